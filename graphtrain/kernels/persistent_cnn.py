"""Launcher for persistent_cnn.cu: the cnn trained by a cooperative grid of one block per SM, one
launch an epoch, and its test accuracy by a second launch of the same grid.

The kernel is compiled for the model's sizes, the batch, the number of blocks and the products'
passes, so a `PersistentCnn` is made per workload, and `CnnShape.refusal` says beforehand why one
cannot be. Its shared memory and its global workspace are each laid out by one table
(`CnnShape.layout`, `CnnShape.workspace`), which both the launcher and the kernel's -D defines come
from.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphtrain.kernels import I32, PTR, KernelFile, ceil_div, kernel
from graphtrain.kernels.optim import CONSTANTS, layout_defines
from graphtrain.kernels.persistent import MAX_CLASSES, MAX_SHARED_BYTES, Layout, Region, probe_defines
from graphtrain.libs import cuda

THREADS = 256  # per block: eight warps, one m16n8 piece of a product's 32 × 32 tile each
TILE = 32  # a product's tile of outputs a side (persistent_cnn.cu: one m16n8 piece a warp)
KC = 32  # the k-values of a tile's operands staged at a time: fc1's 800 inputs in 25 chunks
# The chunks of a tile's operands in flight in registers (persistent_cnn.cu's tile_product): 4 of 32
# take 32 registers a thread (the speedrun's epoch build: 255 and 12 bytes of spill, its time the
# fastest measured; 5 spill none but ran 3.6% slower, 6 spill 12–24 bytes beside phase 4's preloaded
# optimizer state, and chunks of 64 k-values spill)
PREFETCH = 4
# fc1's inputs split over up to this many blocks a tile where the grid has blocks to spare (phase 2:
# the speedrun's 64 tiles of 800 inputs leave 68 of 132 blocks idle), the parts added by phase 3
MAX_FC1_PARTS = 4
ASSUMED_SMS = 132  # an H100 SXM's, for shapes made without a GPU (the CPU tests)
PASSES = {"tf32": 1, "fp32": 3}  # the products' tensor-core passes for each precision
# Phase 5's conv 2 input gradient on the tensor cores in one pass (TC_INPUT_GRADIENT; False: fp32 FMAs,
# for an A/B with scripts/probes/variant.py)
TC_INPUT_GRADIENT = True
# Phase 5's conv 2 weight gradient on the tensor cores in one pass (TC_WEIGHT_GRADIENT; False: fp32 FMAs)
TC_WEIGHT_GRADIENT = True
WARPS = THREADS // 32
# The probe build's phases (probes.cuh; scripts/probes/persistent_cnn_phases.py) in step order, the
# cycles from the probe before to its own: (name in the kernel, meaning).
PHASES = tuple(tuple(line.split(None, 1)) for line in """
CONV_PARAMS           1a: the conv parameters staged (one pass: their B fragments too, after a launch's first step copied as phase 6 wrote them), the gradient sums zeroed
IMAGES                1b: the block's samples' images staged
CONV1                 1c: their conv 1 + pool + ReLU
CONVS_FORWARD         1d: their conv 2 + pool + ReLU, a2 published
WAIT_CONVS_FORWARD    grid barrier after 1: a2 of every sample
FC1                   2: fc1's sums a2·W1ᵀ over each part of its inputs, the block's tiles
WAIT_FC1              grid barrier after 2: the parts' sums
HEAD                  3: h = relu(the parts + b1), logits, softmax, dz and dh, a warp a row
WAIT_HEAD             grid barrier after 3: dz, dh
DW1                   4a: dW1 = dhᵀ·a2, the block's tiles, and W1's update
DA2                   4b: da2 = dh·W1, the block's tiles
HEAD_UPDATE           4c: W2, b2 and b1's gradients and updates (the last blocks': block 0's where it has no extra tile)
WAIT_LINEAR_BACKWARD  grid barrier after 4: da2, the linear layers updated
BACKWARD_MAPS         5a: the block's samples' pooled gradients loaded (their maps too where phase 1 kept none), dp2 scattered into conv 2's output gradient
CONV2_GRADS           5b: their conv 2 weight and bias gradients
POOL1_GRADIENT        5c: their conv 2 input gradients dp1
CONV1_GRADS           5d: their conv 1 weight and bias gradients
CONVS_BACKWARD        5e: the block's conv gradient sums published
WAIT_CONVS_BACKWARD   grid barrier after 5: every block's sums
CONV_UPDATE           6: the conv gradients summed over the blocks, the conv parameters' update
WAIT_CONV_UPDATE      grid barrier after 6: the conv parameters updated
""".strip().splitlines())


@dataclass(frozen=True)
class CnnShape:
    """The sizes the kernel is compiled for: the model's (square 1-channel images of side `image`,
    conv 1 of c1 maps k1×k1, conv 2 of c2 maps k2×k2, each followed by a 2×2 max-pool and a ReLU,
    one hidden linear layer, the logits), the batch's, the products' passes, and the grid's."""

    image: int
    c1: int
    k1: int
    c2: int
    k2: int
    hidden: int
    classes: int
    batch: int
    passes: int = 1
    blocks: int = ASSUMED_SMS
    kc: int = KC  # the k-values of a product's operands staged at a time
    prefetch: int = PREFETCH  # the chunks of kc in flight
    # phase 1 keeps the maps phase 5 reads of up to this many of a block's samples in shared memory
    # (None: as many as fit; fewer for a test of the workspace's path)
    kept_at_most: int | None = None

    kernel_name = "grid"  # as a run's record names the persistent kernel that trained it

    @classmethod
    def of(cls, spec, batch: int, precision: str, blocks: int = ASSUMED_SMS) -> CnnShape:
        """The shape of a cnn spec (graphtrain.reference_cnn.CnnSpec) that `problems_of(spec)` passes."""
        (first, second), (hidden,) = spec.convs, spec.hidden
        return cls(spec.height, first.out_channels, first.kernel, second.out_channels, second.kernel, hidden,
                   spec.classes, batch, PASSES.get(precision, 1), blocks, KC, PREFETCH)

    @property
    def conv1_side(self) -> int:
        return self.image - self.k1 + 1

    @property
    def pooled1(self) -> int:
        return self.conv1_side // 2

    @property
    def conv2_side(self) -> int:
        return self.pooled1 - self.k2 + 1

    @property
    def pooled2(self) -> int:
        return self.conv2_side // 2

    @property
    def a1(self) -> int:
        return self.c1 * self.pooled1 ** 2

    @property
    def flat(self) -> int:
        return self.c2 * self.pooled2 ** 2

    @property
    def staged_floats(self) -> int:
        """A product's staged operand tile (persistent_cnn.cu's STAGE_FLOATS): TILE rows of kc + 4
        values, or kc rows of TILE + 8, whichever is larger; ta and tb hold two each."""
        return max(TILE * (self.kc + 4), self.kc * (TILE + 8))

    @property
    def fc1_parts(self) -> int:
        """Phase 2's parts of fc1's inputs (persistent_cnn.cu's FC1_PARTS): as many as keep every
        part's tiles on a block of their own, at most MAX_FC1_PARTS (the speedrun's 64 tiles: 2)."""
        tiles = ceil_div(self.batch, TILE) * ceil_div(self.hidden, TILE)
        parts = max(1, min(MAX_FC1_PARTS, self.blocks // tiles))
        while parts > 1 and (parts - 1) * self.fc1_part(parts) >= self.flat:  # every part some inputs
            parts -= 1
        return parts

    def fc1_part(self, parts: int) -> int:
        """The inputs of each of fc1's `parts` parts but the last: whole k-steps of 8 (FC1_PART)."""
        return ceil_div(ceil_div(self.flat, parts), 8) * 8

    @property
    def conv_params(self) -> int:
        return self.c1 * self.k1 ** 2 + self.c1 + self.c2 * self.c1 * self.k2 ** 2 + self.c2

    @property
    def conv_fragments(self) -> int:
        """The B fragments (k-step, n-tile) of phase 1's convolutions on the tensor cores (one pass):
        conv 1's ⌈k1²/8⌉ k-steps, conv 2's k2²·⌈c1/8⌉, each over n-tiles of 8 output maps."""
        groups = ceil_div(self.c1, 8)  # conv 1's n-tiles, conv 2's channel groups
        return ceil_div(self.k1 ** 2, 8) * groups + self.k2 ** 2 * groups * ceil_div(self.c2, 8)

    @property
    def work_map_stride(self) -> int:
        """Phase 5's zero-bordered conv 2 output gradient: a map's words (persistent_cnn.cu's WPS),
        (conv2_side + 2·(k2 − 1))² rounded up to ≡ 8 (mod 32), so that its mma's A loads of 4 maps
        at 8 positions fall on 32 banks."""
        plane = (self.conv2_side + 2 * (self.k2 - 1)) ** 2
        return plane + (40 - plane % 32) % 32

    @property
    def num_params(self) -> int:
        return self.conv_params + self.hidden * self.flat + self.hidden + self.classes * self.hidden + self.classes

    @property
    def layout(self) -> Layout:
        """persistent_cnn.cu's shared memory (its struct Smem says what each region holds)."""
        return self.layout_with()

    @property
    def kept_samples(self) -> int:
        """The block's samples whose image, a1 and pool 1's argmaxes phase 1 keeps in shared memory for
        phase 5 (persistent_cnn.cu's KEPT), the others reloaded from the workspace: all ⌈batch /
        blocks⌉ of them where they fit beside the rest (the probe build's counts too), else fewer (at most
        kept_at_most)."""
        most = ceil_div(self.batch, self.blocks)
        for kept in range(most if self.kept_at_most is None else min(most, self.kept_at_most), 0, -1):
            if self.layout_with(len(PHASES), kept).bytes <= MAX_SHARED_BYTES:
                return kept
        return 0

    def layout_with(self, probe_counts: int = 0, kept: int | None = None) -> Layout:
        """The shared memory with `probe_counts` int64 phase counts at its end (the probe build's), and
        `kept` samples' maps (None: kept_samples)."""
        kept = self.kept_samples if kept is None else kept
        probes = [Region("probe_counts", "long long", probe_counts)] if probe_counts else []
        maps = [Region("kept_x", "float", kept * self.image ** 2, 16), Region("kept_a1", "float", kept * self.a1, 16),
                Region("kept_arg1", "unsigned char", kept * self.a1, 16)] if kept else []
        return Layout([
            Region("totals", "double", 2 * WARPS),
            Region("conv", "float", self.conv_params, 16),
            Region("grad", "float", self.conv_params, 16),
            Region("x", "float", self.image ** 2, 16),
            Region("a1", "float", self.a1, 16),
            # conv 2's output gradient (phase 5); in one pass work and dp1 together also hold phase 1's
            # B fragments, 64 floats each (both phase 5's, free in phase 1)
            Region("work", "float", max(self.c2 * self.work_map_stride,
                                        64 * self.conv_fragments - self.a1 if self.passes == 1 else 0), 16),
            Region("dp1", "float", self.a1, 16),
            Region("dp2", "float", self.flat, 16),
            Region("arg1", "unsigned char", self.a1, 16),
            Region("arg2", "unsigned char", self.flat, 16),
            Region("ta", "float", 2 * self.staged_floats, 16),
            Region("tb", "float", 2 * self.staged_floats, 16),
            *maps,
            *probes,
        ])

    @property
    def shared_bytes(self) -> int:
        return self.layout.bytes

    @property
    def workspace(self) -> Layout:
        """The kernel's global scratch (its struct Workspace), each region on a 256-byte boundary."""
        batch = self.batch
        return Layout([
            Region("barrier", "unsigned long long", 1, 256),
            Region("block_metrics", "double", 2 * self.blocks, 256),
            Region("w1_other", "float", self.hidden * self.flat, 256),
            Region("a1", "float", batch * self.a1, 256),
            Region("arg1", "unsigned char", batch * self.a1, 256),
            Region("arg2", "unsigned char", batch * self.flat, 256),
            Region("a2", "float", batch * self.flat, 256),
            Region("h_parts", "float", self.fc1_parts * batch * self.hidden, 256),
            Region("h", "float", batch * self.hidden, 256),
            Region("dh", "float", batch * self.hidden, 256),
            Region("dz", "float", batch * self.classes, 256),
            Region("da2", "float", batch * self.flat, 256),
            Region("conv_part", "float", self.blocks * self.conv_params, 256),
            Region("conv_frags", "float", 64 * self.conv_fragments if self.passes == 1 else 0, 256),
        ])

    @property
    def defines(self) -> dict[str, int]:
        """The -D defines persistent_cnn.cu is compiled with for this shape."""
        return {"BLOCKS": self.blocks, "THREADS": THREADS, "IMG": self.image, "C1": self.c1, "K1": self.k1,
                "C2": self.c2, "K2": self.k2, "HIDDEN": self.hidden, "CLASSES": self.classes, "BATCH": self.batch,
                "PASSES": self.passes, "TC_INPUT_GRADIENT": int(self.passes == 1 and TC_INPUT_GRADIENT),
                "TC_WEIGHT_GRADIENT": int(self.passes == 1 and TC_WEIGHT_GRADIENT), "TILE": TILE, "KC": self.kc,
                "PREFETCH": self.prefetch, "FC1_PARTS": self.fc1_parts, "KEPT": self.kept_samples,
                **self.layout.defines, **layout_defines(CONSTANTS),
                **{f"WS_{name.upper()}": offset for name, offset in self.workspace.offsets.items()}}

    def refusal(self) -> str | None:
        """Why the kernel cannot train this shape, or None."""
        if self.classes > MAX_CLASSES:
            return f"{self.classes} classes (at most {MAX_CLASSES}: a row's classes are one warp's lanes)"
        if self.conv1_side < 2 or self.conv2_side < 2 or self.conv1_side % 2 or self.conv2_side % 2:
            return (f"conv outputs of {self.conv1_side} and {self.conv2_side} pixels a side: the grid kernel's "
                    "2×2 pools take even sides only")
        if self.shared_bytes > MAX_SHARED_BYTES:
            return f"a block needs {self.shared_bytes} bytes of shared memory (at most {MAX_SHARED_BYTES})"
        if self.workspace.bytes >= 2**31:
            return f"a workspace of {self.workspace.bytes} bytes (the kernel's offsets are 32-bit)"
        return None


def problems_of(spec) -> list[str]:
    """Why the grid kernel cannot hold a cnn spec's layers (empty: it can, its sizes then checked by
    CnnShape.refusal): the speedrun's kind of model only."""
    problems = []
    if spec.channels != 1 or spec.height != spec.width:
        problems.append(f"{spec.channels}-channel {spec.height}×{spec.width} images (one channel, square only)")
    if len(spec.convs) != 2:
        problems.append(f"{len(spec.convs)} conv layers (exactly two)")
    for i, layer in enumerate(spec.convs, 1):
        if (layer.stride, layer.padding, layer.pool) != (1, 0, 2):
            problems.append(f"conv layer {i} of stride {layer.stride}, padding {layer.padding}, pool {layer.pool} "
                            "(stride 1, no padding, a 2×2 pool only)")
    if len(spec.hidden) != 1:
        problems.append(f"{len(spec.hidden)} hidden linear layers (exactly one)")
    return problems


class PersistentCnn(KernelFile):
    stem = "persistent_cnn"
    min_arch = 80  # TF32 mma; no cluster
    headers = ("smem_layout.cuh", "probes.cuh", "grid_sync.cuh", "async_copy.cuh", "batched_loads.cuh", "tf32_mma.cuh", "logits_loss.cuh",
               "model_axis.cuh", "optim.cu")
    # The class's defines compile the file for the speedrun's cnn (the CPU tests); a stage passes its own.
    defines = CnnShape(28, 24, 5, 32, 3, 256, 10, 256).defines
    _cnn_epoch = kernel("cnn_epoch", PTR, PTR, PTR, PTR, PTR, PTR, PTR, I32, I32, I32, PTR, I32, PTR, cooperative=True,
                        max_shared_bytes=MAX_SHARED_BYTES)
    _cnn_evaluate = kernel("cnn_evaluate", PTR, PTR, I32, PTR, PTR, PTR, cooperative=True,
                           max_shared_bytes=MAX_SHARED_BYTES)

    def __init__(self, device, shape: CnnShape, probes: bool = False, probe_block: int = 0):
        """`probes`: the probe build (probes.cuh), which counts the SM cycles of each of PHASES over
        a launch's steps (thread 0 of block `probe_block`) and writes them, len(PHASES) int64, where
        train_epoch's `metrics` would go (launched with measure off)."""
        # (the table is read once, not per launch)
        self.shape, self.shared_bytes = shape, self.build_layout(shape, probes).bytes
        workspace = shape.workspace
        self.workspace_bytes, self.barrier_offset = workspace.bytes, workspace.offsets["barrier"]
        super().__init__(device, self.build_defines(shape, probes, probe_block))

    @staticmethod
    def build_layout(shape: CnnShape, probes: bool = False) -> Layout:
        """The shared memory of the kernel for `shape`, with its probes' counts or without."""
        return shape.layout_with(len(PHASES) if probes else 0)

    @classmethod
    def build_defines(cls, shape: CnnShape, probes: bool = False, probe_block: int = 0) -> dict[str, int | str]:
        """The -D defines of the kernel for `shape`, with its probes (block `probe_block` counting:
        probes.cuh's prober is the block whose PROBE_RANK is 0) or without."""
        if not probes:
            return shape.defines
        if not 0 <= probe_block < shape.blocks:
            raise ValueError(f"no block {probe_block} to probe in a grid of {shape.blocks}")
        rank = f"((int)blockIdx.x - {probe_block})" if probe_block else "blockIdx.x"
        return {**shape.defines, **cls.build_layout(shape, True).defines, **probe_defines(name for name, _ in PHASES),
                "PROBE_PHASES": len(PHASES), "PROBE_LAYERS": 1, "PROBE_RANK": rank}

    def train_epoch(self, stream, images: int, labels: int, order: int, params: int, slot1: int, slot2: int,
                    constants: int, num_samples: int, num_steps: int, first_step: int, metrics: int, measure: bool,
                    workspace: int) -> None:
        """`num_steps` steps of the shape's batch over samples order[0:num_samples] (the last batch
        may be shorter), the first of them the run's step `first_step` (0-based). `params`: the
        model's num_params floats in its order (each conv layer's W, b, then each linear layer's),
        updated in place; slot1, slot2: the optimizer's state, laid out alike; constants: optim.py's
        CONSTANTS record; metrics (2 doubles) += (Σ loss, #correct) when measuring. `images`: rows of
        image² normalised floats; `workspace`: workspace_bytes of device memory, its barrier counter
        zeroed here before the launch."""
        _check_aligned(params)
        cuda.memset(workspace + self.barrier_offset, 0, 8, stream)
        self._cnn_epoch(stream, self.shape.blocks, THREADS, images, labels, order, params, slot1, slot2, constants,
                        num_samples, num_steps, first_step, metrics, int(measure), workspace,
                        shared_bytes=self.shared_bytes)

    def evaluate(self, stream, images: int, labels: int, num_samples: int, params: int, out: int,
                 workspace: int) -> None:
        """out[1] (of two doubles; out[0] unchanged) += how many of the first num_samples images the model classifies right."""
        _check_aligned(params)
        cuda.memset(workspace + self.barrier_offset, 0, 8, stream)
        self._cnn_evaluate(stream, self.shape.blocks, THREADS, images, labels, num_samples, params, out, workspace,
                           shared_bytes=self.shared_bytes)


def _check_aligned(params: int) -> None:
    """The kernels load the conv parameters 16 bytes at a time (load_conv): the span must start on
    16 bytes (an arena's buffers start on 256)."""
    if params % 16:
        raise RuntimeError(f"persistent_cnn: the parameter span at {params:#x} is not 16-byte aligned")
