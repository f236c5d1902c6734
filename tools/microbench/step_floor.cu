// Floors for lily's decode step on one GPU, from kernels that do nothing but what bounds it:
//
// 1. What a kernel boundary costs inside a recorded step: N dependent kernels (each reads the
//    value its predecessor wrote and writes the next, so that none may run ahead) captured in a
//    CUDA graph and replayed, as lily records a decode step, with and without programmatic
//    dependent launch (PDL); and, for the persistent form a fused decode kernel would take, one
//    cooperative kernel with N grid barriers. Each kernel's blocks can also spin for a while (the
//    "work"), so that what a boundary adds to kernels that do something is seen too.
// 2. The 35B-A3B step as a chain of ideal streaming kernels: each of lily's weight-reading
//    kernels replaced by one that only reads as many bytes (from buffers that never share the
//    50 MB L2), in the same order and count (7 a layer, 40 layers, then the lm_head), two blocks
//    of 256 threads an SM (shared memory keeps a third out, as lily's products' registers do),
//    with PDL. "prefetch": a kernel issues its reads before it waits for its predecessor (lily's
//    products do, but for the routed experts, which need the router's choice); "wait first": it
//    reads only after the wait. The step's time is the floor for a step of this many dependent
//    kernels that move these bytes, at 256, 32,768 and 131,072 keys (the attention layers' KV
//    cache, f16, read where the GDN layers read their state). "products": as a product must, each
//    kernel also stages its predecessor's output (4,096 floats) after its wait, before it uses
//    the weights it requested before the wait (held in registers); with two blocks an SM, or one
//    (the next kernel's block then fits beside it). Then each family's kernel alone in a chain of 40
//    (the small ones' buffers stay in L2 between replays).
//
// 3. The same step as one persistent kernel (persistent_step): every dependency a counter in
//    global memory, every block paging its slice of each kernel's bytes through shared memory as
//    far ahead as its ring of pages and the routing allow. The floor of a decode megakernel; with
//    a release reduction for the hand-over, with one float of x a thread, and with no weights (the
//    dependencies' chain alone).
// 4. That kernel with the dependencies a fused step needs rather than whole-level ones: a head's
//    recurrence waiting for its group of blocks, the split-K out_proj and expert down for nothing.
//
// Build and run on the GPU machine (nvcc is there, no Rust needed):
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/step_floor tools/microbench/step_floor.cu
//   timeout 300 /tmp/step_floor   (part 3 spins on counters: a fault there must not hold the call)
// Prints markdown tables: microseconds (the mean of 5 runs of 50 replays each, after 10 warm-up
// replays, with the runs' min and max).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "check.cuh"

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;"); }

// Busy for `ns` nanoseconds at the H200's 1.98 GHz boost clock (counted in SM cycles: the global
// timer may tick too coarsely).
__device__ __forceinline__ void spin_ns(unsigned ns) {
    if (ns == 0) return;
    const long long cycles = (long long)ns * 198 / 100, t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}

// One link of the chain: wait for the predecessor (PDL), let the successor launch, then thread 0
// of block 0 carries the value on while every block spins for `work_ns`.
__global__ void link(float* chain, int i, unsigned work_ns) {
    pdl_wait();
    pdl_launch_dependents();
    if (blockIdx.x == 0 && threadIdx.x == 0) chain[i] = chain[i - 1] + 1.f;
    spin_ns(work_ns);
}

// The persistent form: `links` steps separated by grid barriers (a counter and a generation, as a
// hand-written fused kernel would use; the kernel is launched cooperatively, so every block is
// resident).
__global__ void persistent(float* chain, unsigned* arrived, volatile unsigned* generation, int links,
                           unsigned work_ns) {
    for (int i = 1; i <= links; ++i) {
        if (blockIdx.x == 0 && threadIdx.x == 0) chain[i] = chain[i - 1] + 1.f;
        spin_ns(work_ns);
        __syncthreads();
        if (threadIdx.x == 0) {
            const unsigned gen = *generation;
            __threadfence();
            if (atomicAdd(arrived, 1u) == gridDim.x - 1) {
                *arrived = 0;
                __threadfence();
                *generation = gen + 1;
            } else {
                while (*generation == gen) {
                }
            }
            __threadfence();
        }
        __syncthreads();
    }
}

