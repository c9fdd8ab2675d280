"""persistent_wide.cu run on the CPU: its source compiled by the host's C++ compiler with the CUDA
features it uses emulated (cuda_on_cpu/prelude.h: a thread per CUDA thread, a warp's mma.sync,
movmatrix and shuffles computed from its lanes' registers as PTX lays them out, block and grid
barriers of threads), a few steps of small shapes against the float64 run with the kernel's bf16
roundings (bf16_reference.py). What the emulation cannot show (the GPU's memory order, its timing)
test_persistent_wide_gpu.py does."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess

import numpy as np
import pytest
from bf16_reference import bf16_reference_steps
from helpers import rel_err

from graphtrain import reference
from graphtrain.config import TrainConfig
from graphtrain.data import Dataset
from graphtrain.kernels import KERNELS_DIR
from graphtrain.kernels.persistent import kernel_images, pixel_levels
from graphtrain.kernels.persistent_wide import THREADS, WideShape

HARNESS = KERNELS_DIR.parents[1] / "tests" / "cuda_on_cpu"
# What the host compiler cannot take, replaced: the block's dynamic shared memory (the launch's own
# buffer) and the barrier's acquire load (the compiler's, and a yield: a thread per CUDA thread).
REPLACED = {'extern __shared__ __align__(16) unsigned char smem_raw[];': 'unsigned char* smem_raw = block_smem();',
            'asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(now) : "l"(counter) : "memory");':
                'now = __atomic_load_n(counter, __ATOMIC_ACQUIRE); std::this_thread::yield();',
            'extern "C" __global__ void': 'void'}
# The kernel's sums are fp32 in an order of its own (the emulated mma's in double): a bf16 rounding
# or a ReLU mask they flip moves a value by 2⁻⁹ of itself or more. A wrong fragment, index or step
# errs by order 1, and bf16's roundings (which the reference mirrors) by ~5e-2.
BOUND = 1e-3


def build(shape: WideShape, folder) -> str:
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ to compile the kernel for the CPU")
    source = (KERNELS_DIR / "logits_loss.cuh").read_text() + (KERNELS_DIR / "persistent_wide.cu").read_text()
    for old, new in REPLACED.items():
        assert old in source, f"persistent_wide.cu no longer has {old!r}: the emulation must follow it"
        source = source.replace(old, new)
    defines = {"THREADS": THREADS, **shape.defines, "WS_BYTES": shape.workspace.bytes}
    text = ('#include "prelude.h"\n' + "".join(f"#define {k} {v}\n" for k, v in defines.items()) + source
            + (HARNESS / "launch.inc").read_text())
    (folder / "wide.cpp").write_text(text)
    program = str(folder / "wide")
    proc = subprocess.run([compiler, "-O1", "-std=c++20", "-pthread", "-w", "-I", str(HARNESS), "-o", program,
                           str(folder / "wide.cpp")], capture_output=True, text=True)
    if proc.returncode and "barrier" in proc.stderr and "No such file" in proc.stderr:
        pytest.skip(f"{compiler} has no C++20 <barrier>")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return program


@pytest.mark.parametrize("hidden,batch,samples,features,classes,bias,eight_bit,units,epochs", [
    ((144,) * 3, 32, 80, 160, 10, True, True, 16, 1),
    ((136,) * 2, 24, 60, 200, 10, True, False, 8, 2),
    ((32,), 32, 80, 32, 32, False, True, 16, 1),
])
def test_steps_match_float64_with_the_kernels_roundings(tmp_path, hidden, batch, samples, features, classes, bias,
                                                        eight_bit, units, epochs, seed):
    """Three hidden layers of 144 units in 9 blocks of 16 (9 k-steps of 16 a hidden product and 10 of
    the 160 features: every warp takes one, the first two, each loading its next while it
    multiplies), 8-bit pixels, a last step of 16 rows; two layers of 136 units in 18 blocks of 8 (the
    last 8 units padding), batch 24 (part tiles of rows), 200 features (padded to 208) as floats
    rounded to bf16, two epochs (the parameters reloaded, the metrics summed); one layer of 32 in 2
    blocks of 16, 32 classes (a warp's every lane), no bias. Three steps an epoch."""
    data = Dataset.synthetic(samples, 10, seed=seed, num_features=features, num_classes=classes)
    if eight_bit:
        data = dataclasses.replace(data, train_images=np.rint(data.train_images * 255).astype(np.float32) / np.float32(255))
    levels = pixel_levels(data.train_images)
    cfg = TrainConfig(hidden=hidden, batch=batch, epochs=epochs, lr=0.1, seed=seed, in_features=features,
                      classes=classes, bias=bias)
    shape = WideShape(features, hidden, classes, batch, levels, units=units)
    assert shape.refusal() is None and levels == (255 if eight_bit else 0)
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
