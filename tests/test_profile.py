"""--profile on the CPU: the aggregation of recorded CUPTI activity, the recorder's handling of
CUPTI's callbacks (with a stand-in for cupti-python), the trainer's extra epoch, the paragraph
and the up-front check for a missing cupti-python."""

from __future__ import annotations

import enum
import json
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphtrain import profile, report, training
from graphtrain.cli import main
from graphtrain.config import PRESETS
from graphtrain.data import Dataset
from graphtrain.errors import UsageError
from graphtrain.libs.shared_lib import LibraryError
from graphtrain.plan import RunPlan
from graphtrain.profile import Activity
from graphtrain.record import EpochRecord, RunRecord, merge_repeats
from graphtrain.stages.numpy_cpu import NumpyStage

RECORDED = json.loads((Path(__file__).parent / "data" / "cupti-activities.json").read_text())


def recorded(name: str) -> tuple[list[Activity], int, float]:
    epoch = RECORDED[name]
    return [Activity(**a) for a in epoch["activities"]], epoch["steps"], epoch["epoch_ms"]


# ---- aggregation ---------------------------------------------------------------------------


@pytest.mark.parametrize("intervals, length", [
    ([], 0),
    ([(0, 10)], 10),
    ([(0, 10), (20, 25)], 15),  # disjoint
    ([(0, 10), (5, 15)], 15),  # overlapping
    ([(0, 100), (10, 20), (30, 40)], 100),  # nested
    ([(10, 20), (0, 10)], 20),  # touching, out of order
])
def test_union_counts_overlapping_time_once(intervals, length):
    assert profile.union_ns(intervals) == length


def test_eager_epoch_busy_time_is_the_union_and_every_launch_counts():
    activities, steps, epoch_ms = recorded("eager")
    p = profile.summarize(activities, steps, epoch_ms, traced_epoch_ms=0.012)
    # Intervals add to 4.5 µs, but the step-1 copy overlaps its last kernel by 0.1 µs.
    assert p["busy_ms"] == pytest.approx(0.0044)
    assert p["kernel_ms"] == pytest.approx(0.0040)
    assert p["idle_share"] == pytest.approx(1 - 0.0044 / 0.01)
    assert (p["kernels"], p["memcpys"], p["memsets"]) == (6, 2, 0)
    assert p["kernels_per_step"] == 3 and p["copies_per_step"] == 1
    assert p["launches_per_step"] == 4  # every kernel and copy its own host call
    assert p["graph_kernels"] == 0 and p["untimed"] == 0
    assert p["epoch_ms"] == 0.01 and p["traced_epoch_ms"] == 0.012
    assert p["top_kernels"][0] == {"name": "gemm_naive", "count": 2, "ms": pytest.approx(0.002)}


def test_graph_epoch_one_launch_per_step_and_untimed_records_left_out():
    activities, steps, epoch_ms = recorded("graph")
    p = profile.summarize(activities, steps, epoch_ms)
    assert p["untimed"] == 1
    assert p["kernels"] == 5 and p["kernels_per_step"] == 2.5
    assert p["launches_per_step"] == 1  # one graph launch per step
    assert p["graph_kernels"] == 5
    assert p["busy_ms"] == pytest.approx(0.0027)  # back-to-back nodes: [1000, 2500) and [2600, 3800)
    assert p["idle_share"] == pytest.approx(1 - 0.0027 / 0.004)


def test_idle_share_is_never_negative_and_follows_the_median():
    activities, steps, _ = recorded("eager")
    p = profile.summarize(activities, steps, epoch_ms=0.004)  # busy 4.4 µs in a 4 µs epoch
    assert p["idle_share"] == 0.0
    moved = profile.against(p, 0.011)
    assert moved["epoch_ms"] == 0.011 and moved["idle_share"] == pytest.approx(0.6)
    assert moved["busy_ms"] == p["busy_ms"]


def test_summarize_rejects_an_empty_epoch():
    with pytest.raises(ValueError):
        profile.summarize([], steps=0, epoch_ms=1.0)


# ---- the recorder, with a stand-in for cupti-python ---------------------------------------


