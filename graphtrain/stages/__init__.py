"""The ladder: one module per rung, in the order each adds its idea to the one before.

A new rung is one new file here plus one line in `LADDER`. Modules are imported only when a
stage is used, so the CPU stage needs no CUDA packages.
"""

from __future__ import annotations

import importlib

from graphtrain.errors import UsageError

# stage name -> "module:Class", in ladder order.
LADDER: dict[str, str] = {
    "numpy": "numpy_cpu:NumpyStage",
    "baseline": "baseline:BaselineStage",
    "fewer-syncs": "fewer_syncs:FewerSyncsStage",
    "cublas": "cublas_gemm:CublasStage",
    "sparse-metrics": "sparse_metrics:SparseMetricsStage",
    "cudnn-softmax": "cudnn_softmax:CudnnSoftmaxStage",
    "graphs": "graphs:GraphsStage",
    "fused": "fused:FusedStage",
    "bf16": "bf16:Bf16Stage",
    "device-loop": "device_loop:DeviceLoopStage",
    "persistent": "persistent:PersistentStage",
}


def stage_names() -> list[str]:
    return list(LADDER)


def get_stage(name: str):
    try:
        target = LADDER[name]
    except KeyError:
        raise UsageError(f"unknown stage {name!r}; choose one of {', '.join(LADDER)}") from None
    module_name, class_name = target.split(":")
    module = importlib.import_module(f"graphtrain.stages.{module_name}")
    return getattr(module, class_name)
