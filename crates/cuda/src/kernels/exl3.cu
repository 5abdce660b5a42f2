// EXL3 trellis linear layers, exact path, one activation row:
//   y = (H128(H128(x * suh) W_inner) * svh + bias)[..rows]
// W_inner is stored as 16x16 tail-biting tiles, int16 [k/16][n/16][16 K] (crates/quant/src/exl3,
// the CPU twin every kernel here is checked against). One module per codebook (EXL3_CB: 0 = 3INST,
// 1 = MCG, 2 = MUL1) and bitrate (EXL3_TWICE = 2 K: 2..16 even, or 3/5/7 for 1.5/2.5/3.5), so the
// bit positions below are compile-time constants (the multi-part kernels' other parts may have
// rates of their own: EXL3_TWICE1, EXL3_TWICE2).
//
// Three launches: exl3_in (x * suh, H128 -> xh), exl3_gemv (decode in registers, f32 partial sums
// over a k-split), exl3_out (the partial sums in a fixed order, H128, * svh, + bias). The split is
// summed in order, never with atomics, so runs are bit-identical. Beside them: the tensor-core
// GEMV for up to 64 rows (exl3_mma*), the GEMM path's decode to fp16 (exl3_dequant), and MUL1's
// fast path for one row (exl3_q8: int8 activations, dp4a). The tensor-core and int8 kernels take
// up to three layers of one input in one launch (PART_PARAMS) and can fuse a gated MLP's
// activation.
//
// Measured on the H200 (scripts/gpu/results/2026-12-01-exl3-run1, -run2): ~34 us for a 4096x14336 layer at
// K = 2, 3 and 4 and every codebook, so the cost is per weight (integer decode issue), not bytes.
// Two changes measured slower and are not kept (run 2): the fp16 conversions replaced by integer
// and f32 bit tricks (MUL1 42 us, 3INST/MCG 77 us: more work on the saturated integer pipe) and
// 4-24 tiles in flight per warp with xh staged in shared memory (depth 4 best at 36 us; deeper
// only cost occupancy).

#ifndef EXL3_CB
#define EXL3_CB 2
#endif
#ifndef EXL3_TWICE
#define EXL3_TWICE 8
#endif
// Parts 1 and 2 of a multi-part launch (PART_PARAMS: k and v beside q, up beside gate) may be
// at other bitrates than part 0's (a quantizer's allocation can give them another K):
// EXL3_TWICE1 and EXL3_TWICE2, by default the part before's. The one-layer kernels take
// EXL3_TWICE.
#ifndef EXL3_TWICE1
#define EXL3_TWICE1 EXL3_TWICE
#endif
#ifndef EXL3_TWICE2
#define EXL3_TWICE2 EXL3_TWICE1
#endif
#define EXL3_MIXED (EXL3_TWICE1 != EXL3_TWICE || EXL3_TWICE2 != EXL3_TWICE)

// Tile rows of one step of the tensor-core GEMV (two steps in flight per warp). Its splits are
// whole pairs of steps (exl3::mma_split: multiples of 8 tile rows).
#define MMA_DEPTH 4
// Blocks per SM the tensor-core GEMV's registers are bounded for (gpu_exl3::timing sweeps it).
#ifndef MMA_MIN_BLOCKS
#if !EXL3_MIXED
#define MMA_MIN_BLOCKS 4
#else
// Parts at different rates: both rates' layers in one kernel spilled a few bytes at 64
// registers (and bounded for 4 with those spills, measured no faster; session 29).
#define MMA_MIN_BLOCKS 3
#endif
#endif

#define EXL3_WARPS 8

// The stream geometry of bitrate TW = 2 K, all compile-time constants.
// One past the last stream bit of position p (half rates: odd positions carry one more bit).
template <int TW>
__host__ __device__ constexpr int end_bit(int p) {
    return (p + 1) * (TW / 2) + ((TW & 1) ? (p + 1) / 2 : 0);
}
// Offset of lane-position j's window from the lane's first window (the same for every lane:
// end_bit(8L + j) - end_bit(8L)).
template <int TW>
__host__ __device__ constexpr int pos_off(int j) {
    return j * (TW / 2) + ((TW & 1) ? (j + 1) / 2 : 0);
}
// Start of lane L's first 16-bit window, in [0, 128 TW) (circular).
template <int TW>
__host__ __device__ constexpr int lane_start(int lane) {
    return (end_bit<TW>(8 * lane) - 16 + 128 * TW) % (128 * TW);
}
// Words each lane loads: enough for its 8 windows from its (unaligned) start, the most any lane
// needs.
template <int TW>
__host__ __device__ constexpr int lane_loads() {
    int m = 0;
    for (int l = 0; l < 32; l++) {
        const int need = ((lane_start<TW>(l) & 31) + pos_off<TW>(7) + 16 + 31) / 32;
        m = need > m ? need : m;
    }
    return m;
}
template <int TW>
struct Rate {
    // A tile's 256 positions of TW / 2 bits.
    static constexpr int TILE_WORDS = 4 * TW;
    // Words each lane decodes from.
    static constexpr int NLOAD = lane_loads<TW>();
    // Words of a tile each lane holds when a warp loads the tile coalesced.
    static constexpr int OWN = (TILE_WORDS + 31) / 32;
    // Aligned words the 8 windows span.
    static constexpr int NALIGN = (pos_off<TW>(7) + 16 + 31) / 32;
};

// The bitrate (2 K) of a multi-part launch's part.
__device__ __forceinline__ int part_twice(int part) {
    return part == 0 ? EXL3_TWICE : part == 1 ? EXL3_TWICE1 : EXL3_TWICE2;
}
// Runs CALL(TW) with TW the bitrate `tw` of a part, one instantiation per distinct rate.
#if EXL3_TWICE1 == EXL3_TWICE && EXL3_TWICE2 == EXL3_TWICE
#define AT_PART_RATE(tw, CALL) CALL(EXL3_TWICE)
#elif EXL3_TWICE2 == EXL3_TWICE || EXL3_TWICE2 == EXL3_TWICE1
#define AT_PART_RATE(tw, CALL) \
    if ((tw) == EXL3_TWICE) CALL(EXL3_TWICE); else CALL(EXL3_TWICE1)
#elif EXL3_TWICE1 == EXL3_TWICE
#define AT_PART_RATE(tw, CALL) \
    if ((tw) == EXL3_TWICE) CALL(EXL3_TWICE); else CALL(EXL3_TWICE2)
#else
#define AT_PART_RATE(tw, CALL)                                      \
    if ((tw) == EXL3_TWICE) CALL(EXL3_TWICE);                       \
    else if ((tw) == EXL3_TWICE1) CALL(EXL3_TWICE1);                \
    else CALL(EXL3_TWICE2)
#endif

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
// Round to the nearest fp16 (even on ties), back as f32: the codec's fp16 values.
__device__ __forceinline__ float round_f16(float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h2f(h);
}

// The codebook's fp16 value of a 16-bit state, as f32 (codebook.rs: every step is exact in f32,
// then one rounding).
__device__ __forceinline__ float codebook(u32 x) {
#if EXL3_CB == 2
    const u32 p = x * 0x83DCD12Du;
    u32 s;
    asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(s) : "r"(p), "r"(0x01010101u), "r"(0u));
    // fma(fp16(1024 + s), fp16 0x1EEE, fp16 0xC931), exact in f32.
    return round_f16(__fadd_rn(__fmul_rn((float)(1024u + s), 1774.0f / 262144.0f), -1329.0f / 128.0f));
#else
#if EXL3_CB == 0
    u32 m = x * 89226354u + 64248484u;
#else
    u32 m = x * 0xCBAC1FEDu;
#endif
    m = (m & 0x8FFF8FFFu) ^ 0x3B603B60u;
    return round_f16(__fadd_rn(h2f((unsigned short)(m & 0xffffu)), h2f((unsigned short)(m >> 16))));
