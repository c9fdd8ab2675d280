#!/usr/bin/env python3
"""Where a speedrun row's clock goes: the parts of what `graphtrain speedrun` times for a seed
(graphtrain.speedrun.train_and_test after `restart`), each timed on its own with perf_counter,
and the training launch's GPU time by its events.

    python3 scripts/probes/speedrun_clock.py [--stages persistent,graphs] [--seeds 5]

Per row, medians over the seeds (the row set up once, untimed, as the speedrun does):
restart (the seed's weights, orders and recipe put on the row), the epoch on the host (queued
and waited for), the epoch's GPU time (its events), the test accuracy (queued, waited for, read),
and their sum, which is the speedrun's time for the seed.
"""

from __future__ import annotations

import argparse
import statistics
import time

from graphtrain import data as datasets
from graphtrain.config import preset
from graphtrain.speedrun import SpeedrunCase, set_up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="persistent,graphs")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    case = SpeedrunCase.of(preset("speedrun"), datasets.load("mnist"))
    print("| row | restart ms | epoch (host) ms | epoch (events) ms | test accuracy ms | sum ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.stages.split(","):
        cls = case.row_class(name)
        config = case.row_config(cls)
        row, _ = set_up(cls, case.plan(config, 0), case.data)
        parts = {key: [] for key in ("restart", "host", "events", "test", "sum")}
        try:
            for seed in range(args.seeds):
                plan = case.plan(config, seed)
                t0 = time.perf_counter()
                if not row.restart(plan):
                    raise SystemExit(f"{name} cannot restart seed {seed}'s plan in place")
                t1 = time.perf_counter()
                gpu_ms = 0.0
                for epoch in range(plan.num_epochs):
                    gpu_ms += row.train_epoch(epoch, plan.batches[epoch], False).ms
                t2 = time.perf_counter()
                row.test_accuracy()
                t3 = time.perf_counter()
                for key, value in (("restart", t1 - t0), ("host", t2 - t1), ("test", t3 - t2), ("sum", t3 - t0)):
                    parts[key].append(value * 1e3)
                parts["events"].append(gpu_ms)
        finally:
            row.close()
        m = {key: statistics.median(values) for key, values in parts.items()}
        print(f"| {name} | {m['restart']:.3f} | {m['host']:.3f} | {m['events']:.3f} | {m['test']:.3f} | {m['sum']:.3f} |")


if __name__ == "__main__":
    main()
