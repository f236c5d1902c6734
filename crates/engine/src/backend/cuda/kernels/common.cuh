// Helpers every kernel family shares; nvrtc.rs puts this text in front of each family's source
// (NVRTC has no include path here: the kernels use no CUDA headers).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000u)

// The decode step's timeline (`LILY_CUDA_TIMELINE`, tools/timeline.py): compiled in only when
// the host puts timeline.rs's defines in front of the source (LILY_TIMELINE and the buffer's
// TIMELINE_LAUNCHES, TIMELINE_BLOCKS, TIMELINE_MARKS). Thread 0 of every block stores the global
// time at three marks: reaching its wait for the previous kernel (0), the wait's return (1) and
// letting the next kernel launch (2), in slot (launch id % TIMELINE_LAUNCHES, block, mark) of the
// host's buffer, as plain stores (an atomic's round trip would hold the block back). Records are
// (launch id, time).
#ifdef LILY_TIMELINE
extern "C" {
__device__ u64* lily_timeline;
}
__device__ __forceinline__ void timeline_mark(u32 mark) {
    const u32 block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if ((threadIdx.x | threadIdx.y | threadIdx.z) != 0 || !lily_timeline || block >= TIMELINE_BLOCKS) return;
    u64 grid, t;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    const u64 slot = ((grid % TIMELINE_LAUNCHES) * TIMELINE_BLOCKS + block) * TIMELINE_MARKS + mark;
    asm volatile("st.global.v2.u64 [%0], {%1, %2};" ::"l"(lily_timeline + 2 * slot), "l"(grid), "l"(t) : "memory");
}
#else
__device__ __forceinline__ void timeline_mark(u32) {}
#endif

