#!/usr/bin/env python3
"""The jax-scan peers' variants, timed side by side: which way of writing the scan is fastest.

    python3 scripts/benchmarks/jax_scan_variants.py [--preset jhu] [--hidden 784,784,784] [--epochs 6] [--rounds 2]

A variant is the peer with another `product` (what the products read and return, see
`graphtrain.peers.jax_scan.make_product`), `gather` (where a step's images are gathered) or
`matmul_precision`. The rows take turns for `--rounds` rounds on the same data and plan; each
cell is the median over the rounds of the run's median epoch time (the ladder's protocol),
beside the last epoch's training loss and the test accuracy (the variants must train alike).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys

from graphtrain import data as data_mod
from graphtrain.config import preset
from graphtrain.peers.jax_scan import JaxScanBf16Peer, JaxScanPeer
from graphtrain.plan import RunPlan
from graphtrain.training import run_stage

# (row name, base peer, attributes changed)
VARIANTS = [
    ("jax-scan (fp32, highest)", JaxScanPeer, {}),
    ("jax-scan, epoch gather", JaxScanPeer, {"gather": "epoch"}),
    ("bf16-mixed (autodiff of preferred fp32: fp32 backward)", JaxScanBf16Peer, {"product": "bf16-mixed"}),
    ("bf16-mixed, default precision", JaxScanBf16Peer, {"product": "bf16-mixed", "matmul_precision": "default"}),
    ("bf16-out (results rounded to bf16)", JaxScanBf16Peer, {"product": "bf16-out"}),
    ("bf16-out, bf16 images", JaxScanBf16Peer, {"product": "bf16-out", "gather": "rows-bf16"}),
    ("bf16 (custom VJP: bf16 backward, fp32 results)", JaxScanBf16Peer, {"product": "bf16"}),
    ("bf16, bf16 images", JaxScanBf16Peer, {"product": "bf16", "gather": "rows-bf16"}),
    ("bf16, epoch gather", JaxScanBf16Peer, {"product": "bf16", "gather": "epoch"}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="jhu")
    parser.add_argument("--hidden", default="784,784,784", help="comma-separated hidden sizes")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    config = preset(args.preset).replace(epochs=args.epochs)
    if args.hidden:
        config = config.replace(hidden=tuple(int(h) for h in args.hidden.split(",")))
    data = data_mod.load(config.dataset)
    plan = RunPlan.for_data(config, data)
    rows = {name: type(base.__name__, (base,), attrs) for name, base, attrs in VARIANTS}
    times: dict[str, list[float]] = {name: [] for name in rows}
    trained: dict[str, tuple[float, float]] = {}
    for _ in range(args.rounds):
        for name, cls in rows.items():
            record = run_stage(cls, plan, data)
            times[name].append(record.epoch_ms)
            trained[name] = (record.epochs[-1].train_loss, record.test_accuracy)
            print(f"{name}: {record.epoch_ms:.3f} ms", file=sys.stderr, flush=True)
    env = record.environment
    dims = "-".join(map(str, config.dims))
    print(f"# jax-scan variants: {args.preset} {dims}, batch {config.batch}, {args.epochs} epochs, "
          f"{args.rounds} rounds\n")
    print(f"- command: `{shlex.join(['python3', *sys.argv])}`")
    print("\n".join(f"- {key}: {env[key]}" for key in sorted(env)) + "\n")
    print("| variant | ms/epoch (median of rounds) | min | max | last train loss | test accuracy |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, ms in times.items():
        loss, accuracy = trained[name]
        print(f"| {name} | {statistics.median(ms):.3f} | {min(ms):.3f} | {max(ms):.3f} | "
              f"{loss:.5f} | {accuracy:.4f} |")


if __name__ == "__main__":
    main()
