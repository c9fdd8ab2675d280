"""Finding and opening NVIDIA's shared libraries (cuBLAS, cuDNN) for ctypes.

The first choice is `cuda.pathfinder.load_nvidia_dynamic_lib`, which knows where NVIDIA's pip
wheels, conda and the CUDA toolkit put each library. Older pathfinder releases do not know every
library (cuDNN came late), so we then look in the wheels' folders on sys.path ourselves, and last
ask the system loader for the usual sonames.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from graphtrain.errors import GpuUnavailableError


@dataclass(frozen=True)
class LoadedLibrary:
    lib: ctypes.CDLL
    path: str | None
    found_via: str


def _loaded_path(soname: str) -> str | None:
    """Where the process mapped a library from (Linux), to report it."""
    base = os.path.basename(soname)
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                path = line.rsplit(" ", 1)[-1].strip()
                if path and os.path.basename(path) == base:
                    return path
    except OSError:
        pass
    return None


def load_library(
    pathfinder_name: str,
    sonames: Sequence[str],
    wheel_dirs: Sequence[str],
    what: str,
    install: str,
) -> LoadedLibrary:
    """Open one library or raise GpuUnavailableError naming it, where we looked, and how to get it."""
    looked: list[str] = []
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError:
        looked.append("cuda.pathfinder (not installed)")
    else:
        try:
            loaded = load_nvidia_dynamic_lib(pathfinder_name)
        except Exception as exc:  # not found, or a pathfinder too old to know this library
            looked.append(f"cuda.pathfinder ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
        else:
            target = loaded.abs_path or sonames[0]
            try:
                return LoadedLibrary(ctypes.CDLL(target), loaded.abs_path or _loaded_path(sonames[0]),
                                     f"cuda.pathfinder ({loaded.found_via})")
            except OSError as exc:
                looked.append(f"cuda.pathfinder found {target} but it did not load: {exc}")

    for entry in sys.path:
        for sub in wheel_dirs:
            for soname in sonames:
                candidate = Path(entry or ".") / sub / soname
                if candidate.is_file():
                    try:
                        return LoadedLibrary(ctypes.CDLL(str(candidate)), str(candidate), "pip wheel on sys.path")
                    except OSError as exc:
                        looked.append(f"{candidate} (did not load: {exc})")
    looked.append(f"pip wheel folders {', '.join(wheel_dirs)} on sys.path")

    for soname in sonames:
        try:
            lib = ctypes.CDLL(soname)
        except OSError:
            looked.append(f"system loader for {soname}")
            continue
        return LoadedLibrary(lib, _loaded_path(soname), "system loader")

    short = sonames[0].split(".so", 1)[0].removeprefix("lib")
    found = ctypes.util.find_library(short)
    if found:
        try:
            lib = ctypes.CDLL(found)
            return LoadedLibrary(lib, _loaded_path(found) or found, "ctypes.util.find_library")
        except OSError as exc:
            looked.append(f"{found} (did not load: {exc})")
    else:
        looked.append(f"ctypes.util.find_library({short!r})")

    raise GpuUnavailableError(f"{what} was not found; looked in: {'; '.join(looked)}. {install}")
