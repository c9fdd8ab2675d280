"""The IDX file format of MNIST-style datasets: a header, then one array, big-endian.

    bytes 0-1  zero
    byte  2    data type code (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64)
    byte  3    number of dimensions, n
    then n big-endian uint32 sizes, then the values in C order

Files may be gzipped or not, whatever their name says. Every problem raises a `DataError`
naming the file and what is wrong with it.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from graphtrain.errors import DataError

# IDX data type codes. The format stores multi-byte values big-endian.
IDX_DTYPES = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

GZIP_MAGIC = b"\x1f\x8b"


def read_idx(path: str | os.PathLike[str], axes: tuple[str, ...] | None = None) -> np.ndarray:
    """Read an IDX file, gzipped or not, into a native-endian array of its declared shape.

    `axes` names the dimensions the caller expects, e.g. ("count", "rows", "columns"): a header
    declaring another number of dimensions is rejected before its sizes are read.
    """
    path = Path(path)
    data = read_bytes(path)
    # Decide by content, not by name: some browsers gunzip a download but keep its ".gz" name.
    compressed = data[:2] == GZIP_MAGIC
    if compressed:
        data = gunzip(data, str(path))
    elif path.name.endswith(".gz") and data[:2] != b"\x00\x00":
        start = data[:4].hex(" ") or "nothing"
        raise DataError(f"{path} is not a gzip file (it starts with {start}) nor an IDX file")
    return _parse_idx(data, path, compressed, axes)


def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc


def gunzip(data: bytes, label: str) -> bytes:
    try:
        return gzip.decompress(data)
    # A bad CRC or header is an OSError (BadGzipFile), a cut-off stream an EOFError, and
    # garbage inside the deflate stream a zlib.error.
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{label}: corrupted gzip data ({exc})") from exc


def _parse_idx(data: bytes, path: Path, compressed: bool, axes: tuple[str, ...] | None) -> np.ndarray:
    # Byte counts in messages refer to what was parsed; say so when that is not the file size.
    what = "the uncompressed data has" if compressed else "the file has"
    if len(data) < 4:
        raise DataError(f"{path}: too short for an IDX header: {what} {len(data)} bytes")
    zero_a, zero_b, code, ndim = data[:4]
    if zero_a or zero_b:
        raise DataError(
            f"{path}: bad IDX magic number {data[:4].hex(' ')}: an IDX file starts with two "
            "zero bytes, a data type code and the number of dimensions"
        )
    dtype = IDX_DTYPES.get(code)
    if dtype is None:
        known = ", ".join(f"0x{c:02X}" for c in IDX_DTYPES)
        raise DataError(f"{path}: unknown IDX data type code 0x{code:02X} (known: {known})")
    if ndim == 0:
        raise DataError(f"{path}: the IDX header declares 0 dimensions")
    if axes is not None and ndim != len(axes):
        raise DataError(f"{path}: expected a {len(axes)}-dimensional IDX array ({', '.join(axes)}), "
                        f"but its header declares {ndim} dimensions: is it the right file?")
    header_size = 4 + 4 * ndim
    if len(data) < header_size:
        raise DataError(
            f"{path}: truncated IDX header: {ndim} dimensions need {header_size} bytes, "
            f"{what} {len(data)}"
        )
    shape = struct.unpack(f">{ndim}I", data[4:header_size])
    count = math.prod(shape)
    expected = header_size + count * dtype.itemsize
    layout = f"a {'x'.join(map(str, shape))} array of {dtype.newbyteorder('=').name}"
    if len(data) < expected:
        raise DataError(
            f"{path}: truncated: {layout} needs {expected} bytes, {what} {len(data)} "
            f"({expected - len(data)} missing)"
        )
    if len(data) > expected:
        raise DataError(
            f"{path}: {len(data) - expected} unexpected trailing bytes: {layout} needs "
            f"{expected} bytes, {what} {len(data)}"
        )
    array = np.frombuffer(data, dtype=dtype, count=count, offset=header_size).reshape(shape)
    # The copy makes the array native-endian and writable (frombuffer over bytes is read-only).
    return array.astype(dtype.newbyteorder("="))
