// Softmax and the cross-entropy gradient, one thread per row (the classes are few).

// probs[r, :] = exp(logits[r, :] − m) / Σ_j exp(logits[r, j] − m),  m = max_j logits[r, j]
extern "C" __global__ void softmax_rows(const float* logits, float* probs, int rows, int cols) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* z = logits + (long long)r * cols;
    float* p = probs + (long long)r * cols;
    float m = z[0];
    for (int j = 1; j < cols; ++j) m = fmaxf(m, z[j]);
    float sum = 0.0f;
    for (int j = 0; j < cols; ++j) { p[j] = expf(z[j] - m); sum += p[j]; }
    float inv = 1.0f / sum;
    for (int j = 0; j < cols; ++j) p[j] *= inv;
}

// dlogits[r, j] = (probs[r, j] − [j = y[r]]) / rows: the gradient of the batch-mean
// cross-entropy, scaled by the batch's real size (the tail batch is smaller).
extern "C" __global__ void xent_grad(const float* probs, const int* y, float* dlogits, int rows, int cols) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * cols) return;
    int r = idx / cols, j = idx % cols;
    dlogits[idx] = (probs[idx] - (j == y[r] ? 1.0f : 0.0f)) / (float)rows;
}
