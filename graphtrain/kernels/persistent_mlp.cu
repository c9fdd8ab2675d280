// `persistent` for MLPs: LAYERS hidden layers of HIDDEN units (ReLU) and a softmax head, trained by
// one thread-block cluster; one launch runs an epoch.
//
// Block c of the CLUSTER blocks owns S = HIDDEN / CLUSTER units U_c of every hidden layer: the rows
// W_l[U_c, :] of each hidden layer's weights (kept k-major, wt[k][u]), its bias b_l[U_c], and the
// head's columns W_h[:, U_c]. Every block keeps a copy of the head's bias. A step of `rows` samples
// x (read from global memory through the sample order), h_0 = x:
//
//   forward, l = 1..LAYERS      h_l[:, U_c] = relu(h_{l-1} · W_l[U_c, :]ᵀ + b_l[U_c])
//       for l < LAYERS each block sends its columns to every block's h_full[l]  ── cluster barrier ──
//   head, partial               P_c = h_L[:, U_c] · W_h[:, U_c]ᵀ, sent to every block
//                                                                              ── cluster barrier ──
//   head, in every block        z = Σ_{c = 0..CLUSTER-1} P_c + b_h (in that order: every block
//                               gets the same bits), dz = (softmax(z) − onehot(y)) / rows,
//                               dh_L[:, U_c] = dz · W_h[:, U_c] ⊙ [h_L[:, U_c] > 0],
//                               W_h[:, U_c] −= lr · dzᵀ h_L[:, U_c],  b_h −= lr · Σ_r dz[r]
//   backward, l = LAYERS..1     Q_c = dh_l[:, U_c] · W_l[U_c, :] (this block's part of dh_{l-1}),
//       (l ≥ 2)                 Q_c[:, U_o] sent to block o's inbox
//                               W_l[U_c, :] −= lr · dh_l[:, U_c]ᵀ h_{l-1},  b_l[U_c] −= lr · Σ_r dh_l
//       (l ≥ 2)                 ── cluster barrier ──  dh_{l-1}[:, U_c] = Σ_{o} Q_o[:, U_c] (in order
//                               o = 0..CLUSTER-1) ⊙ [h_{l-1}[:, U_c] > 0]
//
// So no block needs another's weights, nor its weight gradients: the exchanges are activations
// (gathered), partial logits (all-reduced) and partial input gradients (reduce-scattered), and a
// step waits at 2·LAYERS − 1 cluster barriers (5 for three hidden layers). The products that need
// old weights (dh, Q) run before the update of those weights, as SGD requires. Every sum runs in a
// fixed order without atomics: the same seed gives the same weights bit for bit.
//
// Shared memory is reused across the step. Each buffer that other blocks write is written in one
// phase (between two barriers) and read in later ones; region[l] below serves two buffers whose
// lives do not overlap. A block's phases, barriers A_l (after the gather of h_l), Z (after the
// partial logits), D_l (after the exchange of dh_l):
//
//   region[0]         h_full[1]: written before A_1, read before A_2 (forward) and before D_1
//                     (dW_2); the next step writes it after D_1, in its forward, so once all
//                     blocks have passed D_1, which every reader passes after its last read.
//   region[l], 1 ≤ l ≤ LAYERS−2   h_full[l+1] (written before A_{l+1}, last read by dW_{l+2},
//                     before D_{l+1}) and dh_l's inbox (written after D_{l+1}, read after D_l):
//                     the inbox is written only after every block has passed D_{l+1}, after its last
//                     read of h_full[l+1]; the next step's gather of h_{l+1} comes after A_l of that
//                     step, after every reader's sum of the inbox (before D_{l−1}, or before A_1).
//   region[LAYERS−1]  dh_{L−1}'s inbox (written after Z, read after D_{L−1}) and the forward's
//                     partial sums (this block only, between the inbox's read and Z of the next
//                     step). With one hidden layer there is no inbox: only the partial sums.
//   logits            written after A_{L−1} (or, with one hidden layer, any time in the step), read
//                     after Z and before D_{L−1}; the next step writes it after A_{L−1} of that
//                     step. With one hidden layer Z is the step's only barrier, so two buffers
//                     alternate by step: step t+2 writes step t's buffer only after passing Z of
//                     step t+1, which every reader passes after reading step t's logits.
//
// The sample indices come two steps ahead and the labels one step ahead (cp.async), and the next
// step's images are prefetched into L2 (cp.async.bulk.prefetch), so no dependent global load sits
// on a step's path apart from the images themselves.
//
// Compile-time (from kernels/persistent_mlp.py): CLUSTER, THREADS, FEATURES, FEATURE_STRIDE (a
// multiple of 4; images are rows of FEATURE_STRIDE floats, zero past FEATURES), HIDDEN (a multiple
// of 4·CLUSTER), LAYERS, CLASSES (≤ 32), X_STRIDE (0, or FEATURE_STRIDE + 4 where the batch's
// images fit in shared memory: layer 1's forward stores what it loads there, and the update of
// W_1 reads them back instead of reading global memory again). Without a bias (bias = 0) every
// bias stays zero.

