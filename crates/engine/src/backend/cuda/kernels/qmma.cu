// Quantized products on the tensor cores, for prefill: the dense product over a chunk's tokens,
// and the routed experts grouped by expert (each expert's weights read once per 64 of the
// tokens routed to it, instead of once per token).
//
// Exactness. MLX codes are small integers, exact in bf16, so the tensor cores multiply the codes
// themselves, never a rounded dequantized weight. Each activation is split into two bf16 parts
// (hi = bf16(x), lo = bf16(x - hi); 16 significant bits together), both multiplied, so the dot
// of a 64-column group is accumulated in f32 with a relative error near 2^-17. The group's scale
// and bias are then applied in f32 as the matrix-vector kernels do:
//   acc = scale * sum(q * x) + (bias * sum(x) + acc)
// which keeps the products within ~1e-10 (NMSE) of the CPU reference.
//
// Tile: 64 weight rows x 64 token slots per block of 8 warps (2 along rows x 4 along tokens,
// each warp 32 rows x 16 tokens as 2 x 2 mma.m16n8k16 tiles), one 64-column group per step.
// The next group's codes and activations are loaded into registers while the tensor cores work
// on the current one. Slot s of a block reads activation row xrow[s] and writes output row
// yrow[s] (null: an empty slot), so one core serves dense and grouped products.

constexpr int TC_BM = 64;
constexpr int TC_BN = 64;
// Shared row pitch in bf16: 64 + 8, so that the fragment loads of a warp hit 32 different banks.
constexpr int TC_LD = 72;
constexpr int TC_THREADS = 256;

// NMAT = 1: a plain product; NMAT = 2: gate and up of one expert, written as silu(gate) * up.
template <int NMAT>
struct TcSmem {
    u16 w[NMAT][TC_BM][TC_LD];  // codes as bf16
    u16 xh[TC_BN][TC_LD];       // activations, high part
    u16 xl[TC_BN][TC_LD];       // activations, low part
    float scale[NMAT][TC_BM];
    float bias[NMAT][TC_BM];
    float sx[TC_BN];  // sum of the group's activations per slot
    const float* xrow[TC_BN];
    float* yrow[TC_BN];
};

// The matrices of one product, by value (an array behind a pointer would live in local memory).
template <int NMAT>
struct QMats {
    QMat m[NMAT];
};

// One group's global data, held in registers between its load and its store to shared memory.
template <int BITS, int NMAT>
struct TcStage {
    static constexpr int WORDS = 64 * BITS / 32;            // code words per row and group
    static constexpr int WPT = TC_BM * WORDS / TC_THREADS;  // code words per thread and matrix
    u32 codes[NMAT][WPT];
    float4 x[4];
    u16 s, b;
};

template <int BITS, int NMAT>
__device__ __forceinline__ void tc_load(TcStage<BITS, NMAT>& st, const QMats<NMAT>& mats, const TcSmem<NMAT>& sm,
                                        int n0, int rows, int cols, int g) {
    constexpr int WORDS = TcStage<BITS, NMAT>::WORDS;
    const int tid = threadIdx.x;
    const size_t words = (size_t)cols * BITS / 32;
#pragma unroll
    for (int m = 0; m < NMAT; ++m)
#pragma unroll
        for (int j = 0; j < TcStage<BITS, NMAT>::WPT; ++j) {
            const int i = tid + j * TC_THREADS, r = i / WORDS, wi = i % WORDS;
            st.codes[m][j] = n0 + r < rows ? __ldg(mats.m[m].codes + (size_t)(n0 + r) * words + g * WORDS + wi) : 0u;
        }
    // Threads 64 * m + r fetch row r's scale and bias of matrix m.
    const int m = tid / TC_BM, r = tid % TC_BM;
    st.s = st.b = 0;
    if (m < NMAT && n0 + r < rows) {
        const size_t gi = (size_t)(n0 + r) * (cols >> 6) + g;
        st.s = __ldg(mats.m[m].scales + gi);
        st.b = __ldg(mats.m[m].biases + gi);
    }
    // Four threads per slot, 16 columns each.
    const float* xr = sm.xrow[tid >> 2];
#pragma unroll
    for (int v = 0; v < 4; ++v)
        st.x[v] = xr ? *reinterpret_cast<const float4*>(xr + g * 64 + (tid & 3) * 16 + 4 * v)
                     : make_float4(0.f, 0.f, 0.f, 0.f);
}

