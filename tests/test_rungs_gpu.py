"""The promises each GPU rung makes beyond its numbers (those are tests/test_oracle_gpu.py's):
same seed → same bits, host syncs and device allocations per run, graphs and nodes per step,
launches per epoch, the refusals, and the jhu preset's accuracy on real MNIST."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import MODELS, rel_err

from graphtrain.config import PRESETS, TrainConfig
from graphtrain.data import Dataset, load
from graphtrain.errors import TrainingError, UsageError
from graphtrain.plan import RunPlan
from graphtrain.stages import get_stage, stage_names
from graphtrain.training import train

RUNGS = [name for name in stage_names() if get_stage(name).uses_gpu]
RUNS = [(name, precision) for name in RUNGS for precision in get_stage(name).precisions]


def run_id(run) -> str:
    name, precision = run
    return name if precision == get_stage(name).precisions[0] else f"{name}-{precision}"


def stage_for(name: str, cfg: TrainConfig, data: Dataset):
    return get_stage(name)(RunPlan.for_data(cfg, data), data)


@pytest.mark.parametrize("model", ["softmax-regression", "mlp"])
@pytest.mark.parametrize("run", RUNS, ids=run_id)
def test_same_seed_gives_bit_identical_weights(run, model):
    name, precision = run
    data = Dataset.synthetic(2000, 100, seed=3)
    cfg = TrainConfig(**MODELS[model], batch=64, epochs=2, lr=0.1, seed=4, precision=precision)
    runs = []
    for _ in range(2):
        with stage_for(name, cfg, data) as stage:
            stage.setup()
            for epoch in range(2):
                stage.train_epoch(epoch, 32, measure=epoch == 1)
            runs.append(stage.weights())
    for a, b in zip(*runs):
        assert np.array_equal(a.w, b.w) and np.array_equal(a.b, b.b)


def count_epoch(stage_name: str, measure: bool, cfg: TrainConfig, data: Dataset):
    from graphtrain.libs import cuda

    with get_stage(stage_name)(RunPlan.for_data(cfg, data), data) as stage:
        stage.setup()
        cuda.reset_counters()
        stage.train_epoch(0, stage.plan.batches_per_epoch, measure)
        return cuda.counters.syncs, cuda.counters.d2h_copies


@pytest.mark.parametrize("stage_name", RUNGS)
def test_host_syncs_per_epoch(stage_name):
    data = Dataset.synthetic(1000, 300, seed=5)
    cfg = TrainConfig(batch=100, epochs=1, seed=1)
    steps = 10
    syncs, copies = count_epoch(stage_name, True, cfg, data)
    if stage_name == "baseline":
        # loss and accuracy copied back after every step, then the end-of-epoch event
        assert syncs == 2 * steps + 1 and copies == 2 * steps
    else:
        # the end-of-epoch event and one read of the metrics: nothing inside the batch loop
        assert syncs == 2 and copies == 1
    sparse_schedule = RunPlan.for_data(cfg.replace(epochs=2, metrics_every=2), data)
    if not get_stage(stage_name)(sparse_schedule, data).measures(0):  # a sparse-metrics rung
        assert count_epoch(stage_name, False, cfg, data) == (1, 0)


@pytest.mark.parametrize("stage_name", RUNGS)
def test_one_device_allocation_per_run(stage_name):
    from graphtrain.libs import cuda

    data = Dataset.synthetic(1000, 300, seed=6)
    cuda.reset_counters()
    train(TrainConfig(hidden=(64,), batch=50, epochs=2, seed=2), stage=stage_name, data=data)
    assert cuda.counters.mallocs == 1
    assert cuda.counters.frees == 1


def test_graphs_match_cudnn_softmax_after_an_epoch():
    data = Dataset.synthetic(2000, 300, seed=7)
    cfg = TrainConfig(hidden=(128, 64), batch=128, epochs=1, lr=0.1, seed=9)
    weights = {}
    for name in ("cudnn-softmax", "graphs"):
        with get_stage(name)(RunPlan.for_data(cfg, data), data) as stage:
            stage.setup()
            stage.train_epoch(0, 16, measure=True)
            weights[name] = stage.weights()
    for a, b in zip(weights["cudnn-softmax"], weights["graphs"]):
        assert rel_err(b.w, a.w) < 1e-6
        assert rel_err(b.b, a.b) < 1e-6


def test_graphs_capture_one_graph_per_batch_shape():
    data = Dataset.synthetic(1000, 300, seed=8)
    cfg = TrainConfig(batch=300, epochs=1, seed=1)
    with get_stage("graphs")(RunPlan.for_data(cfg, data), data) as stage:
        stage.setup()
        assert sorted(stage.graphs) == [(100, False), (100, True), (300, False), (300, True)]


@pytest.mark.parametrize("stage_name", RUNGS)
def test_nan_loss_stops_training_naming_the_epoch(stage_name):
    data = Dataset.synthetic(1000, 300, seed=9)
    cfg = TrainConfig(hidden=(64,), batch=100, epochs=2, lr=1e30, seed=1, metrics_every=1)
    with pytest.raises(TrainingError, match=r"epoch 1.*lower --lr"):
        train(cfg, stage=stage_name, data=data)


@pytest.mark.parametrize("name,hidden,bias,most", [
    ("fused", (), True, 2), ("fused", (64, 64, 64), True, 15), ("fused", (64, 64, 64), False, 14),
    ("bf16", (), True, 2), ("bf16", (64, 64, 64), True, 15),
])
def test_nodes_per_step(name, hidden, bias, most):
    data = Dataset.synthetic(600, 100, seed=1)
    cfg = TrainConfig(hidden=hidden, bias=bias, batch=100, epochs=1, seed=1)
    with stage_for(name, cfg, data) as stage:
        stage.setup()
        assert stage.nodes_per_step == most  # the targets: at most 5 and 16


def launches_in_an_epoch(stage, monkeypatch, num_batches: int) -> tuple[int, int, int]:
    """(graph launches, kernel launches, host syncs) while `stage` trains one epoch."""
    from graphtrain.libs import cuda, nvrtc

    counts = {"graph": 0, "kernel": 0}
    graph_launch, kernel_call = cuda.Graph.launch, nvrtc.Kernel.__call__

    def count_graph(self, stream):
        counts["graph"] += 1
        graph_launch(self, stream)

    def count_kernel(self, *args, **kwargs):
        counts["kernel"] += 1
        kernel_call(self, *args, **kwargs)

    monkeypatch.setattr(cuda.Graph, "launch", count_graph)
    monkeypatch.setattr(nvrtc.Kernel, "__call__", count_kernel)
    cuda.reset_counters()
    stage.train_epoch(1, num_batches, measure=False)
    monkeypatch.undo()
    return counts["graph"], counts["kernel"], cuda.counters.syncs


@pytest.mark.parametrize("name,hidden,graphs,kernels", [
    ("graphs", (), 10, 1), ("device-loop", (), 1, 0), ("persistent", (), 0, 1), ("persistent", (64, 64), 0, 1),
])
def test_launches_per_epoch(name, hidden, graphs, kernels, monkeypatch):
    """1000 samples at batch 100: `graphs` launches a graph per batch (and sets its cursor),
    device-loop one graph per epoch, persistent one kernel; each waits once, for the epoch's end."""
    data = Dataset.synthetic(1000, 100, seed=2)
    cfg = TrainConfig(hidden=hidden, batch=100, epochs=2, seed=2)
    with stage_for(name, cfg, data) as stage:
        stage.setup()
        stage.train_epoch(0, 10, measure=False)
        assert launches_in_an_epoch(stage, monkeypatch, 10) == (graphs, kernels, 1)
        if name == "device-loop":
            assert stage.loop_kind == "while"  # conditional nodes: CUDA 12.4 and later


