// Gated full attention: partial rotary embedding, and causal grouped-query attention over the f32
// KV cache split along the keys (split-K: many blocks per query head at long contexts, merged by a
// second kernel with the usual max/sum rescaling).

// Decode steps replayed from a CUDA graph read the position from device memory (`pos_ptr`, written
// before each replay); eager launches pass it by value (`pos_ptr` null).
__device__ __forceinline__ int position(const int* pos_ptr, int pos0) { return pos_ptr ? *pos_ptr : pos0; }

// Rotate-half RoPE of one pair of a head, dims j and j + rotary/2 (a and b), at position pos.
// Angles in f64 (as the CPU reference computes its table), then cos/sin rounded to f32.
__device__ __forceinline__ void rope_pair(float& a, float& b, int pos, int j, int rotary, double theta) {
    const double inv = pow(theta, -2.0 * (double)j / (double)rotary);
    double sn, cs;
    sincos((double)pos * inv, &sn, &cs);
    const float c = (float)cs, s = (float)sn;
    const float a0 = a, b0 = b;
    a = a0 * c - b0 * s;
    b = b0 * c + a0 * s;
}

// Rotate-half RoPE on the first `rotary` dims of each head of x [T, H*D], in place; row t is at
// position pos0 + t. One thread per (t, h, j < rotary/2).
extern "C" __global__ void rope(float* x, int tokens, int heads, int d, int rotary, double theta,
                                const int* pos_ptr, int pos0) { grid_dep();
    const int half = rotary >> 1;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)tokens * heads * half) return;
    const int j = (int)(i % half);
    const long long th = i / half;
    const int t = (int)(th / heads);
    float* head = x + th * d;
    rope_pair(head[j], head[j + half], position(pos_ptr, pos0) + t, j, rotary, theta);
}

// Writes k and v [T, row] into the caches at rows pos0.. (row = KVH*D floats).
extern "C" __global__ void kv_write(const float* k, const float* v, float* kc, float* vc, long long n, int row,
                                    const int* pos_ptr, int pos0) { grid_dep();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long dst = (long long)position(pos_ptr, pos0) * row + i;
    kc[dst] = k[i];
    vc[dst] = v[i];
}

// The attention layer's inputs in one launch (Backend::attn_prep). Block (t, slot): a slot below
// `heads` is query head `slot` of qg [T, H*2D] (per head [query | gate]): its gate is copied to
// g [T, H*D] and its query normed by q_norm and rotated into q [T, H*D]. Slot heads + j is KV
// head j: k's row normed by k_norm and rotated into the K cache, and v's row copied into the V
// cache, at position pos0 + t. The norm sums as rms_norm does with 128 threads and the rotation
// is rope's, so the results equal those of the separate kernels bit for bit. Launch with 128
// threads, (T, heads + kv_heads) blocks and d * 4 bytes of dynamic shared memory.
extern "C" __global__ void attn_prep(const float* qg, const float* k, const float* v, const float* q_norm,
                                     const float* k_norm, float* q, float* g, float* kc, float* vc, int heads,
                                     int kv_heads, int d, int rotary, double theta, float eps, const int* pos_ptr,
                                     int pos0) {
    grid_dep();
    extern __shared__ float xs[];
    const int t = blockIdx.x, slot = blockIdx.y;
    const bool is_q = slot < heads;
    const int kvh = slot - heads;
    const int pos = position(pos_ptr, pos0) + t;
    const size_t kv_row = (size_t)pos * kv_heads * d + (size_t)kvh * d;
    const float* src = is_q ? qg + ((size_t)t * heads + slot) * 2 * d : k + ((size_t)t * kv_heads + kvh) * d;
    const float* w = is_q ? q_norm : k_norm;
    float* dst = is_q ? q + ((size_t)t * heads + slot) * d : kc + kv_row;
    float ss = 0.f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        const float x = src[c];
        ss = fmaf(x, x, ss);
    }
    const float inv = 1.f / sqrtf(block_sum(ss) / (float)d + eps);
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        xs[c] = src[c] * inv * w[c];
        if (is_q) g[((size_t)t * heads + slot) * d + c] = src[d + c];
        else vc[kv_row + c] = v[((size_t)t * kv_heads + kvh) * d + c];
    }
    __syncthreads();
    const int half = rotary >> 1;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float out = xs[c];
        if (c < rotary) {
            const int j = c < half ? c : c - half;
            float a = xs[j], b = xs[j + half];
            rope_pair(a, b, pos, j, rotary, theta);
            out = c < half ? a : b;
        }
        dst[c] = out;
    }
}

