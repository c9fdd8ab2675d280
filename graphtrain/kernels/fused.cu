// The fused rungs' own kernels: the model's head (the logits layer, at most 32 classes wide) with
// the loss step, the backward pass through it, the ReLU's derivative with the bias gradient, the
// bf16 batch gather, and the end of a step. Products this narrow (N or K = classes) leave the
// tensor cores and cuBLAS's tiles idle; one pass of plain FMAs is faster and fuses what surrounds
// them. CLASSES (compile time, ≤ 32), BF16 and the block sizes come from kernels/fused.py; the
// math of the logits layer and its loss step is logits_loss.cuh's (put before this file by the
// launcher). Every sum runs in a fixed order, without atomics: the same seed gives the same
// weights bit for bit.

// bf16 values travel as their 16 bits; cvt.rn rounds to nearest even (sm_80 and later).
typedef unsigned short bf16;
__device__ __forceinline__ bf16 to_bf16(float v) {
    bf16 out; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out) : "f"(v)); return out;
}

// floatX: the hidden activations' and their gradients' element type, one per build (BF16): bf16 on
// the bf16 rung, else fp32. The head's weights, logits, dlogits and sums are fp32 either way.
#if BF16
typedef bf16 floatX;
__device__ __forceinline__ floatX to_floatX(float v) { return to_bf16(v); }
#else
typedef float floatX;
__device__ __forceinline__ floatX to_floatX(float v) { return v; }
#endif

// dst[0:n] = src[0:n] by the whole block, 16 bytes a copy and eight copies in flight per thread.
template <int THREADS>
__device__ __forceinline__ void copy_to_shared(float4* dst, const float* __restrict__ src, int n) {
    const float4* src4 = reinterpret_cast<const float4*>(src);
#pragma unroll 8
    for (int i = threadIdx.x; i < n / 4; i += THREADS) dst[i] = src4[i];
    float* tail = reinterpret_cast<float*>(dst);
    for (int i = n / 4 * 4 + threadIdx.x; i < n; i += THREADS) tail[i] = src[i];
}

// ---- head: logits and the loss step, one warp per row ------------------------------------------
// z[r], dlogits[r] (divided by rows), row_loss[r] and row_correct[r] (when row_loss is given) as
// logits_loss.cuh says, a class per lane: lane j ends with z_j. The row is x[r], or, when `order`
// is given, gathered here: x[r] = images[order[*cursor + r]], with y[r] from `labels`, and the
// rows kept in x_copy (fp32) for the weight update. W (CLASSES × k fp32, the master
// weights) is read by every row: when the launcher gives shared memory for it (CLASSES·k floats),
// the block copies it there first.
__device__ void head_step_body(const floatX* __restrict__ x, const float* __restrict__ images, const int* labels,
                               const int* order, const int* cursor, float* __restrict__ x_copy, int* y,
                               const float* __restrict__ w_global, const float* b, int k, int rows,
                               float* __restrict__ dlogits, float* row_loss, float* row_correct, int w_shared) {
    extern __shared__ float4 w_smem4[];
    const float* w = w_global;
    if (w_shared) {  // float4 copies, many in flight (W's rows are 16-byte aligned when k % 4 == 0)
        copy_to_shared<HEAD_THREADS>(w_smem4, w_global, CLASSES * k);
        __syncthreads();
        w = reinterpret_cast<const float*>(w_smem4);
    }
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (HEAD_THREADS / 32) + (threadIdx.x >> 5);
    if (r >= rows) return;  // whole warps leave together
    float acc[CLASSES];
#pragma unroll
    for (int j = 0; j < CLASSES; ++j) acc[j] = 0.0f;
    int label;
    if (order != nullptr) {
        const int sample = order[*cursor + r];
        label = labels[sample];
        if (lane == 0) y[r] = label;
        row_logit_partials(images + (long long)sample * k, x_copy + (long long)r * k, w, k, lane, acc);
    } else {
        label = y[r];
        row_logit_partials(x + (long long)r * k, static_cast<float*>(nullptr), w, k, lane, acc);
    }
    float z = -__int_as_float(0x7f800000);  // lane j keeps z_j; −∞ past the classes
#pragma unroll
    for (int j = 0; j < CLASSES; ++j) {
        const float s = warp_sum(acc[j]);
        if (lane == j) z = s + (b != nullptr ? b[j] : 0.0f);
    }
    float m, total;
    const float dl = warp_softmax_grad(z, lane < CLASSES, lane, label, rows, m, total);
    if (lane < CLASSES) dlogits[(long long)r * CLASSES + lane] = dl;
    if (row_loss != nullptr) {
        unsigned at_max;
        const float z_label = warp_label_logit(z, lane < CLASSES, 0, label, m, at_max);
        if (lane == 0) {
            row_loss[r] = xent_loss(total, m, z_label);
            row_correct[r] = first_max_is(at_max, label) ? 1.0f : 0.0f;
        }
    }
}

