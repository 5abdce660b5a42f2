// Decode GEMV over bf16 weights: y = W x for one activation row, bandwidth-bound.
// One block of GEMV_THREADS computes R rows: its threads stride over the rows' 16-byte vectors
// (8 bf16), so every block streams contiguous bytes, and a block per R rows gives every matrix
// (even 4096-row ones) enough blocks to fill the chip. Each thread issues UNROLL loads per row
// before using any; partial sums are reduced over the warp, then over the block.
// Rows whose length is not a multiple of 8 take a scalar path.

#define GEMV_THREADS 128
#define GEMV_WARPS (GEMV_THREADS / 32)
// Resident blocks an SM that the one-wave GEMVs (qkv, residual) are built for: at most 40
// registers a thread.
#define GEMV_BLOCKS_PER_SM 12
#ifndef UNROLL
#define UNROLL 2
#endif

__device__ __forceinline__ float dot8(uint4 w, uint4 x) {
    float s = bflo(w.x) * bflo(x.x);
    s = fmaf(bfhi(w.x), bfhi(x.x), s);
    s = fmaf(bflo(w.y), bflo(x.y), s);
    s = fmaf(bfhi(w.y), bfhi(x.y), s);
    s = fmaf(bflo(w.z), bflo(x.z), s);
    s = fmaf(bfhi(w.z), bfhi(x.z), s);
    s = fmaf(bflo(w.w), bflo(x.w), s);
    s = fmaf(bfhi(w.w), bfhi(x.w), s);
    return s;
}

// acc[r] = row r (starting at W + off[r]) . x, reduced over the block (thread 0 gets it).
template <int R, int U = UNROLL>
__device__ __forceinline__ void block_dot(const bf16* __restrict__ W, const long long* off, int k,
                                          const bf16* __restrict__ x, float* acc) {
    __shared__ float red[R][GEMV_WARPS];
    const int tid = threadIdx.x;
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.0f;
    // The first vectors into L2 ahead of the loads (part of the configuration measured at 87% of
    // copy, H200 run 12).
    if ((k & 7) == 0) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int v = tid + u * GEMV_THREADS;
            if (v < (k >> 3))
#pragma unroll
                for (int r = 0; r < R; r++)
                    asm volatile("prefetch.global.L2 [%0];" ::"l"(W + off[r] + (long long)v * 8));
        }
    }
    if ((k & 7) == 0) {
        const int nvec = k >> 3;
        for (int v0 = tid; v0 < nvec; v0 += GEMV_THREADS * U) {
            uint4 wv[R][U], xv[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int v = v0 + u * GEMV_THREADS;
                if (v < nvec) {
#pragma unroll
                    for (int r = 0; r < R; r++) wv[r][u] = ld_stream(W + off[r] + (long long)v * 8);
                    xv[u] = ld_nc((const uint4*)(x) + v);
                } else {
                    xv[u] = make_uint4(0, 0, 0, 0);
#pragma unroll
                    for (int r = 0; r < R; r++) wv[r][u] = make_uint4(0, 0, 0, 0);
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int r = 0; r < R; r++) acc[r] += dot8(wv[r][u], xv[u]);
        }
    } else {
        for (int i = tid; i < k; i += GEMV_THREADS) {
            const float xi = bf2f(x[i]);
#pragma unroll
            for (int r = 0; r < R; r++) acc[r] = fmaf(bf2f(W[off[r] + i]), xi, acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        acc[r] = warp_sum(acc[r]);
        if ((tid & 31) == 0) red[r][tid >> 5] = acc[r];
    }
    __syncthreads();
    if (tid == 0) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            float s = 0.0f;
#pragma unroll
            for (int w = 0; w < GEMV_WARPS; w++) s += red[r][w];
            acc[r] = s;
        }
    }
}

