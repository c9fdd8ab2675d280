"""The ladder: every stage, then the peers, on one workload, side by side.

`run_ladder` builds one run plan (initial weights, sample orders, batches) and trains it with
each stage in ladder order and then with each peer, one row each. A row that fails does not stop the others: it
becomes a failed row with its error (or a skipped row when its framework or the GPU is missing).
It shows a progress bar per row on the given (stderr) console and, given an output folder,
writes the reports of `graphtrain.report` there (the sweep over widths, learning rates and seeds
is `graphtrain.sweep`); each row's own output (the frameworks'
warnings, autotuning logs, tracebacks) then goes to <out>/logs/<kind>-<label>-<row>.log instead
of the terminal (`graphtrain.capture`).

A ladder row can run `repeat` times, each from a fresh setup (`record.merge_repeats` makes one
row of them), and be profiled: one more epoch under CUPTI after the timed ones of its last run
(`training.run_stage`).
"""

from __future__ import annotations

import contextlib
import itertools
import traceback
from pathlib import Path

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from graphtrain import report, terminal, training
from graphtrain.capture import RowOutput
from graphtrain.config import PRESETS, TrainConfig
from graphtrain.data import Dataset
from graphtrain.errors import GpuUnavailableError, GraphtrainError, ModelUnsupported, UsageError
from graphtrain.peers import PeerUnavailable
from graphtrain.plan import RunPlan
from graphtrain.record import FailedRun, Row, data_summary, merge_repeats
from graphtrain.stages import ROWS, check_names, get_stage, peer_names, stage_names



def default_stages() -> list[str]:
    return stage_names()


def default_peers() -> list[str]:
    return peer_names()


def run_label(config: TrainConfig) -> str:
    """<workload>-<model>, plus a tag for each other setting that differs from the preset's own.

    jhu -> "jhu-softmax" (softmax regression); jhu with --hidden 784,784,784 -> "jhu-mlp784x3";
    other overrides add e.g. "-e5" (epochs), "-s1000" (steps), "-b256", "-lr0.05", "-nobias",
    "-seed1", "-fashion-mnist", so that runs of different workloads never overwrite each other.
    """
    preset = PRESETS.get(config.preset) if config.preset else None
    if preset is None:
        return "custom-" + model_tag(config.hidden, config.conv)
    tags = [f"-{model_tag(config.hidden, config.conv)}"]
    if config.bias != preset.bias:
        tags.append("-bias" if config.bias else "-nobias")
    if config.batch != preset.batch:
        tags.append(f"-b{config.batch}")
    if (config.epochs, config.steps) != (preset.epochs, preset.steps):
        tags.append(f"-e{config.epochs}" if config.epochs is not None else f"-s{config.steps}")
    if config.lr != preset.lr:
        tags.append(f"-lr{config.lr:g}")
    if config.seed != preset.seed:
        tags.append(f"-seed{config.seed}")
    if config.metrics_every != preset.metrics_every:
        tags.append(f"-m{config.metrics_every}")
    if config.dataset != preset.dataset:
        tags.append(f"-{config.dataset}")
    return config.preset + "".join(tags)


def model_tag(hidden, conv=()) -> str:
    """The model in a file name: "softmax" (no hidden layer), else "mlp" and the hidden sizes,
    a run of equal ones as size x count: (784, 784, 784) -> "mlp784x3", (96, 40) -> "mlp96-40";
    the sweep's H stays a letter: ("H",) * 3 -> "mlpHx3". A cnn: "cnn", its conv layers as
    channels c kernel, then its hidden sizes: ((24, 5), (32, 3)), (256,) -> "cnn24c5-32c3-256"."""
    if conv:
        return "cnn" + "-".join([*(f"{out}c{kernel}" for out, kernel in conv), *map(str, hidden)])
    if not hidden:
        return "softmax"
    runs = [(size, len(list(group))) for size, group in itertools.groupby(hidden)]
    return "mlp" + "-".join(f"{size}x{count}" if count > 1 else f"{size}" for size, count in runs)


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def run_ladder(config: TrainConfig, *, stages: list[str], peers: list[str], data: Dataset,
               out_dir: Path | None, command: str, console: Console | None = None, repeat: int = 1,
               profile: bool = False, force: bool = False) -> list[Row]:
    """Run each stage, then each peer, on `config` with one shared run plan; write the reports
    to `out_dir` if given. The files are tagged `-partial` when a row failed or was skipped or
    when `stages` and `peers` are not all of them, unless `force`."""
    console = console or terminal.err
    check_names(stages, peers)
    if not isinstance(repeat, int) or repeat < 1:
        raise UsageError(f"--repeat must be a whole number >= 1, got {repeat!r}")
    plan = RunPlan.for_data(config, data)
    label = run_label(config)
    skips = Skips()
    with _row_output(console, out_dir, f"ladder-{label}") as output, terminal.progress_bar(console) as progress:
        records = [_run_row(name, plan, data, progress, skips, output, repeat, profile)
                   for name in [*stages, *peers]]
    skips.report(console)
    if out_dir is not None:
        rows = [r.to_json() for r in records]
        subset = stages != default_stages() or peers != default_peers()
        partial = not force and (subset or report.has_problems(rows))
        paths = report.write_ladder(rows, label, out_dir, command, log=terminal.logger(console), partial=partial)
        _print_paths(console, paths)
    return records


def _row_output(console: Console, out_dir: Path | None, prefix: str):
    """Where the rows' own output goes: <out>/logs/, or the terminal when nothing is written."""
    if out_dir is None:
        return contextlib.nullcontext(None)
    return RowOutput(console, Path(out_dir) / "logs", prefix)


