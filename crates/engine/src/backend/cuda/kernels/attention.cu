// Gated full attention: partial rotary embedding, and causal grouped-query attention over the KV
// cache (f16 values: f16_bits, as the CPU reference's kv_value rounds them) split along the keys
// (split-K: many blocks per query head at long contexts, merged by a second kernel with the usual
// max/sum rescaling).
//
// Every softmax here works in log2 units: the queries are scaled by log2(e) / sqrt(D) before they
// are split, so that exp(s - m) is 2^(s' - m') and takes one special-function instruction
// (exp2_ftz); the maxima the split kernels hand to the merge are in the same units.

// Decode steps replayed from a CUDA graph read the position from device memory (`pos_ptr`, written
// before each replay); eager launches pass it by value (`pos_ptr` null).
__device__ __forceinline__ int position(const int* pos_ptr, int pos0) { return pos_ptr ? *pos_ptr : pos0; }

// 2^x by the special-function unit alone, results under 2^-126 flushed to 0 (a probability that
// small adds nothing next to its row's largest, which is 1); 2^-inf = 0. expf took the scaling
// by log2(e) and exp2f a rescaling for subnormal results around the same instruction: prefill
// attention's softmax, which runs on the CUDA cores beside the tensor products, was a measured
// part of its time (docs/performance.md, session 22).
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Rotate-half RoPE of one pair of a head, dims j and j + rotary/2 (a and b), at position pos.
// Angles in f64 (as the CPU reference computes its table), then cos/sin rounded to f32.
__device__ __forceinline__ void rope_angle(int pos, int j, int rotary, double theta, float& c, float& s) {
    const double inv = pow(theta, -2.0 * (double)j / (double)rotary);
    double sn, cs;
    sincos((double)pos * inv, &sn, &cs);
    c = (float)cs;
    s = (float)sn;
}

__device__ __forceinline__ void rope_rotate(float& a, float& b, float c, float s) {
    const float a0 = a, b0 = b;
    a = a0 * c - b0 * s;
    b = b0 * c + a0 * s;
}

__device__ __forceinline__ void rope_pair(float& a, float& b, int pos, int j, int rotary, double theta) {
    float c, s;
    rope_angle(pos, j, rotary, theta, c, s);
    rope_rotate(a, b, c, s);
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

// Writes k and v [T, row] into the caches at rows pos0.. (row = KVH*D values).
extern "C" __global__ void kv_write(const float* k, const float* v, u16* kc, u16* vc, long long n, int row,
                                    const int* pos_ptr, int pos0) { grid_dep();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long dst = (long long)position(pos_ptr, pos0) * row + i;
    kc[dst] = f16_bits(k[i]);
    vc[dst] = f16_bits(v[i]);
}

// The attention layer's inputs in one launch (Backend::attn_prep). Block (t, slot): a slot below
// `heads` is query head `slot` of qg [T, H*2D] (per head [query | gate]): its gate is copied to
// g [T, H*D] and its query normed by q_norm and rotated into q [T, H*D]. Slot heads + j is KV
// head j: k's row normed by k_norm and rotated into the K cache, and v's row copied into the V
// cache, at position pos0 + t. The norm sums as rms_norm does with 128 threads and the rotation
// is rope's, so the results equal those of the separate kernels bit for bit. Launch with 128
// threads, (T, heads + kv_heads) blocks and d * 4 bytes of dynamic shared memory.
extern "C" __global__ void attn_prep(const float* qg, const float* k, const float* v, const float* q_norm,
                                     const float* k_norm, float* q, float* g, u16* kc, u16* vc, int heads,
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
    float* qdst = is_q ? q + ((size_t)t * heads + slot) * d : nullptr;
    float ss = 0.f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        const float x = src[c];
        ss = fmaf(x, x, ss);
    }
    const float inv = 1.f / sqrtf(block_sum(ss) / (float)d + eps);
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        xs[c] = src[c] * inv * w[c];
        if (is_q) g[((size_t)t * heads + slot) * d + c] = src[d + c];
        else vc[kv_row + c] = f16_bits(v[((size_t)t * kv_heads + kvh) * d + c]);
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
        if (is_q) qdst[c] = out;
        else kc[kv_row + c] = f16_bits(out);
    }
}

// Decode attention, split-K: one block per (token t, KV head, key split) computes, for each query
// head of the KV head's group, the partial results of its keys, (acc[d], max, sum) with acc =
// sum_k exp(s_k - max) v_k, to part [T*H, splits, D+2]; attention_combine merges the splits.
//
// On the tensor cores: the query group is the N = 8 side of m16n8k16 f16 products (NG tiles of
// 8 query heads, the last padded with zero queries), so that the block's warps read each K and V
// value from shared memory once, not once per query head. K and V are the cache's f16 values, exact
// as they are; Q and the probabilities are split in f16 hi + lo (f16_split2), two products each,
// near f32 accuracy. The warps divide the head dims; each keeps its part of Q^T's fragments in
// registers, split once. Per tile of 32 keys (the next two in flight, copied by cp.async):
//   S^T [32 keys][heads]: each warp's product over its dims (A = K rows, B = Q^T) goes to shared
//     memory; each score is summed over the adec_warps(d) parts once, in warp order, into a
//     table every warp reads (so each holds the same scores, maxima and sums, and no warp's
//     results need merging at the end; each warp summing the parts for itself read eight times
//     as much shared memory);
//   online softmax per head: lane (g, c) holds head g's scores of keys 16 kk + 2c, + 1, + 8 and
//     + 9 for kk = 0, 1, which are the B fragments of P^T for the next product;
//   O^T [its dims][heads] += V^T P^T (A = V rows, transposed by ldmatrix).
// Keys past the end score -inf; their V rows are zeroed (a zero probability times an uncopied
// row could be NaN). The keys are split from the length read at run time (`position`), so that a
// recorded step, whose grid is sized for its context's power-of-two bucket, still gives every
// block keys. Launch with 32 * adec_warps(d) threads, (T * KVH, splits) blocks and
// attn_decode_smem_bytes(d, ng) of dynamic shared memory.
// With f16 tiles of 16 keys and two stages the kernel read 67 MB (32,768 keys) at 2.2 TB/s: too
// few bytes in flight a block for the chain each tile waits on (session 21).
constexpr int ATTN_TILE = 32;
constexpr int ATTN_STAGES = 3;
// Warps a block: eight, each with 16 dims at least.
__host__ __device__ constexpr int adec_warps(int d) { return d / 16 < 8 ? d / 16 : 8; }
// Score parts [warps][TILE][8 ng] f32, the scores [TILE][8 ng + 4] f32 (the pitch puts a warp's
// reads on 32 banks), then the stages of K and V [TILE][d + 8] f16 (the pitch, 16 bytes past a
// multiple of 128, puts each ldmatrix's eight rows on different banks).
__host__ __device__ constexpr int attn_decode_smem_bytes(int d, int ng) {
    return 4 * (adec_warps(d) * ATTN_TILE * 8 * ng + ATTN_TILE * (8 * ng + 4)) +
           2 * ATTN_STAGES * 2 * ATTN_TILE * (d + 8);
}

