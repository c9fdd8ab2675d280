"""What a new user installs and runs: the extras in pyproject.toml, CI's checks, the README."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

tomllib = pytest.importorskip("tomllib", reason="tomllib is new in Python 3.11")

# The packages of NVIDIA's CUDA 13 wheels: named without a -cu12 / -cu13 suffix, or with -cu13.
CUDA13_NAMES = {"nvidia-cublas", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "nvidia-cudnn-cu13"}


def extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def requirements(extra: str) -> list[str]:
    """The extra's requirements, with the extras of graphtrain it names expanded."""
    out = []
    for requirement in extras()[extra]:
        nested = re.fullmatch(r"graphtrain\[([\w,-]+)\]", requirement)
        if nested:
            for name in nested.group(1).split(","):
                out += requirements(name)
        else:
            out.append(requirement)
    return out


def name_of(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()


@pytest.mark.parametrize("extra", ["cu12", "cu13", "nvrtc-cu12", "nvrtc-cu13"])
def test_cuda_extras_name_the_bindings_and_a_matched_set_of_one_cuda_major(extra):
    reqs = requirements(extra)
    names = {name_of(r) for r in reqs}
    assert "cuda-python" not in names  # the meta-package: graphtrain uses cuda.bindings alone
    assert {"cuda-bindings", "cuda-pathfinder"} <= names
    assert any(re.fullmatch(r"cuda-pathfinder>=1\.([7-9]|\d\d+),<2", r) for r in reqs)  # finds cuDNN
    major = extra[-2:]
    # cuBLAS, the runtime and NVRTC come from one cuda-toolkit release: a matched set.
    toolkit = [r for r in reqs if name_of(r) == "cuda-toolkit"]
    assert toolkit and all(re.search(rf"==\s*{major}\.\d+\.\*", r) for r in toolkit), toolkit
    assert not names & {"nvidia-cublas", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime",
                        "nvidia-cublas-cu12", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12"}
    bindings = next(r for r in reqs if name_of(r) == "cuda-bindings")
    assert bindings.endswith(f"<{int(major) + 1}")
    if major == "12":
        assert not names & CUDA13_NAMES


def test_the_test_extra_brings_no_cuda_package():
    """`.[cu12,test]` must not bring a CUDA 13 NVRTC: the test extra names no CUDA package."""
    assert [name_of(r) for r in requirements("test")] == ["pytest"]


@pytest.fixture
def ci_copy(tmp_path):
    """.ci/run in a checkout of its own, with no MNIST copy beside it."""
    repo = tmp_path / "checkout"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci/run", repo / ".ci/run")
    return repo


def test_ci_fails_without_the_mnist_copy_instead_of_skipping(ci_copy):
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    env = {k: v for k, v in os.environ.items() if k != "GRAPHTRAIN_DATA"}  # CI's own layout
    result = subprocess.run(["bash", str(ci_copy / ".ci/run")], capture_output=True, text=True, timeout=60,
                            env=env)
    assert result.returncode == 1
    assert "no MNIST copy" in result.stderr and "GRAPHTRAIN_DATA" in result.stderr
    assert not (ci_copy / ".venv").exists()  # it failed first, before installing anything


def test_ci_checks_that_both_cuda_extras_resolve():
    script = (ROOT / ".ci/run").read_text()
    assert re.search(r"for extra in cu12,test cu13; do\n\s+python -m pip install [^\n]*--dry-run", script)


def test_readme_test_command_says_how_to_point_the_tests_at_mnist():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("Run the tests", 1)[1].split("\n## ", 1)[0]
    assert "GRAPHTRAIN_DATA=" in section and "skip" in section
    installs = re.findall(r'pip install "(\.\[[\w,-]+\])"', section)
    # Any machine: the test extra alone; then the full extras, which CI installs.
    assert installs[0] == ".[test]", installs
    ci = (ROOT / ".ci/run").read_text()
    # CI runs the README's test command: one of its installs and the same pytest.
    assert any(f'pip install --quiet "{install}"' in ci for install in installs[1:]), installs
    pytest_line = re.search(r"python3? -m pytest( -[\w -]+)?$", section, re.M).group(0)
    assert re.search(r"^python -m pytest" + re.escape(pytest_line.split("pytest", 1)[1]) + "$", ci, re.M), pytest_line


def test_python_runs_the_package():
    result = subprocess.run([sys.executable, "-m", "graphtrain", "--help"], capture_output=True, text=True,
                            cwd=ROOT, timeout=60)
    assert result.returncode == 0 and "--stage numpy" in result.stdout
