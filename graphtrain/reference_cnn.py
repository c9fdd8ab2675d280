"""The convolutional model, its optimizers and learning-rate schedules in NumPy.

The tests' oracle (in float64) for the cuDNN convolutions, the pooling kernels, the optimizer
kernel and the schedules computed on the device, and the `numpy` row of `graphtrain speedrun`.

Model (`CnnSpec`): for each conv layer, c = conv(x, W) + b (cross-correlation, PyTorch's
Conv2d: W is (out, in, k, k)), p = max-pool(c) over pool×pool windows with stride pool, then
a = ReLU(p); the last conv output is flattened per sample (C·H·W, row-major like torch's
Flatten) and fed to the linear head of `graphtrain.reference` (ReLU between its layers).
Parameters are a list of arrays in a fixed order: conv W, conv b per conv layer, then W, b per
linear layer; the device keeps them in the same order in one span.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from graphtrain import reference

# ---- the model --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvLayer:
    out_channels: int
    kernel: int
    stride: int = 1
    padding: int = 0
    pool: int = 2  # max-pool window and stride; 1: none


@dataclass(frozen=True)
class CnnSpec:
    """A cnn over `channels`×`height`×`width` images: conv layers, then linear layers."""

    convs: tuple[ConvLayer, ...]
    hidden: tuple[int, ...]
    classes: int = 10
    channels: int = 1
    height: int = 28
    width: int = 28

    def conv_shapes(self) -> list[tuple[int, int, int, int, int, int]]:
        """Per conv layer (C_in, H_in, W_in, C_out, H_conv, W_conv); the pooled size is
        H_conv // pool × W_conv // pool."""
        shapes, c, h, w = [], self.channels, self.height, self.width
        for layer in self.convs:
            hc = (h + 2 * layer.padding - layer.kernel) // layer.stride + 1
            wc = (w + 2 * layer.padding - layer.kernel) // layer.stride + 1
            shapes.append((c, h, w, layer.out_channels, hc, wc))
            c, h, w = layer.out_channels, hc // layer.pool, wc // layer.pool
        return shapes

    def problems(self) -> list[str]:
        """Why this model cannot exist (empty: it can)."""
        out, c, h, w = [], self.channels, self.height, self.width
        for i, layer in enumerate(self.convs, 1):
            if min(layer.out_channels, layer.kernel, layer.stride, layer.pool) < 1 or layer.padding < 0:
                out.append(f"conv layer {i}: channels, kernel, stride and pool must be >= 1, padding >= 0")
                return out
            hc = (h + 2 * layer.padding - layer.kernel) // layer.stride + 1
            wc = (w + 2 * layer.padding - layer.kernel) // layer.stride + 1
            if hc < layer.pool or wc < layer.pool:
                out.append(f"conv layer {i} ({layer.out_channels}x{layer.kernel}) leaves a {max(hc, 0)}x{max(wc, 0)} "
                           f"image, smaller than its {layer.pool}x{layer.pool} pool")
                return out
            c, h, w = layer.out_channels, hc // layer.pool, wc // layer.pool
        return out

    @property
    def flat_features(self) -> int:
        c, _, _, co, hc, wc = self.conv_shapes()[-1]
        pool = self.convs[-1].pool
        return co * (hc // pool) * (wc // pool)

    @property
    def dims(self) -> tuple[int, ...]:
        """The linear head's chain, flattened features to classes."""
        return (self.flat_features, *self.hidden, self.classes)

    def param_shapes(self) -> list[tuple[int, ...]]:
        shapes = []
        for (cin, _, _, cout, _, _), layer in zip(self.conv_shapes(), self.convs):
            shapes += [(cout, cin, layer.kernel, layer.kernel), (cout,)]
        for fan_in, fan_out in zip(self.dims[:-1], self.dims[1:]):
            shapes += [(fan_out, fan_in), (fan_out,)]
        return shapes

    def fan_ins(self) -> list[int]:
        fans = [cin * layer.kernel ** 2 for (cin, *_), layer in zip(self.conv_shapes(), self.convs)]
        return fans + list(self.dims[:-1])


def init_params(spec: CnnSpec, seed: int, dtype=np.float64) -> list[np.ndarray]:
    """PyTorch's default Conv2d and Linear init, U(±1/√fan_in) for weights and biases (fan_in =
    C_in·k·k for a conv), layer by layer, weight then bias, from a seeded generator; drawn in
    float64 and rounded once to float32, so every row starts from the same point."""
    rng = np.random.default_rng([seed, 0])
    shapes = spec.param_shapes()
    params = []
    for layer, fan_in in enumerate(spec.fan_ins()):
        bound = 1.0 / math.sqrt(fan_in)
        for shape in shapes[2 * layer:2 * layer + 2]:
            params.append(rng.uniform(-bound, bound, size=shape).astype(np.float32).astype(dtype))
    return params


# ---- convolution and pooling -------------------------------------------------------------------


def _windows(x: np.ndarray, k: int, stride: int, padding: int) -> np.ndarray:
    """(N, C, H, W) -> (N, C, Ho, Wo, k, k) views of the zero-padded input's k×k windows."""
    if padding:
        x = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    n, c, h, w = x.shape
    ho, wo = (h - k) // stride + 1, (w - k) // stride + 1
    s = x.strides
    return np.lib.stride_tricks.as_strided(x, (n, c, ho, wo, k, k),
                                           (s[0], s[1], s[2] * stride, s[3] * stride, s[2], s[3]), writeable=False)


def conv_forward(x: np.ndarray, w: np.ndarray, stride: int = 1, padding: int = 0) -> np.ndarray:
    """y[n, o, i, j] = Σ_{c, u, v} x_pad[n, c, i·s + u, j·s + v] · w[o, c, u, v] (no bias)."""
    return np.einsum("ncijuv,ocuv->noij", _windows(x, w.shape[2], stride, padding), w, optimize=True)


def conv_backward_filter(x: np.ndarray, dy: np.ndarray, k: int, stride: int = 1, padding: int = 0) -> np.ndarray:
    """dW[o, c, u, v] = Σ_{n, i, j} dy[n, o, i, j] · x_pad[n, c, i·s + u, j·s + v]."""
    return np.einsum("ncijuv,noij->ocuv", _windows(x, k, stride, padding), dy, optimize=True)


def conv_backward_data(dy: np.ndarray, w: np.ndarray, x_shape, stride: int = 1, padding: int = 0) -> np.ndarray:
    """dx = the transpose of conv_forward applied to dy: each output's gradient spread back over
    the window it read, weighted by W; padding cropped off."""
    n, c, h, wd = x_shape
    k = w.shape[2]
    dxp = np.zeros((n, c, h + 2 * padding, wd + 2 * padding), dy.dtype)
    ho, wo = dy.shape[2], dy.shape[3]
    for u in range(k):
        for v in range(k):
            # contribution of tap (u, v): dx_pad[n, c, i·s + u, j·s + v] += Σ_o dy[n, o, i, j] w[o, c, u, v]
            dxp[:, :, u:u + stride * (ho - 1) + 1:stride, v:v + stride * (wo - 1) + 1:stride] += \
                np.einsum("noij,oc->ncij", dy, w[:, :, u, v], optimize=True)
    return dxp[:, :, padding:padding + h, padding:padding + wd]


def maxpool_forward(c: np.ndarray, pool: int) -> tuple[np.ndarray, np.ndarray]:
    """(pooled, argmax): the maximum of each pool×pool window (rows and columns past the last
    whole window are dropped) and the window position of its first maximum, row-major."""
    if pool == 1:
        return c.copy(), np.zeros(c.shape, np.int64)
    n, ch, h, w = c.shape
    ho, wo = h // pool, w // pool
    win = c[:, :, :ho * pool, :wo * pool].reshape(n, ch, ho, pool, wo, pool).transpose(0, 1, 2, 4, 3, 5)
    win = win.reshape(n, ch, ho, wo, pool * pool)
    arg = win.argmax(axis=-1)
    return np.take_along_axis(win, arg[..., None], -1)[..., 0], arg


def maxpool_backward(dp: np.ndarray, arg: np.ndarray, pool: int, conv_shape) -> np.ndarray:
    """dc: each pooled gradient routed to its window's (first) maximum, zero elsewhere."""
    if pool == 1:
        return dp.copy()
    n, ch, h, w = conv_shape
    ho, wo = dp.shape[2], dp.shape[3]
    onehot = (np.arange(pool * pool) == arg[..., None]) * dp[..., None]  # (n, ch, ho, wo, pool²)
    dc = np.zeros(conv_shape, dp.dtype)
    dc[:, :, :ho * pool, :wo * pool] = onehot.reshape(n, ch, ho, wo, pool, pool).transpose(
        0, 1, 2, 4, 3, 5).reshape(n, ch, ho * pool, wo * pool)
    return dc


# ---- forward, loss, backward -------------------------------------------------------------------


def forward(spec: CnnSpec, params: list[np.ndarray], x: np.ndarray) -> dict:
    """Every intermediate of one pass over x (N, C·H·W flattened or N×C×H×W): conv outputs `c`,
    pool argmaxes, activations `a` (a[0] the input), then the head's activations and logits."""
    a = [x.reshape(len(x), spec.channels, spec.height, spec.width)]
    convs, args = [], []
    for i, layer in enumerate(spec.convs):
        w, b = params[2 * i], params[2 * i + 1]
        c = conv_forward(a[-1], w, layer.stride, layer.padding) + b[None, :, None, None]
        p, arg = maxpool_forward(c, layer.pool)
        convs.append(c)
        args.append(arg)
        a.append(np.maximum(p, 0))
    h = [a[-1].reshape(len(x), -1)]
    head = params[2 * len(spec.convs):]
    for i in range(len(head) // 2):
        y = h[-1] @ head[2 * i].T + head[2 * i + 1]
        h.append(np.maximum(y, 0) if i < len(head) // 2 - 1 else y)
    return {"a": a, "c": convs, "arg": args, "h": h, "logits": h[-1]}


def loss_and_dlogits(logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy and dL/dlogits = (softmax − onehot) / rows: the MLP's (graphtrain.reference)."""
    loss, dlogits = reference.loss_and_dlogits(logits, labels)
    return float(loss), dlogits


def backward(spec: CnnSpec, params: list[np.ndarray], acts: dict, dlogits: np.ndarray) -> list[np.ndarray]:
    """Gradients of the mean loss, in the parameters' order."""
    nconv = len(spec.convs)
    head, h = params[2 * nconv:], acts["h"]
    grads: list[np.ndarray] = [None] * len(params)  # type: ignore[list-item]
    dy = dlogits
    for i in reversed(range(len(head) // 2)):
        grads[2 * nconv + 2 * i] = dy.T @ h[i]
        grads[2 * nconv + 2 * i + 1] = dy.sum(axis=0)
        dy = dy @ head[2 * i]
        if i > 0:
            dy = dy * (h[i] > 0)
    da = dy.reshape(acts["a"][-1].shape)
    for i in reversed(range(nconv)):
        layer, c, x = spec.convs[i], acts["c"][i], acts["a"][i]
        dp = da * (acts["a"][i + 1] > 0)  # through the ReLU
        dc = maxpool_backward(dp, acts["arg"][i], layer.pool, c.shape)
        grads[2 * i] = conv_backward_filter(x, dc, layer.kernel, layer.stride, layer.padding)
        grads[2 * i + 1] = dc.sum(axis=(0, 2, 3))
        if i > 0:
            da = conv_backward_data(dc, params[2 * i], x.shape, layer.stride, layer.padding)
    return grads


def logits(spec: CnnSpec, params: list[np.ndarray], images: np.ndarray, chunk: int = 1000) -> np.ndarray:
    return np.concatenate([forward(spec, params, images[s:s + chunk])["logits"] for s in range(0, len(images), chunk)])


def accuracy(spec: CnnSpec, params: list[np.ndarray], images: np.ndarray, labels: np.ndarray) -> float:
    return int((logits(spec, params, images).argmax(axis=1) == labels).sum()) / len(images)


# ---- learning-rate schedules ---------------------------------------------------------------------

SCHEDULES = ("constant", "warmup", "one-cycle", "cosine")


@dataclass(frozen=True)
class Schedule:
    """The learning rate of step k (0-based) of `total` steps, peak `lr`.

    constant   lr
    warmup     lr · min(1, (k + 1) / warmup_steps): a linear warm-up, then constant
    one-cycle  PyTorch's OneCycleLR (cosine annealing, two phases): from lr/div up to lr over the
               first pct·total − 1 steps, then down to lr/(div·final_div) at step total − 1
    cosine     PyTorch's CosineAnnealingLR to 0 over `total` steps: lr · (1 + cos(π k / total)) / 2
    """

    kind: str = "constant"
    lr: float = 0.1
    total: int = 1
    warmup_steps: int = 0
    pct: float = 0.3
    div: float = 25.0
    final_div: float = 1e4

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.kind!r}")

    @classmethod
    def of(cls, config, total: int) -> Schedule:
        """The schedule a TrainConfig asks for over a run of `total` steps."""
        return cls(config.schedule, config.lr, total, config.warmup)

    def at(self, k: int) -> float:
        lr, total = self.lr, self.total
        if self.kind == "constant":
            return lr
        if self.kind == "warmup":
            return lr * min(1.0, (k + 1) / max(self.warmup_steps, 1))
        if self.kind == "cosine":
            return lr * (1 + math.cos(math.pi * k / total)) / 2
        start, low = lr / self.div, lr / self.div / self.final_div
        end1, end2 = self.pct * total - 1, total - 1

        def anneal(a: float, b: float, pct: float) -> float:
            return b + (a - b) / 2 * (math.cos(math.pi * pct) + 1)

        if k <= end1:
            return anneal(start, lr, k / end1)
        return anneal(lr, low, (k - end1) / (end2 - end1))


# ---- optimizers -------------------------------------------------------------------------------------

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw")


@dataclass(frozen=True)
class Optimizer:
    """PyTorch's update rules (torch.optim.SGD with momentum/nesterov, Adam, AdamW), over every
    parameter alike. `momentum` is SGD's μ; `betas` and `eps` Adam's; `weight_decay` is L2 added to
    the gradient for sgd/momentum/nesterov/adam and decoupled (p ← p·(1 − lr·wd)) for adamw."""

    kind: str = "sgd"
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.kind!r}")

    @classmethod
    def of(cls, config) -> Optimizer:
        """The optimizer a TrainConfig asks for."""
        return cls(config.optimizer, config.momentum, config.betas, 1e-8, config.weight_decay)

    @property
    def slots(self) -> int:
        """State arrays per parameter: momentum 1 (the velocity), Adam 2 (m and v)."""
        return {"sgd": 0, "momentum": 1, "nesterov": 1, "adam": 2, "adamw": 2}[self.kind]

    def init_state(self, params: list[np.ndarray]) -> list[list[np.ndarray]]:
        return [[np.zeros_like(p) for p in params] for _ in range(self.slots)]

    def step(self, params: list[np.ndarray], grads: list[np.ndarray], state: list[list[np.ndarray]],
             t: int, lr: float) -> None:
        """Update in place; t is the 1-based step number (Adam's bias correction)."""
        wd = self.weight_decay
        for i, (p, g) in enumerate(zip(params, grads)):
            if self.kind == "adamw":
                p *= 1 - lr * wd
            elif wd:
                g = g + wd * p
            if self.kind == "sgd":
                p -= lr * g
            elif self.kind in ("momentum", "nesterov"):
                buf = state[0][i]
                buf *= self.momentum
                buf += g
                p -= lr * (g + self.momentum * buf if self.kind == "nesterov" else buf)
            else:
                b1, b2 = self.betas
                m, v = state[0][i], state[1][i]
                m *= b1
                m += (1 - b1) * g
                v *= b2
                v += (1 - b2) * g * g
                denom = np.sqrt(v) / math.sqrt(1 - b2 ** t) + self.eps
                p -= lr / (1 - b1 ** t) * m / denom


# ---- training -----------------------------------------------------------------------------------------


def train_step(spec: CnnSpec, params, x, labels, optimizer: Optimizer, state, t: int, lr: float):
    """One step in place (t 1-based). Returns the batch's mean loss before the update."""
    acts = forward(spec, params, x)
    loss, dlogits = loss_and_dlogits(acts["logits"], labels)
    optimizer.step(params, backward(spec, params, acts, dlogits), state, t, lr)
    return loss
