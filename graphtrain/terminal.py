"""What graphtrain shows on the terminal: results on stdout, everything else on stderr.

One console per stream, one logger for progress notes, one progress-bar factory. Results
(tables, a JSON record written to `-`) go to stdout so that it can be piped; downloads, notes,
warnings, progress bars and errors go to stderr.
"""

from __future__ import annotations

from typing import Callable

import os

from rich.console import Console, ConsoleDimensions
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

Log = Callable[[str], None]

# Output that is not a terminal (a pipe, a file) is this wide: a table keeps every value whole
# instead of being cut to 80 columns with "…"; $COLUMNS, where set, still rules.
UNBOUNDED_WIDTH = 10_000


class StreamConsole(Console):
    """A console as wide as its terminal, and unbounded where it writes to a pipe or a file."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        if self._width is None and not self.is_terminal and not os.environ.get("COLUMNS"):
            return ConsoleDimensions(UNBOUNDED_WIDTH, size.height)
        return size

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)


# Both look up sys.stdout / sys.stderr when they print, so redirections made later still apply.
out = StreamConsole()
err = StreamConsole(stderr=True)


def logger(console: Console) -> Log:
    """A logger printing plain lines to `console`: no markup, no highlighting, no wrapping, so
    paths and names like graphtrain[cu13] appear exactly as written."""

    def log(message: str) -> None:
        console.print(message, markup=False, highlight=False, soft_wrap=True)

    return log


log: Log = logger(err)  # the default logger of every module: stderr


def counted(count: int, noun: str) -> str:
    """'1 epoch', '20 epochs'."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def progress_bar(console: Console | None = None) -> Progress:
    """A progress display on stderr: per task its description, a bar, done/total, a status
    text (the task's `status` field) and the time elapsed."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                    console=console or err)
