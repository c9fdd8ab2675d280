"""The model axis on the GPU: K = 3 models with distinct seeded random inputs, their buffers three
copies of one layout a non-zero stride apart (a gap after each copy, so the stride is not the
copy's size), launched once with models=3 and then each alone with models=1 on its own buffers
from the same inputs: every per-model buffer bit for bit the same (outputs NaN-poisoned first, and
each checked written). Then the strided batched product against three `gemm` calls, bit for bit,
and against NumPy in float64."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import Scratch, rel_err

K = 3
GAP = 768  # bytes after each model's copy of the layout
F32 = np.float32


def randn(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(F32)


def nan(*shape, dtype=F32):
    return np.full(shape, np.nan, dtype)


def argmaxes(rng, *shape):
    """Pool windows' argmaxes, some marked off by the ReLU (255)."""
    return rng.choice(np.array([0, 1, 2, 3, 255], np.uint8), size=shape)


def ints(rng, high, *shape):
    return rng.integers(0, high, shape).astype(np.int32)


class Models:
    """K copies of one buffer layout in one arena, model k's buffer at model 0's + k·stride bytes,
    and the buffers every model shares; each filled from the given host arrays."""

    def __init__(self, stream, shared: dict, per_model: list[dict]):
        from graphtrain.libs.memory import Arena

        self.stream, self.shared, self.per_model, self.arena = stream, shared, per_model, Arena()
        self.shared_bufs = {name: self.arena.reserve(name, a.shape, a.dtype) for name, a in shared.items()}
        self.bufs = []
        for k, arrays in enumerate(per_model):
            self.bufs.append({name: self.arena.reserve(f"{name}@{k}", a.shape, a.dtype) for name, a in arrays.items()})
            self.arena.reserve(f"gap@{k}", GAP, np.uint8)
        self.arena.allocate()
        first = next(iter(per_model[0]))
        self.stride = self.bufs[1][first].ptr - self.bufs[0][first].ptr
        assert all(self.bufs[k][name].ptr == self.bufs[0][name].ptr + k * self.stride
                   for k in range(len(per_model)) for name in per_model[0])

    def fill(self) -> None:
        for name, a in self.shared.items():
            self.shared_bufs[name].upload(a, self.stream)
        for bufs, arrays in zip(self.bufs, self.per_model):
            for name, a in arrays.items():
                bufs[name].upload(a, self.stream)

    def ptr(self, name: str, model: int) -> int:
        return self.shared_bufs[name].ptr if name in self.shared_bufs else self.bufs[model][name].ptr

    def read(self) -> list[dict]:
        return [{name: buf.download(self.stream) for name, buf in bufs.items()} for bufs in self.bufs]


def packed_and_alone(stream, shared, per_model, launch):
    """Each model's buffers after one launch of its len(per_model) models (K unless a test says), and
    after a launch of one model each (launch(ptr, **axis), ptr(name) the address of model 0's buffer
    or of a shared one)."""
    models = Models(stream, shared, per_model)
    try:
        models.fill()
        launch(lambda name: models.ptr(name, 0), models=len(per_model), model_stride=models.stride)
        packed = models.read()
        models.fill()
        for k in range(len(per_model)):
            launch(lambda name, k=k: models.ptr(name, k), models=1, model_stride=0)
        return packed, models.read()
    finally:
        models.arena.close()


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


# ---- the cases: (launcher, shared inputs, one model's buffers, its outputs, the launch) ---------
# The speedrun cnn's sizes: batch 256, conv1 1×28×28 → 24 (5×5), conv2 24×12×12 → 32 (3×3), a
# hidden layer of 256, 10 classes.
N, HIDDEN, CLASSES, EPOCH = 256, 256, 10, 60_000
SPAN = 215_360  # the speedrun cnn's parameters, each 64-float aligned in one span (more than one block's grid-stride)
CONVS = {"conv1": (1, 28, 28, 24, 5), "conv2": (24, 12, 12, 32, 3)}


def conv_launcher(device, kind, c, h, w, outs, k, models=1):
    from graphtrain.kernels.convpool import ConvPool
    from graphtrain.kernels.convpool_tc import ConvPoolTc

    return ConvPoolTc(device, c, h, w, k, 2, outs, models=models) if kind == "tf32" else ConvPool(device, c, k, 2, outs)


