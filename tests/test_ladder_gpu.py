"""A short ladder on the GPU: every stage and every importable peer, 2 epochs of jhu."""

from rich.console import Console

from graphtrain.config import PRESETS
from graphtrain.data import load
from graphtrain.ladder import default_peers, default_stages, run_ladder


def test_short_ladder_every_row_trains(mnist_dir, tmp_path, monkeypatch):
    # max-autotune spends minutes benchmarking kernels; the row itself is what is under test
    monkeypatch.setenv("GRAPHTRAIN_TORCH_COMPILE_MODE", "reduce-overhead")
    data = load("mnist", data_dir=mnist_dir, offline=True)
    records = run_ladder(PRESETS["jhu"].replace(epochs=2), stages=default_stages(), peers=default_peers(),
                         data=data, out_dir=tmp_path, command="graphtrain ladder --epochs 2",
                         console=Console(stderr=True, quiet=True))
    assert [r.stage for r in records] == default_stages() + default_peers()
    for record in records:
        if record.failed and record.skipped:  # a framework that is not installed here
            continue
        assert not record.failed, record
        assert record.test_accuracy > 0.88, record.stage
        assert record.epoch_ms > 0
    # Named after the GPU; -partial when a peer's framework is not installed here.
    assert list(tmp_path.glob("ladder-jhu-softmax-e2-*.md")) and list(tmp_path.glob("ladder-jhu-softmax-e2-*.json"))
    nodes = {r.stage: r.nodes_per_step for r in records if not r.failed}
    assert nodes["fused"] and nodes["bf16"], nodes  # the rungs that capture a step graph say how many nodes
    assert nodes["baseline"] is None
