"""graphtrain: train MNIST-style classifiers on an NVIDIA GPU, rung by rung up the optimisation
ladder, from naive NVRTC kernels to whole training steps captured in CUDA Graphs.

    from graphtrain import train, TrainConfig
    record = train(TrainConfig(hidden=(784,)), stage="graphs")   # a RunRecord
"""

from graphtrain.config import PRESETS, TrainConfig
from graphtrain.plan import RunPlan
from graphtrain.record import RunRecord
from graphtrain.training import train

__version__ = "0.1.0"
__all__ = ["PRESETS", "RunPlan", "RunRecord", "TrainConfig", "train", "__version__"]
