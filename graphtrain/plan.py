"""The run plan: what every row of a workload shares, built once and handed to each of them.

The ladder's promise is that every row, rung and peer alike, trains the same model from the same
initial weights, in the same sample order, over the same batches, and that the sparse-metrics
rungs measure the same epochs. A `RunPlan` is that promise as data. It is built once per workload
from the config and the dataset's size, its arrays are read-only, and no row recomputes any of
it: a row reads `plan.initial`, `plan.orders[epoch]`, `plan.epoch_bounds(epoch)`,
`plan.batch_sizes` and `plan.metrics_due[epoch]`.

Building a plan also checks that the workload can run at all: a batch no larger than the
dataset, and the plan's own arrays within the host's free memory. `check_fits` does the same
for a row, against the memory it trains in (the host's or a GPU's), before its setup. All are
a `UsageError`, raised before anything large is allocated.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from graphtrain import environment, reference
from graphtrain.config import TrainConfig
from graphtrain.errors import UsageError
from graphtrain.kernels import ceil_div  # the package's one ⌈a / b⌉, beside the launchers
from graphtrain.reference import Layer

FLOAT_BYTES = 4  # float32 parameters, activations and images
INDEX_BYTES = 4  # int32 sample indices and labels


def epoch_batches(config: TrainConfig, num_train: int) -> tuple[int, ...]:
    """Batches run in each epoch: all of them, except in a steps-limited last epoch."""
    per_epoch = ceil_div(num_train, config.batch)
    if config.epochs is not None:
        return (per_epoch,) * config.epochs
    full_epochs, rest = divmod(config.steps, per_epoch)
    return (per_epoch,) * full_epochs + ((rest,) if rest else ())


@dataclass(frozen=True, eq=False)  # eq=False: arrays compare elementwise, not to a bool
class RunPlan:
    config: TrainConfig  # in_features and classes taken from the dataset
    num_train: int
    num_test: int
    initial: tuple[Layer, ...]  # float32 initial parameters, read-only
    orders: np.ndarray  # (num_epochs, num_train) int32: epoch e trains samples orders[e] in order
    bounds: tuple[tuple[int, int], ...]  # (start, stop) of each batch of a whole epoch
    batches: tuple[int, ...]  # batches run in each epoch (see epoch_batches)
    batch_sizes: tuple[int, ...]  # the distinct batch sizes the run trains, largest first
    metrics_due: tuple[bool, ...]  # the sparse schedule: every metrics_every epochs and the last
    # Epochs the model trained before this run (a run resumed from a saved model): this run's
    # epoch e is the model's epoch first_epoch + e, and takes that epoch's sample order.
    first_epoch: int = 0

    @classmethod
    def build(cls, config: TrainConfig, num_train: int, num_test: int,
              num_features: int | None = None, num_classes: int | None = None,
              initial: Sequence[Layer] | None = None, first_epoch: int = 0) -> RunPlan:
        """The plan of `config` over a dataset of `num_train` training and `num_test` test samples
        of `num_features` features in `num_classes` classes (default: the config's).

        The initial parameters are `initial` when given (a saved model's, to resume training;
        the caller checks they fit the config), else the seeded init. `first_epoch` is how many
        epochs they were trained for: the sample orders continue from there.
        """
        config = config.replace(in_features=num_features, classes=num_classes)
        cls.check_workload(config, num_train, num_test)
        batches = epoch_batches(config, num_train)
        num_epochs = len(batches)
        bounds = tuple(reference.batch_bounds(num_train, config.batch))
        sizes = {hi - lo for count in set(batches) for lo, hi in bounds[:count]}

        orders = np.empty((num_epochs, num_train), np.int32)

        def draw(epoch: int) -> None:
            orders[epoch] = reference.epoch_order(config.seed, first_epoch + epoch, num_train)

        # Each epoch's order from its own generator, so a pool of threads draws them at once
        # (numpy shuffles without the GIL): the same orders in a fraction of the time.
        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1, max(num_epochs, 1))) as pool:
            list(pool.map(draw, range(num_epochs)))
        if initial is None and config.model == "cnn":
            from graphtrain import reference_cnn
            from graphtrain.config import cnn_spec

            params = reference_cnn.init_params(cnn_spec(config), config.seed, np.float32)
            initial = [Layer(params[i], params[i + 1]) for i in range(0, len(params), 2)]  # conv, then linear
        elif initial is None:
            initial = reference.init_params(config.dims, config.bias, config.seed, np.float32)
        else:
            initial = [layer.copy(np.float32) for layer in initial]
            shapes = [(layer.w.shape, None if layer.b is None else layer.b.shape) for layer in initial]
            if config.model == "cnn":  # every layer of the cnn has a bias
                from graphtrain.config import cnn_spec

                params = cnn_spec(config).param_shapes()
                wanted = list(zip(params[::2], params[1::2]))
            else:
                wanted = [((o, i), (o,) if config.bias else None) for i, o in zip(config.dims, config.dims[1:])]
            if shapes != wanted:  # the caller checks a user's file; this guards the plan itself
                raise ValueError(f"initial parameters {shapes} do not fit the model {config.dims}")
        for array in (orders, *(a for layer in initial for a in (layer.w, layer.b) if a is not None)):
            array.flags.writeable = False  # shared by every row: none may change it for the others
        every = config.metrics_every
        return cls(
            config=config, num_train=num_train, num_test=num_test, initial=tuple(initial),
            orders=orders, bounds=bounds, batches=batches,
            batch_sizes=tuple(sorted(sizes, reverse=True)),
            metrics_due=tuple((first_epoch + e + 1) % every == 0 or e == num_epochs - 1
                              for e in range(num_epochs)),
            first_epoch=first_epoch,
        )

    @staticmethod
    def check_workload(config: TrainConfig, num_train: int, num_test: int) -> None:
        """UsageError unless a plan of `config` can be built here: a batch no larger than the
        dataset, and the plan's initial weights and sample orders within the free memory."""
        if config.batch > num_train:
            raise UsageError(f"invalid training configuration: batch {config.batch} is larger than "
                             f"the dataset ({num_train} samples)")
        footprint = Footprint.of(config, num_train, num_test)
        footprint.check(footprint.plan_bytes, environment.free_host_memory(), "the memory free on this machine")

    @classmethod
    def for_data(cls, config: TrainConfig, data, initial: Sequence[Layer] | None = None,
                 first_epoch: int = 0) -> RunPlan:
        """The plan of `config` over a loaded `graphtrain.data.Dataset`, whose sample size and
        classes set the model's input and output sizes."""
        return cls.build(config, len(data.train_images), len(data.test_images), data.num_features,
                         data.num_classes, initial, first_epoch)

    @property
    def num_epochs(self) -> int:
        return len(self.batches)

    @property
    def batches_per_epoch(self) -> int:
        """Batches of a whole epoch, the tail batch included."""
        return len(self.bounds)

    def epoch_bounds(self, epoch: int, num_batches: int | None = None) -> tuple[tuple[int, int], ...]:
        """(start, stop) of the batches `epoch` runs (its first `num_batches`, when given)."""
        return self.bounds[:self.batches[epoch] if num_batches is None else num_batches]

    def samples_seen(self, num_batches: int) -> int:
        """Samples trained by the first `num_batches` batches of an epoch."""
        return self.bounds[num_batches - 1][1]

    def initial_params(self, dtype=np.float32) -> list[Layer]:
        """Writable copies of the initial parameters, for a row to train."""
        return [layer.copy(dtype) for layer in self.initial]

    def check_fits(self, on_gpu: bool, gpu_memory: int | None = None) -> None:
        """UsageError unless a row's model fits where it trains: on the host (its weights,
        gradients and activations in the free memory) or on a GPU of `gpu_memory` bytes (those,
        the dataset and the orders; not checked when the size is unknown)."""
        footprint = Footprint.of(self.config, self.num_train, self.num_test)
        if on_gpu:
            footprint.check(footprint.device_bytes, gpu_memory, "the GPU's memory")
        else:
            footprint.check(footprint.host_bytes, environment.free_host_memory(), "the memory free on this machine")


# --------------------------------------------------------------------------------------------
# Memory: a lower bound, to reject what cannot fit before any work starts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Footprint:
    """Bytes a run needs at least, by what holds them."""

    config: TrainConfig
    params: int  # one copy of every weight and bias
    activations: int  # one batch through every layer
    dataset: int  # training and test images and labels
    orders: int  # every epoch's sample order

    @classmethod
    def of(cls, config: TrainConfig, num_train: int, num_test: int) -> Footprint:
        dims = config.dims
        params = sum(o * i + (o if config.bias else 0) for i, o in zip(dims[:-1], dims[1:]))
        samples = num_train + num_test
        return cls(config, params * FLOAT_BYTES, config.batch * sum(dims) * FLOAT_BYTES,
                   samples * (config.in_features * FLOAT_BYTES + INDEX_BYTES),
                   len(epoch_batches(config, num_train)) * num_train * INDEX_BYTES)

    @property
    def plan_bytes(self) -> int:
        """The plan's initial weights and sample orders."""
        return self.params + self.orders

    @property
    def host_bytes(self) -> int:
        """A row training on the host: its weights, their gradients, activations and theirs."""
        return 2 * self.params + 2 * self.activations

    @property
    def device_bytes(self) -> int:
        """A row training on a GPU: the same, plus the dataset and the orders uploaded."""
        return self.host_bytes + self.dataset + self.orders

    def check(self, needed: int, available: int | None, where: str) -> None:
        if available is None or needed <= available:
            return
        raise UsageError(
            f"the model {'-'.join(map(str, self.config.dims))} at batch {self.config.batch} needs at "
            f"least {format_bytes(needed)} of memory, more than {where} ({format_bytes(available)}): "
            "choose smaller --hidden sizes or a smaller --batch")


def format_bytes(count: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"
