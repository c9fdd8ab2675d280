// Phase probes of the persistent kernels (scripts/probes/persistent_phases.py, persistent_mlp_phases.py):
// SM clock readings by thread 0 of cluster block 0 (of block PROBE_RANK == 0 where a kernel's launcher
// defines it otherwise: the grid kernel's blockIdx.x), compiled only with -DPROBES. Without it every
// probe is `((void)0)` and `Probes` an empty struct, so the kernel's code is as if they were absent.
// Not a kernel file: a launcher lists it in `headers`.
//
// A probe build takes its probe table where the kernel's `metrics` would go (it is never run with
// measure on), and its slots from the launcher's list: `-DPROBE_SLOT_<NAME>=slot` for each name, so a
// probe the list lacks fails to compile. Two kinds:
//   PROBE_STAMP(p, step, NAME)      table[step][slot] = the clock, for the first PROBE_STEPS steps
//                                   (PROBE_SLOTS a step): the script takes the differences.
//   PROBE_END(p, NAME, layer)       the cycles since the last probe added to slot (NAME, layer) of
//                                   a table in shared memory (the layout's probe region; PROBE_LAYERS
//                                   layers a name), copied out by p.finish at the end of the launch.
//   PROBE_START(p, counts), PROBE_FINISH(p)  zero the shared counts (PROBE_PHASES × PROBE_LAYERS)
//                                   and start the clock; copy the counts out.
//   PROBE_SYNC()                    a block barrier, so that a phase that ends without one takes the
//                                   slowest thread's time (probe builds only: it slows the step).

#ifdef PROBES
#ifndef PROBE_RANK
#define PROBE_RANK cluster_rank()
#endif
struct Probes {
    long long* table;  // global: the stamps, or where finish copies the phase counts
    long long* counts = nullptr;  // shared: the phase counts (PROBE_END)
    long long mark = 0;
    bool on;
    __device__ explicit Probes(void* metrics) : table(static_cast<long long*>(metrics)) {
        on = PROBE_RANK == 0 && threadIdx.x == 0;
    }
#ifdef PROBE_STEPS  // a kernel that stamps
    __device__ __forceinline__ void stamp(int step, int slot) {
        if (on && step < PROBE_STEPS) table[step * PROBE_SLOTS + slot] = clock64();
    }
#endif
    // Phase counts in shared memory (not local: a local array misses L1 behind the images' loads,
    // and each count would cost an L2 round trip), zeroed here; the clock starts.
    __device__ __forceinline__ void start(long long* shared_counts, int slots) {
        counts = shared_counts;
        if (on)
            for (int i = 0; i < slots; ++i) counts[i] = 0;
        mark = clock64();
    }
    __device__ __forceinline__ void end(int slot) {
        if (on) {
            const long long now = clock64();
            counts[slot] += now - mark;
            mark = now;
        }
    }
    __device__ __forceinline__ void finish(int slots) {
        if (on)
            for (int i = 0; i < slots; ++i) table[i] = counts[i];
    }
};
#define PROBE_STAMP(p, step, name) (p).stamp((step), PROBE_SLOT_##name)
#define PROBE_END(p, name, layer) (p).end(PROBE_SLOT_##name * PROBE_LAYERS + (layer))
#define PROBE_SYNC() __syncthreads()
#define PROBE_START(p, shared_counts) (p).start((shared_counts), PROBE_PHASES * PROBE_LAYERS)
#define PROBE_FINISH(p) (p).finish(PROBE_PHASES * PROBE_LAYERS)
#else
struct Probes {
    __device__ explicit Probes(void*) {}
};
#define PROBE_STAMP(p, step, name) ((void)0)
#define PROBE_END(p, name, layer) ((void)0)
#define PROBE_SYNC() ((void)0)
#define PROBE_START(p, shared_counts) ((void)0)
#define PROBE_FINISH(p) ((void)0)
#endif
