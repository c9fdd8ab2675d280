"""Launcher for persistent.cu: softmax regression, one thread-block cluster, one launch an epoch.

The kernel is compiled for the model's sizes (its loops unroll over the classes and the slice),
so a `Persistent` is made per workload, and `fits` says beforehand why one cannot be.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphtrain.kernels import F32, I32, PTR, KernelFile, ceil_div, kernel

CLUSTER = 16  # blocks: the largest cluster Hopper runs (a non-portable size)
COMPUTE_WARPS = 8  # run the phases: A, C and the update take eight a step (jhu); sixteen measured 6% slower,
#                   the idle ones spinning on the step's barriers
FETCH_WARPS = 2  # copy the next batch in while the compute warps train the current one
THREADS = 32 * (COMPUTE_WARPS + FETCH_WARPS)
MAX_CLASSES = 32  # a row's classes are the lanes of one warp
MAX_SHARED_BYTES = 227 * 1024  # dynamic shared memory a Hopper block may opt in to
# The probe build's clock stamps (probes.cuh; scripts/probes/persistent_phases.py), in the order a step
# passes them: each names the phase that ends there. The bf16 build has no separate barrier in C.
STAMPS = tuple(tuple(line.split(None, 1)) for line in """
C_LAST_BARRIER  C: second barrier (of the step before)
TILE_WAIT       tile wait
A_PRODUCTS      A: products
A_SENDS         A: sends
INBOX_WAIT      inbox wait
B               B
DLOGITS_WAIT    dlogits wait
C_PRODUCTS      C: products
C_BARRIER       C: barrier
C_UPDATE        C: update
""".strip().splitlines())
PROBE_STEPS = 64  # steps stamped


def probe_defines(names) -> dict[str, int]:
    """-D defines of a probe build (probes.cuh): PROBES, and each probe's slot."""
    return {"PROBES": 1, **{f"PROBE_SLOT_{name}": slot for slot, name in enumerate(names)}}


# Bytes of each element type a layout's regions hold (the C type names the kernels use).
ELEMENT_BYTES = {"unsigned long long": 8, "long long": 8, "double": 8, "float2": 8, "float": 4, "int": 4,
                 "unsigned short": 2, "unsigned char": 1}


@dataclass(frozen=True)
class Region:
    """One buffer of a kernel's dynamic shared memory: `count` values of C type `ctype`, placed at
    the next multiple of `align` bytes (0: the element's size)."""

    name: str
    ctype: str
    count: int
    align: int = 0


class Layout:
    """A kernel's dynamic shared memory: its regions in order, each at the first offset past the one
    before that its alignment allows. The one table both sides read: the launcher launches with
    `bytes`, and the kernel, compiled with `defines`, carves at `SMEM_<NAME>` (its element size
    checked against `SMEM_<NAME>_ELEMENT`) and traps unless launched with `SMEM_BYTES`."""

    def __init__(self, regions: list[Region]):
        self.regions, self.offsets, at = tuple(regions), {}, 0
        for region in self.regions:
            size = ELEMENT_BYTES[region.ctype]
            align = max(region.align, size)
            at = ceil_div(at, align) * align
            self.offsets[region.name] = at
            at += region.count * size
        self.bytes = at

    @property
    def defines(self) -> dict[str, int]:
        out = {"SMEM_BYTES": self.bytes}
        for region in self.regions:
            out[f"SMEM_{region.name.upper()}"] = self.offsets[region.name]
            out[f"SMEM_{region.name.upper()}_ELEMENT"] = ELEMENT_BYTES[region.ctype]
        return out


