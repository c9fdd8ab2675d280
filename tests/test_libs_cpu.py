"""The CUDA layer's logic that needs no GPU: declaration parsing, arena planning, NVRTC
compilation and its disk cache, status names, and `probe()`.

Compiling needs only NVRTC (the `test` extra installs it); those tests skip, saying why, when it
cannot be loaded.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from graphtrain.errors import GpuUnavailableError, GraphtrainError, UsageError
from graphtrain.libs import cuda, memory, nvrtc

KERNELS = sorted((Path(__file__).resolve().parents[1] / "graphtrain" / "kernels").glob("*.cu"))
ELF_MAGIC = b"\x7fELF"

SAXPY = r"""
extern "C" __global__ void saxpy(float a, const float* __restrict__ x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""


@pytest.fixture(scope="module")
def nvrtc_available() -> str:
    try:
        import cuda.bindings.nvrtc  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"cuda.bindings.nvrtc cannot be imported: {exc}")
    try:
        return nvrtc.nvrtc_version()
    except GpuUnavailableError as exc:
        pytest.skip(f"libnvrtc cannot be loaded: {exc}")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "kernel-cache"
    monkeypatch.setenv("GRAPHTRAIN_CACHE", str(folder))
    return folder


# --------------------------------------------------------------------------------------------
# kernel_signatures


def test_signatures_map_each_parameter_to_a_ctype():
    source = r"""
    extern "C" __global__ void k(const float* __restrict__ x, float *y, float* const z, double* d,
                                 const int* __restrict__ idx, unsigned char* bytes, const float p[],
                                 int n, unsigned u, unsigned int ui, long long ll, float a, double b) {}
    """
    sig = nvrtc.kernel_signatures(source)
    assert sig == {"k": [ctypes.c_void_p] * 7 + [ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_longlong,
                                                ctypes.c_float, ctypes.c_double]}


def test_signatures_handle_layouts_comments_and_blocks():
    source = r"""
    #include <cstdint>
    // extern "C" __global__ void commented_out(bool flag) {}
    /* extern "C" __global__ void also_commented(bool flag) {} */
    extern "C"
    __global__
    void
    multi_line(
        const float* x,   // a comment inside the list
        int64_t n         /* another */
    ) {}
    extern "C" __global__ void __launch_bounds__(256) bounded(int n) { const char* s = "// not a comment"; }
    extern "C" __global__ __launch_bounds__(128, 2) void bounded_first(float* y) {}
    extern "C" __global__ void no_params() {}
    extern "C" __global__ void void_params(void) {}
    extern "C" __global__ void declared(float* y, int n);
    extern "C" __global__ void declared(float* y, int n) {}
    extern "C" {
    __global__ void in_block(double* y, unsigned n) {}
    __device__ float helper(float x) { return x; }
    __global__ void in_block_2(long long n) {}
    }
    __global__ void mangled(float* y) {}
    template <typename T> __global__ void templated(T* y) {}
    """
    sig = nvrtc.kernel_signatures(source)
    assert sig == {
        "multi_line": [ctypes.c_void_p, ctypes.c_int64],
        "bounded": [ctypes.c_int],
        "bounded_first": [ctypes.c_void_p],
        "no_params": [],
        "void_params": [],
        "declared": [ctypes.c_void_p, ctypes.c_int],
        "in_block": [ctypes.c_void_p, ctypes.c_uint],
        "in_block_2": [ctypes.c_longlong],
    }


@pytest.mark.parametrize("param", ["bool flag", "const bool flag"])
def test_signatures_forbid_bool(param):
    with pytest.raises(nvrtc.KernelSignatureError, match="bool"):
        nvrtc.kernel_signatures(f'extern "C" __global__ void k(float* y, {param}) {{}}')


@pytest.mark.parametrize("param", ["float2 v", "short s", "MyStruct s", "int& r"])
def test_signatures_reject_types_python_cannot_pass(param):
    with pytest.raises(nvrtc.KernelSignatureError, match="kernel k"):
        nvrtc.kernel_signatures(f'extern "C" __global__ void k({param}) {{}}')