// Deferred RMSNorm (decode): the input x holds bf16(w * v) of the residual stream v, and `ss` the
// sum of squares of v (accumulated by the producing gemv_res as an exact integer sum, see ss_add);
// the dot product times 1/sqrt(ss/n + eps) is the dot with the normalized input. Null `ss`: no
// scale. Block 0 also zeroes `zero`, the sum the next gemv_res accumulates (that kernel starts
// after this one ends).
//
// A float atomicAdd of the blocks' partial sums rounds in whatever order the blocks finish, so
// the same request gave different logits run to run. Instead each partial (>= 0) goes into
// SS_BUCKETS integer buckets by its exponent: bucket e >> 4 gets the 24-bit mantissa shifted left
// by e & 15 (at most 2^39 per add, so 2^14 blocks cannot overflow). Integer adds commute, so the
// buckets end the same whatever the order, and the total is read back in one fixed order.
#define SS_BUCKETS 16
__device__ __forceinline__ void ss_add(unsigned long long* ss, float v) {
    const unsigned bits = __float_as_uint(v);
    unsigned e = (bits >> 23) & 0xff;
    unsigned long long m = bits & 0x7fffff;
    if (e) m |= 0x800000; else e = 1;  // subnormals: m * 2^(1 - 150)
    atomicAdd(ss + (e >> 4), m << (e & 15));
}
// Warp-collective (all of warp 0 calls it; lane 0's result counts): lane b < SS_BUCKETS reads
// bucket b, which counts units of 2^(16 b - 150), scales it by that exact power of two, and the
// lanes' values are summed in a fixed shuffle tree, the same order every run. One load a lane at
// the end of the block: a serial ldexp loop in thread 0 doubled the consumers' time (H200, run
// 15: gate/up 1.9 -> 3.7 ms a token).
__device__ __forceinline__ float norm_scale(const unsigned long long* ss, float inv_n, float eps,
                                            unsigned long long* zero) {
    const int lane = threadIdx.x & 31;
    if (zero && blockIdx.x == 0 && lane < SS_BUCKETS) zero[lane] = 0ull;
    if (!ss) return 1.0f;
    double t = 0.0;
    if (lane < SS_BUCKETS)
        t = (double)__ldcg(ss + lane) *
            __longlong_as_double((long long)(1023 + 16 * lane - 150) << 52);
#pragma unroll
    for (int o = SS_BUCKETS / 2; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return 1.0f / sqrtf((float)t * inv_n + eps);
}

// y[n] (f32) = W[n, k] x.  Two rows per block. (Fewer blocks striding over the rows, to avoid a
// partial last wave, were slower for this and gemv_glu: H200 run 9.)
extern "C" __global__ void __launch_bounds__(GEMV_THREADS)
gemv_f32(const bf16* __restrict__ W, int n, int k, const bf16* __restrict__ x, float* __restrict__ y,
         const unsigned long long* __restrict__ ss, float inv_n, float eps,
         unsigned long long* __restrict__ zero) {
    const int row = blockIdx.x * 2;
    long long off[2] = {(long long)row * k, (long long)min(row + 1, n - 1) * k};
    float acc[2];
    block_dot<2>(W, off, k, x, acc);
    if (threadIdx.x >= 32) return;
    const float sc = norm_scale(ss, inv_n, eps, zero);
    if (threadIdx.x == 0) {
        y[row] = acc[0] * sc;
        if (row + 1 < n) y[row + 1] = acc[1] * sc;
    }
}

// Gated MLP: W [2*ff, k] holds gate rows then up rows; out[i] = act(g_i + bg_i) * (u_i + bu_i) as
// bf16, the gate and up rows of one output in the same block.
extern "C" __global__ void __launch_bounds__(GEMV_THREADS)
gemv_glu(const bf16* __restrict__ W, int ff, int k, const bf16* __restrict__ x,
         const float* __restrict__ bias, int act, bf16* __restrict__ out,
         const unsigned long long* __restrict__ ss, float inv_n, float eps,
         unsigned long long* __restrict__ zero) {
    const int i = blockIdx.x;
    long long off[2] = {(long long)i * k, (long long)(ff + i) * k};
    float acc[2];
    block_dot<2>(W, off, k, x, acc);
    if (threadIdx.x >= 32) return;
    const float sc = norm_scale(ss, inv_n, eps, zero);
    if (threadIdx.x == 0) {
        float g = acc[0] * sc, u = acc[1] * sc;
        if (bias) { g += bias[i]; u += bias[ff + i]; }
        out[i] = f2bf(activate(g, act) * u);
    }
}

// Plain MLP: out[i] = act(W_i . x + b_i) as bf16, two rows per block.
extern "C" __global__ void __launch_bounds__(GEMV_THREADS)
gemv_act(const bf16* __restrict__ W, int n, int k, const bf16* __restrict__ x,
         const float* __restrict__ bias, int act, bf16* __restrict__ out,
         const unsigned long long* __restrict__ ss, float inv_n, float eps,
         unsigned long long* __restrict__ zero) {
    const int row = blockIdx.x * 2;
    long long off[2] = {(long long)row * k, (long long)min(row + 1, n - 1) * k};
    float acc[2];
    block_dot<2>(W, off, k, x, acc);
    if (threadIdx.x >= 32) return;
    const float sc = norm_scale(ss, inv_n, eps, zero);
    if (threadIdx.x == 0) {
        out[row] = f2bf(activate(acc[0] * sc + (bias ? bias[row] : 0.0f), act));
        if (row + 1 < n)
            out[row + 1] = f2bf(activate(acc[1] * sc + (bias ? bias[row + 1] : 0.0f), act));
    }
}

// Decode's qkv projection with the rope kernel's work in its epilogue (models without q/k norms):
// each block computes the rows of QKV_PAIRS rotary pairs (or pairs of plain rows), adds biases,
// rotates q and k at position pos[0], scales q into q_out (f32) and writes k and v into the
// cache (bf16). Blocks: ceil((n_heads + 2 n_kv) * hd / 2 / QKV_PAIRS), rows of W ordered q heads,
// k heads, v heads. Two pairs a block, one vector a row in flight and at most 40 registers (12
// blocks an SM) keep Llama's 6144 rows in one wave of resident blocks on an H200.
#define QKV_PAIRS 2
extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_BLOCKS_PER_SM)
gemv_qkv_rope(const bf16* __restrict__ W, int k, const bf16* __restrict__ x,
              const float* __restrict__ bias, const int* __restrict__ pos, int n_heads, int n_kv,
              int hd, const float* __restrict__ inv_freq, int rot, int interleaved,
              float pos_scale, float in_scale, float q_scale, float* __restrict__ q_out,
              bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
              const unsigned long long* __restrict__ ss, float inv_n, float eps,
              unsigned long long* __restrict__ zero, const int* __restrict__ tables,
              const int* __restrict__ table_off, int bs) {
    const int half_hd = hd >> 1;
    const int n_pairs = (n_heads + 2 * n_kv) * half_hd;
    const int half = inv_freq ? rot / 2 : 0;
    int head[QKV_PAIRS], j[QKV_PAIRS], a[QKV_PAIRS], b[QKV_PAIRS];
    long long off[2 * QKV_PAIRS];
#pragma unroll
    for (int q = 0; q < QKV_PAIRS; q++) {
        const int pair = min(blockIdx.x * QKV_PAIRS + q, n_pairs - 1);
        head[q] = pair / half_hd;
        j[q] = pair % half_hd;
        if (j[q] < half) {
            a[q] = interleaved ? 2 * j[q] : j[q];
            b[q] = interleaved ? 2 * j[q] + 1 : j[q] + half;
        } else {
            a[q] = 2 * half + 2 * (j[q] - half);
            b[q] = a[q] + 1;
        }
        off[2 * q] = (long long)(head[q] * hd + a[q]) * k;
        off[2 * q + 1] = (long long)(head[q] * hd + b[q]) * k;
    }
    float acc[2 * QKV_PAIRS];
    // One vector a row in flight per thread (not UNROLL): the registers stay low enough for the
    // whole grid to be resident at once.
    block_dot<2 * QKV_PAIRS, 1>(W, off, k, x, acc);
    if (threadIdx.x >= 32) return;
    const float sc = norm_scale(ss, inv_n, eps, zero);
    if (threadIdx.x != 0) return;
    const int p = pos[0];
#pragma unroll
    for (int q = 0; q < QKV_PAIRS; q++) {
        if (blockIdx.x * QKV_PAIRS + q >= n_pairs) break;
        const bool is_v = head[q] >= n_heads + n_kv;
        const int ra = head[q] * hd + a[q], rb = head[q] * hd + b[q];
        float x1 = acc[2 * q] * sc + (bias ? bias[ra] : 0.0f);
        float x2 = acc[2 * q + 1] * sc + (bias ? bias[rb] : 0.0f);
        if (!is_v && j[q] < half) {
            float sn, cs;
            rope_sincos((float)p * pos_scale * inv_freq[j[q]], &sn, &cs);
            const float y1 = x1 * in_scale, y2 = x2 * in_scale;
            x1 = y1 * cs - y2 * sn;
            x2 = y1 * sn + y2 * cs;
        }
        if (head[q] < n_heads) {
            q_out[ra] = x1 * q_scale;
            q_out[rb] = x2 * q_scale;
        } else {
            const int kvh = is_v ? head[q] - n_heads - n_kv : head[q] - n_heads;
            bf16* c = (is_v ? v_cache : k_cache) +
                      (kv_slot(tables, table_off, 0, p, bs) * n_kv + kvh) * hd;
            c[a[q]] = f2bf(x1);
            c[b[q]] = f2bf(x2);
        }
    }
}

