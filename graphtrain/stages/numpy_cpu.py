"""`numpy`: the CPU rung. The reference math in float32, one vectorised step per batch, updated
by the run's recipe: its optimizer and learning-rate schedule (graphtrain.reference_cnn's)."""

from __future__ import annotations

import time

import numpy as np

from graphtrain import reference
from graphtrain.plan import RunPlan
from graphtrain.reference_cnn import Optimizer, Schedule
from graphtrain.stages.base import EpochResult, Stage


class NumpyStage(Stage):
    name = "numpy"
    summary = "CPU reference in float32, the same math as the GPU stages"

    def setup(self) -> None:
        self.layers = self.plan.initial_params(np.float32)
        self.optimizer = Optimizer.of(self.config)
        self.schedule = Schedule.of(self.config, sum(self.plan.batches))  # over the run's steps
        self.state = self.optimizer.init_state(reference.parameters(self.layers))
        self.steps = 0  # steps taken: the schedule's position, Adam's bias correction

    def restart(self, plan: RunPlan) -> bool:
        """Another plan of this shape: its initial weights and recipe, the state from zero (setup
        builds nothing else)."""
        if not self.same_shape(plan):
            return False
        self.adopt(plan)
        self.setup()
        return True

    def update(self, layers, grads, lr: float) -> None:
        """The recipe's update of step `self.steps` (1-based), every parameter alike."""
        self.optimizer.step(reference.parameters(layers), reference.parameters(grads), self.state, self.steps, lr)

    def train_epoch(self, epoch: int, num_batches: int, measure: bool) -> EpochResult:
        images, labels = self.data.train_images, self.data.train_labels
        order = self.plan.orders[epoch]
        loss_sum, correct = 0.0, 0
        start = time.perf_counter()
        # Overflow is not an error here: the trainer stops a run whose loss is not finite.
        with np.errstate(over="ignore", invalid="ignore"):
            for lo, hi in self.plan.epoch_bounds(epoch, num_batches):
                idx = order[lo:hi]
                lr = self.schedule.at(self.steps)
                self.steps += 1
                batch_loss, batch_correct = reference.train_step(self.layers, images[idx], labels[idx], lr,
                                                                 self.update)
                loss_sum += batch_loss
                correct += batch_correct
        ms = (time.perf_counter() - start) * 1e3
        seen = self.plan.samples_seen(num_batches)
        return EpochResult(ms, loss_sum / seen, correct / seen)

    def test_accuracy(self) -> float:
        return reference.accuracy(self.layers, self.data.test_images, self.data.test_labels)

    def weights(self):
        return [layer.copy() for layer in self.layers]
