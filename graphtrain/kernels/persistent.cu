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
// The products of A and C run on tensor cores (mma.sync m16n8k8, TF32 inputs, fp32 sums) in
// three passes, which keeps near-fp32 accuracy: each operand is split as v = hi + lo (hi its
// top 19 bits), and a·b ≈ hi_a·hi_b + (hi_a·lo_b + lo_a·hi_b), the dropped lo·lo term and the
// operands' truncation ~2⁻²⁰ of the product. On CUDA cores the two products were most of a step's
// instructions; here a warp issues about 45 mma for each. Every sum runs in a fixed
// order, without atomics: the same seed gives the same weights bit for bit. The next batch is
// copied in (cp.async) while the current one trains, and its sample indices one step before that,
// so no dependent global load sits on a step's path.
//
// Compile-time (from kernels/persistent.py): CLUSTER, THREADS, SLICE (a multiple of 8), CLASSES
// (≤ 32), FEATURES. Images are float32 rows of CLUSTER·SLICE, zero past FEATURES (as W is there).
// Without a bias (bias = 0), b stays zero.

#define PADDED_FEATURES (CLUSTER * SLICE)
#define WARPS (THREADS / 32)
#define CLASS_STRIDE ((CLASSES + 3) / 4 * 4)  // floats per row of the bias, the inbox
#define N_TILES ((CLASSES + 7) / 8)           // the classes in mma columns of 8
#define QUADS (CLASS_STRIDE / 4)              // the classes in 16-byte pieces
// Rows of W (per feature) and of dlogits (per sample): N_TILES·8 classes, the stride ≡ 8 or 24
// (mod 32 banks) so that a B fragment's lanes (k = lane % 4, n = lane / 4) hit 32 banks.
#define CLASS_PAD (N_TILES * 8 + (N_TILES % 2 == 0 ? 8 : 0))
#define X_STRIDE (SLICE + 4)        // floats per tile row: A fragments of phase A hit 32 banks
#define C_M_TILES ((SLICE + 1 + 15) / 16)  // phase C's rows: the slice's features, then the bias
#define CHUNKS_PER_ROW (SLICE / 4)  // 16-byte copies per row of a tile

#if SLICE % 8 != 0 || CLASSES > 32
#error "persistent.cu: unsupported SLICE / CLASSES"
#endif

