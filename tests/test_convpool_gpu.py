"""The fused conv layer's passes (conv + bias + 2×2 max-pool + ReLU forward, the weight and bias
gradients, the input gradient) against the float64 reference on seeded random inputs: the fp32
kernels (convpool.cu) and the tensor-core ones (convpool_tc.cu, TF32)."""

import numpy as np
import pytest

from graphtrain import reference_cnn as R
from helpers import Scratch, rel_err

# (name, n, c, h, w, outs, kernel, first): the speedrun's layers (conv2's n past one wave of the
# forward's grid, so its blocks loop), and one with odd conv sizes (a row and a column in no window).
CASES = [
    ("speedrun conv1", 64, 1, 28, 28, 24, 5, True),
    ("speedrun conv2", 1200, 24, 12, 12, 32, 3, False),
    ("odd 3x11x13", 37, 3, 11, 13, 20, 3, False),
]
# kind: (tolerance of ‖out − ref‖ / ‖ref‖, largest fraction of windows whose argmax may differ
# from float64's: near-ties that the rounding of the products orders the other way); "tf32" as built
# (the forward's last k-step as m16n8k4 mma where it holds at most 4 taps: FORWARD_TAIL_K4, and the
# speedrun's first layer's B fragments in registers); "tf32 k8 shared": the forward's every k-step as
# m16n8k8, its B fragments from shared memory (the speedrun's first layer's 25 taps and the odd
# layer's 27 end in a k-step of 1 and 3)
KINDS = {"fp32": (1e-5, 1e-3), "tf32": (3e-3, 2e-2), "tf32 k8 shared": (3e-3, 2e-2)}


@pytest.fixture
def stream(gpu_device):
    from graphtrain.libs import cuda

    s = cuda.Stream()
    yield s
    s.close()


def build(device, kind, c, h, w, outs, k, monkeypatch=None):
    from graphtrain.kernels import convpool_tc
    from graphtrain.kernels.convpool import ConvPool

    if kind == "fp32":
        return ConvPool(device, c, k, 2, outs)
    if kind == "tf32 k8 shared":
        monkeypatch.setattr(convpool_tc, "FORWARD_TAIL_K4", False)
        monkeypatch.setattr(convpool_tc, "FORWARD_B_REGISTERS", 0)
    return convpool_tc.ConvPoolTc(device, c, h, w, k, 2, outs)


# every case at every kind, "tf32 k8 shared" only where the build differs (a last k-step of at most 4 taps)
CASE_KINDS = [pytest.param(case, kind, id=f"{case[0]}-{kind}") for case in CASES for kind in KINDS
              if kind != "tf32 k8 shared" or 0 < case[2] * case[6] ** 2 % 8 <= 4]


