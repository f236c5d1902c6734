// MLX affine quantized products for decode: matrix-vector, the embedding gather, and the
// routed-expert products of the mixture of experts (prefill's products are in qmma.cu).
//
// w[r][c] = scale[r][c/64] * q[r][c] + bias[r][c/64], codes packed low bits first in u32 words,
// scales and biases bf16. Per group the matrix-vector product is scale * sum(q * x) + bias *
// sum(x), in f32, without rounding the dequantized weight (as the CPU reference computes it).
//
// No CUDA headers: NVRTC has no default include path, and bf16 is read as its 16 raw bits.
// QMat and bf16_to_f32 live in common.cuh (the tensor-core products of qmma.cu share them).


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

// y[t][r] = sum_c w[r][c] * x[t][c] for one token per blockIdx.y, R rows per warp: R = 4
// reuses each staged x value for four rows (large matrices); R = 1 spreads a small matrix over
// four times as many blocks, so that it still occupies the whole GPU. Launch with 256 threads,
// (ceil(rows / (8 * R)), tokens) blocks and cols * 4 bytes of dynamic shared memory.
template <int BITS, int R>
__device__ __forceinline__ void qgemv(QMat w, const float* __restrict__ x, float* __restrict__ y, int rows,
                                      int cols) {
    extern __shared__ float xs[];
    x += (size_t)blockIdx.y * cols;
    y += (size_t)blockIdx.y * rows;
    stage_x<BITS>(xs, x, cols);
    __syncthreads();
    const int row0 = (int)(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
    if (row0 >= rows) return;
    float acc[R] = {};
    qrows_partial<BITS, R>(w, row0, rows, cols, xs, acc);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float v = warp_sum(acc[r]);
        if ((threadIdx.x & 31) == 0 && row0 + r < rows) y[row0 + r] = v;
    }
}

#define QGEMV(BITS, R, NAME)                                                                             \
    extern "C" __global__ void NAME(const u32* codes, const u16* scales, const u16* biases, const float* x, \
                                    float* y, int rows, int cols) { grid_dep();                                      \
        qgemv<BITS, R>({codes, scales, biases}, x, y, rows, cols);                                        \
    }
QGEMV(4, 4, q4_gemv_f32)
QGEMV(8, 4, q8_gemv_f32)
QGEMV(4, 1, q4_gemv_r1)
QGEMV(8, 1, q8_gemv_r1)

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

template <int BITS, int R>
__device__ __forceinline__ void qgemv_batch(const QBatch& b, const float* __restrict__ x, int cols) {
    extern __shared__ float xs[];
    int m = 0;
    while (m < 3 && (int)blockIdx.x >= b.first_block[m + 1]) ++m;
    stage_x<BITS>(xs, x, cols);
    __syncthreads();
    const int rows = b.rows[m];
    const int row0 = (int)((blockIdx.x - b.first_block[m]) * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
    if (row0 >= rows) return;
    float acc[R] = {};
    qrows_partial<BITS, R>({b.codes[m], b.scales[m], b.biases[m]}, row0, rows, cols, xs, acc);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float v = warp_sum(acc[r]);
        if ((threadIdx.x & 31) == 0 && row0 + r < rows) b.y[m][row0 + r] = v;
    }
}

// Launch with 256 threads, first_block[4] blocks (each matrix ceil(rows / (8 * R))) and
// cols * 4 bytes of shared memory; one token.
extern "C" __global__ void q4_gemv_batch(QBatch b, const float* x, int cols) { grid_dep(); qgemv_batch<4, 4>(b, x, cols); }
extern "C" __global__ void q8_gemv_batch(QBatch b, const float* x, int cols) { grid_dep(); qgemv_batch<8, 4>(b, x, cols); }
extern "C" __global__ void q4_gemv_batch_r1(QBatch b, const float* x, int cols) { grid_dep(); qgemv_batch<4, 1>(b, x, cols); }
extern "C" __global__ void q8_gemv_batch_r1(QBatch b, const float* x, int cols) { grid_dep(); qgemv_batch<8, 1>(b, x, cols); }

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
                                    float* out, int cols) { grid_dep();
    embed_rows<4>({codes, scales, biases}, ids, out, cols);
}

