"""The persistent rung's cnn kernel (kernels/persistent_cnn.cu) on one GPU, in one call of under ten
minutes, each part in a process of its own with a time limit (a grid barrier that never opens shows
as a part that ran out of time, and the parts after it still run):

  smoke     an epoch of the speedrun's cnn on 600 synthetic images (5 steps, the last a tail): its
            time, loss and test accuracy
  speedrun  `graphtrain speedrun --seeds 10 --rows persistent,graphs` on MNIST: each row's mean
            accuracy and median time (model construction to test accuracy), and the ratio
  tests     tests/test_persistent_cnn_gpu.py

Usage (GPU machine, from the tree, GRAPHTRAIN_DATA naming the MNIST folder):
  python3 scripts/checks/persistent_cnn.py [OUT_DIR]      (each part's whole output in OUT_DIR)
  python3 scripts/checks/persistent_cnn.py --steps [N]    (the smoke epoch alone, in this process,
                                                           on N training images, N/2 test images:
                                                           what scripts/checks/sanitize_cnn.sh runs)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this tree's graphtrain, in this process and (PYTHONPATH) in the parts'
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
PARTS = {"smoke": 90, "speedrun": 300, "tests": 180}  # seconds each may take
SAMPLES, TEST = 600, 300


def steps(samples: int = SAMPLES, test: int = TEST) -> None:
    """One epoch of the speedrun's cnn at batch 128 (600 images: 4 steps and a tail of 88) on
    learnable synthetic images, and its test accuracy."""
    import numpy as np

    from graphtrain import config
    from graphtrain.data import Dataset
    from graphtrain.plan import RunPlan
    from graphtrain.stages import get_stage

    rng = np.random.default_rng(0)
    means = rng.uniform(0, 1, (10, 784))
    ytr, yte = rng.integers(0, 10, samples), rng.integers(0, 10, test)
    noisy = lambda y: np.clip(means[y] + 0.3 * rng.standard_normal((len(y), 784)), 0, 1).astype(np.float32)  # noqa: E731
    data = Dataset.from_arrays(noisy(ytr), ytr, noisy(yte), yte, name="digits")
    cfg = config.preset("speedrun").replace(batch=128)
    plan = RunPlan.for_data(cfg, data)
    with get_stage("persistent", "cnn")(plan, data) as stage:
        started = time.perf_counter()
        stage.setup()
        setup_s = time.perf_counter() - started
        result = stage.train_epoch(0, plan.batches[0], measure=True)
        accuracy = stage.test_accuracy()
    print(f"setup {setup_s:.2f} s; epoch {result.ms:.3f} ms, loss {result.train_loss:.4f}, "
          f"train accuracy {result.train_accuracy:.3f}, test accuracy {accuracy:.3f}")


def run_part(name: str, command: list[str], out_dir: Path) -> str:
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PARTS[name], cwd=ROOT)
        text, status = done.stdout + done.stderr, "ok" if done.returncode == 0 else f"failed ({done.returncode})"
    except subprocess.TimeoutExpired as stopped:
        text = (stopped.stdout or b"").decode() + (stopped.stderr or b"").decode()
        status = f"ran out of its {PARTS[name]} s"
    (out_dir / f"{name}.log").write_text(text)
    print(f"== {name}: {status} in {time.perf_counter() - started:.0f} s")
    return text


def main() -> int:
    if sys.argv[1:2] == ["--steps"]:
        if len(sys.argv) > 2:
            steps(int(sys.argv[2]), int(sys.argv[2]) // 2)
        else:
            steps()
        return 0
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="persistent-cnn-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    print(run_part("smoke", [python, __file__, "--steps"], out_dir).strip().splitlines()[-1:])
    results = out_dir / "speedrun.json"
    run_part("speedrun", [python, "-m", "graphtrain", "speedrun", "--seeds", "10", "--rows", "persistent,graphs",
                          "--json", str(results)], out_dir)
    if results.exists():
        rows = {row["name"]: row for row in json.loads(results.read_text())["rows"]}
        for name, row in rows.items():
            if row.get("error"):
                print(f"{name:12s} error: {row['error']}")
                continue
            print(f"{name:12s} mean accuracy {row['accuracy_mean']:.4f} (min {row['accuracy_min']:.4f})  "
                  f"median {row['time_ms_median']:.2f} ms  setup {row['setup_ms']:.0f} ms")
        if all("time_ms_median" in rows.get(name, {}) for name in ("persistent", "graphs")):
            print(f"graphs / persistent: {rows['graphs']['time_ms_median'] / rows['persistent']['time_ms_median']:.2f}×")
    tests = run_part("tests", [python, "-m", "pytest", "-q", "-rs", "tests/test_persistent_cnn_gpu.py"], out_dir)
    print("\n".join(tests.strip().splitlines()[-3:]))
    print(f"logs in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
