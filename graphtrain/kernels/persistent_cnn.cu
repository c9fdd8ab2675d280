// `persistent` for the cnn: conv(1→C1, K1×K1) → max-pool 2 → ReLU → conv(C1→C2, K2×K2) → max-pool 2 →
// ReLU → flatten (FLAT = C2·P2·P2) → linear HIDDEN, ReLU → linear CLASSES, trained with the recipe's
// optimizer and schedule by a cooperative grid of BLOCKS blocks (one per SM); one launch runs an
// epoch's steps. The parameters, the optimizer's state and the exchanged activations live in global
// memory (L2); a block keeps in shared memory what a phase of its own reads (the conv weights, a
// sample's maps, its conv gradient sums, the tiles of a product).
//
// A step of `rows` samples (read through the sample order), in six phases, each ended by a grid
// barrier (every block's writes before it visible to every block after):
//
//   1 per sample r ≡ rank (mod BLOCKS): the image, conv 1 + pool + ReLU → a1 (kept, with each pool
//     window's argmax, for phase 5), conv 2 + pool + ReLU → a2[r] (published), its argmaxes (kept)
//   2 fc1, tiles of TILE rows × TILE units, each over one of FC1_PARTS parts q of the inputs (blocks
//     the tiles alone would leave idle):  h_q = a2[:, part q] · W1[:, part q]ᵀ           (published)
//   3 a warp a row: h = relu(h_0 + h_1 + … + b1) (published), z = h·W2ᵀ + b2,
//                   dz = (softmax(z) − onehot(y)) / rows, dh = dz·W2 ⊙ [h > 0]          (published)
//   4 tiles of W1 (TILE units × TILE features): dW1 = dhᵀ·a2 and its owner's update, written to the
//     other copy of W1 (two, by step parity: the tiles of da2 read this step's as it is written);
//     tiles of da2 = dh·W1 (TILE rows × TILE features);
//     the last blocks (those without an extra tile) W2's columns and b1's units, HEAD_UNITS a group
//     (group 0 b2 too): their gradients (a thread its rows in order, a warp's lanes, then the warps in
//     order) and updates
//   5 per sample (the block's of phase 1): back through ReLU and pool 2 to conv 2's output gradient,
//     conv 2's weight gradient and its input gradient at pool 1's argmaxes, back through ReLU and
//     pool 1, conv 1's weight gradient; the block's sums over its samples published
//   6 each conv parameter's gradient, the blocks' sums added in a fixed order by its owner (a block a
//     contiguous range of them), and its update (in one pass also written, rounded to TF32, at its place
//     among phase 1's B fragments in the workspace); the next step's phase 1 copies them anew, and
//     its images are fetched into L2 in the barrier after phase 5
//
// The products of phases 2 and 4 run on the tensor cores (mma.sync m16n8k8, TF32 operands, fp32 sums)
// in PASSES passes: 1 (TF32, the recipe's tf32) or 3 (each operand split hi + lo, near-fp32: fp32).
// In one pass phase 1's convolutions do too (implicit GEMMs, conv_pool_relu_tc), and phase 5's conv 2
// input gradient (pool1_gradient_tc) and weight gradient (conv2_weight_gradient_tc); in three they
// are fp32 FMAs (conv_pool_relu, pool1_gradient, sample_backward's loop). Conv 1's weight gradient, the
// conv bias gradients and the head are fp32 FMAs either way. Every sum runs in a fixed order with no float
// atomics (the barrier's counter is an integer), so a seed gives the same weights bit for bit.
//
// The optimizer is optim.cu's (its OptimizerConstants read from the device at the launch, its rate
// from schedule_lr at step first_step + s): a restart writes another recipe there.
//
// Compile-time (kernels/persistent_cnn.py): BLOCKS, THREADS (256), IMG, C1, K1, C2, K2, HIDDEN, CLASSES
// (≤ 32), BATCH, PASSES, the shared-memory layout SMEM_*, the workspace's WS_*, and optim.cu's OC_*.

#define WARPS (THREADS / 32)
#define H1 (IMG - K1 + 1)          // conv 1's output side
#define P1 (H1 / 2)                // after pool 1
#define H2 (P1 - K2 + 1)           // conv 2's
#define P2 (H2 / 2)                // after pool 2
#define WP (H2 + 2 * (K2 - 1))     // conv 2's output gradient with a zero border of K2 − 1 (phase 5)
#define WPS (WP * WP + (40 - WP * WP % 32) % 32)  // its maps' stride, ≡ 8 (mod 32): see pool1_gradient_tc
#define PIX (IMG * IMG)
#define A1 (C1 * P1 * P1)          // a sample's pooled conv-1 map
#define A2 (C2 * P2 * P2)          // a sample's pooled conv-2 map: FLAT
#define FLAT A2
#define NW1 (C1 * K1 * K1)
#define NW2 (C2 * C1 * K2 * K2)
#define NCONV (NW1 + C1 + NW2 + C2)  // the conv parameters, first in the span
// The parameter span, the model's order: conv 1 W, b, conv 2 W, b, fc1 W, b, fc2 W, b.
#define P_CW1 0
#define P_CB1 (P_CW1 + NW1)
#define P_CW2 (P_CB1 + C1)
#define P_CB2 (P_CW2 + NW2)
#define P_W1 (P_CB2 + C2)
#define P_B1 (P_W1 + HIDDEN * FLAT)
#define P_W2 (P_B1 + HIDDEN)
#define P_B2 (P_W2 + CLASSES * HIDDEN)
#define NPARAMS (P_B2 + CLASSES)
// Phase 1 in one pass (PASSES 1): each convolution an implicit GEMM on the tensor cores,
// conv[(y, x)][o] = Σ_k A[(y, x)][k]·B[k][o], in k-steps of 8 and n-tiles of 8 output maps. Conv 1's
// k = u·K1 + v (its taps row-major; zero weights past K1²). Conv 2's k-step ks = (u·K2 + v)·CG2 + cg
// holds channels 8cg .. 8cg + 7 of tap (u, v) (zero weights past C1), so that a lane's k is always
// the same channel offset: its A loads a fixed address apart from its channel's map, no table.
#define KT1 ((K1 * K1 + 7) / 8)
#define NT1 ((C1 + 7) / 8)
#define CG2 ((C1 + 7) / 8)
#define KT2 (K2 * K2 * CG2)
#define NT2 ((C2 + 7) / 8)
#define CONV_FRAGS (KT1 * NT1 + KT2 * NT2)  // B fragments (k-step, n-tile) of both, conv 1's first
// Phase 5's conv 2 input gradient in one pass, dp1[(y, x)][c] = Σ_k A[(y, x)][k]·B[k][c] on the tensor
// cores: k-step ks = (u·K2 + v)·OG2 + og holds output maps 8og .. 8og + 7 of tap (u, v) (zero weights
// past C2), n-tiles of 8 input channels, m-tiles of 16 positions of pool 1's output.
// TC_INPUT_GRADIENT (the launcher's, in one pass only): on the tensor cores, else pool1_gradient's FMAs.
// TC_WEIGHT_GRADIENT (the launcher's, in one pass only): phase 5's conv 2 weight gradient on the tensor
// cores too (conv2_weight_gradient_tc), else fp32 FMAs.
#define OG2 ((C2 + 7) / 8)
#define BNT2 ((C1 + 7) / 8)
#define BMT2 ((P1 * P1 + 15) / 16)
// TILE: a product's tile, 32 × 32 outputs, one m16n8 piece a warp; KC: the k-values of a tile's
// operands staged at a time; PREFETCH: the chunks of KC in flight (all from the launcher, which lays
// out the staged tiles)
// A staged operand's tile, laid out as its values lie in memory, so that a warp's stores (32 values
// adjacent there) fill 32 banks: an operand whose values run along k (k_fast) as t[m][k] in rows of
// STAGE_STRIDE ≡ 4 (mod 32), the others as t[k][m] in rows of STAGE_ROWS ≡ 8 (mod 32); in either a
// fragment's loads, lanes (g, t) at (m + g, k + t), fall on 32 banks (4g + t, or 8t + g).
#define STAGE_STRIDE (KC + 4)
#define STAGE_ROWS (TILE + 8)
#define STAGE_FLOATS (TILE * STAGE_STRIDE > KC * STAGE_ROWS ? TILE * STAGE_STRIDE : KC * STAGE_ROWS)  // a buffer
#define STAGED (TILE * KC / THREADS)  // the values of an operand's staged tile a thread loads
#define ROW_TILES ((BATCH + TILE - 1) / TILE)
#define UNIT_TILES ((HIDDEN + TILE - 1) / TILE)
#define FLAT_TILES ((FLAT + TILE - 1) / TILE)
#define FC1_TILES (ROW_TILES * UNIT_TILES)
#define DW1_TILES (UNIT_TILES * FLAT_TILES)
#define DA2_TILES (ROW_TILES * FLAT_TILES)
// Phase 4's head gradients: groups of HEAD_UNITS units over the HEAD_BLOCKS last blocks, those past
// the blocks with an extra tile of dW1 or da2 (all of them where the tiles share out evenly)
#define HEAD_UNITS 4
#define HEAD_GROUPS ((HIDDEN + HEAD_UNITS - 1) / HEAD_UNITS)
#define EXTRA_TILES (DW1_TILES % BLOCKS > DA2_TILES % BLOCKS ? DW1_TILES % BLOCKS : DA2_TILES % BLOCKS)
#define HEAD_BLOCKS (BLOCKS - EXTRA_TILES)
#define HEAD_VALUES ((CLASSES + 1) * HEAD_UNITS)  // a group's W2 and b1 sums (b2's CLASSES after them)

// In one pass the layout table's work and dp1 regions hold phase 1's B fragments too.
#if PASSES == 1 && SMEM_DP2 - SMEM_WORK < CONV_FRAGS * 64 * 4
#error "persistent_cnn.cu: the layout table's work and dp1 regions cannot hold phase 1's B fragments"
#endif
#if SMEM_TB - SMEM_TA < 2 * STAGE_FLOATS * 4
#error "persistent_cnn.cu: the layout table's ta region is smaller than two staged tiles"
#endif
#if 2 * STAGE_FLOATS < WARPS * (HEAD_VALUES + CLASSES) || HEAD_VALUES + CLASSES > THREADS
#error "persistent_cnn.cu: phase 4 adds the head's gradients in ta (every warp's HEAD_VALUES + CLASSES), a thread a value"
#endif
#if THREADS % KC != 0 || THREADS % TILE != 0
#error "persistent_cnn.cu: a thread's staged values must lie a whole number of rows (or inputs) apart"
#endif
#if TILE * STAGE_STRIDE < THREADS
#error "persistent_cnn.cu: phase 6 adds its parts' sums in ta, which must hold a value a thread"
#endif
#if SMEM_DP1 - SMEM_WORK < C2 * WPS * 4
#error "persistent_cnn.cu: the layout table's work region is smaller than conv 2's bordered output gradient"
#endif
#if H1 % 2 != 0 || H2 % 2 != 0 || P2 < 1 || CLASSES > 32 || CLASSES < 1 || THREADS != 256 || (PASSES != 1 && PASSES != 3) \
    || TILE != 32 || KC % 8 != 0 || TILE * KC % THREADS != 0 || PREFETCH < 1
