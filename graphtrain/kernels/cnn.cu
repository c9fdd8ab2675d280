// The convolutional model's own kernels, around cuDNN's convolutions: bias + max-pool + ReLU in
// one pass, its backward pass, the conv bias gradient, the loss step of a batch whose valid rows
// are known only on the device (logits_loss.cuh's math, batch_slice.cuh's rows: put before this
// file by the launcher), and the count of correct test predictions.
//
// Layout: fp32, each tensor NCHW or NHWC as its flag says. A pool window is P×P with stride P; rows and columns past the last whole
// window are dropped (PyTorch's MaxPool2d without padding). Each pooled value remembers which
// of its window's P² inputs was the (first) largest in a byte, or RELU_OFF when the ReLU after
// the pool zeroed it: the backward pass then needs neither the conv output nor the activation.
// Every sum that feeds the weights runs in a fixed order, without atomics.
// softmax_xent_step and count_correct have the model axis (model_axis.cuh, put before this file by
// the launcher): blockIdx.z is the model, the grid's x a model's own; which buffers are per model
// each says.

#define RELU_OFF 255

// Where element (n, c, y, x) of an N×C×H×W tensor lies: NCHW, or NHWC (channels innermost, the
// layout cuDNN's tensor-core convolutions read and write without transposing).
__device__ __forceinline__ long long at4(int n, int c, int y, int x, int C, int H, int W, int nhwc) {
    return nhwc ? (((long long)n * H + y) * W + x) * C + c : (((long long)n * C + c) * H + y) * W + x;
}
// The inverse for the pooled tensors' thread mapping: element `idx` in the given layout.
__device__ __forceinline__ void coords4(long long idx, int C, int H, int W, int nhwc, int& n, int& c, int& y, int& x) {
    if (nhwc) { c = idx % C; idx /= C; x = idx % W; idx /= W; y = idx % H; n = idx / H; }
    else { x = idx % W; idx /= W; y = idx % H; idx /= H; c = idx % C; n = idx / C; }
}

// a[n, c, i, j] = ReLU(max_{u,v < P} conv[n, c, i·P + u, j·P + v] + b[c]);  arg = argmax (u·P + v).
// max(x) + b = max(x + b), and ReLU commutes with max: this is conv → +b → pool → ReLU.
// conv in layout in_nhwc, a and arg in out_nhwc; one thread per pooled value, in a's order.
extern "C" __global__ void pool_bias_relu(const float* __restrict__ conv, const float* __restrict__ bias,
                                          float* __restrict__ out, unsigned char* __restrict__ arg,
                                          int n, int c, int h, int w, int p, int in_nhwc, int out_nhwc) {
    const int ho = h / p, wo = w / p;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * c * ho * wo) return;
    int s, ch, i, j;
    coords4(idx, c, ho, wo, out_nhwc, s, ch, i, j);
    float best = conv[at4(s, ch, i * p, j * p, c, h, w, in_nhwc)];
    int where = 0;
    for (int u = 0; u < p; ++u)
        for (int v = 0; v < p; ++v) {
            float x = conv[at4(s, ch, i * p + u, j * p + v, c, h, w, in_nhwc)];
            if (x > best) { best = x; where = u * p + v; }
        }
    float y = best + bias[ch];
    out[idx] = y > 0.0f ? y : 0.0f;
    arg[idx] = y > 0.0f ? (unsigned char)where : (unsigned char)RELU_OFF;
}

// dconv[n, c, y, x] = dout[n, c, y/P, x/P] where (y, x) is that window's recorded maximum and the
// ReLU passed it, else 0. One thread per conv element, in dconv's layout (conv_nhwc): every
// element is written, coalesced. dout and arg are in layout out_nhwc.
extern "C" __global__ void pool_relu_backward(const float* __restrict__ dout, const unsigned char* __restrict__ arg,
                                              float* __restrict__ dconv, int n, int c, int h, int w, int p,
                                              int conv_nhwc, int out_nhwc) {
    const int ho = h / p, wo = w / p;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * c * h * w) return;
    int s, ch, y, x;
    coords4(idx, c, h, w, conv_nhwc, s, ch, y, x);
    const int i = y / p, j = x / p;
    float g = 0.0f;
    if (i < ho && j < wo) {
        long long k = at4(s, ch, i, j, c, ho, wo, out_nhwc);
        if (arg[k] == (y - i * p) * p + (x - j * p)) g = dout[k];
    }
    dconv[idx] = g;
}

