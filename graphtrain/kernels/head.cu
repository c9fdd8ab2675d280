// The cnn's logits layer, its loss step and the layer's gradients in one block: products this
// narrow (HL_CLASSES outputs) leave cuBLAS's tiles idle, and three launches and two reads of the
// dlogits become one. fp32 FMAs; HL_CLASSES (≤ 32, compile time) and HL_THREADS come from
// head.py. For the batch's rows r < valid (valid = min(batch, epoch_samples − *cursor mod
// epoch_samples), the tail batch's real rows; the others get zero gradient):
//   z[r, j] = b[j] + Σ_c h[r, c]·W[j, c]                                  (a warp per row)
//   dlogits[r, j] = (softmax(z_r)_j − [j = y_r]) / valid,  loss_r = log Σ_j e^{z_j − m} + m − z_{y_r}
//   dW[j, c] = Σ_r dlogits[r, j]·h[r, c],  db[j] = Σ_r dlogits[r, j]      (rows in order)
// then *cursor += valid and loss_sum[0] += Σ_r loss_r (unless null). Every sum runs in a fixed
// order (the warps' shuffles included): the same inputs give the same bits.

#define HL_WARPS (HL_THREADS / 32)
#define HL_SLICES 4  // row slices of the weight gradient: thread (column, slice) sums rows ≡ slice (mod 4)

extern "C" __global__ void __launch_bounds__(HL_THREADS) head_loss_step(
        const float* __restrict__ h, const float* __restrict__ w, const float* __restrict__ b,
        const int* __restrict__ y, float* __restrict__ dlogits, float* __restrict__ dw, float* __restrict__ db,
        int* cursor, int batch, int k, int epoch_samples, double* loss_sum) {
    extern __shared__ float smem[];
    float* dl = smem;                       // [batch][HL_CLASSES]
    float* part = dl + batch * HL_CLASSES;  // [HL_SLICES][k + 1][HL_CLASSES]
    float* ws = part + HL_SLICES * (k + 1) * HL_CLASSES;  // W, read by every row
    __shared__ double row_loss[HL_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll 4
    for (int i = threadIdx.x; i < HL_CLASSES * k; i += HL_THREADS) ws[i] = w[i];
    __syncthreads();
    const int at = *cursor;
    const int valid = min(batch, epoch_samples - at % epoch_samples);
    const float inv = 1.0f / (float)valid;
    double loss = 0.0;
    for (int r = warp; r < batch; r += HL_WARPS) {
        float acc[HL_CLASSES] = {};
        const float* hr = h + (long long)r * k;
        for (int c0 = lane; c0 < k; c0 += 32 * 8) {  // eight loads issued before any is used
            float v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) v[u] = c0 + 32 * u < k ? hr[c0 + 32 * u] : 0.0f;
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int c = c0 + 32 * u;
                if (c >= k) break;
#pragma unroll
                for (int j = 0; j < HL_CLASSES; ++j) acc[j] = fmaf(v[u], ws[j * k + c], acc[j]);
            }
        }
        float z[HL_CLASSES];
#pragma unroll
        for (int j = 0; j < HL_CLASSES; ++j) {  // every lane ends with the same sum (a butterfly)
            float s = acc[j];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
            z[j] = s + b[j];
        }
        float m = z[0];
#pragma unroll
        for (int j = 1; j < HL_CLASSES; ++j) m = fmaxf(m, z[j]);
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < HL_CLASSES; ++j) sum += expf(z[j] - m);
        const float rs = 1.0f / sum;
        const int label = r < valid ? y[r] : 0;
        if (lane < HL_CLASSES) {
            float zl = z[0];
#pragma unroll
            for (int j = 1; j < HL_CLASSES; ++j) if (j == lane) zl = z[j];
            const float g = r < valid ? (expf(zl - m) * rs - (lane == label ? 1.0f : 0.0f)) * inv : 0.0f;
            dl[r * HL_CLASSES + lane] = g;
            dlogits[(long long)r * HL_CLASSES + lane] = g;
        }
        if (lane == 0 && r < valid) {
            float zy = z[0];
#pragma unroll
            for (int j = 1; j < HL_CLASSES; ++j) if (j == label) zy = z[j];
            loss += (double)(logf(sum) + m - zy);
        }
    }
    if (lane == 0) row_loss[warp] = loss;
    __syncthreads();  // dl complete; every thread has read *cursor
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int i = 0; i < HL_WARPS; ++i) total += row_loss[i];
        *cursor = at + valid;
        if (loss_sum) loss_sum[0] += total;
    }
    // Column c < k of h, or c = k: the bias, a column of ones.
    for (int task = threadIdx.x; task < (k + 1) * HL_SLICES; task += HL_THREADS) {
        const int c = task % (k + 1), slice = task / (k + 1);
        float acc[HL_CLASSES] = {};
        for (int r0 = slice; r0 < batch; r0 += HL_SLICES * 8) {
            float v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int r = r0 + u * HL_SLICES;
                v[u] = r < batch ? (c < k ? h[(long long)r * k + c] : 1.0f) : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int r = r0 + u * HL_SLICES;
                if (r >= batch) break;
#pragma unroll
                for (int j = 0; j < HL_CLASSES; ++j) acc[j] = fmaf(dl[r * HL_CLASSES + j], v[u], acc[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < HL_CLASSES; ++j) part[(slice * (k + 1) + c) * HL_CLASSES + j] = acc[j];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < (k + 1) * HL_CLASSES; idx += HL_THREADS) {
        const int c = idx / HL_CLASSES, j = idx % HL_CLASSES;
        float total = 0.0f;
        for (int slice = 0; slice < HL_SLICES; ++slice) total += part[(slice * (k + 1) + c) * HL_CLASSES + j];
        if (c < k) dw[j * k + c] = total;
        else db[j] = total;
    }
}
