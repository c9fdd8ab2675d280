"""`jax-vmap`: a sweep's models as one JAX program, the packed sweep's peer.

The JAX answer to many small models: one model's epoch (a `lax.scan` over its full batches, then
its tail batch) under `jax.vmap` over the models' parameters, optimizer state, peak learning
rates and sample orders, jitted: one dispatch an epoch for all K models. Each model trains its
own plan: its initial weights and its seed's sample order, gathered per model from the one copy
of the images on the device. The step is the recipe's (graphtrain.peers.jax_functions: the optimizer
and the schedule of the config, its lr the peak), on either model:

    MLP  graphtrain.peers.jax_scan's layers; fp32 ("highest" matmul precision, no TF32), or bf16
         operands with fp32 accumulation under `--precision bf16`
    cnn  graphtrain.peers.jax_functions's, on the images normalised as the cnn rungs train them; TF32
         convolutions and products ("tensorfloat32"), or fp32 ("highest") under `--precision fp32`

Timing as `jax-scan`: perf_counter from an epoch's dispatch to `block_until_ready`; every model
of the pack shares the epoch's time. Before it (the setup): the data and the plans put on the
device, XLA's compilation of every program the run calls (timed apart, ahead of time: `lower` and
`compile`), and one warm-up call of each on the initial state (the programs are pure, so the run
starts from the same state). The test accuracy is counted after the last epoch, in chunks of the
test set small enough that K models' widest activations stay near EVAL_FLOATS floats.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from graphtrain.errors import ModelUnsupported
from graphtrain.kernels import ceil_div  # the package's one ⌈a / b⌉
from graphtrain.packed import check_pack
from graphtrain.plan import RunPlan
from graphtrain.record import EpochRecord, RunRecord, data_summary
from graphtrain.reference import Layer

EVAL_FLOATS = 1 << 28  # the widest layer's activations of one test chunk over every model: 1 GiB of fp32
MATMUL_PRECISION = {"fp32": "highest", "bf16": "highest", "tf32": "tensorfloat32"}


@dataclass
class PackModel:
    """What differs between the MLP and the cnn in a pack: the inputs, the model, its precision."""

    precision: str  # what the record states: "fp32", "tf32" or "bf16"
    note: str
    train_x: np.ndarray  # the model's inputs, float32
    test_x: np.ndarray
    params: list  # the pytree of the parameters, every leaf stacked over the models (models first)
    forward: Callable  # forward(params, x) -> logits, one model's
    layers: Callable  # layers(params) -> one model's parameters (host arrays) as graphtrain Layers
    widest: int  # floats per sample of the widest activation (the test chunks' size)


def pick_precision(precisions: tuple[str, ...], asked: str | None, model: str) -> str:
    """`asked` (None: the first of `precisions`), or ModelUnsupported saying what the model trains in."""
    precision = asked or precisions[0]
    if precision not in precisions:
        raise ModelUnsupported(f"jax-vmap trains the {model} in {' or '.join(precisions)}, "
                               f"not --precision {precision}")
    return precision


def stacked(trees: list):
    """The models' parameter pytrees as one, every leaf stacked over the models (models first)."""
    import jax

    return jax.tree_util.tree_map(lambda *leaves: np.stack(leaves), *trees)


def mlp_model(plans: list[RunPlan], data) -> PackModel:
    """The MLP of graphtrain.peers.jax_scan: params a list of (w, b or None), on the raw images."""
    from graphtrain.peers.jax_scan import forward, make_product

    cfg = plans[0].config
    precision = pick_precision(("fp32", "bf16"), cfg.precision, "MLP")
    product = make_product(precision)  # bf16: bf16 operands, fp32 accumulation
    params = stacked([[(layer.w, layer.b) for layer in plan.initial] for plan in plans])
    note = "bf16 operands, fp32 accumulation and weights" if precision == "bf16" else "fp32, matmul precision highest"
    return PackModel(precision, note, data.train_images, data.test_images, params,
                     lambda p, x: forward(p, x, product), lambda p: [Layer(w, b) for w, b in p], max(cfg.dims))


def cnn_model(plans: list[RunPlan], data) -> PackModel:
    """The cnn of graphtrain.peers.jax_functions: params the reference's flat list, on the images
    normalised and shaped (N, C, H, W), as the cnn rungs train them."""
    from graphtrain.config import cnn_spec
    from graphtrain.peers import jax_functions as jax_cnn
    from graphtrain.recipe import normalise

    cfg = plans[0].config
    precision = pick_precision(("tf32", "fp32"), cfg.precision, "cnn")
    spec = cnn_spec(cfg)
    shape = (-1, spec.channels, spec.height, spec.width)
    params = stacked([[a for layer in plan.initial for a in (layer.w, layer.b)] for plan in plans])
    channels, height, width = spec.channels, spec.height, spec.width
    widest = max([channels * height * width, *(co * hc * wc for _, _, _, co, hc, wc in spec.conv_shapes()),
                  *spec.dims])
    note = "TF32 convolutions and products" if precision == "tf32" else "fp32, matmul precision highest"
    return PackModel(precision, note, normalise(data.train_images).reshape(shape),
                     normalise(data.test_images).reshape(shape), params,
                     lambda p, x: jax_cnn.forward(spec, p, x),
                     lambda p: [Layer(p[i], p[i + 1]) for i in range(0, len(p), 2)], widest)


