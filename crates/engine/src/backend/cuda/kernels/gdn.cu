// Gated DeltaNet: the causal depthwise conv with SiLU over the conv window, and the gated delta
// rule recurrence on the f32 state [Hv, Dv, Dk].

__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

constexpr int MAX_CONV_K = 8;
// Tokens a block of the conv takes: a thread slides its channel's window over them (over a
// quarter of them in the four-channel form).
constexpr int CONV_TOKENS = 64;

// silu(taps . h) for four channels over K consecutive inputs h[0..K) (oldest first): the conv's
// arithmetic, shared by conv1d_silu and the chunked recurrence's prep, which convolves its own
// loads (gdn_chunk_prep), so that both give the same bits.
template <int K>
__device__ __forceinline__ float4 conv_silu4(const float4 (&taps)[K], const float4* h) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < K; ++j) {
        acc.x += taps[j].x * h[j].x;
        acc.y += taps[j].y * h[j].y;
        acc.z += taps[j].z * h[j].z;
        acc.w += taps[j].w * h[j].w;
    }
    return make_float4(silu(acc.x), silu(acc.y), silu(acc.z), silu(acc.w));
}

// conv1d_silu (below) for a kernel of K taps with four channels a thread, 16 bytes a load and a
// store: a block's 128 threads are four runs of CONV_TOKENS / 4 tokens over its 128 channels. A
// channel a thread kept four tokens' 4-byte loads in flight and read ~2 TB/s over a 4,096-token
// chunk; this form takes the chunk's conv 4.0 -> 2.3 ms (docs/performance.md, run46). The same
// arithmetic per value as the channel-a-thread form. Needs channels % 4 == 0, 16-byte aligned
// buffers and 128 threads a block.
template <int K>
__device__ __forceinline__ void conv1d_silu_x4(const float* __restrict__ x, const float* w, const float* window,
                                               float* window_out, float* __restrict__ y, int tokens, int channels) {
    constexpr int RUN = CONV_TOKENS / 4;
    const int c = blockIdx.x * blockDim.x + 4 * (threadIdx.x & 31);
    const int t0 = blockIdx.y * CONV_TOKENS + (threadIdx.x >> 5) * RUN, t1 = min(t0 + RUN, tokens);
    // The window's reader and writer: the thread whose run starts at token 0.
    const bool live = c < channels, keeper = t0 == 0;
    float4 h[K], taps[K], old[K - 1];
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < K; ++j)
        taps[j] = live ? *reinterpret_cast<const float4*>(w + (size_t)j * channels + c) : zero;
#pragma unroll
    for (int j = 0; j < K - 1; ++j)
        old[j] = live && keeper ? *reinterpret_cast<const float4*>(window + (size_t)j * channels + c) : zero;
    pdl_wait();
    if (!live) return;
    auto ld = [&](int i) { return *reinterpret_cast<const float4*>(x + (size_t)i * channels + c); };
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {
        const int i = t0 - (K - 1) + j;
        h[j] = i < 0 ? old[j] : i < tokens ? ld(i) : zero;
    }
    // LOADS tokens' inputs requested before any of their outputs is stored (the compiler keeps
    // a load after an earlier store, so without the batch each thread had one load in flight).
    constexpr int LOADS = 4;
    for (int t = t0; t < t1; t += LOADS) {
        float4 next[LOADS];
#pragma unroll
        for (int u = 0; u < LOADS; ++u) next[u] = t + u < t1 ? ld(t + u) : zero;
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            if (t + u >= t1) break;
            h[K - 1] = next[u];
            *reinterpret_cast<float4*>(y + (size_t)(t + u) * channels + c) = conv_silu4<K>(taps, h);
#pragma unroll
            for (int j = 0; j + 1 < K; ++j) h[j] = h[j + 1];
        }
    }
    if (!keeper || !window_out) return;
    // The new window: entries tokens .. tokens + K - 2 of [old window | x].
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {
        const int i = tokens + j - (K - 1);
        float4 v = zero;
        if (i >= 0) {
            v = ld(i);
        } else {
#pragma unroll
            for (int m = 0; m < K - 1; ++m)
                if (m == tokens + j) v = old[m];
        }
        *reinterpret_cast<float4*>(window_out + (size_t)j * channels + c) = v;
    }
}

// Channel c's window after `tokens` inputs x [tokens][channels] into window_out: entries
// tokens .. tokens + k - 2 of [old window | x], old being the window before them.
__device__ __forceinline__ void conv_window_next(const float* __restrict__ x, const float (&old)[MAX_CONV_K],
                                                 float* window_out, int tokens, int channels, int c, int k) {
#pragma unroll
    for (int j = 0; j < MAX_CONV_K; ++j)
        if (j < k - 1) {
            const int i = tokens + j - (k - 1);
            window_out[(size_t)j * channels + c] = i < 0 ? old[tokens + j] : x[(size_t)i * channels + c];
        }
}

// y[t][c] = silu(sum_j w[j][c] * h[t + j]) where h is the window (the last K-1 inputs, oldest
// first) followed by x. One thread per (channel, run of CONV_TOKENS tokens): blockIdx.y picks the
// run. Only the first run's threads read the window, and they alone replace it with the last
// K-1 inputs afterwards (into `window_out`, the same buffer as `window` but where the window
// is kept elsewhere: null writes none), so no thread reads a window entry another has written.
// Launch with 128 threads and (ceil(channels / 128), ceil(tokens / CONV_TOKENS)) blocks.
// The taps and the window are read before the wait for the previous kernel: the taps are weights,
// and only this layer's conv writes the window, a step or chunk earlier. That launch has finished:
// since then a whole pass through the other layers has run, including kernels that wait for
// their predecessor before letting the next one start (grid_dep), and kernels finish in order.
extern "C" __global__ void conv1d_silu(const float* __restrict__ x, const float* w, const float* window,
                                       float* window_out, float* __restrict__ y, int tokens, int channels, int k) {
    pdl_launch_dependents();
    // Kernels of up to four taps (the models' four) take the vector form; larger ones, whose
    // registers would cost every launch its occupancy, keep a channel a thread.
    const unsigned long long addresses = (unsigned long long)x | (unsigned long long)w |
                                         (unsigned long long)window | (unsigned long long)window_out |
                                         (unsigned long long)y;
    if (blockDim.x == 128 && channels % 4 == 0 && (addresses & 15) == 0) {
        switch (k) {
            case 2: return conv1d_silu_x4<2>(x, w, window, window_out, y, tokens, channels);
            case 3: return conv1d_silu_x4<3>(x, w, window, window_out, y, tokens, channels);
            case 4: return conv1d_silu_x4<4>(x, w, window, window_out, y, tokens, channels);
        }
    }
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
    if (t0 != 0 || !window_out) return;
    conv_window_next(x, old, window_out, tokens, channels, c, k);
}

