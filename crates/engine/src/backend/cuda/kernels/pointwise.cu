// Row-wise and elementwise ops: RMS norms (plain, per head, gated), residual adds, SwiGLU, the
// attention output gate, the shared-expert gate, the q/gate split, and the argmax of logits rows.
// Every reduction in f32.
//
// The ops whose output a tensor-core product reads next (the norms before the in-projections,
// the router and the experts, the GDN output norm, the attention's output gate) can also write
// that output's split (`SplitOut`, common.cuh) from the values they stored, so that the product
// needs no split pass of its own over [T, cols] (mod.rs, `CudaTensor::split`).

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, one block per row of `cols` (rows may be
// heads: the per-head norms call this with cols = head_dim). If z is given, the result is
// multiplied by silu(z[r]) (the GDN output norm). With split.hi, of rows of a multiple of 64
// columns, the split of out too.
extern "C" __global__ void rms_norm(const float* x, const float* w, const float* z, float* out, SplitOut split,
                                    int cols, float eps) { grid_dep();
    const size_t base = (size_t)blockIdx.x * cols;
    float ss = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = x[base + c];
        ss = fmaf(v, v, ss);
    }
    const float inv = 1.f / sqrtf(block_sum(ss) / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = x[base + c] * inv * w[c];
        if (z) v *= silu(z[base + c]);
        out[base + c] = v;
    }
    if (split.hi) {
        __syncthreads();  // the row's values are visible to the whole block
        split_row(out + base, split, blockIdx.x, cols, threadIdx.x, blockDim.x);
    }
}

// rms_norm with one warp per row, for many short rows (a block per row spends its time in the
// block-wide sum and its barriers) whose 8-column blocks do not fill a warp's lanes evenly
// (rms_norm_rows8 below takes the head dims 64, 128, 256 and 512). Launch with 256 threads and
// ceil(rows / 8) blocks. The split (as rms_norm's) is of the rows as stored: heads of one token
// side by side make the token's row of the split.
extern "C" __global__ void rms_norm_warp(const float* x, const float* w, const float* z, float* out,
                                         SplitOut split, int rows, int cols, float eps) {
    grid_dep();
    const int lane = threadIdx.x & 31, r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;
    const size_t base = (size_t)r * cols;
    float ss = 0.f;
    for (int c = lane; c < cols; c += 32) {
        const float v = x[base + c];
        ss = fmaf(v, v, ss);
    }
    const float inv = 1.f / sqrtf(warp_sum(ss) / (float)cols + eps);
    for (int c = lane; c < cols; c += 32) {
        float v = x[base + c] * inv * w[c];
        if (z) v *= silu(z[base + c]);
        out[base + c] = v;
    }
    if (split.hi) {
        __syncwarp();  // the row's values are visible to the whole warp
        split_row(out + base, split, r, cols, lane, 32);
    }
}

