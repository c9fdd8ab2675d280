"""`cudnn-softmax`: the softmax through cudnnSoftmaxForward (ACCURATE, INSTANCE).

The logits are viewed as an (rows, classes, 1, 1) tensor, so INSTANCE mode normalises each row.
Descriptors are made once at setup, one per batch size the epoch uses (the tail batch is smaller).
"""

from __future__ import annotations

from graphtrain.libs import cudnn
from graphtrain.libs.cudnn import Cudnn
from graphtrain.stages.sparse_metrics import SparseMetricsStage


class CudnnSoftmaxStage(SparseMetricsStage):
    name = "cudnn-softmax"
    summary = "softmax through cudnnSoftmaxForward (ACCURATE, INSTANCE)"
    uses = SparseMetricsStage.uses | {"cudnn"}

    def setup_extra(self) -> None:
        super().setup_extra()
        self.dnn = None
        if not self.needs("cudnn"):
            return
        self.dnn = Cudnn(self.stream)
        self.softmax_desc = {rows: self.dnn.tensor_4d(rows, self.config.classes, 1, 1)
                             for rows in self.plan.batch_sizes}

    def softmax(self, rows: int) -> None:
        self.dnn.softmax_forward(self.softmax_desc[rows], self.acts[-1].ptr, self.probs.ptr)

    def library_versions(self) -> dict:
        return {**super().library_versions(), **({"cudnn": cudnn.version()} if self.needs("cudnn") else {})}

    def close(self) -> None:
        if getattr(self, "dnn", None) is not None:
            self.dnn.close()
        super().close()
