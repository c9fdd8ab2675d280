// `persistent` for wide MLPs: LAYERS hidden layers of HIDDEN units (ReLU) and a softmax head, trained by
// a cooperative grid of BLOCKS blocks, one per SM; one launch runs an epoch. The weights stay in the
// blocks' shared memory; the activations and input gradients of the whole batch go through global
// memory (L2), between grid-wide barriers.
//
// Block c owns S = OWN units U_c = [c·S, c·S + S) of every hidden layer (the units past HIDDEN, up
// to HIDDEN_PAD = BLOCKS·S, are padding: zero weights, zero activations, zero gradients). Its products
// are its cluster's: SPLIT blocks (1 or 2; cluster g = c / SPLIT, the block's rank in it h = c mod SPLIT)
// share UNITS = SPLIT·S units U_g = [g·UNITS, g·UNITS + UNITS), and block h multiplies every product over
// its part K_h of the product's inputs (k-steps [h·span, h·span + span), span = ⌈k-steps / SPLIT⌉); the
// cluster's blocks then trade their sums for each other's units through distributed shared memory
// (sum_over_warps) and each finishes its own U_c. Why split: every block reads the whole of each
// exchanged matrix it multiplies (its rows are the batch), ~200 KB a product at the 784³ MLP, and those
// bytes bound the products; a cluster of two reads half each and trades 4 KB. A block keeps the fp32
// master weights that its products read and its updates write:
//   w1   W_1[U_g, K_h]          the rows of layer 1 (its forward, and its update from dh_1[:, U_g])
//   wc   W_l[K_h, U_g], l ≥ 2   the columns of the other hidden layers (dX, and the update from dh_l)
//   wh   W_h[:, U_c]            the head's columns, and a copy of the head's bias in every block
// (With SPLIT 1, U_g = U_c and K_h every input: below, read U_g and K_h so.)
// A hidden layer l ≥ 2 is read by rows in its forward: each block publishes its columns (of K_h), updated,
// as bf16 into a global copy of W_l (one of two, by step parity), which the next step's forward reads.
//
// A step of `rows` samples x, h_0 = x, the exchanged values bf16:
//
//   X (the step before; rows r ≡ c (mod BLOCKS))  x[r] = images[order[r]]        (published)
//   F_l, l = 1..L     h_l[:, U_c] = relu(h_{l−1} · W_l[U_c, :]ᵀ + b_l[U_c])      (published, l < L; the
//                     cluster's: h_{l−1}[:, K_h] · W_l[U_g, K_h]ᵀ, then summed over h)
//   F_L (the head)    P_c = h_L[:, U_c] · W_h[:, U_c]ᵀ  (fp32, the units in order) (published)
//   S, rows r ≡ c     z = Σ_{c' = 0..BLOCKS−1} P_c'[r] + b_h (in that order),
//   (mod BLOCKS)      dz = (softmax(z) − onehot(y)) / rows                      (published)
//   H (every block)   dh_L[:, U_c] = dz · W_h[:, U_c] ⊙ [h_L[:, U_c] > 0]       (published, L ≥ 2)
//                     W_h[:, U_c] −= lr · dzᵀ h_L[:, U_c],  b_h −= lr · Σ_r dz  (after dh_L's publication)
//   B_l, l = L..2     dh_{l−1}[:, U_c] = dh_l · W_l[:, U_c] ⊙ [h_{l−1}[:, U_c] > 0]  (published, l ≥ 3)
//                     W_l[:, U_c] −= lr · dh_lᵀ h_{l−1}[:, U_c]    (the new columns published as bf16)
//   (after B_2, or H) W_1[U_c, :] −= lr · dh_1[:, U_c]ᵀ x
//   each dh_l, once published:  b_l[U_c] −= lr · Σ_r dh_l[:, U_c]
// The updates that no other block reads (the head's, b_l's) run after the block's arrival at the grid
// barrier that follows dh_l's publication, before its wait: off the path that every block waits on.
//
// A grid barrier follows each phase whose output another block reads: F_1..F_L, S, H (L ≥ 2) and
// B_L..B_3, 2·LAYERS a step (LAYERS = 1: two). The update of W_1 and the next step's F_1 read nothing
// another block writes between them (F_1 publishes h_1, which only F_2 reads), so no barrier parts
// them. A buffer written in one phase and read in the next is rewritten a step later, with at least
// one barrier between its readers and its next writer: one buffer per exchange suffices, and two for
// the published weights (read in F_l, rewritten in B_l of the same step) and for x (read in F_1 and
// W_1's update, and the next step's gathered in X, after every block's W_1 update of the step before,
// which read that buffer, and before the barrier after S, which precedes the next step's F_1: with
// L ≥ 2 written while the barrier after F_L fills (its arrival made, its wait not begun; its loads
// issued before F_L's partial logits), with L = 1 after it; step 0's x gathered before the first
// barrier). The samples of its rows, their labels and images are read ahead in the barrier after
// F_1 (prefetch_rows).
// Why gather: x's rows are random rows of the whole training set (tens of MB, past what L2 keeps),
// which F_1 and W_1's update each read whole from every block; gathered once, they read a buffer of
// the batch's size from L2, as F_2 reads h_1.
//
// Within a cluster (SPLIT 2) three things cross between its blocks' shared memory. A product's sums of
// the other block's units go into that block's inbox as stores that count their bytes on its barrier
// for the slot (st.async on inbox_full, an mbarrier): the receiver waits on its own barrier, and nothing
// holds up the sender (with a cluster barrier instead, its release waited for every store the block had
// in flight, the published weights' too). A block's trades are numbered n = step·(2·L − 1) + the
// product's index in the step (trade_of); trade n uses slot n mod 2, whose barrier completes phase
// (n / 2) mod 2 once the receiver's own arrival (with the bytes it expects) is made and the bytes have
// landed. A block sends into a slot again two trades later, past a grid barrier that the receiver
// reaches only after reading the slot: of any two gaps between consecutive products only one (B_2 to
// the next step's F_1) lacks a grid barrier. h_l[:, U_c]ᵀ, l < L, goes into the other block's ht
// (plain stores), read by its update of W_{l+1} (its B operand) past grid barriers; dh_1[:, U_c]ᵀ into
// its dht, read by its update of W_1 past the cluster barrier that begins it (release and acquire),
// and both are written again a step later, past barriers that follow every read. A block's last
// writes into the other (B_2's trade, dht) come before that cluster barrier, so neither block leaves
// the launch while the other may still write into it.
//
// So every block reads its part K_h of each exchanged matrix (x, h_1..h_{L−1}, dh_L..dh_2, x again) once a step, with
// the weights in place; dX and the update of layer l read dh_l in one pass: its mma fragments, as
// loaded for dh_l · W_l[:, U_c], transposed in registers (movmatrix), are dh_lᵀ's for the update.
// Sums run in a fixed order without atomics (each product's k split over the warps, their partial
// sums added as a fixed tree; the barrier's counter is an integer): the same seed gives the same
// weights bit for bit.
//
// Two builds of the products' operand loads (STAGE_DEPTH, from the launcher's `variant`):
//   registers (STAGE_DEPTH 0)  a warp loads each k-step's A and B fragments (from L2, or the masters
//              from shared memory) straight into registers, PREFETCH k-steps ahead of the one it
//              multiplies (a ring of PREFETCH + 1 k-steps' fragments in registers, refilled in place);
//   staged (STAGE_DEPTH ≥ 2)   each warp copies its k-steps (cp.async) into a ring of STAGE_DEPTH
//              slabs of its own in shared memory, STAGE_DEPTH − 1 k-steps ahead of the one it
//              multiplies: the whole batch's 16 inputs of the k-step (the rows of x or of h_l,
//              zero past the step's rows) and, in a forward of l ≥ 2, the block's
//              rows of the published W_l at those inputs; the fragments then come from the slab.
// Why loads ahead: a warp takes ⌈49 / 8⌉ = 7 k-steps of a 784-input product, and with one k-step
// in flight it waits for an L2 round trip at each, so a product costs ~7 round trips whatever its
// bytes; PREFETCH p in flight wait ~7 / p (until L2's bandwidth binds). Until the ring was refilled in
// place (each_kstep says how) every depth waited a round trip a k-step, which is why on an H100 the
// 784³ MLP's products took as long 1, 2 and 3 k-steps ahead
// (results/persistent-wide-phases-prefetch-jhu-mlp784x3-h100.md), and as long in 49 blocks of 16
// units as in 98 of 8 (results/persistent-wide-check-h100.md), which read half the bytes of L2
// between them (every block reads each exchanged matrix whole) and waited as many round trips.
// The sums, their order and every value are the same in either build and at any depth (the same
// fragments from the same bf16 values): the same weights bit for bit.
//
// Precision (the bf16 rung's): the hidden layers' products read bf16 operands (the images as bf16,
// 8-bit pixels as k, exact; the weights rounded as they are loaded, or published as bf16; h_l and
// dh_l exchanged as bf16) with fp32 sums (mma.sync m16n8k16), into fp32 master weights; the head and
// the softmax in fp32.
//
// Compile-time (from kernels/persistent_wide.py): BLOCKS, UNITS (a cluster's: 8 or 16), SPLIT (1 or 2;
// 2 needs sm_90's clusters), SLOTS (the warps' partial sums held at once: WARPS, or half), THREADS,
// FEATURES, FEATURE_STRIDE (whole tiles of 16), HIDDEN, HIDDEN_PAD, LAYERS, CLASSES (≤ 32), BATCH,
// PIXEL_LEVELS (255: the images are k of pixels k/255; 0: bf16-rounded floats), the strides W1_STRIDE,
// WC_STRIDE, HT_STRIDE, PART_STRIDE, PARTIAL_ROW, STAGE_DEPTH, PREFETCH, the shared-memory layout
// SMEM_* and the workspace's WS_* (the offsets of its regions in global memory). Needs bf16 mma,
// movmatrix and cp.async (sm_80 and later; clusters of two, sm_90). With -DPROBES (probes.cuh;
// PROBE_RANK blockIdx.x) thread 0 of block 0 adds the cycles of each phase (the launcher's PHASES)
// into a table in shared memory, written out where the metrics would go
// (scripts/probes/persistent_wide_phases.py).

