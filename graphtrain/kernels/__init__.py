"""CUDA kernels, each `.cu` file beside the Python module that launches it.

`X.cu` holds the kernels of one concern; `X.py` owns everything a launch needs: the block sizes
(handed to the `.cu` as `-D` defines, so each is written once), the grid for given sizes, and each
kernel's argument types. A stage calls a launcher named after the math and never sees a grid.
Adding a kernel file is about twenty lines:

    // kernels/scale.cu: the block size is not defined here; it comes from scale.py.
    extern "C" __global__ void scale(float* y, float a, int n) {
        int i = blockIdx.x * SCALE_THREADS + threadIdx.x;
        if (i < n) y[i] *= a;
    }

    # kernels/scale.py
    from graphtrain.kernels import F32, I32, PTR, KernelFile, ceil_div, kernel

    THREADS = 256

    class Scale(KernelFile):
        stem = "scale"                           # the .cu beside this file
        defines = {"SCALE_THREADS": THREADS}     # -DSCALE_THREADS=256
        _scale = kernel("scale", PTR, F32, I32)  # the kernel's arguments, declared once

        def scale(self, stream, y: int, a: float, n: int) -> None:
            # y *= a over n floats, one thread per element
            self._scale(stream, ceil_div(n, THREADS), THREADS, y, a, n)

    # in a stage's setup:  self.scale_cu = Scale(self.device)
    # in its step:         self.scale_cu.scale(self.stream, buf.ptr, 0.5, buf.size)
    # in its close:        self.scale_cu.close()

The convention: a declared kernel is the class attribute `_name`; its launcher is a method named
after the math (usually `name`), whose arguments are (stream, device addresses, sizes) and which
computes the launch geometry itself. Pointers are ints (`Buffer.ptr`, `Buffer.at(i)`), or 0 for NULL.

What is checked, and when: the argument types when the class is defined; their number, kinds
and sizes against the `.cu` by the compiler, from a `static_assert` per argument appended to the
source (NVRTC, on any machine, also without a GPU: the CPU tests compile every file for sm_80
and sm_90), so a wrong declaration fails to compile with a message naming the kernel and the
argument; nothing in Python per launch, which packs the
values with one precompiled `struct.pack_into` (refusing, in C, a wrong count, a float for an int
or a value out of range) and calls the driver. `kernel(...)` also takes `cluster=(x, y, z)` (a
thread-block cluster, launched through cuLaunchKernelEx), `cooperative=True` (grid-wide sync),
and `max_shared_bytes=N` (raises the kernel's dynamic shared memory limit once, above the
default 48 KiB); a launch passes `shared_bytes=N` for its dynamic shared memory. A class may set
`options` (extra NVRTC options), `arch_suffix = "a"` (compile for sm_90a: wgmma, setmaxnreg) and
`headers` (`.cuh` files of kernels/ whose text goes before the source: device helpers two files
share).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from numbers import Integral
from pathlib import Path
from typing import Any, ClassVar

from graphtrain import phases
from graphtrain.libs import cuda
from graphtrain.libs.nvrtc import (F32, F64, I32, I64, PTR, U32, U64, Kernel, KernelArgumentError, KernelSpec,
                                   Module, compile_cubin_async)

KERNELS_DIR = Path(__file__).resolve().parent


def ceil_div(n: int, d: int) -> int:
    """⌈n / d⌉ for n >= 0 and d > 0, in integers (no float rounding): the blocks of d threads
    that cover n items, the batches of d samples that cover n samples."""
    return -(-n // d)


# --------------------------------------------------------------------------------------------
# The model axis (model_axis.cuh): K models of one shape trained by one launch, model k along
# gridDim.z, its per-model buffers model_stride bytes after model k − 1's. A launcher that has the
# axis takes `models: int = 1, model_stride: int = 0` (bytes); one model is the launch as it was.

MODEL_STRIDE_ALIGNMENT = 256  # bytes: an arena's own alignment, which the kernels' 16-byte loads rely on
MAX_MODELS = 65535  # gridDim.z's limit


def model_stride_arg(models: int, model_stride: int) -> int:
    """The stride a launch of `models` models hands its kernel: model_stride, or 0 for one model
    (whatever was given: a one-model launch is the same launch as before the axis). ValueError, a
    bug in the caller, for a count gridDim.z cannot hold, or a stride that is negative, not a
    multiple of MODEL_STRIDE_ALIGNMENT, or 0 for several models (their outputs would overlap)."""
    if isinstance(models, bool) or not isinstance(models, Integral) or not 1 <= models <= MAX_MODELS:
        raise ValueError(f"models must be an int in 1..{MAX_MODELS} (gridDim.z), not {models!r}")
    if isinstance(model_stride, bool) or not isinstance(model_stride, Integral) or model_stride < 0 \
            or model_stride % MODEL_STRIDE_ALIGNMENT:
        raise ValueError(f"model_stride must be a non-negative multiple of {MODEL_STRIDE_ALIGNMENT} bytes, "
                         f"not {model_stride!r}")
    if models > 1 and model_stride == 0:
        raise ValueError(f"{models} models with model_stride 0 would write one another's buffers")
    return int(model_stride) if models > 1 else 0


def model_grid(grid: int | tuple[int, int, int], models: int) -> int | tuple[int, int, int]:
    """A one-model launch's grid (blocks, or (x, y, 1)) with the models along z; one model: as given."""
    if models == 1:
        return grid
    x, y, z = grid if isinstance(grid, tuple) else (grid, 1, 1)
    if z != 1:
        raise ValueError(f"a grid of {grid} already uses z: the model axis needs it")
    return (x, y, int(models))


