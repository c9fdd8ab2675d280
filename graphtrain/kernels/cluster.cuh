// Thread-block cluster and asynchronous-copy primitives shared by the persistent kernels
// (persistent.cu, persistent_mlp.cu). Not a kernel file: a launcher lists it in `headers`, and
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
__device__ __forceinline__ void copy4_async(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Rows of step `step` over `num_samples` samples in batches of `batch`: the last one may be short.
__device__ __forceinline__ int step_rows(int step, int batch, int num_samples) {
    return min(batch, num_samples - step * batch);
}
