"""`run --gpus N` without a GPU: the refusals, the ranks' slices of each combined batch (the
one-GPU sample order), the update's math, the launcher's messages, NCCL's status naming and
the record. The GPU run itself is tests/test_data_parallel_gpu.py."""

from __future__ import annotations

import os
import threading
import types
from multiprocessing import Pipe

import numpy as np
import pytest

from graphtrain import data_parallel, reference
from graphtrain.config import TrainConfig, preset
from graphtrain.errors import GpuUnavailableError, TrainingError, UsageError
from graphtrain.libs import nccl
from graphtrain.plan import RunPlan
from graphtrain.record import EpochRecord, RunRecord
from graphtrain.stages import LADDER, get_stage
from graphtrain.stages import data_parallel as dp_stage
from test_cli import invoke, one_line_error


# ---- refusals (exit 2, one line) -----------------------------------------------------------------


@pytest.mark.parametrize("stage", [s for s in LADDER if s != "graphs"] + ["torch-eager"])
def test_every_other_row_is_refused_with_its_reason(stage):
    line = one_line_error(invoke("run", "--stage", stage, "--gpus", "2"), 2)
    assert f"{stage} cannot" in line and "graphs rung only" in line


def test_the_cnns_device_loop_is_refused_with_its_own_reason():
    line = one_line_error(invoke("run", "--stage", "device-loop", "--conv", "24x5", "--gpus", "2"), 2)
    assert "device-loop cannot" in line and "captured inside its body" in line


def test_the_cnn_on_graphs_passes_the_request_checks():
    cnn = preset("speedrun").replace(batch=128)
    data_parallel.check_request(2, "graphs", cnn)
    assert get_stage("graphs", "cnn", data_parallel=True) is dp_stage.DataParallelCnnGraphsStage
    assert get_stage("graphs", "mlp", data_parallel=True) is dp_stage.DataParallelGraphsStage


def test_a_cnn_tail_batch_that_does_not_split_evenly_is_refused_before_any_rank_starts(monkeypatch, mnist_dir):
    # 60000 = 66 · 896 + 864 at batch 128 × 7 GPUs, and 864 is not a multiple of 7.
    monkeypatch.setattr(nccl.library, "load", lambda: None)
    monkeypatch.setattr(data_parallel, "visible_gpus", lambda: [str(g) for g in range(8)])
    monkeypatch.setattr(data_parallel, "start_on", lambda *a: pytest.fail("a rank was started"))
    line = one_line_error(invoke("run", "--stage", "graphs", "--preset", "speedrun", "--batch", "128", "--gpus", "7",
                                 "--data-dir", str(mnist_dir)), 2)
    assert "864 samples" in line and "do not split evenly over 7 GPUs" in line


@pytest.mark.parametrize("args, words", [
    (("--gpus", "0"), "whole number >= 1"),
    (("--gpus", "2", "--profile"), "--profile"),
])
def test_options_it_cannot_take_are_refused(args, words):
    assert words in one_line_error(invoke("run", "--stage", "graphs", *args), 2)


def test_missing_nccl_is_refused_naming_what_installs_it(monkeypatch):
    def missing():
        raise GpuUnavailableError("NCCL (libnccl) was not found (no libnccl.so.2); pip install x")

    monkeypatch.setattr(nccl.library, "load", missing)
    line = one_line_error(invoke("run", "--stage", "graphs", "--gpus", "2"), 2)
    assert "--gpus 2 needs NCCL" in line and "libnccl" in line


def test_fewer_gpus_than_asked_are_refused(monkeypatch):
    monkeypatch.setattr(nccl.library, "load", lambda: None)
    monkeypatch.setattr(data_parallel, "visible_gpus", lambda: ["0"])
    assert "this machine has 1 GPU(s)" in one_line_error(invoke("run", "--stage", "graphs", "--gpus", "2"), 2)


def test_no_gpu_at_all_is_refused(monkeypatch):
    def none():
        raise GpuUnavailableError("the NVIDIA driver found no GPU")

    monkeypatch.setattr(nccl.library, "load", lambda: None)
    monkeypatch.setattr(data_parallel, "visible_gpus", none)
    assert "no GPU to run on" in one_line_error(invoke("run", "--stage", "graphs", "--gpus", "2"), 2)


