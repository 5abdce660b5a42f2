// Probe for issue 14's batch-1 decode: what a phase boundary costs as a kernel launch (in a CUDA
// graph, with programmatic dependent launch) against a grid barrier inside one persistent kernel.
// Each phase is a layer-sized split-K GEMV stand-in: 32 bands x 16 splits = 512 blocks of 256
// threads, each reading `bytes` of weights (16-byte loads) and writing 128 partial sums; the next
// phase reads the previous phase's output, so every phase depends on the one before. Modes:
//   1   launches; the band's last block sums the splits through a fence and a counter, as
//       exl3.cu's finish_band does;
//   1b  launches; every block sums the splits of the band it reads itself (no finish);
//   2   persistent; barrier, one block a band sums the splits, barrier;
//   3   persistent; one barrier, every block sums what it reads (3p: the next phase's weights read
//       before the barrier; 3t, 3tp: the same with a two-level barrier).
//
//   nvcc -O3 -arch=sm_90 -o grid_barrier grid_barrier.cu && ./grid_barrier
//
// Prints microseconds a phase for each mode at several weight sizes (median of 5 runs of 128
// phases, the EXL3 launches of one Llama-3.1-8B token).
#include <cooperative_groups.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>

#define CHECK(x)                                                                \
    do {                                                                        \
        cudaError_t e = (x);                                                    \
        if (e != cudaSuccess) {                                                 \
            printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));    \
            exit(1);                                                            \
        }                                                                       \
    } while (0)

constexpr int BANDS = 32, SPLITS = 16, BLOCKS = BANDS * SPLITS, THREADS = 256, PHASES = 128;

__device__ __forceinline__ void pdl_launch_next() { asm volatile("griddepcontrol.launch_dependents;"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// The block's weight stream for phase p: `words` uint4s, summed so the loads are not dead.
__device__ __forceinline__ float stream(const uint4* __restrict__ w, long long words, int phase,
                                        int block) {
    const uint4* p = w + ((long long)(phase * BLOCKS + block) * words) % (1LL << 26);
    float s = 0.0f;
    for (long long i = threadIdx.x; i < words; i += THREADS) {
        const uint4 v = __ldg(p + i);
        s += __int_as_float(v.x & 0x3f7fffff) + __int_as_float(v.w & 0x3f7fffff);
    }
    return s;
}

// The block's input: the previous phase's output band `band`, as the real layers read theirs.
__device__ __forceinline__ float input_of(const float* __restrict__ y, int band) {
    return y[band * 128 + (threadIdx.x & 127)];
}

// Mode 1: one launch a phase, the band's last block sums the splits (fence + counter).
__global__ void __launch_bounds__(THREADS) phase_launch(const uint4* __restrict__ w, long long words,
                                                        int phase, const float* __restrict__ x,
                                                        float* __restrict__ partial,
                                                        unsigned* __restrict__ counters,
                                                        float* __restrict__ y) {
    const int band = blockIdx.x, split = blockIdx.y, block = split * BANDS + band;
    pdl_launch_next();
    float s = stream(w, words, phase, block);  // weights do not depend on the phase before
    pdl_wait();
    s += input_of(x, (band + split) % BANDS);
    if (threadIdx.x < 128) partial[(split * BANDS + band) * 128 + threadIdx.x] = s;
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&counters[band], 1u) == SPLITS - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x < 128) {
        float v = 0.0f;
        for (int sp = 0; sp < SPLITS; sp++) v += __ldcg(&partial[(sp * BANDS + band) * 128 + threadIdx.x]);
        y[band * 128 + threadIdx.x] = v * 1e-3f;
    }
    if (threadIdx.x == 0) counters[band] = 0;
}

// Mode 1b: one launch a phase, no finish: each block sums the splits of the band it reads from
// the previous phase's partials itself (double-buffered).
__global__ void __launch_bounds__(THREADS) phase_launch_consumer(const uint4* __restrict__ w,
                                                                 long long words, int phase,
                                                                 const float* __restrict__ prev,
                                                                 float* __restrict__ partial) {
    const int band = blockIdx.x, split = blockIdx.y, block = split * BANDS + band;
    pdl_launch_next();
    float s = stream(w, words, phase, block);
    pdl_wait();
    const int rb = (band + split) % BANDS;
    float in = 0.0f;
    if (threadIdx.x < 128)
        for (int sp = 0; sp < SPLITS; sp++) in += __ldcg(&prev[(sp * BANDS + rb) * 128 + threadIdx.x]);
    s += in * 1e-3f;
    if (threadIdx.x < 128) partial[(split * BANDS + band) * 128 + threadIdx.x] = s;
}

