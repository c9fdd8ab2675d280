"""The rungs' classes that train the `cnn` model (`--conv`, the `speedrun` preset) on `numpy`,
`graphs` and `device-loop`; the row registry (graphtrain.stages.REGISTRY) names them, and the
reason each other row cannot train the cnn.

The cnn is its own program rather than a step of the MLP chain (baseline → … → device-loop):
its layers, optimizer and schedule live in `graphtrain.stages.cnn_device.CnnDevice`, and these
rungs only decide how its recorded step reaches the GPU, as `graphs` and `device-loop` do for
the MLPs:

    graphs       the step captured once into a CUDA graph, replayed per batch by the host
    device-loop  each epoch one graph: a WHILE node over the steps (5 a body), one launch

Every batch is a full-size step (the tail batch's extra rows get zero gradient), so one step
graph serves the whole run. The images are normalised with MNIST's mean and standard deviation
on upload, as the speedrun recipe does (a saved cnn records it, `graphtrain.model_io`).

A set-up row trains the next plan of its shape in place (`restart`): numpy takes its initial
weights and recipe; graphs and device-loop write the recipe as device values
(`CnnDevice.set_recipe`), load the weights and orders and zero the run's counters, keeping the
uploaded data and the captured graphs.
"""

from __future__ import annotations

import time
from typing import ClassVar

import numpy as np

from graphtrain import reference_cnn
from graphtrain.errors import UsageError
from graphtrain.plan import RunPlan
from graphtrain.recipe import Recipe
from graphtrain.reference import Layer
from graphtrain.stages.base import EpochResult, Stage


def cnn_recipe(stage: Stage) -> Recipe:
    """The recipe of a stage's cnn run: its config's, over the plan's steps."""
    from graphtrain.recipe import recipe_of

    plan = stage.plan
    return recipe_of(stage.config, sum(plan.batches), plan.num_epochs, stage.precision)


def cnn_setup(stage: Stage):
    """The spec, the recipe and the normalised images of a stage's cnn run (the same image arrays
    for every row of a process that trains on the same dataset: graphtrain.recipe.normalised)."""
    from graphtrain.recipe import normalised

    return (*cnn_model(stage), normalised(stage.data.train_images), normalised(stage.data.test_images))


def cnn_model(stage: Stage):
    """The spec and the recipe of a stage's cnn run (a row that normalises the images itself)."""
    from graphtrain.config import cnn_spec

    return cnn_spec(stage.config), cnn_recipe(stage)


def flat_params(layers) -> list[np.ndarray]:
    return [a for layer in layers for a in (layer.w, layer.b)]


def as_layers(params: list[np.ndarray]) -> list[Layer]:
    return [Layer(params[i], params[i + 1]) for i in range(0, len(params), 2)]


class CnnStage(Stage):
    """What every class that trains the cnn shares, rungs and peers: the recipe from the run's
    config, and a restart that takes a plan of the same shape whose recipe the row can train in
    place (`put_recipe`), then starts its run (`start_run`)."""

    model_kind = "cnn"
    recipe: Recipe  # the recipe of the plan the row trains now

    def start_run(self) -> None:
        """On the set-up row: the plan's initial weights and sample orders, the optimizer's state
        and the step count from zero (what setup ends with, and a restart)."""
        raise NotImplementedError

    def put_recipe(self, recipe: Recipe) -> bool:
        """Make `recipe` the one the row trains, where it holds the recipe (device values, a
        captured graph); False where it cannot, nothing changed. Here the recipe is only read
        when a run starts."""
        return True

    def restart(self, plan: RunPlan) -> bool:
        if not self.same_shape(plan):
            return False
        previous = self.plan
        self.adopt(plan)
        recipe = cnn_recipe(self)
        if not self.put_recipe(recipe):
            self.adopt(previous)
            return False
        self.recipe = recipe
        self.start_run()
        return True


