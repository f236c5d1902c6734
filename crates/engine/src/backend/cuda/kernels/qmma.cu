// Quantized products on the tensor cores, for prefill: the dense products over a chunk's tokens
// (up to four matrices that read the same input in one launch), and the routed experts grouped
// by expert (each expert's weights read once per tile of 64, or 16, of the tokens routed to it,
// instead of once per token).
//
// Exactness. MLX codes are small integers, exact in bf16, so the tensor cores multiply the codes
// themselves, never a rounded dequantized weight. Each activation is split into two bf16 parts
// (hi = bf16(x), lo = bf16(x - hi); 16 significant bits together), both multiplied, so the dot
// of a 64-column group is accumulated in f32 with a relative error near 2^-17. The group's scale
// and bias are then applied in f32 as the matrix-vector kernels do:
//   acc = scale * sum(q * x) + (bias * sum(x) + acc)
// which keeps the products within ~1e-10 (NMSE) of the CPU reference.
//
// Split activations. split_bf16 writes a product's input once as hi and lo [rows][cols] plus the
// f32 sum of each 64-column group [rows][cols / 64], so that the product's blocks (which all
// read the same rows) stage them by plain copies. The kernels that write a product's input (the
// norms and the attention's output gate, pointwise.cu) write the same split themselves, through
// store_split8 (common.cuh), and save the pass. Within each 8-column block the columns are
// stored in the order 0 4 1 5 2 6 3 7: a u32 of eight 4-bit codes then unpacks, two nibbles at
// a time ((w >> 4p) & 0x000f000f), straight into the bf16 pairs that meet them. The weights use
// the same order, so every dot product is unchanged.
//
// Tile: 128 weight rows x 64 token slots per block of 8 warps (2 along rows x 4 along tokens),
// one 64-column group per step. The next group's codes and activations are loaded into registers
// while the tensor cores work on the current one, then written to the second of two shared
// buffers (one barrier per group). Slot s of a block reads split row xrow[s] (-1: an empty slot)
// and writes output row yrow[s], so one core serves dense and grouped products: each kernel
// family lists its tiles (DenseTiles, GateUpTiles, DownTiles) and the core computes them. On
// sm_90a the same kernels run on Hopper's warpgroup products instead (the `wgmma` core below: 256
// rows a tile, and a block may take several tiles in turn); the host picks the core (mod.rs).

// Weight rows per block: each warp 64 rows x 16 slots (4 x 2 mma.m16n8k16 tiles), so that its B
// fragments serve 4 row tiles (1.5 shared-memory wavefronts per product instead of 2).
constexpr int TC_BM = 128;
constexpr int TC_BN = 64;
// Shared row pitch in bf16: 64 + 8, so that the fragment loads of a warp hit 32 different banks.
constexpr int TC_LD = 72;
constexpr int TC_THREADS = 256;

// One thread per 8-column block of x [rows][cols] (cols a multiple of 64): hi and lo in the
// stored order above, and each group's sum. With GLU, x holds [rows][2 * cols] (gate | up) and
// the split is of silu(gate) * up. Launch with 256 threads and ceil(rows * cols / 8 / 256)
// blocks.
template <bool GLU>
__device__ __forceinline__ void split_rows(const float* x, u16* hi, u16* lo, float* sum, long long blocks8,
                                           int cols) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    // A group's 8 threads are all in range or all out (blocks8 is a multiple of 8).
    if (i >= blocks8) return;
    float f[8];
    if constexpr (GLU) {
        const long long row = i / (cols / 8), c = (i % (cols / 8)) * 8;
        const float* g = x + row * 2 * cols + c;
        float u[8];
        load8(g, f);
        load8(g + cols, u);
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = silu(f[j]) * u[j];
    } else {
        load8(x + 8 * i, f);
    }
    store_split8(f, {hi, lo, sum}, i);
}

extern "C" __global__ void split_bf16(const float* x, u16* hi, u16* lo, float* sum, long long blocks8, int cols) {
    grid_dep();
    split_rows<false>(x, hi, lo, sum, blocks8, cols);
}
extern "C" __global__ void swiglu_split_bf16(const float* x, u16* hi, u16* lo, float* sum, long long blocks8,
                                             int cols) {
    grid_dep();
    split_rows<true>(x, hi, lo, sum, blocks8, cols);
}

