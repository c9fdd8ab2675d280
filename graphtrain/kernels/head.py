"""Launcher for head.cu: the cnn's logits layer, loss step and the layer's weight and bias
gradients in one block, compiled for the model's class count."""

from __future__ import annotations

from graphtrain.kernels import I32, PTR, KernelFile, kernel

THREADS = 1024  # one block: a warp per row, then (column, row slice) per thread
SLICES = 4  # head.cu's HL_SLICES
MAX_CLASSES = 32  # a row's classes are at most one warp's lanes
MAX_SHARED = 96 * 1024  # the batch's dlogits, W and the slices' sums (raised once)


def shared_bytes(batch: int, k: int, classes: int) -> int:
    return 4 * classes * (batch + SLICES * (k + 1) + k)


def fits(batch: int, k: int, classes: int) -> bool:
    """Whether a logits layer of k inputs and `classes` outputs, trained at this batch, fits the kernel."""
    return 1 <= classes <= MAX_CLASSES and shared_bytes(batch, k, classes) <= MAX_SHARED


class Head(KernelFile):
    stem = "head"
    defines = {"HL_CLASSES": 10, "HL_THREADS": THREADS}
    _head_loss_step = kernel("head_loss_step", PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, I32, I32, I32, PTR,
                             max_shared_bytes=MAX_SHARED)
    note = "fp32 (head.cu, with the loss step)"

    def __init__(self, device, classes: int):
        if not 1 <= classes <= MAX_CLASSES:
            raise ValueError(f"head.cu takes 1 to {MAX_CLASSES} classes, not {classes}")
        super().__init__(device, {"HL_CLASSES": classes})
        self.classes = classes

    def loss_step(self, stream, h: int, w: int, b: int, y: int, dlogits: int, dw: int, db: int, cursor: int,
                  batch: int, k: int, epoch_samples: int, loss_sum: int = 0) -> None:
        """logits = h·Wᵀ + b (W: classes × k), the loss step of the batch's valid rows (dlogits,
        the cursor advanced by them, Σ loss added to loss_sum unless 0), dW = dlogitsᵀ·h, db."""
        if not fits(batch, k, self.classes):
            raise ValueError(f"head.cu cannot hold a batch of {batch} rows of {k} inputs and {self.classes} classes "
                             f"in {MAX_SHARED // 1024} KiB of shared memory")
        self._head_loss_step(stream, 1, THREADS, h, w, b, y, dlogits, dw, db, cursor, batch, k, epoch_samples,
                             loss_sum, shared_bytes=shared_bytes(batch, k, self.classes))
