// What one group of a prefill product costs a warpgroup with the activations split as now (bf16
// hi + bf16 lo: eight m64n64k16 bf16 products a group) against the split session 56 found to keep
// the goldens in a CPU emulation (f16 hi + e4m3 lo, one power of two a token: four m64n64k16 f16
// products and two m64n64k32 e4m3 ones, the codes converted to e4m3 A fragments from their f16
// ones; built whole in session 57, it failed the goldens on the GPU and was dropped, run61 in
// docs/performance.md; its form of this bench is in that run's patch). Each form
// runs the product core's per-group chain of kernels/qmma.cu's wg_tiles (codes from shared
// memory to A fragments, the products issued, waited for, folded into the accumulators with
// the rows' scales) over data that stays in shared memory, so that only the chain is timed: no
// copies, no barriers between warpgroups. Four warpgroups of 64 rows a block (512 threads, one
// block an SM), as wg_tiles runs. The bounds beside them: the new form with its e4m3 fragments
// not converted (what the conversions cost), and the f16 hi part alone (no lo at all).
//
// The numbers are throughput only; the data are arbitrary and the results unchecked (the
// numerics are bench/results/cpu-product-input-fp8-lo-golden.txt's).
//
// Build and run on the GPU machine:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/fp8_lo_group tools/microbench/fp8_lo_group.cu && /tmp/fp8_lo_group
// (It compiles qmma.cu's kernels too, for the helpers: ~10 s more.)
// Prints a markdown table: microseconds a launch (the mean of 5 timed runs of 20 launches after
// 5 warm-up launches, with the runs' min and max) and nanoseconds a group a warpgroup.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

// The kernels' own helpers, as NVRTC sees them (common.cuh, then the family): code_pair and
// wgmma_rs are the product core's.
#include "../../crates/engine/src/backend/cuda/kernels/common.cuh"
#include "../../crates/engine/src/backend/cuda/kernels/qmma.cu"
#include "check.cuh"

enum Form { BF16_HI_LO = 0, F16_HI_E4M3_LO = 1, F16_HI_E4M3_LO_UNCONVERTED = 2, F16_HI_ONLY = 3 };

constexpr int THREADS = 512;    // four warpgroups
constexpr int CODE_SETS = 8;    // distinct codes and scales, cycled over the groups
constexpr int ROWS = 256;       // a block's rows, 64 a warpgroup
constexpr int GROUPS = 4096;    // groups a warpgroup runs in one launch

// Shared memory: two x stages (hi: 64 slots x 64 16-bit columns; lo: 64 slots x 128 bytes, the
// 128-byte swizzle's row: 64 bf16 columns now, or 128 e4m3 columns of which a group's 64 are
// read), each 1,024-byte aligned; then the code sets (a row's 64 4-bit codes in 8 words) and
// their scales (bf16).
struct Smem {
    u16 xh[2][64 * 64];
    unsigned char xl[2][64 * 128];
    u32 codes[CODE_SETS][ROWS * 8];
    u16 scales[CODE_SETS][ROWS];
};

// The f16 pair (column p, column p + 4) of 8-column block b of a row's codes w, as qmma.cu's
// code_pair<4> makes the bf16 one: OR-ing a nibble into the mantissa of 1024.0 gives 1024 + q
// exactly; one f16x2 fused multiply-add takes the 1024 off again (exact).
__device__ __forceinline__ u32 code_pair_f16(const u32* w, int b, int p) {
    u32 t, d;
    asm("lop3.b32 %0, %1, 0x000f000f, 0x64006400, 0xea;" : "=r"(t) : "r"(w[b] >> (4 * p)));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(t), "r"(0x3c003c00u), "r"(0xe400e400u));
    return d;
}
// Four e4m3 values from two f16 pairs (exact for the codes 0-15).
__device__ __forceinline__ u32 e4m3x4(u32 a, u32 b) {
    u32 d;
    asm("{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f16x2 lo, %1; cvt.rn.satfinite.e4m3x2.f16x2 hi, %2; "
        "mov.b32 %0, {lo, hi}; }"
        : "=r"(d)
        : "r"(a), "r"(b));
    return d;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// wgmma_rs (qmma.cu) with f16 operands.
__device__ __forceinline__ void wgmma_rs_f16(float (&d)[32], const u32 (&a)[4], u64 b, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %37, 0; "
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" WGMMA_D32_REGS
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0; }"
        : WGMMA_D32_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate)
        : "memory");
}
__device__ __forceinline__ void mma_e4m3_k32(float (&d)[32], const u32 (&a)[4], u64 b, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %37, 0; "
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" WGMMA_D32_REGS
        "{%32, %33, %34, %35}, %36, p, 1, 1; }"
        : WGMMA_D32_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate)
        : "memory");
}
#endif