// a * b + c on two bf16 lanes.
__device__ __forceinline__ u32 bf16x2_fma(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The bf16 pair (column p, column p + 4) of 8-column block b of a row's codes `w` (words of one
// 64-column group). 4-bit: OR-ing a nibble into the mantissa of 128.0 gives 128 + q exactly; one
// fused multiply-add takes the 128 off again (exact). 8-bit codes go through f32.
template <int BITS>
__device__ __forceinline__ u32 code_pair(const u32* w, int b, int p) {
    if constexpr (BITS == 4) {
        // (w & mask) | 128.0 in one lop3: written as C, the compiler moves the mask into a
        // register before every use.
        u32 t;
        asm("lop3.b32 %0, %1, 0x000f000f, 0x43004300, 0xea;" : "=r"(t) : "r"(w[b] >> (4 * p)));
        return bf16x2_fma(t, 0x3f803f80u, 0xc300c300u);
    } else {
        const u32 lo = __float_as_uint((float)((w[2 * b] >> (8 * p)) & 0xffu)) >> 16;
        const u32 hi = __float_as_uint((float)((w[2 * b + 1] >> (8 * p)) & 0xffu)) >> 16;
        return lo | (hi << 16);
    }
}

// Eight codes of one 8-column block as the bf16 pairs (column p, column p + 4), p = 0..3.
template <int BITS>
__device__ __forceinline__ uint4 codes_to_bf16(const u32 (&w)[BITS / 4]) {
    return make_uint4(code_pair<BITS>(w, 0, 0), code_pair<BITS>(w, 0, 1), code_pair<BITS>(w, 0, 2),
                      code_pair<BITS>(w, 0, 3));
}

// A split input (see split_bf16) with rows of ld columns (the product may read fewer).
struct SplitX {
    const u16* hi;
    const u16* lo;
    const float* sum;
    int ld;
};

// One 64-column group as the tensor cores read it.
struct __align__(16) TcGroup {
    u16 w[TC_BM][TC_LD];   // codes as bf16
    u16 xh[TC_BN][TC_LD];  // activations, high part
    u16 xl[TC_BN][TC_LD];  // activations, low part
    float scale[TC_BM];
    float bias[TC_BM];
    float sx[TC_BN];  // sum of the group's activations per slot
};

// A block's token slots: slot s reads split row xrow[s] (-1: an empty slot) and writes output
// row yrow[s]. Each product core keeps them in its shared memory (TcSmem, WgSmem).
struct TileSlots {
    int xrow[TC_BN];
    float* yrow[TC_BN];
};

// A tile of a product: rows [n0, n0 + the core's tile rows) of a rows x ld matrix, over its
// columns [k0, k0 + cols) (all of them unless the product is split along K; see DenseTiles). w
// starts at column k0 (from_column), so its rows are read as from column 0; x is moved by k0 where
// it is read.
struct TileJob {
    QMat w;
    int n0, rows, cols, k0, ld;
};

// A tile's weights and activations from column k0 on: w's rows keep their length (ld), so only
// the starts move (k0 is a multiple of 64: a whole group).
template <int BITS>
__device__ __forceinline__ QMat from_column(QMat w, int k0) {
    return {w.codes + (size_t)k0 * BITS / 32, w.scales + (k0 >> 6), w.biases + (k0 >> 6)};
}
__device__ __forceinline__ SplitX from_column(SplitX x, int k0) {
    return {x.hi + k0, x.lo + k0, x.sum + (k0 >> 6), x.ld};
}

// A tile's first column and the length of its matrix's rows: the job's own where its Jobs split
// along K (Jobs::PARTS), else 0 and its columns, known at compile time, so that the products
// that never split compile to what they were before the parts (a tile carried across a block's
// loop would otherwise keep both, run59).
template <class Jobs>
__device__ __forceinline__ int first_column(const TileJob& j) {
    return Jobs::PARTS ? j.k0 : 0;
}
template <class Jobs>
__device__ __forceinline__ int row_length(const TileJob& j) {
    return Jobs::PARTS ? j.ld : j.cols;
}

// The slots, then two groups (the one being multiplied and the next, written meanwhile). 75 KiB:
// dynamic shared memory (TC_SMEM_BYTES in mod.rs; each kernel checks that it got enough).
struct __align__(16) TcSmem {
    TileSlots slots;
    TcGroup group[2];
};

// The block's shared memory, trapping when the launch gave less than TcSmem needs.
__device__ __forceinline__ TcSmem& tc_smem() {
    extern __shared__ __align__(16) unsigned char tc_smem_raw[];
    require_dynamic_smem(sizeof(TcSmem));
    return *reinterpret_cast<TcSmem*>(tc_smem_raw);
}

// One group's global data, held in registers between its load and its store to shared memory:
// four 8-column blocks of codes per thread, and 16 columns of one slot.
template <int BITS>
struct TcStage {
    static constexpr int BLOCKS = TC_BM / 32;
    u32 codes[BLOCKS][BITS / 4];
    uint4 xh[2], xl[2];
    float xsum;
    u16 s, b;
};

template <int BITS>
__device__ __forceinline__ void tc_load(TcStage<BITS>& st, QMat w, SplitX x, const TcSmem& sm, int n0, int rows,
                                        int ld, int g) {
    const int tid = threadIdx.x;
    const size_t words = (size_t)ld * BITS / 32;
#pragma unroll
    for (int j = 0; j < TcStage<BITS>::BLOCKS; ++j) {
        const int blk = tid + j * TC_THREADS, r = blk >> 3, bi = blk & 7;
        const u32* src = w.codes + (size_t)(n0 + r) * words + (size_t)(g * 8 + bi) * (BITS / 4);
#pragma unroll
        for (int k = 0; k < BITS / 4; ++k) st.codes[j][k] = n0 + r < rows ? __ldg(src + k) : 0u;
    }
    // Thread r < BM fetches row r's scale and bias.
    const int r = tid;
    st.s = st.b = 0;
    if (r < TC_BM && n0 + r < rows) {
        const size_t gi = (size_t)(n0 + r) * (ld >> 6) + g;
        st.s = __ldg(w.scales + gi);
        st.b = __ldg(w.biases + gi);
    }
    // Four threads per slot, 16 columns each.
    const int row = sm.slots.xrow[tid >> 2];
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const size_t at = (size_t)row * x.ld + g * 64 + (tid & 3) * 16;
#pragma unroll
    for (int v = 0; v < 2; ++v) {
        st.xh[v] = row >= 0 ? *reinterpret_cast<const uint4*>(x.hi + at + 8 * v) : zero;
        st.xl[v] = row >= 0 ? *reinterpret_cast<const uint4*>(x.lo + at + 8 * v) : zero;
    }
    st.xsum = row >= 0 && (tid & 3) == 0 ? x.sum[(size_t)row * (x.ld >> 6) + g] : 0.f;
}

template <int BITS>
__device__ __forceinline__ void tc_store(const TcStage<BITS>& st, TcGroup& sm) {
    const int tid = threadIdx.x;
#pragma unroll
    for (int j = 0; j < TcStage<BITS>::BLOCKS; ++j) {
        const int blk = tid + j * TC_THREADS;
        *reinterpret_cast<uint4*>(&sm.w[blk >> 3][(blk & 7) * 8]) = codes_to_bf16<BITS>(st.codes[j]);
    }
    if (tid < TC_BM) {
        sm.scale[tid] = bf16_to_f32(st.s);
        sm.bias[tid] = bf16_to_f32(st.b);
    }
    const int slot = tid >> 2, c0 = (tid & 3) * 16;
#pragma unroll
    for (int v = 0; v < 2; ++v) {
        *reinterpret_cast<uint4*>(&sm.xh[slot][c0 + 8 * v]) = st.xh[v];
        *reinterpret_cast<uint4*>(&sm.xl[slot][c0 + 8 * v]) = st.xl[v];
    }
    if ((tid & 3) == 0) sm.sx[slot] = st.xsum;
}

// The block's 128 rows [n0, n0 + 128) of `rows` against its slots (set in sm.slots, and
// synchronised, by the caller) over `cols` columns (of w's rows of ld); results written to the
// slots' rows.
template <int BITS>
__device__ __forceinline__ void tc_product(QMat w, SplitX x, TcSmem& sm, int n0, int rows, int cols, int ld) {
    constexpr int MI = TC_BM / 32;  // 16-row tiles per warp
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp & 1, wn = warp >> 1;  // warp tile: rows wm * 64.., slots wn * 16..
    const int gq = lane >> 2, cq = lane & 3;  // mma fragment coordinates
    // The block row and slot of accumulator element e of row tile mi / slot tile ni.
    auto row_of = [&](int mi, int e) { return (wm * MI + mi) * 16 + gq + (e >> 1) * 8; };
    auto slot_of = [&](int ni, int e) { return wn * 16 + ni * 8 + 2 * cq + (e & 1); };
    float acc[MI][2][4] = {};
    TcStage<BITS> st;
    const int groups = cols >> 6;
    tc_load<BITS>(st, w, x, sm, n0, rows, ld, 0);
    tc_store<BITS>(st, sm.group[0]);
    __syncthreads();
    for (int g = 0; g < groups; ++g) {
        if (g + 1 < groups) tc_load<BITS>(st, w, x, sm, n0, rows, ld, g + 1);
        const TcGroup& cur = sm.group[g & 1];
        float d[MI][2][4] = {};
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            u32 bh[4], bl[4];  // [0..1]: slots 0-7 of the warp's 16, [2..3]: slots 8-15
            ldsm_b2(bh, &cur.xh[wn * 16][kk * 16], TC_LD);
            ldsm_b2(bl, &cur.xl[wn * 16][kk * 16], TC_LD);
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                u32 a[4];
                ldsm_a(a, &cur.w[(wm * MI + mi) * 16][kk * 16], TC_LD);
#pragma unroll
                for (int ni = 0; ni < 2; ++ni) {
                    mma_bf16(d[mi][ni], a, bh + 2 * ni);
                    mma_bf16(d[mi][ni], a, bl + 2 * ni);
                }
            }
        }
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int ni = 0; ni < 2; ++ni)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = row_of(mi, e);
                    acc[mi][ni][e] =
                        fmaf(cur.scale[r], d[mi][ni][e], fmaf(cur.bias[r], cur.sx[slot_of(ni, e)], acc[mi][ni][e]));
                }
        // The other buffer was last read in the previous step, which every warp finished before
        // this step's barrier: one barrier per group.
        if (g + 1 < groups) tc_store<BITS>(st, sm.group[(g + 1) & 1]);
        __syncthreads();
    }
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < 2; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = n0 + row_of(mi, e), slot = slot_of(ni, e);
                if (sm.slots.xrow[slot] >= 0 && r < rows) sm.slots.yrow[slot][r] = acc[mi][ni][e];
            }
}

