"""Where an epoch's time goes: GPU-busy time, kernels and launches per step, from CUPTI.

`--profile` runs one more epoch per row after the timed ones (`training.run_stage`), with CUPTI
tracing every kernel, memcpy and memset the GPU runs (a `Recorder`); the timed epochs are never
traced, so their figures do not change. `summarize` turns that epoch's activity records into
the row's `profile`:

    busy_ms    the length of the union of the activities' [start, end) intervals: time in
               which the GPU was running at least one of them. Work that overlaps (kernels on
               two streams, a copy beside a kernel) counts once; `kernel_ms`, the plain sum of
               kernel durations, counts it as often as it runs.
    idle_share 1 − busy_ms / epoch_ms, where epoch_ms is the row's timed median epoch: the
               share of an epoch in which the GPU had nothing to run, waiting for the host.
               Not the traced epoch's own wall time (`traced_epoch_ms`, CUDA events): tracing
               stretches it, on an H100 by 15–30% (the graphs rung's 13.7 ms epoch took 17.8
               ms traced), while the GPU work it records is the same in every epoch.
    kernels_per_step, copies_per_step   GPU operations per training step (a step is a batch);
               in a CUDA graph each kernel node is one kernel.
    launches_per_step  distinct host calls that put work on the GPU, per step (CUPTI's
               correlation ids): one per eager kernel launch, one per graph launch.

The recorder asks CUPTI (through NVIDIA's cupti-python, the `profile` extra; its calls are in
graphtrain.libs.cupti) for kernels as CONCURRENT_KERNEL, which leaves concurrent kernels
concurrent (the plain KERNEL kind would serialise them), with their graph ids when they ran as
nodes of a CUDA graph. CUPTI hands back each full buffer of records from its own thread, or all
of them, partly filled ones included, from a forced flush; every record becomes an `Activity`
straight away, because the record objects point into buffers that CUPTI reuses. Everything but
the recorder is pure and tested on recorded activity data.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

from graphtrain.errors import INSTALL_HINTS, MissingRequirement
from graphtrain.libs import cupti as libcupti

HOST_BOUND_IDLE = 0.5  # a row whose GPU sat idle for at least this share of the epoch is host-bound
TOP_KERNELS = 5
BUFFER_BYTES = 8 << 20  # per activity buffer; CUPTI asks for another when one fills
TRACED_KINDS = {"CONCURRENT_KERNEL": "kernel", "MEMCPY": "memcpy", "MEMSET": "memset"}
FLUSH_FORCED = 1  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED: deliver the partly filled buffers too


def cupti_missing() -> str | None:
    """None when cupti-python can be imported here, else why not and what installs it."""
    try:
        from cupti import cupti  # noqa: F401
    except ImportError as exc:
        return (f"NVIDIA's cupti-python cannot be imported ({exc}); install it with: {INSTALL_HINTS['profile']}, "
                "in a version whose CUDA is not newer than the driver's")
    return None


def require_cupti() -> None:
    """MissingRequirement (exit 2) with the install hint when CUPTI cannot be used (checked before any work)."""
    reason = cupti_missing()
    if reason:
        raise MissingRequirement(f"--profile needs CUPTI: {reason}")


@dataclass(frozen=True)
class Activity:
    """One piece of GPU work, with CUPTI's timestamps (ns, one clock for all records)."""

    kind: str  # "kernel", "memcpy" or "memset"
    start_ns: int
    end_ns: int
    # The host API call that launched it: one per eager launch, one per graph launch (shared by
    # every node of that launch).
    correlation_id: int
    graph_id: int = 0  # 0 when it did not run as a node of a CUDA graph
    graph_node_id: int = 0
    name: str = ""


_lock = threading.Lock()
_sink: list[Activity] | None = None  # where delivered records go; None while no recorder is on
_registered = False  # CUPTI keeps one pair of buffer callbacks per process


def _activity(record, kinds: dict[int, str]) -> Activity | None:
    """The Activity of a CUPTI record whose kind is in `kinds` (CUPTI's number -> ours)."""
    kind = kinds.get(int(record.kind))
    if kind is None:
        return None
    return Activity(kind, int(record.start), int(record.end), int(record.correlation_id),
                    int(getattr(record, "graph_id", 0) or 0), int(getattr(record, "graph_node_id", 0) or 0),
                    str(record.name or "") if kind == "kernel" else "")


def _register(cupti) -> None:
    """Hand CUPTI the buffer callbacks, once per process."""
    global _registered
    if _registered:
        return
    kinds = {int(getattr(cupti.ActivityKind, name)): ours for name, ours in TRACED_KINDS.items()}

    def buffer_requested():
        return BUFFER_BYTES, 0  # 0: as many records as fit

    def buffer_completed(records):
        converted = [a for a in (_activity(r, kinds) for r in records) if a is not None]
        with _lock:
            if _sink is not None:
                _sink.extend(converted)

    libcupti.call("activity_register_callbacks", buffer_requested, buffer_completed)
    _registered = True


