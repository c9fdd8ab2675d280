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
