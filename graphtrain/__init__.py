"""graphtrain: train MNIST-style classifiers on an NVIDIA GPU, rung by rung up the optimisation
ladder, from naive NVRTC kernels to whole training steps captured in CUDA Graphs.

    from graphtrain import train, TrainConfig
    record = train(TrainConfig(hidden=(784,)), stage="graphs")
"""

from graphtrain.config import PRESETS, TrainConfig
from graphtrain.training import train

__version__ = "0.1.0"
__all__ = ["PRESETS", "TrainConfig", "train", "__version__"]
