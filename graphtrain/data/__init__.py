"""MNIST-style datasets: reading IDX files, the datasets known, downloading, finding and loading.

    idx        the IDX file format
    registry   the datasets graphtrain knows: files, shapes, checksums, mirrors; the cache folder
    fetch      downloads, checked against md5 sums, written atomically
    load       finding a dataset's files on disk and loading them into a `Dataset`; `load_npz`,
               a user's .npz file
    images     a user's own images (.npz datasets, .npy and IDX inputs to predict on): checked,
               and one preprocessing rule for training, evaluation and prediction

Every problem with the data raises `DataError` (a `UsageError`), whose message names the file
and what is wrong; a download that fails raises `DownloadError`.
"""

from __future__ import annotations

import importlib

from graphtrain.data.load import Dataset, FileLookup, find_files, load, load_npz
from graphtrain.data.registry import (
    DATASET_NAMES,
    DATASETS,
    ROLES,
    DatasetSpec,
    FileSpec,
    cache_dir,
)

# Imported when first used: downloading needs http.client, reading IDX files numpy.
_EXPORTS = {"download": "graphtrain.data.fetch", "verify_file": "graphtrain.data.fetch",
            "read_idx": "graphtrain.data.idx"}

__all__ = [
    "DATASETS",
    "DATASET_NAMES",
    "ROLES",
    "Dataset",
    "DatasetSpec",
    "FileLookup",
    "FileSpec",
    "cache_dir",
    "download",
    "find_files",
    "load",
    "load_npz",
    "read_idx",
    "verify_file",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'graphtrain.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
