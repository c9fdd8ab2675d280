"""The ladder, the sweep and their reports, on the CPU: synthetic run records for the report
code, and real runs of the numpy stage for the drivers. No GPU, torch or jax needed: peers are
made absent on purpose, so the tests behave the same on a machine that has them."""

from __future__ import annotations

import io
import json
import os
import stat
import sys

import pytest
from rich.console import Console

from graphtrain import ladder, report, sweep
from graphtrain.config import PRESETS, TrainConfig
from graphtrain.data import Dataset
from graphtrain.errors import (
    GpuUnavailableError,
    GraphtrainError,
    TrainingError,
    UsageError,
)
from graphtrain.peers import PeerUnavailable
from graphtrain.record import FailedRun, RunRecord
from graphtrain.stages import PEERS, peer_names, stage_names
from graphtrain.stages.numpy_cpu import NumpyStage

COMMAND = "graphtrain ladder --preset jhu --out results"

GPU_ENV = {"python": "3.12.3", "numpy": "2.1.0", "cpu": "Test CPU", "cpu_count": 16,
           "gpu": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "driver": "580.95.05",
           "cuda_driver": "13.0", "driver_cuda": "13.0", "runtime": "13.0", "nvrtc": "13.0",
           "cublas": "13.1.0", "cudnn": "9.13.0", "cuda_bindings": "13.0.1"}
TORCH_ENV = {"gpu": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "driver": "580.95.05",
             "torch": "2.9.0+cu130", "torch_cuda": "13.0", "torch_cudnn": "9.13.0"}


def fake_record(stage, epoch_ms, kind="stage", env=None, epochs=4, note=""):
    """A run record shaped like training.train's, with round numbers."""
    config = PRESETS["jhu"].replace(epochs=epochs).to_dict()
    entries = [{"epoch": e + 1, "ms": epoch_ms, "batches": 469, "full": True,
                "train_loss": 0.5 / (e + 1), "train_accuracy": 0.9, "test_accuracy": 0.92}
               for e in range(epochs)]
    record = {"stage": stage, "kind": kind, "config": config,
              "environment": dict(env if env is not None else GPU_ENV),
              "epochs": entries, "epoch_ms": epoch_ms, "setup_ms": 100.0,
              "total_ms": 100.0 + epochs * epoch_ms, "test_accuracy": 0.92,
              "train_loss": entries[-1]["train_loss"], "command": "graphtrain ladder"}
    if note:
        record["note"] = note
    return record


def failed(stage, message, kind="stage", skipped=False):
    return {"stage": stage, "kind": kind, "error": message, "skipped": skipped}


@pytest.fixture
def records():
    return [
        fake_record("numpy", 200.0, env={"python": "3.12.3", "numpy": "2.1.0", "cpu": "Test CPU"}),
        fake_record("baseline", 40.0),
        fake_record("fewer-syncs", 20.0),
        failed("cublas", "CudaError: cublasGemmEx failed: CUBLAS_STATUS_NOT_SUPPORTED"),
        fake_record("sparse-metrics", 10.0),
        fake_record("graphs", 2.5),
        fake_record("torch-eager", 100.0, kind="peer", env=TORCH_ENV, note="fp32, TF32 off"),
        failed("jax-scan", "jax is not installed", kind="peer", skipped=True),
    ]


@pytest.fixture
def quiet_console():
    return Console(file=io.StringIO(), width=200, stderr=True)


@pytest.fixture
def no_frameworks(monkeypatch):
    """`import torch` and `import jax` raise ImportError, as on a machine without them."""
    for name in ("torch", "jax"):
        monkeypatch.setitem(sys.modules, name, None)


def small_data():
    return Dataset.synthetic(2000, 500, seed=0)


# ---- speed-ups and rows --------------------------------------------------------------------