#define WARPS (THREADS / 32)
#define OWN (UNITS / SPLIT)            // the units a block finishes (of its cluster's UNITS)
#define GROUPS (BLOCKS / SPLIT)        // the clusters
#define NT (UNITS / 8)                 // a cluster's units in mma columns of 8
#define MT ((BATCH + 15) / 16)         // the batch in mma rows of 16
#define ROWS16 (MT * 16)
#define F_KSTEPS (FEATURE_STRIDE / 16) // layer 1's inputs in k-steps of 16
#define H_KSTEPS (HIDDEN_PAD / 16)     // a hidden layer's
#define SPAN(KSTEPS) (((KSTEPS) + SPLIT - 1) / SPLIT)  // the k-steps of a product a block takes (the last, fewer)
#define F_SPAN SPAN(F_KSTEPS)          // of layer 1's products
#define H_SPAN SPAN(H_KSTEPS)          // of a hidden layer's
#define PIECE (ROWS16 * OWN)           // a block's piece of an exchanged matrix (bf16 values)
#define R_OWN ((BATCH + BLOCKS - 1) / BLOCKS)  // rows a block owns for the softmax, at most
#define X_UNIT (PIXEL_LEVELS ? 1.0f / PIXEL_LEVELS : 1.0f)
#define SLAB_ROWS (ROWS16 * 16)          // a staged k-step of the rows: ROWS16 rows of 16 inputs (bf16)
#define SLAB (SLAB_ROWS + UNITS * 16)    // and of the block's rows of a published W_l, after them

#if UNITS % 8 != 0 || NT < 1 || NT > 2 || (SPLIT != 1 && SPLIT != 2) || BLOCKS % SPLIT != 0 || OWN % 8 != 0 \
    || (SLOTS != WARPS && 2 * SLOTS != WARPS) || HIDDEN_PAD != GROUPS * UNITS || HIDDEN_PAD % 16 != 0 || HIDDEN > HIDDEN_PAD \
    || FEATURE_STRIDE % 16 != 0 || FEATURES > FEATURE_STRIDE || CLASSES > 32 || CLASSES < 1 || LAYERS < 1 \
    || THREADS != 256 || W1_STRIDE < 16 * F_SPAN || WC_STRIDE < 16 * H_SPAN || W1_STRIDE % 32 != 0 \
    || WC_STRIDE % 32 != 0 || HT_STRIDE < ROWS16 || HT_STRIDE % 2 != 0 || PART_STRIDE < UNITS || PART_STRIDE % 2 != 0 \
    || STAGE_DEPTH == 1 || STAGE_DEPTH < 0 || PREFETCH < 1 || PARTIAL_ROW < BLOCKS * CLASSES || PARTIAL_ROW % 4 != 0
#error "persistent_wide.cu: unsupported sizes"
#endif

typedef unsigned short bf16_bits;  // a bf16 value as its 16 bits

// ---- shared memory (the layout table: kernels/persistent_wide.py, WideShape.layout) -------------
struct Smem {
    double* totals;     // [2·WARPS]                   the warps' loss and correct counts, at the end
    float* w1;          // [UNITS][W1_STRIDE]           W_1[U_g, K_h], zero past FEATURES and HIDDEN (swizzled: master_at)
    float* wc;          // [LAYERS−1][UNITS][WC_STRIDE] wc[j][i] = W_l[i0 + i][g0 + j], l = 2..LAYERS, i over K_h, zero
                        //                              past HIDDEN (alike)
    float* wh;          // [CLASSES][OWN]               W_h[:, U_c]
    float* b;           // [LAYERS][OWN]                b_l[U_c]
    float* bh;          // [CLASSES]                    the head's bias (every block's copy)
    int* row_samples;   // [2][R_OWN]                   the owned rows' samples (−1 past the step's rows) and
    int* row_labels;    // [2][R_OWN]                   their labels, by step parity (read ahead: prefetch_rows)
    float* h_last;      // [ROWS16][OWN]                h_L[:, U_c], zero past the step's rows
    bf16_bits* ht;      // [LAYERS−1][UNITS][HT_STRIDE] h_l[:, U_g]ᵀ, l < LAYERS (their ReLU masks too)
    bf16_bits* dht;     // [UNITS][HT_STRIDE]           dh_1[:, U_g]ᵀ
    float* dh;          // [ROWS16][OWN]                dh_l[:, U_c], zero past the step's rows
    float* part;        // [SLOTS][ROWS16][PART_STRIDE] partial sums of a product, by warp; in the softmax
                        //   [R_OWN][PARTIAL_ROW], the owned rows' partial logits (no product runs then); in
                        //   the head's update [WARPS − 1][CLASSES][OWN + 1], warps 1..'s sums of its gradient
    float* inbox;       // [2][ROWS16][OWN]             (SPLIT 2) the other block's sums of U_c, by trade parity
    unsigned long long* inbox_full;  // [2]             (SPLIT 2) each slot's mbarrier: one arrival and its bytes a trade
    float* dl;          // [ROWS16][CLASSES]            dlogits of every row, zero past the step's
#if STAGE_DEPTH
    bf16_bits* stage;   // [WARPS][STAGE_DEPTH][SLAB]     each warp's ring of staged k-steps (the staged build's)
#endif
#ifdef PROBES
    long long* probe_counts;  // [PROBE_PHASES][PROBE_LAYERS]  the probe build's phase counts
#endif
};

__device__ Smem carve(unsigned char* base) {
    Smem s;
    SMEM_REGION(s, base, totals, SMEM_TOTALS);
    SMEM_REGION(s, base, w1, SMEM_W1);
    SMEM_REGION(s, base, wc, SMEM_WC);
    SMEM_REGION(s, base, wh, SMEM_WH);
    SMEM_REGION(s, base, b, SMEM_B);
    SMEM_REGION(s, base, bh, SMEM_BH);
    SMEM_REGION(s, base, row_samples, SMEM_ROW_SAMPLES);
    SMEM_REGION(s, base, row_labels, SMEM_ROW_LABELS);
    SMEM_REGION(s, base, h_last, SMEM_H_LAST);
    SMEM_REGION(s, base, ht, SMEM_HT);
    SMEM_REGION(s, base, dht, SMEM_DHT);
    SMEM_REGION(s, base, dh, SMEM_DH);
    SMEM_REGION(s, base, part, SMEM_PART);
    SMEM_REGION(s, base, inbox, SMEM_INBOX);
    SMEM_REGION(s, base, inbox_full, SMEM_INBOX_FULL);
    SMEM_REGION(s, base, dl, SMEM_DL);
#if STAGE_DEPTH
    SMEM_REGION(s, base, stage, SMEM_STAGE);
#endif
#ifdef PROBES
    SMEM_REGION(s, base, probe_counts, SMEM_PROBE_COUNTS);
#endif
    check_shared_bytes(SMEM_BYTES);
    return s;
}

// ---- global workspace (its table too: WideShape.workspace; the launcher zeroes `barrier`) ---------
struct Workspace {
    unsigned long long* barrier;  // the grid barrier's arrivals
    double* block_metrics;        // [BLOCKS][2]                       each block's loss and correct count
    bf16_bits* x;                 // [2][FEATURE_STRIDE / 16][ROWS16][16] x of the steps, by step parity
    bf16_bits* act;               // [LAYERS−1][BLOCKS][ROWS16][OWN] h_l, l < LAYERS, block c's units U_c at piece c
    bf16_bits* grad;              // [LAYERS−1][BLOCKS][ROWS16][OWN] dh_l, l ≥ 2, alike
    bf16_bits* wg;                // [LAYERS−1][2][HIDDEN_PAD²]         W_l, l ≥ 2, by step parity (published_at)
    float* partials;              // [BATCH][PARTIAL_ROW]              P_c, the head's partial logits, by row ([BLOCKS][CLASSES])
    float* dz;                    // [BATCH][CLASSES]                  dlogits
};

__device__ Workspace workspace_at(unsigned char* base) {
    return Workspace{reinterpret_cast<unsigned long long*>(base + WS_BARRIER), reinterpret_cast<double*>(base + WS_BLOCK_METRICS),
                     reinterpret_cast<bf16_bits*>(base + WS_X),
                     reinterpret_cast<bf16_bits*>(base + WS_ACT), reinterpret_cast<bf16_bits*>(base + WS_GRAD),
                     reinterpret_cast<bf16_bits*>(base + WS_WG), reinterpret_cast<float*>(base + WS_PARTIALS),
                     reinterpret_cast<float*>(base + WS_DZ)};
}
__device__ __forceinline__ bf16_bits* x_of(const Workspace& ws, int step) { return ws.x + (step & 1) * ROWS16 * FEATURE_STRIDE; }
__device__ __forceinline__ bf16_bits* act_of(const Workspace& ws, int l) { return ws.act + (l - 1) * BLOCKS * PIECE; }
__device__ __forceinline__ bf16_bits* grad_of(const Workspace& ws, int l) { return ws.grad + (l - 2) * BLOCKS * PIECE; }
__device__ __forceinline__ bf16_bits* wg_of(const Workspace& ws, int l, int parity) {
    return ws.wg + (long long)((l - 2) * 2 + parity) * HIDDEN_PAD * HIDDEN_PAD;
}
// A published copy of W_l is laid out for the forward's B fragments: each cluster's rows (its outputs U_g)
// a tile of their own, k-step after k-step, W_l[o][k] at published_at(o, k), so that a warp's B load
// (units 8n + g, inputs k .. k + 3 of a k-step) reads 256 contiguous bytes, not a sector of each of
// eight rows. (A cluster's inputs U_g of a row, which its updates write, lie in one k-step:
// published_at(o, g0 + j) = published_at(o, j) + published_at(0, g0) for j < UNITS.)
__device__ __forceinline__ int published_at(int o, int k) {
    return ((unsigned)o / UNITS * H_KSTEPS + (unsigned)k / 16) * (UNITS * 16) + (unsigned)o % UNITS * 16 + (unsigned)k % 16;
}
__device__ __forceinline__ float* wc_of(const Smem& s, int l) { return s.wc + (l - 2) * UNITS * WC_STRIDE; }
__device__ __forceinline__ bf16_bits* ht_of(const Smem& s, int l) { return s.ht + (l - 1) * UNITS * HT_STRIDE; }
#if STAGE_DEPTH
__device__ __forceinline__ bf16_bits* ring_of(const Smem& s) { return s.stage; }
#else
__device__ __forceinline__ bf16_bits* ring_of(const Smem&) { return nullptr; }
#endif
// The end of a phase in the probe build: a block barrier (the slowest thread's time), then the count.
#define PHASE_END(p, name, layer) do { PROBE_SYNC(); PROBE_END(p, name, layer); } while (0)

