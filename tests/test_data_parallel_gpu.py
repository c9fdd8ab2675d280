"""`run --gpus 2` on two GPUs: the trained weights equal one GPU's at the combined batch within
fp32 rounding, and the record says how it ran. Skipped, with the reason, without two GPUs or NCCL.

Each MLP run is a `graphtrain run` process (the data-parallel ranks are processes of their own);
both start from the seeded init and take the same samples in the same order. The cnn is not
saved by `run --save`, so its runs go through the library: `data_parallel.train` (the ranks
spawned as `run --gpus` spawns them) and `run_stage` on this process's GPU. Its ranks' slicing,
loss step and all-reduce point are also checked on one GPU without NCCL: two rank models stepped
in lockstep, their gradient spans summed on the host where NCCL would."""

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
# fp32 sums in another order (two half-batch products and their all-reduce against one product):
# each step's update differs by a rounding (~1e-7 of it), and training's own dynamics carry the
# differences on. Measured on H100s for the 784³ MLP: 1.75e-5 after 50 steps, 5.8e-4 after an
# epoch; the bound for 50 steps keeps a margin of ~6 and is still far below what a wrong slice,
# scale or order gives (≥ 1e-2).
WEIGHT_TOLERANCE = 1e-4  # ‖a − b‖ / ‖b‖ of the weights
CHANGE_TOLERANCE = 1e-2  # of what training changed, ‖(a − w0) − (b − w0)‖ / ‖b − w0‖: 1.7e-3 measured


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


# ---- the cnn --------------------------------------------------------------------------------------

# The cnn's gradients are fp32 sums over 64 to 2048 rows taken in another order on two GPUs (each
# rank's rows, then the all-reduce's one addition; the conv kernels' chunks over another row
# count); the runs here are fp32 throughout. With SGD a rounding δ moves an update by lr·|g|·δ,
# and training carries it on (see the `tail` case): over 7–20 steps a few 1e-5 of ‖b‖; the bounds
# take a 10× margin. The
# lockstep test (one GPU, fp32) holds the bound the one-GPU run meets against float64 on the
# synthetic task (test_cnn_gpu.test_training_steps_match_reference).
CNN_WEIGHT_TOLERANCE = 5e-4  # ‖a − b‖ / ‖b‖, the two-GPU runs
# Of what training moved, ‖a − b‖ / ‖b − w0‖: 20–32 SGD steps move the weights little, so the
# same difference is a larger share of it (measured on H100s: 3.3e-3 and 4.7e-3 after 20–32 steps).
CNN_CHANGE_TOLERANCE = 2e-2
# cuDNN may pick FFT or Winograd algorithms (and other ones for 64 rows than for 128), which
# round more than a direct sum: there the one-GPU run meets 1e-3 against float64.
CNN_LOCKSTEP_TOLERANCE = {"fused": 1e-4, "cudnn-nhwc": 1e-3}


def flat_cnn(layers) -> np.ndarray:
    return np.concatenate([a.astype(np.float64).ravel() for layer in layers for a in (layer.w, layer.b)])


def flat_arrays(arrays) -> np.ndarray:
    return np.concatenate([a.astype(np.float64).ravel() for a in arrays])


@pytest.mark.parametrize("path", ["fused", "cudnn-nhwc"])
def test_two_cnn_ranks_stepped_in_lockstep_train_the_combined_batch(gpu_device, path):
    """Rank 0 and rank 1 of 2 (64 rows each of the combined 128) on this GPU, their gradient spans
    summed on the host at the step's all-reduce (the node just before the optimizer's), against
    one model at 128: every step of an epoch of 600 = 4·128 + 88 (the tail: 44 rows a rank), fp32."""
    from test_cnn_gpu import PATHS, small_task

    from graphtrain.stages.cnn_device import CnnDevice

    task, seed = small_task(precision="fp32"), 5
    args = (gpu_device, task.spec, task.recipe, task.train_images, task.train_labels, task.test_images,
            task.test_labels)
    one = CnnDevice(*args, **PATHS[path][0])
    ranks = [CnnDevice(*args, **PATHS[path][0], rank=r, ranks=2, all_reduce=lambda *a: None) for r in range(2)]
    try:
        assert [m.batch for m in ranks] == [64, 64] and one.batch == 128
        for m in (one, *ranks):
            m.load(task.initial(seed), task.orders(seed))
            m.reset(m.stream)
        for _ in range(task.steps):
            one.record_step(one.stream)
            ops = [m.step_ops(m.stream) for m in ranks]
            names = [name for name, _ in ops[0]]
            cut = names.index("all-reduce")
            assert names[cut + 1:] == ["optimizer"]
            for steps in ops:
                for _, op in steps[:cut]:
                    op()
            first, second = (m.grads.download(m.stream) for m in ranks)
            total = first + second  # fp32: NCCL's sum of two ranks, one addition per element
            for m in ranks:
                m.grads.upload(total, m.stream)
            for steps in ops:
                for _, op in steps[cut + 1:]:
                    op()
        got, other, want = (flat_arrays(m.weights()) for m in (ranks[0], ranks[1], one))
        cursors = [int(m.cursor.download(m.stream)[0]) for m in (one, *ranks)]
        losses = [m.read_loss_sum() for m in (one, *ranks)]
    finally:
        for m in (one, *ranks):
            m.close()
    assert np.array_equal(got, other), "the ranks' weights differ"
    assert cursors == [600, 600, 600]
    diff = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert diff < CNN_LOCKSTEP_TOLERANCE[path], f"{path}, seed {seed}: ‖a−b‖/‖b‖ = {diff:.3e}"
    assert abs(losses[1] + losses[2] - losses[0]) < 1e-5 * losses[0], f"{path}, seed {seed}: {losses}"


