#!/usr/bin/env python3
"""The floors under graphtrain's time to result, piece by piece: each a process of its own.

    python3 scripts/benchmarks/startup_floors.py [--repeat 5]

Prints the median wall (ms, from before the process starts to after it exits) of: a bare
interpreter; importing numpy; importing the CUDA bindings; cuInit; the primary context and a first
allocation; importing graphtrain.cli; `graphtrain run --help`. Each row includes the ones above it
that it needs, so the differences are what each piece adds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

PIECES = [
    ("interpreter", "pass"),
    ("import numpy", "import numpy"),
    ("import cuda.bindings (driver, runtime)", "import cuda.bindings.driver, cuda.bindings.runtime"),
    ("+ cuInit", "from cuda.bindings import driver; driver.cuInit(0)"),
    ("+ primary context, cudaMalloc", "from cuda.bindings import driver, runtime; driver.cuInit(0); "
                                      "runtime.cudaSetDevice(0); runtime.cudaFree(0); runtime.cudaMalloc(1 << 20)"),
    ("  the same, leaving by os._exit (no teardown)", "import os; from cuda.bindings import driver, runtime; "
                                                   "driver.cuInit(0); runtime.cudaSetDevice(0); runtime.cudaFree(0); "
                                                   "runtime.cudaMalloc(1 << 20); os._exit(0)"),
    ("import graphtrain.cli", "import graphtrain.cli"),
]


def wall_ms(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    commands = [(name, [sys.executable, "-c", code]) for name, code in PIECES]
    commands.append(("graphtrain run --help", [sys.executable, "-m", "graphtrain", "run", "--help"]))
    for name, command in commands:
        wall_ms(command)  # the page cache warm
        times = [wall_ms(command) for _ in range(args.repeat)]
        print(f"{name:45s} {statistics.median(times):8.1f} ms  (min {min(times):.1f}, max {max(times):.1f})")


if __name__ == "__main__":
    main()