#define S (HIDDEN / CLUSTER)          // units a block owns per hidden layer
#define SQ (S / 4)                    // ... as float4 quads
#define CS ((CLASSES + 3) / 4 * 4)    // classes padded to whole float4 quads
#define HS (HIDDEN + 4)               // row stride of h_full: rows land on different banks
#define KP 16                         // the forward's partial sums per output (its k split)
#define FQ (FEATURE_STRIDE / 4)
#define HQ (HIDDEN / 4)
#define WARPS (THREADS / 32)
#define LOGIT_BUFFERS (LAYERS == 1 ? 2 : 1)

#if (X_STRIDE != 0 && X_STRIDE < FEATURE_STRIDE) || X_STRIDE % 4 != 0 || S % 4 != 0 || KP * S > HS || FEATURE_STRIDE % 4 != 0 || CLASSES > 32 || LAYERS < 1 || THREADS % 32 != 0 || HQ > THREADS
#error "persistent_mlp.cu: unsupported HIDDEN / FEATURE_STRIDE / CLASSES / LAYERS / THREADS"
#endif

// From cluster.cuh (put before this file by the launcher): cluster_rank, cluster_sync, remote,
// copy4_async, async_commit, async_wait_all, step_rows.

__device__ __forceinline__ void store_remote4(unsigned addr, float4 v) {
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" :: "r"(addr), "f"(v.x), "f"(v.y), "f"(v.z),
                 "f"(v.w) : "memory");
}
// A hint: fetch `bytes` (a multiple of 16, 16-byte aligned) of global memory into L2.
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
}