// Reads n16 16-byte words of w (grid-strided, eight loads a thread in flight), then the chain's
// link as `link` does; `sink` keeps the reads from being optimised away. PREFETCH: the reads are
// issued before the wait for the predecessor (which then only orders the link).
template <bool PREFETCH>
__global__ void __launch_bounds__(256) stream(const uint4* __restrict__ w, long long n16, float* chain, int i,
                                              unsigned* sink) {
    extern __shared__ unsigned occupancy[];  // sized by the launch: two blocks an SM
    if (!PREFETCH) pdl_wait();
    pdl_launch_dependents();
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned acc = 0;
    for (; j + 7 * stride < n16; j += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = __ldg(w + j + u * stride);
#pragma unroll
        for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; j < n16; j += stride) {
        const uint4 v = __ldg(w + j);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (PREFETCH) pdl_wait();
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) occupancy[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < 8; ++k) acc ^= occupancy[k];
        sink[blockIdx.x] ^= acc;
        if (blockIdx.x == 0) chain[i] = chain[i - 1] + 1.f;
    }
}

// A product's floor: as `stream`, but the kernel also consumes its predecessor's output, as
// every product of the step consumes x. The thread's first WORDS 16-byte words are requested
// before the wait (held in registers: enough for every kernel of the step but the lm_head);
// then the block stages X_LEN floats of the predecessor's output `x_in` into shared memory, lets
// the next kernel launch (where lily's products do), combines its words with x, and writes its
// slice of this kernel's output `x_out` (X_LEN floats over the grid).
constexpr int X_LEN = 4096;  // a power of two (an index mask)
template <int WORDS>
__global__ void __launch_bounds__(256) product(const uint4* __restrict__ w, long long n16, const float* x_in,
                                               float* x_out, unsigned* sink) {
    extern __shared__ float xs[];  // X_LEN floats, then 8 words; sized by the launch: two blocks an SM
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    uint4 v[WORDS];
#pragma unroll
    for (int u = 0; u < WORDS; ++u) v[u] = t + u * stride < n16 ? __ldg(w + t + u * stride) : make_uint4(0, 0, 0, 0);
    pdl_wait();
    for (int i = threadIdx.x; i < X_LEN; i += blockDim.x) xs[i] = x_in[i];
    __syncthreads();
    pdl_launch_dependents();
    unsigned acc = 0;
#pragma unroll
    for (int u = 0; u < WORDS; ++u)
        acc ^= (v[u].x ^ v[u].y ^ v[u].z ^ v[u].w) + __float_as_uint(xs[(threadIdx.x + 256 * u) & (X_LEN - 1)]);
    for (long long j = t + WORDS * stride; j < n16; j += 8 * stride) {  // the lm_head's, a long KV's rest
        uint4 r[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) r[u] = j + u * stride < n16 ? __ldg(w + j + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < 8; ++u) acc ^= r[u].x ^ r[u].y ^ r[u].z ^ r[u].w;
    }
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    unsigned* red = reinterpret_cast<unsigned*>(xs + X_LEN);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = acc;
    __syncthreads();
    const int per = (X_LEN + gridDim.x - 1) / gridDim.x;
    if (threadIdx.x < per && blockIdx.x * per + threadIdx.x < X_LEN) {
        unsigned a = 0;
        for (int k = 0; k < 8; ++k) a ^= red[k];
        x_out[blockIdx.x * per + threadIdx.x] = (float)(a & 0xffff) + xs[threadIdx.x];
    }
    if (threadIdx.x == 0) sink[blockIdx.x] ^= red[0];
}

