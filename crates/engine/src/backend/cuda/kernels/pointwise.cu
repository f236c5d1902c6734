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

// rms_norm with one warp per row, for short rows (the per-head and the GDN output norms: many
// rows of 64-256 columns, where a block per row spends its time in the block-wide sum and its
// barriers). Launch with 256 threads and ceil(rows / 8) blocks. The split (as rms_norm's) is of
// the rows as stored: heads of one token side by side make the token's row of the split.
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

// Columns per thread of add_rms_norm (`NORM_PER_THREAD`, mod.rs): a row is held in registers, so
// every load of x and y is issued before any store to x (looping with a store between loads
// waited for a round trip to memory per element).
constexpr int NORM_PER_THREAD = 8;

// The residual add fused with the next norm, for row blockIdx.x: x[r] += delta(c) for each
// column c, then out[r] = rmsnorm(x[r]) * w, and with split.hi its split (cols a multiple of 64).
// cols <= PER_THREAD * blockDim.x. The gains are read before the wait for the previous kernel
// (they are weights).
template <int PER_THREAD, class Delta>
__device__ __forceinline__ void add_rms_norm_row(float* x, const float* w, float* out, SplitOut split, int cols,
                                                 float eps, Delta delta) {
    pdl_launch_dependents();
    float g[PER_THREAD], v[PER_THREAD];
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        g[i] = c < cols ? w[c] : 0.f;
    }
    pdl_wait();
    const size_t base = (size_t)blockIdx.x * cols;
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        v[i] = c < cols ? x[base + c] + delta(c) : 0.f;
        ss = fmaf(v[i], v[i], ss);
    }
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < cols) x[base + c] = v[i];
    }
    const float inv = 1.f / sqrtf(block_sum(ss) / (float)cols + eps);
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < cols) out[base + c] = v[i] * inv * g[i];
    }
    if (split.hi) {
        __syncthreads();  // the row's values are visible to the whole block
        split_row(out + base, split, blockIdx.x, cols, threadIdx.x, blockDim.x);
    }
}

// x[r] += y[r], then out[r] = rmsnorm(x[r]) * w; one block per row.
extern "C" __global__ void add_rms_norm(float* x, const float* y, const float* w, float* out, SplitOut split,
                                        int cols, float eps) {
    const float* yr = y + (size_t)blockIdx.x * cols;
    add_rms_norm_row<NORM_PER_THREAD>(x, w, out, split, cols, eps, [&](int c) { return yr[c]; });
}

// The MoE block's output mixed into the residual add (moe_combine's sum, in its order), then the
// next norm: one block per token t over y [pairs (+ tokens), cols] (pair t * top_k + j is token
// t's j-th expert; with a shared expert, pair pairs + t is its output, gated by
// sigmoid(shared_logit[t])). One block reads the row's k + 1 outputs, so they are loaded all at
// once: two columns a thread (cols <= 2 * blockDim.x), mixed by moe_mix (common.cuh). At most 32
// registers (8 bytes spilled), so that two blocks of 1,024 threads (the 35B's rows) share an SM:
// with 48 only one fitted, and each SM waited on its loads, then its sums and stores, in turn
// (a 4,096-token chunk's mixes 7.0 -> 5.4 ms, docs/performance.md, run46).
extern "C" __global__ void __launch_bounds__(1024, 2)
    moe_combine_add_rms_norm(const float* y, const float* weights, const float* shared_logit, float* x, const float* w,
                             float* out, SplitOut split, int cols, int top_k, float eps) {
    const size_t t = blockIdx.x, pairs = (size_t)gridDim.x * top_k;
    const float* wt = weights + t * top_k;
    const float* yt = y + t * top_k * cols;
    const float* ys = y + (pairs + t) * cols;
    add_rms_norm_row<2>(x, w, out, split, cols, eps, [&](int c) {
        return moe_mix(
            wt, top_k, shared_logit ? shared_logit + t : nullptr, [&](int j) { return yt[(size_t)j * cols + c]; },
            [&] { return ys[c]; });
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
// multiple of 64 columns, 16-byte aligned buffers). Launch with 256 threads and
// ceil(blocks8 / 256) blocks.
extern "C" __global__ void sigmoid_mul_split(const float* x, const float* gate, float* out, SplitOut split,
                                             long long blocks8) {
    grid_dep();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    // A group's 8 threads are all in range or all out (blocks8 is a multiple of 8).
    if (i >= blocks8) return;
    const float4* x4 = reinterpret_cast<const float4*>(x) + 2 * i;
    const float4* g4 = reinterpret_cast<const float4*>(gate) + 2 * i;
    const float4 xa = x4[0], xb = x4[1], ga = g4[0], gb = g4[1];
    const float f[8] = {xa.x * sigmoid(ga.x), xa.y * sigmoid(ga.y), xa.z * sigmoid(ga.z), xa.w * sigmoid(ga.w),
                        xb.x * sigmoid(gb.x), xb.y * sigmoid(gb.y), xb.z * sigmoid(gb.z), xb.w * sigmoid(gb.w)};
    float4* o4 = reinterpret_cast<float4*>(out) + 2 * i;
    o4[0] = make_float4(f[0], f[1], f[2], f[3]);
    o4[1] = make_float4(f[4], f[5], f[6], f[7]);
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
