"""The sweep's grid, its tasks and packs, its engines and its table, on the CPU (the numpy rung
trains; worker processes are spawned for real, bound to made-up GPU numbers)."""

import dataclasses
import json
import sys

import numpy as np
import pytest
from rich.console import Console

from graphtrain import sweep, workers
from graphtrain.config import PRESETS, TrainConfig
from graphtrain.data import Dataset
from graphtrain.errors import GpuUnavailableError, UsageError
from graphtrain.packed import lane_schedule, lanes_for

JHU = PRESETS["jhu"]


def small_data():
    return Dataset.synthetic(600, 200, seed=3, num_features=20, num_classes=4)


@pytest.fixture
def npz_source(tmp_path):
    data = small_data()
    path = tmp_path / "small.npz"
    np.savez(path, x_train=data.train_images, y_train=data.train_labels, x_test=data.test_images,
             y_test=data.test_labels)
    return sweep.DataSource("small", data_file=path)


def small_config(**changes):
    return TrainConfig(hidden=(), batch=50, epochs=2, lr=0.1, seed=0, in_features=20, classes=4).replace(**changes)


# ---- the grid -------------------------------------------------------------------------------


def test_the_grid_is_the_cross_product_in_order():
    points = sweep.expand_grid(JHU, ["persistent", "graphs"], ["jax-vmap"], hidden_sizes=[], lrs=[0.05, 0.1, 0.2],
                               seeds=[0, 1])
    assert len(points) == 3 * 2 * 3
    assert [p.index for p in points] == list(range(18))
    assert [(p.config.lr, p.config.seed, p.name) for p in points[:4]] == [
        (0.05, 0, "persistent"), (0.05, 0, "graphs"), (0.05, 0, "jax-vmap"), (0.05, 1, "persistent")]
    assert points[2].kind == "peer" and points[0].kind == "stage"
    assert all(p.config.epochs == 20 and p.config.batch == 128 for p in points)


def test_hidden_sizes_set_every_hidden_layer_and_default_to_three():
    points = sweep.expand_grid(JHU, ["numpy"], [], hidden_sizes=[8, 16])
    assert [(p.hidden_size, p.config.hidden) for p in points] == [(8, (8, 8, 8)), (16, (16, 16, 16))]
    mlp = sweep.expand_grid(PRESETS["cuda-mlp"], ["numpy"], [], hidden_sizes=[32])
    assert mlp[0].config.hidden == (32,) * 4


def test_without_grid_options_the_grid_is_the_config_itself():
    points = sweep.expand_grid(JHU, ["numpy"], [])
    assert len(points) == 1 and points[0].config == JHU and points[0].hidden_size is None


@pytest.mark.parametrize("kwargs, words", [
    ({"lrs": [0.1, 0.1]}, "--lrs repeats"),
    ({"seeds": [1, 2, 1]}, "--seeds repeats"),
    ({"lrs": [-0.1]}, "lr must be"),
    ({"seeds": [-1]}, "seed must be"),
])
def test_bad_grid_values_are_usage_errors(kwargs, words):
    with pytest.raises(UsageError, match=words):
        sweep.expand_grid(JHU, ["numpy"], [], **kwargs)


def test_parse_seeds_and_floats():
    assert sweep.parse_seeds("0-3,7") == [0, 1, 2, 3, 7]
    assert sweep.parse_seeds(None) == []
    assert sweep.parse_floats("--lrs", "0.05, 0.1") == [0.05, 0.1]
    for bad in ("a", "3-1", ","):
        with pytest.raises(UsageError):
            sweep.parse_seeds(bad)
    with pytest.raises(UsageError, match="--lrs"):
        sweep.parse_floats("--lrs", "0.1,x")


# ---- tasks and packs ------------------------------------------------------------------------


def test_persistent_softmax_regressions_pack_and_the_rest_run_alone():
    points = sweep.expand_grid(JHU, ["persistent", "graphs"], [], lrs=[0.05, 0.1], seeds=[0, 1])
    tasks = sweep.make_tasks(points, pack=True)
    packs = [t for t in tasks if t.packed]
    assert len(packs) == 1 and [p.index for p in packs[0].points] == [0, 2, 4, 6]
    assert sorted(p.index for t in tasks for p in t.points) == list(range(8))
    assert all(len(t.points) == 1 for t in tasks if not t.packed)
    assert not any(t.packed for t in sweep.make_tasks(points, pack=False))


