"""Finding a dataset's files on disk and loading them, downloading them into the cache if need be.

The four files of a dataset are looked for in one place only, chosen in this order:

1. the folder given as ``data_dir`` (the CLI's ``--data-dir``),
2. the folder named by the environment variable ``GRAPHTRAIN_DATA``,
3. the per-user cache, ``$XDG_CACHE_HOME/graphtrain/<dataset>`` (``~/.cache/graphtrain/<dataset>``).

A folder given by the user may hold the files directly or in a ``<dataset>/`` subfolder, and each
file may be kept gzipped (``train-images-idx3-ubyte.gz``) or not (``train-images-idx3-ubyte``).
Only the cache is ever downloaded into: when the user points at a folder, a missing file there is
their mistake to hear about, not something to paper over with a second copy somewhere else.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from graphtrain import terminal
from graphtrain.data.registry import AXES, ROLES, DatasetSpec, cache_dir, get_spec
from graphtrain.errors import DataError, DownloadError
from graphtrain.terminal import Log

if TYPE_CHECKING:
    import numpy as np

# numpy and the readers are imported where they are used, so that the command line, which names
# the datasets, starts without them.

# --------------------------------------------------------------------------------------------
# Finding the files
# --------------------------------------------------------------------------------------------


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

    def missing_message(self, reason: str | None = None, downloaded: bool = False) -> str:
        """A few lines: what is missing, where it was looked for, why it was not fetched, and the
        ways out (after a failed download, `downloaded`, not that download again)."""
        total = len(self.found) + len(self.missing)

        def where(folder: Path) -> str:
            return f"{folder}" + ("" if folder.is_dir() else " (not a folder)" if folder.exists()
                                  else " (does not exist)")

        lines = [f"{self.dataset}: {len(self.missing)} of {total} files missing "
                 f"({', '.join(self.missing)}; each .gz or not) in {' or '.join(map(where, self.searched))}"]
        if reason:
            lines.append(reason)
        ways = (f"use copies you have with --data-dir DIR or GRAPHTRAIN_DATA=DIR (the files in DIR or "
                f"DIR/{self.dataset}/)")
        if downloaded:
            ways += ", or copy them into the cache with GRAPHTRAIN_MIRROR=file:///DIR/ graphtrain data download"
        else:
            ways += ", or fetch them with `graphtrain data download`"
        lines.append(ways[0].upper() + ways[1:] + ".")
        return "\n".join(lines)


def _folders_to_search(spec: DatasetSpec, data_dir: str | os.PathLike[str] | None):
    """(folders, explicit): the user's folder and its <dataset>/ subfolder, or the cache."""
    given = ("--data-dir", data_dir) if data_dir is not None else ("GRAPHTRAIN_DATA",
                                                                      os.environ.get("GRAPHTRAIN_DATA"))
    if not given[1]:
        return [cache_dir(spec)], False
    # Absolute paths, so messages and Dataset.source do not depend on the working directory.
    root = Path(given[1]).expanduser().absolute()
    if root.exists() and not root.is_dir():
        raise DataError(f"{root} (given as {given[0]}) is not a folder: give the folder that "
                        f"holds the {spec.name} files")
    return [root, root / spec.name], True


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
    spec = get_spec(dataset)
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
    source: Path | None = None  # the folder or file the data came from; None when not from files
    image_shape: tuple[int, ...] | None = None  # one sample before flattening, e.g. (28, 28)
    warnings: tuple[str, ...] = ()  # what the user should hear about the data (classes with no sample)

    @property
    def num_features(self) -> int:
        return int(self.train_images.shape[1])

    @classmethod
    def from_arrays(cls, x_train, y_train, x_test, y_test, name: str = "arrays",
                    source: Path | None = None) -> Dataset:
        """A dataset from arrays of any sample shape and any number of classes.

        Images are (N, ...) uint8 pixels 0-255 or floats in [0, 1] (see `graphtrain.data.images`);
        labels are integers 0 to classes - 1, the classes being counted from y_train.
        """
        from graphtrain.data.images import arrays_to_splits, empty_classes_warning

        train_images, train_labels, test_images, test_labels, classes, image_shape = arrays_to_splits(
            x_train, y_train, x_test, y_test, label=str(source or name))
        warning = empty_classes_warning(train_labels, classes, f"{source or name}: y_train")
        return cls(name=name, train_images=train_images, train_labels=train_labels,
                   test_images=test_images, test_labels=test_labels, num_classes=classes,
                   source=source, image_shape=image_shape, warnings=(warning,) if warning else ())

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
        import numpy as np

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
    import numpy as np

    from graphtrain.data.idx import read_idx
    from graphtrain.data.images import to_features

    images = read_idx(images_path, AXES["images"])
    labels = read_idx(labels_path, AXES["labels"])
    for path, array, role in ((images_path, images, "images"), (labels_path, labels, "labels")):
        if array.dtype != np.uint8:
            raise DataError(f"{path}: expected {role} as uint8, found {array.dtype}")
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
    return to_features(images, str(images_path)), labels.astype(np.int32)


