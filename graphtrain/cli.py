"""The `graphtrain` command: parse, call the library, print. Exit codes: 0 ok, 2 bad usage or
input, 1 a failure while training, 130 interrupted."""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from graphtrain import config as config_mod
from graphtrain import data as data_mod
from graphtrain.errors import GraphtrainError, UsageError
from graphtrain.stages import stage_names

out = Console()
err = Console(stderr=True)


# Environment variables that change what a run does; a recorded command names those that are set.
BEHAVIOUR_VARIABLES = ("GRAPHTRAIN_TORCH_COMPILE_MODE",)


def command_line() -> str:
    settings = [f"{name}={os.environ[name]}" for name in BEHAVIOUR_VARIABLES if os.environ.get(name)]
    return shlex.join([*settings, "graphtrain", *sys.argv[1:]])


def fail(error: Exception) -> None:
    code = 2 if isinstance(error, UsageError) else 1
    # escape: messages name extras like graphtrain[cu13], which rich would read as markup
    err.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)
    sys.exit(code)


@contextmanager
def reported_errors():
    """Turn graphtrain's own errors into a message and an exit code, never a traceback."""
    try:
        yield
    except GraphtrainError as error:
        fail(error)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


def log_stderr(message: str) -> None:
    err.print(message, highlight=False, markup=False, soft_wrap=True)