// Programmatic dependent launch (Hopper and newer). `pdl_wait` returns once the previous kernel
// has finished and its writes are visible; `pdl_launch_dependents` lets the next kernel start
// launching, so that its launch (and whatever it does before its own wait) overlaps this
// kernel's work. Before the wait a kernel may read only what no kernel writes (the weights).
// Without the launch attribute both are no-ops.
__device__ __forceinline__ void pdl_wait() {
    timeline_mark(0);
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    timeline_mark(1);
}
__device__ __forceinline__ void pdl_launch_dependents() {
    timeline_mark(2);
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// What most kernels begin with: wait for the inputs, then let the next kernel launch.
__device__ __forceinline__ void grid_dep() {
    pdl_wait();
    pdl_launch_dependents();
}

// The end of a chained decode step (`Backend::queue_decode_step`): the chosen token becomes the
// next step's input (params[0]) and the position advances (params[1]); (token, status, position)
// go to slot position & 1 of the host's mapped pinned buffer, read once the step's event is done.
// Status 1: the sampler needed the row (never for the parameters the host chains).
__device__ __forceinline__ void finish_chained_step(int* params, int* host_out, int token, int status) {
    const int pos = params[1];
    volatile int* slot = host_out + 3 * (pos & 1);
    slot[0] = token;
    slot[1] = status;
    slot[2] = pos;
    params[0] = token;
    params[1] = pos + 1;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the total,
// the warps' sums added in order. REUSED: another call may come before or after this one in the
// kernel (a barrier first, as `part` may still be read by the previous one); a kernel's only call
// skips it.
template <bool REUSED = true>
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    if (REUSED) __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    float s = 0.f;
    for (int w = 0; w < nw; ++w) s += part[w];
    return s;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

// The MoE mix's arithmetic at one column: the top_k pairs' values, the first L already loaded
// (loaded(j)) and later ones by load(j), added by weights[j] in the order j = 0..top_k-1 (as
// moe_combine and the CPU reference add them), then with a shared expert its value s over den
// (1 + exp(-shared logit): gated by the sigmoid). moe_mix and moe_combine_add_rms_norm
// (pointwise.cu, eight columns a thread) both mix with it, so their sums are the same.
template <int L, class Loaded, class Load>
__device__ __forceinline__ float moe_mix_sum(const float* weights, int top_k, Loaded loaded, Load load, bool shared,
                                             float s, float den) {
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < L; ++j)
        if (j < top_k) acc = fmaf(weights[j], loaded(j), acc);
    for (int j = L; j < top_k; ++j) acc = fmaf(weights[j], load(j), acc);
    if (shared) acc += s / den;
    return acc;
}

// One token's MoE output at one column: its top_k pairs' values load(j) mixed by weights[j], then,
// with a shared expert (shared_logit not null), load_shared() gated by sigmoid(*shared_logit)
// added (moe_mix_sum). The first MIX_LOADS values and the shared one are loaded before any is
// summed. moe_down_mix (quant.cu) mixes with it.
#define MIX_LOADS 10
template <class Load, class LoadShared>
__device__ __forceinline__ float moe_mix(const float* weights, int top_k, const float* shared_logit, Load load,
                                         LoadShared load_shared) {
    float yv[MIX_LOADS];
#pragma unroll
    for (int j = 0; j < MIX_LOADS; ++j) yv[j] = j < top_k ? load(j) : 0.f;
    const float s = shared_logit ? load_shared() : 0.f;
    return moe_mix_sum<MIX_LOADS>(weights, top_k, [&](int j) { return yv[j]; }, load, shared_logit != nullptr, s,
                                  shared_logit ? 1.f + expf(-shared_logit[0]) : 1.f);
}

// A float's bits made monotonic: larger (non-NaN) values give larger unsigned integers.
__device__ __forceinline__ u32 ordered_bits(float v) {
    const u32 b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// (value, index) packed in a u64 that orders as "larger value, then lower index" (NaN excluded by
// the callers): ordered_bits in the high half, the index's complement in the low half. Argmax and
// top-k compare these with plain integer max.
__device__ __forceinline__ u64 pack_max(float v, int i) {
    return ((u64)ordered_bits(v) << 32) | (u64)(0xffffffffu - (u32)i);
}

// The index of the largest of pack_max's keys; 0 where there was none (key 0: every value NaN).
__device__ __forceinline__ int packed_index(u64 key) { return key ? (int)(0xffffffffu - (u32)key) : 0; }

__device__ __forceinline__ float bf16_to_f32(u16 v) { return __uint_as_float(((u32)v) << 16); }

// One MLX affine-quantized matrix (or one expert of a stack: the pointers already offset to it):
// codes packed low bits first in u32 words, bf16 scale and bias per group of 64 columns.
struct QMat {
    const u32* codes;
    const u16* scales;
    const u16* biases;
};

// Up to four matrices of the same width and bit width that read the same x (the fused input
// projections of a layer): one launch, blocks assigned to matrices in order, ceil(rows_m / rows
// per block) each (quant.cu's matrix-vector and qmma.cu's dense products). Passed by value as
// one kernel parameter.
struct QBatch {
    const u32* codes[4];
    const u16* scales[4];
    const u16* biases[4];
    float* y[4];
    int rows[4];
    int first_block[5];
    int first_row[5];  // prefix sums of rows: matrix m's rows start at first_row[m] of the run
};

// Matrix e of a stack of `rows` x `cols` BITS-bit matrices (the routed experts).
template <int BITS>
__device__ __forceinline__ QMat expert_slice(QMat stack, size_t e, int rows, int cols) {
    const size_t wofs = e * rows * ((size_t)cols * BITS / 32), gofs = e * rows * (size_t)(cols >> 6);
    return {stack.codes + wofs, stack.scales + gofs, stack.biases + gofs};
}

// Traps unless the launch gave the block at least `bytes` of dynamic shared memory (the host
// computes the size from the same layout; a mismatch must not read past the allocation).
__device__ __forceinline__ void require_dynamic_smem(u32 bytes) {
    u32 given;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(given));
    if (given < bytes) __trap();
}

// ---- asynchronous copies global -> shared (sm_80+).

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// To a shared address (smem_addr), for callers that compute it once for many copies.
__device__ __forceinline__ void cp_async16_to(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4_to(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}
// Asks for the 128-byte line at p to be brought into L2 (no register, nothing waits for it).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
__device__ __forceinline__ void cp_async16(void* dst, const void* src) { cp_async16_to(smem_addr(dst), src); }
__device__ __forceinline__ void cp_async4(void* dst, const void* src) { cp_async4_to(smem_addr(dst), src); }
// This thread's share of the copies of a [ROWS][COLS] f32 tile, its rows LD floats apart in
// global memory, to shared address `dst`, its rows PITCH floats apart (16-byte copies; COLS and
// PITCH multiples of 4). Each of the THREADS threads takes one column of every (THREADS / (COLS
// / 4))-th row, so that its addresses after the first are constant offsets.
template <int ROWS, int COLS, int LD, int PITCH, int THREADS>
__device__ __forceinline__ void cp_async_tile(u32 dst, const float* src) {
    constexpr int X = COLS / 4, STEP = THREADS / X;
    static_assert(THREADS % X == 0 && ROWS % STEP == 0, "whole rounds of whole rows");
    const int t = threadIdx.x / X, x = threadIdx.x % X;
    dst += 4 * (t * PITCH + 4 * x);
    src += (size_t)t * LD + 4 * x;
#pragma unroll
    for (int j = 0; j < ROWS / STEP; ++j) cp_async16_to(dst + 4 * j * STEP * PITCH, src + (size_t)j * STEP * LD);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// All but the N most recently committed groups have landed.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { cp_async_wait<0>(); }
// All but the most recently committed group have landed.
__device__ __forceinline__ void cp_async_wait_one() { cp_async_wait<1>(); }

// ---- Hopper (sm_90a): warpgroup products, mbarriers.

// Shared-memory descriptor of a wgmma operand stored with the 128-byte swizzle (64 16-bit values
// a 128-byte row, its 16-byte chunk c at chunk c ^ (row & 7), from a 1,024-byte aligned base):
// the start address, the leading-dimension offset `lbo` (bytes), the stride between groups of 8
// rows (1,024 bytes), each in units of 16 bytes, and the swizzle mode. The hardware applies the
// swizzle to the addresses it forms, so the start may move inside the aligned rows.
__device__ __forceinline__ u64 smem_desc_sw128(const void* start, u32 lbo) {
    return (u64)((smem_addr(start) & 0x3ffffu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(1024 >> 4) << 32) |
           ((u64)1 << 62);
}

// desc with its start address moved by `bytes` (a multiple of 16): one 32-bit add, where
// smem_desc_sw128 would take a handful of instructions per product. The start field (14 bits of
// 16-byte units) cannot carry into the next: shared addresses stay under 256 KiB.
__device__ __forceinline__ u64 smem_desc_advance(u64 desc, u32 bytes) {
    return (desc & 0xffffffff00000000ull) | (u32)((u32)desc + (bytes >> 4));
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The 32 f32 accumulators of an m64n64 product (d[0..31], asm operands %0-%31): the register
// list of its asm template (closing the list) and the operands it names.
#define WGMMA_D32_REGS                                                                                         \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                   \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define WGMMA_D32_OPERANDS(d)                                                                                  \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),            \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),             \
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),             \
        "+f"(d[30]), "+f"(d[31])
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Keeps the compiler from moving register reads and writes of d across the asynchronous product.
template <int M>
__device__ __forceinline__ void wgmma_hold(float (&d)[M]) {
#pragma unroll
    for (int i = 0; i < M; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Orders the shared-memory data this thread has seen land (cp.async copies, through an mbarrier)
// before the tensor cores' reads of it (the async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void mbar_init(u64* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// The barriers below by shared address (smem_addr), for loops that step through an array of them.
// One arrival, once every cp.async this thread has issued so far has landed.
__device__ __forceinline__ void mbar_arrive_copies(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }" ::"r"(bar) : "memory");
}
// Returns once the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, int parity) {
    asm volatile(
        "{ .reg .pred done; WAIT: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1; @!done bra WAIT; }" ::"r"(
            bar),
        "r"(parity)
        : "memory");
}

// ---- Hopper (sm_90a): thread-block clusters and bulk copies.

// This block's rank in its cluster.
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// Every thread of every block of the cluster reaches this point; what each wrote before it is
// visible to all after it (a __syncthreads of the whole cluster).
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The same for a block that has just synchronised itself (__syncthreads), to order its own
// shared-memory traffic, and needs of the other blocks only that they got here: a relaxed arrival
// needs no fence at the GPU's scope (which a release arrival compiles to).
__device__ __forceinline__ void cluster_sync_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}
// Makes this thread's mbarrier inits visible to the cluster, so that the other blocks' copies may
// count on them once a cluster_sync has passed.
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival on `bar` that also expects `bytes` more to land through it this phase.
__device__ __forceinline__ void mbar_arrive_expect(u32 bar, u32 bytes) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }" ::"r"(bar), "r"(bytes)
                 : "memory");
}
// `bytes` (a multiple of 16, both ends 16-byte aligned) from global memory to this block's
// shared address `dst`, counted on `bar` as they land.
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
// The same bytes to `dst` in every block of the cluster whose rank is set in `mask`, each counted
// on the barrier at `bar` in that block (the same offsets in every block).
__device__ __forceinline__ void bulk_copy_multicast(u32 dst, const void* src, u32 bytes, u32 bar, u16 mask) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], "
        "%4;" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar), "h"(mask)
        : "memory");
}
#endif