def test_a_pack_splits_into_one_per_worker_in_near_equal_shares():
    points = sweep.expand_grid(JHU, ["persistent"], [], lrs=[0.05, 0.1, 0.2], seeds=[0, 1, 2])
    tasks = sweep.make_tasks(points, pack=True, workers=2)
    assert [len(t.points) for t in tasks] == [4, 5]
    assert [p.index for t in tasks for p in t.points] == list(range(9))


def test_mlps_and_different_workloads_never_share_a_pack():
    mlp = sweep.expand_grid(JHU, ["persistent"], [], hidden_sizes=[128], lrs=[0.1, 0.2])
    assert not any(t.packed for t in sweep.make_tasks(mlp))
    vmapped = sweep.expand_grid(JHU, ["numpy"], ["jax-vmap"], lrs=[0.1, 0.2])
    tasks = sweep.make_tasks(vmapped, pack=False)  # the vmapped peer is a pack by nature
    assert [(t.points[0].name, len(t.points)) for t in tasks] == [("numpy", 1), ("jax-vmap", 2), ("numpy", 1)]


def test_lanes_hold_as_many_clusters_as_the_sms():
    assert lanes_for(132, 16, 64) == 8
    assert lanes_for(132, 16, 3) == 3
    assert lanes_for(8, 16, 5) == 1
    assert lane_schedule(5, 2) == [[0, 2, 4], [1, 3]]


# ---- gathering ------------------------------------------------------------------------------


def test_gather_orders_rows_and_refuses_a_lost_or_doubled_one():
    rows = [{"index": 2}, {"index": 0}, {"index": 1}]
    assert [r["index"] for r in sweep.gather(rows)] == [0, 1, 2]
    with pytest.raises(RuntimeError):
        sweep.gather([{"index": 0}, {"index": 2}])
    with pytest.raises(RuntimeError):
        sweep.gather([{"index": 0}, {"index": 0}])


# ---- engines --------------------------------------------------------------------------------


def _train_alone(config, data):
    from graphtrain import training

    return sweep.weights_digest(training.train(config, "numpy", data=data).params)


def test_in_process_rows_equal_each_model_trained_alone():
    data = small_data()
    points = sweep.expand_grid(small_config(), ["numpy"], [], lrs=[0.05, 0.2], seeds=[0, 4])
    rows, summary = sweep.run_sweep(points, sweep.InProcess(), sweep.DataSource("small"), data=data)
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert summary["models"] == 4 and summary["tasks"] == 4 and summary["wall_ms"] > 0
    for row, point in zip(rows, points):
        assert row["device"] == "CPU" and row["config"]["lr"] == point.config.lr
        assert row["weights_sha256"] == _train_alone(point.config, data), point
        assert row["train_ms"] == pytest.approx(sum(e["ms"] for e in row["epochs"]))
    assert len({r["weights_sha256"] for r in rows}) == 4


def test_gpu_workers_schedule_every_row_and_gather_the_same_table(npz_source):
    """Two spawned workers (bound to GPU numbers 0 and 1; the numpy rung never asks for one)
    share six rows; the gathered table is the in-process one, row for row, weights included."""
    data = npz_source.load()
    points = sweep.expand_grid(small_config(), ["numpy"], [], lrs=[0.05, 0.1, 0.2], seeds=[0, 1])
    done = []
    rows, summary = sweep.run_sweep(points, workers.GpuWorkers([0, 1]), npz_source,
                                    on_task=lambda task, task_rows: done.append(task.points[0].index))
    assert sorted(done) == list(range(6)) and summary["workers"] == 2
    alone, _ = sweep.run_sweep(points, sweep.InProcess(), npz_source, data=data)
    assert [r["weights_sha256"] for r in rows] == [r["weights_sha256"] for r in alone]
    assert {r["device"] for r in rows} <= {"GPU 0", "GPU 1"}
    assert all(r["index"] == i for i, r in enumerate(rows))


