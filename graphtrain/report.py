"""Ladder and sweep reports: Markdown, JSON and plots from run records.

Everything here is pure: it reads run records in their JSON form (`to_json()` of the records in
graphtrain.record, or a results/ file read back) and writes files. Nothing touches a GPU, so the
whole module is tested on synthetic records.

Speed-ups are ratios of median epoch times (the seeds' protocol):

    speed-up over the rung before  = prev.epoch_ms / row.epoch_ms   (consecutive successful stages)
    speed-up over `baseline`       = baseline.epoch_ms / row.epoch_ms

Peers are not rungs of the ladder, so they get no "rung before", only the baseline ratio.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from graphtrain import terminal
from graphtrain.errors import INSTALL_HINTS
from graphtrain.files import write_atomic, write_json
from graphtrain.terminal import Log

DASH = "—"



# --------------------------------------------------------------------------------------------
# Rows: what every table shows, computed once
# --------------------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    kind: str  # "stage" or "peer"
    status: str  # "ok", "failed" or "skipped"
    epoch_ms: float | None = None
    total_ms: float | None = None
    vs_prev: float | None = None
    vs_baseline: float | None = None
    test_accuracy: float | None = None
    train_loss: float | None = None
    note: str = ""


def is_ok(record: dict) -> bool:
    return "error" not in record and record.get("epoch_ms") is not None


def kind_of(record: dict) -> str:
    return record.get("kind", "stage")


def ladder_rows(records: list[dict]) -> list[Row]:
    """One display row per record, with both speed-ups worked out."""
    baseline = next((r for r in records if r.get("stage") == "baseline" and is_ok(r)), None)
    baseline_ms = baseline["epoch_ms"] if baseline else None
    rows = []
    prev_stage: dict | None = None  # the stage row just before, successful or not
    for record in records:
        kind = kind_of(record)
        if not is_ok(record):
            status = "skipped" if record.get("skipped") else "failed"
            rows.append(Row(record.get("stage", "?"), kind, status, note=record.get("error", "")))
        else:
            ms = record["epoch_ms"]
            vs_prev = None
            if kind == "stage" and prev_stage is not None and is_ok(prev_stage):
                vs_prev = _ratio(prev_stage["epoch_ms"], ms)
            rows.append(Row(
                record["stage"], kind, "ok", epoch_ms=ms, total_ms=record.get("total_ms"),
                vs_prev=vs_prev,
                vs_baseline=_ratio(baseline_ms, ms) if baseline_ms is not None else None,
                test_accuracy=record.get("test_accuracy"), train_loss=record.get("train_loss"),
                note=record.get("note", ""),
            ))
        if kind == "stage":
            prev_stage = record
    return rows


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator and denominator > 0 else None


# --------------------------------------------------------------------------------------------
# Number formatting, shared by Markdown and the rich tables
# --------------------------------------------------------------------------------------------


def fmt_ms(ms: float | None) -> str:
    if ms is None:
        return DASH
    if ms < 10:
        return f"{ms:.3f}"
    if ms < 1000:
        return f"{ms:.2f}"
    return f"{ms:,.0f}"


def fmt_speedup(ratio: float | None) -> str:
    if ratio is None:
        return DASH
    return f"{ratio:.2f}×" if ratio < 100 else f"{ratio:,.0f}×"


def fmt_accuracy(accuracy: float | None) -> str:
    return DASH if accuracy is None else f"{accuracy * 100:.2f}%"


def fmt_loss(loss: float | None) -> str:
    return DASH if loss is None else f"{loss:.4f}"


def row_note(row: Row) -> str:
    if row.status == "ok":
        return row.note
    return f"{row.status}: {row.note}" if row.note else row.status


LADDER_COLUMNS = ("stage", "epoch ms", "total ms", "× prev", "× baseline", "test acc", "train loss",
                  "note")
LADDER_LEGEND = ("epoch ms: median epoch time over the second half of the epochs; total ms: wall time "
                 "of the whole run, setup included; × prev: the rung before's epoch ms over this "
                 "one's (consecutive successful stages); × baseline: `baseline`'s epoch ms over this "
                 "one's; test acc and train loss: after the last epoch.")


def ladder_cells(row: Row) -> list[str]:
    """A row's cells in LADDER_COLUMNS order; a peer's name is marked so it never reads as a rung."""
    name = f"{row.name} (peer)" if row.kind == "peer" else row.name
    return [name, fmt_ms(row.epoch_ms), fmt_ms(row.total_ms), fmt_speedup(row.vs_prev),
            fmt_speedup(row.vs_baseline), fmt_accuracy(row.test_accuracy), fmt_loss(row.train_loss),
            row_note(row)]


# --------------------------------------------------------------------------------------------
# The header block: where and when it ran
# --------------------------------------------------------------------------------------------


def _known(value) -> bool:
    return value is not None and str(value) not in ("", "None", "unknown")


def _first(records: list[dict], key: str, kind: str | None = None):
    """The first known value of environment[key] over the records (of one kind, if given)."""
    for record in records:
        if kind is not None and kind_of(record) != kind:
            continue
        value = (record.get("environment") or {}).get(key)
        if _known(value):
            return value
    return None


def _joined(parts: list[tuple[str, object]]) -> str:
    return ", ".join(f"{label} {value}" for label, value in parts if _known(value))


def environment_lines(records: list[dict]) -> list[str]:
    """Device, driver and library versions as Markdown list items, from the records' environments.

    The device comes from the first record that ran on a GPU. Library versions are gathered per
    source, because PyTorch and JAX bring their own CUDA libraries, which need not match the
    ones graphtrain's stages load.
    """
    lines = []
    gpu_record = next((r for r in records if _known((r.get("environment") or {}).get("gpu"))), None)
    if gpu_record is None:
        lines.append("Device: no GPU (CPU only)")
    else:
        env = gpu_record["environment"]
        cc = env.get("compute_capability")
        lines.append(f"Device: {env['gpu']}" + (f" (compute capability {cc})" if _known(cc) else ""))
    driver = _first(records, "driver")
    driver_cuda = _first(records, "driver_cuda") or _first(records, "cuda_driver")
    if driver or driver_cuda:
        lines.append(f"Driver: {driver or 'unknown'}" + (f" (CUDA {driver_cuda})" if driver_cuda else ""))
    ours = _joined([(name, _first(records, key, "stage")) for name, key in (
        ("CUDA runtime", "runtime"), ("cuBLAS", "cublas"), ("cuDNN", "cudnn"), ("NVRTC", "nvrtc"),
        ("cuda-bindings", "cuda_bindings"))])
    if ours:
        lines.append(f"graphtrain stages: {ours}")
    torch_version = _first(records, "torch")
    if torch_version:
        extra = _joined([("CUDA", _first(records, "torch_cuda")), ("cuDNN", _first(records, "torch_cudnn"))])
        lines.append(f"PyTorch: {torch_version}" + (f" ({extra})" if extra else ""))
    jax_version = _first(records, "jax")
    if jax_version:
        extra = _joined([("jaxlib", _first(records, "jaxlib")), ("CUDA", _first(records, "jax_cuda")),
                         ("cuDNN", _first(records, "jax_cudnn"))])
        lines.append(f"JAX: {jax_version}" + (f" ({extra})" if extra else ""))
    cpu, count = _first(records, "cpu"), _first(records, "cpu_count")
    host = _joined([("Python", _first(records, "python")), ("NumPy", _first(records, "numpy"))])
    if cpu or host:
        cpu_text = f"{cpu} ({count} threads)" if cpu and count else (cpu or "")
        lines.append("Host: " + ", ".join(part for part in (cpu_text, host) if part))
    return lines


def workload_line(records: list[dict], sweep: bool = False) -> str | None:
    record = next((r for r in records if r.get("config")), None)
    if record is None:
        return None
    cfg = record["config"]
    if sweep:
        model = f"{cfg['in_features']}→H×{max(len(cfg.get('hidden') or []), 1)}→{cfg['classes']} ReLU"
    else:
        model = "→".join(str(d) for d in cfg.get("dims", []))
        model += " softmax regression" if not cfg.get("hidden") else " ReLU MLP"
    length = f"{cfg['epochs']} epochs" if cfg.get("epochs") is not None else f"{cfg['steps']} steps"
    parts = [model, "bias" if cfg.get("bias") else "no bias", f"batch {cfg['batch']}", length,
             f"lr {cfg['lr']}", f"seed {cfg['seed']}"]
    data = record.get("data")
    if data:
        parts.append(f"data {data['name']} ({data['train']} train / {data['test']} test)")
    else:
        parts.append(f"data {cfg.get('dataset')}")
    return "Workload: " + ", ".join(parts)


TIMING_LINE = ("Timing: median epoch time over the second half of the epochs (CUDA events on the GPU, "
               "perf_counter on the CPU), after a warm-up; total wall time includes setup "
               "(compilation, uploads, warm-up, graph capture)")


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _header(title: str, records: list[dict], date: str, sweep: bool = False) -> list[str]:
    items = [f"Date: {date}", *environment_lines(records)]
    workload = workload_line(records, sweep)
    if workload:
        items.append(workload)
    items.append(TIMING_LINE)
    return [f"# {title}", "", *(f"- {item}" for item in items), ""]


def _plots_and_command(heading: str, images, plot_note: str | None, command: str) -> list[str]:
    """The report's end: its plots (or why there are none), then the command that made it."""
    if images:
        lines = [f"## {heading}", ""] + [f"![{Path(name).stem}]({name})" for name in images] + [""]
    else:
        lines = [f"{heading}: {plot_note}", ""] if plot_note else []
    return lines + _command_block(command)