// 3. The persistent form of the step (session 38): one cooperative kernel whose blocks walk the
// step's kernels of part 2 as levels, each level depending on the whole level before it (as a
// product depends on all of x). A block reads its slice of every level's bytes through a ring of
// PAGES shared-memory pages of 32 KiB (cp.async, 16 bytes a copy; each thread consumes the words
// it copied itself, so the ring needs no barrier), copying as far ahead as the ring allows and
// across levels, except that a routed level's copies wait until the block has seen its router's
// level complete (the expert ids come from it). With AHEAD false it copies only the level it is
// on (no loads across a level's wait). A level: thread 0 waits until the level before has been
// completed by every block (a counter in global memory, one increment a block a step), then every
// thread reads its 16 floats of the level before's output (4,096 floats, from L2, as `product`
// stages x), folds its words with them as the ring delivers them, and the block reduces and
// writes its slice of the level's output, then counts itself in the level's counter. What this
// times is the floor of a decode step made of one persistent kernel with the weights paged
// through shared memory ahead of the dependencies: every dependency as a counter, every load as
// early as the ring and the routing allow. RELEASE counts a block in with one release reduction
// instead of a fence and an atomic add; without STAGE_X a thread reads one float of x, not 16 (the
// share of x's staging in a level).
//
// 4. The same kernel with finer dependencies (session 39): a level may wait for the whole level
// before it (WAIT_LEVEL, as above), for its group of GROUP consecutive blocks in it (WAIT_GROUP: a
// GDN head's recurrence, which needs only its head's rows of the in-projections, or attention's
// kv head), or for nothing (WAIT_NONE: the block's own output, as a split-K out_proj or expert down
// summing the rows that the same block computed in the level before). A level that does not wait
// for the whole level before does not read x either. Every block counts itself in its level's
// counter, and in its group's where the next level waits for groups.
constexpr int PAGE_WORDS = 2048;  // 16-byte words in a 32 KiB page: eight a thread
struct Level {
    const uint4* w;
    long long per;  // 16-byte words a block reads (the last blocks may read fewer)
    long long words;
    int chunks;  // pages a block's slice takes, at least one
    int dep;     // for a routed level, the index of its router's level; else -1
    int wait;    // what the level waits for in the level before: WAIT_LEVEL, WAIT_GROUP or WAIT_NONE
};
enum { WAIT_NONE = 0, WAIT_GROUP = 1, WAIT_LEVEL = 2 };
constexpr int GROUP = 8, MAX_GROUPS = 64;  // blocks a group; groups a level (grids up to 512 blocks)

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void copy16(uint4* dst, const uint4* src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
// Until at most n of the thread's copy groups are in flight (n below 8).
__device__ __forceinline__ void copies_in_flight_at_most(int n) {
    switch (n) {
        case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
        case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
        case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
        case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
        case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
        case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
        case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
        default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
    }
}

// `target`: the count every level's counter reaches in this launch (launch number x blocks).
__global__ void __launch_bounds__(256, 1) persistent_step(const Level* __restrict__ levels, int nlevels,
                                                        unsigned* counters, unsigned target, float* xbuf,
                                                        unsigned* sink, int pages, int ahead, int release,
                                                        int stage_x) {
    extern __shared__ uint4 ring[];  // pages * PAGE_WORDS words, then 8 for the reduction
    unsigned* red = reinterpret_cast<unsigned*>(ring + pages * PAGE_WORDS);
    const int tid = threadIdx.x;
    int il = 0, ic = 0;                   // the next page to copy: level il's chunk ic
    long long issued = 0, consumed = 0;  // pages copied (requested) and consumed by this block
    int seen = -1;                        // the last level this block has seen complete
    auto slice_start = [&](const Level& L) { return min(L.words, L.per * blockIdx.x); };
    auto issue = [&](int current) {
        while (issued - consumed < pages && il < nlevels) {
            const Level& L = levels[il];
            if ((!ahead && il > current) || L.dep > seen) break;
            const long long b0 = slice_start(L), b1 = min(L.words, b0 + L.per);
            const long long c0 = b0 + (long long)ic * PAGE_WORDS;
            uint4* page = ring + (issued % pages) * PAGE_WORDS;
#pragma unroll
            for (int u = 0; u < PAGE_WORDS / 256; ++u) {
                const long long j = c0 + tid + 256 * u;
                if (j < b1) copy16(page + tid + 256 * u, L.w + j);
            }
            asm volatile("cp.async.commit_group;" ::: "memory");
            ++issued;
            if (++ic == L.chunks) {
                ic = 0;
                ++il;
            }
        }
    };
    for (int l = 0; l < nlevels; ++l) {
        const Level L = levels[l];
        issue(l);
        const int group = blockIdx.x / GROUP;
        if (l > 0 && L.wait != WAIT_NONE) {
            if (tid == 0) {
                // A group's count in this launch: the launch's number times its blocks.
                const unsigned group_target = target / gridDim.x * min(GROUP, (int)gridDim.x - group * GROUP);
                const unsigned* c = L.wait == WAIT_LEVEL ? counters + l - 1
                                                         : counters + nlevels + (l - 1) * MAX_GROUPS + group;
                const unsigned want = L.wait == WAIT_LEVEL ? target : group_target;
                while (ld_acquire(c) < want) {
                }
            }
            __syncthreads();
            if (L.wait == WAIT_LEVEL) seen = l - 1;
        }
        float x[16];
        const float* xi = xbuf + (size_t)l * X_LEN;
        const bool read_x = L.wait == WAIT_LEVEL;
#pragma unroll
        for (int u = 0; u < 16; ++u)
            x[u] = read_x && (stage_x || u == 0) ? __ldcg(xi + ((tid + 256 * u) & (X_LEN - 1))) : 0.f;
        const long long b0 = slice_start(L), b1 = min(L.words, b0 + L.per);
        unsigned acc = 0;
#pragma unroll
        for (int u = 0; u < 16; ++u) acc ^= __float_as_uint(x[u]);  // every staged value used
        for (int c = 0; c < L.chunks; ++c) {
            issue(l);
            copies_in_flight_at_most((int)(issued - consumed - 1));
            const uint4* page = ring + (consumed % pages) * PAGE_WORDS;
            const long long c0 = b0 + (long long)c * PAGE_WORDS;
#pragma unroll
            for (int u = 0; u < PAGE_WORDS / 256; ++u)
                if (c0 + tid + 256 * u < b1) {
                    const uint4 v = page[tid + 256 * u];
                    acc ^= (v.x ^ v.y ^ v.z ^ v.w) + __float_as_uint(x[u]) + c;
                }
            ++consumed;
        }
        for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
        if ((tid & 31) == 0) red[tid >> 5] = acc;
        __syncthreads();
        const int per_x = (X_LEN + gridDim.x - 1) / gridDim.x;
        if (tid < per_x && blockIdx.x * per_x + tid < X_LEN) {
            unsigned a = 0;
            for (int k = 0; k < 8; ++k) a ^= red[k];
            xbuf[(size_t)(l + 1) * X_LEN + blockIdx.x * per_x + tid] = (float)(a & 0xffff) + x[0];
        }
        if (tid == 0) sink[blockIdx.x] ^= red[0];
        __syncthreads();  // the block's writes (and its reads of red) before it counts itself
        // The group's counter only where the next level waits for it (part 3's hand-over unchanged).
        const bool count_group = l + 1 < nlevels && levels[l + 1].wait == WAIT_GROUP;
        if (tid == 0) {
            if (release) {
                // One release reduction, cumulative over the block's writes ordered by the barrier.
                asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counters + l) : "memory");
                if (count_group)
                    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counters + nlevels + l * MAX_GROUPS +
                                                                                  group)
                                 : "memory");
            } else {
                __threadfence();
                atomicAdd(counters + l, 1u);
                if (count_group) atomicAdd(counters + nlevels + l * MAX_GROUPS + group, 1u);
            }
        }
    }
}