def test_a_worker_that_cannot_load_the_data_fails_its_rows(tmp_path):
    source = sweep.DataSource("missing", data_file=tmp_path / "nowhere.npz")
    points = sweep.expand_grid(small_config(), ["numpy"], [], seeds=[0, 1])
    rows, _ = sweep.run_sweep(points, workers.GpuWorkers([0]), source)
    assert [r["index"] for r in rows] == [0, 1]
    assert all("error" in r and "could not start" in r["error"] for r in rows)


def test_a_row_that_fails_does_not_stop_the_others(monkeypatch):
    from graphtrain.errors import TrainingError

    train_one = sweep._train_one

    def diverging_at_lr_2(point, data):
        if point.config.lr == 2:
            raise TrainingError("the training loss became nan")
        return train_one(point, data)

    monkeypatch.setattr(sweep, "_train_one", diverging_at_lr_2)
    points = sweep.expand_grid(small_config(), ["numpy"], [], lrs=[2, 0.1])
    rows, _ = sweep.run_sweep(points, sweep.InProcess(), sweep.DataSource("small"), data=small_data())
    assert rows[0]["error"] == "TrainingError: the training loss became nan" and not rows[0]["skipped"]
    assert "error" not in rows[1] and rows[1]["test_accuracy"] > 0


# ---- --gpus ---------------------------------------------------------------------------------


def test_gpus_are_counted_and_too_many_refused(monkeypatch):
    monkeypatch.setattr(workers, "gpu_count", lambda: 2)
    assert workers.resolve_gpus("all") == [0, 1]
    assert workers.resolve_gpus("1") == [0]
    with pytest.raises(UsageError, match="this machine has 2 GPU"):
        workers.resolve_gpus("4")
    for bad in ("0", "two", "-1"):
        with pytest.raises(UsageError, match="--gpus wants"):
            workers.resolve_gpus(bad)

    def no_driver():
        raise GpuUnavailableError("no NVIDIA driver found")

    monkeypatch.setattr(workers, "gpu_count", no_driver)
    with pytest.raises(UsageError, match="no GPU to run on"):
        workers.resolve_gpus("all")


def test_sweep_command_refuses_more_gpus_than_there_are(monkeypatch, mnist_dir):
    from test_cli import invoke, one_line_error

    monkeypatch.setattr(workers, "gpu_count", lambda: 1)
    line = one_line_error(invoke("sweep", "--data-dir", str(mnist_dir), "--gpus", "2", "--no-peers",
                                 "--stages", "numpy", "--epochs", "1"), 2)
    assert line == "error: --gpus 2: this machine has 1 GPU(s)"


def test_sweep_command_grid_json_and_report(tmp_path, monkeypatch):
    from test_cli import invoke

    data = small_data()
    path = tmp_path / "small.npz"
    np.savez(path, x_train=data.train_images, y_train=data.train_labels, x_test=data.test_images,
             y_test=data.test_labels)
    result = invoke("sweep", "--data", str(path), "--stages", "numpy", "--no-peers", "--batch", "50",
                    "--epochs", "2", "--lrs", "0.05,0.1", "--seeds", "0-1", "--out", str(tmp_path / "out"),
                    "--json", str(tmp_path / "grid.json"))
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "grid.json").read_text())
    assert [(r["config"]["lr"], r["config"]["seed"]) for r in document["records"]] == [
        (0.05, 0), (0.05, 1), (0.1, 0), (0.1, 1)]
    assert document["sweep"]["models"] == 4
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["sweep-jhu-softmax-b50-e2-small-cpu.json", "sweep-jhu-softmax-b50-e2-small-cpu.md"]
    assert "| numpy | 0.05 | 0 | CPU |" in (tmp_path / "out" / written[1]).read_text()


# ---- the table ------------------------------------------------------------------------------


