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
// `tile_full` mbarrier once its copies have landed. A buffer is refilled once every compute
// thread has sent step t's partial logits (`sent`): step t − 1, the buffer's last user, is done
// then, and the compute warps spend the next while waiting for the exchanges, so the copies
// hardly delay their loads. So no copy is issued and no dependent global load (order → bytes,
// order → label) waits on a step's path; within a step the compute warps meet only at two named
// barriers, both in phase C (a short last step adds one). (Bulk copies, one a row, were slower:
// they held up the exchanges.)
//
// The products of A and C run on tensor cores (mma.sync m16n8k8, TF32 inputs, fp32 sums) in
// three passes, which keeps near-fp32 accuracy: each operand is split as v = hi + lo (hi its
// top 19 bits), and a·b ≈ hi·hi + (hi·lo + lo·hi), the dropped lo·lo term and the operands'
// truncation ~2⁻²⁰ of the product; with 8-bit inputs (PIXEL_LEVELS) x needs no split, and the
// products with x take two passes. W is kept split (hi, lo), so only dlogits and (for other
// inputs) x are split in the loop. Shared memory and latency bound both products more than the
// tensor cores do: an SM sub-partition issues an m16n8k8 TF32 mma every ~6 cycles
// (scripts/mma_rate.py), so at 784 features, 10 classes and batch 128, A's 224 mma a step need
// ~340 cycles and C's 256 ~380, about 40% of each phase, while A's fragment loads alone keep
// shared memory busy ~560 cycles. So a warp takes a 16-row tile of all classes (A), or two
// 16-feature tiles of all classes over a part of the k range (C, loading each operand fragment
// once for both), and lanes of padding classes load nothing. (Measured no faster: A or C over
// twice the warps; x or W fragments loaded ahead during the waits; W held in registers, each
// warp updating its copy from dW; predicated instead of branched-around stores of partial logits
// and dlogits.) Every sum runs in a fixed order, without atomics: the same seed gives the same
// weights bit for bit.
//
// Measured no faster: taking both products off the path from one step's dlogits to the next's.
// For softmax regression z_{t+1} = x_{t+1}·W_tᵀ + b_t − lr·G_t·dlogits_t with G_t = x_{t+1}·x_tᵀ
// + 1 (the bias), so step t + 1's partials can use the weights before step t's update and be
// computed while step t trains, given the products of consecutive batches (a kernel on every SM
// ahead of the epoch: 0.06 ms in integer mma). With warps in three roles (the owned rows with
// G·dlogits on tensor cores; C and the partials two steps ahead; the copies in), a step took
// ~4,500 cycles against this kernel's 5,144, but the epoch 1.33 ms against 1.315: the roles share
// the SM's issue slots and shared-memory pipe, so each phase ran 30-50% slower than alone (C and
// A alone took ~4,350 cycles a step with the G product dropped), and the copies in of random rows
// take ~3,000 cycles a step however issued (cp.async, a bulk copy a row, bytes).
//
// Compile-time (from kernels/persistent.py): CLUSTER, COMPUTE_WARPS, FETCH_WARPS, SLICE (a
// multiple of 8), CLASSES (≤ 32), FEATURES, BATCH (the rows of a full step; a short last step
// takes the same code with fewer rows), PIXEL_LEVELS (below). Images are float32 rows of
// CLUSTER·SLICE, zero past FEATURES (as W is there). Without a bias (bias = 0), b stays zero.

