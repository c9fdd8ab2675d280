"""`cudnn-softmax`: the softmax through cudnnSoftmaxForward (ACCURATE, INSTANCE).

The logits are viewed as an (rows, classes, 1, 1) tensor, so INSTANCE mode normalises each row.
Descriptors are made once at setup, one per batch size the epoch uses (the tail batch is smaller).
The softmax part is CudnnSoftmax; the loss gradient stays softmax.cu's.
"""

from __future__ import annotations

from collections.abc import Iterable

from graphtrain.libs import cudnn
from graphtrain.libs.cudnn import Cudnn
from graphtrain.stages.baseline import BaselineStage
from graphtrain.stages.chain_parts import SoftmaxPart
from graphtrain.stages.sparse_metrics import SparseMetricsStage


class CudnnSoftmax(SoftmaxPart):
    """cudnnSoftmaxForward on a cuDNN handle bound to the rung's stream, a tensor descriptor per
    row count."""

    uses = frozenset({"softmax", "cudnn"})  # softmax.cu still gives the loss gradient

    def open(self, stage: BaselineStage) -> None:
        self.classes, self.logits, self.probs = stage.config.classes, stage.acts[-1], stage.probs
        self.dnn = Cudnn(stage.stream)
        self.desc = {rows: self.dnn.tensor_4d(rows, self.classes, 1, 1) for rows in stage.plan.batch_sizes}

    def describe(self, row_counts: Iterable[int]) -> None:
        """Descriptors for more row counts (a data-parallel rank's slices), those not described yet."""
        self.desc.update({rows: self.dnn.tensor_4d(rows, self.classes, 1, 1)
                          for rows in row_counts if rows not in self.desc})

    def forward(self, rows: int) -> None:
        self.dnn.softmax_forward(self.desc[rows], self.logits.ptr, self.probs.ptr)

    def library_versions(self) -> dict:
        return {"cudnn": cudnn.version()}

    def close(self) -> None:
        if getattr(self, "dnn", None) is not None:
            self.dnn.close()


class CudnnSoftmaxStage(BaselineStage):
    name = "cudnn-softmax"
    summary = "softmax through cudnnSoftmaxForward (ACCURATE, INSTANCE)"
    parts = SparseMetricsStage.parts.but(softmax=CudnnSoftmax)