#error "persistent_cnn.cu: unsupported sizes"
#endif

// ---- shared memory (the layout table: kernels/persistent_cnn.py, CnnShape.layout) -----------------
struct Smem {
    double* totals;  // [2·WARPS]        the warps' loss and correct counts, at the end
    float* conv;     // [NCONV]          the conv parameters (this step's), in the span's order
    float* grad;     // [NCONV]          the block's conv gradient sums over its samples, this step
    float* x;        // [PIX]            a sample's image
    float* a1;       // [A1]             its pooled conv-1 map (after the ReLU)
    float* work;     // [C2][WPS]         conv 2's output gradient, zero-bordered (phase 5); in one pass
                     //   work and dp1 (next to it) are also wtc's (phase 1, staged each step before it)
    float* dp1;      // [A1]             the gradient at pool 1's outputs, masked by its ReLU (phase 5)
    float* dp2;      // [A2]             the gradient at pool 2's outputs, masked (phase 5)
    unsigned char* arg1;  // [A1]        pool 1's argmaxes (window position 0..3, row-major)
    unsigned char* arg2;  // [A2]        pool 2's
    float* ta;       // [2][STAGE_FLOATS]  a product's A tile, staged (two buffers: tile_product)
    float* tb;       // [2][STAGE_FLOATS]  its B tile
    float* wtc;      // [CONV_FRAGS][32][2] from work on (one pass only): the conv weights rounded to TF32
                     //   as phase 1's mma read them; phase 5 zeroes work and writes dp1 before it reads them
    // The maps phase 5 reads of the block's first KEPT samples, kept from phase 1 (nullptr where KEPT is 0)
    float* kept_x;   // [KEPT][PIX]      each one's image (as loaded: not rounded)
    float* kept_a1;  // [KEPT][A1]       its pooled conv-1 map (fp32)
    unsigned char* kept_arg1;  // [KEPT][A1]  pool 1's argmaxes
#ifdef PROBES
    long long* probe_counts;  // [PROBE_PHASES]  the probe build's phase counts
#endif
};

__device__ Smem carve(unsigned char* base) {
    Smem s;
    SMEM_REGION(s, base, totals, SMEM_TOTALS);
    SMEM_REGION(s, base, conv, SMEM_CONV);
    SMEM_REGION(s, base, grad, SMEM_GRAD);
    SMEM_REGION(s, base, x, SMEM_X);
    SMEM_REGION(s, base, a1, SMEM_A1);
    SMEM_REGION(s, base, work, SMEM_WORK);
    SMEM_REGION(s, base, dp1, SMEM_DP1);
    SMEM_REGION(s, base, dp2, SMEM_DP2);
    SMEM_REGION(s, base, arg1, SMEM_ARG1);
    SMEM_REGION(s, base, arg2, SMEM_ARG2);
    SMEM_REGION(s, base, ta, SMEM_TA);
    SMEM_REGION(s, base, tb, SMEM_TB);
    s.wtc = s.work;
#if KEPT > 0
    SMEM_REGION(s, base, kept_x, SMEM_KEPT_X);
    SMEM_REGION(s, base, kept_a1, SMEM_KEPT_A1);
    SMEM_REGION(s, base, kept_arg1, SMEM_KEPT_ARG1);
#else
    s.kept_x = s.kept_a1 = nullptr;
    s.kept_arg1 = nullptr;
#endif
#ifdef PROBES
    SMEM_REGION(s, base, probe_counts, SMEM_PROBE_COUNTS);
#endif
    check_shared_bytes(SMEM_BYTES);
    return s;
}

// ---- global workspace (its table: CnnShape.workspace; the launcher zeroes `barrier`) -----------------
struct Workspace {
    unsigned long long* barrier;  // the grid barrier's arrivals
    double* block_metrics;        // [BLOCKS][2]     each block's loss and correct count
    float* w1_other;              // [HIDDEN][FLAT]  the second copy of W1 (odd steps read it)
    float* a1;                    // [BATCH][A1]     each sample's pooled conv-1 map (its block's own)
    unsigned char* arg1;          // [BATCH][A1]     pool 1's argmaxes (the block's own)
    unsigned char* arg2;          // [BATCH][A2]     pool 2's (the block's own)
    float* a2;                    // [BATCH][FLAT]   the flattened conv output
    float* h_parts;               // [FC1_PARTS][BATCH][HIDDEN] fc1's sums over each part of its inputs
    float* h;                     // [BATCH][HIDDEN] fc1's output
    float* dh;                    // [BATCH][HIDDEN] its gradient (ReLU-masked)
    float* dz;                    // [BATCH][CLASSES] dlogits
    float* da2;                   // [BATCH][FLAT]   the gradient at the flattened conv output
    float* conv_part;             // [BLOCKS][NCONV] each block's conv gradient sums
    float* conv_frags;            // [CONV_FRAGS][32][2] one pass: phase 1's B fragments of the conv weights
                                  //   (wtc's layout), written by their owners' updates in phase 6
};

__device__ Workspace workspace_at(unsigned char* base) {
    return Workspace{reinterpret_cast<unsigned long long*>(base + WS_BARRIER), reinterpret_cast<double*>(base + WS_BLOCK_METRICS),
                     reinterpret_cast<float*>(base + WS_W1_OTHER), reinterpret_cast<float*>(base + WS_A1),
                     reinterpret_cast<unsigned char*>(base + WS_ARG1), reinterpret_cast<unsigned char*>(base + WS_ARG2),
                     reinterpret_cast<float*>(base + WS_A2), reinterpret_cast<float*>(base + WS_H_PARTS), reinterpret_cast<float*>(base + WS_H),
                     reinterpret_cast<float*>(base + WS_DH), reinterpret_cast<float*>(base + WS_DZ),
                     reinterpret_cast<float*>(base + WS_DA2), reinterpret_cast<float*>(base + WS_CONV_PART),
                     reinterpret_cast<float*>(base + WS_CONV_FRAGS)};
}

// ---- the grid barrier: grid_sync.cuh's grid_sync(counter) --------------------------------------

// ---- the optimizer: optim.cu's update of one parameter ---------------------------------------------
struct Update {
    OptimizerConstants c;
    float lr, step_size, rc2;  // the step's rate, lr / (1 − β1^t), 1 / √(1 − β2^t)
    __device__ Update(const OptimizerConstants* constants, int t) : c(*constants) {
        const Schedule sch{c.schedule, c.total, c.warmup, c.lr, c.pct, c.div, c.final_div};
        lr = schedule_lr(sch, t - 1);
        const float c1 = (float)(1.0 - pow((double)c.beta1, (double)t));
        rc2 = (float)rsqrt(1.0 - pow((double)c.beta2, (double)t));
        step_size = lr / c1;
    }
    // The parameter's new value from its value w and gradient g; s1, s2: its state slots.
    __device__ __forceinline__ float apply(float w, float g, float* s1, float* s2) const {
        return apply(State::of(w, s1, s2, c.optimizer), g, s1, s2);
    }
    // The same from its value and state loaded before its gradient was ready (State::of), so that
    // their round trip to L2 passed under the gradient's work; the new state is written to s1, s2.
    struct State {
        float w, s1, s2;
        __device__ __forceinline__ static State of(float w, const float* s1, const float* s2, int optimizer) {
            return State{w, optimizer == 0 ? 0.0f : *s1, optimizer >= 3 ? *s2 : 0.0f};
        }
    };
    __device__ __forceinline__ float apply(State at, float g, float* s1, float* s2) const {
        float w = at.w;
        if (c.optimizer == 4) w *= 1.0f - lr * c.weight_decay;
        else g = fmaf(c.weight_decay, w, g);
        if (c.optimizer == 0) return w - lr * g;
        if (c.optimizer <= 2) {
            const float b = fmaf(c.momentum, at.s1, g);
            *s1 = b;
            return w - lr * (c.optimizer == 2 ? fmaf(c.momentum, b, g) : b);
        }
        const float m = fmaf(c.beta1, at.s1, (1.0f - c.beta1) * g);
        const float v = fmaf(c.beta2, at.s2, (1.0f - c.beta2) * g * g);
        *s1 = m;
        *s2 = v;
        return w - step_size * m / fmaf(sqrtf(v), rc2, c.eps);
    }
};

// ---- the tensor-core products ----------------------------------------------------------------------
// A TF32 operand rounded to nearest (ties away), as cvt.rna.tf32.f32 gives it.
__device__ __forceinline__ unsigned tf32_rounded(float v) { return (__float_as_uint(v) + 0x1000u) & 0xffffe000u; }

// A value rounded to TF32 (tf32_rounded), as a float: an operand of phase 1's mma, staged rounded.
__device__ __forceinline__ float tf32_value(float v) { return __uint_as_float(tf32_rounded(v)); }

// An operand of a product, M × K (or N × K): value(m, k) = p[m·sm + k·sk] inside (rows, ks), zero
// past them. k_fast: the operand's adjacent values run along k (its tile is staged k-fastest).
struct Operand {
    const float* p;
    int sm, sk, rows, ks;
    bool k_fast;
    __device__ __forceinline__ float at(int m, int k) const { return m < rows && k < ks ? __ldcg(p + (long long)m * sm + (long long)k * sk) : 0.0f; }
    // Where value (m, k) of the tile lies in its staged buffer (STAGE_STRIDE above).
    __device__ __forceinline__ int staged(int m, int k) const { return k_fast ? m * STAGE_STRIDE + k : k * STAGE_ROWS + m; }
    // The tile's rows m0.. and inputs k0.. (staged at staged(m − m0, k − k0)): load()
    // issues a thread's STAGED loads into registers, store() puts them in the staged tile. Value j of
    // a thread is element e = tid + j·THREADS: (m, k) = (e / KC, e mod KC) k-fast, else (e mod TILE,
    // e / TILE), so j moves m (or k) on by THREADS / KC (or THREADS / TILE) and the loads lie a constant
    // distance apart. A chunk inside the operand (most) loads without bounds, from one address (an
    // immediate offset each): per value, at()'s bounds and 64-bit address cost a load six instructions.
    __device__ __forceinline__ void load(float (&v)[STAGED], int m0, int k0) const {
        const int mi = k_fast ? threadIdx.x / KC : threadIdx.x % TILE, ki = k_fast ? threadIdx.x % KC : threadIdx.x / TILE;
        if (m0 + TILE <= rows && k0 + KC <= ks) {
            const float* first = p + (m0 + mi) * sm + (k0 + ki) * sk;  // (an operand's offsets fit an int)
            const int step = k_fast ? THREADS / KC * sm : THREADS / TILE * sk;
#pragma unroll
            for (int j = 0; j < STAGED; ++j) v[j] = __ldcg(first + j * step);
        } else {
#pragma unroll
            for (int j = 0; j < STAGED; ++j)
                v[j] = k_fast ? at(m0 + mi + j * (THREADS / KC), k0 + ki) : at(m0 + mi, k0 + ki + j * (THREADS / TILE));
        }
    }
    __device__ __forceinline__ void store(float* t, const float (&v)[STAGED]) const {
#pragma unroll
        for (int j = 0; j < STAGED; ++j) {
            const int e = threadIdx.x + j * THREADS;
            t[k_fast ? staged(e / KC, e % KC) : staged(e % TILE, e / TILE)] = v[j];
        }
    }
};

