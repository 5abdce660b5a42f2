// Shared definitions, prepended to every kernel source before NVRTC compiles it. No CUDA headers
// are needed: bf16 values travel as raw 16-bit words and are widened with shifts.
typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

// bf16 -> f32: the bf16 bits are the top half of the f32.
__device__ __forceinline__ float bf2f(bf16 v) { return __uint_as_float(((u32)v) << 16); }
// The low and high bf16 of a packed pair (element 2i is the low half, little endian).
__device__ __forceinline__ float bflo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bfhi(u32 w) { return __uint_as_float(w & 0xffff0000u); }
// f32 -> bf16, round to nearest even; NaN stays NaN.
__device__ __forceinline__ bf16 f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

// The shared-memory address of `p` (a pointer into this block's shared memory).
__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}
// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch /* 33 floats */) {
    v = warp_sum(v);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) scratch[w] = v;
    __syncthreads();
    if (w == 0) {
        v = (l < (int)(blockDim.x >> 5)) ? scratch[l] : 0.0f;
        v = warp_sum(v);
        if (l == 0) scratch[32] = v;
    }
    __syncthreads();
    return scratch[32];
}

// Activations, written as the CPU reference (backend::cpu) writes them.
#define ACT_SILU 0
#define ACT_GELU_TANH 1
#define ACT_GELU 2
__device__ __forceinline__ float activate(float x, int act) {
    if (act == ACT_SILU) return x / (1.0f + expf(-x));
    if (act == ACT_GELU_TANH) {
        const float c = 0.7978846f;
        return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
    }
    return x * (1.0f + erff(x * 0.70710678f)) * 0.5f;
}

// A 16-byte load that bypasses L1 (weights are read once per token).
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

// Programmatic dependent launch (sm_90+; the kernels a source lists in `dependent_launch`): such
// a kernel may be started while the kernel before it still runs. pdl_wait() first lets the
// kernel after it start too, then waits for the one before to finish; nothing before it may touch
// memory another kernel writes or reads (only immutable weights may be read). Started early, the
// next kernels' blocks wait resident and their weight loads are in flight: EXL3 decode 276.5 ->
// 288 tok/s at K = 3, against 284.6 with the launch let go after the wait (H200, session 11).
// Without the launch attribute both are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Thread-block clusters (sm_90+): the barrier over all threads of the cluster's blocks, the
// block's rank and the cluster's size, and a load from a peer block's shared memory.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Only that every block of the cluster got here (no memory ordering): keeps a block's shared
// memory alive until its peers have read it.
__device__ __forceinline__ void cluster_sync_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ u32 cluster_size() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
    return r;
}
// `p` points into this block's shared memory; the same variable in block `rank` is read.
__device__ __forceinline__ float ld_cluster(const float* p, u32 rank) {
    u32 a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_addr(p)), "r"(rank));
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a) : "memory");
    return v;
}
#endif

// c += A B on tensor cores, one m16n8k16 tile: bf16 operands (A row-major a0..a3, B column-major
// b0, b1, as packed pairs), f32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A 16-byte read-only load through L1 (activation vectors every warp of a block reads).
__device__ __forceinline__ uint4 ld_nc(const void* p) {
    uint4 r;
    asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

// sin and cos of a RoPE angle in the hot kernels' epilogues: sincosf's slow path for large angles
// needs a stack frame, so the angle is reduced by 2 pi (Cody-Waite, two parts) and the fast
// intrinsic runs on [-pi, pi].
__device__ __forceinline__ void rope_sincos(float ang, float* sn, float* cs) {
    const float kk = rintf(ang * 0.15915494309189535f);
    float red = fmaf(-kk, 6.28318548202514648f, ang);
    red = fmaf(-kk, -1.7484555e-7f, red);
    __sincosf(red, sn, cs);
}

// The KV-cache slot of position p of a token's sequence: through its block table (paged cache,
// blocks of bs positions), or p itself without one (a contiguous cache).
__device__ __forceinline__ long long kv_slot(const int* tables, const int* table_off, int t, int p,
                                             int bs) {
    return tables ? (long long)tables[table_off[t] + p / bs] * bs + p % bs : (long long)p;
}