// One token's attn_prep taken by the decode attention (attention_partial): every block norms and
// rotates its KV head's query heads from the in-projections' q|gate rows itself, and the block
// whose keys hold the new position norms and rotates the new key and writes it and the value
// into the caches before it copies them, so the attention layer needs no launch of its own for
// them. The results equal attn_prep's bit for bit (its sums in its order: norm_rotate_row). Head
// dims up to 256, rotary dims a multiple of 64 (the pairs of a row's rotation in one lane).
// q_norm == nullptr: the queries are read as they are (q), and attn_prep wrote the caches.
// Passed by value.
struct AttnPrep {
    const float* qg;      // [heads][2 D]: each head's query, then its gate
    const float* k;       // [kv_heads][D]: the new key and value rows
    const float* v;
    const float* q_norm;  // [D]
    const float* k_norm;  // [D]
    double theta;
    int rotary;
    float eps;
};

// A head's row of D = 32 ND values, lane l holding dims l + 32 i (x[i]), normed by gains w and
// rotated as attn_prep does them: its sum of squares in attn_prep's order (128 threads, thread t
// summing dims t, t + 128, ..., then the four warps' sums in order), x * inv * w, then the
// rotation of dims j and j + rotary/2 for j < rotary/2 (lane-local: rotary a multiple of 64),
// with the angles cs/sn of dims l + 32 i.
template <int ND>
__device__ __forceinline__ void norm_rotate_row(float (&x)[ND], const float (&w)[ND], float eps, int rotary,
                                                const float (&cs)[ND], const float (&sn)[ND]) {
    constexpr int D = 32 * ND;
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float part = 0.f;
#pragma unroll
        for (int i = k; i < ND; i += 4) part = fmaf(x[i], x[i], part);
        total += warp_sum(part);
    }
    const float inv = 1.f / sqrtf(total / (float)D + eps);
#pragma unroll
    for (int i = 0; i < ND; ++i) x[i] = x[i] * inv * w[i];
#pragma unroll
    for (int p = 1; p <= ND / 2; ++p)  // p = rotary / 64: the pair's partner p values on
        if (rotary == 64 * p)
#pragma unroll
            for (int i = 0; i < p; ++i) rope_rotate(x[i], x[i + p], cs[i], sn[i]);
}

// A lane's rotation angles for norm_rotate_row at position pos: dims lane + 32 i of the first
// rotary / 2 (cs and sn past them are left as they are).
template <int ND>
__device__ __forceinline__ void lane_rope_angles(int pos, int rotary, double theta, float (&cs)[ND], float (&sn)[ND]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < ND; ++i)
        if (64 * i < rotary) rope_angle(pos, lane + 32 * i, rotary, theta, cs[i], sn[i]);
}

// A new key row x (normed and rotated, lane l holding dims l + 32 i) and its value row (the
// lane's dim l + 32 i from value(i)) into the f16 caches at `at`.
template <int ND, class Value>
__device__ __forceinline__ void store_kv_row(u16* kc, u16* vc, size_t at, const float (&x)[ND], Value value) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < ND; ++i) {
        kc[at + lane + 32 * i] = (u16)f16_bits(x[i]);
        vc[at + lane + 32 * i] = (u16)f16_bits(value(i));
    }
}

// The rotation angles of the T tokens at positions position(pos_ptr, pos0) + t for
// attn_prep_rows: angles[t][j] = (cos, sin) for dim pairs j < rotary / 2, by rope_angle (the same
// floats as lane_rope_angles gives). A token's 18 rows (the 35B's heads) share them instead of
// each warp working them out in double precision on its row's critical path. With the position
// given (pos_ptr null) the angles are worked out before the wait for the kernel before, which
// they need nothing of; the wait stays, so that this kernel's end implies that one's. Launch
// with 256 threads and ceil(T rotary / 2 / 256) blocks.
extern "C" __global__ void rope_angles(float2* angles, int tokens, int rotary, double theta, const int* pos_ptr,
                                       int pos0) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x, half = rotary / 2;
    if (pos_ptr) grid_dep();  // the position may come from a kernel before
    float c = 0.f, s = 0.f;
    if (i < tokens * half) rope_angle(position(pos_ptr, pos0) + i / half, i % half, rotary, theta, c, s);
    if (!pos_ptr) grid_dep();
    if (i < tokens * half) angles[i] = make_float2(c, s);
}

// attn_prep with a warp a row, for head dims D = 32 ND up to 256 and rotary dims a multiple of
// 64: warp w of block (t, y) takes attn_prep's block (t, 8 y + w), normed and rotated by
// norm_rotate_row, whose sums and rotation are attn_prep's, so the values are the same bit for
// bit; the rotation's angles from rope_angles (theta unused). attn_prep's blocks of 128 threads
// did 1 KiB each with two barriers: a 4,096-token chunk's took 196 us a layer, 1.5 TB/s
// (docs/performance.md, run46). attn_prep's arguments (d is D) and the angles; launch with 256
// threads and (T, ceil((heads + kv_heads) / 8)) blocks.
template <int ND>
__device__ __forceinline__ void attn_prep_rows(const float* qg, const float* k, const float* v, const float* q_norm,
                                               const float* k_norm, float* q, float* g, u16* kc, u16* vc, int heads,
                                               int kv_heads, int rotary, float eps, const int* pos_ptr, int pos0,
                                               const float2* angles) {
    constexpr int D = 32 * ND;
    grid_dep();
    const int lane = threadIdx.x & 31, t = blockIdx.x;
    const int slot = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (slot >= heads + kv_heads) return;
    const bool is_q = slot < heads;
    const int kvh = slot - heads, pos = position(pos_ptr, pos0) + t;
    const float* src = is_q ? qg + ((size_t)t * heads + slot) * 2 * D : k + ((size_t)t * kv_heads + kvh) * D;
    const float* w = is_q ? q_norm : k_norm;
    // The row's second half (a query's gate, a key's value) loaded with it: it only passes through.
    const float* second = is_q ? src + D : v + ((size_t)t * kv_heads + kvh) * D;
    float x[ND], gains[ND], y[ND], cs[ND] = {}, sn[ND] = {};
#pragma unroll
    for (int i = 0; i < ND; ++i) {
        x[i] = src[lane + 32 * i];
        y[i] = second[lane + 32 * i];
        gains[i] = w[lane + 32 * i];
        if (64 * i < rotary) {
            const float2 a = angles[(size_t)t * (rotary / 2) + lane + 32 * i];
            cs[i] = a.x, sn[i] = a.y;
        }
    }
    norm_rotate_row<ND>(x, gains, eps, rotary, cs, sn);
    if (is_q) {
        const size_t at = ((size_t)t * heads + slot) * D;
#pragma unroll
        for (int i = 0; i < ND; ++i) {
            q[at + lane + 32 * i] = x[i];
            g[at + lane + 32 * i] = y[i];
        }
    } else {
        store_kv_row<ND>(kc, vc, (size_t)pos * kv_heads * D + (size_t)kvh * D, x, [&](int i) { return y[i]; });
    }
}

