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
    from graphtrain.kernels import KernelFile, ceil_div
    from graphtrain.libs.nvrtc import F32, I32, PTR, kernel

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
and sizes against the `.cu` by the compiler (NVRTC, on any machine, also without a GPU: the CPU
tests compile every file for sm_80 and sm_90); nothing in Python per launch, which packs the
values with one precompiled `struct.pack_into` (refusing, in C, a wrong count, a float for an int
or a value out of range) and calls the driver. `kernel(...)` also takes `cluster=(x, y, z)` (a
thread-block cluster, launched through cuLaunchKernelEx), `cooperative=True` (grid-wide sync),
and `max_shared_bytes=N` (raises the kernel's dynamic shared memory limit once, above the
default 48 KiB); a launch passes `shared_bytes=N` for its dynamic shared memory. A class may set
`options` (extra NVRTC options) and `arch_suffix = "a"` (compile for sm_90a: wgmma, setmaxnreg).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

from graphtrain.libs import cuda
from graphtrain.libs.nvrtc import KernelSpec, Module, compile_kernels

KERNELS_DIR = Path(__file__).resolve().parent


def ceil_div(n: int, d: int) -> int:
    """⌈n / d⌉ for n >= 0 and d > 0, in integers (no float rounding): the blocks of d threads
    that cover n items, the batches of d samples that cover n samples."""
    return -(-n // d)


class KernelFile:
    """A `.cu` file compiled with its defines and loaded, each declared kernel bound to its slot."""

    stem: ClassVar[str]
    defines: ClassVar[Mapping[str, int | str]] = {}
    options: ClassVar[tuple[str, ...]] = ()
    arch_suffix: ClassVar[str] = ""
    min_arch: ClassVar[int] = 80  # the oldest architecture the file compiles for (90: clusters)

    @classmethod
    def specs(cls) -> dict[str, KernelSpec]:
        """Attribute name -> declared kernel, over this class and its bases."""
        return {attr: value for klass in reversed(cls.__mro__) for attr, value in vars(klass).items()
                if isinstance(value, KernelSpec)}

    @classmethod
    def cubin(cls, arch: str, defines: Mapping[str, int | str] | None = None) -> bytes:
        """The file compiled for `arch` ("sm_90"), its declarations checked (cached on disk);
        `defines` add to or replace the class's (a kernel specialised for one model's sizes)."""
        path = KERNELS_DIR / f"{cls.stem}.cu"
        return compile_kernels(path.read_text(encoding="utf-8"), path.name, arch + cls.arch_suffix,
                               cls.specs().values(), {**cls.defines, **(defines or {})}, cls.options)

    def __init__(self, device: cuda.DeviceInfo, defines: Mapping[str, int | str] | None = None):
        specs = self.specs()
        self.module = Module(f"{self.stem}.cu", self.cubin(device.arch, defines), specs.values(), device)
        for attr, spec in specs.items():
            setattr(self, attr, self.module[spec.name])  # the Kernel shadows its declaration

    def close(self) -> None:
        self.module.close()
