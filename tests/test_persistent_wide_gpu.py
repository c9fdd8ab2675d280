"""The persistent rung's grid kernel (persistent_wide.cu) on a GPU: the weights after a few steps
against the float64 reference and against the bf16 rung, the loss it measures, the same bits twice,
and the refusal past what it fits (what it compiles to and which shapes it takes are tested without
a GPU, in test_persistent_wide.py, and its logic on the CPU in test_persistent_wide_emulated.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from bf16_reference import bf16_reference_steps
from helpers import rel_err

from graphtrain import reference
from graphtrain.config import TrainConfig
from graphtrain.data import Dataset
from graphtrain.errors import UsageError
from graphtrain.kernels import persistent_wide
from graphtrain.kernels.persistent_wide import WideShape
from graphtrain.plan import RunPlan
from graphtrain.stages import get_stage

# The relative error of the weights' change over STEPS steps, against float64: the bf16 rungs'
# tolerance for an epoch of a few steps (tests/test_oracle_gpu.py: bf16 operands keep 8 significant
# bits, and an update compounds the roundings of every layer above it; the persistent MLP kernels
# measured 5.4e-2 to 7.3e-2 over four steps). Against the bf16 rung, whose roundings are its own, the
# same bound. A wrong step (a missing mask, a transposed operand, a stale weight) errs by order 1.
BOUND = 0.15
# Against the float64 run with the kernel's own bf16 roundings (bf16_reference.py): what is left is
# the order and rounding of its fp32 sums, and the rare bf16 rounding or ReLU mask they flip (one
# mask flipped at 784 units moves an update by ~3e-3). A wrong fragment, index or step errs by order 1.
# Measured on an H100 over three steps: up to 1.9e-2 (512 units, batch 32); the bound leaves room.
ROUNDED_BOUND = 3e-2
LOSS_BOUND = 2e-2  # the mean loss of the steps, relative: bf16 products in the forward
STEPS = 3  # 300 samples at batch 128: steps of 128, 128 and 44 rows (the last a tail)
SAMPLES = 300


def eight_bit(data: Dataset) -> Dataset:
    """The dataset's images as 8-bit pixels k/255 (as loaded from uint8), which the kernel reads as k."""
    return dataclasses.replace(data, train_images=np.rint(data.train_images * 255).astype(np.float32) / np.float32(255))


def train_steps(name: str, cfg: TrainConfig, data: Dataset, steps: int):
    """`steps` steps of epoch 0 on rung `name`: (its shape or None, the measured (loss, accuracy),
    the weights after), the grid kernel checked to be the persistent rung's."""
    with get_stage(name)(RunPlan.for_data(cfg, data), data) as stage:
        stage.setup()
        shape = getattr(stage, "shape", None)
        if name == "persistent":
            assert isinstance(shape, WideShape) and stage.environment()["persistent_kernel"] == "grid"
        result = stage.train_epoch(0, steps, measure=True)
        return shape, (result.train_loss, result.train_accuracy), stage.weights()


def reference_steps(cfg: TrainConfig, data: Dataset, steps: int):
    """The float64 run of the first `steps` steps: (initial layers, layers after, mean loss, accuracy)."""
    start = reference.init_params(cfg.dims, cfg.bias, cfg.seed, np.float64)
    layers = [layer.copy() for layer in start]
    order = reference.epoch_order(cfg.seed, 0, len(data.train_images))
    loss = correct = seen = 0
    for lo, hi in reference.batch_bounds(len(data.train_images), cfg.batch)[:steps]:
        batch_loss, batch_correct = reference.train_step(layers, data.train_images[order[lo:hi]].astype(np.float64),
                                                         data.train_labels[order[lo:hi]], cfg.lr)
        loss, correct, seen = loss + batch_loss, correct + batch_correct, seen + hi - lo
    return start, layers, loss / seen, correct / seen


def change_errors(got, start, want) -> list[float]:
    """Per parameter (each layer's W, then b): ‖Δgot − Δwant‖ / ‖Δwant‖, Δ the change from `start`."""
    out = []
    for g, s, w in zip(got, start, want):
        out.append(rel_err(g.w.astype(np.float64) - s.w, w.w - s.w))
        if s.b is not None:
            out.append(rel_err(g.b.astype(np.float64) - s.b, w.b - s.b))
    return out


def wide_step_errors(hidden: tuple[int, ...], batch: int, seed: int, eight_bits: bool = True, against_bf16: bool = False,
                     samples: int = SAMPLES, steps: int = STEPS) -> dict:
    """The grid kernel's `steps` steps against float64 with its roundings and without (and against the
    bf16 rung's): the worst relative error of a parameter's change, the loss's, and the accuracy's
    difference; with the shape trained."""
    data = Dataset.synthetic(samples, 100, seed=seed)
    data = eight_bit(data) if eight_bits else data
    cfg = TrainConfig(hidden=hidden, batch=batch, epochs=1, lr=0.1, seed=seed, precision="bf16")
    shape, (loss, accuracy), weights = train_steps("persistent", cfg, data, steps)
    start, after, ref_loss, ref_accuracy = reference_steps(cfg, data, steps)
    _, rounded, _, _ = bf16_reference_steps(cfg, data, steps, shape.pixel_levels)
    out = {"shape": shape, "bf16-rounded float64": max(change_errors(weights, start, rounded)),
           "float64": max(change_errors(weights, start, after)),
           "loss": abs(loss - ref_loss) / ref_loss, "accuracy": abs(accuracy - ref_accuracy)}
    if against_bf16:
        _, _, rung = train_steps("bf16", cfg, data, steps)
        out["bf16 rung"] = max(change_errors(weights, start, rung))
        out["bf16 rung vs float64"] = max(change_errors(rung, start, after))
    return out


