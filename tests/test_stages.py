"""The rows' registry: the ladder's order, the peers after it, and each GPU rung built on the
one before it."""

import pytest

from graphtrain.config import TrainConfig
from graphtrain.data import Dataset
from graphtrain.errors import UsageError
from graphtrain.plan import RunPlan
from graphtrain.stages import CHAIN_END, LADDER, PEERS, get_stage, peer_names, row_names, stage_names
from graphtrain.stages.base import Stage
from graphtrain.stages.baseline import BaselineStage

DESIGN_ORDER = ["numpy", "baseline", "fewer-syncs", "cublas", "sparse-metrics", "cudnn-softmax", "graphs"]


def test_registry_is_in_ladder_order_then_the_peers():
    assert stage_names()[: len(DESIGN_ORDER)] == DESIGN_ORDER
    assert peer_names() == ["torch-eager", "torch-compile", "torch-graph", "jax-scan", "torch-graph-bf16", "jax-scan-bf16"]
    assert row_names() == stage_names() + peer_names()


def chain() -> list[str]:
    """The GPU rungs of the chain, baseline to CHAIN_END."""
    names = stage_names()
    return names[names.index("baseline"): names.index(CHAIN_END) + 1]


def test_every_rung_of_the_chain_extends_the_rung_before():
    """A rung is 'the one before it plus one idea': its class derives from the previous rung's."""
    for before, after in zip(chain(), chain()[1:]):
        assert issubclass(get_stage(after), get_stage(before)), (before, after)


def test_a_rung_past_the_chain_composes_instead_of_inheriting():
    """`persistent` (and every rung after the chain) holds no eager or graph rung in its MRO: it
    has the device pieces, and sets up nothing of the chain's."""
    names = stage_names()
    past = names[names.index(CHAIN_END) + 1:]
    assert "persistent" in past
    for name in past:
        cls = get_stage(name)
        assert cls.uses_gpu and not issubclass(cls, BaselineStage), [k.__name__ for k in cls.__mro__]
        assert [k for k in cls.__mro__ if k.__module__.startswith("graphtrain.stages.")] == [cls, Stage], cls.__mro__


def test_each_rung_of_the_chain_sets_up_only_what_its_steps_use():
    """The naive product kernel until cuBLAS replaces it, cuDNN only while its softmax runs,
    cuBLASLt only where hidden layers give it products."""
    uses = {name: get_stage(name).uses for name in chain()}
    assert [name for name in chain() if "matmul" in uses[name]] == ["baseline", "fewer-syncs"]
    assert [name for name in chain() if "cudnn" in uses[name]] == ["cudnn-softmax", "graphs"]
    assert [name for name in chain() if "softmax" in uses[name]] == chain()[:chain().index("fused")]
    assert all("cublas" in uses[name] for name in chain()[chain().index("cublas"):])  # the test-set forward
    data = Dataset.synthetic(100, 10)
    for hidden, lt in (((), False), ((32,), True)):
        plan = RunPlan.for_data(TrainConfig(batch=50, epochs=1, hidden=hidden), data)
        for name in chain()[chain().index("fused"):]:
            assert get_stage(name)(plan, data).needs("cublaslt") == lt, (name, hidden)


def test_the_step_kernels_know_nothing_of_the_device_loop():
    """The WHILE node's condition is set by device-loop's own node (kernels/loop.cu), so the fused
    step and its kernels take no loop handle."""
    import inspect

    from graphtrain.kernels import KERNELS_DIR
    from graphtrain.stages.fused import FusedStage

    assert "cudaGraphSetConditional" not in (KERNELS_DIR / "fused.cu").read_text(encoding="utf-8")
    assert "cudaGraphSetConditional" in (KERNELS_DIR / "loop.cu").read_text(encoding="utf-8")
    assert list(inspect.signature(FusedStage.train_step).parameters) == ["self", "offset", "rows", "measure"]


# The precision each rung trains each model in (its record's `precision`), by default and with
# --precision where the rung offers another. bf16 and device-loop train softmax regression in fp32:
# it has no hidden layer, and only the hidden layers' products read bf16 operands.
PRECISION_RUN = {
    "numpy": ("fp32", "fp32"), "baseline": ("fp32", "fp32"), "fewer-syncs": ("fp32", "fp32"),
    "cublas": ("fp32", "fp32"), "sparse-metrics": ("fp32", "fp32"), "cudnn-softmax": ("fp32", "fp32"),
    "graphs": ("fp32", "fp32"), "fused": ("fp32", "fp32"), "bf16": ("fp32", "bf16"),
    "device-loop": ("fp32", "bf16"), "persistent": ("bf16", "bf16"),
}
CHOSEN = {("cublas", "tf32"): "tf32", ("graphs", "tf32"): "tf32", ("persistent", "fp32"): "fp32"}


@pytest.mark.parametrize("name", stage_names())
@pytest.mark.parametrize("model", ["softmax-regression", "mlp"])
def test_each_rung_states_the_precision_its_path_trains_each_model_in(name, model):
    assert set(PRECISION_RUN) == set(stage_names()), "a new rung needs its row in PRECISION_RUN"
    data = Dataset.synthetic(100, 10)
    hidden = (32, 32) if model == "mlp" else ()
    plan = RunPlan.for_data(TrainConfig(batch=50, epochs=1, hidden=hidden), data)
    cls = get_stage(name)
    assert cls(plan, data).precision == PRECISION_RUN[name][model == "mlp"], (name, model)
    for (rung, chosen), ran in CHOSEN.items():
        if rung == name:
            plan = RunPlan.for_data(TrainConfig(batch=50, epochs=1, hidden=hidden, precision=chosen), data)
            assert cls(plan, data).precision == ran, (name, model, chosen)


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
