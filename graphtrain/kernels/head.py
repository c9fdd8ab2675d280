"""Launchers for head.cu: the cnn's logits layer with its loss step (a warp per row), and the
layer's weight and bias gradients (a block per 32 columns); compiled for the model's class count.
With `models` > 1 a launch trains that many models at once (graphtrain.kernels' model axis: every
buffer per model, model_stride bytes apart)."""

from __future__ import annotations

from graphtrain.kernels import I32, I64, PTR, KernelFile, ceil_div, kernel, model_grid, model_stride_arg

ROW_THREADS = 256  # head_logits_loss: 8 rows (warps) per block
COL_THREADS = 512  # head_grads: 16 warps split a block's rows
# A row's classes are at most one warp's lanes, and head_grads keeps its warps' partial sums
# (warps × classes × 32 floats) in static shared memory, which a block has 48 KiB of: 24 classes.
MAX_CLASSES = min(32, 48 * 1024 // (COL_THREADS // 32 * 32 * 4))
MAX_DLOGITS_BYTES = 96 * 1024  # head_grads stages the batch's dlogits (raised once)


def fits(batch: int, classes: int) -> bool:
    """Whether a logits layer of `classes` outputs, trained at this batch, fits the kernels."""
    return 1 <= classes <= MAX_CLASSES and 4 * batch * classes <= MAX_DLOGITS_BYTES


class Head(KernelFile):
    stem = "head"
    headers = ("logits_loss.cuh", "batch_slice.cuh", "model_axis.cuh")
    defines = {"HL_CLASSES": 10, "HL_ROW_THREADS": ROW_THREADS, "HL_COL_THREADS": COL_THREADS}
    _head_logits_loss = kernel("head_logits_loss", PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, I32, I32, I32, PTR, I32,
                               I64)
    _head_grads = kernel("head_grads", PTR, PTR, PTR, PTR, I32, I32, I64, max_shared_bytes=MAX_DLOGITS_BYTES)
    note = "fp32 (head.cu, with the loss step)"

    def __init__(self, device, classes: int):
        if not 1 <= classes <= MAX_CLASSES:
            raise ValueError(f"head.cu takes 1 to {MAX_CLASSES} classes, not {classes}")
        super().__init__(device, {"HL_CLASSES": classes})
        self.classes = classes

    def _check(self, batch: int) -> None:
        if not fits(batch, self.classes):
            raise ValueError(f"head.cu cannot stage a batch of {batch} rows of {self.classes} classes' dlogits "
                             f"in {MAX_DLOGITS_BYTES // 1024} KiB of shared memory")

    def logits_loss(self, stream, h: int, w: int, b: int, y: int, dlogits: int, row_loss: int, count: int,
                    cursor: int, batch: int, k: int, epoch_samples: int, loss_sum: int = 0, ranks: int = 1,
                    models: int = 1, model_stride: int = 0) -> None:
        """logits = h·Wᵀ + b (W: classes × k) and the loss step of the batch's valid rows: dlogits,
        the cursor advanced by them, Σ loss added to loss_sum unless 0. row_loss: batch doubles of
        scratch; count: an int that is 0 (and is left 0), each model's own. With ranks > 1, `batch`
        is the combined batch and this rank's batch / ranks rows hold its slice (see head.cu)."""
        if batch % ranks:
            raise ValueError(f"a combined batch of {batch} rows does not split over {ranks} ranks")
        stride = model_stride_arg(models, model_stride)
        rows = batch // ranks
        self._check(rows)
        self._head_logits_loss(stream, model_grid(ceil_div(rows, ROW_THREADS // 32), models), ROW_THREADS, h, w, b, y,
                               dlogits, row_loss, count, cursor, batch, k, epoch_samples, loss_sum, ranks, stride)

    def grads(self, stream, h: int, dlogits: int, dw: int, db: int, batch: int, k: int, models: int = 1,
              model_stride: int = 0) -> None:
        """dW = dlogitsᵀ·h (classes × k), db = Σ_rows dlogits."""
        self._check(batch)
        stride = model_stride_arg(models, model_stride)
        self._head_grads(stream, model_grid(ceil_div(k + 1, 32), models), COL_THREADS, h, dlogits, dw, db, batch, k,
                         stride, shared_bytes=4 * batch * self.classes)
