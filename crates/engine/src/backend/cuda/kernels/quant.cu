// MLX affine quantized products for decode: matrix-vector, the embedding gather, and the
// routed-expert products of the mixture of experts (prefill's products are in qmma.cu).
//
// w[r][c] = scale[r][c/64] * q[r][c] + bias[r][c/64], codes packed low bits first in u32 words,
// scales and biases bf16. Per group the matrix-vector product is scale * sum(q * x) + bias *
// sum(x), in f32, without rounding the dequantized weight (as the CPU reference computes it).
//
// No CUDA headers: NVRTC has no default include path, and bf16 is read as its 16 raw bits.
// QMat and bf16_to_f32 live in common.cuh (the tensor-core products of qmma.cu share them).


// A code used in place: masked, not shifted, its bits read as a float. Codes wholly below bit 24
// stay where they are; the others are taken from the word shifted down by 8. Below 2^24 the bits
// m of a float are exactly m * 2^-149 (a denormal, or the first binade above them), so the code
// at bit offset o reads as q * 2^(o - 149), and its product with x * 2^(CODE_X_EXP - o) is
// q * x * 2^-CODE_DOT_EXP, exact: the dot product over a vector is the plain one scaled by a
// power of two, bit for bit, and is scaled back once per vector. One mask (LOP3) and one FFMA a
// code: converting each code (I2FP) or offsetting it into a normal float (and subtracting the
// offset) costs a third instruction, and the decode products are bound by instruction issue
// (Nsight Compute: 66% of issue slots for the lm_head, docs/performance.md). The staged x may
// not reach 2^59, 5.8e17 (it would overflow; activations stay many orders of magnitude below),
// and a term q * x under 2^-46 keeps its absolute error under 2^-70 instead of its relative one.
#define CODE_DOT_EXP 80
#define CODE_X_EXP (149 - CODE_DOT_EXP)

template <int BITS>
__device__ __forceinline__ constexpr bool code_in_place(int j) { return BITS * (j + 1) <= 24; }

template <int BITS>
__device__ __forceinline__ constexpr int code_offset(int j) { return code_in_place<BITS>(j) ? BITS * j : BITS * j - 8; }

// Code j of a word as the float q * 2^(code_offset(j) - 149); `shifted` is word >> 8. j is a
// constant once the callers' loops unroll.
template <int BITS>
__device__ __forceinline__ float code_value(u32 word, u32 shifted, int j) {
    return __uint_as_float((code_in_place<BITS>(j) ? word : shifted) & (((1u << BITS) - 1u) << code_offset<BITS>(j)));
}

// Stages x (cols floats) in shared memory for the matrix-vector loop, in two parts:
//   xs[j][w] = x[w * PER_WORD + j] * 2^(CODE_X_EXP - code_offset(j)), transposed, so that the
//     loop reads four consecutive words' x values as one float4, and scaled for the codes used in
//     place (above);
//   xsum[v] (after the cols values) = the sum of x over vector v's 4 * PER_WORD columns, which
//     every row's group bias multiplies: summed once per block instead of once per row, in the
//     order the loop used to sum it.
// One thread per vector (four words). Shared memory: gemv_smem_bytes(cols) in mod.rs. `scale(v)`
// multiplies vector v's values as they are read (stage_x: none; a HeadNorm: its head's norm).
// stage_x_by: the vectors v = first, first + step, ... (a warp staging a row of its own).
template <int BITS, class Scale>
__device__ __forceinline__ void stage_x_scaled_by(float* xs, const float* __restrict__ x, int cols, Scale scale,
                                                  int first, int step) {
    constexpr int PER_WORD = 32 / BITS;
    const int words = cols / PER_WORD, vecs = words / 4;
    float* xsum = xs + cols;
    for (int v = first; v < vecs; v += step) {
        const float4* src = reinterpret_cast<const float4*>(x + (size_t)v * 4 * PER_WORD);
        float f[4][PER_WORD];
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int h = 0; h < PER_WORD / 4; ++h) {
                const float4 a = src[k * PER_WORD / 4 + h];
                f[k][4 * h] = a.x, f[k][4 * h + 1] = a.y, f[k][4 * h + 2] = a.z, f[k][4 * h + 3] = a.w;
            }
        const float sv = scale(v);
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int j = 0; j < PER_WORD; ++j) f[k][j] *= sv;
        float sx = 0.f;
#pragma unroll
        for (int j = 0; j < PER_WORD; ++j) {
            sx += (f[0][j] + f[1][j]) + (f[2][j] + f[3][j]);
            const float scale = __int_as_float((127 + CODE_X_EXP - code_offset<BITS>(j)) << 23);
#pragma unroll
            for (int k = 0; k < 4; ++k) xs[j * words + 4 * v + k] = f[k][j] * scale;
        }
        xsum[v] = sx;
    }
}

template <int BITS, class Scale>
__device__ __forceinline__ void stage_x_scaled(float* xs, const float* __restrict__ x, int cols, Scale scale) {
    stage_x_scaled_by<BITS>(xs, x, cols, scale, (int)threadIdx.x, (int)blockDim.x);
}

template <int BITS>
__device__ __forceinline__ void stage_x(float* xs, const float* __restrict__ x, int cols) {
    stage_x_scaled<BITS>(xs, x, cols, [](int) { return 1.f; });
}

// The floats a staged row of `cols` takes: gemv_smem_bytes(cols) / 4 (mod.rs), for a kernel that
// stages several rows side by side.
__device__ __forceinline__ constexpr int staged_x_floats(int cols) { return cols + cols / 16; }

template <int BITS>
__device__ __forceinline__ void stage_x_by(float* xs, const float* __restrict__ x, int cols, int first, int step) {
    stage_x_scaled_by<BITS>(xs, x, cols, [](int) { return 1.f; }, first, step);
}

// One token's input row normed lazily: rmsnorm(x) * gains, where the kernel that wrote the
// residual x (qgemv_add_sumsq, moe_down_mix) wrote x * gains as the product's input and left the
// sum of squares of x as `count` partial sums, one per block, instead of a launch of its own
// norming it. A product over it scales its sums by rsqrt(mean(x^2) + eps), which the product's
// linearity makes the same value as norming first, up to rounding. partials == nullptr: the input
// is used as it is (several tokens, or a row normed already). Passed by value.
struct RowNorm {
    const float* partials;
    int count;
    int n;
    float eps;
};

// A lane's first ROW_NORM_LOADS partials of a RowNorm (0 past the count, or without one), loaded
// as soon as the kernel that wrote them is waited for, and summed only after the staging of x
// (row_norm_scale): the two loads overlap instead of taking a round trip to L2 each.
#define ROW_NORM_LOADS 8
__device__ __forceinline__ void row_norm_load(const RowNorm& nrm, float (&part)[ROW_NORM_LOADS]) {
#pragma unroll
    for (int j = 0; j < ROW_NORM_LOADS; ++j) {
        const int i = (int)(threadIdx.x & 31) + 32 * j;
        part[j] = nrm.partials && i < nrm.count ? nrm.partials[i] : 0.f;
    }
}

// The scale of a RowNorm's row (1 without one), its partials summed in a fixed order; called by
// every lane of a warp.
__device__ __forceinline__ float row_norm_scale(const RowNorm& nrm, const float (&part)[ROW_NORM_LOADS]) {
    if (!nrm.partials) return 1.f;
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < ROW_NORM_LOADS; ++j) s += part[j];
    for (int i = (int)(threadIdx.x & 31) + 32 * ROW_NORM_LOADS; i < nrm.count; i += 32) s += nrm.partials[i];
    return 1.f / sqrtf(warp_sum(s) / (float)nrm.n + nrm.eps);
}

// Sum over each group of LANES lanes (32: the warp; 16: each half).
template <int LANES>
__device__ __forceinline__ float lanes_sum(float v) {
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The first of the R consecutive rows this lane works on: a warp takes R rows per group of
// LANES lanes (LANES = 16 puts two groups of rows side by side, for rows of at most 16 vectors,
// which would leave half of a 32-lane warp idle).
template <int R, int LANES>
__device__ __forceinline__ int first_row(int warp_in_grid) {
    return (warp_in_grid * (32 / LANES) + (int)(threadIdx.x & 31) / LANES) * R;
}

// This thread's warp in the grid along x (8 warps per block).
__device__ __forceinline__ int warp_in_grid() { return (int)(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)); }

// Whether the whole warp is past the last row (the lane sums need every lane of a working warp).
template <int R, int LANES>
__device__ __forceinline__ bool warp_idle(int warp_in_grid, int rows) {
    return warp_in_grid * R * (32 / LANES) >= rows;
}

// R rows' dot products with a staged x. A row is a run of 16-byte vectors of codes; lane l of its
// LANES takes vectors l, l + LANES, ..., U of them per round, all U loads issued before any is
// used. `load(0)` may run before the previous kernel has finished (the weights never change), so
// that the first round's loads overlap its tail; `run` does the rest once x is staged.
// Per 64-column group the sum is scale * sum(q * x) + bias * sum(x), in f32, without rounding the
// dequantized weight (as the CPU reference computes it). Needs cols to be a multiple of 64.
template <int BITS, int R, int U, int LANES>
struct QRows {
    static constexpr int PER_WORD = 32 / BITS;
    QMat w;
    int row0, nrows, words, groups, vecs;
    uint4 q[R][U];
    u16 s[R][U], b[R][U];

    __device__ __forceinline__ QRows(QMat w_, int row0_, int nrows_, int cols)
        : w(w_), row0(row0_), nrows(nrows_), words(cols / PER_WORD), groups(cols >> 6),
          vecs(cols / PER_WORD / 4) {}

    __device__ __forceinline__ int vec(int base, int u) const {
        return base + (int)(threadIdx.x & (LANES - 1)) + LANES * u;
    }

