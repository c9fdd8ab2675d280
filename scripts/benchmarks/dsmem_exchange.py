#!/usr/bin/env python3
"""How fast a 16-block cluster exchanges data through distributed shared memory (DSMEM).

    python3 scripts/benchmarks/dsmem_exchange.py [--rounds 50] > results/dsmem-exchange-h100.md

The persistent kernels' steps are all-to-all exchanges (softmax regression: partial sums to their
owners, then the owners' results to every block, ~5 KiB a block; the MLP: five a step of 15 to
30 KiB a block), made of stores or bulk copies that count their bytes on the receiver's mbarrier.
This measures that traffic alone: each of the 16 blocks sends a share of 512 bytes, 1 KiB or
2 KiB to every block of the cluster a round (the MLP's pieces at H = 64, 128 and 256: 32 rows of
4, 8 or 16 float units), and waits until its own shares have arrived; the table gives block 0's
median over the rounds after the first five, for the ways of packing the stores
(dsmem_exchange.cu says each) and 4 or 16 sending warps. "issue" is the cycles block 0's warp 0
took to issue its stores, "arrived" the cycles until every byte for block 0 had landed, and B/clk
is the bytes a block over "arrived": the rate at which each SM sends and receives at the same time.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

import numpy as np

from graphtrain import environment, report
from graphtrain.kernels import I32, KERNELS_DIR, PTR, KernelFile, kernel
from graphtrain.libs import cuda, nvrtc
from graphtrain.libs.memory import Arena

CLUSTER, THREADS = 16, 512
SHARES = (512, 1024, 2048)  # bytes from one block to one block
MAX_SHARED_BYTES = 16 + 2 * CLUSTER * max(SHARES)
PATTERNS = ["scatter: lane l to block l % 16, 16 B a lane", "one block an instruction, 16 B a lane",
            "one block an instruction, 8 B a lane", "one bulk copy a block"]


class Exchange(KernelFile):
    stem = "dsmem_exchange"
    min_arch = 90
    headers = ("cluster.cuh",)
    defines = {"SHARE": SHARES[0]}  # main() compiles it for each share
    _exchange = kernel("exchange", I32, I32, I32, PTR, cluster=(CLUSTER, 1, 1), max_shared_bytes=MAX_SHARED_BYTES)

    @classmethod
    def source(cls) -> str:
        """The headers from kernels/, then dsmem_exchange.cu from beside this script."""
        headers = "".join((KERNELS_DIR / name).read_text(encoding="utf-8") + "\n" for name in cls.headers)
        return headers + Path(__file__).with_suffix(".cu").read_text(encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    if args.rounds < 10:
        raise SystemExit("dsmem_exchange.py: --rounds must be at least 10 (the first five are a warm-up)")
    device = cuda.open_device()
    if device.compute_capability < (9, 0):
        raise SystemExit(f"dsmem_exchange.py: {device.name} has no thread-block clusters (compute capability 9.0+)")
    stream = cuda.Stream()
    rows = []
    with Arena() as arena:
        cycles = arena.reserve("cycles", (2 * args.rounds,), np.int64)
        arena.allocate()
        for share in SHARES:
            bench = Exchange(device, {"SHARE": share})
            per_block = CLUSTER * share
            for pattern, name in enumerate(PATTERNS):
                for warps in (4, 16):
                    bench._exchange(stream, CLUSTER, THREADS, pattern, warps, args.rounds, cycles.ptr,
                                    shared_bytes=16 + 2 * per_block)
                    per_round = cycles.download(stream).reshape(args.rounds, 2)[5:]
                    issued, arrived = (statistics.median(per_round[:, k].tolist()) for k in (0, 1))
                    rows.append((share, name, warps, issued, arrived))
            bench.close()
    stream.close()
    env = {**environment.host(), **environment.gpu(device), "nvrtc": nvrtc.version()}
    print(report.script_header(f"DSMEM all-to-all exchange: a {CLUSTER}-block cluster", env,
                               shlex.join(["python3", *sys.argv])))
    print("| share (B) | bytes a block | stores | sending warps | issue (cycles) | arrived (cycles) | B/clk per SM |\n"
          "|---:|---:|---|---:|---:|---:|---:|")
    for share, name, warps, issued, arrived in rows:
        print(f"| {share} | {CLUSTER * share} | {name} | {warps} | {issued:.0f} | {arrived:.0f} | "
              f"{CLUSTER * share / arrived:.1f} |")


if __name__ == "__main__":
    main()
