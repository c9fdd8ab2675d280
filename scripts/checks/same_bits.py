#!/usr/bin/env python3
"""Does this tree train the same bits as another? Each run below once with this tree's graphtrain
and once with BEFORE's (a copy of another revision's tree), on this GPU: the saved weights
compared key by key (np.array_equal), and each record's epoch losses and test accuracy.

    python3 scripts/checks/same_bits.py BEFORE_DIR [--save-before] [--only TEXT]

--save-before: BEFORE's tree saves the cnn too (a revision that could not save it is compared
by its record only). --only: the runs whose name holds TEXT."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
RUNS = [
    *((f"{rung}, MLP 128", ["--stage", rung, "--hidden", "128"])
      for rung in ("baseline", "fewer-syncs", "cublas", "sparse-metrics", "cudnn-softmax")),
    ("cublas tf32, MLP 128", ["--stage", "cublas", "--hidden", "128", "--precision", "tf32"]),
    ("graphs tf32, MLP 128", ["--stage", "graphs", "--hidden", "128", "--precision", "tf32"]),
    ("graphs adam one-cycle, MLP 128", ["--stage", "graphs", "--hidden", "128", "--optimizer", "adam",
                                        "--schedule", "one-cycle"]),
    ("fused, MLP 128", ["--stage", "fused", "--hidden", "128"]),
    ("fused, softmax", ["--stage", "fused", "--hidden", "none"]),
    ("bf16, MLP 128", ["--stage", "bf16", "--hidden", "128"]),
    ("bf16, softmax", ["--stage", "bf16", "--hidden", "none"]),
    ("device-loop, MLP 128", ["--stage", "device-loop", "--hidden", "128"]),
    ("persistent, MLP 128", ["--stage", "persistent", "--hidden", "128"]),
    ("persistent, MLP 784x3 (the grid kernel)", ["--stage", "persistent", "--hidden", "784,784,784"]),
    ("graphs, MLP 128", ["--stage", "graphs", "--hidden", "128"]),
    ("graphs, speedrun cnn", ["--stage", "graphs", "--preset", "speedrun"]),
    ("device-loop, speedrun cnn", ["--stage", "device-loop", "--preset", "speedrun"]),
]


def run(tree: Path, args: list[str], scratch: Path, tag: str, save: bool) -> tuple[dict, dict | None]:
    record, weights = scratch / f"{tag}.json", scratch / f"{tag}.safetensors"
    command = [sys.executable, "-m", "graphtrain", "run", *args, "--epochs", "2", "--json", str(record)]
    if save:
        command += ["--save", str(weights)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tag}: {' '.join(command)} failed:\n{done.stderr[-2000:]}")
    tensors = None
    if save:
        from safetensors.numpy import load_file

        tensors = load_file(weights)
    return json.loads(record.read_text()), tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("--save-before", action="store_true")
    parser.add_argument("--only", default="", help="the runs whose name holds this text")
    args = parser.parse_args()
    same_everywhere = True
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        for i, (name, run_args) in enumerate(RUNS):
            if args.only not in name:
                continue
            cnn = "speedrun" in run_args
            save_before = args.save_before or not cnn
            a, wa = run(args.before.resolve(), run_args, scratch, f"before{i}", save_before)
            b, wb = run(ROOT, run_args, scratch, f"after{i}", save_before)
            losses = [e["train_loss"] for e in a["epochs"]] == [e["train_loss"] for e in b["epochs"]]
            accuracy = a["test_accuracy"] == b["test_accuracy"]
            weights = "not saved" if wa is None else (
                "same" if wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa) else "DIFFER")
            same = losses and accuracy and weights in ("same", "not saved")
            same_everywhere &= same
            print(f"{name:28s} losses {'same' if losses else 'DIFFER'}, test accuracy "
                  f"{'same' if accuracy else 'DIFFER'} ({a['test_accuracy']:.4f} / {b['test_accuracy']:.4f}), "
                  f"weights {weights}", flush=True)
    print("same bits" if same_everywhere else "NOT the same bits")


if __name__ == "__main__":
    main()
