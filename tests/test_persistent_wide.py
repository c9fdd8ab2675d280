"""The persistent rung's grid kernel (persistent_wide.cu) without a GPU: the grid it takes for each
width, what it refuses and why, that its two layout tables are the only place its memory is laid
out, that it compiles for each kind of shape, and which kernel the rung picks. With a GPU:
test_persistent_wide_gpu.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_persistent import load_script

from graphtrain.errors import ModelUnsupported
from graphtrain.kernels import KERNELS_DIR, persistent_wide
from graphtrain.kernels.persistent import ELEMENT_BYTES, MAX_SHARED_BYTES, Layout
from graphtrain.kernels.persistent_mlp import MlpShape
from graphtrain.kernels.persistent_wide import PHASES, VARIANTS, PersistentWide, WideShape
from graphtrain.stages.persistent import kernel_name, mlp_shape, products_note

ELF_MAGIC = b"\x7fELF"
JHU_784 = WideShape(784, (784,) * 3, 10, 128, 255)
STAGED = dataclasses.replace(JHU_784, variant="staged", split=1)


@pytest.mark.parametrize("width,blocks,padded", [
    (784, 98, 784), (1024, 128, 1024), (512, 64, 512), (257, 34, 272), (64, 8, 64), (72, 10, 80),
])
def test_clusters_of_two_blocks_of_8_units_and_the_grid_whole_k_steps_of_16(width, blocks, padded):
    """A cluster of two blocks owns 16 units, a k-step of 16, each block finishing 8 (257 units: 17
    clusters hold 272, the last 15 units padding); where the GPU runs no clusters, blocks of 8 units
    alone, which come in pairs for the same reason."""
    shape = WideShape(784, (width,) * 3, 10, 128, 255)
    assert shape.refusal() is None and shape.grid == (16, 2) and shape.defines["SPLIT"] == 2
    assert (shape.block_units, shape.blocks, shape.padded_hidden) == (8, blocks, padded)
    alone = dataclasses.replace(shape, clusters=False)
    assert alone.grid == (8, 1) and (alone.block_units, alone.blocks, alone.padded_hidden) == (8, blocks, padded)


def test_blocks_of_16_units_where_8_would_need_more_blocks_than_sms():
    """On a GPU of 60 SMs the 784³ MLP takes 49 blocks of 16 units alone (98 blocks of 8, alone or in
    clusters, do not fit the grid), which the shared memory holds at batch 128 with half the warps'
    partial sums at once; at 1024 units no grid fits."""
    shape = dataclasses.replace(JHU_784, sm_count=60)
    assert shape.refusal() is None and shape.grid == (16, 1) and (shape.block_units, shape.blocks) == (16, 49)
    assert shape.shared_bytes <= MAX_SHARED_BYTES and shape.defines["SLOTS"] == 4
    assert dataclasses.replace(shape, sm_count=132).defines["SLOTS"] == 8  # (98 blocks in clusters)
    wide = dataclasses.replace(shape, hidden=(1024,) * 3)
    assert "128 blocks of 8 units, one per SM, and the GPU has 60" in wide.refusal()
    assert "64 blocks of 16 units, one per SM, and the GPU has 60" in wide.refusal()
    assert dataclasses.replace(JHU_784, units=16, split=1).blocks == 49  # asked for
    assert dataclasses.replace(JHU_784, units=16).grid == (16, 2)


@pytest.mark.parametrize("shape,needles", [
    (WideShape(784, (2048,) * 3, 10, 128, 255), ["784-2048-2048-2048-10 MLP at batch 128 on a grid",
                                                 "256 blocks of 8 units, one per SM, and the GPU has 132",
                                                 "a block of 16 units needs"]),
    (WideShape(784, (784,) * 3, 10, 128, 255, bf16=False), ["in fp32: the grid kernel trains in bf16 only"]),
    (WideShape(784, (784, 512), 10, 128), ["784-784-512-10 MLP: its hidden layers must all have the same size"]),
    (WideShape(784, (784,), 40, 128), ["40 classes (at most 32"]),
    (WideShape(784, (1024,) * 3, 10, 128, units=16, split=1), ["a block of 16 units needs"]),
    (WideShape(784, (784,) * 3, 10, 128, units=8, split=2), ["clusters of 2 blocks share 8 units"]),
    (WideShape(784, (784,) * 3, 10, 128, split=2, clusters=False), ["the GPU runs no thread-block clusters"]),
    (WideShape(784, (784,) * 3, 10, 128, units=32), ["clusters of 32 units (8 or 16"]),
])
def test_a_shape_it_cannot_train_is_refused_with_the_reason(shape, needles):
    for needle in needles:
        assert needle in shape.refusal()


def test_the_784_cube_fits_in_every_grid():
    """The jhu preset's MLP: 98 blocks of 8 units alone (the fp32 masters of W_1's rows and of the
    other layers' columns, 77 KB, a unit's 784 inputs padded to 800, whole rows of the 32 banks, for
    the swizzle), 49 of 16 (the masters 154 KB), or 49 clusters of two (each block's masters its
    cluster's 16 units at its half of the inputs, 25 or 24 k-steps, rows of 416: 80 KB)."""
    for grid, blocks, stride in (((8, 1), 98, 800), ((16, 1), 49, 800), ((16, 2), 98, 416)):
        shape = dataclasses.replace(JHU_784, units=grid[0], split=grid[1])
        assert shape.refusal() is None and shape.grid == grid and shape.blocks == blocks
        masters = shape.layout.regions[1:3]
        assert [r.name for r in masters] == ["w1", "wc"]
        assert shape.strides["W1_STRIDE"] == shape.strides["WC_STRIDE"] == stride
        assert sum(r.count for r in masters) * 4 == grid[0] * 3 * stride * 4
        counts = {r.name: r.count for r in shape.layout.regions}
        assert counts["inbox"] == (2 * 128 * 8 if grid[1] == 2 else 0)  # a slot of rows × a block's units, two
        assert counts["inbox_full"] == (2 if grid[1] == 2 else 0)  # their mbarriers
    # the global copies of W_2 and W_3 (two each, by step parity) dominate the workspace
    assert JHU_784.workspace.bytes > 4 * 784 * 784 * 2


@pytest.mark.parametrize("shape", [
    JHU_784, dataclasses.replace(JHU_784, units=16, split=1), dataclasses.replace(JHU_784, split=1),
    dataclasses.replace(JHU_784, split=1, prefetch=3),
    WideShape(784, (1024,) * 3, 10, 128, 255),
    WideShape(784, (257,) * 3, 10, 128, 255), WideShape(784, (512,) * 3, 10, 32, 255), WideShape(784, (512,), 10, 128),
    WideShape(784, (257, 257), 10, 100, 255), WideShape(30, (72,) * 4, 3, 16), WideShape(784, (64,) * 2, 32, 40, 255),
])
def test_the_kernel_compiles_for_every_kind_of_shape_it_takes(nvrtc_available, cache, shape):
    """Widths 257 to 1024, clusters of two blocks, blocks of 8 and 16 units alone, one to four layers,
    batches of whole and part tiles of 16 rows, 8-bit pixels and floats, few classes and 32."""
    assert shape.refusal() is None
    assert PersistentWide.cubin("sm_90", shape.defines).startswith(ELF_MAGIC)


@pytest.mark.parametrize("table,region,prefix,variant", [
    ("layout", "ht", "SMEM_", "registers"), ("layout", "part", "SMEM_", "registers"), ("layout", "inbox", "SMEM_", "registers"),
    ("layout", "inbox_full", "SMEM_", "registers"),
    ("workspace", "grad", "WS_", "registers"), ("workspace", "x", "WS_", "registers"), ("layout", "dl", "SMEM_", "staged"),
    ("layout", "stage", "SMEM_", "staged"),
])
def test_one_table_gives_the_launch_sizes_and_the_kernel_offsets(nvrtc_available, cache, monkeypatch, table, region,
                                                                 prefix, variant):
    """Each of the kernel's memories is laid out in one place: grow a region of its table, and the
    bytes the launcher launches with (shared memory) or allocates (the workspace) and the offsets
    the kernel is compiled with all move by the region's size, and the kernel compiled from them
    changes (in the staged build too, whose rings follow the other regions)."""
    shape = WideShape(784, (257,) * 3, 10, 128, 255, variant=variant)
    before, plain_defines = getattr(shape, table), shape.defines
    plain = PersistentWide.cubin("sm_90", plain_defines)
    grown = Layout([dataclasses.replace(r, count=r.count + 512) if r.name == region else r for r in before.regions])
    monkeypatch.setattr(WideShape, table, property(lambda self: grown))
    moved = 512 * ELEMENT_BYTES[next(r.ctype for r in before.regions if r.name == region)]
    if table == "layout":
        assert shape.shared_bytes == before.bytes + moved == shape.defines["SMEM_BYTES"]
    else:
        assert shape.workspace.bytes == before.bytes + moved
    names = [r.name for r in before.regions]
    for name in names:
        shift = moved if names.index(name) > names.index(region) else 0
        key = f"{prefix}{name.upper()}"
        assert shape.defines[key] == plain_defines[key] + shift, name
    assert PersistentWide.cubin("sm_90", shape.defines) != plain


def test_the_rung_takes_the_grid_kernel_where_the_cluster_kernel_refuses():
    """The cluster kernel where it fits one cluster (H = 128 and 256 at batch 32); the grid kernel
    for what it refuses for its shared memory (the 784³ MLP, H = 512 at batch 32) or for a width
    off its tiles (257); both reasons where neither trains the model."""
    cluster = MlpShape(784, (256,) * 3, 10, 32, 255, bf16=True)
    assert mlp_shape(cluster, 132) is cluster and kernel_name(cluster) == "cluster"
    for hidden, batch in (((784,) * 3, 128), ((784,) * 3, 32), ((512,) * 3, 32), ((257,) * 3, 128)):
        shape = mlp_shape(MlpShape(784, hidden, 10, batch, 255, bf16=True), 132)
        assert isinstance(shape, WideShape) and kernel_name(shape) == "grid", hidden
        assert (shape.hidden, shape.batch, shape.pixel_levels) == (hidden, batch, 255)
    assert products_note(JHU_784) == ("bf16 mma, one pass, fp32 sums and master weights; the head fp32; a grid "
                                      "of 98 blocks of 8 units in clusters of 2 (each block multiplying 1/2 of a "
                                      "product's inputs for the cluster's 16 units)")
    alone = dataclasses.replace(JHU_784, split=1)
    assert products_note(alone).endswith("a grid of 98 blocks of 8 units; loads 2 k-steps ahead")
    assert products_note(dataclasses.replace(alone, prefetch=1)).endswith("a grid of 98 blocks of 8 units")
    fp32 = MlpShape(784, (784,) * 3, 10, 128, 255)
    with pytest.raises(ModelUnsupported, match=r"784-784-784-784-10 MLP at batch 128: a block needs \d+ bytes of "
                                               r"shared memory .*, nor can its grid kernel: .* in bf16 only"):
        mlp_shape(fp32, 132)
    assert mlp_shape(fp32, 132, refuse=False) is fp32
    with pytest.raises(ModelUnsupported, match=r"nor can its grid kernel: .*256 blocks of 8 units, one per SM, and "
                                               r"the GPU has 132"):
        mlp_shape(MlpShape(784, (2048,) * 3, 10, 128, 255, bf16=True), 132)


def test_the_grid_choices_are_tried_in_order(monkeypatch):
    """GRID_CHOICES decides between grids that all fit (the check script times each): clusters of two
    first, then blocks of 8 units alone, then of 16; a shape's units or split narrows the choice."""
    assert JHU_784.grid == (16, 2)
    monkeypatch.setattr(persistent_wide, "GRID_CHOICES", ((16, 1), (8, 1)))
    assert JHU_784.grid == (16, 1) and JHU_784.blocks == 49
    assert WideShape(784, (1024,) * 3, 10, 128, 255).grid == (8, 1)  # 16 units alone do not fit its shared memory
    assert dataclasses.replace(JHU_784, units=8).grid == (8, 1)


@pytest.mark.parametrize("shape,depth", [
    (STAGED, 2), (dataclasses.replace(STAGED, hidden=(1024,) * 3), 2),
    (dataclasses.replace(STAGED, hidden=(512,) * 3, batch=32), 7),
    (WideShape(784, (257, 257), 10, 100, 255, variant="staged"), 3), (WideShape(30, (72,) * 4, 3, 16, variant="staged"), 2),
    (WideShape(784, (64,) * 2, 32, 40, 255, variant="staged"), 4), (WideShape(784, (512,), 10, 128, variant="staged"), 3),
])
def test_the_staged_build_compiles_with_the_deepest_rings_that_fit(nvrtc_available, cache, shape, depth):
    """The staged build's rings: as many slabs a warp as fit beside the rest of the shared memory (the
    784³ MLP at batch 128 in blocks of 8 units alone: two, beside every warp's partial sums; 1024
    units: two), at most the k-steps a warp takes (49 k-steps of 784 inputs: seven; a block of a
    cluster takes 25 of them: four); its layout ends with them, and it compiles for each kind of shape."""
    assert shape.refusal() is None and shape.stage_depth == depth == shape.defines["STAGE_DEPTH"]
    plain = dataclasses.replace(shape, variant="registers")
    assert plain.defines["STAGE_DEPTH"] == 0 and "stage" not in plain.layout.offsets
    rings = shape.layout.regions[-1]
    assert rings.name == "stage" and rings.count == 8 * depth * (shape.rows16 + shape.cluster_units) * 16
    assert shape.shared_bytes <= MAX_SHARED_BYTES
    assert shape.layout.offsets["stage"] == plain.layout.bytes  # the registers build's regions unmoved
    assert PersistentWide.cubin("sm_90", shape.defines).startswith(ELF_MAGIC)


def test_the_staged_build_takes_what_fits_and_refuses_what_does_not(monkeypatch):
    """Its rings do not fit beside the masters of blocks of 16 units at 784 (nor at 1024): asked for
    16 units it is refused for its shared memory, and tried after 8 it takes blocks of 8."""
    assert "a block of 16 units needs" in dataclasses.replace(STAGED, units=16).refusal()
    monkeypatch.setattr(persistent_wide, "GRID_CHOICES", ((16, 1), (8, 1)))
    assert STAGED.block_units == 8 and dataclasses.replace(JHU_784, variant="registers").block_units == 16
    assert dataclasses.replace(STAGED, stage_slabs=2).stage_depth == 2
    with pytest.raises(ValueError, match="at least 2"):
        _ = dataclasses.replace(STAGED, stage_slabs=1).stage_depth
    with pytest.raises(ValueError, match="no grid kernel variant 'tma'"):
        _ = dataclasses.replace(JHU_784, variant="tma").defines


def test_the_default_variant_is_the_rungs(monkeypatch):
    """A shape that names no variant takes DEFAULT_VARIANT when used, as the rung's shapes do, and
    the run's record says how its operands were loaded."""
    assert persistent_wide.DEFAULT_VARIANT in VARIANTS
    shape = mlp_shape(MlpShape(784, (784,) * 3, 10, 128, 255, bf16=True), 132)
    monkeypatch.setattr(persistent_wide, "DEFAULT_VARIANT", "staged")
    assert shape.build == "staged" and shape.stage_depth == 2
    assert products_note(shape).endswith("a grid of 98 blocks of 8 units in clusters of 2 (each block multiplying 1/2 "
                                         "of a product's inputs for the cluster's 16 units); k-steps staged in rings of 2")
    monkeypatch.setattr(persistent_wide, "DEFAULT_VARIANT", "registers")
    alone = dataclasses.replace(shape, split=1)
    assert alone.stage_depth == 0 and products_note(alone).endswith(f"of 8 units; loads {alone.prefetch_depth} k-steps ahead")


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_probe_build_compiles(nvrtc_available, cache, variant):
    """scripts/probes/persistent_wide_phases.py's build: the kernel with -DPROBES (probes.cuh, block 0
    of the grid probing), a slot for every phase of the launcher's PHASES, their counts at the end
    of its shared memory; the plain build has no probe code."""
    shape = dataclasses.replace(JHU_784, variant=variant)
    plain, probed = PersistentWide.build_layout(shape), PersistentWide.build_layout(shape, probes=True)
    assert probed.bytes == plain.bytes + 8 * len(PHASES) * 4 and probed.offsets["probe_counts"] == plain.bytes
    assert probed.bytes <= MAX_SHARED_BYTES
    defines = PersistentWide.build_defines(shape, probes=True)
    assert defines["SMEM_BYTES"] == probed.bytes and "PROBES" not in PersistentWide.build_defines(shape)
    cubin = PersistentWide.cubin("sm_90", defines)
    assert cubin.startswith(ELF_MAGIC) and cubin != PersistentWide.cubin("sm_90", shape.defines)


def test_every_phase_is_probed_in_the_kernel():
    """Each of PHASES ends somewhere in the kernel (a slot the kernel never counts would print as
    nothing), and the kernel counts no phase the list lacks (that would not compile)."""
    source = (KERNELS_DIR / "persistent_wide.cu").read_text()
    for name, _ in PHASES:
        assert f"PROBE_END(probes, {name}," in source or f"PHASE_END(probes, {name}," in source, name


def test_the_phase_script_prints_a_column_per_build():
    module = load_script("persistent_wide_phases")
    steps, layers = 4, 3
    tables = {v: np.zeros((len(PHASES), layers + 1), np.int64) for v in ("registers", "staged")}
    tables["registers"][0, 1], tables["staged"][0, 1], tables["staged"][3, 3] = 4000, 2000, 400
    rows = module.phase_rows(tables, steps)
    assert rows[0] == "| phase (block 0) | layer | registers | staged |"
    assert f"| {PHASES[0][1]} | 1 | 1000 | 500 |" in rows and f"| {PHASES[3][1]} | 3 | 0 | 100 |" in rows
    assert rows[-1] == "| **step** | | **1000** | **600** |" and len(rows) == 5


def test_the_check_script_names_its_parts(tmp_path):
    """scripts/checks/wide_persistent.py runs the parts it is given (the sweep only when named), and
    refuses a part it lacks before running any, with one line."""
    module = load_script("wide_persistent")
    assert "sweep" in module.PARTS and "sweep" not in module.DEFAULT_PARTS
    assert set(module.DEFAULT_PARTS) < set(module.PARTS)
    assert module.SWEEP[:2] == ["sweep", "--preset"] and "jax-scan" in module.SWEEP
    proc = subprocess.run([sys.executable, str(Path(module.__file__)), str(tmp_path / "out"), "timing", "nope"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr == "error: no part nope (the parts: " + ", ".join(module.PARTS) + ")\n"
    assert not (tmp_path / "out").exists()


def test_the_default_prefetch_holds_as_many_registers_at_any_batch(monkeypatch):
    """DEFAULT_PREFETCH 0 (the rung's): in blocks of 8 units alone two k-steps ahead at batch 128, the
    depth measured best there; at batch 32 the same registers hold eight, no more than a warp's
    k-steps of the widest product less one (1024 units: 64 k-steps, 8 a warp: 7; 512: the images' 49,
    7 a warp: 6). Clusters of 16 units hold a second mma column's sums: one k-step ahead at batch 128
    (two spilled), and at batch 32 a block's 32 or 25 k-steps, 4 a warp: 3. A shape's prefetch, or a
    positive DEFAULT_PREFETCH, sets the depth; the staged build loads one."""
    depth = lambda hidden, batch, **kw: WideShape(784, hidden, 10, batch, 255, **kw).prefetch_depth
    assert depth((784,) * 3, 128, split=1) == depth((1024,) * 3, 128, split=1) == 2
    assert depth((1024,) * 3, 32, split=1) == 7 and depth((512,) * 3, 32, split=1) == 6
    assert depth((784,) * 4, 64, split=1) == 4
    assert depth((784,) * 3, 128) == depth((1024,) * 3, 128) == 1 and depth((1024,) * 3, 32) == depth((512,) * 3, 32) == 3
    assert persistent_wide.prefetch_for(16, 1000) == 16 and persistent_wide.prefetch_for(128, 8) == 1
    assert persistent_wide.prefetch_for(16, 1000, units=16) == 15
    assert depth((1024,) * 3, 32, prefetch=3) == 3 and depth((1024,) * 3, 32, variant="staged") == 1
    monkeypatch.setattr(persistent_wide, "DEFAULT_PREFETCH", 1)
    assert depth((1024,) * 3, 32) == depth((784,) * 3, 128) == 1
