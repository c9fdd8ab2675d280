"""The decoded dataset, kept on disk so that it is decoded once: one file, memory-mapped.

Decoding MNIST's gzipped IDX files and scaling the pixels takes a few hundred ms; reading the
result back from a file in the page cache takes a few. The four arrays a `Dataset` holds
(train and test images as float32, labels as int32) go into one file per dataset and folder,

    <cache>/arrays/<dataset>-<hash of the folder's path>.arrays

whose header names the source files with their sizes and modification times. It is used only
while they still match: a source file replaced or touched rebuilds it. The file is written
atomically (a reader sees the old one or the new one) and its header holds a CRC-32 of every
8 MiB of the arrays, checked on every read by a few threads at once (zlib releases the GIL),
which also brings the pages in before the arrays are uploaded. A cache file that is truncated,
corrupt or from another version is rebuilt, never half read. Where the cache cannot be written
(a read-only home), the dataset is decoded on each run, as before.

Layout: b"GTARRAY1", the JSON header's length (8 bytes, little-endian), the header, then each
array at a multiple of 4096 bytes. The arrays are read-only views of the mapping.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import numpy as np

from graphtrain import files
from graphtrain.errors import OutputError

MAGIC = b"GTARRAY1"
VERSION = 1
ALIGN = 4096
CHUNK = 8 << 20  # bytes per CRC-32
Arrays = dict[str, np.ndarray]


def cache_path(dataset: str, folder: Path) -> Path:
    """The cache file of `dataset` as loaded from `folder`."""
    digest = hashlib.sha256(str(folder.absolute()).encode()).hexdigest()[:16]
    return files.cache_dir("arrays") / f"{dataset}-{digest}.arrays"


def sources(paths: Mapping[str, Path]) -> dict[str, list]:
    """What the cache is valid for: each source file's absolute path, size and modification time."""
    out = {}
    for role, path in sorted(paths.items()):
        stat = path.stat()
        out[role] = [str(path.absolute()), stat.st_size, stat.st_mtime_ns]
    return out


def load(path: Path, paths: Mapping[str, Path], decode: Callable[[], Arrays],
         log: Callable[[str], None] | None = None) -> Arrays:
    """The arrays cached at `path` for the source files `paths`, or `decode()`'s, then cached."""
    key = sources(paths)
    arrays, problem = read(path, key)
    if arrays is not None:
        return arrays
    if problem and log:
        log(f"graphtrain: rebuilding the dataset cache {path}: {problem}")
    arrays = decode()
    write(path, key, arrays)
    return arrays


def _chunks(buffer: memoryview, start: int, nbytes: int) -> list[memoryview]:
    return [buffer[offset:min(offset + CHUNK, start + nbytes)] for offset in range(start, start + nbytes, CHUNK)]


def _crcs(chunks: list[memoryview]) -> list[int]:
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1, max(len(chunks), 1))) as pool:
        return list(pool.map(zlib.crc32, chunks))


def read(path: Path, key: Mapping[str, list]) -> tuple[Arrays | None, str | None]:
    """(the arrays, None) when `path` holds a complete, intact cache for `key`; else (None, why
    not), the reason None when there is simply no cache file (or it is for other source files)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(len(MAGIC) + 8)
            if len(head) < len(MAGIC) + 8 or not head.startswith(MAGIC):
                return None, "not a dataset cache file"
            (header_size,) = struct.unpack("<Q", head[len(MAGIC):])
            header = json.loads(handle.read(header_size))
            if header.get("version") != VERSION:
                return None, f"written by another version ({header.get('version')})"
            if header.get("sources") != key:
                return None, None  # the source files changed: rebuilt, nothing wrong with it
            if os.fstat(handle.fileno()).st_size != header["size"]:
                return None, "truncated"
            mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, KeyError, struct.error) as exc:  # ValueError: bad JSON too
        return None, f"unreadable ({exc})"
    buffer = memoryview(mapping)
    arrays: Arrays = {}
    chunks, expected = [], []
    try:
        for name, entry in header["arrays"].items():
            dtype, shape, offset = np.dtype(entry["dtype"]), tuple(entry["shape"]), entry["offset"]
            count = int(np.prod(shape, dtype=np.int64))
            arrays[name] = np.frombuffer(buffer, dtype, count, offset).reshape(shape)
            chunks += _chunks(buffer, offset, count * dtype.itemsize)
            expected += entry["crc32"]
    except (KeyError, TypeError, ValueError) as exc:
        return None, f"a bad header ({exc})"
    if len(chunks) != len(expected) or _crcs(chunks) != expected:
        return None, "corrupt (a checksum does not match)"
    return arrays, None


def write(path: Path, key: Mapping[str, list], arrays: Arrays) -> bool:
    """Cache `arrays` at `path` atomically; False when it cannot be written (a cache is optional)."""
    entries, offset = {}, 0
    contiguous = {name: np.ascontiguousarray(array) for name, array in arrays.items()}
    for name, array in contiguous.items():
        view = memoryview(array).cast("B")
        entries[name] = {"dtype": array.dtype.str, "shape": list(array.shape), "offset": offset,
                         "crc32": _crcs(_chunks(view, 0, array.nbytes))}
        offset += array.nbytes + (-array.nbytes % ALIGN)  # the next array at a multiple of ALIGN

    def header_bytes(base: int) -> bytes:
        placed = {name: {**entry, "offset": entry["offset"] + base} for name, entry in entries.items()}
        return json.dumps({"version": VERSION, "sources": key, "size": base + offset, "arrays": placed}).encode()

    # The arrays start at the first multiple of ALIGN after the header; the header's length does
    # not depend on where that is as long as the offsets keep their number of digits.
    base = ALIGN
    while len(MAGIC) + 8 + len(header_bytes(base)) > base:
        base += ALIGN
    header = header_bytes(base)

    def content(handle: BinaryIO) -> None:
        handle.write(MAGIC + struct.pack("<Q", len(header)) + header)
        for name, array in contiguous.items():
            handle.seek(entries[name]["offset"] + base)
            handle.write(memoryview(array).cast("B"))
        handle.truncate(base + offset)

    try:
        files.write_atomic(path, content)
    except OutputError:
        return False
    return True
