"""`fewer-syncs`: loss and accuracy add up on the device; the host reads them once per epoch.

The baseline stalled the GPU twice a step, waiting for a copy of the batch's loss and accuracy.
Here both kernels add into a device accumulator, and nothing inside the batch loop waits: the
metrics part is DeviceSumMetrics, read once at the epoch's end (MetricsPart.read).
"""

from __future__ import annotations

from graphtrain.stages.baseline import BaselineStage
from graphtrain.stages.chain_parts import MetricsPart


class DeviceSumMetrics(MetricsPart):
    """Each step's loss and correct count added into the device's two totals, nothing read."""

    def record(self, rows: int) -> None:
        logits, classes = self.logits.ptr, self.classes
        self.metrics_cu.batch_loss(self.stream, logits, self.labels.ptr, rows, classes, self.totals.at(0), True)
        self.metrics_cu.batch_correct(self.stream, logits, self.labels.ptr, rows, classes, self.totals.at(1), True)


class FewerSyncsStage(BaselineStage):
    name = "fewer-syncs"
    summary = "loss and accuracy accumulated on the device; one host read per epoch"
    parts = BaselineStage.parts.but(metrics=DeviceSumMetrics)
