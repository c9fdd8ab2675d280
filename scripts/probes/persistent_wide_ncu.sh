#!/usr/bin/env bash
# The persistent rung's grid kernel under Nsight Compute: one epoch of the 784³ MLP (jhu preset; the
# first launch, a short warm-up, skipped), its full section set and its warp-state samples by source
# line (built with GRAPHTRAIN_LINEINFO=1, compiled into a cache of its own; sampled every 2^(5+8)
# cycles into a buffer that holds the whole epoch, else the samples stop early in it). The clocks are
# left as they are (--clock-control none). Writes OUT_DIR/details.txt (the sections), OUT_DIR/source.csv
# (CUDA lines with their SASS) and OUT_DIR/lines.md (scripts/probes/ncu_source_lines.py's table).
# Usage: scripts/probes/persistent_wide_ncu.sh OUT_DIR [RUN_ARGS]   (RUN_ARGS: `graphtrain run` options
# that replace the defaults below, e.g. "--preset cuda-mnist --hidden 1024,1024,1024 --steps 2000")
set -euo pipefail
out=$1
run_args=${2:-"--preset jhu --hidden 784,784,784 --epochs 1"}
mkdir -p "$out"
export GRAPHTRAIN_LINEINFO=1 GRAPHTRAIN_CACHE="$out/kernel-cache"
command="python3 -m graphtrain run --stage persistent $run_args"
ncu --clock-control none --set full --import-source yes -k regex:wide_epoch --launch-skip 1 --launch-count 1 \
    --warp-sampling-interval 8 --warp-sampling-buffer-size 536870912 -f -o "$out/wide" $command
ncu -i "$out/wide.ncu-rep" --page details --print-details all > "$out/details.txt"
ncu -i "$out/wide.ncu-rep" --page source --csv --print-source cuda,sass > "$out/source.csv"
python3 scripts/probes/ncu_source_lines.py "$out/source.csv" --title "persistent grid kernel under Nsight Compute: warp samples by source line" \
    --command "scripts/probes/persistent_wide_ncu.sh OUT_DIR${2:+ \"$2\"} ($command)" > "$out/lines.md"
rm -rf "$out/kernel-cache"
