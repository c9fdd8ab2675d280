// `persistent`: softmax regression trained by one thread-block cluster; one launch runs an epoch.
//
// The cluster's CLUSTER blocks split the input features (padded to CLUSTER·SLICE) into slices:
// block c owns W[:, c·SLICE : (c+1)·SLICE] and the same columns of every batch. A step of `rows`
// samples, R = ⌈rows / CLUSTER⌉ of them owned by each block:
//
//   A  partial_c[r, j] = Σ_{f in slice c} x[r, f] · W[j, f]; each block pushes the partials of
//      rows r into the inbox of r's owner (distributed shared memory stores)
//      ── cluster barrier 1 ──
//   B  the owner of row r: z[r, j] = b[j] + Σ_{c = 0..CLUSTER-1} inbox[c][r, j] (in that order),
//      dlogits[r, j] = (softmax(z[r])_j − [j = y_r]) / rows, pushed to every block;
//      loss and accuracy when measured
//      ── cluster barrier 2 ──
//   C  every block, from its own copy of dlogits:  W[j, f] −= lr · Σ_r dlogits[r, j] · x[r, f]
//      on its slice, and b[j] −= lr · Σ_r dlogits[r, j] on its copy of b
//
// No block needs another's slice of W or of dW, so a step exchanges only the partial logits and
// dlogits (rows × classes each) and waits at two cluster barriers.
//
// The products of A and C run on tensor cores (mma.sync m16n8k8, TF32 inputs, fp32 sums) in
// three passes, which keeps fp32 accuracy: each operand is split as v = hi + lo, hi = tf32(v),
// lo = tf32(v − hi), and a·b ≈ hi_a·hi_b + (hi_a·lo_b + lo_a·hi_b), the dropped lo·lo term
// being ~2⁻²² of the product. On CUDA cores the two products were most of a step's
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
// Rows of W (per feature) and of dlogits (per sample): N_TILES·8 classes, the stride ≡ 8 or 24
// (mod 32 banks) so that a B fragment's lanes (k = lane % 4, n = lane / 4) hit 32 banks.
#define CLASS_PAD (N_TILES * 8 + (N_TILES % 2 == 0 ? 8 : 0))
#define X_STRIDE (SLICE + 4)        // floats per tile row: A fragments of phase A hit 32 banks
#define C_M_TILES ((SLICE + 1 + 15) / 16)  // phase C's rows: the slice's features, then the bias
#define CHUNKS_PER_ROW (SLICE / 4)  // 16-byte copies per row of a tile

