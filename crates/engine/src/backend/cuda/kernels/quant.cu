// MLX affine quantized products: matrix-vector for decode, a tiled matrix-matrix for prefill,
// the embedding gather, and the routed-expert products of the mixture of experts.
//
// w[r][c] = scale[r][c/64] * q[r][c] + bias[r][c/64], codes packed low bits first in u32 words,
// scales and biases bf16. Per group the matrix-vector product is scale * sum(q * x) + bias *
// sum(x), in f32, without rounding the dequantized weight (as the CPU reference computes it).
//
// No CUDA headers: NVRTC has no default include path, and bf16 is read as its 16 raw bits.

typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ float bf16_to_f32(u16 v) { return __uint_as_float(((u32)v) << 16); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

#define NEG_INF __int_as_float(0xff800000u)

// One quantized matrix (or one expert of a stack: the pointers already offset to it).
struct QMat {
    const u32* codes;
    const u16* scales;
    const u16* biases;
};

// Stages x (cols floats) in shared memory transposed, xs[j][w] = x[w * PER_WORD + j], so that the
// matrix-vector loop reads four consecutive words' x values as one float4.
template <int BITS>
__device__ __forceinline__ void stage_x(float* xs, const float* __restrict__ x, int cols) {
    constexpr int PER_WORD = 32 / BITS;
    const int words = cols / PER_WORD;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) xs[(c % PER_WORD) * words + c / PER_WORD] = x[c];
}

// Lane partial sums of R consecutive rows starting at row0 (rows >= nrows are skipped) against
// the staged x. At each step lane l takes the four words 4v..4v+3 (v = step*32 + l) of each row as
// one 16-byte load (a warp reads 512 contiguous bytes per row) and their x values as float4 reads
// of consecutive shared-memory words (no bank conflicts); each x value serves R rows.
// Needs cols to be a multiple of 64 (every MLX tensor's is). The caller reduces over the warp.
template <int BITS, int R>
__device__ __forceinline__ void qrows_partial(QMat w, int row0, int nrows, int cols, const float* xs,
                                              float acc[R]) {
    constexpr int PER_WORD = 32 / BITS;
    constexpr u32 MASK = (1u << BITS) - 1u;
    const int lane = threadIdx.x & 31;
    const int words = cols / PER_WORD;
    const int groups = cols >> 6;
    const int vecs = words >> 2;
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
        for (int r = 0; r < R; ++r) {
            const int row = row0 + r;
            if (row < nrows) {
                const uint4 q = __ldg(reinterpret_cast<const uint4*>(w.codes + (size_t)row * words) + v);
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
                acc[r] = fmaf(bf16_to_f32(__ldg(w.scales + gi)), dot,
                              fmaf(bf16_to_f32(__ldg(w.biases + gi)), sx, acc[r]));
            }
        }
    }
}

// ROWS_PER_WARP rows per warp, 8 warps per block (256 threads): 32 rows per block.
constexpr int ROWS_PER_WARP = 4;

// y[t][r] = sum_c w[r][c] * x[t][c] for one token per blockIdx.y. Launch with 256 threads,
// (ceil(rows / 32), tokens) blocks and cols * 4 bytes of dynamic shared memory.
template <int BITS>
__device__ __forceinline__ void qgemv(QMat w, const float* __restrict__ x, float* __restrict__ y, int rows,
                                      int cols) {
    extern __shared__ float xs[];
    x += (size_t)blockIdx.y * cols;
    y += (size_t)blockIdx.y * rows;
    stage_x<BITS>(xs, x, cols);
    __syncthreads();
    const int row0 = (int)(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * ROWS_PER_WARP;
    if (row0 >= rows) return;
    float acc[ROWS_PER_WARP] = {};
    qrows_partial<BITS, ROWS_PER_WARP>(w, row0, rows, cols, xs, acc);
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const float v = warp_sum(acc[r]);
        if ((threadIdx.x & 31) == 0 && row0 + r < rows) y[row0 + r] = v;
    }
}

extern "C" __global__ void q4_gemv_f32(const u32* codes, const u16* scales, const u16* biases,
                                       const float* x, float* y, int rows, int cols) {
    qgemv<4>({codes, scales, biases}, x, y, rows, cols);
}

extern "C" __global__ void q8_gemv_f32(const u32* codes, const u16* scales, const u16* biases,
                                       const float* x, float* y, int rows, int cols) {
    qgemv<8>({codes, scales, biases}, x, y, rows, cols);
}

