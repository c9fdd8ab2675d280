"""The CUDA runtime layer: device, streams, events, memory, copies and CUDA Graphs.

A thin layer over NVIDIA's `cuda.bindings` (the `cuda-python` wheels, CUDA 12 or 13). Every call's
status is checked and turned into a `CudaError` that names the call and the status, e.g.
``cudaMalloc failed: cudaErrorMemoryAllocation``.

`cuda.bindings` is imported on first use, not at import time, so that `graphtrain` (its CLI, its
CPU tests, `graphtrain info`) works on machines without it and can say what is missing.

The counters below let tests assert the properties the training loop is built for: one device
allocation per run and no host-blocking synchronisation inside the batch loop.
"""

from __future__ import annotations

import re
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphtrain.errors import GpuUnavailableError, GraphtrainError, UsageError

INSTALL_HINT = "pip install 'graphtrain[cu12]' (CUDA 12 driver) or 'graphtrain[cu13]' (CUDA 13 driver)"


class CudaError(GraphtrainError):
    """A CUDA runtime or driver call returned an error status."""

    def __init__(self, call: str, status: Any, detail: str | None = None):
        self.call = call
        self.status = _status_name(status)
        message = f"{call} failed: {self.status}"
        if detail:
            message += f" ({detail})"
        super().__init__(message)


# --------------------------------------------------------------------------------------------
# Lazy import of cuda.bindings


_modules: dict[str, Any] = {}
_import_lock = threading.Lock()


def _import_bindings() -> dict[str, Any]:
    """Import the runtime, driver and NVRTC bindings once; GpuUnavailableError if missing."""
    if _modules:
        return _modules
    with _import_lock:
        if _modules:
            return _modules
        try:
            from cuda.bindings import driver, nvrtc, runtime
        except ImportError as exc:
            try:
                # cuda-python 12.6.0 predates the cuda.bindings namespace (added in 12.6.1).
                from cuda import cuda as driver  # type: ignore[no-redef]
                from cuda import cudart as runtime  # type: ignore[no-redef]
                from cuda import nvrtc  # type: ignore[no-redef]
            except ImportError:
                raise GpuUnavailableError(
                    f"the CUDA Python bindings (cuda-bindings) are not installed ({exc}); {INSTALL_HINT}"
                ) from None
        _modules.update(runtime=runtime, driver=driver, nvrtc=nvrtc)
    return _modules


def runtime_api() -> Any:
    """The `cuda.bindings.runtime` module (imported on first use)."""
    return _import_bindings()["runtime"]


def driver_api() -> Any:
    """The `cuda.bindings.driver` module (imported on first use)."""
    return _import_bindings()["driver"]


def nvrtc_api() -> Any:
    """The `cuda.bindings.nvrtc` module (imported on first use)."""
    return _import_bindings()["nvrtc"]


