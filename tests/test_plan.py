"""The run plan: what every row shares, built once from the config and the dataset's size."""

import re
from pathlib import Path

import numpy as np
import pytest

from graphtrain import reference
from graphtrain.config import PRESETS, TrainConfig
from graphtrain.data import Dataset
from graphtrain.errors import UsageError
from graphtrain.kernels import ceil_div
from graphtrain.plan import Footprint, RunPlan

PACKAGE = Path(__file__).resolve().parents[1] / "graphtrain"


def test_ceil_div():
    assert [ceil_div(n, 128) for n in (0, 1, 127, 128, 129, 60000)] == [0, 1, 1, 1, 2, 469]


def test_plan_holds_the_reference_init_orders_and_bounds():
    cfg = TrainConfig(hidden=(16,), batch=300, epochs=3, seed=4)
    plan = RunPlan.build(cfg, 1000, 200)
    assert plan.num_epochs == 3 and plan.batches == (4, 4, 4) and plan.batches_per_epoch == 4
    assert plan.bounds == ((0, 300), (300, 600), (600, 900), (900, 1000))  # a real tail batch
    assert plan.batch_sizes == (300, 100)
    assert plan.orders.shape == (3, 1000) and plan.orders.dtype == np.int32
    for epoch in range(3):
        assert np.array_equal(plan.orders[epoch], reference.epoch_order(4, epoch, 1000))
    for layer, ref in zip(plan.initial, reference.init_params(cfg.dims, True, 4, np.float32)):
        assert np.array_equal(layer.w, ref.w) and np.array_equal(layer.b, ref.b)
    assert plan.samples_seen(4) == 1000 and plan.samples_seen(2) == 600


def test_plan_arrays_are_read_only_and_rows_get_copies():
    plan = RunPlan.build(TrainConfig(hidden=(8,), epochs=1), 500, 100)
    with pytest.raises(ValueError):
        plan.orders[0, 0] = 1
    with pytest.raises(ValueError):
        plan.initial[0].w[0, 0] = 1.0
    mine = plan.initial_params()
    mine[0].w[0, 0] += 1.0
    assert mine[0].w[0, 0] != plan.initial[0].w[0, 0]


def test_steps_stop_inside_the_last_epoch():
    plan = RunPlan.build(PRESETS["cuda-mnist"], 60000, 10000)  # 1875 batches per epoch, 5000 steps
    assert plan.batches == (1875, 1875, 1250)
    assert len(plan.epoch_bounds(2)) == 1250 and plan.batch_sizes == (32,)
    short = RunPlan.build(TrainConfig(batch=100, epochs=None, steps=3), 250, 10)
    assert short.batches == (3,) and short.batch_sizes == (100, 50)
    shorter = RunPlan.build(TrainConfig(batch=100, epochs=None, steps=2), 250, 10)
    assert shorter.batch_sizes == (100,)  # the tail batch is never trained: nothing to prepare


def test_sparse_metrics_schedule_includes_the_last_epoch():
    plan = RunPlan.build(TrainConfig(epochs=25, metrics_every=10), 1000, 10)
    assert [e for e in range(25) if plan.metrics_due[e]] == [9, 19, 24]


def test_for_data_takes_the_features_from_the_dataset():
    data = Dataset.synthetic(300, 50, num_features=20)
    plan = RunPlan.for_data(TrainConfig(hidden=(8,), epochs=1), data)
    assert plan.config.dims == (20, 8, 10) and plan.initial[0].w.shape == (8, 20)
    assert (plan.num_train, plan.num_test) == (300, 50)


def test_batch_larger_than_the_dataset_is_rejected():
    with pytest.raises(UsageError, match="batch 1000 is larger than the dataset"):
        RunPlan.build(PRESETS["jhu"].replace(batch=1000), 500, 100)


def test_footprint_counts_parameters_activations_and_data():
    cfg = TrainConfig(hidden=(100,), batch=50, bias=True, epochs=2)
    fp = Footprint.of(cfg, num_train=1000, num_test=10)
    assert fp.params == (784 * 100 + 100 + 100 * 10 + 10) * 4
    assert fp.activations == 50 * (784 + 100 + 10) * 4
    assert fp.dataset == 1010 * (784 * 4 + 4) and fp.orders == 2 * 1000 * 4
    assert fp.plan_bytes == fp.params + fp.orders
    assert fp.host_bytes == 2 * fp.params + 2 * fp.activations
    assert fp.device_bytes == fp.host_bytes + fp.dataset + fp.orders


def test_the_plan_alone_draws_init_and_order():
    """Every row reads the plan: outside the references and the plan, no module of graphtrain
    calls reference.init_params, epoch_order or batch_bounds (or the cnn's init_params)."""
    pattern = re.compile(r"\b(init_params|epoch_order|batch_bounds)\(")
    offenders = [f"{path.relative_to(PACKAGE)}:{number}"
                 for path in PACKAGE.rglob("*.py") if path.name not in ("plan.py", "reference.py", "reference_cnn.py")
                 for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


def test_ceil_div_is_the_one_spelling_of_rounding_up():
    """`ceil_div` (graphtrain/kernels/__init__.py) is the one spelling of ⌈a / b⌉."""
    offenders = [f"{path.relative_to(PACKAGE)}:{number}"
                 for path in PACKAGE.rglob("*.py") if path != PACKAGE / "kernels" / "__init__.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if "-(-" in line or "def ceil_div" in line]
    assert offenders == []
