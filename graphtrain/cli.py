"""The `graphtrain` command: parse, call the library, print.

Exit codes: 0 ok; 2 what the user can fix before anything runs (bad usage or input, a missing
GPU, library, framework, CUPTI or matplotlib: see graphtrain.errors); 1 a failure while training,
fetching data or writing results; 130 interrupted (see __main__.py). Explained failures print
`error: ...` and no traceback; a bug surfaces with its traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shlex
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import click

from graphtrain import __version__ as graphtrain_version
from graphtrain import config as config_mod
from graphtrain import data as data_mod
from graphtrain import files, terminal
from graphtrain.errors import GpuUnavailableError, GraphtrainError, MissingRequirement, ModelUnsupported, UsageError
from graphtrain.stages import (LADDER, PACKED_PEERS, PEERS, SPECS, check_names, get_stage, models_on, row_names, speedrun_defaults,
                               speedrun_names, spoken)

out, err = terminal.out, terminal.err
log = terminal.log


def escape(text: str) -> str:
    """`text` with rich's markup escaped (rich is imported when first printed with)."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


# Environment variables that change what a run does; a recorded command names those that are set.
BEHAVIOUR_VARIABLES = ("GRAPHTRAIN_TORCH_COMPILE_MODE",)


def command_line() -> str:
    settings = [f"{name}={os.environ[name]}" for name in BEHAVIOUR_VARIABLES if os.environ.get(name)]
    return shlex.join([*settings, "graphtrain", *sys.argv[1:]])


def fail(message: str, code: int) -> None:
    # escape: messages name extras like graphtrain[cu13], which rich would read as markup
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(code)


@contextmanager
def reported_errors():
    """Turn graphtrain's own errors, and running out of memory, into one line and an exit code."""
    try:
        yield
    except GraphtrainError as error:
        fail(str(error), 2 if isinstance(error, UsageError) else 1)
    except MemoryError as error:  # numpy's says how much it could not allocate
        fail(f"out of memory: {error or 'an allocation failed'}", 1)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


# --------------------------------------------------------------------------------------------
# The workload: one option set shared by run, ladder and sweep
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """What run, ladder and sweep train: a preset, its overrides, and where the dataset is."""

    preset: str
    hidden: str | None
    bias: bool | None
    batch: int | None
    epochs: int | None
    steps: int | None
    lr: float | None
    seed: int | None
    metrics_every: int | None
    precision: str | None
    dataset: str | None
    data_file: Path | None
    data_dir: Path | None
    offline: bool
    conv: str | None = None
    optimizer: str | None = None
    schedule: str | None = None

    def config(self) -> config_mod.TrainConfig:
        """The preset with the options given applied (checked as it is made)."""
        if self.epochs is not None and self.steps is not None:
            raise UsageError("give --epochs or --steps, not both")
        if self.data_file is not None and self.dataset is not None:
            raise UsageError("give --data FILE.npz or --dataset, not both")
        return config_mod.preset(self.preset).replace(
            hidden=config_mod.parse_hidden(self.hidden) if self.hidden is not None else None,
            bias=self.bias, batch=self.batch, epochs=self.epochs, steps=self.steps, lr=self.lr,
            seed=self.seed, metrics_every=self.metrics_every, precision=self.precision,
            dataset=self.dataset if self.data_file is None else self.data_file.stem,
            conv=config_mod.parse_conv(self.conv) if self.conv else None,
            optimizer=self.optimizer, schedule=self.schedule)

    def load(self, config: config_mod.TrainConfig) -> data_mod.Dataset:
        return load_dataset(config.dataset, self.data_file, self.data_dir, self.offline)

    def resuming(self, model, path: Path) -> Workload:
        """The workload of a run resumed from a saved `model`: its conv layers, hidden sizes, bias,
        seed, batch, lr and dataset, where the command line does not say otherwise (the recipe,
        optimizer and schedule, is the preset's or the options')."""
        info = model.info

        def given_or(value, saved):
            return saved if value is None else value

        dataset = self.dataset
        if dataset is None and self.data_file is None:
            dataset = registered_dataset(info.dataset, path)
        return dataclasses.replace(
            self, hidden=given_or(self.hidden, ",".join(map(str, info.hidden)) or "none"),
            bias=given_or(self.bias, info.bias), seed=given_or(self.seed, info.seed),
            conv=given_or(self.conv, ",".join(f"{c.out_channels}x{c.kernel}" for c in info.convs) or None),
            batch=given_or(self.batch, info.batch), lr=given_or(self.lr, info.lr), dataset=dataset)


def registered_dataset(name: str, model_path: Path) -> str:
    """The dataset a saved model was trained on, when graphtrain can load it by name."""
    if name not in data_mod.DATASETS:
        raise UsageError(f"{model_path} was trained on {name!r}, not a registered dataset: "
                         "give its file with --data FILE.npz")
    return name


