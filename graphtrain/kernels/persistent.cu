// `persistent`: softmax regression trained by one thread-block cluster; one launch runs an epoch.
//
// The cluster's CLUSTER blocks split the input features (padded to CLUSTER·SLICE) into slices:
// block c owns W[:, c·SLICE : (c+1)·SLICE] and the same columns of every batch. A step of `rows`
// samples, R = ⌈rows / CLUSTER⌉ of them owned by each block:
//
//   A  partial_c[r, j] = Σ_{f in slice c} x[r, f] · W[j, f]; each block sends the partials of
//      rows r into the inbox of r's owner (distributed shared memory stores)
//   B  the owner of row r, once its inbox is full: z[r, j] = b[j] + Σ_{c = 0..CLUSTER-1}
//      inbox[c][r, j] (in that order), dlogits[r, j] = (softmax(z[r])_j − [j = y_r]) / rows,
//      sent to every block; loss and accuracy when measured
//   C  every block, once its dlogits are all in:  W[j, f] −= lr · Σ_r dlogits[r, j] · x[r, f]
//      on its slice, and b[j] −= lr · Σ_r dlogits[r, j] on its copy of b
//
// No block needs another's slice of W or of dW, so a step exchanges only the partial logits and
// dlogits (rows × classes each): st.async stores that count their bytes on the receiver's mbarrier
// (one for the inbox, one for dlogits, a phase a step), with no cluster barrier and no memory fence
// in the loop. Warps have two roles: COMPUTE_WARPS run the phases, FETCH_WARPS copy the next step's
// tile of this block's columns (and the labels of its owned rows) into the second of two buffers
// while the step trains.
//
// The products of A and C run on tensor cores with fp32 sums, in one of two builds (the type
// Build: Bf16Build or Tf32Build, picked by BF16):
//   BF16 = 1   bf16 operands (mma.sync m16n8k16), one pass (the bf16 rung's precision): the
//              images come as bf16 (8-bit pixels k, exact), phase A reads a bf16 copy of W
//              (rounded when the fp32 W is updated), and the owners send dlogits as bf16.
//              W and b are kept and updated in fp32.
//   BF16 = 0   TF32 inputs (m16n8k8) in three passes, which keeps near-fp32 accuracy: each
//              operand is split as v = hi + lo (hi its top 19 bits), and a·b ≈ hi·hi + (hi·lo +
//              lo·hi), the dropped lo·lo term and the operands' truncation ~2⁻²⁰ of the
//              product; with 8-bit inputs (PIXEL_LEVELS) x needs no split, and the products
//              with x take two passes.
// Every sum runs in a fixed order, without atomics: the same seed gives the same weights bit for
// bit.
//
// Why one buffer of each exchange suffices (the exchange order), how the batches come in, how the
// products are spread over the warps, and what was measured slower: docs/persistent.md.
//
// Compile-time (from kernels/persistent.py): CLUSTER, COMPUTE_WARPS, FETCH_WARPS, SLICE (a
// multiple of 8), CLASSES (≤ 32), FEATURES, BATCH (the rows of a full step; a short last step
// takes the same code with fewer rows), PIXEL_LEVELS (below), BF16; the strides and the layout of
// shared memory (Shape.strides, Shape.layout). Images are rows of
// CLUSTER·SLICE values (bf16 bits in the BF16 build, else float32), zero past FEATURES (as W
// is there). Without a bias (bias = 0), b stays zero.

#define PADDED_FEATURES (CLUSTER * SLICE)
#define COMPUTE_THREADS (32 * COMPUTE_WARPS)
#define THREADS (32 * (COMPUTE_WARPS + FETCH_WARPS))
#define N_TILES ((CLASSES + 7) / 8)           // the classes in mma columns of 8
#define INBOX_STRIDE ROW_LANES                // floats per row of the inbox
#define C_M_TILES ((SLICE + 1 + 15) / 16)  // phase C's rows: the slice's features, then the bias
#define C_TILES (C_M_TILES * N_TILES)
#define ROWS16 ((BATCH + 15) / 16 * 16)  // rows of a tile and of dlogits: whole mma tiles
#define R_MAX ((BATCH + CLUSTER - 1) / CLUSTER)  // owned rows of a full step
#define C_M_PAIRS ((C_M_TILES + 1) / 2)
#define FETCH_ROWS ((BATCH + FETCH_WARPS - 1) / FETCH_WARPS)  // a fetch warp's rows of a tile