#define PADDED_FEATURES (CLUSTER * SLICE)
#define COMPUTE_THREADS (32 * COMPUTE_WARPS)
#define THREADS (32 * (COMPUTE_WARPS + FETCH_WARPS))
#define N_TILES ((CLASSES + 7) / 8)           // the classes in mma columns of 8
#define QUADS ((CLASSES + 3) / 4)             // a row's dlogits in 16-byte pieces
// Floats per row of dlogits: ≡ 8 or 24 (mod 32), so that a fragment's loads (k = lane % 4,
// n = lane / 4) hit 32 banks.
#define DL_STRIDE (N_TILES * 8 + (N_TILES % 2 == 0 ? 8 : 0))
#define ROW_LANES (CLASSES <= 16 ? 16 : 32)   // phase B's threads per row: a class each
#define INBOX_STRIDE ROW_LANES                // floats per row of the inbox
// Classes per feature pair of W, each class an 8-byte (even, odd feature) pair: ≡ 4 (mod 16),
// so that a fragment's 8-byte loads (k = lane % 4, n = lane / 4) spread over all 32 banks.
#define PAIR_STRIDE ((N_TILES * 8 + 11) / 16 * 16 + 4)
#define C_M_TILES ((SLICE + 1 + 15) / 16)  // phase C's rows: the slice's features, then the bias
#define C_TILES (C_M_TILES * N_TILES)
#define X_COLS (16 * C_M_TILES)     // a tile row as phase C reads it: features, the bias's input, zeros
#define X_STRIDE ((X_COLS + 23) / 32 * 32 + 8)  // ≡ 8 (mod 32): A's 8-byte and C's 4-byte loads hit 32 banks
#define CHUNKS_PER_ROW (SLICE / 4)  // 16-byte copies per row of a tile
#define ROWS16 ((BATCH + 15) / 16 * 16)  // rows of a tile and of dlogits: whole mma tiles
#define R_MAX ((BATCH + CLUSTER - 1) / CLUSTER)  // owned rows of a full step
#define C_M_PAIRS ((C_M_TILES + 1) / 2)
#define C_K_STEPS (ROWS16 / 8)      // phase C's k-steps of 8 rows (an even number)
#define C_K_PARTS (C_K_STEPS % 4 == 0 ? 4 : 2)  // phase C's k range split over warps
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

// From cluster.cuh, tf32_mma.cuh and warp_softmax.cuh (put before this file by the launcher):
// cluster_rank, cluster_sync, remote, copy4_async, copy16_async, async_wait_all, smem_addr, send,
// send2, send4, mbarrier_expect, mbarrier_arrive, mbarrier_wait, cluster_metrics, step_rows;
// mma_tf32, split_tf32, Sums3, total, mma_x; warp_softmax_grad.

__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count) : "memory");
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
    unsigned long long* sent;        // the compute threads have sent this step's partial logits
    double* totals;     // [2 + 2·COMPUTE_WARPS]        block totals of loss and correct, then per warp
    float2* w_hi;       // [SLICE/2][PAIR_STRIDE]       this block's slice of W as W = hi + lo (hi: TF32),
    float2* w_lo;       //                              (W[2p][j], W[2p+1][j]) at [p][j]
    float* b;           // [ROW_LANES]                  this block's copy of the bias
    float* x;           // [2][ROWS16][X_STRIDE]        this step's tile and the next one's
    float* inbox;       // [CLUSTER][R_MAX][INBOX_STRIDE]  partial logits of the owned rows, per block
    float* dl;          // [ROWS16][DL_STRIDE]          dlogits, pushed by the rows' owners
    float* dl_row;      // [R_MAX + 1][ROW_LANES]       an owned row's dlogits, gathered for sending
    float* dw_parts;    // [C_K_PARTS][C_TILES][32][4]  phase C's sums over each part of the rows
    int* order;         // [BATCH]                      a tile's sample indices, for the fetch warps
    int* labels;        // [2][R_MAX]                   labels of the owned rows, per tile buffer
};

