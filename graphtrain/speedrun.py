"""`graphtrain speedrun`: time to 99% on MNIST, as the field measures it.

train_mnist_fast's protocol: the data already on the GPU and the kernels compiled, the clock
runs from model construction (the initial weights put on the device) through one epoch of
training to the test accuracy as a number on the host. Each row trains the same recipe from the
same initial weights in the same sample order for every seed: seed s's run plan
(graphtrain.plan.RunPlan, the preset with seed s) gives them, on the same normalised images.

A row is a registry row whose class trains the speedrun's model (graphtrain.stages: the cnn's
rungs and the peers' cnn classes), driven as every runner drives a `Stage`. It is set up once,
untimed and reported apart (compile, cuDNN's algorithm search, the data's upload, warm-up, graph
capture); then per seed the clock covers `restart(plan)` (the seed's initial weights, orders and
recipe put on the set-up row), the plan's epochs (`train_epoch`) and `test_accuracy()`, timed
with perf_counter. A row that cannot take a seed's plan in place is set up anew for it (untimed),
and the result says how many setups a row took.

`holdout` > 0 trains on the training set's first N − holdout samples and reports accuracy on
the last `holdout` ones instead of the test set: where the recipe is tuned.
"""

from __future__ import annotations

import dataclasses
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from graphtrain import environment, report, stages, training
from graphtrain.config import TrainConfig, cnn_spec
from graphtrain.data import Dataset
from graphtrain.errors import UsageError
from graphtrain.kernels import ceil_div
from graphtrain.plan import RunPlan
from graphtrain.recipe import MNIST_MEAN, MNIST_STD, Recipe, recipe_of
from graphtrain.reference_cnn import CnnSpec
from graphtrain.stages.base import Stage


@dataclass
class SpeedrunCase:
    """What every row of a speedrun trains: the config (the speedrun preset and the options, its
    precision the one asked for), the dataset (with a holdout, its split), and where accuracy is
    measured. Each seed's run plan is built once and shared by the rows."""

    config: TrainConfig
    data: Dataset
    evaluated_on: str = "test"  # or "holdout"
    conv_path: str = "fused"  # graphtrain's conv layers: convpool.cu's fused kernels, or cuDNN's
    plans: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, config: TrainConfig, data: Dataset, holdout: int = 0, conv_path: str = "fused") -> SpeedrunCase:
        if config.epochs is None:
            raise UsageError("the speedrun trains whole epochs: give --epochs, not --steps")
        if holdout:
            if not 0 < holdout < len(data.train_images) - config.batch:
                raise UsageError(f"--holdout must leave more than a batch to train on, got {holdout}")
            x, y = data.train_images, data.train_labels
            data = dataclasses.replace(data, train_images=x[:-holdout], train_labels=y[:-holdout],
                                       test_images=x[-holdout:], test_labels=y[-holdout:])
        return cls(config, data, "holdout" if holdout else "test", conv_path)

    def row_class(self, name: str) -> type[Stage]:
        """Row `name`'s class (see `row_class`), its conv layers on `conv_path` where it has a choice."""
        found = row_class(name, self.config)
        return found.on_conv_path(self.conv_path) if hasattr(found, "on_conv_path") else found

    @property
    def steps(self) -> int:
        return self.config.epochs * ceil_div(len(self.data.train_images), self.config.batch)

    @property
    def recipe(self) -> Recipe:
        """The recipe every row trains (its precision: the one asked for, None: each row's own)."""
        return recipe_of(self.config, self.steps, self.config.epochs, self.config.precision)

    def row_config(self, cls: type[Stage]) -> TrainConfig:
        """The config row `cls` trains: the precision asked for where it trains in it, else its
        own (numpy's float32: NumPy has no TF32), which its result states."""
        asked = self.config.precision
        return dataclasses.replace(self.config, precision=cls.check_precision(asked if asked in cls.precisions else None))

    def plan(self, config: TrainConfig, seed: int) -> RunPlan:
        """Seed `seed`'s run plan of `config` (built once per seed and config)."""
        key = config.replace(seed=seed)
        if key not in self.plans:
            self.plans[key] = RunPlan.for_data(key, self.data)
        return self.plans[key]


def row_class(name: str, config: TrainConfig) -> type[Stage]:
    """Row `name`'s class for the speedrun's model, once checked (before any data is read) that it
    can train the recipe: a UsageError saying why not."""
    if name not in stages.speedrun_names():
        raise UsageError(f"unknown speedrun row {name!r}; choose from {', '.join(stages.speedrun_names())}")
    return training.row_for(stages.get_stage(name, config.model), config)


