"""`graphs` on N GPUs, one process each: every step all-reduces the gradients through NCCL.
The MLP's rung (DataParallelGraphsStage) and the cnn's (DataParallelCnnGraphsStage).

The plan is the one-GPU plan at the combined batch C = N·B (graphtrain.data_parallel builds it),
so the sample order is that run's: batch [lo, hi) of C rows (or the tail's T) splits into N
consecutive slices of C/N rows, rank r taking rows lo + r·C/N ... lo + (r+1)·C/N − 1. Each rank
replays the `graphs` step on its slice, with two changes:

    the batch     the gather reads the order from r·rows on (its pointer moved, the device cursor
                  shared with the one-GPU run), and the cursor moves on by the combined batch
    the update    the gradients lie in one span (every dW, then every db), so one in-place
                  ncclAllReduce(sum, fp32) a step, captured into the step's graph, sums them;
                  each rank's are the mean over its slice, so Σ_r g_r / N is the mean over the
                  combined batch, and the 1/N is folded into the update: W −= (lr/N)·Σ_r g_r

Every rank then holds the same weights (the all-reduce hands all of them the same sums). The
epoch's loss and accuracy sums are all-reduced (fp64) when read, outside the graph.

The cnn (graphtrain.stages.cnn_device): one captured step serves every batch, the tail batch
included, so the slice is found on the device: the combined batch's valid rows are
valid = min(C, epoch end − cursor), rank r gathers rows cursor + r·valid/N ... (its C/N rows, the
ones past valid/N given zero gradient), the loss step divides each row's gradient by the
combined `valid` (not its slice's) and moves the cursor by `valid`. The ranks' gradients summed
(one in-place ncclAllReduce over the packed gradient span, the node before the optimizer's) are
then the combined batch's mean, so Adam, momentum and the schedule see exactly the one-GPU run's
gradient up to fp32 summation order. The epoch's loss sum is all-reduced when read; each rank
evaluates the whole test set with the same weights, so the correct count is not summed.

Why only this rung: the earlier rungs replay no graph; `fused` and `bf16` fuse the update into
the weight-gradient product (W ← W − lr·dYᵀX as one product), so no gradient exists to sum;
`device-loop` and `persistent` run a whole epoch in one graph launch or one kernel, without a
point between steps where a collective could be placed with the samples of the same batch. The
cnn's `device-loop` has a step boundary, inside a conditional WHILE node's body; NCCL's captured
collectives bring event record and wait nodes with them (its graph-mixing support), which public
reports say CUDA does not allow in a conditional node's body. Not tried here: refused. Each rung's
reason lives in the row registry (graphtrain.stages.REGISTRY).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from graphtrain import stages
from graphtrain.errors import ModelUnsupported, UsageError
from graphtrain.libs import cuda, nccl
from graphtrain.plan import RunPlan
from graphtrain.stages.cnn_rungs import CnnGraphsStage
from graphtrain.stages.graphs import GraphsStage

def rank_slice(rows: int, rank: int, size: int) -> tuple[int, int]:
    """(first row, rows) of rank `rank`'s slice of a combined batch of `rows` rows: N equal,
    consecutive slices in rank order (ValueError where `rows` does not split evenly)."""
    local, rest = divmod(rows, size)
    if rest or not 0 <= rank < size:
        raise ValueError(f"a batch of {rows} rows does not split into {size} equal slices (rank {rank})")
    return rank * local, local


def check_split(plan: RunPlan, size: int) -> dict[int, int]:
    """Each combined batch size of the plan -> the rows of every rank's slice; a UsageError
    where one (the tail batch, at most) does not split evenly over `size` GPUs."""
    uneven = [rows for rows in plan.batch_sizes if rows % size]
    if uneven:
        batch = plan.config.batch
        raise UsageError(
            f"--gpus {size}: the last batch of each epoch has {uneven[0]} samples ({plan.num_train} mod "
            f"{batch}), which do not split evenly over {size} GPUs; choose a --batch that does "
            f"(the combined batch is --batch × --gpus = {batch})")
    return {rows: rows // size for rows in plan.batch_sizes}


@dataclass(frozen=True)
class Group:
    """This process's place among the data-parallel processes, and the communicator's id."""

    rank: int
    size: int
    unique_id: bytes


class DataParallelGraphsStage(GraphsStage):
    data_parallel = True
    summary = "the graphs rung on several GPUs, the gradients all-reduced through NCCL inside the step graph"
    group: ClassVar[Group | None] = None  # set by `for_group`

    @classmethod
    def for_group(cls, group: Group) -> type[DataParallelGraphsStage]:
        """This stage bound to one rank of `group` (the trainer makes a stage from its class)."""
        return type(cls.__name__, (cls,), {"group": group})

    def __init__(self, plan, data):
        if self.group is None:
            raise TypeError("DataParallelGraphsStage trains as one rank of a group: use for_group(group)")
        if plan.config.model != self.model_kind:
            raise ModelUnsupported(f"DataParallelGraphsStage trains MLPs; the {plan.config.model}'s is "
                                   f"{stages.get_stage(self.name, plan.config.model, data_parallel=True).__name__}")
        super().__init__(plan, data)
        self.local_rows = check_split(plan, self.group.size)
        self.comm: nccl.Communicator | None = None

    # ---- setup ---------------------------------------------------------------------------------

    def setup_extra(self) -> None:
        super().setup_extra()
        self.comm = nccl.Communicator(self.group.unique_id, self.group.size, self.group.rank)
        # The step's softmax runs on a slice: descriptors for the slices' row counts.
        self.chosen.softmax.describe(self.local_rows.values())
        # Every dW, then every db: reserved one after the other, so one span (with the arena's
        # alignment padding between them, zeroed here once and summed as zeros ever after).
        grads = [*self.dw, *(db for db in self.db if db is not None)]
        if any(b.offset <= a.offset for a, b in zip(grads, grads[1:])):
            raise RuntimeError("the gradients were not reserved in order: they do not form one span")
        first, last = grads[0], grads[-1]
        self.grad_ptr, self.grad_count = first.ptr, (last.offset + last.nbytes - first.offset) // 4
        cuda.memset(self.grad_ptr, 0, self.grad_count * 4, self.stream)

    # ---- the step ------------------------------------------------------------------------------

    def train_step(self, offset: int, rows: int, measure: bool) -> None:
        """One step of the combined batch of `rows` rows: this rank's slice of it."""
        super().train_step(offset, self.local_rows[rows], measure)

    def samples_per_step(self, rows: int) -> int:
        return rows * self.group.size  # the cursor follows the combined batch

    def load_batch(self, offset: int, rows: int) -> None:
        # order[*cursor + first + r]: the order's pointer moved to this rank's slice.
        first, _ = rank_slice(rows * self.group.size, self.group.rank, self.group.size)
        order = self.order.ptr + first * self.order.dtype.itemsize
        self.gather_cu.gather_batch_at(self.stream, self.train_images.ptr, self.train_labels.ptr, order,
                                       self.cursor.ptr, self.config.in_features, rows, self.acts[0].ptr, self.y.ptr)

    def update(self) -> None:
        self.comm.all_reduce_sum(self.grad_ptr, self.grad_count, nccl.FLOAT32, self.stream)
        lr = self.config.lr / self.group.size  # Σ_r (mean over slice r) / N = mean over the combined batch
        for param, grad in [*zip(self.w, self.dw), *zip(self.b, self.db)]:
            if param is not None:
                self.layers_cu.sgd_update(self.stream, param.ptr, grad.ptr, lr, param.size)

    # ---- metrics -------------------------------------------------------------------------------

    def read_metrics(self):
        # Σ loss and # correct over every rank's slices: the combined batches' sums.
        self.comm.all_reduce_sum(self.metrics.ptr, 2, nccl.FLOAT64, self.stream)
        return self.metrics.download(self.stream)

    # ---- the rest ------------------------------------------------------------------------------

    def library_versions(self) -> dict:
        return {**super().library_versions(), "nccl": nccl.version()}

    def close(self) -> None:
        for graph in getattr(self, "graphs", {}).values():
            graph.close()  # the captured all-reduces go before their communicator
        if self.comm is not None:
            comm, self.comm = self.comm, None
            comm.close()
        super().close()

    def __exit__(self, *exc):
        if exc[0] is not None and self.comm is not None:
            comm, self.comm = self.comm, None  # a failed rank does not wait for its peers
            comm.abort()
        self.close()


