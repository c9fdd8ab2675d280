#!/usr/bin/env bash
# The new rungs' kernels under compute-sanitizer: memcheck for every rung from `fused` on, and
# racecheck and synccheck (shared memory, clusters) for the fused head kernels and the persistent
# cluster kernels. A few steps each: the tools slow kernels down by orders of magnitude.
# Usage (GPU machine, MNIST reachable): scripts/checks/sanitize.sh OUT_DIR [persistent | wide]
# With `persistent`, only the persistent kernels: memcheck over one whole epoch of each build
# (softmax regression, jhu; the MLP at H = 128), then racecheck and synccheck as below (a few
# steps: under racecheck an epoch of the cluster kernels takes hours). With `wide`, only the grid
# kernel's (persistent_wide.cu) checks, in each of its builds, which both other modes run too.
set -uo pipefail
out=${1:?usage: scripts/checks/sanitize.sh OUT_DIR [persistent | wide]}
only=${2:-}
mkdir -p "$out"
status=0
short=(--steps 3)
# `graphtrain run` with the grid kernel built as $variant (persistent_wide.VARIANTS; the rung's
# default where unset), which no option of the command chooses
# ("registers:1": the registers build loading 1 k-step ahead, persistent_wide.DEFAULT_PREFETCH; a third
# field, the blocks a cluster: GRID_CHOICES narrowed to its grids)
as_variant='import sys; from graphtrain.kernels import persistent_wide as w; build, ahead, split = (sys.argv.pop(1) + "::").split(":")[:3]; w.DEFAULT_VARIANT = build; w.DEFAULT_PREFETCH = int(ahead or w.DEFAULT_PREFETCH); w.GRID_CHOICES = tuple(c for c in w.GRID_CHOICES if not split or c[1] == int(split)); from graphtrain.__main__ import main; main()'
sanitize() {  # sanitize TOOL NAME graphtrain-run-args... (the run's length among them)
  local tool=$1 name=$2; shift 2
  local graphtrain=(python3 -m graphtrain)
  if [ -n "${variant:-}" ]; then graphtrain=(python3 -c "$as_variant" "$variant"); fi
  if timeout "${limit:-0}" compute-sanitizer --tool "$tool" --report-api-errors no --num-cuda-barriers 64 --error-exitcode 99 "${graphtrain[@]}" run "$@" \
      > "$out/$tool-$name.log" 2>&1; then
    echo "ok      $tool $name"
  else
    echo "FAILED  $tool $name (see $tool-$name.log)"; status=1
  fi
}
check() { sanitize "$@" "${short[@]}"; }  # check TOOL NAME graphtrain-run-args...: a few steps
mnist_300() {  # the first 300 training samples of MNIST (and 100 test ones), for a short last step
  python3 - "$out/mnist-300.npz" <<'PY'
import sys
import numpy as np
from graphtrain import data
d = data.load("mnist")
pixels = lambda images: np.rint(images * 255).astype(np.uint8)  # the loader's floats back to bytes
np.savez(sys.argv[1], x_train=pixels(d.train_images[:300]), y_train=d.train_labels[:300],
         x_test=pixels(d.test_images[:100]), y_test=d.test_labels[:100])
PY
}
# The grid kernel (persistent_wide.cu, the MLPs too wide for one cluster): hidden layers of 72 units,
# off the cluster kernel's multiples of 64, so 10 blocks of 8 units (the last 8 units padding) and
# four grid barriers a step; the cuda-mnist preset's batch of 32, then batch 128 over 300 samples
# (steps of 128, 128 and 44 rows). Each tool sees its global exchanges, its barrier's spin and
# atomics (memcheck), and its block barriers and shared memory (racecheck, synccheck). Each build of
# the kernel (persistent_wide.VARIANTS): the staged one's copies into its warps' rings (cp.async) and
# their __syncwarp (at batch 128 a ring of four slabs, which the 49 k-steps of the images wrap); and
# the registers build loading one k-step ahead beside the default's depth (its ring of fragments in
# registers, refilled in place). The rung's grid is of clusters of two blocks (their sums traded
# through distributed shared memory: racecheck and synccheck see those too); "registers:0:1" checks
# blocks alone (the grid where the GPU runs no clusters).
wide() {
  local limit=600  # seconds a check may take (a grid barrier that never opens fails it, not the script)
  local variant
  for variant in $(python3 -c 'from graphtrain.kernels.persistent_wide import VARIANTS; print(*VARIANTS)') registers:1 registers:0:1; do
    for tool in memcheck racecheck synccheck; do
      check "$tool" "persistent-wide-$variant" --stage persistent --preset cuda-mnist --hidden 72,72
      sanitize "$tool" "persistent-wide-tail-$variant" --stage persistent --hidden 72,72 --data "$out/mnist-300.npz" --epochs 1
    done
  done
}
if [ "$only" = wide ]; then
  mnist_300
  wide
  exit $status
