// Token sampling where the logits are: the host sampler's rule (engine/src/sampler.rs, `choose`)
// with the host's draw u, so that a sampled decode step reads back one token id rather than the
// vocabulary's row.
//
//   whole row   no top-k below the vocabulary and top-p 1 (the OpenAI default): the weights
//               exp((l - max) / T), zero below the min-p cutoff, on a grid of blocks
//               (`sample_row_max`, `sample_row_weights`, below);
//   top-p       over the whole row (no top-k below it), the nucleus by a radix select on the
//               weights in fixed point, on a grid of blocks (`sample_select_pass`,
//               `sample_nucleus_draw`, at the end of this file);
//   small top-k a top-k whose ranges' best fit SAMPLE_MAX_CAND candidates, and greedy with
//               penalties (the best one), on a grid of blocks (`sample_row_top`,
//               `sample_top_merge`, below);
//   top-k       any other top-k up to SAMPLE_MAX_CAND: the k-th largest key by counting passes,
//               the keys at or above it gathered, one block choosing (`sample_select_pass`,
//               `sample_select_gather`, `sample_select_merge`, at the end of this file);
//   every other choice (a top-k above SAMPLE_MAX_CAND, rows of 2^21 ids or more, greedy with
//               penalties on rows of more than 2^23 ids) on one block of SAMPLE_THREADS threads
//               (`sample_token`), the row (248,320 floats, 1 MB) in L2 between its passes; one
//               SM's pass over the row is bound by the loads it has in flight, so every pass
//               issues SAMPLE_UNROLL loads a thread before it uses any, and reads coalesced:
//               strided over the block, or, where id order matters, in warp chunks (each warp a
//               contiguous run of ids, 32 at a time; the chunks tile the row in warp order):
//   penalties   logits[id] -= amount for each generated token, in place (the host falls back to
//               the row already penalised; the grid applies them by range; a chained step by
//               `sample_penalise_chained`, from the counts the chain keeps);
//   greedy      T <= 0 (penalties given): the first maximum, NaN never chosen;
//   candidates  the K = min(limit, SAMPLE_MAX_CAND) largest logits (ties to the lower id): a
//               radix select of the K-th largest key, a compaction in id order, a bitonic sort;
//               then the host's softmax, top-p and min-p over them by one thread, in its order.
//               Where the host would widen past SAMPLE_MAX_CAND candidates (a top-k above them,
//               below the row: without top-p, or with a nucleus not inside them), out[1] = 1
//               asks for the row.
//
// out[0] = the token, out[1] = 0 (chosen) or 1 (the host samples the row).
constexpr int SAMPLE_THREADS = 1024;
constexpr int SAMPLE_WARPS = SAMPLE_THREADS / 32;
constexpr unsigned FULL_MASK = 0xffffffffu;
constexpr int SAMPLE_MAX_CAND = 4096;  // sampler.rs TOP_P_PREFILTER
constexpr int SAMPLE_UNROLL = 8;
#define SAMPLE_NAN __int_as_float(0x7fffffff)

// The inverse of common.cuh's ordered_bits.
__device__ __forceinline__ float from_ordered_bits(u32 o) {
    return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}

// Scratch for the block-wide reductions and scans below: 32 8-byte slots, one per warp.
__device__ __forceinline__ u64* sample_scratch() {
    __shared__ u64 slots[32];
    return slots;
}

// This warp's contiguous run of ids: a multiple of 32 ids a warp, the runs in warp order.
struct WarpChunk {
    int lo, hi;
};
__device__ __forceinline__ WarpChunk warp_chunk(int n) {
    const int per = (n + SAMPLE_WARPS * 32 - 1) / (SAMPLE_WARPS * 32) * 32;
    const int w = threadIdx.x >> 5;
    return {min(n, w * per), min(n, (w + 1) * per)};
}

// f(id, logit) for ids tid, tid + SAMPLE_THREADS, ...; SAMPLE_UNROLL loads issued before any
// is used; ids past n read NaN (which every pass skips). The block's threads make the same trips.
template <typename F>
__device__ __forceinline__ void strided_pass(const float* logits, int n, F f) {
    for (int base = 0; base < n; base += SAMPLE_UNROLL * SAMPLE_THREADS) {
        float v[SAMPLE_UNROLL];
#pragma unroll
        for (int j = 0; j < SAMPLE_UNROLL; ++j) {
            const int c = base + j * SAMPLE_THREADS + (int)threadIdx.x;
            v[j] = c < n ? logits[c] : SAMPLE_NAN;
        }
#pragma unroll
        for (int j = 0; j < SAMPLE_UNROLL; ++j) f(base + j * SAMPLE_THREADS + (int)threadIdx.x, v[j]);
    }
}

// f(id, logit) over this warp's chunk in id order, 32 ids (one a lane) at a time, SAMPLE_UNROLL
// groups loaded before any is used; ids past the chunk read NaN. A warp's lanes make the same
// trips, so f may use warp votes.
template <typename F>
__device__ __forceinline__ void chunk_pass(const float* logits, WarpChunk ch, F f) {
    const int lane = threadIdx.x & 31;
    for (int base = ch.lo; base < ch.hi; base += 32 * SAMPLE_UNROLL) {
        float v[SAMPLE_UNROLL];
#pragma unroll
        for (int j = 0; j < SAMPLE_UNROLL; ++j) {
            const int c = base + 32 * j + lane;
            v[j] = c < ch.hi ? logits[c] : SAMPLE_NAN;
        }
#pragma unroll
        for (int j = 0; j < SAMPLE_UNROLL; ++j) f(base + 32 * j + lane, v[j]);
    }
}

// Each warp's value `v` (the same in all its lanes) summed over the warps before it, in warp
// order (so that each warp's prefix plus its value is the next warp's prefix).
template <typename T>
__device__ __forceinline__ T warps_before(T v) {
    T* part = reinterpret_cast<T*>(sample_scratch());
    const int warp = threadIdx.x >> 5;
    __syncthreads();  // `part` may still be read by a previous call
    if ((threadIdx.x & 31) == 0) part[warp] = v;
    __syncthreads();
    T before = 0;
    for (int w = 0; w < warp; ++w) before += part[w];
    return before;
}

