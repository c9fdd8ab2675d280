#!/usr/bin/env bash
# The same sweep on one GPU, on two (one worker process each), and on a local Dask cluster of two
# workers; each timed from process start to exit, every model's weights compared across the three.
# Usage: scripts/benchmarks/multi_gpu_sweep.sh OUT_DIR [sweep options...]
# Default sweep: the 784³ MLP on device-loop, 8 learning rates × 4 seeds, 20 epochs (32 models).
set -uo pipefail
out=${1:?usage: scripts/benchmarks/multi_gpu_sweep.sh OUT_DIR [sweep options...]}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
grid=("$@")
if [ ${#grid[@]} -eq 0 ]; then
  grid=(--stages device-loop --no-peers --hidden 784,784,784 --lrs 0.02,0.04,0.06,0.08,0.1,0.12,0.14,0.16 --seeds 0-3
        --epochs 20)
fi
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$out/gpus.txt"
run() {  # run NAME ENGINE-OPTIONS...: one sweep, its wall time (process start to exit) in NAME.wall
  local name=$1; shift
  local start end
  start=$(date +%s.%N)
  python3 -m graphtrain sweep "${grid[@]}" "$@" --out "$out/$name" --json "$out/$name.json" > "$out/$name.log" 2>&1
  local rc=$?
  end=$(date +%s.%N)
  python3 -c "print(f'{$end - $start:.2f}')" > "$out/$name.wall"
  echo "$name: exit $rc, $(cat "$out/$name.wall") s"
}
run one-gpu --gpus 1
run two-gpus --gpus 2
if python3 -c "import distributed" 2>/dev/null; then
  run dask-local --cluster local --gpus 2
else
  echo "dask-local: skipped (Dask's distributed is not installed)"
fi
python3 - "$out" "${grid[*]}" <<'PY'
import json, sys
from pathlib import Path

out, grid = Path(sys.argv[1]), sys.argv[2]
runs = {}
for name in ("one-gpu", "two-gpus", "dask-local"):
    path = out / f"{name}.json"
    if path.exists():
        runs[name] = (json.loads(path.read_text()), float((out / f"{name}.wall").read_text()))
if "one-gpu" not in runs:
    sys.exit("the one-GPU sweep wrote no records: see one-gpu.log")
base_doc, base_wall = runs["one-gpu"]
base = [r.get("weights_sha256") for r in base_doc["records"]]
from graphtrain import report

gpus = len((out / "gpus.txt").read_text().splitlines())
items = report.provenance_lines(base_doc["records"], f"scripts/benchmarks/multi_gpu_sweep.sh OUT {grid}",
                                report.utc_now())
items += [f"GPUs on this host: {gpus}",
          f"Models: {len(base)}; wall time from process start to exit (setup, worker start-up and data loading included)"]
lines = ["# Sweeps over several GPUs", "", *(f"- {item}" for item in items),
         "", "| engine | wall s | vs one GPU | sum of train ms | failed rows | weights equal to one GPU's |",
         "|---|---:|---:|---:|---:|---|"]
for name, (doc, wall) in runs.items():
    rows = doc["records"]
    digests = [r.get("weights_sha256") for r in rows]
    failed = sum("error" in r for r in rows)
    train = sum(r.get("train_ms") or 0 for r in rows)
    lines.append(f"| {doc['sweep']['engine']} | {wall:.2f} | {wall / base_wall:.2f} | {train:.0f} | {failed} | "
                 f"{'yes' if digests == base and None not in digests else 'NO'} |")
text = "\n".join(lines) + "\n"
print(text)
(out / "multi-gpu-sweep.md").write_text(text)
PY
