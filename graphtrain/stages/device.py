"""The pieces a GPU rung is made of, each setting up only itself:

    DeviceContext    the GPU, the stream everything runs on, the two events that time an epoch
                     (and an epoch's loss and accuracy, read once at its end)
    DatasetOnDevice  the training and test sets and every epoch's sample order, in the run's arena
    Parameters       each layer's W and b in fp32, from the plan's initial weights; weights out
    DeviceOptimizer  the recipe's update (optimizer and schedule) of every parameter from its
                     gradient: one optimizer_step launch (kernels/optim.cu) over the packed span,
                     its rate from the device's step counter, so a replayed graph follows the schedule
    DeviceEvaluation test accuracy on the device: a forward pass of up to EVAL_ROWS test rows at a
                     time through the naive kernels (matmul.cu, layers.cu), then a count of the
                     rows whose largest logit is the label (metrics.cu), read once at the end

The ladder's chain (baseline … graphs) is built on them by `BaselineStage`; a rung that is its own
program composes the ones it uses beside its own kernels, and nothing else: `fused`, `bf16` and
`device-loop` through the fused step's model (graphtrain.stages.fused_mlp), `persistent` directly.
Every buffer comes from one arena: a piece reserves its buffers in the arena it is given, the
rung allocates the arena once, then each piece uploads what it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from graphtrain.config import TrainConfig
from graphtrain.data import Dataset
from graphtrain.kernels.layers import Layers
from graphtrain.kernels.matmul import Matmul
from graphtrain.kernels.metrics import Metrics
from graphtrain.kernels.optim import CONSTANTS, MAX_SLOTS, STATE_INTS, Optim, constants_of
from graphtrain.libs import cuda
from graphtrain.libs.memory import Arena, Buffer
from graphtrain.plan import RunPlan
from graphtrain.reference import Layer
from graphtrain.reference_cnn import Optimizer, Schedule
from graphtrain.stages.base import EpochResult

EVAL_ROWS = 1024  # test-set rows per forward pass when measuring accuracy

# gemm(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc): row-major C = alpha·op(A)·op(B) + beta·C
Gemm = Callable[..., None]


class DeviceContext:
    """The GPU, one stream for all of a run's work, and the events that time an epoch on it."""

    def __init__(self) -> None:
        self.device = cuda.open_device()
        self.stream = cuda.Stream()
        self.start_event, self.end_event = cuda.Event(), cuda.Event()

    def timed(self, work: Callable[[], None]) -> float:
        """Queue `work` on the stream between the two events, wait for it; its GPU time in ms."""
        self.start_event.record(self.stream)
        work()
        self.end_event.record(self.stream)
        self.end_event.synchronize()
        return self.start_event.elapsed_ms(self.end_event)

    def epoch(self, work: Callable[[], None], metrics: Buffer, measure: bool, seen: int) -> EpochResult:
        """One timed epoch (`timed(work)`); with `measure`, the [Σ loss, # correct] that `work` adds
        into `metrics` (two doubles, zeroed before it, read once after it) as means over `seen` samples."""
        if measure:
            metrics.zero(self.stream)
        ms = self.timed(work)
        if not measure:
            return EpochResult(ms)
        loss_sum, correct = metrics.download(self.stream)
        return EpochResult(ms, loss_sum / seen, correct / seen)

    def close(self) -> None:
        for obj in (self.start_event, self.end_event, self.stream):
            obj.close()


class DatasetOnDevice:
    """The dataset and the plan's sample orders in the arena. `train_images=False` leaves the fp32
    training images out, for a rung whose kernel reads them in another form of its own."""

    def __init__(self, arena: Arena, plan: RunPlan, data: Dataset, train_images: bool = True):
        self.plan, self.data = plan, data
        self.num_train, self.num_test = plan.num_train, plan.num_test
        features = plan.config.in_features
        self.train_images = arena.reserve("train_images", (self.num_train, features)) if train_images else None
        self.train_labels = arena.reserve("train_labels", (self.num_train,), np.int32)
        self.test_images = arena.reserve("test_images", (self.num_test, features))
        self.test_labels = arena.reserve("test_labels", (self.num_test,), np.int32)
        # Every epoch's sample order, uploaded once: epoch e's batch at `lo` starts at e·N + lo.
        self.order = arena.reserve("order", (plan.orders.size,), np.int32)

    def upload(self, stream: cuda.Stream) -> None:
        data = self.data
        if self.train_images is not None:
            self.train_images.upload(data.train_images, stream)
        self.train_labels.upload(data.train_labels.astype(np.int32), stream)
        self.test_images.upload(data.test_images, stream)
        self.test_labels.upload(data.test_labels.astype(np.int32), stream)
        self.upload_orders(self.plan, stream)

    def upload_orders(self, plan: RunPlan, stream: cuda.Stream) -> None:
        """Every epoch's sample order of `plan`, a plan of this dataset's sizes: the orders of the
        run it was uploaded for, or of the next one a restart puts on it (the images stay)."""
        self.plan = plan
        self.order.upload(plan.orders.ravel(), stream)


