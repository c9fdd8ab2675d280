// The elementwise parts of a linear + ReLU layer, forward, backward and the SGD update.

// y[r, j] = act(y[r, j] + b[j]), act = ReLU when relu != 0 else identity; b may be null (no bias).
extern "C" __global__ void bias_relu(float* y, const float* b, int rows, int cols, int relu) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)rows * cols) return;
    float v = y[idx];
    if (b) v += b[idx % cols];
    if (relu) v = fmaxf(v, 0.0f);
    y[idx] = v;
}

// dh[i] *= (h[i] > 0): the ReLU's derivative, read off its output h = max(pre, 0).
extern "C" __global__ void relu_backward(float* dh, const float* h, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && h[i] <= 0.0f) dh[i] = 0.0f;
}

// db[j] = Σ_r dy[r, j]. One thread per column summing rows in order: no atomics, so the
// result is the same bit for bit on every run (the sum feeds the weights).
extern "C" __global__ void bias_grad(const float* dy, float* db, int rows, int cols) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    float acc = 0.0f;
    for (int r = 0; r < rows; ++r) acc += dy[(long long)r * cols + j];
    db[j] = acc;
}

// w[i] -= lr · dw[i]
extern "C" __global__ void sgd_update(float* w, const float* dw, float lr, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) w[i] -= lr * dw[i];
}
