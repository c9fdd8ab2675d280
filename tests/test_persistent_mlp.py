"""The persistent MLP kernel: without a GPU, which shapes it takes and that it compiles for each kind
of shape (one, two and three hidden layers; images padded to whole tiles; a few classes). With one:
test_persistent_mlp_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from graphtrain.config import TrainConfig
from graphtrain.data import Dataset
from graphtrain.errors import UsageError
from graphtrain.kernels.persistent import kernel_images, pixel_levels
from graphtrain.kernels.persistent_mlp import MlpShape, PersistentMlp
from graphtrain.plan import RunPlan
from graphtrain.stages import get_stage

ELF_MAGIC = b"\x7fELF"




@pytest.mark.parametrize("shape", [
    MlpShape(784, (64,), 10, 100), MlpShape(784, (64, 64), 10, 100), MlpShape(784, (128,) * 3, 10, 32),
    MlpShape(30, (128, 128), 3, 16), MlpShape(784, (128,) * 3, 10, 32, 255), MlpShape(784, (256,) * 3, 10, 32, 255),
    MlpShape(784, (64,), 10, 100, bf16=True), MlpShape(30, (128, 128), 3, 16, bf16=True),
    MlpShape(784, (128,) * 3, 10, 32, 255, bf16=True), MlpShape(784, (256,) * 3, 10, 32, 255, bf16=True),
])
def test_the_kernel_compiles_for_every_kind_of_shape_it_takes(nvrtc_available, cache, shape):
    assert shape.refusal() is None
    assert PersistentMlp.cubin("sm_90", shape.defines).startswith(ELF_MAGIC)


def test_the_phase_cycles_build_compiles(nvrtc_available, cache):
    """scripts/persistent_mlp_phases.py's instrumented build of the kernel."""
    assert PersistentMlp.cubin("sm_90", {"PHASE_CYCLES": 1}).startswith(ELF_MAGIC)


def test_the_cuda_mnist_preset_fits_at_h128_and_h256():
    # floats ≡ 64 bytes mod 128 (784·4), bytes ≡ 16 (784), bf16 an odd number of 16-byte pieces
    # (784·2 = 98 pieces, padded to 99: 792 inputs)
    for h, levels, bf16, stride in ((128, 0, False, 784), (128, 255, False, 784), (256, 0, False, 0),
                                    (256, 255, False, 0), (128, 0, True, 792), (128, 255, True, 792),
                                    (256, 0, True, 792), (256, 255, True, 792)):
        shape = MlpShape(784, (h,) * 3, 10, 32, levels, bf16)
        assert shape.refusal() is None and shape.shared_bytes <= 227 * 1024
        assert shape.x_stride == stride, (h, levels, bf16)
    # The bf16 build keeps W_1 in registers, the images in one buffer (they too go to registers once
    # read), and the gathered activations (two layers of 32 × 256) and the input gradients' pieces
    # (two inboxes of 16 × 32 × 16) as bf16: at H = 256 the batch's images fit beside the rest, which
    # they do not in the TF32 build.
    fp32 = MlpShape(784, (256,) * 3, 10, 32, 255).bytes_with(0)
    assert fp32 - MlpShape(784, (256,) * 3, 10, 32, 255, bf16=True).bytes_with(0) == (784 * 16 * 4 + 2 * 32 * 256 * 2
                                                                                       + 2 * 16 * 32 * 16 * 2)
    assert MlpShape(784, (256,) * 3, 10, 32, bf16=True).x_buffers == 1
    assert MlpShape(30, (64,), 3, 8, bf16=True).x_stride == 40  # 64 bytes a row: 4 pieces, padded to 5
    assert MlpShape(40, (64,), 3, 8, bf16=True).x_stride == 56  # 48 inputs, 96 bytes: 6 pieces, padded to 7
    # 8-bit pixels as bytes: two buffers of a quarter the size, so 50 KB less than one of floats
    assert MlpShape(784, (128,) * 3, 10, 32).shared_bytes - MlpShape(784, (128,) * 3, 10, 32, 255).shared_bytes == 32 * 784 * (4 - 2)
    assert MlpShape(30, (64,), 3, 8, 255).x_stride == 144  # 32 bytes a row, padded to ≡ 16 mod 128
    assert MlpShape(30, (64,), 3, 8).padded_features == 32
    assert MlpShape(40, (64,), 3, 8).padded_features == 48  # whole mma tiles of 16 inputs