// Lane l gets v_0 + ... + v_l.
template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T v) {
    const int lane = threadIdx.x & 31;
    for (int o = 1; o < 32; o <<= 1) {
        const T n = __shfl_up_sync(FULL_MASK, v, o);
        if (lane >= o) v += n;
    }
    return v;
}

// Inclusive scan over a block of up to 1,024 threads, the warps' sums added in order.
template <typename T>
__device__ __forceinline__ T block_inclusive_scan(T v) {
    T* part = reinterpret_cast<T*>(sample_scratch());
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_inclusive_scan(v);
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

__device__ __forceinline__ void sample_done_by_this_thread(int* out, int token, int status) {
    out[0] = token;
    out[1] = status;
}

__device__ __forceinline__ void sample_done(int* out, int token, int status) {
    if (threadIdx.x == 0) sample_done_by_this_thread(out, token, status);
}

// The first maximum's id (0 when every value is NaN), as the host's argmax.
__device__ __forceinline__ int sample_argmax(const float* logits, int n) {
    u64 best = 0;
    strided_pass(logits, n, [&](int c, float v) {
        if (v == v) best = max(best, pack_max(v, c));
    });
    best = block_reduce(best, [](u64 a, u64 b) { return max(a, b); });
    return packed_index(best);
}

// Bitonic sort of a[0, P) in shared memory, largest first (P a power of two; every thread of
// the block calls it).
__device__ __forceinline__ void sort_descending(u64* a, int P) {
    for (int size = 2; size <= P; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            __syncthreads();
            for (int i = threadIdx.x; i < P; i += blockDim.x) {
                const int j = i ^ stride;
                if (j > i) {
                    const u64 x = a[i], y = a[j];
                    if ((x < y) == ((i & size) == 0)) {
                        a[i] = y;
                        a[j] = x;
                    }
                }
            }
        }
    __syncthreads();
}

// The k largest of keys[0, count) (shared memory; distinct where not 0, 0 = none, never chosen)
// written to out[0, k') in any order, k' = min(k, keys not 0); returns k'. A radix select from
// the top byte, eight bits a pass, that stops once the bin holding the k-th largest is wanted
// whole; warp 0 finds that bin (each lane eight bins, a scan from the top). Every thread calls it.
__device__ __forceinline__ int select_largest(const u64* keys, int count, int k, u64* out) {
    __shared__ int hist[256];
    __shared__ int sel[3];  // the bin, how many of it are wanted, how many it holds
    __shared__ int written;
    const int tid = threadIdx.x;
    int nonzero = 0;
    for (int i = tid; i < count; i += blockDim.x) nonzero += keys[i] != 0;
    nonzero = block_reduce(nonzero, [](int a, int b) { return a + b; });
    k = min(k, nonzero);
    u64 prefix = 0, mask = 0;
    if (k < nonzero) {
        int need = k;
        for (int shift = 56; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += blockDim.x) hist[b] = 0;
            __syncthreads();
            for (int i = tid; i < count; i += blockDim.x) {
                const u64 key = keys[i];
                if (key && (key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
            }
            __syncthreads();
            if (tid < 32) {
                int bins[8], sum = 0;
#pragma unroll
                for (int j = 0; j < 8; ++j) sum += bins[j] = hist[255 - (tid * 8 + j)];
                const int incl = warp_inclusive_scan(sum);
                int above = incl - sum;
                if (above < need && need <= incl) {
                    for (int j = 0; j < 8; ++j) {
                        if (above + bins[j] >= need) {
                            sel[0] = 255 - (tid * 8 + j);
                            sel[1] = need - above;
                            sel[2] = bins[j];
                            break;
                        }
                        above += bins[j];
                    }
                }
            }
            __syncthreads();
            prefix |= (u64)sel[0] << shift;
            mask |= 255ull << shift;
            need = sel[1];
            if (need == sel[2]) break;  // the whole bin is wanted (the same for every thread)
        }
    }
    // Above the prefix in the digits examined, or in its bin (wanted whole, or the one key left
    // after the last digit): exactly k keys.
    if (tid == 0) written = 0;
    __syncthreads();
    for (int i = tid; i < count; i += blockDim.x) {
        const u64 key = keys[i];
        if (key && (key & mask) >= prefix) out[atomicAdd(&written, 1)] = key;
    }
    __syncthreads();
    return k;
}

// The host's choice among its K candidates, cand[0, K) the packed (value, id) keys sorted
// largest first (every thread of the block calls it; thread 0 writes out).
__device__ __forceinline__ void choose_among(u64* cand, int K, float temperature, float top_p, float min_p,
                                             double u, int* out) {
    const int tid = threadIdx.x;
    const float top = from_ordered_bits((u32)(cand[0] >> 32));
    __syncthreads();  // every thread has read cand[0] before the loop below rewrites it
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

__device__ __forceinline__ void sample_candidates(const float* logits, int n, float temperature, int limit,
                                                  float top_p, float min_p, double u, int* out, u64* cand) {
    __shared__ int hist[256];
    __shared__ int sel[2];
    const int tid = threadIdx.x, lane = tid & 31;
    int valid = 0;
    strided_pass(logits, n, [&](int, float v) { valid += v == v; });
    valid = block_reduce(valid, [](int a, int b) { return a + b; });
    const int K = min(min(limit, SAMPLE_MAX_CAND), valid);
    if (K == 0) {  // every logit NaN
        sample_done(out, 0, 0);
        return;
    }
    // Radix select, 8 bits a pass from the top: the K-th largest key `prefix`, and `k`, how many
    // of the keys equal to it belong to the top K (the lowest ids among them). (Adding a warp's
    // lanes of one bin with one atomic, __match_any_sync, measured slower: run35 call 4.)
    u32 prefix = 0, mask = 0;
    int k = K;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        strided_pass(logits, n, [&](int, float v) {
            const u32 key = ordered_bits(v);
            if (v == v && (key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
        });
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
    // Compaction in id order, warp chunks: keys above the K-th first, then the lowest-id k of its
    // ties; each lane's place is its warp's count before it plus its rank among the 32.
    const WarpChunk ch = warp_chunk(n);
    const unsigned below = (1u << lane) - 1u;
    auto classify = [&](float v) {  // 1: above the K-th key, 2: equal to it, 0: neither (NaN)
        const u32 key = ordered_bits(v);
        return v != v ? 0 : key > prefix ? 1 : key == prefix ? 2 : 0;
    };
    int g = 0, e = 0;
    chunk_pass(logits, ch, [&](int, float v) {
        const int kind = classify(v);
        g += __popc(__ballot_sync(FULL_MASK, kind == 1));
        e += __popc(__ballot_sync(FULL_MASK, kind == 2));
    });
    int gi = warps_before(g), ei = warps_before(e);
    chunk_pass(logits, ch, [&](int c, float v) {
        const int kind = classify(v);
        const unsigned bg = __ballot_sync(FULL_MASK, kind == 1), be = __ballot_sync(FULL_MASK, kind == 2);
        if (kind == 1) cand[gi + __popc(bg & below)] = pack_max(v, c);
        const int tie = ei + __popc(be & below);
        if (kind == 2 && tie < k) cand[K - k + tie] = pack_max(v, c);
        gi += __popc(bg);
        ei += __popc(be);
    });
    int P = 1;
    while (P < K) P <<= 1;
    for (int i = K + tid; i < P; i += blockDim.x) cand[i] = 0;
    sort_descending(cand, P);
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
            strided_pass(logits, n, [&](int, float v) {
                if (v == v) all += exp((double)((v - top) / temperature));
            });
            part = block_reduce(part, [](double a, double b) { return a + b; });
            all = block_reduce(all, [](double a, double b) { return a + b; });
            widen = (float)(part / all) < top_p;
        }
        if (widen) {
            sample_done(out, 0, 1);
            return;
        }
    }
    choose_among(cand, K, temperature, top_p, min_p, u, out);
}

// Launch with one block of SAMPLE_THREADS threads, for every choice but the whole row (which it
// would send back to the host). `limit` is min(top_k, n), or n without top-k.
// The draw is `u`, or *u_at where u_at is not null (a recorded step reads the draw uploaded before
// each replay). With `params` not null the sample ends a chained decode step (finish_chained_step
// into `host_out`); `out` is then the kernel's scratch.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_token(float* logits, int n, const u32* pen_ids, const float* pen_amount, int n_pen, float temperature,
                 int limit, float top_p, float min_p, double u, const double* u_at, int* out, int* params,
                 int* host_out) {
    __shared__ u64 cand[SAMPLE_MAX_CAND];  // 32 KiB: the candidates
    grid_dep();
    if (u_at) u = *u_at;
    for (int j = threadIdx.x; j < n_pen; j += blockDim.x)
        if (pen_ids[j] < (u32)n) logits[pen_ids[j]] -= pen_amount[j];
    __syncthreads();  // the penalised row is what every pass below reads
    if (!(temperature > 0.f)) {
        const int t = sample_argmax(logits, n);
        sample_done(out, t, 0);
    } else {
        sample_candidates(logits, n, temperature, limit, top_p, min_p, u, out, cand);
    }
    // Every path above has written `out` (whichever thread chose) before this barrier.
    __syncthreads();
    if (params && threadIdx.x == 0) finish_chained_step(params, host_out, out[0], out[1]);
}

// A penalised chained step's penalties, before its chooser (which then takes none), from the
// counts the chain keeps on the device (the host has not read the tokens chosen since it
// uploaded them): `ids` holds *count_n distinct generated ids (room for `capacity`), `counts`
// their counts before the token this step fed (params[0]). That token is counted first
// (appended where new), then each id's penalty, presence + frequency * count rounded as the
// host's (no FMA), is subtracted from its logit in place. Launch with one block of
// SAMPLE_THREADS threads.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_penalise_chained(float* logits, int n, const int* params, u32* ids, u32* counts, int* count_n,
                            int capacity, float presence, float frequency) {
    __shared__ int slot;
    grid_dep();
    const u32 fed = (u32)params[0];
    const int m = *count_n;
    if (threadIdx.x == 0) slot = m;
    __syncthreads();
    for (int j = threadIdx.x; j < m; j += blockDim.x)
        if (ids[j] == fed) slot = j;  // the ids are distinct: one writer at most
    __syncthreads();
    const int total = slot == m ? min(m + 1, capacity) : m;
    if (threadIdx.x == 0 && slot < capacity) {
        if (slot == m) {
            ids[m] = fed;
            counts[m] = 0;
            *count_n = total;
        }
        counts[slot] += 1;
    }
    __syncthreads();  // thread 0's writes are what the loop reads
    for (int j = threadIdx.x; j < total; j += blockDim.x)
        if (ids[j] < (u32)n) logits[ids[j]] -= __fadd_rn(presence, __fmul_rn(frequency, (float)counts[j]));
}

// The whole-row path on a grid: temperature sampling with top-p 1 and no top-k below the row
// (the OpenAI default), which on one block is bound by its arithmetic (a division and an exact
// expf a logit, 248,320 times on one SM). Two launches of SAMPLE_ROW_THREADS threads a block,
// each block a range of SAMPLE_ROW_RANGE ids; the host's rule and draw (`sample_whole_vocabulary`
// in sampler.rs):
//   sample_row_max      the penalties of its range applied in place, then its range's maximum;
//   sample_row_weights  the row's maximum from the ranges', its range's weights summed in f64;
//                       the last block to finish finds the range whose interval holds
//                       u * total, then the id in it whose interval holds the rest
//                       (find_interval; past every interval, by rounding, the last positive
//                       range, or id).
constexpr int SAMPLE_ROW_THREADS = 256;
constexpr int SAMPLE_ROW_PER_THREAD = 8;
constexpr int SAMPLE_ROW_RANGE = SAMPLE_ROW_THREADS * SAMPLE_ROW_PER_THREAD;

// This block's range of ids [lo, hi): SAMPLE_ROW_RANGE of them (fewer in the last block).
struct Range {
    int lo, hi;
};
__device__ __forceinline__ Range block_range(int n) {
    const int lo = blockIdx.x * SAMPLE_ROW_RANGE;
    return {lo, min(n, lo + SAMPLE_ROW_RANGE)};
}

// The penalties of the range's ids applied in place (each id once; the host's order), then a
// barrier: the penalised range is what the caller reads.
__device__ __forceinline__ void penalise_range(float* logits, Range r, const u32* pen_ids, const float* pen_amount,
                                               int n_pen) {
    for (int j = threadIdx.x; j < n_pen; j += blockDim.x)
        if (pen_ids[j] >= (u32)r.lo && pen_ids[j] < (u32)r.hi) logits[pen_ids[j]] -= pen_amount[j];
    __syncthreads();
}

// The range's logits, strided over the block: v[j] is id lo + j * SAMPLE_ROW_THREADS + thread
// (NaN past the range); all loads issued before any is used.
__device__ __forceinline__ void load_range(const float* logits, Range r, float (&v)[SAMPLE_ROW_PER_THREAD]) {
#pragma unroll
    for (int j = 0; j < SAMPLE_ROW_PER_THREAD; ++j) {
        const int c = r.lo + j * SAMPLE_ROW_THREADS + (int)threadIdx.x;
        v[j] = c < r.hi ? logits[c] : SAMPLE_NAN;
    }
}

// The row's maximum from the ranges' (sample_row_max), in every thread.
__device__ __forceinline__ float max_of_ranges(const float* range_max) {
    float m = NEG_INF;
    for (int r = threadIdx.x; r < (int)gridDim.x; r += blockDim.x) m = fmaxf(m, range_max[r]);
    return block_reduce(m, [](float a, float b) { return fmaxf(a, b); });
}

// The first maximum's id by any block (a grid's last block, where no weight was finite).
__device__ __forceinline__ int block_argmax(const float* logits, int n) {
    u64 best = 0;
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        const float v = logits[c];
        if (v == v) best = max(best, pack_max(v, c));
    }
    return packed_index(block_reduce(best, [](u64 a, u64 b) { return max(a, b); }));
}

