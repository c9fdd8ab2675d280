#!/usr/bin/env python3
"""Where a step of the persistent rung's cnn kernel spends its time: SM cycles per phase, per step.

    python3 scripts/probes/persistent_cnn_phases.py [--preset speedrun] [--precisions tf32,fp32] [--steps 0]
                                                    [--kc 64,32:6] [--blocks 0,67,131]

Builds kernels/persistent_cnn.cu with its phase probes (-DPROBES, kernels/probes.cuh) for each of
`--precisions` (the products' passes): thread 0 of block 0 (or of each of `--blocks`, a build each:
phase 4's share and the barriers' waits differ by block) reads the SM clock at the end of each of
the step's six phases and of each grid barrier's wait after it (kernels/persistent_cnn.py's PHASES),
adding each one's cycles over the launch in shared memory; the launch writes them out at its end.
With `--kc`, each precision is built for each of those k-values staged a chunk in the products, each
`kc` or `kc:prefetch` (CnnShape.kc and CnnShape.prefetch, the chunks in flight; the same sums in the
same order), a column each.
Each build trains `--steps` steps (0: an epoch) of the preset's cnn on MNIST in one launch, after a
warm-up launch of one step, from the plan's initial weights, and the script prints the cycles per
step of every phase, a markdown table with a column per build. The probe build ends each phase with
a block barrier (so that a phase takes its slowest warp's time and the wait after it is the grid
barrier's alone): its total runs above the plain build's time per step, so time a change with the
plain build (scripts/checks/persistent_cnn.py).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
import shlex
import sys

import numpy as np

from graphtrain import data as data_mod
from graphtrain import environment, report
from graphtrain.config import preset
from graphtrain.kernels.persistent_cnn import KC, PASSES, PHASES, PREFETCH, PersistentCnn
from graphtrain.libs import nvrtc
from graphtrain.libs.memory import Arena
from graphtrain.plan import RunPlan
from graphtrain.stages.cnn_persistent import CnnPersistentStage


def phase_rows(tables: dict[str, np.ndarray], steps: int, block: str = "block 0") -> list[str]:
    """The table's rows: each phase, its cycles a step in each build, and the step's total; `block`:
    the block counted, where every column counts the same one."""
    builds = list(tables)
    rows = [f"| phase{f' ({block})' if block else ''} | {' | '.join(builds)} |", "|---|" + "---:|" * len(builds)]
    for p, (_, meaning) in enumerate(PHASES):
        rows.append(f"| {meaning} | {' | '.join(str(table[p] // steps) for table in tables.values())} |")
    totals = " | ".join(f"**{table.sum() // steps}**" for table in tables.values())
    rows.append(f"| **step** | {totals} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="speedrun")
    parser.add_argument("--precisions", default="tf32", help=f"builds to count, of {', '.join(PASSES)}")
    parser.add_argument("--steps", type=int, default=0, help="steps in the counted launch (0: an epoch)")
    parser.add_argument("--blocks", default="0", help="the blocks whose phases are counted, a build each "
                        "(comma-separated ranks; phase 4 and the barriers' waits differ by block)")
    parser.add_argument("--kc", default=str(KC),
                        help="the products' k-values staged a chunk, KC or KC:PREFETCH, a build each (multiples of 8)")
    args = parser.parse_args()
    precisions = args.precisions.split(",")
    unknown = [p for p in precisions if p not in PASSES]
    if unknown:
        parser.error(f"no precision {', '.join(unknown)} (one of {', '.join(PASSES)})")
    if args.steps < 0:
        parser.error(f"--steps {args.steps}: at least 0")
    try:
        kcs = [(int(k), int(ahead or PREFETCH)) for k, _, ahead in (b.partition(":") for b in args.kc.split(","))]
    except ValueError:
        parser.error(f"--kc {args.kc}: integers, e.g. 64,32:6")
    if any(k < 8 or k % 8 or ahead < 1 for k, ahead in kcs):
        parser.error(f"--kc {args.kc}: multiples of 8, each prefetch at least 1")
    try:
        blocks = [int(b) for b in args.blocks.split(",")]
    except ValueError:
        parser.error(f"--blocks {args.blocks}: block ranks, e.g. 0,67,131")
    base = preset(args.preset).replace(epochs=1, steps=None)
    if base.model != "cnn":
        parser.error(f"the preset {args.preset} trains a {base.model}, not a cnn")
    data = data_mod.load(base.dataset)
    tables, notes, device, steps = {}, [], None, 0
    for precision in precisions:
        config = base.replace(precision=precision)
        with CnnPersistentStage(RunPlan.for_data(config, data), data) as stage, Arena() as arena:
            stage.setup()
            batches = stage.plan.batches[0]
            steps = min(args.steps or batches, batches)
            counts = arena.reserve("phase_counts", (len(PHASES),), np.int64)
            arena.allocate()
            notes.append(f"{precision}: {stage.note}, a grid of {stage.shape.blocks} blocks")
            outside = [b for b in blocks if not 0 <= b < stage.shape.blocks]
            if outside:
                parser.error(f"--blocks {args.blocks}: a grid of {stage.shape.blocks} blocks has no block {outside[0]}")
            for (kc, ahead), block in ((k, b) for k in kcs for b in blocks):
                kernel = PersistentCnn(stage.device, replace(stage.shape, kc=kc, prefetch=ahead), probes=True,
                                       probe_block=block)
                try:
                    for num_steps in (1, steps):  # a warm-up launch, then the one counted
                        stage.start_run()  # from the plan's initial weights
                        counts.zero(stage.stream)
                        kernel.train_epoch(stage.stream, stage.resident.train_x.ptr, stage.resident.train_y.ptr,
                                           stage.orders.at(0, 0), stage.params.ptr, stage.slot1.ptr, stage.slot2.ptr,
                                           stage.constants.ptr, stage.plan.samples_seen(num_steps), num_steps, 0,
                                           counts.ptr, False, stage.workspace.ptr)
                    name = precision if len(kcs) == 1 else f"{precision}, kc {kc}:{ahead}"
                    name += f", block {block}" if len(blocks) > 1 else ""
                    tables[name] = counts.download(stage.stream)
                finally:
                    kernel.close()
            device = stage.device
    env = {**environment.host(), **environment.gpu(device), "nvrtc": nvrtc.version()}
    print(report.script_header(f"persistent cnn kernel, {args.preset}: SM cycles per step", env,
                               shlex.join(["python3", *sys.argv]), notes))
    counted = f"block {blocks[0]}" if len(blocks) == 1 else "the block each column names"
    print(f"\n{steps} steps of {base.batch} rows in one launch, counted by thread 0 of {counted}.\n")
    print("\n".join(phase_rows(tables, steps, f"block {blocks[0]}" if len(blocks) == 1 else "")))


if __name__ == "__main__":
    main()
