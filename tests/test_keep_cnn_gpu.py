"""A cnn trained on the GPU rungs, kept: the file holds the parameters the device trained, in
PyTorch's layout (filters (out, in, kh, kw) whatever layout the device kept them in); a plain
torch.nn.Sequential built from the file reproduces the run's test accuracy exactly; resuming
(--init) writes the file's weights back to the device and goes on from them.

Skipped where there is no GPU; the PyTorch check also where torch (with CUDA) is missing.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import graphtrain
from graphtrain import evaluate
from graphtrain.config import PRESETS, TrainConfig
from graphtrain.data import Dataset, load
from graphtrain.plan import RunPlan
from graphtrain.training import train

CNN_RUNGS = ("graphs", "device-loop")
# A small cnn trained with SGD at a constant rate: nothing but the weights and the sample order
# carries over an epoch, so a resumed run is the longer run, bit for bit.
SMALL_SGD_CNN = TrainConfig(model="cnn", conv=((6, 5), (8, 3)), hidden=(32,), batch=128, epochs=2, lr=0.05, seed=4)


@pytest.fixture(scope="module")
def mnist(mnist_dir):
    return load("mnist", data_dir=mnist_dir, offline=True)


def torch_cuda():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch")
    return torch


def test_a_plain_sequential_reads_the_graphs_cnn_at_its_test_accuracy(mnist, tmp_path):
    """The speedrun recipe on `graphs` with fp32 products, saved; PyTorch, without graphtrain,
    builds nn.Sequential from the file's `layers`, loads its state_dict strictly, feeds it the
    test images normalised as the metadata says, with TF32 off: graphtrain's test accuracy."""
    torch = torch_cuda()
    from safetensors import safe_open
    from safetensors.torch import load_file

    record = train(PRESETS["speedrun"].replace(precision="fp32"), stage="graphs", data=mnist)
    path = graphtrain.save(tmp_path / "speedrun.safetensors", record)
    with safe_open(path, "pt") as f:
        metadata, keys = f.metadata(), list(f.keys())
    net = torch.nn.Sequential(*(getattr(torch.nn, m.pop("type"))(**m) for m in json.loads(metadata["layers"])))
    assert sorted(net.state_dict()) == sorted(keys)
    net.load_state_dict(load_file(path))  # strict: every key, every shape
    norm = json.loads(metadata["normalisation"])
    x = torch.tensor(mnist.test_images).reshape(-1, *json.loads(metadata["input_shape"]))
    saved_flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32, as the run
    try:
        net = net.cuda().eval()
        with torch.no_grad():
            logits = net(((x - norm["mean"]) / norm["std"]).cuda())
        predicted = logits.argmax(dim=1).cpu().numpy()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved_flags
    accuracy = int((predicted == mnist.test_labels).sum()) / len(mnist.test_labels)
    assert accuracy == record.test_accuracy, (accuracy, record.test_accuracy)
    assert accuracy >= 0.98


@pytest.mark.parametrize("stage", CNN_RUNGS)
def test_the_file_holds_what_the_device_trained(stage, tmp_path):
    """The saved parameters are the trained ones (not the initial), bit for bit the run's, and
    NumPy scores them as the device did up to near ties of two logits."""
    data = Dataset.synthetic(2000, 500, seed=6)
    record = train(SMALL_SGD_CNN.replace(epochs=1), stage=stage, data=data)
    model = graphtrain.load(graphtrain.save(tmp_path / f"{stage}.safetensors", record))
    assert (model.info.stage, model.info.epochs_trained) == (stage, 1)
    initial = RunPlan.for_data(SMALL_SGD_CNN, data).initial
    for saved, trained, start in zip(model.layers, record.params, initial, strict=True):
        assert saved.w.tobytes() == trained.w.tobytes() and saved.b.tobytes() == trained.b.tobytes()
        assert not np.array_equal(saved.w, start.w), "the initial weights were saved, not the trained ones"
    result = evaluate.evaluate(model, data.test_images, data.test_labels, model.info.classes)
    assert abs(result.accuracy - record.test_accuracy) <= 2 / len(data.test_labels), (result.accuracy,
                                                                                       record.test_accuracy)


@pytest.mark.parametrize("stage", CNN_RUNGS)
def test_resuming_a_gpu_cnn_continues_from_the_files_weights(stage, tmp_path):
    """1 epoch, saved, resumed for 1 more (--init): the 2-epoch run's weights, bit for bit."""
    data = Dataset.synthetic(3000, 500, seed=12)
    whole = train(SMALL_SGD_CNN, stage=stage, data=data)
    first = train(SMALL_SGD_CNN.replace(epochs=1), stage=stage, data=data)
    path = graphtrain.save(tmp_path / "half.safetensors", first)
    rest = train(SMALL_SGD_CNN.replace(epochs=1), stage=stage, data=data, init=path)
    assert [e.epoch for e in rest.epochs] == [2]
    for a, b in zip(rest.params, whole.params, strict=True):
        assert a.w.tobytes() == b.w.tobytes() and a.b.tobytes() == b.b.tobytes()


@pytest.mark.parametrize("fused", [True, False], ids=["fused convs", "cudnn convs"])
def test_device_parameters_round_trip_in_the_files_layout(gpu_device, fused, seed):
    """Written to the device (cuDNN's path keeps its filters KHWC) and read back: the same
    (out, in, kh, kw) arrays, bit for bit."""
    from graphtrain import reference_cnn as R
    from graphtrain.stages.cnn_device import CnnDevice, Recipe

    spec = R.CnnSpec((R.ConvLayer(6, 5), R.ConvLayer(8, 3)), (32,), classes=10)
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 1, (256, 784)).astype(np.float32)
    y = rng.integers(0, 10, 256).astype(np.int32)
    params = [rng.standard_normal(shape).astype(np.float32) for shape in spec.param_shapes()]
    model = CnnDevice(gpu_device, spec, Recipe(batch=128), x, y, x[:64], y[:64], fused=fused)
    try:
        assert model.fused == fused
        model.load(params, np.arange(256, dtype=np.int32)[None])
        for got, want in zip(model.weights(), params, strict=True):
            assert got.shape == want.shape and got.tobytes() == want.tobytes(), f"seed {seed}"
    finally:
        model.close()
