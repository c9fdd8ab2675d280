// `persistent` for MLPs: LAYERS hidden layers of HIDDEN units (ReLU) and a softmax head, trained by
// one thread-block cluster; one launch runs an epoch.
//
// Block c of the CLUSTER blocks owns S = HIDDEN / CLUSTER units U_c of every hidden layer: the rows
// W_l[U_c, :] of each hidden layer's weights (kept k-major, wt[k][u]; W_1 in quads of inputs, see
// w1_at, or in the BF16 build in registers, see W1Regs), its bias b_l[U_c], and the head's columns
// W_h[:, U_c]. Every block keeps a copy of the head's bias. Block c also owns R = ⌈rows / CLUSTER⌉
// of a step's rows for the softmax. A step of `rows` samples x (read through the sample order),
// h_0 = x:
//
//   forward, l = 1..LAYERS      h_l[:, U_c] = relu(h_{l-1} · W_l[U_c, :]ᵀ + b_l[U_c])
//       l < LAYERS: G_l         each block sends its columns to every block's h_full[l]
//   head, partial: Z            P_c = h_L[:, U_c] · W_h[:, U_c]ᵀ, row r sent to r's owner
//   softmax, owned rows: Y      z = Σ_{c = 0..CLUSTER-1} P_c + b_h (in that order), dz = (softmax(z)
//                               − onehot(y)) / rows, sent to every block's dl
//   head, in every block        dh_L[:, U_c] = dz · W_h[:, U_c] ⊙ [h_L[:, U_c] > 0],
//                               W_h[:, U_c] −= lr · dzᵀ h_L[:, U_c],  b_h −= lr · Σ_r dz[r]
//   backward, l = LAYERS..2     Q_c = dh_l[:, U_c] · W_l[U_c, :] (this block's part of dh_{l-1}),
//       D_l                     W_l[U_c, :] −= lr · dh_l[:, U_c]ᵀ h_{l-1},  b_l[U_c] −= lr · Σ_r dh_l,
//                               then Q_c[:, U_o] sent to block o's inbox[l−1];
//                               dh_{l-1}[:, U_c] = Σ_{o = 0..CLUSTER-1} Q_o[:, U_c] (in order)
//                               ⊙ [h_{l-1}[:, U_c] > 0]
//   l = 1                       W_1[U_c, :] −= lr · dh_1[:, U_c]ᵀ x,  b_1[U_c] −= lr · Σ_r dh_1
//
// So no block needs another's weights, nor its weight gradients: the exchanges are activations
// (gathered), partial logits (reduce-scattered to the rows' owners), dlogits (gathered) and
// partial input gradients (reduce-scattered). Every sum runs in a fixed order without atomics: the
// same seed gives the same weights bit for bit.
//
// The hidden layers' products run on tensor cores with fp32 sums, in one of two builds:
//   BF16 = 1   bf16 operands (mma.sync m16n8k16), one pass: each operand rounded to bf16 (8 bits of
//              mantissa) as it is loaded, the weights kept in fp32 and updated in fp32 (the bf16
//              rung's precision); the images come as bf16 (8-bit pixels k, exact). G_l moves h_l
//              as bf16 (HElem: the operand it becomes) and D_l its pieces as bf16 (QElem, summed
//              in fp32 by the receiver). W_1 stays in the registers of the warps that use it.
//   BF16 = 0   TF32 operands (m16n8k8) in three passes, which keeps near-fp32 accuracy: each operand
//              is split as v = hi + lo (hi its top 19 bits), and a·b ≈ hi_a·hi_b + (hi_a·lo_b +
//              lo_a·hi_b), the dropped lo·lo term and the truncations ~2⁻²⁰ of the product.
// The head (partial logits, dh_L, dW_h) takes the three TF32 passes in both. A forward product
// splits its k (the inputs) over the warps, whose partial sums then add up in warp order; the
// updates and Q split their outputs over the warps.
//
// The exchanges write the receiver's shared memory and count their bytes on the receiver's mbarrier
// for that exchange (a phase a step); the receiver waits on its own barrier only, so there is no
// cluster barrier and no memory fence in the loop. For G_l and D_l block c sends one contiguous piece
// to each other block (G_l: its h_l[:, U_c], rows × S, into h_full[l], kept block-major; D_l:
// Q_c[:, U_o], rows × S, into block o's inbox[l−1][c]; in the BF16 build both as bf16): a bulk copy
// each (cp.async.bulk, the copy engine, ~60 cycles a copy whichever warps issue them; for D_l this
// beat st.async stores straight from the mma registers by 4% of a step on an H100 at H = 128, and
// came within 1% at H = 256), and its own piece by plain stores. Z and Y are small (R rows of the
// classes a block): st.async stores, Z's straight from the mma registers into the owner's zin[c],
// Y's from the owner's dl into every other block's. (Z all-gathered instead, as 15 bulk copies a block, and every block computing
// every row's softmax, the step took 1.5% longer at H = 128 and 0.6% at H = 256 on an H100: the
// bytes saved are few, and two exchanges wait where one did.)
//
// Why one buffer per exchange is safe to reuse step after step: the exchanges run in one order,
// G_1 .. G_{L−1}, Z, Y, D_L .. D_2, and each is all-to-all (every block sends to every block: Z
// to each owner, Y from each owner), so a block that has waited for exchange E has received every
// block's E, each sent after its sender had waited for the exchange before E.
// So when block B writes block A's buffer for E in step t + 1, A has already sent its part of the
// exchange before E (of step t + 1, or D_2 of step t where E = G_1, or Y of step t where E = Z
// with one hidden layer), and it suffices that A reads its buffer of E for step t only before
// making that send:
//
//   h_full[l], l ≥ 2    read by the forward of layer l + 1 and the update of W_{l+1}, in step t;
//                       the exchange before G_l is G_{l−1} of step t + 1.
//   h_full[1]           read by the forward of layer 2 and the update of W_2; the exchange before
//                       G_1 is D_2 of step t, which a block sends after its update of W_2 (below).
//   zin                 (Z's target) read by the softmax, before Y of step t (the exchange before
//                       Z is G_{L−1} of step t + 1, or with one hidden layer Y of step t).
//   dl                  (Y's target) read by the head's products, before D_L of step t (or with
//                       one hidden layer, before the next Z); the exchange before Y is Z of t + 1.
//   inbox[l]            (dh_l's inbox, the target of D_{l+1}) read by the sum of dh_l in step t;
//                       the exchange before D_{l+1} is D_{l+2} or Y, of step t + 1.
// The same order makes an mbarrier's phases safe: a block's bytes for E of step t + 1 reach A only
// after A has sent the exchange before E of step t + 1, so after A waited for E of step t; and A
// sets a barrier's expected bytes for a step at the step's start, after that wait.
//
// A bulk copy reads its source asynchronously, so a source is rewritten only once every block has
// received it: this block's own slot of h_full[l] (G_l's source) in the next step's forward, after
// this block waited for D_2 (every block's D_2 comes after its wait for G_l). (st.async stores read
// their registers at once: Z and Y have no such source.) D_l's source is h_full[l−1]
// itself, Q[:, k] staged where h_{l−1}[:, k] lies once the warp that owns input k has read it (its
// last reader in the step): the piece for block o is in o's slot, which only o's G_{l−1} of step
// t + 1 overwrites, sent after o has received that piece.
//
// Two buffers share memory where their lives do not overlap, by the same argument:
//   inbox[L−1] and the forward's partial sums (this block's only): D_L of step t comes after every
//     block's Z of step t, sent after the forward's last partial sums; the next forward writes them
//     after reading inbox[L−1].
//   inbox[1] and zin, with L ≥ 3: D_2 of step t comes after every block's D_3, sent after its wait
//     for Y, which every owner sent after its softmax; Z of step t + 1 after every block's G_{L−1}
//     of step t + 1, sent after it read inbox[1] in step t.
//
// The sample indices come two steps ahead and the labels one step ahead (cp.async), so no dependent
// global load sits on a step's path apart from the images themselves. Where the batch's images fit
// in shared memory (X_STRIDE > 0) copies bring them in (copy_images_in) and layer 1's products
// read them there; else they read global memory, the next step's rows prefetched into L2
// (cp.async.bulk.prefetch). bf16 images take half the floats' bytes, and bytes (8-bit pixels in the
// TF32 build, PIXEL_LEVELS below) a quarter: the next step's images are copied in while this step
// trains, into one buffer in the BF16 build (its forward of layer 1 keeps them in registers, and
// the copies go out after every warp has read them: past the block barriers after that forward)
// or two in the TF32 build (its update of W_1 reads them again); float images into one, copied at
// the step's start. The copies for the steps ahead go out at a wait for an exchange (copy_ahead
// says which). The TF32 build's layer-1 operands come in pieces of 8 or 16 bytes (forward) and 4
// or 8 (update), not 2 or 4.
//
// Compile-time (from kernels/persistent_mlp.py): CLUSTER, THREADS, FEATURES, FEATURE_STRIDE (a
// multiple of 16; images are rows of FEATURE_STRIDE pixels, zero past FEATURES), HIDDEN (a multiple
// of 4·CLUSTER), LAYERS, CLASSES (≤ 32), BATCH, PIXEL_LEVELS, BF16, X_STRIDE (pixels per staged row:
// 0, or FEATURE_STRIDE padded to ≡ 64 bytes mod 128 for floats, ≡ 16 for bytes, and for bf16 to an
// odd number of 16-byte pieces (ldmatrix's rows), so that a load phase's rows fall on different
// banks). Without a bias (bias = 0) every bias stays zero.
//
// PIXEL_LEVELS = 255 where every input is an 8-bit pixel k/255 (as loaded from uint8): the images
// are then k (bf16 in the BF16 build, else bytes), exact in bf16 and in TF32, so layer 1's TF32
// products take two passes, not three; x's unit 1/255 goes into h_1 and W_1's step. 0: float
// images (bf16-rounded in the BF16 build; three TF32 passes in the other).

