"""Launchers for loop.cu: the counter of the device-loop rung's WHILE node."""

from __future__ import annotations

from graphtrain.kernels import I32, PTR, U64, KernelFile, kernel


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