// Decode attention, split-K: one block per (token t, KV head, key split) computes, for each query
// head of the KV head's group, the partial results of its keys, (acc[d], max, sum) with acc =
// sum_k exp(s_k - max) v_k, to part [T*H, splits, D+2]; attention_combine merges the splits.
//
// On the tensor cores: the query group is the N = 8 side of m16n8k8 tf32 products (NG tiles of
// 8 query heads, the last padded with zero queries), so that the block's warps read each K and V
// value from shared memory once, not once per query head. Every operand is split in tf32 hi + lo
// (mma_tf32x3), near f32 accuracy. The warps divide the head dims; each keeps its part of Q^T's
// fragments in registers, split once. Per tile of 16 keys (the next one in flight, copied by
// cp.async; a third stage, 105 KiB a block at d = 256, was 2% slower at 32,768 keys, session 15):
//   S^T [16 keys][heads]: each warp's product over its dims (A = K rows, B = Q^T) goes to shared
//     memory, and every warp sums the adec_warps(d) parts in the same order (so each holds the same
//     scores, maxima and sums, and no warp's results need merging at the end);
//   online softmax per head: lane (g, c) holds head g's scores of keys c, c + 4, c + 8, c + 12,
//     which are the B fragments of P^T for the next product;
//   O^T [its dims][heads] += V^T P^T (A = V rows, transposed as read).
// Keys past the end score -inf; their V rows are zeroed (a zero probability times an uncopied
// row could be NaN). The keys are split from the length read at run time (`position`), so that a
// recorded step, whose grid is sized for its context's power-of-two bucket, still gives every
// block keys. Launch with 32 * adec_warps(d) threads, (T * KVH, splits) blocks and
// attn_decode_smem_bytes(d, ng) of dynamic shared memory.
constexpr int ATTN_TILE = 16;
// Warps a block: eight, each with 16 dims at least.
__host__ __device__ constexpr int adec_warps(int d) { return d / 16 < 8 ? d / 16 : 8; }
// Score parts [warps][16][8 ng], then two stages: K [16][d + 4], V [16][d + 8] (pitches 4 and 8
// mod 32 keep the fragment reads on 32 different banks).
__host__ __device__ constexpr int attn_decode_smem_bytes(int d, int ng) {
    return 4 * (adec_warps(d) * ATTN_TILE * 8 * ng + 2 * ATTN_TILE * (2 * d + 12));
}

template <int ND, int NG>
__device__ __forceinline__ void attention_partial_impl(const float* __restrict__ q, const float* __restrict__ k,
                                                       const float* __restrict__ v, float* __restrict__ part,
                                                       int heads, int kv_heads, const int* pos_ptr, int pos0) {
    constexpr int D = 32 * ND, H = 8 * NG, TILE = ATTN_TILE;
    constexpr int WARPS = adec_warps(D), DW = D / WARPS, KSTEPS = DW / 8, MTILES = DW / 16;
    constexpr int KP = D + 4, VP = D + 8, STAGES = 2;
    constexpr int STAGE = TILE * (KP + VP);
    extern __shared__ float4 attn_smem[];
    require_dynamic_smem(attn_decode_smem_bytes(D, NG));
    float* sp = reinterpret_cast<float*>(attn_smem);  // [WARPS][TILE][H]
    float* stages = sp + WARPS * TILE * H;            // [STAGES][K [TILE][KP], V [TILE][VP]]
    const int group = heads / kv_heads;
    const int t = blockIdx.x / kv_heads, kvh = blockIdx.x % kv_heads, split = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int splits = gridDim.y, pos = position(pos_ptr, pos0), len = pos + t + 1;
    // Whole tiles a split, from the last token's keys.
    const int keys = pos + (int)gridDim.x / kv_heads;
    const int chunk = ((keys + splits - 1) / splits + TILE - 1) / TILE * TILE;
    const int start = split * chunk, end = min(start + chunk, len);
    const size_t row = (size_t)kv_heads * D;
    const int tiles_n = end > start ? (end - start + TILE - 1) / TILE : 0;
    // Tile j's K and V rows into stage j % STAGES, 16 bytes a copy; one commit group per tile.
    auto fetch = [&](int j) {
        if (j < tiles_n) {
            float* kt = stages + (j % STAGES) * STAGE;
            float* vt = kt + TILE * KP;
            const int p0 = start + j * TILE, n = min(TILE, end - p0);
            for (int i = threadIdx.x; i < TILE * (D / 4); i += blockDim.x) {
                const int key = i / (D / 4), col = 4 * (i % (D / 4));
                if (key < n) {
                    const size_t src = (size_t)(p0 + key) * row + (size_t)kvh * D + col;
                    cp_async16(kt + key * KP + col, k + src);
                    cp_async16(vt + key * VP + col, v + src);
                } else {
                    *reinterpret_cast<float4*>(vt + key * VP + col) = make_float4(0.f, 0.f, 0.f, 0.f);
                }
            }
        }
        cp_async_commit();
    };
    fetch(0);
    const int d0 = warp * DW;  // this warp's first dim
    // Q^T's fragments for this warp's dims (the score product's B: head 8n + g, dims
    // d0 + 8 ks + c and + 4), scaled and split once for every tile.
    u32 qh[NG][KSTEPS][2], ql[NG][KSTEPS][2];
    {
        const float scale = rsqrtf((float)D);
#pragma unroll
        for (int n = 0; n < NG; ++n) {
            const int h = 8 * n + g;
            const float* qrow = q + ((size_t)t * heads + kvh * group + min(h, group - 1)) * D + d0 + c;
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks) {
                tf32_split(h < group ? qrow[8 * ks] * scale : 0.f, qh[n][ks][0], ql[n][ks][0]);
                tf32_split(h < group ? qrow[8 * ks + 4] * scale : 0.f, qh[n][ks][1], ql[n][ks][1]);
            }
        }
    }
    float o[NG][MTILES][4];
    float m[NG], l[NG];  // head n * 8 + g's running max and sum
