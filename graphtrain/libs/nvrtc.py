"""Kernels: compile CUDA C++ with NVRTC to a cubin (cached on disk), load it, launch it.

How kernels are declared, and what is checked when, is in graphtrain/kernels/__init__.py.
Compiling for the real architecture (``sm_90``, not ``compute_90``) gives a cubin the driver loads
without a JIT step. ``--use_fast_math`` is deliberately not used: the losses need accurate expf/logf.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import struct
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphtrain import files
from graphtrain.errors import INSTALL_HINTS, GpuUnavailableError
from graphtrain.libs import cuda

_CACHE_MAGIC = b"GTCUBIN1"


class NvrtcError(RuntimeError):
    """NVRTC failed; for a compile error the message holds the file name and NVRTC's log."""

    def __init__(self, message: str, *, call: str, status: str, log: str | None = None):
        super().__init__(message)
        self.call, self.status, self.log = call, status, log


class KernelArgumentError(TypeError):
    """A kernel was declared or launched with arguments that do not fit it: a bug in a launcher."""


@dataclass
class CompileCounters:
    """How many NVRTC compilations ran and how many cubins came from the disk cache."""

    compiles: int = 0
    cache_hits: int = 0


counters = CompileCounters()


# --------------------------------------------------------------------------------------------
# The argument types a kernel may take (graphtrain.kernels declares kernels with them), each with
# the `struct` code a launch packs it with, in native alignment as the C ABI lays arguments out

PTR, I32, U32, I64, U64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64
F32, F64 = ctypes.c_float, ctypes.c_double
STRUCT_CODES = {PTR: "Q", I32: "i", U32: "I", I64: "q", U64: "Q", F32: "f", F64: "d"}


@dataclass(frozen=True)
class KernelSpec:
    """One `extern "C" __global__` kernel: its name, argument types and how it is launched."""

    name: str
    arg_types: tuple[Any, ...]
    cluster: tuple[int, int, int] | None = None  # blocks per thread-block cluster (cuLaunchKernelEx)
    cooperative: bool = False  # grid-wide sync allowed (cuLaunchKernelEx)
    max_shared_bytes: int = 0  # dynamic shared memory above the default 48 KiB, raised once


# --------------------------------------------------------------------------------------------
# Compilation with a disk cache


def _nvrtc_call(call: str, fn: Any, *args: Any) -> Any:
    """Call an NVRTC binding and unwrap `(status, *values)`; NvrtcError on failure."""
    try:
        result = fn(*args)
    except RuntimeError as exc:  # cuda-bindings loads libnvrtc on first call: a missing one surfaces here
        raise GpuUnavailableError(f"the NVRTC library (libnvrtc) could not be loaded: {exc}; "
                                  f"{INSTALL_HINTS['nvrtc']}") from exc
    status, values = result[0], result[1:]
    if status:
        name = getattr(status, "name", str(status))
        raise NvrtcError(f"{call} failed: {name}", call=call, status=name)
    return values[0] if len(values) == 1 else (values or None)


@functools.cache  # a failure is not cached: it raises again at the next call
def version() -> str:
    """NVRTC's version, e.g. "13.0" (GpuUnavailableError if NVRTC cannot be loaded). Asked once:
    it keys the cubin cache, and loading the library is the costly part of asking."""
    nvrtc = cuda.bindings("nvrtc")  # compiling needs no driver and no GPU
    major, minor = _nvrtc_call("nvrtcVersion", nvrtc.nvrtcVersion)
    return f"{major}.{minor}"


def library_path() -> str:
    """The path of the NVRTC library this process loads, as cuda.pathfinder finds it."""
    from cuda.pathfinder import load_nvidia_dynamic_lib

    return load_nvidia_dynamic_lib("nvrtc").abs_path


def cache_dir() -> Path:
    """Where compiled cubins are kept: $GRAPHTRAIN_CACHE, else graphtrain's per-user cache folder
    `kernels` (graphtrain.files.cache_dir)."""
    explicit = os.environ.get("GRAPHTRAIN_CACHE")
    return Path(explicit).expanduser() if explicit else files.cache_dir("kernels")


def profiler_options() -> tuple[str, ...]:
    """$GRAPHTRAIN_LINEINFO=1 compiles every kernel with its source lines (NVRTC's
    --generate-line-info) for a profiler's per-line counters (ncu's source page); the code is the same."""
    return ("--generate-line-info",) if os.environ.get("GRAPHTRAIN_LINEINFO") == "1" else ()


@contextmanager
def _program(source: str, name: str, options: Sequence[str]):
    """An NVRTC program of `source` compiled with `options`: (the program, the compile's status)."""
    nvrtc = cuda.bindings("nvrtc")
    program = _nvrtc_call("nvrtcCreateProgram", nvrtc.nvrtcCreateProgram, source.encode(), name.encode(), 0, [], [])
    try:
        encoded = [opt.encode() for opt in options]
        yield program, nvrtc.nvrtcCompileProgram(program, len(encoded), encoded)[0]
    finally:
        nvrtc.nvrtcDestroyProgram(program)  # cleanup: its status must not mask the error being raised