// The kernels below work on columns: a block of COL_THREADS takes 32 consecutive columns (its
// lanes) and its COL_WARPS warps split the rows (warp w: rows w, w + COL_WARPS, ...), so loads are coalesced and
// many rows are in flight; the warps' partial sums meet in shared memory, added in warp order.
#define COL_WARPS (COL_THREADS / 32)

// Σ over the block's warps of v (one value per lane), in warp order; valid in warp 0.
__device__ __forceinline__ float sum_over_warps(float v, float (*part)[32]) {
    part[threadIdx.x >> 5][threadIdx.x & 31] = v;
    __syncthreads();
    float total = 0.0f;
    if ((threadIdx.x >> 5) == 0)
        for (int w = 0; w < COL_WARPS; ++w) total += part[w][threadIdx.x];
    return total;
}

// ---- the head's update: W and b of the logits layer, the metrics, the cursor --------------------
// Blocks over the columns: W[j, c] −= lr · Σ_r dlogits[r, j] · x[r, c] for every class j.
// The last block: b[j] −= lr · Σ_r dlogits[r, j]; totals += (Σ_r row_loss, Σ_r row_correct) when
// measured; cursor += rows (every reader of the cursor ran before this kernel). With `gradient`
// the sums are stored instead, W[j, c] = Σ_r dlogits[r, j]·x[r, c] and b[j] = Σ_r dlogits[r, j]
// (w and b then point at the gradients), for an optimizer that updates every parameter after.
__device__ void head_update_body(const floatX* __restrict__ x, const float* __restrict__ dlogits,
                                 float* __restrict__ w, float* __restrict__ b, int k, int rows, float lr, int gradient,
                                 const float* __restrict__ row_loss, const float* __restrict__ row_correct,
                                 double* totals, int* cursor) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (blockIdx.x < gridDim.x - 1) {
        __shared__ float part[COL_WARPS][32];
        extern __shared__ float4 dl_smem4[];  // dlogits, read by every column
        copy_to_shared<COL_THREADS>(dl_smem4, dlogits, rows * CLASSES);
        __syncthreads();
        const float* dl = reinterpret_cast<const float*>(dl_smem4);
        const int c = blockIdx.x * 32 + lane;
        float acc[CLASSES];
#pragma unroll
        for (int j = 0; j < CLASSES; ++j) acc[j] = 0.0f;
        if (c < k) {
#pragma unroll 8
            for (int r = warp; r < rows; r += COL_WARPS) {
                const float v = to_float(x[(long long)r * k + c]);
#pragma unroll
                for (int j = 0; j < CLASSES; ++j) acc[j] = fmaf(dl[r * CLASSES + j], v, acc[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < CLASSES; ++j) {
            const float total = sum_over_warps(acc[j], part);
            if (warp == 0 && c < k) {
                if (gradient) w[j * k + c] = total;  // dW, for the optimizer
                else w[j * k + c] -= lr * total;
            }
            __syncthreads();  // part is reused by the next class
        }
        return;
    }
    // Warp per class: lanes stride over the rows, then a butterfly in fixed order.
    if (b != nullptr) {
        for (int j = warp; j < CLASSES; j += COL_WARPS) {
            float db = 0.0f;
            for (int r = lane; r < rows; r += 32) db += dlogits[r * CLASSES + j];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) db += __shfl_xor_sync(0xffffffffu, db, o);
            if (lane == 0) b[j] = gradient ? db : b[j] - lr * db;
        }
    }
    if (warp == COL_WARPS - 1) {
        if (row_loss != nullptr) {
            double loss = 0.0, correct = 0.0;
            for (int r = lane; r < rows; r += 32) { loss += row_loss[r]; correct += row_correct[r]; }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                loss += __shfl_xor_sync(0xffffffffu, loss, o);
                correct += __shfl_xor_sync(0xffffffffu, correct, o);
            }
            if (lane == 0) { totals[0] += loss; totals[1] += correct; }
        }
        if (lane == 0) *cursor += rows;
    }
}

