#!/usr/bin/env python3
"""Where a `graphtrain run`'s setup goes: the command run in this process as `python3 -m graphtrain`
runs it (CUDA opened in the background at start, the libraries' first uses on threads of their
own), the main thread under cProfile, and the background threads' works timed one by one.

    python3 scripts/probes/run_setup_timeline.py [--top 60] -- run --preset speedrun --stage graphs

Printed: each background work's start and end (ms since the command's first step) and the main
thread's profile (cumulative), so a wait on a thread shows both whom it waited for and how long.
The process ends normally (no os._exit), so its exit is not what `graphtrain` pays.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import threading
import time

T0 = time.perf_counter()
LOG: list[tuple[str, str, float, float]] = []


def timed(label: str, work):
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return work(*args, **kwargs)
        finally:
            LOG.append((threading.current_thread().name, label, (start - T0) * 1e3,
                        (time.perf_counter() - T0) * 1e3))
    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--top", type=int, default=60)
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    argv = [a for a in args.argv if a != "--"]

    from graphtrain import __main__ as entry
    from graphtrain.libs import cuda

    cuda._open_device = timed("open device (cuInit, primary context)", cuda._open_device)
    entry.head_start = timed("head start (NVRTC, libraries loaded)", entry.head_start)
    start_beside = cuda.start_beside

    def start_beside_timed(works, device, name):
        return start_beside([timed(f"{name}: {getattr(w, '__qualname__', w)}", w) for w in works], device, name)

    cuda.start_beside = start_beside_timed
    profile = cProfile.Profile()
    profile.enable()
    entry.start(argv)
    from graphtrain.cli import main as cli_main

    try:
        cli_main.main(argv, prog_name="graphtrain", standalone_mode=False)
    finally:
        profile.disable()
        end = (time.perf_counter() - T0) * 1e3
        print(f"\ncommand: {end:.1f} ms; background works (ms since its first step):")
        for thread, label, start, stop in sorted(LOG, key=lambda e: e[2]):
            print(f"  {start:8.1f} → {stop:8.1f}  ({stop - start:7.1f})  [{thread}] {label}")
        pstats.Stats(profile).sort_stats("cumulative").print_stats(args.top)
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    sys.exit(main())