class Recorder:
    """`with Recorder() as r: ...` traces the GPU work started inside; then `r.activities`.

    The caller makes sure the GPU is idle on entry and has finished the work on exit
    (synchronised), so that exactly that work is recorded.
    """

    def __init__(self) -> None:
        self.activities: list[Activity] = []
        self._enabled: list = []

    def __enter__(self) -> Recorder:
        global _sink
        from cupti import cupti

        _register(cupti)
        with _lock:
            if _sink is not None:
                raise RuntimeError("a CUPTI recorder is already on")
            _sink = self.activities
        try:
            for name in TRACED_KINDS:
                kind = getattr(cupti.ActivityKind, name)
                libcupti.call("activity_enable", kind)
                self._enabled.append(kind)
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def _stop(self) -> None:
        global _sink
        try:
            while self._enabled:
                libcupti.call("activity_disable", self._enabled.pop())
            libcupti.call("activity_flush_all", FLUSH_FORCED)
        finally:
            with _lock:
                _sink = None


def profile_epoch(runner, epoch: int, num_batches: int, measure: bool, epoch_ms: float) -> dict:
    """Run one more epoch of `runner` under CUPTI and summarise it against the timed `epoch_ms`.
    The GPU is idle on entry (every epoch and test evaluation ends with a synchronisation) and
    train_epoch synchronises before it returns, so the trace holds exactly this epoch's work."""
    with Recorder() as recorder:
        result = runner.train_epoch(epoch, num_batches, measure)
    return summarize(recorder.activities, steps=num_batches, epoch_ms=epoch_ms, traced_epoch_ms=result.ms)


def idle_share(busy_ms: float, epoch_ms: float) -> float:
    """1 − busy/epoch, and 0 where the traced work exceeds the timed epoch (tracing stretches
    kernels a little, so a row that keeps the GPU busy throughout can read a hair over 100%)."""
    return max(0.0, 1.0 - busy_ms / epoch_ms)


def against(profile: dict, epoch_ms: float) -> dict:
    """`profile` with its idle share taken against another epoch time (a repeated row's median)."""
    return {**profile, "epoch_ms": epoch_ms, "idle_share": idle_share(profile["busy_ms"], epoch_ms)}


def union_ns(intervals: Iterable[tuple[int, int]]) -> int:
    """Total length of the union of [start, end) intervals."""
    total, current_start, current_end = 0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def summarize(activities, steps: int, epoch_ms: float, traced_epoch_ms: float | None = None) -> dict:
    """The profile of one epoch from its activity records (objects with kind, start_ns, end_ns,
    correlation_id, graph_id, name), against the row's timed `epoch_ms`. Records without valid
    timestamps (CUPTI writes 0 when it could not time one) are counted as `untimed` and left
    out of the times."""
    if steps < 1 or not epoch_ms > 0:
        raise ValueError(f"a profiled epoch needs steps >= 1 and a positive time, got {steps}, {epoch_ms}")
    timed = [a for a in activities if 0 < a.start_ns <= a.end_ns]
    kernels = [a for a in timed if a.kind == "kernel"]
    copies = [a for a in timed if a.kind in ("memcpy", "memset")]
    busy_ms = union_ns((a.start_ns, a.end_ns) for a in timed) / 1e6
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for a in kernels:
        entry = by_name[a.name]
        entry[0] += 1
        entry[1] += (a.end_ns - a.start_ns) / 1e6
    top = sorted(by_name.items(), key=lambda item: -item[1][1])[:TOP_KERNELS]
    return {
        "steps": steps,
        "epoch_ms": epoch_ms,
        "traced_epoch_ms": traced_epoch_ms,
        "busy_ms": busy_ms,
        "idle_share": idle_share(busy_ms, epoch_ms),
        "kernel_ms": sum(a.end_ns - a.start_ns for a in kernels) / 1e6,
        "kernels": len(kernels),
        "memcpys": sum(a.kind == "memcpy" for a in timed),
        "memsets": sum(a.kind == "memset" for a in timed),
        "kernels_per_step": len(kernels) / steps,
        "copies_per_step": len(copies) / steps,
        "launches_per_step": len({a.correlation_id for a in timed}) / steps,
        "graph_kernels": sum(a.graph_id != 0 for a in kernels),
        "untimed": len(activities) - len(timed),
        "top_kernels": [{"name": name, "count": count, "ms": ms} for name, (count, ms) in top],
    }
