// Row-wise kernels of the dense decoder: embedding, norms (fused with the residual add),
// activations, logits post-processing and argmax, and seeded synthetic weights.

// x[t] = table[tokens[t]] * scale, one block per token.
extern "C" __global__ void embed_rows(const int* __restrict__ tokens, const bf16* __restrict__ table,
                                      int h, float scale, float* __restrict__ x) {
    pdl_wait();
    const long long t = blockIdx.x;
    const bf16* row = table + (long long)tokens[t] * h;
    for (int i = threadIdx.x; i < h; i += blockDim.x) x[t * h + i] = bf2f(row[i]) * scale;
}

// Normalizes v (n values at stride 1) into out: RMSNorm, or LayerNorm when `layer` is set.
// Writes f32 and/or bf16 outputs, either may be null; a null `w` copies. In place is allowed.
__device__ __forceinline__ void norm_one(const float* v, int n, const float* w, const float* b,
                                         float eps, int layer, float* of, bf16* ob,
                                         float* scratch) {
    if (!w) {  // no norm: a plain copy
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            if (of) of[i] = v[i];
            if (ob) ob[i] = f2bf(v[i]);
        }
        return;
    }
    float mean = 0.0f;
    if (layer) {
        float s = 0.0f;
        for (int i = threadIdx.x; i < n; i += blockDim.x) s += v[i];
        mean = block_sum(s, scratch) / (float)n;
    }
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float d = v[i] - mean;
        ss += d * d;
    }
    const float r = 1.0f / sqrtf(block_sum(ss, scratch) / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float y = layer ? ((v[i] - mean) * r) * w[i] + b[i] : w[i] * (v[i] * r);
        if (of) of[i] = y;
        if (ob) ob[i] = f2bf(y);
    }
}

// One block per row: out[row] = norm(x[row]); rows at `x_stride` (f32 out at the same stride).
extern "C" __global__ void norm_rows(float* x, int x_stride, int n, const float* __restrict__ w,
                                     const float* __restrict__ b, float eps, int layer,
                                     float* out_f32, bf16* out_bf16, int out_stride) {
    pdl_wait();
    __shared__ float scratch[33];
    const long long r = blockIdx.x;
    norm_one(x + r * x_stride, n, w, b, eps, layer, out_f32 ? out_f32 + r * x_stride : 0,
             out_bf16 ? out_bf16 + r * out_stride : 0, scratch);
}

#define RN_CHUNKS 4  // float4s per thread on residual_norm's one-pass path

// One block per row of the residual stream x [rows, h]:
//   y += ybias; y = post_norm(y) (if pw); x += y * rscale; xn = norm(x) (a copy without nw).
// `y_stride` lets a caller pass only some rows of y (the last, for logits).
extern "C" __global__ void residual_norm(float* __restrict__ x, float* __restrict__ y, int h,
                                         const float* __restrict__ ybias,
                                         const float* __restrict__ pw, const float* __restrict__ pb,
                                         float rscale, const float* __restrict__ nw,
                                         const float* __restrict__ nb, float eps, int layer,
                                         bf16* __restrict__ xn) {
    pdl_wait();
    __shared__ float scratch[33];
    const long long r = blockIdx.x;
    float* xr = x + r * h;
    float* yr = y + r * h;
    if (!ybias && !pw && (h & 3) == 0 && h <= RN_CHUNKS * 4 * (int)blockDim.x) {
        // The common case in one pass: each thread keeps its float4s of the new x in registers.
        float4 v[RN_CHUNKS];
        float sum = 0.0f;
#pragma unroll
        for (int u = 0; u < RN_CHUNKS; u++) {
            const int k = (threadIdx.x + u * blockDim.x) * 4;
            v[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (k < h) {
                const float4 a = *(const float4*)(xr + k), b = *(const float4*)(yr + k);
                v[u] = make_float4(a.x + b.x * rscale, a.y + b.y * rscale, a.z + b.z * rscale,
                                   a.w + b.w * rscale);
                *(float4*)(xr + k) = v[u];
                sum += (v[u].x + v[u].y) + (v[u].z + v[u].w);
            }
        }
        bf16* xo = xn + r * h;
        const float mean = nw && layer ? block_sum(sum, scratch) / (float)h : 0.0f;
        float ss = 0.0f;
#pragma unroll
        for (int u = 0; u < RN_CHUNKS; u++) {
            const int k = (threadIdx.x + u * blockDim.x) * 4;
            if (k < h) {
                const float d[4] = {v[u].x - mean, v[u].y - mean, v[u].z - mean, v[u].w - mean};
                ss += (d[0] * d[0] + d[1] * d[1]) + (d[2] * d[2] + d[3] * d[3]);
            }
        }
        const float rs = nw ? 1.0f / sqrtf(block_sum(ss, scratch) / (float)h + eps) : 1.0f;
#pragma unroll
        for (int u = 0; u < RN_CHUNKS; u++) {
            const int k = (threadIdx.x + u * blockDim.x) * 4;
            if (k >= h) continue;
            const float vv[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
            bf16 o[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float yv = vv[j];
                if (nw)
                    yv = layer ? ((vv[j] - mean) * rs) * nw[k + j] + nb[k + j]
                               : nw[k + j] * (vv[j] * rs);
                o[j] = f2bf(yv);
            }
            *(uint2*)(xo + k) = make_uint2(o[0] | ((u32)o[1] << 16), o[2] | ((u32)o[3] << 16));
        }
        return;
    }
    if (ybias) {
        for (int i = threadIdx.x; i < h; i += blockDim.x) yr[i] += ybias[i];
        __syncthreads();
    }
    if (pw) {
        norm_one(yr, h, pw, pb, eps, layer, yr, 0, scratch);
        __syncthreads();
    }
    for (int i = threadIdx.x; i < h; i += blockDim.x) xr[i] += yr[i] * rscale;
    __syncthreads();
    norm_one(xr, h, nw, nb, eps, layer, 0, xn + r * h, scratch);
}

// Prefill MLP activation: gu [rows, 2*ff] (gate | up) -> out [rows, ff] = act(g) * u; or, when
// not gated, gu [rows, ff] -> act(u). Biases (over gu's columns) are added first. gu is f32, or
// bf16 when `gu_bf16` is set. Each thread takes 4 consecutive outputs (16-byte loads where ff
// is a multiple of 4 and gu is f32).
extern "C" __global__ void act_rows(const float* __restrict__ gf, const float* __restrict__ bias,
                                    int ff, int gated, int act, bf16* __restrict__ out) {
    pdl_wait();
    const long long r = blockIdx.y;
    const int i0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i0 >= ff) return;
    const long long gate0 = gated ? r * 2 * ff : r * ff, up0 = gated ? gate0 + ff : gate0;
    float g[4], u[4];
    if ((ff & 3) == 0) {
        const float4 gv = *(const float4*)(gf + gate0 + i0);
        const float4 uv = *(const float4*)(gf + up0 + i0);
        g[0] = gv.x; g[1] = gv.y; g[2] = gv.z; g[3] = gv.w;
        u[0] = uv.x; u[1] = uv.y; u[2] = uv.z; u[3] = uv.w;
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int i = min(i0 + j, ff - 1);
            g[j] = gf[gate0 + i];
            u[j] = gf[up0 + i];
        }
    }
    bf16 y[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int i = min(i0 + j, ff - 1);
        if (gated) {
            float gg = g[j], uu = u[j];
            if (bias) { gg += bias[i]; uu += bias[ff + i]; }
            y[j] = f2bf(activate(gg, act) * uu);
        } else {
            y[j] = f2bf(activate(u[j] + (bias ? bias[i] : 0.0f), act));
        }
    }
    if ((ff & 3) == 0) {
        *(uint2*)(out + r * ff + i0) =
            make_uint2(y[0] | ((u32)y[1] << 16), y[2] | ((u32)y[3] << 16));
    } else {
        for (int j = 0; j < 4 && i0 + j < ff; j++) out[r * ff + i0 + j] = y[j];
    }
}

