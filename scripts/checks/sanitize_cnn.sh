#!/usr/bin/env bash
# The cnn's kernels (kernels/convpool_tc.cu at tf32, kernels/convpool.cu at fp32, kernels/cnn.cu,
# kernels/optim.cu) and cuDNN's passes under compute-sanitizer: memcheck for all, racecheck and
# synccheck for the kernels with shared memory (the staged samples and filters, the fixed-order
# reductions, the optimizer's last-block count), at both precisions; then the persistent rung's kernel.
# Usage (GPU machine): scripts/checks/sanitize_cnn.sh OUT_DIR [persistent]   (persistent: its checks alone)
set -uo pipefail
out=${1:?usage: scripts/checks/sanitize_cnn.sh OUT_DIR [persistent]}
only=${2:-}
mkdir -p "$out"
status=0
if [ "$only" != persistent ]; then
  # Library API probes (cuGetProcAddress of entry points the driver lacks) are not reported.
  # racecheck without the device loop (the step graph replayed covers the same kernels).
  for run in "memcheck adam" "racecheck adam no-loop" "synccheck adam no-loop" "memcheck adam fp32 no-loop" \
      "racecheck adam fp32 no-loop" "memcheck momentum cudnn"; do
    set -- $run
    tool=$1; shift
    name="$tool-$(IFS=-; echo "$*")"
    if compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 99 python3 scripts/checks/cnn_check.py "$@" \
        > "$out/$name.log" 2>&1; then
      echo "ok      $name"
    else
      echo "FAILED  $name (see $name.log)"; status=1
    fi
  done
  # convpool_tc on a model axis (the packed launcher: rounds of samples, two m-tiles an item, the weight
  # gradient's slices of chunks), once as built and once without the forward's m16n8k4 tail (FORWARD_TAIL_K4).
  for tail in False True; do
    for tool in memcheck racecheck synccheck; do
      name="$tool-axis-tail-k4-$tail"
      if compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 99 python3 scripts/probes/variant.py \
          graphtrain.kernels.convpool_tc.FORWARD_TAIL_K4=$tail -- scripts/checks/convpool_axis.py 34 32 > "$out/$name.log" 2>&1; then
        echo "ok      $name"
      else
        echo "FAILED  $name (see $name.log)"; status=1
      fi
    done
  done
fi
# The persistent rung's grid kernel (kernels/persistent_cnn.cu): an epoch of 200 images at batch 128
# (a step and a tail of 72) and the evaluation of 100 (one pass of part of a batch): every phase and barrier
# of a step (the second copies the conv fragments phase 6 wrote, with cp.async); racecheck for its shared
# memory (the staged tiles, the samples' maps, the conv gradient sums), synccheck for its block barriers
# inside the grid's.
for tool in memcheck racecheck synccheck; do
  name="$tool-persistent"
  if compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 99 \
      python3 scripts/checks/persistent_cnn.py --steps 200 > "$out/$name.log" 2>&1; then
    echo "ok      $name"
  else
    echo "FAILED  $name (see $name.log)"; status=1
  fi
done
exit $status