def test_a_tail_batch_that_does_not_split_evenly_is_refused():
    plan = RunPlan.build(TrainConfig(hidden=(8,), batch=7 * 16, epochs=1), num_train=1000, num_test=10)
    with pytest.raises(UsageError, match="does not split evenly|do not split evenly") as caught:
        dp_stage.check_split(plan, 7)
    assert "\n" not in str(caught.value)
    assert dp_stage.check_split(RunPlan.build(TrainConfig(hidden=(8,), batch=256, epochs=1), 1000, 10), 2) == \
        {256: 128, 232: 116}


def test_the_stage_trains_only_as_a_rank_of_a_group():
    plan = RunPlan.build(TrainConfig(hidden=(8,), batch=256, epochs=1), num_train=1000, num_test=10)
    with pytest.raises(TypeError, match="for_group"):
        dp_stage.DataParallelGraphsStage(plan, None)
    bound = dp_stage.DataParallelGraphsStage.for_group(dp_stage.Group(1, 2, bytes(128)))
    assert bound.group.rank == 1 and bound.name == "graphs" and dp_stage.DataParallelGraphsStage.group is None


# ---- the sample order: each rank's slice, as the stage's gather reads it ---------------------------


@pytest.mark.parametrize("size", [1, 2, 4])
def test_the_ranks_slices_are_the_one_gpu_batch_in_order(size, seed):
    """The gather reads order[cursor + first + r] (its order pointer moved by `first`), the cursor
    moving on by the combined batch: the ranks' slices, in rank order, are the one-GPU run's batch."""
    plan = RunPlan.build(TrainConfig(hidden=(8,), batch=32 * size, epochs=2, seed=seed), num_train=1000,
                         num_test=10)
    flat, local_rows = plan.orders.ravel(), dp_stage.check_split(plan, size)
    for epoch in range(plan.num_epochs):
        cursor = epoch * plan.num_train  # set_cursor at the epoch's start
        for lo, hi in plan.epoch_bounds(epoch):
            rows = hi - lo
            slices = []
            for rank in range(size):
                first, local = dp_stage.rank_slice(rows, rank, size)
                assert local == local_rows[rows]
                slices.append(flat[cursor + first:cursor + first + local])
            assert np.array_equal(np.concatenate(slices), plan.orders[epoch][lo:hi]), f"seed {seed}"
            cursor += rows  # samples_per_step(local) = local · size


