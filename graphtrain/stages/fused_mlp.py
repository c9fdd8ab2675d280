"""The model the fused rungs (`fused`, `bf16`, `device-loop`) train: an MLP (softmax regression has
no hidden layer) on the GPU, stepped by the fused step. What the step does, and why, is the
`fused` rung's lesson (graphtrain.stages.fused); how its steps reach the GPU is each rung's own
(a graph replayed per batch, or a WHILE node per epoch).

    FusedMlp     the device pieces it reads (graphtrain.stages.device: the dataset, the
                 parameters, the recipe's optimizer) and the step's own buffers, kernels
                 (kernels/gather.cu, kernels/fused.cu) and cuBLASLt products, in the run's arena;
                 `record_step(stream, rows, measure)` queues one step on the stream it is handed,
                 eagerly or into a capture; `accuracy` runs the test set forward through cuBLAS
    Bf16Copies   with bf16 operands: the bf16 copies the hidden layers' products read

The operands' precision is a parameter, the row's precision: "fp32", or "bf16", where the hidden
layers' products read bf16 copies of the batch, the activations, their gradients, the weights and
the biases, and accumulate in fp32. The head, the master weights and every sum stay fp32 either
way, so softmax regression (all head) trains in fp32 alone.

A model set up once trains the next plan of its shape in place (`start_run`): the plan's initial
weights, sample orders and recipe, as `start` leaves them after its warm-up. A recorded step holds
pointers, the batch's rows and whether it measures, and with SGD fused into it the rate as kernel
arguments and the products' α (`step_constants`): a rung re-captures its steps where that
changes. With another recipe the step holds none of it: the optimizer reads its constants and its
rate from the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from graphtrain.config import TrainConfig
from graphtrain.data import Dataset
from graphtrain.errors import ModelUnsupported
from graphtrain.kernels.fused import Fused
from graphtrain.kernels.gather import Gather
from graphtrain.kernels.layers import Layers
from graphtrain.kernels.metrics import Metrics
from graphtrain.libs import cublas, cublaslt, cuda, nvrtc
from graphtrain.libs.cublas import Cublas
from graphtrain.libs.cublaslt import R_16BF, R_32F, Lt, LtMatmul, Product
from graphtrain.libs.memory import Arena, Buffer
from graphtrain.plan import RunPlan
from graphtrain.reference import Layer
from graphtrain.reference_cnn import Optimizer, Schedule
from graphtrain.stages import device
from graphtrain.stages.base import Stage
from graphtrain.stages.cublas_gemm import WORKSPACE_BYTES

BF16 = np.uint16  # the arena holds bf16 values as their 16 bits
# The hidden layers' operand and activation type, by precision (cuBLASLt's data types).
OPERAND_TYPES = {"fp32": R_32F, "bf16": R_16BF}


def refuse_unless_fused(rung: str, config: TrainConfig) -> None:
    """ModelUnsupported where the fused head cannot train `config` (before any GPU work)."""
    refusal = Fused.refusal(config.batch, config.classes)
    if refusal is not None:
        raise ModelUnsupported(f"the {rung} rung cannot train {refusal}; use --stage graphs")


def open_fused(rung: Stage) -> tuple[device.DeviceContext, Arena, FusedMlp]:
    """A fused rung's setup up to its own buffers: the refusal (before any GPU work), the GPU and
    its stream, and an arena holding the model's buffers at the rung's precision, for the rung to
    add its own to and allocate."""
    refuse_unless_fused(rung.name, rung.config)
    context, arena = device.DeviceContext(), Arena()
    return context, arena, FusedMlp(arena, rung.plan, rung.data, rung.precision)


def fused_sgd(config: TrainConfig) -> bool:
    """Whether the fused step trains `config` with SGD fused into its products and kernels (SGD at a
    constant rate), rather than computing gradients for the recipe's optimizer (DeviceOptimizer)."""
    return (config.optimizer, config.schedule) == ("sgd", "constant")


