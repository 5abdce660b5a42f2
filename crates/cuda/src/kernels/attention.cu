// Attention over the KV cache, flash-decoding style: each block takes one kv head, a tile of
// query rows (token x head of that kv head's group, so K/V tiles are shared by the whole GQA
// group) and one split of the key range; it writes unnormalized partial results (acc, max, sum)
// that attn_combine merges, or, in decode with the splits launched as one cluster, merges them
// through distributed shared memory itself (cluster_merge). Used for one token (decode, and a
// one-token prefill); a batch's decode tokens take attn_decode (tensor cores) where the head dim
// allows; longer prefills run flash style (attn_prefill) or as GEMMs (attn_softmax below).
// Rows attend to keys [lo, pos] with lo = pos + 1 - window (sliding windows) or 0.
// HEAD_DIM is fixed per model at compile time (-DHEAD_DIM=...).

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#define HD HEAD_DIM
#define ATT_WARPS 4
#define ATT_THREADS (ATT_WARPS * 32)
#define RPW 1                       // query rows per warp
#define ATT_ROWS (ATT_WARPS * RPW)  // query rows per block
#define KT 32                       // keys per tile: one per lane
#define KW (HD / 2 + 1)             // words per K row in shared memory (padded: no bank conflicts)
#define VW (HD / 2)                 // words per V row
#define VPL ((VW + 31) / 32)        // V words per lane
#define TILE_VECS ((KT * HD / 8 + ATT_THREADS - 1) / ATT_THREADS)  // 16-byte K (and V) loads per thread

// Decode with the splits of one (kv head, row tile) as a thread-block cluster (sm_90+): each
// block leaves its rows' partial (max, sum, acc) in shared memory, and after a cluster barrier
// every block merges a share of the outputs from all blocks' shared memory (no second kernel,
// no global round trip). The second barrier keeps each block's shared memory alive until every
// peer has read it. (Merging all in the first block after the others pushed their partials
// there was slower: H200 run 9.)
#define MAX_CLUSTER 8
__device__ __forceinline__ void cluster_merge(const float (&mx)[RPW], const float (&l)[RPW],
                                              const float (&acc)[RPW][VPL][2], int r0, int n_rows,
                                              int group, int kvh, int n_heads,
                                              bf16* __restrict__ out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __shared__ float pml[ATT_ROWS][2];
    __shared__ float pacc[ATT_ROWS][HD];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < RPW; j++) {
        const int rr = warp * RPW + j;
        if (lane == 0) {
            pml[rr][0] = mx[j];
            pml[rr][1] = l[j];
        }
#pragma unroll
        for (int v = 0; v < VPL; v++) {
            const int w = lane + 32 * v;
            if (w < VW) {
                pacc[rr][2 * w] = acc[j][v][0];
                pacc[rr][2 * w + 1] = acc[j][v][1];
            }
        }
    }
    cluster_sync();
    const int n_blocks = (int)cluster_size(), rank = (int)cluster_rank();
#pragma unroll 1
    for (int i = rank * ATT_THREADS + threadIdx.x; i < ATT_ROWS * HD; i += n_blocks * ATT_THREADS) {
        const int rr = i / HD, d = i % HD, r = r0 + rr;
        if (r >= n_rows) break;
        float m[MAX_CLUSTER], s[MAX_CLUSTER], a[MAX_CLUSTER];
        float gm = NEG_INF;
#pragma unroll
        for (int c = 0; c < MAX_CLUSTER; c++) {
            m[c] = NEG_INF;
            s[c] = a[c] = 0.0f;
            if (c < n_blocks) {
                m[c] = ld_cluster(&pml[rr][0], c);
                s[c] = ld_cluster(&pml[rr][1], c);
                a[c] = ld_cluster(&pacc[rr][d], c);
            }
        }
#pragma unroll
        for (int c = 0; c < MAX_CLUSTER; c++)
            if (s[c] > 0.0f) gm = fmaxf(gm, m[c]);
        float den = 0.0f, num = 0.0f;
#pragma unroll
        for (int c = 0; c < MAX_CLUSTER; c++) {
            const float wgt = s[c] > 0.0f ? expf(m[c] - gm) : 0.0f;
            den = fmaf(s[c], wgt, den);
            num = fmaf(a[c], wgt, num);
        }
        const int t = r / group, h = kvh * group + r % group;
        out[((long long)t * n_heads + h) * HD + d] = f2bf(den > 0.0f ? num / den : 0.0f);
    }
    cluster_sync_relaxed();
#else
    __trap();
