// The optimizer step: one kernel over every parameter of the model (they lie in one span, as do
// their gradients and the optimizer's state), the learning rate computed here from the step
// counter, so a captured graph replays unchanged while the rate follows its schedule: no
// re-capture, no parameter patched, no host read. The optimizer's and the schedule's constants
// (OptimizerConstants) are read from the device too, where the host writes them between runs: a
// graph captured once trains whatever recipe was written last.
//
// state[0] = steps taken (t − 1 before this step), state[1] = blocks done with this step. Every
// block reads state[0] first; the last block to finish (counted with an integer atomic: no float
// atomics, the update is the same bit for bit on every run) writes t back, resets the count and
// records the rate it used in lr_out[0]. The step knows nothing of loops: a device loop counts
// its iterations in a node of its own (loop.cu).
//
// The model axis (model_axis.cuh): model k = blockIdx.z; every pointer is per model (its
// parameters, gradients, state slots, counters, rate and constants record), model_stride bytes
// after model k − 1's. Model k's blocks count on its own state[1] against gridDim.x, so each
// model's step, rate and constants are its own, the bits of its launch alone.
//
// Schedules (k = t − 1, the 0-based step; `total` steps; peak `lr`), as graphtrain.reference_cnn:
//   0 constant   lr
//   1 warmup     lr · min(1, (k + 1) / warmup)
//   2 one-cycle  PyTorch's OneCycleLR, cosine: lr/div → lr over pct·total − 1 steps, then → lr/(div·final_div)
//   3 cosine     lr · (1 + cos(π k / total)) / 2
// Optimizers (PyTorch's rules; wd: L2 on the gradient, decoupled for AdamW):
//   0 sgd        p −= lr·g
//   1 momentum   b = μ·b + g;  p −= lr·b
//   2 nesterov   b = μ·b + g;  p −= lr·(g + μ·b)
//   3 adam       m = β1·m + (1−β1)·g;  v = β2·v + (1−β2)·g²;  p −= lr/(1−β1^t) · m / (√v/√(1−β2^t) + ε)
//   4 adamw      p ·= 1 − lr·wd, then adam without L2

struct Schedule { int kind, total, warmup; float lr, pct, div, final_div; };

