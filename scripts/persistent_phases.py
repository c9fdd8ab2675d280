#!/usr/bin/env python3
"""Where a step of the persistent softmax-regression kernel spends its time: SM cycles per phase.

    python3 scripts/persistent_phases.py [--preset jhu] [--steps 64] [--precision bf16|fp32]

Builds kernels/persistent.cu with clock64() stamps put before the lines named below (thread 0 of
block 0, the first 64 steps), trains that many steps of the workload with it, and prints the
median cycles between consecutive stamps over steps 8 on. Thread 0 is one warp of eight: its
phase A and C times are its own tiles', and a wait ends when the slowest block's data reach it,
so the columns show where the step's critical path runs. The stamps cost a few cycles each; the
total is within a few per cent of the plain kernel's time per step (ms/epoch ÷ steps × SM clock).
A line the script looks for that the kernel no longer has is an error: edit MARKS with the kernel.
"""

from __future__ import annotations

import argparse
import shlex
import sys

import numpy as np

from graphtrain import data as data_mod
from graphtrain import environment
from graphtrain.config import preset
from graphtrain.kernels.persistent import Persistent
from graphtrain.libs import nvrtc
from graphtrain.libs.memory import Arena
from graphtrain.plan import RunPlan
from graphtrain.stages.persistent import PersistentStage

MAX_STEPS = 64
# (name of the phase that ends at the stamp, the kernel line the stamp goes before, the builds
# whose code runs that line: phase C differs between them)
MARKS = [
    ("C: second barrier", "    mbarrier_wait(s.tile_full + cur", "bf16 fp32"),  # (of the step before)
    ("tile wait", "    if (me.tid == 0) {  // what this step will receive", "bf16 fp32"),
    ("A: products", "        for (int half = 0; half < 2; ++half) {  // rows g and g + 8", "bf16 fp32"),
    ("A: sends", "    mbarrier_wait(s.inbox_full, step & 1);", "bf16 fp32"),
    ("inbox wait", "    // ---- B: the owned rows", "bf16 fp32"),
    ("B", "    mbarrier_wait(s.dl_full, step & 1);", "bf16 fp32"),
    ("dlogits wait", "    // ---- C: this block's slice", "bf16 fp32"),
    ("C: products", "#pragma unroll\n        for (int n = 0; n < N_TILES; ++n) update_tile(", "bf16"),
    ("C: products", "    compute_sync();  // every part's sums are in", "fp32"),
    ("C: barrier", "        float grads[4] = {};", "fp32"),
    ("C: update", "    compute_sync();  // the updates before", "bf16 fp32"),
]


def marks(precision: str) -> list[int]:
    """The stamps the `precision` build runs, as indices of MARKS."""
    return [k for k, (_, _, builds) in enumerate(MARKS) if precision in builds.split()]


class PhaseCycles(Persistent):
    """Every mark stamped (slot k of a step for MARKS[k]); a build leaves the other build's at zero."""

    @classmethod
    def source(cls) -> str:
        text = super().source()
        for k, (_, line, _) in enumerate(MARKS):
            if line not in text:
                raise SystemExit(f"persistent_phases.py: the kernel has no line {line.strip()!r}; update MARKS")
            stamp = f"    if (me.rank == 0 && me.tid == 0 && step < {MAX_STEPS}) phase_stamps[step * {len(MARKS)} + {k}] = clock64();\n"
            text = text.replace(line, stamp + line, 1)
        text = text.replace("// One step of `rows` samples", "__device__ long long* phase_stamps;\n// One step of `rows` samples", 1)
        # The stamps go where the metrics would (the run below does not measure).
        return text.replace("    const Smem s = carve(smem_raw);",
                            "    const Smem s = carve(smem_raw);\n    phase_stamps = reinterpret_cast<long long*>(metrics);", 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="jhu")
    parser.add_argument("--steps", type=int, default=MAX_STEPS, help=f"steps to time (at most {MAX_STEPS})")
    parser.add_argument("--precision", choices=PersistentStage.precisions, default=PersistentStage.precisions[0],
                        help="the products' operands: bf16 (one pass) or fp32 (TF32 passes)")
    args = parser.parse_args()
    steps = min(args.steps, MAX_STEPS)
    config = preset(args.preset).replace(epochs=1, precision=args.precision)
    if config.hidden:
        raise SystemExit("persistent_phases.py times the softmax-regression kernel; for MLPs see persistent_mlp_phases.py")
    data = data_mod.load(config.dataset)
    with PersistentStage(RunPlan.for_data(config, data), data) as stage, Arena() as arena:
        stage.setup()
        stamps = arena.reserve("stamps", (MAX_STEPS * len(MARKS),), np.int64)
        arena.allocate()
        device, products = stage.device, stage.environment()["persistent_products"]
        kernel = PhaseCycles(device, stage.shape)
        try:
            stamps.zero(stage.stream)
            kernel.train_epoch(stage.stream, stage.images.ptr, stage.train_labels.ptr, stage.order.ptr, stage.w[0].ptr,
                               stage.b[0].ptr if config.bias else 0, stage.num_train, steps, config.lr, stamps.ptr, False)
            at = stamps.download(stage.stream).reshape(MAX_STEPS, len(MARKS))[:, marks(stage.precision)][:steps].astype(np.float64)
        finally:
            kernel.close()
    # Each phase: from the stamp before to its own; the first, from the previous step's last stamp.
    per_phase = np.diff(np.concatenate([at[:-1, -1:], at[1:]], axis=1), axis=1)[7:]
    env = {**environment.gpu(device), "nvrtc": nvrtc.version(), "persistent_products": products}
    print(f"# persistent softmax regression, {args.preset}: SM cycles per step\n")
    print(f"- command: `{shlex.join(['python3', *sys.argv])}`")
    print("\n".join(f"- {key}: {env[key]}" for key in sorted(env)) + "\n")
    print(f"Block 0, thread 0; median over steps 8 to {steps - 1}.\n")
    print("| phase (ends at the stamp) | cycles |\n|---|---:|")
    for k, cycles in zip(marks(stage.precision), np.median(per_phase, axis=0)):
        name = MARKS[k][0]
        print(f"| {name} | {cycles:.0f} |")
    print(f"| **step** | **{np.median(np.diff(at[:, 0])[7:]):.0f}** |")


if __name__ == "__main__":
    main()
