"""The model in NumPy: init, sample order, forward, softmax cross-entropy, backward, SGD.

The other update rules and the learning-rate schedules (graphtrain.reference_cnn's `Optimizer`
and `Schedule`, the recipe) take the parameters as one list, `parameters(layers)`; `train_step`
takes any of them as its `update`.

This is the `numpy` stage's core (in float32) and the oracle every GPU stage is tested against
(in float64). Shapes follow torch.nn.Linear: a layer's weight `w` is (out, in), `y = x wᵀ + b`.
Every hidden layer is followed by a ReLU; the last layer's outputs are the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Layer:
    w: np.ndarray  # (out, in)
    b: np.ndarray | None  # (out,) or None when the model has no bias

    def copy(self, dtype=None) -> Layer:
        dtype = dtype or self.w.dtype
        return Layer(self.w.astype(dtype, copy=True), None if self.b is None else self.b.astype(dtype, copy=True))


def init_params(dims, bias: bool, seed: int, dtype=np.float32) -> list[Layer]:
    """PyTorch's default Linear init, U(±1/√fan_in) for weights and biases, from a seeded generator.

    Drawn in float64 and rounded once, so the float32 and float64 models start from the same point.
    """
    rng = np.random.default_rng([seed, 0])
    layers = []
    for fan_in, fan_out in zip(dims[:-1], dims[1:]):
        bound = 1.0 / np.sqrt(fan_in)
        w = rng.uniform(-bound, bound, size=(fan_out, fan_in)).astype(np.float32)
        b = rng.uniform(-bound, bound, size=fan_out).astype(np.float32) if bias else None
        layers.append(Layer(w, b).copy(dtype))
    return layers


def epoch_order(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """The sample order of one epoch: a seeded permutation, the same for every stage and peer."""
    return np.random.default_rng([seed, 1, epoch]).permutation(num_samples).astype(np.int32)


def batch_bounds(num_samples: int, batch: int):
    """(start, stop) of each batch; the tail batch is a real smaller batch, not padding."""
    return [(start, min(start + batch, num_samples)) for start in range(0, num_samples, batch)]


def forward(layers: list[Layer], x: np.ndarray) -> list[np.ndarray]:
    """Activations [x, h1, ..., logits]; hidden ones after their ReLU."""
    acts = [x]
    for i, layer in enumerate(layers):
        y = acts[-1] @ layer.w.T
        if layer.b is not None:
            y += layer.b
        if i < len(layers) - 1:
            np.maximum(y, 0, out=y)
        acts.append(y)
    return acts


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def loss_and_dlogits(logits: np.ndarray, labels: np.ndarray):
    """Mean cross-entropy over the batch and its gradient, dL/dlogits = (softmax − onehot) / rows."""
    rows = logits.shape[0]
    logp = log_softmax(logits)
    loss = -logp[np.arange(rows), labels].mean()
    dlogits = np.exp(logp)
    dlogits[np.arange(rows), labels] -= 1
    dlogits /= rows
    return loss, dlogits


def backward(layers: list[Layer], acts: list[np.ndarray], dlogits: np.ndarray) -> list[Layer]:
    """Gradients of the mean loss: dW = dyᵀ x, db = Σ_rows dy, dx = dy W masked by the ReLU."""
    grads = [None] * len(layers)
    dy = dlogits
    for i in reversed(range(len(layers))):
        x = acts[i]
        dw = dy.T @ x
        db = dy.sum(axis=0) if layers[i].b is not None else None
        grads[i] = Layer(dw, db)
        if i > 0:
            dy = (dy @ layers[i].w) * (x > 0)
    return grads


def parameters(layers: list[Layer]) -> list[np.ndarray]:
    """Every parameter array in a fixed order, W then b layer by layer (no b without a bias):
    the order the optimizers walk, the same for a model's layers and their gradients."""
    return [array for layer in layers for array in (layer.w, layer.b) if array is not None]


def sgd(layers: list[Layer], grads: list[Layer], lr: float) -> None:
    for layer, grad in zip(layers, grads):
        layer.w -= lr * grad.w
        if layer.b is not None:
            layer.b -= lr * grad.b


def train_step(layers: list[Layer], x: np.ndarray, labels: np.ndarray, lr: float, update=sgd):
    """One step in place: `update(layers, grads, lr)` (SGD unless given). Returns (summed loss,
    correct predictions) of the batch before the update."""
    acts = forward(layers, x)
    loss, dlogits = loss_and_dlogits(acts[-1], labels)
    update(layers, backward(layers, acts, dlogits), lr)
    correct = int((acts[-1].argmax(axis=1) == labels).sum())
    return float(loss) * x.shape[0], correct


def logits(layers: list[Layer], images: np.ndarray, chunk: int = 2000) -> np.ndarray:
    """The logits of many samples, `chunk` rows per forward pass (the numpy stage's test pass)."""
    return np.concatenate([forward(layers, images[start:start + chunk])[-1]
                           for start in range(0, len(images), chunk)])


def accuracy(layers: list[Layer], images: np.ndarray, labels: np.ndarray) -> float:
    return int((logits(layers, images).argmax(axis=1) == labels).sum()) / len(images)
