"""The recipe (optimizer and learning-rate schedule) of the MLP on the `numpy` rung: its update
against PyTorch's rules written out in float64, SGD at a constant rate unchanged, one epoch of
Adam with the one-cycle schedule on MNIST, and the rows that refuse a recipe saying why before
any work.

Inputs are seeded synthetic data (the seed in every assertion); errors are ‖out − ref‖ / ‖ref‖
in float64 of the update (the weights' change), not of the weights it is added to."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import cosine_rates, recipe_reference_run, rel_err
from test_cli import invoke

from graphtrain import reference, training
from graphtrain.config import TrainConfig
from graphtrain.data import Dataset
from graphtrain.errors import ModelUnsupported, UsageError
from graphtrain.plan import RunPlan
from graphtrain.stages import get_stage, stage_names
from graphtrain.stages.numpy_cpu import NumpyStage

STEPS = 3  # of an epoch of 10 (1000 samples, batch 100), the cosine schedule over all 10
# float32 against float64. Momentum and Nesterov are linear in the gradients: measured ≤ 2e-6 over
# 20 seeds. Adam's first steps are about lr·sign(g): an element whose gradient sums to nearly 0
# takes ±lr by the sign float32 rounding gives it, measured ≤ 1.5e-5 on 58 of 60 seeds and 3e-4,
# 2e-3 on two. A wrong rule (a missing bias correction, weight decay coupled where it is
# decoupled at this weight decay of 0.5) errs by order 1e-1 to 1.
TOLERANCE = {"momentum": 1e-5, "nesterov": 1e-5, "adam": 1e-2, "adamw": 1e-2}


def numpy_run(cfg: TrainConfig, data: Dataset, steps: int):
    with NumpyStage(RunPlan.for_data(cfg, data), data) as stage:
        stage.setup()
        stage.train_epoch(0, steps, measure=True)
        return stage.weights()


@pytest.mark.parametrize("optimizer", list(TOLERANCE))
def test_numpy_mlp_update_matches_float64(optimizer, seed):
    data = Dataset.synthetic(1000, 300, seed=seed)
    cfg = TrainConfig(hidden=(64, 32), bias=True, batch=100, epochs=1, lr=0.01 if "adam" in optimizer else 0.1,
                      seed=seed, optimizer=optimizer, schedule="cosine", weight_decay=0.5)
    got = numpy_run(cfg, data, STEPS)
    start, ref = recipe_reference_run(cfg, data, cosine_rates(cfg.lr, 10, STEPS))
    for layer, (g, s, r) in enumerate(zip(got, start, ref)):
        for name in ("w", "b"):
            err = rel_err(getattr(g, name) - getattr(s, name), getattr(r, name) - getattr(s, name))
            assert err < TOLERANCE[optimizer], f"{optimizer} layer {layer} {name}: {err:.2e}, seed {seed}"


def test_numpy_sgd_at_a_constant_rate_is_the_reference_step_bit_for_bit(seed):
    """The recipe's SGD is the numpy rung's SGD of before: the same bits as reference.train_step."""
    data = Dataset.synthetic(1000, 300, seed=seed)
    cfg = TrainConfig(hidden=(64,), bias=True, batch=100, epochs=1, lr=0.1, seed=seed)
    got = numpy_run(cfg, data, 4)
    layers = reference.init_params(cfg.dims, cfg.bias, seed, np.float32)
    order = reference.epoch_order(seed, 0, 1000)
    for lo, hi in reference.batch_bounds(1000, 100)[:4]:
        reference.train_step(layers, data.train_images[order[lo:hi]], data.train_labels[order[lo:hi]],
                             np.float32(cfg.lr))
    for g, r in zip(got, layers):
        assert np.array_equal(g.w, r.w) and np.array_equal(g.b, r.b), f"seed {seed}"


def test_numpy_mlp_with_adam_and_one_cycle_reaches_95_percent_in_an_epoch(mnist_dir, tmp_path):
    """784-128-10, batch 128: Adam at a peak rate of 0.01 (the preset's 0.1 is SGD's), one-cycle."""
    out = tmp_path / "run.json"
    result = invoke("run", "--hidden", "128", "--stage", "numpy", "--optimizer", "adam", "--schedule", "one-cycle",
                    "--epochs", "1", "--lr", "0.01", "--data-dir", str(mnist_dir), "--json", str(out))
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["test_accuracy"] >= 0.95, record["test_accuracy"]


ADAM = TrainConfig(hidden=(16,), batch=100, epochs=1, lr=0.01, optimizer="adam", schedule="one-cycle")
RECIPE_RUNGS = ("numpy", "graphs", "fused", "bf16", "device-loop")


@pytest.mark.parametrize("name", stage_names())
def test_every_rung_trains_the_recipe_or_refuses_it_with_the_reason(name):
    stage_cls = get_stage(name)
    if name in RECIPE_RUNGS:
        stage_cls.check_recipe(ADAM)
        return
    with pytest.raises(ModelUnsupported, match=f"{name} trains with SGD at a constant rate, not --optimizer adam "
                                               "--schedule one-cycle; .*the recipe trains on numpy"):
        stage_cls.check_recipe(ADAM)
    stage_cls.check_recipe(ADAM.replace(optimizer="sgd", schedule="constant"))


def test_a_refused_recipe_stops_the_run_before_its_setup(monkeypatch):
    """run_stage refuses before the row is made or the GPU looked for."""
    data = Dataset.synthetic(200, 100, seed=0)
    stage_cls = get_stage("persistent")
    monkeypatch.setattr(stage_cls, "check_available", classmethod(lambda cls: pytest.fail("looked for a GPU")))
    with pytest.raises(ModelUnsupported, match="persistent trains with SGD at a constant rate"):
        training.run_stage(stage_cls, RunPlan.for_data(ADAM, data), data)


def test_resuming_with_another_recipe_starts_from_the_files_weights(tmp_path):
    """A saved model keeps no optimizer state: Adam's moments start at zero, from the file's weights."""
    data = Dataset.synthetic(200, 100, seed=0)
    cfg = TrainConfig(hidden=(16,), batch=100, epochs=1, lr=0.1)
    record = training.train(cfg, "numpy", data=data)
    plan = training.plan_for(ADAM, data, record_model(record, tmp_path))
    for got, want in zip(plan.initial, record.params):
        assert np.array_equal(got.w, want.w) and np.array_equal(got.b, want.b)


def record_model(record, tmp_path):
    from graphtrain import model_io

    path = tmp_path / "m.safetensors"
    model_io.save(path, record)
    return model_io.load(path)


def test_data_parallel_mlp_refuses_another_recipe_before_reading_data(tmp_path):
    result = invoke("run", "--stage", "graphs", "--hidden", "16", "--gpus", "2", "--optimizer", "adam",
                    "--offline", "--data-dir", str(tmp_path))
    assert result.exit_code == 2
    assert "not --optimizer adam" in result.stderr and "with --gpus" in result.stderr and "Traceback" not in result.output + result.stderr
