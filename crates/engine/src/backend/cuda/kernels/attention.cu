// Gated full attention: partial rotary embedding, and causal grouped-query attention over the f32
// KV cache split along the keys (split-K: many blocks per query head at long contexts, merged by a
// second kernel with the usual max/sum rescaling).

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

#define NEG_INF __int_as_float(0xff800000u)

// Decode steps replayed from a CUDA graph read the position from device memory (`pos_ptr`, written
// before each replay); eager launches pass it by value (`pos_ptr` null).
__device__ __forceinline__ int position(const int* pos_ptr, int pos0) { return pos_ptr ? *pos_ptr : pos0; }

// Rotate-half RoPE on the first `rotary` dims of each head of x [T, H*D], in place; row t is at
// position pos0 + t. Angles in f64 (as the CPU reference computes its table). One thread per
// (t, h, j < rotary/2).
extern "C" __global__ void rope(float* x, int tokens, int heads, int d, int rotary, double theta,
                                const int* pos_ptr, int pos0) {
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
                                    const int* pos_ptr, int pos0) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long dst = (long long)position(pos_ptr, pos0) * row + i;
    kc[dst] = k[i];
    vc[dst] = v[i];
}

// Head dims per lane: head_dim = 32 * ND_MAX at most.
constexpr int ND_MAX = 16;
// Keys scored per warp iteration: independent dot products keep the warp's shuffles overlapped.
constexpr int KEYS_PER_ITER = 4;

// One block per (token t, KV head, key split) with one warp per query head of that KV head's
// group, so the K and V rows are read from memory once for the whole group (the other warps hit
// L1). Warp w covers query row r = t * heads + kvh * group + w over keys
// [split * chunk, min(+chunk, pos0 + t + 1)) with an online softmax, and writes
// (acc[d], max, sum) to part[r][split]. q [T, H*D]; k, v [cap, KVH*D]; part [T*H, splits, D+2].
extern "C" __global__ void attention_partial(const float* q, const float* k, const float* v, float* part,
                                             int heads, int kv_heads, int d, const int* pos_ptr, int pos0,
                                             int chunk, int splits) {
    const int group = heads / kv_heads;
    const int t = blockIdx.x / kv_heads, kvh = blockIdx.x % kv_heads, split = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = t * heads + kvh * group + warp;
    const int len = position(pos_ptr, pos0) + t + 1;
    const int start = split * chunk, end = min(start + chunk, len);
    const int nd = d >> 5;
    const int row = kv_heads * d;
    const float scale = rsqrtf((float)d);
    float qr[ND_MAX], acc[ND_MAX];
#pragma unroll
    for (int j = 0; j < ND_MAX; ++j) {
        qr[j] = j < nd ? q[(size_t)r * d + lane + 32 * j] * scale : 0.f;
        acc[j] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    const float* kb = k + kvh * d + lane;
    const float* vb = v + kvh * d + lane;
    for (int p0 = start; p0 < end; p0 += KEYS_PER_ITER) {
        float s[KEYS_PER_ITER];
#pragma unroll
        for (int u = 0; u < KEYS_PER_ITER; ++u) {
            const int p = min(p0 + u, end - 1);
            float dot = 0.f;
#pragma unroll
            for (int j = 0; j < ND_MAX; ++j)
                if (j < nd) dot = fmaf(qr[j], __ldg(kb + (size_t)p * row + 32 * j), dot);
            s[u] = dot;
        }
#pragma unroll
        for (int u = 0; u < KEYS_PER_ITER; ++u) s[u] = warp_sum(s[u]);
#pragma unroll
        for (int u = 0; u < KEYS_PER_ITER; ++u) {
            const int p = p0 + u;
            if (p >= end) break;
            const float m_new = fmaxf(m, s[u]);
            const float corr = expf(m - m_new), e = expf(s[u] - m_new);
            l = l * corr + e;
#pragma unroll
            for (int j = 0; j < ND_MAX; ++j)
                if (j < nd) acc[j] = fmaf(e, __ldg(vb + (size_t)p * row + 32 * j), acc[j] * corr);
            m = m_new;
        }
    }
    float* out = part + ((size_t)r * splits + split) * (d + 2);
#pragma unroll
    for (int j = 0; j < ND_MAX; ++j)
        if (j < nd) out[lane + 32 * j] = acc[j];
    if (lane == 0) {
        out[d] = m;
        out[d + 1] = l;
    }
}

// o[r][c] = sum_s exp(m_s - M) acc_s[c] / sum_s exp(m_s - M) l_s over the splits of row r
// (splits past the row's keys hold max = -inf and are skipped).
extern "C" __global__ void attention_combine(const float* part, float* o, int d, int splits) {
    const int r = blockIdx.x;
    const float* pr = part + (size_t)r * splits * (d + 2);
    float mm = NEG_INF;
    for (int s = 0; s < splits; ++s) mm = fmaxf(mm, pr[(size_t)s * (d + 2) + d]);
    float ls = 0.f;
    for (int s = 0; s < splits; ++s) {
        const float ms = pr[(size_t)s * (d + 2) + d];
        if (ms != NEG_INF) ls += pr[(size_t)s * (d + 2) + d + 1] * expf(ms - mm);
    }
    const float inv = 1.f / ls;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < splits; ++s) {
            const float ms = pr[(size_t)s * (d + 2) + d];
            if (ms != NEG_INF) a += pr[(size_t)s * (d + 2) + c] * expf(ms - mm);
        }
        o[(size_t)r * d + c] = a * inv;
    }
}