def load_dataset(name: str, data_file: Path | None, data_dir: Path | None, offline: bool) -> data_mod.Dataset:
    """A registered dataset by name, or the user's own .npz file (--data)."""
    if data_file is None:
        return data_mod.load(name, data_dir=data_dir, offline=offline)
    if data_dir is not None:
        raise UsageError("give --data FILE.npz or --data-dir, not both")
    data = data_mod.load_npz(data_file)
    for warning in data.warnings:
        err.print(f"[bold yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
    return data


# Where the data comes from: shared by the workload options and `eval`.
DATA_OPTIONS = [
    click.option("--dataset", default=None, type=click.Choice(list(data_mod.DATASETS)),
                 help="Dataset (default: the preset's, mnist; with a saved model, the model's)."),
    click.option("--data", "data_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
                 metavar="FILE.npz",
                 help="Your own data instead: an .npz with x_train, y_train, x_test, y_test, images of any "
                      "size as uint8 0-255 or float 0-1, labels 0 to classes-1."),
    click.option("--data-dir", type=click.Path(path_type=Path), default=None,
                 help="Folder holding the dataset's IDX files (else $GRAPHTRAIN_DATA, else the cache)."),
    click.option("--offline", is_flag=True, help="Never download; fail if the dataset is missing."),
]


WORKLOAD_OPTIONS = [
    click.option("--preset", default="jhu", show_default=True, type=click.Choice(list(config_mod.PRESETS)),
                 help="Named workload (see README)."),
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
    click.option("--precision", default=None, type=click.Choice(list(config_mod.PRECISIONS)),
                 help="The products' operands (fp32 accumulation always); default: each stage's own. "
                      "tf32: cublas to graphs; bf16: bf16, device-loop, persistent and the bf16 peers; "
                      "fp32: persistent's TF32 passes."),
    click.option("--conv", default=None, metavar="CxK,...",
                 help="Conv layers before the hidden ones (the cnn model), e.g. 24x5,32x3; trains on "
                      f"{spoken(models_on('cnn'))}."),
    click.option("--optimizer", default=None, type=click.Choice(list(config_mod.OPTIMIZERS)),
                 help="The update rule (numpy, and graphs through device-loop; the other rungs: sgd)."),
    click.option("--schedule", default=None, type=click.Choice(list(config_mod.SCHEDULES)),
                 help="The learning-rate schedule, --lr its peak (where --optimizer is taken; else constant)."),
    *DATA_OPTIONS,
]
WORKLOAD_FIELDS = tuple(Workload.__dataclass_fields__)


def with_options(options):
    """Apply a list of click options to a command, in the order listed."""

    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def workload_options(command):
    """Give a command the workload options, collected into one `workload: Workload` argument."""

    @functools.wraps(command)
    def with_workload(**kwargs):
        workload = Workload(**{name: kwargs.pop(name) for name in WORKLOAD_FIELDS})
        return command(workload=workload, **kwargs)

    return with_options(WORKLOAD_OPTIONS)(with_workload)


def require(stage: str, model: str = "mlp"):
    """The class of row `stage` that trains `model`, once what it needs (bindings, driver, GPU; a
    framework) is checked: before any data is looked for, so a missing GPU is the first thing the
    user hears of."""
    from graphtrain.peers import PeerUnavailable

    stage_cls = get_stage(stage, model)
    try:
        stage_cls.check_available()
    except (GpuUnavailableError, PeerUnavailable) as exc:
        raise type(exc)(f"{exc}; to train on the CPU instead, use --stage numpy") from None
    return stage_cls


def check_rows(stages: list[str], peers: list[str], peers_named: bool, check_peer=None) -> tuple[list[str], dict[str, list[str]]]:
    """Before any data is read, what the rows asked for need: the GPU rungs a usable GPU (none:
    refused with the CPU's way, --stages numpy), each peer its framework and a GPU it can see.
    A peer named with --peer that cannot run is refused; one of the default peers is left out.
    Returns (the peers that can run, {why: the default peers left out for it}).
    `check_peer(name)`: a peer's check where it is not a graphtrain.stages row (the sweep's packs)."""
    from graphtrain.peers import PeerUnavailable

    gpu_rungs = [name for name in stages if name in LADDER and SPECS[name].uses_gpu]
    if gpu_rungs:
        try:
            get_stage(gpu_rungs[0]).check_available()
        except GpuUnavailableError as exc:
            rungs = ", ".join(gpu_rungs) if len(gpu_rungs) <= 3 else f"{gpu_rungs[0]} and {len(gpu_rungs) - 1} more"
            raise GpuUnavailableError(f"{exc}; the GPU rungs asked for ({rungs}) cannot run here: "
                                      "to train on the CPU, use --stages numpy") from None
    runnable, left_out = [], {}
    for peer in peers:
        try:
            (check_peer or (lambda name: get_stage(name).check_available()))(peer)
        except PeerUnavailable as exc:
            if peers_named:
                raise PeerUnavailable(f"peer {peer}: {exc}; leave it out of --peer, or give --no-peers") from None
            left_out.setdefault(str(exc), []).append(peer)
        else:
            runnable.append(peer)
    return runnable, left_out


def left_out_note(left_out: dict[str, list[str]]) -> str:
    """The default peers that did not run, said once per reason."""
    return "; ".join(f"{', '.join(peers)}: {why}" for why, peers in left_out.items())


PROFILE_OPTION = click.option(
    "--profile", is_flag=True,
    help="After the timed epochs, run one more under CUPTI: kernels and launches per step, GPU-busy "
         "ms per epoch and the share of it the GPU sat idle (needs graphtrain[profile]).")


def check_profile(profile: bool) -> None:
    """Before any work: --profile without CUPTI is a usage error that says what to install."""
    if profile:
        from graphtrain.profile import require_cupti

        require_cupti()


def name_list(text: str | None, default: list[str]) -> list[str]:
    """'a,b' -> ['a', 'b']; None -> default."""
    if text is None:
        return list(default)
    return [name.strip() for name in text.split(",") if name.strip()]


def click_error_line(error: click.ClickException) -> str:
    """click's own error (a bad option value, a missing argument, an unknown command) as the one
    line every other error is, with where to read the command's options."""
    message = error.format_message()
    context = getattr(error, "ctx", None)
    if isinstance(error, click.UsageError) and context is not None:
        command = " ".join(["graphtrain", *context.command_path.split()[1:]])
        message += f" (see {command} --help)"
    return message


class Graphtrain(click.Group):
    """The command group, whose click errors are written as `error: ...` in one line, with exit
    code 2 (click's usage errors) like graphtrain's own, not as click's `Usage:` block."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.Abort:  # click's Ctrl-C; __main__ makes it "interrupted", 130
            raise KeyboardInterrupt from None
        except click.ClickException as error:
            fail(click_error_line(error), error.exit_code)
        if standalone_mode:
            sys.exit(code if isinstance(code, int) else 0)
        return code


@click.group(cls=Graphtrain, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(version=graphtrain_version, prog_name="graphtrain")
def main():
    """Train MNIST-style classifiers on an NVIDIA GPU, rung by rung up the optimisation ladder.

    \b
    graphtrain run --stage graphs          train one model with one stage
    graphtrain run --stage numpy           the same on the CPU, no GPU needed
    graphtrain run --save m.safetensors    keep the trained model (eval, predict, --init)
    graphtrain eval --model m.safetensors  its test accuracy, per class, confusion matrix
    graphtrain ladder                      every stage and the framework peers, into results/
    graphtrain compare A.json B.json       two ladders side by side, row by row
    graphtrain info                        what this machine offers
    graphtrain data download               fetch MNIST into the cache
    """


# --------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------


@main.command()
@click.option("--stage", default="numpy", show_default=True, type=click.Choice(row_names()),
              help="Which rung trains (ladder order; numpy is the CPU reference), or a framework peer.")
@workload_options
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
              default=None, help="Write the run record (per-epoch times, losses, environment) here; "
                                 "'-' prints it on stdout.")
@click.option("--save", "save_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              metavar="MODEL.safetensors",
              help="Keep the trained model: its parameters in PyTorch's nn.Sequential layout, with "
                   "what it is and how it was trained (for eval, predict, --init, graphtrain.to_torch).")
@click.option("--init", "init_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              metavar="MODEL.safetensors",
              help="Resume training a saved model: start from its parameters and go on with its next "
                   "epoch's sample order (epochs are numbered on from its count). Its conv layers, hidden "
                   "sizes, bias, seed, batch, lr and dataset are the defaults; --epochs/--steps say how much "
                   "more to train. The optimizer's state and the learning-rate schedule start afresh over "
                   "this run's steps (SGD at a constant rate goes on exactly as one longer run).")
@PROFILE_OPTION
@click.option("--gpus", type=int, default=None, metavar="N",
              help="Train data-parallel on N GPUs of this host, one process each, the gradients summed "
                   "through NCCL every step: --batch is per GPU, and the run is one GPU's at the combined "
                   "batch N × --batch, its samples in the same order (the graphs rung, MLPs and the cnn; needs "
                   "graphtrain[nccl-cu13] or [nccl-cu12]).")
@click.option("-v", "--verbose", is_flag=True,
              help="Also print where the command's time went, phase by phase (the record's `phases`).")
def run(stage, workload, json_path, save_path, init_path, profile, verbose, gpus):
    """Train one model with one stage; print per-epoch loss, accuracy and time."""
    from graphtrain import model_io, phases
    from graphtrain.training import begin_first_uses, plan_for, row_for, run_stage

    to_stdout = json_path is not None and str(json_path) == "-"
    with reported_errors():
        files.check_outputs({"--json": json_path, "--save": save_path},
                            {"--init": init_path, "--data": workload.data_file})
        init = None
        if init_path is not None:
            init = model_io.load(init_path)
            workload = workload.resuming(init, init_path)
        cfg = workload.config()
        if save_path is not None and str(save_path) == "-":
            raise UsageError("--save writes a binary file: give it a name (MODEL.safetensors); "
                             "'-' (standard output) is not supported")
        ranks = None
        if gpus is not None:  # refused before any data is read: the rung, NCCL, the GPUs
            from graphtrain import data_parallel

            data_parallel.check_request(gpus, stage, cfg, profile, init_path is not None)
            ranks = data_parallel.require(gpus)
            batch_text = f"batch {cfg.batch} per GPU × {gpus} GPUs = {cfg.batch * gpus}"
            cfg = cfg.replace(batch=cfg.batch * gpus)  # the plan is one GPU's at the combined batch
        else:
            check_profile(profile)
            stage_cls = row_for(require(stage, cfg.model), cfg)  # refused if it cannot train the recipe
            stage_cls.check_precision(cfg.precision)
            batch_text = f"batch {cfg.batch}"
            begin_first_uses(stage_cls)  # the libraries' first-call costs, beside the data loading
        phases.advance("data")
        data = workload.load(cfg)
        plan = plan_for(cfg, data, init)
        phases.advance("setup")
        length = terminal.counted(cfg.epochs, "epoch") if cfg.epochs else terminal.counted(cfg.steps, "step")
        log(f"graphtrain: stage {stage}, model {plan.config.layers_text}, {batch_text}, "
            f"lr {cfg.lr}, {length}, data {data.source or data.name}")
        with epoch_progress(plan.num_epochs, stage) as progress:
            if ranks is not None:
                from graphtrain.sweep import DataSource

                source = DataSource(cfg.dataset if workload.data_file is None else "npz", workload.data_file,
                                    workload.data_dir, workload.offline)
                record = data_parallel.train(plan, ranks, source, progress, stage)
            else:
                record = run_stage(stage_cls, plan, data, progress, profile=profile)
        phases.advance("writing")
        record.command = command_line()
        record.init = None if init_path is None else str(init_path)
        if save_path is not None:
            model_io.save(save_path, record)
            log(f"model saved to {save_path}")
        for warning in record.warnings:
            err.print(f"[bold yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
        # With the record on stdout, the table goes to stderr, so stdout is the JSON alone; it is
        # printed first so that the record's phases cover it.
        (err if to_stdout else out).print(summary_table(record))
        phases.leaving()
        record.phases, record.phases_from = phases.snapshot(), phases.origin()
        if verbose:
            err.print(phases_text(record.phases, record.phases_from), highlight=False, soft_wrap=True)
        if to_stdout:
            sys.stdout.write(json.dumps(record.to_json(), indent=2, default=str) + "\n")
        elif json_path is not None:
            files.write_json(json_path, record.to_json())
            log(f"run record written to {json_path}")


def phases_text(ms: dict[str, float], origin: str = "process") -> str:
    """One line: each phase's ms, then their sum: the wall time since the process started, or
    since graphtrain's import where the process's start could not be read (graphtrain.phases)."""
    parts = [f"{name.replace('_', ' ')} {value:.0f}" for name, value in ms.items()]
    since = "the process's start" if origin == "process" else "graphtrain's import (the process's start is unknown)"
    return f"phases (ms): {', '.join(parts)}; total {sum(ms.values()):.0f} since {since}"


@contextmanager
def epoch_progress(num_epochs: int, label: str):
    """A progress bar on stderr, one tick per epoch, showing the last measured metrics; yields
    the trainer's progress callback."""
    with terminal.progress_bar() as bar:
        task = bar.add_task(label, total=num_epochs, status="setup")

        def on_epoch(epoch: int, num_epochs: int, entry) -> None:
            text = f"{entry.ms:8.2f} ms"
            if entry.train_loss is not None:
                text += f"  loss {loss_text(entry.train_loss)}"
            if entry.test_accuracy is not None:
                text += f"  test acc {100 * entry.test_accuracy:.2f}%"
            bar.update(task, advance=1, status=text)

        yield on_epoch


def loss_text(loss: float) -> str:
    """Four decimals, or four significant digits for a loss that has blown up (5.051e+33)."""
    return f"{loss:.4f}" if abs(loss) < 1e4 else f"{loss:.4g}"


def summary_table(record):
    """The per-epoch table, then its footer as lines of their own (wrapped at the terminal's
    width, not squeezed into the table's): a rich Group."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    def pct(value):
        return "" if value is None else f"{100 * value:.2f}%"

    table = Table(title=f"graphtrain {record.stage}", show_header=True)
    for column in ("epoch", "ms", "train loss", "train acc", "test acc"):
        table.add_column(column, justify="right")
    for e in record.epochs:
        table.add_row(str(e.epoch), f"{e.ms:.2f}", "" if e.train_loss is None else loss_text(e.train_loss),
                      pct(e.train_accuracy), pct(e.test_accuracy))
    footer = (f"median epoch (2nd half) {record.epoch_ms:.2f} ms · setup {record.setup_ms:.0f} ms · "
              f"total {record.total_ms:.0f} ms · test accuracy {pct(record.test_accuracy)}")
    profile = record.profile
    if profile:
        footer += (f"\nprofiled epoch (CUPTI): GPU busy {profile['busy_ms']:.2f} ms per epoch, idle "
                   f"{profile['idle_share']:.0%} of the median epoch; {profile['kernels_per_step']:.1f} "
                   f"kernels and {profile['launches_per_step']:.1f} host launches per step")
    return Group(table, Text(footer))


@main.command()
def info():
    """What this machine offers: Python, numpy, GPU and driver, CUDA libraries, peers."""
    import importlib.util

    from rich.table import Table

    from graphtrain import environment

    found = environment.probe()
    out.print(escape(environment.verdict(found)), highlight=False, soft_wrap=True)
    out.print(escape(mnist_whereabouts()), highlight=False, soft_wrap=True)
    host = environment.host()
    table = Table(show_header=True, title="graphtrain info")
    table.add_column("component")
    table.add_column("status")
    table.add_column("details", overflow="fold")
    table.add_row("python", "ok", f"{host['python']} ({sys.executable})")
    table.add_row("numpy", "ok", host["numpy"])
    hints_given: dict[str, str] = {}  # install hint -> the first row that gave it
    for name, finding in found.items():
        status = "[green]found[/]" if finding.get("found") else "[red]missing[/]"
        hint = finding.get("install")
        error = finding.get("error", "")
        if hint is not None and (re.search(r"\binstall\b", error) or error.startswith("needs ")):  # said already, or above
            finding = {k: v for k, v in finding.items() if k != "install"}
        elif hint in hints_given:
            finding = {**finding, "install": f"as for {hints_given[hint]}"}
        elif hint is not None:
            hints_given[hint] = name
        details = "; ".join(f"{k}: {v}" if k != "error" else str(v) for k, v in finding.items()
                            if k != "found" and v not in (None, ""))
        table.add_row(name, status, escape(details))
    optional = {"torch": "optional: the ladder skips the torch peers without it",
                "jax": "optional: the ladder skips the jax peers without it",
                "matplotlib": "optional, for plots only (a ladder's or sweep's, eval --plot): without it "
                              "the tables are still written"}
    for name, use in optional.items():
        spec = importlib.util.find_spec(name)
        table.add_row(name, "[green]importable[/]" if spec else "[yellow]absent[/]", "" if spec else use)
    from graphtrain.profile import cupti_missing

    missing = cupti_missing()
    table.add_row("cupti", "[yellow]absent[/]" if missing else "[green]importable[/]",
                  escape(f"optional, for --profile: {missing}") if missing else "")
    out.print(table)


def mnist_whereabouts() -> str:
    """Where `graphtrain run` finds MNIST (the folder, and which setting points there), or that
    it is not there and what fetches it. Reads nothing but the folders' listings."""
    from graphtrain.data.load import find_files

    try:
        lookup = find_files("mnist")
    except GraphtrainError as exc:  # GRAPHTRAIN_DATA names a file, say
        return f"MNIST: {exc}"
    via = "GRAPHTRAIN_DATA" if lookup.explicit else "the cache"
    if lookup.complete:
        return f"MNIST: found in {lookup.folder} ({via})"
    where = " or ".join(map(str, lookup.searched))
    fetch = ("give a folder that holds it" if lookup.explicit
             else "`graphtrain data download` (or the first run) fetches it")
    return f"MNIST: not in {where} ({via}); {fetch}"


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
        if dest is not None:
            files.check_writable(dest, folder=True)
        folder = data_mod.download(dataset, dest=dest)
    out.print(f"{dataset} is in {folder}")


# --------------------------------------------------------------------------------------------
# ladder and sweep
# --------------------------------------------------------------------------------------------

ROW_OPTIONS = [
    click.option("--peers/--no-peers", "peers_flag", default=True, help="Also run the framework peers."),
    click.option("--peer", "peer_names", default=None, metavar="P1,P2",
                 help=f"Which peers (default: {', '.join(PEERS)})."),
    click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("results"),
                 show_default=True,
                 help="Where the Markdown, JSON and plots go, named <ladder|sweep>-<workload>-<model>-<GPU>[-partial].*; "
                      "each row's own output goes to <out>/logs/."),
    click.option("--force", is_flag=True,
                 help="Write the files under the complete table's name even when rows failed or were "
                      "skipped (or, for the ladder, only some rows were chosen); by default such a run "
                      "is tagged -partial."),
]


