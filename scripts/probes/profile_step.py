#!/usr/bin/env python3
"""Where one training step's GPU time goes: every kernel of a step, timed by Nsight Compute.

    python3 scripts/probes/profile_step.py --stage graphs --out results/profile-jhu-softmax-h100-graphs.md [-- run options]

Runs `graphtrain run --stage S --epochs 1` under `ncu` (kernel durations only; caches and
clocks left as they are), takes the kernels of one step in the middle of the epoch (from one
batch gather to the next) and writes them as a Markdown table under the provenance every results
file opens with (report.script_header: date, revision, command, device, driver, libraries).
ncu runs the kernels one at a time, each starting from an idle GPU: the durations rank where a
step's time goes, but in a graph consecutive kernels overlap their start-up, and the step takes
less than their sum.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shlex
import subprocess
import sys

# The first kernel of every step: a gather, or, for softmax regression on the fused rungs, the
# head, which gathers the batch itself.
STEP_START = ("gather_batch", "gather_batch_at", "gather_batch_bf16")
HEAD_START = ("head_step",)


def profile(stage: str, run_args: list[str], skip: int, count: int) -> tuple[list[tuple[str, float]], str]:
    command = ["ncu", "--csv", "--metrics", "gpu__time_duration.sum", "--cache-control", "none",
               "--clock-control", "none", "--launch-skip", str(skip), "--launch-count", str(count),
               "python3", "-m", "graphtrain", "run", "--stage", stage, "--epochs", "1", *run_args]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"ncu failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = list(csv.DictReader(io.StringIO("\n".join(
        line for line in done.stdout.splitlines() if line.startswith('"')))))
    kernels = []
    for row in rows:
        value = float(row["Metric Value"].replace(",", ""))
        scale = {"ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(row["Metric Unit"], None)
        if scale is None:
            sys.exit(f"unexpected unit {row['Metric Unit']!r}")
        kernels.append((row["Kernel Name"], value * scale))
    return kernels, shlex.join(command)


def one_step(kernels: list[tuple[str, float]]) -> list[tuple[str, float]]:
    names = [name.split("(")[0] for name, _ in kernels]
    first = STEP_START if any(name in STEP_START for name in names) else HEAD_START
    starts = [i for i, name in enumerate(names) if name in first]
    if len(starts) < 2:
        sys.exit("no whole step in the profiled window: raise --count")
    return kernels[starts[0]:starts[1]]


def environment_of_this_machine() -> dict:
    """Host, revision, GPU and driver (graphtrain.environment), as a run record has them."""
    from graphtrain import environment
    from graphtrain.libs import cuda

    return {**environment.host(), **environment.gpu(cuda.open_device())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", default="graphs")
    parser.add_argument("--skip", type=int, default=400, help="kernel launches to skip (setup, first steps)")
    parser.add_argument("--count", type=int, default=120, help="kernel launches to profile")
    parser.add_argument("--out", help="write the Markdown here (default: stdout)")
    parser.add_argument("run_args", nargs="*", help="options for `graphtrain run`, after --")
    args = parser.parse_args()

    kernels, command = profile(args.stage, args.run_args, args.skip, args.count)
    step = one_step(kernels)
    total = sum(us for _, us in step)
    from graphtrain import report

    workload = shlex.join(["graphtrain", "run", "--stage", args.stage, "--epochs", "1", *args.run_args])
    header = report.script_header(
        f"Kernels of one `{args.stage}` step", environment_of_this_machine(),
        shlex.join(["python3", "scripts/probes/profile_step.py", *sys.argv[1:]]),
        extra=[f"Which ran: `{command}`", f"Workload: `{workload}`",
               "Durations: Nsight Compute `gpu__time_duration.sum`, each kernel run alone from an idle GPU, "
               "caches and clocks as found; in a graph the kernels overlap their start-up, so a step takes "
               "less than the sum"])
    lines = [header, "| # | kernel | µs |", "|---:|---|---:|"]
    lines += [f"| {i} | `{name.split('(')[0][:90]}` | {us:.2f} |" for i, (name, us) in enumerate(step, 1)]
    lines += [f"| | **{len(step)} kernels, sum** | **{total:.2f}** |", ""]
    text = "\n".join(lines)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
