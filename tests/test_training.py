"""The trainer and the numpy stage, on small synthetic data and on the real MNIST."""

import numpy as np
import pytest
from helpers import reference_run

from graphtrain import TrainConfig, train
from graphtrain.config import PRESETS
from graphtrain.data import Dataset, load
from graphtrain.errors import TrainingError, UsageError
from graphtrain.plan import RunPlan
from graphtrain.record import EpochRecord, median_epoch_ms
from graphtrain.stages import get_stage
from graphtrain.stages.numpy_cpu import NumpyStage
from graphtrain.training import run_stage

RECORD_KEYS = {"stage", "kind", "note", "config", "environment", "data", "epochs", "epoch_ms",
               "setup_ms", "total_ms", "test_accuracy", "train_loss", "warnings", "precision",
               "nodes_per_step"}


@pytest.fixture(scope="module")
def small():
    return Dataset.synthetic(1000, 300, seed=1)


def test_record_has_the_stable_keys(small):
    seen = []
    record = train(TrainConfig(hidden=(32,), batch=64, epochs=3), data=small,
                   progress=lambda e, n, entry: seen.append((e, n)))
    saved = record.to_json()
    assert RECORD_KEYS <= set(saved)
    assert saved["stage"] == "numpy" and seen == [(0, 3), (1, 3), (2, 3)]
    assert [e["epoch"] for e in saved["epochs"]] == [1, 2, 3]
    assert all(e["batches"] == 16 for e in saved["epochs"])
    assert saved["config"]["dims"] == [784, 32, 10]
    assert saved["environment"]["python"] and saved["environment"]["numpy"]
    assert saved["data"] == {"name": "synthetic", "train": 1000, "test": 300, "image_shape": None}
    assert saved["epoch_ms"] == record.epoch_ms and saved["train_loss"] == record.train_loss
    assert record.test_accuracy > 0.8  # the synthetic classes are separable
    losses = [e.train_loss for e in record.epochs]
    assert losses[-1] < losses[0]
    assert record.warnings == []
    # The numpy stage computes in fp32 and captures no step graph; no profile, no repeats, no log.
    assert (saved["precision"], saved["nodes_per_step"]) == ("fp32", None)
    assert not {"profile", "repeats", "epoch_ms_min", "log"} & set(saved)


@pytest.mark.parametrize("row, precision", [
    ("numpy", "fp32"), ("graphs", "fp32"), ("fused", "fp32"), ("bf16", "bf16"), ("device-loop", "bf16"),
    ("persistent", "bf16"), ("torch-eager", "fp32"), ("torch-graph", "fp32"), ("torch-compile", "bf16"),
    ("jax-scan", "fp32"), ("torch-graph-bf16", "bf16"), ("jax-scan-bf16", "bf16"),
])
def test_every_row_says_its_own_precision(row, precision):
    """What the ladder's headline pairs rungs and peers by (imports no framework and no GPU)."""
    assert get_stage(row).precisions[0] == precision


def test_a_record_carries_the_rows_precision_and_nodes_per_step(small):
    class CapturingStage(NumpyStage):
        """The numpy stage, claiming the precision and the step graph of a later rung."""

        precisions = ("bf16",)

        def setup(self):
            super().setup()
            self.nodes_per_step = 15

    plan = RunPlan.for_data(TrainConfig(batch=100, epochs=1), small)
    saved = run_stage(CapturingStage, plan, small).to_json()
    assert (saved["precision"], saved["nodes_per_step"]) == ("bf16", 15)


def test_numpy_stage_is_the_reference_step_by_step(small):
    cfg = TrainConfig(hidden=(16,), batch=300, epochs=2, lr=0.2, seed=3)
    plan = RunPlan.for_data(cfg, small)
    with get_stage("numpy")(plan, small) as stage:
        stage.setup()
        for epoch in range(2):
            stage.train_epoch(epoch, 4, measure=True)
        weights = stage.weights()
    _, layers = reference_run(cfg, small, epochs=2)  # the tail batch of 100 rows included
    for w32, w64 in zip(weights, layers):
        assert np.linalg.norm(w32.w - w64.w) / np.linalg.norm(w64.w) < 1e-5