// ---- tensor cores (sm_80+): bf16 inputs, f32 accumulators.

// d += a * b over one m16n8k16 tile (bf16 inputs, f32 accumulators).
__device__ __forceinline__ void mma_bf16(float d[4], const u32 a[4], const u32 b[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// bf16(a) | bf16(b) << 16, rounded to nearest even: one conversion instruction for the pair
// (rounding by integer arithmetic took four a value).
__device__ __forceinline__ u32 bf16x2_bits(float a, float b) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(b), "f"(a));
    return d;
}
// The pair's values back in f32.
__device__ __forceinline__ float bf16x2_lo(u32 p) { return __uint_as_float(p << 16); }
__device__ __forceinline__ float bf16x2_hi(u32 p) { return __uint_as_float(p & 0xffff0000u); }
// a and b each split in two bf16 parts, hi = bf16(x) and lo = bf16(x - hi) (16 significant bits
// together), packed as bf16x2_bits packs them.
__device__ __forceinline__ void bf16x2_split(float a, float b, u32& hi, u32& lo) {
    hi = bf16x2_bits(a, b);
    lo = bf16x2_bits(a - bf16x2_lo(hi), b - bf16x2_hi(hi));
}

// Eight consecutive floats from (to) 16-byte aligned memory, as two float4.
__device__ __forceinline__ void load8(const float* p, float (&f)[8]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}
__device__ __forceinline__ void store8(float* p, const float (&f)[8]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}
// The same for a thread's 8-column block of a row whose width may not be a multiple of 8: n of
// the block's columns are in the row (zeros past them), and with vec (the width a multiple of 8,
// so the block 16-byte aligned) they move as two float4, else one at a time.
__device__ __forceinline__ void load_cols8(const float* p, float (&f)[8], int n, bool vec) {
    if (vec) {
        load8(p, f);
        return;
    }
#pragma unroll
    for (int c = 0; c < 8; ++c) f[c] = c < n ? p[c] : 0.f;
}
__device__ __forceinline__ void store_cols8(float* p, const float (&f)[8], int n, bool vec) {
    if (vec) {
        store8(p, f);
        return;
    }
#pragma unroll
    for (int c = 0; c < 8; ++c)
        if (c < n) p[c] = f[c];
}

