"""The MLP's recipe (optimizer and schedule) on the GPU rungs that train it (`graphs`, `fused`,
`bf16`, `device-loop`): the update after a few steps against PyTorch's rules written out in
float64 (tests/helpers.py), the schedule's rate as the device computed it, the same bits from the
same seed, and one epoch of Adam with the one-cycle schedule on MNIST.

Inputs are seeded synthetic data (the seed in every assertion); errors are ‖out − ref‖ / ‖ref‖
in float64 of the update (the weights' change)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import MODELS, cosine_rates, recipe_reference_run, rel_err

from graphtrain.config import TrainConfig
from graphtrain.data import Dataset, load
from graphtrain.plan import RunPlan
from graphtrain.reference_cnn import Schedule
from graphtrain.stages import get_stage
from graphtrain.training import train

# (rung, model): each rung on the models whose path differs (softmax regression is all head on the
# fused rungs, and fp32 on bf16 and device-loop; their MLPs have bf16 operands).
RUNS = [(rung, model) for rung in ("graphs", "fused", "bf16", "device-loop")
        for model in ("softmax-regression", "mlp")]
STEPS = 3  # of an epoch of 10 (1000 samples, batch 100), the cosine schedule over all 10
# fp32 against float64 after 3 steps. Momentum is linear in the gradients: the oracle's fp32 bound
# for SGD (tests/test_oracle_gpu.py). Adam's first steps are about lr·sign(g): an element whose
# gradient sums to nearly 0 takes ±lr by the sign fp32 rounding gives it (numpy's float32,
# tests/test_recipe.py: ≤ 1.5e-5 on most seeds, 2e-3 on one of 60), so 1e-2; a wrong rule errs by
# 1e-1 to 1. bf16 operands: the oracle's bound for an epoch of SGD (0.15), the same for both.
TOLERANCE = {("momentum", "fp32"): 1e-4, ("adam", "fp32"): 1e-2, ("momentum", "bf16"): 0.15, ("adam", "bf16"): 0.15}


def config(model: str, optimizer: str, seed: int, **changes) -> TrainConfig:
    return TrainConfig(**{**MODELS[model], "batch": 100, "epochs": 1, "lr": 0.01 if optimizer == "adam" else 0.1,
                          "seed": seed, "optimizer": optimizer, "schedule": "cosine", "weight_decay": 0.5, **changes})


def device_optimizer(stage):
    """The rung's DeviceOptimizer: graphs' own, or that of the fused rungs' model (stages/fused_mlp.py)."""
    return stage.mlp.optimizer if stage.name != "graphs" else stage.device_optimizer


def run_steps(rung: str, cfg: TrainConfig, data: Dataset, steps: int):
    """The weights after the first `steps` steps, the rate of the last one, the precision run."""
    with get_stage(rung)(RunPlan.for_data(cfg, data), data) as stage:
        stage.setup()
        stage.train_epoch(0, steps, measure=True)
        lr = device_optimizer(stage).lr_used.download(stage.stream)[0]
        return stage.weights(), lr, stage.precision


@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
@pytest.mark.parametrize("run", RUNS, ids=lambda run: "-".join(run))
def test_recipe_steps_match_float64(run, optimizer, seed):
    rung, model = run
    data = Dataset.synthetic(1000, 300, seed=seed)
    cfg = config(model, optimizer, seed)
    got, lr, precision = run_steps(rung, cfg, data, STEPS)
    start, ref = recipe_reference_run(cfg, data, cosine_rates(cfg.lr, 10, STEPS))
    tol = TOLERANCE[optimizer, precision]
    for layer, (g, s, r) in enumerate(zip(got, start, ref)):
        for name in ("w", "b"):
            err = rel_err(getattr(g, name) - getattr(s, name), getattr(r, name) - getattr(s, name))
            assert err < tol, f"{rung} {model} {optimizer} layer {layer} {name}: {err:.2e}, seed {seed}"
    # The rate of the last step, read on the device from its step counter (the graph replays it).
    assert abs(lr - Schedule.of(cfg, 10).at(STEPS - 1)) <= 1e-6 * cfg.lr, f"seed {seed}"


def test_device_loop_replays_the_schedule_through_its_while_node(seed):
    """Softmax regression (fp32 on device-loop) with momentum and the one-cycle schedule: an epoch
    of 20 steps, a WHILE node's 16 and 4 unrolled, against float64 step by step's rates."""
    data = Dataset.synthetic(1000, 300, seed=seed)
    cfg = config("softmax-regression", "momentum", seed, schedule="one-cycle").replace(batch=50)
    got, lr, precision = run_steps("device-loop", cfg, data, 20)
    assert precision == "fp32", f"seed {seed}"
    schedule = Schedule.of(cfg, 20)
    start, ref = recipe_reference_run(cfg, data, [schedule.at(k) for k in range(20)])
    for g, s, r in zip(got, start, ref):
        assert rel_err(g.w - s.w, r.w - s.w) < 1e-4 and rel_err(g.b - s.b, r.b - s.b) < 1e-4, f"seed {seed}"
    assert abs(lr - schedule.at(19)) <= 1e-6 * cfg.lr, f"seed {seed}"


@pytest.mark.parametrize("rung", ["graphs", "fused", "bf16", "device-loop"])
def test_same_seed_gives_bit_identical_adam_weights(rung):
    data = Dataset.synthetic(2000, 100, seed=3)
    cfg = config("mlp", "adam", 4).replace(batch=64, epochs=2, schedule="one-cycle")
    runs = []
    for _ in range(2):
        with get_stage(rung)(RunPlan.for_data(cfg, data), data) as stage:
            stage.setup()
            for epoch in range(2):
                stage.train_epoch(epoch, 32, measure=epoch == 1)
            runs.append(stage.weights())
    for a, b in zip(*runs):
        assert np.array_equal(a.w, b.w) and np.array_equal(a.b, b.b)


@pytest.mark.parametrize("rung", ["graphs", "fused", "bf16", "device-loop"])
def test_mlp_with_adam_and_one_cycle_reaches_95_percent_in_an_epoch(rung, mnist_dir):
    """784-128-10, batch 128, Adam at a peak rate of 0.01, one-cycle: as on numpy (tests/test_recipe.py)."""
    cfg = TrainConfig(hidden=(128,), bias=True, batch=128, epochs=1, lr=0.01, seed=0, optimizer="adam",
                      schedule="one-cycle")
    record = train(cfg, rung, data=load("mnist", data_dir=mnist_dir))
    assert record.test_accuracy >= 0.95, f"{rung}: {record.test_accuracy}"
