// One conv layer with its bias, max-pool and ReLU as fused kernels, for the small layers of an
// MNIST cnn (stride 1, no padding; one sample's input and every filter fit in shared memory).
// cuDNN's kernels for these shapes (1→24 5×5 on 28×28, 24→32 3×3 on 12×12, batch 256) spend
// 20–45 µs a pass, writing the full conv output for the pool to read back; here the conv output
// never leaves registers, and the backward passes read only the pooled gradient and each
// window's argmax. fp32 on the CUDA cores. CP_C (input channels), CP_K (kernel) and CP_P (pool
// window and stride) come from convpool.py, one build per layer: every loop over them unrolls.
//
// Tensors are NCHW. Pooled value (s, o, i, j) keeps in arg the position u·P + v of its window's
// first maximum, or RELU_OFF where the ReLU after the pool zeroed it (no gradient flows there).
// Sums feeding the weights run in a fixed order, without atomics.

#define RELU_OFF 255
#define TAPS (CP_C * CP_K * CP_K)
#define SPAN (CP_K + CP_P - 1)  // a pool window's input patch, per channel

// out[s, o, i, j] = ReLU(max_{u,v<P} Σ_{c,a,b} x[s, c, i·P+u+a, j·P+v+b]·w[o, c, a, b] + bias[o]).
// One block per sample: its input and every filter in shared memory; the threads over (o, i, j).
// The P×P conv outputs of a window share one SPAN×SPAN patch per channel, read once into registers.
extern "C" __global__ void convpool_forward(const float* __restrict__ x, const float* __restrict__ w,
                                            const float* __restrict__ bias, float* __restrict__ out,
                                            unsigned char* __restrict__ arg, int outs, int h, int wd) {
    extern __shared__ float smem[];
    const int image = CP_C * h * wd;
    float* xs = smem;
    float* ws = smem + image;
    const int s = blockIdx.x;
    for (int t = threadIdx.x; t < image; t += blockDim.x) xs[t] = x[(long long)s * image + t];
    for (int t = threadIdx.x; t < outs * TAPS; t += blockDim.x) ws[t] = w[t];
    __syncthreads();
    const int ho = (h - CP_K + 1) / CP_P, wo = (wd - CP_K + 1) / CP_P, plane = ho * wo;
    for (int q = threadIdx.x; q < outs * plane; q += blockDim.x) {
        const int o = q / plane, i = (q % plane) / wo, j = q % wo;
        const float* wf = ws + o * TAPS;
        float acc[CP_P * CP_P];
#pragma unroll
        for (int t = 0; t < CP_P * CP_P; ++t) acc[t] = 0.0f;
#pragma unroll 1
        for (int ch = 0; ch < CP_C; ++ch) {
            float patch[SPAN][SPAN];
            const float* src = xs + (ch * h + i * CP_P) * wd + j * CP_P;
#pragma unroll
            for (int a = 0; a < SPAN; ++a)
#pragma unroll
                for (int b = 0; b < SPAN; ++b) patch[a][b] = src[a * wd + b];
#pragma unroll
            for (int a = 0; a < CP_K; ++a)
#pragma unroll
                for (int b = 0; b < CP_K; ++b) {
                    const float wv = wf[(ch * CP_K + a) * CP_K + b];
#pragma unroll
                    for (int u = 0; u < CP_P; ++u)
#pragma unroll
                        for (int v = 0; v < CP_P; ++v)
                            acc[u * CP_P + v] = fmaf(patch[u + a][v + b], wv, acc[u * CP_P + v]);
                }
        }
        float best = acc[0];
        int where = 0;
#pragma unroll
        for (int t = 1; t < CP_P * CP_P; ++t)
            if (acc[t] > best) { best = acc[t]; where = t; }
        const float y = best + bias[o];
        const long long at = (long long)s * outs * plane + q;
        out[at] = y > 0.0f ? y : 0.0f;
        arg[at] = y > 0.0f ? (unsigned char)where : (unsigned char)RELU_OFF;
    }
}

// The weight and bias gradients from the pooled gradient: each g = dout[s, o, i, j] where the
// ReLU passed came from the conv output at its window's argmax (cy, cx) = (i·P + du, j·P + dv):
//   dW[o, c, a, b] += g · x[s, c, cy + a, cx + b],   db[o] += g.
// Block (o, chunk) sums the samples [chunk·per_chunk, ...) into
// partial[(o·chunks + chunk)·(TAPS + 1) + t], t = TAPS being the bias; convpool_reduce adds the
// chunks in order.