def row_options(command):
    for option in reversed(ROW_OPTIONS):
        command = option(command)
    return command


def exit_if_nothing_ran(records) -> None:
    """A ladder or sweep in which every row failed or was skipped is a failure (exit 1)."""
    if all(r.failed for r in records):
        err.print("[bold red]error:[/] no row of the table ran; see the notes above")
        sys.exit(1)


def where_to_write(out_dir: Path) -> Path | None:
    """--out, or None (write nothing) where it was left at its default and there is no GPU: a
    table of skipped rows is not put into the checkout's results/ unless asked for."""
    source = click.get_current_context().get_parameter_source("out_dir")
    if source is not click.core.ParameterSource.DEFAULT:
        return out_dir
    try:
        get_stage(next(name for name in LADDER if SPECS[name].uses_gpu)).check_available()  # is there a GPU?
    except GpuUnavailableError:
        log(f"no GPU here: the table is shown, not written into {out_dir}/ (--out DIR writes it)")
        return None
    return out_dir


@contextmanager
def removed_unless_finished(folder: Path | None):
    """A folder the command creates is removed again if it stops before it is done
    (interrupted, or an error): no empty or half-filled --out folder is left behind."""
    existed = folder is None or folder.exists()
    try:
        yield
    except BaseException:
        if not existed and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
        raise


