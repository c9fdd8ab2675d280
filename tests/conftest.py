import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    """The real MNIST: $GRAPHTRAIN_DATA, else the shared copy beside the checkout."""
    candidates = [os.environ.get("GRAPHTRAIN_DATA"), Path(__file__).resolve().parents[2] / "shared/data/mnist"]
    for folder in filter(None, candidates):
        if (Path(folder) / "train-images-idx3-ubyte.gz").exists() or (Path(folder) / "train-images-idx3-ubyte").exists():
            return Path(folder)
    pytest.skip("real MNIST not found: set GRAPHTRAIN_DATA to a folder with the four IDX files")


@pytest.fixture(scope="session")
def gpu_device():
    """The GPU, opened once; a skip saying why where there is none."""
    from graphtrain.errors import GpuUnavailableError
    from graphtrain.libs import cuda

    try:
        return cuda.open_device()
    except GpuUnavailableError as error:
        pytest.skip(f"no usable GPU: {error}")
