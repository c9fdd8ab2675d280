"""The persistent softmax-regression kernel without a GPU: which inputs take the two-pass
products, the images as the kernel reads them, and that it compiles for each kind of shape."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from graphtrain.data import images as images_mod
from graphtrain.kernels.persistent import Persistent, Shape, kernel_images, pixel_levels

ELF_MAGIC = b"\x7fELF"




def test_8bit_pixels_are_found_and_given_to_the_kernel_as_integers(seed):
    pixels = np.random.default_rng(seed).integers(0, 256, size=(50, 28, 28), dtype=np.uint8)
    features = images_mod.to_features(pixels, "test")  # as every loader makes them: k / 255 in float32
    assert pixel_levels(features) == 255, f"seed {seed}"
    shape = Shape(784, 10, 128, pixel_levels=255)
    rows = kernel_images(features, shape)
    assert rows.shape == (50, shape.padded_features) and rows.dtype == np.float32
    assert np.array_equal(rows[:, :784], pixels.reshape(50, -1).astype(np.float32)), f"seed {seed}"
    assert not rows[:, 784:].any()


def test_the_bf16_build_reads_the_images_as_bf16(seed):
    """8-bit pixels as k, exact in bf16 (8 significant bits); other floats rounded to nearest even."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(20, 784), dtype=np.uint8)
    shape = Shape(784, 10, 128, 255, bf16=True)
    rows = kernel_images(images_mod.to_features(pixels.reshape(20, 28, 28), "test"), shape)
    assert rows.dtype == np.uint16 and rows.shape == (20, shape.padded_features)
    as_float = (rows[:, :784].astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(as_float, pixels.astype(np.float32)), f"seed {seed}"
    assert not rows[:, 784:].any()
    floats = rng.uniform(-1, 1, size=(20, 30)).astype(np.float32)
    rows = kernel_images(floats, Shape(30, 3, 16, bf16=True))
    back = (rows[:, :30].astype(np.uint32) << 16).view(np.float32)
    assert np.all(np.abs(back - floats) <= np.abs(floats) * 2.0**-8), f"seed {seed}"  # bf16: 8 significant bits
    assert not rows[:, 30:].any()


def test_other_floats_keep_the_three_pass_products(seed):
    features = np.random.default_rng(seed).uniform(0, 1, size=(50, 784)).astype(np.float32)
    assert pixel_levels(features) == 0, f"seed {seed}"
    almost = images_mod.to_features(np.full((2, 784), 7, np.uint8), "test")
    almost[1, 3] = np.nextafter(almost[1, 3], np.float32(1))  # one value a float ulp off 7/255
    assert pixel_levels(almost) == 0
    rows = kernel_images(features, Shape(784, 10, 128))
    assert np.array_equal(rows[:, :784], features), f"seed {seed}"


@pytest.mark.parametrize("shape", [
    Shape(784, 10, 128, 255), Shape(784, 10, 128), Shape(784, 10, 100), Shape(784, 10, 240, 255),
    Shape(30, 3, 16), Shape(784, 17, 64),
    Shape(784, 10, 128, 255, bf16=True), Shape(784, 10, 100, bf16=True), Shape(784, 10, 240, 255, bf16=True),
    Shape(30, 3, 16, bf16=True), Shape(784, 17, 64, bf16=True), Shape(784, 33 - 1, 32, bf16=True),
])
def test_the_kernel_compiles_for_every_kind_of_shape_it_takes(nvrtc_available, cache, shape):
    assert shape.refusal() is None
    assert Persistent.cubin("sm_90", shape.defines).startswith(ELF_MAGIC)


def load_script(name: str):
    path = next((Path(__file__).parents[1] / "scripts").rglob(f"{name}.py"))  # scripts/<purpose>/<name>.py
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_phase_cycles_build_compiles(nvrtc_available, cache):
    """scripts/persistent_phases.py's instrumented build: every line it stamps is still in the kernel."""
    module = load_script("persistent_phases")
    for bf16 in (True, False):
        assert module.PhaseCycles.cubin("sm_90", Shape(784, 10, 128, 255, bf16=bf16).defines).startswith(ELF_MAGIC)


def test_the_dsmem_exchange_benchmark_compiles(nvrtc_available, cache):
    """scripts/dsmem_exchange.py's kernel (its .cu beside it, kernels/cluster.cuh before it)."""
    assert load_script("dsmem_exchange").Exchange.cubin("sm_90").startswith(ELF_MAGIC)


def test_the_mma_rate_benchmark_compiles(nvrtc_available, cache):
    """scripts/mma_rate.py's kernel (its .cu beside it), for Ampere and Hopper."""
    for arch in ("sm_80", "sm_90"):
        assert load_script("mma_rate").MmaRate.cubin(arch).startswith(ELF_MAGIC)