@dataclass(frozen=True)
class Shape:
    """The sizes a kernel is compiled for, and the batch its shared memory is carved for."""

    features: int
    classes: int
    batch: int
    pixel_levels: int = 0  # 255: the images are 8-bit pixels k/255 and the kernel reads k (see pixel_levels())
    bf16: bool = False  # the products from bf16 operands in one pass, else TF32 passes (persistent.cu: BF16)

    @property
    def slice(self) -> int:
        """Features per block: ⌈features / CLUSTER⌉ rounded up to 8 (an mma's k)."""
        return ceil_div(ceil_div(self.features, CLUSTER), 8) * 8

    @property
    def padded_features(self) -> int:
        return CLUSTER * self.slice

    @property
    def image_dtype(self) -> type:
        """The images as the kernel reads them: bf16 (its 16 bits) for the bf16 products, else
        floats (8-bit pixels as k, exact in both)."""
        return np.uint16 if self.bf16 else np.float32

    @property
    def strides(self) -> dict[str, int]:
        """The row strides of persistent.cu's buffers (in values), chosen so that a load phase's
        lanes fall on different banks:
          PAIR_STRIDE  classes per feature pair of W (each class an 8-byte (even, odd feature) pair):
                       ≡ 4 (mod 16), so that a fragment's 8-byte loads (k = lane % 4, n = lane / 4)
                       spread over all 32 banks;
          ROW_LANES    phase B's threads per row, a class each (and floats per row of the inbox);
          X_STRIDE     a tile row: the slice's features, the bias's input, zeros to whole mma tiles;
                       TF32: ≡ 8 (mod 32) floats (A's 8-byte and C's 4-byte loads hit 32 banks);
                       bf16: an odd number of 16-byte pieces (ldmatrix reads eight rows of 16 bytes
                       a matrix, which then fall in eight different 16-byte columns of the banks);
          DL_STRIDE    a row of dlogits: TF32 ≡ 8 or 24 (mod 32) floats; bf16 as X_STRIDE;
          W16_STRIDE   (bf16) a class of W's bf16 copy: the slice in k-steps of 16, as X_STRIDE;
          C_K_PARTS    (TF32) phase C's k range split over warps (0 in the bf16 build)."""
        n_tiles = ceil_div(self.classes, 8)
        x_cols = 16 * ceil_div(self.slice + 1, 16)
        rows16 = ceil_div(self.batch, 16) * 16
        out = {"PAIR_STRIDE": (n_tiles * 8 + 11) // 16 * 16 + 4, "ROW_LANES": 16 if self.classes <= 16 else 32}
        if self.bf16:
            out.update(X_STRIDE=x_cols + 8, DL_STRIDE=16 * ceil_div(n_tiles, 2) + 8,
                       W16_STRIDE=ceil_div(self.slice, 16) * 16 + 8, C_K_PARTS=0)
        else:
            out.update(X_STRIDE=(x_cols + 23) // 32 * 32 + 8, DL_STRIDE=8 * n_tiles + (8 if n_tiles % 2 == 0 else 0),
                       W16_STRIDE=0, C_K_PARTS=4 if rows16 // 8 % 4 == 0 else 2)
        return out

    @property
    def layout(self) -> Layout:
        """persistent.cu's shared memory (its struct Smem says what each region holds)."""
        st, n_tiles = self.strides, ceil_div(self.classes, 8)
        rows16, owned = ceil_div(self.batch, 16) * 16, ceil_div(self.batch, CLUSTER)
        c_m_tiles = ceil_div(self.slice + 1, 16)
        value = "unsigned short" if self.bf16 else "float"  # tiles, W's copy and dlogits: bf16 bits or floats
        w_pairs = self.slice // 2 * st["PAIR_STRIDE"]
        return Layout([
            Region("bars", "unsigned long long", 6),
            Region("totals", "double", 2 + 2 * COMPUTE_WARPS),
            Region("w_hi", "float2", w_pairs),
            Region("w_lo", "float2", 0 if self.bf16 else w_pairs),
            Region("b", "float", st["ROW_LANES"]),
            Region("inbox", "float", CLUSTER * owned * st["ROW_LANES"]),
            Region("dw_parts", "float", st["C_K_PARTS"] * c_m_tiles * n_tiles * 32 * 4),
            Region("w16", value, 2 * 16 * ceil_div(n_tiles, 2) * st["W16_STRIDE"] if self.bf16 else 0, 16),
            Region("x", value, 2 * rows16 * st["X_STRIDE"], 16),
            Region("dl", value, rows16 * st["DL_STRIDE"], 16),
            Region("dl_row", value, (owned + 1) * st["ROW_LANES"], 16),
            Region("order", "int", self.batch),
            Region("labels", "int", 2 * owned),
        ])

    @property
    def shared_bytes(self) -> int:
        return self.layout.bytes

    @property
    def defines(self) -> dict[str, int]:
        """The -D defines persistent.cu is compiled with for this shape: its sizes, strides and layout."""
        return {"SLICE": self.slice, "CLASSES": self.classes, "FEATURES": self.features, "BATCH": self.batch,
                "PIXEL_LEVELS": self.pixel_levels, "BF16": int(self.bf16), **self.strides, **self.layout.defines}

    def refusal(self) -> str | None:
        """Why the kernel cannot train this shape, or None."""
        if self.classes > MAX_CLASSES:
            return f"{self.classes} classes (at most {MAX_CLASSES}: a row's classes are one warp's lanes)"
        if self.shared_bytes > MAX_SHARED_BYTES:
            return (f"batch {self.batch} of {self.features} features, whose step needs {self.shared_bytes} bytes "
                    f"of shared memory per block (at most {MAX_SHARED_BYTES})")
        return None


ROWS_PER_BLOCK = 2048  # images converted per task: a few MB, so each task's temporaries stay in cache


def by_row_blocks(num_rows: int, work: Callable[[slice], Any]) -> list:
    """`work(rows)` over blocks of rows, on a pool of threads (numpy releases the GIL in its loops):
    the whole training set in a few ms instead of a few hundred."""
    blocks = [slice(lo, lo + ROWS_PER_BLOCK) for lo in range(0, num_rows, ROWS_PER_BLOCK)]
    if len(blocks) <= 1:
        return [work(rows) for rows in blocks]
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1, len(blocks))) as pool:
        return list(pool.map(work, blocks))