// Few taps (a first layer): the accumulators in registers, the threads over (sample, window),
// then a tree over the threads per tap.
extern "C" __global__ void convpool_weight_grad_regs(const float* __restrict__ x, const float* __restrict__ dout,
                                                     const unsigned char* __restrict__ arg,
                                                     float* __restrict__ partial, int n, int outs, int h, int wd,
                                                     int per_chunk) {
    __shared__ float part[CP_REDUCE_THREADS];
    const int o = blockIdx.x, chunk = blockIdx.y, chunks = gridDim.y;
    const int ho = (h - CP_K + 1) / CP_P, wo = (wd - CP_K + 1) / CP_P, plane = ho * wo;
    float acc[TAPS + 1];
#pragma unroll
    for (int t = 0; t <= TAPS; ++t) acc[t] = 0.0f;
    const int first = chunk * per_chunk, last = min(n, first + per_chunk);
    for (int q = threadIdx.x; q < (last - first) * plane; q += CP_REDUCE_THREADS) {
        const int s = first + q / plane, pos = q % plane;
        const long long at = ((long long)s * outs + o) * plane + pos;
        const int where = arg[at];
        if (where == RELU_OFF) continue;
        const float g = dout[at];
        const int cy = (pos / wo) * CP_P + where / CP_P, cx = (pos % wo) * CP_P + where % CP_P;
        const float* xs = x + (long long)s * CP_C * h * wd;
#pragma unroll
        for (int t = 0; t < TAPS; ++t) {
            const int ch = t / (CP_K * CP_K), a = (t / CP_K) % CP_K, b = t % CP_K;
            acc[t] = fmaf(g, xs[(ch * h + cy + a) * wd + cx + b], acc[t]);
        }
        acc[TAPS] += g;
    }
    float* dst = partial + ((long long)o * chunks + chunk) * (TAPS + 1);
    for (int t = 0; t <= TAPS; ++t) {
        part[threadIdx.x] = acc[t];
        __syncthreads();
        for (int stride = CP_REDUCE_THREADS / 2; stride > 0; stride >>= 1) {
            if (threadIdx.x < stride) part[threadIdx.x] += part[threadIdx.x + stride];
            __syncthreads();
        }
        if (threadIdx.x == 0) dst[t] = part[0];
        __syncthreads();
    }
}

// Many taps: one thread per tap (and thread TAPS for the bias), each summing its own term over
// the chunk's samples and windows in order; the window's g and argmax are read by every thread
// (staged in shared memory per sample).
extern "C" __global__ void convpool_weight_grad_taps(const float* __restrict__ x, const float* __restrict__ dout,
                                                     const unsigned char* __restrict__ arg,
                                                     float* __restrict__ partial, int n, int outs, int h, int wd,
                                                     int per_chunk) {
    extern __shared__ float window[];  // plane values of g (0 where the ReLU was off), then plane offsets
    const int o = blockIdx.x, chunk = blockIdx.y, chunks = gridDim.y;
    const int ho = (h - CP_K + 1) / CP_P, wo = (wd - CP_K + 1) / CP_P, plane = ho * wo;
    int* origin = reinterpret_cast<int*>(window + plane);  // (cy·wd + cx) of each window's argmax
    const int t = threadIdx.x;
    const int ch = t / (CP_K * CP_K), a = (t / CP_K) % CP_K, b = t % CP_K;
    const int tap_offset = t < TAPS ? (ch * h + a) * wd + b : 0;
    float acc = 0.0f;
    const int first = chunk * per_chunk, last = min(n, first + per_chunk);
    for (int s = first; s < last; ++s) {
        __syncthreads();  // the previous sample's window is no longer read
        for (int pos = t; pos < plane; pos += blockDim.x) {
            const long long at = ((long long)s * outs + o) * plane + pos;
            const int where = arg[at];
            window[pos] = where == RELU_OFF ? 0.0f : dout[at];
            const int cy = (pos / wo) * CP_P + (where == RELU_OFF ? 0 : where / CP_P);
            const int cx = (pos % wo) * CP_P + (where == RELU_OFF ? 0 : where % CP_P);
            origin[pos] = cy * wd + cx;
        }
        __syncthreads();
        if (t < TAPS) {
            const float* xs = x + (long long)s * CP_C * h * wd + tap_offset;
            for (int pos = 0; pos < plane; ++pos) acc = fmaf(window[pos], xs[origin[pos]], acc);
        } else if (t == TAPS) {
            for (int pos = 0; pos < plane; ++pos) acc += window[pos];
        }
    }
    if (t <= TAPS) partial[((long long)o * chunks + chunk) * (TAPS + 1) + t] = acc;
}