#endif
}

// The codebook's fp16 values of two 16-bit states as a packed half2 (the first in the low half):
// the same values as codebook(), computed in fp16 arithmetic with the same single rounding (MUL1:
// one fused fp16 fma of the exact integer 1024 + s; 3INST/MCG: one fp16 add of the two halves).
__device__ __forceinline__ u32 codebook2(u32 x0, u32 x1) {
    u32 r;
#if EXL3_CB == 2
    // dp4a's accumulator 0x6400 makes 0x6400 + s, the fp16 bits of 1024 + s (s <= 1020).
    u32 h0, h1;
    asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(h0) : "r"(x0 * 0x83DCD12Du), "r"(0x01010101u), "r"(0x6400u));
    asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(h1) : "r"(x1 * 0x83DCD12Du), "r"(0x01010101u), "r"(0x6400u));
    const u32 h = __byte_perm(h0, h1, 0x5410);
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(h), "r"(0x1EEE1EEEu), "r"(0xC931C931u));
#else
#if EXL3_CB == 0
    const u32 m0 = x0 * 89226354u + 64248484u, m1 = x1 * 89226354u + 64248484u;
#else
    const u32 m0 = x0 * 0xCBAC1FEDu, m1 = x1 * 0xCBAC1FEDu;
#endif
    const u32 lo = (__byte_perm(m0, m1, 0x5410) & 0x8FFF8FFFu) ^ 0x3B603B60u;
    const u32 hi = (__byte_perm(m0, m1, 0x7632) & 0x8FFF8FFFu) ^ 0x3B603B60u;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(lo), "r"(hi));
#endif
    return r;
}

// Lane geometry: which tile words it loads, and its shift to its first window.
template <int TW>
struct LaneWords {
    int idx[Rate<TW>::NLOAD];
    int shift;
};
template <int TW>
__device__ __forceinline__ LaneWords<TW> lane_words(int lane) {
    LaneWords<TW> g;
    const int s0 = lane_start<TW>(lane);
#pragma unroll
    for (int i = 0; i < Rate<TW>::NLOAD; i++) {
        int w = (s0 >> 5) + i;
        g.idx[i] = w >= Rate<TW>::TILE_WORDS ? w - Rate<TW>::TILE_WORDS : w;
    }
    g.shift = s0 & 31;
    return g;
}

template <int TW>
__device__ __forceinline__ void load_words(const u32* __restrict__ tile, const LaneWords<TW>& g,
                                           u32 (&w)[Rate<TW>::NLOAD]) {
#pragma unroll
    for (int i = 0; i < Rate<TW>::NLOAD; i++) w[i] = __ldg(tile + g.idx[i]);
}

// The shift to the first window that every lane has, or -1 where lanes differ (K = 4 and 8:
// a lane's 8 positions are whole words of the stream).
template <int TW>
__host__ __device__ constexpr int common_shift() {
    for (int l = 1; l < 32; l++)
        if ((lane_start<TW>(l) & 31) != (lane_start<TW>(0) & 31)) return -1;
    return lane_start<TW>(0) & 31;
}

// The lane's 8 16-bit states (positions 8L..8L+7) from its loaded words.
template <int TW>
__device__ __forceinline__ void states8(const u32 (&w)[Rate<TW>::NLOAD], int shift, u32 (&st)[8]) {
    constexpr int NLOAD = Rate<TW>::NLOAD, NALIGN = Rate<TW>::NALIGN;
    constexpr int FIXED = common_shift<TW>();
    if (FIXED >= 0 && NLOAD <= 2) {
        // Each window straight from the loaded words, without an aligned copy of the stream
        // first: 2 instructions a tile fewer at K = 4. (At K = 8, over 3 words, the 16-row
        // kernel spilled.)
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int o = FIXED + pos_off<TW>(j), q = o >> 5, r = o & 31;
            st[j] = r <= 16 ? (w[q] >> (16 - r)) & 0xffffu
                            : __funnelshift_l(q + 1 < NLOAD ? w[q + 1] : 0u, w[q], r) >> 16;
        }
        return;
    }
    // The stream from the lane's first window on, in NALIGN big-endian words (+1 of zeros).
    u32 a[NALIGN + 1];
#pragma unroll
    for (int i = 0; i <= NALIGN; i++) {
        const u32 hi = i < NLOAD ? w[i] : 0u;
        const u32 lo = i + 1 < NLOAD ? w[i + 1] : 0u;
        a[i] = __funnelshift_l(lo, hi, shift);
    }
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int o = pos_off<TW>(j), q = o >> 5, r = o & 31;
        // A window inside one word is one shift and a mask (or one byte permute).
        st[j] = r <= 16 ? (a[q] >> (16 - r)) & 0xffffu : __funnelshift_l(a[q + 1], a[q], r) >> 16;
    }
}

// The lane's 8 weights (positions 8L..8L+7) from its loaded words.
template <int TW>
__device__ __forceinline__ void decode8(const u32 (&w)[Rate<TW>::NLOAD], int shift, float (&v)[8]) {
    u32 st[8];
    states8<TW>(w, shift, st);
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = codebook(st[j]);
}

// The lane's 8 weights as 4 half2: (v0, v1), (v2, v3), (v4, v5), (v6, v7) of decode8's order,
// which are the mma.m16n8k16 B fragments of the tile's two 8-column halves ({h[0], h[1]} for
// columns 0..7, {h[2], h[3]} for 8..15).
template <int TW>
__device__ __forceinline__ void decode8h(const u32 (&w)[Rate<TW>::NLOAD], int shift, u32 (&h)[4]) {
    u32 st[8];
    states8<TW>(w, shift, st);
#pragma unroll
    for (int j = 0; j < 4; j++) h[j] = codebook2(st[2 * j], st[2 * j + 1]);
}

// Warp-wide H128 on 128 values, lane holding elements 4 lane .. 4 lane + 3: the butterflies of
// hadamard.rs in the same order of operations, then the 1/sqrt(128) scale (bit-identical to it).
__device__ __forceinline__ void had128(float (&v)[4], int lane) {
    float a, b;
    a = v[0]; b = v[1]; v[0] = __fadd_rn(a, b); v[1] = __fsub_rn(a, b);
    a = v[2]; b = v[3]; v[2] = __fadd_rn(a, b); v[3] = __fsub_rn(a, b);
    a = v[0]; b = v[2]; v[0] = __fadd_rn(a, b); v[2] = __fsub_rn(a, b);
    a = v[1]; b = v[3]; v[1] = __fadd_rn(a, b); v[3] = __fsub_rn(a, b);
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float o = __shfl_xor_sync(FULL_MASK, v[i], m);
            v[i] = (lane & m) ? __fsub_rn(o, v[i]) : __fadd_rn(v[i], o);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) v[i] = __fmul_rn(v[i], __uint_as_float(0x3DB504F3u));
}

// Four f32 as fp16 (round to nearest), clamped to fp16's range (a real activation beyond it
// would already be inf in exllamav3's fp16), packed in order.
__device__ __forceinline__ uint2 pack_f16x4(const float (&v)[4]) {
    u32 h01, h23;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h01) : "f"(fminf(fmaxf(v[1], -65504.0f), 65504.0f)),
        "f"(fminf(fmaxf(v[0], -65504.0f), 65504.0f)));
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h23) : "f"(fminf(fmaxf(v[3], -65504.0f), 65504.0f)),
        "f"(fminf(fmaxf(v[2], -65504.0f), 65504.0f)));
    return make_uint2(h01, h23);
}

