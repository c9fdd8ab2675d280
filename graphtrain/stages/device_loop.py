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

Its own program: the GPU and its stream (graphtrain.stages.device's DeviceContext), the model the
fused step trains at `bf16`'s precision (graphtrain.stages.fused_mlp.FusedMlp), and what this rung
adds, loop.cu's counter and a stream for the WHILE node's body. An epoch's graph is the fused step
recorded into the body, handed the body's stream, then on the epoch's own stream for the steps left.

A set-up row trains the next plan of its shape in place (FusedRung.restart), as `fused` does: the
epoch graphs hold pointers, the loop's iteration count (the epoch's length) and the batch's rows,
the same for every plan of the shape, and with SGD fused into the step its rate, so another rate
captures them again.
"""

from __future__ import annotations

import numpy as np

from graphtrain import environment
from graphtrain.kernels.loop import Loop
from graphtrain.libs import cuda
from graphtrain.reference import Layer
from graphtrain.stages.base import EpochResult
from graphtrain.stages.fused_mlp import FusedMlp, FusedRung, bf16_where_hidden, open_fused


class DeviceLoopStage(FusedRung):
    name = "device-loop"
    summary = "the whole epoch from one graph launch: a conditional WHILE node over the steps"
    steps_per_iteration = 16  # full steps in the WHILE body (measured: scripts/benchmarks/device_loop_body.py)

    @classmethod
    def precision_run(cls, config, chosen: str) -> str:
        return bf16_where_hidden(config, chosen)

    first_uses = staticmethod(FusedMlp.first_uses)

    def measures(self, epoch: int) -> bool:
        return self.plan.metrics_due[epoch]

    def setup(self) -> None:
        self.context, self.arena, self.mlp = open_fused(self)  # the model with bf16 operands (an MLP's)
        self.device, self.stream = self.context.device, self.context.stream
        self.iterations_left = self.arena.reserve("iterations_left", (1,), np.int32)  # the loop's counter
        self.arena.allocate()
        self.loop_kind = "while" if cuda.conditional_nodes() else "unrolled"
        self.body_stream = cuda.Stream() if self.loop_kind == "while" else None  # the body's capture stream
        self.loop_cu = Loop(self.device) if self.loop_kind == "while" else None
        self.mlp.start(self.device, self.stream)
        step_graph = self.mlp.capture_step(self.stream, self.config.batch, False)  # for the record only
        try:
            self.nodes_per_step = step_graph.num_nodes
        finally:
            step_graph.close()
        self.epoch_graphs = {}
        self.capture()
        self.next_sample = 0  # the cursor's sample (FusedMlp.start_run left it at 0); each epoch leaves it at the next one's start
        cuda.wait_for_head_starts()  # none still runs beside the timed epochs

    def capture(self) -> None:
        """The graph of every epoch length the plan has (and of any other captured before: a
        test's partial epoch), with and without metrics, in place of those captured before. The
        counter's iterations, the steps' rows and the pointers are the shape's; the rate of fused
        SGD is the only value of a plan they hold (FusedMlp.step_constants)."""
        lengths = set(self.plan.batches) | {num_batches for num_batches, _ in self.epoch_graphs}
        old, self.epoch_graphs = self.epoch_graphs, {}
        for graph in old.values():
            graph.close()
        for num_batches in sorted(lengths):
            for measure in (False, True):
                self.epoch_graphs[num_batches, measure] = self.capture_epoch(num_batches, measure)
        self.captured_for = self.mlp.step_constants(self.config)

    def restart(self, plan) -> bool:
        if not super().restart(plan):
            return False
        self.next_sample = 0  # start_run put the cursor at the first sample
        return True

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

        def body(stream: cuda.Stream) -> None:
            for _ in range(per_body):
                self.mlp.record_step(stream, full, measure)

        with cuda.Graph.capture(self.stream) as graph:
            if iterations:
                self.loop_cu.record_while(self.stream, self.body_stream, self.iterations_left.ptr, iterations, body)
            for _ in range(unrolled):
                self.mlp.record_step(self.stream, full, measure)
            if tail is not None:
                self.mlp.record_step(self.stream, tail, measure)
        return graph

    def train_epoch(self, epoch: int, num_batches: int, measure: bool) -> EpochResult:
        return self.context.epoch(lambda: self.run_batches(epoch, num_batches, measure), self.mlp.metrics, measure,
                                  self.plan.samples_seen(num_batches))

    def run_batches(self, epoch: int, num_batches: int, measure: bool) -> None:
        start = epoch * self.plan.num_train
        if start != self.next_sample:  # only when epochs are not run in order
            self.mlp.set_cursor(self.stream, start)
        graph = self.epoch_graphs.get((num_batches, measure))
        if graph is None:  # a length the run's epochs do not have (a test's partial epoch)
            graph = self.epoch_graphs[num_batches, measure] = self.capture_epoch(num_batches, measure)
        graph.launch(self.stream)
        self.next_sample = start + self.plan.samples_seen(num_batches)

    def test_accuracy(self) -> float:
        return self.mlp.accuracy(self.stream)

    def weights(self) -> list[Layer]:
        return self.mlp.weights(self.stream)

    def environment(self) -> dict:
        return {**environment.gpu(self.device), **self.mlp.library_versions(),
                "device_loop": self.loop_kind}  # "while", or "unrolled"

    def close(self) -> None:
        for graph in getattr(self, "epoch_graphs", {}).values():
            graph.close()
        for name in ("body_stream", "loop_cu", "mlp", "arena", "context"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
