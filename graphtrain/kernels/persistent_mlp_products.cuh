// The products of persistent_mlp.cu, in the build's precision: the helpers they share, the Ops
// types (Tf32Ops, Bf16Ops) and the products written once over them, and layer 1's. Not a kernel file:
// kernels/persistent_mlp.py lists it in `headers`, after persistent_mlp_shape.cuh.

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

// f(i, n, p) for each of N tiles of a warp (while has(i)), each unit tile n and pair p = 0, 1.
template <int N, class Has, class F>
__device__ __forceinline__ void each_pair(Has has, F f) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        if (!has(i)) break;  // (the same for the whole warp)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int p = 0; p < 2; ++p) f(i, n, p);
    }
}
// W −= lr · grad for N tiles of a warp's update (tile i where has(i)), grad[i][n] an mma D fragment:
// the lane's pair p of floats of tile i, unit tile n, lies at w + at(i, n, p) and takes the
// fragment's values A·p and A·p + B. Every load goes before any store: a store through these
// pointers holds back each load after it.
template <int N, int A, int B, class Has, class At>
__device__ __forceinline__ void update_tiles(float* w, const float (&grad)[N][NT][4], float lr, Has has, At at) {
    float2 old[N][NT][2];
    each_pair<N>(has, [&](int i, int n, int p) { old[i][n][p] = *reinterpret_cast<const float2*>(w + at(i, n, p)); });
    each_pair<N>(has, [&](int i, int n, int p) {
        *reinterpret_cast<float2*>(w + at(i, n, p)) =
            make_float2(fmaf(-lr, grad[i][n][A * p], old[i][n][p].x), fmaf(-lr, grad[i][n][A * p + B], old[i][n][p].y));
    });
}

// W_1[U_c, 16mt..16mt+15] −= lr · grad[i] for N of warp w's tiles of the update, mt = w + WARPS·(i0 +
// i) (m = inputs, n = units, as an mma's D fragment: its rows g and g + 8 are the inputs 2g and 2g +
// 1, so unit 8n + 2t + e of both is one float2 of W_1's quads). The TF32 build (the bf16 one keeps
// W_1 in registers: Bf16Ops::FirstLayer) updates one tile at a time, short of registers (all at
// once took 1 to 2% more, H100).
template <int N>
__device__ __forceinline__ void update_w1(float* w1, int i0, const float (&grad)[N][NT][4], float lr) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    update_tiles<N, 1, 2>(w1, grad, lr, [&](int i) { return warp_has_tile<F_MTILES>(i0 + i); },
                          [&](int i, int n, int e) { return w1_at(16 * (warp + WARPS * (i0 + i)) + 2 * g, 8 * n + 2 * t + e); });
}

// W_l[U_c, :] −= lr · grad[ii] for N of warp w's input tiles of the backward (l ≥ 2), k0 = 16i, i =
// w + WARPS·(i0 + ii): grad[ii][n] an mma D fragment whose rows g and g + 8 are the inputs k0 +
// in[0] and k0 + in[1] and whose columns 2t, 2t + 1 are the units 8n + 2t, 8n + 2t + 1 (one float2
// of wt). The bf16 build updates all its tiles at once, the TF32 build one at a time.
template <int N>
__device__ __forceinline__ void update_hidden(float* wt, int i0, const float (&grad)[N][NT][4], const int (&in)[2],
                                              float lr) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = lane & 3;
    update_tiles<N, 2, 1>(wt, grad, lr, [&](int ii) { return H_MTILES % WARPS == 0 || warp + WARPS * (i0 + ii) < H_MTILES; },
                          [&](int ii, int n, int h) { return wt_at(16 * (warp + WARPS * (i0 + ii)) + in[h], 8 * n + 2 * t); });
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

