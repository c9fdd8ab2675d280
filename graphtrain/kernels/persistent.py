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
    def shared_bytes(self) -> int:
        """persistent.cu's `carve`, in bytes: six mbarriers, totals (double), floats,
        the tiles and dlogits (floats, or bf16), then ints."""
        n_tiles = ceil_div(self.classes, 8)
        pair_stride = (n_tiles * 8 + 11) // 16 * 16 + 4
        row_lanes = 16 if self.classes <= 16 else 32
        c_m_tiles = ceil_div(self.slice + 1, 16)
        rows16, owned = ceil_div(self.batch, 16) * 16, ceil_div(self.batch, CLUSTER)
        if self.bf16:
            n_pairs = ceil_div(n_tiles, 2)
            x_stride, dl_stride = 16 * c_m_tiles + 8, 16 * n_pairs + 8
            c_k_parts = 0  # a warp sums its tile row of dW over all the rows, no parts
            w16 = 2 * 16 * n_pairs * (ceil_div(self.slice, 16) * 16 + 8)  # W's bf16 copy, two buffers
        else:
            x_stride = (16 * c_m_tiles + 23) // 32 * 32 + 8
            dl_stride = 8 * n_tiles + (8 if n_tiles % 2 == 0 else 0)
            c_k_parts = 4 if rows16 // 8 % 4 == 0 else 2
            w16 = 0
        w_parts = 1 if self.bf16 else 2  # W (bf16 build), or hi and lo
        floats = (w_parts * self.slice * pair_stride + row_lanes + CLUSTER * owned * row_lanes
                  + c_k_parts * c_m_tiles * n_tiles * 32 * 4)
        values = w16 + 2 * rows16 * x_stride + rows16 * dl_stride + (owned + 1) * row_lanes
        value_bytes = 2 if self.bf16 else 4
        return 8 * 6 + 8 * (2 + 2 * COMPUTE_WARPS) + 4 * floats + value_bytes * values + 4 * (self.batch + 2 * owned)

    @property
    def defines(self) -> dict[str, int]:
        return {"SLICE": self.slice, "CLASSES": self.classes, "FEATURES": self.features, "BATCH": self.batch,
                "PIXEL_LEVELS": self.pixel_levels, "BF16": int(self.bf16)}

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
    headers = ("cluster.cuh", "tf32_mma.cuh", "bf16_mma.cuh", "warp_softmax.cuh")
    # The class's defines compile the file for MNIST's shapes (the CPU tests); a stage passes its own.
    defines = {"CLUSTER": CLUSTER, "COMPUTE_WARPS": COMPUTE_WARPS, "FETCH_WARPS": FETCH_WARPS,
               **Shape(784, 10, 128).defines}
    _softmax_epoch = kernel("softmax_epoch", PTR, PTR, PTR, PTR, PTR, I32, I32, I32, F32, PTR, I32,
                    cluster=(CLUSTER, 1, 1), max_shared_bytes=MAX_SHARED_BYTES)

    def __init__(self, device, shape: Shape):
        self.shape = shape
        super().__init__(device, shape.defines)

    def train_epoch(self, stream, images: int, labels: int, order: int, w: int, b: int, num_samples: int,
                    num_steps: int, lr: float, metrics: int, measure: bool) -> None:
        """`num_steps` SGD steps of the shape's batch over samples order[0:num_samples] (the last
        batch may be shorter), W (classes × features) and b (0: no bias) updated in place;
        metrics += (Σ loss, #correct) when measuring. `images`: num_samples × padded_features."""
        self._softmax_epoch(stream, CLUSTER, THREADS, images, labels, order, w, b, int(b != 0), num_samples,
                            num_steps, lr, metrics, measure, shared_bytes=self.shape.shared_bytes)
