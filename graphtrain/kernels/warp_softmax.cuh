// One row's softmax and its loss gradient over LANES lanes of a warp (32, or 16: two rows a warp),
// class j on the group's lane j (fused.cu, persistent.cu, persistent_mlp.cu); every lane of the
// warp calls it. z is −∞ on the lanes past the classes. Returns the lane's dlogit
// (softmax(z)_j − [j = label]) / rows (0 past the classes) and sets m = max_j z_j and
// sum = Σ_j exp(z_j − m), which give the row's loss: log(sum) + m − z_label. Every lane of the
// group ends with the same m and sum (butterfly order).
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
