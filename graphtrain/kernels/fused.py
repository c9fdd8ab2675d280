"""Launchers for fused.cu: the model's head (logits layer and loss step), its backward pass and
update, the ReLU's derivative with the bias gradient, the bf16 gather, the end of a step.

The head kernels unroll over the classes, so a `Fused` is compiled for a model's class count.
head_backward and relu_bias_grad train `models` > 1 models at once when asked (graphtrain.kernels'
model axis: every buffer per model, model_stride bytes apart).
"""

from __future__ import annotations

from graphtrain.kernels import F32, I32, I64, PTR, KernelFile, ceil_div, kernel, model_grid, model_stride_arg

HEAD_THREADS = 256  # head_step: 8 rows (warps) per block
COL_THREADS, COLUMNS = 512, 32  # the column kernels: 32 columns per block, its 16 warps split the rows
SHARED_W_BYTES = 48 * 1024  # head_step copies W into shared memory up to the default limit
# The column kernels keep a batch's dlogits in shared memory: batch × classes floats, up to this
# (raised once per kernel; within what every GPU from compute capability 8.0 on allows a block).
MAX_DLOGITS_BYTES = 96 * 1024
GATHER_THREADS = 256  # per row copied
SGD_THREADS, SGD_BLOCKS = 256, 264  # a grid-stride pass over the packed parameters
MAX_CLASSES = 32  # a row's classes are the lanes of one warp


class Fused(KernelFile):
    stem = "fused"
    headers = ("logits_loss.cuh", "model_axis.cuh")
    # CLASSES and BF16 (the activations' element type, fused.cu's floatX): the model's, per instance.
    defines = {"HEAD_THREADS": HEAD_THREADS, "COL_THREADS": COL_THREADS, "CLASSES": 10, "BF16": 0}
    _head_step = kernel("head_step", PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, I32, I32, PTR, PTR, PTR, I32)
    _head_update = kernel("head_update", PTR, PTR, PTR, PTR, I32, I32, F32, I32, PTR, PTR, PTR, PTR,
                          max_shared_bytes=MAX_DLOGITS_BYTES)
    _head_backward = kernel("head_backward", PTR, PTR, PTR, PTR, PTR, I32, I32, I64,
                            max_shared_bytes=MAX_DLOGITS_BYTES)
    _relu_bias_grad = kernel("relu_bias_grad", PTR, PTR, PTR, I32, I32, I64)
    _gather_batch_bf16 = kernel("gather_batch_bf16", PTR, PTR, PTR, PTR, I32, PTR, PTR)
    _sgd_bias_refresh = kernel("sgd_bias_refresh", PTR, PTR, PTR, I64, F32, PTR, PTR, I64)

    def __init__(self, device, classes: int, bf16: bool):
        """`bf16`: the hidden activations and their gradients are bf16 (a model with hidden layers
        on the bf16 rung); else fp32, which softmax regression's head, gathering its own fp32
        batch, needs. The head itself is fp32 either way."""
        super().__init__(device, {"CLASSES": classes, "BF16": int(bf16)})
        self.classes, self.bf16 = classes, bf16

    def dlogits_bytes(self, rows: int) -> int:
        return rows * self.classes * 4

    @staticmethod
    def refusal(batch: int, classes: int) -> str | None:
        """Why the fused head cannot train a batch this wide, or None."""
        if not 1 <= classes <= MAX_CLASSES:
            return f"{classes} classes (the fused head takes at most {MAX_CLASSES}: one warp's lanes)"
        if batch * classes * 4 > MAX_DLOGITS_BYTES:
            return (f"batch {batch} of {classes} classes (the fused head keeps a batch's dlogits in "
                    f"{MAX_DLOGITS_BYTES // 1024} KiB of shared memory: batch × classes ≤ {MAX_DLOGITS_BYTES // 4})")
        return None

    def head_step(self, stream, x: int, w: int, b: int, k: int, rows: int, y: int, dlogits: int, row_loss: int,
                  row_correct: int, gather: tuple[int, int, int, int, int] | None = None) -> None:
        """dlogits of the logits layer (W: classes × k) from x, or from the batch gathered here
        (gather = images, labels, order, cursor, x_copy); row_loss/row_correct unless 0."""
        if gather is not None and self.bf16:
            raise ValueError("the gathered batch is fp32, and these kernels read bf16 activations (bf16=True)")
        images, labels, order, cursor, x_copy = gather or (0, 0, 0, 0, 0)
        w_bytes = self.classes * k * 4
        shared = w_bytes if w_bytes <= SHARED_W_BYTES else 0
        self._head_step(stream, ceil_div(rows, HEAD_THREADS // 32), HEAD_THREADS, x, images, labels, order, cursor,
                        x_copy, y, w, b, k, rows, dlogits, row_loss, row_correct, shared > 0, shared_bytes=shared)

    def head_update(self, stream, x: int, dlogits: int, w: int, b: int, k: int, rows: int, lr: float,
                    row_loss: int, row_correct: int, totals: int, cursor: int, gradient: bool = False) -> None:
        """W −= lr·dlogitsᵀx, b −= lr·Σ dlogits (`gradient`: W = dlogitsᵀx and b = Σ dlogits, the
        head's gradients written where w and b point), totals += the rows' metrics (row_loss ≠ 0)
        and cursor += rows. x: the activations, or the fp32 batch head_step gathered."""
        self._head_update(stream, ceil_div(k, COLUMNS) + 1, COL_THREADS, x, dlogits, w, b, k, rows, lr,
                          int(gradient), row_loss, row_correct, totals, cursor, shared_bytes=self.dlogits_bytes(rows))

    def head_backward(self, stream, dlogits: int, w: int, h: int, dh: int, db: int, k: int, rows: int,
                      models: int = 1, model_stride: int = 0) -> None:
        """dh = (dlogits·W) masked by h > 0, and db = Σ_rows dh unless 0."""
        stride = model_stride_arg(models, model_stride)
        self._head_backward(stream, model_grid(ceil_div(k, COLUMNS), models), COL_THREADS, dlogits, w, h, dh, db, k,
                            rows, stride, shared_bytes=self.dlogits_bytes(rows))

    def relu_bias_grad(self, stream, h: int, dh: int, db: int, k: int, rows: int, models: int = 1,
                       model_stride: int = 0) -> None:
        """dh = 0 where h ≤ 0 (in place), and db = Σ_rows dh unless 0."""
        stride = model_stride_arg(models, model_stride)
        self._relu_bias_grad(stream, model_grid(ceil_div(k, COLUMNS), models), COL_THREADS, h, dh, db, k, rows,
                             stride)

    def gather_batch_bf16(self, stream, images: int, labels: int, order: int, cursor: int, features: int,
                          rows: int, x: int, y: int) -> None:
        """x[r] = bf16(images[order[*cursor + r]]), y[r] = labels[order[*cursor + r]]."""
        self._gather_batch_bf16(stream, rows, GATHER_THREADS, images, labels, order, cursor, features, x, y)

    def sgd_bias_refresh(self, stream, bias: int, dbias: int, bias16: int, n_bias: int, lr: float,
                         weights: int, weights16: int, n_weights: int) -> None:
        """bias −= lr·dbias over n_bias packed floats (and bias16 = bf16(bias) unless 0), then
        weights16 = bf16(weights) over n_weights packed floats."""
        self._sgd_bias_refresh(stream, SGD_BLOCKS, SGD_THREADS, bias, dbias, bias16, n_bias, lr, weights,
                               weights16, n_weights)
