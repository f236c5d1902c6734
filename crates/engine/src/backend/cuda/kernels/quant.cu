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

// One warp per output row; each lane takes whole u32 words (32/BITS codes each), so a warp reads
// 128 contiguous bytes of the row per step. y[r] = sum_c w[r][c] * x[c].
template <int BITS>
__device__ __forceinline__ void qgemv_f32(const u32* __restrict__ codes, const u16* __restrict__ scales,
                                          const u16* __restrict__ biases, const float* __restrict__ x,
                                          float* __restrict__ y, int rows, int cols) {
    constexpr int PER_WORD = 32 / BITS;
    constexpr u32 MASK = (1u << BITS) - 1u;
    const int row = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const int words = cols / PER_WORD;
    const int groups = cols >> 6;
    const u32* wr = codes + (size_t)row * words;
    const u16* sr = scales + (size_t)row * groups;
    const u16* br = biases + (size_t)row * groups;
    float acc = 0.f;
    for (int i = lane; i < words; i += 32) {
        const u32 w = wr[i];
        const int c0 = i * PER_WORD;
        const int g = c0 >> 6;
        float dot = 0.f, sx = 0.f;
#pragma unroll
        for (int j = 0; j < PER_WORD; ++j) {
            const float xv = x[c0 + j];
            dot = fmaf((float)((w >> (BITS * j)) & MASK), xv, dot);
            sx += xv;
        }
        acc = fmaf(bf16_to_f32(sr[g]), dot, fmaf(bf16_to_f32(br[g]), sx, acc));
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
