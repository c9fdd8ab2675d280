"""The cnn in JAX (`run --preset speedrun --stage jax-scan`, the speedrun's peer), written for
speed as a competent user would: an epoch (the full batches as one `lax.scan`, then the tail
batch) is one jitted function, so an epoch is one dispatch, and the test accuracy another. Adam
and the rate schedule are written out (graphtrain.reference_cnn's rules), the rate computed from
the step inside the scan. Compiled in setup for every epoch length of the plan; a restart puts
the plan's weights and orders on the device and zeroes Adam's moments and the step. The peak
learning rate is an argument of the compiled epoch, so a restart may change it; the schedule's
shape and the optimizer's constants are compiled in, so another is set up anew.

TF32 ("tensorfloat32" precision) for convolutions and products unless the precision is fp32
("highest"): set around each call (jax.default_matmul_precision), not for the whole process.
An epoch is timed with perf_counter from the dispatch to `block_until_ready` on its result.
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np

from graphtrain.peers import jax_functions
from graphtrain.peers.jax_scan import import_jax
from graphtrain.recipe import Recipe, schedule_rate
from graphtrain.reference import Layer
from graphtrain.stages.base import EpochResult
from graphtrain.stages.cnn_rungs import CnnStage, as_layers, cnn_setup, flat_params


class JaxScanCnnPeer(CnnStage):
    name = "jax-scan"
    summary = "JAX: the cnn's epoch as one jitted lax.scan, Adam and the rate schedule written out"

    @classmethod
    def check_available(cls) -> int | None:
        import_jax()
        return None

    def measures(self, epoch: int) -> bool:
        return False  # the compiled epoch holds no loss sum: the speedrun's program, as timed

    def matmul_precision(self):
        """The block's products at this row's precision (jax's own context; nothing process-wide)."""
        return self.jax.default_matmul_precision("tensorfloat32" if self.precision == "tf32" else "highest")

    def setup(self) -> None:
        jax, device = import_jax()
        import jax.numpy as jnp

        self.jax, self.device = jax, device
        self.note = f"{'TF32' if self.precision == 'tf32' else 'fp32'}, one jit per epoch: a scan over the steps"
        self.spec, self.recipe, train_x, test_x = cnn_setup(self)
        spec, recipe, data = self.spec, self.recipe, self.data
        opt, sch = recipe.optimizer, recipe.schedule
        if opt.kind not in ("adam", "adamw"):  # the registry refuses another before any work
            raise RuntimeError(f"{self.name} trains the cnn with Adam or AdamW, not {opt.kind}")
        shape = (-1, spec.channels, spec.height, spec.width)

        def put(array):
            return jax.device_put(array, device)

        self.put = put
        self.train_x, self.train_y = put(train_x.reshape(shape)), put(data.train_labels.astype(np.int32, copy=False))
        self.test_x, self.test_y = put(test_x.reshape(shape)), put(data.test_labels.astype(np.int32, copy=False))
        b, b1, b2 = recipe.batch, *opt.betas

        def loss_fn(params, x, y):
            return jax_functions.cross_entropy(jax_functions.forward(spec, params, x), y)

        def step(train_x, train_y, peak, carry, idx):
            params, m, v, k = carry
            grads = jax.grad(loss_fn)(params, train_x[idx], train_y[idx])
            lr = schedule_rate(sch, k.astype(jnp.float32), peak, jnp)
            t = (k + 1).astype(jnp.float32)
            c1, c2 = 1 - b1 ** t, 1 - b2 ** t
            new = []
            for p, g, mi, vi in zip(params, grads, m, v):
                if opt.kind == "adamw":
                    p = p * (1 - lr * opt.weight_decay)
                elif opt.weight_decay:
                    g = g + opt.weight_decay * p
                mi = b1 * mi + (1 - b1) * g
                vi = b2 * vi + (1 - b2) * g * g
                p = p - lr / c1 * mi / (jnp.sqrt(vi) / jnp.sqrt(c2) + opt.eps)
                new.append((p, mi, vi))
            return ([n[0] for n in new], [n[1] for n in new], [n[2] for n in new], k + 1), None

        def start(params):
            """A run's carry: the parameters, Adam's moments at zero, the step counter at zero."""
            zeros = [jnp.zeros_like(p) for p in params]
            return params, zeros, list(zeros), jnp.int32(0)

        def epoch_fn(carry, orders, epoch, peak, train_x, train_y, full, tail):
            """One epoch: its first `full` batches as a scan, then a tail batch of `tail` rows."""
            order = jax.lax.dynamic_index_in_dim(orders, epoch, keepdims=False)
            if full:
                rows = order[:full * b].reshape(full, b)
                carry, _ = jax.lax.scan(partial(step, train_x, train_y, peak), carry, rows)
            if tail:
                carry, _ = step(train_x, train_y, peak, carry, order[full * b:full * b + tail])
            return carry

        def correct_fn(params, test_x, test_y):
            return (jnp.argmax(jax_functions.forward(spec, params, test_x), axis=1) == test_y).sum()

        self.start_fn = jax.jit(start)
        self.epoch_fn = jax.jit(epoch_fn, static_argnames=("full", "tail"))
        self.correct_fn = jax.jit(correct_fn)
        # Compile, and run once, every epoch length of the plan and the evaluation; the functions
        # are pure, so the results are dropped and the run starts from the plan's weights.
        with self.matmul_precision():
            self.start_run()
            for num_batches in sorted(set(self.plan.batches)):
                carry = self.epoch_fn(self.carry, self.orders, 0, self.peak, self.train_x, self.train_y,
                                      **self.epoch_shape(num_batches))
                jax.block_until_ready(carry)
            jax.block_until_ready(self.correct_fn(self.carry[0], self.test_x, self.test_y))

    def epoch_shape(self, num_batches: int) -> dict:
        """The compiled epoch's static shape for the first `num_batches` batches: its full
        batches and the rows of its tail batch (0: none)."""
        b = self.recipe.batch
        sizes = [hi - lo for lo, hi in self.plan.epoch_bounds(0, num_batches)]
        full = sum(1 for size in sizes if size == b)
        return {"full": full, "tail": sizes[-1] if sizes[-1] != b else 0}

    def put_recipe(self, recipe: Recipe) -> bool:
        """Another peak rate is an argument of the compiled epoch; the rest is compiled in."""
        return recipe.but_for_the_peak() == self.recipe.but_for_the_peak()

    def start_run(self) -> None:
        """The plan's weights and orders on the device, Adam's moments and the step at zero."""
        with self.matmul_precision():
            self.carry = self.start_fn([self.put(p) for p in flat_params(self.plan.initial)])
        self.orders = self.put(self.plan.orders)
        self.peak = self.put(np.float32(self.recipe.schedule.lr))

    def train_epoch(self, epoch: int, num_batches: int, measure: bool) -> EpochResult:
        start = time.perf_counter()
        with self.matmul_precision():
            self.carry = self.epoch_fn(self.carry, self.orders, epoch, self.peak, self.train_x, self.train_y,
                                       **self.epoch_shape(num_batches))
        self.jax.block_until_ready(self.carry)
        return EpochResult((time.perf_counter() - start) * 1e3)

    def test_accuracy(self) -> float:
        with self.matmul_precision():
            correct = self.correct_fn(self.carry[0], self.test_x, self.test_y)
        return int(correct) / len(self.data.test_images)

    def weights(self) -> list[Layer]:
        return as_layers([np.array(p) for p in self.jax.device_get(self.carry[0])])

    def environment(self) -> dict:
        from graphtrain.environment import driver_version

        return {"gpu": self.device.device_kind, "driver": driver_version(), "jax": self.jax.__version__}

    def close(self) -> None:
        for name in ("train_x", "train_y", "test_x", "test_y", "carry", "orders", "peak", "start_fn", "epoch_fn",
                     "correct_fn"):
            if hasattr(self, name):
                setattr(self, name, None)