def write_json_atomic(path: Path, obj) -> None:
    """Write next to the target and rename, so a crash never leaves half a file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# Options shared by run, ladder and sweep: a preset, then field-by-field overrides.
def workload_options(func):
    options = [
        click.option("--preset", default="jhu", show_default=True,
                     type=click.Choice(list(config_mod.PRESETS)), help="Named workload (see README)."),
        click.option("--hidden", default=None, metavar="H1,H2,...",
                     help="Hidden layer sizes, e.g. 784,784; 'none' for softmax regression."),
        click.option("--bias/--no-bias", default=None, help="Layers with or without bias."),
        click.option("--batch", type=int, default=None, help="Batch size."),
        click.option("--epochs", type=int, default=None, help="Epochs (replaces the preset's length)."),
        click.option("--steps", type=int, default=None, help="Training steps instead of epochs."),
        click.option("--lr", type=float, default=None, help="SGD learning rate."),
        click.option("--seed", type=int, default=None, help="Seed of the init and the sample order."),
        click.option("--metrics-every", type=int, default=None,
                     help="Epochs between loss/accuracy reads in the sparse-metrics rungs."),
        click.option("--dataset", default=None, type=click.Choice(list(data_mod.DATASETS)),
                     help="Dataset (default: the preset's, mnist)."),
        click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="Folder holding the dataset's IDX files (else $GRAPHTRAIN_DATA, else the cache)."),
        click.option("--offline", is_flag=True, help="Never download; fail if the dataset is missing."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def build_config(preset, hidden, bias, batch, epochs, steps, lr, seed, metrics_every, dataset):
    cfg = config_mod.preset(preset)
    if epochs is not None and steps is not None:
        raise UsageError("give --epochs or --steps, not both")
    return cfg.replace(
        hidden=config_mod.parse_hidden(hidden) if hidden is not None else None,
        bias=bias, batch=batch, epochs=epochs, steps=steps, lr=lr, seed=seed,
        metrics_every=metrics_every, dataset=dataset,
    ).validate()


def load_data(cfg, data_dir, offline):
    """The dataset, and the check that needs its size (a batch larger than the training set)."""
    data = data_mod.load(cfg.dataset, data_dir=data_dir, offline=offline, log=log_stderr)
    cfg.validate(len(data.train_images))
    return data


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="graphtrain")
def main():
    """Train MNIST-style classifiers on an NVIDIA GPU, rung by rung up the optimisation ladder.

    \b
    graphtrain run --stage graphs          train one model with one stage
    graphtrain ladder                      every stage and the framework peers, into results/
    graphtrain info                        what this machine offers
    graphtrain data download               fetch MNIST into the cache
    """


@main.command()
@click.option("--stage", default="numpy", show_default=True, type=click.Choice(stage_names()),
              help="Which rung trains (ladder order; numpy is the CPU reference).")
@workload_options
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the run record (per-epoch times, losses, environment) here.")
def run(stage, preset, hidden, bias, batch, epochs, steps, lr, seed, metrics_every, dataset, data_dir,
        offline, json_path):
    """Train one model with one stage; print per-epoch loss, accuracy and time."""
    from graphtrain.training import train

    with reported_errors():
        cfg = build_config(preset, hidden, bias, batch, epochs, steps, lr, seed, metrics_every, dataset)
        data = load_data(cfg, data_dir, offline)
        dims = "-".join(map(str, cfg.dims))
        log_stderr(f"graphtrain: stage {stage}, model {dims}, batch {cfg.batch}, lr {cfg.lr}, "
                   f"{'%d epochs' % cfg.epochs if cfg.epochs else '%d steps' % cfg.steps}, data {data.source}")
        with epoch_progress(cfg.num_epochs(len(data.train_images)), stage) as progress:
            record = train(cfg, stage=stage, data=data, progress=progress)
        record["command"] = command_line()
        if json_path is not None:
            write_json_atomic(json_path, record)

    out.print(summary_table(record))
    if json_path is not None:
        log_stderr(f"run record written to {json_path}")


class epoch_progress:
    """A rich progress bar on stderr, one tick per epoch, showing the last measured metrics."""

    def __init__(self, num_epochs: int, label: str):
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[metrics]}"), TimeElapsedColumn(), console=err,
                            transient=False)
        self.task = self.bar.add_task(label, total=num_epochs, metrics="setup")

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)

    def __call__(self, epoch: int, num_epochs: int, entry: dict) -> None:
        text = f"{entry['ms']:8.2f} ms"
        if entry["train_loss"] is not None:
            text += f"  loss {entry['train_loss']:.4f}"
        if entry["test_accuracy"] is not None:
            text += f"  test acc {100 * entry['test_accuracy']:.2f}%"
        self.bar.update(self.task, advance=1, metrics=text)


def summary_table(record: dict) -> Table:
    table = Table(title=f"graphtrain {record['stage']}", show_header=True)
    for column in ("epoch", "ms", "train loss", "train acc", "test acc"):
        table.add_column(column, justify="right")
    for e in record["epochs"]:
        pct = lambda v: "" if v is None else f"{100 * v:.2f}%"  # noqa: E731
        table.add_row(str(e["epoch"]), f"{e['ms']:.2f}",
                      "" if e["train_loss"] is None else f"{e['train_loss']:.4f}",
                      pct(e["train_accuracy"]), pct(e["test_accuracy"]))
    table.caption = (f"median epoch (2nd half) {record['epoch_ms']:.2f} ms · setup {record['setup_ms']:.0f} ms · "
                     f"total {record['total_ms']:.0f} ms · test accuracy {100 * record['test_accuracy']:.2f}%")
    return table


@main.command()
def info():
    """What this machine offers: Python, numpy, GPU and driver, CUDA libraries, peers."""
    import importlib.util
    import platform

    import numpy as np

    from graphtrain.environment import probe

    table = Table(show_header=True, title="graphtrain info")
    table.add_column("component")
    table.add_column("status")
    table.add_column("details", overflow="fold")
    table.add_row("python", "ok", f"{platform.python_version()} ({sys.executable})")
    table.add_row("numpy", "ok", np.__version__)
    for name, finding in probe().items():
        status = "[green]found[/]" if finding.get("found") else "[red]missing[/]"
        details = "; ".join(f"{k}: {v}" for k, v in finding.items() if k != "found" and v not in (None, ""))
        table.add_row(name, status, escape(details))
    for peer in ("torch", "jax", "matplotlib"):
        spec = importlib.util.find_spec(peer)
        table.add_row(peer, "[green]importable[/]" if spec else "[yellow]absent[/]",
                      "" if spec else "optional: the ladder skips rows that need it")
    out.print(table)


@main.group()
def data():
    """Manage datasets: where they are looked up, and downloading them."""


@data.command("download")
@click.option("--dataset", default="mnist", show_default=True, type=click.Choice(list(data_mod.DATASETS)))
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder to download into (default: the per-user cache).")
def data_download(dataset, dest):
    """Fetch the dataset's missing files, verify their md5 sums, write them atomically."""
    with reported_errors():
        folder = data_mod.download(dataset, dest=dest, log=log_stderr)
    out.print(f"{dataset} is in {folder}")


