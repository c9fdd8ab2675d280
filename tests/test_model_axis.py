"""The model axis without a GPU: K models of one shape in one launch (graphtrain.kernels,
model_axis.cuh). Each launcher that has it, against a driver that records what it is given:
one model is the launch as it was (the same grid and arguments, a stride of 0); K models are the
same launch with gridDim.z = K and the stride in the kernel's stride arguments, nothing else
changed, but where a kernel's blocks loop over its samples (GRID_BY_LAUNCH: fewer blocks a model,
at most max_blocks in all, the shared memory of the samples each then stages). The refusals; the strided batched product's call against `gemm`'s; the files compiled
for the speedrun's layer shapes. tests/test_model_axis_gpu.py runs them."""

from __future__ import annotations

import re
import types

import pytest

from graphtrain import kernels
from graphtrain.kernels import KERNELS_DIR, KernelFile, model_grid, model_stride_arg
from graphtrain.libs import nvrtc
from test_libs_cpu import ELF_MAGIC, read_params, recording_driver  # noqa: F401 (a fixture)

S = 3 << 20  # bytes from one model's buffers to the next's
DEVICE = types.SimpleNamespace(sm_count=132, arch="sm_90", ordinal=0, sm_shared_bytes=228 * 1024, sm_registers=64 * 1024,
                                 sm_threads=2048)
# The speedrun cnn's conv layers: (c, h, w, outs, k).
CONV1, CONV2 = (1, 28, 28, 24, 5), (24, 12, 12, 32, 3)


@pytest.fixture
def uncompiled(monkeypatch, recording_driver):  # noqa: F811 (the fixture, imported)
    """KernelFile's set-up without compiling or loading: each declared kernel a recorded one, the
    defines a build would get kept in `built_with`."""
    def init(self, device, defines=None):
        self.module, self.built_with = None, {**self.defines, **(defines or {})}
        for attr, spec in self.specs().items():
            setattr(self, attr, nvrtc.Kernel(spec, spec.name))

    monkeypatch.setattr(KernelFile, "__init__", init)
    return recording_driver


def build(name: str):
    """A launcher object of the cnn's step, by name."""
    from graphtrain.kernels.cnn import Cnn
    from graphtrain.kernels.convpool import ConvPool
    from graphtrain.kernels.convpool_tc import ConvPoolTc
    from graphtrain.kernels.fused import Fused
    from graphtrain.kernels.gather import Gather
    from graphtrain.kernels.head import Head
    from graphtrain.kernels.layers import Layers
    from graphtrain.kernels.optim import Optim

    c1, h1, w1, o1, k1 = CONV1
    c2, h2, w2, o2, k2 = CONV2
    return {"gather": lambda: Gather(DEVICE),
            "tc conv1": lambda: ConvPoolTc(DEVICE, c1, h1, w1, k1, 2, o1),
            "tc conv2": lambda: ConvPoolTc(DEVICE, c2, h2, w2, k2, 2, o2),
            "fp32 conv1": lambda: ConvPool(DEVICE, c1, k1, 2, o1),  # few taps: the register weight gradient
            "fp32 conv2": lambda: ConvPool(DEVICE, c2, k2, 2, o2),  # many: the per-tap one
            "head": lambda: Head(DEVICE, 10), "fused": lambda: Fused(DEVICE, 10, bf16=False),
            "layers": lambda: Layers(DEVICE), "cnn": lambda: Cnn(DEVICE), "optim": lambda: Optim(DEVICE)}[name]()


