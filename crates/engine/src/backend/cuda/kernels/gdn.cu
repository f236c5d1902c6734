// Gated DeltaNet: the causal depthwise conv with SiLU over the conv window, and the gated delta
// rule recurrence on the f32 state [Hv, Dv, Dk].

__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

constexpr int MAX_CONV_K = 8;
// Tokens per thread of the conv: a thread slides its channel's window over them.
constexpr int CONV_TOKENS = 64;

// y[t][c] = silu(sum_j w[j][c] * h[t + j]) where h is the window (the last K-1 inputs, oldest
// first) followed by x. One thread per (channel, run of CONV_TOKENS tokens): blockIdx.y picks the
// run. Only the first run's threads read the window, and they alone replace it with the last
// K-1 inputs afterwards, so no thread reads a window entry another has written. Launch with
// 128 threads and (ceil(channels / 128), ceil(tokens / CONV_TOKENS)) blocks.
extern "C" __global__ void conv1d_silu(const float* x, const float* w, float* window, float* y, int tokens,
                                       int channels, int k) { grid_dep();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    const int t0 = blockIdx.y * CONV_TOKENS, t1 = min(t0 + CONV_TOKENS, tokens);
    float h[MAX_CONV_K], taps[MAX_CONV_K], old[MAX_CONV_K];
#pragma unroll
    for (int j = 0; j < MAX_CONV_K; ++j) {
        taps[j] = j < k ? w[(size_t)j * channels + c] : 0.f;
        // h[j] = input t0 - (k - 1) + j: from the window before the first token, else from x.
        const int i = t0 - (k - 1) + j;
        old[j] = (t0 == 0 && j < k - 1) ? window[(size_t)j * channels + c] : 0.f;
        h[j] = j < k - 1 ? (i < 0 ? old[j] : x[(size_t)i * channels + c]) : 0.f;
    }
    for (int t = t0; t < t1; ++t) {
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < MAX_CONV_K; ++j) {
            if (j == k - 1) h[j] = x[(size_t)t * channels + c];
            if (j < k) acc += taps[j] * h[j];
        }
        y[(size_t)t * channels + c] = silu(acc);
#pragma unroll
        for (int j = 0; j + 1 < MAX_CONV_K; ++j) h[j] = h[j + 1];
    }
    if (t0 != 0) return;
    // The new window: entries tokens .. tokens + k - 2 of [old window | x].
#pragma unroll
    for (int j = 0; j < MAX_CONV_K; ++j)
        if (j < k - 1) {
            const int i = tokens + j - (k - 1);
            window[(size_t)j * channels + c] = i < 0 ? old[tokens + j] : x[(size_t)i * channels + c];
        }
}

// The gated delta rule for value head blockIdx.x, state rows [blockIdx.y * 32, +32), token by
// token:
//   q, k = l2norm(q), l2norm(k); q *= dk^-1/2
//   decay = exp(-exp(a_log) * softplus(a + dt_bias)); beta = sigmoid(b)
//   per row: s *= decay; delta = (v - s.k) * beta; s += delta * k; y = s.q
// Four threads share a row, each holding a quarter of its keys in registers (float4 j of the
// thread with part p is keys 4 * (p + 4j) ..), so the row's dot products reduce over two
// shuffles. The block stages a chunk of tokens' q, k (normalised once, by one warp per token),
// v and gates in shared memory, then runs the chunk's dependent steps from there.
// qkv is the conv output [T, 2*Hk*dk + Hv*dv]; a and b are [T, Hv]; y is [T, Hv*dv].
constexpr int GDN_ROWS = 32;
constexpr int GDN_THREADS = 4 * GDN_ROWS;

