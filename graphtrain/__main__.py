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
"""

import os
import sys

BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
EXIT_INTERRUPTED = 130


def interrupted() -> None:
    sys.stderr.write("interrupted\n")
    sys.exit(EXIT_INTERRUPTED)


def main() -> None:
    try:
        if not any(os.environ.get(name) for name in BLAS_THREAD_VARIABLES):
            os.environ["OPENBLAS_NUM_THREADS"] = "1"
        import click

        from graphtrain.cli import main as command

        try:
            # standalone_mode=False: click would turn a Ctrl-C into "Aborted!" and exit code 1.
            code = command.main(standalone_mode=False)
        except click.exceptions.Abort:
            raise KeyboardInterrupt from None
        except click.exceptions.ClickException as error:  # bad usage: click's message, exit 2
            error.show()
            sys.exit(error.exit_code)
    except KeyboardInterrupt:
        interrupted()
    except BrokenPipeError:  # the reader left (`| head`): say nothing more, on a stdout that is gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
