// `persistent` for MLPs: LAYERS hidden layers of HIDDEN units (ReLU) and a softmax head, trained by
// one thread-block cluster; one launch runs an epoch.
//
// Block c of the CLUSTER blocks owns S = HIDDEN / CLUSTER units U_c of every hidden layer: the rows
// W_l[U_c, :] of each hidden layer's weights (kept k-major, wt[k][u]; W_1 in quads of inputs, see
// w1_at, or in the BF16 build in registers, see Bf16Ops::FirstLayer), its bias b_l[U_c], and the head's columns
// W_h[:, U_c]. Every block keeps a copy of the head's bias. Block c also owns R = ⌈rows / CLUSTER⌉
// of a step's rows for the softmax. A step of `rows` samples x (read through the sample order),
// h_0 = x:
//
//   forward, l = 1..LAYERS      h_l[:, U_c] = relu(h_{l-1} · W_l[U_c, :]ᵀ + b_l[U_c])
//       l < LAYERS: G_l         each block sends its columns to every block's h_full[l]
//   head, partial: Z            P_c = h_L[:, U_c] · W_h[:, U_c]ᵀ, row r sent to r's owner
//   softmax, owned rows: Y      z = Σ_{c = 0..CLUSTER-1} P_c + b_h (in that order), dz = (softmax(z)
//                               − onehot(y)) / rows, sent to every block's dl
//   head, in every block        dh_L[:, U_c] = dz · W_h[:, U_c] ⊙ [h_L[:, U_c] > 0],
//                               W_h[:, U_c] −= lr · dzᵀ h_L[:, U_c],  b_h −= lr · Σ_r dz[r]
//   backward, l = LAYERS..2     Q_c = dh_l[:, U_c] · W_l[U_c, :] (this block's part of dh_{l-1}),
//       D_l                     W_l[U_c, :] −= lr · dh_l[:, U_c]ᵀ h_{l-1},  b_l[U_c] −= lr · Σ_r dh_l,
//                               then Q_c[:, U_o] sent to block o's inbox[l−1];
//                               dh_{l-1}[:, U_c] = Σ_{o = 0..CLUSTER-1} Q_o[:, U_c] (in order)
//                               ⊙ [h_{l-1}[:, U_c] > 0]
//   l = 1                       W_1[U_c, :] −= lr · dh_1[:, U_c]ᵀ x,  b_1[U_c] −= lr · Σ_r dh_1
//
// So no block needs another's weights, nor its weight gradients: the exchanges are activations
// (gathered), partial logits (reduce-scattered to the rows' owners), dlogits (gathered) and
// partial input gradients (reduce-scattered). Every sum runs in a fixed order without atomics: the
// same seed gives the same weights bit for bit.
//
// The hidden layers' products run on tensor cores with fp32 sums, in one of two builds (the type
// Ops, persistent_mlp_products.cuh: Tf32Ops or Bf16Ops, picked by BF16):
//   BF16 = 1   bf16 operands (mma.sync m16n8k16), one pass: each operand rounded to bf16 (8 bits of
//              mantissa) as it is loaded, the weights kept in fp32 and updated in fp32 (the bf16
//              rung's precision); the images come as bf16 (8-bit pixels k, exact). G_l moves h_l
//              as bf16 (HElem: the operand it becomes) and D_l its pieces as bf16 (QElem, summed
//              in fp32 by the receiver). W_1 stays in the registers of the warps that use it.
//   BF16 = 0   TF32 operands (m16n8k8) in three passes, which keeps near-fp32 accuracy: each operand
//              is split as v = hi + lo (hi its top 19 bits), and a·b ≈ hi_a·hi_b + (hi_a·lo_b +
//              lo_a·hi_b), the dropped lo·lo term and the truncations ~2⁻²⁰ of the product.
// The head (partial logits, dh_L, dW_h) takes the three TF32 passes in both. A forward product
// splits its k (the inputs) over the warps, whose partial sums then add up in warp order; the
// updates and Q split their outputs over the warps.
//
// How the exchanges go (st.async stores and bulk copies, each counted on the receiver's mbarrier,
// no cluster barrier in the loop), why one buffer per exchange is safe to reuse step after step
// (the exchange order), which buffers share memory, how the images come in, and what was measured
// slower: docs/persistent-mlp.md.
//
// Compile-time (from kernels/persistent_mlp.py, with the strides WST and DST and the shared-memory
// layout SMEM_*): CLUSTER, THREADS, FEATURES, FEATURE_STRIDE (a
// multiple of 16; images are rows of FEATURE_STRIDE pixels, zero past FEATURES), HIDDEN (a multiple
// of 4·CLUSTER), LAYERS, CLASSES (≤ 32), BATCH, PIXEL_LEVELS, BF16, X_STRIDE (pixels per staged row:
// 0, or FEATURE_STRIDE padded to ≡ 64 bytes mod 128 for floats, ≡ 16 for bytes, and for bf16 to an
// odd number of 16-byte pieces (ldmatrix's rows), so that a load phase's rows fall on different
// banks). Without a bias (bias = 0) every bias stays zero.
//
// PIXEL_LEVELS = 255 where every input is an 8-bit pixel k/255 (as loaded from uint8): the images
// are then k (bf16 in the BF16 build, else bytes), exact in bf16 and in TF32, so layer 1's TF32
// products take two passes, not three; x's unit 1/255 goes into h_1 and W_1's step. 0: float
// images (bf16-rounded in the BF16 build; three TF32 passes in the other).
//
// The sizes, element types, shared memory and shared helpers: persistent_mlp_shape.cuh; the products:
// persistent_mlp_products.cuh (both put before this file by the launcher, after cluster.cuh,
// smem_layout.cuh, probes.cuh, tf32_mma.cuh, bf16_mma.cuh and logits_loss.cuh). This file: the
// phases of a step, and the epoch.

