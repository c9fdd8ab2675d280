"""Every kernel in graphtrain/kernels, through its launcher, against NumPy in float64, on fresh
random inputs (fixed seeds): the launch geometry is under test as much as the kernel.

Outputs are poisoned with NaN before each launch, so an element a kernel fails to write fails
the comparison instead of passing as a leftover.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import Scratch, rel_err


RNG = np.random.default_rng()  # reseeded before each test from its fixed seed (conftest.seed)


@pytest.fixture(autouse=True)
def fixed_inputs(seed):
    """Each test's random inputs from its own fixed seed, printed if it fails."""
    RNG.bit_generator.state = np.random.default_rng(seed).bit_generator.state


@pytest.fixture(scope="module")
def gpu(gpu_device):
    from graphtrain.kernels.gather import Gather
    from graphtrain.kernels.layers import Layers
    from graphtrain.kernels.matmul import Matmul
    from graphtrain.kernels.metrics import Metrics
    from graphtrain.kernels.softmax import Softmax
    from graphtrain.libs import cuda

    stream = cuda.Stream()
    launchers = {cls.stem: cls(gpu_device) for cls in (Gather, Matmul, Layers, Softmax, Metrics)}
    yield stream, launchers
    for launcher in launchers.values():
        launcher.close()
    stream.close()


def poison(shape, dtype=np.float32):
    return np.full(shape, np.nan, dtype) if np.dtype(dtype).kind == "f" else np.full(shape, -7, dtype)


@pytest.mark.parametrize("transa", [False, True])
@pytest.mark.parametrize("transb", [False, True])
def test_gemm_naive_all_forms(gpu, transa, transb):
    stream, mods = gpu
    m, n, k = 37, 23, 45
    a = RNG.standard_normal((k, m) if transa else (m, k)).astype(np.float32)
    b = RNG.standard_normal((n, k) if transb else (k, n)).astype(np.float32)
    c0 = RNG.standard_normal((m, n)).astype(np.float32)
    s = Scratch(stream, a=a, b=b, c=c0)
    lda, ldb = a.shape[1], b.shape[1]
    mods["matmul"].gemm(stream, transa, transb, m, n, k, 0.5, s["a"], lda, s["b"], ldb, 2.0, s["c"], n)
    opa = a.T if transa else a
    opb = b.T if transb else b
    ref = 0.5 * opa.astype(np.float64) @ opb + 2.0 * c0
    assert rel_err(s.get("c"), ref) < 1e-5
    s.close()


def test_gemm_naive_beta_zero_ignores_nan_output(gpu):
    stream, mods = gpu
    m, n, k = 8, 9, 10
    a = RNG.standard_normal((m, k)).astype(np.float32)
    b = RNG.standard_normal((k, n)).astype(np.float32)
    s = Scratch(stream, a=a, b=b, c=poison((m, n)))
    mods["matmul"].gemm(stream, False, False, m, n, k, 1.0, s["a"], k, s["b"], n, 0.0, s["c"], n)
    assert rel_err(s.get("c"), a.astype(np.float64) @ b) < 1e-5
    s.close()


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("relu", [1, 0])
def test_bias_relu(gpu, with_bias, relu):
    stream, mods = gpu
    rows, cols = 33, 70
    y = RNG.standard_normal((rows, cols)).astype(np.float32)
    b = RNG.standard_normal(cols).astype(np.float32)
    s = Scratch(stream, y=y, b=b)
    mods["layers"].bias_relu(stream, s["y"], s["b"] if with_bias else 0, rows, cols, relu)
    ref = y.astype(np.float64) + (b if with_bias else 0)
    if relu:
        ref = np.maximum(ref, 0)
    assert rel_err(s.get("y"), ref) < 1e-6
    s.close()


