"""The datasets graphtrain knows: their four files, shapes, checksums and mirrors.

A dataset is four IDX files, named after the `Dataset` fields they become (`ROLES`). Each is
named as the mirrors serve it (gzipped) and may be kept uncompressed under the same name without
`.gz`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from graphtrain.files import cache_dir as graphtrain_cache_dir
from graphtrain.errors import DataError

# The four files of a dataset, named after the `Dataset` fields they become.
ROLES = ("train_images", "train_labels", "test_images", "test_labels")

# The dimensions each file's array has.
AXES = {"images": ("count", "rows", "columns"), "labels": ("count",)}


@dataclass(frozen=True)
class FileSpec:
    """One file of a dataset, named as the mirrors serve it (gzipped).

    A file is accepted when either checksum matches: `gz_md5` covers the bytes of the .gz file,
    `md5` the uncompressed IDX data. The uncompressed sum is the one to trust where it is known,
    because the same data re-compressed (as some mirrors did) has a different .gz sum.
    """

    name: str
    shape: tuple[int, ...]
    md5: str | None = None
    gz_md5: str | None = None

    def __post_init__(self) -> None:
        if not (self.md5 or self.gz_md5):
            raise ValueError(f"{self.name}: a FileSpec needs md5, gz_md5 or both")

    @property
    def raw_name(self) -> str:
        """The name of the uncompressed copy: the same name without ``.gz``."""
        return self.name.removesuffix(".gz")


@dataclass(frozen=True)
class DatasetSpec:
    """What a dataset's four files are called, what they hold and where to download them."""

    name: str
    files: Mapping[str, FileSpec]  # keyed by the names in ROLES
    mirrors: tuple[str, ...] = ()  # base URLs, tried in order
    num_classes: int = 10

    def __post_init__(self) -> None:
        if set(self.files) != set(ROLES):
            raise ValueError(f"{self.name}: files must be keyed by exactly {', '.join(ROLES)}")
        # Callers may pass a list; a tuple keeps the frozen spec from changing under them.
        object.__setattr__(self, "mirrors", tuple(self.mirrors))

    @property
    def file_names(self) -> tuple[str, ...]:
        return tuple(self.files[role].name for role in ROLES)


_TRAIN_IMAGES = "train-images-idx3-ubyte.gz"
_TRAIN_LABELS = "train-labels-idx1-ubyte.gz"
_TEST_IMAGES = "t10k-images-idx3-ubyte.gz"
_TEST_LABELS = "t10k-labels-idx1-ubyte.gz"

DATASETS: dict[str, DatasetSpec] = {
    "mnist": DatasetSpec(
        name="mnist",
        files={
            "train_images": FileSpec(
                _TRAIN_IMAGES,
                (60000, 28, 28),
                md5="6bbc9ace898e44ae57da46a324031adb",
                gz_md5="f68b3c2dcbeaaa9fbdd348bbdeb94873",
            ),
            "train_labels": FileSpec(
                _TRAIN_LABELS,
                (60000,),
                md5="a25bea736e30d166cdddb491f175f624",
                gz_md5="d53e105ee54ea40749a09fcbcd1e9432",
            ),
            "test_images": FileSpec(
                _TEST_IMAGES,
                (10000, 28, 28),
                md5="2646ac647ad5339dbf082846283269ea",
                gz_md5="9fb629c4189551a2d022fa330f9573f3",
            ),
            "test_labels": FileSpec(
                _TEST_LABELS,
                (10000,),
                md5="27ae3e4e09519cfbb04c329615203637",
                gz_md5="ec29112dd5afa0611ce80d1b7f02629c",
            ),
        },
        mirrors=(
            "https://ossci-datasets.s3.amazonaws.com/mnist/",
            "https://storage.googleapis.com/cvdf-datasets/mnist/",
        ),
    ),
    # Only the published .gz sums are recorded for Fashion-MNIST; an uncompressed copy of it
    # therefore cannot be checksummed (verify_file says so by returning None).
    "fashion-mnist": DatasetSpec(
        name="fashion-mnist",
        files={
            "train_images": FileSpec(
                _TRAIN_IMAGES, (60000, 28, 28), gz_md5="8d4fb7e6c68d591d4c3dfef9ec88bf0d"
            ),
            "train_labels": FileSpec(
                _TRAIN_LABELS, (60000,), gz_md5="25c81989df183df01b3e8a0aad5dffbe"
            ),
            "test_images": FileSpec(
                _TEST_IMAGES, (10000, 28, 28), gz_md5="bef4ecab320f06d8554ea6380940ec79"
            ),
            "test_labels": FileSpec(
                _TEST_LABELS, (10000,), gz_md5="bb300cfdad3c16e7a12a480ee83cd310"
            ),
        },
        mirrors=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
    ),
}

# For click.Choice and help texts.
DATASET_NAMES: tuple[str, ...] = tuple(DATASETS)


def get_spec(dataset: str | DatasetSpec) -> DatasetSpec:
    # Tests and callers with their own data pass a DatasetSpec; everyone else passes a name.
    if isinstance(dataset, DatasetSpec):
        return dataset
    try:
        return DATASETS[dataset]
    except KeyError:
        raise DataError(
            f"unknown dataset {dataset!r}: choose one of {', '.join(DATASET_NAMES)}"
        ) from None


def cache_dir(dataset: str | DatasetSpec) -> Path:
    """The per-user cache folder of a dataset, where downloads go."""
    return graphtrain_cache_dir(get_spec(dataset).name)