// A projection that feeds the residual stream (decode, no bias, no post-norm), with the residual
// add in its epilogue and no serial tail: each block owns RES_ROWS rows, x[row] += rscale *
// (W xin)[row] (f32), writes xz[row] = bf16(nw[row] * x[row]) (a copy without nw) and adds its
// rows' squares into the buckets at ss (ss_add); the next GEMV scales its dot products by
// 1/sqrt(ss / n + eps) (norm_scale), which finishes the RMSNorm. The buckets are zeroed by the
// GEMV before this one. Four rows
// a block, one vector a row in flight and at most 40 registers keep a 4096-row matrix in one
// wave of resident blocks (with two rows a block, 2048 blocks took 1.3 waves).
#define RES_ROWS 4
extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_BLOCKS_PER_SM)
gemv_res(const bf16* __restrict__ W, int n, int k, const bf16* __restrict__ xin,
         float* __restrict__ x, float rscale, const float* __restrict__ nw, bf16* __restrict__ xz,
         unsigned long long* __restrict__ ss) {
    const int row = blockIdx.x * RES_ROWS;
    long long off[RES_ROWS];
#pragma unroll
    for (int r = 0; r < RES_ROWS; r++) off[r] = (long long)min(row + r, n - 1) * k;
    float acc[RES_ROWS];
    block_dot<RES_ROWS, 1>(W, off, k, xin, acc);
    if (threadIdx.x == 0) {
        float sq = 0.0f;
#pragma unroll
        for (int r = 0; r < RES_ROWS; r++) {
            const int i = row + r;
            if (i < n) {
                const float v = x[i] + acc[r] * rscale;
                x[i] = v;
                xz[i] = f2bf(nw ? nw[i] * v : v);
                sq = fmaf(v, v, sq);
            }
        }
        if (ss) ss_add(ss, sq);
    }
}

