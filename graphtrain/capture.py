"""Each row's own output into its log file, so the terminal shows only graphtrain's.

The frameworks write to the terminal from Python (print, warnings, logging), from C and C++
(XLA's and Triton's diagnostics) and from subprocesses (Inductor's autotuning workers). All of
it ends up on file descriptors 1 and 2, so that is where it is caught: while a row runs, both
point at the row's log file, and `sys.stdout`/`sys.stderr` are streams on those descriptors
(replacing, for the row, the proxies through which rich's progress display prints). graphtrain's
own console keeps writing to the terminal through copies of the descriptors made beforehand.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import sys
from pathlib import Path
from typing import Iterator

from rich.console import Console

_fd_streams: dict[int, io.TextIOWrapper] = {}


def _stream_on(fd: int) -> io.TextIOWrapper:
    """A text stream that writes to descriptor `fd`, whatever it points at when written; made
    once and never closed, since a logging handler may keep it for the life of the process."""
    if fd not in _fd_streams:
        _fd_streams[fd] = io.TextIOWrapper(open(fd, "wb", buffering=0, closefd=False),
                                           encoding="utf-8", errors="replace", line_buffering=True)
    return _fd_streams[fd]


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _flush_everything() -> None:
    for stream in (sys.stdout, sys.stderr, *_fd_streams.values()):
        with contextlib.suppress(Exception):  # a closed or detached stream has nothing to flush
            stream.flush()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)  # C stdio buffers (printf from a library)


class RowOutput:
    """`with RowOutput(console, folder) as rows:` then `with rows.capture(name) as log:` per row.

    A log that stays empty is removed, so only rows that printed something leave a file.
    """

    def __init__(self, console: Console, folder: Path, prefix: str):
        self.console, self.folder, self.prefix = console, Path(folder), prefix
        self._terminal: dict[int, int] = {}  # 1 and 2 -> copies of what they pointed at
        self._console_file = None
        self._swapped_console = False

    def __enter__(self) -> RowOutput:
        _flush_everything()
        for fd in (1, 2):
            self._terminal[fd] = os.dup(fd)
        target = _fileno(self.console.file)
        if target in (1, 2):
            # Private, because rich offers no way to read back whether a console follows
            # sys.stderr or was given a file; restoring it restores exactly that.
            self._console_file = getattr(self.console, "_file", None)
            self.console.file = io.TextIOWrapper(open(self._terminal[target], "wb", buffering=0, closefd=False),
                                                 encoding="utf-8", errors="replace", line_buffering=True)
            self._swapped_console = True
        return self

    def __exit__(self, *exc) -> None:
        if self._swapped_console:
            self.console.file.flush()
            self.console.file = self._console_file
        for fd in self._terminal.values():
            os.close(fd)
        self._terminal.clear()

    def path(self, row: str) -> Path:
        return self.folder / f"{self.prefix}-{row}.log"

    @contextlib.contextmanager
    def capture(self, row: str) -> Iterator[Path]:
        """Descriptors 1 and 2 and sys.stdout/sys.stderr into the row's log while the block runs."""
        path = self.path(row)
        self.folder.mkdir(parents=True, exist_ok=True)
        _flush_everything()
        saved_streams = sys.stdout, sys.stderr
        try:
            with open(path, "wb") as log:
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                sys.stdout, sys.stderr = _stream_on(1), _stream_on(2)
                try:
                    yield path
                finally:
                    _flush_everything()
                    os.dup2(self._terminal[1], 1)
                    os.dup2(self._terminal[2], 2)
                    sys.stdout, sys.stderr = saved_streams
        finally:
            if path.stat().st_size == 0:
                path.unlink()
                with contextlib.suppress(OSError):  # not empty: other logs are there
                    self.folder.rmdir()
