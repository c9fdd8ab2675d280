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
// dlogits (rows × classes each). The exchanges are st.async stores that count their bytes on
// the receiver's mbarrier (one for the inbox, one for dlogits, a phase a step), so a block
// waits only for the bytes it needs: no cluster barrier and no memory fence in the loop. Why
// one buffer of each suffices: a block sends step t+1's partials only after all of step t's
// dlogits reached it, which their owners sent after reading their inboxes; an owner sends step
// t+1's dlogits only after every block's partials of t+1 reached it, which each block sent after
// finishing its phase C of step t.
//
// Warps have two roles. COMPUTE_WARPS run the phases; FETCH_WARPS only copy batches in: step
// t+1's tile of this block's columns (and the labels of its owned rows) goes into the second of
// two buffers with cp.async while step t trains; each fetch thread arrives on that buffer's
// `tile_full` mbarrier once its copies have landed, and refills a buffer only once every compute
// thread has marked it free (`tile_empty`, after phase C's products read it). So no copy is
// issued and no dependent global load (order → bytes, order → label) waits on a step's path;
// within a step the compute warps meet only at two named barriers, both in phase C. (Bulk
// copies, one a row, were slower: they held up the exchanges' stores.)
//
// The products of A and C run on tensor cores (mma.sync m16n8k8, TF32 inputs, fp32 sums) in
// three passes, which keeps near-fp32 accuracy: each operand is split as v = hi + lo (hi its
// top 19 bits), and a·b ≈ hi·hi + (hi·lo + lo·hi), the dropped lo·lo term and the operands'
// truncation ~2⁻²⁰ of the product; with 8-bit inputs (PIXEL_LEVELS) x needs no split, and the
// products with x take two passes. A warp takes one 16×8 tile of A's partials, or half of the
// k range (the batch's rows) of one 16×8 tile of C's gradients, with even and odd k-steps in
// separate sums so that no chain of dependent mma is longer than a quarter of the k range; C's
// two halves meet in shared memory and are added in a fixed order. Every sum runs in a fixed
// order, without atomics: the same seed gives the same weights bit for bit.
//
// Compile-time (from kernels/persistent.py): CLUSTER, COMPUTE_WARPS, FETCH_WARPS, SLICE (a
// multiple of 8), CLASSES (≤ 32), FEATURES, BATCH (the rows of a full step; a short last step
// takes the same code with fewer rows), PIXEL_LEVELS (below). Images are float32 rows of
// CLUSTER·SLICE, zero past FEATURES (as W is there). Without a bias (bias = 0), b stays zero.

#define PADDED_FEATURES (CLUSTER * SLICE)
#define COMPUTE_THREADS (32 * COMPUTE_WARPS)
#define THREADS (32 * (COMPUTE_WARPS + FETCH_WARPS))
#define CLASS_STRIDE ((CLASSES + 3) / 4 * 4)  // floats per row of the bias, the inbox
#define N_TILES ((CLASSES + 7) / 8)           // the classes in mma columns of 8
#define QUADS (CLASS_STRIDE / 4)              // the classes in 16-byte pieces
// Rows of W (per feature) and of dlogits (per sample): N_TILES·8 classes, the stride ≡ 8 or 24
// (mod 32 banks) so that a B fragment's lanes (k = lane % 4, n = lane / 4) hit 32 banks.
#define CLASS_PAD (N_TILES * 8 + (N_TILES % 2 == 0 ? 8 : 0))
#define X_STRIDE (SLICE + 4)        // floats per tile row: A fragments of phase A hit 32 banks
#define C_M_TILES ((SLICE + 1 + 15) / 16)  // phase C's rows: the slice's features, then the bias
#define C_TILES (C_M_TILES * N_TILES)
#define CHUNKS_PER_ROW (SLICE / 4)  // 16-byte copies per row of a tile
#define ROWS16 ((BATCH + 15) / 16 * 16)  // rows of a tile and of dlogits: whole mma tiles
#define R_MAX ((BATCH + CLUSTER - 1) / CLUSTER)  // owned rows of a full step
#define C_K_HALF (ROWS16 / 16)      // phase C's k-steps (8 rows each) per half
#define FETCH_ROWS ((BATCH + FETCH_WARPS - 1) / FETCH_WARPS)  // a fetch warp's rows of a tile

