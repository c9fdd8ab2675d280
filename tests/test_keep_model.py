"""Keeping a model: run --save, eval, resume with --init, and training on your own .npz data."""

import json
import re

import numpy as np
import pytest
from click.testing import CliRunner

import graphtrain
from graphtrain import TrainConfig, evaluate, model_io, reference, train
from graphtrain.cli import main
from graphtrain.data import Dataset, load, load_npz
from graphtrain.errors import DataError, UsageError
from graphtrain.plan import RunPlan
from graphtrain.stages import get_stage, row_names
from graphtrain.stages.base import Stage


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_same_params(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.w.tobytes() == y.w.tobytes()
        assert (x.b is None and y.b is None) or x.b.tobytes() == y.b.tobytes()


def own_data(n_train=600, n_test=150, shape=(9, 7), classes=3, seed=2):
    """uint8 images of a non-MNIST size in a few classes, learnable (class means plus noise)."""
    rng = np.random.default_rng(seed)
    means = rng.uniform(0, 255, size=(classes, *shape))

    def split(n):
        labels = rng.permutation(np.arange(n) % classes).astype(np.int64)
        images = np.clip(means[labels] + rng.normal(0, 60, size=(n, *shape)), 0, 255).astype(np.uint8)
        return images, labels

    (x_train, y_train), (x_test, y_test) = split(n_train), split(n_test)
    return dict(x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)


@pytest.fixture(scope="module")
def npz(tmp_path_factory):
    path = tmp_path_factory.mktemp("own") / "shapes.npz"
    np.savez(path, **own_data())
    return path


@pytest.fixture(scope="module")
def small():
    return Dataset.synthetic(1000, 300, seed=1)


# ---- save and load ---------------------------------------------------------------------------


def test_numpy_run_saves_and_loads_bit_exact(small, tmp_path):
    cfg = TrainConfig(hidden=(24,), batch=100, epochs=2, lr=0.2, seed=3)
    record = train(cfg, data=small)
    assert len(record.params) == 2 and record.params[0].w.shape == (24, 784)
    path = graphtrain.save(tmp_path / "m.safetensors", record)
    model = graphtrain.load(path)
    assert_same_params(model.layers, record.params)
    info = model.info
    assert info.dims == (784, 24, 10) and info.bias and info.stage == "numpy" and info.seed == 3
    assert (info.batch, info.lr, info.epochs_trained, info.dataset) == (100, 0.2, 2, "synthetic")
    assert info.test_accuracy == record.test_accuracy
    assert "params" not in record.to_json()  # the JSON record stays what it was


@pytest.mark.parametrize("name", row_names())
def test_every_row_hands_over_its_trained_parameters(name):
    """`run --save` writes what the row's `weights()` returns: no rung or peer may leave it to
    the base class, which has none to give."""
    assert get_stage(name).weights is not Stage.weights


def test_saved_model_evaluates_to_the_accuracy_the_run_reported(mnist_dir, tmp_path):
    path, json_path = tmp_path / "jhu.safetensors", tmp_path / "run.json"
    result = invoke("run", "--stage", "numpy", "--data-dir", mnist_dir, "--epochs", "1",
                    "--save", path, "--json", json_path)
    assert result.exit_code == 0, result.output
    assert "model saved to" in result.output
    reported = json.loads(json_path.read_text())["test_accuracy"]

    model = model_io.load(path)
    data = load("mnist", data_dir=mnist_dir, offline=True)
    assert model.info.image_shape == (28, 28) and model.info.dataset == "mnist"
    assert evaluate.evaluate(model.layers, data.test_images, data.test_labels, 10).accuracy == reported

    result = invoke("eval", "--model", path, "--data-dir", mnist_dir, "--offline")
    assert result.exit_code == 0, result.output
    assert f"accuracy {100 * reported:.2f}%" in result.output
    assert "confusion matrix" in result.output and "accuracy per class" in result.output
    loss = float(re.search(r"loss (\d+\.\d+)", result.output).group(1))
    assert 0.1 < loss < 0.6


def test_evaluation_counts_add_up():
    rng = np.random.default_rng(3)
    layers = reference.init_params((20, 5), True, 1)
    x, y = rng.uniform(0, 1, (400, 20)).astype(np.float32), rng.integers(0, 5, 400)
    result = evaluate.evaluate(layers, x, y, 5)
    predicted = reference.forward(layers, x)[-1].argmax(axis=1)
    assert result.samples == 400 and result.confusion.sum(axis=1).tolist() == np.bincount(y, minlength=5).tolist()
    assert result.accuracy == np.mean(predicted == y)
    for c in range(5):
        assert result.class_accuracy[c] == np.mean(predicted[y == c] == c)
    logp = reference.log_softmax(reference.forward(layers, x.astype(np.float64))[-1])
    assert result.loss == pytest.approx(-logp[np.arange(400), y].mean(), rel=1e-5)


def test_eval_plot(tmp_path, npz, monkeypatch):
    pytest.importorskip("matplotlib")
    model_path = tmp_path / "m.safetensors"
    assert invoke("run", "--data", npz, "--epochs", "1", "--batch", "50", "--save", model_path).exit_code == 0
    png = tmp_path / "confusion.png"
    result = invoke("eval", "--model", model_path, "--data", npz, "--plot", png)
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from graphtrain import report

    monkeypatch.setattr(report, "matplotlib_missing", lambda: "not drawn")
    result = invoke("eval", "--model", model_path, "--data", npz, "--plot", tmp_path / "other.png")
    assert result.exit_code == 2 and "pip install 'graphtrain[plot]'" in result.output
    assert not (tmp_path / "other.png").exists()


def test_unwritable_save_is_refused_before_any_work(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    target = blocker / "m.safetensors"
    # The data folder is empty: had the run started, the error would be about missing files.
    result = invoke("run", "--offline", "--data-dir", tmp_path, "--save", target)
    assert result.exit_code == 2
    assert result.output.startswith(f"error: cannot write {target}: ")


# ---- resume ----------------------------------------------------------------------------------


def test_resume_continues_the_loss_curve_bit_exact(small, tmp_path):
    """2 epochs, save, 2 more from the file == 4 epochs at once: same losses, same parameters."""
    cfg = TrainConfig(hidden=(32,), batch=64, epochs=4, lr=0.1, seed=7)
    whole = train(cfg, data=small)
    first = train(cfg.replace(epochs=2), data=small)
    path = graphtrain.save(tmp_path / "half.safetensors", first)
    rest = train(cfg.replace(epochs=2), data=small, init=path)

    assert [e.epoch for e in rest.epochs] == [3, 4]
    losses = [e.train_loss for e in first.epochs + rest.epochs]
    assert losses == [e.train_loss for e in whole.epochs]
    assert_same_params(rest.params, whole.params)
    assert graphtrain.Model.from_record(rest).info.epochs_trained == 4


def test_resume_takes_the_next_epochs_order_and_the_saved_parameters(small):
    cfg = TrainConfig(hidden=(8,), batch=100, epochs=2, seed=5)
    saved = reference.init_params(cfg.dims, True, 99)
    plan = RunPlan.for_data(cfg, small, saved, first_epoch=3)
    for e in range(2):
        assert np.array_equal(plan.orders[e], reference.epoch_order(5, 3 + e, 1000))
    assert_same_params(plan.initial, saved)
    # The sparse schedule counts the model's epochs too: epoch 10 of the model is due.
    plan = RunPlan.for_data(cfg.replace(epochs=4, metrics_every=10), small, saved, first_epoch=8)
    assert plan.metrics_due == (False, True, False, True)
    with pytest.raises(ValueError, match="do not fit"):
        RunPlan.for_data(cfg.replace(hidden=(9,)), small, saved)


def test_a_run_cut_short_by_steps_resumes_at_the_next_epoch(small, tmp_path):
    cfg = TrainConfig(batch=100, epochs=None, steps=25)  # 10 batches an epoch: 2.5 epochs
    record = train(cfg, data=small)
    path = graphtrain.save(tmp_path / "steps.safetensors", record)
    assert graphtrain.load(path).info.epochs_trained == 3
    rest = train(TrainConfig(batch=100, epochs=1), data=small, init=path)
    assert [e.epoch for e in rest.epochs] == [4]


def test_resume_through_the_cli_with_the_saved_settings(npz, tmp_path):
    whole, half, rest = (tmp_path / f"{name}.json" for name in ("whole", "half", "rest"))
    saved = tmp_path / "half.safetensors"
    common = ["--data", npz, "--hidden", "16", "--batch", "40", "--lr", "0.05", "--seed", "3"]
    assert invoke("run", *common, "--epochs", "3", "--json", whole).exit_code == 0
    assert invoke("run", *common, "--epochs", "1", "--json", half, "--save", saved).exit_code == 0
    # Hidden sizes, seed, batch and lr come from the file; only the length is given.
    result = invoke("run", "--data", npz, "--init", saved, "--epochs", "2", "--json", rest)
    assert result.exit_code == 0, result.output
    records = [json.loads(p.read_text()) for p in (whole, half, rest)]
    assert records[2]["init"] == str(saved)
    assert records[2]["config"]["batch"] == 40 and records[2]["config"]["hidden"] == [16]
    assert [e["epoch"] for e in records[2]["epochs"]] == [2, 3]
    assert ([e["train_loss"] for e in records[1]["epochs"] + records[2]["epochs"]]
            == [e["train_loss"] for e in records[0]["epochs"]])


def test_init_that_does_not_fit_names_both_shapes(npz, tmp_path):
    saved = tmp_path / "m.safetensors"
    assert invoke("run", "--data", npz, "--hidden", "16", "--epochs", "1", "--batch", "50",
                  "--save", saved).exit_code == 0
    result = invoke("run", "--data", npz, "--init", saved, "--hidden", "12", "--epochs", "1")
    assert result.exit_code == 2, result.output
    assert "(16, 63) in the file, (12, 63) in the run" in result.output
    assert "Traceback" not in result.output
    # Trained on a file, not a registered dataset: resuming or evaluating needs the file again.
    for args in (["run", "--init", saved, "--epochs", "1"], ["eval", "--model", saved]):
        result = invoke(*args)
        assert result.exit_code == 2 and "give its file with --data" in result.output


def test_init_with_a_bad_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 3)
    result = invoke("run", "--init", bad, "--epochs", "1")
    assert result.exit_code == 2 and result.output.startswith("error:") and "not a safetensors file" in result.output


# ---- your own data ---------------------------------------------------------------------------


def test_npz_with_another_image_size_and_three_classes_trains(npz, tmp_path):
    data = load_npz(npz)
    assert data.num_features == 63 and data.num_classes == 3 and data.image_shape == (9, 7)
    assert data.train_images.dtype == np.float32 and data.train_images.max() <= 1.0

    model_path, json_path = tmp_path / "shapes.safetensors", tmp_path / "run.json"
    result = invoke("run", "--data", npz, "--hidden", "32", "--epochs", "3", "--batch", "50",
                    "--save", model_path, "--json", json_path)
    assert result.exit_code == 0, result.output
    record = json.loads(json_path.read_text())
    assert record["config"]["dims"] == [63, 32, 3] and record["config"]["dataset"] == "shapes"
    assert record["data"] == {"name": "shapes", "train": 600, "test": 150, "image_shape": [9, 7]}
    assert record["test_accuracy"] > 0.9
    info = model_io.load(model_path).info
    assert info.dims == (63, 32, 3) and info.image_shape == (9, 7) and info.dataset == "shapes"

    result = invoke("eval", "--model", model_path, "--data", npz)
    assert result.exit_code == 0 and f"accuracy {100 * record['test_accuracy']:.2f}%" in result.output

    images = tmp_path / "x.npy"
    np.save(images, np.load(npz)["x_test"][:10])
    result = invoke("predict", "--model", model_path, images)
    assert result.exit_code == 0, result.output
    classes = [int(line.split(",")[1]) for line in result.stdout.splitlines()[1:]]
    assert len(classes) == 10 and set(classes) <= {0, 1, 2}


def test_from_arrays_is_the_library_way(small):
    arrays = own_data(n_train=200, n_test=60, shape=(5, 5), classes=4)
    data = Dataset.from_arrays(**arrays, name="mine")
    record = train(TrainConfig(batch=20, epochs=2), data=data)
    assert record.config.dims == (25, 4) and record.params[0].w.shape == (4, 25)


@pytest.mark.parametrize("change,needle", [
    (lambda a: a.update(y_test=a["y_test"] + 3), "label 3 at index"),
    (lambda a: a.update(y_train=-a["y_train"]), "is negative"),
    (lambda a: a.update(y_train=a["y_train"][:-1]), "labels for 600 samples"),
    (lambda a: a.update(y_train=a["y_train"].astype(np.float32)), "integer labels"),
    (lambda a: a.update(x_test=a["x_test"][:, :8]), "must agree"),
    (lambda a: a.update(x_train=a["x_train"].astype(np.float64)), "must lie in [0, 1]"),
    (lambda a: a.update(y_train=np.zeros_like(a["y_train"])), "single class"),
    (lambda a: a.pop("y_test"), "missing y_test"),
])
def test_bad_npz_data_is_a_clear_error(tmp_path, change, needle):
    arrays = own_data()
    change(arrays)
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError, match=re.escape(needle)):
        load_npz(path)
    result = invoke("run", "--data", path, "--epochs", "1")
    assert result.exit_code == 2 and str(path) in result.output and "Traceback" not in result.output


