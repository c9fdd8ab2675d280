#!/usr/bin/env bash
# Time to result, one round on a GPU machine: each row's wall against its record's phases (warm,
# one epoch, empty kernel cache), the phases before and after (persistent, graphs, numpy, against
# the committed before table), what a process's end costs after its last line, and where the
# graphs and device-loop setups go with their variants (scripts/probes/graphs_setup.py).
# Writes two files into OUT: summary.md (every table, in that order) and time-to-result.tgz
# (each table's .md and .json, the probes' .json).
#   scripts/benchmarks/phases_round.sh OUT [REPEAT]
# From the tree, GRAPHTRAIN_DATA set (and GRAPHTRAIN_REVISION where the tree is a copy without git).
set -euo pipefail
out=$(realpath -m "$1"); repeat=${2:-5}
before=results/time-to-result/wall-jhu-h100-before.json
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$out" "$work/warm" "$work/one" "$work/cold"
python3 scripts/benchmarks/wall.py --stages persistent,device-loop,graphs,numpy --repeat "$repeat" \
    --out "$work/warm" > /dev/null
python3 scripts/benchmarks/phases_table.py "$before" "$work"/warm/wall-*.json --out "$work/phases.md" > /dev/null
python3 scripts/benchmarks/wall.py --stages persistent,numpy --epochs 1 --repeat "$repeat" --out "$work/one" > /dev/null
python3 scripts/probes/exit_cost.py --repeat "$repeat" --json "$work/exit-cost.json" > "$work/exit-cost.md"
python3 scripts/probes/graphs_setup.py --repeat "$repeat" --json "$work/graphs-setup.json" > "$work/graphs-setup.md"
python3 scripts/probes/graphs_setup.py --stage device-loop --variants tree,no-first-use,no-release --no-breakdown \
    --repeat "$repeat" --json "$work/device-loop-setup.json" > "$work/device-loop-setup.md"
python3 scripts/benchmarks/wall.py --stages persistent,device-loop,graphs --cold --repeat 3 --out "$work/cold" > /dev/null
cat "$work"/warm/wall-*.md "$work/phases.md" "$work"/one/wall-*.md "$work/exit-cost.md" "$work/graphs-setup.md" \
    "$work/device-loop-setup.md" "$work"/cold/wall-*.md > "$out/summary.md"
tar -czf "$out/time-to-result.tgz" -C "$work" .
cat "$out/summary.md"
