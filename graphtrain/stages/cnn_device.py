"""The convolutional model on the device: its layers (graphtrain.stages.cnn_layers), its arena,
and the training step and the evaluation recorded onto a stream. The cnn rungs compose it:
`graphs` captures the step once and replays it per batch, `device-loop` captures the epoch (a
WHILE node over the steps) and the evaluation into one graph; a pack (graphtrain.stages.cnn_pack)
trains many at once, as models of their own or as K models on one model axis (`models=K`: one
allocation, every launch training all K).

    model = CnnDevice(device, spec, recipe, train_images, train_labels, test_images, test_labels)
    model.load(params, orders)        # a run's initial weights and sample orders (uploads)
    model.reset(stream)               # cursor, step counter, optimizer state and count to zero
    model.record_step(stream)         # gather → forward → loss step → backward → optimizer
    model.record_eval(stream)         # the test set's forward passes and the correct count
    model.read_correct()              # the one read of a run
    model.set_recipe(recipe)          # another learning rate, schedule or optimizer: no re-capture

Set up once, trained many times. Construction does everything a run does not: the kernel files
(shared by the process's models, graphtrain.kernels.KernelFile), the dataset on the device
(shared by every model of the same arrays, graphtrain.stages.cnn_shared.resident_data), the
stream and the library handles (the lane's, shared by its models: cnn_shared.Lane), the arena,
cuDNN's plans and algorithm search. A run is `load` + `reset` + the step (or a graph of it). The
recipe's constants (the optimizer's kind, momentum, betas, eps and weight decay; the schedule's
kind, total steps, warm-up, peak rate, pct, div and final_div) live on the device
(graphtrain.stages.device.DeviceOptimizer), so `set_recipe` puts another recipe on a model whose
graphs are captured and their next launch trains it. What a capture holds cannot change: the
batch, the epochs (the sample orders' room), the precision (the kernels and the products' math),
so `set_recipe` refuses a recipe that differs in them (`recipe_refusal` says why); every model
has room for the most demanding optimizer's state (two arrays the size of its parameters, which
the cnn's are small), so any optimizer fits.

One step, every launch on the model's stream (nothing allocated or chosen in it, so it captures
as is). Branches forked to a side stream (the logits layer's gradients beside the backward pass
below them, the last conv layer's weight gradient beside its input gradient) measured slower on an
H100 (scripts/probes/cnn_step_profile.py):

    gather          x, y = the batch's rows through the order, from the device cursor; where the
                    first layer reads its batch where it lies (convpool_tc's `samples`, one GPU),
                    only the rows' sample indices and labels
    conv i          a_i = ReLU(maxpool(conv(a_{i-1}) + b_i)) with each window's argmax: one fused
                    kernel (convpool_tc.cu on the tensor cores at TF32, convpool.cu at fp32), or
                    cuDNN's forward (TF32 or fp32) and a pool kernel
    head            cuBLASLt products, bias + ReLU kernels; the logits layer (fp32 FMA) with the loss
                    step in one kernel, its weight and bias gradients in another (head.cu)
    loss step       dlogits of the valid rows; the cursor moves on by them
    head backward   cuBLASLt products; ReLU mask and bias gradient in one kernel, with the logits
                    layer's input gradient (fused.cu's head_backward)
    conv i back     fused: the weight and bias gradients from the pooled gradient and the argmaxes,
                    and (past the first layer) the input gradient; cuDNN: the pooled gradient
                    routed to the argmaxes, the bias gradient, backward filter and backward data
    optimizer       one kernel over every parameter, its rate from the device's step counter and
                    its constants from the device

cuDNN's legacy convolutions for the speedrun's layers measured slower than the fused kernels on
an H100 whatever the layout, algorithm or math type its search picked
(scripts/probes/cnn_step_profile.py): the fused kernels are the default where every layer fits them.

Every batch is `batch` rows: the epoch's tail batch is the first rows of a full one, the rows
past the epoch's end reading padding of the order and given zero gradient by the loss step, so
one captured step serves every batch of the run and the result is exactly the tail batch's.

The evaluation runs the test set in equal passes of at most `eval_rows` rows (MAX_EVAL_ROWS, the
whole MNIST test set at once, unless a smaller one is asked for: a pack of many models), the last
pass reading the resident test set's zero padding past its end, counted out.

Data-parallel (`rank` of `ranks` GPUs, graphtrain.stages.data_parallel): `recipe.batch` is the
combined batch C and this model holds C/ranks rows. The gather reads this rank's slice of the
combined batch (its valid rows split evenly over the ranks), the loss step divides each row's
gradient by the combined batch's valid rows and moves the cursor by them, and `all_reduce(stream,
ptr, count)` sums the packed gradient span over the ranks just before the optimizer: every rank
then updates with the combined batch's mean gradient, and all hold the same parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

import numpy as np

from graphtrain.errors import ModelUnsupported
from graphtrain.kernels import ceil_div, convpool, convpool_tc
from graphtrain.kernels import head as head_kernel
from graphtrain.kernels.cnn import Cnn
from graphtrain.kernels.convpool import ConvPool
from graphtrain.kernels.convpool_tc import ConvPoolTc
from graphtrain.kernels.fused import Fused
from graphtrain.kernels.gather import Gather
from graphtrain.kernels.head import Head
from graphtrain.kernels.layers import Layers
from graphtrain.kernels.loop import Loop
from graphtrain.kernels.optim import MAX_SLOTS, constants_of
from graphtrain.libs import cublas, cublaslt, cuda, cudnn
from graphtrain.libs.memory import Arena, Buffer
from graphtrain.recipe import Recipe
from graphtrain.reference_cnn import CnnSpec
from graphtrain.stages.cnn_layers import (Batch, ConvShape, CudnnConv, FusedConv, FusedHead, Linear, ModelAxis, Op,
                                          ParameterSpan, SoftmaxHead)
from graphtrain.stages.cnn_shared import MAX_EVAL_PASSES, Lane, lane_of, resident_data
from graphtrain.stages.device import DeviceOptimizer

STEPS_PER_BODY = 5  # steps in a WHILE body: 235 = 47 × 5, and few nodes to capture
MAX_EVAL_ROWS = 10_000  # test rows per forward pass: the whole MNIST test set at once

# What a captured graph holds of the recipe: another value needs another model.
CAPTURED = ("batch", "epochs", "precision")


def eval_passes(num_test: int, max_rows: int) -> tuple[int, int]:
    """(rows, passes): the test set's forward passes of at most `max_rows` rows, all of the same
    size, the last reading rows − (num_test − (passes − 1)·rows) padding rows past its end."""
    passes = max(1, ceil_div(num_test, max_rows))
    if passes > MAX_EVAL_PASSES:
        raise ValueError(f"{num_test} test rows in passes of at most {max_rows} is {passes} passes; "
                         f"at most {MAX_EVAL_PASSES} fit the resident test set's padding")
    return max(1, ceil_div(num_test, passes)), passes


def capture_refusal(built: Recipe, recipe: Recipe) -> str | None:
    """Why a model built for `built` (and its graphs captured) cannot train `recipe` by
    `set_recipe`: what a capture holds differs (CAPTURED), or None."""
    differ = [f"{name} {getattr(recipe, name)} (the model's is {getattr(built, name)})"
              for name in CAPTURED if getattr(recipe, name) != getattr(built, name)]
    return f"what the model's captures hold differs: {', '.join(differ)}" if differ else None


class CnnDevice:
    """`fused`: every conv layer as fused kernels (conv + bias + pool + ReLU in one, the weight
    and bias gradients from the pooled gradient, the input gradient), where all layers fit them
    (stride 1, no padding, one sample and the filters in shared memory); NCHW. At the recipe's
    precision tf32 a layer that fits kernels/convpool_tc.cu (pool 2) runs there, on the tensor
    cores; at fp32, or where it does not fit, kernels/convpool.cu's fp32 kernels.
    Otherwise (or False) cuDNN's convolutions and kernels/cnn.cu's pooling kernels. `nhwc`: then
    cuDNN's convolutions on NHWC tensors and KHWC filters (their tensor-core kernels need no
    transposes); the activations a layer hands to a cuDNN convolution are kept NHWC, the last
    conv layer's NCHW (the head reads it flattened C·H·W, as PyTorch's Flatten).
    `fused_head`: the logits layer's training step in head.cu where it fits. `lane`: the stream
    and handles the model runs on (default: the process's lane 0 on the device). `eval_rows`: the
    most test rows a forward pass of the evaluation takes. `normalisation` (mean, std): the images
    are given as loaded and normalised on the device (graphtrain.stages.cnn_shared.ResidentData);
    None: they are given normalised.

    `models` (K): that many models of this shape in one allocation, each launch training them all
    (the model axis, graphtrain.stages.cnn_layers.ModelAxis): model k's arena is model 0's layout
    `model_stride` bytes further on, and what a run loads or reads is per model (`model=k`); every
    model starts with the recipe built for, `set_recipe(recipe, model=k)` puts its own. Only on
    the fused conv kernels (cuDNN's calls have no model axis) and one GPU."""

    def __init__(self, device: cuda.DeviceInfo, spec: CnnSpec, recipe: Recipe, train_images: np.ndarray,
                 train_labels: np.ndarray, test_images: np.ndarray, test_labels: np.ndarray, fused: bool = True,
                 nhwc: bool = True, fused_head: bool = True, device_loop: bool = False, rank: int = 0,
                 ranks: int = 1, all_reduce: Callable[[cuda.Stream, int, int], None] | None = None,
                 lane: Lane | None = None, eval_rows: int = MAX_EVAL_ROWS, models: int = 1,
                 normalisation: tuple[float, float] | None = None):
        self.device, self.spec, self.recipe = device, spec, recipe
        self.axis = ModelAxis(models)
        self.models = models
        self.recipes = [recipe] * models  # what each model trains
        if not 0 <= rank < ranks or recipe.batch % ranks:
            raise ValueError(f"rank {rank} of {ranks}: the combined batch {recipe.batch} must split evenly over them")
        if ranks > 1 and all_reduce is None:
            raise ValueError(f"{ranks} ranks sum their gradients through `all_reduce`: give one")
        self.rank, self.ranks, self.all_reduce = rank, ranks, all_reduce
        self.num_train, self.num_test = len(train_images), len(test_images)
        self.batch = b = recipe.batch // ranks  # this rank's rows of the combined batch
        self.features = spec.channels * spec.height * spec.width
        self.eval_rows, self.eval_chunks = eval_passes(self.num_test, eval_rows)
        shapes = [ConvShape(i, shape, layer) for i, (shape, layer) in enumerate(zip(spec.conv_shapes(), spec.convs))]
        self.fused = fused and all(
            convpool.fits(s.c, s.h, s.w, s.outs, s.layer.kernel, s.layer.stride, s.layer.padding, s.pool, s.first)
            for s in shapes)
        if models > 1 and not self.fused:
            raise ModelUnsupported(f"{models} cnns on one model axis run every conv layer as the fused kernels; "
                                   f"these layers run through cuDNN, whose calls have no model axis")
        if models > 1 and ranks > 1:
            raise ValueError("a model axis trains on one GPU: no ranks")
        # NHWC images for cuDNN's first layer only where one channel makes NCHW the same bytes.
        self.layout = "nhwc" if nhwc and not self.fused and spec.channels == 1 else "nchw"
        # A device loop's WHILE nodes (capture_steps, capture_run): only for the rungs that run one.
        self.loop_kind = ("while" if cuda.conditional_nodes() else "unrolled") if device_loop else None

        self.lane = lane or lane_of(device)
        self.stream = self.lane.stream  # every launch of the model, and the handles' stream
        self.arena = arena = Arena()
        self.data = None
        try:
            # train_x, train_y, test_x, test_y: uploaded by the first model of these arrays on the
            # device, on a thread of its own from here on while this setup goes on (the kernel
            # files, the arena, the products' planning: the data's addresses are known at once);
            # waited for before anything reads it.
            self.data = resident_data(device, train_images, train_labels, test_images, test_labels,
                                      None, normalisation).acquire()
            self._kernel_files(device, spec, shapes, fused_head)
            self._reserve(arena, spec, shapes)
            self._place_models(arena)
            arena.allocate()
            self.optimizer.load(device)  # model 0's constants
            for k in range(1, models):
                self.set_recipe(recipe, model=k)
            if isinstance(self.head, FusedHead):
                self._zero(self.head.count, self.stream)
            self._plan_products()
            self.data.ready()
            self._choose_algorithms()  # cuDNN's, timed on the data
            # No wait here: what construction queued (memsets) is on the model's stream, before
            # whatever the model queues next there, and the copies waited for themselves.
        except BaseException:
            self.close()
            raise

    # ---- setup ----------------------------------------------------------------------------------

    def _kernel_files(self, device: cuda.DeviceInfo, spec: CnnSpec, shapes: list[ConvShape], fused_head: bool) -> None:
        """The files the model launches (each compiling, where it must, while setup goes on)."""
        self.cnn_cu, self.gather_cu, self.layers_cu = Cnn(device), Gather(device), Layers(device)
        self.fused_cu = Fused(device, spec.classes, bf16=False)
        self.loop_cu = Loop(device) if self.loop_kind == "while" else None
        self.convpool = [self._fused_layer(device, s) if self.fused else None for s in shapes]
        # The training step's logits layer, loss step and logits gradients in one kernel where it fits.
        self.head_cu = Head(device, spec.classes) if fused_head and head_kernel.fits(self.batch, spec.classes) else None

    def _fused_layer(self, device: cuda.DeviceInfo, s: ConvShape) -> ConvPool | ConvPoolTc:
        """A conv layer's fused kernels: on the tensor cores (TF32) where the recipe's precision is
        tf32 and the layer fits them, else fp32."""
        layer = s.layer
        if self.recipe.precision == "tf32" and convpool_tc.fits(s.c, s.h, s.w, s.outs, layer.kernel, layer.stride,
                                                                 layer.padding, s.pool, s.first):
            return ConvPoolTc(device, s.c, s.h, s.w, layer.kernel, s.pool, s.outs, models=self.models)
        return ConvPool(device, s.c, layer.kernel, s.pool, s.outs)

    def _reserve(self, arena: Arena, spec: CnnSpec, shapes: list[ConvShape]) -> None:
        """The layers and every buffer of the model, in its arena (not yet allocated)."""
        recipe, b, f = self.recipe, self.batch, self.features
        rows = max(b, self.eval_rows)  # the activations serve the training batch and an evaluation pass
        # Every epoch's order back to back, then a batch of padding read by the tail batch's extra rows.
        self.order = arena.reserve("order", (recipe.epochs * self.num_train + b,), np.int32)
        self.cursor = arena.reserve("cursor", (1,), np.int32)
        self.correct = arena.reserve("correct", (1,), np.int32)
        # Σ loss of the rows trained: slot 0, or one per epoch where a run records them apart (record_part).
        self.loss_sum = arena.reserve("loss_sum", (recipe.epochs,), np.float64)
        self.iterations_left = arena.reserve("iterations_left", (1,), np.int32) if self.loop_cu else None
        # The first conv layer reads its batch in the resident training set through the step's sample
        # indices where its kernels can (one GPU); else the gather copies the rows into x. 51 MB a step
        # less to move at 64 models (the gather took 24 µs of a 1.7 ms step on an H200).
        self.through_samples = self.ranks == 1 and self.fused and self.convpool[0].reads_samples
        self.samples = arena.reserve("samples", (b,), np.int32) if self.through_samples else None
        self.x = None if self.through_samples else arena.reserve("x", (b, f))
        self.y = arena.reserve("y", (b,), np.int32)
        self.convs = [FusedConv(arena, s, self.convpool[s.index], b, rows, self.axis) if self.fused else
                      CudnnConv(arena, s, self.cnn_cu, self.lane.dnn(), recipe.precision, self.layout,
                                self.layout == "nhwc" and s.index < len(shapes) - 1, b, self.eval_rows, rows)
                      for s in shapes]
        gemms, dims = self.lane.gemms(recipe.precision), spec.dims
        self.linears = [Linear(arena, j, fan_in, fan_out, j < len(dims) - 2, gemms, self.layers_cu, self.fused_cu, b,
                               rows, self.axis) for j, (fan_in, fan_out) in enumerate(zip(dims[:-1], dims[1:]))]
        logits = self.linears[-1]
        self.head = (FusedHead(arena, logits, self.head_cu, self.fused_cu, b) if self.head_cu is not None
                     else SoftmaxHead(logits, self.cnn_cu, self.layers_cu))
        layers = [*self.convs, *self.linears]
        self.span = ParameterSpan(arena, [p for layer in layers for p in (layer.w, layer.b)])
        self.params, self.grads = self.span.params, self.span.grads
        # Room for the most demanding optimizer's state, so that set_recipe takes any optimizer.
        self.optimizer = DeviceOptimizer.over_span(arena, self.params, self.grads, recipe.optimizer, recipe.schedule,
                                                   slots=MAX_SLOTS)
        cudnn_convs = [conv for conv in self.convs if isinstance(conv, CudnnConv)]
        self.conv_workspace = arena.reserve("conv_workspace", (max([c.workspace_bytes for c in cudnn_convs] + [1]),),
                                            np.uint8)
        self.batch_state = Batch(self.x, self.y, self.cursor, self.loss_sum, b, recipe.batch, self.ranks,
                                 self.num_train)

    def _place_models(self, arena: Arena) -> None:
        """The model axis's stride, one model's layout (every buffer reserved); models 1..K−1's
        copies after model 0's, as one reservation that nothing but their offsets names."""
        stride = arena.nbytes
        self.axis.settle(stride)
        if self.models > 1:
            others = arena.reserve("models_after_the_first", ((self.models - 1) * stride,), np.uint8)
            if others.offset != stride:
                raise RuntimeError(f"model 1's copy at byte {others.offset} of the arena, not at its stride {stride}")

    @property
    def model_bytes(self) -> int:
        """Bytes of one model's arena (the stride between models, where there are several)."""
        return self.arena.nbytes // self.models

    def _plan_products(self) -> None:
        """The step's and an evaluation pass's ops built once, not run: the linear layers' products
        they queue are planned now (cuBLASLt's algorithm search), never inside a capture."""
        self.step_ops(self.stream)
        self.forward_ops(self.stream, self.data.test_x.ptr, self.eval_rows, shared_input=True)

    def _choose_algorithms(self) -> None:
        """cuDNN's algorithms, timed on the real buffers (their contents are overwritten here)."""
        for i, conv in enumerate(self.convs):
            if isinstance(conv, CudnnConv):
                train_src = self.convs[i - 1].a.ptr if i else self.x.ptr
                eval_src = self.convs[i - 1].a.ptr if i else self.data.test_x.ptr
                conv.choose(train_src, eval_src, self.conv_workspace)

    @property
    def eval_row_bytes(self) -> int:
        """Bytes of the activations per row of an evaluation pass (they are sized for
        max(batch, eval_rows) rows): what a smaller pass saves a row."""
        return sum(buf.nbytes // buf.shape[0] for layer in (*self.convs, *self.linears) for buf in layer.row_buffers)

    @property
    def train_plans(self) -> list:
        """Each conv layer's cuDNN plan for the training batch (None: a fused layer)."""
        return [conv.train_plan if isinstance(conv, CudnnConv) else None for conv in self.convs]

    # ---- the recipe -------------------------------------------------------------------------------

    def recipe_refusal(self, recipe: Recipe) -> str | None:
        """Why this model cannot train `recipe` by `set_recipe`, or None."""
        return capture_refusal(self.recipe, recipe) or self.optimizer.refusal(recipe.optimizer)

    def set_recipe(self, recipe: Recipe, model: int = 0) -> None:
        """Model `model` trains `recipe` from the next run on, in the graphs already captured too:
        its learning rate, schedule and optimizer constants written on the device. Between runs
        (no graph of the model running). ValueError where the recipe differs in what a capture
        holds."""
        why = self.recipe_refusal(recipe)
        if why is not None:
            raise ValueError(why)
        if model == 0:
            self.optimizer.set_recipe(recipe.optimizer, recipe.schedule)
            self.recipe = recipe
        else:
            self._upload(self.optimizer.constants, constants_of(recipe.optimizer, recipe.schedule), model)
        self.recipes[model] = recipe

    # ---- per run --------------------------------------------------------------------------------

    def pack(self, params: list[np.ndarray]) -> np.ndarray:
        """The parameters (PyTorch's shapes: filters KCHW) as the device's span."""
        return self.span.pack(params)

    def _upload(self, buf: Buffer, array: np.ndarray, model: int) -> None:
        """Model `model`'s copy of `buf` := `array` (its shape and dtype; waits for the copy)."""
        if array.shape != buf.shape or array.dtype != buf.dtype:
            raise ValueError(f"{buf.name} holds {buf.shape} of {buf.dtype}, not {array.shape} of {array.dtype}")
        cuda.copy_to_device(self.axis.at(buf.ptr, model), array, self.stream)

    def _download(self, buf: Buffer, model: int) -> np.ndarray:
        """Model `model`'s copy of `buf`, after the work queued on the model's stream."""
        return cuda.copy_to_host(self.axis.at(buf.ptr, model), np.empty(buf.shape, buf.dtype), self.stream)

    def _zero(self, buf: Buffer, stream: cuda.Stream, nbytes: int | None = None) -> None:
        """Queue zeroing every model's copy of `buf` (its first `nbytes`, default all of it)."""
        for k in range(self.models):
            cuda.memset(self.axis.at(buf.ptr, k), 0, buf.nbytes if nbytes is None else nbytes, stream)

    def load(self, params: list[np.ndarray], orders: np.ndarray, model: int = 0) -> None:
        """A run's initial parameters and its epochs' sample orders (two uploads), model `model`'s."""
        self._upload(self.params, self.pack(params), model)
        order = np.zeros(self.order.shape, np.int32)
        order[:orders.size] = orders.ravel()
        self._upload(self.order, order, model)

    def reset(self, stream: cuda.Stream) -> None:
        """Queue zeroing, for every model, the cursor, the optimizer's step counter and state, the
        gradients (the padding between them is never written after: it stays 0), the loss sums
        and the correct count: the start of a run (capturable)."""
        opt = self.optimizer
        for buf in (self.cursor, opt.state, opt.slot1, opt.slot2, self.loss_sum, self.correct):
            if buf is not None:
                self._zero(buf, stream)
        self._zero(opt.grads_span, stream, opt.count * 4)

    def weights(self, model: int = 0) -> list[np.ndarray]:
        """Model `model`'s parameters in PyTorch's shapes (filters KCHW), float32."""
        return self.span.unpack(self._download(self.params, model))

    def read_correct(self, model: int = 0) -> int:
        return int(self._download(self.correct, model)[0])

    def read_loss_sum(self, model: int = 0) -> float:
        return float(self._download(self.loss_sum, model)[0])

    def read_loss_sums(self, model: int = 0) -> np.ndarray:
        """Each epoch's Σ loss, where a run recorded them apart (record_part's `epoch`)."""
        return self._download(self.loss_sum, model)

    # ---- the step ---------------------------------------------------------------------------------

    def _check_stream(self, stream: cuda.Stream) -> None:
        if stream is not self.stream:
            raise ValueError("the cnn records on its lane's stream (cuDNN and the products are bound to it)")

    def forward_ops(self, stream: cuda.Stream, x: int, rows: int, training: bool = False,
                    shared_input: bool = False, samples: int = 0) -> list[Op]:
        """Conv layers, then the linear layers: the logits of `rows` samples from x into the
        logits layer's h (`training`: the training batch's plans, up to the logits layer's input;
        `shared_input`: x is one buffer every model reads, the test images; `samples`: the rows are
        x's images at these indices, the first conv layer's to read)."""
        ops, src = [], x
        for conv in self.convs:
            first = conv is self.convs[0]
            ops += conv.forward_ops(stream, src, rows, training, shared_input and first,
                                    **({"samples": samples} if samples and first else {}))
            src = conv.a.ptr
        for linear in self.linears[:-1] if training else self.linears:
            ops += linear.forward_ops(stream, src, rows)
            src = linear.h.ptr
        return ops

    def _gather_op(self, stream: cuda.Stream) -> Op:
        data, b = self.data, self.batch
        if self.through_samples:
            return ("sample indices", partial(self.gather_cu.gather_samples_at, stream, data.train_y.ptr,
                                              self.order.ptr, self.cursor.ptr, b, self.samples.ptr, self.y.ptr,
                                              **self.axis.launch))
        if self.ranks == 1:
            return ("gather", partial(self.gather_cu.gather_batch_at, stream, data.train_x.ptr, data.train_y.ptr,
                                      self.order.ptr, self.cursor.ptr, self.features, b, self.x.ptr, self.y.ptr,
                                      **self.axis.launch))
        return ("gather", partial(self.gather_cu.gather_slice_at, stream, data.train_x.ptr, data.train_y.ptr,
                                  self.order.ptr, self.cursor.ptr, self.features, self.recipe.batch, self.num_train,
                                  self.rank, self.ranks, self.x.ptr, self.y.ptr))

    def step_ops(self, stream: cuda.Stream, epoch: int = 0) -> list[Op]:
        """The launches of one training step, named, in order (record_step runs them; a profile
        times them one by one); its loss added into loss_sum[epoch]."""
        convs, hidden = self.convs, self.linears[:-1]
        batch = replace(self.batch_state, loss_slot=epoch)
        # the batch: x, or the training set's images at the sample indices
        x, samples = (self.data.train_x.ptr, self.samples.ptr) if self.through_samples else (self.x.ptr, 0)
        ops = [self._gather_op(stream), *self.forward_ops(stream, x, self.batch, training=True, samples=samples)]

        def below_of(j: int) -> tuple[int, int, Linear | None]:
            """Linear layer j's input, its gradient's buffer, and the layer below if linear."""
            below = hidden[j - 1] if j > 0 else None
            return (below.h.ptr, below.dh.ptr, below) if below else (convs[-1].a.ptr, convs[-1].da.ptr, None)

        ops += self.head.train_ops(stream, *below_of(len(hidden)), batch)
        for j in range(len(hidden) - 1, -1, -1):
            ops += hidden[j].backward_ops(stream, *below_of(j))
        for i in range(len(convs) - 1, -1, -1):  # da of conv i: the gradient of its pooled, ReLU'd output
            below = convs[i - 1] if i > 0 else None
            if below:
                ops += convs[i].backward_ops(stream, below.a.ptr, below.da.ptr)
            else:
                ops += convs[i].backward_ops(stream, x, None, **({"samples": samples} if samples else {}))
        if self.all_reduce is not None:  # Σ over the ranks of the whole span (its padding stays 0)
            ops.append(("all-reduce", partial(self.all_reduce, stream, self.grads.ptr, self.grads.size)))
        ops.append(("optimizer", self._optimizer_op(stream)))
        return ops

    def _optimizer_op(self, stream: cuda.Stream) -> Callable[[], None]:
        """DeviceOptimizer.step's launch over every model (each its own counter and constants)."""
        opt = self.optimizer
        return partial(opt.optim_cu.step, stream, opt.params_span.ptr, opt.grads_span.ptr,
                       opt.slot1.ptr if opt.slot1 else 0, opt.slot2.ptr if opt.slot2 else 0, opt.count, opt.state.ptr,
                       opt.lr_used.ptr, opt.constants.ptr, **self.axis.launch)

    def record_step(self, stream: cuda.Stream, epoch: int = 0) -> None:
        """One training step on the batch at the cursor (its loss into loss_sum[epoch])."""
        self._check_stream(stream)
        for _, op in self.step_ops(stream, epoch):
            op()

    def record_eval(self, stream: cuda.Stream) -> None:
        """correct += the test samples classified right; forward passes of eval_rows rows."""
        self._check_stream(stream)
        self._zero(self.correct, stream)
        e, data, logits = self.eval_rows, self.data, self.linears[-1].h
        for chunk in range(self.eval_chunks):
            for _, op in self.forward_ops(stream, data.test_x.at(chunk * e, 0), e, shared_input=True):
                op()
            rows = min(e, self.num_test - chunk * e)
            self.cnn_cu.count_correct(stream, logits.ptr, data.test_y.at(chunk * e), rows, self.spec.classes,
                                      self.correct.ptr, **self.axis.launch)

    # ---- whole runs as graphs -------------------------------------------------------------------

    def _record_steps(self, outer: cuda.Stream, steps: int, per_body: int, epoch: int) -> None:
        """Inside a capture of `outer`: `steps` training steps, a WHILE node whose body is
        `per_body` steps run ⌊steps / per_body⌋ times (kernels/loop.cu counts them), then the
        rest unrolled on the model's stream, joined into the capture; their losses into
        loss_sum[epoch]. Without conditional nodes every step is unrolled (`loop_kind` says so).
        Ends on the model's stream."""
        if self.loop_kind is None:
            raise RuntimeError("a device loop needs the model built with device_loop=True")
        iterations = steps // per_body if self.loop_cu else 0
        if iterations:
            def body(stream: cuda.Stream) -> None:
                for _ in range(per_body):
                    self.record_step(stream, epoch)

            self.loop_cu.record_while(outer, self.stream, self.iterations_left.ptr, iterations, body)
        cuda.stream_wait(self.stream, outer)  # joins the model's stream into the capture
        for _ in range(steps - iterations * per_body):
            self.record_step(self.stream, epoch)

    def record_part(self, outer: cuda.Stream, steps: int, per_body: int = STEPS_PER_BODY, epoch: int = 0,
                    reset: bool = False, evaluate: bool = False) -> None:
        """Inside a capture of `outer` (or of a stream `outer` is joined into): the start of a
        run first where `reset`, then `steps` training steps from wherever the cursor and the
        step counter stand (a WHILE node over bodies of `per_body`, see _record_steps), their
        losses into loss_sum[epoch], then the evaluation where `evaluate`; ends on `outer`.
        The model's launches stay on its own stream (the one cuDNN and the products are bound to),
        joined into the capture and back."""
        if reset:
            self.reset(outer)
        self._record_steps(outer, steps, per_body, epoch)
        if evaluate:
            self.record_eval(self.stream)
        cuda.stream_wait(outer, self.stream)

    def capture_steps(self, steps: int, outer: cuda.Stream, per_body: int = STEPS_PER_BODY) -> cuda.Graph:
        """One graph of `steps` training steps (`record_part`), captured from `outer` and
        launched there."""
        with cuda.Graph.capture(outer) as graph:
            self.record_part(outer, steps, per_body)
        return graph

    def record_run(self, outer: cuda.Stream, steps: int, per_body: int = STEPS_PER_BODY) -> None:
        """Inside a capture of `outer`: a whole run, reset, the steps (a WHILE node over bodies
        of `per_body`), then the evaluation (`record_part`)."""
        self.record_part(outer, steps, per_body, reset=True, evaluate=True)

    def capture_run(self, steps: int, outer: cuda.Stream, per_body: int = STEPS_PER_BODY) -> cuda.Graph:
        """One graph for a whole run (`record_run`), captured from `outer` and launched there."""
        with cuda.Graph.capture(outer) as graph:
            self.record_run(outer, steps, per_body)
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
        if self.head.note is None:
            return f"{convs}, linear layers {products} (cuBLASLt), fp32 elsewhere"
        return (f"{convs}, linear layers {products} (cuBLASLt) but the logits layer's training step "
                f"{self.head.note}, fp32 elsewhere")

    def environment(self) -> dict:
        algos = {f"conv{i}_{name}": algo for i, plan in enumerate(self.train_plans) if plan
                 for name, algo in plan.algo.items()}
        if self.fused:
            algos = {f"conv{i}": f"kernels/{cp.stem}.cu ({cp.note})" for i, cp in enumerate(self.convpool)}
        loop = {"device_loop": self.loop_kind} if self.loop_kind else {}  # "while", or "unrolled"
        return {"cudnn": cudnn.version(), "cublas": cublas.version(), "cublaslt": cublaslt.version(),
                "precision": self.precision_note(),
                "cudnn_algorithms": algos, **loop}

    def close(self) -> None:
        """Free the model's arena and let go of what it shares (the dataset stays resident, the
        kernel files loaded and the lane open for the process's next model)."""
        for name in ("optimizer", "arena", "cnn_cu", "gather_cu", "layers_cu", "fused_cu", "head_cu", "loop_cu"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
        for cp in getattr(self, "convpool", []):
            if cp is not None:
                cp.close()
        if getattr(self, "data", None) is not None:
            data, self.data = self.data, None
            data.release()
