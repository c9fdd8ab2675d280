"""The sweep: many models at once, over a grid of hidden sizes, learning rates and seeds.

    points = expand_grid(config, stages, peers, hidden_sizes, lrs, seeds)   # the cross product
    tasks = make_tasks(points, pack=True)      # what runs together: one model, or a pack of them
    rows = run_tasks(tasks, engine, source)    # in this process, on worker processes, on a cluster
    table = grid_table(rows)                   # one row per model: device, time, accuracy, loss curve

A grid point is one model: a row (rung or peer) and the workload with that point's hidden width,
learning rate and seed. Each point's run plan is its own (its seed sets the initial weights and
the sample order), so a point trains exactly what `graphtrain run` with the same options trains.

A task is what one worker runs at a time. Most tasks are one point. Points that differ only in
learning rate and seed can instead run as one pack on one GPU, every model still bit-identical to
its run alone: the `persistent` rung's softmax regressions, one thread-block cluster each
(graphtrain.packed), the cnns on `graphs` and `device-loop`, on one model axis (each launch
trains every model of the pack: graphtrain.stages.cnn_pack, in the registry's Pack.mode), and
the `jax-vmap` peer, which is by its nature the pack vmapped (graphtrain.peers.jax_vmap). Where
several workers share a pack's points, the pack is split into one pack per worker.

A process sets a row up once per shape: the points that run alone go through this process's
`graphtrain.training.SetUpRows`, which restarts the row set up for an earlier point of the same
row and shape (Stage.restart: another seed or learning rate put on it in place, the uploaded
data and captured graphs kept) and sets one up anew only where it cannot. The dataset is loaded
once per process and the same arrays handed to every row, and a run plan's arrays (initial
weights, sample orders) are drawn once per seed and shape while kept (`shared_plan`): the points
of every learning rate at one seed train from them. Each row says whether it was restarted, and
its setup_ms is then the restart's.

Engines (where tasks run; each imports this module, never the other way round): `InProcess`
(this process, its GPU), `graphtrain.workers.GpuWorkers`
(one spawned process per GPU of this host) and `graphtrain.cluster.DaskCluster` (an existing
Dask cluster, or a local one). All return the rows in grid order as JSON dicts (the run records'
`to_json()`, plus `device`, `weights_sha256`, `restarted`, and `packed` for a pack's models); a row
that could not run is a failed or skipped row, never a hole in the table. The sweep's summary
adds its models' training time (each pack once), and the command adds its process's wall time
from start to exit and the models per second over it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich import box
from rich.markup import escape
from rich.table import Table

from graphtrain import report, stages
from graphtrain.config import TrainConfig
from graphtrain.errors import GpuUnavailableError, GraphtrainError, ModelUnsupported, UsageError

SWEEP_DEPTH = 3  # hidden layers of a swept width when the preset has none: cuda-mnist's (H, H, H); --depth



# --------------------------------------------------------------------------------------------
# The grid
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GridPoint:
    """One model of the sweep: row `name` trains `config`; `index` is its place in the table."""

    index: int
    name: str  # a rung, a peer, or a packed peer (jax-vmap)
    kind: str  # "stage" or "peer"
    config: TrainConfig
    hidden_size: int | None = None  # the swept width, when the sweep varies it


def swept_depth(config: TrainConfig, depth: int | None = None) -> int:
    """Hidden layers of a swept width: `depth` (--depth), else the config's, else SWEEP_DEPTH."""
    return depth or len(config.hidden) or SWEEP_DEPTH


def sized_config(config: TrainConfig, size: int, depth: int | None = None) -> TrainConfig:
    """config with `swept_depth` hidden layers, every one `size` wide."""
    return config.replace(hidden=(size,) * swept_depth(config, depth))


def check_peer(name: str) -> None:
    """PeerUnavailable unless peer `name` (a graphtrain.stages peer, or a packed peer) can run here."""
    pack = stages.SPECS[name].pack
    if pack is not None and pack.only:
        stages.load_target(pack.check)()
    else:
        stages.get_stage(name).check_available()


