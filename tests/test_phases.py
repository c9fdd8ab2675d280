"""The run record's phases: where they count from, the exit phase, and that they add up to the
process's wall (the CPU path; scripts/benchmarks/wall.py measures the GPU rows)."""

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from graphtrain import phases
from graphtrain.phases import NAMES, Timeline, age_from, start_ticks

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------
# The process's start


def stat_line(comm: bytes, starttime: int) -> bytes:
    """A /proc/PID/stat line: pid, (comm), then fields 3-52 with starttime as field 22."""
    fields = [b"S"] + [str(n).encode() for n in range(4, 22)] + [str(starttime).encode()]
    fields += [str(n).encode() for n in range(23, 53)]
    return b"4242 (" + comm + b") " + b" ".join(fields) + b"\n"


@pytest.mark.parametrize("comm", [b"python3", b"a b", b"x) (y", b")"])
def test_the_start_is_read_after_the_command_name_whatever_it_holds(comm):
    assert start_ticks(stat_line(comm, 987654)) == 987654


def test_the_age_counts_from_the_middle_of_the_start_tick():
    # Started in tick 9000 (at 100 ticks a second: 90.00 to 90.01 s after boot), now 100 s after boot.
    assert age_from(stat_line(b"python3", 9000), 100.0, 100) == pytest.approx(100.0 - 90.005)


def test_a_stat_line_without_its_fields_is_refused():
    with pytest.raises((ValueError, IndexError)):
        start_ticks(b"4242 (python3) S 1 2")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="no /proc: the process's start cannot be read")
def test_this_process_has_an_age_and_the_timeline_counts_from_it():
    age = phases.process_age()
    assert age is not None and 0 < age < time.clock_gettime(time.CLOCK_BOOTTIME)
    assert phases.origin() == "process"


def test_a_timeline_without_a_start_says_it_counts_from_its_making():
    assert Timeline().origin == "import" and Timeline(time.perf_counter() - 1.0).origin == "process"


# --------------------------------------------------------------------------------------------
# The exit phase


def test_leaving_does_the_exit_work_once_in_the_exit_phase():
    clock = Timeline()
    clock.advance("writing")
    done = []
    clock.at_exit(lambda: (time.sleep(0.02), done.append(1)))
    clock.leaving()
    clock.leaving()
    ms = clock.snapshot()
    assert done == [1]
    assert ms["exit"] >= 20 and list(ms) == list(NAMES) and all(value >= 0 for value in ms.values())


def test_leaving_without_exit_work_keeps_the_exit_phase_near_zero():
    clock = Timeline()
    clock.advance("writing")
    clock.leaving()
    assert clock.snapshot()["exit"] < 5


def test_the_exit_work_raises_what_it_raised():
    clock = Timeline()

    def fails() -> None:
        raise RuntimeError("release failed")

    clock.at_exit(fails)
    with pytest.raises(RuntimeError, match="release failed"):
        clock.leaving()


