"""The cnn recipe and the MNIST normalisation, below every row that trains them.

`Recipe` is how a model is trained (batch, epochs, optimizer, learning-rate schedule, precision);
`recipe_of` builds it from a `TrainConfig`; `normalise` puts [0, 1] pixels on MNIST's mean and
standard deviation, as the recipe trains on them, and `normalised` does it once per array in a
process. The cnn's classes (graphtrain.stages.cnn_rungs and the peers' in graphtrain.peers) and
the speedrun (graphtrain.speedrun) take these from here, so that no row imports a runner.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass, field

import numpy as np

from graphtrain.config import TrainConfig
from graphtrain.data import images as images_mod
from graphtrain.kernels import ceil_div
from graphtrain.reference_cnn import Optimizer, Schedule

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

    def but_for_the_peak(self) -> Recipe:
        """This recipe with its schedule's peak rate set aside: equal for two recipes that differ
        in the learning rate only."""
        return dataclasses.replace(self, schedule=dataclasses.replace(self.schedule, lr=1.0))


def normalise(images: np.ndarray) -> np.ndarray:
    """Pixels in [0, 1] as the recipe trains on them: (x − mean) / std, float32."""
    return images_mod.normalise(images, MNIST_MEAN, MNIST_STD)


# id(images) -> (a weak reference to images, their normalised copy): see `normalised`.
_NORMALISED: dict[int, tuple[weakref.ref, np.ndarray]] = {}


def normalised(images: np.ndarray) -> np.ndarray:
    """`normalise(images)`, computed once per array object while it lives: every row of a
    process that trains on the same dataset gets the same normalised array (shared: never
    written), so what keys its uploads on the array's identity uploads it once."""
    key = id(images)
    cached = _NORMALISED.get(key)
    if cached is not None and cached[0]() is images:
        return cached[1]
    result = normalise(images)
    # The entry goes when `images` does (before its id can be given to another array).
    _NORMALISED[key] = (weakref.ref(images, lambda _gone, key=key: _NORMALISED.pop(key, None)), result)
    return result


def schedule_rate(schedule: Schedule, k, peak, xp):
    """The learning rate of step `k` (a float array: a framework's step counter) peaking at
    `peak` (an array, so that another peak needs no new program), as `schedule.at` computes it,
    written with the array module `xp` (torch, jax.numpy or numpy: its ones_like, minimum, cos
    and where) for a framework's compiled step to compute on the device."""
    if schedule.kind == "constant":
        return peak * xp.ones_like(k)
    if schedule.kind == "warmup":
        return peak * xp.minimum(xp.ones_like(k), (k + 1) / max(schedule.warmup_steps, 1))
    if schedule.kind == "cosine":
        return peak * (1 + xp.cos(math.pi * k / schedule.total)) / 2
    start, low = peak / schedule.div, peak / schedule.div / schedule.final_div
    end1, end2 = schedule.pct * schedule.total - 1, schedule.total - 1

    def anneal(a, b, pct):
        return b + (a - b) / 2 * (xp.cos(math.pi * pct) + 1)

    return xp.where(k <= end1, anneal(start, peak, k / end1), anneal(peak, low, (k - end1) / (end2 - end1)))


def recipe_of(config: TrainConfig, steps: int, epochs: int, precision: str = "tf32") -> Recipe:
    """The recipe of `config` over a run of `epochs` epochs, `steps` steps in all (what the
    schedule spans)."""
    return Recipe(batch=config.batch, epochs=epochs,
                  optimizer=Optimizer.of(config), schedule=Schedule.of(config, steps),
                  precision=precision)