def prepare_rows(workload: Workload, stages: str | None, default_stages: list[str], peers_flag: bool,
                 peer_names: str | None, out_dir: Path):
    """Config, rows and output folder checked, then the dataset loaded: (config, stages, peers, data)."""
    cfg = workload.config()
    stage_list = name_list(stages, default_stages)
    peer_list = name_list(peer_names, list(PEERS)) if peers_flag else []
    check_names(stage_list, peer_list)
    # The default peers a machine lacks stay in the ladder's table as skipped rows: only the
    # peers named are checked here.
    check_rows(stage_list, peer_list if peer_names is not None else [], peers_named=True)
    files.check_writable(out_dir, folder=True)
    return cfg, stage_list, peer_list, workload.load(cfg)


@main.command()
@workload_options
@click.option("--stages", default=None, metavar="S1,S2", help="Stages to run (default: all, in ladder order).")
@row_options
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run each row this many times from a fresh setup; the table shows the median "
                   "epoch time and the range.")
@PROFILE_OPTION
def ladder(workload, stages, peers_flag, peer_names, out_dir, force, repeat, profile):
    """Reproduce the optimisation table: every stage, then the peers, on one workload."""
    from graphtrain import ladder as ladder_mod

    with reported_errors():
        check_profile(profile)
        cfg, stage_list, peer_list, dataset = prepare_rows(workload, stages, list(LADDER), peers_flag,
                                                           peer_names, out_dir)
        out_dir = where_to_write(out_dir)
        with removed_unless_finished(out_dir):
            records = ladder_mod.run_ladder(cfg, stages=stage_list, peers=peer_list, data=dataset,
                                            out_dir=out_dir, command=command_line(), console=err,
                                            repeat=repeat, profile=profile, force=force)
    out.print(ladder_mod.ladder_table([r.to_json() for r in records]))
    exit_if_nothing_ran(records)