#define ATTN_PREP_ROWS(ND)                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) attn_prep_rows_d##ND(                                        \
        const float* qg, const float* k, const float* v, const float* q_norm, const float* k_norm, float* q, float* g, \
        u16* kc, u16* vc, int heads, int kv_heads, int d, int rotary, double theta, float eps, const int* pos_ptr,  \
        int pos0, const float2* angles) {                                                                           \
        attn_prep_rows<ND>(qg, k, v, q_norm, k_norm, q, g, kc, vc, heads, kv_heads, rotary, eps, pos_ptr, pos0,     \
                           angles);                                                                                 \
    }
// Head dims 64, 128 and 256.
ATTN_PREP_ROWS(2)
ATTN_PREP_ROWS(4)
ATTN_PREP_ROWS(8)

template <int ND, int NG>
__device__ __forceinline__ void attention_partial_impl(const float* __restrict__ q, u16* k, u16* v,
                                                       float* __restrict__ part, int heads, int kv_heads,
                                                       const int* pos_ptr, int pos0, const AttnPrep& prep) {
    constexpr int D = 32 * ND, H = 8 * NG, TILE = ATTN_TILE, KT = TILE / 16;
    constexpr int WARPS = adec_warps(D), DW = D / WARPS, KSTEPS = DW / 16, MTILES = DW / 16;
    constexpr int LD = D + 8, SP = H + 4, STAGES = ATTN_STAGES;
    constexpr int STAGE = 2 * TILE * LD;
    extern __shared__ float4 attn_smem[];
    require_dynamic_smem(attn_decode_smem_bytes(D, NG));
    float* sp = reinterpret_cast<float*>(attn_smem);             // [WARPS][TILE][H]
    float* ss = sp + WARPS * TILE * H;                            // [TILE][SP]
    u16* stages = reinterpret_cast<u16*>(ss + TILE * SP);         // [STAGES][K, V [TILE][LD]]
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
    // Each thread copies the same (key, column) slots of every tile: keys key0 + ROWS_AT_ONCE r.
    constexpr int THREADS = 32 * WARPS, ROWS_AT_ONCE = THREADS / (D / 8), COPIES = TILE / ROWS_AT_ONCE;
    static_assert(THREADS % (D / 8) == 0 && TILE % ROWS_AT_ONCE == 0, "copy slots");
    const int key0 = threadIdx.x / (D / 8), col = 8 * (threadIdx.x % (D / 8));
    const u16* k_at = k + (size_t)kvh * D + col;
    const u16* v_at = v + (size_t)kvh * D + col;
    auto fetch = [&](int j) {
        if (j < tiles_n) {
            u16* kt = stages + (j % STAGES) * STAGE + key0 * LD + col;
            u16* vt = kt + TILE * LD;
            const int p0 = start + j * TILE, n = min(TILE, end - p0);
#pragma unroll
            for (int r = 0; r < COPIES; ++r) {
                const int key = key0 + ROWS_AT_ONCE * r;
                if (key < n) {
                    const size_t src = (size_t)(p0 + key) * row;
                    cp_async16(kt + ROWS_AT_ONCE * r * LD, k_at + src);
                    cp_async16(vt + ROWS_AT_ONCE * r * LD, v_at + src);
                } else {
                    *reinterpret_cast<uint4*>(vt + ROWS_AT_ONCE * r * LD) = make_uint4(0u, 0u, 0u, 0u);
                }
            }
        }
        cp_async_commit();
    };
    // The first tiles of keys that earlier steps wrote are requested before the wait for
    // attn_prep, which writes the new keys' rows: this kernel launches only once attn_prep's blocks
    // have waited for the kernels before them, so those rows and the position are in memory
    // (decode +0.6% at 256, +0.9% at 32,768: docs/performance.md, session 36). With an AttnPrep
    // the kernel before is the in-projections, which likewise wait before letting it launch.
    int fetched = 0;
    while (fetched < STAGES - 1 && start + (fetched + 1) * TILE <= pos) fetch(fetched++);
    // With an AttnPrep (one token): its rotation's angles and the norms' gains, before the wait.
    const bool prepped = prep.q_norm != nullptr;
    float* qs = sp;  // the prepped queries [group][D], before the score parts take the space
    constexpr bool PREP_FITS = ND <= 8;  // head dims up to 256 (the host sends no AttnPrep past)
    static_assert(!PREP_FITS || 8 * NG * D <= WARPS * TILE * H, "the prepped queries fit the score parts");
    float cs[PREP_FITS ? ND : 1] = {}, sn[PREP_FITS ? ND : 1] = {}, qw[PREP_FITS ? ND : 1] = {},
                                   kw[PREP_FITS ? ND : 1] = {};
    if constexpr (PREP_FITS) {
        if (prepped) {
            lane_rope_angles<ND>(pos, prep.rotary, prep.theta, cs, sn);
#pragma unroll
            for (int i = 0; i < ND; ++i) {
                qw[i] = prep.q_norm[lane + 32 * i];
                kw[i] = prep.k_norm[lane + 32 * i];
            }
        }
    }
    pdl_wait();
    pdl_launch_dependents();
    if constexpr (PREP_FITS) {
        if (prepped) {
            // Rows 0 .. group - 1: the KV head's query heads; row `group`: the new key, for the
            // block whose keys hold its position, which writes it and the value into the caches.
            const bool new_key = start <= pos && pos < end;
            for (int r = warp; r < group + (new_key ? 1 : 0); r += WARPS) {
                const bool key = r == group;
                const float* src = key ? prep.k + (size_t)kvh * D : prep.qg + (size_t)(kvh * group + r) * 2 * D;
                float x[ND];
#pragma unroll
                for (int i = 0; i < ND; ++i) x[i] = src[lane + 32 * i];
                norm_rotate_row<ND>(x, key ? kw : qw, prep.eps, prep.rotary, cs, sn);
                if (!key) {
#pragma unroll
                    for (int i = 0; i < ND; ++i) qs[r * D + lane + 32 * i] = x[i];
                } else {
                    const float* vr = prep.v + (size_t)kvh * D;
                    store_kv_row<ND>(k, v, (size_t)pos * row + (size_t)kvh * D, x,
                                     [&](int i) { return vr[lane + 32 * i]; });
                }
            }
            __syncthreads();  // the queries staged; the new rows in memory before their tile's copies
        }
    }
    while (fetched < STAGES - 1) fetch(fetched++);
    const int d0 = warp * DW;  // this warp's first dim
    // Q^T's fragments for this warp's dims (the score product's B: head 8n + g, dims
    // d0 + 16 ks + 2c, + 1 and + 8, + 9), scaled and split once for every tile.
    u32 qh[NG][KSTEPS][2], ql[NG][KSTEPS][2];
    {
        const float scale = rsqrtf((float)D) * 1.4426950408889634f;  // and log2(e): exp2 below
#pragma unroll
        for (int n = 0; n < NG; ++n) {
            const int h = 8 * n + g;
            const float* qrow = (prepped ? qs : q + ((size_t)t * heads + kvh * group) * D) +
                                (size_t)min(h, group - 1) * D + d0 + 2 * c;
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    float2 x = make_float2(0.f, 0.f);
                    if (h < group) x = *reinterpret_cast<const float2*>(qrow + 16 * ks + 8 * i);
                    f16_split2(x.x * scale, x.y * scale, qh[n][ks][i], ql[n][ks][i]);
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
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile j is in; every warp is done with tile j - 1 (its stage, the parts)
        fetch(j + STAGES - 1);
        const u16* kt = stages + (j % STAGES) * STAGE;
        const u16* vt = kt + TILE * LD;
        // This warp's part of S^T = K Q^T (the lo products apart, so that they do not wait on
        // the hi ones).
        float s[KT][NG][4], sl[KT][NG][4];
#pragma unroll
        for (int kk = 0; kk < KT; ++kk)
#pragma unroll
            for (int n = 0; n < NG; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) s[kk][n][i] = sl[kk][n][i] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
            for (int kk = 0; kk < KT; ++kk) {
                u32 a[4];
                ldsm_a(a, kt + 16 * kk * LD + d0 + 16 * ks, LD);
#pragma unroll
                for (int n = 0; n < NG; ++n) {
                    mma_f16(sl[kk][n], a, ql[n][ks]);
                    mma_f16(s[kk][n], a, qh[n][ks]);
                }
            }
        float* mine = sp + warp * TILE * H;
#pragma unroll
        for (int kk = 0; kk < KT; ++kk)
#pragma unroll
            for (int n = 0; n < NG; ++n) {
                float* r = mine + 16 * kk * H + 8 * n + 2 * c;
                *reinterpret_cast<float2*>(r + g * H) =
                    make_float2(s[kk][n][0] + sl[kk][n][0], s[kk][n][1] + sl[kk][n][1]);
                *reinterpret_cast<float2*>(r + (g + 8) * H) =
                    make_float2(s[kk][n][2] + sl[kk][n][2], s[kk][n][3] + sl[kk][n][3]);
            }
        __syncthreads();
        const int p0 = start + j * TILE;
        for (int i = threadIdx.x; i < TILE * H; i += blockDim.x) {
            const int key = i / H;
            float a = 0.f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) a += sp[w * TILE * H + i];
            ss[key * SP + i % H] = p0 + key < end ? a : NEG_INF;
        }
        __syncthreads();
#pragma unroll
        for (int n = 0; n < NG; ++n) {
            // Head 8n + g's scores of keys 16 kk + 2c, + 1, + 8, + 9.
            float sc[4 * KT];
#pragma unroll
            for (int i = 0; i < 4 * KT; ++i) {
                const int key = 16 * (i >> 2) + 2 * c + (i & 1) + 8 * ((i >> 1) & 1);
                sc[i] = ss[key * SP + 8 * n + g];
            }
            float tile_max = sc[0];
#pragma unroll
            for (int i = 1; i < 4 * KT; ++i) tile_max = fmaxf(tile_max, sc[i]);
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
            const float m_new = fmaxf(m[n], tile_max);  // finite: every tile has a key before `end`
            const float corr = exp2_ftz(m[n] - m_new);  // 0 on the first tile (m = -inf)
            float p[4 * KT], tile_sum = 0.f;
#pragma unroll
            for (int i = 0; i < 4 * KT; ++i) {
                p[i] = sc[i] == NEG_INF ? 0.f : exp2_ftz(sc[i] - m_new);
                tile_sum += p[i];
            }
            tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 1);
            tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 2);
            l[n] = l[n] * corr + tile_sum;
            m[n] = m_new;
            // The accumulator columns are heads 2c and 2c + 1, whose factors lanes 8c and 8c + 4 hold.
            const float corr0 = __shfl_sync(0xffffffffu, corr, 8 * c);
            const float corr1 = __shfl_sync(0xffffffffu, corr, 8 * c + 4);
            // P^T's fragments: keys 16 kk + 2c, + 1 and + 8, + 9 of head g.
            u32 ph[KT][2], pl[KT][2];
#pragma unroll
            for (int kk = 0; kk < KT; ++kk) {
                f16_split2_unit(p[4 * kk], p[4 * kk + 1], ph[kk][0], pl[kk][0]);
                f16_split2_unit(p[4 * kk + 2], p[4 * kk + 3], ph[kk][1], pl[kk][1]);
            }
#pragma unroll
            for (int mt = 0; mt < MTILES; ++mt) {
                float* acc = o[n][mt];
                acc[0] *= corr0;
                acc[1] *= corr1;
                acc[2] *= corr0;
                acc[3] *= corr1;
#pragma unroll
                for (int kk = 0; kk < KT; ++kk) {
                    u32 a[4];
                    ldsm_at(a, vt + 16 * kk * LD + d0 + 16 * mt, LD);
                    mma_f16(acc, a, pl[kk]);
                    mma_f16(acc, a, ph[kk]);
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
        attention_partial_d##ND##_g##NG(const float* q, u16* k, u16* v, float* part, int heads, int kv_heads, \
                                        const int* pos_ptr, int pos0, AttnPrep prep) {                          \
        attention_partial_impl<ND, NG>(q, k, v, part, heads, kv_heads, pos_ptr, pos0, prep);                  \
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

// o[r][c] = sum_s 2^(m_s - M) acc_s[c] / sum_s 2^(m_s - M) l_s over the splits of row r (maxima in
// log2 units; splits past the row's keys hold max = -inf and weigh nothing). One block of 256
// threads per (row, 32 columns), so that thread s holds split s's max and sum (the host makes at
// most 256 splits): every value the block reads is requested first, warp w's lane holding its
// column of splits w, w + 8, ... in registers, so the block waits on memory once, then on its
// reductions; warp w sums its column over its splits in order and warp 0 adds the eight partial
// sums. With a gate (the attention layer's output gate, row r at r * gate_stride: attn_prep's
// [rows][d], or the in-projections' q|gate rows for an AttnPrep) o is then multiplied by
// sigmoid(gate), as sigmoid_mul would.
constexpr int MAX_SPLITS = 256;
extern "C" __global__ void __launch_bounds__(256) attention_combine(const float* part, const float* gate, float* o,
                                                                    int d, int splits, int gate_stride) {
    constexpr int WARPS = 8, PER_WARP = MAX_SPLITS / WARPS;
    __shared__ float wgt[MAX_SPLITS];
    __shared__ float red[2][WARPS];
    __shared__ float colsum[WARPS][32];
    const int r = blockIdx.x, s = threadIdx.x, lane = s & 31, warp = s >> 5;
    const int c = blockIdx.y * 32 + lane;
    // The gate is read before the wait for the partial results: its writer (attn_prep, or for an
    // AttnPrep the in-projections) had finished before attention_partial let this kernel launch.
    const float gate_v = gate && warp == 0 && c < d ? gate[(size_t)r * gate_stride + c] : 0.f;
    grid_dep();
    const float* pr = part + (size_t)r * splits * (d + 2);
    float acc[PER_WARP];
#pragma unroll
    for (int i = 0; i < PER_WARP; ++i) {
        const int si = warp + WARPS * i;
        acc[i] = c < d && si < splits ? pr[(size_t)si * (d + 2) + c] : 0.f;
    }
    const float ms = s < splits ? pr[(size_t)s * (d + 2) + d] : NEG_INF;
    const float ls = s < splits ? pr[(size_t)s * (d + 2) + d + 1] : 0.f;
    float mm = ms;
    for (int o2 = 16; o2 > 0; o2 >>= 1) mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, o2));
    if (lane == 0) red[0][warp] = mm;
    __syncthreads();
    mm = red[0][0];
    for (int w = 1; w < WARPS; ++w) mm = fmaxf(mm, red[0][w]);
    const float w = exp2_ftz(ms - mm);  // an empty split: 2^-inf = 0
    wgt[s] = w;
    const float lw = warp_sum(ls * w);
    if (lane == 0) red[1][warp] = lw;
    __syncthreads();
    float l = 0.f;
    for (int i = 0; i < WARPS; ++i) l += red[1][i];
    float a = 0.f;
#pragma unroll
    for (int i = 0; i < PER_WARP; ++i) {
        const int si = warp + WARPS * i;
        if (si < splits) a = fmaf(acc[i], wgt[si], a);
    }
    colsum[warp][lane] = a;
    __syncthreads();
    if (warp == 0 && c < d) {
        float total = 0.f;
        for (int i = 0; i < WARPS; ++i) total += colsum[i][lane];
        const float out = total / l;
        o[(size_t)r * d + c] = gate ? out * sigmoid(gate_v) : out;
    }
}

// ---- prefill: causal flash attention on the tensor cores.
//
// One block per (128 queries, query head): 8 warps, each owning 16 query rows. The block walks the
// keys in tiles of 64 up to its last query's position, computing the scores S = Q K^T and then
// O += P V with an online softmax (running max and sum per row, O rescaled only when a row's max
// grows). Numerics: K and V are the cache's f16 values; Q (scaled) and P are rounded to f16 once
// each, and both products accumulate in f32. Each rounding is the one the cache already gives K
// and V (relative 2^-11), so it adds an error of the cache's own size: ~3e-8 (NMSE) from the f32
// reference on the same cache (cuda_parity). Until session 24, Q and P were split in f16 hi + lo
// parts, two products each (~1e-11): rounding them once made a 131,072-token prefill 21% faster
// on wgmma, the goldens' worst |dlogit| 5.17e-4 -> 5.58e-4 (docs/performance.md). The tiles
// arrive from the cache by cp.async: K tile j + 1 is requested as soon as S of tile j is done, V
// tile j + 1 as soon as its P V is, each overlapping the other's work. Shared memory (u16): Q
// [128][D + 8], K and V [64][D + 8] (the pitch makes each warp's fragment loads hit 32 different
// banks): 132 KiB at D = 256, one block per SM.
// Tiles of 64 keys halve the barriers and the reloads of Q's fragments a key against 32 (prefill
// +6% at 32,768 tokens, +12% at 131,072: session 22). Splitting the head dims over pairs of warps
// (16 warps a block) was slower at long contexts: each pair ran the softmax twice, and so was a
// ping-pong of two 4-warp groups on 32-key tiles (session 23). This kernel serves sm_80 to sm_89;
// on sm_90a the wgmma form below takes its place.
constexpr int FA_BQ = 128;
constexpr int FA_BK = 64;
constexpr int FA_THREADS = 256;

__host__ __device__ constexpr int fa_smem_bytes(int d) { return 2 * (FA_BQ * (d + 8) + 2 * FA_BK * (d + 8)); }

// Rows [row0, row0 + rows) of a cache [*, ld], D columns from col0, into a tile by cp.async, value
// (r, c) at element at(r, c); rows at or past `valid` are zero. Each thread copies one 8-column
// chunk of every STEP-th row: at is linear in r for a fixed r & 7 (STEP is a multiple of 8), so
// its addresses are one pointer and a stride, not a register each.
template <int D, class At>
__device__ __forceinline__ void fa_fetch(u16* tile, const u16* src, size_t ld, int col0, int row0, int rows,
                                         int valid, At at) {
    constexpr int D8 = D / 8, STEP = FA_THREADS / D8;
    static_assert(STEP % 8 == 0, "fa_fetch: rows a pass must keep r & 7");
    const int r0 = threadIdx.x / D8, c = (threadIdx.x % D8) * 8;
    u16* dst = tile + at(r0, c);
    const int stride = at(r0 + STEP, c) - at(r0, c);
    const u16* from = src + (size_t)(row0 + r0) * ld + col0 + c;
    for (int r = r0; r < rows; r += STEP, dst += stride, from += STEP * ld) {
        if (row0 + r < valid) cp_async16(dst, from);
        else *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
    cp_async_commit();
}

// The block's 128 queries of head h from row t0 of q, scaled by log2(e) / sqrt(D) (exp2 below)
// and rounded to f16, value (r, c) at element at(r, c) of qt.
template <int D, class At>
__device__ __forceinline__ void fa_stage_q(const float* __restrict__ q, u16* qt, int t0, int tokens, size_t qld,
                                           int h, At at) {
    const float scale = rsqrtf((float)D) * 1.4426950408889634f;
    constexpr int D4 = D / 4;
    for (int i = threadIdx.x; i < FA_BQ * D4; i += FA_THREADS) {
        const int r = i / D4, c = (i % D4) * 4;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (t0 + r < tokens) x = *reinterpret_cast<const float4*>(q + (size_t)(t0 + r) * qld + h * D + c);
        *reinterpret_cast<uint2*>(qt + at(r, c)) =
            make_uint2(f16x2_bits(x.x * scale, x.y * scale), f16x2_bits(x.z * scale, x.w * scale));
    }
}

// The online softmax of the tile of keys from k0 for this thread's two rows (qpos0, qpos1: rows
// gq and gq + 8 of its warp's 16, each row's 64 scores spread over the four lanes of a quad),
// the scores p becoming the probabilities in place: the causal mask (only on the tiles that reach
// past the warp's first query or the cache: most tiles of a long context need none), the running
// maxima m and sums l, and O rescaled. Once the maxima settle most tiles leave them as they are:
// the rescale (a multiply by exactly 1 then) is skipped unless one of the warp's rows grew.
template <int NK, int NO>
__device__ __forceinline__ void fa_softmax(float (&p)[NK][4], float (&acc)[NO][4], float (&m)[2], float (&l)[2],
                                           int k0, int warp_first, int qpos0, int qpos1, int keys, int cq) {
    if (k0 + NK * 8 - 1 > warp_first || k0 + NK * 8 > keys) {
#pragma unroll
        for (int n = 0; n < NK; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + n * 8 + 2 * cq + (e & 1);
                if (key > ((e >> 1) ? qpos1 : qpos0) || key >= keys) p[n][e] = NEG_INF;
            }
    }
    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int n = 0; n < NK; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], p[n][e]);
    float base[2], corr[2];  // base: the maxima, 0 for a row with no key yet (-inf - -inf is NaN)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        const float mn = fmaxf(m[i], mx[i]);
        corr[i] = mn == NEG_INF ? 1.f : exp2_ftz(m[i] - mn);
        m[i] = mn;
        base[i] = mn == NEG_INF ? 0.f : mn;
        l[i] *= corr[i];
    }
