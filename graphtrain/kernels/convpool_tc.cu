// convpool.cu's fused conv layer (conv + bias + 2×2 max-pool + ReLU, the backward passes from the
// pooled gradient and each window's argmax) as implicit GEMMs on the tensor cores: TF32 operands
// (each rounded to nearest by cvt.rna), fp32 sums, mma.sync m16n8k8 (tf32_mma.cuh's mma_tf32).
// One build per layer shape: TC_C input channels of TC_H × TC_W, TC_K × TC_K filters, TC_OUTS
// output channels, stride 1, no padding, pool 2; blocks of TC_WARPS warps. Every sum feeding
// the weights runs in a fixed order, without atomics. Tensors NCHW, filters KCHW, as convpool.cu.
// Model axis (model_axis.cuh, put before this file by the launcher): every kernel's buffers are
// per model (the forward's input x moves by its own x_stride: 0 where every model reads the same
// images); blockIdx.z is the model, the grids' x (and the loops over it) are a model's own.
// Sample indices: where `samples` is not null, the forward's and the weight gradient's sample s is
// image samples[s] of x (the training set every model shares; samples per model: its batch's
// indices), so a first layer reads its batch where it lies, with no gathered copy; else image s.

// TC_MIN_BLOCKS: the blocks an SM is to hold of the forward (its registers bound it, its staging
// does not): 1 leaves ptxas its choice (more than 128 registers with every k-step unrolled: one block
// at the 24→32 3×3 layer); 2 caps a thread at 128; 3 at 80, spilling 72 to 168 bytes, for more
// warps to hide latency with. TC_WG_MIN_BLOCKS: the
// same for the weight gradient (2: at most 128 registers, which its loop over chunks exceeds unbounded).
// TC_BD_WARPS, TC_BD_MIN_BLOCKS, TC_BD_MTW: the backward data's warps a block, blocks an SM and m-tiles
// a warp's item (the launcher's backward_data_geometry, BD_REGISTERS, BD_TILES say why).
#define RELU_OFF 255
#define HC (TC_H - TC_K + 1)  // conv output
#define WC (TC_W - TC_K + 1)
#define HO (HC / 2)  // pooled output (a last odd conv row or column is in no window)
#define WO (WC / 2)
#define PLANE (HO * WO)
#define IMAGE (TC_C * TC_H * TC_W)
// The forward's staged image: image[c][y][x] at word c·TC_CS + y·TC_RS + x (TC_RS ≥ TC_W, TC_CS ≥
// TC_H·TC_RS: padded rows and channels, the launcher's ConvPoolShape.forward_strides). A's loads read
// 8 windows 2 words apart at 4 taps' offsets; strides other than W and H·W move the taps' rows and
// channels to other banks (scripts/probes/convpool_tc_banks.py counts each load's wavefronts).
#define XS_WORDS (TC_C * TC_CS)
#define KK (TC_K * TC_K)
#define TAPS (TC_C * KK)
#define THREADS (TC_WARPS * 32)
#define BD_THREADS (TC_BD_WARPS * 32)  // the backward data's block

__device__ __forceinline__ unsigned tf32(float v) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
    return r;
}

// store(e, load(e)) for e < count over the block's BLOCK threads, each thread's TC_BATCH loads issued
// before its stores: a staging loop waits on global memory's latency once a batch, not once an
// element (a strided loop's trip count is unknown, so the compiler does not batch it itself).
template <int BLOCK = THREADS, class Load, class Store>
__device__ __forceinline__ void batched(int count, Load load, Store store) {
    for (int base = threadIdx.x; base < count; base += BLOCK * TC_BATCH) {
        decltype(load(0)) v[TC_BATCH];
#pragma unroll
        for (int u = 0; u < TC_BATCH; ++u)
            if (base + u * BLOCK < count) v[u] = load(base + u * BLOCK);
#pragma unroll
        for (int u = 0; u < TC_BATCH; ++u)
            if (base + u * BLOCK < count) store(base + u * BLOCK, v[u]);
    }
}
// d[0..3] = TF32(v): a staged quad of one row.
__device__ __forceinline__ void store_tf32(unsigned* d, float4 v) {
    d[0] = tf32(v.x);
    d[1] = tf32(v.y);
    d[2] = tf32(v.z);
    d[3] = tf32(v.w);
}
// row(r)[c] = TF32(src_row(r)[c]) for r < rows, c < COLS: 16-byte loads where COLS is a multiple of 4
// and `base` (where the rows are: every row at base plus a multiple of COLS floats) 16-byte aligned
// (the four then share a row), else one float a load.
template <int COLS, class Row, class SrcRow>
__device__ __forceinline__ void stage_rows_tf32_from(Row row, SrcRow src_row, int rows, const float* base) {
    if (COLS % 4 == 0 && (reinterpret_cast<unsigned long long>(base) & 15) == 0) {
        batched(rows * COLS / 4, [&](int q) { return *reinterpret_cast<const float4*>(src_row(4 * q / COLS) + 4 * q % COLS); },
                [&](int q, float4 v) { store_tf32(row(4 * q / COLS) + 4 * q % COLS, v); });
    } else {
        batched(rows * COLS, [&](int e) { return src_row(e / COLS)[e % COLS]; },
                [&](int e, float v) { row(e / COLS)[e % COLS] = tf32(v); });
    }
}
// The same from rows one after another at src (src[r·COLS + c]); its loads index src directly (as
// the other's, through src_row, cost the weight gradient's 1→24 layer registers it spilled).
template <int COLS, class Row>
__device__ __forceinline__ void stage_rows_tf32(Row row, const float* __restrict__ src, int rows) {
    if (COLS % 4 == 0 && (reinterpret_cast<unsigned long long>(src) & 15) == 0) {
        const float4* src4 = reinterpret_cast<const float4*>(src);
        batched(rows * COLS / 4, [&](int q) { return src4[q]; },
                [&](int q, float4 v) { store_tf32(row(4 * q / COLS) + 4 * q % COLS, v); });
    } else {
        batched(rows * COLS, [&](int e) { return src[e]; },
                [&](int e, float v) { row(e / COLS)[e % COLS] = tf32(v); });
    }
}
// B operands laid out as the mma's lanes take them: word ((ks·NT + nt)·32 + lane)·2 + j holds
// B[ks·8 + t + 4j][nt·8 + g] (g = lane / 4, t = lane % 4), so a lane's b0, b1 for one n-tile are
// one 8-byte load, and a warp's 32 loads cover 256 consecutive bytes (no bank conflicts).
// Every word of the KT × NT fragments, as above: B[k][col] = TF32(src[at(k, col)]) for
// k < k_count and col < col_count, zeros elsewhere (rows past the sum, columns never written). The
// block's BLOCK threads take the words in order (stores to consecutive words: no bank conflicts; the loads of a
// warp's 32 words fall in 4 columns × 8 rows of src, a few sectors, from L2 after the first block).
// PAIRS (NT even): n-tiles 2p and 2p + 1 side by side, word ((ks·NT/2 + p)·32 + lane)·4 + 2h + j holding
// B[ks·8 + t + 4j][(2p + h)·8 + g]: a lane's fragments of two n-tiles one 16-byte load.
template <int KT, int NT, int BLOCK = THREADS, bool PAIRS = false, class At>
__device__ __forceinline__ void stage_fragments(unsigned* dst, const float* __restrict__ src, At at, int k_count,
                                                int col_count) {
    static_assert(!PAIRS || NT % 2 == 0, "stage_fragments: n-tiles in pairs need an even count");
    batched<BLOCK>(KT * NT * 64, [&](int e) {
        const int lane = PAIRS ? (e >> 2) & 31 : (e >> 1) & 31;
        const int ks = PAIRS ? (e >> 7) / (NT / 2) : (e >> 6) / NT;
        const int nt = PAIRS ? (e >> 7) % (NT / 2) * 2 + ((e >> 1) & 1) : (e >> 6) % NT;
        const int k = ks * 8 + (lane & 3) + 4 * (e & 1), col = nt * 8 + (lane >> 2);
        return k < k_count && col < col_count ? src[at(k, col)] : 0.0f;
    }, [&](int e, float v) { dst[e] = tf32(v); });
}
// A block's samples a round: up to `capacity` (what its shared memory stages), as many as its share
// of the n samples when the launch has fewer blocks than samples (each then stages the filters once
// for several rounds).
__device__ __forceinline__ int samples_per_round(int capacity, int n) {
    return min(capacity, (n + (int)gridDim.x - 1) / (int)gridDim.x);
}