// The conv's window moved on over `tokens` inputs x [tokens][channels] without the conv, for
// a conv that its reader applies later (gdn_chunk_prep): the window before them copied to
// `saved` (the reader's), then replaced by entries tokens .. tokens + k - 2 of [window | x], as
// conv1d_silu replaces it. A thread a channel; ceil(channels / 256) blocks of 256 threads.
extern "C" __global__ void conv1d_window(const float* __restrict__ x, float* window, float* __restrict__ saved,
                                         int tokens, int channels, int k) {
    grid_dep();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    float old[MAX_CONV_K];
#pragma unroll
    for (int j = 0; j < MAX_CONV_K; ++j)
        if (j < k - 1) {
            old[j] = window[(size_t)j * channels + c];
            saved[(size_t)j * channels + c] = old[j];
        }
    conv_window_next(x, old, window, tokens, channels, c, k);
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

// One token's step of a state row, by the GDN_TPR threads that share it: s *= decay; delta =
// (v - s.k) * beta; s += delta * k; returns s.q (every thread of the row gets it). kp and qp hold
// the thread's float4s of the normalised key and query, STRIDE apart (GDN_TPR in the staged chunk,
// 1 in registers). The dot products keep four partial sums (one per float4 lane) so that
// consecutive multiply-adds do not wait on each other.
template <int NJ, int STRIDE>
__device__ __forceinline__ float gdn_token_step(float4 (&s)[NJ], const float4* kp, const float4* qp, float v,
                                                float decay, float beta) {
    float4 k[NJ];
    float4 kv4 = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        k[j] = kp[STRIDE * j];
        s[j] = make_float4(s[j].x * decay, s[j].y * decay, s[j].z * decay, s[j].w * decay);
        kv4 = make_float4(fmaf(s[j].x, k[j].x, kv4.x), fmaf(s[j].y, k[j].y, kv4.y), fmaf(s[j].z, k[j].z, kv4.z),
                          fmaf(s[j].w, k[j].w, kv4.w));
    }
    float kv = (kv4.x + kv4.y) + (kv4.z + kv4.w);
#pragma unroll
    for (int m = 1; m < GDN_TPR; m <<= 1) kv += __shfl_xor_sync(0xffffffffu, kv, m);
    const float delta = (v - kv) * beta;
    float4 o4 = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        const float4 q = qp[STRIDE * j];
        s[j] = make_float4(fmaf(delta, k[j].x, s[j].x), fmaf(delta, k[j].y, s[j].y), fmaf(delta, k[j].z, s[j].z),
                           fmaf(delta, k[j].w, s[j].w));
        o4 = make_float4(fmaf(s[j].x, q.x, o4.x), fmaf(s[j].y, q.y, o4.y), fmaf(s[j].z, q.z, o4.z),
                         fmaf(s[j].w, q.w, o4.w));
    }
    float o = (o4.x + o4.y) + (o4.z + o4.w);
#pragma unroll
    for (int m = 1; m < GDN_TPR; m <<= 1) o += __shfl_xor_sync(0xffffffffu, o, m);
    return o;
}

// One token's q and k normalised in place by the GDN_TPR threads that share them: q *= qscale / |q|,
// k /= |k| (l2_eps under each root). q and k hold the thread's float4s, STRIDE apart (as
// gdn_token_step reads them); with `ok` false the thread holds none (q and k are not read) but
// takes part in the shuffles.
template <int NJ, int STRIDE>
__device__ __forceinline__ void gdn_normalise_qk(float4* q, float4* k, bool ok, float qscale, float l2_eps) {
    float qq = 0.f, kk = 0.f;
#pragma unroll
    for (int j = 0; j < NJ; ++j)
        if (ok) {
            const float4 a = q[STRIDE * j], b = k[STRIDE * j];
            qq += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
            kk += b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
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
            const float4 a = q[STRIDE * j], b = k[STRIDE * j];
            q[STRIDE * j] = make_float4(a.x * qn, a.y * qn, a.z * qn, a.w * qn);
            k[STRIDE * j] = make_float4(b.x * kn, b.y * kn, b.z * kn, b.w * kn);
        }
}

// The thread's part of state row `row` of value head h into s, read before the wait for the
// previous kernel as conv1d_silu reads its window: only this layer's recurrence writes the state,
// a step or chunk earlier. Returns where the part goes back (gdn_store_state).
template <int DK, int NJ>
__device__ __forceinline__ float4* gdn_load_state(float* state, int h, int row, int part, int dv, bool live,
                                                  float4 (&s)[NJ]) {
    float4* st = reinterpret_cast<float4*>(state + ((size_t)h * dv + row) * DK);
#pragma unroll
    for (int j = 0; j < NJ; ++j) s[j] = live ? st[part + GDN_TPR * j] : make_float4(0.f, 0.f, 0.f, 0.f);
    return st;
}

template <int NJ>
__device__ __forceinline__ void gdn_store_state(float4* st, int part, bool live, const float4 (&s)[NJ]) {
    if (live)
#pragma unroll
        for (int j = 0; j < NJ; ++j) st[part + GDN_TPR * j] = s[j];
}

// The GDN output norm, rmsnorm(y_h) * w * silu(z_h) per head h, left to the output projection
// for one token (decode): the recurrence writes g = y * w * silu(z) and, per block (8 rows of a
// head), the sum of squares of its rows of y into partials[h * gridDim.y + blockIdx.y]; the
// out_proj's staging scales each head's g by rsqrt(mean(y_h^2) + eps) from its head's partials
// (HeadNorm, quant.cu). The SiLUs are taken once and the norm's launch is saved. g == nullptr:
// y is written as it is. Passed by value.
struct GdnGate {
    const float* z;
    const float* w;
    float* g;
    float* partials;
};