#define S (HIDDEN / CLUSTER)          // units a block owns per hidden layer
#define SQ (S / 4)                    // ... as float4 quads
#define CS ((CLASSES + 3) / 4 * 4)    // classes padded to whole float4 quads
#define WARPS (THREADS / 32)
#define NT ((S + 7) / 8)              // a block's units in mma columns of 8
// WST, DST: floats per row of wt[k][u] and of dh (MlpShape.strides).
// wt[k][u] lies at k·WST + (u ^ WT_SWIZZLE(k)). Where WST ≡ 16 (mod 32) the XOR (of whole quads,
// so pairs and quads stay together) spreads a fragment's loads of rows k0 + g, columns t (the
// backward's Q and update) over all 32 banks, which rows g, g + 2, g + 4, g + 6 would otherwise
// share. (With rows of 8 floats the same loads share banks only two ways, and the XOR's address
// arithmetic cost more than it saved: 2 ms an epoch on an H100 at H = 128.)
#define WT_SWIZZLE(k) (WST % 32 == 16 ? 4 * (((k) >> 1) & 3) : 0)
#define MT ((BATCH + 15) / 16)        // the batch in mma rows of 16
#define ROWS16 (MT * 16)
#define KB ((BATCH + 7) / 8)          // the batch in k-steps of 8 (the updates sum over rows)
#define H_KSTEPS (HIDDEN / 8)
#define UNIT_KSTEPS NT                // a block's units in k-steps of 8
#define CLASS_TILES ((CLASSES + 7) / 8)  // the classes in mma columns of 8
#define CLASS_KSTEPS CLASS_TILES       // ... and in k-steps of 8
#define F_MTILES (FEATURE_STRIDE / 16)
#define H_MTILES (HIDDEN / 16)
#define R_OWN ((BATCH + CLUSTER - 1) / CLUSTER)  // rows a block owns for the softmax (of a full step)
#define QUADS (CS / 4)
#define GATHER_BARS (LAYERS - 1)
#define NBARS (2 * (LAYERS - 1) + 3)  // an mbarrier per exchange, and the images'
#if BF16
typedef unsigned short Pixel;  // bf16 bits
#define PIXEL_ROW_ALIGN 16     // staged rows: an odd number of 16-byte pieces (ldmatrix): see MlpShape.x_stride
#elif PIXEL_LEVELS
typedef unsigned char Pixel;
#define PIXEL_ROW_ALIGN 16
#else
typedef float Pixel;
#define PIXEL_ROW_ALIGN 64
#endif
#define X_UNIT (PIXEL_LEVELS ? 1.0f / PIXEL_LEVELS : 1.0f)
// Steps ahead whose images a step copies in: bf16 or bytes one, floats none (copied at the step's
// start). The BF16 build keeps a step's images in registers once layer 1's forward has read them
// (W1Regs), so one buffer serves; the TF32 build reads them again for W_1's update: two buffers.
#define X_LEAD (X_STRIDE && sizeof(Pixel) < 4 ? 1 : 0)
#define X_BUFFERS (BF16 ? 1 : X_LEAD + 1)
#define W1_TILES_PER_WARP ((F_MTILES + WARPS - 1) / WARPS)  // a warp's input tiles of 16 of layer 1

#if (X_STRIDE != 0 && (BF16 ? X_STRIDE * 2 % 32 : X_STRIDE * (PIXEL_LEVELS ? 1 : 4) % 128) != PIXEL_ROW_ALIGN) || S % 4 != 0 || FEATURE_STRIDE % 16 != 0 || HIDDEN % 16 != 0 || CLASSES > 32 || LAYERS < 1 || THREADS % 32 != 0 || THREADS < 64
#error "persistent_mlp.cu: unsupported HIDDEN / FEATURE_STRIDE / CLASSES / LAYERS / THREADS"
#endif

// From cluster.cuh and tf32_mma.cuh (put before this file by the launcher): cluster_rank,
// cluster_sync, remote, copy4_async, copy16_async, async_commit, async_wait_all, smem_addr, send2,
// mbarrier_expect, mbarrier_wait, step_rows; mma_tf32, split_tf32, Sums3, total, mma_x.

// The three passes of a tile's product, each into its own sum of a Sums3 (three independent chains).
__device__ __forceinline__ void mma_3xtf32(Sums3& d, const unsigned (&a_hi)[4], const unsigned (&a_lo)[4],
                                           const unsigned (&b_hi)[2], const unsigned (&b_lo)[2]) {
    mma_tf32(d.lh, a_lo, b_hi);
    mma_tf32(d.hl, a_hi, b_lo);
    mma_tf32(d.hh, a_hi, b_hi);
}
__device__ __forceinline__ void mma_split(Sums3& d, const float (&a)[4], const float (&b)[2]) {
    unsigned a_hi[4], a_lo[4], b_hi[2], b_lo[2];
    split_tf32(a, a_hi, a_lo);
    split_tf32(b, b_hi, b_lo);
    mma_3xtf32(d, a_hi, a_lo, b_hi, b_lo);
}

// Two and four consecutive inputs as one load (Pixels2, Pixels4), and as a product reads them
// (as_operand): floats for the TF32 products, the bf16 pairs themselves for the BF16 ones.
#if BF16
typedef unsigned Pixels2;
typedef uint2 Pixels4;
__device__ __forceinline__ unsigned as_operand(unsigned v) { return v; }
__device__ __forceinline__ uint2 as_operand(uint2 v) { return v; }
#elif PIXEL_LEVELS
typedef unsigned short Pixels2;
typedef unsigned Pixels4;
// Byte i of v as a float, exactly: 2²³ + byte as a float's bits, less 2²³ (two instructions).
__device__ __forceinline__ float byte_value(unsigned v, int i) {
    return __uint_as_float(__byte_perm(v, 0x4b000000u, 0x7440 + i)) - 8388608.0f;
}
__device__ __forceinline__ float2 as_operand(Pixels2 v) { return make_float2(byte_value(v, 0), byte_value(v, 1)); }
__device__ __forceinline__ float4 as_operand(Pixels4 v) {
    return make_float4(byte_value(v, 0), byte_value(v, 1), byte_value(v, 2), byte_value(v, 3));
}
#else
typedef float2 Pixels2;
typedef float4 Pixels4;
__device__ __forceinline__ float2 as_operand(float2 v) { return v; }
__device__ __forceinline__ float4 as_operand(float4 v) { return v; }
#endif

// The block this thread sends its bulk copy to in an all-to-all exchange, or −1. (The SM's copy
// engine takes ~60 cycles a copy, one after another, whichever warps issue them. Measured slower
// on an H100, at H = 128 and 256: a different order of destinations in every block, (rank + 1 +
// i) mod CLUSTER, by 1 to 6%; 4 to 11 of the 15 pieces as st.async stores from warps 1.. beside
// the bulk copies, by 2 to 15%, the stores taking the same bandwidth.)
__device__ __forceinline__ int send_dest() { return threadIdx.x < CLUSTER ? threadIdx.x : -1; }

__device__ __forceinline__ int g_of(int lane) { return lane >> 2; }  // an mma fragment's row group
__device__ __forceinline__ int t_of(int lane) { return lane & 3; }   // ... and its column pair
// D += A·B over K_STEPS k-steps of 8 for one m16n8 tile, three passes; a(m, k) and b(k, n) give the
// operands relative to the tile (zero where they run past the data).
template <int K_STEPS, class A, class B>
__device__ __forceinline__ void tile_product(Sums3& d, A a, B b) {
    const int lane = threadIdx.x & 31, g = g_of(lane), t = t_of(lane);
#pragma unroll
    for (int ks = 0; ks < K_STEPS; ++ks) {
        const int k = 8 * ks;
        const float av[4] = {a(g, k + t), a(g + 8, k + t), a(g, k + t + 4), a(g + 8, k + t + 4)};
        const float bv[2] = {b(k + t, g), b(k + t + 4, g)};
        mma_split(d, av, bv);
    }
}

__device__ __forceinline__ float4 add4(float4 a, float4 b) { return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w); }
__device__ __forceinline__ float4 relu4(float4 v) {
    return make_float4(fmaxf(v.x, 0.0f), fmaxf(v.y, 0.0f), fmaxf(v.z, 0.0f), fmaxf(v.w, 0.0f));
}

