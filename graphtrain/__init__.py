"""graphtrain: train MNIST-style classifiers on an NVIDIA GPU, rung by rung up the optimisation
ladder, from naive NVRTC kernels to whole training steps captured in CUDA Graphs.

    from graphtrain import train, TrainConfig, save
    record = train(TrainConfig(hidden=(784,)), stage="graphs")   # a RunRecord
    save("model.safetensors", record)          # load(path), to_torch(path) read it back

The names below are imported when first used, so that `import graphtrain` (and with it every
`graphtrain` command) starts without loading numpy and the trainer until they are needed.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "PRESETS": "graphtrain.config", "TrainConfig": "graphtrain.config", "Dataset": "graphtrain.data",
    "Model": "graphtrain.model_io", "load": "graphtrain.model_io", "save": "graphtrain.model_io",
    "to_torch": "graphtrain.model_io", "RunPlan": "graphtrain.plan", "RunRecord": "graphtrain.record",
    "train": "graphtrain.training",
}
__all__ = [*sorted(_EXPORTS), "__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'graphtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
