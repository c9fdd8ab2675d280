"""convpool_tc.cu's forward and backward data run on the CPU: the source compiled by the host's C++
compiler with the CUDA features it uses emulated (cuda_on_cpu/convpool.h: a thread per CUDA thread, a
warp's TF32 mma.sync from its lanes' registers as PTX lays them out), on the launchers' geometry
(grid, samples a round, shared bytes: a block's shared memory is exactly what the launcher asks for,
filled with a pattern that shows a read of what was never written), against NumPy float64. What
the emulation cannot show (the GPU's timing, its memory order) test_convpool_gpu.py does."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import compile_for_cpu, kernel_text
from helpers import rel_err

from graphtrain.kernels import ceil_div
from graphtrain.kernels import convpool_tc
from graphtrain.kernels.convpool_tc import THREADS, ConvPoolShape, ConvPoolTc, samples_per_round

# The texts the host compiler cannot take: the block's dynamic shared memory (the launch's own
# buffer), the TF32 rounding's PTX, the kernels' qualifiers.
REPLACED = {'extern __shared__ __align__(16) unsigned smem[];': 'unsigned* smem = (unsigned*)block_smem();',
            'asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));': 'r = tf32_rna_emulated(v);',
            'extern "C" __global__ void': 'void'}
# Where the forward's and backward data's text ends (the weight gradient's is not emulated).
WEIGHT_GRAD = "// ---- weight and bias gradients"
RELU_OFF = 255
# TF32 operands (10 mantissa bits, each rounded to nearest: 2⁻¹¹ of itself) over sums of 25 to a
# few hundred terms of both signs: ~1e-3 of the result's norm at most; a wrong index, fragment or
# column errs by order 1.
BOUND = 3e-3

# an H100's SM (sm_90): shared memory for blocks, registers, threads
H100_SM = (228 * 1024, 64 * 1024, 2048)


def build(source: str, shape: ConvPoolShape, spb: int, bd: tuple[int, int, int], folder, prefetch: bool = False,
          tiles: int = convpool_tc.BD_TILES, tail_k4: bool = False, b_regs: bool | None = None,
          b_pairs: bool = convpool_tc.FORWARD_B_PAIRS) -> str:
    """The program of convpool_tc.cu's `source` (with its headers) for `shape`, the forward staging
    spb samples a round (its last k-step as m16n8k4 mma where `tail_k4`: TC_TAIL_K4), the backward
    data bd = (warps a block, samples a round, blocks an SM) with `tiles` m-tiles an item, loading its
    next sample into registers ahead where `prefetch` (TC_BD_PREFETCH); the forward's B fragments in
    registers where `b_regs` (TC_B_REGS; None: as the launcher chooses for the shape), else two n-tiles'
    in one 16-byte load where `b_pairs` (TC_B_PAIRS)."""
    assert WEIGHT_GRAD in source, f"convpool_tc.cu no longer has {WEIGHT_GRAD!r}: the emulation must follow it"
    source = source[:source.index(WEIGHT_GRAD)]
    defines = {**ConvPoolTc.defines, "TC_C": shape.c, "TC_H": shape.h, "TC_W": shape.w, "TC_K": shape.k,
               "TC_OUTS": shape.outs, "TC_RS": shape.row_stride, "TC_CS": shape.channel_stride, "TC_SPB": spb, "TC_BD_WARPS": bd[0], "TC_BD_SPB": bd[1], "TC_BD_MIN_BLOCKS": bd[2],
               "TC_BD_PREFETCH": int(prefetch), "TC_BD_MTW": tiles, "TC_TAIL_K4": int(tail_k4),
               "TC_B_REGS": int(shape.forward_b_registers() if b_regs is None else b_regs),
               "TC_B_PAIRS": int(b_pairs), "THREADS": THREADS}
    return compile_for_cpu(source, "convpool_tc.cu", defines, "convpool_tc.h", "convpool_launch.inc", folder, REPLACED)


def run(program: str, folder, n: int, models: int, grids: tuple[int, int], shared: tuple[int, int],
        x, w, bias, dout, shared_input: bool, samples=None):
    """(out, arg, dx) of the emulated launches, each models × its per-model shape; with `samples`
    (models × n indices) the forward reads image samples[m, s] of x, which every model shares."""
    np.array([n, models, grids[0], shared[0], grids[1], shared[1], int(shared_input), int(samples is not None)],
             np.int32).tofile(folder / "launch.bin")
    if samples is not None:
        np.ascontiguousarray(samples, np.int32).tofile(folder / "samples.bin")
    for name, a in (("x", x), ("w", w), ("bias", bias), ("dout", dout)):
        np.ascontiguousarray(a, np.float32).tofile(folder / f"{name}.bin")
    proc = subprocess.run([program, str(folder)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = np.fromfile(folder / "out.bin", np.float32).reshape(dout.shape)
    arg = np.fromfile(folder / "arg.bin", np.uint8).reshape(dout.shape)
    dx = np.fromfile(folder / "dx.bin", np.float32).reshape(models, n, -1)  # NaNs where no backward data ran
    return out, arg, dx


def reference_forward(x, w, bias, k: int):
    """conv (valid) + bias in float64, 2×2 max-pool windows (u·2 + v order), ReLU: (out, the windows' values)."""
    n, c, h, wd = x.shape
    hc, wc = h - k + 1, wd - k + 1
    conv = np.zeros((n, w.shape[0], hc, wc))
    for a in range(k):
        for b in range(k):
            conv += np.einsum("nchw,oc->nohw", x[:, :, a:a + hc, b:b + wc], w[:, :, a, b])
    ho, wo = hc // 2, wc // 2
    win = conv[:, :, :2 * ho, :2 * wo].reshape(n, -1, ho, 2, wo, 2).transpose(0, 1, 2, 4, 3, 5).reshape(n, -1, ho, wo, 4)
    win = win + bias[None, :, None, None, None]
    return np.maximum(win.max(-1), 0.0), win


def reference_backward_data(dout, arg, w, h: int, wd: int):
    """dx in float64: dout routed to each window's argmax (none where the ReLU was off), then the
    full correlation with the filters."""
    n, outs, ho, wo = dout.shape
    k = w.shape[2]
    dconv = np.zeros((n, outs, h - k + 1, wd - k + 1))
    for q in range(4):
        u, v = divmod(q, 2)
        dconv[:, :, u:2 * ho:2, v:2 * wo:2] += np.where(arg == q, dout, 0.0)
    dx = np.zeros((n, w.shape[1], h, wd))
    for a in range(k):
        for b in range(k):
            dx[:, :, a:a + dconv.shape[2], b:b + dconv.shape[3]] += np.einsum("nohw,oc->nchw", dconv, w[:, :, a, b])
    return dx


# (c, h, k, outs), n, models, blocks a model (None: the launcher's for max_blocks = 1024), whether the
# layer is a first one (no backward data), every model reading the same x: conv0's shape (one input
# channel, a 5×5 filter, 18 groups of windows: 4 samples a round) and conv1's (24 channels, 3×3, 3
# n-tiles of input channels), with few samples; blocks fewer than the samples (several rounds, the
# last part-filled) and more models than one.
CASES = {
    "conv0-one-model": ((1, 28, 5, 24), 2, 1, None, True, False),
    "conv0-rounds-models": ((1, 28, 5, 24), 6, 2, 1, True, True),
    "conv1-one-model": ((24, 12, 3, 32), 2, 1, None, False, False),
    "conv1-rounds-models": ((24, 12, 3, 32), 3, 2, 2, False, False),
    # 7×7 conv, a last row and column in no window; column tiles part-filled
    "odd-shape": ((5, 9, 3, 10), 7, 3, 3, False, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_backward_data_match_float64(tmp_path, case, seed):
    (c, h, k, outs), n, models, blocks, first, shared_input = CASES[case]
    shape = ConvPoolShape(c, h, h, k, outs)
    spb = shape.samples_per_block(shape.forward_words, H100_SM[0])
    tiles = convpool_tc.BD_TILES_PACKED if models > 1 else convpool_tc.BD_TILES  # as ConvPoolTc's for `models`
    bd = shape.backward_data_geometry(*H100_SM, tiles)
    bd_spb = bd[1]
    program = build(kernel_text("model_axis.cuh", "convpool_tc.cu"), shape, spb, bd, tmp_path, tiles=tiles)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1 if shared_input else models, n, c, h, h)).astype(np.float32)
    w = (rng.standard_normal((models, outs, c, k, k)) / np.sqrt(c * k * k)).astype(np.float32)
    bias = (0.1 * rng.standard_normal((models, outs))).astype(np.float32)
    ho, wo = shape.hc // 2, shape.wc // 2
    dout = rng.standard_normal((models, n, outs, ho, wo)).astype(np.float32)
    grid_f = blocks or min(ceil_div(n, max(1, round(8 / ceil_div(shape.plane, 8)))), 1024 // models)
    grid_b = 0 if first else blocks or min(ceil_div(n, bd_spb), 1024 // models)
    shared = (4 * shape.forward_words(samples_per_round(spb, n, grid_f)),
              0 if first else 4 * shape.backward_data_words(samples_per_round(bd_spb, n, grid_b)))
    out, arg, dx = run(program, tmp_path, n, models, (grid_f, grid_b), shared, x, w, bias, dout, shared_input)
    for m in range(models):
        ref, win = reference_forward(x[0 if shared_input else m].astype(np.float64), w[m].astype(np.float64), bias[m].astype(np.float64), k)
        err = rel_err(out[m], ref)
        assert err < BOUND, f"forward, model {m}: ‖out − ref‖/‖ref‖ = {err:.2e} (seed {seed})"
        # the argmax the kernel chose: its window's maximum up to the TF32 products' error, or 255
        # exactly where the ReLU is off
        off = arg[m] == RELU_OFF
        best = win.max(-1)
        picked = np.take_along_axis(win, np.where(off, 0, arg[m]).astype(np.int64)[..., None], -1)[..., 0]
        scale = np.abs(win).max()
        assert np.all(np.abs(picked - best)[~off] <= 1e-2 * scale), f"forward, model {m}: an argmax off its window's maximum (seed {seed})"
        assert np.all(best[off] <= 1e-2 * scale) and np.all(best[~off] >= -1e-2 * scale), f"model {m}: ReLU mask (seed {seed})"
        if first:
            continue
        dref = reference_backward_data(dout[m].astype(np.float64), arg[m], w[m].astype(np.float64), h, h)
        err = rel_err(dx[m].reshape(dref.shape), dref)
        assert err < BOUND, f"backward data, model {m}: ‖dx − ref‖/‖ref‖ = {err:.2e} (seed {seed})"


def test_backward_data_geometry_keeps_every_warp_busy():
    """The 24→32 3×3 layer's 9 m-tiles a sample: at two an item, 5 warps a block, 4 blocks an SM; at
    one, 9 warps, each an item a round, 4 blocks an SM at 56 registers (36 busy warps, against 8
    warps' 4 blocks × 9/16), 3 at 64; BD_WARPS fixes the warps."""
    shape = ConvPoolShape(24, 12, 12, 3, 32)
    assert shape.backward_data_geometry(*H100_SM, 2) == (5, 1, 4)
    assert shape.backward_data_geometry(*H100_SM, 1) == (9, 1, 4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(convpool_tc, "BD_REGISTERS", 64)
        assert shape.backward_data_geometry(*H100_SM, 1) == (9, 1, 3)  # 64 Ki / (288 × 64)
        mp.setattr(convpool_tc, "BD_WARPS", 8)
        assert shape.backward_data_geometry(*H100_SM, 1) == (8, 1, 4)  # 64 Ki / (256 × 64)


# (c, h, k, outs), n, blocks a model, the fixed warps to compare the layer's own choices with (at one
# and at two m-tiles an item): conv1's shape (its 9 or 5 warps, against 8 and 3: turns with idle
# warps, or more turns), a 7×7 conv's 6 m-tiles (against 8, 2 and 12 warps: 1 to 4 samples a round).
GEOMETRY_CASES = {"conv1": ((24, 12, 3, 32), 5, 2, (8, 3)), "odd-shape": ((5, 9, 3, 10), 5, 2, (8, 2, 12))}


@pytest.mark.parametrize("case", list(GEOMETRY_CASES))
def test_backward_data_bits_do_not_depend_on_the_block_geometry(tmp_path, case, seed):
    """dx bit for bit the same whichever m-tiles an item (a one-model launcher's and a packed one's),
    warps a block (and so whichever warp takes an item, how many samples a round), with the next
    sample loaded ahead or not: each output's k-steps summed in the same order from 0."""
    (c, h, k, outs), n, blocks, fixed = GEOMETRY_CASES[case]
    shape = ConvPoolShape(c, h, h, k, outs)
    spb = shape.samples_per_block(shape.forward_words, H100_SM[0])
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, n, c, h, h)).astype(np.float32)
    w = (rng.standard_normal((1, outs, c, k, k)) / np.sqrt(c * k * k)).astype(np.float32)
    bias = (0.1 * rng.standard_normal((1, outs))).astype(np.float32)
    dout = rng.standard_normal((1, n, outs, shape.hc // 2, shape.wc // 2)).astype(np.float32)
    geometries = []  # (m-tiles an item, (warps, samples a round, blocks an SM), prefetch)
    for tiles in (convpool_tc.BD_TILES, convpool_tc.BD_TILES_PACKED):
        geometries.append((tiles, shape.backward_data_geometry(*H100_SM, tiles), False))
        with pytest.MonkeyPatch.context() as mp:
            for warps in fixed:
                mp.setattr(convpool_tc, "BD_WARPS", warps)
                geometries.append((tiles, shape.backward_data_geometry(*H100_SM, tiles), False))
    assert len({(t, g[:2]) for t, g, _ in geometries}) == len(geometries), f"{geometries}: the same block twice"
    prefetching = [(t, g) for t, g, _ in geometries if g[1] == 1]
    assert prefetching, f"{geometries}: none of one sample a round, which the prefetch needs"
    geometries.append((*prefetching[0], True))
    results = []
    for i, (tiles, bd, prefetch) in enumerate(geometries):
        folder = tmp_path / str(i)
        folder.mkdir()
        program = build(kernel_text("model_axis.cuh", "convpool_tc.cu"), shape, spb, bd, folder, prefetch=prefetch,
                        tiles=tiles)
        shared = (4 * shape.forward_words(samples_per_round(spb, n, blocks)),
                  4 * shape.backward_data_words(samples_per_round(bd[1], n, blocks)))
        results.append(run(program, folder, n, 1, (blocks, blocks), shared, x, w, bias, dout, True))
    for geometry, (out, arg, dx) in zip(geometries[1:], results[1:]):
        assert np.array_equal(out.view(np.uint32), results[0][0].view(np.uint32)) and np.array_equal(arg, results[0][1])
        differ = np.count_nonzero(dx.view(np.uint32) != results[0][2].view(np.uint32))
        assert differ == 0, f"{differ} of dx's words differ between {geometries[0]} and {geometry} (seed {seed})"


@pytest.mark.parametrize("case", ["conv0-rounds-models", "conv1-rounds-models", "odd-shape"])
def test_forward_padded_strides_same_bits_as_row_major(tmp_path, case, seed, monkeypatch):
    """The forward's staged image with the layer's chosen strides (forward_strides; the odd shape's
    searched at setup) against row-major strides: only addresses move, so out and arg must be the
    same bits."""
    (c, h, k, outs), n, models, blocks, _, shared_input = CASES[case]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1 if shared_input else models, n, c, h, h)).astype(np.float32)
    w = (rng.standard_normal((models, outs, c, k, k)) / np.sqrt(c * k * k)).astype(np.float32)
    bias = (0.1 * rng.standard_normal((models, outs))).astype(np.float32)
    results = []
    for padded in (True, False):
        monkeypatch.setattr(convpool_tc, "PADDED_ROWS", padded)
        shape = ConvPoolShape(c, h, h, k, outs)
        assert ((shape.row_stride, shape.channel_stride) != (h, h * h)) == padded, "no padded strides to test"
        spb = shape.samples_per_block(shape.forward_words, H100_SM[0])
        folder = tmp_path / str(padded)
        folder.mkdir()
        program = build(kernel_text("model_axis.cuh", "convpool_tc.cu"), shape, spb,
                        shape.backward_data_geometry(*H100_SM, convpool_tc.BD_TILES), folder)
        dout = np.zeros((models, n, outs, shape.hc // 2, shape.wc // 2), np.float32)
        shared = (4 * shape.forward_words(samples_per_round(spb, n, blocks)), 0)
        results.append(run(program, folder, n, models, (blocks, 0), shared, x, w, bias, dout, shared_input)[:2])
    (out_p, arg_p), (out_r, arg_r) = results
    assert np.array_equal(out_p.view(np.uint32), out_r.view(np.uint32)), f"out differs (seed {seed})"
    assert np.array_equal(arg_p, arg_r), f"arg differs (seed {seed})"


# Layers whose last k-step holds at most 4 taps: conv0's 25 (one) and a 7×7 conv of 3 channels' 27 (three).
TAIL_CASES = {"conv0-rounds-models": CASES["conv0-rounds-models"],
              "three-channels-7x7": ((3, 9, 3, 10), 7, 3, 3, False, True)}


def forward_builds(tmp_path, case, seed, builds):
    """The emulated forward of `case` (a CASES entry) on seeded inputs, once for each of `builds`
    (build()'s keyword arguments): the inputs (x, w, bias) and each build's (out, arg)."""
    (c, h, k, outs), n, models, blocks, _, shared_input = case
    shape = ConvPoolShape(c, h, h, k, outs)
    spb = shape.samples_per_block(shape.forward_words, H100_SM[0])
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1 if shared_input else models, n, c, h, h)).astype(np.float32)
    w = (rng.standard_normal((models, outs, c, k, k)) / np.sqrt(c * k * k)).astype(np.float32)
    bias = (0.1 * rng.standard_normal((models, outs))).astype(np.float32)
    dout = np.zeros((models, n, outs, shape.hc // 2, shape.wc // 2), np.float32)
    shared = (4 * shape.forward_words(samples_per_round(spb, n, blocks)), 0)
    results = []
    for i, options in enumerate(builds):
        folder = tmp_path / f"build-{i}"
        folder.mkdir()
        program = build(kernel_text("model_axis.cuh", "convpool_tc.cu"), shape, spb,
                        shape.backward_data_geometry(*H100_SM, convpool_tc.BD_TILES), folder, **options)
        results.append(run(program, folder, n, models, (blocks, 0), shared, x, w, bias, dout, shared_input)[:2])
    return (x, w, bias), results


@pytest.mark.parametrize("case", list(TAIL_CASES))
def test_forward_tail_k4_matches_float64_and_the_full_k_step(tmp_path, case, seed):
    """FORWARD_TAIL_K4: the last k-step as m16n8k4 mma: out against float64, and in the emulation (an
    mma's sums in double) the same bits as the full k-step, whose other 4 taps are zero weights: the
    k4 fragments take the same A and B words."""
    (c, h, k, outs), _, models, _, _, shared_input = TAIL_CASES[case]
    assert 0 < ConvPoolShape(c, h, h, k, outs).taps % 8 <= 4, "no k-step of at most 4 taps to test"
    (x, w, bias), [(out, arg), (out_full, arg_full)] = forward_builds(
        tmp_path, TAIL_CASES[case], seed, [{"tail_k4": True}, {"tail_k4": False}])
    for m in range(models):
        ref, _ = reference_forward(x[0 if shared_input else m].astype(np.float64), w[m].astype(np.float64),
                                   bias[m].astype(np.float64), k)
        err = rel_err(out[m], ref)
        assert err < BOUND, f"forward with the k4 tail, model {m}: ‖out − ref‖/‖ref‖ = {err:.2e} (seed {seed})"
    assert np.array_equal(out.view(np.uint32), out_full.view(np.uint32)), f"out differs (seed {seed})"
    assert np.array_equal(arg, arg_full), f"arg differs (seed {seed})"


@pytest.mark.parametrize("tail_k4", [False, True], ids=["k8", "k4-tail"])
def test_forward_b_fragments_in_registers_give_the_same_bits(tmp_path, tail_k4, seed):
    """TC_B_REGS: a lane's B fragments held in registers, loaded once a block, take the same words
    into the same mma as its loads from shared memory at each k-step: the same out and arg bits."""
    case = CASES["conv0-rounds-models"]
    (c, h, k, outs) = case[0]
    assert ConvPoolShape(c, h, h, k, outs).forward_b_registers(), \
        "the launcher no longer holds this layer's B fragments in registers"
    (x, w, bias), [(out, arg), (out_shared, arg_shared)] = forward_builds(
        tmp_path, case, seed, [{"tail_k4": tail_k4, "b_regs": True}, {"tail_k4": tail_k4, "b_regs": False}])
    ref, _ = reference_forward(x[0].astype(np.float64), w[0].astype(np.float64), bias[0].astype(np.float64), k)
    err = rel_err(out[0], ref)
    assert err < BOUND, f"forward, B in registers, model 0: ‖out − ref‖/‖ref‖ = {err:.2e} (seed {seed})"
    assert np.array_equal(out.view(np.uint32), out_shared.view(np.uint32)), f"out differs (seed {seed})"
    assert np.array_equal(arg, arg_shared), f"arg differs (seed {seed})"


@pytest.mark.parametrize("case", ["conv1-rounds-models", "odd-shape"])
def test_forward_b_fragments_in_pairs_give_the_same_bits(tmp_path, case, seed):
    """TC_B_PAIRS: two n-tiles' B fragments in one 16-byte load take the same words into the same
    mma as one load each: the same out and arg bits (the odd shape's 2 n-tiles, its fragments kept in
    shared memory for the test; conv1's 4, in shared memory as built)."""
    c, h, k, outs = CASES[case][0]
    assert -(-outs // 8) % 2 == 0, case
    (x, w, bias), [(out, arg), (out_single, arg_single)] = forward_builds(
        tmp_path, CASES[case], seed, [{"b_pairs": True, "b_regs": False}, {"b_pairs": False, "b_regs": False}])
    ref, _ = reference_forward(x[0].astype(np.float64), w[0].astype(np.float64), bias[0].astype(np.float64), k)
    assert rel_err(out[0], ref) < BOUND, f"{case}, seed {seed}: B in pairs against float64"
    assert out.tobytes() == out_single.tobytes() and arg.tobytes() == arg_single.tobytes(), f"{case}, seed {seed}"


@pytest.mark.parametrize("case", ["conv0-rounds-models", "odd-shape"])
def test_the_forward_through_sample_indices_is_the_gathered_batchs_bit_for_bit(tmp_path, case, seed):
    """A first layer's batch read where it lies (`samples`: each model's indices into images every
    model shares, repeats among them) gives the outputs and argmaxes of the rows gathered into each
    model's own x, over rounds of several samples and blocks."""
    (c, h, k, outs), n, models, blocks, first, _ = CASES[case]
    shape = ConvPoolShape(c, h, h, k, outs)
    spb = shape.samples_per_block(shape.forward_words, H100_SM[0])
    bd = shape.backward_data_geometry(*H100_SM, convpool_tc.BD_TILES_PACKED)
    program = build(kernel_text("model_axis.cuh", "convpool_tc.cu"), shape, spb, bd, tmp_path, tiles=convpool_tc.BD_TILES_PACKED)
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((n + 5, c, h, h)).astype(np.float32)
    samples = rng.integers(0, len(images), (models, n)).astype(np.int32)
    w = (rng.standard_normal((models, outs, c, k, k)) / np.sqrt(c * k * k)).astype(np.float32)
    bias = (0.1 * rng.standard_normal((models, outs))).astype(np.float32)
    dout = np.zeros((models, n, outs, shape.hc // 2, shape.wc // 2), np.float32)
    shared = (4 * shape.forward_words(samples_per_round(spb, n, blocks)), 0)
    out, arg, _ = run(program, tmp_path, n, models, (blocks, 0), shared, images, w, bias, dout, False, samples)
    gathered_out, gathered_arg, _ = run(program, tmp_path, n, models, (blocks, 0), shared, images[samples], w, bias,
                                        dout, False)
    assert out.tobytes() == gathered_out.tobytes(), f"{case}, seed {seed}: outputs"
    assert arg.tobytes() == gathered_arg.tobytes(), f"{case}, seed {seed}: argmaxes"
    ref, _ = reference_forward(images[samples[1]].astype(np.float64), w[1].astype(np.float64), bias[1].astype(np.float64), k)
    assert rel_err(out[1], ref) < BOUND, f"{case}, seed {seed}: model 1 against float64"


def test_the_forward_tail_k4_compiles_for_hopper(nvrtc_available, cache):
    """The m16n8k4 mma's PTX assembles (ptxas, through NVRTC) for the 1→24 5×5 layer with the tail on."""
    shape = ConvPoolShape(1, 28, 28, 5, 24)
    defines = {**ConvPoolTc.defines, "TC_C": 1, "TC_H": 28, "TC_W": 28, "TC_K": 5, "TC_OUTS": 24,
               "TC_RS": shape.row_stride, "TC_CS": shape.channel_stride, "TC_SPB": 4, "TC_TAIL_K4": 1}
    assert ConvPoolTc.cubin("sm_90", defines).startswith(b"\x7fELF")


@pytest.mark.parametrize("models", [1, 64])
def test_the_speedrun_layers_kernels_do_not_spill(nvrtc_available, models):
    """Every kernel of the speedrun's two layers as a launch of `models` models builds it (an H100's SM)
    keeps its registers: the forward and the weight gradient sit at their 128-register bounds, where
    two more live values spilled (the weight gradient's sample indices, held through its products)."""
    import re

    from graphtrain.libs.nvrtc import ptxas_report

    for c, h, k, outs in ((1, 28, 5, 24), (24, 12, 3, 32)):
        shape = ConvPoolShape(c, h, h, k, outs)
        tiles = convpool_tc.BD_TILES_PACKED if models > 1 else convpool_tc.BD_TILES
        defines = {**ConvPoolTc.defines, **convpool_tc.layer_defines(
            shape, shape.samples_per_block(shape.forward_words, H100_SM[0]), tiles,
            shape.backward_data_geometry(*H100_SM, tiles))}
        log = ptxas_report(ConvPoolTc.source(), "convpool_tc.cu", "sm_90", [f"-D{a}={b}" for a, b in defines.items()])
        spills = re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores", log, re.S)
        assert len(spills) == 4 and all(int(n) == 0 for _, n in spills), (c, spills)


def test_known_strides_are_what_the_search_chooses():
    """KNOWN_STRIDES only saves the search at setup: each entry must be the search's own choice."""
    for key, strides in convpool_tc.KNOWN_STRIDES.items():
        assert convpool_tc.forward_strides(*key) == strides, key


def test_the_wavefront_model_counts_bank_conflicts():
    wavefronts = convpool_tc.wavefronts
    assert wavefronts(np.arange(32)[None]).tolist() == [1]                      # a word a bank
    assert wavefronts(np.zeros((1, 32), np.int64)).tolist() == [1]              # one word, shared
    assert wavefronts((32 * np.arange(32))[None]).tolist() == [32]              # one bank
    assert wavefronts((np.arange(32) * 2)[None]).tolist() == [2]                # two words a bank
    # staging a 1×28×28 image row-major: 196 16-byte stores, 8 lanes (32 words) a wavefront
    assert convpool_tc.staging_wavefronts(1, 28, 28, 28, 784) == 25
    # rows of 51 words: four 4-byte stores a thread, more wavefronts than the aligned rows
    assert convpool_tc.staging_wavefronts(1, 28, 28, 51, 1428) > convpool_tc.staging_wavefronts(1, 28, 28, 28, 784)