def _log(program) -> str:
    nvrtc = cuda.bindings("nvrtc")
    log = b" " * _nvrtc_call("nvrtcGetProgramLogSize", nvrtc.nvrtcGetProgramLogSize, program)
    _nvrtc_call("nvrtcGetProgramLog", nvrtc.nvrtcGetProgramLog, program, log)  # the binding fills it in place
    return log.rstrip(b"\0").decode(errors="replace").strip()


def _failed(name: str, options: Sequence[str], status, log: str) -> NvrtcError:
    return NvrtcError(f"NVRTC could not compile {name} ({status.name}, options: {' '.join(options)}):\n{log}",
                      call="nvrtcCompileProgram", status=status.name, log=log)


def _compile(source: str, name: str, options: Sequence[str]) -> bytes:
    """Run NVRTC once; NvrtcError with the log on a compile error."""
    nvrtc = cuda.bindings("nvrtc")
    with _program(source, name, options) as (program, status):
        if status:
            raise _failed(name, options, status, _log(program))
        cubin = b" " * _nvrtc_call("nvrtcGetCUBINSize", nvrtc.nvrtcGetCUBINSize, program)
        _nvrtc_call("nvrtcGetCUBIN", nvrtc.nvrtcGetCUBIN, program, cubin)
        return cubin


def ptxas_report(source: str, name: str, arch: str, options: Iterable[str] = ()) -> str:
    """Compile `source` for `arch` with ptxas's resource report (--ptxas-options=-v), uncached, and
    return NVRTC's log: each kernel's registers, stack frame and spill bytes a thread."""
    all_options = [f"--gpu-architecture={arch}", "-std=c++17", *options, "--ptxas-options=-v"]
    with _program(source, name, all_options) as (program, status):
        log = _log(program)
        if status:
            raise _failed(name, all_options, status, log)
        return log


def compile_cubin(source: str, name: str, arch: str, options: Iterable[str] = ()) -> bytes:
    """Compile CUDA C++ `source` (called `name` in messages) to a cubin for `arch` ("sm_90"), cached
    under `cache_dir()` by source, options, architecture and NVRTC version (a corrupt entry is redone)."""
    return compile_cubin_async(source, name, arch, options).result()


_compiling: ThreadPoolExecutor | None = None


def finish_compiles() -> None:
    """Wait for every compile still running (its cubin then in the cache, whole)."""
    global _compiling
    if _compiling is not None:
        _compiling.shutdown(wait=True)
        _compiling = None


def compile_cubin_async(source: str, name: str, arch: str, options: Iterable[str] = ()) -> Future:
    """`compile_cubin`, with the compile (on a cache miss) run by a pool of threads: the Future is
    done at once on a cache hit, and otherwise while the caller goes on, several files compiling
    at once (NVRTC holds no Python lock while it compiles). Its result raises what the compile did."""
    global _compiling
    if not re.fullmatch(r"sm_\d{2,3}[af]?", arch):
        raise ValueError(f"GPU architecture must look like 'sm_90' (a real architecture), not {arch!r}")
    all_options = (f"--gpu-architecture={arch}", "-std=c++17", *options, *profiler_options())
    digest = hashlib.sha256()
    for part in ("graphtrain-cubin-v1", version(), "\0".join(all_options), source):
        digest.update(part.encode() + b"\xff")  # a separator that cannot occur in UTF-8 text
    path = cache_dir() / f"{digest.hexdigest()}.cubin"
    cubin = files.read_cached(path, _CACHE_MAGIC)
    if cubin is not None:
        counters.cache_hits += 1
        done: Future = Future()
        done.set_result(cubin)
        return done

    def compile_and_keep() -> bytes:
        compiled = _compile(source, name, all_options)
        counters.compiles += 1
        files.write_cached(path, _CACHE_MAGIC, compiled)  # when it cannot be written, the next run compiles again
        return compiled

    if _compiling is None:
        _compiling = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="graphtrain-nvrtc")
    return _compiling.submit(compile_and_keep)


# --------------------------------------------------------------------------------------------
# Launching


