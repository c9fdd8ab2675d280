"""The rows graphtrain trains, in one registry: the ladder's rungs in order, then the framework
peers, and for each what varies from row to row.

A row is a rung (graphtrain.stages) or a peer (graphtrain.peers). For each model kind (the MLP,
the cnn) it names the `Stage` class that trains it (a `Trainer`: the class, the precisions it
trains in, whether it trains the recipe) or the reason it cannot (a `Refused`); likewise the
class that trains it data-parallel (`run --gpus`), how it packs models in the sweep, and whether
`graphtrain speedrun` times it by default (its rows are the rows whose classes train the speedrun
preset's model). Every list of rows and every refusal is derived from `REGISTRY`: a new rung is
one file in this package plus one entry here, a peer one module in graphtrain/peers/ plus one
entry. This module is plain data: classes are imported only when their row is used, so the
CLI's start and the CPU stage need no numpy import from here, no CUDA, torch or jax.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from graphtrain.config import MODELS, PRESETS  # the model kinds; the speedrun's preset
from graphtrain.errors import ModelUnsupported, UsageError


# Where the recipe (--optimizer, --schedule) trains, said at the end of a refusal.
RECIPE_ROWS = "the recipe trains on numpy and on graphs through device-loop"


@dataclass(frozen=True)
class Refused:
    """Why a row cannot do something (said in the refusal, before any work)."""

    why: str


@dataclass(frozen=True)
class Trainer:
    """The class that trains one model kind on a row, and what it trains."""

    target: str  # "module:Class", a graphtrain.stages.base.Stage
    # The products' operand precisions it trains in, its own first (fp32 accumulation always).
    precisions: tuple[str, ...] = ("fp32",)
    # None: it trains every recipe (optimizer and schedule, config.lr the peak); else why it
    # trains SGD at a constant rate only, and where the recipe trains.
    recipe_refusal: str | None = RECIPE_ROWS
    # The optimizers it trains (graphtrain.config.OPTIMIZERS), where not every one: checked with
    # the recipe, before any data is read.
    optimizers: tuple[str, ...] | None = None

    @property
    def trains_recipes(self) -> bool:
        return self.recipe_refusal is None

    def load(self) -> type:
        module_name, class_name = self.target.split(":")
        return getattr(importlib.import_module(module_name), class_name)


@dataclass(frozen=True)
class Pack:
    """How the sweep trains a row's models of one kind together on one GPU (lr and seed
    differing); a row's MLPs and its cnns each have their own (RowSpec.pack, RowSpec.pack_cnn)."""

    target: str  # "module:function", plans and data -> a record per plan
    softmax_only: bool = False  # of the MLPs, only those without hidden layers pack
    only: bool = False  # the row exists only as packs (not a row `run` or `ladder` trains)
    check: str | None = None  # "module:function" raising PeerUnavailable where it cannot run
    mode: str | None = None  # the target's `mode=` (how it packs), where it has several


@dataclass(frozen=True)
class RowSpec:
    """One row: a rung or a peer, and what it trains, model kind by model kind."""

    name: str
    kind: str  # "stage" (a rung) or "peer"
    uses_gpu: bool
    mlp: Trainer | Refused
    cnn: Trainer | Refused
    # `run --gpus`: the class per model kind, or why not.
    data_parallel_mlp: Trainer | Refused
    data_parallel_cnn: Trainer | Refused
    pack: Pack | None = None  # how the sweep packs its MLPs; None: every model runs alone
    pack_cnn: Pack | None = None  # how the sweep packs its cnns; None: every model runs alone
    speedrun_default: bool = False  # timed by `graphtrain speedrun` unless rows are named

    def trainer(self, model: str, data_parallel: bool = False) -> Trainer | Refused:
        if model not in MODELS:
            raise ValueError(f"unknown model kind {model!r}")
        if data_parallel:
            return {"mlp": self.data_parallel_mlp, "cnn": self.data_parallel_cnn}[model]
        return {"mlp": self.mlp, "cnn": self.cnn}[model]

    def pack_for(self, config) -> Pack | None:
        """How the sweep packs `config`'s model on this row, or None where it runs alone."""
        pack = self.pack_cnn if config.model == "cnn" else self.pack
        if pack is None or (pack.softmax_only and config.hidden):
            return None
        return pack


# ---- the reasons, each said once -----------------------------------------------------------

SEED_RECIPE = ("the first GPU rungs teach one idea each on plain SGD; the recipe trains on numpy and on "
               "graphs through device-loop")
NO_STEP_GRAPH = Refused("it replays no step graph to put the all-reduce in")
FUSED_SGD = Refused("it fuses SGD into the weight-gradient product, so there is no gradient to all-reduce")
PEER_NOT_DATA_PARALLEL = Refused("it is a framework peer, not a graphtrain rung")
MLP_ONLY = Refused("trains MLPs only")