@main.command()
@workload_options
@click.option("--hidden-sizes", default=None, metavar="H1,H2,...",
              help="Hidden widths to sweep, e.g. 128,256,512 (every hidden layer that wide; how many "
                   "layers: --depth).")
@click.option("--depth", type=click.IntRange(1), default=None, metavar="N",
              help="Hidden layers of each swept width (with --hidden-sizes). Default: as many as the "
                   "preset's model has, or 3 where it has none (jhu: softmax regression).")
@click.option("--lrs", default=None, metavar="LR1,LR2,...", help="Learning rates to sweep, e.g. 0.05,0.1,0.2.")
@click.option("--seeds", default=None, metavar="S1,S2,... or A-B",
              help="Seeds to sweep (initial weights and sample order), e.g. 0,1,2 or 0-7.")
@click.option("--stages", default="graphs", show_default=True, metavar="S1,S2", help="Stages to time.")
@row_options
@click.option("--gpus", default=None, metavar="all|N",
              help="One worker process per GPU (all of this host's, or the first N); rows are "
                   "scheduled over them and gathered into one table.")
@click.option("--cluster", default=None, metavar="local|ADDRESS",
              help="Run the rows as tasks on a Dask cluster: 'local' starts one on this host (one "
                   "worker per GPU; --gpus says how many), else a scheduler's address "
                   "(needs graphtrain[cluster]).")
