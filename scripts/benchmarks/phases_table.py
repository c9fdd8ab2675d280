#!/usr/bin/env python3
"""Time to result, before and after: each row's phases from two of scripts/benchmarks/wall.py's tables.

    python3 scripts/benchmarks/phases_table.py BEFORE.json AFTER.json [--rows persistent,graphs,numpy]
                                               [--out FILE.md]

For each row, the median run's wall and phases from each table, one line each, then the change:
where the time went before and where it goes now, and whether the phases (graphtrain.phases)
account for the wall (Σ phases against the wall). The epoch time of each, and their ratio: the
work on the time to result must leave the training itself as it was. The header gives both
tables' provenance (date, revision, command), and the device and libraries of the after table.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from graphtrain import report
from graphtrain.files import write_atomic
from graphtrain.phases import NAMES

DEFAULT_ROWS = "persistent,graphs,numpy"


def cells(record: dict | None) -> list[str]:
    """wall, Σ phases, wall − Σ, each phase, epoch ms: of one table's row (dashes where absent)."""
    if record is None or "error" in record:
        return [report.DASH] * (4 + len(NAMES))
    phases = record.get("phases") or {}
    wall = record["wall_ms"]
    total = sum(phases.values()) if phases else None
    return [f"{wall:.0f}", report.DASH if total is None else f"{total:.0f}",
            report.DASH if total is None else f"{wall - total:.0f}",
            *(f"{phases[name]:.0f}" if name in phases else report.DASH for name in NAMES),
            report.fmt_ms(record.get("epoch_ms"))]


def change(before: dict | None, after: dict | None) -> list[str]:
    """after − before of each figure; the epoch time as a ratio."""
    if not before or not after or "error" in before or "error" in after:
        return [report.DASH] * (4 + len(NAMES))
    old, new = before.get("phases") or {}, after.get("phases") or {}

    def diff(a: float | None, b: float | None) -> str:
        return report.DASH if a is None or b is None else f"{b - a:+.0f}"

    old_total, new_total = (sum(old.values()) if old else None), (sum(new.values()) if new else None)
    rest = (None if old_total is None else before["wall_ms"] - old_total,
            None if new_total is None else after["wall_ms"] - new_total)
    ratio = (after["epoch_ms"] / before["epoch_ms"] if before.get("epoch_ms") and after.get("epoch_ms") else None)
    return [diff(before["wall_ms"], after["wall_ms"]), diff(old_total, new_total), diff(*rest),
            *(diff(old.get(name, 0.0 if old else None), new.get(name)) for name in NAMES),
            report.DASH if ratio is None else f"×{ratio:.3f}"]


def by_stage(saved: dict) -> dict[str, dict]:
    return {record["stage"]: record for record in saved["records"]}


def markdown(before: dict, after: dict, before_path: str, after_path: str, rows: list[str], command: str,
             date: str) -> str:
    old, new = by_stage(before), by_stage(after)
    records = [new[row] for row in rows if row in new and "error" not in new[row]]
    items = [f"Date: {date}", f"Revision: {after['revision']} (after); {before['revision']} (before)",
             f"Command: `{command}`", *report.environment_lines(records)]
    workload = report.workload_line(records)
    if workload:
        items.append(workload)
    items += [f"Before: `{before_path}`, {before['date']}, revision {before['revision']}, `{before['command']}`",
              f"After: `{after_path}`, {after['date']}, revision {after['revision']}, `{after['command']}`"]
    lines = [f"# graphtrain time to result, phases before and after: {after.get('label', '')}", "",
             *(f"- {item}" for item in items), ""]
    columns = ["row", "", "wall ms", "Σ phases", "wall − Σ", *(name.replace("_", " ") for name in NAMES), "epoch ms"]
    table = []
    for row in rows:
        table.append([row, "before", *cells(old.get(row))])
        table.append(["", "after", *cells(new.get(row))])
        table.append(["", "change", *change(old.get(row), new.get(row))])
    lines += report.markdown_table(columns, table) + [""]
    lines += ["Each table's median run (by wall) of the row: wall ms, the process from before it starts to after "
              "it exits; Σ phases, the record's phases (graphtrain.phases), which count from the process's start to "
              "the record's writing; wall − Σ, what they leave out (the process's creation before its start, and its "
              "end after the record). A phase a table's records lack shows as —, and as 0 in the change; the "
              "epoch ms change is after over before.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--rows", default=DEFAULT_ROWS)
    parser.add_argument("--out", type=Path, default=None, help="Also write the table here.")
    args = parser.parse_args()
    command = shlex.join(["python3", "scripts/benchmarks/phases_table.py", *sys.argv[1:]])
    text = markdown(report.read_json(args.before), report.read_json(args.after), str(args.before), str(args.after),
                    [row for row in args.rows.split(",") if row], command, report.utc_now())
    if args.out is not None:
        write_atomic(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
