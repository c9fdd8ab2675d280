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
// dlogits (rows × classes each) and waits at two cluster barriers. Every sum runs in a fixed
// order, without atomics: the same seed gives the same weights bit for bit. The next batch is
// copied in (cp.async) while the current one trains, and its sample indices one step before that,
// so no dependent global load sits on a step's path.
//
// Compile-time (from kernels/persistent.py): CLUSTER, THREADS, SLICE (a multiple of 4, < F_LANES),
// CLASSES (≤ 32), FEATURES. Images are float32 rows of CLUSTER·SLICE, zero past FEATURES (as W is
// there). Without a bias (bias = 0), b stays zero.

#define PADDED_FEATURES (CLUSTER * SLICE)
#define CLASS_STRIDE ((CLASSES + 3) / 4 * 4)  // floats per row of W slice, inbox and dlogits
#define A_SPLIT 4                    // phase A: lanes per row, each over SLICE / A_SPLIT features
#define F_LANES 64                   // phase C: lanes per row chunk, one per feature (and the bias)
#define C_PARTS (THREADS / F_LANES)  // phase C: row chunks, summed in order afterwards
#define CHUNKS_PER_ROW (SLICE / 4)   // 16-byte copies per row of a tile

#if SLICE % 4 != 0 || SLICE % A_SPLIT != 0 || SLICE >= F_LANES || CLASSES > 32 || THREADS % F_LANES != 0
#error "persistent.cu: unsupported SLICE / CLASSES / THREADS"
#endif

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r;
}
// Arrive (release: this block's writes, remote ones included, become visible) and wait (acquire).
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
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
__device__ __forceinline__ void async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// The dynamic shared memory, carved for a batch of `batch` rows. Keep in step with the
// launcher's byte count (kernels/persistent.py: shared_bytes).
struct Smem {
    double* totals;   // [2 + 2·THREADS/32]  block totals of loss and correct, then per warp
    float* w;         // [SLICE][CLASS_STRIDE]     this block's slice of W, feature-major
    float* b;         // [CLASS_STRIDE]            this block's copy of the bias
    float* x;         // [2][batch][SLICE]         this step's tile and the next one's
    float* inbox;     // [CLUSTER][r_max][CLASS_STRIDE]  partial logits of the owned rows, per block
    float* dl;        // [batch][CLASS_STRIDE]     dlogits, pushed by the rows' owners
    float* red;       // [C_PARTS][CLASSES][F_LANES]  phase C's per-chunk sums
    int* order;       // [2][batch]                sample indices of the next two steps
    int* labels;      // [2][r_max]                labels of the owned rows, this step and the next
};

__device__ __forceinline__ int owned_rows(int rows) { return (rows + CLUSTER - 1) / CLUSTER; }

