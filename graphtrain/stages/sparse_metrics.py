"""`sparse-metrics`: loss and accuracy only every `metrics_every` epochs (and the last), fused.

Most epochs now run forward, backward and SGD alone. When metrics are due, one kernel computes
both the loss and the accuracy in a single pass over the logits: the metrics part is
SparseFusedMetrics.
"""

from __future__ import annotations

from graphtrain.plan import RunPlan
from graphtrain.stages.baseline import BaselineStage
from graphtrain.stages.chain_parts import MetricsPart
from graphtrain.stages.cublas_gemm import CublasStage


class SparseFusedMetrics(MetricsPart):
    """Loss and correct count of the plan's metric epochs only, both from one kernel, summed on
    the device."""

    @classmethod
    def measures(cls, plan: RunPlan, epoch: int) -> bool:
        return plan.metrics_due[epoch]

    def record(self, rows: int) -> None:
        self.metrics_cu.batch_metrics(self.stream, self.logits.ptr, self.labels.ptr, rows, self.classes,
                                      self.totals.ptr)


class SparseMetricsStage(BaselineStage):
    name = "sparse-metrics"
    summary = "loss and accuracy only every N epochs (and the last), in one fused kernel"
    parts = CublasStage.parts.but(metrics=SparseFusedMetrics)