#endif
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32, 1)
attn_partial(const float* __restrict__ q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,
             const int* __restrict__ pos, const int* __restrict__ tok_idx, int n_heads, int n_kv,
             int window, float softcap, int n_splits, float* __restrict__ part_acc,
             float* __restrict__ part_ml, bf16* __restrict__ out, const int* __restrict__ tables,
             const int* __restrict__ table_off, int bs) {
    pdl_wait();
    __shared__ float qs[ATT_ROWS][HD];
    __shared__ u32 ks[KT * KW];
    __shared__ __align__(16) u32 vs[KT * VW];

    // A block: one token (the tok_idx[i]-th of the batch, or the i-th without a list), a tile of
    // ATT_ROWS heads of one kv head's group, one split of the keys that token sees. Tokens of a
    // batch belong to different sequences (their own positions and block tables).
    const int kvh = blockIdx.x, split = blockIdx.z;
    const int group = n_heads / n_kv;
    const int tiles = (group + ATT_ROWS - 1) / ATT_ROWS;
    const int ti = blockIdx.y / tiles, tile = blockIdx.y % tiles;
    const int tok = tok_idx ? tok_idx[ti] : ti;
    const int r0 = tok * group + tile * ATT_ROWS;
    const int n_rows = min(r0 + ATT_ROWS, (tok + 1) * group);  // rows r0 .. n_rows - 1
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // The splits share the keys the token sees, in whole tiles, so the grid stays sized to the
    // chip while each block's work follows the actual context.
    const int p = pos[tok];
    const int base = window > 0 ? max(p + 1 - window, 0) : 0;
    const int chunk = ((p + 1 - base + n_splits - 1) / n_splits + KT - 1) / KT * KT;
    const int s_lo = base + split * chunk;
    const int k_begin = s_lo, k_end = min(p, s_lo + chunk - 1);
    // A tile's K/V loads go to registers one tile ahead: tile t+1 is in flight while t is
    // multiplied (all of a thread's loads are issued before any is used).
    uint4 kv[TILE_VECS], vv[TILE_VECS];
    auto load_tile = [&](int k0) {
#pragma unroll
        for (int u = 0; u < TILE_VECS; u++) {
            const int i = threadIdx.x + u * ATT_THREADS;
            const int kk = i / (HD / 8), c = i % (HD / 8), key = k0 + kk;
            kv[u] = vv[u] = make_uint4(0, 0, 0, 0);
            if (i < KT * (HD / 8) && key <= k_end) {
                const long long g = (kv_slot(tables, table_off, tok, key, bs) * n_kv + kvh) * HD + c * 8;
                kv[u] = *(const uint4*)(kc + g);
                vv[u] = *(const uint4*)(vc + g);
            }
        }
    };
    if (k_begin <= k_end) load_tile(k_begin);

    // Each warp's rows: key range clipped to this split, and the query in shared memory.
    int row_lo[RPW], row_hi[RPW];
#pragma unroll
    for (int j = 0; j < RPW; j++) {
        const int rr = warp * RPW + j, r = r0 + rr;
        row_lo[j] = 1;  // empty
        row_hi[j] = 0;
        if (r < n_rows) {
            const int h = kvh * group + r % group;
            row_lo[j] = k_begin;
            row_hi[j] = k_end;
            const float* qr = q + ((long long)tok * n_heads + h) * HD;
#pragma unroll
            for (int d = lane; d < HD; d += 32) qs[rr][d] = qr[d];
        }
    }
    __syncwarp();

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
#pragma unroll
        for (int u = 0; u < TILE_VECS; u++) {
            const int i = threadIdx.x + u * ATT_THREADS;
            if (i < KT * (HD / 8)) {
                const int kk = i / (HD / 8), c = i % (HD / 8);
                u32* kd = ks + kk * KW + c * 4;
                kd[0] = kv[u].x; kd[1] = kv[u].y; kd[2] = kv[u].z; kd[3] = kv[u].w;
                *(uint4*)(vs + kk * VW + c * 4) = vv[u];
            }
        }
        __syncthreads();
        if (k0 + KT <= k_end) load_tile(k0 + KT);
        const int key = k0 + lane;
#pragma unroll
        for (int j = 0; j < RPW; j++) {
            const int rr = warp * RPW + j;
            const int lo = row_lo[j], hi = row_hi[j];
            if (lo > hi || k0 > hi || k0 + KT - 1 < lo) continue;  // warp-uniform
            const u32* kr = ks + lane * KW;
            // Four independent sums: the dot is a latency chain otherwise.
            float s4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 16
            for (int w = 0; w < HD / 2; w++) {
                const u32 kw = kr[w];
                s4[(2 * w) & 3] = fmaf(qs[rr][2 * w], bflo(kw), s4[(2 * w) & 3]);
                s4[(2 * w + 1) & 3] = fmaf(qs[rr][2 * w + 1], bfhi(kw), s4[(2 * w + 1) & 3]);
            }
            float s = (s4[0] + s4[1]) + (s4[2] + s4[3]);
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
#pragma unroll 8
            for (int kk = 0; kk < KT; kk++) {
                const float pk = __shfl_sync(FULL_MASK, p, kk);
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

    if (out) {
        cluster_merge(mx, l, acc, r0, n_rows, group, kvh, n_heads, out);
        return;
    }
#pragma unroll
    for (int j = 0; j < RPW; j++) {
        const int r = r0 + warp * RPW + j;
        if (r >= n_rows) continue;
        const int h = kvh * group + r % group;
        const long long slot = ((long long)ti * n_heads + h) * n_splits + split;
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
}

// One block per (listed token, head), a multiple of 32 threads: merges the splits and writes the
// bf16 output row (of token tok_idx[i], or i without a list). Every warp weighs 32 splits at a time (a lane per split); every thread then sums its dimensions over
// those splits with all loads in flight at once (the merge is latency-bound, not byte-bound).
extern "C" __global__ void attn_combine(const float* __restrict__ part_acc,
                                        const float* __restrict__ part_ml, int n_splits,
                                        const int* __restrict__ tok_idx, int n_heads,
                                        bf16* __restrict__ out) {
    pdl_wait();
    const long long row = blockIdx.x;
    const int ti = (int)(row / n_heads), h = (int)(row % n_heads);
    const long long out_row = (long long)(tok_idx ? tok_idx[ti] : ti) * n_heads + h;
    const int lane = threadIdx.x & 31;
    const float2* ml = (const float2*)(part_ml + row * n_splits * 2);
    float gm = NEG_INF;
    for (int s = lane; s < n_splits; s += 32) {
        const float2 v = ml[s];
        if (v.y > 0.0f) gm = fmaxf(gm, v.x);
    }
    gm = warp_max(gm);
    constexpr int DPT = (HD + 31) / 32;  // dimensions per thread at the smallest block (32)
    float a[DPT], den = 0.0f;
#pragma unroll
    for (int i = 0; i < DPT; i++) a[i] = 0.0f;
    const float* pa = part_acc + row * n_splits * HD;
    for (int s0 = 0; s0 < n_splits; s0 += 32) {
        const int s = s0 + lane;
        float wgt = 0.0f;
        if (s < n_splits) {
            const float2 v = ml[s];
            wgt = v.y > 0.0f ? expf(v.x - gm) : 0.0f;
            den += v.y * wgt;
        }
        const int n = min(32, n_splits - s0);
#pragma unroll
        for (int i = 0; i < DPT; i++) {
            if (i * (int)blockDim.x >= HD) break;  // block-uniform: every lane shuffles below
            const int d = threadIdx.x + i * blockDim.x;
            float vals[32];
#pragma unroll
            for (int j = 0; j < 32; j++)
                vals[j] = j < n && d < HD ? pa[(long long)(s0 + j) * HD + d] : 0.0f;
#pragma unroll
            for (int j = 0; j < 32; j++) a[i] = fmaf(vals[j], __shfl_sync(FULL_MASK, wgt, j), a[i]);
        }
    }
    den = warp_sum(den);
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;
#pragma unroll
    for (int i = 0; i < DPT; i++) {
        const int d = threadIdx.x + i * blockDim.x;
        if (d < HD) out[out_row * HD + d] = f2bf(a[i] * inv);
    }
}

// Prefill attention, flash style on tensor cores (mma.m16n8k16, bf16 operands, f32 sums): the
// scores never leave registers. A block takes FA_ROWS stacked query rows of one kv head (row
// r = t * group + j of the segment, q already scaled and rounded to bf16 by the RoPE kernel), a
// warp 16 of them; the block walks tiles of FA_KT keys, K and V copied into shared memory
// asynchronously one tile ahead (from the paged cache through `table`, or contiguous rows), and
// each warp computes S = Q K^T, masks it (causal by position, sliding window), soft-caps it, and
// folds it into a running max, sum and O += bf16(2^(S log2 e - max)) V. Rows attend to keys
// [lo, min(pos, n_keys - 1)]. Head dims that are not a multiple of 16 or above 128 (whose O and
// Q fragments would not fit the registers) run as GEMMs (attn_softmax below). A first version
// that loaded each tile synchronously only matched the GEMMs (H200 run 13).
#define FA_WARPS 4
#define FA_ROWS (FA_WARPS * 16)
#define FA_KT 64
#define FA_LD (HD + 8)  // halves a staged row: the 8 rows an ldmatrix phase reads in distinct banks
#define FA_STAGE (2 * FA_KT * FA_LD)  // halves of one stage: K then V
#define FA_OK (HD % 16 == 0 && HD <= 128)
#define LOG2E 1.4426950408889634f

__device__ __forceinline__ u32 pack_bf2(float lo, float hi) {
    return (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
}
// 16 bytes global -> shared without a register round trip; zeros where `full` is false.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool full) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(full ? 16 : 0));
}

#if FA_OK
// The online softmax's step for a lane's two rows (h = 0: row grp, 1: row grp + 8): the tile's
// row maxima `tm` (log2 units) over the quad, the new running max, the rescaling of the sums and
// of O; `base` is what the tile's exponents subtract.
__device__ __forceinline__ void softmax_step(float (&tm)[2], float (&mx)[2], float (&l)[2],
                                             float (&o)[HD / 8][4], float (&base)[2]) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        tm[h] = fmaxf(tm[h], __shfl_xor_sync(FULL_MASK, tm[h], 1));
        tm[h] = fmaxf(tm[h], __shfl_xor_sync(FULL_MASK, tm[h], 2));
        const float m_new = fmaxf(mx[h], tm[h]);
        base[h] = m_new == NEG_INF ? 0.0f : m_new;  // no key yet: every p is 0
        const float alpha = exp2f(mx[h] - base[h]);  // 0 while mx is -inf
        mx[h] = m_new;
        l[h] *= alpha;
#pragma unroll
        for (int d = 0; d < HD / 8; d++) {
            o[d][2 * h] *= alpha;
            o[d][2 * h + 1] *= alpha;
        }
    }
}
#endif

extern "C" __global__ void __launch_bounds__(FA_WARPS * 32, 2)
attn_prefill(const bf16* __restrict__ q, int q_rows, int row0, int rows,
             const bf16* __restrict__ kc, const bf16* __restrict__ vc, const int* __restrict__ table,
             int bs, int n_kv, int n_keys, const int* __restrict__ pos, int group, int window,
             float softcap, bf16* __restrict__ out) {
    pdl_wait();
#if FA_OK
    extern __shared__ __align__(16) bf16 fa_smem[];  // two stages
    __shared__ int range[2][FA_WARPS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int grp = lane >> 2, tig = lane & 3;
    const int kvh = blockIdx.y;
    // The last row tiles (the most keys) start first.
    const int tile = gridDim.x - 1 - blockIdx.x;
    const int rw = tile * FA_ROWS + warp * 16;  // this warp's first row

    // Each of the lane's two rows (grp, grp + 8): its key range, empty past the last row.
    int lo[2], hi[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = rw + grp + 8 * h;
        lo[h] = 1;
        hi[h] = 0;
        if (r < rows) {
            const int ps = pos[r / group];
            lo[h] = window > 0 ? max(ps + 1 - window, 0) : 0;
            hi[h] = min(ps, n_keys - 1);
        }
    }
    // The warp's and the block's key ranges: the union of their rows'.
    int wlo = min(lo[0] <= hi[0] ? lo[0] : 0x7fffffff, lo[1] <= hi[1] ? lo[1] : 0x7fffffff);
    int whi = max(lo[0] <= hi[0] ? hi[0] : -1, lo[1] <= hi[1] ? hi[1] : -1);
    wlo = __reduce_min_sync(FULL_MASK, wlo);
    whi = __reduce_max_sync(FULL_MASK, whi);
    // Keys every row of the warp sees (an empty row sees none): tiles inside need no mask.
    const int all_lo = __reduce_max_sync(FULL_MASK, max(lo[0], lo[1]));
    const int all_hi = __reduce_min_sync(FULL_MASK, min(hi[0], hi[1]));
    if (lane == 0) {
        range[0][warp] = wlo;
        range[1][warp] = whi;
    }
    // The warp's query rows as A fragments (rows grp, grp + 8; dims 2 tig.., 2 tig + 8..).
    u32 qa[HD / 16][4];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = rw + grp + 8 * h;
        const u32* qr = (const u32*)(q + ((long long)kvh * q_rows + row0 + r) * HD);
#pragma unroll
        for (int k = 0; k < HD / 16; k++) {
            qa[k][h] = r < rows ? qr[8 * k + tig] : 0u;
            qa[k][2 + h] = r < rows ? qr[8 * k + 4 + tig] : 0u;
        }
    }
    __syncthreads();
    int k_lo = 0x7fffffff, k_hi = -1;
#pragma unroll
    for (int w = 0; w < FA_WARPS; w++) {
        k_lo = min(k_lo, range[0][w]);
        k_hi = max(k_hi, range[1][w]);
    }

    const int bs_shift = __ffs(bs) - 1;  // blocks of a power-of-two size
    // Tile k0 into stage st, 16 bytes a copy (keys past k_hi zero).
    const auto load_tile = [&](int k0, int st) {
        bf16* kd = fa_smem + st * FA_STAGE;
        bf16* vd = kd + FA_KT * FA_LD;
#pragma unroll
        for (int i = threadIdx.x; i < FA_KT * (HD / 8); i += FA_WARPS * 32) {
            const int kk = i / (HD / 8), c = i % (HD / 8), key = k0 + kk;
            const bool in = key <= k_hi;
            const long long slot =
                !in ? 0 : table ? (long long)table[key >> bs_shift] * bs + (key & (bs - 1)) : key;
            const long long g = (slot * n_kv + kvh) * HD + c * 8;
            cp_async16(kd + kk * FA_LD + c * 8, kc + g, in);
            cp_async16(vd + kk * FA_LD + c * 8, vc + g, in);
        }
        asm volatile("cp.async.commit_group;");
    };

    float o[HD / 8][4];
#pragma unroll
    for (int d = 0; d < HD / 8; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    // Running max (in log2 units), and this lane's share of the row sums.
    float mx[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};

    if (k_lo <= k_hi) load_tile(k_lo, 0);
    int st = 0;
    for (int k0 = k_lo; k0 <= k_hi; k0 += FA_KT, st ^= 1) {
        if (k0 + FA_KT <= k_hi) {
            load_tile(k0 + FA_KT, st ^ 1);
            asm volatile("cp.async.wait_group 1;");
        } else {
            asm volatile("cp.async.wait_group 0;");
        }
        __syncthreads();  // tile k0 is in stage st for every thread
        const bf16* ks = fa_smem + st * FA_STAGE;
        const bf16* vs = ks + FA_KT * FA_LD;
        if (k0 <= whi && k0 + FA_KT - 1 >= wlo) {  // warp-uniform: a key of this tile is the warp's
            // S = Q K^T: 8 tiles of 8 keys; K rows are the B operand's columns (ldmatrix, no
            // transpose: lane l addresses key 8 j + l % 8, dims 16 k + 8 (l / 8)).
            float s[FA_KT / 8][4];
#pragma unroll
            for (int j = 0; j < FA_KT / 8; j++) {
                s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
                const bf16* kr = ks + (8 * j + (lane & 7)) * FA_LD;
#pragma unroll
                for (int k = 0; k + 1 < HD / 16; k += 2) {
                    u32 b0, b1, b2, b3;
                    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                                 : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                                 : "r"(smem_addr(kr + 16 * k + 8 * (lane >> 3))));
                    mma_bf16(s[j], qa[k][0], qa[k][1], qa[k][2], qa[k][3], b0, b1);
                    mma_bf16(s[j], qa[k + 1][0], qa[k + 1][1], qa[k + 1][2], qa[k + 1][3], b2,
                             b3);
                }
                if ((HD / 16) & 1) {
                    constexpr int k = HD / 16 - 1;
                    u32 b0, b1;
                    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                                 : "=r"(b0), "=r"(b1)
                                 : "r"(smem_addr(kr + 16 * k + 8 * ((lane >> 3) & 1))));
                    mma_bf16(s[j], qa[k][0], qa[k][1], qa[k][2], qa[k][3], b0, b1);
                }
            }
            // Mask, soft-cap, to log2 units; the tile's max per row (c0, c1: row grp; c2, c3:
            // row grp + 8).
            float tm[2] = {NEG_INF, NEG_INF};
            if (k0 >= all_lo && k0 + FA_KT - 1 <= all_hi) {  // warp-uniform
#pragma unroll
                for (int j = 0; j < FA_KT / 8; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        float v = s[j][e];
                        if (softcap > 0.0f) v = tanhf(v / softcap) * softcap;
                        s[j][e] = v * LOG2E;
                        tm[e >> 1] = fmaxf(tm[e >> 1], s[j][e]);
                    }
            } else {
#pragma unroll
                for (int j = 0; j < FA_KT / 8; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int h = e >> 1, key = k0 + 8 * j + 2 * tig + (e & 1);
                        float v = s[j][e];
                        if (softcap > 0.0f) v = tanhf(v / softcap) * softcap;
                        v = key >= lo[h] && key <= hi[h] ? v * LOG2E : NEG_INF;
                        s[j][e] = v;
                        tm[h] = fmaxf(tm[h], v);
                    }
            }
            float base[2];
            softmax_step(tm, mx, l, o, base);
            // P (bf16, the A operand: keys 16 kk.. are tiles 2 kk and 2 kk + 1) times V
            // (ldmatrix with transpose: lane l addresses key 16 kk + 8 ((l / 8) & 1) + l % 8,
            // dims 8 d + 8 (l / 16)).
#pragma unroll
            for (int kk = 0; kk < FA_KT / 16; kk++) {
                u32 pa[4];
#pragma unroll
                for (int t = 0; t < 2; t++) {
                    const float* c = s[2 * kk + t];
                    const u32 p01 = pack_bf2(exp2f(c[0] - base[0]), exp2f(c[1] - base[0]));
                    const u32 p23 = pack_bf2(exp2f(c[2] - base[1]), exp2f(c[3] - base[1]));
                    // The sums take the rounded weights the product uses.
                    l[0] += bflo(p01) + bfhi(p01);
                    l[1] += bflo(p23) + bfhi(p23);
                    pa[2 * t] = p01;
                    pa[2 * t + 1] = p23;
                }
                const bf16* vr =
                    vs + (16 * kk + 8 * ((lane >> 3) & 1) + (lane & 7)) * FA_LD + 8 * (lane >> 4);
#pragma unroll
                for (int d = 0; d < HD / 8; d += 2) {
                    u32 b0, b1, b2, b3;
                    asm volatile(
                        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                        : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                        : "r"(smem_addr(vr + 8 * d)));
                    mma_bf16(o[d], pa[0], pa[1], pa[2], pa[3], b0, b1);
                    mma_bf16(o[d + 1], pa[0], pa[1], pa[2], pa[3], b2, b3);
                }
            }
        }
        __syncthreads();  // stage st is free for the tile after next
    }
    // The row sums over the quad's lanes; O / l as bf16 into [t][head][d].
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(FULL_MASK, l[h], 1);
        l[h] += __shfl_xor_sync(FULL_MASK, l[h], 2);
    }
    const int n_heads = n_kv * group;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = rw + grp + 8 * h;
        if (r >= rows) continue;
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        const int t = r / group, head = kvh * group + r % group;
        u32* orow = (u32*)(out + ((long long)t * n_heads + head) * HD);
