"""Images a user brings: their own datasets (`.npz`) and the inputs of `predict` (`.npy`, IDX).

One preprocessing rule serves training, evaluation and prediction, and a saved model records it:
each sample is flattened row-major into a float32 vector, and pixels stored as uint8 (0-255)
are divided by 255, while floats must already lie in [0, 1]. Every problem raises `DataError`
naming the file (or array) and what is wrong.
"""

from __future__ import annotations

import math
import os
import zipfile
import zlib
from pathlib import Path

import numpy as np

from graphtrain.data.idx import read_idx
from graphtrain.errors import DataError
from graphtrain.files import read_input

PREPROCESSING = "each sample flattened row-major to float32; uint8 pixels divided by 255, floats in [0, 1] as they are"
# The cnn recipe's input normalisation (train_mnist_fast's): MNIST's pixel mean and standard
# deviation in [0, 1]; the features are fed to the cnn as (x − mean) / std.
MNIST_NORMALISATION = (0.1307, 0.3081)
NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK\x03\x04"


def to_features(images: np.ndarray, what: str) -> np.ndarray:
    """(N, ...) uint8 0-255 or float 0-1 -> float32 (N, features) in [0, 1]."""
    images = np.asarray(images)
    if images.ndim < 2 or images.shape[0] == 0 or 0 in images.shape:
        raise DataError(f"{what}: expected a non-empty array of samples, shape (N, features) or (N, height, "
                        f"width), found shape {images.shape}")
    flat = images.reshape(len(images), -1)
    if images.dtype == np.uint8:
        features = flat.astype(np.float32)
        features /= 255.0
        return features
    if images.dtype.kind != "f":
        raise DataError(f"{what}: pixels must be uint8 (0-255) or floats (0-1), found {images.dtype}")
    features = flat.astype(np.float32)
    low, high = float(features.min()), float(features.max())
    if not (math.isfinite(low) and math.isfinite(high)):
        raise DataError(f"{what}: holds NaN or infinite values")
    if low < 0.0 or high > 1.0:
        raise DataError(f"{what}: float pixels must lie in [0, 1], found values from {low:g} to {high:g} "
                        "(uint8 pixels 0-255 are divided by 255; floats are taken as they are)")
    return features


def normalise(features: np.ndarray, mean: float, std: float) -> np.ndarray:
    """(features − mean) / std in float32: what a model trained on normalised inputs is fed. Each
    operation rounds to float32 (mean and std taken as float32), in one new array: a training set
    of 47 M pixels is two passes, not three and a copy."""
    out = np.subtract(np.asarray(features, np.float32), np.float32(mean))
    np.divide(out, np.float32(std), out=out)
    return out


def check_sample_shape(images: np.ndarray, in_features: int, image_shape: tuple[int, ...] | None,
                       what: str) -> None:
    """Inputs for a model: (N, in_features) or (N, *image_shape) as the model was trained."""
    sample = tuple(images.shape[1:])
    if sample == (in_features,) or (image_shape and sample == tuple(image_shape)):
        return
    wanted = f"(N, {in_features})"
    if image_shape and tuple(image_shape) != (in_features,):
        wanted += f" or (N, {', '.join(map(str, image_shape))})"
    raise DataError(f"{what}: the model takes samples of shape {wanted}, found {images.shape}")


def check_labels(labels: np.ndarray, count: int, what: str, classes: int | None = None) -> np.ndarray:
    """1-D integer labels, one per sample, each in [0, classes); returned as int32."""
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise DataError(f"{what}: expected 1-dimensional integer labels, found a {labels.ndim}-dimensional "
                        f"{labels.dtype} array")
    if len(labels) != count:
        raise DataError(f"{what}: {len(labels)} labels for {count} samples: the counts must agree")
    low = int(labels.min()) if len(labels) else 0
    if low < 0:
        index = int(np.argmin(labels))
        raise DataError(f"{what}: label {low} at index {index} is negative")
    if classes is not None and len(labels) and int(labels.max()) >= classes:
        index = int(np.argmax(labels >= classes))
        raise DataError(f"{what}: label {int(labels[index])} at index {index} is out of range: "
                        f"the training labels have {classes} classes (0 to {classes - 1})")
    return labels.astype(np.int32)


