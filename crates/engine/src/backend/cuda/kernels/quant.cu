// MLX affine quantized matrix-vector products for decode (one token).
//
// w[r][c] = scale[r][c/64] * q[r][c] + bias[r][c/64], codes packed low bits first in u32 words,
// scales and biases bf16. Per group the product is scale * sum(q * x) + bias * sum(x), in f32,
// without rounding the dequantized weight (as the CPU reference computes it).
//
// No CUDA headers: NVRTC has no default include path, and bf16 is read as its 16 raw bits.

typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ float bf16_to_f32(u16 v) { return __uint_as_float(((u32)v) << 16); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One warp per output row. Each lane loads 16 bytes of codes at a time (4 words: 32 codes at
// 4 bits, 16 at 8 bits, always inside one group of 64), so a warp reads 512 contiguous bytes per
// step, and unrolling keeps two such loads in flight. x (a few KB) is read as float4 through the
// read-only cache. y[r] = sum_c w[r][c] * x[c]. Rows start 16-byte aligned because every row
// holds a multiple of 64 codes.
template <int BITS>
__device__ __forceinline__ void qgemv_f32(const u32* __restrict__ codes, const u16* __restrict__ scales,
                                          const u16* __restrict__ biases, const float* __restrict__ x,
                                          float* __restrict__ y, int rows, int cols) {
    constexpr int PER_WORD = 32 / BITS;
    constexpr int PER_VEC = 4 * PER_WORD;
    constexpr u32 MASK = (1u << BITS) - 1u;
    const int row = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const int vecs = cols / PER_VEC;
    const int groups = cols >> 6;
    const uint4* wr = reinterpret_cast<const uint4*>(codes + (size_t)row * (cols / PER_WORD));
    const u16* sr = scales + (size_t)row * groups;
    const u16* br = biases + (size_t)row * groups;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float acc = 0.f;
#pragma unroll 2
    for (int v = lane; v < vecs; v += 32) {
        const uint4 w4 = __ldg(wr + v);
        const int c0 = v * PER_VEC;
        const int g = c0 >> 6;
        const u32 ws[4] = {w4.x, w4.y, w4.z, w4.w};
        float dot = 0.f, sx = 0.f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
#pragma unroll
            for (int j4 = 0; j4 < PER_WORD; j4 += 4) {
                const float4 xv = __ldg(x4 + ((c0 + k * PER_WORD + j4) >> 2));
                const float xs[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    dot = fmaf((float)((ws[k] >> (BITS * (j4 + j))) & MASK), xs[j], dot);
                    sx += xs[j];
                }
            }
        }
        acc = fmaf(bf16_to_f32(__ldg(sr + g)), dot, fmaf(bf16_to_f32(__ldg(br + g)), sx, acc));
    }
    acc = warp_sum(acc);
    if (lane == 0) y[row] = acc;
}

// 4-bit: every projection, the experts and lm_head.
extern "C" __global__ void q4_gemv_f32(const u32* codes, const u16* scales, const u16* biases,
                                       const float* x, float* y, int rows, int cols) {
    qgemv_f32<4>(codes, scales, biases, x, y, rows, cols);
}

// 8-bit: the router and the shared-expert gate.
extern "C" __global__ void q8_gemv_f32(const u32* codes, const u16* scales, const u16* biases,
                                       const float* x, float* y, int rows, int cols) {
    qgemv_f32<8>(codes, scales, biases, x, y, rows, cols);
}
