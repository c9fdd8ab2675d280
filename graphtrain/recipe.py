"""The cnn recipe and the MNIST normalisation, below every row that trains them.

`Recipe` is how a model is trained (batch, epochs, optimizer, learning-rate schedule, precision);
`recipe_of` builds it from a `TrainConfig`; `normalise` puts [0, 1] pixels on MNIST's mean and
standard deviation, as the recipe trains on them. The cnn rungs (graphtrain.stages) and the
speedrun (graphtrain.speedrun) take these from here, and the speedrun's peers (graphtrain.peers)
its `SpeedrunTask` and `SpeedrunRow`, so that no row imports a runner.

`SpeedrunTask` is what every row of a speedrun trains (the model, the recipe, the normalised data, each
seed's run plan) and `SpeedrunRow` the protocol a speedrun row answers to: set up once, then `run(seed)`
returns the test accuracy of one seed's training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphtrain.config import TrainConfig, preset
from graphtrain.data import images as images_mod
from graphtrain.kernels import ceil_div
from graphtrain.plan import RunPlan
from graphtrain.reference_cnn import CnnSpec, Optimizer, Schedule

# MNIST's pixel mean and standard deviation (of [0, 1] pixels), the usual normalisation: one pair,
# kept in graphtrain.data.images, which saved models' `normalisation` and `predict` use too.
MNIST_MEAN, MNIST_STD = images_mod.MNIST_NORMALISATION


@dataclass(frozen=True)
class Recipe:
    """How the model is trained: batch, epochs, optimizer and learning-rate schedule, precision."""

    batch: int = 256
    epochs: int = 1
    optimizer: Optimizer = field(default_factory=Optimizer)
    schedule: Schedule = field(default_factory=Schedule)  # its `total` is the run's step count
    precision: str = "tf32"

    def steps(self, num_train: int) -> int:
        return self.epochs * ceil_div(num_train, self.batch)


def normalise(images: np.ndarray) -> np.ndarray:
    """Pixels in [0, 1] as the recipe trains on them: (x − mean) / std, float32."""
    return images_mod.normalise(images, MNIST_MEAN, MNIST_STD)


def recipe_of(config: TrainConfig, steps: int, epochs: int, precision: str = "tf32") -> Recipe:
    """The recipe of `config` over a run of `epochs` epochs, `steps` steps in all (what the
    schedule spans)."""
    return Recipe(batch=config.batch, epochs=epochs,
                  optimizer=Optimizer.of(config), schedule=Schedule.of(config, steps),
                  precision=precision)


@dataclass(frozen=True)
class SpeedrunTask:
    """What every row of a speedrun trains: the model, the recipe, the normalised data."""

    spec: CnnSpec
    recipe: Recipe
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    evaluated_on: str = "test"  # or "holdout"
    config: TrainConfig | None = None  # the plans' workload; None: the speedrun preset with this model and batch
    plans: dict = field(default_factory=dict, compare=False)
    fused_convs: bool = True  # graphtrain's rows: convpool.cu's fused conv layers, or cuDNN's

    @property
    def steps(self) -> int:
        return self.recipe.steps(len(self.train_images))

    def plan(self, seed: int) -> RunPlan:
        """Seed `seed`'s run plan: its initial weights and sample orders (built once per seed)."""
        if seed not in self.plans:
            cfg = self.config or preset("speedrun").replace(
                conv=tuple((layer.out_channels, layer.kernel) for layer in self.spec.convs), hidden=self.spec.hidden,
                batch=self.recipe.batch, epochs=self.recipe.epochs)
            self.plans[seed] = RunPlan.build(cfg.replace(seed=seed), len(self.train_images), len(self.test_images),
                                             self.spec.channels * self.spec.height * self.spec.width,
                                             self.spec.classes)
        return self.plans[seed]

    def initial(self, seed: int) -> list[np.ndarray]:
        """The parameters in order: each layer's weight, then its bias (float32 copies)."""
        return [a.copy() for layer in self.plan(seed).initial for a in (layer.w, layer.b)]

    def orders(self, seed: int) -> np.ndarray:
        return self.plan(seed).orders


class SpeedrunRow:
    name: str
    note: str = ""

    def setup(self, task: SpeedrunTask) -> None:
        self.task = task

    def run(self, seed: int) -> float:
        raise NotImplementedError

    def environment(self) -> dict:
        return {}

    def close(self) -> None:
        pass
