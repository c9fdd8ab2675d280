"""`run --gpus 2` on two GPUs: the trained weights equal one GPU's at the combined batch within
fp32 rounding, and the record says how it ran. Skipped, with the reason, without two GPUs or NCCL.

Each run is a `graphtrain run` process (the data-parallel ranks are processes of their own);
both start from the seeded init and take the same samples in the same order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from graphtrain import model_io, reference

ROOT = Path(__file__).resolve().parents[1]
# fp32 sums in another order (two half-batch products and their all-reduce against one product),
# over an epoch: the same bound the rungs meet against the float64 reference (test_oracle_gpu).
WEIGHT_TOLERANCE = 1e-5  # ‖a − b‖ / ‖b‖ of the weights
CHANGE_TOLERANCE = 1e-4  # of what training changed: ‖(a − w0) − (b − w0)‖ / ‖b − w0‖


@pytest.fixture(scope="module")
def two_gpus():
    """Two GPUs and NCCL, or a skip saying which is missing."""
    from graphtrain.errors import GpuUnavailableError
    from graphtrain.libs import cuda, nccl

    count = cuda.device_count()
    if count < 2:
        pytest.skip(f"data-parallel training needs 2 GPUs; this machine has {count}")
    try:
        nccl.library.load()
    except GpuUnavailableError as exc:
        pytest.skip(str(exc))
    return count


def run(tmp_path: Path, mnist_dir: Path, name: str, *args: str) -> tuple[dict, list]:
    record, weights = tmp_path / f"{name}.json", tmp_path / f"{name}.safetensors"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "graphtrain", "run", "--stage", "graphs", "--data-dir",
                           str(mnist_dir), "--json", str(record), "--save", str(weights), *args],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(record.read_text()), model_io.load(weights).layers


def flat(layers) -> np.ndarray:
    return np.concatenate([a.astype(np.float64).ravel() for layer in layers for a in (layer.w, layer.b)
                           if a is not None])


@pytest.mark.parametrize("hidden, bias", [("64,64", True), ("784,784,784", True), ("96", False)])
def test_two_gpus_train_the_weights_of_one_gpu_at_the_combined_batch(two_gpus, mnist_dir, tmp_path, seed, hidden,
                                                                      bias):
    # 50 steps: long enough to cross the epoch-order machinery and the ReLUs' kinks, short enough
    # that fp32 rounding has not been amplified by training's own dynamics (over a whole epoch of
    # the 784³ MLP two runs summed in different orders measured 5.8e-4 apart; 20 epochs, 1.5e-2).
    common = ["--hidden", hidden, "--steps", "50", "--seed", str(seed), "--lr", "0.05",
              "--bias" if bias else "--no-bias"]
    parallel, got = run(tmp_path, mnist_dir, "two", *common, "--batch", "64", "--gpus", "2")
    single, want = run(tmp_path, mnist_dir, "one", *common, "--batch", "128")
    dims = tuple(parallel["config"]["dims"])
    start = flat(reference.init_params(dims, bias, seed, np.float32))
    a, b = flat(got), flat(want)
    weights = np.linalg.norm(a - b) / np.linalg.norm(b)
    change = np.linalg.norm((a - start) - (b - start)) / np.linalg.norm(b - start)
    assert weights < WEIGHT_TOLERANCE, f"seed {seed}: ‖a−b‖/‖b‖ = {weights:.3e}"
    assert change < CHANGE_TOLERANCE, f"seed {seed}: the trained change differs by {change:.3e}"
    assert abs(parallel["test_accuracy"] - single["test_accuracy"]) < 2e-3, f"seed {seed}"
    assert parallel["data_parallel"]["gpus"] == 2 and parallel["data_parallel"]["batch_per_gpu"] == 64
    assert parallel["data_parallel"]["combined_batch"] == parallel["config"]["batch"] == 128
    assert parallel["precision"] == single["precision"] == "fp32"
    assert parallel["environment"]["nccl"]


def test_the_loss_read_each_epoch_is_the_combined_batches(two_gpus, mnist_dir, tmp_path, seed):
    """The ranks' loss and accuracy sums are all-reduced when read: the same as one GPU's."""
    common = ["--hidden", "64", "--epochs", "2", "--seed", str(seed)]
    parallel, _ = run(tmp_path, mnist_dir, "two", *common, "--batch", "128", "--gpus", "2")
    single, _ = run(tmp_path, mnist_dir, "one", *common, "--batch", "256")
    measured = [(p, s) for p, s in zip(parallel["epochs"], single["epochs"]) if s["train_loss"] is not None]
    assert measured and all(p["train_loss"] is not None for p, _ in measured)
    for p, s in measured:
        assert abs(p["train_loss"] - s["train_loss"]) < 1e-4 * s["train_loss"], f"seed {seed}"
        assert abs(p["train_accuracy"] - s["train_accuracy"]) < 1e-3, f"seed {seed}"
