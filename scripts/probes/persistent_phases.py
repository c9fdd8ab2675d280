#!/usr/bin/env python3
"""Where a step of the persistent softmax-regression kernel spends its time: SM cycles per phase.

    python3 scripts/probes/persistent_phases.py [--preset jhu] [--steps 64] [--precision bf16|fp32]

Builds kernels/persistent.cu with its phase probes (-DPROBES, kernels/probes.cuh: clock64() stamps
of thread 0 of block 0 at the ends of the phases, kernels/persistent.py's STAMPS, for the first
PROBE_STEPS steps), trains that many steps of the workload with it, and prints the median cycles
between consecutive stamps over steps 8 on. Thread 0 is one warp of eight: its phase A and C times
are its own tiles', and a wait ends when the slowest block's data reach it, so the columns show
where the step's critical path runs. The stamps cost a few cycles each; the total is within a few
per cent of the plain kernel's time per step (ms/epoch ÷ steps × SM clock).
"""

from __future__ import annotations

import argparse
import shlex
import sys

import numpy as np

from graphtrain import data as data_mod
from graphtrain import environment, report
from graphtrain.config import preset
from graphtrain.kernels.persistent import PROBE_STEPS, STAMPS, Persistent
from graphtrain.libs import nvrtc
from graphtrain.libs.memory import Arena
from graphtrain.plan import RunPlan
from graphtrain.stages.persistent import PersistentStage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="jhu")
    parser.add_argument("--steps", type=int, default=PROBE_STEPS, help=f"steps to time (at most {PROBE_STEPS})")
    parser.add_argument("--precision", choices=PersistentStage.precisions, default=PersistentStage.precisions[0],
                        help="the products' operands: bf16 (one pass) or fp32 (TF32 passes)")
    args = parser.parse_args()
    steps = min(args.steps, PROBE_STEPS)
    config = preset(args.preset).replace(epochs=1, precision=args.precision)
    if config.hidden:
        raise SystemExit("persistent_phases.py times the softmax-regression kernel; for MLPs see persistent_mlp_phases.py")
    data = data_mod.load(config.dataset)
    with PersistentStage(RunPlan.for_data(config, data), data) as stage, Arena() as arena:
        stage.setup()
        stamps = arena.reserve("stamps", (PROBE_STEPS * len(STAMPS),), np.int64)
        arena.allocate()
        device, products = stage.device, stage.environment()["persistent_products"]
        kernel = Persistent(device, stage.shape, probes=True)
        try:
            stamps.zero(stage.stream)
            kernel.train_epoch(stage.stream, stage.images.ptr, stage.train_labels.ptr, stage.order.ptr, stage.w[0].ptr,
                               stage.b[0].ptr if config.bias else 0, stage.num_train, steps, config.lr, stamps.ptr, False)
            table = stamps.download(stage.stream).reshape(PROBE_STEPS, len(STAMPS))[:steps]
        finally:
            kernel.close()
    ran = [k for k in range(len(STAMPS)) if table[:, k].any()]  # a build's own stamps (bf16: no C barrier)
    at = table[:, ran].astype(np.float64)
    # Each phase: from the stamp before to its own; the first, from the previous step's last stamp.
    per_phase = np.diff(np.concatenate([at[:-1, -1:], at[1:]], axis=1), axis=1)[7:]
    env = {**environment.host(), **environment.gpu(device), "nvrtc": nvrtc.version()}
    print(report.script_header(f"persistent softmax regression, {args.preset}: SM cycles per step", env,
                               shlex.join(["python3", *sys.argv]), [f"Products: {products}"]))
    print(f"Block 0, thread 0; median over steps 8 to {steps - 1}.\n")
    print("| phase (ends at the stamp) | cycles |\n|---|---:|")
    for k, cycles in zip(ran, np.median(per_phase, axis=0)):
        print(f"| {STAMPS[k][1]} | {cycles:.0f} |")
    print(f"| **step** | **{np.median(np.diff(at[:, 0])[7:]):.0f}** |")


if __name__ == "__main__":
    main()