#define N_PAIRS ((N_TILES + 1) / 2)           // the classes in pairs of mma columns (bf16: one ldmatrix.x4)
#define W16_SIZE (16 * N_PAIRS * W16_STRIDE)  // a buffer of W's bf16 copy (none in the TF32 build: W16_STRIDE = 0)
// The values of the tiles, W's copy and dlogits as kept: floats in the TF32 build, their bf16 bits
// (rounded to nearest even) in the BF16 one, each read by ldmatrix (the strides: Shape.strides).
template <bool IS_BF16> struct Values {
    typedef float Elem;
    __device__ static __forceinline__ float of(float v) { return v; }
};
template <> struct Values<true> {
    typedef unsigned short Elem;
    __device__ static __forceinline__ unsigned short of(float v) { return (unsigned short)(bf16x2(v, 0.0f) & 0xffffu); }
};
typedef Values<BF16 != 0>::Elem Elem;
__device__ __forceinline__ Elem to_elem(float v) { return Values<BF16 != 0>::of(v); }
#define DL_PIECE (16 / (int)sizeof(Elem))     // dlogits sent 16 bytes a store: 4 floats or 8 bf16
#define DL_PIECES ((CLASSES + DL_PIECE - 1) / DL_PIECE)  // a row's dlogits in 16-byte stores
#define CHUNK (16 / (int)sizeof(Elem))        // values a 16-byte copy of a tile row carries
#define CHUNKS_PER_ROW (SLICE / CHUNK)        // 16-byte copies per row of a tile

// PIXEL_LEVELS = 255 where every input is an 8-bit pixel k/255 (as loaded from uint8): the
// images then hold k itself, exact in TF32 and in bf16, so the TF32 products with x take two
// passes, not three, and x's unit 1/255 goes into the logits and the step. 0: any floats (three
// passes; rounded to bf16 in the BF16 build).
#if PIXEL_LEVELS
#define X_LEVELS PIXEL_LEVELS  // 1 in x's unit, exact (1 / X_UNIT in float is not)
#else
#define X_LEVELS 1
#endif
#define X_UNIT (1.0f / X_LEVELS)

#if SLICE % 8 != 0 || CLASSES > 32 || 32 % CLUSTER != 0 || COMPUTE_THREADS % CLUSTER != 0
#error "persistent.cu: unsupported SLICE / CLASSES"
#endif

// From cluster.cuh, tf32_mma.cuh and logits_loss.cuh (put before this file by the launcher):
// cluster_rank, cluster_sync, remote, copy4_async, copy16_async, async_wait_all, smem_addr, send,
// send2, send4, mbarrier_expect, mbarrier_arrive, mbarrier_wait, cluster_metrics, step_rows;
// mma_tf32, split_tf32, Sums3, total, mma_x; warp_softmax_grad, warp_label_logit,
// first_max_is, xent_loss.

// The compute warps' own barrier (the fetch warps never wait at it).
__device__ __forceinline__ void compute_sync() {
    asm volatile("bar.sync 1, %0;" :: "n"(COMPUTE_THREADS) : "memory");
}

// The dynamic shared memory. Its layout (the regions' order, sizes and offsets, SMEM_*) and the
// strides above (PAIR_STRIDE, ROW_LANES, X_STRIDE, DL_STRIDE, W16_STRIDE, C_K_PARTS) come from one
// table, kernels/persistent.py's Shape.layout, which gives the launcher its byte count too.
struct Smem {
    unsigned long long* bars;  // [6]: inbox_full, dl_full, tile_full[2], tile_free[2]
    unsigned long long* inbox_full;  // this step's partial logits of the owned rows have arrived
    unsigned long long* dl_full;     // this step's dlogits have arrived
    unsigned long long* tile_full;   // [2] a tile buffer's copies (and its labels') have landed
    unsigned long long* tile_free;   // [2] the compute threads are done with a tile buffer
    double* totals;     // [2 + 2·COMPUTE_WARPS]        block totals of loss and correct, then per warp
    float2* w_hi;       // [SLICE/2][PAIR_STRIDE]       this block's slice of W, (W[2p][j], W[2p+1][j]) at [p][j]:
    float2* w_lo;       //                              W = hi + lo (hi: TF32); BF16: W itself in w_hi, no w_lo
    float* b;           // [ROW_LANES]                  this block's copy of the bias
    float* inbox;       // [CLUSTER][R_MAX][INBOX_STRIDE]  partial logits of the owned rows, per block
    float* dw_parts;    // [C_K_PARTS][C_TILES][32][4]  phase C's sums over each part of the rows
    Elem* w16;          // BF16: [2][16·N_PAIRS][W16_STRIDE]  W rounded to bf16, [class][feature], for phase A:
    //                  step t reads buffer t % 2 and writes the other
    Elem* x;            // [2][ROWS16][X_STRIDE]        this step's tile and the next one's
    Elem* dl;           // [ROWS16][DL_STRIDE]          dlogits, pushed by the rows' owners
    Elem* dl_row;       // [R_MAX + 1][ROW_LANES]       an owned row's dlogits, gathered for sending
    int* order;         // [BATCH]                      a tile's sample indices, for the fetch warps
    int* labels;        // [2][R_MAX]                   labels of the owned rows, per tile buffer
};