P = [0x7000_0000 + 0x1_0000 * i for i in range(10)]  # distinct device addresses
N = 256  # the batch
# (launcher, method, arguments, each launch's stride arguments for 3 models): every launch the cnn's
# fused step and evaluation make through these files.
CASES = [
    ("gather", "gather_batch_at", (P[0], P[1], P[2], P[3], 784, N, P[4], P[5]), {}, [(S,)]),
    ("gather", "gather_samples_at", (P[1], P[2], P[3], N, P[4], P[5]), {}, [(S,)]),
    # the first layer reading its batch through sample indices: the training set shared (x_stride 0)
    ("tc conv1", "forward", (P[0], P[1], P[2], P[3], P[4], N, CONV1[3], CONV1[1], CONV1[2]), {"samples": P[9]},
     [(0, S)]),
    ("tc conv1", "weight_grad", (P[0], P[1], P[2], P[3], P[4], P[5], N, CONV1[3], CONV1[1], CONV1[2]),
     {"samples": P[9]}, [(S,), (S,)]),
    *[(conv, "forward", (P[0], P[1], P[2], P[3], P[4], N, o, h, w), {}, [(S, S)])
      for conv, (_, h, w, o, _) in (("tc conv1", CONV1), ("tc conv2", CONV2), ("fp32 conv1", CONV1),
                                    ("fp32 conv2", CONV2))],
    *[(conv, "forward", (P[0], P[1], P[2], P[3], P[4], 10_000, o, h, w), {"shared_input": True}, [(0, S)])
      for conv, (_, h, w, o, _) in (("tc conv1", CONV1), ("fp32 conv1", CONV1))],
    *[(conv, "weight_grad", (P[0], P[1], P[2], P[3], P[4], P[5], N, o, h, w), {}, [(S,), (S,)])
      for conv, (_, h, w, o, _) in (("tc conv1", CONV1), ("tc conv2", CONV2), ("fp32 conv1", CONV1),
                                    ("fp32 conv2", CONV2))],
    *[(conv, "backward_data", (P[0], P[1], P[2], P[3], N, 32, 12, 12), {}, [(S,)])
      for conv in ("tc conv2", "fp32 conv2")],
    ("head", "logits_loss", (P[0], P[1], P[2], P[3], P[4], P[5], P[6], P[7], N, 128, 60_000, P[8]), {}, [(S,)]),
    ("head", "logits_loss", (P[0], P[1], P[2], P[3], P[4], P[5], P[6], P[7], N, 128, 60_000), {}, [(S,)]),
    ("head", "grads", (P[0], P[1], P[2], P[3], N, 128), {}, [(S,)]),
    ("fused", "head_backward", (P[0], P[1], P[2], P[3], P[4], 128, N), {}, [(S,)]),
    ("fused", "relu_bias_grad", (P[0], P[1], P[2], 128, N), {}, [(S,)]),
    ("layers", "bias_relu", (P[0], P[1], N, 128, True), {}, [(S,)]),
    ("layers", "bias_relu", (P[0], 0, N, 128, False), {}, [(S,)]),
    ("layers", "bias_grad", (P[0], P[1], N, 128), {}, [(S,)]),
    ("cnn", "softmax_xent_step", (P[0], P[1], P[2], P[3], N, 60_000, 10, P[4]), {}, [(S,)]),
    ("cnn", "count_correct", (P[0], P[1], 10_000, 10, P[2]), {}, [(S,)]),
    # the optimizer over the speedrun cnn's span (its parameters each 64-float aligned), with and without state
    ("optim", "step", (P[0], P[1], P[2], P[3], 215_360, P[4], P[5], P[6]), {}, [(S,)]),
    ("optim", "step", (P[0], P[1], 0, 0, 215_360, P[4], P[5], P[6]), {}, [(S,)]),
]


# The kernels whose grid x follows the whole launch's work (convpool_tc.py's _grid): each output's
# sum is the same whatever block computes it (test_convpool_gpu.py's bit-identity across grids).
GRID_BY_LAUNCH = {"convpool_tc_forward", "convpool_tc_backward_data"}
# The optimizer's blocks over all models at most PACK_BLOCKS (an elementwise update: any grid, the same bits).
OPTIMIZER_BLOCKS = 2112


class FakeStream:
    handle = 0x5EA


