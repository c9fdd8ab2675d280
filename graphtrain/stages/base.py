"""The interface every rung implements; the trainer (graphtrain.training) drives it.

A stage owns the model's state wherever it lives (host arrays, a device arena) and runs epochs
over the shared sample order. It times its own epochs, because only it knows the right clock:
CUDA events on the GPU, perf_counter on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from graphtrain.config import TrainConfig
from graphtrain.data import Dataset
from graphtrain.reference import Layer


@dataclass
class EpochResult:
    ms: float
    train_loss: float | None = None  # mean over the epoch's samples, when measured
    train_accuracy: float | None = None


class Stage:
    name: ClassVar[str]
    summary: ClassVar[str]  # what this rung adds to the one before it
    uses_gpu: ClassVar[bool] = False
    kind: ClassVar[str] = "stage"  # "peer" for the framework peers
    note: ClassVar[str] = ""  # what sets a run apart (precision, compile mode), shown in reports
    # False: train loss and accuracy are measured every epoch. True: only when
    # config.metrics_due(epoch) says so, the sparse schedule of the later rungs.
    sparse_metrics: ClassVar[bool] = False

    def __init__(self, config: TrainConfig, data: Dataset):
        self.config = config
        self.data = data

    def setup(self) -> None:
        """Everything before the first timed epoch: compile, allocate, upload, warm up, capture."""

    def train_epoch(self, epoch: int, num_batches: int, measure: bool) -> EpochResult:
        raise NotImplementedError

    def test_accuracy(self) -> float:
        raise NotImplementedError

    def weights(self) -> list[Layer]:
        """Host copies of the current parameters."""
        raise NotImplementedError

    def environment(self) -> dict:
        """What the run ran on, beyond Python and the CPU (GPU, driver, library versions)."""
        return {}

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