// v = x[r] * suh, this lane's four inputs from c0, x zero-extended from `cols` (the model's padding
// to 128s); x is f32 or bf16 (x_bf16), row stride ldx.
__device__ __forceinline__ void load_in(const void* __restrict__ x, int x_bf16, int ldx, int cols,
                                        const float* __restrict__ suh, long long r, int c0,
                                        float (&v)[4]) {
    const long long xo = r * ldx + c0;
    const void* xp = x_bf16 ? (const void*)((const bf16*)x + xo) : (const void*)((const float*)x + xo);
    if (c0 + 3 < cols && ((u64)xp & (x_bf16 ? 7 : 15)) == 0) {
        // Four inputs in one load.
        if (x_bf16) {
            const uint2 w = *(const uint2*)xp;
            v[0] = bflo(w.x), v[1] = bfhi(w.x), v[2] = bflo(w.y), v[3] = bfhi(w.y);
        } else {
            const float4 w = *(const float4*)xp;
            v[0] = w.x, v[1] = w.y, v[2] = w.z, v[3] = w.w;
        }
        const float4 s = *(const float4*)(suh + c0);
        v[0] = __fmul_rn(v[0], s.x), v[1] = __fmul_rn(v[1], s.y);
        v[2] = __fmul_rn(v[2], s.z), v[3] = __fmul_rn(v[3], s.w);
    } else {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int c = c0 + i;
            float xv = 0.0f;
            if (c < cols)
                xv = x_bf16 ? bf2f(((const bf16*)x)[xo + i]) : ((const float*)x)[xo + i];
            v[i] = c < cols ? __fmul_rn(xv, suh[c]) : 0.0f;
        }
    }
}

// v = H128(x[r] * suh) over inputs c0 - 4 lane .. + 128 (this lane's four from c0).
__device__ __forceinline__ void rotate_in(const void* __restrict__ x, int x_bf16, int ldx, int cols,
                                          const float* __restrict__ suh, long long r, int c0,
                                          int lane, float (&v)[4]) {
    load_in(x, x_bf16, ldx, cols, suh, r, c0, v);
    had128(v, lane);
}

// Rows of x each warp of exl3_in rotates, their loads issued together (exl3::IN_ROWS).
#define IN_ROWS 4

// xh[r] = H128(x[r] * suh) for the m rows, IN_ROWS a block from IN_ROWS blockIdx.y, x zero-extended
// from `cols` to `k` (the model's padding to 128s). x is f32 or bf16 (x_bf16), row stride ldx; xh
// is f32 (the exact path) or fp16 (xh_f16: the tensor-core GEMM's operand; clamped to fp16's range,
// as a real activation beyond it would already be inf in exllamav3's fp16). One warp per
// 128-block; blocks of 4 warps. blockIdx.z picks the layer of up to three sharing the input
// (suh, suh1, suh2), whose rows go `part_stride` elements apart in xh.
extern "C" __global__ void __launch_bounds__(128) exl3_in(const void* __restrict__ x, int x_bf16,
                                                          int ldx, int cols,
                                                          const float* __restrict__ suh,
                                                          const float* __restrict__ suh1,
                                                          const float* __restrict__ suh2,
                                                          unsigned long long part_stride,
                                                          void* __restrict__ xh, int xh_f16, int k,
                                                          int m) {
    pdl_wait();
    const int lane = threadIdx.x & 31;
    if (blockIdx.z > 0) {
        suh = blockIdx.z == 1 ? suh1 : suh2;
        xh = (char*)xh + (xh_f16 ? 2 : 4) * part_stride * blockIdx.z;
    }
    const int blk = blockIdx.x * 4 + (threadIdx.x >> 5);
    if (blk * 128 >= k) return;
    const int c0 = blk * 128 + 4 * lane;
    const long long r0 = (long long)blockIdx.y * IN_ROWS;
    float v[IN_ROWS][4];
    // Every row's loads first: more bytes in flight.
#pragma unroll
    for (int i = 0; i < IN_ROWS; i++)
        if (r0 + i < m) load_in(x, x_bf16, ldx, cols, suh, r0 + i, c0, v[i]);
#pragma unroll
    for (int i = 0; i < IN_ROWS; i++) {
        if (r0 + i >= m) break;
        had128(v[i], lane);
        const long long o = (r0 + i) * k + c0;
        if (xh_f16) {
            *(uint2*)((unsigned short*)xh + o) = pack_f16x4(v[i]);
        } else {
            *(float4*)((float*)xh + o) = make_float4(v[i][0], v[i][1], v[i][2], v[i][3]);
        }
    }
}

// partial[split][r][n]: sum over the split's tile rows of xh[r] . W_inner, for the m <= R rows
// (m < R leaves the rows past m unread and unwritten). Grid (n / 128, splits), 8 warps a block;
// warp w takes tile column 8 blockIdx.x + w, so a block reads 8 adjacent tiles (contiguous bytes)
// per tile row. Lane L holds rows 2(L&3) + {0, 1, 8, 9} of columns L/4 and L/4 + 8 (the mma
// B-fragment order of the positions). Each weight is decoded once for all R rows; every row's sum
// runs in the same order as R = 1's, so the result does not depend on the row count.
template <int R>
__device__ __forceinline__ void gemv_rows(const u32* __restrict__ trellis,
                                          const float* __restrict__ xh,
                                          float* __restrict__ partial, int tiles_k, int tiles_n,
                                          int tk_per_split, int m) {
    constexpr int TW = EXL3_TWICE, NLOAD = Rate<TW>::NLOAD, TILE_WORDS = Rate<TW>::TILE_WORDS;
    pdl_wait();
    const int lane = threadIdx.x & 31;
    const int tn = blockIdx.x * EXL3_WARPS + (threadIdx.x >> 5);
    const int tk0 = blockIdx.y * tk_per_split;
    const int tk1 = min(tk0 + tk_per_split, tiles_k);
    const LaneWords<TW> g = lane_words<TW>(lane);
    const int row0 = 2 * (lane & 3);
    const long long k = (long long)tiles_k * 16;
    const long long stride = (long long)tiles_n * TILE_WORDS;
    const u32* t = trellis + ((long long)tk0 * tiles_n + tn) * TILE_WORDS;
    float acc0[R], acc1[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = 0.0f;
    u32 cur[NLOAD];
    if (tk0 < tk1) load_words<TW>(t, g, cur);
    for (int tk = tk0; tk < tk1; tk++) {
        // The next tile's words in flight while this one decodes.
        u32 nxt[NLOAD];
        if (tk + 1 < tk1) load_words<TW>(t + stride, g, nxt);
        t += stride;
        float v[8];
        decode8<TW>(cur, g.shift, v);
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (r < m) {
                const float* xr = xh + r * k + 16 * tk + row0;
                const float2 xa = __ldg((const float2*)xr);
                const float2 xb = __ldg((const float2*)(xr + 8));
                acc0[r] = fmaf(xa.x, v[0], acc0[r]);
                acc0[r] = fmaf(xa.y, v[1], acc0[r]);
                acc0[r] = fmaf(xb.x, v[2], acc0[r]);
                acc0[r] = fmaf(xb.y, v[3], acc0[r]);
                acc1[r] = fmaf(xa.x, v[4], acc1[r]);
                acc1[r] = fmaf(xa.y, v[5], acc1[r]);
                acc1[r] = fmaf(xb.x, v[6], acc1[r]);
                acc1[r] = fmaf(xb.y, v[7], acc1[r]);
            }
        }
#pragma unroll
        for (int i = 0; i < NLOAD; i++) cur[i] = nxt[i];
    }
    const long long n = (long long)tiles_n * 16;
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (r < m) {
            // The 4 lanes of a column, in a fixed order.
            float a0 = acc0[r], a1 = acc1[r];
            a0 += __shfl_xor_sync(FULL_MASK, a0, 1);
            a1 += __shfl_xor_sync(FULL_MASK, a1, 1);
            a0 += __shfl_xor_sync(FULL_MASK, a0, 2);
            a1 += __shfl_xor_sync(FULL_MASK, a1, 2);
            if ((lane & 3) == 0) {
                float* p = partial + ((long long)blockIdx.y * m + r) * n + tn * 16 + (lane >> 2);
                p[0] = a0;
                p[8] = a1;
            }
        }
    }
}