def launches(driver, launcher, method: str, args, kwargs) -> list[tuple]:
    """Each launch the call makes: (kernel, grid, block, shared bytes, argument values)."""
    driver.calls.clear()
    getattr(launcher, method)(FakeStream(), *args, **kwargs)
    out = []
    for call, (function, gx, gy, gz, bx, by, bz, shared, _, params, _) in driver.calls:
        assert call == "cuLaunchKernel", call
        spec = next(s for s in launcher.specs().values() if s.name == function)
        out.append((function, (gx, gy, gz), (bx, by, bz), shared, read_params(params, list(spec.arg_types))))
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}.{c[1]}{'+' + ','.join(c[3]) if c[3] else ''}")
def test_models_go_along_z_and_only_the_strides_change(uncompiled, case):
    name, method, args, extra, strides = case
    launcher = build(name)
    one = launches(uncompiled, launcher, method, args, extra)
    assert len(one) == len(strides)
    # A stride given with one model changes nothing: the launch is the one-model launch.
    assert launches(uncompiled, launcher, method, args, {**extra, "models": 1, "model_stride": S}) == one
    three = launches(uncompiled, launcher, method, args, {**extra, "models": 3, "model_stride": S})
    for (f1, g1, b1, sh1, a1), (f3, g3, b3, sh3, a3), tail in zip(one, three, strides):
        t = len(tail)
        assert f3 == f1 and b3 == b1, f1
        if f1 in GRID_BY_LAUNCH:
            assert g1[2] == 1 and g3[1:] == (g1[1], 3) and 1 <= g3[0] <= g1[0], f1
            assert 3 * g3[0] <= launcher.max_blocks and sh3 >= sh1, f1
        elif f1 == "optimizer_step":
            assert g1[2] == 1 and g3[1:] == (g1[1], 3) and 1 <= g3[0] <= g1[0] and sh3 == sh1, f1
            assert 3 * g3[0] <= OPTIMIZER_BLOCKS, f1
        else:
            assert sh3 == sh1, f1
            assert g1[2] == 1 and g3 == (g1[0], g1[1], 3), f1
        assert a1[-t:] == [0] * t and a3[-t:] == list(tail), f1
        assert a3[:-t] == a1[:-t], f1


