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
from functools import partial

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


def make_product(kind: str):
    """The function `product(x, w)` = x @ w.T that the model's layers use, w shaped (out, in).

    "fp32": fp32 operands (at the process-wide precision, "highest" in these peers: no TF32).
    The bf16 ones read both operands as bf16 and differ in what the backward pass multiplies:
    - "bf16": forward and backward products all bf16 x bf16 with fp32 accumulation and fp32
      results (a custom VJP casts the cotangent to bf16 before its two products);
    - "bf16-mixed": `jnp.dot(bf16, bf16, preferred_element_type=float32)` left to autodiff: the
      cotangent stays fp32, so the backward products are fp32 x bf16, which XLA runs as fp32
      products (at "highest": true fp32, no tensor-core bf16);
    - "bf16-out": `(bf16 @ bf16).astype(float32)`: every product's result rounded to bf16
      (the logits and the weight gradients included), the backward products bf16 too.
    """
    import jax
    import jax.numpy as jnp

    f32, bf16 = jnp.float32, jnp.bfloat16
    if kind == "fp32":
        return lambda x, w: x @ w.T
    if kind == "bf16-mixed":
        return lambda x, w: jnp.dot(x.astype(bf16), w.T.astype(bf16), preferred_element_type=f32)
    if kind == "bf16-out":
        return lambda x, w: (x.astype(bf16) @ w.T.astype(bf16)).astype(f32)
    if kind != "bf16":
        raise ValueError(f"unknown product {kind!r}")

    # dy = g: dx = g @ w, dw = g.T @ x, each bf16 x bf16 -> fp32. x_dtype (static) is x's own
    # type, bf16 where the images are gathered as bf16: a cotangent has its primal's type.
    @partial(jax.custom_vjp, nondiff_argnums=(2,))
    def product(x, w, x_dtype):
        return jnp.dot(x.astype(bf16), w.astype(bf16).T, preferred_element_type=f32)

    def product_fwd(x, w, x_dtype):
        xb, wb = x.astype(bf16), w.astype(bf16)
        return jnp.dot(xb, wb.T, preferred_element_type=f32), (xb, wb)

    def product_bwd(x_dtype, residuals, g):
        xb, wb = residuals
        gb = g.astype(bf16)
        dx = jnp.dot(gb, wb, preferred_element_type=f32).astype(x_dtype)
        dw = jnp.dot(gb.T, xb, preferred_element_type=f32)
        return dx, dw

    product.defvjp(product_fwd, product_bwd)
    return lambda x, w: product(x, w, x.dtype)


def forward(params, x, product):
    """Logits; `params` is a list of (w, b or None), w shaped (out, in) like the reference;
    `product(x, w)` = x @ w.T (see `make_product`)."""
    import jax

    for i, (w, b) in enumerate(params):
        x = product(x, w)
        if b is not None:
            x = x + b
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return x


class JaxScanPeer(Peer):
    name = "jax-scan"
    summary = "JAX: one jitted lax.scan per epoch over the full batches, fp32"
    note = "fp32, matmul precision highest"
    product = "fp32"  # what the layers' products read and return: see make_product
    # Where a step's images come from: "rows", gathered from the fp32 images by the step;
    # "rows-bf16", gathered from a bf16 copy made once at setup (the operand the bf16 products
    # read anyway: half the bytes); "epoch", one gather of the whole epoch's batches before the
    # scan, which then walks the gathered rows.
    gather = "rows"
    matmul_precision = "highest"  # set process-wide for the run (fp32 products: no TF32)

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
        jax.config.update("jax_default_matmul_precision", self.matmul_precision)
        self.device = device

        def put(array):
            return jax.device_put(array, device)

        plan = self.plan
        self.train_x, self.train_y = put(data.train_images), put(data.train_labels.astype(np.int32))
        self.test_x, self.test_y = put(data.test_images), put(data.test_labels.astype(np.int32))
        if self.gather == "rows-bf16":
            self.train_x = self.train_x.astype(jnp.bfloat16)
        product = make_product(self.product)
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
            logits = forward(params, x, product)
            logp = jax.nn.log_softmax(logits)
            loss = -jnp.take_along_axis(logp, y[:, None], axis=1).mean()
            return loss, logits

        def batch_step(params, x, y):
            """One SGD step on the batch (x, y); returns (params, Σ loss over it, # correct)."""
            (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y)
            params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
            correct = (jnp.argmax(logits, axis=1) == y).sum()
            return params, loss * y.shape[0], correct

        def step(params, train_x, train_y, idx):
            return batch_step(params, train_x[idx], train_y[idx])

        def epoch_fn(params, train_x, train_y, idx_rows):
            def body(carry, batch):
                params, loss_sum, correct = carry
                if self.gather == "epoch":
                    params, loss, batch_correct = batch_step(params, *batch)
                else:
                    params, loss, batch_correct = step(params, train_x, train_y, batch)
                return (params, loss_sum + loss, correct + batch_correct), None

            start = (params, jnp.float32(0), jnp.int32(0))
            batches = (train_x[idx_rows], train_y[idx_rows]) if self.gather == "epoch" else idx_rows
            (params, loss_sum, correct), _ = jax.lax.scan(body, start, batches)
            return params, loss_sum, correct

        def correct_fn(params, x, y):
            return (jnp.argmax(forward(params, x, product), axis=1) == y).sum()

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
    """`jax-scan-bf16`: the same scan, every product (forward and backward) on bf16 operands with
    fp32 accumulation and fp32 results; the parameters, the softmax and the loss stay fp32 (the
    precision of graphtrain's bf16 rungs).

    How a JAX user would write it, and what each way costs (`scripts/benchmarks/jax_scan_variants.py`,
    H100 80GB HBM3, jax 0.11.2, jhu schedule, 784-784-784-784-10, batch 128, median ms/epoch):
    `jnp.dot(bf16, bf16, preferred_element_type=float32)` left to autodiff ("bf16-mixed") 54.6:
    its cotangents are fp32, so the backward products are fp32 x bf16, run as true fp32 products
    under the process-wide "highest" (43.1 at the default precision, i.e. TF32); products whose
    results are rounded to bf16 ("bf16-out", the plain way: cast operands, cast the product back)
    39.0; a custom VJP that casts the cotangent to bf16 and keeps fp32 results ("bf16") 37.5.
    Gathering the images from a bf16 copy (37.2) or the whole epoch's batches before the scan
    (37.0) is within the runs' spread, so the step gathers its fp32 rows as jax-scan does.
    """

    name = "jax-scan-bf16"
    summary = "JAX: one jitted lax.scan per epoch, bf16 operands, fp32 accumulation and weights"
    note = ("bf16 operands (backward products too, through a custom VJP), fp32 accumulation, "
            "results and weights")

    product = "bf16"
    gather = "rows"

