"""MNIST-style datasets: reading IDX files, finding them on disk, downloading them, loading them.

The four files of a dataset are looked for in one place only, chosen in this order:

1. the folder given as ``data_dir`` (the CLI's ``--data-dir``),
2. the folder named by the environment variable ``GRAPHTRAIN_DATA``,
3. the per-user cache, ``$XDG_CACHE_HOME/graphtrain/<dataset>`` (``~/.cache/graphtrain/<dataset>``).

A folder given by the user may hold the files directly or in a ``<dataset>/`` subfolder, and each
file may be kept gzipped (``train-images-idx3-ubyte.gz``) or not (``train-images-idx3-ubyte``).
Only the cache is ever downloaded into: when the user points at a folder, a missing file there is
their mistake to hear about, not something to paper over with a second copy somewhere else.

Every problem with the data raises `DataError`, whose message names the file and what is wrong.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import math
import os
import struct
import sys
import tempfile
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphtrain.errors import DataError

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
    "print_to_stderr",
    "read_idx",
    "verify_file",
]

# The four files of a dataset, named after the `Dataset` fields they become.
ROLES = ("train_images", "train_labels", "test_images", "test_labels")

# IDX data type codes. The format stores multi-byte values big-endian.
_IDX_DTYPES = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

_GZIP_MAGIC = b"\x1f\x8b"

DEFAULT_TIMEOUT_S = 30.0

Log = Callable[[str], None]


def print_to_stderr(message: str) -> None:
    """The default `log`: progress goes to stderr so stdout stays clean for results."""
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# IDX files
# --------------------------------------------------------------------------------------------


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file, gzipped or not, into a native-endian array of its declared shape."""
    path = Path(path)
    data = _read_bytes(path)
    # Decide by content, not by name: some browsers gunzip a download but keep its ".gz" name.
    compressed = data[:2] == _GZIP_MAGIC
    if compressed:
        data = _gunzip(data, str(path))
    elif path.name.endswith(".gz") and data[:2] != b"\x00\x00":
        start = data[:4].hex(" ") or "nothing"
        raise DataError(
            f"{path} is not a gzip file (it starts with {start}) nor an IDX file: "
            "delete it and download it again"
        )
    return _parse_idx(data, path, compressed)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _gunzip(data: bytes, label: str) -> bytes:
    try:
        return gzip.decompress(data)
    # A bad CRC or header is an OSError (BadGzipFile), a cut-off stream an EOFError, and
    # garbage inside the deflate stream a zlib.error.
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(
            f"{label}: corrupted gzip data ({exc}): delete it and download it again"
        ) from exc


def _parse_idx(data: bytes, path: Path, compressed: bool) -> np.ndarray:
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
    dtype = _IDX_DTYPES.get(code)
    if dtype is None:
        known = ", ".join(f"0x{c:02X}" for c in _IDX_DTYPES)
        raise DataError(f"{path}: unknown IDX data type code 0x{code:02X} (known: {known})")
    if ndim == 0:
        raise DataError(f"{path}: the IDX header declares 0 dimensions")
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


# --------------------------------------------------------------------------------------------
# Dataset registry
# --------------------------------------------------------------------------------------------


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


def _get_spec(dataset: str | DatasetSpec) -> DatasetSpec:
    # Tests and callers with their own data pass a DatasetSpec; everyone else passes a name.
    if isinstance(dataset, DatasetSpec):
        return dataset
    try:
        return DATASETS[dataset]
    except KeyError:
        raise DataError(
            f"unknown dataset {dataset!r}: choose one of {', '.join(DATASET_NAMES)}"
        ) from None


# --------------------------------------------------------------------------------------------
# Checksums
# --------------------------------------------------------------------------------------------


def verify_file(path: str | os.PathLike[str], file_spec: FileSpec) -> str | None:
    """Check a file (gzipped or not) against its spec's checksums.

    Returns which sum matched ("md5" or "gz_md5"), or None for an uncompressed file whose spec
    only knows the .gz sum, since there is nothing to compare it with. Raises DataError on a
    mismatch, naming the file, the expected and the actual sums.
    """
    path = Path(path)
    return _check_sums(_read_bytes(path), file_spec, str(path))


