"""Shared by the tests: the models every rung is checked on, the float64 reference run, the
float64 error measure, the float64 run's distance from ReLU's kink, and a scratch arena for GPU
tests."""

import numpy as np

from graphtrain import reference


# The models the rungs are checked on: name → TrainConfig fields. A new model is one line here, and
# every rung × model test (tests/test_oracle_gpu.py) takes it up.
MODELS = {
    "softmax-regression": dict(hidden=(), bias=True),
    "mlp": dict(hidden=(64, 64), bias=True),
    "mlp-no-bias": dict(hidden=(64,), bias=False),
    "mlp-three-layers": dict(hidden=(64, 64, 64), bias=True),
    "mlp-uneven": dict(hidden=(96, 40), bias=True),  # sizes off every tile, widest first
}


def reference_run(cfg, data, epochs: int = 1, num_batches: int | None = None):
    """The float64 reference of a run: (the initial layers, the layers after `epochs` epochs of
    their first `num_batches` steps each, all of them by default), in the run's own order."""
    start = reference.init_params(cfg.dims, cfg.bias, cfg.seed, np.float64)
    layers = [layer.copy() for layer in start]
    n = len(data.train_images)
    for epoch in range(epochs):
        order = reference.epoch_order(cfg.seed, epoch, n)
        for lo, hi in reference.batch_bounds(n, cfg.batch)[:num_batches]:
            reference.train_step(layers, data.train_images[order[lo:hi]].astype(np.float64),
                                 data.train_labels[order[lo:hi]], cfg.lr)
    return start, layers


def rel_err(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖, computed in float64."""
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref))


class Scratch:
    """Named device arrays in one arena, uploaded from the given host arrays: s["x"] is the
    device address, s.get("x") a host copy."""

    def __init__(self, stream, **arrays):
        from graphtrain.libs.memory import Arena

        self.stream, self.arena = stream, Arena()
        self.bufs = {name: self.arena.reserve(name, a.shape, a.dtype) for name, a in arrays.items()}
        self.arena.allocate()
        for name, a in arrays.items():
            self.bufs[name].upload(a, stream)

    def __getitem__(self, name):
        return self.bufs[name].ptr

    def get(self, name):
        return self.bufs[name].download(self.stream)

    def close(self):
        self.arena.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def kink_margin(cfg, data, num_batches: int) -> float:
    """The float64 run's closest approach to ReLU's kink: the least |pre-activation| of any hidden
    unit, row and step, relative to the size of its terms (Σ|input|·|weight| + |bias|)."""
    layers = reference.init_params(cfg.dims, cfg.bias, cfg.seed, np.float64)
    order = reference.epoch_order(cfg.seed, 0, len(data.train_images))
    closest = np.inf
    for lo, hi in reference.batch_bounds(len(data.train_images), cfg.batch)[:num_batches]:
        x = data.train_images[order[lo:hi]].astype(np.float64)
        a = x
        for layer in layers[:-1]:
            b = layer.b if layer.b is not None else 0.0
            z = a @ layer.w.T + b
            closest = min(closest, float(np.min(np.abs(z) / (np.abs(a) @ np.abs(layer.w.T) + np.abs(b) + 1e-300))))
            a = np.maximum(z, 0.0)
        reference.train_step(layers, x, data.train_labels[order[lo:hi]], cfg.lr)
    return closest


def recipe_reference_run(cfg, data, lrs):
    """The float64 reference of the first len(lrs) steps of epoch 0 under `cfg`'s optimizer, step k
    at rate lrs[k]: PyTorch's update rules written out here, one parameter at a time (torch.optim
    SGD with momentum/nesterov, Adam, AdamW; eps 1e-8). Returns (initial layers, layers after)."""
    start = reference.init_params(cfg.dims, cfg.bias, cfg.seed, np.float64)
    layers = [layer.copy() for layer in start]
    params = reference.parameters(layers)
    m = [np.zeros_like(p) for p in params]  # momentum's buffer, Adam's first moment
    v = [np.zeros_like(p) for p in params]  # Adam's second moment
    mu, (b1, b2), eps, wd = cfg.momentum, cfg.betas, 1e-8, cfg.weight_decay
    n = len(data.train_images)
    order = reference.epoch_order(cfg.seed, 0, n)
    for t, ((lo, hi), lr) in enumerate(zip(reference.batch_bounds(n, cfg.batch), lrs), 1):
        x = data.train_images[order[lo:hi]].astype(np.float64)
        acts = reference.forward(layers, x)
        _, dlogits = reference.loss_and_dlogits(acts[-1], data.train_labels[order[lo:hi]])
        grads = reference.parameters(reference.backward(layers, acts, dlogits))
        for p, g, m_i, v_i in zip(params, grads, m, v):
            if cfg.optimizer == "adamw":
                p -= lr * wd * p  # decoupled weight decay
            else:
                g = g + wd * p  # L2 in the gradient
            if cfg.optimizer == "sgd":
                p -= lr * g
            elif cfg.optimizer in ("momentum", "nesterov"):
                m_i[...] = mu * m_i + g
                p -= lr * (g + mu * m_i if cfg.optimizer == "nesterov" else m_i)
            else:
                m_i[...] = b1 * m_i + (1 - b1) * g
                v_i[...] = b2 * v_i + (1 - b2) * g * g
                m_hat, v_hat = m_i / (1 - b1 ** t), v_i / (1 - b2 ** t)
                p -= lr * m_hat / (np.sqrt(v_hat) + eps)
    return start, layers


def cosine_rates(lr: float, total: int, steps: int) -> list[float]:
    """PyTorch's CosineAnnealingLR to 0 over `total` steps, its first `steps` rates."""
    return [lr * (1 + np.cos(np.pi * k / total)) / 2 for k in range(steps)]