// h_full's elements: bf16 in the BF16 build, where h_l (l < LAYERS) is only ever a product's operand
// (so rounded to bf16 anyway; the ReLU masks come from h_own) and a gather then moves half the
// bytes (the exchanges move 7 to 14 bytes a cycle an SM: at H = 256 a gather of floats took ~2,000
// cycles); else floats.
#if BF16
typedef unsigned short HElem;
#else
typedef float HElem;
#endif
// D_l's pieces (this block's partial sums Q_c[:, U_o] for block o) as they travel: bf16 in the BF16
// build, floats in the TF32 one. The receiver sums the CLUSTER pieces in fp32; so in the BF16 build
// each of the 16 partial sums of dh_{l−1} is rounded to bf16 before the sum (as a bf16 reduce-scatter
// of gradients rounds its pieces), and dh_{l−1} again as the next products' operand. Half the bytes:
// at H = 256 the step took 8% less (H100) and the test accuracy stayed the same. A block stages its
// pieces of D_l where h_{l−1} lies (backward_layer): one element type.
typedef HElem QElem;
#if BF16
__device__ __forceinline__ float4 load_q4(const QElem* p) {  // four bf16 as floats (exact)
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                       __uint_as_float(v.y & 0xffff0000u));
}
__device__ __forceinline__ void store_q2(QElem* p, float a, float b) { *reinterpret_cast<unsigned*>(p) = bf16x2(a, b); }
#else
__device__ __forceinline__ float4 load_q4(const QElem* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void store_q2(QElem* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
#endif
// The dynamic shared memory, carved from its layout table (kernels/persistent_mlp.py:
// MlpShape.layout_with, which gives the launcher its byte count too).
#define INBOX_FLOATS (CLUSTER * BATCH * S * (int)sizeof(QElem) / 4)  // an inbox (inbox_of)
struct Smem {
    unsigned long long* bars;  // [NBARS]  G_1..G_{L−1}; Z; Y; D_2..D_L; the images' copies
    double* totals;   // [2 + 2·WARPS]        block totals of loss and correct, then per warp
    float* w1;        // [FEATURE_STRIDE][WST]  W_1[U_c, :] in quads of inputs (w1_at), zero past S;
                      //   none in the BF16 build, whose W_1 lives in registers (W1Regs)
    float* w;         // [LAYERS−1][HIDDEN][WST]  W_l[U_c, :] for l = 2..LAYERS
    float* wh;        // [CS][S]              W_h[:, U_c], zero past CLASSES
    float* b;         // [LAYERS][S]          b_l[U_c]
    float* bh;        // [CS]                 the head's bias (every block's copy)
    HElem* h_full;    // [LAYERS−1][CLUSTER][BATCH][S]  h_l of the whole batch, l < LAYERS, by owning block
    float* zin;       // [CLUSTER][R_OWN][CS]  partial logits of the owned rows, per sending block;
                      //   with LAYERS ≥ 3 also inbox[1]
    float* inbox_mid; // [LAYERS−3][CLUSTER][BATCH][S]  inbox[l] for 2 ≤ l ≤ LAYERS−2
    float* last;      // inbox[LAYERS−1] [CLUSTER][BATCH][S] and the partial sums [WARPS][ROWS16][WST]
    float* h_own;     // [LAYERS][BATCH][S]   h_l[:, U_c]: the ReLU masks, the head's input
    float* dh;        // [2][ROWS16][DST]     dh_l[:, U_c] in dh[l mod 2] (dh_of), 0 past the rows and S
    float* dl;        // [BATCH][CS]          dlogits, every owner's rows
    float* gwh;       // [CS][S], then [CS]   the head's gradient
    Pixel* x;         // [X_BUFFERS][BATCH][X_STRIDE]  a step's images, where they fit (X_STRIDE > 0)
    int* order;       // [3][BATCH]           sample indices of this step and the next two
    int* labels;      // [2][BATCH]           labels of this step and the next
    long long* probe_counts;  // [PROBE_PHASES][PROBE_LAYERS]  probe builds only (probes.cuh)
};

__device__ Smem carve(unsigned char* base) {
    Smem s;
    SMEM_REGION(s, base, bars, BARS);
    SMEM_REGION(s, base, totals, TOTALS);
    SMEM_REGION(s, base, w1, W1);
    SMEM_REGION(s, base, w, W);
    SMEM_REGION(s, base, wh, WH);
    SMEM_REGION(s, base, b, B);
    SMEM_REGION(s, base, bh, BH);
    SMEM_REGION(s, base, h_full, H_FULL);
    SMEM_REGION(s, base, zin, ZIN);
    SMEM_REGION(s, base, inbox_mid, INBOX_MID);
    SMEM_REGION(s, base, last, LAST);
    SMEM_REGION(s, base, h_own, H_OWN);
    SMEM_REGION(s, base, dh, DH);
    SMEM_REGION(s, base, dl, DL);
    SMEM_REGION(s, base, gwh, GWH);
    SMEM_REGION(s, base, x, X);
    SMEM_REGION(s, base, order, ORDER);
    SMEM_REGION(s, base, labels, LABELS);
#ifdef PROBES
    SMEM_REGION(s, base, probe_counts, PROBE_COUNTS);
#endif
    check_shared_bytes(SMEM_BYTES);
    return s;
}

__device__ __forceinline__ float* layer_weights(const Smem& s, int l) {  // wt of hidden layer l (1-based)
    return l == 1 ? s.w1 : s.w + (l - 2) * HIDDEN * WST;
}
// dh_l's inbox, 1 ≤ l ≤ LAYERS − 1 (see the header), and its barrier.
__device__ __forceinline__ float* inbox_of(const Smem& s, int l) {
    return l == LAYERS - 1 ? s.last : l == 1 ? s.zin : s.inbox_mid + (l - 2) * INBOX_FLOATS;
}
__device__ __forceinline__ unsigned long long* gather_bar(const Smem& s, int l) { return s.bars + (l - 1); }
__device__ __forceinline__ unsigned long long* zin_bar(const Smem& s) { return s.bars + GATHER_BARS; }
__device__ __forceinline__ unsigned long long* dl_bar(const Smem& s) { return s.bars + GATHER_BARS + 1; }
__device__ __forceinline__ unsigned long long* inbox_bar(const Smem& s, int l) { return s.bars + GATHER_BARS + 2 + (l - 1); }
__device__ __forceinline__ unsigned long long* x_bar(const Smem& s) { return s.bars + NBARS - 1; }
// dh_l's buffer. Two, so that dh_{l−1} is summed while dh_l may still be read (the bias's update).
__device__ __forceinline__ float* dh_of(const Smem& s, int l) { return s.dh + (l & 1) * ROWS16 * DST; }
__device__ __forceinline__ Pixel* staged_images(const Smem& s, int buffer) { return s.x + buffer * BATCH * X_STRIDE; }
// Step `step`'s images into image buffer step % X_BUFFERS (the sample indices `step_order` in shared
// memory), by threads `first` .. THREADS − 1. Copied a step ahead (X_LEAD = 1): a bulk copy a row
// (the SM's copy engine), counted on the images' barrier (a phase a step; the next step's copies go
// out after this step's wait), the rows spread over the warps: the engine takes them one after
// another, ~60 cycles each, and no warp waits for all 32. 16-byte cp.async copies spread over the
// block took ~3% of a step more at H = 256 (H100): their ~3,000 loads a step held up the softmax's
// warp beside them. Copied at the step's start (floats, X_LEAD = 0): cp.async copies, landed once
// their threads have waited (async_wait_all) and met at a block barrier (bulk copies, one after
// another, would hold up layer 1's products).
__device__ void copy_images_in(const Smem& s, const Pixel* images, const int* step_order, int step, int rows, int first = 0) {
    constexpr int ROW_BYTES = FEATURE_STRIDE * sizeof(Pixel), CHUNKS = ROW_BYTES / 16;  // 16-byte pieces a row
    unsigned char* staged = reinterpret_cast<unsigned char*>(staged_images(s, step % X_BUFFERS));
    if (threadIdx.x < first) return;
    if (X_LEAD) {
        const int copiers = (THREADS - first) / 32, w = (threadIdx.x - first) >> 5, lane = threadIdx.x & 31;
        if (threadIdx.x == first) mbarrier_expect(x_bar(s), rows * ROW_BYTES);
        for (int r = w + copiers * lane; r < rows; r += 32 * copiers)
            copy_bulk(staged + r * X_STRIDE * sizeof(Pixel), images + (long long)step_order[r] * FEATURE_STRIDE, ROW_BYTES, x_bar(s));
    } else {
        for (int i = threadIdx.x - first; i < rows * CHUNKS; i += THREADS - first) {
            const int r = i / CHUNKS, c = i - r * CHUNKS;
            const unsigned char* row = reinterpret_cast<const unsigned char*>(images + (long long)step_order[r] * FEATURE_STRIDE);
            copy16_async(staged + r * X_STRIDE * sizeof(Pixel) + 16 * c, row + 16 * c);
        }
    }
}

// The rows of a product's left operand: a batch of images in global memory, or rows in shared.
// load2 and load4 give two and four consecutive inputs as the products read them (as_operand).
struct ImageRows {
    static constexpr bool SHARED = false;
    const Pixel* images; const int* order;
    __device__ const Pixel* operator()(int r) const { return images + (long long)order[r] * FEATURE_STRIDE; }
    __device__ static auto load2(const Pixel* p) { return as_operand(__ldg(reinterpret_cast<const Pixels2*>(p))); }
    __device__ static auto load4(const Pixel* p) { return as_operand(__ldg(reinterpret_cast<const Pixels4*>(p))); }
};
template <int STRIDE> struct SharedRows {
    static constexpr bool SHARED = true;
    const Pixel* base;
    __device__ const Pixel* operator()(int r) const { return base + r * STRIDE; }
    __device__ static auto load2(const Pixel* p) { return as_operand(*reinterpret_cast<const Pixels2*>(p)); }
    __device__ static auto load4(const Pixel* p) { return as_operand(*reinterpret_cast<const Pixels4*>(p)); }
};
// Sender c's piece of an inbox (rows × S).
__device__ __forceinline__ QElem* inbox_piece(float* inbox, int c) { return reinterpret_cast<QElem*>(inbox) + c * BATCH * S; }
// Where h_l[r][k] lies in h_full[l] (block-major): r·S + hcol(k), in HElems.
__device__ __forceinline__ int hcol(int k) { return k / S * (BATCH * S) + k % S; }
__device__ __forceinline__ HElem* h_of(const Smem& s, int l) { return s.h_full + (l - 1) * BATCH * HIDDEN; }
using StagedRows = SharedRows<X_STRIDE == 0 ? 16 : X_STRIDE>;  // the batch's images in shared memory

// A warp's partial sums of a forward product, rows × units: partial[warp][r][u].
template <class Sums>
__device__ __forceinline__ void store_partial(const Sums (&sums)[MT][NT], float* partial) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    float* p = partial + warp * ROWS16 * WST;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                *reinterpret_cast<float2*>(p + (16 * mt + 8 * h + g) * WST + 8 * n + 2 * t) =
                    make_float2(total(sums[mt][n], 2 * h), total(sums[mt][n], 2 * h + 1));
}

// W_1 in quads of 4 inputs: W_1[k][u] at ((k/4)·WST + (u ^ 2·(k/4 mod 4)))·4 + k mod 4. A lane's
// four inputs 4t..4t+3 of unit g are one 16-byte load, and the XOR spreads the 8 lanes of a load
// phase (units g, g + 1 of quads t = 0..3) over all 32 banks.
__device__ __forceinline__ int w1_at(int k, int u) { return (((k >> 2) * WST + (u ^ (((k >> 2) & 3) << 1))) << 2) + (k & 3); }
__device__ __forceinline__ int wt_at(int k, int u) { return k * WST + (u ^ WT_SWIZZLE(k)); }  // layers ≥ 2
__device__ __forceinline__ int weight_at(int l, int k, int u) { return l == 1 ? w1_at(k, u) : wt_at(k, u); }

// Whether warp w has an i-th of TILES tiles taken w, w + WARPS, ...: warp-uniform, and known at
// compile time but in the last round (i unrolled), so that a tile's loads address the warp's first
// tile plus a constant, with no arithmetic of their own (a select of the tile per load took ~4% of
// a step at H = 128, H100: the updates of W_1 were bound by issuing instructions).
template <int TILES>
__device__ __forceinline__ bool warp_has_tile(int i) {
    constexpr int LAST = (TILES + WARPS - 1) / WARPS - 1;
    return TILES % WARPS == 0 || i < LAST || (int)(threadIdx.x >> 5) < TILES - WARPS * LAST;
}

#define BACKWARD_TILES ((H_MTILES + WARPS - 1) / WARPS)  // a warp's input tiles of 16 in the backward

// W_1[U_c, 16mt..16mt+15] −= lr · grad[i] for N of warp w's tiles of the update, mt = w + WARPS·(i0 +
// i) (m = inputs, n = units, as an mma's D fragment: its rows g and g + 8 are the inputs 2g and 2g +
// 1, so unit 8n + 2t + e of both is one float2 of W_1's quads). Every load goes before any store: a
// store through these pointers holds back each load after it. The TF32 build (the BF16 one keeps
// W_1 in registers: W1Regs) updates one tile at a time, short of registers (all at once took 1 to
// 2% more, H100).
template <int N>
__device__ __forceinline__ void update_w1(float* w1, int i0, const float (&grad)[N][NT][4], float lr) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    float2 old[N][NT][2];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int mt = warp + WARPS * (i0 + i);
        if (!warp_has_tile<F_MTILES>(i0 + i)) break;  // the same for the whole warp
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) old[i][n][e] = *reinterpret_cast<const float2*>(w1 + w1_at(16 * mt + 2 * g, 8 * n + 2 * t + e));
    }
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int mt = warp + WARPS * (i0 + i);
        if (!warp_has_tile<F_MTILES>(i0 + i)) break;  // the same for the whole warp
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                *reinterpret_cast<float2*>(w1 + w1_at(16 * mt + 2 * g, 8 * n + 2 * t + e)) =
                    make_float2(fmaf(-lr, grad[i][n][e], old[i][n][e].x), fmaf(-lr, grad[i][n][2 + e], old[i][n][e].y));
    }
}