class PackedAndAlone:
    """A layer's launcher built for K models (the packed launch) and one built for one (each model
    alone), as a pack's and a single run's are (convpool_tc's backward data takes more m-tiles an
    item packed): `of(models)` is the one a launch of `models` models uses."""

    def __init__(self, make):
        self.packed, self.alone = make(K), make(1)

    def of(self, models):
        return self.packed if models > 1 else self.alone

    def close(self):
        self.packed.close()
        self.alone.close()


def conv_case(device, rng, kind, layer, passes):
    c, h, w, outs, k = CONVS[layer]
    ho, wo = (h - k + 1) // 2, (w - k + 1) // 2
    launchers = PackedAndAlone(lambda models: conv_launcher(device, kind, c, h, w, outs, k, models))
    cp = launchers.alone
    shared = {"x": randn(rng, N, c, h, w)} if passes == "forward, shared input" else {}

    def model():
        m = {"w": randn(rng, outs, c, k, k, scale=1 / np.sqrt(c * k * k)), "b": randn(rng, outs, scale=0.3)}
        if passes != "forward, shared input":
            m["x"] = randn(rng, N, c, h, w)
        if passes.startswith("forward"):
            return m | {"out": nan(N, outs, ho, wo), "arg": np.full((N, outs, ho, wo), 77, np.uint8)}, ("out", "arg")
        m |= {"dout": randn(rng, N, outs, ho, wo), "arg": argmaxes(rng, N, outs, ho, wo)}
        if passes == "weight grad":
            return m | {"partial": nan(outs * cp.chunks(N) * (cp.taps + 1)), "dw": nan(outs * cp.taps),
                        "db": nan(outs)}, ("partial", "dw", "db")
        return m | {"dx": nan(N, c, h, w)}, ("dx",)

    def launch(s, p, **axis):
        cp = launchers.of(axis["models"])
        if passes.startswith("forward"):
            cp.forward(s, p("x"), p("w"), p("b"), p("out"), p("arg"), N, outs, h, w,
                       shared_input=passes == "forward, shared input", **axis)
        elif passes == "weight grad":
            cp.weight_grad(s, p("x"), p("dout"), p("arg"), p("partial"), p("dw"), p("db"), N, outs, h, w, **axis)
        else:
            cp.backward_data(s, p("dout"), p("arg"), p("w"), p("dx"), N, outs, h, w, **axis)

    return launchers, shared, model, launch


