"""Launchers for metrics.cu: a batch's summed loss and number correct, reduced in one block."""

from __future__ import annotations

from graphtrain.kernels import I32, PTR, KernelFile, kernel

METRICS_THREADS = 256  # the block that reduces, in a fixed order; a power of two


class Metrics(KernelFile):
    stem = "metrics"
    defines = {"METRICS_THREADS": METRICS_THREADS}
    _batch_loss = kernel("batch_loss", PTR, PTR, I32, I32, PTR, I32)
    _batch_correct = kernel("batch_correct", PTR, PTR, I32, I32, PTR, I32)
    _batch_metrics = kernel("batch_metrics", PTR, PTR, I32, I32, PTR)

    def batch_loss(self, stream, logits: int, y: int, rows: int, cols: int, total: int, accumulate: bool) -> None:
        """*total (+)= Σ_r cross-entropy(logits[r], y[r]) (a double; adds when accumulate)."""
        self._batch_loss(stream, 1, METRICS_THREADS, logits, y, rows, cols, total, accumulate)

    def batch_correct(self, stream, logits: int, y: int, rows: int, cols: int, total: int, accumulate: bool) -> None:
        """*total (+)= #{r : argmax logits[r] = y[r]} (a double; adds when accumulate)."""
        self._batch_correct(stream, 1, METRICS_THREADS, logits, y, rows, cols, total, accumulate)

    def batch_metrics(self, stream, logits: int, y: int, rows: int, cols: int, totals: int) -> None:
        """totals[0] += Σ loss, totals[1] += #correct, in one pass (two doubles)."""
        self._batch_metrics(stream, 1, METRICS_THREADS, logits, y, rows, cols, totals)