class FusedRung(Stage):
    """What the rungs that train a FusedMlp share (`fused`, `bf16`, `device-loop`): the restart.
    A rung's setup leaves `mlp` started on `stream`, and its graphs captured by `capture`
    (`captured_for`: the step constants they hold)."""

    mlp: FusedMlp
    stream: cuda.Stream
    captured_for: tuple  # FusedMlp.step_constants of the config the graphs were captured with

    def capture(self) -> None:
        """(Re)capture every graph the rung replays, from the model's config; `captured_for` set."""
        raise NotImplementedError

    def restart(self, plan: RunPlan) -> bool:
        """The plan's weights, orders and recipe on the model (FusedMlp.start_run); the graphs
        kept where they hold nothing of the recipe that changed (an optimizer's recipe, or the same
        fused SGD rate), else captured again. False, the row untouched, for another shape or where
        the model's buffers were laid out for another recipe (FusedMlp.restart_refusal)."""
        if not self.same_shape(plan) or self.mlp.restart_refusal(plan) is not None:
            return False
        self.adopt(plan)
        self.mlp.start_run(plan, self.stream)
        if self.mlp.step_constants(plan.config) != self.captured_for:
            self.capture()
        return True


def bf16_where_hidden(config: TrainConfig, chosen: str) -> str:
    """The precision a row with bf16 operands trains `config` in, `chosen` being its own: bf16
    operands are read only by the hidden layers' products, so softmax regression (all head, the
    fp32 kernels) trains in fp32."""
    return chosen if config.hidden else "fp32"


def span(buffers: Sequence[Buffer]) -> int:
    """Floats from the first buffer's start to the last one's end (they were reserved in order)."""
    return (buffers[-1].offset + buffers[-1].nbytes - buffers[0].offset) // 4