def _md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def _check_sums(data: bytes, file_spec: FileSpec, label: str) -> str | None:
    mismatches = []
    if data[:2] == _GZIP_MAGIC:
        if file_spec.gz_md5:
            actual = _md5(data)
            if actual == file_spec.gz_md5:
                return "gz_md5"
            mismatches.append(f"expected .gz md5 {file_spec.gz_md5}, got {actual}")
        # Only worth decompressing when there is an uncompressed sum to compare with.
        raw = _gunzip(data, label) if file_spec.md5 else b""
    else:
        raw = data
    if file_spec.md5:
        actual = _md5(raw)
        if actual == file_spec.md5:
            return "md5"
        mismatches.append(f"expected md5 {file_spec.md5} of the uncompressed data, got {actual}")
    if not mismatches:
        return None
    raise DataError(f"{label}: checksum mismatch: {'; '.join(mismatches)}")


# --------------------------------------------------------------------------------------------
# Finding the files
# --------------------------------------------------------------------------------------------


def cache_dir(dataset: str | DatasetSpec) -> Path:
    """The per-user cache folder of a dataset, where downloads go."""
    spec = _get_spec(dataset)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says to ignore a relative XDG_CACHE_HOME.
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "graphtrain" / spec.name


@dataclass(frozen=True)
class FileLookup:
    """Where a dataset's files were looked for and what was found."""

    dataset: str
    found: dict[str, Path]  # role -> file, from the best folder searched
    missing: tuple[str, ...]  # file names (as the spec names them) not found there
    searched: tuple[Path, ...]  # every folder looked in, in order
    explicit: bool  # the folders came from data_dir or GRAPHTRAIN_DATA, not the cache
    folder: Path | None  # the folder holding all four files, when complete

    @property
    def complete(self) -> bool:
        return not self.missing

    def missing_message(self, reason: str | None = None) -> str:
        """A message telling the user what is missing, where it was looked for, and what to do."""
        total = len(self.found) + len(self.missing)
        lines = [f"{self.dataset}: {len(self.missing)} of {total} files missing:"]
        lines += [f"  {name}" for name in self.missing]
        lines.append("(each may also be stored uncompressed, without the .gz)")
        lines.append("Looked in:")
        for folder in self.searched:
            note = "" if folder.is_dir() else " (does not exist)"
            lines.append(f"  {folder}{note}")
        if reason:
            lines.append(reason)
        lines.append(
            "To use copies you already have, pass --data-dir DIR or set GRAPHTRAIN_DATA=DIR, "
            f"where DIR holds the files or a {self.dataset}/ subfolder with them; "
            "to fetch them, run `graphtrain data download`."
        )
        return "\n".join(lines)


def _folders_to_search(spec: DatasetSpec, data_dir: str | os.PathLike[str] | None):
    # Absolute paths, so messages and Dataset.source do not depend on the working directory.
    if data_dir is not None:
        root = Path(data_dir).expanduser().absolute()
        return [root, root / spec.name], True
    env = os.environ.get("GRAPHTRAIN_DATA", "")
    if env:
        root = Path(env).expanduser().absolute()
        return [root, root / spec.name], True
    return [cache_dir(spec)], False


def _files_in(folder: Path, spec: DatasetSpec) -> dict[str, Path]:
    found = {}
    for role in ROLES:
        file_spec = spec.files[role]
        # The gzipped name first: it is what downloads produce and what the checksums cover.
        for candidate in (folder / file_spec.name, folder / file_spec.raw_name):
            if candidate.is_file():
                found[role] = candidate
                break
    return found


