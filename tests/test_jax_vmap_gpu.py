"""The jax-vmap peer on the GPU (skipped where jax is not installed): the packed cnns equal to the
same step alone and to the float64 reference, as on the CPU (tests/test_jax_vmap.py) but with
XLA's GPU programs; and the sweep command packing the speedrun's cnns, its table saying the
compile time apart from the training time."""

import json

import pytest

pytest.importorskip("jax")

from test_jax_vmap import check_against_alone, check_against_reference, pack, random_pixels  # noqa: E402

from graphtrain.config import PRESETS  # noqa: E402


def test_packed_cnns_equal_their_step_alone_and_the_float64_reference_on_the_gpu(gpu_device):
    data = random_pixels()
    plans, records = pack(PRESETS["speedrun"].replace(batch=64, epochs=1, precision="fp32"), data, device=None)
    assert all("gpu" in record.environment for record in records)
    check_against_alone(plans, records, data)
    check_against_reference(plans, records, data)


def test_the_sweep_packs_the_speedrun_cnns_beside_the_graphs_rung(gpu_device, mnist_dir, tmp_path):
    """`sweep --preset speedrun --peer jax-vmap`: one pack of every (lr, seed), at TF32 as the graphs
    rung, trained to the speedrun's accuracy; the pack's line under the table gives its training
    time and, apart, its setup and XLA's compile."""
    from click.testing import CliRunner

    from graphtrain.cli import main

    out = tmp_path / "sweep.json"
    result = CliRunner().invoke(main, ["sweep", "--preset", "speedrun", "--data-dir", str(mnist_dir),
                                       "--lrs", "0.006,0.01", "--seeds", "0-1", "--stages", "graphs",
                                       "--peer", "jax-vmap", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["records"]
    vmapped = [row for row in rows if row["stage"] == "jax-vmap"]
    graphs = [row for row in rows if row["stage"] == "graphs"]
    assert len(vmapped) == len(graphs) == 4 and all("error" not in row for row in rows), rows
    pack = vmapped[0]["packed"]
    assert pack["models"] == 4 and all(row["packed"] == pack for row in vmapped)
    assert 0 < pack["compile_ms"] < pack["setup_ms"] and pack["train_ms"] > 0
    assert {row["precision"] for row in vmapped} == {row["precision"] for row in graphs} == {"tf32"}
    assert [row["config"]["lr"] for row in vmapped] == [row["config"]["lr"] for row in graphs]
    assert all(row["test_accuracy"] >= 0.98 for row in vmapped), [row["test_accuracy"] for row in vmapped]
    assert "of them XLA's compile" in " ".join(result.output.split())
