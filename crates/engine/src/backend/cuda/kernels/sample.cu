// Token sampling where the logits are: the host sampler's rule (engine/src/sampler.rs, `choose`)
// with the host's draw u, so that a sampled decode step reads back one token id rather than the
// vocabulary's row. One block of SAMPLE_THREADS threads does everything: the row (248,320 floats,
// 1 MB) stays in L2 between its passes, and one block needs no grid-wide ordering.
//
//   penalties   logits[id] -= amount for each generated token, in place (the host falls back to
//               the row already penalised);
//   greedy      T <= 0 (penalties given): the first maximum, NaN never chosen;
//   whole row   no top-k below the vocabulary and top-p 1: the weights exp((l - max) / T), zero
//               below the min-p cutoff, summed in f64; each thread owns a contiguous slice of
//               ids, so the block's inclusive scan of the slices' sums orders the intervals as
//               the host's walk does, and the thread whose interval holds u * total walks it;
//   candidates  the K = min(limit, SAMPLE_MAX_CAND) largest logits (ties to the lower id): a
//               radix select of the K-th largest key, a compaction in id order, a bitonic sort;
//               then the host's softmax, top-p and min-p over them by one thread, in its order.
//               Where the host would widen past SAMPLE_MAX_CAND candidates (the nucleus is not
//               inside them, or top-k above them without top-p), out[1] = 1 asks for the row.
//
// out[0] = the token, out[1] = 0 (chosen) or 1 (the host samples the row).
constexpr int SAMPLE_THREADS = 1024;
constexpr int SAMPLE_MAX_CAND = 4096;  // sampler.rs TOP_P_PREFILTER

// The inverse of common.cuh's ordered_bits.
__device__ __forceinline__ float from_ordered_bits(u32 o) {
    return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}

// Scratch for the block-wide reductions and scans below: 32 8-byte slots, one per warp.
__device__ __forceinline__ u64* sample_scratch() {
    __shared__ u64 slots[32];
    return slots;
}

// Inclusive scan over the block (1024 threads): thread t gets v_0 + ... + v_t, the warps' sums
// added in order.
template <typename T>
__device__ __forceinline__ T block_inclusive_scan(T v) {
    T* part = reinterpret_cast<T*>(sample_scratch());
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        const T n = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += n;
    }
    __syncthreads();  // `part` may still be read by a previous call
    if (lane == 31) part[warp] = v;
    __syncthreads();
    T before = 0;
    for (int w = 0; w < warp; ++w) before += part[w];
    return v + before;
}

template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op) {
    T* part = reinterpret_cast<T*>(sample_scratch());
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    T r = part[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) r = op(r, part[w]);
    return r;
}

__device__ __forceinline__ void sample_done(int* out, int token, int status) {
    if (threadIdx.x == 0) {
        out[0] = token;
        out[1] = status;
    }
}

// The first maximum's id (0 when every value is NaN), as the host's argmax.
__device__ __forceinline__ int sample_argmax(const float* logits, int n) {
    u64 best = 0;
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        const float v = logits[c];
        if (v == v) best = max(best, pack_max(v, c));
    }
    best = block_reduce(best, [](u64 a, u64 b) { return max(a, b); });
    return best ? (int)(0xffffffffu - (u32)best) : 0;
}