#pragma unroll
    for (int n = 0; n < NK; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            p[n][e] = exp2_ftz(p[n][e] - base[e >> 1]);  // masked: 2^-inf = 0
            l[e >> 1] += p[n][e];
        }
    if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            acc[n][0] *= corr[0];
            acc[n][1] *= corr[0];
            acc[n][2] *= corr[1];
            acc[n][3] *= corr[1];
        }
    }
}

// P rounded to f16 for keys 16 kk .. 16 kk + 15: the scores' accumulator layout is the A-fragment
// layout of the next product.
template <int NK>
__device__ __forceinline__ void fa_round_p(const float (&p)[NK][4], int kk, u32 (&ph)[4]) {
    const float* pa = p[2 * kk];
    const float* pb = p[2 * kk + 1];
    ph[0] = f16x2_bits(pa[0], pa[1]);
    ph[1] = f16x2_bits(pa[2], pa[3]);
    ph[2] = f16x2_bits(pb[0], pb[1]);
    ph[3] = f16x2_bits(pb[2], pb[3]);
}

// O / l into o's rows r0 and r0 + 8 (those before `tokens`), head columns from col0.
template <int NO>
__device__ __forceinline__ void fa_store(const float (&acc)[NO][4], float (&l)[2], float* __restrict__ o, int r0,
                                         int tokens, size_t qld, int col0, int cq) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