// PIXEL_LEVELS = 255 where every input is an 8-bit pixel k/255 (as loaded from uint8): the
// images then hold k itself, exact in TF32, so the products with x take two passes, not three,
// and x's unit 1/255 goes into the logits and the step. 0: any floats, three passes.
#if PIXEL_LEVELS
#define X_LEVELS PIXEL_LEVELS  // 1 in x's unit, exact (1 / X_UNIT in float is not)
#else
#define X_LEVELS 1
#endif
#define X_UNIT (1.0f / X_LEVELS)

#if SLICE % 8 != 0 || CLASSES > 32 || 32 % CLUSTER != 0 || COMPUTE_THREADS % CLUSTER != 0
#error "persistent.cu: unsupported SLICE / CLASSES"
#endif

// From cluster.cuh and warp_softmax.cuh (put before this file by the launcher): cluster_rank,
// cluster_sync, remote, copy4_async, async_wait_all, step_rows.

__device__ __forceinline__ double load_remote_f64(unsigned addr) {
    double v; asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(addr) : "memory"); return v;
}
__device__ __forceinline__ void copy16_async(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}
// D += A·B for one m16n8k8 tile, TF32 inputs, fp32 D. Fragments (g = lane / 4, t = lane % 4):
// a = A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]; b = B[t][g], B[t+4][g];
// d = D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1].
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// v = hi + lo exactly: hi is v with its low 13 mantissa bits cleared (a TF32 value), lo the
// rest. The mma reads only a TF32 operand's top 19 bits, so lo loses ~2⁻¹⁰ of itself, ~2⁻²⁰ of
// v. (Two integer/float instructions; cvt.rna.tf32 takes about five.)
template <int N>
__device__ __forceinline__ void split_tf32(const float (&v)[N], unsigned (&hi)[N], unsigned (&lo)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        hi[i] = __float_as_uint(v[i]) & 0xffffe000u;
        lo[i] = __float_as_uint(v[i] - __uint_as_float(hi[i]));
    }
}
// The passes of a tile's product, each into a sum of its own so that the chains of dependent
// mma stay one per k-step: hi·hi, lo_a·hi_b, hi_a·lo_b. The caller adds them last, small terms
// first.
struct Sums3 { float hh[4] = {}, lh[4] = {}, hl[4] = {}; };
// x·v for x from a tile (the A operand) and v = hi + lo: with 8-bit inputs x is exact in TF32
// and two passes suffice (hi·x, lo·x), else x too is split and lo_x·hi_v is the third.
__device__ __forceinline__ void mma_x(Sums3& d, const float (&x)[4], const unsigned (&v_hi)[2], const unsigned (&v_lo)[2]) {
    unsigned x_hi[4];
#if PIXEL_LEVELS
#pragma unroll
    for (int i = 0; i < 4; ++i) x_hi[i] = __float_as_uint(x[i]);
#else
    unsigned x_lo[4];
    split_tf32(x, x_hi, x_lo);
    mma_tf32(d.lh, x_lo, v_hi);
#endif
    mma_tf32(d.hl, x_hi, v_lo);
    mma_tf32(d.hh, x_hi, v_hi);
}
__device__ __forceinline__ float total(const Sums3& d, int i) { return d.hh[i] + (d.lh[i] + d.hl[i]); }
// Stores into cluster block `rank`'s shared memory that count their bytes on that block's
// mbarrier `bar` (addresses from remote()): the receiver waits on its own barrier, and no fence
// or cluster barrier stands between the two blocks.
__device__ __forceinline__ void send(unsigned addr, float v, unsigned bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
                 :: "r"(addr), "f"(v), "r"(bar) : "memory");
}
__device__ __forceinline__ void send2(unsigned addr, float v0, float v1, unsigned bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];"
                 :: "r"(addr), "f"(v0), "f"(v1), "r"(bar) : "memory");
}
__device__ __forceinline__ void send4(unsigned addr, float4 v, unsigned bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
                 :: "r"(addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar) : "memory");
}
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
// This block's one arrival of a phase, with the bytes the phase will receive.
__device__ __forceinline__ void mbarrier_expect(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" :: "r"(smem_addr(bar)) : "memory");
}
// Wait for the phase of parity `parity` to complete: its arrivals made and its bytes received.
// CTA scope: what it orders is this block's shared memory (a cluster-scope acquire would also
// invalidate the L1 cache after every wait).
__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned parity) {
    asm volatile("{\n\t.reg .pred done;\n"
                 "wait_%=:\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
                 "@!done bra wait_%=;\n}" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}
// The compute warps' own barrier (the fetch warps never wait at it).
__device__ __forceinline__ void compute_sync() {
    asm volatile("bar.sync 1, %0;" :: "n"(COMPUTE_THREADS) : "memory");
}

// The dynamic shared memory, carved in this order. Keep in step with the launcher's byte count
// (kernels/persistent.py: Shape.shared_bytes).
struct Smem {
    unsigned long long* inbox_full;  // this step's partial logits of the owned rows have arrived
    unsigned long long* dl_full;     // this step's dlogits have arrived
    unsigned long long* tile_full;   // [2] a tile buffer's copies (and its labels') have landed
    unsigned long long* tile_empty;  // [2] the compute warps are done reading a tile buffer
    double* totals;   // [2 + 2·COMPUTE_WARPS]      block totals of loss and correct, then per warp
    float* w;         // [SLICE][CLASS_PAD]         this block's slice of W, feature-major
    float* b;         // [CLASS_STRIDE]             this block's copy of the bias
    float* x;         // [2][ROWS16][X_STRIDE]      this step's tile and the next one's
    float* inbox;     // [CLUSTER][R_MAX][CLASS_STRIDE]  partial logits of the owned rows, per block
    float* dl;        // [ROWS16][CLASS_PAD]        dlogits, pushed by the rows' owners
    float* dw_half;   // [2][C_TILES][32][4]        phase C's sums over each half of the rows
    int* order;       // [BATCH]                    a tile's sample indices, for the fetch warps
    int* labels;      // [2][R_MAX]                 labels of the owned rows, per tile buffer
};

__device__ Smem carve(unsigned char* base) {
    Smem s;
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(base);
    s.inbox_full = bars; s.dl_full = bars + 1; s.tile_full = bars + 2; s.tile_empty = bars + 4;
    double* d = reinterpret_cast<double*>(bars + 6);
    s.totals = d; d += 2 + 2 * COMPUTE_WARPS;
    float* f = reinterpret_cast<float*>(d);  // every region below starts 16-byte aligned
    s.w = f; f += SLICE * CLASS_PAD;
    s.b = f; f += CLASS_STRIDE;
    s.x = f; f += 2 * ROWS16 * X_STRIDE;
    s.inbox = f; f += CLUSTER * R_MAX * CLASS_STRIDE;
    s.dl = f; f += ROWS16 * CLASS_PAD;
    s.dw_half = f; f += 2 * C_TILES * 32 * 4;
    int* i = reinterpret_cast<int*>(f);
    s.order = i; i += BATCH;
    s.labels = i;
    return s;
}

__device__ __forceinline__ int owned_rows(int rows) { return (rows + CLUSTER - 1) / CLUSTER; }

// A fetch warp's loop: rows [FETCH_ROWS·warp, FETCH_ROWS·(warp + 1)) of every step's tile
// (16-byte cp.async copies of this block's columns) and the labels of the owned rows among them;
// each lane arrives on the buffer's `tile_full` barrier once its copies have landed. Each lane
// holds the sample indices of its rows of the next step in registers, loaded while the current
// step's copies fly.
__device__ void fetch_epoch(const Smem& s, const float* images, const int* labels, const int* order,
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
    const float* columns = images + rank * SLICE;
    for (int step = 0; step < num_steps; ++step) {
        const int buffer = step & 1, rows = step_rows(step, BATCH, num_samples);
        const int r_own = owned_rows(rows), own_lo = min(rows, (int)rank * r_own);
        const int owned = min(rows, own_lo + r_own) - own_lo;
        if (step >= 2) mbarrier_wait(s.tile_empty + buffer, ((step >> 1) & 1) ^ 1);  // step − 2 is done
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
        float* tile = s.x + (buffer * ROWS16 + row0) * X_STRIDE;
        for (int i = lane; i < my_rows * CHUNKS_PER_ROW; i += 32) {
            const int r = i / CHUNKS_PER_ROW, k = i - r * CHUNKS_PER_ROW;
            copy16_async(tile + r * X_STRIDE + 4 * k, columns + (long long)s.order[row0 + r] * PADDED_FEATURES + 4 * k);
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
    unsigned dl_to, dl_full_to;  // this thread's dlogit stores in phase B: to block tid % CLUSTER
    double loss_sum = 0.0, correct_sum = 0.0;  // kept by the threads of phase B that send to block 0
};

// One step of `rows` samples (BATCH for all but a short last one; inlined, so that a full step's
// row counts are constants).
__device__ __forceinline__ void train_step(const Smem& s, Compute& me, int step, int rows, int bias, float lr,
                                           int measure) {
    const int lane = me.lane, warp = me.warp, g = me.g, t = me.t;
    const int r_own = owned_rows(rows), own_lo = min(rows, (int)me.rank * r_own);
    const int owned = min(rows, own_lo + r_own) - own_lo;
    const int cur = step & 1;
    const float* x = s.x + cur * ROWS16 * X_STRIDE;

    mbarrier_wait(s.tile_full + cur, (step >> 1) & 1);  // this step's tile and labels have landed
    if (me.tid == 0) {  // what this step will receive: partials of the owned rows, all dlogits
        mbarrier_expect(s.inbox_full, owned * CLUSTER * CLASSES * 4);
        mbarrier_expect(s.dl_full, rows * QUADS * 16);
    }
    // A short step: phase C's k-steps run past its rows, where dlogits must be zero (no block
    // pushes there this step; an earlier step's values are still in place).
    if (rows < ROWS16)
        for (int i = rows * CLASS_PAD + me.tid; i < ROWS16 * CLASS_PAD; i += COMPUTE_THREADS) s.dl[i] = 0.0f;

    // ---- A: partial logits of this block's features, pushed to each row's owner ----------------
    // P = x·W_sliceᵀ, a warp a 16×8 tile: rows 16m.., classes 8n.., k over the slice's features.
    const int m_tiles = (rows + 15) / 16;
    for (int task = warp; task < m_tiles * N_TILES; task += COMPUTE_WARPS) {
        const int m = task / N_TILES, n = task - m * N_TILES;
        const float* xa = x + (16 * m + g) * X_STRIDE + t;
        const float* wb = s.w + t * CLASS_PAD + 8 * n + g;
        Sums3 sums[2];  // even and odd k-steps
#pragma unroll
        for (int k = 0; k < SLICE; k += 8) {
            const float a[4] = {xa[k], xa[8 * X_STRIDE + k], xa[k + 4], xa[8 * X_STRIDE + k + 4]};
            const float b[2] = {wb[k * CLASS_PAD], wb[(k + 4) * CLASS_PAD]};
            unsigned b_hi[2], b_lo[2];
            split_tf32(b, b_hi, b_lo);
            mma_x(sums[(k / 8) & 1], a, b_hi, b_lo);
        }
        const int j = 8 * n + 2 * t;  // this lane's classes j, j + 1: one 8-byte store a row
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // rows g and g + 8 of the tile
            const int r = 16 * m + g + 8 * half;
            if (r >= rows || j >= CLASSES) continue;
            const int owner = r / r_own, rr = r - owner * r_own;
            const unsigned dst = remote(s.inbox + (me.rank * R_MAX + rr) * CLASS_STRIDE + j, owner);
            const unsigned bar = remote(s.inbox_full, owner);
            const float v0 = total(sums[0], 2 * half) + total(sums[1], 2 * half);
            const float v1 = total(sums[0], 2 * half + 1) + total(sums[1], 2 * half + 1);
            if (j + 1 < CLASSES) send2(dst, v0, v1, bar);
            else send(dst, v0, bar);
        }
    }
    mbarrier_wait(s.inbox_full, step & 1);

    // ---- B: the owned rows: logits, softmax, dlogits to every block --------------------------
    // Thread (rr, c) computes owned row rr's softmax (the CLUSTER threads of a row alike, from
    // the same loads) and sends the row's dlogits to block c: no shuffles, one row per thread.
    for (int i = me.tid; i < owned * CLUSTER; i += COMPUTE_THREADS) {
        const int rr = i / CLUSTER, c = i - rr * CLUSTER, r = own_lo + rr;
        const int label = s.labels[cur * R_MAX + rr];
        float z[CLASS_STRIDE] = {};  // Σ_c partial_c, in x's unit, then the logits
#pragma unroll
        for (int from = 0; from < CLUSTER; ++from) {
            const float4* partial = reinterpret_cast<const float4*>(s.inbox + (from * R_MAX + rr) * CLASS_STRIDE);
#pragma unroll
            for (int q = 0; q < QUADS; ++q) {
                const float4 v = partial[q];
                z[4 * q] += v.x; z[4 * q + 1] += v.y; z[4 * q + 2] += v.z; z[4 * q + 3] += v.w;
            }
        }
#pragma unroll
        for (int j = 0; j < CLASS_STRIDE; ++j) z[j] = s.b[j] + X_UNIT * z[j];
        float m = z[0];
#pragma unroll
        for (int j = 1; j < CLASSES; ++j) m = fmaxf(m, z[j]);
        float e[CLASS_STRIDE], sum = 0.0f;
#pragma unroll
        for (int j = 0; j < CLASS_STRIDE; ++j) {
            e[j] = j < CLASSES ? expf(z[j] - m) : 0.0f;
            sum += e[j];
        }
        const float inv_sum = 1.0f / sum, inv_rows = 1.0f / (float)rows;
#pragma unroll
        for (int j = 0; j < CLASS_STRIDE; ++j) e[j] = j < CLASSES ? (e[j] * inv_sum - (j == label ? 1.0f : 0.0f)) * inv_rows : 0.0f;
        const unsigned to = me.dl_to + 4 * r * CLASS_PAD;  // c = tid % CLUSTER: me.dl_to is block c's
#pragma unroll
        for (int q = 0; q < QUADS; ++q) send4(to + 16 * q, reinterpret_cast<const float4*>(e)[q], me.dl_full_to);
        if (measure && c == 0) {
            int argmax = 0;  // the first index of the largest logit (m)
            float z_label = z[0];
#pragma unroll
            for (int j = CLASSES - 1; j > 0; --j) {
                if (z[j] == m) argmax = j;
                if (j == label) z_label = z[j];
            }
            if (z[0] == m) argmax = 0;
            me.loss_sum += (double)(logf(sum) + m - z_label);
            me.correct_sum += argmax == label ? 1.0 : 0.0;
        }
    }
    mbarrier_wait(s.dl_full, step & 1);

    // ---- C: this block's slice of W and its copy of b, from its copy of dlogits ---------------
    // dW_sliceᵀ = xᵀ·dlogits: rows are the slice's features and then the bias (a feature whose
    // input is 1), k runs over the tile's rows (past the step's rows, dlogits are zero). A warp
    // takes one half of the k range of one 16×8 tile.
    for (int task = warp; task < 2 * C_TILES; task += COMPUTE_WARPS) {
        const int half = task / C_TILES, tile = task - half * C_TILES;
        const int m = tile / N_TILES, n = tile - m * N_TILES;
        const int f0 = 16 * m + g, f1 = f0 + 8;
        // A[f][r] = x[r][f] for a feature, 1 for the bias row (in x's unit), 0 past it.
        const float* x0 = x + min(f0, SLICE - 1);
        const float* x1 = x + min(f1, SLICE - 1);
        const float c0 = f0 == SLICE ? (float)X_LEVELS : 0.0f, c1 = f1 == SLICE ? (float)X_LEVELS : 0.0f;
        const bool in0 = f0 < SLICE, in1 = f1 < SLICE;
        const float* db = s.dl + t * CLASS_PAD + 8 * n + g;
        Sums3 sums[2];  // even and odd k-steps
#pragma unroll
        for (int i = 0; i < C_K_HALF; ++i) {
            const int k = 8 * (half * C_K_HALF + i);
            const int r0 = (k + t) * X_STRIDE, r1 = r0 + 4 * X_STRIDE;
            const float a[4] = {in0 ? x0[r0] : c0, in1 ? x1[r0] : c1, in0 ? x0[r1] : c0, in1 ? x1[r1] : c1};
            const float b[2] = {db[k * CLASS_PAD], db[(k + 4) * CLASS_PAD]};
            unsigned b_hi[2], b_lo[2];
            split_tf32(b, b_hi, b_lo);
            mma_x(sums[i & 1], a, b_hi, b_lo);
        }
        float4 part;
        part.x = total(sums[0], 0) + total(sums[1], 0); part.y = total(sums[0], 1) + total(sums[1], 1);
        part.z = total(sums[0], 2) + total(sums[1], 2); part.w = total(sums[0], 3) + total(sums[1], 3);
        reinterpret_cast<float4*>(s.dw_half)[(half * C_TILES + tile) * 32 + lane] = part;
    }
    mbarrier_arrive(s.tile_empty + cur);  // this thread is done with the tile (and the labels)
    compute_sync();  // every half's sums are in
    for (int tile = warp; tile < C_TILES; tile += COMPUTE_WARPS) {
        const int m = tile / N_TILES, n = tile - m * N_TILES;
        const float4 lo = reinterpret_cast<const float4*>(s.dw_half)[tile * 32 + lane];
        const float4 hi = reinterpret_cast<const float4*>(s.dw_half)[(C_TILES + tile) * 32 + lane];
        const float grads[4] = {lo.x + hi.x, lo.y + hi.y, lo.z + hi.z, lo.w + hi.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]
            const int f = 16 * m + g + (i < 2 ? 0 : 8), j = 8 * n + 2 * t + (i & 1);
            if (j >= CLASSES) continue;
            if (f < SLICE) s.w[f * CLASS_PAD + j] -= lr * X_UNIT * grads[i];
            else if (f == SLICE && bias) s.b[j] -= lr * X_UNIT * grads[i];
        }
    }
    compute_sync();  // the updates before the next step's phase A reads W and b
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
softmax_epoch(const float* images, const int* labels, const int* order, float* w, float* b,
              int bias, int num_samples, int num_steps, float lr, double* metrics, int measure) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Smem s = carve(smem_raw);
    const unsigned rank = cluster_rank();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int col0 = rank * SLICE;

    for (int i = tid; i < SLICE * CLASS_PAD; i += THREADS) {
        const int f = i / CLASS_PAD, j = i - f * CLASS_PAD;
        s.w[i] = (j < CLASSES && col0 + f < FEATURES) ? w[j * FEATURES + col0 + f] : 0.0f;
    }
    // Tiles and dlogits start at zero: the mma tiles read rows past a step's last one (and
    // dlogits' columns past the classes), whose products are discarded but must be finite.
    for (int i = tid; i < 2 * ROWS16 * X_STRIDE; i += THREADS) s.x[i] = 0.0f;
    for (int i = tid; i < ROWS16 * CLASS_PAD; i += THREADS) s.dl[i] = 0.0f;
    if (tid < CLASS_STRIDE) s.b[tid] = bias && tid < CLASSES ? b[tid] : 0.0f;
    if (tid == 0) {
        mbarrier_init(s.inbox_full, 1);
        mbarrier_init(s.dl_full, 1);
        for (int i = 0; i < 2; ++i) {
            mbarrier_init(s.tile_full + i, 32 * FETCH_WARPS);
            mbarrier_init(s.tile_empty + i, COMPUTE_THREADS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    // No block may write into another's shared memory (nor count on its barriers) before every
    // block of the cluster runs and has set up its barriers.
    cluster_sync();

    Compute me{rank, tid, lane, warp, lane >> 2, lane & 3, remote(s.dl, tid % CLUSTER), remote(s.dl_full, tid % CLUSTER)};
    if (warp >= COMPUTE_WARPS) {
        fetch_epoch(s, images, labels, order, num_samples, num_steps, rank, warp - COMPUTE_WARPS, lane);
    } else {
        const int full_steps = min(num_steps, num_samples / BATCH);
        for (int step = 0; step < full_steps; ++step) train_step(s, me, step, BATCH, bias, lr, measure);
        if (full_steps < num_steps)
            train_step(s, me, full_steps, step_rows(full_steps, BATCH, num_samples), bias, lr, measure);
    }

    // ---- W slice and bias back to global memory; the metrics, summed over the cluster in order --
    __syncthreads();
    for (int i = tid; i < SLICE * CLASSES; i += THREADS) {
        const int f = i / CLASSES, j = i - f * CLASSES;
        if (col0 + f < FEATURES) w[j * FEATURES + col0 + f] = s.w[f * CLASS_PAD + j];
    }
    if (bias && rank == 0 && tid < CLASSES) b[tid] = s.b[tid];
    if (measure) {
        double* per_warp = s.totals + 2;
        double loss = me.loss_sum, correct = me.correct_sum;  // the warp's sums, in butterfly order
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            loss += __shfl_xor_sync(0xffffffffu, loss, o);
            correct += __shfl_xor_sync(0xffffffffu, correct, o);
        }
        if (lane == 0 && warp < COMPUTE_WARPS) { per_warp[2 * warp] = loss; per_warp[2 * warp + 1] = correct; }
        __syncthreads();
        if (tid == 0) {
            double l = 0.0, c = 0.0;
            for (int i = 0; i < COMPUTE_WARPS; ++i) { l += per_warp[2 * i]; c += per_warp[2 * i + 1]; }
            s.totals[0] = l; s.totals[1] = c;
        }
    }
    cluster_sync();
    if (measure && rank == 0 && tid == 0) {
        double l = 0.0, c = 0.0;
        for (int k = 0; k < CLUSTER; ++k) {
            l += load_remote_f64(remote(s.totals, k));
            c += load_remote_f64(remote(s.totals + 1, k));
        }
        metrics[0] += l; metrics[1] += c;
    }
    cluster_sync();  // no block leaves while another may still read its shared memory
}
