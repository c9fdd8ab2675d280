"""The cnn's steps in float64 as persistent_cnn.cu computes them: reference_cnn's, with the roundings
of its one-pass TF32 products, the convolutions' forward, fc1's, and conv 2's input and weight
gradients (test_persistent_cnn_emulated.py, test_persistent_cnn_gpu.py)."""

from __future__ import annotations

import numpy as np

from graphtrain import reference_cnn
from graphtrain.reference_cnn import CnnSpec


def tf32(x: np.ndarray) -> np.ndarray:
    """x rounded to TF32 (10 mantissa bits) to nearest, ties away from zero: cvt.rna.tf32.f32, as the
    kernel rounds an operand of its one-pass products."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


def forward(spec: CnnSpec, params, x, passes: int) -> dict:
    """reference_cnn.forward's activations, with both convolutions' operands (the images and conv 1's
    weights, a1 and conv 2's weights) rounded to TF32 where the kernel takes one pass; the bias added
    to the sums and the pools as reference_cnn's."""
    if passes != 1:
        return reference_cnn.forward(spec, params, x)
    a, convs, args = [x.reshape(len(x), spec.channels, spec.height, spec.width)], [], []
    for i, layer in enumerate(spec.convs):
        w, b = params[2 * i], params[2 * i + 1]
        c = reference_cnn.conv_forward(tf32(a[-1]), tf32(w), layer.stride, layer.padding) + b[None, :, None, None]
        p, arg = reference_cnn.maxpool_forward(c, layer.pool)
        convs.append(c)
        args.append(arg)
        a.append(np.maximum(p, 0))
    return {"a": a, "c": convs, "arg": args, "h": [a[-1].reshape(len(x), -1)]}


def float64_step(spec: CnnSpec, params, x, labels, passes: int):
    """One step's (gradients, mean loss, correct count) in float64: reference_cnn's, with the
    convolutions' forward products, fc1's three (h, dW1, da2) and conv 2's input and weight gradients
    from TF32-rounded operands where the kernel takes one pass (conv 1's weight gradient and the bias
    gradients in fp32 either way)."""
    rounded = tf32 if passes == 1 else (lambda v: v)
    acts = forward(spec, params, x, passes)
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
        # conv 2's weight gradient from TF32 operands in one pass (phase 5's mma); conv 1's, the bias sums fp32
        filter_operand = rounded if i > 0 else (lambda v: v)
        grads[2 * i] = reference_cnn.conv_backward_filter(filter_operand(below), filter_operand(dc), layer.kernel)
        grads[2 * i + 1] = dc.sum(axis=(0, 2, 3))
        if i > 0:  # conv 2's input gradient: TF32 operands in one pass (phase 5's mma)
            da = reference_cnn.conv_backward_data(rounded(dc), rounded(params[2 * i]), below.shape)
    return grads, loss, int((logits.argmax(axis=1) == labels).sum())
