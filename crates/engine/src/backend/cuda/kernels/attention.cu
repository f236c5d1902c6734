// Gated full attention: partial rotary embedding, and causal grouped-query attention over the f32
// KV cache split along the keys (split-K: many blocks per query head at long contexts, merged by a
// second kernel with the usual max/sum rescaling).

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

#define NEG_INF __int_as_float(0xff800000u)

// Rotate-half RoPE on the first `rotary` dims of each head of x [T, H*D], in place; row t is at
// position pos0 + t. Angles in f64 (as the CPU reference computes its table). One thread per
// (t, h, j < rotary/2).
extern "C" __global__ void rope(float* x, int tokens, int heads, int d, int rotary, double theta, int pos0) {
    const int half = rotary >> 1;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)tokens * heads * half) return;
    const int j = (int)(i % half);
    const long long th = i / half;
    const int t = (int)(th / heads);
    const double inv = pow(theta, -2.0 * (double)j / (double)rotary);
    double sn, cs;
    sincos((double)(pos0 + t) * inv, &sn, &cs);
    const float c = (float)cs, s = (float)sn;
    float* head = x + th * d;
    const float a = head[j], b = head[j + half];
    head[j] = a * c - b * s;
    head[j + half] = b * c + a * s;
}

constexpr int ATT_WARPS = 4;
// Head dims per lane: head_dim = 32 * ND_MAX at most.
constexpr int ND_MAX = 16;

// One block per (query row, key split): the keys [split * chunk, min(+chunk, pos0 + t + 1)) of
// query row r = t * heads + h. Each warp runs an online softmax over every 4th key; the four are
// merged and written as (max, sum, acc[d]) to part[r][split].
// q [T, H*D]; k, v [cap, KVH*D]; part [T*H, splits, D + 2].
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
    attention_partial(const float* q, const float* k, const float* v, float* part, int heads, int kv_heads,
                      int d, int pos0, int chunk, int splits) {
    __shared__ float sm_m[ATT_WARPS], sm_l[ATT_WARPS];
    __shared__ float sm_acc[ATT_WARPS][32 * ND_MAX];
    const int r = blockIdx.x, split = blockIdx.y;
    const int t = r / heads, h = r % heads;
    const int kvh = h / (heads / kv_heads);
    const int len = pos0 + t + 1;
    const int start = split * chunk, end = min(start + chunk, len);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nd = d >> 5;
    const int row = kv_heads * d;
    const float scale = rsqrtf((float)d);
    float qr[ND_MAX], acc[ND_MAX];
#pragma unroll
    for (int j = 0; j < ND_MAX; ++j) {
        qr[j] = j < nd ? q[(size_t)r * d + lane + 32 * j] : 0.f;
        acc[j] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    for (int p = start + warp; p < end; p += ATT_WARPS) {
        const float* kp = k + (size_t)p * row + kvh * d;
        float sdot = 0.f;
#pragma unroll
        for (int j = 0; j < ND_MAX; ++j)
            if (j < nd) sdot = fmaf(qr[j], kp[lane + 32 * j], sdot);
        const float s = warp_sum(sdot) * scale;
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new), e = expf(s - m_new);
        l = l * corr + e;
        const float* vp = v + (size_t)p * row + kvh * d;
#pragma unroll
        for (int j = 0; j < ND_MAX; ++j)
            if (j < nd) acc[j] = fmaf(e, vp[lane + 32 * j], acc[j] * corr);
        m = m_new;
    }
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < ND_MAX; ++j)
        if (j < nd) sm_acc[warp][lane + 32 * j] = acc[j];
    __syncthreads();
    float mm = NEG_INF;
    for (int w = 0; w < ATT_WARPS; ++w) mm = fmaxf(mm, sm_m[w]);
    float* out = part + ((size_t)r * splits + split) * (d + 2);
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float a = 0.f;
        for (int w = 0; w < ATT_WARPS; ++w)
            if (sm_m[w] != NEG_INF) a += sm_acc[w][c] * expf(sm_m[w] - mm);
        out[c] = a;
    }
    if (threadIdx.x == 0) {
        float ls = 0.f;
        for (int w = 0; w < ATT_WARPS; ++w)
            if (sm_m[w] != NEG_INF) ls += sm_l[w] * expf(sm_m[w] - mm);
        out[d] = mm;
        out[d + 1] = ls;
    }
}

// o[r][c] = sum_s exp(m_s - M) acc_s[c] / sum_s exp(m_s - M) l_s over the splits of row r.
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
