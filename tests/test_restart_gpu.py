"""Set up once, restarted per plan, on a GPU: the cnn's graphs and device-loop rows restarted with
another seed and learning rate train bit for bit what a fresh setup trains (no new capture); the
speedrun sets a row up once for its seeds; the peers' cnn classes train through the common trainer
and restart in place. Peers are skipped, with the reason, where their framework is missing."""

import numpy as np
import pytest

from graphtrain import training
from graphtrain.config import PRESETS
from graphtrain.data import Dataset
from graphtrain.plan import RunPlan
from graphtrain.stages import get_stage
from graphtrain.stages.cnn_rungs import flat_params
from test_peers_gpu import require

pytestmark = pytest.mark.gpu


def small_cnn(**changes):
    """The speedrun's recipe on a small cnn: 600 samples at batch 128 (a tail batch of 88)."""
    return PRESETS["speedrun"].replace(**{"conv": ((6, 5), (8, 3)), "hidden": (32,), "batch": 128, "epochs": 1,
                                          **changes})


@pytest.fixture(scope="module")
def data():
    return Dataset.synthetic(600, 300, seed=5)


def run(stage, plan):
    for epoch in range(plan.num_epochs):
        stage.train_epoch(epoch, plan.batches[epoch], False)
    return flat_params(stage.weights()), stage.test_accuracy()


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
@pytest.mark.parametrize("epochs", [1, 2])
@pytest.mark.parametrize("name", ["graphs", "device-loop"])
def test_a_restarted_cnn_row_trains_bit_for_bit_what_a_fresh_setup_trains(data, name, epochs, precision):
    """Set up for seed 0 at lr 0.01 and trained; restarted with seed 3 at lr 0.004: the weights and
    the accuracy are those of a row set up for seed 3 at lr 0.004 from scratch."""
    cls = get_stage(name, "cnn")
    first = RunPlan.for_data(small_cnn(epochs=epochs, precision=precision), data)
    second = RunPlan.for_data(small_cnn(epochs=epochs, precision=precision, seed=3, lr=0.004), data)
    with cls(first, data) as stage:
        stage.setup()
        run(stage, first)
        graphs = getattr(stage, "step_graph", None), dict(getattr(stage, "epoch_graphs", {}))
        assert stage.restart(second)
        assert (getattr(stage, "step_graph", None), dict(getattr(stage, "epoch_graphs", {}))) == graphs  # no new capture
        restarted, accuracy = run(stage, second)
    with cls(second, data) as alone:
        alone.setup()
        fresh, fresh_accuracy = run(alone, second)
    assert accuracy == fresh_accuracy, f"{name}, seed 3"
    for i, (got, want) in enumerate(zip(restarted, fresh)):
        assert np.array_equal(got, want), f"{name} parameter {i}, seed 3"


def test_a_restart_takes_another_optimizer_but_not_another_batch(data):
    """Every cnn keeps two optimizer state slots, so momentum restarts a row set up for Adam (its
    constants are device values); another batch is another capture: refused, the row unchanged."""
    cls = get_stage("graphs", "cnn")
    with cls(RunPlan.for_data(small_cnn(), data), data) as stage:
        stage.setup()
        assert not stage.restart(RunPlan.for_data(small_cnn(batch=64, seed=1), data))
        assert stage.plan.config.batch == 128
        assert stage.restart(RunPlan.for_data(small_cnn(optimizer="momentum", seed=1), data))
        assert stage.plan.config.optimizer == "momentum"


def test_the_speedrun_sets_the_graphs_row_up_once_for_its_seeds(mnist_dir):
    """Two seeds of the speedrun on `graphs`: one setup, and each seed's accuracy the one a fresh
    `run` of that seed reaches (bit-identical training)."""
    from graphtrain import data as data_mod, speedrun

    mnist = data_mod.load("mnist", data_dir=mnist_dir)
    config = PRESETS["speedrun"].replace(precision="tf32")
    case = speedrun.SpeedrunCase.of(config, mnist)
    result = speedrun.run_row("graphs", case, [0, 1])
    assert result.setups == 1 and len(result.times_ms) == 2 and min(result.accuracies) > 0.985, result
    assert result.setup_ms > 0 and all(ms > 0 for ms in result.times_ms)
    for seed, accuracy in zip([0, 1], result.accuracies):
        record = training.train(config.replace(seed=seed), "graphs", data=mnist)
        assert record.test_accuracy == accuracy, f"seed {seed}"


@pytest.mark.parametrize("name", ["torch-eager", "torch-compile", "torch-graph", "jax-scan"])
def test_a_peers_cnn_trains_through_run_and_restarts_in_place(name, mnist_dir):
    """`run --preset speedrun --stage <peer>` trains the cnn (one epoch of real MNIST to 98%), and a
    restart with another seed and learning rate trains what a fresh setup trains (fp32, where the
    frameworks' TF32 choices cannot differ; within float32 rounding, cuDNN's algorithm search may
    pick other kernels for another setup)."""
    require(name)
    from graphtrain import data as data_mod

    mnist = data_mod.load("mnist", data_dir=mnist_dir)
    record = training.train(PRESETS["speedrun"], name, data=mnist)
    assert record.stage == name and record.kind == "peer" and record.test_accuracy > 0.98, record.test_accuracy

    small = Dataset.synthetic(600, 300, seed=5)
    cls = get_stage(name, "cnn")
    first = RunPlan.for_data(small_cnn(precision="fp32"), small)
    second = RunPlan.for_data(small_cnn(precision="fp32", seed=3, lr=0.004), small)
    with cls(first, small) as stage:
        stage.setup()
        run(stage, first)
        assert stage.restart(second)
        restarted, _ = run(stage, second)
        assert not stage.restart(RunPlan.for_data(small_cnn(precision="fp32", batch=100), small))
    with cls(second, small) as alone:
        alone.setup()
        fresh, _ = run(alone, second)
    for i, (got, want) in enumerate(zip(restarted, fresh)):
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err < 1e-4, f"{name} parameter {i}, seed 3: {err}"
