"""Launcher for persistent_mlp.cu: an MLP trained by one thread-block cluster, one launch an epoch.

The kernel is compiled for the model's sizes and the batch (its loops unroll over the units a block
owns, the batch's rows and the inputs' tiles), so a `PersistentMlp` is made per workload, and
`MlpShape.refusal` says beforehand why one cannot be.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphtrain.kernels import F32, I32, PTR, KernelFile, ceil_div, kernel
from graphtrain.kernels.persistent import (CLUSTER, ELEMENT_BYTES, MAX_CLASSES, MAX_SHARED_BYTES, Layout, Region,
                                           probe_defines)

THREADS = 256  # per block
UNIT_QUAD = 4 * CLUSTER  # a hidden size is whole float4 quads of units in every block
# The probe build's phases (probes.cuh; scripts/probes/persistent_mlp_phases.py) in step order, each counted
# per layer (0: none), the cycles from the probe before to its own: (name in the kernel, meaning).
PHASES = tuple(tuple(line.split(None, 1)) for line in """
START_WAIT         start: the last step's copies landed
START_EXPECT       start: barrier, expected bytes
START_IMAGES       start: float images' copies issued
PRODUCTS           forward: products
FINISH             forward: sums, bias, ReLU
FENCE_SYNC         forward: proxy fence, barrier
SENDS              forward: bulk sends issued
EXCHANGE           forward: wait for the gather (layer 1: and the copies ahead)
HEAD_PRODUCT       head: partial logits, sent to the rows' owners
HEAD_WAIT          head: wait for the owned rows' partial logits
SOFTMAX_EXP        softmax: logits, exp, sums (thread 0)
SOFTMAX_ROWS       softmax: dlogits sent, loss (thread 0)
SOFTMAX            softmax: the block's other warps
SOFTMAX_WAIT       softmax: wait for every row's dlogits
HEAD_TILES         head gradient: tiles (thread 0)
HEAD_TILES_SYNC    head gradient: the other warps
HEAD_GRADIENT      head gradient: update of W_h
BACKWARD_PRODUCTS  backward: products, sends, update (thread 0)
GATHER_GRADIENT    backward: the other warps' wait for the inbox and input gradient sums
UPDATE             update of W_1
""".strip().splitlines())


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
    def strides(self) -> dict[str, int]:
        """Floats per row of persistent_mlp.cu's weights and input gradients:
          WST  a row of wt[k][u] (the units a block owns, k-major): S in mma columns of 8, zero past S;
          DST  a row of dh: WST, or 4 more where WST ≡ 16 (mod 32), so that a fragment's loads (row
               g, column t) fall on 32 banks, not 8."""
        wst = 8 * ceil_div(self.units, 8)
        return {"WST": wst, "DST": wst + 4 if wst % 32 == 16 else wst}

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
        return staged if self.layout_with(staged).bytes <= MAX_SHARED_BYTES else 0

    @property
    def layout(self) -> Layout:
        return self.layout_with(self.x_stride)

    @property
    def shared_bytes(self) -> int:
        return self.layout.bytes

    def layout_with(self, x_stride: int, probe_counts: int = 0) -> Layout:
        """persistent_mlp.cu's shared memory with `x_stride` inputs a staged image row (0: none
        staged) and `probe_counts` int64 phase counts (a probe build's); its struct Smem says what
        each region holds. Where two buffers' lives do not overlap they share a region (why that is
        safe: docs/persistent-mlp.md): the partial logits' inbox and dh_1's inbox (three layers or more), and dh_L's
        inbox and the forward's partial sums."""
        h, s, b, layers = self.hidden[0], self.units, self.batch, self.layers
        cs, wst, dst = ceil_div(self.classes, 4) * 4, self.strides["WST"], self.strides["DST"]
        rows16 = ceil_div(b, 16) * 16
        barriers = 2 * (layers - 1) + 3  # the exchanges', the images'
        # The bf16 build keeps W_1 in registers, and the gathered activations and input gradients'
        # pieces (h_full, the inboxes) as bf16.
        exchanged = "unsigned short" if self.bf16 else "float"
        inbox = CLUSTER * b * s * ELEMENT_BYTES[exchanged] // 4  # floats
        partial, zin = THREADS // 32 * rows16 * wst, CLUSTER * ceil_div(b, CLUSTER) * cs
        pixel = {2: "unsigned short", 1: "unsigned char", 4: "float"}[self.pixel_bytes]
        x_bytes = (self.x_buffers if x_stride else 1) * b * x_stride * self.pixel_bytes
        regions = [
            Region("bars", "unsigned long long", ceil_div(barriers, 2) * 2),
            Region("totals", "double", 2 + 2 * THREADS // 32),
            Region("w1", "float", 0 if self.bf16 else self.padded_features * wst),
            Region("w", "float", (layers - 1) * h * wst),
            Region("wh", "float", cs * s),
            Region("b", "float", layers * s),
            Region("bh", "float", cs),
            Region("h_full", exchanged, (layers - 1) * b * h),
            Region("zin", "float", max(zin, inbox if layers >= 3 else 0)),
            Region("inbox_mid", "float", max(layers - 3, 0) * inbox),
            Region("last", "float", max(inbox if layers >= 2 else 0, partial)),
            Region("h_own", "float", layers * b * s),
            Region("dh", "float", 2 * rows16 * dst),
            Region("dl", "float", b * cs),
            Region("gwh", "float", cs * s + cs),
            Region("x", pixel, ceil_div(x_bytes, 16) * 16 // self.pixel_bytes, 16),  # whole 16-byte pieces
            Region("order", "int", 3 * b),
            Region("labels", "int", 2 * b),
        ]
        if probe_counts:
            regions.append(Region("probe_counts", "long long", probe_counts))
        return Layout(regions)

    @property
    def defines(self) -> dict[str, int]:
        """The -D defines persistent_mlp.cu is compiled with for this shape."""
        return {"FEATURES": self.features, "FEATURE_STRIDE": self.padded_features, "HIDDEN": self.hidden[0],
                "LAYERS": self.layers, "CLASSES": self.classes, "BATCH": self.batch, "X_STRIDE": self.x_stride,
                "PIXEL_LEVELS": self.pixel_levels, "BF16": int(self.bf16), **self.strides, **self.layout.defines}

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
    headers = ("cluster.cuh", "async_copy.cuh", "smem_layout.cuh", "probes.cuh", "tf32_mma.cuh", "bf16_mma.cuh", "logits_loss.cuh",
               "persistent_mlp_shape.cuh", "persistent_mlp_products.cuh")
    # The class's defines compile the file for the cuda-mnist preset at H = 256 (the CPU tests); a
    # stage passes its own.
    defines = {"CLUSTER": CLUSTER, "THREADS": THREADS, **MlpShape(784, (256,) * 3, 10, 32, 255, bf16=True).defines}
    _mlp_epoch = kernel("mlp_epoch", PTR, PTR, PTR, PTR, I32, I32, I32, F32, PTR, I32,
                        cluster=(CLUSTER, 1, 1), max_shared_bytes=MAX_SHARED_BYTES)

    def __init__(self, device, shape: MlpShape, probes: bool = False):
        """`probes`: the probe build (probes.cuh), which counts the SM cycles of each phase and layer
        of the steps (thread 0 of block 0) and writes them, PHASES × (layers + 1) int64 summed over
        the launch's steps, where train_epoch's `metrics` points (and is never to measure)."""
        self.shape, self.layout = shape, self.build_layout(shape, probes)
        super().__init__(device, self.build_defines(shape, probes))

    @staticmethod
    def build_layout(shape: MlpShape, probes: bool = False) -> Layout:
        """The kernel's shared memory for `shape`; the probe build's holds its phase counts too."""
        return shape.layout_with(shape.x_stride, probe_counts=len(PHASES) * (shape.layers + 1) if probes else 0)

    @classmethod
    def build_defines(cls, shape: MlpShape, probes: bool = False) -> dict[str, int]:
        """The -D defines of the kernel for `shape`, with its probes or without."""
        if not probes:
            return shape.defines
        return {**shape.defines, **cls.build_layout(shape, True).defines, **probe_defines(name for name, _ in PHASES),
                "PROBE_PHASES": len(PHASES), "PROBE_LAYERS": shape.layers + 1}

    def train_epoch(self, stream, images: int, labels: int, order: int, params: int, bias: bool,
                    num_samples: int, num_steps: int, lr: float, metrics: int, measure: bool) -> None:
        """`num_steps` SGD steps of the shape's batch over samples order[0:num_samples] (the last
        batch may be shorter). `params`: a device array of 2·(layers + 1) addresses, the weights
        (fan_out × fan_in) of each layer, the head's last, then their biases (unread without a
        bias), all updated in place; metrics += (Σ loss, #correct) when measuring. `images`:
        num_samples × padded_features as `shape.image_dtype` (persistent.kernel_images)."""
        self._mlp_epoch(stream, CLUSTER, THREADS, images, labels, order, params, int(bias), num_samples,
                        num_steps, lr, metrics, measure, shared_bytes=self.layout.bytes)