def test_signatures_reject_conflicting_redeclaration():
    source = 'extern "C" __global__ void k(int n);\nextern "C" __global__ void k(float x) {}'
    with pytest.raises(nvrtc.KernelSignatureError, match="declared twice"):
        nvrtc.kernel_signatures(source)


@pytest.mark.parametrize("path", KERNELS, ids=[p.name for p in KERNELS])
def test_project_kernel_declarations_parse(path):
    sig = nvrtc.kernel_signatures(path.read_text())
    assert sig, f'{path.name} declares no extern "C" __global__ kernel'


# --------------------------------------------------------------------------------------------
# Arena planning (no GPU: allocation is a separate step, faked here)


@pytest.fixture
def fake_device_memory(monkeypatch):
    calls = {"malloc": [], "free": []}
    base = 0x7F00_0000_0000

    def fake_malloc(nbytes):
        calls["malloc"].append(nbytes)
        return base

    monkeypatch.setattr(cuda, "malloc", fake_malloc)
    monkeypatch.setattr(cuda, "free", lambda ptr: calls["free"].append(ptr))
    calls["base"] = base
    return calls


def test_arena_offsets_are_aligned_and_disjoint():
    arena = memory.Arena()
    specs = [("a", (3,), np.float32), ("b", (7, 5), np.float64), ("c", (1,), np.uint8), ("d", (0,), np.float32),
             ("e", (128, 784), np.float32), ("f", 300, np.int32), ("g", (), np.float32)]
    bufs = [arena.reserve(name, shape, dtype) for name, shape, dtype in specs]
    for buf, (_, _, dtype) in zip(bufs, specs):
        assert buf.offset % memory.ALIGNMENT == 0
        assert buf.dtype == np.dtype(dtype)
        assert buf.size == int(np.prod(buf.shape))
        assert buf.nbytes == buf.size * buf.dtype.itemsize
    intervals = sorted((b.offset, b.offset + b.nbytes) for b in bufs if b.nbytes)
    for (_, end), (start, _) in zip(intervals, intervals[1:]):
        assert end <= start
    assert arena.nbytes % memory.ALIGNMENT == 0
    assert arena.nbytes >= max(end for _, end in intervals)
    assert list(arena.buffers) == [name for name, _, _ in specs]
    assert bufs[5].shape == (300,)


def test_arena_rejects_duplicates_bad_shapes_and_late_reserves(fake_device_memory):
    arena = memory.Arena()
    arena.reserve("w", (4, 4))
    with pytest.raises(UsageError, match="already reserved"):
        arena.reserve("w", (2,))
    for bad in [(-1, 3), (2.5,), "abc", None]:
        with pytest.raises(ValueError):
            arena.reserve("bad", bad)
    arena.allocate()
    with pytest.raises(UsageError, match="already allocated"):
        arena.reserve("late", (1,))
    with pytest.raises(UsageError, match="already allocated"):
        arena.allocate()


def test_buffer_ptr_needs_allocation_then_is_base_plus_offset(fake_device_memory):
    arena = memory.Arena()
    x = arena.reserve("x", (10,))
    y = arena.reserve("y", (20, 3), np.int32)
    with pytest.raises(UsageError, match="allocate"):
        _ = x.ptr
    arena.allocate()
    assert fake_device_memory["malloc"] == [arena.nbytes]  # exactly one allocation, for the total
    assert x.ptr == fake_device_memory["base"] + x.offset
    assert y.ptr == fake_device_memory["base"] + y.offset
    arena.close()
    arena.close()
    assert fake_device_memory["free"] == [fake_device_memory["base"]]  # freed once
    with pytest.raises(UsageError, match="closed"):
        _ = y.ptr