#define EXL3_GEMV(name, R)                                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        name(const u32* __restrict__ trellis, const float* __restrict__ xh,                     \
             float* __restrict__ partial, int tiles_k, int tiles_n, int tk_per_split, int m) { \
        gemv_rows<R>(trellis, xh, partial, tiles_k, tiles_n, tk_per_split, m);                  \
    }
// One row: the exact twin. Its 2-, 4- and 8-row instantiations measured slower than the
// tensor-core kernel at every row count (98 against 36 us at 8 rows, 4096x14336) and were deleted.
EXL3_GEMV(exl3_gemv, 1)

// fp16 halves of the rotated input a tensor-core GEMV block holds (rows x (its split's inputs +
// 8)).
#define XS_HALVES 24320

// Where input i (0..15) of a 16-input group sits in the int8 path's shared inputs: the four
// inputs of a lane's weights (2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9) side by side, so one
// 128-bit load reads them.
__device__ __forceinline__ int xs_pos(int i) { return ((i & 6) << 1) | ((i >> 2) & 2) | (i & 1); }

// Streams tile rows tk0..tk1 of one tile column, starting at tl (its first tile's words + lane)
// with `stride` words between tile rows: two buffers of MMA_DEPTH tile rows in turn, one in
// flight while the other is used (so tk1 - tk0 must be whole pairs of steps: 2 MMA_DEPTH tile
// rows). Each tile's words are loaded coalesced (lane L holds words L and L + 32) and handed to
// the lanes that decode them by shuffles; tile(cur, tk) then gets this lane's NLOAD words of
// tile row tk, and turn(tk) runs after tile rows tk .. tk + 7 (a 128-input block).
template <int TW, class Prologue, class Tile, class Turn>
__device__ __forceinline__ void stream_tiles(const u32* __restrict__ tl, long long stride, int tk0,
                                             int tk1, const LaneWords<TW>& g, Prologue prologue,
                                             Tile tile, Turn turn) {
    constexpr int OWN = Rate<TW>::OWN, NLOAD = Rate<TW>::NLOAD, TILE_WORDS = Rate<TW>::TILE_WORDS;
    const int lane = threadIdx.x & 31;
    // Lanes past the tile's words load one of its words again (never used) instead of
    // branching around the load.
    int at[OWN];
#pragma unroll
    for (int o = 0; o < OWN; o++) at[o] = 32 * o - (32 * o + lane < TILE_WORDS ? 0 : TILE_WORDS);
    const auto load = [&](const u32* p, u32 (&w)[MMA_DEPTH][OWN]) {
#pragma unroll
        for (int d = 0; d < MMA_DEPTH; d++)
#pragma unroll
            for (int o = 0; o < OWN; o++) w[d][o] = __ldg(p + d * stride + at[o]);
    };
    const auto step = [&](const u32 (&w)[MMA_DEPTH][OWN], int tk) {
#pragma unroll
        for (int d = 0; d < MMA_DEPTH; d++) {
            u32 cur[NLOAD];
#pragma unroll
            for (int i = 0; i < NLOAD; i++) {
                const int src = g.idx[i];
                if (OWN == 1) {
                    cur[i] = __shfl_sync(FULL_MASK, w[d][0], src);
                } else {
                    const u32 lo = __shfl_sync(FULL_MASK, w[d][0], src & 31);
                    const u32 hi = __shfl_sync(FULL_MASK, w[d][OWN - 1], src & 31);
                    cur[i] = src < 32 ? lo : hi;
                }
            }
            tile(cur, tk + d);
        }
    };
    // The first two steps' words are in flight while the kernel before finishes (pdl_wait) and the
    // prologue runs (the block's inputs).
    u32 wa[MMA_DEPTH][OWN], wb[MMA_DEPTH][OWN];
    load(tl, wa);
    load(tl + MMA_DEPTH * stride, wb);
    pdl_wait();
    prologue();
    for (int tk = tk0; tk < tk1; tk += 2 * MMA_DEPTH) {
        step(wa, tk);
        if (tk + 2 * MMA_DEPTH < tk1) load(tl + 2 * MMA_DEPTH * stride, wa);
        step(wb, tk + MMA_DEPTH);
        if (tk + 3 * MMA_DEPTH < tk1) load(tl + 3 * MMA_DEPTH * stride, wb);
        tl += 2 * MMA_DEPTH * stride;
        turn(tk);
    }
}
// stream_tiles with nothing to do between turns.
template <int TW, class Prologue, class Tile>
__device__ __forceinline__ void stream_tiles(const u32* __restrict__ tl, long long stride, int tk0,
                                             int tk1, const LaneWords<TW>& g, Prologue prologue,
                                             Tile tile) {
    stream_tiles<TW>(tl, stride, tk0, tk1, g, prologue, tile, [](int) {});
}

// Up to three layers of one module that take the same input (q, k, v; gate, up) run as one
// launch: their 128-output bands side by side in blockIdx.x (bands0 of part 0, bands1 of part 1,
// the rest part 2), their outputs side by side in y (part 1's from column rows0 on). One launch
// instead of three: each launch costs a ramp and a tail.
#define PART_BASE_PARAMS                                                                          \
    const u32 *__restrict__ t0, const u32 *__restrict__ t1, const u32 *__restrict__ t2,           \
        const float *__restrict__ suh0, const float *__restrict__ suh1,                           \
        const float *__restrict__ suh2, const float *__restrict__ svh0,                           \
        const float *__restrict__ svh1, const float *__restrict__ svh2,                           \
        const float *__restrict__ bias0, const float *__restrict__ bias1,                         \
        const float *__restrict__ bias2, int rows0, int rows1, int rows2, int bands0, int bands1, \
        int act, bf16 *__restrict__ act_y
#define PART_PARAMS                                                                               \
    PART_BASE_PARAMS, const int *__restrict__ rope_pos, const float *__restrict__ rope_freq,      \
        int rope_heads, int rope_kv, float rope_pos_scale, float rope_in_scale,                   \
        float rope_q_scale, float *__restrict__ rope_q, bf16 *__restrict__ rope_k,                \
        bf16 *__restrict__ rope_v, const int *__restrict__ rope_tables,                           \
        const int *__restrict__ rope_table_off, int rope_bs
// PART_PARAMS passed on as they are.
#define PART_NAMES                                                                                 \
    t0, t1, t2, suh0, suh1, suh2, svh0, svh1, svh2, bias0, bias1, bias2, rows0, rows1, rows2,     \
        bands0, bands1, act, act_y, rope_pos, rope_freq, rope_heads, rope_kv, rope_pos_scale,     \
        rope_in_scale, rope_q_scale, rope_q, rope_k, rope_v, rope_tables, rope_table_off, rope_bs
#define PART_ARGS                                                                                  \
    t0, t1, t2, suh0, suh1, suh2, svh0, svh1, svh2, bias0, bias1, bias2, rows0, rows1, rows2,     \
        bands0, bands1, act, act_y,                                                               \
        RopeKv{rope_pos, rope_freq, rope_heads, rope_kv, rope_pos_scale, rope_in_scale,           \
               rope_q_scale, rope_q, rope_k, rope_v, rope_tables, rope_table_off, rope_bs}

// With act >= 0 the launch is a gated MLP's gate (part 0) and up (part 1, as wide): the last
// block of each pair of bands writes act_y[r][c] = bf16(act(gate) * up) for the rows0 outputs
// instead of the two layers' outputs (no second pass over them).
//
// With rope_heads > 0 (up to 16 rows) the launch is an attention's q (part 0), k and v (parts 1,
// 2) with a head dimension of 128, so that a band is a head: the band's last block applies RoPE
// (half-split, all 128 dims; pair i, i + 64 sits in lanes l, l + 16) to q and k at the row's
// position, writes q * q_scale (f32, row stride rope_heads * 128) and k, v (bf16) into the KV
// cache at the position's slot (through the block tables where given), as qkv_rope does after an
// unfused launch, and writes nothing to y.
struct RopeKv {
    const int* pos;
    const float* freq;
    int heads, kv;
    float pos_scale, in_scale, q_scale;
    float* q;
    bf16* k;
    bf16* v;
    const int* tables;
    const int* table_off;
    int bs;
};