__device__ Smem carve(unsigned char* base) {
    Smem s;
    SMEM_REGION(s, base, bars, SMEM_BARS);
    s.inbox_full = s.bars; s.dl_full = s.bars + 1; s.tile_full = s.bars + 2; s.tile_free = s.bars + 4;
    SMEM_REGION(s, base, totals, SMEM_TOTALS);
    SMEM_REGION(s, base, w_hi, SMEM_W_HI);
    SMEM_REGION(s, base, w_lo, SMEM_W_LO);
    SMEM_REGION(s, base, b, SMEM_B);
    SMEM_REGION(s, base, inbox, SMEM_INBOX);
    SMEM_REGION(s, base, dw_parts, SMEM_DW_PARTS);
    SMEM_REGION(s, base, w16, SMEM_W16);
    SMEM_REGION(s, base, x, SMEM_X);
    SMEM_REGION(s, base, dl, SMEM_DL);
    SMEM_REGION(s, base, dl_row, SMEM_DL_ROW);
    SMEM_REGION(s, base, order, SMEM_ORDER);
    SMEM_REGION(s, base, labels, SMEM_LABELS);
    check_shared_bytes(SMEM_BYTES);
    return s;
}

__device__ __forceinline__ int owned_rows(int rows) { return (rows + CLUSTER - 1) / CLUSTER; }
// v = hi + lo, hi a TF32 value (see split_tf32)
__device__ __forceinline__ float2 split_pair(float v) {
    const float hi = __uint_as_float(__float_as_uint(v) & 0xffffe000u);
    return make_float2(hi, v - hi);
}
// A fetch warp's loop: rows [FETCH_ROWS·warp, FETCH_ROWS·(warp + 1)) of every step's tile
// (16-byte cp.async copies of this block's columns) and the labels of the owned rows among them;
// each lane arrives on the buffer's `tile_full` barrier once its copies have landed. Each lane
// holds the sample indices of its rows of the next step in registers, loaded while the current
// step's copies fly.
__device__ void fetch_epoch(const Smem& s, const Elem* images, const int* labels, const int* order,
                            int num_samples, int num_steps, unsigned rank, int fetch_warp, int lane) {
    constexpr int ROWS_PER_LANE = (FETCH_ROWS + 31) / 32;
    const int row0 = fetch_warp * FETCH_ROWS;
    int index[ROWS_PER_LANE];
    const auto load_indices = [&](int step) {
        const int rows = step_rows(step, BATCH, num_samples);
#pragma unroll
        for (int i = 0; i < ROWS_PER_LANE; ++i) {
            const int local = lane + 32 * i, r = row0 + local;
            index[i] = local < FETCH_ROWS && r < rows ? order[(long long)step * BATCH + r] : 0;
        }
    };
    if (num_steps > 0) load_indices(0);
    const Elem* columns = images + rank * SLICE;
    for (int step = 0; step < num_steps; ++step) {
        const int buffer = step & 1, rows = step_rows(step, BATCH, num_samples);
        const int r_own = owned_rows(rows), own_lo = min(rows, (int)rank * r_own);
        const int owned = min(rows, own_lo + r_own) - own_lo;
        // Step − 2, the buffer's last user, is done with it: the buffer's (step / 2 − 1)-th
        // completion. (Its next needs this very tile, so a parity wait cannot mistake the two.)
        if (step >= 2) mbarrier_wait(s.tile_free + buffer, ((step >> 1) + 1) & 1);
#pragma unroll
        for (int i = 0; i < ROWS_PER_LANE; ++i) {
            const int local = lane + 32 * i, r = row0 + local;
            if (local < FETCH_ROWS && r < rows) {
                s.order[r] = index[i];
                if (r >= own_lo && r < own_lo + owned) copy4_async(s.labels + buffer * R_MAX + r - own_lo, labels + index[i]);
            }
        }
        __syncwarp();
        const int my_rows = max(0, min(FETCH_ROWS, rows - row0));
        Elem* tile = s.x + (buffer * ROWS16 + row0) * X_STRIDE;
        for (int i = lane; i < my_rows * CHUNKS_PER_ROW; i += 32) {
            const int r = i / CHUNKS_PER_ROW, k = i - r * CHUNKS_PER_ROW;
            copy16_async(tile + r * X_STRIDE + CHUNK * k, columns + (long long)s.order[row0 + r] * PADDED_FEATURES + CHUNK * k);
        }
        if (step + 1 < num_steps) load_indices(step + 1);  // in flight while the copies land
        async_wait_all();
        mbarrier_arrive(s.tile_full + buffer);
        __syncwarp();  // every lane has read this step's indices before the next step's overwrite them
    }
}

// What a compute thread keeps across steps.
struct Compute {
    unsigned rank;
    int tid, lane, warp, g, t;  // g, t: an mma fragment's row group and column pair
    unsigned dl_to, dl_full_to;  // phase B: this thread's block (lane % ROW_LANES) and its barrier
    double loss_sum = 0.0, correct_sum = 0.0;  // kept by the threads of phase B of class 0
};

