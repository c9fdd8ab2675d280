// Loss and accuracy of a batch, reduced on the device by one block in a fixed tree order
// (deterministic, no atomics). One block of METRICS_THREADS threads (a power of two), which
// comes from metrics.py.

// Cross-entropy of row r from the logits, stable for any logit range:
//   loss_r = log Σ_j exp(z_j − m) + m − z_{y_r}
__device__ float row_loss(const float* z, int cols, int label) {
    float m = z[0];
    for (int j = 1; j < cols; ++j) m = fmaxf(m, z[j]);
    float sum = 0.0f;
    for (int j = 0; j < cols; ++j) sum += expf(z[j] - m);
    return logf(sum) + m - z[label];
}

// 1 when the first largest logit of the row is the label's.
__device__ int row_correct(const float* z, int cols, int label) {
    int best = 0;
    for (int j = 1; j < cols; ++j) if (z[j] > z[best]) best = j;
    return best == label;
}

// out[0] = Σ_t part[t] over the block, in a fixed order.
__device__ double block_sum(double v) {
    __shared__ double part[METRICS_THREADS];
    part[threadIdx.x] = v;
    __syncthreads();
    for (int s = METRICS_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    double total = part[0];
    __syncthreads();
    return total;
}

// total[0] (+)= Σ_r loss_r  (accumulate = 0 overwrites, 1 adds)
extern "C" __global__ void batch_loss(const float* logits, const int* y, int rows, int cols,
                                      double* total, int accumulate) {
    double acc = 0.0;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) acc += row_loss(logits + (long long)r * cols, cols, y[r]);
    double sum = block_sum(acc);
    if (threadIdx.x == 0) total[0] = accumulate ? total[0] + sum : sum;
}

// total[0] (+)= #{r : argmax_j z[r, j] = y[r]}
extern "C" __global__ void batch_correct(const float* logits, const int* y, int rows, int cols,
                                         double* total, int accumulate) {
    double acc = 0.0;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) acc += row_correct(logits + (long long)r * cols, cols, y[r]);
    double sum = block_sum(acc);
    if (threadIdx.x == 0) total[0] = accumulate ? total[0] + sum : sum;
}

// Both in one pass over the logits: totals[0] += Σ loss_r, totals[1] += #correct.
extern "C" __global__ void batch_metrics(const float* logits, const int* y, int rows, int cols, double* totals) {
    double loss = 0.0, correct = 0.0;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        const float* z = logits + (long long)r * cols;
        loss += row_loss(z, cols, y[r]);
        correct += row_correct(z, cols, y[r]);
    }
    double loss_sum = block_sum(loss);
    double correct_sum = block_sum(correct);
    if (threadIdx.x == 0) { totals[0] += loss_sum; totals[1] += correct_sum; }
}
