// The EXL3 tile encoder: the tail-biting Viterbi of trellm_quant::exl3::encode::viterbi_with on
// the GPU, bit for bit (launcher: crate::viterbi). One module per K (VIT_K = 1..8); the codebook
// is data (its 65536 fp16 values, uploaded once).
//
// A tile's search keeps one f32 cost per edge (the low 16 - K bits of a state, 2^(16-K) of them);
// each step takes, for every edge o, the best of the 2^K states (c << (16-K)) | o, by the CPU's
// rule: cost fma(d, d, prev[state >> K]), d = value(state) - w, its low K bits replaced by c,
// the unsigned minimum of the bit patterns (the stored cost has those bits cleared). A block of 1024 threads runs 1 tile (K <= 6) or 2^(K-6) tiles (one edge a thread)
// in lock step, a __syncthreads a step.
//
// Shared memory: the codebook as fp16 (exact: every value is an fp16) in the order the threads
// read it, (o << K) | c, each edge's 2^K values contiguous, 16-byte chunks XOR-swizzled so the
// lanes of a warp hit distinct banks (128 KiB); the costs, ping-pong (K >= 3; K = 1, 2 keep them
// in global memory: 2 x 128 / 64 KiB would not fit beside the table); the tiles' targets.
// Back-pointers (one byte per edge per step) live in global memory, a region per tile in flight.

#ifndef VIT_K
#define VIT_K 4
#endif
#define KR (16 - VIT_K)
#define EDGES (1 << KR)
#define CANDS (1 << VIT_K)
#define THREADS 1024
#define TPB (VIT_K >= 6 ? (1 << (VIT_K - 6)) : 1)
#define TTHREADS (THREADS / TPB)
#define EPT (EDGES / TTHREADS)
#define COSTS_SMEM (VIT_K >= 3)
#define TABLE_BYTES (65536 * 2)
#define POS_INF __int_as_float(0x7f800000)
#define TAG ((u32)(CANDS - 1))

// One candidate c of an edge: (v, p) its value and previous cost, w the target; `best` the
// tagged minimum so far.
__device__ __forceinline__ void vit_cand(u32& best, float v, float p, float w, u32 c) {
    const float d = __fsub_rn(v, w);
    best = min(best, (__float_as_uint(__fmaf_rn(d, d, p)) & ~TAG) | c);
}

// The swizzle of an edge's 16-byte chunks (XOR on the chunk index, within the edge's row).
__device__ __forceinline__ u32 vit_swizzle(u32 o) {
#if VIT_K <= 3
    return 0;
#elif VIT_K == 4
    return (o >> 2) & 1;
#elif VIT_K == 5
    return (o >> 1) & 3;
#else
    return o & 7;
#endif
}

// Where the value of logical index (o << K) | c lives in the shared table (in halves).
__device__ __forceinline__ u32 vit_phys(u32 l) {
#if VIT_K >= 3
    const u32 o = l >> VIT_K;
    return (((l >> 3) ^ vit_swizzle(o)) << 3) | (l & 7);
#else
    return l;
#endif
}

__device__ __forceinline__ float vit_h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// The smallest cost of (av, ai) and (bv, bi), first index on ties, NaN never wins (unless both
// are): the CPU's argmin.
__device__ __forceinline__ bool vit_better(float bv, int bi, float av, int ai) {
    const bool bn = bv != bv, an = av != av;
    if (bn != an) return an;
    if (bn) return bi < ai;
    return bv < av || (bv == av && bi < ai);
}