// ---- forward ------------------------------------------------------------------------------------
// conv[s, o, y, x] = Σ_tap A[(y, x), tap]·B[tap, o] with A the im2col of x (tap = (c, a, b):
// x[s, c, y + a, x + b]) and B[tap, o] = w[o, tap]. A tile's 16 rows are 8 pool windows: row g
// is conv position (2wy + u, 2wx) of window g, row g + 8 is (2wy + u, 2wx + 1), and the two
// m-tiles u = 0, 1 cover the window's other row; so each thread's accumulators hold the four
// positions of one window for two output channels, and the pool, bias, ReLU and argmax (first
// maximum in the order u·2 + v, as convpool.cu) happen in registers:
//   out[s, o, wy, wx] = ReLU(max_{u,v} conv[s, o, 2wy + u, 2wx + v] + bias[o]).
// The block stages every filter once (as B fragments), then up to TC_SPB samples at a time; a warp
// takes items of 8 consecutive windows of the round's samples, one after another (a group may
// span two samples: its lanes' images differ, not its k-steps), so a plane that is no multiple of 8
// wastes only its round's last group (the 24→32 3×3 layer's 25 windows: 4 groups a sample were 32
// windows' work; two samples a round take 7 groups, 56 for 50).
#define F_KT ((TAPS + 7) / 8)     // k-steps (taps past TAPS: zero weights)
#define F_NT ((TC_OUTS + 7) / 8)  // n-tiles of output channels
// TC_TAIL_K4 (the launcher's FORWARD_TAIL_K4): where the last k-step holds at most 4 taps, it runs as
// m16n8k4 mma (taps ks·8 + t only): half its A loads and products (the 1→24 5×5 layer's 25 taps: 28
// of 32 k's, not 32). Its B words t + 4 are zero weights either way.
#define F_TAIL_K4 (TC_TAIL_K4 && TAPS % 8 != 0 && TAPS % 8 <= 4)
// TC_B_REGS (the launcher's FORWARD_B_REGISTERS): a lane holds every B fragment of its own in
// registers (2·F_KT·F_NT words: 24 for the 1→24 5×5 layer), loaded once a block, so that a k-step
// loads only its A words from shared memory (its B loads were 6 of its 14 wavefronts there).
// Else, with TC_B_PAIRS (the launcher's FORWARD_B_PAIRS) and an even count of n-tiles, the fragments
// of two n-tiles are one 16-byte load (stage_fragments' PAIRS): half the B loads' instructions.
#define F_B_PAIRS (TC_B_PAIRS && !TC_B_REGS && F_NT % 2 == 0)
__device__ __forceinline__ uint2 pair_half(uint4 v, int h) { return h ? make_uint2(v.z, v.w) : make_uint2(v.x, v.y); }
extern "C" __global__ void __launch_bounds__(THREADS, TC_MIN_BLOCKS) convpool_tc_forward(
        const float* __restrict__ x, const int* __restrict__ samples, const float* __restrict__ w,
        const float* __restrict__ bias, float* __restrict__ out, unsigned char* __restrict__ arg, int n,
        long long x_stride, long long model_stride) {
    // moved on the pointers (model_axis.cuh's step_bytes): the loads and stores stay global ones
    const long long model = model_offset(model_stride);
    x = step_bytes(x, model_offset(x_stride));
    if (samples) samples = step_bytes(samples, model);
    w = step_bytes(w, model);
    bias = step_bytes(bias, model);
    out = step_bytes(out, model);
    arg = step_bytes(arg, model);
    extern __shared__ __align__(16) unsigned smem[];
    const uint2* bfrag = reinterpret_cast<const uint2*>(smem);        // [F_KT][F_NT][32]: B fragments
    int2* tapoff = reinterpret_cast<int2*>(smem + F_KT * F_NT * 64);  // [F_KT·4]: taps t, t + 4's byte offsets
    unsigned* xs = smem + F_KT * F_NT * 64 + F_KT * 8;                // [TC_SPB][XS_WORDS], TF32
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    // B[tap][o] = w[o, tap]; columns o ≥ TC_OUTS are zeros and are not written.
    stage_fragments<F_KT, F_NT, THREADS, F_B_PAIRS>(smem, w, [](int k, int o) { return o * TAPS + k; }, TAPS, TC_OUTS);
    // tap k's offset in a staged image, in bytes: 4·(c·TC_CS + a·TC_RS + b) (0 past TAPS, where the weights are zeros)
    auto tap_offset = [](int k) { return k < TAPS ? 4 * ((k / KK) * TC_CS + (k / TC_K) % TC_K * TC_RS + k % TC_K) : 0; };
    for (int q = threadIdx.x; q < F_KT * 4; q += THREADS)
        tapoff[q] = make_int2(tap_offset(q / 4 * 8 + q % 4), tap_offset(q / 4 * 8 + q % 4 + 4));
#if TC_B_REGS
    __syncthreads();  // the fragments staged
    uint2 b_regs[F_KT][F_NT];
#pragma unroll
    for (int ks = 0; ks < F_KT; ++ks)
#pragma unroll
        for (int nt = 0; nt < F_NT; ++nt) b_regs[ks][nt] = bfrag[(ks * F_NT + nt) * 32 + lane];
#define F_B(ks, nt) b_regs[ks][nt]
#elif F_B_PAIRS
#define F_B(ks, nt) pair_half(lane_b4[((ks) * (F_NT / 2) + (nt) / 2) * 32], (nt) % 2)
#else
#define F_B(ks, nt) lane_b[((ks) * F_NT + (nt)) * 32]
#endif
    const int spb = samples_per_round(TC_SPB, n);
    for (int s0 = blockIdx.x * spb; s0 < n; s0 += gridDim.x * spb) {
        const int count = min(spb, n - s0);
        __syncthreads();  // the previous samples are no longer read (first time: nothing staged yet)
        // a sample's rows of TC_W: row r = (sample, c, y) at word sample·XS_WORDS + c·TC_CS + y·TC_RS,
        // from image s0 + sample of x, or through the indices image samples[s0 + sample] (a load from
        // the L1 but for a round's first: a block's indices share a few lines)
        auto row = [&](int r) { return xs + r / (TC_C * TC_H) * XS_WORDS + r / TC_H % TC_C * TC_CS + r % TC_H * TC_RS; };
        if (samples)
            stage_rows_tf32_from<TC_W>(row, [&](int r) { return x + (long long)samples[s0 + r / (TC_C * TC_H)] * IMAGE + r % (TC_C * TC_H) * TC_W; },
                                  count * TC_C * TC_H, x);
        else
            stage_rows_tf32<TC_W>(row, x + (long long)s0 * IMAGE, count * TC_C * TC_H);
        __syncthreads();
        const int windows = count * PLANE;
        for (int item = warp; item * 8 < windows; item += TC_WARPS) {
            const int at = item * 8 + g;
            const bool valid = at < windows;  // the last group's lanes past the round compute window 0, unwritten
            const int sl = valid ? at / PLANE : 0, win = valid ? at % PLANE : 0;
            const char* img = reinterpret_cast<const char*>(xs + sl * XS_WORDS + 2 * (win / WO) * TC_RS + 2 * (win % WO));
            const int2* lane_tapoff = tapoff + t;  // k-step ks's at lane_tapoff[4·ks]: an immediate offset
#if F_B_PAIRS
            // (ks, nt)'s B fragment in lane_b4[(ks·F_NT/2 + nt/2)·32], half nt % 2
            const uint4* lane_b4 = reinterpret_cast<const uint4*>(smem) + lane;
#elif !TC_B_REGS
            const uint2* lane_b = bfrag + lane;    // (ks, nt)'s B fragment at lane_b[(ks·F_NT + nt)·32]
#endif
            float acc[2][F_NT][4] = {};
            // every k-step unrolled (a compile-time count): no loop counter, the offsets' and B fragments'
            // loads at immediate offsets, and one add a tap pair's four A words (immediates 0, 1, TC_RS, TC_RS + 1)
#pragma unroll
            for (int ks = 0; ks < F_KT; ++ks) {
                const int2 tk = lane_tapoff[ks * 4];
                const unsigned* r0 = reinterpret_cast<const unsigned*>(img + tk.x);
                if (F_TAIL_K4 && ks == F_KT - 1) {  // a = A[g][t], A[g+8][t]; b = B[t][g]
#pragma unroll
                    for (int u = 0; u < 2; ++u) {
                        const unsigned a[2] = {r0[u * TC_RS], r0[u * TC_RS + 1]};
#pragma unroll
                        for (int nt = 0; nt < F_NT; ++nt) mma_tf32_k4(acc[u][nt], a, F_B(ks, nt).x);
                    }
                    break;
                }
                const unsigned* r1 = reinterpret_cast<const unsigned*>(img + tk.y);
                unsigned a[2][4];
#pragma unroll
                for (int u = 0; u < 2; ++u) {  // a = A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]
                    a[u][0] = r0[u * TC_RS];
                    a[u][1] = r0[u * TC_RS + 1];
                    a[u][2] = r1[u * TC_RS];
                    a[u][3] = r1[u * TC_RS + 1];
                }
#pragma unroll
                for (int nt = 0; nt < F_NT; ++nt) {
                    const uint2 bv = F_B(ks, nt);
                    const unsigned b[2] = {bv.x, bv.y};
                    mma_tf32(acc[0][nt], a[0], b);
                    mma_tf32(acc[1][nt], a[1], b);
                }
            }
            if (!valid) continue;
            const long long base = (long long)(s0 + sl) * TC_OUTS * PLANE + win;
#pragma unroll
            for (int nt = 0; nt < F_NT; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int o = nt * 8 + 2 * t + j;
                    if (o >= TC_OUTS) continue;
                    // d[j] = D[g][2t + j] (v = 0), d[2 + j] = D[g + 8][2t + j] (v = 1)
                    const float v4[4] = {acc[0][nt][j], acc[0][nt][2 + j], acc[1][nt][j], acc[1][nt][2 + j]};
                    float best = v4[0];
                    int where = 0;
#pragma unroll
                    for (int q = 1; q < 4; ++q)
                        if (v4[q] > best) { best = v4[q]; where = q; }
                    const float y = best + bias[o];
                    out[base + (long long)o * PLANE] = y > 0.0f ? y : 0.0f;
                    arg[base + (long long)o * PLANE] = y > 0.0f ? (unsigned char)where : (unsigned char)RELU_OFF;
                }
        }
    }
#undef F_B
}