// min-p keeps p >= min_p * p_max, i.e. logit >= max + T ln(min_p) (-inf without min-p; NaN fails
// every test); rounded as the host's separate product and sum (no contraction into an FMA).
__device__ __forceinline__ float min_p_cutoff(float m, float temperature, float min_p) {
    return min_p > 0.f ? __fadd_rn(m, __fmul_rn(temperature, logf(min_p))) : NEG_INF;
}
// The merge selects at most this many candidates before sorting them (else it sorts them all).
constexpr int SAMPLE_SELECT_MAX = 256;

// Launch with SAMPLE_ROW_THREADS threads and ceil(n / SAMPLE_ROW_RANGE) blocks.
extern "C" __global__ void __launch_bounds__(SAMPLE_ROW_THREADS)
    sample_row_max(float* logits, int n, const u32* pen_ids, const float* pen_amount, int n_pen, float* range_max) {
    grid_dep();
    const Range range = block_range(n);
    penalise_range(logits, range, pen_ids, pen_amount, n_pen);
    float v[SAMPLE_ROW_PER_THREAD];
    load_range(logits, range, v);
    float m = NEG_INF;
#pragma unroll
    for (int j = 0; j < SAMPLE_ROW_PER_THREAD; ++j) m = fmaxf(m, v[j]);  // fmaxf skips NaN
    m = block_reduce(m, [](float a, float b) { return fmaxf(a, b); });
    if (threadIdx.x == 0) range_max[blockIdx.x] = m;
}

