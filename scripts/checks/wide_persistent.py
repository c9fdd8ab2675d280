"""The persistent rung's grid kernel (kernels/persistent_wide.cu) on one GPU, each part in a process of
its own with a time limit (a grid barrier that never opens shows as a part that ran out of time, and
the parts after it still run). Each part runs both builds of the kernel (persistent_wide.VARIANTS:
its operands loaded from L2 into registers, or staged into shared memory by cp.async):

  smoke    an MLP of two hidden layers of 72 units (10 blocks), one epoch of 300 samples in each
           build, every kernel of the report compiled meanwhile (the compile cache serves the parts
           after it)
  timing   the 784³ MLP of the jhu preset (batch 128, SGD at 0.1, 20 epochs) on MNIST: the median
           epoch (CUDA events) and the test accuracy of `persistent` in each build and each grid of
           persistent_wide.GRID_CHOICES that fits it (clusters of two blocks, blocks of 8 units
           alone, of 16), of `device-loop` (bf16) and of `graphs` (fp32); then `persistent` on the
           cuda-mnist preset at H = 512 and 1024 (batch 32, 5000 steps) in each build: its training
           time and accuracy; last, each 784³ epoch against the registers build's in blocks of 8
  phases   scripts/probes/persistent_wide_phases.py: the SM cycles of each phase of a 784³ step,
           a column per build
  errors   the weights' change after three steps against float64 and against the bf16 rung (the
           bounds the GPU tests hold them to), at 784 and 1024 units, and the staged build's at 784
  tests    tests/test_persistent_wide_gpu.py and the persistent rung's refusals in test_rungs_gpu.py
  sweep    (only when named) `graphtrain sweep --preset cuda-mnist --hidden-sizes 128,256,512,1024
           --stages persistent --peer jax-scan`, its table written to OUT_DIR (the rung's default
           build) and printed

Usage (GPU machine, from the tree, GRAPHTRAIN_DATA naming the MNIST folder; each part's whole output
in OUT_DIR; the default parts: all but sweep, which may not fit one ten-minute call with them):
  python3 scripts/checks/wide_persistent.py [OUT_DIR [PART ...]]
  python3 scripts/checks/wide_persistent.py PART [OUT_DIR]        (one part, in this process)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this tree's graphtrain, in this process and (PYTHONPATH) in the parts'
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
PARTS = {"smoke": 150, "timing": 260, "phases": 120, "errors": 100, "tests": 240, "sweep": 540}  # seconds each may take
DEFAULT_PARTS = ("smoke", "timing", "phases", "errors", "tests")
SWEEP = ["sweep", "--preset", "cuda-mnist", "--hidden-sizes", "128,256,512,1024", "--stages", "persistent",
         "--peer", "jax-scan"]
TESTS = ["tests/test_persistent_wide_gpu.py", "tests/test_rungs_gpu.py::test_persistent_refuses_a_model_it_cannot_train",
         "tests/test_rungs_gpu.py::test_persistent_refusal_from_the_cli_is_one_line_and_writes_nothing"]


def precompile() -> None:
    """Every grid kernel the parts build, compiled at once on all cores into the cache."""
    from graphtrain.kernels.persistent_wide import GRID_CHOICES, VARIANTS, PersistentWide, WideShape
    from graphtrain.libs import cuda

    device = cuda.open_device()
    shapes = [WideShape(784, hidden, 10, batch, levels, sm_count=device.sm_count, units=units, split=split, variant=variant)
              for hidden, batch, levels in (
                  ((784,) * 3, 128, 255), ((784,) * 3, 128, 0), ((1024,) * 3, 128, 255), ((512,) * 3, 128, 255),
                  ((257,) * 3, 128, 255), ((512,) * 3, 32, 255), ((1024,) * 3, 32, 255), ((512,), 128, 255),
                  ((257,) * 2, 100, 0))
              for units, split in GRID_CHOICES for variant in VARIANTS]
    shapes = [shape for shape in shapes if shape.refusal() is None]  # (a grid that does not fit a build: not built)
    futures = [PersistentWide.cubin_async(device.arch, shape.defines) for shape in shapes]
    for future in futures:
        future.result()


def smoke() -> None:
    import numpy as np

    from graphtrain.config import TrainConfig
    from graphtrain.data import Dataset
    from graphtrain.kernels import persistent_wide
    from graphtrain.training import train

    started = time.perf_counter()
    data = Dataset.synthetic(300, 100, seed=1)
    for variant in persistent_wide.VARIANTS:
        persistent_wide.DEFAULT_VARIANT = variant
        record = train(TrainConfig(hidden=(72, 72), batch=128, epochs=1, lr=0.1, seed=2), stage="persistent", data=data)
        env = record.environment
        print(f"smoke, {variant}: {env['persistent_kernel']} kernel ({env['persistent_products']}), loss "
              f"{record.epochs[-1].train_loss:.4f}, finite weights "
              f"{all(np.isfinite(layer.w).all() for layer in record.params)}, {time.perf_counter() - started:.1f} s",
              flush=True)
    precompile()
    print(f"smoke: kernels compiled, {time.perf_counter() - started:.1f} s in all")


def timing() -> None:
    from graphtrain.config import PRESETS
    from graphtrain.data import load
    from graphtrain.kernels import persistent_wide
    from graphtrain.training import train

    data = load("mnist")
    jhu = PRESETS["jhu"].replace(hidden=(784,) * 3)

    def row(label: str, stage: str, cfg) -> float:
        """The run's line; its median epoch (ms)."""
        record = train(cfg, stage=stage, data=data)
        ms = [epoch.ms for epoch in record.epochs]
        kernel = record.environment.get("persistent_products", "")
        print(f"{label:<44} median {statistics.median(ms):8.2f} ms/epoch  (min {min(ms):.2f}, max {max(ms):.2f}; "
              f"train {sum(ms):8.1f} ms)  test accuracy {100 * record.test_accuracy:.2f}%  {kernel}", flush=True)
        return statistics.median(ms)

    choices, medians = persistent_wide.GRID_CHOICES, {}
    for variant in persistent_wide.VARIANTS:
        persistent_wide.DEFAULT_VARIANT = variant
        for units, split in choices:
            shape = persistent_wide.WideShape(784, jhu.hidden, 10, jhu.batch, 255, units=units, split=split, variant=variant)
            if shape.refusal() is None:
                persistent_wide.GRID_CHOICES = ((units, split),)
                grid = f"{units} units" + (f" in clusters of {split}" if split > 1 else "")
                medians[variant, grid] = row(f"784^3 jhu persistent {variant}, {grid}", "persistent", jhu)
        persistent_wide.GRID_CHOICES = choices
    persistent_wide.DEFAULT_VARIANT = "registers"
    row("784^3 jhu device-loop (bf16)", "device-loop", jhu)
    row("784^3 jhu graphs (fp32)", "graphs", jhu)
    for h in (512, 1024):
        for variant in persistent_wide.VARIANTS:
            persistent_wide.DEFAULT_VARIANT = variant
            row(f"cuda-mnist H={h} persistent {variant}", "persistent", PRESETS["cuda-mnist"].replace(hidden=(h,) * 3))
    base = medians["registers", "8 units"]
    print("784^3 epoch against the registers build in blocks of 8 units: "
          + ", ".join(f"{variant} ({grid}) {base / ms:.3f}x" for (variant, grid), ms in medians.items()))


