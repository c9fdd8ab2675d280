"""Kernels: compile CUDA C++ with NVRTC to a cubin (cached on disk), load it, launch it.

Kernel sources live in ``graphtrain/kernels/*.cu`` and declare each kernel as

    extern "C" __global__ void name(const float* __restrict__ x, float* y, int n)

`extern "C"` keeps the symbol name unmangled for cuModuleGetFunction, and the declaration is parsed
here (`kernel_signatures`) so a launch can take plain Python ints and floats and pack each into the
C type the kernel expects.

Compiling for the real architecture (``sm_90``, not ``compute_90``) gives a cubin the driver loads
without a JIT step. ``--use_fast_math`` is deliberately not used: the losses need accurate
expf/logf.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphtrain.errors import GpuUnavailableError, GraphtrainError, UsageError
from graphtrain.libs import cuda

KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"

_CACHE_MAGIC = b"GTCUBIN1"  # file = magic + sha256(cubin) + cubin: a torn or corrupt entry is detected
_DEFAULT_OPTIONS = ("-std=c++17",)


class NvrtcError(GraphtrainError):
    """NVRTC failed; for a compile error the message holds the file name and NVRTC's log."""

    def __init__(self, message: str, *, call: str | None = None, status: str | None = None,
                 log: str | None = None, name: str | None = None):
        super().__init__(message)
        self.call = call
        self.status = status
        self.log = log
        self.name = name


class KernelSignatureError(GraphtrainError, ValueError):
    """A kernel declaration uses a parameter type that cannot be passed from Python."""


class KernelArgumentError(UsageError, TypeError):
    """A kernel was launched with the wrong number or kind of arguments."""


@dataclass
class CompileCounters:
    """How many NVRTC compilations ran and how many cubins came from the disk cache."""

    compiles: int = 0
    cache_hits: int = 0


counters = CompileCounters()


# --------------------------------------------------------------------------------------------
# NVRTC bindings


_nvrtc_module: Any = None


def _nvrtc() -> Any:
    """`cuda.bindings.nvrtc`, imported alone: compiling needs no driver and no GPU."""
    global _nvrtc_module
    if _nvrtc_module is None:
        try:
            from cuda.bindings import nvrtc
        except ImportError:
            try:
                from cuda import nvrtc  # type: ignore[no-redef]  # cuda-python 12.6.0 layout
            except ImportError:
                raise GpuUnavailableError(
                    f"the CUDA Python bindings (cuda-bindings) are not installed; {cuda.INSTALL_HINT}"
                ) from None
        _nvrtc_module = nvrtc
    return _nvrtc_module


def _nvrtc_call(call: str, fn: Any, *args: Any) -> Any:
    """Call an NVRTC binding and unwrap `(status, *values)`; NvrtcError on failure."""
    try:
        result = fn(*args)
    except RuntimeError as exc:
        # cuda-bindings loads libnvrtc on first call; a missing library surfaces here.
        raise GpuUnavailableError(
            f"the NVRTC library (libnvrtc) could not be loaded: {exc}; "
            f"pip install nvidia-cuda-nvrtc (CUDA 13) or nvidia-cuda-nvrtc-cu12, or {cuda.INSTALL_HINT}"
        ) from exc
    status, values = result[0], result[1:]
    if status:
        name = getattr(status, "name", str(status))
        raise NvrtcError(f"{call} failed: {name}", call=call, status=name)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


_version: str | None = None


def nvrtc_version() -> str:
    """NVRTC's version, e.g. "13.0" (GpuUnavailableError if NVRTC cannot be loaded)."""
    global _version
    if _version is None:
        nvrtc = _nvrtc()
        major, minor = _nvrtc_call("nvrtcVersion", nvrtc.nvrtcVersion)
        _version = f"{major}.{minor}"
    return _version


# --------------------------------------------------------------------------------------------
# Compilation with a disk cache