// Which of `count` items holds `target_of(total)` on their weights' cumulative sum in item
// order, total the sum of all: every thread gets the item whose interval [acc, acc + w), w > 0,
// holds it, and the target's offset into it. Thread t owns the consecutive items
// [t * per, (t + 1) * per): it sums them, a block scan gives each thread its interval, and the
// thread whose interval holds the target walks its items. Integer weights find the item exactly;
// f64 sums may round past every interval (target at or past the total, or in a gap between a
// thread's scan and its own sums): the last item of positive weight then, offset +inf. Item -1
// only where the total is not positive. Every thread of the block calls it.
template <typename T>
struct Interval {
    int item;
    T offset, total;
};
template <typename T, typename Weight, typename Target>
__device__ __forceinline__ Interval<T> find_interval(int count, Weight weight, Target target_of) {
    __shared__ T scan[SAMPLE_ROW_THREADS];
    __shared__ Interval<T> sh;
    const int tid = threadIdx.x, per = (count + (int)blockDim.x - 1) / (int)blockDim.x;
    const int lo = min(count, tid * per), hi = min(count, lo + per);
    T own = 0;
    for (int i = lo; i < hi; ++i) own += weight(i);
    const T incl = block_inclusive_scan(own);  // (its first barrier orders a previous call's reads)
    scan[tid] = incl;
    if (tid == 0) sh.item = -1;
    __syncthreads();
    const T total = scan[blockDim.x - 1], excl = tid ? scan[tid - 1] : T(0);
    const T target = target_of(total);
    if (own > 0 && excl <= target && target < incl) {
        T acc = excl;
        for (int i = lo; i < hi; ++i) {
            const T w = weight(i);
            if (w > 0 && target < acc + w) {
                sh.item = i;
                sh.offset = target - acc;
                break;
            }
            acc += w;
        }
    }
    __syncthreads();
    Interval<T> r = sh;
    r.total = total;
    if (r.item < 0 && total > 0) {  // rounding (f64): the last item of positive weight
        int last = -1;
        for (int i = lo; i < hi; ++i)
            if (weight(i) > 0) last = i;
        r.item = block_reduce(last, [](int x, int y) { return max(x, y); });
        r.offset = (T)__longlong_as_double(0x7ff0000000000000ll);  // +inf
    }
    __syncthreads();  // `sh` and `scan` are read before a next call writes them
    return r;
}

