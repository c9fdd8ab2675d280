"""The persistent rung's cnn kernel (persistent_cnn.cu) without a GPU: the shapes it takes and those it
refuses (with the reason, before the GPU is opened), the one table of each of its memories, and its
compilation for sm_90. Its steps run on the CPU in test_persistent_cnn_emulated.py, on a GPU in
test_persistent_cnn_gpu.py."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from graphtrain import config
from graphtrain.config import cnn_spec
from graphtrain.errors import ModelUnsupported
from graphtrain.kernels.persistent import MAX_SHARED_BYTES
from graphtrain.kernels import KERNELS_DIR
from graphtrain.kernels.persistent_cnn import PHASES, CnnShape, PersistentCnn, problems_of
from graphtrain.reference_cnn import CnnSpec, ConvLayer
from graphtrain.stages import trainer_of
from graphtrain.stages.cnn_persistent import cnn_refusal

ELF_MAGIC = b"\x7fELF"
SPEEDRUN = CnnShape(28, 24, 5, 32, 3, 256, 10, 256)


def test_the_speedrun_cnn_is_the_shape_of_its_preset():
    spec = cnn_spec(config.preset("speedrun"))
    shape = CnnShape.of(spec, 256, "tf32")
    assert shape == SPEEDRUN and shape.refusal() is None and not problems_of(spec)
    assert (shape.conv1_side, shape.pooled1, shape.conv2_side, shape.pooled2, shape.flat) == (24, 12, 10, 5, 800)
    assert shape.num_params == sum(math.prod(s) for s in spec.param_shapes())
    assert CnnShape.of(spec, 256, "fp32").passes == 3 and shape.passes == 1


@pytest.mark.parametrize("spec,needle", [
    (CnnSpec((ConvLayer(24, 5),), (256,)), "1 conv layers (exactly two)"),
    (CnnSpec((ConvLayer(8, 3),) * 3, (64,)), "3 conv layers"),
    (CnnSpec((ConvLayer(24, 5, stride=2), ConvLayer(32, 3)), (256,)), "conv layer 1 of stride 2"),
    (CnnSpec((ConvLayer(24, 5), ConvLayer(32, 3, padding=1)), (256,)), "conv layer 2 of stride 1, padding 1"),
    (CnnSpec((ConvLayer(24, 5), ConvLayer(32, 3)), (256, 128)), "2 hidden linear layers"),
    (CnnSpec((ConvLayer(24, 5), ConvLayer(32, 3)), (256,), channels=3), "3-channel 28×28 images"),
    (CnnSpec((ConvLayer(24, 4), ConvLayer(32, 3)), (256,)), "even sides only"),  # 25×25 after conv 1
    (CnnSpec((ConvLayer(24, 5), ConvLayer(32, 3)), (256,), classes=40), "40 classes"),
    (CnnSpec((ConvLayer(128, 5), ConvLayer(64, 3)), (256,)), "bytes of shared memory"),
])
def test_a_cnn_it_cannot_hold_is_refused_with_the_reason(spec, needle):
    refusal = cnn_refusal(spec, 256, "tf32")
    assert refusal is not None and needle in refusal, refusal


def test_close_variants_are_held():
    """Other widths, kernels, batches and class counts of the speedrun's kind of cnn."""
    for spec, batch in [(CnnSpec((ConvLayer(16, 5), ConvLayer(64, 3)), (128,)), 128),
                        (CnnSpec((ConvLayer(16, 5), ConvLayer(32, 5)), (300,), classes=32), 100),
                        (CnnSpec((ConvLayer(32, 5), ConvLayer(48, 3)), (512,)), 512)]:
        assert cnn_refusal(spec, batch, "tf32") is None
        assert CnnShape.of(spec, batch, "tf32").shared_bytes <= MAX_SHARED_BYTES


