"""The cnn's layers on the device, each owning its buffers, its parameters (named views into the
model's packed spans) and the launches of its forward and backward passes:

    FusedConv    conv + bias + max-pool + ReLU as fused kernels: kernels/convpool_tc.cu on the
                 tensor cores (TF32) or kernels/convpool.cu (fp32); the weight and bias gradients
                 from the pooled gradient and the argmaxes, and the input gradient
    CudnnConv    cuDNN's convolution, then kernels/cnn.cu's bias + pool + ReLU; backward: the
                 pooled gradient routed to the argmaxes, the bias gradient, backward filter and data
    Linear       a cuBLASLt product, then layers.cu's bias (+ ReLU); backward: the weight and input
                 gradients' products, and for the layer below, its ReLU mask with its bias gradient
                 (fused.cu's relu_bias_grad)
    SoftmaxHead  the logits layer (a Linear) with cnn.cu's loss step and layers.cu's bias gradient
    FusedHead    the logits layer with the loss step in one kernel and its weight and bias
                 gradients in another (head.cu), the input gradient with the ReLU mask and bias
                 gradient of the layer below in a third (fused.cu's head_backward)

A layer's ops are (name, launch) pairs, as graphtrain.stages.cnn_device lists a step's. A layer
reserves its buffers in the model's arena when it is made; its parameters get their places when
the model lays out the span (`ParameterSpan`); ops are built once the arena is allocated.

Every launch takes the model axis (`ModelAxis`, graphtrain.kernels' model axis): K models of one
arena layout, model k's copy of every buffer model_stride bytes after model k − 1's, trained by
each launch at once (the kernels' grid z; the products as strided batches of K, each shape's one
cuBLASLt algorithm, graphtrain.libs.cublaslt.LtGemms). One model is K = 1, stride 0: the launches
of a model alone, whose bits each model of K gets. The stride is the arena's size, known once
every layer has reserved its buffers (`ModelAxis.settle`), before any op is built.

Each parameter starts PARAM_ALIGN floats into the span (256 bytes), every gradient at the same
offset in the gradients' span: one optimizer launch, and one all-reduce, cover all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from graphtrain.kernels import MODEL_STRIDE_ALIGNMENT, ceil_div, model_stride_arg
from graphtrain.kernels.cnn import Cnn
from graphtrain.kernels.convpool import ConvPool
from graphtrain.kernels.convpool_tc import ConvPoolTc
from graphtrain.kernels.fused import Fused
from graphtrain.kernels.head import Head
from graphtrain.kernels.layers import Layers
from graphtrain.libs import cuda
from graphtrain.libs.cublaslt import LtGemms
from graphtrain.libs.cudnn import ConvPlan
from graphtrain.libs.memory import Arena, Buffer
from graphtrain.reference_cnn import ConvLayer

PARAM_ALIGN = 64  # floats: each parameter starts 256-byte aligned inside the packed span

Op = tuple[str, Callable[[], None]]


def packed_layout(shapes: Sequence[tuple[int, ...]]) -> tuple[list[int], int]:
    """Offsets (in floats) of each parameter inside one span, each PARAM_ALIGN-aligned; the span's size."""
    offsets, end = [], 0
    for shape in shapes:
        offsets.append(end)
        end += ceil_div(int(np.prod(shape)), PARAM_ALIGN) * PARAM_ALIGN
    return offsets, end


# ---- the model axis ----------------------------------------------------------------------------------