def train_both(source, config):
    """(`config` on two GPUs, `config` on one at the same combined batch, the plan), both on the
    dataset `source` (a graphtrain.sweep.DataSource) loads."""
    from graphtrain import data_parallel
    from graphtrain.plan import RunPlan
    from graphtrain.stages import get_stage
    from graphtrain.training import run_stage

    data = source.load()
    plan = RunPlan.for_data(config, data)
    parallel = data_parallel.train(plan, data_parallel.require(2), source)
    single = run_stage(get_stage("graphs"), plan, data)
    assert [e.batches for e in parallel.epochs] == list(plan.batches)
    assert parallel.config.model == "cnn" and parallel.environment["nccl"]
    assert parallel.precision == single.precision
    return parallel, single, plan


def mnist_source(mnist_dir):
    from graphtrain.sweep import DataSource

    return DataSource("mnist", data_dir=mnist_dir)


def mnist_slice_source(mnist_dir, tmp_path, num_train: int):
    """MNIST with its first `num_train` training images, as an .npz the ranks load."""
    from graphtrain import data as data_mod
    from graphtrain.sweep import DataSource

    data = data_mod.load("mnist", data_dir=mnist_dir)
    path = tmp_path / f"mnist{num_train}.npz"
    np.savez(path, x_train=data.train_images[:num_train], y_train=data.train_labels[:num_train],
             x_test=data.test_images, y_test=data.test_labels)
    return DataSource(path.stem, data_file=path)


# `tail`: 10,000 = 4·2048 + 1808 training images, so 7 steps cross the tail batch (904 rows a rank)
# into the second epoch. Not the whole of MNIST (29 steps before its tail): the runs are two
# programs that sum in another order, and a rounding apart in the weights is carried on by
# training's own dynamics, every ReLU or max-pool choice it flips moving a whole gradient term.
# Measured on H100s with scripts/probes/cnn_ranks_lockstep.py (two ranks and one model stepped in
# lockstep on one GPU, batch 2048, SGD at 0.05): 1e-6 of what training moved after one step,
# 4.7e-5 after 5, 1.3e-3 after 32, and then the second epoch's loss 1e-3 apart; at TF32 (the
# rung's default) the same, and each run as far from the float64 reference (7e-3 after 32 steps) as
# from the other. Over 7 steps the runs stay within rounding of each other, so the loss read across
# the tail and the epoch boundary is checked at the bound of a rounding.
@pytest.mark.parametrize("per_gpu, steps, num_train", [(128, 20, None), (1024, 7, 10_000)], ids=["20-steps", "tail"])
def test_two_gpus_train_the_cnn_of_one_gpu_at_the_combined_batch(two_gpus, mnist_dir, tmp_path, seed, per_gpu,
                                                                  steps, num_train):
    """The speedrun cnn with SGD (whose updates scale with the gradients, so fp32 rounding stays
    rounding) in fp32, --gpus 2 against one GPU at the combined batch."""
    from graphtrain.config import preset

    source = mnist_source(mnist_dir) if num_train is None else mnist_slice_source(mnist_dir, tmp_path, num_train)
    config = preset("speedrun").replace(batch=2 * per_gpu, steps=steps, seed=seed, optimizer="sgd",
                                        schedule="constant", lr=0.05, precision="fp32")
    parallel, single, plan = train_both(source, config)
    if num_train is not None:
        assert len(parallel.epochs) == 2 and parallel.epochs[1].batches == 2, "the run crosses into epoch 2"
    start, a, b = flat_cnn(plan.initial), flat_cnn(parallel.params), flat_cnn(single.params)
    weights = np.linalg.norm(a - b) / np.linalg.norm(b)
    change = np.linalg.norm(a - b) / np.linalg.norm(b - start)
    assert weights < CNN_WEIGHT_TOLERANCE, f"seed {seed}: ‖a−b‖/‖b‖ = {weights:.3e}"
    assert change < CNN_CHANGE_TOLERANCE, f"seed {seed}: ‖a−b‖/‖b−w0‖ = {change:.3e}"
    for p, s in zip(parallel.epochs, single.epochs):  # the ranks' loss sums, all-reduced when read
        assert abs(p.train_loss - s.train_loss) < 1e-4 * s.train_loss, f"seed {seed}: {p.train_loss} {s.train_loss}"
    assert parallel.data_parallel["gpus"] == 2 and parallel.data_parallel["batch_per_gpu"] == per_gpu


def test_two_gpus_train_the_speedrun_recipe_as_one_gpu(two_gpus, mnist_dir, seed):
    """The speedrun recipe itself (Adam, one-cycle) on two GPUs: Adam's first updates are ±lr
    whatever a gradient's size, so the sign of a near-zero gradient, which fp32 summation order
    can flip, decides a whole step of that weight (measured on H100s: weights 4.6e-3 to 1.8e-2
    apart after 20–32 steps, against ~1e-5 with SGD). The runs agree in what they learn: the loss
    of each epoch and the test accuracy."""
    from graphtrain.config import preset

    config = preset("speedrun").replace(batch=256, epochs=1, seed=seed)
    parallel, single, _ = train_both(mnist_source(mnist_dir), config)
    for p, s in zip(parallel.epochs, single.epochs):
        assert abs(p.train_loss - s.train_loss) < 2e-2 * s.train_loss, f"seed {seed}: {p.train_loss} {s.train_loss}"
    assert abs(parallel.test_accuracy - single.test_accuracy) < 3e-3, f"seed {seed}"
