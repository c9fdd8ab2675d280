"""Data-parallel scaling: `run --gpus N` (N = 2, 4; batch B per GPU) against one GPU at batch B
(the same work per GPU) and one GPU at the combined batch N·B (the same model and updates), for
the 784³ MLP on the graphs rung; one table row per run, each run a `graphtrain run` process.

    python3 scripts/benchmarks/data_parallel_scaling.py --out results/data-parallel-jhu-mlp784x3-h100.md

Epoch time: the run record's median epoch (CUDA events on rank 0; every rank waits for the
others in each step's all-reduce). Weights: each data-parallel run's trained weights against
the one-GPU run at its combined batch, ‖a − b‖ / ‖b‖ over all parameters in float64. Counts of
GPUs beyond what this host has are left out, and the table says so.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from graphtrain import model_io, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="1,2,4", help="GPU counts to run (1: one GPU, no NCCL)")
    parser.add_argument("--batch", type=int, default=128, help="batch per GPU")
    parser.add_argument("--hidden", default="784,784,784")
    parser.add_argument("--preset", default="jhu")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="the Markdown table (else printed only)")
    args = parser.parse_args()
    counts = sorted({int(n) for n in args.gpus.split(",")})

    from graphtrain.libs import cuda

    from graphtrain.errors import GpuUnavailableError

    try:
        available = cuda.device_count()
    except GpuUnavailableError as exc:
        sys.exit(f"error: the scaling table needs GPUs: {exc}")
    runs: list[tuple[str, int, int, dict, float | None]] = []  # engine, gpus, batch/GPU, record, rel. diff
    skipped = [n for n in counts if n > available]
    with tempfile.TemporaryDirectory() as tmp:
        one_gpu: dict[int, tuple[dict, Path]] = {}

        def single(batch: int) -> tuple[dict, Path]:
            if batch not in one_gpu:
                one_gpu[batch] = train(args, Path(tmp), batch, None)
            return one_gpu[batch]

        for n in (n for n in counts if n <= available):
            record, _ = single(args.batch)
            if n == 1:
                runs.append(("one GPU", 1, args.batch, record, None))
                continue
            same_model, same_weights = single(args.batch * n)
            runs.append((f"one GPU at batch {args.batch * n}", 1, args.batch * n, same_model, None))
            record, weights = train(args, Path(tmp), args.batch, n)
            runs.append((f"--gpus {n}", n, args.batch, record, relative_difference(weights, same_weights)))

    command = shlex.join(["python3", *sys.argv])
    records = [record for _, _, _, record, _ in runs]
    base = next((r for engine, _, _, r, _ in runs if engine == "one GPU"), None)
    extra = [report.workload_line(records[:1]) or "", "Epoch: the run record's median epoch (CUDA events, rank 0); "
             "samples/s: 60000 / epoch; weights: ‖a − b‖/‖b‖ (float64) against one GPU at the combined batch"]
    if skipped:
        extra.append(f"Left out: --gpus {', '.join(map(str, skipped))} (this host has {available} GPU(s))")
    date = report.utc_now()
    items = report.provenance_lines(records, command, date) + extra  # NCCL's version from the --gpus runs
    lines = ["# Data-parallel scaling (run --gpus N, NCCL all-reduce in the step graph)", "",
             *(f"- {item}" for item in items), "",
             "| run | GPUs | batch per GPU | combined batch | epoch ms | samples/s | vs one GPU at batch "
             f"{args.batch} | test acc | weights vs one GPU at the combined batch |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for engine, n, per_gpu, record, diff in runs:
        ms = record["epoch_ms"]
        samples = record["data"]["train"] if record.get("data") else 60000
        speed = f"{base['epoch_ms'] / ms:.2f}×" if base else "—"
        lines.append(f"| {engine} | {n} | {per_gpu} | {per_gpu * n} | {ms:.2f} | {samples / ms * 1e3:,.0f} | {speed} | "
                     f"{100 * record['test_accuracy']:.2f}% | {'—' if diff is None else f'{diff:.2e}'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(
            {"date": date, "revision": (records[0]["environment"].get("revision") if records else None),
             "command": command, "records": records}, indent=2, default=str))


def train(args, tmp: Path, batch: int, gpus: int | None) -> tuple[dict, Path]:
    """One `graphtrain run` process; its record and its saved weights."""
    name = f"b{batch}" + (f"-g{gpus}" if gpus else "")
    record_path, weights_path = tmp / f"{name}.json", tmp / f"{name}.safetensors"
    command = [sys.executable, "-m", "graphtrain", "run", "--stage", "graphs", "--preset", args.preset,
               "--hidden", args.hidden, "--batch", str(batch), "--epochs", str(args.epochs),
               "--json", str(record_path), "--save", str(weights_path)]
    if gpus:
        command += ["--gpus", str(gpus)]
    print("+", shlex.join(command[1:]), file=sys.stderr, flush=True)
    subprocess.run(command, check=True)
    return json.loads(record_path.read_text()), weights_path


def relative_difference(a: Path, b: Path) -> float:
    """‖a − b‖ / ‖b‖ over every parameter of two saved models, in float64."""
    layers_a, layers_b = model_io.load(a).layers, model_io.load(b).layers
    flat_a = np.concatenate([x.astype(np.float64).ravel() for layer in layers_a for x in (layer.w, layer.b)
                             if x is not None])
    flat_b = np.concatenate([x.astype(np.float64).ravel() for layer in layers_b for x in (layer.w, layer.b)
                             if x is not None])
    return float(np.linalg.norm(flat_a - flat_b) / np.linalg.norm(flat_b))


if __name__ == "__main__":
    main()
