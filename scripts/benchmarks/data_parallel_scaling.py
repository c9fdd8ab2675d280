"""Data-parallel scaling: `run --gpus N` (N = 2, 4; batch B per GPU) against one GPU at batch B
(the same work per GPU) and one GPU at the combined batch N·B (the same model and updates), on
the graphs rung, for two models: the 784³ MLP (jhu, SGD) and the cnn (`--preset speedrun`'s
layers, Adam and its one-cycle schedule); one table per model, one row per run, each run a
process of its own.

    python3 scripts/benchmarks/data_parallel_scaling.py --out-dir results/multi-gpu

writes data-parallel-jhu-mlp784x3-speedrun-cnn-<gpu>.md (and .json), <gpu> the GPU the runs
saw ("h100").

Epoch time: the run record's median epoch (CUDA events on rank 0; every rank waits for the
others in each step's all-reduce). Weights: each data-parallel run's trained weights against
the one-GPU run at its combined batch, ‖a − b‖ / ‖b‖ over all parameters in float64. The MLP
runs are `graphtrain run` processes (their weights from --save); the cnn, which `run --save`
does not save, runs in a process of this script (`--cnn-run`) that trains it as `run` does
(graphtrain.data_parallel.train for --gpus, run_stage for one GPU) and keeps its record and
weights. Counts of GPUs beyond what this host has are left out, and the table says so.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphtrain import model_io, report


@dataclass(frozen=True)
class Workload:
    """One model's runs: `graphtrain run --stage graphs` of a preset (and the MLP's hidden sizes)."""

    model: str  # "mlp" or "cnn"
    preset: str
    epochs: int
    hidden: str | None = None  # the MLP's

    def config(self):
        from graphtrain.config import parse_hidden, preset

        cfg = preset(self.preset).replace(epochs=self.epochs)
        return cfg.replace(hidden=parse_hidden(self.hidden)) if self.hidden else cfg

    def label(self) -> str:
        from graphtrain.ladder import run_label

        cfg = self.config()
        return f"{cfg.preset}-cnn" if cfg.model == "cnn" else run_label(cfg)

    def train(self, tmp: Path, batch: int, gpus: int | None) -> tuple[dict, Path]:
        """One run in a process of its own: its record and its saved weights."""
        name = f"{self.model}-b{batch}" + (f"-g{gpus}" if gpus else "")
        record_path = tmp / f"{name}.json"
        if self.model == "cnn":
            weights_path = tmp / f"{name}.npy"
            command = [sys.executable, __file__, "--cnn-run", self.preset, str(batch), str(self.epochs),
                       str(gpus or 0), str(record_path), str(weights_path)]
        else:
            weights_path = tmp / f"{name}.safetensors"
            command = [sys.executable, "-m", "graphtrain", "run", "--stage", "graphs", "--preset", self.preset,
                       "--hidden", self.hidden, "--batch", str(batch), "--epochs", str(self.epochs),
                       "--json", str(record_path), "--save", str(weights_path)]
            if gpus:
                command += ["--gpus", str(gpus)]
        print("+", shlex.join(command[1:]), file=sys.stderr, flush=True)
        subprocess.run(command, check=True)
        return json.loads(record_path.read_text()), weights_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="1,2,4", help="GPU counts to run (1: one GPU, no NCCL)")
    parser.add_argument("--batch", type=int, default=128, help="batch per GPU")
    parser.add_argument("--models", default="mlp,cnn", help="which tables: mlp, cnn or both")
    parser.add_argument("--hidden", default="784,784,784", help="the MLP's hidden sizes")
    parser.add_argument("--preset", default="jhu", help="the MLP's preset")
    parser.add_argument("--epochs", type=int, default=20, help="the MLP's epochs")
    parser.add_argument("--cnn-preset", default="speedrun")
    parser.add_argument("--cnn-epochs", type=int, default=5,
                        help="the cnn's epochs (its one-cycle schedule spans them; the median of 5 epochs times it)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="write data-parallel-<workloads>-<gpu>.md and .json here (else printed only)")
    parser.add_argument("--cnn-run", nargs=6, default=None, help=argparse.SUPPRESS,
                        metavar=("PRESET", "BATCH", "EPOCHS", "GPUS", "RECORD", "WEIGHTS"))
    args = parser.parse_args()
    if args.cnn_run is not None:
        cnn_run(*args.cnn_run)
        return
    counts = sorted({int(n) for n in args.gpus.split(",")})
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - {"mlp", "cnn"})
    if unknown or not models:
        sys.exit(f"error: --models takes mlp and cnn, got {args.models!r}")
    workloads = [Workload("mlp", args.preset, args.epochs, args.hidden) if m == "mlp"
                 else Workload("cnn", args.cnn_preset, args.cnn_epochs) for m in models]

    from graphtrain.errors import GpuUnavailableError
    from graphtrain.libs import cuda

    try:
        available = cuda.device_count()
    except GpuUnavailableError as exc:
        sys.exit(f"error: the scaling table needs GPUs: {exc}")
    skipped = [n for n in counts if n > available]
    tables: list[tuple[Workload, list]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for workload in workloads:
            tables.append((workload, scale(workload, Path(tmp), args.batch, [n for n in counts if n <= available])))

    command = shlex.join(["python3", *sys.argv])
    records = [record for _, runs in tables for _, _, _, record, _ in runs]
    extra = ["Epoch: the run record's median epoch (CUDA events, rank 0); samples/s: training samples / epoch; "
             "weights: ‖a − b‖/‖b‖ (float64) against one GPU at the combined batch"]
    if skipped:
        extra.append(f"Left out: --gpus {', '.join(map(str, skipped))} (this host has {available} GPU(s))")
    date = report.utc_now()
    items = report.provenance_lines(records, command, date) + extra  # NCCL's version from the --gpus runs
    lines = ["# Data-parallel scaling (run --gpus N, NCCL all-reduce in the step graph)", "",
             *(f"- {item}" for item in items), ""]
    for workload, runs in tables:
        lines += table(workload, runs, args.batch)
    text = "\n".join(lines)
    print(text)
    if args.out_dir is not None:
        label = "-".join(workload.label() for workload, _ in tables)
        out = args.out_dir / f"data-parallel-{label}-{report.device_tag(records)}.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps(
            {"date": date, "revision": (records[0]["environment"].get("revision") if records else None),
             "command": command, "records": records}, indent=2, default=str))
        print(f"written: {out} and {out.with_suffix('.json').name}", file=sys.stderr)


def scale(workload: Workload, tmp: Path, batch: int, counts: list[int]) -> list:
    """(run, GPUs, batch per GPU, record, weights difference) for each GPU count that runs."""
    runs: list[tuple[str, int, int, dict, float | None]] = []
    one_gpu: dict[int, tuple[dict, Path]] = {}

    def single(rows: int) -> tuple[dict, Path]:
        if rows not in one_gpu:
            one_gpu[rows] = workload.train(tmp, rows, None)
        return one_gpu[rows]

    for n in counts:
        record, _ = single(batch)
        if n == 1:
            runs.append(("one GPU", 1, batch, record, None))
            continue
        same_model, same_weights = single(batch * n)
        runs.append((f"one GPU at batch {batch * n}", 1, batch * n, same_model, None))
        record, weights = workload.train(tmp, batch, n)
        runs.append((f"--gpus {n}", n, batch, record, relative_difference(weights, same_weights)))
    return runs


def table(workload: Workload, runs: list, batch: int) -> list[str]:
    """The model's heading, its workload line and its table."""
    records = [record for _, _, _, record, _ in runs]
    base = next((r for engine, _, _, r, _ in runs if engine == "one GPU"), None)
    lines = [f"## {workload.model}: {workload.label()}", ""]
    if records:
        lines += [f"- {cnn_workload_line(records[0]) if workload.model == 'cnn' else report.workload_line(records)}"]
        if records[0].get("note"):
            lines.append(f"- Precision: {records[0]['note']}")
        lines.append("")
    lines += ["| run | GPUs | batch per GPU | combined batch | epoch ms | samples/s | vs one GPU at batch "
              f"{batch} | last train loss | test acc | weights vs one GPU at the combined batch |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for engine, n, per_gpu, record, diff in runs:
        ms = record["epoch_ms"]
        samples = record["data"]["train"] if record.get("data") else 60000
        speed = f"{base['epoch_ms'] / ms:.2f}×" if base else "—"
        loss = next((e["train_loss"] for e in reversed(record["epochs"]) if e.get("train_loss") is not None), None)
        lines.append(f"| {engine} | {n} | {per_gpu} | {per_gpu * n} | {ms:.2f} | {samples / ms * 1e3:,.0f} | {speed} | "
                     f"{'—' if loss is None else f'{loss:.4f}'} | {100 * record['test_accuracy']:.2f}% | "
                     f"{'—' if diff is None else f'{diff:.2e}'} |")
    return lines + ["", "The weights column compares the whole runs: the ranks sum in another order than one GPU (each "
                    "rank's rows, then the all-reduce) and training carries those roundings on, Adam's most of all "
                    "(its first updates are ±lr whatever a gradient's size, so a near-zero gradient's sign decides). "
                    "Equality within fp32 rounding is what tests/test_data_parallel_gpu.py checks, over a few steps.",
                    ""]


def cnn_workload_line(record: dict) -> str:
    """The cnn's layers and recipe, from a run record's config."""
    cfg = record["config"]
    convs = ", ".join(f"conv {c}×{k}×{k}" for c, k in cfg["conv"])
    head = "→".join(["flatten", *(str(d) for d in cfg["hidden"]), str(cfg["classes"])])
    optimizer = cfg["optimizer"] + (f" (β {cfg['betas'][0]:g}, {cfg['betas'][1]:g})" if "adam" in cfg["optimizer"]
                                    else "")
    data = record.get("data") or {}
    return (f"Workload: {convs} (each max-pool 2, ReLU), {head}; {optimizer}, {cfg['schedule']} schedule, "
            f"lr {cfg['lr']:g} peak, {cfg['epochs']} epochs, seed {cfg['seed']}, data {data.get('name', cfg['dataset'])}")


def cnn_run(preset_name: str, batch: str, epochs: str, gpus: str, record_path: str, weights_path: str) -> None:
    """One cnn run as `graphtrain run --stage graphs --preset P --batch B --epochs E [--gpus N]`
    trains it: its record (JSON) and its trained parameters (float32, flat, in order)."""
    from graphtrain import data as data_mod
    from graphtrain import data_parallel
    from graphtrain.config import preset
    from graphtrain.plan import RunPlan
    from graphtrain.stages import get_stage
    from graphtrain.sweep import DataSource
    from graphtrain.training import run_stage

    n = int(gpus)
    config = preset(preset_name).replace(batch=int(batch) * max(n, 1), epochs=int(epochs))
    if n:
        data_parallel.check_request(n, "graphs", config)
        ranks = data_parallel.require(n)
    data = data_mod.load(config.dataset)
    plan = RunPlan.for_data(config, data)
    if n:
        record = data_parallel.train(plan, ranks, DataSource(config.dataset))
    else:
        record = run_stage(get_stage("graphs"), plan, data)
    record.command = shlex.join(["python3", *sys.argv])
    Path(record_path).write_text(json.dumps(record.to_json(), indent=2, default=str))
    np.save(weights_path, np.concatenate([a.astype(np.float32).ravel() for layer in record.params
                                          for a in (layer.w, layer.b) if a is not None]))


def flat_weights(path: Path) -> np.ndarray:
    """Every parameter of a run, in order, float64: a saved model (.safetensors) or a cnn run's .npy."""
    if path.suffix == ".npy":
        return np.load(path).astype(np.float64)
    return np.concatenate([x.astype(np.float64).ravel() for layer in model_io.load(path).layers
                           for x in (layer.w, layer.b) if x is not None])


def relative_difference(a: Path, b: Path) -> float:
    """‖a − b‖ / ‖b‖ over every parameter of two runs, in float64."""
    flat_a, flat_b = flat_weights(a), flat_weights(b)
    return float(np.linalg.norm(flat_a - flat_b) / np.linalg.norm(flat_b))


if __name__ == "__main__":
    main()