// A launch on `s` of `grid` blocks of 256 threads with `smem` bytes of dynamic shared memory and,
// with `pdl`, programmatic dependent launch; `attr` is the attribute's storage.
cudaLaunchConfig_t launch_config(cudaStream_t s, int grid, int smem, bool pdl, cudaLaunchAttribute* attr) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(256);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    attr->id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr->val.programmaticStreamSerializationAllowed = pdl;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cfg;
}

struct Stat {
    double mean, lo, hi;
};

// Events on the stream that runs the replays (a non-blocking one: the legacy stream would not
// order them).
template <class F>
Stat time_us(cudaStream_t s, F replay, int per_replay) {
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    for (int i = 0; i < 10; ++i) replay();
    CHECK(cudaStreamSynchronize(s));
    std::vector<double> runs;
    for (int r = 0; r < 5; ++r) {
        CHECK(cudaEventRecord(a, s));
        for (int i = 0; i < 50; ++i) replay();
        CHECK(cudaEventRecord(b, s));
        CHECK(cudaEventSynchronize(b));
        float ms = 0.f;
        CHECK(cudaEventElapsedTime(&ms, a, b));
        runs.push_back(1000.0 * ms / 50 / per_replay);
    }
    double sum = 0;
    for (double v : runs) sum += v;
    return {sum / runs.size(), *std::min_element(runs.begin(), runs.end()),
            *std::max_element(runs.begin(), runs.end())};
}

