#!/usr/bin/env python3
"""Where `graphtrain run --stage graphs` spends its setup, and what each way of doing it costs.

    python3 scripts/probes/graphs_setup.py [--stage graphs] [--preset jhu] [--repeat 5] [--json F]
                                           [--variants tree,no-first-use,...] [--no-breakdown]

Two parts, each run as `graphtrain run` processes of their own (python -c, the command's own
entry point, with the changes below made first), warm caches (one untimed run first):

1. The breakdown (one process, twice; the second is shown): the setup's steps and the first
   calls of cuBLAS and cuDNN, each waited for on the GPU and timed, on a timeline from the
   process's start (ms), the thread of the libraries' first uses (`first_use`) included, so
   that what runs beside what shows. The waits add a little to each step.

2. The variants, each `--repeat` times: the process's wall (from before it starts to after it has
   exited), the record's phases, and whether the trained weights are those of `tree` bit for bit:

       tree          the code as it is
       no-first-use  the libraries' first uses not begun beside the data loading (Stage.first_uses
                     gives none): their cost back in the setup's first calls
       no-release    the GPU not released before the record is written (phases.at_exit does
                     nothing): the driver's teardown after the last line again
       fold          no eager warm-up step: the forward pass's first product and the softmax run
                     once before the capture (the libraries' first calls), and the capture is
                     every other kernel's first launch (the driver loads a kernel there, CUDA 12.3 on)
       fold-bare     no warm-up at all: the capture is every first call

Read: the setup phase and the wall of each variant against `tree`; a variant whose weights
differ from `tree`'s, or that fails, is not a way to go.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("tree", "no-first-use", "no-release", "fold", "fold-bare")

# ---- what a child process changes before the command runs ------------------------------------


def patch_early(variant: str) -> None:
    """What must change before the command's entry point starts (it hands over the release then)."""
    if variant == "no-release":
        from graphtrain import phases

        phases.at_exit = lambda work: None


def patch(variant: str) -> None:
    """Make `variant`'s change (see the module's docstring) in this process, once the entry point
    has started CUDA's thread: importing the stages earlier would hold that start back."""
    if variant == "no-first-use":
        from graphtrain.stages.base import Stage
        from graphtrain.stages.baseline import BaselineStage

        BaselineStage.first_uses = Stage.first_uses
    elif variant in ("fold", "fold-bare"):
        from graphtrain.stages.graphs import GraphsStage

        def fold(self) -> None:
            rows = self.plan.batch_sizes[0]
            self.forward(self.acts[0].ptr, rows)
            self.softmax(rows)

        GraphsStage.warm_up = fold if variant == "fold" else (lambda self: None)
    elif variant not in ("tree", "no-release"):
        raise SystemExit(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}")


