"""What a new user meets in the first hour: set-up, skips, messages, exit codes, output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


# --------------------------------------------------------------------------------------------
# One exit-code rule: 2 for what the user can fix before anything runs, 1 for failures after
# --------------------------------------------------------------------------------------------


def invoke(*args):
    from click.testing import CliRunner

    from graphtrain.cli import main

    try:  # click < 8.2 mixes stderr into stdout unless told not to
        runner = CliRunner(mix_stderr=False)
    except TypeError:
        runner = CliRunner()
    return runner.invoke(main, [str(a) for a in args])


def error_line(result, code: int) -> str:
    assert result.exit_code == code, (result.output, result.stderr)
    assert "Traceback" not in result.output + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_every_missing_piece_exits_2(monkeypatch, tmp_path):
    """A missing GPU or bindings, a missing framework, a missing CUPTI or matplotlib: each one
    line and exit 2, before any data is looked for (the data folder here does not exist)."""
    from graphtrain import evaluate, profile
    from graphtrain.errors import GpuUnavailableError, MissingRequirement, UsageError
    from graphtrain.libs import cuda
    from graphtrain.peers import PeerUnavailable
    from graphtrain.peers import jax_scan

    assert issubclass(GpuUnavailableError, MissingRequirement) and issubclass(PeerUnavailable, MissingRequirement)
    assert issubclass(MissingRequirement, UsageError)
    nowhere = tmp_path / "nowhere"

    def no_gpu():
        raise GpuUnavailableError("the CUDA Python bindings (cuda-bindings) are not installed")

    monkeypatch.setattr(cuda, "open_device", no_gpu)
    line = error_line(invoke("run", "--stage", "graphs", "--data-dir", nowhere), 2)
    assert "cuda-bindings" in line and "--stage numpy" in line

    def no_jax():
        raise PeerUnavailable("jax is not installed")

    monkeypatch.setattr(jax_scan, "import_jax", no_jax)
    assert "jax is not installed" in error_line(invoke("run", "--stage", "jax-scan", "--data-dir", nowhere), 2)

    monkeypatch.setattr(profile, "cupti_missing", lambda: "cupti-python is not installed")
    assert "CUPTI" in error_line(invoke("run", "--profile", "--data-dir", nowhere), 2)

    monkeypatch.setattr(evaluate, "require_matplotlib",
                        lambda: (_ for _ in ()).throw(MissingRequirement("--plot needs matplotlib")))
    model = tmp_path / "m.safetensors"
    model.write_bytes(b"")
    assert "matplotlib" in error_line(invoke("eval", "--model", model, "--plot", tmp_path / "c.png"), 2)


def test_the_commands_page_states_the_exit_code_rule():
    page = (ROOT / "docs/commands.md").read_text()
    rule = page.split("Exit codes:", 1)[1].split("\n\n", 1)[0]
    for words in ("2 what you can fix", "missing GPU", "matplotlib", "CUPTI", "1 a failure", "130 interrupted"):
        assert words in " ".join(rule.split()), rule


def test_save_to_standard_output_is_refused_before_training(tmp_path):
    line = error_line(invoke("run", "--save", "-", "--data-dir", tmp_path / "nowhere"), 2)
    assert "--save" in line and "'-'" in line
    assert not (Path.cwd() / "-").exists()


def test_a_precision_the_stage_lacks_is_refused_before_the_data_is_looked_for(tmp_path):
    line = error_line(invoke("run", "--stage", "numpy", "--precision", "bf16", "--data-dir",
                             tmp_path / "nowhere"), 2)
    assert line == "error: numpy trains in fp32, not --precision bf16"


def test_one_epoch_is_singular(monkeypatch):
    from graphtrain import cli
    from graphtrain.data import Dataset

    monkeypatch.setattr(cli.data_mod, "load", lambda *a, **k: Dataset.synthetic(300, 50, seed=0))
    result = invoke("run", "--stage", "numpy", "--epochs", "1")
    assert result.exit_code == 0, result.stderr
    assert ", 1 epoch, data" in result.stderr


# --------------------------------------------------------------------------------------------
# The command's start: BLAS threads, Ctrl-C
# --------------------------------------------------------------------------------------------


def graphtrain_process(*args, env=None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "graphtrain", *map(str, args)], cwd=ROOT,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


SHOW_BLAS_THREADS = """
import os, sys
import graphtrain.__main__ as entry
assert "numpy" not in sys.modules, "importing the entry point loaded numpy"
sys.argv = ["graphtrain", "--version"]
try:
    entry.main()