extern "C" __global__ void q8_embed(const u32* codes, const u16* scales, const u16* biases, const int* ids,
                                    float* out, int cols) { grid_dep();
    embed_rows<8>({codes, scales, biases}, ids, out, cols);
}

// ---- the mixture-of-experts block. Pair p < pairs is token p / top_k's (p % top_k)-th chosen
// expert ids[p]; pair pairs + t is token t's shared expert (its own matrices, `inter_s` rows).
// Activations act[p] hold `stride` = max(inter, inter_s) floats, outputs y[p] `hidden`.

// act[p][r] = silu(gate[r] . x[t]) * (up[r] . x[t]) for the chosen experts and the shared
// expert only, R rows per warp (4, or 1 to spread a single token's few experts over more
// blocks). Launch with 256 threads, (ceil(stride / (8 R)), pairs + tokens) blocks and
// hidden * 4 bytes of shared memory.
template <int BITS, int R>
__device__ __forceinline__ void moe_gate_up(QMat gate, QMat up, QMat sgate, QMat sup, const int* ids,
                                            const float* x, float* act, int top_k, int pairs, int inter,
                                            int inter_s, int hidden) {
    extern __shared__ float xs[];
    const int p = blockIdx.y;
    const bool shared = p >= pairs;
    const int t = shared ? p - pairs : p / top_k;
    const int rows = shared ? inter_s : inter;
    QMat g = sgate, u = sup;
    if (!shared) {
        const size_t e = (size_t)ids[p];
        g = expert_slice<BITS>(gate, e, inter, hidden);
        u = expert_slice<BITS>(up, e, inter, hidden);
    }
    const int row0 = (int)(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
    if ((int)(blockIdx.x * (blockDim.x >> 5)) * R >= rows) return;  // whole block idle
    stage_x<BITS>(xs, x + (size_t)t * hidden, hidden);
    __syncthreads();
    if (row0 >= rows) return;
    float ag[R] = {}, au[R] = {};
    qrows_partial<BITS, R>(g, row0, rows, hidden, xs, ag);
    qrows_partial<BITS, R>(u, row0, rows, hidden, xs, au);
    const int stride = max(inter, inter_s);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float gv = warp_sum(ag[r]), uv = warp_sum(au[r]);
        if ((threadIdx.x & 31) == 0 && row0 + r < rows) act[(size_t)p * stride + row0 + r] = silu(gv) * uv;
    }
}

// y[p][r] = down[r] . act[p], R rows per warp. Launch with 256 threads, (ceil(hidden / (8 R)),
// pairs + tokens) blocks, stride * 4 bytes of shared memory.
template <int BITS, int R>
__device__ __forceinline__ void moe_down(QMat down, QMat sdown, const int* ids, const float* act, float* y,
                                         int pairs, int inter, int inter_s, int hidden) {
    extern __shared__ float xs[];
    const int p = blockIdx.y;
    const bool shared = p >= pairs;
    const int cols = shared ? inter_s : inter;
    QMat d = sdown;
    if (!shared) {
        d = expert_slice<BITS>(down, (size_t)ids[p], hidden, inter);
    }
    stage_x<BITS>(xs, act + (size_t)p * max(inter, inter_s), cols);
    __syncthreads();
    const int row0 = (int)(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
    if (row0 >= hidden) return;
    float acc[R] = {};
    qrows_partial<BITS, R>(d, row0, hidden, cols, xs, acc);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float v = warp_sum(acc[r]);
        if ((threadIdx.x & 31) == 0 && row0 + r < hidden) y[(size_t)p * hidden + row0 + r] = v;
    }
}

