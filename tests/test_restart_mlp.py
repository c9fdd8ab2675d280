"""The MLP rows set up once and restarted per plan (fused, bf16, device-loop, persistent), on the
CPU: what a restart writes (device memory stood in for by host memory: every byte it leaves is
read back), what the captured graphs hold of a plan (the kernels, products and library calls
stood in for by recorders: a capture holds exactly the calls recorded into it), which plans each
row refuses, and that the graphs are captured again only where a plan's value is baked into them.
On a GPU: tests/test_restart_mlp_gpu.py."""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest

from graphtrain.config import TrainConfig
from graphtrain.data import Dataset
from graphtrain.kernels.optim import CONSTANTS, constants_of
from graphtrain.libs import cuda
from graphtrain.libs.memory import Arena
from graphtrain.plan import RunPlan
from graphtrain.reference_cnn import Optimizer, Schedule
from graphtrain.stages import device
from graphtrain.stages.bf16 import Bf16Stage
from graphtrain.stages.device_loop import DeviceLoopStage
from graphtrain.stages.fused import FusedStage
from graphtrain.stages.fused_mlp import FusedMlp
from graphtrain.stages.persistent import PersistentStage

GARBAGE = 0xA7  # every byte of a trained row's memory, before a restart: what it leaves is the restart's


@pytest.fixture(scope="module")
def data() -> Dataset:
    return Dataset.synthetic(610, 200, seed=3, num_features=20, num_classes=4)  # batch 50: a tail of 10


def config(**changes) -> TrainConfig:
    return TrainConfig(hidden=(16, 8), batch=50, epochs=2, lr=0.05, seed=0, in_features=20, classes=4,
                       precision=None).replace(**changes)


@pytest.fixture
def host_memory(monkeypatch):
    """The arena's one allocation in host memory, copies and memsets on it: what a piece writes to
    the 'device' is there to read back."""
    blocks = {}

    def malloc(nbytes: int) -> int:
        block = np.zeros(nbytes + 256, np.uint8)
        base = (block.ctypes.data + 255) // 256 * 256
        blocks[base] = block
        return base

    def copy_to_device(dst: int, src, stream) -> None:
        host = np.ascontiguousarray(src)
        ctypes.memmove(int(dst), host.ctypes.data, host.nbytes)

    def copy_to_host(src: int, dst: np.ndarray, stream) -> np.ndarray:
        ctypes.memmove(dst.ctypes.data, int(src), dst.nbytes)
        return dst

    monkeypatch.setattr(cuda, "malloc", malloc)
    monkeypatch.setattr(cuda, "free", lambda ptr: blocks.pop(ptr))
    monkeypatch.setattr(cuda, "copy_to_device", copy_to_device)
    monkeypatch.setattr(cuda, "copy_to_host", copy_to_host)
    monkeypatch.setattr(cuda, "memset", lambda ptr, value, nbytes, stream: ctypes.memset(int(ptr), value, nbytes))
    return blocks


class Recorder:
    """A kernel file's or library's stand-in: every call of a method, with its arguments, in `log`."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def __getattr__(self, method: str):
        if method.startswith("__"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self.log.append((self.name, method, args, tuple(sorted(kwargs.items()))))


class Product:
    """An LtMatmul's stand-in: its calls (a, b, c, alpha, beta, stream) in `log`."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def __call__(self, *args) -> None:
        self.log.append((self.name, "matmul", args, ()))


STREAM = SimpleNamespace(handle=7, synchronize=lambda: None)


class FakeGraph:
    """cuda.Graph's stand-in: a capture holds the calls recorded into the log during it."""

    log: list = []
    captures = 0

    def __init__(self, calls):
        self.calls, self.closed = calls, False
        self.num_nodes = len(calls)

    @classmethod
    @contextmanager
    def capture(cls, stream):
        start, graph = len(cls.log), cls([])
        yield graph
        graph.calls = list(cls.log[start:])
        graph.num_nodes = len(graph.calls)
        del cls.log[start:]  # captured, not run
        FakeGraph.captures += 1

    def launch(self, stream) -> None:
        self.log.append(("graph", "launch", (id(self),), ()))

    def close(self) -> None:
        self.closed = True