class FakeCupti(types.ModuleType):
    """Just enough of `cupti.cupti`: enabling kinds, registering the buffer callbacks, and a
    flush that delivers whatever `pending` holds, as CUPTI does."""

    class ActivityKind(enum.IntEnum):
        CONCURRENT_KERNEL = 10
        MEMCPY = 1
        MEMSET = 2
        DRIVER = 3

    class Result(enum.IntEnum):
        ERROR_NOT_INITIALIZED = 15

    class cuptiError(Exception):
        def __init__(self, status):
            super().__init__(f"status {status}")
            self.status = status

    def __init__(self):
        super().__init__("cupti.cupti")
        self.enabled: set[int] = set()
        self.callbacks = None
        self.pending: list = []
        self.fail_enable = False

    def activity_register_callbacks(self, requested, completed):
        self.callbacks = (requested, completed)

    def activity_enable(self, kind):
        if self.fail_enable:
            raise self.cuptiError(self.Result.ERROR_NOT_INITIALIZED)
        self.enabled.add(kind)

    def activity_disable(self, kind):
        self.enabled.discard(kind)

    def activity_flush_all(self, flag):
        records, self.pending = self.pending, []
        self.callbacks[1](records)

    def trace(self, kind, start, end, correlation, name="", graph_id=0):
        """What the GPU would have run: a record, delivered only if its kind is enabled."""
        if kind in self.enabled:
            self.pending.append(types.SimpleNamespace(kind=kind, start=start, end=end, correlation_id=correlation,
                                                      name=name, graph_id=graph_id, graph_node_id=0))


@pytest.fixture
def fake_cupti(monkeypatch):
    fake = FakeCupti()
    package = types.ModuleType("cupti")
    package.cupti = fake
    monkeypatch.setitem(sys.modules, "cupti", package)
    monkeypatch.setitem(sys.modules, "cupti.cupti", fake)
    monkeypatch.setattr(profile, "_registered", False)
    return fake


def test_recorder_collects_kernels_copies_and_memsets_while_on(fake_cupti):
    kinds = FakeCupti.ActivityKind
    with profile.Recorder() as recorder:
        assert fake_cupti.enabled == {kinds.CONCURRENT_KERNEL, kinds.MEMCPY, kinds.MEMSET}
        fake_cupti.trace(kinds.CONCURRENT_KERNEL, 100, 200, 7, name="gemm", graph_id=3)
        fake_cupti.trace(kinds.MEMCPY, 200, 250, 8)
        fake_cupti.trace(kinds.DRIVER, 50, 60, 9)  # a kind graphtrain does not ask for
    assert fake_cupti.enabled == set()
    assert recorder.activities == [Activity("kernel", 100, 200, 7, 3, 0, "gemm"), Activity("memcpy", 200, 250, 8)]
    fake_cupti.callbacks[1]([types.SimpleNamespace(kind=kinds.MEMSET, start=1, end=2, correlation_id=1)])
    assert len(recorder.activities) == 2  # delivered after the recorder stopped: not its work


def test_a_cupti_error_names_the_call_and_the_status(fake_cupti):
    fake_cupti.fail_enable = True
    with pytest.raises(LibraryError, match="cupti.activity_enable failed: ERROR_NOT_INITIALIZED"):
        with profile.Recorder():
            pass
    fake_cupti.fail_enable = False
    with profile.Recorder():  # nothing left half-on: a new recorder starts
        pass


class FakeGpuStage(NumpyStage):
    """The numpy stage, claiming a GPU, whose epochs 'run' one fake kernel per batch."""

    name = "fake-gpu"
    uses_gpu = True
    tracer: FakeCupti

    @classmethod
    def check_available(cls):
        return None  # no GPU to look at: its memory is unknown

    def train_epoch(self, epoch, num_batches, measure):
        for step in range(num_batches):
            self.tracer.trace(FakeCupti.ActivityKind.CONCURRENT_KERNEL, 1000 * step + 1, 1000 * step + 401, step,
                              name="step")
        return super().train_epoch(epoch, num_batches, measure)


def test_run_stage_profiles_one_extra_epoch_after_the_timed_ones(fake_cupti):
    data = Dataset.synthetic(640, 100, seed=0)
    plan = RunPlan.for_data(PRESETS["jhu"].replace(epochs=2, batch=64), data)
    stage = type("Traced", (FakeGpuStage,), {"tracer": fake_cupti})
    plain = training.run_stage(stage, plan, data)
    profiled = training.run_stage(stage, plan, data, profile=True)
    assert plain.profile is None and "profile" not in plain.to_json()
    p = profiled.profile
    # Only the extra epoch was traced: 10 batches of one 0.4 µs kernel, not 30.
    assert p["kernels"] == 10 and p["steps"] == 10 and p["launches_per_step"] == 1
    assert p["busy_ms"] == pytest.approx(10 * 400 / 1e6)
    assert p["epoch_ms"] == profiled.epoch_ms  # idle against the timed median
    assert len(profiled.epochs) == 2 and profiled.to_json()["profile"] == p
    assert profiled.train_loss == plain.train_loss and profiled.test_accuracy == plain.test_accuracy


def test_a_cpu_row_is_not_profiled(fake_cupti):
    data = Dataset.synthetic(640, 100, seed=0)
    plan = RunPlan.for_data(PRESETS["jhu"].replace(epochs=1, batch=64), data)
    assert training.run_stage(NumpyStage, plan, data, profile=True).profile is None
    assert fake_cupti.callbacks is None  # CUPTI was never asked


