// The grid barrier of the persistent rung's cooperative kernels (persistent_wide.cu, persistent_cnn.cu;
// BLOCKS: the grid's blocks, each passing the same barriers). Every block's writes before it are
// visible to every block after it. Thread 0 of each block adds one arrival to a counter that only
// grows (zeroed before the launch), the release fence ordering the block's writes (made before the
// block barrier) before it, and waits for the counter to reach the arrivals of this barrier's round: a
// whole multiple of BLOCKS. The counter is an integer, so the barrier adds no float in any order.
// (The pattern of cooperative_groups' grid sync, which NVRTC compiles only with the CUDA headers.)
__device__ __forceinline__ void grid_sync(unsigned long long* counter) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned long long arrived = atomicAdd(counter, 1ull);
        const unsigned long long target = (arrived / BLOCKS + 1) * BLOCKS;
        unsigned long long now;
        do {
            asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(now) : "l"(counter) : "memory");
        } while (now < target);
        __threadfence();
    }
    __syncthreads();
}