class FakeLoop:
    """kernels.loop.Loop's stand-in: a WHILE node over the body recorded into it."""

    def __init__(self, log: list):
        self.log = log

    def record_while(self, stream, body, iterations_left, iterations, record_body) -> None:
        self.log.append(("loop", "while", (iterations_left, iterations), ()))
        record_body(body)
        self.log.append(("loop", "end while", (), ()))


@pytest.fixture
def log(monkeypatch) -> list:
    calls: list = []
    monkeypatch.setattr(FakeGraph, "log", calls)
    monkeypatch.setattr(cuda, "Graph", FakeGraph)
    return calls


def started_mlp(plan: RunPlan, data: Dataset, precision: str, log: list) -> tuple[FusedMlp, Arena]:
    """A FusedMlp whose arena is host memory and whose kernels and products are recorders, its
    memory garbage: a row after a run."""
    arena = Arena()
    mlp = FusedMlp(arena, plan, data, precision)
    arena.allocate()
    ctypes.memset(arena._base, GARBAGE, arena.nbytes)
    mlp.gather_cu, mlp.fused_cu = Recorder(log, "gather"), Recorder(log, "fused")
    mlp.lt = object()
    mlp.products = {rows: {role: [Product(log, f"{role}{i}") if role != "dx" or i > 0 else None
                                  for i in range(len(mlp.w) - 1)] for role in ("forward", "dx", "sgd")}
                    for rows in plan.batch_sizes}
    if mlp.optimizer is not None:
        mlp.optimizer.optim_cu, mlp.optimizer.uploads = Recorder(log, "optim"), STREAM
    return mlp, arena


def read(buf) -> np.ndarray:
    return buf.download(STREAM)


# ---- what a restart writes -------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recipe", [dict(), dict(optimizer="adam", schedule="cosine")], ids=["sgd", "adam"])
def test_start_run_writes_the_plans_weights_orders_and_recipe_and_zeroes_the_run(host_memory, log, data, precision,
                                                                                 recipe):
    """A restart of a row whose memory is garbage leaves the new plan's initial weights and
    orders, the optimizer's constants of its recipe with zero state, steps and gradients, zero
    metrics, the cursor at 0, and the bf16 copies refreshed from the new weights with rate 0."""
    first = RunPlan.for_data(config(**recipe), data)
    second = RunPlan.for_data(config(**{**recipe, "seed": 4, "lr": 0.1, **({"optimizer": "adamw"} if recipe else {})}),
                              data)
    mlp, arena = started_mlp(first, data, precision, log)
    with arena:
        mlp.start_run(second, STREAM)
        assert mlp.plan is second and mlp.config is second.config and mlp.dataset.plan is second
        np.testing.assert_array_equal(read(mlp.dataset.order), second.orders.ravel())
        for i, (got, want) in enumerate(zip(mlp.params.download(STREAM), second.initial)):
            np.testing.assert_array_equal(got.w, want.w, err_msg=f"W{i + 1}")
            np.testing.assert_array_equal(got.b, want.b, err_msg=f"b{i + 1}")
        assert read(mlp.metrics).tolist() == [0.0, 0.0]
        assert ("gather", "set_cursor", (STREAM, mlp.cursor.ptr, 0), ()) in log
        optimizer = mlp.optimizer
        if recipe:
            want = constants_of(Optimizer.of(second.config), Schedule.of(second.config, sum(second.batches)))
            assert read(optimizer.constants).tobytes() == want.tobytes()
            assert read(optimizer.constants)["lr"][0] == np.float32(0.1)
            assert not read(optimizer.state).any() and not read(optimizer.slot1).any() and not read(optimizer.slot2).any()
            span = np.empty(optimizer.count, np.float32)
            assert not cuda.copy_to_host(optimizer.grads_span.ptr, span, STREAM).any()  # every dW, db and padding
        else:
            assert optimizer is None
        refreshes = [call for call in log if call[1] == "sgd_bias_refresh"]
        if precision == "bf16":
            assert not any(read(db).any() for db in mlp.db)
            (_, _, args, _), = refreshes
            assert args[5] == 0.0 and args[6] == mlp.w[0].ptr and args[7] == mlp.copies.w.ptr  # lr 0: b stays
        else:
            assert refreshes == []