def breakdown(path: str, stage: str) -> None:
    """Time the setup's steps and the libraries' first calls (each waited for on the GPU) into
    `path`, as (what, thread, start ms from the process's start, ms), when the process leaves."""
    import threading

    from graphtrain import phases
    from graphtrain.libs import cublas, cuda, cudnn, memory
    from graphtrain.stages import device, get_stage

    origin = time.perf_counter() - (phases.process_age() or 0.0)
    events: list[tuple[str, str, float, float]] = []
    seen: set[str] = set()

    def timed(owner, attr: str, label: str, stream_of=None, first_only: bool = False) -> None:
        if not hasattr(owner, attr):  # a row without this step (persistent has no warm-up, say)
            return
        original = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            name = label(*args) if callable(label) else label
            if first_only and name in seen:
                return original(*args, **kwargs)
            seen.add(name)
            stream = stream_of(*args) if stream_of else None
            if stream is not None:
                cuda.wait_uncounted(stream)
            start = time.perf_counter()
            result = original(*args, **kwargs)
            if stream is not None:
                cuda.wait_uncounted(stream)
            end = time.perf_counter()
            events.append((name, threading.current_thread().name, (start - origin) * 1e3, (end - start) * 1e3))
            return result

        setattr(owner, attr, wrapper)

    own_stream = lambda self, *rest: getattr(self, "stream", None)  # noqa: E731: a CPU row has none
    timed(cublas, "first_use", "cublas.first_use (side thread)")
    timed(cudnn, "first_use", "cudnn.first_use (side thread)")
    timed(device.DeviceContext, "__init__", "device context, stream, events")
    timed(memory.Arena, "allocate", "arena allocation")
    timed(device.DatasetOnDevice, "upload", "dataset upload", stream_of=lambda self, stream: stream)
    timed(cublas.Cublas, "__init__", "cublasCreate and its settings")
    timed(cudnn.Cudnn, "__init__", "cudnnCreate")
    # On the row's own class: a method it overrides calls its bases' in turn, all inside the wrapper.
    row = get_stage(stage)
    timed(row, "setup_extra", "setup_extra (handles, descriptors, cursor)", own_stream)
    timed(row, "warm_up", "warm-up", own_stream)
    timed(row, "upload_initial_weights", "initial weights upload", own_stream)
    timed(row, "capture", "capture and instantiate", own_stream)
    timed(cublas.Cublas, "gemm", lambda self, ta, tb, m, n, k, *rest: f"first gemm {m}x{n}x{k} t{int(ta)}{int(tb)}",
          lambda self, *rest: self.stream, first_only=True)
    timed(cudnn.Cudnn, "softmax_forward", "first cudnnSoftmaxForward", lambda self, *rest: self.stream,
          first_only=True)
    timed(row, "train_epoch", lambda self, epoch, *rest: "epoch 1" if epoch == 0 else "epoch 2",
          own_stream, first_only=True)
    timed(row, "test_accuracy", "first test accuracy", own_stream, first_only=True)

    leaving = phases.leaving

    def leaving_then_write() -> None:
        start = time.perf_counter()
        leaving()  # the GPU's release (graphtrain.__main__ handed it over)
        events.append(("the exit phase (the GPU's release)", threading.current_thread().name,
                       (start - origin) * 1e3, (time.perf_counter() - start) * 1e3))
        with open(path, "w") as fh:
            json.dump(events, fh)

    phases.leaving = leaving_then_write


def child(variant: str, breakdown_path: str | None, stage: str = "graphs") -> None:
    """One `graphtrain run` (its words in sys.argv) through the command's entry point, changed."""
    import graphtrain.__main__ as entry

    patch_early(variant)
    start = entry.start

    def start_then_patch(argv: list[str]) -> None:
        start(argv)
        patch(variant)
        if breakdown_path:
            breakdown(breakdown_path, stage)

    entry.start = start_then_patch
    entry.main()


# ---- the parent -------------------------------------------------------------------------------


def command(variant: str, args: argparse.Namespace, record: Path, saved: Path | None,
            breakdown_path: str | None = None) -> list[str]:
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'scripts' / 'probes')!r}); import graphs_setup; "
            f"graphs_setup.child({variant!r}, {breakdown_path!r}, {args.stage!r})")
    line = [sys.executable, "-c", code, "run", "--stage", args.stage, "--preset", args.preset, "--json", str(record)]
    return line + (["--save", str(saved)] if saved is not None else [])