class ModelAxis:
    """`models` models of one arena layout, model k's buffers `stride` bytes after model k − 1's:
    what every launch of a layer takes. The stride is settled once the model's buffers are all
    reserved (the arena's size); one model's is 0."""

    def __init__(self, models: int = 1):
        model_stride_arg(models, MODEL_STRIDE_ALIGNMENT)  # a count gridDim.z holds, else ValueError
        self.models = int(models)
        self._stride: int | None = 0 if models == 1 else None

    def settle(self, stride: int) -> None:
        """Model k's buffers lie k·stride bytes after model 0's (ValueError for a stride the kernels
        cannot take: see graphtrain.kernels.model_stride_arg)."""
        if self._stride is not None and self.models > 1:
            raise RuntimeError("the model axis's stride is settled once")
        self._stride = model_stride_arg(self.models, stride)

    @property
    def stride(self) -> int:
        """Bytes from one model's buffers to the next's (0: one model)."""
        if self._stride is None:
            raise RuntimeError("the model axis's stride is not settled yet: every buffer must be reserved first")
        return self._stride

    @property
    def launch(self) -> dict[str, int]:
        """A launcher's model-axis arguments."""
        return {"models": self.models, "model_stride": self.stride}

    @property
    def elements(self) -> int:
        """The stride in fp32 elements: a strided batched product's stride between models' matrices."""
        return self.stride // 4

    def at(self, ptr: int, model: int) -> int:
        """Model `model`'s copy of the buffer at `ptr` (model 0's)."""
        if not 0 <= model < self.models:
            raise IndexError(f"model {model} of {self.models}")
        return ptr + model * self.stride


# ---- parameters --------------------------------------------------------------------------------


class Parameter:
    """One parameter in PyTorch's shape (a filter KCHW): its value's and its gradient's addresses
    once the model's spans are laid out and allocated. `khwc`: the device keeps the filter KHWC
    (cuDNN's NHWC convolutions read it so)."""

    def __init__(self, name: str, shape: tuple[int, ...], khwc: bool = False):
        self.name, self.shape, self.khwc = name, tuple(shape), khwc
        self.size = int(np.prod(shape))
        self.span: ParameterSpan | None = None
        self.offset = -1

    @property
    def ptr(self) -> int:
        return self.span.params.at(self.offset)

    @property
    def grad(self) -> int:
        return self.span.grads.at(self.offset)

    def to_device(self, value: np.ndarray) -> np.ndarray:
        """`value` (this parameter's shape) in the device's order, flat."""
        if value.shape != self.shape:
            raise ValueError(f"{self.name}: an array of shape {value.shape} where the model has {self.shape}")
        return (value.transpose(0, 2, 3, 1) if self.khwc else value).ravel()

    def from_device(self, flat: np.ndarray) -> np.ndarray:
        """The device's flat copy as an array of this parameter's shape."""
        if self.khwc:
            k, c, h, w = self.shape
            return flat.reshape(k, h, w, c).transpose(0, 3, 1, 2).copy()
        return flat.reshape(self.shape).copy()


class ParameterSpan:
    """Every parameter in one fp32 buffer (`params`), in the model's order, and the gradients in
    another laid out alike (`grads`); the padding between them is zero in both."""

    def __init__(self, arena: Arena, parameters: Sequence[Parameter]):
        self.parameters = list(parameters)
        offsets, size = packed_layout([p.shape for p in self.parameters])
        for p, offset in zip(self.parameters, offsets):
            p.span, p.offset = self, offset
        self.params = arena.reserve("params", (size,))
        self.grads = arena.reserve("grads", (size,))

    def pack(self, values: Sequence[np.ndarray]) -> np.ndarray:
        """The parameters' values (PyTorch's shapes, in order) as the span's contents."""
        if len(values) != len(self.parameters):
            raise ValueError(f"{len(values)} arrays for the model's {len(self.parameters)} parameters")
        span = np.zeros(self.params.shape, np.float32)
        for p, value in zip(self.parameters, values):
            span[p.offset:p.offset + p.size] = p.to_device(value)
        return span

    def unpack(self, span: np.ndarray) -> list[np.ndarray]:
        """The span's contents as the parameters' values (PyTorch's shapes, float32)."""
        return [p.from_device(span[p.offset:p.offset + p.size]) for p in self.parameters]


# ---- what the training step's head reads of the batch ----------------------------------------


