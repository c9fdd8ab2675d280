#!/usr/bin/env python3
"""Where a step of the persistent MLP kernel spends its time: SM cycles per phase, per step.

    python3 scripts/probes/persistent_mlp_phases.py [--preset cuda-mnist] [--hidden 128,128,128] [--steps 1875]
                                             [--precision bf16|fp32]

Builds kernels/persistent_mlp.cu with its phase probes (-DPROBES, kernels/probes.cuh): thread 0 of
block 0 reads the SM clock at the end of each phase of every step (kernels/persistent_mlp.py's
PHASES; a phase that ends at a block barrier or at the wait for an exchange takes the slowest
thread's time, and for a wait the slowest sender's) and adds up each phase's cycles per layer in
shared memory; the launch writes the table out at its end. This trains `--steps` steps of the
workload in one launch, after a warm-up launch of one step, and prints the cycles per step of every
phase and layer, a markdown table. The probe build adds block barriers of its own (to split phases
that end without one): its total runs 5 to 20% above the plain build's time per step (ms/epoch ÷
steps per epoch × the SM clock; its barriers make every warp wait where the plain build lets them
run ahead), so read a phase of a few hundred cycles as a rough figure, and time a change with the
plain build.
"""

from __future__ import annotations

import argparse
import shlex
import sys

import numpy as np

from graphtrain import data as data_mod
from graphtrain import environment, report
from graphtrain.config import preset
from graphtrain.kernels.persistent_mlp import PHASES, PersistentMlp
from graphtrain.libs import nvrtc
from graphtrain.libs.memory import Arena
from graphtrain.plan import RunPlan
from graphtrain.stages.persistent import PersistentStage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cuda-mnist")
    parser.add_argument("--hidden", default="128,128,128", help="comma-separated hidden sizes")
    parser.add_argument("--steps", type=int, default=1875, help="SGD steps (the preset's batch; at most an epoch)")
    parser.add_argument("--precision", choices=PersistentStage.precisions, default=PersistentStage.precisions[0],
                        help="the products' operands: bf16 (one pass) or fp32 (TF32 passes)")
    args = parser.parse_args()
    config = preset(args.preset).replace(hidden=tuple(int(h) for h in args.hidden.split(",")), epochs=1,
                                         steps=None, precision=args.precision)
    data = data_mod.load(config.dataset)
    layers = len(config.hidden)
    with PersistentStage(RunPlan.for_data(config, data), data) as stage, Arena() as arena:
        stage.setup()
        steps = min(args.steps, -(-stage.num_train // config.batch))
        counts = arena.reserve("phase_counts", (len(PHASES) * (layers + 1),), np.int64)
        arena.allocate()
        device, products = stage.device, stage.environment()["persistent_products"]
        kernel = PersistentMlp(device, stage.shape, probes=True)
        try:
            for num_steps in (1, steps):  # a warm-up launch, then the one counted
                counts.zero(stage.stream)
                kernel.train_epoch(stage.stream, stage.images.ptr, stage.train_labels.ptr, stage.order.ptr,
                                   stage.param_table.ptr, config.bias, stage.num_train, num_steps, config.lr,
                                   counts.ptr, False)
            table = counts.download(stage.stream).reshape(len(PHASES), layers + 1)
        finally:
            kernel.close()
    env = {**environment.host(), **environment.gpu(device), "nvrtc": nvrtc.version()}
    print(report.script_header(f"persistent MLP, {args.preset} {'-'.join(map(str, config.dims))}: SM cycles per step",
                               env, shlex.join(["python3", *sys.argv]), [f"Products: {products}"]))
    print(f"\n{steps} steps of {config.batch} rows in one launch, counted by thread 0 of block 0.\n")
    print("| phase (block 0) | layer | cycles a step |\n|---|---:|---:|")
    for (_, name), row in zip(PHASES, table):
        for layer, cycles in enumerate(row):
            if cycles:
                print(f"| {name} | {layer} | {cycles // steps} |")
    print(f"| **step** | | **{table.sum() // steps}** |")


if __name__ == "__main__":
    main()