def expand_grid(config: TrainConfig, stages: Sequence[str], peers: Sequence[str],
                hidden_sizes: Sequence[int] = (), lrs: Sequence[float] = (),
                seeds: Sequence[int] = (), depth: int | None = None) -> list[GridPoint]:
    """The cross product of the hidden sizes, learning rates and seeds (each, when empty, the
    config's own), and for each point every stage then every peer: hidden size outermost, then
    lr, then seed, then the row. Invalid values are a UsageError before anything runs."""
    for name, values in (("--hidden-sizes", hidden_sizes), ("--lrs", lrs), ("--seeds", seeds)):
        if len(set(values)) != len(values):
            raise UsageError(f"{name} repeats a value: {', '.join(map(str, values))}")
    if not stages and not peers:
        raise UsageError("no stages and no peers to run")
    sizes = list(hidden_sizes) or [None]
    points = []
    for size in sizes:
        sized = config if size is None else sized_config(config, size, depth)
        for lr in list(lrs) or [config.lr]:
            for seed in list(seeds) or [config.seed]:
                point_config = sized.replace(lr=lr, seed=seed)  # TrainConfig checks the values
                if point_config.lr != lr or point_config.seed != seed:  # replace() keeps a None
                    raise UsageError(f"invalid grid value: lr {lr!r}, seed {seed!r}")
                for name, kind in [*((s, "stage") for s in stages), *((p, "peer") for p in peers)]:
                    points.append(GridPoint(len(points), name, kind, point_config, size))
    return points


@dataclass(frozen=True)
class SweepTask:
    """What one worker runs at a time: one point, or a pack of points trained together."""

    points: tuple[GridPoint, ...]

    @property
    def packed(self) -> bool:
        return len(self.points) > 1 or self.points[0].name in stages.PACKED_PEERS

    @property
    def label(self) -> str:
        first = self.points[0]
        if len(self.points) > 1:
            return f"{first.name} ×{len(self.points)}"
        return f"{first.name} lr={first.config.lr:g} seed={first.config.seed}" + (
            f" H={first.hidden_size}" if first.hidden_size is not None else "")


def pack_key(point: GridPoint) -> tuple | None:
    """Points with the same key can train as one pack: the same row and workload but for the
    learning rate and the seed. None: this point always runs alone."""
    if stages.SPECS[point.name].pack_for(point.config) is None:
        return None
    return point.name, dataclasses.replace(point.config, lr=1.0, seed=0)


def make_tasks(points: Sequence[GridPoint], pack: bool = True, workers: int = 1) -> list[SweepTask]:
    """The points as tasks. With `pack`, the points that can share a GPU (see `pack_key`) go
    into packs, each split into `workers` packs of near-equal size so every worker gets a share;
    the jax-vmap peer always runs as packs. Tasks come out in the order of their first point."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    groups: dict[tuple, list[GridPoint]] = {}
    singles = []
    for point in points:
        key = pack_key(point)
        if key is None or (not pack and point.name not in stages.PACKED_PEERS):
            singles.append(SweepTask((point,)))
        else:
            groups.setdefault(key, []).append(point)
    tasks = list(singles)
    for members in groups.values():
        parts = min(workers, len(members))
        for part in range(parts):  # contiguous shares, the first ones one larger
            lo, hi = part * len(members) // parts, (part + 1) * len(members) // parts
            tasks.append(SweepTask(tuple(members[lo:hi])))
    return sorted(tasks, key=lambda task: task.points[0].index)


# --------------------------------------------------------------------------------------------
# Running a task where it lands (any engine's worker calls `run_task`)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataSource:
    """Where a worker finds the dataset: what `--dataset/--data/--data-dir/--offline` said."""

    name: str
    data_file: Path | None = None
    data_dir: Path | None = None
    offline: bool = False

    def load(self):
        from graphtrain import data as data_mod

        if self.data_file is not None:
            return data_mod.load_npz(self.data_file)
        return data_mod.load(self.name, data_dir=self.data_dir, offline=self.offline)


def run_task(task: SweepTask, data, device: str) -> list[dict]:
    """Train the task's points on this process's GPU; one JSON row per point, in point order.
    A failure becomes failed rows (a missing framework or GPU, or a model the rung cannot
    train by design: skipped rows), so one task's trouble never stops a sweep."""
    try:
        if task.packed:
            records, restarted = _train_pack(task, data), False
        else:
            record, restarted = _train_one(task.points[0], data)
            records = [record]
        rows = [_row(point, record, device, len(task.points) if task.packed else None, restarted)
                for point, record in zip(task.points, records)]
    except (GpuUnavailableError, ModelUnsupported) as exc:
        rows = [_failed(point, str(exc), skipped=True, unsupported=isinstance(exc, ModelUnsupported))
                for point in task.points]
    except Exception as exc:
        from graphtrain.peers import PeerUnavailable

        if isinstance(exc, PeerUnavailable):
            return [_failed(point, str(exc), skipped=True) for point in task.points]
        trace = None if isinstance(exc, GraphtrainError) else "".join(traceback.format_exception(exc))
        rows = [_failed(point, f"{type(exc).__name__}: {exc}", trace=trace) for point in task.points]
    for row in rows:
        row.setdefault("device", device)
    return rows


