"""Shared by the tests: the float64 error measure and a scratch arena for GPU tests."""

import numpy as np


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