def number_ranges(numbers) -> str:
    """Sorted whole numbers as runs: [3, 4, 5, 9] -> "3 to 5, 9"."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(lo) if lo == hi else f"{lo}, {hi}" if hi == lo + 1 else f"{lo} to {hi}" for lo, hi in runs)


def empty_classes_warning(train_labels: np.ndarray, classes: int, what: str) -> str | None:
    """The classes 0 to `classes` - 1 with no training sample, named (None: every class has one).
    The classes are counted from the largest label, so a stray label (a 99 among 0 to 2) makes a
    model with outputs that never see a sample: trained as asked, but said."""
    counts = np.bincount(train_labels, minlength=classes)
    empty = np.flatnonzero(counts == 0)
    if not len(empty):
        return None
    present = np.flatnonzero(counts)
    return (f"{what}: classes {number_ranges(empty.tolist())} have no training sample (the labels are "
            f"{number_ranges(present.tolist())}): the model gets {classes} outputs, one per class from 0 to the "
            f"largest label {classes - 1}; if a label is a mistake, fix it or drop its samples")


def arrays_to_splits(x_train, y_train, x_test, y_test, label: str = "arrays"):
    """Checked, preprocessed train and test splits, the classes and the per-sample shape.

    The classes are 0 to the largest training label; test labels must lie among them.
    """
    x_train, x_test = np.asarray(x_train), np.asarray(x_test)
    train_images = to_features(x_train, f"{label}: x_train")
    test_images = to_features(x_test, f"{label}: x_test")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError(f"{label}: x_train samples have shape {x_train.shape[1:]} but x_test samples "
                        f"{x_test.shape[1:]}: they must agree")
    train_labels = check_labels(y_train, len(train_images), f"{label}: y_train")
    classes = int(train_labels.max()) + 1
    if classes < 2:
        raise DataError(f"{label}: y_train holds a single class ({classes - 1}); a classifier needs two or more")
    test_labels = check_labels(y_test, len(test_images), f"{label}: y_test", classes)
    return (train_images, train_labels, test_images, test_labels, classes, tuple(x_train.shape[1:]))


def read_npz(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The four arrays of an mnist.npz-style file: x_train, y_train, x_test, y_test."""
    path = Path(path)
    if read_input(path, DataError, len(_ZIP_MAGIC)) != _ZIP_MAGIC:
        raise DataError(f"{path}: not an .npz archive (np.savez writes one, with x_train, y_train, x_test "
                        "and y_test)")
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [key for key in NPZ_KEYS if key not in archive.files]
            if missing:
                raise DataError(f"{path}: missing {', '.join(missing)}; an .npz dataset holds x_train, "
                                f"y_train, x_test and y_test (found: {', '.join(archive.files) or 'nothing'})")
            return {key: archive[key] for key in NPZ_KEYS}
    # A cut-off or damaged archive is a BadZipFile, EOFError or zlib.error; np.load says
    # ValueError for object arrays (which would need pickle) and members it cannot parse.
    except (zipfile.BadZipFile, EOFError, zlib.error, ValueError, OSError) as exc:
        raise DataError(f"{path}: cannot read it as an .npz archive: {exc}") from exc


def read_images(path: str | os.PathLike[str]) -> np.ndarray:
    """Images to predict on: a .npy array, or an IDX images file (gzipped or not)."""
    path = Path(path)
    start = read_input(path, DataError, len(_NPY_MAGIC))
    if start != _NPY_MAGIC:
        return read_idx(path)
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, EOFError, OSError) as exc:
        raise DataError(f"{path}: cannot read it as a .npy array: {exc}") from exc
