"""convpool_tc.cu's weight gradient (convpool_tc_weight_grad, then convpool_tc_reduce) run on the CPU:
its source compiled by the host's C++ compiler with the CUDA features it uses emulated (cuda_on_cpu/:
a thread per CUDA thread, a warp's TF32 mma.sync from its lanes' registers). Against float64 NumPy
from the same TF32-rounded operands, and bit for bit between the launcher's two grids (a block a
chunk; REDUCE_SLICES blocks each adding its chunks in the reduce's order) and between models packed
on the model axis and each alone. What the emulation cannot show (the GPU's timing, its own mma
rounding) test_convpool_gpu.py and test_model_axis_gpu.py do."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from emulation import compile_for_cpu, kernel_text
from helpers import rel_err

from graphtrain import reference_cnn as R
from graphtrain.kernels import convpool_tc
from graphtrain.kernels.convpool_tc import (REDUCE_SLICES, WEIGHT_GRAD_SAMPLES, WEIGHT_GRAD_SAMPLES_ONE_CHANNEL,
                                             ConvPoolShape, ConvPoolTc)

# What the host compiler cannot take: the block's shared memory (the launch's own buffer), the
# kernels' qualifiers, the TF32 conversion's asm (convpool_tc.h's emulation).
REPLACED = {"extern __shared__ __align__(16) unsigned smem[];": "unsigned* smem = (unsigned*)block_smem();",
            "__shared__ float part[TC_REDUCE_SLICES][32];":
                "auto& part = *reinterpret_cast<float (*)[TC_REDUCE_SLICES][32]>(block_smem());",
            'asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));': "r = tf32_rna_emulated(v);",
            'extern "C" __global__ void': "void"}
# The kernels' sums are fp32 over at most a few thousand TF32 products each (the reference takes the
# same TF32 operands), so they err by ~1e-7 of ‖dW‖; a wrong position, tap, fragment, a word of
# dconv left from the slices' sums, a chunk summed twice or missed errs by far more than 1e-5.
BOUND = 1e-5

# (c, h, w, k, outs, n), small (the emulation takes ~1 ms an mma), each with chunks > REDUCE_SLICES
# (slices of 2 chunks and of 1): one input channel (chunks of two samples, the last of one; one group of n-tiles over 8
# slices of k-steps, slices without any); many taps (five groups of n-tiles, the last of one tile,
# one slice, an idle warp, outputs past 16 in a second m-tile); a conv row and column in no pool
# window, the slices' sums over more words than dconv's rows, some of them read (clear_unscattered).
CASES = {"one channel 1x9x9 4x4 → 6": (1, 9, 9, 4, 6, 19),
         "speedrun 1x28x28 5x5 → 24": (1, 28, 28, 5, 24, 19),
         "many taps 15x6x6 3x3 → 20": (15, 6, 6, 3, 20, 17),
         "odd 3x7x9 3x3 → 12": (3, 7, 9, 3, 12, 19)}


def tf32(a: np.ndarray) -> np.ndarray:
    """float32 → TF32 as cvt.rna does it (nearest, ties away from zero), as float64."""
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


class Program:
    """The weight gradient built for one shape; run(...) launches it on a packed arena."""

    def __init__(self, shape: tuple, folder):
        c, h, w, k, outs, _ = shape
        self.s = ConvPoolShape(c, h, w, k, outs)
        self.per_chunk = WEIGHT_GRAD_SAMPLES_ONE_CHANNEL if c == 1 else WEIGHT_GRAD_SAMPLES  # ConvPoolTc's chunk
        defines = {**ConvPoolTc.defines, "TC_C": c, "TC_H": h, "TC_W": w, "TC_K": k, "TC_OUTS": outs,
                   "TC_WG_RS": self.s.wg_row_stride, "TC_WG_CS": self.s.wg_channel_stride,
                   "SMEM_BYTES": 4 * self.s.weight_grad_words()}
        source = kernel_text("model_axis.cuh", "convpool_tc.cu")
        self.folder = folder
        self.program = compile_for_cpu(source, "convpool_tc.cu", defines, "convpool_tc.h", "convpool_tc_launch.inc",
                                       folder, REPLACED)

    def run(self, models: list[dict], n: int, blocks: int, images: np.ndarray | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each model's (dw, db) after one launch of len(models) models on `blocks` blocks each;
        with `images`, each model's x is images at its "samples" (the kernel reads them through the
        indices, the images in model 0's x for every model)."""
        s = self.s
        chunks = -(-n // self.per_chunk)
        sizes = {"x": 4 * (n if images is None else len(images)) * s.image, "dout": 4 * n * s.outs * s.plane,
                 "arg": n * s.outs * s.plane, "partial": 4 * s.outs * chunks * (s.taps + 1),
                 "dw": 4 * s.outs * s.taps, "db": 4 * s.outs, "samples": 4 * n}
        offsets, at = {}, 0
        for name, size in sizes.items():
            offsets[name], at = at, at + -(-size // 256) * 256
        stride = at
        arena = np.full(stride * len(models), 0xFF, np.uint8)  # NaNs where nothing was written
        for m, bufs in enumerate(models):
            names = ("x", "dout", "arg") if images is None else ("dout", "arg", "samples")
            for name in names:
                raw = np.ascontiguousarray(bufs[name]).view(np.uint8).ravel()
                arena[m * stride + offsets[name]:m * stride + offsets[name] + raw.size] = raw
        if images is not None:
            raw = np.ascontiguousarray(images, np.float32).view(np.uint8).ravel()
            arena[offsets["x"]:offsets["x"] + raw.size] = raw
        arena.tofile(self.folder / "arena.bin")
        layout = [*offsets.values()][:-1] + [offsets["samples"] if images is not None else -1]
        np.array([n, self.per_chunk, blocks, len(models), stride, *layout], np.int64).tofile(self.folder / "layout.bin")
        proc = subprocess.run([self.program, str(self.folder)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        out = np.fromfile(self.folder / "arena_out.bin", np.uint8)
        take = lambda m, name, count: out[m * stride + offsets[name]:][:4 * count].view(np.float32)  # noqa: E731
        return [(take(m, "dw", s.outs * s.taps), take(m, "db", s.outs)) for m in range(len(models))]


def inputs(rng, s: ConvPoolShape, n: int) -> dict:
    ho, wo = (s.hc // 2), (s.wc // 2)
    arg = rng.integers(0, 4, (n, s.outs, ho, wo)).astype(np.uint8)
    arg[rng.random(arg.shape) < 0.3] = 255  # the ReLU's off windows
    return {"x": rng.standard_normal((n, s.c, s.h, s.w)).astype(np.float32),
            "dout": rng.standard_normal((n, s.outs, ho, wo)).astype(np.float32), "arg": arg}


def reference(s: ConvPoolShape, bufs: dict) -> tuple[np.ndarray, np.ndarray]:
    """dW, db in float64 from the TF32 operands the kernel multiplies."""
    off = bufs["arg"] == 255
    routed = np.where(off, 0.0, tf32(bufs["dout"]))
    n = routed.shape[0]
    dconv = R.maxpool_backward(routed, np.where(off, 0, bufs["arg"]).astype(np.int64), 2, (n, s.outs, s.hc, s.wc))
    return R.conv_backward_filter(tf32(bufs["x"]), dconv, s.k), dconv.sum(axis=(0, 2, 3))


@pytest.mark.parametrize("case", list(CASES))
def test_weight_gradient_matches_float64_and_its_grids_agree_bit_for_bit(tmp_path, case, seed):
    n = CASES[case][-1]
    program = Program(CASES[case], tmp_path)
    s = program.s
    chunks = -(-n // program.per_chunk)
    assert chunks > REDUCE_SLICES
    rng = np.random.default_rng(seed)
    models = [inputs(rng, s, n) for _ in range(2)]
    by_chunk = program.run(models[:1], n, chunks)  # model 0 alone, a block a chunk: the one-model launch
    by_slice = program.run(models, n, REDUCE_SLICES)  # both models, a block a slice of chunks
    msg = f"{case}, seed {seed}"
    for m, bufs in enumerate(models):
        ref_dw, ref_db = reference(s, bufs)
        dw, db = by_slice[m]
        assert rel_err(dw, ref_dw.ravel()) < BOUND, f"{msg}, model {m}"
        assert rel_err(db, ref_db) < BOUND, f"{msg}, model {m}"
    assert by_chunk[0][0].tobytes() == by_slice[0][0].tobytes(), f"{msg}: dw, alone by chunks vs packed by slices"
    assert by_chunk[0][1].tobytes() == by_slice[0][1].tobytes(), f"{msg}: db, alone by chunks vs packed by slices"


@pytest.mark.parametrize("case", ["speedrun 1x28x28 5x5 → 24", "many taps 15x6x6 3x3 → 20", "odd 3x7x9 3x3 → 12"])
def test_the_weight_gradients_padded_image_gives_the_row_major_bits(tmp_path, case, seed, monkeypatch):
    """The staged image's padded strides (weight_grad_strides: rows, and channels where there are
    several) move its words only: dw and db have the row-major layout's bits."""
    n = CASES[case][-1]
    (tmp_path / "padded").mkdir(), (tmp_path / "row-major").mkdir()
    padded = Program(CASES[case], tmp_path / "padded")
    monkeypatch.setattr(convpool_tc, "WEIGHT_GRAD_PADDED_ROWS", False)
    row_major = Program(CASES[case], tmp_path / "row-major")
    (c, h, w, *_), s = CASES[case], padded.s
    assert (row_major.s.wg_row_stride, row_major.s.wg_channel_stride) == (w, h * w)
    assert (s.wg_row_stride, s.wg_channel_stride) != (w, h * w), f"{case}: the search keeps row-major"
    bufs = inputs(np.random.default_rng(seed), s, n)
    blocks = -(-n // padded.per_chunk)
    (dw, db), = padded.run([bufs], n, blocks)
    (dw_rm, db_rm), = row_major.run([bufs], n, blocks)
    msg = f"{case}, seed {seed}"
    assert rel_err(dw, reference(s, bufs)[0].ravel()) < BOUND, msg
    assert dw.tobytes() == dw_rm.tobytes() and db.tobytes() == db_rm.tobytes(), msg


def test_known_weight_gradient_strides_are_what_the_search_chooses():
    """KNOWN_WEIGHT_GRAD_STRIDES only saves the search at setup: each entry is the search's own choice."""
    for key, strides in convpool_tc.KNOWN_WEIGHT_GRAD_STRIDES.items():
        assert convpool_tc.weight_grad_strides(*key) == strides, key


def test_the_weight_gradients_b_loads_model_sees_the_row_conflicts():
    """At rows of 28 words the 1→24 5×5 layer's B loads are 2-way conflicted on some taps; the chosen
    strides load every one in one wavefront."""
    wavefronts = convpool_tc.wavefronts
    row_major = wavefronts(convpool_tc.weight_grad_b_reads(1, 28, 28, 5, 28, 784))
    padded = wavefronts(convpool_tc.weight_grad_b_reads(1, 28, 28, 5, 40, 1120))
    assert row_major.max() == 2 and padded.max() == 1 and len(padded) == 4 * 72 * 2


@pytest.mark.parametrize("case", ["speedrun 1x28x28 5x5 → 24", "odd 3x7x9 3x3 → 12"])
def test_the_weight_gradient_through_sample_indices_is_the_gathered_batchs_bit_for_bit(tmp_path, case, seed):
    """A first layer's batch read where it lies (`samples`: each model's indices into images every
    model shares) gives the bits of the same rows gathered into each model's x, on both grids."""
    n = CASES[case][-1]
    program = Program(CASES[case], tmp_path)
    s = program.s
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((n + 7, s.c, s.h, s.w)).astype(np.float32)
    models = []
    for _ in range(2):
        bufs = inputs(rng, s, n)
        bufs["samples"] = rng.integers(0, len(images), n).astype(np.int32)  # repeats too, as a tail batch's padding
        bufs["x"] = images[bufs["samples"]]
        models.append(bufs)
    chunks = -(-n // program.per_chunk)
    for blocks in (chunks, REDUCE_SLICES):
        through = program.run(models, n, blocks, images)
        gathered = program.run(models, n, blocks)
        for m in range(2):
            msg = f"{case}, seed {seed}, {blocks} blocks, model {m}"
            assert rel_err(through[m][0], reference(s, models[m])[0].ravel()) < BOUND, msg
            assert through[m][0].tobytes() == gathered[m][0].tobytes(), msg
            assert through[m][1].tobytes() == gathered[m][1].tobytes(), msg