def run(line: list[str]) -> tuple[float, str]:
    """The process's wall in ms, from before it starts to after it has exited; its error or ""."""
    start = time.perf_counter()
    done = subprocess.run(line, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    wall_ms = (time.perf_counter() - start) * 1e3
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return wall_ms, lines[-1] if lines else f"exit status {done.returncode}"
    return wall_ms, ""


def same_weights(a: Path, b: Path) -> bool:
    from graphtrain import model_io

    first, second = model_io.load(a), model_io.load(b)
    import numpy as np

    return all(np.array_equal(x.w, y.w) and (x.b is None) == (y.b is None) and (x.b is None or np.array_equal(x.b, y.b))
               for x, y in zip(first.layers, second.layers, strict=True))


def print_breakdown(args: argparse.Namespace, scratch: Path) -> list:
    path = str(scratch / "breakdown.json")
    for _ in range(2):  # the first fills the caches; the second is shown
        wall, error = run(command("tree", args, scratch / "b.json", None, path))
        if error:
            print(f"breakdown: failed: {error}")
            return []
    events = sorted(json.loads(Path(path).read_text()), key=lambda e: e[2])
    print(f"\n## Breakdown ({args.stage}, one process, wall {wall:.0f} ms; ms from the process's start)\n")
    print(f"| start ms | ms | thread | what |\n|---:|---:|---|---|")
    for what, thread, start, ms in events:
        print(f"| {start:.1f} | {ms:.1f} | {'main' if thread == 'MainThread' else thread} | {what} |")
    return events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", default="graphs")
    parser.add_argument("--preset", default="jhu")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--no-breakdown", action="store_true")
    parser.add_argument("--json", default=None, help="Also write the figures here.")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    out = {"stage": args.stage, "preset": args.preset, "variants": {}}
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        first = scratch / "first.json"
        run(command("tree", args, first, None))  # caches warm, and a record for the header
        print(header(args, first))
        if not args.no_breakdown:
            out["breakdown"] = print_breakdown(args, scratch)
        print(f"\n## Variants ({args.stage}, {args.repeat} runs each, warm caches)\n")
        names = ("startup", "cuda_context", "data", "kernels", "setup", "training", "evaluation", "writing", "exit")
        print("| variant | wall ms | range | Σ phases | Δ | " + " | ".join(names) + " | weights as tree |")
        print("|---|---:|---:|---:|---:|" + "---:|" * len(names) + "---|")
        reference = scratch / "tree.safetensors"
        for variant in variants:
            record_path, saved = scratch / f"{variant}.json", scratch / f"{variant}.safetensors"
            line = command(variant, args, record_path, saved)
            _, error = run(line)  # caches warm
            runs = []
            for _ in range(args.repeat if not error else 0):
                wall, error = run(line)
                if error:
                    break
                record = json.loads(record_path.read_text())
                runs.append({"wall_ms": wall, "phases": record.get("phases") or {}})
            if error:
                print(f"| {variant} | failed: {error} |")
                out["variants"][variant] = {"error": error}
                continue
            if variant == "tree":
                os.replace(saved, reference)
                same = "—"
            elif not reference.exists():
                same = "no tree run to compare with"
            else:
                same = "yes" if same_weights(reference, saved) else "NO"
            walls = [r["wall_ms"] for r in runs]
            median_run = sorted(runs, key=lambda r: r["wall_ms"])[len(runs) // 2]
            phases = median_run["phases"]
            total = sum(phases.values())
            gap = 100 * (total - median_run["wall_ms"]) / median_run["wall_ms"]
            print(f"| {variant} | {statistics.median(walls):.0f} | {min(walls):.0f}–{max(walls):.0f} | {total:.0f} | "
                  f"{gap:+.1f}% | " + " | ".join(f"{phases.get(n, 0):.0f}" for n in names) + f" | {same} |", flush=True)
            out["variants"][variant] = {"runs": runs, "weights_as_tree": same}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


def header(args: argparse.Namespace, record_path: Path) -> str:
    """The provenance of what follows, from a run's record (its device and libraries)."""
    from graphtrain import report

    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    command = shlex.join(["python3", "scripts/probes/graphs_setup.py", *sys.argv[1:]])
    return report.script_header(f"graphtrain {args.stage} setup: where it goes, and its variants",
                                record.get("environment") or {}, command,
                                extra=[f"Workload: --preset {args.preset}, {args.repeat} runs a variant after one "
                                       "untimed; each run `python -c` through the command's entry point"])


if __name__ == "__main__":
    main()