// ---- the grid barrier: grid_sync.cuh's grid_sync(counter) --------------------------------------

// ---- the operands of the products ----------------------------------------------------------------
// An A fragment (16 rows × 16 inputs k0..k0+15) with its k-slots permuted (a permutation of k leaves a
// product as it is): lane (g, t) holds inputs k0 + 4t .. k0 + 4t + 3 of rows g and g + 8, one 8-byte
// load a row: a[0] = (row g; k0+4t, +1), a[1] = (row g+8; k0+4t, +1), a[2] = (row g; k0+4t+2, +3),
// a[3] = (row g+8; k0+4t+2, +3). The B fragments take the same slots: b[0] = inputs k0+4t, +1 and
// b[1] = k0+4t+2, +3 of unit g.
__device__ __forceinline__ void a_fragment(unsigned (&a)[4], uint2 row_g, uint2 row_g8) {
    a[0] = row_g.x; a[1] = row_g8.x; a[2] = row_g.y; a[3] = row_g8.y;
}

// A staged k-step (the staged build's slab): row r's 16 inputs at slab[16r ..], as the copies of
// 16 bytes c = lane + 32j (j < MT) put them, chunk c holding row c / 2's inputs 8(c mod 2) .. + 7. The
// A fragments of every m-tile read from it (a_fragment's layout: a half-warp's 8-byte loads take
// four rows of 32 bytes, 128 contiguous bytes, on distinct banks).
__device__ __forceinline__ void staged_fragments(unsigned (&a)[MT][4], const bf16_bits* slab) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        a_fragment(a[mt], *reinterpret_cast<const uint2*>(slab + (16 * mt + g) * 16 + 4 * t),
                   *reinterpret_cast<const uint2*>(slab + (16 * mt + g + 8) * 16 + 4 * t));
}

// The rows of an exchanged matrix of the batch, in pieces of WIDTH inputs, ROWS16 rows each (input k
// of row r at (k / WIDTH)·ROWS16·WIDTH + r·WIDTH + k mod WIDTH): h_l or dh_l block-major (WIDTH =
// UNITS, block c's units at piece c), x in k-step pieces (WIDTH = 16). load(a, k) the
// fragments of every m-tile at the lane's inputs k = k0 + 4t (rows past the step's are zero there,
// written so by their producer); stage(slab, ks) the lane's copies of k-step ks.
template <int WIDTH>
struct ExchangedRows {
    const bf16_bits* base;
    __device__ __forceinline__ const bf16_bits* at(int r, int k) const {  // (unsigned: k / WIDTH a shift)
        return base + (unsigned)k / WIDTH * (ROWS16 * WIDTH) + r * WIDTH + (unsigned)k % WIDTH;
    }
    __device__ __forceinline__ void stage(bf16_bits* slab, int ks) const {
        const int lane = threadIdx.x & 31, h = lane & 1;
#pragma unroll
        for (int j = 0; j < MT; ++j) {
            const int r = (lane >> 1) + 16 * j;
            copy16_async_or_zero(slab + 16 * r + 8 * h, at(r, 16 * ks + 8 * h), 16);
        }
    }
    // One address a k-step, row g's: the other rows' loads lie a constant distance from it (an immediate
    // offset in each load; from row 0's address, the compiler spent four 64-bit adds on each load's).
    __device__ __forceinline__ void load(unsigned (&a)[MT][4], int k) const {
        const int g = (threadIdx.x & 31) >> 2;
        const bf16_bits* p = at(g, k);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            a_fragment(a[mt], __ldcg(reinterpret_cast<const uint2*>(p + 16 * mt * WIDTH)),
                       __ldcg(reinterpret_cast<const uint2*>(p + (16 * mt + 8) * WIDTH)));
    }
};
typedef ExchangedRows<OWN> HiddenRows;             // h_l, dh_l
typedef ExchangedRows<16> InputRows;               // x

// The fp32 master weights (w1, wc) are unit-major, a unit's inputs a row of `stride` floats (a multiple
// of 32: whole rows of the banks), input k of unit j at j·stride + (k ^ master_swizzle(j)). The swizzle
// flips bit 4 of k (the half of the banks) by unit bits 0 ^ 2, and bit 1 (the pair within a 16-byte
// quad) by unit bit 1, so that both ways the products touch them hit 32 banks:
//   the B fragments' 16-byte loads (lanes g = 0, 1 of a load phase: units 2m, 2m + 1, the quads of 16
//   inputs): the two units on different halves;
//   the updates' 4-byte loads and stores (lane (g, t): unit 2t (or 2t + 1) at input kmap(g), whose bits
//   0, 2, 3 run over g): bits 1 and 4 run over t, where unswizzled every t hits g's eight banks.
__device__ __forceinline__ int master_swizzle(int j) { return (((j ^ (j >> 2)) & 1) << 4) | (j & 2); }
__device__ __forceinline__ float* master_at(float* w, int stride, int j, int k) {
    return w + j * stride + (k ^ master_swizzle(j));
}
__device__ __forceinline__ const float* master_at(const float* w, int stride, int j, int k) {
    return w + j * stride + (k ^ master_swizzle(j));
}

// B fragments from fp32 master weights in shared memory (master_at's rows), rounded to bf16 as loaded:
// the lane's four inputs k .. k + 3 of unit 8n + g, one 16-byte load of the quad they are swizzled into
// (bit 1 of the swizzle swaps its halves).
// `first`: the input that the rows' element 0 holds (the first of the block's K_h).
// (Weights: load(b, k) the B fragments at the lane's inputs k = k0 + 4t; in the staged build stage(slab,
// ks) the lane's copies of k-step ks, if any, and load_staged(b, slab, k) the fragments.)
struct MasterWeights {
    const float* w;
    int stride, first;
    __device__ __forceinline__ void stage(bf16_bits*, int) const {}
    __device__ __forceinline__ void load_staged(unsigned (&b)[NT][2], const bf16_bits*, int k) const { load(b, k); }
    __device__ __forceinline__ void load(unsigned (&b)[NT][2], int k) const {
        const int g = (threadIdx.x & 31) >> 2;
        k -= first;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int j = 8 * n + g, swap = master_swizzle(j) & 2;
            const float4 v = *reinterpret_cast<const float4*>(w + j * stride + (k ^ (master_swizzle(j) & 16)));
            const unsigned lo = bf16x2(v.x, v.y), hi = bf16x2(v.z, v.w);
            b[n][0] = swap ? hi : lo;
            b[n][1] = swap ? lo : hi;
        }
    }
};
// B fragments from a published bf16 copy of W_l (published_at's layout), at the block's rows; staged, unit
// u's 16 inputs of the k-step at slab[SLAB_ROWS + 16u ..] (lanes 2u, 2u + 1 copy them).
struct PublishedWeights {
    const bf16_bits* rows;  // the cluster's tile: W_l[g0 + u][k] at rows[published_at(u, k)]
    __device__ __forceinline__ void stage(bf16_bits* slab, int ks) const {
        const int lane = threadIdx.x & 31, u = lane >> 1, h = lane & 1;
        if (u < UNITS) copy16_async_or_zero(slab + SLAB_ROWS + 16 * u + 8 * h, rows + published_at(u, 16 * ks + 8 * h), 16);
    }
    __device__ __forceinline__ void load_staged(unsigned (&b)[NT][2], const bf16_bits* slab, int k) const {
        const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const uint2 v = *reinterpret_cast<const uint2*>(slab + SLAB_ROWS + (8 * n + g) * 16 + k % 16);
            b[n][0] = v.x;
            b[n][1] = v.y;
        }
    }
    __device__ __forceinline__ void load(unsigned (&b)[NT][2], int k) const {
        const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const uint2 v = __ldcg(reinterpret_cast<const uint2*>(rows + published_at(8 * n + g, k)));
            b[n][0] = v.x;
            b[n][1] = v.y;
        }
    }
};
// No B operand (the update of W_1 alone, whose B comes from dh_1ᵀ in shared memory); made as
// MasterWeights are, so that update_product takes either.
struct NoWeights {
    const float* w;
    int stride, first;
    __device__ __forceinline__ void stage(bf16_bits*, int) const {}
    __device__ __forceinline__ void load_staged(unsigned (&)[NT][2], const bf16_bits*, int) const {}
    __device__ __forceinline__ void load(unsigned (&)[NT][2], int) const {}
};

template <bool FIRST, class A, class B> struct Either { typedef A type; };
template <class A, class B> struct Either<false, A, B> { typedef B type; };

// ---- the products --------------------------------------------------------------------------------
template <int M>
__device__ __forceinline__ void zero_sums(float (&sums)[M][NT][4]) {
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int q = 0; q < 4; ++q) sums[i][n][q] = 0.0f;
}

