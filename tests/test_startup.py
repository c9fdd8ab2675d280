"""Time to result: what the command imports at start, the dataset cache, the run record's phases."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from graphtrain.__main__ import gpu_stage
from graphtrain.data import cache
from graphtrain.phases import NAMES, Timeline

ROOT = Path(__file__).resolve().parents[1]


def imported_by(code: str) -> set[str]:
    """The top-level packages a fresh interpreter has imported after running `code`."""
    script = f"{code}\nimport sys; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    return set(done.stdout.split())


def test_the_cli_starts_without_frameworks_plots_or_rich():
    loaded = imported_by("import graphtrain.cli")
    assert not loaded & {"torch", "jax", "matplotlib", "cupti", "safetensors", "rich"}, loaded


def test_help_needs_neither_numpy_nor_cuda():
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "graphtrain", "run", "--help"],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and "--stage" in done.stdout
    modules = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines()
               if line.startswith("import time:")}
    assert not modules & {"numpy", "cuda", "rich", "torch", "jax"}, modules


@pytest.mark.parametrize("argv, stage", [
    (["run", "--stage", "persistent"], "persistent"),
    (["run", "--stage=graphs", "--epochs", "1"], "graphs"),
    (["run", "-v", "--preset", "jhu", "--stage", "device-loop"], "device-loop"),
    (["run"], None),  # numpy, run's default
    (["run", "--stage", "numpy"], None),
    (["run", "--stage", "torch-graph"], None),  # a peer makes its own context
    (["run", "--stage", "persistent", "--help"], None),
    (["ladder", "--stages", "persistent"], None),
    ([], None),
])
def test_only_a_gpu_rung_starts_cuda_early(argv, stage):
    assert gpu_stage(argv) == stage


def test_timeline_charges_every_moment_once():
    clock = Timeline()
    clock.advance("data")
    with clock.inside("cuda_context"):
        with clock.inside("kernels"):
            pass
    clock.advance("training")
    ms = clock.snapshot()
    assert set(ms) == set(NAMES) and all(value >= 0 for value in ms.values())
    assert ms["setup"] == 0 and ms["writing"] == 0


# --------------------------------------------------------------------------------------------
# The dataset cache


def sources(tmp_path: Path) -> dict[str, Path]:
    files = {}
    for role in ("images", "labels"):
        files[role] = tmp_path / f"{role}.idx"
        files[role].write_bytes(os.urandom(64))
    return files


class Decoder:
    """What the dataset decodes to (seeded random arrays), counting the decodes."""

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.arrays = {"train_images": rng.random((3000, 784), dtype=np.float32),
                       "train_labels": rng.integers(0, 10, 3000).astype(np.int32),
                       "test_images": rng.random((500, 784), dtype=np.float32),
                       "test_labels": rng.integers(0, 10, 500).astype(np.int32)}
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return {name: array.copy() for name, array in self.arrays.items()}


def assert_same(arrays, decoder):
    assert set(arrays) == set(decoder.arrays)
    for name, array in arrays.items():
        assert array.dtype == decoder.arrays[name].dtype and np.array_equal(array, decoder.arrays[name]), name


def test_cache_is_decoded_once_then_mapped_read_only(tmp_path):
    files, path, decode = sources(tmp_path), tmp_path / "cache" / "d.arrays", Decoder()
    assert_same(cache.load(path, files, decode), decode)
    again = cache.load(path, files, decode)
    assert decode.calls == 1
    assert_same(again, decode)
    assert not again["train_images"].flags.writeable  # a view of the mapping, never written through


def test_cache_is_rebuilt_when_a_source_file_changes(tmp_path):
    files, path = sources(tmp_path), tmp_path / "d.arrays"
    cache.load(path, files, Decoder(1))
    files["labels"].write_bytes(os.urandom(65))  # another copy of the dataset
    new = Decoder(2)
    assert_same(cache.load(path, files, new), new)
    assert new.calls == 1
    os.utime(files["images"], ns=(1, 1))  # same size, touched
    assert_same(cache.load(path, files, new), new)
    assert new.calls == 2


@pytest.mark.parametrize("damage", ["truncate", "flip a byte", "garbage header", "empty"])
def test_a_damaged_cache_is_rebuilt_never_read(tmp_path, damage):
    files, path, decode = sources(tmp_path), tmp_path / "d.arrays", Decoder(3)
    cache.load(path, files, decode)
    blob = bytearray(path.read_bytes())
    if damage == "truncate":
        blob = blob[:len(blob) - 5000]
    elif damage == "flip a byte":
        blob[len(blob) // 2] ^= 0x40  # inside the train images
    elif damage == "garbage header":
        blob[len(cache.MAGIC) + 8:len(cache.MAGIC) + 20] = b"\x00" * 12
    else:
        blob = bytearray()
    path.write_bytes(bytes(blob))
    messages = []
    arrays = cache.load(path, files, decode, log=messages.append)
    assert decode.calls == 2, "the damaged cache was read"
    assert_same(arrays, decode)
    assert len(messages) == 1 and "rebuilding" in messages[0]
    assert_same(cache.load(path, files, decode), decode)  # and the rebuilt one is good
    assert decode.calls == 2


def test_an_unwritable_cache_only_costs_the_decode(tmp_path):
    files, decode = sources(tmp_path), Decoder(4)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    path = blocker / "d.arrays"
    assert_same(cache.load(path, files, decode), decode)
    assert_same(cache.load(path, files, decode), decode)
    assert decode.calls == 2


def test_mnist_from_the_cache_equals_mnist_decoded(mnist_dir, tmp_path, monkeypatch):
    from graphtrain import data

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = data.load("mnist", data_dir=mnist_dir)  # decoded and cached
    assert list((tmp_path / "graphtrain" / "arrays").iterdir())
    second = data.load("mnist", data_dir=mnist_dir)  # mapped
    assert not second.train_images.flags.writeable
    for name in ("train_images", "train_labels", "test_images", "test_labels"):
        a, b = getattr(first, name), getattr(second, name)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name


# --------------------------------------------------------------------------------------------
# The record's phases


def test_run_records_its_phases(tmp_path):
    from graphtrain.cli import main

    rng = np.random.default_rng(5)
    npz = tmp_path / "tiny.npz"
    np.savez(npz, x_train=rng.integers(0, 256, (256, 8, 8), dtype=np.uint8), y_train=rng.integers(0, 4, 256),
             x_test=rng.integers(0, 256, (64, 8, 8), dtype=np.uint8), y_test=rng.integers(0, 4, 64))
    record_path = tmp_path / "run.json"
    result = CliRunner().invoke(main, ["run", "--stage", "numpy", "--data", str(npz), "--epochs", "2", "--batch",
                                       "32", "--json", str(record_path), "-v"])
    assert result.exit_code == 0, result.output
    phases = json.loads(record_path.read_text())["phases"]
    assert list(phases) == list(NAMES)
    assert all(value >= 0 for value in phases.values()), phases
    assert phases["training"] > 0 and phases["data"] > 0
    assert "phases (ms): startup" in result.output


def test_the_ladder_table_shows_each_rows_wall_when_measured():
    from graphtrain import report

    record = {"stage": "persistent", "kind": "stage", "epoch_ms": 1.0, "total_ms": 120.0, "test_accuracy": 0.92}
    plain = report.ladder_rows([record])
    assert report.WALL_COLUMN not in report.ladder_columns(plain)
    timed = report.ladder_rows([{**record, "wall_ms": 640.0}])
    columns = report.ladder_columns(timed)
    assert columns.index(report.WALL_COLUMN) == columns.index("setup ms") + 1
    assert "640" in report.ladder_cells(timed[0], columns)[columns.index(report.WALL_COLUMN)]
    assert "wall ms:" in report.ladder_legend(timed)


def tiny_npz(tmp_path: Path) -> Path:
    rng = np.random.default_rng(7)
    npz = tmp_path / "tiny.npz"
    np.savez(npz, x_train=rng.integers(0, 256, (256, 8, 8), dtype=np.uint8), y_train=rng.integers(0, 4, 256),
             x_test=rng.integers(0, 256, (64, 8, 8), dtype=np.uint8), y_test=rng.integers(0, 4, 64))
    return npz


def test_a_run_leaving_without_teardown_still_flushes_and_says_its_status(tmp_path):
    """`python -m graphtrain run` ends by os._exit: the record on stdout is whole, the exit code
    the command's, for a good run (0) and a bad option (2)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "graphtrain", "run", "--stage", "numpy", "--data", str(tiny_npz(tmp_path)),
               "--epochs", "1", "--batch", "32", "--json", "-"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["stage"] == "numpy" and set(record["phases"]) == set(NAMES)
    bad = subprocess.run([*command, "--lr", "fast"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert bad.returncode == 2 and "fast" in bad.stderr and not bad.stdout
