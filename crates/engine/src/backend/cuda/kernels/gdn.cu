// Gated DeltaNet: the causal depthwise conv with SiLU over the conv window, and the gated delta
// rule recurrence on the f32 state [Hv, Dv, Dk].

__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

constexpr int MAX_CONV_K = 8;

// One thread per channel c: y[t][c] = silu(sum_j w[j][c] * h[t + j]) where h is the window (the
// last K-1 inputs, oldest first) followed by x. The window then keeps the last K-1 inputs.
extern "C" __global__ void conv1d_silu(const float* x, const float* w, float* window, float* y, int tokens,
                                       int channels, int k) { grid_dep();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    float h[MAX_CONV_K];
    float taps[MAX_CONV_K];
#pragma unroll
    for (int j = 0; j < MAX_CONV_K; ++j) {
        taps[j] = j < k ? w[(size_t)j * channels + c] : 0.f;
        h[j] = j < k - 1 ? window[(size_t)j * channels + c] : 0.f;
    }
    for (int t = 0; t < tokens; ++t) {
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
#pragma unroll
    for (int j = 0; j < MAX_CONV_K; ++j)
        if (j < k - 1) window[(size_t)j * channels + c] = h[j];
}

// Keys per lane: dk = 32 * NK_MAX at most.
constexpr int NK_MAX = 8;
// Value rows of the state per warp, and warps per block.
constexpr int GDN_ROWS_PER_WARP = 8;
constexpr int GDN_WARPS = 4;

// The gated delta rule for value head blockIdx.x, state rows [blockIdx.y * 32, +32), token by token:
//   q, k = l2norm(q), l2norm(k); q *= dk^-1/2
//   decay = exp(-exp(a_log) * softplus(a + dt_bias)); beta = sigmoid(b)
//   per row: s *= decay; delta = (v - s.k) * beta; s += delta * k; y = s.q
// Each warp keeps its 8 rows of the state in registers (lane l holds keys l, l+32, ...).
// qkv is the conv output [T, 2*Hk*dk + Hv*dv]; a and b are [T, Hv]; y is [T, Hv*dv].
extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32)
    gdn_recurrence(const float* qkv, const float* a, const float* b, const float* a_log, const float* dt_bias,
                   float* state, float* y, int tokens, int hk, int hv, int dk, int dv, float l2_eps) { grid_dep();
    const int h = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = blockIdx.y * (GDN_WARPS * GDN_ROWS_PER_WARP) + warp * GDN_ROWS_PER_WARP;
    const int nk = dk >> 5;
    const int kh = h / (hv / hk);
    const int kd = hk * dk, cols = 2 * kd + hv * dv;
    float* st = state + (size_t)h * dv * dk;
    float s[GDN_ROWS_PER_WARP][NK_MAX];
#pragma unroll
    for (int r = 0; r < GDN_ROWS_PER_WARP; ++r)
#pragma unroll
        for (int j = 0; j < NK_MAX; ++j)
            s[r][j] = (j < nk && row0 + r < dv) ? st[(size_t)(row0 + r) * dk + lane + 32 * j] : 0.f;
    const float qscale = rsqrtf((float)dk);
    const float neg_a = -expf(a_log[h]);
    for (int t = 0; t < tokens; ++t) {
        const float* row = qkv + (size_t)t * cols;
        float q[NK_MAX], k[NK_MAX];
        float qq = 0.f, kk = 0.f;
#pragma unroll
        for (int j = 0; j < NK_MAX; ++j) {
            q[j] = j < nk ? row[kh * dk + lane + 32 * j] : 0.f;
            k[j] = j < nk ? row[kd + kh * dk + lane + 32 * j] : 0.f;
            qq = fmaf(q[j], q[j], qq);
            kk = fmaf(k[j], k[j], kk);
        }
        const float qn = qscale / sqrtf(warp_sum(qq) + l2_eps);
        const float kn = 1.f / sqrtf(warp_sum(kk) + l2_eps);
#pragma unroll
        for (int j = 0; j < NK_MAX; ++j) {
            q[j] *= qn;
            k[j] *= kn;
        }
        const float decay = expf(neg_a * softplus(a[(size_t)t * hv + h] + dt_bias[h]));
        const float beta = sigmoid(b[(size_t)t * hv + h]);
#pragma unroll
        for (int r = 0; r < GDN_ROWS_PER_WARP; ++r) {
            if (row0 + r >= dv) break;
            float kv = 0.f;
#pragma unroll
            for (int j = 0; j < NK_MAX; ++j) {
                s[r][j] *= decay;
                kv = fmaf(s[r][j], k[j], kv);
            }
            const float delta = (row[2 * kd + h * dv + row0 + r] - warp_sum(kv)) * beta;
            float o = 0.f;
#pragma unroll
            for (int j = 0; j < NK_MAX; ++j) {
                s[r][j] = fmaf(delta, k[j], s[r][j]);
                o = fmaf(s[r][j], q[j], o);
            }
            o = warp_sum(o);
            if (lane == 0) y[(size_t)t * hv * dv + h * dv + row0 + r] = o;
        }
    }
#pragma unroll
    for (int r = 0; r < GDN_ROWS_PER_WARP; ++r)
#pragma unroll
        for (int j = 0; j < NK_MAX; ++j)
            if (j < nk && row0 + r < dv) st[(size_t)(row0 + r) * dk + lane + 32 * j] = s[r][j];
}