# The run plans this process keeps for its next points, newest last, up to this many bytes of
# initial weights and sample orders (the newest always: a wide model's weights alone may be more).
PLAN_CACHE_BYTES = 256 << 20
_plans: dict = {}  # plan_inputs(config) -> (data, plan)


def plan_inputs(config: TrainConfig) -> TrainConfig:
    """What a run plan's arrays (initial weights, sample orders, batches, metrics schedule) are
    drawn from: `config` with its recipe set aside and its seed kept. Points that differ in the
    recipe only (a sweep's learning rates) train from the same arrays."""
    from graphtrain.stages.base import RESTART_NEUTRAL

    return dataclasses.replace(config, **{k: v for k, v in RESTART_NEUTRAL.items() if k != "seed"})


def shared_plan(config: TrainConfig, data):
    """The run plan of `config` on `data`. Its arrays are drawn once per `plan_inputs` and dataset
    while kept (PLAN_CACHE_BYTES): every row of a grid point trains from one plan, as a ladder's
    do, and the points of another learning rate at the same seed take its arrays under their own
    config. (A 784³ MLP's plan of 20 epochs of MNIST is 14 MB and tens of ms to draw.)"""
    from graphtrain.plan import RunPlan

    key = plan_inputs(config)
    kept = _plans.pop(key, None)
    if kept is not None and kept[0] is data:
        plan = kept[1]
        filled = config.replace(in_features=data.num_features, classes=data.num_classes)  # as RunPlan.build fills it
        if plan.config != filled:
            plan = dataclasses.replace(plan, config=filled)
    else:
        plan = RunPlan.for_data(config, data)
    _plans[key] = (data, plan)
    kept_bytes = sum(plan_bytes(p) for _, p in _plans.values())
    while kept_bytes > PLAN_CACHE_BYTES and len(_plans) > 1:
        _, oldest = _plans.pop(next(iter(_plans)))
        kept_bytes -= plan_bytes(oldest)
    return plan


def plan_bytes(plan) -> int:
    return plan.orders.nbytes + sum(a.nbytes for layer in plan.initial for a in (layer.w, layer.b) if a is not None)


def forget_plans() -> None:
    """Drop the kept plans (a process that goes on after its sweep)."""
    _plans.clear()


_set_up: list = []  # this process's set-up rows (graphtrain.training.SetUpRows), made when first needed


def set_up_rows():
    """This process's set-up rows: every point that runs alone trains on them (see the module's
    docstring); `close_set_up_rows` ends them."""
    if not _set_up:
        from graphtrain.training import SetUpRows

        _set_up.append(SetUpRows())
    return _set_up[0]


def close_set_up_rows() -> None:
    while _set_up:
        _set_up.pop().close()


def _train_one(point: GridPoint, data):
    """(the point's run record, whether it ran on a restarted row)."""
    from graphtrain.stages import get_stage

    return set_up_rows().train(get_stage(point.name), shared_plan(point.config, data), data)


def _train_pack(task: SweepTask, data):
    from graphtrain.plan import RunPlan

    plans = [RunPlan.for_data(point.config, data) for point in task.points]
    pack = stages.SPECS[task.points[0].name].pack_for(task.points[0].config)
    return stages.load_target(pack.target)(plans, data, **({"mode": pack.mode} if pack.mode else {}))


