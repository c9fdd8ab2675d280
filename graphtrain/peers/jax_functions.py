"""The cnn and the recipe in JAX, as pure functions: graphtrain.reference_cnn's model, schedules
and optimizers written with jax.numpy, for the peers that train them in JAX to compose with jit,
scan and vmap.

    forward(spec, params, x)                  logits of x (N, C, H, W); params as the reference's
    cross_entropy(logits, y)                  mean loss over the batch
    rate(schedule, k, peak)                   Schedule.at(k) peaking at `peak`, a traced value
    init_slots(optimizer, params)             the optimizer's state, zeros
    update(optimizer, params, grads, slots, t, lr)   Optimizer.step's rules on a pytree
    train_step(loss_fn, optimizer, schedule, state, k, peak, x, y)   one step of the recipe

The model is the reference's: per conv layer c = conv(x, W) + b (cross-correlation, W (out, in,
k, k)), max-pool over pool×pool windows (the rows and columns past the last whole window
dropped), ReLU; flattened row-major per sample into the linear head (ReLU between its layers).
`params` is the reference's flat list: conv W, conv b per conv layer, then W, b per linear layer.

The optimizers and schedules serve any model whose parameters are a pytree: the jax-vmap peer
trains the MLPs with them too. `peak` is the schedule's peak rate as an argument rather than
`schedule.lr`, so that models differing only in their rate share one traced program. Products
and convolutions take the process-wide matmul precision (jax_default_matmul_precision).
"""

from __future__ import annotations

from graphtrain.reference_cnn import CnnSpec, Optimizer, Schedule


def forward(spec: CnnSpec, params, x):
    """Logits of x (N, C, H, W) under `spec`'s cnn with `params` (the reference's flat order)."""
    import jax
    import jax.numpy as jnp

    for i, layer in enumerate(spec.convs):
        w, b = params[2 * i], params[2 * i + 1]
        x = jax.lax.conv_general_dilated(x, w, (layer.stride,) * 2, [(layer.padding, layer.padding)] * 2,
                                         dimension_numbers=("NCHW", "OIHW", "NCHW"))
        x = x + b[None, :, None, None]
        if layer.pool > 1:
            window = (1, 1, layer.pool, layer.pool)
            x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, window, window, "VALID")
        x = jax.nn.relu(x)
    x = x.reshape(x.shape[0], -1)
    head = params[2 * len(spec.convs):]
    for j in range(len(head) // 2):
        x = x @ head[2 * j].T + head[2 * j + 1]
        if j < len(head) // 2 - 1:
            x = jax.nn.relu(x)
    return x


def cross_entropy(logits, y):
    """Mean cross-entropy of the rows' logits against labels y."""
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, y[:, None], axis=1).mean()


def rate(schedule: Schedule, k, peak):
    """The rate of step k (0-based, traced) under `schedule`'s kind and length, peaking at `peak`
    instead of schedule.lr: graphtrain.recipe.schedule_rate in jax.numpy, k in peak's type."""
    import jax.numpy as jnp

    from graphtrain.recipe import schedule_rate

    return schedule_rate(schedule, jnp.asarray(k).astype(jnp.result_type(peak)), peak, jnp)


def init_slots(optimizer: Optimizer, params) -> tuple:
    """The optimizer's state: `optimizer.slots` zero copies of the parameters' pytree (momentum's
    velocity; Adam's m and v)."""
    import jax
    import jax.numpy as jnp

    return tuple(jax.tree_util.tree_map(jnp.zeros_like, params) for _ in range(optimizer.slots))


def update(optimizer: Optimizer, params, grads, slots: tuple, t, lr):
    """(params, slots) after one step of Optimizer.step's rule; t the 1-based step number (float,
    Adam's bias correction), lr the step's rate."""
    import jax
    import jax.numpy as jnp

    kind, wd = optimizer.kind, optimizer.weight_decay
    b1, b2 = optimizer.betas

    def leaf(p, g, *state):
        if kind == "adamw":
            p = p * (1 - lr * wd)
        elif wd:
            g = g + wd * p
        if kind == "sgd":
            return (p - lr * g,)
        if kind in ("momentum", "nesterov"):
            buf = optimizer.momentum * state[0] + g
            return (p - lr * (g + optimizer.momentum * buf if kind == "nesterov" else buf), buf)
        m = b1 * state[0] + (1 - b1) * g
        v = b2 * state[1] + (1 - b2) * g * g
        denom = jnp.sqrt(v) / jnp.sqrt(1 - b2 ** t) + optimizer.eps
        return (p - lr / (1 - b1 ** t) * m / denom, m, v)

    leaves, tree = jax.tree_util.tree_flatten(params)
    others = [tree.flatten_up_to(x) for x in (grads, *slots)]
    new = [leaf(*parts) for parts in zip(leaves, *others)]
    unflat = [tree.unflatten([n[i] for n in new]) for i in range(1 + len(slots))]
    return unflat[0], tuple(unflat[1:])


def train_step(loss_fn, optimizer: Optimizer, schedule: Schedule, state, k, peak, x, y):
    """One step of the recipe on the batch (x, y), step k (0-based) of the run:
    state = (params, slots) -> (state, Σ loss over the batch, # rows classified right), the loss
    and the count from the logits before the update. `loss_fn(params, x, y)` = (mean loss, logits)."""
    import jax
    import jax.numpy as jnp

    params, slots = state
    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y)
    t = (jnp.asarray(k) + 1).astype(jnp.result_type(loss))
    params, slots = update(optimizer, params, grads, slots, t, rate(schedule, k, peak))
    return (params, slots), loss * y.shape[0], (jnp.argmax(logits, axis=1) == y).sum()