def test_files_that_are_not_npz(tmp_path):
    npy = tmp_path / "x.npy"
    np.save(npy, np.zeros((3, 4)))
    cut = tmp_path / "cut.npz"
    np.savez(tmp_path / "whole.npz", **own_data())
    cut.write_bytes((tmp_path / "whole.npz").read_bytes()[:3000])
    for path, needle in ((npy, "not an .npz archive"), (cut, "cannot read it"), (tmp_path / "nope.npz", "no such file")):
        with pytest.raises(DataError, match=needle):
            load_npz(path)


def test_data_and_dataset_options_exclude_each_other(npz, tmp_path):
    result = invoke("run", "--data", npz, "--dataset", "mnist")
    assert result.exit_code == 2 and "not both" in result.output
    result = invoke("run", "--data", npz, "--data-dir", tmp_path)
    assert result.exit_code == 2 and "not both" in result.output


def test_eval_on_data_of_another_size_is_refused(npz, tmp_path):
    dims = (784, 10)
    path = model_io.save(tmp_path / "m.safetensors",
                         model_io.Model(reference.init_params(dims, True, 0), model_io.ModelInfo(dims, True, "mnist")))
    result = invoke("eval", "--model", path, "--data", npz)
    assert result.exit_code == 2 and "784 input features" in result.output and "63 features" in result.output


def test_usage_errors_stay_usage_errors():
    assert issubclass(model_io.ModelFileError, UsageError) and issubclass(DataError, UsageError)
