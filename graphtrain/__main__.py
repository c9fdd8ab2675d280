"""The `graphtrain` command (`python -m graphtrain` and the console entry).

Two things here are about the time a user waits for `graphtrain run`:

- With a rung that trains on the GPU, CUDA starts (cuInit and the primary context: a few hundred
  ms of driver work that holds no Python lock) on a thread of its own before anything else is
  imported, so that it runs while the interpreter imports numpy, click, rich and the rung; that
  thread then loads NVRTC and the NVIDIA libraries the rung's modules use. Where starting CUDA
  fails (no GPU, no bindings), the command's own first use of the GPU fails as it always has.
- A run of a rung ends, once its output is flushed and any kernel compile still running has
  finished, without the interpreter's teardown (os._exit): freeing every module and the CUDA
  context object by object takes 100 ms or more that the process's exit does at once. Peers
  (torch, jax) and the other commands exit the ordinary way.
"""

from __future__ import annotations

import os
import sys

LIBRARIES = ("cublas", "cublaslt", "cudnn")  # graphtrain.libs modules of NVIDIA libraries


def run_rung(argv: list[str]) -> str | None:
    """The rung `graphtrain run` trains with (numpy, its default, included); None for another
    command, a peer or --help. A look at the words before click parses them: a wrong guess costs
    only the head start or the quick exit."""
    from graphtrain.stages import LADDER

    words = [word for word in argv if word not in ("-v", "--verbose")]
    if not words or words[0] != "run" or "--help" in words or "-h" in words:
        return None
    stage = "numpy"  # run's default
    for i, word in enumerate(words):
        if word == "--stage" and i + 1 < len(words):
            stage = words[i + 1]
        elif word.startswith("--stage="):
            stage = word.split("=", 1)[1]
    return stage if stage in LADDER else None


def gpu_stage(argv: list[str]) -> str | None:
    """The rung of a `graphtrain run` on the GPU (not the CPU's numpy, not a peer, which makes its
    own context), else None."""
    stage = run_rung(argv)
    return stage if stage != "numpy" else None


def head_start() -> None:
    """On the CUDA thread, once the context is made: load NVRTC (it keys the kernel cache) and the
    NVIDIA libraries whose modules the rung has imported by then (dlopen holds no Python lock)."""
    from graphtrain.libs import nvrtc

    nvrtc.version()
    for name in LIBRARIES:
        module = sys.modules.get(f"graphtrain.libs.{name}")
        if module is not None:
            module.library.load()


def leave(code: object) -> None:
    """End the process with `code` as `sys.exit(code)` would, without the interpreter's teardown."""
    nvrtc = sys.modules.get("graphtrain.libs.nvrtc")
    if nvrtc is not None:
        nvrtc.finish_compiles()  # a compile still running writes its cubin to the cache whole
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it, as at any exit
            pass
    os._exit(code or 0)


def main() -> None:
    rung = run_rung(sys.argv[1:])
    if rung is not None and rung != "numpy":
        from graphtrain.libs import cuda

        cuda.open_device_in_background(then=head_start)
        from graphtrain.libs import nvrtc  # noqa: F401: here, so that the two threads never import it at once
    from graphtrain.cli import main as cli_main

    if rung is None:
        cli_main()
        return
    try:
        cli_main()
    except SystemExit as done:  # click ends every command with one
        leave(done.code)
    leave(0)


if __name__ == "__main__":
    main()
