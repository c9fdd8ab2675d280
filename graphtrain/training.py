"""The trainer: runs one row (a rung of the ladder or a framework peer) over a run plan and
returns its run record.

    train(config, stage)          the library's entry: load the data, build the plan, run one row
    plan_for(config, data, init)  the run plan, from a saved model's parameters when resuming
    run_stage(cls, plan, data)    the timing protocol around any row, given the shared plan
    SetUpRows().train(cls, plan, data)
                                  the same protocol on a row set up once per shape in this process
                                  and restarted for each next plan (Stage.restart): the sweep's

The ladder builds one plan and calls `run_stage` for every row, so all of them train the same
initial weights in the same order over the same batches. With `profile`, a row that trains on
a GPU runs one more epoch after everything its record reports was measured, traced by CUPTI
(graphtrain.profile): the record gains its `profile` and nothing else changes.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable

import numpy as np

from graphtrain import data as data_mod
from graphtrain import environment as environment_mod
from graphtrain import model_io, phases
from graphtrain.config import TrainConfig
from graphtrain.errors import TrainingError, UsageError
from graphtrain.model_io import Model
from graphtrain.plan import RunPlan
from graphtrain.record import EpochRecord, RunRecord, data_summary, median_epoch_ms
from graphtrain.stages import get_stage
from graphtrain.stages.base import Stage

# progress(epoch_index, num_epochs, epoch_record) after each epoch.
Progress = Callable[[int, int, EpochRecord], None]

# A measured loss this many times the loss of guessing, ln(classes), means training diverges.
DIVERGENCE_FACTOR = 10


def train(
    config: TrainConfig,
    stage: str = "numpy",
    data: data_mod.Dataset | None = None,
    data_dir=None,
    offline: bool = False,
    progress: Progress | None = None,
    init: str | os.PathLike[str] | Model | None = None,
    profile: bool = False,
) -> RunRecord:
    """Train `config` with `stage` (a rung or a peer) and return its run record, whose
    `params` are the trained parameters (`graphtrain.save(path, record)` keeps them).

    What the stage needs (a GPU, a framework) is checked before the dataset is looked for;
    the dataset is loaded when not given. `init`, a saved model or its path, resumes training
    from it (see `plan_for`).
    """
    stage_cls = get_stage(stage)
    stage_cls.check_available()
    if isinstance(init, (str, os.PathLike)):
        init = model_io.load(init)
    if data is None:
        data = data_mod.load(config.dataset, data_dir=data_dir, offline=offline)
    record = run_stage(stage_cls, plan_for(config, data, init), data, progress, profile=profile)
    record.init = None if init is None or init.source is None else str(init.source)
    return record


def plan_for(config: TrainConfig, data: data_mod.Dataset, init: Model | None = None) -> RunPlan:
    """The run plan of `config` on `data`; with `init`, one that resumes training the saved model.

    Resuming starts from the model's parameters and goes on counting epochs from its
    `epochs_trained`: the run's first epoch is the model's next one and takes that epoch's
    sample order, so (with the same seed, batch and lr) training 2 epochs, saving and resuming
    for 2 more gives the same parameters as training 4 epochs at once. A run that stopped inside
    an epoch (--steps) resumes at the start of the next one. The file holds no optimizer state:
    momentum and Adam's moments start from zero, and the schedule spans this run's steps, so only
    SGD at a constant rate continues exactly.
    """
    if init is None:
        return RunPlan.for_data(config, data)
    model_io.check_config(init, init.source or "the saved model",
                          config.replace(in_features=data.num_features, classes=data.num_classes))
    return RunPlan.for_data(config, data, init.layers, init.info.epochs_trained)


def row_for(stage_cls: type[Stage], config: TrainConfig) -> type[Stage]:
    """The row that trains `config` when `stage_cls` is asked for (the class of the same row for
    the config's model kind, graphtrain.stages.REGISTRY), once it is checked that it can train the
    config's recipe: a UsageError saying why not, before any data is read."""
    if stage_cls.model_kind != config.model:
        stage_cls = get_stage(stage_cls.name, config.model, data_parallel=stage_cls.data_parallel)
    stage_cls.check_recipe(config)
    return stage_cls


def begin_first_uses(stage_cls: type[Stage]) -> None:
    """Begin the once-a-process work of the libraries `stage_cls`'s setup calls (its
    `first_uses`), each library on a thread of its own (they share nothing), so that
    `graphtrain run` pays their first-call costs beside the data loading rather than in the setup."""
    first_uses = stage_cls.first_uses()
    if not first_uses:
        return
    from graphtrain.libs import cuda

    device = cuda.open_device()
    for first_use in first_uses:
        library = first_use.__module__.rsplit(".", 1)[-1]
        cuda.start_beside([first_use], device, name=f"graphtrain-first-use-{library}")


def run_stage(stage_cls: type[Stage], plan: RunPlan, data: data_mod.Dataset,
              progress: Progress | None = None, profile: bool = False) -> RunRecord:
    """The timing protocol around any row: setup apart, each epoch timed by the row, the loss
    checked wherever it was measured, test accuracy outside the timed loop; then, with
    `profile`, the profiled epoch (see `_profile`), which total_ms leaves out."""
    stage_cls = row_for(stage_cls, plan.config)
    plan.check_fits(stage_cls.uses_gpu, stage_cls.check_available())
    run_start = time.perf_counter()
    phases.advance("setup")
    with stage_cls(plan, data) as runner:
        runner.setup()
        record, profile_ms = run_set_up(runner, plan, run_start, progress, profile)
    record.total_ms = (time.perf_counter() - run_start) * 1e3 - profile_ms  # the profiled epoch is not the run's
    return record


def run_set_up(runner: Stage, plan: RunPlan, run_start: float, progress: Progress | None = None,
               profile: bool = False) -> tuple[RunRecord, float]:
    """The protocol's epochs, evaluation and record on a row set up (or restarted) for `plan`
    since `run_start` (perf_counter); (the record, the profiled epoch's ms, which its total_ms
    leaves out)."""
    config, name = plan.config, runner.name
    setup_ms = (time.perf_counter() - run_start) * 1e3
    phases.advance("training")
    epochs: list[EpochRecord] = []
    warnings: list[str] = []
    unchecked_since = 0  # first epoch whose loss has not been looked at yet
    for epoch in range(plan.num_epochs):
        num_batches = plan.batches[epoch]
        result = runner.train_epoch(epoch, num_batches, runner.measures(epoch))
        # Numbered as the model's epochs: a resumed run goes on from the saved count.
        number = plan.first_epoch + epoch + 1
        entry = EpochRecord(number, result.ms, num_batches,
                            full=num_batches == plan.batches_per_epoch,
                            train_loss=result.train_loss, train_accuracy=result.train_accuracy)
        if result.train_loss is not None:
            first = plan.first_epoch + unchecked_since + 1
            where = f"epoch {number}" if first == number else f"epochs {first}-{number}"
            if not math.isfinite(result.train_loss):
                raise TrainingError(
                    f"the training loss became {result.train_loss} in {where} with {name}; "
                    f"the learning rate {config.lr} is probably too high: try a lower --lr")
            warning = _divergence(result.train_loss, config, where)
            if warning and not warnings:
                warnings.append(warning)
            unchecked_since = epoch + 1
            phases.advance("evaluation")
            entry.test_accuracy = runner.test_accuracy()
        epochs.append(entry)
        phases.advance("writing")
        if progress:
            progress(epoch, plan.num_epochs, entry)
        phases.advance("training")
    phases.advance("evaluation")
    weights = runner.weights()
    if not all(np.isfinite(layer.w).all() for layer in weights):
        raise TrainingError(f"the weights became NaN or Inf with {name}: try a lower --lr")
    test_accuracy = epochs[-1].test_accuracy
    if test_accuracy is None:
        test_accuracy = runner.test_accuracy()
    environment = {**environment_mod.host(), **runner.environment()}
    note, precision, nodes = runner.note, runner.precision, getattr(runner, "nodes_per_step", None)
    profile_start = time.perf_counter()
    profiled = _profile(runner, plan, median_epoch_ms(epochs)) if profile and runner.uses_gpu else None
    profile_ms = (time.perf_counter() - profile_start) * 1e3
    total_ms = (time.perf_counter() - run_start) * 1e3 - profile_ms
    record = RunRecord(stage=name, kind=runner.kind, config=config, environment=environment,
                       epochs=epochs, setup_ms=setup_ms, total_ms=total_ms, test_accuracy=test_accuracy,
                       note=note, precision=precision, nodes_per_step=nodes, data=data_summary(runner.data),
                       warnings=warnings, params=weights, profile=profiled)
    return record, profile_ms


class SetUpRows:
    """A process's set-up rows, kept for the next plan of their shape: a process that trains many
    models (a sweep's worker) sets each row class up once and restarts it (Stage.restart) for
    each next plan it can take in place, on the same dataset object; where it cannot (another
    shape, a recipe its setup holds), the row is closed and a fresh one set up. One row is kept
    per row class, the last one set up: consecutive plans of one shape reuse it. A row that
    cannot restart at all (Stage.restarts) is closed after its run, as `run_stage` does."""

    def __init__(self) -> None:
        self.rows: dict[type[Stage], Stage] = {}
        self.setups = 0  # fresh setups
        self.restarts = 0  # plans put on a set-up row

    def train(self, stage_cls: type[Stage], plan: RunPlan, data: data_mod.Dataset) -> tuple[RunRecord, bool]:
        """`run_stage`'s protocol for `plan` on this process's set-up row of `stage_cls` (restarted
        in place where it can be, else set up anew); (the run record, whether it was restarted).
        The record's setup_ms is the restart's where it was restarted."""
        stage_cls = row_for(stage_cls, plan.config)
        plan.check_fits(stage_cls.uses_gpu, stage_cls.check_available())
        run_start = time.perf_counter()
        phases.advance("setup")
        runner = self.rows.pop(stage_cls, None)
        restarted = False
        try:
            if runner is not None:
                restarted = runner.data is data and runner.restart(plan)
                if not restarted:
                    stale, runner = runner, None
                    stale.close()
            if runner is None:
                runner = stage_cls(plan, data)
                runner.setup()
            self.setups, self.restarts = self.setups + (not restarted), self.restarts + restarted
            record, _ = run_set_up(runner, plan, run_start)
        except BaseException:
            if runner is not None:
                runner.close()  # a row that failed is not kept: its state is the failure's
            raise
        if stage_cls.restarts():
            self.rows[stage_cls] = runner
        else:
            runner.close()
        return record, restarted

    def close(self) -> None:
        """Close every kept row."""
        rows, self.rows = list(self.rows.values()), {}
        for row in rows:
            row.close()


def _profile(runner: Stage, plan: RunPlan, epoch_ms: float) -> dict:
    """One more epoch, traced by CUPTI (CPU rows have nothing for it to see): the last epoch's
    sample order, with the metrics reads of most epochs (every epoch for the rungs that measure
    every epoch, none for the sparse-metrics ones), its idle share against the timed `epoch_ms`."""
    from graphtrain.profile import profile_epoch

    last = plan.num_epochs - 1
    measured = sum(runner.measures(epoch) for epoch in range(plan.num_epochs))
    return profile_epoch(runner, last, plan.batches[last], measure=2 * measured > plan.num_epochs,
                         epoch_ms=epoch_ms)


def _divergence(loss: float, config: TrainConfig, where: str) -> str | None:
    """A warning when a finite loss is far above the loss of guessing: the run diverges."""
    guessing = math.log(config.classes)
    if loss <= DIVERGENCE_FACTOR * guessing:
        return None
    return (f"the training loss reached {loss:.3g} in {where}, more than {DIVERGENCE_FACTOR}x the "
            f"{guessing:.2f} of guessing: training is diverging; the learning rate {config.lr} is "
            "probably too high: try a lower --lr")