def test_the_rung_refuses_before_the_gpu_is_opened(monkeypatch):
    """A cnn the kernel cannot hold is refused in setup before any device work (the device is
    never opened here: opening it would fail on a machine without a GPU with another message)."""
    from graphtrain.libs import cuda
    from graphtrain.plan import RunPlan

    monkeypatch.setattr(cuda, "open_device", lambda *a, **k: pytest.fail("the device was opened"))
    cfg = config.preset("speedrun").replace(conv=((24, 5), (32, 3), (16, 3)))
    plan = RunPlan.build(cfg, 512, 128, 784, 10)
    stage = trainer_of("persistent", "cnn").load()(plan, None)
    with pytest.raises(ModelUnsupported, match="3 conv layers"):
        stage.setup()


@pytest.mark.parametrize("shape", [
    SPEEDRUN, dataclasses.replace(SPEEDRUN, passes=3), dataclasses.replace(SPEEDRUN, batch=100, blocks=114),
    CnnShape(28, 16, 5, 64, 3, 128, 10, 128), CnnShape(14, 4, 3, 6, 3, 40, 32, 8, passes=3, blocks=4),
])
def test_the_kernel_compiles_for_sm_90(nvrtc_available, cache, shape):
    assert shape.refusal() is None
    assert PersistentCnn.cubin("sm_90", shape.defines).startswith(ELF_MAGIC)


@pytest.mark.parametrize("table,region,prefix", [("layout", "work", "SMEM_"), ("workspace", "h", "WS_")])
def test_one_table_gives_the_launch_sizes_and_the_kernel_offsets(nvrtc_available, cache, monkeypatch, table, region,
                                                                 prefix):
    """Grow a region of a table: the bytes launched with or allocated, and every later region's
    offset the kernel is compiled with, move by its size, and the compiled kernel changes."""
    from graphtrain.kernels.persistent import ELEMENT_BYTES, Layout

    before, plain_defines = getattr(SPEEDRUN, table), SPEEDRUN.defines
    plain = PersistentCnn.cubin("sm_90", plain_defines)
    grown = Layout([dataclasses.replace(r, count=r.count + 512) if r.name == region else r for r in before.regions])
    monkeypatch.setattr(CnnShape, table, property(lambda self: grown))
    moved = 512 * ELEMENT_BYTES[next(r.ctype for r in before.regions if r.name == region)]
    names = [r.name for r in before.regions]
    for name in names:
        shift = moved if names.index(name) > names.index(region) else 0
        assert SPEEDRUN.defines[f"{prefix}{name.upper()}"] == plain_defines[f"{prefix}{name.upper()}"] + shift, name
    if table == "layout":
        assert SPEEDRUN.shared_bytes == before.bytes + moved == SPEEDRUN.defines["SMEM_BYTES"]
    assert PersistentCnn.cubin("sm_90", SPEEDRUN.defines) != plain


def test_in_one_pass_work_and_dp1_hold_phase_1s_fragments_and_the_kernel_checks_it(nvrtc_available, cache,
                                                                                   monkeypatch):
    """At tf32 phase 1's B fragments (64 floats each: conv 1's 4 k-steps × 3 n-tiles, conv 2's 27 × 4)
    span phase 5's work (32 maps of 14 × 14, each 200 words apart) and dp1 (24 of 12 × 12) regions, next to each other in the
    table, which sizes work for both uses (the speedrun's as phase 5 alone needs it); a table whose two
    regions fall a fragment short does not compile."""
    from graphtrain.kernels.persistent import Layout
    from graphtrain.libs.nvrtc import NvrtcError

    fragments, work, dp1 = 64 * 4 * (4 * 3 + 27 * 4), 32 * 200, 24 * 12 * 12
    assert SPEEDRUN.work_map_stride == 200 and 200 % 32 == 8
    layout = SPEEDRUN.layout
    assert SPEEDRUN.conv_fragments == 4 * 3 + 27 * 4 and work + dp1 >= fragments // 4
    assert layout.offsets["dp2"] - layout.offsets["work"] == 4 * (work + dp1) == SPEEDRUN.defines["SMEM_DP2"] - \
        SPEEDRUN.defines["SMEM_WORK"]
    assert dataclasses.replace(SPEEDRUN, passes=3).layout.bytes == layout.bytes
    short = fragments // 4 - dp1 - 64
    shrunk = Layout([dataclasses.replace(r, count=short) if r.name == "work" else r for r in layout.regions])
    monkeypatch.setattr(CnnShape, "layout", property(lambda self: shrunk))
    with pytest.raises(NvrtcError, match="work and dp1 regions cannot hold phase 1's B fragments"):
        PersistentCnn.cubin("sm_90", SPEEDRUN.defines)


