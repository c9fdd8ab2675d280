"""`persistent`: one kernel trains the epoch; the steps never leave the GPU.

After `device-loop`, an epoch is still ~2,000 graph nodes, each a kernel launched and drained by
the GPU, each step's parameters read from and written to device memory. Here one launch of one
thread-block cluster (16 blocks, one per SM) runs every step of the epoch (kernels/persistent.cu):
each block keeps its slice of the input features' weights in shared memory, computes partial
logits of the batch over its slice, and sends them to the block that owns each row; the owners
compute softmax and dlogits and send those to every block, and each block updates its own slice.
A step is two cluster barriers and two small exchanges through distributed shared memory; the
next batch is copied in while the current one trains. fp32 throughout; sums in a fixed order, so
the same seed gives the same weights bit for bit.

Softmax regression only (a model with hidden layers is refused before training, with the
reason), on a GPU with thread-block clusters (compute capability 9.0: Hopper and later).
"""

from __future__ import annotations

import numpy as np

from graphtrain.errors import ModelUnsupported
from graphtrain.kernels.persistent import Persistent, Shape
from graphtrain.libs import cuda
from graphtrain.stages.device_loop import DeviceLoopStage


class PersistentStage(DeviceLoopStage):
    name = "persistent"
    summary = "one kernel trains the epoch: a thread-block cluster, weights in shared memory"
    precisions = ("fp32",)

    def setup(self) -> None:
        cfg, features = self.config, self.data.train_images.shape[1]
        if cfg.hidden:
            raise ModelUnsupported(f"the persistent rung trains softmax regression (no hidden layers), not the "
                             f"{'-'.join(map(str, cfg.dims))} MLP; use --stage device-loop or an earlier rung")
        self.shape = Shape(features, cfg.classes, cfg.batch)
        refusal = self.shape.refusal()
        if refusal is not None:
            raise ModelUnsupported(f"the persistent rung cannot train {refusal}; use --stage device-loop")
        device = cuda.open_device()
        if device.compute_capability < (9, 0):
            raise ModelUnsupported(f"the persistent rung needs thread-block clusters (compute capability 9.0), "
                             f"and {device.name} has {'.'.join(map(str, device.compute_capability))}")
        super().setup()

    def reserve_extra(self, arena) -> None:
        super().reserve_extra(arena)
        # The training images again, each row padded to whole 16-byte copies per block.
        self.padded_images = arena.reserve("padded_images", (self.num_train, self.shape.padded_features))

    def setup_extra(self) -> None:
        super().setup_extra()
        self.persistent_cu = Persistent(self.device, self.shape)
        padded = np.zeros((self.num_train, self.shape.padded_features), np.float32)
        padded[:, :self.config.in_features] = self.data.train_images
        self.padded_images.upload(padded, self.stream)

    def warm_up(self) -> None:
        self.launch_epoch(0, 1, measure=True)

    def capture(self) -> None:
        """Nothing to capture: an epoch is one launch."""

    def launch_epoch(self, epoch: int, num_steps: int, measure: bool) -> None:
        cfg = self.config
        self.persistent_cu.train_epoch(self.stream, self.padded_images.ptr, self.train_labels.ptr,
                                       self.order.at(epoch * self.num_train), self.w[0].ptr,
                                       self.b[0].ptr if cfg.bias else 0, self.num_train, num_steps, cfg.lr,
                                       self.metrics.ptr, measure)

    def run_batches(self, epoch: int, num_batches: int, measure: bool) -> None:
        self.launch_epoch(epoch, num_batches, measure)

    def environment(self) -> dict:
        env = super().environment()
        env.pop("device_loop")  # no graph here: one kernel per epoch
        return env

    def close(self) -> None:
        if getattr(self, "persistent_cu", None) is not None:
            self.persistent_cu.close()
        super().close()
