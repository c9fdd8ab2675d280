// The CUDA features persistent_wide.cu uses, emulated on the CPU (tests/test_persistent_wide_emulated.py):
// a std::thread per CUDA thread; __syncthreads a barrier of the block's threads, __syncwarp of the
// warp's, cluster_sync of the cluster's (its blocks' shared memory reached by peer_shared's pointers and remote()'s
// addresses; an mbarrier's phases, with st.async's bytes, kept in a table under a lock); cp.async's copies made at the wait for their group; a warp's mma.sync,
// movmatrix and shuffles computed from its 32 lanes' registers, exchanged through the warp's own
// memory between two barriers of its lanes, each register holding what PTX says it holds (the
// fragment layouts of mma.m16n8k16 and movmatrix.m8n8, the lower k in a register's low half); global
// memory plain host memory, its atomics and fences the compiler's. An mma's sums run in double.
#include <algorithm>
#include <atomic>
#include <barrier>
#include <condition_variable>
#include <map>
#include <mutex>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <thread>
#include <vector>
#define __device__
#define __global__
#define __forceinline__
#define __noinline__
#define __launch_bounds__(...)
#define __cluster_dims__(...)
#define __align__(n)
struct Dim3 { unsigned x, y, z; };
thread_local Dim3 threadIdx, blockIdx;
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
using std::min;
inline float __int_as_float(int v) { float f; memcpy(&f, &v, 4); return f; }
inline float __uint_as_float(unsigned v) { float f; memcpy(&f, &v, 4); return f; }
inline unsigned float_bits(float f) { unsigned v; memcpy(&v, &f, 4); return v; }
template <class T> T __ldg(const T* p) { return *p; }
template <class T> T __ldcg(const T* p) { return *p; }
template <class T, class U> void __stcg(T* p, U v) { *p = v; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }

struct BlockCtx { std::barrier<>* bar; unsigned char* smem; unsigned smem_bytes; };
struct WarpCtx { std::barrier<> bar{32}; unsigned u[32][8]; float f[32][4]; const void* p[32]; };
thread_local BlockCtx* block_ctx;
thread_local WarpCtx* warp_ctx;
inline void __syncthreads() { block_ctx->bar->arrive_and_wait(); }
// A thread-block cluster (cluster.cuh's): a barrier of its blocks' threads, and its blocks' shared memory.
struct ClusterCtx { std::barrier<>* bar; unsigned char* smem[16]; };
thread_local ClusterCtx* cluster_ctx;
inline void cluster_sync() { cluster_ctx->bar->arrive_and_wait(); }
template <class T> T* peer_shared(T* p, unsigned rank) {
    return reinterpret_cast<T*>(cluster_ctx->smem[rank] + (reinterpret_cast<unsigned char*>(p) - block_ctx->smem));
}
inline unsigned char* block_smem() { return block_ctx->smem; }
// cluster.cuh's addresses in a cluster block's shared memory: its rank in the top byte, the offset below.
inline unsigned remote(const void* p, unsigned rank) {
    return (rank << 24) | (unsigned)(reinterpret_cast<const unsigned char*>(p) - block_ctx->smem);
}
inline unsigned char* remote_at(unsigned addr) { return cluster_ctx->smem[addr >> 24] + (addr & 0xffffffu); }
// An mbarrier: its state in a table beside the shared memory (keyed by its address), under one lock.
// A phase completes when its pending arrivals and its transaction bytes are both zero (the bytes may
// land before the arrival that expects them: they count below zero meanwhile).
struct Mbarrier { unsigned count, pending; long long bytes; unsigned phase; };
inline std::mutex mbarrier_lock;
inline std::condition_variable mbarrier_done;
inline std::map<const void*, Mbarrier> mbarriers;
inline void mbarrier_step(Mbarrier& m) {
    if (m.pending == 0 && m.bytes == 0) { m.phase ^= 1u; m.pending = m.count; mbarrier_done.notify_all(); }
}
inline void mbarrier_init(unsigned long long* bar, unsigned count) {
    std::lock_guard<std::mutex> hold(mbarrier_lock);
    mbarriers[bar] = Mbarrier{count, count, 0, 0};
}
inline void mbarrier_init_fence() {}
inline void mbarrier_expect(unsigned long long* bar, unsigned bytes) {
    std::lock_guard<std::mutex> hold(mbarrier_lock);
    Mbarrier& m = mbarriers.at(bar);
    m.bytes += bytes; --m.pending; mbarrier_step(m);
}
// Waits until the phase of parity `parity` has completed (the current phase's parity is the other).
inline void mbarrier_wait(unsigned long long* bar, unsigned parity) {
    std::unique_lock<std::mutex> hold(mbarrier_lock);
    mbarrier_done.wait(hold, [&] { return mbarriers.at(bar).phase != parity; });
}
// st.async: the values stored, then their bytes counted on the receiver's barrier.
inline void send2(unsigned addr, float v0, float v1, unsigned bar) {
    const float v[2] = {v0, v1};
    std::lock_guard<std::mutex> hold(mbarrier_lock);
    memcpy(remote_at(addr), v, sizeof v);
    Mbarrier& m = mbarriers.at(remote_at(bar));
    m.bytes -= (long long)sizeof v; mbarrier_step(m);
}
inline int lane_id() { return threadIdx.x & 31; }

