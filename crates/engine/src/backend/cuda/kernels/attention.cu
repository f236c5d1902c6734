// Gated full attention: partial rotary embedding, and causal grouped-query attention over the f32
// KV cache split along the keys (split-K: many blocks per query head at long contexts, merged by a
// second kernel with the usual max/sum rescaling).

// Decode steps replayed from a CUDA graph read the position from device memory (`pos_ptr`, written
// before each replay); eager launches pass it by value (`pos_ptr` null).
__device__ __forceinline__ int position(const int* pos_ptr, int pos0) { return pos_ptr ? *pos_ptr : pos0; }

// Rotate-half RoPE on the first `rotary` dims of each head of x [T, H*D], in place; row t is at
// position pos0 + t. Angles in f64 (as the CPU reference computes its table). One thread per
// (t, h, j < rotary/2).
extern "C" __global__ void rope(float* x, int tokens, int heads, int d, int rotary, double theta,
                                const int* pos_ptr, int pos0) { grid_dep();
    const int half = rotary >> 1;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)tokens * heads * half) return;
    const int j = (int)(i % half);
    const long long th = i / half;
    const int t = (int)(th / heads);
    const double inv = pow(theta, -2.0 * (double)j / (double)rotary);
    double sn, cs;
    sincos((double)(position(pos_ptr, pos0) + t) * inv, &sn, &cs);
    const float c = (float)cs, s = (float)sn;
    float* head = x + th * d;
    const float a = head[j], b = head[j + half];
    head[j] = a * c - b * s;
    head[j + half] = b * c + a * s;
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

// Keys per warp iteration: their K and V rows are all requested before any is used, so a warp
// keeps 2 * KEYS_PER_ITER * ND loads in flight instead of waiting on each key in turn.
constexpr int KEYS_PER_ITER = 4;

// One block per (token t, KV head, key split) with one warp per query head of that KV head's
// group, so the K and V rows are read from memory once for the whole group (the other warps hit
// L1). Warp w covers query row r = t * heads + kvh * group + w over keys
// [split * chunk, min(+chunk, pos0 + t + 1)) with an online softmax, and writes
// (acc[d], max, sum) to part[r][split]. ND = head_dim / 32 values per lane.
// q [T, H*D]; k, v [cap, KVH*D]; part [T*H, splits, D+2].
template <int ND>
__device__ __forceinline__ void attention_partial_impl(const float* __restrict__ q, const float* __restrict__ k,
                                                       const float* __restrict__ v, float* __restrict__ part,
                                                       int heads, int kv_heads, const int* pos_ptr, int pos0,
                                                       int chunk, int splits) {
    constexpr int d = 32 * ND;
    const int group = heads / kv_heads;
    const int t = blockIdx.x / kv_heads, kvh = blockIdx.x % kv_heads, split = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = t * heads + kvh * group + warp;
    const int len = position(pos_ptr, pos0) + t + 1;
    const int start = split * chunk, end = min(start + chunk, len);
    const size_t row = (size_t)kv_heads * d;
    const float scale = rsqrtf((float)d);
    float qr[ND], acc[ND];
#pragma unroll
    for (int j = 0; j < ND; ++j) {
        qr[j] = q[(size_t)r * d + lane + 32 * j] * scale;
        acc[j] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    const float* kb = k + kvh * d + lane;
    const float* vb = v + kvh * d + lane;
    for (int p0 = start; p0 < end; p0 += KEYS_PER_ITER) {
        float kr[KEYS_PER_ITER][ND], vr[KEYS_PER_ITER][ND];
#pragma unroll
        for (int u = 0; u < KEYS_PER_ITER; ++u) {
            const size_t p = (size_t)min(p0 + u, end - 1);
#pragma unroll
            for (int j = 0; j < ND; ++j) {
                kr[u][j] = __ldg(kb + p * row + 32 * j);
                vr[u][j] = __ldg(vb + p * row + 32 * j);
            }
        }
        float s[KEYS_PER_ITER];
#pragma unroll
        for (int u = 0; u < KEYS_PER_ITER; ++u) {
            float dot = 0.f;
#pragma unroll
            for (int j = 0; j < ND; ++j) dot = fmaf(qr[j], kr[u][j], dot);
            s[u] = warp_sum(dot);
        }
#pragma unroll
        for (int u = 0; u < KEYS_PER_ITER; ++u) {
            // Keys past the end (the tail of the last iteration) weigh nothing.
            const float su = p0 + u < end ? s[u] : NEG_INF;
            const float m_new = fmaxf(m, su);
            const float corr = m_new == NEG_INF ? 1.f : expf(m - m_new);
            const float e = su == NEG_INF ? 0.f : expf(su - m_new);
            l = l * corr + e;
#pragma unroll
            for (int j = 0; j < ND; ++j) acc[j] = fmaf(e, vr[u][j], acc[j] * corr);
            m = m_new;
        }
    }
    float* out = part + ((size_t)r * splits + split) * (d + 2);
#pragma unroll
    for (int j = 0; j < ND; ++j) out[lane + 32 * j] = acc[j];
    if (lane == 0) {
        out[d] = m;
        out[d + 1] = l;
    }
}

#define ATTENTION_PARTIAL(ND)                                                                              \
    extern "C" __global__ void attention_partial_d##ND(const float* q, const float* k, const float* v,    \
                                                        float* part, int heads, int kv_heads,              \
                                                        const int* pos_ptr, int pos0, int chunk, int splits) { grid_dep(); \
        attention_partial_impl<ND>(q, k, v, part, heads, kv_heads, pos_ptr, pos0, chunk, splits);          \
    }
// Head dims 64, 128, 256 and 512.
ATTENTION_PARTIAL(2)
ATTENTION_PARTIAL(4)
ATTENTION_PARTIAL(8)
ATTENTION_PARTIAL(16)

// o[r][c] = sum_s exp(m_s - M) acc_s[c] / sum_s exp(m_s - M) l_s over the splits of row r
// (splits past the row's keys hold max = -inf and weigh nothing). One block of 128 threads
// per row: the split weights are computed once into shared memory, then each thread sums its
// columns over the splits.
constexpr int MAX_SPLITS = 256;
extern "C" __global__ void attention_combine(const float* part, float* o, int d, int splits) { grid_dep();
    __shared__ float wgt[MAX_SPLITS];
    __shared__ float red[32];
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
    const float inv = 1.f / ls;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < splits; ++s) a = fmaf(pr[(size_t)s * (d + 2) + c], wgt[s], a);
        o[(size_t)r * d + c] = a * inv;
    }
}