// This block's part: its layer's pointers, used outputs, tile columns, band within it, and first
// output column in y; and, for a fused MLP, the up layer's scales and the activation's output.
struct Part {
    const u32* trellis;
    const float* suh;
    const float* svh;
    const float* bias;
    int rows, tiles_n, band, y_off, index;
    int act, bands0;
    const float* svh_gate;
    const float* bias_gate;
    const float* svh_up;
    const float* bias_up;
    bf16* act_y;
    RopeKv rope;
};
// Which part this block computes.
__device__ __forceinline__ int block_index(int bands0, int bands1) {
    const int b = blockIdx.x;
    return b < bands0 ? 0 : b < bands0 + bands1 ? 1 : 2;
}
__device__ __forceinline__ Part block_part(PART_BASE_PARAMS, RopeKv rope) {
    const int b = blockIdx.x, index = block_index(bands0, bands1);
    Part p;
    if (index == 0) {
        p = Part{t0, suh0, svh0, bias0, rows0, 8 * bands0, b, 0, 0};
    } else if (index == 1) {
        p = Part{t1, suh1, svh1, bias1, rows1, 8 * bands1, b - bands0, rows0, 1};
    } else {
        p = Part{t2,    suh2, svh2, bias2, rows2, 8 * ((int)gridDim.x - bands0 - bands1),
                 b - bands0 - bands1, rows0 + rows1, 2};
    }
    p.act = act;
    p.bands0 = bands0;
    p.svh_gate = svh0;
    p.bias_gate = bias0;
    p.svh_up = svh1;
    p.bias_up = bias1;
    p.act_y = act_y;
    p.rope = rope;
    return p;
}

// H128 of the sum of split partials of row r over the 128 columns from c0 (this lane's four).
__device__ __forceinline__ void band_sum(const float* __restrict__ partial, int splits, int m, int r,
                                         long long n, long long c0, int lane, float (&v)[4]) {
    v[0] = v[1] = v[2] = v[3] = 0.0f;
    for (int s = 0; s < splits; s++) {
        const float4 q = __ldcg((const float4*)(partial + ((long long)s * m + r) * n + c0));
        v[0] += q.x;
        v[1] += q.y;
        v[2] += q.z;
        v[3] += q.w;
    }
    had128(v, lane);
}

// The RoPE + KV-cache epilogue of band p.band (a head) of row r (see RopeKv): h is the band's
// H128 output, this lane's four values 4 lane .. 4 lane + 3. The arithmetic is qkv_rope's but for
// the angle's sin and cos (rope_sincos, as the bf16 qkv GEMV's epilogue).
__device__ __forceinline__ void rope_kv_row(const Part& p, int r, const float (&h)[4], int lane) {
    const RopeKv& e = p.rope;
    const int d0 = 4 * lane, c0 = p.band * 128 + d0;
    const int pos = e.pos[r];
    const float pf = (float)pos * e.pos_scale;
    // One value at a time, each stored as it is done, the cache slot recomputed per value: the
    // epilogue runs within the main loop's register budget (holding the slot's address across
    // the loop spilled the 16-row kernel at K = 2, measured by the NVRTC spill check).
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float o = __fmul_rn(h[i], p.svh[c0 + i]);
        if (p.bias) o = __fadd_rn(o, p.bias[c0 + i]);
        if (p.index == 2) {
            e.v[(kv_slot(e.tables, e.table_off, r, pos, e.bs) * e.kv + p.band) * 128 + d0 + i] =
                f2bf(o);
            continue;
        }
        float sn, cs;
        rope_sincos(pf * e.freq[(d0 + i) & 63], &sn, &cs);
        const float mine = o * e.in_scale;
        const float other = __shfl_xor_sync(FULL_MASK, mine, 16);
        // Lanes 0-15 hold the first of each pair (x1), lanes 16-31 the second (x2).
        float out;
        if (lane < 16) {
            const float x1 = mine, x2 = other;
            out = x1 * cs - x2 * sn;
        } else {
            const float x1 = other, x2 = mine;
            out = x1 * sn + x2 * cs;
        }
        if (p.index == 0)
            e.q[(long long)r * e.heads * 128 + c0 + i] = out * e.q_scale;
        else
            e.k[(kv_slot(e.tables, e.table_off, r, pos, e.bs) * e.kv + p.band) * 128 + d0 + i] =
                f2bf(out);
    }
}

// After a block wrote its split's partial[split][r][band's 128 outputs] (bands of all parts side
// by side, n columns): the band's last block to finish (a counter per band, reset by that block
// for the next launch) sums the band's partials in split order (so runs are bit-identical),
// rotates them back (H128), scales by its part's svh, adds the bias.
// ROPE: whether this kernel has the RoPE + KV epilogue (the 32- and 64-row kernels do not: it
// would make them spill at some rates; their launcher never asks for it).
template <bool ROPE>
__device__ __forceinline__ void finish_band(const float* __restrict__ partial,
                                            u32* __restrict__ counters, const Part& p,
                                            float* __restrict__ y, int ldy, long long n, int m) {
    __shared__ int last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int splits = gridDim.y;
    // A fused MLP's gate band b and up band b share counter b.
    const bool pair = p.act >= 0;
    const int counter = pair ? (int)blockIdx.x % p.bands0 : (int)blockIdx.x;
    const u32 arrivals = pair ? 2 * splits : splits;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&counters[counter], 1u) == arrivals - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int r = warp; r < m; r += EXL3_WARPS) {
        float v[4];
        if (pair) {
            const int band = counter;
            float u[4];
            band_sum(partial, splits, m, r, n, (long long)band * 128 + 4 * lane, lane, v);
            band_sum(partial, splits, m, r, n, (long long)(p.bands0 + band) * 128 + 4 * lane, lane,
                     u);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int c = band * 128 + 4 * lane + i;
                if (c < p.rows) {
                    // The finishing block may be the up layer's: both layers' scales by name.
                    float gv = __fmul_rn(v[i], p.svh_gate[c]), uv = __fmul_rn(u[i], p.svh_up[c]);
                    if (p.bias_gate) gv = __fadd_rn(gv, p.bias_gate[c]);
                    if (p.bias_up) uv = __fadd_rn(uv, p.bias_up[c]);
                    p.act_y[(long long)r * p.rows + c] = f2bf(activate(gv, p.act) * uv);
                }
            }
            continue;
        }
        band_sum(partial, splits, m, r, n, (long long)blockIdx.x * 128 + 4 * lane, lane, v);
        if (ROPE && p.rope.heads > 0) {
            rope_kv_row(p, r, v, lane);
            continue;
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int c = p.band * 128 + 4 * lane + i;
            if (c < p.rows) {
                float o = __fmul_rn(v[i], p.svh[c]);
                if (p.bias) o = __fadd_rn(o, p.bias[c]);
                y[(long long)r * ldy + p.y_off + c] = o;
            }
        }
    }
    if (threadIdx.x == 0) counters[counter] = 0u;
}

