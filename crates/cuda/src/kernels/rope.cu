// q/k/v post-processing after the fused qkv projection, one warp per head:
// bias, per-head RMSNorm of q and k, RoPE (half-split or interleaved, on the first `rot` dims,
// per-row positions), attention scale folded into q, and k/v written into the layer's cache.
// q goes to q_stacked (bf16, the prefill GEMMs' layout) and/or q_out (f32), whichever is given.
// With block tables (`tables`, each token's at `table_off[t]`), k/v go to the paged slots.

#define ROPE_WARPS 8
#define MAX_HD 256

extern "C" __global__ void __launch_bounds__(ROPE_WARPS * 32)
qkv_rope(const float* __restrict__ qkv, const float* __restrict__ bias, const int* __restrict__ pos,
         int n_heads, int n_kv, int hd, const float* __restrict__ q_norm,
         const float* __restrict__ k_norm, float eps, const float* __restrict__ inv_freq, int rot,
         int interleaved, float pos_scale, float in_scale, float q_scale, float* __restrict__ q_out,
         bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, bf16* __restrict__ q_stacked,
         const int* __restrict__ tables, const int* __restrict__ table_off, int bs) {
    pdl_wait();
    __shared__ float buf[ROPE_WARPS][MAX_HD];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int head = blockIdx.y * ROPE_WARPS + warp;
    if (head >= n_heads + n_kv) return;
    const long long t = blockIdx.x;
    const int q_dim = n_heads * hd, kv_dim = n_kv * hd;
    const float* row = qkv + t * (long long)(q_dim + 2 * kv_dim);
    const bool is_q = head < n_heads;
    const int off = is_q ? head * hd : q_dim + (head - n_heads) * hd;
    const int p = pos[t];
    float* s = buf[warp];

    for (int d = lane; d < hd; d += 32) s[d] = row[off + d] + (bias ? bias[off + d] : 0.0f);
    __syncwarp();
    const float* nw = is_q ? q_norm : k_norm;
    if (nw) {
        float ss = 0.0f;
        for (int d = lane; d < hd; d += 32) ss += s[d] * s[d];
        const float r = 1.0f / sqrtf(warp_sum(ss) / (float)hd + eps);
        __syncwarp();
        for (int d = lane; d < hd; d += 32) s[d] = nw[d] * (s[d] * r);
        __syncwarp();
    }
    if (inv_freq) {
        const int half = rot / 2;
        const float pf = (float)p * pos_scale;
        // Each lane rotates whole pairs, so reads and writes of a pair stay in one lane.
        for (int i = lane; i < half; i += 32) {
            const int a = interleaved ? 2 * i : i;
            const int b = interleaved ? 2 * i + 1 : i + half;
            float sn, cs;
            sincosf(pf * inv_freq[i], &sn, &cs);
            const float x1 = s[a] * in_scale, x2 = s[b] * in_scale;
            s[a] = x1 * cs - x2 * sn;
            s[b] = x1 * sn + x2 * cs;
        }
        __syncwarp();
    }
    if (is_q) {
        if (q_stacked) {
            // bf16, stacked per kv head for the batched GEMMs: [kv head][t * group + j][hd].
            const int group = n_heads / n_kv, g = head / group, j = head % group;
            bf16* out = q_stacked + (((long long)g * gridDim.x + t) * group + j) * hd;
            for (int d = lane; d < hd; d += 32) out[d] = f2bf(s[d] * q_scale);
        }
        if (q_out) {
            float* out = q_out + t * q_dim + off;
            for (int d = lane; d < hd; d += 32) out[d] = s[d] * q_scale;
        }
    } else {
        const int kvh = head - n_heads;
        const long long c = (kv_slot(tables, table_off, (int)t, p, bs) * n_kv + kvh) * hd;
        for (int d = lane; d < hd; d += 32) {
            k_cache[c + d] = f2bf(s[d]);
            const int vo = q_dim + kv_dim + kvh * hd + d;
            v_cache[c + d] = f2bf(row[vo] + (bias ? bias[vo] : 0.0f));
        }
    }
}
