#!/usr/bin/env bash
# Setup ms and median epoch ms of the rungs whose setup the structure work changed, for one or more
# source trees side by side (each a folder holding graphtrain/), alternating trees in each round so
# drift hits both; round 0 warms the kernel cache and is not reported.
#   scripts/benchmarks/setup_times.sh OUT_DIR TREE [TREE...]     (GRAPHTRAIN_DATA set to MNIST's folder)
set -euo pipefail
out=$(realpath "$1"); shift
mkdir -p "$out"
runs=("persistent|--stage persistent --preset jhu"
      "persistent-mlp128|--stage persistent --preset cuda-mnist --hidden 128,128,128 --epochs 2"
      "graphs|--stage graphs --preset jhu"
      "device-loop|--stage device-loop --preset jhu")
for round in 0 1 2; do
  echo "round $round" >&2
  for run in "${runs[@]}"; do
    name=${run%%|*}; args=${run#*|}
    for tree in "$@"; do
      tag=$(basename "$tree")
      # shellcheck disable=SC2086
      # From inside the tree: `python -m` puts the working folder first on sys.path.
      (cd "$tree" && PYTHONPATH=$tree python3 -m graphtrain run $args --json "$out/$tag-$name-$round.json" > /dev/null) \
        || echo "$tag $name round $round failed" >&2
    done
  done
done
python3 - "$out" "$@" <<'PY'
import json, statistics, sys
from pathlib import Path
out, trees = Path(sys.argv[1]), [Path(t).name for t in sys.argv[2:]]
names = ["persistent", "persistent-mlp128", "graphs", "device-loop"]
print("| run | tree | setup ms (rounds 1, 2) | median epoch ms (rounds 1, 2) | precision | test acc |")
print("|---|---|---|---|---|---|")
for name in names:
    for tree in trees:
        recs = [json.loads(p.read_text()) for p in (out / f"{tree}-{name}-{r}.json" for r in (1, 2)) if p.exists()]
        if not recs:
            continue
        setup = ", ".join(f"{r['setup_ms']:.1f}" for r in recs)
        epoch = ", ".join(f"{r['epoch_ms']:.3f}" for r in recs)
        print(f"| {name} | {tree} | {setup} | {epoch} | {recs[-1]['precision']} | {recs[-1]['test_accuracy']:.4f} |")
PY
