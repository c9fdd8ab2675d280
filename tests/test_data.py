"""Tests of graphtrain.data: IDX parsing, file lookup, downloads over HTTP, loading."""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import os
import struct
import threading
from pathlib import Path

import click
import numpy as np
import pytest

from graphtrain import data
from graphtrain.data import DATASETS, ROLES, Dataset, DatasetSpec, FileSpec
from graphtrain.errors import DataError, DownloadError, UsageError

from conftest import real_mnist

# Read before the autouse fixture below clears it, so the real-MNIST test can still use it.
_USER_DATA_DIR = os.environ.get("GRAPHTRAIN_DATA", "")

_IDX_CODES = {"u1": 0x08, "i1": 0x09, "i2": 0x0B, "i4": 0x0C, "f4": 0x0D, "f8": 0x0E}


@pytest.fixture(autouse=True)
def isolated_environment(tmp_path, monkeypatch):
    """Keep every test away from the user's data, cache, mirror and proxy settings."""
    for name in ("GRAPHTRAIN_DATA", "GRAPHTRAIN_MIRROR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    # urllib honours these; the local test server must be reached directly.
    for name in (
        "http_proxy",
        "HTTP_PROXY",
        "https_proxy",
        "HTTPS_PROXY",
        "all_proxy",
        "ALL_PROXY",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def idx_bytes(array: np.ndarray) -> bytes:
    """The uncompressed IDX encoding of `array`."""
    big_endian = array.astype(array.dtype.newbyteorder(">"))
    code = _IDX_CODES[array.dtype.kind + str(array.dtype.itemsize)]
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + big_endian.tobytes()


def write_idx(path: Path, array: np.ndarray) -> Path:
    """Write `array` as IDX, gzipped when the name ends with .gz."""
    payload = idx_bytes(array)
    if path.name.endswith(".gz"):
        payload = gzip.compress(payload, mtime=0)
    path.write_bytes(payload)
    return path


def md5(payload: bytes) -> str:
    return hashlib.md5(payload).hexdigest()


def tiny_arrays(n_train: int = 6, n_test: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "train_images": rng.integers(0, 256, size=(n_train, 28, 28), dtype=np.uint8),
        "train_labels": (np.arange(n_train) % 10).astype(np.uint8),
        "test_images": rng.integers(0, 256, size=(n_test, 28, 28), dtype=np.uint8),
        "test_labels": (np.arange(n_test) % 10).astype(np.uint8),
    }


def tiny_spec(
    arrays: dict[str, np.ndarray], mirrors=(), name: str = "tiny", sums="both"
) -> DatasetSpec:
    """A spec for `arrays` stored under the MNIST file names, with matching checksums."""
    files = {}
    for role, file_spec in DATASETS["mnist"].files.items():
        raw = idx_bytes(arrays[role])
        files[role] = FileSpec(
            name=file_spec.name,
            shape=arrays[role].shape,
            md5=md5(raw) if sums in ("both", "md5") else None,
            gz_md5=md5(gzip.compress(raw, mtime=0)) if sums in ("both", "gz") else None,
        )
    return DatasetSpec(name=name, files=files, mirrors=tuple(mirrors))


def write_dataset(folder: Path, spec: DatasetSpec, arrays, gz: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for role in ROLES:
        file_spec = spec.files[role]
        write_idx(folder / (file_spec.name if gz else file_spec.raw_name), arrays[role])
    return folder


# --------------------------------------------------------------------------------------------
# IDX reader
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["x-idx3-ubyte.gz", "x-idx3-ubyte"])
@pytest.mark.parametrize("dtype", ["u1", "i1", ">i2", ">i4", ">f4", ">f8"])
def test_read_idx_round_trip(tmp_path, name, dtype):
    array = (np.arange(2 * 3 * 4) - 5).reshape(2, 3, 4).astype(dtype)
    result = data.read_idx(write_idx(tmp_path / name, array))
    assert result.shape == (2, 3, 4)
    assert result.dtype.isnative
    assert result.dtype == np.dtype(dtype).newbyteorder("=")
    np.testing.assert_array_equal(result, array)


def test_read_idx_labels_are_uint8_vectors(tmp_path):
    labels = np.array([3, 1, 4, 1, 5], dtype=np.uint8)
    result = data.read_idx(write_idx(tmp_path / "l-idx1-ubyte.gz", labels))
    assert result.dtype == np.uint8 and result.shape == (5,)


def test_read_idx_accepts_gunzipped_file_with_gz_name(tmp_path):
    # Browsers sometimes gunzip a download but keep its .gz name.
    path = tmp_path / "x.gz"
    path.write_bytes(idx_bytes(np.ones((2, 2), np.uint8)))
    assert data.read_idx(path).shape == (2, 2)


def _expect_error(path: Path, *fragments: str) -> str:
    with pytest.raises(DataError) as info:
        data.read_idx(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message
    return message


def test_bad_magic(tmp_path):
    path = tmp_path / "bad-magic"
    path.write_bytes(b"\x01\x02\x08\x01" + struct.pack(">I", 1) + b"\x00")
    _expect_error(path, "magic")


def test_unknown_dtype_code(tmp_path):
    path = tmp_path / "bad-type"
    path.write_bytes(b"\x00\x00\x0a\x01" + struct.pack(">I", 1) + b"\x00")
    _expect_error(path, "unknown IDX data type code 0x0A")


def test_too_short_and_zero_dimensions(tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"\x00\x00")
    _expect_error(short, "too short")
    zero = tmp_path / "zero-dims"
    zero.write_bytes(b"\x00\x00\x08\x00")
    _expect_error(zero, "0 dimensions")
    header = tmp_path / "cut-header"
    header.write_bytes(b"\x00\x00\x08\x03" + struct.pack(">I", 5))
    _expect_error(header, "truncated IDX header", "16 bytes")


@pytest.mark.parametrize("name", ["t-idx3-ubyte", "t-idx3-ubyte.gz"])
def test_truncated(tmp_path, name):
    raw = idx_bytes(np.zeros((3, 28, 28), np.uint8))  # 16 + 2352 bytes
    cut = raw[:-100]
    path = tmp_path / name
    path.write_bytes(gzip.compress(cut) if name.endswith(".gz") else cut)
    _expect_error(path, "truncated", f"needs {len(raw)} bytes", str(len(cut)), "100 missing")


def test_trailing_bytes(tmp_path):
    raw = idx_bytes(np.zeros((3, 4), np.uint8))
    path = tmp_path / "trailing"
    path.write_bytes(raw + b"extra")
    _expect_error(path, "5 unexpected trailing bytes", f"needs {len(raw)} bytes")


def test_corrupted_gzip_bad_crc(tmp_path):
    payload = bytearray(gzip.compress(idx_bytes(np.zeros((3, 4), np.uint8))))
    payload[-8] ^= 0xFF  # the CRC32 in the gzip trailer
    path = tmp_path / "bad-crc.gz"
    path.write_bytes(bytes(payload))
    _expect_error(path, "corrupted gzip")


def test_truncated_gzip_stream(tmp_path):
    payload = gzip.compress(idx_bytes(np.arange(1000, dtype=np.uint8).reshape(10, 100)))
    path = tmp_path / "cut.gz"
    path.write_bytes(payload[: len(payload) // 2])
    _expect_error(path, "corrupted gzip")


def test_not_gzip(tmp_path):
    path = tmp_path / "html.gz"
    path.write_bytes(b"<html>404 Not Found</html>")
    _expect_error(path, "not a gzip file")


def test_missing_file(tmp_path):
    _expect_error(tmp_path / "nope.gz", "no such file")


def test_wrong_number_of_dimensions_is_named_before_the_sizes_are_read(tmp_path):
    """A labels file whose header says 3 dimensions: not 'truncated: a 6x117835012x... array'."""
    labels = np.arange(6, dtype=np.uint8)
    path = tmp_path / "labels-idx1-ubyte"
    path.write_bytes(b"\x00\x00\x08\x03" + struct.pack(">I", 6) + labels.tobytes())
    with pytest.raises(DataError) as info:
        data.read_idx(path, ("count",))
    message = str(info.value)
    assert "expected a 1-dimensional IDX array (count)" in message
    assert "declares 3 dimensions" in message and "truncated" not in message


def test_load_names_the_dimensions_images_and_labels_need(tmp_path):
    arrays = tiny_arrays()
    arrays["test_labels"] = np.zeros((4, 2, 2), np.uint8)  # an images file where labels belong
    message = _load_error(tmp_path, arrays)
    assert "t10k-labels-idx1-ubyte.gz: expected a 1-dimensional IDX array (count)" in message


# --------------------------------------------------------------------------------------------
# Dataset checks on load
# --------------------------------------------------------------------------------------------


def _load_error(tmp_path, arrays, spec=None) -> str:
    spec = spec or tiny_spec(tiny_arrays())
    write_dataset(tmp_path / "d", spec, arrays)
    with pytest.raises(DataError) as info:
        data.load(spec, data_dir=tmp_path / "d", log=pytest.fail)
    return str(info.value)


def test_load_tiny_dataset(tmp_path):
    arrays = tiny_arrays()
    spec = tiny_spec(arrays)
    folder = write_dataset(tmp_path / "d", spec, arrays, gz=False)
    dataset = data.load(spec, data_dir=folder, log=pytest.fail)
    assert dataset.name == "tiny" and dataset.source == folder.absolute()
    assert dataset.train_images.shape == (6, 784) and dataset.train_images.dtype == np.float32
    assert dataset.test_images.shape == (4, 784) and dataset.num_features == 784
    assert dataset.train_labels.dtype == np.int32 and dataset.num_classes == 10
    np.testing.assert_array_equal(dataset.train_images * 255, arrays["train_images"].reshape(6, -1))
    np.testing.assert_array_equal(dataset.test_labels, arrays["test_labels"])


def test_images_with_wrong_ndim(tmp_path):
    arrays = tiny_arrays()
    arrays["train_images"] = arrays["train_images"].reshape(6, 784)
    message = _load_error(tmp_path, arrays)
    assert "train-images-idx3-ubyte.gz" in message and "3-dimensional" in message


def test_image_label_count_mismatch(tmp_path):
    arrays = tiny_arrays()
    arrays["test_labels"] = arrays["test_labels"][:3]
    message = _load_error(tmp_path, arrays)
    assert "t10k-images-idx3-ubyte.gz holds 4 images" in message
    assert "t10k-labels-idx1-ubyte.gz holds 3 labels" in message


def test_labels_out_of_range(tmp_path):
    arrays = tiny_arrays()
    arrays["train_labels"][2] = 10
    message = _load_error(tmp_path, arrays)
    assert (
        "train-labels-idx1-ubyte.gz" in message and "label 10 at index 2 is out of range" in message
    )


def test_a_bad_file_in_the_users_folder_is_theirs_to_replace(tmp_path):
    """No advice to download what graphtrain would never download into the user's folder."""
    arrays = tiny_arrays()
    spec = tiny_spec(arrays)
    folder = write_dataset(tmp_path / "mine", spec, arrays)
    (folder / "train-labels-idx1-ubyte.gz").write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(DataError) as info:
        data.load(spec, data_dir=folder, log=pytest.fail)
    message = str(info.value)
    assert "corrupted gzip" in message and "replace it with a good copy" in message
    assert "download" not in message


def test_a_bad_file_in_the_cache_is_fetched_again(tmp_path):
    arrays = tiny_arrays()
    spec = tiny_spec(arrays)
    cache = write_dataset(tmp_path / "home/.cache/graphtrain/tiny", spec, arrays)
    (cache / "train-labels-idx1-ubyte.gz").write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(DataError, match="delete it, and graphtrain downloads it again"):
        data.load(spec, log=pytest.fail)


@pytest.mark.parametrize("how", ["data_dir", "GRAPHTRAIN_DATA"])
def test_a_data_folder_that_is_a_file_is_not_a_folder(tmp_path, monkeypatch, how):
    not_a_folder = tmp_path / "mnist.tar"
    not_a_folder.write_bytes(b"x")
    if how == "GRAPHTRAIN_DATA":
        monkeypatch.setenv("GRAPHTRAIN_DATA", str(not_a_folder))
    with pytest.raises(DataError) as info:
        data.load("mnist", data_dir=not_a_folder if how == "data_dir" else None, log=pytest.fail)
    message = str(info.value)
    assert f"{not_a_folder} (given as {'--data-dir' if how == 'data_dir' else how}) is not a folder" in message
    assert "does not exist" not in message


def test_shape_differs_from_spec(tmp_path):
    arrays = tiny_arrays()
    spec = tiny_spec(tiny_arrays(n_train=8))
    message = _load_error(tmp_path, arrays, spec)
    assert "train-images-idx3-ubyte.gz" in message and "expected shape (8, 28, 28)" in message


# --------------------------------------------------------------------------------------------
# Finding files
# --------------------------------------------------------------------------------------------


def test_lookup_order(tmp_path, monkeypatch):
    arrays = tiny_arrays()
    spec = tiny_spec(arrays)
    explicit = write_dataset(tmp_path / "explicit", spec, arrays)
    env = write_dataset(tmp_path / "env", spec, arrays)
    cache = write_dataset(tmp_path / "home/.cache/graphtrain/tiny", spec, arrays)

    assert data.find_files(spec).folder == cache
    monkeypatch.setenv("GRAPHTRAIN_DATA", str(env))
    assert data.find_files(spec).folder == env
    assert data.find_files(spec, data_dir=explicit).folder == explicit


def test_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data.cache_dir("mnist") == tmp_path / "xdg/graphtrain/mnist"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # ignored, as the XDG spec says
    assert data.cache_dir("fashion-mnist") == tmp_path / "home/.cache/graphtrain/fashion-mnist"


def test_subfolder_and_uncompressed_names(tmp_path):
    arrays = tiny_arrays()
    spec = tiny_spec(arrays)
    write_dataset(tmp_path / "root/tiny", spec, arrays, gz=False)
    lookup = data.find_files(spec, data_dir=tmp_path / "root")
    assert lookup.complete and lookup.folder == tmp_path / "root/tiny"
    assert lookup.found["test_labels"].name == "t10k-labels-idx1-ubyte"


def test_lookup_reports_missing_and_searched(tmp_path):
    arrays = tiny_arrays()
    spec = tiny_spec(arrays)
    folder = tmp_path / "partial"
    folder.mkdir()
    write_idx(folder / "train-images-idx3-ubyte.gz", arrays["train_images"])
    write_idx(folder / "train-labels-idx1-ubyte", arrays["train_labels"])
    lookup = data.find_files(spec, data_dir=folder)
    assert not lookup.complete and lookup.folder is None and lookup.explicit
    assert set(lookup.found) == {"train_images", "train_labels"}
    assert lookup.missing == ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
    assert lookup.searched == (folder, folder / "tiny")


def test_unknown_dataset():
    with pytest.raises(DataError, match="unknown dataset 'cifar'.*mnist, fashion-mnist"):
        data.find_files("cifar")


def test_dataset_names_work_with_click_choice():
    choice = click.Choice(data.DATASET_NAMES)
    assert choice.convert("fashion-mnist", None, None) == "fashion-mnist"
    assert set(DATASETS) == {"mnist", "fashion-mnist"}
    assert issubclass(DataError, UsageError)


def test_load_offline_names_missing_files_and_folders(tmp_path):
    with pytest.raises(DataError) as info:
        data.load("mnist", offline=True, log=pytest.fail)
    message = str(info.value)
    for name in DATASETS["mnist"].file_names:
        assert name in message
    assert str(tmp_path / "home/.cache/graphtrain/mnist") in message
    assert "--data-dir DIR" in message and "GRAPHTRAIN_DATA=DIR" in message
    assert "graphtrain data download" in message


def test_load_with_explicit_folder_never_downloads(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHTRAIN_DATA", str(tmp_path / "env"))
    with pytest.raises(DataError) as info:
        data.load("mnist", log=pytest.fail)  # pytest.fail: nothing may be logged or fetched
    message = str(info.value)
    assert str(tmp_path / "env") in message and str(tmp_path / "env/mnist") in message
    assert "4 of 4 files missing" in message


# --------------------------------------------------------------------------------------------
# Checksums
# --------------------------------------------------------------------------------------------


def test_verify_accepts_either_sum(tmp_path):
    arrays = tiny_arrays()
    raw = idx_bytes(arrays["train_labels"])
    gz_path = tmp_path / "labels.gz"
    gz_path.write_bytes(gzip.compress(raw, mtime=0))
    raw_path = tmp_path / "labels"
    raw_path.write_bytes(raw)
    good_md5, good_gz = md5(raw), md5(gz_path.read_bytes())

    # Re-compressed data (a different .gz sum) is accepted on its uncompressed sum.
    spec = FileSpec("labels.gz", (6,), md5=good_md5, gz_md5="0" * 32)
    assert data.verify_file(gz_path, spec) == "md5"
    assert data.verify_file(raw_path, spec) == "md5"
    gz_only = FileSpec("labels.gz", (6,), gz_md5=good_gz)
    assert data.verify_file(gz_path, gz_only) == "gz_md5"
    assert (
        data.verify_file(raw_path, gz_only) is None
    )  # nothing to compare an uncompressed copy with

    with pytest.raises(DataError) as info:
        data.verify_file(gz_path, FileSpec("labels.gz", (6,), md5="1" * 32, gz_md5="2" * 32))
    message = str(info.value)
    assert str(gz_path) in message and "1" * 32 in message and "2" * 32 in message
    assert good_md5 in message and good_gz in message


def test_file_spec_needs_a_checksum():
    with pytest.raises(ValueError):
        FileSpec("x.gz", (1,))


# --------------------------------------------------------------------------------------------
# Downloads from a local HTTP server
# --------------------------------------------------------------------------------------------


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


@pytest.fixture
def server(tmp_path):
    """An HTTP server on 127.0.0.1 serving tmp_path/www; yields its base URL."""
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    # A short poll interval keeps shutdown() from waiting half a second per test.
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


def _serve(tmp_path, arrays, spec, folder="good") -> None:
    write_dataset(tmp_path / "www" / folder, spec, arrays)


def _contents(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()} if folder.exists() else set()


def test_download_then_nothing_to_fetch(tmp_path, server):
    arrays = tiny_arrays()
    spec = tiny_spec(arrays)
    _serve(tmp_path, arrays, spec)
    dest = tmp_path / "dest"
    lines = []
    assert data.download(spec, dest, mirrors=[server + "good"], log=lines.append, timeout=5) == dest
    assert _contents(dest) == set(spec.file_names)  # no temporary files left over
    assert sum("fetching" in line for line in lines) == 4
    assert all("MB" in line for line in lines if "fetching" in line)
    for role in ROLES:
        np.testing.assert_array_equal(data.read_idx(dest / spec.files[role].name), arrays[role])

    lines.clear()
    data.download(spec, dest, mirrors=[server + "good"], log=lines.append, timeout=5)
    assert not any("fetching" in line for line in lines)


def test_download_rejects_checksum_mismatch(tmp_path, server):
    arrays = tiny_arrays()
    spec = tiny_spec(arrays, sums="md5")
    corrupted = dict(arrays, test_labels=arrays["test_labels"][::-1].copy())
    _serve(tmp_path, corrupted, spec)
    dest = tmp_path / "dest"
    with pytest.raises(DownloadError) as info:
        data.download(spec, dest, mirrors=[server + "good"], log=lambda _: None, timeout=5)
    message = str(info.value)
    assert "t10k-labels-idx1-ubyte.gz" in message and "checksum mismatch" in message
    assert spec.files["test_labels"].md5 in message
    assert md5(idx_bytes(corrupted["test_labels"])) in message
    assert "train-images" not in message  # only the bad file is reported
    # The good files were kept; of the bad one nothing at all, not even a temporary file.
    assert _contents(dest) == set(spec.file_names) - {"t10k-labels-idx1-ubyte.gz"}


def test_download_falls_through_to_next_mirror(tmp_path, server, monkeypatch):
    arrays = tiny_arrays()
    spec = tiny_spec(arrays, sums="gz")
    _serve(tmp_path, arrays, spec)
    lines = []
    dest = data.download(
        spec,
        tmp_path / "dest",
        mirrors=[server + "missing/", "http://127.0.0.1:1/", server + "good/"],
        log=lines.append,
        timeout=5,
    )
    assert _contents(dest) == set(spec.file_names)
    assert any("404" in line for line in lines)
    # The refused mirror is tried once, not once per file.
    assert sum("127.0.0.1:1/" in line for line in lines) == 1

    # GRAPHTRAIN_MIRROR is tried before the given mirrors.
    monkeypatch.setenv("GRAPHTRAIN_MIRROR", server + "good")
    lines.clear()
    data.download(
        spec, tmp_path / "dest2", mirrors=[server + "missing/"], log=lines.append, timeout=5
    )
    assert not any("missing" in line for line in lines)


def test_download_all_mirrors_fail(tmp_path, server):
    spec = tiny_spec(tiny_arrays())
    dest = tmp_path / "dest"
    with pytest.raises(DownloadError) as info:
        data.download(
            spec,
            dest,
            mirrors=[server + "missing/", server + "gone/"],
            log=lambda _: None,
            timeout=5,
        )
    message = str(info.value)
    assert "could not download 4 of 4" in message
    for name in spec.file_names:
        assert name in message
    assert "404" in message
    assert not dest.exists()  # not even an empty folder


def test_download_without_a_network_says_each_failure_once_and_leaves_no_folder(tmp_path):
    spec = tiny_spec(tiny_arrays())
    dest = tmp_path / "cache" / "tiny"
    lines = []
    with pytest.raises(DownloadError) as info:
        data.download(spec, dest, mirrors=["http://127.0.0.1:1/", "http://127.0.0.1:2/"],
                      log=lines.append, timeout=5)
    message = str(info.value)
    assert not isinstance(info.value, UsageError)  # the network's failure, not the user's
    assert "could not download 4 of 4" in message and "Check the network" in message
    for port in (1, 2):  # each unreachable mirror said once, in the error, not in the log too
        assert message.count(f"127.0.0.1:{port}/") == 1
    assert lines == []
    assert not (tmp_path / "cache").exists()


def test_interrupted_write_leaves_nothing(tmp_path, server, monkeypatch):
    arrays = tiny_arrays()
    spec = tiny_spec(arrays)
    _serve(tmp_path, arrays, spec)

    def interrupt(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupt)
    dest = tmp_path / "dest"
    with pytest.raises(KeyboardInterrupt):
        data.download(spec, dest, mirrors=[server + "good"], log=lambda _: None, timeout=5)
    assert _contents(dest) == set()


def test_load_downloads_into_cache(tmp_path, server, monkeypatch):
    arrays = tiny_arrays()
    spec = tiny_spec(arrays, mirrors=[server + "good"])
    _serve(tmp_path, arrays, spec)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    lines = []
    dataset = data.load(spec, log=lines.append)
    cache = tmp_path / "xdg/graphtrain/tiny"
    assert lines[0] == f"graphtrain: downloading tiny into {cache}"
    assert dataset.source == cache and dataset.train_images.shape == (6, 784)


def test_load_reports_failed_download(tmp_path, server):
    spec = tiny_spec(tiny_arrays(), mirrors=[server + "missing/"])
    with pytest.raises(DownloadError) as info:  # the network's failure, not the user's: exit 1
        data.load(spec, log=lambda _: None)
    message = str(info.value)
    assert "4 of 4 files missing" in message and "The download failed" in message
    assert str(tmp_path / "home/.cache/graphtrain/tiny") in message


# --------------------------------------------------------------------------------------------
# Synthetic data
# --------------------------------------------------------------------------------------------


def test_synthetic_is_deterministic_and_learnable():
    dataset = Dataset.synthetic(200, 100, seed=3, num_features=20, num_classes=4)
    again = Dataset.synthetic(200, 100, seed=3, num_features=20, num_classes=4)
    np.testing.assert_array_equal(dataset.train_images, again.train_images)
    assert dataset.train_images.shape == (200, 20) and dataset.train_images.dtype == np.float32
    assert dataset.test_labels.dtype == np.int32 and dataset.num_classes == 4
    assert dataset.train_images.min() >= 0 and dataset.train_images.max() <= 1
    assert set(np.unique(dataset.train_labels)) == {0, 1, 2, 3}
    # A nearest-class-mean classifier fit on train must do well on test.
    means = np.stack([dataset.train_images[dataset.train_labels == c].mean(0) for c in range(4)])
    distances = ((dataset.test_images[:, None, :] - means[None]) ** 2).sum(-1)
    assert (distances.argmin(1) == dataset.test_labels).mean() > 0.9


# --------------------------------------------------------------------------------------------
# The real MNIST, where a copy is at hand
# --------------------------------------------------------------------------------------------


def test_real_mnist():
    folder, reason = real_mnist(_USER_DATA_DIR)
    if folder is None:
        pytest.skip(reason)
    dataset = data.load("mnist", data_dir=folder, offline=True, log=pytest.fail)
    assert dataset.train_images.shape == (60000, 784) and dataset.test_images.shape == (10000, 784)
    assert dataset.train_images.dtype == np.float32 and dataset.train_labels.dtype == np.int32
    assert dataset.train_images.min() == 0.0 and dataset.train_images.max() == 1.0
    for labels in (dataset.train_labels, dataset.test_labels):
        counts = np.bincount(labels, minlength=10)
        assert (
            len(counts) == 10
            and counts.min() > 0.08 * len(labels)
            and counts.max() < 0.12 * len(labels)
        )
    spec = DATASETS["mnist"]
    lookup = data.find_files("mnist", data_dir=folder)
    for role in ROLES:
        assert data.verify_file(lookup.found[role], spec.files[role]) is not None


def test_normalise_rounds_each_operation_to_float32():
    """The in-place normalisation gives the bits of float32 (x − mean) / std, each step rounded."""
    from graphtrain.data.images import normalise

    seed = 1234
    x = np.random.default_rng(seed).random((300, 784), dtype=np.float32)
    mean, std = 0.1307, 0.3081
    expected = ((x - np.float32(mean)).astype(np.float32) / np.float32(std)).astype(np.float32)
    got = normalise(x, mean, std)
    assert got.dtype == np.float32 and got.shape == x.shape
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), f"seed {seed}"
    assert not np.shares_memory(got, x), "the input is left as it was"