def test_device_loop_matches_bf16_bit_for_bit():
    """The same step graphs, only launched from the device: the same weights, bit for bit."""
    data = Dataset.synthetic(1000, 100, seed=5)
    cfg = TrainConfig(hidden=(48,), batch=128, epochs=2, seed=5)  # 7 full batches and a tail of 104
    weights = {}
    for name in ("bf16", "device-loop"):
        with stage_for(name, cfg, data) as stage:
            stage.setup()
            for epoch in range(2):
                stage.train_epoch(epoch, 8, measure=True)
            weights[name] = stage.weights()
    for a, b in zip(weights["bf16"], weights["device-loop"]):
        assert np.array_equal(a.w, b.w) and np.array_equal(a.b, b.b)


def test_bf16_trains_softmax_regression_as_fused_bit_for_bit():
    """Softmax regression has no hidden layer to read bf16 operands: bf16 is the fused program at
    fp32 there, the same kernels with the same arguments, so the same weights, bit for bit."""
    data = Dataset.synthetic(1000, 100, seed=6)
    cfg = TrainConfig(batch=128, epochs=2, seed=6)
    weights = {}
    for name in ("fused", "bf16"):
        with stage_for(name, cfg, data) as stage:
            stage.setup()
            assert stage.precision == "fp32" and stage.nodes_per_step == 2, name
            for epoch in range(2):
                stage.train_epoch(epoch, 8, measure=True)
            weights[name] = stage.weights()
    for a, b in zip(weights["fused"], weights["bf16"]):
        assert np.array_equal(a.w, b.w) and np.array_equal(a.b, b.b)