#pragma unroll
    for (int n = 0; n < NG; ++n) {
        m[n] = NEG_INF;
        l[n] = 0.f;
#pragma unroll
        for (int mt = 0; mt < MTILES; ++mt)
#pragma unroll
            for (int i = 0; i < 4; ++i) o[n][mt][i] = 0.f;
    }
    for (int j = 0; j < tiles_n; ++j) {
        cp_async_wait_all();
        __syncthreads();  // tile j is in; every warp is done with tile j - 1 (its stage, the parts)
        fetch(j + 1);
        const float* kt = stages + (j % STAGES) * STAGE;
        const float* vt = kt + TILE * KP;
        // This warp's part of S^T = K Q^T.
        float s[NG][4];
#pragma unroll
        for (int n = 0; n < NG; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[n][i] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            u32 ah[4], al[4];
            tf32_split_a(ah, al, kt + d0 + 8 * ks, KP);
#pragma unroll
            for (int n = 0; n < NG; ++n) mma_tf32x3(s[n], ah, al, qh[n][ks], ql[n][ks]);
        }
        float* mine = sp + warp * TILE * H;
#pragma unroll
        for (int n = 0; n < NG; ++n) {
            *reinterpret_cast<float2*>(mine + g * H + 8 * n + 2 * c) = make_float2(s[n][0], s[n][1]);
            *reinterpret_cast<float2*>(mine + (g + 8) * H + 8 * n + 2 * c) = make_float2(s[n][2], s[n][3]);
        }
        __syncthreads();
        const int p0 = start + j * TILE;
#pragma unroll
        for (int n = 0; n < NG; ++n) {
            // Head 8n + g's scores of keys c + 4i, the parts added in warp order.
            float sc[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int key = c + 4 * i;
                float a = 0.f;
#pragma unroll
                for (int w = 0; w < WARPS; ++w) a += sp[(w * TILE + key) * H + 8 * n + g];
                sc[i] = p0 + key < end ? a : NEG_INF;
            }
            float tile_max = fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3]));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
            const float m_new = fmaxf(m[n], tile_max);  // finite: every tile has a key before `end`
            const float corr = expf(m[n] - m_new);      // 0 on the first tile (m = -inf)
            float p[4], tile_sum = 0.f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                p[i] = sc[i] == NEG_INF ? 0.f : expf(sc[i] - m_new);
                tile_sum += p[i];
            }
            tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 1);
            tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 2);
            l[n] = l[n] * corr + tile_sum;
            m[n] = m_new;
            // The accumulator columns are heads 2c and 2c + 1, whose factors lanes 8c and 8c + 4 hold.
            const float corr0 = __shfl_sync(0xffffffffu, corr, 8 * c);
            const float corr1 = __shfl_sync(0xffffffffu, corr, 8 * c + 4);
            // P^T's fragments: keys c, c + 4 (k-step 0) and c + 8, c + 12 (k-step 1) of head g.
            u32 ph[4], pl[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) tf32_split(p[i], ph[i], pl[i]);