class Parameters:
    """W_i (fan_out × fan_in) and b_i of every layer, fp32: the weights, then the biases, each kind
    in layer order and so one span (the fused rungs update or convert a kind in one pass)."""

    def __init__(self, arena: Arena, config: TrainConfig):
        layers = list(enumerate(zip(config.dims[:-1], config.dims[1:]), 1))
        self.w = [arena.reserve(f"w{i}", (fan_out, fan_in)) for i, (fan_in, fan_out) in layers]
        self.b = [arena.reserve(f"b{i}", (fan_out,)) if config.bias else None for i, (_, fan_out) in layers]

    def upload(self, layers: Sequence[Layer], stream: cuda.Stream) -> None:
        for w, b, layer in zip(self.w, self.b, layers):
            w.upload(layer.w, stream)
            if b is not None:
                b.upload(layer.b, stream)

    def download(self, stream: cuda.Stream) -> list[Layer]:
        return [Layer(w.download(stream), None if b is None else b.download(stream)) for w, b in zip(self.w, self.b)]


class DeviceOptimizer:
    """The recipe's update of all the parameters at once, as the cnn's (graphtrain.stages.cnn_device):
    one optimizer_step over the packed span of `params` (every W, then every b) from the gradients'
    span laid out alike (`grads`, every dW then every db, in the same order and shapes), with
    `slots` state spans beside them (default: what the optimizer needs). The step counter lives on
    the device and the kernel reads its rate from it, so a captured step replays the schedule; the
    update is elementwise, the same bits every run.

    The optimizer's and the schedule's constants live on the device too (optim.py's CONSTANTS),
    written by `load` and again by `set_recipe`: a step captured once trains the recipe written
    last, with no re-capture. `over_span` builds one for parameters that already lie in one
    buffer (the cnn's)."""

    def __init__(self, arena: Arena, params: Parameters, grads: Sequence[Buffer], optimizer: Optimizer,
                 schedule: Schedule, slots: int | None = None):
        weights = [*params.w, *(b for b in params.b if b is not None)]
        count = (weights[-1].offset + weights[-1].nbytes - weights[0].offset) // 4
        for param, grad in zip(weights, grads, strict=True):  # one index serves both spans
            if (param.shape != grad.shape
                    or param.offset - weights[0].offset != grad.offset - grads[0].offset):
                raise RuntimeError(f"the gradient {grad.name} does not lie where {param.name} does in its span")
        self._plan(arena, weights[0], grads[0], count, optimizer, schedule, slots)

    @classmethod
    def over_span(cls, arena: Arena, params: Buffer, grads: Buffer, optimizer: Optimizer, schedule: Schedule,
                  slots: int | None = None) -> DeviceOptimizer:
        """The update of the fp32 parameters in `params` from the gradients in `grads`, one
        buffer each of the same shape (their padding, if any, zero in both)."""
        if params.shape != grads.shape or params.dtype != np.float32 or grads.dtype != np.float32:
            raise RuntimeError(f"the gradients {grads.name} {grads.shape} are not laid out as the parameters "
                               f"{params.name} {params.shape} (fp32 both)")
        made = cls.__new__(cls)
        made._plan(arena, params, grads, params.size, optimizer, schedule, slots)
        return made

    def _plan(self, arena: Arena, params_span: Buffer, grads_span: Buffer, count: int, optimizer: Optimizer,
              schedule: Schedule, slots: int | None) -> None:
        self.optimizer, self.schedule = optimizer, schedule
        self.params_span, self.grads_span, self.count = params_span, grads_span, count
        self.slots = optimizer.slots if slots is None else slots
        if not optimizer.slots <= self.slots <= MAX_SLOTS:
            raise ValueError(f"{self.slots} optimizer state slots: {optimizer.kind} needs {optimizer.slots}, "
                             f"and none needs more than {MAX_SLOTS}")
        self.slot1 = arena.reserve("opt_slot1", (count,)) if self.slots >= 1 else None
        self.slot2 = arena.reserve("opt_slot2", (count,)) if self.slots >= 2 else None
        self.state = arena.reserve("opt_state", (STATE_INTS,), np.int32)  # [steps taken, blocks done]
        self.lr_used = arena.reserve("opt_lr", (1,))  # the rate of the last step
        self.constants = arena.reserve("opt_constants", (1,), CONSTANTS)  # what optimizer_step reads
        self.optim_cu: Optim | None = None
        self.uploads: cuda.Stream | None = None

    def load(self, device: cuda.DeviceInfo) -> None:
        """Compile (or read from the cache) and load optim.cu; write the constants (the arena
        is allocated)."""
        self.optim_cu = Optim(device)
        self.uploads = cuda.Stream()  # set_recipe's writes, each waited for
        self.set_recipe(self.optimizer, self.schedule)

    def refusal(self, optimizer: Optimizer) -> str | None:
        """Why `set_recipe` cannot take `optimizer`, or None."""
        if optimizer.slots > self.slots:
            return (f"the optimizer {optimizer.kind} keeps {optimizer.slots} state arrays a parameter, and "
                    f"{self.slots} were allocated")
        return None

    def set_recipe(self, optimizer: Optimizer, schedule: Schedule) -> None:
        """Write `optimizer`'s and `schedule`'s constants where optimizer_step reads them (waits
        for the copy): every later step, a graph captured before included, trains with them.
        Between runs only: no step may be running. ValueError where the optimizer needs more
        state slots than were allocated."""
        why = self.refusal(optimizer)
        if why is not None:
            raise ValueError(why)
        self.constants.upload(constants_of(optimizer, schedule), self.uploads)
        self.optimizer, self.schedule = optimizer, schedule

    def reset(self, stream: cuda.Stream) -> None:
        """Queue the start of a run: no steps taken, zero state, and the gradients' span zeroed,
        so the alignment padding between them is 0 (its parameters stay as they are)."""
        for buf in (self.state, self.slot1, self.slot2):
            if buf is not None:
                buf.zero(stream)
        cuda.memset(self.grads_span.ptr, 0, self.count * 4, stream)

    def step(self, stream: cuda.Stream) -> None:
        """Queue one update of every parameter from its gradient (capturable)."""
        self.optim_cu.step(stream, self.params_span.ptr, self.grads_span.ptr, self.slot1.ptr if self.slot1 else 0,
                           self.slot2.ptr if self.slot2 else 0, self.count, self.state.ptr, self.lr_used.ptr,
                           self.constants.ptr)

    def close(self) -> None:
        for obj in (self.optim_cu, self.uploads):
            if obj is not None:
                obj.close()