def find_files(
    dataset: str | DatasetSpec, data_dir: str | os.PathLike[str] | None = None
) -> FileLookup:
    """Look for a dataset's four files; never raises for missing files, it reports them."""
    spec = _get_spec(dataset)
    folders, explicit = _folders_to_search(spec, data_dir)
    # All four files must come from one folder, so that train and test data of different
    # copies (or datasets) are never mixed. Short of that, report the folder closest to it.
    best_folder, best = folders[0], {}
    for folder in folders:
        found = _files_in(folder, spec)
        if len(found) == len(ROLES):
            best_folder, best = folder, found
            break
        if len(found) > len(best):
            best_folder, best = folder, found
    missing = tuple(spec.files[role].name for role in ROLES if role not in best)
    return FileLookup(
        dataset=spec.name,
        found=best,
        missing=missing,
        searched=tuple(folders),
        explicit=explicit,
        folder=None if missing else best_folder,
    )


# --------------------------------------------------------------------------------------------
# Downloading
# --------------------------------------------------------------------------------------------


def _mirror_urls(spec: DatasetSpec, mirrors: Sequence[str] | None) -> list[str]:
    bases = list(spec.mirrors if mirrors is None else mirrors)
    # Users behind a proxy or with a local mirror set this; it goes first so the public
    # mirrors are only tried when it fails.
    env = os.environ.get("GRAPHTRAIN_MIRROR", "").strip()
    if env:
        bases.insert(0, env)
    return list(dict.fromkeys(bases))  # drop repeats, keep order


def _url(base: str, name: str) -> str:
    # Mirrors are given as folder URLs; accept them with or without the final slash.
    return (base if base.endswith("/") else base + "/") + name


def _size_text(length: str | None) -> str:
    if length is None or not length.isdigit():
        return "size unknown"
    return f"{int(length) / 1e6:.1f} MB"


class _Unreachable(DataError):
    """No connection to the mirror at all (no DNS, refused, no answer): skip it from now on."""