def _seed_rung(name: str, module_class: str, precisions: tuple[str, ...] = ("fp32",)) -> RowSpec:
    """A first GPU rung: one idea each, MLPs on SGD at a constant rate, one GPU."""
    return RowSpec(name, "stage", True, Trainer(module_class, precisions, SEED_RECIPE), MLP_ONLY,
                   NO_STEP_GRAPH, NO_STEP_GRAPH)


# The cnn's products: tf32 puts the fused conv layers on the tensor cores (convpool_tc.cu) and the
# hidden linear layers' and cuDNN's products on TF32; fp32 keeps every product fp32. The peers' cnn
# classes take the same two (the frameworks' TF32 flags).
CNN_TRAINS = ("tf32", "fp32")


def _peer(name: str, module_class: str, precisions: tuple[str, ...] = ("fp32",), cnn: str | None = None,
          speedrun_default: bool = False) -> RowSpec:
    """A framework peer: the MLP's class, and the cnn's (`cnn`, "module:Class") where it has one,
    which trains the speedrun's recipe: Adam or AdamW, any schedule."""
    cnn_trainer = MLP_ONLY if cnn is None else Trainer(cnn, CNN_TRAINS, None, optimizers=("adam", "adamw"))
    return RowSpec(name, "peer", True, Trainer(module_class, precisions), cnn_trainer, PEER_NOT_DATA_PARALLEL,
                   PEER_NOT_DATA_PARALLEL, speedrun_default=speedrun_default)
WHOLE_EPOCH = Refused("it runs a whole epoch per graph launch, with no step boundary for the all-reduce")
ONE_KERNEL = Refused("it runs a whole epoch in one kernel, with no step boundary for the all-reduce")
SWEEP_PACKS_ONLY = Refused("it trains the sweep's packs only")

# The sweep's own peer packs the MLPs and the cnns alike: one vmapped JAX program.
JAX_VMAP = Pack("graphtrain.peers.jax_vmap:train_vmapped", only=True, check="graphtrain.peers.jax_scan:import_jax")

REGISTRY: tuple[RowSpec, ...] = (
    # the rungs, in ladder order
    RowSpec("numpy", "stage", False,
            Trainer("graphtrain.stages.numpy_cpu:NumpyStage", recipe_refusal=None),
            Trainer("graphtrain.stages.cnn_rungs:CnnNumpyStage", recipe_refusal=None),
            Refused("it trains on the CPU"), Refused("it trains on the CPU")),
    _seed_rung("baseline", "graphtrain.stages.baseline:BaselineStage"),
    _seed_rung("fewer-syncs", "graphtrain.stages.fewer_syncs:FewerSyncsStage"),
    # cuBLAS's math mode; the fused rungs leave cuBLAS, and tf32, behind
    _seed_rung("cublas", "graphtrain.stages.cublas_gemm:CublasStage", ("fp32", "tf32")),
    _seed_rung("sparse-metrics", "graphtrain.stages.sparse_metrics:SparseMetricsStage", ("fp32", "tf32")),
    _seed_rung("cudnn-softmax", "graphtrain.stages.cudnn_softmax:CudnnSoftmaxStage", ("fp32", "tf32")),
    RowSpec("graphs", "stage", True,
            Trainer("graphtrain.stages.graphs:GraphsStage", ("fp32", "tf32"), None),
            Trainer("graphtrain.stages.cnn_rungs:CnnGraphsStage", CNN_TRAINS, None),
            # its SGD takes the all-reduced sum with lr/N; the optimizer kernel takes a mean
            Trainer("graphtrain.stages.data_parallel:DataParallelGraphsStage", ("fp32", "tf32"),
                    "with --gpus, where SGD takes the all-reduced gradient sum at lr/N; train the recipe on one GPU"),
            Trainer("graphtrain.stages.data_parallel:DataParallelCnnGraphsStage", CNN_TRAINS, None),
            pack_cnn=Pack("graphtrain.stages.cnn_pack:pack_graphs", mode="axis"), speedrun_default=True),
    RowSpec("fused", "stage", True, Trainer("graphtrain.stages.fused:FusedStage", ("fp32",), None), MLP_ONLY,
            FUSED_SGD, FUSED_SGD),
    RowSpec("bf16", "stage", True, Trainer("graphtrain.stages.bf16:Bf16Stage", ("bf16",), None), MLP_ONLY,
            FUSED_SGD, FUSED_SGD),
    RowSpec("device-loop", "stage", True,
            Trainer("graphtrain.stages.device_loop:DeviceLoopStage", ("bf16",), None),
            Trainer("graphtrain.stages.cnn_rungs:CnnDeviceLoopStage", CNN_TRAINS, None),
            WHOLE_EPOCH,
            # a step boundary exists, inside the epoch's WHILE node (graphtrain.stages.data_parallel)
            Refused("the cnn's epoch is one conditional WHILE node, and an all-reduce captured inside its body "
                    "is not supported here"),
            pack_cnn=Pack("graphtrain.stages.cnn_pack:pack_device_loop", mode="axis"), speedrun_default=True),
    RowSpec("persistent", "stage", True,
            Trainer("graphtrain.stages.persistent:PersistentStage", ("bf16", "fp32"),
                    "its one kernel applies SGD at a constant rate inside the epoch it trains; the recipe trains "
                    "on numpy and on graphs through device-loop"),
            Trainer("graphtrain.stages.cnn_persistent:CnnPersistentStage", CNN_TRAINS, None),
            ONE_KERNEL, ONE_KERNEL,
            pack=Pack("graphtrain.packed:train_packed", softmax_only=True)),
    # the peers: the same workload trained by frameworks, in the order the ladder runs them
    _peer("torch-eager", "graphtrain.peers.torch_eager:TorchEagerPeer",
          cnn="graphtrain.peers.torch_cnn:TorchEagerCnnPeer"),
    _peer("torch-compile", "graphtrain.peers.torch_compile:TorchCompilePeer", ("bf16",),
          cnn="graphtrain.peers.torch_cnn:TorchCompileCnnPeer"),
    _peer("torch-graph", "graphtrain.peers.torch_graph:TorchGraphPeer",
          cnn="graphtrain.peers.torch_cnn:TorchGraphCnnPeer", speedrun_default=True),
    _peer("jax-scan", "graphtrain.peers.jax_scan:JaxScanPeer",
          cnn="graphtrain.peers.jax_cnn:JaxScanCnnPeer", speedrun_default=True),
    _peer("torch-graph-bf16", "graphtrain.peers.torch_graph:TorchGraphBf16Peer", ("bf16",)),
    _peer("jax-scan-bf16", "graphtrain.peers.jax_scan:JaxScanBf16Peer", ("bf16",)),
    # the sweep's own peer: its models (MLPs or cnns) vmapped into one JAX program
    RowSpec("jax-vmap", "peer", True, SWEEP_PACKS_ONLY, SWEEP_PACKS_ONLY,
            PEER_NOT_DATA_PARALLEL, PEER_NOT_DATA_PARALLEL,
            pack=JAX_VMAP, pack_cnn=JAX_VMAP),
)