// h_l[:, U_c] = relu(unit · Σ_w partial[w] + b) (warp order; unit: the inputs' unit, X_UNIT for
// layer 1), into h_own and, when given, this block's slice of h_full[l] (the other blocks' copies of
// it go by bulk copy).
__device__ void forward_finish(const float* partial, const float* bias, float unit, float* h_own, HElem* own_slice, int rows) {
    for (int i = threadIdx.x; i < rows * SQ; i += THREADS) {
        const int uq = i % SQ, r = i / SQ;
        float4 v = *reinterpret_cast<const float4*>(partial + r * WST + 4 * uq);
#pragma unroll
        for (int w = 1; w < WARPS; ++w) v = add4(v, *reinterpret_cast<const float4*>(partial + (w * ROWS16 + r) * WST + 4 * uq));
        const float4 b = reinterpret_cast<const float4*>(bias)[uq];
        v = relu4(make_float4(fmaf(unit, v.x, b.x), fmaf(unit, v.y, b.y), fmaf(unit, v.z, b.z), fmaf(unit, v.w, b.w)));
        *reinterpret_cast<float4*>(h_own + r * S + 4 * uq) = v;
        if (own_slice) Exchange::store4(own_slice + r * S + 4 * uq, v);
    }
}

// Σ_{r < rows} value(r), in a fixed order that is not a chain of `rows` dependent adds: four
// partial sums over r ≡ 0, 1, 2, 3 (mod 4), then (s0 + s1) + (s2 + s3). Every row of the batch is
// read (value(r) must be readable, finite or not, for r < BATCH) and a row past the step's adds
// zero: a select, not a branch around each load, which made the loads one after another (~1,000
// cycles an update of a bias, H100).
template <class Value>
__device__ __forceinline__ float sum_rows(int rows, Value value) {
    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < BATCH; r += 4)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float v = value(r + k);
            part[k] += r + k < rows ? v : 0.0f;
        }
    return (part[0] + part[1]) + (part[2] + part[3]);
}
// b_l[U_c] −= lr · Σ_r dh_l, by the last S threads (the first ones are the busiest elsewhere).
__device__ void update_bias(float* bias, const float* dh, float lr, int rows) {
    const int u = THREADS - 1 - threadIdx.x;
    if (u < S) bias[u] = fmaf(-lr, sum_rows(rows, [&](int r) { return dh[r * DST + u]; }), bias[u]);
}