def cache_dir() -> Path:
    """Where compiled cubins are kept: $GRAPHTRAIN_CACHE, else $XDG_CACHE_HOME/graphtrain/kernels
    (~/.cache/graphtrain/kernels when XDG_CACHE_HOME is unset)."""
    explicit = os.environ.get("GRAPHTRAIN_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "graphtrain" / "kernels"


def _normalise_arch(arch: str) -> str:
    text = str(arch).strip()
    if re.fullmatch(r"sm_\d{2,3}[af]?", text):
        return text
    raise UsageError(f"GPU architecture must look like 'sm_90' (a real architecture), not {arch!r}")


def _cache_key(source: str, options: Sequence[str], arch: str, version: str) -> str:
    digest = hashlib.sha256()
    for part in ("graphtrain-cubin-v1", version, arch, "\0".join(options), source):
        digest.update(part.encode())
        digest.update(b"\xff")  # separator that cannot occur in UTF-8 text
    return digest.hexdigest()


def _read_cache(path: Path) -> bytes | None:
    """The cached cubin, or None when absent, unreadable or corrupt (then it is recompiled)."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    header = len(_CACHE_MAGIC) + 32
    if len(blob) <= header or not blob.startswith(_CACHE_MAGIC):
        return None
    cubin = blob[header:]
    if hashlib.sha256(cubin).digest() != blob[len(_CACHE_MAGIC):header]:
        return None
    return cubin


def _write_cache(path: Path, cubin: bytes) -> None:
    """Write atomically (temp file + os.replace) so readers never see a half-written entry.

    The cache is an optimisation: failing to write it (read-only home, full disk) is not an error.
    """
    tmp_name = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=path.stem[:16] + ".", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            fh.write(_CACHE_MAGIC + hashlib.sha256(cubin).digest() + cubin)
        os.replace(tmp_name, path)
        tmp_name = None
    except OSError:
        pass
    finally:
        if tmp_name is not None:
            try:
                os.unlink(tmp_name)
            except OSError:
                pass


def _program_log(nvrtc: Any, program: Any) -> str:
    size = _nvrtc_call("nvrtcGetProgramLogSize", nvrtc.nvrtcGetProgramLogSize, program)
    if not size or size <= 1:
        return ""
    log = b" " * size  # the binding fills this buffer in place
    _nvrtc_call("nvrtcGetProgramLog", nvrtc.nvrtcGetProgramLog, program, log)
    return log.rstrip(b"\0").decode(errors="replace").strip()


def _compile(source: str, name: str, options: Sequence[str]) -> bytes:
    """Run NVRTC once; NvrtcError with the log on a compile error."""
    nvrtc = _nvrtc()
    program = _nvrtc_call("nvrtcCreateProgram", nvrtc.nvrtcCreateProgram,
                          source.encode(), name.encode(), 0, [], [])
    try:
        encoded = [opt.encode() for opt in options]
        result = nvrtc.nvrtcCompileProgram(program, len(encoded), encoded)
        status = result[0]
        if status:
            status_name = getattr(status, "name", str(status))
            log = _program_log(nvrtc, program)
            raise NvrtcError(
                f"NVRTC could not compile {name} ({status_name}, options: {' '.join(options)}):\n{log}",
                call="nvrtcCompileProgram", status=status_name, log=log, name=name,
            )
        size = _nvrtc_call("nvrtcGetCUBINSize", nvrtc.nvrtcGetCUBINSize, program)
        cubin = b" " * size
        _nvrtc_call("nvrtcGetCUBIN", nvrtc.nvrtcGetCUBIN, program, cubin)
        return cubin
    finally:
        # Cleanup only: its status is not checked so it cannot mask the error being raised.
        nvrtc.nvrtcDestroyProgram(program)


def compile_cubin(source: str, name: str, arch: str, options: Iterable[str] = ()) -> bytes:
    """Compile CUDA C++ `source` (called `name` in messages) to a cubin for `arch` ("sm_90").

    Cached on disk under `cache_dir()`, keyed by the source, the options, the architecture and the
    NVRTC version; an unreadable or corrupt entry is recompiled.
    """
    arch = _normalise_arch(arch)
    version = nvrtc_version()
    all_options = (f"--gpu-architecture={arch}", *_DEFAULT_OPTIONS, *[str(o) for o in options])
    path = cache_dir() / f"{_cache_key(source, all_options, arch, version)}.cubin"
    cached = _read_cache(path)
    if cached is not None:
        counters.cache_hits += 1
        return cached
    cubin = _compile(source, name, all_options)
    counters.compiles += 1
    _write_cache(path, cubin)
    return cubin


# --------------------------------------------------------------------------------------------
# Parsing kernel declarations


_SCALAR_TYPES: dict[str, Any] = {
    "int": ctypes.c_int,
    "signed": ctypes.c_int,
    "signed int": ctypes.c_int,
    "int32_t": ctypes.c_int32,
    "unsigned": ctypes.c_uint,
    "unsigned int": ctypes.c_uint,
    "uint32_t": ctypes.c_uint32,
    "long": ctypes.c_long,  # CUDA matches the host's long: 64-bit on Linux
    "long int": ctypes.c_long,
    "unsigned long": ctypes.c_ulong,
    "long long": ctypes.c_longlong,
    "long long int": ctypes.c_longlong,
    "signed long long": ctypes.c_longlong,
    "int64_t": ctypes.c_int64,
    "unsigned long long": ctypes.c_ulonglong,
    "unsigned long long int": ctypes.c_ulonglong,
    "uint64_t": ctypes.c_uint64,
    "size_t": ctypes.c_size_t,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}
_QUALIFIERS = {"const", "volatile", "__restrict__", "__restrict", "restrict", "__grid_constant__", "struct"}
_TYPE_WORDS = {"int", "signed", "unsigned", "long", "short", "char", "float", "double", "bool", "void",
               "size_t", "int32_t", "uint32_t", "int64_t", "uint64_t", "half", "__half"}
_INTEGER_CTYPES = {ctypes.c_int, ctypes.c_uint, ctypes.c_long, ctypes.c_ulong, ctypes.c_longlong,
                   ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_int32, ctypes.c_uint32, ctypes.c_int64,
                   ctypes.c_uint64}

_KERNEL_HEAD = re.compile(
    r"(?P<quals>(?:(?:(?:__global__|void|static|inline|__noinline__|__forceinline__)\b"
    r"|__launch_bounds__\s*\([^()]*\))\s*)+)(?P<name>[A-Za-z_]\w*)\s*\("
)
_EXTERN_C = re.compile(r'\bextern\s*"C"\s*')


def _strip_comments(source: str) -> str:
    """Drop // and /* */ comments, keeping string and character literals intact."""
    out: list[str] = []
    i, n = 0, len(source)
    while i < n:
        c = source[i]
        if c == "/" and source.startswith("//", i):
            j = source.find("\n", i)
            i = n if j < 0 else j
        elif c == "/" and source.startswith("/*", i):
            j = source.find("*/", i + 2)
            out.append(" ")
            i = n if j < 0 else j + 2
        elif c in "\"'":
            j = i + 1
            while j < n and source[j] != c:
                j += 2 if source[j] == "\\" else 1
            out.append(source[i:j + 1])
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _matching(text: str, start: int, open_: str, close: str) -> int:
    """Index just past the bracket that closes the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    raise KernelSignatureError(f"unbalanced {open_}{close} in kernel source near: {text[start:start + 60]!r}")


def _split_params(params: str) -> list[str]:
    parts, depth, current = [], 0, []
    for c in params:
        if c in "(<[":
            depth += 1
        elif c in ")>]":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(c)
    parts.append("".join(current))
    return [p.strip() for p in parts]


def _param_ctype(kernel: str, index: int, param: str) -> Any:
    decl = param.split("=", 1)[0].strip()  # a default argument does not change the type
    if "&" in decl:
        raise KernelSignatureError(f"kernel {kernel}: parameter {index} ({param!r}) is a reference; "
                                   "__global__ parameters must be values or pointers")
    if "*" in decl or "[" in decl:
        return ctypes.c_void_p  # every pointer is a device address
    words = [w for w in re.findall(r"[A-Za-z_]\w*", decl) if w not in _QUALIFIERS]
    if len(words) > 1 and words[-1] not in _TYPE_WORDS:
        words = words[:-1]  # drop the parameter name
    type_name = " ".join(words)
    if type_name == "bool":
        raise KernelSignatureError(
            f"kernel {kernel}: parameter {index} ({param!r}) is a bool, whose size the C++ ABI leaves "
            "to the compiler; pass an int instead"
        )
    ctype = _SCALAR_TYPES.get(type_name)
    if ctype is None:
        raise KernelSignatureError(
            f"kernel {kernel}: parameter {index} ({param!r}) has type {type_name!r}, which cannot be "
            f"passed from Python; use a pointer or one of: {', '.join(sorted(_SCALAR_TYPES))}"
        )
    return ctype


def _parse_head(text: str, pos: int, found: dict[str, list[Any]]) -> int:
    """Parse one `__global__ void name(...)` starting at `pos`; return the index after it, or -1."""
    match = _KERNEL_HEAD.match(text, pos)
    if not match:
        return -1
    quals = match.group("quals")
    if "__global__" not in quals or not re.search(r"\bvoid\b", quals):
        return -1
    name = match.group("name")
    open_paren = match.end() - 1
    close = _matching(text, open_paren, "(", ")")
    inner = text[open_paren + 1:close - 1].strip()
    params = [] if inner in ("", "void") else _split_params(inner)
    types = [_param_ctype(name, i, p) for i, p in enumerate(params)]
    if found.setdefault(name, types) != types:  # a forward declaration must agree with the definition
        raise KernelSignatureError(f"kernel {name} is declared twice with different parameters")
    return close


def kernel_signatures(source: str) -> dict[str, list[Any]]:
    """Map each `extern "C" __global__ void NAME(...)` kernel to its parameters' ctypes types.

    Pointers of any kind become c_void_p; int -> c_int, unsigned -> c_uint, long long/int64_t ->
    c_longlong, float -> c_float, double -> c_double (and a few fixed-width aliases). A bool
    parameter raises KernelSignatureError. Kernels inside an `extern "C" { ... }` block count too;
    __global__ functions without C linkage are skipped (their names are mangled).
    """
    text = _strip_comments(source)
    found: dict[str, list[Any]] = {}
    for extern in _EXTERN_C.finditer(text):
        pos = extern.end()
        if pos < len(text) and text[pos] == "{":
            block_end = _matching(text, pos, "{", "}")
            block = text[pos + 1:block_end - 1]
            for head in re.finditer(r"__global__|__launch_bounds__|\bvoid\b", block):
                # Only try at a declaration start (after a ; } or { or at the block start).
                before = block[:head.start()].rstrip()
                if before and before[-1] not in ";{}":
                    continue
                _parse_head(block, head.start(), found)
        else:
            _parse_head(text, pos, found)
    return found


# --------------------------------------------------------------------------------------------
# Modules and kernels


def _dims(value: Any, what: str, kernel: str) -> tuple[int, int, int]:
    if type(value) is int and value > 0:
        return value, 1, 1
    if isinstance(value, (tuple, list)) and 1 <= len(value) <= 3:
        dims = tuple(value) + (1,) * (3 - len(value))
        if all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
            return dims  # type: ignore[return-value]
    raise KernelArgumentError(f"kernel {kernel}: {what} must be a positive int or a tuple of 1 to 3 "
                              f"positive ints, not {value!r}")


class Kernel:
    """A launchable kernel: ``kernel(grid, block, stream, *args, shared_bytes=0)``.

    The argument slots (one ctypes object per parameter) and the array of pointers to them are
    built once; a launch only stores the new values and calls cuLaunchKernel with the array's
    address. The driver copies the values during the call (and into the graph node when
    capturing), so reusing the slots is safe. A Kernel is not meant to be launched from several
    threads at once.
    """

    __slots__ = ("name", "param_types", "_function", "_slots", "_array", "_params", "_int_slots",
                 "_launch", "_call_name")

    def __init__(self, name: str, function: Any, param_types: Sequence[Any]):
        self.name = name
        self.param_types = tuple(param_types)
        self._function = function
        self._slots = tuple(t() for t in self.param_types)
        self._array = (ctypes.c_void_p * max(len(self._slots), 1))(
            *[ctypes.addressof(slot) for slot in self._slots]
        )
        # cuda.bindings takes kernelParams as an int: the address of a void*[] (documented forms:
        # None, an int address, a buffer, or ((values), (types))). NULL when there are no params.
        self._params = ctypes.addressof(self._array) if self._slots else 0
        # ctypes integers wrap silently on overflow; these are read back to catch it.
        self._int_slots = tuple(
            (i, slot) for i, (slot, t) in enumerate(zip(self._slots, self.param_types)) if t in _INTEGER_CTYPES
        )
        self._launch = cuda.driver_api().cuLaunchKernel
        self._call_name = f"cuLaunchKernel({name})"

    def __call__(self, grid: Any, block: Any, stream: Any, *args: Any, shared_bytes: int = 0) -> None:
        slots = self._slots
        if len(args) != len(slots):
            raise KernelArgumentError(
                f"kernel {self.name} takes {len(slots)} argument(s) "
                f"({', '.join(t.__name__ for t in self.param_types) or 'none'}), got {len(args)}"
            )
        try:
            for slot, value in zip(slots, args):
                slot.value = value
        except TypeError:
            self._pack_slow(args)
        for i, slot in self._int_slots:
            if slot.value != args[i]:
                raise KernelArgumentError(f"kernel {self.name}: argument {i} ({args[i]!r}) does not fit "
                                          f"in {self.param_types[i].__name__}")
        gx, gy, gz = _dims(grid, "grid", self.name)
        bx, by, bz = _dims(block, "block", self.name)
        try:
            handle = stream.handle
        except AttributeError:
            handle = cuda._stream_handle(stream)
        if not handle:
            handle = cuda._stream_handle(stream)  # raises for a closed Stream; None/0 is the default stream
        if self._function is None:
            raise KernelArgumentError(f"kernel {self.name}: its module was unloaded")
        status = self._launch(self._function, gx, gy, gz, bx, by, bz, shared_bytes, handle, self._params, 0)[0]
        if status:
            raise cuda.CudaError(self._call_name, status, cuda._status_detail(status))

    def _pack_slow(self, args: Sequence[Any]) -> None:
        """Convert arguments the fast path could not store, or say which one is wrong."""
        for i, (slot, ctype, value) in enumerate(zip(self._slots, self.param_types, args)):
            try:
                if ctype is ctypes.c_void_p:
                    ptr = getattr(value, "ptr", value)  # accept a memory.Buffer for a pointer
                    slot.value = None if ptr is None else int(ptr)
                else:
                    slot.value = value
            except (TypeError, ValueError):
                raise KernelArgumentError(
                    f"kernel {self.name}: argument {i} ({value!r}) cannot be passed as {ctype.__name__}"
                ) from None

    def __repr__(self) -> str:
        return f"Kernel({self.name}({', '.join(t.__name__ for t in self.param_types)}))"


class Module:
    """A compiled kernel file loaded into the current CUDA context."""

    def __init__(self, name: str, handle: Any, signatures: dict[str, list[Any]]):
        self.name = name
        self.signatures = signatures
        self._handle = handle
        self._kernels: dict[str, Kernel] = {}

    @classmethod
    def load(cls, file_stem: str, device: cuda.DeviceInfo, kernels_dir: str | Path | None = None,
             options: Iterable[str] = ()) -> Module:
        """Read `<kernels_dir>/<file_stem>.cu` (default: graphtrain/kernels), compile it for the
        device's architecture (cached) and load it."""
        directory = Path(kernels_dir) if kernels_dir is not None else KERNELS_DIR
        path = directory / f"{file_stem}.cu"
        try:
            source = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise GraphtrainError(f"cannot read kernel source {path}: {exc.strerror or exc}") from exc
        return cls.from_source(source, path.name, device, options)

    @classmethod
    def from_source(cls, source: str, name: str, device: cuda.DeviceInfo,
                    options: Iterable[str] = ()) -> Module:
        """Compile and load CUDA C++ given as a string (`name` is used in messages)."""
        signatures = kernel_signatures(source)  # a bad declaration fails before compiling
        cubin = compile_cubin(source, name, device.arch, options)
        cuda.open_device(device.ordinal)  # the module goes into this device's primary context
        handle = cuda.check(cuda.driver_api().cuModuleLoadData(cubin), f"cuModuleLoadData({name})")
        return cls(name, handle, signatures)

    @property
    def kernel_names(self) -> list[str]:
        """The extern "C" kernels the source declares, in declaration order."""
        return list(self.signatures)

    def kernel(self, name: str) -> Kernel:
        """The kernel `name`, with its parsed signature (looked up once, then cached)."""
        kernel = self._kernels.get(name)
        if kernel is not None:
            return kernel
        if self._handle is None:
            raise UsageError(f"module {self.name} was unloaded")
        if name not in self.signatures:
            known = ", ".join(sorted(self.signatures)) or "none"
            raise UsageError(f'{self.name} declares no extern "C" __global__ kernel {name!r} (it has: {known})')
        function = cuda.check(cuda.driver_api().cuModuleGetFunction(self._handle, name.encode()),
                              f"cuModuleGetFunction({name})")
        kernel = Kernel(name, function, self.signatures[name])
        self._kernels[name] = kernel
        return kernel

    def close(self) -> None:
        """Unload the module (idempotent); its kernels refuse to launch afterwards."""
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        for kernel in self._kernels.values():
            kernel._function = None
        self._kernels.clear()
        cuda.check(cuda.driver_api().cuModuleUnload(handle), f"cuModuleUnload({self.name})")

    def __enter__(self) -> Module:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Module({self.name!r}, kernels={sorted(self.signatures)})"
