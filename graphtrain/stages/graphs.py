"""`graphs`: a whole training step captured once into a CUDA Graph, replayed per batch.

Eager launches cost microseconds of Python and driver time each, dozens per step. Captured, the
step is one cudaGraphLaunch. What changes between batches is only where the batch starts, so the
gather kernel reads it from a device cursor that the step itself advances: the graph replays
unchanged and the host does nothing per batch but launch it.

One graph per (batch rows, metrics on/off): the tail batch (60000 = 468·128 + 96) has its own.
The step is cudnn-softmax's, every part as that rung chose it (graphtrain.stages.chain_parts);
what this rung adds are methods: the cursor (and the optimizer) in the arena, the gather that
reads the cursor, the capture and the replay.

From here on a rung trains every recipe: an optimizer other than SGD, or a schedule, is one
optimizer_step over all the parameters (graphtrain.stages.device.DeviceOptimizer), its rate read
on the device from its step counter so that the replayed graph follows the schedule. SGD at a
constant rate keeps the earlier rungs' update, one launch a parameter.

The ladder's chain ends here (graphtrain.stages.CHAIN_END). `fused`, `bf16` and `device-loop` keep
its step graph and its device cursor, but as programs of their own built on another step, the fused
one (graphtrain.stages.fused_mlp); this rung's step is the one `run --gpus` splits over GPUs
(graphtrain.stages.data_parallel).
"""

from __future__ import annotations

import numpy as np

from graphtrain.libs import cuda
from graphtrain.reference_cnn import Optimizer, Schedule
from graphtrain.stages import device
from graphtrain.stages.baseline import BaselineStage
from graphtrain.stages.cudnn_softmax import CudnnSoftmaxStage


class GraphsStage(BaselineStage):
    name = "graphs"
    summary = "one whole training step captured into a CUDA Graph and replayed per batch"
    parts = CudnnSoftmaxStage.parts  # the step of the rung below, every part as it chose

    def reserve_extra(self, arena) -> None:
        super().reserve_extra(arena)
        self.cursor = arena.reserve("cursor", (1,), np.int32)  # first sample of the next batch
        cfg = self.config
        self.device_optimizer = None  # SGD at a constant rate: the update of the rungs before
        if (cfg.optimizer, cfg.schedule) != ("sgd", "constant"):
            grads = [*self.dw, *(db for db in self.db if db is not None)]
            self.device_optimizer = device.DeviceOptimizer(arena, self.params, grads, Optimizer.of(cfg),
                                                           Schedule.of(cfg, sum(self.plan.batches)))

    def setup_extra(self) -> None:
        super().setup_extra()
        self.graphs = {}
        self.set_cursor(0)
        if self.device_optimizer is not None:
            self.device_optimizer.load(self.device)
            self.device_optimizer.reset(self.stream)  # before the warm-up's step

    def upload_initial_weights(self) -> None:
        super().upload_initial_weights()
        if self.device_optimizer is not None:
            self.device_optimizer.reset(self.stream)  # the warm-up's step undone: step 0, zero state

    def update(self) -> None:
        if self.device_optimizer is None:
            super().update()
        else:
            self.device_optimizer.step(self.stream)

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
        if getattr(self, "device_optimizer", None) is not None:
            self.device_optimizer.close()
        super().close()
