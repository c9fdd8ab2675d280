#!/usr/bin/env python3
"""Where a step of the persistent grid kernel spends its time: SM cycles per phase, per step, per build.

    python3 scripts/probes/persistent_wide_phases.py [--preset jhu] [--hidden 784,784,784] [--steps 469]
                                                     [--variants registers,staged] [--units 8] [--splits 1,2]
                                                     [--prefetch 1,2]

Builds kernels/persistent_wide.cu with its phase probes (-DPROBES, kernels/probes.cuh) in each of
`--variants` (persistent_wide.VARIANTS: how the products' operands are loaded): thread 0 of block 0
reads the SM clock at the end of each phase of every step (kernels/persistent_wide.py's PHASES: the
products and the sums of each layer's forward and backward, the head, the softmax, the update of
W_1, and each grid barrier's wait separately, which ends when the slowest block arrives) and adds
up each phase's cycles per layer in shared memory; the launch writes the table out at its end. Each
build (a column for each of `--variants`, `--splits` and `--prefetch`: the rung's grid, or the one named)
trains `--steps` steps of the workload in one launch, after a warm-up launch of one step, from
the same initial weights, and the script prints the cycles per step of every phase and layer, a
markdown table with a column per build. The probe build ends each phase that has no block barrier
of its own with one (so that the phase takes its slowest warp's time): its total runs above the
plain build's time per step (ms/epoch ÷ steps per epoch × the SM clock), so time a change with the
plain build (scripts/checks/wide_persistent.py timing).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys

import numpy as np

from graphtrain import data as data_mod
from graphtrain import environment, report
from graphtrain.config import preset
from graphtrain.kernels.persistent_wide import PHASES, VARIANTS, PersistentWide, WideShape
from graphtrain.libs import nvrtc
from graphtrain.libs.memory import Arena
from graphtrain.plan import RunPlan
from graphtrain.stages.persistent import PersistentStage, products_note


def phase_rows(tables: dict[str, np.ndarray], steps: int) -> list[str]:
    """The table's rows: a phase and layer that any build counted, its cycles a step in each build,
    and the step's total."""
    variants = list(tables)
    rows = [f"| phase (block 0) | layer | {' | '.join(variants)} |", "|---|---:|" + "---:|" * len(variants)]
    first = tables[variants[0]]
    for p, (_, meaning) in enumerate(PHASES):
        for layer in range(first.shape[1]):
            if any(table[p, layer] for table in tables.values()):
                cells = " | ".join(str(table[p, layer] // steps) for table in tables.values())
                rows.append(f"| {meaning} | {layer} | {cells} |")
    totals = " | ".join(f"**{table.sum() // steps}**" for table in tables.values())
    rows.append(f"| **step** | | {totals} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="jhu")
    parser.add_argument("--hidden", default="784,784,784", help="comma-separated hidden sizes")
    parser.add_argument("--steps", type=int, default=469, help="SGD steps (the preset's batch; at most an epoch)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"builds to count, of {', '.join(VARIANTS)}")
    parser.add_argument("--units", type=int, default=0, help="units a cluster owns (0: the rung's choice)")
    parser.add_argument("--splits", default="0", help="blocks a cluster, a column each (comma-separated; 0: the rung's)")
    parser.add_argument("--prefetch", default="0", help="the registers build's k-steps loaded ahead, a column each "
                        "(comma-separated; 0: the rung's, DEFAULT_PREFETCH)")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"no variant {', '.join(unknown)} (one of {', '.join(VARIANTS)})")
    config = preset(args.preset).replace(hidden=tuple(int(h) for h in args.hidden.split(",")), epochs=1,
                                         steps=None, precision="bf16")
    data = data_mod.load(config.dataset)
    layers = len(config.hidden)
    tables, notes = {}, []
    with PersistentStage(RunPlan.for_data(config, data), data) as stage, Arena() as arena:
        stage.setup()
        if not isinstance(stage.shape, WideShape):
            raise SystemExit(f"the persistent rung trains {'-'.join(map(str, config.dims))} with its cluster kernel: "
                             "see scripts/probes/persistent_mlp_phases.py")
        steps = min(args.steps, -(-stage.num_train // config.batch))
        counts = arena.reserve("phase_counts", (len(PHASES) * (layers + 1),), np.int64)
        arena.allocate()
        depths = [int(p) for p in args.prefetch.split(",")]
        splits = [int(s) for s in args.splits.split(",")]
        builds = [(" ".join([v, *([f"split {s}"] if len(splits) > 1 else []),
                             *([f"prefetch {p}"] if v == "registers" and len(depths) > 1 else [])]), v, p, s)
                  for v in variants for s in splits for p in (depths if v == "registers" else [0])]
        for variant, build, depth, split in builds:
            shape = dataclasses.replace(stage.shape, variant=build, prefetch=depth, units=args.units, split=split)
            refusal = shape.refusal()
            if refusal is not None:
                notes.append(f"{variant}: not built ({refusal})")
                continue
            notes.append(f"{variant}: {products_note(shape)}")
            kernel = PersistentWide(stage.device, shape, probes=True)
            try:
                stage.params.upload(stage.plan.initial, stage.stream)  # every build from the same weights
                for num_steps in (1, steps):  # a warm-up launch, then the one counted
                    counts.zero(stage.stream)
                    kernel.train_epoch(stage.stream, stage.images.ptr, stage.train_labels.ptr, stage.order.ptr,
                                       stage.param_table.ptr, config.bias, stage.num_train, num_steps, config.lr,
                                       counts.ptr, False, stage.workspace.ptr)
                tables[variant] = counts.download(stage.stream).reshape(len(PHASES), layers + 1)
            finally:
                kernel.close()
        device = stage.device
    env = {**environment.host(), **environment.gpu(device), "nvrtc": nvrtc.version()}
    print(report.script_header(f"persistent grid kernel, {args.preset} {'-'.join(map(str, config.dims))}: SM cycles "
                               "per step", env, shlex.join(["python3", *sys.argv]), notes))
    print(f"\n{steps} steps of {config.batch} rows in one launch, counted by thread 0 of block 0.\n")
    if tables:
        print("\n".join(phase_rows(tables, steps)))


if __name__ == "__main__":
    main()
