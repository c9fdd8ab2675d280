"""Models saved by the GPU rungs: every rung saves the fp32 parameters it trained; PyTorch loads
them as they are and reproduces their accuracy; resuming a GPU run from its saved model continues
it exactly.

Skipped where there is no GPU; the PyTorch checks also where torch (with CUDA) is missing.
"""

from __future__ import annotations

import numpy as np
import pytest

import graphtrain
from graphtrain import evaluate
from graphtrain.config import PRESETS
from graphtrain.data import Dataset, load
from graphtrain.errors import UsageError
from graphtrain.plan import RunPlan
from graphtrain.stages import LADDER
from graphtrain.training import train


MODELS = {"softmax-regression": dict(hidden=(), bias=True), "mlp": dict(hidden=(256, 128), bias=True),
          "mlp-no-bias": dict(hidden=(128,), bias=False)}
# Each model saved by the graphs rung and by the newest rung that trains it: persistent trains
# neither MLP here (unequal hidden sizes; a batch of 128 whose step outgrows its shared memory), so
# their newest is device-loop (bf16 operands, fp32 masters saved).
NEWEST = {"softmax-regression": "persistent", "mlp": "device-loop", "mlp-no-bias": "device-loop"}
SAVED_BY = [(stage, model) for model in MODELS for stage in ("graphs", NEWEST[model])]
SAVING_STAGES = ["graphs", *sorted(set(NEWEST.values()), key=list(LADDER).index)]
GPU_RUNGS = [name for name in LADDER if name != "numpy"]


@pytest.fixture(scope="module")
def mnist(mnist_dir):
    return load("mnist", data_dir=mnist_dir, offline=True)


def train_or_skip(config, stage, data):
    """Train; skip only where the persistent rung finds no thread-block clusters (a GPU before
    Hopper). Any other refusal of a model these tests give a rung is a defect."""
    try:
        return train(config, stage=stage, data=data)
    except UsageError as error:
        if stage != "persistent" or "compute capability" not in str(error):
            raise
        pytest.skip(f"{stage} does not run on this GPU: {error}")


def torch_cuda():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch")
    return torch


@pytest.mark.parametrize("stage", GPU_RUNGS)
def test_every_gpu_rung_saves_the_parameters_it_trained(stage, tmp_path):
    """`run --save` from any rung: the file holds the fp32 parameters the rung trained (a bf16
    rung's master weights, not their bf16 copies), and NumPy scores them as the rung did."""
    data = Dataset.synthetic(2000, 500, seed=5)
    cfg = PRESETS["jhu"].replace(epochs=1, batch=100, seed=5, hidden=(64,))
    record = train_or_skip(cfg, stage, data)
    model = graphtrain.load(graphtrain.save(tmp_path / f"{stage}.safetensors", record))
    assert (model.info.stage, model.info.epochs_trained) == (stage, 1)
    initial = RunPlan.for_data(cfg, data).initial
    for saved, trained, start in zip(model.layers, record.params, initial, strict=True):
        assert saved.w.dtype == np.float32 and saved.w.tobytes() == trained.w.tobytes()
        assert saved.b.tobytes() == trained.b.tobytes()
        assert not np.array_equal(saved.w, start.w), "the initial weights were saved, not the trained ones"
    # A bf16 copy widened to fp32 has its low 16 bits zero; trained fp32 weights do not.
    assert (model.layers[0].w.view(np.uint32) & 0xFFFF).any(), "bf16-rounded weights were saved"
    result = evaluate.evaluate(model.layers, data.test_images, data.test_labels, model.info.classes)
    # fp32 on the CPU and the GPU sum in other orders: only a near tie of two logits may differ.
    assert abs(result.accuracy - record.test_accuracy) <= 2 / len(data.test_labels), (
        stage, result.accuracy, record.test_accuracy)


@pytest.mark.parametrize("stage, model", SAVED_BY)
def test_pytorch_loads_the_saved_model_and_reproduces_its_accuracy(stage, model, mnist, tmp_path):
    torch = torch_cuda()
    from safetensors.torch import load_file

    cfg = PRESETS["jhu"].replace(epochs=2, **MODELS[model])
    record = train_or_skip(cfg, stage, mnist)
    path = graphtrain.save(tmp_path / f"{stage}.safetensors", record)

    # Exactly what a PyTorch user writes: their own Sequential, the file's state_dict, strict.
    dims = record.config.dims
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(dims[:-1], dims[1:])):
        layers += [torch.nn.ReLU()] if i else []
        layers.append(torch.nn.Linear(fan_in, fan_out, bias=cfg.bias))
    net = torch.nn.Sequential(*layers)
    net.load_state_dict(load_file(path))
    built = graphtrain.to_torch(path)
    for (name, a), (name_b, b) in zip(net.state_dict().items(), built.state_dict().items()):
        assert name == name_b and torch.equal(a, b)

    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products, as the rungs compute them
    try:
        net = net.cuda().eval()
        with torch.no_grad():
            logits = net(torch.as_tensor(mnist.test_images, device="cuda"))
        predicted = logits.argmax(dim=1).cpu().numpy()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32
    accuracy = int((predicted == mnist.test_labels).sum()) / len(mnist.test_labels)
    assert accuracy == record.test_accuracy, (stage, model, accuracy, record.test_accuracy)


@pytest.mark.parametrize("stage, model", [(s, m) for s, m in SAVED_BY if m in ("softmax-regression", "mlp")])
def test_resuming_a_gpu_run_continues_it_exactly(stage, model, tmp_path):
    data = Dataset.synthetic(3000, 500, seed=12)
    cfg = PRESETS["jhu"].replace(batch=128, epochs=4, seed=12, **MODELS[model])
    whole = train_or_skip(cfg, stage, data)
    first = train(cfg.replace(epochs=2), stage=stage, data=data)
    path = graphtrain.save(tmp_path / "half.safetensors", first)
    rest = train(cfg.replace(epochs=2), stage=stage, data=data, init=path)
    assert [e.epoch for e in rest.epochs] == [3, 4]
    # The rungs are deterministic: the same step sequence from the same start is bit-identical.
    for a, b in zip(rest.params, whole.params, strict=True):
        assert a.w.tobytes() == b.w.tobytes() and a.b.tobytes() == b.b.tobytes()
    assert rest.train_loss == whole.train_loss


@pytest.mark.parametrize("stage", SAVING_STAGES)
def test_own_data_with_three_classes_trains_on_the_gpu(stage, tmp_path):
    rng = np.random.default_rng(8)
    means = rng.uniform(0, 255, size=(3, 12, 10))

    def split(n):
        labels = rng.permutation(np.arange(n) % 3)
        return np.clip(means[labels] + rng.normal(0, 50, (n, 12, 10)), 0, 255).astype(np.uint8), labels

    (x_train, y_train), (x_test, y_test) = split(1200), split(300)
    data = Dataset.from_arrays(x_train, y_train, x_test, y_test, name="mine")
    record = train_or_skip(PRESETS["jhu"].replace(epochs=3, batch=64), stage, data)
    assert record.config.dims == (120, 3) and record.test_accuracy > 0.9
    model = graphtrain.load(graphtrain.save(tmp_path / "mine.safetensors", record))
    assert model.info.image_shape == (12, 10) and model.info.classes == 3
