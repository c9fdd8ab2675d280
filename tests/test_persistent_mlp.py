"""The persistent MLP kernel without a GPU: which shapes it takes, and that it compiles for each
kind of shape (one, two and three hidden layers; images padded to whole quads; a few classes)."""

from __future__ import annotations

import pytest

from graphtrain.kernels.persistent_mlp import MlpShape, PersistentMlp
from graphtrain.libs import nvrtc

ELF_MAGIC = b"\x7fELF"


@pytest.fixture(scope="module")
def nvrtc_available() -> str:
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda.bindings.nvrtc cannot be imported")
    return nvrtc.version()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHTRAIN_CACHE", str(tmp_path / "kernel-cache"))


@pytest.mark.parametrize("shape", [
    MlpShape(784, (64,), 10, 100), MlpShape(784, (64, 64), 10, 100), MlpShape(784, (128,) * 3, 10, 32),
    MlpShape(30, (128, 128), 3, 16),
])
def test_the_kernel_compiles_for_every_kind_of_shape_it_takes(nvrtc_available, cache, shape):
    assert shape.refusal() is None
    defines = {"FEATURES": shape.features, "FEATURE_STRIDE": shape.padded_features, "HIDDEN": shape.hidden[0],
               "LAYERS": shape.layers, "CLASSES": shape.classes, "X_STRIDE": shape.x_stride}
    assert PersistentMlp.cubin("sm_90", defines).startswith(ELF_MAGIC)


def test_the_phase_cycles_build_compiles(nvrtc_available, cache):
    """scripts/persistent_mlp_phases.py's instrumented build of the kernel."""
    assert PersistentMlp.cubin("sm_90", {"PHASE_CYCLES": 1}).startswith(ELF_MAGIC)


def test_the_cuda_mnist_preset_fits_at_h128_and_h256():
    for h, staged in ((128, True), (256, False)):  # the batch's images in shared memory at H = 128 only
        shape = MlpShape(784, (h,) * 3, 10, 32)
        assert shape.refusal() is None and shape.shared_bytes <= 227 * 1024
        assert shape.x_stride == (788 if staged else 0)
    assert MlpShape(30, (64,), 3, 8).padded_features == 32


@pytest.mark.parametrize("shape,needle", [
    (MlpShape(784, (784,) * 3, 10, 32), "784-784-784-784-10 MLP at batch 32: a block needs 820956 bytes of shared "
                                        "memory (at most 232448)"),
    (MlpShape(784, (256,) * 3, 10, 64), "at batch 64: a block needs 354480 bytes"),
    (MlpShape(784, (128, 64), 10, 32), "784-128-64-10 MLP: its hidden layers must all have the same size"),
    (MlpShape(784, (96, 96), 10, 32), "a hidden size must be a multiple of 64"),
    (MlpShape(784, (64,), 40, 32), "40 classes (at most 32"),
])
def test_a_shape_it_cannot_train_is_refused_with_the_reason(shape, needle):
    assert needle in shape.refusal()
