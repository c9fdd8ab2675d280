"""Ladder and sweep reports: Markdown, JSON and plots from run records.

Everything here is pure: it reads run records in their JSON form (`to_json()` of the records in
graphtrain.record, or a results/ file read back) and writes files. Nothing touches a GPU, so the
whole module is tested on synthetic records.

Speed-ups are ratios of median epoch times (the seeds' protocol):

    speed-up over the rung before  = prev.epoch_ms / row.epoch_ms   (consecutive successful stages)
    speed-up over `baseline`       = baseline.epoch_ms / row.epoch_ms

Peers are not rungs of the ladder, so they get no "rung before", only the baseline ratio.

Every file opens with its provenance (`provenance_lines`): date, graphtrain's git revision (from the
records' environments), the exact command, device, driver and library versions. The scripts under
scripts/ print theirs through `script_header`.

Files are named <kind>-<workload>-<model>-<GPU>[-partial]: `ladder-jhu-softmax-h100.md` (the
label, `ladder.run_label`, is the workload and the model). The GPU tag keeps ladders of several
GPUs side by side; `-partial` marks a run with failed or skipped rows (or, for
the ladder, a chosen subset of rows), so that it never replaces a complete table.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from graphtrain import terminal
from graphtrain.errors import INSTALL_HINTS
from graphtrain.files import write_atomic, write_json
from graphtrain.profile import HOST_BOUND_IDLE
from graphtrain.terminal import Log, counted

DASH = "—"



# --------------------------------------------------------------------------------------------
# Rows: what every table shows, computed once
# --------------------------------------------------------------------------------------------


@dataclass
class TableRow:
    name: str
    kind: str  # "stage" or "peer"
    status: str  # "ok", "failed" or "skipped"
    epoch_ms: float | None = None
    total_ms: float | None = None
    setup_ms: float | None = None  # compile, allocate, upload, warm up, capture: before the first epoch
    vs_prev: float | None = None
    vs_baseline: float | None = None
    test_accuracy: float | None = None
    train_loss: float | None = None
    note: str = ""
    epoch_ms_min: float | None = None  # over the repeats of the row, when it ran more than once
    epoch_ms_max: float | None = None
    profile: dict | None = None  # graphtrain.profile's summary of the profiled epoch
    precision: str | None = None
    nodes_per_step: int | None = None  # CUDA-graph nodes of one step, for rungs that capture one
    wall_ms: float | None = None  # its `graphtrain run` as a process of its own (scripts/benchmarks/wall.py)


def is_ok(record: dict) -> bool:
    return "error" not in record and record.get("epoch_ms") is not None


def kind_of(record: dict) -> str:
    return record.get("kind", "stage")


def ladder_rows(records: list[dict]) -> list[TableRow]:
    """One display row per record, with both speed-ups worked out."""
    baseline = next((r for r in records if r.get("stage") == "baseline" and is_ok(r)), None)
    baseline_ms = baseline["epoch_ms"] if baseline else None
    rows = []
    prev_stage: dict | None = None  # the stage row just before, successful or not
    for record in records:
        kind = kind_of(record)
        if not is_ok(record):
            status = "skipped" if record.get("skipped") else "failed"
            rows.append(TableRow(record.get("stage", "?"), kind, status, note=record.get("error", "")))
        else:
            ms = record["epoch_ms"]
            vs_prev = None
            if kind == "stage" and prev_stage is not None and is_ok(prev_stage):
                vs_prev = _ratio(prev_stage["epoch_ms"], ms)
            rows.append(TableRow(
                record["stage"], kind, "ok", epoch_ms=ms, total_ms=record.get("total_ms"), setup_ms=record.get("setup_ms"),
                vs_prev=vs_prev,
                vs_baseline=_ratio(baseline_ms, ms) if baseline_ms is not None else None,
                test_accuracy=record.get("test_accuracy"), train_loss=record.get("train_loss"),
                note=record.get("note", ""), epoch_ms_min=record.get("epoch_ms_min"),
                epoch_ms_max=record.get("epoch_ms_max"), profile=record.get("profile"),
                precision=record.get("precision"), nodes_per_step=record.get("nodes_per_step"),
                wall_ms=record.get("wall_ms"),
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


def row_note(row: TableRow) -> str:
    if row.status == "ok":
        return row.note
    return f"{row.status}: {row.note}" if row.note else row.status


def fmt_count(value: float | None) -> str:
    if value is None:
        return DASH
    return f"{value:.0f}" if abs(value - round(value)) < 0.05 else f"{value:.1f}"


def fmt_share(share: float | None) -> str:
    return DASH if share is None else f"{share:.0%}"


def fmt_range(low: float | None, high: float | None) -> str:
    return DASH if low is None or high is None else f"{fmt_ms(low)}–{fmt_ms(high)}"


SPREAD_COLUMN = "epoch ms range"
WALL_COLUMN = "wall ms"
NODES_COLUMN = "nodes / step"
PROFILE_COLUMNS = ("kernels /step", "launches /step", "GPU busy ms", "GPU idle")
LADDER_COLUMNS = ("stage", "epoch ms", "total ms", "setup ms", "× prev", "× baseline", "test acc", "train loss",
                  "note")
LADDER_LEGEND = ("epoch ms: median epoch time over the second half of the epochs; total ms: wall time "
                 "of the whole run, setup included; setup ms: its setup (compiling, "
                 "allocating, uploading, warming up, capturing) before the first epoch; × prev: the rung before's epoch ms over this "
                 "one's (consecutive successful stages); × baseline: `baseline`'s epoch ms over this "
                 "one's; test acc and train loss: after the last epoch.")
SPREAD_LEGEND = ("With --repeat, each row ran several times from a fresh setup: epoch ms is the median "
                 "of the runs' and epoch ms range their lowest and highest.")
WALL_LEGEND = ("wall ms: the row's `graphtrain run` as a process of its own, from its start to its exit "
               "(scripts/benchmarks/wall.py).")
NODES_LEGEND = "nodes / step: the CUDA-graph nodes of one training step, for the rungs that capture one."
PROFILE_LEGEND = ("From one extra epoch under CUPTI: kernels and host launches per training step, "
                  "GPU busy ms per epoch (the union of kernel, memcpy and memset intervals) and the "
                  "share of the median epoch the GPU sat idle.")


def ladder_columns(rows: list[TableRow]) -> list[str]:
    """LADDER_COLUMNS, with the range column after epoch ms when rows were repeated, then before
    the note the nodes column when rows captured a step graph and the profile columns when rows
    were profiled."""
    columns = list(LADDER_COLUMNS[:2])
    if any(row.epoch_ms_min is not None for row in rows):
        columns.append(SPREAD_COLUMN)
    columns += LADDER_COLUMNS[2:4]  # total ms, setup ms
    if any(row.wall_ms is not None for row in rows):
        columns.append(WALL_COLUMN)
    columns += LADDER_COLUMNS[4:-1]
    if any(row.nodes_per_step is not None for row in rows):
        columns.append(NODES_COLUMN)
    if any(row.profile for row in rows):
        columns += PROFILE_COLUMNS
    return columns + [LADDER_COLUMNS[-1]]


def ladder_legend(rows: list[TableRow]) -> str:
    columns = ladder_columns(rows)
    extra = [SPREAD_LEGEND] if SPREAD_COLUMN in columns else []
    extra += [WALL_LEGEND] if WALL_COLUMN in columns else []
    extra += [NODES_LEGEND] if NODES_COLUMN in columns else []
    extra += [PROFILE_LEGEND] if PROFILE_COLUMNS[0] in columns else []
    return " ".join([LADDER_LEGEND, *extra])


def ladder_cells(row: TableRow, columns: list[str] | tuple[str, ...] = LADDER_COLUMNS) -> list[str]:
    """A row's cells in `columns` order; a peer's name is marked so it never reads as a rung."""
    profile = row.profile or {}
    values = {
        "stage": f"{row.name} (peer)" if row.kind == "peer" else row.name,
        "epoch ms": fmt_ms(row.epoch_ms),
        SPREAD_COLUMN: fmt_range(row.epoch_ms_min, row.epoch_ms_max),
        "total ms": fmt_ms(row.total_ms),
        "setup ms": fmt_ms(row.setup_ms),
        WALL_COLUMN: fmt_ms(row.wall_ms),
        "× prev": fmt_speedup(row.vs_prev),
        "× baseline": fmt_speedup(row.vs_baseline),
        "test acc": fmt_accuracy(row.test_accuracy),
        "train loss": fmt_loss(row.train_loss),
        NODES_COLUMN: DASH if row.nodes_per_step is None else str(row.nodes_per_step),
        "kernels /step": fmt_count(profile.get("kernels_per_step")),
        "launches /step": fmt_count(profile.get("launches_per_step")),
        "GPU busy ms": fmt_ms(profile.get("busy_ms")),
        "GPU idle": fmt_share(profile.get("idle_share")),
        "note": row_note(row),
    }
    return [values[column] for column in columns]


def headline(rows: list[TableRow]) -> str | None:
    """The fastest graphtrain rung against `baseline` and the fastest peer of its precision."""
    ok = [row for row in rows if row.status == "ok"]
    stages = [row for row in ok if row.kind == "stage"]
    if not stages:
        return None
    best = min(stages, key=lambda row: row.epoch_ms)
    parts = []
    if best.vs_baseline is not None and best.name != "baseline":
        parts.append(f"{fmt_speedup(best.vs_baseline)} over `baseline`")
    if best.precision is None:
        parts.append("no peer comparison (the rung's precision is not recorded)")
    else:
        peers = [row for row in ok if row.kind == "peer" and row.precision == best.precision]
        if peers:
            peer = min(peers, key=lambda row: row.epoch_ms)
            parts.append(f"{fmt_speedup(_ratio(peer.epoch_ms, best.epoch_ms))} over the fastest "
                         f"{best.precision} peer, `{peer.name}` ({fmt_ms(peer.epoch_ms)} ms)")
        else:
            parts.append(f"no {best.precision} peer ran")
    return (f"Fastest graphtrain rung: `{best.name}`, {fmt_ms(best.epoch_ms)} ms per epoch: "
            + "; ".join(parts) + " (speed-ups: their epoch time over this rung's).")


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
        ("NCCL", "nccl"), ("cuda-bindings", "cuda_bindings"))])
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


def grid_values(name: str, values: list) -> str:
    """"lr 0.1", or for a grid of several, "lrs 0.05, 0.1" (in the order first met)."""
    distinct = list(dict.fromkeys(values))
    return f"{name} {distinct[0]}" if len(distinct) == 1 else f"{name}s {', '.join(map(str, distinct))}"


def workload_line(records: list[dict], sweep: bool = False) -> str | None:
    """The workload in a line; for a sweep, its grid: every width, lr and seed it trained."""
    record = next((r for r in records if r.get("config")), None)
    if record is None:
        return None
    cfg = record["config"]
    if cfg.get("model") == "cnn":  # its conv layers first, then the linear layers
        convs = ", ".join(f"conv {out}x{kernel}" for out, kernel in cfg.get("conv", []))
        model = f"cnn ({convs}, then {'→'.join(str(d) for d in cfg.get('hidden', []))}→{cfg['classes']})"
    elif sweep:
        model = f"{cfg['in_features']}→H×{max(len(cfg.get('hidden') or []), 1)}→{cfg['classes']} ReLU"
    else:
        model = "→".join(str(d) for d in cfg.get("dims", []))
        model += " softmax regression" if not cfg.get("hidden") else " ReLU MLP"
    length = (counted(cfg["epochs"], "epoch") if cfg.get("epochs") is not None
              else counted(cfg["steps"], "step"))
    configs = [r["config"] for r in records if r.get("config")]
    widths = sorted({r["hidden_size"] for r in records if r.get("hidden_size") is not None})
    parts = [model, "bias" if cfg.get("bias") else "no bias", f"batch {cfg['batch']}", length,
             *([f"H {', '.join(map(str, widths))}"] if widths else []),
             grid_values("lr", [c["lr"] for c in configs]), grid_values("seed", [c["seed"] for c in configs])]
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


def revision_line(records: list[dict]) -> str:
    revision = _first(records, "revision")
    return f"Revision: {revision}" if revision else "Revision: unknown (not run from a git checkout of graphtrain)"


def provenance_lines(records: list[dict], command: str, date: str) -> list[str]:
    """What every results file opens with: when it ran, graphtrain's git revision, the device,
    driver and library versions (from the records' environments), and the exact command."""
    return [f"Date: {date}", revision_line(records), f"Command: `{command}`", *environment_lines(records)]


def script_header(title: str, env: dict, command: str, extra: list[str] | None = None,
                  date: str | None = None) -> str:
    """The opening of a Markdown table a script under scripts/ prints: the title, then the
    provenance lines of a run whose environment is `env` (environment.host() and .gpu(device),
    plus the libraries it loaded), then the script's own `extra` lines."""
    record = {"kind": "stage", "environment": env}
    items = provenance_lines([record], command, date or utc_now()) + (extra or [])
    return "\n".join([f"# {title}", "", *(f"- {item}" for item in items), ""])


def _header(title: str, records: list[dict], date: str, command: str, sweep: bool = False) -> list[str]:
    items = provenance_lines(records, command, date)
    workload = workload_line(records, sweep)
    if workload:
        items.append(workload)
    items.append(TIMING_LINE)
    return [f"# {title}", "", *(f"- {item}" for item in items), ""]


def _plots(heading: str, images, plot_notes: list[str] | None) -> list[str]:
    """The report's end: its plots and why any is missing."""
    if not (images or plot_notes):
        return []
    lines = [f"## {heading}", ""]
    lines += [f"![{Path(name).stem}]({name})" for name in images or []]
    lines += [f"- {note}" for note in plot_notes or []]
    return lines + [""]


def _md_cell(text: str) -> str:
    # A pipe would end the cell and a newline the row.
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(columns, rows) -> list[str]:
    lines = ["| " + " | ".join(_md_cell(c) for c in columns) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|"]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return lines


# --------------------------------------------------------------------------------------------
# The ladder report's paragraph
# --------------------------------------------------------------------------------------------


def _profiled(records: list[dict]) -> list[dict]:
    return [r for r in records if "error" not in r and r.get("profile")]


def _name(record: dict) -> str:
    return f"`{record['stage']}`" + (" (peer)" if record.get("kind") == "peer" else "")


def where_the_time_goes(records: list[dict]) -> list[str]:
    """Markdown lines: which rows are host-bound, and what each rung changed in the GPU's work."""
    profiled = _profiled(records)
    if not profiled:
        return []
    lines = ["## Where the time goes", "",
             "One extra epoch per row ran under CUPTI after the timed ones. GPU busy is the union "
             "of the kernel, memcpy and memset intervals it recorded (overlapping work counts "
             "once); idle is the rest of the row's median epoch time, when the GPU waited for "
             "the host.",
             ""]
    host_bound = [r for r in profiled if r["profile"]["idle_share"] >= HOST_BOUND_IDLE]
    gpu_bound = [r for r in profiled if r["profile"]["idle_share"] < HOST_BOUND_IDLE]

    def idle_list(rows: list[dict]) -> str:
        return ", ".join(f"{_name(r)} ({r['profile']['idle_share']:.0%} idle)" for r in rows)

    if host_bound:
        lines.append(f"- Host-bound (the GPU idle for at least {HOST_BOUND_IDLE:.0%} of the epoch): "
                     f"{idle_list(host_bound)}. Their epoch time is the host's launch time, so it "
                     "moves with the host's load, and a rung that lightens the GPU's work need not "
                     "make them faster.")
    if gpu_bound:
        lines.append(f"- Kept the GPU busy: {idle_list(gpu_bound)}.")
    steps = []
    previous = None
    for record in records:
        if record.get("kind", "stage") != "stage":
            continue
        if previous is not None and record in profiled and previous in profiled:
            steps.append(_rung_change(previous, record))
        previous = record
    if steps:
        lines.append("- Rung by rung, GPU work per epoch, kernels per step and host launches per step: "
                     + "; ".join(steps) + ".")
    return lines + [""]


def _rung_change(before: dict, after: dict) -> str:
    a, b = before["profile"], after["profile"]
    change = (b["busy_ms"] - a["busy_ms"]) / a["busy_ms"] if a["busy_ms"] > 0 else 0.0
    return (f"{_name(after)} {_ms(a['busy_ms'])} → {_ms(b['busy_ms'])} ms ({change:+.0%}), "
            f"{fmt_count(a['kernels_per_step'])} → {fmt_count(b['kernels_per_step'])} kernels, "
            f"{fmt_count(a['launches_per_step'])} → {fmt_count(b['launches_per_step'])} launches")


def _ms(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


# --------------------------------------------------------------------------------------------
# The ladder
# --------------------------------------------------------------------------------------------


def ladder_markdown(records: list[dict], label: str, command: str, date: str | None = None,
                    images: list[str] | None = None, plot_notes: list[str] | None = None) -> str:
    """The ladder report: header, table, plots (or why there are none) and the exact command."""
    lines = _header(f"graphtrain ladder: {label}", records, date or utc_now(), command)
    rows = ladder_rows(records)
    columns = ladder_columns(rows)
    table = markdown_table(columns, [ladder_cells(row, columns) for row in rows])
    # The note column is the last one; left-align it like the name.
    table[1] = table[1].rsplit("|", 2)[0] + "|---|"
    lines += table + [""]
    top = headline(rows)
    if top:
        lines += [f"**{top}**", ""]
    lines += [ladder_legend(rows), ""]
    lines += where_the_time_goes(records)
    lines += _plots("Plots", images, plot_notes)
    return "\n".join(lines)


def _display_name(row: TableRow) -> str:
    return f"{row.name} (peer)" if row.kind == "peer" else row.name


def plot_ladder_time(records: list[dict], path: Path) -> None:
    """Median epoch time per successful row, horizontal bars on a log scale, in ladder order; a
    whisker spans the repeats' lowest to highest where rows were repeated."""
    plt = _pyplot()
    rows = [r for r in ladder_rows(records) if r.status == "ok"]
    fig, ax = plt.subplots(figsize=(8, 0.45 * max(len(rows), 1) + 1.5))
    times = [r.epoch_ms for r in rows]
    colors = ["tab:orange" if r.kind == "peer" else "tab:blue" for r in rows]
    spread = None
    if any(r.epoch_ms_min is not None for r in rows):
        spread = [[r.epoch_ms - (r.epoch_ms_min if r.epoch_ms_min is not None else r.epoch_ms) for r in rows],
                  [(r.epoch_ms_max if r.epoch_ms_max is not None else r.epoch_ms) - r.epoch_ms for r in rows]]
    ax.barh(range(len(rows)), times, color=colors, xerr=spread, capsize=3 if spread else 0)
    ax.set_yticks(range(len(rows)), [_display_name(r) for r in rows])
    ax.invert_yaxis()  # ladder order top to bottom
    ax.set_xscale("log")
    _plain_log_ticks(ax.xaxis)
    ends = [r.epoch_ms_max if r.epoch_ms_max is not None else r.epoch_ms for r in rows]
    for i, (ms, end) in enumerate(zip(times, ends)):
        ax.annotate(f" {fmt_ms(ms)} ms", (end, i), va="center", fontsize=8)  # past the whisker
    ax.set_xlim(min(times) / 2, max(ends) * 4)  # room for the labels
    ax.set_xlabel("median epoch time, ms (log scale)")
    ax.set_title("Epoch time: stages (blue), peers (orange)")
    ax.grid(axis="x", which="both", alpha=0.3)
    _save(fig, path)


def plot_ladder_busy(records: list[dict], path: Path) -> None:
    """Per profiled row, the profiled epoch split into GPU-busy and GPU-idle time, stacked."""
    plt = _pyplot()
    rows = [r for r in ladder_rows(records) if r.status == "ok" and r.profile]
    fig, ax = plt.subplots(figsize=(8, 0.45 * max(len(rows), 1) + 1.5))
    busy = [r.profile["busy_ms"] for r in rows]
    idle = [max(r.profile["epoch_ms"] - r.profile["busy_ms"], 0.0) for r in rows]
    positions = range(len(rows))
    ax.barh(positions, busy, color="tab:green", label="GPU busy")
    ax.barh(positions, idle, left=busy, color="lightgray", label="GPU idle (waiting for the host)")
    ax.set_yticks(positions, [_display_name(r) for r in rows])
    ax.invert_yaxis()
    for i, r in enumerate(rows):
        ax.annotate(f" {fmt_share(r.profile['idle_share'])} idle", (busy[i] + idle[i], i), va="center", fontsize=8)
    ax.set_xlim(0, max(b + i for b, i in zip(busy, idle)) * 1.2)  # room for the labels
    ax.set_xlabel("ms per epoch (median epoch time, split by the profiled epoch's GPU-busy time)")
    ax.set_title("GPU busy and idle time per epoch")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, path)


def _loss_curves(records: list[dict]) -> list[tuple[str, list[tuple[int, float]]]]:
    curves = []
    for record in records:
        if not is_ok(record):
            continue
        points = [(e["epoch"], e["train_loss"]) for e in record.get("epochs", [])
                  if e.get("train_loss") is not None]
        if points:
            curves.append((record["stage"] + (" (peer)" if kind_of(record) == "peer" else ""), points))
    return curves


def plot_ladder_loss(records: list[dict], path: Path) -> None:
    """Train loss per epoch of every successful row, overlaid: same init and order, same curve."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    styles = ["-", "--", "-.", ":"]
    for i, (name, points) in enumerate(_loss_curves(records)):
        xs, ys = zip(*points)
        ax.plot(xs, ys, styles[i % len(styles)], marker="o", markersize=3, label=name, alpha=0.8)
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
    ax.set_ylabel("mean train loss over the epoch (log scale)")
    ax.set_yscale("log")  # late epochs differ by factors, not by a constant
    ax.set_title("Train loss per epoch (where measured)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def _no_epoch_time(records: list[dict]) -> str | None:
    return None if any(is_ok(r) for r in records) else "no row has an epoch time"


def _no_loss(records: list[dict]) -> str | None:
    return None if _loss_curves(records) else "no row measured a training loss"


@dataclass
class Plot:
    suffix: str  # the file is <stem><suffix>.png
    title: str  # what it shows, for the note when it is not drawn
    draw: Callable[[list[dict], Path], None]
    nothing_to_draw: Callable[[list[dict]], str | None]


def device_tag(records: list[dict]) -> str:
    """The GPU the rows ran on, as a file-name tag ("h100"); "cpu" when none ran on a GPU."""
    name = next((r["environment"]["gpu"] for r in records
                 if _known((r.get("environment") or {}).get("gpu"))), None)
    return gpu_tag(name) if name else "cpu"


_MAKER_WORDS = {"nvidia", "geforce", "tesla", "quadro"}


def gpu_tag(name: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA GeForce RTX 4090" -> "rtx4090",
    "NVIDIA A100-SXM4-80GB" -> "a100": the model's words up to its first number."""
    tag = ""
    for word in (w for w in re.split(r"[\s_]+", name) if w and w.lower() not in _MAKER_WORDS):
        tag += word.split("-")[0]
        if any(ch.isdigit() for ch in word):
            break
    return re.sub(r"[^a-z0-9]", "", tag.lower()) or "gpu"


def has_problems(records: list[dict]) -> bool:
    """Whether any row failed or was skipped: its table is partial. A rung that cannot train the
    model by its design (skipped as unsupported) leaves nothing missing."""
    return any(not is_ok(r) and not r.get("unsupported") for r in records)


def report_stem(kind: str, label: str, records: list[dict], partial: bool) -> str:
    return f"{kind}-{label}-{device_tag(records)}" + ("-partial" if partial else "")


def _write_report(kind: str, records: list[dict], label: str, out_dir, command: str, plots: list[Plot],
                  markdown, log: Log | None, date: str | None, partial: bool | None,
                  summary: dict | None = None) -> list[Path]:
    """<stem>.json, the plots when matplotlib is there, then <stem>.md; returns the paths.
    `summary`: a sweep's figures as a whole (graphtrain.sweep.run_sweep), kept as the JSON's "sweep".

    The JSON goes first: whatever happens to the plots, the measurements are on disk.
    """
    log = log or terminal.log
    out_dir = Path(out_dir)
    date = date or utc_now()
    stem = report_stem(kind, label, records, has_problems(records) if partial is None else partial)
    json_path = out_dir / f"{stem}.json"
    document = {"report": kind, "label": label, "date": date, "revision": _first(records, "revision"),
                "command": command, "records": records}
    if summary is not None:
        document["sweep"] = summary
    write_json(json_path, document)
    images, plot_notes = _write_plots(records, out_dir, stem, plots, log)
    md_path = out_dir / f"{stem}.md"
    write_atomic(md_path, markdown(records, label, command, date, images, plot_notes))
    return [md_path, json_path, *(out_dir / name for name in images)]


def write_ladder(records: list[dict], label: str, out_dir, command: str,
                 log: Log | None = None, date: str | None = None, partial: bool | None = None) -> list[Path]:
    """Write <stem>.md and .json, and with matplotlib the -time, -loss and (profiled) -busy plots.
    `partial` None: partial when a row failed or was skipped."""
    plots = [Plot("-time", "time plot", plot_ladder_time, _no_epoch_time),
             Plot("-loss", "loss plot", plot_ladder_loss, _no_loss)]
    if any(is_ok(r) and r.get("profile") for r in records):
        plots.append(Plot("-busy", "busy plot", plot_ladder_busy, lambda _records: None))
    return _write_report("ladder", records, label, out_dir, command, plots, ladder_markdown, log, date, partial)


# --------------------------------------------------------------------------------------------
# The sweep: time against hidden size
# --------------------------------------------------------------------------------------------


def sweep_summary_lines(summary: dict) -> list[str]:
    """The sweep as a whole: its engine's wall, its models' training time, and (where the
    command measured it) its process's wall and the models per second over it."""
    lines = [f"{summary['models']} models in {summary['tasks']} tasks on {summary['engine']}: "
             f"{summary['wall_ms'] / 1e3:.2f} s from the first task's start to the last row gathered"]
    if "train_ms" in summary:
        restarted = f"; {summary['restarted']} on a restarted row" if summary.get("restarted") else ""
        lines.append(f"training: {fmt_ms(summary['train_ms'])} ms for the {summary['trained']} models "
                     f"that trained (each pack once){restarted}")
    if summary.get("process_wall_ms") is not None:
        since = "the process's start" if summary["process_wall_from"] == "process" else "graphtrain's import"
        per_s = summary.get("models_per_s")
        lines.append(f"process wall: {summary['process_wall_ms'] / 1e3:.2f} s from {since} to the sweep's end"
                     + (f", {per_s:.1f} models per second" if per_s is not None else ""))
    return lines


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
                   images: list[str] | None = None, plot_notes: list[str] | None = None,
                   summary: dict | None = None) -> str:
    """The time-against-width tables; `summary` (the sweep's as a whole: `sweep_summary_lines`)
    after them."""
    lines = _header(f"graphtrain sweep: {label}", records, date or utc_now(), command, sweep=True)
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
    if summary is not None:
        lines += ["## The sweep", "", *(f"- {line}" for line in sweep_summary_lines(summary)), ""]
    notes = {r["stage"]: r["note"] for r in records if is_ok(r) and r.get("note")}
    if notes:
        lines += ["## Notes", ""] + [f"- {name}: {note}" for name, note in notes.items()] + [""]
    problems = [r for r in records if not is_ok(r)]
    if problems:
        lines += ["## Failed and skipped runs", ""]
        lines += [f"- H={r.get('hidden_size')} {r.get('stage')}: "
                  f"{'skipped' if r.get('skipped') else 'failed'}: {r.get('error', '')}" for r in problems]
        lines.append("")
    lines += _plots("Plot", images, plot_notes)
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
                log: Log | None = None, date: str | None = None, partial: bool | None = None,
                summary: dict | None = None) -> list[Path]:
    """Write <stem>.md and .json, and with matplotlib <stem>.png; `summary` (the sweep's) in both."""
    plots = [Plot("", "plot", plot_sweep, _no_epoch_time)]
    markdown = functools.partial(sweep_markdown, summary=summary)
    return _write_report("sweep", records, label, out_dir, command, plots, markdown, log, date, partial, summary)


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


def _write_plots(records, out_dir: Path, stem: str, plots: list[Plot], log: Log) -> tuple[list[str], list[str]]:
    """Draw each plot that has something to show; returns the file names drawn and a note for
    each plot that was not (also logged)."""
    missing = matplotlib_missing()
    if missing:
        log(f"graphtrain: plots {missing}")
        return [], [f"Plots {missing}."]
    drawn, notes = [], []
    for plot in plots:
        reason = plot.nothing_to_draw(records)
        if reason:
            notes.append(f"The {plot.title} is not drawn: {reason}.")
            log(f"graphtrain: {notes[-1]}")
            continue
        name = f"{stem}{plot.suffix}.png"
        plot.draw(records, out_dir / name)
        drawn.append(name)
    return drawn, notes


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