// Decode GEMM for a few activation rows (a small batch of decode tokens):
//   y[m][n] (f32) = x[m][k] (bf16) . W[n][k]^T,  2 <= m <= 8,
// on tensor cores with the weights as the A operand (mma.m16n8k16: 16 outputs x 8 rows a tile),
// so every weight is read once for all rows and streamed as the one-row GEMV streams it. Inside a
// chunk of 64 inputs the order of k is permuted, alike for both operands (a dot product does not
// care): lane (grp, tig) holds inputs 16 tig .. 16 tig + 15 of its rows, two contiguous 16-byte
// loads, and mma q of the chunk takes its pairs 4q, 4q + 1 (k 2 tig, 2 tig + 1 of the fragment)
// and 4q + 2, 4q + 3 (k 2 tig + 8, 2 tig + 9). A block's ROWS8_WARPS warps take interleaved
// chunks of the same 16 outputs and are summed in shared memory in warp order, so runs are
// bit-identical. k must be a multiple of 8; rows past n and m are clamped on load, not stored.
// More rows measured slower than cuBLAS (H200, 2026-12-01: x is reread from L2 for every 16
// outputs, twice the weights' bytes at 32 rows; staging x in shared memory for 128 outputs a
// block was slower still), so cuBLAS takes them.
#define ROWS8_WARPS 8
#define ROWS8_CHUNK 64

