// EXL3 trellis linear layers, exact path, one activation row:
//   y = (H128(H128(x * suh) W_inner) * svh + bias)[..rows]
// W_inner is stored as 16x16 tail-biting tiles, int16 [k/16][n/16][16 K] (crates/quant/src/exl3,
// the CPU twin every kernel here is checked against). One module per codebook (EXL3_CB: 0 = 3INST,
// 1 = MCG, 2 = MUL1) and bitrate (EXL3_TWICE = 2 K: 2..16 even, or 3/5/7 for 1.5/2.5/3.5), so the
// bit positions below are compile-time constants.
//
// Three launches: exl3_in (x * suh, H128 -> xh), exl3_gemv (decode in registers, f32 partial sums
// over a k-split), exl3_out (the partial sums in a fixed order, H128, * svh, + bias). The split is
// summed in order, never with atomics, so runs are bit-identical.
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

#define KA (EXL3_TWICE / 2)
#define HALF_RATE (EXL3_TWICE & 1)
#define TILE_BITS (128 * EXL3_TWICE)
#define TILE_WORDS (TILE_BITS / 32)
#define EXL3_WARPS 8

// One past the last stream bit of position p (half rates: odd positions carry one more bit).
__host__ __device__ constexpr int end_bit(int p) {
    return (p + 1) * KA + (HALF_RATE ? (p + 1) / 2 : 0);
}
// Offset of lane-position j's window from the lane's first window (the same for every lane:
// end_bit(8L + j) - end_bit(8L)).
__host__ __device__ constexpr int pos_off(int j) { return j * KA + (HALF_RATE ? (j + 1) / 2 : 0); }
// Start of lane L's first 16-bit window, in [0, TILE_BITS) (circular).
__host__ __device__ constexpr int lane_start(int lane) {
    return (end_bit(8 * lane) - 16 + TILE_BITS) % TILE_BITS;
}
// Words each lane loads: enough for its 8 windows from its (unaligned) start, the most any lane
// needs.
__host__ __device__ constexpr int lane_loads() {
    int m = 0;
    for (int l = 0; l < 32; l++) {
        const int need = ((lane_start(l) & 31) + pos_off(7) + 16 + 31) / 32;
        m = need > m ? need : m;
    }
    return m;
}
#define NLOAD (lane_loads())
// Aligned words the 8 windows span.
#define NALIGN ((pos_off(7) + 16 + 31) / 32)

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

// Lane geometry: which tile words it loads, and its shift to its first window.
struct LaneWords {
    int idx[NLOAD];
    int shift;
};
__device__ __forceinline__ LaneWords lane_words(int lane) {
    LaneWords g;
    const int s0 = lane_start(lane);
#pragma unroll
    for (int i = 0; i < NLOAD; i++) {
        int w = (s0 >> 5) + i;
        g.idx[i] = w >= TILE_WORDS ? w - TILE_WORDS : w;
    }
    g.shift = s0 & 31;
    return g;
}

__device__ __forceinline__ void load_words(const u32* __restrict__ tile, const LaneWords& g,
                                           u32 (&w)[NLOAD]) {
#pragma unroll
    for (int i = 0; i < NLOAD; i++) w[i] = __ldg(tile + g.idx[i]);
}

// The lane's 8 weights (positions 8L..8L+7) from its loaded words.
__device__ __forceinline__ void decode8(const u32 (&w)[NLOAD], int shift, float (&v)[8]) {
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
        const int o = pos_off(j), q = o >> 5, r = o & 31;
        const u32 st = __funnelshift_l(a[q + 1], a[q], r) >> 16;
        v[j] = codebook(st);
    }
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

// xh = H128(x * suh), x zero-extended from `cols` to `k` (the model's padding to 128s). One warp
// per 128-block; blocks of 4 warps.
extern "C" __global__ void __launch_bounds__(128) exl3_in(const float* __restrict__ x, int cols,
                                                          const float* __restrict__ suh,
                                                          float* __restrict__ xh, int k) {
    const int lane = threadIdx.x & 31;
    const int blk = blockIdx.x * 4 + (threadIdx.x >> 5);
    if (blk * 128 >= k) return;
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int c = blk * 128 + 4 * lane + i;
        v[i] = c < cols ? __fmul_rn(x[c], suh[c]) : 0.0f;
    }
    had128(v, lane);
#pragma unroll
    for (int i = 0; i < 4; i++) xh[blk * 128 + 4 * lane + i] = v[i];
}

