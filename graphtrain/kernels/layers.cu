// The elementwise parts of a linear + ReLU layer, forward, backward and the SGD update.
// bias_relu and bias_grad have the model axis (model_axis.cuh, put before this file by the
// launcher): every buffer per model, blockIdx.z the model, the grid's x a model's own.

// y[r, j] = act(y[r, j] + b[j]), act = ReLU when relu != 0 else identity; b may be null (no bias).
extern "C" __global__ void bias_relu(float* y, const float* b, int rows, int cols, int relu, long long model_stride) {
    y = model_at(y, model_stride);
    b = model_at(b, model_stride);
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

// db[j] = Σ_r dy[r, j]. One block per column j: each thread sums a strided slice of the rows,
// then the block adds the partial sums in a fixed tree order. No atomics, so the result is the
// same bit for bit on every run (the sum feeds the weights). BIAS_GRAD_THREADS (a power of two,
// the block size) comes from layers.py.
extern "C" __global__ void bias_grad(const float* dy, float* db, int rows, int cols, long long model_stride) {
    dy = model_at(dy, model_stride);
    db = model_at(db, model_stride);
    __shared__ float part[BIAS_GRAD_THREADS];
    int j = blockIdx.x;
    float acc = 0.0f;
    for (int r = threadIdx.x; r < rows; r += BIAS_GRAD_THREADS) acc += dy[(long long)r * cols + j];
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = BIAS_GRAD_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) db[j] = part[0];
}

// w[i] -= lr · dw[i]
extern "C" __global__ void sgd_update(float* w, const float* dw, float lr, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) w[i] -= lr * dw[i];
}