class Skips:
    """The rows skipped, by reason: said once each after the table's rows have run, one line a
    reason, instead of the same reason once per row (ten rungs on a machine without a GPU)."""

    def __init__(self):
        self.rows: dict[str, list[str]] = {}  # reason -> the rows it skipped, in order
        self.no_gpu = False

    def add(self, label: str, exc: Exception) -> None:
        self.rows.setdefault(" ".join(str(exc).split()), []).append(label)
        self.no_gpu = self.no_gpu or isinstance(exc, GpuUnavailableError)

    def report(self, console: Console) -> None:
        for reason, labels in self.rows.items():
            console.print(f"[yellow]skipped {escape(', '.join(labels))}:[/] {escape(reason)}", soft_wrap=True)
        if self.no_gpu:
            console.print("to train on the CPU without a GPU: --stages numpy --no-peers", soft_wrap=True)


def _run_row(name: str, plan: RunPlan, data: Dataset, progress: Progress, skips: Skips,
             output: RowOutput | None = None, repeat: int = 1, profile: bool = False) -> Row:
    """Train one row `repeat` times (profiled the last time, if asked); any failure becomes a
    row that says what went wrong. With `output`, what the row prints goes to its log; a skipped
    row's reason is kept in `skips`, to be said once."""
    console = progress.console
    task = progress.add_task(escape(name), total=plan.num_epochs * repeat, status="epochs")
    runs = []

    def on_epoch(epoch: int, num_epochs: int, entry) -> None:
        progress.update(task, completed=len(runs) * num_epochs + epoch + 1)

    kind = ROWS[name].kind
    log_path = None
    captured = output.capture(name) if output else contextlib.nullcontext()  # the log named after the row
    try:
        with captured as log_path:
            try:
                for run in range(repeat):
                    runs.append(training.run_stage(get_stage(name), plan, data, progress=on_epoch,
                                                   profile=profile and run == repeat - 1))
            except (PeerUnavailable, GpuUnavailableError, ModelUnsupported):
                raise  # a skipped row: its message says it all
            except Exception:
                if output:
                    traceback.print_exc()  # into the row's log, beside what the framework printed
                raise
        record = merge_repeats(runs)
        progress.update(task, description=escape(f"{name}: {report.fmt_ms(record.epoch_ms)} ms/epoch"))
        for warning in record.warnings:
            console.print(f"[yellow]{escape(name)}: warning:[/] {escape(warning)}")
    except (PeerUnavailable, GpuUnavailableError, ModelUnsupported) as exc:
        record = FailedRun(name, kind, plan.config, str(exc), skipped=True,
                           unsupported=isinstance(exc, ModelUnsupported))
        progress.update(task, description=escape(f"{name}: skipped"))
        skips.add(name, exc)
    except Exception as exc:  # one row's failure must not stop the ladder; it is reported below
        record = FailedRun(name, kind, plan.config, f"{type(exc).__name__}: {exc}", skipped=False)
        if not isinstance(exc, GraphtrainError):
            # Not one of graphtrain's explained errors: keep the trace for whoever debugs it.
            record.traceback = "".join(traceback.format_exception(exc))
        progress.update(task, description=escape(f"{name}: failed"))
        where = f" (its output: {log_path})" if log_path is not None and log_path.exists() else ""
        console.print(f"[red]{escape(name)}: failed:[/] {escape(record.error)}{escape(where)}")
    if record.failed:
        record.data = data_summary(data)
    if log_path is not None and log_path.exists():
        record.log = str(log_path)
    return record


def _print_paths(console: Console, paths) -> None:
    for path in paths:
        console.print(f"wrote {escape(str(path))}")


# --------------------------------------------------------------------------------------------
# Tables for the terminal
# --------------------------------------------------------------------------------------------

_ROW_STYLES = {"ok": None, "failed": "red", "skipped": "yellow"}


def ladder_table(records: list[dict]) -> Table:
    """The ladder as a rich table; the same rows and numbers as the Markdown report.

    Sized for a terminal: headers on two lines, peers below a rule instead of marked "(peer)",
    and the notes (error messages, a peer's precision) as references like "failed [1]" into the
    caption, which lists each different note once; then the headline and the legend.
    """
    notes: dict[str, int] = {}  # note text -> its number
    table = Table(title="graphtrain ladder", title_justify="left", caption_justify="left",
                  box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)
    rows = report.ladder_rows(records)
    columns = report.ladder_columns(rows)
    last = len(columns) - 1
    for i, column in enumerate(columns):
        header = "stage\n/ peer" if i == 0 else column.replace(" ", "\n", 1)
        table.add_column(header, justify="left" if i in (0, last) else "right", no_wrap=True)
    previous_kind = None
    for row in rows:
        if previous_kind == "stage" and row.kind == "peer":
            table.add_section()
        previous_kind = row.kind
        cells = report.ladder_cells(row, columns)
        cells[0] = row.name
        note = "" if row.status == "ok" else row.status
        if row.note:
            number = notes.setdefault(row.note, len(notes) + 1)
            note = f"{note} [{number}]".strip()
        cells[last] = note
        table.add_row(*(escape(cell) for cell in cells), style=_ROW_STYLES[row.status])
    lines = [f"[{number}] {text}" for text, number in notes.items()]
    top = report.headline(rows)
    lines += [top] if top else []
    table.caption = escape("\n".join([*lines, report.ladder_legend(rows)]))
    return table
