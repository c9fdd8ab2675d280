#!/usr/bin/env bash
# The GPU suite in parallel (pytest-xdist, one GPU shared by the workers; JAX told not to take the
# GPU's memory up front), then the commands a new user runs first, into OUT_DIR/gpu-suite.log.
#   scripts/checks/gpu_suite.sh OUT_DIR [WORKERS]      (from the tree; GRAPHTRAIN_DATA set)
set -uo pipefail
out=${1:?usage: scripts/checks/gpu_suite.sh OUT_DIR [WORKERS]}; workers=${2:-8}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
log=$out/gpu-suite.log
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -m pytest -m gpu -q -rs -n "$workers" --timeout 600 -p no:benchmark --durations=10 2>&1 | grep -v "^  warner"
  echo "== the first commands"
  scratch=$(mktemp -d)
  python3 -m graphtrain info | head -3
  python3 -m graphtrain run --preset speedrun --stage graphs --save "$scratch/cnn.safetensors" | tail -2
  python3 -m graphtrain eval --model "$scratch/cnn.safetensors" | head -3
  python3 -c "import numpy as np; from graphtrain.data import load; np.save('$scratch/digits.npy', load().test_images[:5])"
  python3 -m graphtrain predict --model "$scratch/cnn.safetensors" "$scratch/digits.npy"
  for stage in graphs device-loop; do
    python3 -m graphtrain run --hidden 128 --stage $stage --optimizer adam --schedule one-cycle --lr 0.01 --epochs 1 | tail -1
  done
  python3 -m graphtrain predict --model "$scratch/cnn.safetensors" "$scratch/digits.npy" --out "$scratch/cnn.safetensors"; echo "exit $?"
  rm -rf "$scratch"
} 2>&1 | tee "$log"
