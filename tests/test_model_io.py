"""Saved models: the safetensors layout, the metadata, and a one-line error for every bad file."""

import json
import struct

import numpy as np
import pytest
from click.testing import CliRunner

from graphtrain import model_io, reference
from graphtrain.cli import main
from graphtrain.model_io import Model, ModelFileError, ModelInfo


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def make_model(dims=(12, 8, 3), bias=True, seed=4) -> Model:
    layers = reference.init_params(dims, bias, seed)
    return Model(layers, ModelInfo(dims, bias, "synthetic", image_shape=(3, 4), stage="numpy", seed=seed,
                                   batch=10, lr=0.1, epochs_trained=2, test_accuracy=0.5))


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "model.safetensors"
    model_io.save(path, make_model())
    return path


@pytest.mark.parametrize("bias", [True, False])
def test_round_trip_is_bit_exact_with_the_metadata(tmp_path, bias):
    model = make_model(bias=bias)
    path = model_io.save(tmp_path / "m.safetensors", model)
    loaded = model_io.load(path)
    assert loaded.info == model.info
    for a, b in zip(model.layers, loaded.layers):
        assert a.w.dtype == b.w.dtype == np.float32
        assert a.w.tobytes() == b.w.tobytes()
        assert (a.b is None and b.b is None) or a.b.tobytes() == b.b.tobytes()
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]  # no temporary file left


def test_layout_is_a_pytorch_sequential_state_dict(saved):
    from safetensors import safe_open

    with safe_open(saved, "np") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
        metadata = f.metadata()
    # nn.Sequential(Linear(12, 8), ReLU(), Linear(8, 3)): the ReLU at index 1 holds nothing.
    assert shapes == {"0.weight": [8, 12], "0.bias": [8], "2.weight": [3, 8], "2.bias": [3]}
    assert metadata["format"] == "graphtrain.mlp" and metadata["format_version"] == "1"
    assert json.loads(metadata["dims"]) == [12, 8, 3]
    assert metadata["in_features"] == "12" and metadata["classes"] == "3" and metadata["bias"] == "true"
    assert metadata["dataset"] == "synthetic" and "255" in metadata["preprocessing"]


def _rewrite_header(path, change):
    """Rewrite a saved file's JSON header through `change(header)`, keeping the tensor bytes."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    change(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length:])


def _foreign(path):
    from safetensors.numpy import save_file

    save_file({"fc.weight": np.ones((3, 4), np.float32)}, str(path))


def _set_metadata(key, value):
    return lambda header: header["__metadata__"].__setitem__(key, value)


BAD_FILES = {
    "empty": (lambda p: p.write_bytes(b""), "not a safetensors file"),
    "random bytes": (lambda p: p.write_bytes(np.random.default_rng(0).bytes(4096)), "not a safetensors file"),
    "text": (lambda p: p.write_text("hello, I am not a model\n" * 10), "not a safetensors file"),
    "header cut": (lambda p: p.write_bytes(p.read_bytes()[:60]), "truncated"),
    "data cut": (lambda p: p.write_bytes(p.read_bytes()[:-100]), "truncated"),
    "header not json": (lambda p: p.write_bytes(p.read_bytes()[:8] + b"\xff" + p.read_bytes()[9:]), "not JSON"),
    "foreign safetensors": (_foreign, "not a graphtrain model"),
    "newer format": (lambda p: _rewrite_header(p, _set_metadata("format_version", "2")), "format version 2"),
    "dims disagree with tensors": (lambda p: _rewrite_header(p, _set_metadata("dims", "[12, 9, 3]")), "shape"),
    "dims not sizes": (lambda p: _rewrite_header(p, _set_metadata("dims", '"big"')), "dims"),
    "bias missing": (lambda p: _rewrite_header(p, lambda h: h["__metadata__"].pop("bias")), "bias"),
    "classes disagree": (lambda p: _rewrite_header(p, _set_metadata("classes", "4")), "classes"),
    "wrong dtype": (lambda p: _rewrite_header(p, lambda h: h["2.bias"].__setitem__("dtype", "I32")), "float32"),
    "extra tensor": (lambda p: _rewrite_header(p, lambda h: h.__setitem__("4.weight", h["2.bias"])), "unexpected"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_files_are_one_line_errors(saved, case):
    damage, needle = BAD_FILES[case]
    damage(saved)
    with pytest.raises(ModelFileError, match=needle):
        model_io.load(saved)
    result = invoke("predict", "--model", saved, saved)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error:") and needle in result.output
    assert str(saved) in result.output and "Traceback" not in result.output


def test_missing_file_and_folder_are_clear(tmp_path):
    with pytest.raises(ModelFileError, match="no such file"):
        model_io.load(tmp_path / "absent.safetensors")
    with pytest.raises(ModelFileError, match="folder"):
        model_io.load(tmp_path)


def test_nan_parameters_are_refused(tmp_path):
    model = make_model()
    model.layers[0].w[0, 0] = np.nan
    path = model_io.save(tmp_path / "nan.safetensors", model)
    with pytest.raises(ModelFileError, match="NaN"):
        model_io.load(path)


def test_a_mismatch_names_both_shapes(saved):
    model = model_io.load(saved)
    model_io.check_matches(model, saved, (12, 8, 3), True)
    with pytest.raises(ModelFileError, match=r"0\.weight is \(8, 12\) in the file, \(16, 12\) in the run"):
        model_io.check_matches(model, saved, (12, 16, 3), True)
    with pytest.raises(ModelFileError, match=r"0\.bias is \(8,\) in the file, absent in the run"):
        model_io.check_matches(model, saved, (12, 8, 3), False)
    with pytest.raises(ModelFileError, match="12 input features"):
        model_io.check_data(model, saved, 784, 3, "mnist")


def test_to_torch_without_torch_says_how_to_get_it(saved, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("No module named 'torch'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    from graphtrain.errors import UsageError

    with pytest.raises(UsageError, match="pip install torch"):
        model_io.to_torch(saved)


def test_to_torch_builds_the_sequential(saved):
    torch = pytest.importorskip("torch")
    net = model_io.to_torch(saved)
    model = model_io.load(saved)
    x = np.random.default_rng(9).uniform(0, 1, (5, 12)).astype(np.float32)
    with torch.no_grad():
        out = net(torch.from_numpy(x)).numpy()
    ref = reference.forward(model.layers, x)[-1]
    assert np.allclose(out, ref, rtol=1e-5, atol=1e-6)