# --------------------------------------------------------------------------------------------
# Declaring kernels, and checking the declarations against the source

# The C kind each argument type must have in the kernel (its size is the ctypes size).
_KINDS = {PTR: "p", I32: "i", U32: "u", I64: "i", U64: "u", F32: "f", F64: "f"}
_KIND_NAMES = {"p": "a pointer", "i": "a signed integer", "u": "an unsigned integer", "f": "a floating-point value"}


def kernel(name: str, *arg_types: Any, cluster: Sequence[int] | None = None, cooperative: bool = False,
           max_shared_bytes: int = 0) -> KernelSpec:
    """Declare a kernel: `kernel("saxpy", F32, PTR, PTR, I32)`."""
    for i, t in enumerate(arg_types):
        if t not in _KINDS:
            raise KernelArgumentError(f"kernel {name}: argument {i} has type {t!r}; declare it as one of "
                                      "PTR, I32, U32, I64, U64, F32, F64 (graphtrain.kernels)")
    dims = None
    if cluster is not None:
        dims = (*cluster, 1, 1)[:3]
        if len(cluster) > 3 or not all(isinstance(d, int) and d > 0 for d in dims):
            raise ValueError(f"kernel {name}: cluster must be 1 to 3 positive ints, not {cluster!r}")
    if max_shared_bytes < 0:
        raise ValueError(f"kernel {name}: max_shared_bytes must be non-negative, not {max_shared_bytes}")
    return KernelSpec(name, tuple(arg_types), dims, bool(cooperative), int(max_shared_bytes))


_CHECK_PRELUDE = r"""
// ---- appended by graphtrain.kernels: the Python declarations of this file's kernels ----
template <class T> struct graphtrain_kind { static constexpr char value = '?'; };
template <class T> struct graphtrain_kind<T*> { static constexpr char value = 'p'; };
#define GRAPHTRAIN_KIND(type, kind) template <> struct graphtrain_kind<type> { static constexpr char value = kind; };
GRAPHTRAIN_KIND(int, 'i') GRAPHTRAIN_KIND(long, 'i') GRAPHTRAIN_KIND(long long, 'i')
GRAPHTRAIN_KIND(unsigned, 'u') GRAPHTRAIN_KIND(unsigned long, 'u') GRAPHTRAIN_KIND(unsigned long long, 'u')
GRAPHTRAIN_KIND(float, 'f') GRAPHTRAIN_KIND(double, 'f')
#undef GRAPHTRAIN_KIND
template <unsigned I, class... P> struct graphtrain_arg {  // past the last argument
    static constexpr char kind = '-'; static constexpr unsigned size = 0; };
template <class H, class... T> struct graphtrain_arg<0, H, T...> {
    static constexpr char kind = graphtrain_kind<H>::value; static constexpr unsigned size = sizeof(H); };
template <unsigned I, class H, class... T> struct graphtrain_arg<I, H, T...> : graphtrain_arg<I - 1, T...> {};
template <class F> struct graphtrain_params;
template <class... P> struct graphtrain_params<void(P...)> {
    static constexpr unsigned count = sizeof...(P);
    template <unsigned I> using arg = graphtrain_arg<I, P...>;
};
"""


