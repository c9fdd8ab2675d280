"""The CUDA runtime layer over `cuda.bindings` (CUDA 12 or 13): device, streams, events, memory,
copies and CUDA Graphs. Every call's status is checked: a `CudaError` names the call and the
status (``cudaMalloc failed: cudaErrorMemoryAllocation``). The counters let tests assert what the
training loop is built for: one device allocation per run, no host-blocking sync in the batch loop.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from graphtrain import phases
from graphtrain.errors import INSTALL_HINTS, GpuUnavailableError, UsageError


class CudaError(RuntimeError):
    """A CUDA runtime or driver call returned an error status."""

    def __init__(self, call: str, status: Any, detail: str | None = None):
        self.call = call
        name = getattr(status, "name", None)  # cudaError_t and CUresult are enums with a name
        self.status = name if isinstance(name, str) else str(status)
        super().__init__(f"{call} failed: {self.status}" + (f" ({detail})" if detail else ""))


class ClosedError(RuntimeError):
    """A stream, event, graph, module or library handle was used after `close()`."""

# --------------------------------------------------------------------------------------------
# cuda.bindings, imported on first use: without it graphtrain still runs, and says what is missing


@functools.cache
def bindings(name: str) -> Any:
    """The module `cuda.bindings.<name>` (runtime, driver, nvrtc); GpuUnavailableError if missing."""
    try:
        return importlib.import_module(f"cuda.bindings.{name}")
    except ImportError as exc:
        raise GpuUnavailableError(f"the CUDA Python bindings (cuda-bindings) are not installed ({exc}); "
                                  f"{INSTALL_HINTS['cuda_bindings']}") from None


def bindings_version() -> str | None:
    """cuda-bindings' version as the package itself says it; None where it is not installed or
    does not say (graphtrain.environment then reads the distribution's metadata)."""
    try:
        import cuda.bindings

        return str(cuda.bindings.__version__)
    except (ImportError, AttributeError):
        return None


def runtime_api() -> Any:
    return bindings("runtime")


def driver_api() -> Any:
    return bindings("driver")


def status_detail(status: Any) -> str | None:
    """The driver's or runtime's description of a status, when it can give one."""
    runtime, driver = runtime_api(), driver_api()
    if isinstance(status, runtime.cudaError_t):
        err, text = runtime.cudaGetErrorString(status)
    else:
        err, text = driver.cuGetErrorString(status)
    return None if err else (text.decode(errors="replace") if isinstance(text, bytes) else text) or None


def check(result: Any, call: str) -> Any:
    """Unwrap a cuda.bindings result `(status, *values)` into None, the one value or a tuple;
    CudaError unless the status is 0 (success, for runtime and driver alike)."""
    status, values = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    if status:
        raise CudaError(call, status, status_detail(status))
    return values[0] if len(values) == 1 else (values or None)


def cuda_version(encoded: int) -> str:
    """CUDA's version encoding, 1000 * major + 10 * minor: 13000 -> "13.0", 12080 -> "12.8"."""
    return f"{encoded // 1000}.{(encoded % 1000) // 10}"


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
    counters.mallocs = counters.frees = counters.syncs = counters.d2h_copies = 0


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
    sm_shared_bytes: int  # shared memory an SM holds for its blocks (each block also takes 1 KiB the system reserves)
    sm_registers: int     # 32-bit registers an SM holds
    sm_threads: int       # threads an SM holds


_devices: dict[int, DeviceInfo] = {}
_device_lock = threading.Lock()


def _unavailable(status: Any, runtime: Any) -> GpuUnavailableError:
    """Why the runtime cannot see a GPU, from cudaGetDeviceCount's status."""
    name = getattr(status, "name", str(status))
    if name == "cudaErrorNoDevice":
        return GpuUnavailableError(f"the NVIDIA driver found no GPU ({name})")
    if name != "cudaErrorInsufficientDriver":
        return GpuUnavailableError(f"cannot use the GPU: cudaGetDeviceCount failed: {name}")
    err, driver_encoded = runtime.cudaDriverGetVersion()
    if err or not driver_encoded:
        return GpuUnavailableError(f"no NVIDIA driver found: libcuda could not be loaded ({name}); "
                                   "install the NVIDIA driver on a machine with an NVIDIA GPU")
    runtime_encoded = runtime.cudaRuntimeGetVersion()[1]
    return GpuUnavailableError(
        f"the NVIDIA driver supports CUDA {cuda_version(driver_encoded)}, older than the CUDA "
        f"{cuda_version(runtime_encoded)} runtime of the installed cuda-bindings ({name}); install the "
        f"bindings that match the driver ({INSTALL_HINTS['cuda_bindings']}) or update the driver")


def device_count() -> int:
    """GPUs the runtime can see (after CUDA_VISIBLE_DEVICES); 0 where the driver reports none.
    GpuUnavailableError when there is no usable driver at all."""
    runtime = runtime_api()
    status, count = runtime.cudaGetDeviceCount()
    if getattr(status, "name", "") == "cudaErrorNoDevice":
        return 0
    if status:
        raise _unavailable(status, runtime)
    return int(count)


def open_device(ordinal: int = 0) -> DeviceInfo:
    """Initialise CUDA on GPU `ordinal` and make its primary context current on this thread (the
    context the driver API's modules and launches then use). Cached per ordinal; cudaSetDevice
    runs on every call because the current device is per host thread."""
    cached = _devices.get(ordinal)
    if cached is not None:
        check(runtime_api().cudaSetDevice(ordinal), "cudaSetDevice")
        return cached
    with phases.inside("cuda_context"):
        background = _background.pop(ordinal, None)
        if background is not None:
            background.opened.wait()  # not for its `then`, which goes on beside the caller
            if background.error is not None:
                raise background.error
        return _open_device(ordinal)


class _Opening(threading.Thread):
    """`_open_device` on a thread of its own; what it raised is kept for `open_device` to raise."""

    def __init__(self, ordinal: int, then: Callable[[], Any] | None) -> None:
        super().__init__(name=f"graphtrain-open-device-{ordinal}", daemon=True)
        self.ordinal, self.then, self.error = ordinal, then, None
        self.opened = threading.Event()  # set once the device is open, or failed to open

    def run(self) -> None:
        _retain_primary_context(self.ordinal)
        try:
            _open_device(self.ordinal)
        except BaseException as exc:  # raised again, in the caller's thread, by open_device
            self.error = exc
            return
        finally:
            self.opened.set()
        if self.then is not None:
            try:
                self.then()
            except Exception as exc:  # kept: wait_for_head_starts raises it
                _head_start_errors.append((self.name, exc))


_background: dict[int, _Opening] = {}
_started: list[threading.Thread] = []  # every head-start thread, waited for before the devices are released
_head_start_errors: list[tuple[str, Exception]] = []  # (thread, what it raised), for wait_for_head_starts


def _retain_primary_context(ordinal: int) -> None:
    """cuInit and the device's primary context straight through libcuda (ctypes releases the GIL
    during each call, and there is no Python module to import first), so that the driver's few
    hundred ms begin at once while the caller imports cuda.bindings and the rest. The context is
    the one the runtime then finds and makes current, retained once more for the process's life.
    A head start only: where a call fails, `_open_device` makes the same calls and says why."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    device, context = ctypes.c_int(), ctypes.c_void_p()
    if libcuda.cuInit(0) == 0 and libcuda.cuDeviceGet(ctypes.byref(device), ordinal) == 0:
        libcuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)


def open_device_in_background(ordinal: int = 0, then: Callable[[], Any] | None = None) -> None:
    """Start `open_device(ordinal)`'s work (cuInit, the primary context) on a thread of its own and
    return at once: the driver holds no Python lock meanwhile, so the caller's imports go on beside
    it. The next `open_device(ordinal)` waits for it (and raises what it raised); the context is
    the device's one primary context either way, made current there on the caller's thread.
    `then`, once the context is there, gets a head start on other work whose result is cached
    (loading NVRTC and the libraries the rung uses): the caller does not wait for it; what it
    raises, `wait_for_head_starts` raises."""
    if ordinal not in _devices and ordinal not in _background:
        _background[ordinal] = opening = _Opening(ordinal, then)
        _started.append(opening)
        opening.start()
        # Its `then` may use the context (the libraries' first calls): no capture begins beside it.
        before_capture(opening.join)
        try:
            runtime_api(), driver_api()  # imported here meanwhile: the caller needs them next
        except GpuUnavailableError:
            # No bindings: the thread met the same error and keeps it; the command's first use of
            # the GPU (open_device) raises it there, as the command's own one-line error.
            pass


def _open_device(ordinal: int) -> DeviceInfo:
    runtime, driver = runtime_api(), driver_api()
    with _device_lock:
        cached = _devices.get(ordinal)
        if cached is not None:
            check(runtime.cudaSetDevice(ordinal), "cudaSetDevice")
            return cached
        status, count = runtime.cudaGetDeviceCount()
        if status:
            raise _unavailable(status, runtime)
        if count == 0:
            raise GpuUnavailableError("the NVIDIA driver found no GPU (cudaGetDeviceCount returned 0)")
        if not 0 <= ordinal < count:
            raise UsageError(f"GPU {ordinal} does not exist: this machine has {count} GPU(s), numbered from 0")
        check(runtime.cudaSetDevice(ordinal), "cudaSetDevice")
        check(runtime.cudaFree(0), "cudaFree(0)")  # the documented idiom to create the context now
        check(driver.cuInit(0), "cuInit")

        def attribute(name: str) -> int:
            return int(check(runtime.cudaDeviceGetAttribute(getattr(runtime.cudaDeviceAttr, name), ordinal),
                             f"cudaDeviceGetAttribute({name})"))

        major, minor = attribute("cudaDevAttrComputeCapabilityMajor"), attribute("cudaDevAttrComputeCapabilityMinor")
        # The driver API gives name and memory without cudaDeviceProp, whose layout CUDA 13 changed.
        device = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
        name = check(driver.cuDeviceGetName(256, device), "cuDeviceGetName").split(b"\0", 1)[0]
        driver_cuda = check(runtime.cudaDriverGetVersion(), "cudaDriverGetVersion")
        runtime_cuda = check(runtime.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion")
        info = DeviceInfo(ordinal=ordinal, name=name.decode(errors="replace").strip(),
                          compute_capability=(major, minor), arch=f"sm_{major}{minor}",
                          sm_count=attribute("cudaDevAttrMultiProcessorCount"),
                          total_memory=int(check(driver.cuDeviceTotalMem(device), "cuDeviceTotalMem")),
                          driver_cuda_version=cuda_version(driver_cuda), runtime_version=cuda_version(runtime_cuda),
                          sm_shared_bytes=attribute("cudaDevAttrMaxSharedMemoryPerMultiprocessor"),
                          sm_registers=attribute("cudaDevAttrMaxRegistersPerMultiprocessor"),
                          sm_threads=attribute("cudaDevAttrMaxThreadsPerMultiProcessor"))
        _devices[ordinal] = info
        return info


class HeadStart:
    """Work begun on a thread of its own with a device current (`beside`). `result()` waits for
    it and returns what it returned, or raises what it raised: where its result is used, so that
    a failure surfaces there as the caller's own call would have. A failure no caller claimed is
    raised by `wait_for_head_starts`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.thread: threading.Thread | None = None
        self.value: Any = None
        self.error: Exception | None = None
        self.claimed = False  # its result (or failure) was handed to a caller

    def result(self) -> Any:
        self.thread.join()
        self.claimed = True
        if self.error is not None:
            raise self.error
        return self.value


_heads: list[HeadStart] = []  # every work begun by `beside`, for wait_for_head_starts


def beside(work: Callable[[], Any], device: DeviceInfo, name: str) -> HeadStart:
    """Do `work` on a thread of its own with `device` current, the caller going on at once; its
    `HeadStart` gives the result where it is needed (see there). The next stream capture, and
    `release_devices`, wait for the thread first (it uses the context)."""
    head = HeadStart(name)

    def run() -> None:
        try:
            # A new thread has no current context: the driver API's calls (cuStreamCreate) need one.
            check(runtime_api().cudaSetDevice(device.ordinal), "cudaSetDevice")
            head.value = work()
        except Exception as exc:  # kept: raised by head.result(), or by wait_for_head_starts
            head.error = exc

    head.thread = thread = threading.Thread(target=run, name=name, daemon=True)
    _heads.append(head)
    _started.append(thread)
    thread.start()
    before_capture(thread.join)
    return head


def start_beside(works: list[Callable[[], None]], device: DeviceInfo, name: str) -> HeadStart:
    """Do `works`, in order, on a thread of its own with `device` current (`beside`): a head start
    on once-a-process work whose result the driver or a library keeps (a library's first call),
    so that the caller's own later call finds it done, or waits for it where it is still under
    way rather than doing it again. What a work raises ends the thread; where the same call fails
    in the caller's own setup first, that error is the one the user sees, else
    `wait_for_head_starts` (or the returned HeadStart's `result`) raises it."""
    def run() -> None:
        for work in works:
            work()

    return beside(run, device, name)


def _join_head_starts() -> None:
    for thread in _started:
        thread.join()


class HeadStartError(RuntimeError):
    """Work begun on a head-start thread failed where the caller's own calls did not."""


def wait_for_head_starts() -> None:
    """Wait until every head-start thread (`open_device_in_background`'s, `beside`'s) is done:
    before work that must not share the GPU or the CPU with them (timed epochs). Raises what one
    of them raised that no caller was handed yet (once)."""
    _join_head_starts()
    for head in _heads:
        if head.error is not None and not head.claimed:
            head.claimed = True
            _head_start_errors.append((head.name, head.error))
    if _head_start_errors:
        name, exc = _head_start_errors[0]
        _head_start_errors.clear()
        raise HeadStartError(f"{name}: {type(exc).__name__}: {exc}") from exc


def release_devices() -> None:
    """Destroy the primary context of every GPU this process opened, and with it everything made in
    it (memory, modules, streams, graphs, the libraries' handles' state): what the driver does when
    the process exits, done here so that it happens, and is timed, before the process's last
    line (graphtrain.phases' `exit`). Only for a process about to end: nothing of CUDA may be used
    after it. The head-start threads are waited for first, since they may still use the context
    (what they raised was the setup's to raise: this runs on the way out, errors included)."""
    _join_head_starts()
    if not _devices:
        return
    driver = driver_api()
    with _device_lock:
        for ordinal in list(_devices):
            device = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
            # Destroys the context whatever its retain count (the start-up thread retained it once).
            check(driver.cuDevicePrimaryCtxReset(device), "cuDevicePrimaryCtxReset")
            del _devices[ordinal]


# --------------------------------------------------------------------------------------------
# Streams and events


class Stream:
    """A non-blocking CUDA stream: it never serialises with the legacy default stream, which other
    libraries may use behind our back. `handle` is the driver's CUstream, which both bindings
    take; `int(stream.handle)` is the address ctypes libraries (cuBLAS, cuDNN) want."""

    def __init__(self) -> None:
        driver = driver_api()
        self._handle = check(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")

    @property
    def handle(self) -> Any:
        if self._handle is None:
            raise ClosedError("this CUDA stream was closed")
        return self._handle

    def synchronize(self) -> None:
        """Block the host until all work queued on this stream has finished (counted)."""
        check(runtime_api().cudaStreamSynchronize(self.handle), "cudaStreamSynchronize")
        counters.syncs += 1

    def close(self) -> None:
        """Destroy the stream (idempotent). Work already queued still completes."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            check(driver_api().cuStreamDestroy(handle), "cuStreamDestroy")


def stream_wait(waiting: Stream, on: Stream) -> None:
    """Order the work queued on `waiting` from now on after the work queued on `on` so far,
    through an event. Inside a stream capture of `on`, this joins `waiting` into the capture
    (and the reverse call joins it back), as CUDA's cross-stream capture requires."""
    rt = runtime_api()
    event = check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "cudaEventCreateWithFlags")
    try:
        check(rt.cudaEventRecord(event, on.handle), "cudaEventRecord")
        check(rt.cudaStreamWaitEvent(waiting.handle, event, 0), "cudaStreamWaitEvent")
    finally:
        check(rt.cudaEventDestroy(event), "cudaEventDestroy")  # released once the wait is satisfied


class Event:
    """A CUDA event with timing enabled, for measuring GPU time between two points of a stream."""

    def __init__(self) -> None:
        self._event = check(runtime_api().cudaEventCreate(), "cudaEventCreate")

    def _require(self) -> Any:
        if self._event is None:
            raise ClosedError("this CUDA event was closed")
        return self._event

    def record(self, stream: Stream) -> None:
        """Record the event on `stream`: it completes once the work queued before it has."""
        check(runtime_api().cudaEventRecord(self._require(), stream.handle), "cudaEventRecord")

    def synchronize(self) -> None:
        """Block the host until the event has completed (counted)."""
        check(runtime_api().cudaEventSynchronize(self._require()), "cudaEventSynchronize")
        counters.syncs += 1

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds of GPU time from this event to `end`, which must have completed."""
        return float(check(runtime_api().cudaEventElapsedTime(self._require(), end._require()),
                           "cudaEventElapsedTime"))

    def close(self) -> None:
        """Destroy the event (idempotent)."""
        if self._event is not None:
            event, self._event = self._event, None
            check(runtime_api().cudaEventDestroy(event), "cudaEventDestroy")


# --------------------------------------------------------------------------------------------
# Memory and copies


def malloc(nbytes: int) -> int:
    """Allocate `nbytes` of device memory (counted); returns the device address."""
    if nbytes <= 0:
        raise ValueError(f"device allocation size must be positive, not {nbytes!r}")
    ptr = check(runtime_api().cudaMalloc(int(nbytes)), "cudaMalloc")
    counters.mallocs += 1
    return int(ptr)


def free(ptr: int) -> None:
    """Free device memory from `malloc` (counted)."""
    check(runtime_api().cudaFree(int(ptr)), "cudaFree")
    counters.frees += 1


@contextmanager
def scratch(nbytes: int) -> Iterator[int]:
    """`nbytes` of device memory (its address) for work that is not the run's, freed on leaving
    the block: outside the counters, which count the run's own allocations."""
    runtime = runtime_api()
    ptr = int(check(runtime.cudaMalloc(int(nbytes)), "cudaMalloc"))
    try:
        yield ptr
    finally:
        check(runtime.cudaFree(ptr), "cudaFree")


def wait_uncounted(stream: Stream) -> None:
    """`stream.synchronize()` outside the counters: for work that is not the run's."""
    check(runtime_api().cudaStreamSynchronize(stream.handle), "cudaStreamSynchronize")


def _copy(dst: int, src: int, nbytes: int, kind: str, stream: Stream) -> None:
    """Copy ordered on `stream` (a plain cudaMemcpy would use the legacy default stream, which does
    not order with non-blocking ones), then wait for it: the host array is free to change after."""
    runtime = runtime_api()
    check(runtime.cudaMemcpyAsync(dst, src, nbytes, getattr(runtime.cudaMemcpyKind, f"cudaMemcpy{kind}"),
                                  stream.handle), f"cudaMemcpyAsync({kind})")
    stream.synchronize()


def copy_to_device(dst_ptr: int, src: np.ndarray, stream: Stream) -> None:
    """Copy a host array to device memory at `dst_ptr` and wait (a counted sync). Setup-time only."""
    import numpy as np  # here, not at the top: open_device_in_background runs before numpy is imported

    host = np.ascontiguousarray(src)
    if host.nbytes:
        _copy(int(dst_ptr), host.ctypes.data, host.nbytes, "HostToDevice", stream)


def copy_to_host(src_ptr: int, dst: np.ndarray, stream: Stream) -> np.ndarray:
    """Copy `dst.nbytes` from device address `src_ptr` into the C-contiguous host array `dst`,
    after all work queued on `stream`; waits for it (one d2h copy and one sync counted)."""
    if not dst.flags.c_contiguous or not dst.flags.writeable:
        raise ValueError("copy_to_host needs a writeable C-contiguous destination array")
    if dst.nbytes:
        _copy(dst.ctypes.data, int(src_ptr), dst.nbytes, "DeviceToHost", stream)
        counters.d2h_copies += 1
    return dst


def memset(ptr: int, byte_value: int, nbytes: int, stream: Stream) -> None:
    """Queue setting `nbytes` bytes at `ptr` to `byte_value` on `stream` (no wait)."""
    if nbytes:
        check(runtime_api().cudaMemsetAsync(int(ptr), int(byte_value), int(nbytes), stream.handle),
              "cudaMemsetAsync")


# --------------------------------------------------------------------------------------------
# CUDA Graphs


_before_capture: list[Callable[[], None]] = []


def before_capture(work: Callable[[], None]) -> None:
    """Have `work` done before the next stream capture begins: what may not happen inside one
    (loading a module whose kernels are still compiling, at their first launch)."""
    _before_capture.append(work)


def drop_before_capture(work: Callable[[], None]) -> None:
    """Take back `work` given to `before_capture` that is no longer wanted (its owner closed)."""
    if work in _before_capture:
        _before_capture.remove(work)


def conditional_nodes() -> bool:
    """Whether the runtime and driver both have conditional graph nodes built by stream capture
    (CUDA 12.4)."""
    rt = runtime_api()
    return min(check(rt.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion"),
               check(rt.cudaDriverGetVersion(), "cudaDriverGetVersion")) >= 12040


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
        while _before_capture:
            _before_capture.pop(0)()
        runtime = runtime_api()
        handle = stream.handle
        graph = cls()
        check(runtime.cudaStreamBeginCapture(handle, runtime.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
              "cudaStreamBeginCapture")
        try:
            yield graph
        except BaseException:
            # End the capture so the stream is usable again and drop what was recorded; unchecked,
            # as the capture may already be invalidated: the original exception is the one to see.
            err, partial = runtime.cudaStreamEndCapture(handle)
            if not err and partial is not None and int(partial):
                runtime.cudaGraphDestroy(partial)
            raise
        graph._graph = check(runtime.cudaStreamEndCapture(handle), "cudaStreamEndCapture")
        try:
            graph._exec = check(runtime.cudaGraphInstantiate(graph._graph, 0), "cudaGraphInstantiate")
        except BaseException:
            graph.close()
            raise

    def launch(self, stream: Stream) -> None:
        """Queue one replay of the graph on `stream` (asynchronous)."""
        if self._exec is None:
            raise ClosedError("this CUDA Graph was closed")
        check(runtime_api().cudaGraphLaunch(self._exec, stream.handle), "cudaGraphLaunch")

    @property
    def num_nodes(self) -> int:
        """How many nodes (kernels, memsets, copies...) the captured graph holds."""
        if self._graph is None:
            raise ClosedError("this CUDA Graph was closed")
        # With no node array, cudaGraphGetNodes only reports the count (the last returned value).
        result = check(runtime_api().cudaGraphGetNodes(self._graph), "cudaGraphGetNodes")
        return int(result[-1] if isinstance(result, tuple) else result)

    @staticmethod
    @contextmanager
    def while_loop(stream: Stream, body: Stream) -> Iterator[int]:
        """Inside `Graph.capture(stream)`: a conditional WHILE node, whose body is what is queued on
        `body` inside this block. The body runs again while the loop's value is non-zero: 1 at
        each launch of the graph, then whatever a kernel of the body last set with
        cudaGraphSetConditional(handle, value). Yields the handle, a 64-bit kernel argument.
        Needs conditional nodes (`conditional_nodes()`)."""
        rt = runtime_api()
        _, _, graph, deps, _, count = check(rt.cudaStreamGetCaptureInfo(stream.handle), "cudaStreamGetCaptureInfo")
        handle = check(rt.cudaGraphConditionalHandleCreate(
            graph, 1, rt.cudaGraphConditionalHandleFlags.cudaGraphCondAssignDefault), "cudaGraphConditionalHandleCreate")
        params = rt.cudaGraphNodeParams()
        params.type = rt.cudaGraphNodeType.cudaGraphNodeTypeConditional
        params.conditional.handle = handle
        params.conditional.type = rt.cudaGraphConditionalNodeType.cudaGraphCondTypeWhile
        params.conditional.size = 1
        node = check(rt.cudaGraphAddNode(graph, deps, None, count, params), "cudaGraphAddNode(while)")
        check(rt.cudaStreamUpdateCaptureDependencies(
            stream.handle, [node], None, 1, rt.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamSetCaptureDependencies),
            "cudaStreamUpdateCaptureDependencies")
        check(rt.cudaStreamBeginCaptureToGraph(body.handle, params.conditional.phGraph_out[0], None, None, 0,
                                               rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
              "cudaStreamBeginCaptureToGraph")
        try:
            yield int(handle)
        finally:
            check(rt.cudaStreamEndCapture(body.handle), "cudaStreamEndCapture(while body)")

    def close(self) -> None:
        """Destroy the executable graph and the graph (idempotent)."""
        exec_, graph, self._exec, self._graph = self._exec, self._graph, None, None
        if exec_ is not None:
            check(runtime_api().cudaGraphExecDestroy(exec_), "cudaGraphExecDestroy")
        if graph is not None:
            check(runtime_api().cudaGraphDestroy(graph), "cudaGraphDestroy")


def replay_us(enqueue: Callable[[], None], stream: Stream, reps: int = 50) -> float:
    """GPU microseconds of one `enqueue()` on `stream`: `reps` of them captured into one graph, the
    graph replayed once (caches warm, lazily loaded kernels loaded), then once between two events.
    What a replayed step pays for that work, without the gaps of issuing it from the host."""
    start, end = Event(), Event()
    with Graph.capture(stream) as graph:
        for _ in range(reps):
            enqueue()
    try:
        graph.launch(stream)
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
        return 1e3 * start.elapsed_ms(end) / reps
    finally:
        graph.close()
        start.close()
        end.close()