// gdn_recurrence_impl for one token (decode): the thread's parts of q and k straight into
// registers, normalised there by every row's 16 threads alike, and the gates computed by each
// thread, instead of the chunk's staging through shared memory and its two barriers. The same
// arithmetic as the token loop's, bit for bit.
template <int DK>
__device__ __forceinline__ void gdn_step_one(const float* qkv, const float* a, const float* b, const float* a_log,
                                             const float* dt_bias, float* state, float* y, int hk, int hv, int dv,
                                             float l2_eps, const GdnGate& gate) {
    constexpr int D4 = DK / 4, NJ = DK / (4 * GDN_TPR);
    const int h = blockIdx.x, tid = threadIdx.x;
    const int r = tid / GDN_TPR, part = tid % GDN_TPR, row = blockIdx.y * GDN_ROWS + r;
    const int kh = h / (hv / hk), kd = hk * DK;
    const bool live = row < dv;
    float4 s[NJ];
    float4* st = gdn_load_state<DK>(state, h, row, part, dv, live, s);
    const float qscale = rsqrtf((float)DK), neg_a = -expf(a_log[h]), dtb = dt_bias[h];
    const bool gates = gate.g && part == 0 && live;
    const float gain = gates ? gate.w[row] : 0.f;  // a weight: before the wait
    pdl_wait();
    const float4* in = reinterpret_cast<const float4*>(qkv);
    float4 q[NJ], k[NJ];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        q[j] = in[kh * D4 + part + GDN_TPR * j];
        k[j] = in[kd / 4 + kh * D4 + part + GDN_TPR * j];
    }
    const float v = live ? qkv[2 * kd + h * dv + row] : 0.f;
    const float zv = gates ? gate.z[(size_t)h * dv + row] : 0.f;  // with the inputs' loads
    const float decay = expf(neg_a * softplus(a[h] + dtb)), beta = sigmoid(b[h]);
    gdn_normalise_qk<NJ, 1>(q, k, true, qscale, l2_eps);
    const float o = gdn_token_step<NJ, 1>(s, k, q, v, decay, beta);
    if (gate.g) {
        if (gates) gate.g[(size_t)h * dv + row] = o * gain * silu(zv);
        gdn_store_state(st, part, live, s);
        // The block's sum of squares over its rows (one thread's o a row).
        const float sq = block_sum<false>(part == 0 && live ? o * o : 0.f);
        if (tid == 0) gate.partials[(size_t)h * gridDim.y + blockIdx.y] = sq;
        return;
    }
    if (part == 0 && live) y[(size_t)h * dv + row] = o;
    gdn_store_state(st, part, live, s);
}

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
    float4 s[NJ];
    float4* st = gdn_load_state<DK>(state, h, row, part, dv, live, s);  // and the gates' parameters: before the wait
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
            gdn_normalise_qk<NJ, GDN_TPR>(&c.q[t][part], &c.k[t][part], t < n, qscale, l2_eps);
        }
        for (int t = tid; t < n; t += GDN_THREADS) {
            c.a[t] = expf(neg_a * softplus(c.a[t] + dtb));
            c.b[t] = sigmoid(c.b[t]);
        }
        __syncthreads();
        if (t0 + CHUNK < tokens) fetch(t0 + CHUNK, buf[ci ^ 1]);
#pragma unroll 2
        for (int t = 0; t < n; ++t) {
            const float o =
                gdn_token_step<NJ, GDN_TPR>(s, &c.k[t][part], &c.q[t][part], c.v[t][r], c.a[t], c.b[t]);
            if (part == 0 && live) y[(size_t)(t0 + t) * hv * dv + h * dv + row] = o;
        }
    }
    gdn_store_state(st, part, live, s);
}

// Key dims 64, 128 and 256. Launch with 128 threads and (Hv, ceil(dv / 8)) blocks. A GdnGate
// (one token only) leaves the output norm to the out_proj.
#define GDN_RECURRENCE(DK)                                                                                  \
    extern "C" __global__ void __launch_bounds__(GDN_THREADS)                                              \
        gdn_recurrence_k##DK(const float* qkv, const float* a, const float* b, const float* a_log,        \
                             const float* dt_bias, float* state, float* y, int tokens, int hk, int hv, int dv, \
                             float l2_eps, GdnGate gate) {                                                  \
        pdl_launch_dependents();                                                                            \
        if (tokens == 1) gdn_step_one<DK>(qkv, a, b, a_log, dt_bias, state, y, hk, hv, dv, l2_eps, gate);   \
        else gdn_recurrence_impl<DK>(qkv, a, b, a_log, dt_bias, state, y, tokens, hk, hv, dv, l2_eps);     \
    }
GDN_RECURRENCE(64)
GDN_RECURRENCE(128)
GDN_RECURRENCE(256)

// ---- prefill: the same recurrence, a chunk of tokens at a time.
//
// Over a chunk of C tokens entered with state S0 (rows are value dims), the token loop above
// unrolls to products of whole matrices:
//   G[t][j] = decay_{j+1} ... decay_t (1 on the diagonal),  gamma_t = decay_0 ... decay_t,
//   (I + A) U = beta (V - gamma K S0^T),  A[t][j] = beta_t G[t][j] (k_t . k_j) for j < t,
//   O = gamma Q S0^T + P U,               P[t][j] = G[t][j] (q_t . k_j) for j <= t,
//   S_end = gamma_{C-1} S0 + U^T (G[C-1][.] K),
// where row t of U is the token's delta, beta_t (v_t - decay_t S_{t-1} k_t). Writing
// U = U' - W S0^T with W = (I + A)^-1 (beta gamma K) and U' = (I + A)^-1 (beta V), all but S0
// is known per chunk: gdn_chunk_prep computes it for every chunk at once, then gdn_chunk_state
// walks the chunks in order with three products each. Every stored value is f32 as in the token
// loop, and the products keep f32 accuracy (tf32 hi + lo, mma_tf32x3); each G[t][.] is the exp
// of a sum of log-decays taken backwards from the diagonal, so a short span keeps its precision
// however long the chunk's prefix is (exp of a difference of prefix sums would not).
constexpr int GDN_C = 64;  // tokens per chunk
constexpr int GDN_PREP_THREADS = 256;  // a value head's threads in gdn_chunk_prep
constexpr int GDN_STATE_ROWS = 32;  // state rows per gdn_chunk_state block
constexpr int GDN_STATE_THREADS = 256;
// On sm_90a gdn_chunk_state runs in clusters of two blocks (a pair of a head's row blocks), which
// share their stage copies (gdn_chunk_state_impl).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GDN_STATE_PAIRS 1
#define GDN_STATE_CLUSTER __cluster_dims__(1, 2, 1)
#else
#define GDN_STATE_PAIRS 0
#define GDN_STATE_CLUSTER
#endif

// gdn_chunk_prep's shared memory (floats) for `heads` value heads of one key head: k, q (then
// the first head's v) and the other heads' v [C][D + 4], each head's G (then A) [C][C + 4], and
// its log-decay, beta and gamma [C]; then the second head's W [C][D + 4] (the forward
// substitution's). 86 KiB at D = 128 for one head (two blocks an SM), 168 KiB for two.
__host__ __device__ constexpr int gdn_prep_smem_bytes(int d, int heads) {
    return 4 * ((2 * heads) * GDN_C * (d + 4) + heads * GDN_C * (GDN_C + 4) + 3 * heads * GDN_C);
}