def pack_model(plans: list[RunPlan], data) -> PackModel:
    """The pack's model, by the plans' model kind."""
    return cnn_model(plans, data) if plans[0].config.model == "cnn" else mlp_model(plans, data)


def recipe_step(model: PackModel, recipe):
    """One model's step of `recipe` (its optimizer and schedule): step(state, k, peak, x, y) ->
    (state, Σ loss over the batch, # correct), state = (params, optimizer slots)."""
    from graphtrain.peers import jax_functions as jax_cnn

    def loss_fn(params, x, y):
        logits = model.forward(params, x)
        return jax_cnn.cross_entropy(logits, y), logits

    def step(state, k, peak, x, y):
        return jax_cnn.train_step(loss_fn, recipe.optimizer, recipe.schedule, state, k, peak, x, y)

    return step


def epoch_indices(plans: list[RunPlan], epoch: int):
    """Epoch `epoch`'s batches as index arrays, model k's rows from its own sample order: the full
    batches (models, batches, batch) for the scan, the tail batch (models, rows) apart; None
    where the epoch has none."""
    first, batch = plans[0], plans[0].config.batch
    used = first.epoch_bounds(epoch)
    full = sum(1 for lo, hi in used if hi - lo == batch)
    orders = np.stack([plan.orders[epoch] for plan in plans])  # (models, samples)
    full_idx = orders[:, :full * batch].reshape(len(plans), full, batch) if full else None
    tail = [(lo, hi) for lo, hi in used if hi - lo < batch]
    tail_idx = np.ascontiguousarray(orders[:, tail[0][0]:tail[0][1]]) if tail else None
    return full_idx, tail_idx


def model_epoch(step):
    """One model's epoch from its step(state, k, peak, x, y) -> (state, Σ loss, # correct):
    epoch(state, peak, first_step, full_idx, tail_idx, train_x, train_y) -> (state, Σ loss, # correct),
    the full batches (full_idx (batches, batch), or None) folded by one lax.scan, then the tail
    batch (tail_idx (rows,), or None); k counts the run's steps from first_step."""
    import jax
    import jax.numpy as jnp

    def epoch(state, peak, first_step, full_idx, tail_idx, train_x, train_y):
        def body(carry, idx):
            state, k, loss_sum, correct = carry
            state, loss, batch_correct = step(state, k, peak, train_x[idx], train_y[idx])
            return (state, k + 1, loss_sum + loss, correct + batch_correct), None

        carry = (state, first_step, jnp.float32(0), jnp.int32(0))
        if full_idx is not None:
            carry = jax.lax.scan(body, carry, full_idx)[0]
        if tail_idx is not None:
            carry = body(carry, tail_idx)[0]
        state, _, loss_sum, correct = carry
        return state, loss_sum, correct

    return epoch


def model_correct(forward):
    """One model's count of the test rows classified right, over the chunks of (chunks, rows, …)
    arrays; padding rows have label -1, which no argmax equals."""
    import jax
    import jax.numpy as jnp

    def correct(params, test_x, test_y):
        def chunk(xy):
            x, y = xy
            return (jnp.argmax(forward(params, x), axis=1) == y).sum()

        return jax.lax.map(chunk, (test_x, test_y)).sum()

    return correct


def chunked_test_set(test_x: np.ndarray, test_y: np.ndarray, rows: int):
    """The test set as (chunks, rows, …) arrays, the last chunk padded with zero images labelled -1."""
    chunks = ceil_div(len(test_x), rows)
    pad = chunks * rows - len(test_x)
    x = np.concatenate([test_x, np.zeros((pad, *test_x.shape[1:]), test_x.dtype)])
    y = np.concatenate([test_y.astype(np.int32), np.full(pad, -1, np.int32)])
    return x.reshape(chunks, rows, *test_x.shape[1:]), y.reshape(chunks, rows)


def shape_of(full_idx, tail_idx) -> tuple:
    """An epoch's shape, which its program is compiled for."""
    return tuple(None if idx is None else idx.shape for idx in (full_idx, tail_idx))


