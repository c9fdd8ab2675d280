#!/usr/bin/env bash
# On a GPU machine: the cnn's GPU tests, the conv passes and the step profile, the speedrun table
# (10 seeds, graphtrain's rows and the peers, each also timed as its own process), `run --preset
# speedrun` start to exit, and the cnn kernels under compute-sanitizer. Usage: scripts/checks/speedrun_check.sh OUT_DIR
# The speedrun tables go to results/ (speedrun-h100.*, speedrun-cudnn-h100.*: name them for another
# GPU by hand) and are copied into OUT_DIR.
# (a tree copied out of its checkout: set GRAPHTRAIN_REVISION to its commit for the results' header)
set -uo pipefail
out=${1:?usage: scripts/checks/speedrun_check.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -m pytest -q -m gpu tests/test_convpool_gpu.py tests/test_cnn_gpu.py 2>&1 | tail -n 30 > "$out/pytest-cnn-gpu.log"
tail -n 3 "$out/pytest-cnn-gpu.log"
python3 scripts/probes/convpool_passes.py 2>&1 | tee "$out/conv-passes.txt"
python3 scripts/probes/cnn_step_profile.py 2>&1 | grep -v "timed (algo" | tee "$out/step-profile.txt"
python3 -m graphtrain speedrun --seeds 10 --stages device-loop,graphs --peer torch-graph,jax-scan,torch-compile,torch-eager \
  --json results/speedrun-h100.json --markdown results/speedrun-h100.md > "$out/speedrun.log" 2>&1
tail -n 30 "$out/speedrun.log"
python3 -m graphtrain speedrun --seeds 3 --stages device-loop,graphs --peer none --conv-path cudnn --no-process-wall \
  --json results/speedrun-cudnn-h100.json --markdown results/speedrun-cudnn-h100.md > "$out/speedrun-cudnn.log" 2>&1
cp results/speedrun-h100.* results/speedrun-cudnn-h100.* "$out/"
grep -E "device-loop|graphs" "$out/speedrun-cudnn.log" | head -n 4
start=$(date +%s.%N)
python3 -m graphtrain run --preset speedrun --stage device-loop > "$out/run-speedrun.log" 2>&1
end=$(date +%s.%N)
echo "run --preset speedrun --stage device-loop: $(python3 -c "print(f'{$end - $start:.2f}')") s, start to exit" \
  | tee -a "$out/run-speedrun.log"
bash scripts/checks/sanitize_cnn.sh "$out/sanitize"