__device__ __forceinline__ float4 zero4() { return make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
__device__ __forceinline__ float4 add4(float4 a, float4 b) { return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w); }
__device__ __forceinline__ float4 operator+(float4 a, float4 b) { return add4(a, b); }
__device__ __forceinline__ float4 fma4(float s, float4 v, float4 acc) {
    return make_float4(fmaf(s, v.x, acc.x), fmaf(s, v.y, acc.y), fmaf(s, v.z, acc.z), fmaf(s, v.w, acc.w));
}
__device__ __forceinline__ float4 relu_mask(float4 v, float4 h) {  // v where h > 0, else 0
    return make_float4(h.x > 0.0f ? v.x : 0.0f, h.y > 0.0f ? v.y : 0.0f, h.z > 0.0f ? v.z : 0.0f, h.w > 0.0f ? v.w : 0.0f);
}
__device__ __forceinline__ float at(float4 v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// The dynamic shared memory, carved for a batch of `batch` rows. Keep in step with the launcher's
// byte count (kernels/persistent_mlp.py: shared_bytes). [..]4 marks float4 layouts, [uq][r]
// meaning quad uq of row r: consecutive rows are consecutive float4s (conflict-free).
struct Smem {
    double* totals;   // [2 + 2·WARPS]        block totals of loss and correct, then per warp
    float* w1;        // [FEATURE_STRIDE][S]  W_1[U_c, :], k-major
    float* w;         // [LAYERS−1][HIDDEN][S]  W_l[U_c, :] for l = 2..LAYERS, k-major
    float* wh;        // [CS][S]              W_h[:, U_c], zero past CLASSES
    float* b;         // [LAYERS][S]          b_l[U_c]
    float* bh;        // [CS]                 the head's bias (every block's copy)
    float* region;    // [LAYERS][batch·HS]   see the header
    float* logits;    // [LOGIT_BUFFERS][CLUSTER][batch][CS]  partial logits, per sending block
    float4* h_own;    // [LAYERS][SQ][batch]4 h_l[:, U_c]: the ReLU masks, the head's input
    float4* dh;       // [SQ][batch]4         dh_l[:, U_c] of the layer being differentiated
    float* dl;        // [batch][CS]          dlogits
    float* gwh;       // [CS][S], then [CS]   the head's gradient
    float* x;         // [batch][X_STRIDE]    the batch's images, where they fit (X_STRIDE > 0)
    int* order;       // [3][batch]           sample indices of this step and the next two
    int* labels;      // [2][batch]           labels of this step and the next
};

__device__ Smem carve(unsigned char* base, int batch) {
    Smem s;
    double* d = reinterpret_cast<double*>(base);
    s.totals = d; d += 2 + 2 * WARPS;
    float* f = reinterpret_cast<float*>(d);  // every region below is a multiple of 16 bytes
    s.w1 = f; f += FEATURE_STRIDE * S;
    s.w = f; f += (LAYERS - 1) * HIDDEN * S;
    s.wh = f; f += CS * S;
    s.b = f; f += LAYERS * S;
    s.bh = f; f += CS;
    s.region = f; f += LAYERS * batch * HS;
    s.logits = f; f += LOGIT_BUFFERS * CLUSTER * batch * CS;
    s.h_own = reinterpret_cast<float4*>(f); f += LAYERS * batch * S;
    s.dh = reinterpret_cast<float4*>(f); f += batch * S;
    s.dl = f; f += batch * CS;
    s.gwh = f; f += CS * S + CS;
    s.x = f; f += batch * X_STRIDE;
    int* i = reinterpret_cast<int*>(f);
    s.order = i; i += 3 * batch;
    s.labels = i;
    return s;
}

__device__ __forceinline__ float* layer_weights(const Smem& s, int l) {  // wt of hidden layer l (1-based)
    return l == 1 ? s.w1 : s.w + (l - 2) * HIDDEN * S;
}

// The rows of a product's left operand: a batch of images in global memory, or h_full in shared.
struct ImageRows {
    const float* images; const int* order;
    __device__ const float4* operator()(int r) const {
        return reinterpret_cast<const float4*>(images + (long long)order[r] * FEATURE_STRIDE);
    }
};
template <int STRIDE> struct SharedRows {
    const float* base;
    __device__ const float4* operator()(int r) const { return reinterpret_cast<const float4*>(base + r * STRIDE); }
};
using ActivationRows = SharedRows<HS>;  // h_full
using StagedRows = SharedRows<X_STRIDE>;  // the batch's images, as layer 1's forward read them

// ---- forward: h_l[:, U_c] = act(A · W_l[U_c, :]ᵀ + b) -----------------------------------------
// Thread (p, pair) sums the features k ≡ p (mod KP, in quads) of rows r and r + pairs for every
// owned unit (each weight loaded once serves two rows; the lanes of a warp share p, so the weight
// loads are broadcasts); the KP partial sums then add up in order p = 0..KP−1.
// With `stage`, the thread also stores the quads it loaded there (rows of X_STRIDE floats), for
// the update of W_1 to read from shared memory.
template <int K4, class Rows>
__device__ void forward_partials(Rows a_rows, const float* wt, float4* partial, int rows, int batch,
                                 float* stage = nullptr) {
    constexpr int NQ = (K4 + KP - 1) / KP;  // input quads per thread and row, all loaded up front
    const int pairs = (rows + 1) / 2;
    for (int i = threadIdx.x; i < pairs * KP; i += THREADS) {
        const int p = i / pairs, r0 = i - p * pairs, r1 = r0 + pairs;
        const bool two = r1 < rows;
        const float4* x0 = a_rows(r0);
        const float4* x1 = two ? a_rows(r1) : x0;
        float4 acc0[SQ], acc1[SQ], in0[NQ], in1[NQ];
#pragma unroll
        for (int uq = 0; uq < SQ; ++uq) { acc0[uq] = zero4(); acc1[uq] = zero4(); }
#pragma unroll
        for (int n = 0; n < NQ; ++n) {  // the loads first: one memory latency, not NQ of them
            const int q = p + n * KP;
            in0[n] = q < K4 ? x0[q] : zero4();
            in1[n] = q < K4 ? x1[q] : zero4();
        }
        if (stage) {
            float4* staged = reinterpret_cast<float4*>(stage);
#pragma unroll
            for (int n = 0; n < NQ; ++n) {
                const int q = p + n * KP;
                if (q >= K4) break;
                staged[r0 * (X_STRIDE / 4) + q] = in0[n];
                if (two) staged[r1 * (X_STRIDE / 4) + q] = in1[n];
            }
        }
#pragma unroll
        for (int n = 0; n < NQ; ++n) {
            const int q = p + n * KP;
            if (q >= K4) break;
            const float4 a0 = in0[n], a1 = in1[n];
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const float4* wk = reinterpret_cast<const float4*>(wt + (4 * q + kk) * S);
                const float v0 = at(a0, kk), v1 = at(a1, kk);
#pragma unroll
                for (int uq = 0; uq < SQ; ++uq) {
                    const float4 wv = wk[uq];
                    acc0[uq] = fma4(v0, wv, acc0[uq]);
                    acc1[uq] = fma4(v1, wv, acc1[uq]);
                }
            }
        }
#pragma unroll
        for (int uq = 0; uq < SQ; ++uq) {
            partial[(p * SQ + uq) * batch + r0] = acc0[uq];
            if (two) partial[(p * SQ + uq) * batch + r1] = acc1[uq];
        }
    }
}