#pragma unroll
    for (int n = 0; n < NO; ++n) {
        const int col = col0 + n * 8 + 2 * cq;
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

// q [T, H*D] at positions pos0.., the caches [keys, KVH*D] holding positions
// 0 .. pos0 + T - 1, o [T, H*D]. Launch with 256 threads, (ceil(T / 128), H) blocks and
// fa_smem_bytes(D) bytes of dynamic shared memory.
template <int D>
__device__ __forceinline__ void attention_prefill_impl(const float* __restrict__ q, const u16* __restrict__ k,
                                                       const u16* __restrict__ v, float* __restrict__ o, int tokens,
                                                       int heads, int kv_heads, int pos0) {
    constexpr int NO = D / 8;      // output n-tiles per warp
    constexpr int NK = FA_BK / 8;  // key n-tiles of a tile's scores
    constexpr int LD = D + 8;
    extern __shared__ __align__(16) u16 fa_smem[];
    require_dynamic_smem(fa_smem_bytes(D));
    u16* qt = fa_smem;
    u16* kt = qt + FA_BQ * LD;
    u16* vt = kt + FA_BK * LD;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, cq = lane & 3;
    // Blocks in launch order take the last queries first (they see the most keys, so the short
    // ones fill the tail of the grid), the heads of one block of queries side by side (those of
    // a KV head read the same tiles from L2 at about the same time).
    const int order = blockIdx.x + gridDim.x * blockIdx.y;
    const int t0 = (gridDim.x - 1 - order / heads) * FA_BQ, h = order % heads, kvh = h / (heads / kv_heads);
    const size_t qld = (size_t)heads * D, kld = (size_t)kv_heads * D;
    const int keys = pos0 + tokens;
    const int last = min(pos0 + t0 + FA_BQ, keys);  // keys [0, last) can be seen by the block
    const auto padded = [](int r, int c) { return r * LD + c; };
    fa_fetch<D>(kt, k, kld, kvh * D, 0, FA_BK, keys, padded);
    fa_fetch<D>(vt, v, kld, kvh * D, 0, FA_BK, keys, padded);
    fa_stage_q<D>(q, qt, t0, tokens, qld, h, padded);  // while the first tiles arrive
    // This thread's two query rows (fragment rows gq and gq + 8 of the warp's 16).
    const int qpos0 = pos0 + t0 + warp * 16 + gq, qpos1 = qpos0 + 8;
    // Warps whose rows all precede a tile's first key skip its products.
    const int warp_first = pos0 + t0 + warp * 16, warp_last = warp_first + 15;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    float acc[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    for (int k0 = 0; k0 < last; k0 += FA_BK) {
        const bool more = k0 + FA_BK < last;
        cp_async_wait_one();  // K of this tile (V may still be on its way)
        __syncthreads();
        const bool active = k0 <= warp_last;
        float s[NK][4];
#pragma unroll
        for (int n = 0; n < NK; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
        if (active) {
            // S = Q K^T for the warp's 16 rows x 64 keys (eight accumulators a k-step).
#pragma unroll 2
            for (int ks = 0; ks < D / 16; ++ks) {
                u32 a[4];
                ldsm_a(a, qt + warp * 16 * LD + ks * 16, LD);
#pragma unroll
                for (int n2 = 0; n2 < NK / 2; ++n2) {
                    u32 b[4];  // keys n2 * 16 + 0-7 in [0..1], + 8-15 in [2..3]
                    ldsm_b2(b, kt + n2 * 16 * LD + ks * 16, LD);
#pragma unroll
                    for (int h2 = 0; h2 < 2; ++h2) mma_f16(s[2 * n2 + h2], a, b + 2 * h2);
                }
            }
        }
        __syncthreads();  // every warp is done with this K tile
        if (more) fa_fetch<D>(kt, k, kld, kvh * D, k0 + FA_BK, FA_BK, keys, padded);
        if (active) fa_softmax(s, acc, m, l, k0, warp_first, qpos0, qpos1, keys, cq);
        if (more) cp_async_wait_one();  // V of this tile (the next K may still be on its way)
        else cp_async_wait_all();
        __syncthreads();
        if (active) {
            // O += P V, V's fragments transposed from its key-major tile.
#pragma unroll
            for (int kk = 0; kk < NK / 2; ++kk) {
                u32 p[4];
                fa_round_p(s, kk, p);
#pragma unroll
                for (int n2 = 0; n2 < NO / 2; ++n2) {
                    u32 b[4];  // dims n2 * 16 + 0-7 in [0..1], + 8-15 in [2..3]
                    ldsm_bt2(b, vt + kk * 16 * LD + n2 * 16, LD);
#pragma unroll
                    for (int h2 = 0; h2 < 2; ++h2) mma_f16(acc[2 * n2 + h2], p, b + 2 * h2);
                }
            }
        }
        __syncthreads();  // every warp is done with this V tile
        if (more) fa_fetch<D>(vt, v, kld, kvh * D, k0 + FA_BK, FA_BK, keys, padded);
    }
    fa_store(acc, l, o, t0 + warp * 16 + gq, tokens, qld, h * D, cq);
}

// The entry points of a flash-attention form: NAME_d64, NAME_d128, NAME_d256.
#define ATTENTION_PREFILL_KERNEL(NAME, IMPL, D)                                                                \
    extern "C" __global__ void __launch_bounds__(FA_THREADS)                                                  \
        NAME##_d##D(const float* q, const u16* k, const u16* v, float* o, int tokens, int heads, int kv_heads, \
                    int pos0) {                                                                                \
        grid_dep();                                                                                            \
        IMPL<D>(q, k, v, o, tokens, heads, kv_heads, pos0);                                                    \
    }
// Head dims 64, 128 and 256 (512 takes the split-K kernels: its tiles would not fit).
ATTENTION_PREFILL_KERNEL(attention_prefill, attention_prefill_impl, 64)
ATTENTION_PREFILL_KERNEL(attention_prefill, attention_prefill_impl, 128)
ATTENTION_PREFILL_KERNEL(attention_prefill, attention_prefill_impl, 256)

// ---- prefill on Hopper's warpgroup products (sm_90a).
//
// The kernel above with its two products on wgmma: the same blocks (128 queries of one head, 8
// warps), tiles of 64 keys, online softmax and numerics, each of the two warpgroups multiplying
// its 64 queries, and one block barrier fewer a tile (K's next tile is fetched at the barrier
// before P V). S = Q K^T (m64n64k16, 16 products a tile: one for each 16 of the D columns) reads
// Q and K from shared memory, and O += P V (m64n64k16 for each 64 of the D columns and 16 keys)
// takes P from the registers its softmax left and reads V as an N-major operand: the tensor cores fetch the tiles
// themselves, with no fragment loads by the warps (the mma.sync kernel spends 76 ldmatrix a warp a
// tile), and at up to twice mma.sync's rate. Tiles are stored with the 128-byte swizzle: 64
// columns a 128-byte row, its 16-byte chunk c at c ^ (row & 7), the next 64 columns after all the
// rows (sw128_at). Shared memory: Q [128][D], K and V [64][D]: 129 KiB at D = 256 with the
// alignment. Measured against the mma.sync kernel (docs/performance.md, session 23): prefill +13%
// at 32,768 tokens, +33% at 131,072. Dropped: K in two slots with S(j + 1) issued before tile j's
// softmax (3-7% slower with Q and P split, no faster with P rounded once: session 23 and 24), and
// K and V in two slots with one block barrier a tile (1% slower: session 24).
__host__ __device__ constexpr int fa_wg_smem_bytes(int d) { return 2 * (FA_BQ * d + 2 * FA_BK * d) + 1024; }

// Element offset of value (r, c) of a tile of `rows` rows in the 128-byte swizzle.
__device__ __forceinline__ int sw128_at(int r, int c, int rows) {
    return (c >> 6) * rows * 64 + r * 64 + ((((c >> 3) & 7) ^ (r & 7)) << 3) + (c & 7);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d (+)= a * b over 64 rows x 64 columns x 16: a and b K-major, by descriptor.
__device__ __forceinline__ void wgmma_ss_f16(float (&d)[32], u64 a, u64 b, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %34, 0; "
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
        WGMMA_D32_REGS
        "%32, %33, p, 1, 1, 0, 0; }"
        : WGMMA_D32_OPERANDS(d)
        : "l"(a), "l"(b), "r"(accumulate)
        : "memory");
}
// d += a * b over 64 rows x 64 columns x 16: a in registers (the m16n8k16 A fragment of the
// warp's 16 rows), b N-major by descriptor.
__device__ __forceinline__ void wgmma_rs_f16_nmajor(float (&d)[32], const u32 (&a)[4], u64 b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
        WGMMA_D32_REGS
        "{%32, %33, %34, %35}, %36, 1, 1, 1, 1;"
        : WGMMA_D32_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)
        : "memory");
}

