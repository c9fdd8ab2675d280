"""`graphtrain speedrun`: time to 99% on MNIST, as the field measures it.

train_mnist_fast's protocol: the data already on the GPU and the kernels compiled, the clock
runs from model construction (the initial weights put on the device) through one epoch of
training to the test accuracy as a number on the host; capture is inside the clock. Each row
trains the same recipe from the same initial weights in the same sample order for every seed:
seed s's run plan (graphtrain.plan.RunPlan, the preset with seed s) gives them, on the same
normalised images.

A row is set up once (untimed: compile, cuDNN's algorithm search, upload the data, warm up),
then `run` trains one seed and returns its test accuracy; the caller times the call with
perf_counter. Rows: graphtrain's `graphs` (the step captured once per run, replayed per
batch) and `device-loop` (the run, evaluation included, one graph), `numpy` (the float32
reference on the CPU, slow), and the peers of graphtrain.peers.speedrun_torch / speedrun_jax.

`holdout` > 0 trains on the training set's first N − holdout samples and reports accuracy on
the last `holdout` ones instead of the test set: where the recipe is tuned.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

from graphtrain import environment, reference_cnn, report, stages
from graphtrain.config import TrainConfig
from graphtrain.config import cnn_spec as config_cnn_spec
from graphtrain.errors import UsageError
from graphtrain.kernels import ceil_div
from graphtrain.recipe import MNIST_MEAN, MNIST_STD, SpeedrunRow, SpeedrunTask, normalise, recipe_of
from graphtrain.reference_cnn import CnnSpec


def make_task(config: TrainConfig, data, holdout: int = 0, precision: str = "tf32", fused_convs: bool = True) -> SpeedrunTask:
    """The task of `config` on a loaded dataset, its images normalised once here."""
    if config.epochs is None:
        raise UsageError("the speedrun trains whole epochs: give --epochs, not --steps")
    train_x, train_y = data.train_images, data.train_labels
    test_x, test_y = data.test_images, data.test_labels
    if holdout:
        if not 0 < holdout < len(train_x) - config.batch:
            raise UsageError(f"--holdout must leave more than a batch to train on, got {holdout}")
        train_x, train_y, test_x, test_y = (train_x[:-holdout], train_y[:-holdout], train_x[-holdout:],
                                            train_y[-holdout:])
    recipe = recipe_of(config, config.epochs * ceil_div(len(train_x), config.batch), config.epochs, precision)
    return SpeedrunTask(config_cnn_spec(config), recipe, normalise(train_x),
                train_y.astype(np.int32), normalise(test_x), test_y.astype(np.int32),
                "holdout" if holdout else "test", config, fused_convs=fused_convs)


# --------------------------------------------------------------------------------------------
# graphtrain's rows


class NumpyRow(SpeedrunRow):
    name = "numpy"
    note = "float32 NumPy on the CPU"

    def run(self, seed: int) -> float:
        task = self.task
        spec, recipe = task.spec, task.recipe
        params = task.initial(seed)
        state = recipe.optimizer.init_state(params)
        plan, t = task.plan(seed), 0
        for epoch, order in enumerate(plan.orders):
            for lo, hi in plan.epoch_bounds(epoch):
                idx = order[lo:hi]
                reference_cnn.train_step(spec, params, task.train_images[idx], task.train_labels[idx],
                                         recipe.optimizer, state, t + 1, recipe.schedule.at(t))
                t += 1
        return reference_cnn.accuracy(spec, params, task.test_images, task.test_labels)


class _CnnGpuRow(SpeedrunRow):
    device_loop = False  # whether the model records WHILE nodes

    def setup(self, task: SpeedrunTask) -> None:
        from graphtrain.libs import cuda
        from graphtrain.stages.cnn_device import CnnDevice

        super().setup(task)
        self.device = cuda.open_device()
        self.model = CnnDevice(self.device, task.spec, task.recipe, task.train_images, task.train_labels,
                               task.test_images, task.test_labels, fused=task.fused_convs,
                               device_loop=self.device_loop)
        self.note = self.model.precision_note()
        self.outer = cuda.Stream()
        # Warm-up: first launches of every kernel and library call (undone by the next load).
        self.model.load(task.initial(0), task.orders(0))
        self.model.reset(self.model.stream)
        self.model.record_step(self.model.stream)
        self.model.record_eval(self.model.stream)
        self.model.stream.synchronize()

    def accuracy(self) -> float:
        return self.model.read_correct() / len(self.task.test_images)

    def weights(self) -> list[np.ndarray]:
        return self.model.weights()

    def environment(self) -> dict:
        return {**environment.gpu(self.device), **self.model.environment()}

    def close(self) -> None:
        if getattr(self, "model", None) is not None:
            self.model.close()
        if getattr(self, "outer", None) is not None:
            self.outer.close()


class GraphsRow(_CnnGpuRow):
    """The step captured into a graph once per run and replayed per batch from the host."""

    name = "graphs"

    def run(self, seed: int) -> float:
        from graphtrain.libs import cuda

        m, s = self.model, self.model.stream
        m.load(self.task.initial(seed), self.task.orders(seed))
        m.reset(s)
        with cuda.Graph.capture(s) as graph:
            m.record_step(s)
        try:
            for _ in range(self.task.steps):
                graph.launch(s)
            m.record_eval(s)
            return self.accuracy()
        finally:
            graph.close()


class DeviceLoopRow(_CnnGpuRow):
    """The whole run as one graph: reset, a WHILE node over the steps, the evaluation."""

    name = "device-loop"
    device_loop = True

    def run(self, seed: int) -> float:
        m = self.model
        m.load(self.task.initial(seed), self.task.orders(seed))
        graph = m.capture_run(self.task.steps, self.outer)
        try:
            graph.launch(self.outer)
            return self.accuracy_after(self.outer)
        finally:
            graph.close()

    def accuracy_after(self, stream) -> float:
        return float(self.model.correct.download(stream)[0]) / len(self.task.test_images)


def check_row(name: str) -> None:
    """Before any data is read: GpuUnavailableError (a peer: PeerUnavailable) unless row `name`
    can run here: numpy anywhere, graphtrain's other rows on a GPU, a peer with its framework."""
    stages.get_stage(name).check_available()