@click.option("--pack/--no-pack", default=True, show_default=True,
              help="Train the models of one row that differ only in lr and seed together on one GPU, each "
                   "bit-identical to its run alone: the persistent rung's softmax regressions (one thread-block "
                   "cluster each) and the cnns on graphs and device-loop (each its own graphs, on streams side by "
                   "side). --no-pack: every model runs alone, set up once per shape and restarted.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
              default=None, help="Write every row's record (and the sweep's wall time) here; '-' prints it on stdout.")
def sweep(workload, hidden_sizes, depth, lrs, seeds, stages, peers_flag, peer_names, out_dir, force, gpus, cluster,
          pack, json_path):
    """Train the cross product of hidden sizes, learning rates and seeds with chosen stages and peers."""
    from graphtrain import phases, report
    from graphtrain import sweep as sweep_mod
    from graphtrain.plan import RunPlan

    to_stdout = json_path is not None and str(json_path) == "-"
    with reported_errors():
        cfg = workload.config()
        stage_list = name_list(stages, ["graphs"])
        peer_list = name_list(peer_names, list(PEERS)) if peers_flag else []
        ordinary_peers = [p for p in peer_list if p not in PACKED_PEERS]
        if stage_list or ordinary_peers:
            check_names(stage_list, ordinary_peers)
        sizes = config_mod.parse_hidden(hidden_sizes) if hidden_sizes is not None else ()
        if hidden_sizes is not None and not sizes:
            raise UsageError("--hidden-sizes needs at least one size")
        if depth is not None and not sizes:
            raise UsageError("--depth is the depth of the swept widths: give --hidden-sizes too")
        left_out = {}
        if cluster is None or cluster == "local":  # a remote cluster's workers have what they have
            peer_list, left_out = check_rows(stage_list, peer_list, peers_named=peer_names is not None,
                                             check_peer=sweep_mod.check_peer)
            if not stage_list and not peer_list:
                raise UsageError(f"no row of the sweep can run here: {left_out_note(left_out)}")
        points = sweep_mod.expand_grid(cfg, stage_list, peer_list, sizes, sweep_mod.parse_floats("--lrs", lrs),
                                       sweep_mod.parse_seeds(seeds), depth=depth)
        files.check_outputs({"--json": json_path}, {"--data": workload.data_file})
        files.check_writable(out_dir, folder=True)
        out_dir = where_to_write(out_dir)
        if cluster is not None:
            from graphtrain.cluster import DaskCluster

            engine = DaskCluster.for_request(cluster, gpus)
        elif gpus is not None:
            from graphtrain.workers import GpuWorkers

            engine = GpuWorkers.for_request(gpus)
        else:
            engine = sweep_mod.InProcess()
        source = sweep_mod.DataSource(cfg.dataset if workload.data_file is None else "npz", workload.data_file,
                                      workload.data_dir, workload.offline)
        data = workload.load(cfg)  # checked here, once, before any worker starts
        for point in points:
            RunPlan.check_workload(point.config.replace(in_features=data.num_features, classes=data.num_classes),
                                   len(data.train_images), len(data.test_images))
        log(f"graphtrain sweep: {len(points)} models on {engine.description}")
        with removed_unless_finished(out_dir), terminal.progress_bar(err) as bar:
            progress = bar.add_task("sweep", total=len(points), status="models")

            def on_task(task, rows):
                bar.update(progress, advance=len(rows), status=escape(task.label))

            rows, summary = sweep_mod.run_sweep(points, engine, source, data=data, pack=pack, on_task=on_task)
            # The process's wall from its start (graphtrain.phases) to the sweep's end: the report's
            # writing after it, and the process's teardown, are not counted.
            sweep_mod.add_process_wall(summary, sum(phases.snapshot().values()), phases.origin())
            if left_out:
                summary["peers_left_out"] = left_out
            for row in rows:
                row["command"] = command_line()
            if out_dir is not None:
                label = sweep_mod.grid_label(cfg, bool(sizes), lrs is not None, seeds is not None, depth)
                partial = not force and report.has_problems(rows)
                write = report.write_sweep if sweep_mod.only_sizes_vary(points, rows) else sweep_mod.write_grid
                for path in write(rows, label, out_dir, command_line(), log=terminal.logger(err), partial=partial,
                                  summary=summary):
                    err.print(f"wrote {escape(str(path))}")
        document = {"sweep": summary, "command": command_line(), "records": rows}
        if to_stdout:
            sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")
        elif json_path is not None:
            files.write_json(json_path, document)
            log(f"sweep records written to {json_path}")
    (err if to_stdout else out).print(sweep_mod.grid_table(rows, summary))
    if left_out:
        (err if to_stdout else out).print(f"note: not run, {escape(left_out_note(left_out))}", highlight=False,
                                          soft_wrap=True)
    if not any(report.is_ok(row) for row in rows):
        err.print("[bold red]error:[/] no row of the table ran; see the notes above")
        sys.exit(1)


# --------------------------------------------------------------------------------------------
# Using a saved model: eval and predict
# --------------------------------------------------------------------------------------------

MODEL_OPTION = click.option(
    "--model", "model_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
    help="A model saved by `graphtrain run --save` (.safetensors).")


