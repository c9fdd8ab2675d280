"""The command line: exit codes, clear errors without tracebacks, the run record on disk."""

import json
import os
import stat
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

import graphtrain.data
from graphtrain.cli import main
from graphtrain.data import Dataset
from graphtrain.errors import GpuUnavailableError


def invoke(*args):
    try:  # click < 8.2 mixes stderr into stdout unless told not to
        runner = CliRunner(mix_stderr=False)
    except TypeError:
        runner = CliRunner()
    return runner.invoke(main, list(args))


def one_line_error(result, code: int) -> str:
    """The error line of a failed command, checked to be one line, without a traceback."""
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


@pytest.fixture
def synthetic(monkeypatch):
    """Commands train on a small synthetic set instead of MNIST (fast, no files); returns the
    list of datasets they asked for."""
    asked = []

    def load(dataset="mnist", data_dir=None, offline=False, log=None):
        asked.append(dataset)
        return Dataset.synthetic(600, 100, seed=0)

    monkeypatch.setattr(graphtrain.data, "load", load)
    return asked


def test_help_lists_the_commands():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("run", "ladder", "sweep", "info", "data"):
        assert command in result.output
    run_help = invoke("run", "--help").output
    assert "graphs" in run_help and "--preset" in run_help and "--json" in run_help


@pytest.mark.parametrize("args,needle", [
    (["--lr", "-1"], "lr must be a finite number > 0"),
    (["--lr", "inf"], "lr must be a finite number > 0, got inf"),
    (["--lr", "nan"], "lr must be a finite number > 0, got nan"),
    (["--hidden", "0"], "--hidden none"),
    (["--batch", "0"], "batch must be >= 1"),
    (["--hidden", "784,0"], "hidden sizes must be positive"),
    (["--epochs", "2", "--steps", "3"], "not both"),
])
def test_bad_options_exit_2_with_a_message(args, needle, tmp_path):
    result = invoke("run", "--offline", "--data-dir", str(tmp_path), *args)
    assert result.exit_code == 2
    assert needle in result.output
    assert "Traceback" not in result.output


def test_unknown_stage_and_preset_exit_2():
    assert invoke("run", "--stage", "warp").exit_code == 2
    assert invoke("run", "--preset", "imagenet").exit_code == 2


def test_missing_data_offline_names_files_and_folders(tmp_path):
    result = invoke("run", "--offline", "--data-dir", str(tmp_path))
    assert result.exit_code == 2
    assert "train-images-idx3-ubyte" in result.output and str(tmp_path) in result.output
    assert "Traceback" not in result.output


def test_batch_larger_than_dataset_exits_2(mnist_dir):
    result = invoke("run", "--data-dir", str(mnist_dir), "--batch", "70000")
    assert result.exit_code == 2 and "larger than the dataset" in result.output


def test_run_numpy_writes_the_record(mnist_dir, tmp_path):
    path = tmp_path / "deep" / "run.json"
    result = invoke("run", "--stage", "numpy", "--data-dir", str(mnist_dir), "--epochs", "1",
                    "--json", str(path))
    assert result.exit_code == 0, result.output
    record = json.loads(path.read_text())
    assert record["stage"] == "numpy" and record["config"]["epochs"] == 1
    assert record["test_accuracy"] > 0.85
    assert "median epoch" in result.output
    assert not [p for p in path.parent.iterdir() if p.name != "run.json"]  # no temp files left


def test_gpu_stage_without_gpu_is_a_clear_error(mnist_dir):
    from graphtrain.libs import cuda

    try:
        cuda.open_device()
        pytest.skip("this machine has a GPU")
    except GpuUnavailableError:
        pass
    result = invoke("run", "--stage", "graphs", "--data-dir", str(mnist_dir), "--epochs", "1")
    line = one_line_error(result, 2)  # a missing GPU is the user's to fix: exit 2
    assert "GPU" in line or "driver" in line or "cuda" in line.lower()
    assert "--stage numpy" in line


def test_gpu_stage_without_a_driver_says_so_before_looking_for_data(monkeypatch, tmp_path):
    """The quick start on a machine without a GPU (and without network): the first and only
    error is the missing driver, with the way to train on the CPU; no dataset is looked for."""
    from graphtrain.libs import cuda

    def no_driver(ordinal=0):
        raise GpuUnavailableError("no NVIDIA driver found: libcuda could not be loaded")

    def no_data(*args, **kwargs):
        raise AssertionError("the dataset was looked for before the GPU was checked")

    monkeypatch.setattr(cuda, "open_device", no_driver)
    monkeypatch.setattr(graphtrain.data, "load", no_data)
    line = one_line_error(invoke("run", "--stage", "graphs"), 2)
    assert "no NVIDIA driver found" in line and "to train on the CPU instead, use --stage numpy" in line


