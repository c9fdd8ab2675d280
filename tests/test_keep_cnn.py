"""Keeping a cnn: run --save, the file's PyTorch layout and metadata, eval, predict,
graphtrain.load(p).predict(x), resuming with --init, and to_torch (where PyTorch is installed)."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

import graphtrain
from graphtrain import evaluate, model_io, reference
from graphtrain.cli import main
from graphtrain.config import PRESETS, TrainConfig
from graphtrain.data import Dataset, images, load
from graphtrain.model_io import Model, ModelFileError, ModelInfo
from graphtrain.training import plan_for, train


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_same_params(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.w.tobytes() == y.w.tobytes() and x.b.tobytes() == y.b.tobytes()


# A cnn small enough to train in a second or two on the CPU: conv 1→4 5×5, pool, ReLU, 576→16→10.
SMALL_CNN = TrainConfig(model="cnn", conv=((4, 5),), hidden=(16,), batch=50, epochs=1, lr=0.05, seed=7)


@pytest.fixture(scope="module")
def data():
    return Dataset.synthetic(400, 200, seed=3)


@pytest.fixture(scope="module")
def record(data):
    return train(SMALL_CNN, stage="numpy", data=data)


@pytest.fixture
def saved(record, tmp_path):
    return graphtrain.save(tmp_path / "cnn.safetensors", record)


def test_a_saved_cnn_loads_bit_exact_with_what_it_is(record, saved):
    model = graphtrain.load(saved)
    assert_same_params(model.layers, record.params)
    info = model.info
    assert info.convs == ((model_io.ConvLayer(4, 5),)) and info.input_shape == (1, 28, 28)
    assert info.dims == (576, 16, 10) and info.in_features == 784 and info.classes == 10
    assert info.normalisation == images.MNIST_NORMALISATION
    assert (info.stage, info.seed, info.batch, info.lr, info.epochs_trained) == ("numpy", 7, 50, 0.05, 1)
    assert (info.optimizer, info.schedule, info.test_accuracy) == ("sgd", "constant", record.test_accuracy)
    assert info.describe() == "conv 4x5, 576-16-10 with bias"


def test_the_file_is_a_pytorch_sequential_state_dict(saved):
    from safetensors import safe_open

    with safe_open(saved, "np") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        metadata = f.metadata()
    # nn.Sequential(Conv2d(1, 4, 5), MaxPool2d(2), ReLU(), Flatten(), Linear(576, 16), ReLU(), Linear(16, 10))
    assert shapes == {"0.weight": (4, 1, 5, 5), "0.bias": (4,), "4.weight": (16, 576), "4.bias": (16,),
                      "6.weight": (10, 16), "6.bias": (10,)}
    assert [m["type"] for m in json.loads(metadata["layers"])] == [
        "Conv2d", "MaxPool2d", "ReLU", "Flatten", "Linear", "ReLU", "Linear"]
    assert json.loads(metadata["layers"])[0] == {"type": "Conv2d", "in_channels": 1, "out_channels": 4,
                                                 "kernel_size": 5, "stride": 1, "padding": 0, "bias": True}
    assert metadata["format"] == "graphtrain.cnn" and json.loads(metadata["input_shape"]) == [1, 28, 28]
    assert json.loads(metadata["normalisation"]) == {"mean": 0.1307, "std": 0.3081}


def test_mlp_files_list_their_layers_too(tmp_path):
    dims = (12, 8, 3)
    path = model_io.save(tmp_path / "mlp.safetensors",
                         Model(reference.init_params(dims, False, 1), ModelInfo(dims, False, "synthetic")))
    from safetensors import safe_open

    with safe_open(path, "np") as f:
        layers = json.loads(f.metadata()["layers"])
    assert layers == [{"type": "Linear", "in_features": 12, "out_features": 8, "bias": False}, {"type": "ReLU"},
                      {"type": "Linear", "in_features": 8, "out_features": 3, "bias": False}]


def test_evaluation_and_prediction_give_the_runs_accuracy_exactly(record, saved, data):
    """The numpy stage's forward pass on the normalised features: the run's test accuracy, to the sample."""
    model = graphtrain.load(saved)
    result = evaluate.evaluate(model, data.test_images, data.test_labels, model.info.classes)
    assert result.accuracy == record.test_accuracy
    predicted = model.predict(data.test_images)
    assert predicted.dtype == np.int64 and int((predicted == data.test_labels).sum()) / 200 == record.test_accuracy
    # uint8 images (N, 28, 28), as a user has them, give the same classes as their features.
    pixels = np.random.default_rng(11).integers(0, 256, (9, 28, 28), dtype=np.uint8)
    assert np.array_equal(model.predict(pixels), model.predict(images.to_features(pixels, "pixels")))


def test_prediction_normalises_as_training_did(saved):
    """Features fed without the normalisation would give other logits: predict applies it."""
    model = graphtrain.load(saved)
    x = np.random.default_rng(4).uniform(0, 1, (6, 784)).astype(np.float32)
    from graphtrain import reference_cnn

    params = [a for layer in model.layers for a in (layer.w, layer.b)]
    expected = reference_cnn.logits(model.info.spec, params, ((x - 0.1307) / 0.3081).astype(np.float32))
    assert model.logits(x).tobytes() == expected.tobytes()
    assert not np.allclose(model.logits(x), reference_cnn.logits(model.info.spec, params, x))


def test_resuming_a_cnn_with_sgd_continues_it_exactly(data, tmp_path):
    cfg = SMALL_CNN.replace(epochs=2)
    whole = train(cfg, stage="numpy", data=data)
    first = train(cfg.replace(epochs=1), stage="numpy", data=data)
    rest = train(cfg.replace(epochs=1), stage="numpy", data=data,
                 init=graphtrain.save(tmp_path / "half.safetensors", first))
    assert [e.epoch for e in rest.epochs] == [2]
    assert_same_params(rest.params, whole.params)
    assert rest.train_loss == whole.train_loss


def test_resuming_with_adam_starts_from_the_files_weights(record, saved, data):
    model = graphtrain.load(saved)
    cfg = SMALL_CNN.replace(optimizer="adam", schedule="one-cycle", lr=0.01)
    plan = plan_for(cfg, data, model)
    assert plan.first_epoch == 1
    assert_same_params(plan.initial, record.params)
    resumed = train(cfg, stage="numpy", data=data, init=model)
    assert [e.epoch for e in resumed.epochs] == [2]
    assert resumed.test_accuracy >= record.test_accuracy - 0.05


def test_a_file_that_is_not_the_runs_cnn_names_both(saved, data):
    model = graphtrain.load(saved)
    with pytest.raises(ModelFileError, match=r"conv 4x5, 576-16-10 .* asks for conv 6x5, 864-16-10 .*"
                                             r"0\.weight is \(4, 1, 5, 5\) in the file, \(6, 1, 5, 5\) in the run"):
        plan_for(SMALL_CNN.replace(conv=((6, 5),)), data, model)
    with pytest.raises(ModelFileError, match=r"asks for 784-16-10 with bias: tensor 0\.weight"):
        plan_for(TrainConfig(hidden=(16,)), data, model)


def _rewrite_metadata(path, key, change):
    import struct

    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    header["__metadata__"][key] = change(header["__metadata__"][key])
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + length:])


def _layers(change):
    def apply(text):
        layers = json.loads(text)
        change(layers)
        return json.dumps(layers)

    return apply


BAD_CNN_FILES = {
    "no flatten": ("layers", _layers(lambda m: m.pop(3)), "no Flatten"),
    "a pool of another size": ("layers", _layers(lambda m: m[1].__setitem__("kernel_size", 3)), "give 256 features"),
    "a module graphtrain lacks": ("layers", _layers(lambda m: m.insert(2, {"type": "Dropout", "p": 0.5})),
                                  "module 2 is Dropout, where ReLU belongs"),
    "a stride": ("layers", _layers(lambda m: m[0].__setitem__("stride", 2)), "give 144 features"),
    "a conv without bias": ("layers", _layers(lambda m: m[0].__setitem__("bias", False)), "differ"),
    "layers not a list": ("layers", lambda text: '"conv"', "list of modules"),
    "input shape not three sizes": ("input_shape", lambda text: "[1, 28, 28, 1]", "channels, height, width"),
    "input shape of two sizes": ("input_shape", lambda text: "[28, 28]", "input_shape"),
    "an input too small": ("input_shape", lambda text: "[1, 4, 4]", "smaller than its 2x2 pool"),
    "dims disagree": ("dims", lambda text: "[576, 17, 10]", "disagree with its layers"),
    "normalisation std zero": ("normalisation", lambda text: '{"mean": 0.1, "std": 0}', "normalisation"),
}


@pytest.mark.parametrize("case", BAD_CNN_FILES)
def test_a_damaged_cnn_file_is_one_line(saved, case):
    key, change, needle = BAD_CNN_FILES[case]
    _rewrite_metadata(saved, key, change)
    with pytest.raises(ModelFileError, match=needle):
        model_io.load(saved)
    result = invoke("eval", "--model", saved, "--offline")
    assert result.exit_code == 2 and result.output.startswith("error:") and needle in result.output, result.output
    assert "Traceback" not in result.output


@pytest.fixture(scope="module")
def npz(tmp_path_factory):
    """12×12 uint8 images in 3 classes (class means plus noise): a cnn's square input, not MNIST's."""
    rng = np.random.default_rng(6)
    means = rng.uniform(0, 255, size=(3, 12, 12))

    def split(n):
        labels = rng.permutation(np.arange(n) % 3)
        return np.clip(means[labels] + rng.normal(0, 60, (n, 12, 12)), 0, 255).astype(np.uint8), labels

    (x_train, y_train), (x_test, y_test) = split(300), split(120)
    path = tmp_path_factory.mktemp("own") / "squares.npz"
    np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    return path


def test_the_cli_keeps_a_cnn_evaluates_predicts_and_resumes_it(npz, tmp_path):
    saved, run_json, resumed_json = tmp_path / "m.safetensors", tmp_path / "run.json", tmp_path / "resumed.json"
    result = invoke("run", "--stage", "numpy", "--data", npz, "--conv", "4x3", "--hidden", "none", "--batch", "30",
                    "--epochs", "2", "--lr", "0.05", "--save", saved, "--json", run_json)
    assert result.exit_code == 0, result.output
    run = json.loads(run_json.read_text())

    result = invoke("eval", "--model", saved, "--data", npz)
    assert result.exit_code == 0, result.output
    assert f"accuracy {100 * run['test_accuracy']:.2f}%" in result.output
    assert "conv 4x3, 100-3 with bias" in result.output

    x_test = np.load(npz)["x_test"]
    np.save(tmp_path / "x.npy", x_test[:20])
    result = invoke("predict", "--model", saved, tmp_path / "x.npy")
    assert result.exit_code == 0, result.output
    classes = [int(line.split(",")[1]) for line in result.output.strip().splitlines()[1:]]
    assert classes == graphtrain.load(saved).predict(x_test[:20]).tolist()

    # The conv layers, hidden sizes, batch, lr and seed come from the file; only the length is given.
    result = invoke("run", "--data", npz, "--init", saved, "--epochs", "1", "--json", resumed_json)
    assert result.exit_code == 0, result.output
    resumed = json.loads(resumed_json.read_text())
    assert resumed["config"]["conv"] == [[4, 3]] and resumed["config"]["batch"] == 30
    assert [e["epoch"] for e in resumed["epochs"]] == [3]


def test_the_speedrun_preset_is_saved(tmp_path):
    """What `run --preset speedrun --save` used to refuse, on a few steps of synthetic data."""
    data = Dataset.synthetic(600, 100, seed=2)
    record = train(PRESETS["speedrun"].replace(epochs=None, steps=2), stage="numpy", data=data)
    model = graphtrain.load(graphtrain.save(tmp_path / "speedrun.safetensors", record))
    assert model.info.describe() == "conv 24x5,32x3, 800-256-10 with bias"
    assert (model.info.optimizer, model.info.schedule) == ("adam", "one-cycle")
    assert [layer.w.shape for layer in model.layers] == [(24, 1, 5, 5), (32, 24, 3, 3), (256, 800), (10, 256)]
    assert evaluate.evaluate(model, data.test_images, data.test_labels, 10).accuracy == record.test_accuracy


# ---- PyTorch -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mnist_cnn(mnist_dir, tmp_path_factory):
    """A small cnn trained by the numpy stage on real MNIST (100 steps), saved."""
    pytest.importorskip("torch", reason="torch is not installed")
    mnist = load("mnist", data_dir=mnist_dir, offline=True)
    record = train(SMALL_CNN.replace(epochs=None, steps=100, batch=128, lr=0.003, optimizer="adam"),
                   stage="numpy", data=mnist)
    return mnist, record, graphtrain.save(tmp_path_factory.mktemp("cnn") / "mnist-cnn.safetensors", record)


def test_to_torch_of_a_cnn_reproduces_its_test_accuracy_exactly(mnist_cnn):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    mnist, record, path = mnist_cnn
    net = graphtrain.to_torch(path)
    assert isinstance(net, torch.nn.Sequential)
    with torch.no_grad():
        logits = net(torch.tensor(mnist.test_images)).numpy()
    accuracy = int((logits.argmax(axis=1) == mnist.test_labels).sum()) / len(mnist.test_labels)
    assert accuracy == record.test_accuracy, (accuracy, record.test_accuracy)
    reference_logits = graphtrain.load(path).logits(mnist.test_images)
    error = np.linalg.norm(logits - reference_logits) / np.linalg.norm(reference_logits)
    assert error < 1e-5, error


def test_a_plain_sequential_from_the_files_metadata_loads_it(mnist_cnn):
    """What a PyTorch user writes, graphtrain not imported: the modules from `layers`, the
    tensors strict, the normalisation from the metadata."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from safetensors import safe_open
    from safetensors.torch import load_file

    mnist, record, path = mnist_cnn
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    net = torch.nn.Sequential(*(getattr(torch.nn, m.pop("type"))(**m) for m in json.loads(metadata["layers"])))
    net.load_state_dict(load_file(path))
    norm = json.loads(metadata["normalisation"])
    x = torch.tensor(mnist.test_images).reshape(-1, *json.loads(metadata["input_shape"]))
    with torch.no_grad():
        logits = net((x - norm["mean"]) / norm["std"]).numpy()
    accuracy = int((logits.argmax(axis=1) == mnist.test_labels).sum()) / len(mnist.test_labels)
    assert accuracy == record.test_accuracy, (accuracy, record.test_accuracy)
    for (name, a), (name_b, b) in zip(net.state_dict().items(), graphtrain.to_torch(path).state_dict().items(),
                                      strict=True):
        assert name == name_b and torch.equal(a, b)