// W_l[U_c, :] −= lr · grad[ii] for N of warp w's input tiles of the backward (l ≥ 2), k0 = 16i, i =
// w + WARPS·(i0 + ii): grad[ii][n] an mma D fragment whose rows g and g + 8 are the inputs k0 +
// in[0] and k0 + in[1] and whose columns 2t, 2t + 1 are the units 8n + 2t, 8n + 2t + 1 (one float2
// of wt). As in update_w1, every load goes before any store, and the bf16 build updates all its
// tiles at once, the TF32 build one at a time.
template <int N>
__device__ __forceinline__ void update_hidden(float* wt, int i0, const float (&grad)[N][NT][4], const int (&in)[2],
                                              float lr) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = lane & 3;
    float2 old[N][NT][2];
#pragma unroll
    for (int ii = 0; ii < N; ++ii) {
        const int i = warp + WARPS * (i0 + ii);
        if (H_MTILES % WARPS != 0 && i >= H_MTILES) break;  // the same for the whole warp
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int h = 0; h < 2; ++h) old[ii][n][h] = *reinterpret_cast<const float2*>(wt + wt_at(16 * i + in[h], 8 * n + 2 * t));
    }
#pragma unroll
    for (int ii = 0; ii < N; ++ii) {
        const int i = warp + WARPS * (i0 + ii);
        if (H_MTILES % WARPS != 0 && i >= H_MTILES) break;  // the same for the whole warp
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                *reinterpret_cast<float2*>(wt + wt_at(16 * i + in[h], 8 * n + 2 * t)) =
                    make_float2(fmaf(-lr, grad[ii][n][2 * h], old[ii][n][h].x), fmaf(-lr, grad[ii][n][2 * h + 1], old[ii][n][h].y));
    }
}

// The TF32 build's image operand of layer 1's forward: warp w's rows 16mt + 8h + g (the last
// row again past the step's) at the lane's inputs 16w + 4t, and load(i, v) the four inputs there
// of the warp's i-th input tile w + WARPS·i (Rows::load4; zero past the last tile).
template <class Rows>
struct FirstLayerTiles {
    static constexpr int TILES = FEATURE_STRIDE / 16, TPW = (TILES + WARPS - 1) / WARPS;  // tiles, a warp's
    const Pixel* row[MT][2];
    __device__ FirstLayerTiles(Rows x_rows, int rows) {
        const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3, warp = threadIdx.x >> 5;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) row[mt][h] = x_rows(min(16 * mt + 8 * h + g, rows - 1)) + 16 * warp + 4 * t;
    }
    template <class V>
    __device__ __forceinline__ void load(int i, V (&v)[MT][2], V zero) const {
        const bool valid = warp_has_tile<TILES>(i);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) v[mt][h] = valid ? Rows::load4(row[mt][h] + 16 * WARPS * i) : zero;
    }
    // The input quad 4c + t of W_1's tile c = w + WARPS·i, c = w where the warp has no i-th tile
    // (its images are zero there): ((4c + t)·WST + ((8n + g) ^ 2t))·4 (w1_at) less 32n.
    __device__ static __forceinline__ int w1_quad(int i) {
        const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3, warp = threadIdx.x >> 5;
        const int c = warp + (warp_has_tile<TILES>(i) ? WARPS * i : 0);
        return ((4 * c + t) * WST + (g ^ (t << 1))) << 2;
    }
};

// ==== The products: TF32 passes (BF16 = 0) ======================================================
#if !BF16
// ---- forward of layer 1: partial[w] = x · W_1[U_c, :]ᵀ over warp w's tiles of 16 inputs ------
// Warp w takes the input tiles w, w + WARPS, ... (zero past the last: no branch around the mma).
// Within a tile a lane holds inputs 4t..4t+3 of its rows (one 16-byte load) and of its unit: the
// first k-step takes inputs 4t, 4t + 1 as its k = t, t + 4, the second 4t + 2, 4t + 3 (a
// permutation of k, the same for both operands, leaves the product as it is).
template <class Rows>
__device__ __forceinline__ void forward_first(Rows x_rows, const float* w1, float* partial, int rows) {
    using Tiles = FirstLayerTiles<Rows>;
    constexpr int TPW = Tiles::TPW;
    const Tiles tiles(x_rows, rows);  // a tile's inputs, loaded one tile ahead of its products
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    Sums3 sums[MT][NT];
    float4 v[MT][2], v_next[MT][2];
    tiles.load(0, v_next, zero);
#pragma unroll
    for (int i = 0; i < TPW; ++i) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) { v[mt][0] = v_next[mt][0]; v[mt][1] = v_next[mt][1]; }
        if (i + 1 < TPW) tiles.load(i + 1, v_next, zero);
        const float* w1_quad = w1 + Tiles::w1_quad(i);
        unsigned b_hi[NT][2][2], b_lo[NT][2][2];  // [unit tile][k-step][fragment register]
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const float4 b = *reinterpret_cast<const float4*>(w1_quad + 32 * n);
            const float b0[2] = {b.x, b.y}, b1[2] = {b.z, b.w};
            split_tf32(b0, b_hi[n][0], b_lo[n][0]);
            split_tf32(b1, b_hi[n][1], b_lo[n][1]);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const float4 v0 = v[mt][0], v1 = v[mt][1];
            const float a0[4] = {v0.x, v1.x, v0.y, v1.y}, a1[4] = {v0.z, v1.z, v0.w, v1.w};
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                mma_x(sums[mt][n], a0, b_hi[n][0], b_lo[n][0]);
                mma_x(sums[mt][n], a1, b_hi[n][1], b_lo[n][1]);
            }
        }
    }
    store_partial(sums, partial);
}

// ---- forward of layer l ≥ 2: partial[w] = h_{l−1} · W_l[U_c, :]ᵀ over warp w's k-steps -------
// Warp w takes the k-steps w, w + WARPS, ... of the HIDDEN inputs for every row tile and unit
// tile; past them its A operand is zero (no branch around the mma). Rows past the step's are the
// last row again (finite; their sums are never read). h: h_full[l − 1], block-major.
__device__ __forceinline__ void forward_hidden(const float* h, const float* wt, float* partial, int rows) {
    constexpr int KPW = (H_KSTEPS + WARPS - 1) / WARPS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    int row[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) row[mt][hh] = min(16 * mt + 8 * hh + g, rows - 1) * S;
    Sums3 sums[MT][NT];
#pragma unroll
    for (int i = 0; i < KPW; ++i) {
        const int ks = warp + WARPS * i;
        const bool valid = H_KSTEPS % WARPS == 0 || ks < H_KSTEPS;
        const int k = valid ? 8 * ks : 0, c0 = hcol(k + t), c1 = hcol(k + t + 4);
        float b[NT][2];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            b[n][0] = wt[wt_at(k + t, 8 * n + g)];
            b[n][1] = wt[wt_at(k + t + 4, 8 * n + g)];
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float a[4] = {h[row[mt][0] + c0], h[row[mt][1] + c0], h[row[mt][0] + c1], h[row[mt][1] + c1]};
            if (!valid) a[0] = a[1] = a[2] = a[3] = 0.0f;
#pragma unroll
            for (int n = 0; n < NT; ++n) mma_split(sums[mt][n], a, b[n]);
        }
    }
    store_partial(sums, partial);
}

// ---- backward ----------------------------------------------------------------------------------
// An update's B operand, split: dh (k = rows, n = units) for every k-step of the batch.
__device__ __forceinline__ void dh_operand(const float* dh, unsigned (&b_hi)[KB][NT][2], unsigned (&b_lo)[KB][NT][2]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int ks = 0; ks < KB; ++ks)
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const float b[2] = {dh[(8 * ks + t) * DST + 8 * n + g], dh[(8 * ks + t + 4) * DST + 8 * n + g]};
            split_tf32(b, b_hi[ks][n], b_lo[ks][n]);
        }
}

// Layer l ≥ 2's products for warp w's input tiles k0 = 16i (i = w, w + WARPS, ...; backward_layer,
// below): Q[:, k0..] into q_out, and the update of W_l[U_c, k0..] (the tile's rows g and g + 8 are
// the inputs k0 + g and k0 + g + 8).
__device__ __forceinline__ void backward_products(const HElem* h_prev, float* wt, const float* dh, float lr, int rows,
                                                  float (&q_out)[BACKWARD_TILES][MT][2][4]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    unsigned bu_hi[KB][NT][2], bu_lo[KB][NT][2];  // the update's B operand, the same for every input tile
    dh_operand(dh, bu_hi, bu_lo);
    int h_row[KB][2];  // rows 8ks + t and 8ks + t + 4 of h_{l−1}, the last row past the step's
#pragma unroll
    for (int ks = 0; ks < KB; ++ks)
#pragma unroll
        for (int h = 0; h < 2; ++h) h_row[ks][h] = min(8 * ks + 4 * h + t, rows - 1) * S;
    const int in[2] = {g, g + 8};  // the inputs of a tile's update rows g and g + 8
#pragma unroll
    for (int ii = 0; ii < BACKWARD_TILES; ++ii) {
        const int i = warp + WARPS * ii;
        if (H_MTILES % WARPS != 0 && i >= H_MTILES) break;  // the same for the whole warp
        const int k0 = 16 * i, c_lo = hcol(k0 + g), c_hi = hcol(k0 + g + 8);
        Sums3 q[MT][2];
#pragma unroll
        for (int kk = 0; kk < NT; ++kk) {
            float b[2][2];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                b[j][0] = wt[wt_at(k0 + 8 * j + g, 8 * kk + t)];
                b[j][1] = wt[wt_at(k0 + 8 * j + g, 8 * kk + t + 4)];
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const float* d0 = dh + (16 * mt + g) * DST + 8 * kk + t;
                const float a[4] = {d0[0], d0[8 * DST], d0[4], d0[8 * DST + 4]};
#pragma unroll
                for (int j = 0; j < 2; ++j) mma_split(q[mt][j], a, b[j]);
            }
        }
        Sums3 du[NT];
#pragma unroll
        for (int ks = 0; ks < KB; ++ks) {
            const float a[4] = {h_prev[h_row[ks][0] + c_lo], h_prev[h_row[ks][0] + c_hi], h_prev[h_row[ks][1] + c_lo],
                                h_prev[h_row[ks][1] + c_hi]};
            unsigned a_hi[4], a_lo[4];
            split_tf32(a, a_hi, a_lo);
#pragma unroll
            for (int n = 0; n < NT; ++n) mma_3xtf32(du[n], a_hi, a_lo, bu_hi[ks][n], bu_lo[ks][n]);
        }
        float grad[1][NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) grad[0][n][e] = total(du[n], e);
        __syncwarp();  // every lane's loads of these weights (for Q) before any lane's update
        update_hidden(wt, ii, grad, in, lr);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) q_out[ii][mt][j][e] = total(q[mt][j], e);
    }
}

