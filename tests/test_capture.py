"""Each row's own output goes to its log: a peer that prints (from Python, through the file
descriptors, from a subprocess) leaves the terminal to graphtrain's progress and tables."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from rich.console import Console

from graphtrain import ladder
from graphtrain.config import PRESETS
from graphtrain.data import Dataset
from graphtrain.stages.numpy_cpu import NumpyStage

NOISE = ("autotune says hello", "warning via stderr", "fd one", "fd two", "from a subprocess")


class NoisyStage(NumpyStage):
    """The numpy stage, printing the way frameworks do while it sets up."""

    name = "torch-eager"
    kind = "peer"
    fail = False

    def setup(self) -> None:
        print(NOISE[0])
        sys.stderr.write(NOISE[1] + "\n")
        os.write(1, (NOISE[2] + "\n").encode())
        os.write(2, (NOISE[3] + "\n").encode())
        subprocess.run([sys.executable, "-c", f"import sys; print({NOISE[4]!r}, file=sys.stderr)"], check=True)
        super().setup()
        if self.fail:
            raise RuntimeError("the framework fell over")


def noisy_peer(monkeypatch, fail=False):
    """Make the torch-eager row the NoisyStage."""
    stage = type("Noisy", (NoisyStage,), {"fail": fail})
    real_get_stage = ladder.get_stage
    monkeypatch.setattr(ladder, "get_stage", lambda name: stage if name == "torch-eager" else real_get_stage(name))


def run(tmp_path, console):
    return ladder.run_ladder(PRESETS["jhu"].replace(epochs=1), stages=["numpy"], peers=["torch-eager"],
                             data=Dataset.synthetic(500, 100, seed=0), out_dir=tmp_path, command="graphtrain ladder",
                             console=console)


def test_a_noisy_peer_leaves_the_terminal_clean(monkeypatch, tmp_path, capfd):
    noisy_peer(monkeypatch)
    console = Console(file=io.StringIO(), width=200)
    records = run(tmp_path, console)
    terminal = capfd.readouterr()
    for text in NOISE:
        assert text not in terminal.out and text not in terminal.err
        assert text not in console.file.getvalue()
    log = tmp_path / "logs" / "ladder-jhu-softmax-e1-torch-eager.log"
    assert records[1].log == str(log) and not records[1].failed
    assert records[1].to_json()["log"] == str(log) and "log" not in records[0].to_json()
    logged = log.read_text()
    for text in NOISE:
        assert text in logged
    # The numpy row printed nothing: no log for it.
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [log.name]
    assert "wrote" in console.file.getvalue()  # graphtrain's own output still reaches its console


def test_the_console_on_the_terminal_keeps_writing_there(monkeypatch, tmp_path, capfd):
    """A console writing to file descriptor 2 (as the CLI's does) is moved to a copy of it while
    rows run, so its progress and messages are not captured with the row's output."""
    noisy_peer(monkeypatch)
    console = Console(file=open(2, "w", closefd=False), width=200, force_terminal=False)
    streams = sys.stdout, sys.stderr
    run(tmp_path, console)
    console.file.flush()
    err = capfd.readouterr().err
    assert "wrote" in err and "torch-eager" in err
    assert not any(text in err for text in NOISE)
    assert (sys.stdout, sys.stderr) == streams  # put back after the rows


def test_a_failed_row_points_at_its_log_which_holds_the_traceback(monkeypatch, tmp_path, capfd):
    noisy_peer(monkeypatch, fail=True)
    console = Console(file=io.StringIO(), width=300)
    records = run(tmp_path, console)
    log = tmp_path / "logs" / "ladder-jhu-softmax-e1-torch-eager.log"
    assert records[1].error == "RuntimeError: the framework fell over"
    assert records[1].log == str(log) and records[1].to_json()["log"] == str(log)
    assert f"(its output: {log})" in console.file.getvalue()
    logged = log.read_text()
    assert NOISE[0] in logged and "Traceback" in logged and "the framework fell over" in logged
    assert "the framework fell over" not in capfd.readouterr().err


def test_without_an_output_folder_nothing_is_captured(monkeypatch, capfd):
    noisy_peer(monkeypatch)
    ladder.run_ladder(PRESETS["jhu"].replace(epochs=1), stages=[], peers=["torch-eager"],
                      data=Dataset.synthetic(500, 100, seed=0), out_dir=None, command="x",
                      console=Console(file=io.StringIO()))
    assert NOISE[0] in capfd.readouterr().out