// body(ks, a, b) for warp w's k-steps ks = ks0 + w, ks0 + w + WARPS, ... < ks0 + ksteps of `rows`, a
// the A fragments of every m-tile at the k-step (a_fragment's layout) and b the weights' B fragments there (loaded before the
// body, which may update the weights). The registers build loads k-step i + PREFETCH's fragments while
// k-step i's are used; the staged build keeps STAGE_DEPTH − 1 k-steps' copies in flight in the warp's
// ring (`ring`: the block's rings, Smem::stage), k-step i in slab i mod STAGE_DEPTH: at iteration i
// it issues k-step i + STAGE_DEPTH − 1's copies into the slab that k-step i − 1 was read from (every
// lane past the __syncwarp after that read), commits them as one group (every iteration commits one,
// empty past the warp's k-steps, so the group count is the iteration's), and waits until k-step i's
// group, STAGE_DEPTH − 1 groups before the newest, has landed: its own copies, then every lane's (the
// __syncwarp after the wait).
template <class Rows, class Weights, class Body>
__device__ __forceinline__ void each_kstep(bf16_bits* ring, const Rows& rows, const Weights& weights, int ks0, int ksteps,
                                           Body body) {
    const int warp = threadIdx.x >> 5, t = threadIdx.x & 3;
#if STAGE_DEPTH
    const int mine = warp < ksteps ? (ksteps - 1 - warp) / WARPS + 1 : 0;  // the warp's k-steps
    bf16_bits* own = ring + warp * (STAGE_DEPTH * SLAB);
    auto stage = [&](int i) {  // k-step i of the warp's, into its slab
        if (i < mine) {
            rows.stage(own + (i % STAGE_DEPTH) * SLAB, ks0 + warp + i * WARPS);
            weights.stage(own + (i % STAGE_DEPTH) * SLAB, ks0 + warp + i * WARPS);
        }
        copies_commit();
    };
#pragma unroll
    for (int i = 0; i < STAGE_DEPTH - 1; ++i) stage(i);
    for (int i = 0; i < mine; ++i) {
        const int ks = ks0 + warp + i * WARPS;
        stage(i + STAGE_DEPTH - 1);
        copies_wait<STAGE_DEPTH - 1>();
        __syncwarp();
        const bf16_bits* slab = own + (i % STAGE_DEPTH) * SLAB;
        unsigned a[MT][4], b[NT][2];
        staged_fragments(a, slab);
        weights.load_staged(b, slab, 16 * ks + 4 * t);
        __syncwarp();  // (the slab read: the next iteration's copies may overwrite it)
        body(ks, a, b);
    }
#else
    // The warp's k-step i is ks = warp + i·WARPS; its fragments wait in slot i mod (PREFETCH + 1) of a ring
    // of PREFETCH + 1 slots (static indices: the j loop is unrolled by the ring's size), loaded PREFETCH
    // k-steps ahead: k-step i + PREFETCH's loads go into the slot k-step i − 1 was multiplied from,
    // before k-step i multiplies, so PREFETCH L2 round trips overlap and a k-step waits only at its
    // own products. Why no copies: a ring of PREFETCH slots refilled by copying the next k-step's
    // fragments into the slot just used makes every k-step wait for the load issued before it (the
    // copy reads the load's registers), whatever PREFETCH. (A B fragment loaded ahead is of other
    // inputs than the body's update writes: the same values.)
    constexpr int RING = PREFETCH + 1;
    const int mine = warp < ksteps ? (ksteps - 1 - warp) / WARPS + 1 : 0;  // the warp's k-steps
    auto k_of = [&](int i) { return 16 * (ks0 + warp + i * WARPS) + 4 * t; };  // the lane's inputs of k-step i
    unsigned a[RING][MT][4], b[RING][NT][2];
#pragma unroll
    for (int j = 0; j < PREFETCH; ++j)
        if (j < mine) {
            rows.load(a[j], k_of(j));
            weights.load(b[j], k_of(j));
        }
    for (int i0 = 0; i0 < mine; i0 += RING) {
#pragma unroll
        for (int j = 0; j < RING; ++j) {
            const int i = i0 + j;
            if (i < mine) {
                if (i + PREFETCH < mine) {
                    rows.load(a[(j + PREFETCH) % RING], k_of(i + PREFETCH));
                    weights.load(b[(j + PREFETCH) % RING], k_of(i + PREFETCH));
                }
                body(ks0 + warp + i * WARPS, a[j], b[j]);
            }
        }
    }
#endif
}

// acc = rows · Wᵀ over warp w's k-steps (m = rows, n = the block's units, k = inputs).
template <class Rows, class Weights>
__device__ __forceinline__ void forward_product(bf16_bits* ring, const Rows& rows, const Weights& weights, int ks0, int ksteps,
                                                float (&acc)[MT][NT][4]) {
    zero_sums(acc);
    each_kstep(ring, rows, weights, ks0, ksteps, [&](int, const unsigned (&a)[MT][4], const unsigned (&b)[NT][2]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < NT; ++n) mma_bf16(acc[mt][n], a[mt], b[n]);
    });
}

// The update of fp32 master weights w[j][i − first] (unit-major, `stride`) from G = rowsᵀ · bt over the
// batch (i = the inputs of warp w's k-steps, from ks0, j = the cluster's units: G[i][j] = Σ_r rows[r][i] ·
// bt[j][r]), w −= lr · G; with DX also acc = rows · wᵀ (the weights before the update, as
// forward_product), and with `published` the new weights as bf16 at published[published_at(i, j)].
// G's A operand is rows' fragments as loaded for acc, each 8×8 quarter transposed (movmatrix): the
// quarter a[q] holds M[ρ][c] = rows[16mt + ρ (+8)][k0 + kmap(c) (+2)], kmap(c) = 4⌊c/2⌋ + c mod 2, so
// its transpose is M[c][ρ] (m = input slot c, k = row ρ): {T(a[0]), T(a[2]), T(a[1]), T(a[3])} is the
// A fragment of the inputs k0 + kmap(g) (m-slots g) and k0 + kmap(g) + 2 (m-slots g + 8) over the
// tile's 16 rows. bt[j][r] (UNITS rows of HT_STRIDE bf16) gives B (k = rows, n = units) as 4-byte
// loads. The k-steps are the warp's own: no other warp reads or writes these weights meanwhile.
template <bool DX, class Rows>
__device__ __forceinline__ void update_product(bf16_bits* ring, const Rows& rows, int ks0, int ksteps, float* w, int stride,
                                               const bf16_bits* bt, float lr, bf16_bits* published,
                                               float (&acc)[MT][NT][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    if (DX) zero_sums(acc);
    const int kmap = 4 * (g >> 1) + (g & 1);
    typedef typename Either<DX, MasterWeights, NoWeights>::type Weights;  // DX's B: w before this k-step's update
    const int first = 16 * ks0;  // the input at w's element 0
    each_kstep(ring, rows, Weights{w, stride, first}, ks0, ksteps, [&](int ks, const unsigned (&a)[MT][4], const unsigned (&b)[NT][2]) {
        if (DX) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < NT; ++n) mma_bf16(acc[mt][n], a[mt], b[n]);
        }
        float grad[1][NT][4];
        zero_sums(grad);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const unsigned at[4] = {movmatrix_trans(a[mt][0]), movmatrix_trans(a[mt][2]), movmatrix_trans(a[mt][1]),
                                    movmatrix_trans(a[mt][3])};
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const bf16_bits* p = bt + (8 * n + g) * HT_STRIDE + 16 * mt + 2 * t;
                const unsigned b[2] = {*reinterpret_cast<const unsigned*>(p), *reinterpret_cast<const unsigned*>(p + 8)};
                mma_bf16(grad[0][n], at, b);
            }
        }
        // grad[0][n]: (input i, unit j), (i, j + 1), (i + 2, j), (i + 2, j + 1) for i = k0 + kmap, j = 8n + 2t
        const int i = 16 * ks + kmap;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int j = 8 * n + 2 * t;
            float* w00 = master_at(w, stride, j, i - first);
            float* w10 = master_at(w, stride, j + 1, i - first);
            float* w02 = master_at(w, stride, j, i - first + 2);
            float* w12 = master_at(w, stride, j + 1, i - first + 2);
            const float n00 = fmaf(-lr, grad[0][n][0], *w00), n10 = fmaf(-lr, grad[0][n][1], *w10);
            const float n02 = fmaf(-lr, grad[0][n][2], *w02), n12 = fmaf(-lr, grad[0][n][3], *w12);
            *w00 = n00; *w10 = n10; *w02 = n02; *w12 = n12;
            if (published != nullptr) {
                __stcg(reinterpret_cast<unsigned*>(published + published_at(i, j)), bf16x2(n00, n10));
                __stcg(reinterpret_cast<unsigned*>(published + published_at(i + 2, j)), bf16x2(n02, n12));
            }
        }
    });
}