// ---- Hopper (sm_90a): the same tile on warpgroup products (wgmma).
//
// Each of the block's four warpgroups multiplies 64 of its 256 rows by all 64 slots with
// wgmma.m64n64k16 (on 4-bit 16-slot tiles, two warpgroups 128 rows each: WG_MTILES): the weights
// as the A operand in registers, converted from the codes by the thread that holds them (each
// code converted once, no shared copy of bf16 weights), the activations as the B operand read by
// the tensor cores straight from shared memory (no ldmatrix).
// Codes and activations arrive by cp.async, four groups ahead, each stage handed over by
// mbarriers (wg_tiles). Per group the exact split and the f32 scale are as above; the bias
// half, sum over groups of bias * sum(x), is one more exact product after the last group
// (wg_bias_product), so that a group costs one FMA an accumulator, not two:
//   acc = sum_g scale_g * sum(q * x)_g  +  sum_g bias_g * sum(x)_g
// Every term is as exact as the mma core's; only the order of the f32 additions differs.
// These kernels were bound by instruction issue (Nsight Compute, docs/performance.md), so the
// per-group loop is kept to the instructions the products need: copy sources and destinations
// worked out once (WgCopies), stages by running index.
// 256 rows a block (twice the mma core's) because the activations, read from L2 once per block,
// are four bytes a value with the split: per product they outweigh the codes, and their traffic
// halves with each doubling of the rows.
//
// Slots. A tile takes N = 64 token slots, or 16 (the `_n16` kernels) where 64-slot tiles would
// leave the GPU idle: few tokens, or experts that see a few tokens each. A 16-slot block does a
// quarter of the products per group and, 4-bit, needs few enough registers that two fit an SM;
// the host picks (mod.rs, `ProductShape`). Each output is the same sum either way.

constexpr int WG_BM = 256;
// Row tiles of 64 a warpgroup takes: two on the 4-bit 16-slot tiles, else one. A warpgroup's
// per-group work beside its products (its copies, waits, descriptors and scale loads) does not
// grow with its rows, so on the 16-slot tiles, whose products are small, 128 rows a warpgroup
// issue fewer instructions a code than 64 (docs/performance.md, run62). 8-bit ones keep one: their
// stages leave room for one block an SM, whose warps two row tiles a warpgroup would halve.
// Threads a block: 256 rows over its warpgroups.
#define WG_MTILES(BITS, N) ((BITS) == 4 && (N) == 16 ? 2 : 1)
#define WG_THREADS_OF(BITS, N) (512 / WG_MTILES(BITS, N))
// Stages of codes and activations (groups in flight).
constexpr int WG_STAGES = 6;
// Blocks per SM: two for 4-bit 16-slot tiles (two warpgroups a block; with four warpgroups of one
// row tile each, two blocks of 64 registers a thread gave 7,640 vs 7,271 tok/s of prefill at 256
// tokens for one block of 128), else one.
#define WG_BLOCKS_PER_SM(BITS, N) ((BITS) == 4 && (N) == 16 ? 2 : 1)
// Whether a block stages its tiles' slot group sums (the bias product's B operand) in shared
// memory with the tiles' first copies, off the tile's end: 4-bit 64-slot tiles. 8-bit ones have
// no room for them; the 16-slot kernels, capped at 64 registers, spill more with the staging
// and lost 1% of prefill at 256 tokens with it (docs/performance.md, run50). The others read
// the sums from L2 at the tile's end.
#define WG_STAGED_SUMS(BITS, N) ((BITS) == 4 && (N) == 64)

// One group's operands. x parts as wgmma's K-major operand with the 128-byte swizzle: slot s's 64
// columns are the 128-byte row s, its 16-byte chunk c stored at chunk c ^ (s & 7), so that the
// tensor cores reading the same columns of eight slots hit eight different banks (wg_x_at;
// 1,024-byte aligned). Codes: row r's 2 * BITS words as BITS / 2 chunks, swizzled (wg_chunk) so
// that the eight rows a warp reads at once fall in different banks.
template <int BITS, int N>
struct __align__(1024) WgStage {
    u16 xh[N * 64];
    u16 xl[N * 64];
    u32 codes[WG_BM * 2 * BITS];
    // The parts' byte offsets, for copies addressed from the stage's shared address (wg_load).
    static constexpr u32 XH = 0, XL = N * 64 * 2, CODES = 2 * N * 64 * 2;
};

// With 64 slots 203 KiB (4-bit) or 219 KiB (8-bit); with 16, 81 or 129 KiB; and up to 1,023
// bytes to align it: wg_smem_bytes in mod.rs.
template <int BITS, int N>
struct __align__(1024) WgSmem {
    WgStage<BITS, N> stage[WG_STAGES];
    // The bias product's B operand (wg_bias_product): the slots' group sums in three bf16 parts,
    // each laid out as an x part. Its own, since the stages already hold the next tile's groups.
    u16 __align__(1024) sum_parts[3 * N * 64];
    // The slots' f32 sums of groups 0-63, [slot][group], of tile k in sums[k & 1] (copied with
    // the tile's first group; WG_STAGED_SUMS).
    float sums[2][WG_STAGED_SUMS(BITS, N) ? N * 64 : 4];
    // The slots of a block's current tile and of the next one (tile k in slots[k & 1]).
    TileSlots slots[2];
    // Per stage: `full` completes a phase when every thread's copies of its group have landed,
    // `empty` when every warp has finished with that group (wg_tiles).
    u64 full[WG_STAGES], empty[WG_STAGES];
};

// The block's shared memory, from the first 1,024-byte boundary of the dynamic allocation.
template <int BITS, int N>
__device__ __forceinline__ WgSmem<BITS, N>& wg_smem() {
    extern __shared__ __align__(16) unsigned char tc_smem_raw[];
    require_dynamic_smem(sizeof(WgSmem<BITS, N>) + 1024);
    return *reinterpret_cast<WgSmem<BITS, N>*>(tc_smem_raw + ((1024 - (smem_addr(tc_smem_raw) & 1023)) & 1023));
}

// Element offset of column chunk c (8 columns) of slot s in an x part (see WgStage).
__device__ __forceinline__ int wg_x_at(int s, int c) { return s * 64 + ((c ^ (s & 7)) * 8); }

// Where chunk c of code row r lies among the row's CH chunks.
template <int CH>
__device__ __forceinline__ int wg_chunk(int r, int c) {
    return c ^ ((r >> (CH == 2 ? 2 : 1)) & (CH - 1));
}

// Shared-memory descriptor of an x part from its first column (the K-major layout with the 128-byte
// swizzle): start address, the leading-dimension offset (unused with this swizzle: 1), the
// distance between 8-slot blocks (1,024 bytes), each in units of 16 bytes, and the swizzle mode.
// Column 16 kk's is smem_desc_advance(wg_desc(part), 32 * kk): the start moves 32 bytes a step
// inside the 1,024-byte aligned rows; the hardware applies the swizzle to the addresses it forms.
__device__ __forceinline__ u64 wg_desc(const u16* part) { return smem_desc_sw128(part, 16); }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d (+)= a * b over 64 rows x N slots x 16 columns: a in registers (the m16n8k16 A fragment of
// the warp's 16 rows), b by descriptor. Asynchronous until wgmma_wait.
__device__ __forceinline__ void wgmma_rs(float (&d)[8], const u32 (&a)[4], u64 b, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %13, 0; "
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7}, "
        "{%8, %9, %10, %11}, %12, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate)
        : "memory");
}
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const u32 (&a)[4], u64 b, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %37, 0; "
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        WGMMA_D32_REGS
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0; }"
        : WGMMA_D32_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate)
        : "memory");
}
#endif

