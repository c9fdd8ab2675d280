"""The speedrun in JAX, written for speed as a competent user would: the whole run (the full
batches as one `lax.scan`, the tail batch, the test accuracy) is one jitted function, so a run
is one dispatch. Adam and the rate schedule are written out (graphtrain.reference_cnn's rules),
the rate computed from the step inside the scan. Compiled in setup for the run's shapes; per run
the clock covers the parameters and the order put on the device, the call, and the accuracy as
a Python number. TF32 ("tensorfloat32" precision) for convolutions and products unless the
task's precision is fp32 ("highest").
"""

from __future__ import annotations

import numpy as np

from graphtrain.peers.jax_scan import import_jax
from graphtrain.recipe import SpeedrunRow, SpeedrunTask


class JaxScanRow(SpeedrunRow):
    name = "jax-scan"

    def setup(self, task: SpeedrunTask) -> None:
        super().setup(task)
        jax, device = import_jax()
        import jax.numpy as jnp

        self.jax, self.device = jax, device
        self.saved_precision = jax.config.jax_default_matmul_precision
        precision = "tensorfloat32" if task.recipe.precision == "tf32" else "highest"
        jax.config.update("jax_default_matmul_precision", precision)
        self.note = f"{'TF32' if precision == 'tensorfloat32' else 'fp32'}, one jit: scan over the steps + eval"
        spec, recipe = task.spec, task.recipe
        if recipe.optimizer.kind not in ("adam", "adamw"):
            raise NotImplementedError(f"the jax speedrun peer trains with Adam or AdamW, not {recipe.optimizer.kind}")
        shape = (-1, spec.channels, spec.height, spec.width)
        put = lambda a: jax.device_put(a, device)  # noqa: E731
        self.train_x = put(task.train_images.reshape(shape))
        self.train_y = put(task.train_labels)
        self.test_x = put(task.test_images.reshape(shape))
        self.test_y = put(task.test_labels)
        n, b = len(task.train_images), recipe.batch
        if recipe.epochs != 1:
            raise NotImplementedError("the jax speedrun peer trains one epoch")
        self.full = n // b
        opt, sch = recipe.optimizer, recipe.schedule
        b1, b2 = opt.betas

        def forward(params, x):
            for i, layer in enumerate(spec.convs):
                w, bias = params[2 * i], params[2 * i + 1]
                x = jax.lax.conv_general_dilated(x, w, (layer.stride,) * 2, [(layer.padding, layer.padding)] * 2,
                                                 dimension_numbers=("NCHW", "OIHW", "NCHW"))
                x = x + bias[None, :, None, None]
                if layer.pool > 1:
                    x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, layer.pool, layer.pool),
                                              (1, 1, layer.pool, layer.pool), "VALID")
                x = jax.nn.relu(x)
            x = x.reshape(x.shape[0], -1)
            head = params[2 * len(spec.convs):]
            for j in range(len(head) // 2):
                x = x @ head[2 * j].T + head[2 * j + 1]
                if j < len(head) // 2 - 1:
                    x = jax.nn.relu(x)
            return x

        def loss_fn(params, x, y):
            logp = jax.nn.log_softmax(forward(params, x))
            return -jnp.take_along_axis(logp, y[:, None], axis=1).mean()

        def rate(k):
            k = k.astype(jnp.float32)
            if sch.kind == "constant":
                return jnp.float32(sch.lr)
            if sch.kind == "warmup":
                return sch.lr * jnp.minimum(1.0, (k + 1) / max(sch.warmup_steps, 1))
            if sch.kind == "cosine":
                return sch.lr * (1 + jnp.cos(jnp.pi * k / sch.total)) / 2
            start, low = sch.lr / sch.div, sch.lr / sch.div / sch.final_div
            end1, end2 = sch.pct * sch.total - 1, sch.total - 1

            def anneal(a, b_, pct):
                return b_ + (a - b_) / 2 * (jnp.cos(jnp.pi * pct) + 1)

            return jnp.where(k <= end1, anneal(start, sch.lr, k / end1), anneal(sch.lr, low, (k - end1) / (end2 - end1)))

        def step(train_x, train_y, carry, idx):
            params, m, v, k = carry
            grads = jax.grad(loss_fn)(params, train_x[idx], train_y[idx])
            lr = rate(k)
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

        def run(params, rows, tail, train_x, train_y, test_x, test_y):
            """The whole run: the full batches scanned, the tail batch, the test set's correct count."""
            zeros = [jnp.zeros_like(p) for p in params]
            carry = (params, zeros, list(zeros), jnp.int32(0))
            carry, _ = jax.lax.scan(lambda c, idx: step(train_x, train_y, c, idx), carry, rows)
            if tail is not None:
                carry, _ = step(train_x, train_y, carry, tail)
            logits = forward(carry[0], test_x)
            return (jnp.argmax(logits, axis=1) == test_y).sum(), carry[0]

        self.run_fn = jax.jit(run)
        self.data = (self.train_x, self.train_y, self.test_x, self.test_y)
        jax.block_until_ready(self.run_fn(*self.inputs(0), *self.data))  # compile, and one run to warm up

    def inputs(self, seed: int):
        task, b = self.task, self.task.recipe.batch
        order = task.orders(seed)[0]
        put = lambda a: self.jax.device_put(a, self.device)  # noqa: E731
        params = [put(p) for p in task.initial(seed)]
        rows = put(order[:self.full * b].reshape(self.full, b))
        tail = put(order[self.full * b:]) if len(order) > self.full * b else None
        return params, rows, tail

    def run(self, seed: int) -> float:
        params, rows, tail = self.inputs(seed)
        correct, self.params = self.run_fn(params, rows, tail, *self.data)
        return int(correct) / len(self.task.test_images)

    def weights(self) -> list[np.ndarray]:
        return [np.asarray(p) for p in self.jax.device_get(self.params)]

    def environment(self) -> dict:
        from graphtrain.environment import driver_version

        return {"gpu": self.device.device_kind, "driver": driver_version(), "jax": self.jax.__version__}

    def close(self) -> None:
        jax = getattr(self, "jax", None)
        if jax is not None and hasattr(self, "saved_precision"):
            jax.config.update("jax_default_matmul_precision", self.saved_precision)
        for name in ("train_x", "train_y", "test_x", "test_y", "run_fn", "params", "data"):
            if hasattr(self, name):
                setattr(self, name, None)