// Σ over the warps of acc (each warp's sums over its k-steps) in a fixed order: with SLOTS = WARPS every
// warp's stored, then the WARPS sums of a value added as a tree of pairs by one thread (eight loads in
// flight); where the shared memory holds half as many (SLOTS = WARPS / 2, a large batch), warp w's sums
// first added into warp w + SLOTS's in a pass of their own (which took longer: the launcher's layout
// gives WARPS where they fit); finish(r, u, v0, v1) for each row r < ROWS16 and pair u, u + 1 of the
// block's own units U_c (u from 0). With SPLIT 2 each block of the
// cluster has summed over its half of the inputs, K_h: it sends the sums of the other block's units
// into that block's inbox (trade `trade`'s slot, counted on the slot's barrier there: the header says
// how the slots and phases go), and once its own barrier says the other's sums of its units have landed
// (`exchanged()` then) finishes its own units with the two halves' sums added (two terms: either
// order gives the same bits). Ends without a block barrier: finish's writes are its own.
template <class Exchanged, class Finish>
__device__ __forceinline__ void sum_over_warps(const Smem& s, int trade, const float (&acc)[MT][NT][4], Exchanged exchanged,
                                               Finish finish) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    // (At 16 units, rows of 16 floats: unit bit 3 flipped by row bit 1, so that the acc stores' half-warps,
    // rows g = 0..3 at units 2t, take 32 banks, where unswizzled rows g and g + 2 share eight; the sums'
    // loads, two rows of 16 units a half-warp, take 32 either way.)
    auto slot = [&](int w, int r, int u) {
        return reinterpret_cast<float2*>(s.part + (w * ROWS16 + r) * PART_STRIDE + (UNITS == 16 ? u ^ ((r & 2) << 2) : u));
    };
    if (warp >= WARPS - SLOTS) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    *slot(warp % SLOTS, 16 * mt + 8 * h + g, 8 * n + 2 * t) = make_float2(acc[mt][n][2 * h], acc[mt][n][2 * h + 1]);
    }
    __syncthreads();
    if (SLOTS < WARPS) {  // (half the slots: warp w's sums added into warp w + SLOTS's)
        if (warp < SLOTS) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < NT; ++n)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float2* p = slot(warp, 16 * mt + 8 * h + g, 8 * n + 2 * t);
                        const float2 stored = *p;
                        *p = make_float2(acc[mt][n][2 * h] + stored.x, acc[mt][n][2 * h + 1] + stored.y);
                    }
        }
        __syncthreads();
    }
    // The SLOTS sums of the pair (r, u .. u + 1) of the cluster's units, in a fixed tree.
    auto summed = [&](int r, int u) {
        float2 v[SLOTS];
#pragma unroll
        for (int w = 0; w < SLOTS; ++w) v[w] = *slot(w, r, u);
#pragma unroll
        for (int step = 1; step < SLOTS; step *= 2)
#pragma unroll
            for (int w = 0; w + step < SLOTS; w += 2 * step) v[w] = make_float2(v[w].x + v[w + step].x, v[w].y + v[w + step].y);
        return v[0];
    };
#if SPLIT == 1
    for (int i = threadIdx.x; i < ROWS16 * UNITS / 2; i += THREADS) {
        const int r = i / (UNITS / 2), u = 2 * (i - r * (UNITS / 2));
        const float2 v = summed(r, u);
        finish(r, u, v.x, v.y);
    }
    (void)trade; (void)exchanged;
#else
    // The other block's units first, sent; then this block's own summed while the other's sums of them
    // are on their way, kept in registers, and finished with the other's.
    constexpr int PAIRS = ROWS16 * OWN / 2, TRIPS = (PAIRS + THREADS - 1) / THREADS;  // a block's pairs, a thread's
    const int half = blockIdx.x % SPLIT, theirs = (half ^ 1) * OWN, box = trade & 1;  // (the inbox slot)
    auto row = [](int i) { return i / (OWN / 2); };                          // pair i: row r,
    auto unit = [](int i) { return 2 * (i - i / (OWN / 2) * (OWN / 2)); };  // units u, u + 1 of U_c (inbox: pair i at 2i)
    float* inbox = s.inbox + box * ROWS16 * OWN;
    unsigned long long* full = s.inbox_full + box;
    if (threadIdx.x == 0) mbarrier_expect(full, PAIRS * sizeof(float2));  // (this block's one arrival of the phase)
    const unsigned their_inbox = remote(inbox, half ^ 1), their_full = remote(full, half ^ 1);
    for (int i = threadIdx.x; i < PAIRS; i += THREADS) {
        const float2 v = summed(row(i), theirs + unit(i));
        send2(their_inbox + i * sizeof(float2), v.x, v.y, their_full);
    }
    float2 mine[TRIPS];
#pragma unroll
    for (int j = 0; j < TRIPS; ++j) {
        const int i = threadIdx.x + j * THREADS;
        if (i < PAIRS) mine[j] = summed(row(i), half * OWN + unit(i));
    }
    mbarrier_wait(full, (trade >> 1) & 1);  // (the other block's sums of U_c landed)
    exchanged();
#pragma unroll
    for (int j = 0; j < TRIPS; ++j) {
        const int i = threadIdx.x + j * THREADS;
        if (i < PAIRS) {
            const float2 in = reinterpret_cast<const float2*>(inbox)[i];
            finish(row(i), unit(i), mine[j].x + in.x, mine[j].y + in.y);
        }
    }
#endif
}

// Σ_{r < ROWS16} value(r) for eight outputs, by a whole warp: lane (p, e), p = lane / 8, holds
// output e = lane mod 8 (value reads it from the lane) and adds rows r ≡ p and r ≡ p + 4 (mod 8)
// in two chains, in order; then a + b, and the four parts as (p0 + p1) + (p2 + p3) by xor shuffles
// (a sum and its partner's, in either order the same bits): every lane of e returns the same sum, in a
// fixed order. Why a warp a group: a bias sum of one thread took ROWS16 loads and adds on the step's
// path; a lane takes two chains of ROWS16 / 8 and two shuffles. (The head's gradient sums over parts
// of the rows for every class at once: head_update.)
template <class Value>
__device__ __forceinline__ float warp_sum_rows(Value value) {
    static_assert(ROWS16 % 8 == 0, "ROWS16 is whole mma tiles");
    const int p = (threadIdx.x & 31) >> 3;
    float a = 0.0f, b = 0.0f;
#pragma unroll 4
    for (int r = p; r < ROWS16; r += 8) {
        a += value(r);
        b += value(r + 4);
    }
    float sum = a + b;
    sum += __shfl_xor_sync(0xffffffffu, sum, 8);
    sum += __shfl_xor_sync(0xffffffffu, sum, 16);
    return sum;
}

// ---- the phases ----------------------------------------------------------------------------------
struct Step {
    int step, rows, rank;
    int half, group;   // the block's rank in its cluster (K_h: its inputs of every product) and the cluster's (U_g)
    const int* order;  // the step's sample indices (global)
};
// The k-steps of K_h, the block's part of a product of `ksteps`: from first_kstep, kstep_count of them.
__device__ __forceinline__ int first_kstep(const Step& st, int ksteps) { return st.half * SPAN(ksteps); }
__device__ __forceinline__ int kstep_count(const Step& st, int ksteps) { return min(SPAN(ksteps), ksteps - first_kstep(st, ksteps)); }
// The block's count of trades before product `product` of the step (F_l: l − 1, B_l: 2·L − l), 2·L − 1 a step.
__device__ __forceinline__ int trade_of(const Step& st, int product) { return st.step * (2 * LAYERS - 1) + product; }

// X: step `step`'s x, rows r ≡ rank (mod BLOCKS) of its ROWS16: the images of its samples (rows of
// FEATURE_STRIDE bf16, read-only for the launch; the samples read ahead by prefetch_rows), zero
// past its rows; published in 16-byte pieces (InputRows' layout: piece p of row r in k-step p / 2, half p mod 2), for
// every block's F_1 and W_1's update of that step. Why k-step pieces: a fragment load's 32 lanes (rows
// g, g + 8 of a tile, inputs k0 + 4t .. + 3) then read 256 contiguous bytes, two lines of 128, where
// row-major rows a whole image apart take eight lines of 32 bytes, which L1TEX serves a line at a time.
// In two halves: gather_load, a thread's first GATHER_AHEAD pieces into registers (their loads in
// flight together), and gather_store, published (with any others); the main loop issues the loads before the head's partial logits, whose
// work then hides their trip to L2, and the stores after its arrival at the barrier that follows.
#define GATHER_PIECES ((ROWS16 + BLOCKS - 1) / BLOCKS * (FEATURE_STRIDE / 8))  // the owned rows' 16-byte pieces
#define GATHER_TRIPS ((GATHER_PIECES + THREADS - 1) / THREADS)                // a thread's
#define GATHER_AHEAD (GATHER_TRIPS < 2 ? GATHER_TRIPS : 2)  // of them held in registers (the 784³ MLP's: all, one)
// A thread's j-th piece: counted from warp 1, so that warp 0, whose thread 0 makes the block's arrival at
// the barrier that gather_store runs in (a fence and an atomic's round trip), holds the last, if any.
__device__ __forceinline__ int gather_index(int j) { return (threadIdx.x + THREADS - 32) % THREADS + j * THREADS; }
// Piece i of the owned rows (row q = i / PIECES), zero past the step's rows and past BATCH.
__device__ __forceinline__ uint4 gathered_piece(const int* row_samples, const bf16_bits* images, int i) {
    constexpr int PIECES = FEATURE_STRIDE / 8;  // of a row
    const int q = i / PIECES, sample = i < GATHER_PIECES && q < R_OWN ? row_samples[q] : -1;
    return sample >= 0 ? __ldg(reinterpret_cast<const uint4*>(images + (long long)sample * FEATURE_STRIDE) + i - q * PIECES)
                       : make_uint4(0u, 0u, 0u, 0u);
}
struct GatheredRows {
    uint4 v[GATHER_AHEAD];
};
__device__ __forceinline__ GatheredRows gather_load(const Smem& s, const bf16_bits* images, int step) {
    GatheredRows g;
#pragma unroll
    for (int j = 0; j < GATHER_AHEAD; ++j) g.v[j] = gathered_piece(s.row_samples + (step & 1) * R_OWN, images, gather_index(j));
    return g;
}
// The held pieces published, then the thread's others (a shape with more owned rows) loaded and published.
__device__ __forceinline__ void gather_store(const Smem& s, const Workspace& ws, const GatheredRows& g, const bf16_bits* images,
                                             int step, int rank) {
    constexpr int PIECES = FEATURE_STRIDE / 8;
    uint4* x = reinterpret_cast<uint4*>(x_of(ws, step));
    auto store = [&](int i, uint4 v) {
        const int q = i / PIECES, r = rank + BLOCKS * q, piece = i - q * PIECES;
        if (i < GATHER_PIECES && r < ROWS16) __stcg(x + (piece >> 1) * (ROWS16 * 2) + r * 2 + (piece & 1), v);
    };
#pragma unroll
    for (int j = 0; j < GATHER_AHEAD; ++j) store(gather_index(j), g.v[j]);
    for (int j = GATHER_AHEAD; j < GATHER_TRIPS; ++j) {
        const int i = gather_index(j);
        store(i, gathered_piece(s.row_samples + (step & 1) * R_OWN, images, i));
    }
}