// The tile C[m0 .. m0+31][n0 .. n0+31] of A·Bᵀ over k < ks: warp w computes rows m0 + 16·(w % 2) + {g, g+8}
// and columns n0 + 8·(w / 2) + {2t, 2t+1} (d as mma_tf32 lays it out), the k-steps in order.
// The operands come in chunks of KC inputs: PREFETCH chunks' loads in flight in registers (a ring
// refilled in place: the chunk PREFETCH ahead loads into the slot just staged), so that L2's latency
// passes under PREFETCH chunks' products, not one; chunk c staged in buffer c % 2, one barrier a
// chunk (chunk c's stores overwrite chunk c − 2's tiles, whose readers all passed chunk c − 1's
// barrier). Registers: 2·PREFETCH·STAGED a thread for the ring.
__device__ __forceinline__ void tile_product(const Smem& s, const Operand& a, const Operand& b, int m0, int n0, int ks,
                                             float (&d)[4]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#if PASSES == 3
    Sums3 sums;
#else
    float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#endif
    float va[PREFETCH][STAGED], vb[PREFETCH][STAGED];
#pragma unroll
    for (int p = 0; p < PREFETCH; ++p) {  // (chunks past ks load nothing: at() gives their zeros)
        a.load(va[p], m0, p * KC);
        b.load(vb[p], n0, p * KC);
    }
    __syncthreads();  // (the buffers' last readers, the previous tile's or another phase's, are done)
    for (int k0 = 0; k0 < ks; k0 += PREFETCH * KC) {
#pragma unroll
        for (int p = 0; p < PREFETCH; ++p) {
            const int kc = k0 + p * KC;
            if (kc >= ks) break;
            const int buffer = (kc / KC) & 1;
            float* staged_a = s.ta + buffer * STAGE_FLOATS;
            float* staged_b = s.tb + buffer * STAGE_FLOATS;
            a.store(staged_a, va[p]);
            b.store(staged_b, vb[p]);
            __syncthreads();
            if (kc + PREFETCH * KC < ks) {
                a.load(va[p], m0, kc + PREFETCH * KC);
                b.load(vb[p], n0, kc + PREFETCH * KC);
            }
            const int ma = 16 * (warp & 1) + g, nb = 8 * (warp >> 1) + g;
#pragma unroll
            for (int kk = 0; kk < KC; kk += 8) {
                const float av[4] = {staged_a[a.staged(ma, kk + t)], staged_a[a.staged(ma + 8, kk + t)],
                                     staged_a[a.staged(ma, kk + t + 4)], staged_a[a.staged(ma + 8, kk + t + 4)]};
                const float bv[2] = {staged_b[b.staged(nb, kk + t)], staged_b[b.staged(nb, kk + t + 4)]};
#if PASSES == 3
                mma_split(sums, av, bv);
#else
                const unsigned ar[4] = {tf32_rounded(av[0]), tf32_rounded(av[1]), tf32_rounded(av[2]), tf32_rounded(av[3])};
                const unsigned br[2] = {tf32_rounded(bv[0]), tf32_rounded(bv[1])};
                mma_tf32(sums, ar, br);
#endif
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#if PASSES == 3
        d[i] = total(sums, i);
#else
        d[i] = sums[i];
#endif
}

// The output (m, n) of d[i] in tile_product's tile at (m0, n0).
__device__ __forceinline__ void tile_place(int m0, int n0, int i, int& m, int& n) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    m = m0 + 16 * (warp & 1) + (lane >> 2) + (i >= 2 ? 8 : 0);
    n = n0 + 8 * (warp >> 1) + 2 * (lane & 3) + (i & 1);
}

// ---- phase 1: a sample's convolutions ------------------------------------------------------------
struct Step {
    int step, rows, rank;
    const int* order;  // the step's sample indices (global); nullptr: sample `first + r` (the evaluation)
    int first;
    __device__ __forceinline__ int sample(int r) const { return order ? __ldg(order + r) : first + r; }
};

// out[o][pi][pj] = max over the 2×2 window of conv(in)[o] + b[o], then ReLU; arg its first maximum's
// position (row-major), each written to shared memory (out, arg) and to out_global, arg_global (the
// workspace, or the block's kept maps in shared memory: plain stores). in: cin maps of side `side`,
// w: [cout][cin][k][k]. A thread OG output maps' pooled outputs at one position: their windows' four conv outputs each from one (K+1)×(K+1) patch of
// each input map, held in registers with the OG filters' K×K taps (a patch's loads feed OG maps; each
// output's sum over c, u, v in that order).
template <int CIN, int COUT, int SIDE, int K, int OG>
__device__ __forceinline__ void conv_pool_relu(const float* in, const float* w, const float* b, float* out,
                                               unsigned char* arg, float* out_global, unsigned char* arg_global) {
    static_assert(COUT % OG == 0, "a thread's maps divide the layer's");
    constexpr int CONV = SIDE - K + 1, POOLED = CONV / 2, AREA = POOLED * POOLED;
    for (int task = threadIdx.x; task < COUT / OG * AREA; task += THREADS) {
        const int o0 = task / AREA * OG, p = task % AREA, pi = p / POOLED, pj = p - pi * POOLED;
        float z[OG][4];  // each map's window of conv outputs, row-major
#pragma unroll
        for (int g = 0; g < OG; ++g)
#pragma unroll
            for (int q = 0; q < 4; ++q) z[g][q] = 0.0f;
        for (int c = 0; c < CIN; ++c) {
            const float* patch_at = in + (c * SIDE + 2 * pi) * SIDE + 2 * pj;
            float patch[K + 1][K + 1];
#pragma unroll
            for (int u = 0; u <= K; ++u)
#pragma unroll
                for (int v = 0; v <= K; ++v) patch[u][v] = patch_at[u * SIDE + v];
#pragma unroll
            for (int g = 0; g < OG; ++g) {
                const float* taps = w + ((o0 + g) * CIN + c) * K * K;
                float tap[K][K];
#pragma unroll
                for (int u = 0; u < K; ++u)
#pragma unroll
                    for (int v = 0; v < K; ++v) tap[u][v] = taps[u * K + v];
#pragma unroll
                for (int u = 0; u < K; ++u)
#pragma unroll
                    for (int v = 0; v < K; ++v)
#pragma unroll
                        for (int q = 0; q < 4; ++q) z[g][q] = fmaf(patch[u + (q >> 1)][v + (q & 1)], tap[u][v], z[g][q]);
            }
        }
#pragma unroll
        for (int g = 0; g < OG; ++g) {
            float best = 0.0f;
            int best_at = 0;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float zq = z[g][q] + b[o0 + g];
                if (q == 0 || zq > best) { best = zq; best_at = q; }
            }
            const int i = (o0 + g) * AREA + p;
            const float a = fmaxf(best, 0.0f);
            out[i] = a;
            arg[i] = arg_global[i] = (unsigned char)best_at;
            out_global[i] = a;
        }
    }
}

// Output maps a thread of conv_pool_relu computes: as many as divide the layer's, up to `most`.
#define MAPS_A_THREAD(cout, most) ((cout) % (most) == 0 ? (most) : (cout) % 2 == 0 ? 2 : 1)

#if PASSES == 1

// The conv weights as phase 1's B fragments, rounded to TF32, from the staged parameters: fragment
// f = ks·NT + nt of a layer, lane (g, t), holds B[t][g], B[t + 4][g] of its k-step ks and n-tile nt
// (output map o = 8nt + g; zero past the layer's maps and taps) at wtc[(f·32 + lane)·2 ..]: a lane's
// two values one 8-byte load, a warp's 256 contiguous bytes.
__device__ void stage_conv_fragments(const Smem& s) {
    for (int e = threadIdx.x; e < CONV_FRAGS * 64; e += THREADS) {
        const int lane = (e >> 1) & 31, g = lane >> 2, kin = (lane & 3) + 4 * (e & 1);
        int f = e >> 6;
        float v = 0.0f;
        if (f < KT1 * NT1) {
            const int ks = f / NT1, o = (f - ks * NT1) * 8 + g, k = ks * 8 + kin;
            if (o < C1 && k < K1 * K1) v = s.conv[P_CW1 + o * K1 * K1 + k];
        } else {
            f -= KT1 * NT1;
            const int ks = f / NT2, o = (f - ks * NT2) * 8 + g, tap = ks / CG2, c = (ks - tap * CG2) * 8 + kin;
            if (o < C2 && c < C1) v = s.conv[P_CW2 + (o * C1 + c) * K2 * K2 + tap];
        }
        s.wtc[e] = tf32_value(v);
    }
}

// Where conv parameter i of the span lies in stage_conv_fragments' layout (its e), or −1 (a bias).
// (Not inlined: inlined into phase 6's loop, cnn_epoch spilled 32 bytes.)
__device__ __noinline__ int conv_fragment_at(int i) {
    int f, o, kin;
    if (i < P_CB1) {
        o = i / (K1 * K1);
        const int k = i - o * K1 * K1;
        f = k / 8 * NT1 + o / 8;
        kin = k % 8;
    } else if (i >= P_CW2 && i < P_CB2) {
        const int j = i - P_CW2, oc = j / (K2 * K2), tap = j - oc * K2 * K2, c = oc % C1;
        o = oc / C1;
        f = KT1 * NT1 + (tap * CG2 + c / 8) * NT2 + o / 8;
        kin = c % 8;
    } else {
        return -1;
    }
    return f * 64 + ((o % 8) * 4 + (kin & 3)) * 2 + (kin >> 2);
}

// conv_pool_relu's outputs (the same max, first maximum in the window's row-major order, after the
// bias; the same ReLU) from TF32 operands on the tensor cores, fp32 sums. in: CIN maps of side SIDE,
// rounded to TF32; frags: the layer's B fragments in wtc. A warp's item: 8 pool windows × NB n-tiles.
// Its A tile u (0, 1) has row g = conv position (2wy + u, 2wx) of window g and row g + 8 = (2wy + u,
// 2wx + 1), so a lane's sums d[u][nt][j], d[u][nt][2 + j] are the window's positions 2u, 2u + 1 of map
// 8nt + 2t + j: pool, bias, ReLU and argmax in registers. Each output's sum: the k-steps in order,
// each k-step's 8 products as the mma adds them. Windows past the map (the last group's) compute
// window 0 and are not written. ROUND_OUT: `out` (shared memory) takes the outputs rounded to TF32
// (conv 2's operands), out_global (the workspace or the kept maps) the fp32 values.
template <int CIN, int COUT, int SIDE, int K, int KT, int NT, int NB, bool CONV1, bool ROUND_OUT>
__device__ __forceinline__ void conv_pool_relu_tc(const float* in, const float* frags, const float* b, float* out,
                                                  unsigned char* arg, float* out_global, unsigned char* arg_global) {
    static_assert(NT % NB == 0, "an item's n-tiles divide the layer's");
    constexpr int CONV = SIDE - K + 1, POOLED = CONV / 2, AREA = POOLED * POOLED, GROUPS = (AREA + 7) / 8;
    constexpr int CG = (CIN + 7) / 8;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    // A lane's offsets into `in` of its k-values t and t + 4 at each k-step (conv 1: of each tap,
    // zero-weight taps at 0) or channel group (conv 2: of each channel, past CIN the last one's)
    constexpr int OFFSETS = CONV1 ? KT : CG;
    int offset[OFFSETS][2];
#pragma unroll
    for (int i = 0; i < OFFSETS; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int k = 8 * i + t + 4 * h;
            offset[i][h] = CONV1 ? (k < K * K ? (k / K) * SIDE + k % K : 0) : min(k, CIN - 1) * SIDE * SIDE;
        }
    for (int item = warp; item < GROUPS * (NT / NB); item += WARPS) {
        const int group = item / (NT / NB), nt0 = (item - group * (NT / NB)) * NB, win = group * 8 + g;
        const bool valid = win < AREA;
        const int wy = valid ? win / POOLED : 0, wx = valid ? win - wy * POOLED : 0;
        const float* window = in + 2 * wy * SIDE + 2 * wx;
        float d[2][NB][4];
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
            for (int n = 0; n < NB; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) d[u][n][i] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KT; ++ks) {
            const float *at0, *at1;  // the lane's k-values t and t + 4 at the window's first position
            if constexpr (CONV1) {
                at0 = window + offset[ks][0];
                at1 = window + offset[ks][1];
            } else {  // tap (tap / K, tap % K) of channel group cg
                const int tap = ks / CG, cg = ks - tap * CG, shift = (tap / K) * SIDE + tap % K;
                at0 = window + offset[cg][0] + shift;
                at1 = window + offset[cg][1] + shift;
            }
            unsigned a[2][4];  // a = A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4] of tile u
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                a[u][0] = __float_as_uint(at0[u * SIDE]);
                a[u][1] = __float_as_uint(at0[u * SIDE + 1]);
                a[u][2] = __float_as_uint(at1[u * SIDE]);
                a[u][3] = __float_as_uint(at1[u * SIDE + 1]);
            }
#pragma unroll
            for (int n = 0; n < NB; ++n) {
                const float2 bf = *reinterpret_cast<const float2*>(frags + ((ks * NT + nt0 + n) * 32 + lane) * 2);
                const unsigned bv[2] = {__float_as_uint(bf.x), __float_as_uint(bf.y)};
                mma_tf32(d[0][n], a[0], bv);
                mma_tf32(d[1][n], a[1], bv);
            }
        }
        if (!valid) continue;
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int o = (nt0 + n) * 8 + 2 * t + j;
                if (o >= COUT) continue;
                const float z[4] = {d[0][n][j], d[0][n][2 + j], d[1][n][j], d[1][n][2 + j]};  // row-major
                float best = 0.0f;
                int best_at = 0;
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const float zq = z[q] + b[o];
                    if (q == 0 || zq > best) { best = zq; best_at = q; }
                }
                const int i = o * AREA + win;
                const float a = fmaxf(best, 0.0f);
                out[i] = ROUND_OUT ? tf32_value(a) : a;
                arg[i] = arg_global[i] = (unsigned char)best_at;
                out_global[i] = a;
            }
    }
}
// An item's n-tiles in conv 2: half the layer's where they halve (8 items a sample at the speedrun's
// 32 maps and 5 × 5 windows: one a warp), else all.
#define NB2 (NT2 % 2 == 0 ? NT2 / 2 : NT2)
#endif