SPECS: dict[str, RowSpec] = {spec.name: spec for spec in REGISTRY}

# The rows `run` and `ladder` train (the sweep's packed-only peer aside).
ROWS: dict[str, RowSpec] = {spec.name: spec for spec in REGISTRY if not (spec.pack and spec.pack.only)}
LADDER: tuple[str, ...] = tuple(name for name, spec in ROWS.items() if spec.kind == "stage")
PEERS: tuple[str, ...] = tuple(name for name, spec in ROWS.items() if spec.kind == "peer")
PACKED_PEERS: tuple[str, ...] = tuple(spec.name for spec in REGISTRY if spec.pack and spec.pack.only)

# The ladder's chain runs from `baseline` to CHAIN_END, each rung the one before with one part of
# the step swapped (graphtrain.stages.chain_parts; at CHAIN_END, the replay added), the diff over
# it its lesson; the rungs after it are their own programs, composing the device pieces
# (graphtrain.stages.device) with their own kernels instead of inheriting a rung's setup: `fused`,
# `bf16` (fused at another precision) and `device-loop` the fused step's model
# (graphtrain.stages.fused_mlp), `persistent` its one kernel.
CHAIN_END = "graphs"


def stage_names() -> list[str]:
    """The rungs, in ladder order."""
    return list(LADDER)


def peer_names() -> list[str]:
    return list(PEERS)


def row_names() -> list[str]:
    """Every row `run` trains: the rungs, then the peers."""
    return list(ROWS)


def spoken(names: list[str]) -> str:
    """['a', 'b', 'c'] -> 'a, b and c'."""
    return " and ".join(filter(None, [", ".join(names[:-1]), *names[-1:]]))


def spec_of(name: str) -> RowSpec:
    """Row `name`'s entry, a UsageError naming the rows where there is none."""
    try:
        return ROWS[name]
    except KeyError:
        raise UsageError(f"unknown stage {name!r}; choose one of {', '.join(ROWS)}") from None


def models_on(model: str) -> list[str]:
    """The rows that train `model` on one GPU (or the CPU)."""
    return [name for name, spec in ROWS.items() if isinstance(spec.trainer(model), Trainer)]


def trainer_of(name: str, model: str = "mlp") -> Trainer:
    """The trainer of `model` on row `name`, else a UsageError saying why not and where it trains."""
    found = spec_of(name).trainer(model)
    if isinstance(found, Refused):
        raise UsageError(f"{name} {found.why}; the {model} trains on {', '.join(models_on(model))}")
    return found