def cnn_device_slices(cursor: int, batch: int, epoch_samples: int, ranks: int):
    """What gather_slice_at and softmax_xent_step (gather.cu, cnn.cu) compute from the device
    cursor for each rank: (first order index read, rows read, rows given a gradient), and the
    cursor's next value."""
    valid = min(batch, epoch_samples - cursor % epoch_samples)
    return [(cursor + rank * (valid // ranks), batch // ranks, valid // ranks) for rank in range(ranks)], cursor + valid


@pytest.mark.parametrize("size", [1, 2, 4])
def test_the_cnn_ranks_slices_found_on_the_device_are_the_one_gpu_batch(size, seed):
    """The cnn's one step graph serves every batch, the tail included: each rank finds its slice
    from the cursor alone (valid = the combined batch's real rows, rank r from r·valid/N on), the
    cursor moving by `valid` across epochs; the slices in rank order are the one-GPU run's
    batches, and every row read (past a slice too) lies inside the order and its padding."""
    plan = RunPlan.build(preset("speedrun").replace(batch=32 * size, epochs=2, seed=seed), num_train=1000,
                         num_test=10)
    dp_stage.check_split(plan, size)  # 1000 mod 32·N splits evenly for N = 1, 2, 4
    padded = plan.num_epochs * plan.num_train + plan.config.batch // size  # CnnDevice's order span
    flat, cursor = plan.orders.ravel(), 0
    for epoch in range(plan.num_epochs):
        for lo, hi in plan.epoch_bounds(epoch):
            slices, cursor_after = cnn_device_slices(cursor, plan.config.batch, plan.num_train, size)
            for first, rows, mine in slices:
                assert first + rows <= padded and mine == (hi - lo) // size
            got = np.concatenate([flat[first:first + mine] for first, _, mine in slices])
            assert np.array_equal(got, plan.orders[epoch][lo:hi]), f"seed {seed}, epoch {epoch}, batch {lo}"
            assert cursor_after - cursor == hi - lo
            cursor = cursor_after
    assert cursor == plan.num_epochs * plan.num_train


def test_the_summed_cnn_slice_gradients_give_the_combined_batch_adam_step(seed):
    """The loss step divides each rank's rows by the combined batch's valid rows (the rows past
    its slice get zero gradient): the ranks' gradients summed are the combined batch's mean, and
    one Adam step on them is the one-GPU step (float64, the tail batch of 2·11 rows in 2·16)."""
    from graphtrain import reference_cnn as R

    spec = R.CnnSpec((R.ConvLayer(3, 5), R.ConvLayer(4, 3)), (8,), classes=10)
    rng = np.random.default_rng(seed)
    size, rows, valid = 2, 32, 22
    params = R.init_params(spec, seed)
    x, labels = rng.standard_normal((rows, 1, 28, 28)), rng.integers(0, 10, rows)
    acts = R.forward(spec, params, x[:valid])
    _, dlogits = R.loss_and_dlogits(acts["logits"], labels[:valid])
    whole = R.backward(spec, params, acts, dlogits)
    local = rows // size
    summed = None
    for rank in range(size):
        first, mine = rank * valid // size, valid // size
        batch = slice(first, first + local)  # the rank's rows: its slice, then rows it reads on
        acts = R.forward(spec, params, x[batch])
        _, d = R.loss_and_dlogits(acts["logits"], labels[batch])
        d = d * local / valid  # (softmax − onehot) / valid
        d[mine:] = 0.0
        grads = R.backward(spec, params, acts, d)
        summed = grads if summed is None else [a + g for a, g in zip(summed, grads)]
    for got, want in zip(summed, whole):
        assert np.allclose(got, want, rtol=1e-12, atol=1e-15), f"seed {seed}"
    optimizer = R.Optimizer("adam", betas=(0.7, 0.9))
    one, two = [p.copy() for p in params], [p.copy() for p in params]
    optimizer.step(one, whole, optimizer.init_state(one), 1, 0.01)
    optimizer.step(two, summed, optimizer.init_state(two), 1, 0.01)
    for a, b in zip(two, one):
        assert np.allclose(a, b, rtol=1e-10, atol=1e-13), f"seed {seed}"


def test_a_slice_that_does_not_split_is_a_bug():
    with pytest.raises(ValueError):
        dp_stage.rank_slice(10, 0, 3)


def test_the_summed_slice_gradients_at_lr_over_n_are_the_combined_batch_step(seed):
    """Σ_r (mean gradient over slice r), the update at lr/N: the one-GPU step at the combined batch."""
    rng = np.random.default_rng(seed)
    dims, size, rows, lr = (20, 16, 5), 4, 64, 0.1
    layers = reference.init_params(dims, True, seed, np.float64)
    x, labels = rng.random((rows, dims[0])), rng.integers(0, dims[-1], rows)
    whole = [layer.copy() for layer in layers]
    reference.train_step(whole, x, labels, lr)
    summed = None
    for rank in range(size):
        first, local = dp_stage.rank_slice(rows, rank, size)
        acts = reference.forward(layers, x[first:first + local])
        _, dlogits = reference.loss_and_dlogits(acts[-1], labels[first:first + local])
        grads = reference.backward(layers, acts, dlogits)
        summed = grads if summed is None else [reference.Layer(a.w + g.w, a.b + g.b) for a, g in zip(summed, grads)]
    parallel = [layer.copy() for layer in layers]
    reference.sgd(parallel, summed, lr / size)
    for got, want in zip(parallel, whole):
        assert np.allclose(got.w, want.w, rtol=1e-12, atol=1e-14), f"seed {seed}"
        assert np.allclose(got.b, want.b, rtol=1e-12, atol=1e-14), f"seed {seed}"


def test_each_rank_sees_its_gpu_first_and_its_peers_after():
    assert data_parallel.bound_gpus(["3", "5", "6"], 0) == ["3", "5", "6"]
    assert data_parallel.bound_gpus(["3", "5", "6"], 1) == ["5", "3", "6"]
    assert data_parallel.bound_gpus(["3", "5", "6"], 2) == ["6", "3", "5"]


# ---- the launcher's side of the pipes --------------------------------------------------------------


class FakeRank:
    """A rank's process as `_follow` sees it: a sentinel that becomes ready when it 'exits'."""

    def __init__(self):
        self._read, self._write = os.pipe()
        self.sentinel, self.exitcode = self._read, None

    def exit(self, code: int) -> None:
        self.exitcode = code
        os.close(self._write)

    def join(self, timeout=None) -> None:
        pass

    def is_alive(self) -> bool:
        return self.exitcode is None

    def close(self) -> None:
        os.close(self._read)


def follow(ranks_script, size: int = 2, progress=None):
    """Run `_follow` against `size` fake ranks, each played by ranks_script(rank, conn, fake)."""
    parents, children = zip(*(Pipe() for _ in range(size)))
    fakes = [FakeRank() for _ in range(size)]
    threads = [threading.Thread(target=ranks_script, args=(rank, children[rank], fakes[rank]), daemon=True)
               for rank in range(size)]
    for thread in threads:
        thread.start()
    try:
        return data_parallel._follow(list(parents), fakes, [str(g) for g in range(size)], progress)
    finally:
        for fake in fakes:
            fake.close()


def test_the_unique_id_goes_from_rank_0_to_every_other_and_rank_0s_record_comes_back():
    uid, got, epochs = bytes(range(128)), {}, []

    def script(rank, conn, fake):
        if rank == 0:
            conn.send(("uid", uid))
            conn.send(("epoch", 0, 1, "entry"))
        else:
            got[rank] = conn.recv()
        conn.send(("done", "record" if rank == 0 else None))
        conn.close()
        fake.exit(0)

    assert follow(script, size=3, progress=lambda *a: epochs.append(a)) == "record"
    assert got == {1: uid, 2: uid} and epochs == [(0, 1, "entry")]


@pytest.mark.parametrize("kind, error", [("usage", UsageError), ("graphtrain", TrainingError),
                                         ("bug", data_parallel.RankFailed)])
def test_a_ranks_error_is_raised_as_its_kind(kind, error):
    def script(rank, conn, fake):
        if rank == 1:
            conn.send(("error", kind, "it broke", "Traceback ..."))
            fake.exit(1)
        # rank 0 waits for ever, as it would in the all-reduce

    with pytest.raises(error, match="it broke"):
        follow(script)


def test_a_rank_that_dies_without_a_word_stops_the_run():
    def script(rank, conn, fake):
        if rank == 1:
            conn.close()
            fake.exit(-9)

    with pytest.raises(TrainingError, match=r"GPU 1 exited \(code -9\)"):
        follow(script)


# ---- NCCL's statuses, the record -------------------------------------------------------------------


def test_an_nccl_status_is_named_with_the_call(monkeypatch):
    fake = types.SimpleNamespace(ncclGetErrorString=lambda status: b"invalid argument (run with NCCL_DEBUG=WARN)",
                                 ncclGetLastError=lambda comm: b"")
    monkeypatch.setattr(nccl.library, "load", lambda: fake)
    with pytest.raises(nccl.NcclError) as caught:
        nccl.library.check(4, "ncclAllReduce")
    assert str(caught.value).startswith("ncclAllReduce failed: ncclInvalidArgument: invalid argument")
    assert caught.value.call == "ncclAllReduce" and caught.value.status == 4
    nccl.library.check(0, "ncclAllReduce")  # success raises nothing


def test_loading_nccl_turns_nvlink_multicast_off(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.setattr(nccl.SharedLibrary, "load", lambda self: None)
    nccl.library.load()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"


def test_a_communicator_checks_its_arguments_before_nccl():
    with pytest.raises(ValueError, match="128 bytes"):
        nccl.Communicator(b"short", 2, 0)


def test_the_record_states_the_gpus_and_both_batches():
    record = RunRecord(stage="graphs", kind="stage", config=TrainConfig(batch=256), environment={},
                       epochs=[EpochRecord(1, 3.0, 4, full=True)], setup_ms=1.0, total_ms=2.0, test_accuracy=0.9,
                       data_parallel={"gpus": 2, "batch_per_gpu": 128, "combined_batch": 256})
    out = record.to_json()
    assert out["data_parallel"]["gpus"] == 2 and out["config"]["batch"] == 256
    record.data_parallel = None
    assert "data_parallel" not in record.to_json()


def test_a_rank_sends_the_id_its_epochs_and_its_record(monkeypatch):
    """Rank 0's side of the pipe, in this process: the stage swapped for the CPU one (the GPU
    rank is tests/test_data_parallel_gpu.py), the dataset a small synthetic one."""
    import pickle

    import graphtrain.data
    from graphtrain.data import Dataset
    from graphtrain.stages.numpy_cpu import NumpyStage
    from graphtrain.sweep import DataSource

    uid = bytes(range(128))
    groups = []
    monkeypatch.setattr(nccl, "unique_id", lambda: uid)
    monkeypatch.setattr(graphtrain.data, "load", lambda *a, **k: Dataset.synthetic(600, 100, seed=0))
    monkeypatch.setattr(dp_stage.DataParallelGraphsStage, "for_group",
                        classmethod(lambda cls, group: groups.append(group) or NumpyStage))
    parent, child = Pipe()
    config = TrainConfig(hidden=(16,), batch=64, epochs=2)
    data_parallel._rank_main(0, 2, config, DataSource("mnist"), child)
    messages = []
    while parent.poll():
        messages.append(parent.recv())
    assert messages[0] == ("uid", uid) and groups == [dp_stage.Group(0, 2, uid)]
    assert [m[:3] for m in messages[1:3]] == [("epoch", 0, 2), ("epoch", 1, 2)]
    kind, record = messages[3]
    assert kind == "done" and record.config.batch == 64 and record.params is not None
    pickle.loads(pickle.dumps(record))


def test_a_ranks_failure_goes_up_its_pipe_with_its_kind(monkeypatch):
    from graphtrain.sweep import DataSource

    def missing():
        raise GpuUnavailableError("NCCL (libnccl) was not found")

    monkeypatch.setattr(nccl, "unique_id", missing)
    parent, child = Pipe()
    data_parallel._rank_main(0, 2, TrainConfig(), DataSource("mnist"), child)
    kind, what, text, trace = parent.recv()
    assert (kind, what) == ("error", "usage") and "libnccl" in text and "Traceback" in trace


# ---- the cnn rank's plumbing, the GPU mocked -------------------------------------------------------


class FakeCommunicator:
    """nccl.Communicator as the cnn rank uses it: what was asked of it, in order."""

    def __init__(self, uid, nranks, rank):
        self.calls = [("init", uid, nranks, rank)]

    def all_reduce_sum(self, ptr, count, datatype, stream):
        self.calls.append(("sum", ptr, count, datatype, stream))

    def close(self):
        self.calls.append(("close",))

    def abort(self):
        self.calls.append(("abort",))


def cnn_rank(monkeypatch, rank=1, size=2):
    monkeypatch.setattr(nccl, "Communicator", FakeCommunicator)
    plan = RunPlan.build(preset("speedrun").replace(batch=64 * size), num_train=1000, num_test=10)
    return dp_stage.DataParallelCnnGraphsStage.for_group(dp_stage.Group(rank, size, bytes(128)))(plan, None)


def test_the_cnn_rank_builds_its_model_as_its_rank_and_sums_the_gradient_span(monkeypatch):
    stage = cnn_rank(monkeypatch)
    options = stage.model_options()  # setup's call, once the GPU is open: the communicator joins
    assert options["rank"] == 1 and options["ranks"] == 2
    assert stage.comm.calls == [("init", bytes(128), 2, 1)]
    stream = object()
    options["all_reduce"](stream, 0x7000, 215_000)
    assert stage.comm.calls[-1] == ("sum", 0x7000, 215_000, nccl.FLOAT32, stream)
    assert stage.local_rows == {128: 64, 104: 52}  # 1000 = 7 · 128 + 104


def test_the_cnn_ranks_epoch_loss_is_summed_over_the_ranks_when_read(monkeypatch):
    stage = cnn_rank(monkeypatch)
    stage.model_options()
    stream = object()
    stage.model = types.SimpleNamespace(loss_sum=types.SimpleNamespace(ptr=0x9000), stream=stream,
                                        read_loss_sum=lambda: 12.5)
    assert stage.read_loss_sum() == 12.5
    assert stage.comm.calls[-1] == ("sum", 0x9000, 1, nccl.FLOAT64, stream)


def test_the_cnn_rank_closes_its_step_graph_before_its_communicator_and_aborts_on_failure(monkeypatch):
    order = []
    stage = cnn_rank(monkeypatch)
    stage.model_options()
    comm = stage.comm
    stage.step_graph = types.SimpleNamespace(close=lambda: order.append("graph"))
    monkeypatch.setattr(FakeCommunicator, "close", lambda self: order.append("comm"))
    stage.close()
    assert order[:2] == ["graph", "comm"] and stage.comm is None
    failed = cnn_rank(monkeypatch)
    failed.model_options()
    comm = failed.comm
    failed.__exit__(RuntimeError, RuntimeError("x"), None)
    assert comm.calls[-1] == ("abort",)


def test_the_trainer_keeps_the_cnn_rank_it_is_given():
    from graphtrain.stages.cnn_rungs import CnnGraphsStage
    from graphtrain.stages.graphs import GraphsStage
    from graphtrain.training import row_for

    cnn = preset("speedrun")
    bound = dp_stage.DataParallelCnnGraphsStage.for_group(dp_stage.Group(0, 2, bytes(128)))
    assert row_for(bound, cnn) is bound
    assert row_for(GraphsStage, cnn) is CnnGraphsStage


def test_a_cnn_model_checks_its_rank_before_touching_the_gpu():
    from graphtrain import reference_cnn as R
    from graphtrain.recipe import Recipe
    from graphtrain.stages.cnn_device import CnnDevice

    spec, images, labels = R.CnnSpec((R.ConvLayer(4, 5),), (8,)), np.zeros((10, 784), np.float32), np.zeros(10)
    with pytest.raises(ValueError, match="split evenly"):
        CnnDevice(None, spec, Recipe(batch=10), images, labels, images, labels, rank=0, ranks=3,
                  all_reduce=lambda *a: None)
    with pytest.raises(ValueError, match="all_reduce"):
        CnnDevice(None, spec, Recipe(batch=10), images, labels, images, labels, rank=0, ranks=2)


def test_a_cnn_rank_trains_the_cnn_stage(monkeypatch):
    """_rank_main picks the cnn's data-parallel rung for a cnn plan (swapped here for the cnn's
    CPU rung, on a small synthetic dataset)."""
    import graphtrain.data
    from graphtrain.data import Dataset
    from graphtrain.stages.cnn_rungs import CnnNumpyStage
    from graphtrain.sweep import DataSource

    groups = []
    monkeypatch.setattr(nccl, "unique_id", lambda: bytes(128))
    monkeypatch.setattr(graphtrain.data, "load", lambda *a, **k: Dataset.synthetic(256, 64, seed=0))
    monkeypatch.setattr(dp_stage.DataParallelCnnGraphsStage, "for_group",
                        classmethod(lambda cls, group: groups.append(group) or CnnNumpyStage))
    parent, child = Pipe()
    config = preset("speedrun").replace(conv=((2, 5),), hidden=(8,), batch=128, epochs=1)
    data_parallel._rank_main(0, 2, config, DataSource("mnist"), child)
    messages = []
    while parent.poll():
        messages.append(parent.recv())
    assert groups == [dp_stage.Group(0, 2, bytes(128))], messages
    kind, record = messages[-1]
    assert kind == "done" and record.config.model == "cnn" and record.config.batch == 128


# ---- the scaling script (its runs faked) ------------------------------------------------------------


def test_the_scaling_script_writes_both_tables_to_one_file_named_by_the_gpu(monkeypatch, tmp_path):
    import importlib.util
    import json
    import sys
    from pathlib import Path

    from graphtrain.libs import cuda

    path = Path(__file__).parents[1] / "scripts/benchmarks/data_parallel_scaling.py"
    spec = importlib.util.spec_from_file_location("data_parallel_scaling", path)
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclass looks its module up there
    spec.loader.exec_module(script)
    trained = []

    def train(self, tmp, batch, gpus):
        trained.append((self.model, batch, gpus))
        config = self.config().replace(batch=batch * (gpus or 1))
        record = {"kind": "stage", "config": config.to_dict(), "epoch_ms": 80.0 / (gpus or 1), "test_accuracy": 0.98,
                  "data": {"name": "mnist", "train": 60000, "test": 10000}, "epochs": [{"train_loss": 0.25}],
                  "note": "linear layers TF32" if self.model == "cnn" else "",
                  "environment": {"gpu": "NVIDIA H100 80GB HBM3", "revision": "0123abc",
                                  "nccl": "2.28.9" if gpus else None}}
        weights = tmp / f"{self.model}-{batch}-{gpus}.npy"
        np.save(weights, np.full(8, 1.0 + (1e-5 if gpus else 0.0), np.float32))
        return record, weights

    monkeypatch.setattr(script.Workload, "train", train)
    monkeypatch.setattr(cuda, "device_count", lambda: 2)
    monkeypatch.setattr(sys, "argv", [str(path), "--out-dir", str(tmp_path)])
    script.main()
    out = tmp_path / "data-parallel-jhu-mlp784x3-speedrun-cnn-h100.md"
    text = out.read_text()
    assert "## mlp: jhu-mlp784x3" in text and "## cnn: speedrun-cnn" in text
    assert "conv 24×5×5, conv 32×3×3" in text and "Left out: --gpus 4 (this host has 2 GPU(s))" in text
    assert text.count("| --gpus 2 | 2 | 128 | 256 |") == 2 and "1.00e-05" in text
    assert ("cnn", 128, 2) in trained and ("mlp", 256, None) in trained
    assert json.loads(out.with_suffix(".json").read_text())["revision"] == "0123abc"
