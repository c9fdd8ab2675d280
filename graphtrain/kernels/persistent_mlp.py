"""Launcher for persistent_mlp.cu: an MLP trained by one thread-block cluster, one launch an epoch.

The kernel is compiled for the model's sizes and the batch (its loops unroll over the units a block
owns, the batch's rows and the inputs' tiles), so a `PersistentMlp` is made per workload, and
`MlpShape.refusal` says beforehand why one cannot be.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphtrain.kernels import F32, I32, PTR, KernelFile, ceil_div, kernel
from graphtrain.kernels.persistent import CLUSTER, MAX_CLASSES, MAX_SHARED_BYTES

THREADS = 256  # per block
UNIT_QUAD = 4 * CLUSTER  # a hidden size is whole float4 quads of units in every block
PHASE_SLOTS = 24  # persistent_mlp.cu's rows of phase counts, carved after the rest in PHASE_CYCLES builds


@dataclass(frozen=True)
class MlpShape:
    """The sizes a kernel is compiled for, the batch's included."""

    features: int
    hidden: tuple[int, ...]
    classes: int
    batch: int
    pixel_levels: int = 0  # 255: 8-bit pixels k/255, which the kernel reads as k (persistent.pixel_levels)
    bf16: bool = False  # the hidden layers' products from bf16 operands in one pass, else three TF32 passes

    @property
    def padded_features(self) -> int:
        """Inputs per image row as the kernel reads them: whole tiles of 16 (its mma tiles of inputs)."""
        return ceil_div(self.features, 16) * 16

    @property
    def layers(self) -> int:
        return len(self.hidden)

    @property
    def units(self) -> int:
        """Units of each hidden layer a block owns (rounded up, for the size of a shape refused)."""
        return ceil_div(self.hidden[0], CLUSTER)

    @property
    def image_dtype(self) -> type:
        """The images as the kernel reads them: bf16 (its 16 bits) for the bf16 products, else bytes
        k for 8-bit pixels, else floats."""
        return np.uint16 if self.bf16 else np.uint8 if self.pixel_levels else np.float32

    @property
    def pixel_bytes(self) -> int:
        return np.dtype(self.image_dtype).itemsize

    @property
    def x_buffers(self) -> int:
        """Buffers of staged images: one for floats (copied at the step's start) and for bf16 (the
        kernel keeps them in registers once read, so the next step's are copied in while this one
        trains); two for bytes, which W_1's update reads again."""
        return 2 if self.pixel_bytes == 1 else 1

    @property
    def x_stride(self) -> int:
        """Inputs per row of the images kept in shared memory (a row padded to ≡ 64 bytes mod 128
        for floats, ≡ 16 for bytes, and for bf16 to an odd number of 16-byte pieces, the rows of an
        ldmatrix: so that a load phase's rows lie on different banks), or 0 where they do not fit
        (they are read from global memory instead)."""
        row = self.padded_features * self.pixel_bytes
        if self.bf16:
            staged = (row + 16 * (row // 16 % 2 == 0)) // 2
        else:
            want = {4: 64, 1: 16}[self.pixel_bytes]
            staged = (row + (want - row) % 128) // self.pixel_bytes
        return staged if self.bytes_with(staged) <= MAX_SHARED_BYTES else 0

    @property
    def shared_bytes(self) -> int:
        return self.bytes_with(self.x_stride)

    def bytes_with(self, x_stride: int) -> int:
        """persistent_mlp.cu's `carve`, in bytes: mbarriers, totals (double), floats (the staged
        images among them), then ints."""
        h, s, b, layers = self.hidden[0], self.units, self.batch, self.layers
        cs = ceil_div(self.classes, 4) * 4
        n_tiles = ceil_div(s, 8)
        w_stride, rows16 = 8 * n_tiles, ceil_div(b, 16) * 16
        dh_stride = w_stride + 4 if w_stride % 32 == 16 else w_stride
        x_buffers = self.x_buffers if x_stride else 1
        barriers = 2 * (layers - 1) + 3  # the exchanges', the images'
        # The bf16 build keeps W_1 in registers, and the gathered activations and input gradients'
        # pieces (h_full, the inboxes) as bf16: half a float each.
        w1, exchanged = (0, 2) if self.bf16 else (self.padded_features * w_stride, 4)
        inbox, partial, zin = CLUSTER * b * s * exchanged // 4, THREADS // 32 * rows16 * w_stride, CLUSTER * ceil_div(b, CLUSTER) * cs
        floats = (w1 + (layers - 1) * h * w_stride + cs * s + layers * s + cs
                  + (layers - 1) * b * h * exchanged // 4 + max(zin, inbox if layers >= 3 else 0)
                  + max(layers - 3, 0) * inbox + max(inbox if layers >= 2 else 0, partial)
                  + layers * b * s + 2 * rows16 * dh_stride + b * cs + cs * s + cs
                  + ceil_div(x_buffers * b * x_stride * self.pixel_bytes, 16) * 4)
        return 8 * ceil_div(barriers, 2) * 2 + 8 * (2 + 2 * THREADS // 32) + 4 * floats + 4 * 5 * b

    @property
    def defines(self) -> dict[str, int]:
        """The -D defines persistent_mlp.cu is compiled with for this shape."""
        return {"FEATURES": self.features, "FEATURE_STRIDE": self.padded_features, "HIDDEN": self.hidden[0],
                "LAYERS": self.layers, "CLASSES": self.classes, "BATCH": self.batch, "X_STRIDE": self.x_stride,
                "PIXEL_LEVELS": self.pixel_levels, "BF16": int(self.bf16)}

    def refusal(self) -> str | None:
        """Why the kernel cannot train this shape, or None."""
        dims = "-".join(map(str, (self.features, *self.hidden, self.classes)))
        if self.classes > MAX_CLASSES:
            return f"{self.classes} classes (at most {MAX_CLASSES}: a row's classes are one warp's lanes)"
        if len(set(self.hidden)) > 1:
            return f"the {dims} MLP: its hidden layers must all have the same size"
        if self.shared_bytes > MAX_SHARED_BYTES:
            return (f"the {dims} MLP at batch {self.batch}: a block needs {self.shared_bytes} bytes of shared "
                    f"memory (at most {MAX_SHARED_BYTES})")
        if self.hidden[0] % UNIT_QUAD:
            return (f"the {dims} MLP: a hidden size must be a multiple of {UNIT_QUAD} ({CLUSTER} blocks, "
                    f"each owning whole quads of 4 units)")
        return None


class PersistentMlp(KernelFile):
    stem = "persistent_mlp"
    min_arch = 90  # thread-block clusters and distributed shared memory
    headers = ("cluster.cuh", "tf32_mma.cuh", "bf16_mma.cuh", "warp_softmax.cuh")
    # The class's defines compile the file for the cuda-mnist preset at H = 256 (the CPU tests); a
    # stage passes its own.
    defines = {"CLUSTER": CLUSTER, "THREADS": THREADS, **MlpShape(784, (256,) * 3, 10, 32, 255, bf16=True).defines,
               "PHASE_CYCLES": 0}
    _mlp_epoch = kernel("mlp_epoch", PTR, PTR, PTR, PTR, I32, I32, I32, F32, PTR, I32,
                        cluster=(CLUSTER, 1, 1), max_shared_bytes=MAX_SHARED_BYTES)

    def __init__(self, device, shape: MlpShape):
        self.shape = shape
        super().__init__(device, shape.defines)

    def train_epoch(self, stream, images: int, labels: int, order: int, params: int, bias: bool,
                    num_samples: int, num_steps: int, lr: float, metrics: int, measure: bool) -> None:
        """`num_steps` SGD steps of the shape's batch over samples order[0:num_samples] (the last
        batch may be shorter). `params`: a device array of 2·(layers + 1) addresses, the weights
        (fan_out × fan_in) of each layer, the head's last, then their biases (unread without a
        bias), all updated in place; metrics += (Σ loss, #correct) when measuring. `images`:
        num_samples × padded_features as `shape.image_dtype` (persistent.kernel_images)."""
        shared_bytes = self.shape.shared_bytes
        if self.defines["PHASE_CYCLES"]:  # the phase counts (scripts/persistent_mlp_phases.py), 8-byte aligned
            shared_bytes += 8 + 8 * PHASE_SLOTS * (self.shape.layers + 1)
        self._mlp_epoch(stream, CLUSTER, THREADS, images, labels, order, params, int(bias), num_samples,
                        num_steps, lr, metrics, measure, shared_bytes=shared_bytes)