// graphtrain.kernels.optim.CONSTANTS lays out the same fields in the same order. It hands here
// the record's size (OC_BYTES), each field's place in it (OC_<FIELD>: its index) and which of them
// are floats (OC_FLOAT_FIELDS, bit i for the field at index i), all checked when this compiles.
struct OptimizerConstants {
    int optimizer;
    float momentum, beta1, beta2, eps, weight_decay;
    int schedule, total, warmup;
    float lr, pct, div, final_div;
};
template <class A, class B> struct oc_same { static constexpr bool value = false; };
template <class A> struct oc_same<A, A> { static constexpr bool value = true; };
constexpr OptimizerConstants oc_places{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};  // each field its index
static_assert(sizeof(OptimizerConstants) == OC_BYTES, "OptimizerConstants: not the size of optim.py's CONSTANTS");
#define OC_CHECK(field, place) \
    static_assert((int)oc_places.field == place && ((OC_FLOAT_FIELDS >> place) & 1) == \
                  (int)oc_same<decltype(OptimizerConstants::field), float>::value, \
                  "OptimizerConstants." #field ": not where, or not of the type, optim.py's CONSTANTS has it");
OC_CHECK(optimizer, OC_OPTIMIZER) OC_CHECK(momentum, OC_MOMENTUM) OC_CHECK(beta1, OC_BETA1)
OC_CHECK(beta2, OC_BETA2) OC_CHECK(eps, OC_EPS) OC_CHECK(weight_decay, OC_WEIGHT_DECAY)
OC_CHECK(schedule, OC_SCHEDULE) OC_CHECK(total, OC_TOTAL) OC_CHECK(warmup, OC_WARMUP) OC_CHECK(lr, OC_LR)
OC_CHECK(pct, OC_PCT) OC_CHECK(div, OC_DIV) OC_CHECK(final_div, OC_FINAL_DIV)
#undef OC_CHECK

__device__ float cosine_anneal(float from, float to, float pct) {
    return to + (from - to) * 0.5f * (cospif(pct) + 1.0f);
}

__device__ float schedule_lr(const Schedule& s, int k) {
    switch (s.kind) {
        case 1: return s.lr * fminf(1.0f, (float)(k + 1) / (float)max(s.warmup, 1));
        case 2: {
            float start = s.lr / s.div, low = start / s.final_div;
            float end1 = s.pct * (float)s.total - 1.0f, end2 = (float)(s.total - 1);
            if ((float)k <= end1) return cosine_anneal(start, s.lr, (float)k / end1);
            return cosine_anneal(s.lr, low, ((float)k - end1) / (end2 - end1));
        }
        case 3: return s.lr * 0.5f * (1.0f + cospif((float)k / (float)s.total));
        default: return s.lr;
    }
}

__device__ __forceinline__ void optimizer_step_body(float* __restrict__ p, const float* __restrict__ g,
                                                    float* __restrict__ s1, float* __restrict__ s2, long long n,
                                                    int* state, float* lr_out,
                                                    const OptimizerConstants* __restrict__ constants) {
    const OptimizerConstants c = *constants;
    const int t = state[0] + 1;
    const int optimizer = c.optimizer;
    const float momentum = c.momentum, beta1 = c.beta1, beta2 = c.beta2, eps = c.eps, wd = c.weight_decay;
    const Schedule sch{c.schedule, c.total, c.warmup, c.lr, c.pct, c.div, c.final_div};
    const float lr = schedule_lr(sch, t - 1);
    // Bias corrections in double: β^t for t in the thousands loses digits in float.
    const float c1 = (float)(1.0 - pow((double)beta1, (double)t));
    const float rc2 = (float)rsqrt(1.0 - pow((double)beta2, (double)t));
    const float step_size = lr / c1;
    // One parameter's update; the same arithmetic for every element, so the pass below may take
    // them four at a time (16-byte loads: a quarter of the memory instructions, more bytes in
    // flight a thread) and the tail one at a time, with the same bits.
    auto update = [&](float& w, float grad, float& m1, float& m2) {
        if (optimizer == 4) w *= 1.0f - lr * wd;
        else grad = fmaf(wd, w, grad);
        if (optimizer == 0) {
            w -= lr * grad;
        } else if (optimizer <= 2) {
            const float b = fmaf(momentum, m1, grad);
            m1 = b;
            w -= lr * (optimizer == 2 ? fmaf(momentum, b, grad) : b);
        } else {
            const float m = fmaf(beta1, m1, (1.0f - beta1) * grad);
            const float v = fmaf(beta2, m2, (1.0f - beta2) * grad * grad);
            m1 = m;
            m2 = v;
            w -= step_size * m / fmaf(sqrtf(v), rc2, eps);
        }
    };
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    // Whole quads when every span is 16-byte aligned (the arenas are; a state slot absent is null).
    const bool quads = ((reinterpret_cast<unsigned long long>(p) | reinterpret_cast<unsigned long long>(g) |
                         reinterpret_cast<unsigned long long>(s1) | reinterpret_cast<unsigned long long>(s2)) & 15) == 0;
    const long long vector_end = quads ? n / 4 * 4 : 0;
    for (long long q = first; q < vector_end / 4; q += stride) {
        float4 w = reinterpret_cast<float4*>(p)[q];
        const float4 grad = reinterpret_cast<const float4*>(g)[q];
        float4 m1 = s1 ? reinterpret_cast<float4*>(s1)[q] : float4{};
        float4 m2 = s2 ? reinterpret_cast<float4*>(s2)[q] : float4{};
        update(w.x, grad.x, m1.x, m2.x);
        update(w.y, grad.y, m1.y, m2.y);
        update(w.z, grad.z, m1.z, m2.z);
        update(w.w, grad.w, m1.w, m2.w);
        if (s1) reinterpret_cast<float4*>(s1)[q] = m1;
        if (s2) reinterpret_cast<float4*>(s2)[q] = m2;
        reinterpret_cast<float4*>(p)[q] = w;
    }
    for (long long i = vector_end + first; i < n; i += stride) {
        float w = p[i], m1 = s1 ? s1[i] : 0.0f, m2 = s2 ? s2[i] : 0.0f;
        update(w, g[i], m1, m2);
        if (s1) s1[i] = m1;
        if (s2) s2[i] = m2;
        p[i] = w;
    }
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(&state[1], 1) == (int)gridDim.x - 1;
    }
    __syncthreads();
    if (last && threadIdx.x == 0) {
        state[1] = 0;
        state[0] = t;
        lr_out[0] = lr;
    }
}
extern "C" __global__ void optimizer_step(float* p, const float* g, float* s1, float* s2, long long n, int* state,
                                          float* lr_out, const OptimizerConstants* constants,
                                          long long model_stride) {
    // Stepped in bytes on the pointers (model_axis.cuh's step_bytes), so the loads stay global
    // ones; an absent state slot (0: an optimizer without it) stays null.
    const long long at = model_offset(model_stride);
    optimizer_step_body(step_bytes(p, at), step_bytes(g, at), s1 ? step_bytes(s1, at) : s1,
                        s2 ? step_bytes(s2, at) : s2, n, step_bytes(state, at), step_bytes(lr_out, at),
                        step_bytes(constants, at));
}

// The rate schedule_lr gives each of the steps first..first+count−1 (0-based): what the tests
// compare with the reference.
extern "C" __global__ void schedule_rates(float* out, int first, int count, int schedule, int total, int warmup,
                                          float peak, float pct, float div, float final_div) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    const Schedule sch{schedule, total, warmup, peak, pct, div, final_div};
    if (i < count) out[i] = schedule_lr(sch, first + i);
}