// Up to four matrices of the same width and bit width that read the same x (the fused input
// projections of a layer): one launch, blocks assigned to matrices in order, ceil(rows_m / 32)
// each. Passed by value as one kernel parameter.
struct QBatch {
    const u32* codes[4];
    const u16* scales[4];
    const u16* biases[4];
    float* y[4];
    int rows[4];
    int first_block[5];
};

template <int BITS>
__device__ __forceinline__ void qgemv_batch(const QBatch& b, const float* __restrict__ x, int cols) {
    extern __shared__ float xs[];
    int m = 0;
    while (m < 3 && (int)blockIdx.x >= b.first_block[m + 1]) ++m;
    stage_x<BITS>(xs, x, cols);
    __syncthreads();
    const int rows = b.rows[m];
    const int row0 = (int)((blockIdx.x - b.first_block[m]) * (blockDim.x >> 5) + (threadIdx.x >> 5)) * ROWS_PER_WARP;
    if (row0 >= rows) return;
    float acc[ROWS_PER_WARP] = {};
    qrows_partial<BITS, ROWS_PER_WARP>({b.codes[m], b.scales[m], b.biases[m]}, row0, rows, cols, xs, acc);
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const float v = warp_sum(acc[r]);
        if ((threadIdx.x & 31) == 0 && row0 + r < rows) b.y[m][row0 + r] = v;
    }
}

// Launch with 256 threads, first_block[4] blocks and cols * 4 bytes of shared memory; one token.
extern "C" __global__ void q4_gemv_batch(QBatch b, const float* x, int cols) { qgemv_batch<4>(b, x, cols); }
extern "C" __global__ void q8_gemv_batch(QBatch b, const float* x, int cols) { qgemv_batch<8>(b, x, cols); }

// Tiled matrix-matrix product for prefill: y[t][n] = sum_k x[t][k] * w[n][k] over a 64x64 tile
// of (weight rows, tokens) per block of 256 threads, one 64-column group per step: the group's
// weights are dequantized once into shared memory and serve 64 tokens. Each thread owns 4x4
// outputs. SIMT f32; tensor-core tiles are the next step for prefill.
constexpr int MM_TILE = 64;

template <int BITS>
__device__ __forceinline__ void qgemm(QMat w, const float* __restrict__ x, float* __restrict__ y, int tokens,
                                      int rows, int cols) {
    constexpr int PER_WORD = 32 / BITS;
    constexpr u32 MASK = (1u << BITS) - 1u;
    constexpr int WORDS_PER_GROUP = 64 / PER_WORD;
    __shared__ float ws[MM_TILE][MM_TILE + 1];
    __shared__ float xt[MM_TILE][MM_TILE + 1];
    const int n0 = blockIdx.x * MM_TILE, t0 = blockIdx.y * MM_TILE;
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const int words = cols / PER_WORD, groups = cols >> 6;
    float acc[4][4] = {};
    for (int g = 0; g < groups; ++g) {
        // Dequantize the 64x64 weight tile: 64 rows x WORDS_PER_GROUP words.
        for (int i = threadIdx.x; i < MM_TILE * WORDS_PER_GROUP; i += blockDim.x) {
            const int r = i / WORDS_PER_GROUP, wi = i % WORDS_PER_GROUP;
            const int row = n0 + r;
            if (row < rows) {
                const u32 q = __ldg(w.codes + (size_t)row * words + g * WORDS_PER_GROUP + wi);
                const float s = bf16_to_f32(__ldg(w.scales + (size_t)row * groups + g));
                const float b = bf16_to_f32(__ldg(w.biases + (size_t)row * groups + g));
#pragma unroll
                for (int j = 0; j < PER_WORD; ++j) ws[r][wi * PER_WORD + j] = fmaf(s, (float)((q >> (BITS * j)) & MASK), b);
            } else {
#pragma unroll
                for (int j = 0; j < PER_WORD; ++j) ws[r][wi * PER_WORD + j] = 0.f;
            }
        }
        for (int i = threadIdx.x; i < MM_TILE * MM_TILE; i += blockDim.x) {
            const int t = i >> 6, k = i & 63;
            xt[t][k] = (t0 + t < tokens) ? x[(size_t)(t0 + t) * cols + g * 64 + k] : 0.f;
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < 64; ++k) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = ws[tx + 16 * i][k];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = xt[ty + 16 * j][k];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = n0 + tx + 16 * i, t = t0 + ty + 16 * j;
            if (n < rows && t < tokens) y[(size_t)t * rows + n] = acc[i][j];
        }
}