// The sample's forward through both convolutions: a2 published, a1 and pool 1's argmaxes kept for
// phase 5 (slot < KEPT: the block's slot-th sample's, in shared memory with its image as loaded; else
// in the workspace), pool 2's in the workspace. One pass: on the tensor cores, the image and a1 staged
// rounded to TF32 (phase 5 reads them unrounded); three: fp32 FMAs.
// Probed (a probe build, `probes` given: training's) in three parts: the image staged, conv 1, conv 2.
__device__ void sample_forward(const Smem& s, const Workspace& ws, const float* images, int r, int sample, int slot,
                               Probes* probes) {
    const float* image = images + (long long)sample * PIX;
    const bool kept = slot < KEPT;
    float* a1_kept = kept ? s.kept_a1 + slot * A1 : ws.a1 + (long long)r * A1;
    unsigned char* arg1_kept = kept ? s.kept_arg1 + slot * A1 : ws.arg1 + (long long)r * A1;
    stage_batched_to<PIX>([&](int i) { return __ldg(image + i); }, [&](int i, float v) {
        s.x[i] = PASSES == 1 ? tf32_value(v) : v;
        if (kept) s.kept_x[slot * PIX + i] = v;
    });
    __syncthreads();
    if (probes) PROBE_END(*probes, IMAGES, 0);
#if PASSES == 1
    conv_pool_relu_tc<1, C1, IMG, K1, KT1, NT1, NT1, true, true>(s.x, s.wtc, s.conv + P_CB1, s.a1, s.arg1, a1_kept, arg1_kept);
#else
    conv_pool_relu<1, C1, IMG, K1, MAPS_A_THREAD(C1, 2)>(s.x, s.conv + P_CW1, s.conv + P_CB1, s.a1, s.arg1, a1_kept, arg1_kept);
#endif
    __syncthreads();
    if (probes) PROBE_END(*probes, CONV1, 0);
#if PASSES == 1
    conv_pool_relu_tc<C1, C2, P1, K2, KT2, NT2, NB2, false, false>(s.a1, s.wtc + KT1 * NT1 * 64, s.conv + P_CB2, s.dp2,
                                                                   s.arg2, ws.a2 + (long long)r * FLAT,
                                                                   ws.arg2 + (long long)r * A2);
#else
    conv_pool_relu<C1, C2, P1, K2, MAPS_A_THREAD(C2, 4)>(s.a1, s.conv + P_CW2, s.conv + P_CB2, s.dp2, s.arg2, ws.a2 + (long long)r * FLAT,
                                                        ws.arg2 + (long long)r * A2);
#endif
    __syncthreads();  // (the next sample overwrites x, a1)
    if (probes) PROBE_END(*probes, CONVS_FORWARD, 0);
}

// The conv parameters staged (and, in one pass, phase 1's B fragments of them): 16 bytes a load (the
// span and s.conv start 16-byte aligned), the last NCONV mod 4 alone; at the speedrun's shape a
// thread's loads are then one batch, one trip to L2, where 4-byte loads took four.
__device__ void load_conv(const Smem& s, const float* params) {
    stage_batched<NCONV / 4>(reinterpret_cast<float4*>(s.conv), [&](int i) { return __ldcg(reinterpret_cast<const float4*>(params) + i); });
    if (threadIdx.x < NCONV % 4) s.conv[NCONV / 4 * 4 + threadIdx.x] = __ldcg(params + NCONV / 4 * 4 + threadIdx.x);
    __syncthreads();
#if PASSES == 1
    stage_conv_fragments(s);
    __syncthreads();
#endif
}

#if PASSES == 1
// A training step after a launch's first: the conv parameters and their B fragments (the workspace's,
// which phase 6's updates wrote) copied as they are (cp.async, 16 bytes a copy, no registers), where
// stage_conv_fragments computed each fragment from the staged parameters.
__device__ void copy_conv(const Smem& s, const float* params, const float* frags) {
    for (int i = threadIdx.x; i < NCONV / 4; i += THREADS) copy16_async_or_zero(s.conv + 4 * i, params + 4 * i, 16);
    for (int i = threadIdx.x; i < CONV_FRAGS * 16; i += THREADS) copy16_async_or_zero(s.wtc + 4 * i, frags + 4 * i, 16);
    copies_commit();
    if (threadIdx.x < NCONV % 4) s.conv[NCONV / 4 * 4 + threadIdx.x] = __ldcg(params + NCONV / 4 * 4 + threadIdx.x);
    copies_wait<0>();
    __syncthreads();
}
#endif

// A probe build's phase ends at a block barrier (the slowest warp's time; see the epoch below).
#define PHASE_END(p, name) do { PROBE_SYNC(); PROBE_END(p, name, 0); } while (0)

// ---- phase 2: fc1 --------------------------------------------------------------------------------
// Part q: inputs [q·FC1_PART, min((q + 1)·FC1_PART, FLAT)), FC1_PART a multiple of 8 (whole k-steps).
#define FC1_PART (((FLAT + FC1_PARTS - 1) / FC1_PARTS + 7) / 8 * 8)
#if FC1_PARTS < 1 || (FC1_PARTS - 1) * FC1_PART >= FLAT
#error "persistent_cnn.cu: every part of fc1's inputs must hold some (CnnShape.fc1_parts)"
#endif
__device__ void fc1_forward(const Smem& s, const Workspace& ws, const Step& st, const float* w1) {
    for (int item = st.rank; item < FC1_TILES * FC1_PARTS; item += BLOCKS) {
        const int part = item / FC1_TILES, tile = item - part * FC1_TILES;
        const int m0 = (tile / UNIT_TILES) * TILE, n0 = (tile % UNIT_TILES) * TILE;
        const int k0 = part * FC1_PART, ks = min(FLAT - k0, FC1_PART);
        float d[4];
        tile_product(s, Operand{ws.a2 + k0, FLAT, 1, st.rows, ks, true}, Operand{w1 + k0, FLAT, 1, HIDDEN, ks, true},
                     m0, n0, ks, d);
        float* h_part = ws.h_parts + (long long)part * BATCH * HIDDEN;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int r, u;
            tile_place(m0, n0, i, r, u);
            if (r < st.rows && u < HIDDEN) __stcg(h_part + r * HIDDEN + u, d[i]);
        }
    }
}

