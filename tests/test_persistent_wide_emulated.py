"""persistent_wide.cu run on the CPU: its source compiled by the host's C++ compiler with the CUDA
features it uses emulated (cuda_on_cpu/prelude.h: a thread per CUDA thread, a warp's mma.sync,
movmatrix and shuffles computed from its lanes' registers as PTX lays them out, block and grid
barriers of threads), a few steps of small shapes against the float64 run with the kernel's bf16
roundings (bf16_reference.py). What the emulation cannot show (the GPU's memory order, its timing)
test_persistent_wide_gpu.py does."""

from __future__ import annotations

import dataclasses
import subprocess

import numpy as np
import pytest
from bf16_reference import bf16_reference_steps
from emulation import compile_for_cpu, kernel_text
from helpers import rel_err

from graphtrain import reference
from graphtrain.config import TrainConfig
from graphtrain.data import Dataset
from graphtrain.kernels.persistent import kernel_images, pixel_levels
from graphtrain.kernels.persistent_wide import THREADS, WideShape

# The kernel's sums are fp32 in an order of its own (the emulated mma's in double): a bf16 rounding
# or a ReLU mask they flip moves a value by 2⁻⁹ of itself or more. A wrong fragment, index or step
# errs by order 1, and bf16's roundings (which the reference mirrors) by ~5e-2.
BOUND = 1e-3


def build(shape: WideShape, folder) -> str:
    source = kernel_text("probes.cuh", "grid_sync.cuh", "batched_loads.cuh", "logits_loss.cuh", "persistent_wide.cu")
    return compile_for_cpu(source, "persistent_wide.cu", {"THREADS": THREADS, **shape.defines, "WS_BYTES": shape.workspace.bytes},
                           "prelude.h", "launch.inc", folder)


