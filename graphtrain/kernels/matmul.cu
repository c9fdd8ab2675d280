// The baseline's matrix product: one thread per output element, no tiling, no shared memory.
// Row-major, with the same argument order as the row-major cuBLAS helper, so a later rung can
// swap one for the other:
//   C[i, j] = alpha · Σ_p op(A)[i, p] · op(B)[p, j] + beta · C[i, j]
//   op(A)[i, p] = transa ? A[p·lda + i] : A[i·lda + p],  op(B)[p, j] = transb ? B[j·ldb + p] : B[p·ldb + j]
extern "C" __global__ void gemm_naive(int transa, int transb, int m, int n, int k, float alpha,
                                      const float* a, int lda, const float* b, int ldb,
                                      float beta, float* c, int ldc) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    int i = blockIdx.y * blockDim.y + threadIdx.y;
    if (i >= m || j >= n) return;
    float acc = 0.0f;
    for (int p = 0; p < k; ++p) {
        float av = transa ? a[(long long)p * lda + i] : a[(long long)i * lda + p];
        float bv = transb ? b[(long long)j * ldb + p] : b[(long long)p * ldb + j];
        acc += av * bv;
    }
    // beta == 0 must not read C: it may hold anything, NaN included (BLAS semantics).
    float out = alpha * acc;
    if (beta != 0.0f) out += beta * c[(long long)i * ldc + j];
    c[(long long)i * ldc + j] = out;
}