// W_1[U_c, :] −= lr · (xᵀ dh_1)ᵀ, x in global memory or staged in shared: m = inputs (tiles of 16,
// warp w taking w, w + WARPS, ...), k = rows, n = units. A lane's rows m = g, g + 8 of a tile are
// the inputs 2g, 2g + 1 (one 8-byte load). Rows past the step's read the last row again, against
// zeros of dh.
template <class Rows>
__device__ void update_first_layer(Rows x_rows, float* w1, const float* dh, float lr, int rows) {
    constexpr int MPW = W1_TILES_PER_WARP;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    unsigned b_hi[KB][NT][2], b_lo[KB][NT][2];
    dh_operand(dh, b_hi, b_lo);
    const Pixel* x_row[KB][2];
#pragma unroll
    for (int ks = 0; ks < KB; ++ks)
#pragma unroll
        for (int h = 0; h < 2; ++h) x_row[ks][h] = x_rows(min(8 * ks + 4 * h + t, rows - 1)) + 16 * warp + 2 * g;
    // A tile's inputs, loaded one tile ahead of its products.
    const auto load_tile = [&](int i, float2 (&a)[KB][2]) {
#pragma unroll
        for (int ks = 0; ks < KB; ++ks)
#pragma unroll
            for (int h = 0; h < 2; ++h) a[ks][h] = Rows::load2(x_row[ks][h] + 16 * WARPS * i);
    };
    float2 a_cur[KB][2], a_next[KB][2];
    load_tile(0, a_next);
#pragma unroll
    for (int i = 0; i < MPW; ++i) {
        if (!warp_has_tile<F_MTILES>(i)) break;  // (the same for the whole warp)
#pragma unroll
        for (int ks = 0; ks < KB; ++ks) { a_cur[ks][0] = a_next[ks][0]; a_cur[ks][1] = a_next[ks][1]; }
        if (i + 1 < MPW && warp_has_tile<F_MTILES>(i + 1)) load_tile(i + 1, a_next);
        Sums3 d[NT];
#pragma unroll
        for (int ks = 0; ks < KB; ++ks) {
            const float a[4] = {a_cur[ks][0].x, a_cur[ks][0].y, a_cur[ks][1].x, a_cur[ks][1].y};
#pragma unroll
            for (int n = 0; n < NT; ++n) mma_x(d[n], a, b_hi[ks][n], b_lo[ks][n]);
        }
        float grad[1][NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) grad[0][n][e] = total(d[n], e);
        update_w1(w1, i, grad, lr);
    }
}

#else
// ==== The products: bf16 operands, one pass (BF16 = 1) ==========================================
// The same products as above, each operand rounded to bf16 as it is loaded (cvt.rn.bf16x2: one
// instruction a pair) and multiplied in one m16n8k16 pass, sums in fp32. The images come as bf16
// already (8-bit pixels as k, exact). In the products of layers ≥ 2 a lane's k-slots 2t, 2t + 1,
// 2t + 8, 2t + 9 (mma_bf16) take four consecutive inputs 4t..4t + 3 where k runs over inputs or units
// (one 8- or 16-byte load), and the rows t, t + 4, t + 8, t + 12 where k runs over the batch (an
// update): a permutation of k, the same for both operands, leaves a product as it is. Layer 1's
// (W1Regs) take the fragments' own order.

// ---- layer 1: W_1 and the step's images in registers ------------------------------------------
// Warp w takes the input tiles c = w + WARPS·i of 16 inputs (i < W1_TILES_PER_WARP) for both of
// layer 1's products, so its part of W_1[U_c, :] never leaves its registers: they hold it as the
// update's D fragments (m = units, n = inputs), which are exactly the forward's B fragments (k =
// inputs, n = units): lane (g, t) keeps W_1[8n + g][16c + 8h + 2t + j], in fp32. The forward's A
// fragments of the images (m = rows, k = inputs; one ldmatrix.x4 a tile of 16 rows from shared
// memory) stay in registers until the update, whose B operand (k = rows, n = inputs) is their
// transpose: one movmatrix a register. So no W_1 goes through shared memory, and the staged images
// are free once the forward has read them: one buffer, the next step's copied in while this step
// trains. (At H = 256 the images then fit in shared memory, which they did not beside W_1.)
// A warp without an i-th tile (the last round only) holds zeros for it and skips its products.
struct W1Regs {
    static constexpr int TILES = F_MTILES, TPW = W1_TILES_PER_WARP, UT = (S + 15) / 16;  // UT: units in m-tiles of 16
    float w[TPW][NT][2][2];  // W_1[8n + g][16c + 8h + 2t + j]
    unsigned x[TPW][MT][4];  // the images' A fragments of rows 16mt.., inputs 16c..: x[r][k] as bf16

    // W_1[U_c, :] from global memory (W_1 row-major, HIDDEN × FEATURES), zero past S and FEATURES,
    // and back.
    __device__ void load(const float* w_global, int u0) {
        each_weight(u0, [&](float& v, long long at) { v = at >= 0 ? w_global[at] : 0.0f; });
    }
    __device__ void store(float* w_global, int u0) {
        each_weight(u0, [&](float& v, long long at) { if (at >= 0) w_global[at] = v; });
    }
    // f(w[i][n][h][j], where it lies in W_1 or −1 past S and FEATURES) for each of the warp's tiles.
    template <class F>
    __device__ __forceinline__ void each_weight(int u0, F f) {
#pragma unroll
        for (int i = 0; i < TPW; ++i) {
            if (!warp_has_tile<TILES>(i)) break;  // (the same for the whole warp)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const int u = unit(n), k = input(i, h, j);
                        f(w[i][n][h][j], u < S && k < FEATURES ? (long long)(u0 + u) * FEATURES + k : -1ll);
                    }
        }
    }
    __device__ static int unit(int n) { return 8 * n + ((threadIdx.x & 31) >> 2); }
    __device__ static int input(int i, int h, int j) {
        return 16 * ((int)(threadIdx.x >> 5) + WARPS * i) + 8 * h + 2 * (threadIdx.x & 3) + j;
    }

    // The step's images into x: from shared memory, ldmatrix (lanes 8q..8q + 7 address matrix q's
    // rows: 16mt + 8(q & 1) + ·, inputs 16c + 8(q >> 1)), or from global memory, 4 bytes a register.
    // Rows past the step's read the last row again (finite; their sums are never read, and the
    // update meets them with zeros of dh).
    template <class Rows>
    __device__ __forceinline__ void load_images(Rows x_rows, int rows) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            if constexpr (Rows::SHARED) {
                const unsigned a = smem_addr(x_rows(min(16 * mt + (lane & 15), rows - 1)) + 16 * warp + 8 * (lane >> 4));
#pragma unroll
                for (int i = 0; i < TPW; ++i) {
                    if (!warp_has_tile<TILES>(i)) break;  // (the same for the whole warp)
                    ldmatrix_x4(x[i][mt], a + 2 * 16 * WARPS * i);
                }
            } else {
                const Pixel* r0 = x_rows(min(16 * mt + g, rows - 1)) + 16 * warp + 2 * t;
                const Pixel* r1 = x_rows(min(16 * mt + g + 8, rows - 1)) + 16 * warp + 2 * t;
#pragma unroll
                for (int i = 0; i < TPW; ++i) {
                    if (!warp_has_tile<TILES>(i)) break;
                    const int k = 16 * WARPS * i;
                    x[i][mt][0] = Rows::load2(r0 + k);
                    x[i][mt][1] = Rows::load2(r1 + k);
                    x[i][mt][2] = Rows::load2(r0 + k + 8);
                    x[i][mt][3] = Rows::load2(r1 + k + 8);
                }
            }
        }
    }

    // partial[w] = x · W_1[U_c, :]ᵀ over the warp's tiles (m = rows, k = inputs, n = units).
    __device__ __forceinline__ void forward(float* partial) const {
        Sums1 sums[MT][NT];
#pragma unroll
        for (int i = 0; i < TPW; ++i) {
            if (!warp_has_tile<TILES>(i)) break;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const unsigned b[2] = {bf16x2(w[i][n][0][0], w[i][n][0][1]), bf16x2(w[i][n][1][0], w[i][n][1][1])};
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma_bf16(sums[mt][n].d, x[i][mt], b);
            }
        }
        store_partial(sums, partial);
    }

    // W_1[U_c, :] −= lr · dh_1ᵀ x (m = units, k = rows, n = inputs): A = dh_1ᵀ, lane (g, t) holding
    // units 16ut + g, + 8 at rows 16ks + 2t, + 1, + 8, + 9 (zero past S; dh is zero past the rows).
    __device__ __forceinline__ void update(const float* dh, float lr) {
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        unsigned a[UT][MT][4];
#pragma unroll
        for (int ut = 0; ut < UT; ++ut)
#pragma unroll
            for (int ks = 0; ks < MT; ++ks)
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int u = 16 * ut + g + 8 * (q & 1), r = 16 * ks + 2 * t + 8 * (q >> 1);
                    a[ut][ks][q] = u < S ? bf16x2(dh[r * DST + u], dh[(r + 1) * DST + u]) : 0u;
                }
#pragma unroll
        for (int i = 0; i < TPW; ++i) {
            if (!warp_has_tile<TILES>(i)) break;
            Sums1 d[UT][2];  // units 16ut.., inputs 16c + 8h..
#pragma unroll
            for (int ks = 0; ks < MT; ++ks)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    // B[r][k] = x[16ks + r][16c + 8h + k]: the A registers of those 8×8 matrices, transposed.
                    const unsigned b[2] = {movmatrix_trans(x[i][ks][2 * h]), movmatrix_trans(x[i][ks][2 * h + 1])};
#pragma unroll
                    for (int ut = 0; ut < UT; ++ut) mma_bf16(d[ut][h].d, a[ut][ks], b);
                }
#pragma unroll
            for (int ut = 0; ut < UT; ++ut)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {  // D rows g (units 16ut + g: n = 2ut) and g + 8 (n = 2ut + 1)
                        const int n = 2 * ut + e;
                        if (n < NT)
#pragma unroll
                            for (int j = 0; j < 2; ++j) w[i][n][h][j] = fmaf(-lr, d[ut][h].d[2 * e + j], w[i][n][h][j]);
                    }
        }
    }
};

