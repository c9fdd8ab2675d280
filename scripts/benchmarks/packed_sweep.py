"""The packed sweep against the jax-vmap peer, on one GPU: K softmax regressions (the jhu preset,
a grid of learning rates × seeds) trained by the persistent kernel packed one cluster a model, at
several lane counts, then the same K models as one vmapped JAX scan, and a few models again
alone, whose weights must equal the packed ones bit for bit.

    python3 scripts/benchmarks/packed_sweep.py --out results/jhu-sweep/packed-sweep-jhu-h100.md [--lrs ...] [--seeds 0-7]

Training time: the packed run from its first launch to the last model's last epoch (CUDA
events); the peer's, the sum of its epochs (dispatch to block_until_ready), as `jax-scan`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import numpy as np

from graphtrain import data as data_mod
from graphtrain import report, training
from graphtrain.config import PRESETS
from graphtrain.packed import train_packed
from graphtrain.plan import RunPlan
from graphtrain.stages import get_stage
from graphtrain.sweep import parse_floats, parse_seeds, weights_digest

DEFAULT_LRS = "0.025,0.05,0.075,0.1,0.125,0.15,0.175,0.2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", default=DEFAULT_LRS)
    parser.add_argument("--seeds", default="0-7")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lanes", default="4,7,8,16", help="lane counts to time the pack at")
    parser.add_argument("--alone", type=int, default=4, help="models trained again alone, for the check")
    parser.add_argument("--repeat", type=int, default=3, help="timed packs per lane count (the best is kept)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    data = data_mod.load("mnist")
    configs = [PRESETS["jhu"].replace(lr=lr, seed=seed, epochs=args.epochs)
               for lr in parse_floats("--lrs", args.lrs) for seed in parse_seeds(args.seeds)]
    plans = [RunPlan.for_data(config, data) for config in configs]
    count = len(plans)

    results = {}
    digests = None
    for precision in ("bf16", "fp32"):
        for lanes in [int(x) for x in args.lanes.split(",")]:
            best = None
            for _ in range(args.repeat):
                records = train_packed(plans, data, precision=precision, lanes=lanes)
                pack = records[0].pack
                if best is None or pack["train_ms"] < best[0]["train_ms"]:
                    best = (pack, records)
            pack, records = best
            results[precision, lanes] = pack
            print(f"persistent {precision} lanes {lanes:2}: {pack['train_ms']:8.2f} ms (GPU), "
                  f"{pack['train_wall_ms']:8.2f} ms wall, acc {np.mean([r.test_accuracy for r in records]):.4f}",
                  flush=True)
            found = [weights_digest(r.params) for r in records]
            if precision == "bf16":
                if digests is None:
                    digests = found
                assert found == digests, f"lanes {lanes} changed the weights"
            env = records[0].environment

    # A few models alone through the rung itself: the same weights, bit for bit.
    picks = sorted({round(i * (count - 1) / max(1, args.alone - 1)) for i in range(args.alone)})
    alone_ok = []
    stage = get_stage("persistent")
    for k in picks:
        record = training.run_stage(stage, plans[k], data)
        same = weights_digest(record.params) == digests[k]
        alone_ok.append((k, configs[k].lr, configs[k].seed, same, record.test_accuracy, sum(e.ms for e in record.epochs)))
        print(f"alone: model {k} lr {configs[k].lr} seed {configs[k].seed}: identical {same}, "
              f"{sum(e.ms for e in record.epochs):.2f} ms alone", flush=True)

    from graphtrain.peers.jax_vmap import train_vmapped

    peers = {}
    for precision in ("fp32", "bf16"):
        vplans = [RunPlan.for_data(c.replace(precision=precision), data) for c in configs]
        vrecords = train_vmapped(vplans, data)
        peers[precision] = vrecords[0].pack
        print(f"jax-vmap {precision}: {peers[precision]['train_ms']:8.2f} ms, acc "
              f"{np.mean([r.test_accuracy for r in vrecords]):.4f}", flush=True)
        jax_env = vrecords[0].environment

    command = shlex.join(["python3", "scripts/benchmarks/packed_sweep.py", *sys.argv[1:]])
    extra = [f"JAX: {jax_env.get('jax')} (jaxlib {jax_env.get('jaxlib')})",
             f"Workload: jhu (784→10, bias, batch 128, {args.epochs} epochs), lrs {args.lrs}, seeds {args.seeds}: "
             f"{count} models",
             "Timing: the pack from its first launch to its last model's end (CUDA events), best of "
             f"{args.repeat}; jax-vmap the sum of its epochs (dispatch to block_until_ready), after a warm-up"]
    lines = [report.script_header(f"Packed sweep: {count} jhu softmax regressions, {args.epochs} epochs", env,
                                  command, extra)]
    lines += ["| row | precision | lanes | training ms | vs jax-vmap (same precision) |", "|---|---|---:|---:|---:|"]
    for (precision, lanes), pack in results.items():
        peer = peers[precision]["train_ms"]
        lines.append(f"| persistent packed | {precision} | {lanes} | {pack['train_ms']:.2f} | "
                     f"{peer / pack['train_ms']:.2f}x |")
    for precision, pack in peers.items():
        lines.append(f"| jax-vmap (peer) | {precision} | — | {pack['train_ms']:.2f} | 1.00x |")
    lines += ["", "Models trained again alone by the persistent rung (bf16), weights against the pack's:", ""]
    lines += [f"- model {k} (lr {lr}, seed {seed}): {'identical' if same else 'DIFFERENT'}, test accuracy "
              f"{100 * acc:.2f}%, {ms:.2f} ms alone" for k, lr, seed, same, acc, ms in alone_ok]
    lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if not all(same for *_, same, _, _ in alone_ok):
        sys.exit("a packed model's weights differ from its run alone")


if __name__ == "__main__":
    main()
