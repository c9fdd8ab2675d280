"""`graphs`: a whole training step captured once into a CUDA Graph, replayed per batch.

Eager launches cost microseconds of Python and driver time each, dozens per step. Captured, the
step is one cudaGraphLaunch. What changes between batches is only where the batch starts, so the
gather kernel reads it from a device cursor that the step itself advances: the graph replays
unchanged and the host does nothing per batch but launch it.

One graph per (batch rows, metrics on/off): the tail batch (60000 = 468·128 + 96) has its own.
"""

from __future__ import annotations

import numpy as np

from graphtrain.libs import cuda
from graphtrain.stages.cudnn_softmax import CudnnSoftmaxStage


class GraphsStage(CudnnSoftmaxStage):
    name = "graphs"
    summary = "one whole training step captured into a CUDA Graph and replayed per batch"

    def reserve_extra(self, arena) -> None:
        super().reserve_extra(arena)
        self.cursor = arena.reserve("cursor", (1,), np.int32)  # first sample of the next batch

    def setup_extra(self) -> None:
        super().setup_extra()
        self.graphs = {}
        self.set_cursor(0)

    def set_cursor(self, sample: int) -> None:
        self.gather_cu.set_cursor(self.stream, self.cursor.ptr, sample)

    def load_batch(self, offset: int, rows: int) -> None:
        # `offset` is the eager rungs' kernel argument; here the cursor on the device says it.
        self.gather_cu.gather_batch_at(self.stream, self.train_images.ptr, self.train_labels.ptr, self.order.ptr,
                                       self.cursor.ptr, self.config.in_features, rows, self.acts[0].ptr, self.y.ptr)

    def train_step(self, offset: int, rows: int, measure: bool) -> None:
        super().train_step(offset, rows, measure)
        self.gather_cu.advance_cursor(self.stream, self.cursor.ptr, self.samples_per_step(rows))

    def samples_per_step(self, rows: int) -> int:
        """How far the cursor moves on after a step of `rows` rows: to the next batch."""
        return rows

    def capture(self) -> None:
        for rows in self.plan.batch_sizes:
            for measure in (False, True):
                with cuda.Graph.capture(self.stream) as graph:
                    self.train_step(0, rows, measure)
                self.graphs[rows, measure] = graph

    def run_batches(self, epoch: int, num_batches: int, measure: bool) -> None:
        self.set_cursor(epoch * self.num_train)
        for lo, hi in self.plan.epoch_bounds(epoch, num_batches):
            self.graphs[hi - lo, measure].launch(self.stream)

    def close(self) -> None:
        for graph in getattr(self, "graphs", {}).values():
            graph.close()
        super().close()