def run_record(epoch_ms: float, setup_ms: float, total_ms: float) -> RunRecord:
    epochs = [EpochRecord(e + 1, epoch_ms, 10, True, train_loss=0.3) for e in range(2)]
    return RunRecord(stage="graphs", kind="stage", config=PRESETS["jhu"], environment={}, epochs=epochs,
                     setup_ms=setup_ms, total_ms=total_ms, test_accuracy=0.92)


def test_merge_repeats_keeps_every_run_and_reports_the_median():
    runs = [run_record(ms, 100.0 + ms, 1000.0 + ms) for ms in (12.0, 10.0, 30.0)]
    runs[-1].profile = {"busy_ms": 6.0, "epoch_ms": 30.0, "idle_share": 0.8}
    merged = merge_repeats(runs)
    assert merged.epoch_ms == 12.0 and merged.epoch_ms_range == (10.0, 30.0)
    assert merged.setup_ms == 112.0 and merged.total_ms == 1012.0
    assert [r.epoch_ms for r in merged.repeats] == [12.0, 10.0, 30.0]
    assert merged.profile["idle_share"] == pytest.approx(0.5)  # 6 of the median 12 ms
    saved = merged.to_json()
    assert (saved["epoch_ms"], saved["epoch_ms_min"], saved["epoch_ms_max"]) == (12.0, 10.0, 30.0)
    assert [r["epoch_ms"] for r in saved["repeats"]] == [12.0, 10.0, 30.0]
    assert len(saved["repeats"][0]["epochs"]) == 2
    assert runs[0].repeats == [] and runs[0].epoch_ms_range is None  # the runs themselves are unchanged
    assert merge_repeats(runs[:1]) is runs[0]
    assert "repeats" not in runs[0].to_json() and "epoch_ms_min" not in runs[0].to_json()


# ---- without cupti-python ------------------------------------------------------------------


def test_profile_without_cupti_is_a_usage_error_before_any_work(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "cupti", None)  # import cupti raises ImportError
    with pytest.raises(UsageError, match=r"graphtrain\[profile\]"):
        profile.require_cupti()
    # --data-dir points at an empty folder: reaching the data would fail differently.
    for command in (["ladder", "--stages", "baseline", "--no-peers"], ["run", "--stage", "graphs"]):
        result = CliRunner().invoke(main, [*command, "--profile", "--offline", "--data-dir", str(tmp_path),
                                           "--out" if command[0] == "ladder" else "--epochs",
                                           str(tmp_path / "out") if command[0] == "ladder" else "1"])
        assert result.exit_code == 2, result.output
        assert "cupti-python cannot be imported" in result.output and "graphtrain[profile]" in result.output
        assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


# ---- the paragraph -------------------------------------------------------------------------


def profiled_record(stage, busy_ms, epoch_ms, kernels, launches, kind="stage"):
    return {"stage": stage, "kind": kind, "epoch_ms": epoch_ms,
            "profile": {"busy_ms": busy_ms, "epoch_ms": epoch_ms, "idle_share": profile.idle_share(busy_ms, epoch_ms),
                        "kernels_per_step": kernels, "launches_per_step": launches}}


def test_where_the_time_goes_names_host_bound_rows_and_each_rungs_change():
    records = [
        profiled_record("baseline", 25.8, 85.4, 11, 13),
        profiled_record("cublas", 14.4, 51.1, 12, 12),
        {"stage": "sparse-metrics", "kind": "stage", "error": "boom", "skipped": False},
        profiled_record("cudnn-softmax", 14.0, 50.0, 12, 12),
        profiled_record("graphs", 12.5, 14.4, 11, 1),
        profiled_record("torch-graph", 27.5, 31.2, 20, 2, kind="peer"),
    ]
    text = "\n".join(report.where_the_time_goes(records))
    assert text.startswith("## Where the time goes")
    assert "Host-bound (the GPU idle for at least 50% of the epoch): `baseline` (70% idle), `cublas` (72% idle)" in text
    assert "Kept the GPU busy: `graphs` (13% idle), `torch-graph` (peer) (12% idle)" in text
    assert "`cublas` 25.8 → 14.4 ms (-44%), 11 → 12 kernels, 13 → 12 launches" in text
    assert "`graphs` 14.0 → 12.5 ms (-11%), 12 → 11 kernels, 12 → 1 launches" in text
    assert "`cudnn-softmax` 14.4" not in text  # the rung before it failed: no change to state
    assert report.where_the_time_goes([{"stage": "numpy", "kind": "stage", "epoch_ms": 1.0}]) == []