#if SLICE % 8 != 0 || CLASSES > 32
#error "persistent.cu: unsupported SLICE / CLASSES"
#endif

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r;
}
// Arrive (release: this block's writes, remote ones included, become visible) and wait (acquire).
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() { cluster_arrive(); cluster_wait(); }
// `p`'s address in the shared memory of cluster block `rank`.
__device__ __forceinline__ unsigned remote(const void* p, unsigned rank) {
    unsigned out;
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(rank));
    return out;
}
__device__ __forceinline__ void store_remote(unsigned addr, float v) {
    asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(addr), "f"(v) : "memory");
}
__device__ __forceinline__ double load_remote_f64(unsigned addr) {
    double v; asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(addr) : "memory"); return v;
}
__device__ __forceinline__ void copy16_async(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void copy4_async(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}
// D += A·B for one m16n8k8 tile, TF32 inputs, fp32 D. Fragments (g = lane / 4, t = lane % 4):
// a = A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]; b = B[t][g], B[t+4][g];
// d = D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1].
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// v = hi + lo, each a TF32 value (fp32 bits, the low 13 mantissa bits zero).
__device__ __forceinline__ void split_tf32(float v, unsigned& hi, unsigned& lo) {
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(v));
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(v - __uint_as_float(hi)));
}
// The three-pass product of one tile: big += hi·hi, small += hi_a·lo_b + lo_a·hi_b (kept apart,
// so each sum's chain of dependent mma is one per k-step; the caller adds small to big last).
template <int A, int B>
__device__ __forceinline__ void mma_3xtf32(float (&big)[4], float (&small)[4], const float (&a)[A], const float (&b)[B]) {
    unsigned a_hi[4], a_lo[4], b_hi[2], b_lo[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) split_tf32(a[i], a_hi[i], a_lo[i]);
#pragma unroll
    for (int i = 0; i < 2; ++i) split_tf32(b[i], b_hi[i], b_lo[i]);
    mma_tf32(small, a_lo, b_hi);
    mma_tf32(small, a_hi, b_lo);
    mma_tf32(big, a_hi, b_hi);
}
__device__ __forceinline__ void async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// The dynamic shared memory, carved for a batch of `batch` rows. Keep in step with the
// launcher's byte count (kernels/persistent.py: shared_bytes).
struct Smem {
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
    double* d = reinterpret_cast<double*>(base);
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

__device__ __forceinline__ int step_rows(int step, int batch, int num_samples) {
    return min(batch, num_samples - step * batch);
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
    __syncthreads();
    fetch(images, labels, s.order, step_rows(0, batch, num_samples), rank, s.x, s.labels);
    async_commit();
    // No block may write into another's shared memory before every block of the cluster runs.
    cluster_sync();
    double loss_sum = 0.0, correct_sum = 0.0;  // kept by lane 0 of the warps of phase B

    for (int step = 0; step < num_steps; ++step) {
        const int rows = step_rows(step, batch, num_samples), r_own = owned_rows(rows);
        const int own_lo = min(rows, (int)rank * r_own), owned = min(rows, own_lo + r_own) - own_lo;
        const int cur = step & 1, nxt = cur ^ 1;
        const float* x = s.x + cur * rows16 * X_STRIDE;

        async_wait_all();
        __syncthreads();  // this step's tile, labels and the next step's indices have landed

        // ---- A: partial logits of this block's features, pushed to each row's owner ----------
        // P = x·W_sliceᵀ: warp w takes rows 16w.., all classes, k over the slice's features.
        for (int m = warp; m < (rows + 15) / 16; m += WARPS) {
            float big[N_TILES][4] = {}, small[N_TILES][4] = {};
            const float* xa = x + (16 * m + g) * X_STRIDE + t;
#pragma unroll
            for (int k = 0; k < SLICE; k += 8) {
                const float a[4] = {xa[k], xa[8 * X_STRIDE + k], xa[k + 4], xa[8 * X_STRIDE + k + 4]};
#pragma unroll
                for (int n = 0; n < N_TILES; ++n) {
                    const float* wb = s.w + (k + t) * CLASS_PAD + 8 * n + g;
                    const float b[2] = {wb[0], wb[4 * CLASS_PAD]};
                    mma_3xtf32(big[n], small[n], a, b);
                }
            }
#pragma unroll
            for (int half = 0; half < 2; ++half) {  // rows g and g + 8 of the tile
                const int r = 16 * m + g + 8 * half;
                if (r >= rows) continue;
                const int owner = r / r_own, rr = r - owner * r_own;
                const unsigned dst = remote(s.inbox + (rank * r_max + rr) * CLASS_STRIDE, owner);
#pragma unroll
                for (int n = 0; n < N_TILES; ++n) {
                    const int j = 8 * n + 2 * t;
                    if (j < CLASSES) store_remote(dst + 4 * j, big[n][2 * half] + small[n][2 * half]);
                    if (j + 1 < CLASSES) store_remote(dst + 4 * (j + 1), big[n][2 * half + 1] + small[n][2 * half + 1]);
                }
            }
        }
        // Barrier 1, split: while the other blocks finish their pushes, queue the next step's
        // copies (its tile and labels, and the indices of the step after it).
        cluster_arrive();
        if (step + 1 < num_steps)
            fetch(images, labels, s.order + nxt * batch, step_rows(step + 1, batch, num_samples), rank,
                  s.x + nxt * rows16 * X_STRIDE, s.labels + nxt * r_max);
        if (step + 2 < num_steps)
            for (int r = tid; r < step_rows(step + 2, batch, num_samples); r += THREADS)
                copy4_async(s.order + cur * batch + r, order + (long long)(step + 2) * batch + r);
        async_commit();
        cluster_wait();

        // ---- B: the owned rows: logits, softmax, dlogits to every block; one warp per row ------
        for (int rr = warp; rr < owned; rr += WARPS) {
            const int r = own_lo + rr, label = s.labels[cur * r_max + rr];
            float z = -__int_as_float(0x7f800000);  // −∞ on the lanes past the classes
            if (lane < CLASSES) {
                z = s.b[lane];
#pragma unroll
                for (int c = 0; c < CLUSTER; ++c) z += s.inbox[(c * r_max + rr) * CLASS_STRIDE + lane];
            }
            float m = z;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
            const float e = lane < CLASSES ? expf(z - m) : 0.0f;
            float total = e;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
            if (lane < CLASSES) {
                const float dl = (e / total - (lane == label ? 1.0f : 0.0f)) / (float)rows;
#pragma unroll
                for (int c = 0; c < CLUSTER; ++c) store_remote(remote(s.dl + r * CLASS_PAD + lane, c), dl);
            }
            if (measure) {
                const float z_label = __shfl_sync(0xffffffffu, z, label);
                // The first index of the largest logit: the lowest lane holding m.
                const unsigned at_max = __ballot_sync(0xffffffffu, lane < CLASSES && z == m);
                if (lane == 0) {
                    loss_sum += (double)(logf(total) + m - z_label);
                    correct_sum += (__ffs(at_max) - 1) == label ? 1.0 : 0.0;
                }
            }
        }
        cluster_sync();

        // ---- C: this block's slice of W and its copy of b, from its copy of dlogits -----------
        // dW_sliceᵀ = xᵀ·dlogits: rows are the slice's features and then the bias (a feature
        // whose input is 1), k runs over the step's rows (past them, A is zero), a warp a tile.
        for (int tile = warp; tile < C_M_TILES * N_TILES; tile += WARPS) {
            const int m = tile / N_TILES, n = tile - m * N_TILES;
            const int f0 = 16 * m + g, f1 = f0 + 8;
            const auto xt = [&](int f, int r) {  // A[f][r]
                return r >= rows ? 0.0f : f < SLICE ? x[r * X_STRIDE + f] : f == SLICE ? 1.0f : 0.0f;
            };
            float big[4] = {}, small[4] = {};
            for (int k = 0; k < rows; k += 8) {
                const int r0 = k + t, r1 = r0 + 4;
                const float a[4] = {xt(f0, r0), xt(f1, r0), xt(f0, r1), xt(f1, r1)};
                const float b[2] = {s.dl[r0 * CLASS_PAD + 8 * n + g], s.dl[r1 * CLASS_PAD + 8 * n + g]};
                mma_3xtf32(big, small, a, b);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int f = i < 2 ? f0 : f1, j = 8 * n + 2 * t + (i & 1);
                const float grad = big[i] + small[i];
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
