#!/usr/bin/env python3
"""What a process's end costs after its last line of Python, with and without the GPU released first.

    python3 scripts/probes/exit_cost.py [--repeat 5] [--json F]

Each case is a process of its own that does some CUDA work, then stamps time.perf_counter() (the
system's monotonic clock, the same in every process) and leaves by os._exit, as `graphtrain run`
does. Here, the stamp is compared with the moment the process is seen to have exited (the same
clock, after waiting for it): that difference is what happens after the last line, which no
record written by the process can count. Cases:

    python            numpy imported, nothing of CUDA: the floor of any process's end
    context           the primary context alone
    context+release   the same, then graphtrain.libs.cuda.release_devices (timed inside)
    libraries         the context, one 200 MB allocation (a dataset's size), a cuBLAS product and
                      a cuDNN softmax (their first uses, `first_use`): what a graphs run holds
    libraries+release the same, then release_devices

`release ms` is what releasing took inside the process (what the record's `exit` phase holds);
`after ms` what the end cost beyond the last stamp. Releasing pays off where release + after is
about the plain case's after, and `after` is then small: the record then holds nearly all of it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

from graphtrain import report

CASES = ("python", "context", "context+release", "libraries", "libraries+release")
DATASET_BYTES = 200 << 20


def child(case: str) -> None:
    """One case: its work, then its stamps on stdout, then os._exit."""
    import numpy  # noqa: F401: every case pays what a graphtrain run pays for it

    stamps = {}
    if case != "python":
        from graphtrain import environment
        from graphtrain.libs import cuda

        stamps["environment"] = environment.gpu(cuda.open_device())
        if case.startswith("libraries"):
            cuda.malloc(DATASET_BYTES)  # held to the end, freed with the context (a run frees its arena first)
            from graphtrain.libs import cublas, cudnn

            cublas.first_use()
            cudnn.first_use()
        if case.endswith("+release"):
            start = time.perf_counter()
            cuda.release_devices()
            stamps["release_ms"] = (time.perf_counter() - start) * 1e3
    stamps["last"] = time.perf_counter()
    sys.stdout.write(json.dumps(stamps) + "\n")
    sys.stdout.flush()
    os._exit(0)


def measure(case: str) -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--child", case], capture_output=True, text=True)
    seen_exited = time.perf_counter()
    if done.returncode != 0:
        raise SystemExit(f"{case}: exit status {done.returncode}: {done.stderr.strip()[-2000:]}")
    stamps = json.loads(done.stdout.strip().splitlines()[-1])
    return {"wall_ms": (seen_exited - start) * 1e3, "after_ms": (seen_exited - stamps["last"]) * 1e3,
            "release_ms": stamps.get("release_ms"), "environment": stamps.get("environment")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None, help="Also write every run's figures here.")
    parser.add_argument("--cases", default=",".join(CASES), help="Which cases, in order (default: all).")
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
    results, rows = {}, []
    for case in (c for c in args.cases.split(",") if c):
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r}: one of {', '.join(CASES)}")
        measure(case)  # the page cache and the driver's files warm
        runs = [measure(case) for _ in range(args.repeat)]
        results[case] = runs
        after = [run["after_ms"] for run in runs]
        release = [run["release_ms"] for run in runs if run["release_ms"] is not None]
        rows.append([case, f"{statistics.median(run['wall_ms'] for run in runs):.1f}",
                     f"{statistics.median(release):.1f}" if release else report.DASH,
                     f"{statistics.median(after):.1f}", f"{min(after):.1f}–{max(after):.1f}"])
        print(f"{case}: after {statistics.median(after):.1f} ms", file=sys.stderr, flush=True)
    from graphtrain import environment as environment_mod

    gpu = next((run["environment"] for runs in results.values() for run in runs if run["environment"]), {})
    environment = {**environment_mod.host(), **gpu}
    command = shlex.join(["python3", "scripts/probes/exit_cost.py", *sys.argv[1:]])
    print(report.script_header("graphtrain: what a process's end costs after its last line", environment, command,
                               extra=[f"Timing: {args.repeat} processes per case after one untimed; medians"]))
    print("\n".join(report.markdown_table(["case", "wall ms", "release ms", "after ms", "after range"], rows)))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"command": command, "date": report.utc_now(), "environment": environment, "cases": results},
                      fh, indent=2)


if __name__ == "__main__":
    main()
