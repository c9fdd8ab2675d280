"""The choices a rung of the ladder's chain makes in the one step they all run (BaselineStage's),
each a small named part, and `Parts`, a rung's choice of each:

    products  how the matrix products run       NaiveProducts (baseline.py: matmul.cu)
                                                CublasProducts (cublas_gemm.py: cublasGemmEx)
    softmax   how the probabilities are made    KernelSoftmax (baseline.py: softmax.cu)
                                                CudnnSoftmax (cudnn_softmax.py: cudnnSoftmaxForward)
    metrics   how loss and accuracy are kept    HostReadMetrics (baseline.py: read every step)
                                                DeviceSumMetrics (fewer_syncs.py: summed on the device,
                                                read once an epoch)
                                                SparseFusedMetrics (sparse_metrics.py: metric epochs only,
                                                one kernel for both)

Why data, not a chain of subclasses: a rung of the chain is the rung below it plus one idea, and
that idea is one of these choices, so a rung states it as data over the rung below,

    parts = FewerSyncsStage.parts.but(products=CublasProducts)

and derives from BaselineStage itself. The diff stays where it was, in the rung's file (its part
and that one line), and is all the rung is: no override of the step reaches past the rung that
wrote it, and no rung sits more than two classes below `Stage` (were each rung derived from the
one below, `graphs` would sit six below it, and `run --gpus`'s rank seven). tests/test_stages.py checks that each rung's parts
differ from the rung below's in exactly the part its module's docstring names, defined in its
file. `graphs` changes no part: it adds methods (the cursor and the optimizer in the arena, the
capture, the replay).

A part follows the rung's setup, and owns what it makes: `load` (kernel files, made with the
rung's own before the arena is planned), `reserve` (room in the rung's arena), `open` (handles and
descriptors once the arena is allocated; it keeps from the rung the stream and the buffers it
works on), then the calls of the step, `library_versions` (what the rung's record states of the
library it calls) and `close`. `uses` names what its setup makes beyond the chain's own kernels
(BaselineStage.uses, the union of its parts', says it per rung).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from graphtrain.libs import cuda
from graphtrain.libs.memory import Arena
from graphtrain.plan import RunPlan


class Part:
    """One choice of the chain's step; each method is a step of the rung's setup (see above)."""

    # What its setup makes beyond the chain's own kernels (BaselineStage.uses lists the names).
    uses: ClassVar[frozenset[str]] = frozenset()

    def load(self, device: cuda.DeviceInfo) -> None:
        """Make its kernel files (they compile while the rung's setup goes on)."""

    def reserve(self, arena: Arena) -> None:
        """Plan its room in the rung's arena."""

    def open(self, stage) -> None:
        """Create its handles once the arena is allocated; keep what it works on from `stage`, the
        BaselineStage it serves (its stream, plan, precision and buffers)."""

    def library_versions(self) -> dict:
        return {}

    def close(self) -> None:
        """Destroy what it created (also after a setup that failed before `open`)."""


class ProductsPart(Part):
    """How the step's matrix products run."""

    def gemm(self, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) -> None:
        """Row-major C (m×n) = alpha·op(A)·op(B) + beta·C, queued on the rung's stream."""
        raise NotImplementedError


class SoftmaxPart(Part):
    """How the probabilities come from the logits, each row normalised."""

    def forward(self, rows: int) -> None:
        """probs = softmax(logits) over the first `rows` rows, queued on the rung's stream."""
        raise NotImplementedError


class MetricsPart(Part):
    """How the train loss and accuracy of a measured epoch are kept: the rung's `metrics`, two
    doubles [Σ loss, # correct] on the device, zeroed by `reset`, added to by `record` each step
    of a measured epoch, and read by `read` at its end."""

    def open(self, stage) -> None:
        self.stream, self.metrics_cu, self.classes = stage.stream, stage.metrics_cu, stage.config.classes
        self.totals, self.logits, self.labels = stage.metrics, stage.acts[-1], stage.y

    @classmethod
    def measures(cls, plan: RunPlan, epoch: int) -> bool:
        """Whether `epoch` (0-based) measures train loss and accuracy: every epoch here."""
        return True

    def reset(self) -> None:
        self.totals.zero(self.stream)

    def record(self, rows: int) -> None:
        raise NotImplementedError

    def read(self) -> np.ndarray:
        """[Σ loss, # correct] over the epoch's samples, as host floats."""
        return self.totals.download(self.stream)


@dataclass(frozen=True)
class Parts:
    """A rung's choice of each part (the classes; the rung makes one of each at its setup)."""

    products: type[ProductsPart]
    softmax: type[SoftmaxPart]
    metrics: type[MetricsPart]

    def but(self, **changes: type[Part]) -> Parts:
        """These parts with the named ones replaced: a rung's one change over the rung below."""
        return dataclasses.replace(self, **changes)

    def changes_from(self, below: Parts) -> dict[str, type[Part]]:
        """The parts these parts choose otherwise than `below`, by field."""
        return {name: part for name, part in self.by_field().items() if getattr(below, name) is not part}

    def by_field(self) -> dict[str, type[Part]]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    @property
    def uses(self) -> frozenset[str]:
        """What a rung with these parts sets up beyond the chain's own kernels."""
        return frozenset().union(*(part.uses for part in self.by_field().values()))

    def make(self) -> ChosenParts:
        return ChosenParts(self.products(), self.softmax(), self.metrics())


@dataclass(frozen=True)
class ChosenParts:
    """One rung's parts, made at its setup, in the order they are set up (closed in reverse)."""

    products: ProductsPart
    softmax: SoftmaxPart
    metrics: MetricsPart

    def __iter__(self):
        return iter((self.products, self.softmax, self.metrics))