// h_l[:, U_c] = act(Σ_p partial[p] + b), kept in h_own and, when `h_full` is given, sent to every
// block's h_full[:, U_c] (two threads per quad, each sending to half the cluster).
__device__ void forward_finish(const float4* partial, const float* bias, bool relu, float4* h_own, float* h_full,
                               int rows, int batch, unsigned rank) {
    const int items = rows * SQ, senders = h_full ? 2 : 1;
    for (int i = threadIdx.x; i < items * senders; i += THREADS) {
        const int half = i / items, j = i - half * items, uq = j / rows, r = j - uq * rows;
        float4 v = partial[uq * batch + r];
#pragma unroll
        for (int p = 1; p < KP; ++p) v = add4(v, partial[(p * SQ + uq) * batch + r]);
        v = add4(v, reinterpret_cast<const float4*>(bias)[uq]);
        if (relu) v = relu_mask(v, v);
        if (half == 0) h_own[uq * batch + r] = v;
        if (h_full) {
            const float* dst = h_full + r * HS + rank * S + 4 * uq;
#pragma unroll
            for (int o = 0; o < CLUSTER / 2; ++o) store_remote4(remote(dst, half * (CLUSTER / 2) + o), v);
        }
    }
}

// ---- backward ----------------------------------------------------------------------------------
// Q_c = dh_l[:, U_c] · W_l[U_c, :] for the HIDDEN inputs of layer l ≥ 2; quad k..k+3 of each row
// goes to the inbox of the block that owns unit k, at [rank][k's quad][r]. Thread (q, g) holds
// the four weight rows k = 4q..4q+3 in registers and takes the rows r ≡ g (mod groups).
__device__ void send_input_grad(const float* wt, const float4* dh, float* inbox, int rows, int batch, unsigned rank) {
    constexpr int groups = THREADS / HQ;
    for (int i = threadIdx.x; i < HQ * groups; i += THREADS) {
        const int q = i % HQ, g = i / HQ, k = 4 * q, owner = k / S, uq = (k - owner * S) / 4;
        float4 w[4][SQ];
#pragma unroll
        for (int m = 0; m < 4; ++m)
#pragma unroll
            for (int u = 0; u < SQ; ++u) w[m][u] = reinterpret_cast<const float4*>(wt + (k + m) * S)[u];
        const unsigned dst = remote(inbox + 4 * ((rank * SQ + uq) * batch), owner);
        for (int r = g; r < rows; r += groups) {
            float qv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int u = 0; u < SQ; ++u) {
                const float4 d = dh[u * batch + r];
#pragma unroll
                for (int m = 0; m < 4; ++m)
                    qv[m] = fmaf(d.w, w[m][u].w, fmaf(d.z, w[m][u].z, fmaf(d.y, w[m][u].y, fmaf(d.x, w[m][u].x, qv[m]))));
            }
            store_remote4(dst + 16 * r, make_float4(qv[0], qv[1], qv[2], qv[3]));
        }
    }
}

// Sums over the rows of a step, in a fixed order that is not a chain of `rows` dependent adds:
// four partial sums over r ≡ 0, 1, 2, 3 (mod 4), then (s0 + s1) + (s2 + s3).
template <class T, class Term>
__device__ __forceinline__ T sum_rows(int rows, T zero, Term term) {
    T part[4] = {zero, zero, zero, zero};
    for (int r = 0; r < rows; r += 4)
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (r + k < rows) part[k] = term(r + k, part[k]);
    return (part[0] + part[1]) + (part[2] + part[3]);
}
// b_l[U_c] −= lr · Σ_r dh_l, by the last S threads (the first ones are the busiest above).
__device__ void update_bias(float* bias, const float4* dh, float lr, int rows, int batch) {
    const int u = THREADS - 1 - threadIdx.x;
    if (u < S) {
        const float sum = sum_rows(rows, 0.0f, [&](int r, float acc) { return acc + at(dh[(u / 4) * batch + r], u % 4); });
        bias[u] = fmaf(-lr, sum, bias[u]);
    }
}

// W_l[U_c, :] −= lr · dh_lᵀ h_{l−1}, l ≥ 2: thread (q, g) owns inputs 4q..4q+3 of units 4g..4g+3
// and sums over the rows in order (the lanes of a warp read consecutive quads of a row). Where
// that leaves threads idle, thread (k, g) owns input k alone.
__device__ void update_layer(ActivationRows a_rows, float* wt, const float4* dh, float lr, int rows, int batch) {
    if constexpr (HQ * SQ < THREADS) {
        for (int i = threadIdx.x; i < HIDDEN * SQ; i += THREADS) {
            const int g = i % SQ, k = i / SQ;
            float4 acc = zero4();
#pragma unroll 4
            for (int r = 0; r < rows; ++r) acc = fma4(a_rows.base[r * HS + k], dh[g * batch + r], acc);
            float4* wv = reinterpret_cast<float4*>(wt + k * S) + g;
            *wv = fma4(-lr, acc, *wv);
        }
    } else {
        for (int i = threadIdx.x; i < HQ * SQ; i += THREADS) {
            const int g = i % SQ, q = i / SQ;
            float4 acc[4] = {zero4(), zero4(), zero4(), zero4()};
#pragma unroll 4
            for (int r = 0; r < rows; ++r) {
                const float4 a = a_rows(r)[q], d = dh[g * batch + r];
                acc[0] = fma4(a.x, d, acc[0]); acc[1] = fma4(a.y, d, acc[1]);
                acc[2] = fma4(a.z, d, acc[2]); acc[3] = fma4(a.w, d, acc[3]);
            }
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                float4* wv = reinterpret_cast<float4*>(wt + (4 * q + m) * S) + g;
                *wv = fma4(-lr, acc[m], *wv);
            }
        }
    }
}