def check_row(name: str, config: TrainConfig) -> None:
    """Before any data is read: a UsageError where row `name` cannot train `config`'s recipe, and
    GpuUnavailableError (a peer: PeerUnavailable) unless it can run here."""
    row_class(name, config).check_available()


def is_peer(name: str) -> bool:
    return stages.SPECS[name].kind == "peer"


# --------------------------------------------------------------------------------------------
# The protocol


@dataclass
class RowResult:
    name: str
    note: str
    seeds: list[int]
    accuracies: list[float]
    times_ms: list[float]
    setup_ms: float  # every setup the row took, summed (one, where each seed restarted it)
    environment: dict
    precision: str = ""  # what the row trained in
    setups: int = 1  # fresh setups: one, unless a seed's plan could not be put on the set-up row
    process_wall_s: float | None = None
    error: str | None = None

    @property
    def accuracy_mean(self) -> float:
        return statistics.fmean(self.accuracies)

    @property
    def accuracy_std(self) -> float:
        return statistics.pstdev(self.accuracies) if len(self.accuracies) > 1 else 0.0

    @property
    def time_ms_median(self) -> float:
        return statistics.median(self.times_ms)

    def to_dict(self) -> dict:
        d = {"name": self.name, "note": self.note, "precision": self.precision, "seeds": self.seeds,
             "accuracies": self.accuracies, "times_ms": self.times_ms, "setup_ms": self.setup_ms,
             "setups": self.setups, "process_wall_s": self.process_wall_s, "environment": self.environment,
             "error": self.error}
        if self.accuracies:
            d.update(accuracy_mean=self.accuracy_mean, accuracy_std=self.accuracy_std,
                     accuracy_min=min(self.accuracies), accuracy_max=max(self.accuracies),
                     time_ms_median=self.time_ms_median)
        return d


def set_up(cls: type[Stage], plan: RunPlan, data: Dataset) -> tuple[Stage, float]:
    """A fresh row for `plan`, set up (untimed by the speedrun's clock); (the row, its setup ms)."""
    start = time.perf_counter()
    row = cls(plan, data)
    try:
        row.setup()
    except BaseException:
        row.close()
        raise
    return row, (time.perf_counter() - start) * 1e3


def train_and_test(row: Stage, plan: RunPlan) -> float:
    """What the clock covers after the restart: the plan's epochs (no metrics read), then the test
    accuracy as a number on the host."""
    for epoch in range(plan.num_epochs):
        row.train_epoch(epoch, plan.batches[epoch], False)
    return float(row.test_accuracy())


def run_row(name: str, case: SpeedrunCase, seeds: list[int], progress=None) -> RowResult:
    """Set the row up once (untimed), then time each seed from `restart(plan)` to its accuracy."""
    cls = case.row_class(name)
    config = case.row_config(cls)
    row, setup_ms, setups = None, 0.0, 0
    accuracies, times = [], []
    try:
        for seed in seeds:
            plan = case.plan(config, seed)
            if row is None:
                row, ms = set_up(cls, plan, case.data)
                setup_ms, setups = setup_ms + ms, setups + 1
            start = time.perf_counter()
            if not row.restart(plan):  # this row cannot take the seed's plan in place: a fresh one
                stale, row = row, None
                stale.close()
                row, ms = set_up(cls, plan, case.data)
                setup_ms, setups = setup_ms + ms, setups + 1
                start = time.perf_counter()
                if not row.restart(plan):
                    raise RuntimeError(f"{name} cannot restart the plan it was set up for: the speedrun's clock "
                                       "starts with Stage.restart")
            accuracy = train_and_test(row, plan)
            times.append((time.perf_counter() - start) * 1e3)
            accuracies.append(accuracy)
            if progress:
                progress(name, seed, accuracies[-1], times[-1])
        return RowResult(name, row.note, list(seeds), accuracies, times, setup_ms, row.environment(),
                         precision=row.precision, setups=setups)
    finally:
        if row is not None:
            row.close()


def process_wall(name: str, argv: list[str]) -> float:
    """Seconds `graphtrain speedrun --seeds 1 --rows name` takes from process start to exit."""
    cmd = [sys.executable, "-m", "graphtrain", "speedrun", "--seeds", "1", "--rows", name, "--no-process-wall",
           *argv]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}: {tail[0]}")
    return wall