// Step `step`'s rows r ≡ rank (mod BLOCKS), q = 0 .. R_OWN − 1, read ahead by threads 32 + q (+ 224k): the
// sample (−1 past the step's rows) and its label into s.row_samples and s.row_labels (by step parity),
// for X and S, which take the same rows; the image into L2 (a bulk prefetch), where X gathers it
// from. Called in the wait of a barrier a phase or more before X, so that X makes one trip to L2 where
// it made a trip for the sample and one to device memory for its image, and S none for the label.
__device__ __forceinline__ void prefetch_rows(const Smem& s, const bf16_bits* images, const int* labels, const int* order,
                                              int step, int num_samples, int rank) {
    if (threadIdx.x < 32) return;  // (warp 0's thread 0 is in the grid barrier's wait)
    for (int q = threadIdx.x - 32; q < R_OWN; q += THREADS - 32) {
        const int r = rank + BLOCKS * q;
        const int sample = r < min(BATCH, num_samples - step * BATCH) ? __ldg(order + (long long)step * BATCH + r) : -1;
        s.row_samples[(step & 1) * R_OWN + q] = sample;
        s.row_labels[(step & 1) * R_OWN + q] = sample >= 0 ? __ldg(labels + sample) : -1;
        if (sample >= 0) prefetch_l2(images + (long long)sample * FEATURE_STRIDE, FEATURE_STRIDE * sizeof(bf16_bits));
    }
}

// X where nothing was read ahead (step 0, and every step with one hidden layer): the rows' samples
// first, then the gather.
__device__ __forceinline__ void gather_rows(const Smem& s, const Workspace& ws, const bf16_bits* images, const int* labels,
                                            const int* order, int step, int num_samples, int rank) {
    prefetch_rows(s, images, labels, order, step, num_samples, rank);
    __syncthreads();
    gather_store(s, ws, gather_load(s, images, step), images, step, rank);
}

// F_l: h_l[:, U_c] from the products' sums, kept (h_last; or ht, the other block's too, and published),
// zero past the rows.
template <class Rows, class Weights>
__device__ __forceinline__ void forward_layer(const Smem& s, const Smem& other, const Workspace& ws, const Step& st, int l,
                                              const Rows& rows, const Weights& weights, int ksteps, float unit,
                                              Probes& probes) {
    float acc[MT][NT][4];
    forward_product(ring_of(s), rows, weights, first_kstep(st, ksteps), kstep_count(st, ksteps), acc);
    PHASE_END(probes, FORWARD_PRODUCTS, l);
    const float* bias = s.b + (l - 1) * OWN;
    bf16_bits* ht = l < LAYERS ? ht_of(s, l) + st.half * OWN * HT_STRIDE : nullptr;  // (U_c's rows of the cluster's)
    bf16_bits* ht_other = l < LAYERS ? ht_of(other, l) + st.half * OWN * HT_STRIDE : nullptr;
    bf16_bits* piece = l < LAYERS ? act_of(ws, l) + st.rank * PIECE : nullptr;
    sum_over_warps(s, trade_of(st, l - 1), acc, [&] { PHASE_END(probes, FORWARD_EXCHANGE, l); },
                   [&](int r, int u, float v0, float v1) {
        const bool real = r < st.rows;
        const float h0 = real ? fmaxf(fmaf(unit, v0, bias[u]), 0.0f) : 0.0f;
        const float h1 = real ? fmaxf(fmaf(unit, v1, bias[u + 1]), 0.0f) : 0.0f;
        if (l == LAYERS) {
            *reinterpret_cast<float2*>(s.h_last + r * OWN + u) = make_float2(h0, h1);
        } else {
            const unsigned pair = bf16x2(h0, h1);
            ht[u * HT_STRIDE + r] = (bf16_bits)(pair & 0xffffu);
            ht[(u + 1) * HT_STRIDE + r] = (bf16_bits)(pair >> 16);
            if (SPLIT > 1) {  // (read by the other block's update of W_{l+1}, past grid barriers)
                ht_other[u * HT_STRIDE + r] = (bf16_bits)(pair & 0xffffu);
                ht_other[(u + 1) * HT_STRIDE + r] = (bf16_bits)(pair >> 16);
            }
            __stcg(reinterpret_cast<unsigned*>(piece + r * OWN + u), pair);
        }
    });
    PHASE_END(probes, FORWARD_SUMS, l);
}

// The head's partial logits P_c = h_L[:, U_c] · W_h[:, U_c]ᵀ of the step's rows, published.
__device__ __forceinline__ void head_partials(const Smem& s, const Workspace& ws, const Step& st) {
    __syncthreads();  // h_last is whole
    for (int i = threadIdx.x; i < st.rows * CLASSES; i += THREADS) {
        const int r = i / CLASSES, j = i - r * CLASSES;
        float z = 0.0f;
#pragma unroll
        for (int u = 0; u < OWN; ++u) z = fmaf(s.h_last[r * OWN + u], s.wh[j * OWN + u], z);
        __stcg(ws.partials + (long long)r * PARTIAL_ROW + st.rank * CLASSES + j, z);
    }
}

// S: the softmax of rows r = rank + BLOCKS·q, a warp a row and a lane a class; dz published, the loss
// and correct count kept by lane 0. The owned rows' partial logits (BLOCKS·CLASSES floats a row,
// adjacent, in rows of PARTIAL_ROW) come in first, by the whole block at once, 16 bytes a load and a
// thread's loads before its stores (stage_batched): one trip to L2, not one a value. (4-byte loads,
// eight a thread at the 784³ MLP's 98 blocks, took as long a trip, but the kernel then needed 253
// registers, not 242, and B_l's products ran ~10% longer.) A class's sum over
// the blocks is taken by PARTS lanes (lane (p, j) adds blocks c ≡ p (mod PARTS), in order), the parts
// then added in order p = 0, 1, …: a chain of BLOCKS / PARTS adds, not BLOCKS. The labels were
// read ahead (prefetch_rows), not loaded here through the sample order: two trips to L2 fewer.
__device__ __forceinline__ void softmax_rows(const Smem& s, const Workspace& ws, const Step& st, bool measure,
                                             double& loss_sum, double& correct_sum) {
    constexpr int PARTS = 32 / CLASSES;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    constexpr int ROW_QUADS = PARTIAL_ROW / 4;
    float* zin = s.part;  // [R_OWN][PARTIAL_ROW]
    stage_batched<R_OWN * ROW_QUADS>(reinterpret_cast<float4*>(zin), [&](int i) {
        const int q = i / ROW_QUADS, r = st.rank + BLOCKS * q;
        return r < st.rows ? __ldcg(reinterpret_cast<const float4*>(ws.partials + (long long)r * PARTIAL_ROW) + (i - q * ROW_QUADS))
                           : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    });
    __syncthreads();
    for (int q = warp; st.rank + BLOCKS * q < st.rows; q += WARPS) {
        const int r = st.rank + BLOCKS * q;
        const bool is_class = lane < CLASSES;
        const int j = lane % CLASSES, p = lane / CLASSES;
        float part = 0.0f;
        if (p < PARTS)
            for (int c = p; c < BLOCKS; c += PARTS) part += zin[q * PARTIAL_ROW + c * CLASSES + j];
        float sum = part;  // lane j < CLASSES: part 0's, then the others in order
#pragma unroll
        for (int o = 1; o < PARTS; ++o) sum += __shfl_sync(0xffffffffu, part, j + o * CLASSES);
        const float z = is_class ? sum + s.bh[lane] : -__int_as_float(0x7f800000);  // −∞ past the classes
        const int label = s.row_labels[(st.step & 1) * R_OWN + q];
        float m, total;
        const float dz = warp_softmax_grad<32>(z, is_class, lane, label, st.rows, m, total);
        if (is_class) __stcg(ws.dz + r * CLASSES + lane, dz);
        if (measure) {
            unsigned at_max;
            const float z_label = warp_label_logit(z, is_class, 0, label, m, at_max);
            if (lane == 0) {
                loss_sum += (double)xent_loss(total, m, z_label);
                correct_sum += first_max_is(at_max, label) ? 1.0 : 0.0;
            }
        }
    }
}

// Once dh_l[:, U_c] is whole in s.dh: dh_l published (l ≥ 2) or kept transposed for W_1's update (l = 1;
// with SPLIT 2 in the other block's dht too, which its update reads past the cluster barrier that begins
// update_first_layer). Its bias's update (bias_update) comes after: no other block waits for it.
__device__ __forceinline__ void publish_gradient(const Smem& s, const Smem& other, const Workspace& ws, const Step& st, int l) {
    __syncthreads();
    if (l >= 2) {
        bf16_bits* piece = grad_of(ws, l) + st.rank * PIECE;
        for (int i = threadIdx.x; i < ROWS16 * OWN / 2; i += THREADS) {
            const float2 v = *reinterpret_cast<const float2*>(s.dh + 2 * i);
            __stcg(reinterpret_cast<unsigned*>(piece) + i, bf16x2(v.x, v.y));
        }
    } else {
        const int at = st.half * OWN * HT_STRIDE;  // (U_c's rows of the cluster's dht)
        for (int i = threadIdx.x; i < ROWS16 * OWN; i += THREADS) {
            const int r = i % ROWS16, u = i / ROWS16;
            const bf16_bits v = (bf16_bits)(bf16x2(s.dh[r * OWN + u], 0.0f) & 0xffffu);
            s.dht[at + u * HT_STRIDE + r] = v;
            if (SPLIT > 1) other.dht[at + u * HT_STRIDE + r] = v;
        }
    }
}

