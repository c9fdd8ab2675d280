"""What a run record says ran is what ran: every rung × model trains a short run and its record's
`precision` is the one its code path trains in (tests/test_stages.py: PRECISION_RUN), confirmed by
the weights: where bf16 and device-loop state fp32 (softmax regression, the fused rung's fp32 head)
they train fused's weights bit for bit, and where they state bf16 they do not. Also the persistent
rung's images made on the device against the host's kernel_images and pixel_levels, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from test_stages import PRECISION_RUN

from graphtrain.config import TrainConfig
from graphtrain.data import Dataset
from graphtrain.kernels.persistent import Shape, kernel_images, pixel_levels
from graphtrain.kernels.persistent_mlp import MlpShape
from graphtrain.plan import RunPlan
from graphtrain.stages import get_stage, stage_names
from graphtrain.training import run_stage

pytestmark = pytest.mark.gpu

SEED = 11  # data, initial weights and order
MODELS = {"softmax-regression": (), "mlp": (64, 64)}  # the persistent MLP kernel's sizes: multiples of 64


@pytest.fixture(scope="module")
def records(gpu_device):
    """One short run (1000 samples, batch 100, one epoch) per rung × model."""
    data = Dataset.synthetic(1000, 200, seed=SEED)
    out = {}
    for model, hidden in MODELS.items():
        plan = RunPlan.for_data(TrainConfig(hidden=hidden, batch=100, epochs=1, seed=SEED), data)
        for name in stage_names():
            out[name, model] = run_stage(get_stage(name), plan, data)
    return out


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("name", stage_names())
def test_the_record_states_the_precision_that_ran(records, name, model):
    record = records[name, model]
    assert record.precision == PRECISION_RUN[name][model == "mlp"], (name, model, record.precision, f"seed {SEED}")
    assert record.setup_ms > 0 and record.to_json()["setup_ms"] == record.setup_ms


def test_the_weights_confirm_the_stated_precision(records):
    """fp32 stated by bf16 and device-loop: fused's path, the same bits; bf16 stated: other bits."""
    def same(a, b):
        return all(np.array_equal(x.w, y.w) and np.array_equal(x.b, y.b) for x, y in zip(a.params, b.params))

    for name in ("bf16", "device-loop"):
        fused, softmax, mlp = (records["fused", m] for m in MODELS), records[name, "softmax-regression"], records[name, "mlp"]
        fused_softmax, fused_mlp = fused
        assert softmax.precision == "fp32" and same(softmax, fused_softmax), (name, f"seed {SEED}")
        assert mlp.precision == "bf16" and not same(mlp, fused_mlp), (name, f"seed {SEED}")


@pytest.mark.parametrize("eight_bit", [True, False])
def test_the_persistent_images_made_on_the_device_match_the_host(gpu_device, eight_bit):
    from graphtrain.kernels.images import Images
    from graphtrain.libs import cuda

    rng = np.random.default_rng(SEED)
    n, features = 300, 784
    images = (rng.integers(0, 256, (n, features)) / 255).astype(np.float32) if eight_bit else \
        rng.random((n, features), dtype=np.float32)
    levels = pixel_levels(images)
    assert levels == (255 if eight_bit else 0), f"seed {SEED}"
    shapes = [Shape(features, 10, 128, levels, bf16=True), Shape(features, 10, 128, levels, bf16=False),
              MlpShape(features, (128,) * 3, 10, 32, levels, bf16=True),
              MlpShape(features, (128,) * 3, 10, 32, levels, bf16=False)]
    stream, kernel = cuda.Stream(), Images(gpu_device)
    counter = (images.nbytes + 255) // 256 * 256  # an aligned 8-byte counter after the images
    src = cuda.malloc(counter + 256)
    try:
        cuda.copy_to_device(src, images, stream)
        assert kernel.pixel_levels(stream, src, images.size, src + counter) == levels, f"seed {SEED}"
        for shape in shapes:
            want = kernel_images(images, shape)
            out = cuda.malloc(want.nbytes)
            try:
                cuda.memset(out, 0xAB, want.nbytes, stream)  # poison: every byte must be written
                kernel.kernel_images(stream, src, n, features, shape, out)
                got = cuda.copy_to_host(out, np.empty_like(want), stream)
            finally:
                cuda.free(out)
            assert got.dtype == want.dtype and np.array_equal(got, want), (shape, f"seed {SEED}")
    finally:
        cuda.free(src)
        kernel.close()
        stream.close()