def _fetch(base: str, name: str, timeout: float, log: Log) -> bytes:
    url = _url(base, name)
    # A plain name lets mirrors that refuse the default Python agent serve us too.
    request = urllib.request.Request(url, headers={"User-Agent": "graphtrain"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            size = _size_text(response.headers.get("Content-Length"))
            log(f"graphtrain: fetching {name} from {base} ({size})")
            # The largest file is about 30 MB: holding it in memory lets it be verified before
            # anything touches the disk.
            return response.read()
    except urllib.error.HTTPError as exc:
        raise DataError(f"{url}: HTTP {exc.code} {exc.reason}") from exc
    except urllib.error.URLError as exc:
        raise _Unreachable(f"{url}: {exc.reason}") from exc
    except TimeoutError as exc:
        raise DataError(f"{url}: no answer within {timeout:g} s") from exc
    # A dropped connection (OSError), a short read (HTTPException) or a URL urllib cannot
    # open (ValueError) all mean: try the next mirror.
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise DataError(f"{url}: {exc}") from exc


def _fsync_folder(folder: Path) -> None:
    # Makes the rename itself durable; not possible on every platform, and not essential.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomically(target: Path, data: bytes) -> None:
    """Write `data` to `target` so that `target` is either absent, the old file, or complete."""
    try:
        # Same folder as the target, so os.replace is a rename within one file system.
        fd, temp_name = tempfile.mkstemp(
            dir=target.parent, prefix=f".{target.name}.", suffix=".part"
        )
    except OSError as exc:
        raise DataError(f"cannot write into {target.parent}: {exc.strerror or exc}") from exc
    temp = Path(temp_name)
    replaced = False
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        # mkstemp makes files readable by their owner only; data files are for everyone.
        os.chmod(temp, 0o644)
        os.replace(temp, target)
        replaced = True
    except OSError as exc:
        raise DataError(f"cannot write {target}: {exc.strerror or exc}") from exc
    finally:
        # Whatever stopped us (a full disk, Ctrl-C), no half-written file stays behind.
        if not replaced:
            temp.unlink(missing_ok=True)
    _fsync_folder(target.parent)


def _has_valid_copy(dest: Path, file_spec: FileSpec, log: Log) -> bool:
    for path in (dest / file_spec.name, dest / file_spec.raw_name):
        if not path.is_file():
            continue
        try:
            verify_file(path, file_spec)
        except DataError as exc:
            log(f"graphtrain: {exc}; fetching it again")
            return False
        log(f"graphtrain: already have {path}")
        return True
    return False


def download(
    dataset: str | DatasetSpec,
    dest: str | os.PathLike[str] | None = None,
    mirrors: Sequence[str] | None = None,
    log: Log = print_to_stderr,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Path:
    """Fetch the dataset's files that `dest` (default: the cache) lacks; return `dest`.

    Each file is tried on $GRAPHTRAIN_MIRROR, then on each of `mirrors` (default: the spec's)
    in turn, checked against its checksum, and only then written, atomically. Files already
    present and valid are kept. Raises DataError listing every file that no mirror provided.
    """
    spec = _get_spec(dataset)
    dest = Path(dest).expanduser() if dest is not None else cache_dir(spec)
    bases = _mirror_urls(spec, mirrors)
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create the folder {dest}: {exc.strerror or exc}") from exc

    # Keep going after a file fails, so one bad file does not cost the others and the error
    # can list everything still missing.
    failures: dict[str, list[str]] = {}
    # Without this, a machine with no network would wait out every timeout once per file.
    unreachable: set[str] = set()
    for role in ROLES:
        file_spec = spec.files[role]
        if _has_valid_copy(dest, file_spec, log):
            continue
        reasons = []
        for base in bases:
            if base in unreachable:
                reasons.append(f"{_url(base, file_spec.name)}: skipped, unreachable before")
                continue
            try:
                data = _fetch(base, file_spec.name, timeout, log)
                _check_sums(data, file_spec, _url(base, file_spec.name))
            except DataError as exc:
                if isinstance(exc, _Unreachable):
                    unreachable.add(base)
                reasons.append(str(exc))
                log(f"graphtrain: {exc}")
                continue
            _write_atomically(dest / file_spec.name, data)
            break
        else:
            failures[file_spec.name] = reasons or ["no mirror to download from"]

    if failures:
        lines = [
            f"could not download {len(failures)} of {len(ROLES)} {spec.name} files into {dest}:"
        ]
        for name, reasons in failures.items():
            lines.append(f"  {name}:")
            lines += [f"    {reason}" for reason in reasons]
        lines.append(
            "Nothing was written for these files. Set GRAPHTRAIN_MIRROR=URL to try another "
            "mirror, or fetch them by hand and pass --data-dir DIR."
        )
        raise DataError("\n".join(lines))
    return dest


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)  # eq=False: comparing arrays with == gives arrays, not bools
class Dataset:
    """A classification dataset ready for training: images flattened to float32 in [0, 1]."""

    name: str
    train_images: np.ndarray  # float32 (N, num_features)
    train_labels: np.ndarray  # int32 (N,)
    test_images: np.ndarray  # float32 (M, num_features)
    test_labels: np.ndarray  # int32 (M,)
    num_classes: int = 10
    source: Path | None = None  # the folder the files came from; None when not from files

    @property
    def num_features(self) -> int:
        return int(self.train_images.shape[1])

    @classmethod
    def synthetic(
        cls,
        n_train: int,
        n_test: int,
        seed: int = 0,
        num_features: int = 784,
        num_classes: int = 10,
    ) -> Dataset:
        """A small random dataset a classifier can learn, for tests that need no files."""
        if min(n_train, n_test) < 0 or num_features < 1 or num_classes < 1:
            raise ValueError("synthetic: sizes must be non-negative, features and classes >= 1")
        rng = np.random.default_rng(seed)
        # Each class has its own mean image and samples are that mean plus noise: learnable
        # by a linear model, yet not so clean that a broken trainer would look fine.
        means = rng.uniform(0.0, 1.0, size=(num_classes, num_features))

        def sample(n: int) -> tuple[np.ndarray, np.ndarray]:
            # Balanced classes, shuffled, so even tiny sets contain every class.
            labels = rng.permutation(np.arange(n) % num_classes).astype(np.int32)
            noise = rng.normal(0.0, 0.3, size=(n, num_features))
            images = np.clip(means[labels] + noise, 0.0, 1.0).astype(np.float32)
            return images, labels

        train_images, train_labels = sample(n_train)
        test_images, test_labels = sample(n_test)
        return cls(
            name="synthetic",
            train_images=train_images,
            train_labels=train_labels,
            test_images=test_images,
            test_labels=test_labels,
            num_classes=num_classes,
        )


def _read_split(
    spec: DatasetSpec, files: Mapping[str, Path], split: str
) -> tuple[np.ndarray, np.ndarray]:
    images_path, labels_path = files[f"{split}_images"], files[f"{split}_labels"]
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.dtype != np.uint8 or images.ndim != 3:
        raise DataError(
            f"{images_path}: expected images as a 3-dimensional uint8 IDX array "
            f"(count, rows, columns), found a {images.ndim}-dimensional {images.dtype} array"
        )
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise DataError(
            f"{labels_path}: expected labels as a 1-dimensional uint8 IDX array, "
            f"found a {labels.ndim}-dimensional {labels.dtype} array"
        )
    # Checked before the shapes, because a count mismatch explains a wrong shape better.
    if len(images) != len(labels):
        raise DataError(
            f"{images_path} holds {len(images)} images but {labels_path} holds "
            f"{len(labels)} labels: the counts must agree"
        )
    for path, array, role in ((images_path, images, "images"), (labels_path, labels, "labels")):
        expected = tuple(spec.files[f"{split}_{role}"].shape)
        if array.shape != expected:
            raise DataError(
                f"{path}: expected shape {expected} for {spec.name}, found {array.shape}"
            )
    if labels.size and int(labels.max()) >= spec.num_classes:
        index = int(np.argmax(labels >= spec.num_classes))
        raise DataError(
            f"{labels_path}: label {int(labels[index])} at index {index} is out of range: "
            f"{spec.name} has {spec.num_classes} classes (0 to {spec.num_classes - 1})"
        )
    flat = images.reshape(len(images), -1).astype(np.float32)
    flat /= 255.0
    return flat, labels.astype(np.int32)


def load(
    dataset: str | DatasetSpec = "mnist",
    data_dir: str | os.PathLike[str] | None = None,
    offline: bool = False,
    log: Log = print_to_stderr,
) -> Dataset:
    """Find (or, into the cache, download) a dataset's files and load them.

    Downloads only when nothing points at a folder (no `data_dir`, no GRAPHTRAIN_DATA) and
    `offline` is False. Checks the files' structure, not their checksums (see `verify_file`).
    """
    spec = _get_spec(dataset)
    lookup = find_files(spec, data_dir)
    if not lookup.complete:
        if offline:
            raise DataError(lookup.missing_message("Not downloading: offline mode."))
        if lookup.explicit:
            raise DataError(
                lookup.missing_message(
                    "Not downloading: a folder was given (--data-dir or GRAPHTRAIN_DATA)."
                )
            )
        dest = cache_dir(spec)
        log(f"graphtrain: downloading {spec.name} into {dest}")
        try:
            download(spec, dest=dest, log=log)
        except DataError as exc:
            raise DataError(lookup.missing_message(f"The download failed: {exc}")) from exc
        lookup = find_files(spec)
        if not lookup.complete:
            raise DataError(lookup.missing_message("The download did not provide them."))

    train_images, train_labels = _read_split(spec, lookup.found, "train")
    test_images, test_labels = _read_split(spec, lookup.found, "test")
    return Dataset(
        name=spec.name,
        train_images=train_images,
        train_labels=train_labels,
        test_images=test_images,
        test_labels=test_labels,
        num_classes=spec.num_classes,
        source=lookup.folder,
    )