    // Loads of vectors vec(base, 0..U-1) of each row; past the end they are zeros (a zero scale
    // and bias add nothing).
    __device__ __forceinline__ void load(int base) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int v = vec(base, u), row = row0 + r;
                if (row < nrows && v < vecs) {
                    q[r][u] = __ldg(reinterpret_cast<const uint4*>(w.codes + (size_t)row * words) + v);
                    const size_t gi = (size_t)row * groups + ((v * 4 * PER_WORD) >> 6);
                    s[r][u] = __ldg(w.scales + gi);
                    b[r][u] = __ldg(w.biases + gi);
                } else {
                    q[r][u] = make_uint4(0u, 0u, 0u, 0u);
                    s[r][u] = 0;
                    b[r][u] = 0;
                }
            }
        }
    }

    // Vector v's staged x values (stage_x: scaled per code position) and their sum.
    __device__ __forceinline__ void read_x(const float* xs, int v, float4 (&xv)[PER_WORD], float& sx) const {
#pragma unroll
        for (int j = 0; j < PER_WORD; ++j) xv[j] = reinterpret_cast<const float4*>(xs + j * words)[v];
        sx = xs[words * PER_WORD + v];
    }

    // Adds vector u of the loaded round to each row's sum.
    __device__ __forceinline__ void add(int u, const float4 (&xv)[PER_WORD], float sx, float acc[R]) const {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const uint4 c = q[r][u];
            const uint4 shifted = make_uint4(c.x >> 8, c.y >> 8, c.z >> 8, c.w >> 8);
            float dot = 0.f;
#pragma unroll
            for (int j = 0; j < PER_WORD; ++j) {
                dot = fmaf(code_value<BITS>(c.x, shifted.x, j), xv[j].x, dot);
                dot = fmaf(code_value<BITS>(c.y, shifted.y, j), xv[j].y, dot);
                dot = fmaf(code_value<BITS>(c.z, shifted.z, j), xv[j].z, dot);
                dot = fmaf(code_value<BITS>(c.w, shifted.w, j), xv[j].w, dot);
            }
            dot *= __int_as_float((127 + CODE_DOT_EXP) << 23);  // exact
            acc[r] = fmaf(bf16_to_f32(s[r][u]), dot, fmaf(bf16_to_f32(b[r][u]), sx, acc[r]));
        }
    }

    // The loaded round of vectors at `base`, added to each row's sum; with `o`, to o's rows' too
    // (into oacc), from the same reads of x.
    __device__ __forceinline__ void accumulate(int base, const float* xs, float acc[R], const QRows* o,
                                               float* oacc) const {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int v = vec(base, u);
            if (v >= vecs) break;
            float4 xv[PER_WORD];
            float sx;
            read_x(xs, v, xv, sx);
            add(u, xv, sx, acc);
            if (o) o->add(u, xv, sx, oacc);
        }
    }

    // After load(0) and the staging of x: every vector of the rows, reduced over the lanes (the
    // sums are valid in each group's first lane). With `o` (its load(0) done too), the rows of a
    // second matrix over the same columns (an expert's up rows beside its gate rows) take their
    // sums into oacc from the same reads of x.
    __device__ __forceinline__ void run(const float* xs, float acc[R], QRows* o = nullptr, float* oacc = nullptr) {
        accumulate(0, xs, acc, o, oacc);
        for (int base = LANES * U; base < vecs; base += LANES * U) {
            load(base);
            if (o) o->load(base);
            accumulate(base, xs, acc, o, oacc);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            acc[r] = lanes_sum<LANES>(acc[r]);
            if (o) oacc[r] = lanes_sum<LANES>(oacc[r]);
        }
    }

    __device__ __forceinline__ bool writer(int r) const {
        return (threadIdx.x & (LANES - 1)) == 0 && row0 + r < nrows;
    }
};

// When the next kernel launches: the products let it launch (pdl_launch_dependents) only once
// they have waited for their input and staged it, not at their start. Launched at the start, the
// next kernel's blocks take the SMs' slots and issue their weight loads while this kernel's own
// first loads are in flight: decode was 7-9% slower (docs/performance.md, run12). The next
// kernel's weight loads still overlap this kernel's main loop.

// A product's input row staged (stage_x), then the barrier, then the next kernel's launch (only
// now: see above); returns the scale of the row's RowNorm (1 without one), whose partials are
// loaded before the staging and summed after it. Every thread of the block calls it, after the
// wait for the kernel that wrote x.
// `scale` as stage_x_scaled's.
template <int BITS, class Scale>
__device__ __forceinline__ float stage_input_scaled(float* xs, const float* __restrict__ x, int cols,
                                                    const RowNorm& nrm, Scale scale) {
    float part[ROW_NORM_LOADS];
    row_norm_load(nrm, part);
    stage_x_scaled<BITS>(xs, x, cols, scale);
    __syncthreads();
    pdl_launch_dependents();
    return row_norm_scale(nrm, part);
}

template <int BITS>
__device__ __forceinline__ float stage_input(float* xs, const float* __restrict__ x, int cols, const RowNorm& nrm) {
    return stage_input_scaled<BITS>(xs, x, cols, nrm, [](int) { return 1.f; });
}

// The matrix-vector variants, by the rows each warp takes (and the blocks per SM their registers
// must allow):
//   r4:  four rows per warp, each x value reused for four rows (large matrices);
//   r1:  one row per warp, four times the blocks (a small matrix still fills the GPU);
//   h16: four rows per half warp (rows of at most 16 vectors, 512 4-bit columns, are one 16-byte
//        load per lane: four rows keep 2 KiB per warp in flight).
// Each launches with 256 threads and ceil(rows / ROWS_PER_BLOCK) blocks along x, ROWS_PER_BLOCK
// being 32, 8 and 64 (mod.rs, `GEMV_SHAPES`).
// X(rows per lane group, vectors per lane per round, lanes per row, suffix, blocks per SM)
#define GEMV_VARIANTS(X)     \
    X(4, 2, 32, , 2)          \
    X(1, 4, 32, _r1, 3)       \
    X(4, 1, 16, _h16, 3)

// y[t][r] = sum_c w[r][c] * x[t][c], one token per blockIdx.y. Launch with 256 threads,
// gemv_smem_bytes(cols) of dynamic shared memory (mod.rs).
// With a RowNorm (one token), x is that lazily normed row.
template <int BITS, int R, int U, int LANES>
__device__ __forceinline__ void qgemv(QMat w, const float* __restrict__ x, float* __restrict__ y, int rows,
                                      int cols, const RowNorm& nrm) {
    extern __shared__ float xs[];
    QRows<BITS, R, U, LANES> m(w, first_row<R, LANES>(warp_in_grid()), rows, cols);
    m.load(0);
    pdl_wait();
    const float scale = stage_input<BITS>(xs, x + (size_t)blockIdx.y * cols, cols, nrm);
    if (warp_idle<R, LANES>(warp_in_grid(), rows)) return;
    float acc[R] = {};
    m.run(xs, acc);
#pragma unroll
    for (int r = 0; r < R; ++r)
        if (m.writer(r)) y[(size_t)blockIdx.y * rows + m.row0 + r] = acc[r] * scale;
}

// The launch bounds of a variant: 256 threads, and the blocks per SM its registers must allow.
#define GEMV_BOUNDS(MIN_BLOCKS) __launch_bounds__(256, MIN_BLOCKS)

#define QGEMV(R, U, LANES, SUFFIX, MIN_BLOCKS)                                                          \
    extern "C" __global__ void GEMV_BOUNDS(MIN_BLOCKS)                                                  \
        q4_gemv##SUFFIX(QMat w, const float* x, float* y, int rows, int cols, RowNorm nrm) {            \
        qgemv<4, R, U, LANES>(w, x, y, rows, cols, nrm);                                                \
    }                                                                                                   \
    extern "C" __global__ void GEMV_BOUNDS(MIN_BLOCKS)                                                  \
        q8_gemv##SUFFIX(QMat w, const float* x, float* y, int rows, int cols, RowNorm nrm) {            \
        qgemv<8, R, U, LANES>(w, x, y, rows, cols, nrm);                                                \
    }
GEMV_VARIANTS(QGEMV)

// The same product for matrices of many rows (the lm_head): a grid of a few blocks per SM whose
// warps walk the rows in steps of the whole grid, the next rows' codes loaded while the current
// ones are summed, and x staged once per block instead of once per 32 rows. Two rows per warp.
// Launch with 256 threads, (2 per SM, tokens) blocks (the registers allow two) and
// gemv_smem_bytes(cols) of shared memory.
template <int BITS>
__device__ __forceinline__ void qgemv_stream(QMat w, const float* __restrict__ x, float* __restrict__ y, int rows,
                                             int cols, const RowNorm& nrm) {
    constexpr int R = 2, U = 2;
    extern __shared__ float xs[];
    const int step = (int)(gridDim.x * (blockDim.x >> 5)) * R;
    int row0 = warp_in_grid() * R;
    QRows<BITS, R, U, 32> cur(w, row0, rows, cols);
    cur.load(0);
    pdl_wait();
    const float scale = stage_input<BITS>(xs, x + (size_t)blockIdx.y * cols, cols, nrm);
    for (; row0 < rows; row0 += step) {
        QRows<BITS, R, U, 32> next(w, row0 + step, rows, cols);
        if (row0 + step < rows) next.load(0);
        float acc[R] = {};
        cur.run(xs, acc);
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (cur.writer(r)) y[(size_t)blockIdx.y * rows + row0 + r] = acc[r] * scale;
        cur = next;
    }
}

extern "C" __global__ void GEMV_BOUNDS(2) q4_gemv_stream(QMat w, const float* x, float* y, int rows, int cols,
                                                        RowNorm nrm) {
    qgemv_stream<4>(w, x, y, rows, cols, nrm);
}
extern "C" __global__ void GEMV_BOUNDS(2) q8_gemv_stream(QMat w, const float* x, float* y, int rows, int cols,
                                                        RowNorm nrm) {
    qgemv_stream<8>(w, x, y, rows, cols, nrm);
}

