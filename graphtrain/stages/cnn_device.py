"""The convolutional model on the device: one arena, the cuDNN plans, and the training step and
the evaluation recorded onto a stream. The cnn rungs compose it: `graphs` captures the step
once and replays it per batch, `device-loop` captures the epoch (a WHILE node over the steps)
and the evaluation into one graph.

    model = CnnDevice(device, spec, recipe, train_images, train_labels, test_images, test_labels)
    model.load(params, orders)        # a run's initial weights and sample orders (uploads)
    model.reset(stream)               # cursor, step counter, optimizer state and count to zero
    model.record_step(stream)         # gather → forward → loss step → backward → optimizer
    model.record_eval(stream)         # the test set's forward passes and the correct count
    model.read_correct()              # the one read of a run

One step, every launch on the model's stream (nothing allocated or chosen in it, so it captures
as is). Branches forked to a side stream (the logits layer's gradients beside the backward pass
below them, the last conv layer's weight gradient beside its input gradient) measured slower on an
H100: a replayed step graph of 99.0 µs against 97.2 µs as one chain (scripts/probes/cnn_step_profile.py):

    gather          x, y = the batch's rows through the order, from the device cursor
    conv i          a_i = ReLU(maxpool(conv(a_{i-1}) + b_i)) with each window's argmax: one fused
                    kernel (convpool_tc.cu on the tensor cores at TF32, convpool.cu at fp32), or
                    cuDNN's forward (TF32 or fp32) and a pool kernel
    head            cuBLAS products, bias + ReLU kernels; the logits layer (fp32 FMA) with the loss
                    step in one kernel, its weight and bias gradients in another (head.cu)
    loss step       dlogits of the valid rows; the cursor moves on by them
    head backward   cuBLAS products; ReLU mask and bias gradient in one kernel, with the logits
                    layer's input gradient (fused.cu's head_backward)
    conv i back     fused: the weight and bias gradients from the pooled gradient and the argmaxes,
                    and (past the first layer) the input gradient; cuDNN: the pooled gradient
                    routed to the argmaxes, the bias gradient, backward filter and backward data
    optimizer       one kernel over every parameter, its rate from the device's step counter

Measured on an H100 (scripts/probes/cnn_step_profile.py), cuDNN's legacy convolutions for the speedrun's
layers took 17–45 µs a pass whatever the layout, algorithm or math type its search picked; the
fused kernels are the default where every layer fits them.

Every batch is `batch` rows: the epoch's tail batch is the first rows of a full one, the rows
past the epoch's end reading padding of the order and given zero gradient by the loss step, so
one captured step serves every batch of the run and the result is exactly the tail batch's.

Data-parallel (`rank` of `ranks` GPUs, graphtrain.stages.data_parallel): `recipe.batch` is the
combined batch C and this model holds C/ranks rows. The gather reads this rank's slice of the
combined batch (its valid rows split evenly over the ranks), the loss step divides each row's
gradient by the combined batch's valid rows and moves the cursor by them, and `all_reduce(stream,
ptr, count)` sums the packed gradient span over the ranks just before the optimizer: every rank
then updates with the combined batch's mean gradient, and all hold the same parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from graphtrain.kernels import ceil_div
from graphtrain.kernels import convpool, convpool_tc
from graphtrain.kernels.cnn import Cnn
from graphtrain.kernels.convpool import ConvPool
from graphtrain.kernels.convpool_tc import ConvPoolTc
from graphtrain.kernels.fused import Fused
from graphtrain.kernels.gather import Gather
from graphtrain.kernels import head as head_kernel
from graphtrain.kernels.head import Head
from graphtrain.kernels.layers import Layers
from graphtrain.kernels.loop import Loop
from graphtrain.kernels.optim import STATE_INTS, Optim
from graphtrain.libs import cublas, cuda, cudnn
from graphtrain.libs.cublas import Cublas
from graphtrain.libs.cudnn import ConvPlan, Cudnn
from graphtrain.libs.memory import Arena
from graphtrain.recipe import Recipe
from graphtrain.reference_cnn import CnnSpec

STEPS_PER_BODY = 5  # steps in a WHILE body: 235 = 47 × 5, and few nodes to capture

CUBLAS_WORKSPACE_BYTES = 32 << 20
PARAM_ALIGN = 64  # floats: each parameter starts 256-byte aligned inside the packed span
MAX_EVAL_ROWS = 10_000  # test rows per forward pass: the whole MNIST test set at once


def packed_layout(shapes) -> tuple[list[int], int]:
    """Offsets (in floats) of each parameter inside one span, each PARAM_ALIGN-aligned; the span's size."""
    offsets, end = [], 0
    for shape in shapes:
        offsets.append(end)
        end += ceil_div(int(np.prod(shape)), PARAM_ALIGN) * PARAM_ALIGN
    return offsets, end


