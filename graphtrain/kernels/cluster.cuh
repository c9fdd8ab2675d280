// Thread-block cluster, mbarrier and asynchronous-copy primitives shared by the persistent kernels
// (persistent.cu, persistent_mlp.cu, persistent_wide.cu). Not a kernel file: a launcher lists it in `headers`, and
// its text goes before the kernel's source (so the compile cache sees it).

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r;
}
// Arrive (release: this block's writes, remote ones included, become visible) and wait (acquire).
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// `p`'s address in the shared memory of cluster block `rank`.
__device__ __forceinline__ unsigned remote(const void* p, unsigned rank) {
    unsigned out;
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(rank));
    return out;
}
// `p` (this block's shared memory) as a generic address into cluster block `rank`'s: plain loads and
// stores through it reach that block's shared memory.
template <class T>
__device__ __forceinline__ T* peer_shared(T* p, unsigned rank) {
    unsigned long long out;
    asm("mapa.u64 %0, %1, %2;" : "=l"(out) : "l"(p), "r"(rank));
    return reinterpret_cast<T*>(out);
}
// A double from cluster block memory (an address from remote()).
__device__ __forceinline__ double load_remote_f64(unsigned addr) {
    double v; asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(addr) : "memory"); return v;
}
__device__ __forceinline__ void copy4_async(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void copy16_async(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
// Stores into cluster block `rank`'s shared memory that count their bytes on that block's
// mbarrier `bar` (addresses from remote()): the receiver waits on its own barrier, and no fence
// or cluster barrier stands between the two blocks.
__device__ __forceinline__ void send(unsigned addr, float v, unsigned bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
                 :: "r"(addr), "f"(v), "r"(bar) : "memory");
}
__device__ __forceinline__ void send2(unsigned addr, float v0, float v1, unsigned bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];"
                 :: "r"(addr), "f"(v0), "f"(v1), "r"(bar) : "memory");
}
__device__ __forceinline__ void send4(unsigned addr, float4 v, unsigned bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
                 :: "r"(addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar) : "memory");
}
// `bar` ready for `count` arrivals a phase. After every barrier is set up, one thread makes them
// visible to the cluster (mbarrier_init_fence) before the cluster barrier that lets others use them.
__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// This block's one arrival of a phase, with the bytes the phase will receive.
__device__ __forceinline__ void mbarrier_expect(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" :: "r"(smem_addr(bar)) : "memory");
}
// Wait for the phase of parity `parity` to complete: its arrivals made and its bytes received.
// CTA scope: what it orders is this block's shared memory (a cluster-scope acquire would also
// invalidate the L1 cache after every wait). The suspend-time hint (10 ms, a bound: a waiting
// warp wakes when the phase completes) keeps a waiting warp from retrying every few cycles and
// taking issue slots from the working warps of its sub-partition.
__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned parity) {
    asm volatile("{\n\t.reg .pred done;\n"
                 "wait_%=:\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, %2;\n\t"
                 "@!done bra wait_%=;\n}" :: "r"(smem_addr(bar)), "r"(parity), "r"(10000000) : "memory");
}

// A bulk copy (the SM's copy engine) of `bytes` (a multiple of 16, both ends 16-byte aligned) of
// this block's shared memory into cluster block memory (`dst`, `bar` from remote()), counted on
// the receiver's barrier `bar`. The source must have been made visible to the copy engine:
// written, then fence_proxy_async by the writers, then a block barrier.
__device__ __forceinline__ void send_bulk(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "r"(smem_addr(src)), "r"(bytes), "r"(bar) : "memory");
}
// A bulk copy of `bytes` (a multiple of 16, both ends 16-byte aligned) of global memory into this
// block's shared memory, counted on its barrier `bar`.
__device__ __forceinline__ void copy_bulk(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
// Orders this thread's writes to shared memory before the copy engine's reads of them.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// metrics[0], metrics[1] += Σ loss, Σ correct over the threads of every block of the cluster, in a
// fixed order (a warp's lanes by butterfly, the block's first `warps` warps in order into totals, the
// blocks in rank order by block 0's thread 0), so the same bits every run. totals: 2 + 2·warps
// doubles of shared memory. Every thread of every block calls it; it ends past a cluster barrier.
__device__ void cluster_metrics(double* totals, int warps, double loss, double correct, double* metrics) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    double* per_warp = totals + 2;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        loss += __shfl_xor_sync(0xffffffffu, loss, o);
        correct += __shfl_xor_sync(0xffffffffu, correct, o);
    }
    if (lane == 0 && warp < warps) { per_warp[2 * warp] = loss; per_warp[2 * warp + 1] = correct; }
    __syncthreads();
    if (tid == 0) {
        double l = 0.0, c = 0.0;
        for (int i = 0; i < warps; ++i) { l += per_warp[2 * i]; c += per_warp[2 * i + 1]; }
        totals[0] = l; totals[1] = c;
    }
    cluster_sync();
    if (cluster_rank() == 0 && tid == 0) {
        double l = 0.0, c = 0.0;
        unsigned blocks;
        asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(blocks));
        for (unsigned k = 0; k < blocks; ++k) {
            l += load_remote_f64(remote(totals, k));
            c += load_remote_f64(remote(totals + 1, k));
        }
        metrics[0] += l; metrics[1] += c;
    }
}

// Rows of step `step` over `num_samples` samples in batches of `batch`: the last one may be short.
__device__ __forceinline__ int step_rows(int step, int batch, int num_samples) {
    return min(batch, num_samples - step * batch);
}