// One thread's part of every group's copies of a tile into a stage, worked out once per tile:
// the element offsets of its sources at group 0 (-1: nothing to copy) and where each lands
// within a stage. Group g's sources lie g groups further on. x of the occupied slots (threads
// below 8N each take one chunk of slot tid / 8, whose split row is `row`); the codes of the rows
// in range (what stays stale only feeds outputs that are never written); with the tile's first
// group, the slot's group sums (WG_STAGED_SUMS; wg_bias_product reads them at the tile's end).
template <int BITS, int N>
struct WgCopies {
    static constexpr int CH = BITS / 2;
    int x = -1;         // one 8-column chunk of a slot, into x.hi and x.lo alike
    u32 x_at = 0;       // its byte offset within a stage's xh (and xl)
    // 16-byte chunks of code rows, into w.codes: a stage's 256 x CH over the block's threads.
    static constexpr int CODES = WG_BM * CH / WG_THREADS_OF(BITS, N);
    int codes[CODES];
    u32 codes_at[CODES];
    int sum = -1;       // the slot's sums of groups 8c .. 8c + 7 (c = tid % 8), into sums

    // k0 and ld: the tile's first column and its matrix's row length (first_column, row_length).
    __device__ __forceinline__ WgCopies(int row, SplitX x_, const TileJob& j_, int k0, int ld) {
        const int tid = threadIdx.x, n0 = j_.n0, rows = j_.rows;
        if (tid < 8 * N) {
            const int s = tid >> 3, c = tid & 7;
            x = row >= 0 ? row * x_.ld + k0 + c * 8 : -1;
            x_at = 2 * wg_x_at(s, c);
            sum = row >= 0 && 8 * c < (j_.cols >> 6) ? row * (x_.ld >> 6) + (k0 >> 6) + 8 * c : -1;
        }
        const int words = ld * BITS / 32;
#pragma unroll
        for (int j = 0; j < CODES; ++j) {
            const int i = tid + j * WG_THREADS_OF(BITS, N), r = i / CH, c = i % CH;
            codes[j] = n0 + r < rows ? (n0 + r) * words + c * 4 : -1;
            codes_at[j] = 4 * (r * CH + wg_chunk<CH>(r, c)) * 4;
        }
    }
};

// Starts the copies of the slot sums that thread tid < 8N holds for the tile (groups 8c .. 8c + 7
// of slot tid / 8, those below `groups`) to `dst` (its place in the tile's sums).
__device__ __forceinline__ void wg_load_sums(u32 dst, const float* sum, int groups) {
    const int c = threadIdx.x & 7;
    if (8 * c + 8 <= groups && ((size_t)sum & 15) == 0) {
        cp_async16_to(dst, sum);
        cp_async16_to(dst + 16, sum + 4);
    } else {
        for (int i = 0; i < 8 && 8 * c + i < groups; ++i) cp_async4_to(dst + 4 * i, sum + i);
    }
}

// Starts the copies of group g into the stage at shared address `stage`.
template <int BITS, int N>
__device__ __forceinline__ void wg_load(u32 stage, const WgCopies<BITS, N>& cp, QMat w, SplitX x, int g) {
    using St = WgStage<BITS, N>;
    if (cp.x >= 0) {
        const u32 at = (u32)cp.x + 64u * g;
        cp_async16_to(stage + St::XH + cp.x_at, x.hi + at);
        cp_async16_to(stage + St::XL + cp.x_at, x.lo + at);
    }
#pragma unroll
    for (int j = 0; j < WgCopies<BITS, N>::CODES; ++j)
        if (cp.codes[j] >= 0) cp_async16_to(stage + St::CODES + cp.codes_at[j], w.codes + (u32)cp.codes[j] + 2u * BITS * g);
}

// The A fragments of the thread's rows r and r + 8 for the group's four 16-column steps.
template <int BITS, int N>
__device__ __forceinline__ void wg_a_frags(u32 (&a)[4][4], const WgStage<BITS, N>& st, int r, int cq) {
    constexpr int CH = BITS / 2;
    u32 w0[2 * BITS], w1[2 * BITS];
#pragma unroll
    for (int c = 0; c < CH; ++c) {
        const uint4 u = *reinterpret_cast<const uint4*>(&st.codes[(r * CH + wg_chunk<CH>(r, c)) * 4]);
        const uint4 v = *reinterpret_cast<const uint4*>(&st.codes[((r + 8) * CH + wg_chunk<CH>(r + 8, c)) * 4]);
        w0[4 * c] = u.x, w0[4 * c + 1] = u.y, w0[4 * c + 2] = u.z, w0[4 * c + 3] = u.w;
        w1[4 * c] = v.x, w1[4 * c + 1] = v.y, w1[4 * c + 2] = v.z, w1[4 * c + 3] = v.w;
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        a[kk][0] = code_pair<BITS>(w0, 2 * kk, cq);
        a[kk][1] = code_pair<BITS>(w1, 2 * kk, cq);
        a[kk][2] = code_pair<BITS>(w0, 2 * kk + 1, cq);
        a[kk][3] = code_pair<BITS>(w1, 2 * kk + 1, cq);
    }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The bias half of every group's sum, acc[row][slot] += sum_g bias[row][g] * sum(x[slot], group
// g), as products after the last group instead of a second FMA per accumulator and group: the
// biases (exact in bf16) as the A operand, rows r and r + 8 of row tile m from at0[m] and at1[m];
// the slots' group sums as B, split in three bf16 parts (exact: 24 significant bits), in
// sm.sum_parts (part p from element p * N * 64, laid out as x). 64 groups a round, in their
// natural order along K. Its first barrier also makes the slots the loads wrote for the next tile
// visible (wg_tiles).
template <int BITS, int N, int MT = WG_MTILES(BITS, N)>
__device__ __forceinline__ void wg_bias_product(float (&acc)[MT][N / 2], QMat w, SplitX x, WgSmem<BITS, N>& sm,
                                                const TileSlots& sl, int k, const u32 (&at0)[MT],
                                                const u32 (&at1)[MT], int groups, int cq) {
    const int tid = threadIdx.x;
    u16* part = sm.sum_parts;
    auto pair = [&](u32 at, int g) {
        const u32 b0 = g < groups ? __ldg(w.biases + at + g) : 0u;
        const u32 b1 = g + 1 < groups ? __ldg(w.biases + at + g + 1) : 0u;
        return b0 | (b1 << 16);
    };
    for (int g0 = 0; g0 < groups; g0 += 64) {
        // The A fragments first, so that their loads (their lines asked into L2 as the tile's
        // copies began) overlap the wait at the barrier: bias pairs (g, g + 1) of rows r and
        // r + 8 at K = 2cq (and + 8) of each 16-group step the round has; past the last, zero.
        const int steps = min(4, (groups - g0 + 15) / 16);
        u32 a[MT][4][4] = {};
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                if (kk < steps) {
                    const int g = g0 + 16 * kk + 2 * cq;
                    a[m][kk][0] = pair(at0[m], g), a[m][kk][1] = pair(at1[m], g);
                    a[m][kk][2] = pair(at0[m], g + 8), a[m][kk][3] = pair(at1[m], g + 8);
                }
        // Every warp is past the previous tile's (or round's) bias products before the parts are
        // rewritten.
        __syncthreads();
        if (tid < 8 * N) {
            const int s = tid >> 3, c = tid & 7, row = sl.xrow[s];
            // The round's sums: the first 64 groups' staged with the tile's copies (landed: every
            // thread waited for all of the tile's groups), later ones from L2.
            const bool staged = WG_STAGED_SUMS(BITS, N) && g0 == 0;
            const float* from = staged ? &sm.sums[k & 1][s * 64] : x.sum + (size_t)max(row, 0) * (x.ld >> 6) + g0;
            u32 p[3][4];  // part q's bf16 pairs (groups 2i and 2i + 1 of the chunk)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float f[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int g = 8 * c + 2 * i + e;
                    f[e] = row >= 0 && g0 + g < groups ? from[g] : 0.f;
                }
                // f = hi + mid + lo exactly: hi rounds f to 8 significant bits, the rest (at
                // most 16) is split as the activations are.
                p[0][i] = bf16x2_bits(f[0], f[1]);
                bf16x2_split(f[0] - bf16x2_lo(p[0][i]), f[1] - bf16x2_hi(p[0][i]), p[1][i], p[2][i]);
            }
#pragma unroll
            for (int q = 0; q < 3; ++q)
                *reinterpret_cast<uint4*>(part + q * N * 64 + wg_x_at(s, c)) = make_uint4(p[q][0], p[q][1], p[q][2], p[q][3]);
        }
        fence_proxy_async();
        __syncthreads();
        wgmma_fence();
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                if (kk < steps)
#pragma unroll
                    for (int q = 0; q < 3; ++q)
                        wgmma_rs(acc[m], a[m][kk], smem_desc_advance(wg_desc(part + q * N * 64), 32 * kk), 1);
        wgmma_commit();
        wgmma_wait_all();
#pragma unroll
        for (int m = 0; m < MT; ++m) wgmma_hold(acc[m]);
    }
}
#endif

