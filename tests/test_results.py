"""What every results file says about itself: the committed files in results/ and the code that
writes new ones open with date, git revision, command and device; names are unique; the README's
links to results/ lead to files that exist."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from graphtrain import environment, report

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
HEADER_LINES = 8  # the provenance comes first, right under the title


def opening(path: Path) -> list[str]:
    return path.read_text().splitlines()[:HEADER_LINES + 2]


@pytest.mark.parametrize("path", sorted(RESULTS.rglob("*.md")), ids=lambda p: p.name)
def test_every_results_file_opens_with_date_revision_command_and_device(path):
    head = opening(path)
    assert head[0].startswith("# "), path
    for item in ("- Date: ", "- Revision: ", "- Command: `"):
        assert any(line.startswith(item) for line in head), f"{path.name}: no {item!r} in its opening lines"
    assert any(line.startswith(("- Device: ", "- gpu: ")) for line in head), f"{path.name} names no device"
    revision = next(line for line in head if line.startswith("- Revision: "))
    assert re.search(r"\b[0-9a-f]{7,40}\b", revision), f"{path.name}: {revision}"


@pytest.mark.parametrize("path", sorted(RESULTS.rglob("*.json")), ids=lambda p: p.name)
def test_every_results_json_names_date_revision_and_command(path):
    saved = report.read_json(path)
    assert saved["date"] and saved["command"], path.name
    assert re.search(r"\b[0-9a-f]{7,40}\b", saved["revision"] or ""), f"{path.name}: {saved.get('revision')}"


def test_no_results_file_name_is_used_twice():
    names = [p.name for p in RESULTS.rglob("*") if p.is_file()]
    assert names and len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_readme_links_into_results_lead_to_files():
    text = (ROOT / "README.md").read_text()
    linked = set(re.findall(r"\((results/[^)\s]+)\)", text))
    assert linked
    missing = sorted(link for link in linked if not (ROOT / link).is_file())
    assert not missing, missing


RECORD = {"stage": "graphs", "kind": "stage", "epoch_ms": 2.0, "environment": {
    "gpu": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "driver": "580.95.05", "driver_cuda": "13.0",
    "runtime": "13.0", "cublas": "13.1.0", "nvrtc": "13.0", "python": "3.12.3", "numpy": "2.1.0",
    "revision": "0123abc"}}


def test_a_written_ladder_opens_with_its_provenance():
    md = report.ladder_markdown([RECORD], "jhu-softmax", "graphtrain ladder --preset jhu", date="2026-01-02 03:04:05 UTC")
    head = md.splitlines()
    assert head[0] == "# graphtrain ladder: jhu-softmax"
    assert head[2:6] == ["- Date: 2026-01-02 03:04:05 UTC", "- Revision: 0123abc",
                         "- Command: `graphtrain ladder --preset jhu`",
                         "- Device: NVIDIA H100 80GB HBM3 (compute capability 9.0)"]
    assert "- Driver: 580.95.05 (CUDA 13.0)" in head[:HEADER_LINES + 2]
    assert any("cuBLAS 13.1.0" in line and "NVRTC 13.0" in line for line in head[:HEADER_LINES + 2])


def test_a_record_without_a_revision_says_so():
    record = {**RECORD, "environment": {**RECORD["environment"], "revision": None}}
    md = report.sweep_markdown([record], "cuda-mnist-mlpHx3", "graphtrain sweep", date="2026-01-02 03:04:05 UTC")
    assert "- Revision: unknown (not run from a git checkout of graphtrain)" in md.splitlines()[:HEADER_LINES]


def test_a_scripts_table_opens_with_its_provenance():
    text = report.script_header("mma.sync issue rate", RECORD["environment"], "python3 scripts/benchmarks/mma_rate.py",
                                extra=["rounds: 512"], date="2026-01-02 03:04:05 UTC")
    assert text.splitlines()[:6] == ["# mma.sync issue rate", "", "- Date: 2026-01-02 03:04:05 UTC",
                                     "- Revision: 0123abc", "- Command: `python3 scripts/benchmarks/mma_rate.py`",
                                     "- Device: NVIDIA H100 80GB HBM3 (compute capability 9.0)"]
    assert "- rounds: 512" in text


def test_every_run_records_the_source_revision(tmp_path):
    """In this checkout, HEAD (with +changes where tracked files differ); in a copy of the package
    outside git, None."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout with git installed: the revision cannot be compared")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=7", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    found = environment.host()["revision"]
    assert found in (head, f"{head}+changes"), found
    shutil.copytree(ROOT / "graphtrain", tmp_path / "graphtrain",
                    ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-c", "from graphtrain import environment; "
                           "print(environment.source_revision())"],
                          capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr


def test_a_written_json_names_date_revision_and_command(tmp_path):
    paths = report.write_ladder([RECORD], "jhu-softmax", tmp_path, "graphtrain ladder", log=lambda m: None,
                                date="2026-01-02 03:04:05 UTC", partial=False)
    saved = report.read_json(next(p for p in paths if p.suffix == ".json"))
    assert (saved["date"], saved["revision"], saved["command"]) == ("2026-01-02 03:04:05 UTC", "0123abc",
                                                                    "graphtrain ladder")
