"""`graphtrain run --gpus N`: one model trained data-parallel, one spawned process per GPU.

    check_request(n, stage, config)      what can be refused before anything is loaded
    require(n)                           NCCL found, N GPUs present (UsageError, exit 2, if not)
    record = train(plan, n, source)      the ranks' run; rank 0's record, with `data_parallel`

Each rank is a fresh process (multiprocessing's "spawn": no CUDA state inherited) bound to its GPU
through CUDA_VISIBLE_DEVICES before anything CUDA loads (its GPU is its device 0; the other ranks'
follow, for NCCL's direct transfers: `bound_gpus`), with NCCL_NVLS_ENABLE=0. Rank 0 makes
the communicator's unique id (ncclGetUniqueId, 128 bytes) and sends it up its pipe; this process
hands it down every other rank's pipe; then every rank joins (ncclCommInitRank), loads the
dataset, builds the same plan (the one-GPU plan at the combined batch) and trains its slices
(graphtrain.stages.data_parallel). Rank 0 sends each epoch's line as it goes and its run record at
the end. A rank that fails or dies stops the run: the others are terminated (they would wait in
the all-reduce for ever), and its error is raised here, a usage error as a usage error.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import traceback
from multiprocessing.connection import wait

from graphtrain.errors import GpuUnavailableError, GraphtrainError, TrainingError, UsageError
from graphtrain import stages
from graphtrain.libs import nccl
from graphtrain.stages import data_parallel as dp_stage
from graphtrain.sweep import DataSource
from graphtrain.workers import start_on

JOIN_SECONDS = 10  # how long a rank that finished may take to exit before it is terminated


class RankFailed(RuntimeError):
    """A rank raised something graphtrain does not explain (a bug): its traceback is the message."""


def check_request(gpus: int, stage: str, config, profile: bool = False, init: bool = False) -> None:
    """UsageError where `run --gpus` cannot train this at all, whatever the machine."""
    if gpus < 1:
        raise UsageError(f"--gpus wants a whole number >= 1, got {gpus}")
    trainer = stages.data_parallel_trainer(stage, config.model)  # the rung and the model, or why not
    stages.check_recipe(stage, trainer.recipe_refusal, config)
    if profile:
        raise UsageError("--profile traces one process's GPU: run it without --gpus")
    if init:
        raise UsageError("--init resumes on one GPU: run it without --gpus")
    stages.check_precision(stage, trainer.precisions, config.precision)


def visible_gpus() -> list[str]:
    """The names CUDA_VISIBLE_DEVICES gives this process's GPUs ('0', '1', ... when unset)."""
    from graphtrain.libs import cuda

    count = cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count)]
    return [name.strip() for name in listed.split(",") if name.strip()][:count]


def require(gpus: int) -> list[str]:
    """NCCL and `gpus` GPUs, else a one-line UsageError; the GPUs the ranks bind to, in order."""
    try:
        nccl.library.load()
    except GpuUnavailableError as exc:
        raise UsageError(f"--gpus {gpus} needs NCCL: {exc}") from None
    try:
        names = visible_gpus()
    except GpuUnavailableError as exc:
        raise UsageError(f"--gpus {gpus}: no GPU to run on ({exc})") from None
    if len(names) < gpus:
        raise UsageError(f"--gpus {gpus}: this machine has {len(names)} GPU(s)")
    return names[:gpus]


