#!/usr/bin/env python3
"""Median epoch times of two source trees side by side, on this GPU, in one call: each run a
`graphtrain run` process from inside its tree, the trees taking turns in every round (drift hits
both), round 0 warming the kernel caches and not reported.

    python3 scripts/benchmarks/epoch_ab.py BEFORE_TREE AFTER_TREE [--rounds 2] [--json F] [--only TEXT]

Runs: the speedrun cnn on graphs, device-loop and persistent; softmax regression (jhu) on graphs,
fused, bf16, device-loop and persistent; the 784³ MLP (jhu --hidden 784,784,784, 5 epochs) on
graphs, bf16, device-loop and persistent; cuda-mnist's MLPs of 512 and 1024 units on persistent.
Printed: per run and tree the record's median epoch ms over the rounds (each round's record: the
median of its second half of epochs), and after/before. GRAPHTRAIN_DATA names
MNIST's folder (an absolute path: each run starts inside its tree).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RUNS = {
    "speedrun cnn, graphs": "--preset speedrun --stage graphs",
    "speedrun cnn, device-loop": "--preset speedrun --stage device-loop",
    "jhu softmax, graphs": "--preset jhu --stage graphs",
    "jhu softmax, fused": "--preset jhu --stage fused",
    "jhu softmax, bf16": "--preset jhu --stage bf16",
    "jhu softmax, device-loop": "--preset jhu --stage device-loop",
    "jhu softmax, persistent": "--preset jhu --stage persistent",
    "speedrun cnn, persistent": "--preset speedrun --stage persistent",
    "784³ MLP, graphs": "--preset jhu --hidden 784,784,784 --epochs 5 --stage graphs",
    "784³ MLP, bf16": "--preset jhu --hidden 784,784,784 --epochs 5 --stage bf16",
    "784³ MLP, device-loop": "--preset jhu --hidden 784,784,784 --epochs 5 --stage device-loop",
    "784³ MLP, persistent": "--preset jhu --hidden 784,784,784 --epochs 5 --stage persistent",
    "cuda-mnist 512³ MLP, persistent": "--preset cuda-mnist --hidden 512,512,512 --stage persistent",
    "cuda-mnist 1024³ MLP, persistent": "--preset cuda-mnist --stage persistent",
}


def epoch_ms(tree: Path, args: str, scratch: Path) -> float:
    out = scratch / "record.json"
    subprocess.run([sys.executable, "-m", "graphtrain", "run", *args.split(), "--json", str(out)], cwd=tree,
                   env={**__import__("os").environ, "PYTHONPATH": str(tree)}, check=True, capture_output=True)
    return float(json.loads(out.read_text())["epoch_ms"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--only", default="", help="only the runs whose name holds this text")
    args = parser.parse_args()
    runs = {name: run for name, run in RUNS.items() if args.only in name}
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    times: dict[str, dict[str, list[float]]] = {name: {"before": [], "after": []} for name in runs}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds + 1):
            for name, run_args in runs.items():
                for tag, tree in (trees.items() if round_ % 2 == 0 else reversed(trees.items())):
                    ms = epoch_ms(tree, run_args, Path(scratch))
                    if round_:
                        times[name][tag].append(ms)
            print(f"round {round_} done", file=sys.stderr, flush=True)
    print("| run | before ms | after ms | after / before |")
    print("|---|---:|---:|---:|")
    rows = {}
    for name, by_tree in times.items():
        before, after = statistics.median(by_tree["before"]), statistics.median(by_tree["after"])
        rows[name] = {"before_ms": by_tree["before"], "after_ms": by_tree["after"], "ratio": after / before}
        print(f"| {name} | {before:.3f} | {after:.3f} | {after / before:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