// rms_norm_warp for rows of a multiple of 8 columns whose 8-column blocks (cols / 8 of them)
// divide 32 or are a multiple of it: min(32, cols / 8) lanes of a warp a row, each taking 8
// consecutive columns at a time as two float4, and with split.hi writing the split from the same
// registers. The strided form above spent a load and a store instruction a column and read its
// output back for the split (the GDN output norm, 4,096 x 32 rows of 128 a chunk: 2.6 TB/s,
// docs/performance.md, run49). out may be null where split.hi is set: the output kept as its split
// alone (mod.rs, `LazySplit`), made plain later by this kernel with out and no split, from the
// same registers' values. Launch with 256 threads and ceil(rows / (8 * 32 / lanes)) blocks.
extern "C" __global__ void rms_norm_rows8(const float* x, const float* w, const float* z, float* out, SplitOut split,
                                          int rows, int cols, float eps) {
    grid_dep();
    const int blocks8 = cols >> 3, lanes = min(32, blocks8), lane = threadIdx.x & 31;
    const int r = (blockIdx.x * blockDim.x + threadIdx.x) / lanes, b0 = lane % lanes;
    if (r >= rows) return;  // the whole row's lanes alike
    // The row's lanes: the shuffles below stay among them.
    const u32 mask = lanes == 32 ? ~0u : ((1u << lanes) - 1) << (lane - b0);
    constexpr int MAX_PER_LANE = 2;  // cols <= 512 (SHORT_NORM_COLS, mod.rs)
    float v[MAX_PER_LANE][8];
    float ss = 0.f;
    const size_t base = (size_t)r * cols;
#pragma unroll
    for (int k = 0; k < MAX_PER_LANE; ++k) {
        const int b = b0 + k * lanes;
        if (b < blocks8) {
            load8(x + base + 8 * b, v[k]);
#pragma unroll
            for (int c = 0; c < 8; ++c) ss = fmaf(v[k][c], v[k][c], ss);
        }
    }
    for (int o = 1; o < lanes; o <<= 1) ss += __shfl_xor_sync(mask, ss, o);
    const float inv = 1.f / sqrtf(ss / (float)cols + eps);
#pragma unroll
    for (int k = 0; k < MAX_PER_LANE; ++k) {
        const int b = b0 + k * lanes;
        if (b >= blocks8) continue;
        float g[8], zv[8];
        load8(w + 8 * b, g);
        if (z) load8(z + base + 8 * b, zv);
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            v[k][c] = v[k][c] * inv * g[c];
            if (z) v[k][c] *= silu(zv[c]);
        }
        if (out) store8(out + base + 8 * b, v[k]);
        if (split.hi) store_split8(v[k], split, (long long)r * blocks8 + b);
    }
}

// The residual add fused with the next norm, for row blockIdx.x, an 8-column block a thread:
// thread b's columns 8b .. 8b + 7 of x_out[r] = x_in[r] + d, the values that delta(d, n, vec)
// loads (n of them in the row; vec: cols a multiple of 8, see load_cols8; x_out may be x_in),
// then out[r] = rmsnorm(x_out[r]) * w and, with split.hi, its split from the same registers
// (store_split8; cols a multiple of 64). Without ADD, x_in is only normed (x_out unused). out may
// be null where split.hi is set: the output kept as its split alone (mod.rs, `LazySplit`), made
// plain later by rms_norm_row8 from x_out with the same block shape, hence the same sums.
// Loads are float4, and the split needs neither a second pass over the row nor a barrier before
// it: with a thread per strided column the MoE mix spent ~360 instructions a column and moved
// ~2.7 TB/s (docs/performance.md, run49). cols at most 8 * blockDim.x, and a multiple of 8 unless
// ANY_WIDTH; 16-byte aligned rows.
template <bool ANY_WIDTH, bool ADD, class Delta>
__device__ __forceinline__ void add_rms_norm_row8(const float* x_in, float* x_out, const float* w, float* out,
                                                  SplitOut split, int cols, float eps, Delta delta) {
    const int b = threadIdx.x, n = min(8, cols - 8 * b);
    const bool mine = n > 0, vec = !ANY_WIDTH || (cols & 7) == 0;
    const size_t at = (size_t)blockIdx.x * cols + 8 * b;  // this block's offset in a [T, cols] tensor
    grid_dep();
    float v[8] = {};
    if (mine) {
        load_cols8(x_in + at, v, n, vec);
        if constexpr (ADD) {
            float d[8];
            delta(d, n, vec);
#pragma unroll
            for (int c = 0; c < 8; ++c) v[c] += d[c];
            store_cols8(x_out + at, v, n, vec);
        }
    }
    float ss = 0.f;
#pragma unroll
    for (int c = 0; c < 8; ++c) ss = fmaf(v[c], v[c], ss);
    const float inv = 1.f / sqrtf(block_sum(ss) / (float)cols + eps);
    if (!mine) return;
    // The gains after the sum: held from the start, they cost the MoE mix's loads registers.
    float g[8];
    load_cols8(w + 8 * b, g, n, vec);
#pragma unroll
    for (int c = 0; c < 8; ++c) v[c] = v[c] * inv * g[c];
    if (out) store_cols8(out + at, v, n, vec);
    if (split.hi) store_split8(v, split, (long long)(at >> 3));
}