def declarations_check(specs: Iterable[KernelSpec]) -> str:
    """C++ that fails to compile unless each kernel takes exactly the declared arguments."""
    lines = [_CHECK_PRELUDE]
    for spec in specs:
        params = f"graphtrain_params<decltype({spec.name})>"
        lines.append(f'static_assert({params}::count == {len(spec.arg_types)}, '
                     f'"kernel {spec.name} is declared in Python with {len(spec.arg_types)} arguments");')
        for i, t in enumerate(spec.arg_types):
            kind, size = _KINDS[t], ctypes.sizeof(t)
            arg = f"{params}::arg<{i}>"
            lines.append(f"static_assert({arg}::kind == '{kind}' && {arg}::size == {size}, \"kernel {spec.name}: "
                         f'argument {i} is declared in Python as {t.__name__}, {_KIND_NAMES[kind]} of {size} bytes");')
    return "\n".join(lines) + "\n"


def compile_kernels(source: str, name: str, arch: str, specs: Iterable[KernelSpec],
                    defines: Mapping[str, int | str] | None = None, options: Iterable[str] = ()) -> bytes:
    """Compile a kernel file with its `-D` defines and extra options, checking its declarations."""
    return compile_kernels_async(source, name, arch, specs, defines, options).result()


def compile_kernels_async(source: str, name: str, arch: str, specs: Iterable[KernelSpec],
                          defines: Mapping[str, int | str] | None = None, options: Iterable[str] = ()) -> Future:
    """`compile_kernels` as a Future (see `compile_cubin_async`)."""
    define_options = [f"-D{key}={value}" for key, value in (defines or {}).items()]
    return compile_cubin_async(source + declarations_check(specs), name, arch, [*define_options, *options])


def load_source(source: str, name: str, device: cuda.DeviceInfo, specs: Sequence[KernelSpec], *,
                defines: Mapping[str, int | str] | None = None, options: Iterable[str] = (),
                arch_suffix: str = "") -> Module:
    """Compile CUDA C++ given as a string (`name` is used in messages) for the device, and load it."""
    return Module(name, compile_kernels(source, name, device.arch + arch_suffix, specs, defines, options),
                  specs, device)


# --------------------------------------------------------------------------------------------
# A kernel file and its launchers


class _SharedFile:
    """One kernel file as this process holds it for one device: its cubin (a Future while it
    compiles) and, once loaded, its module, which every instance of the file with the same
    defines on that device uses."""

    def __init__(self, device: cuda.DeviceInfo, cubin: Future):
        self.device, self.cubin = device, cubin
        self.module: Module | None = None

    def usable_for(self, device: cuda.DeviceInfo) -> bool:
        """Whether this entry still serves `device`: opened in the same context (a device
        released and opened again is a new DeviceInfo, its modules gone with the old context),
        and not a compile that failed (tried again)."""
        failed = self.module is None and self.cubin.done() and self.cubin.exception() is not None
        return self.device is device and not failed


# (class, device ordinal, defines) -> the file as loaded: a process compiles and loads each file
# once per device and defines, however many instances (models, rows, packed models) use it.
_FILES: dict[tuple, _SharedFile] = {}