@main.command("eval")
@MODEL_OPTION
@with_options(DATA_OPTIONS)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also draw the confusion matrix into this PNG (needs matplotlib).")
def eval_command(model_path, dataset, data_file, data_dir, offline, plot_path):
    """Test accuracy and loss of a saved model, per class, and its confusion matrix.

    The test split is the model's own dataset's, unless --dataset or --data names another.
    Evaluation runs on the CPU with NumPy, in float32 with the numpy stage's forward pass, so a
    model the numpy stage trained shows exactly the test accuracy its run reported; a model a
    GPU stage trained may differ from its run's by the few samples whose two top logits nearly
    tie. There is no GPU evaluation: a test pass of a model this size takes well under a second.
    """
    from graphtrain import evaluate, model_io

    with reported_errors():
        if plot_path is not None:
            evaluate.require_matplotlib()
        files.check_outputs({"--plot": plot_path}, {"--model": model_path, "--data": data_file})
        model = model_io.load(model_path)
        if dataset is None and data_file is None:
            dataset = registered_dataset(model.info.dataset, model_path)
        data = load_dataset(dataset, data_file, data_dir, offline)
        model_io.check_data(model, model_path, data.num_features, data.num_classes, str(data.source or data.name))
        result = evaluate.evaluate(model, data.test_images, data.test_labels, model.info.classes)
        if plot_path is not None:
            evaluate.plot_confusion(result, plot_path, f"{model_path.name} on {data.name}")

    out.print(evaluate.class_table(result))
    out.print(evaluate.confusion_table(result))
    out.print(f"{model_path} ({model.info.describe()}) on the {data.name} test set, "
              f"{result.samples} samples: accuracy {100 * result.accuracy:.2f}%, loss {result.loss:.4f}",
              soft_wrap=True)
    if plot_path is not None:
        log(f"confusion matrix drawn in {plot_path}")