// A grid's hand-off to its last block: thread 0 runs `publish` (this block's results to global
// memory), then counts the block on `ticket`; returns, in every thread, whether this block counted
// last. The last block then sees every block's results and leaves `ticket` zero for the next
// launch.
template <typename Publish>
__device__ __forceinline__ bool last_block_after(u32* ticket, Publish publish) {
    __shared__ bool last;
    if (threadIdx.x == 0) {
        publish();
        __threadfence();  // this block's results are visible before its ticket counts
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last) {
        __threadfence();
        if (threadIdx.x == 0) *ticket = 0;
    }
    return last;
}

// Launch as sample_row_max, after it; `ticket` zero (the last block leaves it so). The draw is
// `u`, or *u_at where u_at is not null; with `params` not null the sample ends a chained decode
// step (finish_chained_step into `host_out`), `out` then the kernel's scratch.
extern "C" __global__ void __launch_bounds__(SAMPLE_ROW_THREADS)
    sample_row_weights(const float* logits, int n, const float* range_max, float temperature, float min_p,
                       double u, const double* u_at, double* range_sum, u32* ticket, int* out, int* params,
                       int* host_out) {
    grid_dep();
    const int tid = threadIdx.x, ranges = gridDim.x;
    float v[SAMPLE_ROW_PER_THREAD];
    load_range(logits, block_range(n), v);
    const float m = max_of_ranges(range_max);
    const float cutoff = min_p_cutoff(m, temperature, min_p);
    auto weight = [&](float x) { return x >= cutoff ? expf((x - m) / temperature) : 0.f; };
    {
        double s = 0.0;
#pragma unroll
        for (int j = 0; j < SAMPLE_ROW_PER_THREAD; ++j) s += (double)weight(v[j]);
        s = block_reduce(s, [](double a, double b) { return a + b; });
        if (!last_block_after(ticket, [&] { range_sum[blockIdx.x] = s; })) return;
    }
    // The last block: every range's sum is in range_sum. The range whose interval holds u * total,
    // then the id in it whose interval holds the rest.
    if (u_at) u = *u_at;
    const volatile double* sums = range_sum;
    const Interval<double> range =
        find_interval<double>(ranges, [&](int r) { return sums[r]; }, [&](double total) { return u * total; });
    if (!(range.total > 0.0)) {  // no weight at all: the host takes the argmax
        const int t = block_argmax(logits, n);
        if (tid == 0) sample_done_by_this_thread(out, t, 0);
    } else {
        const int lo = range.item * SAMPLE_ROW_RANGE, len = min(n, lo + SAMPLE_ROW_RANGE) - lo;
        const Interval<double> id = find_interval<double>(
            len, [&](int i) { return (double)weight(logits[lo + i]); }, [&](double) { return range.offset; });
        if (tid == 0) sample_done_by_this_thread(out, lo + id.item, 0);
    }
    __syncthreads();
    if (params && tid == 0) finish_chained_step(params, host_out, out[0], out[1]);
}

// The top-k path on a grid, for a top-k small enough that every range's `kb` best fit one
// block's candidates (kb = min(top-k, SAMPLE_ROW_RANGE), kb * ranges <= SAMPLE_MAX_CAND: a
// top-k up to 33 on a 248,320-entry row, as Qwen's advised 20; and greedy with penalties, as a
// top-k of 1). Such a choice never looks past the best top-k, so the host's candidates are the
// best top-k of the ranges' best:
//   sample_row_top    the penalties of its range applied in place, then its range's kb largest
//                     packed (value, id) keys (ties to the lower id; 0 where it has fewer) by a
//                     bitonic sort of its SAMPLE_ROW_RANGE;
//   sample_top_merge  one block of SAMPLE_THREADS: the ranges' keys sorted again; the best
//                     min(top-k, valid) are the host's candidates, and its softmax, top-p, min-p
//                     and walk choose among them (choose_among); greedy takes the best.

// Launch with SAMPLE_ROW_THREADS threads and ceil(n / SAMPLE_ROW_RANGE) blocks.
extern "C" __global__ void __launch_bounds__(SAMPLE_ROW_THREADS)
    sample_row_top(float* logits, int n, const u32* pen_ids, const float* pen_amount, int n_pen, int kb,
                   u64* range_top) {
    __shared__ u64 keys[SAMPLE_ROW_RANGE];  // 16 KiB
    grid_dep();
    const Range range = block_range(n);
    penalise_range(logits, range, pen_ids, pen_amount, n_pen);
    float v[SAMPLE_ROW_PER_THREAD];
    load_range(logits, range, v);
#pragma unroll
    for (int j = 0; j < SAMPLE_ROW_PER_THREAD; ++j) {
        const int i = j * SAMPLE_ROW_THREADS + (int)threadIdx.x;
        keys[i] = v[j] == v[j] ? pack_max(v[j], range.lo + i) : 0;
    }
    __syncthreads();  // every key is written before the select reads them
    u64* top = range_top + (size_t)blockIdx.x * kb;
    const int kept = select_largest(keys, SAMPLE_ROW_RANGE, kb, top);
    for (int i = kept + threadIdx.x; i < kb; i += blockDim.x) top[i] = 0;
}