def bindings_version() -> str | None:
    """The installed cuda-bindings version, or None if it is not installed. Imports nothing heavy."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - Python >= 3.8 always has it
        return None
    for dist in ("cuda-bindings", "cuda-python"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


# --------------------------------------------------------------------------------------------
# Status checking


def _status_name(status: Any) -> str:
    # cudaError_t, CUresult and nvrtcResult are enums (IntEnum in 12.x, FastEnum in 13.x): both
    # have .name. Fall back to the number for anything else.
    name = getattr(status, "name", None)
    return name if isinstance(name, str) else str(status)


def _status_detail(status: Any) -> str | None:
    """The human description of a runtime or driver status, when the library can give it."""
    try:
        mods = _import_bindings()
        runtime, driver = mods["runtime"], mods["driver"]
        if isinstance(status, runtime.cudaError_t):
            text = runtime.cudaGetErrorString(status)[1]
        elif isinstance(status, driver.CUresult):
            err, text = driver.cuGetErrorString(status)
            if err:
                return None
        else:
            return None
    except Exception:  # the description is a courtesy: never mask the real error
        return None
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text or None


def check(result: Any, call: str) -> Any:
    """Unwrap a cuda.bindings result `(status, *values)`; raise CudaError unless it succeeded.

    Works for runtime (cudaError_t), driver (CUresult) and NVRTC statuses alike: success is 0 in
    all three. Returns None when there are no values, the value when there is one, else a tuple.
    """
    if isinstance(result, tuple):
        status, values = result[0], result[1:]
    else:
        status, values = result, ()
    if status:
        raise CudaError(call, status, _status_detail(status))
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return values


def _handle(obj: Any) -> int:
    """The address behind a cuda.bindings handle object (stream, event, graph...)."""
    if obj is None:
        return 0
    if isinstance(obj, int):
        return obj
    try:
        from cuda.bindings.utils import get_cuda_native_handle
    except ImportError:
        return int(obj)
    return int(get_cuda_native_handle(obj))


# --------------------------------------------------------------------------------------------
# Counters


@dataclass
class Counters:
    """How many device allocations, frees, host-blocking syncs and device-to-host copies ran."""

    mallocs: int = 0
    frees: int = 0
    syncs: int = 0
    d2h_copies: int = 0


counters = Counters()


def reset_counters() -> None:
    """Set every counter back to zero (tests call this before the region they measure)."""
    counters.mallocs = 0
    counters.frees = 0
    counters.syncs = 0
    counters.d2h_copies = 0


# --------------------------------------------------------------------------------------------
# Device


@dataclass(frozen=True)
class DeviceInfo:
    """What `open_device` found: enough to pick kernel architectures and to report a run."""

    ordinal: int
    name: str
    compute_capability: tuple[int, int]
    arch: str
    sm_count: int
    total_memory: int
    driver_cuda_version: str
    runtime_version: str
    driver_version: str | None


_devices: dict[int, DeviceInfo] = {}
_device_lock = threading.Lock()


def _cuda_version_string(encoded: int) -> str:
    # CUDA encodes versions as 1000 * major + 10 * minor (13000 -> "13.0", 12080 -> "12.8").
    return f"{encoded // 1000}.{(encoded % 1000) // 10}"


def nvidia_driver_version() -> str | None:
    """The NVIDIA driver's version string (e.g. "580.95.05"), or None when it cannot be read."""
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        match = re.search(r"Kernel Module(?: for [\w-]+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
        if match:
            return match.group(1)
    except OSError:
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if out.returncode == 0 and lines and re.fullmatch(r"\d+\.\d+(\.\d+)?", lines[0]):
        return lines[0]
    return None


def _unavailable_for(status: Any, runtime: Any) -> GpuUnavailableError:
    """Explain why the runtime cannot see a GPU, by status."""
    name = _status_name(status)
    driver_encoded = 0
    try:
        err, driver_encoded = runtime.cudaDriverGetVersion()
        if err:
            driver_encoded = 0
    except Exception:
        driver_encoded = 0
    runtime_encoded = 0
    try:
        err, runtime_encoded = runtime.cudaRuntimeGetVersion()
        if err:
            runtime_encoded = 0
    except Exception:
        runtime_encoded = 0
    if name == "cudaErrorInsufficientDriver":
        if driver_encoded:
            return GpuUnavailableError(
                f"the NVIDIA driver supports CUDA {_cuda_version_string(driver_encoded)}, older than the "
                f"CUDA {_cuda_version_string(runtime_encoded)} runtime of the installed cuda-bindings "
                f"({name}); install the bindings that match the driver ({INSTALL_HINT}) or update the driver"
            )
        return GpuUnavailableError(
            f"no NVIDIA driver found: libcuda could not be loaded ({name}); "
            "install the NVIDIA driver on a machine with an NVIDIA GPU"
        )
    if name == "cudaErrorNoDevice":
        return GpuUnavailableError(f"the NVIDIA driver found no GPU ({name})")
    return GpuUnavailableError(f"cannot use the GPU: cudaGetDeviceCount failed: {name}")


def open_device(ordinal: int = 0) -> DeviceInfo:
    """Initialise CUDA on GPU `ordinal` and make its primary context current on this thread.

    cudaSetDevice + cudaFree(0) create the primary context; the driver API (modules, kernel
    launches) then uses that same context. Cached per ordinal, but cudaSetDevice runs on every
    call because the current device is per host thread.
    """
    if not isinstance(ordinal, int) or ordinal < 0:
        raise UsageError(f"GPU ordinal must be a non-negative integer, not {ordinal!r}")
    mods = _import_bindings()
    runtime, driver = mods["runtime"], mods["driver"]
    with _device_lock:
        cached = _devices.get(ordinal)
        if cached is not None:
            check(runtime.cudaSetDevice(ordinal), "cudaSetDevice")
            return cached
        try:
            status, count = runtime.cudaGetDeviceCount()
        except Exception as exc:  # a bindings build that cannot even reach the runtime
            raise GpuUnavailableError(f"cannot initialise CUDA: {exc}") from exc
        if status:
            raise _unavailable_for(status, runtime)
        if count == 0:
            raise GpuUnavailableError("the NVIDIA driver found no GPU (cudaGetDeviceCount returned 0)")
        if ordinal >= count:
            raise UsageError(f"GPU {ordinal} does not exist: this machine has {count} GPU(s), numbered from 0")
        check(runtime.cudaSetDevice(ordinal), "cudaSetDevice")
        # cudaFree(0) is the documented idiom to create the primary context now, not lazily.
        check(runtime.cudaFree(0), "cudaFree(0)")
        try:
            # The runtime already initialised the driver; this makes the driver bindings load
            # libcuda now, so a broken install fails here with a clear message.
            status = driver.cuInit(0)[0]
        except Exception as exc:
            raise GpuUnavailableError(f"the CUDA driver API is unavailable: {exc}") from exc
        if status:
            raise CudaError("cuInit", status, _status_detail(status))

        attr = runtime.cudaDeviceAttr
        major = check(runtime.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMajor, ordinal),
                      "cudaDeviceGetAttribute(ComputeCapabilityMajor)")
        minor = check(runtime.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMinor, ordinal),
                      "cudaDeviceGetAttribute(ComputeCapabilityMinor)")
        sm_count = check(runtime.cudaDeviceGetAttribute(attr.cudaDevAttrMultiProcessorCount, ordinal),
                         "cudaDeviceGetAttribute(MultiProcessorCount)")
        # The driver API gives name and memory without cudaDeviceProp, whose layout CUDA 13 changed.
        device = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
        raw_name = check(driver.cuDeviceGetName(256, device), "cuDeviceGetName")
        name = raw_name.split(b"\0", 1)[0].decode(errors="replace").strip()
        total_memory = int(check(driver.cuDeviceTotalMem(device), "cuDeviceTotalMem"))
        driver_cuda = check(runtime.cudaDriverGetVersion(), "cudaDriverGetVersion")
        runtime_cuda = check(runtime.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion")
        info = DeviceInfo(
            ordinal=ordinal,
            name=name,
            compute_capability=(int(major), int(minor)),
            arch=f"sm_{int(major)}{int(minor)}",
            sm_count=int(sm_count),
            total_memory=total_memory,
            driver_cuda_version=_cuda_version_string(int(driver_cuda)),
            runtime_version=_cuda_version_string(int(runtime_cuda)),
            driver_version=nvidia_driver_version(),
        )
        _devices[ordinal] = info
        return info


def synchronize() -> None:
    """Wait for all work on the current device (counted as a sync)."""
    runtime = runtime_api()
    check(runtime.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
    counters.syncs += 1


def versions() -> dict[str, str | None]:
    """Versions of what is loaded: cuda-bindings, its CUDA runtime, the driver's CUDA and the driver.

    Never raises: a missing piece is None.
    """
    out: dict[str, str | None] = {
        "cuda_bindings": bindings_version(),
        "runtime": None,
        "driver_cuda": None,
        "driver": nvidia_driver_version(),
    }
    try:
        runtime = runtime_api()
    except GpuUnavailableError:
        return out
    try:
        err, encoded = runtime.cudaRuntimeGetVersion()
        if not err:
            out["runtime"] = _cuda_version_string(int(encoded))
        err, encoded = runtime.cudaDriverGetVersion()
        if not err and encoded:
            out["driver_cuda"] = _cuda_version_string(int(encoded))
    except Exception:
        pass
    return out


# --------------------------------------------------------------------------------------------
# Streams and events


class Stream:
    """A non-blocking CUDA stream.

    Non-blocking so that it never serialises with the legacy default stream, which other libraries
    may use behind our back. `.handle` is the raw cudaStream_t address for ctypes libraries and
    cuLaunchKernel.
    """

    def __init__(self) -> None:
        runtime = runtime_api()
        self._stream = check(runtime.cudaStreamCreateWithFlags(runtime.cudaStreamNonBlocking),
                             "cudaStreamCreateWithFlags")
        self.handle: int = _handle(self._stream)

    def synchronize(self) -> None:
        """Block the host until all work queued on this stream has finished (counted)."""
        check(runtime_api().cudaStreamSynchronize(self._require()), "cudaStreamSynchronize")
        counters.syncs += 1

    def _require(self) -> Any:
        if self._stream is None:
            raise UsageError("this CUDA stream was closed")
        return self._stream

    def close(self) -> None:
        """Destroy the stream (idempotent). Work already queued still completes."""
        if self._stream is not None:
            stream, self._stream, self.handle = self._stream, None, 0
            check(runtime_api().cudaStreamDestroy(stream), "cudaStreamDestroy")

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Stream(handle={self.handle:#x})" if self._stream is not None else "Stream(closed)"


def _stream_handle(stream: Any) -> int:
    """Accept a Stream, a raw handle int, or None (the legacy default stream)."""
    if stream is None:
        return 0
    if isinstance(stream, Stream):
        if stream._stream is None:
            raise UsageError("this CUDA stream was closed")
        return stream.handle
    if isinstance(stream, int):
        return stream
    raise TypeError(f"expected a Stream, not {type(stream).__name__}")


class Event:
    """A CUDA event with timing enabled, for measuring GPU time between two points of a stream."""

    def __init__(self) -> None:
        self._event = check(runtime_api().cudaEventCreate(), "cudaEventCreate")

    def _require(self) -> Any:
        if self._event is None:
            raise UsageError("this CUDA event was closed")
        return self._event

    def record(self, stream: Stream) -> None:
        """Record the event on `stream`: it completes once the work queued before it has."""
        check(runtime_api().cudaEventRecord(self._require(), _stream_handle(stream)), "cudaEventRecord")

    def synchronize(self) -> None:
        """Block the host until the event has completed (counted)."""
        check(runtime_api().cudaEventSynchronize(self._require()), "cudaEventSynchronize")
        counters.syncs += 1

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds of GPU time from this event to `end`; `end` must have completed
        (call end.synchronize() first, else cudaErrorNotReady)."""
        ms = check(runtime_api().cudaEventElapsedTime(self._require(), end._require()),
                   "cudaEventElapsedTime")
        return float(ms)

    def close(self) -> None:
        """Destroy the event (idempotent)."""
        if self._event is not None:
            event, self._event = self._event, None
            check(runtime_api().cudaEventDestroy(event), "cudaEventDestroy")

    def __enter__(self) -> Event:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# Memory and copies


def malloc(nbytes: int) -> int:
    """Allocate `nbytes` of device memory (counted); returns the device address."""
    if not isinstance(nbytes, (int, np.integer)) or nbytes <= 0:
        raise ValueError(f"device allocation size must be a positive integer, not {nbytes!r}")
    ptr = check(runtime_api().cudaMalloc(int(nbytes)), "cudaMalloc")
    counters.mallocs += 1
    return int(ptr)


def free(ptr: int) -> None:
    """Free device memory from `malloc` (counted)."""
    check(runtime_api().cudaFree(int(ptr)), "cudaFree")
    counters.frees += 1


def copy_to_device(dst_ptr: int, src: np.ndarray, stream: Stream) -> None:
    """Copy a host array to device memory at `dst_ptr`, then wait for the copy (counted sync).

    The copy is ordered on `stream` (a plain cudaMemcpy would use the legacy default stream, which
    does not order with non-blocking streams), and the wait makes it safe for the caller to drop
    or modify `src` as soon as this returns. Setup-time only.
    """
    host = np.ascontiguousarray(src)
    if host.nbytes == 0:
        return
    runtime = runtime_api()
    check(runtime.cudaMemcpyAsync(int(dst_ptr), host.ctypes.data, host.nbytes,
                                  runtime.cudaMemcpyKind.cudaMemcpyHostToDevice, _stream_handle(stream)),
          "cudaMemcpyAsync(HostToDevice)")
    check(runtime.cudaStreamSynchronize(_stream_handle(stream)), "cudaStreamSynchronize")
    counters.syncs += 1


def copy_to_host(src_ptr: int, dst: np.ndarray, stream: Stream) -> np.ndarray:
    """Copy `dst.nbytes` from device address `src_ptr` into the C-contiguous host array `dst`,
    after all work queued on `stream`; waits for it (one d2h copy and one sync counted)."""
    if not isinstance(dst, np.ndarray):
        raise TypeError(f"copy_to_host needs a numpy array to fill, not {type(dst).__name__}")
    if not dst.flags.c_contiguous or not dst.flags.writeable:
        raise ValueError("copy_to_host needs a writeable C-contiguous destination array")
    if dst.nbytes == 0:
        return dst
    runtime = runtime_api()
    handle = _stream_handle(stream)
    check(runtime.cudaMemcpyAsync(dst.ctypes.data, int(src_ptr), dst.nbytes,
                                  runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost, handle),
          "cudaMemcpyAsync(DeviceToHost)")
    counters.d2h_copies += 1
    check(runtime.cudaStreamSynchronize(handle), "cudaStreamSynchronize")
    counters.syncs += 1
    return dst


def memset(ptr: int, byte_value: int, nbytes: int, stream: Stream) -> None:
    """Queue setting `nbytes` bytes at `ptr` to `byte_value` on `stream` (no wait)."""
    if not 0 <= int(byte_value) <= 255:
        raise ValueError(f"memset byte value must be in 0..255, not {byte_value!r}")
    if nbytes < 0:
        raise ValueError(f"memset size must be non-negative, not {nbytes!r}")
    if nbytes == 0:
        return
    check(runtime_api().cudaMemsetAsync(int(ptr), int(byte_value), int(nbytes), _stream_handle(stream)),
          "cudaMemsetAsync")


# --------------------------------------------------------------------------------------------
# CUDA Graphs


class Graph:
    """A captured and instantiated CUDA Graph.

        with Graph.capture(stream) as graph:
            ...enqueue kernels, cuBLAS and cuDNN calls on `stream`...
        graph.launch(stream)

    Capture uses cudaStreamCaptureModeThreadLocal: an unsafe call (cudaMalloc, a sync) made by
    *this* thread during capture fails loudly instead of silently escaping the graph, while other
    threads of the process (a data loader, say) are not affected, as they would be with Global.
    """

    def __init__(self) -> None:
        self._graph: Any = None
        self._exec: Any = None

    @classmethod
    @contextmanager
    def capture(cls, stream: Stream) -> Iterator[Graph]:
        runtime = runtime_api()
        handle = _stream_handle(stream)
        if handle == 0:
            raise UsageError("CUDA Graph capture needs a created Stream, not the legacy default stream")
        graph = cls()
        check(runtime.cudaStreamBeginCapture(handle, runtime.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
              "cudaStreamBeginCapture")
        try:
            yield graph
        except BaseException:
            # End the capture so the stream is usable again, drop whatever was recorded, and let
            # the original exception through (capture may already be invalidated: ignore that).
            try:
                err, partial = runtime.cudaStreamEndCapture(handle)
                if not err and partial is not None and _handle(partial):
                    runtime.cudaGraphDestroy(partial)
            except Exception:
                pass
            raise
        captured = check(runtime.cudaStreamEndCapture(handle), "cudaStreamEndCapture")
        graph._graph = captured
        try:
            graph._exec = check(runtime.cudaGraphInstantiate(captured, 0), "cudaGraphInstantiate")
        except BaseException:
            graph.close()
            raise

    def launch(self, stream: Stream) -> None:
        """Queue one replay of the graph on `stream` (asynchronous)."""
        if self._exec is None:
            raise UsageError("this CUDA Graph was closed or never instantiated")
        check(runtime_api().cudaGraphLaunch(self._exec, _stream_handle(stream)), "cudaGraphLaunch")

    @property
    def num_nodes(self) -> int:
        """How many nodes (kernels, memsets, copies...) the captured graph holds."""
        if self._graph is None:
            raise UsageError("this CUDA Graph was closed or never captured")
        # With no node array, cudaGraphGetNodes only reports the count (the last returned value).
        result = check(runtime_api().cudaGraphGetNodes(self._graph), "cudaGraphGetNodes")
        count = result[-1] if isinstance(result, tuple) else result
        return int(count)

    def close(self) -> None:
        """Destroy the executable graph and the graph (idempotent)."""
        runtime = runtime_api() if (self._exec is not None or self._graph is not None) else None
        if self._exec is not None:
            exec_, self._exec = self._exec, None
            check(runtime.cudaGraphExecDestroy(exec_), "cudaGraphExecDestroy")
        if self._graph is not None:
            graph, self._graph = self._graph, None
            check(runtime.cudaGraphDestroy(graph), "cudaGraphDestroy")

    def __enter__(self) -> Graph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