class KernelFile:
    """A `.cu` file compiled with its defines and loaded, each declared kernel bound to its slot.

    The loaded module is the process's: every instance of the same class with the same defines
    on the same device binds the one module (compiled, or read from the disk cache, and loaded
    once), so a process that sets up many models of one shape loads their kernels once. An
    instance's `close` lets go of it; the module stays loaded until the device is released."""

    stem: ClassVar[str]
    defines: ClassVar[Mapping[str, int | str]] = {}
    options: ClassVar[tuple[str, ...]] = ()
    arch_suffix: ClassVar[str] = ""
    headers: ClassVar[tuple[str, ...]] = ()
    min_arch: ClassVar[int] = 80  # the oldest architecture the file compiles for (90: clusters)

    @classmethod
    def specs(cls) -> dict[str, KernelSpec]:
        """Attribute name -> declared kernel, over this class and its bases."""
        return {attr: value for klass in reversed(cls.__mro__) for attr, value in vars(klass).items()
                if isinstance(value, KernelSpec)}

    @classmethod
    def source(cls) -> str:
        """The text compiled: the headers, then the `.cu` file, each after a `#line` naming it, so
        the compiler's messages and a profiler's source lines (GRAPHTRAIN_LINEINFO) point into it."""
        texts = [f'#line 1 "graphtrain/kernels/{name}"\n' + (KERNELS_DIR / name).read_text(encoding="utf-8") + "\n"
                 for name in (*cls.headers, f"{cls.stem}.cu")]
        return "".join(texts)

    @classmethod
    def cubin(cls, arch: str, defines: Mapping[str, int | str] | None = None) -> bytes:
        """The file compiled for `arch` ("sm_90"), its declarations checked (cached on disk);
        `defines` add to or replace the class's (a kernel specialised for one model's sizes)."""
        return cls.cubin_async(arch, defines).result()

    @classmethod
    def cubin_async(cls, arch: str, defines: Mapping[str, int | str] | None = None) -> Future:
        """`cubin` as a Future: done at once from the cache, else compiling on a thread of its own."""
        return compile_kernels_async(cls.source(), f"{cls.stem}.cu", arch + cls.arch_suffix, cls.specs().values(),
                                     {**cls.defines, **(defines or {})}, cls.options)

    @classmethod
    def shared_key(cls, device: cuda.DeviceInfo, defines: Mapping[str, int | str] | None = None) -> tuple:
        """What names one loaded module in the process: the class, the device, the defines."""
        merged = {**cls.defines, **(defines or {})}
        return cls, device.ordinal, tuple(sorted(merged.items()))  # the names are unique: values never compared

    def __init__(self, device: cuda.DeviceInfo, defines: Mapping[str, int | str] | None = None):
        """Binds the process's module of this file where it is loaded; else reads the cubin from
        the cache, or starts its compile here and loads the module at the first launch of one of
        its kernels, so that the files a rung sets up compile at once, while its setup goes on."""
        self.module: Module | None = None
        self._device = device
        key = self.shared_key(device, defines)
        shared = _FILES.get(key)
        if shared is None or not shared.usable_for(device):
            with phases.inside("kernels"):
                shared = _FILES[key] = _SharedFile(device, self.cubin_async(device.arch, defines))
        self._shared = shared
        if shared.module is not None or shared.cubin.done():
            self._load()
        else:
            for attr in self.specs():
                setattr(self, attr, _Pending(self, attr))
            cuda.before_capture(self._load)  # a stream capture must not be where a module loads

    def _load(self) -> None:
        """Wait for the cubin, load the module (once in the process), and bind each declared
        kernel to its slot (once per instance)."""
        if self.module is not None:
            return
        shared, specs = self._shared, self.specs()
        if shared.module is None:
            with phases.inside("kernels"):
                shared.module = Module(f"{self.stem}.cu", shared.cubin.result(), specs.values(), self._device)
        self.module = shared.module
        for attr, spec in specs.items():
            setattr(self, attr, self.module[spec.name])  # the Kernel shadows its declaration

    def close(self) -> None:
        """Let go of the file. Its module stays loaded, shared with every other instance of the
        file (and the next one made), until the device is released with everything in its
        context (graphtrain.libs.cuda.release_devices). One still compiling was never launched
        by this instance: its compile finishes (and is cached) on its thread, and no later
        capture loads it for this instance."""
        if self.module is None:
            cuda.drop_before_capture(self._load)


class _Pending:
    """A kernel of a file still compiling: its first use waits for the compile and loads the file."""

    def __init__(self, file: KernelFile, attr: str):
        self._file, self._attr = file, attr

    def _kernel(self) -> Kernel:
        self._file._load()
        return getattr(self._file, self._attr)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self._kernel()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernel(), name)
