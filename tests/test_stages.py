"""The ladder's shape: registry order, and each GPU rung built on the one before it."""

import pytest

from graphtrain.errors import UsageError
from graphtrain.stages import LADDER, get_stage, stage_names
from graphtrain.stages.base import Stage

DESIGN_ORDER = ["numpy", "baseline", "fewer-syncs", "cublas", "sparse-metrics", "cudnn-softmax", "graphs"]


def test_registry_is_in_ladder_order():
    assert stage_names()[: len(DESIGN_ORDER)] == DESIGN_ORDER


def test_every_gpu_rung_extends_the_rung_before():
    """A rung is 'the one before it plus one idea': its class derives from the previous rung's."""
    gpu = [name for name in stage_names() if get_stage(name).uses_gpu]
    for before, after in zip(gpu, gpu[1:]):
        assert issubclass(get_stage(after), get_stage(before)), (before, after)


@pytest.mark.parametrize("name", list(LADDER))
def test_each_stage_names_itself_and_says_what_it_adds(name):
    cls = get_stage(name)
    assert issubclass(cls, Stage) and cls.name == name and cls.summary


def test_sparse_metrics_from_its_rung_on():
    flags = [get_stage(name).sparse_metrics for name in DESIGN_ORDER]
    assert flags == [False, False, False, False, True, True, True]


def test_unknown_stage_lists_the_choices():
    with pytest.raises(UsageError, match="graphs"):
        get_stage("warp-drive")