#define MOE_KERNELS(BITS, R, SUFFIX)                                                                        \
    extern "C" __global__ void q##BITS##_moe_gate_up##SUFFIX(QMat gate, QMat up, QMat sgate, QMat sup,       \
                                                            const int* ids, const float* x, float* act,     \
                                                            int top_k, int pairs, int inter, int inter_s,   \
                                                            int hidden) {                                   \
        grid_dep();                                                                                         \
        moe_gate_up<BITS, R>(gate, up, sgate, sup, ids, x, act, top_k, pairs, inter, inter_s, hidden);      \
    }                                                                                                       \
    extern "C" __global__ void q##BITS##_moe_down##SUFFIX(QMat down, QMat sdown, const int* ids,             \
                                                         const float* act, float* y, int pairs, int inter,  \
                                                         int inter_s, int hidden) {                         \
        grid_dep();                                                                                         \
        moe_down<BITS, R>(down, sdown, ids, act, y, pairs, inter, inter_s, hidden);                         \
    }
MOE_KERNELS(4, 4, )
MOE_KERNELS(8, 4, )
MOE_KERNELS(4, 1, _r1)
MOE_KERNELS(8, 1, _r1)

// out[t][c] = sum_j weights[t*k+j] * y[t*k+j][c] (in the order j = 0..k-1, as the reference
// adds), then + sigmoid(shared_logit[t]) * y[pairs + t][c] when there is a shared expert.
extern "C" __global__ void moe_combine(const float* y, const float* weights, const float* shared_logit,
                                       float* out, int tokens, int top_k, int hidden) { grid_dep();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)tokens * hidden) return;
    const size_t t = i / hidden, c = i % hidden;
    float acc = 0.f;
    for (int j = 0; j < top_k; ++j) acc = fmaf(weights[t * top_k + j], y[(t * top_k + j) * hidden + c], acc);
    if (shared_logit) {
        const size_t pairs = (size_t)tokens * top_k;
        acc += y[(pairs + t) * hidden + c] / (1.f + expf(-shared_logit[t]));
    }
    out[i] = acc;
}

// Softmax over each token's router logits, then the top k (ties to the lowest expert id,
// comparing logits as the reference does), optionally renormalised over the chosen k. One warp
// per token. Each (logit, id) is packed in a u64 that orders like the comparison (the logit's
// bits made monotonic, then the complement of the id), so round j picks the largest key below
// round j-1's: no marking of chosen experts, and no shared memory.

extern "C" __global__ void moe_route(const float* logits, int* ids, float* weights, int experts, int top_k,
                                     int renormalize) { grid_dep();
    const int t = blockIdx.x, lane = threadIdx.x & 31;
    const float* l = logits + (size_t)t * experts;
    float m = NEG_INF;
    for (int e = lane; e < experts; e += 32) m = fmaxf(m, l[e]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float z = 0.f;
    for (int e = lane; e < experts; e += 32) z += expf(l[e] - m);
    z = warp_sum(z);
    u64 prev = ~0ull;
    float total = 0.f;
    for (int j = 0; j < top_k; ++j) {
        u64 best = 0;
        for (int e = lane; e < experts; e += 32) {
            const float v = l[e];
            if (v == v) {
                const u64 key = pack_max(v, e);
                if (key < prev && key > best) best = key;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const u64 other = __shfl_xor_sync(0xffffffffu, best, o);
            best = other > best ? other : best;
        }
        prev = best;
        const int id = best ? (int)(0xffffffffu - (u32)best) : 0;  // all NaN: expert 0
        const float p = expf(l[id] - m) / z;
        total += p;
        if (lane == 0) {
            ids[t * top_k + j] = id;
            weights[t * top_k + j] = p;
        }
    }
    if (lane == 0 && renormalize)
        for (int j = 0; j < top_k; ++j) weights[t * top_k + j] /= total;
}
