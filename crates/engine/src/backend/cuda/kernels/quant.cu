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

// ROWS_PER_WARP rows per warp, 8 warps per block. x is staged once per block in shared memory,
// transposed so that xs[j][w] = x[w * PER_WORD + j]. At each step lane l takes the four words
// 4v..4v+3 (v = step*32 + l) of each of its rows as one 16-byte load (a warp reads 512 contiguous
// bytes per row) and their x values as float4 reads of consecutive shared-memory words (no bank
// conflicts). Each x value read serves ROWS_PER_WARP rows. y[r] = sum_c w[r][c] * x[c].
// Dynamic shared memory: cols floats. Needs cols to be a multiple of 64 (every MLX tensor's is).
constexpr int ROWS_PER_WARP = 4;

template <int BITS>
__device__ __forceinline__ void qgemv_f32(const u32* __restrict__ codes, const u16* __restrict__ scales,
                                          const u16* __restrict__ biases, const float* __restrict__ x,
                                          float* __restrict__ y, int rows, int cols) {
    constexpr int PER_WORD = 32 / BITS;
    constexpr u32 MASK = (1u << BITS) - 1u;
    extern __shared__ float xs[];
    const int words = cols / PER_WORD;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) xs[(c % PER_WORD) * words + c / PER_WORD] = x[c];
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int row0 = (int)(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * ROWS_PER_WARP;
    if (row0 >= rows) return;
    const int groups = cols >> 6;
    const int vecs = words >> 2;
    float acc[ROWS_PER_WARP] = {};
    for (int v = lane; v < vecs; v += 32) {
        float4 xv[PER_WORD];
        float sx = 0.f;
#pragma unroll
        for (int j = 0; j < PER_WORD; ++j) {
            xv[j] = reinterpret_cast<const float4*>(xs + j * words)[v];
            sx += (xv[j].x + xv[j].y) + (xv[j].z + xv[j].w);
        }
        const int g = (v * 4 * PER_WORD) >> 6;
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            const int row = row0 + r;
            if (row < rows) {
                const uint4 q = __ldg(reinterpret_cast<const uint4*>(codes + (size_t)row * words) + v);
                float dot = 0.f;
#pragma unroll
                for (int j = 0; j < PER_WORD; ++j) {
                    const int sh = BITS * j;
                    dot = fmaf((float)((q.x >> sh) & MASK), xv[j].x, dot);
                    dot = fmaf((float)((q.y >> sh) & MASK), xv[j].y, dot);
                    dot = fmaf((float)((q.z >> sh) & MASK), xv[j].z, dot);
                    dot = fmaf((float)((q.w >> sh) & MASK), xv[j].w, dot);
                }
                const size_t gi = (size_t)row * groups + g;
                acc[r] = fmaf(bf16_to_f32(__ldg(scales + gi)), dot, fmaf(bf16_to_f32(__ldg(biases + gi)), sx, acc[r]));
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const float v = warp_sum(acc[r]);
        if (lane == 0 && row0 + r < rows) y[row0 + r] = v;
    }
}

// 4-bit: every projection, the experts and lm_head. Launch with 256 threads, ceil(rows / 32)
// blocks and cols * 4 bytes of dynamic shared memory.
extern "C" __global__ void q4_gemv_f32(const u32* codes, const u16* scales, const u16* biases,
                                       const float* x, float* y, int rows, int cols) {
    qgemv_f32<4>(codes, scales, biases, x, y, rows, cols);
}

// 8-bit: the router and the shared-expert gate.
extern "C" __global__ void q8_gemv_f32(const u32* codes, const u16* scales, const u16* biases,
                                       const float* x, float* y, int rows, int cols) {
    qgemv_f32<8>(codes, scales, biases, x, y, rows, cols);
}
