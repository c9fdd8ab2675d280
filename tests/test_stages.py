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


# Each rung of the chain past baseline: the part it swaps in over the rung below (field -> class
# name), the lesson its module's docstring tells. `graphs` swaps none: it adds methods.
LESSONS = {
    "fewer-syncs": {"metrics": "DeviceSumMetrics"},
    "cublas": {"products": "CublasProducts"},
    "sparse-metrics": {"metrics": "SparseFusedMetrics"},
    "cudnn-softmax": {"softmax": "CudnnSoftmax"},
    "graphs": {},
}
# What `graphs` adds to the step it replays: the cursor and the optimizer in the arena, the gather
# that reads the cursor, the recipe's update, the capture and the replay.
GRAPHS_ADDS = {"reserve_extra", "setup_extra", "upload_initial_weights", "update", "set_cursor", "load_batch",
               "train_step", "samples_per_step", "capture", "run_batches", "close"}


def test_every_rung_of_the_chain_is_the_rung_below_plus_one_part():
    """A rung is 'the one before it plus one idea': the same step (BaselineStage's, its direct
    base) with one part swapped, `parts = Below.parts.but(...)`, the part defined in the rung's
    own file and named in its docstring; nothing else in its class. `graphs` swaps no part and
    adds the methods that replay the step."""
    import sys

    from graphtrain.stages.chain_parts import Part

    assert set(LESSONS) == set(chain()[1:])
    for before, after in zip(chain(), chain()[1:]):
        below, cls = get_stage(before), get_stage(after)
        assert cls.__bases__ == (BaselineStage,), (after, cls.__bases__)
        changes = cls.parts.changes_from(below.parts)
        assert {field: part.__name__ for field, part in changes.items()} == LESSONS[after], (after, changes)
        module = sys.modules[cls.__module__]
        own_parts = {value for value in vars(module).values()
                     if isinstance(value, type) and issubclass(value, Part) and value.__module__ == module.__name__}
        assert own_parts == set(changes.values()), (after, own_parts)
        assert all(part.__name__ in module.__doc__ for part in own_parts), (after, module.__doc__)
        added = {name for name, value in vars(cls).items() if callable(value) and not isinstance(value, type)}
        assert added == (GRAPHS_ADDS if after == "graphs" else set()), (after, added)
        assert cls.uses == cls.parts.uses


def test_baselines_step_makes_its_parts_in_its_own_file():
    from graphtrain.stages.baseline import HostReadMetrics, KernelSoftmax, NaiveProducts

    assert BaselineStage.parts.by_field() == {"products": NaiveProducts, "softmax": KernelSoftmax,
                                              "metrics": HostReadMetrics}
    assert all(part.__module__ == BaselineStage.__module__ for part in BaselineStage.parts.by_field().values())


def stage_depth(cls: type) -> int:
    """How many classes below Stage `cls` sits: the Stage subclasses in its MRO, Stage not counted."""
    return sum(1 for klass in cls.__mro__ if issubclass(klass, Stage) and klass is not Stage)


def registered_classes():
    """Every class the registry names: each row's, per model kind, on one GPU and as one rank of
    `run --gpus` (the rank's class bound to a group, as it trains, included)."""
    from graphtrain import stages
    from graphtrain.config import MODELS
    from graphtrain.stages.data_parallel import Group

    for spec in stages.REGISTRY:
        for model in MODELS:
            for data_parallel in (False, True):
                trainer = spec.trainer(model, data_parallel)
                if isinstance(trainer, stages.Trainer):
                    cls = trainer.load()
                    yield f"{spec.name} {model}{' --gpus' if data_parallel else ''}", cls
                    if data_parallel:
                        yield f"{spec.name} {model} --gpus (a rank)", cls.for_group(Group(0, 2, bytes(128)))


def test_no_row_sits_more_than_four_classes_below_stage_and_the_chain_two():
    depths = {row: stage_depth(cls) for row, cls in registered_classes()}
    assert len(depths) >= 20 and "graphs mlp --gpus" in depths and "graphs cnn --gpus" in depths, depths
    assert all(depth <= 4 for depth in depths.values()), depths
    assert {name: depths[f"{name} mlp"] for name in chain()} == {name: 1 if name == "baseline" else 2
                                                                for name in chain()}
    assert depths["graphs mlp --gpus"] == 3, depths


def test_the_chain_ends_at_graphs():
    assert CHAIN_END == "graphs" and chain() == ["baseline", "fewer-syncs", "cublas", "sparse-metrics",
                                                 "cudnn-softmax", "graphs"]


def test_a_rung_past_the_chain_composes_instead_of_inheriting():
    """`fused`, `bf16`, `device-loop` and `persistent` hold no eager or graph rung of the chain in
    their MRO: they compose the device pieces and set up nothing of the chain's. `bf16` is `fused`
    at another precision (its only other class); the rungs that train the fused step's model share
    its restart (FusedRung) and derive from Stage otherwise, `persistent` from Stage alone."""
    from graphtrain.stages.fused_mlp import FusedRung

    names = stage_names()
    past = names[names.index(CHAIN_END) + 1:]
    assert past == ["fused", "bf16", "device-loop", "persistent"]
    chain_classes = {get_stage(name) for name in chain()}
    for name in past:
        cls = get_stage(name)
        assert cls.uses_gpu and not issubclass(cls, BaselineStage), [k.__name__ for k in cls.__mro__]
        assert not chain_classes & set(cls.__mro__), (name, cls.__mro__)
        ours = [k for k in cls.__mro__ if k.__module__.startswith("graphtrain.stages.")]
        between = {"fused": [FusedRung], "bf16": [get_stage("fused"), FusedRung], "device-loop": [FusedRung]}
        assert ours == [cls, *between.get(name, []), Stage], cls.__mro__