// The pooled gradient put back at each window's argmax: dconv[o, 2wy + u, 2wx + v] =
// dout[s, o, wy, wx] where arg = u·2 + v (and the ReLU passed), 0 elsewhere; written into a
// row-major plane of `stride` floats a channel, `row` a conv row, at `origin` (TF32). Every
// window position is written; positions in no window are the caller's zeros.
// A thread a window (the backward data's BD_THREADS), a store its row pair (8 bytes where stride, row
// and origin are even): first the window's row u = wy mod 2, then the other, so that the half-warps'
// stores interleave the planes' even and odd conv rows over the banks (the 24→32 3×3 layer's padded
// planes: 200 wavefronts a sample's scatter, against 392 for four 4-byte stores a window).
struct Routed { float g; int where; };  // a window's pooled gradient and argmax
__device__ __forceinline__ Routed routed(const float* __restrict__ dout, const unsigned char* __restrict__ arg, int s,
                                         int q) {
    const long long at = (long long)s * TC_OUTS * PLANE + q;
    return Routed{dout[at], arg[at]};
}
// Window q's (q = o·PLANE + win) four words, as above.
__device__ __forceinline__ void scatter_window(unsigned* dst, int q, Routed v, int stride, int row, int origin) {
    const bool pairs = (stride | row | origin) % 2 == 0;  // every row pair 8-byte aligned
    const unsigned o = (unsigned)q / PLANE, win = (unsigned)q % PLANE, wy = win / WO, u = wy % 2;
    const unsigned gv = v.where == RELU_OFF ? 0u : tf32(v.g);
    const int rel = v.where ^ (int)(2 * u);  // 0, 1: the first store's words; 2, 3: the second's
    unsigned* d = dst + o * stride + origin + 2 * wy * row + 2 * (win % WO);
    unsigned* first = d + u * row;
    unsigned* second = d + row - u * row;
    const unsigned w[4] = {rel == 0 ? gv : 0u, rel == 1 ? gv : 0u, rel == 2 ? gv : 0u, rel == 3 ? gv : 0u};
    if (pairs) {
        *reinterpret_cast<uint2*>(first) = make_uint2(w[0], w[1]);
        *reinterpret_cast<uint2*>(second) = make_uint2(w[2], w[3]);
    } else {
        first[0] = w[0];
        first[1] = w[1];
        second[0] = w[2];
        second[1] = w[3];
    }
}
__device__ __forceinline__ void scatter_dconv(unsigned* dst, const float* __restrict__ dout,
                                              const unsigned char* __restrict__ arg, int s, int stride, int row,
                                              int origin) {
    batched<BD_THREADS>(TC_OUTS * PLANE, [&](int q) { return routed(dout, arg, s, q); },
                        [&](int q, Routed v) { scatter_window(dst, q, v, stride, row, origin); });
}

