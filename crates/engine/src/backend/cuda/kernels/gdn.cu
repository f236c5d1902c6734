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
// The taps and the window are read before the wait for the previous kernel: the taps are weights,
// and only this layer's conv writes the window, a step or chunk earlier. That launch has finished:
// since then a whole pass through the other layers has run, including kernels that wait for
// their predecessor before letting the next one start (grid_dep), and kernels finish in order.
extern "C" __global__ void conv1d_silu(const float* __restrict__ x, const float* w, float* window,
                                       float* __restrict__ y, int tokens, int channels, int k) {
    pdl_launch_dependents();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int t0 = blockIdx.y * CONV_TOKENS, t1 = min(t0 + CONV_TOKENS, tokens);
    float h[MAX_CONV_K], taps[MAX_CONV_K], old[MAX_CONV_K];
    const bool live = c < channels;
#pragma unroll
    for (int j = 0; j < MAX_CONV_K; ++j) {
        taps[j] = live && j < k ? w[(size_t)j * channels + c] : 0.f;
        old[j] = (live && t0 == 0 && j < k - 1) ? window[(size_t)j * channels + c] : 0.f;
    }
    pdl_wait();
    if (!live) return;
#pragma unroll
    for (int j = 0; j < MAX_CONV_K; ++j) {
        // h[j] = input t0 - (k - 1) + j: from the window before the first token, else from x.
        const int i = t0 - (k - 1) + j;
        h[j] = j < k - 1 ? (i < 0 ? old[j] : x[(size_t)i * channels + c]) : 0.f;
    }
    // Unrolled (x and y do not alias) so that several tokens' loads are in flight at once.
#pragma unroll 4
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

// The gated delta rule for value head blockIdx.x, state rows [blockIdx.y * 8, +8), token by
// token:
//   q, k = l2norm(q), l2norm(k); q *= dk^-1/2
//   decay = exp(-exp(a_log) * softplus(a + dt_bias)); beta = sigmoid(b)
//   per row: s *= decay; delta = (v - s.k) * beta; s += delta * k; y = s.q
// Sixteen threads share a row, each holding a sixteenth of its keys in registers (float4 j of
// the thread with part p is keys 4 * (p + 16j) ..), so the row's dot products reduce over four
// shuffles. Each token is a chain of dependent steps, so what sets the pace is how many warps an
// SM can interleave: sixteen threads per row give 1,024 warps for the 35B's 4,096 state rows.
// Tokens arrive in chunks, copied asynchronously (cp.async) into one of two shared buffers while
// the block runs the previous chunk's steps; on arrival q and k are normalised and the gates
// computed, all tokens of the chunk at once.
// qkv is the conv output [T, 2*Hk*dk + Hv*dv]; a and b are [T, Hv]; y is [T, Hv*dv].
constexpr int GDN_TPR = 16;  // threads per state row
constexpr int GDN_THREADS = 128;
constexpr int GDN_ROWS = GDN_THREADS / GDN_TPR;

// One staged chunk: q and k [CHUNK][DK], v [CHUNK][GDN_ROWS], a then decay [CHUNK], b then
// beta [CHUNK].
template <int DK>
struct GdnChunk {
    static constexpr int CHUNK = 2048 / DK;  // 16 KB of q and k per buffer
    float4 q[CHUNK][DK / 4], k[CHUNK][DK / 4];
    float v[CHUNK][GDN_ROWS];
    float a[CHUNK], b[CHUNK];
};

template <int DK>
__device__ __forceinline__ void gdn_recurrence_impl(const float* qkv, const float* a, const float* b,
                                                    const float* a_log, const float* dt_bias, float* state,
                                                    float* y, int tokens, int hk, int hv, int dv, float l2_eps) {
    constexpr int D4 = DK / 4;              // float4 per q or k row
    constexpr int NJ = DK / (4 * GDN_TPR);  // float4 per thread
    constexpr int CHUNK = GdnChunk<DK>::CHUNK;
    __shared__ GdnChunk<DK> buf[2];
    const int h = blockIdx.x, tid = threadIdx.x;
    const int r = tid / GDN_TPR, part = tid % GDN_TPR, row = blockIdx.y * GDN_ROWS + r;
    const int kh = h / (hv / hk), kd = hk * DK, cols = 2 * kd + hv * dv;
    const bool live = row < dv;
    float4* st = reinterpret_cast<float4*>(state + ((size_t)h * dv + row) * DK);
    // The state and the gate parameters before the wait for the previous kernel, as conv1d_silu
    // reads its window: only this layer's recurrence writes the state, a step or chunk earlier.
    float4 s[NJ];
#pragma unroll
    for (int j = 0; j < NJ; ++j) s[j] = live ? st[part + GDN_TPR * j] : make_float4(0.f, 0.f, 0.f, 0.f);
    const float qscale = rsqrtf((float)DK), neg_a = -expf(a_log[h]), dtb = dt_bias[h];
    pdl_wait();
    auto fetch = [&](int t0, GdnChunk<DK>& c) {
        const int n = min(CHUNK, tokens - t0);
        for (int i = tid; i < n * D4; i += GDN_THREADS) {
            const int t = i / D4, x = i % D4;
            const float4* in = reinterpret_cast<const float4*>(qkv + (size_t)(t0 + t) * cols);
            cp_async16(&c.q[t][x], in + kh * D4 + x);
            cp_async16(&c.k[t][x], in + kd / 4 + kh * D4 + x);
        }
        for (int i = tid; i < n * GDN_ROWS; i += GDN_THREADS) {
            const int t = i / GDN_ROWS, vr = blockIdx.y * GDN_ROWS + i % GDN_ROWS;
            if (vr < dv) cp_async4(&c.v[t][i % GDN_ROWS], qkv + (size_t)(t0 + t) * cols + 2 * kd + h * dv + vr);
            else c.v[t][i % GDN_ROWS] = 0.f;
        }
        for (int t = tid; t < n; t += GDN_THREADS) {
            cp_async4(&c.a[t], a + (size_t)(t0 + t) * hv + h);
            cp_async4(&c.b[t], b + (size_t)(t0 + t) * hv + h);
        }
        cp_async_commit();
    };
    if (tokens > 0) fetch(0, buf[0]);
    for (int t0 = 0, ci = 0; t0 < tokens; t0 += CHUNK, ci ^= 1) {
        const int n = min(CHUNK, tokens - t0);
        GdnChunk<DK>& c = buf[ci];
        cp_async_wait_all();
        __syncthreads();  // the chunk has landed, and every thread is done with the other buffer
        // Normalise: sixteen threads per token (every lane takes part in the shuffles).
        for (int base = 0; base < n; base += GDN_ROWS) {
            const int t = base + tid / GDN_TPR;
            const bool ok = t < n;
            float qq = 0.f, kk = 0.f;
#pragma unroll
            for (int j = 0; j < NJ; ++j)
                if (ok) {
                    const float4 q = c.q[t][part + GDN_TPR * j], k = c.k[t][part + GDN_TPR * j];
                    qq += q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w;
                    kk += k.x * k.x + k.y * k.y + k.z * k.z + k.w * k.w;
                }
#pragma unroll
            for (int m = 1; m < GDN_TPR; m <<= 1) {
                qq += __shfl_xor_sync(0xffffffffu, qq, m);
                kk += __shfl_xor_sync(0xffffffffu, kk, m);
            }
            const float qn = qscale / sqrtf(qq + l2_eps), kn = 1.f / sqrtf(kk + l2_eps);
#pragma unroll
            for (int j = 0; j < NJ; ++j)
                if (ok) {
                    const float4 q = c.q[t][part + GDN_TPR * j], k = c.k[t][part + GDN_TPR * j];
                    c.q[t][part + GDN_TPR * j] = make_float4(q.x * qn, q.y * qn, q.z * qn, q.w * qn);
                    c.k[t][part + GDN_TPR * j] = make_float4(k.x * kn, k.y * kn, k.z * kn, k.w * kn);
                }
        }
        for (int t = tid; t < n; t += GDN_THREADS) {
            c.a[t] = expf(neg_a * softplus(c.a[t] + dtb));
            c.b[t] = sigmoid(c.b[t]);
        }
        __syncthreads();
        if (t0 + CHUNK < tokens) fetch(t0 + CHUNK, buf[ci ^ 1]);
        // The dot products keep four partial sums (one per float4 lane) so that consecutive
        // multiply-adds do not wait on each other.
#pragma unroll 2
        for (int t = 0; t < n; ++t) {
            const float decay = c.a[t], beta = c.b[t];
            float4 k[NJ];
            float4 kv4 = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                k[j] = c.k[t][part + GDN_TPR * j];
                s[j] = make_float4(s[j].x * decay, s[j].y * decay, s[j].z * decay, s[j].w * decay);
                kv4 = make_float4(fmaf(s[j].x, k[j].x, kv4.x), fmaf(s[j].y, k[j].y, kv4.y),
                                  fmaf(s[j].z, k[j].z, kv4.z), fmaf(s[j].w, k[j].w, kv4.w));
            }
            float kv = (kv4.x + kv4.y) + (kv4.z + kv4.w);
#pragma unroll
            for (int m = 1; m < GDN_TPR; m <<= 1) kv += __shfl_xor_sync(0xffffffffu, kv, m);
            const float delta = (c.v[t][r] - kv) * beta;
            float4 o4 = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const float4 q = c.q[t][part + GDN_TPR * j];
                s[j] = make_float4(fmaf(delta, k[j].x, s[j].x), fmaf(delta, k[j].y, s[j].y),
                                   fmaf(delta, k[j].z, s[j].z), fmaf(delta, k[j].w, s[j].w));
                o4 = make_float4(fmaf(s[j].x, q.x, o4.x), fmaf(s[j].y, q.y, o4.y), fmaf(s[j].z, q.z, o4.z),
                                 fmaf(s[j].w, q.w, o4.w));
            }
            float o = (o4.x + o4.y) + (o4.z + o4.w);
#pragma unroll
            for (int m = 1; m < GDN_TPR; m <<= 1) o += __shfl_xor_sync(0xffffffffu, o, m);
            if (part == 0 && live) y[(size_t)(t0 + t) * hv * dv + h * dv + row] = o;
        }
    }
    if (live)
#pragma unroll
        for (int j = 0; j < NJ; ++j) st[part + GDN_TPR * j] = s[j];
}

// Key dims 64, 128 and 256. Launch with 128 threads and (Hv, ceil(dv / 8)) blocks.
#define GDN_RECURRENCE(DK)                                                                                  \
    extern "C" __global__ void __launch_bounds__(GDN_THREADS)                                              \
        gdn_recurrence_k##DK(const float* qkv, const float* a, const float* b, const float* a_log,        \
                             const float* dt_bias, float* state, float* y, int tokens, int hk, int hv, int dv, \
                             float l2_eps) {                                                                \
        pdl_launch_dependents();                                                                            \
        gdn_recurrence_impl<DK>(qkv, a, b, a_log, dt_bias, state, y, tokens, hk, hv, dv, l2_eps);          \
    }
GDN_RECURRENCE(64)
GDN_RECURRENCE(128)
GDN_RECURRENCE(256)