// Row r's unit u of fc1's output, relu(h_0 + h_1 + … + b1), the parts added in order.
__device__ __forceinline__ float fc1_output(const Workspace& ws, int r, int u, const float* b1) {
    float sum = __ldcg(ws.h_parts + r * HIDDEN + u);
#pragma unroll
    for (int q = 1; q < FC1_PARTS; ++q) sum += __ldcg(ws.h_parts + ((long long)q * BATCH + r) * HIDDEN + u);
    return fmaxf(sum + __ldcg(b1 + u), 0.0f);
}

// ---- phase 3: the head, a warp a row ------------------------------------------------------------------
// z_j = b2_j + Σ_u h_u·W2[j][u] (each lane its units u ≡ lane mod 32, then a butterfly); with labels,
// dz and dh published and the loss and correct count kept (measure); without (the evaluation), the
// correct count only.
#define UNITS_A_LANE ((HIDDEN + 31) / 32)  // a lane's units u = lane + 32i, the loops unrolled: all loads in flight
__device__ __forceinline__ void head_row(const Workspace& ws, const Step& st, int r, const float* w2, const float* b2,
                                         const float* b1, const int* labels, bool train, bool measure, double& loss_sum,
                                         double& correct_sum) {
    const int lane = threadIdx.x & 31;
    const int label = __ldg(labels + st.sample(r));  // (its two loads' round trips under the sums)
    const float b2_lane = lane < CLASSES ? __ldcg(b2 + lane) : 0.0f;  // (before the stores below, which it
                                                                      // could not pass: one trip fewer)
    float part[CLASSES], h[UNITS_A_LANE], w2u[UNITS_A_LANE][CLASSES];  // w2u: W2[j][u], kept for dh
#pragma unroll
    for (int j = 0; j < CLASSES; ++j) part[j] = 0.0f;
#pragma unroll
    for (int i = 0; i < UNITS_A_LANE; ++i) {
        const int u = lane + 32 * i;
        h[i] = 0.0f;
#pragma unroll
        for (int j = 0; j < CLASSES; ++j) w2u[i][j] = 0.0f;
        if (u < HIDDEN) {
            h[i] = fc1_output(ws, r, u, b1);
#pragma unroll
            for (int j = 0; j < CLASSES; ++j) {
                w2u[i][j] = __ldcg(w2 + j * HIDDEN + u);
                part[j] = fmaf(h[i], w2u[i][j], part[j]);
            }
        }
    }
    if (train)  // (phase 4's)
#pragma unroll
        for (int i = 0; i < UNITS_A_LANE; ++i)
            if (lane + 32 * i < HIDDEN) __stcg(ws.h + r * HIDDEN + lane + 32 * i, h[i]);
    float z = -__int_as_float(0x7f800000);  // −∞ past the classes
#pragma unroll
    for (int j = 0; j < CLASSES; ++j) {
        const float v = warp_sum(part[j]);
        if (lane == j) z = v + b2_lane;
    }
    const bool is_class = lane < CLASSES;
    float m, total;
    const float dz = warp_softmax_grad<32>(z, is_class, lane, label, st.rows, m, total);
    if (train) {
        if (is_class) __stcg(ws.dz + r * CLASSES + lane, dz);
        float dzs[CLASSES];  // every class's dz on every lane
#pragma unroll
        for (int j = 0; j < CLASSES; ++j) dzs[j] = __shfl_sync(0xffffffffu, dz, j);
#pragma unroll
        for (int i = 0; i < UNITS_A_LANE; ++i) {
            const int u = lane + 32 * i;
            if (u >= HIDDEN) continue;
            float v = 0.0f;
#pragma unroll
            for (int j = 0; j < CLASSES; ++j) v = fmaf(dzs[j], w2u[i][j], v);
            __stcg(ws.dh + r * HIDDEN + u, h[i] > 0.0f ? v : 0.0f);
        }
    }
    if (measure) {
        unsigned at_max;
        const float z_label = warp_label_logit(z, is_class, 0, label, m, at_max);
        if (lane == 0) {
            if (train) loss_sum += (double)xent_loss(total, m, z_label);
            correct_sum += first_max_is(at_max, label) ? 1.0 : 0.0;
        }
    }
}

__device__ void head(const Workspace& ws, const Step& st, const float* params, const int* labels, bool train, bool measure,
                     double& loss_sum, double& correct_sum) {
    for (int r = st.rank * WARPS + (threadIdx.x >> 5); r < st.rows; r += BLOCKS * WARPS)
        head_row(ws, st, r, params + P_W2, params + P_B2, params + P_B1, labels, train, measure, loss_sum, correct_sum);
}

// ---- phase 4: the linear layers' gradients and updates, and da2 ----------------------------------------
// W2, b2, b1: HEAD_UNITS units a group, group q (units HEAD_UNITS·q ..) on block BLOCKS − 1 − q mod
// HEAD_BLOCKS: the last blocks, which hold the fewest of the product tiles above, so that the head's
// sums pass under block 0's extra tiles. Thread i adds rows i, i + THREADS, … in order,
//   dW2[j][u] = Σ_r dz[r][j]·h[r][u],  db1[u] = Σ_r dh[r][u],  db2[j] = Σ_r dz[r][j] (group 0),
// a row's h, dh and dz loads all in flight at once; then each warp's lanes are added by a butterfly
// (every lane the same bits), the warps' totals in warp order, and a thread a parameter updates it.
__device__ __forceinline__ void head_gradients(const Smem& s, const Workspace& ws, const Step& st, float* params,
                                               float* s1, float* s2, const Update& up) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, slot = BLOCKS - 1 - st.rank;
    if (slot >= HEAD_BLOCKS) return;
    for (int q = slot; q < HEAD_GROUPS; q += HEAD_BLOCKS) {
        const int u0 = HEAD_UNITS * q, values = q == 0 ? HEAD_VALUES + CLASSES : HEAD_VALUES;
        // the parameters' values and state first (their round trip under the sums): thread t < values
        // updates sum t, [j·HEAD_UNITS + i]: W2[j][u0 + i]; [CLASSES·HEAD_UNITS + i]: b1[u0 + i]; then b2[j]
        const int t = threadIdx.x;
        int at = -1;
        if (t < values) {
            const int j = t / HEAD_UNITS, i = t - j * HEAD_UNITS;
            if (t < CLASSES * HEAD_UNITS) at = u0 + i < HIDDEN ? P_W2 + j * HIDDEN + u0 + i : -1;
            else if (t < HEAD_VALUES) at = u0 + i < HIDDEN ? P_B1 + u0 + i : -1;
            else at = P_B2 + t - HEAD_VALUES;
        }
        Update::State state{};
        if (at >= 0) state = Update::State::of(__ldcg(params + at), s1 + at, s2 + at, up.c.optimizer);
        float g[HEAD_VALUES + CLASSES];  // W2's, b1's, b2's sums, as above
#pragma unroll
        for (int v = 0; v < HEAD_VALUES + CLASSES; ++v) g[v] = 0.0f;
#pragma unroll 1
        for (int r = threadIdx.x; r < st.rows; r += THREADS) {  // (one trip at BATCH ≤ THREADS)
            float hu[HEAD_UNITS], dz[CLASSES];
#pragma unroll
            for (int i = 0; i < HEAD_UNITS; ++i) {
                const bool in = u0 + i < HIDDEN;
                hu[i] = in ? __ldcg(ws.h + r * HIDDEN + u0 + i) : 0.0f;
                g[CLASSES * HEAD_UNITS + i] += in ? __ldcg(ws.dh + r * HIDDEN + u0 + i) : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < CLASSES; ++j) dz[j] = __ldcg(ws.dz + r * CLASSES + j);
#pragma unroll
            for (int j = 0; j < CLASSES; ++j) {
#pragma unroll
                for (int i = 0; i < HEAD_UNITS; ++i) g[j * HEAD_UNITS + i] = fmaf(dz[j], hu[i], g[j * HEAD_UNITS + i]);
                g[HEAD_VALUES + j] += dz[j];
            }
        }
        float* sums = s.ta;  // [WARPS][HEAD_VALUES + CLASSES] (ta: free after the products)
        __syncthreads();     // (its last readers, this block's products or the previous group's updates, are done)
#pragma unroll
        for (int v = 0; v < HEAD_VALUES + CLASSES; ++v) {  // (b2's too: only group 0 updates them)
            const float total = warp_sum(g[v]);
            if (lane == 0) sums[warp * (HEAD_VALUES + CLASSES) + v] = total;
        }
        __syncthreads();
        if (at >= 0) {
            float total = sums[t];
#pragma unroll
            for (int w = 1; w < WARPS; ++w) total += sums[w * (HEAD_VALUES + CLASSES) + t];
            __stcg(params + at, up.apply(state, total, s1 + at, s2 + at));
        }
    }
}

__device__ void linear_backward(const Smem& s, const Workspace& ws, const Step& st, float* params, float* s1, float* s2,
                                const float* w1, float* w1_next, const Update& up, Probes& probes) {
    // dW1 = dhᵀ·a2, a tile of W1 and its update (the tile's weights and state loaded first)
    for (int tile = st.rank; tile < DW1_TILES; tile += BLOCKS) {
        const int m0 = (tile / FLAT_TILES) * TILE, n0 = (tile % FLAT_TILES) * TILE;
        Update::State state[4];
        int at[4];  // (W1 is a model's HIDDEN·FLAT parameters: int offsets)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int u, f;
            tile_place(m0, n0, i, u, f);
            at[i] = u < HIDDEN && f < FLAT ? u * FLAT + f : -1;
            if (at[i] >= 0) state[i] = Update::State::of(__ldcg(w1 + at[i]), s1 + P_W1 + at[i], s2 + P_W1 + at[i], up.c.optimizer);
        }
        float d[4];
        tile_product(s, Operand{ws.dh, 1, HIDDEN, HIDDEN, st.rows, false}, Operand{ws.a2, 1, FLAT, FLAT, st.rows, false},
                     m0, n0, st.rows, d);
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (at[i] >= 0) __stcg(w1_next + at[i], up.apply(state[i], d[i], s1 + P_W1 + at[i], s2 + P_W1 + at[i]));
    }
    PHASE_END(probes, DW1);
    // da2 = dh·W1 (this step's W1)
    for (int tile = st.rank; tile < DA2_TILES; tile += BLOCKS) {
        const int m0 = (tile / FLAT_TILES) * TILE, n0 = (tile % FLAT_TILES) * TILE;
        float d[4];
        tile_product(s, Operand{ws.dh, HIDDEN, 1, st.rows, HIDDEN, true}, Operand{w1, 1, FLAT, FLAT, HIDDEN, false},
                     m0, n0, HIDDEN, d);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int r, f;
            tile_place(m0, n0, i, r, f);
            if (r < st.rows && f < FLAT) __stcg(ws.da2 + r * FLAT + f, d[i]);
        }
    }
    PHASE_END(probes, DA2);
    head_gradients(s, ws, st, params, s1, s2, up);
}