class Kernel:
    """A launchable kernel: ``kernel(stream, grid, block, *args, shared_bytes=0)``, `grid` and
    `block` an int (x) or a 3-tuple. The arguments live in one buffer laid out as the C ABI lays
    them out, with the array of pointers into it built once; a launch packs all the values with
    one precompiled `struct.pack_into` (in C, which refuses a wrong count, a float for an int and a
    value out of range) and calls the driver, which copies the values during the call (and into the
    graph node when capturing), so reusing the buffer is safe. Not for several threads at once."""

    def __init__(self, spec: KernelSpec, function: Any):
        driver = cuda.driver_api()
        self.name, self.spec, self._function = spec.name, spec, function
        codes = "".join(STRUCT_CODES[t] for t in spec.arg_types)
        packer = struct.Struct("@" + codes)
        self._pack, self._values = packer.pack_into, ctypes.create_string_buffer(max(packer.size, 1))
        # Each argument's offset: the packed size up to and including it, less its own size.
        offsets = [struct.calcsize("@" + codes[:i + 1]) - struct.calcsize(code) for i, code in enumerate(codes)]
        base = ctypes.addressof(self._values)
        self._array = (ctypes.c_void_p * max(len(codes), 1))(*[base + offset for offset in offsets])
        # cuda.bindings takes kernelParams as an int: the address of a void*[] (NULL for none).
        self._params = ctypes.addressof(self._array) if codes else 0
        self._call = f"cuLaunchKernel({spec.name})"
        self._launch, self._launch_ex, self._config = driver.cuLaunchKernel, driver.cuLaunchKernelEx, None
        if spec.cluster is not None or spec.cooperative:
            self._config, self._call = launch_config(spec), f"cuLaunchKernelEx({spec.name})"

        def set_attribute(name: str, value: int) -> None:
            cuda.check(driver.cuFuncSetAttribute(function, getattr(driver.CUfunction_attribute, name), value),
                       f"cuFuncSetAttribute({spec.name}, {name})")

        if spec.max_shared_bytes:
            set_attribute("CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", spec.max_shared_bytes)
        if spec.cluster is not None and spec.cluster[0] * spec.cluster[1] * spec.cluster[2] > 8:
            # Clusters of more than 8 blocks (up to 16 on Hopper) are "non-portable": opt in.
            set_attribute("CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED", 1)

    def __call__(self, stream: cuda.Stream, grid: Any, block: Any, *args: Any, shared_bytes: int = 0) -> None:
        try:
            self._pack(self._values, 0, *args)
        except struct.error as exc:  # costs nothing unless raised
            raise KernelArgumentError(f"{self!r} cannot take {args!r}: {exc}") from None
        gx, gy, gz = grid if grid.__class__ is tuple else (grid, 1, 1)
        bx, by, bz = block if block.__class__ is tuple else (block, 1, 1)
        config = self._config
        if config is None:
            status = self._launch(self._function, gx, gy, gz, bx, by, bz, shared_bytes, stream.handle,
                                  self._params, 0)[0]
        else:
            config.gridDimX, config.gridDimY, config.gridDimZ = gx, gy, gz
            config.blockDimX, config.blockDimY, config.blockDimZ = bx, by, bz
            config.sharedMemBytes, config.hStream = shared_bytes, stream.handle
            status = self._launch_ex(config, self._function, self._params, 0)[0]
        if status:
            raise cuda.CudaError(self._call, status, cuda.status_detail(status))

    def __repr__(self) -> str:
        return f"Kernel({self.name}({', '.join(t.__name__ for t in self.spec.arg_types)}))"


def launch_config(spec: KernelSpec) -> Any:
    """The CUlaunchConfig for cuLaunchKernelEx with the kernel's cluster and cooperative attributes,
    filled in per launch. With a cluster, the grid still counts blocks (a multiple of the cluster)."""
    driver = cuda.driver_api()
    attrs = []
    if spec.cluster is not None:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = spec.cluster
        attrs.append(attr)
    if spec.cooperative:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        attr.value.cooperative = 1
        attrs.append(attr)
    config = driver.CUlaunchConfig()
    config.attrs, config.numAttrs = attrs, len(attrs)
    return config


class Module:
    """A compiled kernel file loaded into the device's primary context; `module["name"]` is a Kernel."""

    def __init__(self, name: str, cubin: bytes, specs: Iterable[KernelSpec], device: cuda.DeviceInfo):
        self.name = name
        cuda.open_device(device.ordinal)  # the module goes into this device's primary context
        driver = cuda.driver_api()
        self._handle = cuda.check(driver.cuModuleLoadData(cubin), f"cuModuleLoadData({name})")
        try:
            self.kernels = {spec.name: Kernel(spec, cuda.check(driver.cuModuleGetFunction(
                self._handle, spec.name.encode()), f"cuModuleGetFunction({spec.name})")) for spec in specs}
        except BaseException:
            driver.cuModuleUnload(self._handle)  # cleanup: the lookup's error is the one to see
            raise

    def __getitem__(self, name: str) -> Kernel:
        return self.kernels[name]

    def close(self) -> None:
        """Unload the module (idempotent); a launch of one of its kernels then fails (CudaError)."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            for kernel in self.kernels.values():
                kernel._function = None
            cuda.check(cuda.driver_api().cuModuleUnload(handle), f"cuModuleUnload({self.name})")