// From cluster.cuh and warp_softmax.cuh (put before this file by the launcher): cluster_rank,
// cluster_sync, remote, copy4_async, async_commit, async_wait_all, step_rows, warp_softmax_grad.

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
// The three passes of a tile's product, each into a sum of its own so that the chains of
// dependent mma stay one per k-step: hi·hi, lo_a·hi_b, hi_a·lo_b. The caller adds them last,
// small terms first.
struct Sums3 { float hh[4] = {}, lh[4] = {}, hl[4] = {}; };
__device__ __forceinline__ void mma_3xtf32(Sums3& d, const unsigned (&a_hi)[4], const unsigned (&a_lo)[4],
                                           const unsigned (&b_hi)[2], const unsigned (&b_lo)[2]) {
    mma_tf32(d.lh, a_lo, b_hi);
    mma_tf32(d.hl, a_hi, b_lo);
    mma_tf32(d.hh, a_hi, b_hi);
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
__device__ __forceinline__ void mbarrier_init(unsigned long long* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(bar)) : "memory");
}
// This block's one arrival of a phase, with the bytes the phase will receive.
__device__ __forceinline__ void mbarrier_expect(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// Wait for the phase of parity `parity` to complete: its arrival made and its bytes received.
__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned parity) {
    asm volatile("{\n\t.reg .pred done;\n"
                 "wait_%=:\n\t"
                 "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n\t"
                 "@!done bra wait_%=;\n}" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}

// The dynamic shared memory, carved for a batch of `batch` rows. Keep in step with the
// launcher's byte count (kernels/persistent.py: shared_bytes).
struct Smem {
    unsigned long long* inbox_full;  // this step's partial logits of the owned rows have arrived
    unsigned long long* dl_full;     // this step's dlogits have arrived
    double* totals;   // [2 + 2·WARPS]              block totals of loss and correct, then per warp
    float* w;         // [SLICE][CLASS_PAD]         this block's slice of W, feature-major
    float* b;         // [CLASS_STRIDE]             this block's copy of the bias
    float* x;         // [2][tile_rows][X_STRIDE]   this step's tile and the next one's
    float* inbox;     // [CLUSTER][r_max][CLASS_STRIDE]  partial logits of the owned rows, per block
    float* dl;        // [tile_rows][CLASS_PAD]     dlogits, pushed by the rows' owners
    int* order;       // [2][batch]                 sample indices of the next two steps
    int* labels;      // [2][r_max]                 labels of the owned rows, this step and the next
};

__device__ __forceinline__ int owned_rows(int rows) { return (rows + CLUSTER - 1) / CLUSTER; }
// Rows of a tile and of dlogits: the batch in whole mma tiles of 16.
__device__ __forceinline__ int tile_rows(int batch) { return (batch + 15) / 16 * 16; }

__device__ Smem carve(unsigned char* base, int batch) {
    const int r_max = owned_rows(batch), rows16 = tile_rows(batch);
    Smem s;
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(base);
    s.inbox_full = bars; s.dl_full = bars + 1;
    double* d = reinterpret_cast<double*>(bars + 2);
    s.totals = d; d += 2 + 2 * WARPS;
    float* f = reinterpret_cast<float*>(d);  // every region below starts 16-byte aligned
    s.w = f; f += SLICE * CLASS_PAD;
    s.b = f; f += CLASS_STRIDE;
    s.x = f; f += 2 * rows16 * X_STRIDE;
    s.inbox = f; f += CLUSTER * r_max * CLASS_STRIDE;
    s.dl = f; f += rows16 * CLASS_PAD;
    int* i = reinterpret_cast<int*>(f);
    s.order = i; i += 2 * batch;
    s.labels = i;
    return s;
}


// Queue the copies of a step's tile (this block's columns) and of the labels of its owned rows.
__device__ void fetch(const float* images, const int* labels, const int* order, int rows, unsigned rank,
                      float* tile, int* owned_labels) {
    for (int i = threadIdx.x; i < rows * CHUNKS_PER_ROW; i += THREADS) {
        const int r = i / CHUNKS_PER_ROW, k = i - r * CHUNKS_PER_ROW;
        copy16_async(tile + r * X_STRIDE + 4 * k, images + (long long)order[r] * PADDED_FEATURES + rank * SLICE + 4 * k);
    }
    const int r_own = owned_rows(rows), lo = min(rows, (int)rank * r_own), owned = min(rows, lo + r_own) - lo;
    if (threadIdx.x < owned) copy4_async(owned_labels + threadIdx.x, labels + order[lo + threadIdx.x]);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
softmax_epoch(const float* images, const int* labels, const int* order, float* w, float* b,
                         int bias, int num_samples, int batch, int num_steps, float lr, double* metrics,
                         int measure) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Smem s = carve(smem_raw, batch);
    const unsigned rank = cluster_rank();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int col0 = rank * SLICE;
    const int r_max = owned_rows(batch), rows16 = tile_rows(batch);
    const int g = lane >> 2, t = lane & 3;  // an mma fragment's row group and column pair

    for (int i = tid; i < SLICE * CLASS_PAD; i += THREADS) {
        const int f = i / CLASS_PAD, j = i - f * CLASS_PAD;
        s.w[i] = (j < CLASSES && col0 + f < FEATURES) ? w[j * FEATURES + col0 + f] : 0.0f;
    }
    // Tiles and dlogits start at zero: the mma tiles read rows past a step's last one (and
    // dlogits' columns past the classes), whose products are discarded but must be finite.
    for (int i = tid; i < 2 * rows16 * X_STRIDE; i += THREADS) s.x[i] = 0.0f;
    for (int i = tid; i < rows16 * CLASS_PAD; i += THREADS) s.dl[i] = 0.0f;
    if (tid < CLASS_STRIDE) s.b[tid] = bias && tid < CLASSES ? b[tid] : 0.0f;
    for (int step = 0; step < 2 && step < num_steps; ++step) {
        const int rows = step_rows(step, batch, num_samples);
        for (int r = tid; r < rows; r += THREADS) s.order[step * batch + r] = order[(long long)step * batch + r];
    }
    if (tid == 0) {
        mbarrier_init(s.inbox_full);
        mbarrier_init(s.dl_full);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    fetch(images, labels, s.order, step_rows(0, batch, num_samples), rank, s.x, s.labels);
    async_commit();
    // No block may write into another's shared memory (nor count on its barriers) before every
    // block of the cluster runs and has set up its barriers.
    cluster_sync();
    double loss_sum = 0.0, correct_sum = 0.0;  // kept by lane 0 of the warps of phase B

    for (int step = 0; step < num_steps; ++step) {
        const int rows = step_rows(step, batch, num_samples), r_own = owned_rows(rows);
        const int own_lo = min(rows, (int)rank * r_own), owned = min(rows, own_lo + r_own) - own_lo;
        const int cur = step & 1, nxt = cur ^ 1;
        const float* x = s.x + cur * rows16 * X_STRIDE;

        async_wait_all();
        __syncthreads();  // this step's tile, labels and the next step's indices have landed
        if (tid == 0) {  // what this step will receive: partials of the owned rows, all dlogits
            mbarrier_expect(s.inbox_full, owned * CLUSTER * CLASSES * 4);
            mbarrier_expect(s.dl_full, rows * QUADS * 16);
        }
        // A short step: phase C's k-steps run past its rows, where dlogits must be zero (no
        // block pushes there this step; the last one's values are still in place).
        for (int i = rows * CLASS_PAD + tid; i < rows16 * CLASS_PAD; i += THREADS) s.dl[i] = 0.0f;

        // ---- A: partial logits of this block's features, pushed to each row's owner ----------
        // P = x·W_sliceᵀ: warp w takes rows 16w.., all classes, k over the slice's features.
        for (int m = warp; m < (rows + 15) / 16; m += WARPS) {
            Sums3 sums[N_TILES];
            const float* xa = x + (16 * m + g) * X_STRIDE + t;
#pragma unroll
            for (int k = 0; k < SLICE; k += 8) {
                const float a[4] = {xa[k], xa[8 * X_STRIDE + k], xa[k + 4], xa[8 * X_STRIDE + k + 4]};
                unsigned a_hi[4], a_lo[4];
                split_tf32(a, a_hi, a_lo);
#pragma unroll
                for (int n = 0; n < N_TILES; ++n) {
                    const float* wb = s.w + (k + t) * CLASS_PAD + 8 * n + g;
                    const float b[2] = {wb[0], wb[4 * CLASS_PAD]};
                    unsigned b_hi[2], b_lo[2];
                    split_tf32(b, b_hi, b_lo);
                    mma_3xtf32(sums[n], a_hi, a_lo, b_hi, b_lo);
                }
            }
#pragma unroll
            for (int half = 0; half < 2; ++half) {  // rows g and g + 8 of the tile
                const int r = 16 * m + g + 8 * half;
                if (r >= rows) continue;
                const int owner = r / r_own, rr = r - owner * r_own;
                const unsigned dst = remote(s.inbox + (rank * r_max + rr) * CLASS_STRIDE, owner);
                const unsigned bar = remote(s.inbox_full, owner);
#pragma unroll
                for (int n = 0; n < N_TILES; ++n) {  // classes j, j + 1: one 8-byte store
                    const int j = 8 * n + 2 * t;
                    const float v0 = total(sums[n], 2 * half), v1 = total(sums[n], 2 * half + 1);
                    if (j + 1 < CLASSES) send2(dst + 4 * j, v0, v1, bar);
                    else if (j < CLASSES) send(dst + 4 * j, v0, bar);
                }
            }
        }
        mbarrier_wait(s.inbox_full, step & 1);

        // ---- B: the owned rows: logits, softmax, dlogits to every block; one warp per row ------
        for (int rr = warp; rr < owned; rr += WARPS) {
            const int r = own_lo + rr, label = s.labels[cur * r_max + rr];
            float z = -__int_as_float(0x7f800000);  // −∞ on the lanes past the classes
            if (lane < CLASSES) {
                z = s.b[lane];
#pragma unroll
                for (int c = 0; c < CLUSTER; ++c) z += s.inbox[(c * r_max + rr) * CLASS_STRIDE + lane];
            }
            float m, sum;
            const float dl = warp_softmax_grad(z, lane < CLASSES, lane, label, rows, m, sum);
            // The row's dlogits to every block, as 16-byte stores: lane p takes block p % CLUSTER
            // and classes 4q..4q+3, q = p / CLUSTER (zeros past the classes).
            for (int base = 0; base < CLUSTER * QUADS; base += 32) {
                const int p = base + lane, q = min(p / CLUSTER, QUADS - 1);
                const float4 v = make_float4(__shfl_sync(0xffffffffu, dl, 4 * q), __shfl_sync(0xffffffffu, dl, 4 * q + 1),
                                             __shfl_sync(0xffffffffu, dl, 4 * q + 2), __shfl_sync(0xffffffffu, dl, 4 * q + 3));
                if (p < CLUSTER * QUADS)
                    send4(remote(s.dl + r * CLASS_PAD + 4 * q, p % CLUSTER), v, remote(s.dl_full, p % CLUSTER));
            }
            if (measure) {
                const float z_label = __shfl_sync(0xffffffffu, z, label);
                // The first index of the largest logit: the lowest lane holding m.
                const unsigned at_max = __ballot_sync(0xffffffffu, lane < CLASSES && z == m);
                if (lane == 0) {
                    loss_sum += (double)(logf(sum) + m - z_label);
                    correct_sum += (__ffs(at_max) - 1) == label ? 1.0 : 0.0;
                }
            }
        }
        // While the dlogits come in, queue the next step's copies (its tile and labels, and the
        // indices of the step after it).
        if (step + 1 < num_steps)
            fetch(images, labels, s.order + nxt * batch, step_rows(step + 1, batch, num_samples), rank,
                  s.x + nxt * rows16 * X_STRIDE, s.labels + nxt * r_max);
        if (step + 2 < num_steps)
            for (int r = tid; r < step_rows(step + 2, batch, num_samples); r += THREADS)
                copy4_async(s.order + cur * batch + r, order + (long long)(step + 2) * batch + r);
        async_commit();
        mbarrier_wait(s.dl_full, step & 1);

        // ---- C: this block's slice of W and its copy of b, from its copy of dlogits -----------
        // dW_sliceᵀ = xᵀ·dlogits: rows are the slice's features and then the bias (a feature
        // whose input is 1), k runs over the step's rows (past them, A is zero), a warp a tile.
        for (int tile = warp; tile < C_M_TILES * N_TILES; tile += WARPS) {
            const int m = tile / N_TILES, n = tile - m * N_TILES;
            const int f0 = 16 * m + g, f1 = f0 + 8;
            // A[f][r] = x[r][f] for a feature, 1 for the bias row, 0 past it.
            const float* x0 = x + min(f0, SLICE - 1);
            const float* x1 = x + min(f1, SLICE - 1);
            const float c0 = f0 == SLICE ? 1.0f : 0.0f, c1 = f1 == SLICE ? 1.0f : 0.0f;
            const bool in0 = f0 < SLICE, in1 = f1 < SLICE;
            const float* db = s.dl + t * CLASS_PAD + 8 * n + g;
            const auto k_step = [&](Sums3& d, int k) {
                const int r0 = (k + t) * X_STRIDE, r1 = r0 + 4 * X_STRIDE;
                const float a[4] = {in0 ? x0[r0] : c0, in1 ? x1[r0] : c1, in0 ? x0[r1] : c0, in1 ? x1[r1] : c1};
                const float b[2] = {db[k * CLASS_PAD], db[(k + 4) * CLASS_PAD]};
                unsigned a_hi[4], a_lo[4], b_hi[2], b_lo[2];
                split_tf32(a, a_hi, a_lo);
                split_tf32(b, b_hi, b_lo);
                mma_3xtf32(d, a_hi, a_lo, b_hi, b_lo);
            };
            Sums3 sums[2];  // even and odd k-steps: two chains of dependent mma, not one
#pragma unroll 2
            for (int k = 0; k < rows; k += 16) {
                k_step(sums[0], k);
                if (k + 8 < rows) k_step(sums[1], k + 8);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int f = i < 2 ? f0 : f1, j = 8 * n + 2 * t + (i & 1);
                const float grad = total(sums[0], i) + total(sums[1], i);
                if (j >= CLASSES) continue;
                if (f < SLICE) s.w[f * CLASS_PAD + j] -= lr * grad;
                else if (f == SLICE && bias) s.b[j] -= lr * grad;
            }
        }
        // The next step's first __syncthreads orders these updates before phase A reads them.
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
        if (lane == 0) { per_warp[2 * warp] = loss_sum; per_warp[2 * warp + 1] = correct_sum; }
        __syncthreads();
        if (tid == 0) {
            double l = 0.0, c = 0.0;
            for (int i = 0; i < WARPS; ++i) { l += per_warp[2 * i]; c += per_warp[2 * i + 1]; }
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