// ---- backward into the top hidden layer: a product with K = classes, fused with the ReLU -------
// dh[r, c] = [h[r, c] > 0] · Σ_j dlogits[r, j] · W[j, c], and (db given) db[c] = Σ_r dh[r, c]:
// the bias gradient of the layer that made h, summed from the values as stored.
__device__ void head_backward_body(const float* __restrict__ dlogits, const float* __restrict__ w,
                                   const floatX* __restrict__ h, floatX* __restrict__ dh, float* __restrict__ db,
                                   int k, int rows) {
    __shared__ float part[COL_WARPS][32];
    extern __shared__ float4 dl_smem4[];  // dlogits, read by every column
    copy_to_shared<COL_THREADS>(dl_smem4, dlogits, rows * CLASSES);
    __syncthreads();
    const float* dl = reinterpret_cast<const float*>(dl_smem4);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, c = blockIdx.x * 32 + lane;
    float sum = 0.0f;
    if (c < k) {
        float wc[CLASSES];
#pragma unroll
        for (int j = 0; j < CLASSES; ++j) wc[j] = w[j * k + c];
#pragma unroll 8
        for (int r = warp; r < rows; r += COL_WARPS) {
            const long long i = (long long)r * k + c;
            float g = 0.0f;
#pragma unroll
            for (int j = 0; j < CLASSES; ++j) g = fmaf(dl[r * CLASSES + j], wc[j], g);
            if (!(to_float(h[i]) > 0.0f)) g = 0.0f;
            const floatX stored = to_floatX(g);
            dh[i] = stored;
            sum += to_float(stored);
        }
    }
    const float total = sum_over_warps(sum, part);
    if (warp == 0 && c < k && db != nullptr) db[c] = total;
}

