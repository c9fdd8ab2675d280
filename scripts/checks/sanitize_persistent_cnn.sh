#!/usr/bin/env bash
# The persistent rung's cnn kernel (kernels/persistent_cnn.cu, tf32) under compute-sanitizer:
# memcheck, racecheck and synccheck (shared memory, cp.async copies, grid barriers), each over
# scripts/checks/persistent_cnn.py's smoke epoch on 1200 images (five steps, the last a tail of 176
# rows: a launch's first step computes the conv fragments, the later ones copy them) and its test
# accuracy. Usage (GPU machine): scripts/checks/sanitize_persistent_cnn.sh OUT_DIR
set -uo pipefail
out=${1:?usage: scripts/checks/sanitize_persistent_cnn.sh OUT_DIR}
mkdir -p "$out"
status=0
# Library API probes (cuGetProcAddress of entry points the driver lacks) are not reported.
for tool in memcheck racecheck synccheck; do
  if compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 99 \
      python3 scripts/checks/persistent_cnn.py --steps 1200 > "$out/$tool.log" 2>&1; then
    echo "ok      $tool"
  else
    echo "FAILED  $tool (see $tool.log)"; status=1
  fi
done
exit $status
