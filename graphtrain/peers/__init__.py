"""Peers: the same workload trained by frameworks, timed with the same protocol as the stages.

Each peer is a module with `run(config, data, progress=None) -> dict` that returns a run record
with the same keys as `graphtrain.training.train` (its "stage" is the peer's name) plus
"kind": "peer" and a "note" on what it uses (precision, compile mode). Every peer trains the
model from `reference.init_params` in the order of `reference.epoch_order`, with the whole
dataset preloaded on the GPU, so its loss curve overlays the stages'.

The frameworks are optional: they are imported only when a peer runs, and a missing one (or a
missing GPU) raises `PeerUnavailable`, which the ladder shows as a skipped row.
"""

from __future__ import annotations

import importlib

from graphtrain.errors import GraphtrainError, UsageError

# peer name -> "module:function", in the order the ladder runs them.
PEERS: dict[str, str] = {
    "torch-eager": "torch_eager:run",
    "torch-compile": "torch_compile:run",
    "torch-graph": "torch_graph:run",
    "jax-scan": "jax_scan:run",
}


class PeerUnavailable(GraphtrainError):
    """The peer cannot run here (its framework or a GPU is missing); the message says which."""


def peer_names() -> list[str]:
    return list(PEERS)


def run_peer(name: str, config, data, progress=None) -> dict:
    """Train `config` on `data` with peer `name` and return its run record."""
    try:
        target = PEERS[name]
    except KeyError:
        raise UsageError(f"unknown peer {name!r}; choose one of {', '.join(PEERS)}") from None
    module_name, function_name = target.split(":")
    module = importlib.import_module(f"graphtrain.peers.{module_name}")
    return getattr(module, function_name)(config, data, progress=progress)
