// Copies from global into shared memory that run while the thread goes on (cp.async, sm_80 and
// later), taken in groups: a thread commits the copies it issued as a group, and waits until at most
// N of its groups are still in flight. A copy completes for its own thread only: the threads that
// read what other threads copied wait for theirs and then meet at a barrier (__syncwarp for a warp).
// Not a kernel file: a launcher lists it in `headers`.

// 16 bytes from src (global, 16-byte aligned) to dst (shared, 16-byte aligned); with src_bytes 0 the
// copy reads nothing and writes 16 zero bytes.
__device__ __forceinline__ void copy16_async_or_zero(void* dst, const void* src, unsigned src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Until at most N of this thread's committed groups are in flight (the older ones have landed).
template <int N>
__device__ __forceinline__ void copies_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

// A hint: fetch `bytes` (a multiple of 16, 16-byte aligned) of global memory into L2. From sm_90 one
// bulk prefetch (the copy engine's: no register, no wait); before, a prefetch a 128-byte line.
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
#else
    for (unsigned at = 0; at < bytes; at += 128) asm volatile("prefetch.global.L2 [%0];" :: "l"(static_cast<const char*>(p) + at));
#endif
}
