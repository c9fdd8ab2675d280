"""Shared by the tests: the float64 error measure, the float64 run's distance from ReLU's kink,
and a scratch arena for GPU tests."""

import numpy as np

from graphtrain import reference


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
