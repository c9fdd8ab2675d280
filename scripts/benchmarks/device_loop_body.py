#!/usr/bin/env python3
"""How many steps the device-loop rung's WHILE body should hold: ms/epoch by body size, beside bf16.

    python3 scripts/benchmarks/device_loop_body.py [--preset jhu] [--hidden 784,784,784] [--epochs 10] [--rounds 3]

Each iteration of a conditional WHILE node costs the GPU a few microseconds of its own, so a body
of one step pays it every step; a body of k steps pays it every k steps. The rows (bf16, whose
host launches one step graph per batch, and device-loop with bodies of 1, 4, 8, 16 and 32 steps)
take turns for `--rounds` rounds on the same data and plan; each cell is the median over the
rounds of the run's median epoch time (the ladder's protocol).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys

from graphtrain import data as data_mod
from graphtrain import report
from graphtrain.config import preset
from graphtrain.plan import RunPlan
from graphtrain.stages.bf16 import Bf16Stage
from graphtrain.stages.device_loop import DeviceLoopStage
from graphtrain.training import run_stage

BODIES = (1, 4, 8, 16, 32)


def body_of(k: int) -> type[DeviceLoopStage]:
    return type(f"DeviceLoop{k}", (DeviceLoopStage,), {"steps_per_iteration": k})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="jhu")
    parser.add_argument("--hidden", default="", help="comma-separated hidden sizes (default: the preset's)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    config = preset(args.preset).replace(epochs=args.epochs)
    if args.hidden:
        config = config.replace(hidden=tuple(int(h) for h in args.hidden.split(",")))
    data = data_mod.load(config.dataset)
    plan = RunPlan.for_data(config, data)
    rows = {"bf16": Bf16Stage, **{f"device-loop, {k} steps a body": body_of(k) for k in BODIES}}
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, cls in rows.items():
            record = run_stage(cls, plan, data)
            times[name].append(record.epoch_ms)
    env = record.environment
    dims = "-".join(map(str, config.dims))
    print(report.script_header(f"WHILE body size: {args.preset} {dims}, batch {config.batch}, {args.epochs} epochs, "
                               f"{args.rounds} rounds", env, shlex.join(["python3", *sys.argv]),
                               extra=[f"device_loop: {env.get('device_loop')}"]))
    print("| row | ms/epoch (median of rounds) | min | max |\n|---|---:|---:|---:|")
    for name, ms in times.items():
        print(f"| {name} | {statistics.median(ms):.3f} | {min(ms):.3f} | {max(ms):.3f} |")


if __name__ == "__main__":
    main()