def weights_digest(params) -> str:
    """SHA-256 over every parameter's float32 bytes, layer by layer: equal digests, equal weights."""
    digest = hashlib.sha256()
    for layer in params:
        for array in (layer.w, layer.b):
            if array is not None:
                digest.update(np.ascontiguousarray(array, np.float32).tobytes())
    return digest.hexdigest()


def _row(point: GridPoint, record, device: str, packed: int | None, restarted: bool = False) -> dict:
    record.hidden_size = point.hidden_size
    row = record.to_json()
    row["index"] = point.index
    row["device"] = device
    row["train_ms"] = report.train_ms(row)
    row["weights_sha256"] = weights_digest(record.params)
    row["restarted"] = restarted  # trained on a row set up for an earlier point (setup_ms: the restart's)
    if packed is not None:
        row["packed"] = getattr(record, "pack", None) or {"models": packed}
        row["train_ms"] = row["packed"].get("train_ms", row["train_ms"])
    return row


def _failed(point: GridPoint, error: str, skipped: bool = False, unsupported: bool = False,
            trace: str | None = None) -> dict:
    from graphtrain.record import FailedRun

    run = FailedRun(point.name, point.kind, point.config, error, skipped=skipped, unsupported=unsupported,
                    traceback=trace, hidden_size=point.hidden_size)
    row = run.to_json()
    row["index"] = point.index
    return row


def device_label() -> str:
    """This process's GPU as the table shows it: "GPU 1" (its number on the host, from
    CUDA_VISIBLE_DEVICES where a worker was bound to it), "GPU 0" otherwise."""
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return f"GPU {visible or 0}"


# --------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------

# on_task(task, rows) after each task, for progress.
OnTask = Callable[[SweepTask, list[dict]], None]


class InProcess:
    """Every task in this process, one after another, on its GPU (CPU rows on the CPU)."""

    workers = 1
    description = "this process"

    def run(self, tasks: Sequence[SweepTask], source: DataSource, data=None, on_task: OnTask | None = None) -> list[dict]:
        data = data if data is not None else source.load()
        rows = []
        try:
            for task in tasks:
                task_rows = run_task(task, data, _device_of(task))
                rows += task_rows
                if on_task:
                    on_task(task, task_rows)
        finally:
            close_set_up_rows()  # this process goes on after the sweep: its GPU memory back
            forget_plans()  # and its host memory
        return gather(rows)


def _device_of(task: SweepTask) -> str:
    """Where a task trains: the CPU rung on the CPU, everything else on this process's GPU."""
    return "CPU" if not any(stages.SPECS[point.name].uses_gpu for point in task.points) else device_label()


def gather(rows: Sequence[dict]) -> list[dict]:
    """The rows of every task in grid order; each point exactly once (an engine that lost or
    doubled one is a bug)."""
    ordered = sorted(rows, key=lambda row: row["index"])
    indices = [row["index"] for row in ordered]
    if indices != list(range(len(indices))):
        raise RuntimeError(f"the sweep's rows are not one per grid point: {indices}")
    return ordered


def run_sweep(points: Sequence[GridPoint], engine, source: DataSource, data=None, pack: bool = True,
              on_task: OnTask | None = None) -> tuple[list[dict], dict]:
    """Run the grid on `engine`; (rows in grid order, what the sweep as a whole took)."""
    tasks = make_tasks(points, pack=pack, workers=engine.workers)
    start = time.perf_counter()
    rows = engine.run(tasks, source, data=data, on_task=on_task)
    wall_ms = (time.perf_counter() - start) * 1e3
    trained = [row for row in rows if report.is_ok(row)]
    summary = {"engine": engine.description, "workers": engine.workers, "tasks": len(tasks),
               "models": len(points), "wall_ms": wall_ms, "trained": len(trained),
               "train_ms": training_ms(trained), "restarted": sum(bool(row.get("restarted")) for row in trained)}
    return rows, summary


def training_ms(rows: Sequence[dict]) -> float:
    """The training time of the rows that trained, all models together: each model alone's
    timed epochs, each pack's time once (its models trained at the same time)."""
    packs = {(row["stage"], row.get("device"), row["packed"].get("id")): row["train_ms"]
             for row in rows if row.get("packed")}
    return sum(row["train_ms"] for row in rows if not row.get("packed")) + sum(packs.values())