// Launch with 256 threads, first_block[4] blocks and gemv_smem_bytes(cols) of shared memory; one
// token.
template <int BITS, int R, int U, int LANES>
__device__ __forceinline__ void qgemv_batch(const QBatch& b, const float* __restrict__ x, int cols,
                                            const RowNorm& nrm) {
    extern __shared__ float xs[];
    int m = 0;
    while (m < 3 && (int)blockIdx.x >= b.first_block[m + 1]) ++m;
    const int rows = b.rows[m];
    const int warp = warp_in_grid() - b.first_block[m] * (blockDim.x >> 5);
    QRows<BITS, R, U, LANES> mat({b.codes[m], b.scales[m], b.biases[m]}, first_row<R, LANES>(warp), rows, cols);
    mat.load(0);
    pdl_wait();
    const float scale = stage_input<BITS>(xs, x, cols, nrm);
    if (warp_idle<R, LANES>(warp, rows)) return;
    float acc[R] = {};
    mat.run(xs, acc);
#pragma unroll
    for (int r = 0; r < R; ++r)
        if (mat.writer(r)) b.y[m][mat.row0 + r] = acc[r] * scale;
}

#define QGEMV_BATCH(R, U, LANES, SUFFIX, MIN_BLOCKS)                                                  \
    extern "C" __global__ void GEMV_BOUNDS(MIN_BLOCKS) q4_gemv_batch##SUFFIX(QBatch b, const float* x,   \
                                                                            int cols, RowNorm nrm) {    \
        qgemv_batch<4, R, U, LANES>(b, x, cols, nrm);                                                   \
    }                                                                                                   \
    extern "C" __global__ void GEMV_BOUNDS(MIN_BLOCKS) q8_gemv_batch##SUFFIX(QBatch b, const float* x,   \
                                                                            int cols, RowNorm nrm) {    \
        qgemv_batch<8, R, U, LANES>(b, x, cols, nrm);                                                   \
    }
GEMV_VARIANTS(QGEMV_BATCH)

// qgemv_batch for matrices of many rows in all: their rows taken as one run (matrix m's after
// m - 1's; every matrix's row count even), walked two at a time by every warp of a grid of two
// blocks per SM as qgemv_stream walks the lm_head's, the next rows' codes loaded while the
// current are summed. A grid of four-row warps would take a second, mostly empty wave of blocks
// (two blocks of 121 registers a thread fit an SM). Launch with 256 threads, 2 blocks per SM and
// gemv_smem_bytes(cols) of shared memory; one token.
template <int BITS>
__device__ __forceinline__ void qgemv_batch_stream(const QBatch& b, const float* __restrict__ x, int cols,
                                                   const RowNorm& nrm) {
    constexpr int R = 2, U = 2;
    extern __shared__ float xs[];
    const int total = b.first_row[4];
    const int step = (int)(gridDim.x * (blockDim.x >> 5)) * R;
    // Matrix m of run row g, and a QRows for the warp's two rows from g.
    auto rows_at = [&](int g, int& m) {
        m = 0;
        while (m < 3 && g >= b.first_row[m + 1]) ++m;
        return QRows<BITS, R, U, 32>({b.codes[m], b.scales[m], b.biases[m]}, g - b.first_row[m], b.rows[m], cols);
    };
    int g = warp_in_grid() * R, m = 0;
    QRows<BITS, R, U, 32> cur = rows_at(min(g, total - 1), m);
    if (g < total) cur.load(0);
    pdl_wait();
    const float scale = stage_input<BITS>(xs, x, cols, nrm);
    for (; g < total; g += step) {
        int m_next = m;
        QRows<BITS, R, U, 32> next = rows_at(min(g + step, total - 1), m_next);
        if (g + step < total) next.load(0);
        float acc[R] = {};
        cur.run(xs, acc);
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (cur.writer(r)) b.y[m][cur.row0 + r] = acc[r] * scale;
        cur = next;
        m = m_next;
    }
}

extern "C" __global__ void GEMV_BOUNDS(2) q4_gemv_batch_stream(QBatch b, const float* x, int cols, RowNorm nrm) {
    qgemv_batch_stream<4>(b, x, cols, nrm);
}
extern "C" __global__ void GEMV_BOUNDS(2) q8_gemv_batch_stream(QBatch b, const float* x, int cols, RowNorm nrm) {
    qgemv_batch_stream<8>(b, x, cols, nrm);
}

// ---- one token's 4-bit products on the integer tensor cores (mma.sync m16n8k32, u8 codes times
// s8 digits of x, s32 sums). The products above spend about four instructions a code on the CUDA
// cores (extract, convert, multiply-add), enough to bound them by issue rather than by HBM
// (docs/performance.md, run38); an mma takes 512 codes in one instruction.
//
// A holds the codes: row i's 32 k-values of one step are 32 codes as unsigned bytes. B holds x:
// per 64-column group g, x is taken to 31-bit fixed point X = rint(x * 2^(30 - e_g)) (max|x| <
// 2^e_g), and split in four signed base-256 digits X = sum_k d_k 256^k (the parts; d_k = byte k
// of X + 0x80808080, less 128). The mma sums code * part exactly in s32, and
//   sum_c q_c x_c = sum_k 2^(e_g - 30 + 8k) C_k   (C_k: the mma's sum of part k).
// Each part's sum is exact, and the fixed point's error (under 2^(e_g - 31) an element) is far
// below the f32 rounding of the group's sum: the dequantized weight is never rounded, and the
// result differs from the f32 product by about its order of additions (design.md's numerics;
// the parity tests' nmse is that of the CUDA-core kernels). A group
// holding a NaN or an infinity gets NaN multipliers, so the product is NaN as in f32.
//
// The k order inside a tile is free as long as A and B agree. Lane (g, t) of k-step j of a
// 128-column round takes word 4t + j of its row (each lane loads four consecutive words, 32
// codes, as one 16-byte vector): a0/a1 are its even nibbles (columns 8(4t + j) + 2i), a2/a3 its
// odd ones (+1). So B column n of that step holds part n % 4 of the x values at those columns
// where they fall in group n / 4 of the round (t / 2), else zero: one mma sums both groups of the
// round, four parts each, into C's eight columns.

#define QX_WARPS_PER_TILE 4  // the warps of a tile split its rounds
#define QX_TILES 2           // tiles of 16 rows per block of 256 threads (mod.rs: QX_ROWS_PER_BLOCK)
#define QX_BATCH 2           // rounds of 128 columns a warp loads at once (two 16-byte vectors each)

__device__ __forceinline__ int qx_rounds(int cols) { return (cols + 127) >> 7; }

// The staged x in shared memory (qx_smem_bytes in mod.rs): per 128-column round, k-step, part
// and lane-in-quad, the (even, odd) B fragment words of the lanes whose group holds them (the
// other lanes' are zero, chosen in b()); per 64-column group the parts' multipliers and the sum
// of x (for the biases).
struct QxStaged {
    uint2* frag;
    float* mult;
    float* gsum;

    __device__ __forceinline__ QxStaged(unsigned char* smem, int cols) {
        const int rounds = qx_rounds(cols);
        frag = reinterpret_cast<uint2*>(smem);
        mult = reinterpret_cast<float*>(frag + rounds * 64);
        gsum = mult + rounds * 8;
    }

    // Stages x[cols] (cols a multiple of 64), span w (8 columns, one 4-bit word) by thread w of
    // the block. Whole warps run every pass (the shuffles need them; a group's 8 spans are 8
    // lanes), lanes past the last span idle: spans is a multiple of 16 only.
    __device__ __forceinline__ void stage(const float* __restrict__ x, int cols) const {
        const int spans = qx_rounds(cols) * 16;
        for (int base = 0; base < spans; base += blockDim.x) {
            const int w = base + (int)threadIdx.x;
            const bool live = w < spans;
            float v[8];
            if (live && 8 * w < cols) {
                const float4 lo = reinterpret_cast<const float4*>(x)[2 * w], hi = reinterpret_cast<const float4*>(x)[2 * w + 1];
                v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) v[i] = 0.f;
            }
            // The largest |x| as bits: non-negative floats order as their bits, and an infinity
            // or NaN is above every finite value.
            u32 mb = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) mb = max(mb, __float_as_uint(v[i]) & 0x7fffffffu);
            float s = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) {
                mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, o));
                s += __shfl_xor_sync(0xffffffffu, s, o);
            }
            // max|x| < 2^e; e >= -96 keeps 2^(30 - e) a normal float (a group that small is zeros).
            const int e = max((int)(mb >> 23) - 126, -96);
            const float to_fixed = __int_as_float((127 + 30 - e) << 23);
            u32 d[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) d[i] = ((u32)__float2int_rn(v[i] * to_fixed) + 0x80808080u) ^ 0x80808080u;
            // Byte k of the even columns' digits into word k (a 4 x 4 byte transpose), and of the odd.
            u32 even[4], odd[4];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                u32* out = h ? odd : even;
                const u32 lo01 = __byte_perm(d[h], d[h + 2], 0x5140), hi01 = __byte_perm(d[h], d[h + 2], 0x7362);
                const u32 lo23 = __byte_perm(d[h + 4], d[h + 6], 0x5140), hi23 = __byte_perm(d[h + 4], d[h + 6], 0x7362);
                out[0] = __byte_perm(lo01, lo23, 0x5410);
                out[1] = __byte_perm(lo01, lo23, 0x7632);
                out[2] = __byte_perm(hi01, hi23, 0x5410);
                out[3] = __byte_perm(hi01, hi23, 0x7632);
            }
            if (!live) continue;
            const int r = w >> 4, t = (w >> 2) & 3, j = w & 3;