def kernel_case(device, rng, name):
    from graphtrain.kernels.cnn import Cnn
    from graphtrain.kernels.fused import Fused
    from graphtrain.kernels.gather import Gather
    from graphtrain.kernels.head import Head
    from graphtrain.kernels.layers import Layers
    from graphtrain.kernels.optim import STATE_INTS, Optim, constants_of
    from graphtrain.reference_cnn import Optimizer, Schedule

    train, features, test = 1000, 784, 1000
    cursor = lambda: rng.integers(EPOCH - 300, EPOCH, 1).astype(np.int32)  # noqa: E731 (tail batches: valid rows vary)
    cases = {
        "gather_batch_at": (
            Gather, {"images": randn(rng, train, features), "labels": ints(rng, CLASSES, train)},
            lambda: ({"order": ints(rng, train, train + N), "cursor": ints(rng, train, 1), "x": nan(N, features),
                      "y": np.full(N, -7, np.int32)}, ("x", "y")),
            lambda L, s, p, **axis: L.gather_batch_at(s, p("images"), p("labels"), p("order"), p("cursor"), features,
                                                      N, p("x"), p("y"), **axis)),
        "head.logits_loss": (
            lambda d: Head(d, CLASSES), {},
            lambda: ({"h": randn(rng, N, HIDDEN), "w": randn(rng, CLASSES, HIDDEN, scale=1 / 16),
                      "b": randn(rng, CLASSES), "y": ints(rng, CLASSES, N), "dlogits": nan(N, CLASSES),
                      "row_loss": nan(N, dtype=np.float64), "count": np.zeros(1, np.int32), "cursor": cursor(),
                      "loss_sum": rng.standard_normal(1)}, ("dlogits", "row_loss", "cursor", "loss_sum")),
            lambda L, s, p, **axis: L.logits_loss(s, p("h"), p("w"), p("b"), p("y"), p("dlogits"), p("row_loss"),
                                                  p("count"), p("cursor"), N, HIDDEN, EPOCH, p("loss_sum"), **axis)),
        "head.grads": (
            lambda d: Head(d, CLASSES), {},
            lambda: ({"h": randn(rng, N, HIDDEN), "dlogits": randn(rng, N, CLASSES), "dw": nan(CLASSES, HIDDEN),
                      "db": nan(CLASSES)}, ("dw", "db")),
            lambda L, s, p, **axis: L.grads(s, p("h"), p("dlogits"), p("dw"), p("db"), N, HIDDEN, **axis)),
        "fused.head_backward": (
            lambda d: Fused(d, CLASSES, bf16=False), {},
            lambda: ({"dlogits": randn(rng, N, CLASSES), "w": randn(rng, CLASSES, HIDDEN), "h": randn(rng, N, HIDDEN),
                      "dh": nan(N, HIDDEN), "db": nan(HIDDEN)}, ("dh", "db")),
            lambda L, s, p, **axis: L.head_backward(s, p("dlogits"), p("w"), p("h"), p("dh"), p("db"), HIDDEN, N,
                                                    **axis)),
        "fused.relu_bias_grad": (
            lambda d: Fused(d, CLASSES, bf16=False), {},
            lambda: ({"h": randn(rng, N, HIDDEN), "dh": randn(rng, N, HIDDEN), "db": nan(HIDDEN)}, ("dh", "db")),
            lambda L, s, p, **axis: L.relu_bias_grad(s, p("h"), p("dh"), p("db"), HIDDEN, N, **axis)),
        "layers.bias_relu": (
            Layers, {},
            lambda: ({"y": randn(rng, N, HIDDEN), "b": randn(rng, HIDDEN)}, ("y",)),
            lambda L, s, p, **axis: L.bias_relu(s, p("y"), p("b"), N, HIDDEN, True, **axis)),
        "layers.bias_grad": (
            Layers, {},
            lambda: ({"dy": randn(rng, N, HIDDEN), "db": nan(HIDDEN)}, ("db",)),
            lambda L, s, p, **axis: L.bias_grad(s, p("dy"), p("db"), N, HIDDEN, **axis)),
        "cnn.softmax_xent_step": (
            Cnn, {},
            lambda: ({"logits": randn(rng, N, CLASSES), "y": ints(rng, CLASSES, N), "dlogits": nan(N, CLASSES),
                      "cursor": cursor(), "loss_sum": rng.standard_normal(1)}, ("dlogits", "cursor", "loss_sum")),
            lambda L, s, p, **axis: L.softmax_xent_step(s, p("logits"), p("y"), p("dlogits"), p("cursor"), N, EPOCH,
                                                        CLASSES, p("loss_sum"), **axis)),
        "cnn.count_correct": (
            Cnn, {"labels": ints(rng, CLASSES, test)},
            lambda: ({"logits": randn(rng, test, CLASSES), "correct": ints(rng, 100, 1)}, ("correct",)),
            lambda L, s, p, **axis: L.count_correct(s, p("logits"), p("labels"), test, CLASSES, p("correct"), **axis)),
        "optim.step": (
            Optim, {},
            lambda: ({"p": randn(rng, SPAN), "g": randn(rng, SPAN, scale=0.1), "s1": randn(rng, SPAN, scale=0.01),
                      "s2": np.abs(randn(rng, SPAN, scale=1e-3)), "lr": nan(1),
                      # steps taken so far (each model its own), no block done with this one
                      "state": np.array([rng.integers(0, 400), 0], np.int32).reshape(STATE_INTS),
                      "constants": constants_of(*next(recipes))}, ("p", "s1", "state", "lr")),  # s2: Adam's only
            lambda L, s, p, **axis: L.step(s, p("p"), p("g"), p("s1"), p("s2"), SPAN, p("state"), p("lr"),
                                           p("constants"), **axis)),
    }
    # A recipe per model, each optimizer and schedule another (drawn in turn as the K models' buffers are).
    recipes = iter([(Optimizer("adam", betas=(0.8, 0.95), weight_decay=1e-3), Schedule("one-cycle", 0.01, 500)),
                    (Optimizer("nesterov", 0.85, weight_decay=0.01), Schedule("cosine", 0.05, 450)),
                    (Optimizer("adamw", betas=(0.9, 0.99), weight_decay=0.1),
                     Schedule("warmup", 0.003, 400, warmup_steps=50))])
    make, shared, model, launch = cases[name]
    launcher = make(device)
    return launcher, shared, model, lambda s, p, **axis: launch(launcher, s, p, **axis)