class CnnDevice:
    """`fused`: every conv layer as fused kernels (conv + bias + pool + ReLU in one, the weight
    and bias gradients from the pooled gradient, the input gradient), where all layers fit them
    (stride 1, no padding, one sample and the filters in shared memory); NCHW. At the recipe's
    precision tf32 a layer that fits kernels/convpool_tc.cu (pool 2) runs there, on the tensor
    cores; at fp32, or where it does not fit, kernels/convpool.cu's fp32 kernels.
    Otherwise (or False) cuDNN's convolutions and kernels/cnn.cu's pooling kernels. `nhwc`: then
    cuDNN's convolutions on NHWC tensors and KHWC filters (their tensor-core kernels need no
    transposes); the activations a layer hands to a cuDNN convolution are kept NHWC, the last
    conv layer's NCHW (the head reads it flattened C·H·W, as PyTorch's Flatten)."""

    def __init__(self, device: cuda.DeviceInfo, spec: CnnSpec, recipe: Recipe, train_images: np.ndarray,
                 train_labels: np.ndarray, test_images: np.ndarray, test_labels: np.ndarray, fused: bool = True,
                 nhwc: bool = True, fused_head: bool = True, device_loop: bool = False, rank: int = 0,
                 ranks: int = 1, all_reduce: Callable[[cuda.Stream, int, int], None] | None = None):
        self.device, self.spec, self.recipe = device, spec, recipe
        if not 0 <= rank < ranks or recipe.batch % ranks:
            raise ValueError(f"rank {rank} of {ranks}: the combined batch {recipe.batch} must split evenly over them")
        if ranks > 1 and all_reduce is None:
            raise ValueError(f"{ranks} ranks sum their gradients through `all_reduce`: give one")
        self.rank, self.ranks, self.all_reduce = rank, ranks, all_reduce
        self.num_train, self.num_test = len(train_images), len(test_images)
        self.batch = b = recipe.batch // ranks  # this rank's rows of the combined batch
        self.features = spec.channels * spec.height * spec.width
        self.eval_rows = e = min(self.num_test, MAX_EVAL_ROWS)
        self.eval_chunks = ceil_div(self.num_test, e)
        rows = max(b, e)
        self.stream = cuda.Stream()  # every launch of the model, and the handles' stream
        self.conv_shapes = spec.conv_shapes()
        self.fused = fused and all(
            convpool.fits(cin, h, w, co, layer.kernel, layer.stride, layer.padding, layer.pool, first=i == 0)
            for i, ((cin, h, w, co, _, _), layer) in enumerate(zip(self.conv_shapes, spec.convs)))
        # NHWC images for cuDNN's first layer only where one channel makes NCHW the same bytes.
        self.layout = "nhwc" if nhwc and not self.fused and spec.channels == 1 else "nchw"
        nconv = len(spec.convs)
        self.conv_nhwc = self.layout == "nhwc"  # every conv output c_i, and dc_i
        self.act_nhwc = [self.conv_nhwc and i < nconv - 1 for i in range(nconv)]  # a_i, arg_i, da_i
        self.cnn_cu = Cnn(device)
        self.convpool = [self._fused_layer(device, i, layer) if self.fused else None
                         for i, layer in enumerate(spec.convs)]
        self.optim_cu, self.gather_cu = Optim(device), Gather(device)
        # A device loop's WHILE nodes (capture_steps, capture_run): only for the rungs that run one.
        self.loop_kind = ("while" if cuda.conditional_nodes() else "unrolled") if device_loop else None
        self.loop_cu = Loop(device) if self.loop_kind == "while" else None
        self.layers_cu, self.fused_cu = Layers(device), Fused(device, spec.classes, bf16=False)
        # The training step's logits layer, loss step and logits gradients in one kernel where it fits.
        self.head = Head(device, spec.classes) if fused_head and head_kernel.fits(b, spec.classes) else None
        self.dnn = Cudnn(self.stream)

        # ---- the arena: data, parameters and their gradients and state, activations ----
        arena = self.arena = Arena()
        f = self.features
        self.train_x = arena.reserve("train_images", (self.num_train, f))
        self.train_y = arena.reserve("train_labels", (self.num_train,), np.int32)
        self.test_x = arena.reserve("test_images", (self.eval_chunks * e, f))  # padded to whole chunks
        self.test_y = arena.reserve("test_labels", (self.eval_chunks * e,), np.int32)
        # Every epoch's order back to back, then a batch of padding read by the tail batch's extra rows.
        self.order = arena.reserve("order", (recipe.epochs * self.num_train + b,), np.int32)
        shapes = spec.param_shapes()
        self.offsets, span = packed_layout(shapes)
        self.shapes = shapes
        self.params = arena.reserve("params", (span,))
        self.grads = arena.reserve("grads", (span,))
        slots = recipe.optimizer.slots
        self.slot1 = arena.reserve("slot1", (span,)) if slots >= 1 else None
        self.slot2 = arena.reserve("slot2", (span,)) if slots >= 2 else None
        self.opt_state = arena.reserve("opt_state", (STATE_INTS,), np.int32)
        self.iterations_left = arena.reserve("iterations_left", (1,), np.int32) if self.loop_cu else None
        self.lr_used = arena.reserve("lr_used", (1,))
        self.cursor = arena.reserve("cursor", (1,), np.int32)
        self.correct = arena.reserve("correct", (1,), np.int32)
        self.loss_sum = arena.reserve("loss_sum", (1,), np.float64)
        self.row_loss = arena.reserve("row_loss", (b,), np.float64)  # head.cu's scratch
        self.head_count = arena.reserve("head_count", (1,), np.int32)  # head.cu's count of blocks (left 0)
        self.x = arena.reserve("x", (b, f))
        self.y = arena.reserve("y", (b,), np.int32)
        self.c, self.a, self.arg, self.dc, self.da = [], [], [], [], []
        for i, ((_, _, _, co, hc, wc), layer) in enumerate(zip(self.conv_shapes, spec.convs)):
            hp, wp = hc // layer.pool, wc // layer.pool
            # The fused layers keep the conv output in registers: no c_i, no dc_i.
            self.c.append(None if self.fused else arena.reserve(f"c{i}", (rows, co, hc, wc)))
            self.a.append(arena.reserve(f"a{i}", (rows, co, hp, wp)))
            self.arg.append(arena.reserve(f"arg{i}", (rows, co, hp, wp), np.uint8))
            self.dc.append(None if self.fused else arena.reserve(f"dc{i}", (b, co, hc, wc)))
            self.da.append(arena.reserve(f"da{i}", (b, co, hp, wp)))
        # The fused weight gradients' per-chunk partial sums (taps and the bias), per layer.
        self.partial = [arena.reserve(f"partial{i}", (co, cp.chunks(b), cp.taps + 1)) if cp else None
                        for i, ((_, _, _, co, _, _), cp) in enumerate(zip(self.conv_shapes, self.convpool))]
        dims = spec.dims
        self.h = [arena.reserve(f"h{j}", (rows, d)) for j, d in enumerate(dims[1:], 1)]  # h[-1]: logits
        self.dh = [arena.reserve(f"dh{j}", (b, d)) for j, d in enumerate(dims[1:], 1)]  # dh[-1]: dlogits

        # ---- cuDNN: one plan per conv layer for the training batch, one for the evaluation ----
        self.train_plans, self.eval_plans = [], []
        for i, ((cin, h, w, co, _, _), layer) in enumerate(zip(self.conv_shapes, spec.convs)):
            if self.fused:
                self.train_plans.append(None)
                self.eval_plans.append(None)
                continue
            passes = ("forward", "backward_filter") + (("backward_data",) if i > 0 else ())
            self.train_plans.append(ConvPlan(self.dnn, b, cin, h, w, co, layer.kernel, layer.stride, layer.padding,
                                             recipe.precision, passes, self.layout))
            self.eval_plans.append(ConvPlan(self.dnn, e, cin, h, w, co, layer.kernel, layer.stride, layer.padding,
                                            recipe.precision, ("forward",), self.layout))
        self.conv_workspace_bytes = max([p.workspace_bytes for p in self.train_plans + self.eval_plans if p] + [0])
        self.conv_workspace = arena.reserve("conv_workspace", (max(self.conv_workspace_bytes, 1),), np.uint8)
        self.blas_workspace = arena.reserve("cublas_workspace", (CUBLAS_WORKSPACE_BYTES,), np.uint8)
        arena.allocate()
        self.blas = Cublas(self.stream, self.blas_workspace.ptr, self.blas_workspace.nbytes, recipe.precision)

        # ---- the data, once ----
        s = self.stream
        self.train_x.upload(np.ascontiguousarray(train_images, np.float32), s)
        self.train_y.upload(train_labels.astype(np.int32), s)
        pad = self.test_x.shape[0] - self.num_test
        self.test_x.upload(np.concatenate([test_images.astype(np.float32), np.zeros((pad, f), np.float32)]), s)
        self.test_y.upload(np.concatenate([test_labels.astype(np.int32), np.zeros(pad, np.int32)]), s)
        self.grads.zero(s)  # the padding between packed parameters is never written: its gradient stays 0
        self.head_count.zero(s)

        # ---- algorithms, timed on the real buffers (their contents are overwritten here) ----
        for i, (tp, ep) in enumerate(zip(self.train_plans, self.eval_plans)):
            if tp is None:
                continue
            src = self.x.ptr if i == 0 else self.a[i - 1].ptr
            eval_src = self.test_x.ptr if i == 0 else self.a[i - 1].ptr
            ws, wsb = self.conv_workspace.ptr, self.conv_workspace.nbytes
            tp.choose(src, self.param(2 * i), self.c[i].ptr, ws, wsb)
            ep.choose(eval_src, self.param(2 * i), self.c[i].ptr, ws, wsb)
        self.stream.synchronize()

    def _fused_layer(self, device: cuda.DeviceInfo, i: int, layer) -> ConvPool | ConvPoolTc:
        """Layer i's fused kernels: on the tensor cores (TF32) where the recipe's precision is
        tf32 and the layer fits them, else fp32."""
        cin, h, w, co, _, _ = self.conv_shapes[i]
        if self.recipe.precision == "tf32" and convpool_tc.fits(cin, h, w, co, layer.kernel, layer.stride,
                                                                 layer.padding, layer.pool, first=i == 0):
            return ConvPoolTc(device, cin, h, w, layer.kernel, layer.pool, co)
        return ConvPool(device, cin, layer.kernel, layer.pool, co)

    # ---- per run --------------------------------------------------------------------------------

    def param(self, index: int) -> int:
        return self.params.at(self.offsets[index])

    def grad(self, index: int) -> int:
        return self.grads.at(self.offsets[index])

    def _khwc(self, index: int) -> bool:
        """Whether parameter `index` is a conv filter cuDNN reads as KHWC."""
        return index < 2 * len(self.spec.convs) and index % 2 == 0 and self.conv_nhwc and \
            self.train_plans[index // 2] is not None

    def pack(self, params: list[np.ndarray]) -> np.ndarray:
        """The parameters (PyTorch's shapes: filters KCHW) as the device's span."""
        span = np.zeros(self.params.shape, np.float32)
        for i, (offset, p, shape) in enumerate(zip(self.offsets, params, self.shapes)):
            if p.shape != shape:
                raise ValueError(f"parameter of shape {p.shape} where the model has {shape}")
            span[offset:offset + p.size] = (p.transpose(0, 2, 3, 1) if self._khwc(i) else p).ravel()
        return span

    def load(self, params: list[np.ndarray], orders: np.ndarray) -> None:
        """A run's initial parameters and its epochs' sample orders (two uploads)."""
        self.params.upload(self.pack(params), self.stream)
        order = np.zeros(self.order.shape, np.int32)
        order[:orders.size] = orders.ravel()
        self.order.upload(order, self.stream)

    def reset(self, stream: cuda.Stream) -> None:
        """Queue zeroing the cursor, the optimizer's step counter and state, the loss sum and the
        correct count: the start of a run (capturable)."""
        for buf in (self.cursor, self.opt_state, self.slot1, self.slot2, self.loss_sum, self.correct):
            if buf is not None:
                buf.zero(stream)

    def weights(self) -> list[np.ndarray]:
        """The parameters in PyTorch's shapes (filters KCHW), float32."""
        span, out = self.params.download(self.stream), []
        for i, (o, shape) in enumerate(zip(self.offsets, self.shapes)):
            flat = span[o:o + int(np.prod(shape))]
            if self._khwc(i):
                k, c, h, w = shape
                out.append(flat.reshape(k, h, w, c).transpose(0, 3, 1, 2).copy())
            else:
                out.append(flat.reshape(shape).copy())
        return out

    def read_correct(self) -> int:
        return int(self.correct.download(self.stream)[0])

    def read_loss_sum(self) -> float:
        return float(self.loss_sum.download(self.stream)[0])

    # ---- the step ---------------------------------------------------------------------------------

    def _check_stream(self, stream: cuda.Stream) -> None:
        if stream is not self.stream:
            raise ValueError("the cnn records on its own stream (cuDNN and cuBLAS are bound to it)")

    def forward_ops(self, stream, x: int, rows: int, plans,
                    logits: bool = True) -> list[tuple[str, Callable[[], None]]]:
        """Conv layers, then the head: logits of `rows` samples from x into h[-1] (`logits`
        False: up to the logits layer's input)."""
        spec, cnn, ops = self.spec, self.cnn_cu, []
        src = x
        for i, ((cin, h, w, co, hc, wc), layer) in enumerate(zip(self.conv_shapes, spec.convs)):
            if self.fused:
                ops.append((f"conv{i}+bias+pool+relu", partial(self.convpool[i].forward, stream, src,
                                                                 self.param(2 * i), self.param(2 * i + 1),
                                                                 self.a[i].ptr, self.arg[i].ptr, rows, co, h, w)))
                src = self.a[i].ptr
                continue
            ops.append((f"conv{i} forward", partial(plans[i].forward, src, self.param(2 * i), self.c[i].ptr)))
            ops.append((f"conv{i} bias+pool+relu", partial(cnn.pool_bias_relu, stream, self.c[i].ptr,
                                                             self.param(2 * i + 1), self.a[i].ptr, self.arg[i].ptr,
                                                             rows, co, hc, wc, layer.pool, self.conv_nhwc,
                                                             self.act_nhwc[i])))
            src = self.a[i].ptr
        dims, base = spec.dims, 2 * len(spec.convs)
        for j in range(len(dims) - 1 if logits else len(dims) - 2):
            fan_in, fan_out = dims[j], dims[j + 1]
            out = self.h[j].ptr
            ops.append((f"linear{j} product", partial(self.blas.gemm, False, True, rows, fan_out, fan_in, 1.0, src,
                                                      fan_in, self.param(base + 2 * j), fan_in, 0.0, out, fan_out)))
            ops.append((f"linear{j} bias{'+relu' if j < len(dims) - 2 else ''}",
                        partial(self.layers_cu.bias_relu, stream, out, self.param(base + 2 * j + 1), rows, fan_out,
                                j < len(dims) - 2)))
            src = out
        return ops

    def step_ops(self, stream: cuda.Stream) -> list[tuple[str, Callable[[], None]]]:
        """The launches of one training step, named, in order (record_step runs them; a profile
        times them one by one)."""
        spec, b, cnn, recipe = self.spec, self.batch, self.cnn_cu, self.recipe
        if self.ranks == 1:
            ops = [("gather", partial(self.gather_cu.gather_batch_at, stream, self.train_x.ptr, self.train_y.ptr,
                                      self.order.ptr, self.cursor.ptr, self.features, b, self.x.ptr, self.y.ptr))]
        else:
            ops = [("gather", partial(self.gather_cu.gather_slice_at, stream, self.train_x.ptr, self.train_y.ptr,
                                      self.order.ptr, self.cursor.ptr, self.features, recipe.batch, self.num_train,
                                      self.rank, self.ranks, self.x.ptr, self.y.ptr))]
        ops += self.forward_ops(stream, self.x.ptr, b, self.train_plans, logits=self.head is None)
        dims, base, nconv = spec.dims, 2 * len(spec.convs), len(spec.convs)
        # Head backward: layer j maps inputs (h[j-1], or the flattened last conv activation) to h[j].
        last = len(dims) - 2
        if self.head is not None:
            inp = self.h[last - 1].ptr if last > 0 else self.a[-1].ptr
            ops.append((f"linear{last}+loss step", partial(
                self.head.logits_loss, stream, inp, self.param(base + 2 * last), self.param(base + 2 * last + 1),
                self.y.ptr, self.dh[last].ptr, self.row_loss.ptr, self.head_count.ptr, self.cursor.ptr, recipe.batch,
                dims[last], self.num_train, self.loss_sum.ptr, self.ranks)))
            ops.append((f"linear{last} weight+bias grad", partial(
                self.head.grads, stream, inp, self.dh[last].ptr, self.grad(base + 2 * last),
                self.grad(base + 2 * last + 1), b, dims[last])))
        else:
            ops.append(("loss step", partial(cnn.softmax_xent_step, stream, self.h[-1].ptr, self.y.ptr,
                                             self.dh[-1].ptr, self.cursor.ptr, recipe.batch, self.num_train,
                                             spec.classes, self.loss_sum.ptr, self.ranks)))
            ops.append((f"linear{last} bias grad", partial(self.layers_cu.bias_grad, stream, self.dh[last].ptr,
                                                           self.grad(base + 2 * last + 1), b, dims[-1])))
        for j in range(last, -1, -1):
            fan_in, fan_out = dims[j], dims[j + 1]
            inp = self.h[j - 1].ptr if j > 0 else self.a[-1].ptr
            dy = self.dh[j].ptr
            if self.head is not None and j == last:
                if j > 0:  # dh[j-1] = dlogits·W masked by h[j-1] > 0, with layer j-1's bias gradient
                    ops.append((f"linear{j} input grad+relu+bias grad", partial(
                        self.fused_cu.head_backward, stream, dy, self.param(base + 2 * j), self.h[j - 1].ptr,
                        self.dh[j - 1].ptr, self.grad(base + 2 * (j - 1) + 1), fan_in, b)))
                    continue
            else:
                ops.append((f"linear{j} weight grad", partial(self.blas.gemm, True, False, fan_out, fan_in, b, 1.0,
                                                              dy, fan_out, inp, fan_in, 0.0, self.grad(base + 2 * j),
                                                              fan_in)))
            dx = self.dh[j - 1].ptr if j > 0 else self.da[-1].ptr
            ops.append((f"linear{j} input grad", partial(self.blas.gemm, False, False, b, fan_in, fan_out, 1.0, dy,
                                                         fan_out, self.param(base + 2 * j), fan_in, 0.0, dx, fan_in)))
            if j > 0:  # through the ReLU of h[j-1], with its layer's bias gradient
                ops.append((f"linear{j - 1} relu+bias grad", partial(
                    self.fused_cu.relu_bias_grad, stream, self.h[j - 1].ptr, dx, self.grad(base + 2 * (j - 1) + 1),
                    fan_in, b)))
        # Conv layers backward: da[i] is the gradient of a[i] (the pooled, ReLU'd output).
        for i in range(nconv - 1, -1, -1):
            (_, h, w, co, hc, wc), layer = self.conv_shapes[i], spec.convs[i]
            if self.fused:
                src = self.x.ptr if i == 0 else self.a[i - 1].ptr
                ops.append((f"conv{i} weight+bias grad", partial(
                    self.convpool[i].weight_grad, stream, src, self.da[i].ptr, self.arg[i].ptr,
                    self.partial[i].ptr, self.grad(2 * i), self.grad(2 * i + 1), b, co, h, w)))
                if i > 0:
                    ops.append((f"conv{i} input grad", partial(
                        self.convpool[i].backward_data, stream, self.da[i].ptr, self.arg[i].ptr, self.param(2 * i),
                        self.da[i - 1].ptr, b, co, h, w)))
                continue
            ops.append((f"conv{i} pool+relu backward", partial(cnn.pool_relu_backward, stream, self.da[i].ptr,
                                                               self.arg[i].ptr, self.dc[i].ptr, b, co, hc, wc,
                                                               layer.pool, self.conv_nhwc, self.act_nhwc[i])))
            ops.append((f"conv{i} bias grad", partial(cnn.channel_bias_grad, stream, self.da[i].ptr, self.arg[i].ptr,
                                                      self.grad(2 * i + 1), b, co,
                                                      (hc // layer.pool) * (wc // layer.pool), self.act_nhwc[i])))
            src = self.x.ptr if i == 0 else self.a[i - 1].ptr
            ops.append((f"conv{i} backward filter", partial(self.train_plans[i].backward_filter, src,
                                                            self.dc[i].ptr, self.grad(2 * i))))
            if i > 0:
                ops.append((f"conv{i} backward data", partial(self.train_plans[i].backward_data, self.param(2 * i),
                                                              self.dc[i].ptr, self.da[i - 1].ptr)))
        if self.all_reduce is not None:  # Σ over the ranks of the whole span (its padding stays 0)
            ops.append(("all-reduce", partial(self.all_reduce, stream, self.grads.ptr, self.grads.size)))
        ops.append(("optimizer", partial(self.optim_cu.step, stream, self.params.ptr, self.grads.ptr,
                                         self.slot1.ptr if self.slot1 else 0, self.slot2.ptr if self.slot2 else 0,
                                         self.params.size, self.opt_state.ptr, self.lr_used.ptr, recipe.optimizer,
                                         recipe.schedule)))
        return ops

    def record_step(self, stream: cuda.Stream) -> None:
        """One training step on the batch at the cursor."""
        self._check_stream(stream)
        for _, op in self.step_ops(stream):
            op()

    def record_eval(self, stream: cuda.Stream) -> None:
        """correct += the test samples classified right; forward passes of eval_rows rows."""
        self._check_stream(stream)
        self.correct.zero(stream)
        e = self.eval_rows
        for chunk in range(self.eval_chunks):
            for _, op in self.forward_ops(stream, self.test_x.at(chunk * e, 0), e, self.eval_plans):
                op()
            rows = min(e, self.num_test - chunk * e)
            self.cnn_cu.count_correct(stream, self.h[-1].ptr, self.test_y.at(chunk * e), rows, self.spec.classes,
                                      self.correct.ptr)

    # ---- whole runs as graphs -------------------------------------------------------------------

    def _record_steps(self, outer: cuda.Stream, steps: int, per_body: int) -> None:
        """Inside a capture of `outer`: `steps` training steps, a WHILE node whose body is
        `per_body` steps run ⌊steps / per_body⌋ times (kernels/loop.cu counts them), then the
        rest unrolled on the model's stream, joined into the capture. Without conditional nodes
        every step is unrolled (`loop_kind` says so). Ends with the model's stream joined back
        into `outer`."""
        if self.loop_kind is None:
            raise RuntimeError("a device loop needs the model built with device_loop=True")
        iterations = steps // per_body if self.loop_cu else 0
        if iterations:
            def body(stream: cuda.Stream) -> None:
                for _ in range(per_body):
                    self.record_step(stream)

            self.loop_cu.record_while(outer, self.stream, self.iterations_left.ptr, iterations, body)
        cuda.stream_wait(self.stream, outer)  # joins the model's stream into the capture
        for _ in range(steps - iterations * per_body):
            self.record_step(self.stream)

    def capture_steps(self, steps: int, outer: cuda.Stream, per_body: int = STEPS_PER_BODY) -> cuda.Graph:
        """One graph of `steps` training steps from wherever the cursor and step counter stand
        (see _record_steps), captured from `outer` and launched there."""
        with cuda.Graph.capture(outer) as graph:
            self._record_steps(outer, steps, per_body)
            cuda.stream_wait(outer, self.stream)
        return graph

    def capture_run(self, steps: int, outer: cuda.Stream, per_body: int = STEPS_PER_BODY) -> cuda.Graph:
        """One graph for a whole run: reset, the steps (a WHILE node over bodies of `per_body`),
        then the evaluation. Captured from `outer`; the model's launches stay on its own stream
        (the one cuDNN and cuBLAS are bound to), joined into the capture."""
        with cuda.Graph.capture(outer) as graph:
            self.reset(outer)
            self._record_steps(outer, steps, per_body)
            self.record_eval(self.stream)
            cuda.stream_wait(outer, self.stream)  # and back: the capture ends on `outer`
        return graph

    def precision_note(self) -> str:
        """What ran in which precision, from the code path taken."""
        products = "TF32" if self.recipe.precision == "tf32" else "fp32"
        if self.fused:
            notes = [cp.note for cp in self.convpool]
            convs = (f"convolutions {notes[0]}" if len(set(notes)) == 1 else
                     ", ".join(f"conv{i} {note}" for i, note in enumerate(notes)))
        else:
            convs = f"convolutions {products} (cuDNN, {self.layout.upper()})"
        if self.head is None:
            return f"{convs}, linear layers {products} (cuBLAS), fp32 elsewhere"
        return (f"{convs}, linear layers {products} (cuBLAS) but the logits layer's training step {self.head.note}, "
                f"fp32 elsewhere")

    def environment(self) -> dict:
        algos = {f"conv{i}_{name}": algo for i, plan in enumerate(self.train_plans) if plan
                 for name, algo in plan.algo.items()}
        if self.fused:
            algos = {f"conv{i}": f"kernels/{cp.stem}.cu ({cp.note})" for i, cp in enumerate(self.convpool)}
        loop = {"device_loop": self.loop_kind} if self.loop_kind else {}  # "while", or "unrolled"
        return {"cudnn": cudnn.version(), "cublas": cublas.version(), "precision": self.precision_note(),
                "cudnn_algorithms": algos, **loop}

    def close(self) -> None:
        for name in ("blas", "dnn", "arena", "cnn_cu", "optim_cu", "gather_cu", "layers_cu", "fused_cu", "head",
                     "loop_cu"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
        for cp in getattr(self, "convpool", []):
            if cp is not None:
                cp.close()
        if getattr(self, "stream", None) is not None:
            self.stream.close()