// dw[o, t] = Σ_chunk partial[o, chunk, t] (t < TAPS), db[o] = the same at t = TAPS, in order.
extern "C" __global__ void convpool_reduce(const float* __restrict__ partial, float* __restrict__ dw,
                                           float* __restrict__ db, int outs, int chunks) {
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= outs * (TAPS + 1)) return;
    const int o = idx / (TAPS + 1), t = idx % (TAPS + 1);
    float sum = 0.0f;
    for (int chunk = 0; chunk < chunks; ++chunk) sum += partial[((long long)o * chunks + chunk) * (TAPS + 1) + t];
    if (t < TAPS) dw[o * TAPS + t] = sum;
    else db[o] = sum;
}

// dx[s, c, y, x] = Σ_o Σ_windows g[s, o, window] · w[o, c, y − cy, x − cx] over the windows whose
// argmax (cy, cx) has (y, x) inside its K×K footprint: the gradient of the layer's input (the
// previous layer's pooled, ReLU'd output). One block per sample: every filter, the sample's
// pooled gradient (0 where the ReLU was off) and window origins in shared memory; the threads
// over (c, y, x), each a fixed-order sum.
extern "C" __global__ void convpool_backward_data(const float* __restrict__ dout, const unsigned char* __restrict__ arg,
                                                  const float* __restrict__ w, float* __restrict__ dx, int outs,
                                                  int h, int wd) {
    extern __shared__ float smem[];
    const int ho = (h - CP_K + 1) / CP_P, wo = (wd - CP_K + 1) / CP_P, plane = ho * wo;
    float* ws = smem;
    float* g = ws + outs * TAPS;
    int* origin = reinterpret_cast<int*>(g + outs * plane);  // (cy << 16) | cx
    const int s = blockIdx.x;
    for (int t = threadIdx.x; t < outs * TAPS; t += blockDim.x) ws[t] = w[t];
    for (int q = threadIdx.x; q < outs * plane; q += blockDim.x) {
        const long long at = (long long)s * outs * plane + q;
        const int where = arg[at], pos = q % plane;
        g[q] = where == RELU_OFF ? 0.0f : dout[at];
        const int cy = (pos / wo) * CP_P + (where == RELU_OFF ? 0 : where / CP_P);
        const int cx = (pos % wo) * CP_P + (where == RELU_OFF ? 0 : where % CP_P);
        origin[q] = (cy << 16) | cx;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < CP_C * h * wd; e += blockDim.x) {
        const int c = e / (h * wd), y = (e / wd) % h, xx = e % wd;
        // Windows whose footprint can hold (y, x): argmax rows cy in (y − K, y], so window rows
        // i with i·P ≤ y and i·P + P − 1 > y − K.
        const int i_lo = max(0, (y - CP_K - CP_P + 2 + CP_P - 1) / CP_P), i_hi = min(ho - 1, y / CP_P);
        const int j_lo = max(0, (xx - CP_K - CP_P + 2 + CP_P - 1) / CP_P), j_hi = min(wo - 1, xx / CP_P);
        float acc = 0.0f;
        for (int o = 0; o < outs; ++o) {
            const float* wf = ws + (o * CP_C + c) * CP_K * CP_K;
            for (int i = i_lo; i <= i_hi; ++i)
                for (int j = j_lo; j <= j_hi; ++j) {
                    const int q = o * plane + i * wo + j;
                    const int dy = y - (origin[q] >> 16), dxx = xx - (origin[q] & 0xffff);
                    if (dy >= 0 && dy < CP_K && dxx >= 0 && dxx < CP_K) acc = fmaf(g[q], wf[dy * CP_K + dxx], acc);
                }
        }
        dx[(long long)s * CP_C * h * wd + e] = acc;
    }
}
