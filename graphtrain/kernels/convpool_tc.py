"""Launchers for convpool_tc.cu: convpool.cu's fused conv layer (conv + bias + 2×2 max-pool +
ReLU and its backward passes) as implicit GEMMs on the tensor cores, TF32 operands and fp32
sums; compiled once per layer shape. The launchers take the same arguments as ConvPool's, so a
model holds either; with `models` > 1 they train that many models at once (graphtrain.kernels'
model axis: every buffer per model, model_stride bytes apart, but a forward's input where
`shared_input` says every model reads the same x)."""

from __future__ import annotations

import functools

import numpy as np

from graphtrain.kernels import I32, I64, PTR, KernelFile, ceil_div, kernel, model_grid, model_stride_arg

WARPS = 8
THREADS = 32 * WARPS
REDUCE_SLICES = 8  # convpool_tc_reduce: chunk slices per block of 32 outputs
BATCH = 8  # loads a thread issues before it stores what they brought (staging, the chunk sums)
MAX_SHARED = 160 * 1024  # the kernels' dynamic shared memory limit, raised once (sm_80 allows 163 KiB)
BLOCKS_PER_SM = 4  # the forward grid: at most this many blocks an SM, looping over samples (the backward data's: BD_REGISTERS)
# Samples per block (chunk) of the weight gradient, one after another; the chunks are then summed
# in order. Measured on an H100 at batch 256 (scripts/probes/convpool_passes.py): 2 beat 1, 4 and 8
# for the 24→32 3×3 layer (16.25 µs against 17.33 at 1); on an H200 (scripts/probes/cnn_step_profile.py)
# 4 beats 2 there at 64 models (282 µs against 289) but not at one (17.4 against 14.4). With one input
# channel a sample is little work and its slices' sums are added once a chunk: 2 beats 1 at 64 models
# (the 1→24 5×5 layer: 285 µs against 318), 1 beats 2 at one model by 0.3 µs.
WEIGHT_GRAD_SAMPLES = 2
WEIGHT_GRAD_SAMPLES_ONE_CHANNEL = 2
# convpool_tc_weight_grad: n-tiles (8 taps each) a warp (TC_WG_NTW; a last group may have fewer). On an H200
# (scripts/probes/cnn_step_profile.py --models 64), the 24→32 3×3 layer at 7 (4 groups of two slices,
# every warp busy, against 7 groups of one, a warp idle, at 4): 625 µs against 292.
NTW = 4
# convpool_tc_backward_data: m-tiles (16 input positions) a warp's item, each k-step's B fragments and
# offsets loaded once for all of them (the 24→32 3×3 layer: 15 shared-memory wavefronts a k-step for 6
# mma at 2, against 11 for 3 at 1). Measured on an H200 (scripts/probes/cnn_step_profile.py), with the
# warps a block chosen per layer (9 at 1; 5 at 2: a sample's 5 items, the last of one m-tile): at 64
# models, bound by the shared-memory loads (92% of the L1's wavefronts at 1), 288 µs at 2 against 354
# at 1, the same at 56, 64 and 72 registers; at one model 12.2 µs at 2 against 10.6 at 1. dx's bits do
# not depend on it (each output's k-steps in order), so a launcher for one model takes BD_TILES and
# one for several BD_TILES_PACKED, and the packed models still match their runs alone.
BD_TILES = 1
BD_TILES_PACKED = 2
# convpool_tc_backward_data's warps a block (TC_BD_WARPS): None chooses them per layer
# (ConvPoolShape.backward_data_geometry), a number fixes them (8, the other kernels' WARPS: one warp
# of 8 takes the 24→32 3×3 layer's 9th m-tile while 7 wait at the next barrier).
BD_WARPS: int | None = None
# A backward-data thread's registers: its __launch_bounds__ blocks an SM (TC_BD_MIN_BLOCKS) are the
# blocks of its threads at this many in an SM's 64 Ki, within the SM's threads and shared memory;
# ptxas may then take up to 64 Ki / (blocks × threads). The 24→32 3×3 layer (sm_90, NVRTC 13.0, no
# spills at any of these; 54 KiB of shared memory a block, 4 blocks in an SM's 228 KiB): 56 gives 4
# blocks of 9 warps at 56 registers (36 warps, every one with an item a round); 64 gives 3 blocks
# of 9 at 72 (27 warps, the k-steps' loads issued further ahead); at 8 warps either gives the
# 8-warp block's 4 blocks at 64 registers (77 and three blocks an SM unbounded).
BD_REGISTERS = 56
BD_WARPS_RANGE = range(4, 17)  # the warps a backward-data block may have when chosen per layer
# convpool_tc_backward_data's next sample's pooled gradient and argmaxes loaded into registers while
# a block multiplies this one's (TC_BD_PREFETCH; where it stages one sample a round, at most BATCH
# windows a thread): 6 registers more through the k-steps at the 24→32 3×3 layer (no spills at 56).
# On an H200 (scripts/probes/cnn_step_profile.py --models 64) the 24→32 3×3 layer's backward data took
# 361 µs with it against 370 without (386 with 8 warps a block).
BD_PREFETCH = True
# The forward's samples a block stages a round (TC_SPB): None chooses them per layer
# (ConvPoolShape.samples_per_block), a number fixes them for every layer (where they fit). Measured on
# an H200 (scripts/probes/cnn_step_profile.py --models 64), the 24→32 3×3 layer's 25 windows a sample:
# 2 samples a round (7 groups of 8 windows, one turn of 8 warps) 246 µs, 1: 292, 3: 265, 5 (16 groups,
# two turns) 263; the 1→24 5×5 layer's 144: 4 samples 202 µs, 1: 253, 3: 210.
FORWARD_SAMPLES: int | None = None
# The forward's last k-step as m16n8k4 mma where it holds at most 4 taps (TC_TAIL_K4; the 1→24 5×5
# layer's 25 taps: its 4th k-step has one): an eighth less of that layer's A loads and products; the
# sums are the same terms (the k-step's other 4 are zero weights). On an H200 at 64 models
# (scripts/probes/cnn_step_profile.py) that layer took 192 µs with it against 197 without, with its B
# fragments in registers (201 with neither).
FORWARD_TAIL_K4 = True
# The most registers a forward lane gives to holding its B fragments (2 a k-step and n-tile: TC_B_REGS
# where they fit, ConvPoolShape.forward_b_registers), so that its k-steps load only A from shared memory;
# 0 keeps every layer's in shared memory.
FORWARD_B_REGISTERS = 32
# The forward's B fragments of two n-tiles one 16-byte load where they stay in shared memory and the
# n-tiles are even (TC_B_PAIRS; the 24→32 3×3 layer's 4): half its B loads' instructions.
FORWARD_B_PAIRS = True
# The forward's __launch_bounds__ blocks an SM (convpool_tc.cu's TC_MIN_BLOCKS): 2 caps a thread at 128
# registers, which its fully unrolled k-steps exceed unbounded (the 24→32 3×3 layer: 142, one block an SM),
# without spilling (127); 3 caps it at 80, spilling 72 to 168 bytes (on an H200 at 64 models: the 1→24
# 5×5 layer 263 µs against 202 at 2, the 24→32 3×3 327 against 263, five samples a round).
MIN_BLOCKS = 2
# The weight gradient's __launch_bounds__ blocks an SM (TC_WG_MIN_BLOCKS): 256 threads of at most 128
# registers, two blocks in an SM's 64 Ki registers (the speedrun's layers' shared memory allows two).
WEIGHT_GRAD_MIN_BLOCKS = 2
# The forward's staged image: image[c][y][x] at word c·CS + y·RS + x (convpool_tc.cu's TC_RS, TC_CS),
# the strides chosen per layer by forward_strides(): the fewest shared-memory wavefronts a round
# (its A loads and its staging stores, modelled below) within STRIDE_SLACK_WORDS more words than
# row-major. The speedrun's layers, row-major against chosen: 1→24 5×5, a sample (RS 51) 984 + 25
# against 672 + 52 (the A loads spread over the banks; rows of 51 words turn the staging's 16-byte
# stores into four 4-byte ones); 24→32 3×3, two samples (RS 12, CS 164) 2952 + 216 against
# 2808 + 240 (RS 13, CS 171 would load in 2784 but stage 4-way conflicted in 480). Measured on an
# H200 (cnn_step_profile.py --models 64), the 3×3 layer's forward at CS 164: 263 µs against 272 at
# CS 148 (five samples a round). PADDED_ROWS False: row-major (the A/B).
PADDED_ROWS = True
STRIDE_SLACK_WORDS = 1024  # 4 KiB a staged sample: the padding may cost samples a round, not more
# forward_strides' choice for the speedrun's layers, kept so a run does not search at setup;
# tests/test_convpool_tc_emulated.py checks each entry against the search.
KNOWN_STRIDES = {(1, 28, 28, 5): (51, 28 * 51), (24, 12, 12, 3): (12, 164)}
# The weight gradient's staged image (convpool_tc.cu's TC_WG_RS, TC_WG_CS), chosen per layer by
# weight_grad_strides(): the fewest wavefronts of its B loads (a tap of the lane's column at a conv
# position of its k) and staging stores a sample. The 1→24 5×5 layer row-major: 1008 B-load wavefronts
# a sample (rows of 28 words put the taps' rows a, a + 1 on each other's banks), at RS 40: 576, one a
# load (38 loads as few, but its rows' 16-byte staging stores are not aligned); the 24→32 3×3 layer's
# 728 are one a load row-major already. WEIGHT_GRAD_PADDED_ROWS False: row-major.
WEIGHT_GRAD_PADDED_ROWS = True
KNOWN_WEIGHT_GRAD_STRIDES = {(1, 28, 28, 5): (40, 28 * 40), (24, 12, 12, 3): (12, 144)}


