// One row's softmax and its loss gradient over a warp, class j on lane j (fused.cu, persistent.cu).
// z is −∞ on the lanes past the classes. Returns the lane's dlogit (softmax(z)_j − [j = label]) /
// rows (0 past the classes) and sets m = max_j z_j and sum = Σ_j exp(z_j − m), which give the
// row's loss: log(sum) + m − z_label. Every lane ends with the same m and sum (butterfly order).
__device__ __forceinline__ float warp_softmax_grad(float z, bool is_class, int lane, int label, int rows,
                                                   float& m, float& sum) {
    m = z;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float e = is_class ? expf(z - m) : 0.0f;
    sum = e;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    return is_class ? (e / sum - (lane == label ? 1.0f : 0.0f)) / (float)rows : 0.0f;
}