// gdn_chunk_state's shared memory (4-byte words): one stage with the chunk's [W; gamma Q]
// [2C][D + 4] and the block's columns of U' [C][R + 4]; another with P [C][C + 4] and Kd
// [C][D + 8]; the block's state rows split in tf32 hi and lo [2][R][D + 4], and U^T split the
// same way [2][R][C + 4]; then two mbarriers (GDN_STATE_PAIRS). Each pitch puts the 32 lanes'
// fragment reads (and ldmatrix's 8 rows) in different banks. 176 KiB at D = 128.
__host__ __device__ constexpr int gdn_state_smem_bytes(int d) {
    return 4 * (2 * GDN_C * (d + 4) + GDN_C * (GDN_STATE_ROWS + 4) + GDN_C * (GDN_C + 4) + GDN_C * (d + 8) +
                2 * GDN_STATE_ROWS * (d + 4) + 2 * GDN_STATE_ROWS * (GDN_C + 4) + 4);
}

__device__ __forceinline__ float4 scale4(float4 a, float s) { return make_float4(a.x * s, a.y * s, a.z * s, a.w * s); }

// The conv that gdn_chunk_prep applies to its own loads (taps non-null; its kernel size is
// GDN_PREP_CONV_K): qkv holds the in-projection's rows before the conv, `taps` are the conv's
// weights [K][cols] and `window` the inputs before the prompt's first token [K - 1][cols],
// oldest first (conv1d_window saved them). Its outputs are conv1d_silu's, bit for bit
// (conv_silu4); the conv's launch, whose output the prep read back (2 x 134 MB at each layer of
// a 4,096-token chunk), is gone from 512 tokens (docs/performance.md, run57).
struct PrepConv {
    const float* taps;
    const float* window;
};
constexpr int GDN_PREP_CONV_K = 4;

// RUN consecutive tokens tf .. tf + RUN - 1 of the chunk starting at token t0 (n of them real),
// the float4 of columns [col, col + 4) of each, into out: the rows past the chunk's last token
// zero, and with the conv, each token's conv output (its K - 1 tokens before it loaded as
// well, from the window before the first).
template <int RUN>
__device__ __forceinline__ void prep_load_run(float4 (&out)[RUN], const float* qkv, const PrepConv& cv, int col,
                                              int cols, int t0, int tf, int n) {
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    auto at = [&](const float* base, long long row) {
        return *reinterpret_cast<const float4*>(base + row * cols + col);
    };
    if (!cv.taps) {
#pragma unroll
        for (int r = 0; r < RUN; ++r) out[r] = tf + r < n ? at(qkv, t0 + tf + r) : zero;
        return;
    }
    constexpr int K = GDN_PREP_CONV_K;
    float4 taps[K], h[RUN + K - 1];
#pragma unroll
    for (int j = 0; j < K; ++j) taps[j] = at(cv.taps, j);
    // h[j]: the chunk's token tf - (K - 1) + j, every load issued before the first sum.
#pragma unroll
    for (int j = 0; j < RUN + K - 1; ++j) {
        const int l = tf - (K - 1) + j, g = t0 + l;
        h[j] = l >= n ? zero : g < 0 ? at(cv.window, g + K - 1) : at(qkv, g);
    }
#pragma unroll
    for (int r = 0; r < RUN; ++r) out[r] = tf + r < n ? conv_silu4<K>(taps, h + r) : zero;
}

