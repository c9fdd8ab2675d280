"""The cnn's packs measured each way: 64 speedrun cnns (the preset's recipe; 8 learning rates ×
seeds 0-7) trained together by graphtrain.stages.cnn_pack in each mode ("axis": every launch
trains the models of a pack, at most --per-launch of them; "streams": a graph per model on its
lane's stream; "graph": one graph of a lane-group's models as branches, the last two over 8, 16
and 64 lanes), each twice, on one GPU in one process. Per configuration: the pack's training
time (first step to last accuracy, CUDA events) and its host wall, its setup (all of it; the
captures; the first model's construction and the median of the others': the per-row setup once
the process holds the dataset, the kernels and the lanes), the test accuracies, and whether
every model's weights are the bits of the first configuration's (they must be: each model runs
its own launches). A pack of one model first: the run alone, for scale. For axis, the "lanes"
column is the most models a launch trains, "1st model" the first pack's construction, and "per
model" the median time to write a model's recipe, weights and orders into the pack.

Usage: python3 scripts/probes/cnn_pack_modes.py [--lanes 8,16,64] [--modes axis,streams,graph]
                                                [--per-launch 64,32] [--precision tf32] [--repeats 2]"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import numpy as np

from graphtrain import config, data
from graphtrain.plan import RunPlan
from graphtrain.stages import cnn_pack
from graphtrain.stages.cnn_pack import flat, train_packed_cnn

LRS = (0.006, 0.007, 0.008, 0.009, 0.01, 0.011, 0.012, 0.014)
SEEDS = range(8)


def digest(record) -> str:
    hashed = hashlib.sha256()
    for array in flat(record.params):
        hashed.update(np.ascontiguousarray(array, np.float32).tobytes())
    return hashed.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lanes", default="8,16,64")
    parser.add_argument("--modes", default="axis,streams,graph")
    parser.add_argument("--per-launch", default="64,32", help="axis: the most models a launch trains")
    parser.add_argument("--precision", default="tf32")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    start = time.perf_counter()
    mnist = data.load("mnist")
    preset = config.preset("speedrun")
    plans = [RunPlan.for_data(preset.replace(lr=lr, seed=seed), mnist) for lr in LRS for seed in SEEDS]
    print(f"data and {len(plans)} plans: {time.perf_counter() - start:.2f} s", flush=True)

    header = (f"{'mode':8} {'lanes':>5} {'models':>6} {'train ms':>9} {'wall ms':>8} {'setup ms':>9} {'capture':>8} "
              f"{'1st model':>9} {'per model':>9} {'acc mean':>9} {'acc min':>8} {'eval rows':>9} bits")
    print(header)
    reference: list[str] | None = None

    def show(mode: str, lanes: int, chosen: list[RunPlan]) -> None:
        nonlocal reference
        t0 = time.perf_counter()
        records = train_packed_cnn(chosen, mnist, precision=args.precision, lanes=lanes, mode=mode)
        wall_ms = (time.perf_counter() - t0) * 1e3
        pack = records[0].pack
        accuracies = [r.test_accuracy for r in records]
        digests = [digest(r) for r in records]
        if len(chosen) == len(plans) and reference is None:
            reference = digests
        bits = ("first" if digests is reference else "same" if digests == reference else "DIFFER") \
            if len(chosen) == len(plans) else "-"
        per_model = pack["model_setup_ms"]
        print(f"{mode:8} {lanes:5d} {len(chosen):6d} {pack['train_ms']:9.2f} {pack['train_wall_ms']:8.2f} "
              f"{pack['setup_ms']:9.1f} {pack['capture_ms']:8.1f} {pack['first_model_setup_ms']:9.2f} "
              f"{per_model if per_model is None else round(per_model, 2)!s:>9} {statistics.fmean(accuracies):9.4f} "
              f"{min(accuracies):8.4f} {pack['eval_rows']:9d} {bits}  (call {wall_ms:.0f} ms)", flush=True)

    show("streams", 1, plans[:1])  # one model: the run alone (and the process's first setup)
    for mode in args.modes.split(","):
        if mode == "axis":  # one lane; the pack's size a launch instead
            for per_launch in (int(n) for n in args.per_launch.split(",")):
                cnn_pack.AXIS_MAX_MODELS = per_launch
                for _ in range(args.repeats):
                    show(mode, per_launch, plans)
            continue
        for lanes in (int(n) for n in args.lanes.split(",")):
            for _ in range(args.repeats):
                show(mode, lanes, plans)
    print(f"whole probe: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
