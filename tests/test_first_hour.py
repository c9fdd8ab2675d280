"""What a new user meets in the first hour: set-up, skips, messages, exit codes, output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_data_folder_that_does_not_exist_skips_the_real_data_tests_with_the_reason(tmp_path):
    """The README's test command with its placeholder left in: skips naming the folder, no errors."""
    missing = tmp_path / "path/to/mnist"
    env = {**os.environ, "GRAPHTRAIN_DATA": str(missing)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         "tests/test_peers_gpu.py", "tests/test_predict.py", "tests/test_data.py::test_real_mnist"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "error" not in result.stdout.splitlines()[-1], result.stdout[-3000:]
    assert f"GRAPHTRAIN_DATA={missing} is not a folder" in result.stdout, result.stdout[-3000:]


def run_ci_data_check(tmp_path, data: str | None) -> subprocess.CompletedProcess:
    """.ci/run in a clone-like folder with no MNIST beside it, up to where it makes its venv: a
    stand-in python3 on PATH says what it was asked and stops the script there."""
    clone = tmp_path / "elsewhere/clone"
    tmp_path.mkdir(parents=True, exist_ok=True)
    (clone / ".ci").mkdir(parents=True)
    (clone / ".ci/run").write_text((ROOT / ".ci/run").read_text())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/bin/sh\necho "python3 $* with GRAPHTRAIN_DATA=$GRAPHTRAIN_DATA"\nexit 3\n')
    (bin_dir / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "GRAPHTRAIN_DATA"}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    if data is not None:
        env["GRAPHTRAIN_DATA"] = data
    return subprocess.run(["bash", str(clone / ".ci/run")], env=env, capture_output=True, text=True,
                          timeout=60)


def test_ci_uses_graphtrain_data_where_it_is_set(tmp_path):
    folder = tmp_path / "mnist"
    folder.mkdir()
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte.gz",
                 "t10k-labels-idx1-ubyte.gz"):
        (folder / name).write_bytes(b"")
    result = run_ci_data_check(tmp_path, str(folder))
    assert result.returncode == 3, result.stderr  # got past the data check, to the venv
    assert f"python3 -m venv .venv with GRAPHTRAIN_DATA={folder}" in result.stdout


def test_ci_fails_loudly_without_the_data(tmp_path):
    result = run_ci_data_check(tmp_path, None)  # unset, and no ../shared/data/mnist beside the clone
    assert result.returncode == 1 and "ci: no MNIST copy: ../shared/data/mnist is not a folder" in result.stderr
    result = run_ci_data_check(tmp_path / "again", str(tmp_path / "nowhere"))
    assert result.returncode == 1, result.stderr
    assert f"GRAPHTRAIN_DATA={tmp_path / 'nowhere'} is not a folder" in result.stderr
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "train-images-idx3-ubyte.gz").write_bytes(b"")
    result = run_ci_data_check(tmp_path / "third", str(incomplete))
    assert result.returncode == 1 and "lacks train-labels-idx1-ubyte(.gz)" in result.stderr
    assert "python3" not in result.stdout