def test_relu_backward_bias_grad_sgd(gpu):
    stream, mods = gpu
    rows, cols = 300, 31  # more rows than bias_grad's threads
    dh = RNG.standard_normal((rows, cols)).astype(np.float32)
    h = np.maximum(RNG.standard_normal((rows, cols)), 0).astype(np.float32)
    w = RNG.standard_normal((cols, 17)).astype(np.float32)
    dw = RNG.standard_normal((cols, 17)).astype(np.float32)
    s = Scratch(stream, dh=dh, h=h, db=poison(cols), w=w, dw=dw)
    layers = mods["layers"]
    layers.relu_backward(stream, s["dh"], s["h"], dh.size)
    layers.bias_grad(stream, s["dh"], s["db"], rows, cols)
    layers.sgd_update(stream, s["w"], s["dw"], 0.25, w.size)
    masked = dh.astype(np.float64) * (h > 0)
    assert rel_err(s.get("dh"), masked) < 1e-7
    assert rel_err(s.get("db"), masked.sum(axis=0)) < 1e-5
    assert rel_err(s.get("w"), w.astype(np.float64) - 0.25 * dw) < 1e-6
    s.close()


def test_softmax_and_xent_grad(gpu):
    stream, mods = gpu
    rows, cols = 77, 10
    logits = (5 * RNG.standard_normal((rows, cols))).astype(np.float32)
    y = RNG.integers(0, cols, rows).astype(np.int32)
    s = Scratch(stream, logits=logits, probs=poison((rows, cols)), y=y, d=poison((rows, cols)))
    mods["softmax"].softmax_rows(stream, s["logits"], s["probs"], rows, cols)
    mods["softmax"].xent_grad(stream, s["probs"], s["y"], s["d"], rows, cols)
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    d = p.copy()
    d[np.arange(rows), y] -= 1
    d /= rows
    assert rel_err(s.get("probs"), p) < 1e-6
    assert rel_err(s.get("d"), d) < 1e-6
    s.close()


def test_metrics_kernels(gpu):
    stream, mods = gpu
    rows, cols = 300, 10  # more rows than threads: the strided loop is exercised
    logits = (3 * RNG.standard_normal((rows, cols))).astype(np.float32)
    y = RNG.integers(0, cols, rows).astype(np.int32)
    start = RNG.standard_normal(2)
    s = Scratch(stream, logits=logits, y=y, one=np.array([np.nan]), acc=start.copy(), fused=start.copy())
    z = logits.astype(np.float64)
    m = z.max(1)
    loss = (np.log(np.exp(z - m[:, None]).sum(1)) + m - z[np.arange(rows), y]).sum()
    correct = (z.argmax(1) == y).sum()
    k = mods["metrics"]
    k.batch_loss(stream, s["logits"], s["y"], rows, cols, s["one"], False)
    assert abs(s.get("one")[0] - loss) / loss < 1e-6
    k.batch_correct(stream, s["logits"], s["y"], rows, cols, s["one"], False)
    assert s.get("one")[0] == correct
    k.batch_loss(stream, s["logits"], s["y"], rows, cols, s["acc"], True)
    assert abs(s.get("acc")[0] - (start[0] + loss)) < 1e-5 * loss
    k.batch_metrics(stream, s["logits"], s["y"], rows, cols, s["fused"])
    fused = s.get("fused")
    assert abs(fused[0] - (start[0] + loss)) < 1e-5 * loss and fused[1] == start[1] + correct
    s.close()


def test_gather_and_cursor(gpu):
    stream, mods = gpu
    n, features, rows = 200, 33, 17
    images = RNG.random((n, features)).astype(np.float32)
    labels = RNG.integers(0, 10, n).astype(np.int32)
    order = RNG.permutation(n).astype(np.int32)
    s = Scratch(stream, images=images, labels=labels, order=order, x=poison((rows, features)),
                y=poison(rows, np.int32), cursor=np.array([0], np.int32))
    g = mods["gather"]
    g.gather_batch(stream, s["images"], s["labels"], s["order"], 40, features, rows, s["x"], s["y"])
    idx = order[40:40 + rows]
    assert np.array_equal(s.get("x"), images[idx]) and np.array_equal(s.get("y"), labels[idx])
    g.set_cursor(stream, s["cursor"], 100)
    g.gather_batch_at(stream, s["images"], s["labels"], s["order"], s["cursor"], features, rows, s["x"], s["y"])
    g.advance_cursor(stream, s["cursor"], rows)
    idx = order[100:100 + rows]
    assert np.array_equal(s.get("x"), images[idx]) and np.array_equal(s.get("y"), labels[idx])
    assert s.get("cursor")[0] == 100 + rows
    s.close()