// ---- phase 5: a sample's convolutions backward -------------------------------------------------------
// The gradient at pool 1's outputs, ReLU-masked: conv 2's input gradient,
//   dp1[c][y][x] = [a1[c][y][x] > 0] · Σ_o Σ_u Σ_v work[o][K2−1+y−u][K2−1+x−v] · w2[o][c][u][v]
// (work: conv 2's output gradient with its zero border). A thread a DP1_T × DP1_T tile of one map: for
// each o, the tile's (DP1_T + K2 − 1)² patch of work and the K2 × K2 taps into registers, then DP1_T²·K2²
// FMAs, so that a shared-memory load feeds several FMAs (one load a term, two, gathered a thread an
// output). Each output's sum runs over o, u, v in that order.
#define DP1_T (P1 % 4 == 0 ? 4 : P1 % 3 == 0 ? 3 : P1 % 2 == 0 ? 2 : 1)
__device__ __forceinline__ void pool1_gradient(const Smem& s, const float* a1) {
    constexpr int T = DP1_T, TILES = P1 / T, PATCH = T + K2 - 1;
    const float* w2 = s.conv + P_CW2;
    for (int task = threadIdx.x; task < C1 * TILES * TILES; task += THREADS) {
        const int c = task / (TILES * TILES), t = task - c * TILES * TILES, y0 = (t / TILES) * T, x0 = (t % TILES) * T;
        float g[T][T];
#pragma unroll
        for (int i = 0; i < T; ++i)
#pragma unroll
            for (int j = 0; j < T; ++j) g[i][j] = 0.0f;
        for (int o = 0; o < C2; ++o) {
            const float* at = s.work + o * WPS + y0 * WP + x0;  // the patch: bordered rows y0.., columns x0..
            const float* taps = w2 + (o * C1 + c) * K2 * K2;
            float patch[PATCH][PATCH], tap[K2][K2];
#pragma unroll
            for (int r = 0; r < PATCH; ++r)
#pragma unroll
                for (int q = 0; q < PATCH; ++q) patch[r][q] = at[r * WP + q];
#pragma unroll
            for (int u = 0; u < K2; ++u)
#pragma unroll
                for (int v = 0; v < K2; ++v) tap[u][v] = taps[u * K2 + v];
#pragma unroll
            for (int i = 0; i < T; ++i)
#pragma unroll
                for (int j = 0; j < T; ++j)
#pragma unroll
                    for (int u = 0; u < K2; ++u)
#pragma unroll
                        for (int v = 0; v < K2; ++v) g[i][j] = fmaf(patch[K2 - 1 + i - u][K2 - 1 + j - v], tap[u][v], g[i][j]);
        }
#pragma unroll
        for (int i = 0; i < T; ++i)
#pragma unroll
            for (int j = 0; j < T; ++j) {
                const int k = (c * P1 + y0 + i) * P1 + x0 + j;
                s.dp1[k] = a1[k] > 0.0f ? g[i][j] : 0.0f;
            }
    }
}

#if TC_INPUT_GRADIENT
// pool1_gradient's dp1 on the tensor cores (TF32 operands: work as the scatter rounded it, the
// weights rounded as loaded; fp32 sums), A[(y, x)][(u, v, o)] = work[o][K2−1+y−u][K2−1+x−v] and
// B[(u, v, o)][c] = w2[o][c][u][v] (zero past C2), read from the staged parameters (the speedrun's
// lanes (g, t), at c = 8nt + g, o = 8og + t: words (t·C1 + g)·K2² apart, on 32 banks): a warp an
// m-tile of 16 positions (row g: position m0 + g, row g + 8: m0 + g + 8; past P1² the last one's,
// not written) × every n-tile. A lane's A words at a k-step: maps o = 8og + t and + t + 4 at its two
// positions, shifted by the tap: 4 loads at an offset known at compile time from 4 base addresses.
// Lanes (g, t) read map 8og + t at position m0 + g: with the maps WPS ≡ 8 (mod 32) words apart, the
// 4 maps' 8 positions fall on distinct banks where the 8 positions lie in one row of WP. Each
// output's sum: the k-steps in order, each k-step's 8 products as the mma adds them.
__device__ __forceinline__ void pool1_gradient_tc(const Smem& s, const float* a1) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    for (int mt = warp; mt < BMT2; mt += WARPS) {
        const int m[2] = {min(mt * 16 + g, P1 * P1 - 1), min(mt * 16 + g + 8, P1 * P1 - 1)};
        const float* row[2][2];  // [position][h]: map 8·0 + t + 4h at the position, tap (K2 − 1, K2 − 1)
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                row[i][h] = s.work + min(t + 4 * h, C2 - 1) * WPS + (m[i] / P1) * WP + m[i] % P1;
        float d[BNT2][4];
#pragma unroll
        for (int nt = 0; nt < BNT2; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) d[nt][i] = 0.0f;
        // the k-steps in order, a tap's OG2 unrolled (not all K2²·OG2: the kernel's code is one body,
        // and the instruction cache holds its phases' loops)
#pragma unroll 1
        for (int tap = 0; tap < K2 * K2; ++tap)
#pragma unroll
        for (int og = 0; og < OG2; ++og) {
            const int u = tap / K2, v = tap - u * K2;
            // the shift to tap (u, v) of map group og (maps past C2: the last one's, zero weights)
            const int shift = (K2 - 1 - u) * WP + (K2 - 1 - v);
            unsigned a[4];  // A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int maps = 8 * og + t + 4 * h < C2 ? 8 * og * WPS : (C2 - 1 - min(t + 4 * h, C2 - 1)) * WPS;
                a[2 * h] = __float_as_uint(row[0][h][maps + shift]);
                a[2 * h + 1] = __float_as_uint(row[1][h][maps + shift]);
            }
#pragma unroll
            for (int nt = 0; nt < BNT2; ++nt) {
                unsigned b[2];  // B[t][g], B[t+4][g]
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int o = 8 * og + t + 4 * h, c = 8 * nt + g;
                    b[h] = o < C2 && c < C1 ? tf32_rounded(s.conv[P_CW2 + (o * C1 + c) * K2 * K2 + tap]) : 0u;
                }
                mma_tf32(d[nt], a, b);
            }
        }
#pragma unroll
        for (int nt = 0; nt < BNT2; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int p = mt * 16 + g + (i >= 2 ? 8 : 0), c = nt * 8 + 2 * t + (i & 1);
                if (p < P1 * P1 && c < C1) {
                    const int k = c * P1 * P1 + p;
                    s.dp1[k] = a1[k] > 0.0f ? d[nt][i] : 0.0f;
                }
            }
    }
}
#endif

#if TC_WEIGHT_GRADIENT
// Phase 5's conv 2 weight gradient in one pass on the tensor cores (TF32 operands, rounded as loaded;
// fp32 sums), an implicit GEMM over pool 2's windows' positions:
//   dW2[o][n] = Σ_k A[o][k]·B[k][n],  n = (c·K2 + u)·K2 + v (the weights' layout past o), k = 4p + q,
//   A[o][k] = dp2[o][p] where q is pooled output p's argmax, else 0  (p = pi·P2 + pj, q its window's
//             position 0..3, row-major),
//   B[k][n] = a1[c][2pi + q/2 + u][2pj + q%2 + v].
// K-step ks holds p = 2ks (k 8ks + t: lane t's q is t) and p = 2ks + 1 (k + 4: q is t again), so a lane's
// four A words are its two rows' gradients at those two outputs, each kept where its argmax is the
// lane's t: no routed copy of the gradient. Zero past P2² (the last k-step's second output) and past
// C2 (m-tiles of 16 maps); columns past the taps (n-tiles of 8) come from a clamped address and are
// not written. The warps share the m-tiles out (warp w: m-tile w / GROUPS, then every WARPS / GROUPS-th)
// and an m-tile's n-tiles (those ≡ w mod GROUPS, CHUNK at a time: CHUNK independent mma chains); a
// k-step's operands are loaded during the k-step before's mma. Each sum: the k-steps in order, each
// k-step's 8 products as the mma adds them; the block's sums of its samples in sample order (+=).
// (Not inlined: inlined, cnn_epoch spilled 20 bytes, 16 as a call.) Conv 1's weight gradient stays fp32
// FMAs: its implicit GEMM (576 k-values of mostly zeros a sample, 24 maps in two m-tiles, 25 taps in four
// n-tiles) measured twice its FMAs' cycles (docs/persistent-cnn.md).
__device__ __noinline__ void conv2_weight_gradient_tc(const float* a1, const float* dp2, const unsigned char* arg2,
                                                      float* grad_w2) {
    constexpr int N = C1 * K2 * K2, MT = (C2 + 15) / 16, NT = (N + 7) / 8, KS = (P2 * P2 + 1) / 2;
    constexpr int GROUPS = MT < WARPS ? WARPS / MT : 1, MT_STRIDE = WARPS / GROUPS;
    static_assert(WARPS % GROUPS == 0, "conv2_weight_gradient_tc: an m-tile's warps a divisor of WARPS (8: always)");
    // a warp's n-tiles, in chunks of at most 8, as even as they go (the speedrun's 7 in one: in chunks of
    // 4 and 3, which spill nothing, each k-step's A words loaded twice, 5b counted half as many cycles again)
    constexpr int NTW = (NT + GROUPS - 1) / GROUPS, CHUNKS = (NTW + 7) / 8, CHUNK = (NTW + CHUNKS - 1) / CHUNKS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3, group = warp % GROUPS;
    const int q_at = (t >> 1) * P1 + (t & 1);  // the lane's window position q = t, in a1
    for (int mt = warp / GROUPS; mt < MT; mt += MT_STRIDE)
        for (int chunk = 0; chunk < CHUNKS; ++chunk) {
            const int o[2] = {mt * 16 + g, mt * 16 + g + 8};
            const int oc[2] = {min(o[0], C2 - 1), min(o[1], C2 - 1)};
            int column[CHUNK];  // the lane's n = 8nt + g of each n-tile, as an offset in a1
#pragma unroll
            for (int i = 0; i < CHUNK; ++i) {
                const int n = min(8 * (group + GROUPS * (chunk * CHUNK + i)) + g, N - 1), c = n / (K2 * K2);
                const int uv = n - c * K2 * K2;
                column[i] = c * P1 * P1 + (uv / K2) * P1 + uv % K2;
            }
            float d[CHUNK][4];
#pragma unroll
            for (int i = 0; i < CHUNK; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) d[i][j] = 0.0f;
            // k-step ks's operands as loaded (each A word's gradient and argmax, 4: none; B's values)
            float dpv[4], bv[CHUNK][2];
            int qv[4];
            const auto fetch = [&](int ks) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int p = 2 * ks + h, pc = min(p, P2 * P2 - 1), pi = pc / P2;
                    const int at = 2 * pi * P1 + 2 * (pc - pi * P2) + q_at;  // the output's window corner
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int e = oc[r] * P2 * P2 + pc;
                        dpv[2 * h + r] = dp2[e];
                        qv[2 * h + r] = p < P2 * P2 && o[r] < C2 ? arg2[e] : 4;
                    }
#pragma unroll
                    for (int i = 0; i < CHUNK; ++i) bv[i][h] = a1[column[i] + at];
                }
            };
            fetch(0);
