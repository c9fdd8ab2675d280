"""One worker process per GPU of this host: a sweep's tasks scheduled over them, rows gathered.

    engine = GpuWorkers(gpus=[0, 1])        # or GpuWorkers.for_request("all")
    rows = engine.run(tasks, source)        # graphtrain.sweep's engine interface

Each worker is a fresh process (multiprocessing's "spawn": no CUDA state is inherited from this
one, which may have initialised CUDA to count the GPUs) started with CUDA_VISIBLE_DEVICES set to
its one GPU, so everything CUDA it ever does (graphtrain's stages, a framework peer) sees that GPU
as device 0. It loads the dataset once and then takes tasks from one shared queue until there
are none left: whichever worker is free takes the next task, so uneven tasks even out. Each task's
rows come back on a result queue; `gather` puts them in grid order.

A worker that dies (killed, out of memory) takes only its task in flight with it: those points
become failed rows saying which GPU's worker exited, and the other workers finish the rest.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import traceback
from collections.abc import Sequence

from graphtrain.errors import GpuUnavailableError, UsageError
from graphtrain.sweep import DataSource, OnTask, SweepTask, _failed, gather, run_task


def start_on(process, visible: str) -> None:
    """Start the spawned `process` with CUDA_VISIBLE_DEVICES=visible (a GPU, or a list with its
    own first): the child inherits it, bound from its first line; this process's own is put back."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    try:
        process.start()
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


POLL_SECONDS = 0.5  # how often the parent looks for a dead worker while it waits for rows


def gpu_count() -> int:
    """GPUs this process can see (0 where CUDA sees none); the first call initialises CUDA here."""
    from graphtrain.libs import cuda

    return cuda.device_count()


def resolve_gpus(request: str) -> list[int]:
    """`--gpus all|N` as GPU numbers: all of them, or the first N. Fewer GPUs than asked for,
    or none, is a UsageError saying how many there are."""
    text = request.strip().lower()
    if text != "all" and not (text.isdigit() and int(text) >= 1):
        raise UsageError(f"--gpus wants 'all' or a whole number >= 1, got {request!r}")
    try:
        count = gpu_count()
    except GpuUnavailableError as exc:
        raise UsageError(f"--gpus {request}: no GPU to run on ({exc})") from None
    wanted = count if text == "all" else int(text)
    if count == 0 or wanted > count:
        raise UsageError(f"--gpus {request}: this machine has {count} GPU(s)")
    return list(range(wanted))


def _worker_main(gpu: int, source: DataSource, tasks, results) -> None:
    """A worker's life: bound to `gpu`, load the data, run tasks until the None at the end."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)  # already so from the parent; before any CUDA import
    try:
        data = source.load()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the rows
        results.put(("broken", gpu, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    device = f"GPU {gpu}"
    while True:
        task = tasks.get()
        if task is None:
            results.put(("idle", gpu, None, None))
            return
        results.put(("start", gpu, task.points[0].index, None))
        results.put(("done", gpu, task.points[0].index, run_task(task, data, device)))


class GpuWorkers:
    """The engine: one spawned worker per GPU in `gpus` (numbers on this host)."""

    def __init__(self, gpus: Sequence[int]):
        if not gpus:
            raise ValueError("no GPUs to start workers on")
        self.gpus = list(gpus)
        self.workers = len(self.gpus)
        self.description = f"{self.workers} worker process(es), one per GPU ({', '.join(map(str, self.gpus))})"

    @classmethod
    def for_request(cls, request: str) -> GpuWorkers:
        return cls(resolve_gpus(request))

    def run(self, tasks: Sequence[SweepTask], source: DataSource, data=None, on_task: OnTask | None = None) -> list[dict]:
        """Every task on whichever worker is free; rows in grid order. (`data`, this process's
        loaded dataset, is not sent: each worker loads its own from `source`.)"""
        context = multiprocessing.get_context("spawn")
        task_queue, results = context.Queue(), context.Queue()
        by_first = {task.points[0].index: task for task in tasks}
        for task in tasks:
            task_queue.put(task)
        for _ in self.gpus:
            task_queue.put(None)
        processes = {gpu: self._start(context, gpu, source, task_queue, results) for gpu in self.gpus}
        rows: list[dict] = []
        in_flight: dict[int, int] = {}  # gpu -> first point of its task
        finished: set[int] = set()  # gpus whose worker is done
        exited: set[int] = set()  # gpus whose worker was seen dead once (its last rows may be on the way)
        resolved: set[int] = set()  # tasks (first points) whose rows are in
        done_tasks = 0
        try:
            while done_tasks < len(tasks):
                try:
                    kind, gpu, index, payload = results.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    done_tasks += self._bury_dead(processes, finished, exited, in_flight, by_first, resolved,
                                                  rows, on_task)
                    if len(finished) == len(processes) and done_tasks < len(tasks):
                        self._fail_unclaimed(by_first, rows, "every worker exited before this row ran")
                        break
                    continue
                if kind == "start":
                    in_flight[gpu] = index
                elif kind == "done":
                    in_flight.pop(gpu, None)
                    if index in resolved:  # already failed as lost: cannot happen after two polls
                        raise RuntimeError(f"rows of a task counted lost came back from GPU {gpu}")
                    resolved.add(index)
                    rows += payload
                    done_tasks += 1
                    if on_task:
                        on_task(by_first[index], payload)
                elif kind == "broken":  # could not even load the data: its tasks go to the others
                    finished.add(gpu)
                    if len(finished) == len(processes):
                        self._fail_unclaimed(by_first, rows, f"the workers could not start: {index}")
                        break
                elif kind == "idle":
                    finished.add(gpu)
        finally:
            for process in processes.values():
                process.join(timeout=10)
                if process.is_alive():
                    process.terminate()
                    process.join()
        return gather(rows)

    @staticmethod
    def _start(context, gpu: int, source: DataSource, task_queue, results):
        process = context.Process(target=_worker_main, args=(gpu, source, task_queue, results),
                                  name=f"graphtrain-gpu{gpu}", daemon=True)
        start_on(process, str(gpu))
        return process

    @staticmethod
    def _bury_dead(processes, finished, exited, in_flight, by_first, resolved, rows, on_task) -> int:
        """Workers that exited without saying so: their task in flight becomes failed rows, once
        the worker has been seen dead on two polls in a row (what it sent before it died has
        arrived by then). Returns how many tasks that finished."""
        failed = 0
        for gpu, process in processes.items():
            if gpu in finished or process.is_alive():
                continue
            if gpu not in exited:
                exited.add(gpu)
                continue
            finished.add(gpu)
            index = in_flight.pop(gpu, None)
            if index is not None:
                task = by_first[index]
                resolved.add(index)
                task_rows = [_failed(point, f"the worker on GPU {gpu} exited (code {process.exitcode}) "
                                            "while training this row") for point in task.points]
                for row in task_rows:
                    row["device"] = f"GPU {gpu}"
                rows += task_rows
                failed += 1
                if on_task:
                    on_task(task, task_rows)
        return failed

    @staticmethod
    def _fail_unclaimed(by_first, rows, reason: str) -> None:
        """Rows for every task no worker returned."""
        returned = {row["index"] for row in rows}
        for task in by_first.values():
            for point in task.points:
                if point.index not in returned:
                    rows.append(_failed(point, reason))
