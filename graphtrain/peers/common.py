"""What every peer shares: the run driver and the run record.

A peer is a `Stage` (setup, train_epoch, test_accuracy, weights, environment, close), so the
driver below is the same loop as `training.train`: setup is timed apart, each epoch times
itself on the GPU, the median over the second half of the epochs is reported, and the total
wall time covers everything from the start of setup to the last test accuracy.
"""

from __future__ import annotations

import math
import sys
import time

from graphtrain.config import TrainConfig
from graphtrain.errors import TrainingError
from graphtrain.stages.base import Stage
from graphtrain.training import host_environment, median_epoch_ms

WARMUP_STEPS = 3  # per batch shape; enough for lazy init, autotuning and CUDA-graph recording


class Peer(Stage):
    uses_gpu = True
    note: str = ""  # what sets this peer apart (precision, compile mode), shown in the reports


def driver_version() -> str | None:
    """The NVIDIA driver's version, when it can be read."""
    try:
        from graphtrain.libs.cuda import nvidia_driver_version
    except ImportError:
        return None
    return nvidia_driver_version()


def drive(peer_cls: type[Peer], config: TrainConfig, data, progress=None) -> dict:
    """Run one peer over `config` and return its run record (see `graphtrain.training.train`)."""
    num_train = len(data.train_images)
    config.validate(num_train)
    if data.num_features != config.in_features:
        config = config.replace(in_features=data.num_features)
    num_epochs = config.num_epochs(num_train)
    full_batches = -(-num_train // config.batch)

    run_start = time.perf_counter()
    with peer_cls(config, data) as peer:
        peer.setup()
        setup_ms = (time.perf_counter() - run_start) * 1e3
        epochs = []
        for epoch in range(num_epochs):
            num_batches = config.batches_in_epoch(epoch, num_train)
            result = peer.train_epoch(epoch, num_batches, True)
            if not math.isfinite(result.train_loss):
                raise TrainingError(
                    f"the training loss became {result.train_loss} in epoch {epoch + 1} with peer "
                    f"{peer_cls.name}; the learning rate {config.lr} is probably too high: try a lower --lr")
            entry = {"epoch": epoch + 1, "ms": result.ms, "batches": num_batches,
                     "full": num_batches == full_batches,
                     "train_loss": result.train_loss, "train_accuracy": result.train_accuracy,
                     "test_accuracy": peer.test_accuracy()}
            epochs.append(entry)
            if progress:
                progress(epoch, num_epochs, entry)
        environment = {**host_environment(), **peer.environment()}
        note = peer.note
    total_ms = (time.perf_counter() - run_start) * 1e3

    return {
        "stage": peer_cls.name,
        "kind": "peer",
        "note": note,
        "config": config.to_dict(),
        "environment": environment,
        "epochs": epochs,
        "epoch_ms": median_epoch_ms(epochs),
        "setup_ms": setup_ms,
        "total_ms": total_ms,
        "test_accuracy": epochs[-1]["test_accuracy"],
        "train_loss": epochs[-1]["train_loss"],
        "command": " ".join(["graphtrain", *sys.argv[1:]]) if sys.argv else None,
    }
