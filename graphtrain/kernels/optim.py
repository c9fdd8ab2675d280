"""Launchers for optim.cu: the fused optimizer step over all parameters, its learning rate from
the schedule and the step counter on the device."""

from __future__ import annotations

from graphtrain.kernels import F32, I32, I64, PTR, KernelFile, ceil_div, kernel
from graphtrain.reference_cnn import OPTIMIZERS, SCHEDULES, Optimizer, Schedule

THREADS = 256
MAX_BLOCKS = 264  # a grid-stride pass: two blocks an SM on an H100 is enough to stream the span
STATE_INTS = 2  # [steps taken, blocks done with the current step]


class Optim(KernelFile):
    stem = "optim"
    _optimizer_step = kernel("optimizer_step", PTR, PTR, PTR, PTR, I64, PTR, PTR, I32, F32, F32, F32, F32, F32,
                             I32, I32, I32, F32, F32, F32, F32)
    _schedule_rates = kernel("schedule_rates", PTR, I32, I32, I32, I32, I32, F32, F32, F32, F32)

    @staticmethod
    def _schedule_args(schedule: Schedule) -> tuple:
        return (SCHEDULES.index(schedule.kind), schedule.total, schedule.warmup_steps, schedule.lr, schedule.pct,
                schedule.div, schedule.final_div)

    def step(self, stream, params: int, grads: int, slot1: int, slot2: int, n: int, state: int, lr_out: int,
             optimizer: Optimizer, schedule: Schedule) -> None:
        """One update of the n packed parameters from their gradients; slot1/slot2 the optimizer's
        state (0 where it has none); state: the STATE_INTS counters, zeroed before the first
        step; lr_out: where the rate used is written."""
        b1, b2 = optimizer.betas
        blocks = min(MAX_BLOCKS, ceil_div(n, THREADS))
        self._optimizer_step(stream, blocks, THREADS, params, grads, slot1, slot2, n, state, lr_out,
                             OPTIMIZERS.index(optimizer.kind), optimizer.momentum, b1, b2, optimizer.eps,
                             optimizer.weight_decay, *self._schedule_args(schedule))

    def schedule_rates(self, stream, out: int, first: int, count: int, schedule: Schedule) -> None:
        """out[i] = the schedule's rate at step first + i, for i < count."""
        self._schedule_rates(stream, ceil_div(count, THREADS), THREADS, out, first, count,
                             *self._schedule_args(schedule))
