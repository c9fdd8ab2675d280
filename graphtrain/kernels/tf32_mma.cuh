// Tensor-core products at near-fp32 accuracy from TF32 operands, shared by the persistent kernels
// (persistent.cu, persistent_mlp.cu). Not a kernel file: a launcher lists it in `headers`, and
// its text goes before the kernel's source.

// D += A·B for one m16n8k8 tile, TF32 inputs, fp32 D. Fragments (g = lane / 4, t = lane % 4):
// a = A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]; b = B[t][g], B[t+4][g];
// d = D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1].
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// a = A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4] of a 16×8 tile of 32-bit words in shared memory, in one
// ldmatrix: four 8×8 b16 matrices, each an 8×4-word block, lane i receiving word i % 4 of row i / 4
// of each (matrix j's rows at lanes 8j..8j+7's addresses). So a lane's `row` is the tile's row
// lane % 8 + 8·(lane / 8 % 2) at column 4·(lane / 16), 16-byte aligned. One instruction, not four loads.
__device__ __forceinline__ void ldmatrix_tf32(unsigned (&a)[4], const unsigned* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(static_cast<unsigned>(__cvta_generic_to_shared(row))));
}
// D += A·B for one m16n8k4 tile (half an m16n8k8's k): a = A[g][t], A[g+8][t]; b = B[t][g]; d as above.
__device__ __forceinline__ void mma_tf32_k4(float (&d)[4], const unsigned (&a)[2], unsigned b) {
    asm volatile("mma.sync.aligned.m16n8k4.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b));
}
// v = hi + lo exactly: hi is v with its low 13 mantissa bits cleared (a TF32 value), lo the
// rest. The mma reads only a TF32 operand's top 19 bits, so lo loses ~2⁻¹⁰ of itself, ~2⁻²⁰ of
// v. (Two integer/float instructions; cvt.rna.tf32 takes about five.)
template <int N>
__device__ __forceinline__ void split_tf32(const float (&v)[N], unsigned (&hi)[N], unsigned (&lo)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        hi[i] = __float_as_uint(v[i]) & 0xffffe000u;
        lo[i] = __float_as_uint(v[i] - __uint_as_float(hi[i]));
    }
}
// The passes of a tile's product, each into a sum of its own so that the chains of dependent
// mma stay one per k-step: hi·hi, lo_a·hi_b, hi_a·lo_b. The caller adds them last, small terms
// first.
struct Sums3 { float hh[4] = {}, lh[4] = {}, hl[4] = {}; };
__device__ __forceinline__ float total(const Sums3& d, int i) { return d.hh[i] + (d.lh[i] + d.hl[i]); }
// x·v for x from the images (the A operand) and v = hi + lo: where the images are 8-bit pixels
// held as k (PIXEL_LEVELS, defined by the kernel file), x is exact in TF32 and two passes suffice
// (x·hi, x·lo); else x too is split and lo_x·hi_v is the third.
__device__ __forceinline__ void mma_x(Sums3& d, const float (&x)[4], const unsigned (&v_hi)[2], const unsigned (&v_lo)[2]) {
    unsigned x_hi[4];
#if PIXEL_LEVELS
#pragma unroll
    for (int i = 0; i < 4; ++i) x_hi[i] = __float_as_uint(x[i]);
#else
    unsigned x_lo[4];
    split_tf32(x, x_hi, x_lo);
    mma_tf32(d.lh, x_lo, v_hi);
#endif
    mma_tf32(d.hl, x_hi, v_lo);
    mma_tf32(d.hh, x_hi, v_hi);
}
// The three passes of a tile's product, each into its own sum of a Sums3 (three independent chains).
__device__ __forceinline__ void mma_3xtf32(Sums3& d, const unsigned (&a_hi)[4], const unsigned (&a_lo)[4],
                                           const unsigned (&b_hi)[2], const unsigned (&b_lo)[2]) {
    mma_tf32(d.lh, a_lo, b_hi);
    mma_tf32(d.hl, a_hi, b_lo);
    mma_tf32(d.hh, a_hi, b_hi);
}
__device__ __forceinline__ void mma_split(Sums3& d, const float (&a)[4], const float (&b)[2]) {
    unsigned a_hi[4], a_lo[4], b_hi[2], b_lo[2];
    split_tf32(a, a_hi, a_lo);
    split_tf32(b, b_hi, b_lo);
    mma_3xtf32(d, a_hi, a_lo, b_hi, b_lo);
}