def test_bf16_is_fused_at_another_precision():
    """bf16 adds no method to `fused`: its precision (bf16 operands where there are hidden layers)
    is the fused model's parameter."""
    bf16 = get_stage("bf16")
    added = {name for name, value in vars(bf16).items() if callable(value) or isinstance(value, classmethod)}
    assert issubclass(bf16, get_stage("fused")) and added == {"precision_run"}, added


def test_each_rung_of_the_chain_sets_up_only_what_its_steps_use():
    """The naive product kernel until cuBLAS replaces it, cuDNN only while its softmax runs."""
    uses = {name: get_stage(name).uses for name in chain()}
    assert [name for name in chain() if "matmul" in uses[name]] == ["baseline", "fewer-syncs"]
    assert [name for name in chain() if "cudnn" in uses[name]] == ["cudnn-softmax", "graphs"]
    assert all("softmax" in uses[name] for name in chain())
    assert all("cublas" in uses[name] for name in chain()[chain().index("cublas"):])
    assert all(set(uses[name]) <= {"matmul", "softmax", "cublas", "cudnn"} for name in chain())


FUSED_MODELS = [((), "fp32"), ((32,), "fp32"), ((32, 16), "fp32"), ((32,), "bf16"), ((32, 16), "bf16")]


@pytest.mark.parametrize("hidden,precision", FUSED_MODELS)
@pytest.mark.parametrize("recipe", [("sgd", "constant"), ("adam", "one-cycle")])
@pytest.mark.parametrize("bias", [True, False])
def test_the_fused_model_reserves_only_what_its_step_touches(hidden, precision, recipe, bias):
    """No softmax's buffer (the head computes it), bf16 copies only with bf16 operands, the
    optimizer's state only for another recipe; its gradients laid out as the parameters are."""
    from graphtrain.libs.memory import Arena
    from graphtrain.stages.fused_mlp import FusedMlp

    data = Dataset.synthetic(100, 10)
    cfg = TrainConfig(batch=50, epochs=1, hidden=hidden, bias=bias, optimizer=recipe[0], schedule=recipe[1])
    arena = Arena()
    mlp = FusedMlp(arena, RunPlan.for_data(cfg, data), data, precision)
    names = set(arena.buffers)
    assert "probs" not in names
    copies = {"x16", "w16", "b16", *(f"h{i}_16" for i in range(1, len(hidden) + 1)),
              *(f"dh{i}_16" for i in range(1, len(hidden) + 1))}
    if not bias:
        copies.discard("b16")
    assert names & {n for n in names if n.endswith("16")} == (copies if precision == "bf16" else set())
    assert ({"opt_state", "opt_lr"} <= names) == (recipe != ("sgd", "constant"))
    params = [*mlp.params.w, *(b for b in mlp.params.b if b is not None)]
    grads = [*mlp.dw, *(db for db in mlp.db if db is not None)]
    assert [g.offset - grads[0].offset for g in grads] == [p.offset - params[0].offset for p in params]


@pytest.mark.parametrize("name", ["fused", "bf16", "device-loop"])
def test_a_fused_rung_refuses_a_batch_too_wide_for_its_head_before_any_gpu_work(name):
    """On this machine (no GPU needed) the refusal comes before the GPU is opened."""
    from graphtrain.errors import ModelUnsupported

    data = Dataset.synthetic(5000, 10)
    stage = get_stage(name)(RunPlan.for_data(TrainConfig(batch=4000, epochs=1), data), data)
    with pytest.raises(ModelUnsupported, match=rf"^the {name} rung cannot train batch 4000 of 10 classes .*; "
                                               r"use --stage graphs$"):
        stage.setup()


def test_bf16_operands_need_hidden_layers():
    from graphtrain.libs.memory import Arena
    from graphtrain.stages.fused_mlp import FusedMlp

    data = Dataset.synthetic(100, 10)
    with pytest.raises(ValueError, match="bf16 operands"):
        FusedMlp(Arena(), RunPlan.for_data(TrainConfig(batch=50, epochs=1), data), data, "bf16")


def test_the_step_kernels_know_nothing_of_the_device_loop():
    """The WHILE node's condition is set by device-loop's own node (kernels/loop.cu), so the fused
    step and its kernels take no loop handle: the step is handed the stream it queues on."""
    import inspect

    from graphtrain.kernels import KERNELS_DIR
    from graphtrain.stages.fused_mlp import FusedMlp

    assert "cudaGraphSetConditional" not in (KERNELS_DIR / "fused.cu").read_text(encoding="utf-8")
    assert "cudaGraphSetConditional" in (KERNELS_DIR / "loop.cu").read_text(encoding="utf-8")
    assert list(inspect.signature(FusedMlp.record_step).parameters) == ["self", "stream", "rows", "measure"]


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
