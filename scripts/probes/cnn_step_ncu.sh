#!/usr/bin/env bash
# The packed speedrun step's convolution kernels under Nsight Compute: one step of K models
# (default 64, a sweep's pack) run eagerly after a warm-up step (cnn_step_profile.py --once), its
# five convpool_tc launches profiled with the full section set and their SASS-level stall samples.
# The clocks are left as they are (--clock-control none).
# Usage: scripts/probes/cnn_step_ncu.sh OUT_DIR [MODELS]
set -euo pipefail
out=$1
models=${2:-64}
mkdir -p "$out"
kernels='regex:convpool_tc_(forward|backward_data|weight_grad)'
ncu --clock-control none --set full --import-source yes -k "$kernels" --launch-skip 5 --launch-count 5 \
    -f -o "$out/step" python3 scripts/probes/cnn_step_profile.py --models "$models" --once
ncu -i "$out/step.ncu-rep" --page details --print-details all > "$out/details.txt"
ncu -i "$out/step.ncu-rep" --page source --csv --print-source sass > "$out/source.csv"