@pytest.mark.parametrize("hidden,batch,eight_bits", [
    ((257,) * 3, 128, True), ((512,) * 3, 128, True), ((784,) * 3, 128, True), ((1024,) * 3, 128, True),
    ((784,) * 3, 128, False), ((512,) * 3, 32, True), ((257, 257), 100, False),
])
def test_steps_match_float64(hidden, batch, eight_bits, seed):
    """Widths 257 (34 blocks, the last 15 units padding), 512, 784 and 1024 (128 blocks), three
    layers, then floats for images (rounded to bf16), batch 32 (the cuda-mnist preset's), and two
    layers with a batch of part tiles (100 rows: 300 samples are steps of 100 rows). (One hidden
    layer of 512 fits the cluster kernel, which the rung then takes.)"""
    errors = wide_step_errors(hidden, batch, seed, eight_bits)
    assert errors["shape"].hidden == hidden, f"seed {seed}"
    assert errors["bf16-rounded float64"] < ROUNDED_BOUND and errors["float64"] < BOUND, f"seed {seed}: {errors}"
    assert errors["loss"] < LOSS_BOUND and errors["accuracy"] <= 0.03, f"seed {seed}: {errors}"


@pytest.mark.parametrize("grid", [(8, 1), (16, 1)])
def test_blocks_alone_match_float64(monkeypatch, grid, seed):
    """The 784³ MLP in 98 blocks of 8 units or 49 of 16 (two mma columns a block; half the warps'
    partial sums held at once), each block its own cluster, as GRID_CHOICES may pick."""
    monkeypatch.setattr(persistent_wide, "GRID_CHOICES", (grid,))
    errors = wide_step_errors((784,) * 3, 128, seed)
    assert errors["shape"].grid == grid and errors["shape"].blocks == 784 // grid[0]
    assert errors["bf16-rounded float64"] < ROUNDED_BOUND and errors["float64"] < BOUND, f"seed {seed}: {errors}"
    assert errors["loss"] < LOSS_BOUND, f"seed {seed}: {errors}"


@pytest.mark.parametrize("hidden,batch", [((257,) * 3, 128), ((784,) * 3, 128), ((1024,) * 3, 128), ((512,) * 3, 32),
                                          ((257, 257), 100)])
def test_clusters_of_two_blocks_match_float64(monkeypatch, hidden, batch, seed):
    """Clusters of two blocks of 8 units (split 2: each block multiplies half of every product's
    inputs for the cluster's 16 units, the two trading their sums through distributed shared memory):
    257 units (17 clusters, the last 15 units padding), 784, 1024 (128 blocks), batch 32, and two layers
    at batch 100."""
    monkeypatch.setattr(persistent_wide, "GRID_CHOICES", ((16, 2),))
    errors = wide_step_errors(hidden, batch, seed, eight_bits=batch != 100)
    shape = errors["shape"]
    assert (shape.cluster_blocks, shape.block_units, shape.defines["SPLIT"]) == (2, 8, 2), f"seed {seed}"
    assert errors["bf16-rounded float64"] < ROUNDED_BOUND and errors["float64"] < BOUND, f"seed {seed}: {errors}"
    assert errors["loss"] < LOSS_BOUND and errors["accuracy"] <= 0.03, f"seed {seed}: {errors}"


def test_steps_match_the_bf16_rung(seed):
    """The 784³ MLP: the grid kernel's weights against the bf16 rung's (the same precision, its own
    roundings), both against float64."""
    errors = wide_step_errors((784,) * 3, 128, seed, against_bf16=True)
    assert errors["bf16 rung"] < BOUND and errors["bf16 rung vs float64"] < BOUND, f"seed {seed}: {errors}"