// Layer l ≥ 2, warp w taking the inputs k0 = 16i .. 16i + 15 for i = w, w + WARPS, ...:
//   Q[:, k0..] = dh_l · W_l[U_c, k0..] (old weights; m = rows, k = units, n = inputs),
//   W_l[U_c, k0..] −= lr · (h_{l−1}[:, k0..]ᵀ dh_l)ᵀ (m = inputs, k = rows, n = units),
// and Q's columns sent to their owners' inbox `inbox` (at [rank][r][u − u_o]) on barrier `bar`:
// Q[:, k] is staged where h_{l−1}[:, k] lies (h_prev, h_full[l − 1], the same element type: owner o's
// columns at o's slot, see docs/persistent-mlp.md), which only the warp's own products read, and goes by a
// bulk copy an owner; this block's own columns go straight into its inbox. A warp reads and writes
// only its own inputs' weights and columns of h_{l−1}. The bf16 build updates W_l after the sends
// are issued: the other warps update while the sending warp waits on the copy engine.
__device__ void backward_layer(HElem* h_prev, float* wt, const float* dh, float* inbox, unsigned long long* bar,
                               float lr, int rows, unsigned rank) {
    constexpr int TPW = BACKWARD_TILES;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    float q_out[TPW][MT][2][4];  // Q's tiles, kept until h_{l−1} may be overwritten
    float grad[TPW][NT][4];  // W_l's update (the bf16 build: every tile's before any is stored)
    backward_products<Ops>(h_prev, wt, dh, lr, rows, q_out, grad);
    __syncwarp();  // the warp's lanes have read its columns of h_{l−1} (Q[:, k] goes where h_{l−1}[:, k] was)
#pragma unroll
    for (int ii = 0; ii < TPW; ++ii) {
        const int i = warp + WARPS * ii;
        if (H_MTILES % WARPS != 0 && i >= H_MTILES) break;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int col = 16 * i + 8 * j + 2 * t, owner = col / S, u = col - owner * S;
            QElem* piece = (owner == (int)rank ? inbox_piece(inbox, rank) : h_prev + owner * BATCH * S) + u;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = 16 * mt + 8 * h + g;
                    if (r < rows) Exchange::store2(piece + r * S, q_out[ii][mt][j][2 * h], q_out[ii][mt][j][2 * h + 1]);
                }
        }
    }
    fence_proxy_async();  // the staged pieces are the copies' sources
    __syncthreads();  // (and every lane's loads of W_l for Q are done)
    const int dest = send_dest();
    if (dest >= 0 && dest != (int)rank)
        send_bulk(remote(inbox_piece(inbox, rank), dest), h_prev + dest * BATCH * S, rows * S * sizeof(QElem), remote(bar, dest));
    if (Ops::UPDATE_AFTER_SENDS) {
        int in[2];
        Ops::update_inputs(in);
        update_hidden(wt, 0, grad, in, lr);
    }
}

// dh_{l}[:, U_c] = Σ_o inbox[o] (in order) ⊙ [h_l[:, U_c] > 0], zero past the step's rows and S,
// by threads `first` .. THREADS − 1, a quad of units a thread (one round of the block at H = 256,
// where a unit a thread took three). (The sums here and in forward_finish as trees of adds, not
// chains, measured 3 to 5% slower at H = 128.)
__device__ void gather_input_grad(float* inbox, const float* h_own, float* dh, int rows, int first) {
    constexpr int DQ = DST / 4;  // quads a row of dh
    for (int i = threadIdx.x - first; i < ROWS16 * DQ; i += THREADS - first) {
        const int r = i / DQ, u = 4 * (i - r * DQ);
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < rows && u < S) {  // (S is whole quads)
            v = Exchange::load4(inbox_piece(inbox, 0) + r * S + u);
#pragma unroll
            for (int o = 1; o < CLUSTER; ++o) v = add4(v, Exchange::load4(inbox_piece(inbox, o) + r * S + u));
            const float4 h = *reinterpret_cast<const float4*>(h_own + r * S + u);
            v = make_float4(h.x > 0.0f ? v.x : 0.0f, h.y > 0.0f ? v.y : 0.0f, h.z > 0.0f ? v.z : 0.0f, h.w > 0.0f ? v.w : 0.0f);
        }
        *reinterpret_cast<float4*>(dh + r * DST + u) = v;
    }
}

// The epoch's arguments, as the phases read them.
struct Epoch {
    const Pixel* images; const int* labels; const int* order;
    int bias, num_samples, num_steps, measure;
    float lr;
};
// One step: its rows, and this block's part of them.
struct Step {
    int step, rows, r_own, own_lo, owned;  // owned: this block's rows of the softmax, from own_lo
    unsigned parity, rank;
    const int* order;   // this step's sample indices (shared memory)
    const int* labels;  // ... and labels
    ImageRows x_rows;   // its images in global memory
};

