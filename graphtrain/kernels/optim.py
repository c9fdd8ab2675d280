"""Launchers for optim.cu: the fused optimizer step over all parameters, its learning rate from
the schedule and the step counter on the device, its constants from a record on the device.

`CONSTANTS` is that record's layout (optim.cu's OptimizerConstants, checked against it when the
file compiles): the optimizer (kind, momentum, betas, eps, weight decay) and the schedule (kind,
total steps, warm-up steps, peak rate, pct, div, final_div). The host writes it between runs
(`constants_of`), so a captured step trains the recipe written last. With `models` > 1 the step
updates that many models at once (graphtrain.kernels' model axis: every buffer per model, the
constants record too, model_stride bytes apart), each with its own step counter and recipe."""

from __future__ import annotations

import numpy as np

from graphtrain.kernels import F32, I32, I64, PTR, KernelFile, ceil_div, kernel, model_grid, model_stride_arg
from graphtrain.reference_cnn import OPTIMIZERS, SCHEDULES, Optimizer, Schedule

THREADS = 256
MAX_BLOCKS = 264  # a grid-stride pass: two blocks an SM on an H100 is enough to stream the span
# A launch of several models: its blocks over all of them at most PACK_BLOCKS (16 an SM of 132). On an
# H200 (scripts/probes/cnn_step_profile.py --models 64, the speedrun cnn's 215K parameters a model)
# the update took 106.4 µs at 528 blocks, 104.2 at 1056 and 103.6 at 2112: more quads in flight.
PACK_BLOCKS = 2112
STATE_INTS = 2  # [steps taken, blocks done with the current step]
MAX_SLOTS = 2  # state arrays per parameter of the most demanding optimizer (Adam's m and v)

CONSTANTS = np.dtype([("optimizer", np.int32), ("momentum", np.float32), ("beta1", np.float32),
                      ("beta2", np.float32), ("eps", np.float32), ("weight_decay", np.float32),
                      ("schedule", np.int32), ("total", np.int32), ("warmup", np.int32), ("lr", np.float32),
                      ("pct", np.float32), ("div", np.float32), ("final_div", np.float32)])


def constants_of(optimizer: Optimizer, schedule: Schedule) -> np.ndarray:
    """The record optimizer_step reads: one element of CONSTANTS (its floats rounded to float32
    as a kernel argument of type float would be)."""
    record = np.zeros(1, CONSTANTS)
    b1, b2 = optimizer.betas
    values = {"optimizer": OPTIMIZERS.index(optimizer.kind), "momentum": optimizer.momentum, "beta1": b1,
              "beta2": b2, "eps": optimizer.eps, "weight_decay": optimizer.weight_decay,
              "schedule": SCHEDULES.index(schedule.kind), "total": schedule.total, "warmup": schedule.warmup_steps,
              "lr": schedule.lr, "pct": schedule.pct, "div": schedule.div, "final_div": schedule.final_div}
    for name, value in values.items():
        record[name] = value
    return record


def layout_defines(record: np.dtype) -> dict[str, int]:
    """The record's size, each field's index and which fields are floats, as optim.cu's
    static_asserts check them against OptimizerConstants (all its fields are 4 bytes)."""
    return {"OC_BYTES": record.itemsize, **{f"OC_{name.upper()}": i for i, name in enumerate(record.names)},
            "OC_FLOAT_FIELDS": sum(1 << i for i, name in enumerate(record.names)
                                   if record.fields[name][0] == np.float32)}


class Optim(KernelFile):
    stem = "optim"
    headers = ("model_axis.cuh",)
    defines = layout_defines(CONSTANTS)
    _optimizer_step = kernel("optimizer_step", PTR, PTR, PTR, PTR, I64, PTR, PTR, PTR, I64)
    _schedule_rates = kernel("schedule_rates", PTR, I32, I32, I32, I32, I32, F32, F32, F32, F32)

    def step(self, stream, params: int, grads: int, slot1: int, slot2: int, n: int, state: int, lr_out: int,
             constants: int, models: int = 1, model_stride: int = 0) -> None:
        """One update of the n packed parameters from their gradients; slot1/slot2 the optimizer's
        state (0 where it has none); state: the STATE_INTS counters, zeroed before the first
        step; lr_out: where the rate used is written; constants: the CONSTANTS record. Each of
        them per model with `models` > 1."""
        stride = model_stride_arg(models, model_stride)
        # A thread takes four parameters at a time; a model's blocks at most MAX_BLOCKS, the launch's
        # over all models at most PACK_BLOCKS, each then looping over many quads: a thread's fixed cost
        # (the constants, the rate, the bias corrections' pow in double) paid once for many parameters,
        # not once for four.
        blocks = min(MAX_BLOCKS, ceil_div(n, 4 * THREADS), max(1, PACK_BLOCKS // models))
        self._optimizer_step(stream, model_grid(blocks, models), THREADS, params, grads, slot1, slot2, n, state,
                             lr_out, constants, stride)

    def schedule_rates(self, stream, out: int, first: int, count: int, schedule: Schedule) -> None:
        """out[i] = the schedule's rate at step first + i, for i < count."""
        self._schedule_rates(stream, ceil_div(count, THREADS), THREADS, out, first, count,
                             SCHEDULES.index(schedule.kind), schedule.total, schedule.warmup_steps, schedule.lr,
                             schedule.pct, schedule.div, schedule.final_div)