inline float bf16_to_float(unsigned short b) { return __uint_as_float((unsigned)b << 16); }
inline unsigned short float_to_bf16(float f) {  // round to nearest even
    unsigned v = float_bits(f);
    return (unsigned short)((v + 0x7fffu + ((v >> 16) & 1u)) >> 16);
}
inline unsigned bf16x2(float lo, float hi) { return (unsigned)float_to_bf16(lo) | ((unsigned)float_to_bf16(hi) << 16); }
inline float half_of(unsigned r, int h) { return bf16_to_float((unsigned short)(h ? r >> 16 : r & 0xffffu)); }

// D += A·B, m16n8k16, fragments as PTX lays them out.
inline void mma_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    WarpCtx& w = *warp_ctx; const int l = lane_id();
    for (int q = 0; q < 4; ++q) w.u[l][q] = a[q];
    w.u[l][4] = b[0]; w.u[l][5] = b[1];
    w.bar.arrive_and_wait();
    auto A = [&](int r, int k) {
        const int reg = (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0), kk = k % 8;
        return half_of(w.u[(r % 8) * 4 + kk / 2][reg], kk % 2);
    };
    auto B = [&](int k, int n) { const int kk = k % 8; return half_of(w.u[n * 4 + kk / 2][4 + (k >= 8)], kk % 2); };
    const int g = l >> 2, t = l & 3;
    const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    float out[4];
    for (int i = 0; i < 4; ++i) {
        double s = 0.0;
        for (int k = 0; k < 16; ++k) s += (double)A(rows[i], k) * (double)B(k, cols[i]);
        out[i] = d[i] + (float)s;
    }
    w.bar.arrive_and_wait();
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}
inline unsigned movmatrix_trans(unsigned r) {
    WarpCtx& w = *warp_ctx; const int l = lane_id();
    w.u[l][6] = r;
    w.bar.arrive_and_wait();
    const int g = l >> 2, t = l & 3;
    auto M = [&](int row, int col) { return (unsigned short)((w.u[row * 4 + col / 2][6] >> (16 * (col % 2))) & 0xffffu); };
    const unsigned out = (unsigned)M(2 * t, g) | ((unsigned)M(2 * t + 1, g) << 16);
    w.bar.arrive_and_wait();
    return out;
}
inline float __shfl_xor_sync(unsigned, float v, int o) {
    WarpCtx& w = *warp_ctx; const int l = lane_id();
    w.f[l][0] = v; w.bar.arrive_and_wait();
    const float out = w.f[l ^ o][0]; w.bar.arrive_and_wait();
    return out;
}
inline float __shfl_sync(unsigned, float v, int src) {
    WarpCtx& w = *warp_ctx; const int l = lane_id();
    w.f[l][0] = v; w.bar.arrive_and_wait();
    const float out = w.f[src & 31][0]; w.bar.arrive_and_wait();
    return out;
}
inline unsigned __ballot_sync(unsigned, bool p) {
    WarpCtx& w = *warp_ctx; const int l = lane_id();
    w.u[l][7] = p; w.bar.arrive_and_wait();
    unsigned out = 0;
    for (int i = 0; i < 32; ++i) out |= (w.u[i][7] ? 1u : 0u) << i;
    w.bar.arrive_and_wait();
    return out;
}
inline void __syncwarp() { warp_ctx->bar.arrive_and_wait(); }
// async_copy.cuh's copies: a thread's copies are made when it waits for their group, not before (the
// latest the GPU may make them), so that a read before the wait sees the buffer's old bytes.
struct PendingCopy { void* dst; const void* src; unsigned bytes; };
thread_local std::vector<PendingCopy> open_copies;
thread_local std::vector<std::vector<PendingCopy>> copy_groups;  // committed, oldest first
inline void copy16_async_or_zero(void* dst, const void* src, unsigned src_bytes) { open_copies.push_back({dst, src, src_bytes}); }
inline void prefetch_l2(const void*, unsigned) {}  // a hint to L2: nothing to emulate
inline void copies_commit() { copy_groups.push_back(std::move(open_copies)); open_copies.clear(); }
template <int N> void copies_wait() {
    while (copy_groups.size() > (size_t)N) {
        for (const PendingCopy& c : copy_groups.front()) {
            memset(c.dst, 0, 16);
            memcpy(c.dst, c.src, c.bytes);
        }
        copy_groups.erase(copy_groups.begin());
    }
}
// smem_layout.cuh's, without the special register
#define SMEM_REGION(s, base, member, OFFSET) do {                                                   \
        static_assert(sizeof(*s.member) == OFFSET##_ELEMENT, "the layout table's element type of " #OFFSET); \
        s.member = reinterpret_cast<decltype(s.member)>((base) + OFFSET);                           \
    } while (0)
inline void check_shared_bytes(unsigned bytes) {
    if (block_ctx->smem_bytes != bytes) { fprintf(stderr, "shared bytes %u != %u\n", block_ctx->smem_bytes, bytes); abort(); }
}