// ---- the step's start: its copies landed, the exchanges' expected bytes ------------------------
__device__ __forceinline__ void step_start(const Smem& s, const Step& st, const Epoch& e, Probes& probes) {
    const int tid = threadIdx.x, rows = st.rows, owned = st.owned, step = st.step;
    const Pixel* images = e.images;
    const int* step_order = st.order;
    async_wait_all();
    PROBE_END(probes, START_WAIT, 0);
    // This step's labels, the next step's indices (and, copied a step ahead, this step's images)
    // have landed; the last step's reads are done (among them those of the image buffer that
    // is refilled next).
    __syncthreads();
    if (tid == 0) {  // what this step's exchanges (and the images' copy) will bring
        for (int l = 1; l < LAYERS; ++l) {
            mbarrier_expect(gather_bar(s, l), (CLUSTER - 1) * rows * S * sizeof(HElem));  // (this block writes its own)
            mbarrier_expect(inbox_bar(s, l), (CLUSTER - 1) * rows * S * sizeof(QElem));
        }
        mbarrier_expect(zin_bar(s), owned * CLUSTER * CLASSES * 4);  // (to itself alike)
        mbarrier_expect(dl_bar(s), (rows - owned) * CS * 4);
    }
    PROBE_END(probes, START_EXPECT, 0);
    if (X_STRIDE && X_LEAD == 0) copy_images_in(s, images, step_order, step, rows);  // float images: this step's
    async_commit();
    PROBE_END(probes, START_IMAGES, 0);
}

// The copies for the steps ahead: the next step's labels (and images, copied a step ahead), the
// indices of the one after, by every warp but the first. Issued where they cost the step least
// (H100, H = 128 and 256): with the images staged, at the wait for the partial logits, where warp 0
// alone computes the owned rows' softmax (at the gather of h_1 the step took 5% longer at H = 128);
// else (labels, indices and the images' L2 prefetch) at the gather of h_1, where warp 0 issues the
// bulk copies (at the logits: 1% longer at H = 256), or with one hidden layer at the logits. Issued
// at the step's start they held up layer 1's products by ~3% of a step, at the wait for D_L they
// slowed the update of W_1 beside them. They land before the next step's start (async_wait_all):
// the buffers they fill were last read the step before this one.
__device__ __forceinline__ void copy_ahead(const Smem& s, const Step& st, const Epoch& e) {
    const int tid = threadIdx.x, step = st.step, num_steps = e.num_steps, num_samples = e.num_samples;
    const unsigned rank = st.rank;
    const Pixel* images = e.images;
    const int *labels = e.labels, *order = e.order;
    constexpr int FIRST = 32;  // warp 0: the bulk copies (send_dest), the softmax
    if (tid < FIRST) return;
    const int c = tid - FIRST, copiers = THREADS - FIRST;
    if (step + 1 < num_steps) {
        const int next_rows = step_rows(step + 1, BATCH, num_samples);
        const int* next_order = s.order + ((step + 1) % 3) * BATCH;
        for (int r = c; r < next_rows; r += copiers)
            copy4_async(s.labels + ((step + 1) & 1) * BATCH + r, labels + next_order[r]);
        if (X_STRIDE && X_LEAD == 1)
            copy_images_in(s, images, next_order, step + 1, next_rows, FIRST);
        if (X_LEAD == 0)  // (images copied a step ahead need no hint)
            for (int r = c * CLUSTER + rank; r < next_rows; r += copiers * CLUSTER)
                prefetch_l2(images + (long long)next_order[r] * FEATURE_STRIDE, FEATURE_STRIDE * sizeof(Pixel));
    }
    if (step + 2 < num_steps)
        for (int r = c; r < step_rows(step + 2, BATCH, num_samples); r += copiers)
            copy4_async(s.order + ((step + 2) % 3) * BATCH + r, order + (long long)(step + 2) * BATCH + r);
    async_commit();
}

