"""The `graphtrain` command's entry point (and `python -m graphtrain`).

Before anything imports numpy: numpy's BLAS (OpenBLAS) starts one thread per core and spins them
on every product, so with another busy process on the machine the numpy stage's epochs run many
times slower (jhu on 2 busy cores: 0.10-0.36 s an epoch at 1 thread, 1.9-15.7 s at 2; the 784^3
MLP 6.5-17 s at 1, 52-159 s at 2). graphtrain's products on the CPU are small (a batch of 128
rows; jhu on an idle machine: 206 ms an epoch at 1 thread, 200 ms at all), so the command sets
OPENBLAS_NUM_THREADS=1, unless the user set OPENBLAS_NUM_THREADS, OMP_NUM_THREADS or
MKL_NUM_THREADS. Library users keep their own settings (`import graphtrain` loads no numpy until
a name from it is used).

A Ctrl-C from the moment this module runs, while graphtrain.cli and its modules load included,
ends the command with one line, "interrupted", and exit code 130.

Three things here are about the time a user waits for `graphtrain run`:

- With a rung that trains on the GPU, CUDA starts (cuInit and the primary context: a few hundred
  ms of driver work that holds no Python lock) on a thread of its own before numpy and the rest
  are imported, so that it runs while the interpreter imports them; that thread then loads NVRTC
  and the NVIDIA libraries the rung's modules use. Where starting CUDA fails (no GPU, no
  bindings), the command's own first use of the GPU fails as it always has.
- A run of a rung ends, once its output is flushed and any kernel compile still running has
  finished, without the interpreter's teardown (os._exit): freeing every module and the CUDA
  context object by object took 50-170 ms. Peers (torch, jax) and the other commands exit the
  ordinary way.
- os._exit skips Python's teardown, not the driver's: as the process ends, the kernel closes the
  GPU's device files and the driver destroys the context then, after the run record was written
  (87-123 ms on an H100: results/time-to-result/wall-jhu-h100-after.md, the wall against the sum
  of the record's phases). A run of a rung on the GPU therefore destroys the context itself
  (graphtrain.libs.cuda.release_devices) once its table is printed and before its record is
  written, in the record's `exit` phase; what the process's end still costs after that is what
  scripts/probes/exit_cost.py measures.
"""

import os
import sys

BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
EXIT_INTERRUPTED = 130
LIBRARIES = ("cublas", "cublaslt", "cudnn")  # graphtrain.libs modules of NVIDIA libraries

_leave_without_teardown = False  # set once the command is known to be a run of a rung


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
    from graphtrain.stages import ROWS

    stage = run_rung(argv)
    return stage if stage is not None and ROWS[stage].uses_gpu else None


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


def interrupted() -> None:
    sys.stderr.write("interrupted\n")
    sys.exit(EXIT_INTERRUPTED)


def start(argv: list[str]) -> None:
    """Note a run of a rung, and for one on the GPU start CUDA on its own thread."""
    global _leave_without_teardown
    _leave_without_teardown = run_rung(argv) is not None
    if gpu_stage(argv) is not None:
        from graphtrain import phases
        from graphtrain.libs import cuda

        cuda.open_device_in_background(then=head_start)
        # The process ends with the command: the GPU is released before the record is written,
        # so that the record counts the driver's teardown (see the module's docstring).
        phases.at_exit(cuda.release_devices)
        from graphtrain.libs import nvrtc  # noqa: F401: here, so that the two threads never import it at once


def command() -> None:
    try:
        if not any(os.environ.get(name) for name in BLAS_THREAD_VARIABLES):
            os.environ["OPENBLAS_NUM_THREADS"] = "1"
        start(sys.argv[1:])
        from graphtrain.cli import main as cli_main

        # standalone_mode=False: click would turn a Ctrl-C into "Aborted!" and exit code 1 (the
        # group writes click's own errors as one line, exit 2: graphtrain.cli.Graphtrain).
        code = cli_main.main(prog_name="graphtrain", standalone_mode=False)
    except KeyboardInterrupt:
        interrupted()
    except BrokenPipeError:  # the reader left (`| head`): say nothing more, on a stdout that is gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


def main() -> None:
    try:
        command()
    except SystemExit as done:
        if _leave_without_teardown:
            leave(done.code)
        raise


if __name__ == "__main__":
    main()
