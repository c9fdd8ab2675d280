"""`persistent` for the cnn: each epoch one launch of one kernel (kernels/persistent_cnn.cu), a
cooperative grid of one block per SM that runs every step's forward, backward and update between
grid barriers, the optimizer's rate and constants read on the device; the test accuracy by a second
launch of the same grid.

It trains the speedrun's kind of cnn (1-channel square images, two conv layers of stride 1, no
padding and a 2×2 pool, one hidden linear layer) and refuses any other, with the reason, before
anything is allocated. TF32 (the recipe's tf32) runs the linear layers' products on the tensor
cores in one pass; fp32 in three (each operand split hi + lo: near-fp32). The images are the
resident dataset's, normalised on the device (graphtrain.stages.cnn_shared).

A restart puts the next plan's weights, orders and recipe (device values: the kernel reads the
optimizer's constants at each launch) on what setup built, keeping the compiled kernel and the data.
"""

from __future__ import annotations

import numpy as np

from graphtrain.errors import ModelUnsupported, UsageError
from graphtrain.recipe import Recipe
from graphtrain.stages.base import EpochResult
from graphtrain.stages.cnn_rungs import CnnStage, as_layers, cnn_model, flat_params


def cnn_refusal(spec, batch: int, precision: str, sm_count: int | None = None) -> str | None:
    """Why the grid kernel cannot train this cnn, or None (its sizes checked for a grid of
    `sm_count` blocks where given: a GPU's)."""
    from graphtrain.kernels.persistent_cnn import ASSUMED_SMS, CnnShape, problems_of

    problems = problems_of(spec)
    if not problems:
        refusal = CnnShape.of(spec, batch, precision, sm_count or ASSUMED_SMS).refusal()
        problems = [refusal] if refusal else []
    return "; ".join(problems) or None


def refuse_unless_trains(spec, batch: int, precision: str, sm_count: int | None = None) -> None:
    """ModelUnsupported, with the reason, where the grid kernel cannot train this cnn."""
    refusal = cnn_refusal(spec, batch, precision, sm_count)
    if refusal is not None:
        raise ModelUnsupported(f"the persistent rung cannot train the cnn: {refusal}; use --stage graphs")