# --------------------------------------------------------------------------------------------
# Adding up: the numpy rung, a process of its own timed from outside


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="no /proc: the phases count from the import")
def test_the_phases_of_a_numpy_run_add_up_to_its_wall(tmp_path):
    rng = np.random.default_rng(3)
    npz = tmp_path / "tiny.npz"
    np.savez(npz, x_train=rng.integers(0, 256, (512, 8, 8), dtype=np.uint8), y_train=rng.integers(0, 4, 512),
             x_test=rng.integers(0, 256, (64, 8, 8), dtype=np.uint8), y_test=rng.integers(0, 4, 64))
    record_path = tmp_path / "run.json"
    command = [sys.executable, "-m", "graphtrain", "run", "--stage", "numpy", "--data", str(npz), "--epochs", "2",
               "--batch", "32", "--json", str(record_path)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall_ms = (time.perf_counter() - start) * 1e3
    assert done.returncode == 0, done.stderr
    record = json.loads(record_path.read_text())
    assert record["phases_from"] == "process"
    ms = record["phases"]
    assert list(ms) == list(NAMES) and all(value >= 0 for value in ms.values()), ms
    total = sum(ms.values())
    # Never more than the wall (the start's tick is split in the middle: at most 5 ms off); less
    # by the process's creation, the record's writing and its end: a few ms.
    assert total <= wall_ms + 6, (total, wall_ms)
    assert wall_ms - total <= max(0.05 * wall_ms, 50), (total, wall_ms)


def test_verbose_says_where_the_phases_count_from():
    from graphtrain.cli import phases_text

    ms = dict.fromkeys(NAMES, 1.0)
    assert phases_text(ms, "process").endswith(f"total {len(NAMES)} since the process's start")
    assert "graphtrain's import" in phases_text(ms, "import")


# --------------------------------------------------------------------------------------------
# The head start beside the data, and the GPU's release


class FakeRuntime:
    set_devices: list[int] = []

    @classmethod
    def cudaSetDevice(cls, ordinal: int) -> int:
        cls.set_devices.append(ordinal)
        return 0


def test_work_beside_runs_in_order_keeps_what_it_raises_and_is_waited_for_before_a_capture(monkeypatch):
    from graphtrain.libs import cuda

    done, gate = [], threading.Event()

    def first() -> None:
        gate.wait(5)
        done.append("first")

    def fails() -> None:
        done.append("fails")
        raise RuntimeError("only a head start")

    monkeypatch.setattr(cuda, "runtime_api", lambda: FakeRuntime)  # no GPU here: the device is only set
    device = cuda.DeviceInfo(0, "test GPU", (9, 0), "sm_90", 132, 80 << 30, "13.0", "13.0",
                              228 * 1024, 64 * 1024, 2048)
    cuda.start_beside([first, fails, lambda: done.append("never")], device, name="test-beside")
    thread = cuda._started[-1]
    try:
        assert thread.join in cuda._before_capture  # the next capture waits for it
        gate.set()
        thread.join(5)
        assert done == ["first", "fails"] and not thread.is_alive()
        assert FakeRuntime.set_devices == [0]  # the device made current on the thread first
        with pytest.raises(cuda.HeadStartError, match="test-beside: RuntimeError: only a head start"):
            cuda.wait_for_head_starts()
        cuda.wait_for_head_starts()  # raised once
    finally:
        cuda.drop_before_capture(thread.join)
        cuda._started.remove(thread)
        cuda._head_start_errors.clear()


def test_releasing_with_no_gpu_opened_does_nothing():
    from graphtrain.libs import cuda

    if cuda._devices:
        pytest.skip("this process has a GPU open: releasing it would end the other tests' use of it")
    cuda.release_devices()


def test_a_rung_begins_the_first_uses_of_the_libraries_its_setup_calls_and_no_others():
    from graphtrain.libs import cublas, cudnn
    from graphtrain.stages import get_stage

    assert get_stage("graphs").first_uses() == [cublas.first_use, cudnn.first_use]
    assert get_stage("cublas").first_uses() == [cublas.first_use]
    assert get_stage("device-loop").first_uses() == [cublas.first_use]  # its test-set forward pass
    assert get_stage("baseline").first_uses() == []
    assert get_stage("persistent").first_uses() == [] and get_stage("numpy").first_uses() == []
    # the cnn: its lane and cuBLASLt handle (its linear layers' products); cuDNN only where its conv
    # layers are asked of it
    from graphtrain.stages import cnn_shared

    assert get_stage("graphs", "cnn").first_uses() == [cnn_shared.first_use]
    assert get_stage("device-loop", "cnn").first_uses() == [cnn_shared.first_use]
    assert get_stage("graphs", "cnn").on_conv_path("cudnn").first_uses() == [cnn_shared.first_use, cudnn.first_use]
    assert get_stage("numpy", "cnn").first_uses() == []


# --------------------------------------------------------------------------------------------
# The before/after table


def wall_table(revision: str, rows: dict[str, tuple[float, dict[str, float], float]]) -> dict:
    records = [{"stage": stage, "kind": "stage", "wall_ms": wall, "phases": ms, "epoch_ms": epoch,
                "environment": {"gpu": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "python": "3.12.3"}}
               for stage, (wall, ms, epoch) in rows.items()]
    return {"report": "wall", "label": "jhu", "date": "2026-01-02 03:04:05 UTC", "revision": revision,
            "command": "python3 scripts/benchmarks/wall.py", "records": records}


def test_the_phases_table_gives_before_after_and_the_change_with_its_provenance():
    table = load_script("scripts/benchmarks/phases_table.py")
    before = wall_table("e121a09", {"graphs": (1365.0, {"startup": 161.0, "setup": 187.0}, 12.71)})
    after_phases = {**dict.fromkeys(NAMES, 0.0), "startup": 200.0, "setup": 60.0, "exit": 90.0}
    after = wall_table("0123abc", {"graphs": (400.0, after_phases, 12.80)})
    text = table.markdown(before, after, "b.json", "a.json", ["graphs", "numpy"], "python3 phases_table.py",
                          "2026-01-03 00:00:00 UTC")
    head = text.splitlines()[:10]
    assert head[0].startswith("# ") and "- Date: 2026-01-03 00:00:00 UTC" in head
    assert any(line.startswith("- Revision: 0123abc") for line in head)
    assert any(line.startswith("- Device: NVIDIA H100") for line in head)
    rows = [line for line in text.splitlines() if line.startswith("|")]
    before_row = next(r for r in rows if "| graphs | before |" in r)
    change_row = rows[rows.index(before_row) + 2]
    cells = [c.strip() for c in change_row.strip("|").split("|")]
    columns = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[columns.index("wall ms")] == "-965"
    assert cells[columns.index("exit")] == "+90"  # absent before: 0 then
    assert cells[columns.index("setup")] == "-127"
    assert cells[columns.index("epoch ms")] == "×1.007"
    assert "| numpy | before |" in text  # a row neither table has shows as dashes