# ---- what a captured step holds of a plan -----------------------------------------------------


def recorded_step(mlp: FusedMlp, log: list, rows: int, measure: bool) -> list:
    start = len(log)
    mlp.record_step(STREAM, rows, measure)
    return log[start:]


def floats_in(calls: list) -> set[float]:
    """Every float argument of the calls: what a capture bakes in besides pointers and sizes."""
    return {arg for _, _, args, _ in calls for arg in args if isinstance(arg, float)}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_step_with_an_optimizer_holds_nothing_of_the_recipe(host_memory, log, data, precision):
    """With an optimizer, a step recorded for one plan is call for call the step recorded for
    another seed, rate, optimizer and schedule: the recipe is all device values."""
    first = RunPlan.for_data(config(optimizer="adam", schedule="one-cycle", lr=0.05), data)
    second = RunPlan.for_data(config(optimizer="momentum", schedule="cosine", momentum=0.8, lr=0.1, seed=2), data)
    mlp, arena = started_mlp(first, data, precision, log)
    with arena:
        steps = {(rows, m): recorded_step(mlp, log, rows, m) for rows in first.batch_sizes for m in (False, True)}
        assert floats_in([c for s in steps.values() for c in s]) <= {0.0, 1.0}
        mlp.start_run(second, STREAM)
        for (rows, measure), step in steps.items():
            assert recorded_step(mlp, log, rows, measure) == step, (rows, measure)
    assert FusedMlp.step_constants(first.config) == FusedMlp.step_constants(second.config) == ()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_step_with_sgd_fused_into_it_holds_its_rate_and_nothing_else_of_the_plan(host_memory, log, data, precision):
    """Fused SGD's rate is in the step's kernel arguments and its products' α (by value, as a
    capture keeps them); the seed is not: another seed at the same rate records the same step."""
    first, same_rate, other_rate = (RunPlan.for_data(config(**c), data)
                                    for c in (dict(), dict(seed=5), dict(seed=5, lr=0.125)))
    mlp, arena = started_mlp(first, data, precision, log)
    with arena:
        step = recorded_step(mlp, log, 50, True)
        assert np.float32(0.05) in {np.float32(f) for f in floats_in(step)} and -0.05 in floats_in(step)
        mlp.start_run(same_rate, STREAM)
        assert recorded_step(mlp, log, 50, True) == step
        mlp.start_run(other_rate, STREAM)
        again = recorded_step(mlp, log, 50, True)
        assert again != step and 0.05 not in floats_in(again) and -0.125 in floats_in(again)
    assert FusedMlp.step_constants(first.config) == FusedMlp.step_constants(same_rate.config) == (0.05,)
    assert FusedMlp.step_constants(other_rate.config) == (0.125,)


# ---- which plans a row takes ------------------------------------------------------------------