// ==== The products of the hidden layers, in the build's precision ===============================
// Tf32Ops: TF32 operands (m16n8k8) in three passes (v = hi + lo, hi its top 19 bits; a·b ≈
// hi_a·hi_b + (hi_a·lo_b + lo_a·hi_b)), each operand split as it is loaded. Bf16Ops: bf16 operands
// (m16n8k16) in one pass, each operand rounded to bf16 as it is loaded (cvt.rn.bf16x2: one
// instruction a pair); the images come as bf16 already (8-bit pixels as k, exact). Both sum in
// fp32. The products of layers ≥ 2 (forward_hidden, backward_products) are written once, over an
// Ops type that says how a lane loads its fragments and multiplies them; layer 1's differ in
// where W_1 lives (Tf32Ops::FirstLayer: shared memory; Bf16Ops::FirstLayer: registers).
//
// A fragment's k-slots may take the k range in any order that is the same for both operands (a
// permutation of k leaves a product as it is): in the bf16 products of layers ≥ 2 a lane's k-slots
// 2t, 2t + 1, 2t + 8, 2t + 9 (mma_bf16) take four consecutive inputs 4t..4t + 3 where k runs over
// inputs or units (one 8- or 16-byte load), and the rows t, t + 4, t + 8, t + 12 where k runs over
// the batch (an update).

// TF32 operands split once and used in several products (v = hi + lo).
template <int N> struct Split { unsigned hi[N], lo[N]; };

// The rows of an update's A operand a lane reads in each of KSTEPS k-steps of STEP rows: r·S for rows
// STEP·ks + 4j + t (j < PER), the last row where they run past the step's.
template <int KSTEPS, int PER, int STEP>
struct UpdateRows {
    int row[KSTEPS][PER];
    __device__ __forceinline__ explicit UpdateRows(int rows) {
        const int t = threadIdx.x & 3;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
            for (int j = 0; j < PER; ++j) row[ks][j] = min(STEP * ks + 4 * j + t, rows - 1) * S;
    }
};

// An update's B operand, dh (k = rows, n = units), for each of KSTEPS k-steps of STEP rows: load(b,
// d) fills a fragment from d = dh at the lane's first row of the k-step (STEP·ks + t) and unit (8n + g).
template <int KSTEPS, int STEP, class Fragment>
struct DhFragments {
    Fragment b[KSTEPS][NT];
    template <class Load>
    __device__ __forceinline__ DhFragments(const float* dh, Load load) {
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
            for (int n = 0; n < NT; ++n) load(b[ks][n], dh + (STEP * ks + t) * DST + 8 * n + g);
    }
};