__device__ Smem carve(unsigned char* base) {
    Smem s;
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(base);
    s.inbox_full = bars; s.dl_full = bars + 1; s.tile_full = bars + 2; s.sent = bars + 4;
    double* d = reinterpret_cast<double*>(bars + 6);  // five barriers and a pad: the floats start 16-byte aligned
    s.totals = d; d += 2 + 2 * COMPUTE_WARPS;
    float* f = reinterpret_cast<float*>(d);  // every region below starts 16-byte aligned
    s.w_hi = reinterpret_cast<float2*>(f); f += SLICE * PAIR_STRIDE;
    s.w_lo = reinterpret_cast<float2*>(f); f += SLICE * PAIR_STRIDE;
    s.b = f; f += ROW_LANES;
    s.x = f; f += 2 * ROWS16 * X_STRIDE;
    s.inbox = f; f += CLUSTER * R_MAX * INBOX_STRIDE;
    s.dl = f; f += ROWS16 * DL_STRIDE;
    s.dl_row = f; f += (R_MAX + 1) * ROW_LANES;
    s.dw_parts = f; f += C_K_PARTS * C_TILES * 32 * 4;
    int* i = reinterpret_cast<int*>(f);
    s.order = i; i += BATCH;
    s.labels = i;
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
        // Step − 1's partials are sent, so step − 2 (whose buffer this is) is done; and the compute
        // warps now wait for the exchanges, so the copies hardly delay their loads. (Step 1 waits
        // too, though its buffer is fresh: a parity wait tells apart only the phase it waits for
        // and the one after, so each wait must find the one before it complete.)
        if (step >= 1) mbarrier_wait(s.sent, (step - 1) & 1);
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
    unsigned dl_to, dl_full_to;  // phase B: this thread's block (lane % ROW_LANES) and its barrier
    double loss_sum = 0.0, correct_sum = 0.0;  // kept by the threads of phase B of class 0
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
    // pushes there this step; an earlier step's values are still in place). The barrier orders
    // these stores before phase C's loads in other warps (nothing else between them does).
    if (rows < ROWS16) {
        for (int i = rows * DL_STRIDE + me.tid; i < ROWS16 * DL_STRIDE; i += COMPUTE_THREADS) s.dl[i] = 0.0f;
        compute_sync();
    }

    // ---- A: partial logits of this block's features, pushed to each row's owner ----------------
    // P = x·W_sliceᵀ, a warp a 16-row tile of all classes, k over the slice's features. Within a
    // k-step of 8 features, mma slot t takes feature 2t and slot t + 4 feature 2t + 1 (any order
    // of k gives the same sum), so each operand pair is one 8-byte load. (Two tiles a warp load
    // W's fragments half as often, but leave each warp twice the sends to issue, which costs more.)
    const int m_tiles = (rows + 15) / 16;
    for (int m = warp; m < m_tiles; m += COMPUTE_WARPS) {
        const float* xa = x + (16 * m + g) * X_STRIDE + 2 * t;
        const float2* wb_hi = s.w_hi + t * PAIR_STRIDE + g;
        const float2* wb_lo = s.w_lo + t * PAIR_STRIDE + g;
        Sums3 sums[N_TILES];
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
    mbarrier_arrive(s.sent);
    mbarrier_wait(s.inbox_full, step & 1);

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
        float* gathered = s.dl_row + (row_owned ? rr : R_MAX) * ROW_LANES;  // a spare row past the owned
        gathered[j] = dl;
        __syncwarp();
        if (row_owned && j < CLUSTER) {  // to block j: the row's classes, 4 a store
            const float4* pieces = reinterpret_cast<const float4*>(gathered);
#pragma unroll
            for (int q = 0; q < QUADS; ++q) send4(me.dl_to + 4 * (r * DL_STRIDE + 4 * q), pieces[q], me.dl_full_to);
        }
        if (measure) {
            const float z_label = __shfl_sync(0xffffffffu, z, (lane & ~(ROW_LANES - 1)) + label);
            // The first index of the largest logit: the lowest of the row's lanes holding m.
            const unsigned at_max = __ballot_sync(0xffffffffu, is_class && z == m) >> (lane & ~(ROW_LANES - 1));
            if (row_owned && j == 0) {
                me.loss_sum += (double)(logf(sum) + m - z_label);
                me.correct_sum += (__ffs(at_max) - 1) == label ? 1.0 : 0.0;
            }
        }
        __syncwarp();  // the row's pieces are read before the next row's overwrite them
    }
    mbarrier_wait(s.dl_full, step & 1);

    // ---- C: this block's slice of W and its copy of b, from its copy of dlogits ---------------
    // dW_sliceᵀ = xᵀ·dlogits: rows are the slice's features and then the bias (a feature whose
    // input, X_LEVELS, is the tile's column SLICE), k runs over the tile's rows (past the step's
    // rows, dlogits are zero). A warp takes two 16-feature tiles of all classes over one of
    // C_K_PARTS parts of the k range (fewer loads of shared memory than a tile a warp); the parts
    // meet in shared memory and are added in order.
    for (int task = warp; task < C_M_PAIRS * C_K_PARTS; task += COMPUTE_WARPS) {
        const int part = task / C_M_PAIRS, pair = task - part * C_M_PAIRS;
        const int m0 = 2 * pair, m1 = min(m0 + 1, C_M_TILES - 1);  // m1 = m0: one tile, done twice
        const float* xa0 = x + t * X_STRIDE + 16 * m0 + g;  // A[f][r] = x[r][f]
        const float* xa1 = x + t * X_STRIDE + 16 * m1 + g;
        const float* db = s.dl + t * DL_STRIDE + g;
        Sums3 sums[2][N_TILES];
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
    compute_sync();  // every part's sums are in
    for (int tile = warp; tile < C_TILES; tile += COMPUTE_WARPS) {
        const int m = tile / N_TILES, n = tile - m * N_TILES;
        float grads[4] = {};
#pragma unroll
        for (int part = 0; part < C_K_PARTS; ++part) {
            const float4 v = reinterpret_cast<const float4*>(s.dw_parts)[(part * C_TILES + tile) * 32 + lane];
            grads[0] += v.x; grads[1] += v.y; grads[2] += v.z; grads[3] += v.w;
        }
        float w_now[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // every load before any store: stores through the same pointers
            // would otherwise hold each load back until the store before it (about 100 cycles a step)
            const int f = 16 * m + g + (i < 2 ? 0 : 8), j = 8 * n + 2 * t + (i & 1);
            const float* w_hi = reinterpret_cast<const float*>(s.w_hi + (f / 2) * PAIR_STRIDE + j) + (f & 1);
            const float* w_lo = reinterpret_cast<const float*>(s.w_lo + (f / 2) * PAIR_STRIDE + j) + (f & 1);
            w_now[i] = j < CLASSES && f < SLICE ? *w_hi + *w_lo : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]
            const int f = 16 * m + g + (i < 2 ? 0 : 8), j = 8 * n + 2 * t + (i & 1);
            // W = hi + lo exactly, so this is W's fp32 update, split again. Predicated stores, and
            // the bias's row apart below: branches here, divergent where a tile holds padding or
            // the bias, cost 3% of a step.
            float* w_hi = reinterpret_cast<float*>(s.w_hi + (f / 2) * PAIR_STRIDE + j) + (f & 1);
            float* w_lo = reinterpret_cast<float*>(s.w_lo + (f / 2) * PAIR_STRIDE + j) + (f & 1);
            const float2 w = split_pair(w_now[i] - lr * X_UNIT * grads[i]);
            if (j < CLASSES && f < SLICE) { *w_hi = w.x; *w_lo = w.y; }
        }
        if (bias && m == SLICE / 16)  // the tile holding the bias's row, f = SLICE (the same for the whole warp)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int f = 16 * m + g + (i < 2 ? 0 : 8), j = 8 * n + 2 * t + (i & 1);
                if (f == SLICE && j < CLASSES) s.b[j] -= lr * X_UNIT * grads[i];
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

    for (int i = tid; i < SLICE / 2 * PAIR_STRIDE; i += THREADS) {
        const int f = 2 * (i / PAIR_STRIDE), j = i - f / 2 * PAIR_STRIDE;
        const bool in = j < CLASSES;
        const float2 even = split_pair(in && col0 + f < FEATURES ? w[j * FEATURES + col0 + f] : 0.0f);
        const float2 odd = split_pair(in && col0 + f + 1 < FEATURES ? w[j * FEATURES + col0 + f + 1] : 0.0f);
        s.w_hi[i] = make_float2(even.x, odd.x);
        s.w_lo[i] = make_float2(even.y, odd.y);
    }
    // Tiles and dlogits start at zero: the mma tiles read rows past a step's last one (and
    // dlogits' columns past the classes), whose products are discarded but must be finite. A
    // tile row's column SLICE is the bias's input, X_LEVELS (1 in x's unit); the copies never
    // write there.
    for (int i = tid; i < 2 * ROWS16 * X_STRIDE; i += THREADS) s.x[i] = i % X_STRIDE == SLICE ? (float)X_LEVELS : 0.0f;
    for (int i = tid; i < ROWS16 * DL_STRIDE; i += THREADS) s.dl[i] = 0.0f;
    if (tid < ROW_LANES) s.b[tid] = bias && tid < CLASSES ? b[tid] : 0.0f;
    if (tid == 0) {
        mbarrier_init(s.inbox_full, 1);
        mbarrier_init(s.dl_full, 1);
        for (int i = 0; i < 2; ++i) mbarrier_init(s.tile_full + i, 32 * FETCH_WARPS);
        mbarrier_init(s.sent, COMPUTE_THREADS);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    // No block may write into another's shared memory (nor count on its barriers) before every
    // block of the cluster runs and has set up its barriers.
    cluster_sync();

    const int to = min(lane % ROW_LANES, CLUSTER - 1);
    Compute me{rank, tid, lane, warp, lane >> 2, lane & 3, remote(s.dl, to), remote(s.dl_full, to)};
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
        const int at = (f / 2) * PAIR_STRIDE + j;
        const float w_hi = f & 1 ? s.w_hi[at].y : s.w_hi[at].x, w_lo = f & 1 ? s.w_lo[at].y : s.w_lo[at].x;
        if (col0 + f < FEATURES) w[j * FEATURES + col0 + f] = w_hi + w_lo;
    }
    if (bias && rank == 0 && tid < CLASSES) b[tid] = s.b[tid];
    if (measure) cluster_metrics(s.totals, COMPUTE_WARPS, me.loss_sum, me.correct_sum, metrics);
    cluster_sync();  // no block leaves while another may still read its shared memory
}