// As attention_prefill_impl; launch with fa_wg_smem_bytes(D) bytes of dynamic shared memory.
template <int D>
__device__ __forceinline__ void attention_prefill_wg_impl(const float* __restrict__ q, const u16* __restrict__ k,
                                                          const u16* __restrict__ v, float* __restrict__ o,
                                                          int tokens, int heads, int kv_heads, int pos0) {
    constexpr int NO = D / 8, NK = FA_BK / 8;
    extern __shared__ __align__(16) unsigned char fa_wg_raw[];
    require_dynamic_smem(fa_wg_smem_bytes(D));
    u16* qt = reinterpret_cast<u16*>(fa_wg_raw + ((1024 - (smem_addr(fa_wg_raw) & 1023)) & 1023));
    u16* kt = qt + FA_BQ * D;
    u16* vt = kt + FA_BK * D;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, cq = lane & 3, wg = warp >> 2;
    const int order = blockIdx.x + gridDim.x * blockIdx.y;  // heaviest first, as above
    const int t0 = (gridDim.x - 1 - order / heads) * FA_BQ, h = order % heads, kvh = h / (heads / kv_heads);
    const size_t qld = (size_t)heads * D, kld = (size_t)kv_heads * D;
    const int keys = pos0 + tokens;
    const int last = min(pos0 + t0 + FA_BQ, keys);
    const auto tile_at = [](int r, int c) { return sw128_at(r, c, FA_BK); };
    fa_fetch<D>(kt, k, kld, kvh * D, 0, FA_BK, keys, tile_at);
    fa_fetch<D>(vt, v, kld, kvh * D, 0, FA_BK, keys, tile_at);
    fa_stage_q<D>(q, qt, t0, tokens, qld, h, [](int r, int c) { return sw128_at(r, c, FA_BQ); });
    const int qpos0 = pos0 + t0 + warp * 16 + gq, qpos1 = qpos0 + 8;
    const int warp_first = pos0 + t0 + warp * 16;
    // The products are the warpgroup's together: it skips a tile only if all its 64 rows precede
    // the tile's first key.
    const int group_last = pos0 + t0 + wg * 64 + 63;
    // Q's rows of this warpgroup, K and V tiles, 16 columns (Q, K) or keys (V) a k-step. V is the
    // B operand N-major: its 8-key groups lie 1,024 bytes apart (the stride); the leading offset,
    // between 64-column blocks, is unused by a 64-column product.
    // (Each a fixed descriptor advanced by a constant: one add a product.)
    const u64 q_base = smem_desc_sw128(qt + wg * 64 * 64, 1024), k_base = smem_desc_sw128(kt, 1024),
              v_base = smem_desc_sw128(vt, 1024);
    const auto q_desc = [&](int ks) { return smem_desc_advance(q_base, 2 * ((ks >> 2) * FA_BQ * 64 + (ks & 3) * 16)); };
    const auto k_desc = [&](int ks) { return smem_desc_advance(k_base, 2 * ((ks >> 2) * FA_BK * 64 + (ks & 3) * 16)); };
    const auto v_desc = [&](int b, int kk) { return smem_desc_advance(v_base, 2 * (b * FA_BK * 64 + kk * 16 * 64)); };
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    float acc[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    for (int k0 = 0; k0 < last; k0 += FA_BK) {
        const bool more = k0 + FA_BK < last;
        cp_async_wait_one();  // K of this tile (V may still be on its way)
        fence_proxy_async();  // what this thread saw land (and Q, zero rows) before the tensor cores read it
        __syncthreads();
        const bool active = k0 <= group_last;
        float s[NK][4];
        if (active) {
            float(&sf)[NK * 4] = reinterpret_cast<float(&)[NK * 4]>(s);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) wgmma_ss_f16(sf, q_desc(ks), k_desc(ks), ks > 0);
            wgmma_commit();
            wgmma_wait_all();
            wgmma_hold(sf);
        }
        // No barrier here: a warpgroup whose scores are done starts its softmax while the other's
        // products still run; K's next tile is fetched after the barrier below.
        u32 p[NK / 2][4];
        if (active) {
            fa_softmax(s, acc, m, l, k0, warp_first, qpos0, qpos1, keys, cq);
#pragma unroll
            for (int kk = 0; kk < NK / 2; ++kk) fa_round_p(s, kk, p[kk]);
        }
        cp_async_wait_all();  // V of this tile
        fence_proxy_async();
        __syncthreads();  // V has landed; every warpgroup is done with this K tile
        if (more) fa_fetch<D>(kt, k, kld, kvh * D, k0 + FA_BK, FA_BK, keys, tile_at);
        if (active) {
            wgmma_fence();  // after the rescale of acc
#pragma unroll
            for (int b = 0; b < D / 64; ++b) {
                float(&ab)[32] = reinterpret_cast<float(&)[32]>(acc[8 * b]);
#pragma unroll
                for (int kk = 0; kk < NK / 2; ++kk) wgmma_rs_f16_nmajor(ab, p[kk], v_desc(b, kk));
            }
            wgmma_commit();
            wgmma_wait_all();
#pragma unroll
            for (int b = 0; b < D / 64; ++b) wgmma_hold(reinterpret_cast<float(&)[32]>(acc[8 * b]));
        }
        __syncthreads();  // every warpgroup is done with this V tile
        if (more) fa_fetch<D>(vt, v, kld, kvh * D, k0 + FA_BK, FA_BK, keys, tile_at);
    }
    fa_store(acc, l, o, t0 + warp * 16 + gq, tokens, qld, h * D, cq);
}

ATTENTION_PREFILL_KERNEL(attention_prefill_wg, attention_prefill_wg_impl, 64)
ATTENTION_PREFILL_KERNEL(attention_prefill_wg, attention_prefill_wg_impl, 128)
ATTENTION_PREFILL_KERNEL(attention_prefill_wg, attention_prefill_wg_impl, 256)
#endif