except SystemExit:
    pass
print("OPENBLAS_NUM_THREADS", os.environ.get("OPENBLAS_NUM_THREADS"))
"""


def test_the_command_runs_numpys_blas_on_one_thread_unless_told_otherwise():
    base = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                                              "MKL_NUM_THREADS")}
    for extra, expected in (({}, "1"), ({"OPENBLAS_NUM_THREADS": "4"}, "4"), ({"OMP_NUM_THREADS": "3"}, "None")):
        result = subprocess.run([sys.executable, "-c", SHOW_BLAS_THREADS], cwd=ROOT, env={**base, **extra},
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert f"OPENBLAS_NUM_THREADS {expected}" in result.stdout, (extra, result.stdout)
    page = " ".join((ROOT / "docs/commands.md").read_text().split())
    assert "OPENBLAS_NUM_THREADS=1" in page


def test_ctrl_c_while_the_modules_load_is_one_line_and_exit_130(monkeypatch, capsys):
    """The entry point's first moments: a Ctrl-C while graphtrain.cli (click, rich, numpy) loads."""
    import builtins

    import graphtrain.__main__ as entry

    real_import = builtins.__import__

    def interrupted_import(name, *args, **kwargs):
        if name == "graphtrain.cli":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted_import)
    monkeypatch.setattr(sys, "argv", ["graphtrain", "info"])
    try:
        entry.main()
    except SystemExit as exit_:
        assert exit_.code == 130
    else:
        raise AssertionError("main() returned")
    assert capsys.readouterr().err == "interrupted\n"


def test_ctrl_c_while_training_is_one_line_and_exit_130(mnist_dir, tmp_path):
    import signal

    record = tmp_path / "run.json"
    process = graphtrain_process("run", "--stage", "numpy", "--epochs", "50", "--data-dir", mnist_dir,
                                 "--json", record)
    started = process.stderr.readline()  # "graphtrain: stage numpy, ..." once the data is loaded
    assert started.startswith("graphtrain: stage numpy"), started
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1] == "interrupted" and "Traceback" not in err, err
    assert not record.exists()


# --------------------------------------------------------------------------------------------
# Data: offline messages, the dataset named
# --------------------------------------------------------------------------------------------


def test_offline_without_the_data_says_it_in_a_few_lines_and_names_the_way_out(tmp_path, monkeypatch):
    """No network: the download fails; the error names the files, where they were looked for,
    why they were not fetched, and the ways out, without advising the download that just failed."""
    import dataclasses

    from graphtrain.data.registry import DATASETS

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("GRAPHTRAIN_DATA", raising=False)
    monkeypatch.delenv("GRAPHTRAIN_MIRROR", raising=False)
    unreachable = ("http://127.0.0.1:1/", "http://127.0.0.1:2/")
    monkeypatch.setitem(DATASETS, "mnist", dataclasses.replace(DATASETS["mnist"], mirrors=unreachable))
    result = invoke("run", "--stage", "numpy")
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = lines[lines.index(next(line for line in lines if line.startswith("error:"))):]
    assert len(errors) <= 3, result.stderr
    text = "\n".join(errors)
    assert "train-images-idx3-ubyte.gz" in text and "no mirror could be reached" in text
    assert "--data-dir DIR" in text and "GRAPHTRAIN_MIRROR=file:///DIR/" in text
    assert "fetch them with `graphtrain data download`" not in text
    assert not (tmp_path / "home/.cache/graphtrain/mnist").exists()

    offline = invoke("run", "--stage", "numpy", "--offline")
    assert offline.exit_code == 2 and len([line for line in offline.stderr.splitlines() if line.strip()]) == 3


