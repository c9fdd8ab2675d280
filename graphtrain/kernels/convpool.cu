// One conv layer with its bias, max-pool and ReLU as fused kernels, for the small layers of an
// MNIST cnn (stride 1, no padding; one sample's input and every filter fit in shared memory).
// cuDNN's kernels for these shapes (1→24 5×5 on 28×28, 24→32 3×3 on 12×12, batch 256) spend
// 20–45 µs a pass, writing the full conv output for the pool to read back; here the conv output
// never leaves registers, and the backward passes read only the pooled gradient and each
// window's argmax. fp32 on the CUDA cores. CP_C (input channels), CP_K (kernel) and CP_P (pool
// window and stride) and CP_OUTS (output channels) come from convpool.py, one build per layer:
// every loop over them unrolls.
//
// Tensors are NCHW. Pooled value (s, o, i, j) keeps in arg the position u·P + v of its window's
// first maximum, or RELU_OFF where the ReLU after the pool zeroed it (no gradient flows there).
// Sums feeding the weights run in a fixed order, without atomics.
//
// Model axis (model_axis.cuh, put before this file by the launcher): every kernel's buffers are
// per model (the forward's input x moves by its own x_stride: 0 where every model reads the same
// images); blockIdx.z is the model, the grids' x and y are a model's own.

#define RELU_OFF 255
#define TAPS (CP_C * CP_K * CP_K)
#define SPAN (CP_K + CP_P - 1)  // a pool window's input patch, per channel

