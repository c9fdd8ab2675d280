// Images made on the device from the float32 images as uploaded: NumPy takes tens to hundreds of
// milliseconds over MNIST's 47 million values, the GPU well under one. The training images in the
// form a persistent kernel reads them (the same values as graphtrain.kernels.persistent's
// pixel_levels and kernel_images, bit for bit), and the images normalised as a recipe trains on
// them (graphtrain.data.images.normalise's values, bit for bit); the GPU tests compare them.

// x[i] = (x[i] − mean) / std, in place: each operation rounded once to float32 as NumPy's are
// (__fsub_rn, __fdiv_rn: no contraction into an FMA, no reciprocal).
extern "C" __global__ void normalise(float* x, long long n, float mean, float std) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = __fdiv_rn(__fsub_rn(x[i], mean), std);
}

// off_levels += #{i : rint(images[i]·255)/255 ≠ images[i]}: zero when every value is an 8-bit
// pixel k/255. Each product and quotient rounded once, as NumPy's float32 does (no FMA contraction:
// __fmul_rn, __fdiv_rn); a count, so the integer atomics' order does not matter.
extern "C" __global__ void count_off_levels(const float* images, long long n, unsigned long long* off_levels) {
    unsigned long long off = 0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float v = images[i];
        if (__fdiv_rn(rintf(__fmul_rn(v, 255.0f)), 255.0f) != v) ++off;  // NaN too: it equals nothing
    }
    if (off) atomicAdd(off_levels, off);
}

// One value as the kernel reads it: rint(v·levels) where levels ≠ 0 (the pixel k), else v; then
// as float, as bf16 bits (rounded to nearest even, as persistent.bf16_bits), or as a byte k.
__device__ __forceinline__ float level(float v, int levels) {
    return levels ? rintf(__fmul_rn(v, (float)levels)) : v;
}
__device__ __forceinline__ void store(float* dst, float v) { *dst = v; }
__device__ __forceinline__ void store(unsigned short* dst, float v) {
    const unsigned bits = __float_as_uint(v);
    *dst = (unsigned short)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ void store(unsigned char* dst, float v) { *dst = (unsigned char)v; }

// dst[r, c] = level(src[r, c]) for c < features, 0 for features ≤ c < padded; a block per row.
template <typename Out>
__device__ void kernel_rows(const float* __restrict__ src, int features, int padded, int levels, Out* __restrict__ dst) {
    const long long r = blockIdx.x;
    for (int c = threadIdx.x; c < padded; c += blockDim.x)
        store(dst + r * padded + c, c < features ? level(src[r * features + c], levels) : 0.0f);
}

extern "C" __global__ void kernel_images_f32(const float* src, int features, int padded, int levels, float* dst) {
    kernel_rows(src, features, padded, levels, dst);
}
extern "C" __global__ void kernel_images_bf16(const float* src, int features, int padded, int levels,
                                              unsigned short* dst) {
    kernel_rows(src, features, padded, levels, dst);
}
extern "C" __global__ void kernel_images_u8(const float* src, int features, int padded, int levels, unsigned char* dst) {
    kernel_rows(src, features, padded, levels, dst);
}
