"""Launchers for loop.cu: the counter of a device loop's WHILE node, and the WHILE node around a
recorded body (the device-loop rungs', MLP and cnn)."""

from __future__ import annotations

from collections.abc import Callable

from graphtrain.kernels import I32, PTR, U64, KernelFile, kernel
from graphtrain.libs import cuda


class Loop(KernelFile):
    stem = "loop"
    _count_down = kernel("count_down", U64, PTR)
    _set_iterations = kernel("set_iterations", PTR, I32)

    def count_down(self, stream, loop: int, iterations_left: int) -> None:
        """*iterations_left −= 1 and the WHILE node `loop`'s condition: iterations remain (inside
        the loop's body, its last node)."""
        self._count_down(stream, 1, 1, loop, iterations_left)

    def set_iterations(self, stream, iterations_left: int, iterations: int) -> None:
        """*iterations_left = iterations."""
        self._set_iterations(stream, 1, 1, iterations_left, iterations)

    def record_while(self, stream: cuda.Stream, body: cuda.Stream, iterations_left: int, iterations: int,
                     record_body: Callable[[cuda.Stream], None]) -> None:
        """Inside a capture of `stream`: a WHILE node whose body, what `record_body(body)` queues
        on `body` and then this file's count_down, runs `iterations` (≥ 1) times; the counter
        at `iterations_left` (one int32 on the device) is set before it on `stream`."""
        self.set_iterations(stream, iterations_left, iterations)
        with cuda.Graph.while_loop(stream, body) as loop:
            record_body(body)
            self.count_down(body, loop, iterations_left)