// Phase C's step for output tile (m, n): W[j][f] −= lr · X_UNIT · dW[j][f] and, where the tile
// holds the bias's row (f = SLICE), b[j] likewise; grads is the tile's mma fragment of dW_sliceᵀ:
// D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1].
template <class Build>
__device__ __forceinline__ void update_tile(const Smem& s, const Compute& me, int m, int n, const float (&grads)[4],
                                            int bias, float lr, Elem* w16_next) {
    const int g = me.g, t = me.t;
    float w_now[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // every load before any store: stores through the same pointers
        // would otherwise hold each load back until the store before it (about 100 cycles a step)
        const int f = 16 * m + g + (i < 2 ? 0 : 8), j = 8 * n + 2 * t + (i & 1);
        w_now[i] = Build::load_w(s, min(f, SLICE - 1), j);  // past the slice: a value in range, never stored
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // W's fp32 update (TF32 build: W = hi + lo exactly, split again)
        const int f = 16 * m + g + (i < 2 ? 0 : 8), j = 8 * n + 2 * t + (i & 1);
        Build::store_w(s, f, j, w_now[i] - lr * X_UNIT * grads[i], j < CLASSES && f < SLICE, w16_next);
    }
    if (bias && m == SLICE / 16)  // the tile holding the bias's row (the same for the whole warp)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int f = 16 * m + g + (i < 2 ? 0 : 8), j = 8 * n + 2 * t + (i & 1);
            if (f == SLICE && j < CLASSES) s.b[j] -= lr * X_UNIT * grads[i];
        }
}

// ---- The build's precision, a type: Tf32Build or Bf16Build (Build, picked by BF16) ---------------
// Each says how W is kept (load_w: W[j][f] of the slice; store_w: W[j][f] = v where `keep`), how
// phase A's and phase C's products run, and how phase C sums its tiles and updates W (phase_c).
// The stores of store_w are predicated, not branched around: the update's tiles hold padding and
// the bias's row, where branches diverge.

// TF32 passes: W kept as hi + lo (split_pair), so only dlogits and (for other inputs than 8-bit
// pixels) x are split in the loop.
template <class V>  // V: Elem (a template, so that only the build's own precision is compiled)
struct Tf32Build {
    typedef Sums3 Sums;
    static constexpr int C_K_STEPS = ROWS16 / 8;  // phase C's k-steps of 8 rows (an even number)
    __device__ static __forceinline__ float load_w(const Smem& s, int f, int j) {
        const float hi = reinterpret_cast<const float*>(s.w_hi + (f / 2) * PAIR_STRIDE + j)[f & 1];
        return hi + reinterpret_cast<const float*>(s.w_lo + (f / 2) * PAIR_STRIDE + j)[f & 1];
    }
    __device__ static __forceinline__ void store_w(const Smem& s, int f, int j, float v, bool keep, V*) {
        float* hi = reinterpret_cast<float*>(s.w_hi + (f / 2) * PAIR_STRIDE + j) + (f & 1);
        float* lo = reinterpret_cast<float*>(s.w_lo + (f / 2) * PAIR_STRIDE + j) + (f & 1);
        const float2 parts = split_pair(v);
        if (keep) { *hi = parts.x; *lo = parts.y; }
    }
    __device__ static __forceinline__ void zero_w_copy(const Smem&) {}  // (no bf16 copy of W)
    // A: the partial logits of the 16 rows of tile m, k over the slice's features. Within a k-step
    // of 8 features, mma slot t takes feature 2t and slot t + 4 feature 2t + 1 (any order of k gives
    // the same sum), so each operand pair is one 8-byte load.
    __device__ static __forceinline__ void a_products(Sums3 (&sums)[N_TILES], const Smem& s, const V* x, const V* w16,
                                               int m, const Compute& me) {
        const int g = me.g, t = me.t;
        const float* xa = x + (16 * m + g) * X_STRIDE + 2 * t;
        const float2* wb_hi = s.w_hi + t * PAIR_STRIDE + g;
        const float2* wb_lo = s.w_lo + t * PAIR_STRIDE + g;
#pragma unroll
        for (int k = 0; k < SLICE; k += 8) {
            const float2 top = *reinterpret_cast<const float2*>(xa + k), bottom = *reinterpret_cast<const float2*>(xa + 8 * X_STRIDE + k);
            const float a[4] = {top.x, bottom.x, top.y, bottom.y};
#pragma unroll
            for (int n = 0; n < N_TILES; ++n) {
                // Lanes of padding classes load nothing (their columns' sums are never sent): with
                // 10 classes, half the second tile's loads, a sixth of A's shared-memory traffic.
                const bool live = 8 * n + g < CLASSES;
                const float2 hi = live ? wb_hi[k / 2 * PAIR_STRIDE + 8 * n] : make_float2(0.0f, 0.0f);
                const float2 lo = live ? wb_lo[k / 2 * PAIR_STRIDE + 8 * n] : make_float2(0.0f, 0.0f);
                const unsigned b_hi[2] = {__float_as_uint(hi.x), __float_as_uint(hi.y)};
                const unsigned b_lo[2] = {__float_as_uint(lo.x), __float_as_uint(lo.y)};
                mma_x(sums[n], a, b_hi, b_lo);
            }
        }
    }
    // C: dW_sliceᵀ of the 16-feature tiles m0 and m1 (A[f][r] = x[r][f]) over part `part` of the
    // tile's rows, loading each dlogits fragment once for both tiles.
    __device__ static __forceinline__ void c_products(Sums3 (&sums)[2][N_TILES], const Smem& s, const V* x, int m0,
                                               int m1, int part, const Compute& me) {
        const int g = me.g, t = me.t;
        const float* xa0 = x + t * X_STRIDE + 16 * m0 + g;
        const float* xa1 = x + t * X_STRIDE + 16 * m1 + g;
        const float* db = s.dl + t * DL_STRIDE + g;
#pragma unroll
        for (int i = 0; i < C_K_STEPS / C_K_PARTS; ++i) {
            const int k = 8 * (part * (C_K_STEPS / C_K_PARTS) + i);
            const float* x0 = xa0 + k * X_STRIDE;
            const float* x1 = xa1 + k * X_STRIDE;
            const float a0[4] = {x0[0], x0[8], x0[4 * X_STRIDE], x0[4 * X_STRIDE + 8]};
            const float a1[4] = {x1[0], x1[8], x1[4 * X_STRIDE], x1[4 * X_STRIDE + 8]};
#pragma unroll
            for (int n = 0; n < N_TILES; ++n) {
                const bool live = 8 * n + g < CLASSES;  // as in A: padding classes load nothing
                const float d[2] = {live ? db[k * DL_STRIDE + 8 * n] : 0.0f, live ? db[(k + 4) * DL_STRIDE + 8 * n] : 0.0f};
                unsigned b_hi[2], b_lo[2];
                split_tf32(d, b_hi, b_lo);
                mma_x(sums[0][n], a0, b_hi, b_lo);
                mma_x(sums[1][n], a1, b_hi, b_lo);
            }
        }
    }
    // C: W's update from the parts' sums.
    __device__ static __forceinline__ void phase_c(const Smem& s, const Compute& me, const V* x, int bias, float lr,
                                                   V* w16_next, int step, Probes& probes) {
        const int lane = me.lane, warp = me.warp;
        // A warp takes two 16-feature tiles of all classes over one of C_K_PARTS parts of the k range
        // (fewer loads of shared memory than a tile a warp); the parts meet in shared memory and are
        // added in order.
        for (int task = warp; task < C_M_PAIRS * C_K_PARTS; task += COMPUTE_WARPS) {
            const int part = task / C_M_PAIRS, pair = task - part * C_M_PAIRS;
            const int m0 = 2 * pair, m1 = min(m0 + 1, C_M_TILES - 1);  // m1 = m0: one tile, done twice
            Sums3 sums[2][N_TILES];
            c_products(sums, s, x, m0, m1, part, me);
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                if (mi == 1 && m1 == m0) break;
#pragma unroll
                for (int n = 0; n < N_TILES; ++n) {
                    const int tile = (mi ? m1 : m0) * N_TILES + n;
                    const float4 v = make_float4(total(sums[mi][n], 0), total(sums[mi][n], 1), total(sums[mi][n], 2),
                                                 total(sums[mi][n], 3));
                    reinterpret_cast<float4*>(s.dw_parts)[(part * C_TILES + tile) * 32 + lane] = v;
                }
            }
        }
        PROBE_STAMP(probes, step, C_PRODUCTS);
        compute_sync();  // every part's sums are in
        PROBE_STAMP(probes, step, C_BARRIER);
        for (int tile = warp; tile < C_TILES; tile += COMPUTE_WARPS) {
            const int m = tile / N_TILES, n = tile - m * N_TILES;
            float grads[4] = {};
#pragma unroll
            for (int part = 0; part < C_K_PARTS; ++part) {
                const float4 v = reinterpret_cast<const float4*>(s.dw_parts)[(part * C_TILES + tile) * 32 + lane];
                grads[0] += v.x; grads[1] += v.y; grads[2] += v.z; grads[3] += v.w;
            }
            update_tile<Tf32Build>(s, me, m, n, grads, bias, lr, w16_next);
        }
    }
};