def forward(gemm: Gemm, layers_cu: Layers, stream: cuda.Stream, dims: Sequence[int], params: Parameters,
            x_ptr: int, outputs: Sequence[Buffer], rows: int) -> None:
    """outputs[i] = ReLU(input_i W_iᵀ + b_i), input_0 = x, input_i = outputs[i-1]; no ReLU on the
    logits (the last output). One product and one bias/ReLU pass a layer."""
    last = len(params.w) - 1
    for i, (w, b) in enumerate(zip(params.w, params.b)):
        src = x_ptr if i == 0 else outputs[i - 1].ptr
        out, fan_in, fan_out = outputs[i], dims[i], dims[i + 1]
        gemm(False, True, rows, fan_out, fan_in, 1.0, src, fan_in, w.ptr, fan_in, 0.0, out.ptr, fan_out)
        if b is not None or i < last:
            layers_cu.bias_relu(stream, out.ptr, b.ptr if b is not None else 0, rows, fan_out, i < last)


def count_correct(stream: cuda.Stream, metrics_cu: Metrics, dataset: DatasetOnDevice, rows_per_pass: int,
                  forward_rows: Callable[[int, int], Buffer], classes: int, correct: int) -> float:
    """Test accuracy: `forward_rows(x_ptr, rows)` (which returns the logits' buffer) over the test
    set `rows_per_pass` rows at a time, each pass's correct rows added into the double at
    `correct` on the device; one read at the end."""
    cuda.memset(correct, 0, 8, stream)
    for lo in range(0, dataset.num_test, rows_per_pass):
        rows = min(rows_per_pass, dataset.num_test - lo)
        logits = forward_rows(dataset.test_images.at(lo, 0), rows)
        metrics_cu.batch_correct(stream, logits.ptr, dataset.test_labels.at(lo), rows, classes, correct, True)
    count = cuda.copy_to_host(correct, np.zeros(1), stream)[0]
    return float(count) / dataset.num_test


class DeviceEvaluation:
    """Test accuracy of the fp32 parameters through the naive kernels, with buffers of its own:
    for a rung whose training loop computes no forward pass that could serve (its own program)."""

    def __init__(self, arena: Arena, config: TrainConfig, dataset: DatasetOnDevice):
        self.config, self.dataset = config, dataset
        self.rows = min(EVAL_ROWS, dataset.num_test)
        self.outputs = [arena.reserve(f"eval_h{i}", (self.rows, d)) for i, d in enumerate(config.dims[1:-1], 1)]
        self.outputs.append(arena.reserve("eval_logits", (self.rows, config.classes)))
        self.correct = arena.reserve("eval_correct", (1,), np.float64)
        self.matmul_cu = self.layers_cu = self.metrics_cu = None

    def load(self, device: cuda.DeviceInfo) -> None:
        """Compile (or read from the cache) and load the three kernel files."""
        self.matmul_cu, self.layers_cu, self.metrics_cu = Matmul(device), Layers(device), Metrics(device)

    def accuracy(self, stream: cuda.Stream, params: Parameters) -> float:
        def forward_rows(x_ptr: int, rows: int) -> Buffer:
            gemm = lambda *args: self.matmul_cu.gemm(stream, *args)  # noqa: E731
            forward(gemm, self.layers_cu, stream, self.config.dims, params, x_ptr, self.outputs, rows)
            return self.outputs[-1]

        return count_correct(stream, self.metrics_cu, self.dataset, self.rows, forward_rows, self.config.classes,
                             self.correct.ptr)

    def close(self) -> None:
        for obj in (self.matmul_cu, self.layers_cu, self.metrics_cu):
            if obj is not None:
                obj.close()
