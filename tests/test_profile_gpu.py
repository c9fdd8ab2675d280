"""--profile on the GPU: the CUPTI trace of one extra epoch, per row of a short ladder."""

import pytest
from rich.console import Console

from graphtrain.config import PRESETS
from graphtrain.data import load
from graphtrain.ladder import run_ladder
from graphtrain.profile import cupti_missing
from graphtrain.training import train


@pytest.fixture(scope="module")
def gpu_data(mnist_dir):
    missing = cupti_missing()
    if missing:
        pytest.skip(missing)
    return load("mnist", data_dir=mnist_dir, offline=True)


def test_profile_columns_on_a_short_ladder(gpu_data, tmp_path):
    config = PRESETS["jhu"].replace(epochs=2)
    records = run_ladder(config, stages=["numpy", "baseline", "cublas", "graphs", "fused"], peers=["torch-graph"],
                         data=gpu_data, out_dir=tmp_path, command="graphtrain ladder --profile --epochs 2",
                         console=Console(stderr=True, quiet=True), profile=True)
    rows = {r.stage: r for r in records}
    assert rows["numpy"].profile is None  # CPU work: nothing for CUPTI to see
    for name in ("baseline", "cublas", "graphs", "fused"):
        assert not rows[name].failed, rows[name]
        profile = rows[name].profile
        assert profile["steps"] == 469 and profile["untimed"] == 0, (name, profile)
        assert 0 < profile["busy_ms"] <= profile["traced_epoch_ms"] * 1.02, (name, profile)
        assert 0 <= profile["idle_share"] < 1
    baseline, cublas, graphs = rows["baseline"].profile, rows["cublas"].profile, rows["graphs"].profile
    fused = rows["fused"].profile
    assert baseline["kernels_per_step"] >= 5
    # Eager rungs: one host call per kernel, copy and memset; the graph rungs: one graph launch
    # per step (plus the cursor reset once per epoch), every kernel a graph node.
    assert baseline["launches_per_step"] == pytest.approx(
        baseline["kernels_per_step"] + baseline["copies_per_step"], abs=0.01)
    for graph_rung in (graphs, fused):
        assert graph_rung["launches_per_step"] < 1.01
        assert graph_rung["graph_kernels"] >= graph_rung["kernels"] - 1
    # What CUPTI saw per step is the fused step graph's node count (its nodes are all kernels).
    assert fused["kernels_per_step"] == pytest.approx(rows["fused"].nodes_per_step, abs=0.01)
    # cuBLAS's products do less GPU work than the naive kernels, and so do the rungs after it.
    assert cublas["busy_ms"] < baseline["busy_ms"]
    assert graphs["busy_ms"] < baseline["busy_ms"]
    peer = rows["torch-graph"]
    if not (peer.failed and peer.skipped):
        # per step: the batch's indices copied into the graph's input, then one replay
        assert peer.profile["launches_per_step"] == pytest.approx(2, abs=0.05)
    md = next(tmp_path.glob("ladder-jhu-softmax-e2-*-partial.md")).read_text()
    assert "| kernels /step | launches /step | GPU busy ms | GPU idle |" in md
    assert "| nodes / step |" in md
    assert "## Where the time goes" in md
    assert list(tmp_path.glob("ladder-jhu-softmax-e2-*-partial-busy.png"))


def test_profiling_changes_nothing_the_record_reports(gpu_data):
    config = PRESETS["jhu"].replace(epochs=2)
    plain = train(config, stage="graphs", data=gpu_data)
    profiled = train(config, stage="graphs", data=gpu_data, profile=True)
    assert profiled.profile is not None and plain.profile is None
    assert profiled.test_accuracy == plain.test_accuracy and profiled.train_loss == plain.train_loss
    assert [e.train_loss for e in profiled.epochs] == [e.train_loss for e in plain.epochs]
    assert len(profiled.epochs) == 2  # the profiled epoch is not one of the record's
