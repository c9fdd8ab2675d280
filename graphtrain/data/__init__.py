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

from graphtrain.data.fetch import download, verify_file
from graphtrain.data.idx import read_idx
from graphtrain.data.load import Dataset, FileLookup, find_files, load, load_npz
from graphtrain.data.registry import (
    DATASET_NAMES,
    DATASETS,
    ROLES,
    DatasetSpec,
    FileSpec,
    cache_dir,
)

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