__device__ Smem carve(unsigned char* base, int batch) {
    const int r_max = owned_rows(batch);
    Smem s;
    double* d = reinterpret_cast<double*>(base);
    s.totals = d; d += 2 + 2 * (THREADS / 32);
    float* f = reinterpret_cast<float*>(d);  // every region below starts 16-byte aligned
    s.w = f; f += SLICE * CLASS_STRIDE;
    s.b = f; f += CLASS_STRIDE;
    s.x = f; f += 2 * batch * SLICE;
    s.inbox = f; f += CLUSTER * r_max * CLASS_STRIDE;
    s.dl = f; f += batch * CLASS_STRIDE;
    s.red = f; f += C_PARTS * CLASSES * F_LANES;
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
        copy16_async(tile + r * SLICE + 4 * k, images + (long long)order[r] * PADDED_FEATURES + rank * SLICE + 4 * k);
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
    const int r_max = owned_rows(batch);

    for (int i = tid; i < SLICE * CLASS_STRIDE; i += THREADS) {
        const int f = i / CLASS_STRIDE, j = i - f * CLASS_STRIDE;
        s.w[i] = (j < CLASSES && col0 + f < FEATURES) ? w[j * FEATURES + col0 + f] : 0.0f;
    }
    if (tid < CLASS_STRIDE) s.b[tid] = bias && tid < CLASSES ? b[tid] : 0.0f;
    for (int step = 0; step < 2 && step < num_steps; ++step) {
        const int rows = step_rows(step, batch, num_samples);
        for (int r = tid; r < rows; r += THREADS) s.order[step * batch + r] = order[(long long)step * batch + r];
    }
    __syncthreads();
    fetch(images, labels, s.order, step_rows(0, batch, num_samples), rank, s.x, s.labels);
    async_commit();
    double loss_sum = 0.0, correct_sum = 0.0;  // kept by lane 0 of the warps of phase B

    for (int step = 0; step < num_steps; ++step) {
        const int rows = step_rows(step, batch, num_samples), r_own = owned_rows(rows);
        const int own_lo = min(rows, (int)rank * r_own), owned = min(rows, own_lo + r_own) - own_lo;
        const int cur = step & 1, nxt = cur ^ 1;
        const float* x = s.x + cur * batch * SLICE;

        async_wait_all();
        __syncthreads();  // this step's tile, labels and the next step's indices have landed
        if (step + 1 < num_steps)
            fetch(images, labels, s.order + nxt * batch, step_rows(step + 1, batch, num_samples), rank,
                  s.x + nxt * batch * SLICE, s.labels + nxt * r_max);
        if (step + 2 < num_steps)
            for (int r = tid; r < step_rows(step + 2, batch, num_samples); r += THREADS)
                copy4_async(s.order + cur * batch + r, order + (long long)(step + 2) * batch + r);
        async_commit();

        // ---- A: partial logits of this block's features, pushed to each row's owner ----------
        // A_SPLIT adjacent lanes share a row; whole warps take part, for the shuffles.
        for (int t = tid; t < (rows * A_SPLIT + 31) / 32 * 32; t += THREADS) {
            const int r = t / A_SPLIT, part = t - r * A_SPLIT;
            const bool valid = r < rows;
            float acc[CLASS_STRIDE];
#pragma unroll
            for (int j = 0; j < CLASS_STRIDE; ++j) acc[j] = 0.0f;
            if (valid) {
                const float* xr = x + r * SLICE + part * (SLICE / A_SPLIT);
                const float* wf = s.w + part * (SLICE / A_SPLIT) * CLASS_STRIDE;
#pragma unroll
                for (int f = 0; f < SLICE / A_SPLIT; ++f) {
                    const float xv = xr[f];
#pragma unroll
                    for (int q = 0; q < CLASS_STRIDE / 4; ++q) {
                        const float4 wv = reinterpret_cast<const float4*>(wf + f * CLASS_STRIDE)[q];
                        acc[4 * q] = fmaf(xv, wv.x, acc[4 * q]);
                        acc[4 * q + 1] = fmaf(xv, wv.y, acc[4 * q + 1]);
                        acc[4 * q + 2] = fmaf(xv, wv.z, acc[4 * q + 2]);
                        acc[4 * q + 3] = fmaf(xv, wv.w, acc[4 * q + 3]);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < CLASSES; ++j)
#pragma unroll
                for (int o = 1; o < A_SPLIT; o <<= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
            if (valid && part < 2) {  // two lanes push half the classes each
                const int owner = r / r_own, rr = r - owner * r_own;
                const unsigned dst = remote(s.inbox + (rank * r_max + rr) * CLASS_STRIDE, owner);
#pragma unroll
                for (int j = 0; j < CLASSES; ++j)
                    if ((j & 1) == part) store_remote(dst + 4 * j, acc[j]);
            }
        }
        cluster_sync();

        // ---- B: the owned rows: logits, softmax, dlogits to every block; one warp per row ------
        for (int rr = warp; rr < owned; rr += THREADS / 32) {
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
                for (int c = 0; c < CLUSTER; ++c) store_remote(remote(s.dl + r * CLASS_STRIDE + lane, c), dl);
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
        // Thread (part, f) sums a chunk of rows for every class; the lanes of a warp take
        // consecutive features of the same rows (conflict-free x, broadcast dlogits). Lane
        // f = SLICE sums dlogits alone: the bias is a feature whose input is 1.
        {
            const int f = tid % F_LANES, part = tid / F_LANES;
            const int chunk = (rows + C_PARTS - 1) / C_PARTS;
            const int r0 = min(rows, part * chunk), r1 = min(rows, r0 + chunk);
            if (f <= SLICE) {
                float acc[CLASS_STRIDE];
#pragma unroll
                for (int j = 0; j < CLASS_STRIDE; ++j) acc[j] = 0.0f;
                for (int r = r0; r < r1; ++r) {
                    const float xv = f < SLICE ? x[r * SLICE + f] : 1.0f;
#pragma unroll
                    for (int q = 0; q < CLASS_STRIDE / 4; ++q) {
                        const float4 d = reinterpret_cast<const float4*>(s.dl + r * CLASS_STRIDE)[q];
                        acc[4 * q] = fmaf(d.x, xv, acc[4 * q]);
                        acc[4 * q + 1] = fmaf(d.y, xv, acc[4 * q + 1]);
                        acc[4 * q + 2] = fmaf(d.z, xv, acc[4 * q + 2]);
                        acc[4 * q + 3] = fmaf(d.w, xv, acc[4 * q + 3]);
                    }
                }
#pragma unroll
                for (int j = 0; j < CLASSES; ++j) s.red[(part * CLASSES + j) * F_LANES + f] = acc[j];
            }
        }
        __syncthreads();
        for (int i = tid; i < CLASSES * F_LANES; i += THREADS) {
            const int j = i / F_LANES, f = i - j * F_LANES;
            if (f > SLICE) continue;
            float sum = 0.0f;
#pragma unroll
            for (int part = 0; part < C_PARTS; ++part) sum += s.red[(part * CLASSES + j) * F_LANES + f];
            if (f < SLICE) s.w[f * CLASS_STRIDE + j] -= lr * sum;
            else if (bias) s.b[j] -= lr * sum;
        }
        // The next step's first __syncthreads orders these updates before phase A reads them.
    }

    // ---- W slice and bias back to global memory; the metrics, summed over the cluster in order --
    __syncthreads();
    for (int i = tid; i < SLICE * CLASSES; i += THREADS) {
        const int f = i / CLASSES, j = i - f * CLASSES;
        if (col0 + f < FEATURES) w[j * FEATURES + col0 + f] = s.w[f * CLASS_STRIDE + j];
    }
    if (bias && rank == 0 && tid < CLASSES) b[tid] = s.b[tid];
    if (measure) {
        double* per_warp = s.totals + 2;
        if (lane == 0) { per_warp[2 * warp] = loss_sum; per_warp[2 * warp + 1] = correct_sum; }
        __syncthreads();
        if (tid == 0) {
            double l = 0.0, c = 0.0;
            for (int i = 0; i < THREADS / 32; ++i) { l += per_warp[2 * i]; c += per_warp[2 * i + 1]; }
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