# ---- outputs: checked before the work, never replacing what is not a regular file ---------------


@pytest.mark.parametrize("where", ["parent-is-a-file", "proc", "read-only"])
def test_an_unwritable_json_path_is_refused_before_training(where, tmp_path, synthetic):
    if where == "parent-is-a-file":
        (tmp_path / "notes.txt").write_text("x")
        path, reason = tmp_path / "notes.txt" / "run.json", "is not a folder"
    elif where == "proc":
        if not Path("/proc/self").is_dir():
            pytest.skip("no /proc here")
        path, reason = Path("/proc/graphtrain/run.json"), "cannot create a file in /proc"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        folder = tmp_path / "locked"
        folder.mkdir(mode=0o500)
        path, reason = folder / "run.json", "Permission denied"
    line = one_line_error(invoke("run", "--epochs", "1", "--json", str(path)), 2)
    assert f"cannot write {path}: " in line and reason in line
    assert synthetic == []  # refused before the data was even loaded


def test_an_unwritable_out_folder_is_refused_before_the_ladder(tmp_path, synthetic):
    (tmp_path / "notes.txt").write_text("x")
    out = tmp_path / "notes.txt" / "results"
    line = one_line_error(invoke("ladder", "--epochs", "1", "--no-peers", "--stages", "numpy",
                                 "--out", str(out)), 2)
    assert f"cannot write {out}: {tmp_path / 'notes.txt'} is not a folder" in line and synthetic == []


def test_a_failed_write_after_training_is_one_line(tmp_path, synthetic, monkeypatch):
    import errno

    def disk_full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", disk_full)
    line = one_line_error(invoke("run", "--epochs", "1", "--json", str(tmp_path / "run.json")), 1)
    assert f"cannot write {tmp_path / 'run.json'}: No space left on device" in line
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


def device_node(folder: Path, name: str, minor: int) -> Path:
    """A private copy of a memory device (1, minor): 3 is null, 7 is full. A private node, so a
    regression that replaces the target replaces this one, never the machine's /dev."""
    path = folder / name
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, minor))
    except (PermissionError, AttributeError, OSError) as exc:
        pytest.skip(f"cannot make a device node here: {exc}")
    return path


def test_json_to_a_device_writes_through_it(tmp_path, synthetic):
    null = device_node(tmp_path, "null", 3)
    result = invoke("run", "--epochs", "1", "--json", str(null))
    assert result.exit_code == 0, result.output
    assert stat.S_ISCHR(os.stat(null).st_mode)  # still the device, not a JSON file in its place


def test_json_to_a_full_device_is_one_line(tmp_path, synthetic):
    full = device_node(tmp_path, "full", 7)
    line = one_line_error(invoke("run", "--epochs", "1", "--json", str(full)), 1)
    assert f"cannot write {full}: No space left on device" in line
    assert stat.S_ISCHR(os.stat(full).st_mode)


def test_json_through_a_symlink_writes_its_target(tmp_path, synthetic):
    target = tmp_path / "records" / "run.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    result = invoke("run", "--epochs", "1", "--json", str(link))
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and json.loads(target.read_text())["stage"] == "numpy"


def test_json_into_a_fifo_writes_through_it(tmp_path, synthetic):
    fifo = tmp_path / "records.fifo"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()), daemon=True)
    reader.start()
    result = invoke("run", "--epochs", "1", "--json", str(fifo))
    reader.join(timeout=30)
    assert result.exit_code == 0, result.output
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and json.loads(received[0])["stage"] == "numpy"


def test_json_dash_is_stdout(tmp_path, synthetic, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("run", "--epochs", "1", "--json", "-")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)  # stdout is the record alone; the table went to stderr
    assert record["stage"] == "numpy" and "median epoch" in result.stderr
    assert list(tmp_path.iterdir()) == []  # no file named "-"


# ---- sizes and values that cannot work -------------------------------------------------------


def test_a_model_larger_than_memory_is_one_line_before_work(synthetic):
    line = one_line_error(invoke("run", "--hidden", "1000000000", "--epochs", "1"), 2)
    assert "needs at least" in line and "TB of memory" in line and "--hidden" in line


