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
    exit          the work the process's end would do anyway, done before the record is written
                  so that the record counts it: for a run on the GPU, releasing the GPU (the
                  driver's teardown of the context, which otherwise runs after the last line of
                  Python, as the process exits)

The phases run one after another (`advance`), except `cuda_context` and `kernels`, which happen
inside the others wherever they first happen (`inside`): their time is taken out of the phase
they interrupt. The clock is the main thread's: work done in another thread counts where the
main thread waits for it. `exit` runs only the work handed to `at_exit` (the command's entry
point hands it the GPU's release, and only where the process ends with the command); elsewhere
it stays at zero.

The process's start comes from the kernel (/proc/self/stat, in clock ticks since boot): what an
outside timer of the command sees, the interpreter's own start-up included (`origin` "process").
The kernel truncates it to a whole tick (10 ms at the usual 100 per second), so the process began
somewhere in the tick after the one read: its middle is taken, which halves the worst error and
leaves none on average. Where the start cannot be read (not Linux, no /proc), the clock starts
when this module is first imported and `origin` says "import": the interpreter's start-up before
that is then missing from `startup`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

NAMES = ("startup", "cuda_context", "data", "kernels", "setup", "training", "evaluation", "writing", "exit")


def start_ticks(stat: bytes) -> int:
    """Field 22 of a /proc/PID/stat line (starttime: clock ticks from boot to the process's start).
    The command name (field 2) is in parentheses and may hold spaces and parentheses itself, so
    the fields are counted from after its last ')'. ValueError or IndexError where it is not there."""
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def age_from(stat: bytes, since_boot: float, ticks_per_second: int) -> float:
    """Seconds since the process of `stat` started, `since_boot` seconds after boot: from the
    middle of its start tick (the kernel truncates the start to a whole tick)."""
    return since_boot - (start_ticks(stat) + 0.5) / ticks_per_second


def process_age() -> float | None:
    """Seconds since this process started, from /proc/self/stat and CLOCK_BOOTTIME (the clock the
    kernel counts starttime on); None where either cannot be read."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read()
        return age_from(stat, time.clock_gettime(time.CLOCK_BOOTTIME), os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc, no CLOCK_BOOTTIME (not Linux)
        return None


class Timeline:
    """Exclusive time per phase: a stack whose top is charged with the time until the next event."""

    def __init__(self, start: float | None = None) -> None:
        now = time.perf_counter()
        self._last = now if start is None else start
        # Where `startup` begins: the process's start, or (unknown) this timeline's making.
        self.origin = "import" if start is None else "process"
        self._stack = ["startup"]
        self.ms = dict.fromkeys(NAMES, 0.0)
        self._thread = threading.get_ident()
        self._at_exit: list[Callable[[], None]] = []

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

    def at_exit(self, work: Callable[[], None]) -> None:
        """Have `leaving` do `work`, in the `exit` phase: what the process's end would otherwise do
        after the record is written (only for a process that ends once its command is done)."""
        self._at_exit.append(work)

    def leaving(self) -> None:
        """Go on in `exit` and do the work handed to `at_exit`, once; the record's snapshot comes
        after. What the work raises is raised: the run is then reported as failed."""
        self.advance("exit")
        while self._at_exit:
            self._at_exit.pop(0)()

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


def at_exit(work: Callable[[], None]) -> None:
    timeline.at_exit(work)


def leaving() -> None:
    timeline.leaving()


def snapshot() -> dict[str, float]:
    return timeline.snapshot()


def origin() -> str:
    """"process" where the phases count from the process's start, "import" where they count from
    graphtrain's first import (the start could not be read)."""
    return timeline.origin