struct Tf32Ops {
    typedef Sums3 Sums;
    typedef float A[4];  // an A fragment as loaded (split by mma)
    typedef float B[2];
    static constexpr int K = 8;                       // an mma's k
    static constexpr int Q_KSTEPS = NT;               // a block's units in k-steps (Q)
    static constexpr int ROW_KSTEPS = KB;             // the batch in k-steps (an update)
    static constexpr bool UPDATE_AFTER_SENDS = false;  // W_l's update tile by tile, short of registers
    typedef Split<4> RowsA;  // the update's A fragment, split once for every unit tile
    __device__ static __forceinline__ void mma(Sums3& d, const float (&a)[4], const float (&b)[2]) { mma_split(d, a, b); }
    __device__ static __forceinline__ void mma(Sums3& d, const Split<4>& a, const Split<2>& b) {
        mma_3xtf32(d, a.hi, a.lo, b.hi, b.lo);
    }
    // forward_hidden: W_l's B fragment at inputs k + t, k + t + 4 of unit u; h's A fragment of
    // the rows row[0], row[1] at the same inputs (zero where !valid).
    __device__ static __forceinline__ void hidden_b(float (&b)[2], const float* wt, int k, int u) {
        const int t = threadIdx.x & 3;
        b[0] = wt[wt_at(k + t, u)];
        b[1] = wt[wt_at(k + t + 4, u)];
    }
    __device__ static __forceinline__ void hidden_a(float (&a)[4], const float* h, const int (&row)[2], int k, bool valid) {
        const int t = threadIdx.x & 3, c0 = hcol(k + t), c1 = hcol(k + t + 4);
        a[0] = h[row[0] + c0]; a[1] = h[row[1] + c0]; a[2] = h[row[0] + c1]; a[3] = h[row[1] + c1];
        if (!valid) a[0] = a[1] = a[2] = a[3] = 0.0f;
    }
    // An update's B operand, split: dh (k = rows, n = units) for every k-step of 8 rows, lane (g, t)
    // holding rows t, t + 4 of unit g.
    struct DhOperand : DhFragments<KB, 8, Split<2>> {
        __device__ __forceinline__ explicit DhOperand(const float* dh)
            : DhFragments(dh, [](Split<2>& b, const float* d) {
                  const float v[2] = {d[0], d[4 * DST]};
                  split_tf32(v, b.hi, b.lo);
              }) {}
    };
    // backward_products, Q = dh_l · W_l[U_c, k0..]: W_l's B fragments (inputs k0 + 8j + g, units
    // 8kk + t, + 4) and dh's A fragment (rows 16mt + g, + 8; units 8kk + t, + 4).
    __device__ static __forceinline__ void q_weights(float (&b)[2][2], const float* wt, int k0, int kk) {
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            b[j][0] = wt[wt_at(k0 + 8 * j + g, 8 * kk + t)];
            b[j][1] = wt[wt_at(k0 + 8 * j + g, 8 * kk + t + 4)];
        }
    }
    __device__ static __forceinline__ void q_gradients(float (&a)[4], const float* dh, int mt, int kk) {
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        const float* d0 = dh + (16 * mt + g) * DST + 8 * kk + t;
        a[0] = d0[0]; a[1] = d0[8 * DST]; a[2] = d0[4]; a[3] = d0[8 * DST + 4];
    }
    // The update of W_l[U_c, k0..] (m = inputs k0 + g, k0 + g + 8; k = rows; n = units): h_{l−1}'s
    // rows 8ks + t, + 4 (the last row past the step's) at those inputs, split once for every n.
    typedef UpdateRows<KB, 2, 8> PrevRows;
    __device__ static __forceinline__ void prev_rows(Split<4>& a, const float* h_prev, const PrevRows& r, int ks, int k0) {
        const int g = (threadIdx.x & 31) >> 2, c_lo = hcol(k0 + g), c_hi = hcol(k0 + g + 8);
        const float v[4] = {h_prev[r.row[ks][0] + c_lo], h_prev[r.row[ks][0] + c_hi], h_prev[r.row[ks][1] + c_lo],
                            h_prev[r.row[ks][1] + c_hi]};
        split_tf32(v, a.hi, a.lo);
    }
    __device__ static __forceinline__ void update_inputs(int (&in)[2]) { in[0] = (threadIdx.x & 31) >> 2; in[1] = in[0] + 8; }
    struct FirstLayer;
};

