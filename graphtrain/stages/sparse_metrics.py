"""`sparse-metrics`: loss and accuracy only every `metrics_every` epochs (and the last), fused.

Most epochs now run forward, backward and SGD alone. When metrics are due, one kernel computes
both the loss and the accuracy in a single pass over the logits.
"""

from __future__ import annotations

from graphtrain.stages.cublas_gemm import CublasStage


class SparseMetricsStage(CublasStage):
    name = "sparse-metrics"
    summary = "loss and accuracy only every N epochs (and the last), in one fused kernel"

    def measures(self, epoch: int) -> bool:
        return self.plan.metrics_due[epoch]

    def record_metrics(self, rows: int) -> None:
        self.metrics_cu.batch_metrics(self.stream, self.acts[-1].ptr, self.y.ptr, rows, self.config.classes,
                                      self.metrics.ptr)