class DataParallelCnnGraphsStage(CnnGraphsStage):
    """The cnn's `graphs` rung as one rank: CnnDevice holds this rank's C/N rows, gathers its
    slice, and sums the packed gradients over the ranks before the optimizer (see the module's
    docstring); the step graph is captured and replayed as on one GPU."""

    data_parallel = True
    summary = "the cnn's graphs rung on several GPUs, the gradients all-reduced through NCCL inside the step graph"
    group: ClassVar[Group | None] = None  # set by `for_group`

    @classmethod
    def for_group(cls, group: Group) -> type[DataParallelCnnGraphsStage]:
        """This stage bound to one rank of `group` (the trainer makes a stage from its class)."""
        return type(cls.__name__, (cls,), {"group": group})

    def __init__(self, plan, data):
        if self.group is None:
            raise TypeError("DataParallelCnnGraphsStage trains as one rank of a group: use for_group(group)")
        super().__init__(plan, data)
        self.local_rows = check_split(plan, self.group.size)
        self.comm: nccl.Communicator | None = None

    def model_options(self) -> dict:
        # Called by setup once the GPU is open and current, before the model is built and its
        # first (warm-up) step runs: the communicator joins here.
        self.comm = nccl.Communicator(self.group.unique_id, self.group.size, self.group.rank)
        return {"rank": self.group.rank, "ranks": self.group.size, "all_reduce": self.all_reduce_gradients}

    def all_reduce_gradients(self, stream, ptr: int, count: int) -> None:
        """The step's all-reduce: Σ over the ranks of `count` fp32 gradients at `ptr`, in place."""
        self.comm.all_reduce_sum(ptr, count, nccl.FLOAT32, stream)

    def read_loss_sum(self) -> float:
        # Σ loss over every rank's slices: the combined batches' sum (fp64).
        m = self.model
        self.comm.all_reduce_sum(m.loss_sum.ptr, 1, nccl.FLOAT64, m.stream)
        return m.read_loss_sum()

    def environment(self) -> dict:
        return {**super().environment(), "nccl": nccl.version()}

    def close(self) -> None:
        graph = getattr(self, "step_graph", None)
        if graph is not None:
            graph.close()  # the captured all-reduce goes before its communicator
        if self.comm is not None:
            comm, self.comm = self.comm, None
            comm.close()
        super().close()

    def __exit__(self, *exc):
        if exc[0] is not None and self.comm is not None:
            comm, self.comm = self.comm, None  # a failed rank does not wait for its peers
            comm.abort()
        self.close()
