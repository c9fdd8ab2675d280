"""`jax-scan`: a whole epoch as one jitted JAX program, the steps folded by `lax.scan`.

The parameters are a pytree (a list of (w, b) per layer), SGD is a `tree_map`, and the full
batches of an epoch run as one `lax.scan` over their index rows: one dispatch per epoch, with
XLA free to fuse across the step. The tail batch is a real smaller batch, run by a separately
jitted step. Matmuls use fp32 ("highest" precision, so no TF32).

Timing: JAX dispatches asynchronously, so an epoch is timed with perf_counter from the dispatch
to `block_until_ready` on its results; the GPU is idle when it starts.

JAX grabs 75% of the GPU's memory when it starts unless told otherwise; graphtrain sets
XLA_PYTHON_CLIENT_PREALLOCATE=false (unless already set) before importing it, so the stages
and peers that run after it in the same process still find memory.
"""

from __future__ import annotations

import os
import time

import numpy as np

from graphtrain.environment import driver_version
from graphtrain.errors import INSTALL_HINTS
from graphtrain.peers import PeerUnavailable
from graphtrain.peers.common import Peer
from graphtrain.reference import Layer
from graphtrain.stages.base import EpochResult


def import_jax():
    """jax, with a GPU backend; PeerUnavailable saying what is missing otherwise."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
    except ImportError:
        raise PeerUnavailable(f"jax is not installed ({INSTALL_HINTS['jax']})") from None
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        raise PeerUnavailable("no CUDA GPU visible to jax (is its CUDA plugin installed?)")
    return jax, gpus[0]


def forward(params, x, operand=None):
    """Logits; `params` is a list of (w, b or None), w shaped (out, in) like the reference.
    `operand` (jnp.bfloat16): the products read both sides in that type and accumulate in fp32."""
    import jax
    import jax.numpy as jnp

    for i, (w, b) in enumerate(params):
        if operand is None:
            x = x @ w.T
        else:
            x = jnp.dot(x.astype(operand), w.T.astype(operand), preferred_element_type=jnp.float32)
        if b is not None:
            x = x + b
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return x


class JaxScanPeer(Peer):
    name = "jax-scan"
    summary = "JAX: one jitted lax.scan per epoch over the full batches, fp32"
    note = "fp32, matmul precision highest"
    operand = None  # the products' operand type (None: the parameters' own, fp32)

    @classmethod
    def check_available(cls) -> int | None:
        import_jax()
        return None

    def setup(self) -> None:
        jax, device = import_jax()
        import jax.numpy as jnp

        self.jax = jax
        cfg, data = self.config, self.data
        # Process-wide; close() puts it back.
        self.saved_precision = jax.config.jax_default_matmul_precision
        jax.config.update("jax_default_matmul_precision", "highest")
        self.device = device

        def put(array):
            return jax.device_put(array, device)

        plan = self.plan
        self.train_x, self.train_y = put(data.train_images), put(data.train_labels.astype(np.int32))
        self.test_x, self.test_y = put(data.test_images), put(data.test_labels.astype(np.int32))
        self.params = put([(layer.w, layer.b) for layer in plan.initial])

        # Each epoch's batches as index arrays on the device: the full batches as rows of a
        # (batches, batch) matrix for the scan, the tail batch (if the epoch has it) apart.
        self.epoch_indices = []
        for epoch, order in enumerate(plan.orders):
            used = plan.epoch_bounds(epoch)
            full = sum(1 for lo, hi in used if hi - lo == cfg.batch)
            full_idx = put(order[:full * cfg.batch].reshape(full, cfg.batch)) if full else None
            tail = [(lo, hi) for lo, hi in used if hi - lo < cfg.batch]
            tail_idx = put(order[tail[0][0]:tail[0][1]]) if tail else None
            self.epoch_indices.append((full_idx, tail_idx))

        lr = np.float32(cfg.lr)

        def loss_fn(params, x, y):
            logits = forward(params, x, self.operand)
            logp = jax.nn.log_softmax(logits)
            loss = -jnp.take_along_axis(logp, y[:, None], axis=1).mean()
            return loss, logits

        def step(params, train_x, train_y, idx):
            """One SGD step on samples idx; returns (params, Σ loss over the batch, # correct)."""
            x, y = train_x[idx], train_y[idx]
            (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y)
            params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
            correct = (jnp.argmax(logits, axis=1) == y).sum()
            return params, loss * idx.shape[0], correct

        def epoch_fn(params, train_x, train_y, idx_rows):
            def body(carry, idx):
                params, loss_sum, correct = carry
                params, loss, batch_correct = step(params, train_x, train_y, idx)
                return (params, loss_sum + loss, correct + batch_correct), None

            start = (params, jnp.float32(0), jnp.int32(0))
            (params, loss_sum, correct), _ = jax.lax.scan(body, start, idx_rows)
            return params, loss_sum, correct

        def correct_fn(params, x, y):
            return (jnp.argmax(forward(params, x, self.operand), axis=1) == y).sum()

        self.epoch_fn = jax.jit(epoch_fn)
        self.step_fn = jax.jit(step)
        self.correct_fn = jax.jit(correct_fn)

        # Warm up: compile and run once every shape the run will use, on the initial parameters.
        # The functions are pure, so the results are simply dropped; the run starts from the
        # same parameters.
        seen = set()
        for full_idx, tail_idx in self.epoch_indices:
            for fn, idx in ((self.epoch_fn, full_idx), (self.step_fn, tail_idx)):
                if idx is not None and (fn, idx.shape) not in seen:
                    seen.add((fn, idx.shape))
                    jax.block_until_ready(fn(self.params, self.train_x, self.train_y, idx))
        jax.block_until_ready(self.correct_fn(self.params, self.test_x, self.test_y))

    def train_epoch(self, epoch: int, num_batches: int, measure: bool) -> EpochResult:
        jax = self.jax
        full_idx, tail_idx = self.epoch_indices[epoch]
        params, sums = self.params, []
        start = time.perf_counter()
        if full_idx is not None:
            params, loss_sum, correct = self.epoch_fn(params, self.train_x, self.train_y, full_idx)
            sums.append((loss_sum, correct))
        if tail_idx is not None:
            params, loss_sum, correct = self.step_fn(params, self.train_x, self.train_y, tail_idx)
            sums.append((loss_sum, correct))
        jax.block_until_ready((params, sums))
        ms = (time.perf_counter() - start) * 1e3
        self.params = params
        host = jax.device_get(sums)  # one read per epoch
        seen = sum(int(idx.size) for idx in (full_idx, tail_idx) if idx is not None)
        loss = sum(float(batch_loss) for batch_loss, _ in host) / seen
        accuracy = sum(int(c) for _, c in host) / seen
        return EpochResult(ms, loss, accuracy)

    def test_accuracy(self) -> float:
        return int(self.correct_fn(self.params, self.test_x, self.test_y)) / len(self.data.test_images)

    def weights(self) -> list[Layer]:
        host = self.jax.device_get(self.params)
        return [Layer(np.array(w), None if b is None else np.array(b)) for w, b in host]

    def environment(self) -> dict:
        jax = self.jax
        env = {"gpu": self.device.device_kind, "driver": driver_version(), "jax": jax.__version__,
               "jaxlib": _jaxlib_version()}
        env.update(_jax_cuda_versions())
        return env

    def close(self) -> None:
        jax = getattr(self, "jax", None)
        if jax is None:
            return
        if hasattr(self, "saved_precision"):
            jax.config.update("jax_default_matmul_precision", self.saved_precision)
        for name in ("train_x", "train_y", "test_x", "test_y", "params", "epoch_indices"):
            if hasattr(self, name):
                setattr(self, name, None)


def _jaxlib_version() -> str | None:
    try:
        import jaxlib

        return getattr(jaxlib, "__version__", None) or jaxlib.version.__version__
    except (ImportError, AttributeError):
        return None


def _jax_cuda_versions() -> dict:
    """CUDA runtime and cuDNN versions jaxlib was loaded with; internal API, so best effort."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return {}
    if cuda_versions is None:
        return {}
    out = {}
    for key, getter in (("jax_cuda", "cuda_runtime_get_version"), ("jax_cudnn", "cudnn_get_version")):
        try:
            version = int(getattr(cuda_versions, getter)())
        except Exception:
            continue
        # CUDA encodes 12.4 as 12040; cuDNN 9 encodes 9.10.2 as 91002.
        out[key] = (f"{version // 1000}.{version % 1000 // 10}" if key == "jax_cuda"
                    else f"{version // 10000}.{version // 100 % 100}.{version % 100}")
    return out



class JaxScanBf16Peer(JaxScanPeer):
    """`jax-scan-bf16`: the same scan, its products on bf16 operands with fp32 accumulation; the
    parameters, the softmax and the loss stay fp32 (the precision of graphtrain's bf16 rungs)."""

    name = "jax-scan-bf16"
    summary = "JAX: one jitted lax.scan per epoch, bf16 operands, fp32 accumulation and weights"
    note = "bf16 operands, fp32 accumulation and weights"
    precisions = ("bf16",)

    def setup(self) -> None:
        import jax.numpy as jnp

        self.operand = jnp.bfloat16
        super().setup()
