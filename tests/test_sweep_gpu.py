"""Packed sweeps on a GPU: every packed model bit-identical to its run alone; the jax-vmap peer
equal to the jax-scan peer model by model within fp32 tolerance; a worker process on the GPU
giving the same rows as this process."""

import numpy as np
import pytest

from graphtrain import sweep, training
from graphtrain.config import PRESETS
from graphtrain.plan import RunPlan
from graphtrain.stages import get_stage

pytestmark = pytest.mark.gpu

GRID = [(0.05, 0), (0.1, 1), (0.2, 2)]  # (lr, seed) of the models packed together


@pytest.fixture(scope="module")
def mnist(mnist_dir):
    from graphtrain import data

    return data.load("mnist", data_dir=mnist_dir)


def plans_for(mnist, precision=None, epochs=2):
    return [RunPlan.for_data(PRESETS["jhu"].replace(lr=lr, seed=seed, epochs=epochs, precision=precision), mnist)
            for lr, seed in GRID]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("lanes", [1, 3])
def test_packed_models_equal_their_runs_alone_bit_for_bit(gpu_device, mnist, precision, lanes):
    from graphtrain.packed import train_packed

    if gpu_device.compute_capability < (9, 0):
        pytest.skip("the persistent rung needs thread-block clusters")
    plans = plans_for(mnist, precision)
    packed = train_packed(plans, mnist, lanes=lanes)
    for plan, record in zip(plans, packed):
        alone = training.run_stage(get_stage("persistent"), plan, mnist)
        for mine, theirs in zip(record.params, alone.params):
            assert np.array_equal(mine.w, theirs.w) and np.array_equal(mine.b, theirs.b), (
                f"lr {plan.config.lr} seed {plan.config.seed} {precision}: packed weights differ from alone")
        assert record.test_accuracy == alone.test_accuracy  # the rung's own evaluation, on the same weights
        assert record.epochs[-1].train_loss == pytest.approx(alone.epochs[-1].train_loss, rel=1e-6)
    assert len({sweep.weights_digest(r.params) for r in packed}) == len(GRID)
    assert packed[0].pack["models"] == 3 and packed[0].pack["train_ms"] > 0


def test_jax_vmap_equals_jax_scan_model_by_model(gpu_device, mnist):
    pytest.importorskip("jax")
    from graphtrain.peers.jax_vmap import train_vmapped

    plans = plans_for(mnist, epochs=1)
    vmapped = train_vmapped(plans, mnist)
    for plan, record in zip(plans, vmapped):
        alone = training.run_stage(get_stage("jax-scan"), plan, mnist)
        for mine, theirs in zip(record.params, alone.params):
            err = np.linalg.norm(mine.w.astype(np.float64) - theirs.w) / np.linalg.norm(theirs.w)
            assert err < 1e-5, f"lr {plan.config.lr} seed {plan.config.seed}: relative error {err:.2e}"
        assert record.train_loss == pytest.approx(alone.train_loss, rel=1e-4)


def test_a_gpu_worker_gives_the_rows_of_this_process(gpu_device, mnist_dir):
    from graphtrain.workers import GpuWorkers

    config = PRESETS["jhu"].replace(epochs=1)
    points = sweep.expand_grid(config, ["persistent", "graphs"], [], lrs=[0.05, 0.1], seeds=[0, 1])
    source = sweep.DataSource("mnist", data_dir=mnist_dir)
    here, _ = sweep.run_sweep(points, sweep.InProcess(), source)
    there, _ = sweep.run_sweep(points, GpuWorkers([0]), source)
    assert all("error" not in row for row in here + there), [r.get("error") for r in here + there]
    assert [r["weights_sha256"] for r in here] == [r["weights_sha256"] for r in there]
    assert {r["device"] for r in there} == {"GPU 0"}
    assert [r.get("packed", {}).get("models") for r in there if r["stage"] == "persistent"] == [4] * 4


def test_two_gpu_workers_give_the_rows_of_one(gpu_device, mnist_dir):
    from graphtrain.workers import GpuWorkers, gpu_count

    if gpu_count() < 2:
        pytest.skip("needs two GPUs")
    config = PRESETS["jhu"].replace(epochs=1)
    points = sweep.expand_grid(config, ["persistent", "device-loop"], [], lrs=[0.05, 0.1], seeds=[0, 1])
    source = sweep.DataSource("mnist", data_dir=mnist_dir)
    one, _ = sweep.run_sweep(points, GpuWorkers([0]), source)
    two, summary = sweep.run_sweep(points, GpuWorkers([0, 1]), source)
    assert all("error" not in row for row in one + two), [r.get("error") for r in one + two]
    assert [r["weights_sha256"] for r in one] == [r["weights_sha256"] for r in two]
    assert {r["device"] for r in two} == {"GPU 0", "GPU 1"}
    assert summary["tasks"] == 2 + 4  # the persistent pack split in two, four device-loop rows


def test_the_sweep_command_on_a_gpu_with_depth_and_the_peers_it_lacks_noted(gpu_device, mnist_dir, tmp_path):
    """--depth sets the swept widths' layers; a default peer whose framework is missing is one note
    under the table, not rows; the workload line names the grid."""
    import importlib.util
    import json

    from click.testing import CliRunner

    from graphtrain.cli import main

    result = CliRunner().invoke(main, ["sweep", "--data-dir", str(mnist_dir), "--epochs", "1", "--hidden-sizes", "16",
                                       "--depth", "2", "--lrs", "0.05,0.1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    document = json.loads(next(tmp_path.glob("sweep-*.json")).read_text())
    graphs = [r for r in document["records"] if r["stage"] == "graphs"]
    assert len(graphs) == 2 and all(tuple(r["config"]["hidden"]) == (16, 16) for r in graphs)
    assert "lrs 0.05, 0.1" in next(tmp_path.glob("sweep-*.md")).read_text()
    notes = [line for line in result.output.splitlines() if line.startswith("note: not run")]
    lacking = [name for name in ("torch", "jax") if importlib.util.find_spec(name) is None]
    assert len(notes) == (1 if lacking else 0), result.output
    for name in lacking:
        assert f"{name} is not installed" in " ".join(result.output.split())
        assert not any(r["stage"].startswith(name) for r in document["records"])


def test_speedrun_on_a_gpu_checks_its_rows_then_runs(gpu_device, mnist_dir, tmp_path):
    from click.testing import CliRunner

    from graphtrain.cli import main

    out = tmp_path / "speedrun.json"
    result = CliRunner().invoke(main, ["speedrun", "--data-dir", str(mnist_dir), "--stages", "graphs", "--peer", "none",
                                       "--seeds", "1", "--epochs", "1", "--no-process-wall", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert out.exists()
    same = CliRunner().invoke(main, ["speedrun", "--data-dir", str(mnist_dir), "--stages", "graphs", "--peer", "none",
                                     "--json", str(out), "--markdown", str(out)])
    assert same.exit_code == 2 and "name the same file" in same.output
