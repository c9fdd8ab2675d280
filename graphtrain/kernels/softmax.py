"""Launchers for softmax.cu: row-wise softmax and the cross-entropy gradient."""

from __future__ import annotations

from graphtrain.kernels import I32, PTR, KernelFile, ceil_div, kernel

THREADS = 256


class Softmax(KernelFile):
    stem = "softmax"
    _softmax_rows = kernel("softmax_rows", PTR, PTR, I32, I32)
    _xent_grad = kernel("xent_grad", PTR, PTR, PTR, I32, I32)

    def softmax_rows(self, stream, logits: int, probs: int, rows: int, cols: int) -> None:
        """probs = softmax(logits) per row; one thread per row."""
        self._softmax_rows(stream, ceil_div(rows, THREADS), THREADS, logits, probs, rows, cols)

    def xent_grad(self, stream, probs: int, y: int, dlogits: int, rows: int, cols: int) -> None:
        """dlogits = (probs − onehot(y)) / rows; one thread per element."""
        self._xent_grad(stream, ceil_div(rows * cols, THREADS), THREADS, probs, y, dlogits, rows, cols)
