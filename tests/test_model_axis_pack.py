"""The cnn's packs on one model axis, without a GPU: the stride arithmetic (model k's copy of the
arena, the packs a count of models goes in), the linear layers' products (every product a step or
an evaluation queues was planned, for the axis's batch and stride), the refusals, and the sweep's
choice of the axis. tests/test_cnn_shared_gpu.py trains such packs against each model alone."""

from __future__ import annotations

import types

import numpy as np
import pytest

from graphtrain.libs import cuda
from graphtrain.libs.memory import Arena

BASE = 0x7000_0000_0000  # the fake allocation's address


@pytest.fixture
def fake_malloc(monkeypatch):
    """Arena.allocate without a GPU: one address for the allocation, nothing freed."""
    monkeypatch.setattr(cuda, "malloc", lambda nbytes: BASE)
    monkeypatch.setattr(cuda, "free", lambda ptr: None)


# ---- the stride and the packs -------------------------------------------------------------------


def test_the_axis_takes_its_stride_once_and_places_model_k_that_far_on_per_model():
    from graphtrain.stages.cnn_layers import ModelAxis

    one = ModelAxis()
    assert (one.models, one.stride, one.elements, one.launch) == (1, 0, 0, {"models": 1, "model_stride": 0})
    one.settle(4096)
    assert one.stride == 0 and one.at(BASE, 0) == BASE  # one model: the launches as they were
    three = ModelAxis(3)
    with pytest.raises(RuntimeError, match="not settled"):
        three.launch
    three.settle(3 << 20)
    assert three.launch == {"models": 3, "model_stride": 3 << 20} and three.elements == (3 << 20) // 4
    assert [three.at(BASE, k) for k in range(3)] == [BASE, BASE + (3 << 20), BASE + (6 << 20)]
    with pytest.raises(IndexError):
        three.at(BASE, 3)
    with pytest.raises(RuntimeError, match="once"):
        three.settle(4 << 20)


@pytest.mark.parametrize("models,stride,why", [(0, 256, "models must be"), (70_000, 256, "models must be"),
                                               (2, 100, "model_stride must be"), (2, 0, "one another's")])
def test_a_model_count_or_stride_the_kernels_cannot_take_is_refused(models, stride, why):
    from graphtrain.stages.cnn_layers import ModelAxis

    with pytest.raises(ValueError, match=why):
        ModelAxis(models).settle(stride)


@pytest.mark.parametrize("models", [1, 3])
def test_model_k_of_the_arena_lies_k_strides_after_model_0(fake_malloc, models):
    """CnnDevice's placement: the stride is one model's layout; models 1..K−1 follow model 0's."""
    from graphtrain.stages.cnn_device import CnnDevice
    from graphtrain.stages.cnn_layers import ModelAxis

    arena = Arena()
    arena.reserve("params", (1000,))
    arena.reserve("cursor", (1,), np.int32)
    layout = arena.nbytes
    model = types.SimpleNamespace(axis=ModelAxis(models), models=models, arena=arena)
    CnnDevice._place_models(model, arena)
    assert arena.nbytes == models * layout and CnnDevice.model_bytes.fget(model) == layout
    assert model.axis.stride == (layout if models > 1 else 0)
    cursor = arena.buffers["cursor"]
    arena.allocate()
    assert [model.axis.at(cursor.ptr, k) for k in range(models)] == [BASE + cursor.offset + k * layout
                                                                      for k in range(models)]


def test_the_models_go_in_as_few_packs_as_fit_their_sizes_within_one():
    from graphtrain.stages.cnn_pack import AXIS_MAX_MODELS, axis_packs

    assert axis_packs(64, 300) == [list(range(64))]
    assert axis_packs(5, 2) == [[0], [1, 2], [3, 4]]
    assert [len(p) for p in axis_packs(10, 4)] == [3, 3, 4]
    assert [len(p) for p in axis_packs(300, 10_000)] == [100, 100, 100]  # AXIS_MAX_MODELS a launch at most
    assert all(len(p) <= AXIS_MAX_MODELS for p in axis_packs(1000, 10_000))
    assert sum(axis_packs(77, 9), []) == list(range(77))
    with pytest.raises(ValueError, match="not even one"):
        axis_packs(3, 0)


# ---- the linear layers' products ---------------------------------------------------------------


class RecordingGemms:
    """LtGemms's two calls, recorded: what was planned, what was queued (its plan's key)."""

    def __init__(self):
        self.planned, self.queued = set(), []

    def plan(self, *key):
        self.planned.add(key)

    def gemm_strided_batched(self, transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c, ldc,
                             stride_c, batch):
        self.queued.append(((transa, transb, m, n, k, lda, stride_a, ldb, stride_b, ldc, stride_c, batch), c))


