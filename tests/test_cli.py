"""The command line: exit codes, clear errors without tracebacks, the run record on disk."""

import json

import pytest
from click.testing import CliRunner

from graphtrain.cli import main


def invoke(*args):
    return CliRunner().invoke(main, list(args))


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
    from graphtrain.errors import GpuUnavailableError
    from graphtrain.libs import cuda

    try:
        cuda.open_device()
        pytest.skip("this machine has a GPU")
    except GpuUnavailableError:
        pass
    result = invoke("run", "--stage", "graphs", "--data-dir", str(mnist_dir), "--epochs", "1")
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert "GPU" in result.output or "driver" in result.output or "cuda" in result.output.lower()


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
    assert result.exit_code == 1
    assert "graphtrain[cu13]" in result.output


def test_sweep_where_no_row_can_run_exits_1(mnist_dir, monkeypatch):
    from graphtrain import ladder
    from graphtrain.record import FailedRun

    def every_row_skipped(config, **kwargs):
        return [FailedRun("graphs", "stage", config, "no GPU", skipped=True, hidden_size=8)]

    monkeypatch.setattr(ladder, "run_sweep", every_row_skipped)
    result = invoke("sweep", "--data-dir", str(mnist_dir), "--hidden-sizes", "8", "--no-peers")
    assert result.exit_code == 1 and "no row" in result.output