@pytest.mark.parametrize("case,kind", CASE_KINDS)
def test_fused_conv_passes_match_reference(gpu_device, stream, seed, case, kind, monkeypatch):
    name, n, c, h, w, outs, k, first = case
    tol, flips = KINDS[kind]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w))
    wt = rng.standard_normal((outs, c, k, k)) / np.sqrt(c * k * k)
    b = 0.3 * rng.standard_normal(outs)
    ho, wo = (h - k + 1) // 2, (w - k + 1) // 2
    dout = rng.standard_normal((n, outs, ho, wo))
    cp = build(gpu_device, kind, c, h, w, outs, k, monkeypatch)
    f32 = np.float32
    try:
        with Scratch(stream, x=x.astype(f32), w=wt.astype(f32), b=b.astype(f32), dout=dout.astype(f32),
                     out=np.full(dout.shape, np.nan, f32), arg=np.full(dout.shape, 77, np.uint8),
                     partial=np.zeros(outs * cp.chunks(n) * (cp.taps + 1), f32),
                     dw=np.full(wt.shape, np.nan, f32), db=np.full(outs, np.nan, f32),
                     dx=np.full(x.shape, np.nan, f32)) as s:
            cp.forward(stream, s["x"], s["w"], s["b"], s["out"], s["arg"], n, outs, h, w)
            cp.weight_grad(stream, s["x"], s["dout"], s["arg"], s["partial"], s["dw"], s["db"], n, outs, h, w)
            if not first:  # a first layer's input gradient is never needed (convpool.cu's does not fit it)
                cp.backward_data(stream, s["dout"], s["arg"], s["w"], s["dx"], n, outs, h, w)
            out, arg, dw, db, dx = (s.get(key) for key in ("out", "arg", "dw", "db", "dx"))
    finally:
        cp.close()
    msg = f"{name}, {kind}, seed {seed}"
    conv = R.conv_forward(x, wt) + b[None, :, None, None]
    pooled, ref_arg = R.maxpool_forward(conv, 2)
    ref_out = np.maximum(pooled, 0)
    assert rel_err(out, ref_out) < tol, msg
    off = arg == 255
    assert np.array_equal(off, out == 0), msg  # the ReLU's zeros are exactly the windows marked off
    assert np.all(arg[~off] < 4), msg
    assert np.mean(arg[~off] != ref_arg[~off]) <= flips, msg
    # The backward passes from the kernel's own argmaxes: the pooled gradient routed where it chose.
    routed = np.where(off, 0.0, dout)
    dconv = R.maxpool_backward(routed, np.where(off, 0, arg).astype(np.int64), 2, conv.shape)
    assert rel_err(dw, R.conv_backward_filter(x, dconv, k)) < tol, msg
    assert rel_err(db, dconv.sum(axis=(0, 2, 3))) < tol, msg
    if not first:
        assert rel_err(dx, R.conv_backward_data(dconv, wt, x.shape)) < tol, msg


def test_weight_gradient_is_bit_identical_between_runs(gpu_device, stream, seed):
    """The tensor-core passes twice on the same inputs: the same bits (fixed-order sums, no atomics)."""
    n, c, h, w, outs, k = 256, 24, 12, 12, 32, 3
    rng = np.random.default_rng(seed)
    f32 = np.float32
    cp = build(gpu_device, "tf32", c, h, w, outs, k)
    try:
        with Scratch(stream, x=rng.standard_normal((n, c, h, w)).astype(f32),
                     wt=(rng.standard_normal((outs, c, k, k)) / 15).astype(f32), b=np.zeros(outs, f32),
                     dout=rng.standard_normal((n, outs, 5, 5)).astype(f32), out=np.zeros((n, outs, 5, 5), f32),
                     arg=np.zeros((n, outs, 5, 5), np.uint8),
                     partial=np.zeros(outs * cp.chunks(n) * (cp.taps + 1), f32), dw=np.zeros(outs * cp.taps, f32),
                     db=np.zeros(outs, f32), dx=np.zeros((n, c, h, w), f32)) as s:
            cp.forward(stream, s["x"], s["wt"], s["b"], s["out"], s["arg"], n, outs, h, w)
            runs = []
            for _ in range(2):
                cp.weight_grad(stream, s["x"], s["dout"], s["arg"], s["partial"], s["dw"], s["db"], n, outs, h, w)
                cp.backward_data(stream, s["dout"], s["arg"], s["wt"], s["dx"], n, outs, h, w)
                runs.append([s.get(key) for key in ("dw", "db", "dx")])
    finally:
        cp.close()
    for a, b in zip(*runs):
        assert np.array_equal(a, b), f"seed {seed}"


