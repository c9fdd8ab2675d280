"""The float64 run of an MLP with the persistent grid kernel's bf16 roundings (persistent_wide.cu):
its products' operands rounded to bf16 where the kernel rounds them, everything else in float64.
What is left between the two is the kernel's fp32 sums (their order, their rounding) and the rare
bf16 rounding or ReLU mask that those flip."""

from __future__ import annotations

import numpy as np

from graphtrain import reference


def bf16(values) -> np.ndarray:
    """Values rounded to float32, then to bf16 (nearest, ties to even), as float64."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def bf16_reference_steps(cfg, data, steps: int, pixel_levels: int, epochs: int = 1):
    """(initial layers, layers after `epochs` epochs of their first `steps` steps, Σ loss, # correct)
    in float64 with the kernel's roundings: the images as bf16 (8-bit pixels as k, exact, with the
    1/pixel_levels unit applied to layer 1's sums and its update); each hidden layer's forward from
    bf16 weights and bf16 activations below (the first layer's from the images); the head, softmax
    and dlogits unrounded; dX from bf16 input gradients and bf16 weights; each update from bf16 input
    gradients and bf16 activations (the images for layer 1); the biases from unrounded gradients."""
    start = reference.init_params(cfg.dims, cfg.bias, cfg.seed, np.float64)
    layers = [layer.copy() for layer in start]
    loss_sum = correct = 0.0
    n = len(data.train_images)
    for epoch in range(epochs):
        order = reference.epoch_order(cfg.seed, epoch, n)
        for lo, hi in reference.batch_bounds(n, cfg.batch)[:steps]:
            images = data.train_images[order[lo:hi]].astype(np.float64)
            x, unit = (np.rint(images * pixel_levels), 1.0 / pixel_levels) if pixel_levels else (bf16(images), 1.0)
            labels = data.train_labels[order[lo:hi]]
            hidden, head = layers[:-1], layers[-1]
            acts, below = [], x
            for i, layer in enumerate(hidden):
                z = (below @ bf16(layer.w).T) * (unit if i == 0 else 1.0) + (layer.b if layer.b is not None else 0.0)
                acts.append(np.maximum(z, 0.0))
                below = bf16(acts[-1])
            logits = acts[-1] @ head.w.T + (head.b if head.b is not None else 0.0)
            loss, dz = reference.loss_and_dlogits(logits, labels)
            loss_sum, correct = loss_sum + loss * (hi - lo), correct + int((logits.argmax(axis=1) == labels).sum())
            dh = (dz @ head.w) * (acts[-1] > 0)
            head.w -= cfg.lr * (dz.T @ acts[-1])
            if head.b is not None:
                head.b -= cfg.lr * dz.sum(axis=0)
            for i in range(len(hidden) - 1, -1, -1):
                layer, grad = hidden[i], bf16(dh)
                if layer.b is not None:
                    layer.b -= cfg.lr * dh.sum(axis=0)
                if i == 0:
                    layer.w -= cfg.lr * unit * (grad.T @ x)
                else:
                    below = bf16(acts[i - 1])
                    dh = (grad @ bf16(layer.w)) * (below > 0)
                    layer.w -= cfg.lr * (grad.T @ below)
    return start, layers, loss_sum, correct