#pragma unroll
            for (int k = 0; k < 4; ++k) frag[((r * 4 + j) * 4 + k) * 4 + t] = make_uint2(even[k], odd[k]);
            if ((w & 7) == 0) {
                const int g = w >> 3;
                const bool bad = mb >= 0x7f800000u;
#pragma unroll
                for (int k = 0; k < 4; ++k)
                    mult[4 * g + k] = bad ? __int_as_float(0x7fffffff) : __int_as_float((127 + e - 30 + 8 * k) << 23);
                gsum[g] = s;
            }
        }
    }

    // The kernel's wait for its predecessor, then x staged (by the whole block) and the next
    // kernel let launch; returns the row norm's scale of the products (1 without one).
    __device__ __forceinline__ float stage_after_wait(const float* __restrict__ x, int cols, const RowNorm& nrm) const {
        pdl_wait();
        float part[ROW_NORM_LOADS];
        row_norm_load(nrm, part);
        stage(x, cols);
        __syncthreads();
        pdl_launch_dependents();
        return row_norm_scale(nrm, part);
    }

    // Lane (g, t)'s B fragment of k-step j of round r: part g % 4 of group g / 4, zero where the
    // lane's columns (t / 2) are in the other group.
    __device__ __forceinline__ uint2 b(int r, int j) const {
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        const uint2 v = frag[((r * 4 + j) * 4 + (g & 3)) * 4 + t];
        return (g >> 2) == (t >> 1) ? v : make_uint2(0u, 0u);
    }
};

// The sum over a quad's four lanes (a row's partial sums: each lane holds its columns').
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

__device__ __forceinline__ void mma_u8s8(int c[4], const u32 a[4], uint2 b) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
}

// A lane's row of a 4-bit matrix, from its first word (4t, lane (g, t)) and its first group's
// scale and bias (t / 2); no codes: a row past the end (zeros).
struct QxRow {
    const u32* codes;
    const u16* scales;
    const u16* biases;
};

__device__ __forceinline__ QxRow qx_row(QMat m, int row, int cols) {
    const int t = threadIdx.x & 3;
    const size_t words = cols >> 3, groups = cols >> 6;
    return {m.codes + row * words + 4 * t, m.scales + row * groups + (t >> 1), m.biases + row * groups + (t >> 1)};
}

// One warp's part of a 16-row tile: row a (tile rows 0-7) and row b (8-15) of lane (g, t),
// loaded QX_BATCH rounds of 128 columns at a time; partial sums over the lane's columns (the
// quad's four lanes sum to the row's).
struct QxTile {
    QxRow ra, rb;
    uint4 qa[QX_BATCH], qb[QX_BATCH];
    u32 sba[QX_BATCH], sbb[QX_BATCH];  // bf16 scale (low half) and bias (high half)

    // Loads rounds r0 .. r0 + QX_BATCH - 1 (those under r1).
    __device__ __forceinline__ void load(int cols, int r0, int r1) {
        const int t = threadIdx.x & 3;
#pragma unroll
        for (int i = 0; i < QX_BATCH; ++i) {
            const int r = r0 + i;
            const bool in = r < r1 && 128 * r + 32 * t < cols;
            qa[i] = in && ra.codes ? __ldg(reinterpret_cast<const uint4*>(ra.codes + 16 * r)) : make_uint4(0u, 0u, 0u, 0u);
            qb[i] = in && rb.codes ? __ldg(reinterpret_cast<const uint4*>(rb.codes + 16 * r)) : make_uint4(0u, 0u, 0u, 0u);
            sba[i] = in && ra.codes ? (u32)__ldg(ra.scales + 2 * r) | ((u32)__ldg(ra.biases + 2 * r) << 16) : 0u;
            sbb[i] = in && rb.codes ? (u32)__ldg(rb.scales + 2 * r) | ((u32)__ldg(rb.biases + 2 * r) << 16) : 0u;
        }
    }

    // The loaded rounds added to acc_a / acc_b.
    __device__ __forceinline__ void run(const QxStaged& xs, int r0, int r1, float& acc_a, float& acc_b) const {
        const int t = threadIdx.x & 3;
#pragma unroll
        for (int i = 0; i < QX_BATCH; ++i) {
            const int r = r0 + i;
            if (r >= r1) break;
            int c[4] = {0, 0, 0, 0};
            const u32 wa[4] = {qa[i].x, qa[i].y, qa[i].z, qa[i].w}, wb[4] = {qb[i].x, qb[i].y, qb[i].z, qb[i].w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 a[4] = {wa[j] & 0x0f0f0f0fu, wb[j] & 0x0f0f0f0fu, (wa[j] >> 4) & 0x0f0f0f0fu,
                                  (wb[j] >> 4) & 0x0f0f0f0fu};
                mma_u8s8(c, a, xs.b(r, j));
            }
            // C's columns 2t, 2t + 1: parts 2(t & 1) and 2(t & 1) + 1 of group 2r + t / 2.
            const int grp = 2 * r + (t >> 1);
            const float2 m = reinterpret_cast<const float2*>(xs.mult + 4 * grp)[t & 1];
            const float bsx = (t & 1) ? 0.f : xs.gsum[grp];  // each group's bias term once
            const float da = fmaf((float)c[1], m.y, (float)c[0] * m.x), db = fmaf((float)c[3], m.y, (float)c[2] * m.x);
            acc_a = fmaf(bf16_to_f32((u16)sba[i]), da, fmaf(bf16_to_f32((u16)(sba[i] >> 16)), bsx, acc_a));
            acc_b = fmaf(bf16_to_f32((u16)sbb[i]), db, fmaf(bf16_to_f32((u16)(sbb[i] >> 16)), bsx, acc_b));
        }
    }
};

// Matrix m of run row g of a batch (b.first_row[4] rows in all).
__device__ __forceinline__ int batch_matrix(const QBatch& b, int g) {
    int m = 0;
    while (m < 3 && g >= b.first_row[m + 1]) ++m;
    return m;
}

// A GDN layer's causal conv of one token, taken by its in-projections' writers (q4_gemv_batch_qx):
// the batch's rows below `channels` are the q, k and v channels, each written as
// silu(taps . [window | product]) (conv1d_silu's arithmetic, gdn.cu, bit for bit) in place of the
// product, which moves into the window. Taps and window are read before the kernel's wait: only
// this layer's conv writes the window, a step earlier. One dependent launch fewer a GDN layer:
// decode +4.6% at 256 (docs/performance.md, session 36). taps == nullptr: no conv. Passed by
// value.
constexpr int CONV_K_FUSED = 4;
struct ConvTail {
    const float* taps;  // [CONV_K_FUSED][channels]
    float* window;      // [CONV_K_FUSED - 1][channels]
    int channels;
};

// qgemv_batch_stream's product on the tensor cores: a block per 32 rows of the batch's run (two
// tiles of 16, each split over 4 warps by rounds of 128 columns), the first rounds' weights
// loaded before the wait. Launch with 256 threads, ceil(first_row[4] / 32) blocks and
// qx_smem_bytes(cols) of shared memory; 4-bit matrices, cols a multiple of 64. With a ConvTail,
// the conv of the channels (the batch's first rows) as well: one launch a GDN layer instead of
// the product's and conv1d_silu's.
extern "C" __global__ void __launch_bounds__(256, 3) q4_gemv_batch_qx(QBatch b, const float* x, int cols, RowNorm nrm,
                                                                      ConvTail conv) {
    extern __shared__ __align__(16) unsigned char qx_smem[];
    const QxStaged xs(qx_smem, cols);
    __shared__ float partial[QX_TILES][QX_WARPS_PER_TILE][16];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tile = warp / QX_WARPS_PER_TILE, kw = warp % QX_WARPS_PER_TILE;
    const int total = b.first_row[4], first = (blockIdx.x * QX_TILES + tile) * 16;
    const int rounds = qx_rounds(cols), per_warp = (rounds + QX_WARPS_PER_TILE - 1) / QX_WARPS_PER_TILE;
    const int r0 = kw * per_warp, r1 = min(rounds, r0 + per_warp);
    auto row_of = [&](int g) {
        if (g >= total) return QxRow{nullptr, nullptr, nullptr};
        const int m = batch_matrix(b, g);
        return qx_row({b.codes[m], b.scales[m], b.biases[m]}, g - b.first_row[m], cols);
    };
    QxTile w;
    w.ra = row_of(first + (lane >> 2));
    w.rb = row_of(first + 8 + (lane >> 2));
    w.load(cols, r0, r1);
    // The writer's row (below) and, for a channel, its taps and window.
    const int wrow = blockIdx.x * QX_TILES * 16 + (int)threadIdx.x;
    const bool convolved = conv.taps && threadIdx.x < 16 * QX_TILES && wrow < conv.channels;
    float taps[CONV_K_FUSED] = {}, window[CONV_K_FUSED - 1] = {};
    if (convolved) {
#pragma unroll
        for (int j = 0; j < CONV_K_FUSED; ++j) taps[j] = conv.taps[(size_t)j * conv.channels + wrow];
#pragma unroll
        for (int j = 0; j + 1 < CONV_K_FUSED; ++j) window[j] = conv.window[(size_t)j * conv.channels + wrow];
    }
    const float scale = xs.stage_after_wait(x, cols, nrm);
    float acc_a = 0.f, acc_b = 0.f;
    for (int rb = r0; rb < r1; rb += QX_BATCH) {
        if (rb != r0) w.load(cols, rb, r1);
        w.run(xs, rb, r1, acc_a, acc_b);
    }
    acc_a = quad_sum(acc_a);
    acc_b = quad_sum(acc_b);
    if ((lane & 3) == 0) {
        partial[tile][kw][lane >> 2] = acc_a;
        partial[tile][kw][8 + (lane >> 2)] = acc_b;
    }
    __syncthreads();
    if (threadIdx.x < 16 * QX_TILES) {
        const int g = wrow;
        if (g < total) {
            const int tl = threadIdx.x >> 4, r = threadIdx.x & 15;
            float sum = 0.f;
#pragma unroll
            for (int k = 0; k < QX_WARPS_PER_TILE; ++k) sum += partial[tl][k][r];
            const int m = batch_matrix(b, g);
            float out = sum * scale;
            if (convolved) {
                float acc = 0.f;
#pragma unroll
                for (int j = 0; j + 1 < CONV_K_FUSED; ++j) acc += taps[j] * window[j];
                acc += taps[CONV_K_FUSED - 1] * out;
#pragma unroll
                for (int j = 0; j + 2 < CONV_K_FUSED; ++j) conv.window[(size_t)j * conv.channels + g] = window[j + 1];
                conv.window[(size_t)(CONV_K_FUSED - 2) * conv.channels + g] = out;
                out = silu(acc);
            }
            b.y[m][g - b.first_row[m]] = out;
        }
    }
}