// The whole layer for m <= 16 MT rows (m <= 8 unless FULL) in one launch, on tensor cores:
//   y[r][c] = (H128(sum over splits of xh[r] . W_inner) * svh + bias)[c]
// Prologue: the block rotates its split's inputs of every row, xh = H128(x * suh) rounded to
// fp16, into shared memory (the A operand; a split is whole 128-blocks). Main loop
// (stream_tiles): each tile decoded once into the mma B fragments (exact fp16 codebook values) and multiplied for every
// 16-row tile with f32 accumulation (mma.m16n8k16); its partial sums go to partial[split][r][n].
// Epilogue: the last block of a band to finish (a counter per band, reset by that block for the
// next launch) sums the band's partials in split order (so runs are bit-identical), rotates them
// back and scales. Grid (n / 128, splits), 8 warps; warp w takes tile column 8 blockIdx.x + w.
// FINISH: whether the band's finish runs here, at the end (one rate), or after (a kernel with
// parts at several rates: one copy of it for all of them).
template <int TW, int MT, bool FULL, bool FINISH>
__device__ __forceinline__ void mma_layer(const Part& p, unsigned short* __restrict__ xs,
                                          Part& sp, const void* __restrict__ x, int x_bf16,
                                          int ldx, int cols,
                                          const unsigned short* __restrict__ xh_pre,
                                          float* __restrict__ partial,
                                          u32* __restrict__ counters, float* __restrict__ y,
                                          int ldy, int tiles_k, int tk_per_split, int m) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tn = p.band * EXL3_WARPS + warp;
    // The part's epilogue fields wait in shared memory, not in registers, through the main loop
    // (written before the prologue's barrier).
    if (threadIdx.x == 0) sp = p;
    const int tk0 = blockIdx.y * tk_per_split;
    const int tk1 = min(tk0 + tk_per_split, tiles_k);
    const int kw = 16 * (tk1 - tk0);
    // Row stride of xs: 8 halves of padding put the 8 rows an A load reads in distinct banks.
    const int ks = kw + 8;
    const long long n = (long long)gridDim.x * 128;

    // xs[r][0..kw) = fp16(H128(x[r] * suh)) over this split's inputs: rotated here, or copied
    // from xh_pre (exl3_in's output for the m rows of every part, m rows of 16 tiles_k a part),
    // which is cheaper for many rows: every band's blocks would rotate the same inputs again.
    const auto prologue = [&]() {
        if (xh_pre) {
            const int k = 16 * tiles_k;
            const unsigned short* src = xh_pre + (long long)p.index * m * k + 16 * tk0;
            for (int i = threadIdx.x; i < m * (kw / 8); i += 32 * EXL3_WARPS) {
                const int r = i / (kw / 8), c = 8 * (i - r * (kw / 8));
                *(uint4*)&xs[r * ks + c] = __ldcg((const uint4*)(src + (long long)r * k + c));
            }
            __syncthreads();
            return;
        }
        const int blocks = kw / 128;
        for (int job = warp; job < m * blocks; job += EXL3_WARPS) {
            const int r = job / blocks, b = job - r * blocks;
            float v[4];
            rotate_in(x, x_bf16, ldx, cols, p.suh, r, 16 * tk0 + 128 * b + 4 * lane, lane, v);
            *(uint2*)&xs[r * ks + 128 * b + 4 * lane] = pack_f16x4(v);
        }
        __syncthreads();
    };

    const LaneWords<TW> g = lane_words<TW>(lane);
    const int grp = lane >> 2, tig = lane & 3;
    const long long stride = (long long)p.tiles_n * Rate<TW>::TILE_WORDS;
    // The tile's words coalesced (lane L holds words L and L + 32); each lane takes the words it
    // decodes from their holders by shuffles.
    const u32* tl = p.trellis + ((long long)tk0 * p.tiles_n + tn) * Rate<TW>::TILE_WORDS + lane;
    if (!FULL) {
        // Up to 8 rows: the decoded tile is the A operand (the lane's 8 weights are exactly the
        // fragment of the transposed tile: outputs grp, grp + 8, inputs 2 tig.., 2 tig + 8..) and
        // the rows of xs the B operand (column grp = row grp, clamped to the last row: the extra
        // columns are discarded). One mma a tile for its 16 outputs, two unpredicated loads.
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const int brow = min(grp, m - 1) * ks + 2 * tig;
        stream_tiles<TW>(tl, stride, tk0, tk1, g, prologue, [&](const u32 (&cur)[Rate<TW>::NLOAD], int tk) {
            u32 w[4];
            decode8h<TW>(cur, g.shift, w);
            const int o = 16 * (tk - tk0);
            const u32 b0 = *(const u32*)&xs[brow + o], b1 = *(const u32*)&xs[brow + o + 8];
            asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                : "r"(w[0]), "r"(w[2]), "r"(w[1]), "r"(w[3]), "r"(b0), "r"(b1));
        });
        // D fragment: c0, c1 at output grp, rows 2 tig + {0, 1}; c2, c3 at output grp + 8.
        float* pp = partial + (long long)blockIdx.y * m * n + blockIdx.x * 128 + warp * 16 + grp;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = 2 * tig + h;
            if (r < m) {
                pp[(long long)r * n] = acc[h];
                pp[(long long)r * n + 8] = acc[2 + h];
            }
        }
        if (FINISH) finish_band<true>(partial, counters, sp, y, ldy, n, m);
        return;
    }
    float acc[MT][2][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[i][j][c] = 0.0f;
    // This lane's A rows in xs (grp, and grp + 8 where FULL, of each 16-row tile), -1 past m.
    int arow[MT][2];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int r = 16 * i + grp + 8 * j;
            arow[i][j] = r < m ? r * ks + 2 * tig : -1;
        }
    stream_tiles<TW>(tl, stride, tk0, tk1, g, prologue, [&](const u32 (&cur)[Rate<TW>::NLOAD], int tk) {
            u32 b[4];
            decode8h<TW>(cur, g.shift, b);
            const int o = 16 * (tk - tk0);
#pragma unroll
            for (int i = 0; i < MT; i++) {
                // a0: row grp, k 2 tig..; a1: row grp + 8; a2: row grp, k + 8; a3: row grp + 8,
                // k + 8.
                u32 a[4];
                a[0] = arow[i][0] >= 0 ? *(const u32*)&xs[arow[i][0] + o] : 0u;
                a[2] = arow[i][0] >= 0 ? *(const u32*)&xs[arow[i][0] + o + 8] : 0u;
                if (FULL) {
                    a[1] = arow[i][1] >= 0 ? *(const u32*)&xs[arow[i][1] + o] : 0u;
                    a[3] = arow[i][1] >= 0 ? *(const u32*)&xs[arow[i][1] + o + 8] : 0u;
                } else {
                    a[1] = a[3] = 0u;
                }
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    float* c = acc[i][j];
                    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[2 * j]),
                          "r"(b[2 * j + 1]));
                }
            }
    });
    // D fragment: c0, c1 at row grp, columns 2 tig + {0, 1} of the 8-column half; c2, c3 at row
    // grp + 8.
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = 16 * i + grp + 8 * h;
                if (r < m) {
                    float2 v = make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                    *(float2*)(partial + ((long long)blockIdx.y * m + r) * n +
                               blockIdx.x * 128 + warp * 16 + 8 * j + 2 * tig) = v;
                }
            }

    if (FINISH) finish_band<MT == 1>(partial, counters, sp, y, ldy, n, m);
}

// mma_layer at the bitrate of this block's part (block_part computed inside each rate's branch:
// computed before it and held across the branches, the part's fields spilled).
template <int MT, bool FULL>
__device__ __forceinline__ void mma_part(PART_PARAMS, unsigned short* __restrict__ xs, Part& sp,
                                         const void* __restrict__ x, int x_bf16, int ldx, int cols,
                                         const unsigned short* __restrict__ xh_pre,
                                         float* __restrict__ partial, u32* __restrict__ counters,
                                         float* __restrict__ y, int ldy, int tiles_k,
                                         int tk_per_split, int m) {
#define MMA_AT(TW)                                                                                \
    mma_layer<TW, MT, FULL, !EXL3_MIXED>(block_part(PART_ARGS), xs, sp, x, x_bf16, ldx, cols,     \
                                         xh_pre, partial, counters, y, ldy, tiles_k,              \
                                         tk_per_split, m)
    AT_PART_RATE(part_twice(block_index(bands0, bands1)), MMA_AT);
#undef MMA_AT
    if (EXL3_MIXED)
        finish_band<!FULL || MT == 1>(partial, counters, sp, y, ldy, (long long)gridDim.x * 128, m);
}