// bf16 operands in one pass: W kept in fp32 in w_hi, with a bf16 copy in `w16` (a buffer of s.w16)
// for phase A where j is a class. (Why two buffers of the copy: a step's phase A reads one while its
// phase C writes the other, so the reads and writes of a buffer are always a compute barrier apart;
// with one, only the exchanges between them would order them, which compute-sanitizer's racecheck
// cannot follow.)
template <class V>
struct Bf16Build {
    typedef Sums1 Sums;
    static constexpr int A_K = (SLICE + 15) / 16 * 16;  // phase A's k range: the slice in k-steps of 16
    static constexpr int C_K_STEPS = ROWS16 / 16;       // phase C's k-steps of 16 rows
    __device__ static __forceinline__ float load_w(const Smem& s, int f, int j) {
        return reinterpret_cast<const float*>(s.w_hi + (f / 2) * PAIR_STRIDE + j)[f & 1];
    }
    __device__ static __forceinline__ void store_w(const Smem& s, int f, int j, float v, bool keep, V* w16) {
        float* hi = reinterpret_cast<float*>(s.w_hi + (f / 2) * PAIR_STRIDE + j) + (f & 1);
        V* copy = w16 + j * W16_STRIDE + f;
        const V v16 = to_elem(v);
        if (keep) *hi = v;
        if (keep && j < CLASSES) *copy = v16;
    }
    // Both buffers of W's bf16 copy zero past the classes and the slice (store_w writes the rest).
    __device__ static __forceinline__ void zero_w_copy(const Smem& s) {
        for (int i = threadIdx.x; i < 2 * W16_SIZE; i += THREADS)
            if (i % W16_SIZE / W16_STRIDE >= CLASSES || i % W16_STRIDE >= SLICE) s.w16[i] = 0;
    }
    // The same products from bf16 operands in one m16n8k16 pass, every fragment one ldmatrix.x4:
    // lanes 8q..8q+7 give the rows of the fragment's matrix q (see bf16_mma.cuh).
    // A: a = x[16m + 8(q & 1) + ·][k + 8(q >> 1) + ·]; b for column tiles 2p, 2p + 1 = W16 rows
    // 16p + 8(q >> 1) + ·, features k + 8(q & 1) + · (W16's features past SLICE are zero).
    __device__ static __forceinline__ void a_products(Sums1 (&sums)[N_TILES], const Smem& s, const V* x, const V* w16,
                                               int m, const Compute& me) {
        const int lane = me.lane, q = lane >> 3, i = lane & 7;
        const unsigned xa = smem_addr(x + (16 * m + 8 * (q & 1) + i) * X_STRIDE + 8 * (q >> 1));
        const unsigned wb = smem_addr(w16 + (8 * (q >> 1) + i) * W16_STRIDE + 8 * (q & 1));
#pragma unroll
        for (int k = 0; k < A_K; k += 16) {
            unsigned a[4];
            ldmatrix_x4(a, xa + 2 * k);
#pragma unroll
            for (int p = 0; p < N_PAIRS; ++p) {
                unsigned b[4];
                ldmatrix_x4(b, wb + 2 * (16 * p * W16_STRIDE + k));
                mma_bf16(sums[2 * p].d, a, {b[0], b[1]});
                if (2 * p + 1 < N_TILES) mma_bf16(sums[2 * p + 1].d, a, {b[2], b[3]});
            }
        }
    }
    // C: dW_sliceᵀ of the 16 features of tile row m, all classes, over all the tile's rows. A[f][r] =
    // x[r][f] and B[r][j] = dlogits[r][j] are both row-major in r, so both fragments come from
    // ldmatrix.trans: a = x rows k + 8(q >> 1) + ·, features 16m + 8(q & 1) + ·; b for column tiles
    // 2p, 2p + 1 = dlogits rows k + 8(q & 1) + ·, classes 16p + 8(q >> 1) + ·. Even and odd k-steps
    // in two sums (two chains of dependent mma a tile), added last.
    __device__ static __forceinline__ void c_products(float (&grads)[N_TILES][4], const Smem& s, const V* x, int m,
                                               const Compute& me) {
        const int lane = me.lane, q = lane >> 3, i = lane & 7;
        const unsigned xa = smem_addr(x + (8 * (q >> 1) + i) * X_STRIDE + 16 * m + 8 * (q & 1));
        const unsigned db = smem_addr(s.dl + (8 * (q & 1) + i) * DL_STRIDE + 8 * (q >> 1));
        Sums1 sums[N_TILES][2];
#pragma unroll
        for (int step = 0; step < C_K_STEPS; ++step) {
            const int k = 16 * step;
            unsigned a[4];
            ldmatrix_x4_trans(a, xa + 2 * k * X_STRIDE);
#pragma unroll
            for (int p = 0; p < N_PAIRS; ++p) {
                unsigned b[4];
                ldmatrix_x4_trans(b, db + 2 * (k * DL_STRIDE + 16 * p));
                mma_bf16(sums[2 * p][step % 2].d, a, {b[0], b[1]});
                if (2 * p + 1 < N_TILES) mma_bf16(sums[2 * p + 1][step % 2].d, a, {b[2], b[3]});
            }
        }
#pragma unroll
        for (int n = 0; n < N_TILES; ++n)
#pragma unroll
            for (int v = 0; v < 4; ++v) grads[n][v] = sums[n][0].d[v] + sums[n][1].d[v];
    }
    __device__ static __forceinline__ void phase_c(const Smem& s, const Compute& me, const V* x, int bias, float lr,
                                                   V* w16_next, int step, Probes& probes) {
        const int lane = me.lane, warp = me.warp;
        // A warp a row of tiles (16 features, all classes) over all the rows, updated from its
        // registers. (Measured slower: a warp a single tile, ~150 cycles more a step, each x fragment
        // loaded once per class tile; two warps a tile row, each over half the rows, its halves met
        // through shared memory, ~7% more an epoch: with twice the warps in C at once, each phase of
        // it took about as long as before for half the work. Phase C is bound by the SM's shared-
        // memory and issue throughput more than by its chains of mma.)
        for (int m = warp; m < C_M_TILES; m += COMPUTE_WARPS) {
            float grads[N_TILES][4];
            c_products(grads, s, x, m, me);
            PROBE_STAMP(probes, step, C_PRODUCTS);
#pragma unroll
            for (int n = 0; n < N_TILES; ++n) update_tile<Bf16Build>(s, me, m, n, grads[n], bias, lr, w16_next);
        }
    }
};