@dataclass(frozen=True)
class Batch:
    """The training batch as the loss step sees it: this model's `rows` rows gathered into x (None
    where the first layer reads them through their sample indices) and y, the device cursor the step
    moves on, the Σ loss it adds to (`loss_sums[loss_slot]`), the combined batch and the ranks it is
    split over (1: one GPU), and the samples of an epoch."""

    x: Buffer | None
    y: Buffer
    cursor: Buffer
    loss_sums: Buffer
    rows: int
    combined: int
    ranks: int
    epoch_samples: int
    loss_slot: int = 0

    @property
    def loss_sum(self) -> int:
        return self.loss_sums.at(self.loss_slot)


# ---- convolutions -------------------------------------------------------------------------------


class ConvShape:
    """Conv layer i's sizes: input c×h×w, `outs` channels out of a conv of hc×wc, pooled hp×wp."""

    def __init__(self, index: int, shape: tuple[int, int, int, int, int, int], layer: ConvLayer):
        self.index, self.layer = index, layer
        self.c, self.h, self.w, self.outs, self.hc, self.wc = shape
        self.pool = layer.pool
        self.hp, self.wp = self.hc // layer.pool, self.wc // layer.pool
        self.first = index == 0

    def parameters(self, khwc: bool = False) -> tuple[Parameter, Parameter]:
        k = self.layer.kernel
        return (Parameter(f"conv{self.index}.weight", (self.outs, self.c, k, k), khwc),
                Parameter(f"conv{self.index}.bias", (self.outs,)))


class FusedConv:
    """A conv layer as fused kernels (`kernels`: a ConvPool or ConvPoolTc built for its shape),
    NCHW; the conv output stays in registers (no buffer for it or its gradient)."""

    def __init__(self, arena: Arena, shape: ConvShape, kernels: ConvPool | ConvPoolTc, batch: int, rows: int,
                 axis: ModelAxis):
        self.shape, self.kernels, self.batch, self.axis = shape, kernels, batch, axis
        s, i = shape, shape.index
        self.w, self.b = shape.parameters()
        self.a = arena.reserve(f"a{i}", (rows, s.outs, s.hp, s.wp))
        self.arg = arena.reserve(f"arg{i}", (rows, s.outs, s.hp, s.wp), np.uint8)
        self.da = arena.reserve(f"da{i}", (batch, s.outs, s.hp, s.wp))
        self.row_buffers = (self.a, self.arg)  # sized for the training batch or an evaluation pass
        # The weight gradient's per-chunk partial sums (taps and the bias).
        self.partial = arena.reserve(f"partial{i}", (s.outs, kernels.chunks(batch), kernels.taps + 1))

    def forward_ops(self, stream: cuda.Stream, src: int, rows: int, training: bool,
                    shared_input: bool = False, samples: int = 0) -> list[Op]:
        """`shared_input`: src is one buffer every model reads (the test images); `samples`: the
        batch's sample indices into src, which every model shares (the training set; kernels that
        read through them only: `reads_samples`)."""
        s = self.shape
        through = {"samples": samples} if samples else {}
        return [(f"conv{s.index}+bias+pool+relu", partial(self.kernels.forward, stream, src, self.w.ptr, self.b.ptr,
                                                           self.a.ptr, self.arg.ptr, rows, s.outs, s.h, s.w,
                                                           shared_input=shared_input, **through, **self.axis.launch))]

    def backward_ops(self, stream: cuda.Stream, src: int, dsrc: int | None, samples: int = 0) -> list[Op]:
        """From da: the weight and bias gradients (src: the layer's input, read through `samples`
        as the forward's), and the input's gradient into dsrc (not for the first layer: None)."""
        s, b = self.shape, self.batch
        through = {"samples": samples} if samples else {}
        ops = [(f"conv{s.index} weight+bias grad", partial(
            self.kernels.weight_grad, stream, src, self.da.ptr, self.arg.ptr, self.partial.ptr, self.w.grad,
            self.b.grad, b, s.outs, s.h, s.w, **through, **self.axis.launch))]
        if dsrc is not None:
            ops.append((f"conv{s.index} input grad", partial(
                self.kernels.backward_data, stream, self.da.ptr, self.arg.ptr, self.w.ptr, dsrc, b, s.outs, s.h, s.w,
                **self.axis.launch)))
        return ops