int main() {
    constexpr int N = 294;  // lily's launches in one 35B decode step (docs/performance.md)
    float* chain;
    unsigned* bar;
    CHECK(cudaMalloc(&chain, (N + 1) * sizeof(float)));
    CHECK(cudaMalloc(&bar, 2 * sizeof(unsigned)));
    CHECK(cudaMemset(chain, 0, (N + 1) * sizeof(float)));
    CHECK(cudaMemset(bar, 0, 2 * sizeof(unsigned)));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    std::printf("| form | blocks x threads | work a block, us | us a boundary (mean of 5) | min | max |\n");
    std::printf("|---|---|---:|---:|---:|---:|\n");
    const int grids[] = {1, sms, 2 * sms, 4 * sms};
    const unsigned works[] = {0, 2000};
    for (int pdl = 1; pdl >= 0; --pdl)
        for (unsigned work : works)
            for (int grid : grids) {
                cudaGraph_t g;
                cudaGraphExec_t ge;
                CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
                for (int i = 1; i <= N; ++i) {
                    cudaLaunchAttribute attr;
                    const cudaLaunchConfig_t cfg = launch_config(s, grid, 0, pdl, &attr);
                    CHECK(cudaLaunchKernelEx(&cfg, link, chain, i, work));
                }
                CHECK(cudaStreamEndCapture(s, &g));
                CHECK(cudaGraphInstantiate(&ge, g, 0));
                const Stat t = time_us(s, [&] { CHECK(cudaGraphLaunch(ge, s)); }, N);
                std::printf("| graph of %d kernels, %s | %d x 256 | %.1f | %.2f | %.2f | %.2f |\n", N,
                            pdl ? "PDL" : "no PDL", grid, work / 1000.0, t.mean, t.lo, t.hi);
                CHECK(cudaGraphExecDestroy(ge));
                CHECK(cudaGraphDestroy(g));
            }
    for (unsigned work : works)
        for (int grid : grids) {
            int per_sm = 0;
            CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persistent, 256, 0));
            if (grid > per_sm * sms) continue;
            int links = N;
            unsigned* generation = bar + 1;
            void* args[] = {&chain, &bar, &generation, &links, &work};
            const Stat t = time_us(
                s,
                [&] {
                    CHECK(cudaLaunchCooperativeKernel((void*)persistent, dim3(grid), dim3(256), args, 0, s));
                },
                N);
            std::printf("| one kernel, %d grid barriers | %d x 256 | %.1f | %.2f | %.2f | %.2f |\n", N, grid,
                        work / 1000.0, t.mean, t.lo, t.hi);
        }
    CHECK(cudaStreamSynchronize(s));
    float last = 0.f;
    CHECK(cudaMemcpy(&last, chain + N, sizeof(float), cudaMemcpyDeviceToHost));
    std::printf("chain value %g (%d: every link ran)\n\n", last, N);

    // 2. The step as streaming kernels. Bytes a kernel reads (MB), in a layer's order: the GDN or
    // attention in-projections, the conv (its taps and window), the GDN recurrence's state (read
    // and written) or, in every fourth layer, the attention's KV cache (f16, 2 heads of 256 at
    // each key; its prep and merge stand in with the conv's slot), the out_proj or o_proj, the
    // router and shared-expert gate, the expert gate/up (shared and 8 routed experts), the expert
    // down with the mix; then the lm_head. From docs/performance.md's decode profile (weights per
    // family over its launches).
    const double layer_mb[7] = {13.33, 0.05, 4.19, 4.72, 0.56, 10.62, 5.31};
    const bool routed[7] = {false, false, false, false, false, true, false};
    const int layers = 40;
    const double head_mb = 286.1;
    const int kernels = 7 * layers + 1;
    float* chain2;
    unsigned* sink;
    CHECK(cudaMalloc(&chain2, (kernels + 1) * sizeof(float)));
    CHECK(cudaMemset(chain2, 0, (kernels + 1) * sizeof(float)));
    CHECK(cudaMalloc(&sink, 4 * sms * sizeof(unsigned)));
    CHECK(cudaMemset(sink, 0, 4 * sms * sizeof(unsigned)));
    // Two blocks an SM: each takes more than a third of the SM's shared memory.
    int smem_per_sm = 0;
    CHECK(cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
    const int smem = smem_per_sm / 3 + 1024;
    CHECK(cudaFuncSetAttribute(stream<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CHECK(cudaFuncSetAttribute(stream<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CHECK(cudaFuncSetAttribute(product<16>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    float* xbuf;  // each kernel's output, the next one's x
    CHECK(cudaMalloc(&xbuf, (size_t)(kernels + 1) * X_LEN * sizeof(float)));
    CHECK(cudaMemset(xbuf, 0, (size_t)(kernels + 1) * X_LEN * sizeof(float)));
    auto launch_stream = [&](bool pre, const uint4* w, long long n16, int k) {
        cudaLaunchAttribute attr;
        const cudaLaunchConfig_t cfg = launch_config(s, 2 * sms, smem, true, &attr);
        if (pre)
            CHECK(cudaLaunchKernelEx(&cfg, stream<true>, w, n16, chain2, k + 1, sink));
        else
            CHECK(cudaLaunchKernelEx(&cfg, stream<false>, w, n16, chain2, k + 1, sink));
    };
    std::vector<uint4*> bufs(kernels);
    std::vector<long long> words(kernels);
    // Each kernel's buffer (bufs, words) at a context of `keys` (the attention layers' KV cache
    // grows with it); returns the step's MB.
    auto alloc_levels = [&](long long keys) {
        double total_mb = 0;
        for (int k = 0; k < kernels; ++k) {
            const int l = k / 7, f = k % 7;
            const bool attention = l % 4 == 3;
            double mb = k == kernels - 1 ? head_mb : layer_mb[f];
            if (k < kernels - 1 && f == 2 && attention) mb = keys * 2 * 256 * 2 * 2 / 1e6;
            words[k] = (long long)(mb * 1e6 / 16);
            total_mb += mb;
            CHECK(cudaMalloc(&bufs[k], words[k] * 16 + 16));
            CHECK(cudaMemset(bufs[k], k & 0xff, words[k] * 16 + 16));
        }
        return total_mb;
    };
    auto free_levels = [&] {
        for (int k = 0; k < kernels; ++k) CHECK(cudaFree(bufs[k]));
    };
    std::printf("| the 35B step as %d streaming kernels | context | MB | us a step (mean of 5) | min | max | "
                "tok/s | GB/s |\n",
                kernels);
    std::printf("|---|---:|---:|---:|---:|---:|---:|---:|\n");
    // mode 0: every kernel prefetches but the routed experts'; 1: none does; 2: every one does.
    const char* modes[3] = {"prefetch (the routed experts wait first)", "every kernel waits first",
                            "every kernel prefetches"};
    const long long contexts[3] = {256, 32768, 131072};
    for (long long keys : contexts) {
        const double total_mb = alloc_levels(keys);
        for (int mode = 0; mode < 3; ++mode) {
            if (keys != 256 && mode != 0) continue;
            cudaGraph_t g;
            cudaGraphExec_t ge;
            CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
            for (int k = 0; k < kernels; ++k)
                launch_stream(mode == 2 || (mode == 0 && !(k < kernels - 1 && routed[k % 7])), bufs[k], words[k],
                              k);
            CHECK(cudaStreamEndCapture(s, &g));
            CHECK(cudaGraphInstantiate(&ge, g, 0));
            const Stat t = time_us(s, [&] { CHECK(cudaGraphLaunch(ge, s)); }, 1);
            std::printf("| %s | %lld | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f |\n", modes[mode], keys, total_mb,
                        t.mean, t.lo, t.hi, 1e6 / t.mean, total_mb / t.mean * 1e3);
            CHECK(cudaGraphExecDestroy(ge));
            CHECK(cudaGraphDestroy(g));
        }
        // The same chain as products: each kernel stages its predecessor's output after its wait.
        // Two blocks an SM, or one (half the SM's registers and shared memory), so that the next
        // kernel's block fits beside the current one's and requests its weights while the current
        // one finishes (its words past the 16 a thread are then read after the wait).
        for (int per_sm = 2; per_sm >= 1; --per_sm) {
            cudaGraph_t g;
            cudaGraphExec_t ge;
            CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
            for (int k = 0; k < kernels; ++k) {
                cudaLaunchAttribute attr;
                const cudaLaunchConfig_t cfg = launch_config(s, per_sm * sms, smem, true, &attr);
                const float* xi = xbuf + (size_t)k * X_LEN;
                float* xo = xbuf + (size_t)(k + 1) * X_LEN;
                CHECK(cudaLaunchKernelEx(&cfg, product<16>, (const uint4*)bufs[k], words[k], xi, xo, sink));
            }
            CHECK(cudaStreamEndCapture(s, &g));
            CHECK(cudaGraphInstantiate(&ge, g, 0));
            const Stat t = time_us(s, [&] { CHECK(cudaGraphLaunch(ge, s)); }, 1);
            std::printf("| products: x staged after the wait, %d words a thread before it, %d block(s) an SM | %lld | "
                        "%.0f | %.0f | %.0f | %.0f | %.0f | %.0f |\n",
                        16, per_sm, keys, total_mb, t.mean, t.lo, t.hi, 1e6 / t.mean,
                        total_mb / t.mean * 1e3);
            CHECK(cudaGraphExecDestroy(ge));
            CHECK(cudaGraphDestroy(g));
        }
        if (keys != contexts[2]) free_levels();
    }
    // One kernel of each family's size in a chain of 40 (prefetching), for the per-family floor:
    // the GDN layers' buffers (30 of them), each read once or twice.
    std::printf("\n| one family's kernel, in a chain of 40 | MB | us a kernel | GB/s |\n|---|---:|---:|---:|\n");
    const char* names[7] = {"in-projections", "conv", "GDN recurrence state", "out_proj", "router",
                            "expert gate/up", "expert down"};
    for (int f = 0; f < 7; ++f) {
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
        int i = 0;
        for (int l = 0; i < layers; l = (l + 1) % layers) {
            if (l % 4 == 3) continue;
            const int k = 7 * l + f;
            launch_stream(true, bufs[k], words[k], i++);
        }
        CHECK(cudaStreamEndCapture(s, &g));
        CHECK(cudaGraphInstantiate(&ge, g, 0));
        const Stat t = time_us(s, [&] { CHECK(cudaGraphLaunch(ge, s)); }, layers);
        std::printf("| %s | %.2f | %.2f | %.0f |\n", names[f], layer_mb[f], t.mean, layer_mb[f] / t.mean * 1e3);
        CHECK(cudaGraphExecDestroy(ge));
        CHECK(cudaGraphDestroy(g));
    }
    // 3. and 4. The persistent form (see persistent_step): the same levels as part 2's chain, the
    // routed experts' gate/up and down copied after their router's level; one or two blocks an SM;
    // each level waiting for the whole level before (3) or as a fused kernel's level must (4).
    std::printf("\n| the 35B step as one persistent kernel, %d levels | context | blocks | pages of 32 KiB a block | "
                "copies across levels | hand-over | x staged | weights | waits for | us a step (mean of 5) | min | max | tok/s | "
                "GB/s |\n",
                kernels);
    std::printf("|---|---:|---:|---:|---|---|---|---|---|---:|---:|---:|---:|---:|\n");
    unsigned* counters;  // each level's, then each level's MAX_GROUPS groups'
    const size_t counter_bytes = (size_t)kernels * (1 + MAX_GROUPS) * sizeof(unsigned);
    CHECK(cudaMalloc(&counters, counter_bytes));
    Level* d_levels;
    CHECK(cudaMalloc(&d_levels, kernels * sizeof(Level)));
    // weights 0: every level reads no bytes, so the step is its chain of dependencies alone. fine 1:
    // part 4's waits. A layer's levels (part 2's order): the in-projections wait for the whole
    // residual, the conv for nothing (its channels are the block's own rows), the recurrence or
    // attention for its group (a head's rows), the out_proj for nothing (split over K by head: the
    // block's own heads), the router for the whole out_proj, the gate/up for the whole router (the
    // routing), the down for nothing (split over K: the block's own gate/up rows). The split-K
    // sums' atomics are not modelled: each block writes its slice as in part 3.
    struct Form {
        int per_sm, pages, ahead, release, stage_x, weights, fine;
    };
    const Form forms[] = {{1, 6, 1, 0, 1, 1, 0}, {1, 3, 1, 0, 1, 1, 0}, {1, 6, 0, 0, 1, 1, 0},
                          {2, 3, 1, 0, 1, 1, 0}, {2, 3, 1, 1, 1, 1, 0}, {1, 6, 1, 1, 1, 1, 0},
                          {2, 3, 1, 1, 0, 1, 0}, {2, 3, 1, 1, 1, 0, 0}, {2, 3, 1, 1, 0, 0, 0},
                          {2, 3, 1, 1, 1, 1, 1}, {1, 6, 1, 1, 1, 1, 1}, {2, 3, 1, 1, 1, 0, 1}};
    const int fine_wait[7] = {WAIT_LEVEL, WAIT_NONE, WAIT_GROUP, WAIT_NONE, WAIT_LEVEL, WAIT_LEVEL, WAIT_NONE};
    free_levels();  // part 2's last context, which the family chains used
    for (long long keys : {256LL, 32768LL}) {
        const double total_mb = alloc_levels(keys);
        for (const Form& form : forms) {
            const int grid = form.per_sm * sms;
            const int psmem = form.pages * PAGE_WORDS * 16 + 64;
            CHECK(cudaFuncSetAttribute(persistent_step, cudaFuncAttributeMaxDynamicSharedMemorySize, psmem));
            int fit = 0;
            CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, persistent_step, 256, psmem));
            if (fit < form.per_sm) {
                std::printf("| (%d blocks an SM with %d pages do not fit: %d) | | | | | | | | | | | | | |\n", form.per_sm,
                            form.pages, fit);
                continue;
            }
            std::vector<Level> levels(kernels);
            for (int k = 0; k < kernels; ++k) {
                const long long level_words = form.weights ? words[k] : 0;
                const long long per = (level_words + grid - 1) / grid;
                // The expert gate/up and down (levels 5 and 6 of a layer) copy after the layer's router (4).
                const bool routed_level = k < kernels - 1 && (k % 7 == 5 || k % 7 == 6);
                levels[k] = {bufs[k], per, level_words, (int)std::max(1LL, (per + PAGE_WORDS - 1) / PAGE_WORDS),
                             routed_level ? 7 * (k / 7) + 4 : -1,
                             form.fine && k < kernels - 1 ? fine_wait[k % 7] : WAIT_LEVEL};
            }
            CHECK(cudaMemcpy(d_levels, levels.data(), kernels * sizeof(Level), cudaMemcpyHostToDevice));
            CHECK(cudaMemset(counters, 0, counter_bytes));
            unsigned launches = 0, target = 0;
            int nlevels = kernels, pages = form.pages, ahead = form.ahead, release = form.release,
                stage_x = form.stage_x;
            void* args[] = {&d_levels, &nlevels, &counters, &target, &xbuf, &sink, &pages, &ahead, &release, &stage_x};
            const Stat t = time_us(
                s,
                [&] {
                    target = ++launches * (unsigned)grid;
                    CHECK(cudaLaunchCooperativeKernel((void*)persistent_step, dim3(grid), dim3(256), args, psmem,
                                                      s));
                },
                1);
            const double mb = form.weights ? total_mb : 0.0;
            std::printf(
                "| persistent | %lld | %d x 256 | %d | %s | %s | %s | %s | %s | %.0f | %.0f | %.0f | %.0f | %.0f |\n",
                keys, grid, form.pages, form.ahead ? "yes" : "no", form.release ? "release add" : "fence, atomic",
                form.stage_x ? "16 a thread" : "1 a thread", form.weights ? "yes" : "none",
                form.fine ? "what it reads" : "the whole level", t.mean, t.lo, t.hi, 1e6 / t.mean, mb / t.mean * 1e3);
        }
        free_levels();
    }
    CHECK(cudaFree(counters));
    CHECK(cudaFree(d_levels));
    CHECK(cudaStreamSynchronize(s));
    return 0;
}
