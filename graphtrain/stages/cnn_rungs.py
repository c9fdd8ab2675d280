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
"""

from __future__ import annotations

import time

import numpy as np

from graphtrain import reference_cnn
from graphtrain.errors import UsageError
from graphtrain.reference import Layer
from graphtrain.stages.base import EpochResult, Stage

def cnn_setup(stage: Stage):
    """The spec, the recipe and the normalised images of a stage's cnn run."""
    from graphtrain.config import cnn_spec
    from graphtrain.recipe import normalise, recipe_of

    plan = stage.plan
    recipe = recipe_of(stage.config, sum(plan.batches), plan.num_epochs, stage.precision)
    return (cnn_spec(stage.config), recipe, normalise(stage.data.train_images),
            normalise(stage.data.test_images))


def flat_params(layers) -> list[np.ndarray]:
    return [a for layer in layers for a in (layer.w, layer.b)]


def as_layers(params: list[np.ndarray]) -> list[Layer]:
    return [Layer(params[i], params[i + 1]) for i in range(0, len(params), 2)]


class CnnNumpyStage(Stage):
    name = "numpy"
    summary = "CPU reference in float32 (the cnn: NumPy convolutions, Adam or SGD, the schedule)"
    model_kind = "cnn"

    def setup(self) -> None:
        self.spec, self.recipe, self.train_x, self.test_x = cnn_setup(self)
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


class CnnGraphsStage(Stage):
    name = "graphs"
    summary = "the cnn's whole step captured into a CUDA Graph once and replayed per batch"
    model_kind = "cnn"
    device_loop = False  # whether the model records WHILE nodes (device-loop's own)

    def setup(self) -> None:
        from graphtrain.libs import cuda
        from graphtrain.stages.cnn_device import CnnDevice

        self.spec, self.recipe, train_x, test_x = cnn_setup(self)
        self.device = cuda.open_device()
        data = self.data
        self.model = m = CnnDevice(self.device, self.spec, self.recipe, train_x, data.train_labels.astype(np.int32),
                                   test_x, data.test_labels.astype(np.int32), device_loop=self.device_loop,
                                   **self.model_options())
        self.note = m.precision_note()
        self.start_event, self.end_event = cuda.Event(), cuda.Event()
        initial = flat_params(self.plan.initial)
        m.load(initial, self.plan.orders)  # warm up (first launches), then start again from the shared init
        m.reset(m.stream)
        m.record_step(m.stream)
        m.stream.synchronize()
        m.load(initial, self.plan.orders)
        m.reset(m.stream)
        self.capture()

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
        if epoch * self.plan.num_train != self.samples_done():
            raise UsageError("the cnn rungs train their epochs in order, each whole but the last")
        m.loss_sum.zero(s)
        self.start_event.record(s)
        self.run_batches(epoch, num_batches)
        self.end_event.record(s)
        self.end_event.synchronize()
        self.done = getattr(self, "done", 0) + self.plan.samples_seen(num_batches)
        return EpochResult(self.start_event.elapsed_ms(self.end_event),
                           self.read_loss_sum() / self.plan.samples_seen(num_batches))

    def samples_done(self) -> int:
        return getattr(self, "done", 0)

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
        counter live on the device, so one graph serves every epoch of its length)."""
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
