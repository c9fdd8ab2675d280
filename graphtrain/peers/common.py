"""What every peer shares.

A peer is a `Stage` (setup, train_epoch, test_accuracy, weights, environment, close), so
`training.run_stage` times it exactly as it times the rungs: setup apart, each epoch timed on
the GPU, the median over the second half of the epochs, total wall time from the start of setup
to the last test accuracy.
"""

from __future__ import annotations

from graphtrain.stages.base import Stage

WARMUP_STEPS = 3  # per batch shape; enough for lazy init, autotuning and CUDA-graph recording


class Peer(Stage):
    @classmethod
    def check_available(cls) -> int | None:
        """Each framework checks its own GPU (the subclasses); graphtrain's CUDA is not needed."""
        return None