// ---- backward data ------------------------------------------------------------------------------
// dx[s, c, y, x] = Σ_{o,a,b} dconv[s, o, y − a, x − b]·w[o, c, a, b]: A[(y, x), (o, a, b)] =
// dcp[o, y + K−1−a, x + K−1−b] with dcp the conv gradient zero-padded by K − 1 on each side (no
// bounds tests), B[(o, a, b), c] = w[o, c, a, b]. A warp takes (sample, TC_BD_MTW m-tiles of 16
// input positions) items, every input channel: each k-step's B fragments and offsets, loaded
// once, feed TC_BD_MTW·B_NT mma. Blocks of TC_BD_WARPS warps (BD_THREADS threads), the launcher's
// choice for the layer (as many as a sample's items for the 24→32 3×3 layer: none idles in a round).
// Which warp takes an item does not change its sums: each output's k-steps in order, from 0.
#define HP (HC + 2 * (TC_K - 1))
#define WP (WC + 2 * (TC_K - 1))
// dcp's channel stride: HP·WP rounded up to ≡ 16 (mod 32), so a k-step whose taps cross into the
// next output channel reads it in the other half of the banks (the 24→32 3×3 layer's A loads: 1.33
// wavefronts each at 196 words, 1 at 208).
#define DCS (HP * WP + (48 - HP * WP % 32) % 32)
#define B_KT ((TC_OUTS * KK + 7) / 8)
#define B_NT ((TC_C + 7) / 8)
#define B_MT ((TC_H * TC_W + 15) / 16)
#define B_ITEMS ((B_MT + TC_BD_MTW - 1) / TC_BD_MTW)  // items a sample
// TC_BD_PREFETCH (one sample a round, at most TC_BATCH windows a thread: BD_PRE): a round's block
// loads the next sample's pooled gradient and argmaxes into registers before its items, and scatters
// them after the next barrier: the global loads' latency behind the products (the 24→32 3×3 layer:
// 800 windows, at most 3 a thread of 288: 6 registers held through the k-steps), not between the barriers.
#define BD_PRE ((TC_OUTS * PLANE + BD_THREADS - 1) / BD_THREADS)
#define BD_PREFETCHING (TC_BD_PREFETCH && TC_BD_SPB == 1 && BD_PRE <= TC_BATCH)
extern "C" __global__ void __launch_bounds__(BD_THREADS, TC_BD_MIN_BLOCKS) convpool_tc_backward_data(
        const float* __restrict__ dout, const unsigned char* __restrict__ arg, const float* __restrict__ w,
        float* __restrict__ dx, int n, long long model_stride) {
    const long long model = model_offset(model_stride);  // on the pointers: global loads and stores
    dout = step_bytes(dout, model);
    arg = step_bytes(arg, model);
    w = step_bytes(w, model);
    dx = step_bytes(dx, model);
    extern __shared__ __align__(16) unsigned smem[];
    const uint2* bfrag = reinterpret_cast<const uint2*>(smem);     // [B_KT][B_NT][32]: B fragments
    int2* koff = reinterpret_cast<int2*>(smem + B_KT * B_NT * 64);  // [B_KT·4]: k = t, t + 4's byte offsets in dcp
    unsigned* dcp = smem + B_KT * B_NT * 64 + B_KT * 8;             // [TC_BD_SPB][TC_OUTS·DCS]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    // B[(o, a, b)][c] = w[o, c, a, b] (k = o·KK + a·K + b); rows past TC_OUTS·KK and columns c ≥ TC_C are
    // zeros (those columns are not written).
    stage_fragments<B_KT, B_NT, BD_THREADS>(smem, w, [](int k, int c) { return k / KK * TAPS + c * KK + k % KK; },
                                TC_OUTS * KK, TC_C);
    // k's offset in dcp, in bytes (k past TC_OUTS·KK: 0, A's read at each row's dcp offset 0 against zero B
    // rows): a row's base address plus it is an A word's address, one add a load
    auto k_offset = [](int k) {
        return 4 * (k < TC_OUTS * KK ? (k / KK) * DCS + (TC_K - 1 - (k / TC_K) % TC_K) * WP + TC_K - 1 - k % TC_K : 0);
    };
    for (int q = threadIdx.x; q < B_KT * 4; q += BD_THREADS)
        koff[q] = make_int2(k_offset(q / 4 * 8 + q % 4), k_offset(q / 4 * 8 + q % 4 + 4));
    const int spb = samples_per_round(TC_BD_SPB, n);
    for (int e = threadIdx.x; e < spb * TC_OUTS * DCS; e += BD_THREADS) dcp[e] = 0u;  // the borders stay 0
    constexpr int origin = (TC_K - 1) * WP + TC_K - 1;  // dconv's (0, 0) in dcp
    // BD_PREFETCHING: this thread's windows q = threadIdx.x + u·BD_THREADS of the round's sample
    Routed next[BD_PRE];  // (not read, and not kept, where not BD_PREFETCHING)
    auto fetch_next = [&](int s) {
#pragma unroll
        for (int u = 0; u < BD_PRE; ++u) {
            const int q = threadIdx.x + u * BD_THREADS;
            if (q < TC_OUTS * PLANE) next[u] = routed(dout, arg, s, q);
        }
    };
    if (BD_PREFETCHING && (int)blockIdx.x < n) fetch_next(blockIdx.x);
    for (int s0 = blockIdx.x * spb; s0 < n; s0 += gridDim.x * spb) {
        const int count = min(spb, n - s0);
        __syncthreads();
        if (BD_PREFETCHING) {
#pragma unroll
            for (int u = 0; u < BD_PRE; ++u) {
                const int q = threadIdx.x + u * BD_THREADS;
                if (q < TC_OUTS * PLANE) scatter_window(dcp, q, next[u], DCS, WP, origin);
            }
        } else {
            for (int sl = 0; sl < count; ++sl)
                scatter_dconv(dcp + sl * TC_OUTS * DCS, dout, arg, s0 + sl, DCS, WP, origin);
        }
        __syncthreads();
        if (BD_PREFETCHING && s0 + (int)gridDim.x < n) fetch_next(s0 + gridDim.x);
        for (int item = warp; item < count * B_ITEMS; item += TC_BD_WARPS) {
            const int sl = item / B_ITEMS, mt0 = (item % B_ITEMS) * TC_BD_MTW;
            const int tiles = min(TC_BD_MTW, B_MT - mt0);  // the sample's last item may have fewer
            const unsigned* d = dcp + sl * TC_OUTS * DCS;
            // rows g and g + 8 of m-tile mt0 + i: input position p = (mt0 + i)·16 + g + 8h, whose row of
            // A starts at r[i][h] in dcp (past the image: dcp's word 0, not written)
            const char* r[TC_BD_MTW][2];
#pragma unroll
            for (int i = 0; i < TC_BD_MTW; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int p = (mt0 + i) * 16 + g + 8 * h;
                    r[i][h] = reinterpret_cast<const char*>(d + (p < TC_H * TC_W ? (p / TC_W) * WP + p % TC_W : 0));
                }
            auto word = [](const char* at) { return *reinterpret_cast<const unsigned*>(at); };
            const int2* lane_koff = koff + t;    // k-step ks's at lane_koff[4·ks]: an immediate offset
            const uint2* lane_b = bfrag + lane;  // (ks, nt)'s B fragment at lane_b[(ks·B_NT + nt)·32]
            float acc[TC_BD_MTW][B_NT][4] = {};
            // every k-step unrolled (a compile-time count): no loop counter, and the offsets' and B
            // fragments' loads take their k-step's place as immediates
#pragma unroll
            for (int ks = 0; ks < B_KT; ++ks) {
                const int2 k = lane_koff[ks * 4];
                uint2 bv[B_NT];
#pragma unroll
                for (int nt = 0; nt < B_NT; ++nt) bv[nt] = lane_b[(ks * B_NT + nt) * 32];
#pragma unroll
                for (int i = 0; i < TC_BD_MTW; ++i) {
                    if (i >= tiles) break;
                    const unsigned a[4] = {word(r[i][0] + k.x), word(r[i][1] + k.x), word(r[i][0] + k.y),
                                           word(r[i][1] + k.y)};
#pragma unroll
                    for (int nt = 0; nt < B_NT; ++nt) {
                        const unsigned b[2] = {bv[nt].x, bv[nt].y};
                        mma_tf32(acc[i][nt], a, b);
                    }
                }
            }
            float* o = dx + (long long)(s0 + sl) * IMAGE;
#pragma unroll
            for (int i = 0; i < TC_BD_MTW; ++i)
#pragma unroll
                for (int nt = 0; nt < B_NT; ++nt)
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const int c = nt * 8 + 2 * t + j;
                        if (c >= TC_C) continue;
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const int p = (mt0 + i) * 16 + g + 8 * h;
                            if (p < TC_H * TC_W) o[c * TC_H * TC_W + p] = acc[i][nt][2 * h + j];
                        }
                    }
        }
    }
}

