"""`graphtrain compare A.json B.json`: two ladder (or sweep) reports side by side, row by row.

For each row in either report (a stage or peer; in a sweep, a stage or peer at one hidden size):
both epoch times and their ratio A/B (above 1: faster in B), the difference in test accuracy,
and both GPU-busy times where both reports were profiled. Typical use: your GPU's ladder against
the committed H100 one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.markup import escape
from rich.table import Table

from graphtrain import report
from graphtrain.errors import UsageError


@dataclass
class Report:
    path: Path
    kind: str  # "ladder" or "sweep"
    label: str
    date: str
    device: str
    rows: dict[tuple[int | None, str], dict]  # (hidden size or None, row name) -> record


@dataclass
class Pair:
    key: tuple[int | None, str]
    a: dict | None
    b: dict | None

    @property
    def name(self) -> str:
        size, name = self.key
        return name if size is None else f"H={size} {name}"

    def ms(self, record: dict | None) -> float | None:
        return record["epoch_ms"] if record is not None and report.is_ok(record) else None

    @property
    def ratio(self) -> float | None:
        a, b = self.ms(self.a), self.ms(self.b)
        return a / b if a and b else None


def load(path) -> Report:
    """A report written by `graphtrain ladder` or `graphtrain sweep`; UsageError otherwise."""
    path = Path(path)
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path} is not JSON: {exc}") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("records"), list):
        raise UsageError(f"{path} is not a graphtrain ladder or sweep report (no \"records\" list)")
    records = saved["records"]
    device = next((r["environment"]["gpu"] for r in records
                   if isinstance(r, dict) and (r.get("environment") or {}).get("gpu")), "no GPU")
    rows = {}
    for record in records:
        if isinstance(record, dict) and "stage" in record:
            rows[record.get("hidden_size"), record["stage"]] = record
    return Report(path, saved.get("report", "ladder"), saved.get("label", "?"), saved.get("date", "?"),
                  device, rows)


def check_comparable(a: Report, b: Report) -> None:
    """UsageError where the two reports have no row to set side by side: a ladder and a sweep
    (their rows are keyed differently: a ladder's by row, a sweep's by hidden size and row), or
    no row in common."""
    if a.kind != b.kind:
        raise UsageError(f"{a.path} is a {a.kind} and {b.path} a {b.kind}: compare two ladders or "
                         "two sweeps")
    if not set(a.rows) & set(b.rows):
        raise UsageError(f"{a.path} and {b.path} have no row in common")


def pairs(a: Report, b: Report) -> list[Pair]:
    """Every row of A in A's order, then the rows only B has."""
    keys = list(a.rows) + [key for key in b.rows if key not in a.rows]
    return [Pair(key, a.rows.get(key), b.rows.get(key)) for key in keys]


def _state(record: dict | None) -> str | None:
    if record is None:
        return "absent"
    if not report.is_ok(record):
        return "skipped" if record.get("skipped") else "failed"
    return None


def _busy(record: dict | None) -> str:
    profile = (record or {}).get("profile")
    return report.fmt_ms(profile["busy_ms"]) if profile else report.DASH


def cells(pair: Pair) -> list[str]:
    """name, A ms, B ms, A/B, Δ test acc (points), A busy ms, B busy ms."""
    a_text = _state(pair.a) or report.fmt_ms(pair.ms(pair.a))
    b_text = _state(pair.b) or report.fmt_ms(pair.ms(pair.b))
    delta = report.DASH
    if pair.ratio is not None and pair.a.get("test_accuracy") is not None and pair.b.get("test_accuracy") is not None:
        delta = f"{100 * (pair.b['test_accuracy'] - pair.a['test_accuracy']):+.2f}"
    return [pair.name, a_text, b_text, report.fmt_speedup(pair.ratio), delta, _busy(pair.a), _busy(pair.b)]


COLUMNS = ("row", "A epoch ms", "B epoch ms", "A/B", "Δ test acc", "A busy ms", "B busy ms")


def table(a: Report, b: Report) -> Table:
    t = Table(title="graphtrain compare", title_justify="left", caption_justify="left",
              box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)
    for i, column in enumerate(COLUMNS):
        t.add_column(column, justify="left" if i == 0 else "right", no_wrap=True)
    for pair in pairs(a, b):
        t.add_row(*(escape(cell) for cell in cells(pair)))
    notes = [f"A: {a.path} ({a.kind} {a.label}, {a.device}, {a.date})",
             f"B: {b.path} ({b.kind} {b.label}, {b.device}, {b.date})",
             "A/B: A's median epoch time over B's (above 1: faster in B); Δ test acc: B − A, "
             "in points; busy: GPU-busy ms per epoch, where profiled."]
    if a.label != b.label or a.kind != b.kind:
        notes.append(f"note: the workloads differ ({a.kind} {a.label} against {b.kind} {b.label})")
    t.caption = escape("\n".join(notes))
    return t
