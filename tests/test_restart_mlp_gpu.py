"""Set up once, restarted per plan, on a GPU: the MLP rows (fused, bf16, device-loop, persistent)
restarted with another seed, rate and (where the row's step was built for an optimizer) optimizer
and schedule train bit for bit what a fresh setup of that plan trains; their graphs are kept where
they hold nothing of what changed. The sweep restarts a device-loop row for each next point."""

import numpy as np
import pytest

from graphtrain import sweep, training
from graphtrain.config import TrainConfig
from graphtrain.data import Dataset
from graphtrain.plan import RunPlan
from graphtrain.stages import get_stage
from graphtrain.stages.cnn_rungs import flat_params

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def data():
    return Dataset.synthetic(1000, 300, seed=5)  # batch 64: 15 full batches and a tail of 40


def small_mlp(**changes) -> TrainConfig:
    return TrainConfig(hidden=(64, 32), batch=64, epochs=2, lr=0.05, seed=0).replace(**changes)


def run(stage, plan):
    """The plan's epochs (measured where the row measures: the metrics' sums are part of a run),
    then its weights and test accuracy."""
    for epoch in range(plan.num_epochs):
        stage.train_epoch(epoch, plan.batches[epoch], stage.measures(epoch))
    return flat_params(stage.weights()), stage.test_accuracy()


def graphs_of(stage) -> dict:
    return dict(getattr(stage, "epoch_graphs", None) or stage.graphs)


def restarted_and_fresh(name, first_config, second_config, data, graphs_kept: bool):
    """Row `name` set up for the first config and trained, restarted with the second and trained
    (its graphs kept or captured again, as `graphs_kept` says); then a fresh row of the second.
    (restarted weights and accuracy, fresh weights and accuracy)."""
    cls = get_stage(name)
    first, second = RunPlan.for_data(first_config, data), RunPlan.for_data(second_config, data)
    with cls(first, data) as stage:
        stage.setup()
        run(stage, first)
        graphs = graphs_of(stage) if hasattr(stage, "captured_for") else None
        assert stage.restart(second)
        if graphs is not None:
            assert (graphs_of(stage) == graphs) == graphs_kept, name
        restarted = run(stage, second)
    with cls(second, data) as alone:
        alone.setup()
        fresh = run(alone, second)
    return restarted, fresh


def assert_same_bits(restarted, fresh, what: str) -> None:
    (got, accuracy), (want, fresh_accuracy) = restarted, fresh
    assert accuracy == fresh_accuracy, what
    for i, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(g, w), f"{what}: parameter {i}, max |diff| {np.max(np.abs(g - w))}"


@pytest.mark.parametrize("name", ["fused", "bf16", "device-loop"])
def test_a_restarted_fused_sgd_row_trains_what_a_fresh_setup_trains(data, name):
    """Fused SGD at lr 0.05, seed 0, then lr 0.1, seed 1: the graphs hold the rate, so they are
    captured again, and the weights are a fresh row's bit for bit."""
    restarted, fresh = restarted_and_fresh(name, small_mlp(), small_mlp(seed=1, lr=0.1), data, graphs_kept=False)
    assert_same_bits(restarted, fresh, f"{name}, sgd lr 0.1 seed 1")


@pytest.mark.parametrize("name", ["fused", "bf16", "device-loop"])
def test_a_restarted_optimizer_row_takes_another_optimizer_in_its_graphs(data, name):
    """Adam at lr 0.05, seed 0, then momentum with a cosine schedule at lr 0.1, seed 1: the
    recipe is device values, the graphs are kept, and the weights are a fresh row's bit for bit."""
    restarted, fresh = restarted_and_fresh(
        name, small_mlp(optimizer="adam"), small_mlp(optimizer="momentum", schedule="cosine", seed=1, lr=0.1), data,
        graphs_kept=True)
    assert_same_bits(restarted, fresh, f"{name}, momentum cosine lr 0.1 seed 1")


@pytest.mark.parametrize("hidden, features, batch", [((), 784, 128), ((64, 64), 50, 32)], ids=["softmax", "mlp"])
def test_a_restarted_persistent_row_trains_what_a_fresh_setup_trains(hidden, features, batch):
    """The rate is a launch argument: lr 0.05, seed 0, then lr 0.1, seed 1, on the compiled
    kernel and the converted images; a tail batch each epoch."""
    data = Dataset.synthetic(700 if not hidden else 300, 200, seed=2, num_features=features)
    config = TrainConfig(hidden=hidden, batch=batch, epochs=2, lr=0.05, seed=0, in_features=features)
    restarted, fresh = restarted_and_fresh("persistent", config, config.replace(seed=1, lr=0.1), data,
                                           graphs_kept=True)
    assert_same_bits(restarted, fresh, f"persistent {hidden}, lr 0.1 seed 1")


def test_the_sweep_restarts_its_device_loop_row_for_every_next_point(data):
    """Two rates × two seeds on device-loop: one setup, three restarts (one of them captures again
    for the new rate), every model's weights those of its run alone."""
    points = sweep.expand_grid(small_mlp(), ["device-loop"], [], lrs=[0.05, 0.1], seeds=[0, 1])
    rows, summary = sweep.run_sweep(points, sweep.InProcess(), sweep.DataSource("synthetic"), data=data)
    assert [row["restarted"] for row in rows] == [False, True, True, True] and summary["restarted"] == 3
    for row, point in zip(rows, points):
        alone = training.train(point.config, "device-loop", data=data)
        assert row["weights_sha256"] == sweep.weights_digest(alone.params), point