def wavefronts(words: np.ndarray) -> np.ndarray:
    """Shared-memory wavefronts of each row of `words` (one warp-wide 32-bit access, a word a
    lane): the most distinct words any of the 32 banks serves (lanes reading one word share it)."""
    s = np.sort(words, axis=-1)
    distinct = np.ones_like(s, bool)
    distinct[..., 1:] = s[..., 1:] != s[..., :-1]
    flat = s.reshape(-1, 32)
    rows = np.repeat(np.arange(flat.shape[0]), 32)
    counts = np.bincount(rows * 32 + flat.ravel() % 32, weights=distinct.ravel(), minlength=flat.shape[0] * 32)
    return counts.reshape(*words.shape[:-1], 32).max(-1).astype(np.int64)


def forward_round_samples(c: int, h: int, w: int, k: int) -> int:
    """The samples of a forward round as the wavefront model takes them: the most whose groups of 8
    windows fit one turn of the WARPS warps, else 1 (ConvPoolShape.samples_per_block's choice where
    a sample's groups fit a turn; where they do not, the groups of later samples repeat the first's
    pattern only when the plane is a multiple of 8, as the speedrun's 1→24 5×5 layer's 144 is)."""
    plane = ((h - k + 1) // 2) * ((w - k + 1) // 2)
    return max(1, WARPS * 8 // plane)


def forward_a_reads(c: int, h: int, w: int, k: int, samples: int) -> np.ndarray:
    """(c', y, x) of the image word each lane of each forward A load reads in a round of `samples`
    samples (c' = sample·c + c: the samples' images follow one another as their channels do): an
    array (loads, 3, 32). Lane (g, t) of group j's k-step ks, tap pair p and m-tile u reads window
    f = 8j + g of the round's windows in order (sample f / plane, window f mod plane; past the
    round: sample 0's window 0, as the kernel) at conv position (2wy + u, 2wx + v) and tap
    ks·8 + t + 4p = (c, a, b): word (c, 2wy + a + u, 2wx + b + v); taps past the sum read tap 0."""
    wo, plane, taps = (w - k + 1) // 2, ((h - k + 1) // 2) * ((w - k + 1) // 2), c * k * k
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    out = []
    for group in range(_c(samples * plane, 8)):
        at = group * 8 + g
        sample, win = divmod(np.where(at < samples * plane, at, 0), plane)
        wy, wx = win // wo, win % wo
        for ks in range(_c(taps, 8)):
            for pair in range(2):
                tap = np.where(ks * 8 + t + 4 * pair < taps, ks * 8 + t + 4 * pair, 0)
                ch, a, b = sample * c + tap // (k * k), tap // k % k, tap % k
                for u in range(2):
                    for v in range(2):
                        out.append((ch, 2 * wy + a + u, 2 * wx + b + v))
    return np.array(out)


def staging_wavefronts(c: int, h: int, w: int, rs: int, cs: int) -> int:
    """A sample's staging stores' wavefronts (convpool_tc.cu's stage_rows_tf32 over its c·h rows of
    w words): with w a multiple of 4, thread q stores words 4q..4q+3 of the rows in order, one
    16-byte store where RS and CS keep them 16-byte aligned (served a quarter warp at a time), else
    four 4-byte ones; other widths one 4-byte store an element."""
    per = 4 if w % 4 == 0 else 1
    e = per * np.arange(c * h * w // per)
    r = e // w
    first = (r // h) * cs + (r % h) * rs + e % w

    def lanes(n: int) -> np.ndarray:  # rows of n lanes; a last row's idle lanes store nothing: as lane 0
        rows = np.concatenate([first, np.full(-len(first) % n, -1)]).reshape(-1, n)
        return np.where(rows < 0, rows[:, :1], rows)

    if per == 4 and rs % 4 == 0 and cs % 4 == 0:  # 8 lanes × 4 words a wavefront at best
        return int(wavefronts((lanes(8)[:, :, None] + np.arange(4)).reshape(-1, 32)).sum())
    return int(sum(wavefronts(lanes(32) + j).sum() for j in range(per)))


@functools.lru_cache(maxsize=None)
def forward_strides(c: int, h: int, w: int, k: int) -> tuple[int, int]:
    """(RS, CS) of the forward's staged image: of RS in w..w+31 and CS in h·RS..h·RS+31 (a single
    channel: h·RS) within STRIDE_SLACK_WORDS words more than row-major, the fewest A-load plus
    staging wavefronts a round (forward_round_samples), ties to the fewest words, then to the
    smallest RS. A load's banks depend on (RS, CS) mod 32 only: those cover every pattern."""
    samples = forward_round_samples(c, h, w, k)
    reads = forward_a_reads(c, h, w, k, samples)
    ch, y, x = reads[:, 0], reads[:, 1], reads[:, 2]
    return _cheapest_strides(c, h, w, lambda rs, cs: int(wavefronts(ch * cs + y * rs + x).sum())
                             + samples * staging_wavefronts(c, h, w, rs, cs))


def _cheapest_strides(c: int, h: int, w: int, cost) -> tuple[int, int]:
    """Of RS in w..w+31 and CS in h·RS..h·RS+31 (a single channel: h·RS) within STRIDE_SLACK_WORDS
    words more than row-major, the (RS, CS) of the least cost(RS, CS), ties to the fewest words, then
    to the smallest RS."""
    best = None
    for rs in range(w, w + 32):
        for cs in [h * rs] if c == 1 else range(h * rs, h * rs + 32):
            if c * cs > c * h * w + STRIDE_SLACK_WORDS:
                break
            key = (cost(rs, cs), c * cs)
            if best is None or key < best[0]:
                best = (key, rs, cs)
    return best[1], best[2]


def weight_grad_b_reads(c: int, h: int, w: int, k: int, rs: int, cs: int) -> np.ndarray:
    """The word each lane of each weight-gradient B load reads in a sample's image staged at row
    stride rs and channel stride cs: an array (loads, 32). Lane (g, t) of n-tile j's k-step ks, pair p
    reads tap j·8 + g = (c, a, b) (past the taps: tap 0's word) at conv position k = ks·8 + t + 4p =
    4·win + u·2 + v, (2wy + u, 2wx + v) (past the windows: word 0): word c·cs + (2wy + u + a)·rs +
    2wx + v + b (convpool_tc.cu's xcol plus winpair)."""
    wo, plane, taps = (w - k + 1) // 2, ((h - k + 1) // 2) * ((w - k + 1) // 2), c * k * k
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    tiles, steps = _c(taps + 1, 8), _c(4 * plane, 8)
    tap = np.arange(tiles)[:, None, None, None] * 8 + g                        # (tiles, 1, 1, 32)
    tap = np.where(tap < taps, tap, 0)
    col = tap // (k * k) * cs + tap // k % k * rs + tap % k
    pos = np.arange(steps)[None, :, None, None] * 8 + t + 4 * np.arange(2)[None, None, :, None]
    win, u, v = pos // 4, pos // 2 % 2, pos % 2
    row = np.where(pos < 4 * plane, (2 * (win // wo) + u) * rs + 2 * (win % wo) + v, 0)
    return (col + row).reshape(-1, 32)


@functools.lru_cache(maxsize=None)
def weight_grad_strides(c: int, h: int, w: int, k: int) -> tuple[int, int]:
    """(RS, CS) of the weight gradient's staged image: of RS in w..w+31 and CS in h·RS..h·RS+31 (a
    single channel: h·RS) within STRIDE_SLACK_WORDS words more than row-major, the fewest B-load plus
    staging wavefronts a sample, ties to the fewest words, then to the smallest RS."""
    return _cheapest_strides(c, h, w, lambda rs, cs: int(wavefronts(weight_grad_b_reads(c, h, w, k, rs, cs)).sum())
                             + staging_wavefronts(c, h, w, rs, cs))


def _c(n: int, d: int) -> int:
    return ceil_div(n, d)


class ConvPoolShape:
    """A layer's sizes as convpool_tc.cu derives them, and each kernel's shared memory in bytes."""

    def __init__(self, c: int, h: int, w: int, k: int, outs: int):
        self.c, self.h, self.w, self.k, self.outs = c, h, w, k, outs
        self.hc, self.wc = h - k + 1, w - k + 1
        self.plane = (self.hc // 2) * (self.wc // 2)
        self.image, self.taps = c * h * w, c * k * k
        self.row_stride, self.channel_stride = self.forward_strides()
        self.wg_row_stride, self.wg_channel_stride = self.weight_grad_strides()

    def forward_strides(self) -> tuple[int, int]:
        """The forward's staged image's row and channel strides in words (TC_RS, TC_CS)."""
        return self._strides(PADDED_ROWS, KNOWN_STRIDES, forward_strides)

    def weight_grad_strides(self) -> tuple[int, int]:
        """The weight gradient's staged image's row and channel strides in words (TC_WG_RS, TC_WG_CS)."""
        return self._strides(WEIGHT_GRAD_PADDED_ROWS, KNOWN_WEIGHT_GRAD_STRIDES, weight_grad_strides)

    def _strides(self, padded: bool, known: dict, search) -> tuple[int, int]:
        """Row-major where not `padded`; else `known`'s entry for the layer, or `search`'s choice."""
        if not padded:
            return self.w, self.h * self.w
        key = (self.c, self.h, self.w, self.k)
        rs, cs = known[key] if key in known else search(*key)
        assert rs >= self.w and cs >= self.h * rs, (rs, cs)
        return rs, cs

    def fragment_words(self, k: int, cols: int) -> int:
        """A GEMM's B operand (k rows, cols columns) staged as the mma's lanes take it
        (convpool_tc.cu's stage_fragments): 64 words a k-step of 8 and n-tile of 8."""
        return _c(k, 8) * _c(cols, 8) * 64

    def forward_words(self, spb: int) -> int:
        """B fragments of the filters, two tap offsets a k-step's lane pair, spb images of
        c·channel_stride words (convpool_tc.cu's XS_WORDS)."""
        return self.fragment_words(self.taps, self.outs) + _c(self.taps, 8) * 8 + spb * self.c * self.channel_stride

    def forward_b_registers(self) -> bool:
        """Whether a forward lane holds its B fragments in registers (TC_B_REGS): 2 words a k-step
        and n-tile, at most FORWARD_B_REGISTERS (the 1→24 5×5 layer's 4 × 3: 24; the 24→32 3×3's
        27 × 4: 216, which stay in shared memory)."""
        return 2 * _c(self.taps, 8) * _c(self.outs, 8) <= FORWARD_B_REGISTERS

    def backward_data_words(self, spb: int) -> int:
        """B fragments of the filters (k = (o, a, b), columns c), two dcp offsets a k-step's lane
        pair, spb padded conv gradients (a channel's plane rounded up to ≡ 16 words mod 32: DCS)."""
        kk, plane = self.outs * self.k * self.k, (self.hc + 2 * self.k - 2) * (self.wc + 2 * self.k - 2)
        return self.fragment_words(kk, self.c) + _c(kk, 8) * 8 + spb * self.outs * (plane + (48 - plane % 32) % 32)

    def weight_grad_groups(self) -> int:
        """convpool_tc_weight_grad's n-tile groups (of NTW tiles of 8 taps, the bias one more tap)."""
        return _c(_c(self.taps + 1, 8), NTW)

    def weight_grad_words(self) -> int:
        """convpool_tc_weight_grad's shared words: dconv's rows (or the slices' sums), the running
        sums of a block's chunks, the next sample as copied (where its parts are whole 16-byte
        pieces: convpool_tc.cu's ASYNC_STAGE), the image at its strides (even words), a k-step's two
        windows' offsets, the sample indices' address (2 words)."""
        kt, mt, groups = _c(4 * self.plane, 8), _c(self.outs, 16), self.weight_grad_groups()
        slices = WARPS // groups
        red = slices * groups * mt * NTW * 128 if slices > 1 else 0
        routed = self.outs * self.plane
        raw = self.image + routed + routed // 4 if self.image % 4 == 0 and routed % 16 == 0 else 0
        staged = self.c * self.wg_channel_stride
        return max(mt * 16 * (kt * 8 + 4), red) + groups * mt * NTW * 128 + raw + 2 * _c(staged, 2) + kt * 2 + 2

    def samples_per_block(self, words, sm_shared: int) -> int:
        """Samples a forward block stages a round (FORWARD_SAMPLES where set), within MAX_SHARED and
        an SM's sm_shared bytes for MIN_BLOCKS blocks (each 1 KiB more). A round's windows run in
        groups of 8, a warp's item (convpool_tc.cu). Where a sample's groups fit one turn of the
        WARPS warps: the most samples whose groups still do (conv1's 25 windows: 2 samples, 7
        groups); else the fewest of the busiest (busy: the windows over a round's turns × WARPS × 8;
        conv0's 144 windows: 4 samples, 72 groups in 9 full turns); at least 1."""
        limit = min(MAX_SHARED, sm_shared // MIN_BLOCKS - 1024)
        fitting = [spb for spb in range(1, 2 * WARPS + 1) if spb == 1 or 4 * words(spb) <= limit]
        if FORWARD_SAMPLES:
            return min(FORWARD_SAMPLES, fitting[-1])
        if _c(self.plane, 8) <= WARPS:  # a sample's groups fit one turn
            return min(forward_round_samples(self.c, self.h, self.w, self.k), fitting[-1])

        def busy(spb: int) -> float:
            return spb * self.plane / (_c(_c(spb * self.plane, 8), WARPS) * WARPS * 8)
        return min(fitting, key=lambda spb: (-busy(spb), spb))

    def backward_data_samples(self, warps: int, tiles: int) -> int:
        """Samples a backward-data block of `warps` warps stages at once: about one item (`tiles`
        m-tiles of 16 input positions) a warp, within half the shared memory limit; at least 1 (the
        24→32 3×3 layer: 1; two do not fit half the limit)."""
        spb = max(1, round(warps / self.backward_data_items(tiles)))
        while spb > 1 and 4 * self.backward_data_words(spb) > MAX_SHARED // 2:
            spb -= 1
        return spb

    def backward_data_items(self, tiles: int) -> int:
        """A sample's backward-data items: its input positions' m-tiles of 16, `tiles` an item (TC_BD_MTW)."""
        return _c(_c(self.h * self.w, 16), tiles)

    def backward_data_geometry(self, sm_shared: int, sm_registers: int, sm_threads: int,
                               tiles: int) -> tuple[int, int, int]:
        """The backward data's (warps a block, samples a round, blocks an SM), on an SM of sm_shared
        bytes of shared memory, sm_registers registers and sm_threads threads (the device's): with
        BD_WARPS None the warps in BD_WARPS_RANGE that keep the most warps of an SM busy in a round
        of items, ties to the fewest. Busy warps = blocks an SM × warps × busy, busy = a round's
        items / (its turns × warps), blocks an SM from BD_REGISTERS and the shared memory. A round's
        items all take as long (each every k-step, in order) and a block waits for its last at the
        barrier before the next scatter, so a warp without an item in a turn idles through it. The
        24→32 3×3 layer on an H100 (9 items a sample, one sample a round, 56 registers): 8 warps, 4
        blocks, 2 turns, 9/16 busy: 18 busy warps; 9 warps, 4 blocks, 1 turn: 36; 10: 3 blocks, 27;
        16: 2 blocks, 18. Two samples a round (18 items) do not fit half the shared memory limit (nor
        two blocks of them an SM's: 2 × 26.6 KB of conv gradients + 27.6 KB of B fragments), so 8
        warps cannot take whole turns of items."""
        items = self.backward_data_items(tiles)

        def geometry(warps: int) -> tuple[int, int, int]:
            spb, threads = self.backward_data_samples(warps, tiles), 32 * warps
            blocks = min(sm_registers // (threads * BD_REGISTERS), sm_threads // threads,
                         sm_shared // (4 * self.backward_data_words(spb) + 1024))
            return warps, spb, max(1, blocks)

        def busy_warps(g: tuple[int, int, int]) -> float:
            warps, spb, blocks = g
            return blocks * spb * items / _c(spb * items, warps)

        choices = [geometry(BD_WARPS)] if BD_WARPS else [geometry(w) for w in BD_WARPS_RANGE]
        return max(choices, key=lambda g: (busy_warps(g), -g[0]))


def samples_per_round(capacity: int, n: int, grid: int) -> int:
    """convpool_tc.cu's samples_per_round: what a block of the grid's stages a round, at most its capacity."""
    return min(capacity, ceil_div(n, grid))


def fits(c: int, h: int, w: int, outs: int, k: int, stride: int, padding: int, pool: int, first: bool) -> bool:
    """Whether a layer can run as these kernels: stride 1, no padding, pool 2 (a tile's rows are
    pairs of a window's positions), and each kernel's staging within the shared memory limit."""
    if stride != 1 or padding != 0 or pool != 2 or h - k + 1 < 2 or w - k + 1 < 2:
        return False
    s = ConvPoolShape(c, h, w, k, outs)
    return (4 * s.forward_words(1) <= MAX_SHARED and 4 * s.weight_grad_words() <= MAX_SHARED
            and s.weight_grad_groups() <= WARPS and (first or 4 * s.backward_data_words(1) <= MAX_SHARED))


def layer_defines(s: ConvPoolShape, spb: int, bd_tiles: int, bd: tuple[int, int, int]) -> dict[str, int]:
    """convpool_tc.cu's defines for layer s: the forward staging spb samples a round, the backward data
    bd = (warps a block, samples a round, blocks an SM) with bd_tiles m-tiles an item."""
    return {"TC_C": s.c, "TC_H": s.h, "TC_W": s.w, "TC_K": s.k, "TC_OUTS": s.outs,
            "TC_RS": s.row_stride, "TC_CS": s.channel_stride, "TC_WG_RS": s.wg_row_stride,
            "TC_WG_CS": s.wg_channel_stride, "TC_SPB": spb, "TC_BD_SPB": bd[1], "TC_BD_MTW": bd_tiles,
            "TC_BD_WARPS": bd[0], "TC_BD_MIN_BLOCKS": bd[2], "TC_BD_PREFETCH": int(BD_PREFETCH), "TC_WG_NTW": NTW,
            "TC_MIN_BLOCKS": MIN_BLOCKS, "TC_TAIL_K4": int(FORWARD_TAIL_K4), "TC_B_REGS": int(s.forward_b_registers()),
            "TC_B_PAIRS": int(FORWARD_B_PAIRS)}


class ConvPoolTc(KernelFile):
    stem = "convpool_tc"
    headers = ("tf32_mma.cuh", "model_axis.cuh", "async_copy.cuh")
    defines = {"TC_C": 24, "TC_H": 12, "TC_W": 12, "TC_K": 3, "TC_OUTS": 32, "TC_RS": 12, "TC_CS": 144, "TC_WG_RS": 12, "TC_WG_CS": 144, "TC_WARPS": WARPS, "TC_SPB": 2,
               "TC_BD_SPB": 1, "TC_BD_MTW": BD_TILES, "TC_BD_WARPS": WARPS, "TC_BD_MIN_BLOCKS": BLOCKS_PER_SM, "TC_BD_PREFETCH": 0, "TC_REDUCE_SLICES": REDUCE_SLICES,
               "TC_BATCH": BATCH, "TC_MIN_BLOCKS": MIN_BLOCKS, "TC_WG_MIN_BLOCKS": WEIGHT_GRAD_MIN_BLOCKS, "TC_WG_NTW": NTW,
               "TC_TAIL_K4": 0, "TC_B_REGS": 0, "TC_B_PAIRS": 0}
    _convpool_tc_forward = kernel("convpool_tc_forward", PTR, PTR, PTR, PTR, PTR, PTR, I32, I64, I64,
                                  max_shared_bytes=MAX_SHARED)
    _convpool_tc_backward_data = kernel("convpool_tc_backward_data", PTR, PTR, PTR, PTR, I32, I64,
                                        max_shared_bytes=MAX_SHARED)
    _convpool_tc_weight_grad = kernel("convpool_tc_weight_grad", PTR, PTR, PTR, PTR, PTR, I32, I32, I64,
                                      max_shared_bytes=MAX_SHARED)
    _convpool_tc_reduce = kernel("convpool_tc_reduce", PTR, PTR, PTR, I32, I64)
    note = "TF32 tensor cores, fp32 sums (convpool_tc.cu's fused conv+bias+pool+ReLU implicit GEMMs)"
    reads_samples = True  # the forward and weight gradient read a batch through its sample indices (`samples`)

    def __init__(self, device, c: int, h: int, w: int, k: int, pool: int, outs: int, models: int = 1):
        if not fits(c, h, w, outs, k, 1, 0, pool, first=False) and not fits(c, h, w, outs, k, 1, 0, pool, True):
            raise ValueError(f"a {c}×{h}×{w} input, {outs} {k}×{k} filters and pool {pool} do not fit convpool_tc.cu")
        self.shape = s = ConvPoolShape(c, h, w, k, outs)
        self.spb = s.samples_per_block(s.forward_words, device.sm_shared_bytes)
        self.spb_alone = max(1, round(WARPS / ceil_div(s.plane, 8)))  # a one-model launch's blocks: about a sample's groups a warp
        # the backward data's block: bd_tiles m-tiles an item, bd_warps warps, bd_spb samples a round,
        # bd_blocks blocks an SM (launches of `models` models)
        self.bd_tiles = BD_TILES_PACKED if models > 1 else BD_TILES
        self.bd_warps, self.bd_spb, self.bd_blocks = s.backward_data_geometry(
            device.sm_shared_bytes, device.sm_registers, device.sm_threads, self.bd_tiles)
        super().__init__(device, layer_defines(s, self.spb, self.bd_tiles, (self.bd_warps, self.bd_spb, self.bd_blocks)))
        self.c, self.k, self.pool, self.outs = c, k, pool, outs
        self.taps = s.taps
        self.chunk = WEIGHT_GRAD_SAMPLES_ONE_CHANNEL if c == 1 else WEIGHT_GRAD_SAMPLES
        self.max_blocks = BLOCKS_PER_SM * device.sm_count  # the forward's one wave
        self.weight_grad_slots = WEIGHT_GRAD_MIN_BLOCKS * device.sm_count  # the weight gradient's blocks at once

    def chunks(self, n: int) -> int:
        """Chunks of samples of the weight gradient: its partial sums are at most outs × chunks × (taps + 1)."""
        return ceil_div(n, self.chunk)

    def weight_grad_blocks(self, n: int, models: int) -> int:
        """A model's blocks of the weight gradient, each one partial sum: one a chunk, or, where the
        models fill every SM's WEIGHT_GRAD_MIN_BLOCKS at REDUCE_SLICES blocks each, REDUCE_SLICES
        blocks, block r adding the chunks ≡ r (mod REDUCE_SLICES) in order as the reduce would: the
        same bits (convpool_tc.cu), 1/16 to 1/32 of the partials' traffic at the speedrun's batch, and a
        block's fixed costs (its start, zeroing dconv's rows) paid once for many samples. Only these
        two counts keep the reduce's order, so the sums do not depend on `models`."""
        chunks = self.chunks(n)
        if chunks > REDUCE_SLICES and models * REDUCE_SLICES >= self.weight_grad_slots:
            return REDUCE_SLICES
        return chunks

    def _grid(self, n: int, spb: int, models: int, max_blocks: int) -> int:
        """A model's blocks of the forward or backward data: spb samples each, the launch's blocks over
        all models at most max_blocks (an SM's blocks times the SMs: one wave); past that each block
        loops over rounds of samples (samples_per_round), staging the filters once (64 models × 256 samples: 8 blocks a model, 32
        samples each, rather than 256 blocks each staging every filter for one or two samples)."""
        return max(1, min(ceil_div(n, spb), max_blocks // models))

    def _check(self, outs: int, h: int, wd: int) -> None:
        s = self.shape
        if (outs, h, wd) != (s.outs, s.h, s.w):
            raise ValueError(f"convpool_tc was built for {s.outs} outputs of a {s.h}×{s.w} input, not {outs} of {h}×{wd}")

    def forward(self, stream, x: int, w: int, b: int, out: int, arg: int, n: int, outs: int, h: int,
                wd: int, models: int = 1, model_stride: int = 0, shared_input: bool = False,
                samples: int = 0) -> None:
        """out = ReLU(maxpool(conv(x, w) + b)) and each window's argmax, n samples of c×h×wd;
        `shared_input`: every model reads the same x (the test images); `samples` (per model, n
        int32): sample s is image samples[s] of x, which every model shares (the training set)."""
        self._check(outs, h, wd)
        stride = model_stride_arg(models, model_stride)
        grid = self._grid(n, self.spb_alone, models, self.max_blocks)
        self._convpool_tc_forward(stream, model_grid(grid, models), THREADS, x, samples, w, b, out, arg, n,
                                  0 if shared_input or samples else stride, stride,
                                  shared_bytes=4 * self.shape.forward_words(samples_per_round(self.spb, n, grid)))

    def weight_grad(self, stream, x: int, dout: int, arg: int, partial: int, dw: int, db: int, n: int, outs: int,
                    h: int, wd: int, models: int = 1, model_stride: int = 0, samples: int = 0) -> None:
        """dw, db from the pooled gradient dout: a partial sum a block (partial: outs × chunks ×
        (taps + 1) floats, the first `weight_grad_blocks` chunks' worth written), then their sum in order;
        `samples` as the forward's."""
        self._check(outs, h, wd)
        stride = model_stride_arg(models, model_stride)
        blocks = self.weight_grad_blocks(n, models)
        self._convpool_tc_weight_grad(stream, model_grid(blocks, models), THREADS, x, samples, dout, arg, partial, n,
                                      self.chunk, stride, shared_bytes=4 * self.shape.weight_grad_words())
        self._convpool_tc_reduce(stream, model_grid(ceil_div(outs * (self.taps + 1), 32), models),
                                 32 * REDUCE_SLICES, partial, dw, db, blocks, stride)

    def backward_data(self, stream, dout: int, arg: int, w: int, dx: int, n: int, outs: int, h: int, wd: int,
                      models: int = 1, model_stride: int = 0) -> None:
        """dx (n×c×h×wd): the gradient of the layer's input from its pooled gradient."""
        self._check(outs, h, wd)
        stride = model_stride_arg(models, model_stride)
        # its one wave: bd_blocks an SM, max_blocks' share of them (a smaller max_blocks, fewer)
        grid = self._grid(n, self.bd_spb, models, max(1, self.max_blocks * self.bd_blocks // BLOCKS_PER_SM))
        self._convpool_tc_backward_data(stream, model_grid(grid, models), 32 * self.bd_warps, dout, arg, w, dx, n, stride,
                                        shared_bytes=4 * self.shape.backward_data_words(
                                            samples_per_round(self.bd_spb, n, grid)))