def _command_block(command: str) -> list[str]:
    return ["## Command", "", "```sh", command, "```", ""]


def _md_cell(text: str) -> str:
    # A pipe would end the cell and a newline the row.
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(columns, rows) -> list[str]:
    lines = ["| " + " | ".join(_md_cell(c) for c in columns) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|"]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return lines


# --------------------------------------------------------------------------------------------
# The ladder
# --------------------------------------------------------------------------------------------


def ladder_markdown(records: list[dict], label: str, command: str, date: str | None = None,
                    images: list[str] | None = None, plot_note: str | None = None) -> str:
    """The ladder report: header, table, plots (or why there are none) and the exact command."""
    lines = _header(f"graphtrain ladder: {label}", records, date or utc_now())
    table = markdown_table(LADDER_COLUMNS, [ladder_cells(row) for row in ladder_rows(records)])
    # The note column is the last one; left-align it like the name.
    table[1] = table[1].rsplit("|", 2)[0] + "|---|"
    lines += table + [""]
    lines += [LADDER_LEGEND, ""]
    lines += _plots_and_command("Plots", images, plot_note, command)
    return "\n".join(lines)


def plot_ladder_time(records: list[dict], path: Path) -> None:
    """Median epoch time per successful row, horizontal bars on a log scale, fastest at the bottom."""
    plt = _pyplot()
    rows = [r for r in ladder_rows(records) if r.status == "ok"]
    fig, ax = plt.subplots(figsize=(8, 0.45 * max(len(rows), 1) + 1.5))
    names = [f"{r.name} (peer)" if r.kind == "peer" else r.name for r in rows]
    times = [r.epoch_ms for r in rows]
    colors = ["tab:orange" if r.kind == "peer" else "tab:blue" for r in rows]
    ax.barh(range(len(rows)), times, color=colors)
    ax.set_yticks(range(len(rows)), names)
    ax.invert_yaxis()  # ladder order top to bottom
    ax.set_xscale("log")
    _plain_log_ticks(ax.xaxis)
    for i, ms in enumerate(times):
        ax.annotate(f" {fmt_ms(ms)} ms", (ms, i), va="center", fontsize=8)
    if times:
        ax.set_xlim(min(times) / 2, max(times) * 4)  # room for the labels
    ax.set_xlabel("median epoch time, ms (log scale)")
    ax.set_title("Epoch time per stage (blue) and peer (orange)")
    ax.grid(axis="x", which="both", alpha=0.3)
    _save(fig, path)


def plot_ladder_loss(records: list[dict], path: Path) -> None:
    """Train loss per epoch of every successful row, overlaid: same init and order, same curve."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    styles = ["-", "--", "-.", ":"]
    for i, record in enumerate(r for r in records if is_ok(r)):
        points = [(e["epoch"], e["train_loss"]) for e in record.get("epochs", [])
                  if e.get("train_loss") is not None]
        if not points:
            continue
        xs, ys = zip(*points)
        name = record["stage"] + (" (peer)" if kind_of(record) == "peer" else "")
        ax.plot(xs, ys, styles[i % len(styles)], marker="o", markersize=3, label=name, alpha=0.8)
    ax.set_xlabel("epoch")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("mean train loss over the epoch (log scale)")
    ax.set_yscale("log")  # late epochs differ by factors, not by a constant
    ax.set_title("Train loss per epoch (where measured)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    _save(fig, path)


def _write_report(kind: str, records: list[dict], label: str, out_dir, command: str, plots,
                  markdown, log: Log | None, date: str | None) -> list[Path]:
    """<kind>-<label>.md and .json, and the plots when matplotlib is there; returns the paths."""
    log = log or terminal.log
    out_dir = Path(out_dir)
    date = date or utc_now()
    images, plot_note = _write_plots(records, out_dir, plots, log)
    stem = f"{kind}-{label}"
    json_path = out_dir / f"{stem}.json"
    write_json(json_path, {"report": kind, "label": label, "command": command, "date": date,
                           "records": records})
    md_path = out_dir / f"{stem}.md"
    write_atomic(md_path, markdown(records, label, command, date, images, plot_note))
    return [md_path, json_path, *(out_dir / name for name in images)]


def write_ladder(records: list[dict], label: str, out_dir, command: str,
                 log: Log | None = None, date: str | None = None) -> list[Path]:
    """Write ladder-<label>.md and .json, and with matplotlib the -time and -loss plots."""
    plots = [(f"ladder-{label}-time.png", plot_ladder_time), (f"ladder-{label}-loss.png", plot_ladder_loss)]
    return _write_report("ladder", records, label, out_dir, command, plots, ladder_markdown, log, date)


# --------------------------------------------------------------------------------------------
# The sweep: time against hidden size
# --------------------------------------------------------------------------------------------


def train_ms(record: dict) -> float | None:
    """Training time: the sum of the timed epochs (setup, compilation and warm-up excluded)."""
    if not is_ok(record):
        return None
    return sum(e["ms"] for e in record.get("epochs", []))


def sweep_grid(records: list[dict]) -> tuple[list[int], list[str], dict]:
    """(hidden sizes, row names in first-seen order, {(H, name): record})."""
    sizes, names, cells = [], [], {}
    for record in records:
        size, name = record.get("hidden_size"), record.get("stage", "?")
        if size not in sizes:
            sizes.append(size)
        if name not in names:
            names.append(name)
        cells[size, name] = record
    return sorted(sizes), names, cells


def sweep_cell(record: dict | None, value: Callable[[dict], str]) -> str:
    if record is None:
        return DASH
    if not is_ok(record):
        return "skipped" if record.get("skipped") else "failed"
    return value(record)


def sweep_markdown(records: list[dict], label: str, command: str, date: str | None = None,
                   images: list[str] | None = None, plot_note: str | None = None) -> str:
    lines = _header(f"graphtrain sweep: {label}", records, date or utc_now(), sweep=True)
    sizes, names, cells = sweep_grid(records)
    heads = ["hidden size H", *(f"{n} (peer)" if _is_peer_name(records, n) else n for n in names)]
    tables = [
        ("Training time, ms (sum of the timed epochs)", lambda r: fmt_ms(train_ms(r))),
        ("Median epoch time, ms (second half)", lambda r: fmt_ms(r["epoch_ms"])),
        ("Total wall time, ms (with setup)", lambda r: fmt_ms(r.get("total_ms"))),
        ("Final test accuracy", lambda r: fmt_accuracy(r.get("test_accuracy"))),
    ]
    for title, value in tables:
        rows = [[str(size), *(sweep_cell(cells.get((size, n)), value) for n in names)] for size in sizes]
        lines += [f"## {title}", "", *markdown_table(heads, rows), ""]
    notes = {r["stage"]: r["note"] for r in records if is_ok(r) and r.get("note")}
    if notes:
        lines += ["## Notes", ""] + [f"- {name}: {note}" for name, note in notes.items()] + [""]
    problems = [r for r in records if not is_ok(r)]
    if problems:
        lines += ["## Failed and skipped runs", ""]
        lines += [f"- H={r.get('hidden_size')} {r.get('stage')}: "
                  f"{'skipped' if r.get('skipped') else 'failed'}: {r.get('error', '')}" for r in problems]
        lines.append("")
    lines += _plots_and_command("Plot", images, plot_note, command)
    return "\n".join(lines)


def _is_peer_name(records: list[dict], name: str) -> bool:
    return any(r.get("stage") == name and kind_of(r) == "peer" for r in records)


def plot_sweep(records: list[dict], path: Path) -> None:
    """Training time against hidden size, one line per stage or peer, log-log."""
    plt = _pyplot()
    sizes, names, cells = sweep_grid(records)
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in names:
        points = [(size, train_ms(cells[size, name]) / 1e3) for size in sizes
                  if (size, name) in cells and is_ok(cells[size, name])]
        if points:
            xs, ys = zip(*points)
            peer = _is_peer_name(records, name)
            ax.plot(xs, ys, "--" if peer else "-", marker="o", label=name + (" (peer)" if peer else ""))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _plain_log_ticks(ax.yaxis)
    if sizes:
        ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("hidden size H")
    ax.set_ylabel("training time, s (log scale)")
    ax.set_title("Training time against hidden size")
    ax.grid(which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    _save(fig, path)


def write_sweep(records: list[dict], label: str, out_dir, command: str,
                log: Log | None = None, date: str | None = None) -> list[Path]:
    """Write sweep-<label>.md and .json, and with matplotlib sweep-<label>.png."""
    plots = [(f"sweep-{label}.png", plot_sweep)]
    return _write_report("sweep", records, label, out_dir, command, plots, sweep_markdown, log, date)


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window, work without a display
    import matplotlib.pyplot as plt

    return plt


def matplotlib_missing() -> str | None:
    """None when plots can be drawn, else why not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"not drawn: matplotlib is not installed ({INSTALL_HINTS['plot']})"
    return None


def _write_plots(records, out_dir: Path, plots, log: Log) -> tuple[list[str], str | None]:
    """Draw each (file name, function); returns the names drawn and a note when none could be."""
    missing = matplotlib_missing()
    if missing:
        log(f"graphtrain: plots {missing}")
        return [], missing
    drawn = []
    for name, draw in plots:
        draw(records, out_dir / name)
        drawn.append(name)
    return drawn, None


def _plain_log_ticks(axis) -> None:
    """Label a log axis 1, 2, 5, 10, 20, 50 ... in plain numbers instead of powers like 2×10⁰."""
    from matplotlib.ticker import FuncFormatter

    def label(value, _position) -> str:
        if value <= 0:
            return ""
        mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
        return f"{value:g}" if any(abs(mantissa - m) < 1e-6 for m in (1, 2, 5)) else ""

    axis.set_major_formatter(FuncFormatter(label))
    axis.set_minor_formatter(FuncFormatter(label))


def _save(fig, path: Path) -> None:
    plt = _pyplot()
    try:
        fig.tight_layout()
        write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120))
    finally:
        plt.close(fig)


def read_json(path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))