// W_1[U_c, :] −= lr · dh_1ᵀ X, X in global memory or staged in shared: thread q owns inputs
// 4q..4q+3 of every owned unit (each image quad loaded once) and sums over the rows in order; the
// quads of the next CHUNK rows are loaded while the products of this chunk's run.
template <class Rows>
__device__ void update_first_layer(Rows x_rows, float* wt, const float4* dh, float lr, int rows, int batch) {
    constexpr int CHUNK = S <= 8 ? 16 : 8;
    for (int q = threadIdx.x; q < FQ; q += THREADS) {
        float4 acc[4][SQ];
#pragma unroll
        for (int m = 0; m < 4; ++m)
#pragma unroll
            for (int uq = 0; uq < SQ; ++uq) acc[m][uq] = zero4();
        float4 a[CHUNK], next[CHUNK];
#pragma unroll
        for (int n = 0; n < CHUNK; ++n) a[n] = n < rows ? x_rows(n)[q] : zero4();
        for (int r0 = 0; r0 < rows; r0 += CHUNK) {
#pragma unroll
            for (int n = 0; n < CHUNK; ++n)  // the next chunk in flight while this one's products run
                next[n] = r0 + CHUNK + n < rows ? x_rows(r0 + CHUNK + n)[q] : zero4();
#pragma unroll
            for (int n = 0; n < CHUNK; ++n) {
                if (r0 + n >= rows) break;
#pragma unroll
                for (int uq = 0; uq < SQ; ++uq) {
                    const float4 d = dh[uq * batch + r0 + n];
                    acc[0][uq] = fma4(a[n].x, d, acc[0][uq]); acc[1][uq] = fma4(a[n].y, d, acc[1][uq]);
                    acc[2][uq] = fma4(a[n].z, d, acc[2][uq]); acc[3][uq] = fma4(a[n].w, d, acc[3][uq]);
                }
            }
#pragma unroll
            for (int n = 0; n < CHUNK; ++n) a[n] = next[n];
        }
#pragma unroll
        for (int m = 0; m < 4; ++m)
#pragma unroll
            for (int uq = 0; uq < SQ; ++uq) {
                float4* wv = reinterpret_cast<float4*>(wt + (4 * q + m) * S) + uq;
                *wv = fma4(-lr, acc[m][uq], *wv);
            }
    }
}

// dh_{l}[:, U_c] = Σ_o inbox[o] (in order) ⊙ [h_l[:, U_c] > 0].
__device__ void gather_input_grad(const float* inbox, const float4* h_own, float4* dh, int rows, int batch) {
    const float4* in = reinterpret_cast<const float4*>(inbox);
    for (int i = threadIdx.x; i < rows * SQ; i += THREADS) {
        const int uq = i / rows, r = i - uq * rows;
        float4 v = in[uq * batch + r];
#pragma unroll
        for (int o = 1; o < CLUSTER; ++o) v = add4(v, in[(o * SQ + uq) * batch + r]);
        dh[uq * batch + r] = relu_mask(v, h_own[uq * batch + r]);
    }
}

// With PHASE_CYCLES=1 (scripts/persistent_mlp_phases.py), thread 0 of block 0 adds up the SM
// cycles of each phase of a step (each ending at a block or cluster barrier, so the slowest
// thread's and block's time) and prints them per step at the end of the launch. Off, it is nothing.
enum Phase { START, PRODUCTS, EXCHANGE, HEAD_PARTIALS, HEAD_BARRIER, SOFTMAX, HEAD_GRADIENT, SEND_GRADIENT,
             UPDATE, BACKWARD_BARRIER, GATHER_GRADIENT, PHASES };
#if PHASE_CYCLES
#define PHASE_END(phase, layer) do { if (rank == 0 && tid == 0) { const long long now = clock64(); \
        phase_cycles[phase][layer] += now - phase_mark; phase_mark = now; } } while (0)
