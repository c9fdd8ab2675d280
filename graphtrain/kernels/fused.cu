// The fused rungs' own kernels: the whole loss step of a batch in one block, the batch gather
// in bf16, and the bias SGD with the refresh of the bf16 weight copies. LOSS_THREADS comes from
// kernels/fused.py; the classes fit one warp (≤ 32).
// bf16 values travel as their 16 bits; cvt.rn rounds to nearest even (sm_80 and later).
typedef unsigned short bf16;
__device__ __forceinline__ bf16 to_bf16(float v) {
    bf16 out; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out) : "f"(v)); return out;
}

extern "C" __device__ __attribute__((cudart_builtin)) void cudaGraphSetConditional(cudaGraphConditionalHandle handle, unsigned int value);

template <typename T> __device__ __forceinline__ T to(float v);
template <> __device__ __forceinline__ float to<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16 to<bf16>(float v) { return to_bf16(v); }

// One block does the whole loss step of a batch, one warp per row at a time (lane j = class j):
//   p = softmax(z_r),  dlogits[r, j] = (p_j − [j = y_r]) / rows          (written as T)
//   if b:        b[j] −= lr · Σ_r dlogits[r, j]   (the last layer's bias: its gradient is here)
//   if measure:  totals += (Σ_r loss_r, #correct)  with loss_r = log Σ_j e^{z_j − m} + m − z_{y_r}
//   then:        cursor += rows (the next batch), and, inside a device loop, one step fewer to go
// Sums run in a fixed order (per warp over its rows, then over warps): no atomics.
template <typename T>
__device__ void loss_step(const float* logits, const int* y, T* dlogits, float* b, float lr, int rows,
                          int classes, double* totals, int measure, int* cursor,
                          cudaGraphConditionalHandle loop, int* steps_left) {
    __shared__ float db_part[LOSS_THREADS / 32][32];
    __shared__ double loss_part[LOSS_THREADS / 32], correct_part[LOSS_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float db = 0.0f;
    double loss = 0.0, correct = 0.0;
    for (int r = warp; r < rows; r += LOSS_THREADS / 32) {
        const float z = lane < classes ? logits[(long long)r * classes + lane] : -__int_as_float(0x7f800000);
        const int label = y[r];
        float m = z;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        const float e = lane < classes ? expf(z - m) : 0.0f;
        float total = e;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
        if (lane < classes) {
            const float g = (e / total - (lane == label ? 1.0f : 0.0f)) / (float)rows;
            dlogits[(long long)r * classes + lane] = to<T>(g);
            db += g;
        }
        if (measure) {
            const float z_label = __shfl_sync(0xffffffffu, z, label);
            const unsigned at_max = __ballot_sync(0xffffffffu, lane < classes && z == m);
            loss += (double)(logf(total) + m - z_label);
            correct += (__ffs(at_max) - 1) == label ? 1.0 : 0.0;
        }
    }
    db_part[warp][lane] = db;
    if (lane == 0) { loss_part[warp] = loss; correct_part[warp] = correct; }
    __syncthreads();
    if (warp == 0) {
        if (b != nullptr && lane < classes) {
            float sum = 0.0f;
            for (int w = 0; w < LOSS_THREADS / 32; ++w) sum += db_part[w][lane];
            b[lane] -= lr * sum;
        }
        if (lane == 0) {
            if (measure) {
                double l = 0.0, c = 0.0;
                for (int w = 0; w < LOSS_THREADS / 32; ++w) { l += loss_part[w]; c += correct_part[w]; }
                totals[0] += l; totals[1] += c;
            }
            *cursor += rows;
            if (steps_left != nullptr) cudaGraphSetConditional(loop, --*steps_left > 0);
        }
    }
}

extern "C" __global__ void __launch_bounds__(LOSS_THREADS)
loss_step_f32(const float* logits, const int* y, float* dlogits, float* b, float lr, int rows, int classes,
              double* totals, int measure, int* cursor, cudaGraphConditionalHandle loop, int* steps_left) {
    loss_step<float>(logits, y, dlogits, b, lr, rows, classes, totals, measure, cursor, loop, steps_left);
}

extern "C" __global__ void __launch_bounds__(LOSS_THREADS)
loss_step_bf16(const float* logits, const int* y, bf16* dlogits, float* b, float lr, int rows, int classes,
               double* totals, int measure, int* cursor, cudaGraphConditionalHandle loop, int* steps_left) {
    loss_step<bf16>(logits, y, dlogits, b, lr, rows, classes, totals, measure, cursor, loop, steps_left);
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

// The end of a step: b[i] −= lr · db[i] over the hidden layers' biases (one packed span, the
// gradients written by the products' epilogues), then the bf16 copies the next forward pass reads:
// b16 = bf16(b) (when given) and w16 = bf16(w) over the packed span of every weight.
extern "C" __global__ void sgd_bias_refresh(float* b, const float* db, bf16* b16, long long n_bias,
                                            float lr, const float* w, bf16* w16, long long n_weights) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long i = start; i < n_bias; i += stride) {
        const float v = b[i] - lr * db[i];
        b[i] = v;
        if (b16 != nullptr) b16[i] = to_bf16(v);
    }
    for (long long i = start; i < n_weights; i += stride) w16[i] = to_bf16(w[i]);
}