def run_emulated(shape: WideShape, cfg: TrainConfig, data: Dataset, steps: int, folder) -> tuple[list, np.ndarray]:
    """The kernel built for `shape` and run on the CPU from the float64 run's initial weights, one
    launch of `steps` steps an epoch: (each parameter after, in the stage's order; the metrics)."""
    folder.mkdir(exist_ok=True)
    program = build(shape, folder)
    start = reference.init_params(cfg.dims, cfg.bias, cfg.seed, np.float64)
    kernel_images(data.train_images, shape).tofile(folder / "images.bin")
    data.train_labels.astype(np.int32).tofile(folder / "labels.bin")
    samples = len(data.train_images)
    orders = [reference.epoch_order(cfg.seed, epoch, samples) for epoch in range(cfg.epochs)]
    np.concatenate(orders).astype(np.int32).tofile(folder / "order.bin")
    for i, layer in enumerate(start):
        layer.w.astype(np.float32).tofile(folder / f"p{i}.bin")
        (layer.b if cfg.bias else np.zeros(1)).astype(np.float32).tofile(folder / f"p{i + len(start)}.bin")
    proc = subprocess.run([program, str(folder), str(samples), str(steps), repr(cfg.lr), str(int(cfg.bias)), "1",
                           str(cfg.epochs)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    params = [np.fromfile(folder / f"out{i}.bin", np.float32) for i in range(2 * len(start))]
    return params, np.fromfile(folder / "metrics.bin", np.float64)


@pytest.mark.parametrize("split,features", [(1, 400), (2, 784)])
def test_the_staged_build_gives_the_registers_builds_bits(tmp_path, seed, split, features):
    """The staged build (each warp's k-steps copied ahead into a ring in shared memory) against the
    registers build and float64: 400 features (25 k-steps: warp 0 takes four, so a ring of three
    slabs wraps), three hidden layers of 144 units in 9 blocks of 16 (the published weights staged
    beside the rows), batch 24 over 60 samples (steps of 24, 24 and 12 rows: the images' rows past
    a step copied as zeros); and in 9 clusters of two blocks of 8 units (split 2) with 784 features
    (a block's 25 or 24 k-steps: warp 0 again takes four). The same fragments in the same order: the
    same bits."""
    samples, steps = 60, 3
    data = Dataset.synthetic(samples, 10, seed=seed, num_features=features)
    data = dataclasses.replace(data, train_images=np.rint(data.train_images * 255).astype(np.float32) / np.float32(255))
    cfg = TrainConfig(hidden=(144,) * 3, batch=24, epochs=1, lr=0.1, seed=seed, in_features=features)
    registers = WideShape(features, cfg.hidden, 10, cfg.batch, 255, units=16, split=split, variant="registers")
    staged = dataclasses.replace(registers, variant="staged", stage_slabs=3)
    assert staged.refusal() is None and staged.defines["STAGE_DEPTH"] == 3 and registers.defines["STAGE_DEPTH"] == 0
    assert staged.shared_bytes > registers.shared_bytes
    want, want_metrics = run_emulated(registers, cfg, data, steps, tmp_path / "registers")
    got, got_metrics = run_emulated(staged, cfg, data, steps, tmp_path / "staged")
    start, after, loss, _ = bf16_reference_steps(cfg, data, steps, 255)
    assert abs(got_metrics[0] - loss) < BOUND * loss, f"seed {seed}: {got_metrics}"
    for i, s in enumerate(start):  # (the staged build checked against float64 too: both builds wrong alike fail here)
        assert rel_err(got[i].reshape(s.w.shape) - s.w, after[i].w - s.w) < BOUND, f"seed {seed}: layer {i + 1}'s weights"
    for i, (a, b) in enumerate(zip(got, want)):
        assert np.array_equal(a, b), f"seed {seed}: parameter {i} differs between the builds"
    assert np.array_equal(got_metrics, want_metrics), f"seed {seed}"


@pytest.mark.parametrize("prefetch", [2, 3])
def test_loads_further_ahead_give_the_same_bits(tmp_path, seed, prefetch):
    """The registers build with `prefetch` k-steps of loads in flight against one: 400 features
    (25 k-steps: warp 0 takes four, so a ring of two or three slots wraps and a warp's last
    k-steps have none left to load), three hidden layers of 144 units in 9 blocks of 16 (9 k-steps:
    warp 0 takes two), batch 24 over 60 samples. The same fragments in the same order: the same bits."""
    samples, steps, features = 60, 3, 400
    data = Dataset.synthetic(samples, 10, seed=seed, num_features=features)
    data = dataclasses.replace(data, train_images=np.rint(data.train_images * 255).astype(np.float32) / np.float32(255))
    cfg = TrainConfig(hidden=(144,) * 3, batch=24, epochs=1, lr=0.1, seed=seed, in_features=features)
    one = WideShape(features, cfg.hidden, 10, cfg.batch, 255, units=16, variant="registers", prefetch=1)
    ahead = dataclasses.replace(one, prefetch=prefetch)
    assert ahead.defines["PREFETCH"] == prefetch and one.defines["PREFETCH"] == 1
    want, want_metrics = run_emulated(one, cfg, data, steps, tmp_path / "one")
    got, got_metrics = run_emulated(ahead, cfg, data, steps, tmp_path / "ahead")
    for i, (a, b) in enumerate(zip(got, want)):
        assert np.array_equal(a, b), f"seed {seed}: parameter {i} differs with {prefetch} k-steps ahead"
    assert np.array_equal(got_metrics, want_metrics), f"seed {seed}"


@pytest.mark.parametrize("hidden,batch,samples,features,classes,bias,eight_bit,units,split,epochs", [
    ((144,) * 3, 32, 80, 160, 10, True, True, 16, 1, 1),
    ((136,) * 2, 24, 60, 200, 10, True, False, 8, 1, 2),
    ((32,), 32, 80, 32, 32, False, True, 16, 1, 1),
    ((32,), 464, 1160, 32, 10, True, True, 16, 1, 1),
    ((144,) * 3, 32, 80, 160, 10, True, True, 16, 2, 1),
    ((136,) * 2, 24, 60, 200, 10, True, False, 16, 2, 2),
    ((32,), 32, 80, 32, 32, False, True, 16, 2, 1),
])
def test_steps_match_float64_with_the_kernels_roundings(tmp_path, hidden, batch, samples, features, classes, bias,
                                                        eight_bit, units, split, epochs, seed):
    """Three hidden layers of 144 units in 9 blocks of 16 (9 k-steps of 16 a hidden product and 10 of
    the 160 features: every warp takes one, the first two, each loading its next while it
    multiplies), 8-bit pixels, a last step of 16 rows; two layers of 136 units in 18 blocks of 8 (the
    last 8 units padding), batch 24 (part tiles of rows), 200 features (padded to 208) as floats
    rounded to bf16, two epochs (the parameters reloaded, the metrics summed); one layer of 32 in 2
    blocks of 16, 32 classes (a warp's every lane), no bias; and at batch 464, 232 rows a block owns
    (more than a block's threads past warp 0 read ahead at once, and x's gather more pieces a thread
    than it holds in registers), the last step of 232 rows. Three steps an epoch. Then in clusters of
    two blocks of 8 units, each multiplying its half of every product's inputs (split 2): 144 units
    (9 hidden k-steps: 5 and 4; 160 features: 5 each), 136 units (200 features: 13 k-steps, 7 and 6),
    and one hidden layer (the inputs' split and dh_1 from the head alone)."""
    data = Dataset.synthetic(samples, 10, seed=seed, num_features=features, num_classes=classes)
    if eight_bit:
        data = dataclasses.replace(data, train_images=np.rint(data.train_images * 255).astype(np.float32) / np.float32(255))
    levels = pixel_levels(data.train_images)
    cfg = TrainConfig(hidden=hidden, batch=batch, epochs=epochs, lr=0.1, seed=seed, in_features=features,
                      classes=classes, bias=bias)
    shape = WideShape(features, hidden, classes, batch, levels, units=units, split=split)
    assert shape.refusal() is None and levels == (255 if eight_bit else 0) and shape.defines["SPLIT"] == split
    program = build(shape, tmp_path)
    start, after, loss, correct = bf16_reference_steps(cfg, data, 3, levels, epochs)
    kernel_images(data.train_images, shape).tofile(tmp_path / "images.bin")
    data.train_labels.astype(np.int32).tofile(tmp_path / "labels.bin")
    orders = [reference.epoch_order(seed, epoch, samples) for epoch in range(epochs)]
    np.concatenate(orders).astype(np.int32).tofile(tmp_path / "order.bin")
    for i, layer in enumerate(start):
        layer.w.astype(np.float32).tofile(tmp_path / f"p{i}.bin")
        (layer.b if bias else np.zeros(1)).astype(np.float32).tofile(tmp_path / f"p{i + len(start)}.bin")
    proc = subprocess.run([program, str(tmp_path), str(samples), "3", repr(cfg.lr), str(int(bias)), "1", str(epochs)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    for i, (s, want) in enumerate(zip(start, after)):
        got = np.fromfile(tmp_path / f"out{i}.bin", np.float32).reshape(s.w.shape)
        assert rel_err(got - s.w, want.w - s.w) < BOUND, f"seed {seed}: layer {i + 1}'s weights"
        if bias:
            got_b = np.fromfile(tmp_path / f"out{i + len(start)}.bin", np.float32)
            assert rel_err(got_b - s.b, want.b - s.b) < BOUND, f"seed {seed}: layer {i + 1}'s bias"
    metrics = np.fromfile(tmp_path / "metrics.bin", np.float64)
    assert abs(metrics[0] - loss) < BOUND * loss and abs(metrics[1] - correct) <= 1, f"seed {seed}: {metrics}"


@pytest.mark.parametrize("shape", [
    WideShape(784, (784,) * 3, 10, 128, 255), WideShape(784, (784,) * 3, 10, 128, 255, units=16),
    WideShape(400, (144,) * 3, 10, 24, 255, units=16), WideShape(200, (136,) * 2, 10, 24, units=8),
])
def test_the_master_weights_swizzle_spreads_the_products_over_the_banks(tmp_path, shape):
    """master_swizzle, as the kernel compiled for the CPU computes it, at every unit tile and k-step of
    the products: the B fragments' 16-byte loads and the updates' 4-byte loads and stores of the fp32
    masters hit each bank once (at 784 inputs, rows of 800 floats; at 144 and 136 units the last k-step
    in the half of a row of 32 that the swizzle moves it from), where unswizzled rows of whole rows of
    the banks put a load phase's two units on one half and an update's four lanes t on one bank."""
    source = kernel_text("probes.cuh", "grid_sync.cuh", "batched_loads.cuh", "logits_loss.cuh", "persistent_wide.cu")
    program = compile_for_cpu(source, "persistent_wide.cu", {"THREADS": THREADS, **shape.defines}, "prelude.h",
                              "wide_banks.inc", tmp_path)
    proc = subprocess.run([program], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()]
    strides = {shape.strides["W1_STRIDE"], shape.strides["WC_STRIDE"]}
    assert {int(stride) for _, stride, _, _ in rows} == strides and len(rows) == 4
    for kind, stride, swizzled, plain in rows:
        assert int(stride) % 32 == 0
        assert int(swizzled) == 1, f"{kind} at a stride of {stride}: {swizzled} lanes on one bank"
        assert int(plain) == (2 if kind == "fragments" else 4), f"{kind} unswizzled at {stride}: {plain}"