#pragma unroll
            for (int mt = 0; mt < MTILES; ++mt) {
                float* acc = o[n][mt];
                acc[0] *= corr0;
                acc[1] *= corr1;
                acc[2] *= corr0;
                acc[3] *= corr1;
#pragma unroll
                for (int kstep = 0; kstep < 2; ++kstep) {
                    u32 ah[4], al[4];
                    tf32_split_a_km(ah, al, vt + 8 * kstep * VP + d0 + 16 * mt, VP);
                    mma_tf32x3(acc, ah, al, ph + 2 * kstep, pl + 2 * kstep);
                }
            }
        }
    }
    // O^T's fragments: dims d0 + 16 mt + g (+ 8), heads 8n + 2c (+ 1).
    const size_t r0 = (size_t)t * heads + (size_t)kvh * group;
#pragma unroll
    for (int n = 0; n < NG; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int h = 8 * n + 2 * c + (i & 1);
            if (h >= group) continue;
            float* out = part + ((r0 + h) * splits + split) * (D + 2);
#pragma unroll
            for (int mt = 0; mt < MTILES; ++mt) out[d0 + 16 * mt + g + 8 * (i >> 1)] = o[n][mt][i];
        }
        const int h = 8 * n + g;
        if (warp == 0 && c == 0 && h < group) {
            float* out = part + ((r0 + h) * splits + split) * (D + 2);
            out[D] = m[n];
            out[D + 1] = l[n];
        }
    }
}

#define ATTENTION_PARTIAL(ND, NG)                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * adec_warps(32 * ND))                                         \
        attention_partial_d##ND##_g##NG(const float* q, const float* k, const float* v, float* part, int heads, \
                                        int kv_heads, const int* pos_ptr, int pos0) {                           \
        grid_dep();                                                                                            \
        attention_partial_impl<ND, NG>(q, k, v, part, heads, kv_heads, pos_ptr, pos0);                        \
    }
// Head dims 64, 128, 256 and 512; query groups of up to 8 and up to 16 heads.
ATTENTION_PARTIAL(2, 1)
ATTENTION_PARTIAL(4, 1)
ATTENTION_PARTIAL(8, 1)
ATTENTION_PARTIAL(16, 1)
ATTENTION_PARTIAL(2, 2)
ATTENTION_PARTIAL(4, 2)
ATTENTION_PARTIAL(8, 2)
ATTENTION_PARTIAL(16, 2)

// o[r][c] = sum_s exp(m_s - M) acc_s[c] / sum_s exp(m_s - M) l_s over the splits of row r
// (splits past the row's keys hold max = -inf and weigh nothing). One block of 256 threads per
// (row, 32 columns): the split weights are computed into shared memory, then warp w sums its
// lane's column over splits w, w + 8, ... and warp 0 adds the eight partial sums. With a gate
// (the attention layer's output gate, [rows][d]) o is then multiplied by sigmoid(gate), as
// sigmoid_mul would.
constexpr int MAX_SPLITS = 256;
extern "C" __global__ void attention_combine(const float* part, const float* gate, float* o, int d, int splits) {
    grid_dep();
    __shared__ float wgt[MAX_SPLITS];
    __shared__ float red[32];
    __shared__ float colsum[8][32];
    const int r = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const float* pr = part + (size_t)r * splits * (d + 2);
    float mm = NEG_INF;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) mm = fmaxf(mm, pr[(size_t)s * (d + 2) + d]);
    for (int o2 = 16; o2 > 0; o2 >>= 1) mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, o2));
    if (lane == 0) red[warp] = mm;
    __syncthreads();
    mm = red[0];
    for (int w = 1; w < nw; ++w) mm = fmaxf(mm, red[w]);
    __syncthreads();
    float ls = 0.f;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) {
        const float ms = pr[(size_t)s * (d + 2) + d];
        const float w = ms == NEG_INF ? 0.f : expf(ms - mm);
        wgt[s] = w;
        ls += pr[(size_t)s * (d + 2) + d + 1] * w;
    }
    ls = warp_sum(ls);
    if (lane == 0) red[warp] = ls;
    __syncthreads();
    ls = 0.f;
    for (int w = 0; w < nw; ++w) ls += red[w];
    const int c = blockIdx.y * 32 + lane;
    float a = 0.f;
    if (c < d)
        for (int s = warp; s < splits; s += nw) a = fmaf(pr[(size_t)s * (d + 2) + c], wgt[s], a);
    colsum[warp][lane] = a;
    __syncthreads();
    if (warp == 0 && c < d) {
        float total = 0.f;
        for (int w = 0; w < nw; ++w) total += colsum[w][lane];
        const float out = total / ls;
        o[(size_t)r * d + c] = gate ? out * sigmoid(gate[(size_t)r * d + c]) : out;
    }
}