class CudnnConv:
    """A conv layer through cuDNN: its plans for the training batch and for an evaluation pass
    (`train_plan`, `eval_plan`: made now, their algorithms chosen by `choose` once the arena is
    allocated), then cnn.cu's pool kernels. `conv_nhwc`: the conv output (and the filter, KHWC)
    NHWC; `act_nhwc`: the pooled output too (every layer's but the last, which the head reads
    flattened C·H·W)."""

    def __init__(self, arena: Arena, shape: ConvShape, cnn_cu: Cnn, dnn, precision: str, layout: str,
                 act_nhwc: bool, batch: int, eval_rows: int, rows: int):
        self.shape, self.cnn_cu, self.batch = shape, cnn_cu, batch
        self.conv_nhwc, self.act_nhwc = layout == "nhwc", act_nhwc
        s, i, layer = shape, shape.index, shape.layer
        self.w, self.b = shape.parameters(khwc=self.conv_nhwc)
        self.c = arena.reserve(f"c{i}", (rows, s.outs, s.hc, s.wc))
        self.a = arena.reserve(f"a{i}", (rows, s.outs, s.hp, s.wp))
        self.arg = arena.reserve(f"arg{i}", (rows, s.outs, s.hp, s.wp), np.uint8)
        self.dc = arena.reserve(f"dc{i}", (batch, s.outs, s.hc, s.wc))
        self.da = arena.reserve(f"da{i}", (batch, s.outs, s.hp, s.wp))
        self.row_buffers = (self.c, self.a, self.arg)  # sized for the training batch or an evaluation pass
        passes = ("forward", "backward_filter") + (() if s.first else ("backward_data",))
        geometry = (s.c, s.h, s.w, s.outs, layer.kernel, layer.stride, layer.padding, precision)
        self.train_plan = ConvPlan(dnn, batch, *geometry, passes, layout)
        self.eval_plan = ConvPlan(dnn, eval_rows, *geometry, ("forward",), layout)

    @property
    def workspace_bytes(self) -> int:
        return max(self.train_plan.workspace_bytes, self.eval_plan.workspace_bytes)

    def choose(self, train_src: int, eval_src: int, workspace: Buffer) -> None:
        """Each plan's algorithms, timed on the real buffers (their contents overwritten)."""
        for plan, src in ((self.train_plan, train_src), (self.eval_plan, eval_src)):
            plan.choose(src, self.w.ptr, self.c.ptr, workspace.ptr, workspace.nbytes)

    def forward_ops(self, stream: cuda.Stream, src: int, rows: int, training: bool,
                    shared_input: bool = False) -> list[Op]:
        """One model's (cuDNN's calls have no model axis: `shared_input` changes nothing)."""
        s, plan = self.shape, self.train_plan if training else self.eval_plan
        return [(f"conv{s.index} forward", partial(plan.forward, src, self.w.ptr, self.c.ptr)),
                (f"conv{s.index} bias+pool+relu", partial(
                    self.cnn_cu.pool_bias_relu, stream, self.c.ptr, self.b.ptr, self.a.ptr, self.arg.ptr, rows,
                    s.outs, s.hc, s.wc, s.pool, self.conv_nhwc, self.act_nhwc))]

    def backward_ops(self, stream: cuda.Stream, src: int, dsrc: int | None) -> list[Op]:
        s, b, plan = self.shape, self.batch, self.train_plan
        ops = [(f"conv{s.index} pool+relu backward", partial(
                   self.cnn_cu.pool_relu_backward, stream, self.da.ptr, self.arg.ptr, self.dc.ptr, b, s.outs, s.hc,
                   s.wc, s.pool, self.conv_nhwc, self.act_nhwc)),
               (f"conv{s.index} bias grad", partial(
                   self.cnn_cu.channel_bias_grad, stream, self.da.ptr, self.arg.ptr, self.b.grad, b, s.outs,
                   s.hp * s.wp, self.act_nhwc)),
               (f"conv{s.index} backward filter", partial(plan.backward_filter, src, self.dc.ptr, self.w.grad))]
        if dsrc is not None:
            ops.append((f"conv{s.index} backward data", partial(plan.backward_data, self.w.ptr, self.dc.ptr, dsrc)))
        return ops