// ---- the ReLU's derivative and the bias gradient after a dX product ----------------------------
// dh[r, c] = 0 where h[r, c] ≤ 0 (in place), and (db given) db[c] = Σ_r dh[r, c].
__device__ void relu_bias_grad_body(const floatX* __restrict__ h, floatX* __restrict__ dh, float* __restrict__ db,
                                    int k, int rows) {
    __shared__ float part[COL_WARPS][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, c = blockIdx.x * 32 + lane;
    float sum = 0.0f;
    if (c < k) {
#pragma unroll 8
        for (int r = warp; r < rows; r += COL_WARPS) {
            const long long i = (long long)r * k + c;
            if (!(to_float(h[i]) > 0.0f)) dh[i] = to_floatX(0.0f);
            else sum += to_float(dh[i]);
        }
    }
    const float total = sum_over_warps(sum, part);
    if (warp == 0 && c < k && db != nullptr) db[c] = total;
}

// ---- the kernels: each hands its arguments to its body above ----------------------------------
// The bodies take the pointers as __restrict__, the kernels plainly: a kernel's own __restrict__
// parameters would let the compiler read more of them through the read-only cache, another build
// than the one measured. head_backward and relu_bias_grad have the model axis (model_axis.cuh, put
// before this file by the launcher): every buffer per model, blockIdx.z the model, gridDim.x a
// model's own blocks.
extern "C" __global__ void __launch_bounds__(HEAD_THREADS) head_step(
        const floatX* x, const float* images, const int* labels, const int* order, const int* cursor, float* x_copy,
        int* y, const float* w, const float* b, int k, int rows, float* dlogits, float* row_loss, float* row_correct,
        int w_shared) {
    head_step_body(x, images, labels, order, cursor, x_copy, y, w, b, k, rows, dlogits, row_loss, row_correct,
                   w_shared);
}
extern "C" __global__ void __launch_bounds__(COL_THREADS) head_update(
        const floatX* x, const float* dlogits, float* w, float* b, int k, int rows, float lr, int gradient,
        const float* row_loss, const float* row_correct, double* totals, int* cursor) {
    head_update_body(x, dlogits, w, b, k, rows, lr, gradient, row_loss, row_correct, totals, cursor);
}
extern "C" __global__ void __launch_bounds__(COL_THREADS) head_backward(
        const float* dlogits, const float* w, const floatX* h, floatX* dh, float* db, int k, int rows,
        long long model_stride) {
    const long long at = model_offset(model_stride);  // model_at's step without its integer detour
    head_backward_body(step_bytes(dlogits, at), step_bytes(w, at), step_bytes(h, at), step_bytes(dh, at),
                       db ? step_bytes(db, at) : db, k, rows);
}
extern "C" __global__ void __launch_bounds__(COL_THREADS) relu_bias_grad(const floatX* h, floatX* dh, float* db, int k,
                                                                       int rows, long long model_stride) {
    const long long at = model_offset(model_stride);
    relu_bias_grad_body(step_bytes(h, at), step_bytes(dh, at), db ? step_bytes(db, at) : db, k, rows);
}

// x[r, :] = bf16(images[order[*cursor + r], :]), y[r] = labels[order[*cursor + r]]; one block per row.
extern "C" __global__ void gather_batch_bf16(const float* images, const int* labels, const int* order,
                                             const int* cursor, int features, bf16* x, int* y) {
    const int r = blockIdx.x, sample = order[*cursor + r];
    const float* src = images + (long long)sample * features;
    bf16* dst = x + (long long)r * features;
    for (int j = threadIdx.x; j < features; j += blockDim.x) dst[j] = to_bf16(src[j]);
    if (threadIdx.x == 0) y[r] = labels[sample];
}

// The end of a step: b[i] −= lr · db[i] over the hidden layers' biases (one packed span), then
// the bf16 copies the next forward pass reads: b16 = bf16(b) (when given) and w16 = bf16(w) over
// the packed span of the hidden layers' weights, four at a time (spans start 256-byte aligned).
extern "C" __global__ void sgd_bias_refresh(float* b, const float* db, bf16* b16, long long n_bias, float lr,
                                            const float* w, bf16* w16, long long n_weights) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long i = start; i < n_bias; i += stride) {
        const float v = b[i] - lr * db[i];
        b[i] = v;
        if (b16 != nullptr) b16[i] = to_bf16(v);
    }
    const float4* w4 = reinterpret_cast<const float4*>(w);
    uint2* w16x4 = reinterpret_cast<uint2*>(w16);
    for (long long i = start; i < n_weights / 4; i += stride) {
        const float4 v = w4[i];
        w16x4[i] = make_uint2(to_bf16(v.x) | ((unsigned)to_bf16(v.y) << 16), to_bf16(v.z) | ((unsigned)to_bf16(v.w) << 16));
    }
    for (long long i = n_weights / 4 * 4 + start; i < n_weights; i += stride) w16[i] = to_bf16(w[i]);
}