@pytest.mark.parametrize("variant,grid", [(variant, (8, 1)) for variant in persistent_wide.VARIANTS] + [("registers", (16, 2))])
def test_same_seed_gives_the_same_bits(monkeypatch, variant, grid):
    """Sums in a fixed order, no float atomics: two runs of two epochs (the second from the first's
    weights, with a tail step each) give the same weights, losses and accuracies bit for bit, in
    each build of the kernel, and in clusters of two blocks."""
    monkeypatch.setattr(persistent_wide, "DEFAULT_VARIANT", variant)
    monkeypatch.setattr(persistent_wide, "GRID_CHOICES", (grid,))
    data = eight_bit(Dataset.synthetic(SAMPLES, 100, seed=5))
    cfg = TrainConfig(hidden=(784,) * 3, batch=128, epochs=2, lr=0.1, seed=6)

    def run():
        with get_stage("persistent")(RunPlan.for_data(cfg, data), data) as stage:
            stage.setup()
            metrics = [stage.train_epoch(epoch, STEPS, measure=True) for epoch in range(2)]
            return [(m.train_loss, m.train_accuracy) for m in metrics], stage.weights()

    (metrics_a, weights_a), (metrics_b, weights_b) = run(), run()
    assert metrics_a == metrics_b
    for a, b in zip(weights_a, weights_b):
        assert np.array_equal(a.w, b.w) and np.array_equal(a.b, b.b)


@pytest.mark.parametrize("hidden,batch", [((784,) * 3, 128), ((1024,) * 3, 128), ((512,) * 3, 32)])
def test_the_staged_build_gives_the_registers_builds_weights(monkeypatch, hidden, batch, seed):
    """The staged build (each warp's k-steps copied ahead into a ring in shared memory: two slabs at
    784 and 1024 units, seven at batch 32; blocks of 8 units) against the registers build after three steps (at
    batch 128 the last a tail of 44 rows): within the bound the registers build keeps to the float64
    run with its roundings, and the same bits (the same fragments, summed in the same order); and
    against float64."""
    data = eight_bit(Dataset.synthetic(SAMPLES, 100, seed=seed))
    cfg = TrainConfig(hidden=hidden, batch=batch, epochs=1, lr=0.1, seed=seed, precision="bf16")
    monkeypatch.setattr(persistent_wide, "GRID_CHOICES", ((8, 1),))  # (both builds in one grid, every warp's sums held)
    runs = {}
    for variant in ("registers", "staged"):
        monkeypatch.setattr(persistent_wide, "DEFAULT_VARIANT", variant)
        runs[variant] = train_steps("persistent", cfg, data, STEPS)
        assert runs[variant][0].build == variant
    (_, plain_metrics, plain), (shape, metrics, staged) = runs["registers"], runs["staged"]
    assert shape.stage_depth >= 2 and shape.defines["SLOTS"] == runs["registers"][0].defines["SLOTS"]
    start, after, _, _ = reference_steps(cfg, data, STEPS)
    assert max(change_errors(staged, start, plain)) < ROUNDED_BOUND, f"seed {seed}"
    assert max(change_errors(staged, start, after)) < BOUND, f"seed {seed}"
    for i, (a, b) in enumerate(zip(staged, plain)):
        assert np.array_equal(a.w, b.w) and np.array_equal(a.b, b.b), f"seed {seed}: layer {i + 1} differs"
    assert metrics == plain_metrics, f"seed {seed}"


@pytest.mark.parametrize("hidden,batch", [((784,) * 3, 128), ((1024,) * 3, 128), ((512,) * 3, 32)])
@pytest.mark.parametrize("prefetch", [2, 3])
def test_loads_further_ahead_give_the_same_weights(monkeypatch, hidden, batch, prefetch, seed):
    """The registers build with `prefetch` k-steps of loads in flight against one, after three steps
    (at batch 128 the last a tail of 44 rows): the same fragments in the same order, the same bits."""
    data = eight_bit(Dataset.synthetic(SAMPLES, 100, seed=seed))
    cfg = TrainConfig(hidden=hidden, batch=batch, epochs=1, lr=0.1, seed=seed, precision="bf16")
    runs = {}
    for depth in (1, prefetch):
        monkeypatch.setattr(persistent_wide, "DEFAULT_PREFETCH", depth)
        runs[depth] = train_steps("persistent", cfg, data, STEPS)
        assert runs[depth][0].prefetch_depth == depth
    (_, one_metrics, one), (_, metrics, ahead) = runs[1], runs[prefetch]
    for i, (a, b) in enumerate(zip(ahead, one)):
        assert np.array_equal(a.w, b.w) and np.array_equal(a.b, b.b), f"seed {seed}: layer {i + 1} differs"
    assert metrics == one_metrics, f"seed {seed}"


def test_a_model_past_the_limit_is_refused_with_the_reason():
    """2048 units: 256 blocks of 8 units are more than the SMs, and a block of 16 units more than
    its shared memory; in fp32, which the grid kernel does not train, the cluster kernel's reason
    and its own."""
    data = Dataset.synthetic(200, 50, seed=1)
    with pytest.raises(UsageError, match=r"nor can its grid kernel: the 784-2048-2048-2048-10 MLP at batch 128 on a "
                                         r"grid: 256 blocks of 8 units, one per SM, .*a block of 16 units needs"):
        train_steps("persistent", TrainConfig(hidden=(2048,) * 3, batch=128, epochs=1), data, 1)
    with pytest.raises(UsageError, match=r"a block needs \d+ bytes of shared memory .*nor can its grid kernel: .*"
                                         r"in bf16 only"):
        train_steps("persistent", TrainConfig(hidden=(784,) * 3, batch=128, epochs=1, precision="fp32"), data, 1)
