"""The cnn's steps in float64 as persistent_cnn.cu computes them: reference_cnn's, with the roundings
of its one-pass TF32 products (test_persistent_cnn_emulated.py, test_persistent_cnn_gpu.py)."""

from __future__ import annotations

import numpy as np

from graphtrain import reference_cnn
from graphtrain.reference_cnn import CnnSpec


def tf32(x: np.ndarray) -> np.ndarray:
    """x rounded to TF32 (10 mantissa bits) to nearest, ties away from zero: cvt.rna.tf32.f32, as the
    kernel rounds an operand of its one-pass products."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


def windows(c: np.ndarray) -> np.ndarray:
    """The 2×2 pool windows of conv outputs c (N, C, H, W): (N, C, H/2, W/2, 4), row-major in a window."""
    n, ch, h, w = c.shape
    return c.reshape(n, ch, h // 2, 2, w // 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(n, ch, h // 2, w // 2, 4)


def near_ties(spec: CnnSpec, params, x, gap: float) -> list[tuple[int, int]]:
    """The pool windows (conv layer, flat window index) whose largest output passes the ReLU and
    lies within `gap` of the next largest: where fp32 sums may pick the other maximum."""
    acts, out = reference_cnn.forward(spec, params, x), []
    for layer, c in enumerate(acts["c"]):
        top = np.sort(windows(c), axis=-1)[..., 2:].reshape(-1, 2)
        out += [(layer, int(i)) for i in np.flatnonzero((top[:, 1] - top[:, 0] < gap) & (top[:, 1] > 0))]
    return out


def float64_step(spec: CnnSpec, params, x, labels, passes: int, runner_up: tuple[int, int] | None = None):
    """One step's (gradients, mean loss, correct count) in float64: reference_cnn's, with fc1's three
    products (h, dW1, da2) from TF32-rounded operands where the kernel takes one pass. `runner_up`: a
    window of near_ties whose gradient goes to its second largest output instead (its forward value
    the same within the tie)."""
    rounded = tf32 if passes == 1 else (lambda v: v)
    acts = reference_cnn.forward(spec, params, x)
    if runner_up is not None:
        layer, index = runner_up
        arg = acts["arg"][layer].reshape(-1)
        top = np.argsort(windows(acts["c"][layer]), axis=-1, kind="stable")[..., 2:].reshape(-1, 2)[index]
        arg[index] = top[0] if top[1] == arg[index] else top[1]
    a2, w1, b1, w2, b2 = acts["h"][0], *params[4:8]
    h = np.maximum(rounded(a2) @ rounded(w1).T + b1, 0)
    logits = h @ w2.T + b2
    loss, dz = reference_cnn.loss_and_dlogits(logits, labels)
    dh = (dz @ w2) * (h > 0)
    grads = [None] * 4 + [rounded(dh).T @ rounded(a2), dh.sum(axis=0), dz.T @ h, dz.sum(axis=0)]
    da = (rounded(dh) @ rounded(w1)).reshape(acts["a"][-1].shape)
    for i in reversed(range(2)):  # reference_cnn.backward's conv layers
        layer, c, below = spec.convs[i], acts["c"][i], acts["a"][i]
        dc = reference_cnn.maxpool_backward(da * (acts["a"][i + 1] > 0), acts["arg"][i], layer.pool, c.shape)
        grads[2 * i] = reference_cnn.conv_backward_filter(below, dc, layer.kernel)
        grads[2 * i + 1] = dc.sum(axis=(0, 2, 3))
        if i > 0:
            da = reference_cnn.conv_backward_data(dc, params[2 * i], below.shape)
    return grads, loss, int((logits.argmax(axis=1) == labels).sum())