struct Bf16Ops {
    typedef Sums1 Sums;
    typedef unsigned A[4];
    typedef unsigned B[2];
    static constexpr int K = 16;
    static constexpr int Q_KSTEPS = (S + 15) / 16;
    static constexpr int ROW_KSTEPS = MT;
    static constexpr bool UPDATE_AFTER_SENDS = true;  // every tile's gradient kept; W_l updated while the copies go
    typedef unsigned RowsA[4];
    __device__ static __forceinline__ void mma(Sums1& d, const unsigned (&a)[4], const unsigned (&b)[2]) { mma_bf16(d.d, a, b); }
    // forward_hidden: inputs k + 4t .. k + 4t + 3 (one 8-byte load of h_full: they lie in one
    // block's slot), the k-slots 2t, 2t + 1, 2t + 8, 2t + 9.
    __device__ static __forceinline__ void hidden_b(unsigned (&b)[2], const float* wt, int k, int u) {
        k += 4 * (threadIdx.x & 3);
        b[0] = bf16x2(wt[wt_at(k, u)], wt[wt_at(k + 1, u)]);
        b[1] = bf16x2(wt[wt_at(k + 2, u)], wt[wt_at(k + 3, u)]);
    }
    __device__ static __forceinline__ void hidden_a(unsigned (&a)[4], const unsigned short* h, const int (&row)[2], int k,
                                                    bool valid) {
        const int c = hcol(k + 4 * (threadIdx.x & 3));
        const uint2 v0 = *reinterpret_cast<const uint2*>(h + row[0] + c);
        const uint2 v1 = *reinterpret_cast<const uint2*>(h + row[1] + c);
        a[0] = v0.x; a[1] = v1.x; a[2] = v0.y; a[3] = v1.y;
        if (!valid) a[0] = a[1] = a[2] = a[3] = 0u;
    }
    // An update's B operand: dh (k = rows, n = units) for every k-step of 16 rows, lane (g, t)
    // holding rows t, t + 4 and t + 8, t + 12 of unit g.
    struct DhOperand : DhFragments<MT, 16, unsigned[2]> {
        __device__ __forceinline__ explicit DhOperand(const float* dh)
            : DhFragments(dh, [](unsigned (&b)[2], const float* d) {
                  b[0] = bf16x2(d[0], d[4 * DST]);
                  b[1] = bf16x2(d[8 * DST], d[12 * DST]);
              }) {}
    };
    // Q: units u = 16kk + 4t .. + 3 (zero past S; S is whole quads) of W_l's inputs k0 + 8j + g,
    // and of dh's rows 16mt + g, + 8.
    __device__ static __forceinline__ void q_weights(unsigned (&b)[2][2], const float* wt, int k0, int kk) {
        const int g = (threadIdx.x & 31) >> 2, u = 16 * kk + 4 * (threadIdx.x & 3);
        const bool valid = S % 16 == 0 || u < S;
        const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const float4 w = valid ? *reinterpret_cast<const float4*>(wt + wt_at(k0 + 8 * j + g, u)) : zero;
            b[j][0] = bf16x2(w.x, w.y);
            b[j][1] = bf16x2(w.z, w.w);
        }
    }
    __device__ static __forceinline__ void q_gradients(unsigned (&a)[4], const float* dh, int mt, int kk) {
        const int g = (threadIdx.x & 31) >> 2, u = 16 * kk + 4 * (threadIdx.x & 3);
        const bool valid = S % 16 == 0 || u < S;
        const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const float* d = dh + (16 * mt + g) * DST + u;
        const float4 d0 = valid ? *reinterpret_cast<const float4*>(d) : zero;
        const float4 d1 = valid ? *reinterpret_cast<const float4*>(d + 8 * DST) : zero;
        a[0] = bf16x2(d0.x, d0.y); a[1] = bf16x2(d1.x, d1.y); a[2] = bf16x2(d0.z, d0.w); a[3] = bf16x2(d1.z, d1.w);
    }
    // The update: m = inputs k0 + 2g, + 1 (a bf16 pair of h_full), k = rows 16ks + t + 4j.
    typedef UpdateRows<MT, 4, 16> PrevRows;
    __device__ static __forceinline__ void prev_rows(unsigned (&a)[4], const unsigned short* h_prev, const PrevRows& r,
                                                     int ks, int k0) {
        const int c = hcol(k0 + 2 * ((threadIdx.x & 31) >> 2));
        unsigned v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = *reinterpret_cast<const unsigned*>(h_prev + r.row[ks][j] + c);
        a[0] = low_halves(v[0], v[1]); a[1] = high_halves(v[0], v[1]); a[2] = low_halves(v[2], v[3]); a[3] = high_halves(v[2], v[3]);
    }
    __device__ static __forceinline__ void update_inputs(int (&in)[2]) { in[0] = 2 * ((threadIdx.x & 31) >> 2); in[1] = in[0] + 1; }
    struct FirstLayer;
};

