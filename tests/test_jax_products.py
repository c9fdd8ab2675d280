"""The jax-scan peers' products and their gradients against float64 NumPy (jax on any device;
skipped where jax is not installed)."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from graphtrain.peers.jax_scan import make_product  # noqa: E402


def bf16(a: np.ndarray) -> np.ndarray:
    """a rounded to bf16 (to nearest even), as float64."""
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


def rel(out, ref) -> float:
    out = np.asarray(out, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("x_type", ["float32", "bfloat16"])
def test_bf16_product_multiplies_bf16_operands_forward_and_backward(x_type):
    """`bf16`: y = x @ w.T, dx = g @ w, dw = g.T @ x, each on bf16-rounded operands with fp32
    results: equal to the float64 products of the rounded operands to fp32 accuracy; and the
    cotangent of x has x's own type."""
    seed = 31
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, 96)).astype(np.float32)
    w = rng.standard_normal((40, 96)).astype(np.float32)
    g = rng.standard_normal((64, 40)).astype(np.float32)
    xj = jnp.asarray(x).astype(getattr(jnp, x_type))
    product = make_product("bf16")
    y, vjp = jax.vjp(product, xj, jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    xr, wr, gr = bf16(x), bf16(w), bf16(g)
    assert y.dtype == jnp.float32 and dw.dtype == jnp.float32 and dx.dtype == xj.dtype
    assert rel(y, xr @ wr.T) < 1e-6, f"seed {seed}"
    assert rel(dw, gr.T @ xr) < 1e-6, f"seed {seed}"
    assert rel(dx, gr @ wr) < (1e-6 if x_type == "float32" else 1e-2), f"seed {seed}"
    # Not the fp32 products: the bf16 rounding of the operands shows at ~1e-3.
    assert rel(dw, g.astype(np.float64).T @ xr) > 1e-4, f"seed {seed}"


def test_products_agree_on_the_forward_pass():
    """Every bf16 variant computes x @ w.T from bf16 operands; fp32 is the plain product."""
    seed = 32
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    ref = bf16(x) @ bf16(w).T
    with jax.default_matmul_precision("highest"):
        assert rel(make_product("fp32")(x, w), x.astype(np.float64) @ w.T) < 1e-6, f"seed {seed}"
        assert rel(make_product("bf16-mixed")(x, w), ref) < 1e-6, f"seed {seed}"
        assert rel(make_product("bf16")(x, w), ref) < 1e-6, f"seed {seed}"
        assert rel(make_product("bf16-out")(x, w), ref) < 1e-2, f"seed {seed}"
    with pytest.raises(ValueError, match="unknown product"):
        make_product("fp8")
