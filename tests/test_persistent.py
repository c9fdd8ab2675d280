"""The persistent softmax-regression kernel without a GPU: which inputs take the two-pass
products, the images as the kernel reads them, and that it compiles for each kind of shape."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from graphtrain.data import images as images_mod
from graphtrain.kernels.persistent import (ELEMENT_BYTES, Layout, Persistent, Region, Shape, kernel_images,
                                          pixel_levels)
from graphtrain.kernels.persistent_mlp import MlpShape, PersistentMlp

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


@pytest.mark.parametrize("launcher,shape,region", [
    (Persistent, Shape(784, 10, 128, 255, bf16=True), "inbox"), (Persistent, Shape(784, 10, 128, 255), "inbox"),
    (PersistentMlp, MlpShape(784, (128,) * 3, 10, 32, 255, bf16=True), "dh"),
    (PersistentMlp, MlpShape(784, (128,) * 3, 10, 32, 255), "dh"),
])
def test_one_table_gives_the_launch_size_and_the_kernel_offsets(nvrtc_available, cache, monkeypatch, launcher, shape,
                                                                 region):
    """A shape's layout is the only place its kernel's shared memory is laid out: grow one buffer
    there, and the launcher's byte count and the offsets the kernel is compiled with both move by its
    size, and the kernel compiled from them changes."""
    before, plain_defines = shape.layout, shape.defines
    plain = launcher.cubin("sm_90", plain_defines)
    grown = Layout([dataclasses.replace(r, count=r.count + 64) if r.name == region else r for r in before.regions])
    monkeypatch.setattr(type(shape), "layout", property(lambda self: grown))
    moved = 64 * ELEMENT_BYTES[next(r.ctype for r in before.regions if r.name == region)]
    assert shape.shared_bytes == before.bytes + moved == shape.defines["SMEM_BYTES"]
    names = [r.name for r in before.regions]
    for name in names:
        shift = moved if names.index(name) > names.index(region) else 0
        assert shape.defines[f"SMEM_{name.upper()}"] == plain_defines[f"SMEM_{name.upper()}"] + shift, name
    assert launcher.cubin("sm_90", shape.defines) != plain


def test_a_layout_aligns_each_region_and_sums_the_bytes():
    layout = Layout([Region("a", "unsigned char", 3), Region("b", "float", 2), Region("c", "unsigned short", 1, 16),
                     Region("d", "double", 0)])
    assert layout.offsets == {"a": 0, "b": 4, "c": 16, "d": 24} and layout.bytes == 24
    assert layout.defines["SMEM_C"] == 16 and layout.defines["SMEM_B_ELEMENT"] == 4 and layout.defines["SMEM_BYTES"] == 24


def load_script(name: str):
    path = next((Path(__file__).parents[1] / "scripts").rglob(f"{name}.py"))  # scripts/<purpose>/<name>.py
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_probe_build_compiles(nvrtc_available, cache):
    """scripts/probes/persistent_phases.py's build: the kernel with -DPROBES (probes.cuh), a slot for every
    stamp it makes from the launcher's STAMPS; the plain build has no probe code."""
    for bf16 in (True, False):
        shape = Shape(784, 10, 128, 255, bf16=bf16)
        probed = Persistent.cubin("sm_90", Persistent.build_defines(shape, probes=True))
        assert probed.startswith(ELF_MAGIC) and probed != Persistent.cubin("sm_90", shape.defines)
    assert "PROBE_STEPS" not in Persistent.build_defines(shape)


def test_the_phase_script_reads_the_stamps_it_names():
    module = load_script("persistent_phases")
    assert module.STAMPS and module.PROBE_STEPS >= 16


def test_the_dsmem_exchange_benchmark_compiles(nvrtc_available, cache):
    """scripts/dsmem_exchange.py's kernel (its .cu beside it, kernels/cluster.cuh before it)."""
    assert load_script("dsmem_exchange").Exchange.cubin("sm_90").startswith(ELF_MAGIC)


def test_the_mma_rate_benchmark_compiles(nvrtc_available, cache):
    """scripts/mma_rate.py's kernel (its .cu beside it), for Ampere and Hopper."""
    for arch in ("sm_80", "sm_90"):
        assert load_script("mma_rate").MmaRate.cubin(arch).startswith(ELF_MAGIC)


def test_the_rung_and_a_pack_refuse_and_describe_a_kernel_alike():
    """The checks and the record's note that the persistent rung and a packed sweep share."""
    from graphtrain.errors import ModelUnsupported
    from graphtrain.libs import cuda
    from graphtrain.stages.persistent import products_note, refuse_unless_trains, require_clusters

    def gpu(cc):
        return cuda.DeviceInfo(ordinal=0, name="GPU", compute_capability=cc, arch=f"sm_{cc[0]}{cc[1]}", sm_count=132,
                               total_memory=80 << 30, driver_cuda_version="13.0", runtime_version="13.0",
                               sm_shared_bytes=228 * 1024, sm_registers=64 * 1024, sm_threads=2048)

    require_clusters(gpu((9, 0)))
    with pytest.raises(ModelUnsupported, match="compute capability 9.0.*has 8.0"):
        require_clusters(gpu((8, 0)))
    refuse_unless_trains(Shape(784, 10, 128))
    with pytest.raises(ModelUnsupported, match="cannot train 40 classes"):
        refuse_unless_trains(Shape(784, 40, 128))
    assert products_note(Shape(784, 10, 128, bf16=True)).endswith("dlogits sent as bf16")
    assert products_note(Shape(784, 10, 128, 255)).startswith("3xTF32 mma; 8-bit inputs")
    assert products_note(Shape(784, 10, 128)) == "3xTF32 mma: three passes"
    assert products_note(MlpShape(784, (256,) * 3, 10, 32, 255, bf16=True)).endswith("the head 3xTF32")