#define PHASE_SYNC() __syncthreads()  // splits a phase that ends without a barrier of its own
#else
#define PHASE_END(phase, layer) do {} while (0)
#define PHASE_SYNC() do {} while (0)
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 1)
mlp_epoch(const float* images, const int* labels, const int* order, const unsigned long long* params, int bias,
          int num_samples, int batch, int num_steps, float lr, double* metrics, int measure) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Smem s = carve(smem_raw, batch);
    const unsigned rank = cluster_rank();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int u0 = rank * S;  // this block's first unit
    // params: the weights of hidden layers 1..LAYERS and of the head, then their biases (row-major
    // fan_out × fan_in, as the stage keeps them).
    float* const* w_global = reinterpret_cast<float* const*>(params);
    float* const* b_global = reinterpret_cast<float* const*>(params + LAYERS + 1);

    // ---- parameters into shared memory -------------------------------------------------------
    for (int l = 1; l <= LAYERS; ++l) {
        const int fan_in = l == 1 ? FEATURES : HIDDEN, stride = l == 1 ? FEATURE_STRIDE : HIDDEN;
        float* wt = layer_weights(s, l);
        for (int i = tid; i < stride * S; i += THREADS) {
            const int k = i / S, u = i - k * S;
            wt[i] = k < fan_in ? w_global[l - 1][(long long)(u0 + u) * fan_in + k] : 0.0f;
        }
        if (tid < S) s.b[(l - 1) * S + tid] = bias ? b_global[l - 1][u0 + tid] : 0.0f;
    }
    for (int i = tid; i < CS * S; i += THREADS) {
        const int j = i / S, u = i - j * S;
        s.wh[i] = j < CLASSES ? w_global[LAYERS][j * HIDDEN + u0 + u] : 0.0f;
    }
    if (tid < CS) s.bh[tid] = bias && tid < CLASSES ? b_global[LAYERS][tid] : 0.0f;
    for (int step = 0; step < 2 && step < num_steps; ++step)
        for (int r = tid; r < step_rows(step, batch, num_samples); r += THREADS)
            s.order[step * batch + r] = order[(long long)step * batch + r];
    cluster_sync();  // every block of the cluster has started before any writes to another's memory
    if (num_steps > 0)
        for (int r = tid; r < step_rows(0, batch, num_samples); r += THREADS) {
            copy4_async(s.labels + r, labels + s.order[r]);
            if (r % CLUSTER == rank) prefetch_l2(images + (long long)s.order[r] * FEATURE_STRIDE, FEATURE_STRIDE * 4);
        }
    async_commit();
    double loss_sum = 0.0, correct_sum = 0.0;  // kept by lane 0 of each warp of block 0
#if PHASE_CYCLES
    long long phase_cycles[PHASES][LAYERS + 1] = {}, phase_mark = clock64();
