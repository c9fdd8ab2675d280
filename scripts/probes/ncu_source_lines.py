#!/usr/bin/env python3
"""Where a kernel's warps wait, by CUDA source line: Nsight Compute's warp-state samples (its source
page as CSV, CUDA lines with their SASS: `ncu -i REPORT --page source --csv --print-source cuda,sass`)
summed per source line, the hottest lines printed as a Markdown table with each line's top stall
reasons, after the kernel's stall reasons over all its instructions.

    python3 scripts/probes/ncu_source_lines.py SOURCE_CSV --title TITLE --command COMMAND [--lines 40]

A sample is one warp's state at one moment: a line where many warps wait at a barrier counts them
all, so the table says where warps wait, and the hottest lines of the working warps are read beside
the barriers they wait at. An inlined function's instructions count at its own line and again at
each line that calls it (each file's section of the CSV lists them). Run on the GPU machine (the
header names its GPU), by scripts/probes/persistent_wide_ncu.sh.
"""

from __future__ import annotations

import argparse
import collections
import csv

from graphtrain import environment, report
from graphtrain.libs import cuda, nvrtc

SAMPLES = "Warp Stall Sampling (All Samples)"


def source_lines(path: str) -> tuple[dict, dict, collections.Counter]:
    """(file, line) -> samples, (file, line) -> (source text, stall reason -> samples), and the
    stall reasons over every instruction once (each SASS address counted where it first appears)."""
    samples: dict = collections.Counter()
    detail: dict = {}
    overall: collections.Counter = collections.Counter()
    seen_addresses: set = set()
    header, file = None, ""
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "File Path":
                file = row[1].rsplit("/", 1)[-1]
                continue
            if row[0] == "Line No":
                header = {name: i for i, name in enumerate(row)}
                stalls = [(i, name[len("stall_"):]) for name, i in header.items()
                          if name.startswith("stall_") and "Not Issued" not in name]
                continue
            if header is None or row[0] == "Function Name":
                continue
            address = row[2]
            if address == "-" and row[0].isdigit():  # a CUDA line, its SASS's metrics summed
                key = (file, int(row[0]))
                samples[key] += int(row[header[SAMPLES]] or 0)
                reasons = detail.setdefault(key, (row[1].strip(), collections.Counter()))[1]
                for i, name in stalls:
                    reasons[name] += int(row[i] or 0)
            elif address.startswith("0x") and address not in seen_addresses:  # a SASS row, once
                seen_addresses.add(address)
                for i, name in stalls:
                    overall[name] += int(row[i] or 0)
    return samples, detail, overall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--title", required=True)
    parser.add_argument("--command", required=True, help="the command that was profiled, for the header")
    parser.add_argument("--lines", type=int, default=40)
    args = parser.parse_args()
    samples, detail, overall = source_lines(args.csv)
    device = cuda.open_device(0)
    env = {**environment.host(), **environment.gpu(device), "nvrtc": nvrtc.version()}
    print(report.script_header(args.title, env, args.command))
    total = sum(overall.values())
    print("## Stall reasons, every instruction\n\n| reason | share of samples |\n|---|---:|")
    for name, count in overall.most_common():
        if count:
            print(f"| {name} | {100 * count / total:.1f}% |")
    print(f"\n## The hottest source lines ({args.lines}; an inlined line counts at its callers too)\n")
    print("| file:line | share of samples | top stall reasons | source |\n|---|---:|---|---|")
    for (file, line), count in samples.most_common(args.lines):
        text, reasons = detail[(file, line)]
        top = ", ".join(f"{name} {100 * n / max(count, 1):.0f}%" for name, n in reasons.most_common(3) if n)
        source = text.replace("|", "\\|").replace("`", "'")[:100]
        print(f"| {file}:{line} | {100 * count / total:.1f}% | {top} | `{source}` |")


if __name__ == "__main__":
    main()
