// Tensor-core products from bf16 operands with fp32 sums (the persistent kernels' BF16 builds). Not a
// kernel file: a launcher lists it in `headers`, and its text goes before the kernel's source.

// D += A·B for one m16n8k16 tile, bf16 inputs two to a register (the lower k in the low half),
// fp32 D. Fragments (g = lane / 4, t = lane % 4): a = A[g][2t..2t+1], A[g+8][2t..2t+1],
// A[g][2t+8..2t+9], A[g+8][2t+8..2t+9]; b = B[2t..2t+1][g], B[2t+8..2t+9][g];
// d = D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1].
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// Two floats as a bf16 pair, each rounded to nearest even: lo in the low half (one instruction).
__device__ __forceinline__ unsigned bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// The low halves of two bf16 pairs as one pair (a's low, b's low), and the high halves.
__device__ __forceinline__ unsigned low_halves(unsigned a, unsigned b) { return __byte_perm(a, b, 0x5410); }
__device__ __forceinline__ unsigned high_halves(unsigned a, unsigned b) { return __byte_perm(a, b, 0x7632); }
// One pass's sums of a tile (tf32_mma.cuh's Sums3 keeps three).
struct Sums1 { float d[4] = {}; };
__device__ __forceinline__ float total(const Sums1& s, int i) { return s.d[i]; }
// Four 8×8 matrices of 16-bit values from shared memory: lanes 8q..8q+7 give the addresses of
// matrix q's eight rows (16 bytes each, 16-byte aligned), and r[q] = M_q[g][2t..2t+1], an mma
// fragment's register (g = lane / 4, t = lane % 4). Volatile, and a memory clobber: it must not
// move across the barriers and stores that make the matrices ready.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
// The same, each matrix transposed: r[q] = (M_q[2t][g], M_q[2t+1][g]).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
// An 8×8 matrix of 16-bit values held as mma fragments (r = M[g][2t..2t+1]), transposed across the
// warp: the result is (M[2t][g], M[2t+1][g]). An A fragment's register of a row-major operand so
// becomes a B fragment's register of its transpose.
__device__ __forceinline__ unsigned movmatrix_trans(unsigned r) {
    unsigned t;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(t) : "r"(r));
    return t;
}