def test_the_table_shows_device_time_accuracy_and_loss_curve():
    epochs = [{"ms": 1.0, "train_loss": loss} for loss in (2.0, 1.0, 0.5)]
    row = {"stage": "persistent", "kind": "stage", "config": {"lr": 0.1, "seed": 3}, "device": "GPU 1",
           "epoch_ms": 1.0, "epochs": epochs, "train_ms": 150.0, "test_accuracy": 0.92,
           "packed": {"models": 64, "train_ms": 150.0, "how": "8 clusters at once", "id": "p"}, "index": 0}
    failed = {"stage": "graphs", "kind": "stage", "config": {"lr": 0.1, "seed": 3}, "error": "no GPU",
              "skipped": True, "index": 1, "device": "GPU 0"}
    assert sweep.loss_curve(row) == "█▃▁ 0.5000"
    long = {"epochs": [{"train_loss": 2.0 - 0.1 * i} for i in range(20)]}
    assert sweep.loss_curve(long) == "██▇▆▅▄▃▂▁▁ 0.1000"
    console = Console(record=True, width=160)
    console.print(sweep.grid_table([row, failed], {"models": 2, "tasks": 2, "engine": "this process",
                                                   "wall_ms": 1500.0}))
    text = console.export_text()
    assert "GPU 1" in text and "92.00%" in text and "skipped: no GPU" in text
    assert " H " not in text.splitlines()[2]  # no width swept, no H column
    words = " ".join(text.split())  # the caption wraps at the table's width
    assert "persistent on GPU 1: 64 models trained together in 150.00 ms, 8 clusters at once" in words


# ---- --cluster ------------------------------------------------------------------------------


def test_a_local_dask_cluster_gives_the_table_of_the_gpu_workers(npz_source):
    """Needs graphtrain[cluster]; skipped without it (the extra is optional)."""
    pytest.importorskip("distributed")
    from graphtrain.cluster import DaskCluster

    points = sweep.expand_grid(small_config(), ["numpy"], [], lrs=[0.05, 0.2], seeds=[0, 1])
    rows, summary = sweep.run_sweep(points, DaskCluster(None, [0, 1]), npz_source)
    alone, _ = sweep.run_sweep(points, sweep.InProcess(), npz_source, data=npz_source.load())
    assert [r["weights_sha256"] for r in rows] == [r["weights_sha256"] for r in alone]
    assert {r["device"] for r in rows} <= {"GPU 0", "GPU 1"} and summary["workers"] == 2