// ---- forward of layer l ≥ 2: partial[w] = h_{l−1} · W_l[U_c, :]ᵀ over warp w's k-steps ---------
// Warp w takes the k-steps w, w + WARPS, ... of the HIDDEN inputs for every row tile and unit tile;
// past them its A operand is zero (no branch around the mma). Rows past the step's are the last
// row again (finite; their sums are never read). h: h_full[l − 1], block-major.
template <class Ops>
__device__ __forceinline__ void forward_hidden(const HElem* h, const float* wt, float* partial, int rows) {
    constexpr int K_STEPS = HIDDEN / Ops::K, KPW = (K_STEPS + WARPS - 1) / WARPS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
    int row[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) row[mt][hh] = min(16 * mt + 8 * hh + g, rows - 1) * S;
    typename Ops::Sums sums[MT][NT];
#pragma unroll
    for (int i = 0; i < KPW; ++i) {
        const int ks = warp + WARPS * i;
        const bool valid = K_STEPS % WARPS == 0 || ks < K_STEPS;
        const int k = valid ? Ops::K * ks : 0;
        typename Ops::B b[NT];
#pragma unroll
        for (int n = 0; n < NT; ++n) Ops::hidden_b(b[n], wt, k, 8 * n + g);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            typename Ops::A a;
            Ops::hidden_a(a, h, row[mt], k, valid);
#pragma unroll
            for (int n = 0; n < NT; ++n) Ops::mma(sums[mt][n], a, b[n]);
        }
    }
    store_partial(sums, partial);
}

// ---- backward of layer l ≥ 2 ------------------------------------------------------------------
// The products for warp w's input tiles k0 = 16i (i = w, w + WARPS, ...; backward_layer):
//   Q[:, k0..] = dh_l · W_l[U_c, k0..] (old weights; m = rows, k = units, n = inputs) into q_out,
//   and W_l[U_c, k0..]'s gradient (h_{l−1}[:, k0..]ᵀ dh_l)ᵀ (m = inputs, k = rows, n = units) into
//   grad, each tile's rows g and g + 8 the inputs Ops::update_inputs gives; the TF32 build updates
//   W_l here, tile by tile (its lanes' loads of the weights for Q done first), the bf16 build once
//   Q is on its way (backward_layer).
template <class Ops>
__device__ __forceinline__ void backward_products(const HElem* h_prev, float* wt, const float* dh, float lr, int rows,
                                                  float (&q_out)[BACKWARD_TILES][MT][2][4],
                                                  float (&grad)[BACKWARD_TILES][NT][4]) {
    const int warp = threadIdx.x >> 5;
    const typename Ops::DhOperand bu(dh);  // the update's B operand, the same for every input tile
    const typename Ops::PrevRows h_rows(rows);
    int in[2];
    Ops::update_inputs(in);
#pragma unroll
    for (int ii = 0; ii < BACKWARD_TILES; ++ii) {
        const int i = warp + WARPS * ii;
        if (H_MTILES % WARPS != 0 && i >= H_MTILES) break;  // the same for the whole warp
        const int k0 = 16 * i;
        typename Ops::Sums q[MT][2];
#pragma unroll
        for (int kk = 0; kk < Ops::Q_KSTEPS; ++kk) {
            typename Ops::B b[2];
            Ops::q_weights(b, wt, k0, kk);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                typename Ops::A a;
                Ops::q_gradients(a, dh, mt, kk);
#pragma unroll
                for (int j = 0; j < 2; ++j) Ops::mma(q[mt][j], a, b[j]);
            }
        }
        typename Ops::Sums du[NT];
#pragma unroll
        for (int ks = 0; ks < Ops::ROW_KSTEPS; ++ks) {
            typename Ops::RowsA a;
            Ops::prev_rows(a, h_prev, h_rows, ks, k0);
#pragma unroll
            for (int n = 0; n < NT; ++n) Ops::mma(du[n], a, bu.b[ks][n]);
        }
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) grad[ii][n][e] = total(du[n], e);
        if (!Ops::UPDATE_AFTER_SENDS) {
            __syncwarp();  // every lane's loads of these weights (for Q) before any lane's update
            float tile[1][NT][4];
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) tile[0][n][e] = grad[ii][n][e];
            update_hidden(wt, ii, tile, in, lr);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) q_out[ii][mt][j][e] = total(q[mt][j], e);
    }
}

