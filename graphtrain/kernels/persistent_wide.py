"""Launcher for persistent_wide.cu: an MLP trained by a cooperative grid of one block per SM, one
launch an epoch (the model too wide for one cluster's shared memory: see persistent_mlp.py).

The kernel is compiled for the model's sizes, the batch and the number of blocks, so a
`PersistentWide` is made per workload, and `WideShape.refusal` says beforehand why one cannot be.
Its shared memory and its global workspace are each laid out by one table (`WideShape.layout`,
`WideShape.workspace`), which both the launcher and the kernel's -D defines come from. The kernel has
two builds of its operand loads (`VARIANTS`; its header comment says why): a shape names one, or
takes DEFAULT_VARIANT.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphtrain.kernels import F32, I32, PTR, KernelFile, ceil_div, kernel
from graphtrain.kernels.persistent import MAX_CLASSES, MAX_SHARED_BYTES, Layout, Region, probe_defines
from graphtrain.libs import cuda

THREADS = 256  # per block: eight warps, the k-steps of each product split over them
WARPS = THREADS // 32
# The builds of the products' operand loads: "registers", from L2 into registers one k-step ahead;
# "staged", each warp's k-steps copied (cp.async) into a ring of its own in shared memory, STAGE_DEPTH
# − 1 k-steps ahead (the deepest ring that fits, at least two slabs). The same sums either way.
VARIANTS = ("registers", "staged")
DEFAULT_VARIANT = "registers"  # (the rung's, until the staged build is measured faster)
# The registers build's k-steps of operand loads in flight beyond the one multiplying (a ring of
# fragments in registers, PREFETCH in the kernel): each adds a k-step's A fragments to a thread's
# registers (4 an m-tile of 16 rows: 32 at batch 128) and hides one more L2 round trip of a product.
# The same sums at any depth. DEFAULT_PREFETCH 0: by the batch (prefetch_for); a positive value
# forces that depth (the phase probe's --prefetch, scripts/checks/sanitize.sh's registers:1).
DEFAULT_PREFETCH = 0
# The registers a thread gives its products' A fragments in flight (4 an m-tile of 16 rows): 64, two
# k-steps at batch 128, less the sums of a second mma column (clusters of 16 units: 4 an m-tile), so
# that clusters of 16 units hold one k-step there. Three is the deepest whose build does not spill at
# 784 and 1024 units in blocks of 8 (scripts/probes/persistent_wide_registers.py), but once each load
# took one address a k-step the 784³ epoch took longer at three than at two on an H200
# (scripts/benchmarks/epoch_ab.py, a tree of each); clusters of 16 units spill two k-steps ahead, and
# their products counted longer. At batch 32 the same registers hold eight k-steps; the phase probe's
# --prefetch columns (H200) counted the cuda-mnist MLPs' steps shorter loading 6 or 7 ahead than 2
# (1024 units in blocks of 8: 43.1k → 41.1k cycles; 512: 34.6k → 33.8k).
PREFETCH_REGISTERS = 64


def prefetch_for(rows16: int, ksteps: int, units: int = 8) -> int:
    """The registers build's default depth at a batch of `rows16` rows (whole m-tiles) whose widest
    product takes a block `ksteps` k-steps, `units` wide: the A fragments that PREFETCH_REGISTERS hold
    (less a second mma column's sums), and no more than the k-steps a warp takes less the one it multiplies."""
    tiles = rows16 // 16
    return max(1, min((PREFETCH_REGISTERS - 4 * tiles * (units // 8 - 1)) // (4 * tiles), ceil_div(ksteps, WARPS) - 1))


# The probe build's phases (probes.cuh; scripts/probes/persistent_wide_phases.py) in step order, each
# counted per layer (0: none), the cycles from the probe before to its own: (name in the kernel, meaning).
PHASES = tuple(tuple(line.split(None, 1)) for line in """
FORWARD_PRODUCTS   F_l: products (the slowest warp's)
FORWARD_EXCHANGE   F_l: the warps' sums added and the other block's sent (split 2: until the other's have landed)
FORWARD_SUMS       F_l: the warps' sums added, bias, ReLU, h_l kept and published (split 2: the two blocks' sums)
HEAD_PARTIALS      F_L: the head's partial logits published
WAIT_FORWARD       grid barrier after F_l (l = L: the partial logits)
GATHER             X: the next step's images gathered (the owned rows; L ≥ 2: inside the barrier after F_L)
SOFTMAX            S: the owned rows' logits in, softmax, dlogits published
WAIT_SOFTMAX       grid barrier after S: every row's dlogits
HEAD_GRADIENT      H: dh_L from the dlogits, published
BIAS_UPDATE        b_l's update (l = L: the head's too), inside the barrier before B_l (l = 1: before W_1's update)
WAIT_BACKWARD      grid barrier before B_l: dh_l of every block
BACKWARD_PRODUCTS  B_l: dh_{l-1}'s products and W_l's update (the slowest warp's)
BACKWARD_EXCHANGE  B_l: the warps' sums added and the other block's sent (split 2: until the other's have landed)
BACKWARD_SUMS      B_l: the warps' sums added, ReLU mask, dh_{l-1} published (split 2: the two blocks' sums)
UPDATE             update of W_1 (its products)
""".strip().splitlines())
# The grids tried, in order: (the units of every hidden layer a cluster owns, its blocks), the first
# whose grid fits the GPU (one block per SM) and whose layout fits a block's shared memory (a choice of
# clusters of two where the GPU runs none, skipped). A cluster's products are its units wide (mma columns
# of 8); in a cluster of two (SPLIT 2) each block multiplies half of every product's inputs and the two
# trade their sums (distributed shared memory), so each reads half of the exchanged matrices' bytes: on
# an H200 the 784³ MLP's epoch took less time in 49 clusters of two blocks than in 98 blocks of 8
# (scripts/benchmarks/epoch_ab.py), and so did the cuda-mnist MLP's of 1024 units. A block alone (1)
# reads each exchanged matrix whole whatever it owns: 49 blocks of 16 units took longer than 98 of 8.
GRID_CHOICES = ((16, 2), (8, 1), (16, 1))
SPLITS = (1, 2)
ASSUMED_SMS = 132  # an H100 SXM's, for shapes made without a GPU (the CPU tests)
MAX_IMAGE_VALUES = 2**31 - 1  # the kernel's image row offsets are 32-bit


def swizzled_stride(values: int) -> int:
    """A row of `values` floats of the master weights padded to whole rows of the 32 banks: the kernel's
    swizzle (master_swizzle) moves an input between the halves of its row of 32, which must be in the
    row (it spreads the products' loads and the updates' over the banks without padding them apart)."""
    return ceil_div(values, 32) * 32


@dataclass(frozen=True)
class WideShape:
    """The sizes the kernel is compiled for: the model's, the batch's, and the grid's (`sm_count`
    bounds the blocks; `units` and `split`, where given, fix a cluster's units and blocks among
    GRID_CHOICES; `clusters`: whether the GPU runs thread-block clusters)."""

    features: int
    hidden: tuple[int, ...]
    classes: int
    batch: int
    pixel_levels: int = 0  # 255: 8-bit pixels k/255, which the kernel reads as k (persistent.pixel_levels)
    bf16: bool = True  # the only precision the kernel has (bf16 operands, fp32 sums and master weights)
    sm_count: int = ASSUMED_SMS
    units: int = 0  # a cluster's units (its products' width); 0: GRID_CHOICES's
    split: int = 0  # blocks a cluster (one of SPLITS); 0: GRID_CHOICES's
    variant: str = ""  # one of VARIANTS; "": DEFAULT_VARIANT (read when used, as GRID_CHOICES is)
    stage_slabs: int = 0  # the staged build's slabs a warp; 0: the most that fit (stage_depth_with)
    prefetch: int = 0  # the registers build's k-steps loaded ahead; 0: DEFAULT_PREFETCH (read when used), by the batch
    clusters: bool = True  # the GPU runs thread-block clusters (compute capability 9.0 and later)

    kernel_name = "grid"  # as a run's record names the persistent kernel that trained it

    @property
    def layers(self) -> int:
        return len(self.hidden)

    @property
    def width(self) -> int:
        return self.hidden[0]

    @property
    def padded_features(self) -> int:
        """Inputs per image row as the kernel reads them: whole k-steps of 16."""
        return ceil_div(self.features, 16) * 16

    @property
    def image_dtype(self) -> type:
        return np.uint16  # bf16 bits: 8-bit pixels as k (exact), other floats rounded

    @property
    def rows16(self) -> int:
        return ceil_div(self.batch, 16) * 16

    @property
    def build(self) -> str:
        """The variant the kernel is compiled as."""
        variant = self.variant or DEFAULT_VARIANT
        if variant not in VARIANTS:
            raise ValueError(f"no grid kernel variant {variant!r} (one of {', '.join(VARIANTS)})")
        return variant

    @property
    def prefetch_depth(self) -> int:
        """The registers build's k-steps of loads in flight (1 in the staged build, which has its ring)."""
        depth = self.prefetch or DEFAULT_PREFETCH or prefetch_for(self.rows16, self.block_ksteps(*self.grid),
                                                                  self.cluster_units)
        if depth < 1:
            raise ValueError(f"a prefetch of {depth} k-steps (at least 1)")
        return 1 if self.build == "staged" else depth

    def block_ksteps(self, units: int, split: int) -> int:
        """The k-steps of the widest product that a block takes (its part, in clusters of `split`)."""
        return ceil_div(max(self.padded_features, self.clusters_for(units) * units) // 16, split)

    def slab_values(self, units: int) -> int:
        """bf16 values of a staged k-step: the batch's rows and the cluster's units, 16 inputs each."""
        return (self.rows16 + units) * 16

    def stage_depth_with(self, units: int, split: int) -> int:
        """The staged build's slabs a warp (0 in the registers build): `stage_slabs` where given,
        else the most that fit a block's shared memory beside the rest, at most the k-steps a warp
        takes of a product, at least two (a shape that two do not fit is refused for its shared
        memory)."""
        if self.build != "staged":
            return 0
        if self.stage_slabs:
            if self.stage_slabs < 2:
                raise ValueError(f"a staged ring of {self.stage_slabs} slabs (at least 2)")
            return self.stage_slabs
        rest = self.layout_with(units, split, stage_depth=0).bytes
        slab_bytes = WARPS * self.slab_values(units) * 2
        fits = (MAX_SHARED_BYTES - ceil_div(rest, 16) * 16) // slab_bytes
        return max(2, min(ceil_div(self.block_ksteps(units, split), WARPS), fits))

    @property
    def stage_depth(self) -> int:
        return self.stage_depth_with(*self.grid)

    def clusters_for(self, units: int) -> int:
        """Clusters of `units` units that cover the width, in whole k-steps of 16 units."""
        return ceil_div(self.width, units) if units % 16 == 0 else 2 * ceil_div(self.width, 2 * units)

    def blocks_for(self, units: int, split: int) -> int:
        """The grid's blocks in clusters of `split` blocks and `units` units."""
        return self.clusters_for(units) * split

    def problem_with(self, units: int, split: int) -> str | None:
        """Why a grid of clusters of `split` blocks and `units` units cannot train this shape, or None."""
        if split not in SPLITS:
            return f"clusters of {split} blocks (one of {', '.join(map(str, SPLITS))})"
        if units not in (8, 16):
            return f"clusters of {units} units (8 or 16: one or two mma columns)"
        if units % (8 * split) != 0:
            return f"clusters of {split} blocks share {units} units (a block finishes whole columns of 8)"
        if split > 1 and not self.clusters:
            return f"clusters of {split} blocks, and the GPU runs no thread-block clusters (compute capability 9.0)"
        blocks, own = self.blocks_for(units, split), units // split
        if blocks > self.sm_count:
            return f"{blocks} blocks of {own} units, one per SM, and the GPU has {self.sm_count}"
        needed = self.layout_with(units, split).bytes
        if needed > MAX_SHARED_BYTES:
            return f"a block of {own} units needs {needed} bytes of shared memory (at most {MAX_SHARED_BYTES})"
        return None

    @property
    def choices(self) -> tuple[tuple[int, int], ...]:
        """The grids this shape may take, in order: GRID_CHOICES's with its `units` and `split` where
        given (a pair not among them: that pair alone), clusters of two dropped where the GPU runs none."""
        picked = tuple(c for c in GRID_CHOICES if self.units in (0, c[0]) and self.split in (0, c[1])
                       and (self.clusters or c[1] == 1 or self.split))
        return picked or ((self.units or 8, self.split or 1),)

    @property
    def grid(self) -> tuple[int, int]:
        """(a cluster's units, its blocks): the first choice that fits (the first, for a shape that none
        fits: refusal says why)."""
        return next((c for c in self.choices if self.problem_with(*c) is None), self.choices[0])

    @property
    def cluster_units(self) -> int:
        """The units a cluster owns, its products' width (UNITS)."""
        return self.grid[0]

    @property
    def cluster_blocks(self) -> int:
        """The blocks of a cluster (SPLIT)."""
        return self.grid[1]

    @property
    def block_units(self) -> int:
        """The units a block owns: finishes, publishes, and holds the head's columns of."""
        return self.cluster_units // self.cluster_blocks

    @property
    def blocks(self) -> int:
        return self.blocks_for(*self.grid)

    @property
    def padded_hidden(self) -> int:
        return self.blocks * self.block_units

    def strides_with(self, units: int, split: int) -> dict[str, int]:
        """Values per row of persistent_wide.cu's buffers, for clusters of `units` units:
          W1_STRIDE, WC_STRIDE  the master weights' rows (a unit's inputs, a block's part of them),
                       swizzled_stride;
          HT_STRIDE    a unit's rows of a transposed bf16 operand: ≡ 8 (mod 16) bf16, so that the
                       eight units of a 4-byte load phase start on eight different 16-byte columns;
          PART_STRIDE  a row of a warp's partial sums: the units, unpadded (at 16 units the kernel's
                       slot flips a unit's bit 3 by its row's bit 1, so that a float2 store phase
                       takes every bank without padding);
          PARTIAL_ROW  a row of the head's partial logits (every block's classes), padded to whole
                       float4s: the softmax loads them 16 bytes at a time."""
        span = lambda values: 16 * ceil_div(values // 16, split)  # a block's part of a product's inputs
        return {"W1_STRIDE": swizzled_stride(span(self.padded_features)),
                "WC_STRIDE": swizzled_stride(span(self.clusters_for(units) * units)),
                "HT_STRIDE": self.rows16 + 8, "PART_STRIDE": units,
                "PARTIAL_ROW": ceil_div(self.blocks_for(units, split) * self.classes, 4) * 4}

    @property
    def strides(self) -> dict[str, int]:
        return self.strides_with(*self.grid)

    def sum_slots(self, units: int, split: int) -> int:
        """The warps' partial sums of a product that the shared memory holds at once (SLOTS): every
        warp's where they fit beside the rest, else half (the kernel's sum_over_warps says why)."""
        least_rings = (self.stage_slabs or 2) if self.build == "staged" else 0
        every = self.layout_with(units, split, stage_depth=least_rings, slots=WARPS)
        return WARPS if every.bytes <= MAX_SHARED_BYTES else WARPS // 2

    def layout_with(self, units: int, split: int, stage_depth: int | None = None, probe_counts: int = 0,
                    slots: int = 0) -> Layout:
        """persistent_wide.cu's shared memory for clusters of `split` blocks and `units` units (its struct Smem says what
        each region holds): with the staged build's rings (`stage_depth` slabs a warp, its own where
        None), `probe_counts` int64 phase counts (a probe build's) and `slots` warps' partial sums (0:
        sum_slots's)."""
        st, layers, classes, rows16 = self.strides_with(units, split), self.layers, self.classes, self.rows16
        own, owned_rows = units // split, ceil_div(self.batch, self.blocks_for(units, split))
        depth = self.stage_depth_with(units, split) if stage_depth is None else stage_depth
        slots = slots or self.sum_slots(units, split)
        rings = [Region("stage", "unsigned short", WARPS * depth * self.slab_values(units), 16)] if depth else []
        probes = [Region("probe_counts", "long long", probe_counts)] if probe_counts else []
        return Layout([
            Region("totals", "double", 2 * THREADS // 32),
            Region("w1", "float", units * st["W1_STRIDE"], 16),
            Region("wc", "float", (layers - 1) * units * st["WC_STRIDE"], 16),
            Region("wh", "float", classes * own, 16),
            Region("b", "float", layers * own, 16),
            Region("bh", "float", classes, 16),
            Region("row_samples", "int", 2 * owned_rows),
            Region("row_labels", "int", 2 * owned_rows),
            Region("h_last", "float", rows16 * own, 16),
            Region("ht", "unsigned short", (layers - 1) * units * st["HT_STRIDE"], 16),
            Region("dht", "unsigned short", units * st["HT_STRIDE"], 16),
            Region("dh", "float", rows16 * own, 16),
            # the warps' partial sums of a product, in the softmax (no product then) the owned rows'
            # partial logits, and in the head's update the warps' sums of its gradient
            Region("part", "float", max(slots * rows16 * st["PART_STRIDE"], owned_rows * st["PARTIAL_ROW"],
                                        WARPS * classes * (own + 1)), 16),
            Region("inbox", "float", 2 * rows16 * own if split > 1 else 0, 16),
            Region("inbox_full", "unsigned long long", 2 if split > 1 else 0),
            Region("dl", "float", rows16 * classes, 16),
            *rings,
            *probes,
        ])

    @property
    def layout(self) -> Layout:
        return self.layout_with(*self.grid)

    @property
    def shared_bytes(self) -> int:
        return self.layout.bytes

    @property
    def workspace(self) -> Layout:
        """The kernel's global scratch (its struct Workspace), each region on a 256-byte boundary."""
        blocks, units, padded, layers = self.blocks, self.block_units, self.padded_hidden, self.layers  # (units: a block's)
        piece = self.rows16 * units
        return Layout([
            Region("barrier", "unsigned long long", 1, 256),
            Region("block_metrics", "double", 2 * blocks, 256),
            Region("x", "unsigned short", 2 * self.rows16 * self.padded_features, 256),
            Region("act", "unsigned short", (layers - 1) * blocks * piece, 256),
            Region("grad", "unsigned short", (layers - 1) * blocks * piece, 256),
            Region("wg", "unsigned short", (layers - 1) * 2 * padded * padded, 256),
            Region("partials", "float", self.batch * self.strides["PARTIAL_ROW"], 256),
            Region("dz", "float", self.batch * self.classes, 256),
        ])

    @property
    def defines(self) -> dict[str, int]:
        """The -D defines persistent_wide.cu is compiled with for this shape."""
        workspace = self.workspace
        return {"BLOCKS": self.blocks, "UNITS": self.cluster_units, "SPLIT": self.cluster_blocks,
                "SLOTS": self.sum_slots(*self.grid), "STAGE_DEPTH": self.stage_depth, "PREFETCH": self.prefetch_depth,
                "FEATURES": self.features,
                "FEATURE_STRIDE": self.padded_features, "HIDDEN": self.width, "HIDDEN_PAD": self.padded_hidden,
                "LAYERS": self.layers, "CLASSES": self.classes, "BATCH": self.batch, "PIXEL_LEVELS": self.pixel_levels,
                **self.strides, **self.layout.defines,
                **{f"WS_{name.upper()}": offset for name, offset in workspace.offsets.items()}}

    def refusal(self) -> str | None:
        """Why the kernel cannot train this shape, or None."""
        dims = "-".join(map(str, (self.features, *self.hidden, self.classes)))
        if not self.bf16:
            return f"the {dims} MLP in fp32: the grid kernel trains in bf16 only (--precision bf16)"
        if self.classes > MAX_CLASSES:
            return f"{self.classes} classes (at most {MAX_CLASSES}: a row's classes are one warp's lanes)"
        if len(set(self.hidden)) > 1:
            return f"the {dims} MLP: its hidden layers must all have the same size"
        problems = list(dict.fromkeys(self.problem_with(*choice) for choice in self.choices))  # (each once)
        if all(problems):
            return f"the {dims} MLP at batch {self.batch} on a grid: " + "; ".join(problems)
        return None


class PersistentWide(KernelFile):
    stem = "persistent_wide"
    min_arch = 80  # bf16 mma and movmatrix; clusters of two blocks (split 2) need 90 (WideShape.clusters)
    headers = ("cluster.cuh", "smem_layout.cuh", "probes.cuh", "grid_sync.cuh", "batched_loads.cuh", "bf16_mma.cuh", "async_copy.cuh", "logits_loss.cuh")
    # The class's defines compile the file for the jhu preset's 784³ MLP in blocks alone, which every
    # architecture it takes runs (the CPU tests; clusters: WideShape's tests); a stage passes its own.
    defines = {"THREADS": THREADS, **WideShape(784, (784,) * 3, 10, 128, 255, clusters=False).defines}
    _wide_epoch = kernel("wide_epoch", PTR, PTR, PTR, PTR, I32, I32, I32, F32, PTR, I32, PTR, cooperative=True,
                         max_shared_bytes=MAX_SHARED_BYTES)

    def __init__(self, device, shape: WideShape, probes: bool = False):
        """`probes`: the probe build (probes.cuh), which counts the SM cycles of each phase and layer
        of the steps (thread 0 of block 0) and writes them, PHASES × (layers + 1) int64 summed over
        the launch's steps, where train_epoch's `metrics` points (and is never to measure)."""
        layout = self.build_layout(shape, probes)
        self.shape, self.shared_bytes = shape, layout.bytes  # (the table is read once, not per launch)
        workspace = shape.workspace
        self.workspace_bytes, self.barrier_offset = workspace.bytes, workspace.offsets["barrier"]
        super().__init__(device, self.build_defines(shape, probes))

    @staticmethod
    def build_layout(shape: WideShape, probes: bool = False) -> Layout:
        """The kernel's shared memory for `shape`; the probe build's holds its phase counts too."""
        if not probes:
            return shape.layout
        return shape.layout_with(*shape.grid, probe_counts=len(PHASES) * (shape.layers + 1))

    @classmethod
    def build_defines(cls, shape: WideShape, probes: bool = False) -> dict[str, int | str]:
        """The -D defines of the kernel for `shape`, with its probes or without."""
        if not probes:
            return shape.defines
        return {**shape.defines, **cls.build_layout(shape, True).defines, **probe_defines(name for name, _ in PHASES),
                "PROBE_PHASES": len(PHASES), "PROBE_LAYERS": shape.layers + 1, "PROBE_RANK": "blockIdx.x"}

    def train_epoch(self, stream, images: int, labels: int, order: int, params: int, bias: bool, num_samples: int,
                    num_steps: int, lr: float, metrics: int, measure: bool, workspace: int) -> None:
        """`num_steps` SGD steps of the shape's batch over samples order[0:num_samples] (the last
        batch may be shorter). `params`: a device array of 2·(layers + 1) addresses, the weights
        (fan_out × fan_in) of each layer, the head's last, then their biases (unread without a
        bias), all updated in place; metrics += (Σ loss, #correct) when measuring. `images`:
        num_samples × padded_features bf16 (persistent.kernel_images); `workspace`: workspace_bytes
        of device memory, its barrier counter zeroed here before the launch."""
        cuda.memset(workspace + self.barrier_offset, 0, 8, stream)
        self._wide_epoch(stream, self.shape.blocks, THREADS, images, labels, order, params, int(bias), num_samples,
                         num_steps, lr, metrics, measure, workspace, shared_bytes=self.shared_bytes)
