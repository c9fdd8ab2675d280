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


@pytest.fixture(scope="session")
def nvrtc_available() -> str:
    """NVRTC's version; a skip saying why where it cannot be imported or loaded."""
    from graphtrain.errors import GpuUnavailableError
    from graphtrain.libs import nvrtc

    try:
        import cuda.bindings.nvrtc  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"cuda.bindings.nvrtc cannot be imported: {exc}")
    try:
        return nvrtc.version()
    except GpuUnavailableError as exc:
        pytest.skip(f"libnvrtc cannot be loaded: {exc}")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh kernel cache folder for the test ($GRAPHTRAIN_CACHE)."""
    folder = tmp_path / "kernel-cache"
    monkeypatch.setenv("GRAPHTRAIN_CACHE", str(folder))
    return folder