@main.command()
@MODEL_OPTION
@click.argument("input_path", metavar="INPUT", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the predictions (CSV: index,class,probability) here instead of to stdout.")
def predict(model_path, input_path, out_path):
    """Predict the class of each image in INPUT, with the model's probability for it.

    \b
    INPUT is an IDX images file (gzipped or not, like t10k-images-idx3-ubyte.gz) or a
    .npy array of shape (N, H, W) with the model's image size, e.g. (N, 28, 28), or
    (N, features), e.g. (N, 784); a cnn's also (N, channels, H, W). Pixels are
    uint8 0-255 (divided by 255, as in training) or floats already in 0-1; a model
    trained on normalised inputs (the cnn) normalises them as its file records.

    Prints CSV (index,class,probability) to stdout, or writes it to --out.
    Runs on the CPU with NumPy.
    """
    from graphtrain import evaluate, model_io
    from graphtrain.data import images

    with reported_errors():
        files.check_outputs({"--out": out_path}, {"--model": model_path, "INPUT": input_path})
        model = model_io.load(model_path)
        features = model.features(images.read_images(input_path), str(input_path))
        predicted, probability = evaluate.predict(model, features)
        if out_path is not None:
            evaluate.write_predictions(out_path, predicted, probability)
    if out_path is None:
        click.echo(evaluate.predictions_csv(predicted, probability), nl=False)
    else:
        log(f"{len(predicted)} predictions written to {out_path}")


@main.command()
@click.argument("a", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("b", type=click.Path(dir_okay=False, path_type=Path))
def compare(a, b):
    """Two ladder (or sweep) JSON reports side by side: epoch times, their ratio, accuracy.

    \b
    graphtrain compare results/ladder-jhu-softmax-h100.json my-results/ladder-jhu-softmax-rtx4090.json
    """
    from graphtrain import compare as compare_mod

    with reported_errors():
        first, second = compare_mod.load(a), compare_mod.load(b)
        compare_mod.check_comparable(first, second)
    out.print(compare_mod.table(first, second))


# --------------------------------------------------------------------------------------------
# speedrun
# --------------------------------------------------------------------------------------------


@main.command()
@click.option("--seeds", type=click.IntRange(1), default=10, show_default=True, help="Runs per row: seeds 0..N-1.")
@click.option("--stages", default=None, metavar="A,B",
              help=f"graphtrain rows (default {','.join(speedrun_defaults('stage'))}; "
                   f"also {', '.join(n for n in speedrun_names('stage') if n not in speedrun_defaults('stage'))}).")
@click.option("--peer", "peers", default=None, metavar="A,B",
              help=f"Peers (default {','.join(speedrun_defaults('peer'))}; "
                   f"also {', '.join(n for n in speedrun_names('peer') if n not in speedrun_defaults('peer'))}; 'none').")
@click.option("--rows", default=None, metavar="A,B", help="Exactly these rows, in this order (stages and peers).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the results as JSON.")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the results table as Markdown, with its header.")
@click.option("--holdout", type=click.IntRange(0), default=0, show_default=True,
              help="Train on all but the last N training samples and report accuracy on those (for tuning).")
@click.option("--precision", default="tf32", show_default=True, type=click.Choice(["tf32", "fp32"]),
              help="The convolutions' and products' precision, for every row that has the choice (numpy "
                   "computes in float32; each row's result says its own).")
@click.option("--conv", default=None, metavar="CxK,...", help="Conv layers, e.g. 24x5,32x3.")
@click.option("--hidden", default=None, metavar="H1,...", help="Hidden linear layers, e.g. 256.")
@click.option("--batch", type=int, default=None, help="Batch size.")
@click.option("--epochs", type=int, default=None, help="Epochs.")
@click.option("--lr", type=float, default=None, help="Peak learning rate.")
@click.option("--optimizer", default=None, type=click.Choice(list(config_mod.OPTIMIZERS)))
@click.option("--schedule", default=None, type=click.Choice(list(config_mod.SCHEDULES)))
@click.option("--betas", default=None, metavar="B1,B2", help="Adam's betas, e.g. 0.7,0.9.")
@click.option("--warmup", type=int, default=None, help="Warm-up steps (the warmup schedule).")
@click.option("--weight-decay", type=float, default=None)
@click.option("--conv-path", default="fused", show_default=True, type=click.Choice(["fused", "cudnn"]),
              help="graphtrain's conv layers: convpool.cu's fused kernels (where they fit), or cuDNN's.")
@click.option("--process-wall/--no-process-wall", default=True, show_default=True,
              help="Also time one run of each row as its own process, start to exit.")
@click.option("--data-dir", type=click.Path(path_type=Path), default=None,
              help="Folder holding MNIST's IDX files (else $GRAPHTRAIN_DATA, else the cache).")
def speedrun(seeds, stages, peers, rows, json_path, md_path, holdout, precision, conv, hidden, batch, epochs, lr,
             optimizer, schedule, betas, warmup, weight_decay, conv_path, process_wall, data_dir):
    """Time to 99% on MNIST: the speedrun preset (train_mnist_fast's recipe) N times per row.

    Reports per row the test accuracy's mean and spread over the seeds, the median time from
    model construction to test accuracy (the row set up once beforehand: data on the GPU, kernels
    compiled, graphs captured), and the wall time of one run as its own process.
    """
    from rich.table import Table

    from graphtrain import report, speedrun as sr

    with reported_errors():
        try:
            parsed_betas = tuple(float(v) for v in betas.split(",")) if betas else None
        except ValueError:
            raise UsageError(f"--betas wants two numbers like 0.7,0.9, got {betas!r}") from None
        if parsed_betas is not None and len(parsed_betas) != 2:
            raise UsageError(f"--betas wants two numbers like 0.7,0.9, got {betas!r}")
        cfg = config_mod.preset("speedrun").replace(
            conv=config_mod.parse_conv(conv) if conv else None,
            hidden=config_mod.parse_hidden(hidden) if hidden else None, batch=batch, epochs=epochs, lr=lr,
            optimizer=optimizer, schedule=schedule, betas=parsed_betas, warmup=warmup, weight_decay=weight_decay)
        if rows:
            names = name_list(rows, [])
        else:
            names = (name_list(stages, speedrun_defaults("stage"))
                     + [p for p in name_list(peers, speedrun_defaults("peer")) if p != "none"])
        unknown = [n for n in names if n not in speedrun_names()]
        if unknown or not names:
            raise UsageError(f"unknown speedrun row(s) {', '.join(unknown)}; choose from "
                             f"{', '.join(speedrun_names())}" if unknown else "no rows to run")
        files.check_outputs({"--json": json_path, "--markdown": md_path})
        cfg = cfg.replace(precision=precision)
        check_speedrun_rows(names, cfg)
        data = data_mod.load("mnist", data_dir=data_dir)
        case = sr.SpeedrunCase.of(cfg, data, holdout, conv_path)
        seed_list = list(range(seeds))
        forwarded = [a for a in sys.argv[1:] if a not in ("speedrun",)]
        results = []
        for name in names:
            def progress(row, seed, acc, ms):
                log(f"{row} seed {seed}: {100 * acc:.2f}% in {ms:.2f} ms")

            result = sr.run_row(name, case, seed_list, progress)  # each row's needs checked above
            if process_wall and result.accuracies:
                result.process_wall_s = sr.process_wall(name, _without_row_options(forwarded))
            results.append(result)
        doc = sr.summary(results, case, command_line(), report.utc_now())
        table = Table(title=f"speedrun: {len(seed_list)} seed(s), accuracy on the {case.evaluated_on} set")
        for column in ("row", "accuracy", "spread", "median ms", "× fastest peer", "process s", "note"):
            table.add_column(column)
        for r in doc["rows"]:
            if r.get("error"):
                table.add_row(r["name"], "", "", "", "", "", escape(r["error"]))
                continue
            speed = f"{r['speedup_vs_fastest_peer']:.2f}x" if r.get("speedup_vs_fastest_peer") else ""
            wall = f"{r['process_wall_s']:.2f}" if r.get("process_wall_s") is not None else ""
            table.add_row(r["name"], f"{100 * r['accuracy_mean']:.2f}%",
                          f"±{100 * r['accuracy_std']:.2f} ({100 * r['accuracy_min']:.2f}–{100 * r['accuracy_max']:.2f})",
                          f"{r['time_ms_median']:.2f}", speed, wall, escape(r["note"]))
        out.print(table)
        if json_path:
            files.write_json(json_path, doc)
        if md_path:
            files.write_atomic(md_path, sr.markdown(doc))


def check_speedrun_rows(names: list[str], cfg) -> None:
    """Every row's needs, before the data is read: a row that cannot train the recipe is refused
    with the reason; what cannot run here is refused, all of it said in one line, with the options
    that leave it out."""
    from graphtrain import speedrun as sr
    from graphtrain.peers import PeerUnavailable

    missing: dict[str, list[str]] = {}  # why -> the rows it stops
    for name in names:
        try:
            sr.check_row(name, cfg)
        except (GpuUnavailableError, PeerUnavailable) as exc:
            missing.setdefault(str(exc), []).append(name)
        except ModelUnsupported as exc:
            if SPECS[name].kind != "peer":
                raise
            raise ModelUnsupported(f"{exc}; --peer none leaves the peers out") from None
    if missing:
        gpu_rows = [n for n in names if SPECS[n].kind == "stage" and SPECS[n].uses_gpu]
        peers = [n for n in names if SPECS[n].kind == "peer"]
        ways = []
        if gpu_rows and any(set(rows) & set(gpu_rows) for rows in missing.values()):
            ways.append("--stages numpy to time the CPU's row alone")
        if peers and any(set(rows) & set(peers) for rows in missing.values()):
            ways.append("--peer none (or the peers that can run) to leave the peers out")
        raise MissingRequirement("cannot run " + "; ".join(f"{', '.join(rows)}: {why}" for why, rows in missing.items())
                                 + (f"; use {' and '.join(ways)}" if ways else ""))


def _without_row_options(argv: list[str]) -> list[str]:
    """The speedrun arguments minus those the per-row process sets itself (rows, seeds, outputs)."""
    drop_with_value = {"--seeds", "--stages", "--peer", "--rows", "--json", "--markdown"}
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in drop_with_value:
            skip = "=" not in arg
            continue
        if name in ("--process-wall", "--no-process-wall"):
            continue
        kept.append(arg)
    return kept