template <int BITS, int NMAT>
__device__ __forceinline__ void tc_store(const TcStage<BITS, NMAT>& st, TcSmem<NMAT>& sm) {
    constexpr int WORDS = TcStage<BITS, NMAT>::WORDS;
    constexpr int PER_WORD = 32 / BITS;
    constexpr u32 MASK = (1u << BITS) - 1u;
    const int tid = threadIdx.x;
#pragma unroll
    for (int m = 0; m < NMAT; ++m)
#pragma unroll
        for (int j = 0; j < TcStage<BITS, NMAT>::WPT; ++j) {
            const int i = tid + j * TC_THREADS, r = i / WORDS, wi = i % WORDS;
            const u32 q = st.codes[m][j];
            u32 packed[PER_WORD / 2];
#pragma unroll
            for (int p = 0; p < PER_WORD / 2; ++p) {
                // Codes up to 255 are exact in bf16: the top half of their f32 bits.
                const u32 lo = __float_as_uint((float)((q >> (BITS * 2 * p)) & MASK)) >> 16;
                const u32 hi = __float_as_uint((float)((q >> (BITS * (2 * p + 1))) & MASK)) >> 16;
                packed[p] = lo | (hi << 16);
            }
            u32* dst = reinterpret_cast<u32*>(&sm.w[m][r][wi * PER_WORD]);
#pragma unroll
            for (int p = 0; p < PER_WORD / 2; ++p) dst[p] = packed[p];
        }
    const int m = tid / TC_BM, r = tid % TC_BM;
    if (m < NMAT) {
        sm.scale[m][r] = bf16_to_f32(st.s);
        sm.bias[m][r] = bf16_to_f32(st.b);
    }
    const int slot = tid >> 2, c0 = (tid & 3) * 16;
    u32 hi[8], lo[8];
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < 4; ++v) {
        const float f[4] = {st.x[v].x, st.x[v].y, st.x[v].z, st.x[v].w};
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
            u32 h0, l0, h1, l1;
            bf16_split(f[e], h0, l0);
            bf16_split(f[e + 1], h1, l1);
            hi[2 * v + e / 2] = h0 | (h1 << 16);
            lo[2 * v + e / 2] = l0 | (l1 << 16);
            sum += f[e] + f[e + 1];
        }
    }
    u32* dh = reinterpret_cast<u32*>(&sm.xh[slot][c0]);
    u32* dl = reinterpret_cast<u32*>(&sm.xl[slot][c0]);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        dh[i] = hi[i];
        dl[i] = lo[i];
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if ((tid & 3) == 0) sm.sx[slot] = sum;
}

// The block's 64 rows [n0, n0 + 64) of `rows` against its slots (set in sm.xrow / sm.yrow, and
// synchronised, by the caller) over `cols` columns; results written to the slots' rows.
template <int BITS, int NMAT>
__device__ __forceinline__ void tc_product(const QMats<NMAT> mats, TcSmem<NMAT>& sm, int n0, int rows, int cols) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp & 1, wn = warp >> 1;  // warp tile: rows wm * 32.., slots wn * 16..
    const int gq = lane >> 2, cq = lane & 3;  // mma fragment coordinates
    float acc[NMAT][2][2][4] = {};
    TcStage<BITS, NMAT> st;
    const int groups = cols >> 6;
    tc_load<BITS, NMAT>(st, mats, sm, n0, rows, cols, 0);
    tc_store<BITS, NMAT>(st, sm);
    __syncthreads();
    for (int g = 0; g < groups; ++g) {
        if (g + 1 < groups) tc_load<BITS, NMAT>(st, mats, sm, n0, rows, cols, g + 1);
        float d[NMAT][2][2][4] = {};
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const int k0 = kk * 16 + 2 * cq;
            u32 bh[2][2], bl[2][2];
#pragma unroll
            for (int ni = 0; ni < 2; ++ni) {
                const int s = wn * 16 + ni * 8 + gq;
                bh[ni][0] = *reinterpret_cast<const u32*>(&sm.xh[s][k0]);
                bh[ni][1] = *reinterpret_cast<const u32*>(&sm.xh[s][k0 + 8]);
                bl[ni][0] = *reinterpret_cast<const u32*>(&sm.xl[s][k0]);
                bl[ni][1] = *reinterpret_cast<const u32*>(&sm.xl[s][k0 + 8]);
            }
#pragma unroll
            for (int m = 0; m < NMAT; ++m)
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) {
                    const int r = wm * 32 + mi * 16 + gq;
                    u32 a[4];
                    a[0] = *reinterpret_cast<const u32*>(&sm.w[m][r][k0]);
                    a[1] = *reinterpret_cast<const u32*>(&sm.w[m][r + 8][k0]);
                    a[2] = *reinterpret_cast<const u32*>(&sm.w[m][r][k0 + 8]);
                    a[3] = *reinterpret_cast<const u32*>(&sm.w[m][r + 8][k0 + 8]);
#pragma unroll
                    for (int ni = 0; ni < 2; ++ni) {
                        mma_bf16(d[m][mi][ni], a, bh[ni]);
                        mma_bf16(d[m][mi][ni], a, bl[ni]);
                    }
                }
        }