def test_steps_stop_inside_the_last_epoch(small):
    record = train(TrainConfig(batch=100, epochs=None, steps=25), data=small)
    assert [e.batches for e in record.epochs] == [10, 10, 5]
    assert [e.full for e in record.epochs] == [True, True, False]


def test_same_seed_same_result(small):
    a = train(TrainConfig(batch=100, epochs=2, seed=5), data=small)
    b = train(TrainConfig(batch=100, epochs=2, seed=5), data=small)
    assert [e.train_loss for e in a.epochs] == [e.train_loss for e in b.epochs]


def test_nan_loss_names_the_epoch_and_suggests_a_lower_lr(small):
    with np.errstate(all="ignore"), pytest.raises(TrainingError, match=r"epoch 1 .*lower --lr"):
        train(TrainConfig(hidden=(64,), batch=100, epochs=3, lr=1e30), data=small)


def test_a_finite_loss_that_explodes_is_a_warning_naming_the_epoch(small):
    """A loss far above the loss of guessing, ln(classes), is a run diverging, even when finite."""
    record = train(TrainConfig(hidden=(32,), batch=100, epochs=3, lr=1e4), data=small)
    assert all(np.isfinite(e.train_loss) for e in record.epochs)
    assert max(e.train_loss for e in record.epochs) > 100
    assert len(record.warnings) == 1
    assert "epoch 1" in record.warnings[0] and "diverging" in record.warnings[0]
    assert record.to_json()["warnings"] == record.warnings


def test_invalid_config_is_rejected_before_training(small):
    with pytest.raises(UsageError, match="larger than the dataset"):
        train(TrainConfig(batch=5000, epochs=1), data=small)
    with pytest.raises(UsageError, match="unknown stage"):
        train(TrainConfig(), stage="warp-drive", data=small)


def test_a_model_too_large_for_the_memory_is_rejected_before_any_allocation(small, monkeypatch):
    """--hidden 1000000000 would need terabytes: a one-line UsageError, not numpy's MemoryError."""
    with pytest.raises(UsageError, match=r"needs at least 3\.\d TB .*free on this machine.*--hidden"):
        train(TrainConfig(hidden=(10**9,), epochs=1), data=small)


def test_a_model_too_large_to_train_on_the_host_is_rejected_before_setup(small, monkeypatch):
    """The plan fits, but the numpy stage's weights, gradients and activations would not."""
    from graphtrain import environment
    from graphtrain.plan import Footprint

    plan = RunPlan.for_data(TrainConfig(hidden=(1024,), epochs=1), small)
    footprint = Footprint.of(plan.config, 1000, 300)
    monkeypatch.setattr(environment, "free_host_memory", lambda: footprint.host_bytes - 1)
    with pytest.raises(UsageError, match="more than the memory free on this machine"):
        run_stage(get_stage("numpy"), plan, small)


def test_a_model_too_large_for_the_gpu_is_rejected_before_setup(small, monkeypatch):
    from graphtrain.stages.numpy_cpu import NumpyStage

    class SmallGpu(NumpyStage):
        name = "small-gpu"
        uses_gpu = True

        @classmethod
        def check_available(cls):
            return 1 << 20  # a 1 MiB GPU

        def setup(self):
            raise AssertionError("setup must not start")

    monkeypatch.setattr("graphtrain.training.get_stage", lambda name: SmallGpu)
    with pytest.raises(UsageError, match=r"more than the GPU's memory \(1\.0 MB\)"):
        train(TrainConfig(hidden=(1024,), epochs=1), stage="small-gpu", data=small)


def test_median_epoch_is_over_the_second_half():
    epochs = [EpochRecord(i + 1, ms, 10, full=True) for i, ms in enumerate((100, 90, 5, 7, 6, 1000))]
    assert median_epoch_ms(epochs) == 7  # median of 7, 6, 1000
    epochs.append(EpochRecord(7, 0.5, 3, full=False))  # a steps-limited last epoch is not timed
    assert median_epoch_ms(epochs) == 7


def test_jhu_preset_on_real_mnist_reaches_91_percent(mnist_dir):
    record = train(PRESETS["jhu"], data=load("mnist", data_dir=mnist_dir, offline=True))
    assert record.test_accuracy >= 0.91
    assert len(record.epochs) == 20 and record.epochs[0].batches == 469
