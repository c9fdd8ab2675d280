#!/usr/bin/env bash
# On a GPU machine: the GPU tests, then every stage on the jhu preset and on a 784-784-784 MLP,
# each writing its run record. Usage: scripts/checks/gpu-check.sh OUT_DIR [pytest args...]
set -uo pipefail
out=${1:?usage: scripts/checks/gpu-check.sh OUT_DIR}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -m pytest -m gpu -q -rs "$@" 2>&1 | tee "$out/pytest-gpu.log" | tail -n 25
rungs=$(python3 -c 'from graphtrain.stages import LADDER; print(*LADDER)')  # the registry's rungs, in order
for model in jhu mlp; do
  extra=(); [ "$model" = mlp ] && extra=(--hidden 784,784,784)
  for stage in $rungs; do
    python3 -m graphtrain run --stage "$stage" --preset jhu "${extra[@]}" --json "$out/$model-$stage.json" \
      > "$out/$model-$stage.log" 2>&1 || echo "FAILED: $model $stage (see $model-$stage.log)"
    python3 - "$out/$model-$stage.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except OSError:
    sys.exit(0)
print(f"{r['config']['dims']!s:28} {r['stage']:15} epoch {r['epoch_ms']:9.2f} ms  total {r['total_ms']:9.0f} ms  "
      f"test acc {100 * r['test_accuracy']:.2f}%")
PY
  done
done 2>&1 | tee "$out/runs.txt"
