// How fast the blocks of a 16-block cluster exchange data through distributed shared memory, the
// way the persistent kernels do: every block sends PER_BLOCK bytes, an equal share to every block
// of the cluster (itself included), with stores that count their bytes on the receiver's
// mbarrier, and waits until its own share from every block has arrived. Launched by
// dsmem_exchange.py, which puts kernels/cluster.cuh before this text and defines SHARE, the bytes
// from one block to one block (a multiple of 512).
//
// Patterns (one warp instruction = 32 lanes):
//   0  scatter, 16 B a lane: lane l stores to block l % 16 (two lanes a block an instruction)
//   1  one block an instruction, 16 B a lane (512 contiguous bytes)
//   2  one block an instruction, 8 B a lane (256 contiguous bytes)
//   3  one bulk copy a block (cp.async.bulk shared::cluster), issued by one lane each
// `warps` warps share the instructions; thread 0 of block 0 records, per round, the cycles its
// warp took to issue its part and the cycles until all its block's bytes had arrived.

#define CLUSTER 16
#define PER_BLOCK (SHARE * CLUSTER)      // bytes every block sends (and receives) a round

__device__ __forceinline__ void bulk_send(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "r"(smem_addr(src)), "r"(bytes), "r"(bar) : "memory");
}

extern "C" __global__ void __launch_bounds__(512, 1)
exchange(int pattern, int warps, int rounds, long long* cycles) {
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned long long* bar = reinterpret_cast<unsigned long long*>(smem);
    unsigned char* source = smem + 16;                // PER_BLOCK bytes to send
    unsigned char* inbox = source + PER_BLOCK;        // [CLUSTER][SHARE]: block c's stores land in row c
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const unsigned rank = cluster_rank();
    for (int i = tid; i < PER_BLOCK / 4; i += blockDim.x) reinterpret_cast<float*>(source)[i] = (float)i;
    if (tid == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(bar)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    cluster_sync();
    unsigned char* row = inbox + rank * SHARE;       // where this block's stores land in every block
    const float4 v = make_float4(lane, warp, 1.0f, 2.0f);
    for (int round = 0; round < rounds; ++round) {
        if (tid == 0) mbarrier_expect(bar, PER_BLOCK);
        __syncthreads();
        const long long start = clock64();
        if (warp < warps) {
            if (pattern == 0) {
                for (int i = warp; i < PER_BLOCK / 512; i += warps)
                    send4(remote(row + (2 * i + lane / CLUSTER) * 16, lane % CLUSTER), v, remote(bar, lane % CLUSTER));
            } else if (pattern == 1 || pattern == 2) {
                const int bytes = pattern == 1 ? 16 : 8, per_block = SHARE / (32 * bytes);
                for (int i = warp; i < CLUSTER * per_block; i += warps) {
                    const unsigned to = (rank + i / per_block) % CLUSTER;
                    const unsigned at = remote(row + (i % per_block) * 32 * bytes + lane * bytes, to);
                    if (bytes == 16) send4(at, v, remote(bar, to));
                    else send2(at, v.x, v.y, remote(bar, to));
                }
            } else {
                for (int c = warp * 32 + lane; c < CLUSTER; c += 32 * warps) {
                    const unsigned to = (rank + c) % CLUSTER;
                    bulk_send(remote(row, to), source + c * SHARE, SHARE, remote(bar, to));
                }
            }
        }
        const long long issued = clock64();
        mbarrier_wait(bar, round & 1);
        const long long arrived = clock64();
        if (rank == 0 && tid == 0) { cycles[2 * round] = issued - start; cycles[2 * round + 1] = arrived - start; }
        __syncthreads();
        cluster_sync();  // no block starts the next round's stores before every block's wait is over
    }
}
