"""graphtrain: train MNIST-style classifiers on an NVIDIA GPU, rung by rung up the optimisation
ladder, from naive NVRTC kernels to whole training steps captured in CUDA Graphs.

    from graphtrain import train, TrainConfig, save
    record = train(TrainConfig(hidden=(784,)), stage="graphs")   # a RunRecord
    save("model.safetensors", record)          # load(path), to_torch(path) read it back
    load("model.safetensors").predict(images)  # the class of each image (uint8 0-255 or floats 0-1)
"""

from __future__ import annotations

import importlib

# The public names and the modules that define them, imported on first use: `import graphtrain`
# (and so the `graphtrain` command, see __main__.py) loads no numpy until something needs it.
_EXPORTS = {
    "PRESETS": "graphtrain.config", "TrainConfig": "graphtrain.config", "Dataset": "graphtrain.data",
    "Model": "graphtrain.model_io", "load": "graphtrain.model_io", "save": "graphtrain.model_io",
    "to_torch": "graphtrain.model_io", "RunPlan": "graphtrain.plan", "RunRecord": "graphtrain.record",
    "train": "graphtrain.training",
}

__version__ = "0.1.0"
__all__ = ["PRESETS", "Dataset", "Model", "RunPlan", "RunRecord", "TrainConfig", "load", "save", "to_torch",
           "train", "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'graphtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
