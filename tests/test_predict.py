"""`graphtrain predict` and the input rules it shares with training: IDX and .npy, uint8 or float."""

import gzip
import struct

import numpy as np
import pytest
from click.testing import CliRunner

from graphtrain import evaluate, model_io, reference
from graphtrain.cli import main
from graphtrain.data import images
from graphtrain.errors import DataError
from graphtrain.model_io import Model, ModelInfo


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    dims = (784, 32, 10)
    path = tmp_path_factory.mktemp("model") / "m.safetensors"
    model_io.save(path, Model(reference.init_params(dims, True, 11), ModelInfo(dims, True, "mnist", (28, 28))))
    return path


@pytest.fixture(scope="module")
def pixels():
    return np.random.default_rng(5).integers(0, 256, size=(37, 28, 28), dtype=np.uint8)


def write_idx(path, array: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(gzip.compress(header + array.tobytes()))


def parse_csv(text: str):
    lines = text.strip().splitlines()
    assert lines[0] == "index,class,probability"
    rows = [line.split(",") for line in lines[1:]]
    return (np.array([int(r[0]) for r in rows]), np.array([int(r[1]) for r in rows]),
            np.array([float(r[2]) for r in rows]))


def expected(model_path, pixels):
    layers = model_io.load(model_path).layers
    logits = reference.forward(layers, pixels.reshape(len(pixels), -1).astype(np.float32) / 255)[-1]
    logp = reference.log_softmax(logits.astype(np.float64))
    return logits.argmax(axis=1), np.exp(logp.max(axis=1))


def test_predict_on_an_idx_file_prints_csv(model_path, pixels, tmp_path):
    idx = tmp_path / "images-idx3-ubyte.gz"
    write_idx(idx, pixels)
    result = invoke("predict", "--model", model_path, idx)
    assert result.exit_code == 0, result.output
    index, classes, probability = parse_csv(result.stdout)
    want_classes, want_probability = expected(model_path, pixels)
    assert list(index) == list(range(37))
    assert np.array_equal(classes, want_classes)
    assert np.allclose(probability, want_probability, atol=1e-6)
    assert (probability >= 0.1 - 1e-6).all()  # the top class of 10 has at least a tenth


@pytest.mark.parametrize("layout", ["uint8 (N, 28, 28)", "uint8 (N, 784)", "float (N, 28, 28)", "float (N, 784)"])
def test_predict_on_npy_in_every_layout_agrees(model_path, pixels, tmp_path, layout):
    array = pixels if layout.startswith("uint8") else pixels.astype(np.float64) / 255
    if "784" in layout:
        array = array.reshape(len(array), 784)
    npy = tmp_path / "x.npy"
    np.save(npy, array)
    out = tmp_path / "preds.csv"
    result = invoke("predict", "--model", model_path, npy, "--out", out)
    assert result.exit_code == 0, result.output
    assert "37 predictions written" in result.output
    _, classes, probability = parse_csv(out.read_text())
    want_classes, want_probability = expected(model_path, pixels)
    assert np.array_equal(classes, want_classes)
    assert np.allclose(probability, want_probability, atol=1e-6)


def test_predict_on_real_mnist_matches_the_evaluation(model_path, mnist_dir, tmp_path):
    from graphtrain.data import load

    data = load("mnist", data_dir=mnist_dir, offline=True)
    model = model_io.load(model_path)
    out = tmp_path / "p.csv"
    source = next(p for p in mnist_dir.iterdir() if p.name.startswith("t10k-images"))
    assert invoke("predict", "--model", model_path, source, "--out", out).exit_code == 0
    _, classes, _ = parse_csv(out.read_text())
    accuracy = evaluate.evaluate(model.layers, data.test_images, data.test_labels, 10).accuracy
    assert np.mean(classes == data.test_labels) == accuracy


@pytest.mark.parametrize("array,needle", [
    (np.zeros((4, 27, 28), np.uint8), "shape (N, 784) or (N, 28, 28)"),
    (np.zeros((4, 785), np.float32), "shape (N, 784)"),
    (np.full((4, 784), 2.0, np.float32), "must lie in [0, 1]"),
    (np.full((4, 784), np.nan, np.float32), "NaN"),
    (np.zeros((4, 784), np.int64), "uint8 (0-255) or floats (0-1)"),
    (np.zeros((0, 784), np.uint8), "non-empty"),
])
def test_bad_inputs_are_one_line_errors(model_path, tmp_path, array, needle):
    npy = tmp_path / "x.npy"
    np.save(npy, array)
    out = tmp_path / "preds.csv"
    result = invoke("predict", "--model", model_path, npy, "--out", out)
    assert result.exit_code == 2 and result.output.startswith("error:"), result.output
    assert needle in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_inputs_that_are_neither_npy_nor_idx(model_path, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not images")
    result = invoke("predict", "--model", model_path, text)
    assert result.exit_code == 2 and "IDX" in result.output
    result = invoke("predict", "--model", model_path, tmp_path / "absent.npy")
    assert result.exit_code == 2 and "no such file" in result.output


def test_unwritable_out_is_refused_before_any_work(model_path, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    target = blocker / "preds.csv"
    # The input does not exist either: the output is checked first, before anything is read.
    result = invoke("predict", "--model", model_path, tmp_path / "absent.npy", "--out", target)
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: cannot write {target}: ") and "not a folder" in result.output


def test_help_says_what_inputs_it_takes():
    text = invoke("predict", "--help").output
    for needle in ("IDX", ".npy", "(N, 28, 28)", "(N, 784)", "uint8 0-255", "0-1", "--out"):
        assert needle in text


def test_to_features_scales_uint8_and_keeps_floats():
    raw = np.array([[[0, 255], [51, 102]]], np.uint8)
    assert np.array_equal(images.to_features(raw, "x"), np.array([[0, 1, 0.2, 0.4]], np.float32))
    assert images.to_features(raw, "x").dtype == np.float32
    floats = np.array([[0.25, 1.0]], np.float64)
    assert images.to_features(floats, "x").tolist() == [[0.25, 1.0]]
    with pytest.raises(DataError, match="x: float pixels"):
        images.to_features(floats * 3, "x")
