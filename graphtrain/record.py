"""Run records: what one row of training produced, typed, and its stable JSON form.

`RunRecord` is what `graphtrain.train` returns and what `--json` writes; `FailedRun` is a row of
a ladder or sweep that could not run (skipped: its framework or GPU is missing; failed: it
raised). Both turn into JSON with `to_json()`, whose keys are stable, because reports, the
`results/` files and scripts read them:

    stage, kind, note, precision, nodes_per_step, config, environment, data, epochs, epoch_ms,
    setup_ms, total_ms, test_accuracy, train_loss, warnings; when they apply: command, init (a run
    resumed from a saved model), profile (--profile: see graphtrain.profile), phases (`run`: the
    command's wall time by phase, see graphtrain.phases) and phases_from (where they count
    from: "process" or "import"), epoch_ms_min, epoch_ms_max and repeats (a row run more than
    once), log (a ladder row that printed something) and hidden_size (in a sweep);
    a failed row: stage, kind, error, skipped, config, traceback (when unexplained), data, log.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

from graphtrain.config import TrainConfig
from graphtrain.profile import against
from graphtrain.reference import Layer


@dataclass
class EpochRecord:
    epoch: int  # 1-based
    ms: float  # the epoch's training loop, timed by the row's own clock
    batches: int
    full: bool  # False for a steps-limited last epoch that stopped early
    train_loss: float | None = None  # mean over the epoch's samples, where measured
    train_accuracy: float | None = None
    test_accuracy: float | None = None

    def to_json(self) -> dict:
        return {"epoch": self.epoch, "ms": self.ms, "batches": self.batches, "full": self.full,
                "train_loss": self.train_loss, "train_accuracy": self.train_accuracy,
                "test_accuracy": self.test_accuracy}


def median_epoch_ms(epochs: list[EpochRecord]) -> float:
    """The seeds' protocol: the median epoch time over the second half of the (whole) epochs."""
    times = [e.ms for e in epochs if e.full] or [e.ms for e in epochs]
    return statistics.median(times[len(times) // 2:])


def data_summary(data) -> dict:
    """What a record says about the dataset a row trained on."""
    shape = None if data.image_shape is None else list(data.image_shape)
    return {"name": data.name, "train": len(data.train_images), "test": len(data.test_images),
            "image_shape": shape}


@dataclass
class RunRecord:
    stage: str
    kind: str  # "stage" (a rung of the ladder) or "peer" (a framework)
    config: TrainConfig
    environment: dict  # Python, CPU; GPU, driver and library versions where the row used them
    epochs: list[EpochRecord]
    setup_ms: float  # compile, allocate, upload, warm up, capture
    total_ms: float  # wall time of the row: setup, training and test evaluation
    test_accuracy: float
    note: str = ""  # what sets the row apart (precision, compile mode)
    precision: str = "fp32"  # the products' operands (fp32 accumulation always)
    nodes_per_step: int | None = None  # kernels in one step's graph, for rows that replay one
    data: dict | None = None
    warnings: list[str] = field(default_factory=list)
    command: str | None = None
    hidden_size: int | None = None  # the swept width, in a sweep
    init: str | None = None  # the saved model training resumed from
    # The trained parameters (float32, weight (out, in)): `graphtrain.save` writes them; not JSON.
    params: list[Layer] | None = field(default=None, repr=False)
    profile: dict | None = None  # the profiled epoch's figures (graphtrain.profile.summarize)
    repeats: list[RunRecord] = field(default_factory=list)  # every run of a row run more than once
    log: str | None = None  # where a ladder row's own output went
    # `graphtrain run`'s wall time from the process's start, by phase (graphtrain.phases), in ms.
    phases: dict[str, float] | None = None
    # Where `phases` count from: "process" (its start, from the kernel) or "import" (graphtrain's).
    phases_from: str | None = None
    # `run --gpus N`: the GPUs, the batch per GPU and combined (config.batch), NCCL's version.
    data_parallel: dict | None = None

    @property
    def epoch_ms(self) -> float:
        """The median epoch time; of a repeated row, the median of its runs' ones."""
        if self.repeats:
            return statistics.median(run.epoch_ms for run in self.repeats)
        return median_epoch_ms(self.epochs)

    @property
    def epoch_ms_range(self) -> tuple[float, float] | None:
        """The lowest and highest epoch_ms of a repeated row's runs; None for a single run."""
        if not self.repeats:
            return None
        times = [run.epoch_ms for run in self.repeats]
        return min(times), max(times)

    @property
    def train_loss(self) -> float | None:
        """The last measured train loss."""
        measured = [e.train_loss for e in self.epochs if e.train_loss is not None]
        return measured[-1] if measured else None

    @property
    def failed(self) -> bool:
        return False

    def to_json(self) -> dict:
        out = _row_head(self)
        out.update({
            "note": self.note, "precision": self.precision, "nodes_per_step": self.nodes_per_step,
            "config": self.config.to_dict(), "environment": self.environment,
            "data": self.data, "epochs": [e.to_json() for e in self.epochs],
            "epoch_ms": self.epoch_ms, "setup_ms": self.setup_ms, "total_ms": self.total_ms,
            "test_accuracy": self.test_accuracy, "train_loss": self.train_loss,
            "warnings": list(self.warnings),
        })
        for key in ("init", "command", "profile", "phases", "phases_from", "data_parallel"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.repeats:
            out["epoch_ms_min"], out["epoch_ms_max"] = self.epoch_ms_range
            out["repeats"] = [{"epoch_ms": run.epoch_ms, "setup_ms": run.setup_ms, "total_ms": run.total_ms,
                               "test_accuracy": run.test_accuracy, "train_loss": run.train_loss,
                               "epochs": [e.to_json() for e in run.epochs]} for run in self.repeats]
        return _row_tail(self, out)


def merge_repeats(runs: list[RunRecord]) -> RunRecord:
    """One row from several runs of it, each from a fresh setup: the first run's record (the
    runs train the same weights in the same order) with the median of the runs' setup_ms and
    total_ms, every run in `repeats` (epoch_ms then is their median), and the profile of the
    run that has one, its idle share taken against that median."""
    if not runs:
        raise ValueError("no runs to merge")
    if len(runs) == 1:
        return runs[0]
    merged = dataclasses.replace(runs[0], setup_ms=statistics.median(run.setup_ms for run in runs),
                                 total_ms=statistics.median(run.total_ms for run in runs), repeats=list(runs))
    profiled = [run.profile for run in runs if run.profile is not None]
    merged.profile = against(profiled[-1], merged.epoch_ms) if profiled else None
    return merged


@dataclass
class FailedRun:
    """A row that did not train: skipped (cannot run here) or failed (raised while running)."""

    stage: str
    kind: str
    config: TrainConfig
    error: str
    skipped: bool
    unsupported: bool = False  # skipped because the rung cannot train this model by design
    traceback: str | None = None  # kept for errors graphtrain did not explain itself
    data: dict | None = None
    hidden_size: int | None = None
    log: str | None = None  # where the row's own output went, the traceback included

    @property
    def failed(self) -> bool:
        return True

    def to_json(self) -> dict:
        out = _row_head(self)
        out.update({"error": self.error, "skipped": self.skipped, "config": self.config.to_dict(),
                    "data": self.data})
        if self.unsupported:
            out["unsupported"] = True
        if self.traceback is not None:
            out["traceback"] = self.traceback
        return _row_tail(self, out)


Row = RunRecord | FailedRun  # one row of a ladder or sweep


def _row_head(row: Row) -> dict:
    """The keys a row's JSON starts with: which row, and in a sweep, at which width."""
    head = {"stage": row.stage, "kind": row.kind}
    if row.hidden_size is not None:
        head["hidden_size"] = row.hidden_size
    return head


def _row_tail(row: Row, out: dict) -> dict:
    """The keys a row's JSON ends with: where its own output went, when it printed any."""
    if row.log is not None:
        out["log"] = row.log
    return out