def test_a_memory_error_anywhere_is_one_line(synthetic, monkeypatch):
    from graphtrain.stages.numpy_cpu import NumpyStage

    def setup(self):
        raise MemoryError("Unable to allocate 2.9 TiB for an array with shape (1000000000, 784)")

    monkeypatch.setattr(NumpyStage, "setup", setup)
    line = one_line_error(invoke("run", "--epochs", "1"), 1)
    assert line.startswith("error: out of memory: Unable to allocate 2.9 TiB")


def test_a_data_dir_that_is_a_file_is_not_a_folder(tmp_path):
    archive = tmp_path / "mnist.zip"
    archive.write_bytes(b"PK")
    line = one_line_error(invoke("run", "--data-dir", str(archive)), 2)
    assert "is not a folder" in line and "does not exist" not in line


def test_a_diverging_run_warns_naming_the_epoch(synthetic):
    result = invoke("run", "--hidden", "32", "--lr", "1e4", "--epochs", "2")
    assert result.exit_code == 0, result.output
    warning = next(line for line in result.stderr.splitlines() if line.startswith("warning:"))
    assert "epoch 1" in warning and "diverging" in warning and "--lr" in warning


def test_download_without_a_network_exits_1_and_leaves_nothing(tmp_path, monkeypatch):
    import dataclasses

    from graphtrain.data.registry import DATASETS

    unreachable = ("http://127.0.0.1:1/", "http://127.0.0.1:2/")
    monkeypatch.setitem(DATASETS, "mnist", dataclasses.replace(DATASETS["mnist"], mirrors=unreachable))
    monkeypatch.delenv("GRAPHTRAIN_MIRROR", raising=False)
    dest = tmp_path / "new" / "mnist"
    result = invoke("data", "download", "--dest", str(dest))
    assert result.exit_code == 1 and "Traceback" not in result.output
    for mirror in unreachable:
        assert result.output.count(mirror) == 1  # each failure said once
    assert not (tmp_path / "new").exists()


def test_info_runs_anywhere():
    result = invoke("info")
    assert result.exit_code == 0, result.output
    assert "numpy" in result.output


def test_recorded_command_names_settings_that_change_the_run(monkeypatch):
    from graphtrain import cli

    monkeypatch.setattr("sys.argv", ["graphtrain", "sweep", "--hidden-sizes", "128,256"])
    monkeypatch.delenv("GRAPHTRAIN_TORCH_COMPILE_MODE", raising=False)
    assert cli.command_line() == "graphtrain sweep --hidden-sizes 128,256"
    monkeypatch.setenv("GRAPHTRAIN_TORCH_COMPILE_MODE", "reduce-overhead")
    assert cli.command_line() == "GRAPHTRAIN_TORCH_COMPILE_MODE=reduce-overhead graphtrain sweep --hidden-sizes 128,256"


def test_error_messages_keep_square_brackets(monkeypatch, tmp_path):
    """Install hints name extras like graphtrain[cu13]; the terminal must show them as written."""
    from graphtrain import cli
    from graphtrain.errors import GpuUnavailableError

    def no_gpu(*args, **kwargs):
        raise GpuUnavailableError("cuBLAS was not found: pip install 'graphtrain[cu13]'")

    monkeypatch.setattr(cli.data_mod, "download", no_gpu)
    result = invoke("data", "download", "--dest", str(tmp_path))
    assert result.exit_code == 2  # a missing piece is the user's to install: exit 2
    assert "graphtrain[cu13]" in result.output


def test_sweep_where_no_row_can_run_exits_1(mnist_dir, monkeypatch, tmp_path):
    from graphtrain import sweep

    def every_row_skipped(task, data, device):
        return [sweep._failed(point, "no GPU", skipped=True) for point in task.points]

    monkeypatch.setattr(sweep, "run_task", every_row_skipped)
    result = invoke("sweep", "--data-dir", str(mnist_dir), "--hidden-sizes", "8", "--no-peers", "--stages", "numpy",
                    "--out", str(tmp_path))
    assert result.exit_code == 1 and "no row" in result.output


def test_a_precision_the_stage_does_not_train_in_is_one_line(synthetic):
    line = one_line_error(invoke("run", "--stage", "numpy", "--precision", "bf16", "--epochs", "1"), 2)
    assert "numpy trains in fp32" in line and "--precision bf16" in line


def test_precision_defaults_to_the_stage_own_and_is_recorded(synthetic, tmp_path):
    out = tmp_path / "run.json"
    result = invoke("run", "--stage", "numpy", "--epochs", "1", "--json", str(out))
    assert result.exit_code == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["precision"] == "fp32" and record["config"]["precision"] is None
