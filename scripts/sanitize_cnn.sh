#!/usr/bin/env bash
# The cnn's kernels (kernels/cnn.cu, kernels/optim.cu) and cuDNN's passes under compute-sanitizer:
# memcheck for all, racecheck and synccheck for the kernels with shared memory (the fixed-order
# reductions, the optimizer's last-block count). Usage (GPU machine): scripts/sanitize_cnn.sh OUT_DIR
set -uo pipefail
out=${1:?usage: scripts/sanitize_cnn.sh OUT_DIR}
mkdir -p "$out"
status=0
for run in "memcheck adam" "memcheck momentum" "racecheck adam" "synccheck adam"; do
  set -- $run
  if compute-sanitizer --tool "$1" --report-api-errors no --error-exitcode 99 python3 scripts/cnn_check.py "$2" > "$out/$1-$2.log" 2>&1; then
    echo "ok      $1 $2"
  else
    echo "FAILED  $1 $2 (see $1-$2.log)"; status=1
  fi
done
exit $status
