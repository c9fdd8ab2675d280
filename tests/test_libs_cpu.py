"""The CUDA layer's logic that needs no GPU: kernel declarations checked by the compiler, launch
encoding against a recording driver, arena planning, NVRTC compilation and its disk cache,
errors and their exit codes, and `probe()`.

Compiling needs only NVRTC (the `nvrtc-cu13` or `nvrtc-cu12` extra installs it); those tests skip,
saying why, when it cannot be loaded. The launch tests need cuda-bindings' Python structures, not a driver.
"""

from __future__ import annotations

import ctypes
import fnmatch
import importlib
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import numpy as np
import pytest

from graphtrain import files
from graphtrain.errors import GpuUnavailableError, GraphtrainError, UsageError
from graphtrain.kernels import F32, F64, I32, I64, KERNELS_DIR, PTR, U32, KernelFile, compile_kernels, kernel
from graphtrain.libs import cuda, memory, nvrtc

ROOT = Path(__file__).resolve().parents[1]
KERNEL_FILES = sorted(p.stem for p in KERNELS_DIR.glob("*.cu"))
ELF_MAGIC = b"\x7fELF"

SAXPY = r"""
extern "C" __global__ void saxpy(float a, const float* __restrict__ x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""
SAXPY_SPEC = kernel("saxpy", F32, PTR, PTR, I32)




def launcher_class(stem: str) -> type[KernelFile]:
    """The KernelFile subclass in graphtrain/kernels/<stem>.py."""
    module = importlib.import_module(f"graphtrain.kernels.{stem}")
    found = [v for v in vars(module).values()
             if isinstance(v, type) and issubclass(v, KernelFile) and v is not KernelFile]
    assert len(found) == 1, f"kernels/{stem}.py should define one KernelFile, not {found}"
    return found[0]


# --------------------------------------------------------------------------------------------
# Declarations: checked in Python when made, and by the compiler against the .cu


def test_declarations_take_only_types_a_kernel_can_receive():
    with pytest.raises(nvrtc.KernelArgumentError, match="argument 1"):
        kernel("k", PTR, ctypes.c_bool)
    with pytest.raises(nvrtc.KernelArgumentError):
        kernel("k", int)
    with pytest.raises(ValueError, match="cluster"):
        kernel("k", PTR, cluster=(0, 1))
    assert kernel("k", PTR, cluster=(4,)).cluster == (4, 1, 1)


@pytest.mark.parametrize("stem", KERNEL_FILES)
def test_every_kernel_file_has_a_launcher_module_beside_it(stem):
    cls = launcher_class(stem)
    assert cls.stem == stem
    assert cls.specs(), f"kernels/{stem}.py declares no kernel"
    source = cls.source()  # the file and the headers put before it
    for name in cls.defines:  # each block size is written once, in Python
        used = name.removesuffix("_ELEMENT")  # a layout region's element size: checked by its offset's SMEM_REGION
        assert used in source and f"#define {name}" not in source, name
    for attr, spec in cls.specs().items():
        assert attr == f"_{spec.name}", f"{stem}.py declares kernel {spec.name} as {attr}"


def test_a_compile_error_names_the_kernel_file_and_its_line(monkeypatch, tmp_path):
    # source() puts the headers before the file: a `#line` before each keeps messages (and a
    # profiler's source lines) in the file's own numbering, not the concatenation's.
    monkeypatch.setenv("GRAPHTRAIN_CACHE", str(tmp_path))
    cls = next(launcher_class(stem) for stem in KERNEL_FILES if launcher_class(stem).headers)
    cu = (KERNELS_DIR / f"{cls.stem}.cu").read_text(encoding="utf-8")
    source = cls.source()
    assert source.count(cu) == 1
    lines = cu.split("\n")
    lines[4] = "#error marker"  # the file's line 5
    with pytest.raises(nvrtc.NvrtcError) as failed:
        compile_kernels(source.replace(cu, "\n".join(lines)), f"{cls.stem}.cu", "sm_90", cls.specs().values(),
                        cls.defines)
    assert f"graphtrain/kernels/{cls.stem}.cu(5)" in str(failed.value), str(failed.value)[:2000]


def test_every_header_a_launcher_names_exists_and_ships_with_the_package():
    shipped = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["graphtrain"]
    named = {header for stem in KERNEL_FILES for header in launcher_class(stem).headers}
    assert named, "no launcher names a header"
    for header in named:
        assert (KERNELS_DIR / header).is_file(), header
        assert any(fnmatch.fnmatch(f"kernels/{header}", pattern) for pattern in shipped), header


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("stem", KERNEL_FILES)
def test_every_kernel_file_compiles_with_its_declarations(nvrtc_available, cache, stem, arch):
    launcher = launcher_class(stem)
    if int(arch.removeprefix("sm_")) < launcher.min_arch:  # clusters: Hopper and later only
        with pytest.raises(nvrtc.NvrtcError, match="requires .target sm_90"):
            launcher.cubin(arch)
        return
    assert launcher.cubin(arch).startswith(ELF_MAGIC)


@pytest.mark.parametrize("spec,needle", [
    (kernel("saxpy", F32, PTR, PTR), "declared in Python with 3 arguments"),
    (kernel("saxpy", F32, PTR, PTR, I32, I32), "declared in Python with 5 arguments"),
    (kernel("saxpy", I32, PTR, PTR, I32), "argument 0 is declared in Python as c_int"),
    (kernel("saxpy", F64, PTR, PTR, I32), "argument 0 is declared in Python as c_double"),
    (kernel("saxpy", F32, PTR, I32, I32), "argument 2 is declared in Python as c_int"),
    (kernel("saxpy", F32, PTR, PTR, I64), "argument 3 is declared in Python as c_long"),
    (kernel("saxpy", F32, PTR, PTR, U32), "argument 3 is declared in Python as c_uint"),
    (kernel("saxpy", F32, PTR, PTR, PTR), "argument 3 is declared in Python as c_void_p"),
])
def test_a_declaration_that_does_not_match_the_kernel_fails_to_compile(nvrtc_available, cache, spec, needle):
    with pytest.raises(nvrtc.NvrtcError, match=needle) as info:
        compile_kernels(SAXPY, "saxpy.cu", "sm_90", [spec])
    assert not isinstance(info.value, UsageError)


def test_a_declared_kernel_missing_from_the_source_fails_to_compile(nvrtc_available, cache):
    with pytest.raises(nvrtc.NvrtcError, match="no_such_kernel"):
        compile_kernels(SAXPY, "saxpy.cu", "sm_90", [SAXPY_SPEC, kernel("no_such_kernel", PTR)])


def test_block_sizes_reach_the_source_only_through_defines(nvrtc_available, cache):
    metrics = launcher_class("metrics")
    source = (KERNELS_DIR / "metrics.cu").read_text()
    with pytest.raises(nvrtc.NvrtcError, match="METRICS_THREADS"):
        compile_kernels(source, "metrics.cu", "sm_90", metrics.specs().values())
    with_define = compile_kernels(source, "metrics.cu", "sm_90", metrics.specs().values(), metrics.defines)
    other_size = compile_kernels(source, "metrics.cu", "sm_90", metrics.specs().values(),
                                 {"METRICS_THREADS": 128})
    assert with_define != other_size


def test_extra_options_and_the_arch_specific_target(nvrtc_available, cache):
    source = 'extern "C" __global__ void k(int* y) {\n#if defined(FLAG) && FLAG == 3\n *y = FLAG;\n#endif\n}\n'
    spec = kernel("k", PTR)
    plain = compile_kernels(source, "k.cu", "sm_90", [spec])
    flagged = compile_kernels(source, "k.cu", "sm_90", [spec], options=["-DFLAG=3"])
    assert plain != flagged
    assert compile_kernels(source, "k.cu", "sm_90a", [spec]).startswith(ELF_MAGIC)


# --------------------------------------------------------------------------------------------
# The launch, against a driver that records what it is given


class RecordingDriver(types.SimpleNamespace):
    """The real cuda.bindings.driver with the calls that need a GPU replaced by recorders."""

    def __init__(self, status=0):
        from cuda.bindings import driver

        super().__init__(**{k: getattr(driver, k) for k in dir(driver) if not k.startswith("__")})
        self.calls, self.status = [], status
        self.cuLaunchKernel = lambda *a: self.calls.append(("cuLaunchKernel", a)) or (self.status,)
        self.cuLaunchKernelEx = lambda *a: self.calls.append(("cuLaunchKernelEx", a)) or (self.status,)
        self.cuFuncSetAttribute = lambda *a: self.calls.append(("cuFuncSetAttribute", a)) or (0,)


@pytest.fixture
def recording_driver(monkeypatch):
    pytest.importorskip("cuda.bindings.driver")
    fake = RecordingDriver()
    monkeypatch.setattr(cuda, "driver_api", lambda: fake)
    return fake


class FakeStream:
    def __init__(self):
        from cuda.bindings import driver

        self.handle = driver.CUstream(0x5EA)


def read_params(address: int, types_: list) -> list:
    """The values behind a kernelParams array (void*[]) as the driver reads them."""
    pointers = (ctypes.c_void_p * len(types_)).from_address(address)
    return [t.from_address(p).value for t, p in zip(types_, pointers)]


def test_a_launch_hands_the_driver_the_geometry_and_the_packed_arguments(recording_driver):
    spec = kernel("k", PTR, I32, F32, F64, I64, U32)
    k = nvrtc.Kernel(spec, "function")
    stream = FakeStream()
    k(stream, 7, 128, 0x7F00_0000_1000, -3, 0.5, 1e-300, 2**40, 2**32 - 1)
    k(stream, (3, 4, 1), (16, 16, 1), 0, 5, -1.25, 2.0, -(2**40), 7, shared_bytes=4096)
    (name1, first), (name2, second) = recording_driver.calls
    assert name1 == name2 == "cuLaunchKernel"
    assert first[:9] == ("function", 7, 1, 1, 128, 1, 1, 0, stream.handle)
    assert second[:9] == ("function", 3, 4, 1, 16, 16, 1, 4096, stream.handle)
    assert first[9] == second[9]  # the same slots, refilled
    assert read_params(second[9], list(spec.arg_types)) == [None, 5, -1.25, 2.0, -(2**40), 7]


def test_a_launch_with_the_wrong_arguments_is_a_bug_not_a_usage_error(recording_driver):
    k = nvrtc.Kernel(SAXPY_SPEC, "function")
    for bad in [(1.0, 0, 0), (1.0, 0, 0, 5, 6), (1.0, 0, 0, 2.5), ("x", 0, 0, 1), (1.0, 0, 0, 2**31),
                (1.0, -8, 0, 1), (1.0, None, 0, 1)]:
        with pytest.raises(nvrtc.KernelArgumentError, match="saxpy") as info:
            k(FakeStream(), 1, 32, *bad)
        assert isinstance(info.value, TypeError) and not isinstance(info.value, GraphtrainError)
    assert recording_driver.calls == []


def test_a_failed_launch_names_the_kernel_and_the_status(recording_driver, monkeypatch):
    from cuda.bindings import driver

    recording_driver.status = driver.CUresult.CUDA_ERROR_INVALID_VALUE
    monkeypatch.setattr(cuda, "status_detail", lambda status: None)  # the description needs libcuda
    with pytest.raises(cuda.CudaError, match=r"cuLaunchKernel\(saxpy\) failed: CUDA_ERROR_INVALID_VALUE"):
        nvrtc.Kernel(SAXPY_SPEC, "function")(FakeStream(), 1, 32, 1.0, 0, 0, 1)


def test_cluster_cooperative_and_shared_memory_go_through_cuLaunchKernelEx(recording_driver):
    from cuda.bindings import driver

    spec = kernel("k", PTR, I32, cluster=(16, 1), cooperative=True, max_shared_bytes=200 * 1024)
    k = nvrtc.Kernel(spec, "function")
    attributes = {a[1]: a[2] for name, a in recording_driver.calls if name == "cuFuncSetAttribute"}
    assert attributes == {driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: 200 * 1024,
                          driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED: 1}
    recording_driver.calls.clear()
    k(FakeStream(), 32, 256, 0x1000, 9, shared_bytes=150 * 1024)
    ((name, (config, function, params, extra)),) = recording_driver.calls
    assert name == "cuLaunchKernelEx" and function == "function"
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (32, 1, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ) == (256, 1, 1)
    assert config.sharedMemBytes == 150 * 1024 and int(config.hStream) == 0x5EA and config.numAttrs == 2
    cluster, cooperative = config.attrs
    assert cluster.id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert (cluster.value.clusterDim.x, cluster.value.clusterDim.y, cluster.value.clusterDim.z) == (16, 1, 1)
    assert cooperative.id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
    assert cooperative.value.cooperative == 1
    assert read_params(params, [PTR, I32]) == [0x1000, 9]


def test_a_plain_kernel_sets_no_attribute_and_a_small_cluster_stays_portable(recording_driver):
    nvrtc.Kernel(SAXPY_SPEC, "function")
    nvrtc.Kernel(kernel("k", PTR, cluster=(2, 2, 2)), "function")
    assert recording_driver.calls == []


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


def test_a_buffer_view_is_the_same_bytes_and_never_more(fake_device_memory):
    """Room reserved for one of several forms (persistent's images) is seen as the one chosen."""
    arena = memory.Arena()
    room = arena.reserve("room", (10, 16), np.uint8)
    after = arena.reserve("after", (4,), np.float32)
    arena.allocate()
    as_bf16 = room.view((10, 8), np.uint16)
    assert (as_bf16.ptr, as_bf16.nbytes, as_bf16.dtype, as_bf16.shape) == (room.ptr, 160, np.uint16, (10, 8))
    assert room.view((10, 4), np.float32).at(9, 3) == room.ptr + 156 < after.ptr
    with pytest.raises(memory.ArenaError, match="too few"):
        room.view((10, 5), np.float32)
    arena.close()


def test_arena_misuse_is_a_bug_not_a_usage_error(fake_device_memory):
    arena = memory.Arena()
    arena.reserve("w", (4, 4))
    with pytest.raises(memory.ArenaError, match="already reserved") as info:
        arena.reserve("w", (2,))
    assert isinstance(info.value, ValueError) and not isinstance(info.value, GraphtrainError)
    for bad in [(-1, 3), (2.5,), "abc", None]:
        with pytest.raises(ValueError):
            arena.reserve("bad", bad)
    arena.allocate()
    with pytest.raises(memory.ArenaError, match="already allocated"):
        arena.reserve("late", (1,))
    with pytest.raises(memory.ArenaError, match="already allocated"):
        arena.allocate()


def test_buffer_ptr_needs_allocation_then_is_base_plus_offset(fake_device_memory):
    arena = memory.Arena()
    x = arena.reserve("x", (10,))
    y = arena.reserve("y", (20, 3), np.int32)
    with pytest.raises(memory.ArenaError, match="allocate"):
        _ = x.ptr
    arena.allocate()
    assert fake_device_memory["malloc"] == [arena.nbytes]  # exactly one allocation, for the total
    assert x.ptr == fake_device_memory["base"] + x.offset
    assert y.ptr == fake_device_memory["base"] + y.offset
    arena.close()
    arena.close()
    assert fake_device_memory["free"] == [fake_device_memory["base"]]  # freed once
    with pytest.raises(memory.ArenaError, match="closed"):
        _ = y.ptr


def test_buffer_at_is_the_address_of_one_element(fake_device_memory):
    arena = memory.Arena()
    totals = arena.reserve("totals", (2,), np.float64)
    images = arena.reserve("images", (50, 784))
    arena.allocate()
    assert totals.at(0) == totals.ptr and totals.at(1) == totals.ptr + 8
    assert images.at(3, 0) == images.at(3 * 784) == images.ptr + 3 * 784 * 4
    assert images.at(49, 783) == images.ptr + (50 * 784 - 1) * 4
    for bad in [(2,), (-1,)]:
        with pytest.raises(IndexError):
            totals.at(*bad)
    with pytest.raises(ValueError):
        images.at(50, 0)


def test_arena_context_manager_frees_and_empty_arena_refuses(fake_device_memory):
    with memory.Arena() as arena:
        arena.reserve("x", (1,))
        arena.allocate()
    assert fake_device_memory["free"] == [fake_device_memory["base"]]
    with pytest.raises(memory.ArenaError, match="nothing to allocate"):
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
# NVRTC compilation and the disk cache


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compile_small_kernel_gives_a_cubin(nvrtc_available, cache, arch):
    assert nvrtc.compile_cubin(SAXPY, "saxpy.cu", arch).startswith(ELF_MAGIC)


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


def test_cache_key_covers_arch_options_and_declarations(nvrtc_available, cache):
    nvrtc.compile_cubin(SAXPY, "saxpy.cu", "sm_80")
    nvrtc.compile_cubin(SAXPY, "saxpy.cu", "sm_90")
    nvrtc.compile_cubin(SAXPY, "saxpy.cu", "sm_90", options=["-lineinfo"])
    compile_kernels(SAXPY, "saxpy.cu", "sm_90", [SAXPY_SPEC])
    assert len(list(cache.glob("*.cubin"))) == 4


def test_corrupt_cache_entry_is_recompiled(nvrtc_available, cache):
    good = nvrtc.compile_cubin(SAXPY, "saxpy.cu", "sm_90")
    (entry,) = cache.glob("*.cubin")
    entry.write_bytes(entry.read_bytes()[:40] + b"garbage")
    compiles = nvrtc.counters.compiles
    assert nvrtc.compile_cubin(SAXPY, "saxpy.cu", "sm_90") == good
    assert nvrtc.counters.compiles == compiles + 1
    assert [p.name for p in cache.iterdir()] == [entry.name]  # rewritten in place, no temporary left


def test_an_unwritable_cache_still_compiles(nvrtc_available, tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("GRAPHTRAIN_CACHE", str(tmp_path / "a-file" / "kernels"))  # cannot be a folder
    compiles = nvrtc.counters.compiles
    assert nvrtc.compile_cubin(SAXPY, "saxpy.cu", "sm_90").startswith(ELF_MAGIC)
    assert nvrtc.counters.compiles == compiles + 1


def test_bad_arch_is_refused():
    with pytest.raises(ValueError):
        nvrtc.compile_cubin(SAXPY, "saxpy.cu", "compute_90")


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAPHTRAIN_CACHE", str(tmp_path / "explicit"))
    assert nvrtc.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("GRAPHTRAIN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert nvrtc.cache_dir() == tmp_path / "xdg" / "graphtrain" / "kernels" == files.cache_dir("kernels")


# --------------------------------------------------------------------------------------------
# Errors: statuses named, bugs told apart from what a user can fix


def test_check_unwraps_values_and_names_failures(monkeypatch):
    try:
        from cuda.bindings import driver, runtime
    except ImportError:
        pytest.skip("cuda-bindings is not installed")
    monkeypatch.setattr(cuda, "status_detail", lambda status: None)  # the description needs libcuda
    assert cuda.check((runtime.cudaError_t.cudaSuccess,), "x") is None
    assert cuda.check((runtime.cudaError_t.cudaSuccess, 5), "x") == 5
    assert cuda.check((driver.CUresult.CUDA_SUCCESS, 1, 2), "x") == (1, 2)
    with pytest.raises(cuda.CudaError, match="cudaMalloc failed: cudaErrorMemoryAllocation") as info:
        cuda.check((runtime.cudaError_t.cudaErrorMemoryAllocation, None), "cudaMalloc")
    assert info.value.call == "cudaMalloc" and info.value.status == "cudaErrorMemoryAllocation"
    with pytest.raises(cuda.CudaError, match="cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE"):
        cuda.check((driver.CUresult.CUDA_ERROR_INVALID_VALUE,), "cuLaunchKernel")


def test_library_errors_name_the_call_and_the_status():
    from graphtrain.libs.shared_lib import LibraryError

    error = LibraryError("cublasGemmEx", 7, "CUBLAS_STATUS_INVALID_VALUE")
    assert (error.call, error.status, error.name) == ("cublasGemmEx", 7, "CUBLAS_STATUS_INVALID_VALUE")
    assert str(error) == "cublasGemmEx failed: CUBLAS_STATUS_INVALID_VALUE"


def test_gemm_shapes_are_checked_before_cublas_sees_them():
    from graphtrain.libs.cublas import GemmShapeError, check_gemm_shape

    check_gemm_shape(False, False, 8, 6, 5, lda=5, ldb=6, ldc=6)
    check_gemm_shape(True, True, 8, 6, 5, lda=8, ldb=5, ldc=7)
    bad = [dict(lda=4),  # A is m×k = 8×5
           dict(transa=True, lda=7),  # A is k×m = 5×8
           dict(ldb=5),  # B is k×n = 5×6
           dict(transb=True, ldb=4),  # B is n×k = 6×5
           dict(ldc=5),  # C is m×n = 8×6
           dict(m=0), dict(k=-3), dict(n=2**31)]
    for override in bad:
        args = {**dict(transa=False, transb=False, m=8, n=6, k=5, lda=8, ldb=8, ldc=8), **override}
        with pytest.raises(GemmShapeError) as info:
            check_gemm_shape(**args)
        assert isinstance(info.value, ValueError) and not isinstance(info.value, GraphtrainError)


def test_only_missing_hardware_or_libraries_are_graphtrain_errors():
    from graphtrain.libs.cublas import GemmShapeError
    from graphtrain.libs.shared_lib import LibraryError

    bugs = [nvrtc.KernelArgumentError, GemmShapeError, memory.ArenaError, cuda.ClosedError, cuda.CudaError,
            nvrtc.NvrtcError, LibraryError]
    for error in bugs:
        assert not issubclass(error, GraphtrainError), error
    # A missing GPU or library is the user's to fix (exit 2, see graphtrain.errors).
    assert issubclass(GpuUnavailableError, UsageError)


# A `graphtrain run` in a fresh interpreter whose first step (the initial weights) fails as a bug would.
CLI_WITH_A_BUG = """
import sys
import tomllib
from graphtrain import reference
from graphtrain.libs import memory

def buggy_init(*args, **kwargs):
    memory.Arena().allocate()  # a real bug-class error: nothing was reserved

reference.init_params = buggy_init
from graphtrain.cli import main
sys.argv = ["graphtrain", *sys.argv[1:]]
main()
"""


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLI_WITH_A_BUG, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_a_bug_exits_1_with_a_traceback_and_a_user_error_exits_2_with_one_line(mnist_dir):
    bug = run_cli("run", "--stage", "numpy", "--epochs", "1", "--offline", "--data-dir", str(mnist_dir))
    assert bug.returncode == 1, bug.stderr
    assert "Traceback (most recent call last)" in bug.stderr and "ArenaError: nothing to allocate" in bug.stderr
    user = run_cli("run", "--stage", "numpy", "--lr", "-1", "--offline", "--data-dir", str(mnist_dir))
    assert user.returncode == 2, user.stderr
    lines = [line for line in user.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "lr" in lines[0], user.stderr


# --------------------------------------------------------------------------------------------
# Environment discovery


def test_everything_imports_and_probes_without_cuda_bindings():
    # A fresh interpreter in which `import cuda...` fails, as on a machine with no CUDA package.
    import json

    script = """
import importlib.abc, json, sys
class NoCuda(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "cuda" or name.startswith("cuda."):
            raise ImportError(f"blocked {name}")
sys.meta_path.insert(0, NoCuda())
from graphtrain.errors import GpuUnavailableError
from graphtrain.libs import cuda, cublas, cudnn, memory, nvrtc
from graphtrain import environment, kernels
from graphtrain.kernels import gather, layers, matmul, metrics, softmax
from graphtrain.stages import graphs
report = environment.probe()
try:
    cuda.open_device()
    opened = "opened"
except GpuUnavailableError as exc:
    opened = str(exc)
print(json.dumps({"report": report, "opened": opened}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "graphtrain[cu12]" in result["opened"] and "graphtrain[cu13]" in result["opened"]
    for piece in ("cuda_bindings", "driver", "nvrtc", "cublas", "cudnn"):
        assert result["report"][piece]["found"] is False, piece


def test_probe_reports_every_component_without_raising():
    from graphtrain.environment import probe

    report = probe()
    assert set(report) == {"cuda_bindings", "driver", "nvrtc", "cublas", "cublasLt", "cudnn", "nccl"}
    for name, entry in report.items():
        assert isinstance(entry["found"], bool), name
        if not entry["found"]:
            assert entry.get("error"), f"{name} is missing but probe() does not say why"
            assert entry.get("install"), f"{name} is missing but probe() does not say what installs it"


def test_host_environment_names_python_numpy_and_the_cpu():
    from graphtrain.environment import host

    found = host()
    assert found["python"] and found["numpy"] == np.__version__ and found["cpu"] and found["cpu_count"]


def test_gpu_environment_has_the_keys_the_reports_read():
    from graphtrain import environment

    device = cuda.DeviceInfo(ordinal=0, name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), arch="sm_90",
                             sm_count=132, total_memory=80 << 30, driver_cuda_version="13.0", runtime_version="13.0",
                               sm_shared_bytes=228 * 1024, sm_registers=64 * 1024, sm_threads=2048)
    found = environment.gpu(device)
    assert set(found) == {"gpu", "compute_capability", "driver", "driver_cuda", "runtime", "cuda_bindings"}
    assert (found["gpu"], found["compute_capability"], found["driver_cuda"]) == ("NVIDIA H100 80GB HBM3", "9.0", "13.0")


def test_work_given_to_before_capture_can_be_taken_back():
    """A kernel file closed while still compiling takes back its load, so no later capture loads it."""
    from graphtrain.libs import cuda

    loads = []

    def load():
        loads.append(1)

    cuda.before_capture(load)
    assert load in cuda._before_capture
    cuda.drop_before_capture(load)
    cuda.drop_before_capture(load)  # twice: nothing left to take
    assert load not in cuda._before_capture and not loads


def nvrtc_library():
    import ctypes

    from graphtrain.libs.shared_lib import SharedLibrary

    return SharedLibrary("nvrtc", "NVRTC", {"nvrtcVersion": ([ctypes.POINTER(ctypes.c_int)] * 2, ctypes.c_int)},
                         "nvrtcGetErrorString")


def test_a_library_is_opened_at_the_path_the_last_load_found(tmp_path, monkeypatch):
    """The path pathfinder found is remembered in the cache; the next process opens the library
    there first (libc's dlopen, without the GIL), and a remembered path that is gone is no harm."""
    import ctypes
    import json

    pytest.importorskip("cuda.pathfinder")
    from graphtrain.errors import GpuUnavailableError
    from graphtrain.libs import shared_lib

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    remembered = tmp_path / "graphtrain" / "libraries" / shared_lib.PATHS_FILE
    try:
        first = nvrtc_library()
        first.load()
    except GpuUnavailableError as exc:
        pytest.skip(f"NVRTC is not installed here (the nvrtc-cu13 extra): {exc}")
    assert json.loads(remembered.read_text()) == {"nvrtc": first.path}
    opened = []
    real = shared_lib._open_without_gil
    monkeypatch.setattr(shared_lib, "_open_without_gil", lambda path: (opened.append(path), real(path)))
    second = nvrtc_library()
    major, minor = ctypes.c_int(), ctypes.c_int()
    assert second.load().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) == 0 and major.value >= 12
    assert opened == [first.path] and second.path == first.path
    remembered.write_text(json.dumps({"nvrtc": str(tmp_path / "gone" / "libnvrtc.so.13")}))
    third = nvrtc_library()
    third.load()
    assert third.path == first.path and json.loads(remembered.read_text()) == {"nvrtc": first.path}