#pragma unroll
        for (int d = 0; d < HD / 8; d++)
            orow[4 * d + tig] = pack_bf2(o[d][2 * h] * inv, o[d][2 * h + 1] * inv);
    }
#else
    __trap();
#endif
}

// Decode attention of many tokens on tensor cores (one token of each listed sequence; the
// split partials that attn_combine merges, as attn_partial's). A warp is a split: one token, up
// to 16 query rows of one kv head's group (rows past the group are zero), one share of the keys
// that token sees, walked in tiles of DEC_KT keys, each copied into the warp's own shared memory
// one tile ahead (cp.async, no block barriers), S = Q K^T and O += P V on mma.m16n8k16 with
// bf16 operands and f32 sums, the softmax running in registers as attn_prefill's (q rounded to
// bf16 as the prefill's is; attn_partial keeps it f32). A block is
// DEC_WARPS independent warps (splits blockIdx.z * DEC_WARPS + warp). Against attn_partial's
// scalar dot products (~900 instructions a 32-key tile a query row) it issues ~200 a 16-key tile
// for all the rows.
#define DEC_WARPS 2
#define DEC_KT 16
// Tiles a warp holds: DEC_STAGES - 1 in flight while one is multiplied. 3 and 4 made the kernel
// faster still (B = 64: 1.58 / 1.80-1.97 ms against 1.79-1.83 at 2) but not the batched steps
// (H200 session 13, call 4).
#define DEC_STAGES 2
#define DEC_STAGE (2 * DEC_KT * FA_LD)  // halves: K then V of one tile
extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32)
attn_decode(const float* __restrict__ q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,
            const int* __restrict__ pos, const int* __restrict__ tok_idx, int n_heads, int n_kv,
            int window, float softcap, int n_splits, float* __restrict__ part_acc,
            float* __restrict__ part_ml, const int* __restrict__ tables,
            const int* __restrict__ table_off, int bs) {
    pdl_wait();
#if FA_OK
    __shared__ __align__(16) bf16 dec_smem[DEC_WARPS * DEC_STAGES * DEC_STAGE];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int grp = lane >> 2, tig = lane & 3;
    const int kvh = blockIdx.x, split = blockIdx.z * DEC_WARPS + warp;
    const int group = n_heads / n_kv;
    const int tiles = (group + 15) / 16;
    const int ti = blockIdx.y / tiles, j0 = (blockIdx.y % tiles) * 16;
    const int tok = tok_idx ? tok_idx[ti] : ti;
    const int p = pos[tok];
    const int base = window > 0 ? max(p + 1 - window, 0) : 0;
    const int chunk = ((p + 1 - base + n_splits - 1) / n_splits + DEC_KT - 1) / DEC_KT * DEC_KT;
    const int k_lo = base + split * chunk, k_hi = min(p, k_lo + chunk - 1);

    // The rows (heads kvh * group + j0 + grp, + 8) as A fragments: f32 q rounded to bf16.
    u32 qa[HD / 16][4];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int j = j0 + grp + 8 * h;
        const bool in = j < group;
        const float2* qr = (const float2*)(q + ((long long)tok * n_heads + kvh * group + j) * HD);
#pragma unroll
        for (int k = 0; k < HD / 16; k++) {
            const float2 a = in ? qr[8 * k + tig] : make_float2(0.0f, 0.0f);
            const float2 b = in ? qr[8 * k + 4 + tig] : make_float2(0.0f, 0.0f);
            qa[k][h] = pack_bf2(a.x, a.y);
            qa[k][2 + h] = pack_bf2(b.x, b.y);
        }
    }

    bf16* stage0 = dec_smem + warp * DEC_STAGES * DEC_STAGE;
    // The block table's entries for 32 blocks from tb0 (lane i holds block tb0 + i), so that a
    // tile's copies need no dependent load of the table first; refilled as the keys move on.
    // An empty split (its keys past the token's) reads none: they would be past its table.
    const int* tab = tables ? tables + table_off[tok] : nullptr;
    int tb0 = k_lo / bs, tb = 0;
    const int tb_last = k_hi / bs;
    if (tab && k_lo <= k_hi && tb0 + lane <= tb_last) tb = tab[tb0 + lane];
    // Tile k0 into stage st: 16 bytes a copy, keys past k_hi zero.
    const auto load_tile = [&](int k0, int st) {
        if (tab && (k0 + DEC_KT - 1) / bs - tb0 >= 32) {  // warp-uniform
            tb0 = k0 / bs;
            tb = tb0 + lane <= tb_last ? tab[tb0 + lane] : 0;
        }
        bf16* kd = stage0 + st * DEC_STAGE;
        bf16* vd = kd + DEC_KT * FA_LD;
#pragma unroll
        for (int i = lane; i < DEC_KT * (HD / 8); i += 32) {
            const int kk = i / (HD / 8), c = i % (HD / 8), key = k0 + kk;
            const bool in = key <= k_hi;
            const int blk = __shfl_sync(FULL_MASK, tb, min(key / bs - tb0, 31));
            const long long slot = tab ? (long long)blk * bs + key % bs : key;
            const long long g = ((in ? slot : 0) * n_kv + kvh) * HD + c * 8;
            cp_async16(kd + kk * FA_LD + c * 8, kc + g, in);
            cp_async16(vd + kk * FA_LD + c * 8, vc + g, in);
        }
    };

    float o[HD / 8][4];
