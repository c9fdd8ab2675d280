// The grid barrier of the persistent rung's cooperative kernels (persistent_wide.cu, persistent_cnn.cu;
// BLOCKS: the grid's blocks, each passing the same barriers). Every block's writes before it are
// visible to every block after it. Thread 0 of each block adds one arrival to a counter that only
// grows (zeroed before the launch) and waits for it to reach the arrivals of this barrier's round: a
// whole multiple of BLOCKS. The counter is an integer, so the barrier adds no float in any order.
// Memory order (PTX's model): the block barrier orders the block's writes before thread 0's
// fence.acq_rel.gpu, which is cumulative, so they are visible at gpu scope before its arrival (a
// relaxed atomic after the fence); the wait's ld.acquire.gpu that sees every arrival then orders every
// other block's writes before the block barrier that releases this block's threads. No fence.sc (what
// __threadfence is) on either side: the release fence and the acquiring load are all the order needs.
// grid_arrive and grid_wait are its two halves, for a block with work of its own between them (work
// that no other block reads before a later barrier): grid_wait(counter, grid_arrive(counter)) is
// grid_sync(counter). The arrival's target is thread 0's alone. (An arrival that returns nothing, a
// red with thread 0 counting the rounds itself, so that it polls at once, made the 784³ MLP's epoch
// slower on an H200, scripts/benchmarks/epoch_ab.py --only persistent: kept as an atomic.)
__device__ __forceinline__ unsigned long long grid_arrive(unsigned long long* counter) {
    __syncthreads();
    unsigned long long target = 0;
    if (threadIdx.x == 0) {
        unsigned long long arrived;
        asm volatile("fence.acq_rel.gpu;\n\tatom.relaxed.gpu.global.add.u64 %0, [%1], 1;"
                     : "=l"(arrived) : "l"(counter) : "memory");
        target = (arrived / BLOCKS + 1) * BLOCKS;
    }
    return target;
}
__device__ __forceinline__ void grid_wait(unsigned long long* counter, unsigned long long target) {
    if (threadIdx.x == 0) {
        unsigned long long now;
        do {
            asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(now) : "l"(counter) : "memory");
        } while (now < target);
    }
    __syncthreads();
}
__device__ __forceinline__ void grid_sync(unsigned long long* counter) { grid_wait(counter, grid_arrive(counter)); }