__device__ __forceinline__ void sample_whole_row(const float* logits, int n, float temperature, float min_p,
                                                 double u, int* out, double* incl) {
    const int tid = threadIdx.x, chunk = (n + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int c0 = min(n, tid * chunk), c1 = min(n, c0 + chunk);
    float m = NEG_INF;
    for (int c = tid; c < n; c += blockDim.x) m = fmaxf(m, logits[c]);  // fmaxf skips NaN
    m = block_reduce(m, [](float a, float b) { return fmaxf(a, b); });
    // min-p keeps p >= min_p * p_max, i.e. logit >= max + T ln(min_p); NaN fails every test.
    const float cutoff = min_p > 0.f ? m + temperature * logf(min_p) : NEG_INF;
    auto weight = [&](float v) { return v >= cutoff ? expf((v - m) / temperature) : 0.f; };
    double s = 0.0;
    for (int c = c0; c < c1; ++c) s += (double)weight(logits[c]);
    const double hi = block_inclusive_scan(s);
    incl[tid] = hi;
    __syncthreads();
    const double total = incl[SAMPLE_THREADS - 1], lo = tid ? incl[tid - 1] : 0.0;
    if (!(total > 0.0)) {  // no weight at all: the host takes the argmax
        const int t = sample_argmax(logits, n);
        sample_done(out, t, 0);
        return;
    }
    const double target = u * total;
    // The slices' intervals [lo, hi) tile [0, total): exactly one holds the target, unless
    // rounding put it at total, where the host takes the last positive weight.
    const int last_positive_slice = block_reduce(s > 0.0 ? tid : -1, [](int a, int b) { return max(a, b); });
    const bool mine = s > 0.0 && lo <= target && target < hi;
    const bool none = __syncthreads_or(mine) == 0;
    if (mine || (none && tid == last_positive_slice)) {
        double r = target - lo;
        int pick = -1, last = -1;
        for (int c = c0; c < c1; ++c) {
            const float w = weight(logits[c]);
            if (w > 0.f) {
                if (mine && r < (double)w) {
                    pick = c;
                    break;
                }
                r -= (double)w;
                last = c;
            }
        }
        out[0] = pick >= 0 ? pick : last;
        out[1] = 0;
    }
}

__device__ __forceinline__ void sample_candidates(const float* logits, int n, float temperature, int limit,
                                                  float top_p, float min_p, double u, int* out, u64* cand) {
    __shared__ int hist[256];
    __shared__ int sel[2];
    const int tid = threadIdx.x, chunk = (n + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int c0 = min(n, tid * chunk), c1 = min(n, c0 + chunk);
    int valid = 0;
    for (int c = tid; c < n; c += blockDim.x) valid += logits[c] == logits[c];
    valid = block_reduce(valid, [](int a, int b) { return a + b; });
    const int K = min(min(limit, SAMPLE_MAX_CAND), valid);
    if (K == 0) {  // every logit NaN
        sample_done(out, 0, 0);
        return;
    }
    // Radix select, 8 bits a pass from the top: the K-th largest key `prefix`, and `k`, how many
    // of the keys equal to it belong to the top K (the lowest ids among them).
    u32 prefix = 0, mask = 0;
    int k = K;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (int c = tid; c < n; c += blockDim.x) {
            const float v = logits[c];
            if (v == v) {
                const u32 key = ordered_bits(v);
                if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
            }
        }
        __syncthreads();
        if (tid == 0) {
            int above = 0, b = 255;
            while (above + hist[b] < k) above += hist[b--];
            sel[0] = b;
            sel[1] = k - above;
        }
        __syncthreads();
        prefix |= (u32)sel[0] << shift;
        mask |= 255u << shift;
        k = sel[1];
    }
    // Compaction, each thread's slice in id order: keys above the K-th first, then its ties.
    int g = 0, e = 0;
    for (int c = c0; c < c1; ++c) {
        const float v = logits[c];
        if (v == v) {
            const u32 key = ordered_bits(v);
            g += key > prefix;
            e += key == prefix;
        }
    }
    int gi = block_inclusive_scan(g) - g, ei = block_inclusive_scan(e) - e;
    for (int c = c0; c < c1; ++c) {
        const float v = logits[c];
        if (v == v) {
            const u32 key = ordered_bits(v);
            if (key > prefix) cand[gi++] = pack_max(v, c);
            else if (key == prefix) {
                if (ei < k) cand[K - k + ei] = pack_max(v, c);
                ++ei;
            }
        }
    }
    int P = 1;
    while (P < K) P <<= 1;
    for (int i = K + tid; i < P; i += blockDim.x) cand[i] = 0;
    // Bitonic sort, largest first.
    for (int size = 2; size <= P; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            __syncthreads();
            for (int i = tid; i < P; i += blockDim.x) {
                const int j = i ^ stride;
                if (j > i) {
                    const u64 a = cand[i], b = cand[j];
                    if ((a < b) == ((i & size) == 0)) {
                        cand[i] = b;
                        cand[j] = a;
                    }
                }
            }
        }
    __syncthreads();
    const float top = from_ordered_bits((u32)(cand[0] >> 32));
    // Where the host would widen past these candidates: the nucleus checked against the whole
    // row's mass (f64, as the host), or more candidates wanted without top-p.
    // (K below the limit because the row has fewer valid logits: every one is a candidate, and
    // the host's widened set would be the same.)
    if (limit > K && valid > K) {
        bool widen = true;
        if (top_p < 1.f) {
            double part = 0.0, all = 0.0;
            for (int i = tid; i < K; i += blockDim.x)
                part += exp((double)((from_ordered_bits((u32)(cand[i] >> 32)) - top) / temperature));
            for (int c = tid; c < n; c += blockDim.x) {
                const float v = logits[c];
                if (v == v) all += exp((double)((v - top) / temperature));
            }
            part = block_reduce(part, [](double a, double b) { return a + b; });
            all = block_reduce(all, [](double a, double b) { return a + b; });
            widen = (float)(part / all) < top_p;
        }
        if (widen) {
            sample_done(out, 0, 1);
            return;
        }
    }
    // Each candidate becomes (exp((l - top) / T) bits, id); one thread then follows the host's
    // softmax, top-p, min-p and walk in order.
    for (int i = tid; i < K; i += blockDim.x) {
        const u64 c = cand[i];
        const float w = expf((from_ordered_bits((u32)(c >> 32)) - top) / temperature);
        cand[i] = ((u64)__float_as_uint(w) << 32) | (u64)(0xffffffffu - (u32)c);
    }
    __syncthreads();
    if (tid != 0) return;
    auto prob_raw = [&](int i) { return __uint_as_float((u32)(cand[i] >> 32)); };
    float z = 0.f;
    for (int i = 0; i < K; ++i) z += prob_raw(i);
    auto prob = [&](int i) { return prob_raw(i) / z; };
    int keep = K;
    if (top_p < 1.f) {
        float acc = 0.f;
        for (int i = 0; i < K; ++i) {
            acc += prob(i);
            if (acc >= top_p) {
                keep = i + 1;
                break;
            }
        }
    }
    if (min_p > 0.f) {
        const float floor = min_p * prob(0);
        int above = 0;
        while (above < K && prob(above) >= floor) ++above;
        keep = min(keep, max(above, 1));
    }
    float total = 0.f;
    for (int i = 0; i < keep; ++i) total += prob(i);
    float r = (float)u * total;
    int pick = keep - 1;
    for (int i = 0; i < keep; ++i) {
        const float p = prob(i);
        if (r < p) {
            pick = i;
            break;
        }
        r -= p;
    }
    out[0] = (int)(u32)cand[pick];
    out[1] = 0;
}

// Launch with one block of SAMPLE_THREADS threads. `limit` is min(top_k, n), or n without top-k.
// The draw is `u`, or *u_at where u_at is not null (a recorded step reads the draw uploaded before
// each replay). With `params` not null the sample ends a chained decode step (finish_chained_step
// into `host_out`); `out` is then the kernel's scratch.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_token(float* logits, int n, const u32* pen_ids, const float* pen_amount, int n_pen, float temperature,
                 int limit, float top_p, float min_p, double u, const double* u_at, int* out, int* params,
                 int* host_out) {
    __shared__ u64 cand[SAMPLE_MAX_CAND];  // 32 KiB: the candidates, or the whole-row scan
    grid_dep();
    if (u_at) u = *u_at;
    for (int j = threadIdx.x; j < n_pen; j += blockDim.x)
        if (pen_ids[j] < (u32)n) logits[pen_ids[j]] -= pen_amount[j];
    __syncthreads();  // the penalised row is what every pass below reads
    if (!(temperature > 0.f)) {
        const int t = sample_argmax(logits, n);
        sample_done(out, t, 0);
    } else if (limit >= n && top_p >= 1.f) {
        sample_whole_row(logits, n, temperature, min_p, u, out, reinterpret_cast<double*>(cand));
    } else {
        sample_candidates(logits, n, temperature, limit, top_p, min_p, u, out, cand);
    }
    // Every path above has written `out` (whichever thread chose) before this barrier.
    __syncthreads();
    if (params && threadIdx.x == 0) finish_chained_step(params, host_out, out[0], out[1]);
}