// ---- layer 1, TF32: W_1 in shared memory ---------------------------------------------------------
// The forward: partial[w] = x · W_1[U_c, :]ᵀ over warp w's tiles of 16 inputs.
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

// W_1[U_c, :] −= lr · (xᵀ dh_1)ᵀ, x in global memory or staged in shared: m = inputs (tiles of 16,
// warp w taking w, w + WARPS, ...), k = rows, n = units. A lane's rows m = g, g + 8 of a tile are
// the inputs 2g, 2g + 1 (one 8-byte load). Rows past the step's read the last row again, against
// zeros of dh.
template <class Rows>
__device__ void update_first_layer(Rows x_rows, float* w1, const float* dh, float lr, int rows) {
    constexpr int MPW = W1_TILES_PER_WARP;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const Tf32Ops::DhOperand bu(dh);
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
            for (int n = 0; n < NT; ++n) mma_x(d[n], a, bu.b[ks][n].hi, bu.b[ks][n].lo);
        }
        float grad[1][NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) grad[0][n][e] = total(d[n], e);
        update_w1(w1, i, grad, lr);
    }
}

// Layer 1's products (TF32) over W_1[U_c, :] in shared memory (s.w1, in quads of inputs: w1_at).
struct Tf32Ops::FirstLayer {
    float* w1;
    __device__ explicit FirstLayer(const Smem& s) : w1(s.w1) {}
    // W_1[U_c, :] from global memory (row-major, HIDDEN × FEATURES), zero past S and FEATURES, by
    // the whole block, and back.
    __device__ void load(const float* w_global, int u0) {
        for (int i = threadIdx.x; i < FEATURE_STRIDE * WST; i += THREADS) {
            const int k = i / WST, u = i - k * WST;
            w1[w1_at(k, u)] = k < FEATURES && u < S ? w_global[(long long)(u0 + u) * FEATURES + k] : 0.0f;
        }
    }
    __device__ void store(float* w_global, int u0) const {
        for (int i = threadIdx.x; i < FEATURES * S; i += THREADS) {
            const int u = i / FEATURES, k = i - u * FEATURES;
            w_global[(long long)(u0 + u) * FEATURES + k] = w1[w1_at(k, u)];
        }
    }
    template <class Rows>
    __device__ __forceinline__ void forward(Rows x_rows, int rows, float* partial) { forward_first(x_rows, w1, partial, rows); }
    template <class Rows>
    __device__ __forceinline__ void update(Rows x_rows, const float* dh, float lr, int rows) {
        update_first_layer(x_rows, w1, dh, lr, rows);
    }
};

// ---- layer 1, bf16: W_1 and the step's images in registers ------------------------------------
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
struct Bf16Ops::FirstLayer {
    static constexpr int TILES = F_MTILES, TPW = W1_TILES_PER_WARP, UT = (S + 15) / 16;  // UT: units in m-tiles of 16
    float w[TPW][NT][2][2];  // W_1[8n + g][16c + 8h + 2t + j]
    unsigned x[TPW][MT][4];  // the images' A fragments of rows 16mt.., inputs 16c..: x[r][k] as bf16

    __device__ explicit FirstLayer(const Smem&) {}
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
    __device__ __forceinline__ void forward_products(float* partial) const {
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
    __device__ __forceinline__ void update_weights(const float* dh, float lr) {
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

    // The interface of a FirstLayer (Tf32Ops::FirstLayer's too): partial[w] = x · W_1[U_c, :]ᵀ over
    // the warp's tiles, and W_1's update from dh_1 (the images as the forward left them here).
    template <class Rows>
    __device__ __forceinline__ void forward(Rows x_rows, int rows, float* partial) {
        load_images(x_rows, rows);
        forward_products(partial);
    }
    template <class Rows>
    __device__ __forceinline__ void update(Rows, const float* dh, float lr, int) { update_weights(dh, lr); }
};

// The build's products.
template <bool IS_BF16> struct OpsOf { typedef Tf32Ops type; };
template <> struct OpsOf<true> { typedef Bf16Ops type; };
typedef OpsOf<BF16 != 0>::type Ops;