// qgemv_stream's product (the lm_head's: many rows, one token) on the tensor cores: each warp
// walks 16-row tiles over all their columns (no reduction across warps, so no barrier after the
// staging), the next QX_BATCH rounds' weights, of this tile or the warp's next, loaded while the
// current ones multiply. Launch with 256 threads, at most ceil(rows / 128) blocks (two an SM fill
// it) and qx_smem_bytes(cols) of shared memory; 4-bit, cols a multiple of 64; one token.
extern "C" __global__ void __launch_bounds__(256, 2) q4_gemv_stream_qx(QMat w, const float* x, float* y, int rows,
                                                                       int cols, RowNorm nrm) {
    extern __shared__ __align__(16) unsigned char qx_smem[];
    const QxStaged xs(qx_smem, cols);
    const int lane = threadIdx.x & 31, warps = (int)(gridDim.x * (blockDim.x >> 5));
    const int tiles = (rows + 15) >> 4, rounds = qx_rounds(cols);
    auto row_of = [&](int r) { return r < rows ? qx_row(w, r, cols) : QxRow{nullptr, nullptr, nullptr}; };
    int tile = warp_in_grid(), r = 0;
    QxTile cur;
    if (tile < tiles) {
        cur.ra = row_of(16 * tile + (lane >> 2));
        cur.rb = row_of(16 * tile + 8 + (lane >> 2));
        cur.load(cols, 0, rounds);
    }
    const float scale = xs.stage_after_wait(x, cols, nrm);
    float acc_a = 0.f, acc_b = 0.f;
    while (tile < tiles) {
        int next_tile = tile, next_r = r + QX_BATCH;
        if (next_r >= rounds) next_r = 0, next_tile += warps;
        QxTile next;
        if (next_tile < tiles) {
            next.ra = next_tile == tile ? cur.ra : row_of(16 * next_tile + (lane >> 2));
            next.rb = next_tile == tile ? cur.rb : row_of(16 * next_tile + 8 + (lane >> 2));
            next.load(cols, next_r, rounds);
        }
        cur.run(xs, r, rounds, acc_a, acc_b);
        if (next_r == 0) {
            acc_a = quad_sum(acc_a);
            acc_b = quad_sum(acc_b);
            const int ra = 16 * tile + (lane >> 2), rb = ra + 8;
            if ((lane & 3) == 0 && ra < rows) y[ra] = acc_a * scale;
            if ((lane & 3) == 0 && rb < rows) y[rb] = acc_b * scale;
            acc_a = acc_b = 0.f;
        }
        cur = next;
        tile = next_tile;
        r = next_r;
    }
}

// ---- loads and flags across blocks and kernels.

