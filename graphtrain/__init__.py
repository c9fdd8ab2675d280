"""graphtrain: train MNIST-style classifiers on an NVIDIA GPU, rung by rung up the optimisation
ladder, from naive NVRTC kernels to whole training steps captured in CUDA Graphs.

    from graphtrain import train, TrainConfig, save
    record = train(TrainConfig(hidden=(784,)), stage="graphs")   # a RunRecord
    save("model.safetensors", record)          # load(path), to_torch(path) read it back
"""

from graphtrain.config import PRESETS, TrainConfig
from graphtrain.data import Dataset
from graphtrain.model_io import Model, load, save, to_torch
from graphtrain.plan import RunPlan
from graphtrain.record import RunRecord
from graphtrain.training import train

__version__ = "0.1.0"
__all__ = ["PRESETS", "Dataset", "Model", "RunPlan", "RunRecord", "TrainConfig", "load", "save", "to_torch",
           "train", "__version__"]
