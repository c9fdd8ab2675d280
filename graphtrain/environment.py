"""What a run ran on: host, GPU, driver and library versions, for run records and `graphtrain info`;
the memory still free on the host, for the run plan's checks.

Nothing here raises on a machine without a GPU or a CUDA package: a version that cannot be read
is None, and `probe()` says for each missing piece why and what installs it.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from graphtrain.errors import INSTALL_HINTS


def driver_version() -> str | None:
    """The NVIDIA driver's version ("580.95.05") from /proc or nvidia-smi; None if neither says."""
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8", errors="replace") as fh:
            match = re.search(r"Kernel Module(?: for [\w-]+)?\s+(\d+\.\d+(?:\.\d+)?)", fh.read())
        if match:
            return match.group(1)
    except OSError:
        pass  # no driver loaded, or not Linux: ask nvidia-smi
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    first = done.stdout.strip().splitlines()[0].strip() if done.stdout.strip() else ""
    return first if done.returncode == 0 and re.fullmatch(r"\d+\.\d+(\.\d+)?", first) else None


def package_version(distribution: str) -> str | None:
    """The installed version of a Python distribution ("cuda-bindings"), or None."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


@functools.cache  # two git commands: asked once a process, not once for every run record
def source_revision() -> str | None:
    """The git revision of graphtrain's source ("fc620f7"; "fc620f7+changes" where tracked files
    differ from it), when it runs from a git checkout; None for an installed copy.
    $GRAPHTRAIN_REVISION, where set, stands for it: a tree copied out of its checkout (to a GPU
    machine) has no git to ask."""
    if os.environ.get("GRAPHTRAIN_REVISION"):
        return os.environ["GRAPHTRAIN_REVISION"]
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():  # an installed package, even one inside someone's checkout
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=7", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=False)
        changes = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None  # no git on this machine
    if head.returncode != 0 or changes.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if changes.stdout.strip() else "")


def host() -> dict[str, Any]:
    """Python, numpy, the CPU and graphtrain's revision: the part of every run record that any
    machine has."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass  # not Linux: platform's answer stands
    return {"python": platform.python_version(), "numpy": np.__version__, "platform": platform.platform(),
            "cpu": cpu, "cpu_count": os.cpu_count(), "revision": source_revision()}


def free_host_memory() -> int | None:
    """Memory this process can still use: MemAvailable, capped by a cgroup limit; None if unknown."""
    limits = []
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError):
        pass
    if not limits:
        try:
            limits.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError, AttributeError):
            pass
    try:  # a container's limit (cgroup v2), less what the group already uses
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit.isdigit():
            limits.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


def gpu(device: Any) -> dict[str, Any]:
    """The GPU part of a run record, for a `graphtrain.libs.cuda.DeviceInfo`; the stage adds the
    versions of the libraries it loaded (nvrtc, cublas, cudnn)."""
    major, minor = device.compute_capability
    return {"gpu": device.name, "compute_capability": f"{major}.{minor}", "driver": driver_version(),
            "driver_cuda": device.driver_cuda_version, "runtime": device.runtime_version,
            "cuda_bindings": bindings_version()}


def bindings_version() -> str | None:
    """cuda-bindings' version, from the package itself where it says (no scan of the installed
    distributions, which takes tens of ms in a large environment), else from its metadata."""
    from graphtrain.libs import cuda

    return cuda.bindings_version() or package_version("cuda-bindings")


def _first_line(exc: BaseException) -> str:
    """The first line of why a probe failed: graphtrain's own message as it is (written for the
    user), any other exception with its class's name (it says what kind of failure it was)."""
    from graphtrain.errors import GraphtrainError

    text = str(exc).strip()
    if isinstance(exc, GraphtrainError) and text:
        return text.splitlines()[0]
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def probe() -> dict[str, dict[str, Any]]:
    """What `graphtrain info` shows: for the CUDA bindings, the driver and GPU, NVRTC, cuBLAS,
    cuBLASLt, cuDNN and NCCL, whether each was found, where, which version, and if not, why and what
    installs it."""
    from graphtrain.libs import cublas, cublaslt, cuda, cudnn, nccl, nvrtc

    def bindings() -> dict[str, Any]:
        cuda.runtime_api()
        return {"version": package_version("cuda-bindings")}

    def driver() -> dict[str, Any]:
        info = cuda.open_device(0)
        return {"device": info.name, "arch": info.arch, "memory_bytes": info.total_memory,
                "driver_cuda_version": info.driver_cuda_version, "runtime_version": info.runtime_version}

    def nvrtc_library() -> dict[str, Any]:
        found_version = nvrtc.version()
        return {"version": found_version, "path": nvrtc.library_path()}

    def shared(module: Any) -> dict[str, Any]:
        module.library.load()
        return {"path": module.library.path, "found_via": module.library.found_via, "version": module.version()}

    steps = {"cuda_bindings": bindings, "driver": driver, "nvrtc": nvrtc_library,
             "cublas": lambda: shared(cublas), "cublasLt": lambda: shared(cublaslt), "cudnn": lambda: shared(cudnn),
             "nccl": lambda: shared(nccl)}  # run --gpus N only
    report: dict[str, dict[str, Any]] = {}
    for key, step in steps.items():
        if key != "cuda_bindings" and not report["cuda_bindings"]["found"]:
            # Each of them is reached through the bindings: one reason, said once, on their row.
            report[key] = {"found": False, "error": "needs the CUDA bindings (cuda_bindings)",
                           "install": INSTALL_HINTS[key]}
            continue
        try:
            report[key] = {"found": True, **step()}
        except Exception as exc:  # reported, not hidden: `info` exists to say what is missing and why
            why = _first_line(exc).replace(f"; {INSTALL_HINTS[key]}", "")  # said once, under "install"
            report[key] = {"found": False, "error": why, "install": INSTALL_HINTS[key]}
    report["driver"]["driver_version"] = driver_version()
    return report


GPU_PIECES = ("cuda_bindings", "driver", "nvrtc", "cublas", "cublasLt", "cudnn")  # what the GPU rungs use


def verdict(found: dict[str, dict[str, Any]]) -> str:
    """What this machine can do, in one line, from `probe()`'s findings."""
    missing = [key for key in GPU_PIECES if not found[key]["found"]]
    if not missing:
        return f"GPU ready ({found['driver']['device']}): every rung runs, numpy on the CPU"
    if found["driver"]["found"]:
        return (f"GPU {found['driver']['device']}, but {', '.join(missing)} missing: the rungs that use them "
                "cannot run; numpy and the rest can")
    if missing[0] == "cuda_bindings":
        return f"CPU only: the numpy rung runs here; the GPU rungs need the CUDA bindings ({INSTALL_HINTS['cuda_bindings']})"
    return "CPU only: the numpy rung runs here; the GPU rungs need an NVIDIA GPU and its driver (none usable here)"