// One block per (chunk blockIdx.x, HEADS value heads HEADS blockIdx.y + j that share one key
// head), 256 HEADS threads. The key head's q and k, their norms and the products K K^T and
// Q K^T are the same for every value head of it, so a block of two heads does them once. Writes,
// per (chunk, head) at index chunk * Hv + head: wq [2C][D] (W, then gamma Q with q normalised
// and scaled as in the token loop), kd [C][D] (G[n-1][t] k_t, n the chunk's tokens), u [C][D]
// (U'), p [C][C] and gch (gamma_{n-1}). Rows past the last token are zero.
template <int D, int HEADS>
__device__ __forceinline__ void gdn_chunk_prep_impl(const float* qkv, PrepConv cv, const float* a, const float* b,
                                                    const float* a_log, const float* dt_bias, float* wq, float* kd,
                                                    float* u, float* p, float* gch, int tokens, int hk, int hv,
                                                    float l2_eps) {
    constexpr int THREADS = HEADS * GDN_PREP_THREADS, WARPS = THREADS / 32;
    static_assert(2 * D == GDN_PREP_THREADS, "one thread per column of [K | V] and head");
    constexpr int C = GDN_C, KP = D + 4, MP = C + 4, D4 = D / 4, NT = 8 / HEADS;
    static_assert(D4 == 32, "a lane a float4 of a row");
    // Each warp loads runs of consecutive tokens (with the conv, a run's first output needs the
    // K - 1 tokens before it): QK_RUN of q and of k, V_RUN of one head's v.
    constexpr int QK_RUN = C / WARPS, V_RUN = HEADS * C / WARPS, V_RUNS = C / V_RUN;
    extern __shared__ float4 gdn_smem4[];
    float* ks = reinterpret_cast<float*>(gdn_smem4);
    float* qs = ks + C * KP;  // q until its products are done, then head 0's v (head j's at qs + j C KP)
    float* m = qs + HEADS * C * KP;  // head j's G, then A, at m + j C MP
    float* lg = m + HEADS * C * MP;  // head j's at lg + j C, and the same for beta and gamma
    float* beta = lg + HEADS * C;
    float* gam = beta + HEADS * C;
    float* xk = gam + HEADS * C;  // heads 1.. W's rows [C][KP] in the forward substitution
    require_dynamic_smem(gdn_prep_smem_bytes(D, HEADS));
    const int ci = blockIdx.x, h0 = blockIdx.y * HEADS, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int t0 = ci * C, n = min(C, tokens - t0);
    const int kh = h0 / (hv / hk), kcols = hk * D, cols = 2 * kcols + hv * D;
    const float qscale = rsqrtf((float)D);
    const size_t blk0 = (size_t)ci * hv + h0;  // head h0 + j's outputs at blk0 + j
    auto vbuf = [&](int j) { return qs + j * C * KP; };  // head j's v, once q is done
    // Flat index e over the heads' [HEADS][C][D4] float4 of a [C][D] tile: head, token, float4.
    struct HeadTokenX {
        int j, t, x;
    };
    auto head_token_x = [](int e) { return HeadTokenX{e / (C * D4), (e % (C * D4)) / D4, e % D4}; };
    // q and k into shared memory; v waits in registers until q's products are done.
    {
        const int tf = warp * QK_RUN;
        float4 q4[QK_RUN], k4[QK_RUN];
        prep_load_run(q4, qkv, cv, kh * D + 4 * lane, cols, t0, tf, n);
        prep_load_run(k4, qkv, cv, kcols + kh * D + 4 * lane, cols, t0, tf, n);
#pragma unroll
        for (int r = 0; r < QK_RUN; ++r) {
            *reinterpret_cast<float4*>(qs + (tf + r) * KP + 4 * lane) = q4[r];
            *reinterpret_cast<float4*>(ks + (tf + r) * KP + 4 * lane) = k4[r];
        }
    }
    const int vj = warp / V_RUNS, vt = warp % V_RUNS * V_RUN;  // the warp's head and first token of v
    float4 v4[V_RUN];
    prep_load_run(v4, qkv, cv, 2 * kcols + (h0 + vj) * D + 4 * lane, cols, t0, vt, n);
    if (tid < HEADS * C) {
        const int j = tid / C, t = tid % C, h = h0 + j;
        const bool ok = t < n;
        lg[tid] = ok ? -expf(a_log[h]) * softplus(a[(size_t)(t0 + t) * hv + h] + dt_bias[h]) : 0.f;
        beta[tid] = ok ? sigmoid(b[(size_t)(t0 + t) * hv + h]) : 0.f;
    }
    __syncthreads();
    // q and k l2-normalised (q also scaled by D^-1/2), a warp per token; a warp's tokens unrolled
    // so that their chains of loads, shuffles and roots overlap (rows past the last token are
    // zero and stay zero: l2_eps, GDN_L2_EPS, is positive).
    static_assert(C % (THREADS / 32) == 0, "whole tokens a warp");
#pragma unroll
    for (int r = 0; r < C / (THREADS / 32); ++r) {
        const int t = warp + r * (THREADS / 32);
        float qq = 0.f, kk = 0.f;
        for (int x = lane; x < D; x += 32) {
            qq = fmaf(qs[t * KP + x], qs[t * KP + x], qq);
            kk = fmaf(ks[t * KP + x], ks[t * KP + x], kk);
        }
        qq = warp_sum(qq);
        kk = warp_sum(kk);
        const float qn = qscale / sqrtf(qq + l2_eps), kn = 1.f / sqrtf(kk + l2_eps);
        for (int x = lane; x < D; x += 32) {
            qs[t * KP + x] *= qn;
            ks[t * KP + x] *= kn;
        }
    }
    // Row t of each head's G walked backwards from the diagonal; gamma_t is the walk's end. Four
    // threads a row, thread q taking columns [16q, 16q + 16): it first sums the row's log decays
    // from t down to 16q + 16 (the walk's additions in the walk's order, so the same bits), then
    // walks its columns with their decays in registers. One thread a row walked 64 columns, each
    // step's load queued behind the previous step's store of an exp (docs/performance.md, run54).
    {
        static_assert(THREADS == 4 * HEADS * C, "four threads a row of G");
        const int j = tid / (4 * C), t = tid / 4 % C, c0 = 16 * (tid % 4);
        float* gt = m + j * C * MP + t * MP;
        const float* lj = lg + j * C;
        float seg = 0.f;
        for (int i = t; i >= c0 + 16; --i) seg += lj[i];
        float l[16];
#pragma unroll
        for (int u = 0; u < 16; ++u) l[u] = lj[c0 + u];
#pragma unroll
        for (int u = 15; u >= 0; --u)
            if (c0 + u <= t) {
                gt[c0 + u] = expf(seg);
                seg += l[u];
            }
        if (c0 == 0) gam[j * C + t] = expf(seg);
    }
    __syncthreads();
    for (int e = tid; e < HEADS * C * D4; e += THREADS) {
        const auto [j, t, x] = head_token_x(e);
        const float* g_end = m + j * C * MP + (n - 1) * MP;  // G[n-1][i]: decay from token i to the chunk's end
        const float4 q4 = *reinterpret_cast<const float4*>(qs + t * KP + 4 * x);
        const float4 k4 = *reinterpret_cast<const float4*>(ks + t * KP + 4 * x);
        reinterpret_cast<float4*>(wq + (blk0 + j) * 2 * C * D + (size_t)(C + t) * D)[x] = scale4(q4, gam[j * C + t]);
        reinterpret_cast<float4*>(kd + (blk0 + j) * C * D + (size_t)t * D)[x] = scale4(k4, t < n ? g_end[t] : 0.f);
    }
    // K K^T (warps 0-3 of each 8) and Q K^T (warps 4-7) on the tensor cores (tf32 split in hi +
    // lo, as in gdn_chunk_state): warp w takes rows 16 (w % 4) .. + 15 of the NT column tiles
    // from NT (w / 8), in acc[nt][0..3] at rows 16 (w % 4) + g (+8) and columns 8 (nt0 + nt) +
    // 2c (+1).
    const int g = lane >> 2, c = lane & 3, i0 = 16 * (warp % 4), nt0 = NT * (warp / 8);
    const bool kk_warp = warp % 8 < 4;
    const float* xs = kk_warp ? ks : qs;
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[nt][r] = 0.f;
#pragma unroll 2
    for (int k0 = 0; k0 < D; k0 += 8) {
        u32 ah[4], al[4];
        tf32_split_a(ah, al, xs + i0 * KP + k0, KP);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            u32 bh[2], bl[2];
            tf32_split_b_nk(bh, bl, ks + 8 * (nt0 + nt) * KP + k0, KP);
            mma_tf32x3(acc[nt], ah, al, bh, bl);
        }
    }
    __syncthreads();  // q has been read: the heads' v replace it
#pragma unroll
    for (int r = 0; r < V_RUN; ++r) *reinterpret_cast<float4*>(vbuf(vj) + (vt + r) * KP + 4 * lane) = v4[r];
    // Each head's P = G (Q K^T) on and below the diagonal, A = beta G (K K^T) below it; A
    // replaces G once every warp has read its G. The last head's A takes acc's place.
    float av_early[HEADS > 1 ? HEADS - 1 : 1][NT][4];
    auto av = [&](int j, int nt, int r) -> float& { return j == HEADS - 1 ? acc[nt][r] : av_early[j][nt][r]; };