def pixel_levels(images: np.ndarray) -> int:
    """255 where every value is k/255 for an integer k (8-bit pixels, as loaded from uint8), else 0.

    With 255 the kernel is given k itself, exact in TF32, so its products with the images take
    two tensor-core passes instead of three (persistent.cu: PIXEL_LEVELS)."""

    def exact(rows: slice) -> bool:
        block = images[rows]
        return np.array_equal(np.rint(block * np.float32(255)) / np.float32(255), block)

    return 255 if all(by_row_blocks(len(images), exact)) else 0


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 (to nearest, ties to even), as their 16 bits."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def kernel_images(images: np.ndarray, shape) -> np.ndarray:
    """The training images as a persistent kernel reads them (`shape`: a Shape or an MlpShape):
    rows of `shape.padded_features` (zero past the features) of `shape.image_dtype` (uint16: bf16
    bits), in units of 1/pixel_levels where the shape has them (k, exact in bf16 as in TF32)."""
    rows = np.zeros((len(images), shape.padded_features), shape.image_dtype)

    def fill(block: slice) -> None:
        values = np.rint(images[block] * np.float32(shape.pixel_levels)) if shape.pixel_levels else images[block]
        rows[block, :shape.features] = bf16_bits(values) if shape.image_dtype == np.uint16 else values

    by_row_blocks(len(images), fill)
    return rows


class Persistent(KernelFile):
    stem = "persistent"
    min_arch = 90  # thread-block clusters and distributed shared memory
    headers = ("cluster.cuh", "smem_layout.cuh", "probes.cuh", "tf32_mma.cuh", "bf16_mma.cuh", "logits_loss.cuh")
    # The class's defines compile the file for MNIST's shapes (the CPU tests); a stage passes its own.
    defines = {"CLUSTER": CLUSTER, "COMPUTE_WARPS": COMPUTE_WARPS, "FETCH_WARPS": FETCH_WARPS,
               **Shape(784, 10, 128).defines}
    _softmax_epoch = kernel("softmax_epoch", PTR, PTR, PTR, PTR, PTR, I32, I32, I32, F32, PTR, I32,
                    cluster=(CLUSTER, 1, 1), max_shared_bytes=MAX_SHARED_BYTES)

    def __init__(self, device, shape: Shape, probes: bool = False):
        """`probes`: the probe build (probes.cuh), which writes its clock stamps, PROBE_STEPS × STAMPS
        int64, where train_epoch's `metrics` points (and is never to measure)."""
        self.shape, self.shared_bytes = shape, shape.shared_bytes  # (the table is read once, not per launch)
        super().__init__(device, self.build_defines(shape, probes))

    @staticmethod
    def build_defines(shape: Shape, probes: bool = False) -> dict[str, int]:
        """The -D defines of the kernel for `shape`, with its probes or without."""
        if not probes:
            return shape.defines
        return {**shape.defines, **probe_defines(name for name, _ in STAMPS), "PROBE_STEPS": PROBE_STEPS,
                "PROBE_SLOTS": len(STAMPS)}

    def train_epoch(self, stream, images: int, labels: int, order: int, w: int, b: int, num_samples: int,
                    num_steps: int, lr: float, metrics: int, measure: bool) -> None:
        """`num_steps` SGD steps of the shape's batch over samples order[0:num_samples] (the last
        batch may be shorter), W (classes × features) and b (0: no bias) updated in place;
        metrics += (Σ loss, #correct) when measuring. `images`: num_samples × padded_features."""
        self._softmax_epoch(stream, CLUSTER, THREADS, images, labels, order, w, b, int(b != 0), num_samples,
                            num_steps, lr, metrics, measure, shared_bytes=self.shared_bytes)
