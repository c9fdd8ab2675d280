#!/usr/bin/env python3
"""Time to result: each row's `graphtrain run` as a process of its own, timed from outside.

    python3 scripts/benchmarks/wall.py [--stages persistent,graphs,device-loop,numpy] [--peers torch-graph,jax-scan]
                            [--preset jhu] [--epochs N] [--repeat 3] [--cold] [--out results]

For each row, `python -m graphtrain run --stage ROW --json F` runs `--repeat` times; the wall time
of each process, from before it is started to after it has exited, is measured here, and the
record's `phases` (graphtrain.phases: the same process's time from its start, by phase) are read
back. Warm (the default): one untimed run first fills the kernel and dataset caches. `--cold`:
each timed run gets an empty kernel cache of its own (GRAPHTRAIN_CACHE), the dataset cache is
left as it is. Writes results/wall-<preset>[-epochsN][-cold]-<gpu>.md and .json: the median
wall, its range, the phases of the median run, and how far their sum is from the wall.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from graphtrain import report
from graphtrain.files import write_atomic, write_json
from graphtrain.phases import NAMES

DEFAULT_STAGES = "persistent,device-loop,graphs,numpy"


def git_revision() -> str:
    """GRAPHTRAIN_REVISION where set (a copy of a tree, which git would place in whatever checkout
    holds the copy), else the checkout's commit (with -dirty when files differ from it), else
    "unknown"."""
    if os.environ.get("GRAPHTRAIN_REVISION"):
        return os.environ["GRAPHTRAIN_REVISION"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_once(row: str, args: argparse.Namespace, cache: str | None) -> dict:
    """One process: its record (with `wall_ms` added), or a failed row's dict with the error."""
    with tempfile.TemporaryDirectory() as scratch:
        record_path = Path(scratch) / "record.json"
        command = [sys.executable, "-m", "graphtrain", "run", "--stage", row, "--preset", args.preset,
                   "--json", str(record_path)]
        if args.epochs is not None:
            command += ["--epochs", str(args.epochs)]
        env = dict(os.environ)
        if cache is not None:
            env["GRAPHTRAIN_CACHE"] = cache
        start = time.perf_counter()
        done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wall_ms = (time.perf_counter() - start) * 1e3
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines()
            return {"stage": row, "kind": "peer" if row in args.peer_list else "stage",
                    "error": lines[-1] if lines else f"exit status {done.returncode}", "skipped": False}
        record = json.loads(record_path.read_text())
    record["wall_ms"] = wall_ms
    return record