def train_vmapped(plans: list[RunPlan], data, device=None) -> list[RunRecord]:
    """Train every plan (they differ only in lr and seed) as one vmapped program on `device` (a
    jax device; default: the GPU, as import_jax finds it); a record each, in order."""
    from graphtrain import environment
    from graphtrain.peers import jax_functions as jax_cnn
    from graphtrain.peers.jax_scan import _jax_cuda_versions, _jaxlib_version, import_jax
    from graphtrain.recipe import recipe_of

    check_pack(plans)
    if device is None:
        jax, device = import_jax()
    else:
        import jax

    run_start = time.perf_counter()
    first, count = plans[0], len(plans)
    cfg, num_epochs = first.config, first.num_epochs
    model = pack_model(plans, data)
    recipe = recipe_of(cfg, sum(first.batches), num_epochs)  # the optimizer, the schedule's kind and length
    saved_precision = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", MATMUL_PRECISION[model.precision])
    try:
        def put(array):
            return None if array is None else jax.device_put(array, device)

        train_x, train_y = put(model.train_x), put(data.train_labels.astype(np.int32))
        chunk_rows = max(1, min(len(model.test_x), EVAL_FLOATS // (count * model.widest)))
        test_x, test_y = (put(a) for a in chunked_test_set(model.test_x, data.test_labels, chunk_rows))
        params = put(model.params)
        state = (params, jax_cnn.init_slots(recipe.optimizer, params))
        peaks = put(np.array([plan.config.lr for plan in plans], np.float32))
        first_steps = np.cumsum((0, *first.batches[:-1])).astype(np.int32)
        epochs = [(put(np.int32(first_steps[e])), *(put(i) for i in epoch_indices(plans, e)))
                  for e in range(num_epochs)]

        # Compile ahead of time every program the run calls (one per epoch shape), then warm each up.
        compile_start = time.perf_counter()
        epoch_jit = jax.jit(jax.vmap(model_epoch(recipe_step(model, recipe)), in_axes=(0, 0, None, 0, 0, None, None)))
        correct_jit = jax.jit(jax.vmap(model_correct(model.forward), in_axes=(0, None, None)))
        programs = {}  # epoch shape -> (compiled program, the first epoch of that shape)
        for first_step, full_idx, tail_idx in epochs:
            if shape_of(full_idx, tail_idx) not in programs:
                program = epoch_jit.lower(state, peaks, first_step, full_idx, tail_idx, train_x, train_y).compile()
                programs[shape_of(full_idx, tail_idx)] = program, (first_step, full_idx, tail_idx)
        correct_program = correct_jit.lower(params, test_x, test_y).compile()
        compile_ms = (time.perf_counter() - compile_start) * 1e3
        for program, (first_step, full_idx, tail_idx) in programs.values():
            jax.block_until_ready(program(state, peaks, first_step, full_idx, tail_idx, train_x, train_y))
        jax.block_until_ready(correct_program(params, test_x, test_y))
        setup_ms = (time.perf_counter() - run_start) * 1e3

        epoch_ms, losses, accuracies = [], [], []
        for epoch, (first_step, full_idx, tail_idx) in enumerate(epochs):
            program = programs[shape_of(full_idx, tail_idx)][0]
            start = time.perf_counter()
            state, loss_sum, correct = program(state, peaks, first_step, full_idx, tail_idx, train_x, train_y)
            jax.block_until_ready((state, loss_sum, correct))
            epoch_ms.append((time.perf_counter() - start) * 1e3)
            seen = first.samples_seen(first.batches[epoch])
            losses.append(np.asarray(jax.device_get(loss_sum), np.float64) / seen)
            accuracies.append(np.asarray(jax.device_get(correct), np.float64) / seen)
        test_correct = np.asarray(jax.device_get(correct_program(state[0], test_x, test_y)))
        host_params = jax.device_get(state[0])
    finally:
        jax.config.update("jax_default_matmul_precision", saved_precision)

    env = {**environment.host(), "jax": jax.__version__, "jaxlib": _jaxlib_version()}
    if device.platform != "cpu":
        env.update({"gpu": device.device_kind, "driver": environment.driver_version(), **_jax_cuda_versions()})
    else:
        env["jax_device"] = device.device_kind
    train_ms = float(sum(epoch_ms))
    pack = {"models": count, "train_ms": train_ms, "setup_ms": setup_ms, "compile_ms": compile_ms,
            "how": (f"one jit: vmap over the models of a lax.scan over an epoch's steps; set up in "
                    f"{setup_ms:,.0f} ms, {compile_ms:,.0f} of them XLA's compile"),
            "id": f"jax-vmap-{cfg.layers_text}-{cfg.lr:g}-{cfg.seed}-{count}"}
    records = []
    for k, plan in enumerate(plans):
        epoch_records = [EpochRecord(plan.first_epoch + e + 1, epoch_ms[e], plan.batches[e],
                                     full=plan.batches[e] == plan.batches_per_epoch,
                                     train_loss=float(losses[e][k]), train_accuracy=float(accuracies[e][k]))
                         for e in range(num_epochs)]
        accuracy = float(test_correct[k]) / len(data.test_images)
        epoch_records[-1].test_accuracy = accuracy
        record = RunRecord(
            stage="jax-vmap", kind="peer", config=plan.config, environment=env, epochs=epoch_records,
            setup_ms=setup_ms, total_ms=(time.perf_counter() - run_start) * 1e3, test_accuracy=accuracy,
            note=f"{model.note}; {count} models vmapped", precision=model.precision, data=data_summary(data),
            params=model.layers(jax.tree_util.tree_map(lambda a: np.array(a[k]), host_params)))
        record.pack = pack
        records.append(record)
    return records
