// The cnn's logits layer with its loss step, and the layer's gradients: products this narrow
// (HL_CLASSES outputs) leave cuBLAS's tiles idle, and five launches become two. fp32 FMAs;
// HL_CLASSES (≤ 32, compile time) and the block sizes come from head.py; the math of a row is
// logits_loss.cuh's, the batch's valid rows and this rank's slice batch_slice.cuh's (both put
// before this file by the launcher). For the batch's rows r < valid (the others get zero gradient):
//   z[r, j] = b[j] + Σ_c h[r, c]·W[j, c]
//   dlogits[r, j] = (softmax(z_r)_j − [j = y_r]) / valid,  loss_r = log Σ_j e^{z_j − m} + m − z_{y_r}
//   dW[j, c] = Σ_r dlogits[r, j]·h[r, c],  db[j] = Σ_r dlogits[r, j]
// then *cursor += valid and loss_sum[0] += Σ_r loss_r (unless null). Every sum runs in a fixed
// order (the warps' shuffles included), without float atomics: the same inputs give the same bits.
// Data-parallel over `ranks` GPUs (1: the one-GPU step), as cnn.cu's softmax_xent_step: `batch`
// is the combined batch, this rank holds its batch/ranks rows.
// Model axis (model_axis.cuh, put before this file by the launcher): every buffer of both kernels
// is per model, the count and the cursor included (each model counts its own blocks in its own
// int); blockIdx.z is the model, gridDim.x a model's own blocks.

// ---- logits and the loss step: a warp per row ---------------------------------------------------
// row_loss holds each row's loss (0 past valid); the last block to finish (an integer count,
// reset by that block) sums them in a fixed-order tree, moves the cursor and adds to loss_sum.
// Every block reads *cursor before it counts itself, so the cursor moves after every read.
extern "C" __global__ void __launch_bounds__(HL_ROW_THREADS) head_logits_loss(
        const float* __restrict__ h, const float* __restrict__ w, const float* __restrict__ b,
        const int* __restrict__ y, float* __restrict__ dlogits, double* __restrict__ row_loss, int* count,
        int* cursor, int batch, int k, int epoch_samples, double* loss_sum, int ranks, long long model_stride) {
    h = model_at(h, model_stride);
    w = model_at(w, model_stride);
    b = model_at(b, model_stride);
    y = model_at(y, model_stride);
    dlogits = model_at(dlogits, model_stride);
    row_loss = model_at(row_loss, model_stride);
    count = model_at(count, model_stride);
    cursor = model_at(cursor, model_stride);
    loss_sum = model_at(loss_sum, model_stride);
    __shared__ double tree[HL_ROW_THREADS];
    __shared__ bool last;
    const int lane = threadIdx.x & 31, r = blockIdx.x * (HL_ROW_THREADS / 32) + (threadIdx.x >> 5);
    const BatchSlice slice = batch_slice(*cursor, batch, epoch_samples, ranks);
    const int rows = slice.rows, mine = slice.mine;  // this rank's rows, and its real ones
    if (r < rows) {
        float acc[HL_CLASSES] = {};
        row_logit_partials(h + (long long)r * k, static_cast<float*>(nullptr), w, k, lane, acc);
        float z[HL_CLASSES];  // every lane holds the whole row
#pragma unroll
        for (int j = 0; j < HL_CLASSES; ++j) z[j] = warp_sum(acc[j]) + b[j];
        float m, sum;
        row_max_sum(z, HL_CLASSES, m, sum);
        const float rs = 1.0f / sum, inv = 1.0f / (float)slice.valid;
        const int label = r < mine ? y[r] : -1;
        float zl = z[0], zy = z[0];  // z[lane] and z[label], picked without indexing registers
#pragma unroll
        for (int j = 1; j < HL_CLASSES; ++j) {
            if (j == lane) zl = z[j];
            if (j == label) zy = z[j];
        }
        if (lane < HL_CLASSES)
            dlogits[(long long)r * HL_CLASSES + lane] = r < mine ? xent_dlogit(zl, m, rs, lane, label, inv) : 0.0f;
        if (lane == 0) row_loss[r] = r < mine ? (double)xent_loss(sum, m, zy) : 0.0;
    }
    __threadfence();  // this block's row losses are visible before it is counted
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(count, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    double total = 0.0;
    for (int i = threadIdx.x; i < rows; i += HL_ROW_THREADS) total += __ldcg(row_loss + i);  // past L1: other SMs wrote them
    tree[threadIdx.x] = total;
    __syncthreads();
    for (int s = HL_ROW_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) tree[threadIdx.x] += tree[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        *cursor = slice.next();
        if (loss_sum) loss_sum[0] += tree[0];
        *count = 0;
    }
}

// ---- the logits layer's gradients: a block per 32 columns --------------------------------------
// Column c < k of h, or c = k: the bias, a column of ones. Warp q sums the rows ≡ q (mod warps)
// in order, then warp 0 adds the warps' sums in order; dlogits staged in shared memory.
#define HL_COL_WARPS (HL_COL_THREADS / 32)
extern "C" __global__ void __launch_bounds__(HL_COL_THREADS) head_grads(
        const float* __restrict__ h, const float* __restrict__ dlogits, float* __restrict__ dw,
        float* __restrict__ db, int batch, int k, long long model_stride) {
    h = model_at(h, model_stride);
    dlogits = model_at(dlogits, model_stride);
    dw = model_at(dw, model_stride);
    db = model_at(db, model_stride);
    extern __shared__ float dl[];  // [batch][HL_CLASSES]
    __shared__ float part[HL_COL_WARPS][HL_CLASSES][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, c = blockIdx.x * 32 + lane;
    for (int i = threadIdx.x; i < batch * HL_CLASSES; i += HL_COL_THREADS) dl[i] = dlogits[i];
    __syncthreads();
    float acc[HL_CLASSES] = {};
    if (c <= k)
        for (int r0 = warp; r0 < batch; r0 += HL_COL_WARPS * 4) {
            float v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int r = r0 + u * HL_COL_WARPS;
                v[u] = r < batch ? (c < k ? h[(long long)r * k + c] : 1.0f) : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int r = r0 + u * HL_COL_WARPS;
                if (r >= batch) break;
#pragma unroll
                for (int j = 0; j < HL_CLASSES; ++j) acc[j] = fmaf(dl[r * HL_CLASSES + j], v[u], acc[j]);
            }
        }
#pragma unroll
    for (int j = 0; j < HL_CLASSES; ++j) part[warp][j][lane] = acc[j];
    __syncthreads();
    if (warp != 0 || c > k) return;
#pragma unroll
    for (int j = 0; j < HL_CLASSES; ++j) {
        float total = 0.0f;
        for (int q = 0; q < HL_COL_WARPS; ++q) total += part[q][j][lane];
        if (c < k) dw[j * k + c] = total;
        else db[j] = total;
    }
}
