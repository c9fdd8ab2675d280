"""One device allocation per run: an arena planned first, allocated once, carved into buffers.

    arena = Arena()
    x = arena.reserve("x", (batch, 784))          # offset assigned now, no GPU needed
    w = arena.reserve("w1", (128, 784))
    arena.allocate()                              # the single cudaMalloc
    w.upload(weights, stream); x.ptr              # base + offset

Planning is separate from allocation so the layout (and its size) is known, and testable, before
touching the GPU, and so that nothing in the training loop ever allocates: CUDA Graph capture
forbids it and allocation would hide in the timings.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from graphtrain.libs import cuda

ALIGNMENT = 256  # cudaMalloc's own alignment; also what cuBLAS wants for workspaces and matrices


class ArenaError(ValueError):
    """The arena was used out of order or asked for an impossible layout: a bug in the caller."""


def _align(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


class Buffer:
    """A typed, shaped slice of an Arena at a fixed, 256-byte-aligned offset."""

    __slots__ = ("name", "shape", "dtype", "nbytes", "size", "offset", "_arena")

    def __init__(self, arena: Arena, name: str, shape: tuple[int, ...], dtype: np.dtype, offset: int):
        self._arena, self.name, self.shape, self.dtype, self.offset = arena, name, shape, dtype, offset
        self.size = int(np.prod(shape, dtype=np.int64)) if shape else 1
        self.nbytes = self.size * dtype.itemsize

    @property
    def ptr(self) -> int:
        """The device address of this buffer; only once the arena is allocated and not closed."""
        return self._arena._base_for(self.name) + self.offset

    def at(self, *index: int) -> int:
        """The device address of one element: `at(i)` counts elements from the start (row-major),
        `at(r, c)` names one by its index in every dimension (ValueError when out of range)."""
        flat = index[0] if len(index) == 1 else int(np.ravel_multi_index(index, self.shape))
        if not 0 <= flat < self.size:
            raise IndexError(f"buffer {self.name!r} of shape {self.shape} has no element {flat}")
        return self.ptr + flat * self.dtype.itemsize

    def view(self, shape: tuple[int, ...], dtype: np.dtype | type) -> Buffer:
        """The same bytes seen as another shape and dtype (no more bytes than this buffer has):
        room reserved before the arena's user knows which of several forms it will hold."""
        out = Buffer(self._arena, self.name, tuple(int(d) for d in shape), np.dtype(dtype), self.offset)
        if out.nbytes > self.nbytes:
            raise ArenaError(f"buffer {self.name!r} has {self.nbytes} bytes, too few for {out.shape} of {out.dtype}")
        return out

    def upload(self, array: np.ndarray, stream: cuda.Stream) -> None:
        """Copy a host array of exactly this shape and dtype into the buffer (waits for it)."""
        host = np.asarray(array)
        if host.shape != self.shape:
            raise ArenaError(f"buffer {self.name!r} has shape {self.shape}, cannot upload shape {host.shape}")
        if host.dtype != self.dtype:
            raise ArenaError(f"buffer {self.name!r} holds {self.dtype}, cannot upload {host.dtype}")
        cuda.copy_to_device(self.ptr, np.ascontiguousarray(host), stream)

    def download(self, stream: cuda.Stream) -> np.ndarray:
        """Copy the buffer into a new host array, after the work queued on `stream` (waits)."""
        out = np.empty(self.shape, dtype=self.dtype)
        return cuda.copy_to_host(self.ptr, out, stream)

    def zero(self, stream: cuda.Stream) -> None:
        """Queue setting every byte of the buffer to zero on `stream`."""
        if self.nbytes:
            cuda.memset(self.ptr, 0, self.nbytes, stream)


class Arena:
    """Plan buffers with `reserve`, then `allocate` all of them with one device allocation."""

    def __init__(self) -> None:
        self._buffers: dict[str, Buffer] = {}
        self._end = 0  # first free byte after the last reserved buffer
        self._base: int | None = None
        self._closed = False

    def reserve(self, name: str, shape: int | tuple[int, ...], dtype: np.dtype | type = np.float32) -> Buffer:
        """Plan a buffer; its offset is fixed now. Only before `allocate`; names are unique."""
        if self._base is not None or self._closed:
            raise ArenaError(f"cannot reserve {name!r}: the arena is already allocated")
        if not isinstance(name, str) or not name:
            raise ArenaError(f"a buffer name must be a non-empty string, not {name!r}")
        if name in self._buffers:
            raise ArenaError(f"buffer {name!r} is already reserved in this arena")
        dims = (shape,) if isinstance(shape, (int, np.integer)) else shape
        if not isinstance(dims, (tuple, list)) or not all(
                isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise ArenaError(f"a buffer shape must be a non-negative int or a tuple of them, not {shape!r}")
        buffer = Buffer(self, name, tuple(int(d) for d in dims), np.dtype(dtype), _align(self._end))
        self._buffers[name] = buffer
        self._end = buffer.offset + buffer.nbytes
        return buffer

    @property
    def nbytes(self) -> int:
        """Bytes the single allocation needs: every buffer, each starting on a 256-byte boundary."""
        return _align(self._end)

    @property
    def buffers(self) -> Mapping[str, Buffer]:
        """Read-only view: buffer name -> Buffer, in reservation order."""
        return MappingProxyType(self._buffers)

    def _base_for(self, name: str) -> int:
        if self._base is None:
            raise ArenaError(f"buffer {name!r} has no device address: the arena was "
                             f"{'closed' if self._closed else 'not allocated yet (call Arena.allocate() first)'}")
        return self._base

    def allocate(self) -> int:
        """Make the one device allocation for every reserved buffer; returns its base address."""
        if self._closed:
            raise ArenaError("cannot allocate a closed arena")
        if self._base is not None:
            raise ArenaError("the arena is already allocated")
        if not self._buffers or self.nbytes == 0:
            raise ArenaError("nothing to allocate: reserve at least one non-empty buffer first")
        self._base = cuda.malloc(self.nbytes)
        return self._base

    def close(self) -> None:
        """Free the allocation once (idempotent); every Buffer.ptr is invalid afterwards."""
        if self._closed:
            return
        self._closed = True
        base, self._base = self._base, None
        if base is not None:
            cuda.free(base)

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
