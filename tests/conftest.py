"""Fixtures for every test, and the layout's one rule: a test that needs a GPU lives in a file
named `*_gpu.py`, and every test in such a file is marked `gpu` and opens the GPU through the one
`gpu_device` fixture (skipped, with the reason, where there is none). Every other file is CPU-only:
a `gpu` mark there is an error at collection. So `pytest -m gpu` runs exactly the `*_gpu.py` files
and `pytest -m "not gpu"` everything else.

Seeds are fixed: a test that draws random inputs takes the `seed` fixture (a number derived from
the test's name, the same on every run), and a failing test prints it."""

import os
import zlib
from pathlib import Path

import pytest

# XLA picks a convolution's cuDNN algorithm by timing the candidates, afresh in each process; the
# JAX peers' tests compare a vmapped pack with the same model jitted alone, and two timings can pick
# algorithms that round differently. With autotuning off XLA takes the same algorithm every run.
# Set before any test imports jax.
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), "--xla_gpu_autotune_level=0"]))


def is_gpu_file(path) -> bool:
    return Path(str(path)).name.endswith("_gpu.py")


def pytest_collection_modifyitems(config, items):
    misplaced = []
    for item in items:
        if is_gpu_file(item.path):
            item.add_marker(pytest.mark.gpu)
            if "gpu_device" not in item.fixturenames:  # first, so a missing GPU skips before anything else
                item.fixturenames.insert(0, "gpu_device")
        elif item.get_closest_marker("gpu"):
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError("tests marked gpu outside a *_gpu.py file (move them into one): "
                                + ", ".join(misplaced))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and "seed" in getattr(item, "funcargs", {}):
        report.sections.append(("seed", f"{item.nodeid} ran with seed {item.funcargs['seed']}"))


@pytest.fixture
def seed(request) -> int:
    """This test's fixed seed: the same on every run, different between tests (and parameters)."""
    return zlib.crc32(request.node.name.encode()) & 0xFFFF
SHARED_MNIST = Path(__file__).resolve().parents[2] / "shared/data/mnist"


def real_mnist(given: str | None = None) -> tuple[Path | None, str]:
    """(folder, "") where the real MNIST is at hand, else (None, why not): the folder
    $GRAPHTRAIN_DATA (or `given`) names when it is set (a folder that does not exist, or lacks the files, is
    a reason to skip, never an error), else the shared copy beside the checkout."""
    from graphtrain import data

    given = given if given is not None else os.environ.get("GRAPHTRAIN_DATA")
    folder = Path(given) if given else SHARED_MNIST
    where = f"GRAPHTRAIN_DATA={given}" if given else f"no GRAPHTRAIN_DATA, and {folder}"
    if not folder.is_dir():
        return None, f"real MNIST not found: {where} is not a folder (set GRAPHTRAIN_DATA to a folder with the four IDX files)"
    lookup = data.find_files("mnist", data_dir=folder)
    if not lookup.complete:
        return None, f"real MNIST not found: {where} lacks {', '.join(lookup.missing)}"
    return lookup.folder, ""


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    """The real MNIST folder (see `real_mnist`); a skip saying why where there is none."""
    folder, reason = real_mnist()
    if folder is None:
        pytest.skip(reason)
    return folder


@pytest.fixture(scope="session")
def gpu_device():
    """The GPU, opened once for the session; a skip saying why where there is none."""
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
