"""Every GPU stage against the float64 NumPy oracle, and the promises each rung makes."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers import rel_err

from graphtrain import reference
from graphtrain.config import PRESETS, TrainConfig
from graphtrain.data import Dataset, load
from graphtrain.errors import TrainingError
from graphtrain.plan import RunPlan
from graphtrain.stages import get_stage, stage_names
from graphtrain.training import train

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_device")]

GPU_STAGES = [name for name in stage_names() if name != "numpy"]
MLP_STAGES = GPU_STAGES
# The rungs whose dW and db land in buffers of their own (from `fused` on, SGD is fused into the
# products); the later rungs' own tests are in test_rungs_gpu.py.
GRADIENT_STAGES = GPU_STAGES[:GPU_STAGES.index("fused")]


def synthetic(seed: int, n_train=1000, n_test=300) -> Dataset:
    return Dataset.synthetic(n_train, n_test, seed=seed)


MODELS = {
    "softmax-regression": dict(hidden=(), bias=True),
    "mlp-bias": dict(hidden=(96, 40), bias=True),
    "mlp-no-bias": dict(hidden=(64,), bias=False),
}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stage_name", GRADIENT_STAGES)
def test_one_step_matches_float64_reference(stage_name, model):
    seed = int.from_bytes(os.urandom(2), "little")
    data = synthetic(seed)
    cfg = TrainConfig(**MODELS[model], batch=100, epochs=1, lr=0.1, seed=seed)
    stage = get_stage(stage_name)(RunPlan.for_data(cfg, data), data)
    with stage:
        stage.setup()
        result = stage.train_epoch(0, num_batches=1, measure=True)
        gpu_grads = [(dw.download(stage.stream), None if db is None else db.download(stage.stream))
                     for dw, db in zip(stage.dw, stage.db)]
        gpu_weights = stage.weights()

    layers = reference.init_params(cfg.dims, cfg.bias, seed, np.float64)
    idx = reference.epoch_order(seed, 0, len(data.train_images))[:cfg.batch]
    x, y = data.train_images[idx].astype(np.float64), data.train_labels[idx]
    acts = reference.forward(layers, x)
    loss, dlogits = reference.loss_and_dlogits(acts[-1], y)
    grads = reference.backward(layers, acts, dlogits)

    assert abs(result.train_loss - loss) / loss < 1e-5
    for (dw, db), grad, layer, new in zip(gpu_grads, grads, layers, gpu_weights):
        assert rel_err(dw, grad.w) < 1e-5
        # The update itself, not the weights it is added to (they would hide a wrong step).
        assert rel_err(new.w.astype(np.float64) - layer.w, -cfg.lr * grad.w) < 1e-4
        if cfg.bias:
            assert rel_err(db, grad.b) < 1e-5
            assert rel_err(new.b.astype(np.float64) - layer.b, -cfg.lr * grad.b) < 1e-4


@pytest.mark.parametrize("stage_name", GRADIENT_STAGES)
def test_tail_batch_is_a_real_smaller_batch(stage_name):
    """1000 samples at batch 300: the last step has 100 rows and its own mean."""
    seed = 11
    data = synthetic(seed)
    cfg = TrainConfig(hidden=(32,), batch=300, epochs=1, lr=0.1, seed=seed)
    gpu = train(cfg, stage=stage_name, data=data)
    layers = reference.init_params(cfg.dims, cfg.bias, seed, np.float64)
    order = reference.epoch_order(seed, 0, 1000)
    for lo, hi in reference.batch_bounds(1000, 300):
        reference.train_step(layers, data.train_images[order[lo:hi]].astype(np.float64),
                             data.train_labels[order[lo:hi]], cfg.lr)
    with get_stage(stage_name)(RunPlan.for_data(cfg, data), data) as stage:
        stage.setup()
        stage.train_epoch(0, 4, measure=True)
        weights = stage.weights()
    for new, ref in zip(weights, layers):
        assert rel_err(new.w, ref.w) < 1e-5
    assert gpu.epochs[0].batches == 4


def test_determinism_same_seed_bit_identical_weights():
    data = synthetic(3)
    cfg = TrainConfig(hidden=(64, 32), batch=64, epochs=2, lr=0.1, seed=4)
    for name in GRADIENT_STAGES:
        runs = []
        for _ in range(2):
            with get_stage(name)(RunPlan.for_data(cfg, data), data) as stage:
                stage.setup()
                for epoch in range(2):
                    stage.train_epoch(epoch, 16, measure=True)
                runs.append(stage.weights())
        for a, b in zip(*runs):
            assert np.array_equal(a.w, b.w) and np.array_equal(a.b, b.b), name


def count_epoch(stage_name: str, measure: bool, cfg: TrainConfig, data: Dataset):
    from graphtrain.libs import cuda

    with get_stage(stage_name)(RunPlan.for_data(cfg, data), data) as stage:
        stage.setup()
        cuda.reset_counters()
        stage.train_epoch(0, stage.plan.batches_per_epoch, measure)
        return cuda.counters.syncs, cuda.counters.d2h_copies


@pytest.mark.parametrize("stage_name", GPU_STAGES)
def test_host_syncs_per_epoch(stage_name):
    data = synthetic(5)
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


@pytest.mark.parametrize("stage_name", MLP_STAGES)
def test_one_device_allocation_per_run(stage_name):
    from graphtrain.libs import cuda

    data = synthetic(6)
    cuda.reset_counters()
    train(TrainConfig(hidden=(64,), batch=50, epochs=2, seed=2), stage=stage_name, data=data)
    assert cuda.counters.mallocs == 1
    assert cuda.counters.frees == 1


def test_graphs_match_cudnn_softmax_after_an_epoch():
    data = synthetic(7, n_train=2000)
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
    data = synthetic(8)
    cfg = TrainConfig(batch=300, epochs=1, seed=1)
    with get_stage("graphs")(RunPlan.for_data(cfg, data), data) as stage:
        stage.setup()
        assert sorted(stage.graphs) == [(100, False), (100, True), (300, False), (300, True)]


@pytest.mark.parametrize("stage_name", MLP_STAGES)
def test_nan_loss_stops_training_naming_the_epoch(stage_name):
    data = synthetic(9)
    cfg = TrainConfig(hidden=(64,), batch=100, epochs=2, lr=1e30, seed=1, metrics_every=1)
    with pytest.raises(TrainingError, match=r"epoch 1.*lower --lr"):
        train(cfg, stage=stage_name, data=data)


def test_jhu_preset_reaches_the_numpy_accuracy(mnist_dir):
    data = load("mnist", data_dir=mnist_dir, offline=True)
    cfg = PRESETS["jhu"]
    numpy_acc = train(cfg, stage="numpy", data=data).test_accuracy
    assert numpy_acc >= 0.91
    for name in GPU_STAGES:
        record = train(cfg, stage=name, data=data)
        assert abs(record.test_accuracy - numpy_acc) <= 0.003, name
        assert record.environment["gpu"]