def data_parallel_rungs() -> list[str]:
    return [name for name, spec in ROWS.items()
            if any(isinstance(spec.trainer(model, data_parallel=True), Trainer) for model in MODELS)]


DATA_PARALLEL_RUNGS: tuple[str, ...] = tuple(data_parallel_rungs())


def data_parallel_refusal(name: str, model: str) -> str | None:
    """Why `run --stage name --gpus N` cannot train `model`, or None."""
    if model not in MODELS:
        return f"--gpus trains the {' and '.join(MODELS)} models, not {model}"
    found = spec_of(name).trainer(model, data_parallel=True)
    if isinstance(found, Refused):
        return (f"--gpus trains data-parallel on the {' and '.join(DATA_PARALLEL_RUNGS)} rung only; "
                f"{name} cannot: {found.why}")
    return None


def data_parallel_trainer(name: str, model: str) -> Trainer:
    why = data_parallel_refusal(name, model)
    if why is not None:
        raise UsageError(why)
    return spec_of(name).trainer(model, data_parallel=True)


def get_stage(name: str, model: str = "mlp", data_parallel: bool = False):
    """The `Stage` class of row `name` (a rung or a peer) that trains `model` (one GPU, or one
    rank of `run --gpus`); a UsageError saying why where there is none."""
    trainer = data_parallel_trainer(name, model) if data_parallel else trainer_of(name, model)
    return trainer.load()


def check_names(stages: list[str], peers: list[str]) -> None:
    """Reject unknown rungs and peers, and an empty selection, before anything runs."""
    problems = []
    unknown_stages = [s for s in stages if s not in LADDER]
    unknown_peers = [p for p in peers if p not in PEERS]
    if unknown_stages:
        problems.append(f"unknown stage(s) {', '.join(unknown_stages)}; choose from {', '.join(LADDER)}")
    if unknown_peers:
        problems.append(f"unknown peer(s) {', '.join(unknown_peers)}; choose from {', '.join(PEERS)}")
    if not stages and not peers:
        problems.append("no stages and no peers to run")
    if problems:
        raise UsageError("; ".join(problems))


# ---- the speedrun's rows -------------------------------------------------------------------


def speedrun_names(kind: str | None = None) -> list[str]:
    """The rows the speedrun times (of `kind`, "stage" or "peer"): every row with a class that
    trains the speedrun preset's model, the rungs fastest first (the ladder's reverse), then the peers."""
    model = PRESETS["speedrun"].model
    rows = [spec for spec in ROWS.values()
            if isinstance(spec.trainer(model), Trainer) and kind in (None, spec.kind)]
    rungs = [spec.name for spec in reversed(rows) if spec.kind == "stage"]
    return rungs + [spec.name for spec in rows if spec.kind == "peer"]


def speedrun_defaults(kind: str) -> list[str]:
    return [name for name in speedrun_names(kind) if SPECS[name].speedrun_default]


def load_target(target: str):
    """The object a "module:name" target names."""
    module_name, attribute = target.split(":")
    return getattr(importlib.import_module(module_name), attribute)


# ---- a row's precisions and recipe, as its Stage class checks them --------------------------


def check_precision(name: str, precisions: tuple[str, ...], precision: str | None) -> str:
    """The precision picked from `precisions` when asked for `precision` (None: the row's own);
    a UsageError where it cannot (checked by `run` before any data is read)."""
    if precision is not None and precision not in precisions:
        raise UsageError(f"{name} trains in {' or '.join(precisions)}, not --precision {precision}")
    return precision or precisions[0]


def check_recipe(name: str, recipe_refusal: str | None, config, optimizers: tuple[str, ...] | None = None) -> None:
    """A ModelUnsupported saying why, where a row that trains SGD at a constant rate only
    (`recipe_refusal` not None: why) is asked for `config`'s recipe, or a row that trains some
    optimizers only (`optimizers`) for another."""
    if optimizers is not None and config.optimizer not in optimizers:
        raise ModelUnsupported(f"{name} trains the {config.model} with {' or '.join(optimizers)}, not --optimizer "
                               f"{config.optimizer}; {RECIPE_ROWS}")
    if recipe_refusal is None or (config.optimizer, config.schedule) == ("sgd", "constant"):
        return
    raise ModelUnsupported(f"{name} trains with SGD at a constant rate, not --optimizer {config.optimizer} "
                           f"--schedule {config.schedule}; {recipe_refusal}")


def find_trainer(name: str, model: str, data_parallel: bool) -> Trainer | None:
    """The registry's trainer of a Stage class named `name` (None for a class the registry does
    not list: a test's stand-in)."""
    spec = SPECS.get(name)
    found = spec.trainer(model, data_parallel) if spec is not None else None
    return found if isinstance(found, Trainer) else None
