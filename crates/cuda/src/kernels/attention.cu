// Attention over the KV cache, flash-decoding style: each block takes one kv head, a tile of
// query rows (token x head of that kv head's group, so K/V tiles are shared by the whole GQA
// group) and one split of the key range; it writes unnormalized partial results (acc, max, sum)
// that attn_combine merges. Used for decode (one token, many splits) and prefill (many tokens).
// Rows attend to keys [lo, pos] with lo = pos + 1 - window (sliding windows) or 0.
// HEAD_DIM is fixed per model at compile time (-DHEAD_DIM=...).

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#define HD HEAD_DIM
#define ATT_WARPS 4
#define RPW 1                       // query rows per warp
#define ATT_ROWS (ATT_WARPS * RPW)  // query rows per block
#define KT 32                       // keys per tile: one per lane
#define KW (HD / 2 + 1)             // words per K row in shared memory (padded: no bank conflicts)
#define VW (HD / 2)                 // words per V row
#define VPL ((VW + 31) / 32)        // V words per lane

extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
attn_partial(const float* __restrict__ q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,
             const int* __restrict__ pos, int m, int n_heads, int n_kv, int window, float softcap,
             int chunk, int n_splits, float* __restrict__ part_acc, float* __restrict__ part_ml,
             bf16* __restrict__ out, int* __restrict__ counters) {
    GRID_SYNC();
    __shared__ float qs[ATT_ROWS][HD];
    __shared__ u32 ks[KT * KW];
    __shared__ __align__(16) u32 vs[KT * VW];
    __shared__ int row_lo[ATT_ROWS], row_hi[ATT_ROWS];

    const int kvh = blockIdx.x, split = blockIdx.z;
    const int group = n_heads / n_kv;
    const int n_rows = m * group;
    const int r0 = blockIdx.y * ATT_ROWS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // chunk > 0: split s takes keys [s * chunk, (s + 1) * chunk). chunk == 0 (decode, one token):
    // the splits share the keys this token sees, in whole tiles, so the grid stays sized to the
    // chip while each block's work follows the actual context.
    int s_lo;
    if (chunk > 0) {
        s_lo = split * chunk;
    } else {
        const int p = pos[m - 1];
        const int base = window > 0 ? max(p + 1 - window, 0) : 0;
        chunk = ((p + 1 - base + n_splits - 1) / n_splits + KT - 1) / KT * KT;
        s_lo = base + split * chunk;
    }
    const int s_hi = s_lo + chunk - 1;

    // Each row's key range, clipped to this split.
    if (threadIdx.x < ATT_ROWS) {
        const int r = r0 + threadIdx.x;
        int lo = 1, hi = 0;  // empty
        if (r < n_rows) {
            const int p = pos[r / group];
            lo = window > 0 ? max(p + 1 - window, 0) : 0;
            hi = p;
            lo = max(lo, s_lo);
            hi = min(hi, s_hi);
        }
        row_lo[threadIdx.x] = lo;
        row_hi[threadIdx.x] = hi;
    }
    for (int i = threadIdx.x; i < ATT_ROWS * HD; i += blockDim.x) {
        const int rr = i / HD, d = i % HD, r = r0 + rr;
        float v = 0.0f;
        if (r < n_rows) {
            const int t = r / group, h = kvh * group + r % group;
            v = q[((long long)t * n_heads + h) * HD + d];
        }
        qs[rr][d] = v;
    }
    __syncthreads();
    int k_begin = 0x7fffffff, k_end = -1;
    for (int rr = 0; rr < ATT_ROWS; rr++) {
        if (row_lo[rr] <= row_hi[rr]) {
            k_begin = min(k_begin, row_lo[rr]);
            k_end = max(k_end, row_hi[rr]);
        }
    }

    float mx[RPW], l[RPW], acc[RPW][VPL][2];
#pragma unroll
    for (int j = 0; j < RPW; j++) {
        mx[j] = NEG_INF;
        l[j] = 0.0f;
#pragma unroll
        for (int v = 0; v < VPL; v++) acc[j][v][0] = acc[j][v][1] = 0.0f;
    }

    for (int k0 = k_begin; k0 <= k_end; k0 += KT) {
        __syncthreads();
        for (int i = threadIdx.x; i < KT * (HD / 8); i += blockDim.x) {
            const int kk = i / (HD / 8), c = i % (HD / 8), key = k0 + kk;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (key <= k_end) {
                const long long g = ((long long)key * n_kv + kvh) * HD + c * 8;
                kv = *(const uint4*)(kc + g);
                vv = *(const uint4*)(vc + g);
            }
            u32* kd = ks + kk * KW + c * 4;
            kd[0] = kv.x; kd[1] = kv.y; kd[2] = kv.z; kd[3] = kv.w;
            *(uint4*)(vs + kk * VW + c * 4) = vv;
        }
        __syncthreads();
        const int key = k0 + lane;
#pragma unroll
        for (int j = 0; j < RPW; j++) {
            const int rr = warp * RPW + j;
            const int lo = row_lo[rr], hi = row_hi[rr];
            if (lo > hi || k0 > hi || k0 + KT - 1 < lo) continue;  // warp-uniform
            const u32* kr = ks + lane * KW;
            float s = 0.0f;
#pragma unroll 8
            for (int w = 0; w < HD / 2; w++) {
                const u32 kw = kr[w];
                s = fmaf(qs[rr][2 * w], bflo(kw), s);
                s = fmaf(qs[rr][2 * w + 1], bfhi(kw), s);
            }
            if (softcap > 0.0f) s = tanhf(s / softcap) * softcap;
            const bool valid = key >= lo && key <= hi;
            s = valid ? s : NEG_INF;
            const float m_new = fmaxf(mx[j], warp_max(s));
            const float p = valid ? expf(s - m_new) : 0.0f;
            const float alpha = expf(mx[j] - m_new);  // 0 when mx was -inf
            l[j] = l[j] * alpha + warp_sum(p);
            mx[j] = m_new;
#pragma unroll
            for (int v = 0; v < VPL; v++) {
                acc[j][v][0] *= alpha;
                acc[j][v][1] *= alpha;
            }
            for (int kk = 0; kk < KT; kk++) {
                const float pk = __shfl_sync(FULL_MASK, p, kk);
                if (pk == 0.0f) continue;  // warp-uniform
                const u32* vr = vs + kk * VW;
#pragma unroll
                for (int v = 0; v < VPL; v++) {
                    const int w = lane + 32 * v;
                    if (w < VW) {
                        const u32 vw = vr[w];
                        acc[j][v][0] = fmaf(pk, bflo(vw), acc[j][v][0]);
                        acc[j][v][1] = fmaf(pk, bfhi(vw), acc[j][v][1]);
                    }
                }
            }
        }
    }

#pragma unroll
    for (int j = 0; j < RPW; j++) {
        const int r = r0 + warp * RPW + j;
        if (r >= n_rows) continue;
        const int t = r / group, h = kvh * group + r % group;
        const long long slot = ((long long)t * n_heads + h) * n_splits + split;
        if (lane == 0) {
            part_ml[slot * 2] = mx[j];
            part_ml[slot * 2 + 1] = l[j];
        }
        float* o = part_acc + slot * HD;
#pragma unroll
        for (int v = 0; v < VPL; v++) {
            const int w = lane + 32 * v;
            if (w < VW) {
                o[2 * w] = acc[j][v][0];
                o[2 * w + 1] = acc[j][v][1];
            }
        }
    }
    if (!out) return;
    // Fused combine: the last split of this (kv head, row tile) to finish merges all splits.
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int* c = counters + blockIdx.x * gridDim.y + blockIdx.y;
        const int ticket = atomicAdd(c, 1);
        is_last = ticket == n_splits - 1;
        if (is_last) *c = 0;  // ready for the next launch (graph replay)
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // Each warp merges every ATT_WARPS-th split of a row; the warps' sums meet in shared memory.
    __shared__ float red[ATT_WARPS][HD];
    for (int rr = 0; rr < ATT_ROWS; rr++) {
        const int r = r0 + rr;
        if (r >= n_rows) break;  // block-uniform
        const int t = r / group, h = kvh * group + r % group;
        const long long row = (long long)t * n_heads + h;
        const float* ml = part_ml + row * n_splits * 2;
        float gm = NEG_INF;
        for (int s = lane; s < n_splits; s += 32) {
            const float2 v = __ldcg((const float2*)(ml + 2 * s));
            if (v.y > 0.0f) gm = fmaxf(gm, v.x);
        }
        gm = warp_max(gm);
        float den = 0.0f;
        for (int s = lane; s < n_splits; s += 32) {
            const float2 v = __ldcg((const float2*)(ml + 2 * s));
            if (v.y > 0.0f) den += v.y * expf(v.x - gm);
        }
        den = warp_sum(den);
        const float inv = den > 0.0f ? 1.0f / den : 0.0f;
        float a[(HD + 31) / 32];
#pragma unroll
        for (int i = 0; i < (HD + 31) / 32; i++) a[i] = 0.0f;
        // No branch on the split's emptiness (its acc is zeros), so the loads pipeline.
#pragma unroll 4
        for (int s = warp; s < n_splits; s += ATT_WARPS) {
            const float2 v = __ldcg((const float2*)(ml + 2 * s));
            const float wgt = v.y > 0.0f ? expf(v.x - gm) : 0.0f;
            const float* pa = part_acc + (row * n_splits + s) * HD;
#pragma unroll
            for (int i = 0; i < (HD + 31) / 32; i++) {
                const int d = lane + 32 * i;
                if (d < HD) a[i] = fmaf(__ldcg(pa + d), wgt, a[i]);
            }
        }
#pragma unroll
        for (int i = 0; i < (HD + 31) / 32; i++) {
            const int d = lane + 32 * i;
            if (d < HD) red[warp][d] = a[i];
        }
        __syncthreads();
        for (int d = threadIdx.x; d < HD; d += blockDim.x) {
            float sum = 0.0f;
#pragma unroll
            for (int w = 0; w < ATT_WARPS; w++) sum += red[w][d];
            out[row * HD + d] = f2bf(sum * inv);
        }
        __syncthreads();
    }
}

