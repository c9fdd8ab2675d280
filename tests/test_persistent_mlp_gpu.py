"""The persistent MLP kernel on a GPU: an epoch of each kind of layout against the float64
reference (what it compiles to and which shapes it takes are tested without one, in
test_persistent_mlp.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import kink_margin, reference_run, rel_err

from graphtrain.config import TrainConfig
from graphtrain.data import Dataset
from graphtrain.plan import RunPlan
from graphtrain.stages import get_stage


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("hidden,features,eight_bit,samples", [
    ((256,) * 3, 784, False, 80), ((128,), 784, False, 300), ((64,) * 4, 784, False, 300), ((64, 64), 50, False, 300),
    ((128,) * 3, 784, True, 300), ((256,) * 3, 784, True, 80), ((64, 64), 50, True, 300),
])
def test_an_epoch_matches_float64_for_each_kind_of_layout(hidden, features, eight_bit, samples, precision, seed):
    """Shapes the rung tests leave out, in both precisions: H = 256 (two unit tiles per block, the
    images read from global memory in fp32, kept in shared memory in bf16), one hidden layer with the images in shared memory (the
    logits' two buffers), four layers (an inbox of its own between the first and the last), and
    images padded from 50 features to 64. Then 8-bit pixels k/255, which the kernel reads as k
    (bf16, or bytes in fp32, where they take two TF32 passes): two buffers of staged images at H =
    128, read from global memory at H = 256 in fp32, and rows of 50 pixels padded to 64. Batch 32: 300
    samples are 9 steps and one of 12. As in the rung tests' epoch, in fp32 a pre-activation
    within the kernel's ~2⁻²⁰ of ReLU's kink may take the other side and send the epoch down
    another path (at H = 256 and 1000 samples, 2 seeds of 6 erred by 1e-2), so seeds are drawn
    until the float64 run stays 3e-6 (relative) from the kink; at H = 256 the closest approach of
    300 samples' pre-activations is rarely that far, so there 80 (two steps and one of 16). bf16
    is held to the bf16 rungs' epoch tolerance."""
    batch = 32
    num_batches = -(-samples // batch)
    first = seed
    for seed in range(first, first + 200):  # from the test's fixed seed, the first clear of the kink
        data = Dataset.synthetic(samples, 300, seed=seed, num_features=features)
        if eight_bit:
            data = dataclasses.replace(data, train_images=np.rint(data.train_images * 255).astype(np.float32) / np.float32(255))
        cfg = TrainConfig(hidden=hidden, batch=batch, epochs=1, lr=0.1, seed=seed, in_features=features,
                          precision=precision)
        if precision == "bf16" or kink_margin(cfg, data, num_batches) > 3e-6:
            break
    else:
        pytest.fail("no seed of 200 keeps the float64 run 3e-6 from ReLU's kink")
    with get_stage("persistent")(RunPlan.for_data(cfg, data), data) as stage:
        stage.setup()
        assert stage.shape.pixel_levels == (255 if eight_bit else 0), f"seed {seed}"
        assert stage.shape.bf16 == (precision == "bf16") and stage.precision == precision, f"seed {seed}"
        stage.train_epoch(0, num_batches, measure=True)
        weights = stage.weights()
    start, after = reference_run(cfg, data)
    for got, old, ref in zip(weights, start, after):
        assert rel_err(got.w.astype(np.float64) - old.w, ref.w - old.w) < (0.15 if precision == "bf16" else 1e-4), f"seed {seed}"