// A grid barrier for co-resident blocks: one arrival counter, a generation word to spin on.
__device__ __forceinline__ void grid_barrier(unsigned* count, unsigned* gen) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned g;
        asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(g) : "l"(gen) : "memory");
        __threadfence();
        if (atomicAdd(count, 1u) == gridDim.x - 1) {
            *count = 0;
            asm volatile("st.release.gpu.u32 [%0], %1;" ::"l"(gen), "r"(g + 1) : "memory");
        } else {
            unsigned now;
            do {
                asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(now) : "l"(gen) : "memory");
            } while (now == g);
        }
    }
    __syncthreads();
}

// The same barrier as a two-level tree: blocks arrive on one of 32 counters (each on its own
// 128-byte line), the last of each group on the top counter; all spin on the generation word.
__device__ __forceinline__ void tree_barrier(unsigned* bar) {
    unsigned* gen = bar + 33 * 32;
    unsigned* top = bar + 32 * 32;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned g;
        asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(g) : "l"(gen) : "memory");
        __threadfence();
        unsigned* mine = bar + (blockIdx.x % 32) * 32;
        if (atomicAdd(mine, 1u) == gridDim.x / 32 - 1) {
            *mine = 0;
            if (atomicAdd(top, 1u) == 31) {
                *top = 0;
                asm volatile("st.release.gpu.u32 [%0], %1;" ::"l"(gen), "r"(g + 1) : "memory");
            }
        }
        unsigned now;
        do {
            asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(now) : "l"(gen) : "memory");
        } while (now == g);
    }
    __syncthreads();
}

// Modes 2 and 3: all phases in one persistent launch (gridDim.x = BLOCKS, all resident).
// two_barriers: partials, barrier, one block a band sums them into y, barrier (mode 2).
// Otherwise each block sums the band it reads from the partials itself after one barrier
// (mode 3). prefetch: the next phase's weights are read before the barrier.
__global__ void __launch_bounds__(THREADS) persistent(const uint4* __restrict__ w, long long words,
                                                      float* __restrict__ partial, float* __restrict__ y,
                                                      unsigned* bar, int two_barriers, int prefetch,
                                                      int tree) {
    const int block = blockIdx.x, band = block % BANDS, split = block / BANDS;
    float* part[2] = {partial, partial + BLOCKS * 128};
    float carry = 0.0f;
    float next = prefetch ? stream(w, words, 0, block) : 0.0f;
    for (int phase = 0; phase < PHASES; phase++) {
        const int rb = (band + split) % BANDS;
        float in;
        if (phase == 0) {
            in = 0.0f;
        } else if (two_barriers) {
            in = input_of(y, rb);
        } else {
            in = 0.0f;
            const float* pp = part[(phase - 1) & 1];
            if (threadIdx.x < 128)
                for (int sp = 0; sp < SPLITS; sp++) in += __ldcg(&pp[(sp * BANDS + rb) * 128 + threadIdx.x]);
            in *= 1e-3f;
        }
        float s = prefetch ? next : stream(w, words, phase, block);
        s += in + carry;
        if (threadIdx.x < 128) part[phase & 1][(split * BANDS + band) * 128 + threadIdx.x] = s;
        if (prefetch && phase + 1 < PHASES) next = stream(w, words, phase + 1, block);
        if (tree) tree_barrier(bar + 64); else grid_barrier(bar, bar + 32);
        if (two_barriers) {
            if (split == 0 && threadIdx.x < 128) {
                float v = 0.0f;
                for (int sp = 0; sp < SPLITS; sp++)
                    v += __ldcg(&part[phase & 1][(sp * BANDS + band) * 128 + threadIdx.x]);
                y[band * 128 + threadIdx.x] = v * 1e-3f;
            }
            if (tree) tree_barrier(bar + 64); else grid_barrier(bar, bar + 32);
        }
        carry = s * 1e-9f;
    }
    if (threadIdx.x == 0 && carry == 12345.0f) y[0] = carry;
}