// db[ch] = Σ_{n, i, j} dout[n, ch, i, j] · [ReLU passed]  (= Σ of dconv over the channel: each
// pooled gradient lands on exactly one conv element). One block per channel, its threads
// strided over (n, position) in 32-bit arithmetic, then a tree in shared memory: a fixed order.
extern "C" __global__ void channel_bias_grad(const float* __restrict__ dout, const unsigned char* __restrict__ arg,
                                             float* __restrict__ db, int n, int c, int hw, int nhwc) {
    __shared__ float part[CNN_REDUCE_THREADS];
    const int ch = blockIdx.x;
    float acc = 0.0f;
    for (int k = threadIdx.x; k < n * hw; k += CNN_REDUCE_THREADS) {
        const int s = k / hw, pos = k - s * hw;
        const int at = nhwc ? k * c + ch : (s * c + ch) * hw + pos;
        if (arg[at] != RELU_OFF) acc += dout[at];
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = CNN_REDUCE_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) db[ch] = part[0];
}

// The loss step of a batch of `batch` rows starting at sample *cursor of the run's sample stream,
// of which only the first `valid` are real (batch_slice.cuh: the tail batch of an epoch is
// smaller; its other rows hold whatever the gather read past the epoch's end, and get zero
// gradient, so the step is exactly the tail batch's). For a valid row r (logits_loss.cuh):
//   dlogits[r, j] = (softmax(z_r)_j − [j = y_r]) / valid,   loss_r = log Σ_j e^{z_j − m} + m − z_{y_r}
// Then *cursor += valid (the last kernel of the step to read it), and Σ_r loss_r is added to
// loss_sum[0] unless null. One block of CNN_REDUCE_THREADS threads, rows strided over them.
//
// Data-parallel over `ranks` GPUs (1: the one-GPU step, the same arithmetic): `batch` is the
// combined batch, this rank holds its slice (batch_slice.cuh); each row's gradient is still
// divided by the combined `valid`, so the ranks' dW summed (the all-reduce) is the combined
// batch's mean, each row's term the one-GPU run's bit for bit. loss_sum gets this rank's rows only.
// Model axis: every buffer per model (logits, y, dlogits, cursor, loss_sum).
extern "C" __global__ void softmax_xent_step(const float* __restrict__ logits, const int* __restrict__ y,
                                             float* __restrict__ dlogits, int* cursor, int batch,
                                             int epoch_samples, int classes, double* loss_sum, int ranks,
                                             long long model_stride) {
    logits = model_at(logits, model_stride);
    y = model_at(y, model_stride);
    dlogits = model_at(dlogits, model_stride);
    cursor = model_at(cursor, model_stride);
    loss_sum = model_at(loss_sum, model_stride);
    __shared__ double part[CNN_REDUCE_THREADS];
    const BatchSlice slice = batch_slice(*cursor, batch, epoch_samples, ranks);
    const float inv = 1.0f / (float)slice.valid;
    double loss = 0.0;
    for (int r = threadIdx.x; r < slice.rows; r += CNN_REDUCE_THREADS) {
        const float* z = logits + (long long)r * classes;
        float* d = dlogits + (long long)r * classes;
        if (r >= slice.mine) {
            for (int k = 0; k < classes; ++k) d[k] = 0.0f;
            continue;
        }
        float m, sum;
        row_max_sum(z, classes, m, sum);
        const float rs = 1.0f / sum;
        for (int k = 0; k < classes; ++k) d[k] = xent_dlogit(z[k], m, rs, k, y[r], inv);
        loss += (double)xent_loss(sum, m, z[y[r]]);
    }
    part[threadIdx.x] = loss;
    __syncthreads();  // also: every thread has read *cursor before thread 0 moves it
    for (int s = CNN_REDUCE_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        *cursor = slice.next();
        if (loss_sum) loss_sum[0] += part[0];
    }
}

// *correct += #{r < rows : the first largest logit of row r is labels[r]}. Integer atomics: the
// count is exact in any order. Model axis: per model logits, correct; shared labels.
extern "C" __global__ void count_correct(const float* __restrict__ logits, const int* __restrict__ labels,
                                         int rows, int classes, int* correct, long long model_stride) {
    logits = model_at(logits, model_stride);
    correct = model_at(correct, model_stride);
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    int hit = 0;
    if (r < rows) {
        const float* z = logits + (long long)r * classes;
        int best = 0;
        for (int k = 1; k < classes; ++k) if (z[k] > z[best]) best = k;
        hit = best == labels[r];
    }
    int block_hits = __syncthreads_count(hit);
    if (threadIdx.x == 0 && block_hits) atomicAdd(correct, block_hits);
}