CONV_CASES = [(kind, layer, passes) for kind in ("tf32", "fp32")
              for layer, passes in (("conv1", "forward"), ("conv2", "forward"), ("conv1", "forward, shared input"),
                                    ("conv1", "weight grad"), ("conv2", "weight grad"), ("conv2", "backward data"))]
KERNEL_CASES = ["gather_batch_at", "head.logits_loss", "head.grads", "fused.head_backward", "fused.relu_bias_grad",
                "layers.bias_relu", "layers.bias_grad", "cnn.softmax_xent_step", "cnn.count_correct", "optim.step"]


@pytest.fixture(scope="module")
def stream(gpu_device):
    from graphtrain.libs import cuda

    s = cuda.Stream()
    yield s
    s.close()


@pytest.mark.parametrize("case", [*CONV_CASES, *KERNEL_CASES], ids=lambda c: c if isinstance(c, str) else " ".join(c))
def test_each_model_of_a_packed_launch_is_its_launch_alone_bit_for_bit(gpu_device, stream, seed, case):
    rng = np.random.default_rng(seed)
    launcher, shared, model, launch = (conv_case(gpu_device, rng, *case) if isinstance(case, tuple)
                                       else kernel_case(gpu_device, rng, case))
    try:
        drawn = [model() for _ in range(K)]
        per_model, outputs = [m for m, _ in drawn], drawn[0][1]
        packed, alone = packed_and_alone(stream, shared, per_model, lambda p, **axis: launch(stream, p, **axis))
    finally:
        launcher.close()
    for k in range(K):
        for name in per_model[k]:
            msg = f"{case}: model {k}'s {name}, seed {seed}"
            assert bits(packed[k][name]) == bits(alone[k][name]), msg
            if name in outputs:
                assert bits(alone[k][name]) != bits(per_model[k][name]), f"{msg}: not written"


# ---- the strided batched product ---------------------------------------------------------------
# The cnn's products (its hidden layer of 256 on 800 conv features, batch 256): the forward pass,
# the weight and input gradients; each once with every operand per model, once with B shared.
PRODUCTS = {"forward": (False, True, N, HIDDEN, 800), "weight grad": (True, False, HIDDEN, 800, N),
            "input grad": (False, False, N, 800, HIDDEN)}
TOLERANCE = {"fp32": 1e-5, "tf32": 3e-3}  # ‖out − ref‖ / ‖ref‖ against float64


