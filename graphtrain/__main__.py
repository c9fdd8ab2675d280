"""The `graphtrain` command (`python -m graphtrain` and the console entry).

A `graphtrain run` with a rung that trains on the GPU starts CUDA (cuInit and the primary context:
a few hundred ms of driver work that holds no Python lock) on a thread of its own before anything
else is imported, so that it runs while the interpreter imports numpy, click, rich and the rung.
Where that fails (no GPU, no bindings), the command's own first use of the GPU fails as it would
have, with the message it always gives.
"""

from __future__ import annotations

import sys


def gpu_stage(argv: list[str]) -> str | None:
    """The rung `graphtrain run` trains with, when the command line asks for a rung on the GPU
    (not the CPU's numpy, not a framework peer, which makes its own context); else None. A
    look at the words, before click parses them: a wrong guess costs only the early start."""
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
    return stage if stage in LADDER and stage != "numpy" else None


def main() -> None:
    if gpu_stage(sys.argv[1:]) is not None:
        from graphtrain.libs import cuda, nvrtc

        cuda.open_device_in_background(then=nvrtc.version)  # NVRTC keys the kernel cache
    from graphtrain.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
