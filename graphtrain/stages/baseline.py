"""`baseline`: the first GPU rung. Naive NVRTC kernels for everything, metrics read every step.

This file is also the step every rung of the chain (fewer-syncs … graphs) runs, built on the device
pieces of graphtrain.stages.device (the arena with the dataset, the parameters): gather, forward,
[metrics], softmax, loss gradient, backward, SGD. Three of its choices are parts that a later rung
swaps (graphtrain.stages.chain_parts), each in the file of the rung that brings it:

    products  the matrix products               NaiveProducts here, CublasProducts (cublas)
    softmax   probabilities from logits         KernelSoftmax here, CudnnSoftmax (cudnn-softmax)
    metrics   loss and accuracy                 HostReadMetrics here, DeviceSumMetrics (fewer-syncs),
                                                SparseFusedMetrics (sparse-metrics)

A later rung derives from BaselineStage and states its one change over the rung below as data,
`parts = Below.parts.but(metrics=DeviceSumMetrics)`; its file holds that line and the part it
brings, and the diff is its lesson. `graphs` swaps no part: it adds what replaying the step needs
(its arena, the capture, the replay, the recipe's update). Each rung's parts say in `uses` what
its setup makes beyond the kernels every rung runs, so that no rung compiles, creates or reserves
what its steps never touch. The chain ends at `graphs` (graphtrain.stages.CHAIN_END): the rungs
after it are programs of their own.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from graphtrain import environment
from graphtrain.kernels.gather import Gather
from graphtrain.kernels.layers import Layers
from graphtrain.kernels.matmul import Matmul
from graphtrain.kernels.metrics import Metrics
from graphtrain.kernels.softmax import Softmax
from graphtrain.libs import cuda, nvrtc
from graphtrain.libs.memory import Arena
from graphtrain.reference import Layer
from graphtrain.stages import device
from graphtrain.stages.base import EpochResult, Stage
from graphtrain.stages.chain_parts import MetricsPart, Parts, ProductsPart, SoftmaxPart


class NaiveProducts(ProductsPart):
    """Every product through matmul.cu's naive kernel."""

    uses = frozenset({"matmul"})

    def load(self, device: cuda.DeviceInfo) -> None:
        self.matmul_cu = Matmul(device)

    def open(self, stage: BaselineStage) -> None:
        self.stream = stage.stream

    def gemm(self, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) -> None:
        self.matmul_cu.gemm(self.stream, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)

    def close(self) -> None:
        if getattr(self, "matmul_cu", None) is not None:
            self.matmul_cu.close()


class KernelSoftmax(SoftmaxPart):
    """softmax.cu's softmax_rows, one block a row, into the probabilities' buffer."""

    uses = frozenset({"softmax"})

    def open(self, stage: BaselineStage) -> None:
        self.stream, self.softmax_cu, self.classes = stage.stream, stage.softmax_cu, stage.config.classes
        self.logits, self.probs = stage.acts[-1], stage.probs

    def forward(self, rows: int) -> None:
        self.softmax_cu.softmax_rows(self.stream, self.logits.ptr, self.probs.ptr, rows, self.classes)


class HostReadMetrics(MetricsPart):
    """Each metric computed, copied back and waited for after every step, as a first version would."""

    def reset(self) -> None:
        super().reset()
        self.host_metrics = np.zeros(2)
        self.host_scalar = np.zeros(1)  # where each per-step read lands: allocated here, not per step

    def record(self, rows: int) -> None:
        logits, classes, scalar = self.logits.ptr, self.classes, self.host_scalar
        for i, metric in enumerate((self.metrics_cu.batch_loss, self.metrics_cu.batch_correct)):
            total = self.totals.at(i)
            metric(self.stream, logits, self.labels.ptr, rows, classes, total, False)
            cuda.copy_to_host(total, scalar, self.stream)
            self.host_metrics[i] += scalar[0]

    def read(self) -> np.ndarray:
        return self.host_metrics