# --------------------------------------------------------------------------------------------
# The report


def fastest_peer(results: list[RowResult]) -> RowResult | None:
    peers = [r for r in results if is_peer(r.name) and r.accuracies]
    return min(peers, key=lambda r: r.time_ms_median) if peers else None


def summary(results: list[RowResult], case: SpeedrunCase, command: str, date: str) -> dict:
    """The JSON document: the task, the environment, one entry per row."""
    peer = fastest_peer(results)
    rows = []
    for r in results:
        d = r.to_dict()
        if peer is not None and r.accuracies and not is_peer(r.name):
            d["speedup_vs_fastest_peer"] = peer.time_ms_median / r.time_ms_median
        rows.append(d)
    recipe = case.recipe
    return {"date": date, "revision": environment.source_revision() or "unknown", "command": command,
            "task": {"model": describe(cnn_spec(case.config)), "batch": recipe.batch, "epochs": recipe.epochs,
                     "steps": case.steps, "optimizer": vars(recipe.optimizer) | {"betas": list(recipe.optimizer.betas)},
                     "schedule": vars(recipe.schedule), "precision": recipe.precision,
                     "train_samples": len(case.data.train_images), "evaluated_on": case.evaluated_on,
                     "evaluated_samples": len(case.data.test_images),
                     "normalisation": {"mean": MNIST_MEAN, "std": MNIST_STD}},
            "fastest_peer": peer.name if peer else None, "rows": rows}


def describe(spec: CnnSpec) -> str:
    convs = ", ".join(f"conv {c}→{l.out_channels} {l.kernel}x{l.kernel}, max-pool {l.pool}, ReLU"
                      for (c, *_), l in zip(spec.conv_shapes(), spec.convs))
    return f"{convs}, linear {' → '.join(map(str, spec.dims))} (ReLU between)"


def markdown(doc: dict) -> str:
    """The results file: header (report.provenance_lines: date, revision, command, device, driver,
    libraries; then the task), then the table."""
    task, rows = doc["task"], doc["rows"]
    records = [{"environment": {"revision": doc["revision"]}},
               *({"kind": stages.SPECS[r["name"]].kind, "environment": r.get("environment", {})}
                 for r in rows)]
    lines = [
        "# Speedrun: time to 99% on MNIST", "",
        *(f"- {item}" for item in report.provenance_lines(records, doc["command"], doc["date"])),
        f"- Model: {task['model']}",
        f"- Recipe: batch {task['batch']}, {task['epochs']} epoch(s) = {task['steps']} steps, "
        f"{task['optimizer']['kind']} (betas {tuple(task['optimizer']['betas'])}), "
        f"{task['schedule']['kind']} schedule peaking at {task['schedule']['lr']}, images normalised "
        f"((x − {MNIST_MEAN}) / {MNIST_STD}); precision {task['precision'] or 'each row its own'}",
        f"- Accuracy on the {task['evaluated_on']} set ({task['evaluated_samples']} samples), "
        f"trained on {task['train_samples']}",
        "- Time: from model construction (the seed's initial weights, orders and recipe put on the row, set up "
        "once beforehand: data on the GPU, kernels compiled, algorithms chosen, graphs captured) to the test "
        "accuracy on the host; median over the seeds. Process wall: `graphtrain speedrun --seeds 1` for that "
        "row alone, start to exit.",
        "",
        "| row | accuracy mean | spread (std; min–max) | median ms | × fastest peer | process wall s | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['name']} | — | — | — | — | — | {r['error']} |")
            continue
        speed = f"{r['speedup_vs_fastest_peer']:.2f}×" if r.get("speedup_vs_fastest_peer") else ""
        wall = f"{r['process_wall_s']:.2f}" if r.get("process_wall_s") is not None else ""
        lines.append(f"| {r['name']} | {100 * r['accuracy_mean']:.2f}% | {100 * r['accuracy_std']:.2f}; "
                     f"{100 * r['accuracy_min']:.2f}–{100 * r['accuracy_max']:.2f} | {r['time_ms_median']:.2f} | "
                     f"{speed} | {wall} | {r['note']} |")
    lines += ["", f"Seeds: {', '.join(map(str, rows[0]['seeds'])) if rows and rows[0].get('seeds') else ''}", ""]
    return "\n".join(lines)