def test_cluster_without_dask_is_one_line(monkeypatch, mnist_dir):
    import builtins

    from test_cli import invoke, one_line_error

    real_import = builtins.__import__

    def no_distributed(name, *args, **kwargs):
        if name == "distributed" or name.startswith("distributed."):
            raise ImportError("No module named 'distributed'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_distributed)
    line = one_line_error(invoke("sweep", "--data-dir", str(mnist_dir), "--cluster", "local", "--no-peers",
                                 "--stages", "numpy", "--epochs", "1"), 2)
    assert "graphtrain[cluster]" in line


def test_a_pack_plans_its_buffers_without_a_gpu():
    """Every model its own orders, parameters and metrics; the images, labels and test set once."""
    from graphtrain.kernels.persistent import Shape
    from graphtrain.packed import PackBuffers
    from graphtrain.plan import RunPlan

    data = small_data()
    plans = [RunPlan.for_data(small_config(lr=lr, seed=seed), data) for lr, seed in ((0.1, 0), (0.2, 1), (0.3, 2))]
    pack = PackBuffers(plans, data, Shape(20, 4, 50, bf16=True))
    addresses = {id(b) for b in [*pack.orders, *pack.metrics, *(p.w[0] for p in pack.params),
                                 *(p.b[0] for p in pack.params)]}
    assert len(addresses) == 4 * 3
    assert [o.size for o in pack.orders] == [2 * 600] * 3
    assert [m.shape for m in pack.metrics] == [(2, 2)] * 3
    assert pack.images.shape == (600, Shape(20, 4, 50, bf16=True).padded_features)



def test_a_pack_takes_models_that_differ_only_in_learning_rate_and_seed():
    from graphtrain.packed import check_pack
    from graphtrain.plan import RunPlan

    data = small_data()
    check_pack([RunPlan.for_data(small_config(lr=lr, seed=seed), data) for lr, seed in ((0.1, 0), (0.2, 1))])
    with pytest.raises(ValueError, match="everything but the learning rate and the seed"):
        check_pack([RunPlan.for_data(small_config(batch=batch), data) for batch in (50, 60)])


class _DiesWhenRead:
    def __getattr__(self, name):
        import os

        os._exit(7)  # the worker process dies in the middle of a task, as an out-of-memory kill would


@dataclasses.dataclass(frozen=True)
class DyingSource(sweep.DataSource):
    def load(self):
        return _DiesWhenRead()


def test_a_worker_that_dies_fails_its_task_and_the_rows_nobody_ran():
    points = sweep.expand_grid(small_config(), ["numpy"], [], seeds=[0, 1])
    rows, _ = sweep.run_sweep(points, workers.GpuWorkers([0]), DyingSource("small"))
    assert [r["index"] for r in rows] == [0, 1]
    assert rows[0]["error"] == "the worker on GPU 0 exited (code 7) while training this row"
    assert rows[1]["error"] == "every worker exited before this row ran"


# ---- a sweep over widths: one plan per grid point, the classic report ----------------------


def test_a_width_sweep_trains_each_size_and_writes_the_classic_report(tmp_path, monkeypatch):
    from graphtrain import report

    monkeypatch.setitem(sys.modules, "jax", None)  # as on a machine without jax
    config = PRESETS["cuda-mnist"].replace(steps=30, lr=0.05)
    points = sweep.expand_grid(config, ["numpy"], ["jax-scan"], hidden_sizes=[8, 16])
    records, _ = sweep.run_sweep(points, sweep.InProcess(), sweep.DataSource("small"), data=ladder_data())
    assert [(r["hidden_size"], r["stage"]) for r in records] == [
        (8, "numpy"), (8, "jax-scan"), (16, "numpy"), (16, "jax-scan")]
    assert tuple(records[0]["config"]["hidden"]) == (8, 8, 8)
    assert tuple(records[2]["config"]["hidden"]) == (16, 16, 16)
    assert sum(e["batches"] for e in records[0]["epochs"]) == 30
    assert records[1]["skipped"] is True
    assert sweep.only_sizes_vary(points, records)
    label = sweep.grid_label(config, sizes=True, lrs=False, seeds=False)
    report.write_sweep(records, label, tmp_path, "graphtrain sweep", log=lambda m: None,
                       partial=report.has_problems(records))
    assert (tmp_path / "sweep-cuda-mnist-mlpHx3-s30-lr0.05-cpu-partial.md").exists()  # jax-scan was skipped
    saved = report.read_json(tmp_path / "sweep-cuda-mnist-mlpHx3-s30-lr0.05-cpu-partial.json")
    assert [r["hidden_size"] for r in saved["records"]] == [8, 8, 16, 16]


def test_a_width_of_zero_is_refused():
    with pytest.raises(UsageError):
        sweep.expand_grid(JHU, ["numpy"], [], hidden_sizes=[0])


def test_the_rows_of_a_grid_point_share_one_plan(monkeypatch):
    from graphtrain.stages.numpy_cpu import NumpyStage

    seen = []
    original = NumpyStage.setup

    def setup(self):
        seen.append((self.config.hidden, self.plan))
        original(self)

    monkeypatch.setattr(NumpyStage, "setup", setup)
    monkeypatch.setattr("graphtrain.stages.get_stage", lambda name: type(name, (NumpyStage,), {"name": name}))
    points = sweep.expand_grid(PRESETS["cuda-mnist"].replace(steps=10), ["numpy", "graphs"], ["jax-scan"],
                               hidden_sizes=[8, 16])
    sweep.run_sweep(points, sweep.InProcess(), sweep.DataSource("small"), data=ladder_data())
    by_size = {}
    for hidden, plan in seen:
        by_size.setdefault(hidden, set()).add(id(plan))
    assert sorted(by_size) == [(8, 8, 8), (16, 16, 16)]
    assert all(len(ids) == 1 for ids in by_size.values())
    assert len(seen) == 6  # the rows ran


def ladder_data():
    return Dataset.synthetic(2000, 500, seed=0)


def test_a_cnn_sweep_names_and_describes_the_cnn():
    """A cnn sweep's files and workload line say cnn, its conv layers and its linear layers."""
    from graphtrain import report
    from graphtrain.config import preset
    from graphtrain.sweep import sweep_label

    config = preset("speedrun")
    assert sweep_label(config) == "speedrun-cnn24c5-32c3-256"
    cfg = {"model": "cnn", "conv": [list(c) for c in config.conv], "hidden": list(config.hidden), "classes": 10,
           "in_features": 784, "bias": True, "batch": 256, "epochs": 1, "lr": 0.01, "seed": 0}
    line = report.workload_line([{"config": cfg}], sweep=True)
    assert line.startswith("Workload: cnn (conv 24x5, conv 32x3, then 256→10)"), line