#pragma unroll
    for (int j = 0; j < HEADS; ++j) {
        const float* gj = m + j * C * MP;
        const float* bj = beta + j * C;
        float* pj = p + (blk0 + j) * C * C;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; r += 2) {
                const int i = i0 + g + 8 * (r >> 1), col = 8 * (nt0 + nt) + 2 * c;
                const float g0 = gj[i * MP + col], g1 = gj[i * MP + col + 1];
                if (kk_warp) {
                    av(j, nt, r) = col < i ? bj[i] * g0 * acc[nt][r] : 0.f;
                    av(j, nt, r + 1) = col + 1 < i ? bj[i] * g1 * acc[nt][r + 1] : 0.f;
                } else {
                    *reinterpret_cast<float2*>(pj + i * C + col) = make_float2(
                        col <= i ? acc[nt][r] * g0 : 0.f, col + 1 <= i ? acc[nt][r + 1] * g1 : 0.f);
                }
            }
    }
    __syncthreads();  // every G has been read: A replaces G
    if (kk_warp)
#pragma unroll
        for (int j = 0; j < HEADS; ++j)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    m[j * C * MP + (i0 + g + 8 * (r >> 1)) * MP + 8 * (nt0 + nt) + 2 * c + (r & 1)] = av(j, nt, r);
    __syncthreads();
    // (I + A) [W | U'] = [beta gamma K | beta V] in four blocks of 16 rows. Warp w of head j owns
    // columns [32w, 32w + 32) of [K | V] throughout, so that its steps need only __syncwarp. For
    // block b (rows r0 = 16b ..):
    //   R = the rows' right-hand sides - A[rows, < r0] X[< r0], the product on the tensor cores
    //       (tf32 split in hi + lo, as above), written where the block's X rows go;
    //   X = the 16-row solve of (I + A[rows, rows]) X = R, a lane a column, in registers, stored
    //       back (for the next blocks' products) and to memory.
    // A is zero on and above the diagonal, so whole float4 of a row can be taken. X's rows are kept
    // in place of the right-hand sides: U' in the head's v, head 0's W in k (once every head has
    // read the block's k rows: one barrier a block), the other heads' W in xk.
    {
        const int j = tid / GDN_PREP_THREADS, n0 = 32 * ((tid % GDN_PREP_THREADS) / 32);
        const bool w_cols = n0 < D;  // the warp's columns are W's (K's side), else U's
        const float* rhs = w_cols ? ks + n0 : vbuf(j) + (n0 - D);
        float* x_rows = w_cols ? (j == 0 ? ks : xk + (j - 1) * C * KP) + n0 : vbuf(j) + (n0 - D);
        float* out = w_cols ? wq + (blk0 + j) * 2 * C * D + n0 : u + (blk0 + j) * C * D + (n0 - D);
        const float* mj = m + j * C * MP;
        const float* bj = beta + j * C;
        const float* gmj = gam + j * C;
        auto scale = [&](int i) { return w_cols ? bj[i] * gmj[i] : bj[i]; };
#pragma unroll
        for (int r0 = 0; r0 < C; r0 += 16) {
            float acc[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r) acc[nt][r] = 0.f;
            for (int k0 = 0; k0 < r0; k0 += 8) {
                u32 ah[4], al[4];
                tf32_split_a(ah, al, mj + r0 * MP + k0, MP);
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    u32 bh[2], bl[2];
                    tf32_split_b_kn(bh, bl, x_rows + k0 * KP + 8 * nt, KP);
                    mma_tf32x3(acc[nt], ah, al, bh, bl);
                }
            }
            float2 rs[4][2];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int i = r0 + g + 8 * h;
                    const float2 rhs2 = *reinterpret_cast<const float2*>(rhs + i * KP + 8 * nt + 2 * c);
                    const float si = scale(i);
                    rs[nt][h] = make_float2(rhs2.x * si - acc[nt][2 * h], rhs2.y * si - acc[nt][2 * h + 1]);
                }
            if (HEADS > 1) __syncthreads();  // every head has read the block's k rows
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    *reinterpret_cast<float2*>(x_rows + (r0 + g + 8 * h) * KP + 8 * nt + 2 * c) = rs[nt][h];
            __syncwarp();
            float x[16];
#pragma unroll
            for (int r = 0; r < 16; ++r) x[r] = x_rows[(r0 + r) * KP + lane];
#pragma unroll
            for (int r = 1; r < 16; ++r) {
                const float4* ar = reinterpret_cast<const float4*>(mj + (r0 + r) * MP + r0);
                float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll
                for (int q = 0; q < (r + 3) / 4; ++q) {
                    const float4 a4 = ar[q];
                    s0 = fmaf(a4.x, x[4 * q], s0);
                    s1 = fmaf(a4.y, x[4 * q + 1], s1);
                    s2 = fmaf(a4.z, x[4 * q + 2], s2);
                    s3 = fmaf(a4.w, x[4 * q + 3], s3);
                }
                x[r] -= (s0 + s1) + (s2 + s3);
            }
#pragma unroll
            for (int r = 0; r < 16; ++r) {
                x_rows[(r0 + r) * KP + lane] = x[r];
                out[(size_t)(r0 + r) * D + lane] = x[r];
            }
            __syncwarp();
        }
    }
    if (tid < HEADS) gch[blk0 + tid] = gam[tid * C + n - 1];
}