fi
if [ "$only" = persistent ]; then
  for precision in bf16 fp32; do
    sanitize memcheck "persistent-epoch-$precision" --stage persistent --precision $precision --epochs 1
    sanitize memcheck "persistent-mlp128-epoch-$precision" --stage persistent --preset cuda-mnist --hidden 128,128,128 \
      --precision $precision --epochs 1
    check racecheck "persistent-$precision" --stage persistent --precision $precision
    check synccheck "persistent-$precision" --stage persistent --precision $precision
    check racecheck "persistent-mlp64-$precision" --stage persistent --preset cuda-mnist --hidden 64,64,64 --precision $precision
    check synccheck "persistent-mlp128-$precision" --stage persistent --preset cuda-mnist --hidden 128,128,128 --precision $precision
  done
  mnist_300
  wide
  exit $status
fi
# the rungs after the chain up to persistent (the fused step's kernels), from the row registry
fused_rungs=$(python3 -c 'from graphtrain.stages import CHAIN_END, LADDER as L; print(*L[L.index(CHAIN_END) + 1:L.index("persistent")])')
for stage in $fused_rungs; do
  check memcheck "$stage-mlp" --stage "$stage" --hidden 256,128
  check memcheck "$stage-jhu" --stage "$stage"
done
check memcheck persistent --stage persistent
check memcheck persistent-b100 --stage persistent --batch 100  # a batch of whole tiles plus a part
check memcheck persistent-fp32 --stage persistent --precision fp32  # the TF32-pass build
check memcheck persistent-b100-fp32 --stage persistent --batch 100 --precision fp32
# The persistent MLP kernel: three hidden layers (six exchanges a step) and one (whose only
# exchanges are the logits' two), the cuda-mnist preset's batch; at H = 256 the batch's images
# do not fit in shared memory and are read from global memory twice a step. racecheck takes the
# three layers at H = 64 (at 128 it needs minutes). Its own build (bf16 products), then the fp32
# one (TF32 passes, the images as bytes).
persistent_mlp=(--stage persistent --preset cuda-mnist)
for tool in memcheck synccheck; do
  check "$tool" persistent-mlp "${persistent_mlp[@]}" --hidden 128,128,128
done
for tool in memcheck racecheck synccheck; do
  check "$tool" persistent-mlp1 "${persistent_mlp[@]}" --hidden 64
done
check racecheck persistent-mlp64 "${persistent_mlp[@]}" --hidden 64,64,64
check memcheck persistent-mlp256 "${persistent_mlp[@]}" --hidden 256,256,256
for h in 128 256; do
  check memcheck "persistent-mlp$h-fp32" "${persistent_mlp[@]}" --hidden $h,$h,$h --precision fp32
done
check racecheck persistent-mlp64-fp32 "${persistent_mlp[@]}" --hidden 64,64,64 --precision fp32
for tool in racecheck synccheck; do
  check "$tool" fused-mlp --stage fused --hidden 256,128
  check "$tool" persistent --stage persistent
  check "$tool" persistent-fp32 --stage persistent --precision fp32
done
# A short last step (300 samples at batch 128: steps of 128, 128 and 44 rows), whose rows past
# the batch the softmax kernel zeroes before phase C reads them.
mnist_300
check racecheck persistent-tail --stage persistent --data "$out/mnist-300.npz"
check memcheck persistent-tail --stage persistent --data "$out/mnist-300.npz"
check racecheck persistent-tail-fp32 --stage persistent --data "$out/mnist-300.npz" --precision fp32
wide
exit $status