// Where a split product input goes (qmma.cu's split_bf16 describes the layout): hi and lo
// [rows][cols] and the f32 sum of each 64-column group [rows][cols / 64]. Passed by value; the
// kernels that can write one as well as their f32 output (the norms that feed the products) take
// hi == nullptr as "none".
struct SplitOut {
    u16* hi;
    u16* lo;
    float* sum;
};

// 8-column block i of a split input (i counts blocks over the whole [rows][cols / 8]), from its
// values f: hi and lo in the stored order 0 4 1 5 2 6 3 7, and the group's sum, added with the
// seven other threads that hold the group's blocks: eight consecutive lanes of one warp, block i
// in lane i % 8, all of them calling this together. Every writer of a split goes through here, so
// a split has the same bits whichever kernel wrote it.
__device__ __forceinline__ void store_split8(const float (&f)[8], SplitOut out, long long i) {
    u32 h[4], l[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) bf16x2_split(f[p], f[p + 4], h[p], l[p]);
    reinterpret_cast<uint4*>(out.hi)[i] = make_uint4(h[0], h[1], h[2], h[3]);
    reinterpret_cast<uint4*>(out.lo)[i] = make_uint4(l[0], l[1], l[2], l[3]);
    float s = ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
    const u32 group = 0xffu << (threadIdx.x & 24);
    s += __shfl_xor_sync(group, s, 1);
    s += __shfl_xor_sync(group, s, 2);
    s += __shfl_xor_sync(group, s, 4);
    if ((i & 7) == 0) out.sum[i >> 3] = s;
}