def time_row(row: str, args: argparse.Namespace) -> dict:
    """The row's median run (by wall) with the wall of every run, or the first failure."""
    if not args.cold:
        first = run_once(row, args, None)  # fills the caches
        if "error" in first:
            return first
    runs = []
    for _ in range(args.repeat):
        if args.cold:
            with tempfile.TemporaryDirectory() as cache:
                runs.append(run_once(row, args, cache))
        else:
            runs.append(run_once(row, args, None))
        if "error" in runs[-1]:
            return runs[-1]
        print(f"{row}: {runs[-1]['wall_ms']:.0f} ms", file=sys.stderr, flush=True)
    walls = [run["wall_ms"] for run in runs]
    median = sorted(runs, key=lambda run: run["wall_ms"])[len(runs) // 2]
    return {**median, "wall_ms_run": median["wall_ms"], "wall_ms_all": walls, "wall_ms_min": min(walls),
            "wall_ms_max": max(walls), "wall_ms": statistics.median(walls)}


def phases_gap(record: dict) -> float | None:
    """(sum of the phases − the process's wall) / the wall, of the median run."""
    phases = record.get("phases")
    if not phases:
        return None
    return (sum(phases.values()) - record["wall_ms_run"]) / record["wall_ms_run"]


def markdown(records: list[dict], args: argparse.Namespace, command: str, revision: str, date: str) -> str:
    length = f"{args.epochs} epoch(s)" if args.epochs is not None else "the preset's length"
    cache = ("an empty kernel cache for each run (GRAPHTRAIN_CACHE), the dataset cache warm" if args.cold
             else "warm kernel and dataset caches (one untimed run first)")
    items = [f"Date: {date}", f"Revision: {revision}", f"Command: `{command}`", *report.environment_lines(records)]
    workload = report.workload_line(records)
    if workload:
        items.append(workload)
    items.append(f"Timing: wall time of each `graphtrain run` process, from before it is started to after it "
                 f"exits, {args.repeat} runs per row, {length}, {cache}; phases from the median run's record")
    lines = [f"# graphtrain time to result: {args.preset}", "", *(f"- {item}" for item in items), ""]
    columns = ["row", "wall ms", "range", "Σ phases", "wall − Σ", "Δ", *(name.replace("_", " ") for name in NAMES),
               "epoch ms", "test acc"]
    rows = []
    for record in records:
        name = f"{record['stage']} (peer)" if record.get("kind") == "peer" else record["stage"]
        if "error" in record:
            rows.append([name, "failed: " + record["error"], *[report.DASH] * (len(columns) - 2)])
            continue
        phases = record.get("phases") or {}
        gap = phases_gap(record)
        rows.append([name, f"{record['wall_ms']:.0f}", f"{record['wall_ms_min']:.0f}–{record['wall_ms_max']:.0f}",
                     f"{sum(phases.values()):.0f}" if phases else report.DASH,
                     f"{record['wall_ms_run'] - sum(phases.values()):.0f}" if phases else report.DASH,
                     report.DASH if gap is None else f"{100 * gap:+.1f}%",
                     *(f"{phases[name]:.0f}" if name in phases else report.DASH for name in NAMES),
                     report.fmt_ms(record.get("epoch_ms")), report.fmt_accuracy(record.get("test_accuracy"))])
    lines += report.markdown_table(columns, rows) + [""]
    lines += ["wall ms: median process wall; range: its lowest and highest; Σ phases: the median run's phases "
              "(graphtrain.phases, from the process's start as the kernel records it to the record's writing, the "
              "GPU's release in `exit` included); wall − Σ (ms) and Δ (share of the wall): what the phases leave "
              "out of that run's wall: the process's creation before its start, the record's writing, and what "
              "the process's end costs after its last line (scripts/probes/exit_cost.py).", ""]
    ladder = report.ladder_rows(records)
    columns = report.ladder_columns(ladder)
    lines += ["## As the ladder shows it", "", *report.markdown_table(
        columns, [report.ladder_cells(row, columns) for row in ladder]), "", report.ladder_legend(ladder), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default=DEFAULT_STAGES)
    parser.add_argument("--peers", default="")
    parser.add_argument("--preset", default="jhu")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="An empty kernel cache for every timed run.")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--tag", default="", help="Added to the file names (e.g. the tree measured).")
    args = parser.parse_args()
    args.peer_list = [p for p in args.peers.split(",") if p]
    rows = [s for s in args.stages.split(",") if s] + args.peer_list
    command = shlex.join(["python3", "scripts/benchmarks/wall.py", *sys.argv[1:]])
    revision, date = git_revision(), report.utc_now()
    records = [time_row(row, args) for row in rows]
    label = (args.preset + (f"-epochs{args.epochs}" if args.epochs is not None else "") + ("-cold" if args.cold else "")
             + ("-peers" if rows == args.peer_list else ""))  # a peers-only table beside the rungs' one
    stem = f"wall-{label}-{report.device_tag(records)}" + (f"-{args.tag}" if args.tag else "")
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / f"{stem}.json", {"report": "wall", "label": label, "command": command, "date": date,
                                           "revision": revision, "records": records})
    text = markdown(records, args, command, revision, date)
    write_atomic(args.out / f"{stem}.md", text)
    print(text)


if __name__ == "__main__":
    main()
