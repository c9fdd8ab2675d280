"""Every GPU rung, in every precision it offers, on every model of helpers.MODELS, against the
float64 NumPy reference: one step (its loss, its gradients where the rung keeps them, its update)
and a whole epoch with a real tail batch. A model a rung cannot train is refused with the reason.

Inputs are fresh seeded random data (fixed seeds, printed in every assertion); errors are
‖out − ref‖ / ‖ref‖ in float64, of the update itself rather than of the weights it is added to
(those would hide a wrong step)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import MODELS, kink_margin, reference_run, rel_err

from graphtrain import reference
from graphtrain.config import TrainConfig
from graphtrain.data import Dataset
from graphtrain.errors import UsageError
from graphtrain.plan import RunPlan
from graphtrain.stages import get_stage, stage_names

RUNGS = [name for name in stage_names() if get_stage(name).uses_gpu]
# (rung, precision) for every precision a rung offers (Stage.precisions, its own first).
RUNS = [(name, precision) for name in RUNGS for precision in get_stage(name).precisions]
# The rungs whose dW and db land in buffers of their own (from `fused` on, SGD is fused into the
# products and the gradients never reach memory).
GRADIENT_RUNGS = RUNGS[:RUNGS.index("fused")]
# The models a rung refuses, with what the refusal says.
REFUSED = {("persistent", "mlp-uneven"): "hidden layers must all have the same size"}

# Relative error of one SGD update against float64. fp32 products sum in another order than numpy
# (~1e-6). bf16 operands keep 8 significant bits (each off by up to 2^-9 ≈ 2e-3 relative), and an
# MLP's update compounds several: the batch, the activations, the weights' copies and dX of every
# layer above. Measured on an H100 at 2.8e-2 to 3.2e-2 for the first layer of a 3-layer MLP, and at
# 5.3e-2 for one seed's first-layer bias, so 0.1 for one step; over an epoch of four steps the
# roundings compound (measured 5.4e-2 and 7.3e-2), so 0.15 there. TF32 keeps 11 significant bits,
# 3 more than bf16: held to bf16's bounds. A wrong step (a missing mask, a transposed operand)
# errs by order 1.
TOLERANCE = {"fp32": 1e-4, "tf32": 0.1, "bf16": 0.1}
EPOCH_TOLERANCE = {"fp32": 1e-4, "tf32": 0.15, "bf16": 0.15}
GRADIENT_TOLERANCE = {"fp32": 1e-5, "tf32": 0.1}  # dW, db and the loss of the rungs that keep them
# In fp32 a pre-activation closer to ReLU's kink than the products' error may fall on the other side
# than in float64 and send the epoch down another path (the persistent kernel's three TF32 passes,
# ~2^-20: errors of 1e-3 to 4e-2 at 1000 samples, on about 6% of random seeds). So an fp32 MLP epoch
# takes the first seed from its own whose float64 run stays this far (relative) from the kink: 3e-6
# for the persistent kernel's TF32 passes, 3e-7 for the other rungs' plain fp32 sums (~2^-24, whose
# runs of 1000 samples rarely stay 3e-6 away: none of 200 seeds did for three of them).
KINK_MARGIN = {"persistent": 3e-6}
PLAIN_FP32_KINK_MARGIN = 3e-7


def run_id(run) -> str:
    name, precision = run
    return name if precision == get_stage(name).precisions[0] else f"{name}-{precision}"


def stage_for(name: str, cfg: TrainConfig, data: Dataset):
    return get_stage(name)(RunPlan.for_data(cfg, data), data)


def refused(name: str, model: str, cfg: TrainConfig, data: Dataset) -> bool:
    """True, having checked the refusal, where the rung cannot train the model."""
    if (name, model) not in REFUSED:
        return False
    with pytest.raises(UsageError, match=REFUSED[name, model]):
        with stage_for(name, cfg, data) as stage:
            stage.setup()
    return True


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("run", RUNS, ids=run_id)
def test_one_step_matches_float64(run, model, seed):
    name, precision = run
    check_one_step(name, precision, MODELS[model], Dataset.synthetic(1000, 300, seed=seed), seed, model)


@pytest.mark.parametrize("precision", get_stage("persistent").precisions)
def test_persistent_one_step_with_8bit_inputs_matches_float64(precision, seed):
    """Pixels k/255 (as loaded from uint8): the kernel reads k (exact in bf16 and in TF32), and
    its TF32 products with the images take two passes instead of three (persistent.cu: PIXEL_LEVELS)."""
    data = Dataset.synthetic(1000, 300, seed=seed)
    data = dataclasses.replace(data, train_images=np.rint(data.train_images * 255).astype(np.float32) / np.float32(255))
    stage = check_one_step("persistent", precision, MODELS["softmax-regression"], data, seed)
    assert stage.shape.pixel_levels == 255 and stage.precision == precision, f"seed {seed}"


def check_one_step(name: str, precision: str, model: dict, data: Dataset, seed: int, model_name: str = ""):
    cfg = TrainConfig(**model, batch=100, epochs=1, lr=0.1, seed=seed, precision=precision)
    if refused(name, model_name, cfg, data):
        return None
    with stage_for(name, cfg, data) as stage:
        stage.setup()
        # What ran, derived by the rung from its code path (softmax regression on `bf16` and
        # `device-loop` has no bf16 product: fp32); the tolerances are that precision's.
        precision = get_stage(name).precision_run(cfg, precision)
        assert stage.precision == precision, f"seed {seed}"
        result = stage.train_epoch(0, num_batches=1, measure=True)
        grads = ([(dw.download(stage.stream), None if db is None else db.download(stage.stream))
                  for dw, db in zip(stage.dw, stage.db)] if name in GRADIENT_RUNGS else None)
        new = stage.weights()
    start, after = reference_run(cfg, data, num_batches=1)
    idx = reference.epoch_order(seed, 0, len(data.train_images))[:cfg.batch]
    x, y = data.train_images[idx].astype(np.float64), data.train_labels[idx]
    acts = reference.forward(start, x)
    loss, dlogits = reference.loss_and_dlogits(acts[-1], y)
    tol = TOLERANCE[precision]
    loss_tol = GRADIENT_TOLERANCE[precision] if grads is not None else tol
    assert abs(result.train_loss - loss) / loss < loss_tol, f"seed {seed}"
    if grads is not None:
        for (dw, db), grad in zip(grads, reference.backward(start, acts, dlogits)):
            assert rel_err(dw, grad.w) < GRADIENT_TOLERANCE[precision], f"seed {seed}"
            if cfg.bias:
                assert rel_err(db, grad.b) < GRADIENT_TOLERANCE[precision], f"seed {seed}"
    for got, old, ref in zip(new, start, after):
        assert rel_err(got.w.astype(np.float64) - old.w, ref.w - old.w) < tol, f"seed {seed}"
        if cfg.bias:
            assert rel_err(got.b.astype(np.float64) - old.b, ref.b - old.b) < tol, f"seed {seed}"
    return stage


def epoch_shape(name: str, model: dict) -> tuple[int, int]:
    """(samples, batch): 1000 samples at batch 300, three full steps and a real one of 100 rows.
    A batch of 300 does not fit the persistent kernels' shared memory: softmax regression at batch
    240 (four steps and one of 40); the MLP kernel 300 samples at batch 96 (three steps and one of
    12; the images read from global memory twice a step)."""
    if name == "persistent":
        return (300, 96) if model.get("hidden") else (1000, 240)
    return 1000, 300


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("run", RUNS, ids=run_id)
def test_an_epoch_with_its_tail_batch_matches_float64(run, model, seed):
    name, precision = run
    samples, batch = epoch_shape(name, MODELS[model])
    check_epoch(name, precision, model, MODELS[model], samples, batch, seed)


@pytest.mark.parametrize("precision", get_stage("persistent").precisions)
def test_persistent_epoch_with_the_images_in_shared_memory(precision, seed):
    """H = 128 at batch 32: the persistent MLP kernel keeps the images in shared memory; 300
    samples are nine steps and one of 12."""
    check_epoch("persistent", precision, "mlp-h128", dict(hidden=(128,) * 3, bias=True), 300, 32, seed)


def check_epoch(name: str, precision: str, model_name: str, model: dict, samples: int, batch: int, seed: int):
    num_batches = -(-samples // batch)
    first = seed
    for seed in range(first, first + 200):
        data = Dataset.synthetic(samples, 300, seed=seed)
        cfg = TrainConfig(**model, batch=batch, epochs=1, lr=0.1, seed=seed, precision=precision)
        margin = KINK_MARGIN.get(name, PLAIN_FP32_KINK_MARGIN)
        if precision != "fp32" or not cfg.hidden or kink_margin(cfg, data, num_batches) > margin:
            break
    else:
        pytest.fail(f"no seed of {first}..{first + 199} keeps the float64 run {margin} from ReLU's kink")
    if refused(name, model_name, cfg, data):
        return
    with stage_for(name, cfg, data) as stage:
        stage.setup()
        stage.train_epoch(0, num_batches, measure=True)
        weights = stage.weights()
    start, after = reference_run(cfg, data, num_batches=num_batches)
    for got, old, ref in zip(weights, start, after):
        assert rel_err(got.w.astype(np.float64) - old.w, ref.w - old.w) < EPOCH_TOLERANCE[precision], f"seed {seed}"
