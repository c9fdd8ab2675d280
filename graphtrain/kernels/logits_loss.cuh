// The logits layer and its loss step, one row of a batch at a time: the math written once for the
// kernels that compute it (head.cu, fused.cu, cnn.cu, persistent.cu, persistent_mlp.cu). For the
// row's input x (k values), the layer's W (N × k) and b, the row's label y, and a batch whose loss
// is the mean over its n real rows:
//   z_j = b_j + Σ_c x_c·W[j, c]
//   m = max_j z_j,   sum = Σ_j e^{z_j − m}
//   dlogits_j = ∂loss/∂z_j = (e^{z_j − m} / sum − [j = y]) / n
//   loss = −log softmax(z)_y = log(sum) + m − z_y
//   correct = [the first j with z_j = m is y]
// A row is held one of two ways, each with its own order of operations (another order gives other
// bits, and each rung repeats its runs bit for bit):
//   whole by each thread (row_max_sum, xent_dlogit): head.cu's warps after their butterflies,
//     cnn.cu's thread per row. The sum in class order; the divisions as products with 1/sum, 1/n.
//   a class per lane (warp_softmax_grad, warp_label_logit): fused.cu, persistent.cu and
//     persistent_mlp.cu. The max and the sum by butterflies; the divisions as written.

// A value as the fp32 the sums take: a float, or a bf16 held as its 16 bits (exact).
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(unsigned short bf16_bits) { return __uint_as_float((unsigned)bf16_bits << 16); }

// ---- the logits: a warp per row ------------------------------------------------------------------
// acc[j] += Σ_c x[c]·W[j, c] over the lane's columns c = lane + 32·i (W: N × k), and copy[c] = x[c]
// when copy is given. Eight loads are issued before any is used, so a row's reads overlap instead
// of queueing.
template <int N, typename T>
__device__ __forceinline__ void row_logit_partials(const T* __restrict__ x, float* __restrict__ copy, const float* w,
                                                   int k, int lane, float (&acc)[N]) {
    for (int c0 = lane; c0 < k; c0 += 32 * 8) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = c0 + 32 * u < k ? to_float(x[c0 + 32 * u]) : 0.0f;
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int c = c0 + 32 * u;
            if (c >= k) break;
            if (copy != nullptr) copy[c] = v[u];
#pragma unroll
            for (int j = 0; j < N; ++j) acc[j] = fmaf(v[u], w[j * k + c], acc[j]);
        }
    }
}

// Σ over the warp's lanes of s, as a butterfly: every lane ends with the same sum, added in the
// same order.
__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    return s;
}

// ---- the loss step of a row held whole: z[0..n) ---------------------------------------------------
// m = max_j z_j and sum = Σ_j e^{z_j − m}, j in order. No unroll pragma: the compiler unrolls a row
// held in registers (a count known at compile time) by itself, and leaves a runtime count to ptxas.
template <typename Row>
__device__ __forceinline__ void row_max_sum(const Row& z, int n, float& m, float& sum) {
    m = z[0];
    for (int j = 1; j < n; ++j) m = fmaxf(m, z[j]);
    sum = 0.0f;
    for (int j = 0; j < n; ++j) sum += expf(z[j] - m);
}

// dlogits_j from z_j, the row's m, rs = 1/sum, the class j, the label, and inv = 1/n.
__device__ __forceinline__ float xent_dlogit(float z_j, float m, float rs, int j, int label, float inv) {
    return (expf(z_j - m) * rs - (j == label ? 1.0f : 0.0f)) * inv;
}

// The row's loss, log(sum) + m − z_y.
__device__ __forceinline__ float xent_loss(float sum, float m, float z_label) { return logf(sum) + m - z_label; }

// ---- the loss step of a row held a class per lane ------------------------------------------------
// LANES lanes a row (32, or 16: two rows a warp), class j on the group's lane j; every lane of the
// warp calls it. z is −∞ on the lanes past the classes. Returns the lane's dlogit
// (softmax(z)_j − [j = label]) / rows (0 past the classes) and sets m = max_j z_j and
// sum = Σ_j exp(z_j − m), which give the row's loss (warp_label_logit). Every lane of the group ends
// with the same m and sum (butterfly order).
template <int LANES = 32>
__device__ __forceinline__ float warp_softmax_grad(float z, bool is_class, int j, int label, int rows,
                                                   float& m, float& sum) {
    static_assert(LANES == 16 || LANES == 32, "warp_softmax_grad: a row takes 16 or 32 lanes");
    m = z;
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float e = is_class ? expf(z - m) : 0.0f;
    sum = e;
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    return is_class ? (e / sum - (j == label ? 1.0f : 0.0f)) / (float)rows : 0.0f;
}

// After warp_softmax_grad, on every lane of the warp (all call it; `group`: the row's first lane):
// the row's z_label, which gives its loss xent_loss(sum, m, z_label), and at_max, the row's lanes
// holding m, whose lowest is the first largest logit: first_max_is(at_max, label) says whether
// that is the label.
__device__ __forceinline__ float warp_label_logit(float z, bool is_class, int group, int label, float m,
                                                  unsigned& at_max) {
    const float z_label = __shfl_sync(0xffffffffu, z, group + label);
    at_max = __ballot_sync(0xffffffffu, is_class && z == m) >> group;
    return z_label;
}
__device__ __forceinline__ bool first_max_is(unsigned at_max, int label) { return (__ffs(at_max) - 1) == label; }
