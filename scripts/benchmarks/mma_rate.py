#!/usr/bin/env python3
"""How often an SM sub-partition issues the tensor-core mma.sync shapes the persistent kernels use.

    python3 scripts/benchmarks/mma_rate.py [--rounds 512] > results/mma-rate-h100.md

One block on one SM, 4, 8 or 16 warps (1, 2 or 4 a sub-partition), each issuing independent
mma in a loop (mma_rate.cu); the table gives the SM cycles per mma per sub-partition, the median
of five launches. It is the floor under a persistent kernel's products: e.g. the softmax kernel's
phase A is 224 m16n8k8 TF32 mma a step on 16 blocks, 56 a sub-partition.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

import numpy as np

from graphtrain import environment, report
from graphtrain.kernels import I32, PTR, KernelFile, kernel
from graphtrain.libs import cuda, nvrtc
from graphtrain.libs.memory import Arena

KINDS = ["m16n8k8 TF32 (fp32 sums)", "m16n8k16 bf16 (fp32 sums)", "m16n8k4 TF32 (fp32 sums)"]
MACS = [16 * 8 * 8, 16 * 8 * 16, 16 * 8 * 4]  # multiply-adds of one mma
MMA_PER_ROUND = 8


class MmaRate(KernelFile):
    stem = "mma_rate"
    min_arch = 80
    _mma_rate = kernel("mma_rate", I32, I32, PTR, PTR)

    @classmethod
    def source(cls) -> str:
        return Path(__file__).with_suffix(".cu").read_text(encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=512)
    args = parser.parse_args()
    if args.rounds < 16:
        raise SystemExit("mma_rate.py: --rounds must be at least 16")
    device = cuda.open_device()
    stream = cuda.Stream()
    rows = []
    with Arena() as arena:
        cycles = arena.reserve("cycles", (1,), np.int64)
        sink = arena.reserve("sink", (512,), np.float32)
        arena.allocate()
        bench = MmaRate(device)
        for kind, name in enumerate(KINDS):
            for warps in (4, 8, 16):
                runs = []
                for _ in range(5):
                    bench._mma_rate(stream, 1, 32 * warps, kind, args.rounds, cycles.ptr, sink.ptr)
                    runs.append(int(cycles.download(stream)[0]))
                per_mma = statistics.median(runs) / (warps // 4 * args.rounds * MMA_PER_ROUND)
                rows.append((name, warps, per_mma, MACS[kind] / per_mma))
        bench.close()
    stream.close()
    env = {**environment.host(), **environment.gpu(device), "nvrtc": nvrtc.version()}
    print(report.script_header("mma.sync issue rate: one SM sub-partition", env, shlex.join(["python3", *sys.argv])))
    print("| mma | warps a block | cycles per mma per sub-partition | multiply-adds per cycle per sub-partition |\n"
          "|---|---:|---:|---:|")
    for name, warps, per_mma, macs in rows:
        print(f"| {name} | {warps} | {per_mma:.2f} | {macs:.0f} |")


if __name__ == "__main__":
    main()