__device__ __forceinline__ void forward(const Smem& s, const Step& st, const Epoch& e, Ops::FirstLayer& w1,
                                        Probes& probes) {
    const int step = st.step, rows = st.rows;
    const unsigned parity = st.parity, rank = st.rank;
    const ImageRows& x_rows = st.x_rows;
    // ---- forward ---------------------------------------------------------------------------
    for (int l = 1; l <= LAYERS; ++l) {
        if (l == 1) {
            if (X_STRIDE) {
                if (X_LEAD == 0) {  // the images, copied at this step's start, have landed
                    async_wait_all();
                    __syncthreads();
                } else {
                    mbarrier_wait(x_bar(s), step & 1);
                }
                w1.forward(StagedRows{staged_images(s, step % X_BUFFERS)}, rows, s.last);
            } else {
                w1.forward(x_rows, rows, s.last);
            }
        } else {
            forward_hidden<Ops>(h_of(s, l - 1), layer_weights(s, l), s.last, rows);
        }
        __syncthreads();
        PROBE_END(probes, PRODUCTS, l);
        const bool gather = l < LAYERS;
        float* h_own = s.h_own + (l - 1) * BATCH * S;
        HElem* slice = h_of(s, l) + rank * BATCH * S;  // this block's in h_full[l]
        forward_finish(s.last, s.b + (l - 1) * S, l == 1 ? X_UNIT : 1.0f, h_own, gather ? slice : nullptr, rows);
        PROBE_END(probes, FINISH, l);
        if (gather) fence_proxy_async();  // the slice, written here, is the copies' source
        __syncthreads();  // h_own is whole; the partial sums are read before the next product writes them
        PROBE_END(probes, FENCE_SYNC, l);
        const int dest = send_dest();
        if (gather && dest >= 0 && dest != rank)  // this block's h_l[:, U_c] to block dest's h_full[l]
            send_bulk(remote(slice, dest), slice, rows * S * sizeof(HElem), remote(gather_bar(s, l), dest));
        PROBE_SYNC();
        PROBE_END(probes, SENDS, l);
        if (l == 1 && gather && !X_STRIDE) copy_ahead(s, st, e);
        if (gather) mbarrier_wait(gather_bar(s, l), parity);  // h_full[l] is whole
        PROBE_SYNC();
        PROBE_END(probes, EXCHANGE, l);
    }
}

__device__ __forceinline__ void head_logits(const Smem& s, const Step& st, const Epoch& e, Probes& probes) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, rows = st.rows, r_own = st.r_own;
    const unsigned parity = st.parity, rank = st.rank;
    // ---- head: partial logits of this block's units, to each row's owner ---------------------
    // P_c = h_L[:, U_c] · W_h[:, U_c]ᵀ: a warp a tile of 16 rows × 8 classes, k over the units.
    // Row r's classes j, j + 1 go from the mma registers to its owner, block r / r_own, into
    // zin[c][r mod r_own] (one 8-byte st.async, counted on the owner's zin barrier).
    {
        const float* h_last = s.h_own + (LAYERS - 1) * BATCH * S;
        for (int task = warp; task < MT * CLASS_TILES; task += WARPS) {
            const int mt = task / CLASS_TILES, r0 = 16 * mt, j0 = 8 * (task - mt * CLASS_TILES);
            Sums3 d;
            tile_product<UNIT_KSTEPS>(d, [&](int m, int k) { return r0 + m < rows && k < S ? h_last[(r0 + m) * S + k] : 0.0f; },
                                      [&](int k, int n) { return k < S && j0 + n < CS ? s.wh[(j0 + n) * S + k] : 0.0f; });
#pragma unroll
            for (int half = 0; half < 2; ++half) {  // rows g and g + 8 of the tile
                const int r = r0 + g_of(lane) + 8 * half, j = j0 + 2 * t_of(lane);
                if (r >= rows || j >= CLASSES) continue;
                const int owner = r / r_own;
                const unsigned dst = remote(s.zin + (rank * R_OWN + r - owner * r_own) * CS + j, owner);
                const unsigned bar = remote(zin_bar(s), owner);
                if (j + 1 < CLASSES) send2(dst, total(d, 2 * half), total(d, 2 * half + 1), bar);
                else send(dst, total(d, 2 * half), bar);
            }
        }
    }
    PROBE_SYNC();
    PROBE_END(probes, HEAD_PRODUCT, 0);
    if (LAYERS == 1 || X_STRIDE) copy_ahead(s, st, e);
    mbarrier_wait(zin_bar(s), parity);  // every block's partial logits of the owned rows
    PROBE_SYNC();
    PROBE_END(probes, HEAD_WAIT, 0);
}