#endif

    for (int step = 0; step < num_steps; ++step) {
        const int rows = step_rows(step, batch, num_samples);
        const int* step_order = s.order + (step % 3) * batch;
        const int* step_labels = s.labels + (step & 1) * batch;
        float* logits = s.logits + (LAYERS == 1 ? (step & 1) : 0) * CLUSTER * batch * CS;
        const ImageRows x_rows{images, step_order};

        async_wait_all();
        __syncthreads();  // this step's labels, the next step's indices have landed
        if (step + 1 < num_steps) {
            const int next_rows = step_rows(step + 1, batch, num_samples);
            const int* next_order = s.order + ((step + 1) % 3) * batch;
            for (int r = tid; r < next_rows; r += THREADS)
                copy4_async(s.labels + ((step + 1) & 1) * batch + r, labels + next_order[r]);
            for (int r = tid * CLUSTER + rank; r < next_rows; r += THREADS * CLUSTER)
                prefetch_l2(images + (long long)next_order[r] * FEATURE_STRIDE, FEATURE_STRIDE * 4);
        }
        if (step + 2 < num_steps)
            for (int r = tid; r < step_rows(step + 2, batch, num_samples); r += THREADS)
                copy4_async(s.order + ((step + 2) % 3) * batch + r, order + (long long)(step + 2) * batch + r);
        async_commit();
        PHASE_END(START, 0);

        // ---- forward ---------------------------------------------------------------------------
        float4* partial = reinterpret_cast<float4*>(s.region + (LAYERS - 1) * batch * HS);
        for (int l = 1; l <= LAYERS; ++l) {
            if (l == 1) forward_partials<FQ>(x_rows, s.w1, partial, rows, batch, X_STRIDE ? s.x : nullptr);
            else forward_partials<HQ>(ActivationRows{s.region + (l - 2) * batch * HS}, layer_weights(s, l), partial, rows, batch);
            __syncthreads();
            PHASE_END(PRODUCTS, l);
            forward_finish(partial, s.b + (l - 1) * S, true, s.h_own + (l - 1) * SQ * batch,
                           l < LAYERS ? s.region + (l - 1) * batch * HS : nullptr, rows, batch, rank);
            if (l < LAYERS) cluster_sync();  // h_full[l] is whole in every block
            else __syncthreads();
            PHASE_END(EXCHANGE, l);
        }

        // ---- head: partial logits of this block's units, to every block ------------------------
        {
            const float4* h_last = s.h_own + (LAYERS - 1) * SQ * batch;
            const int items = rows * (CS / 4);
            for (int i = tid; i < 2 * items; i += THREADS) {
                const int half = i / items, j = i - half * items, jq = j / rows, r = j - jq * rows;
                float zq[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int uq = 0; uq < SQ; ++uq) {
                    const float4 h = h_last[uq * batch + r];
#pragma unroll
                    for (int m = 0; m < 4; ++m) {
                        const float4 wv = reinterpret_cast<const float4*>(s.wh + (4 * jq + m) * S)[uq];
                        zq[m] = fmaf(h.w, wv.w, fmaf(h.z, wv.z, fmaf(h.y, wv.y, fmaf(h.x, wv.x, zq[m]))));
                    }
                }
                const float* dst = logits + (rank * batch + r) * CS + 4 * jq;
                const float4 v = make_float4(zq[0], zq[1], zq[2], zq[3]);
#pragma unroll
                for (int o = 0; o < CLUSTER / 2; ++o) store_remote4(remote(dst, half * (CLUSTER / 2) + o), v);
            }
        }
        PHASE_SYNC();
        PHASE_END(HEAD_PARTIALS, 0);
        cluster_sync();  // every block has every block's partial logits
        PHASE_END(HEAD_BARRIER, 0);

        // ---- head, in every block alike: logits, softmax, dlogits -------------------------------
        // A warp per row, each warp ROWS_AT_ONCE rows at once (their shuffles interleave).
        constexpr int ROWS_AT_ONCE = 4;
        for (int r0 = warp; r0 < rows; r0 += WARPS * ROWS_AT_ONCE) {
            float z[ROWS_AT_ONCE], m[ROWS_AT_ONCE], e[ROWS_AT_ONCE], total[ROWS_AT_ONCE];
#pragma unroll
            for (int i = 0; i < ROWS_AT_ONCE; ++i) {
                const int r = r0 + i * WARPS;
                z[i] = -__int_as_float(0x7f800000);  // −∞ on the lanes past the classes
                if (r < rows && lane < CLASSES) {
                    float sum = 0.0f;
#pragma unroll
                    for (int c = 0; c < CLUSTER; ++c) sum += logits[(c * batch + r) * CS + lane];
                    z[i] = sum + s.bh[lane];
                }
                m[i] = z[i];
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
#pragma unroll
                for (int i = 0; i < ROWS_AT_ONCE; ++i) m[i] = fmaxf(m[i], __shfl_xor_sync(0xffffffffu, m[i], o));
#pragma unroll
            for (int i = 0; i < ROWS_AT_ONCE; ++i) total[i] = e[i] = lane < CLASSES && r0 + i * WARPS < rows ? expf(z[i] - m[i]) : 0.0f;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
#pragma unroll
                for (int i = 0; i < ROWS_AT_ONCE; ++i) total[i] += __shfl_xor_sync(0xffffffffu, total[i], o);
#pragma unroll
            for (int i = 0; i < ROWS_AT_ONCE; ++i) {
                const int r = r0 + i * WARPS;
                if (r >= rows) break;  // the same for the whole warp
                const int label = step_labels[r];
                if (lane < CS) s.dl[r * CS + lane] = (e[i] / total[i] - (lane == label ? 1.0f : 0.0f)) / (float)rows;
                if (measure && rank == 0) {
                    const float z_label = __shfl_sync(0xffffffffu, z[i], label);
                    // The first index of the largest logit: the lowest lane holding m.
                    const unsigned at_max = __ballot_sync(0xffffffffu, lane < CLASSES && z[i] == m[i]);
                    if (lane == 0) {
                        loss_sum += (double)(logf(total[i]) + m[i] - z_label);
                        correct_sum += (__ffs(at_max) - 1) == label ? 1.0 : 0.0;
                    }
                }
            }
        }
        __syncthreads();
        PHASE_END(SOFTMAX, 0);
        {   // dh_L[:, U_c] (with W_h before its update), and the head's gradient
            const float4* h_last = s.h_own + (LAYERS - 1) * SQ * batch;
            const float4* wh4 = reinterpret_cast<const float4*>(s.wh);
            for (int i = tid; i < rows * SQ; i += THREADS) {
                const int uq = i / rows, r = i - uq * rows;
                float4 v = zero4();
#pragma unroll
                for (int j = 0; j < CLASSES; ++j) v = fma4(s.dl[r * CS + j], wh4[j * SQ + uq], v);
                s.dh[uq * batch + r] = relu_mask(v, h_last[uq * batch + r]);
            }
            // The head's gradient by the last threads, the first ones being busy with dh_L above.
            for (int i = THREADS - 1 - tid; i < CLASSES * SQ + CLASSES; i += THREADS) {
                if (i < CLASSES * SQ) {
                    const int j = i / SQ, uq = i - j * SQ;
                    reinterpret_cast<float4*>(s.gwh)[j * SQ + uq] = sum_rows(rows, zero4(), [&](int r, float4 acc) {
                        return fma4(s.dl[r * CS + j], h_last[uq * batch + r], acc); });
                } else if (bias) {
                    const int j = i - CLASSES * SQ;
                    s.gwh[CS * S + j] = sum_rows(rows, 0.0f, [&](int r, float acc) { return acc + s.dl[r * CS + j]; });
                }
            }
            __syncthreads();
            for (int i = tid; i < CLASSES * S; i += THREADS) s.wh[i] = fmaf(-lr, s.gwh[i], s.wh[i]);
            if (bias && tid < CLASSES) s.bh[tid] = fmaf(-lr, s.gwh[CS * S + tid], s.bh[tid]);
        }
        PHASE_SYNC();
        PHASE_END(HEAD_GRADIENT, 0);

        // ---- backward ---------------------------------------------------------------------------
        for (int l = LAYERS; l >= 1; --l) {
            float* wt = layer_weights(s, l);
            float* b = s.b + (l - 1) * S;
            if (l >= 2) {
                float* inbox = s.region + (l - 1) * batch * HS;  // dh_{l−1}'s inbox: region[l−1]
                send_input_grad(wt, s.dh, inbox, rows, batch, rank);
                __syncthreads();  // W_l is read by the products above before its update below
                PHASE_END(SEND_GRADIENT, l);
                update_layer(ActivationRows{s.region + (l - 2) * batch * HS}, wt, s.dh, lr, rows, batch);
                if (bias) update_bias(b, s.dh, lr, rows, batch);
                PHASE_SYNC();
                PHASE_END(UPDATE, l);
                cluster_sync();  // dh_{l−1}'s inbox is full in every block; s.dh is read
                PHASE_END(BACKWARD_BARRIER, l);
                gather_input_grad(inbox, s.h_own + (l - 2) * SQ * batch, s.dh, rows, batch);
                __syncthreads();
                PHASE_END(GATHER_GRADIENT, l - 1);
            } else {
                if (X_STRIDE) update_first_layer(StagedRows{s.x}, wt, s.dh, lr, rows, batch);
                else update_first_layer(x_rows, wt, s.dh, lr, rows, batch);
                if (bias) update_bias(b, s.dh, lr, rows, batch);
                PHASE_SYNC();
                PHASE_END(UPDATE, 1);
            }
        }
        // The next step's first __syncthreads orders these updates before its forward reads them.
    }

#if PHASE_CYCLES
    if (rank == 0 && tid == 0 && num_steps > 0) {
        const char* names[PHASES] = {"step start", "forward products", "forward sums, sends, barrier",
                                     "head partial logits, sends", "head barrier", "softmax", "head gradient",
                                     "backward products, sends", "weight update", "backward barrier",
                                     "input gradient sums"};
        long long total = 0;
        for (int p = 0; p < PHASES; ++p)
            for (int l = 0; l <= LAYERS; ++l) total += phase_cycles[p][l];
        printf("phase cycles per step (block 0, %d steps of %d rows): %lld in all\n", num_steps, batch,
               total / num_steps);
        for (int p = 0; p < PHASES; ++p)
            for (int l = 0; l <= LAYERS; ++l)
                if (phase_cycles[p][l]) printf("  %-30s layer %d  %8lld\n", names[p], l, phase_cycles[p][l] / num_steps);
    }
#endif
    // ---- parameters back to global memory; the metrics of block 0 ------------------------------
    __syncthreads();
    for (int l = 1; l <= LAYERS; ++l) {
        const int fan_in = l == 1 ? FEATURES : HIDDEN;
        const float* wt = layer_weights(s, l);
        for (int i = tid; i < fan_in * S; i += THREADS) {
            const int u = i / fan_in, k = i - u * fan_in;
            w_global[l - 1][(long long)(u0 + u) * fan_in + k] = wt[k * S + u];
        }
        if (bias && tid < S) b_global[l - 1][u0 + tid] = s.b[(l - 1) * S + tid];
    }
    for (int i = tid; i < CLASSES * S; i += THREADS) {
        const int j = i / S, u = i - j * S;
        w_global[LAYERS][j * HIDDEN + u0 + u] = s.wh[i];
    }
    if (bias && rank == 0 && tid < CLASSES) b_global[LAYERS][tid] = s.bh[tid];
    if (measure && rank == 0) {
        double* per_warp = s.totals + 2;
        if (lane == 0) { per_warp[2 * warp] = loss_sum; per_warp[2 * warp + 1] = correct_sum; }
        __syncthreads();
        if (tid == 0) {
            double l = 0.0, c = 0.0;
            for (int i = 0; i < WARPS; ++i) { l += per_warp[2 * i]; c += per_warp[2 * i + 1]; }
            metrics[0] += l; metrics[1] += c;
        }
    }
    cluster_sync();  // no block leaves while another may still write to its shared memory
}