// ---- forward of layer l ≥ 2: partial[w] = h_{l−1} · W_l[U_c, :]ᵀ over warp w's k-steps of 16 --
// As the TF32 one: warp w takes the k-steps w, w + WARPS, ..., its A operand zero past them; a
// lane's inputs 4t..4t + 3 of a row are one 8-byte load of h_full (bf16; they lie in one block's slot).
__device__ __forceinline__ void forward_hidden(const HElem* h, const float* wt, float* partial, int rows) {
    constexpr int K16 = HIDDEN / 16, KPW = (K16 + WARPS - 1) / WARPS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    int row[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) row[mt][hh] = min(16 * mt + 8 * hh + g, rows - 1) * S;
    Sums1 sums[MT][NT];
#pragma unroll
    for (int i = 0; i < KPW; ++i) {
        const int ks = warp + WARPS * i;
        const bool valid = K16 % WARPS == 0 || ks < K16;
        const int k = (valid ? 16 * ks : 0) + 4 * t, c = hcol(k);
        unsigned b[NT][2];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int u = 8 * n + g;
            b[n][0] = bf16x2(wt[wt_at(k, u)], wt[wt_at(k + 1, u)]);
            b[n][1] = bf16x2(wt[wt_at(k + 2, u)], wt[wt_at(k + 3, u)]);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const uint2 v0 = *reinterpret_cast<const uint2*>(h + row[mt][0] + c);
            const uint2 v1 = *reinterpret_cast<const uint2*>(h + row[mt][1] + c);
            unsigned a[4] = {v0.x, v1.x, v0.y, v1.y};
            if (!valid) a[0] = a[1] = a[2] = a[3] = 0u;
#pragma unroll
            for (int n = 0; n < NT; ++n) mma_bf16(sums[mt][n].d, a, b[n]);
        }
    }
    store_partial(sums, partial);
}

// ---- backward ----------------------------------------------------------------------------------
// An update's B operand: dh (k = rows, n = units) for every k-step of 16 rows, lane (g, t) holding
// rows t, t + 4 and t + 8, t + 12 of unit g.
__device__ __forceinline__ void dh_operand(const float* dh, unsigned (&b)[MT][NT][2]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int ks = 0; ks < MT; ++ks)
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const float* d = dh + (16 * ks + t) * DST + 8 * n + g;
            b[ks][n][0] = bf16x2(d[0], d[4 * DST]);
            b[ks][n][1] = bf16x2(d[8 * DST], d[12 * DST]);
        }
}

// Layer l ≥ 2's products for warp w's input tiles k0 = 16i (i = w, w + WARPS, ...), as the TF32
// ones: Q[:, k0..] = dh_l · W_l[U_c, k0..] (m = rows, k = units in steps of 16, zero past S,
// n = inputs) into q_out, and (h_{l−1}[:, k0..]ᵀ dh_l)ᵀ, W_l[U_c, k0..]'s gradient, into grad (m =
// inputs, the tile's rows g and g + 8 being inputs 2g and 2g + 1, one 8-byte load of h_full; k =
// rows): backward_layer updates W_l once Q is on its way.
__device__ __forceinline__ void backward_products(const HElem* h_prev, const float* wt, const float* dh, int rows,
                                                  float (&q_out)[BACKWARD_TILES][MT][2][4],
                                                  float (&grad)[BACKWARD_TILES][NT][4]) {
    constexpr int UNIT_K16 = (S + 15) / 16;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    unsigned bu[MT][NT][2];  // the update's B operand, the same for every input tile
    dh_operand(dh, bu);
    int h_row[MT][4];  // rows 16ks + t + 4j of h_{l−1}, the last row past the step's
#pragma unroll
    for (int ks = 0; ks < MT; ++ks)
#pragma unroll
        for (int j = 0; j < 4; ++j) h_row[ks][j] = min(16 * ks + t + 4 * j, rows - 1) * S;
#pragma unroll
    for (int ii = 0; ii < BACKWARD_TILES; ++ii) {
        const int i = warp + WARPS * ii;
        if (H_MTILES % WARPS != 0 && i >= H_MTILES) break;  // the same for the whole warp
        const int k0 = 16 * i;
        Sums1 q[MT][2];
#pragma unroll
        for (int kk = 0; kk < UNIT_K16; ++kk) {
            const int u = 16 * kk + 4 * t;
            const bool valid = S % 16 == 0 || u < S;  // units u..u + 3 (S is whole quads)
            const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            unsigned b[2][2];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const float4 w = valid ? *reinterpret_cast<const float4*>(wt + wt_at(k0 + 8 * j + g, u)) : zero;
                b[j][0] = bf16x2(w.x, w.y);
                b[j][1] = bf16x2(w.z, w.w);
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const float* d = dh + (16 * mt + g) * DST + u;
                const float4 d0 = valid ? *reinterpret_cast<const float4*>(d) : zero;
                const float4 d1 = valid ? *reinterpret_cast<const float4*>(d + 8 * DST) : zero;
                const unsigned a[4] = {bf16x2(d0.x, d0.y), bf16x2(d1.x, d1.y), bf16x2(d0.z, d0.w), bf16x2(d1.z, d1.w)};
#pragma unroll
                for (int j = 0; j < 2; ++j) mma_bf16(q[mt][j].d, a, b[j]);
            }
        }
        Sums1 du[NT];
        const int c = hcol(k0 + 2 * g);
#pragma unroll
        for (int ks = 0; ks < MT; ++ks) {
            unsigned v[4];  // rows 16ks + t + 4j, inputs k0 + 2g, + 1 (a bf16 pair)
#pragma unroll
            for (int j = 0; j < 4; ++j) v[j] = *reinterpret_cast<const unsigned*>(h_prev + h_row[ks][j] + c);
            const unsigned a[4] = {low_halves(v[0], v[1]), high_halves(v[0], v[1]), low_halves(v[2], v[3]), high_halves(v[2], v[3])};
#pragma unroll
            for (int n = 0; n < NT; ++n) mma_bf16(du[n].d, a, bu[ks][n]);
        }
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) grad[ii][n][e] = total(du[n], e);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) q_out[ii][mt][j][e] = total(q[mt][j], e);
    }
}

#endif

// h_l[:, U_c] = relu(unit · Σ_w partial[w] + b) (warp order; unit: the inputs' unit, X_UNIT for
// layer 1), into h_own and, when given, this block's slice of h_full[l] (the other blocks' copies of
// it go by bulk copy).
__device__ void forward_finish(const float* partial, const float* bias, float unit, float* h_own, HElem* own_slice, int rows) {
    for (int i = threadIdx.x; i < rows * SQ; i += THREADS) {
        const int uq = i % SQ, r = i / SQ;
        float4 v = *reinterpret_cast<const float4*>(partial + r * WST + 4 * uq);
#pragma unroll
        for (int w = 1; w < WARPS; ++w) v = add4(v, *reinterpret_cast<const float4*>(partial + (w * ROWS16 + r) * WST + 4 * uq));
        const float4 b = reinterpret_cast<const float4*>(bias)[uq];
        v = relu4(make_float4(fmaf(unit, v.x, b.x), fmaf(unit, v.y, b.y), fmaf(unit, v.z, b.z), fmaf(unit, v.w, b.w)));
        *reinterpret_cast<float4*>(h_own + r * S + 4 * uq) = v;
#if BF16
        if (own_slice) *reinterpret_cast<uint2*>(own_slice + r * S + 4 * uq) = make_uint2(bf16x2(v.x, v.y), bf16x2(v.z, v.w));
#else
        if (own_slice) *reinterpret_cast<float4*>(own_slice + r * S + 4 * uq) = v;
#endif
    }
}

// Σ_{r < rows} value(r), in a fixed order that is not a chain of `rows` dependent adds: four
// partial sums over r ≡ 0, 1, 2, 3 (mod 4), then (s0 + s1) + (s2 + s3). Every row of the batch is
// read (value(r) must be readable, finite or not, for r < BATCH) and a row past the step's adds
// zero: a select, not a branch around each load, which made the loads one after another (~1,000
// cycles an update of a bias, H100).
template <class Value>
__device__ __forceinline__ float sum_rows(int rows, Value value) {
    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < BATCH; r += 4)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float v = value(r + k);
            part[k] += r + k < rows ? v : 0.0f;
        }
    return (part[0] + part[1]) + (part[2] + part[3]);
}
// b_l[U_c] −= lr · Σ_r dh_l, by the last S threads (the first ones are the busiest elsewhere).
__device__ void update_bias(float* bias, const float* dh, float lr, int rows) {
    const int u = THREADS - 1 - threadIdx.x;
    if (u < S) bias[u] = fmaf(-lr, sum_rows(rows, [&](int r) { return dh[r * DST + u]; }), bias[u]);
}

// Layer l ≥ 2, warp w taking the inputs k0 = 16i .. 16i + 15 for i = w, w + WARPS, ...:
//   Q[:, k0..] = dh_l · W_l[U_c, k0..] (old weights; m = rows, k = units, n = inputs),
//   W_l[U_c, k0..] −= lr · (h_{l−1}[:, k0..]ᵀ dh_l)ᵀ (m = inputs, k = rows, n = units),
// and Q's columns sent to their owners' inbox `inbox` (at [rank][r][u − u_o]) on barrier `bar`:
// Q[:, k] is staged where h_{l−1}[:, k] lies (h_prev, h_full[l − 1], the same element type: owner o's
// columns at o's slot, see the header), which only the warp's own products read, and goes by a
// bulk copy an owner; this block's own columns go straight into its inbox. A warp reads and writes
// only its own inputs' weights and columns of h_{l−1}. The bf16 build updates W_l after the sends
// are issued: the other warps update while the sending warp waits on the copy engine.
__device__ void backward_layer(HElem* h_prev, float* wt, const float* dh, float* inbox, unsigned long long* bar,
                               float lr, int rows, unsigned rank) {
    constexpr int TPW = BACKWARD_TILES;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    float q_out[TPW][MT][2][4];  // Q's tiles, kept until h_{l−1} may be overwritten
#if BF16
    float grad[TPW][NT][4];  // W_l's update, every tile's before any is stored
    backward_products(h_prev, wt, dh, rows, q_out, grad);
#else
    backward_products(h_prev, wt, dh, lr, rows, q_out);
#endif
    __syncwarp();  // the warp's lanes have read its columns of h_{l−1} (Q[:, k] goes where h_{l−1}[:, k] was)
#pragma unroll
    for (int ii = 0; ii < TPW; ++ii) {
        const int i = warp + WARPS * ii;
        if (H_MTILES % WARPS != 0 && i >= H_MTILES) break;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int col = 16 * i + 8 * j + 2 * t, owner = col / S, u = col - owner * S;
            QElem* piece = (owner == (int)rank ? inbox_piece(inbox, rank) : h_prev + owner * BATCH * S) + u;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = 16 * mt + 8 * h + g;
                    if (r < rows) store_q2(piece + r * S, q_out[ii][mt][j][2 * h], q_out[ii][mt][j][2 * h + 1]);
                }
        }
    }
    fence_proxy_async();  // the staged pieces are the copies' sources
    __syncthreads();  // (and every lane's loads of W_l for Q are done)
    const int dest = send_dest();
    if (dest >= 0 && dest != (int)rank)
        send_bulk(remote(inbox_piece(inbox, rank), dest), h_prev + dest * BATCH * S, rows * S * sizeof(QElem), remote(bar, dest));
#if BF16
    const int in[2] = {2 * g, 2 * g + 1};
    update_hidden(wt, 0, grad, in, lr);
#endif
}

