// What persistent_cnn.cu uses beyond prelude.h, emulated on the CPU (tests/test_persistent_cnn_emulated.py):
// the TF32 mma.sync m16n8k8 (and the m16n8k4 convpool_tc.cu's forward may take) computed from its
// 32 lanes' registers as PTX lays out its fragments
// (tf32_mma.cuh), each operand read as the hardware reads it (its top 19 bits), the sums in double;
// and the few math functions optim.cu's schedule and update take.
#include "prelude.h"
using std::max;
inline unsigned __float_as_uint(float f) { return float_bits(f); }
inline float cospif(float x) { return (float)cos(M_PI * (double)x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }

// D += A·B, m16n8k8: a = A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4]; b = B[t][g], B[t+4][g];
// d = D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1] (g = lane / 4, t = lane % 4).
inline void mma_tf32_emulated(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    WarpCtx& w = *warp_ctx; const int l = lane_id();
    for (int q = 0; q < 4; ++q) w.u[l][q] = a[q];
    w.u[l][4] = b[0]; w.u[l][5] = b[1];
    w.bar.arrive_and_wait();
    auto tf32 = [](unsigned bits) { return (double)__uint_as_float(bits & 0xffffe000u); };
    auto A = [&](int r, int k) { return tf32(w.u[(r % 8) * 4 + k % 4][(r >= 8 ? 1 : 0) + (k >= 4 ? 2 : 0)]); };
    auto B = [&](int k, int n) { return tf32(w.u[n * 4 + k % 4][4 + (k >= 4)]); };
    const int g = l >> 2, t = l & 3;
    const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    float out[4];
    for (int i = 0; i < 4; ++i) {
        double s = 0.0;
        for (int k = 0; k < 8; ++k) s += A(rows[i], k) * B(k, cols[i]);
        out[i] = d[i] + (float)s;
    }
    w.bar.arrive_and_wait();
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}
// ldmatrix .x4 .b16 of 32-bit words (tf32_mma.cuh's ldmatrix_tf32): lane l receives word l % 4 of the
// row whose address lane 8j + l / 4 gave, for each matrix j.
inline void ldmatrix_tf32_emulated(unsigned (&a)[4], const unsigned* row) {
    WarpCtx& w = *warp_ctx; const int l = lane_id();
    w.p[l] = row;
    w.bar.arrive_and_wait();
    for (int j = 0; j < 4; ++j) a[j] = static_cast<const unsigned*>(w.p[8 * j + l / 4])[l % 4];
    w.bar.arrive_and_wait();
}
// D += A·B, m16n8k4: a = A[g][t], A[g+8][t]; b = B[t][g]: the m16n8k8's fragments with k = t + 4's
// words 0, so the above with those words zero.
inline void mma_tf32_k4_emulated(float (&d)[4], const unsigned (&a)[2], unsigned b) {
    const unsigned a8[4] = {a[0], a[1], 0u, 0u}, b8[2] = {b, 0u};
    mma_tf32_emulated(d, a8, b8);
}
