"""The rows graphtrain trains: the ladder's rungs in order, then the framework peers.

Every row is a `Stage` (graphtrain.stages.base), run by the same trainer with the same run plan.
A new rung is one new file here plus one line in `LADDER`; a peer is a module in
graphtrain/peers/ plus one line in `PEERS`. Modules are imported only when their row is used,
so the CPU stage and the CLI need no CUDA, torch or jax.
"""

from __future__ import annotations

import importlib

from graphtrain.errors import UsageError

# row name -> "module:Class", rungs in ladder order.
LADDER: dict[str, str] = {
    "numpy": "graphtrain.stages.numpy_cpu:NumpyStage",
    "baseline": "graphtrain.stages.baseline:BaselineStage",
    "fewer-syncs": "graphtrain.stages.fewer_syncs:FewerSyncsStage",
    "cublas": "graphtrain.stages.cublas_gemm:CublasStage",
    "sparse-metrics": "graphtrain.stages.sparse_metrics:SparseMetricsStage",
    "cudnn-softmax": "graphtrain.stages.cudnn_softmax:CudnnSoftmaxStage",
    "graphs": "graphtrain.stages.graphs:GraphsStage",
    "fused": "graphtrain.stages.fused:FusedStage",
    "bf16": "graphtrain.stages.bf16:Bf16Stage",
    "device-loop": "graphtrain.stages.device_loop:DeviceLoopStage",
    "persistent": "graphtrain.stages.persistent:PersistentStage",
}

# The ladder's chain runs from `baseline` to CHAIN_END, each rung deriving from the one before; the
# rungs after it are their own programs, composing the device pieces (graphtrain.stages.device)
# with their own kernels instead of inheriting a rung's setup.
CHAIN_END = "device-loop"

# The same workload trained by frameworks, in the order the ladder runs them.
PEERS: dict[str, str] = {
    "torch-eager": "graphtrain.peers.torch_eager:TorchEagerPeer",
    "torch-compile": "graphtrain.peers.torch_compile:TorchCompilePeer",
    "torch-graph": "graphtrain.peers.torch_graph:TorchGraphPeer",
    "jax-scan": "graphtrain.peers.jax_scan:JaxScanPeer",
    "torch-graph-bf16": "graphtrain.peers.torch_graph:TorchGraphBf16Peer",
    "jax-scan-bf16": "graphtrain.peers.jax_scan:JaxScanBf16Peer",
}

ROWS: dict[str, str] = {**LADDER, **PEERS}


def stage_names() -> list[str]:
    """The rungs, in ladder order."""
    return list(LADDER)


def peer_names() -> list[str]:
    return list(PEERS)


def row_names() -> list[str]:
    """Every row: the rungs, then the peers."""
    return list(ROWS)


def get_stage(name: str):
    """The `Stage` class of row `name`, a rung or a peer."""
    try:
        target = ROWS[name]
    except KeyError:
        raise UsageError(f"unknown stage {name!r}; choose one of {', '.join(ROWS)}") from None
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def check_names(stages: list[str], peers: list[str]) -> None:
    """Reject unknown rungs and peers, and an empty selection, before anything runs."""
    problems = []
    unknown_stages = [s for s in stages if s not in LADDER]
    unknown_peers = [p for p in peers if p not in PEERS]
    if unknown_stages:
        problems.append(f"unknown stage(s) {', '.join(unknown_stages)}; choose from {', '.join(LADDER)}")
    if unknown_peers:
        problems.append(f"unknown peer(s) {', '.join(unknown_peers)}; choose from {', '.join(PEERS)}")
    if not stages and not peers:
        problems.append("no stages and no peers to run")
    if problems:
        raise UsageError("; ".join(problems))