def _rank_main(rank: int, size: int, plan_config, source: DataSource, conn,
               stage: str = stages.DATA_PARALLEL_RUNGS[0]) -> None:
    """One rank's life, training on rung `stage`; everything it has to say goes up `conn`."""
    nccl.disable_nvls()
    try:
        if rank == 0:
            uid = nccl.unique_id()
            conn.send(("uid", uid))
        else:
            uid = conn.recv()  # rank 0's, handed down by the parent
        from graphtrain.training import run_stage
        from graphtrain.plan import RunPlan

        data = source.load()
        plan = RunPlan.for_data(plan_config, data)
        stage_cls = stages.get_stage(stage, plan_config.model, data_parallel=True)
        stage_cls = stage_cls.for_group(dp_stage.Group(rank, size, uid))

        def progress(epoch: int, num_epochs: int, entry) -> None:
            if rank == 0:
                conn.send(("epoch", epoch, num_epochs, entry))

        record = run_stage(stage_cls, plan, data, progress)
        conn.send(("done", record if rank == 0 else None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which stops the run
        kind = "usage" if isinstance(exc, UsageError) else "graphtrain" if isinstance(exc, GraphtrainError) else "bug"
        conn.send(("error", kind, f"{type(exc).__name__}: {exc}" if kind == "bug" else str(exc),
                   traceback.format_exc()))


def train(plan, gpus: list[str], source: DataSource, progress=None, stage: str = stages.DATA_PARALLEL_RUNGS[0]):
    """Train `plan` (the one-GPU plan at the combined batch) on `gpus`, one rank each, on rung
    `stage`; rank 0's run record, its `data_parallel` saying how."""
    size = len(gpus)
    dp_stage.check_split(plan, size)
    nccl.disable_nvls()  # inherited by every rank, as is the rest of this environment
    context = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    try:
        for rank, gpu in enumerate(gpus):
            parent_end, child_end = context.Pipe()
            process = context.Process(target=_rank_main, args=(rank, size, plan.config, source, child_end, stage),
                                      name=f"graphtrain-rank{rank}", daemon=True)
            start_on(process, ",".join(bound_gpus(gpus, rank)))
            child_end.close()
            pipes.append(parent_end)
            processes.append(process)
        record = _follow(pipes, processes, gpus, progress)
    except BaseException:
        for process in processes:  # the others would wait for the failed rank in the all-reduce
            if process.is_alive():
                process.terminate()
        raise
    finally:
        for process in processes:
            process.join(timeout=JOIN_SECONDS)
            if process.is_alive():
                process.terminate()
                process.join()
    record.data_parallel = {"gpus": size, "batch_per_gpu": plan.config.batch // size,
                            "combined_batch": plan.config.batch, "devices": list(gpus),
                            "nccl": record.environment.get("nccl")}
    return record


def bound_gpus(gpus: list[str], rank: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES of rank `rank`: its GPU first (device 0, the one every stage opens),
    then the other ranks' GPUs, visible so that NCCL can reach them directly (P2P over NVLink or
    PCIe) rather than through host memory."""
    return [gpus[rank], *(gpu for other, gpu in enumerate(gpus) if other != rank)]


def _follow(pipes, processes, gpus, progress):
    """Relay the unique id, pass rank 0's epochs to `progress`, wait for every rank to finish;
    the first failure (an error reported, or a rank gone without a word) stops the run."""
    by_pipe = {pipe: rank for rank, pipe in enumerate(pipes)}
    by_sentinel = {process.sentinel: rank for rank, process in enumerate(processes)}
    done: dict[int, object] = {}
    closed: set[int] = set()  # ranks whose pipe reached its end (the rank exited)
    while len(done) < len(pipes):
        ready = wait([*(p for p in pipes if by_pipe[p] not in done and by_pipe[p] not in closed),
                      *(s for s, r in by_sentinel.items() if r not in done)])
        for item in ready:
            if item in by_pipe:
                rank = by_pipe[item]
                try:
                    message = item.recv()
                except EOFError:  # it exited: its sentinel says so next
                    closed.add(rank)
                    continue
                _handle(message, rank, pipes, done, gpus, progress)
            else:
                rank = by_sentinel[item]
                pipe = pipes[rank]
                if rank in done:
                    continue
                while rank not in closed and pipe.poll():  # what it said before it exited
                    try:
                        _handle(pipe.recv(), rank, pipes, done, gpus, progress)
                    except EOFError:
                        closed.add(rank)
                if rank not in done:
                    processes[rank].join(timeout=JOIN_SECONDS)  # its exit code, once it is reaped
                    raise TrainingError(f"the rank on GPU {gpus[rank]} exited (code {processes[rank].exitcode}) "
                                        "before it finished")
    return done[0]


def _handle(message, rank: int, pipes, done: dict, gpus, progress) -> None:
    kind = message[0]
    if kind == "uid":
        for other in pipes[1:]:
            other.send(message[1])
    elif kind == "epoch":
        if progress is not None:
            progress(*message[1:])
    elif kind == "done":
        done[rank] = message[1]
    elif kind == "error":
        _, what, text, trace = message
        where = f"GPU {gpus[rank]} (rank {rank})"
        if what == "usage":
            raise UsageError(text)
        if what == "graphtrain":
            raise TrainingError(f"{where}: {text}")
        raise RankFailed(f"{where}: {text}\n{trace}")
    else:
        raise RuntimeError(f"unexpected message {kind!r} from rank {rank}")
