// The compile-time sizes of persistent_mlp.cu, its element types, its shared memory and the helpers
// its phases share. Not a kernel file: kernels/persistent_mlp.py lists it in `headers`, after the
// common ones (cluster.cuh, smem_layout.cuh, probes.cuh, tf32_mma.cuh, bf16_mma.cuh, logits_loss.cuh)
// and before persistent_mlp_products.cuh. The sizes come from the launcher as -D values (see
// persistent_mlp.cu's header).

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
// (Bf16Ops::FirstLayer), so one buffer serves; the TF32 build reads them again for W_1's update: two buffers.
#define X_LEAD (X_STRIDE && sizeof(Pixel) < 4 ? 1 : 0)
#define X_BUFFERS (BF16 ? 1 : X_LEAD + 1)
#define W1_TILES_PER_WARP ((F_MTILES + WARPS - 1) / WARPS)  // a warp's input tiles of 16 of layer 1

#if (X_STRIDE != 0 && (BF16 ? X_STRIDE * 2 % 32 : X_STRIDE * (PIXEL_LEVELS ? 1 : 4) % 128) != PIXEL_ROW_ALIGN) || S % 4 != 0 || FEATURE_STRIDE % 16 != 0 || HIDDEN % 16 != 0 || CLASSES > 32 || LAYERS < 1 || THREADS % 32 != 0 || THREADS < 64
#error "persistent_mlp.cu: unsupported HIDDEN / FEATURE_STRIDE / CLASSES / LAYERS / THREADS"
#endif


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

// The element type of h_full and of D_l's pieces, and how they are read and written: bf16 in the BF16
// build, where h_l (l < LAYERS) is only ever a product's operand (so rounded to bf16 anyway; the
// ReLU masks come from h_own) and a gather then moves half the bytes (the exchanges move 7 to 14
// bytes a cycle an SM: at H = 256 a gather of floats took ~2,000 cycles); else floats. D_l's pieces
// (this block's partial sums Q_c[:, U_o] for block o) travel as the same type, staged where h_{l−1}
// lies (backward_layer); the receiver sums the CLUSTER pieces in fp32, so in the BF16 build each of
// the 16 partial sums of dh_{l−1} is rounded to bf16 before the sum (as a bf16 reduce-scatter of
// gradients rounds its pieces), and dh_{l−1} again as the next products' operand. (Half the bytes:
// at H = 256 the step took 8% less, H100, and the test accuracy stayed the same.)
template <bool IS_BF16> struct Exchanged {
    typedef float Elem;
    __device__ static __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
    __device__ static __forceinline__ void store2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
    __device__ static __forceinline__ void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
};
template <> struct Exchanged<true> {
    typedef unsigned short Elem;  // bf16 bits
    __device__ static __forceinline__ float4 load4(const unsigned short* p) {  // four bf16 as floats (exact)
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                           __uint_as_float(v.y & 0xffff0000u));
    }
    __device__ static __forceinline__ void store2(unsigned short* p, float a, float b) { *reinterpret_cast<unsigned*>(p) = bf16x2(a, b); }
    __device__ static __forceinline__ void store4(unsigned short* p, float4 v) {
        *reinterpret_cast<uint2*>(p) = make_uint2(bf16x2(v.x, v.y), bf16x2(v.z, v.w));
    }
};
typedef Exchanged<BF16 != 0> Exchange;
typedef Exchange::Elem HElem;  // h_full's
typedef HElem QElem;           // D_l's pieces'

// The dynamic shared memory, carved from its layout table (kernels/persistent_mlp.py:
// MlpShape.layout_with, which gives the launcher its byte count too).
#define INBOX_FLOATS (CLUSTER * BATCH * S * (int)sizeof(QElem) / 4)  // an inbox (inbox_of)
struct Smem {
    unsigned long long* bars;  // [NBARS]  G_1..G_{L−1}; Z; Y; D_2..D_L; the images' copies
    double* totals;   // [2 + 2·WARPS]        block totals of loss and correct, then per warp
    float* w1;        // [FEATURE_STRIDE][WST]  W_1[U_c, :] in quads of inputs (w1_at), zero past S;
                      //   none in the BF16 build, whose W_1 lives in registers (Bf16Ops::FirstLayer)
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
    SMEM_REGION(s, base, bars, SMEM_BARS);
    SMEM_REGION(s, base, totals, SMEM_TOTALS);
    SMEM_REGION(s, base, w1, SMEM_W1);
    SMEM_REGION(s, base, w, SMEM_W);
    SMEM_REGION(s, base, wh, SMEM_WH);
    SMEM_REGION(s, base, b, SMEM_B);
    SMEM_REGION(s, base, bh, SMEM_BH);
    SMEM_REGION(s, base, h_full, SMEM_H_FULL);
    SMEM_REGION(s, base, zin, SMEM_ZIN);
    SMEM_REGION(s, base, inbox_mid, SMEM_INBOX_MID);
    SMEM_REGION(s, base, last, SMEM_LAST);
    SMEM_REGION(s, base, h_own, SMEM_H_OWN);
    SMEM_REGION(s, base, dh, SMEM_DH);
    SMEM_REGION(s, base, dl, SMEM_DL);
    SMEM_REGION(s, base, gwh, SMEM_GWH);
    SMEM_REGION(s, base, x, SMEM_X);
    SMEM_REGION(s, base, order, SMEM_ORDER);
    SMEM_REGION(s, base, labels, SMEM_LABELS);
#ifdef PROBES
    SMEM_REGION(s, base, probe_counts, SMEM_PROBE_COUNTS);
#endif
    check_shared_bytes(SMEM_BYTES);
    return s;
}

__device__ __forceinline__ float* layer_weights(const Smem& s, int l) {  // wt of hidden layer l (1-based)
    return l == 1 ? s.w1 : s.w + (l - 2) * HIDDEN * WST;
}
// dh_l's inbox, 1 ≤ l ≤ LAYERS − 1 (which buffers share memory: docs/persistent-mlp.md), and its barrier.
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