def add_process_wall(summary: dict, wall_ms: float, origin: str) -> dict:
    """The sweep's `summary` with its process's wall time (`wall_ms` from the process's start,
    or from graphtrain's import where `origin` is "import": graphtrain.phases) and the models
    trained per second of it."""
    summary.update(process_wall_ms=wall_ms, process_wall_from=origin,
                   models_per_s=summary["trained"] / (wall_ms / 1e3) if wall_ms > 0 else None)
    return summary


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------

_SPARK = "▁▂▃▄▅▆▇█"
CURVE_POINTS = 10  # at most this many losses in a curve, evenly picked, the last one always


def loss_curve(row: dict) -> str:
    """The measured training losses as a small curve, then the last one: "█▂▁ 0.2731"."""
    losses = [e["train_loss"] for e in row.get("epochs", []) if e.get("train_loss") is not None]
    if not losses:
        return report.DASH
    if not all(np.isfinite(losses)):
        return f"{losses[-1]}"
    if len(losses) > CURVE_POINTS:
        picks = np.linspace(0, len(losses) - 1, CURVE_POINTS).round().astype(int)
        losses = [losses[i] for i in picks]
    low, high = min(losses), max(losses)
    span = high - low or 1.0
    spark = "".join(_SPARK[min(len(_SPARK) - 1, int((loss - low) / span * len(_SPARK)))] for loss in losses)
    return f"{spark} {losses[-1]:.4f}"


def grid_columns(rows: list[dict]) -> list[str]:
    """The table's columns; H only where the sweep varies the hidden width."""
    sized = any(row.get("hidden_size") is not None for row in rows)
    return ["row", *(["H"] if sized else []), "lr", "seed", "device", "train ms", "models", "test acc", "loss"]


def grid_cells(row: dict, columns: list[str]) -> list[str]:
    """One row's cells. 'models': how many trained together with it (1: alone)."""
    cfg = row.get("config") or {}
    size = row.get("hidden_size")
    cells = {"row": row.get("stage", "?") + ("*" if row.get("kind") == "peer" else ""),
             "H": str(size) if size is not None else report.DASH, "lr": f"{cfg.get('lr', 0):g}",
             "seed": str(cfg.get("seed", "")), "device": row.get("device", report.DASH)}
    if not report.is_ok(row):
        cells["train ms"] = ("skipped" if row.get("skipped") else "failed") + f": {row.get('error', '')}"
    else:
        packed = row.get("packed")
        cells.update({"train ms": report.fmt_ms(row.get("train_ms")), "models": str(packed["models"] if packed else 1),
                      "test acc": report.fmt_accuracy(row.get("test_accuracy")), "loss": loss_curve(row)})
    return [cells.get(column, "") for column in columns]


LEGEND = ("* a framework peer. train ms: the row's training time (its timed epochs), or for models trained "
          "together ('models' > 1) the time of them all; loss: the measured training losses, then the last")


def grid_table(rows: list[dict], summary: dict | None = None) -> Table:
    """One row per model: where it trained, its training time, test accuracy and loss curve."""
    columns = grid_columns(rows)
    table = Table(title="graphtrain sweep", title_justify="left", caption_justify="left",
                  box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)
    for column in columns:
        table.add_column(column, justify="left" if column in ("row", "device", "loss") else "right", no_wrap=True)
    for row in rows:
        style = None if report.is_ok(row) else ("yellow" if row.get("skipped") else "red")
        table.add_row(*(escape(cell) for cell in grid_cells(row, columns)), style=style)
    lines = [escape(line) for line in [*pack_lines(rows), LEGEND]]
    if summary:
        lines += [escape(line) for line in report.sweep_summary_lines(summary)]
    table.caption = "\n".join(lines)
    return table


def pack_lines(rows: list[dict]) -> list[str]:
    """One line per pack: its models, its training time and how it ran."""
    seen, lines = set(), []
    for row in rows:
        packed = row.get("packed")
        if not packed or not report.is_ok(row):
            continue
        key = (row["stage"], row.get("device"), packed.get("id"))
        if key in seen:
            continue
        seen.add(key)
        how = f", {packed['how']}" if packed.get("how") else ""
        lines.append(f"{row['stage']} on {row.get('device')}: {packed['models']} models trained together in "
                     f"{report.fmt_ms(packed.get('train_ms'))} ms{how}")
    return lines