// Launch with one block of SAMPLE_THREADS threads after sample_row_top; `count` = kb * ranges
// (at most SAMPLE_MAX_CAND). The draw is `u`, or *u_at where u_at is not null; with `params` not
// null the sample ends a chained decode step (finish_chained_step into `host_out`), `out` then
// the kernel's scratch.
// The host's choice among the best `limit` of `count` (at most SAMPLE_MAX_CAND) distinct packed
// keys (0: none), in any order: they are copied into `cand` (shared memory), the best K =
// min(limit, keys not 0) selected and sorted (or all sorted, for a K above SAMPLE_SELECT_MAX),
// and choose_among follows. Every thread of the block calls it.
__device__ __forceinline__ void merge_and_choose(const u64* keys, int count, int limit, float temperature,
                                                 float top_p, float min_p, double u, int* out, u64* cand) {
    int P = 1;
    while (P < count) P <<= 1;
    int valid = 0;
    for (int i = threadIdx.x; i < P; i += blockDim.x) {
        cand[i] = i < count ? keys[i] : 0;
        valid += cand[i] != 0;
    }
    valid = block_reduce(valid, [](int a, int b) { return a + b; });
    const int K = min(limit, valid);
    __shared__ u64 best[SAMPLE_SELECT_MAX];
    u64* chosen = cand;
    if (K <= SAMPLE_SELECT_MAX) {  // select the K best, then sort only them
        select_largest(cand, count, K, best);
        int Q = 1;
        while (Q < K) Q <<= 1;
        for (int i = K + threadIdx.x; i < Q; i += blockDim.x) best[i] = 0;
        sort_descending(best, Q);
        chosen = best;
    } else {
        sort_descending(cand, P);
    }
    if (K == 0) sample_done(out, 0, 0);  // every logit NaN
    else if (!(temperature > 0.f)) sample_done(out, packed_index(chosen[0]), 0);  // greedy (limit 1)
    else choose_among(chosen, K, temperature, top_p, min_p, u, out);
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_top_merge(const u64* range_top, int count, int limit, float temperature, float top_p, float min_p,
                     double u, const double* u_at, int* out, int* params, int* host_out) {
    __shared__ u64 cand[SAMPLE_MAX_CAND];  // 32 KiB
    grid_dep();
    if (u_at) u = *u_at;
    merge_and_choose(range_top, count, limit, temperature, top_p, min_p, u, out, cand);
    __syncthreads();
    if (params && threadIdx.x == 0) finish_chained_step(params, host_out, out[0], out[1]);
}

// Top-p over the whole row on a grid (no top-k below the row): the host's rule (`sample_nucleus`
// in sampler.rs) in the same integer arithmetic, so that it never needs the row on the host,
// whatever the nucleus' size. Each valid logit weighs exp((l - max) / T) in units of 2^-32
// (`fixed_weight`, at most 2^32; the row's sum Z below 2^53 for rows under 2^21 ids). The
// nucleus' boundary is the ordered key (ordered_bits) at which the weights of the keys above it,
// largest first, reach need = ceil(top_p Z): a radix select by weight rather than by count, in
// three digits of 11, 11 and 10 bits from the top. The launches, each on sample_row_max's grid:
//   sample_row_max        the range maxima (and the penalties, as for the whole row);
//   sample_select_pass    once a digit: the weights of the keys that match the boundary's digits
//                         found so far, summed by their next digit into hist[digit] (integer
//                         atomics: the same sums in any order);
//   sample_nucleus_draw   the boundary key k, the weight of the keys above it; each range's
//                         members' weight (its keys above k, at or above the min-p cutoff) and
//                         its count of keys equal to k; the last block takes the lowest-id keys
//                         equal to k that the nucleus needs, draws t = floor(u S) over the
//                         members' weight S, and finds the member whose interval, in id order,
//                         holds t (find_interval, for the range, then for the id); it leaves
//                         `hist` and `ticket` zero for the next sample.
constexpr int SELECT_DIGITS = 3;
constexpr int SELECT_BINS = 2048;  // the widest digit's; hist holds SELECT_DIGITS x SELECT_BINS

__device__ __forceinline__ int select_width(int digit) { return digit < 2 ? 11 : 10; }
__device__ __forceinline__ int select_shift(int digit) { return digit == 0 ? 21 : digit == 1 ? 10 : 0; }

__device__ __forceinline__ u64 fixed_weight(float v, float m, float temperature) {
    return (u64)(expf((v - m) / temperature) * 4294967296.f);  // truncates; NaN gives 0
}

// What the mass histograms of digits [0, digits) say about the nucleus' boundary key: its digits
// (`prefix`, under `mask`), the weight of the keys above those digits (`above`), and `need`
// (0 when the row has no finite weight, or digits = 0). With k > 0 the histograms count keys
// (sample_select_pass for a top-k) and the boundary is the k-th largest key (need = min(k, the
// valid keys)). Each digit's bins are scanned from the
// top by the block, eight (or four) a thread; every thread gets the result. Launch with
// SAMPLE_ROW_THREADS threads.
struct SelectBoundary {
    u32 prefix, mask;
    u64 above, need;
};
__device__ __forceinline__ SelectBoundary select_boundary(const u64* hist, int digits, float top_p, int k = 0) {
    __shared__ SelectBoundary sh;
    const int tid = threadIdx.x;
    // Every digit's bins are loaded at once (they do not depend on the digits before).
    u64 mine[SELECT_DIGITS][8];
#pragma unroll
    for (int d = 0; d < SELECT_DIGITS; ++d) {
        const int bins = 1 << select_width(d), per = bins / (int)blockDim.x;
#pragma unroll
        for (int j = 0; j < 8; ++j)
            mine[d][j] = d < digits && j < per ? hist[d * SELECT_BINS + bins - 1 - (tid * per + j)] : 0;
    }
    SelectBoundary nb = {0u, 0u, 0ull, 0ull};
    if (digits > 0) {  // Z: digit 0's bins hold every weight
        u64 z = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) z += mine[0][j];
        z = block_reduce(z, [](u64 a, u64 b) { return a + b; });
        if (k > 0) nb.need = min((u64)k, z);  // counts: the k-th largest key
        else if (z > 0) nb.need = min(max((u64)ceil((double)top_p * (double)z), 1ull), z);
    }
#pragma unroll
    for (int d = 0; d < SELECT_DIGITS; ++d) {
        if (d >= digits || nb.need == 0) break;
        const int bins = 1 << select_width(d), per = bins / (int)blockDim.x, shift = select_shift(d);
        u64 sum = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) sum += mine[d][j];
        const u64 incl = block_inclusive_scan(sum);
        u64 above = nb.above + incl - sum;  // the bins above this thread's
        if (above < nb.need && nb.need <= nb.above + incl) {  // exactly one thread
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (j < per && above + mine[d][j] >= nb.need) {
                    sh.prefix = nb.prefix | ((u32)(bins - 1 - (tid * per + j)) << shift);
                    sh.above = above;
                    break;
                }
                above += mine[d][j];
            }
        }
        __syncthreads();
        nb.prefix = sh.prefix;
        nb.above = sh.above;
        nb.mask |= (u32)(bins - 1) << shift;
        __syncthreads();  // `sh` is read before the next digit's thread writes it
    }
    return nb;
}

