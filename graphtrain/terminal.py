"""What graphtrain shows on the terminal: results on stdout, everything else on stderr.

One console per stream, one logger for progress notes, one progress-bar factory. Results
(tables, a JSON record written to `-`) go to stdout so that it can be piped; downloads, notes,
warnings, progress bars and errors go to stderr. rich is imported when a console is first used.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

Log = Callable[[str], None]

# Output that is not a terminal (a pipe, a file) is this wide: a table keeps every value whole
# instead of being cut to 80 columns with "…"; $COLUMNS, where set, still rules.
UNBOUNDED_WIDTH = 10_000


@functools.cache
def stream_console_class() -> type:
    """StreamConsole: a console as wide as its terminal, and unbounded where it writes to a pipe
    or a file (made on first use, as a subclass of rich's Console)."""
    from rich.console import Console, ConsoleDimensions

    class StreamConsole(Console):
        @property
        def size(self) -> ConsoleDimensions:
            size = super().size
            if self._width is None and not self.is_terminal and not os.environ.get("COLUMNS"):
                return ConsoleDimensions(UNBOUNDED_WIDTH, size.height)
            return size

        @size.setter
        def size(self, new_size: tuple[int, int]) -> None:
            Console.size.fset(self, new_size)

    return StreamConsole


class LazyConsole:
    """A StreamConsole made when first used: importing rich costs tens of milliseconds that a
    command printing nothing through it (`--help`, a usage error) need not pay. Attributes are
    read from and written to the console itself."""

    def __init__(self, stderr: bool = False) -> None:
        object.__setattr__(self, "_stderr", stderr)
        object.__setattr__(self, "_console", None)

    def console(self) -> Console:
        if self._console is None:
            object.__setattr__(self, "_console", stream_console_class()(stderr=self._stderr))
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.console(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.console(), name, value)


def real_console(console: Console | LazyConsole) -> Console:
    """The rich Console itself, for rich's own classes (a progress display) to hold."""
    return console.console() if isinstance(console, LazyConsole) else console


# Both look up sys.stdout / sys.stderr when they print, so redirections made later still apply.
out = LazyConsole()
err = LazyConsole(stderr=True)


def logger(console: Console | LazyConsole) -> Log:
    """A logger printing plain lines to `console`: no markup, no highlighting, no wrapping, so
    paths and names like graphtrain[cu13] appear exactly as written."""

    def log(message: str) -> None:
        console.print(message, markup=False, highlight=False, soft_wrap=True)

    return log


log: Log = logger(err)  # the default logger of every module: stderr


def counted(count: int, noun: str) -> str:
    """'1 epoch', '20 epochs'."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def progress_bar(console: Console | LazyConsole | None = None) -> Progress:
    """A progress display on stderr: per task its description, a bar, done/total, a status
    text (the task's `status` field) and the time elapsed."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                    console=real_console(console or err))