def test_speedups_over_the_rung_before_and_over_baseline(records):
    rows = {row.name: row for row in report.ladder_rows(records)}
    assert rows["numpy"].vs_prev is None  # the first rung has none before it
    assert rows["numpy"].vs_baseline == pytest.approx(0.2)
    assert rows["baseline"].vs_prev == pytest.approx(5.0)
    assert rows["baseline"].vs_baseline == pytest.approx(1.0)
    assert rows["fewer-syncs"].vs_prev == pytest.approx(2.0)
    assert rows["cublas"].status == "failed"
    # The rung before sparse-metrics failed: no ratio over a rung that has no time.
    assert rows["sparse-metrics"].vs_prev is None
    assert rows["sparse-metrics"].vs_baseline == pytest.approx(4.0)
    assert rows["graphs"].vs_prev == pytest.approx(4.0)
    # Peers are not rungs: only the baseline ratio.
    assert rows["torch-eager"].vs_prev is None
    assert rows["torch-eager"].vs_baseline == pytest.approx(0.4)
    assert rows["jax-scan"].status == "skipped" and rows["jax-scan"].note == "jax is not installed"


def test_no_baseline_means_no_baseline_ratio(records):
    rows = report.ladder_rows([r for r in records if r["stage"] != "baseline"])
    assert all(row.vs_baseline is None for row in rows)


def test_formatting():
    assert report.fmt_speedup(4.0) == "4.00×"
    assert report.fmt_speedup(1234.0) == "1,234×"
    assert report.fmt_speedup(None) == report.DASH
    assert report.fmt_ms(1.23456) == "1.235"
    assert report.fmt_ms(12345.6) == "12,346"
    assert report.fmt_accuracy(0.9229) == "92.29%"
    assert report.fmt_loss(None) == report.DASH


# ---- Markdown, JSON, plots -----------------------------------------------------------------


def test_ladder_markdown_has_rows_device_versions_and_command(records):
    md = report.ladder_markdown(records, "jhu", COMMAND, date="2026-01-02 03:04:05 UTC")
    assert md.startswith("# graphtrain ladder: jhu")
    assert "Date: 2026-01-02 03:04:05 UTC" in md
    assert "Device: NVIDIA H100 80GB HBM3 (compute capability 9.0)" in md
    assert "Driver: 580.95.05 (CUDA 13.0)" in md
    assert "cuBLAS 13.1.0" in md and "cuDNN 9.13.0" in md and "NVRTC 13.0" in md
    assert "PyTorch: 2.9.0+cu130 (CUDA 13.0, cuDNN 9.13.0)" in md
    assert f"- Command: `{COMMAND}`" in md.split("|")[0]  # in the header, above the table
    assert "| baseline | 40.00 | 260.00 | 100.00 | 5.00× | 1.00× | 92.00% | 0.1250 |  |" in md
    assert "| graphs | 2.500 |" in md and "| 4.00× | 16.00× |" in md
    assert "| torch-eager (peer) | 100.00 |" in md and "fp32, TF32 off" in md
    assert "failed: CudaError: cublasGemmEx failed: CUBLAS_STATUS_NOT_SUPPORTED" in md
    assert "| jax-scan (peer) |" in md and "skipped: jax is not installed" in md


def test_markdown_cells_escape_pipes():
    records = [failed("baseline", "weird | message\nsecond line")]
    md = report.ladder_markdown(records, "jhu", COMMAND)
    assert "weird \\| message second line" in md


def test_device_line_without_any_gpu_record():
    records = [fake_record("numpy", 100.0, env={"python": "3.12", "numpy": "2.1", "cpu": "Test CPU"})]
    lines = report.environment_lines(records)
    assert "Device: no GPU (CPU only)" in lines
    assert not any(line.startswith("Driver") for line in lines)


