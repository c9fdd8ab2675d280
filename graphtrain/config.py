"""What to train: `TrainConfig` and the named presets of the workloads graphtrain reproduces."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from graphtrain.errors import UsageError

PRECISIONS = ("fp32", "tf32", "bf16")  # of the products' operands; every row accumulates in fp32
MODELS = ("mlp", "cnn")
OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw")  # graphtrain.reference_cnn's
SCHEDULES = ("constant", "warmup", "one-cycle", "cosine")


@dataclass(frozen=True)
class TrainConfig:
    """One training run's workload. `dims` is the whole layer chain, input to classes.

    `hidden=()` is softmax regression; every hidden layer is followed by a ReLU. The `cnn` model
    puts conv layers before them: `conv` is ((out channels, kernel), ...), each conv followed by
    a 2×2 max-pool and a ReLU. `optimizer` and `schedule` (with `lr` its peak) say how the
    parameters are updated; plain SGD at a constant rate is what every rung can do. Exactly one of
    `epochs` and `steps` sets the length: with `steps`, training runs whole epochs and stops
    the last one early, so the sample order is the same as an epochs-based run.
    """

    hidden: tuple[int, ...] = ()
    bias: bool = True
    batch: int = 128
    epochs: int | None = 20
    steps: int | None = None
    lr: float = 0.1
    seed: int = 0
    dataset: str = "mnist"
    metrics_every: int = 10
    precision: str | None = None  # None: each row's own (see Stage.precisions)
    in_features: int = 784
    classes: int = 10
    preset: str | None = field(default=None, compare=False)
    model: str = "mlp"
    conv: tuple[tuple[int, int], ...] = ()
    optimizer: str = "sgd"
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    schedule: str = "constant"
    warmup: int = 0  # steps of linear warm-up (the `warmup` schedule)

    @property
    def dims(self) -> tuple[int, ...]:
        return (self.in_features, *self.hidden, self.classes)

    @property
    def layers_text(self) -> str:
        """The model in a few words: '784-256-10', a cnn's conv layers first ('conv 24x5,32x3, 800-256-10')."""
        dims = "-".join(map(str, self.dims))
        return f"conv {','.join(f'{c}x{k}' for c, k in self.conv)}, {dims}" if self.conv else dims

    def replace(self, **changes) -> TrainConfig:
        """A copy with `changes` applied; None values mean 'keep the current one'. Conv layers
        given without a model make the model the cnn."""
        changes = {k: v for k, v in changes.items() if v is not None}
        if changes.get("conv") and "model" not in changes:
            changes["model"] = "cnn"
        if "steps" in changes:
            changes.setdefault("epochs", None)
        elif "epochs" in changes:
            changes["steps"] = None
        return dataclasses.replace(self, **changes)

    def __post_init__(self) -> None:
        """Reject values no stage can train with: a config that exists is one that can run.

        What depends on the dataset (a batch larger than it, a model too big for the memory)
        is checked when the run plan is built (`graphtrain.plan.RunPlan.build`).
        """
        problems = []
        if any(not isinstance(h, int) or h < 1 for h in self.hidden):
            problems.append(f"hidden sizes must be positive integers, got {list(self.hidden)}")
        if self.batch < 1:
            problems.append(f"batch must be >= 1, got {self.batch}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            problems.append(f"lr must be a finite number > 0, got {self.lr}")
        if (self.epochs is None) == (self.steps is None):
            problems.append("give exactly one of epochs and steps")
        if self.epochs is not None and self.epochs < 1:
            problems.append(f"epochs must be >= 1, got {self.epochs}")
        if self.steps is not None and self.steps < 1:
            problems.append(f"steps must be >= 1, got {self.steps}")
        if self.metrics_every < 1:
            problems.append(f"metrics_every must be >= 1, got {self.metrics_every}")
        if self.precision is not None and self.precision not in PRECISIONS:
            problems.append(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.seed < 0:
            problems.append(f"seed must be >= 0, got {self.seed}")
        if self.in_features < 1 or self.classes < 2:
            problems.append(f"a model needs >= 1 input feature and >= 2 classes, got "
                            f"{self.in_features} and {self.classes}")
        if self.model not in MODELS:
            problems.append(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.model == "cnn" and not self.conv:
            problems.append("the cnn model needs at least one conv layer (--conv 24x5,32x3)")
        if self.model == "mlp" and self.conv:
            problems.append("conv layers need --model cnn")
        if any(len(c) != 2 or min(c) < 1 for c in self.conv):
            problems.append(f"conv layers are (channels, kernel) pairs of positive integers, got {list(self.conv)}")
        if self.optimizer not in OPTIMIZERS:
            problems.append(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.schedule not in SCHEDULES:
            problems.append(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not (0 <= self.momentum < 1 and all(0 <= b < 1 for b in self.betas) and self.weight_decay >= 0):
            problems.append("momentum and betas must lie in [0, 1), weight decay be >= 0")
        if self.schedule == "warmup" and self.warmup < 1:
            problems.append("the warmup schedule needs --warmup steps >= 1")
        if problems:
            raise UsageError("invalid training configuration: " + "; ".join(problems))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["hidden"] = list(self.hidden)
        d["conv"] = [list(c) for c in self.conv]
        d["betas"] = list(self.betas)
        d["dims"] = list(self.dims)
        return d


PRESETS: dict[str, TrainConfig] = {
    # Softmax regression, the JHU report's ladder workload.
    "jhu": TrainConfig(hidden=(), bias=True, batch=128, epochs=20, lr=0.1, preset="jhu"),
    # The 'Cuda MLP' project: four 784-wide ReLU layers, no bias.
    "cuda-mlp": TrainConfig(
        hidden=(784, 784, 784, 784), bias=False, batch=64, epochs=10, lr=0.1, preset="cuda-mlp"
    ),
    # The 'cuda-mnist' project: three hidden layers of H (swept 128..8192), 5000 steps.
    "cuda-mnist": TrainConfig(
        hidden=(1024, 1024, 1024), bias=True, batch=32, epochs=None, steps=5000, lr=0.003,
        preset="cuda-mnist",
    ),
    # train_mnist_fast's recipe: conv 1→24 5×5, pool, ReLU, conv 24→32 3×3, pool, ReLU, 800→256→10;
    # Adam (β 0.7, 0.9) at a one-cycle rate peaking at 0.01; batch 256; one epoch.
    "speedrun": TrainConfig(
        model="cnn", conv=((24, 5), (32, 3)), hidden=(256,), bias=True, batch=256, epochs=1, lr=0.01,
        optimizer="adam", betas=(0.7, 0.9), schedule="one-cycle", preset="speedrun",
    ),
}


def preset(name: str) -> TrainConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise UsageError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None


def parse_hidden(text: str) -> tuple[int, ...]:
    """'784,784' -> (784, 784); '' or 'none' -> () (softmax regression, no hidden layer)."""
    text = text.strip()
    if text.lower() in ("", "none"):
        return ()
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"--hidden wants comma-separated integers like 784,784, got {text!r}") from None
    if any(s < 1 for s in sizes):
        raise UsageError(f"hidden sizes must be positive, got {text!r} "
                         "(for softmax regression, with no hidden layer, give --hidden none)")
    return sizes


def parse_conv(text: str) -> tuple[tuple[int, int], ...]:
    """'24x5,32x3' -> ((24, 5), (32, 3)): each conv layer's output channels and kernel size."""
    layers = []
    for part in text.strip().split(","):
        try:
            channels, kernel = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise UsageError(f"--conv wants CHANNELSxKERNEL pairs like 24x5,32x3, got {text!r}") from None
        if channels < 1 or kernel < 1:
            raise UsageError(f"conv channels and kernel sizes must be positive, got {text!r}")
        layers.append((channels, kernel))
    return tuple(layers)


def cnn_spec(config: TrainConfig):
    """The cnn a config describes, over 28×28 single-channel images."""
    side = int(round(config.in_features ** 0.5))
    if side * side != config.in_features:
        raise UsageError(f"the cnn wants square single-channel images; these have {config.in_features} features")
    from graphtrain.reference_cnn import CnnSpec, ConvLayer

    spec = CnnSpec(tuple(ConvLayer(c, k) for c, k in config.conv), tuple(config.hidden), config.classes, 1, side,
                   side)
    problems = spec.problems()
    if problems:
        raise UsageError("invalid cnn: " + "; ".join(problems))
    return spec
