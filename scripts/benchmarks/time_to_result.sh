#!/usr/bin/env bash
# Time to result (issue: `graphtrain run` to a trained model in well under a second): the process
# wall of each row, warm caches, one epoch, and an empty kernel cache, into OUT_DIR (scripts/benchmarks/wall.py
# writes each table with its header), then `run --help`'s imports.
#   scripts/benchmarks/time_to_result.sh OUT_DIR [REPEAT [COLD_REPEAT]]   (run from the tree; GRAPHTRAIN_DATA set)
set -euo pipefail
out=$(realpath -m "$1"); repeat=${2:-3}; cold_repeat=${3:-$repeat}
mkdir -p "$out"
python3 scripts/benchmarks/wall.py --stages persistent,device-loop,graphs,numpy --repeat "$repeat" --out "$out"
python3 scripts/benchmarks/wall.py --stages persistent,numpy --epochs 1 --repeat "$repeat" --out "$out"
python3 scripts/benchmarks/wall.py --stages persistent,device-loop,graphs --cold --repeat "$cold_repeat" --out "$out"
python3 -X importtime -m graphtrain run --help 2> "$out/importtime-run-help.txt" > /dev/null