#pragma unroll
        for (int m = 0; m < NMAT; ++m)
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int ni = 0; ni < 2; ++ni)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int r = wm * 32 + mi * 16 + gq + (e >> 1) * 8;
                        const int s = wn * 16 + ni * 8 + 2 * cq + (e & 1);
                        acc[m][mi][ni][e] =
                            fmaf(sm.scale[m][r], d[m][mi][ni][e], fmaf(sm.bias[m][r], sm.sx[s], acc[m][mi][ni][e]));
                    }
        __syncthreads();
        if (g + 1 < groups) tc_store<BITS, NMAT>(st, sm);
        __syncthreads();
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 2; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = n0 + wm * 32 + mi * 16 + gq + (e >> 1) * 8;
                float* y = sm.yrow[wn * 16 + ni * 8 + 2 * cq + (e & 1)];
                if (y && r < rows)
                    y[r] = NMAT == 2 ? silu(acc[0][mi][ni][e]) * acc[NMAT - 1][mi][ni][e] : acc[0][mi][ni][e];
            }
}

// y[t][n] = sum_k w[n][k] * x[t][k]. Launch with 256 threads and (ceil(rows / 64),
// ceil(tokens / 64)) blocks; cols a multiple of 64.
template <int BITS>
__device__ __forceinline__ void qmma_dense(QMat w, const float* x, float* y, int tokens, int rows, int cols) {
    __shared__ TcSmem<1> sm;
    if (threadIdx.x < TC_BN) {
        const int t = blockIdx.y * TC_BN + threadIdx.x;
        sm.xrow[threadIdx.x] = t < tokens ? x + (size_t)t * cols : nullptr;
        sm.yrow[threadIdx.x] = t < tokens ? y + (size_t)t * rows : nullptr;
    }
    __syncthreads();
    tc_product<BITS, 1>({{w}}, sm, blockIdx.x * TC_BM, rows, cols);
}

extern "C" __global__ void __launch_bounds__(TC_THREADS)
    q4_mma(QMat w, const float* x, float* y, int tokens, int rows, int cols) {
    grid_dep();
    qmma_dense<4>(w, x, y, tokens, rows, cols);
}
extern "C" __global__ void __launch_bounds__(TC_THREADS)
    q8_mma(QMat w, const float* x, float* y, int tokens, int rows, int cols) {
    grid_dep();
    qmma_dense<8>(w, x, y, tokens, rows, cols);
}

// ---- the routed experts grouped by expert. Pair p < pairs is token p / top_k's (p % top_k)-th
// chosen expert ids[p]; with a shared expert, pair pairs + t is token t's, as the virtual expert
// `experts`. moe_group sorts the pairs by expert (perm) and cuts each expert's run into tiles of
// up to 64 pairs: tiles[3 * i] = expert, [3 * i + 1] = first index into perm, [3 * i + 2] =
// pairs in the tile; ntiles[0] = the tile count. The order of the pairs inside an expert's run
// does not matter: each pair's outputs depend only on its own activations.

constexpr int MAX_GROUPS = 1024;

// One block of 1024 threads. Expert ids must lie in [0, experts); experts + 1 <= MAX_GROUPS.
extern "C" __global__ void moe_group(const int* ids, int pairs, int tokens, int experts, int with_shared,
                                     int* perm, int* tiles, int* ntiles) {
    grid_dep();
    __shared__ int count[MAX_GROUPS], start[MAX_GROUPS], first_tile[MAX_GROUPS], filled[MAX_GROUPS];
    const int groups = experts + (with_shared ? 1 : 0);
    for (int e = threadIdx.x; e < groups; e += blockDim.x) {
        count[e] = 0;
        filled[e] = 0;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) atomicAdd(&count[ids[p]], 1);
    if (with_shared && threadIdx.x == 0) count[experts] = tokens;
    __syncthreads();
    if (threadIdx.x == 0) {
        int s = 0, tl = 0;
        for (int e = 0; e < groups; ++e) {
            start[e] = s;
            first_tile[e] = tl;
            s += count[e];
            tl += (count[e] + TC_BN - 1) / TC_BN;
        }
        ntiles[0] = tl;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < groups; e += blockDim.x)
        for (int j = 0; j * TC_BN < count[e]; ++j) {
            int* tile = tiles + 3 * (first_tile[e] + j);
            tile[0] = e;
            tile[1] = start[e] + j * TC_BN;
            tile[2] = min(TC_BN, count[e] - j * TC_BN);
        }
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int e = ids[p];
        perm[start[e] + atomicAdd(&filled[e], 1)] = p;
    }
    if (with_shared)
        for (int t = threadIdx.x; t < tokens; t += blockDim.x) perm[start[experts] + t] = pairs + t;
}