def phases(out: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "probes" / "persistent_wide_phases.py")], cwd=ROOT,
                          capture_output=True, text=True)
    (out / "persistent-wide-phases.md").write_text(proc.stdout)
    print(proc.stdout + proc.stderr)
    sys.exit(proc.returncode)


def errors() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import test_persistent_wide_gpu as wide_tests

    from graphtrain.kernels import persistent_wide

    def show(label: str, result: dict) -> None:
        shape = result.pop("shape")
        numbers = ", ".join(f"{name} {value:.3g}" for name, value in result.items())
        print(f"{label} ({shape.blocks} blocks of {shape.block_units} units, clusters of {shape.cluster_blocks}): {numbers}  "
              f"(bound {wide_tests.BOUND})",
              flush=True)

    show("784^3, 3 steps", wide_tests.wide_step_errors((784,) * 3, 128, seed=0, against_bf16=True))
    show("1024^3, 3 steps", wide_tests.wide_step_errors((1024,) * 3, 128, seed=0))
    persistent_wide.DEFAULT_VARIANT = "staged"
    show("784^3 staged, 3 steps", wide_tests.wide_step_errors((784,) * 3, 128, seed=0))
    persistent_wide.DEFAULT_VARIANT = "registers"
    persistent_wide.GRID_CHOICES = ((16, 1),)
    show("784^3 in blocks of 16 units", wide_tests.wide_step_errors((784,) * 3, 128, seed=0))
    persistent_wide.GRID_CHOICES = ((8, 1),)
    show("784^3 in blocks of 8 units", wide_tests.wide_step_errors((784,) * 3, 128, seed=0))


def tests() -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *TESTS], cwd=ROOT,
                          capture_output=True, text=True)
    print(proc.stdout + proc.stderr)
    print("tests:", proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "no output")
    sys.exit(proc.returncode)


def sweep(out: Path) -> None:
    """The issue's sweep, its Markdown, JSON and plots written to `out` by the command itself."""
    proc = subprocess.run([sys.executable, "-m", "graphtrain", *SWEEP, "--out", str(out)], cwd=ROOT)
    sys.exit(proc.returncode)


def main(out: Path, parts: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    print(f"the grid kernel's checks ({', '.join(parts)}), each part's output in {out}", flush=True)
    status = 0
    for part in parts:
        limit = PARTS[part]
        log = out / f"wide-{part}.log"
        started = time.perf_counter()
        with log.open("w") as sink:
            try:
                proc = subprocess.run([sys.executable, __file__, part, str(out)], cwd=ROOT, stdout=sink,
                                      stderr=subprocess.STDOUT, timeout=limit)
                verdict = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
            except subprocess.TimeoutExpired:
                verdict = f"FAILED (still running after {limit} s: stopped)"
        if not verdict.startswith("ok"):
            status = 1
        lines = log.read_text().splitlines()
        shown = [line for line in lines if part != "tests" or line.startswith(("tests:", "FAILED", "ERROR", "SKIPPED"))]
        shown = shown[-40:] if part in ("phases", "sweep") else shown[-16:]  # (the tables whole)
        print(f"== {part}: {verdict}, {time.perf_counter() - started:.0f} s", *shown, sep="\n", flush=True)
    return status


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    args = sys.argv[1:]
    if args and args[0] in PARTS:  # one part, in this process
        part, out = args[0], Path(args[1]) if len(args) > 1 else ROOT / "results"
        run_part = {"smoke": smoke, "timing": timing, "errors": errors, "tests": tests, "phases": lambda: phases(out),
                    "sweep": lambda: sweep(out)}[part]
        run_part()
    else:
        unknown = [part for part in args[1:] if part not in PARTS]
        if unknown:
            print(f"error: no part {', '.join(unknown)} (the parts: {', '.join(PARTS)})", file=sys.stderr)
            sys.exit(2)
        sys.exit(main(Path(args[0]) if args else Path(tempfile.mkdtemp(prefix="wide-")), args[1:] or list(DEFAULT_PARTS)))