class CnnNumpyStage(CnnStage):
    name = "numpy"
    summary = "CPU reference in float32 (the cnn: NumPy convolutions, Adam or SGD, the schedule)"
    note = "float32 NumPy on the CPU"

    def setup(self) -> None:
        self.spec, self.recipe, self.train_x, self.test_x = cnn_setup(self)
        self.start_run()

    def start_run(self) -> None:
        self.params = flat_params(self.plan.initial_params(np.float32))
        self.state = self.recipe.optimizer.init_state(self.params)
        self.t = 0

    def train_epoch(self, epoch: int, num_batches: int, measure: bool) -> EpochResult:
        order, labels, loss_sum = self.plan.orders[epoch], self.data.train_labels, 0.0
        start = time.perf_counter()
        for lo, hi in self.plan.epoch_bounds(epoch, num_batches):
            idx = order[lo:hi]
            loss = reference_cnn.train_step(self.spec, self.params, self.train_x[idx], labels[idx],
                                            self.recipe.optimizer, self.state, self.t + 1,
                                            self.recipe.schedule.at(self.t))
            loss_sum += loss * (hi - lo)
            self.t += 1
        ms = (time.perf_counter() - start) * 1e3
        return EpochResult(ms, loss_sum / self.plan.samples_seen(num_batches))

    def test_accuracy(self) -> float:
        return reference_cnn.accuracy(self.spec, self.params, self.test_x, self.data.test_labels)

    def weights(self) -> list[Layer]:
        return as_layers([p.copy() for p in self.params])


