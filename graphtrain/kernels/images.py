"""Launchers for images.cu: images made on the device from the float32 images as uploaded — as a
persistent kernel reads them (the same values as persistent.pixel_levels and
persistent.kernel_images compute on the host), or normalised (data.images.normalise's values)."""

from __future__ import annotations

import numpy as np

from graphtrain.kernels import F32, I32, I64, PTR, KernelFile, kernel
from graphtrain.libs import cuda

THREADS = 256
COUNT_BLOCKS = 1024  # a grid-stride pass over the values


class Images(KernelFile):
    stem = "images"
    _count_off_levels = kernel("count_off_levels", PTR, I64, PTR)
    _normalise = kernel("normalise", PTR, I64, F32, F32)
    _kernel_images_f32 = kernel("kernel_images_f32", PTR, I32, I32, I32, PTR)
    _kernel_images_bf16 = kernel("kernel_images_bf16", PTR, I32, I32, I32, PTR)
    _kernel_images_u8 = kernel("kernel_images_u8", PTR, I32, I32, I32, PTR)

    def pixel_levels(self, stream, images: int, n: int, counter: int) -> int:
        """255 where every one of the n floats at `images` is k/255 for an integer k, else 0
        (`counter`: 8 bytes of device scratch). Waits for the answer."""
        cuda.memset(counter, 0, 8, stream)
        self._count_off_levels(stream, COUNT_BLOCKS, THREADS, images, n, counter)
        off = cuda.copy_to_host(counter, np.zeros(1, np.uint64), stream)[0]
        return 255 if off == 0 else 0

    def normalise(self, stream, images: int, n: int, mean: float, std: float) -> None:
        """The n floats at `images` ← (x − mean) / std in float32, in place (mean and std taken
        as float32), as graphtrain.data.images.normalise computes them."""
        self._normalise(stream, COUNT_BLOCKS, THREADS, images, n, float(np.float32(mean)), float(np.float32(std)))

    def kernel_images(self, stream, images: int, rows: int, features: int, shape, out: int) -> None:
        """out (rows × shape.padded_features of shape.image_dtype) = the images at `images` (rows ×
        features floats) as the kernel of `shape` reads them."""
        launch = {np.float32: self._kernel_images_f32, np.uint16: self._kernel_images_bf16,
                  np.uint8: self._kernel_images_u8}[shape.image_dtype]
        launch(stream, rows, THREADS, images, features, shape.padded_features, shape.pixel_levels, out)
