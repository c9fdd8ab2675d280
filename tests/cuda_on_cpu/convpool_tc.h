// What convpool_tc.cu uses beyond prelude.h and tf32.h, emulated on the CPU (tests/test_convpool_tc_emulated.py,
// tests/test_convpool_tc_weight_grad_emulated.py): the grid's size, int2, cvt.rna.tf32.f32 (to the
// nearest TF32 value, ties away from zero: the 13 low mantissa bits rounded off by magnitude) and
// tf32_mma.cuh's mma_tf32, mma_tf32_k4 and ldmatrix_tf32; and the harnesses' files and grid launches (convpool_launch.inc,
// convpool_tc_launch.inc).
#include <string>
#include "tf32.h"
inline unsigned tf32_rna_emulated(float v) { return (float_bits(v) + 0x1000u) & 0xffffe000u; }
inline void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) { mma_tf32_emulated(d, a, b); }
inline void mma_tf32_k4(float (&d)[4], const unsigned (&a)[2], unsigned b) { mma_tf32_k4_emulated(d, a, b); }
inline void ldmatrix_tf32(unsigned (&a)[4], const unsigned* row) { ldmatrix_tf32_emulated(a, row); }
thread_local Dim3 gridDim;  // the launch's grid, as each of its threads sees it
struct int2 { int x, y; };
inline int2 make_int2(int a, int b) { return {a, b}; }
template <class T> std::vector<T> read_file(const std::string& path) {
    FILE* f = fopen(path.c_str(), "rb"); if (!f) { perror(path.c_str()); exit(1); }
    fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
    std::vector<T> v(n / sizeof(T)); if (fread(v.data(), 1, n, f) != (size_t)n) exit(1); fclose(f); return v;
}
template <class T> void write_file(const std::string& path, const std::vector<T>& v) {
    FILE* f = fopen(path.c_str(), "wb"); fwrite(v.data(), sizeof(T), v.size(), f); fclose(f);
}
// body() on each block (x, z) of a gx × 1 × gz grid of `threads` std::threads (the kernels are not
// cooperative: a block at a time), each block with its barrier, its warps and its shared memory
// (filled with 0x5A: a word read before it is written shows).
template <class Body> void run_grid(unsigned gx, unsigned gz, unsigned threads, unsigned smem_bytes, Body body) {
    for (unsigned id = 0; id < gx * gz; ++id) {
        std::barrier<> bar(threads);
        std::vector<unsigned char> smem(smem_bytes + 16, 0x5A);
        BlockCtx block{&bar, (unsigned char*)(((uintptr_t)smem.data() + 15) & ~(uintptr_t)15), smem_bytes};
        std::vector<WarpCtx> warps(threads / 32);
        std::vector<std::thread> pool;
        for (unsigned t = 0; t < threads; ++t)
            pool.emplace_back([&, t] {
                blockIdx = {id % gx, 0, id / gx};
                gridDim = {gx, 1, gz};
                threadIdx = {t, 0, 0};
                block_ctx = &block;
                warp_ctx = &warps[t / 32];
                body();
            });
        for (auto& th : pool) th.join();
    }
}
