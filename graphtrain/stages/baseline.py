"""`baseline`: the first GPU rung. Naive NVRTC kernels for everything, metrics read every step.

This file is also the skeleton the later rungs of the chain (fewer-syncs … graphs) reuse, built on
the device pieces of graphtrain.stages.device (the arena with the dataset, the parameters):
forward, backward and SGD. Each later rung replaces one part of it, and the diff is its lesson:

    train_step    gather → forward → [metrics] → softmax → dlogits → backward → update
    gemm          the matrix products               (cublas replaces it)
    softmax       probabilities from logits         (cudnn-softmax replaces it)
    record_metrics / read_metrics                   (fewer-syncs, sparse-metrics replace them)
    run_batches   the loop over an epoch's batches  (graphs replaces it: step graphs replayed, the
                                                     batch's start read from a device cursor)
    update        SGD at a constant rate            (graphs adds the recipe's optimizers and schedules)

and each states in `uses` what its setup makes beyond the device pieces, so that no rung compiles,
creates or reserves what its steps never touch. The chain ends at `graphs`
(graphtrain.stages.CHAIN_END): the rungs after it are programs of their own.
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


class BaselineStage(Stage):
    name = "baseline"
    summary = "naive NVRTC kernels for everything; loss and accuracy copied to the host every step"
    # What the setup makes beyond the device pieces and the kernels every rung of the chain runs
    # (gather.cu, layers.cu, metrics.cu); a rung adds what it brings and drops what it replaced:
    #   "matmul"   the naive product kernel (matmul.cu)
    #   "softmax"  the softmax and its loss gradient (softmax.cu), and the probabilities' buffer
    #   "cublas"   a cuBLAS handle and its workspace
    #   "cudnn"    a cuDNN handle
    uses: ClassVar[frozenset[str]] = frozenset({"matmul", "softmax"})

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

    # ---- setup -------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg, data, plan = self.config, self.data, self.plan
        self.context = device.DeviceContext()
        self.device, self.stream = self.context.device, self.context.stream
        # One launcher object per kernels/*.cu file, named after it.
        self.gather_cu, self.layers_cu, self.metrics_cu = Gather(self.device), Layers(self.device), Metrics(self.device)
        self.matmul_cu = Matmul(self.device) if self.needs("matmul") else None
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
        """Room a later rung needs in the arena (a cuBLAS workspace, say)."""

    def setup_extra(self) -> None:
        """Handles a later rung creates once the arena exists."""

    def capture(self) -> None:
        """Where the graphs rung records its step graphs, after the warm-up."""

    def upload_initial_weights(self) -> None:
        self.params.upload(self.plan.initial, self.stream)

    # ---- the math, one launch per line ----------------------------------------------------------

    def gemm(self, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) -> None:
        """Row-major C (m×n) = alpha·op(A)·op(B) + beta·C."""
        self.matmul_cu.gemm(self.stream, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)

    def softmax(self, rows: int) -> None:
        self.softmax_cu.softmax_rows(self.stream, self.acts[-1].ptr, self.probs.ptr, rows, self.config.classes)

    def load_batch(self, offset: int, rows: int) -> None:
        self.gather_cu.gather_batch(self.stream, self.train_images.ptr, self.train_labels.ptr, self.order.ptr,
                                    offset, self.config.in_features, rows, self.acts[0].ptr, self.y.ptr)

    def forward(self, x_ptr: int, rows: int) -> None:
        """acts[i] = ReLU(acts[i-1] W_iᵀ + b_i), no ReLU on the logits."""
        device.forward(self.gemm, self.layers_cu, self.stream, self.config.dims, self.params, x_ptr, self.acts[1:], rows)

    def backward(self, rows: int) -> None:
        """dW_i = dyᵀ x, db_i = Σ_rows dy, dx = dy W_i masked by the ReLU below."""
        dims = self.config.dims
        for i in reversed(range(len(self.w))):
            fan_in, fan_out = dims[i], dims[i + 1]
            x, dy = self.acts[i], self.grads[i + 1]
            self.gemm(True, False, fan_out, fan_in, rows, 1.0, dy.ptr, fan_out, x.ptr, fan_in, 0.0,
                      self.dw[i].ptr, fan_in)
            if self.db[i] is not None:
                self.layers_cu.bias_grad(self.stream, dy.ptr, self.db[i].ptr, rows, fan_out)
            if i > 0:
                dx = self.grads[i]
                self.gemm(False, False, rows, fan_in, fan_out, 1.0, dy.ptr, fan_out, self.w[i].ptr, fan_in,
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

    # ---- metrics: the baseline reads loss and accuracy back after every step ---------------------

    def reset_metrics(self) -> None:
        self.metrics.zero(self.stream)
        self.host_metrics = np.zeros(2)
        self.host_scalar = np.zeros(1)  # where each per-step read lands: allocated here, not per step

    def record_metrics(self, rows: int) -> None:
        """Each metric is computed, copied back and waited for, as a first version would."""
        logits, classes, scalar = self.acts[-1].ptr, self.config.classes, self.host_scalar
        for i, metric in enumerate((self.metrics_cu.batch_loss, self.metrics_cu.batch_correct)):
            total = self.metrics.at(i)
            metric(self.stream, logits, self.y.ptr, rows, classes, total, False)
            cuda.copy_to_host(total, scalar, self.stream)
            self.host_metrics[i] += scalar[0]

    def read_metrics(self) -> np.ndarray:
        return self.host_metrics

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
        return {"nvrtc": nvrtc.version()}

    def close(self) -> None:
        for name in ("arena", "gather_cu", "matmul_cu", "layers_cu", "softmax_cu", "metrics_cu", "context"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