// One block per (value head blockIdx.x, state rows [blockIdx.y * R, +R)), 8 warps, walking the
// chunks in order with three products each, on the tensor cores (tf32, each operand split in
// hi + lo so that the products keep f32 accuracy, mma_tf32x3):
//   all warps:  [W; gamma Q] S^T, warp w taking rows 16w .. 16w + 15; warps 0-3 turn theirs
//               into U = U' - W S^T;
//   warps 4-7:  O = gamma Q S^T + P U, into y;
//   warps 0-3, at the same time: S = gamma_end S + U^T Kd, each holding S's rows 0-31 at keys
//               32w .. 32w + 31 in its accumulators from chunk to chunk.
// Each chunk's inputs arrive in two stages, each copied while the other stage's products run: by
// cp.async, or on sm_90a by bulk copies that a cluster of two blocks shares (GDN_STATE_PAIRS).
template <int D>
__device__ __forceinline__ void gdn_chunk_state_impl(const float* wq, const float* kd, const float* u,
                                                     const float* p, const float* gch, float* state, float* y,
                                                     int tokens, int hv) {
    constexpr int C = GDN_C, R = GDN_STATE_ROWS, T = GDN_STATE_THREADS, KP = D + 4, UP = R + 4, PP = C + 4,
                  KDP = D + 8, SP = D + 4, XP = C + 4;
    static_assert(D == 128 && C == 64 && R == 32 && T == 256, "the warp map below");
    extern __shared__ float4 gdn_smem4[];
    float* wqs = reinterpret_cast<float*>(gdn_smem4);  // stage 1: [W; gamma Q] [2C][KP]
    float* uin = wqs + 2 * C * KP;                      //          U' columns [C][UP]
    float* ps = uin + C * UP;                           // stage 2: P [C][PP]
    float* kds = ps + C * PP;                           //          Kd [C][KDP]
    u32* sh = reinterpret_cast<u32*>(kds + C * KDP);    // state rows, tf32 hi [R][SP]
    u32* sl = sh + R * SP;                              //                 lo
    u32* uh = sl + R * SP;                              // U^T, tf32 hi [R][XP]
    u32* ul = uh + R * XP;                              //      lo
    u64* full = reinterpret_cast<u64*>(ul + R * XP);    // pairs: stage 1's and stage 2's mbarriers
    require_dynamic_smem(gdn_state_smem_bytes(D));
    const int h = blockIdx.x, row0 = blockIdx.y * R, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, c = lane & 3;
    const int chunks = (tokens + C - 1) / C;
    float* st = state + ((size_t)h * D + row0) * D;
    // Shared addresses of the tiles the products read by ldmatrix, each with this lane's offset.
    const u32 a_wq = smem_addr(wqs) + ldsm_tf32_a_lane(KP), b_sh = smem_addr(sh) + ldsm_tf32_b2_lane(SP),
              b_sl = smem_addr(sl) + ldsm_tf32_b2_lane(SP), a_ps = smem_addr(ps) + ldsm_tf32_a_lane(PP),
              a_uh = smem_addr(uh) + ldsm_tf32_a_lane(XP), a_ul = smem_addr(ul) + ldsm_tf32_a_lane(XP),
              b_uh = smem_addr(uh) + ldsm_tf32_b2_lane(XP), b_ul = smem_addr(ul) + ldsm_tf32_b2_lane(XP);
    // Warps 0-3: S[16m + g (+8)][32w + 8n + 2c (+1)] in s[m][n][0..3], as mma accumulators.
    float s[2][4][4];
    auto store_state_split = [&]() {
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = 16 * m + g + 8 * (i >> 1), d = 32 * warp + 8 * n + 2 * c + (i & 1);
                    tf32_split(s[m][n][i], sh[r * SP + d], sl[r * SP + d]);
                }
    };
    if (warp < 4) {
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int r = 16 * m + g + 8 * half, d = 32 * warp + 8 * n + 2 * c;
                    const float2 v = *reinterpret_cast<const float2*>(st + (size_t)r * D + d);
                    s[m][n][2 * half] = v.x;
                    s[m][n][2 * half + 1] = v.y;
                }
        store_state_split();
    }
#if GDN_STATE_PAIRS
    // A cluster is a pair of a head's row blocks, which read the same [W; gamma Q], P and Kd: each
    // block copies half of their rows into both blocks' shared memory (bulk copies, multicast), and
    // its own columns of U' into its own. A stage's copies land on its mbarrier (full[0], full[1]),
    // phase ci for chunk ci; they start only once both blocks are done with the stage's previous
    // chunk (cluster_sync), since they rewrite the other block's copy too.
    const u32 rank = cluster_rank(), full1 = smem_addr(&full[0]), full2 = smem_addr(&full[1]);
    if (tid == 0) {
        mbar_init(&full[0], 1);
        mbar_init(&full[1], 1);
        fence_mbarrier_init();
    }
    cluster_sync();
    auto fetch_stage1 = [&](int ci) {
        const size_t blk = (size_t)ci * hv + h;
        if (tid == 0) mbar_arrive_expect(full1, 4 * (2 * C * D + C * R));
        const int r = 2 * tid + rank;  // of the 2C rows of [W; gamma Q]
        if (tid < C)
            bulk_copy_multicast(smem_addr(wqs + r * KP), wq + (blk * 2 * C + r) * D, 4 * D, full1, 0x3);
        else if (tid < 2 * C)
            bulk_copy(smem_addr(uin + (tid - C) * UP), u + (blk * C + tid - C) * D + row0, 4 * R, full1);
    };
    auto fetch_stage2 = [&](int ci) {
        const size_t blk = (size_t)ci * hv + h;
        if (tid == 0) mbar_arrive_expect(full2, 4 * (C * C + C * D));
        const int r = 2 * (tid % (C / 2)) + rank;  // of P's C rows (tid < C / 2), then Kd's
        if (tid < C / 2)
            bulk_copy_multicast(smem_addr(ps + r * PP), p + (blk * C + r) * C, 4 * C, full2, 0x3);
        else if (tid < C)
            bulk_copy_multicast(smem_addr(kds + r * KDP), kd + (blk * C + r) * D, 4 * D, full2, 0x3);
    };
    auto wait_stage1 = [&](int ci) { mbar_wait(full1, ci & 1); };
    auto wait_stage2 = [&](int ci) { mbar_wait(full2, ci & 1); };
    // Both blocks are done with a stage: each block's own reads ordered by its barrier, as a
    // cp.async pipeline's are, and the other block's by the cluster's.
    auto stage_read = [&]() {
        __syncthreads();
        cluster_sync_relaxed();
    };
#else
    (void)full;
    auto fetch_stage1 = [&](int ci) {
        const size_t blk = (size_t)ci * hv + h;
        cp_async_tile<2 * C, D, D, KP, T>(smem_addr(wqs), wq + blk * 2 * C * D);
        cp_async_tile<C, R, D, UP, T>(smem_addr(uin), u + blk * C * D + row0);
        cp_async_commit();
    };
    auto fetch_stage2 = [&](int ci) {
        const size_t blk = (size_t)ci * hv + h;
        cp_async_tile<C, C, C, PP, T>(smem_addr(ps), p + blk * C * C);
        cp_async_tile<C, D, D, KDP, T>(smem_addr(kds), kd + blk * C * D);
        cp_async_commit();
    };
    // Stage 1 of chunk ci is copied after stage 2 of ci - 1, so at most the later one is pending.
    auto wait_stage1 = [&](int) {
        cp_async_wait_one();
        __syncthreads();
    };
    // Stage 2 of chunk ci is followed by stage 1 of ci + 1, where there is one.
    auto wait_stage2 = [&](int ci) {
        if (ci + 1 < chunks) cp_async_wait_one();
        else cp_async_wait_all();
        __syncthreads();
    };
    auto stage_read = [&]() { __syncthreads(); };