@pytest.mark.parametrize("b_shared", [False, True], ids=["B per model", "B shared"])
@pytest.mark.parametrize("product", PRODUCTS)
@pytest.mark.parametrize("precision", TOLERANCE)
def test_a_strided_batched_product_is_each_gemm_to_rounding(gpu_device, stream, seed, precision, product, b_shared):
    """Each product of cuBLAS's strided batched call and each single gemm against float64. Not bit
    for bit: cuBLAS 13.1 on an H100 picks another kernel for the forward product (256×256×800) in
    a single call than in a batch of K ≥ 3, so packed products that must match a model alone run
    by one algorithm per shape (graphtrain.libs.cublaslt.LtGemms, tests/test_cublaslt_batched_gpu.py)."""
    from graphtrain.libs import cuda
    from graphtrain.libs.cublas import Cublas

    transa, transb, m, n, k = PRODUCTS[product]
    rng = np.random.default_rng(seed)
    a_shape, b_shape = ((k, m) if transa else (m, k)), ((n, k) if transb else (k, n))
    a = randn(rng, K, *a_shape)
    b = randn(rng, *b_shape)[None] if b_shared else randn(rng, K, *b_shape)
    lda, ldb, ldc = a_shape[1], b_shape[1], n
    workspace_bytes = 32 << 20
    workspace = cuda.malloc(workspace_bytes)
    try:
        with Cublas(stream, workspace, workspace_bytes, precision) as blas, \
                Scratch(stream, a=a, b=b, batched=nan(K, m, n), single=nan(K, m, n)) as s:
            sa, sb, sc = a[0].size, 0 if b_shared else b[0].size, m * n
            blas.gemm_strided_batched(transa, transb, m, n, k, 1.0, s["a"], lda, sa, s["b"], ldb, sb, 0.0,
                                      s["batched"], ldc, sc, K)
            for i in range(K):
                blas.gemm(transa, transb, m, n, k, 1.0, s["a"] + 4 * i * sa, lda, s["b"] + 4 * i * sb, ldb, 0.0,
                          s["single"] + 4 * i * sc, ldc)
            batched, single = s.get("batched"), s.get("single")
    finally:
        cuda.free(workspace)
    msg = f"{precision} {product}, B {'shared' if b_shared else 'per model'}, seed {seed}"
    for i in range(K):
        op_a = a[i].astype(np.float64).T if transa else a[i].astype(np.float64)
        b_i = b[0 if b_shared else i].astype(np.float64)
        ref = op_a @ (b_i.T if transb else b_i)
        assert rel_err(batched[i], ref) < TOLERANCE[precision], f"{msg}: product {i} against float64"
        assert rel_err(single[i], ref) < TOLERANCE[precision], f"{msg}: gemm {i} against float64"


@pytest.mark.parametrize("layer", list(CONVS))
def test_a_weight_gradient_of_models_enough_to_fill_the_gpu_is_each_alone_bit_for_bit(gpu_device, stream, seed,
                                                                                       layer):
    """convpool_tc's weight gradient over enough models that each model's chunks go to REDUCE_SLICES
    blocks, each adding its chunks in the reduce's order (weight_grad_blocks), against each model's
    one-model launch (a block a chunk): dw and db bit for bit, and near float64. A batch of 250: the
    slices of chunks of unequal lengths."""
    from graphtrain import reference_cnn as R
    from graphtrain.kernels.convpool_tc import REDUCE_SLICES

    c, h, w, outs, k = CONVS[layer]
    n, ho, wo = 250, (h - k + 1) // 2, (w - k + 1) // 2
    rng = np.random.default_rng(seed)
    cp = conv_launcher(gpu_device, "tf32", c, h, w, outs, k)
    try:
        count = -(-cp.weight_grad_slots // REDUCE_SLICES)
        assert cp.weight_grad_blocks(n, count) == REDUCE_SLICES and cp.weight_grad_blocks(n, 1) == cp.chunks(n) > REDUCE_SLICES
        per_model = [{"x": randn(rng, n, c, h, w), "dout": randn(rng, n, outs, ho, wo),
                      "arg": argmaxes(rng, n, outs, ho, wo), "partial": nan(outs * cp.chunks(n) * (cp.taps + 1)),
                      "dw": nan(outs * cp.taps), "db": nan(outs)} for _ in range(count)]
        packed, alone = packed_and_alone(stream, {}, per_model, lambda p, **axis: cp.weight_grad(
            stream, p("x"), p("dout"), p("arg"), p("partial"), p("dw"), p("db"), n, outs, h, w, **axis))
    finally:
        cp.close()
    for m, (one, alone_one) in enumerate(zip(packed, alone)):
        for name in ("dw", "db"):
            assert not np.isnan(one[name]).any(), f"{layer}: model {m}'s {name} not all written, seed {seed}"
            assert bits(one[name]) == bits(alone_one[name]), f"{layer}: model {m}'s {name}, seed {seed}"
    first = per_model[0]
    off = first["arg"] == 255
    dconv = R.maxpool_backward(np.where(off, 0.0, first["dout"]).astype(np.float64),
                               np.where(off, 0, first["arg"]).astype(np.int64), 2, (n, outs, h - k + 1, w - k + 1))
    ref_dw = R.conv_backward_filter(first["x"].astype(np.float64), dconv, k)
    assert rel_err(packed[0]["dw"], ref_dw.ravel()) < 3e-3, f"{layer}, seed {seed}"  # TF32 operands
    assert rel_err(packed[0]["db"], dconv.sum(axis=(0, 2, 3))) < 3e-3, f"{layer}, seed {seed}"