// A load from L2, past this SM's L1 (which may hold an older copy of a buffer another SM wrote).
__device__ __forceinline__ float load_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ int load_cg(const int* p) {
    int v;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
// A flag another kernel's block sets (release) and this one reads (acquire), device-wide.
__device__ __forceinline__ u32 load_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void store_release(u32* p, u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The sum over the block of each thread's v into partials[blockIdx.x] (RowNorm's partial sums of
// squares), in a fixed order. Every thread of the block calls it, once in the kernel.
__device__ __forceinline__ void block_total_to(float* partials, float v) {
    const float t = block_sum<false>(v);
    if (threadIdx.x == 0) partials[blockIdx.x] = t;
}

// The GDN output norm left by the one-token recurrence (GdnGate, gdn.cu) to the output
// projection: its input row is g = y * w * silu(z), and head h (`dim` columns) is scaled by
// rsqrt(mean(y_h^2) + eps), from the head's `parts` partial sums of squares (partials [heads]
// [parts], summed in order). A vector of codes' columns lie in one head (dim a multiple of 32),
// so the scale is applied as each vector is staged; every thread staging a vector sums its head's
// partials, loaded beside the vector's values. Passed by value.
struct HeadNorm {
    const float* partials;
    int parts;
    int dim;
    float eps;
};

// Head h's scale.
__device__ __forceinline__ float head_norm_inv(const HeadNorm& hn, int h) {
    const float* p = hn.partials + (size_t)h * hn.parts;
    float sq = 0.f;
#pragma unroll 8
    for (int i = 0; i < hn.parts; ++i) sq += p[i];
    return 1.f / sqrtf(sq / (float)hn.dim + hn.eps);
}

// The row made plain, out[c] = g[c] * its head's scale, as the staging scales it (for the other
// readers of a lazily normed GDN output). One thread per column.
extern "C" __global__ void head_norm_apply(const float* g, HeadNorm hn, float* out, int cols) {
    grid_dep();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < cols) out[c] = g[c] * head_norm_inv(hn, c / hn.dim);
}

// x_out[r] = x_in[r] + w[r] . y for one token: a mixer's output projection added to the
// residual, whose next norm (gains `gains`) is left to the products that read it (RowNorm:
// x_out * gains into xg, each block's sum of squares of its rows into partials[blockIdx.x]).
// qgemv's blocks and variants. GATED: y is the GDN's g with its HeadNorm (a kernel of its own,
// so that the plain one keeps its registers).
template <int BITS, int R, int U, int LANES, bool GATED>
__device__ __forceinline__ void qgemv_add_sumsq(QMat w, const float* __restrict__ y, const HeadNorm& hn,
                                                const float* x_in, float* x_out, const float* gains, float* xg,
                                                float* partials, int rows, int cols) {
    extern __shared__ float xs[];
    QRows<BITS, R, U, LANES> m(w, first_row<R, LANES>(warp_in_grid()), rows, cols);
    m.load(0);
    pdl_wait();
    float res[R], gain[R];  // the residual and gains, loaded with the staging's loads
#pragma unroll
    for (int r = 0; r < R; ++r) {
        res[r] = m.writer(r) ? x_in[m.row0 + r] : 0.f;
        gain[r] = m.writer(r) ? gains[m.row0 + r] : 0.f;
    }
    if (GATED)
        stage_input_scaled<BITS>(xs, y, cols, RowNorm{},
                                 [&](int v) { return head_norm_inv(hn, v * 4 * (32 / BITS) / hn.dim); });
    else
        stage_input<BITS>(xs, y, cols, RowNorm{});  // y is the plain row: no scale
    float sq = 0.f;
    if (!warp_idle<R, LANES>(warp_in_grid(), rows)) {
        float acc[R] = {};
        m.run(xs, acc);
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (m.writer(r)) {
                const float v = res[r] + acc[r];
                x_out[m.row0 + r] = v;
                xg[m.row0 + r] = v * gain[r];
                sq = fmaf(v, v, sq);
            }
    }
    block_total_to(partials, sq);
}

#define QGEMV_ADD_SUMSQ_KERNEL(BITS, NAME, GATED, R, U, LANES, MIN_BLOCKS)                              \
    extern "C" __global__ void GEMV_BOUNDS(MIN_BLOCKS)                                                  \
        NAME(QMat w, const float* y, HeadNorm hn, const float* x_in, float* x_out, const float* gains,   \
             float* xg, float* partials, int rows, int cols) {                                           \
        qgemv_add_sumsq<BITS, R, U, LANES, GATED>(w, y, hn, x_in, x_out, gains, xg, partials, rows, cols); \
    }
#define QGEMV_ADD_SUMSQ(R, U, LANES, SUFFIX, MIN_BLOCKS)                                                 \
    QGEMV_ADD_SUMSQ_KERNEL(4, q4_gemv_add_sumsq##SUFFIX, false, R, U, LANES, MIN_BLOCKS)               \
    QGEMV_ADD_SUMSQ_KERNEL(8, q8_gemv_add_sumsq##SUFFIX, false, R, U, LANES, MIN_BLOCKS)               \
    QGEMV_ADD_SUMSQ_KERNEL(4, q4_gemv_add_sumsq_gated##SUFFIX, true, R, U, LANES, MIN_BLOCKS)          \
    QGEMV_ADD_SUMSQ_KERNEL(8, q8_gemv_add_sumsq_gated##SUFFIX, true, R, U, LANES, MIN_BLOCKS)
GEMV_VARIANTS(QGEMV_ADD_SUMSQ)

// out[t][c] = dequantized row ids[t] of the table. One block per token.
template <int BITS>
__device__ __forceinline__ void embed_rows(QMat w, const int* ids, float* out, int cols) {
    constexpr int PER_WORD = 32 / BITS;
    constexpr u32 MASK = (1u << BITS) - 1u;
    const size_t row = (size_t)ids[blockIdx.x];
    const int words = cols / PER_WORD, groups = cols >> 6;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const u32 q = (w.codes[row * words + c / PER_WORD] >> (BITS * (c % PER_WORD))) & MASK;
        const size_t gi = row * groups + (c >> 6);
        out[(size_t)blockIdx.x * cols + c] = fmaf(bf16_to_f32(w.scales[gi]), (float)q, bf16_to_f32(w.biases[gi]));
    }
}

extern "C" __global__ void q4_embed(const u32* codes, const u16* scales, const u16* biases, const int* ids,
                                    float* out, int cols) { grid_dep();
    embed_rows<4>({codes, scales, biases}, ids, out, cols);
}

extern "C" __global__ void q8_embed(const u32* codes, const u16* scales, const u16* biases, const int* ids,
                                    float* out, int cols) { grid_dep();
    embed_rows<8>({codes, scales, biases}, ids, out, cols);
}

template <int KEYS, bool WEIGHTS = true>
__device__ __forceinline__ void route_token(const float* l, int experts, int top_k, int renormalize, int* ids,
                                            float* weights, int parts = 1, size_t part_stride = 0);

// ---- the mixture-of-experts block. Pair p < pairs is token p / top_k's (p % top_k)-th chosen
// expert ids[p]; pair pairs + t is token t's shared expert (its own matrices, `inter_s` rows).
// Activations act[p] hold `stride` = max(inter, inter_s) floats, outputs y[p] `hidden`.

// act[p][r] = silu(gate[r] . x[t]) * (up[r] . x[t]) for the chosen experts and the shared
// expert only. Launch with 256 threads, (ceil(stride / ROWS_PER_BLOCK), pairs + tokens) blocks and
// gemv_smem_bytes(hidden) of shared memory. The shared expert's weights are fetched before the
// wait for the previous kernel; a routed expert's only once its id (written by the router) can be
// read.
template <int BITS, int R, int U, int LANES>
__device__ __forceinline__ void moe_gate_up(QMat gate, QMat up, QMat sgate, QMat sup, const int* ids,
                                            const float* x, float* act, int top_k, int pairs, int inter,
                                            int inter_s, int hidden, const RowNorm& nrm) {
    extern __shared__ float xs[];
    const int p = blockIdx.y;
    const bool shared = p >= pairs;
    const int t = shared ? p - pairs : p / top_k;
    const int rows = shared ? inter_s : inter;
    const int warp = warp_in_grid();
    if (warp_idle<R, LANES>(blockIdx.x * (blockDim.x >> 5), rows)) return;  // whole block idle
    QMat g = sgate, u = sup;
    if (!shared) {
        pdl_wait();
        const size_t e = (size_t)ids[p];
        g = expert_slice<BITS>(gate, e, inter, hidden);
        u = expert_slice<BITS>(up, e, inter, hidden);
    }
    QRows<BITS, R, U, LANES> gm(g, first_row<R, LANES>(warp), rows, hidden), um(u, gm.row0, rows, hidden);
    gm.load(0);
    um.load(0);
    if (shared) pdl_wait();
    const float scale = stage_input<BITS>(xs, x + (size_t)t * hidden, hidden, nrm);
    if (warp_idle<R, LANES>(warp, rows)) return;
    float ag[R] = {}, au[R] = {};
    gm.run(xs, ag, &um, au);
    const int stride = max(inter, inter_s);
#pragma unroll
    for (int r = 0; r < R; ++r)
        if (gm.writer(r)) act[(size_t)p * stride + gm.row0 + r] = silu(ag[r] * scale) * (au[r] * scale);
}

// moe_gate_up for one token (decode): the rows of every pair taken as one run, the shared
// expert's first (their weights are loaded before the wait for the router), then each routed
// pair's, walked by every warp of a grid of two blocks per SM one row at a time (gate and up), the
// next row's codes loaded while the current is summed; x is staged once per block. The grid of
// per-pair blocks takes 1.45 waves (three blocks of 68 registers a thread fit an SM). Launch
// with 256 threads, 2 blocks per SM and gemv_smem_bytes(hidden) of shared memory. The kernels
// take moe_gate_up's arguments (top_k unused: one token's pairs are its top k).
//
// With `logits` (the router's `experts` logits, at most 32 * KEYS), the token is routed here rather
// than by the router product: every block's first warp routes it (route_token, into shared memory)
// right after the wait, and the last block writes the choice to `ids` and `weights` for the kernels
// after (only it computes the weights). The router product then ends with its last row: routing in
// its last block (a ticket, a fence and a reload of the logits from L2 first) held the whole expert
// block back longer (docs/performance.md, session 17). Routing in every block costs no more than
// reading the ids. A kernel for each KEYS (up to 256 experts, up to 512): with both routings in
// one, its code was 94 KB against 56, and its warps waited for instructions 10.6% of their cycles
// (Nsight Compute, session 18). With `ids_ready`, the last block flags the ids to the down kernel
// once they are written (flagged_routing, below).
template <int BITS, int KEYS>
__device__ __forceinline__ void moe_gate_up_stream(QMat gate, QMat up, QMat sgate, QMat sup, int* ids,
                                                   const float* x, float* act, int pairs, int inter, int inter_s,
                                                   int hidden, const RowNorm& nrm, const float* logits, int experts,
                                                   int renormalize, float* weights, u32* ids_ready) {
    using Rows = QRows<BITS, 1, 2, 32>;
    extern __shared__ float xs[];
    __shared__ int routed[32];
    __shared__ float routed_weights[32];
    const int shared_rows = sgate.codes ? inter_s : 0;
    const int total = shared_rows + pairs * inter, stride = max(inter, inter_s);
    const int step = (int)(gridDim.x * (blockDim.x >> 5));
    // Run row g: its pair and row, and the gate and up rows' QRows (routed: ids must be readable).
    struct Row {
        int p, r;
        Rows g, u;
    };
    const int* chosen = logits ? routed : ids;
    auto row_at = [&](int g) {
        if (g < shared_rows) return Row{pairs, g, Rows(sgate, g, inter_s, hidden), Rows(sup, g, inter_s, hidden)};
        const int q = g - shared_rows, p = q / inter, r = q % inter;
        const size_t e = (size_t)chosen[p];
        return Row{p, r, Rows(expert_slice<BITS>(gate, e, inter, hidden), r, inter, hidden),
                   Rows(expert_slice<BITS>(up, e, inter, hidden), r, inter, hidden)};
    };
    int g = warp_in_grid();
    const bool early = g < shared_rows;
    // The shared expert's rows are fetched before the wait; a routed row only once its expert is
    // known (a placeholder until then, which loads nothing).
    Row cur = early ? row_at(g) : Row{pairs, 0, Rows(sgate, 0, inter_s, hidden), Rows(sup, 0, inter_s, hidden)};
    if (early) {
        cur.g.load(0);
        cur.u.load(0);
    }
    pdl_wait();
    // The last block (one of those with a row fewer than the first blocks' warps, whose last rows
    // end the kernel) writes the routing for the kernels after: only it computes the weights.
    const bool publisher = blockIdx.x == gridDim.x - 1;
    if (logits) {
        if (threadIdx.x < 32) {
            if (publisher) route_token<KEYS>(logits, experts, pairs, renormalize, routed, routed_weights);
            else route_token<KEYS, false>(logits, experts, pairs, renormalize, routed, routed_weights);
        }
        __syncthreads();
        if (publisher && (int)threadIdx.x < pairs) {
            ids[threadIdx.x] = routed[threadIdx.x];
            weights[threadIdx.x] = routed_weights[threadIdx.x];
        }
    }
    // It tells the expert down kernel that the ids are written (flagged_routing, below).
    if (ids_ready && publisher) {
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();  // the block's ids writes, ordered by the barrier (cumulative)
            store_release(ids_ready, 1u);
        }
    }
    if (!early) {
        cur = row_at(min(g, total - 1));
        if (g < total) {
            cur.g.load(0);
            cur.u.load(0);
        }
    }
    const float scale = stage_input<BITS>(xs, x, hidden, nrm);
    for (; g < total; g += step) {
        Row next = row_at(min(g + step, total - 1));
        if (g + step < total) {
            next.g.load(0);
            next.u.load(0);
        }
        float ag[1] = {}, au[1] = {};
        cur.g.run(xs, ag, &cur.u, au);
        if (cur.g.writer(0)) act[(size_t)cur.p * stride + cur.r] = silu(ag[0] * scale) * (au[0] * scale);
        cur = next;
    }
}

#define MOE_GATE_UP_STREAM(NAME, BITS, KEYS)                                                                \
    extern "C" __global__ void GEMV_BOUNDS(2)                                                                \
        NAME(QMat gate, QMat up, QMat sgate, QMat sup, int* ids, const float* x, float* act, int top_k,      \
             int pairs, int inter, int inter_s, int hidden, RowNorm nrm, const float* logits, int experts,   \
             int renormalize, float* weights, u32* ids_ready) {                                              \
        moe_gate_up_stream<BITS, KEYS>(gate, up, sgate, sup, ids, x, act, pairs, inter, inter_s, hidden, nrm, \
                                       logits, experts, renormalize, weights, ids_ready);                    \
    }
MOE_GATE_UP_STREAM(q4_moe_gate_up_stream, 4, 8)
MOE_GATE_UP_STREAM(q8_moe_gate_up_stream, 8, 8)
MOE_GATE_UP_STREAM(q4_moe_gate_up_stream_e512, 4, 16)
MOE_GATE_UP_STREAM(q8_moe_gate_up_stream_e512, 8, 16)

// One token's routing handed from the gate/up kernel (moe_gate_up_stream) to the down kernel
// (moe_down_mix) before the gate/up kernel has finished: its last block sets ids_ready[0]
// (release) once it has written the ids and weights, and one warp of each down block reads the
// flag (acquire) and the routing, then the block loads its weights before its wait for the
// gate/up outputs. The down blocks count themselves in ids_ready[1]; the last to read clears both
// words, so the flag is zero between launches. The flag is set before its block lets the down
// kernel launch (pdl_launch_dependents, which the down kernel waits for from every gate/up block),
// so the wait is short and cannot hang. The weights then load during the gate/up kernel's last
// rows: decode +1.6-2.6% (docs/performance.md, session 20).
// Called by one whole warp of each of `readers` blocks: the routing into ids_out and weights_out.
__device__ __forceinline__ void flagged_routing(u32* ids_ready, const int* ids, const float* weights, int top_k,
                                                u32 readers, int* ids_out, float* weights_out) {
    const int lane = threadIdx.x & 31;
    while (load_acquire(ids_ready) == 0u) {
    }
    if (lane < top_k) {
        ids_out[lane] = load_cg(ids + lane);
        weights_out[lane] = load_cg(weights + lane);
    }
    if (lane == 0 && atomicAdd(ids_ready + 1, 1u) == readers - 1u) {
        ids_ready[1] = 0u;
        ids_ready[0] = 0u;
    }
}

// y[p][r] = down[r] . act[p]. Launch with 256 threads, (ceil(hidden / ROWS_PER_BLOCK),
// pairs + tokens) blocks, gemv_smem_bytes(stride) of shared memory.
template <int BITS, int R, int U, int LANES>
__device__ __forceinline__ void moe_down(QMat down, QMat sdown, const int* ids, const float* act, float* y,
                                         int pairs, int inter, int inter_s, int hidden) {
    extern __shared__ float xs[];
    const int p = blockIdx.y;
    const bool shared = p >= pairs;
    const int cols = shared ? inter_s : inter;
    QMat d = sdown;
    if (!shared) {
        pdl_wait();
        d = expert_slice<BITS>(down, (size_t)ids[p], hidden, inter);
    }
    QRows<BITS, R, U, LANES> m(d, first_row<R, LANES>(warp_in_grid()), hidden, cols);
    m.load(0);
    if (shared) pdl_wait();
    stage_x<BITS>(xs, act + (size_t)p * max(inter, inter_s), cols);
    __syncthreads();
    pdl_launch_dependents();  // only now: see "When the next kernel launches"
    if (warp_idle<R, LANES>(warp_in_grid(), hidden)) return;
    float acc[R] = {};
    m.run(xs, acc);
#pragma unroll
    for (int r = 0; r < R; ++r)
        if (m.writer(r)) y[(size_t)p * hidden + m.row0 + r] = acc[r];
}

// gate/up take two matrices' loads in flight at once: half the vectors per round of `run`'s. With
// four rows per half warp that is too many registers for three blocks per SM: two.
#define GATE_UP_MIN_BLOCKS(LANES, MIN_BLOCKS) ((LANES) == 16 ? 2 : (MIN_BLOCKS))
#define MOE_KERNELS(R, U, LANES, SUFFIX, MIN_BLOCKS)                                                   \
    extern "C" __global__ void GEMV_BOUNDS(GATE_UP_MIN_BLOCKS(LANES, MIN_BLOCKS))                        \
        q4_moe_gate_up##SUFFIX(QMat gate, QMat up, QMat sgate, QMat sup, const int* ids, const float* x, \
                               float* act, int top_k, int pairs, int inter, int inter_s, int hidden,    \
                               RowNorm nrm, const float*, int, int, float*, u32*) {                    \
        moe_gate_up<4, R, (U + 1) / 2, LANES>(gate, up, sgate, sup, ids, x, act, top_k, pairs, inter,   \
                                              inter_s, hidden, nrm);                                    \
    }                                                                                                   \
    extern "C" __global__ void GEMV_BOUNDS(GATE_UP_MIN_BLOCKS(LANES, MIN_BLOCKS))                        \
        q8_moe_gate_up##SUFFIX(QMat gate, QMat up, QMat sgate, QMat sup, const int* ids, const float* x, \
                               float* act, int top_k, int pairs, int inter, int inter_s, int hidden,    \
                               RowNorm nrm, const float*, int, int, float*, u32*) {                    \
        moe_gate_up<8, R, (U + 1) / 2, LANES>(gate, up, sgate, sup, ids, x, act, top_k, pairs, inter,   \
                                              inter_s, hidden, nrm);                                    \
    }                                                                                                   \
    extern "C" __global__ void GEMV_BOUNDS(MIN_BLOCKS)                                                  \
        q4_moe_down##SUFFIX(QMat down, QMat sdown, const int* ids, const float* act, float* y, int pairs, \
                            int inter, int inter_s, int hidden) {                                       \
        moe_down<4, R, U, LANES>(down, sdown, ids, act, y, pairs, inter, inter_s, hidden);              \
    }                                                                                                   \
    extern "C" __global__ void GEMV_BOUNDS(MIN_BLOCKS)                                                  \
        q8_moe_down##SUFFIX(QMat down, QMat sdown, const int* ids, const float* act, float* y, int pairs, \
                            int inter, int inter_s, int hidden) {                                       \
        moe_down<8, R, U, LANES>(down, sdown, ids, act, y, pairs, inter, inter_s, hidden);              \
    }