#pragma unroll
    for (int d = 0; d < HD / 8; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    // Running max per row (log2 units) and this lane's share of the row sums.
    float mx[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    const int n_tiles = k_lo <= k_hi ? (k_hi - k_lo) / DEC_KT + 1 : 0;
    // One copy group a tile (empty past the last), so that "all but the newest DEC_STAGES - 1
    // groups" is always tile t's.
#pragma unroll
    for (int t = 0; t < DEC_STAGES - 1; t++) {
        if (t < n_tiles) load_tile(k_lo + t * DEC_KT, t);
        asm volatile("cp.async.commit_group;");
    }
    for (int t = 0; t < n_tiles; t++) {
        const int k0 = k_lo + t * DEC_KT, ahead = t + DEC_STAGES - 1;
        if (ahead < n_tiles) load_tile(k_lo + ahead * DEC_KT, ahead % DEC_STAGES);
        asm volatile("cp.async.commit_group;");
        asm volatile("cp.async.wait_group %0;" ::"n"(DEC_STAGES - 1));
        __syncwarp();  // every lane's copies of tile t are in
        const bf16* ks = stage0 + (t % DEC_STAGES) * DEC_STAGE;
        const bf16* vs = ks + DEC_KT * FA_LD;
        // S = Q K^T: two tiles of 8 keys (c0, c1: row grp; c2, c3: row grp + 8; keys 2 tig..).
        float s[2][4];
#pragma unroll
        for (int jt = 0; jt < 2; jt++) {
            s[jt][0] = s[jt][1] = s[jt][2] = s[jt][3] = 0.0f;
            const bf16* kr = ks + (8 * jt + (lane & 7)) * FA_LD;
#pragma unroll
            for (int k = 0; k + 1 < HD / 16; k += 2) {
                u32 b0, b1, b2, b3;
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                             : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                             : "r"(smem_addr(kr + 16 * k + 8 * (lane >> 3))));
                mma_bf16(s[jt], qa[k][0], qa[k][1], qa[k][2], qa[k][3], b0, b1);
                mma_bf16(s[jt], qa[k + 1][0], qa[k + 1][1], qa[k + 1][2], qa[k + 1][3], b2, b3);
            }
            if ((HD / 16) & 1) {
                constexpr int k = HD / 16 - 1;
                u32 b0, b1;
                asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
                             : "=r"(b0), "=r"(b1)
                             : "r"(smem_addr(kr + 16 * k + 8 * ((lane >> 3) & 1))));
                mma_bf16(s[jt], qa[k][0], qa[k][1], qa[k][2], qa[k][3], b0, b1);
            }
        }
        // Mask (keys past k_hi), soft-cap, to log2 units; each row's max (c0, c1: row grp; c2,
        // c3: row grp + 8) over the quad.
        float tm[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int jt = 0; jt < 2; jt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = k0 + 8 * jt + 2 * tig + (e & 1);
                float v = s[jt][e];
                if (softcap > 0.0f) v = tanhf(v / softcap) * softcap;
                v = key <= k_hi ? v * LOG2E : NEG_INF;
                s[jt][e] = v;
                tm[e >> 1] = fmaxf(tm[e >> 1], v);
            }
        float base[2];
        softmax_step(tm, mx, l, o, base);
        // P (bf16, the A operand: keys 0..7 are tile 0, 8..15 tile 1) times V (ldmatrix with
        // transpose: lane l addresses key 8 ((l / 8) & 1) + l % 8, dims 8 d + 8 (l / 16)).
        u32 pa[4];
#pragma unroll
        for (int t = 0; t < 2; t++) {
            const u32 p01 = pack_bf2(exp2f(s[t][0] - base[0]), exp2f(s[t][1] - base[0]));
            const u32 p23 = pack_bf2(exp2f(s[t][2] - base[1]), exp2f(s[t][3] - base[1]));
            // The sums take the rounded weights the product uses.
            l[0] += bflo(p01) + bfhi(p01);
            l[1] += bflo(p23) + bfhi(p23);
            pa[2 * t] = p01;
            pa[2 * t + 1] = p23;
        }
        const bf16* vr = vs + (8 * ((lane >> 3) & 1) + (lane & 7)) * FA_LD + 8 * (lane >> 4);
#pragma unroll
        for (int d = 0; d < HD / 8; d += 2) {
            u32 b0, b1, b2, b3;
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                         : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                         : "r"(smem_addr(vr + 8 * d)));
            mma_bf16(o[d], pa[0], pa[1], pa[2], pa[3], b0, b1);
            mma_bf16(o[d + 1], pa[0], pa[1], pa[2], pa[3], b2, b3);
        }
        __syncwarp();  // tile t's stage is free for the next load
    }
    // The row sums over the quad; the split's unnormalized rows, their max (natural log units,
    // as attn_partial's) and sum.
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(FULL_MASK, l[h], 1);
        l[h] += __shfl_xor_sync(FULL_MASK, l[h], 2);
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int j = j0 + grp + 8 * h;
        if (j >= group) continue;
        const long long slot = ((long long)ti * n_heads + kvh * group + j) * n_splits + split;
        if (tig == 0) {
            part_ml[slot * 2] = mx[h] == NEG_INF ? NEG_INF : mx[h] * 0.6931471805599453f;
            part_ml[slot * 2 + 1] = l[h];
        }
        float2* orow = (float2*)(part_acc + slot * HD);