// b_l[U_c] −= lr · Σ_r dh_l[:, U_c], a warp eight units, once dh_l is whole in s.dh (past publish_gradient's
// block barrier; s.dh is next written past a block barrier that every thread passes after this). On
// warp 0, though its thread 0 makes the block's arrival at the barrier this runs in: on the last warps,
// or from warp 1, the 784³ MLP's build spilled (16 bytes; it holds 255 registers).
__device__ __forceinline__ void bias_update(const Smem& s, int l, int bias, float lr) {
    const int warp = threadIdx.x >> 5;
    if (bias && warp < OWN / 8) {
        const int u = 8 * warp + (threadIdx.x & 7);
        const float sum = warp_sum_rows([&](int r) { return s.dh[r * OWN + u]; });
        if ((threadIdx.x & 31) < 8) s.b[(l - 1) * OWN + u] = fmaf(-lr, sum, s.b[(l - 1) * OWN + u]);
    }
}

// H: dlogits of every row in, dh_L[:, U_c] = dz · W_h[:, U_c] ⊙ [h_L > 0] (W_h before its update), published.
__device__ __forceinline__ void head_gradient(const Smem& s, const Smem& other, const Workspace& ws, const Step& st) {
    stage_batched<ROWS16 * CLASSES>(s.dl, [&](int i) { return i < st.rows * CLASSES ? __ldcg(ws.dz + i) : 0.0f; });
    __syncthreads();
    // thread (q, u), u = tid mod OWN: unit u's column of W_h held in registers, rows r ≡ q (mod THREADS / OWN)
    const int u = threadIdx.x % OWN;
    float wh[CLASSES];
#pragma unroll
    for (int j = 0; j < CLASSES; ++j) wh[j] = s.wh[j * OWN + u];
    for (int r = threadIdx.x / OWN; r < ROWS16; r += THREADS / OWN) {
        float v = 0.0f;
#pragma unroll
        for (int j = 0; j < CLASSES; ++j) v = fmaf(s.dl[r * CLASSES + j], wh[j], v);
        s.dh[r * OWN + u] = s.h_last[r * OWN + u] > 0.0f ? v : 0.0f;
    }
    publish_gradient(s, other, ws, st, LAYERS);
}

// The head's update, past publish_gradient's block barrier (every read of W_h for dh_L made): W_h[:, U_c]
// −= lr · dzᵀ h_L[:, U_c], b_h −= lr · Σ_r dz, by warps 1.. (warp 0's thread 0 is making the block's
// arrival at the grid barrier this runs in: a fence and an atomic's round trip). Thread (q, u) of them,
// u = t mod OWN, q = t / OWN (t = tid − 32), adds rows r ≡ q (mod QS) in order, for every class at once
// (a row's dz from broadcast loads, h_L[r][u] one load); the QS parts are added as a fixed tree: the
// parts in a warp (lane bits above OWN's) by xor shuffles, then the warps' in warp order from s.part.
// Why so: a thread a sum of ROWS16 rows (80 threads at the 784³ MLP) made a chain of 2·ROWS16 shared
// loads, ~4k cycles, longer than the grid barrier it runs in.
// Why apart from H: no other block waits for it, so it runs in the grid barrier after H (L ≥ 2), between
// this block's arrival and its wait. (s.dl and s.h_last are next written in the next step's F_L and H;
// s.part by the next product's sums, past the block barrier that ends grid_wait, or the next F_1's.)
__device__ __forceinline__ void head_update(const Smem& s, int bias, float lr) {
    constexpr int SUMMERS = THREADS - 32, QS = SUMMERS / OWN, PARTS = SUMMERS / 32;  // threads, row parts, warps
    static_assert(32 % OWN == 0, "whole parts a warp");
    const int t = threadIdx.x - 32;
    float* parts = s.part;  // [PARTS][CLASSES][OWN + 1]: a warp's sums (the last column b_h's)
    if (t >= 0) {
        const int u = t % OWN, q = t / OWN;
        float gw[CLASSES], gb[CLASSES];
#pragma unroll
        for (int j = 0; j < CLASSES; ++j) gw[j] = gb[j] = 0.0f;
        for (int r = q; r < ROWS16; r += QS) {
            const float h = s.h_last[r * OWN + u];
#pragma unroll
            for (int j = 0; j < CLASSES; ++j) {
                const float dz = s.dl[r * CLASSES + j];
                gw[j] = fmaf(dz, h, gw[j]);
                gb[j] += dz;
            }
        }
#pragma unroll
        for (int m = OWN; m < 32; m *= 2)
#pragma unroll
            for (int j = 0; j < CLASSES; ++j) {
                gw[j] += __shfl_xor_sync(0xffffffffu, gw[j], m);
                gb[j] += __shfl_xor_sync(0xffffffffu, gb[j], m);
            }
        const int part = t >> 5;
        if ((t & 31) < OWN) {
#pragma unroll
            for (int j = 0; j < CLASSES; ++j) parts[(part * CLASSES + j) * (OWN + 1) + u] = gw[j];
            if (u == 0) {
#pragma unroll
                for (int j = 0; j < CLASSES; ++j) parts[(part * CLASSES + j) * (OWN + 1) + OWN] = gb[j];
            }
        }
    }
    __syncthreads();
    for (int i = t; i >= 0 && i < CLASSES * (OWN + 1); i += SUMMERS) {
        float sum = parts[i];
#pragma unroll
        for (int w = 1; w < PARTS; ++w) sum += parts[w * CLASSES * (OWN + 1) + i];
        const int j = i / (OWN + 1), v = i - j * (OWN + 1);
        if (v < OWN) s.wh[j * OWN + v] = fmaf(-lr, sum, s.wh[j * OWN + v]);
        else if (bias) s.bh[j] = fmaf(-lr, sum, s.bh[j]);
    }
}

// B_l, l ≥ 2: dh_{l−1}[:, U_c] and the update of W_l[K_h, U_g] (published for the next step's forward).
__device__ __forceinline__ void backward_layer(const Smem& s, const Smem& other, const Workspace& ws, const Step& st, int l,
                                               float lr, Probes& probes) {
    float acc[MT][NT][4];
    const bf16_bits* ht = ht_of(s, l - 1);  // h_{l−1}[:, U_g]ᵀ: the update's B
    update_product<true>(ring_of(s), HiddenRows{grad_of(ws, l)}, first_kstep(st, H_KSTEPS), kstep_count(st, H_KSTEPS),
                         wc_of(s, l), WC_STRIDE, ht, lr, wg_of(ws, l, (st.step + 1) & 1) + published_at(0, st.group * UNITS),
                         acc);
    PHASE_END(probes, BACKWARD_PRODUCTS, l);
    const bf16_bits* mask = ht + st.half * OWN * HT_STRIDE;  // U_c's
    sum_over_warps(s, trade_of(st, 2 * LAYERS - l), acc, [&] { PHASE_END(probes, BACKWARD_EXCHANGE, l); },
                   [&](int r, int u, float v0, float v1) {
        const bool real = r < st.rows;  // (h_{l−1} as bf16 is > 0 where it is: [h > 0], the ReLU's mask)
        *reinterpret_cast<float2*>(s.dh + r * OWN + u) =
            make_float2(real && to_float(mask[u * HT_STRIDE + r]) > 0.0f ? v0 : 0.0f,
                        real && to_float(mask[(u + 1) * HT_STRIDE + r]) > 0.0f ? v1 : 0.0f);
    });
    publish_gradient(s, other, ws, st, l - 1);
    PHASE_END(probes, BACKWARD_SUMS, l);
}

// W_1[U_g, K_h] −= lr · dh_1[:, U_g]ᵀ x[:, K_h].
__device__ __forceinline__ void update_first_layer(const Smem& s, const Workspace& ws, const Step& st, float lr) {
#if SPLIT > 1
    cluster_sync();  // dht is whole: the other block's units of dh_1 in it
#else
    __syncthreads();  // dht is whole
#endif
    float unused[MT][NT][4];
    update_product<false>(ring_of(s), InputRows{x_of(ws, st.step)}, first_kstep(st, F_KSTEPS), kstep_count(st, F_KSTEPS),
                          s.w1, W1_STRIDE, s.dht, lr * X_UNIT, nullptr, unused);
    __syncthreads();  // (the next step's forward of layer 1 reads W_1)
}

