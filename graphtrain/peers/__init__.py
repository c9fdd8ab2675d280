"""Peers: the same workload trained by frameworks, timed with the same protocol as the stages.

Each peer is a `Stage` (graphtrain.peers.common.Peer; the cnn's classes in torch_cnn.py and
jax_cnn.py, graphtrain.stages.cnn_rungs.CnnStage), listed in `graphtrain.stages.PEERS` and run by
the same trainers (run, ladder, sweep, speedrun) with the same run plan: it trains the model from `plan.initial` in the
order of `plan.orders`, with the whole dataset preloaded on the GPU, so its loss curve overlays
the stages'. Its record has "kind": "peer" and a "note" on what it uses (precision, compile mode).

The frameworks are optional: they are imported only when a peer runs, and a missing one (or a
missing GPU) raises `PeerUnavailable`, which the ladder shows as a skipped row.
"""

from __future__ import annotations

from graphtrain.errors import MissingRequirement


class PeerUnavailable(MissingRequirement):
    """The peer cannot run here (its framework or a GPU is missing); the message says which."""