// One step for this thread's edges: prev -> next, back-pointers into bp (null: not kept).
__device__ __forceinline__ void vit_step(const unsigned short* __restrict__ tbl, const float* prev,
                                         float* next, unsigned char* bp, float w, u32 t) {
#pragma unroll 1
    for (int e = 0; e < EPT; e++) {
        const u32 o = t + (u32)e * TTHREADS;
        const u32 q = o >> VIT_K;
        const float* pq = prev + q;
        u32 best = 0xffffffffu;
#if VIT_K >= 3
        const uint4* row = reinterpret_cast<const uint4*>(tbl) + (o << (VIT_K - 3));
        const u32 sw = vit_swizzle(o);
#pragma unroll 4
        for (int j = 0; j < CANDS / 8; j++) {
            const uint4 v4 = row[j ^ sw];
            const u32 words[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
            for (int h = 0; h < 8; h++) {
                const int c = j * 8 + h;
                const float v = vit_h2f((unsigned short)(words[h >> 1] >> (16 * (h & 1))));
                vit_cand(best, v, pq[c << (KR - VIT_K)], w, c);
            }
        }
#else
        u32 words[CANDS / 2];
#if VIT_K == 2
        const uint2 v2 = reinterpret_cast<const uint2*>(tbl)[o];
        words[0] = v2.x;
        words[1] = v2.y;
#else
        words[0] = reinterpret_cast<const u32*>(tbl)[o];
#endif
#pragma unroll
        for (int c = 0; c < CANDS; c++) {
            const float v = vit_h2f((unsigned short)(words[c >> 1] >> (16 * (c & 1))));
            vit_cand(best, v, pq[c << (KR - VIT_K)], w, c);
        }
#endif
        next[o] = __uint_as_float(best & ~TAG);
        if (bp) bp[o] = (unsigned char)(best & TAG);
    }
}

// One forward pass of `steps` steps over positions (i + roll) & 255 from edge `start` (< 0: any
// edge at cost 0), back-pointers of steps >= keep_from stored; returns the buffer holding the
// final costs. Block-uniform arguments but `start` (per tile).
__device__ float* vit_forward(float* ping, float* pong, const unsigned short* tbl, const float* tg,
                              unsigned char* bp, int steps, int roll, int keep_from, int start,
                              u32 t) {
    for (int e = 0; e < EPT; e++) {
        const u32 o = t + (u32)e * TTHREADS;
        ping[o] = (start < 0 || o == (u32)start) ? 0.0f : POS_INF;
    }
    __syncthreads();
    float* prev = ping;
    float* next = pong;
    for (int i = 0; i < steps; i++) {
        const float w = tg[(i + roll) & 255];
        vit_step(tbl, prev, next, i >= keep_from ? bp + (size_t)i * EDGES : nullptr, w, t);
        __syncthreads();
        float* x = prev;
        prev = next;
        next = x;
    }
    return prev;
}

// Encodes `ntiles` tiles (targets in position order, 256 each): their states (256 u16 each; the
// launcher sums the cost from them, as the CPU does). Each block loops over groups of TPB tiles;
// `bp` holds 256 x EDGES bytes per tile in flight (gridDim.x x TPB of them), `gcost` (K = 1, 2)
// 2 x EDGES floats per tile in flight. Pass 1: p1_steps steps over positions (p1_roll + i) & 255
// from a free start, traced back from its best end over steps p1_steps - 1 down to p1_keep to the
// wrap edge; pass 2: 256 steps from the wrap edge (forced) back to it. With `open_out`, pass 1
// alone: its best final cost per tile (encode::open_cost_with), no states.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
viterbi_tiles(const unsigned short* __restrict__ gtab, const float* __restrict__ targets,
              int ntiles, unsigned char* __restrict__ bp_all, float* gcost,
              unsigned short* __restrict__ states_out, float* __restrict__ open_out, int p1_steps,
              int p1_roll, int p1_keep) {
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned short* tbl = reinterpret_cast<unsigned short*>(smem);
    unsigned char* after = smem + TABLE_BYTES;
#if COSTS_SMEM
    float* costs = reinterpret_cast<float*>(after);
    after += TPB * 2 * EDGES * 4;
#endif
    float* tg_all = reinterpret_cast<float*>(after);
    after += TPB * 256 * 4;
    float* red_v = reinterpret_cast<float*>(after);
    int* red_i = reinterpret_cast<int*>(after + 32 * 4);
    int* edge_s = reinterpret_cast<int*>(after + 64 * 4);

    const u32 tid = threadIdx.x;
    for (u32 l = tid; l < 65536; l += THREADS) {
        const u32 o = l >> VIT_K, c = l & (CANDS - 1);
        tbl[vit_phys(l)] = gtab[(c << KR) | o];
    }

    const u32 tib = tid / TTHREADS;  // tile in block
    const u32 t = tid % TTHREADS;    // thread in tile
    const u32 lane = tid & 31, warp = tid >> 5;
    const u32 warps_per_tile = TTHREADS / 32;
    const size_t slot = (size_t)blockIdx.x * TPB + tib;
    unsigned char* bp = bp_all + slot * 256 * EDGES;
#if COSTS_SMEM
    float* ping = costs + tib * 2 * EDGES;
#else
    float* ping = gcost + slot * 2 * EDGES;
#endif
    float* pong = ping + EDGES;
    float* tg = tg_all + tib * 256;

    for (int base = blockIdx.x * TPB; base < ntiles; base += gridDim.x * TPB) {
        const int tile = base + (int)tib;
        const bool valid = tile < ntiles;
        __syncthreads();  // the previous group's reads of tg / edge_s are done
        for (u32 i = t; i < 256; i += TTHREADS) tg[i] = valid ? targets[(size_t)tile * 256 + i] : 0.0f;

        // Pass 1.
        float* fin = vit_forward(ping, pong, tbl, tg, bp, p1_steps, p1_roll, p1_keep, -1, t);
        float bv = POS_INF;
        int bi = 0;
        bool first = true;
        for (int e = 0; e < EPT; e++) {
            const u32 o = t + (u32)e * TTHREADS;
            const float v = fin[o];
            if (first || vit_better(v, o, bv, bi)) {
                bv = v;
                bi = o;
                first = false;
            }
        }
#pragma unroll
        for (int m = 1; m < 32; m <<= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, bv, m);
            const int oi = __shfl_xor_sync(FULL_MASK, bi, m);
            if (vit_better(ov, oi, bv, bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            red_v[warp] = bv;
            red_i[warp] = bi;
        }
        __syncthreads();
        if (t == 0) {
            const u32 w0 = tib * warps_per_tile;
            float v = red_v[w0];
            int end = red_i[w0];
            for (u32 w = 1; w < warps_per_tile; w++) {
                if (vit_better(red_v[w0 + w], red_i[w0 + w], v, end)) {
                    v = red_v[w0 + w];
                    end = red_i[w0 + w];
                }
            }
            if (open_out) {
                if (valid) open_out[tile] = v;
                continue;
            }
            u32 edge = end;
            for (int i = p1_steps - 1; i >= p1_keep; i--) {
                const u32 state = ((u32)bp[(size_t)i * EDGES + edge] << KR) | edge;
                edge = state >> VIT_K;
            }
            edge_s[tib] = (int)edge;
        }
        if (open_out) continue;  // block-uniform
        __syncthreads();
        const int wrap = edge_s[tib];

        // Pass 2.
        vit_forward(ping, pong, tbl, tg, bp, 256, 0, 0, wrap, t);
        if (t == 0 && valid) {
            unsigned short* st = states_out + (size_t)tile * 256;
            u32 edge = wrap;
            for (int i = 255; i >= 0; i--) {
                const u32 state = ((u32)bp[(size_t)i * EDGES + edge] << KR) | edge;
                st[i] = (unsigned short)state;
                edge = state >> VIT_K;
            }
        }
    }
}