# ---- the linear layers ------------------------------------------------------------------------------


class Linear:
    """Layer j of the head: h = src·Wᵀ + b (ReLU'd unless it is the logits layer), W fan_out ×
    fan_in; dh its output's gradient for the training batch. Its products are cuBLASLt's
    (`gemms`), the model axis's models one after another in a strided batch, each planned when
    its op is built (the model builds its ops once at setup, outside any capture) and queued per
    step with nothing chosen."""

    def __init__(self, arena: Arena, index: int, fan_in: int, fan_out: int, relu: bool, gemms: LtGemms,
                 layers_cu: Layers, fused_cu: Fused, batch: int, rows: int, axis: ModelAxis):
        self.index, self.fan_in, self.fan_out, self.relu, self.batch = index, fan_in, fan_out, relu, batch
        self.gemms, self.layers_cu, self.fused_cu, self.axis = gemms, layers_cu, fused_cu, axis
        self.w = Parameter(f"linear{index}.weight", (fan_out, fan_in))
        self.b = Parameter(f"linear{index}.bias", (fan_out,))
        self.h = arena.reserve(f"h{index + 1}", (rows, fan_out))
        self.dh = arena.reserve(f"dh{index + 1}", (batch, fan_out))
        self.row_buffers = (self.h,)  # sized for the training batch or an evaluation pass

    def _product(self, name: str, transa: bool, transb: bool, m: int, n: int, k: int, a: int, lda: int, b: int,
                 ldb: int, c: int, ldc: int) -> Op:
        """C = op(A)·op(B) for every model (each operand its own: the stride between models),
        planned now (its algorithm chosen, its layouts made; once a shape and batch) and only
        queued by the op."""
        e, models = self.axis.elements, self.axis.models
        self.gemms.plan(transa, transb, m, n, k, lda, e, ldb, e, ldc, e, models)
        return (name, partial(self.gemms.gemm_strided_batched, transa, transb, m, n, k, 1.0, a, lda, e, b, ldb, e,
                              0.0, c, ldc, e, models))

    def forward_ops(self, stream: cuda.Stream, src: int, rows: int) -> list[Op]:
        j, k, n = self.index, self.fan_in, self.fan_out
        return [self._product(f"linear{j} product", False, True, rows, n, k, src, k, self.w.ptr, k, self.h.ptr, n),
                (f"linear{j} bias{'+relu' if self.relu else ''}", partial(
                    self.layers_cu.bias_relu, stream, self.h.ptr, self.b.ptr, rows, n, self.relu,
                    **self.axis.launch))]

    def weight_grad_op(self, src: int) -> Op:
        """dW = dhᵀ·src over the training batch."""
        k, n, b = self.fan_in, self.fan_out, self.batch
        return self._product(f"linear{self.index} weight grad", True, False, n, k, b, self.dh.ptr, n, src, k,
                             self.w.grad, k)

    def input_grad_op(self, dsrc: int) -> Op:
        """dsrc = dh·W: the gradient of the layer's input."""
        k, n, b = self.fan_in, self.fan_out, self.batch
        return self._product(f"linear{self.index} input grad", False, False, b, k, n, self.dh.ptr, n, self.w.ptr, k,
                             dsrc, k)

    def relu_bias_grad_op(self, stream: cuda.Stream) -> Op:
        """dh masked by h > 0 (the ReLU's backward, in place), and db = Σ_rows dh."""
        return (f"linear{self.index} relu+bias grad", partial(self.fused_cu.relu_bias_grad, stream, self.h.ptr,
                                                              self.dh.ptr, self.b.grad, self.fan_out, self.batch,
                                                              **self.axis.launch))

    def backward_ops(self, stream: cuda.Stream, src: int, dsrc: int, below: Linear | None) -> list[Op]:
        """The weight gradient, the input's gradient into dsrc, and through the ReLU of the layer
        below (None: the input is the last conv layer's, its ReLU the conv layer's own)."""
        ops = [self.weight_grad_op(src), self.input_grad_op(dsrc)]
        return ops + ([below.relu_bias_grad_op(stream)] if below is not None else [])