// Launch with 256 threads and (ceil(rows / 64), ceil(tokens / 64)) blocks.
extern "C" __global__ void q4_gemm_f32(const u32* codes, const u16* scales, const u16* biases,
                                       const float* x, float* y, int tokens, int rows, int cols) {
    qgemm<4>({codes, scales, biases}, x, y, tokens, rows, cols);
}

extern "C" __global__ void q8_gemm_f32(const u32* codes, const u16* scales, const u16* biases,
                                       const float* x, float* y, int tokens, int rows, int cols) {
    qgemm<8>({codes, scales, biases}, x, y, tokens, rows, cols);
}

// out[t][c] = dequantized row ids[t] of the table. One block per token.
template <int BITS>
__device__ __forceinline__ void embed_rows(QMat w, const int* ids, float* out, int cols) {
    constexpr int PER_WORD = 32 / BITS;
    constexpr u32 MASK = (1u << BITS) - 1u;
    const size_t row = (size_t)ids[blockIdx.x];
    const int words = cols / PER_WORD, groups = cols >> 6;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const u32 q = (w.codes[row * words + c / PER_WORD] >> (BITS * (c % PER_WORD))) & MASK;
        const size_t gi = row * groups + (c >> 6);
        out[(size_t)blockIdx.x * cols + c] = fmaf(bf16_to_f32(w.scales[gi]), (float)q, bf16_to_f32(w.biases[gi]));
    }
}

extern "C" __global__ void q4_embed(const u32* codes, const u16* scales, const u16* biases, const int* ids,
                                    float* out, int cols) {
    embed_rows<4>({codes, scales, biases}, ids, out, cols);
}

extern "C" __global__ void q8_embed(const u32* codes, const u16* scales, const u16* biases, const int* ids,
                                    float* out, int cols) {
    embed_rows<8>({codes, scales, biases}, ids, out, cols);
}

// ---- routed experts. Pair p = t * top_k + j is token t's j-th chosen expert ids[p].

// act[p][r] = silu(gate_e[r] . x[t]) * (up_e[r] . x[t]) for the chosen experts only: each block
// covers 32 rows of one pair, reading the gate and up rows of that expert alone.
// Launch with 256 threads, (ceil(inter / 32), pairs) blocks, hidden * 4 bytes of shared memory.
template <int BITS>
__device__ __forceinline__ void moe_gate_up(QMat gate, QMat up, const int* ids, const float* x, float* act,
                                            int top_k, int inter, int hidden) {
    constexpr int PER_WORD = 32 / BITS;
    extern __shared__ float xs[];
    const int p = blockIdx.y, t = p / top_k;
    const size_t e = (size_t)ids[p];
    const size_t wofs = e * inter * (hidden / PER_WORD), gofs = e * inter * (hidden >> 6);
    const QMat g = {gate.codes + wofs, gate.scales + gofs, gate.biases + gofs};
    const QMat u = {up.codes + wofs, up.scales + gofs, up.biases + gofs};
    stage_x<BITS>(xs, x + (size_t)t * hidden, hidden);
    __syncthreads();
    const int row0 = (int)(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * ROWS_PER_WARP;
    if (row0 >= inter) return;
    float ag[ROWS_PER_WARP] = {}, au[ROWS_PER_WARP] = {};
    qrows_partial<BITS, ROWS_PER_WARP>(g, row0, inter, hidden, xs, ag);
    qrows_partial<BITS, ROWS_PER_WARP>(u, row0, inter, hidden, xs, au);
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const float gv = warp_sum(ag[r]), uv = warp_sum(au[r]);
        if ((threadIdx.x & 31) == 0 && row0 + r < inter) act[(size_t)p * inter + row0 + r] = silu(gv) * uv;
    }
}

extern "C" __global__ void q4_moe_gate_up(const u32* gc, const u16* gs, const u16* gb, const u32* uc,
                                          const u16* us, const u16* ub, const int* ids, const float* x,
                                          float* act, int top_k, int inter, int hidden) {
    moe_gate_up<4>({gc, gs, gb}, {uc, us, ub}, ids, x, act, top_k, inter, hidden);
}

extern "C" __global__ void q8_moe_gate_up(const u32* gc, const u16* gs, const u16* gb, const u32* uc,
                                          const u16* us, const u16* ub, const int* ids, const float* x,
                                          float* act, int top_k, int inter, int hidden) {
    moe_gate_up<8>({gc, gs, gb}, {uc, us, ub}, ids, x, act, top_k, inter, hidden);
}