class CnnPersistentStage(CnnStage):
    name = "persistent"
    summary = "the cnn's whole epoch in one cooperative kernel: every step's layers and update between grid barriers"

    def setup(self) -> None:
        from graphtrain.kernels.optim import CONSTANTS
        from graphtrain.kernels.persistent_cnn import CnnShape, PersistentCnn
        from graphtrain.libs import cuda
        from graphtrain.libs.memory import Arena
        from graphtrain.stages.cnn_shared import MNIST_NORMALISATION, dataset_arrays, resident_data

        self.spec, self.recipe = cnn_model(self)
        refuse_unless_trains(self.spec, self.recipe.batch, self.precision)  # before the GPU is opened
        self.device = device = cuda.open_device()
        refuse_unless_trains(self.spec, self.recipe.batch, self.precision, device.sm_count)
        self.shape = shape = CnnShape.of(self.spec, self.recipe.batch, self.precision, device.sm_count)
        self.note = f"{self.precision} products on the tensor cores ({shape.passes} pass{'es' * (shape.passes > 1)})"
        self.stream = cuda.Stream()
        # The same arrays as every cnn row hands (uploaded once a process); where another model's
        # upload of them is still under way beside its setup, ready() waits for it.
        self.resident = resident_data(device, *dataset_arrays(self.data), self.stream,
                                      MNIST_NORMALISATION).acquire().ready()
        self.kernel = PersistentCnn(device, shape)
        self.arena = arena = Arena()
        n = shape.num_params
        self.params = arena.reserve("params", (n,))
        self.slot1 = arena.reserve("slot1", (n,))
        self.slot2 = arena.reserve("slot2", (n,))
        self.constants = arena.reserve("constants", (CONSTANTS.itemsize,), np.uint8)
        self.orders = arena.reserve("orders", self.plan.orders.shape, np.int32)
        self.metrics = arena.reserve("metrics", (2,), np.float64)
        self.correct = arena.reserve("correct", (2,), np.float64)
        self.workspace = arena.reserve("workspace", (self.kernel.workspace_bytes,), np.uint8)
        arena.allocate()
        self.start_event, self.end_event = cuda.Event(), cuda.Event()
        self.put_recipe(self.recipe)
        # Warm up (the kernels' first launches), then start again from the plan's initial weights.
        self.start_run()
        self.run_epoch(0, 1, False)
        self.test_accuracy()
        self.start_run()

    def put_recipe(self, recipe: Recipe) -> bool:
        """The recipe's optimizer and schedule written where the kernel reads them; False where the
        batch or the precision differ (the kernel is compiled for them)."""
        from graphtrain.kernels.optim import constants_of

        if (recipe.batch, recipe.precision) != (self.recipe.batch, self.recipe.precision):
            return False
        self.constants.upload(constants_of(recipe.optimizer, recipe.schedule).view(np.uint8), self.stream)
        return True

    def start_run(self) -> None:
        """The plan's weights and orders loaded, the optimizer's state and the step count zeroed."""
        self.params.upload(np.concatenate([p.ravel() for p in flat_params(self.plan.initial)]), self.stream)
        self.orders.upload(np.ascontiguousarray(self.plan.orders), self.stream)
        self.slot1.zero(self.stream)
        self.slot2.zero(self.stream)
        self.steps_done = 0
        self.done = 0  # samples trained so far

    def run_epoch(self, epoch: int, num_batches: int, measure: bool) -> int:
        """Queue the epoch's first num_batches steps (one launch); returns the samples they train."""
        samples = self.plan.samples_seen(num_batches)
        self.kernel.train_epoch(self.stream, self.resident.train_x.ptr, self.resident.train_y.ptr,
                                self.orders.at(epoch, 0), self.params.ptr, self.slot1.ptr, self.slot2.ptr,
                                self.constants.ptr, samples, num_batches, self.steps_done, self.metrics.ptr, measure,
                                self.workspace.ptr)
        self.steps_done += num_batches
        return samples

    def train_epoch(self, epoch: int, num_batches: int, measure: bool) -> EpochResult:
        if epoch * self.plan.num_train != self.done:
            raise UsageError("the cnn rungs train their epochs in order, each whole but the last")
        self.metrics.zero(self.stream)
        self.start_event.record(self.stream)
        seen = self.run_epoch(epoch, num_batches, measure)
        self.end_event.record(self.stream)
        self.end_event.synchronize()
        self.done += seen
        if not measure:
            return EpochResult(self.start_event.elapsed_ms(self.end_event))
        loss_sum, correct = self.metrics.download(self.stream)
        return EpochResult(self.start_event.elapsed_ms(self.end_event), loss_sum / seen, correct / seen)

    def test_accuracy(self) -> float:
        self.correct.zero(self.stream)
        num_test = self.plan.num_test
        self.kernel.evaluate(self.stream, self.resident.test_x.ptr, self.resident.test_y.ptr, num_test,
                             self.params.ptr, self.correct.ptr, self.workspace.ptr)
        return float(self.correct.download(self.stream)[1]) / num_test

    def weights(self):
        flat, out, at = self.params.download(self.stream), [], 0
        for shape in self.spec.param_shapes():
            size = int(np.prod(shape))
            out.append(flat[at:at + size].reshape(shape).copy())
            at += size
        return as_layers(out)

    def environment(self) -> dict:
        from graphtrain import environment

        return {**environment.gpu(self.device), "kernel": "persistent_cnn", "blocks": self.shape.blocks}

    def close(self) -> None:
        for name in ("arena", "start_event", "end_event", "stream"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
        if getattr(self, "resident", None) is not None:
            self.resident.release()
            self.resident = None