GEMV_VARIANTS(MOE_KERNELS)

// One token's expert down products mixed into the residual in one launch: x_out = x_in + mix,
// mixed as moe_combine_add_rms_norm mixes (the same sums, in the same order), whose next norm
// (gains `gains`) is left to the products that read it (RowNorm: x_out * gains into xg, each
// block's sum of squares into partials[blockIdx.x]). A block takes MIX_ROWS rows of every pair:
// warp w the rows of pair w (the routed pairs, then the shared expert), MIX_ROWS / 2 a half warp;
// each warp stages its own pair's activations, and the warps meet once, at the mix, in shared
// memory. The form before it (moe_down's blocks, one a pair and 64 rows, the last of a block of
// rows' nine to finish mixing them after a fence, a ticket and a reload of the outputs from L2)
// was 0.5-1.3% slower in decode; 8 rows a block (twice the activations' staging from L2) 0.6%
// slower than that (docs/performance.md, session 35). With `ids_ready` (after
// moe_gate_up_stream) the routed ids and weights are read once the gate/up flags them and the
// weights are loaded before the wait; without it, after the wait. Launch with 32 * (top_k +
// shared) threads, ceil(hidden / MIX_ROWS) blocks, (top_k + shared) * gemv_smem_bytes(max(inter,
// inter_s)) of shared memory. One block an SM: ptxas takes ~165 registers, and capping them at
// 128 or 112 (so that the next kernel's blocks fit beside it) spilled and was slower.
#define MIX_ROWS 16
template <int BITS>
__device__ __forceinline__ void moe_down_mix(QMat down, QMat sdown, const int* ids, const float* weights,
                                             const float* shared_logit, const float* act, const float* x_in,
                                             float* x_out, const float* gains, float* xg, float* partials,
                                             int top_k, int inter, int inter_s, int hidden, u32* ids_ready) {
    static_assert(MIX_ROWS % 2 == 0 && MIX_ROWS <= 32, "a half warp's rows; the first warp mixes them");
    constexpr int R = MIX_ROWS / 2;
    extern __shared__ float xs_all[];
    __shared__ int pair_expert[32];
    __shared__ float pair_weight[32], gate_logit, y[32][MIX_ROWS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool shared = warp == top_k;
    const int cols = shared ? inter_s : inter, stride = max(inter, inter_s);
    float* xs = xs_all + (size_t)warp * staged_x_floats(stride);
    const int first = blockIdx.x * MIX_ROWS, row = first + (int)threadIdx.x;
    const bool mixer = threadIdx.x < MIX_ROWS && row < hidden;
    // The residual and the shared gate's logit were written two and more kernels back (finished
    // before the gate/up kernel let this one launch); the routed ids and weights once flagged.
    float x0 = 0.f, g0 = 0.f;
    if (ids_ready && mixer) {
        x0 = x_in[row];
        g0 = gains[row];
    }
    if (warp == 0) {
        if (ids_ready) {
            flagged_routing(ids_ready, ids, weights, top_k, gridDim.x, pair_expert, pair_weight);
        } else {
            pdl_wait();
            if (lane < top_k) {
                pair_expert[lane] = ids[lane];
                pair_weight[lane] = weights[lane];
            }
        }
        if (lane == 0 && sdown.codes) gate_logit = load_cg(shared_logit);
    }
    // The shared expert's rows are requested before the barrier, a routed pair's once its expert
    // is known.
    QRows<BITS, R, 1, 16> m(sdown, first + (lane >> 4) * R, hidden, cols);
    if (shared) m.load(0);
    __syncthreads();
    if (!shared) {
        m.w = expert_slice<BITS>(down, (size_t)pair_expert[warp], hidden, inter);
        m.load(0);
    }
    pdl_wait();
    if (!ids_ready && mixer) {
        x0 = x_in[row];
        g0 = gains[row];
    }
    stage_x_by<BITS>(xs, act + (size_t)warp * stride, cols, lane, 32);
    __syncwarp();
    pdl_launch_dependents();  // only now: see "When the next kernel launches"
    float acc[R] = {};
    m.run(xs, acc);
#pragma unroll
    for (int r = 0; r < R; ++r)
        if ((lane & 15) == 0) y[warp][(lane >> 4) * R + r] = acc[r];
    __syncthreads();
    // The mix and the block's sum of squares are the first warp's alone.
    if (warp != 0) return;
    float sq = 0.f;
    if (mixer) {
        const int t = threadIdx.x;
        const float mix = moe_mix(pair_weight, top_k, sdown.codes ? &gate_logit : nullptr,
                                  [&](int j) { return y[j][t]; }, [&] { return y[top_k][t]; });
        const float v = x0 + mix;
        x_out[row] = v;
        xg[row] = v * g0;
        sq = v * v;
    }
    sq = warp_sum(sq);
    if (lane == 0) partials[blockIdx.x] = sq;
}

#define MOE_DOWN_MIX(NAME, BITS)                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * MIX_LOADS, 1)                                        \
        NAME(QMat down, QMat sdown, const int* ids, const float* weights, const float* shared_logit,          \
             const float* act, const float* x_in, float* x_out, const float* gains, float* xg, float* partials, \
             int top_k, int inter, int inter_s, int hidden, u32* ids_ready) {                                  \
        moe_down_mix<BITS>(down, sdown, ids, weights, shared_logit, act, x_in, x_out, gains, xg, partials,     \
                           top_k, inter, inter_s, hidden, ids_ready);                                          \
    }
MOE_DOWN_MIX(q4_moe_down_mix, 4)
MOE_DOWN_MIX(q8_moe_down_mix, 8)

// out[t][c] = sum_j weights[t*k+j] * y[t*k+j][c] (in the order j = 0..k-1, as the reference
// adds), then + sigmoid(shared_logit[t]) * y[pairs + t][c] when there is a shared expert.
extern "C" __global__ void moe_combine(const float* y, const float* weights, const float* shared_logit,
                                       float* out, int tokens, int top_k, int hidden) { grid_dep();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)tokens * hidden) return;
    const size_t t = i / hidden, c = i % hidden;
    float acc = 0.f;
    for (int j = 0; j < top_k; ++j) acc = fmaf(weights[t * top_k + j], y[(t * top_k + j) * hidden + c], acc);
    if (shared_logit) {
        const size_t pairs = (size_t)tokens * top_k;
        acc += y[(pairs + t) * hidden + c] / (1.f + expf(-shared_logit[t]));
    }
    out[i] = acc;
}

