"""The framework peers on a GPU: they train, their records match the stages', and the fp32 ones
follow the numpy stage step for step (same init, same order, same math).

Skipped, with the reason, where torch or jax or a CUDA GPU is missing. torch-compile runs in
"reduce-overhead" mode here (CUDA graphs, without max-autotune's minutes of kernel benchmarking)
unless GRAPHTRAIN_TORCH_COMPILE_MODE says otherwise.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from graphtrain import data as data_mod
from graphtrain.config import PRESETS
from graphtrain.data import Dataset
from graphtrain.peers import PeerUnavailable
from graphtrain.plan import RunPlan
from graphtrain.stages import get_stage, peer_names
from graphtrain.stages.numpy_cpu import NumpyStage
from graphtrain.training import train

from conftest import real_mnist

PEERS = ["torch-eager", "torch-compile", "torch-graph", "jax-scan", "torch-graph-bf16", "jax-scan-bf16"]
FP32_PEERS = ["torch-eager", "torch-graph", "jax-scan"]  # the others train bf16 products
BF16_PEERS = ["torch-compile", "torch-graph-bf16", "jax-scan-bf16"]


def require(name: str) -> None:
    """Skip unless the peer's framework and a GPU it can see are here."""
    if name.startswith("torch"):
        torch = pytest.importorskip("torch", reason="torch is not installed")
        if not torch.cuda.is_available():
            pytest.skip("no CUDA GPU visible to torch")
    else:
        jax = pytest.importorskip("jax", reason="jax is not installed")
        try:
            if not jax.devices("gpu"):
                raise RuntimeError
        except RuntimeError:
            pytest.skip("no CUDA GPU visible to jax")


@pytest.fixture(autouse=True)
def compile_mode(monkeypatch):
    if not os.environ.get("GRAPHTRAIN_TORCH_COMPILE_MODE"):
        monkeypatch.setenv("GRAPHTRAIN_TORCH_COMPILE_MODE", "reduce-overhead")


@pytest.fixture(scope="module")
def dataset() -> Dataset:
    """Real MNIST when $GRAPHTRAIN_DATA is set (a skip saying why where it does not hold it),
    else a learnable synthetic set."""
    if os.environ.get("GRAPHTRAIN_DATA"):
        folder, reason = real_mnist()
        if folder is None:
            pytest.skip(reason)
        return data_mod.load("mnist", data_dir=folder, offline=True)
    return Dataset.synthetic(6000, 1000, seed=3)


MODELS = {
    "softmax-regression": dict(hidden=(), bias=True),
    "mlp-bias": dict(hidden=(64, 32), bias=True),
    "mlp-no-bias": dict(hidden=(48,), bias=False),
}


def test_registry_lists_the_peers():
    assert peer_names() == PEERS


@pytest.mark.parametrize("model", ["softmax-regression", "mlp-bias"])
@pytest.mark.parametrize("name", PEERS)
def test_peer_trains_and_its_record_has_every_key(name, model, dataset):
    require(name)
    config = PRESETS["jhu"].replace(epochs=2, **MODELS[model])
    record = train(config, stage=name, data=dataset)

    reference_keys = set(train(config.replace(epochs=1), stage="numpy", data=Dataset.synthetic(300, 50)).to_json())
    assert reference_keys <= set(record.to_json())
    assert record.stage == name and record.kind == "peer" and record.note
    assert record.test_accuracy > 0.8
    assert len(record.epochs) == 2
    assert all(e.ms > 0 and np.isfinite(e.train_loss) for e in record.epochs)
    assert record.epochs[1].train_loss < record.epochs[0].train_loss
    assert 0 < record.setup_ms < record.total_ms
    env = record.environment
    assert env["gpu"] and (env.get("torch") or env.get("jax"))


def test_steps_run_whole_epochs_and_stop_the_last_early(dataset):
    require("torch-eager")
    n = len(dataset.train_images)
    per_epoch = -(-n // 128)
    config = PRESETS["jhu"].replace(steps=per_epoch + 5)
    record = train(config, stage="torch-eager", data=dataset)
    assert [e.batches for e in record.epochs] == [per_epoch, 5]
    assert [e.full for e in record.epochs] == [True, False]


def one_epoch(stage_cls, config, data):
    """Weights and train loss after the first epoch of `stage_cls` (a stage or a peer class)."""
    plan = RunPlan.for_data(config, data)
    with stage_cls(plan, data) as runner:
        runner.setup()
        result = runner.train_epoch(0, plan.batches[0], True)
        return runner.weights(), result.train_loss


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("name", FP32_PEERS)
def test_fp32_peer_follows_the_numpy_stage(name, model):
    """Same init, same sample order, same fp32 math: after an epoch, the same weights.

    The sums inside the matmuls run in a different order on the GPU than in NumPy's BLAS, so
    the two drift apart by rounding only: a few float32 ulps per step, compounded over the
    epoch's steps. The warm-up must not show: it would move the weights by whole SGD steps.
    """
    require(name)
    data = Dataset.synthetic(3000, 200, seed=11)  # 3000 = 23·128 + 56: a real tail batch
    config = PRESETS["jhu"].replace(epochs=1, **MODELS[model])
    ref_weights, ref_loss = one_epoch(NumpyStage, config, data)
    weights, loss = one_epoch(get_stage(name), config, data)
    assert loss == pytest.approx(ref_loss, rel=1e-4)
    assert len(weights) == len(ref_weights)
    for layer, ref in zip(weights, ref_weights):
        np.testing.assert_allclose(layer.w, ref.w, rtol=0, atol=2e-5)
        if ref.b is None:
            assert layer.b is None
        else:
            np.testing.assert_allclose(layer.b, ref.b, rtol=0, atol=2e-5)


@pytest.mark.parametrize("name", BF16_PEERS)
def test_bf16_peer_is_close_to_the_numpy_stage(name):
    """bf16 matmuls: the same training within bf16's rounding, not bit for bit."""
    require(name)
    assert get_stage(name).precisions == ("bf16",)
    data = Dataset.synthetic(3000, 200, seed=12)
    config = PRESETS["jhu"].replace(epochs=1)
    ref_weights, ref_loss = one_epoch(NumpyStage, config, data)
    weights, loss = one_epoch(get_stage(name), config, data)
    assert loss == pytest.approx(ref_loss, rel=0.05)
    scale = np.abs(ref_weights[0].w).max()
    assert np.abs(weights[0].w - ref_weights[0].w).max() < 0.05 * scale


def test_torch_peers_restore_tf32_flags(dataset):
    require("torch-eager")
    import torch

    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        train(PRESETS["jhu"].replace(epochs=1), stage="torch-eager", data=dataset)
        assert torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_missing_framework_is_unavailable_not_a_crash(monkeypatch, dataset):
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    with pytest.raises(PeerUnavailable, match="torch is not installed"):
        train(PRESETS["jhu"].replace(epochs=1), stage="torch-graph", data=dataset)