#endif
    if (chunks > 0) {
        fetch_stage1(0);
        fetch_stage2(0);
    }
    for (int ci = 0; ci < chunks; ++ci) {
        wait_stage1(ci);
        // gamma_end, for the state's update after this product: its load overlaps the product.
        const float gend = gch[(size_t)ci * hv + h];
        // [W; gamma Q] S^T: rows 16 * warp + (g, g + 8), state rows 8n + (2c, 2c + 1).
        float acc[4][4];
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;
#pragma unroll
        for (int k0 = 0; k0 < D; k0 += 8) {
            u32 a[4], ah[4], al[4], bh[4][2], bl[4][2];
            ldsm_x4_at(a, a_wq + 4 * (16 * warp * KP + k0));
            tf32_split4(a, ah, al);
#pragma unroll
            for (int n2 = 0; n2 < 2; ++n2) {
                u32 x[4];
                ldsm_x4_at(x, b_sh + 4 * (16 * n2 * SP + k0));
                bh[2 * n2][0] = x[0], bh[2 * n2][1] = x[1], bh[2 * n2 + 1][0] = x[2], bh[2 * n2 + 1][1] = x[3];
                ldsm_x4_at(x, b_sl + 4 * (16 * n2 * SP + k0));
                bl[2 * n2][0] = x[0], bl[2 * n2][1] = x[1], bl[2 * n2 + 1][0] = x[2], bl[2 * n2 + 1][1] = x[3];
            }
#pragma unroll
            for (int n = 0; n < 4; ++n) mma_tf32x3(acc[n], ah, al, bh[n], bl[n]);
        }
        if (warp < 4) {
            // U = U' - W S^T, stored transposed (state row, token): the layout in which both of
            // its products read it by ldmatrix.
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int t = 16 * warp + g + 8 * (i >> 1), r = 8 * n + 2 * c + (i & 1);
                    tf32_split(uin[t * UP + r] - acc[n][i], uh[r * XP + t], ul[r * XP + t]);
                }
        }
        stage_read();  // U is complete, and stage 1 has been read
        if (ci + 1 < chunks) fetch_stage1(ci + 1);
        wait_stage2(ci);
        if (warp >= 4) {
            // O = gamma Q S^T + P U for tokens 16 * (warp - 4) + (g, g + 8); P is zero right of
            // the tile's last token.
            const int t0 = 16 * (warp - 4);
            for (int k0 = 0; k0 < t0 + 16; k0 += 8) {
                u32 a[4], ah[4], al[4];
                ldsm_x4_at(a, a_ps + 4 * (t0 * PP + k0));
                tf32_split4(a, ah, al);
#pragma unroll
                for (int n2 = 0; n2 < 2; ++n2) {
                    u32 bh[4], bl[4];
                    ldsm_x4_at(bh, b_uh + 4 * (16 * n2 * XP + k0));
                    ldsm_x4_at(bl, b_ul + 4 * (16 * n2 * XP + k0));
                    mma_tf32x3(acc[2 * n2], ah, al, bh, bl);
                    mma_tf32x3(acc[2 * n2 + 1], ah, al, bh + 2, bl + 2);
                }
            }
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int t = ci * C + t0 + g + 8 * half;
                if (t < tokens)
#pragma unroll
                    for (int n = 0; n < 4; ++n)
                        *reinterpret_cast<float2*>(y + (size_t)t * hv * D + h * D + row0 + 8 * n + 2 * c) =
                            make_float2(acc[n][2 * half], acc[n][2 * half + 1]);
            }
        } else {
            // S = gamma_end S + U^T Kd.
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int n = 0; n < 4; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) s[m][n][i] *= gend;
#pragma unroll
            for (int k0 = 0; k0 < C; k0 += 8) {
                u32 ah[2][4], al[2][4];
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    ldsm_x4_at(ah[m], a_uh + 4 * (16 * m * XP + k0));
                    ldsm_x4_at(al[m], a_ul + 4 * (16 * m * XP + k0));
                }
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    u32 bh[2], bl[2];
                    tf32_split_b_kn(bh, bl, kds + k0 * KDP + 32 * warp + 8 * n, KDP);
#pragma unroll
                    for (int m = 0; m < 2; ++m) mma_tf32x3(s[m][n], ah[m], al[m], bh, bl);
                }
            }
            store_state_split();
        }
        stage_read();  // stage 2 and U have been read; the state's split is written
        if (ci + 1 < chunks) fetch_stage2(ci + 1);
    }
#if GDN_STATE_PAIRS
    // Neither block of a pair exits while a copy it started may still be landing in the other.
    cluster_sync_relaxed();
#endif
    if (warp < 4)
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int r = 16 * m + g + 8 * half, d = 32 * warp + 8 * n + 2 * c;
                    *reinterpret_cast<float2*>(st + (size_t)r * D + d) = make_float2(s[m][n][2 * half], s[m][n][2 * half + 1]);
                }
}

// Key and value dims 128. gdn_chunk_prep: (ceil(T / C), Hv) blocks of 256 threads with
// gdn_prep_smem_bytes(128, 1); gdn_chunk_state: (Hv, 128 / R) blocks of 256 threads with
// gdn_state_smem_bytes(128), after it on the same stream. qkv is the conv's output, or with
// `cv.taps` its input (PrepConv).
extern "C" __global__ void __launch_bounds__(GDN_PREP_THREADS, 2)
    gdn_chunk_prep_d128(const float* qkv, PrepConv cv, const float* a, const float* b, const float* a_log,
                        const float* dt_bias, float* wq, float* kd, float* u, float* p, float* gch, int tokens, int hk,
                        int hv, float l2_eps) {
    grid_dep();
    gdn_chunk_prep_impl<128, 1>(qkv, cv, a, b, a_log, dt_bias, wq, kd, u, p, gch, tokens, hk, hv, l2_eps);
}
// Value heads in pairs of one key head (Hv / Hk even): (ceil(T / C), Hv / 2) blocks of 512
// threads with gdn_prep_smem_bytes(128, 2).
extern "C" __global__ void __launch_bounds__(2 * GDN_PREP_THREADS, 1)
    gdn_chunk_prep_d128_pairs(const float* qkv, PrepConv cv, const float* a, const float* b, const float* a_log,
                              const float* dt_bias, float* wq, float* kd, float* u, float* p, float* gch, int tokens,
                              int hk, int hv, float l2_eps) {
    grid_dep();
    gdn_chunk_prep_impl<128, 2>(qkv, cv, a, b, a_log, dt_bias, wq, kd, u, p, gch, tokens, hk, hv, l2_eps);
}
extern "C" __global__ void __launch_bounds__(GDN_STATE_THREADS) GDN_STATE_CLUSTER
    gdn_chunk_state_d128(const float* wq, const float* kd, const float* u, const float* p, const float* gch,
                         float* state, float* y, int tokens, int hv) {
    grid_dep();
    gdn_chunk_state_impl<128>(wq, kd, u, p, gch, state, y, tokens, hv);
}