// One block per (token, head): merges the splits and writes the bf16 output row.
extern "C" __global__ void attn_combine(const float* __restrict__ part_acc,
                                        const float* __restrict__ part_ml, int n_splits,
                                        bf16* __restrict__ out) {
    GRID_SYNC();
    const long long row = blockIdx.x;
    const float* ml = part_ml + row * n_splits * 2;
    float gm = NEG_INF;
    for (int s = 0; s < n_splits; s++)
        if (ml[2 * s + 1] > 0.0f) gm = fmaxf(gm, ml[2 * s]);
    float denom = 0.0f;
    for (int s = 0; s < n_splits; s++)
        if (ml[2 * s + 1] > 0.0f) denom += ml[2 * s + 1] * expf(ml[2 * s] - gm);
    const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < n_splits; s++)
            if (ml[2 * s + 1] > 0.0f)
                a += part_acc[(row * n_splits + s) * HD + d] * expf(ml[2 * s] - gm);
        out[row * HD + d] = f2bf(a * inv);
    }
}

// Prefill attention on tensor cores: S = Q K^T and O = P V run as cuBLAS batched GEMMs (one batch
// per kv head, the group's query rows stacked: row r = t * group + j), with this kernel between.
// One block per stacked row of one kv head: masks (causal, sliding window), soft-caps and
// normalizes the f32 scores of keys [0, n_keys) into bf16 probabilities (zero where masked).
// Rows of S and P are `ld` apart; `t0` is the first token of this chunk of rows.
extern "C" __global__ void __launch_bounds__(256)
attn_softmax(const float* __restrict__ s, int ld, int n_keys, int rows, const int* __restrict__ pos,
             int t0, int group, int window, float softcap, bf16* __restrict__ p) {
    GRID_SYNC();
    __shared__ float scratch[33];
    const int r = blockIdx.x;
    const long long off = ((long long)blockIdx.y * rows + r) * ld;
    const float* sr = s + off;
    bf16* pr = p + off;
    const int ps = pos[t0 + r / group];
    const int lo = window > 0 ? max(ps + 1 - window, 0) : 0;
    const int hi = min(ps, n_keys - 1);
    float mx = NEG_INF;
    for (int k = lo + threadIdx.x; k <= hi; k += blockDim.x) {
        float v = sr[k];
        if (softcap > 0.0f) v = tanhf(v / softcap) * softcap;
        mx = fmaxf(mx, v);
    }
    mx = warp_max(mx);  // block max
    __shared__ float wmax[32];
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    if (l == 0) wmax[w] = mx;
    __syncthreads();
    if (w == 0) {
        float v = l < (int)(blockDim.x >> 5) ? wmax[l] : NEG_INF;
        v = warp_max(v);
        if (l == 0) wmax[0] = v;
    }
    __syncthreads();
    mx = wmax[0];
    float sum = 0.0f;
    for (int k = lo + threadIdx.x; k <= hi; k += blockDim.x) {
        float v = sr[k];
        if (softcap > 0.0f) v = tanhf(v / softcap) * softcap;
        sum += expf(v - mx);
    }
    sum = block_sum(sum, scratch);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int k = threadIdx.x; k < n_keys; k += blockDim.x) {
        float e = 0.0f;
        if (k >= lo && k <= hi) {
            float v = sr[k];
            if (softcap > 0.0f) v = tanhf(v / softcap) * softcap;
            e = expf(v - mx) * inv;
        }
        pr[k] = f2bf(e);
    }
}

// Stacked attention output [kv head][t * group + j][HD] -> [t][kv head * group + j][HD] (bf16).
extern "C" __global__ void attn_unstack(const bf16* __restrict__ o, int m, int n_kv, int group,
                                        bf16* __restrict__ out) {
    GRID_SYNC();
    const int t = blockIdx.x;
    const int n_heads = n_kv * group;
    for (int i = threadIdx.x; i < n_heads * (HD / 8); i += blockDim.x) {
        const int h = i / (HD / 8), c = i % (HD / 8);
        const int g = h / group, j = h % group;
        const uint4 v = *(const uint4*)(o + (((long long)g * m + t) * group + j) * HD + c * 8);
        *(uint4*)(out + ((long long)t * n_heads + h) * HD + c * 8) = v;
    }
}