// partial[split][n]: sum over the split's tile rows of xh . W_inner. Grid (n / 128, splits),
// 8 warps a block; warp w takes tile column 8 blockIdx.x + w, so a block reads 8 adjacent tiles
// (contiguous bytes) per tile row. Lane L holds rows 2(L&3) + {0, 1, 8, 9} of columns L/4 and
// L/4 + 8 (the mma B-fragment order of the positions).
extern "C" __global__ void __launch_bounds__(256) exl3_gemv(const u32* __restrict__ trellis,
                                                            const float* __restrict__ xh,
                                                            float* __restrict__ partial,
                                                            int tiles_k, int tiles_n,
                                                            int tk_per_split) {
    const int lane = threadIdx.x & 31;
    const int tn = blockIdx.x * EXL3_WARPS + (threadIdx.x >> 5);
    const int tk0 = blockIdx.y * tk_per_split;
    const int tk1 = min(tk0 + tk_per_split, tiles_k);
    const LaneWords g = lane_words(lane);
    const int row0 = 2 * (lane & 3);
    const long long stride = (long long)tiles_n * TILE_WORDS;
    const u32* t = trellis + ((long long)tk0 * tiles_n + tn) * TILE_WORDS;
    float acc0 = 0.0f, acc1 = 0.0f;
    u32 cur[NLOAD];
    if (tk0 < tk1) load_words(t, g, cur);
    for (int tk = tk0; tk < tk1; tk++) {
        // The next tile's words in flight while this one decodes.
        u32 nxt[NLOAD];
        if (tk + 1 < tk1) load_words(t + stride, g, nxt);
        t += stride;
        float v[8];
        decode8(cur, g.shift, v);
        const float2 xa = __ldg((const float2*)(xh + 16 * tk + row0));
        const float2 xb = __ldg((const float2*)(xh + 16 * tk + row0 + 8));
        acc0 = fmaf(xa.x, v[0], acc0);
        acc0 = fmaf(xa.y, v[1], acc0);
        acc0 = fmaf(xb.x, v[2], acc0);
        acc0 = fmaf(xb.y, v[3], acc0);
        acc1 = fmaf(xa.x, v[4], acc1);
        acc1 = fmaf(xa.y, v[5], acc1);
        acc1 = fmaf(xb.x, v[6], acc1);
        acc1 = fmaf(xb.y, v[7], acc1);
#pragma unroll
        for (int i = 0; i < NLOAD; i++) cur[i] = nxt[i];
    }
    // The 4 lanes of a column, in a fixed order.
    acc0 += __shfl_xor_sync(FULL_MASK, acc0, 1);
    acc1 += __shfl_xor_sync(FULL_MASK, acc1, 1);
    acc0 += __shfl_xor_sync(FULL_MASK, acc0, 2);
    acc1 += __shfl_xor_sync(FULL_MASK, acc1, 2);
    if ((lane & 3) == 0) {
        const long long n = (long long)tiles_n * 16;
        float* p = partial + blockIdx.y * n + tn * 16 + (lane >> 2);
        p[0] = acc0;
        p[8] = acc1;
    }
}

// y[c] = H128(sum of the splits' partials)[c] * svh[c] (+ bias[c]) for c < rows. One warp per
// 128 outputs; blocks of 4 warps.
extern "C" __global__ void __launch_bounds__(128) exl3_out(const float* __restrict__ partial,
                                                           int splits, int n,
                                                           const float* __restrict__ svh,
                                                           const float* __restrict__ bias,
                                                           float* __restrict__ y, int rows) {
    const int lane = threadIdx.x & 31;
    const int blk = blockIdx.x * 4 + (threadIdx.x >> 5);
    if (blk * 128 >= n) return;
    const int c0 = blk * 128 + 4 * lane;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int s = 0; s < splits; s++) {
        const float4 p = *(const float4*)(partial + (long long)s * n + c0);
        v[0] += p.x;
        v[1] += p.y;
        v[2] += p.z;
        v[3] += p.w;
    }
    had128(v, lane);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int c = c0 + i;
        if (c < rows) {
            float o = __fmul_rn(v[i], svh[c]);
            if (bias) o = __fadd_rn(o, bias[c]);
            y[c] = o;
        }
    }
}

// W_inner decoded to f32, row-major [k][n]: the exactness check of the decode (and the first
// step of a prefill path). Grid (n / 128, k / 16), 8 warps, one tile each.
extern "C" __global__ void __launch_bounds__(256) exl3_dequant(const u32* __restrict__ trellis,
                                                               float* __restrict__ w,
                                                               int tiles_n) {
    const int lane = threadIdx.x & 31;
    const int tn = blockIdx.x * EXL3_WARPS + (threadIdx.x >> 5);
    const int tk = blockIdx.y;
    const LaneWords g = lane_words(lane);
    u32 words[NLOAD];
    load_words(trellis + ((long long)tk * tiles_n + tn) * TILE_WORDS, g, words);
    float v[8];
    decode8(words, g.shift, v);
    const long long n = (long long)tiles_n * 16;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int row = 2 * (lane & 3) + (j & 1) + 8 * ((j >> 1) & 1);
        const int col = (lane >> 2) + 8 * (j >> 2);
        w[(long long)(tk * 16 + row) * n + tn * 16 + col] = v[j];
    }
}
