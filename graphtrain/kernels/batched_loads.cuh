// Shared memory filled from global memory by a block's threads, the loads batched: a persistent
// kernel's staging of values it reads again (THREADS: the block's threads). Not a kernel file: a
// launcher lists it in `headers`.

// store(i, load(i)) for i < COUNT over the block's threads, a thread's loads issued AHEAD at a time
// before their stores (in a strided loop, whose trip count the compiler does not know, it waits on each
// load in turn: an L2 round trip an element); stage_batched: dst[i] = load(i), the same.
template <int COUNT, typename Load, typename Store>
__device__ __forceinline__ void stage_batched_to(Load load, Store store) {
    using T = decltype(load(0));
    constexpr int TRIPS = (COUNT + THREADS - 1) / THREADS, AHEAD = 8;
#pragma unroll
    for (int j0 = 0; j0 < TRIPS; j0 += AHEAD) {
        T v[AHEAD];
#pragma unroll
        for (int j = 0; j < AHEAD; ++j) {
            const int i = threadIdx.x + (j0 + j) * THREADS;
            if (j0 + j < TRIPS && i < COUNT) v[j] = load(i);
        }
#pragma unroll
        for (int j = 0; j < AHEAD; ++j) {
            const int i = threadIdx.x + (j0 + j) * THREADS;
            if (j0 + j < TRIPS && i < COUNT) store(i, v[j]);
        }
    }
}
template <int COUNT, typename T, typename Load>
__device__ __forceinline__ void stage_batched(T* dst, Load load) {
    stage_batched_to<COUNT>(load, [&](int i, T v) { dst[i] = v; });
}