// x_out[r] = x_in[r] + y[r], then out[r] = rmsnorm(x_out[r]) * w; one block per row of
// ceil(cols / 8) threads rounded up to a multiple of 32 (add_rms_norm_row8), rows of any width.
// y may come in `parts` partial sums (a product split along K, qmma.cu's DenseTiles), rows x cols
// floats apart, added in order.
extern "C" __global__ void add_rms_norm(const float* x_in, float* x_out, const float* y, int parts, const float* w,
                                        float* out, SplitOut split, int cols, float eps) {
    add_rms_norm_row8<true, true>(x_in, x_out, w, out, split, cols, eps, [&](float (&d)[8], int n, bool vec) {
        const float* at = y + (size_t)blockIdx.x * cols + 8 * threadIdx.x;
        load_cols8(at, d, n, vec);
        for (int q = 1; q < parts; ++q) {
            float e[8];
            load_cols8(at + (size_t)q * gridDim.x * cols, e, n, vec);
#pragma unroll
            for (int c = 0; c < 8; ++c) d[c] += e[c];
        }
    });
}

// out[r] = rmsnorm(x[r]) * w as add_rms_norm_row8 norms (launched as add_rms_norm and
// moe_combine_add_rms_norm are, so the same sums give the same values): the f32 values of their
// output where they kept only its split.
extern "C" __global__ void rms_norm_row8(const float* x, const float* w, float* out, int cols, float eps) {
    add_rms_norm_row8<true, false>(x, nullptr, w, out, SplitOut{}, cols, eps, [](float (&)[8], int, bool) {});
}

// Experts whose outputs a moe_combine_add_rms_norm thread holds at once (the 35B's eight): with
// MIX_LOADS' ten the kernel needed 176 registers, one block an SM.
constexpr int COMBINE_LOADS = 8;

// The MoE block's output mixed into the residual add (moe_combine's sum, in its order), then the
// next norm (add_rms_norm_row8): one block per token t over y [pairs (+ tokens), cols] (pair
// t * top_k + j is token t's j-th expert; with a shared expert, pair pairs + t is its output,
// gated by sigmoid(shared_logit[t])). Thread b's k + 1 outputs are loaded at once, two float4
// each, and mixed column by column by moe_mix_sum (common.cuh), as moe_mix mixes. cols a
// multiple of 8 (the mod.rs side checks), at most 8 * 256; launch with cols / 8 threads rounded
// up to a multiple of 32.
extern "C" __global__ void __launch_bounds__(256, 2)
    moe_combine_add_rms_norm(const float* y, const float* weights, const float* shared_logit, const float* x_in,
                             float* x_out, const float* w, float* out, SplitOut split, int cols, int top_k,
                             float eps) {
    const size_t t = blockIdx.x, pairs = (size_t)gridDim.x * top_k;
    add_rms_norm_row8<false, true>(x_in, x_out, w, out, split, cols, eps, [&](float (&d)[8], int, bool) {
        const float* wt = weights + t * top_k;
        const float* yt = y + t * top_k * cols + 8 * threadIdx.x;
        float yv[COMBINE_LOADS][8], s[8] = {};
#pragma unroll
        for (int j = 0; j < COMBINE_LOADS; ++j)
            if (j < top_k) load8(yt + (size_t)j * cols, yv[j]);
        if (shared_logit) load8(y + (pairs + t) * cols + 8 * threadIdx.x, s);
        const float den = shared_logit ? 1.f + expf(-shared_logit[t]) : 1.f;
#pragma unroll
        for (int c = 0; c < 8; ++c)
            d[c] = moe_mix_sum<COMBINE_LOADS>(
                wt, top_k, [&](int j) { return yv[j][c]; }, [&](int j) { return yt[(size_t)j * cols + c]; },
                shared_logit != nullptr, s[c], den);
    });
}

// x += y.
extern "C" __global__ void add_assign(float* x, const float* y, long long n) { grid_dep();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// out = silu(g) * u.
extern "C" __global__ void swiglu(const float* g, const float* u, float* out, long long n) { grid_dep();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = silu(g[i]) * u[i];
}

// out = x * sigmoid(gate).
extern "C" __global__ void sigmoid_mul(const float* x, const float* gate, float* out, long long n) { grid_dep();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] * sigmoid(gate[i]);
}