def test_8bit_images_go_to_the_kernel_as_bytes_k_in_padded_rows():
    pixels = np.random.default_rng(3).integers(0, 256, size=(5, 30), dtype=np.uint8)
    images = pixels.astype(np.float32) / np.float32(255)
    rows = kernel_images(images, MlpShape(30, (64,), 3, 8, pixel_levels(images)))
    assert rows.dtype == np.uint8 and rows.shape == (5, 32)
    assert np.array_equal(rows[:, :30], pixels) and not rows[:, 30:].any()
    floats = kernel_images(images, MlpShape(30, (64,), 3, 8))  # without pixel levels: the floats as they are
    assert floats.dtype == np.float32 and np.array_equal(floats[:, :30], images) and not floats[:, 30:].any()


def test_images_go_to_the_bf16_kernel_as_bf16_bits():
    """8-bit pixels as k (exact in bf16's 8 significant bits); other floats rounded to the nearest
    bf16, ties to even."""
    pixels = np.random.default_rng(4).integers(0, 256, size=(5, 30), dtype=np.uint8)
    images = pixels.astype(np.float32) / np.float32(255)
    rows = kernel_images(images, MlpShape(30, (64,), 3, 8, pixel_levels(images), bf16=True))
    assert rows.dtype == np.uint16 and rows.shape == (5, 32) and not rows[:, 30:].any()
    widened = (rows.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(widened[:, :30], pixels.astype(np.float32))
    # 1 + 2⁻⁸ lies halfway between 1 and 1 + 2⁻⁷ (to even: 1); 1 + 3·2⁻⁸ between 1 + 2⁻⁷ and
    # 1 + 2⁻⁶ (to even: 1 + 2⁻⁶); −1.00390625·2⁻³ likewise; 0.1 rounds up to 0x3dcd.
    floats = np.array([[1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8) / 8, 0.1]], np.float32)
    bits = kernel_images(floats, MlpShape(4, (64,), 3, 8, bf16=True))[0, :4]
    assert [int(b) for b in bits] == [0x3F80, 0x3F82, 0xBE00, 0x3DCD]


@pytest.mark.parametrize("shape,needle", [
    (MlpShape(784, (784,) * 3, 10, 32), "784-784-784-784-10 MLP at batch 32: a block needs 969180 bytes of shared "
                                        "memory (at most 232448)"),
    (MlpShape(784, (256,) * 3, 10, 64), "at batch 64: a block needs 374000 bytes"),
    (MlpShape(784, (128, 64), 10, 32), "784-128-64-10 MLP: its hidden layers must all have the same size"),
    (MlpShape(784, (96, 96), 10, 32), "a hidden size must be a multiple of 64"),
    (MlpShape(784, (64,), 40, 32), "40 classes (at most 32"),
])
def test_a_shape_it_cannot_train_is_refused_with_the_reason(shape, needle):
    assert needle in shape.refusal()


def test_the_rung_trains_in_bf16_with_fp32_on_request():
    """The precision a run records (what the ladder pairs it with peers by): bf16 is the rung's
    own for an MLP and for softmax regression, fp32 (TF32 passes) is there on request, and the
    kernel is built for the one the run records."""
    data = Dataset.synthetic(200, 50, seed=1)
    stage = get_stage("persistent")

    def precision_of(**config):
        cfg = TrainConfig(batch=32, epochs=1, **config)
        return stage(RunPlan.for_data(cfg, data), data).precision

    assert precision_of(hidden=(64,)) == "bf16" and precision_of(hidden=(64,), precision="fp32") == "fp32"
    assert precision_of() == "bf16" and precision_of(precision="fp32") == "fp32"
    with pytest.raises(UsageError, match="persistent trains in bf16 or fp32, not --precision tf32"):
        precision_of(precision="tf32")
