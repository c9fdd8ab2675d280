"""Launchers for gather.cu: a batch's rows gathered through the epoch's order, and the cursor."""

from __future__ import annotations

from graphtrain.kernels import I32, I64, PTR, KernelFile, kernel, model_grid, model_stride_arg

THREADS = 256  # threads per row copied: 784 floats are 196 float4s, one pass


class Gather(KernelFile):
    stem = "gather"
    headers = ("batch_slice.cuh", "model_axis.cuh")
    _gather_batch = kernel("gather_batch", PTR, PTR, PTR, I32, I32, PTR, PTR)
    _gather_batch_at = kernel("gather_batch_at", PTR, PTR, PTR, PTR, I32, PTR, PTR, I64)
    _gather_slice_at = kernel("gather_slice_at", PTR, PTR, PTR, PTR, I32, PTR, PTR, I32, I32, I32, I32)
    _gather_samples_at = kernel("gather_samples_at", PTR, PTR, PTR, I32, PTR, PTR, I64)
    _advance_cursor = kernel("advance_cursor", PTR, I32)
    _set_cursor = kernel("set_cursor", PTR, I32)

    def gather_batch(self, stream, images: int, labels: int, order: int, offset: int, features: int, rows: int,
                     x: int, y: int) -> None:
        """x[r] = images[order[offset + r]], y[r] = labels[order[offset + r]] for r < rows."""
        self._gather_batch(stream, rows, THREADS, images, labels, order, offset, features, x, y)

    def gather_batch_at(self, stream, images: int, labels: int, order: int, cursor: int, features: int, rows: int,
                        x: int, y: int, models: int = 1, model_stride: int = 0) -> None:
        """The same, with the offset read from the device int at `cursor`; for `models` models at
        once, order, cursor, x and y each model's (model_stride bytes apart), images and labels shared."""
        stride = model_stride_arg(models, model_stride)
        self._gather_batch_at(stream, model_grid(rows, models), THREADS, images, labels, order, cursor, features, x,
                              y, stride)

    def gather_samples_at(self, stream, labels: int, order: int, cursor: int, rows: int, samples: int, y: int,
                          models: int = 1, model_stride: int = 0) -> None:
        """samples[r] = order[*cursor + r], y[r] = labels[samples[r]] for r < rows: the batch's
        indices for a first layer that reads its rows where they lie; per model as gather_batch_at."""
        stride = model_stride_arg(models, model_stride)
        self._gather_samples_at(stream, model_grid(1, models), THREADS, labels, order, cursor, rows, samples, y, stride)

    def gather_slice_at(self, stream, images: int, labels: int, order: int, cursor: int, features: int, batch: int,
                        epoch_samples: int, rank: int, ranks: int, x: int, y: int) -> None:
        """Rank `rank`'s batch / ranks rows of the combined batch of `batch` rows at the device
        cursor: x[r] = images[order[*cursor + rank · valid/ranks + r]], valid the combined
        batch's real rows (the epoch's tail is smaller); see gather.cu."""
        if batch % ranks or not 0 <= rank < ranks:
            raise ValueError(f"rank {rank} of {ranks}: a combined batch of {batch} rows does not split evenly")
        self._gather_slice_at(stream, batch // ranks, THREADS, images, labels, order, cursor, features, x, y, batch,
                              epoch_samples, rank, ranks)

    def advance_cursor(self, stream, cursor: int, rows: int) -> None:
        """*cursor += rows."""
        self._advance_cursor(stream, 1, 1, cursor, rows)

    def set_cursor(self, stream, cursor: int, value: int) -> None:
        """*cursor = value."""
        self._set_cursor(stream, 1, 1, cursor, value)