// ---- weight and bias gradients -----------------------------------------------------------------
// dW[o, tap] = Σ_{s, (y, x)} dconv[s, o, y, x]·x[s, c, y + a, x + b] and db[o] = Σ dconv[s, o, ·]:
// only positions in a pool window have a gradient, so the sum runs over k = 4·win + u·2 + v, the
// window's position (2wy + u, 2wx + v): A[o, k] = dconv there (in shared memory a window's four
// words side by side, written as one 16-byte store: route_dconv; rows past TC_OUTS and k past
// 4·PLANE 0), B[k, tap] the im2col of x, with a column of ones at tap = TAPS for the bias. Chunk c is
// the samples [c·per_chunk, ...) summed one after another. Block b takes the chunks b, b + G,
// b + 2G, ... (G = gridDim.x) and adds their sums in that order, from 0, into
// partial[(o·G + b)·(TAPS + 1) + tap]; convpool_tc_reduce adds the G partials. With G = chunks
// a block's partial is its one chunk's sum; with G = TC_REDUCE_SLICES a block adds the chunks in
// the very order (and from the same 0) in which the reduce's slice b adds them at G = chunks, and
// the reduce then adds the slices' sums in slice order: dw has the same bits either way.
// Warp (group, slice) holds W_NTW n-tiles of group `group` for every m-tile and takes the
// k-steps ≡ slice (mod W_SLICES); the slices' sums are added in order after each chunk.
// The staged image: x[s, c, y, x] at word c·TC_WG_CS + y·TC_WG_RS + x (the launcher's
// ConvPoolShape.weight_grad_strides: padded rows put a B load's taps and positions on distinct banks).
#define W_MT ((TC_OUTS + 15) / 16)
#define W_NT ((TAPS + 1 + 7) / 8)
#define W_NTW TC_WG_NTW  // the launcher's NTW
#define W_GROUPS ((W_NT + W_NTW - 1) / W_NTW)
#define W_SLICES (TC_WARPS / W_GROUPS)
#define W_KT ((4 * PLANE + 7) / 8)
#define KPS (W_KT * 8 + 4)  // a dconv row's stride: ≡ 4 (mod 8), so an ldmatrix's 8 rows of 16 bytes hit 32 banks
#define ONE 0x3f800000u     // 1.0f, a TF32 value
#define WG_XS_WORDS ((TC_C * TC_WG_CS + 1) / 2 * 2)  // the staged image, even words (8-byte pairs next)
static_assert(W_GROUPS <= TC_WARPS, "convpool_tc_weight_grad: more n-tile groups than warps");
// dconv's rows, and after each chunk the slices' sums where they were
#define RED_WORDS (W_SLICES > 1 ? W_SLICES * W_GROUPS * W_MT * W_NTW * 128 : 0)
#define DCS_WORDS (W_MT * 16 * KPS > RED_WORDS ? W_MT * 16 * KPS : RED_WORDS)
// the running sums of a block's chunks: each lane of slice 0's warps its own W_MT·W_NTW·4 words
#define TOT_WORDS (W_GROUPS * W_MT * W_NTW * 128)
// Whether dconv's rows hold words the MMAs read that route_dconv never writes: the last k-step's
// past 4·PLANE (an odd number of windows).
#define UNSCATTERED (4 * PLANE < W_KT * 8)
// Those words back to 0 where the slices' sums were (e < RED_WORDS). Rows past TC_OUTS only feed
// sums never written, and route_dconv writes its own words for every sample: the two may run at once.
__device__ __forceinline__ void clear_unscattered(unsigned* dcs) {
    for (int e = threadIdx.x; e < min(RED_WORDS, TC_OUTS * KPS); e += THREADS) {
        const int k = e % KPS;
        if (k >= 4 * PLANE && k < W_KT * 8) dcs[e] = 0u;
    }
}
// dconv's rows in window order: dst[o·KPS + 4·win + where] = TF32(dout[o, win]) at the window's
// argmax `where` (none where the ReLU was off), the window's other three words 0: one 16-byte store
// a window (KPS and dst keep it aligned; consecutive windows at consecutive addresses). A zeroing
// store and then the value's 4-byte store over it were twice the wavefronts: a warp's 32 values 16
// bytes apart fall 4 to a bank.
__device__ __forceinline__ void route_dconv(unsigned* dst, const float* __restrict__ dout,
                                            const unsigned char* __restrict__ arg) {
    struct Routed { float g; unsigned where; };
    batched(TC_OUTS * PLANE, [&](int q) { return Routed{dout[q], arg[q]}; }, [&](int q, Routed v) {
        const unsigned g = tf32(v.g);
        *reinterpret_cast<uint4*>(dst + (q / PLANE) * KPS + 4 * (q % PLANE)) =
            make_uint4(v.where == 0 ? g : 0u, v.where == 1 ? g : 0u, v.where == 2 ? g : 0u, v.where == 3 ? g : 0u);
    });
}
// The next sample's image, pooled gradient and argmaxes copied as they are (cp.async, 16-byte
// pieces) while the block multiplies this one's: where a sample of each is whole 16-byte pieces
// (and the buffers 16-byte aligned, which the kernel checks), in RAW_WORDS words; else staged from
// global memory between the barriers, waiting on its loads there.
#define ASYNC_STAGE (IMAGE % 4 == 0 && (TC_OUTS * PLANE) % 16 == 0)
#define RAW_WORDS (ASYNC_STAGE ? IMAGE + TC_OUTS * PLANE + TC_OUTS * PLANE / 4 : 0)
// Sample s's copies into raw (its image, then dout's, then arg's, 16 bytes each over the block's
// threads), committed as one group of each thread's.
__device__ __forceinline__ void fetch_sample(unsigned* raw, const float* image, const float* dout,
                                             const unsigned char* arg, int s) {
    constexpr int X4 = IMAGE / 4, D4 = TC_OUTS * PLANE / 4, A16 = TC_OUTS * PLANE / 16;
    auto copy = [&](int count, unsigned* dst, const void* src) {
        for (int q = threadIdx.x; q < count; q += THREADS)
            copy16_async_or_zero(dst + 4 * q, static_cast<const char*>(src) + 16 * q, 16);
    };
    copy(X4, raw, image);
    copy(D4, raw + IMAGE, dout + (long long)s * TC_OUTS * PLANE);
    copy(A16, raw + IMAGE + TC_OUTS * PLANE, arg + (long long)s * TC_OUTS * PLANE);
    copies_commit();
}
// A lane's sums as one array: sum i = (mt·W_NTW + j)·4 + e is D[mt·16 + g + 8(e / 2)][(group·W_NTW + j)·8 +
// 2t + e % 2] of its warp's group.
#define W_SUMS (W_MT * W_NTW * 4)
// After a chunk the W_SLICES warps of a group add the slices' sums in slice order, each for its own
// W_OWN of them (sum i is owned by slice i / W_OWN): the same additions as one warp adding them all.
#define W_OWN (W_SUMS / W_SLICES)
static_assert(W_SUMS % W_SLICES == 0, "convpool_tc_weight_grad: the slices must share the sums evenly");
#define W_STEPS ((W_KT + W_SLICES - 1) / W_SLICES)  // k-steps a slice takes (ks = slice + i·W_SLICES)
#define ONES_TILE (TAPS / 8)                        // the n-tile whose column TAPS % 8 is the bias's ones
#define W_LAST_TILES (W_NT - (W_GROUPS - 1) * W_NTW)  // the last group's n-tiles (W_NTW or fewer)
// A k-step's conv positions k = ks·8 + t + 4p (p = 0, 1) are windows 2ks + p at the lane's (u, v) = (t / 2,
// t % 2): their byte offsets in the image are the window's (win_offset: 0 past the plane, where A is 0)
// plus the lane's own, which its B columns (xcol) hold. (Read from shared memory, not folded in as
// constants where the k-steps are known: the compiler then held every column-plus-offset sum across the
// samples, and the 24→32 layer spilled.)
__device__ __forceinline__ int win_offset(int win) {
    return win < PLANE ? 4 * (2 * (win / WO) * TC_WG_RS + 2 * (win % WO)) : 0;
}
// One sample's products for warp (group, slice): k-steps ks ≡ slice (mod W_SLICES), unrolled, so every
// shared load is a lane's base address plus a constant. a_row: the lane's ldmatrix row of dconv's tile
// (ldmatrix_tf32) at column slice·8; winpair[ks]: the windows' offsets of k-step ks (one load every
// lane shares); xcol[j]: the image at tap (group·W_NTW + j)·8 + g and the lane's position in a window,
// as bytes (a B load's address one add); TILES: the group's n-tiles (the last group may have fewer);
// ones: whether this lane's column of n-tile ONES_TILE is the bias's.
template <int TILES>
__device__ __forceinline__ void weight_grad_products(float (&acc)[W_MT][W_NTW][4], const unsigned* a_row,
                                                     const int2* winpair, const char* const (&xcol)[W_NTW], bool ones,
                                                     int group, int slice) {
#pragma unroll
    for (int i = 0; i < W_STEPS; ++i) {
        if (W_KT % W_SLICES != 0 && slice + i * W_SLICES >= W_KT) break;
        const int2 q = winpair[slice + i * W_SLICES];
        unsigned a[W_MT][4];
#pragma unroll
        for (int mt = 0; mt < W_MT; ++mt) ldmatrix_tf32(a[mt], a_row + mt * 16 * KPS + i * W_SLICES * 8);
#pragma unroll
        for (int j = 0; j < TILES; ++j) {
            const bool one = ones && group * W_NTW + j == ONES_TILE;
            const unsigned b[2] = {one ? ONE : *reinterpret_cast<const unsigned*>(xcol[j] + q.x),
                                   one ? ONE : *reinterpret_cast<const unsigned*>(xcol[j] + q.y)};
#pragma unroll
            for (int mt = 0; mt < W_MT; ++mt) mma_tf32(acc[mt][j], a[mt], b);
        }
    }
}
extern "C" __global__ void __launch_bounds__(THREADS, TC_WG_MIN_BLOCKS) convpool_tc_weight_grad(
        const float* __restrict__ x, const int* __restrict__ samples, const float* __restrict__ dout,
        const unsigned char* __restrict__ arg, float* __restrict__ partial, int n, int per_chunk,
        long long model_stride) {
    x = samples ? x : model_at(x, model_stride);  // through sample indices: the images every model shares
    samples = model_at(samples, model_stride);
    dout = model_at(dout, model_stride);
    arg = model_at(arg, model_stride);
    partial = model_at(partial, model_stride);
    extern __shared__ __align__(16) unsigned smem[];
    unsigned* dcs = smem;                                 // [W_MT·16][KPS], DCS_WORDS
    float* tot = reinterpret_cast<float*>(dcs + DCS_WORDS);  // TOT_WORDS
    unsigned* raw = dcs + DCS_WORDS + TOT_WORDS;          // RAW_WORDS: x, dout, arg of the next sample
    unsigned* xs = raw + RAW_WORDS;                       // [WG_XS_WORDS]: the image at its strides
    int2* winpair = reinterpret_cast<int2*>(xs + WG_XS_WORDS);  // [W_KT]: windows 2ks, 2ks + 1's byte offsets
    // The sample indices' address, parked in shared memory (2 words) and read again where a sample's
    // image is copied: held in registers through the products it spilled them (the 1→24 layer: 72 bytes).
    const int* volatile* samples_at = reinterpret_cast<const int* volatile*>(winpair + W_KT);
    if (threadIdx.x == 0) *samples_at = samples;  // read after the loop's first barrier
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int group = warp % W_GROUPS, slice = warp / W_GROUPS;
    const bool active = slice < W_SLICES;
    for (int e = threadIdx.x; e < W_MT * 16 * KPS; e += THREADS) dcs[e] = 0u;
    for (int ks = threadIdx.x; ks < W_KT; ks += THREADS) winpair[ks] = make_int2(win_offset(2 * ks), win_offset(2 * ks + 1));
    // This lane's B columns: tap n = nt·8 + g of each of its n-tiles at the lane's position (t / 2, t % 2)
    // in a window (k = 4·win + t: conv position (2wy + t / 2, 2wx + t % 2)), its offset in an image.
    const char* xcol[W_NTW];
#pragma unroll
    for (int j = 0; j < W_NTW; ++j) {
        const int tap = (group * W_NTW + j) * 8 + g;
        xcol[j] = reinterpret_cast<const char*>(xs + (tap < TAPS ? (tap / KK) * TC_WG_CS + (tap / TC_K) % TC_K * TC_WG_RS + tap % TC_K : 0)
                                                + t / 2 * TC_WG_RS + t % 2);
    }
    const bool ones = ONES_TILE * 8 + g == TAPS;
    const unsigned* a_row = dcs + (lane % 8 + 8 * (lane / 8 % 2)) * KPS + 4 * (lane / 16) + slice * 8;
    float acc[W_MT][W_NTW][4];
    auto sums = [&](int i) -> float& { return acc[i / (W_NTW * 4)][i / 4 % W_NTW][i % 4]; };  // sum i (W_SUMS)
    const int chunks = (n + per_chunk - 1) / per_chunk;
    // The copies ahead pay where a block has a next sample to copy while it multiplies (a block of
    // one sample only adds the staging's pass through raw: measured slower, the one-model 1→24 layer).
    const bool async = ASYNC_STAGE && (per_chunk > 1 || (int)gridDim.x < chunks) &&
                       ((reinterpret_cast<unsigned long long>(x) | reinterpret_cast<unsigned long long>(dout) |
                         reinterpret_cast<unsigned long long>(arg)) & 15) == 0;
    // sample s's image: s of x, or through the indices samples[s] of x (a load from the L1 but for the
    // first of a line's 32 indices)
    auto image = [&](const int* indices, int s) { return x + (long long)(indices ? indices[s] : s) * IMAGE; };
    if (async && blockIdx.x < chunks)
        fetch_sample(raw, image(samples, blockIdx.x * per_chunk), dout, arg, blockIdx.x * per_chunk);
    for (int chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
        const int first = chunk * per_chunk, last = min(n, first + per_chunk);
#pragma unroll
        for (int i = 0; i < W_SUMS; ++i) sums(i) = 0.0f;
        for (int s = first; s < last; ++s) {
            if (async) copies_wait<0>();  // this sample's copies (this thread's; the barrier: everyone's)
            __syncthreads();  // the previous sample's dconv and image, or the slices' sums, no longer read
            if (RED_WORDS > 0 && UNSCATTERED && s == first && chunk != blockIdx.x) clear_unscattered(dcs);
            // the image's rows r = (c, y) of TC_W at their strides
            auto row = [&](int r) { return xs + r / TC_H * TC_WG_CS + r % TC_H * TC_WG_RS; };
            if (async) {
                const float* raw_dout = reinterpret_cast<const float*>(raw + IMAGE);
                const float* raw_x = reinterpret_cast<const float*>(raw);
                stage_rows_tf32<TC_W>(row, raw_x, TC_C * TC_H);
                route_dconv(dcs, raw_dout, reinterpret_cast<const unsigned char*>(raw_dout + TC_OUTS * PLANE));
            } else {
                const float* src = image(*samples_at, s);
                stage_rows_tf32<TC_W>(row, src, TC_C * TC_H);
                route_dconv(dcs, dout + (long long)s * TC_OUTS * PLANE, arg + (long long)s * TC_OUTS * PLANE);
            }
            __syncthreads();  // raw read: the block's next sample may land in it
            if (async) {
                const int next = s + 1 < last ? s + 1 : chunk + (int)gridDim.x < chunks ? (chunk + gridDim.x) * per_chunk : -1;
                if (next >= 0) fetch_sample(raw, image(*samples_at, next), dout, arg, next);
            }
            if (!active) continue;
            if (group < W_GROUPS - 1) weight_grad_products<W_NTW>(acc, a_row, winpair, xcol, ones, group, slice);
            else weight_grad_products<W_LAST_TILES>(acc, a_row, winpair, xcol, ones, group, slice);
        }
        // This warp's own sums, kept in sums(u) for u < W_OWN (sum slice·W_OWN + u of the group's): with
        // several slices, the slices' sums added in slice order (each warp's parked where dconv's rows were).
        if (W_SLICES > 1) {
            float* red = reinterpret_cast<float*>(dcs);  // warp (group, slice)'s lane's sum i: red_of(slice)[i·32]
            auto red_of = [&](int sl) { return red + (sl * W_GROUPS + group) * W_SUMS * 32 + lane; };
            __syncthreads();
            if (active)
#pragma unroll
                for (int i = 0; i < W_SUMS; ++i) red_of(slice)[i * 32] = sums(i);
            __syncthreads();
            if (active)
#pragma unroll
                for (int u = 0; u < W_OWN; ++u) {
                    const int i = slice * W_OWN + u;
                    float v = red_of(0)[i * 32];
                    for (int sl = 1; sl < W_SLICES; ++sl) v += red_of(sl)[i * 32];
                    sums(u) = v;
                }
        }
        // A block of several chunks: their sums added in order from 0 (the reduce's order), in tot;
        // the last one's total kept. A block of one chunk writes its sum as it is.
        const bool more = chunk + (int)gridDim.x < chunks, after_first = chunk != (int)blockIdx.x;
        if (active && (more || after_first))
#pragma unroll
            for (int u = 0; u < W_OWN; ++u) {
                float& sum = tot[(group * W_SUMS + slice * W_OWN + u) * 32 + lane];
                sum = (after_first ? sum : 0.0f) + sums(u);
                if (!more) sums(u) = sum;
            }
    }
    if (!active || blockIdx.x >= chunks) return;
#pragma unroll
    for (int u = 0; u < W_OWN; ++u) {
        const int i = slice * W_OWN + u, mt = i / (W_NTW * 4), j = i / 4 % W_NTW, e = i % 4;
        const int o = mt * 16 + g + (e >> 1) * 8, tap = (group * W_NTW + j) * 8 + 2 * t + (e & 1);
        if (o < TC_OUTS && tap <= TAPS) partial[((long long)o * gridDim.x + blockIdx.x) * (TAPS + 1) + tap] = sums(u);
    }
}