def test_arena_context_manager_frees_and_empty_arena_refuses(fake_device_memory):
    with memory.Arena() as arena:
        arena.reserve("x", (1,))
        arena.allocate()
    assert fake_device_memory["free"] == [fake_device_memory["base"]]
    with pytest.raises(UsageError, match="nothing to allocate"):
        memory.Arena().allocate()


def test_buffer_upload_checks_shape_and_dtype_before_copying(fake_device_memory, monkeypatch):
    copies = []
    monkeypatch.setattr(cuda, "copy_to_device", lambda ptr, array, stream: copies.append((ptr, array)))
    arena = memory.Arena()
    buf = arena.reserve("w", (2, 3))
    arena.allocate()
    with pytest.raises(ValueError, match="shape"):
        buf.upload(np.zeros((3, 2), np.float32), None)
    with pytest.raises(ValueError, match="float64"):
        buf.upload(np.zeros((2, 3), np.float64), None)
    assert copies == []
    source = np.arange(6, dtype=np.float32).reshape(3, 2).T  # not C-contiguous
    buf.upload(source, None)
    (ptr, sent), = copies
    assert ptr == buf.ptr and sent.flags.c_contiguous and np.array_equal(sent, source)


# --------------------------------------------------------------------------------------------
# NVRTC


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compile_small_kernel_gives_a_cubin(nvrtc_available, cache, arch):
    cubin = nvrtc.compile_cubin(SAXPY, "saxpy.cu", arch)
    assert cubin.startswith(ELF_MAGIC)


def test_compile_error_carries_the_log_and_file_name(nvrtc_available, cache):
    source = 'extern "C" __global__ void broken(float* y) {\n    y[0] = undefined_name;\n}\n'
    with pytest.raises(nvrtc.NvrtcError) as info:
        nvrtc.compile_cubin(source, "broken.cu", "sm_80")
    message = str(info.value)
    assert "broken.cu" in message
    assert "undefined_name" in message and "error" in message
    assert info.value.log and "broken.cu(2)" in info.value.log


def test_disk_cache_is_hit_the_second_time(nvrtc_available, cache, monkeypatch):
    before = nvrtc.CompileCounters(**vars(nvrtc.counters))
    first = nvrtc.compile_cubin(SAXPY, "saxpy.cu", "sm_90")
    assert nvrtc.counters.compiles == before.compiles + 1
    assert len(list(cache.glob("*.cubin"))) == 1

    def no_compile(*args, **kwargs):
        raise AssertionError("NVRTC ran although the cubin was cached")

    monkeypatch.setattr(nvrtc, "_compile", no_compile)
    second = nvrtc.compile_cubin(SAXPY, "saxpy.cu", "sm_90")
    assert second == first
    assert nvrtc.counters.cache_hits == before.cache_hits + 1


def test_cache_key_covers_arch_and_options(nvrtc_available, cache):
    nvrtc.compile_cubin(SAXPY, "saxpy.cu", "sm_80")
    nvrtc.compile_cubin(SAXPY, "saxpy.cu", "sm_90")
    nvrtc.compile_cubin(SAXPY, "saxpy.cu", "sm_90", options=["-lineinfo"])
    assert len(list(cache.glob("*.cubin"))) == 3


def test_corrupt_cache_entry_is_recompiled(nvrtc_available, cache):
    good = nvrtc.compile_cubin(SAXPY, "saxpy.cu", "sm_90")
    (entry,) = cache.glob("*.cubin")
    entry.write_bytes(entry.read_bytes()[:40] + b"garbage")
    compiles = nvrtc.counters.compiles
    assert nvrtc.compile_cubin(SAXPY, "saxpy.cu", "sm_90") == good
    assert nvrtc.counters.compiles == compiles + 1
    assert not list(cache.glob("*.tmp"))