// ---- parameters in and out -----------------------------------------------------------------------
// params: the weights of hidden layers 1..LAYERS and of the head, then their biases (row-major
// fan_out × fan_in, as the stage keeps them). A block holds W_1[U_g, K_h] and W_l[K_h, U_g] (its
// cluster's units, its half of the inputs: 16·F_SPAN or 16·H_SPAN of them from f0 or o0, the masters
// zero past them), and the head's columns and the biases of U_c.
__device__ void load_parameters(const Smem& s, const Workspace& ws, const unsigned long long* params, int bias, const Step& st) {
    const float* const* w = reinterpret_cast<const float* const*>(params);
    const float* const* b = reinterpret_cast<const float* const*>(params + LAYERS + 1);
    const int tid = threadIdx.x, u0 = st.rank * OWN, g0 = st.group * UNITS;
    const int f0 = 16 * first_kstep(st, F_KSTEPS), o0 = 16 * first_kstep(st, H_KSTEPS);
    for (int i = tid; i < UNITS * W1_STRIDE; i += THREADS) {
        const int u = i / W1_STRIDE, k = (i - u * W1_STRIDE) ^ master_swizzle(u);  // (the input stored at i, from f0)
        const bool held = g0 + u < HIDDEN && k < 16 * F_SPAN && f0 + k < FEATURES;
        s.w1[i] = held ? w[0][(long long)(g0 + u) * FEATURES + f0 + k] : 0.0f;
    }
    for (int l = 2; l <= LAYERS; ++l) {
        float* wc = wc_of(s, l);
        bf16_bits* published = wg_of(ws, l, 0) + published_at(0, g0);  // step 0's forward reads this copy
        for (int i = tid; i < WC_STRIDE * UNITS; i += THREADS) {
            const int k = i / UNITS, j = i - k * UNITS;  // (j fastest: a row's units are adjacent in global memory)
            const bool held = k < 16 * H_SPAN && o0 + k < HIDDEN_PAD;
            const float v = held && o0 + k < HIDDEN && g0 + j < HIDDEN ? w[l - 1][(long long)(o0 + k) * HIDDEN + g0 + j] : 0.0f;
            *master_at(wc, WC_STRIDE, j, k) = v;
            if (held) published[published_at(o0 + k, j)] = (bf16_bits)(bf16x2(v, 0.0f) & 0xffffu);
        }
    }
    for (int i = tid; i < CLASSES * OWN; i += THREADS) {
        const int j = i / OWN, u = i - j * OWN;
        s.wh[i] = u0 + u < HIDDEN ? w[LAYERS][j * HIDDEN + u0 + u] : 0.0f;
    }
    for (int i = tid; i < LAYERS * OWN; i += THREADS) {
        const int l = i / OWN, u = i - l * OWN;
        s.b[i] = bias && u0 + u < HIDDEN ? b[l][u0 + u] : 0.0f;
    }
    if (tid < CLASSES) s.bh[tid] = bias ? b[LAYERS][tid] : 0.0f;
}

__device__ void store_parameters(const Smem& s, const unsigned long long* params, int bias, const Step& st) {
    float* const* w = reinterpret_cast<float* const*>(params);
    float* const* b = reinterpret_cast<float* const*>(params + LAYERS + 1);
    const int tid = threadIdx.x, u0 = st.rank * OWN, g0 = st.group * UNITS;
    const int f0 = 16 * first_kstep(st, F_KSTEPS), o0 = 16 * first_kstep(st, H_KSTEPS);
    const int f_held = min(16 * F_SPAN, FEATURES - f0), o_held = min(16 * H_SPAN, HIDDEN - o0);  // (≤ 0: none)
    for (int i = tid; i < UNITS * f_held; i += THREADS) {
        const int u = i / f_held, k = i - u * f_held;
        if (g0 + u < HIDDEN) w[0][(long long)(g0 + u) * FEATURES + f0 + k] = *master_at(s.w1, W1_STRIDE, u, k);
    }
    for (int l = 2; l <= LAYERS; ++l) {
        const float* wc = wc_of(s, l);
        for (int i = tid; i < o_held * UNITS; i += THREADS) {
            const int k = i / UNITS, j = i - k * UNITS;
            if (g0 + j < HIDDEN) w[l - 1][(long long)(o0 + k) * HIDDEN + g0 + j] = *master_at(wc, WC_STRIDE, j, k);
        }
    }
    for (int i = tid; i < CLASSES * OWN; i += THREADS) {
        const int j = i / OWN, u = i - j * OWN;
        if (u0 + u < HIDDEN) w[LAYERS][j * HIDDEN + u0 + u] = s.wh[i];
    }
    for (int i = tid; bias && i < LAYERS * OWN; i += THREADS) {
        const int l = i / OWN, u = i - l * OWN;
        if (u0 + u < HIDDEN) b[l][u0 + u] = s.b[i];
    }
    if (bias && st.rank == 0 && tid < CLASSES) b[LAYERS][tid] = s.bh[tid];
}

// ---- the epoch -----------------------------------------------------------------------------------
#if SPLIT > 1
#define CLUSTER_DIMS __cluster_dims__(SPLIT, 1, 1)
#else
#define CLUSTER_DIMS
#endif
extern "C" __global__ void __launch_bounds__(THREADS, 1) CLUSTER_DIMS
wide_epoch(const bf16_bits* images, const int* labels, const int* order, const unsigned long long* params, int bias,
           int num_samples, int num_steps, float lr, double* metrics, int measure, unsigned char* workspace) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Smem s = carve(smem_raw);
    const Workspace ws = workspace_at(workspace);
    const int rank = blockIdx.x;  // (a cluster's blocks are adjacent: its rank in the cluster is rank mod SPLIT)
    const Step at{0, 0, rank, rank % SPLIT, rank / SPLIT, order};
#if SPLIT > 1
    const Smem other = carve(peer_shared(smem_raw, at.half ^ 1));  // the other block's regions, in its shared memory
#else
    const Smem& other = s;  // (unused)
#endif
    load_parameters(s, ws, params, bias, at);
#if SPLIT > 1
    if (threadIdx.x == 0) {  // (one arrival a phase: this block's, with the bytes the trade brings)
        mbarrier_init(s.inbox_full, 1);
        mbarrier_init(s.inbox_full + 1, 1);
        mbarrier_init_fence();
    }
    cluster_sync();  // (the other block has started and its barriers are set: its shared memory may be written from here)
#endif
    if (num_steps > 0) gather_rows(s, ws, images, labels, order, 0, num_samples, rank);
    grid_sync(ws.barrier);  // (every block's columns of the weights published for step 0, and its x)

    double loss_sum = 0.0, correct_sum = 0.0;  // kept by lane 0 of each warp, over the rows it owns
    Probes probes(metrics);  // (a probe build's table, where the metrics would go)
    PROBE_START(probes, s.probe_counts);
    for (int step = 0; step < num_steps; ++step) {
        const Step st{step, min(BATCH, num_samples - step * BATCH), rank, at.half, at.group, order + (long long)step * BATCH};
        forward_layer(s, other, ws, st, 1, InputRows{x_of(ws, step)}, MasterWeights{s.w1, W1_STRIDE, 16 * first_kstep(st, F_KSTEPS)},
                      F_KSTEPS, X_UNIT, probes);
        for (int l = 2; l <= LAYERS; ++l) {
            const unsigned long long published = grid_arrive(ws.barrier);  // h_{l−1} of every block published
            if (l == 2 && step + 1 < num_steps) prefetch_rows(s, images, labels, order, step + 1, num_samples, rank);
            grid_wait(ws.barrier, published);
            PROBE_END(probes, WAIT_FORWARD, l - 1);
            forward_layer(s, other, ws, st, l, HiddenRows{act_of(ws, l - 1)},
                          PublishedWeights{wg_of(ws, l, step & 1) + published_at(st.group * UNITS, 0)}, H_KSTEPS, 1.0f, probes);
        }
        GatheredRows next;  // (L ≥ 2: the next step's x, loaded under the partial logits' work)
        if (LAYERS >= 2 && step + 1 < num_steps) next = gather_load(s, images, step + 1);
        head_partials(s, ws, st);
        PHASE_END(probes, HEAD_PARTIALS, 0);
        // every block's partial logits; with L ≥ 2 the next step's x (x_of: the other buffer) is gathered
        // between this block's arrival and its wait: that buffer's last readers, the blocks' W_1
        // updates of the step before, are behind the barrier after F_1 (with L = 1 only behind this one)
        const unsigned long long partials = grid_arrive(ws.barrier);
        if (LAYERS >= 2) {
            if (step + 1 < num_steps) gather_store(s, ws, next, images, step + 1, rank);
            PHASE_END(probes, GATHER, 0);
        }
        grid_wait(ws.barrier, partials);
        PROBE_END(probes, WAIT_FORWARD, LAYERS);
        if (LAYERS == 1) {
            if (step + 1 < num_steps) gather_rows(s, ws, images, labels, order, step + 1, num_samples, rank);
            PHASE_END(probes, GATHER, 0);
        }
        softmax_rows(s, ws, st, measure != 0, loss_sum, correct_sum);
        PHASE_END(probes, SOFTMAX, 0);
        grid_sync(ws.barrier);  // every row's dlogits
        PROBE_END(probes, WAIT_SOFTMAX, 0);
        head_gradient(s, other, ws, st);
        PHASE_END(probes, HEAD_GRADIENT, 0);
        // the updates that no other block waits for (the head's, b_l's) between this block's arrival and its wait
        for (int l = LAYERS; l >= 2; --l) {
            const unsigned long long published = grid_arrive(ws.barrier);  // dh_l of every block published
            if (l == LAYERS) head_update(s, bias, lr);
            bias_update(s, l, bias, lr);
            PHASE_END(probes, BIAS_UPDATE, l);
            grid_wait(ws.barrier, published);
            PROBE_END(probes, WAIT_BACKWARD, l);
            backward_layer(s, other, ws, st, l, lr, probes);
        }
        if (LAYERS == 1) head_update(s, bias, lr);
        bias_update(s, 1, bias, lr);
        PHASE_END(probes, BIAS_UPDATE, 1);
        update_first_layer(s, ws, st, lr);
        PROBE_END(probes, UPDATE, 1);  // (update_first_layer ends at a block barrier)
    }
    PROBE_FINISH(probes);

    // ---- parameters back to global memory; the metrics, added in block order by block 0 ---------
    __syncthreads();
    store_parameters(s, params, bias, at);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { s.totals[2 * warp] = loss_sum; s.totals[2 * warp + 1] = correct_sum; }
    __syncthreads();
    if (threadIdx.x == 0) {
        double l = 0.0, c = 0.0;
        for (int w = 0; w < WARPS; ++w) { l += s.totals[2 * w]; c += s.totals[2 * w + 1]; }
        __stcg(ws.block_metrics + 2 * rank, l);
        __stcg(ws.block_metrics + 2 * rank + 1, c);
    }
    grid_sync(ws.barrier);
    if (measure && rank == 0 && threadIdx.x == 0) {
        double l = 0.0, c = 0.0;
        for (int k = 0; k < BLOCKS; ++k) { l += __ldcg(ws.block_metrics + 2 * k); c += __ldcg(ws.block_metrics + 2 * k + 1); }
        metrics[0] += l;
        metrics[1] += c;
    }
}