// dw[o, tap] = Σ_chunk partial[o, chunk, tap] (tap < TAPS), db[o] = the same at tap = TAPS, over the
// weight gradient's `chunks` partials (its blocks). A block of 32 outputs × TC_REDUCE_SLICES: slice r
// sums the chunks ≡ r (mod slices) in order, then slice 0 adds the slices' sums in order.
extern "C" __global__ void convpool_tc_reduce(const float* __restrict__ partial, float* __restrict__ dw,
                                              float* __restrict__ db, int chunks, long long model_stride) {
    partial = model_at(partial, model_stride);
    dw = model_at(dw, model_stride);
    db = model_at(db, model_stride);
    __shared__ float part[TC_REDUCE_SLICES][32];
    const int lane = threadIdx.x & 31, slice = threadIdx.x >> 5;
    const int idx = blockIdx.x * 32 + lane, o = idx / (TAPS + 1), tap = idx % (TAPS + 1);
    const bool valid = idx < TC_OUTS * (TAPS + 1);
    float sum = 0.0f;
    if (valid)
        for (int c0 = slice; c0 < chunks; c0 += TC_REDUCE_SLICES * TC_BATCH) {
            float v[TC_BATCH];  // the batch's loads first, then their sum in chunk order
#pragma unroll
            for (int u = 0; u < TC_BATCH; ++u) {
                const int c = c0 + u * TC_REDUCE_SLICES;
                v[u] = c < chunks ? partial[((long long)o * chunks + c) * (TAPS + 1) + tap] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < TC_BATCH; ++u) sum += v[u];
        }
    part[slice][lane] = sum;
    __syncthreads();
    if (slice != 0 || !valid) return;
    for (int r = 1; r < TC_REDUCE_SLICES; ++r) sum += part[r][lane];
    if (tap < TAPS) dw[o * TAPS + tap] = sum;
    else db[o] = sum;
}