// The first tile at or after i, stepping by the grid, that has rows to compute (or `count`).
template <class Jobs>
__device__ __forceinline__ int next_tile(const Jobs& jobs, int i, int count) {
    while (i < count && jobs.empty(i)) i += gridDim.x;
    return i;
}

// The products of tiles blockIdx.x, blockIdx.x + gridDim.x, ... of `jobs` (see DenseTiles) on the
// warpgroup products. A block takes its tiles one after another with one pipeline of copies: the
// copies run WG_STAGES - 2 groups ahead of the products across the end of a tile, so that a
// tile's first groups (and its slots) land while the previous tile's last groups and bias
// products run, instead of each block starting cold (docs/performance.md, run47). Launch with
// WG_THREADS_OF(BITS, N) threads and at most one block per tile; with fewer blocks than tiles
// (persistent), every tile needs at least WG_STAGES groups (the host checks): that is what lets
// the copies of tile k + 1 rewrite slots[(k + 1) & 1] (see load_next).
template <int BITS, int N, class Jobs>
__device__ __forceinline__ void wg_tiles(const Jobs& jobs, SplitX x) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    WgSmem<BITS, N>& sm = wg_smem<BITS, N>();
    constexpr int MT = WG_MTILES(BITS, N), T = WG_THREADS_OF(BITS, N);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, cq = lane & 3;
    // The thread's tile rows r(m) and r(m) + 8 of its row tiles m: warpgroup warp >> 2 takes MT
    // tiles of 64 rows, each warp 16 rows of each.
    auto row_at = [&](int m) { return 64 * (MT * (warp >> 2) + m) + 16 * (warp & 3) + gq; };
    const int count = jobs.count();
    int tile = next_tile(jobs, blockIdx.x, count);
    if (tile >= count) return;  // the whole block, before any barrier
    // Stages cycle through the block's groups in order, over all its tiles: phase k of
    // full[G % S] is running group G + kS landed, phase k of empty[G % S] every warp done with
    // it. No block-wide barrier per group: a warpgroup waits only for its group's copies, and
    // the copies of group G into a stage wait only for the warps to finish group G - S, so the
    // warpgroups drift apart and one's products run while another folds its results and
    // converts its next codes.
    constexpr int S = WG_STAGES;
    // The copies' tile (lt, the block's lk-th), its group lg and the running group's stage.
    int lt = tile, lk = 0, lg = 0, ls = 0, lpar = 0, lrun = 0;
    TileJob lj = jobs.job(lt);
    // Thread tid < N writes slot tid's rows; thread tid < 8N copies x of slot tid / 8.
    auto slot_rows = [&](int t, int k) {
        int xrow = -1;
        float* yrow = nullptr;
        if (tid < N) {
            jobs.slot(t, tid, xrow, yrow);
            sm.slots[k & 1].xrow[tid] = xrow;
            sm.slots[k & 1].yrow[tid] = yrow;
        }
        if (tid < 8 * N) jobs.slot(t, tid >> 3, xrow, yrow);
        return WgCopies<BITS, N>(xrow, x, lj, first_column<Jobs>(lj), row_length<Jobs>(lj));
    };
    // The scales (its first group's are read as the tile starts) and biases (read at its end) of
    // the thread's rows of a tile toward L2, as the tile's copies begin.
    auto rows_to_l2 = [&](const TileJob& tj) {
        if (cq != 0) return;
        const size_t row_groups = row_length<Jobs>(tj) >> 6;
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = tj.n0 + row_at(m) + 8 * h;
                if (row < tj.rows) {
                    prefetch_l2(tj.w.scales + row * row_groups);
                    prefetch_l2(tj.w.biases + row * row_groups);
                }
            }
    };
    WgCopies<BITS, N> copies = slot_rows(lt, lk);
    rows_to_l2(lj);
    if (tid == 0)
        for (int i = 0; i < S; ++i) {
            mbar_init(&sm.full[i], T);
            mbar_init(&sm.empty[i], T / 32);
        }
    __syncthreads();
    // Stages, and their barriers, by shared address.
    constexpr u32 STAGE_BYTES = sizeof(WgStage<BITS, N>);
    const u32 stage0 = smem_addr(&sm.stage[0]), full0 = smem_addr(&sm.full[0]), empty0 = smem_addr(&sm.empty[0]);
    const u32 sums0 = smem_addr(&sm.sums[0][0]);
    constexpr u32 SUMS_BYTES = sizeof(sm.sums[0]);
    // Copies the next group: its stage's previous group must be done with first, then this
    // thread arrives on the stage's `full`. Moving on to the block's next tile k + 1 rewrites
    // slots[(k + 1) & 1] and sums[(k + 1) & 1], last read by tile k - 1's end: the wait for
    // group G - S (every tile has at least S groups) means every warp has finished a group of
    // tile k, so it is past them.
    auto load_next = [&]() {
        if (lt >= count) return;
        if (lrun >= S) mbar_wait(empty0 + 8 * ls, lpar ^ 1);
        if (lg == (lj.cols >> 6)) {
            lt = next_tile(jobs, lt + gridDim.x, count);
            if (lt >= count) return;
            lj = jobs.job(lt);
            lg = 0;
            copies = slot_rows(lt, ++lk);
            rows_to_l2(lj);
        }
        wg_load<BITS, N>(stage0 + ls * STAGE_BYTES, copies, lj.w, x, lg);
        // The tile's slot sums, with its first group (see above).
        if (WG_STAGED_SUMS(BITS, N) && lg == 0 && copies.sum >= 0)
            wg_load_sums(sums0 + (lk & 1) * SUMS_BYTES + 4 * (tid >> 3) * 64 + 32 * (tid & 7), x.sum + copies.sum,
                         lj.cols >> 6);
        mbar_arrive_copies(full0 + 8 * ls);
        ++lg, ++lrun;
        if (++ls == S) ls = 0, lpar ^= 1;
    };
    for (int G = 0; G < S - 2; ++G) load_next();
    // The running group's stage cs and parity.
    int cs = 0, cpar = 0;
    for (int k = 0; tile < count; tile = next_tile(jobs, tile + gridDim.x, count), ++k) {
        const TileJob j = jobs.job(tile);
        const int groups = j.cols >> 6;
        // Rows r(m) and r(m) + 8's scales from the tile's first group, loaded one group ahead of
        // their use (a row past the matrix reads row 0's: its results are never written).
        const u32 row_groups = row_length<Jobs>(j) >> 6;  // rows * row_groups < 2^32
        u32 at0[MT], at1[MT];
        u16 s0[MT], s1[MT];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            const int r = j.n0 + row_at(m);
            at0[m] = (u32)(r < j.rows ? r : 0) * row_groups;
            at1[m] = (u32)(r + 8 < j.rows ? r + 8 : 0) * row_groups;
            s0[m] = __ldg(j.w.scales + at0[m]), s1[m] = __ldg(j.w.scales + at1[m]);
        }
        float acc[MT][N / 2] = {};
        for (int g = 0; g < groups; ++g) {
            const int gn = min(g + 1, groups - 1);
            u16 s0n[MT], s1n[MT];
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                s0n[m] = __ldg(j.w.scales + at0[m] + gn);
                s1n[m] = __ldg(j.w.scales + at1[m] + gn);
            }
            mbar_wait(full0 + 8 * cs, cpar);
            fence_proxy_async();
            const WgStage<BITS, N>& st = sm.stage[cs];
            u32 a[MT][4][4];