__device__ __forceinline__ void softmax(const Smem& s, const Step& st, const Epoch& e, double& loss_sum,
                                        double& correct_sum, Probes& probes) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, rows = st.rows, owned = st.owned, own_lo = st.own_lo;
    const int measure = e.measure;
    const unsigned parity = st.parity, rank = st.rank;
    const int* step_labels = st.labels;
    // ---- softmax of the owned rows, their dlogits to every block -------------------------------
    // ROW_LANES lanes a row (lane j its class j): z = Σ_c P_c + b_h, the partials added as a fixed
    // tree (four levels for 16 blocks, not a chain of 16 adds), its max and sum by shuffles, and
    // dz_j into this block's dl; then lane p sends the row to block p (st.async of 16 bytes,
    // counted on its dl barrier). Whole warps take part (a row past the owned ones sends nothing).
    {
        constexpr int ROW_LANES = CLASSES <= 16 ? 16 : 32, ROWS_PER_WARP = 32 / ROW_LANES;
        const int j = lane % ROW_LANES, group = lane & ~(ROW_LANES - 1);
        for (int base = warp * ROWS_PER_WARP; base < owned; base += WARPS * ROWS_PER_WARP) {
            const int rr = base + lane / ROW_LANES, r = own_lo + rr;
            const bool row_owned = rr < owned, valid = row_owned && j < CLASSES;
            const int label = row_owned ? step_labels[r] : 0;
            float p[CLUSTER];
#pragma unroll
            for (int c = 0; c < CLUSTER; ++c) p[c] = valid ? s.zin[(c * R_OWN + rr) * CS + j] : 0.0f;
#pragma unroll
            for (int w = 1; w < CLUSTER; w *= 2)
#pragma unroll
                for (int c = 0; c + w < CLUSTER; c += 2 * w) p[c] += p[c + w];
            const float z = valid ? p[0] + s.bh[j] : -__int_as_float(0x7f800000);  // −∞ past the classes
            float m, sum;
            const float dz = warp_softmax_grad<ROW_LANES>(z, valid, j, label, rows, m, sum);
            PROBE_END(probes, SOFTMAX_EXP, 0);
            if (row_owned && j < CS) s.dl[r * CS + j] = dz;
            __syncwarp();  // the row is whole in dl
            if (row_owned && j < CLUSTER && j != (int)rank) {  // to block j
                const float4* row = reinterpret_cast<const float4*>(s.dl + r * CS);
#pragma unroll
                for (int q = 0; q < QUADS; ++q) send4(remote(s.dl + r * CS + 4 * q, j), row[q], remote(dl_bar(s), j));
            }
            if (measure) {
                unsigned at_max;
                const float z_label = warp_label_logit(z, j < CLASSES, group, label, m, at_max);
                if (row_owned && j == 0) {
                    loss_sum += (double)xent_loss(sum, m, z_label);
                    correct_sum += first_max_is(at_max, label) ? 1.0 : 0.0;
                }
            }
            PROBE_END(probes, SOFTMAX_ROWS, 0);
        }
    }
    PROBE_SYNC();
    PROBE_END(probes, SOFTMAX, 0);
    mbarrier_wait(dl_bar(s), parity);  // every owner's rows of dlogits
    __syncthreads();  // (and this block's own)
    PROBE_END(probes, SOFTMAX_WAIT, 0);
}

__device__ __forceinline__ void head_gradient(const Smem& s, const Step& st, const Epoch& e, Probes& probes) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, rows = st.rows, bias = e.bias;
    const float lr = e.lr;
    // dh_L[:, U_c] = dz · W_h[:, U_c] ⊙ [h_L > 0] (W_h before its update; zero past the rows and
    // S) and the head's gradient dW_h[:, U_c] = dzᵀ h_L[:, U_c], a warp a tile of either; the
    // bias's Σ_r dz by the last warp.
    {
        const float* h_last = s.h_own + (LAYERS - 1) * BATCH * S;
        constexpr int DH_TILES = MT * NT, GW_TILES = (CLASSES + 15) / 16 * NT;
        for (int task = warp; task < DH_TILES + GW_TILES; task += WARPS) {
            Sums3 d;
            if (task < DH_TILES) {  // m = rows, k = classes, n = units
                const int mt = task / NT, r0 = 16 * mt, u0 = 8 * (task - mt * NT);
                tile_product<CLASS_KSTEPS>(d, [&](int m, int k) { return r0 + m < rows && k < CLASSES ? s.dl[(r0 + m) * CS + k] : 0.0f; },
                                           [&](int k, int n) { return k < CLASSES && u0 + n < S ? s.wh[k * S + u0 + n] : 0.0f; });
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = r0 + g_of(lane) + (i < 2 ? 0 : 8), u = u0 + 2 * t_of(lane) + (i & 1);
                    dh_of(s, LAYERS)[r * DST + u] = r < rows && u < S && h_last[r * S + u] > 0.0f ? total(d, i) : 0.0f;
                }
            } else {  // m = classes, k = rows, n = units
                const int tile = task - DH_TILES, mc = tile / NT, j0 = 16 * mc, u0 = 8 * (tile - mc * NT);
                tile_product<KB>(d, [&](int m, int k) { return k < rows && j0 + m < CLASSES ? s.dl[k * CS + j0 + m] : 0.0f; },
                                 [&](int k, int n) { return k < rows && u0 + n < S ? h_last[k * S + u0 + n] : 0.0f; });
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int jj = j0 + g_of(lane) + (i < 2 ? 0 : 8), u = u0 + 2 * t_of(lane) + (i & 1);
                    if (jj < CLASSES && u < S) s.gwh[jj * S + u] = total(d, i);
                }
            }
        }
        if (bias && warp == WARPS - 1 && lane < CLASSES)
            s.gwh[CS * S + lane] = sum_rows(rows, [&](int r) { return s.dl[r * CS + lane]; });
        PROBE_END(probes, HEAD_TILES, 0);
        __syncthreads();
        PROBE_END(probes, HEAD_TILES_SYNC, 0);
        for (int i = tid; i < CLASSES * S; i += THREADS) s.wh[i] = fmaf(-lr, s.gwh[i], s.wh[i]);
        if (bias && tid < CLASSES) s.bh[tid] = fmaf(-lr, s.gwh[CS * S + tid], s.bh[tid]);
    }
    PROBE_SYNC();
    PROBE_END(probes, HEAD_GRADIENT, 0);
}