class Bf16Copies:
    """What the hidden layers' products read as bf16: the batch (gathered straight into bf16),
    each hidden layer's activations and their gradients (written bf16 by the products and kernels
    that make them), and copies of the hidden layers' weights and biases, laid out like their fp32
    spans so that one index serves both (refreshed from the fp32 masters at the end of a step)."""

    def __init__(self, arena: Arena, config: TrainConfig, params: device.Parameters):
        rows, hidden = config.batch, config.dims[1:-1]
        self.h = [arena.reserve(f"h{i}_16", (rows, d), BF16) for i, d in enumerate(hidden, 1)]
        self.dh = [arena.reserve(f"dh{i}_16", (rows, d), BF16) for i, d in enumerate(hidden, 1)]
        self.x = arena.reserve("x16", (rows, config.in_features), BF16)
        self.w_masters, self.b_masters = params.w[:-1], params.b[:-1]
        self.w = arena.reserve("w16", (span(self.w_masters),), BF16)
        self.b = arena.reserve("b16", (span(self.b_masters),), BF16) if config.bias else None

    def weight(self, i: int) -> int:
        return self.w.at((self.w_masters[i].offset - self.w_masters[0].offset) // 4)

    def bias(self, i: int) -> int:
        return self.b.at((self.b_masters[i].offset - self.b_masters[0].offset) // 4)


class FusedMlp:
    """The dataset, the parameters, their gradients and the fused step's buffers in one arena
    (reserved here, allocated by the rung), then `start` makes the kernels and products and takes
    one warm-up step; `record_step` queues a step on the stream it is handed."""

    def __init__(self, arena: Arena, plan: RunPlan, data: Dataset, precision: str):
        cfg = self.config = plan.config
        if precision not in OPERAND_TYPES or (precision == "bf16" and not cfg.hidden):
            raise ValueError(f"no fused step with {precision} operands for a {cfg.layers_text} model")
        self.plan, self.precision = plan, precision
        self.dataset = device.DatasetOnDevice(arena, plan, data)
        # Weights, then biases, then their gradients laid out alike: the fused step updates or
        # converts a kind in one pass over its span, and the recipe's optimizer reads both spans.
        self.params = device.Parameters(arena, cfg)
        self.w, self.b = self.params.w, self.params.b
        self.dw = [arena.reserve(f"d{w.name}", w.shape) for w in self.w]
        self.db = [arena.reserve(f"d{b.name}", b.shape) if b is not None else None for b in self.b]
        # fp32 activations and their gradients, with rows enough for the test set's forward pass:
        # acts[0] the batch x, acts[i] layer i's output (after ReLU), acts[-1] the logits;
        # grads[i] = dL/dacts[i], i ≥ 1.
        self.rows = max(cfg.batch, min(device.EVAL_ROWS, plan.num_test))
        self.acts = [arena.reserve("x", (self.rows, cfg.in_features))]
        self.acts += [arena.reserve(f"h{i}", (self.rows, d)) for i, d in enumerate(cfg.dims[1:-1], 1)]
        self.acts.append(arena.reserve("logits", (self.rows, cfg.classes)))
        self.grads = [None] + [arena.reserve(f"d{buf.name}", buf.shape) for buf in self.acts[1:]]
        self.y = arena.reserve("y", (self.rows,), np.int32)
        self.metrics = arena.reserve("metrics", (2,), np.float64)  # [Σ loss, # correct]
        # cuBLAS (the test set's forward pass) and cuBLASLt (the step's products) share one
        # workspace: both run on the one stream, one call at a time.
        self.workspace = arena.reserve("cublas_workspace", (WORKSPACE_BYTES,), np.uint8)
        self.cursor = arena.reserve("cursor", (1,), np.int32)  # first sample of the next batch
        self.optimizer = None  # SGD at a constant rate: fused into the products and kernels
        if not fused_sgd(cfg):
            grads = [*self.dw, *(db for db in self.db if db is not None)]
            self.optimizer = device.DeviceOptimizer(arena, self.params, grads, Optimizer.of(cfg),
                                                    Schedule.of(cfg, sum(plan.batches)))
        self.row_loss = arena.reserve("row_loss", (cfg.batch,))  # per row, summed by the head's update
        self.row_correct = arena.reserve("row_correct", (cfg.batch,))
        self.copies = Bf16Copies(arena, cfg, self.params) if precision == "bf16" else None
        self.gather_cu = self.layers_cu = self.metrics_cu = self.fused_cu = self.blas = self.lt = None
        self.products: dict[int, dict[str, list[LtMatmul | None]]] = {}

    @staticmethod
    def first_uses() -> list:
        """The libraries `start` makes a handle of, whose once-a-process start can begin beside
        the data loading (a rung's `first_uses`): cuBLAS, for the test set's forward pass."""
        return [cublas.first_use]

    # ---- setup, once the arena is allocated -----------------------------------------------------

    def start(self, device_info: cuda.DeviceInfo, stream: cuda.Stream) -> None:
        """Upload the dataset, make the kernels and the products, take one step of the first batch
        (first launches, library heuristics), then start again from the plan's initial weights."""
        cfg = self.config
        self.dataset.upload(stream)
        self.gather_cu, self.layers_cu, self.metrics_cu = Gather(device_info), Layers(device_info), Metrics(device_info)
        # cuBLAS runs only the eager test-set forward pass, on the fp32 weights.
        self.blas = Cublas(stream, self.workspace.ptr, self.workspace.nbytes, precision="fp32")
        self.set_cursor(stream, 0)
        if self.optimizer is not None:
            self.optimizer.load(device_info)
            self.optimizer.reset(stream)  # before the warm-up's step
        self.fused_cu = Fused(device_info, cfg.classes, bf16=self.copies is not None)
        if cfg.hidden:  # only hidden layers have products wide enough for cuBLASLt
            self.lt = Lt(self.workspace.ptr, self.workspace.nbytes, arch=device_info.arch)
            self.products = {rows: self.plan_products(rows) for rows in self.plan.batch_sizes}
        if cfg.bias:  # the padding between the packed biases stays zero
            for buf in (*self.b, *self.db):
                buf.zero(stream)
        self.metrics.zero(stream)
        self.record_step(stream, self.plan.batch_sizes[0], measure=True)
        stream.synchronize()
        self.start_run(self.plan, stream)  # the warm-up's step undone

    def start_run(self, plan: RunPlan, stream: cuda.Stream) -> None:
        """Put `plan` on the started model, a plan of its shape (its own, after the warm-up; a
        restart's next one, whose `restart_refusal` is None): the plan's initial weights (and
        their bf16 copies), every epoch's sample order, the recipe's constants on the device,
        the optimizer's state and step count from zero, the metrics zeroed and the cursor at the
        first sample. What the step's buffers hold besides (activations, gradients, the batch)
        every step writes before it reads. A recorded step is the caller's: it holds
        `step_constants` of the config it was recorded with."""
        self.plan, self.config = plan, plan.config
        cfg = self.config
        self.dataset.upload_orders(plan, stream)
        self.params.upload(plan.initial, stream)
        if self.optimizer is not None:
            self.optimizer.set_recipe(Optimizer.of(cfg), Schedule.of(cfg, sum(plan.batches)))
            self.optimizer.reset(stream)  # step 0, zero state, the gradients' span zero
        if self.copies is not None:
            if cfg.bias:
                for buf in self.db:
                    buf.zero(stream)
            self.refresh_copies(stream, lr=0.0)  # the copies of the initial weights; db is zero, so b stays
        self.metrics.zero(stream)
        self.set_cursor(stream, 0)

    def restart_refusal(self, plan: RunPlan) -> str | None:
        """Why this model cannot take `plan`, a plan of its shape, in place (`start_run`), or None:
        its buffers were laid out for SGD fused into the step or for the recipe's optimizer (a
        step of the one has no room for the other), and the optimizer's state for so many slots."""
        if fused_sgd(plan.config) != (self.optimizer is None):
            built = "SGD fused into the step" if self.optimizer is None else "an optimizer's update"
            return (f"the step was built for {built}, and {plan.config.optimizer} at a {plan.config.schedule} rate "
                    "trains the other")
        return None if self.optimizer is None else self.optimizer.refusal(Optimizer.of(plan.config))

    @staticmethod
    def step_constants(config: TrainConfig) -> tuple:
        """What a step recorded for `config` holds of its recipe, captured by value: the rate of
        fused SGD (head_update's and sgd_bias_refresh's lr, the SGD products' α = −lr); nothing
        with an optimizer, which reads its constants and rate from the device. A captured step
        trains another config's recipe only where these are equal."""
        return (config.lr,) if fused_sgd(config) else ()

    def plan_products(self, rows: int) -> dict[str, list[LtMatmul | None]]:
        """The hidden layers' products for a batch of `rows`: forward (with its bias and ReLU), dX
        (none for the first layer) and SGD (W −= lr·dYᵀX, or dW = dYᵀX for another recipe). The
        head has its own kernels."""
        dims, plans = self.config.dims, {"forward": [], "dx": [], "sgd": []}
        operands = OPERAND_TYPES[self.precision]
        for i in range(len(self.w) - 1):
            fan_in, fan_out = dims[i], dims[i + 1]
            bias = self.b[i] is not None
            plans["forward"].append(LtMatmul(self.lt, Product(
                rows, fan_out, fan_in, transb=True, ab_type=operands, c_type=operands,
                epilogue="relu_bias" if bias else "relu", bias_type=operands), self.product_bias(i) if bias else 0))
            plans["dx"].append(LtMatmul(self.lt, Product(rows, fan_in, fan_out, ab_type=operands, c_type=operands))
                               if i > 0 else None)
            plans["sgd"].append(LtMatmul(self.lt, Product(fan_out, fan_in, rows, transa=True, ab_type=operands,
                                                        c_type=R_32F)))
        return plans

    # ---- what the hidden layers' products read: the fp32 buffers, or their bf16 copies ----------

    def layer_input(self, i: int) -> int:
        """The input of layer i: the batch x, or hidden activations."""
        if self.copies is None:
            return self.acts[i].ptr
        return self.copies.x.ptr if i == 0 else self.copies.h[i - 1].ptr

    def layer_grad(self, i: int) -> int:
        """dL/d(input of layer i), i ≥ 1."""
        return self.grads[i].ptr if self.copies is None else self.copies.dh[i - 1].ptr

    def product_weight(self, i: int) -> int:
        return self.w[i].ptr if self.copies is None else self.copies.weight(i)

    def product_bias(self, i: int) -> int:
        return self.b[i].ptr if self.copies is None else self.copies.bias(i)

    # ---- the step ------------------------------------------------------------------------------

    def record_step(self, stream: cuda.Stream, rows: int, measure: bool) -> None:
        """Queue one training step of `rows` rows, the batch at the cursor, on `stream`: gather →
        the hidden layers forward → the head's loss step → its update (and the cursor moved on) →
        the hidden layers backward, each updated by its SGD product → the end of the step."""
        cfg, fused, plans = self.config, self.fused_cu, self.products_for(rows)
        handle, head = int(stream.handle), len(self.w) - 1  # cuBLASLt takes the stream's raw address
        width, lr = cfg.dims[head], cfg.lr
        w_head, b_head = self.w[head].ptr, self.b[head].ptr if cfg.bias else 0
        metrics = (self.row_loss.ptr, self.row_correct.ptr) if measure else (0, 0)
        dlogits = self.grads[-1].ptr
        if head > 0:
            self.gather(stream, rows)
        for i, forward in enumerate(plans["forward"]):
            forward(self.layer_input(i), self.product_weight(i), self.layer_input(i + 1), 1.0, 0.0, handle)
        if head > 0:
            fused.head_step(stream, self.layer_input(head), w_head, b_head, width, rows, self.y.ptr, dlogits, *metrics)
            fused.head_backward(stream, dlogits, w_head, self.layer_input(head), self.layer_grad(head),
                                self.db[head - 1].ptr if cfg.bias else 0, width, rows)  # before W changes
            head_input = self.layer_input(head)
        else:  # softmax regression: the head gathers the batch itself, into x (fp32)
            data = self.dataset
            fused.head_step(stream, 0, w_head, b_head, width, rows, self.y.ptr, dlogits, *metrics,
                            gather=(data.train_images.ptr, data.train_labels.ptr, data.order.ptr, self.cursor.ptr,
                                    self.acts[0].ptr))
            head_input = self.acts[0].ptr
        # SGD: the head's W and b updated in place; another recipe: its dW and db, for the optimizer
        # (the kernel then reads no rate: 0, so that the recorded step holds nothing of the recipe).
        head_out, head_lr = ((w_head, b_head), lr) if self.optimizer is None else (
            (self.dw[head].ptr, self.db[head].ptr if cfg.bias else 0), 0.0)
        fused.head_update(stream, head_input, dlogits, *head_out, width, rows, head_lr, *metrics, self.metrics.ptr,
                          self.cursor.ptr, gradient=self.optimizer is not None)
        for i in reversed(range(head)):
            if i > 0:  # dX before W_i changes, then the ReLU below and that layer's bias gradient
                plans["dx"][i](self.layer_grad(i + 1), self.product_weight(i), self.layer_grad(i), 1.0, 0.0, handle)
                fused.relu_bias_grad(stream, self.layer_input(i), self.layer_grad(i),
                                     self.db[i - 1].ptr if cfg.bias else 0, cfg.dims[i], rows)
            if self.optimizer is None:  # W −= lr·dYᵀX: SGD as the product
                plans["sgd"][i](self.layer_grad(i + 1), self.layer_input(i), self.w[i].ptr, -lr, 1.0, handle)
            else:  # dW = dYᵀX, for the optimizer
                plans["sgd"][i](self.layer_grad(i + 1), self.layer_input(i), self.dw[i].ptr, 1.0, 0.0, handle)
        self.end_step(stream)

    def products_for(self, rows: int) -> dict[str, list[LtMatmul | None]]:
        """The planned products of a batch of `rows`; none for softmax regression (all head)."""
        return self.products[rows] if self.lt is not None else {"forward": [], "dx": [], "sgd": []}

    def gather(self, stream: cuda.Stream, rows: int) -> None:
        """The batch at the cursor into x, and its labels into y: fp32, or straight into bf16."""
        data, features = self.dataset, self.config.in_features
        if self.copies is None:
            self.gather_cu.gather_batch_at(stream, data.train_images.ptr, data.train_labels.ptr, data.order.ptr,
                                           self.cursor.ptr, features, rows, self.acts[0].ptr, self.y.ptr)
        else:
            self.fused_cu.gather_batch_bf16(stream, data.train_images.ptr, data.train_labels.ptr, data.order.ptr,
                                            self.cursor.ptr, features, rows, self.copies.x.ptr, self.y.ptr)

    def end_step(self, stream: cuda.Stream) -> None:
        """The hidden layers' biases b −= lr·db over their packed span, in the kernel that also
        refreshes the bf16 copies where there are some; with another recipe, the optimizer's
        update of every parameter instead (then the copies refreshed with lr 0)."""
        cfg = self.config
        if self.optimizer is not None:
            self.optimizer.step(stream)
            if self.copies is not None:
                self.refresh_copies(stream, lr=0.0)  # b − 0·db = b: the biases moved with the rest
        elif self.copies is not None:
            self.refresh_copies(stream, cfg.lr)
        elif cfg.bias and len(self.b) > 1:
            self.fused_cu.sgd_bias_refresh(stream, self.b[0].ptr, self.db[0].ptr, 0, span(self.b[:-1]), cfg.lr,
                                           0, 0, 0)

    def refresh_copies(self, stream: cuda.Stream, lr: float) -> None:
        """Hidden biases −= lr·db, then the bf16 copies of the hidden layers' weights and biases,
        in one kernel."""
        bias, copies = self.config.bias, self.copies
        self.fused_cu.sgd_bias_refresh(
            stream, self.b[0].ptr if bias else 0, self.db[0].ptr if bias else 0, copies.b.ptr if bias else 0,
            span(self.b[:-1]) if bias else 0, lr, self.w[0].ptr, copies.w.ptr, span(self.w[:-1]))

    def capture_step(self, stream: cuda.Stream, rows: int, measure: bool) -> cuda.Graph:
        """One step of `rows` rows captured into a graph: it replays on the batch at the cursor."""
        with cuda.Graph.capture(stream) as graph:
            self.record_step(stream, rows, measure)
        return graph

    def set_cursor(self, stream: cuda.Stream, sample: int) -> None:
        self.gather_cu.set_cursor(stream, self.cursor.ptr, sample)

    # ---- evaluation and the rest ---------------------------------------------------------------

    def accuracy(self, stream: cuda.Stream) -> float:
        """Test accuracy of the fp32 weights: forward passes of up to `rows` test rows through
        cuBLAS, eagerly, in the fp32 activation buffers; one read at the end."""
        cfg = self.config

        def forward_rows(x_ptr: int, rows: int) -> Buffer:
            device.forward(self.blas.gemm, self.layers_cu, stream, cfg.dims, self.params, x_ptr, self.acts[1:], rows)
            return self.acts[-1]

        return device.count_correct(stream, self.metrics_cu, self.dataset, self.rows, forward_rows, cfg.classes,
                                    self.metrics.at(1))

    def weights(self, stream: cuda.Stream) -> list[Layer]:
        return self.params.download(stream)

    def library_versions(self) -> dict:
        return {"nvrtc": nvrtc.version(), "cublas": cublas.version(),
                **({"cublaslt": cublaslt.version()} if self.config.hidden else {})}

    def close(self) -> None:
        for plans in self.products.values():
            for matmul in (m for role in plans.values() for m in role if m is not None):
                matmul.close()
        for obj in (self.lt, self.fused_cu, self.optimizer, self.blas, self.gather_cu, self.layers_cu,
                    self.metrics_cu):
            if obj is not None:
                obj.close()