#pragma unroll
            for (int m = 0; m < MT; ++m) wg_a_frags<BITS, N>(a[m], st, row_at(m), cq);
            float d[MT][N / 2];
            const u64 xh = wg_desc(st.xh), xl = wg_desc(st.xl);
            wgmma_fence();
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) {
                    wgmma_rs(d[m], a[m][kk], smem_desc_advance(xh, 32 * kk), kk > 0);
                    wgmma_rs(d[m], a[m][kk], smem_desc_advance(xl, 32 * kk), 1);
                }
            wgmma_commit();
            wgmma_wait_all();
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                wgmma_hold(d[m]);
                const float fs0 = bf16_to_f32(s0[m]), fs1 = bf16_to_f32(s1[m]);
                // d[m][4j + e]: row r(m) + 8 (e >> 1), slot 8j + 2cq + (e & 1).
#pragma unroll
                for (int jj = 0; jj < N / 8; ++jj) {
                    acc[m][4 * jj] = fmaf(fs0, d[m][4 * jj], acc[m][4 * jj]);
                    acc[m][4 * jj + 1] = fmaf(fs0, d[m][4 * jj + 1], acc[m][4 * jj + 1]);
                    acc[m][4 * jj + 2] = fmaf(fs1, d[m][4 * jj + 2], acc[m][4 * jj + 2]);
                    acc[m][4 * jj + 3] = fmaf(fs1, d[m][4 * jj + 3], acc[m][4 * jj + 3]);
                }
                s0[m] = s0n[m], s1[m] = s1n[m];
            }
            // This warp is done with the stage (its products waited for).
            __syncwarp();
            if (lane == 0) mbar_arrive(empty0 + 8 * cs);
            // S - 2 groups ahead: its stage held the group S - 2 back, which a warpgroup up to
            // two groups behind this one may still be reading.
            load_next();
            if (++cs == S) cs = 0, cpar ^= 1;
        }
        const TileSlots& sl = sm.slots[k & 1];
        wg_bias_product<BITS, N>(acc, j.w, from_column(x, first_column<Jobs>(j)), sm, sl, k, at0, at1, groups, cq);
        // Streaming stores: the next kernel reads each output once, and the tiles still to come
        // want L2 for their activations and codes (-1.5 ms of a 4,096-token chunk; run66).
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int jj = 0; jj < N / 8; ++jj)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int slot = 8 * jj + 2 * cq + (e & 1), row = j.n0 + row_at(m) + 8 * (e >> 1);
                    if (sl.xrow[slot] >= 0 && row < j.rows) __stcs(&sl.yrow[slot][row], acc[m][4 * jj + e]);
                }
    }
#else
    __trap();  // the host launches these only on sm_90a
#endif
}

// The product core of each kernel family: `mma` (any sm_80+) or `wgmma` (sm_90a), with the
// weight rows of a tile.
template <bool WG>
__device__ constexpr int tile_rows() {
    return WG ? WG_BM : TC_BM;
}

// The mma core: tile blockIdx.x of `jobs`, one a block.
template <int BITS, class Jobs>
__device__ __forceinline__ void tc_tiles(const Jobs& jobs, SplitX x) {
    const int tile = blockIdx.x;
    if (tile >= jobs.count() || jobs.empty(tile)) return;
    TcSmem& sm = tc_smem();
    if (threadIdx.x < TC_BN) jobs.slot(tile, threadIdx.x, sm.slots.xrow[threadIdx.x], sm.slots.yrow[threadIdx.x]);
    __syncthreads();
    const TileJob j = jobs.job(tile);
    tc_product<BITS>(j.w, from_column(x, first_column<Jobs>(j)), sm, j.n0, j.rows, j.cols, row_length<Jobs>(j));
}

// Every product kernel computes the tiles of a `Jobs`, which says for tile i (0 <= i < count())
// its weights and rows (job), whether it has none (empty) and where its slot s reads and writes
// (slot). N token slots a tile: 64 or 16 on the wgmma core, 64 on the mma core.
template <int BITS, bool WG, int N, class Jobs>
__device__ __forceinline__ void product_tiles(const Jobs& jobs, SplitX x) {
    static_assert(N == TC_BN || (WG && N == 16), "tile slots");
    if constexpr (WG) wg_tiles<BITS, N>(jobs, x);
    else tc_tiles<BITS>(jobs, x);
}

// The dense products y_m[t][n] = sum_k w_m[n][k] * x[t][k] of the batch's matrices m (up to four,
// one launch: the products of one input), x split: tile i is row tile i % first_block[4] (matrix
// m's first_block[m].. taking its rows BM at a time) of token tile i / first_block[4]. Split along
// K (a product too small to fill the GPU, the router, in more blocks that each walk fewer groups),
// the blocks of grid row `part` take columns [part * part_cols, + part_cols) and write their
// partial sums to y_m + part * tokens * rows_m, for a reader that adds the parts in order
// (moe_route). Only the PARTS kernels split (their grid has a row a part): unsplit, a tile's
// columns are all of them at compile time, so the products that never split pay nothing for it
// (the first form, one kernel for both, ran the unsplit products 0.5-1.7% slower, run59).
template <int BITS, int N, int BM, bool SPLIT>
struct DenseTiles {
    static constexpr bool PARTS = SPLIT;
    const QBatch& b;
    int tokens, cols, part_cols, part;

    __device__ __forceinline__ int count() const { return b.first_block[4] * ((tokens + N - 1) / N); }
    __device__ __forceinline__ bool empty(int) const { return false; }
    __device__ __forceinline__ int matrix(int rt) const {
        int m = 0;
        while (m < 3 && rt >= b.first_block[m + 1]) ++m;
        return m;
    }
    __device__ __forceinline__ TileJob job(int i) const {
        const int rt = i % b.first_block[4], m = matrix(rt);
        const QMat w{b.codes[m], b.scales[m], b.biases[m]};
        const int n0 = (rt - b.first_block[m]) * BM;
        if (!PARTS) return {w, n0, b.rows[m], cols, 0, cols};
        const int k0 = part * part_cols;
        return {from_column<BITS>(w, k0), n0, b.rows[m], min(part_cols, cols - k0), k0, cols};
    }
    __device__ __forceinline__ void slot(int i, int s, int& xrow, float*& yrow) const {
        const int m = matrix(i % b.first_block[4]), t = i / b.first_block[4] * N + s;
        xrow = t < tokens ? t : -1;
        yrow = b.y[m] + ((size_t)(PARTS ? part : 0) * tokens + t) * b.rows[m];
    }
};

// Threads and blocks per SM of each core.
#define QMMA_BOUNDS(WG, BITS, N) \
    __launch_bounds__(WG ? WG_THREADS_OF(BITS, N) : TC_THREADS, WG ? WG_BLOCKS_PER_SM(BITS, N) : 2)