@pytest.mark.parametrize("blocks", [1, 3, 7])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tc_forward_and_backward_data_are_bit_identical_across_grids(gpu_device, stream, seed, case, blocks):
    """convpool_tc's forward and backward data on a grid of `blocks` blocks (each looping over rounds
    of samples, as a launch of many models has them: the samples a round then as many as a block
    stages, the last round part-filled) give the default grid's outputs bit for bit: every output
    sums the same k-steps in the same order whatever block computes it."""
    name, n, c, h, w, outs, k, first = case
    rng = np.random.default_rng(seed)
    ho, wo = (h - k + 1) // 2, (w - k + 1) // 2
    f32 = np.float32
    inputs = {"x": rng.standard_normal((n, c, h, w)).astype(f32),
              "w": (rng.standard_normal((outs, c, k, k)) / np.sqrt(c * k * k)).astype(f32),
              "b": (0.3 * rng.standard_normal(outs)).astype(f32), "dout": rng.standard_normal((n, outs, ho, wo)).astype(f32)}
    cp = build(gpu_device, "tf32", c, h, w, outs, k)
    runs = []
    try:
        for max_blocks in (cp.max_blocks, blocks):
            cp.max_blocks = max_blocks
            with Scratch(stream, **inputs, out=np.full((n, outs, ho, wo), np.nan, f32),
                         arg=np.full((n, outs, ho, wo), 77, np.uint8), dx=np.full((n, c, h, w), np.nan, f32)) as s:
                cp.forward(stream, s["x"], s["w"], s["b"], s["out"], s["arg"], n, outs, h, w)
                if not first:
                    cp.backward_data(stream, s["dout"], s["arg"], s["w"], s["dx"], n, outs, h, w)
                runs.append({key: s.get(key) for key in ("out", "arg", "dx")})
    finally:
        cp.close()
    default, few = runs
    for key in ("out", "arg", "dx"):
        assert np.array_equal(default[key].view(np.uint8), few[key].view(np.uint8)), \
            f"{name}: {key}, {blocks} blocks, seed {seed}"
    assert not np.isnan(few["out"]).any() and (first or not np.isnan(few["dx"]).any()), \
        f"{name}: unwritten outputs, seed {seed}"


@pytest.mark.parametrize("case", CASES[:1] + CASES[2:], ids=[CASES[0][0], CASES[2][0]])
def test_tc_passes_through_sample_indices_give_the_gathered_rows_bits(gpu_device, stream, seed, case):
    """A first layer reading its batch where it lies (`samples`: indices into the images, repeats
    among them) against the same rows gathered into x: the forward's outputs and argmaxes and the
    weight gradient bit for bit."""
    name, n, c, h, w, outs, k, _ = case
    rng = np.random.default_rng(seed)
    f32 = np.float32
    images = rng.standard_normal((n + 9, c, h, w)).astype(f32)
    samples = rng.integers(0, len(images), n).astype(np.int32)
    ho, wo = (h - k + 1) // 2, (w - k + 1) // 2
    cp = build(gpu_device, "tf32", c, h, w, outs, k)
    results = []
    try:
        with Scratch(stream, images=images, gathered=images[samples], samples=samples,
                     w=(rng.standard_normal((outs, c, k, k)) / np.sqrt(c * k * k)).astype(f32),
                     b=(0.3 * rng.standard_normal(outs)).astype(f32),
                     dout=rng.standard_normal((n, outs, ho, wo)).astype(f32), out=np.zeros((n, outs, ho, wo), f32),
                     arg=np.zeros((n, outs, ho, wo), np.uint8),
                     partial=np.zeros(outs * cp.chunks(n) * (cp.taps + 1), f32), dw=np.zeros(outs * cp.taps, f32),
                     db=np.zeros(outs, f32)) as s:
            for x, through in ((s["images"], {"samples": s["samples"]}), (s["gathered"], {})):
                cp.forward(stream, x, s["w"], s["b"], s["out"], s["arg"], n, outs, h, w, **through)
                cp.weight_grad(stream, x, s["dout"], s["arg"], s["partial"], s["dw"], s["db"], n, outs, h, w, **through)
                results.append([s.get(key) for key in ("out", "arg", "dw", "db")])
    finally:
        cp.close()
    for what, a, b in zip(("out", "arg", "dw", "db"), *results):
        assert a.tobytes() == b.tobytes(), f"{name}, {what}, seed {seed}"
    assert np.any(results[0][0] != 0), f"{name}, seed {seed}: a forward of zeros"