// ---- prefill: causal flash attention on the tensor cores.
//
// One block per (128 queries, query head): 8 warps, each owning 16 query rows. The block walks the
// keys in tiles of 32 up to its last query's position, computing the scores S = Q K^T and then
// O += P V with an online softmax (running max and sum per row, O rescaled when the max grows).
// Exactness: every operand is split in two bf16 parts (hi + lo) and each product is taken as
// hi*hi + hi*lo + lo*hi with f32 accumulators (the lo*lo term is below 2^-16 of the result), so
// the output stays within ~1e-10 (NMSE) of the f32 reference. kv_split writes the cache's split
// once per layer and chunk, so the tiles arrive by cp.async: K tile j + 1 is requested as soon as
// S of tile j is done, V tile j + 1 as soon as its P V is, each overlapping the other's work.
// Shared memory (u16): Q hi/lo [128][D + 8], K hi/lo and V hi/lo [32][D + 8] (the pitch makes
// each warp's fragment loads hit 32 different banks): 198 KiB at D = 256, one block per SM.
constexpr int FA_BQ = 128;
constexpr int FA_BK = 32;
constexpr int FA_THREADS = 256;

__host__ __device__ constexpr int fa_smem_bytes(int d) { return 2 * (2 * FA_BQ * (d + 8) + 4 * FA_BK * (d + 8)); }

// x [n] f32 -> hi, lo [n] bf16 (n a multiple of 4). One thread per 4 values.
extern "C" __global__ void kv_split(const float* x, u16* hi, u16* lo, long long n4) {
    grid_dep();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const float4 v = reinterpret_cast<const float4*>(x)[i];
    u32 h[4], l[4];
    bf16_split(v.x, h[0], l[0]);
    bf16_split(v.y, h[1], l[1]);
    bf16_split(v.z, h[2], l[2]);
    bf16_split(v.w, h[3], l[3]);
    reinterpret_cast<uint2*>(hi)[i] = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
    reinterpret_cast<uint2*>(lo)[i] = make_uint2(l[0] | (l[1] << 16), l[2] | (l[3] << 16));
}