template <int FORM>
__global__ void __launch_bounds__(THREADS, 1) group_chain(float* out, int groups) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char raw[];
    Smem& sm = *reinterpret_cast<Smem*>(raw + ((1024 - (smem_addr(raw) & 1023)) & 1023));
    const int tid = threadIdx.x;
    // Arbitrary data: x as small normal values, codes as a mix of every nibble, scales near 1/64.
    for (int i = tid; i < 2 * 64 * 64; i += THREADS) (&sm.xh[0][0])[i] = (u16)(0x3000 + (i * 37 & 0x3ff));
    for (int i = tid; i < 2 * 64 * 128; i += THREADS) (&sm.xl[0][0])[i] = (unsigned char)(0x20 + (i * 13 & 0x3f));
    for (int i = tid; i < CODE_SETS * ROWS * 8; i += THREADS) (&sm.codes[0][0])[i] = 0x9e3779b9u * (u32)(i + 1);
    for (int i = tid; i < CODE_SETS * ROWS; i += THREADS) (&sm.scales[0][0])[i] = (u16)(0x3c80 + (i & 0xff));
    __syncthreads();
    const int wg = tid >> 7, lane = tid & 31, warp = (tid >> 5) & 3;
    const int r = 64 * wg + 16 * warp + (lane >> 2), cq = lane & 3;
    float acc[32] = {};
    u32 fixed[2][4];  // the unconverted form's e4m3 fragments
#pragma unroll
    for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) fixed[s][i] = 0x38404448u + s + i;
    for (int g = 0; g < groups; ++g) {
        const int set = g & (CODE_SETS - 1), stage = g & 1;
        u32 w0[8], w1[8];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const uint4 u = *reinterpret_cast<const uint4*>(&sm.codes[set][r * 8 + 4 * (c ^ (r & 1))]);
            const uint4 v = *reinterpret_cast<const uint4*>(&sm.codes[set][(r + 8) * 8 + 4 * (c ^ (r & 1))]);
            w0[4 * c] = u.x, w0[4 * c + 1] = u.y, w0[4 * c + 2] = u.z, w0[4 * c + 3] = u.w;
            w1[4 * c] = v.x, w1[4 * c + 1] = v.y, w1[4 * c + 2] = v.z, w1[4 * c + 3] = v.w;
        }
        const float s0 = bf16_to_f32(sm.scales[set][r]), s1 = bf16_to_f32(sm.scales[set][r + 8]);
        u32 a[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            auto pair = [&](const u32* w, int b) {
                return FORM == BF16_HI_LO ? code_pair<4>(w, b, cq) : code_pair_f16(w, b, cq);
            };
            a[kk][0] = pair(w0, 2 * kk), a[kk][1] = pair(w1, 2 * kk);
            a[kk][2] = pair(w0, 2 * kk + 1), a[kk][3] = pair(w1, 2 * kk + 1);
        }
        // The e4m3 fragments of the same codes (the K order they give is the one the lo writer
        // would follow): rows r and r + 8, four values a register.
        u32 a8[2][4];
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            if constexpr (FORM == F16_HI_E4M3_LO) {
                a8[s][0] = e4m3x4(a[2 * s][0], a[2 * s][2]);
                a8[s][1] = e4m3x4(a[2 * s][1], a[2 * s][3]);
                a8[s][2] = e4m3x4(a[2 * s + 1][0], a[2 * s + 1][2]);
                a8[s][3] = e4m3x4(a[2 * s + 1][1], a[2 * s + 1][3]);
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) a8[s][i] = fixed[s][i] ^ (u32)set;
            }
        }
        const u64 xh = smem_desc_sw128(sm.xh[stage], 16), xl = smem_desc_sw128(sm.xl[stage], 16);
        float d[32];
        wgmma_fence();
        if constexpr (FORM == BF16_HI_LO) {
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                wgmma_rs(d, a[kk], smem_desc_advance(xh, 32 * kk), kk > 0);
                wgmma_rs(d, a[kk], smem_desc_advance(xl, 32 * kk), 1);
            }
        } else {
            if constexpr (FORM != F16_HI_ONLY) {
                // lo first, into the zeroed accumulator: the fp8 products' narrow accumulation then
                // touches lo's sum alone.
                mma_e4m3_k32(d, a8[0], xl, 0);
                mma_e4m3_k32(d, a8[1], smem_desc_advance(xl, 32), 1);
            }
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                wgmma_rs_f16(d, a[kk], smem_desc_advance(xh, 32 * kk), FORM != F16_HI_ONLY || kk > 0);
        }
        wgmma_commit();
        wgmma_wait_all();
        wgmma_hold(d);
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
            acc[4 * jj] = fmaf(s0, d[4 * jj], acc[4 * jj]);
            acc[4 * jj + 1] = fmaf(s0, d[4 * jj + 1], acc[4 * jj + 1]);
            acc[4 * jj + 2] = fmaf(s1, d[4 * jj + 2], acc[4 * jj + 2]);
            acc[4 * jj + 3] = fmaf(s1, d[4 * jj + 3], acc[4 * jj + 3]);
        }
    }
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) sum += acc[i];
    out[blockIdx.x * THREADS + tid] = sum;
