"""One trainer protocol, set up once per shape (graphtrain.stages.base.Stage.restart): what a row
restarted in place trains against a fresh setup, the rows that refuse another shape or recipe,
the sweep's set-up rows counted, the recipe's pieces a restart reads (the rate on the device,
the normalised images shared), and the sweep's report of itself. All on the CPU: the GPU rows'
restart is checked here against a stand-in for their device model, and on a GPU in
tests/test_restart_gpu.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from graphtrain import sweep, training
from graphtrain.config import PRESETS, TrainConfig
from graphtrain.data import Dataset
from graphtrain.plan import RunPlan
from graphtrain.recipe import Recipe, normalised, recipe_of, schedule_rate
from graphtrain.reference_cnn import Schedule
from graphtrain.stages.base import Stage, shape_of
from graphtrain.stages.cnn_rungs import CnnDeviceLoopStage, CnnGraphsStage, CnnNumpyStage, flat_params
from graphtrain.stages.numpy_cpu import NumpyStage


def small_data(seed: int = 3) -> Dataset:
    return Dataset.synthetic(600, 200, seed=seed, num_features=20, num_classes=4)


def mlp_config(**changes) -> TrainConfig:
    return TrainConfig(hidden=(8,), batch=50, epochs=2, lr=0.1, seed=0, in_features=20,
                       classes=4).replace(**changes)


def trained(stage: Stage, plan: RunPlan) -> list:
    """The row's weights after `plan`'s epochs (the row set up or restarted for it)."""
    for epoch in range(plan.num_epochs):
        stage.train_epoch(epoch, plan.batches[epoch], True)
    return flat_params(stage.weights())


def fresh(cls: type[Stage], plan: RunPlan, data: Dataset) -> list:
    with cls(plan, data) as stage:
        stage.setup()
        return trained(stage, plan)


# ---- what a restart may change ---------------------------------------------------------------


def test_the_shape_sets_aside_the_seed_and_the_recipe_only():
    base = mlp_config(optimizer="adam", schedule="one-cycle")
    for other in (dict(seed=4), dict(lr=0.02), dict(optimizer="momentum", momentum=0.8), dict(betas=(0.7, 0.9)),
                  dict(schedule="warmup", warmup=3), dict(weight_decay=0.1)):
        assert shape_of(base.replace(**other)) == shape_of(base), other
    for other in (dict(hidden=(9,)), dict(batch=60), dict(epochs=3), dict(bias=False), dict(metrics_every=2)):
        assert shape_of(base.replace(**other)) != shape_of(base), other


def test_a_row_takes_a_plan_of_its_shape_only():
    data = small_data()
    with NumpyStage(RunPlan.for_data(mlp_config(), data), data) as stage:
        stage.setup()
        assert stage.same_shape(RunPlan.for_data(mlp_config(seed=5, lr=0.3, optimizer="adam"), data))
        for other in (mlp_config(batch=60), mlp_config(hidden=(9,)), mlp_config(epochs=1), mlp_config(steps=5)):
            plan = RunPlan.for_data(other, data)
            assert not stage.same_shape(plan) and not stage.restart(plan), other
        other_data = Dataset.synthetic(500, 200, seed=3, num_features=20, num_classes=4)
        assert not stage.restart(RunPlan.for_data(mlp_config(), other_data))
        assert stage.plan.num_train == 600  # a refused plan leaves the row as it was


@pytest.mark.parametrize("changes", [dict(seed=7), dict(lr=0.03, seed=2), dict(optimizer="adam", schedule="cosine")],
                         ids=["seed", "lr and seed", "recipe"])
def test_the_numpy_mlp_restarted_trains_what_a_fresh_setup_trains(changes):
    data = small_data()
    first, second = RunPlan.for_data(mlp_config(), data), RunPlan.for_data(mlp_config(**changes), data)
    with NumpyStage(first, data) as stage:
        stage.setup()
        trained(stage, first)
        assert stage.restart(second)
        again = trained(stage, second)
    alone = fresh(NumpyStage, second, data)
    for got, want in zip(again, alone):
        assert np.array_equal(got, want), changes


def cnn_config(**changes) -> TrainConfig:
    return PRESETS["speedrun"].replace(**{"conv": ((2, 5),), "hidden": (8,), "batch": 100, "epochs": 1, **changes})


def test_the_numpy_cnn_restarted_trains_what_a_fresh_setup_trains():
    data = Dataset.synthetic(200, 50, seed=1)
    first, second = RunPlan.for_data(cnn_config(), data), RunPlan.for_data(cnn_config(seed=3, lr=0.02), data)
    with CnnNumpyStage(first, data) as stage:
        stage.setup()
        trained(stage, first)
        assert stage.restart(second) and stage.recipe == recipe_of(second.config, 2, 1, "fp32")
        again, accuracy = trained(stage, second), stage.test_accuracy()
    with CnnNumpyStage(second, data) as alone:
        alone.setup()
        want = trained(alone, second)
        assert accuracy == alone.test_accuracy()
    for got, ref in zip(again, want):
        assert np.array_equal(got, ref)


# ---- the GPU rows' restart, against a stand-in for their device model ------------------------


class DeviceModelStandIn:
    """What CnnGraphsStage.restart calls on its CnnDevice (set_recipe, load, reset), recorded;
    `refuse`: set_recipe raises ValueError, as the device model does for a recipe its captures
    cannot train (another batch, precision or optimizer state)."""

    stream = "the model's stream"

    def __init__(self, refuse: bool = False):
        self.refuse, self.calls = refuse, []

    def set_recipe(self, recipe: Recipe) -> None:
        self.calls.append(("set_recipe", recipe))
        if self.refuse:
            raise ValueError("the captures hold another optimizer state")

    def load(self, params, orders) -> None:
        self.calls.append(("load", [p.copy() for p in params], orders))

    def reset(self, stream) -> None:
        self.calls.append(("reset", stream))


@pytest.mark.parametrize("cls", [CnnGraphsStage, CnnDeviceLoopStage], ids=["graphs", "device-loop"])
def test_a_gpu_cnn_row_restarts_by_writing_the_recipe_and_loading_the_plan(cls):
    """The recipe goes to the device model (set_recipe), then the plan's weights and orders
    (load) and the counters zeroed (reset); the captured graphs stay. A recipe the model refuses
    leaves the row as it was, and a plan of another shape is refused before the model is asked."""
    data = Dataset.synthetic(300, 50, seed=2)
    first = RunPlan.for_data(cnn_config(), data)
    second = RunPlan.for_data(cnn_config(seed=9, lr=0.004), data)
    stage = cls(first, data)  # not set up: its model is the stand-in
    stage.recipe, stage.model, stage.done = recipe_of(first.config, 3, 1, stage.precision), DeviceModelStandIn(), 300
    assert stage.restart(second)
    (call, recipe), (load, params, orders), reset = stage.model.calls
    assert (call, load, reset) == ("set_recipe", "load", ("reset", DeviceModelStandIn.stream))
    assert recipe == stage.recipe == recipe_of(second.config, 3, 1, stage.precision) and recipe.schedule.lr == 0.004
    assert all(np.array_equal(p, q) for p, q in zip(params, flat_params(second.initial)))
    assert orders is second.orders and stage.plan is second and stage.done == 0

    stage.model = DeviceModelStandIn(refuse=True)
    assert not stage.restart(RunPlan.for_data(cnn_config(seed=1), data))
    assert [c[0] for c in stage.model.calls] == ["set_recipe"]  # nothing loaded
    assert stage.plan is second and stage.recipe.schedule.lr == 0.004
    stage.model = DeviceModelStandIn()
    assert not stage.restart(RunPlan.for_data(cnn_config(batch=50), data)) and stage.model.calls == []


# ---- the sweep's set-up rows -----------------------------------------------------------------


def test_the_sweep_sets_a_row_up_once_per_shape_and_restarts_it_for_the_rest():
    """Two widths × two lrs × two seeds on numpy: per width the first point sets the row up, the
    other three restart it (their setup_ms the restart's); every model is the one trained alone."""
    data = small_data()
    points = sweep.expand_grid(mlp_config(), ["numpy"], [], hidden_sizes=[8, 16], lrs=[0.05, 0.2], seeds=[0, 4])
    rows, summary = sweep.run_sweep(points, sweep.InProcess(), sweep.DataSource("small"), data=data)
    assert [row["restarted"] for row in rows] == [False, True, True, True] * 2
    assert summary["restarted"] == 6 and summary["trained"] == 8
    for row, point in zip(rows, points):
        alone = training.train(point.config, "numpy", data=data)
        assert row["weights_sha256"] == sweep.weights_digest(alone.params), point
    assert sweep._set_up == []  # the engine closed its rows at the end


def test_the_sweep_draws_a_plan_once_per_seed_and_shape(monkeypatch):
    """Three rates × two seeds: two plans drawn, each point's plan its own config over the seed's
    arrays (the same arrays a plan of that point alone draws); past the byte bound only the newest
    plan is kept, and the engine drops them at the end."""
    data = small_data()
    built = []
    real_build = RunPlan.build.__func__

    def build(cls, config, *args, **kwargs):
        built.append(config)
        return real_build(cls, config, *args, **kwargs)

    monkeypatch.setattr(RunPlan, "build", classmethod(build))
    points = sweep.expand_grid(mlp_config(), ["numpy"], [], lrs=[0.05, 0.1, 0.2], seeds=[0, 4])
    plans = [sweep.shared_plan(point.config, data) for point in points]
    assert [config.seed for config in built] == [0, 4]
    for point, plan in zip(points, plans):
        alone = RunPlan.for_data(point.config, data)
        assert plan.config == alone.config and plan.config.lr == point.config.lr
        assert np.array_equal(plan.orders, alone.orders) and plan.batches == alone.batches
        assert all(np.array_equal(a.w, b.w) and np.array_equal(a.b, b.b) for a, b in zip(plan.initial, alone.initial))
    assert sweep.shared_plan(points[0].config, small_data(seed=4)) is not plans[0]  # another dataset: drawn anew
    monkeypatch.setattr(sweep, "PLAN_CACHE_BYTES", 1)
    built.clear()
    sweep.shared_plan(points[0].config, data)
    sweep.shared_plan(points[1].config, data)
    assert len(sweep._plans) == 1 and len(built) == 2
    sweep.run_sweep(points[:1], sweep.InProcess(), sweep.DataSource("small"), data=data)
    assert sweep._plans == {}


class RefusesEveryPlan(NumpyStage):
    """A row that can restart in principle but takes no plan (as a GPU row whose captures hold the recipe)."""

    closed = 0

    def restart(self, plan: RunPlan) -> bool:
        return False

    def close(self) -> None:
        type(self).closed += 1


class CannotRestart(NumpyStage):
    """A row without restart (Stage's: no plan in place), closed after each run."""

    restart = Stage.restart
    closed = 0

    def close(self) -> None:
        type(self).closed += 1


@pytest.mark.parametrize("cls", [RefusesEveryPlan, CannotRestart])
def test_set_up_rows_set_a_row_up_anew_where_it_cannot_restart(cls):
    data = small_data()
    rows = training.SetUpRows()
    records = [rows.train(cls, RunPlan.for_data(mlp_config(seed=seed), data), data) for seed in (0, 1, 2)]
    assert [restarted for _, restarted in records] == [False] * 3
    assert (rows.setups, rows.restarts) == (3, 0)
    kept = 1 if cls.restarts() else 0  # a row that may restart is kept for the next plan
    assert cls.closed == 3 - kept and len(rows.rows) == kept
    rows.close()
    assert cls.closed == 3 and rows.rows == {}


def test_set_up_rows_restart_on_the_same_data_only_and_drop_a_row_that_failed():
    data, other = small_data(), small_data(seed=4)
    rows = training.SetUpRows()
    assert not rows.train(NumpyStage, RunPlan.for_data(mlp_config(), data), data)[1]
    assert rows.train(NumpyStage, RunPlan.for_data(mlp_config(seed=1), data), data)[1]
    assert not rows.train(NumpyStage, RunPlan.for_data(mlp_config(), other), other)[1]  # another dataset object
    with pytest.raises(training.TrainingError):
        rows.train(NumpyStage, RunPlan.for_data(mlp_config(lr=1e30), other), other)
    assert rows.rows == {}  # a failed row is not kept
    assert (rows.setups, rows.restarts) == (2, 2)  # the failed run was a restart too
    rows.close()


# ---- the recipe's pieces a restart reads -----------------------------------------------------


@pytest.mark.parametrize("kind", ["constant", "warmup", "one-cycle", "cosine"])
def test_the_rate_on_the_device_is_the_schedules(kind):
    """schedule_rate, the formula the framework peers compile (here with numpy as the array
    module), against Schedule.at, step by step; the peak an array, as a restart writes it."""
    schedule = Schedule(kind, 0.01, 47, warmup_steps=5)
    k = np.arange(47, dtype=np.float64)
    rates = schedule_rate(schedule, k, np.float64(0.01), np)
    want = np.array([schedule.at(step) for step in range(47)])
    assert np.max(np.abs(rates - want) / want) < 1e-12, kind
    doubled = schedule_rate(schedule, k, np.float64(0.02), np)
    assert np.allclose(doubled, 2 * want, rtol=1e-12), kind


def test_recipes_that_differ_in_the_peak_only():
    recipe = recipe_of(cnn_config(), 10, 1)
    assert recipe_of(cnn_config(lr=0.3), 10, 1).but_for_the_peak() == recipe.but_for_the_peak()
    for other in (cnn_config(schedule="cosine"), cnn_config(betas=(0.8, 0.9)), cnn_config(optimizer="adamw")):
        assert recipe_of(other, 10, 1).but_for_the_peak() != recipe.but_for_the_peak(), other


def test_every_row_of_a_process_gets_the_same_normalised_images():
    data = small_data()
    first = normalised(data.train_images)
    assert normalised(data.train_images) is first
    assert normalised(data.train_images.copy()) is not first
    np.testing.assert_array_equal(first, normalised(data.train_images.copy()))


# ---- the sweep's report of itself ------------------------------------------------------------


def test_the_sweeps_training_time_counts_each_pack_once_and_its_rate_is_over_the_process_wall():
    rows = [{"stage": "numpy", "kind": "stage", "train_ms": 10.0, "epochs": [{"ms": 10.0}]},
            {"stage": "persistent", "kind": "stage", "device": "GPU 0", "train_ms": 30.0, "packed": {"id": 1}},
            {"stage": "persistent", "kind": "stage", "device": "GPU 0", "train_ms": 30.0, "packed": {"id": 1}},
            {"stage": "persistent", "kind": "stage", "device": "GPU 1", "train_ms": 20.0, "packed": {"id": 1}}]
    assert sweep.training_ms(rows) == 10.0 + 30.0 + 20.0
    summary = {"models": 4, "tasks": 3, "engine": "this process", "wall_ms": 900.0, "trained": 4,
               "train_ms": 60.0, "restarted": 0}
    sweep.add_process_wall(summary, 2000.0, "process")
    assert summary["process_wall_ms"] == 2000.0 and summary["models_per_s"] == pytest.approx(2.0)
    from graphtrain import report

    lines = report.sweep_summary_lines(summary)
    assert lines[1] == "training: 60.00 ms for the 4 models that trained (each pack once)"
    assert lines[2] == "process wall: 2.00 s from the process's start to the sweep's end, 2.0 models per second"


def test_the_sweep_command_reports_its_wall_training_and_rate_in_the_table_json_and_markdown(tmp_path):
    from test_cli import invoke

    data = small_data()
    path = tmp_path / "small.npz"
    np.savez(path, x_train=data.train_images, y_train=data.train_labels, x_test=data.test_images,
             y_test=data.test_labels)
    result = invoke("sweep", "--data", str(path), "--stages", "numpy", "--no-peers", "--batch", "50",
                    "--epochs", "1", "--lrs", "0.05,0.1", "--seeds", "0-1", "--out", str(tmp_path / "out"),
                    "--json", str(tmp_path / "grid.json"))
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "grid.json").read_text())
    summary = document["sweep"]
    assert summary["trained"] == 4 and summary["restarted"] == 3
    assert summary["train_ms"] == pytest.approx(sum(r["train_ms"] for r in document["records"]))
    assert summary["process_wall_ms"] > summary["wall_ms"] > 0 and summary["process_wall_from"] in ("process", "import")
    assert summary["models_per_s"] == pytest.approx(4 / (summary["process_wall_ms"] / 1e3))
    written = json.loads(next((tmp_path / "out").glob("sweep-*.json")).read_text())
    assert written["sweep"] == summary
    markdown = next((tmp_path / "out").glob("sweep-*.md")).read_text()
    table = " ".join(result.stdout.split())
    for text in (markdown, table):
        assert "models that trained" in text and "process wall: " in text and "models per second" in text
    assert [r["restarted"] for r in document["records"]] == [False, True, True, True]