// Order-preserving map of a float onto an unsigned int.
__device__ __forceinline__ u32 float_key(float f) {
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Logits post-processing (softcap, then divisor; 0 = off) in place, and each block's best
// (value key, lowest index) packed in a u64 for the final pass.
extern "C" __global__ void logits_argmax_partial(float* __restrict__ logits, int n, float softcap,
                                                 float divisor, u64* __restrict__ partial) {
    pdl_wait();
    __shared__ u64 best_w[32];
    u64 best = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float v = logits[i];
        if (softcap > 0.0f) v = tanhf(v / softcap) * softcap;
        if (divisor != 0.0f) v = v / divisor;
        if (softcap > 0.0f || divisor != 0.0f) logits[i] = v;
        const u64 key = ((u64)float_key(v) << 32) | (u64)(0xffffffffu - (u32)i);
        best = key > best ? key : best;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(FULL_MASK, best, o);
        best = other > best ? other : best;
    }
    if ((threadIdx.x & 31) == 0) best_w[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) best = best_w[w] > best ? best_w[w] : best;
        partial[blockIdx.x] = best;
    }
}

// Reduces the partial maxima: token[0] = argmax. For graph-replayed decoding it also appends the
// token to `history` (at index *count, then increments it) and advances the position by one.
extern "C" __global__ void argmax_final(const u64* __restrict__ partial, int n_partial,
                                        int* __restrict__ token, int* pos, int* history,
                                        int* count) {
    pdl_wait();
    u64 best = 0;
    for (int i = threadIdx.x; i < n_partial; i += 32) best = partial[i] > best ? partial[i] : best;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(FULL_MASK, best, o);
        best = other > best ? other : best;
    }
    if (threadIdx.x == 0) {
        const int id = (int)(0xffffffffu - (u32)(best & 0xffffffffu));
        token[0] = id;
        if (pos) pos[0] += 1;
        if (history) {
            history[count[0]] = id;
            count[0] += 1;
        }
    }
}

// Seeded uniform values in [-scale, scale) as bf16 (splitmix64 of the index).
extern "C" __global__ void fill_uniform_bf16(bf16* __restrict__ p, u64 n, u64 seed, float scale) {
    pdl_wait();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        const float u = (float)(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
        p[i] = f2bf((2.0f * u - 1.0f) * scale);
    }
}

// Seeded random 32-bit words (synthetic EXL3 trellis: every bit pattern is a valid code).
extern "C" __global__ void fill_random_u32(u32* __restrict__ p, u64 n, u64 seed) {
    pdl_wait();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        p[i] = (u32)(z ^ (z >> 31));
    }
}

extern "C" __global__ void fill_f32(float* __restrict__ p, u64 n, float v) {
    pdl_wait();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        p[i] = v;
}

// Busy-waits `ns` nanoseconds of the global timer (lets a profile queue its work first).
extern "C" __global__ void spin_ns(u64 ns) {
    pdl_wait();
    u64 t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}

// out[r] = x[rows[r]] for rows of n bf16 values (the rows whose logits a batch wants).
extern "C" __global__ void gather_rows(const bf16* __restrict__ x, const int* __restrict__ rows,
                                       int n, bf16* __restrict__ out) {
    pdl_wait();
    const long long src = (long long)rows[blockIdx.x] * n, dst = (long long)blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[dst + i] = x[src + i];
}