#pragma unroll 1
            for (int ks = 0; ks < KS; ++ks) {
                unsigned a[4], b[CHUNK][2];  // A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]; B[t][g], B[t+4][g]
#pragma unroll
                for (int j = 0; j < 4; ++j) a[j] = qv[j] == t ? tf32_rounded(dpv[j]) : 0u;
#pragma unroll
                for (int i = 0; i < CHUNK; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h) b[i][h] = tf32_rounded(bv[i][h]);
                if (ks + 1 < KS) fetch(ks + 1);
#pragma unroll
                for (int i = 0; i < CHUNK; ++i)
                    if (group + GROUPS * (chunk * CHUNK + i) < NT) mma_tf32(d[i], a, b[i]);  // (warp-uniform)
            }
#pragma unroll
            for (int i = 0; i < CHUNK; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int nt = group + GROUPS * (chunk * CHUNK + i), m = mt * 16 + g + (j >= 2 ? 8 : 0);
                    const int n = 8 * nt + 2 * t + (j & 1);
                    if (nt < NT && m < C2 && n < N) grad_w2[m * N + n] += d[i][j];
                }
        }
}

// Conv 2's bias gradient, db2[o] += Σ_p dp2[o][p] over its P2² pooled outputs: LANES adjacent lanes a
// map, each adding a contiguous part in order, the parts then added by a butterfly (every lane the
// same bits).
__device__ __forceinline__ void conv2_bias_gradient(const float* dp2, float* grad_b2) {
    constexpr int LANES = C2 * 8 <= THREADS ? 8 : C2 * 4 <= THREADS ? 4 : C2 * 2 <= THREADS ? 2 : 1;
    constexpr int SPAN = (P2 * P2 + LANES - 1) / LANES;
    for (int task0 = 0; task0 < C2 * LANES; task0 += THREADS) {  // (uniform: the butterfly's lanes all in)
        const int task = task0 + threadIdx.x, o = task / LANES, part = task % LANES;
        float sum = 0.0f;
        if (o < C2)
            for (int p = part * SPAN; p < min(P2 * P2, (part + 1) * SPAN); ++p) sum += dp2[o * P2 * P2 + p];
#pragma unroll
        for (int m = 1; m < LANES; m *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, m);
        if (o < C2 && part == 0) grad_b2[o] += sum;
    }
}
#endif

// Pool windows are disjoint: the pooled output (pi, pj) with argmax q came from conv position
// (2pi + q/2, 2pj + q%2), and only there does the pooled gradient flow back.
// Probed (a probe build) in four parts, each a sample's: its maps staged and dp2 scattered, conv 2's
// weight gradients, its input gradient, conv 1's weight gradients (PHASE_END: the kernel's macro).
__device__ void sample_backward(const Smem& s, const Workspace& ws, const float* images, int r, int sample, int slot,
                                Probes& probes) {
    const float* image = images + (long long)sample * PIX;
    // its image, a1 and pool 1's argmaxes: kept from phase 1 (slot < KEPT), else staged anew
    const bool kept = slot < KEPT;
    const float* x = kept ? s.kept_x + slot * PIX : s.x;
    const float* a1 = kept ? s.kept_a1 + slot * A1 : s.a1;
    const unsigned char* arg1 = kept ? s.kept_arg1 + slot * A1 : s.arg1;
    // the pooled gradient's loads first (into registers: scattered after work is zeroed), then the maps'
    constexpr int DP2_TRIPS = (A2 + THREADS - 1) / THREADS;
    float a2v[DP2_TRIPS], da2v[DP2_TRIPS];
    unsigned char arg2v[DP2_TRIPS];
#pragma unroll
    for (int j = 0; j < DP2_TRIPS; ++j) {
        const int i = threadIdx.x + j * THREADS;
        if (i < A2) {
            a2v[j] = __ldcg(ws.a2 + (long long)r * FLAT + i);
            da2v[j] = __ldcg(ws.da2 + (long long)r * FLAT + i);
            arg2v[j] = ws.arg2[(long long)r * A2 + i];
        }
    }
    if (!kept) {
        stage_batched<PIX>(s.x, [&](int i) { return __ldg(image + i); });
        stage_batched<A1>(s.a1, [&](int i) { return __ldcg(ws.a1 + (long long)r * A1 + i); });
        if constexpr (A1 % 4 == 0) {  // (the argmaxes a word at a time: r·A1 and the regions 4-byte aligned)
            const unsigned* words = reinterpret_cast<const unsigned*>(ws.arg1 + (long long)r * A1);
            stage_batched<A1 / 4>(reinterpret_cast<unsigned*>(s.arg1), [&](int i) { return words[i]; });
        } else {
            stage_batched<A1>(s.arg1, [&](int i) { return ws.arg1[(long long)r * A1 + i]; });
        }
    }
    for (int i = threadIdx.x; i < C2 * WPS; i += THREADS) s.work[i] = 0.0f;
    __syncthreads();
    // dp2 = da2 ⊙ [a2 > 0], scattered to conv 2's output gradient
#pragma unroll
    for (int j = 0; j < DP2_TRIPS; ++j) {
        const int i = threadIdx.x + j * THREADS;
        if (i >= A2) continue;
        const float g = a2v[j] > 0.0f ? da2v[j] : 0.0f;
        const int q = arg2v[j];
        s.dp2[i] = g;
        s.arg2[i] = (unsigned char)q;
        const int o = i / (P2 * P2), p = i - o * P2 * P2, pi = p / P2, pj = p - pi * P2;
        // (in one pass rounded to TF32: an operand of pool1_gradient_tc's mma)
#if TC_INPUT_GRADIENT
        s.work[o * WPS + (K2 - 1 + 2 * pi + (q >> 1)) * WP + K2 - 1 + 2 * pj + (q & 1)] = tf32_value(g);
#else
        s.work[o * WPS + (K2 - 1 + 2 * pi + (q >> 1)) * WP + K2 - 1 + 2 * pj + (q & 1)] = g;
#endif
    }
    __syncthreads();
    PROBE_END(probes, BACKWARD_MAPS, 0);
#if TC_WEIGHT_GRADIENT
    // conv 2's weight gradients on the tensor cores, its bias gradient's sums
    conv2_weight_gradient_tc(a1, s.dp2, s.arg2, s.grad + P_CW2);
    conv2_bias_gradient(s.dp2, s.grad + P_CB2);
#else
    // conv 2's weight gradients, from the pooled outputs' windows: a thread the K2 × K2 taps of one
    // (c, o), o the fastest across a warp (its maps' loads on distinct banks), adding for each pooled
    // output p of map o in order its gradient times the K2 × K2 patch of a1[c] at its window's argmax
    // (c = 0's threads add map o's bias gradient too, the outputs in the same order; the loop a few
    // outputs unrolled, so that their loads are issued ahead of the FMAs)
    for (int task = threadIdx.x; task < C1 * C2; task += THREADS) {
        const int c = task / C2, o = task - c * C2;
        float sum[K2][K2], bias = 0.0f;
#pragma unroll
        for (int u = 0; u < K2; ++u)
#pragma unroll
            for (int v = 0; v < K2; ++v) sum[u][v] = 0.0f;
#pragma unroll 5
        for (int p = 0; p < P2 * P2; ++p) {
            const int pi = p / P2, pj = p - pi * P2, q = s.arg2[o * P2 * P2 + p];
            const float g = s.dp2[o * P2 * P2 + p];
            const float* at = a1 + (c * P1 + 2 * pi + (q >> 1)) * P1 + 2 * pj + (q & 1);
            bias += g;
#pragma unroll
            for (int u = 0; u < K2; ++u)
#pragma unroll
                for (int v = 0; v < K2; ++v) sum[u][v] = fmaf(g, at[u * P1 + v], sum[u][v]);
        }
#pragma unroll
        for (int u = 0; u < K2; ++u)
#pragma unroll
            for (int v = 0; v < K2; ++v) s.grad[P_CW2 + ((o * C1 + c) * K2 + u) * K2 + v] += sum[u][v];
        if (c == 0) s.grad[P_CB2 + o] += bias;
    }
#endif
    PHASE_END(probes, CONV2_GRADS);
#if TC_INPUT_GRADIENT
    pool1_gradient_tc(s, a1);
#else
    pool1_gradient(s, a1);
#endif
    __syncthreads();
    PROBE_END(probes, POOL1_GRADIENT, 0);
    // conv 1's weight gradients: thread (part, o, u) the K1 taps of row u of map o's filter (and with
    // u = 0 map o's bias), adding for each pooled output p of map o in its part of them, in order, its
    // gradient times the image's row at its window's argmax; where the block's threads hold two tasks
    // a task, the pooled outputs in two halves, the second's sums added to the first's through ta
    constexpr int TASKS1 = C1 * K1, PARTS1 = 2 * TASKS1 <= THREADS ? 2 : 1, SPAN1 = (P1 * P1 + PARTS1 - 1) / PARTS1;
    static_assert(PARTS1 == 1 || TASKS1 * (K1 + 1) <= TILE * STAGE_STRIDE, "ta holds the second half's sums");
    for (int task0 = 0; task0 < TASKS1 * PARTS1; task0 += THREADS) {  // (uniform: one pass where PARTS1 is 2)
        const int task = task0 + threadIdx.x, part = task / TASKS1, ot = task - part * TASKS1;
        const int o = ot / K1, u = ot - o * K1;
        const bool mine = task < TASKS1 * PARTS1;
        float sum[K1 + 1];  // the taps, then the bias
#pragma unroll
        for (int v = 0; v <= K1; ++v) sum[v] = 0.0f;
        if (mine) {
            const int p_end = min(P1 * P1, (part + 1) * SPAN1);
#pragma unroll 4
            for (int p = part * SPAN1; p < p_end; ++p) {
                const int pi = p / P1, pj = p - pi * P1, q = arg1[o * P1 * P1 + p];
                const float g = s.dp1[o * P1 * P1 + p];
                const float* at = x + (2 * pi + (q >> 1) + u) * IMG + 2 * pj + (q & 1);
#pragma unroll
                for (int v = 0; v < K1; ++v) sum[v] = fmaf(g, at[v], sum[v]);
                sum[K1] += g;
            }
        }
        if constexpr (PARTS1 == 2) {
            if (mine && part == 1)
#pragma unroll
                for (int v = 0; v <= K1; ++v) s.ta[ot * (K1 + 1) + v] = sum[v];
            __syncthreads();
            if (mine && part == 0)
#pragma unroll
                for (int v = 0; v <= K1; ++v) sum[v] += s.ta[ot * (K1 + 1) + v];
        }
        if (mine && part == 0) {
#pragma unroll
            for (int v = 0; v < K1; ++v) s.grad[P_CW1 + (o * K1 + u) * K1 + v] += sum[v];
            if (u == 0) s.grad[P_CB1 + o] += sum[K1];
        }
    }
    __syncthreads();  // (the next sample overwrites the maps and ta)
    PHASE_END(probes, CONV1_GRADS);
}