// q4_mma, q8_mma (any sm_80+) and q4_wgmma, q8_wgmma, q4_wgmma_n16, q8_wgmma_n16 (sm_90a):
// DenseTiles, cols a multiple of 64, one grid row; and q4_parts_mma, ... (the same shapes) split
// along K, part_cols a multiple of 64, a grid row per part of the columns (ceil(cols /
// part_cols) of them). Launch with the core's threads (mma 256, wgmma WG_THREADS_OF) and a block
// per tile (wgmma: or fewer, see wg_tiles).
#define QMMA_DENSE_KERNEL(BITS, NAME, WG, N, PARTS)                                                                 \
    extern "C" __global__ void QMMA_BOUNDS(WG, BITS, N) q##BITS##_##NAME(                                           \
        QBatch b, const u16* xh, const u16* xl, const float* xsum, int tokens, int cols, int part_cols) {           \
        grid_dep();                                                                                                 \
        const DenseTiles<BITS, N, tile_rows<WG>(), PARTS> jobs{b, tokens, cols, part_cols, (int)blockIdx.y};        \
        product_tiles<BITS, WG, N>(jobs, {xh, xl, xsum, cols});                                                     \
    }
#define QMMA_DENSE(BITS, NAME, WG, N)             \
    QMMA_DENSE_KERNEL(BITS, NAME, WG, N, false) \
    QMMA_DENSE_KERNEL(BITS, parts_##NAME, WG, N, true)
// Every product kernel family comes in these shapes: (bits, core name, wgmma core, token slots).
#define PRODUCT_SHAPES(X) \
    X(4, mma, false, 64) X(8, mma, false, 64) X(4, wgmma, true, 64) X(8, wgmma, true, 64) \
    X(4, wgmma_n16, true, 16) X(8, wgmma_n16, true, 16)
PRODUCT_SHAPES(QMMA_DENSE)

// ---- the routed experts grouped by expert. Pair p < pairs is token p / top_k's (p % top_k)-th
// chosen expert ids[p]; with a shared expert, pair pairs + t is token t's, as the virtual expert
// `experts`. Three kernels sort the pairs by expert (perm) and cut each expert's run into tiles of
// up to `slots` pairs (the products' token slots): tiles[3 * i] = expert, [3 * i + 1] = first
// index into perm, [3 * i + 2] = pairs in the tile; ntiles[0] = the tile count. The order of the
// pairs inside an expert's run does not matter: each pair's outputs depend only on its own
// activations. One block of 1,024 threads did all of it in 42 us a layer at 4,096 tokens, its one
// SM's scattered stores the bound; over the grid it takes a few (docs/performance.md, run49).
//   moe_group_count:   each block of MOE_GROUP_PAIRS pairs counts its pairs per expert, and
//                      ranks each pair among its block's pairs of the same expert;
//   moe_group_scan:    one block: per expert, each count block's first index in the expert's
//                      run; the runs' starts and tiles (scans over the experts);
//   moe_group_scatter: perm[start + the block's first index + rank] = pair.

constexpr int MAX_GROUPS = 1024;
// Pairs a moe_group_count block takes, one a thread.
constexpr int MOE_GROUP_PAIRS = 1024;
// Count blocks whose counts a moe_group_scan thread loads at once (a 4,096-token chunk has 32).
constexpr int MOE_SCAN_BATCH = 16;

// Exclusive prefix sums of a and b over the block's threads in order (every thread calls it,
// 1,024 at most); the totals in ta and tb.
__device__ __forceinline__ void block_scan2(int& a, int& b, int& ta, int& tb) {
    __shared__ int wa[32], wb[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    int ia = a, ib = b;  // inclusive within the warp
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int ua = __shfl_up_sync(~0u, ia, o), ub = __shfl_up_sync(~0u, ib, o);
        if (lane >= o) ia += ua, ib += ub;
    }
    if (lane == 31) wa[warp] = ia, wb[warp] = ib;
    __syncthreads();
    if (warp == 0) {
        int va = lane < warps ? wa[lane] : 0, vb = lane < warps ? wb[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int ua = __shfl_up_sync(~0u, va, o), ub = __shfl_up_sync(~0u, vb, o);
            if (lane >= o) va += ua, vb += ub;
        }
        wa[lane] = va, wb[lane] = vb;  // inclusive over the warps
    }
    __syncthreads();
    ta = wa[warps - 1], tb = wb[warps - 1];
    a = (warp > 0 ? wa[warp - 1] : 0) + ia - a;
    b = (warp > 0 ? wb[warp - 1] : 0) + ib - b;
}

// Block blockIdx.x's pairs [MOE_GROUP_PAIRS * blockIdx.x, +MOE_GROUP_PAIRS): rank[p] = how many
// of the block's pairs of expert ids[p] came before it (in the order of shared-memory atomics),
// counts[blockIdx.x * groups + e] = the block's pairs of expert e, for every group e. Expert
// ids must lie in [0, experts); groups (experts, and the shared expert) <= MAX_GROUPS. Launch
// with MOE_GROUP_PAIRS threads and ceil(pairs / MOE_GROUP_PAIRS) blocks.
extern "C" __global__ void __launch_bounds__(MOE_GROUP_PAIRS)
    moe_group_count(const int* ids, int pairs, int groups, int* rank, int* counts) {
    grid_dep();
    __shared__ int count[MAX_GROUPS];
    const int tid = threadIdx.x, p = blockIdx.x * MOE_GROUP_PAIRS + tid;
    for (int e = tid; e < groups; e += blockDim.x) count[e] = 0;
    __syncthreads();
    if (p < pairs) rank[p] = atomicAdd(&count[ids[p]], 1);
    __syncthreads();
    for (int e = tid; e < groups; e += blockDim.x) counts[blockIdx.x * groups + e] = count[e];
}

// One block of 1,024 threads, thread e for group e: counts[b * groups + e] becomes count block
// b's first index within expert e's run; start[e] = the run's first index into perm (the shared
// expert's run, `tokens` pairs, last); the runs' tiles as above.
extern "C" __global__ void __launch_bounds__(1024)
    moe_group_scan(int* counts, int count_blocks, int tokens, int experts, int with_shared, int slots, int* start,
                   int* tiles, int* ntiles) {
    grid_dep();
    const int tid = threadIdx.x, groups = experts + (with_shared ? 1 : 0);
    int c = 0;
    if (tid < experts) {
        // Each batch's counts loaded before any offset is stored (the stores could alias later
        // loads, so the compiler would not move those ahead of them).
        for (int b0 = 0; b0 < count_blocks; b0 += MOE_SCAN_BATCH) {
            int n[MOE_SCAN_BATCH];
#pragma unroll
            for (int i = 0; i < MOE_SCAN_BATCH; ++i)
                n[i] = b0 + i < count_blocks ? counts[(size_t)(b0 + i) * groups + tid] : 0;
#pragma unroll
            for (int i = 0; i < MOE_SCAN_BATCH; ++i)
                if (b0 + i < count_blocks) {
                    counts[(size_t)(b0 + i) * groups + tid] = c;
                    c += n[i];
                }
        }
    } else if (tid == experts && with_shared) {
        c = tokens;
    }
    int first = c, first_tile = (c + slots - 1) / slots, all_pairs, all_tiles;
    block_scan2(first, first_tile, all_pairs, all_tiles);
    if (tid < groups) {
        start[tid] = first;
        for (int j = 0; j * slots < c; ++j) {
            int* tile = tiles + 3 * (first_tile + j);
            tile[0] = tid;
            tile[1] = first + j * slots;
            tile[2] = min(slots, c - j * slots);
        }
    }
    if (tid == 0) ntiles[0] = all_tiles;
}

// perm[start[e] + counts[b * groups + e] + rank[p]] = p for pair p of count block b and expert
// e = ids[p]; with a shared expert, perm[start[experts] + t] = pairs + t. A thread a pair (pairs
// + tokens of them with the shared expert); launch with 256 threads.
extern "C" __global__ void moe_group_scatter(const int* ids, const int* rank, const int* counts, const int* start,
                                             int pairs, int tokens, int experts, int with_shared, int* perm) {
    grid_dep();
    const int i = blockIdx.x * blockDim.x + threadIdx.x, groups = experts + (with_shared ? 1 : 0);
    if (i < pairs) {
        const int e = ids[i];
        perm[start[e] + counts[(size_t)(i / MOE_GROUP_PAIRS) * groups + e] + rank[i]] = i;
    } else if (with_shared && i < pairs + tokens) {
        perm[start[experts] + (i - pairs)] = i;
    }
}

// Expert e's matrix within a stack of `rows` x `cols` matrices (the shared expert's own when
// e == experts).
template <int BITS>
__device__ __forceinline__ QMat expert_mat(QMat stack, QMat shared, int e, int experts, int rows, int cols) {
    return e == experts ? shared : expert_slice<BITS>(stack, (size_t)e, rows, cols);
}

// The grouped expert products' tiles: tile i is row tile i % row_tiles of the expert's matrix (or
// matrices) against expert tile i / row_tiles (tiles[], moe_group_scan). A tile's slot s is pair
// perm[first + s] of the expert's run, while s < its pairs. An expert tile's row tiles are
// neighbours, so the blocks that read the same gathered activations run at about the same time
// and all but the first find them in L2 (at 4,096 tokens the down product's activations, 75 MB,
// were read from HBM once per row tile; docs/performance.md, run50); an expert's tiles lie
// row_tiles apart, close enough that its codes stay in L2 between them.
template <int BM>
struct ExpertTiles {
    static constexpr bool PARTS = false;  // every tile takes all its columns
    const int* perm;
    const int* tiles;
    int ntiles, row_tiles, experts;

    __device__ __forceinline__ ExpertTiles(const int* perm_, const int* tiles_, const int* ntiles_, int row_tiles_,
                                           int experts_)
        : perm(perm_), tiles(tiles_), ntiles(__ldg(ntiles_)), row_tiles(row_tiles_), experts(experts_) {}
    __device__ __forceinline__ int count() const { return ntiles * row_tiles; }
    __device__ __forceinline__ int expert_tile(int i) const { return i / row_tiles; }
    __device__ __forceinline__ int expert(int i) const { return __ldg(tiles + 3 * expert_tile(i)); }
    __device__ __forceinline__ int row_tile(int i) const { return i % row_tiles; }
    // Pair p of slot s (false: the slot is empty).
    __device__ __forceinline__ bool pair(int i, int s, int& p) const {
        const int* tile = tiles + 3 * expert_tile(i);
        const bool used = s < __ldg(tile + 2);
        p = used ? __ldg(perm + __ldg(tile + 1) + s) : 0;
        return used;
    }
};

// gu[p] = (gate_e . x[t] | up_e . x[t]) for every pair p, x split: gu rows hold 2 * stride floats
// (stride = max(inter, inter_s)), the gate's products first, the up's from column stride. The
// first ceil(stride / BM) row tiles take gate rows, the rest up rows (SwiGLU follows in
// swiglu_split_bf16).
template <int BITS, int BM>
struct GateUpTiles : ExpertTiles<BM> {
    QMat gate, up, sgate, sup;
    float* gu;
    int top_k, pairs, inter, inter_s, hidden;

    __device__ __forceinline__ int stride() const { return max(inter, inter_s); }
    __device__ __forceinline__ int per() const { return (stride() + BM - 1) / BM; }
    __device__ __forceinline__ bool is_up(int i) const { return this->row_tile(i) >= per(); }
    __device__ __forceinline__ int n0(int i) const { return (this->row_tile(i) - (is_up(i) ? per() : 0)) * BM; }
    __device__ __forceinline__ int rows(int e) const { return e == this->experts ? inter_s : inter; }
    __device__ __forceinline__ bool empty(int i) const { return n0(i) >= rows(this->expert(i)); }
    __device__ __forceinline__ TileJob job(int i) const {
        const int e = this->expert(i);
        const QMat w = is_up(i) ? expert_mat<BITS>(up, sup, e, this->experts, inter, hidden)
                                : expert_mat<BITS>(gate, sgate, e, this->experts, inter, hidden);
        return {w, n0(i), rows(e), hidden, 0, hidden};
    }
    __device__ __forceinline__ void slot(int i, int s, int& xrow, float*& yrow) const {
        int p;
        const bool used = this->pair(i, s, p);
        xrow = used ? (p < pairs ? p / top_k : p - pairs) : -1;
        yrow = gu + (size_t)p * 2 * stride() + (is_up(i) ? stride() : 0);
    }
};

// y[p][c] = down_e[c] . act[p], act split with rows of stride columns.
template <int BITS, int BM>
struct DownTiles : ExpertTiles<BM> {
    QMat down, sdown;
    float* y;
    int inter, inter_s, hidden;

    __device__ __forceinline__ bool empty(int) const { return false; }
    __device__ __forceinline__ TileJob job(int i) const {
        const int e = this->expert(i);
        TileJob j{expert_mat<BITS>(down, sdown, e, this->experts, hidden, inter), this->row_tile(i) * BM, hidden,
                  e == this->experts ? inter_s : inter};
        j.ld = j.cols;  // k0 = 0
        return j;
    }
    __device__ __forceinline__ void slot(int i, int s, int& xrow, float*& yrow) const {
        int p;
        xrow = this->pair(i, s, p) ? p : -1;
        yrow = y + (size_t)p * hidden;
    }
};

// q4_moe_gate_up_mma, q4_moe_down_mma, ... and the _wgmma and _wgmma_n16 pairs (sm_90a).
// GateUpTiles over 2 * ceil(stride / tile rows) row tiles and DownTiles over ceil(hidden / tile
// rows). Launch with the core's threads and a block per tile of the most tiles moe_group_scan can
// make (wgmma: or fewer, see wg_tiles); blocks past the tiles it made return.
#define MOE_MMA_KERNELS(BITS, NAME, WG, N)                                                                          \
    extern "C" __global__ void QMMA_BOUNDS(WG, BITS, N) q##BITS##_moe_gate_up_##NAME(                               \
        QMat gate, QMat up, QMat sgate, QMat sup, const int* perm, const int* tiles, const int* ntiles,             \
        const u16* xh, const u16* xl, const float* xsum, float* gu, int top_k, int pairs, int experts,              \
        int inter, int inter_s, int hidden) {                                                                       \
        grid_dep();                                                                                                 \
        constexpr int BM = tile_rows<WG>();                                                                         \
        const int row_tiles = 2 * ((max(inter, inter_s) + BM - 1) / BM);                                            \
        const GateUpTiles<BITS, BM> jobs{{perm, tiles, ntiles, row_tiles, experts},                                 \
                                         gate, up, sgate, sup, gu, top_k, pairs, inter, inter_s, hidden};           \
        product_tiles<BITS, WG, N>(jobs, {xh, xl, xsum, hidden});                                                   \
    }                                                                                                               \
    extern "C" __global__ void QMMA_BOUNDS(WG, BITS, N)                                                             \
        q##BITS##_moe_down_##NAME(QMat down, QMat sdown, const int* perm, const int* tiles, const int* ntiles,      \
                                  const u16* ah, const u16* al, const float* asum, float* y, int experts,           \
                                  int inter, int inter_s, int hidden) {                                             \
        grid_dep();                                                                                                 \
        constexpr int BM = tile_rows<WG>();                                                                         \
        const DownTiles<BITS, BM> jobs{{perm, tiles, ntiles, (hidden + BM - 1) / BM, experts},                      \
                                       down, sdown, y, inter, inter_s, hidden};                                     \
        product_tiles<BITS, WG, N>(jobs, {ah, al, asum, max(inter, inter_s)});                                      \
    }
PRODUCT_SHAPES(MOE_MMA_KERNELS)