def test_a_file_mirror_fills_the_cache(tmp_path, monkeypatch, mnist_dir):
    """The offline way out the message names: GRAPHTRAIN_MIRROR=file:///DIR/ graphtrain data download."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("GRAPHTRAIN_MIRROR", mnist_dir.absolute().as_uri() + "/")
    result = invoke("data", "download")
    assert result.exit_code == 0, result.stderr
    cache = tmp_path / "home/.cache/graphtrain/mnist"
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
         "t10k-labels-idx1-ubyte.gz"])


def test_files_of_another_dataset_are_refused_with_the_reason(tmp_path, mnist_dir):
    """MNIST's files given as fashion-mnist, gzipped or not: refused, naming what they are;
    nothing trained."""
    import gzip

    from graphtrain import data
    from graphtrain.errors import DataError

    line = error_line(invoke("run", "--dataset", "fashion-mnist", "--data-dir", mnist_dir, "--epochs", "1"), 2)
    assert "is not fashion-mnist's train images: it is mnist's" in line, line
    raw = tmp_path / "raw"
    raw.mkdir()
    for path in mnist_dir.iterdir():
        if path.name.endswith(".gz"):
            (raw / path.name.removesuffix(".gz")).write_bytes(gzip.decompress(path.read_bytes()))
    try:
        data.load("fashion-mnist", data_dir=raw, offline=True)
    except DataError as exc:
        assert "it is mnist's" in str(exc)
    else:
        raise AssertionError("uncompressed MNIST files loaded as fashion-mnist")
    assert data.load("mnist", data_dir=raw, offline=True).train_images.shape == (60000, 784)


def test_a_file_whose_sum_matches_nothing_recorded_is_refused(tmp_path, mnist_dir):
    """Well-formed IDX files of the right shapes that are not MNIST (its test labels shuffled)."""
    import gzip
    import shutil

    import numpy as np

    from graphtrain import data
    from graphtrain.errors import DataError

    folder = tmp_path / "shuffled"
    shutil.copytree(mnist_dir, folder)
    labels = folder / "t10k-labels-idx1-ubyte.gz"
    raw = bytearray(gzip.decompress(labels.read_bytes()))
    body = np.frombuffer(bytes(raw[8:]), np.uint8).copy()
    np.random.default_rng(5).shuffle(body)
    labels.write_bytes(gzip.compress(bytes(raw[:8]) + body.tobytes()))
    try:
        data.load("mnist", data_dir=folder, offline=True)
    except DataError as exc:
        assert "t10k-labels-idx1-ubyte.gz is not mnist's test labels" in str(exc)
        assert "matches none recorded" in str(exc)
    else:
        raise AssertionError("a shuffled label file loaded as MNIST")


# --------------------------------------------------------------------------------------------
# The ladder on a machine without a GPU; interrupted; tables that keep every value
# --------------------------------------------------------------------------------------------


@pytest.fixture
def no_gpu_synthetic(monkeypatch):
    """No GPU (the driver's absence as graphtrain sees it) and a small synthetic dataset."""
    from graphtrain import cli
    from graphtrain.data import Dataset
    from graphtrain.errors import GpuUnavailableError
    from graphtrain.libs import cuda

    def no_driver(ordinal=0):
        raise GpuUnavailableError("no NVIDIA driver found: libcuda could not be loaded")

    monkeypatch.setattr(cuda, "open_device", no_driver)
    monkeypatch.setattr(cli.data_mod, "load", lambda *a, **k: Dataset.synthetic(600, 100, seed=0))


def test_a_ladder_without_a_gpu_writes_nothing_into_results(no_gpu_synthetic, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = error_line(invoke("ladder", "--epochs", "1"), 2)  # the GPU rungs asked for: refused at once
    assert "no NVIDIA driver found: libcuda could not be loaded" in line and "--stages numpy" in line
    assert list(tmp_path.iterdir()) == []

    numpy_only = invoke("ladder", "--epochs", "1", "--stages", "numpy", "--no-peers")
    assert numpy_only.exit_code == 0, numpy_only.stderr
    assert not (tmp_path / "results").exists()
    assert "no GPU here: the table is shown, not written into results/ (--out DIR writes it)" in numpy_only.stderr
    assert "numpy" in numpy_only.stdout  # the table, on stdout

    asked = invoke("ladder", "--epochs", "1", "--stages", "numpy", "--no-peers", "--out", tmp_path / "mine")
    assert asked.exit_code == 0, asked.stderr
    assert (tmp_path / "mine/ladder-jhu-softmax-e1-cpu-partial.md").exists()


def test_an_interrupted_ladder_leaves_no_out_folder(no_gpu_synthetic, tmp_path, monkeypatch):
    from graphtrain import training

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(training, "run_set_up", interrupted)  # the epochs of every runner's protocol
    for command in ("ladder", "sweep"):
        out = tmp_path / f"new/{command}"
        extra = ["--hidden-sizes", "8"] if command == "sweep" else []
        result = invoke(command, "--epochs", "1", "--stages", "numpy", "--no-peers", "--out", out, *extra)
        assert result.exit_code == 130, result.stderr
        assert [line for line in result.stderr.splitlines() if line.strip()][-1] == "interrupted"
        assert not out.exists()
    kept = tmp_path / "kept"
    (kept / "notes").mkdir(parents=True)
    result = invoke("ladder", "--epochs", "1", "--stages", "numpy", "--no-peers", "--out", kept)
    assert result.exit_code == 130 and (kept / "notes").is_dir()  # a folder that was there stays


def piped(*args) -> str:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    result = subprocess.run([sys.executable, "-m", "graphtrain", *map(str, args)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_tables_written_to_a_pipe_keep_every_value():
    text = piped("compare", "results/ladder-jhu-softmax-h100.json", "results/ladder-jhu-mlp784x3-h100.json")
    assert "…" not in text
    header = next(line for line in text.splitlines() if "A epoch ms" in line)
    for column in ("row", "A epoch ms", "B epoch ms", "A/B", "Δ test acc", "A busy ms", "B busy ms"):
        assert column in header
    from graphtrain import report

    saved = report.read_json(ROOT / "results/ladder-jhu-softmax-h100.json")
    persistent = next(r for r in saved["records"] if r["stage"] == "persistent")
    row = next(line for line in text.splitlines() if line.split()[:1] == ["persistent"])
    assert report.fmt_ms(persistent["epoch_ms"]) in row, row


def test_the_run_footer_and_the_sweep_title_are_lines_of_their_own():
    import io

    from rich.console import Console

    from graphtrain.cli import summary_table
    from graphtrain.config import TrainConfig
    from graphtrain.data import Dataset
    from graphtrain.sweep import grid_table
    from graphtrain.training import train

    record = train(TrainConfig(epochs=1, batch=100), stage="numpy", data=Dataset.synthetic(300, 50, seed=0))
    console = Console(file=io.StringIO(), width=120)
    console.print(summary_table(record))
    lines = console.file.getvalue().splitlines()
    assert any(line.startswith("median epoch (2nd half)") and "test accuracy" in line for line in lines), lines

    records = [{"stage": "graphs", "kind": "stage", "hidden_size": 8, "epoch_ms": 1.0,
                "epochs": [{"epoch": 1, "ms": 1.0}], "config": {}}]
    console = Console(file=io.StringIO(), width=120)
    console.print(grid_table(records))
    assert "graphtrain sweep" in [line.strip() for line in console.file.getvalue().splitlines()]


def test_compare_refuses_a_ladder_against_a_sweep():
    from graphtrain.cli import main  # noqa: F401

    line = error_line(invoke("compare", ROOT / "results/ladder-jhu-softmax-h100.json",
                             ROOT / "results/sweep-cuda-mnist-mlpHx3-h100.json"), 2)
    assert "is a ladder and" in line and "a sweep: compare two ladders or two sweeps" in line


# --------------------------------------------------------------------------------------------
# graphtrain info
# --------------------------------------------------------------------------------------------


def test_a_library_whose_dependency_is_missing_names_the_dependency(monkeypatch):
    """cuDNN loads cuBLASLt first: its row names cuBLASLt as what is missing, not cuDNN."""
    pathfinder = pytest.importorskip("cuda.pathfinder")
    from graphtrain.errors import GpuUnavailableError
    from graphtrain.libs.shared_lib import SharedLibrary

    def fail(name):
        if name == "cudnn":
            raise RuntimeError('Failure finding "libcublasLt.so.13 or libcublasLt.so.12": No such file')
        raise RuntimeError(f'Failure finding "lib{name}.so.13": No such file')

    monkeypatch.setattr(pathfinder, "load_nvidia_dynamic_lib", fail)
    for name, expected in (("cudnn", "cuDNN 9 (libcudnn) cannot be loaded: it needs libcublasLt, which was not found"),
                           ("cublasLt", "cuBLASLt (libcublasLt) was not found")):
        library = SharedLibrary(name, {"cudnn": "cuDNN 9 (libcudnn)", "cublasLt": "cuBLASLt (libcublasLt)"}[name],
                                {}, "status")
        with pytest.raises(GpuUnavailableError) as info:
            library.load()
        assert str(info.value).startswith(expected), str(info.value)


def test_info_says_matplotlib_is_for_plots_only(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    result = invoke("info")
    assert result.exit_code == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if "matplotlib" in line)
    assert "absent" in row and "plots only" in row and "skips" not in row


def test_pyproject_does_not_claim_results_were_measured_with_the_pinned_release():
    """The CUDA 13 extra pins cuda-toolkit 13.0.*; results/ names the libraries it ran with
    (cuBLAS 13.1, runtime 13.3): the comment must not say results/ used 13.0."""
    import re

    text = (ROOT / "pyproject.toml").read_text()
    assert "13.0 is the release results/ was measured with" not in text
    measured = (ROOT / "results/ladder-jhu-softmax-h100.md").read_text()
    runtime = re.search(r"CUDA runtime (\d+\.\d+)", measured).group(1)
    assert runtime != "13.0"  # so the comment's "newer libraries" is what results/ says
    assert "results/ was measured with newer libraries" in " ".join(text.split())


def test_the_readme_sets_up_in_a_virtual_environment():
    """The quick start's two set-up commands make and activate a venv before pip installs."""
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert len(setup) == 2 and setup[0].startswith("git clone")
    assert setup[1] == "python3 -m venv .venv && . .venv/bin/activate && python3 -m pip install ."


# --------------------------------------------------------------------------------------------
# A CPU machine without the CUDA bindings; checks before work; outputs that never clobber
# --------------------------------------------------------------------------------------------

# The command as it runs where `cuda` (cuda-bindings, cuda-pathfinder) is not installed: every
# import of it fails as it would there.
WITHOUT_BINDINGS = """
import runpy, sys

class NoCuda:
    def find_spec(self, name, path=None, target=None):
        if name == "cuda" or name.startswith("cuda."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, NoCuda())
sys.argv = ["graphtrain", *sys.argv[1:]]
runpy.run_module("graphtrain", run_name="__main__", alter_sys=True)
"""


def without_bindings(*args, cwd=ROOT, env=None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-c", WITHOUT_BINDINGS, *map(str, args)], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=120)


def one_error_line(result: subprocess.CompletedProcess, code: int) -> str:
    assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_a_gpu_rung_without_the_bindings_is_one_line_and_exit_2(tmp_path):
    """The device opening started in the background keeps its error for the command's first use
    of the GPU: one line, exit 2, before any data is looked for."""
    line = one_error_line(without_bindings("run", "--stage", "graphs", "--data-dir", tmp_path / "nowhere"), 2)
    assert "cuda-bindings" in line and "--stage numpy" in line, line


def test_clicks_own_errors_are_one_line_and_exit_2(tmp_path):
    line = one_error_line(without_bindings("run", "--epochs", "x"), 2)
    assert line == "error: Invalid value for '--epochs': 'x' is not a valid integer. (see graphtrain run --help)"
    for args, words in ((("runn",), "No such command 'runn'"), (("predict", "--model", "m"), "Missing argument 'INPUT'"),
                        (("sweep", "--depth", "0"), "--depth"), (("eval",), "Missing option '--model'")):
        assert words in error_line(invoke(*args), 2), args
    version = without_bindings("--version")
    assert version.returncode == 0 and version.stdout.startswith("graphtrain, version "), version.stderr


def test_the_version_is_the_packages():
    import tomllib

    import graphtrain

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert graphtrain.__version__ == project["version"]


@pytest.fixture
def model_file(tmp_path):
    """A saved model (numpy, a few steps on a synthetic set) and a .npy of images for it."""
    import numpy as np

    from graphtrain import TrainConfig, save, train
    from graphtrain.data import Dataset

    data = Dataset.synthetic(300, 50, num_features=16, seed=0)
    record = train(TrainConfig(hidden=(), epochs=None, steps=3, batch=32), data=data, stage="numpy")
    path = tmp_path / "m.safetensors"
    save(path, record)
    images = tmp_path / "x.npy"
    np.save(images, data.test_images[:5])
    return path, images


def test_outputs_never_overwrite_inputs_or_each_other(model_file, tmp_path, monkeypatch):
    from graphtrain import evaluate

    monkeypatch.setattr(evaluate, "require_matplotlib", lambda: None)  # eval --plot's other check
    model, images = model_file
    before = model.read_bytes()
    line = error_line(invoke("predict", "--model", model, images, "--out", model), 2)
    assert "--out" in line and "--model" in line
    line = error_line(invoke("predict", "--model", model, images, "--out", images), 2)
    assert "INPUT" in line
    os.link(model, tmp_path / "hard-link.safetensors")  # one file by two names
    assert "--model" in error_line(invoke("predict", "--model", model, images, "--out",
                                          tmp_path / "hard-link.safetensors"), 2)
    assert "--model" in error_line(invoke("eval", "--model", model, "--plot", model), 2)
    assert model.read_bytes() == before

    nowhere = tmp_path / "nowhere"  # the checks come before the data is looked for
    same = tmp_path / "same"
    line = error_line(invoke("run", "--json", same, "--save", same, "--data-dir", nowhere), 2)
    assert "--save and --json name the same file" in line
    assert "--init" in error_line(invoke("run", "--init", model, "--save", model, "--data-dir", nowhere), 2)
    data = tmp_path / "d.npz"
    data.write_bytes(b"kept")
    for command in ("run", "sweep"):
        line = error_line(invoke(command, "--stages" if command == "sweep" else "--stage", "numpy", "--data", data,
                                 "--json", data), 2)
        assert "--json" in line and "--data" in line
    assert data.read_bytes() == b"kept" and not same.exists()
    assert "same file" in error_line(invoke("speedrun", "--json", same, "--markdown", same), 2)
    assert model.read_bytes() == before and not same.exists()


def test_files_check_outputs_lets_devices_be_shared_and_standard_output_be_anything(tmp_path):
    from graphtrain import files

    files.check_outputs({"--json": "-", "--out": "-"}, {"--data": "-"})
    files.check_outputs({"--json": os.devnull, "--save": os.devnull})
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "target")  # not there yet: the link names it all the same
    with pytest.raises(Exception, match="same file as --model"):
        files.check_outputs({"--out": link}, {"--model": tmp_path / "target"})


@pytest.fixture
def nothing_runs_here(no_gpu_synthetic, monkeypatch):
    """No GPU, no torch, no jax; loading the data fails the test (every check comes first)."""
    from graphtrain import cli
    from graphtrain.peers import PeerUnavailable, jax_scan, torch_common

    def missing(framework):
        def fail(*args, **kwargs):
            raise PeerUnavailable(f"{framework} is not installed (pip install {framework})")
        return fail

    monkeypatch.setattr(torch_common, "import_torch", missing("torch"))
    monkeypatch.setattr(jax_scan, "import_jax", missing("jax"))

    def no_data(*args, **kwargs):
        raise AssertionError("the data was loaded before every check was made")

    monkeypatch.setattr(cli.data_mod, "load", no_data)


def test_a_cpu_machine_gets_one_answer_from_every_command(nothing_runs_here, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for command in ("sweep", "ladder"):
        line = error_line(invoke(command, "--epochs", "1"), 2)
        assert "no NVIDIA driver found" in line and "--stages numpy" in line, line
    line = error_line(invoke("speedrun", "--peer", "none", "--seeds", "1", "--json", tmp_path / "s.json"), 2)
    assert "device-loop, graphs" in line and "--stages numpy" in line, line
    line = error_line(invoke("speedrun", "--stages", "numpy", "--seeds", "1"), 2)
    assert "torch-graph: torch is not installed" in line and "jax-scan: jax is not installed" in line
    assert "--peer none" in line
    line = error_line(invoke("ladder", "--stages", "numpy", "--peer", "torch-eager"), 2)
    assert "torch-eager" in line and "torch is not installed" in line
    assert list(tmp_path.iterdir()) == []  # no results/, no -partial files, no JSON


def test_a_sweep_says_missing_frameworks_once_under_the_table(nothing_runs_here, monkeypatch, tmp_path):
    from graphtrain import cli
    from graphtrain.data import Dataset

    monkeypatch.setattr(cli.data_mod, "load", lambda *a, **k: Dataset.synthetic(600, 100, seed=0))
    result = invoke("sweep", "--stages", "numpy", "--epochs", "1", "--lrs", "0.1,0.2", "--seeds", "0,1",
                    "--hidden-sizes", "8,16", "--depth", "2", "--out", tmp_path)
    assert result.exit_code == 0, result.stderr
    assert "skipped" not in result.stdout and result.stdout.count("numpy") == 8
    notes = [line for line in result.stdout.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "torch-eager" in notes[0] and "torch is not installed" in notes[0], result.stdout
    assert "jax is not installed" in " ".join(result.stdout.split())
    document = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert {tuple(r["config"]["hidden"]) for r in document["records"]} == {(8, 8), (16, 16)}
    markdown = next(tmp_path.glob("*.md")).read_text()
    assert "H 8, 16" in markdown and "lrs 0.1, 0.2" in markdown and "seeds 0, 1" in markdown, markdown
    assert "mlpHx2" in next(tmp_path.glob("*.md")).name


def test_the_sweeps_depth_is_an_option_with_its_default_stated():
    result = invoke("sweep", "--help")
    text = " ".join(result.output.split())
    assert "--depth N" in text and "or 3 where it has none" in text
    assert "give --hidden-sizes too" in error_line(invoke("sweep", "--depth", "2"), 2)


@pytest.mark.parametrize("labels, empty", [((0, 1, 2, 99), "classes 3 to 98 have no training sample"),
                                           (tuple(range(10)) + (12,), "classes 10, 11 have no training sample")])
def test_labels_that_leave_classes_empty_are_warned_about_by_name(labels, empty, tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    y_train = np.resize(np.array(labels), 200)
    arrays = dict(x_train=rng.random((200, 4, 4)), y_train=y_train, x_test=rng.random((20, 4, 4)),
                  y_test=np.zeros(20, np.int64))
    path = tmp_path / "stray.npz"
    np.savez(path, **arrays)
    result = invoke("run", "--data", path, "--epochs", "1")
    assert result.exit_code == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and empty in warnings[0], result.stderr
    assert f"model gets {max(labels) + 1} outputs" in warnings[0]

    from graphtrain.data import Dataset

    assert Dataset.from_arrays(**{**arrays, "y_train": np.resize(np.arange(3), 200)}).warnings == ()


def test_number_ranges():
    from graphtrain.data.images import number_ranges

    assert number_ranges([9, 3, 4, 5, 7, 8]) == "3 to 5, 7 to 9"
    assert number_ranges([10, 11]) == "10, 11" and number_ranges([2]) == "2"


def test_info_on_a_cpu_machine_opens_with_what_it_can_do(mnist_dir):
    result = without_bindings("info", env={"GRAPHTRAIN_DATA": str(mnist_dir), "COLUMNS": "160"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("CPU only: the numpy rung runs here; the GPU rungs need the CUDA bindings"), lines[0]
    assert lines[1] == f"MNIST: found in {mnist_dir} (GRAPHTRAIN_DATA)"
    assert "Error:" not in result.stdout and "GpuUnavailableError" not in result.stdout
    assert result.stdout.count("cuda-bindings) are not installed") == 1
    assert " ".join(result.stdout.split()).count("install: pip install 'graphtrain[cu12]'") == 1  # on its row
    assert result.stdout.count("needs the CUDA bindings") == 6  # driver, NVRTC, the libraries: no hint again
    assert len(lines) < 30, result.stdout


def test_the_verdict_names_what_the_gpu_rungs_lack():
    from graphtrain.environment import GPU_PIECES, verdict

    ready = {key: {"found": True} for key in GPU_PIECES}
    ready["driver"]["device"] = "NVIDIA H100"
    assert verdict(ready).startswith("GPU ready (NVIDIA H100)")
    assert "cudnn missing" in verdict({**ready, "cudnn": {"found": False}})
    no_driver = {**ready, "driver": {"found": False}}
    assert verdict(no_driver).startswith("CPU only: the numpy rung runs here; the GPU rungs need an NVIDIA GPU")