// Rows [row0, row0 + rows) of a split [*, ld] matrix, D columns from col0, into tiles
// [rows][D + 8] by cp.async; rows at or past `valid` are zero.
template <int D>
__device__ __forceinline__ void fa_fetch(u16* hi, u16* lo, const u16* src_hi, const u16* src_lo, size_t ld, int col0,
                                         int row0, int rows, int valid) {
    constexpr int D8 = D / 8;
    for (int i = threadIdx.x; i < rows * D8; i += FA_THREADS) {
        const int r = i / D8, c = (i % D8) * 8;
        u16* dh = hi + r * (D + 8) + c;
        u16* dl = lo + r * (D + 8) + c;
        if (row0 + r < valid) {
            const size_t at = (size_t)(row0 + r) * ld + col0 + c;
            cp_async16(dh, src_hi + at);
            cp_async16(dl, src_lo + at);
        } else {
            *reinterpret_cast<uint4*>(dh) = make_uint4(0u, 0u, 0u, 0u);
            *reinterpret_cast<uint4*>(dl) = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    cp_async_commit();
}

// q [T, H*D] at positions pos0.., the split caches [keys, KVH*D] holding positions
// 0 .. pos0 + T - 1, o [T, H*D]. Launch with 256 threads, (ceil(T / 128), H) blocks and
// fa_smem_bytes(D) bytes of dynamic shared memory.
template <int D>
__device__ __forceinline__ void attention_prefill_impl(const float* __restrict__ q, const u16* khi, const u16* klo,
                                                       const u16* vhi, const u16* vlo, float* __restrict__ o,
                                                       int tokens, int heads, int kv_heads, int pos0) {
    constexpr int NO = D / 8;  // output n-tiles per warp
    constexpr int LD = D + 8;
    extern __shared__ __align__(16) u16 fa_smem[];
    require_dynamic_smem(fa_smem_bytes(D));
    u16* qh = fa_smem;
    u16* ql = qh + FA_BQ * LD;
    u16* kh = ql + FA_BQ * LD;
    u16* kl = kh + FA_BK * LD;
    u16* vh = kl + FA_BK * LD;
    u16* vl = vh + FA_BK * LD;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, cq = lane & 3;
    const int t0 = blockIdx.x * FA_BQ, h = blockIdx.y, kvh = h / (heads / kv_heads);
    const size_t qld = (size_t)heads * D, kld = (size_t)kv_heads * D;
    const int keys = pos0 + tokens;
    const int last = min(pos0 + t0 + FA_BQ, keys);  // keys [0, last) can be seen by the block
    fa_fetch<D>(kh, kl, khi, klo, kld, kvh * D, 0, FA_BK, keys);
    fa_fetch<D>(vh, vl, vhi, vlo, kld, kvh * D, 0, FA_BK, keys);
    // Q, scaled by 1/sqrt(D), split while the first tiles arrive.
    {
        const float scale = rsqrtf((float)D);
        constexpr int D4 = D / 4;
        for (int i = tid; i < FA_BQ * D4; i += FA_THREADS) {
            const int r = i / D4, c = (i % D4) * 4;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (t0 + r < tokens) v = *reinterpret_cast<const float4*>(q + (size_t)(t0 + r) * qld + h * D + c);
            u32 hb[4], lb[4];
            bf16_split(v.x * scale, hb[0], lb[0]);
            bf16_split(v.y * scale, hb[1], lb[1]);
            bf16_split(v.z * scale, hb[2], lb[2]);
            bf16_split(v.w * scale, hb[3], lb[3]);
            *reinterpret_cast<uint2*>(qh + r * LD + c) = make_uint2(hb[0] | (hb[1] << 16), hb[2] | (hb[3] << 16));
            *reinterpret_cast<uint2*>(ql + r * LD + c) = make_uint2(lb[0] | (lb[1] << 16), lb[2] | (lb[3] << 16));
        }
    }
    // This thread's two query rows (fragment rows gq and gq + 8 of the warp's 16).
    const int qpos0 = pos0 + t0 + warp * 16 + gq, qpos1 = qpos0 + 8;
    // Warps whose rows all precede a tile's first key skip its products.
    const int warp_last = pos0 + t0 + warp * 16 + 15;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    float acc[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    for (int k0 = 0; k0 < last; k0 += FA_BK) {
        const bool more = k0 + FA_BK < last;
        cp_async_wait_one();  // K of this tile (V may still be on its way)
        __syncthreads();
        const bool active = k0 <= warp_last;
        float s[4][4], sx[4][4];
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = sx[n][e] = 0.f;
        if (active) {
            // S = Q K^T for the warp's 16 rows x 32 keys; the cross terms accumulate apart from
            // hi*hi, so that consecutive products do not wait on each other.
#pragma unroll 4
            for (int ks = 0; ks < D / 16; ++ks) {
                u32 ah[4], al[4];
                ldsm_a(ah, qh + warp * 16 * LD + ks * 16, LD);
                ldsm_a(al, ql + warp * 16 * LD + ks * 16, LD);
#pragma unroll
                for (int n2 = 0; n2 < 2; ++n2) {
                    u32 bh[4], bl[4];  // keys n2 * 16 + 0-7 in [0..1], + 8-15 in [2..3]
                    ldsm_b2(bh, kh + n2 * 16 * LD + ks * 16, LD);
                    ldsm_b2(bl, kl + n2 * 16 * LD + ks * 16, LD);
#pragma unroll
                    for (int h2 = 0; h2 < 2; ++h2) {
                        const int n = 2 * n2 + h2;
                        mma_bf16(s[n], ah, bh + 2 * h2);
                        mma_bf16(sx[n], ah, bl + 2 * h2);
                        mma_bf16(sx[n], al, bh + 2 * h2);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with this K tile
        if (more) fa_fetch<D>(kh, kl, khi, klo, kld, kvh * D, k0 + FA_BK, FA_BK, keys);
        float p[4][4];
        float corr[2] = {1.f, 1.f};
        if (active) {
            // Causal mask, then the online softmax per row (the row's 32 scores are spread over
            // the four lanes of a quad).
            float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + n * 8 + 2 * cq + (e & 1);
                    p[n][e] = s[n][e] + sx[n][e];
                    if (key > ((e >> 1) ? qpos1 : qpos0) || key >= keys) p[n][e] = NEG_INF;
                    mx[e >> 1] = fmaxf(mx[e >> 1], p[n][e]);
                }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
                mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
                const float mn = fmaxf(m[i], mx[i]);
                corr[i] = mn == NEG_INF ? 1.f : expf(m[i] - mn);
                m[i] = mn;
                l[i] *= corr[i];
            }
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float pe = p[n][e] == NEG_INF ? 0.f : expf(p[n][e] - m[e >> 1]);
                    p[n][e] = pe;
                    l[e >> 1] += pe;
                }
#pragma unroll
            for (int n = 0; n < NO; ++n) {
                acc[n][0] *= corr[0];
                acc[n][1] *= corr[0];
                acc[n][2] *= corr[1];
                acc[n][3] *= corr[1];
            }
        }
        if (more) cp_async_wait_one();  // V of this tile (the next K may still be on its way)
        else cp_async_wait_all();
        __syncthreads();
        if (active) {
            // O += P V: P's accumulator layout is the A-fragment layout of the next product; V's
            // fragments come transposed from its key-major tile.
#pragma unroll
            for (int kk = 0; kk < 2; ++kk) {
                u32 ph[4], pl[4];
                const float* pa = p[2 * kk];
                const float* pb = p[2 * kk + 1];
                const float pv[4][2] = {{pa[0], pa[1]}, {pa[2], pa[3]}, {pb[0], pb[1]}, {pb[2], pb[3]}};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    u32 h0, l0, h1, l1;
                    bf16_split(pv[i][0], h0, l0);
                    bf16_split(pv[i][1], h1, l1);
                    ph[i] = h0 | (h1 << 16);
                    pl[i] = l0 | (l1 << 16);
                }
#pragma unroll
                for (int n2 = 0; n2 < NO / 2; ++n2) {
                    u32 bh[4], bl[4];  // dims n2 * 16 + 0-7 in [0..1], + 8-15 in [2..3]
                    ldsm_bt2(bh, vh + kk * 16 * LD + n2 * 16, LD);
                    ldsm_bt2(bl, vl + kk * 16 * LD + n2 * 16, LD);
#pragma unroll
                    for (int h2 = 0; h2 < 2; ++h2) {
                        float* out = acc[2 * n2 + h2];
                        mma_bf16(out, ph, bh + 2 * h2);
                        mma_bf16(out, ph, bl + 2 * h2);
                        mma_bf16(out, pl, bh + 2 * h2);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with this V tile
        if (more) fa_fetch<D>(vh, vl, vhi, vlo, kld, kvh * D, k0 + FA_BK, FA_BK, keys);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
    const int r0 = t0 + warp * 16 + gq;
#pragma unroll
    for (int n = 0; n < NO; ++n) {
        const int col = h * D + n * 8 + 2 * cq;
        if (r0 < tokens) {
            o[(size_t)r0 * qld + col] = acc[n][0] / l[0];
            o[(size_t)r0 * qld + col + 1] = acc[n][1] / l[0];
        }
        if (r0 + 8 < tokens) {
            o[(size_t)(r0 + 8) * qld + col] = acc[n][2] / l[1];
            o[(size_t)(r0 + 8) * qld + col + 1] = acc[n][3] / l[1];
        }
    }
}

#define ATTENTION_PREFILL(D)                                                                                   \
    extern "C" __global__ void __launch_bounds__(FA_THREADS)                                                  \
        attention_prefill_d##D(const float* q, const u16* khi, const u16* klo, const u16* vhi, const u16* vlo, \
                               float* o, int tokens, int heads, int kv_heads, int pos0) {                      \
        grid_dep();                                                                                            \
        attention_prefill_impl<D>(q, khi, klo, vhi, vlo, o, tokens, heads, kv_heads, pos0);                    \
    }
// Head dims 64, 128 and 256 (512 takes the split-K kernels: its tiles would not fit).
ATTENTION_PREFILL(64)
ATTENTION_PREFILL(128)
ATTENTION_PREFILL(256)
