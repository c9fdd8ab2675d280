"""A sweep's tasks on a Dask cluster: `--cluster local` (one started here) or `--cluster ADDRESS`.

    engine = DaskCluster.for_request("local", gpus="all")    # or "tcp://scheduler:8786"
    rows = engine.run(tasks, source)                          # graphtrain.sweep's engine interface

Dask's `distributed` (the `graphtrain[cluster]` extra, imported only here) runs each task as one
Dask task on whichever worker is free; its result is the task's rows, gathered into grid order
as every engine's are. A local cluster has one worker per GPU, as dask-cuda's LocalCUDACluster
makes them: a Nanny per GPU whose worker process starts with CUDA_VISIBLE_DEVICES set to that GPU
and runs one task at a time. On a remote cluster each worker must likewise own one GPU and run
one thread (as `dask cuda worker` starts them), and must reach the dataset by the same path or
name (its cache, or --data-dir on a shared file system).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections.abc import Sequence

from graphtrain.errors import UsageError
from graphtrain.sweep import DataSource, OnTask, SweepTask, gather, run_task

INSTALL_HINT = "pip install 'graphtrain[cluster]' (Dask's distributed)"


def import_distributed():
    try:
        import distributed
    except ImportError:
        raise UsageError(f"--cluster needs Dask's distributed, which is not installed: {INSTALL_HINT}") from None
    return distributed


@functools.lru_cache(maxsize=2)
def _worker_data(source: DataSource):
    """The dataset, loaded once per worker process."""
    return source.load()


def run_remote(task: SweepTask, source: DataSource, local: bool) -> list[dict]:
    """A Dask task: the task's rows, trained on this worker's GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0"
    device = f"GPU {visible}" if local else f"{socket.gethostname()} GPU {visible}"
    return run_task(task, _worker_data(source), device)


class DaskCluster:
    """The engine: a local Dask cluster of one worker per GPU, or an existing one at an address."""

    def __init__(self, address: str | None, gpus: Sequence[int] = (), workers: int | None = None):
        self.address = address  # None: start a local cluster on `gpus`
        self.gpus = list(gpus)
        self.workers = workers if workers is not None else len(self.gpus)
        where = f"a Dask cluster at {address}" if address else "a local Dask cluster"
        self.description = f"{where}, {self.workers} worker(s), one GPU each"

    @classmethod
    def for_request(cls, cluster: str, gpus: str | None = None) -> DaskCluster:
        """--cluster local (with --gpus all|N, default all) or --cluster ADDRESS."""
        distributed = import_distributed()
        if cluster.strip().lower() == "local":
            from graphtrain.workers import resolve_gpus

            return cls(None, resolve_gpus(gpus or "all"))
        if gpus is not None:
            raise UsageError("--gpus picks a local cluster's GPUs; a remote cluster's workers are its own")
        try:
            with distributed.Client(cluster, timeout="10s") as client:
                count = len(client.scheduler_info()["workers"])
        except OSError as exc:
            raise UsageError(f"--cluster {cluster}: cannot reach the Dask scheduler ({exc})") from None
        if count == 0:
            raise UsageError(f"--cluster {cluster}: the cluster has no workers")
        return cls(cluster, workers=count)

    def local_cluster(self):
        """One Nanny per GPU, its worker process bound to that GPU, one thread each.

        Dask's Nanny limits a worker's BLAS and OpenMP threads to one by default; the numpy
        rung's float32 products then sum in another order than in this process (or in a
        `--gpus` worker) and its weights differ in the last bits, so the workers here keep
        this process's settings instead."""
        import dask
        from distributed import Nanny, Scheduler, SpecCluster

        workers = {f"gpu{gpu}": {"cls": Nanny, "options": {"nthreads": 1, "env": {"CUDA_VISIBLE_DEVICES": str(gpu)},
                                                          "silence_logs": logging.ERROR}}
                   for gpu in self.gpus}
        scheduler = {"cls": Scheduler, "options": {"dashboard_address": None}}
        with dask.config.set({"distributed.nanny.pre-spawn-environ": {}, "distributed.nanny.environ": {}}):
            return SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.ERROR)

    def run(self, tasks: Sequence[SweepTask], source: DataSource, data=None, on_task: OnTask | None = None) -> list[dict]:
        distributed = import_distributed()
        cluster = self.local_cluster() if self.address is None else None
        try:
            with distributed.Client(cluster if cluster is not None else self.address) as client:
                futures = {client.submit(run_remote, task, source, cluster is not None, pure=False): task
                           for task in tasks}
                rows = []
                for future in distributed.as_completed(futures):
                    task_rows = future.result()
                    rows += task_rows
                    if on_task:
                        on_task(futures[future], task_rows)
        finally:
            if cluster is not None:
                cluster.close()
        return gather(rows)