__device__ __forceinline__ u32 word_of(const uint4& v, int s) {
    return s == 0 ? v.x : s == 1 ? v.y : s == 2 ? v.z : v.w;
}

extern "C" __global__ void __launch_bounds__(ROWS8_WARPS * 32)
gemm_rows8(const bf16* __restrict__ W, const bf16* __restrict__ x, float* __restrict__ y, int n,
           int k, int m) {
    // Per warp: [row of x][output], each row padded by 4 so the fragment stores hit 32 banks.
    constexpr int RS = 16 + 4;
    __shared__ float red[ROWS8_WARPS][8 * RS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int grp = lane >> 2, tig = lane & 3;
    const int row0 = blockIdx.x * 16;
    const bf16* wp[2];
#pragma unroll
    for (int h = 0; h < 2; h++)
        wp[h] = W + (long long)min(row0 + grp + 8 * h, n - 1) * k + 16 * tig;
    const bf16* xp = x + (long long)min(grp, m - 1) * k + 16 * tig;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int chunks = (k + ROWS8_CHUNK - 1) / ROWS8_CHUNK;
    // Whether this lane's vector u of chunk c lies inside the row.
    const auto inside = [&](int c, int u) { return c * ROWS8_CHUNK + 16 * tig + 8 * u + 8 <= k; };
    const auto load = [&](int c, uint4 (&w)[2][2]) {
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const bool ok = c < chunks && inside(c, u);
#pragma unroll
            for (int h = 0; h < 2; h++)
                w[h][u] = ok ? ld_stream(wp[h] + c * ROWS8_CHUNK + 8 * u) : make_uint4(0, 0, 0, 0);
        }
    };
    const auto step = [&](int c, const uint4 (&w)[2][2]) {
        uint4 xv[2];
#pragma unroll
        for (int u = 0; u < 2; u++)
            xv[u] = inside(c, u) ? ld_nc(xp + c * ROWS8_CHUNK + 8 * u) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int u = q >> 1, s = 2 * (q & 1);
            mma_bf16(acc, word_of(w[0][u], s), word_of(w[1][u], s), word_of(w[0][u], s + 1),
                     word_of(w[1][u], s + 1), word_of(xv[u], s), word_of(xv[u], s + 1));
        }
    };
    // Two chunks in turn, one in flight while the other is multiplied.
    uint4 wa[2][2], wb[2][2];
    load(warp, wa);
    for (int c = warp; c < chunks; c += 2 * ROWS8_WARPS) {
        load(c + ROWS8_WARPS, wb);
        step(c, wa);
        load(c + 2 * ROWS8_WARPS, wa);
        if (c + ROWS8_WARPS < chunks) step(c + ROWS8_WARPS, wb);
    }
    // D fragment: d0, d1 at output grp, rows 2 tig + {0, 1}; d2, d3 at output grp + 8.
#pragma unroll
    for (int e = 0; e < 4; e++) red[warp][(2 * tig + (e & 1)) * RS + grp + 8 * (e >> 1)] = acc[e];
    __syncthreads();
    if (threadIdx.x < 8 * 16) {
        const int t = threadIdx.x >> 4, c = threadIdx.x & 15;
        if (t < m && row0 + c < n) {
            float s = 0.0f;
#pragma unroll
            for (int w = 0; w < ROWS8_WARPS; w++) s += red[w][t * RS + c];
            y[(long long)t * n + row0 + c] = s;
        }
    }
}