#pragma unroll
        for (int d = 0; d < HD / 8; d++) orow[4 * d + tig] = make_float2(o[d][2 * h], o[d][2 * h + 1]);
    }
#else
    __trap();
#endif
}

// Prefill attention on tensor cores: S = Q K^T and O = P V run as cuBLAS batched GEMMs (one batch
// per kv head, the group's query rows stacked: row r = t * group + j), with this kernel between.
// Each stacked row of one kv head: masks (causal, sliding window), soft-caps and normalizes the
// f32 scores of keys [0, n_keys) into bf16 probabilities (zero where masked). Rows of S and P
// are `ld` apart (a multiple of 8); `t0` is the first token of this chunk of rows.
// One warp per row (no block-wide barriers: the rows are short and many). Rows of up to
// SM_CHUNKS * 128 keys are read once, as float4s held in registers (masked chunks are not read);
// longer rows take three passes.
#define SM_WARPS 8
#define SM_CHUNKS 16

__device__ __forceinline__ float score(float v, float softcap) {
    return softcap > 0.0f ? tanhf(v / softcap) * softcap : v;
}

extern "C" __global__ void __launch_bounds__(SM_WARPS * 32)
attn_softmax(const float* __restrict__ s, int ld, int n_keys, int rows, const int* __restrict__ pos,
             int t0, int group, int window, float softcap, bf16* __restrict__ p) {
    pdl_wait();
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * SM_WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;  // whole warps
    const long long off = ((long long)blockIdx.y * rows + r) * ld;
    const float* sr = s + off;
    bf16* pr = p + off;
    const int ps = pos[t0 + r / group];
    const int lo = window > 0 ? max(ps + 1 - window, 0) : 0;
    const int hi = min(ps, n_keys - 1);
    if (n_keys <= SM_CHUNKS * 128) {
        float v[SM_CHUNKS][4];
        float mx = NEG_INF;
#pragma unroll
        for (int u = 0; u < SM_CHUNKS; u++) {
            const int k = (lane + u * 32) * 4;
            float4 x = make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
            if (k < n_keys && k + 3 >= lo && k <= hi) x = *(const float4*)(sr + k);
            const float xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const bool in = k + j >= lo && k + j <= hi;
                v[u][j] = in ? score(xs[j], softcap) : NEG_INF;
                mx = fmaxf(mx, v[u][j]);
            }
        }
        mx = warp_max(mx);
        float sum = 0.0f;
#pragma unroll
        for (int u = 0; u < SM_CHUNKS; u++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                v[u][j] = v[u][j] > NEG_INF ? expf(v[u][j] - mx) : 0.0f;
                sum += v[u][j];
            }
        sum = warp_sum(sum);
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
        for (int u = 0; u < SM_CHUNKS; u++) {
            const int k = (lane + u * 32) * 4;
            if (k < n_keys) {
                uint2 o;
                o.x = (u32)f2bf(v[u][0] * inv) | ((u32)f2bf(v[u][1] * inv) << 16);
                o.y = (u32)f2bf(v[u][2] * inv) | ((u32)f2bf(v[u][3] * inv) << 16);
                *(uint2*)(pr + k) = o;  // k + 3 < ld: rows are padded to a multiple of 8
            }
        }
        return;
    }
    float mx = NEG_INF;
    for (int k = lo + lane; k <= hi; k += 32) mx = fmaxf(mx, score(sr[k], softcap));
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int k = lo + lane; k <= hi; k += 32) sum += expf(score(sr[k], softcap) - mx);
    sum = warp_sum(sum);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int k = lane; k < n_keys; k += 32)
        pr[k] = f2bf(k >= lo && k <= hi ? expf(score(sr[k], softcap) - mx) * inv : 0.0f);
}