// Expert e's matrix within a stack of `rows` x `cols` matrices (the shared expert's own when
// e == experts).
template <int BITS>
__device__ __forceinline__ QMat expert_mat(QMat stack, QMat shared, int e, int experts, int rows, int cols) {
    if (e == experts) return shared;
    const size_t wofs = (size_t)e * rows * (cols * BITS / 32), gofs = (size_t)e * rows * (cols >> 6);
    return {stack.codes + wofs, stack.scales + gofs, stack.biases + gofs};
}

// act[p][r] = silu(gate_e[r] . x[t]) * (up_e[r] . x[t]) for every pair p (act rows hold
// stride = max(inter, inter_s) floats). Launch with 256 threads and (max tiles,
// ceil(stride / 64)) blocks; blocks past ntiles[0] return.
template <int BITS>
__device__ __forceinline__ void moe_gate_up_mma(QMat gate, QMat up, QMat sgate, QMat sup, const int* perm,
                                                const int* tiles, const int* ntiles, const float* x, float* act,
                                                int top_k, int pairs, int experts, int inter, int inter_s,
                                                int hidden) {
    __shared__ TcSmem<2> sm;
    if ((int)blockIdx.x >= ntiles[0]) return;
    const int* tile = tiles + 3 * blockIdx.x;
    const int e = tile[0];
    const int rows = e == experts ? inter_s : inter;
    const int n0 = blockIdx.y * TC_BM;
    if (n0 >= rows) return;
    const int stride = max(inter, inter_s);
    if (threadIdx.x < TC_BN) {
        const bool used = (int)threadIdx.x < tile[2];
        const int p = used ? perm[tile[1] + threadIdx.x] : 0;
        const int t = p < pairs ? p / top_k : p - pairs;
        sm.xrow[threadIdx.x] = used ? x + (size_t)t * hidden : nullptr;
        sm.yrow[threadIdx.x] = used ? act + (size_t)p * stride : nullptr;
    }
    __syncthreads();
    const QMats<2> mats = {{expert_mat<BITS>(gate, sgate, e, experts, inter, hidden),
                            expert_mat<BITS>(up, sup, e, experts, inter, hidden)}};
    tc_product<BITS, 2>(mats, sm, n0, rows, hidden);
}

// y[p][c] = down_e[c] . act[p]. Launch with 256 threads and (max tiles, ceil(hidden / 64)) blocks.
template <int BITS>
__device__ __forceinline__ void moe_down_mma(QMat down, QMat sdown, const int* perm, const int* tiles,
                                             const int* ntiles, const float* act, float* y, int experts,
                                             int inter, int inter_s, int hidden) {
    __shared__ TcSmem<1> sm;
    if ((int)blockIdx.x >= ntiles[0]) return;
    const int* tile = tiles + 3 * blockIdx.x;
    const int e = tile[0];
    const int cols = e == experts ? inter_s : inter;
    const int stride = max(inter, inter_s);
    if (threadIdx.x < TC_BN) {
        const bool used = (int)threadIdx.x < tile[2];
        const int p = used ? perm[tile[1] + threadIdx.x] : 0;
        sm.xrow[threadIdx.x] = used ? act + (size_t)p * stride : nullptr;
        sm.yrow[threadIdx.x] = used ? y + (size_t)p * hidden : nullptr;
    }
    __syncthreads();
    tc_product<BITS, 1>({{expert_mat<BITS>(down, sdown, e, experts, hidden, inter)}}, sm, blockIdx.y * TC_BM,
                        hidden, cols);
}

#define MOE_MMA_KERNELS(BITS)                                                                                   \
    extern "C" __global__ void __launch_bounds__(TC_THREADS) q##BITS##_moe_gate_up_mma(                         \
        QMat gate, QMat up, QMat sgate, QMat sup, const int* perm, const int* tiles, const int* ntiles,         \
        const float* x, float* act, int top_k, int pairs, int experts, int inter, int inter_s, int hidden) {    \
        grid_dep();                                                                                             \
        moe_gate_up_mma<BITS>(gate, up, sgate, sup, perm, tiles, ntiles, x, act, top_k, pairs, experts, inter, \
                              inter_s, hidden);                                                                 \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(TC_THREADS)                                                    \
        q##BITS##_moe_down_mma(QMat down, QMat sdown, const int* perm, const int* tiles, const int* ntiles,     \
                               const float* act, float* y, int experts, int inter, int inter_s, int hidden) {   \
        grid_dep();                                                                                             \
        moe_down_mma<BITS>(down, sdown, perm, tiles, ntiles, act, y, experts, inter, inter_s, hidden);          \
    }
MOE_MMA_KERNELS(4)
MOE_MMA_KERNELS(8)
