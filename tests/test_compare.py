"""`graphtrain compare`: two small ladder reports, row by row."""

import io
import json

import pytest
from click.testing import CliRunner
from rich.console import Console

from graphtrain import compare
from graphtrain.cli import main
from graphtrain.errors import UsageError


def ladder_file(path, rows, label="jhu", gpu="NVIDIA H100 80GB HBM3"):
    records = []
    for name, ms, kind, extra in rows:
        if ms is None:
            records.append({"stage": name, "kind": kind, "error": "jax is not installed", "skipped": True})
        else:
            records.append({"stage": name, "kind": kind, "epoch_ms": ms, "test_accuracy": 0.92,
                            "environment": {"gpu": gpu}, **extra})
    path.write_text(json.dumps({"report": "ladder", "label": label, "date": "2026-11-22", "command": "x",
                                "records": records}))
    return path


@pytest.fixture
def two(tmp_path):
    a = ladder_file(tmp_path / "a.json", [("baseline", 80.0, "stage", {}),
                                          ("graphs", 14.0, "stage", {"profile": {"busy_ms": 12.5}}),
                                          ("jax-scan", 10.0, "peer", {})])
    b = ladder_file(tmp_path / "b.json", [("baseline", 40.0, "stage", {}),
                                          ("graphs", 28.0, "stage", {"profile": {"busy_ms": 25.0},
                                                                     "test_accuracy": 0.9213}),
                                          ("jax-scan", None, "peer", {}),
                                          ("fused", 7.0, "stage", {})], gpu="NVIDIA GeForce RTX 4090")
    return compare.load(a), compare.load(b)


def test_rows_side_by_side_with_ratios(two):
    a, b = two
    rows = {pair.name: compare.cells(pair) for pair in compare.pairs(a, b)}
    assert list(rows) == ["baseline", "graphs", "jax-scan", "fused"]  # A's order, then B's extra rows
    assert rows["baseline"] == ["baseline", "80.00", "40.00", "2.00×", "+0.00", "—", "—"]
    assert rows["graphs"] == ["graphs", "14.00", "28.00", "0.50×", "+0.13", "12.50", "25.00"]
    assert rows["jax-scan"][1:4] == ["10.00", "skipped", "—"]
    assert rows["fused"][1:4] == ["absent", "7.000", "—"]
    console = Console(file=io.StringIO(), width=200)
    console.print(compare.table(a, b))
    text = console.file.getvalue()
    assert "NVIDIA H100 80GB HBM3" in text and "NVIDIA GeForce RTX 4090" in text and "2.00×" in text


def test_sweep_rows_are_keyed_by_hidden_size(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"report": "sweep", "label": "cuda-mnist", "records": [
        {"stage": "graphs", "hidden_size": 128, "epoch_ms": 5.0},
        {"stage": "graphs", "hidden_size": 256, "epoch_ms": 9.0}]}))
    report = compare.load(path)
    assert [pair.name for pair in compare.pairs(report, report)] == ["H=128 graphs", "H=256 graphs"]


@pytest.mark.parametrize("content, needle", [(None, "cannot read"), ("{not json", "is not JSON"),
                                             ('{"rows": []}', "not a graphtrain ladder or sweep report")])
def test_bad_files_are_usage_errors(tmp_path, content, needle):
    path = tmp_path / "x.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UsageError, match=needle):
        compare.load(path)


def test_cli_compare(tmp_path):
    a = ladder_file(tmp_path / "a.json", [("graphs", 14.0, "stage", {})])
    b = ladder_file(tmp_path / "b.json", [("graphs", 7.0, "stage", {})], label="jhu-e2")
    result = CliRunner().invoke(main, ["compare", str(a), str(b)])
    assert result.exit_code == 0, result.output
    assert "2.00×" in result.output and "the workloads differ" in result.output
    missing = CliRunner().invoke(main, ["compare", str(a), str(tmp_path / "nope.json")])
    assert missing.exit_code == 2 and "cannot read" in missing.output and "Traceback" not in missing.output
