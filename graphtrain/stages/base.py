"""The interface every row implements, rung and peer alike; the runners (graphtrain.training,
ladder, sweep, speedrun) drive it.

A row is handed the run plan (initial weights, sample orders, batch bounds, the metrics
schedule) and the dataset. It owns the model's state wherever it lives (host arrays, a device
arena, framework tensors) and runs epochs over the plan's sample order. It times its own epochs,
because only it knows the right clock: CUDA events on the GPU, perf_counter on the CPU.

    row = cls(plan, data); row.setup()          compile, allocate, upload, warm up, capture
    row.train_epoch(e, batches, measure) …      the plan's epochs
    row.test_accuracy(); row.weights()
    row.restart(next_plan)                      the same shape again, another seed or recipe:
                                                True where it took the plan in place

A process that trains many models of one shape (a sweep's grid, the speedrun's seeds) sets a row
up once and restarts it for each next plan: a restart puts the plan's initial weights, sample
orders and recipe (its learning rate, schedule and optimizer constants) on what setup built and
keeps the rest (compiled kernels, the uploaded data, library handles, captured graphs). Where a
row cannot (it was built for another shape, or holds the recipe where it cannot be rewritten),
restart returns False and the runner sets up a fresh one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from graphtrain.config import TrainConfig
from graphtrain.data import Dataset
from graphtrain import stages
from graphtrain.plan import RunPlan
from graphtrain.reference import Layer

# A restart may change these of a run's config and nothing else: the seed (initial weights and
# sample orders) and the recipe's values. Each is set here to one value, so that two configs that
# differ in them only are equal (`shape_of`).
RESTART_NEUTRAL = dict(seed=0, lr=1.0, optimizer="sgd", momentum=0.9, betas=(0.9, 0.999), weight_decay=0.0,
                       schedule="constant", warmup=0)


def shape_of(config: TrainConfig) -> TrainConfig:
    """`config` with the seed and the recipe's values set aside (RESTART_NEUTRAL): what a set-up
    row is built for, the model, batch, length and dataset. The precision is compared as the row
    resolves it (`Stage.same_shape`)."""
    return dataclasses.replace(config, precision=None, **RESTART_NEUTRAL)


@dataclass
class EpochResult:
    ms: float
    train_loss: float | None = None  # mean over the epoch's samples, when measured
    train_accuracy: float | None = None


class Stage:
    name: ClassVar[str]
    summary: ClassVar[str]  # what this rung adds to the one before it
    model_kind: ClassVar[str] = "mlp"  # the model it trains (graphtrain.config.MODELS)
    data_parallel: ClassVar[bool] = False  # whether it trains as one rank of `run --gpus`
    note: ClassVar[str] = ""  # what sets a run apart (precision, compile mode), shown in reports
    # What varies per row is the registry's (graphtrain.stages.REGISTRY), filled in below for the
    # class it names (by name, model kind and data_parallel):
    uses_gpu: ClassVar[bool] = False
    kind: ClassVar[str] = "stage"  # "peer" for the framework peers
    # The products' operand precisions this row can train in, its own first (fp32 accumulation
    # always); `config.precision` picks one, and `self.precision` is the one it trains in
    # (`precision_run`), what its record states.
    precisions: ClassVar[tuple[str, ...]] = ("fp32",)
    # None where this row trains every recipe (`config.optimizer` and `config.schedule`, with
    # `config.lr` the peak); else why it trains SGD at a constant rate only, and where the recipe trains.
    recipe_refusal: ClassVar[str | None] = stages.RECIPE_ROWS
    # The optimizers it trains where not every one (None: every one), checked with the recipe.
    optimizers: ClassVar[tuple[str, ...] | None] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        trainer = stages.find_trainer(getattr(cls, "name", None), cls.model_kind, cls.data_parallel)
        if trainer is None or trainer.target != f"{cls.__module__}:{cls.__qualname__}":
            return  # not the registry's class: it inherits them (a rank's class, a test's stand-in)
        spec = stages.SPECS[cls.name]
        cls.uses_gpu, cls.kind, cls.precisions = spec.uses_gpu, spec.kind, trainer.precisions
        cls.recipe_refusal, cls.optimizers = trainer.recipe_refusal, trainer.optimizers

    def __init__(self, plan: RunPlan, data: Dataset):
        self.plan = plan
        self.config = plan.config
        self.data = data
        self.precision = self.precision_run(self.config, self.check_precision(self.config.precision))

    @classmethod
    def check_precision(cls, precision: str | None) -> str:
        """The precision picked from `precisions` when asked for `precision` (None: the row's
        own); a UsageError where it cannot (checked by `run` before any data is read)."""
        return stages.check_precision(cls.name, cls.precisions, precision)

    @classmethod
    def check_recipe(cls, config) -> None:
        """A ModelUnsupported saying why, where this row cannot train `config`'s recipe (checked
        before any data is read)."""
        stages.check_recipe(cls.name, cls.recipe_refusal, config, cls.optimizers)

    @classmethod
    def precision_run(cls, config, chosen: str) -> str:
        """The precision this row's code path trains `config`'s model in, `chosen` being the one
        picked from `precisions`: the same unless the path for this model has no product in it
        (a rung overrides this beside the code that decides)."""
        return chosen

    @classmethod
    def check_available(cls) -> int | None:
        """Check, cheaply and before any data is read, that this row can run here.

        Raises GpuUnavailableError (a peer: PeerUnavailable) saying what is missing. A row that
        trains on a GPU returns the GPU's memory in bytes (None when it cannot tell), so the
        trainer can reject a model too large for it before setup.
        """
        if not cls.uses_gpu:
            return None
        from graphtrain.libs import cuda

        return cuda.open_device().total_memory

    @classmethod
    def first_uses(cls) -> list:
        """Once-a-process work of the libraries this row's setup calls (callables), which
        `graphtrain run` may begin beside the data loading; none here."""
        return []

    def measures(self, epoch: int) -> bool:
        """Whether `epoch` (0-based) measures train loss and accuracy: every epoch, unless a
        rung trades that for speed (sparse-metrics and the rungs after it)."""
        return True

    def setup(self) -> None:
        """Everything before the first timed epoch: compile, allocate, upload, warm up, capture."""

    def restart(self, plan: RunPlan) -> bool:
        """Put `plan`, a run of the same shape (`same_shape`: another seed, learning rate,
        schedule or optimizer constants), on this set-up row in place: its initial weights,
        sample orders and recipe, the optimizer's state and the step count from zero, as a
        fresh setup for `plan` would leave the row. True where it did; False where this row
        cannot (then it is left as it was, and the runner sets up a fresh one). None can here."""
        return False

    @classmethod
    def restarts(cls) -> bool:
        """Whether this row can take a new plan in place at all (it overrides `restart`): a
        runner keeps a set-up row of this class for the next plan only then."""
        return cls.restart is not Stage.restart

    def same_shape(self, plan: RunPlan) -> bool:
        """Whether `plan` trains what this row was set up for but for the seed and the recipe's
        values: the same model, batch, epochs and precision, on a dataset of the same sizes."""
        mine = self.plan
        return (shape_of(plan.config) == shape_of(mine.config)
                and (plan.num_train, plan.num_test, plan.batches, plan.first_epoch)
                == (mine.num_train, mine.num_test, mine.batches, mine.first_epoch)
                and self.precision_run(plan.config, self.check_precision(plan.config.precision)) == self.precision)

    def adopt(self, plan: RunPlan) -> None:
        """Make `plan` this row's (a restart's first step, once it is known to fit)."""
        self.plan, self.config = plan, plan.config

    def train_epoch(self, epoch: int, num_batches: int, measure: bool) -> EpochResult:
        """Train the first `num_batches` batches of `epoch` (the plan's `batches[epoch]` in a run)."""
        raise NotImplementedError

    def test_accuracy(self) -> float:
        raise NotImplementedError

    def weights(self) -> list[Layer]:
        """Host copies of the current parameters in float32, what `run --save` writes (a rung
        that computes with lower-precision copies returns its fp32 master weights)."""
        raise NotImplementedError

    def environment(self) -> dict:
        """What the run ran on, beyond Python and the CPU (GPU, driver, library versions)."""
        return {}

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