// Launch with SAMPLE_ROW_THREADS threads and ceil(n / SAMPLE_ROW_RANGE) blocks, once a digit;
// `hist` zero before digit 0. For the nucleus (k = 0) after sample_row_max, the keys weighed by
// fixed_weight; for a top-k (k > 0, range_max unused) the keys counted, and digit 0's pass
// applies the penalties of its range first.
extern "C" __global__ void __launch_bounds__(SAMPLE_ROW_THREADS)
    sample_select_pass(float* logits, int n, const u32* pen_ids, const float* pen_amount, int n_pen,
                       const float* range_max, float temperature, float top_p, int k, int digit, u64* hist) {
    __shared__ u64 bins[SELECT_BINS];  // 16 KiB
    grid_dep();
    const Range range = block_range(n);
    if (n_pen > 0) penalise_range(logits, range, pen_ids, pen_amount, n_pen);
    float v[SAMPLE_ROW_PER_THREAD];
    load_range(logits, range, v);
    for (int b = threadIdx.x; b < SELECT_BINS; b += blockDim.x) bins[b] = 0;
    const float m = k > 0 ? 0.f : max_of_ranges(range_max);
    __syncthreads();  // the zeroed bins
    const SelectBoundary nb = select_boundary(hist, digit, top_p, k);
    const int shift = select_shift(digit);
    const u32 digit_mask = (1u << select_width(digit)) - 1u;
#pragma unroll
    for (int j = 0; j < SAMPLE_ROW_PER_THREAD; ++j) {
        const u32 key = ordered_bits(v[j]);
        if (v[j] == v[j] && (key & nb.mask) == nb.prefix) {
            const u64 w = k > 0 ? 1ull : fixed_weight(v[j], m, temperature);
            if (w) atomicAdd(&bins[(key >> shift) & digit_mask], w);
        }
    }
    __syncthreads();
    for (int b = threadIdx.x; b <= (int)digit_mask; b += blockDim.x)
        if (bins[b]) atomicAdd(&hist[digit * SELECT_BINS + b], bins[b]);
}

// Launch as sample_select_pass, after its passes for the nucleus; `ticket` zero (the last block
// leaves it and `hist` so). The draw is `u`, or *u_at where u_at is not null; with `params` not
// null the sample ends a chained decode step (finish_chained_step into `host_out`), `out` then
// the kernel's scratch.
extern "C" __global__ void __launch_bounds__(SAMPLE_ROW_THREADS)
    sample_nucleus_draw(const float* logits, int n, const float* range_max, float temperature, float top_p,
                        float min_p, u64* hist, double u, const double* u_at, u64* range_mass, u32* range_ties,
                        u32* ticket, int* out, int* params, int* host_out) {
    grid_dep();
    const int tid = threadIdx.x, ranges = gridDim.x;
    float v[SAMPLE_ROW_PER_THREAD];
    load_range(logits, block_range(n), v);
    const float m = max_of_ranges(range_max);
    const float cutoff = min_p_cutoff(m, temperature, min_p);
    const SelectBoundary nb = select_boundary(hist, SELECT_DIGITS, top_p);
    const u32 bound = nb.prefix;  // every digit known: the boundary key itself
    const float bound_v = from_ordered_bits(bound);
    // Its keys' weight (the same for each); the fewest of them that reach `need` belong.
    const u64 bound_w = fixed_weight(bound_v, m, temperature);
    const u64 ties_in = nb.need > nb.above && bound_w > 0 ? (nb.need - nb.above + bound_w - 1) / bound_w : 0;
    const u64 tie_w = bound_v >= cutoff ? bound_w : 0;
    auto above_weight = [&](float x) -> u64 {  // a key above the boundary's member weight
        return x == x && ordered_bits(x) > bound && x >= cutoff ? fixed_weight(x, m, temperature) : 0;
    };
    auto is_tie = [&](float x) { return x == x && ordered_bits(x) == bound; };
    {
        u64 mass = 0;
        u32 ties = 0;
#pragma unroll
        for (int j = 0; j < SAMPLE_ROW_PER_THREAD; ++j) {
            mass += above_weight(v[j]);
            ties += is_tie(v[j]);
        }
        mass = block_reduce(mass, [](u64 a, u64 b) { return a + b; });
        ties = block_reduce(ties, [](u32 a, u32 b) { return a + b; });
        const bool last = last_block_after(ticket, [&] {
            range_mass[blockIdx.x] = mass;
            range_ties[blockIdx.x] = ties;
        });
        if (!last) return;
    }
    // The last block: every block has read `hist` and written its range's sums.
    if (u_at) u = *u_at;
    for (int i = tid; i < SELECT_DIGITS * SELECT_BINS; i += blockDim.x) hist[i] = 0;
    const volatile u64* mass = range_mass;
    const volatile u32* ties = range_ties;
    // The member ties (the first ties_in in id order) end in range last_r, `last_n` of its own.
    int last_r = -1;
    u64 last_n = 0;
    if (ties_in > 0) {
        const Interval<u64> t = find_interval<u64>(
            ranges, [&](int r) { return (u64)ties[r]; }, [&](u64) { return ties_in - 1; });
        last_r = t.item;
        last_n = t.offset + 1;
    }
    auto range_weight = [&](int r) -> u64 {
        return mass[r] + (r < last_r ? (u64)ties[r] : r == last_r ? last_n : 0) * tie_w;
    };
    const Interval<u64> range = find_interval<u64>(ranges, range_weight, [&](u64 total) {
        return total ? min((u64)floor(u * (double)total), total - 1) : 0ull;
    });
    if (range.total == 0) {  // no finite weight (an infinite logit): the host takes the argmax
        const int t = block_argmax(logits, n);
        if (tid == 0) sample_done_by_this_thread(out, t, 0);
    } else {
        const int lo = range.item * SAMPLE_ROW_RANGE, len = min(n, lo + SAMPLE_ROW_RANGE) - lo;
        // The range's member ties end at id last_tie (all of them before last_r, none after).
        int last_tie = range.item < last_r ? n : -1;
        if (range.item == last_r) {
            const Interval<u64> t = find_interval<u64>(
                len, [&](int i) { return (u64)is_tie(logits[lo + i]); }, [&](u64) { return last_n - 1; });
            last_tie = lo + t.item;
        }
        const Interval<u64> id = find_interval<u64>(
            len,
            [&](int i) {
                const float x = logits[lo + i];
                return is_tie(x) ? (lo + i <= last_tie ? tie_w : 0ull) : above_weight(x);
            },
            [&](u64) { return range.offset; });
        if (tid == 0) sample_done_by_this_thread(out, lo + id.item, 0);
    }
    __syncthreads();
    if (params && tid == 0) finish_chained_step(params, host_out, out[0], out[1]);
}

