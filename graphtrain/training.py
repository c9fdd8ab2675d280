"""The training driver: runs one stage over a config and returns its run record.

The run record is the one format every consumer reads (the CLI's summary, `--json`, the ladder's
tables and plots), so its top-level keys are stable: stage, config, environment, epochs,
epoch_ms, setup_ms, total_ms, test_accuracy, train_loss.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import numpy as np

from graphtrain import data as data_mod
from graphtrain import environment as environment_mod
from graphtrain.config import TrainConfig
from graphtrain.errors import TrainingError
from graphtrain.stages import get_stage
from graphtrain.stages.base import Stage

# progress(epoch_index, num_epochs, epoch_entry) after each epoch.
Progress = Callable[[int, int, dict], None]


def median_epoch_ms(epochs: list[dict]) -> float:
    """The seeds' protocol: the median epoch time over the second half of the epochs."""
    times = [e["ms"] for e in epochs if e.get("full", True)] or [e["ms"] for e in epochs]
    return statistics.median(times[len(times) // 2:])


def train(
    config: TrainConfig,
    stage: str = "numpy",
    data: data_mod.Dataset | None = None,
    data_dir=None,
    offline: bool = False,
    progress: Progress | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Train `config` with `stage` and return the run record. Loads the dataset when not given."""
    stage_cls = get_stage(stage)
    if data is None:
        data = data_mod.load(config.dataset, data_dir=data_dir, offline=offline,
                             log=log or data_mod.print_to_stderr)
    return run_stage(stage_cls, config, data, progress)


def run_stage(stage_cls: type[Stage], config: TrainConfig, data: data_mod.Dataset,
              progress: Progress | None = None) -> dict:
    """The timing protocol around any `Stage`, a rung of the ladder or a framework peer."""
    name = stage_cls.name
    num_train = len(data.train_images)
    config.validate(num_train)
    if data.num_features != config.in_features:
        config = config.replace(in_features=data.num_features)
    num_epochs = config.num_epochs(num_train)
    full_batches = -(-num_train // config.batch)

    run_start = time.perf_counter()
    with stage_cls(config, data) as runner:
        runner.setup()
        setup_ms = (time.perf_counter() - run_start) * 1e3
        epochs = []
        unchecked_since = 0  # first epoch whose loss has not been looked at yet
        for epoch in range(num_epochs):
            num_batches = config.batches_in_epoch(epoch, num_train)
            measure = not runner.sparse_metrics or config.metrics_due(epoch, num_epochs)
            result = runner.train_epoch(epoch, num_batches, measure)
            entry = {"epoch": epoch + 1, "ms": result.ms, "batches": num_batches,
                     "full": num_batches == full_batches,
                     "train_loss": result.train_loss, "train_accuracy": result.train_accuracy,
                     "test_accuracy": None}
            if result.train_loss is not None:
                if not math.isfinite(result.train_loss):
                    where = (f"epoch {epoch + 1}" if unchecked_since == epoch
                             else f"epochs {unchecked_since + 1}-{epoch + 1}")
                    raise TrainingError(
                        f"the training loss became {result.train_loss} in {where} with {name}; "
                        f"the learning rate {config.lr} is probably too high: try a lower --lr")
                unchecked_since = epoch + 1
                entry["test_accuracy"] = runner.test_accuracy()
            epochs.append(entry)
            if progress:
                progress(epoch, num_epochs, entry)
        weights = runner.weights()
        if not all(np.isfinite(layer.w).all() for layer in weights):
            raise TrainingError(f"the weights became NaN or Inf with {name}: try a lower --lr")
        test_accuracy = epochs[-1]["test_accuracy"]
        if test_accuracy is None:
            test_accuracy = runner.test_accuracy()
        environment = {**environment_mod.host(), **runner.environment()}
        note = runner.note
    total_ms = (time.perf_counter() - run_start) * 1e3

    measured = [e["train_loss"] for e in epochs if e["train_loss"] is not None]
    return {
        "stage": name,
        "kind": stage_cls.kind,
        "note": note,
        "config": config.to_dict(),
        "environment": environment,
        "epochs": epochs,
        "epoch_ms": median_epoch_ms(epochs),
        "setup_ms": setup_ms,
        "total_ms": total_ms,
        "test_accuracy": test_accuracy,
        "train_loss": measured[-1] if measured else None,
    }