def grid_markdown(records: list[dict], label: str, command: str, date: str | None = None,
                  images=None, plot_notes=None, summary: dict | None = None) -> str:
    widths = {row.get("hidden_size") for row in records} - {None}
    lines = report._header(f"graphtrain sweep: {label}", records, date or report.utc_now(), command,
                           sweep=len(widths) > 1)
    columns = grid_columns(records)
    lines += report.markdown_table(columns, [grid_cells(row, columns) for row in records]) + [""]
    lines += [f"- {line}" for line in [*pack_lines(records), LEGEND, *(report.sweep_summary_lines(summary) if summary else [])]]
    return "\n".join(lines + [""])


def write_grid(records: list[dict], label: str, out_dir, command: str, log=None,
               partial: bool | None = None, summary: dict | None = None) -> list[Path]:
    """<out>/sweep-<label>-<gpu>[-partial].md and .json, one row per model; `summary` (the
    sweep's, `run_sweep`'s) in both."""
    return report._write_report("sweep", records, label, out_dir, command, [], partial_markdown(grid_markdown, summary),
                                log, None, partial, summary=summary)


def partial_markdown(markdown, summary: dict | None):
    """`markdown` (a report's Markdown function) with the sweep's summary given to it."""
    return functools.partial(markdown, summary=summary)


# --------------------------------------------------------------------------------------------
# What the command line gives
# --------------------------------------------------------------------------------------------


def parse_floats(option: str, text: str | None) -> list[float]:
    """'0.05,0.1' -> [0.05, 0.1]; None -> [] (the config's own value)."""
    if text is None:
        return []
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"{option} wants comma-separated numbers like 0.05,0.1, got {text!r}") from None
    if not values:
        raise UsageError(f"{option} needs at least one value")
    return values


def parse_seeds(text: str | None) -> list[int]:
    """'0,1,5' -> [0, 1, 5]; '0-7' -> [0, ..., 7]; None -> [] (the config's own seed)."""
    if text is None:
        return []
    seeds = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        low, dash, high = part.partition("-")
        try:
            seeds += list(range(int(low), int(high) + 1)) if dash else [int(part)]
        except ValueError:
            raise UsageError(f"--seeds wants whole numbers like 0,1,2 or a range like 0-7, got {text!r}") from None
        if dash and int(high) < int(low):
            raise UsageError(f"--seeds range {part!r} runs backwards")
    if not seeds:
        raise UsageError("--seeds needs at least one seed")
    return seeds


def only_sizes_vary(points: Sequence[GridPoint], rows: Sequence[dict]) -> bool:
    """Whether the grid is the classic time-against-width sweep: several widths, one lr and
    one seed, nothing packed (its report is the table of graphtrain.report.write_sweep)."""
    return (any(p.hidden_size is not None for p in points)
            and len({(p.config.lr, p.config.seed) for p in points}) == 1
            and not any(row.get("packed") for row in rows))


def sweep_label(config: TrainConfig, depth: int | None = None) -> str:
    """Like graphtrain.ladder.run_label, with the swept hidden size as H: "cuda-mnist-mlpHx3"."""
    from graphtrain.config import PRESETS
    from graphtrain.ladder import model_tag, run_label

    if config.conv:  # the cnn's widths are not swept
        return run_label(config)
    preset = PRESETS.get(config.preset) if config.preset else None
    depth = swept_depth(config, depth)
    label = run_label(config.replace(hidden=preset.hidden if preset else ()))
    return label.replace(f"-{model_tag(preset.hidden if preset else ())}", f"-{model_tag(('H',) * depth)}", 1)


def grid_label(config: TrainConfig, sizes: bool, lrs: bool, seeds: bool, depth: int | None = None) -> str:
    """The files' label: the workload's (graphtrain.ladder.run_label) without what the grid varies;
    a swept width is H (`sweep_label`)."""
    from graphtrain.config import PRESETS
    from graphtrain.ladder import run_label

    preset = PRESETS.get(config.preset) if config.preset else None
    if preset is None:
        return run_label(config)
    config = config.replace(lr=preset.lr if lrs else None, seed=preset.seed if seeds else None)
    return sweep_label(config, depth) if sizes else run_label(config)