// ---- phase 6: the conv parameters' gradients summed over the blocks, and their update -------------------
// Block b owns the PER_BLOCK parameters from b·PER_BLOCK on: thread (part, j) adds the blocks' sums
// of parameter j of a chunk of 64 over its part of the blocks, [part·SPAN, part·SPAN + SPAN), in
// order (a warp's loads 32 consecutive words of one block's sums: coalesced), then part 0 adds the
// parts' totals in part order and updates it: a fixed order.
#define SUM_PARTS (THREADS / 64)
__device__ void conv_update(const Smem& s, const Workspace& ws, const Step& st, float* params, float* s1, float* s2,
                            const Update& up) {
    constexpr int PER_BLOCK = (NCONV + BLOCKS - 1) / BLOCKS, SPAN = (BLOCKS + SUM_PARTS - 1) / SUM_PARTS;
    const int j = threadIdx.x & 63, part = threadIdx.x >> 6;
    const int first = part * SPAN, last = min(BLOCKS, first + SPAN);
    for (int j0 = 0; j0 < PER_BLOCK; j0 += 64) {
        const int i = st.rank * PER_BLOCK + j0 + j;
        const bool owned = j0 + j < PER_BLOCK && i < NCONV;
        float sum = 0.0f;
        if (owned) {
            const float* at = ws.conv_part + i;
#pragma unroll 8
            for (int c = first; c < last; ++c) sum += __ldcg(at + (long long)c * NCONV);
        }
        s.ta[threadIdx.x] = sum;  // (ta: phase 4's staging, free here)
        __syncthreads();
        if (part == 0 && owned) {
            float total = sum;
#pragma unroll
            for (int q = 1; q < SUM_PARTS; ++q) total += s.ta[q * 64 + j];
            const float w = up.apply(__ldcg(params + i), total, s1 + i, s2 + i);
            __stcg(params + i, w);
#if PASSES == 1
            const int e = conv_fragment_at(i);  // (the next step's phase 1 copies the fragments as they are)
            if (e >= 0) __stcg(ws.conv_frags + e, tf32_value(w));
#endif
        }
        __syncthreads();  // (the next chunk's sums overwrite ta)
    }
}

// ---- the epoch -----------------------------------------------------------------------------------
// The probe build (probes.cuh, -DPROBES; PROBE_RANK blockIdx.x): thread 0 of block 0 adds each phase's
// SM cycles and each grid barrier's wait (PHASES in kernels/persistent_cnn.py) over the launch's steps
// in shared memory, and writes them where the metrics would go at its end. A phase ends at a block
// barrier there (its slowest warp's time: PHASE_END, above sample_backward), so the wait that follows
// is the grid barrier's alone.
#define BARRIER(p, name) do { grid_sync(ws.barrier); PROBE_END(p, name, 0); } while (0)
// The same barrier with `work` of the block's own between its arrival and its wait.
#define BARRIER_AROUND(p, name, work) \
    do { const unsigned long long target = grid_arrive(ws.barrier); work; grid_wait(ws.barrier, target); PROBE_END(p, name, 0); } while (0)

// The next step's images of the block's samples fetched into L2 (a hint: the training set is larger
// than L2, so phase 1's image loads would otherwise wait on device memory), by a thread a sample past
// warp 0 (whose thread 0 waits on the barrier): its order entry, then a bulk prefetch.
__device__ __forceinline__ void prefetch_images(const float* images, const int* order, int step, int num_steps,
                                                int num_samples, int rank) {
    const int r = rank + (int(threadIdx.x) - 32) * BLOCKS, next = (step + 1) * BATCH;
    if (threadIdx.x >= 32 && step + 1 < num_steps && r < BATCH && next + r < num_samples)
        prefetch_l2(images + (long long)__ldg(order + next + r) * PIX, PIX * sizeof(float));
}

// The metrics, added in block order by block 0 (after a barrier): out[0] += Σ loss, out[1] += Σ correct.
__device__ void add_metrics(const Smem& s, const Workspace& ws, int rank, double loss_sum, double correct_sum, double* out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { s.totals[2 * warp] = loss_sum; s.totals[2 * warp + 1] = correct_sum; }
    __syncthreads();
    if (threadIdx.x == 0) {
        double l = 0.0, c = 0.0;
        for (int w = 0; w < WARPS; ++w) { l += s.totals[2 * w]; c += s.totals[2 * w + 1]; }
        __stcg(ws.block_metrics + 2 * rank, l);
        __stcg(ws.block_metrics + 2 * rank + 1, c);
    }
    grid_sync(ws.barrier);
    if (out != nullptr && rank == 0 && threadIdx.x == 0) {
        double l = 0.0, c = 0.0;
        for (int k = 0; k < BLOCKS; ++k) { l += __ldcg(ws.block_metrics + 2 * k); c += __ldcg(ws.block_metrics + 2 * k + 1); }
        out[0] += l;
        out[1] += c;
    }
}

// num_steps steps of BATCH samples over order[0:num_samples] (the last may be shorter), the first
// one the run's step first_step (0-based: its rate and the optimizer's bias correction). params: the
// NPARAMS span, trained in place; slot1, slot2: the optimizer's state, alike; metrics += (Σ loss,
// Σ correct) when measuring.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
cnn_epoch(const float* images, const int* labels, const int* order, float* params, float* slot1, float* slot2,
          const OptimizerConstants* constants, int num_samples, int num_steps, int first_step, double* metrics,
          int measure, unsigned char* workspace) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Smem s = carve(smem_raw);
    const Workspace ws = workspace_at(workspace);
    const int rank = blockIdx.x;
    double loss_sum = 0.0, correct_sum = 0.0;  // kept by lane 0 of each warp, over the rows it owns
    Probes probes(metrics);  // (a probe build's table, where the metrics would go)
    PROBE_START(probes, s.probe_counts);
    for (int step = 0; step < num_steps; ++step) {
        const Step st{step, min(BATCH, num_samples - step * BATCH), rank, order + (long long)step * BATCH, 0};
        const Update up(constants, first_step + step + 1);
        float* w1 = step & 1 ? ws.w1_other : params + P_W1;
        float* w1_next = step & 1 ? params + P_W1 : ws.w1_other;
#if PASSES == 1
        if (step > 0) {
            copy_conv(s, params, ws.conv_frags);
        } else {  // (the fragments computed, and block 0's put in the workspace, where phase 6 updates them)
            load_conv(s, params);
            if (rank == 0)
                for (int e = threadIdx.x; e < CONV_FRAGS * 64; e += THREADS) __stcg(ws.conv_frags + e, s.wtc[e]);
        }
#else
        load_conv(s, params);
#endif
        for (int i = threadIdx.x; i < NCONV; i += THREADS) s.grad[i] = 0.0f;
        PHASE_END(probes, CONV_PARAMS);
        for (int r = rank; r < st.rows; r += BLOCKS)
            sample_forward(s, ws, images, r, st.sample(r), (r - rank) / BLOCKS, &probes);
        BARRIER(probes, WAIT_CONVS_FORWARD);  // a2 of every sample
        fc1_forward(s, ws, st, w1);
        PHASE_END(probes, FC1);
        BARRIER(probes, WAIT_FC1);  // the parts of h
        head(ws, st, params, labels, true, measure != 0, loss_sum, correct_sum);
        PHASE_END(probes, HEAD);
        BARRIER(probes, WAIT_HEAD);  // dz, dh
        linear_backward(s, ws, st, params, slot1, slot2, w1, w1_next, up, probes);
        PHASE_END(probes, HEAD_UPDATE);
        BARRIER(probes, WAIT_LINEAR_BACKWARD);  // da2; the linear layers updated
        for (int r = rank; r < st.rows; r += BLOCKS) sample_backward(s, ws, images, r, st.sample(r), (r - rank) / BLOCKS, probes);
        for (int i = threadIdx.x; i < NCONV; i += THREADS) __stcg(ws.conv_part + (long long)rank * NCONV + i, s.grad[i]);
        PHASE_END(probes, CONVS_BACKWARD);
        // every block's conv gradient sums; the next step's images fetched into L2 in its wait
        BARRIER_AROUND(probes, WAIT_CONVS_BACKWARD, prefetch_images(images, order, step, num_steps, num_samples, rank));
        conv_update(s, ws, st, params, slot1, slot2, up);
        PHASE_END(probes, CONV_UPDATE);
        BARRIER(probes, WAIT_CONV_UPDATE);  // the conv parameters updated
    }
    if (num_steps & 1)  // the last step wrote the other copy of W1
        for (int i = rank * THREADS + threadIdx.x; i < HIDDEN * FLAT; i += BLOCKS * THREADS)
            __stcg(params + P_W1 + i, __ldcg(ws.w1_other + i));
#ifdef PROBES
    add_metrics(s, ws, rank, loss_sum, correct_sum, nullptr);  // (metrics holds the probe table)
    PROBE_FINISH(probes);
#else
    add_metrics(s, ws, rank, loss_sum, correct_sum, metrics);
#endif
}
#undef PHASE_END
#undef BARRIER
#undef BARRIER_AROUND

// out[1] += the number of the first num_samples images whose largest logit is their label's (out[0]
// is left as it is), in passes of BATCH rows (the same phases 1–3 as training, without the gradients).
extern "C" __global__ void __launch_bounds__(THREADS, 1)
cnn_evaluate(const float* images, const int* labels, int num_samples, const float* params, double* out,
             unsigned char* workspace) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Smem s = carve(smem_raw);
    const Workspace ws = workspace_at(workspace);
    const int rank = blockIdx.x;
    double unused = 0.0, correct_sum = 0.0;
    load_conv(s, params);
    for (int first = 0; first < num_samples; first += BATCH) {
        const Step st{0, min(BATCH, num_samples - first), rank, nullptr, first};
        for (int r = rank; r < st.rows; r += BLOCKS) sample_forward(s, ws, images, r, st.sample(r), KEPT, nullptr);  // (none kept)
        grid_sync(ws.barrier);
        fc1_forward(s, ws, st, params + P_W1);
        grid_sync(ws.barrier);
        head(ws, st, params, labels, false, true, unused, correct_sum);
        grid_sync(ws.barrier);  // (the next pass overwrites a2 and h)
    }
    add_metrics(s, ws, rank, unused, correct_sum, out);
}