@pytest.mark.parametrize("shape", [SPEEDRUN, dataclasses.replace(SPEEDRUN, passes=3)])
def test_the_probe_build_compiles(nvrtc_available, cache, shape):
    """scripts/probes/persistent_cnn_phases.py's build: the kernel with -DPROBES (probes.cuh, block 0
    of the grid probing), a slot for every phase of the launcher's PHASES, their counts at the end of
    its shared memory; the plain build has no probe code."""
    plain, probed = PersistentCnn.build_layout(shape), PersistentCnn.build_layout(shape, probes=True)
    assert probed.bytes == plain.bytes + 8 * len(PHASES) and probed.offsets["probe_counts"] == plain.bytes
    assert probed.bytes <= MAX_SHARED_BYTES
    defines = PersistentCnn.build_defines(shape, probes=True)
    assert defines["SMEM_BYTES"] == probed.bytes and "PROBES" not in PersistentCnn.build_defines(shape)
    assert PersistentCnn.build_defines(shape) == shape.defines
    cubin = PersistentCnn.cubin("sm_90", defines)
    assert cubin.startswith(ELF_MAGIC) and cubin != PersistentCnn.cubin("sm_90", shape.defines)


def test_every_phase_is_probed_in_the_kernel_in_step_order():
    """Each of PHASES ends once in the kernel's step, in the table's order (a slot the kernel never
    counts would print as nothing; a probe the table lacks would not compile), a phase before the
    wait of the grid barrier after it; phase 1's last three parts inside sample_forward (a training
    step's: the evaluation passes no probes), phase 4's first two inside linear_backward and phase 5's
    first four inside sample_backward, in order."""
    source = (KERNELS_DIR / "persistent_cnn.cu").read_text()
    step = source[source.index("cnn_epoch("):source.index("cnn_evaluate(")]
    forward = source[source.index("void sample_forward("):source.index("void load_conv(")]
    backward = source[source.index("void sample_backward("):source.index("cnn_epoch(")]
    linear = source[source.index("void linear_backward("):source.index("void sample_backward(")]
    parts = ("BACKWARD_MAPS", "CONV2_GRADS", "POOL1_GRADIENT", "CONV1_GRADS")
    forward_parts = ("IMAGES", "CONV1", "CONVS_FORWARD")
    places, part_places, linear_places, forward_places = [], [], [], []
    for name, _ in PHASES:
        if name in forward_parts:
            assert forward.count(f"if (probes) PROBE_END(*probes, {name}, 0);") == 1, name
            forward_places.append(forward.index(f"PROBE_END(*probes, {name}, 0)"))
            continue
        if name in ("DW1", "DA2"):
            assert linear.count(f"PHASE_END(probes, {name})") == 1, name
            linear_places.append(linear.index(f"PHASE_END(probes, {name})"))
            continue
        if name in parts:
            at = [backward.find(f"{macro}(probes, {name}") for macro in ("PHASE_END", "PROBE_END")]
            assert sum(backward.count(f"{m}(probes, {name}") for m in ("PHASE_END", "PROBE_END")) == 1, name
            part_places.append(max(at))
            continue
        if name.startswith("WAIT_"):  # BARRIER(probes, NAME) or BARRIER_AROUND(probes, NAME, work)
            at = [step.find(f"BARRIER(probes, {name})"), step.find(f"BARRIER_AROUND(probes, {name},")]
            assert sum(i >= 0 for i in at) == 1, name
            places.append(max(at))
            continue
        assert step.count(f"PHASE_END(probes, {name})") == 1, name
        places.append(step.index(f"PHASE_END(probes, {name})"))
    assert places == sorted(places) and part_places == sorted(part_places) and linear_places == sorted(linear_places)
    assert forward_places == sorted(forward_places)
    assert step.count("sample_forward(") == 1 and "&probes)" in step[step.index("sample_forward("):]
    names = [name for name, _ in PHASES]
    assert names[:names.index("WAIT_CONVS_FORWARD")] == ["CONV_PARAMS", *forward_parts]
    assert names[names.index("CONVS_BACKWARD") - 4:names.index("CONVS_BACKWARD")] == list(parts)
    phase_4 = ("DW1", "DA2", "HEAD_UPDATE")  # phase 4's parts, the first two inside linear_backward
    assert names[names.index("WAIT_LINEAR_BACKWARD") - 3:names.index("WAIT_LINEAR_BACKWARD")] == list(phase_4)
    assert [name.startswith("WAIT_") for name in names if name not in parts + phase_4[:2] + forward_parts] == [False, True] * 6
    assert step.count("grid_sync(") == 0, "a grid barrier of the step is not counted"