// The split of `cols` values at `row` (16-byte aligned, cols a multiple of 64), row number r of
// its tensor, by the threads lane0, lane0 + step, ... below `step` (step a multiple of 32: whole
// warps), each taking an 8-column block in turn. Called after the row's values were stored by
// the same threads' block (or warp), past the barrier that makes them visible.
__device__ __forceinline__ void split_row(const float* row, SplitOut out, size_t r, int cols, int lane0, int step) {
    const int blocks8 = cols / 8;
    for (int b = lane0; b < blocks8; b += step) {
        float f[8];
        load8(row + 8 * b, f);
        store_split8(f, out, (long long)r * blocks8 + b);
    }
}

// Four 8x8 bf16 matrices from shared memory, one per eight lanes' row addresses (lanes 8i..8i+7
// give the rows of matrix i); lane l receives row l / 4, columns 2 (l % 4) and +1 of each.
__device__ __forceinline__ void ldsm_x4_at(u32 r[4], u32 row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(row));
}
__device__ __forceinline__ void ldsm_x4(u32 r[4], const u16* row) { ldsm_x4_at(r, smem_addr(row)); }

// The same, each matrix transposed on the way.
__device__ __forceinline__ void ldsm_x4_trans(u32 r[4], const u16* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
}

// Which row of a 16-row, two-chunk tile (a chunk: 16 bytes of a row) lane l gives ldmatrix, and
// which chunk of it, for the two orders of the four matrices: "rows first" (0-7 chunk 0, 8-15
// chunk 0, 0-7 chunk 1, 8-15 chunk 1) and "chunks first" (0-7 chunk 0, 0-7 chunk 1, 8-15 chunk
// 0, 8-15 chunk 1). Every ldsm_* fragment below is one of the two.
struct LdsmLane {
    int row, chunk;
};
__device__ __forceinline__ LdsmLane ldsm_rows_first() {
    const int l = threadIdx.x & 31;
    return {(l & 7) + 8 * ((l >> 3) & 1), l >> 4};
}
__device__ __forceinline__ LdsmLane ldsm_chunks_first() {
    const int l = threadIdx.x & 31;
    return {(l & 7) + 8 * (l >> 4), (l >> 3) & 1};
}

// The A fragment of an m16n8k16 product (16 rows x 16 columns at `tile`, row pitch `ld`
// elements): matrices (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15).
__device__ __forceinline__ void ldsm_a(u32 a[4], const u16* tile, int ld) {
    const LdsmLane at = ldsm_rows_first();
    ldsm_x4(a, tile + at.row * ld + 8 * at.chunk);
}