// A top-k above the small top-k grid's (up to SAMPLE_MAX_CAND) on a grid: the same passes count
// the keys (sample_select_pass with k), which finds the k-th largest key b, then
//   sample_select_gather  every block copies its keys above b and, if they and every key equal to
//                         b fit SAMPLE_MAX_CAND, its keys equal to b into `cand` (packed, in any
//                         order: the merge sorts them); counts[0] counts them, counts[1] = 1 says
//                         they did not fit;
//   sample_select_merge   one block of SAMPLE_THREADS: the best min(k, valid) of `cand` are the
//                         host's candidates (its ties to the lower id are the larger packed keys),
//                         merge_and_choose chooses; where the keys equal to b did not fit (a row
//                         of many equal logits), the one block's path over the row instead
//                         (sample_candidates). It leaves `hist` and `counts` zero.
// Launch with SAMPLE_ROW_THREADS threads and ceil(n / SAMPLE_ROW_RANGE) blocks.
extern "C" __global__ void __launch_bounds__(SAMPLE_ROW_THREADS)
    sample_select_gather(const float* logits, int n, const u64* hist, int k, u64* cand, u32* counts) {
    grid_dep();
    const Range range = block_range(n);
    float v[SAMPLE_ROW_PER_THREAD];
    load_range(logits, range, v);
    const SelectBoundary nb = select_boundary(hist, SELECT_DIGITS, 1.f, k);
    const u32 bound = nb.prefix;
    // The last digit's bin of b counts the keys equal to it.
    const u64 ties = nb.need > 0 ? hist[(SELECT_DIGITS - 1) * SELECT_BINS + (bound & 1023u)] : 0;
    const bool fits = nb.above + ties <= (u64)SAMPLE_MAX_CAND;
    if (!fits) {
        if (blockIdx.x == 0 && threadIdx.x == 0) counts[1] = 1;
        return;
    }
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < SAMPLE_ROW_PER_THREAD; ++j) {
        const bool in = nb.need > 0 && v[j] == v[j] && ordered_bits(v[j]) >= bound;
        const unsigned ballot = __ballot_sync(FULL_MASK, in);
        if (!ballot) continue;
        u32 base = 0;  // one atomic a warp for its keys, each lane's place by its rank among them
        if (lane == __ffs(ballot) - 1) base = atomicAdd(&counts[0], (u32)__popc(ballot));
        base = __shfl_sync(FULL_MASK, base, __ffs(ballot) - 1);
        const int id = range.lo + j * SAMPLE_ROW_THREADS + (int)threadIdx.x;
        if (in) cand[base + __popc(ballot & ((1u << lane) - 1u))] = pack_max(v[j], id);
    }
}

// Launch with one block of SAMPLE_THREADS threads after sample_select_gather; `limit` = min(k, n).
// The draw is `u`, or *u_at where u_at is not null; with `params` not null the sample ends a
// chained decode step (finish_chained_step into `host_out`), `out` then the kernel's scratch.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_select_merge(const float* logits, int n, const u64* cand, u32* counts, u64* hist, int limit,
                        float temperature, float top_p, float min_p, double u, const double* u_at, int* out,
                        int* params, int* host_out) {
    __shared__ u64 shared_cand[SAMPLE_MAX_CAND];  // 32 KiB
    grid_dep();
    if (u_at) u = *u_at;
    const u32 count = counts[0], spilled = counts[1];
    for (int i = threadIdx.x; i < SELECT_DIGITS * SELECT_BINS; i += blockDim.x) hist[i] = 0;
    __syncthreads();  // every thread has read `counts`
    if (threadIdx.x == 0) counts[0] = counts[1] = 0;
    if (spilled) sample_candidates(logits, n, temperature, limit, top_p, min_p, u, out, shared_cand);
    else merge_and_choose(cand, (int)count, limit, temperature, top_p, min_p, u, out, shared_cand);
    __syncthreads();
    if (params && threadIdx.x == 0) finish_chained_step(params, host_out, out[0], out[1]);
}