#else
    __trap();
#endif
}

// Times FORM and prints its row; returns its microseconds a launch. base_us: the first form's (0
// for the first form itself).
template <int FORM>
static double run(const char* name, float* out, int sms, double base_us) {
    const int smem = (int)sizeof(Smem) + 1024;
    CHECK(cudaFuncSetAttribute(group_chain<FORM>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    for (int i = 0; i < 5; ++i) group_chain<FORM><<<sms, THREADS, smem>>>(out, GROUPS);
    CHECK(cudaDeviceSynchronize());
    double runs[5];
    for (int k = 0; k < 5; ++k) {
        CHECK(cudaEventRecord(e0));
        for (int i = 0; i < 20; ++i) group_chain<FORM><<<sms, THREADS, smem>>>(out, GROUPS);
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        float ms = 0.f;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        runs[k] = 1000.0 * ms / 20;
    }
    CHECK(cudaGetLastError());
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    double mean = 0;
    for (double v : runs) mean += v / 5;
    const double lo = *std::min_element(runs, runs + 5), hi = *std::max_element(runs, runs + 5);
    std::printf("| %s | %.1f (%.1f-%.1f) | %.1f | ", name, mean, lo, hi, 1000.0 * mean / GROUPS);
    if (base_us > 0) std::printf("%+.2f%%", 100.0 * (base_us / mean - 1.0));
    std::printf(" |\n");
    return mean;
}

int main() {
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    int clock_khz = 0;
    CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    std::printf("%s: %d SMs, %d MHz; one block of 4 warpgroups an SM, %d groups a warpgroup a launch\n\n",
                prop.name, prop.multiProcessorCount, clock_khz / 1000, GROUPS);
    float* out = nullptr;
    CHECK(cudaMalloc(&out, (size_t)prop.multiProcessorCount * THREADS * sizeof(float)));
    std::printf("| form | us a launch (min-max) | ns a group | speed vs bf16 hi + lo |\n|---|---:|---:|---:|\n");
    const int sms = prop.multiProcessorCount;
    const double base = run<BF16_HI_LO>("bf16 hi + bf16 lo (now)", out, sms, 0);
    run<F16_HI_E4M3_LO>("f16 hi + e4m3 lo", out, sms, base);
    run<F16_HI_E4M3_LO_UNCONVERTED>("f16 hi + e4m3 lo, fragments not converted", out, sms, base);
    run<F16_HI_ONLY>("f16 hi alone (no lo)", out, sms, base);
    CHECK(cudaFree(out));
    return 0;
}