// out[s, o, i, j] = ReLU(max_{u,v<P} Σ_{c,a,b} x[s, c, i·P+u+a, j·P+v+b]·w[o, c, a, b] + bias[o]).
// One block per sample: its input and every filter in shared memory; the threads over (o, i, j).
// The P×P conv outputs of a window share one SPAN×SPAN patch per channel, read once into registers.
extern "C" __global__ void convpool_forward(const float* __restrict__ x, const float* __restrict__ w,
                                            const float* __restrict__ bias, float* __restrict__ out,
                                            unsigned char* __restrict__ arg, int outs, int h, int wd,
                                            long long x_stride, long long model_stride) {
    x = model_at(x, x_stride);
    w = model_at(w, model_stride);
    bias = model_at(bias, model_stride);
    out = model_at(out, model_stride);
    arg = model_at(arg, model_stride);
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

// Few taps (a first layer): the chunk's inputs staged in shared memory, the accumulators in
// registers, the threads over (sample, window), then a tree over the threads per tap.
extern "C" __global__ void convpool_weight_grad_regs(const float* __restrict__ x, const float* __restrict__ dout,
                                                     const unsigned char* __restrict__ arg,
                                                     float* __restrict__ partial, int n, int outs, int h, int wd,
                                                     int per_chunk, long long model_stride) {
    x = model_at(x, model_stride);
    dout = model_at(dout, model_stride);
    arg = model_at(arg, model_stride);
    partial = model_at(partial, model_stride);
    extern __shared__ float xs[];  // per_chunk samples of CP_C·h·wd
    __shared__ float part[CP_REDUCE_THREADS];
    const int o = blockIdx.x, chunk = blockIdx.y, chunks = gridDim.y;
    const int ho = (h - CP_K + 1) / CP_P, wo = (wd - CP_K + 1) / CP_P, plane = ho * wo, image = CP_C * h * wd;
    const int first = chunk * per_chunk, last = min(n, first + per_chunk);
    for (int t = threadIdx.x; t < (last - first) * image; t += CP_REDUCE_THREADS)
        xs[t] = x[(long long)first * image + t];
    __syncthreads();
    float acc[TAPS + 1];
#pragma unroll
    for (int t = 0; t <= TAPS; ++t) acc[t] = 0.0f;
    for (int q = threadIdx.x; q < (last - first) * plane; q += CP_REDUCE_THREADS) {
        const int s = q / plane, pos = q % plane;
        const long long at = ((long long)(first + s) * outs + o) * plane + pos;
        const int where = arg[at];
        if (where == RELU_OFF) continue;
        const float g = dout[at];
        const int cy = (pos / wo) * CP_P + where / CP_P, cx = (pos % wo) * CP_P + where % CP_P;
        const float* src = xs + s * image + cy * wd + cx;
#pragma unroll
        for (int t = 0; t < TAPS; ++t) {
            const int ch = t / (CP_K * CP_K), a = (t / CP_K) % CP_K, b = t % CP_K;
            acc[t] = fmaf(g, src[(ch * h + a) * wd + b], acc[t]);
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

// Many taps: thread (t, g) of a block of TAP_LANES × CP_OUT_GROUPS threads holds, for tap t (and
// t = TAPS for the bias), the sums of the output channels o ≡ g (mod CP_OUT_GROUPS) in registers;
// a block per chunk of samples, each sample's input and its windows' g and argmax origin staged
// in shared memory, every sum in a fixed order. partial as for the register variant.
#define TAP_LANES ((TAPS + 1 + 31) / 32 * 32)
#define OUTS_PER_GROUP ((CP_OUTS + CP_OUT_GROUPS - 1) / CP_OUT_GROUPS)
extern "C" __global__ void convpool_weight_grad_taps(const float* __restrict__ x, const float* __restrict__ dout,
                                                     const unsigned char* __restrict__ arg,
                                                     float* __restrict__ partial, int n, int outs, int h, int wd,
                                                     int per_chunk, long long model_stride) {
    x = model_at(x, model_stride);
    dout = model_at(dout, model_stride);
    arg = model_at(arg, model_stride);
    partial = model_at(partial, model_stride);
    extern __shared__ float smem[];
    const int chunk = blockIdx.x, chunks = gridDim.x;
    const int ho = (h - CP_K + 1) / CP_P, wo = (wd - CP_K + 1) / CP_P, plane = ho * wo, image = CP_C * h * wd;
    float* xs = smem;
    float* g = xs + image;                                     // CP_OUTS·plane pooled gradients (0: ReLU off)
    int* origin = reinterpret_cast<int*>(g + CP_OUTS * plane);  // cy·wd + cx of each window's argmax
    const int t = threadIdx.x % TAP_LANES, group = threadIdx.x / TAP_LANES;
    const int ch = t / (CP_K * CP_K), a = (t / CP_K) % CP_K, b = t % CP_K;
    const int tap_offset = t < TAPS ? (ch * h + a) * wd + b : 0;
    float acc[OUTS_PER_GROUP];
#pragma unroll
    for (int k = 0; k < OUTS_PER_GROUP; ++k) acc[k] = 0.0f;
    const int first = chunk * per_chunk, last = min(n, first + per_chunk);
    for (int s = first; s < last; ++s) {
        __syncthreads();  // the previous sample's staging is no longer read
        for (int e = threadIdx.x; e < image; e += blockDim.x) xs[e] = x[(long long)s * image + e];
        for (int q = threadIdx.x; q < CP_OUTS * plane; q += blockDim.x) {
            const long long at = (long long)s * CP_OUTS * plane + q;
            const int where = arg[at], pos = q % plane;
            g[q] = where == RELU_OFF ? 0.0f : dout[at];
            origin[q] = ((pos / wo) * CP_P + (where == RELU_OFF ? 0 : where / CP_P)) * wd +
                        (pos % wo) * CP_P + (where == RELU_OFF ? 0 : where % CP_P);
        }
        __syncthreads();
        if (t <= TAPS) {
#pragma unroll
            for (int k = 0; k < OUTS_PER_GROUP; ++k) {
                const int o = group + k * CP_OUT_GROUPS;
                if (o >= CP_OUTS) break;
                const float* go = g + o * plane;
                const int* oo = origin + o * plane;
                if (t < TAPS)
                    for (int pos = 0; pos < plane; ++pos) acc[k] = fmaf(go[pos], xs[oo[pos] + tap_offset], acc[k]);
                else
                    for (int pos = 0; pos < plane; ++pos) acc[k] += go[pos];
            }
        }
    }
    if (t <= TAPS)
#pragma unroll
        for (int k = 0; k < OUTS_PER_GROUP; ++k) {
            const int o = group + k * CP_OUT_GROUPS;
            if (o < CP_OUTS) partial[((long long)o * chunks + chunk) * (TAPS + 1) + t] = acc[k];
        }
}

// dw[o, t] = Σ_chunk partial[o, chunk, t] (t < TAPS), db[o] = the same at t = TAPS, in order.
extern "C" __global__ void convpool_reduce(const float* __restrict__ partial, float* __restrict__ dw,
                                           float* __restrict__ db, int outs, int chunks, long long model_stride) {
    partial = model_at(partial, model_stride);
    dw = model_at(dw, model_stride);
    db = model_at(db, model_stride);
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= outs * (TAPS + 1)) return;
    const int o = idx / (TAPS + 1), t = idx % (TAPS + 1);
    float sum = 0.0f;
    for (int chunk = 0; chunk < chunks; ++chunk) sum += partial[((long long)o * chunks + chunk) * (TAPS + 1) + t];
    if (t < TAPS) dw[o * TAPS + t] = sum;
    else db[o] = sum;
}

// dx[s, c, y, x] = Σ_o Σ_{a,b} dconv[s, o, y − a, x − b] · w[o, c, a, b]: the gradient of the
// layer's input (the previous layer's pooled, ReLU'd output), where dconv is the pooled gradient
// put back at each window's argmax (0 elsewhere, and where the ReLU was off). One block per
// sample: every filter and the sample's dconv, zero-padded by K − 1 on each side (no bounds
// tests), in shared memory; each thread a run of XT outputs along x for one (c, y), reusing
// each weight and each loaded dconv row across them; each output a fixed-order sum.
#define XT 4
extern "C" __global__ void convpool_backward_data(const float* __restrict__ dout, const unsigned char* __restrict__ arg,
                                                  const float* __restrict__ w, float* __restrict__ dx, int outs,
                                                  int h, int wd, long long model_stride) {
    dout = model_at(dout, model_stride);
    arg = model_at(arg, model_stride);
    w = model_at(w, model_stride);
    dx = model_at(dx, model_stride);
    extern __shared__ float smem[];
    const int hc = h - CP_K + 1, wc = wd - CP_K + 1;
    const int hp = hc + 2 * (CP_K - 1), wp = wc + 2 * (CP_K - 1);  // the padded conv gradient
    const int ho = hc / CP_P, wo = wc / CP_P, plane = ho * wo;
    float* ws = smem;
    float* dc = ws + CP_OUTS * TAPS;  // CP_OUTS × hp × wp
    const int s = blockIdx.x;
    for (int t = threadIdx.x; t < CP_OUTS * TAPS; t += blockDim.x) ws[t] = w[t];
    for (int t = threadIdx.x; t < CP_OUTS * hp * wp; t += blockDim.x) dc[t] = 0.0f;
    __syncthreads();
    for (int q = threadIdx.x; q < CP_OUTS * plane; q += blockDim.x) {
        const long long at = (long long)s * CP_OUTS * plane + q;
        const int where = arg[at];
        if (where == RELU_OFF) continue;
        const int o = q / plane, pos = q % plane;
        const int cy = (pos / wo) * CP_P + where / CP_P, cx = (pos % wo) * CP_P + where % CP_P;
        // each conv position lies in one window: no two threads write the same element
        dc[(o * hp + cy + CP_K - 1) * wp + cx + CP_K - 1] = dout[at];
    }
    __syncthreads();
    const int runs = (wd + XT - 1) / XT;
    for (int e = threadIdx.x; e < CP_C * h * runs; e += blockDim.x) {
        const int c = e / (h * runs), y = (e / runs) % h, x0 = (e % runs) * XT;
        float acc[XT];
#pragma unroll
        for (int u = 0; u < XT; ++u) acc[u] = 0.0f;
        for (int o = 0; o < CP_OUTS; ++o) {
            const float* wf = ws + (o * CP_C + c) * CP_K * CP_K;
#pragma unroll
            for (int a = 0; a < CP_K; ++a) {
                // padded row y − a + K − 1, columns x0 − b + K − 1 for b < K and the run's XT outputs
                const float* row = dc + (o * hp + y - a + CP_K - 1) * wp + x0;
                float v[XT + CP_K - 1];
#pragma unroll
                for (int i = 0; i < XT + CP_K - 1; ++i) v[i] = x0 + i < wp ? row[i] : 0.0f;
#pragma unroll
                for (int b = 0; b < CP_K; ++b) {
                    const float wv = wf[a * CP_K + b];
#pragma unroll
                    for (int u = 0; u < XT; ++u) acc[u] = fmaf(v[u + CP_K - 1 - b], wv, acc[u]);
                }
            }
        }
        float* out = dx + (long long)s * CP_C * h * wd + (c * h + y) * wd + x0;
#pragma unroll
        for (int u = 0; u < XT; ++u)
            if (x0 + u < wd) out[u] = acc[u];
    }
}
