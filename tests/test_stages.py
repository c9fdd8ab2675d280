"""The rows' registry: the ladder's order, the peers after it, and each GPU rung built on the
one before it."""

import pytest

from graphtrain.config import TrainConfig
from graphtrain.data import Dataset
from graphtrain.errors import UsageError
from graphtrain.plan import RunPlan
from graphtrain.stages import LADDER, PEERS, get_stage, peer_names, row_names, stage_names
from graphtrain.stages.base import Stage

DESIGN_ORDER = ["numpy", "baseline", "fewer-syncs", "cublas", "sparse-metrics", "cudnn-softmax", "graphs"]


def test_registry_is_in_ladder_order_then_the_peers():
    assert stage_names()[: len(DESIGN_ORDER)] == DESIGN_ORDER
    assert peer_names() == ["torch-eager", "torch-compile", "torch-graph", "jax-scan", "torch-graph-bf16", "jax-scan-bf16"]
    assert row_names() == stage_names() + peer_names()


def test_every_gpu_rung_extends_the_rung_before():
    """A rung is 'the one before it plus one idea': its class derives from the previous rung's."""
    gpu = [name for name in stage_names() if get_stage(name).uses_gpu]
    for before, after in zip(gpu, gpu[1:]):
        assert issubclass(get_stage(after), get_stage(before)), (before, after)


@pytest.mark.parametrize("name", list(LADDER) + list(PEERS))
def test_each_row_is_a_stage_that_names_itself_and_its_kind(name):
    """Importing a peer's module needs no framework: torch and jax load in setup."""
    cls = get_stage(name)
    assert issubclass(cls, Stage) and cls.name == name and cls.summary
    assert cls.kind == ("peer" if name in PEERS else "stage")


def test_sparse_metrics_from_its_rung_on():
    """The rung decides whether it measures an epoch; the plan holds the schedule."""
    data = Dataset.synthetic(100, 10)
    plan = RunPlan.for_data(TrainConfig(batch=50, epochs=12, metrics_every=5), data)
    measured = {name: [e for e in range(12) if get_stage(name)(plan, data).measures(e)]
                for name in DESIGN_ORDER}
    every, sparse = list(range(12)), [4, 9, 11]
    assert measured == {name: every if i < 4 else sparse for i, name in enumerate(DESIGN_ORDER)}


def test_unknown_stage_lists_the_choices():
    with pytest.raises(UsageError, match="graphs"):
        get_stage("warp-drive")
