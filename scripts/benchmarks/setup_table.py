#!/usr/bin/env python3
"""The table of where `graphtrain run`'s time went, from the records of runs made with --json:
each run's setup_ms (the row's setup, as the footer prints it) and its phases (graphtrain.phases,
ms from the process's start), with the provenance of the first record.

    for i in 1 2 3; do graphtrain run --preset speedrun --stage graphs --json run$i.json; done
    python3 scripts/benchmarks/setup_table.py run1.json run2.json run3.json > results/speedrun-setup-h100.md
"""

from __future__ import annotations

import json
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

from graphtrain import report

PHASES = ("startup", "cuda_context", "data", "kernels", "setup", "training", "evaluation", "writing", "exit")


def main(paths: list[str]) -> None:
    if not paths:
        raise SystemExit("usage: setup_table.py RUN.json [RUN.json ...]")
    records = [json.loads(Path(p).read_text()) for p in paths]
    first = records[0]
    made = min(Path(p).stat().st_mtime for p in paths)  # (the records hold no date: their files' times)
    date = datetime.fromtimestamp(made, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    run = re.sub(r"--json \S+", "--json run$i.json", first["command"])  # (each run's own file)
    command = f"for i in {' '.join(str(i + 1) for i in range(len(records)))}; do {run}; done"
    title = re.sub(r" --json \S+", "", first["command"])
    print(report.script_header(f"`{title}`: where the process's time goes", first["environment"], command, [
        "Warm caches: the kernel cache filled and Python's bytecode cached by an earlier run, as an installed "
        "package has them",
        "Each run's record: its setup_ms (the row's setup, as the run's footer prints it) and its phases "
        "(graphtrain.phases, ms from the process's start)"], date=date))
    print(f"| run | setup_ms (record) | {' | '.join(PHASES)} | test accuracy |")
    print("|---|" + "---|" * (len(PHASES) + 2))
    for i, r in enumerate(records, 1):
        phases = " | ".join(f"{r['phases'].get(p, 0.0):.1f}" for p in PHASES)
        print(f"| {i} | {r['setup_ms']:.1f} | {phases} | {100 * r['test_accuracy']:.2f}% |")


if __name__ == "__main__":
    main(sys.argv[1:])