// dh_{l}[:, U_c] = Σ_o inbox[o] (in order) ⊙ [h_l[:, U_c] > 0], zero past the step's rows and S,
// by threads `first` .. THREADS − 1, a quad of units a thread (one round of the block at H = 256,
// where a unit a thread took three). (The sums here and in forward_finish as trees of adds, not
// chains, measured 3 to 5% slower at H = 128.)
__device__ void gather_input_grad(float* inbox, const float* h_own, float* dh, int rows, int first) {
    constexpr int DQ = DST / 4;  // quads a row of dh
    for (int i = threadIdx.x - first; i < ROWS16 * DQ; i += THREADS - first) {
        const int r = i / DQ, u = 4 * (i - r * DQ);
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < rows && u < S) {  // (S is whole quads)
            v = load_q4(inbox_piece(inbox, 0) + r * S + u);
#pragma unroll
            for (int o = 1; o < CLUSTER; ++o) v = add4(v, load_q4(inbox_piece(inbox, o) + r * S + u));
            const float4 h = *reinterpret_cast<const float4*>(h_own + r * S + u);
            v = make_float4(h.x > 0.0f ? v.x : 0.0f, h.y > 0.0f ? v.y : 0.0f, h.z > 0.0f ? v.z : 0.0f, h.w > 0.0f ? v.w : 0.0f);
        }
        *reinterpret_cast<float4*>(dh + r * DST + u) = v;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
mlp_epoch(const Pixel* images, const int* labels, const int* order, const unsigned long long* params, int bias,
          int num_samples, int num_steps, float lr, double* metrics, int measure) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Smem s = carve(smem_raw);
    const unsigned rank = cluster_rank();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int u0 = rank * S;  // this block's first unit
    // params: the weights of hidden layers 1..LAYERS and of the head, then their biases (row-major
    // fan_out × fan_in, as the stage keeps them).
    float* const* w_global = reinterpret_cast<float* const*>(params);
    float* const* b_global = reinterpret_cast<float* const*>(params + LAYERS + 1);

    // ---- parameters into shared memory -------------------------------------------------------
#if BF16
    W1Regs w1;  // W_1[U_c, :], the warp's tiles of it
    w1.load(w_global[0], u0);
#endif
    for (int l = 1; l <= LAYERS; ++l) {
        const int fan_in = l == 1 ? FEATURES : HIDDEN, stride = l == 1 ? FEATURE_STRIDE : HIDDEN;
        float* wt = layer_weights(s, l);
        const bool in_smem = l > 1 || !BF16;  // (the BF16 build's W_1 is in registers)
        for (int i = tid; in_smem && i < stride * WST; i += THREADS) {
            const int k = i / WST, u = i - k * WST;
            wt[weight_at(l, k, u)] = k < fan_in && u < S ? w_global[l - 1][(long long)(u0 + u) * fan_in + k] : 0.0f;
        }
        if (tid < S) s.b[(l - 1) * S + tid] = bias ? b_global[l - 1][u0 + tid] : 0.0f;
    }
    for (int i = tid; i < CS * S; i += THREADS) {
        const int j = i / S, u = i - j * S;
        s.wh[i] = j < CLASSES ? w_global[LAYERS][j * HIDDEN + u0 + u] : 0.0f;
    }
    if (tid < CS) s.bh[tid] = bias && tid < CLASSES ? b_global[LAYERS][tid] : 0.0f;
    for (int step = 0; step < 2 && step < num_steps; ++step)
        for (int r = tid; r < step_rows(step, BATCH, num_samples); r += THREADS)
            s.order[step * BATCH + r] = order[(long long)step * BATCH + r];
    if (tid == 0) {
        for (int i = 0; i < NBARS; ++i) mbarrier_init(s.bars + i, 1);
        mbarrier_init_fence();
    }
    __syncthreads();
    if (num_steps > 0)
        for (int r = tid; r < step_rows(0, BATCH, num_samples); r += THREADS) {
            copy4_async(s.labels + r, labels + s.order[r]);
            if (r % CLUSTER == rank) prefetch_l2(images + (long long)s.order[r] * FEATURE_STRIDE, FEATURE_STRIDE * sizeof(Pixel));
        }
    if (X_STRIDE)  // the images of the steps before the first that a step copies in
        for (int step = 0; step < X_LEAD && step < num_steps; ++step)
            copy_images_in(s, images, s.order + step * BATCH, step, step_rows(step, BATCH, num_samples));
    async_commit();
    // No block may write into another's shared memory (nor count on its barriers) before every
    // block of the cluster runs and has set up its barriers.
    cluster_sync();
    double loss_sum = 0.0, correct_sum = 0.0;  // kept by the softmax's lanes of class 0, over the owned rows
    Probes probes(metrics);  // (a probe build's table, where the metrics would go)
#ifdef PROBES
    probes.start(s.probe_counts, PROBE_PHASES * PROBE_LAYERS);
#endif

    for (int step = 0; step < num_steps; ++step) {
        const int rows = step_rows(step, BATCH, num_samples);
        const unsigned parity = step & 1;
        const int* step_order = s.order + (step % 3) * BATCH;
        const int* step_labels = s.labels + (step & 1) * BATCH;
        const int r_own = (rows + CLUSTER - 1) / CLUSTER, own_lo = min(rows, (int)rank * r_own);
        const int owned = min(rows, own_lo + r_own) - own_lo;  // this block's rows of the softmax
        const ImageRows x_rows{images, step_order};

        async_wait_all();
        PROBE_END(probes, START_WAIT, 0);
        // This step's labels, the next step's indices (and, copied a step ahead, this step's images)
        // have landed; the last step's reads are done (among them those of the image buffer that
        // is refilled next).
        __syncthreads();
        if (tid == 0) {  // what this step's exchanges (and the images' copy) will bring
            for (int l = 1; l < LAYERS; ++l) {
                mbarrier_expect(gather_bar(s, l), (CLUSTER - 1) * rows * S * sizeof(HElem));  // (this block writes its own)
                mbarrier_expect(inbox_bar(s, l), (CLUSTER - 1) * rows * S * sizeof(QElem));
            }
            mbarrier_expect(zin_bar(s), owned * CLUSTER * CLASSES * 4);  // (to itself alike)
            mbarrier_expect(dl_bar(s), (rows - owned) * CS * 4);
        }
        PROBE_END(probes, START_EXPECT, 0);
        if (X_STRIDE && X_LEAD == 0) copy_images_in(s, images, step_order, step, rows);  // float images: this step's
        async_commit();
        PROBE_END(probes, START_IMAGES, 0);
        // The copies for the steps ahead: the next step's labels (and images, copied a step ahead),
        // the indices of the one after, by every warp but the first. Issued where they cost the
        // step least (H100, H = 128 and 256): with the images staged, at the wait for the partial
        // logits, where warp 0 alone computes the owned rows' softmax (at the gather of h_1 the
        // step took 5% longer at H = 128); else (labels, indices and the images' L2 prefetch) at
        // the gather of h_1, where warp 0 issues the bulk copies (at the logits: 1% longer at H =
        // 256), or with one hidden layer at the logits. Issued at the step's start they held up
        // layer 1's products by ~3% of a step, at the wait for D_L they slowed the update of W_1
        // beside them. They land before the next step's start (async_wait_all): the buffers they
        // fill were last read the step before this one.
        const auto copy_ahead = [&]() {
            constexpr int FIRST = 32;  // warp 0: the bulk copies (send_dest), the softmax
            if (tid < FIRST) return;
            const int c = tid - FIRST, copiers = THREADS - FIRST;
            if (step + 1 < num_steps) {
                const int next_rows = step_rows(step + 1, BATCH, num_samples);
                const int* next_order = s.order + ((step + 1) % 3) * BATCH;
                for (int r = c; r < next_rows; r += copiers)
                    copy4_async(s.labels + ((step + 1) & 1) * BATCH + r, labels + next_order[r]);
                if (X_STRIDE && X_LEAD == 1)
                    copy_images_in(s, images, next_order, step + 1, next_rows, FIRST);
                if (X_LEAD == 0)  // (images copied a step ahead need no hint)
                    for (int r = c * CLUSTER + rank; r < next_rows; r += copiers * CLUSTER)
                        prefetch_l2(images + (long long)next_order[r] * FEATURE_STRIDE, FEATURE_STRIDE * sizeof(Pixel));
            }
            if (step + 2 < num_steps)
                for (int r = c; r < step_rows(step + 2, BATCH, num_samples); r += copiers)
                    copy4_async(s.order + ((step + 2) % 3) * BATCH + r, order + (long long)(step + 2) * BATCH + r);
            async_commit();
        };

        // ---- forward ---------------------------------------------------------------------------
        for (int l = 1; l <= LAYERS; ++l) {
            if (l == 1) {
                if (X_STRIDE) {
                    if (X_LEAD == 0) {  // the images, copied at this step's start, have landed
                        async_wait_all();
                        __syncthreads();
                    } else {
                        mbarrier_wait(x_bar(s), step & 1);
                    }
#if BF16
                    w1.load_images(StagedRows{staged_images(s, step % X_BUFFERS)}, rows);
                } else {
                    w1.load_images(x_rows, rows);
                }
                w1.forward(s.last);
#else
                    forward_first(StagedRows{staged_images(s, step % X_BUFFERS)}, s.w1, s.last, rows);
                } else {
                    forward_first(x_rows, s.w1, s.last, rows);
                }
#endif
            } else {
                forward_hidden(h_of(s, l - 1), layer_weights(s, l), s.last, rows);
            }
            __syncthreads();
            PROBE_END(probes, PRODUCTS, l);
            const bool gather = l < LAYERS;
            float* h_own = s.h_own + (l - 1) * BATCH * S;
            HElem* slice = h_of(s, l) + rank * BATCH * S;  // this block's in h_full[l]
            forward_finish(s.last, s.b + (l - 1) * S, l == 1 ? X_UNIT : 1.0f, h_own, gather ? slice : nullptr, rows);
            PROBE_END(probes, FINISH, l);
            if (gather) fence_proxy_async();  // the slice, written here, is the copies' source
            __syncthreads();  // h_own is whole; the partial sums are read before the next product writes them
            PROBE_END(probes, FENCE_SYNC, l);
            const int dest = send_dest();
            if (gather && dest >= 0 && dest != rank)  // this block's h_l[:, U_c] to block dest's h_full[l]
                send_bulk(remote(slice, dest), slice, rows * S * sizeof(HElem), remote(gather_bar(s, l), dest));
            PROBE_SYNC();
            PROBE_END(probes, SENDS, l);
            if (l == 1 && gather && !X_STRIDE) copy_ahead();
            if (gather) mbarrier_wait(gather_bar(s, l), parity);  // h_full[l] is whole
            PROBE_SYNC();
            PROBE_END(probes, EXCHANGE, l);
        }

        // ---- head: partial logits of this block's units, to each row's owner ---------------------
        // P_c = h_L[:, U_c] · W_h[:, U_c]ᵀ: a warp a tile of 16 rows × 8 classes, k over the units.
        // Row r's classes j, j + 1 go from the mma registers to its owner, block r / r_own, into
        // zin[c][r mod r_own] (one 8-byte st.async, counted on the owner's zin barrier).
        {
            const float* h_last = s.h_own + (LAYERS - 1) * BATCH * S;
            for (int task = warp; task < MT * CLASS_TILES; task += WARPS) {
                const int mt = task / CLASS_TILES, r0 = 16 * mt, j0 = 8 * (task - mt * CLASS_TILES);
                Sums3 d;
                tile_product<UNIT_KSTEPS>(d, [&](int m, int k) { return r0 + m < rows && k < S ? h_last[(r0 + m) * S + k] : 0.0f; },
                                          [&](int k, int n) { return k < S && j0 + n < CS ? s.wh[(j0 + n) * S + k] : 0.0f; });
#pragma unroll
                for (int half = 0; half < 2; ++half) {  // rows g and g + 8 of the tile
                    const int r = r0 + g_of(lane) + 8 * half, j = j0 + 2 * t_of(lane);
                    if (r >= rows || j >= CLASSES) continue;
                    const int owner = r / r_own;
                    const unsigned dst = remote(s.zin + (rank * R_OWN + r - owner * r_own) * CS + j, owner);
                    const unsigned bar = remote(zin_bar(s), owner);
                    if (j + 1 < CLASSES) send2(dst, total(d, 2 * half), total(d, 2 * half + 1), bar);
                    else send(dst, total(d, 2 * half), bar);
                }
            }
        }
        PROBE_SYNC();
        PROBE_END(probes, HEAD_PRODUCT, 0);
        if (LAYERS == 1 || X_STRIDE) copy_ahead();
        mbarrier_wait(zin_bar(s), parity);  // every block's partial logits of the owned rows
        PROBE_SYNC();
        PROBE_END(probes, HEAD_WAIT, 0);

        // ---- softmax of the owned rows, their dlogits to every block -------------------------------
        // ROW_LANES lanes a row (lane j its class j): z = Σ_c P_c + b_h, the partials added as a fixed
        // tree (four levels for 16 blocks, not a chain of 16 adds), its max and sum by shuffles, and
        // dz_j into this block's dl; then lane p sends the row to block p (st.async of 16 bytes,
        // counted on its dl barrier). Whole warps take part (a row past the owned ones sends nothing).
        {
            constexpr int ROW_LANES = CLASSES <= 16 ? 16 : 32, ROWS_PER_WARP = 32 / ROW_LANES;
            const int j = lane % ROW_LANES, group = lane & ~(ROW_LANES - 1);
            for (int base = warp * ROWS_PER_WARP; base < owned; base += WARPS * ROWS_PER_WARP) {
                const int rr = base + lane / ROW_LANES, r = own_lo + rr;
                const bool row_owned = rr < owned, valid = row_owned && j < CLASSES;
                const int label = row_owned ? step_labels[r] : 0;
                float p[CLUSTER];
#pragma unroll
                for (int c = 0; c < CLUSTER; ++c) p[c] = valid ? s.zin[(c * R_OWN + rr) * CS + j] : 0.0f;
#pragma unroll
                for (int w = 1; w < CLUSTER; w *= 2)
#pragma unroll
                    for (int c = 0; c + w < CLUSTER; c += 2 * w) p[c] += p[c + w];
                const float z = valid ? p[0] + s.bh[j] : -__int_as_float(0x7f800000);  // −∞ past the classes
                float m, sum;
                const float dz = warp_softmax_grad<ROW_LANES>(z, valid, j, label, rows, m, sum);
                PROBE_END(probes, SOFTMAX_EXP, 0);
                if (row_owned && j < CS) s.dl[r * CS + j] = dz;
                __syncwarp();  // the row is whole in dl
                if (row_owned && j < CLUSTER && j != (int)rank) {  // to block j
                    const float4* row = reinterpret_cast<const float4*>(s.dl + r * CS);
#pragma unroll
                    for (int q = 0; q < QUADS; ++q) send4(remote(s.dl + r * CS + 4 * q, j), row[q], remote(dl_bar(s), j));
                }
                if (measure) {
                    const float z_label = __shfl_sync(0xffffffffu, z, group + label);
                    // The first index of the largest logit: the lowest of the row's lanes holding m.
                    const unsigned at_max = __ballot_sync(0xffffffffu, j < CLASSES && z == m) >> group;
                    if (row_owned && j == 0) {
                        loss_sum += (double)(logf(sum) + m - z_label);
                        correct_sum += (__ffs(at_max) - 1) == label ? 1.0 : 0.0;
                    }
                }
                PROBE_END(probes, SOFTMAX_ROWS, 0);
            }
        }
        PROBE_SYNC();
        PROBE_END(probes, SOFTMAX, 0);
        mbarrier_wait(dl_bar(s), parity);  // every owner's rows of dlogits
        __syncthreads();  // (and this block's own)
        PROBE_END(probes, SOFTMAX_WAIT, 0);
        // dh_L[:, U_c] = dz · W_h[:, U_c] ⊙ [h_L > 0] (W_h before its update; zero past the rows and
        // S) and the head's gradient dW_h[:, U_c] = dzᵀ h_L[:, U_c], a warp a tile of either; the
        // bias's Σ_r dz by the last warp.
        {
            const float* h_last = s.h_own + (LAYERS - 1) * BATCH * S;
            constexpr int DH_TILES = MT * NT, GW_TILES = (CLASSES + 15) / 16 * NT;
            for (int task = warp; task < DH_TILES + GW_TILES; task += WARPS) {
                Sums3 d;
                if (task < DH_TILES) {  // m = rows, k = classes, n = units
                    const int mt = task / NT, r0 = 16 * mt, u0 = 8 * (task - mt * NT);
                    tile_product<CLASS_KSTEPS>(d, [&](int m, int k) { return r0 + m < rows && k < CLASSES ? s.dl[(r0 + m) * CS + k] : 0.0f; },
                                               [&](int k, int n) { return k < CLASSES && u0 + n < S ? s.wh[k * S + u0 + n] : 0.0f; });
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int r = r0 + g_of(lane) + (i < 2 ? 0 : 8), u = u0 + 2 * t_of(lane) + (i & 1);
                        dh_of(s, LAYERS)[r * DST + u] = r < rows && u < S && h_last[r * S + u] > 0.0f ? total(d, i) : 0.0f;
                    }
                } else {  // m = classes, k = rows, n = units
                    const int tile = task - DH_TILES, mc = tile / NT, j0 = 16 * mc, u0 = 8 * (tile - mc * NT);
                    tile_product<KB>(d, [&](int m, int k) { return k < rows && j0 + m < CLASSES ? s.dl[k * CS + j0 + m] : 0.0f; },
                                     [&](int k, int n) { return k < rows && u0 + n < S ? h_last[k * S + u0 + n] : 0.0f; });
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int jj = j0 + g_of(lane) + (i < 2 ? 0 : 8), u = u0 + 2 * t_of(lane) + (i & 1);
                        if (jj < CLASSES && u < S) s.gwh[jj * S + u] = total(d, i);
                    }
                }
            }
            if (bias && warp == WARPS - 1 && lane < CLASSES)
                s.gwh[CS * S + lane] = sum_rows(rows, [&](int r) { return s.dl[r * CS + lane]; });
            PROBE_END(probes, HEAD_TILES, 0);
            __syncthreads();
            PROBE_END(probes, HEAD_TILES_SYNC, 0);
            for (int i = tid; i < CLASSES * S; i += THREADS) s.wh[i] = fmaf(-lr, s.gwh[i], s.wh[i]);
            if (bias && tid < CLASSES) s.bh[tid] = fmaf(-lr, s.gwh[CS * S + tid], s.bh[tid]);
        }
        PROBE_SYNC();
        PROBE_END(probes, HEAD_GRADIENT, 0);

        // ---- backward ---------------------------------------------------------------------------
        for (int l = LAYERS; l >= 2; --l) {
            float* inbox = inbox_of(s, l - 1);
            backward_layer(h_of(s, l - 1), layer_weights(s, l), dh_of(s, l), inbox,
                           inbox_bar(s, l - 1), lr, rows, rank);
            if (bias) update_bias(s.b + (l - 1) * S, dh_of(s, l), lr, rows);
            PROBE_END(probes, BACKWARD_PRODUCTS, l);
            // Warp 0 issues D_l's bulk copies and then updates its tiles of W_l; the others do not
            // wait for it (a block barrier here cost 1.5 to 2.5% of a step at H = 128, H100): they wait for
            // the inbox and sum dh_{l−1} into the other buffer of dh.
            if (warp > 0) {
                mbarrier_wait(inbox_bar(s, l - 1), parity);  // dh_{l−1}'s inbox is full
                gather_input_grad(inbox, s.h_own + (l - 2) * BATCH * S, dh_of(s, l - 1), rows, 32);
            }
            __syncthreads();
            PROBE_END(probes, GATHER_GRADIENT, l - 1);
        }