// The B fragments of two adjacent n8 tiles (16 rows of n with k contiguous, 16 columns of k):
// b[0..1] for rows 0-7, b[2..3] for rows 8-15.
__device__ __forceinline__ void ldsm_b2(u32 b[4], const u16* tile, int ld) {
    const LdsmLane at = ldsm_chunks_first();
    ldsm_x4(b, tile + at.row * ld + 8 * at.chunk);
}

// The B fragments of two adjacent n8 tiles from a k-major tile (16 rows of k with n contiguous,
// 16 columns of n), transposed by ldmatrix: b[0..1] for n 0-7, b[2..3] for n 8-15.
__device__ __forceinline__ void ldsm_bt2(u32 b[4], const u16* tile, int ld) {
    const LdsmLane at = ldsm_rows_first();
    ldsm_x4_trans(b, tile + at.row * ld + 8 * at.chunk);
}

// ---- the KV cache's f16 values, and tensor-core products on them (sm_80+, f32 accumulators).

// x as the cache holds it (the CPU reference's kv_value): f16 bits, rounded to nearest even, with
// magnitudes past f16's largest finite value saturated to it (NaN stays NaN).
__device__ __forceinline__ u16 f16_bits(float x) {
    x = fabsf(x) > 65504.f ? copysignf(65504.f, x) : x;
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h));
    return x;
}

// a and b split in two f16 parts each, hi = f16(x) and lo = f16(x - hi), packed as the fragments
// of a 16-bit product take a pair (a in the low half): 22 significant bits together (fewer only
// where lo falls below f16's normal range, at magnitudes under 2^-3 of one).
__device__ __forceinline__ void f16_split2(float a, float b, u32& hi, u32& lo) {
    const u16 ha = f16_bits(a), hb = f16_bits(b);
    hi = (u32)ha | ((u32)hb << 16);
    lo = (u32)f16_bits(a - f16_to_f32(ha)) | ((u32)f16_bits(b - f16_to_f32(hb)) << 16);
}

// (a, b) rounded to f16 and packed, a in the low half (one conversion for the pair).
__device__ __forceinline__ u32 f16x2_bits(float a, float b) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
}