def test_the_phase_script_prints_each_phase_a_row_and_a_column_per_build():
    """scripts/probes/persistent_cnn_phases.py's table: the kernel's PHASES in order, their cycles a
    step in each build, the step's total."""
    from test_persistent import load_script

    module = load_script("persistent_cnn_phases")
    steps = 4
    tables = {p: np.zeros(len(PHASES), np.int64) for p in ("tf32", "fp32")}
    tables["tf32"][0], tables["fp32"][0], tables["fp32"][11] = 4000, 8000, 400
    rows = module.phase_rows(tables, steps)
    assert rows[0] == "| phase (block 0) | tf32 | fp32 |" and len(rows) == 2 + len(PHASES) + 1
    assert rows[2] == f"| {PHASES[0][1]} | 1000 | 2000 |" and rows[13] == f"| {PHASES[11][1]} | 0 | 100 |"
    assert rows[-1] == "| **step** | **1000** | **2100** |"
    assert module.phase_rows(tables, steps, "block 67")[0] == "| phase (block 67) | tf32 | fp32 |"
    assert module.phase_rows(tables, steps, "")[0] == "| phase | tf32 | fp32 |"


def test_the_probe_build_counts_the_block_it_is_given():
    """The probe build's prober (probes.cuh: the block whose PROBE_RANK is 0) is the block asked for:
    blockIdx.x for block 0, blockIdx.x − k for block k; it compiles either way; no block past the grid."""
    shape = CnnShape(28, 24, 5, 32, 3, 256, 10, 256)
    assert PersistentCnn.build_defines(shape, True)["PROBE_RANK"] == "blockIdx.x"
    defines = PersistentCnn.build_defines(shape, True, 67)
    assert defines["PROBE_RANK"] == "((int)blockIdx.x - 67)"
    assert PersistentCnn.cubin("sm_90", defines).startswith(ELF_MAGIC)
    assert "PROBE_RANK" not in PersistentCnn.build_defines(shape, False, 67)
    with pytest.raises(ValueError, match="no block 132 to probe in a grid of 132"):
        PersistentCnn.build_defines(shape, True, 132)


@pytest.mark.parametrize("blocks,parts", [(132, 2), (64, 1), (16, 1), (300, 4)])
def test_fc1s_inputs_are_split_over_the_blocks_its_tiles_leave_idle(blocks, parts):
    """The speedrun's fc1 (256 rows × 256 units: 64 tiles) takes 2 parts of its 800 inputs on 132
    blocks, none on fewer blocks than tiles, at most MAX_FC1_PARTS; every part whole k-steps, the
    last holding the rest."""
    shape = dataclasses.replace(CnnShape(28, 24, 5, 32, 3, 256, 10, 256), blocks=blocks)
    assert shape.fc1_parts == parts
    part = shape.fc1_part(parts)
    assert part % 8 == 0 and 0 < shape.flat - (parts - 1) * part <= part