#define EXL3_MMA(name, MT, FULL, MIN_BLOCKS)                                                      \
    extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS)                                 \
        name(PART_PARAMS, const void* __restrict__ x, int x_bf16, int ldx, int cols,              \
             const unsigned short* __restrict__ xh_pre, float* __restrict__ partial,              \
             u32* __restrict__ counters, float* __restrict__ y, int ldy, int tiles_k,             \
             int tk_per_split, int m) {                                                           \
        __shared__ __align__(16) unsigned short xs[XS_HALVES];                                    \
        __shared__ Part sp;                                                                       \
        mma_part<MT, FULL>(PART_NAMES, xs, sp, x, x_bf16, ldx, cols, xh_pre, partial, counters, y, ldy,    \
                           tiles_k, tk_per_split, m);                                             \
    }
// The one-tile kernels bounded for MMA_MIN_BLOCKS blocks per SM; the wider ones' accumulators
// need more registers than that leaves (they would spill). The 32-row kernel fits 80 registers
// (3 blocks an SM) except at K = 8 or with parts at different rates, where that spills.
#define MMA32_MIN_BLOCKS (EXL3_TWICE >= 16 || EXL3_MIXED ? 2 : 3)
EXL3_MMA(exl3_mma8, 1, false, MMA_MIN_BLOCKS)
EXL3_MMA(exl3_mma16, 1, true, MMA_MIN_BLOCKS)
EXL3_MMA(exl3_mma32, 2, true, MMA32_MIN_BLOCKS)
EXL3_MMA(exl3_mma64, 4, true, 1)

// The fast path (MUL1 only): one row's whole layer in one launch, as exllamav3's default int8
// GEMV computes it. Prologue: the block rotates its split's inputs, xq = H128(x * suh) as int8
// with one scale per 128-block (qs = max |v| / 127), into shared memory, each input's byte
// repeated four times (a splat) and each 16-input group in xs_pos order, so one 128-bit load
// gives a lane the splats of its four inputs of a tile. A MUL1 weight is affine in the byte sum s
// of its state's product, w ~ A s + B (A = 1774 / 2^18, B = 1024 A - 1329 / 128; the codec
// rounds that to fp16, this path does not), so one dp4a of the product's bytes against the
// splat gives s * xq, summed as integers over a 128-block's tiles (at most 4.1M: exact in f32),
// and
//   sum_k w_k x_k ~ sum_blocks qs[b] (A sum_k s_k xq_k + B sum_k xq_k),
// the second sum (qx[b] = qs[b] sum_k xq_k) taken once in the prologue. Tiles are streamed as in
// the tensor-core GEMV (stream_tiles); lane L sums inputs 2(L&3) + {0, 1, 8, 9} of columns L/4
// and L/4 + 8 of its warp's tile column. Epilogue: finish_band. Grid (n / 128, splits), 8 warps;
// a split is at most Q8_INPUTS inputs (exl3::Q8_PER_MAX tile rows). Other codebooks have no such
// form and never launch it. Its parameters are the tensor-core kernels' (one launcher), for one
// row (m = 1).
#define MUL1_A (1774.0f / 262144.0f)
#define MUL1_B (1024.0f * (1774.0f / 262144.0f) - 1329.0f / 128.0f)
#define Q8_INPUTS 11904
// FINISH as mma_layer's.
template <int TW, bool FINISH>
__device__ __forceinline__ void q8_layer(const Part& p, u32* __restrict__ xq,
                                         float* __restrict__ qs, float* __restrict__ qx, Part& sp,
                                         const void* __restrict__ x, int x_bf16, int ldx, int cols,
                                         float* __restrict__ partial, u32* __restrict__ counters,
                                         float* __restrict__ y, int ldy, int tiles_k,
                                         int tk_per_split) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tn = p.band * EXL3_WARPS + warp;
    // The part's epilogue fields wait in shared memory, not in registers, through the main loop
    // (written before the prologue's barrier).
    if (threadIdx.x == 0) sp = p;
    const int tk0 = blockIdx.y * tk_per_split;
    const int tk1 = min(tk0 + tk_per_split, tiles_k);
    const int kw = 16 * (tk1 - tk0);
    const long long n = (long long)gridDim.x * 128;
    const auto prologue = [&]() {
        for (int b = warp; b < kw / 128; b += EXL3_WARPS) {
            float v[4];
            rotate_in(x, x_bf16, ldx, cols, p.suh, 0, 16 * tk0 + 128 * b + 4 * lane, lane, v);
            const float amax =
                warp_max(fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int q[4], sum = 0;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                q[i] = max(-127, min(127, __float2int_rn(v[i] * inv)));
                sum += q[i];
            }
            // Inputs 4 lane .. 4 lane + 3: two pairs, each whole in xs_pos order.
            u32* group = &xq[128 * b + 16 * (lane >> 2)];
            const int i0 = 4 * (lane & 3);
            *(uint2*)&group[xs_pos(i0)] =
                make_uint2(((u32)q[0] & 0xffu) * 0x01010101u, ((u32)q[1] & 0xffu) * 0x01010101u);
            *(uint2*)&group[xs_pos(i0 + 2)] =
                make_uint2(((u32)q[2] & 0xffu) * 0x01010101u, ((u32)q[3] & 0xffu) * 0x01010101u);
#pragma unroll
            for (int m = 16; m > 0; m >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, m);
            if (lane == 0) {
                qs[b] = amax / 127.0f;
                qx[b] = (amax / 127.0f) * (float)sum;
            }
        }
        __syncthreads();
    };

    const LaneWords<TW> g = lane_words<TW>(lane);
    const long long stride = (long long)p.tiles_n * Rate<TW>::TILE_WORDS;
    const u32* tl = p.trellis + ((long long)tk0 * p.tiles_n + tn) * Rate<TW>::TILE_WORDS + lane;
    const u32* xl = xq + 4 * (lane & 3);
    float acc0 = 0.0f, acc1 = 0.0f;
    int d0 = 0, d1 = 0;
    stream_tiles<TW>(
        tl, stride, tk0, tk1, g, prologue,
        [&](const u32 (&cur)[Rate<TW>::NLOAD], int tk) {
            u32 st[8];
            states8<TW>(cur, g.shift, st);
            // The splats of inputs 2(L&3) + {0, 1, 8, 9}: decode8's positions j and j + 4.
            const uint4 xs4 = *(const uint4*)&xl[16 * (tk - tk0)];
            const u32 splat[4] = {xs4.x, xs4.y, xs4.z, xs4.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(d0) : "r"(st[j] * 0x83DCD12Du), "r"(splat[j]));
                asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(d1) : "r"(st[4 + j] * 0x83DCD12Du), "r"(splat[j]));
            }
        },
        [&](int tk) {
            const float q = qs[(tk - tk0) >> 3];
            acc0 = fmaf(q, (float)d0, acc0);
            acc1 = fmaf(q, (float)d1, acc1);
            d0 = d1 = 0;
        });
    float accx = 0.0f;
    for (int b = 0; b < kw / 128; b++) accx += qx[b];
    // The 4 lanes of a column, in a fixed order.
#pragma unroll
    for (int m = 1; m <= 2; m <<= 1) {
        acc0 += __shfl_xor_sync(FULL_MASK, acc0, m);
        acc1 += __shfl_xor_sync(FULL_MASK, acc1, m);
    }
    if ((lane & 3) == 0) {
        float* o = partial + (long long)blockIdx.y * n + blockIdx.x * 128 + warp * 16 + (lane >> 2);
        o[0] = fmaf(MUL1_A, acc0, MUL1_B * accx);
        o[8] = fmaf(MUL1_A, acc1, MUL1_B * accx);
    }
    if (FINISH) finish_band<true>(partial, counters, sp, y, ldy, n, 1);
}