// d += a * b over one m16n8k16 tile (f16 inputs, f32 accumulators); fragments as mma_bf16's.
__device__ __forceinline__ void mma_f16(float d[4], const u32 a[4], const u32 b[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The A fragment of an m16n8k16 product from a k-major tile (16 rows of k with m contiguous; A is
// its transpose), transposed by ldmatrix: matrices (m 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15),
// (8-15, 8-15) as ldsm_a's.
__device__ __forceinline__ void ldsm_at(u32 a[4], const u16* tile, int ld) {
    const LdsmLane at = ldsm_chunks_first();
    ldsm_x4_trans(a, tile + at.row * ld + 8 * at.chunk);
}

// ---- tensor cores on f32 data (sm_80+): tf32 inputs, f32 accumulators.

// x rounded to tf32's 10 mantissa bits, to nearest with ties away from zero (as cvt.rna), by
// integer operations on its bits: cvt issues at a quarter of their rate.
__device__ __forceinline__ u32 tf32_round(u32 bits) { return (bits + 0x1000u) & 0xffffe000u; }

// x split in two tf32 parts, hi = tf32(x) and lo = tf32(x - hi) (each rounded to nearest): 22
// significant bits together. Returns (hi, lo) bits.
__device__ __forceinline__ void tf32_split(float x, u32& hi, u32& lo) {
    hi = tf32_round(__float_as_uint(x));
    lo = tf32_round(__float_as_uint(x - __uint_as_float(hi)));
}

// f16_split2 for values in [0, 1] (probabilities): hi rounded to 11 significant bits by integer
// operations (tf32_round: f16's precision, exact in f16 down to 2^-14), lo = x - hi, each pair
// converted at once. No range checks.
__device__ __forceinline__ void f16_split2_unit(float a, float b, u32& hi, u32& lo) {
    const float ha = __uint_as_float(tf32_round(__float_as_uint(a)));
    const float hb = __uint_as_float(tf32_round(__float_as_uint(b)));
    hi = f16x2_bits(ha, hb);
    lo = f16x2_bits(a - ha, b - hb);
}

// d += a * b over one m16n8k8 tile (tf32 inputs, f32 accumulators). Fragments, with g = lane / 4
// and c = lane % 4: a = A[g][c], A[g + 8][c], A[g][c + 4], A[g + 8][c + 4]; b = B[c][g],
// B[c + 4][g]; d = D[g][2c], D[g][2c + 1], D[g + 8][2c], D[g + 8][2c + 1].
__device__ __forceinline__ void mma_tf32(float d[4], const u32 a[4], const u32 b[2]) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Fragments of an m16n8k8 tf32 product read from f32 tiles in shared memory and split (tf32_split):
// A from a row-major [m][k] tile, B from an [n][k] tile (B = its transpose) or a [k][n] one.
__device__ __forceinline__ void tf32_split_a(u32 ah[4], u32 al[4], const float* tile, int ld) {
    const int l = threadIdx.x & 31;
    const float* a = tile + (l >> 2) * ld + (l & 3);
    tf32_split(a[0], ah[0], al[0]);
    tf32_split(a[8 * ld], ah[1], al[1]);
    tf32_split(a[4], ah[2], al[2]);
    tf32_split(a[8 * ld + 4], ah[3], al[3]);
}
__device__ __forceinline__ void tf32_split_b_nk(u32 bh[2], u32 bl[2], const float* tile, int ld) {
    const int l = threadIdx.x & 31;
    const float* b = tile + (l >> 2) * ld + (l & 3);
    tf32_split(b[0], bh[0], bl[0]);
    tf32_split(b[4], bh[1], bl[1]);
}
__device__ __forceinline__ void tf32_split_b_kn(u32 bh[2], u32 bl[2], const float* tile, int ld) {
    const int l = threadIdx.x & 31;
    const float* b = tile + (l & 3) * ld + (l >> 2);
    tf32_split(b[0], bh[0], bl[0]);
    tf32_split(b[4 * ld], bh[1], bl[1]);
}

// The same fragments by ldmatrix, unsplit. An 8x8 matrix of 16-bit values is an 8x4 one of 32-bit
// values, of which lane l receives word l % 4 of row l / 4: mma_tf32's layout. Each returns lane
// l's byte offset in a 32-bit tile of row pitch `ld` words (rows 16-byte aligned), to add to the
// tile's shared address (smem_addr) for ldsm_x4_at. A (16 rows of m, 8 words of k): matrices
// (m 0-7, k 0-3), (8-15, 0-3), (0-7, 4-7), (8-15, 4-7), so that r = a[0..3] (ldsm_a's order).
__device__ __forceinline__ u32 ldsm_tf32_a_lane(int ld) {
    const LdsmLane at = ldsm_rows_first();
    return 4 * (at.row * ld + 4 * at.chunk);
}
// B of two n8 tiles (16 rows of n, each 8 words of k): r[0..1] for n 0-7, r[2..3] for n 8-15
// (ldsm_b2's order).
__device__ __forceinline__ u32 ldsm_tf32_b2_lane(int ld) {
    const LdsmLane at = ldsm_chunks_first();
    return 4 * (at.row * ld + 4 * at.chunk);
}
// Four words split in tf32 hi and lo (tf32_split).
__device__ __forceinline__ void tf32_split4(const u32 (&x)[4], u32 (&hi)[4], u32 (&lo)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) tf32_split(__uint_as_float(x[i]), hi[i], lo[i]);
}

// d += a * b to within f32 rounding, from split operands: lo*hi, hi*lo, then hi*hi (the small
// terms first; lo*lo is below 2^-22 of the product and left out).
__device__ __forceinline__ void mma_tf32x3(float d[4], const u32 ah[4], const u32 al[4], const u32 bh[2],
                                           const u32 bl[2]) {
    mma_tf32(d, al, bh);
    mma_tf32(d, ah, bl);
    mma_tf32(d, ah, bh);
}
