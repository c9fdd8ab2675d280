"""`device-loop`: the whole epoch from one graph launch; the host leaves the batch loop.

Until here the host launched one step graph per batch, 469 a `jhu` epoch. Now one graph holds the
epoch: a conditional WHILE node whose body is 16 full-batch steps, then the full steps left over
and the tail batch's step. The body ends in a node of this rung's own (kernels/loop.cu) that counts
the iterations left and sets the loop's condition on the device (cudaGraphSetConditional), so the
step's kernels stay the bf16 rung's; the cursor carries each step, and each epoch, on to the next.
Per epoch the host launches one graph and waits once.

What this buys is host time, not GPU time: the nodes are the same nodes, and each iteration of
the WHILE node costs a few microseconds of its own (hence several steps to a body). It matters where the host cannot keep ahead of the GPU (a
busy or slow CPU, tiny steps); on an idle host the queued step graphs already kept the GPU fed,
and the ladder shows that honestly. Without conditional nodes (runtime or driver before CUDA
12.4) the epoch graph is unrolled instead, one step after another; the record says which.
"""

from __future__ import annotations

import numpy as np

from graphtrain.kernels.loop import Loop
from graphtrain.libs import cuda
from graphtrain.stages.bf16 import Bf16Stage


class DeviceLoopStage(Bf16Stage):
    name = "device-loop"
    summary = "the whole epoch from one graph launch: a conditional WHILE node over the steps"
    steps_per_iteration = 16  # full steps in the WHILE body (measured: scripts/benchmarks/device_loop_body.py)

    def reserve_extra(self, arena) -> None:
        super().reserve_extra(arena)
        self.iterations_left = arena.reserve("iterations_left", (1,), np.int32)  # the loop's counter

    def setup_extra(self) -> None:
        super().setup_extra()
        self.loop_kind = "while" if cuda.conditional_nodes() else "unrolled"
        self.loop_stream = cuda.Stream() if self.loop_kind == "while" else None  # the body's capture stream
        self.loop_cu = Loop(self.device) if self.loop_kind == "while" else None

    def capture(self) -> None:
        super().capture()  # the step graphs: nodes per step
        self.epoch_graphs = {}
        for num_batches in sorted(set(self.plan.batches)):
            for measure in (False, True):
                self.epoch_graphs[num_batches, measure] = self.capture_epoch(num_batches, measure)
        self.set_cursor(0)  # the warm-up moved it; from here each epoch leaves it at the next one's start
        self.next_sample = 0

    def capture_epoch(self, num_batches: int, measure: bool) -> cuda.Graph:
        """One graph: the full batches of the epoch's first `num_batches`, then its tail batch.

        With conditional nodes: a WHILE node whose body is `steps_per_iteration` full steps, run
        ⌊full / steps_per_iteration⌋ times, then the remaining full steps and the tail unrolled.
        Each iteration of a WHILE node costs the GPU a few microseconds of its own (the body is
        launched like a graph), so the body holds several steps to spread that cost; the counting
        node at its end is one more node a body: ~1.2 µs against the ~230 µs of 16 jhu steps on an
        H100 (6.7 ms an epoch of 469), 0.5%; less for an MLP's longer steps."""
        sizes = [hi - lo for lo, hi in self.plan.bounds[:num_batches]]
        full, tail = self.config.batch, sizes[-1] if sizes[-1] != self.config.batch else None
        count = len(sizes) - (tail is not None)
        per_body = self.steps_per_iteration
        iterations, unrolled = divmod(count, per_body) if self.loop_kind == "while" else (0, count)

        def body(stream: cuda.Stream) -> None:  # the steps queue on self.stream: the body's, meanwhile
            outer, self.stream = self.stream, stream
            try:
                for _ in range(per_body):
                    self.train_step(0, full, measure)
            finally:
                self.stream = outer

        with cuda.Graph.capture(self.stream) as graph:
            if iterations:
                self.loop_cu.record_while(self.stream, self.loop_stream, self.iterations_left.ptr, iterations, body)
            for _ in range(unrolled):
                self.train_step(0, full, measure)
            if tail is not None:
                self.train_step(0, tail, measure)
        return graph

    def run_batches(self, epoch: int, num_batches: int, measure: bool) -> None:
        start = epoch * self.num_train
        if start != self.next_sample:  # only when epochs are not run in order
            self.set_cursor(start)
        graph = self.epoch_graphs.get((num_batches, measure))
        if graph is None:  # a length the run's epochs do not have (a test's partial epoch)
            graph = self.epoch_graphs[num_batches, measure] = self.capture_epoch(num_batches, measure)
        graph.launch(self.stream)
        self.next_sample = start + self.plan.samples_seen(num_batches)

    def environment(self) -> dict:
        return {**super().environment(), "device_loop": self.loop_kind}  # "while", or "unrolled"

    def close(self) -> None:
        for graph in getattr(self, "epoch_graphs", {}).values():
            graph.close()
        if getattr(self, "loop_stream", None) is not None:
            self.loop_stream.close()
        if getattr(self, "loop_cu", None) is not None:
            self.loop_cu.close()
        super().close()