extern "C" __global__ void __launch_bounds__(256, MMA_MIN_BLOCKS)
exl3_q8(PART_PARAMS, const void* __restrict__ x, int x_bf16, int ldx, int cols,
        const unsigned short* __restrict__ xh_pre /* unused: one launcher */,
        float* __restrict__ partial, u32* __restrict__ counters, float* __restrict__ y, int ldy,
        int tiles_k, int tk_per_split, int m) {
#if EXL3_CB == 2
    __shared__ __align__(16) u32 xq[Q8_INPUTS];
    __shared__ float qs[Q8_INPUTS / 128], qx[Q8_INPUTS / 128];
    __shared__ Part sp;
#define Q8_AT(TW)                                                                              \
    q8_layer<TW, !EXL3_MIXED>(block_part(PART_ARGS), xq, qs, qx, sp, x, x_bf16, ldx, cols,      \
                              partial, counters, y, ldy, tiles_k, tk_per_split)
    AT_PART_RATE(part_twice(block_index(bands0, bands1)), Q8_AT);
#undef Q8_AT
    if (EXL3_MIXED) finish_band<true>(partial, counters, sp, y, ldy, (long long)gridDim.x * 128, 1);
#else
    __trap();
#endif
}

// y[r][c] = H128(sum of the splits' partials of row r)[c] * svh[c] (+ bias[c]) for c < rows, the
// m rows r = blockIdx.y; partial is [split][m][n], y has row stride ldy. One warp per 128
// outputs; blocks of 4 warps.
extern "C" __global__ void __launch_bounds__(128) exl3_out(const float* __restrict__ partial,
                                                           int splits, int n, int m,
                                                           const float* __restrict__ svh,
                                                           const float* __restrict__ bias,
                                                           float* __restrict__ y, int ldy,
                                                           int rows) {
    pdl_wait();
    const int lane = threadIdx.x & 31;
    const int blk = blockIdx.x * 4 + (threadIdx.x >> 5);
    const long long r = blockIdx.y;
    if (blk * 128 >= n) return;
    const int c0 = blk * 128 + 4 * lane;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int s = 0; s < splits; s++) {
        const float4 p = *(const float4*)(partial + ((long long)s * m + r) * n + c0);
        v[0] += p.x;
        v[1] += p.y;
        v[2] += p.z;
        v[3] += p.w;
    }
    had128(v, lane);
    const long long yo = r * ldy + c0;
    if (c0 + 3 < rows && ((u64)(y + yo) & 15) == 0) {
        // Four outputs in one store.
        const float4 s = *(const float4*)(svh + c0);
        float4 o = make_float4(__fmul_rn(v[0], s.x), __fmul_rn(v[1], s.y), __fmul_rn(v[2], s.z),
                               __fmul_rn(v[3], s.w));
        if (bias) {
            o.x = __fadd_rn(o.x, bias[c0]), o.y = __fadd_rn(o.y, bias[c0 + 1]);
            o.z = __fadd_rn(o.z, bias[c0 + 2]), o.w = __fadd_rn(o.w, bias[c0 + 3]);
        }
        *(float4*)(y + yo) = o;
        return;
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int c = c0 + i;
        if (c < rows) {
            float o = __fmul_rn(v[i], svh[c]);
            if (bias) o = __fadd_rn(o, bias[c]);
            y[yo + i] = o;
        }
    }
}

// Row and column in its tile of a lane's j-th weight in decode8's order.
__device__ __forceinline__ int frag_row(int lane, int j) {
    return 2 * (lane & 3) + (j & 1) + 8 * ((j >> 1) & 1);
}
__device__ __forceinline__ int frag_col(int lane, int j) { return (lane >> 2) + 8 * (j >> 2); }

// Tile rows each block of exl3_dequant decodes, their words loaded together (exl3::DQ_TILES).
#define DQ_TILES 4

// W_inner decoded, row-major [k][ld], columns 128 band0 .. of it from column 0: f32 (the
// exactness check) or fp16 (w_f16: the prefill GEMM's operand; every codebook value is an fp16,
// so nothing is rounded). With svh (fp16 only), each row's 128-column segments are also
// rotated and scaled, W H128 * svh rounded to fp16, which folds the output Hadamard into the
// GEMM (y = xh W H128 * svh, H128 symmetric). Grid (bands, k / (16 DQ_TILES)), 8 warps, each a
// column of DQ_TILES tiles.
extern "C" __global__ void __launch_bounds__(256) exl3_dequant(const u32* __restrict__ trellis,
                                                               void* __restrict__ w, int w_f16,
                                                               int tiles_n, int band0, int ld,
                                                               const float* __restrict__ svh) {
    constexpr int TW = EXL3_TWICE, NLOAD = Rate<TW>::NLOAD, TILE_WORDS = Rate<TW>::TILE_WORDS;
    pdl_wait();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tc = blockIdx.x * EXL3_WARPS + warp;
    const int tn = band0 * EXL3_WARPS + tc;
    const int tk0 = blockIdx.y * DQ_TILES;
    const LaneWords<TW> g = lane_words<TW>(lane);
    u32 words[DQ_TILES][NLOAD];
#pragma unroll
    for (int t = 0; t < DQ_TILES; t++)
        load_words<TW>(trellis + ((long long)(tk0 + t) * tiles_n + tn) * TILE_WORDS, g, words[t]);
    if (w_f16) {
        // The fp16 decoder (the tensor-core kernels' values), through shared memory so the band's
        // rows go out as whole 16-byte stores: a block writes 16 DQ_TILES rows x 128 columns.
        __shared__ __align__(16) unsigned short band[16 * DQ_TILES][128 + 8];
#pragma unroll
        for (int t = 0; t < DQ_TILES; t++) {
            u32 h[4];
            decode8h<TW>(words[t], g.shift, h);
#pragma unroll
            for (int j = 0; j < 8; j++)
                band[16 * t + frag_row(lane, j)][16 * warp + frag_col(lane, j)] =
                    (unsigned short)(h[j >> 1] >> (16 * (j & 1)));
        }
        __syncthreads();
        if (svh) {
            // Warp w rotates rows 2 DQ_TILES w .. (lane: columns 4 lane ..).
            const int c0 = (band0 + blockIdx.x) * 128 + 4 * lane;
            const float4 sv = *(const float4*)(svh + c0);
#pragma unroll
            for (int rr = 0; rr < 2 * DQ_TILES; rr++) {
                const int r = 2 * DQ_TILES * warp + rr;
                float v[4];
#pragma unroll
                for (int i = 0; i < 4; i++) v[i] = h2f(band[r][4 * lane + i]);
                had128(v, lane);
                v[0] = __fmul_rn(v[0], sv.x), v[1] = __fmul_rn(v[1], sv.y);
                v[2] = __fmul_rn(v[2], sv.z), v[3] = __fmul_rn(v[3], sv.w);
                *(uint2*)&band[r][4 * lane] = pack_f16x4(v);
            }
            __syncthreads();
        }
#pragma unroll
        for (int t = 0; t < DQ_TILES; t++) {
            const int row = 16 * t + (threadIdx.x >> 4), c8 = 8 * (threadIdx.x & 15);
            *(uint4*)((unsigned short*)w + (long long)(tk0 * 16 + row) * ld + blockIdx.x * 128 +
                      c8) = *(const uint4*)&band[row][c8];
        }
    } else {
#pragma unroll
        for (int t = 0; t < DQ_TILES; t++) {
            float v[8];
            decode8<TW>(words[t], g.shift, v);
#pragma unroll
            for (int j = 0; j < 8; j++)
                ((float*)w)[(long long)((tk0 + t) * 16 + frag_row(lane, j)) * ld + tc * 16 +
                            frag_col(lane, j)] = v[j];
        }
    }
}
