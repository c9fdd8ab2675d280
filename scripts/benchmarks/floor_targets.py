#!/usr/bin/env python3
"""Time to result against the host's floor, measured in one call on the same machine.

    python3 scripts/benchmarks/floor_targets.py [--repeat 3] [--out DIR]

The floor is what any Python program that trains on this GPU waits for before its own work: the
interpreter's start (`python3 -c pass`), importing numpy, cuInit (the CUDA bindings imported),
and the primary context, each piece timed as a process of its own (median of `--repeat`, one
untimed run first) and taken as what it adds to the piece before it. Then each row's `graphtrain
run` (jhu) as a process, timed from outside as scripts/benchmarks/wall.py does, against its
target:

    persistent, 20 epochs          <= floor
    graphs, device-loop, 20 epochs <= floor + 200 ms
    persistent, empty kernel cache <= floor + 1000 ms
    numpy, --epochs 1              <= python + numpy + 250 ms

Writes floor-targets-jhu-<gpu>.md and .json into --out (default results/time-to-result).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wall  # noqa: E402: the rows are timed as wall.py times them

from graphtrain import report  # noqa: E402
from graphtrain.files import write_atomic, write_json  # noqa: E402

CUINIT = "from cuda.bindings import driver; driver.cuInit(0)"
PIECES = [  # (name, code, the piece it adds to)
    ("python", "pass", None),
    ("import numpy", "import numpy", "python"),
    ("cuInit", CUINIT, "python"),
    ("primary context", CUINIT + "; _, d = driver.cuDeviceGet(0); _, c = driver.cuDevicePrimaryCtxRetain(d); "
                                 "driver.cuCtxSetCurrent(c)", "cuInit"),
]
# (row, wall.py's options for it, the floor pieces its target adds up, ms beyond them)
TARGETS = [
    ("persistent", {}, ("python", "import numpy", "cuInit", "primary context"), 0),
    ("graphs", {}, ("python", "import numpy", "cuInit", "primary context"), 200),
    ("device-loop", {}, ("python", "import numpy", "cuInit", "primary context"), 200),
    ("persistent", {"cold": True}, ("python", "import numpy", "cuInit", "primary context"), 1000),
    ("numpy", {"epochs": 1}, ("python", "import numpy"), 250),
]


def process_ms(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
    return (time.perf_counter() - start) * 1e3


def floor_pieces(repeat: int) -> dict[str, dict]:
    walls = {}
    for name, code, _ in PIECES:
        process_ms(code)  # the page cache warm
        walls[name] = [process_ms(code) for _ in range(repeat)]
    pieces = {}
    for name, _, base in PIECES:
        median = statistics.median(walls[name])
        pieces[name] = {"wall_ms": median, "all_ms": walls[name],
                        "adds_ms": median - (statistics.median(walls[base]) if base else 0.0)}
    return pieces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results/time-to-result"))
    args = parser.parse_args()
    command = shlex.join(["python3", "scripts/benchmarks/floor_targets.py", *sys.argv[1:]])
    revision, date = wall.git_revision(), report.utc_now()
    pieces = floor_pieces(args.repeat)
    rows = []
    for stage, options, parts, extra in TARGETS:
        row_args = argparse.Namespace(preset="jhu", epochs=options.get("epochs"), cold=options.get("cold", False),
                                      repeat=args.repeat, peer_list=[])
        record = wall.time_row(stage, row_args)
        target = sum(pieces[p]["adds_ms"] for p in parts) + extra
        rows.append({"stage": stage, "options": options, "target_ms": target, "parts": parts, "extra_ms": extra,
                     "record": record})
    records = [row["record"] for row in rows]
    floor = sum(p["adds_ms"] for p in pieces.values())
    lines = ["# graphtrain time to result against the host's floor: jhu", "",
             f"- Date: {date}", f"- Revision: {revision}", f"- Command: `{command}`",
             *(f"- {line}" for line in report.environment_lines(records)),
             f"- Timing: each process's wall from before its start to after its exit, median of {args.repeat} "
             "(one untimed run first); the floor's pieces each a process of its own, as what it adds to the "
             "piece before it", "", "## The floor", "", "| piece | process ms | adds ms | runs |", "|---|---:|---:|---|"]
    for name, _, base in PIECES:
        p = pieces[name]
        lines.append(f"| {name}{f' (over {base})' if base else ''} | {p['wall_ms']:.0f} | {p['adds_ms']:.0f} | "
                     f"{', '.join(f'{t:.0f}' for t in p['all_ms'])} |")
    lines += [f"| **floor** (the four added) | | **{floor:.0f}** | |", "", "## The rows", "",
              "| row | wall ms | range | target ms | target | met | startup | data | kernels | setup | training | "
              "evaluation | writing | exit |", "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        r = row["record"]
        name = row["stage"] + (" (empty kernel cache)" if row["options"].get("cold") else "") + (
            f" --epochs {row['options']['epochs']}" if row["options"].get("epochs") else "")
        what = " + ".join(row["parts"]) + (f" + {row['extra_ms']} ms" if row["extra_ms"] else "")
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | {row['target_ms']:.0f} | {what} | no |" + " |" * 8)
            continue
        phases = r.get("phases") or {}
        met = "yes" if r["wall_ms"] <= row["target_ms"] else f"no (+{r['wall_ms'] - row['target_ms']:.0f} ms)"
        lines.append(f"| {name} | {r['wall_ms']:.0f} | {r['wall_ms_min']:.0f}–{r['wall_ms_max']:.0f} | "
                     f"{row['target_ms']:.0f} | {what} | {met} | " + " | ".join(
                         f"{phases.get(k, 0):.0f}" for k in ("startup", "data", "kernels", "setup", "training",
                                                              "evaluation", "writing", "exit")) + " |")
    lines += ["", "Phases (ms) from the median run's record (graphtrain.phases); `cuda_context` is 0 where CUDA "
              "was ready before the main thread needed it.", ""]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"floor-targets-jhu-{report.device_tag(records)}"
    write_json(args.out / f"{stem}.json", {"report": "floor-targets", "command": command, "date": date,
                                           "revision": revision, "floor": pieces, "floor_ms": floor, "rows": rows})
    text = "\n".join(lines)
    write_atomic(args.out / f"{stem}.md", text)
    print(text)


if __name__ == "__main__":
    main()
