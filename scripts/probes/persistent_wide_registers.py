#!/usr/bin/env python3
"""The grid kernel's registers and spills a thread for each prefetch depth (no GPU: NVRTC compiles
for sm_90 with ptxas's report), so a depth that spills is known before it is timed.

    python3 scripts/probes/persistent_wide_registers.py [--hidden 784,784,784] [--batch 128] [--prefetch 1,2,3,4]
"""

from __future__ import annotations

import argparse
import dataclasses
import re

from graphtrain.libs.nvrtc import ptxas_report
from graphtrain.kernels.persistent_wide import THREADS, PersistentWide, WideShape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", default="784,784,784")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--prefetch", default="1,2,3,4")
    args = parser.parse_args()
    hidden = tuple(int(h) for h in args.hidden.split(","))
    base = WideShape(784, hidden, 10, args.batch, 255)
    print(f"784-{'-'.join(map(str, hidden))}-10 at batch {args.batch}, {base.blocks} blocks of {base.block_units} units "
          f"(clusters of {base.cluster_blocks}):")
    for depth in (int(p) for p in args.prefetch.split(",")):
        shape = dataclasses.replace(base, prefetch=depth)
        defines = {"THREADS": THREADS, **shape.defines}
        log = ptxas_report(PersistentWide.source(), "persistent_wide.cu", "sm_90", [f"-D{k}={v}" for k, v in defines.items()])
        used = re.search(r"Used (\d+) registers", log)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        stack = re.search(r"(\d+) bytes stack frame", log)
        print(f"  prefetch {depth}: {used.group(1) if used else '?'} registers, stack {stack.group(1) if stack else '?'} B, "
              f"spill stores {spills.group(1) if spills else '?'} B, loads {spills.group(2) if spills else '?'} B")


if __name__ == "__main__":
    main()