def test_bad_arch_is_a_usage_error():
    with pytest.raises(UsageError):
        nvrtc.compile_cubin(SAXPY, "saxpy.cu", "compute_90")


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAPHTRAIN_CACHE", str(tmp_path / "explicit"))
    assert nvrtc.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("GRAPHTRAIN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert nvrtc.cache_dir() == tmp_path / "xdg" / "graphtrain" / "kernels"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("path", KERNELS, ids=[p.name for p in KERNELS])
def test_every_project_kernel_compiles(nvrtc_available, cache, path, arch):
    cubin = nvrtc.compile_cubin(path.read_text(), path.name, arch)
    assert cubin.startswith(ELF_MAGIC)


# --------------------------------------------------------------------------------------------
# Status names, errors, probe


def test_cublas_status_names():
    from graphtrain.libs import cublas

    expected = {0: "SUCCESS", 1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE", 8: "ARCH_MISMATCH",
                11: "MAPPING_ERROR", 13: "EXECUTION_FAILED", 14: "INTERNAL_ERROR", 15: "NOT_SUPPORTED",
                16: "LICENSE_ERROR"}
    for code, name in expected.items():
        assert cublas.status_name(code) == f"CUBLAS_STATUS_{name}"
    error = cublas.CublasError("cublasGemmEx", 7)
    assert isinstance(error, GraphtrainError)
    assert error.status == "CUBLAS_STATUS_INVALID_VALUE"
    assert str(error) == "cublasGemmEx failed: CUBLAS_STATUS_INVALID_VALUE"


def test_check_unwraps_values_and_names_failures():
    try:
        from cuda.bindings import driver, runtime
    except ImportError:
        pytest.skip("cuda-bindings is not installed")
    assert cuda.check((runtime.cudaError_t.cudaSuccess,), "x") is None
    assert cuda.check((runtime.cudaError_t.cudaSuccess, 5), "x") == 5
    assert cuda.check((driver.CUresult.CUDA_SUCCESS, 1, 2), "x") == (1, 2)
    with pytest.raises(cuda.CudaError, match="cudaMalloc failed: cudaErrorMemoryAllocation") as info:
        cuda.check((runtime.cudaError_t.cudaErrorMemoryAllocation, None), "cudaMalloc")
    assert info.value.call == "cudaMalloc" and info.value.status == "cudaErrorMemoryAllocation"
    with pytest.raises(cuda.CudaError, match="cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE"):
        cuda.check((driver.CUresult.CUDA_ERROR_INVALID_VALUE,), "cuLaunchKernel")


def test_everything_imports_and_probes_without_cuda_bindings():
    # A fresh interpreter in which `import cuda...` fails, as on a machine with no CUDA package.
    import json
    import subprocess
    import sys

    script = """
import importlib.abc, json, sys
class NoCuda(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "cuda" or name.startswith("cuda."):
            raise ImportError(f"blocked {name}")
sys.meta_path.insert(0, NoCuda())
from graphtrain.errors import GpuUnavailableError
from graphtrain.libs import cuda, cublas, cudnn, memory, nvrtc, probe
report = probe()
try:
    cuda.open_device()
    opened = "opened"
except GpuUnavailableError as exc:
    opened = str(exc)
print(json.dumps({"report": report, "opened": opened, "versions": cuda.versions()}))
"""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "graphtrain[cu12]" in result["opened"] and "graphtrain[cu13]" in result["opened"]
    assert result["report"]["cuda_bindings"]["found"] is False
    assert result["report"]["nvrtc"]["found"] is False
    assert result["versions"]["runtime"] is None


def test_versions_never_raise():
    found = cuda.versions()
    assert set(found) >= {"cuda_bindings", "runtime", "driver_cuda", "driver"}


def test_probe_reports_every_component_without_raising():
    from graphtrain.libs import probe

    report = probe()
    assert set(report) == {"cuda_bindings", "driver", "nvrtc", "cublas", "cudnn"}
    for name, entry in report.items():
        assert isinstance(entry["found"], bool), name
        if not entry["found"]:
            assert entry.get("error"), f"{name} is missing but probe() does not say why"
            assert entry.get("install"), f"{name} is missing but probe() does not say what installs it"