@pytest.mark.parametrize("built, other, refused", [
    (dict(), dict(lr=0.2, seed=3), False),
    (dict(), dict(optimizer="adam"), True),  # the step has no gradients' span nor optimizer
    (dict(optimizer="adam"), dict(), True),  # SGD at a constant rate is fused into the step: another step
    (dict(optimizer="adam"), dict(optimizer="momentum", schedule="warmup", warmup=3), False),
    (dict(optimizer="adam"), dict(schedule="cosine"), False),  # SGD with a schedule: the optimizer's
    (dict(optimizer="momentum"), dict(optimizer="adamw"), True),  # two state slots where one was allocated
    (dict(optimizer="nesterov"), dict(optimizer="momentum", momentum=0.5, weight_decay=0.01), False),
])
def test_the_model_refuses_a_recipe_its_buffers_were_not_laid_out_for(data, built, other, refused):
    mlp = FusedMlp(Arena(), RunPlan.for_data(config(**built), data), data, "fp32")
    why = mlp.restart_refusal(RunPlan.for_data(config(**other), data))
    assert (why is not None) == refused, why


@pytest.mark.parametrize("cls", [FusedStage, Bf16Stage, DeviceLoopStage, PersistentStage])
def test_the_mlp_rows_restart(cls):
    assert cls.restarts()


def set_up_by_hand(cls, plan: RunPlan, data: Dataset, log: list):
    """A fused rung's setup with its model's memory on the host and its kernels recorded: the
    model started, the graphs captured."""
    stage = cls(plan, data)
    stage.mlp, stage.arena = started_mlp(plan, data, stage.precision, log)
    stage.stream = STREAM
    stage.mlp.start_run(plan, STREAM)
    if cls is DeviceLoopStage:
        stage.loop_kind, stage.loop_cu, stage.body_stream = "while", FakeLoop(log), SimpleNamespace(handle=8)
        stage.steps_per_iteration = 5  # a WHILE node over 12 full steps
        stage.iterations_left = SimpleNamespace(ptr=4096)
        stage.epoch_graphs = {}
        stage.next_sample = 0
    stage.capture()
    return stage


def graphs_of(stage) -> dict:
    return dict(getattr(stage, "epoch_graphs", None) or stage.graphs)


@pytest.mark.parametrize("cls", [FusedStage, Bf16Stage, DeviceLoopStage], ids=["fused", "bf16", "device-loop"])
def test_a_restart_keeps_the_graphs_unless_they_hold_the_rate_that_changed(host_memory, log, data, cls):
    """Another seed at the same rate, and another recipe on the optimizer's path: the same graphs.
    Another rate of fused SGD: every graph captured again (the old ones closed), each what a fresh
    capture for the new plan holds. Another shape or a recipe of the other path: refused, the row as
    it was."""
    plan = RunPlan.for_data(config(), data)
    stage = set_up_by_hand(cls, plan, data, log)
    with stage.arena:
        graphs = graphs_of(stage)
        assert all(graph.calls for graph in graphs.values())
        if cls is DeviceLoopStage:
            assert set(graphs) == {(13, False), (13, True)}  # 12 full batches and the tail of 10
            loops = [call for call in graphs[13, False].calls if call[1] == "while"]
            assert [args[1] for _, _, args, _ in loops] == [2]  # 2 × 5 steps, then 2 and the tail unrolled
        same_rate = RunPlan.for_data(config(seed=3), data)
        assert stage.restart(same_rate) and stage.plan is same_rate and graphs_of(stage) == graphs
        assert not any(graph.closed for graph in graphs.values())

        for refused in (config(batch=40), config(hidden=(16, 16)), config(epochs=3), config(optimizer="adam")):
            assert not stage.restart(RunPlan.for_data(refused, data)), refused
            assert stage.plan is same_rate and graphs_of(stage) == graphs

        other_rate = RunPlan.for_data(config(seed=1, lr=0.1), data)
        assert stage.restart(other_rate)
        recaptured = graphs_of(stage)
        assert set(recaptured) == set(graphs) and all(graph.closed for graph in graphs.values())
        assert stage.captured_for == (0.1,)
        fresh = set_up_by_hand(cls, other_rate, data, log)
        with fresh.arena:
            for key, graph in graphs_of(fresh).items():
                assert graph.calls == [restarted_call(call, stage, fresh) for call in recaptured[key].calls], key


