#!/usr/bin/env python3
"""Where a `graphtrain run`'s setup goes: the command run in this process as `python3 -m graphtrain`
runs it (CUDA opened in the background at start, the libraries' first uses on threads of their
own), the main thread under cProfile, and the calls of interest timed one by one on every thread.

    python3 scripts/probes/run_setup_timeline.py [--top 60] -- run --preset speedrun --stage graphs

Printed, in ms since the command's first step:

- every call of interest made off the main thread (the start-up thread's device opening and head
  start, the first uses and their calls one by one: handle creation, the first product, the
  waits; the dataset's upload; the products' algorithm choices), each with its start and end;
- the same calls on the main thread, summed per call (count, first start, total, last end): the
  setup's own library calls, its copies and waits, and its waits on a background work
  (`HeadStart.result`), so that what waited for what, and how long, shows;
- the main thread's profile (cumulative, then own time).

The process ends normally (no os._exit), so its exit is not what `graphtrain` pays.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import pstats
import sys
import threading
import time
from collections import defaultdict

T0 = time.perf_counter()
LOG: list[tuple[str, str, float, float]] = []  # (thread, label, start ms, end ms)

# (module, attribute path) of the Python calls timed on every thread.
CALLS = (
    ("graphtrain.libs.cuda", "_open_device"),
    ("graphtrain.libs.cuda", "HeadStart.result"),
    ("graphtrain.libs.cuda", "Stream.__init__"),
    ("graphtrain.libs.cuda", "Stream.synchronize"),
    ("graphtrain.libs.cuda", "Event.synchronize"),
    ("graphtrain.libs.cuda", "_copy"),
    ("graphtrain.libs.cuda", "malloc"),
    ("graphtrain.libs.cuda", "wait_uncounted"),
    ("graphtrain.libs.shared_lib", "SharedLibrary.load"),
    ("graphtrain.libs.cublas", "first_use"),
    ("graphtrain.libs.cublas", "Cublas.__init__"),
    ("graphtrain.libs.cublas", "Cublas.gemm"),
    ("graphtrain.libs.cublas", "Cublas.close"),
    ("graphtrain.libs.cublaslt", "first_use"),
    ("graphtrain.libs.cublaslt", "Lt.__init__"),
    ("graphtrain.libs.cublaslt", "choose_algo"),
    ("graphtrain.libs.cublaslt", "StridedLtMatmul.__init__"),
    ("graphtrain.libs.cudnn", "first_use"),
    ("graphtrain.stages.cnn_shared", "ResidentData.__init__"),
    ("graphtrain.stages.cnn_shared", "ResidentData.upload"),
    ("graphtrain.stages.cnn_shared", "ResidentData.ready"),
    ("graphtrain.stages.cnn_shared", "Lane.__init__"),
    ("graphtrain.stages.cnn_device", "CnnDevice.__init__"),
    ("graphtrain.stages.cnn_device", "CnnDevice._kernel_files"),
    ("graphtrain.stages.cnn_device", "CnnDevice._plan_products"),
    ("graphtrain.stages.cnn_device", "CnnDevice.record_step"),
    ("graphtrain.stages.cnn_device", "CnnDevice.record_eval"),
    ("graphtrain.stages.cnn_device", "CnnDevice.load"),
    ("graphtrain.__main__", "head_start"),
)
# (graphtrain.libs module, C functions) of the NVIDIA libraries timed call by call once loaded.
C_CALLS = {
    "cublas": ("cublasCreate_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2", "cublasGemmEx",
               "cublasDestroy_v2"),
    "cublaslt": ("cublasLtCreate", "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmulAlgoCheck", "cublasLtMatmul"),
}


def timed(label: str, work):
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return work(*args, **kwargs)
        finally:
            LOG.append((threading.current_thread().name, label, (start - T0) * 1e3,
                        (time.perf_counter() - T0) * 1e3))
    return run


def patch(module_name: str, path: str) -> None:
    """Time `path` (a function or Class.method) of the module, where it exists (a name a revision
    lacks is skipped: the probe serves the code as it is)."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return
    *owners, name = path.split(".")
    owner = module
    for part in owners:
        owner = getattr(owner, part, None)
    if owner is None or not hasattr(owner, name):
        return
    setattr(owner, name, timed(f"{module_name.rsplit('.', 1)[-1]}.{path}", getattr(owner, name)))


def patch_c_calls() -> None:
    """Once a library is loaded, its C functions of C_CALLS timed call by call."""
    from graphtrain.libs import shared_lib

    load = shared_lib.SharedLibrary.load

    def load_timed(self):
        first = self._cdll is None
        cdll = load(self)
        if first and self.name in C_CALLS:
            for function in C_CALLS[self.name]:
                if hasattr(cdll, function):
                    setattr(cdll, function, timed(function, getattr(cdll, function)))
        return cdll

    shared_lib.SharedLibrary.load = load_timed


def report(end: float) -> None:
    print(f"\ncommand: {end:.1f} ms; calls off the main thread (ms since its first step):")
    for thread, label, start, stop in sorted(LOG, key=lambda e: e[2]):
        if thread != "MainThread":
            print(f"  {start:8.1f} → {stop:8.1f}  ({stop - start:7.1f})  [{thread}] {label}")
    print("\nthe main thread's calls, summed (count, first start → last end, total ms):")
    summed: dict[str, list[float]] = defaultdict(lambda: [0, float("inf"), 0.0, 0.0])
    for thread, label, start, stop in LOG:
        if thread == "MainThread":
            entry = summed[label]
            entry[0] += 1
            entry[1], entry[2], entry[3] = min(entry[1], start), entry[2] + stop - start, max(entry[3], stop)
    for label, (count, first, total, last) in sorted(summed.items(), key=lambda e: e[1][1]):
        print(f"  {first:8.1f} → {last:8.1f}  {int(count):4d}×  {total:7.1f}  {label}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--top", type=int, default=60)
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    argv = [a for a in args.argv if a != "--"]

    from graphtrain import __main__ as entry

    for module_name, path in CALLS:
        patch(module_name, path)
    patch_c_calls()
    profile = cProfile.Profile()
    profile.enable()
    entry.start(argv)
    from graphtrain.cli import main as cli_main

    try:
        cli_main.main(argv, prog_name="graphtrain", standalone_mode=False)
    finally:
        profile.disable()
        report((time.perf_counter() - T0) * 1e3)
        pstats.Stats(profile).sort_stats("cumulative").print_stats(args.top)
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    sys.exit(main())