CACHE_ADVICE = "delete it, and graphtrain downloads it again on the next run"


def load(
    dataset: str | DatasetSpec = "mnist",
    data_dir: str | os.PathLike[str] | None = None,
    offline: bool = False,
    log: Log = terminal.log,
) -> Dataset:
    """Find (or, into the cache, download) a dataset's files and load them.

    Downloads only when nothing points at a folder (no `data_dir`, no GRAPHTRAIN_DATA) and
    `offline` is False. Checks the files' structure, then that they are the dataset named: their
    md5 sums against the recorded ones (see `check_identity`), when it decodes them; the decoded
    arrays are then cached, and read back while the files stay as they were (graphtrain.data.cache).
    """
    spec = get_spec(dataset)
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
        from graphtrain.data.fetch import download  # http.client, only when downloading

        dest = cache_dir(spec)
        log(f"graphtrain: downloading {spec.name} into {dest}")
        try:
            download(spec, dest=dest, log=log)
        except DownloadError as exc:
            raise DownloadError(lookup.missing_message(f"The download failed: {exc.summary}.",
                                                       downloaded=True)) from exc
        lookup = find_files(spec)

    def decode() -> dict[str, np.ndarray]:
        from graphtrain.data.fetch import check_identity  # reads every file's sums: on a decode only

        try:
            train_images, train_labels = _read_split(spec, lookup.found, "train")
            test_images, test_labels = _read_split(spec, lookup.found, "test")
        except DataError as exc:
            # The user's own files are theirs to replace; the cache's, graphtrain fetches again.
            raise DataError(f"{exc}: {'replace it with a good copy' if lookup.explicit else CACHE_ADVICE}") from exc
        try:  # well-formed files: are they the dataset named?
            for role in ROLES:
                check_identity(lookup.found[role], spec, role)
        except DataError as exc:
            raise DataError(str(exc) if lookup.explicit else f"{exc}: {CACHE_ADVICE}") from exc
        return {"train_images": train_images, "train_labels": train_labels, "test_images": test_images,
                "test_labels": test_labels}

    from graphtrain.data import cache as array_cache

    # Decoded and checked once, then read back from the dataset cache while the files keep their
    # size and modification time (graphtrain.data.cache).
    arrays = array_cache.load(array_cache.cache_path(spec.name, lookup.folder), lookup.found, decode, log)
    return Dataset(
        name=spec.name,
        **arrays,
        num_classes=spec.num_classes,
        source=lookup.folder,
        image_shape=spec.files["train_images"].shape[1:],
    )


def load_npz(path: str | os.PathLike[str]) -> Dataset:
    """A dataset from one .npz file in the mnist.npz layout: x_train, y_train, x_test, y_test."""
    path = Path(path).expanduser().absolute()
    from graphtrain.data.images import read_npz

    return Dataset.from_arrays(**read_npz(path), name=path.stem, source=path)