@pytest.mark.parametrize("flat_maps", range(1, 12))
def test_every_part_of_fc1s_inputs_holds_some(flat_maps):
    """Small conv outputs (c2 maps of 2 × 2: 4·c2 inputs) on many blocks: fewer parts where the
    k-steps of 8 would leave the last empty."""
    shape = CnnShape(14, 4, 3, flat_maps, 3, 8, 10, 8, blocks=132)
    parts = shape.fc1_parts
    assert 1 <= parts and (parts - 1) * shape.fc1_part(parts) < shape.flat, (flat_maps, parts)


# The spill stores and stack frame a thread of cnn_epoch may have in the speedrun's one-pass build:
# NVRTC 13.0's ptxas spills 12 bytes (3 registers, a stack frame of 16) beside the step's 255
# registers. Measured on an H200 (scripts/benchmarks/epoch_ab.py): that build's epoch 19.24 ms against
# 19.93 at PREFETCH 5, which spills none. With conv 2's weight gradient on the tensor cores (a call) it
# spills 16 bytes: its epoch 16.61 ms against 17.25 as FMAs, which spill none; in two chunks of n-tiles,
# which spill none either, its phase counted as many cycles as the FMAs. A loop the compiler does not
# unroll leaves its arrays in local memory, a stack frame of their size with no spill reported (176 bytes, five times the phase's
# cycles: docs/persistent-cnn.md).
SPEEDRUN_SPILL_BYTES, SPEEDRUN_STACK_BYTES = 16, 16


def test_the_speedrun_kernel_keeps_its_registers(nvrtc_available):
    """The speedrun's one-pass build keeps its registers (ptxas): its products' ring of PREFETCH
    chunks and phase 4's preloaded optimizer state sit near the 255-register bound, where chunks of
    64 k-values, or 6 of 32 in flight, spilled; the evaluation spills nothing, the epoch at most
    SPEEDRUN_SPILL_BYTES, and neither keeps arrays in local memory (the stack frame)."""
    import re

    from graphtrain.libs.nvrtc import ptxas_report

    shape = CnnShape(28, 24, 5, 32, 3, 256, 10, 256)
    log = ptxas_report(PersistentCnn.source(), "persistent_cnn.cu", "sm_90", [f"-D{k}={v}" for k, v in shape.defines.items()])
    found = {name: (int(stack), int(spill)) for name, stack, spill in
             re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes stack frame, (\d+) bytes spill stores", log, re.S)}
    assert {"cnn_epoch", "cnn_evaluate"} <= found.keys(), found
    assert found["cnn_evaluate"] == (0, 0), found
    assert found["cnn_epoch"][0] <= SPEEDRUN_STACK_BYTES and found["cnn_epoch"][1] <= SPEEDRUN_SPILL_BYTES, found


def test_a_parameter_span_off_16_bytes_is_refused_before_the_launch():
    """load_conv reads the conv parameters 16 bytes at a time: the launcher refuses a span that does
    not start on 16 bytes (an arena's never does: its buffers start on 256)."""
    from graphtrain.kernels.persistent_cnn import _check_aligned
    from graphtrain.libs.memory import ALIGNMENT

    _check_aligned(7 * ALIGNMENT)
    _check_aligned(7 * ALIGNMENT + 16)
    for off in (4, 8, 12):
        with pytest.raises(RuntimeError, match="16-byte aligned"):
            _check_aligned(7 * ALIGNMENT + off)


def test_the_code_size_probe_reads_each_kernels_sass_from_the_cubin(nvrtc_available, cache):
    """scripts/probes/kernel_code_size.py: each kernel function's `.text` section in the cubin, whole
    sm_90 instructions of 16 bytes; a file that is not an ELF64 cubin is refused."""
    from test_persistent import load_script

    probe = load_script("kernel_code_size")
    cubin = PersistentCnn.cubin("sm_90", SPEEDRUN.defines)
    sizes = probe.text_sizes(cubin)
    assert {"cnn_epoch", "cnn_evaluate"} <= sizes.keys(), sizes
    assert all(size > 0 and size % probe.SASS_BYTES == 0 for size in sizes.values()), sizes
    assert sum(sizes.values()) < len(cubin)
    with pytest.raises(ValueError, match="ELF64"):
        probe.text_sizes(b"not a cubin" * 8)