__device__ __forceinline__ void backward(const Smem& s, const Step& st, const Epoch& e, Ops::FirstLayer& w1,
                                         Probes& probes) {
    const int warp = threadIdx.x >> 5, step = st.step, rows = st.rows, bias = e.bias;
    const unsigned parity = st.parity, rank = st.rank;
    const float lr = e.lr;
    const ImageRows& x_rows = st.x_rows;
    // ---- backward ---------------------------------------------------------------------------
    for (int l = LAYERS; l >= 2; --l) {
        float* inbox = inbox_of(s, l - 1);
        backward_layer(h_of(s, l - 1), layer_weights(s, l), dh_of(s, l), inbox,
                       inbox_bar(s, l - 1), lr, rows, rank);
        if (bias) update_bias(s.b + (l - 1) * S, dh_of(s, l), lr, rows);
        PROBE_END(probes, BACKWARD_PRODUCTS, l);
        // Warp 0 issues D_l's bulk copies and then updates its tiles of W_l; the others do not
        // wait for it (a block barrier here cost 1.5 to 2.5% of a step at H = 128, H100): they wait for
        // the inbox and sum dh_{l−1} into the other buffer of dh.
        if (warp > 0) {
            mbarrier_wait(inbox_bar(s, l - 1), parity);  // dh_{l−1}'s inbox is full
            gather_input_grad(inbox, s.h_own + (l - 2) * BATCH * S, dh_of(s, l - 1), rows, 32);
        }
        __syncthreads();
        PROBE_END(probes, GATHER_GRADIENT, l - 1);
    }
    if (X_STRIDE) w1.update(StagedRows{staged_images(s, step % X_BUFFERS)}, dh_of(s, 1), lr * X_UNIT, rows);
    else w1.update(x_rows, dh_of(s, 1), lr * X_UNIT, rows);
    if (bias) update_bias(s.b, dh_of(s, 1), lr, rows);
    PROBE_SYNC();
    PROBE_END(probes, UPDATE, 1);
    // The next step's first __syncthreads orders these updates before its forward reads them.
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
mlp_epoch(const Pixel* images, const int* labels, const int* order, const unsigned long long* params, int bias,
          int num_samples, int num_steps, float lr, double* metrics, int measure) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Smem s = carve(smem_raw);
    const unsigned rank = cluster_rank();
    const int tid = threadIdx.x;
    const int u0 = rank * S;  // this block's first unit
    // params: the weights of hidden layers 1..LAYERS and of the head, then their biases (row-major
    // fan_out × fan_in, as the stage keeps them).
    float* const* w_global = reinterpret_cast<float* const*>(params);
    float* const* b_global = reinterpret_cast<float* const*>(params + LAYERS + 1);

    // ---- parameters into shared memory -------------------------------------------------------
    Ops::FirstLayer w1(s);  // W_1[U_c, :]: in shared memory (TF32), or the warp's tiles in registers (bf16)
    w1.load(w_global[0], u0);
    for (int l = 1; l <= LAYERS; ++l) {
        float* wt = layer_weights(s, l);
        for (int i = tid; l > 1 && i < HIDDEN * WST; i += THREADS) {
            const int k = i / WST, u = i - k * WST;
            wt[wt_at(k, u)] = u < S ? w_global[l - 1][(long long)(u0 + u) * HIDDEN + k] : 0.0f;
        }
        if (tid < S) s.b[(l - 1) * S + tid] = bias ? b_global[l - 1][u0 + tid] : 0.0f;
    }
    for (int i = tid; i < CS * S; i += THREADS) {
        const int j = i / S, u = i - j * S;
        s.wh[i] = j < CLASSES ? w_global[LAYERS][j * HIDDEN + u0 + u] : 0.0f;
    }
    if (tid < CS) s.bh[tid] = bias && tid < CLASSES ? b_global[LAYERS][tid] : 0.0f;
    for (int step = 0; step < 2 && step < num_steps; ++step)
        for (int r = tid; r < step_rows(step, BATCH, num_samples); r += THREADS)
            s.order[step * BATCH + r] = order[(long long)step * BATCH + r];
    if (tid == 0) {
        for (int i = 0; i < NBARS; ++i) mbarrier_init(s.bars + i, 1);
        mbarrier_init_fence();
    }
    __syncthreads();
    if (num_steps > 0)
        for (int r = tid; r < step_rows(0, BATCH, num_samples); r += THREADS) {
            copy4_async(s.labels + r, labels + s.order[r]);
            if (r % CLUSTER == rank) prefetch_l2(images + (long long)s.order[r] * FEATURE_STRIDE, FEATURE_STRIDE * sizeof(Pixel));
        }
    if (X_STRIDE)  // the images of the steps before the first that a step copies in
        for (int step = 0; step < X_LEAD && step < num_steps; ++step)
            copy_images_in(s, images, s.order + step * BATCH, step, step_rows(step, BATCH, num_samples));
    async_commit();
    // No block may write into another's shared memory (nor count on its barriers) before every
    // block of the cluster runs and has set up its barriers.
    cluster_sync();
    double loss_sum = 0.0, correct_sum = 0.0;  // kept by the softmax's lanes of class 0, over the owned rows
    Probes probes(metrics);  // (a probe build's table, where the metrics would go)
    PROBE_START(probes, s.probe_counts);
    const Epoch e{images, labels, order, bias, num_samples, num_steps, measure, lr};

    for (int step = 0; step < num_steps; ++step) {
        const int rows = step_rows(step, BATCH, num_samples);
        const int r_own = (rows + CLUSTER - 1) / CLUSTER, own_lo = min(rows, (int)rank * r_own);
        const int* step_order = s.order + (step % 3) * BATCH;
        const Step st{step, rows, r_own, own_lo, min(rows, own_lo + r_own) - own_lo, (unsigned)step & 1, rank,
                      step_order, s.labels + (step & 1) * BATCH, ImageRows{images, step_order}};
        step_start(s, st, e, probes);
        forward(s, st, e, w1, probes);
        head_logits(s, st, e, probes);
        softmax(s, st, e, loss_sum, correct_sum, probes);
        head_gradient(s, st, e, probes);
        backward(s, st, e, w1, probes);
    }
    PROBE_FINISH(probes);

    // ---- parameters back to global memory; the metrics of block 0 ------------------------------
    __syncthreads();
    w1.store(w_global[0], u0);
    for (int l = 1; l <= LAYERS; ++l) {
        const float* wt = layer_weights(s, l);
        for (int i = tid; l > 1 && i < HIDDEN * S; i += THREADS) {
            const int u = i / HIDDEN, k = i - u * HIDDEN;
            w_global[l - 1][(long long)(u0 + u) * HIDDEN + k] = wt[wt_at(k, u)];
        }
        if (bias && tid < S) b_global[l - 1][u0 + tid] = s.b[(l - 1) * S + tid];
    }
    for (int i = tid; i < CLASSES * S; i += THREADS) {
        const int j = i / S, u = i - j * S;
        w_global[LAYERS][j * HIDDEN + u0 + u] = s.wh[i];
    }
    if (bias && rank == 0 && tid < CLASSES) b_global[LAYERS][tid] = s.bh[tid];
    if (measure) cluster_metrics(s.totals, WARPS, loss_sum, correct_sum, metrics);  // each block's owned rows
    cluster_sync();  // no block leaves while another may still write to its shared memory
}