def restarted_call(call, restarted, fresh):
    """`call` with the restarted row's pointers moved to where the fresh row's arena lies."""
    name, method, args, kwargs = call
    lo, hi = restarted.arena._base, restarted.arena._base + restarted.arena.nbytes
    shift = fresh.arena._base - restarted.arena._base
    moved = tuple(arg + shift if type(arg) is int and lo <= arg < hi else arg for arg in args)
    return name, method, moved, kwargs


def test_an_optimizer_rows_graphs_stay_for_another_rate_optimizer_and_schedule(host_memory, log, data):
    plan = RunPlan.for_data(config(optimizer="adam", lr=0.05), data)
    stage = set_up_by_hand(DeviceLoopStage, plan, data, log)
    with stage.arena:
        stage.run_batches(0, 13, False)
        graphs, captures = graphs_of(stage), FakeGraph.captures
        assert stage.next_sample == 610
        assert stage.restart(RunPlan.for_data(config(optimizer="nesterov", schedule="one-cycle", lr=0.2, seed=9), data))
        assert graphs_of(stage) == graphs and FakeGraph.captures == captures
        assert read(stage.mlp.optimizer.constants)["lr"][0] == np.float32(0.2)
        assert stage.next_sample == 0


def test_device_loop_keeps_a_partial_epochs_graph_through_a_recapture(host_memory, log, data):
    stage = set_up_by_hand(DeviceLoopStage, RunPlan.for_data(config(), data), data, log)
    with stage.arena:
        stage.run_batches(0, 5, False)  # a test's partial epoch: a graph of its own
        assert (5, False) in stage.epoch_graphs
        assert stage.restart(RunPlan.for_data(config(lr=0.3), data))
        assert set(stage.epoch_graphs) == {(5, False), (5, True), (13, False), (13, True)}


# ---- persistent ------------------------------------------------------------------------------


def persistent_by_hand(plan: RunPlan, data: Dataset) -> PersistentStage:
    """The pieces of persistent's setup that a restart writes, in host memory (garbage)."""
    stage = PersistentStage(plan, data)
    arena = stage.arena = Arena()
    stage.dataset = device.DatasetOnDevice(arena, plan, data)
    stage.params = device.Parameters(arena, plan.config)
    stage.metrics = arena.reserve("metrics", (2,), np.float64)
    arena.allocate()
    ctypes.memset(arena._base, GARBAGE, arena.nbytes)
    stage.stream = STREAM
    return stage


@pytest.mark.parametrize("hidden", [(), (64, 64)], ids=["softmax", "mlp"])
def test_persistent_restarts_with_the_plans_weights_and_orders_and_sgd_only(host_memory, data, hidden):
    plan = RunPlan.for_data(config(hidden=hidden, precision="bf16"), data)
    stage = persistent_by_hand(plan, data)
    with stage.arena:
        second = RunPlan.for_data(config(hidden=hidden, precision="bf16", seed=6, lr=0.3), data)
        assert stage.restart(second) and stage.plan is second and stage.config.lr == 0.3
        np.testing.assert_array_equal(read(stage.dataset.order), second.orders.ravel())
        for got, want in zip(stage.params.download(STREAM), second.initial):
            np.testing.assert_array_equal(got.w, want.w)
            np.testing.assert_array_equal(got.b, want.b)
        assert read(stage.metrics).tolist() == [0.0, 0.0]
        for refused in (dict(optimizer="adam"), dict(schedule="cosine"), dict(batch=40), dict(precision="fp32"),
                        dict(hidden=(*hidden, 64))):
            assert not stage.restart(RunPlan.for_data(config(**{"hidden": hidden, "precision": "bf16", **refused}),
                                                      data)), refused
            assert stage.plan is second
        np.testing.assert_array_equal(read(stage.dataset.order), second.orders.ravel())  # refused: nothing written