template <int DK>
__device__ __forceinline__ void gdn_recurrence_impl(const float* qkv, const float* a, const float* b,
                                                    const float* a_log, const float* dt_bias, float* state,
                                                    float* y, int tokens, int hk, int hv, int dv, float l2_eps) {
    constexpr int D4 = DK / 4;        // float4 per q or k row
    constexpr int NJ = DK / 16;       // float4 per thread
    constexpr int CHUNK = 4096 / DK;  // tokens staged at once (32 KB of q and k)
    __shared__ float4 qs[CHUNK][D4], ks[CHUNK][D4];
    __shared__ float vs[CHUNK][GDN_ROWS];
    __shared__ float decay_s[CHUNK], beta_s[CHUNK];
    const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int r = tid >> 2, part = tid & 3, row = blockIdx.y * GDN_ROWS + r;
    const int kh = h / (hv / hk), kd = hk * DK, cols = 2 * kd + hv * dv;
    const bool live = row < dv;
    float4* st = reinterpret_cast<float4*>(state + ((size_t)h * dv + row) * DK);
    float4 s[NJ];
#pragma unroll
    for (int j = 0; j < NJ; ++j) s[j] = live ? st[part + 4 * j] : make_float4(0.f, 0.f, 0.f, 0.f);
    const float qscale = rsqrtf((float)DK), neg_a = -expf(a_log[h]), dtb = dt_bias[h];
    for (int t0 = 0; t0 < tokens; t0 += CHUNK) {
        const int n = min(CHUNK, tokens - t0);
        __syncthreads();  // the previous chunk is done with the staged values
        for (int i = tid; i < n * D4; i += GDN_THREADS) {
            const int t = i / D4, c = i % D4;
            const float4* in = reinterpret_cast<const float4*>(qkv + (size_t)(t0 + t) * cols);
            qs[t][c] = in[kh * D4 + c];
            ks[t][c] = in[kd / 4 + kh * D4 + c];
        }
        for (int i = tid; i < n * GDN_ROWS; i += GDN_THREADS) {
            const int t = i / GDN_ROWS, vr = blockIdx.y * GDN_ROWS + i % GDN_ROWS;
            vs[t][i % GDN_ROWS] = vr < dv ? qkv[(size_t)(t0 + t) * cols + 2 * kd + h * dv + vr] : 0.f;
        }
        __syncthreads();
        for (int t = warp; t < n; t += GDN_THREADS / 32) {
            float qq = 0.f, kk = 0.f;
            for (int c = lane; c < D4; c += 32) {
                const float4 q = qs[t][c], k = ks[t][c];
                qq += q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w;
                kk += k.x * k.x + k.y * k.y + k.z * k.z + k.w * k.w;
            }
            const float qn = qscale / sqrtf(warp_sum(qq) + l2_eps), kn = 1.f / sqrtf(warp_sum(kk) + l2_eps);
            for (int c = lane; c < D4; c += 32) {
                const float4 q = qs[t][c], k = ks[t][c];
                qs[t][c] = make_float4(q.x * qn, q.y * qn, q.z * qn, q.w * qn);
                ks[t][c] = make_float4(k.x * kn, k.y * kn, k.z * kn, k.w * kn);
            }
            if (lane == 0) {
                decay_s[t] = expf(neg_a * softplus(a[(size_t)(t0 + t) * hv + h] + dtb));
                beta_s[t] = sigmoid(b[(size_t)(t0 + t) * hv + h]);
            }
        }
        __syncthreads();
        for (int t = 0; t < n; ++t) {
            const float decay = decay_s[t], beta = beta_s[t];
            float4 k[NJ];
            float kv = 0.f;
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                k[j] = ks[t][part + 4 * j];
                s[j] = make_float4(s[j].x * decay, s[j].y * decay, s[j].z * decay, s[j].w * decay);
                kv = fmaf(s[j].x, k[j].x, fmaf(s[j].y, k[j].y, fmaf(s[j].z, k[j].z, fmaf(s[j].w, k[j].w, kv))));
            }
            kv += __shfl_xor_sync(0xffffffffu, kv, 1);
            kv += __shfl_xor_sync(0xffffffffu, kv, 2);
            const float delta = (vs[t][r] - kv) * beta;
            float o = 0.f;
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const float4 q = qs[t][part + 4 * j];
                s[j] = make_float4(fmaf(delta, k[j].x, s[j].x), fmaf(delta, k[j].y, s[j].y),
                                   fmaf(delta, k[j].z, s[j].z), fmaf(delta, k[j].w, s[j].w));
                o = fmaf(s[j].x, q.x, fmaf(s[j].y, q.y, fmaf(s[j].z, q.z, fmaf(s[j].w, q.w, o))));
            }
            o += __shfl_xor_sync(0xffffffffu, o, 1);
            o += __shfl_xor_sync(0xffffffffu, o, 2);
            if (part == 0 && live) y[(size_t)(t0 + t) * hv * dv + h * dv + row] = o;
        }
    }
    if (live)
#pragma unroll
        for (int j = 0; j < NJ; ++j) st[part + 4 * j] = s[j];
}

// Key dims 64, 128 and 256. Launch with 128 threads and (Hv, ceil(dv / 32)) blocks.
#define GDN_RECURRENCE(DK)                                                                                  \
    extern "C" __global__ void __launch_bounds__(GDN_THREADS)                                              \
        gdn_recurrence_k##DK(const float* qkv, const float* a, const float* b, const float* a_log,        \
                             const float* dt_bias, float* state, float* y, int tokens, int hk, int hv, int dv, \
                             float l2_eps) {                                                                \
        grid_dep();                                                                                         \
        gdn_recurrence_impl<DK>(qkv, a, b, a_log, dt_bias, state, y, tokens, hk, hv, dv, l2_eps);          \
    }
GDN_RECURRENCE(64)
GDN_RECURRENCE(128)
GDN_RECURRENCE(256)