// sigmoid_mul with out's split as well: a thread per 8-column block (blocks8 of them, rows of a
// multiple of 64 columns, 16-byte aligned buffers); out null keeps the split alone (mod.rs,
// `LazySplit`; sigmoid_mul makes the same values later). Launch with 256 threads and
// ceil(blocks8 / 256) blocks.
extern "C" __global__ void sigmoid_mul_split(const float* x, const float* gate, float* out, SplitOut split,
                                             long long blocks8) {
    grid_dep();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    // A group's 8 threads are all in range or all out (blocks8 is a multiple of 8).
    if (i >= blocks8) return;
    float f[8], g[8];
    load8(x + 8 * i, f);
    load8(gate + 8 * i, g);
#pragma unroll
    for (int c = 0; c < 8; ++c) f[c] *= sigmoid(g[c]);
    if (out) store8(out + 8 * i, f);
    store_split8(f, split, i);
}

// out[t][c] += sigmoid(gate_logit[t]) * y[t][c].
extern "C" __global__ void add_sigmoid_gated(float* out, const float* y, const float* gate_logit, int rows,
                                            int cols) { grid_dep();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    out[i] += sigmoid(gate_logit[i / cols]) * y[i];
}

// The q projection holds per head [query (d) | gate (d)]: q[t][h][:] and g[t][h][:].
extern "C" __global__ void split_q_gate(const float* qg, float* q, float* g, int rows, int heads, int d) { grid_dep();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long n = (long long)rows * heads * d;
    if (i >= n) return;
    const long long hd = i / d, j = i % d;
    q[i] = qg[hd * 2 * d + j];
    g[i] = qg[hd * 2 * d + d + j];
}

// First index of the maximum of each row; NaN never wins. Each (value, index) pair is packed in
// a u64 that orders as the comparison wants: the value's bits made monotonic in the high half,
// the complement of the index in the low half (a lower index wins a tie). Blocks of a row reduce
// their slice and combine with one atomicMax into key[row], which starts at 0 ("nothing seen":
// every packed non-NaN value is larger); the host decodes the winning index.

// One block's best packed (value, index) over its 2,048 columns of `row` (0: none), in thread 0.
__device__ __forceinline__ u64 argmax_block(const float* row, int cols) {
    __shared__ u64 part[8];
    u64 best = 0;
    const int base = blockIdx.x * 2048;
    const int end = min(base + 2048, cols);
    for (int c = base + threadIdx.x; c < end; c += blockDim.x) {
        const float v = row[c];
        if (v == v) best = max(best, pack_max(v, c));
    }
    for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) best = max(best, part[w]);
    return best;
}

// Launch with 256 threads and (ceil(cols / 2048), rows) blocks, key zeroed.
extern "C" __global__ void argmax_rows(const float* x, u64* key, int cols) { grid_dep();
    const u64 best = argmax_block(x + (size_t)blockIdx.y * cols, cols);
    if (threadIdx.x == 0 && best) atomicMax(key + blockIdx.y, best);
}

// The greedy choice that ends a chained decode step: argmax_rows over one row, then the last block
// to finish decodes the key (0: every value NaN, index 0, as the host), ends the step
// (finish_chained_step) and zeroes key and ticket for the next replay. Launch with 256 threads and
// ceil(cols / 2048) blocks; key and ticket zeroed once, at allocation.
extern "C" __global__ void step_argmax(const float* x, u64* key, u32* ticket, int cols, int* params,
                                       int* host_out) { grid_dep();
    const u64 best = argmax_block(x, cols);
    if (threadIdx.x != 0) return;
    if (best) atomicMax(key, best);
    __threadfence();  // this block's maximum is in `key` before its ticket counts
    if (atomicAdd(ticket, 1u) != gridDim.x - 1) return;
    const u64 k = atomicExch(key, 0ull);
    *ticket = 0;
    finish_chained_step(params, host_out, packed_index(k), 0);
}
