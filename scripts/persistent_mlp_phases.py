#!/usr/bin/env python3
"""Where a step of the persistent MLP kernel spends its time: SM cycles per phase, per step.

    python3 scripts/persistent_mlp_phases.py [--preset cuda-mnist] [--hidden 128,128,128] [--steps 3750]
                                             [--precision bf16|fp32]

Trains the workload with the persistent rung built with PHASE_CYCLES=1 (kernels/persistent_mlp.cu):
thread 0 of block 0 reads the SM clock at the end of each phase of every step (a phase that ends at
a block barrier or at the wait for an exchange takes the slowest thread's time, and for a wait the
slowest sender's) and each launch of an epoch prints the cycles per step of every phase and layer,
a markdown table, when it ends. The instrumented build adds block barriers of its own (to split
phases that end without one) and keeps the counts in shared memory: its total runs 5 to 20% above
the plain build's time per step (ms/epoch ÷ steps per epoch × the SM clock; its barriers make every
warp wait where the plain build lets them run ahead), so read a phase of a few hundred cycles as a
rough figure, and time a change with the plain build. The output is markdown (results/persistent-mlp-phases-*).
"""

from __future__ import annotations

import argparse
import shlex
import sys

from graphtrain import data as data_mod
from graphtrain import environment
from graphtrain.config import preset
from graphtrain.kernels.persistent_mlp import PersistentMlp
from graphtrain.libs import cuda, nvrtc
from graphtrain.plan import RunPlan
from graphtrain.stages.persistent import PersistentStage
from graphtrain.training import run_stage


class PhaseCyclesMlp(PersistentMlp):
    defines = {**PersistentMlp.defines, "PHASE_CYCLES": 1}


class PhaseCyclesStage(PersistentStage):
    mlp_kernel = PhaseCyclesMlp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cuda-mnist")
    parser.add_argument("--hidden", default="128,128,128", help="comma-separated hidden sizes")
    parser.add_argument("--steps", type=int, default=3750, help="SGD steps (the preset's batch)")
    parser.add_argument("--precision", choices=PersistentStage.precisions, default=PersistentStage.precisions[0],
                        help="the products' operands: bf16 (one pass) or fp32 (TF32 passes)")
    args = parser.parse_args()
    config = preset(args.preset).replace(hidden=tuple(int(h) for h in args.hidden.split(",")), epochs=None,
                                         steps=args.steps, precision=args.precision)
    data = data_mod.load(config.dataset)
    env = {**environment.gpu(cuda.open_device()), "nvrtc": nvrtc.version()}
    print(f"# persistent MLP, {args.preset} {'-'.join(map(str, config.dims))}: SM cycles per step\n")
    print(f"- command: `{shlex.join(['python3', *sys.argv])}`")
    print("\n".join(f"- {key}: {env[key]}" for key in sorted(env)))
    print("\nOne table per epoch's launch, counted by thread 0 of block 0 (the warm-up's single step prints none).",
          flush=True)  # the kernel's tables follow, printed by the device
    record = run_stage(PhaseCyclesStage, RunPlan.for_data(config, data), data)
    print(f"\nThis instrumented build: {record.epoch_ms:.2f} ms/epoch (median), test accuracy "
          f"{100 * record.test_accuracy:.2f}%; products: {record.environment.get('persistent_products', '')}.")


if __name__ == "__main__":
    main()
