"""persistent_cnn.cu run on the CPU: its source compiled by the host's C++ compiler with the CUDA
features it uses emulated (cuda_on_cpu/prelude.h and tf32.h: a thread per CUDA thread, a warp's TF32
mma.sync and shuffles computed from its lanes' registers as PTX lays them out, block and grid barriers
of threads), a few steps of small cnns against reference_cnn's float64 steps, and its evaluation
against reference_cnn's accuracy. What the emulation cannot show (the GPU's memory order, its timing)
test_persistent_cnn_gpu.py does."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from cnn_reference import float64_step
from emulation import LDMATRIX_ASM, MMA_ASM, MMA_K4_ASM, compile_for_cpu, kernel_text
from helpers import rel_err

from graphtrain import reference_cnn
from graphtrain.kernels.optim import constants_of
from graphtrain.kernels.persistent_cnn import CnnShape
from graphtrain.reference_cnn import CnnSpec, ConvLayer, Optimizer, Schedule

# The float64 steps round what the kernel rounds (the convolutions' forward products', conv 2's
# backward ones' and fc1's operands to TF32 where it takes one pass; in three, each operand is split hi + lo and only lo·lo, ~2⁻²² of a term, is dropped), so what
# is left is fp32 against float64: sums in another order (~1e-7 of a gradient), and the stored fp32
# weights, rounded by 2⁻²⁴ of |w| ≤ 0.5 each step against updates of about the rate (~1e-2 at the
# schedule's peak, 4e-4 at its start): up to ~3e-5 of an update, far less in norm. Adam divides m by √v,
# so an update errs as its gradient does unless a ReLU mask or a pool's argmax flips (a value within
# ~1e-7 of 0 or of its window's others: none expected among these few thousand). A wrong index,
# fragment, mask, rounding or step errs by 1e-3 (a TF32 rounding missed) to order 1.
BOUND = 1e-4
# In one pass the convolutions' forward operands are TF32 too (the images, conv 1's output a1, both
# layers' weights): where the kernel's fp32 a1 or a2 lies within fp32's error of a TF32 rounding
# midpoint, it rounds the other way from float64's (by 2⁻¹⁰ of itself), and at a batch of 4 one such
# operand moves an update by up to ~1e-4. Measured on the one-pass cases, seeds 0–2: ≤ 4e-7
# (speedrun-geometry), 4.4e-5 (tf32-tiles), 7.9e-5 (speedrun-maps); without the convolutions' roundings
# in float64 the same cases err by 7e-4 to 8e-2.
ONE_PASS_BOUND = 2e-4


def build(shape: CnnShape, folder) -> str:
    optim = kernel_text("optim.cu")
    optim = optim[:optim.index('__device__ __forceinline__ void optimizer_step_body')]  # its struct and schedule only
    source = kernel_text("probes.cuh", "grid_sync.cuh", "batched_loads.cuh", "tf32_mma.cuh", "logits_loss.cuh") + optim
    source, found = MMA_ASM.subn("mma_tf32_emulated(d, a, b);", source + kernel_text("persistent_cnn.cu"))
    assert found == 1, "tf32_mma.cuh's mma_tf32 is no longer the one asm statement the emulation replaces"
    source, found = MMA_K4_ASM.subn("mma_tf32_k4_emulated(d, a, b);", source)
    assert found == 1, "tf32_mma.cuh's mma_tf32_k4 is no longer the one asm statement the emulation replaces"
    source, found = LDMATRIX_ASM.subn("ldmatrix_tf32_emulated(a, row);", source)
    assert found == 1, "tf32_mma.cuh's ldmatrix_tf32 is no longer the one asm statement the emulation replaces"
    return compile_for_cpu(source, "persistent_cnn.cu", {**shape.defines, "WS_BYTES": shape.workspace.bytes}, "tf32.h",
                           "cnn_launch.inc", folder)


def spec_of(shape: CnnShape) -> CnnSpec:
    return CnnSpec((ConvLayer(shape.c1, shape.k1), ConvLayer(shape.c2, shape.k2)), (shape.hidden,), shape.classes,
                   1, shape.image, shape.image)


# (shape, samples per epoch, [(steps, first step)] a launch each, test images)
CASES = {
    # 14×14 images: conv 3×3 → 12 → 6, conv 3×3 → 4 → 2; 24 features, 40 units (a part tile of 32),
    # batch 8 over 4 blocks (two samples each), 20 samples: steps of 8, 8 and a tail of 4; two launches,
    # the first of three steps (the last of them writes the second copy of W1, copied back), the second
    # from step 3 over another order; the test images in passes of 8, the last of 3.
    "small": (CnnShape(14, 4, 3, 6, 3, 40, 10, 8, passes=3, blocks=4), 20, [(3, 0), (2, 3)], 19),
    # the same with the products' operands in chunks of 8 inputs, 2 in flight: fc1's 24 features in 3
    # chunks (the ring's second round stops after its first), dW1's 8 rows in one
    "small-chunks": (CnnShape(14, 4, 3, 6, 3, 40, 10, 8, passes=3, blocks=4, kc=8, prefetch=2), 20, [(3, 0), (2, 3)],
                     19),
    # the speedrun's geometry (28 → 24 → 12 → 10 → 5, 5×5 then 3×3), few maps: 75 features, 36 units,
    # 7 classes, batch 6 over 3 blocks; one launch of three steps (6, 6, a tail of 2) from step 40 of
    # the schedule, one pass (TF32).
    "speedrun-geometry": (CnnShape(28, 2, 5, 3, 3, 36, 7, 6, passes=1, blocks=3), 14, [(3, 40)], 6),
    # one pass, phase 1's tensor-core tiles past one of each: 12 maps of 3×3 (2 k-steps of 9 taps and
    # 7 zeros, 2 n-tiles, 5 groups of windows, the last of 4), then 10 maps from 2 channel groups (the
    # second of 4 channels and 4 zeros; 2 n-tiles, 1 group of 4 windows); batch 8 over 4 blocks
    "tf32-tiles": (CnnShape(14, 12, 3, 10, 3, 40, 10, 8, passes=1, blocks=4), 20, [(3, 0), (2, 3)], 19),
    # one pass, the speedrun's conv layers (24 maps 5×5, 32 maps 3×3: conv 2's items half its n-tiles),
    # a small head; batch 4 over 2 blocks, two steps
    "speedrun-maps": (CnnShape(28, 24, 5, 32, 3, 40, 10, 4, passes=1, blocks=2), 6, [(2, 0)], 5),
    # one pass, conv 1's 44 maps × 3 rows of taps past half the block's threads: phase 5's conv 1
    # weight gradients in one part, not two halves
    "wide-conv1": (CnnShape(14, 44, 3, 6, 3, 40, 10, 4, passes=1, blocks=2), 6, [(2, 0)], 5),
    # the maps phase 5 reads kept in shared memory for one of a block's two samples, the other's
    # written to the workspace in phase 1 and staged from it (every other case keeps all its maps)
    "one-kept": (CnnShape(14, 4, 3, 6, 3, 40, 10, 8, passes=1, blocks=4, kept_at_most=1), 20, [(3, 0), (2, 3)], 19),
    "none-kept": (CnnShape(14, 4, 3, 6, 3, 40, 10, 8, passes=3, blocks=4, kept_at_most=0), 20, [(3, 0), (2, 3)], 19),
}
# The cases of phase 1's tensor-core tiles and of the kept maps take the speedrun's recipe only (the others' arithmetic
# after phase 1 is the first cases').
TILE_CASES = ("tf32-tiles", "speedrun-maps", "wide-conv1", "one-kept", "none-kept")


# The recipes the device's constants select (test_persistent_cnn_gpu.py's): the speedrun's Adam with its
# one-cycle rate, AdamW (decoupled weight decay) with the cosine schedule, Nesterov momentum with warm-up.
RECIPES = {
    "adam-one-cycle": lambda total: (Optimizer("adam", betas=(0.7, 0.9)), Schedule("one-cycle", 0.01, total)),
    "adamw-cosine": lambda total: (Optimizer("adamw", betas=(0.7, 0.9), weight_decay=5e-4),
                                   Schedule("cosine", 0.01, total)),
    "nesterov-warmup": lambda total: (Optimizer("nesterov", momentum=0.9), Schedule("warmup", 0.05, total,
                                                                                    warmup_steps=2)),
}


@pytest.mark.parametrize("case,recipe", [(case, recipe) for case in CASES for recipe in RECIPES
                                         if case not in TILE_CASES or recipe == "adam-one-cycle"])
def test_steps_match_float64(tmp_path, case, recipe, seed):
    shape, samples, launches, num_test = CASES[case]
    assert shape.refusal() is None
    spec = spec_of(shape)
    program = build(shape, tmp_path)
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((samples, shape.image ** 2)).astype(np.float32)
    labels = rng.integers(0, shape.classes, samples).astype(np.int32)
    test_images = rng.standard_normal((num_test, shape.image ** 2)).astype(np.float32)
    test_labels = rng.integers(0, shape.classes, num_test).astype(np.int32)
    params = reference_cnn.init_params(spec, seed, np.float32)
    total = 100
    optimizer, schedule = RECIPES[recipe](total)
    orders = [rng.permutation(samples).astype(np.int32) for _ in launches]

    # float64: the same steps (fc1's products from TF32-rounded operands in one pass), the optimizer's
    # state carried over the launches
    ref = [p.astype(np.float64) for p in params]
    state = optimizer.init_state(ref)
    loss_sum = correct = 0.0
    for order, (steps, first) in zip(orders, launches):
        for s in range(steps):
            idx = order[s * shape.batch:(s + 1) * shape.batch]
            grads, loss, right = float64_step(spec, ref, images[idx].astype(np.float64), labels[idx],
                                                    shape.passes)
            correct += right
            loss_sum += loss * len(idx)
            optimizer.step(ref, grads, state, first + s + 1, schedule.at(first + s))

    images.tofile(tmp_path / "images.bin")
    labels.tofile(tmp_path / "labels.bin")
    np.concatenate(orders).tofile(tmp_path / "order.bin")
    np.concatenate([p.ravel() for p in params]).astype(np.float32).tofile(tmp_path / "params.bin")
    constants_of(optimizer, schedule).tofile(tmp_path / "constants.bin")
    np.array([(samples, steps, first) for steps, first in launches], np.int32).tofile(tmp_path / "launches.bin")
    test_images.tofile(tmp_path / "test_images.bin")
    test_labels.tofile(tmp_path / "test_labels.bin")
    proc = subprocess.run([program, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr

    out = np.fromfile(tmp_path / "out.bin", np.float32)
    at = 0
    names = ["conv 1 W", "conv 1 b", "conv 2 W", "conv 2 b", "fc1 W", "fc1 b", "fc2 W", "fc2 b"]
    errors = {}
    for name, start, want in zip(names, params, ref):
        got = out[at:at + start.size].reshape(start.shape)
        at += start.size
        errors[name] = rel_err(got - start, want - start)
    assert at == out.size
    bound = ONE_PASS_BOUND if shape.passes == 1 else BOUND
    assert max(errors.values()) < bound, f"seed {seed}: ‖Δout − Δref‖/‖Δref‖ by parameter {errors}"
    metrics = np.fromfile(tmp_path / "metrics.bin", np.float64)
    assert abs(metrics[0] - loss_sum) < 1e-4 * loss_sum and abs(metrics[1] - correct) <= 1, \
        f"seed {seed}: metrics {metrics}, float64 {loss_sum, correct}"
    want_correct = int((reference_cnn.logits(spec, ref, test_images.astype(np.float64)).argmax(axis=1)
                        == test_labels).sum())
    got_correct = np.fromfile(tmp_path / "correct.bin", np.float64)[0]
    assert abs(got_correct - want_correct) <= 1, f"seed {seed}: {got_correct} test images right, float64 {want_correct}"