def test_write_ladder_files_and_json_round_trip(records, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: no plots to check")
    paths = report.write_ladder(records, "jhu", tmp_path, COMMAND, log=lambda m: None, partial=False)
    names = sorted(p.name for p in paths)
    assert names == ["ladder-jhu-h100-loss.png", "ladder-jhu-h100-time.png", "ladder-jhu-h100.json",
                     "ladder-jhu-h100.md"]
    for path in paths:
        assert path.stat().st_size > 0
    assert (tmp_path / "ladder-jhu-h100-time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = report.read_json(tmp_path / "ladder-jhu-h100.json")
    assert saved["records"] == records
    assert saved["command"] == COMMAND and saved["label"] == "jhu"
    md = (tmp_path / "ladder-jhu-h100.md").read_text()
    assert "![ladder-jhu-h100-time](ladder-jhu-h100-time.png)" in md
    # Written through temporary files: none left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == names


def test_write_ladder_without_matplotlib_notes_it(records, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    logged = []
    paths = report.write_ladder(records, "jhu", tmp_path, COMMAND, log=logged.append)
    assert sorted(p.name for p in paths) == ["ladder-jhu-h100-partial.json", "ladder-jhu-h100-partial.md"]
    md = (tmp_path / "ladder-jhu-h100-partial.md").read_text()
    assert "matplotlib is not installed" in md
    assert any("matplotlib is not installed" in message for message in logged)
    assert not list(tmp_path.glob("*.png"))


def test_rewriting_replaces_the_files(records, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    report.write_ladder(records, "jhu", tmp_path, COMMAND, log=lambda m: None, partial=False)
    report.write_ladder(records[:2], "jhu", tmp_path, "second", log=lambda m: None, partial=False)
    assert report.read_json(tmp_path / "ladder-jhu-h100.json")["command"] == "second"
    assert len(list(tmp_path.iterdir())) == 2


def test_ladder_table_renders_every_row_and_note(records):
    console = Console(file=io.StringIO(), width=160)
    console.print(ladder.ladder_table(records))
    text = console.file.getvalue()
    for name in ("numpy", "baseline", "fewer-syncs", "cublas", "graphs", "torch-eager", "jax-scan"):
        assert name in text
    assert "16.00×" in text and "failed [1]" in text and "skipped [3]" in text
    assert "CUBLAS_STATUS_NOT_SUPPORTED" in text and "jax is not installed" in text


def sweep_records():
    out = []
    for size, factor in ((128, 1.0), (256, 2.0)):
        for name, ms, kind in (("graphs", 5.0, "stage"), ("torch-eager", 50.0, "peer")):
            record = fake_record(name, ms * factor, kind=kind)
            out.append({"stage": name, "kind": kind, "hidden_size": size, **record})
        out.append({"stage": "jax-scan", "kind": "peer", "hidden_size": size,
                    **failed("jax-scan", "jax is not installed", kind="peer", skipped=True)})
    return out


def test_sweep_markdown_and_table():
    records = sweep_records()
    md = report.sweep_markdown(records, "cuda-mnist", "graphtrain sweep --hidden-sizes 128,256")
    assert "| hidden size H | graphs | torch-eager (peer) | jax-scan (peer) |" in md
    # Training time is the sum of the timed epochs: 4 epochs of 5 ms at H=128.
    assert "| 128 | 20.00 | 200.00 | skipped |" in md
    assert "| 256 | 40.00 | 400.00 | skipped |" in md
    assert "H=128 jax-scan: skipped: jax is not installed" in md
    assert "- Command: `graphtrain sweep --hidden-sizes 128,256`" in md.split("|")[0]
    console = Console(file=io.StringIO(), width=160)
    console.print(sweep.grid_table([{**r, "train_ms": report.train_ms(r)} for r in records]))  # as sweep._row makes them
    text = console.file.getvalue()
    assert "128" in text and "256" in text and "400.00" in text and "skipped" in text


def test_write_sweep(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: no plot to check")
    records = sweep_records()
    paths = report.write_sweep(records, "cuda-mnist", tmp_path, "graphtrain sweep", log=lambda m: None)
    assert sorted(p.name for p in paths) == ["sweep-cuda-mnist-h100-partial.json",
                                             "sweep-cuda-mnist-h100-partial.md",
                                             "sweep-cuda-mnist-h100-partial.png"]
    assert report.read_json(tmp_path / "sweep-cuda-mnist-h100-partial.json")["records"] == records


# ---- labels and names ----------------------------------------------------------------------


def test_run_label():
    assert ladder.run_label(PRESETS["jhu"]) == "jhu-softmax"
    assert ladder.run_label(PRESETS["jhu"].replace(hidden=(784, 784, 784))) == "jhu-mlp784x3"
    assert ladder.run_label(PRESETS["cuda-mlp"]) == "cuda-mlp-mlp784x4"
    assert ladder.run_label(PRESETS["cuda-mlp"].replace(hidden=())) == "cuda-mlp-softmax"
    assert ladder.run_label(PRESETS["jhu"].replace(epochs=5)) == "jhu-softmax-e5"
    assert ladder.run_label(TrainConfig(hidden=(32,))) == "custom-mlp32"
    assert ladder.run_label(TrainConfig(hidden=(96, 40, 40))) == "custom-mlp96-40x2"
    assert sweep.sweep_label(PRESETS["cuda-mnist"].replace(hidden=(128,) * 3)) == "cuda-mnist-mlpHx3"


def test_defaults_and_registry():
    assert ladder.default_stages() == stage_names()
    assert ladder.default_stages()[:2] == ["numpy", "baseline"]
    assert ladder.default_peers() == peer_names() == list(PEERS)
    assert peer_names() == ["torch-eager", "torch-compile", "torch-graph", "jax-scan", "torch-graph-bf16", "jax-scan-bf16"]
    assert issubclass(PeerUnavailable, GraphtrainError)


def test_unknown_names_are_rejected_before_anything_runs(quiet_console):
    data = small_data()
    with pytest.raises(UsageError, match="unknown stage"):
        ladder.run_ladder(PRESETS["jhu"], stages=["numpy", "warp-drive"], peers=[], data=data,
                          out_dir=None, command=COMMAND, console=quiet_console)
    with pytest.raises(UsageError, match="unknown peer"):
        ladder.run_ladder(PRESETS["jhu"], stages=[], peers=["tensorflow"], data=data,
                          out_dir=None, command=COMMAND, console=quiet_console)
    with pytest.raises(UsageError, match="unknown peer"):  # a rung is not a peer
        ladder.run_ladder(PRESETS["jhu"], stages=[], peers=["numpy"], data=data,
                          out_dir=None, command=COMMAND, console=quiet_console)


def test_compile_mode_comes_from_the_environment(monkeypatch):
    from graphtrain.peers import torch_compile

    monkeypatch.delenv(torch_compile.MODE_VARIABLE, raising=False)
    assert torch_compile.compile_mode() == "max-autotune"
    monkeypatch.setenv(torch_compile.MODE_VARIABLE, "reduce-overhead")
    assert torch_compile.compile_mode() == "reduce-overhead"


# ---- real runs of the numpy stage ----------------------------------------------------------


def test_run_ladder_numpy_then_absent_peers(tmp_path, quiet_console, no_frameworks):
    data = small_data()
    config = PRESETS["jhu"].replace(epochs=2)
    records = ladder.run_ladder(config, stages=["numpy"], peers=peer_names(), data=data,
                                out_dir=tmp_path, command=COMMAND, console=quiet_console)
    assert [r.stage for r in records] == ["numpy", *peer_names()]
    numpy_record = records[0]
    assert isinstance(numpy_record, RunRecord) and numpy_record.kind == "stage"
    assert numpy_record.test_accuracy > 0.8
    assert len(numpy_record.epochs) == 2
    assert numpy_record.data == {"name": "synthetic", "train": 2000, "test": 500, "image_shape": None}
    for record in records[1:]:
        assert isinstance(record, FailedRun) and record.kind == "peer" and record.skipped is True
        assert "is not installed" in record.error
        assert record.data == numpy_record.data
    assert "torch is not installed" in records[1].error
    assert "jax is not installed" in records[-1].error

    # numpy ran on the CPU and every peer was skipped: a partial table, tagged so
    stem = tmp_path / "ladder-jhu-softmax-e2-cpu-partial"
    assert stem.with_suffix(".md").exists() and stem.with_suffix(".json").exists()
    md = stem.with_suffix(".md").read_text()
    assert "| numpy |" in md and "skipped: torch is not installed" in md and COMMAND in md
    assert "data synthetic (2000 train / 500 test)" in md
    saved = report.read_json(stem.with_suffix(".json"))["records"]
    assert saved == json.loads(json.dumps([r.to_json() for r in records]))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in md
    else:
        assert (tmp_path / "ladder-jhu-softmax-e2-cpu-partial-time.png").exists()
        assert (tmp_path / "ladder-jhu-softmax-e2-cpu-partial-loss.png").exists()
    printed = quiet_console.file.getvalue()
    # Each reason once, naming the rows it skipped.
    assert printed.count("torch is not installed") == 1
    assert "skipped torch-eager, torch-compile, torch-graph, torch-graph-bf16: torch is not installed" in printed


class BrokenStage(NumpyStage):
    """The numpy stage, failing in its second epoch."""

    error: Exception = RuntimeError("boom in epoch 2")

    def train_epoch(self, epoch, num_batches, measure):
        if epoch == 1:
            raise self.error
        return super().train_epoch(epoch, num_batches, measure)


def with_broken(monkeypatch, name: str, error: Exception):
    """Make row `name` the BrokenStage raising `error`."""
    broken = type("Broken", (BrokenStage,), {"error": error})
    real_get_stage = ladder.get_stage
    monkeypatch.setattr(ladder, "get_stage", lambda stage: broken if stage == name else real_get_stage(stage))


def test_failing_stage_is_an_error_row_and_the_rest_still_runs(monkeypatch, quiet_console, no_frameworks):
    with_broken(monkeypatch, "baseline", RuntimeError("boom in epoch 2"))
    records = ladder.run_ladder(PRESETS["jhu"].replace(epochs=2), stages=["baseline", "numpy"],
                                peers=["torch-eager"], data=small_data(), out_dir=None,
                                command=COMMAND, console=quiet_console)
    broken, numpy_record, peer = records
    assert isinstance(broken, FailedRun)
    assert (broken.stage, broken.kind, broken.skipped) == ("baseline", "stage", False)
    assert broken.error == "RuntimeError: boom in epoch 2"
    assert "boom in epoch 2" in broken.traceback  # an unexpected error keeps its trace
    assert isinstance(numpy_record, RunRecord) and numpy_record.test_accuracy > 0.8
    assert peer.skipped is True and peer.kind == "peer"
    printed = quiet_console.file.getvalue()
    assert "baseline: failed: RuntimeError: boom in epoch 2" in printed


@pytest.mark.parametrize("error, skipped", [
    (GpuUnavailableError("no NVIDIA driver found"), True),
    (TrainingError("the training loss became nan in epoch 2"), False),
])
def test_graphtrain_errors_become_rows(monkeypatch, quiet_console, error, skipped):
    with_broken(monkeypatch, "baseline", error)
    records = ladder.run_ladder(PRESETS["jhu"].replace(epochs=2), stages=["baseline", "numpy"], peers=[],
                                data=small_data(), out_dir=None, command=COMMAND, console=quiet_console)
    row = records[0]
    assert row.skipped is skipped
    assert str(error) in row.error
    assert row.traceback is None and "traceback" not in row.to_json()  # explained errors
    assert records[1].stage == "numpy" and not records[1].failed


def test_peer_failing_mid_run_is_an_error_row(monkeypatch, quiet_console):
    from graphtrain.peers.torch_eager import TorchEagerPeer

    def explode(cls):
        raise ValueError("peer exploded")

    monkeypatch.setattr(TorchEagerPeer, "check_available", classmethod(explode))
    records = ladder.run_ladder(PRESETS["jhu"].replace(epochs=1), stages=[], peers=["torch-eager"],
                                data=small_data(), out_dir=None, command=COMMAND, console=quiet_console)
    assert records[0].error == "ValueError: peer exploded" and records[0].skipped is False
    assert records[0].kind == "peer"


# ---- one plan for every row ----------------------------------------------------------------


def recording_rows(monkeypatch):
    """Make every row the numpy stage under its own name, recording the plan it is given."""
    plans = {}

    def get_stage(name):
        class Recording(NumpyStage):
            kind = "peer" if name in PEERS else "stage"

            def setup(self):
                plans[name] = self.plan
                super().setup()

        Recording.name = name
        return Recording

    monkeypatch.setattr(ladder, "get_stage", get_stage)
    return plans


def test_every_row_of_a_ladder_trains_from_the_same_plan(monkeypatch, quiet_console):
    plans = recording_rows(monkeypatch)
    records = ladder.run_ladder(PRESETS["jhu"].replace(epochs=2, hidden=(16,)),
                                stages=["numpy", "baseline", "graphs"], peers=["torch-eager", "jax-scan"],
                                data=small_data(), out_dir=None, command=COMMAND, console=quiet_console)
    assert list(plans) == ["numpy", "baseline", "graphs", "torch-eager", "jax-scan"]
    first = plans["numpy"]
    assert all(plan is first for plan in plans.values())
    # The same plan, so the same training: every row's loss curve is the numpy stage's.
    curves = {r.stage: [e.train_loss for e in r.epochs] for r in records}
    assert all(curve == curves["numpy"] for curve in curves.values())


# ---- file names: the GPU, -partial, --force ------------------------------------------------


@pytest.mark.parametrize("name, tag", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("Tesla V100-SXM2-16GB", "v100"), ("NVIDIA RTX A6000", "rtxa6000"),
    ("NVIDIA L4", "l4"), ("NVIDIA GH200 480GB", "gh200"),
])
def test_gpu_tag(name, tag):
    assert report.gpu_tag(name) == tag


def test_file_names_carry_the_gpu_and_partial_runs_never_replace_complete_ones(records, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    complete = [r for r in records if "error" not in r]
    report.write_ladder(complete, "jhu", tmp_path, "complete", log=lambda m: None)
    report.write_ladder(records, "jhu", tmp_path, "with a failed row", log=lambda m: None)
    on_a_4090 = [{**r, "environment": {**r["environment"], "gpu": "NVIDIA GeForce RTX 4090"}} for r in complete]
    report.write_ladder(on_a_4090, "jhu", tmp_path, "another GPU", log=lambda m: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ladder-jhu-h100-partial.json", "ladder-jhu-h100-partial.md", "ladder-jhu-h100.json", "ladder-jhu-h100.md",
        "ladder-jhu-rtx4090.json", "ladder-jhu-rtx4090.md"]
    assert report.read_json(tmp_path / "ladder-jhu-h100.json")["command"] == "complete"
    cpu_only = [fake_record("numpy", 100.0, env={"cpu": "Test CPU"})]
    assert report.report_stem("ladder", "jhu", cpu_only, partial=False) == "ladder-jhu-cpu"


def test_a_subset_of_rows_is_partial_unless_forced(tmp_path, quiet_console, no_frameworks, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    config = PRESETS["jhu"].replace(epochs=1)
    data = small_data()
    ladder.run_ladder(config, stages=["numpy"], peers=[], data=data, out_dir=tmp_path, command="subset",
                      console=quiet_console)
    assert (tmp_path / "ladder-jhu-softmax-e1-cpu-partial.md").exists()
    ladder.run_ladder(config, stages=["numpy"], peers=["jax-scan"], data=data, out_dir=tmp_path,
                      command="forced", console=quiet_console, force=True)
    assert report.read_json(tmp_path / "ladder-jhu-softmax-e1-cpu.json")["command"] == "forced"


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_files_get_the_users_umask(records, tmp_path, umask, mode):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: no plots to check")
    previous = os.umask(umask)
    try:
        paths = report.write_ladder(records, "jhu", tmp_path, COMMAND, log=lambda m: None)
    finally:
        os.umask(previous)
    assert len(paths) == 4
    for path in paths:
        assert stat.S_IMODE(path.stat().st_mode) == mode, path.name


def test_nothing_to_plot_writes_the_tables_and_says_why(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: no plots to check")
    all_skipped = [failed("baseline", "no NVIDIA driver found", skipped=True),
                   failed("jax-scan", "jax is not installed", kind="peer", skipped=True)]
    logged = []
    paths = report.write_ladder(all_skipped, "jhu", tmp_path, COMMAND, log=logged.append)
    assert sorted(p.name for p in paths) == ["ladder-jhu-cpu-partial.json", "ladder-jhu-cpu-partial.md"]
    md = (tmp_path / "ladder-jhu-cpu-partial.md").read_text()
    assert "The time plot is not drawn: no row has an epoch time." in md
    assert "The loss plot is not drawn: no row measured a training loss." in md
    assert any("time plot is not drawn" in message for message in logged)
    assert not list(tmp_path.glob("*.png"))
    sweep = report.write_sweep([{**r, "hidden_size": 128} for r in all_skipped], "cuda-mnist", tmp_path, "x",
                               log=lambda m: None)
    assert sorted(p.name for p in sweep) == ["sweep-cuda-mnist-cpu-partial.json", "sweep-cuda-mnist-cpu-partial.md"]


# ---- the headline, repeats and profile columns, notes ------------------------------------


def test_headline_compares_the_fastest_rung_with_the_fastest_peer_of_its_precision():
    records = [fake_record("baseline", 80.0), fake_record("graphs", 14.0), fake_record("fused", 7.0),
               fake_record("jax-scan", 10.0, kind="peer"), fake_record("torch-compile", 5.0, kind="peer"),
               fake_record("jax-scan-bf16", 4.0, kind="peer")]
    for record in records:
        record["precision"] = "bf16" if record["stage"] in ("torch-compile", "jax-scan-bf16") else "fp32"
    line = report.headline(report.ladder_rows(records))
    assert line.startswith("Fastest graphtrain rung: `fused`, 7.000 ms per epoch: 11.43× over `baseline`; "
                           "1.43× over the fastest fp32 peer, `jax-scan` (10.00 ms)")
    only_bf16_peers = [r for r in records if r["stage"] != "jax-scan"]
    assert "no fp32 peer ran" in report.headline(report.ladder_rows(only_bf16_peers))
    assert report.headline(report.ladder_rows([failed("baseline", "x")])) is None
    md = report.ladder_markdown(records, "jhu", COMMAND)
    assert "**Fastest graphtrain rung: `fused`" in md
    # A bf16 rung is held against the bf16 peers only.
    with_bf16 = [*records[:3], {**fake_record("bf16", 4.5), "precision": "bf16"}, *records[3:]]
    line = report.headline(report.ladder_rows(with_bf16))
    assert line.startswith("Fastest graphtrain rung: `bf16`, 4.500 ms per epoch: 17.78× over `baseline`; "
                           "0.89× over the fastest bf16 peer, `jax-scan-bf16` (4.000 ms)")


def test_nodes_per_step_column_for_the_rungs_that_have_it(records):
    assert "nodes / step" not in report.ladder_markdown(records, "jhu", COMMAND)
    records[5]["nodes_per_step"] = 12
    md = report.ladder_markdown(records, "jhu", COMMAND)
    assert "| test acc | train loss | nodes / step | note |" in md
    assert "| graphs | 2.500 |" in md and "| 0.1250 | 12 |  |" in md
    assert "| baseline | 40.00 | 260.00 | 100.00 | 5.00× | 1.00× | 92.00% | 0.1250 | — |  |" in md
    assert "nodes / step: the CUDA-graph nodes of one training step" in md
    console = Console(file=io.StringIO(), width=250)
    console.print(ladder.ladder_table(records))
    assert "nodes" in console.file.getvalue()


def test_repeated_and_profiled_rows_get_their_columns(records):
    records[1].update(epoch_ms_min=38.0, epoch_ms_max=45.0,
                      profile={"busy_ms": 10.0, "epoch_ms": 40.0, "idle_share": 0.75, "kernels_per_step": 11.0,
                               "launches_per_step": 13.0})
    md = report.ladder_markdown(records, "jhu", COMMAND)
    assert ("| stage | epoch ms | epoch ms range | total ms | setup ms | × prev | × baseline | test acc | train loss "
            "| kernels /step | launches /step | GPU busy ms | GPU idle | note |") in md
    assert "| baseline | 40.00 | 38.00–45.00 | 260.00 | 100.00 | 5.00× | 1.00× | 92.00% | 0.1250 | 11 | 13 | 10.00 | 75% |  |" in md
    assert "| fewer-syncs | 20.00 | — |" in md
    assert "## Where the time goes" in md and "`baseline` (75% idle)" in md
    plain = report.ladder_markdown([r for r in records if r["stage"] != "baseline"], "jhu", COMMAND)
    assert "epoch ms range" not in plain and "GPU busy" not in plain and "Where the time goes" not in plain


def test_plots_with_repeats_and_profiles(records, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: no plots to check")
    records[1].update(epoch_ms_min=38.0, epoch_ms_max=45.0,
                      profile={"busy_ms": 10.0, "epoch_ms": 40.0, "idle_share": 0.75, "kernels_per_step": 11.0,
                               "launches_per_step": 13.0})
    paths = report.write_ladder(records, "jhu", tmp_path, COMMAND, log=lambda m: None)
    assert "ladder-jhu-h100-partial-busy.png" in {p.name for p in paths}
    md = (tmp_path / "ladder-jhu-h100-partial.md").read_text()
    assert "![ladder-jhu-h100-partial-busy](ladder-jhu-h100-partial-busy.png)" in md


def test_terminal_table_lists_each_note_once():
    records = [fake_record("torch-eager", 100.0, kind="peer", note="fp32, TF32 off"),
               fake_record("torch-graph", 30.0, kind="peer", note="fp32, TF32 off")]
    console = Console(file=io.StringIO(), width=200)
    console.print(ladder.ladder_table(records))
    text = console.file.getvalue()
    assert text.count("fp32, TF32 off") == 1 and text.count("[1]") == 3 and "[2]" not in text


def test_repeat_runs_each_row_again_from_a_fresh_setup(quiet_console):
    records = ladder.run_ladder(PRESETS["jhu"].replace(epochs=2), stages=["numpy"], peers=[], data=small_data(),
                                out_dir=None, command=COMMAND, console=quiet_console, repeat=3)
    row = records[0]
    assert len(row.repeats) == 3 and all(len(run.epochs) == 2 for run in row.repeats)
    assert len({id(run) for run in row.repeats}) == 3
    times = sorted(run.epoch_ms for run in row.repeats)
    assert row.epoch_ms == times[1] and row.epoch_ms_range == (times[0], times[2])
    saved = row.to_json()
    assert [run["epoch_ms"] for run in saved["repeats"]] == [run.epoch_ms for run in row.repeats]
    assert (saved["epoch_ms"], saved["epoch_ms_min"], saved["epoch_ms_max"]) == (times[1], times[0], times[2])
    with pytest.raises(UsageError, match="--repeat"):
        ladder.run_ladder(PRESETS["jhu"], stages=["numpy"], peers=[], data=small_data(), out_dir=None,
                          command=COMMAND, console=quiet_console, repeat=0)


def test_a_rung_that_cannot_train_the_model_leaves_the_table_complete():
    """A persistent kernel skips an MLP too large for it by design: the ladder is whole; a missing
    framework is not."""
    ok = {"stage": "graphs", "kind": "stage", "epoch_ms": 1.0}
    unsupported = {"stage": "persistent", "kind": "stage", "error": "too large for shared memory", "skipped": True,
                   "unsupported": True}
    missing = {"stage": "jax-scan", "kind": "peer", "error": "jax is not installed", "skipped": True}
    assert not report.has_problems([ok, unsupported])
    assert report.has_problems([ok, unsupported, missing])
