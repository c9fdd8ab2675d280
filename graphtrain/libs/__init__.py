"""The only part of graphtrain that talks to CUDA: runtime, NVRTC kernels, cuBLAS and cuDNN.

Importing this package (or any module in it) needs no GPU and no CUDA package: everything is
loaded on first use, and `probe()` reports what is there and what is missing.
"""

from __future__ import annotations

from typing import Any

_BINDINGS_EXTRA = "graphtrain[cu12] (CUDA 12 driver) or graphtrain[cu13] (CUDA 13 driver)"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _probe_bindings() -> dict[str, Any]:
    from graphtrain.libs import cuda

    entry: dict[str, Any] = {"found": False, "version": cuda.bindings_version(), "error": None,
                             "install": _BINDINGS_EXTRA}
    try:
        cuda.runtime_api()
        entry["found"] = True
    except Exception as exc:
        entry["error"] = _first_line(exc)
    return entry


def _probe_device() -> dict[str, Any]:
    from graphtrain.libs import cuda

    entry: dict[str, Any] = {"found": False, "device": None, "arch": None,
                             "memory_bytes": None, "driver_version": cuda.nvidia_driver_version(),
                             "driver_cuda_version": None, "runtime_version": None, "error": None,
                             "install": "an NVIDIA GPU with its driver, and " + _BINDINGS_EXTRA}
    versions = cuda.versions()
    entry["driver_cuda_version"] = versions["driver_cuda"]
    entry["runtime_version"] = versions["runtime"]
    try:
        info = cuda.open_device(0)
    except Exception as exc:
        entry["error"] = _first_line(exc)
        return entry
    entry.update(found=True, device=info.name, arch=info.arch, memory_bytes=info.total_memory,
                 driver_version=info.driver_version, driver_cuda_version=info.driver_cuda_version,
                 runtime_version=info.runtime_version)
    return entry


def _pathfinder_path(name: str) -> str | None:
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        return load_nvidia_dynamic_lib(name).abs_path
    except Exception:
        return None


def _probe_nvrtc() -> dict[str, Any]:
    from graphtrain.libs import nvrtc

    entry: dict[str, Any] = {"found": False, "path": None, "version": None, "error": None,
                             "install": "nvidia-cuda-nvrtc (CUDA 13) or nvidia-cuda-nvrtc-cu12, via " + _BINDINGS_EXTRA}
    try:
        entry["version"] = nvrtc.nvrtc_version()
        entry["found"] = True
        entry["path"] = _pathfinder_path("nvrtc")
    except Exception as exc:
        entry["error"] = _first_line(exc)
    return entry


def _probe_ctypes_lib(module_name: str, install: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"found": False, "path": None, "version": None, "error": None, "install": install}
    try:
        import importlib

        module = importlib.import_module(f"graphtrain.libs.{module_name}")
        loaded = module.library()
        entry["found"] = True
        entry["path"] = loaded.path
        entry["found_via"] = loaded.found_via
        entry["version"] = module.library_version()
    except Exception as exc:
        entry["error"] = _first_line(exc)
    return entry


def probe() -> dict[str, dict[str, Any]]:
    """What `graphtrain info` shows: for cuda-bindings, the driver and GPU, NVRTC, cuBLAS and
    cuDNN, whether each was found, where, which version, and if not, why and what installs it.

    Never raises, also on machines without a GPU or without any CUDA package.
    """
    report: dict[str, dict[str, Any]] = {}
    steps = {
        "cuda_bindings": _probe_bindings,
        "driver": _probe_device,
        "nvrtc": _probe_nvrtc,
        "cublas": lambda: _probe_ctypes_lib("cublas", "nvidia-cublas-cu12 or nvidia-cublas, via " + _BINDINGS_EXTRA),
        "cudnn": lambda: _probe_ctypes_lib("cudnn", "nvidia-cudnn-cu12 or nvidia-cudnn-cu13, via " + _BINDINGS_EXTRA),
    }
    for key, step in steps.items():
        try:
            report[key] = step()
        except BaseException as exc:  # noqa: BLE001 - probe must report, never raise
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            report[key] = {"found": False, "error": _first_line(exc)}
        if report[key].get("found"):
            report[key].pop("install", None)  # only say what installs a piece when it is missing
    return report