def test_persistent_refuses_a_model_it_cannot_train():
    """What neither of its kernels trains: the cluster kernel's reason, then the grid kernel's (which
    takes any width in bf16, up to what its blocks' shared memory and the GPU's SMs hold)."""
    data = Dataset.synthetic(200, 50, seed=1)
    with pytest.raises(UsageError, match="multiple of 64.*nor can its grid kernel.*in bf16 only"):
        with stage_for("persistent", TrainConfig(hidden=(32,), batch=50, epochs=1, precision="fp32"), data) as stage:
            stage.setup()
    with pytest.raises(UsageError, match="the same size.*nor can its grid kernel.*the same size"):
        with stage_for("persistent", TrainConfig(hidden=(128, 64), batch=50, epochs=1), data) as stage:
            stage.setup()
    with pytest.raises(UsageError, match=r"784-784-784-784-10 MLP at batch 32: a block needs \d+ bytes of shared "
                                         r"memory \(at most 232448\), nor can its grid kernel"):
        with stage_for("persistent", TrainConfig(hidden=(784,) * 3, batch=32, epochs=1, precision="fp32"),
                       data) as stage:
            stage.setup()
    with pytest.raises(UsageError, match=r"nor can its grid kernel: .*blocks of 8 units, one per SM"):
        with stage_for("persistent", TrainConfig(hidden=(4096,) * 2, batch=32, epochs=1), data) as stage:
            stage.setup()
    with pytest.raises(UsageError, match="shared memory"):
        with stage_for("persistent", TrainConfig(batch=4096, epochs=1), Dataset.synthetic(5000, 50)) as stage:
            stage.setup()


def test_persistent_refusal_from_the_cli_is_one_line_and_writes_nothing(mnist_dir, tmp_path):
    out = tmp_path / "run.json"
    env = {**os.environ, "GRAPHTRAIN_DATA": str(mnist_dir)}
    proc = subprocess.run([sys.executable, "-m", "graphtrain", "run", "--stage", "persistent", "--hidden",
                           "784,784,784", "--batch", "32", "--epochs", "1", "--precision", "fp32", "--json", str(out)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "784-784-784-784-10 MLP" in lines[0] and "bytes of shared memory (at most 232448)" in lines[0]
    assert "the grid kernel trains in bf16 only" in lines[0]
    assert not out.exists()


def test_jhu_preset_reaches_the_numpy_accuracy(mnist_dir):
    data = load("mnist", data_dir=mnist_dir, offline=True)
    cfg = PRESETS["jhu"]
    numpy_acc = train(cfg, stage="numpy", data=data).test_accuracy
    assert numpy_acc >= 0.91
    for name in RUNGS:
        record = train(cfg, stage=name, data=data)
        assert abs(record.test_accuracy - numpy_acc) <= 0.003, name
        assert record.environment["gpu"]