def get_row(name: str) -> SpeedrunRow:
    spec = stages.SPECS.get(name)
    if spec is None or spec.speedrun is None:
        raise UsageError(f"unknown speedrun row {name!r}; choose from {', '.join(stages.speedrun_names())}")
    return stages.load_target(spec.speedrun)()


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
    setup_ms: float
    environment: dict
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
        d = {"name": self.name, "note": self.note, "seeds": self.seeds, "accuracies": self.accuracies,
             "times_ms": self.times_ms, "setup_ms": self.setup_ms, "process_wall_s": self.process_wall_s,
             "environment": self.environment, "error": self.error}
        if self.accuracies:
            d.update(accuracy_mean=self.accuracy_mean, accuracy_std=self.accuracy_std,
                     accuracy_min=min(self.accuracies), accuracy_max=max(self.accuracies),
                     time_ms_median=self.time_ms_median)
        return d


def run_row(name: str, task: SpeedrunTask, seeds: list[int], progress=None) -> RowResult:
    """Set the row up (untimed), then time each seed's run from model construction to accuracy."""
    row = get_row(name)
    start = time.perf_counter()
    try:
        row.setup(task)
        setup_ms = (time.perf_counter() - start) * 1e3
        accuracies, times = [], []
        for seed in seeds:
            t0 = time.perf_counter()
            acc = row.run(seed)
            times.append((time.perf_counter() - t0) * 1e3)
            accuracies.append(float(acc))
            if progress:
                progress(name, seed, accuracies[-1], times[-1])
        return RowResult(name, row.note, list(seeds), accuracies, times, setup_ms, row.environment())
    finally:
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


def summary(results: list[RowResult], task: SpeedrunTask, command: str, date: str) -> dict:
    """The JSON document: the task, the environment, one entry per row."""
    peer = fastest_peer(results)
    rows = []
    for r in results:
        d = r.to_dict()
        if peer is not None and r.accuracies and not is_peer(r.name):
            d["speedup_vs_fastest_peer"] = peer.time_ms_median / r.time_ms_median
        rows.append(d)
    recipe = task.recipe
    return {"date": date, "revision": environment.source_revision() or "unknown", "command": command,
            "task": {"model": describe(task.spec), "batch": recipe.batch, "epochs": recipe.epochs,
                     "steps": task.steps, "optimizer": vars(recipe.optimizer) | {"betas": list(recipe.optimizer.betas)},
                     "schedule": vars(recipe.schedule), "precision": recipe.precision,
                     "train_samples": len(task.train_images), "evaluated_on": task.evaluated_on,
                     "evaluated_samples": len(task.test_images),
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
        f"((x − {MNIST_MEAN}) / {MNIST_STD}); precision {task['precision']}",
        f"- Accuracy on the {task['evaluated_on']} set ({task['evaluated_samples']} samples), "
        f"trained on {task['train_samples']}",
        "- Time: from model construction (initial weights to the device) to the test accuracy on the host, "
        "data already on the GPU, kernels compiled and algorithms chosen beforehand, graph capture included; "
        "median over the seeds. Process wall: `graphtrain speedrun --seeds 1` for that row alone, start to exit.",
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
