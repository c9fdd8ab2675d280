// How often one SM sub-partition issues a tensor-core mma.sync of the shapes the persistent
// kernels use: each warp runs `rounds` × 8 independent mma (eight accumulators, so no mma waits
// for the one before), and thread 0 records the cycles between two block-wide barriers. Launched
// by mma_rate.py with one block of 4, 8 or 16 warps (1, 2 or 4 a sub-partition). The operands
// are arbitrary bits: the rate does not depend on the values.
//
// Kinds: 0  m16n8k8  TF32 in, fp32 sums  (persistent.cu, and the fp32 MLP's passes)
//        1  m16n8k16 bf16 in, fp32 sums  (the bf16 MLP's hidden layers)
//        2  m16n8k4  TF32 in, fp32 sums

template <int KIND>
__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    if constexpr (KIND == 0)
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    else if constexpr (KIND == 1)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    else
        asm volatile("mma.sync.aligned.m16n8k4.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(b[0]));
}

template <int KIND>
__device__ void run(int rounds, long long* cycles, float* sink) {
    const unsigned seed = threadIdx.x * 2654435761u;
    const unsigned a[4] = {seed, seed * 3u, seed * 5u, seed * 7u}, b[2] = {seed * 11u, seed * 13u};
    float d[8][4] = {};
    __syncthreads();
    const long long start = clock64();
    for (int r = 0; r < rounds; ++r)
#pragma unroll
        for (int k = 0; k < 8; ++k) mma<KIND>(d[k], a, b);
    __syncthreads();
    if (threadIdx.x == 0) cycles[0] = clock64() - start;
    float s = 0.0f;  // keeps the mma from being dropped
#pragma unroll
    for (int k = 0; k < 8; ++k) s += d[k][0] + d[k][1] + d[k][2] + d[k][3];
    sink[threadIdx.x] = s;
}

extern "C" __global__ void __launch_bounds__(512, 1) mma_rate(int kind, int rounds, long long* cycles, float* sink) {
    if (kind == 0) run<0>(rounds, cycles, sink);
    else if (kind == 1) run<1>(rounds, cycles, sink);
    else run<2>(rounds, cycles, sink);
}