// Stacked attention output [kv head][t * group + j][HD] -> [t][kv head * group + j][HD] (bf16),
// for tokens t0 .. t0 + gridDim.x of the m stacked ones.
extern "C" __global__ void attn_unstack(const bf16* __restrict__ o, int m, int n_kv, int group,
                                        int t0, bf16* __restrict__ out) {
    pdl_wait();
    const int t = t0 + blockIdx.x;
    const int n_heads = n_kv * group;
    for (int i = threadIdx.x; i < n_heads * (HD / 8); i += blockDim.x) {
        const int h = i / (HD / 8), c = i % (HD / 8);
        const int g = h / group, j = h % group;
        const uint4 v = *(const uint4*)(o + (((long long)g * m + t) * group + j) * HD + c * 8);
        *(uint4*)(out + ((long long)t * n_heads + h) * HD + c * 8) = v;
    }
}

// A sequence's keys and values 0 .. n_keys - 1 from the paged cache into contiguous rows of
// kv_dim (the prefill GEMMs' operands): one block per position, 16-byte copies.
extern "C" __global__ void kv_gather(const bf16* __restrict__ kc, const bf16* __restrict__ vc,
                                     const int* __restrict__ table, int bs, int kv_dim,
                                     bf16* __restrict__ k_out, bf16* __restrict__ v_out) {
    pdl_wait();
    const int p = blockIdx.x;
    const long long src = ((long long)table[p / bs] * bs + p % bs) * kv_dim;
    const long long dst = (long long)p * kv_dim;
    for (int c = threadIdx.x; c < kv_dim / 8; c += blockDim.x) {
        *(uint4*)(k_out + dst + c * 8) = *(const uint4*)(kc + src + c * 8);
        *(uint4*)(v_out + dst + c * 8) = *(const uint4*)(vc + src + c * 8);
    }
}