@pytest.mark.parametrize("conv", ["tc conv1", "tc conv2"])
def test_the_tc_weight_gradient_takes_a_block_a_slice_of_chunks_once_the_models_fill_every_sm(uncompiled, conv):
    """A block a chunk until REDUCE_SLICES blocks a model fill two blocks an SM (132 SMs: 33 models),
    then REDUCE_SLICES blocks a model; the reduce sums as many partials as there were blocks."""
    from graphtrain.kernels.convpool_tc import REDUCE_SLICES

    launcher = build(conv)
    chunks = -(-N // launcher.chunk)
    assert chunks > REDUCE_SLICES
    _, h, w, o, _ = CONV1 if conv == "tc conv1" else CONV2
    args = (P[0], P[1], P[2], P[3], P[4], P[5], N, o, h, w)
    for models, blocks in ((1, chunks), (32, chunks), (33, REDUCE_SLICES), (64, REDUCE_SLICES)):
        grad, reduce = launches(uncompiled, launcher, "weight_grad", args, {"models": models, "model_stride": S})
        assert grad[1] == (blocks, 1, models) and reduce[4][-2] == blocks, (conv, models)


@pytest.mark.parametrize("models,stride,why", [
    (0, S, "models must be"), (kernels.MAX_MODELS + 1, S, "models must be"), (True, S, "models must be"),
    (2.0, S, "models must be"), (2, -256, "model_stride must be"), (2, 100, "model_stride must be"),
    (1, 100, "model_stride must be"), (2, 0, "would write one another's"),
])
def test_a_model_count_or_stride_the_kernels_cannot_take_is_refused_before_any_launch(uncompiled, models, stride,
                                                                                     why):
    launcher = build("layers")
    with pytest.raises(ValueError, match=why):
        launcher.bias_grad(FakeStream(), P[0], P[1], N, 128, models=models, model_stride=stride)
    assert [c for c in uncompiled.calls if c[0] == "cuLaunchKernel"] == []


def test_the_stride_and_the_grid_of_one_model_are_the_launch_as_it_was():
    assert model_stride_arg(1, 0) == model_stride_arg(1, S) == 0
    assert model_stride_arg(4, S) == S
    assert model_grid(7, 1) == 7 and model_grid((5, 6, 1), 1) == (5, 6, 1)
    assert model_grid(7, 4) == (7, 1, 4) and model_grid((5, 6, 1), 4) == (5, 6, 4)
    with pytest.raises(ValueError, match="already uses z"):
        model_grid((5, 6, 2), 4)


def test_only_the_model_axis_uses_the_grids_z():
    """Model k is blockIdx.z in every kernel that has the axis: no kernel may use z for anything else."""
    for path in sorted(KERNELS_DIR.glob("*.cu*")):
        if path.name != "model_axis.cuh":
            code = re.sub(r"//[^\n]*", "", path.read_text(encoding="utf-8"))
            assert not re.search(r"(blockIdx|gridDim)\.z", code), path.name


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", ["tc conv1", "tc conv2", "fp32 conv1", "fp32 conv2", "optim"])
def test_the_conv_kernels_and_the_optimizer_compile_for_the_speedrun_layers(nvrtc_available, cache, uncompiled, name, arch):
    launcher = build(name)
    assert type(launcher).cubin(arch, launcher.built_with).startswith(ELF_MAGIC)


# ---- the strided batched product -----------------------------------------------------------------


class RecordingBlas:
    """cuBLAS's two products, recorded."""

    def __init__(self):
        self.calls = []
        self.cublasGemmEx = lambda *a: self.calls.append(("cublasGemmEx", a)) or 0
        self.cublasGemmStridedBatchedEx = lambda *a: self.calls.append(("cublasGemmStridedBatchedEx", a)) or 0


@pytest.fixture
def blas():
    import ctypes

    from graphtrain.libs import cublas

    lib = RecordingBlas()
    handle = cublas.Cublas.__new__(cublas.Cublas)  # a handle's state, without cuBLAS
    handle._lib, handle._handle, handle._compute_type = lib, ctypes.c_void_p(0x11), cublas.CUBLAS_COMPUTE_32F_FAST_TF32
    handle._alpha, handle._beta = ctypes.c_float(), ctypes.c_float()
    handle._alpha_ref, handle._beta_ref = ctypes.byref(handle._alpha), ctypes.byref(handle._beta)
    return handle, lib


@pytest.mark.parametrize("transa,transb", [(False, False), (False, True), (True, False), (True, True)])
def test_a_strided_batched_product_is_gemms_call_with_the_strides_and_the_batch(blas, transa, transb):
    """The same operand swap as `gemm` (row-major C = column-major Cᵀ = op(B)ᵀ·op(A)ᵀ), each stride
    beside its own matrix, the batch before the compute type."""
    handle, lib = blas
    m, n, k = 6, 5, 4
    lda, ldb, ldc = (m if transa else k) + 1, (k if transb else n) + 2, n + 3
    handle.gemm(transa, transb, m, n, k, 1.0, P[0], lda, P[1], ldb, 0.0, P[2], ldc)
    handle.gemm_strided_batched(transa, transb, m, n, k, 1.0, P[0], lda, 1000, P[1], ldb, 0, 0.0, P[2], ldc, 2000, 3)
    (_, single), (name, batched) = lib.calls
    assert name == "cublasGemmStridedBatchedEx"
    # gemm: handle, ta, tb, m, n, k, alpha, B, type, ldb, A, type, lda, beta, C, type, ldc, compute, algo
    expected = [*single[:10], 0, *single[10:13], 1000, *single[13:17], 2000, 3, *single[17:]]
    assert list(batched) == expected
    assert single[3:6] == (n, m, k) and single[7] == P[1] and single[10] == P[0]


def test_a_strided_batched_product_checks_its_batch_and_strides():
    from graphtrain.libs.cublas import GemmShapeError, check_gemm_batch

    check_gemm_batch(8, 6, 3, 0, 0, 48)  # inputs shared, outputs 8 rows of 6 apart
    check_gemm_batch(8, 6, 1, 0, 0, 0)  # one product: any stride
    for bad in [dict(batch=0), dict(stride_a=-1), dict(stride_b=-5), dict(stride_c=47), dict(stride_c=0)]:
        args = {**dict(m=8, ldc=6, batch=3, stride_a=100, stride_b=100, stride_c=48), **bad}
        with pytest.raises(GemmShapeError):
            check_gemm_batch(**args)