// y[p][r] = down_e[r] . act[p]. Launch with 256 threads, (ceil(hidden / 32), pairs) blocks,
// inter * 4 bytes of shared memory.
template <int BITS>
__device__ __forceinline__ void moe_down(QMat down, const int* ids, const float* act, float* y, int inter,
                                         int hidden) {
    constexpr int PER_WORD = 32 / BITS;
    extern __shared__ float xs[];
    const int p = blockIdx.y;
    const size_t e = (size_t)ids[p];
    const size_t wofs = e * hidden * (inter / PER_WORD), gofs = e * hidden * (inter >> 6);
    const QMat d = {down.codes + wofs, down.scales + gofs, down.biases + gofs};
    stage_x<BITS>(xs, act + (size_t)p * inter, inter);
    __syncthreads();
    const int row0 = (int)(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * ROWS_PER_WARP;
    if (row0 >= hidden) return;
    float acc[ROWS_PER_WARP] = {};
    qrows_partial<BITS, ROWS_PER_WARP>(d, row0, hidden, inter, xs, acc);
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const float v = warp_sum(acc[r]);
        if ((threadIdx.x & 31) == 0 && row0 + r < hidden) y[(size_t)p * hidden + row0 + r] = v;
    }
}

extern "C" __global__ void q4_moe_down(const u32* dc, const u16* ds, const u16* db, const int* ids,
                                       const float* act, float* y, int inter, int hidden) {
    moe_down<4>({dc, ds, db}, ids, act, y, inter, hidden);
}

extern "C" __global__ void q8_moe_down(const u32* dc, const u16* ds, const u16* db, const int* ids,
                                       const float* act, float* y, int inter, int hidden) {
    moe_down<8>({dc, ds, db}, ids, act, y, inter, hidden);
}

// out[t][c] = sum_j weights[t*k+j] * y[t*k+j][c], in the order j = 0..k-1 (as the reference adds).
extern "C" __global__ void moe_combine(const float* y, const float* weights, float* out, int tokens, int top_k,
                                       int hidden) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)tokens * hidden) return;
    const size_t t = i / hidden, c = i % hidden;
    float acc = 0.f;
    for (int j = 0; j < top_k; ++j) acc = fmaf(weights[t * top_k + j], y[(t * top_k + j) * hidden + c], acc);
    out[i] = acc;
}

// Softmax over each token's router logits, then top-k by repeated block argmax (ties to the
// lowest expert id, comparing logits as the reference does), optionally renormalised over the
// chosen k. One block of 256 threads per token; experts <= 1024.
extern "C" __global__ void moe_route(const float* logits, int* ids, float* weights, int experts, int top_k,
                                     int renormalize) {
    __shared__ float l[1024];
    __shared__ float red_v[32];
    __shared__ int red_i[32];
    __shared__ float chosen_p[64];
    const int t = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) l[e] = logits[(size_t)t * experts + e];
    __syncthreads();
    // max and sum of exp
    float m = NEG_INF;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) m = fmaxf(m, l[e]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red_v[warp] = m;
    __syncthreads();
    m = red_v[0];
    for (int w = 1; w < nw; ++w) m = fmaxf(m, red_v[w]);
    __syncthreads();
    float z = 0.f;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) z += expf(l[e] - m);
    z = warp_sum(z);
    if (lane == 0) red_v[warp] = z;
    __syncthreads();
    z = 0.f;
    for (int w = 0; w < nw; ++w) z += red_v[w];
    __syncthreads();
    for (int j = 0; j < top_k; ++j) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int e = threadIdx.x; e < experts; e += blockDim.x) {
            const float v = l[e];
            if (v > bv || (v == bv && e < bi)) { bv = v; bi = e; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) { red_v[warp] = bv; red_i[warp] = bi; }
        __syncthreads();
        if (threadIdx.x == 0) {
            float v = red_v[0];
            int i = red_i[0];
            for (int w = 1; w < nw; ++w)
                if (red_v[w] > v || (red_v[w] == v && red_i[w] < i)) { v = red_v[w]; i = red_i[w]; }
            if (i >= experts) i = 0;  // every logit NaN: expert 0, as the reference's sort leaves it
            ids[t * top_k + j] = i;
            chosen_p[j] = expf(l[i] - m) / z;
            l[i] = __int_as_float(0x7fc00000u);  // NaN: never chosen again
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int j = 0; j < top_k; ++j) total += chosen_p[j];
        for (int j = 0; j < top_k; ++j) weights[t * top_k + j] = renormalize ? chosen_p[j] / total : chosen_p[j];
    }
}