#if BF16
        w1.update(dh_of(s, 1), lr * X_UNIT);
#else
        if (X_STRIDE) update_first_layer(StagedRows{staged_images(s, step % X_BUFFERS)}, s.w1, dh_of(s, 1), lr * X_UNIT, rows);
        else update_first_layer(x_rows, s.w1, dh_of(s, 1), lr * X_UNIT, rows);
#endif
        if (bias) update_bias(s.b, dh_of(s, 1), lr, rows);
        PROBE_SYNC();
        PROBE_END(probes, UPDATE, 1);
        // The next step's first __syncthreads orders these updates before its forward reads them.
    }

#ifdef PROBES
    probes.finish(PROBE_PHASES * PROBE_LAYERS);
#endif
    // ---- parameters back to global memory; the metrics of block 0 ------------------------------
    __syncthreads();
#if BF16
    w1.store(w_global[0], u0);
#endif
    for (int l = 1; l <= LAYERS; ++l) {
        const int fan_in = l == 1 ? FEATURES : HIDDEN;
        const float* wt = layer_weights(s, l);
        const bool in_smem = l > 1 || !BF16;
        for (int i = tid; in_smem && i < fan_in * S; i += THREADS) {
            const int u = i / fan_in, k = i - u * fan_in;
            w_global[l - 1][(long long)(u0 + u) * fan_in + k] = wt[weight_at(l, k, u)];
        }
        if (bias && tid < S) b_global[l - 1][u0 + tid] = s.b[(l - 1) * S + tid];
    }
    for (int i = tid; i < CLASSES * S; i += THREADS) {
        const int j = i / S, u = i - j * S;
        w_global[LAYERS][j * HIDDEN + u0 + u] = s.wh[i];
    }
    if (bias && rank == 0 && tid < CLASSES) b_global[LAYERS][tid] = s.bh[tid];
    if (measure) cluster_metrics(s.totals, WARPS, loss_sum, correct_sum, metrics);  // each block's owned rows
    cluster_sync();  // no block leaves while another may still write to its shared memory
}