// The top k of one warp's routing keys, largest first, where a threshold settles them in few
// dependent steps: lane l holds key[i] for expert l + 32 i (pack_max, 0 for none or NaN); lane
// j < top_k gets the j-th largest key's expert in `mine`. The threshold t is the k-th largest of
// the 32 lanes' largest keys: those k keys are distinct and at least t, so the top k are among the
// keys >= t (about 9 of 256 normal random logits for k = 8, at most 14 in 5,000 simulated
// draws). The candidates go to shared memory in lane order, each one's rank is the count of larger
// candidates, and the expert of rank j goes to lane j: the same choice and order as route_token's rounds, which take
// over (false returned, `mine` untouched) when fewer than k lanes hold a key or more than 32 keys
// reach t. One warp of a block at a time (the candidates' shared memory).
template <int KEYS>
__device__ __forceinline__ bool top_k_by_threshold(const u64 (&key)[KEYS], int top_k, int& mine) {
    const unsigned full = 0xffffffffu;
    const int lane = threadIdx.x & 31;
    __shared__ u64 cand[32];
    __shared__ int chosen[32];
    u64 lm = key[0];
#pragma unroll
    for (int i = 1; i < KEYS; ++i) lm = max(lm, key[i]);
    // lm's rank among the lanes' largest keys (equal ones are zeros: lanes without a key).
    int rank = 0;
#pragma unroll
    for (int j = 0; j < 32; ++j) rank += __shfl_sync(full, lm, j) > lm;
    const u32 at = __ballot_sync(full, rank == top_k - 1 && lm != 0);
    if (at == 0) return false;
    const u64 t = __shfl_sync(full, lm, __ffs(at) - 1);
    const u32 below = (1u << lane) - 1u;
    int n = 0, slot[KEYS];
#pragma unroll
    for (int i = 0; i < KEYS; ++i) {
        const u32 b = __ballot_sync(full, key[i] >= t);
        slot[i] = n + __popc(b & below);
        n += __popc(b);
    }
    if (n > 32) return false;
#pragma unroll
    for (int i = 0; i < KEYS; ++i)
        if (key[i] >= t) cand[slot[i]] = key[i];
    __syncwarp();
    const u64 c = lane < n ? cand[lane] : 0;
    int r = 0;
    for (int j = 0; j < n; ++j) r += cand[j] > c;
    if (lane < n && r < top_k) chosen[r] = packed_index(c);
    __syncwarp();
    if (lane < top_k) mine = chosen[lane];
    __syncwarp();  // the next call's candidates overwrite these
    return true;
}

// Softmax over one token's router logits l[experts], then the top k (ties to the lowest expert
// id, comparing logits as the reference does), optionally renormalised over the chosen k; run by
// one warp. Each (logit, id) is packed in a u64 that orders like the comparison (pack_max). Lane
// l holds the keys of experts l, l + 32, ... (KEYS of them: experts <= 32 * KEYS). The top k come
// from top_k_by_threshold where it settles them (decode +0.4-0.6%, docs/performance.md, session 34),
// else from k rounds: each lane's keys sorted largest first, so its candidate is its first key, a
// round takes the warp's largest candidate by two redux.sync maxima (the high words, then the low
// words of the lanes holding that high word), and the lane that held it moves its next key up.
// The j-th expert goes to lane j (top_k <= 32), which computes its probability; the total adds
// them in the order j = 0..k-1, as the reference. A router product split along K leaves its
// logits in `parts` partial sums part_stride floats apart, added here in order.
template <int KEYS, bool WEIGHTS>
__device__ __forceinline__ void route_token(const float* l, int experts, int top_k, int renormalize, int* ids,
                                            float* weights, int parts, size_t part_stride) {
    const unsigned full = 0xffffffffu;
    const int lane = threadIdx.x & 31;
    float v[KEYS];
    u64 key[KEYS];
    float m = NEG_INF;
#pragma unroll
    for (int i = 0; i < KEYS; ++i) v[i] = lane + 32 * i < experts ? l[lane + 32 * i] : NEG_INF;
    // The parts after the first, added in order; four parts' loads issued before any is added
    // (with the count known only at run time, each part's loads would wait for the last's sums).
    for (int q0 = 1; q0 < parts; q0 += 4) {
        float t[4][KEYS];
#pragma unroll
        for (int dq = 0; dq < 4; ++dq)
#pragma unroll
            for (int i = 0; i < KEYS; ++i)
                t[dq][i] = q0 + dq < parts && lane + 32 * i < experts ? l[(q0 + dq) * part_stride + lane + 32 * i] : 0.f;
#pragma unroll
        for (int dq = 0; dq < 4; ++dq)
            if (q0 + dq < parts)
#pragma unroll
                for (int i = 0; i < KEYS; ++i)
                    if (lane + 32 * i < experts) v[i] += t[dq][i];
    }
#pragma unroll
    for (int i = 0; i < KEYS; ++i) {
        const int e = lane + 32 * i;
        key[i] = (e < experts && v[i] == v[i]) ? pack_max(v[i], e) : 0;
        m = fmaxf(m, v[i]);
    }
    float z = 0.f;
    if (WEIGHTS) {
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(full, m, o));
#pragma unroll
        for (int i = 0; i < KEYS; ++i)
            if (lane + 32 * i < experts) z += expf(v[i] - m);
        z = warp_sum(z);
    }
    int mine = 0;
    if (!top_k_by_threshold<KEYS>(key, top_k, mine)) {
        // Odd-even transposition sort, largest first.
#pragma unroll
        for (int r = 0; r < KEYS; ++r)
#pragma unroll
            for (int i = r & 1; i + 1 < KEYS; i += 2)
                if (key[i] < key[i + 1]) {
                    const u64 t = key[i];
                    key[i] = key[i + 1];
                    key[i + 1] = t;
                }
        for (int j = 0; j < top_k; ++j) {
            const u32 hi = __reduce_max_sync(full, (u32)(key[0] >> 32));
            const u32 lo = __reduce_max_sync(full, (u32)(key[0] >> 32) == hi ? (u32)key[0] : 0u);
            const u64 best = ((u64)hi << 32) | lo;
            if (lane == j) mine = packed_index(best);  // all NaN: expert 0
            if (best && key[0] == best) {
#pragma unroll
                for (int i = 0; i + 1 < KEYS; ++i) key[i] = key[i + 1];
                key[KEYS - 1] = 0;
            }
        }
    }
    if (!WEIGHTS) {
        if (lane < top_k) ids[lane] = mine;
        return;
    }
    // The chosen expert's logit: its own load when unsplit (as before parts), else from the lane
    // that summed it (expert e is lane e % 32's key e / 32).
    float chosen = NEG_INF;
    if (parts == 1) {
        chosen = l[mine];
    } else {
#pragma unroll
        for (int i = 0; i < KEYS; ++i) {
            const float u = __shfl_sync(full, v[i], mine & 31);
            if ((mine >> 5) == i) chosen = u;
        }
    }
    const float p = lane < top_k ? expf(chosen - m) / z : 0.f;
    float total = 0.f;
    for (int j = 0; j < top_k; ++j) total += __shfl_sync(full, p, j);
    if (lane < top_k) {
        ids[lane] = mine;
        weights[lane] = renormalize ? p / total : p;
    }
}

// Up to 256 experts with 8 keys a lane, up to 512 (MAX_ROUTED_EXPERTS, mod.rs) with 16.
__device__ __forceinline__ void route_token_any(const float* l, int experts, int top_k, int renormalize, int* ids,
                                                float* weights, int parts, size_t part_stride) {
    if (experts <= 256) route_token<8>(l, experts, top_k, renormalize, ids, weights, parts, part_stride);
    else route_token<16>(l, experts, top_k, renormalize, ids, weights, parts, part_stride);
}

// The shared expert's gate logits of a MoE block when they come from the router's product split
// along K: `parts` partial sums of each (tokens floats apart) at parts_in, which moe_route adds
// into out; all zero for none.
struct SharedGate {
    const float* parts_in;
    float* out;
};

// The routing of each token: one warp per token, its logits in `parts` partial sums (a router
// product split along K; tokens x experts floats apart), and with a SharedGate the sum of its
// shared-gate logit's parts, in the same order.
extern "C" __global__ void moe_route(const float* logits, int parts, int* ids, float* weights, int experts,
                                     int top_k, int renormalize, SharedGate sg) {
    grid_dep();
    const size_t t = blockIdx.x;
    if (sg.out && threadIdx.x == 0) {
        float sum = sg.parts_in[t];
        for (int q = 1; q < parts; ++q) sum += sg.parts_in[q * (size_t)gridDim.x + t];
        sg.out[t] = sum;
    }
    const float* l = logits + t * experts;
    // One part, a literal: the unsplit routing loads its logits as it did before parts (a count
    // known only at run time cost it 60% at 1,024 tokens, run59).
    if (parts == 1) route_token_any(l, experts, top_k, renormalize, ids + t * top_k, weights + t * top_k, 1, 0);
    else route_token_any(l, experts, top_k, renormalize, ids + t * top_k, weights + t * top_k, parts,
                         (size_t)gridDim.x * experts);
}
