"""Where a command's wall time goes, from the start of the process to the record's writing.

The time is cut into the phases a user waits through, each in ms, and every moment is charged
to exactly one of them, so they add up to the process's wall time up to the last mark:

    startup       the interpreter starting and the imports, up to the command's first step
    cuda_context  initialising CUDA and making the GPU's primary context
    data          finding and loading the dataset, and building the run plan
    kernels       compiling kernels with NVRTC (or reading their cubins from the cache) and loading them
    setup         the rest of a row's setup: allocation, upload, library handles, warm-up, capture
    training      the epochs' training loops
    evaluation    test accuracy, and copying the trained weights back
    writing       printing and writing the results

The phases run one after another (`advance`), except `cuda_context` and `kernels`, which happen
inside the others wherever they first happen (`inside`): their time is taken out of the phase
they interrupt. The clock is the main thread's: work done in another thread counts where the
main thread waits for it.

The process's start comes from the kernel (/proc/self/stat, in clock ticks since boot): what an
outside timer of the command sees, the interpreter's own start-up included. Where that cannot be
read, the clock starts when this module is first imported.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

NAMES = ("startup", "cuda_context", "data", "kernels", "setup", "training", "evaluation", "writing")


def process_age() -> float | None:
    """Seconds since this process started, from /proc/self/stat and CLOCK_BOOTTIME; None if unknown."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read()
        # Field 22 (starttime); the command name (field 2) may hold spaces, so split after its ')'.
        ticks = int(stat[stat.rindex(b")") + 2:].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class Timeline:
    """Exclusive time per phase: a stack whose top is charged with the time until the next event."""

    def __init__(self, start: float | None = None) -> None:
        now = time.perf_counter()
        self._last = now if start is None else start
        self._stack = ["startup"]
        self.ms = dict.fromkeys(NAMES, 0.0)
        self._thread = threading.get_ident()

    def _charge(self) -> None:
        now = time.perf_counter()
        self.ms[self._stack[-1]] += (now - self._last) * 1e3
        self._last = now

    def advance(self, name: str) -> None:
        """Charge the time since the last event to the current phase, then go on in `name`."""
        if threading.get_ident() != self._thread:
            return
        self._charge()
        self._stack[0] = name

    @contextmanager
    def inside(self, name: str) -> Iterator[None]:
        """Charge the block's time to `name`, taking it out of the phase it interrupts."""
        if threading.get_ident() != self._thread:
            yield
            return
        self._charge()
        self._stack.append(name)
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()

    def snapshot(self) -> dict[str, float]:
        """Every phase's ms so far (the current one up to now), rounded to 0.01 ms."""
        if threading.get_ident() == self._thread:
            self._charge()
        return {name: round(ms, 2) for name, ms in self.ms.items()}


def _process_start() -> float | None:
    age = process_age()
    return None if age is None else time.perf_counter() - age


timeline = Timeline(_process_start())  # the process's one timeline


def advance(name: str) -> None:
    timeline.advance(name)


def inside(name: str):
    return timeline.inside(name)


def snapshot() -> dict[str, float]:
    return timeline.snapshot()