class SoftmaxHead:
    """The logits layer's training step as a cuBLASLt product and bias kernel, cnn.cu's loss step
    (dlogits of the batch's valid rows, the cursor moved on, Σ loss), the bias gradient, then the
    weight and input gradients as any Linear's."""

    note = None  # the logits layer trains as the other linear layers do

    def __init__(self, logits: Linear, cnn_cu: Cnn, layers_cu: Layers):
        self.logits, self.cnn_cu, self.layers_cu = logits, cnn_cu, layers_cu

    def train_ops(self, stream: cuda.Stream, src: int, dsrc: int, below: Linear | None, batch: Batch) -> list[Op]:
        out = self.logits
        ops = out.forward_ops(stream, src, batch.rows)
        axis = out.axis.launch
        ops.append(("loss step", partial(self.cnn_cu.softmax_xent_step, stream, out.h.ptr, batch.y.ptr, out.dh.ptr,
                                         batch.cursor.ptr, batch.combined, batch.epoch_samples, out.fan_out,
                                         batch.loss_sum, batch.ranks, **axis)))
        ops.append((f"linear{out.index} bias grad", partial(self.layers_cu.bias_grad, stream, out.dh.ptr, out.b.grad,
                                                            batch.rows, out.fan_out, **axis)))
        return ops + out.backward_ops(stream, src, dsrc, below)


class FusedHead:
    """The logits layer's training step in head.cu: its product with the loss step in one kernel
    (a warp a row), its weight and bias gradients in another; then its input gradient, with the
    ReLU mask and bias gradient of the layer below in one kernel (fused.cu's head_backward), or
    a product where the layer below is a conv layer. `row_loss` and `count` are head.cu's scratch
    (the count is zeroed once and left 0 by the kernel)."""

    def __init__(self, arena: Arena, logits: Linear, head_cu: Head, fused_cu: Fused, batch: int):
        self.logits, self.head_cu, self.fused_cu = logits, head_cu, fused_cu
        self.note = head_cu.note
        self.row_loss = arena.reserve("row_loss", (batch,), np.float64)
        self.count = arena.reserve("head_count", (1,), np.int32)

    def train_ops(self, stream: cuda.Stream, src: int, dsrc: int, below: Linear | None, batch: Batch) -> list[Op]:
        out, b, k, axis = self.logits, batch.rows, self.logits.fan_in, self.logits.axis.launch
        ops = [(f"linear{out.index}+loss step", partial(
                   self.head_cu.logits_loss, stream, src, out.w.ptr, out.b.ptr, batch.y.ptr, out.dh.ptr,
                   self.row_loss.ptr, self.count.ptr, batch.cursor.ptr, batch.combined, k, batch.epoch_samples,
                   batch.loss_sum, batch.ranks, **axis)),
               (f"linear{out.index} weight+bias grad", partial(self.head_cu.grads, stream, src, out.dh.ptr, out.w.grad,
                                                               out.b.grad, b, k, **axis))]
        if below is None:
            return ops + [out.input_grad_op(dsrc)]
        # dsrc (below.dh) = dlogits·W masked by below.h > 0, with the bias gradient of the layer below
        return ops + [(f"linear{out.index} input grad+relu+bias grad", partial(
            self.fused_cu.head_backward, stream, out.dh.ptr, out.w.ptr, below.h.ptr, dsrc, below.b.grad, k, b,
            **axis))]
