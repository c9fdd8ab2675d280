#!/usr/bin/env python3
"""The persistent kernels' code size (no GPU: NVRTC compiles for sm_90): each kernel function's SASS
bytes and instructions in the cubin, for the persistent cnn at the speedrun's shape and the grid
kernel at the 784³ MLP's, with any -D define replaced (NAME=VALUE). Phases that run once a step
fetch their code again each step: Nsight Compute counts that wait as `no_inst`, and this says how
much code a change adds or removes before it is timed.

    python3 scripts/probes/kernel_code_size.py [--kernel cnn|wide|both] [NAME=VALUE ...]
"""

from __future__ import annotations

import argparse
import struct

from graphtrain.kernels.persistent_cnn import CnnShape, PersistentCnn
from graphtrain.kernels.persistent_wide import THREADS as WIDE_THREADS
from graphtrain.kernels.persistent_wide import PersistentWide, WideShape

SASS_BYTES = 16  # an sm_90 instruction


def text_sizes(cubin: bytes) -> dict[str, int]:
    """Bytes of each kernel's code in an ELF64 cubin: its `.text.<kernel>` section's size."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not an ELF64 cubin")
    section_table = struct.unpack_from("<Q", cubin, 0x28)[0]
    entry_size, entries, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, section_table + i * entry_size) for i in range(entries)]
    names_at = headers[names_index][4]  # the section names' table: its offset in the file
    sizes = {}
    for name_at, _type, _flags, _address, _offset, size in headers:
        start = names_at + name_at
        name = cubin[start:cubin.index(b"\0", start)].decode()
        if name.startswith(".text."):
            sizes[name[len(".text."):]] = size
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=("cnn", "wide", "both"), default="both")
    parser.add_argument("defines", nargs="*", metavar="NAME=VALUE", help="a define replaced")
    args = parser.parse_args()
    overrides = dict(define.split("=", 1) for define in args.defines)
    builds = []
    if args.kernel in ("cnn", "both"):
        builds.append(("persistent cnn, speedrun", PersistentCnn, dict(CnnShape(28, 24, 5, 32, 3, 256, 10, 256).defines)))
    if args.kernel in ("wide", "both"):
        builds.append(("grid kernel, 784³ MLP", PersistentWide,
                       {"THREADS": WIDE_THREADS, **WideShape(784, (784,) * 3, 10, 128, 255).defines}))
    for label, kernel, defines in builds:
        sizes = text_sizes(kernel.cubin("sm_90", {**defines, **overrides}))
        print(f"{label}:")
        for name, size in sorted(sizes.items(), key=lambda item: -item[1]):
            print(f"  {name:20s} {size:8d} bytes  {size // SASS_BYTES:6d} instructions")


if __name__ == "__main__":
    main()