template <bool IS_BF16> struct BuildOf { typedef Tf32Build<Elem> type; };
template <> struct BuildOf<true> { typedef Bf16Build<Elem> type; };
typedef BuildOf<BF16 != 0>::type Build;

// One step of `rows` samples (BATCH for all but a short last one; inlined, so that a full step's
// row counts are constants).
__device__ __forceinline__ void train_step(const Smem& s, Compute& me, int step, int rows, int bias, float lr,
                                           int measure, Probes& probes) {
    const int lane = me.lane, warp = me.warp, g = me.g, t = me.t;
    const int r_own = owned_rows(rows), own_lo = min(rows, (int)me.rank * r_own);
    const int owned = min(rows, own_lo + r_own) - own_lo;
    const int cur = step & 1;
    const Elem* w16_now = s.w16 + cur * W16_SIZE;  // (BF16) W's copy this step reads, and the one it writes
    Elem* w16_next = s.w16 + (cur ^ 1) * W16_SIZE;
    const Elem* x = s.x + cur * ROWS16 * X_STRIDE;

    PROBE_STAMP(probes, step, C_LAST_BARRIER);  // (the step before's)
    mbarrier_wait(s.tile_full + cur, (step >> 1) & 1);  // this step's tile and labels have landed
    PROBE_STAMP(probes, step, TILE_WAIT);
    if (me.tid == 0) {  // what this step will receive: partials of the owned rows, all dlogits
        mbarrier_expect(s.inbox_full, owned * CLUSTER * CLASSES * 4);
        mbarrier_expect(s.dl_full, rows * DL_PIECES * 16);
    }
    // A short step: phase C's k-steps run past its rows, where dlogits must be zero (no block
    // pushes there this step; an earlier step's values are still in place). The barrier orders
    // these stores before phase C's loads in other warps (nothing else between them does).
    if (rows < ROWS16) {
        for (int i = rows * DL_STRIDE + me.tid; i < ROWS16 * DL_STRIDE; i += COMPUTE_THREADS) s.dl[i] = 0;
        compute_sync();
    }

    // ---- A: partial logits of this block's features, pushed to each row's owner ----------------
    // P = x·W_sliceᵀ, a warp a 16-row tile of all classes (a_products). (Two tiles a warp load
    // W's fragments half as often, but leave each warp twice the sends to issue, which costs more.)
    const int m_tiles = (rows + 15) / 16;
    for (int m = warp; m < m_tiles; m += COMPUTE_WARPS) {
        Build::Sums sums[N_TILES];
        Build::a_products(sums, s, x, w16_now, m, me);
        PROBE_STAMP(probes, step, A_PRODUCTS);
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // rows g and g + 8 of the tile
            const int r = 16 * m + g + 8 * half;
            if (r >= rows) continue;
            const int owner = r / r_own, rr = r - owner * r_own;
            const unsigned bar = remote(s.inbox_full, owner);
#pragma unroll
            for (int n = 0; n < N_TILES; ++n) {  // classes j, j + 1: one 8-byte store
                const int j = 8 * n + 2 * t;
                const unsigned dst = remote(s.inbox + (me.rank * R_MAX + rr) * INBOX_STRIDE + j, owner);
                const float v0 = total(sums[n], 2 * half), v1 = total(sums[n], 2 * half + 1);
                if (j + 1 < CLASSES) send2(dst, v0, v1, bar);
                else if (j < CLASSES) send(dst, v0, bar);
            }
        }
    }
    PROBE_STAMP(probes, step, A_SENDS);
    mbarrier_wait(s.inbox_full, step & 1);
    PROBE_STAMP(probes, step, INBOX_WAIT);

    // ---- B: the owned rows: logits, softmax, dlogits to every block --------------------------
    // ROW_LANES threads a row, thread j its class j: z_j = b_j + Σ_c partial_c (c in order), the
    // row's max and sum by shuffles among them, and dlogit_j; then thread p sends the row to
    // block p (unsplit: half the remote stores of (hi, lo) pairs; phase C splits them). Whole warps take part (a row past the owned ones computes but sends nothing).
    for (int base = warp * 32; base < owned * ROW_LANES; base += COMPUTE_THREADS) {
        const int row = (base + lane) / ROW_LANES, rr = min(row, R_MAX - 1), j = lane % ROW_LANES, r = own_lo + rr;
        const bool row_owned = row < owned, is_class = j < CLASSES;
        const int label = s.labels[cur * R_MAX + rr];
        float partials = 0.0f;  // in x's unit
#pragma unroll
        for (int from = 0; from < CLUSTER; ++from) partials += s.inbox[(from * R_MAX + rr) * INBOX_STRIDE + j];
        const float z = is_class ? s.b[j] + X_UNIT * partials : -__int_as_float(0x7f800000);
        float m, sum;
        const float dl = warp_softmax_grad<ROW_LANES>(z, is_class, j, label, rows, m, sum);
        Elem* gathered = s.dl_row + (row_owned ? rr : R_MAX) * ROW_LANES;  // a spare row past the owned
        gathered[j] = to_elem(dl);  // BF16: rounded here, as phase C reads it in every block
        __syncwarp();
        if (row_owned && j < CLUSTER) {  // to block j: the row's classes, DL_PIECE a store
            const float4* pieces = reinterpret_cast<const float4*>(gathered);  // the bits, whatever they hold
#pragma unroll
            for (int q = 0; q < DL_PIECES; ++q)
                send4(me.dl_to + sizeof(Elem) * (r * DL_STRIDE + DL_PIECE * q), pieces[q], me.dl_full_to);
        }
        if (measure) {
            unsigned at_max;
            const float z_label = warp_label_logit(z, is_class, lane & ~(ROW_LANES - 1), label, m, at_max);
            if (row_owned && j == 0) {
                me.loss_sum += (double)xent_loss(sum, m, z_label);
                me.correct_sum += first_max_is(at_max, label) ? 1.0 : 0.0;
            }
        }
        __syncwarp();  // the row's pieces are read before the next row's overwrite them
    }
    PROBE_STAMP(probes, step, B);
    mbarrier_wait(s.dl_full, step & 1);
    PROBE_STAMP(probes, step, DLOGITS_WAIT);

    // ---- C: this block's slice of W and its copy of b, from its copy of dlogits ---------------
    // dW_sliceᵀ = xᵀ·dlogits: rows are the slice's features and then the bias (a feature whose
    // input, X_LEVELS, is the tile's column SLICE), k runs over the tile's rows (past the step's
    // rows, dlogits are zero); update_tile applies each 16 × 8 tile of it.
    Build::phase_c(s, me, x, bias, lr, w16_next, step, probes);
    mbarrier_arrive(s.tile_free + cur);  // this thread's last read of the tile is behind it
    PROBE_STAMP(probes, step, C_UPDATE);
    compute_sync();  // the updates before the next step's phase A reads W and b
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
softmax_epoch(const void* images, const int* labels, const int* order, float* w, float* b,
              int bias, int num_samples, int num_steps, float lr, double* metrics, int measure) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Smem s = carve(smem_raw);
    const unsigned rank = cluster_rank();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int col0 = rank * SLICE;

    for (int i = tid; i < SLICE * PAIR_STRIDE; i += THREADS) {
        const int f = i / PAIR_STRIDE, j = i - f * PAIR_STRIDE;
        Build::store_w(s, f, j, j < CLASSES && col0 + f < FEATURES ? w[j * FEATURES + col0 + f] : 0.0f, true, s.w16);
    }
    Build::zero_w_copy(s);
    // Tiles and dlogits start at zero: the mma tiles read rows past a step's last one (and
    // dlogits' columns past the classes), whose products are discarded but must be finite. A
    // tile row's column SLICE is the bias's input, X_LEVELS (1 in x's unit); the copies never
    // write there.
    const Elem bias_input = to_elem((float)X_LEVELS);
    for (int i = tid; i < 2 * ROWS16 * X_STRIDE; i += THREADS) s.x[i] = i % X_STRIDE == SLICE ? bias_input : 0;
    for (int i = tid; i < ROWS16 * DL_STRIDE; i += THREADS) s.dl[i] = 0;
    if (tid < ROW_LANES) s.b[tid] = bias && tid < CLASSES ? b[tid] : 0.0f;
    if (tid == 0) {
        mbarrier_init(s.inbox_full, 1);
        mbarrier_init(s.dl_full, 1);
        for (int i = 0; i < 2; ++i) mbarrier_init(s.tile_full + i, 32 * FETCH_WARPS);
        for (int i = 0; i < 2; ++i) mbarrier_init(s.tile_free + i, COMPUTE_THREADS);
        mbarrier_init_fence();
    }
    __syncthreads();
    // No block may write into another's shared memory (nor count on its barriers) before every
    // block of the cluster runs and has set up its barriers.
    cluster_sync();

    const int to = min(lane % ROW_LANES, CLUSTER - 1);
    Compute me{rank, tid, lane, warp, lane >> 2, lane & 3, remote(s.dl, to), remote(s.dl_full, to)};
    if (warp >= COMPUTE_WARPS) {
        fetch_epoch(s, static_cast<const Elem*>(images), labels, order, num_samples, num_steps, rank, warp - COMPUTE_WARPS, lane);
    } else {
        const int full_steps = min(num_steps, num_samples / BATCH);
        Probes probes(metrics);  // (a probe build's table, where the metrics would go)
        for (int step = 0; step < full_steps; ++step) train_step(s, me, step, BATCH, bias, lr, measure, probes);
        if (full_steps < num_steps)
            train_step(s, me, full_steps, step_rows(full_steps, BATCH, num_samples), bias, lr, measure, probes);
    }

    // ---- W slice and bias back to global memory; the metrics, summed over the cluster in order --
    __syncthreads();
    for (int i = tid; i < SLICE * CLASSES; i += THREADS) {
        const int f = i / CLASSES, j = i - f * CLASSES;
        if (col0 + f < FEATURES) w[j * FEATURES + col0 + f] = Build::load_w(s, f, j);
    }
    if (bias && rank == 0 && tid < CLASSES) b[tid] = s.b[tid];
    if (measure) cluster_metrics(s.totals, COMPUTE_WARPS, me.loss_sum, me.correct_sum, metrics);
    cluster_sync();  // no block leaves while another may still read its shared memory
}