class Recorder:
    """Any launcher: each call recorded with its keyword arguments."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, kwargs))


@pytest.mark.parametrize("models", [1, 3])
def test_every_product_a_step_or_an_evaluation_queues_was_planned_for_the_axis(fake_malloc, models):
    """The speedrun cnn's two linear layers (800 → 256 → 10) at batch 96, evaluating 10000 rows a
    pass: each product an op queues was planned when the op was built (before any op runs, as a
    model builds its ops at setup), as a batch of K with the model stride in elements (one model:
    a batch of one, strides 0); each elementwise launch takes the axis; every output lies in
    model 0's copy of the arena."""
    from graphtrain.stages.cnn_layers import Linear, ModelAxis, ParameterSpan

    gemms, layers, fused, axis = RecordingGemms(), Recorder(), Recorder(), ModelAxis(models)
    arena = Arena()
    src, dsrc = arena.reserve("a1", (10_000, 800)), arena.reserve("da1", (96, 800))
    hidden = Linear(arena, 0, 800, 256, True, gemms, layers, fused, 96, 10_000, axis)
    logits = Linear(arena, 1, 256, 10, False, gemms, layers, fused, 96, 10_000, axis)
    ParameterSpan(arena, [hidden.w, hidden.b, logits.w, logits.b])
    stride = arena.nbytes
    axis.settle(stride)
    arena.allocate()
    ops = [*hidden.forward_ops(None, src.ptr, 96), *hidden.forward_ops(None, src.ptr, 10_000),
           *logits.forward_ops(None, hidden.h.ptr, 96), *logits.forward_ops(None, hidden.h.ptr, 10_000),
           *logits.backward_ops(None, hidden.h.ptr, hidden.dh.ptr, hidden),
           *hidden.backward_ops(None, src.ptr, dsrc.ptr, None)]
    planned_before_running = set(gemms.planned)
    for _, op in ops:
        op()
    assert len(gemms.queued) == 8 and gemms.planned == planned_before_running
    assert planned_before_running == {key for key, _ in gemms.queued}  # each planned is queued
    elements = stride // 4 if models > 1 else 0
    for key, c in gemms.queued:
        assert key in gemms.planned, key
        assert key[-1] == models and (key[6], key[8], key[10]) == (elements,) * 3, key
        assert BASE <= c < BASE + stride, key
    elementwise = layers.calls + fused.calls
    assert {name for name, _ in elementwise} == {"bias_relu", "relu_bias_grad"}
    assert all(kwargs == {"models": models, "model_stride": axis.stride} for _, kwargs in elementwise)


# ---- the refusals ----------------------------------------------------------------------------------


def speedrun_model_args(batch: int = 96):
    from graphtrain.config import cnn_spec, preset
    from graphtrain.recipe import recipe_of

    config = preset("speedrun").replace(batch=batch)
    images, labels = np.zeros((200, 784), np.float32), np.zeros(200, np.int32)
    return cnn_spec(config), recipe_of(config, 3, 1), images, labels, images[:50], labels[:50]


def test_a_model_axis_on_cudnns_convolutions_or_over_ranks_is_refused_before_the_gpu():
    """Refused before the device is touched (it is None here)."""
    from graphtrain.errors import ModelUnsupported
    from graphtrain.stages.cnn_device import CnnDevice

    args = speedrun_model_args()
    with pytest.raises(ModelUnsupported, match="cuDNN, whose calls have no model axis"):
        CnnDevice(None, *args, fused=False, models=4)
    with pytest.raises(ValueError, match="one GPU"):
        CnnDevice(None, *args, ranks=2, all_reduce=lambda *a: None, models=4)
    with pytest.raises(ValueError, match="models must be"):
        CnnDevice(None, *args, models=0)


def test_an_unknown_pack_mode_is_refused():
    from graphtrain.stages.cnn_pack import train_packed_cnn

    with pytest.raises(ValueError, match="axis, streams, graph"):
        train_packed_cnn([], None, mode="lanes")


# ---- the sweep's choice ------------------------------------------------------------------------------


def test_the_sweep_packs_the_cnn_on_one_model_axis(monkeypatch):
    """graphs and device-loop pack their cnns on the axis (the registry's Pack.mode), and the sweep
    hands the pack's trainer that mode; a pack without a mode gets none."""
    from graphtrain import stages, sweep
    from graphtrain.config import preset

    speedrun = preset("speedrun")
    for name in ("graphs", "device-loop"):
        assert stages.SPECS[name].pack_for(speedrun).mode == "axis", name
    assert stages.SPECS["jax-vmap"].pack_for(speedrun).mode is None
    calls = []
    monkeypatch.setattr(stages, "load_target", lambda target: lambda plans, data, **options: calls.append(
        (target, len(plans), options)) or ["record"] * len(plans))
    monkeypatch.setattr("graphtrain.plan.RunPlan.for_data", lambda config, data: config)
    for name in ("graphs", "jax-vmap"):
        points = tuple(types.SimpleNamespace(name=name, config=speedrun.replace(seed=seed)) for seed in range(2))
        sweep._train_pack(sweep.SweepTask(points), data=None)
    assert calls == [("graphtrain.stages.cnn_pack:pack_graphs", 2, {"mode": "axis"}),
                     (stages.SPECS["jax-vmap"].pack_cnn.target, 2, {})]