class CnnGraphsStage(CnnStage):
    name = "graphs"
    summary = "the cnn's whole step captured into a CUDA Graph once and replayed per batch"
    device_loop = False  # whether the model records WHILE nodes (device-loop's own)
    # The conv layers: "fused" (kernels/convpool*.cu, where every layer fits them) or "cudnn".
    conv_path: ClassVar[str] = "fused"

    @classmethod
    def first_uses(cls) -> list:
        """The lane the model runs on, with its cuBLASLt handle (the linear layers' products:
        cnn_shared.first_use), and cuDNN's start where the conv layers are asked of it, which
        `graphtrain run` begins beside the data loading."""
        from graphtrain.libs import cudnn
        from graphtrain.stages import cnn_shared

        return [cnn_shared.first_use, *([cudnn.first_use] if cls.conv_path == "cudnn" else [])]

    @classmethod
    def on_conv_path(cls, path: str) -> type[CnnGraphsStage]:
        """This row with its conv layers on `path` (the speedrun's --conv-path)."""
        if path not in ("fused", "cudnn"):
            raise ValueError(f"unknown conv path {path!r}")
        return cls if path == cls.conv_path else type(cls.__name__, (cls,), {"conv_path": path})

    def setup(self) -> None:
        from graphtrain.libs import cuda
        from graphtrain.stages.cnn_device import CnnDevice
        from graphtrain.stages.cnn_shared import MNIST_NORMALISATION, dataset_arrays

        self.spec, self.recipe = cnn_model(self)
        self.device = cuda.open_device()
        # The images as loaded, normalised on the device: the same arrays for every row, so the
        # dataset is uploaded once per process.
        self.model = m = CnnDevice(self.device, self.spec, self.recipe, *dataset_arrays(self.data),
                                   fused=self.conv_path == "fused", device_loop=self.device_loop,
                                   normalisation=MNIST_NORMALISATION, **self.model_options())
        self.note = m.precision_note()
        self.start_event, self.end_event = cuda.Event(), cuda.Event()
        # Warm up (the first launch of every kernel and library call, the evaluation's too), then
        # start again from the plan's initial weights.
        m.load(flat_params(self.plan.initial), self.plan.orders)
        m.reset(m.stream)
        m.record_step(m.stream)
        m.record_eval(m.stream)
        # No wait for the warm-up: start_run's uploads are queued after it on the same stream and
        # wait for themselves (a warm-up kernel's failure surfaces there).
        self.start_run()
        self.capture()

    def start_run(self) -> None:
        """The plan's weights and orders loaded (two uploads), the run's counters (cursor, step,
        optimizer state, sums) zeroed: what the captured graphs start from."""
        m = self.model
        m.load(flat_params(self.plan.initial), self.plan.orders)
        m.reset(m.stream)
        self.done = 0  # samples trained so far

    def put_recipe(self, recipe: Recipe) -> bool:
        """The recipe written as device values that the captured graphs read: no new capture.
        False where it differs in what a capture holds (CnnDevice.set_recipe says so: the batch,
        the precision, the optimizer's state slots)."""
        try:
            self.model.set_recipe(recipe)
        except ValueError:
            return False
        return True

    def model_options(self) -> dict:
        """CnnDevice's keyword arguments beyond the run's (a data-parallel rank's: rank, ranks, all_reduce)."""
        return {}

    def read_loss_sum(self) -> float:
        """Σ loss over the rows trained since the sum was zeroed."""
        return self.model.read_loss_sum()

    def capture(self) -> None:
        from graphtrain.libs import cuda

        with cuda.Graph.capture(self.model.stream) as graph:
            self.model.record_step(self.model.stream)
        self.step_graph = graph

    def run_batches(self, epoch: int, num_batches: int) -> None:
        for _ in range(num_batches):
            self.step_graph.launch(self.model.stream)

    def train_epoch(self, epoch: int, num_batches: int, measure: bool) -> EpochResult:
        m, s = self.model, self.model.stream
        if epoch * self.plan.num_train != self.done:
            raise UsageError("the cnn rungs train their epochs in order, each whole but the last")
        m.loss_sum.zero(s)
        self.start_event.record(s)
        self.run_batches(epoch, num_batches)
        self.end_event.record(s)
        self.end_event.synchronize()
        seen = self.plan.samples_seen(num_batches)
        self.done += seen
        # The loss sum is one more read from the device: only where the epoch is measured.
        return EpochResult(self.start_event.elapsed_ms(self.end_event),
                           self.read_loss_sum() / seen if measure else None)

    def test_accuracy(self) -> float:
        self.model.record_eval(self.model.stream)
        return self.model.read_correct() / self.plan.num_test

    def weights(self) -> list[Layer]:
        return as_layers(self.model.weights())

    def environment(self) -> dict:
        from graphtrain import environment

        return {**environment.gpu(self.device), **self.model.environment()}

    def close(self) -> None:
        for name in ("step_graph", "model", "start_event", "end_event"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()


class CnnDeviceLoopStage(CnnGraphsStage):
    name = "device-loop"
    summary = "the cnn's epoch from one graph launch: a conditional WHILE node over the steps"
    device_loop = True

    def capture(self) -> None:
        """Every epoch length's graph, before the first epoch is timed (the cursor and the step
        counter live on the device, so one graph serves every epoch of its length, and every
        plan a restart puts on the row)."""
        from graphtrain.libs import cuda

        self.outer = cuda.Stream()
        self.epoch_graphs: dict[int, cuda.Graph] = {}
        for num_batches in sorted(set(self.plan.batches)):
            self.epoch_graph(num_batches)

    def epoch_graph(self, num_batches: int):
        if num_batches not in self.epoch_graphs:  # only a length the run's epochs do not have (a test's partial epoch)
            self.epoch_graphs[num_batches] = self.model.capture_steps(num_batches, self.outer)
        return self.epoch_graphs[num_batches]

    def run_batches(self, epoch: int, num_batches: int) -> None:
        from graphtrain.libs import cuda

        graph = self.epoch_graph(num_batches)
        cuda.stream_wait(self.outer, self.model.stream)
        graph.launch(self.outer)
        cuda.stream_wait(self.model.stream, self.outer)

    def close(self) -> None:
        for graph in getattr(self, "epoch_graphs", {}).values():
            graph.close()
        if getattr(self, "outer", None) is not None:
            self.outer.close()
        super().close()