class BaselineStage(Stage):
    name = "baseline"
    summary = "naive NVRTC kernels for everything; loss and accuracy copied to the host every step"
    parts: ClassVar[Parts] = Parts(products=NaiveProducts, softmax=KernelSoftmax, metrics=HostReadMetrics)
    # What the setup makes beyond the device pieces and the kernels every rung of the chain runs
    # (gather.cu, layers.cu, metrics.cu): the union of its parts' (kept for each subclass):
    #   "matmul"   the naive product kernel (matmul.cu)
    #   "softmax"  the softmax and its loss gradient (softmax.cu), and the probabilities' buffer
    #   "cublas"   a cuBLAS handle and its workspace
    #   "cudnn"    a cuDNN handle
    uses: ClassVar[frozenset[str]] = parts.uses

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.uses = cls.parts.uses

    def needs(self, what: str) -> bool:
        """Whether this rung, training this model, sets up `what` (one of `uses`'s names)."""
        return what in self.uses

    @classmethod
    def first_uses(cls) -> list:
        """The once-a-process starts of the NVIDIA libraries this rung's setup makes a handle of
        (cuBLAS, cuDNN), which its first calls would otherwise pay: for `graphtrain run` to begin
        on a thread of its own while the data loads (graphtrain.libs.cuda.start_beside). From
        `uses`, as `needs` decides for these two whatever the model."""
        from graphtrain.libs import cublas, cudnn

        return [library.first_use for name, library in (("cublas", cublas), ("cudnn", cudnn)) if name in cls.uses]

    def measures(self, epoch: int) -> bool:
        return self.parts.metrics.measures(self.plan, epoch)

    # ---- setup -------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg, data, plan = self.config, self.data, self.plan
        self.context = device.DeviceContext()
        self.device, self.stream = self.context.device, self.context.stream
        # One launcher object per kernels/*.cu file, named after it.
        self.gather_cu, self.layers_cu, self.metrics_cu = Gather(self.device), Layers(self.device), Metrics(self.device)
        self.chosen = self.parts.make()  # the parts' own files next: the naive products' matmul.cu
        for part in self.chosen:
            part.load(self.device)
        self.softmax_cu = Softmax(self.device) if self.needs("softmax") else None

        self.num_train, self.num_test = plan.num_train, plan.num_test
        self.max_rows = max(cfg.batch, min(device.EVAL_ROWS, self.num_test))
        dims, features, rows = cfg.dims, cfg.in_features, self.max_rows

        # One allocation for the whole run: plan every buffer, then allocate once.
        arena = self.arena = Arena()
        self.dataset = device.DatasetOnDevice(arena, plan, data)
        self.train_images, self.train_labels = self.dataset.train_images, self.dataset.train_labels
        self.test_images, self.test_labels, self.order = self.dataset.test_images, self.dataset.test_labels, self.dataset.order
        # Weights, then biases (graphtrain.stages.device.Parameters), then their gradients, each
        # kind in layer order: the fused rungs update or convert a kind in one pass over its span.
        self.params = device.Parameters(arena, cfg)
        self.w, self.b = self.params.w, self.params.b
        self.dw = [arena.reserve(f"d{w.name}", w.shape) for w in self.w]
        self.db = [arena.reserve(f"d{b.name}", b.shape) if b is not None else None for b in self.b]
        # acts[0] is the batch x, acts[i] layer i's output (after ReLU), acts[-1] the logits;
        # grads[i] is dL/dacts[i] for i >= 1.
        self.acts = [arena.reserve("x", (rows, features))]
        self.acts += [arena.reserve(f"h{i}", (rows, d)) for i, d in enumerate(dims[1:-1], 1)]
        self.acts.append(arena.reserve("logits", (rows, cfg.classes)))
        self.grads = [None] + [arena.reserve(f"d{buf.name}", buf.shape) for buf in self.acts[1:]]
        self.probs = arena.reserve("probs", (rows, cfg.classes)) if self.needs("softmax") else None
        self.y = arena.reserve("y", (rows,), np.int32)
        self.metrics = arena.reserve("metrics", (2,), np.float64)  # [Σ loss, # correct]
        self.reserve_extra(arena)
        arena.allocate()

        self.dataset.upload(self.stream)
        self.setup_extra()
        self.reset_metrics()

        # Warm up (first launches, library heuristics), then start again from the shared init.
        self.warm_up()
        self.stream.synchronize()
        self.upload_initial_weights()
        self.capture()
        cuda.wait_for_head_starts()  # none still runs beside the timed epochs

    def warm_up(self) -> None:
        """One step of the first batch: first launches, library heuristics (undone afterwards)."""
        self.train_step(0, self.plan.batch_sizes[0], measure=True)

    def reserve_extra(self, arena: Arena) -> None:
        """Room the parts need in the arena (cuBLAS's workspace), and a later rung (graphs's cursor)."""
        for part in self.chosen:
            part.reserve(arena)

    def setup_extra(self) -> None:
        """Handles the parts create once the arena exists (cuBLAS's, cuDNN's), and a later rung's."""
        for part in self.chosen:
            part.open(self)

    def capture(self) -> None:
        """Where the graphs rung records its step graphs, after the warm-up."""

    def upload_initial_weights(self) -> None:
        self.params.upload(self.plan.initial, self.stream)

    # ---- the math, one launch per line ----------------------------------------------------------

    def softmax(self, rows: int) -> None:
        self.chosen.softmax.forward(rows)

    def load_batch(self, offset: int, rows: int) -> None:
        self.gather_cu.gather_batch(self.stream, self.train_images.ptr, self.train_labels.ptr, self.order.ptr,
                                    offset, self.config.in_features, rows, self.acts[0].ptr, self.y.ptr)

    def forward(self, x_ptr: int, rows: int) -> None:
        """acts[i] = ReLU(acts[i-1] W_iᵀ + b_i), no ReLU on the logits."""
        device.forward(self.chosen.products.gemm, self.layers_cu, self.stream, self.config.dims, self.params, x_ptr, self.acts[1:], rows)

    def backward(self, rows: int) -> None:
        """dW_i = dyᵀ x, db_i = Σ_rows dy, dx = dy W_i masked by the ReLU below."""
        dims, gemm = self.config.dims, self.chosen.products.gemm
        for i in reversed(range(len(self.w))):
            fan_in, fan_out = dims[i], dims[i + 1]
            x, dy = self.acts[i], self.grads[i + 1]
            gemm(True, False, fan_out, fan_in, rows, 1.0, dy.ptr, fan_out, x.ptr, fan_in, 0.0,
                      self.dw[i].ptr, fan_in)
            if self.db[i] is not None:
                self.layers_cu.bias_grad(self.stream, dy.ptr, self.db[i].ptr, rows, fan_out)
            if i > 0:
                dx = self.grads[i]
                gemm(False, False, rows, fan_in, fan_out, 1.0, dy.ptr, fan_out, self.w[i].ptr, fan_in,
                          0.0, dx.ptr, fan_in)
                self.layers_cu.relu_backward(self.stream, dx.ptr, x.ptr, rows * fan_in)

    def update(self) -> None:
        """SGD at a constant rate: W −= lr·dW, b −= lr·db, one launch a parameter."""
        lr = self.config.lr
        for param, grad in [*zip(self.w, self.dw), *zip(self.b, self.db)]:
            if param is not None:
                self.layers_cu.sgd_update(self.stream, param.ptr, grad.ptr, lr, param.size)

    def train_step(self, offset: int, rows: int, measure: bool) -> None:
        classes = self.config.classes
        self.load_batch(offset, rows)
        self.forward(self.acts[0].ptr, rows)
        if measure:
            self.record_metrics(rows)
        self.softmax(rows)
        self.softmax_cu.xent_grad(self.stream, self.probs.ptr, self.y.ptr, self.grads[-1].ptr, rows, classes)
        self.backward(rows)
        self.update()

    # ---- metrics: as the metrics part keeps them ---------------------------------------------------

    def reset_metrics(self) -> None:
        self.chosen.metrics.reset()

    def record_metrics(self, rows: int) -> None:
        self.chosen.metrics.record(rows)

    def read_metrics(self) -> np.ndarray:
        return self.chosen.metrics.read()

    # ---- epochs ---------------------------------------------------------------------------------

    def train_epoch(self, epoch: int, num_batches: int, measure: bool) -> EpochResult:
        if measure:
            self.reset_metrics()
        ms = self.context.timed(lambda: self.run_batches(epoch, num_batches, measure))
        if not measure:
            return EpochResult(ms)
        loss_sum, correct = self.read_metrics()
        seen = self.plan.samples_seen(num_batches)
        return EpochResult(ms, loss_sum / seen, correct / seen)

    def run_batches(self, epoch: int, num_batches: int, measure: bool) -> None:
        base = epoch * self.num_train
        for lo, hi in self.plan.epoch_bounds(epoch, num_batches):
            self.train_step(base + lo, hi - lo, measure)

    def test_accuracy(self) -> float:
        """Accuracy on the test set, forward passes of up to max_rows rows, one read at the end."""
        def forward_rows(x_ptr: int, rows: int):
            self.forward(x_ptr, rows)
            return self.acts[-1]

        return device.count_correct(self.stream, self.metrics_cu, self.dataset, self.max_rows, forward_rows,
                                    self.config.classes, self.metrics.at(1))

    def weights(self) -> list[Layer]:
        return self.params.download(self.stream)

    def environment(self) -> dict:
        return {**environment.gpu(self.device), **self.library_versions()}

    def library_versions(self) -> dict:
        versions = {"nvrtc": nvrtc.version()}
        for part in self.chosen:
            versions.update(part.library_versions())
        return versions

    def close(self) -> None:
        for part in reversed(list(getattr(self, "chosen", ()))):
            part.close()
        for name in ("arena", "gather_cu", "layers_cu", "softmax_cu", "metrics_cu", "context"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
