"""`jax-vmap`: a sweep's models as one JAX program, the packed sweep's peer.

The JAX answer to many small models: `jax.vmap` of `jax-scan`'s SGD step over the models'
parameters, learning rates and sample orders, folded over an epoch's full batches by one
`lax.scan` (one dispatch an epoch for all K models), the tail batch by a separately jitted
vmapped step. Each model trains its own plan: its initial weights and its seed's sample order,
gathered per model from the one copy of the images on the GPU. fp32 with matmul precision
"highest" (no TF32), or bf16 operands with fp32 accumulation under `--precision bf16`.

Timing as `jax-scan`: perf_counter from an epoch's dispatch to `block_until_ready`; every model
of the pack shares the epoch's time.
"""

from __future__ import annotations

import time

import numpy as np

from graphtrain.errors import ModelUnsupported
from graphtrain.packed import check_pack
from graphtrain.peers.jax_scan import _jax_cuda_versions, _jaxlib_version, forward, import_jax, make_product
from graphtrain.record import EpochRecord, RunRecord, data_summary
from graphtrain.reference import Layer


def train_vmapped(plans, data) -> list[RunRecord]:
    """Train every plan (they differ only in lr and seed) as one vmapped scan; a record each."""
    jax, device = import_jax()
    import jax.numpy as jnp

    from graphtrain import environment

    run_start = time.perf_counter()
    cfg = plans[0].config
    check_pack(plans)
    precision = cfg.precision or "fp32"
    if precision not in ("fp32", "bf16"):
        raise ModelUnsupported(f"jax-vmap trains in fp32 or bf16, not --precision {precision}")
    product = make_product(precision)  # "fp32" or "bf16": bf16 operands, fp32 accumulation
    count, num_epochs = len(plans), plans[0].num_epochs
    saved_precision = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        def put(array):
            return jax.device_put(array, device)

        train_x, train_y = put(data.train_images), put(data.train_labels.astype(np.int32))
        test_x, test_y = put(data.test_images), put(data.test_labels.astype(np.int32))
        params = put([(np.stack([plan.initial[i].w for plan in plans]),
                       None if plans[0].initial[i].b is None else np.stack([plan.initial[i].b for plan in plans]))
                      for i in range(len(plans[0].initial))])
        lrs = put(np.array([plan.config.lr for plan in plans], np.float32))

        # Each epoch's batches as index arrays: full batches (batches, models, batch) for the scan,
        # the tail (models, rows) apart; model k's rows from its own sample order.
        epoch_indices = []
        for epoch in range(num_epochs):
            used = plans[0].epoch_bounds(epoch)
            full = sum(1 for lo, hi in used if hi - lo == cfg.batch)
            orders = np.stack([plan.orders[epoch] for plan in plans])  # (models, samples)
            full_idx = (put(orders[:, :full * cfg.batch].reshape(count, full, cfg.batch).transpose(1, 0, 2))
                        if full else None)
            tail = [(lo, hi) for lo, hi in used if hi - lo < cfg.batch]
            tail_idx = put(np.ascontiguousarray(orders[:, tail[0][0]:tail[0][1]])) if tail else None
            epoch_indices.append((full_idx, tail_idx))

        def loss_fn(params, x, y):
            logits = forward(params, x, product)
            logp = jax.nn.log_softmax(logits)
            return -jnp.take_along_axis(logp, y[:, None], axis=1).mean(), logits

        def step(params, lr, train_x, train_y, idx):
            """One model's SGD step on samples idx: (params, Σ loss over the batch, # correct)."""
            x, y = train_x[idx], train_y[idx]
            (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y)
            params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
            return params, loss * idx.shape[0], (jnp.argmax(logits, axis=1) == y).sum()

        models_step = jax.vmap(step, in_axes=(0, 0, None, None, 0))

        def epoch_fn(params, lrs, train_x, train_y, idx_rows):
            def body(carry, idx):
                params, loss_sum, correct = carry
                params, loss, batch_correct = models_step(params, lrs, train_x, train_y, idx)
                return (params, loss_sum + loss, correct + batch_correct), None

            start = (params, jnp.zeros(count, jnp.float32), jnp.zeros(count, jnp.int32))
            return jax.lax.scan(body, start, idx_rows)[0]

        def correct_fn(params, x, y):
            return (jnp.argmax(forward(params, x, product), axis=1) == y).sum()

        epoch_jit, step_jit = jax.jit(epoch_fn), jax.jit(models_step)
        correct_jit = jax.jit(jax.vmap(correct_fn, in_axes=(0, None, None)))

        # Warm up: compile and run every shape once on the initial parameters (pure functions).
        seen = set()
        for full_idx, tail_idx in epoch_indices:
            for fn, idx in ((epoch_jit, full_idx), (step_jit, tail_idx)):
                if idx is not None and (fn, idx.shape) not in seen:
                    seen.add((fn, idx.shape))
                    jax.block_until_ready(fn(params, lrs, train_x, train_y, idx))
        jax.block_until_ready(correct_jit(params, test_x, test_y))
        setup_ms = (time.perf_counter() - run_start) * 1e3

        epoch_ms, losses, accuracies = [], [], []
        for epoch, (full_idx, tail_idx) in enumerate(epoch_indices):
            sums = []
            start = time.perf_counter()
            if full_idx is not None:
                params, loss_sum, correct = epoch_jit(params, lrs, train_x, train_y, full_idx)
                sums.append((loss_sum, correct))
            if tail_idx is not None:
                params, loss_sum, correct = step_jit(params, lrs, train_x, train_y, tail_idx)
                sums.append((loss_sum, correct))
            jax.block_until_ready((params, sums))
            epoch_ms.append((time.perf_counter() - start) * 1e3)
            host = jax.device_get(sums)
            seen_rows = plans[0].samples_seen(plans[0].batches[epoch])
            losses.append(sum(np.asarray(loss, np.float64) for loss, _ in host) / seen_rows)
            accuracies.append(sum(np.asarray(c, np.float64) for _, c in host) / seen_rows)
        test_correct = np.asarray(jax.device_get(correct_jit(params, test_x, test_y)))
        host_params = jax.device_get(params)
        env = {**environment.host(), "gpu": device.device_kind, "driver": environment.driver_version(),
               "jax": jax.__version__, "jaxlib": _jaxlib_version(), **_jax_cuda_versions()}
        pack = {"models": count, "train_ms": float(sum(epoch_ms)), "how": "one vmapped lax.scan an epoch",
                "id": f"jax-vmap-{count}"}
        records = []
        for k, plan in enumerate(plans):
            epochs = [EpochRecord(plan.first_epoch + e + 1, epoch_ms[e], plan.batches[e],
                                  full=plan.batches[e] == plan.batches_per_epoch,
                                  train_loss=float(losses[e][k]), train_accuracy=float(accuracies[e][k]))
                      for e in range(num_epochs)]
            accuracy = float(test_correct[k]) / len(data.test_images)
            epochs[-1].test_accuracy = accuracy
            layers = [Layer(np.array(w[k]), None if b is None else np.array(b[k])) for w, b in host_params]
            record = RunRecord(
                stage="jax-vmap", kind="peer", config=plan.config, environment=env, epochs=epochs,
                setup_ms=setup_ms, total_ms=(time.perf_counter() - run_start) * 1e3, test_accuracy=accuracy,
                note=("bf16 operands, fp32 accumulation and weights" if precision == "bf16"
                      else "fp32, matmul precision highest") + f"; {count} models vmapped",
                precision=precision, data=data_summary(data), params=layers)
            record.pack = pack
            records.append(record)
        return records
    finally:
        jax.config.update("jax_default_matmul_precision", saved_precision)