def exit_if_nothing_ran(records: list[dict]) -> None:
    """A ladder or sweep in which every row failed or was skipped is a failure (exit 1)."""
    if all("error" in r for r in records):
        err.print("[bold red]error:[/] no row of the table ran; see the notes above")
        sys.exit(1)


def _stage_list(stages: str | None):
    from graphtrain.stages import get_stage

    if stages is None:
        return stage_names()
    names = [s.strip() for s in stages.split(",") if s.strip()]
    for name in names:
        get_stage(name)
    return names


def _peer_list(peers_flag: bool, peers: str | None):
    from graphtrain import peers as peers_mod

    if not peers_flag:
        return []
    if peers is None:
        return peers_mod.peer_names()
    names = [p.strip() for p in peers.split(",") if p.strip()]
    unknown = [n for n in names if n not in peers_mod.peer_names()]
    if unknown:
        raise UsageError(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(peers_mod.peer_names())}")
    return names


@main.command()
@workload_options
@click.option("--stages", default=None, metavar="S1,S2", help="Stages to run (default: all, in ladder order).")
@click.option("--peers/--no-peers", "peers_flag", default=True, help="Also run the framework peers.")
@click.option("--peer", "peer_names", default=None, metavar="P1,P2",
              help="Which peers (default: torch-eager, torch-compile, torch-graph, jax-scan).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("results"),
              show_default=True, help="Where the Markdown, JSON and plots go.")
def ladder(preset, hidden, bias, batch, epochs, steps, lr, seed, metrics_every, dataset, data_dir, offline,
           stages, peers_flag, peer_names, out_dir):
    """Reproduce the optimisation table: every stage, then the peers, on one workload."""
    from graphtrain import ladder as ladder_mod

    with reported_errors():
        cfg = build_config(preset, hidden, bias, batch, epochs, steps, lr, seed, metrics_every, dataset)
        stage_list, peer_list = _stage_list(stages), _peer_list(peers_flag, peer_names)
        data = load_data(cfg, data_dir, offline)
        records = ladder_mod.run_ladder(cfg, stages=stage_list, peers=peer_list, data=data, out_dir=out_dir,
                                        command=command_line(), console=err)
    out.print(ladder_mod.ladder_table(records))
    exit_if_nothing_ran(records)


@main.command()
@workload_options
@click.option("--hidden-sizes", required=True, metavar="H1,H2,...",
              help="Hidden widths to sweep, e.g. 128,256,512,1024,2048,4096.")
@click.option("--stages", default="graphs", show_default=True, metavar="S1,S2", help="Stages to time.")
@click.option("--peers/--no-peers", "peers_flag", default=True, help="Also time the framework peers.")
@click.option("--peer", "peer_names", default=None, metavar="P1,P2", help="Which peers (default: all).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("results"),
              show_default=True)
def sweep(preset, hidden, bias, batch, epochs, steps, lr, seed, metrics_every, dataset, data_dir, offline,
          hidden_sizes, stages, peers_flag, peer_names, out_dir):
    """Total training time against hidden size, for chosen stages and peers."""
    from graphtrain import ladder as ladder_mod

    with reported_errors():
        sizes = config_mod.parse_hidden(hidden_sizes)
        if not sizes:
            raise UsageError("--hidden-sizes needs at least one size")
        cfg = build_config(preset, hidden, bias, batch, epochs, steps, lr, seed, metrics_every, dataset)
        stage_list, peer_list = _stage_list(stages), _peer_list(peers_flag, peer_names)
        data = load_data(cfg, data_dir, offline)
        records = ladder_mod.run_sweep(cfg, hidden_sizes=list(sizes), stages=stage_list, peers=peer_list,
                                       data=data, out_dir=out_dir, command=command_line(), console=err)
    out.print(ladder_mod.sweep_table(records))
    exit_if_nothing_ran(records)