// A graph of PHASES launches, each made by launch(config, phase) with programmatic dependent
// launch allowed.
template <class Launch>
static cudaGraphExec_t capture(cudaStream_t st, Launch launch) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int p = 0; p < PHASES; p++) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(BANDS, SPLITS);
        cfg.blockDim = dim3(THREADS);
        cfg.stream = st;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        CHECK(launch(&cfg, p));
    }
    CHECK(cudaStreamEndCapture(st, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CHECK(cudaGraphDestroy(graph));
    return exec;
}

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main() {
    int sms;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    int per_sm;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persistent, THREADS, 0));
    printf("SMs %d, persistent blocks per SM %d (need %d resident)\n", sms, per_sm, BLOCKS);
    if (per_sm * sms < BLOCKS) return 1;
    uint4* w;
    const size_t wbytes = (1LL << 26) * 16 + (1 << 24);
    CHECK(cudaMalloc(&w, wbytes));
    CHECK(cudaMemset(w, 0x11, wbytes));
    float *partial, *y[2];
    unsigned *counters, *bar;
    CHECK(cudaMalloc(&partial, 2 * BLOCKS * 128 * sizeof(float)));
    CHECK(cudaMalloc(&y[0], BANDS * 128 * sizeof(float)));
    CHECK(cudaMalloc(&y[1], BANDS * 128 * sizeof(float)));
    CHECK(cudaMemset(y[0], 0, BANDS * 128 * sizeof(float)));
    CHECK(cudaMemset(y[1], 0, BANDS * 128 * sizeof(float)));
    CHECK(cudaMalloc(&counters, BANDS * sizeof(unsigned)));
    CHECK(cudaMemset(counters, 0, BANDS * sizeof(unsigned)));
    CHECK(cudaMalloc(&bar, 4096 * sizeof(unsigned)));
    CHECK(cudaMemset(bar, 0, 4096 * sizeof(unsigned)));
    cudaStream_t st;
    CHECK(cudaStreamCreate(&st));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));

    // 0, 20 KB (a q/k/v-sized layer at 3 bits over 512 blocks: 10 MB), 40 KB (down: 20 MB).
    for (long long kb : {0LL, 20LL, 40LL}) {
        const long long words = kb * 1024 / 16;
        // Modes 1 and 1b: graphs of PHASES launches with PDL.
        float* pb[2] = {partial, partial + BLOCKS * 128};
        cudaGraphExec_t exec = capture(st, [&](cudaLaunchConfig_t* cfg, int p) {
            return cudaLaunchKernelEx(cfg, phase_launch, (const uint4*)w, words, p,
                                      (const float*)y[p & 1], partial, counters, y[(p + 1) & 1]);
        });
        cudaGraphExec_t exec_c = capture(st, [&](cudaLaunchConfig_t* cfg, int p) {
            return cudaLaunchKernelEx(cfg, phase_launch_consumer, (const uint4*)w, words, p,
                                      (const float*)pb[p & 1], pb[(p + 1) & 1]);
        });
        std::vector<float> t0;
        std::vector<float> t1, t2, t3, t4, t5, t6;
        for (int r = 0; r < 7; r++) {
            float ms;
            CHECK(cudaEventRecord(e0, st));
            CHECK(cudaGraphLaunch(exec, st));
            CHECK(cudaEventRecord(e1, st));
            CHECK(cudaEventSynchronize(e1));
            CHECK(cudaEventElapsedTime(&ms, e0, e1));
            if (r >= 2) t1.push_back(ms * 1000.0f / PHASES);
            CHECK(cudaEventRecord(e0, st));
            CHECK(cudaGraphLaunch(exec_c, st));
            CHECK(cudaEventRecord(e1, st));
            CHECK(cudaEventSynchronize(e1));
            CHECK(cudaEventElapsedTime(&ms, e0, e1));
            if (r >= 2) t0.push_back(ms * 1000.0f / PHASES);
            for (int mode = 0; mode < 5; mode++) {
                int two = mode == 0, pre = mode == 2 || mode == 4, tree = mode >= 3;
                void* args[] = {(void*)&w, (void*)&words, (void*)&partial, (void*)&y[0], (void*)&bar,
                                (void*)&two, (void*)&pre, (void*)&tree};
                CHECK(cudaEventRecord(e0, st));
                CHECK(cudaLaunchCooperativeKernel((void*)persistent, dim3(BLOCKS), dim3(THREADS), args, 0, st));
                CHECK(cudaEventRecord(e1, st));
                CHECK(cudaEventSynchronize(e1));
                CHECK(cudaEventElapsedTime(&ms, e0, e1));
                std::vector<float>* ts[] = {&t2, &t3, &t4, &t5, &t6};
                if (r >= 2) ts[mode]->push_back(ms * 1000.0f / PHASES);
            }
        }
        printf("weights %3lld KB a block (%5.1f MB a phase): launches+PDL+last-block finish %.2f us | "
               "launches+PDL, consumers sum %.2f us | persistent, 2 barriers %.2f us | 1 barrier, consumers sum %.2f us | same + prefetch %.2f us | "
               "tree barrier %.2f us | tree + prefetch %.2f us\n",
               kb, kb * BLOCKS / 1024.0, median(t1), median(t0), median(t2), median(t3), median(t4), median(t5),
               median(t6));
        CHECK(cudaGraphExecDestroy(exec));
        CHECK(cudaGraphExecDestroy(exec_c));
    }
    return 0;
}
