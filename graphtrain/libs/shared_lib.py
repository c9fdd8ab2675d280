"""NVIDIA's shared libraries for ctypes: found by cuda.pathfinder (pip wheels of CUDA 12 or 13,
conda, the toolkit), each C function's types declared once, every status checked."""

from __future__ import annotations

import ctypes
import json
import os
import re
import threading
from collections.abc import Mapping
from typing import Any

from graphtrain import files
from graphtrain.errors import INSTALL_HINTS, GpuUnavailableError, OutputError

# Where each library was found by the last process that loaded it (name -> path). ctypes opens a
# library (cuda.pathfinder's load does) holding the GIL for the whole dlopen: cuBLASLt's ~70 ms on
# an H100 host (scripts/probes/library_loads.py), during which a run's main thread, importing or
# loading the dataset while the head start loads the libraries, cannot run. libc's dlopen called
# through ctypes releases the GIL; so a library is opened that way first, at the path remembered
# here, and pathfinder then finds it loaded (a dlopen of a loaded library costs nothing).
PATHS_FILE = "paths.json"
_remembered_lock = threading.Lock()


def _remembered_paths() -> dict[str, str]:
    try:
        paths = json.loads((files.cache_dir("libraries") / PATHS_FILE).read_text())
    except (OSError, ValueError):  # none yet, or unreadable: a cache, rebuilt by the next load
        return {}
    return paths if isinstance(paths, dict) else {}


def _remember(name: str, path: str) -> None:
    with _remembered_lock:
        paths = _remembered_paths()
        if paths.get(name) != path:
            try:
                files.write_atomic(files.cache_dir("libraries") / PATHS_FILE, json.dumps({**paths, name: path}))
            except OutputError:  # a cache: where it cannot be kept (a read-only home) the next run only waits
                pass


def _open_without_gil(path: str) -> None:
    """dlopen `path` (RTLD_NOW | RTLD_GLOBAL, as pathfinder opens it) with the GIL released. A path
    that no longer opens is left to pathfinder's own search, which reports what is missing."""
    if os.name != "posix" or not os.path.isfile(path):
        return
    dlopen = ctypes.CDLL(None).dlopen
    dlopen.argtypes, dlopen.restype = [ctypes.c_char_p, ctypes.c_int], ctypes.c_void_p
    dlopen(os.fsencode(path), os.RTLD_NOW | os.RTLD_GLOBAL)  # the handle stays open with the process


class LibraryError(RuntimeError):
    """A cuBLAS, cuBLASLt or cuDNN call returned an error status."""

    def __init__(self, call: str, status: int, name: str):
        self.call, self.status, self.name = call, int(status), name
        super().__init__(f"{call} failed: {name}")


class SharedLibrary:
    """One NVIDIA library, opened on first use, `functions` (name -> (argtypes, restype)) declared;
    `status_name` is its function that names a status (cublasGetStatusName, cudnnGetErrorString)."""

    def __init__(self, name: str, what: str, functions: Mapping[str, tuple[list[Any], Any]], status_name: str):
        self.name, self.what, self.functions, self.status_function = name, what, functions, status_name
        self.path: str | None = None
        self.found_via: str | None = None
        self._cdll: ctypes.CDLL | None = None
        self._lock = threading.Lock()

    def load(self) -> ctypes.CDLL:
        """Open the library once (GpuUnavailableError naming it and what installs it)."""
        if self._cdll is not None:
            return self._cdll
        with self._lock:
            if self._cdll is None:
                install = INSTALL_HINTS[self.name]
                try:
                    from cuda.pathfinder import load_nvidia_dynamic_lib
                except ImportError:
                    raise GpuUnavailableError(f"{self.what} cannot be looked for: cuda-pathfinder is not "
                                              f"installed; {install}") from None
                remembered = _remembered_paths().get(self.name)
                if remembered:
                    _open_without_gil(remembered)
                try:
                    found = load_nvidia_dynamic_lib(self.name)
                except Exception as exc:  # pathfinder's not-found errors: report, with its reason
                    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    # pathfinder loads a library's dependencies first (cuDNN and cuBLAS need
                    # cuBLASLt): a failure naming another library is that one's, not this one's.
                    needed = re.search(r'Failure finding "lib(\w+)', reason)
                    if needed and needed.group(1).lower() != self.name.lower():
                        raise GpuUnavailableError(f"{self.what} cannot be loaded: it needs lib{needed.group(1)}, "
                                                  f"which was not found ({reason}); {install}") from exc
                    raise GpuUnavailableError(f"{self.what} was not found ({reason}); {install}") from exc
                cdll = ctypes.CDLL(found.abs_path)
                for function, (argtypes, restype) in self.functions.items():
                    fn = getattr(cdll, function)
                    fn.argtypes, fn.restype = argtypes, restype
                self.path, self.found_via, self._cdll = found.abs_path, found.found_via, cdll
                _remember(self.name, found.abs_path)
        return self._cdll

    def status_name(self, status: int) -> str:
        text = getattr(self.load(), self.status_function)(int(status))
        return text.decode(errors="replace") if text else f"status {int(status)}"

    def check(self, status: int, call: str) -> None:
        """Raise LibraryError unless `status` is 0 (success in every NVIDIA library)."""
        if status:
            raise LibraryError(call, status, self.status_name(status))
