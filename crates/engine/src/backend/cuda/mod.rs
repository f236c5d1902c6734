//! The CUDA backend: device buffers on one stream, kernels in `kernels/*.cu` (one family per
//! file) embedded in the binary and compiled at start by NVRTC for the device's architecture
//! (nvrtc.rs caches the images on disk). Activations, the KV cache and the GDN state are f32, as
//! on the CPU, so every op can be compared with the CPU reference (tests/cuda_parity.rs).
//!
//! Every op only enqueues work on the stream; nothing waits for the GPU except `download`,
//! `argmax_rows`, `sample` and `chosen_token`, which read results back to the host (a chained
//! decode step's token, through mapped pinned memory once its event is done).

pub mod device;
pub mod nvrtc;
pub mod timeline;

use std::cell::Cell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    CudaEvent, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
    ValidAsZeroBits, sys,
};

use self::device::{CudaDevice, driver};
use super::{
    AttnShape, Backend, DeviceSample, DeviceSampling, GdnShape, KernelCost, ProfileMode,
    QueuedStep, StepForward, StepInput, products, route_tokens_separately,
};
use crate::backend::cpu::reference::GDN_L2_EPS;
use crate::checkpoint::QWeight;
use crate::error::{Error, Result};
use crate::model::state::{DecodeState, LayerState};
use crate::sampler::SamplingParams;

/// Device memory of one op's result: owned (back to the pool when the last clone is dropped), or
/// a slice of the decode-step arena, which lives as long as the recorded step that wrote it.
#[derive(Clone)]
pub struct DevBuf<T> {
    ptr: u64,
    len: usize,
    _owned: Option<Arc<CudaSlice<T>>>,
}

impl<T> DevBuf<T> {
    /// No memory (a null address): the buffer of a tensor whose values are elsewhere (`Lazy`).
    fn empty() -> DevBuf<T> {
        DevBuf {
            ptr: 0,
            len: 0,
            _owned: None,
        }
    }

    /// Whether another holder shares this pool buffer (a lazily kept tensor's input).
    fn shared(&self) -> bool {
        self._owned
            .as_ref()
            .is_some_and(|a| Arc::strong_count(a) > 1)
    }

    /// The first `len` elements of a pool buffer, owned.
    fn owned(slice: CudaSlice<T>, len: usize, stream: &CudaStream) -> DevBuf<T> {
        let ptr = slice.device_ptr(stream).0;
        DevBuf {
            ptr,
            len,
            _owned: Some(Arc::new(slice)),
        }
    }
}

/// A row-major `[rows, cols]` f32 activation in device memory.
pub struct CudaTensor {
    /// Empty (a null address) while `lazy` is set.
    pub buf: DevBuf<f32>,
    pub rows: usize,
    pub cols: usize,
    /// Set for one token's row normed lazily (`LazyNorm`, `LazyGate`), and for many tokens'
    /// rows kept as their split alone (`LazySplit`).
    lazy: Option<Lazy>,
    /// The split of `buf` that the tensor-core products read (kernels/qmma.cu, split_bf16),
    /// where the op that wrote the tensor wrote it too: the norms and the attention's output
    /// gate over many tokens, whose outputs are the products' inputs (kernels/pointwise.cu).
    /// The products take it instead of splitting `buf` again (`CudaBackend::split_of`). Dropped
    /// by every op that changes the tensor in place (`CudaBackend::plain_mut`).
    split: Option<Arc<Split>>,
}

/// A one-token row that the products reading it finish while staging it, or many tokens' rows
/// that only the products' split holds.
#[derive(Clone)]
enum Lazy {
    Norm(LazyNorm),
    Gate(LazyGate),
    Split(LazySplit),
    Conv(LazyConv),
}

/// Many tokens' GDN conv output, silu(causal conv of x), left to the chunked recurrence's prep,
/// which convolves the rows it loads (`PrepConv`, kernels/gdn.cu): the conv's own launch wrote
/// its output and the prep read it back, 2 x 134 MB at every GDN layer of a 4,096-token chunk.
/// The state's window moved on when the tensor was made (`conv1d_window`), and the window before
/// it is kept here, so that a reader that needs the values (`CudaBackend::plain`) gets
/// conv1d_silu's from what the tensor holds, however often it asks.
#[derive(Clone)]
struct LazyConv {
    /// The conv's input, the in-projection's rows.
    x: DevBuf<f32>,
    /// Its taps [kernel][cols] and the window before x's first row [kernel - 1][cols].
    taps: u64,
    window: DevBuf<f32>,
    kernel: usize,
}

/// Many tokens' rows (a norm's or the attention's output gate's) whose writer stored only the
/// split that the tensor-core products read (`CudaTensor::split`), not the f32 values: in the
/// model every reader of these outputs is a product, and the f32 rows were a quarter to a fifth
/// of those kernels' traffic (prefill +1.2% at 4,096 and +1.1% at 16,384 tokens,
/// docs/performance.md, run56). A reader that needs the values (`CudaBackend::plain`) gets
/// them remade, bit for bit, by the same arithmetic from what they were made of, which the
/// tensor holds. Those inputs must not change in place meanwhile: they are the op's own
/// temporaries, the residual that the op wrote to a new buffer, or a caller's tensor that the
/// ops changing tensors in place copy first while it is shared (`CudaBackend::unshare`).
#[derive(Clone)]
enum LazySplit {
    /// rmsnorm(x) * gains by whole rows, as `add_rms_norm_row8` norms them (`rms_norm_row8`).
    Residual {
        x: DevBuf<f32>,
        gains: u64,
        eps: f32,
    },
    /// rmsnorm(x) * gains (* silu(z)) by rows of `cols` (heads), by `rms_norm_rows8`.
    Norm {
        x: DevBuf<f32>,
        gains: u64,
        z: Option<DevBuf<f32>>,
        cols: usize,
        eps: f32,
    },
    /// x * sigmoid(gate), by `sigmoid_mul`.
    Gate { x: DevBuf<f32>, gate: DevBuf<f32> },
}

/// One token's residual row x whose next norm, rmsnorm(x) * gains, is left to the products that
/// read it: the kernel that wrote x (the residual add after a mixer, `qmatmul_add_rms_norm`, or
/// after the MoE block, `moe_block_add_rms_norm`) also wrote x * gains (`input`) and the sum of
/// squares of x as one partial sum per block; the matrix-vector kernels take `input` with a
/// `RowNorm` (kernels/quant.cu) and scale their sums by the norm. This saves a norm launch after
/// every residual add of a decode step. Every other op norms x first (`CudaBackend::plain`). The
/// tensor's own `buf` is empty, so that an op reading it without either would fault rather than
/// read the row unnormed.
#[derive(Clone)]
struct LazyNorm {
    x: DevBuf<f32>,
    input: DevBuf<f32>,
    partials: DevBuf<f32>,
    gains: u64,
    eps: f32,
}

/// One token's GDN output whose gated norm, rmsnorm(y_h) * w * silu(z_h) per value head h, is
/// left to the output projection that reads it: the recurrence wrote g = y * w * silu(z) and one
/// partial sum of squares of y per block of rows (`GdnGate`, kernels/gdn.cu), and the
/// projection's staging scales each head of g by its norm (`HeadNorm`, kernels/quant.cu). This
/// saves the norm's launch in every GDN layer of a decode step. Every other op norms it first
/// (`CudaBackend::plain`); the tensor's own `buf` is empty, as for `LazyNorm`.
#[derive(Clone)]
struct LazyGate {
    g: DevBuf<f32>,
    partials: DevBuf<f32>,
    /// Partial sums per head, and the head size.
    parts: usize,
    dim: usize,
    eps: f32,
}

impl LazyGate {
    fn arg(&self) -> HeadNormArg {
        HeadNormArg {
            partials: self.partials.ptr,
            parts: self.parts as i32,
            dim: self.dim as i32,
            eps: self.eps,
            _pad: 0,
        }
    }
}

/// What a residual add with its norm left lazy writes besides the residual: x * gains and one
/// sum of squares per block (`LazyNorm`).
struct LazyParts {
    input: CudaTensor,
    partials: DevBuf<f32>,
}

impl CudaTensor {
    fn new(buf: DevBuf<f32>, rows: usize, cols: usize) -> CudaTensor {
        CudaTensor {
            buf,
            rows,
            cols,
            lazy: None,
            split: None,
        }
    }

    /// Whether the op that wrote this tensor wrote its split for the tensor-core products as
    /// well (`CudaTensor::split`); the parity tests check those splits.
    pub fn has_split(&self) -> bool {
        self.split.is_some()
    }

    /// Whether the op that wrote this tensor kept only its split, its values to be remade
    /// where read (`LazySplit`); the parity tests check that path is taken.
    pub fn kept_as_split(&self) -> bool {
        matches!(self.lazy, Some(Lazy::Split(_)))
    }

    /// Whether this is a GDN conv's output left to the chunked recurrence's prep (`LazyConv`);
    /// the parity tests check that path is taken.
    pub fn conv_left_to_its_reader(&self) -> bool {
        matches!(self.lazy, Some(Lazy::Conv(_)))
    }

    /// One token's row of `cols` that its readers finish (`Lazy`): its own buffer is empty (a
    /// null address), so that an op reading it as plain values would fault.
    fn lazy(cols: usize, lazy: Lazy) -> CudaTensor {
        CudaTensor {
            buf: DevBuf::empty(),
            rows: 1,
            cols,
            lazy: Some(lazy),
            split: None,
        }
    }

    /// `rows x cols` kept as `split` alone (`LazySplit`); its buffer empty, as `lazy`'s.
    fn split_only(rows: usize, cols: usize, split: Arc<Split>, remake: LazySplit) -> CudaTensor {
        CudaTensor {
            buf: DevBuf::empty(),
            rows,
            cols,
            lazy: Some(Lazy::Split(remake)),
            split: Some(split),
        }
    }
}

/// A tensor as plain values: borrowed, or the norm of a lazily normed row.
enum Plain<'a> {
    Borrowed(&'a CudaTensor),
    Normed(CudaTensor),
}

impl std::ops::Deref for Plain<'_> {
    type Target = CudaTensor;
    fn deref(&self) -> &CudaTensor {
        match self {
            Plain::Borrowed(t) => t,
            Plain::Normed(t) => t,
        }
    }
}

/// A `RowNorm` kernel parameter (kernels/quant.cu): a lazily normed row's partial sums of
/// squares, their count, the row's length and epsilon; all zero for a plain input.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RowNormArg {
    partials: u64,
    count: i32,
    n: i32,
    eps: f32,
    _pad: u32,
}

// SAFETY: repr(C), a u64 then four 4-byte fields, no padding.
unsafe impl bytemuck::NoUninit for RowNormArg {}

/// A `SplitOut` kernel parameter (kernels/common.cuh): where a kernel writes its output's split
/// as well; all zero for none.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct SplitArg {
    hi: u64,
    lo: u64,
    sum: u64,
}

// SAFETY: repr(C), three u64, no padding.
unsafe impl bytemuck::NoUninit for SplitArg {}

impl SplitArg {
    fn of(split: Option<&Split>) -> SplitArg {
        split.map_or_else(SplitArg::default, |s| SplitArg {
            hi: s.hi.ptr,
            lo: s.lo.ptr,
            sum: s.sum.ptr,
        })
    }
}

/// A `HeadNorm` kernel parameter (kernels/quant.cu): a `LazyGate`'s partial sums, their count per
/// head, the head size and epsilon; all zero for a plain input.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct HeadNormArg {
    partials: u64,
    parts: i32,
    dim: i32,
    eps: f32,
    _pad: u32,
}

// SAFETY: repr(C), a u64 then four 4-byte fields, no padding.
unsafe impl bytemuck::NoUninit for HeadNormArg {}

/// A `GdnGate` kernel parameter (kernels/gdn.cu): z, the norm's gains, and where g and the
/// partial sums go; all zero for none.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct GdnGateArg {
    z: u64,
    gains: u64,
    g: u64,
    partials: u64,
}

// SAFETY: repr(C), four u64, no padding.
unsafe impl bytemuck::NoUninit for GdnGateArg {}

/// A `ConvTail` kernel parameter (kernels/quant.cu): a GDN layer's conv taps and window and its
/// channel count, taken by one token's in-projections; all zero for none.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ConvTailArg {
    taps: u64,
    window: u64,
    channels: i32,
    _pad: u32,
}

// SAFETY: repr(C), two u64 then two 4-byte fields, no padding.
unsafe impl bytemuck::NoUninit for ConvTailArg {}

/// A `PrepConv` kernel parameter (kernels/gdn.cu): the conv that `gdn_chunk_prep` applies to
/// the rows it loads (`LazyConv`); all zero for rows already convolved.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PrepConvArg {
    taps: u64,
    window: u64,
}

// SAFETY: repr(C), two u64, no padding.
unsafe impl bytemuck::NoUninit for PrepConvArg {}

/// An `AttnPrep` kernel parameter (kernels/attention.cu): one token's attention-layer
/// projections and norms, prepped by the decode attention itself; all zero for none (attn_prep
/// did it).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct AttnPrepArg {
    qg: u64,
    k: u64,
    v: u64,
    q_norm: u64,
    k_norm: u64,
    theta: f64,
    rotary: i32,
    eps: f32,
}

// SAFETY: repr(C), five u64 and an f64 then two 4-byte fields, no padding.
unsafe impl bytemuck::NoUninit for AttnPrepArg {}

/// The conv kernel size one token's in-projections take in their writers (`CONV_K_FUSED`,
/// kernels/quant.cu); other sizes launch conv1d_silu.
const CONV_K_FUSED: usize = 4;

/// A quantized matrix (or expert stack) in device memory, in the checkpoint's layout.
pub struct CudaQMatrix {
    pub name: String,
    codes: CudaSlice<u32>,
    /// bf16 bit patterns.
    scales: CudaSlice<u16>,
    biases: CudaSlice<u16>,
    pub rows: usize,
    pub cols: usize,
    pub bits: u32,
}

pub struct CudaGdnState {
    /// The last `K-1` conv inputs `[K-1, C]`, oldest first.
    pub window: CudaSlice<f32>,
    /// Recurrent state `[Hv, Dv, Dk]`.
    pub state: CudaSlice<f32>,
}

/// K and V rows `[capacity, KVH*D]` as f16 bits (`f16_bits`, kernels/common.cuh: the CPU
/// reference's `kv_value`); grown (reallocated) on append up to `max_seq`, so short sequences and
/// cache snapshots hold only what they use.
pub struct CudaKvCache {
    pub k: CudaSlice<u16>,
    pub v: CudaSlice<u16>,
    pub row: usize,
    pub capacity: usize,
    pub len: usize,
    pub max_seq: usize,
}

/// The shape of one mixture-of-experts call, worked out and checked once by `moe`.
struct MoeDims {
    tokens: usize,
    hidden: usize,
    experts: usize,
    inter: usize,
    /// The shared expert's intermediate size (0 without one).
    inter_s: usize,
    /// Routed (token, expert) pairs; `all` adds one per token for the shared expert.
    pairs: usize,
    all: usize,
    /// Floats per activation row: the larger intermediate size.
    stride: usize,
    with_shared: bool,
    /// Index into the `[q4, q8]` kernel pairs.
    bits: usize,
}

/// An activation split for the tensor-core products: bf16 hi and lo parts `[rows, cols]` (each
/// 8-column block in the order 0 4 1 5 2 6 3 7) and f32 sums per 64-column group.
#[derive(Clone)]
struct Split {
    hi: DevBuf<u16>,
    lo: DevBuf<u16>,
    sum: DevBuf<f32>,
}

/// Each token's chosen experts and their weights. Read them through `CudaBackend::routing`:
/// one token's routing may still be pending (`deferred`).
pub struct CudaRouting {
    ids: DevBuf<i32>,
    weights: DevBuf<f32>,
    pub tokens: usize,
    pub top_k: usize,
    pub num_experts: usize,
    /// One token's router logits, routed by the first kernel that reads the routing: the expert
    /// gate/up kernel of decode routes them itself (`moe_gate_up_stream`, kernels/quant.cu) and
    /// writes `ids` and `weights`; any other reader routes them first (`CudaBackend::settle`).
    /// Until then `ids` and `weights` are unwritten.
    deferred: Cell<Option<DeferredRoute>>,
}

struct DeferredRoute {
    logits: CudaTensor,
    renormalize: bool,
}

/// The compiled kernels, looked up once at start.
struct Kernels {
    /// `[bits][variant]`, the variants of `GEMV_VARIANTS` (kernels/quant.cu, `GEMV_SHAPES`).
    gemv: [[CudaFunction; 3]; 2],
    gemv_batch: [[CudaFunction; 3]; 2],
    /// `[bits][variant]`: one token's product added to the residual, its norm left lazy
    /// (`gemv_add_sumsq`).
    gemv_add_sumsq: [[CudaFunction; 3]; 2],
    /// The same over a `LazyGate` row (its heads normed while staged).
    gemv_add_sumsq_gated: [[CudaFunction; 3]; 2],
    head_norm_apply: CudaFunction,
    /// `[bits]`: the matrix-vector product for matrices of many rows (a grid of two blocks per
    /// SM walking the rows).
    gemv_stream: [CudaFunction; 2],
    gemv_batch_stream: [CudaFunction; 2],
    /// One token's 4-bit products of many rows on the integer tensor cores; `None` with
    /// `LILY_CUDA_QX=0` (`gemv_batch_stream` and `gemv_stream` then, to compare).
    gemv_qx: Option<GemvQx>,
    /// `[experts > 256][bits]`: the kernel's routing takes 8 or 16 logits a lane.
    moe_gate_up_stream: [[CudaFunction; 2]; 2],
    /// Tensor-core products for prefill (kernels/qmma.cu): the warpgroup (`wgmma`) kernels on
    /// sm_90a, the `mma` ones elsewhere, with 64 token slots a tile; and on sm_90a the 16-slot
    /// tiles for products whose 64-slot grid would leave SMs idle (`ProductShapes::pick`).
    products: ProductShapes,
    embed: [CudaFunction; 2],
    /// `[bits][variant]` as `gemv`.
    moe_gate_up: [[CudaFunction; 3]; 2],
    moe_down: [[CudaFunction; 3]; 2],
    /// `[bits]`: one token's expert down products mixed into the residual, its norm left lazy.
    moe_down_mix: [CudaFunction; 2],
    moe_group_count: CudaFunction,
    moe_group_scan: CudaFunction,
    moe_group_scatter: CudaFunction,
    split_bf16: CudaFunction,
    swiglu_split_bf16: CudaFunction,
    moe_combine: CudaFunction,
    moe_combine_add_rms_norm: CudaFunction,
    moe_route: CudaFunction,
    rms_norm: CudaFunction,
    rms_norm_warp: CudaFunction,
    rms_norm_rows8: CudaFunction,
    rms_norm_row8: CudaFunction,
    add_rms_norm: CudaFunction,
    add_assign: CudaFunction,
    swiglu: CudaFunction,
    sigmoid_mul: CudaFunction,
    sigmoid_mul_split: CudaFunction,
    add_sigmoid_gated: CudaFunction,
    split_q_gate: CudaFunction,
    argmax_rows: CudaFunction,
    /// The greedy choice that ends a chained decode step.
    step_argmax: CudaFunction,
    /// Token sampling on the device (kernels/sample.cu); `None` with `LILY_CUDA_SAMPLE=0`, when
    /// the host samples the row read back (to compare the two).
    sample: Option<SampleKernels>,
    conv1d_silu: CudaFunction,
    conv1d_window: CudaFunction,
    /// Key dims 64, 128, 256.
    gdn_recurrence: [CudaFunction; 3],
    /// The chunked recurrence for prefill (key and value dims 128): `gdn_chunk_prep` and
    /// `gdn_chunk_state`. `None` where the device cannot give a block their shared memory, or
    /// with `LILY_CUDA_GDN_CHUNKED=0` (the token loop then serves every length).
    gdn_chunked: Option<GdnChunked>,
    rope: CudaFunction,
    kv_write: CudaFunction,
    attn_prep: CudaFunction,
    /// attn_prep with a warp a row, head dims 64, 128, 256 (rotary dims a multiple of 64).
    attn_prep_rows: [CudaFunction; 3],
    /// The rotation angles a token's rows share in `attn_prep_rows`.
    rope_angles: CudaFunction,
    /// Split-K decode attention for query groups of up to 8 and up to 16 heads, head dims 64,
    /// 128, 256, 512; `None` where the device cannot give a block its shared memory.
    attention_partial: [[Option<CudaFunction>; 4]; 2],
    attention_combine: CudaFunction,
    /// Flash attention for prefill, head dims 64, 128, 256; `None` where the device cannot
    /// give a block the shared memory it needs (the split-K kernels serve instead).
    attention_prefill: [Option<CudaFunction>; 3],
    /// Its form on Hopper's warpgroup products (sm_90a; `LILY_CUDA_FA=mma` keeps the kernels
    /// above, for comparison); `None` elsewhere.
    attention_prefill_wg: [Option<CudaFunction>; 3],
}

/// The two kernels of the chunked GDN recurrence (kernels/gdn.cu).
struct GdnChunked {
    /// `gdn_chunk_prep` a value head a block, then in pairs of one key head (Hv / Hk even): the
    /// key head's norms and products done once for both.
    prep: [CudaFunction; 2],
    state: CudaFunction,
}

impl Kernels {
    fn load(dev: &CudaDevice) -> Result<Kernels> {
        // Hopper's warpgroup products where the kernels were built for it (`LILY_CUDA_WGMMA=0`
        // keeps the sm_80 ones, for comparison).
        let wgmma = dev.arch == "sm_90a" && !switched_off("LILY_CUDA_WGMMA");
        // Warpgroup blocks that take tiles in turn (`LILY_CUDA_PERSISTENT=0`: a block a tile,
        // for comparison).
        let persistent = wgmma && !switched_off("LILY_CUDA_PERSISTENT");
        let max_blocks = env_count("LILY_CUDA_PRODUCT_BLOCKS").filter(|&n| n > 0);
        tracing::info!(
            core = if wgmma { "wgmma" } else { "mma" },
            "prefill products on the tensor cores"
        );
        // Rows and threads per block: WG_BM, WG_THREADS_OF and TC_BM, TC_THREADS in qmma.cu.
        let shape = |core: &str, slots: u32| -> Result<ProductShape> {
            let (smem, rows, threads) = if wgmma {
                let smem = [
                    wg_smem_bytes(4, slots as usize),
                    wg_smem_bytes(8, slots as usize),
                ];
                (smem, 256, [4, 8].map(|bits| wg_threads(bits, slots)))
            } else {
                ([TC_SMEM_BYTES; 2], 128, [256; 2])
            };
            // The products take more shared memory than a launch gets without opting in.
            let kernels = |name: &str| -> Result<[CudaFunction; 2]> {
                let names = [4, 8].map(|bits| format!("q{bits}_{name}{core}"));
                let pair = [
                    dev.function("qmma", &names[0])?,
                    dev.function("qmma", &names[1])?,
                ];
                for b in 0..2 {
                    allow_dynamic_smem(&pair[b], smem[b])?;
                    check_block_threads(&pair[b], &names[b], threads[b])?;
                }
                Ok(pair)
            };
            let dense = kernels("")?;
            let per_sm = [0, 1].map(|b| {
                dense[b]
                    .occupancy_max_active_blocks_per_multiprocessor(threads[b], smem[b], None)
                    .map_or(1, |n| n.max(1) as usize)
            });
            Ok(ProductShape {
                dense,
                dense_parts: kernels("parts_")?,
                moe_gate_up: kernels("moe_gate_up_")?,
                moe_down: kernels("moe_down_")?,
                smem,
                per_sm,
                rows,
                slots,
                threads,
                persistent,
                max_blocks,
            })
        };
        // `LILY_CUDA_TILE_SLOTS=64` or `=16` fixes the slots of the wgmma tiles (to test or
        // compare either), else each launch picks.
        let fixed_slots = std::env::var("LILY_CUDA_TILE_SLOTS").ok();
        let products = if wgmma {
            let (full, n16) = (shape("wgmma", 64)?, shape("wgmma_n16", 16)?);
            match fixed_slots.as_deref() {
                Some("64") => ProductShapes::only(full),
                Some("16") => ProductShapes::only(n16),
                _ => ProductShapes {
                    main: full,
                    n16: Some(n16),
                },
            }
        } else {
            ProductShapes::only(shape("mma", 64)?)
        };
        let f = |family: &'static str, name: &str| dev.function(family, name);
        let pair_in = |family: &'static str, name: &str| -> Result<[CudaFunction; 2]> {
            Ok([
                f(family, &format!("q4_{name}"))?,
                f(family, &format!("q8_{name}"))?,
            ])
        };
        let pair = |name: &str| pair_in("quant", name);
        let mut attention_partial: [[Option<CudaFunction>; 4]; 2] = Default::default();
        for (ng_index, per_dim) in attention_partial.iter_mut().enumerate() {
            for (variant, slot) in per_dim.iter_mut().enumerate() {
                let (nd, ng) = (2 << variant, ng_index + 1);
                let func = f("attention", &format!("attention_partial_d{nd}_g{ng}"))?;
                if allow_dynamic_smem(&func, attn_decode_smem_bytes(64 << variant, ng)).is_ok() {
                    *slot = Some(func);
                }
            }
        }
        let variants = |name: &str| -> Result<[[CudaFunction; 3]; 2]> {
            let [a4, a8] = pair(name)?;
            let [b4, b8] = pair(&format!("{name}_r1"))?;
            let [c4, c8] = pair(&format!("{name}_h16"))?;
            Ok([[a4, b4, c4], [a8, b8, c8]])
        };
        Ok(Kernels {
            gemv: variants("gemv")?,
            gemv_batch: variants("gemv_batch")?,
            gemv_add_sumsq: variants("gemv_add_sumsq")?,
            gemv_add_sumsq_gated: variants("gemv_add_sumsq_gated")?,
            head_norm_apply: f("quant", "head_norm_apply")?,
            gemv_stream: pair("gemv_stream")?,
            gemv_batch_stream: pair("gemv_batch_stream")?,
            gemv_qx: if switched_off("LILY_CUDA_QX") {
                None
            } else {
                Some(GemvQx {
                    batch: f("quant", "q4_gemv_batch_qx")?,
                    stream: f("quant", "q4_gemv_stream_qx")?,
                })
            },
            moe_gate_up_stream: [
                pair("moe_gate_up_stream")?,
                pair("moe_gate_up_stream_e512")?,
            ],
            products,
            embed: pair("embed")?,
            moe_gate_up: variants("moe_gate_up")?,
            moe_down: variants("moe_down")?,
            moe_down_mix: pair("moe_down_mix")?,
            moe_group_count: f("qmma", "moe_group_count")?,
            moe_group_scan: f("qmma", "moe_group_scan")?,
            moe_group_scatter: f("qmma", "moe_group_scatter")?,
            split_bf16: f("qmma", "split_bf16")?,
            swiglu_split_bf16: f("qmma", "swiglu_split_bf16")?,
            moe_combine: f("quant", "moe_combine")?,
            moe_combine_add_rms_norm: f("pointwise", "moe_combine_add_rms_norm")?,
            moe_route: f("quant", "moe_route")?,
            rms_norm: f("pointwise", "rms_norm")?,
            rms_norm_warp: f("pointwise", "rms_norm_warp")?,
            rms_norm_rows8: f("pointwise", "rms_norm_rows8")?,
            rms_norm_row8: f("pointwise", "rms_norm_row8")?,
            add_rms_norm: f("pointwise", "add_rms_norm")?,
            add_assign: f("pointwise", "add_assign")?,
            swiglu: f("pointwise", "swiglu")?,
            sigmoid_mul: f("pointwise", "sigmoid_mul")?,
            sigmoid_mul_split: f("pointwise", "sigmoid_mul_split")?,
            add_sigmoid_gated: f("pointwise", "add_sigmoid_gated")?,
            split_q_gate: f("pointwise", "split_q_gate")?,
            argmax_rows: f("pointwise", "argmax_rows")?,
            step_argmax: f("pointwise", "step_argmax")?,
            sample: if switched_off("LILY_CUDA_SAMPLE") {
                None
            } else {
                Some(SampleKernels {
                    token: f("sample", "sample_token")?,
                    row_max: f("sample", "sample_row_max")?,
                    row_weights: f("sample", "sample_row_weights")?,
                    row_top: f("sample", "sample_row_top")?,
                    top_merge: f("sample", "sample_top_merge")?,
                    select_pass: f("sample", "sample_select_pass")?,
                    select_gather: f("sample", "sample_select_gather")?,
                    select_merge: f("sample", "sample_select_merge")?,
                    nucleus_draw: f("sample", "sample_nucleus_draw")?,
                    penalise_chained: f("sample", "sample_penalise_chained")?,
                })
            },
            conv1d_silu: f("gdn", "conv1d_silu")?,
            conv1d_window: f("gdn", "conv1d_window")?,
            gdn_recurrence: [
                f("gdn", "gdn_recurrence_k64")?,
                f("gdn", "gdn_recurrence_k128")?,
                f("gdn", "gdn_recurrence_k256")?,
            ],
            gdn_chunked: if switched_off("LILY_CUDA_GDN_CHUNKED") {
                None
            } else {
                let prep = [
                    f("gdn", "gdn_chunk_prep_d128")?,
                    f("gdn", "gdn_chunk_prep_d128_pairs")?,
                ];
                let state = f("gdn", "gdn_chunk_state_d128")?;
                (allow_dynamic_smem(&prep[0], gdn_prep_smem_bytes(128, 1)).is_ok()
                    && allow_dynamic_smem(&prep[1], gdn_prep_smem_bytes(128, 2)).is_ok()
                    && allow_dynamic_smem(&state, gdn_state_smem_bytes(128)).is_ok())
                .then_some(GdnChunked { prep, state })
            },
            rope: f("attention", "rope")?,
            kv_write: f("attention", "kv_write")?,
            attn_prep: f("attention", "attn_prep")?,
            rope_angles: f("attention", "rope_angles")?,
            attn_prep_rows: [
                f("attention", "attn_prep_rows_d2")?,
                f("attention", "attn_prep_rows_d4")?,
                f("attention", "attn_prep_rows_d8")?,
            ],
            attention_partial,
            attention_combine: f("attention", "attention_combine")?,
            attention_prefill: [64, 128, 256].map(|d| {
                let func = f("attention", &format!("attention_prefill_d{d}")).ok()?;
                allow_dynamic_smem(&func, fa_smem_bytes(d)).ok()?;
                Some(func)
            }),
            attention_prefill_wg: [64, 128, 256].map(|d| {
                if dev.arch != "sm_90a" || std::env::var("LILY_CUDA_FA").is_ok_and(|v| v == "mma") {
                    return None;
                }
                let func = f("attention", &format!("attention_prefill_wg_d{d}")).ok()?;
                allow_dynamic_smem(&func, fa_wg_smem_bytes(d)).ok()?;
                Some(func)
            }),
        })
    }
}

/// Checks that the host launches a product kernel with the threads its `__launch_bounds__` were
/// built for (`wg_threads` mirrors qmma.cu's `WG_THREADS_OF`): with more a launch fails, but with
/// fewer the warpgroups' stage barriers would wait forever for the missing threads.
fn check_block_threads(func: &CudaFunction, name: &str, launched: u32) -> Result<()> {
    let built = func
        .get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)
        .map_err(driver("reading a kernel's threads a block"))?;
    if built != launched as i32 {
        return Err(Error::Backend(format!(
            "product kernel {name} is built for {built} threads a block, \
             but would be launched with {launched}"
        )));
    }
    Ok(())
}

/// Lets `func` take `bytes` of dynamic shared memory: above 48 KiB a kernel must opt in, which
/// fails where the device gives a block less.
fn allow_dynamic_smem(func: &CudaFunction, bytes: usize) -> Result<()> {
    if bytes <= SMEM_LIMIT {
        return Ok(());
    }
    func.set_attribute(
        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        bytes as i32,
    )
    .map_err(driver("opting in to shared memory"))
}

/// Dynamic shared memory of the flash-attention prefill kernel for head dim `d`
/// (`fa_smem_bytes`, kernels/attention.cu: Q's, K's and V's f16 tiles; the kernel traps if a
/// launch gives it less).
fn fa_smem_bytes(d: usize) -> usize {
    2 * (FA_QUERIES * (d + 8) + 2 * FA_KEYS * (d + 8))
}

/// Dynamic shared memory of its warpgroup form (`fa_wg_smem_bytes`: the same tiles unpadded in
/// the 128-byte swizzle, and 1,024 bytes to align them).
fn fa_wg_smem_bytes(d: usize) -> usize {
    2 * (FA_QUERIES * d + 2 * FA_KEYS * d) + 1024
}

/// Tokens per chunk of the chunked GDN recurrence (`GDN_C`, kernels/gdn.cu) and state rows per
/// block of its second kernel (`GDN_STATE_ROWS`).
const GDN_CHUNK: usize = 64;
const GDN_STATE_ROWS: usize = 32;
/// Inputs of at least this many tokens take the chunked recurrence; decode and shorter inputs
/// take the token loop. Measured on the H200 (session 13, call 7), prefill of the whole model:
/// the loop is 1-3% faster at 32, 48 and 64 tokens, the chunked form 1% faster at 128.
const GDN_CHUNKED_MIN_TOKENS: usize = 128;
/// The conv kernel size that the chunked recurrence's prep applies to its loads
/// (`GDN_PREP_CONV_K`, kernels/gdn.cu; `LazyConv`).
const GDN_PREP_CONV_K: usize = 4;
/// Tokens from which the GDN conv is left to the chunked recurrence's prep (`LazyConv`; below,
/// conv1d_silu runs on its own). On an H100 (run57) it took prefill +1.55% at 4,096 tokens, +1.5%
/// at 16,384 and +0.6-0.8% at 512-768, and cost ~1.8% at 256, where the prep is one wave of a
/// block a head and the conv's arithmetic and conv1d_window's launch sit on its path.
/// `LILY_CUDA_CONV_IN_PREP_MIN_TOKENS` overrides it, for A/B (down to `GDN_CHUNKED_MIN_TOKENS`;
/// a number above any prompt turns it off).
pub const CONV_IN_PREP_MIN_TOKENS: usize = 512;

/// 64-column groups each part of a many-token router product takes at the fewest, where it is
/// split along K to fill the GPU (`route_tokens_in_parts`). `LILY_CUDA_ROUTER_PART_MIN_GROUPS`
/// overrides it, for A/B; 0 computes the router and the shared expert's gate in one unsplit
/// product, as before.
pub const ROUTER_PART_MIN_GROUPS: usize = 4;

/// The same for the output projections into the residual (`qmatmul_add_rms_norm`), split where
/// their tiles leave SMs idle (at 256 tokens, 128 tiles of a kind the GPU holds 264 of): prefill
/// +0.6-0.9% at 256 tokens, unchanged from 1,024 (docs/performance.md, run59).
/// `LILY_CUDA_OUT_PART_MIN_GROUPS` overrides it; 0 leaves them whole.
pub const OUT_PART_MIN_GROUPS: usize = 8;

/// Dynamic shared memory of `gdn_chunk_prep` (`heads` value heads a block) and `gdn_chunk_state`
/// for key/value dim `d`
/// (`gdn_prep_smem_bytes`, `gdn_state_smem_bytes`, kernels/gdn.cu; the kernels trap if a launch
/// gives them less).
fn gdn_prep_smem_bytes(d: usize, heads: usize) -> usize {
    4 * ((2 * heads) * GDN_CHUNK * (d + 4)
        + heads * GDN_CHUNK * (GDN_CHUNK + 4)
        + 3 * heads * GDN_CHUNK)
}
fn gdn_state_smem_bytes(d: usize) -> usize {
    let (c, r) = (GDN_CHUNK, GDN_STATE_ROWS);
    4 * (2 * c * (d + 4)
        + c * (r + 4)
        + c * (c + 4)
        + c * (d + 8)
        + 2 * r * (d + 4)
        + 2 * r * (c + 4)
        + 4)
}

/// Dynamic shared memory of the decode attention kernel for head dim `d` and `ng` tiles of 8
/// query heads (`attn_decode_smem_bytes`, kernels/attention.cu): the warps' f32 score parts, the
/// summed scores (pitch 8 ng + 4), and the stages of K and V rows (f16, pitch d + 8).
fn attn_decode_smem_bytes(d: usize, ng: usize) -> usize {
    4 * (attn_decode_warps(d) * ATTN_TILE * 8 * ng + ATTN_TILE * (8 * ng + 4))
        + 2 * ATTN_STAGES * 2 * ATTN_TILE * (d + 8)
}

pub struct CudaBackend {
    dev: CudaDevice,
    k: Kernels,
    /// Streaming multiprocessors: products with fewer blocks than two per SM use one row per
    /// warp.
    sms: usize,
    /// `[token, position]` of the decode step being recorded or replayed: recorded kernels read
    /// them from here, so one recording serves every step.
    params: CudaSlice<i32>,
    /// One token's expert ids handed from the gate/up kernel to the down kernel: the flag and
    /// the down blocks that read it (zero between launches; kernels/quant.cu, `flagged_routing`).
    ids_ready: CudaSlice<u32>,
    /// What chained decode steps choose with and hand to the host (`queue_decode_step`).
    chain: ChainBuffers,
    /// `LILY_CUDA_CHAIN=0` steps one token at a time, reading each before the next step (to
    /// compare the two).
    chains: bool,
    /// `LILY_CUDA_CONV_IN_PRODUCTS=0` launches one token's GDN conv on its own after the
    /// in-projections instead of in their writers (to compare the two).
    conv_in_products: bool,
    /// `LILY_CUDA_PREP_IN_ATTENTION=0` launches one token's attn_prep on its own before the
    /// decode attention instead of in its blocks (to compare the two).
    prep_in_attention: bool,
    step: Mutex<StepState>,
    /// Set while a decode step is being recorded: temporaries come from the arena, and the
    /// position-dependent kernels read `params`.
    capturing: AtomicBool,
    /// While recording: the key-length bound that sizes the attention split grid.
    bucket: AtomicUsize,
    graphs: bool,
    /// Programmatic dependent launch (compute capability 9.0+; `LILY_CUDA_PDL=0` turns it off).
    pdl: bool,
    /// Keys per decode attention split, at least (`ATTN_MIN_CHUNK`).
    attn_min_chunk: usize,
    /// Tokens from which outputs are kept as their split alone (`SPLIT_ONLY_MIN_TOKENS`).
    split_only_min_tokens: usize,
    /// Tokens from which the GDN conv is left to the chunked recurrence's prep
    /// (`CONV_IN_PREP_MIN_TOKENS`).
    conv_in_prep_min_tokens: usize,
    /// Groups a part of the router's product takes at the fewest (`ROUTER_PART_MIN_GROUPS`;
    /// 0: the router and the shared expert's gate in one product, as before).
    router_part_min_groups: usize,
    /// Groups a part of a many-token output projection takes at the fewest
    /// (`OUT_PART_MIN_GROUPS`; 0: unsplit).
    out_part_min_groups: usize,
    /// While profiling: every launch, for replay in isolation.
    trace: Mutex<Option<Vec<Traced>>>,
    /// The kernel family left out of recorded decode steps (`leave_out_of_decode`).
    left_out: OnceLock<String>,
    tracing: AtomicBool,
    /// While profiling in place: events around every launch (the run's temporaries then come
    /// from the pool as usual, since nothing is replayed).
    in_place: AtomicBool,
}

/// kernels/sample.cu: `sample_token` (one block, any choice), the whole-row path on a grid
/// (`row_max`, `row_weights`), and a small top-k on a grid (`row_top`, `top_merge`).
struct SampleKernels {
    token: CudaFunction,
    row_max: CudaFunction,
    row_weights: CudaFunction,
    row_top: CudaFunction,
    top_merge: CudaFunction,
    select_pass: CudaFunction,
    select_gather: CudaFunction,
    select_merge: CudaFunction,
    nucleus_draw: CudaFunction,
    penalise_chained: CudaFunction,
}

/// Where a sampler launch takes its penalties and draw and leaves its choice: the draw `u`, or
/// the device's `u_at` where that is not 0; `params` and `host_out` not 0 for a chained step.
struct SampleIo {
    penalties: (u64, u64, i32),
    u: f64,
    u_at: u64,
    out: u64,
    params: u64,
    host_out: u64,
}

/// A chained decode step's device-side hand-offs: the greedy choice's packed key and ticket
/// (zero between steps: `step_argmax`'s last block resets them), the sampler's draw (uploaded
/// before each replay) and scratch, and the host's view of each step's choice.
struct ChainBuffers {
    key: CudaSlice<u64>,
    ticket: CudaSlice<u32>,
    /// `sample_row_weights`' and `sample_nucleus_draw`'s ticket (zero between launches),
    /// chained or not.
    row_ticket: CudaSlice<u32>,
    /// `sample_select_pass`'s weight sums or counts, 2,048 bins for each of its three digits
    /// (zero between samples).
    select_hist: CudaSlice<u64>,
    /// `sample_select_gather`'s count of candidates and its overflow flag (zero between
    /// samples).
    select_counts: CudaSlice<u32>,
    draw: CudaSlice<f64>,
    sample_out: CudaSlice<i32>,
    chosen: ChosenSlots,
    /// Recorded after each chained step, by the parity of its position.
    done: [CudaEvent; 2],
    /// A penalised chain's counts of the generated tokens (allocated by its first step).
    generated: Mutex<Option<GeneratedCounts>>,
}

/// The generated tokens' counts a penalised chain keeps on the device: `count_n` distinct ids in
/// `ids`, their counts in `counts` (`sample_penalise_chained` counts each step's fed token,
/// then subtracts the penalties). A chain of a state of `max_seq` positions generates at most
/// that many tokens, so `ids.len() >= max_seq` holds every id it can count.
struct GeneratedCounts {
    ids: CudaSlice<u32>,
    counts: CudaSlice<u32>,
    count_n: CudaSlice<i32>,
}

/// Two `[token, status, position]` slots of mapped pinned host memory, by the parity of the
/// step's position: the chooser writes its slot, the host reads it after the step's event.
struct ChosenSlots {
    _pinned: cudarc::driver::PinnedHostSlice<i32>,
    host: *mut i32,
    /// The slots' device address (mapped memory).
    device: u64,
}

// SAFETY: `host` points into `_pinned`, which lives as long as this; the host reads a slot only
// after the event of the step that wrote it, and writes it only before queueing the next step
// that uses it (`queue_decode_step`), so no two threads or devices use a slot at once.
unsafe impl Send for ChosenSlots {}
unsafe impl Sync for ChosenSlots {}

impl ChosenSlots {
    fn new(dev: &CudaDevice) -> Result<ChosenSlots> {
        // SAFETY: six i32 of page-locked memory, mapped into the device's address space;
        // every slot is written (position -1) before any is read.
        let mut pinned = unsafe {
            dev.ctx
                .alloc_pinned_with_flags::<i32>(6, sys::CU_MEMHOSTALLOC_DEVICEMAP)
        }
        .map_err(driver("pinned allocation"))?;
        let host = pinned.as_mut_ptr().map_err(driver("pinned allocation"))?;
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` was allocated with CU_MEMHOSTALLOC_DEVICEMAP just above.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host.cast(), 0) }
            .result()
            .map_err(driver("mapping pinned memory"))?;
        let slots = ChosenSlots {
            _pinned: pinned,
            host,
            device,
        };
        slots.clear(0);
        slots.clear(1);
        Ok(slots)
    }

    /// Marks `slot` unwritten (position -1) before the step that will write it is queued.
    fn clear(&self, slot: usize) {
        // SAFETY: slot < 2, so the three i32 are inside the allocation; see `Send` above.
        unsafe { std::ptr::write_volatile(self.host.add(3 * slot + 2), -1) }
    }

    /// `[token, status, position]` of `slot`.
    fn read(&self, slot: usize) -> [i32; 3] {
        // SAFETY: as in `clear`; the device's writes are visible once the step's event is done.
        std::array::from_fn(|i| unsafe { std::ptr::read_volatile(self.host.add(3 * slot + i)) })
    }
}

/// `n` zeroed elements on the device's stream.
fn zeroed<T: DeviceRepr + ValidAsZeroBits>(dev: &CudaDevice, n: usize) -> Result<CudaSlice<T>> {
    dev.stream.alloc_zeros::<T>(n).map_err(driver("allocation"))
}

/// How a recorded decode step ends.
#[derive(Clone, Copy)]
enum StepEnd<'a> {
    /// With its logits, for the host to choose from (`decode_step`).
    Logits,
    /// With the device's choice, fed to the next step (`queue_decode_step`).
    Chosen(&'a DeviceSampling<'a>),
}

impl StepEnd<'_> {
    /// What a recording of this end depends on besides the state: the kind, and the sampling
    /// parameters that are baked into the chooser's launch (a penalised chain's counts'
    /// buffers too: `run_step` adds them).
    fn key(&self) -> Vec<u64> {
        match self {
            StepEnd::Logits => vec![0],
            StepEnd::Chosen(c) if c.params.is_greedy() && !c.params.has_penalties() => vec![1],
            StepEnd::Chosen(c) => {
                let p = c.params;
                vec![
                    2,
                    p.temperature.to_bits() as u64,
                    p.top_k as u64,
                    p.top_p.to_bits() as u64,
                    p.min_p.to_bits() as u64,
                    p.presence_penalty.to_bits() as u64,
                    p.frequency_penalty.to_bits() as u64,
                ]
            }
        }
    }
}

/// The recorded decode step and the memory its temporaries live in.
#[derive(Default)]
struct StepState {
    arena: Option<CudaSlice<u8>>,
    used: usize,
    /// Set when a temporary did not fit: the recording is retried with a larger arena.
    overflowed: bool,
    graph: Option<StepGraph>,
}

struct StepGraph {
    /// What the recording depends on: the key-length bucket and every state buffer's address.
    key: Vec<u64>,
    exec: GraphExec,
    /// The recorded logits `[1, vocab]` in the arena.
    logits: (u64, usize),
}

/// An instantiated graph. The driver's graph handles are not tied to a thread; the `Mutex`
/// around `StepState` keeps launches from different threads apart.
struct GraphExec(CudaGraph);

// SAFETY: see above: the handle is only used under the step lock.
unsafe impl Send for GraphExec {}

/// Arena for one recorded step's temporaries; doubled when a recording needs more.
const ARENA_BYTES: usize = 256 << 20;

trait Raw {
    fn raw(&self, stream: &CudaStream) -> u64;
}

impl<T> Raw for CudaSlice<T> {
    fn raw(&self, stream: &CudaStream) -> u64 {
        self.device_ptr(stream).0
    }
}

impl<T> Raw for DevBuf<T> {
    fn raw(&self, _: &CudaStream) -> u64 {
        self.ptr
    }
}

/// Launches kernel `$f` with `$cfg` and the argument values in brackets (device pointers as
/// `u64`); `bytes = N` tells the profiler how many weight bytes the launch streams.
macro_rules! launch {
    ($be:expr, $f:expr, $cfg:expr, [$($arg:expr),* $(,)?] $(, bytes = $bytes:expr)?) => {{
        #[allow(unused_mut, unused_assignments)]
        let mut bytes = 0u64;
        $( bytes = $bytes as u64; )?
        // SAFETY: each kernel's argument list is written next to its launch, in the order and
        // with the types its signature declares; the grids and buffers are sized by the caller
        // for the shapes that the kernel's comment documents.
        unsafe {
            $be.launch(
                &$f,
                stringify!($f),
                $cfg,
                &[$(&$arg as &dyn KernelArg),*],
                bytes,
            )
        }
    }};
}

/// Rebinds each tensor argument as plain values (`CudaBackend::plain`): `plain!(self, x, y)`;
/// `plain!(self, mut x)` norms a lazily normed residual in place.
macro_rules! plain {
    ($be:expr, mut $t:ident) => {
        $be.plain_mut($t)?;
    };
    ($be:expr, $($t:ident),+) => {
        $(
            let $t = $be.plain($t)?;
            let $t: &CudaTensor = &$t;
        )+
    };
}

/// A kernel argument passed by value, as the bytes the kernel reads.
trait KernelArg {
    fn bytes(&self) -> &[u8];
}

impl<T: bytemuck::NoUninit> KernelArg for T {
    fn bytes(&self) -> &[u8] {
        bytemuck::bytes_of(self)
    }
}

/// One traced launch, replayable on its own (the profiler times it in isolation), or with the
/// events recorded around it where it ran (in-place profiling).
struct Traced {
    label: &'static str,
    function: sys::CUfunction,
    cfg: LaunchConfig,
    args: Vec<Vec<u8>>,
    bytes: u64,
    events: Option<(CudaEvent, CudaEvent)>,
}

// SAFETY: the function handle belongs to a module that the backend keeps loaded; it is only
// launched from the thread that runs the profile.
unsafe impl Send for Traced {}

/// Weight bytes a quantized product streams: codes plus bf16 scale and bias per 64 columns.
fn qbytes(rows: usize, cols: usize, bits: u32) -> u64 {
    (rows * cols * bits as usize / 8 + rows * (cols / 64) * 4) as u64
}

/// Up to four matrices of one bit width read by one matrix-vector launch (`QBatch` in
/// kernels/quant.cu: the same field order and C layout).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct QBatch {
    codes: [u64; 4],
    scales: [u64; 4],
    biases: [u64; 4],
    y: [u64; 4],
    rows: [i32; 4],
    first_block: [i32; 5],
    first_row: [i32; 5],
}

// SAFETY: repr(C) with no padding (16 u64, then 14 i32: 184 bytes, a multiple of 8).
unsafe impl bytemuck::NoUninit for QBatch {}

/// One quantized matrix as a kernel parameter (`QMat` in kernels/quant.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct QMatArg {
    codes: u64,
    scales: u64,
    biases: u64,
}

// SAFETY: repr(C), three u64, no padding.
unsafe impl bytemuck::NoUninit for QMatArg {}

/// A `SharedGate` kernel parameter (kernels/quant.cu): the partial sums of the shared expert's
/// gate logits that `moe_route` adds, and where the sums go; both zero for none.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct SharedGateArg {
    parts_in: u64,
    out: u64,
}

// SAFETY: repr(C), two u64, no padding.
unsafe impl bytemuck::NoUninit for SharedGateArg {}

/// Quantization widths with a kernel: index into the `[q4, q8]` kernel pairs.
fn bits_index(bits: u32, name: &str) -> Result<usize> {
    match bits {
        4 => Ok(0),
        8 => Ok(1),
        b => Err(Error::Backend(format!(
            "{name}: {b}-bit weights have no CUDA kernel (4 and 8 do)"
        ))),
    }
}

fn cfg(grid: (u32, u32), threads: u32, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

/// One thread per element, 256 per block.
fn elementwise(n: usize) -> LaunchConfig {
    cfg(((n.div_ceil(256)).max(1) as u32, 1), 256, 0)
}

/// Experts the routing kernel holds in registers (16 keys a lane; kernels/quant.cu, route_token).
const MAX_ROUTED_EXPERTS: usize = 512;

/// The top `top_k` of `experts`, within what the routing kernel takes: one chosen expert per lane
/// of a warp, and `MAX_ROUTED_EXPERTS`.
fn check_routing(experts: usize, top_k: usize) -> Result<()> {
    if experts == 0 || top_k == 0 || top_k > experts || top_k > 32 || experts > MAX_ROUTED_EXPERTS {
        return Err(Error::Backend(format!(
            "route: top {top_k} of {experts} experts (CUDA routes up to {MAX_ROUTED_EXPERTS} \
             experts, choosing at most 32)"
        )));
    }
    Ok(())
}

/// Dynamic shared memory of a matrix-vector block over `cols` columns (kernels/quant.cu,
/// stage_x): x itself, then one sum per vector of codes (16 columns at 8 bits, 32 at 4); the
/// kernels' `staged_x_floats` is the same count in floats.
pub fn gemv_smem_bytes(cols: usize) -> usize {
    4 * (cols + cols / 16)
}

/// Whether the environment switches a CUDA path off (`NAME=0`): the knobs that compare a kernel
/// or a mechanism against the one before it.
fn switched_off(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "0")
}

/// A count set by environment variable `name` (the knobs for A/B and tests); none when it is
/// unset or not a number.
fn env_count(name: &str) -> Option<usize> {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
}

/// The shapes `attn_prep` needs: q|gate [T, 2 H D], k and v [T, KVH D] (the cache's rows), the
/// norms' gains at least D long, an even rotary dim of at most D.
fn check_attn_prep(
    qg: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    [q_norm, k_norm]: [&CudaSlice<f32>; 2],
    c: &CudaKvCache,
    sh: &AttnShape,
) -> Result<()> {
    let (h, kvh, d) = (sh.heads, sh.kv_heads, sh.head_dim);
    same_shape(k, v, "attn_prep")?;
    if qg.cols != 2 * h * d
        || qg.rows != k.rows
        || k.cols != kvh * d
        || k.cols != c.row
        || q_norm.len() < d
        || k_norm.len() < d
        || !sh.rotary_dim.is_multiple_of(2)
        || sh.rotary_dim > d
    {
        return Err(Error::Backend(format!(
            "attn_prep: q|gate [{}, {}], k and v [{}, {}], cache rows of {}, {h} heads and {kvh} \
                 KV heads of {d} (rotary {}), norms of {} and {}",
            qg.rows,
            qg.cols,
            k.rows,
            k.cols,
            c.row,
            sh.rotary_dim,
            q_norm.len(),
            k_norm.len()
        )));
    }
    Ok(())
}

/// One token's 4-bit products on the integer tensor cores (kernels/quant.cu, `QxStaged`).
struct GemvQx {
    /// A batch of matrices, a block per 32 rows (`QX_ROWS_PER_BLOCK`): the in-projections.
    batch: CudaFunction,
    /// One matrix of many rows walked by each warp 16 rows at a time: the lm_head.
    stream: CudaFunction,
}

/// Rows of one block of `q4_gemv_batch_qx` (kernels/quant.cu: two tiles of 16).
const QX_ROWS_PER_BLOCK: usize = 32;
/// Rows one pass of a `q4_gemv_stream_qx` block takes (its 8 warps, a 16-row tile each).
const QX_STREAM_ROWS_PER_BLOCK: usize = 128;

/// Dynamic shared memory of x staged for the integer tensor cores (kernels/quant.cu, `QxStaged`):
/// per 128-column round, 4 k-steps x 4 parts x 4 lanes of 8-byte fragments; per 64-column group
/// four multipliers and a sum.
pub fn qx_smem_bytes(cols: usize) -> usize {
    let rounds = cols.div_ceil(128);
    rounds * 4 * 4 * 4 * 8 + rounds * 2 * (4 + 1) * 4
}

/// A residual norm's row of `cols` against its gains, within what one block holds
/// (`NORM_PER_THREAD` columns for each of up to 1,024 threads).
fn check_row_norm(cols: usize, w: &CudaSlice<f32>) -> Result<()> {
    if w.len() < cols {
        return Err(Error::Backend(format!(
            "add_rms_norm over {cols} columns with {} gains",
            w.len()
        )));
    }
    if cols > NORM_PER_THREAD * 1024 {
        return Err(Error::Backend(format!(
            "add_rms_norm over {cols} columns: at most {} are supported on CUDA",
            NORM_PER_THREAD * 1024
        )));
    }
    Ok(())
}

fn same_shape(a: &CudaTensor, b: &CudaTensor, op: &str) -> Result<()> {
    if a.rows != b.rows || a.cols != b.cols {
        return Err(Error::Backend(format!(
            "{op}: shape mismatch [{}, {}] vs [{}, {}]",
            a.rows, a.cols, b.rows, b.cols
        )));
    }
    Ok(())
}

/// Prompt tokens per prefill forward: the tensor-core tiles take 64 tokens, and the experts'
/// tiles fill only when each of 256 experts sees a few dozen tokens of the chunk.
const PREFILL_CHUNK: usize = 4096;
/// Shared memory of a tensor-core product block (`TcSmem`, kernels/qmma.cu: two groups of 128
/// rows of codes and 64 slots of hi/lo activations, 72-element pitch, scales, biases and sums;
/// then the slots' rows). The kernels trap if a launch gives them less.
const TC_SMEM_BYTES: usize = 2 * (2 * (128 + 2 * 64) * 72 + 4 * (2 * 128 + 64)) + 64 * (4 + 8);
/// Stages of a warpgroup product block (`WG_STAGES`, kernels/qmma.cu).
const WG_STAGES: usize = 6;
/// Shared memory of a warpgroup product block (`WgSmem<BITS, N>`, kernels/qmma.cu): six stages
/// of `slots` slots' hi and lo activations (64 columns each) and 256 rows of codes, the bias
/// product's three parts of the slots' group sums, two tiles' f32 group sums of their slots
/// (`WG_STAGED_SUMS`: 4-bit 64-slot tiles only), then two tiles' slots and the stages'
/// mbarriers (under 2,048 bytes).
fn wg_smem_bytes(bits: usize, slots: usize) -> usize {
    let stage = 2 * slots * 64 * 2 + 256 * 2 * bits * 4;
    let sum_parts = 3 * slots * 64 * 2;
    let sums = if bits == 4 && slots == 64 {
        2 * slots * 64 * 4
    } else {
        2 * 4 * 4
    };
    // Stages, the parts and the whole are 1,024-byte aligned; 1,024 more to align the start.
    WG_STAGES * stage.next_multiple_of(1024) + sum_parts.next_multiple_of(1024) + sums + 2048 + 1024
}

/// Threads of a warpgroup product block (`WG_THREADS_OF`, kernels/qmma.cu): four warpgroups of
/// one 64-row tile each, or on the 4-bit 16-slot tiles two warpgroups of two.
fn wg_threads(bits: u32, slots: u32) -> u32 {
    if bits == 4 && slots == 16 { 256 } else { 512 }
}

/// One tile shape of the tensor-core products (kernels/qmma.cu): its kernels by bits and how
/// they are launched.
struct ProductShape {
    dense: [CudaFunction; 2],
    /// The dense products split along K (`qmma_parts`), kernels of their own so that the
    /// unsplit ones keep a tile's columns fixed at compile time.
    dense_parts: [CudaFunction; 2],
    moe_gate_up: [CudaFunction; 2],
    moe_down: [CudaFunction; 2],
    /// `[bits]` dynamic shared memory, and the blocks an SM holds at once.
    smem: [usize; 2],
    per_sm: [usize; 2],
    /// Weight rows and token slots per block, and `[bits]` threads.
    rows: u32,
    slots: u32,
    threads: [u32; 2],
    /// Whether a block may take several tiles in turn (the wgmma core, `wg_tiles`), and a cap
    /// on such a launch's blocks below what the GPU holds (`LILY_CUDA_PRODUCT_BLOCKS`, so that
    /// tests of small products reach blocks that take many tiles).
    persistent: bool,
    max_blocks: Option<usize>,
}

impl ProductShape {
    /// Blocks for `tiles` tiles of `groups` 64-column groups each (at the fewest) at bits index
    /// `b`: a block per tile, or on the persistent core, when the tiles are more than the GPU
    /// holds at once, as many blocks as it holds, each taking tiles in turn so that the next
    /// tile's copies overlap the current tile's products. That needs `WG_STAGES` groups a tile
    /// (`wg_tiles`, kernels/qmma.cu). Tiles are dealt to blocks in a fixed rotation, so a block's
    /// share is uneven by up to a tile: at a 256-token prompt (3-9 tiles a block) that cost
    /// prefill 1.7% when 16-slot blocks had four warpgroups of one row tile (run47); with two of
    /// two it gains 0.8% there and 0.2-0.6% at 1,024-4,096 tokens (run62; docs/performance.md).
    /// A cap on the blocks (`max_blocks`, for tests) applies whenever the tiles exceed it.
    fn blocks(&self, tiles: usize, groups: usize, b: usize, sms: usize) -> u32 {
        let blocks = if !self.persistent || groups < WG_STAGES {
            tiles
        } else {
            let resident = self.per_sm[b] * sms;
            tiles
                .min(resident)
                .min(self.max_blocks.unwrap_or(usize::MAX))
        };
        blocks as u32
    }
}

/// The product tiles in use: one shape (`main`), or on sm_90a 64-slot tiles and 16-slot ones
/// that launches pick when they suit them better.
struct ProductShapes {
    main: ProductShape,
    n16: Option<ProductShape>,
}

impl ProductShapes {
    fn only(main: ProductShape) -> Self {
        ProductShapes { main, n16: None }
    }

    /// The shape for a product (`bits` index `b`) whose tiles in the main shape would take
    /// `blocks` blocks: 16 slots when the four times as many 16-slot blocks all fit on the GPU
    /// at once (each does a quarter of the products per group, and 4-bit ones fit two an SM),
    /// else the main shape. At 256 tokens they take the output projections and the router and,
    /// with the experts' 16-slot tiles, make prefill 7,640 tok/s against 6,041; where they would
    /// need a second wave they lose (docs/performance.md).
    fn pick(&self, blocks: usize, b: usize, sms: usize) -> &ProductShape {
        match &self.n16 {
            Some(n16) if blocks * (self.main.slots / n16.slots) as usize <= n16.per_sm[b] * sms => {
                n16
            }
            _ => &self.main,
        }
    }

    /// The shape for the grouped expert products of `pairs` pairs over `groups` experts: 16
    /// slots when the experts see 16 pairs each or fewer on average (64-slot tiles would be
    /// mostly empty), else the main shape.
    fn pick_grouped(&self, pairs: usize, groups: usize) -> &ProductShape {
        match &self.n16 {
            Some(n16) if pairs <= 16 * groups => n16,
            _ => &self.main,
        }
    }
}
/// How each matrix-vector variant (`GEMV_VARIANTS`, kernels/quant.cu) is launched.
#[derive(Clone, Copy)]
struct GemvShape {
    variant: usize,
    rows_per_block: usize,
}

/// r4, r1, h16.
const GEMV_SHAPES: [GemvShape; 3] = [
    GemvShape {
        variant: 0,
        rows_per_block: 32,
    },
    GemvShape {
        variant: 1,
        rows_per_block: 8,
    },
    GemvShape {
        variant: 2,
        rows_per_block: 64,
    },
];

/// Matrices that would take at least this many blocks per SM at 32 rows a block (the lm_head)
/// go through `gemv_stream`.
const STREAM_MIN_BLOCKS_PER_SM: usize = 8;
/// Tokens from which the dense products run on the tensor cores (below, each token streams the
/// weights through the matrix-vector kernels, as decode does).
const MMA_MIN_TOKENS: usize = 8;
/// One token's MoE outputs mixed into the residual by `moe_down_mix` (kernels/quant.cu): rows
/// per block (`MIX_ROWS`; also the count of the partial sums of squares it leaves, one a
/// block), and the warps a block has at most, one a pair with the shared expert's (all of them
/// loaded at once: `MIX_LOADS`, kernels/common.cuh).
const MIX_ROWS_PER_BLOCK: usize = 16;
const MIX_MAX_PAIRS: usize = 10;

/// Whether `moe_down_mix` takes a token's down products: fewer routed experts than its warps,
/// and every pair's staged activations (the shared expert's too) within a launch's shared memory.
/// Rows wider than one round of its half warps' loads (16 vectors of codes) are walked.
fn mix_fits(stride: usize, top_k: usize) -> bool {
    top_k < MIX_MAX_PAIRS && (top_k + 1) * gemv_smem_bytes(stride) <= SMEM_LIMIT
}

/// Where `moe_down_mix` puts one token's MoE output: x_out = x_in + the output, x_out * gains
/// into `input` and the sums of squares of its blocks of rows into `partials` (device
/// addresses; see `LazyNorm`).
#[derive(Clone, Copy)]
struct MixInto {
    x_in: u64,
    x_out: u64,
    gains: u64,
    input: u64,
    partials: u64,
}

/// The expert products: every pair's output row (and the shared gate logits' address, 0 without
/// a shared expert), or nothing left to do when `moe_down_mix` took them.
enum MoeOut {
    Rows(DevBuf<f32>, u64),
    Mixed,
}

/// Tokens from which the experts run grouped by expert on the tensor cores (below, each pair is
/// a matrix-vector product: with few tokens an expert rarely serves more than one).
const GROUPED_MOE_MIN_TOKENS: usize = 32;
/// Tokens from which the norms and the attention's output gate keep their output as its split
/// alone (`LazySplit`); `LILY_CUDA_SPLIT_ONLY_MIN_TOKENS` overrides it, for A/B, down to
/// `GROUPED_MOE_MIN_TOKENS` (below it the experts' products would remake the values).
const SPLIT_ONLY_MIN_TOKENS: usize = GROUPED_MOE_MIN_TOKENS;
/// Experts plus the shared expert that the grouping kernel can count (`MAX_GROUPS`, qmma.cu).
const MAX_EXPERT_GROUPS: usize = 1024;
/// Pairs each block of the grouping's first kernel counts (`MOE_GROUP_PAIRS`, qmma.cu).
const MOE_GROUP_PAIRS: usize = 1024;

/// Rows of at most this many columns, this many rows or more, are normed a warp each
/// (`rms_norm_warp`), or several to a warp in 8-column blocks where they fit (`rms_norm_rows8`).
const SHORT_NORM_COLS: usize = 512;
const SHORT_NORM_MIN_ROWS: usize = 256;

/// Whether `launch_norm_rows` takes `groups` rows of `cols` by `rms_norm_rows8`, the kernel
/// that writes the split from its registers and so may leave out the f32 rows (`LazySplit`).
fn norm_rows8_fits(groups: usize, cols: usize) -> bool {
    let blocks8 = cols / 8;
    groups >= SHORT_NORM_MIN_ROWS
        && cols <= SHORT_NORM_COLS
        && cols.is_multiple_of(8)
        && blocks8 > 0
        && (32 % blocks8 == 0 || blocks8.is_multiple_of(32))
}

/// Threads of a block of the residual-add norms (`add_rms_norm_row8`): an 8-column block a
/// thread, whole warps. Their remake (`rms_norm_row8`) takes the same, so the same sums.
fn row8_threads(cols: usize) -> u32 {
    cols.div_ceil(NORM_PER_THREAD).next_multiple_of(32) as u32
}

/// Columns per thread of the residual-add norms: an 8-column block (`add_rms_norm_row8`,
/// kernels/pointwise.cu).
const NORM_PER_THREAD: usize = 8;

/// Tokens per thread of the conv kernel (`CONV_TOKENS`, kernels/gdn.cu).
const CONV_TOKENS: u32 = 64;

/// Keys per tile of the flash-attention prefill kernel (`FA_BK`, kernels/attention.cu).
const FA_KEYS: usize = 64;
/// Queries per block of the flash-attention prefill kernel (`FA_BQ`, kernels/attention.cu: 8
/// warps of 16), and the tokens from which attention takes it (below, the split-K kernels fill
/// the GPU better).
const FA_QUERIES: usize = 128;
const FA_MIN_TOKENS: usize = 32;

/// Keys per attention split, at least (more when the split count is capped);
/// `LILY_CUDA_ATTN_MIN_CHUNK` overrides it, for A/B.
const ATTN_MIN_CHUNK: usize = 16;
/// Keys per tile of the decode attention kernel and its stages (`ATTN_TILE`, `ATTN_STAGES`,
/// kernels/attention.cu).
const ATTN_TILE: usize = 32;
const ATTN_STAGES: usize = 3;
/// Warps per block of the decode attention kernel for head dim `d` (`adec_warps`): eight, each
/// with 16 dims at least.
fn attn_decode_warps(d: usize) -> usize {
    (d / 16).min(8)
}
/// The largest dynamic shared memory a launch may ask for without opting in (48 KiB).
const SMEM_LIMIT: usize = 48 * 1024;

impl CudaBackend {
    /// The GPU `ordinal`, with every kernel compiled (or loaded from the disk cache).
    /// `LILY_CUDA_GRAPHS=0` runs decode steps without recording them (for debugging).
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        let dev = CudaDevice::open(ordinal)?;
        let k = Kernels::load(&dev)?;
        let params = zeroed(&dev, 2)?;
        let ids_ready = zeroed(&dev, 2)?;
        let event = || dev.ctx.new_event(None).map_err(driver("event"));
        let chain = ChainBuffers {
            key: zeroed(&dev, 1)?,
            ticket: zeroed(&dev, 1)?,
            row_ticket: zeroed(&dev, 1)?,
            select_hist: zeroed(&dev, 3 * 2048)?,
            select_counts: zeroed(&dev, 2)?,
            draw: zeroed(&dev, 1)?,
            sample_out: zeroed(&dev, 2)?,
            chosen: ChosenSlots::new(&dev)?,
            done: [event()?, event()?],
            generated: Mutex::new(None),
        };
        let sms = dev
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver("reading the SM count"))? as usize;
        let pdl = dev
            .ctx
            .compute_capability()
            .is_ok_and(|(major, _)| major >= 9)
            && !switched_off("LILY_CUDA_PDL");
        Ok(CudaBackend {
            dev,
            k,
            sms,
            params,
            ids_ready,
            chain,
            chains: !switched_off("LILY_CUDA_CHAIN"),
            conv_in_products: !switched_off("LILY_CUDA_CONV_IN_PRODUCTS"),
            prep_in_attention: !switched_off("LILY_CUDA_PREP_IN_ATTENTION"),
            step: Mutex::new(StepState::default()),
            capturing: AtomicBool::new(false),
            bucket: AtomicUsize::new(0),
            graphs: !switched_off("LILY_CUDA_GRAPHS"),
            pdl,
            attn_min_chunk: env_count("LILY_CUDA_ATTN_MIN_CHUNK")
                .filter(|&n| n > 0)
                .unwrap_or(ATTN_MIN_CHUNK),
            split_only_min_tokens: env_count("LILY_CUDA_SPLIT_ONLY_MIN_TOKENS")
                .unwrap_or(SPLIT_ONLY_MIN_TOKENS)
                .max(GROUPED_MOE_MIN_TOKENS),
            conv_in_prep_min_tokens: env_count("LILY_CUDA_CONV_IN_PREP_MIN_TOKENS")
                .unwrap_or(CONV_IN_PREP_MIN_TOKENS)
                .max(GDN_CHUNKED_MIN_TOKENS),
            router_part_min_groups: env_count("LILY_CUDA_ROUTER_PART_MIN_GROUPS")
                .unwrap_or(ROUTER_PART_MIN_GROUPS),
            out_part_min_groups: env_count("LILY_CUDA_OUT_PART_MIN_GROUPS")
                .unwrap_or(OUT_PART_MIN_GROUPS),
            trace: Mutex::new(None),
            left_out: OnceLock::new(),
            tracing: AtomicBool::new(false),
            in_place: AtomicBool::new(false),
        })
    }

    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// The routing's ids and weights (`[tokens][top_k]`), routed first if still pending.
    pub fn routing<'a>(&self, rt: &'a CudaRouting) -> Result<(&'a DevBuf<i32>, &'a DevBuf<f32>)> {
        self.settle(rt)?;
        Ok((&rt.ids, &rt.weights))
    }

    /// Routes a pending token's logits into `rt.ids` and `rt.weights`.
    fn settle(&self, rt: &CudaRouting) -> Result<()> {
        match rt.deferred.take() {
            Some(d) => self.launch_route(self.ptr(&d.logits.buf), rt, d.renormalize),
            None => Ok(()),
        }
    }

    /// `qmatmul_many` (the trait's), and with `conv` (taps non-zero) the conv of the first
    /// matrix's rows where its launch is the integer tensor cores' batch (`ConvTail`,
    /// kernels/quant.cu); returns whether it took the conv.
    fn products_and_conv(
        &self,
        x: &CudaTensor,
        ws: &[&CudaQMatrix],
        conv: ConvTailArg,
    ) -> Result<(Vec<CudaTensor>, bool)> {
        if x.rows >= MMA_MIN_TOKENS {
            // One split of the input serves every product; consecutive matrices of one bit
            // width share a launch (at most four per launch).
            let split = self.split_of(x)?;
            let mut outs = Vec::with_capacity(ws.len());
            for group in ws.chunk_by(|a, b| a.bits == b.bits) {
                for part in group.chunks(4) {
                    outs.extend(self.qmma(&split, x.cols, part, x.rows)?);
                }
            }
            return Ok((outs, false));
        }
        if x.rows != 1 {
            let outs = ws
                .iter()
                .map(|w| self.qmatmul(x, w))
                .collect::<Result<_>>()?;
            return Ok((outs, false));
        }
        let (_x_held, x_ptr, nrm) = self.row_input(x)?;
        let mut outs = Vec::with_capacity(ws.len());
        let mut convolved = false;
        // Consecutive matrices of one bit width share a launch (at most four per launch).
        for group in ws.chunk_by(|a, b| a.bits == b.bits) {
            for part in group.chunks(4) {
                let b = self.check_q(x.cols, part[0])?;
                let GemvShape {
                    variant,
                    rows_per_block,
                } = self.gemv_variant(part.iter().map(|w| w.rows).sum(), x.cols, part[0].bits);
                let (batch, blocks, part_outs) = self.qbatch(x.cols, part, rows_per_block, 1)?;
                let bytes = part
                    .iter()
                    .map(|w| qbytes(w.rows, w.cols, w.bits))
                    .sum::<u64>();
                // Four-row warps needing more blocks than two per SM (their registers' limit)
                // would leave a second, mostly empty wave: walk the rows instead, or for 4-bit
                // matrices take them on the integer tensor cores.
                let many = variant == 0 && blocks as usize > 2 * self.sms;
                let qx = self
                    .k
                    .gemv_qx
                    .as_ref()
                    .filter(|_| many && part[0].bits == 4);
                if let Some(gemv_qx) = qx {
                    let rows: usize = part.iter().map(|w| w.rows).sum();
                    // The conv rides on the launch of the first matrix (the channels).
                    let tail = if outs.is_empty() {
                        conv
                    } else {
                        ConvTailArg::default()
                    };
                    convolved |= tail.taps != 0;
                    launch!(
                        self,
                        gemv_qx.batch,
                        cfg(
                            (rows.div_ceil(QX_ROWS_PER_BLOCK) as u32, 1),
                            256,
                            qx_smem_bytes(x.cols)
                        ),
                        [batch, x_ptr, x.cols as i32, nrm, tail],
                        bytes = bytes
                    )?;
                } else if many && part.iter().all(|w| w.rows.is_multiple_of(2)) {
                    launch!(
                        self,
                        self.k.gemv_batch_stream[b],
                        cfg(((2 * self.sms) as u32, 1), 256, gemv_smem_bytes(x.cols)),
                        [batch, x_ptr, x.cols as i32, nrm],
                        bytes = bytes
                    )?;
                } else if blocks > 0 {
                    launch!(
                        self,
                        self.k.gemv_batch[b][variant],
                        cfg((blocks as u32, 1), 256, gemv_smem_bytes(x.cols)),
                        [batch, x_ptr, x.cols as i32, nrm],
                        bytes = bytes
                    )?;
                }
                outs.extend(part_outs);
            }
        }
        Ok((outs, convolved))
    }

    /// `conv1d_silu` over `tokens` rows of `channels` at `[x, taps, window, window_out, y]`:
    /// y = silu(causal conv of x), the window before x read from `window` and the window after
    /// it written to `window_out` (0 for none).
    fn launch_conv(
        &self,
        [x, taps, window, window_out, y]: [u64; 5],
        tokens: usize,
        channels: usize,
        kernel: usize,
    ) -> Result<()> {
        if tokens == 0 {
            return Ok(());
        }
        launch!(
            self,
            self.k.conv1d_silu,
            cfg(
                (
                    (channels as u32).div_ceil(128),
                    (tokens as u32).div_ceil(CONV_TOKENS)
                ),
                128,
                0
            ),
            [
                x,
                taps,
                window,
                window_out,
                y,
                tokens as i32,
                channels as i32,
                kernel as i32
            ]
        )
    }

    /// Whether `t` tokens of a GDN layer of shape `sh` take the chunked recurrence
    /// (`gdn_chunk_prep`, `gdn_chunk_state`) rather than the token loop.
    fn gdn_chunked_fits(&self, sh: &GdnShape, t: usize) -> bool {
        self.k.gdn_chunked.is_some()
            && sh.key_dim == 128
            && sh.value_dim == 128
            && t >= GDN_CHUNKED_MIN_TOKENS
    }

    /// `moe_route` over `rt.tokens` rows of `rt.num_experts` logits at `logits`, into `rt.ids`
    /// and `rt.weights`: one warp a token.
    fn launch_route(&self, logits: u64, rt: &CudaRouting, renormalize: bool) -> Result<()> {
        self.launch_route_parts(logits, 1, rt, renormalize, SharedGateArg::default())
    }

    /// `moe_route` over logits left in `parts` partial sums (`qmma_parts`), adding the shared
    /// expert's gate logits' parts too when `gate` has them.
    fn launch_route_parts(
        &self,
        logits: u64,
        parts: usize,
        rt: &CudaRouting,
        renormalize: bool,
        gate: SharedGateArg,
    ) -> Result<()> {
        if rt.tokens == 0 {
            return Ok(());
        }
        launch!(
            self,
            self.k.moe_route,
            cfg((rt.tokens as u32, 1), 32, 0),
            [
                logits,
                parts as i32,
                self.ptr(&rt.ids),
                self.ptr(&rt.weights),
                rt.num_experts as i32,
                rt.top_k as i32,
                renormalize as i32,
                gate
            ]
        )
    }

    /// x += the sum of `parts` partial products at `y` (each x's shape, in order), then its norm
    /// (`add_rms_norm`, kernels/pointwise.cu; `residual_norm` says where each goes).
    fn add_parts_rms_norm(
        &self,
        x: &mut CudaTensor,
        y: u64,
        parts: usize,
        w: &CudaSlice<f32>,
        eps: f32,
    ) -> Result<CudaTensor> {
        check_row_norm(x.cols, w)?;
        let (rows, cols) = (x.rows, x.cols);
        let launch = |x_in: u64, x_out: u64, out: u64, split: SplitArg| {
            launch!(
                self,
                self.k.add_rms_norm,
                cfg((rows as u32, 1), row8_threads(cols), 0),
                [
                    x_in,
                    x_out,
                    y,
                    parts as i32,
                    self.ptr(w),
                    out,
                    split,
                    cols as i32,
                    eps
                ]
            )
        };
        self.residual_norm(x, w, eps, launch)
    }

    /// Room for `tokens` tokens' routing to `top_k` of `experts`, which `moe_route` writes.
    fn routing_of(&self, tokens: usize, top_k: usize, experts: usize) -> Result<CudaRouting> {
        Ok(CudaRouting {
            ids: self.tmp::<i32>(tokens * top_k)?,
            weights: self.tmp::<f32>(tokens * top_k)?,
            tokens,
            top_k,
            num_experts: experts,
            deferred: Cell::new(None),
        })
    }

    /// Many tokens' routing: the router's and the shared expert's gate products (one launch)
    /// split along K into parts that fill the GPU where their tiles would not: at 256 tokens
    /// they made 32 blocks, each walking all 32 groups, on 132 SMs. `moe_route` adds the parts
    /// of both. Unsplit (many tokens), this is `route_tokens_separately`.
    fn route_tokens_in_parts(
        &self,
        h: &CudaTensor,
        router: &CudaQMatrix,
        shared_gate: &CudaQMatrix,
        top_k: usize,
        renormalize: bool,
    ) -> Result<(CudaRouting, CudaTensor)> {
        let split = self.split_of(h)?;
        let t = h.rows;
        let (outs, parts) = self.qmma_parts(
            &split,
            h.cols,
            &[router, shared_gate],
            t,
            self.router_part_min_groups,
        )?;
        let [logits, gate_parts] = products(outs)?;
        let rt = self.routing_of(t, top_k, router.rows)?;
        if parts == 1 {
            self.launch_route(self.ptr(&logits.buf), &rt, renormalize)?;
            return Ok((rt, gate_parts));
        }
        let gate_logit = self.tensor(t, 1)?;
        let gate = SharedGateArg {
            parts_in: self.ptr(&gate_parts.buf),
            out: self.ptr(&gate_logit.buf),
        };
        self.launch_route_parts(self.ptr(&logits.buf), parts, &rt, renormalize, gate)?;
        Ok((rt, gate_logit))
    }

    /// Launches `f` on the stream (through `launch!`, which lists the arguments).
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list, and `cfg` the grid its comment documents.
    unsafe fn launch(
        &self,
        f: &CudaFunction,
        label: &'static str,
        cfg: LaunchConfig,
        args: &[&dyn KernelArg],
        bytes: u64,
    ) -> Result<()> {
        // The name profiles print and `leave_out_of_decode` matches: the kernel's field.
        let label = label.trim_start_matches("self.k.");
        if self.is_left_out(label) {
            return Ok(());
        }
        let mut params = [std::ptr::null_mut::<std::ffi::c_void>(); 24];
        if args.len() > params.len() {
            return Err(Error::Backend(format!(
                "{label}: too many kernel arguments"
            )));
        }
        for (p, a) in params.iter_mut().zip(args) {
            *p = a.bytes().as_ptr() as *mut std::ffi::c_void;
        }
        self.dev
            .ctx
            .bind_to_thread()
            .map_err(driver("binding the context"))?;
        let tracing = self.tracing.load(Ordering::Relaxed);
        let start = match tracing && self.in_place.load(Ordering::Relaxed) {
            true => Some(self.event()?),
            false => None,
        };
        // SAFETY: the caller vouches for the argument list; `params` points at values that
        // live until this call returns, which is all a launch needs.
        // Programmatic dependent launch only for the recorded decode step: it is worth 11% of
        // decode there, and costs prefill's large kernels 5-7% (early-launched dependents
        // waiting on SMs; docs/performance.md, run9).
        let pdl = self.pdl && self.recording();
        unsafe { self.launch_raw(f.cu_function(), &cfg, &mut params[..args.len()], pdl) }?;
        if let Some(t) = self.dev.timeline.as_ref().filter(|_| self.recording()) {
            let (x, y, z) = cfg.grid_dim;
            t.launched(label, x * y * z);
        }
        if tracing
            && let Ok(mut t) = self.trace.lock()
            && let Some(t) = t.as_mut()
        {
            let events = match start {
                Some(start) => Some((start, self.event()?)),
                None => None,
            };
            t.push(Traced {
                label,
                function: f.cu_function(),
                cfg,
                args: args.iter().map(|a| a.bytes().to_vec()).collect(),
                bytes,
                events,
            });
        }
        Ok(())
    }

    /// Whether launches labelled `label` are left out of the step being recorded
    /// (`leave_out_of_decode`).
    fn is_left_out(&self, label: &str) -> bool {
        self.recording()
            && self
                .left_out
                .get()
                .is_some_and(|l| label.starts_with(l.as_str()))
    }

    /// Whether launches are traced to be replayed alone afterwards (`profile`, not in place).
    fn replayed(&self) -> bool {
        self.tracing.load(Ordering::Relaxed) && !self.in_place.load(Ordering::Relaxed)
    }

    /// A timing event recorded on the stream now.
    fn event(&self) -> Result<CudaEvent> {
        let ev = self
            .dev
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver("event"))?;
        ev.record(&self.dev.stream).map_err(driver("event"))?;
        Ok(ev)
    }

    /// Microseconds one traced launch takes on its own: 20 copies recorded in a graph, the
    /// graph replayed 5 times (after a warm-up), divided out. Back-to-back copies find their
    /// weights in L2 when they fit (50 MB), so small products read faster than in a step.
    fn time_alone(&self, t: &Traced) -> Result<f64> {
        const COPIES: usize = 20;
        const REPLAYS: usize = 5;
        let stream = &self.dev.stream;
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(driver("begin capture"))?;
        let mut launched: Result<()> = Ok(());
        for _ in 0..COPIES {
            let mut params: Vec<*mut std::ffi::c_void> = t
                .args
                .iter()
                .map(|a| a.as_ptr() as *mut std::ffi::c_void)
                .collect();
            // SAFETY: the same function, grid and argument bytes that ran in the traced step.
            // As in the recorded step (the profile replays decode launches).
            launched = unsafe { self.launch_raw(t.function, &t.cfg, &mut params, self.pdl) };
            if launched.is_err() {
                break;
            }
        }
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        launched?;
        let graph = graph
            .map_err(driver("end capture"))?
            .ok_or_else(|| Error::Backend("profiling recorded no graph".into()))?;
        graph.launch().map_err(driver("graph launch"))?;
        let timed = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.dev.ctx.new_event(timed).map_err(driver("event"))?;
        let stop = self.dev.ctx.new_event(timed).map_err(driver("event"))?;
        start.record(stream).map_err(driver("event"))?;
        for _ in 0..REPLAYS {
            graph.launch().map_err(driver("graph launch"))?;
        }
        stop.record(stream).map_err(driver("event"))?;
        self.dev.synchronize()?;
        let ms = start.elapsed_ms(&stop).map_err(driver("event"))?;
        Ok(ms as f64 * 1e3 / (COPIES * REPLAYS) as f64)
    }

    /// The routed experts of `rt` on `x`, and the shared expert gated by sigmoid(logit) when
    /// given: one launch for every gate/up product (SwiGLU applied), one for every down
    /// product, one to mix them (kernels/quant.cu).
    #[allow(clippy::type_complexity)]
    /// The MoE block, its outputs mixed by the routing weights (and the shared expert's gate).
    fn moe(
        &self,
        x: &CudaTensor,
        rt: &CudaRouting,
        experts: [&CudaQMatrix; 3],
        shared: Option<([&CudaQMatrix; 3], &CudaTensor)>,
    ) -> Result<CudaTensor> {
        let MoeOut::Rows(y, logit) = self.moe_products(x, rt, experts, shared, None)? else {
            return Err(Error::Backend("moe: the products were mixed".into()));
        };
        self.combine(&y, logit, rt, x.rows, x.cols)
    }

    /// The pairs' outputs `y` mixed by the routing weights (and the shared expert's gate, at
    /// `logit` when not 0) into `[t, hidden]`.
    fn combine(
        &self,
        y: &DevBuf<f32>,
        logit: u64,
        rt: &CudaRouting,
        t: usize,
        hidden: usize,
    ) -> Result<CudaTensor> {
        let out = self.tensor(t, hidden)?;
        if t > 0 {
            launch!(
                self,
                self.k.moe_combine,
                elementwise(t * hidden),
                [
                    y.ptr,
                    self.ptr(&rt.weights),
                    logit,
                    self.ptr(&out.buf),
                    t as i32,
                    rt.top_k as i32,
                    hidden as i32
                ]
            )?;
        }
        Ok(out)
    }

    /// The expert products of the MoE block: y [pairs (+ tokens), hidden] holds the routed
    /// pairs' outputs, then the shared expert's; returned with the shared gate logits' address
    /// (0 without a shared expert). With `mix`, one token whose down rows `moe_down_mix` takes
    /// has its outputs mixed into the residual and normed there instead (`MoeOut::Mixed`).
    fn moe_products(
        &self,
        x: &CudaTensor,
        rt: &CudaRouting,
        [gate, up, down]: [&CudaQMatrix; 3],
        shared: Option<([&CudaQMatrix; 3], &CudaTensor)>,
        mix: Option<MixInto>,
    ) -> Result<MoeOut> {
        let (t, hidden) = (x.rows, x.cols);
        let e = rt.num_experts;
        let inter = gate.rows / e.max(1);
        let b = self.check_q(hidden, gate)?;
        self.check_q(hidden, up)?;
        self.check_q(inter, down)?;
        if rt.tokens != t
            || up.rows != gate.rows
            || !gate.rows.is_multiple_of(e)
            || down.rows != e * hidden
            || up.bits != gate.bits
            || down.bits != gate.bits
        {
            return Err(Error::Backend(format!(
                "moe_experts: stacks {}x{} / {}x{} / {}x{} ({} bits) do not match {e} experts of hidden {hidden}",
                gate.rows, gate.cols, up.rows, up.cols, down.rows, down.cols, gate.bits
            )));
        }
        let none = QMatArg::default();
        let (sgate, sup, sdown, logit, inter_s) = match shared {
            Some(([sg, su, sd], logit)) => {
                let inter_s = sg.rows;
                self.check_q(hidden, sg)?;
                self.check_q(hidden, su)?;
                self.check_q(inter_s, sd)?;
                if su.rows != inter_s
                    || sd.rows != hidden
                    || [sg.bits, su.bits, sd.bits] != [gate.bits; 3]
                    || logit.rows != t
                    || logit.cols != 1
                {
                    return Err(Error::Backend(format!(
                        "moe_block: the shared expert ({}x{}, {} bits) does not match the experts",
                        sg.rows, sg.cols, sg.bits
                    )));
                }
                (
                    self.qarg(sg),
                    self.qarg(su),
                    self.qarg(sd),
                    self.ptr(&logit.buf),
                    inter_s,
                )
            }
            None => (none, none, none, 0, 0),
        };
        // One token's pending routing is done by the gate/up kernel below; any other path
        // routes first.
        let deferred = if t == 1 { rt.deferred.take() } else { None };
        self.settle(rt)?;
        let pairs = t * rt.top_k;
        let with_shared = shared.is_some();
        let all = pairs + if with_shared { t } else { 0 };
        let stride = inter.max(inter_s);
        let mix = mix.filter(|_| t == 1 && mix_fits(stride, rt.top_k));
        if t == 0 {
            return Ok(MoeOut::Rows(self.tmp::<f32>(0)?, logit));
        }
        let shared_bytes = |rows, cols| {
            if with_shared {
                t as u64 * qbytes(rows, cols, gate.bits)
            } else {
                0
            }
        };
        if t >= GROUPED_MOE_MIN_TOKENS {
            // The grouped products read x's split alone (`split_of`).
            let dims = MoeDims {
                tokens: t,
                hidden,
                experts: e,
                inter,
                inter_s,
                pairs,
                all,
                stride,
                with_shared,
                bits: b,
            };
            let y = self.tmp::<f32>(all * hidden)?;
            self.moe_grouped(&dims, x, rt, [gate, up, down], [sgate, sup, sdown], &y)?;
            return Ok(MoeOut::Rows(y, logit));
        }
        let (_x_held, x_ptr, nrm) = self.row_input(x)?;
        let act = self.tmp::<f32>(all * stride)?;
        // A decode step's 9 expert products at four rows per warp fill about one block per
        // SM; at one row per warp, four times as many blocks keep more loads in flight.
        let GemvShape {
            variant,
            rows_per_block,
        } = self.gemv_variant(stride * all, hidden, gate.bits);
        let gate_up_bytes =
            2 * (pairs as u64 * qbytes(inter, hidden, gate.bits) + shared_bytes(inter_s, hidden));
        // One token: every warp of two blocks per SM walks the pairs' rows; more, a block
        // per (rows, pair). Both kernels take the same arguments (kernels/quant.cu).
        let (f, label, grid) = if t == 1 {
            (
                &self.k.moe_gate_up_stream[usize::from(rt.num_experts > 256)][b],
                "moe_gate_up_stream[e][b]",
                ((2 * self.sms) as u32, 1),
            )
        } else {
            (
                &self.k.moe_gate_up[b][variant],
                "moe_gate_up[b][variant]",
                (stride.div_ceil(rows_per_block) as u32, all as u32),
            )
        };
        // One token's down-and-mix kernel (`mix` is only ever one token's, so the gate/up above
        // is the stream kernel) loads its experts' weights as soon as the gate/up kernel has
        // routed the token (`flagged_routing`, kernels/quant.cu). Not when the launches are
        // replayed alone (nothing would set the flag), nor when the gate/up is left out of the
        // step.
        let ids_ready = if mix.is_some() && !self.replayed() && !self.is_left_out(label) {
            self.ptr(&self.ids_ready)
        } else {
            0
        };
        let (logits, renormalize) = match &deferred {
            Some(d) => (self.ptr(&d.logits.buf), d.renormalize),
            None => (0, false),
        };
        let args: [&dyn KernelArg; 18] = [
            &self.qarg(gate),
            &self.qarg(up),
            &sgate,
            &sup,
            &self.ptr(&rt.ids),
            &x_ptr,
            &act.ptr,
            &(rt.top_k as i32),
            &(pairs as i32),
            &(inter as i32),
            &(inter_s as i32),
            &(hidden as i32),
            &nrm,
            &logits,
            &(rt.num_experts as i32),
            &(renormalize as i32),
            &self.ptr(&rt.weights),
            &ids_ready,
        ];
        // SAFETY: both kernels take (QMat gate, QMat up, QMat sgate, QMat sup, int* ids,
        // const float* x, float* act, int top_k, int pairs, int inter, int inter_s,
        // int hidden, RowNorm nrm, const float* logits, int experts, int renormalize,
        // float* weights, u32* ids_ready) and gemv_smem_bytes(hidden) of shared memory; act
        // holds all pairs' rows of `stride`; the generic kernel gets no logits (the routing is
        // settled above unless t == 1) and no ids_ready.
        unsafe {
            self.launch(
                f,
                label,
                cfg(grid, 256, gemv_smem_bytes(hidden)),
                &args,
                gate_up_bytes,
            )
        }?;
        let down_bytes =
            pairs as u64 * qbytes(hidden, inter, down.bits) + shared_bytes(hidden, inter_s);
        if let Some(m) = mix {
            launch!(
                self,
                self.k.moe_down_mix[b],
                cfg(
                    (hidden.div_ceil(MIX_ROWS_PER_BLOCK) as u32, 1),
                    32 * all as u32,
                    all * gemv_smem_bytes(stride)
                ),
                [
                    self.qarg(down),
                    sdown,
                    self.ptr(&rt.ids),
                    self.ptr(&rt.weights),
                    logit,
                    act.ptr,
                    m.x_in,
                    m.x_out,
                    m.gains,
                    m.input,
                    m.partials,
                    rt.top_k as i32,
                    inter as i32,
                    inter_s as i32,
                    hidden as i32,
                    ids_ready
                ],
                bytes = down_bytes
            )?;
            return Ok(MoeOut::Mixed);
        }
        let y = self.tmp::<f32>(all * hidden)?;
        let GemvShape {
            variant,
            rows_per_block,
        } = self.gemv_variant(hidden * all, stride, down.bits);
        launch!(
            self,
            self.k.moe_down[b][variant],
            cfg(
                (hidden.div_ceil(rows_per_block) as u32, all as u32),
                256,
                gemv_smem_bytes(stride)
            ),
            [
                self.qarg(down),
                sdown,
                self.ptr(&rt.ids),
                act.ptr,
                y.ptr,
                pairs as i32,
                inter as i32,
                inter_s as i32,
                hidden as i32
            ],
            bytes = down_bytes
        )?;
        Ok(MoeOut::Rows(y, logit))
    }

    /// `rows x cols` f32 at `src` as the tensor-core products read it (kernels/qmma.cu,
    /// split_bf16): bf16 hi and lo parts and the f32 sum of each 64-column group.
    fn split(&self, src: u64, rows: usize, cols: usize) -> Result<Split> {
        self.split_with(&self.k.split_bf16, src, rows, cols)
    }

    /// `split` of `silu(gate) * up` from `rows x 2 cols` at `src` (gate | up in each row).
    fn swiglu_split(&self, src: u64, rows: usize, cols: usize) -> Result<Split> {
        self.split_with(&self.k.swiglu_split_bf16, src, rows, cols)
    }

    /// The split of `x` for the tensor-core products: the one its writer made with it (all that
    /// a `LazySplit` tensor holds), else a new one of its plain values.
    fn split_of(&self, x: &CudaTensor) -> Result<Split> {
        if let Some(split) = &x.split {
            return Ok(Split::clone(split));
        }
        plain!(self, x);
        self.split(self.ptr(&x.buf), x.rows, x.cols)
    }

    /// Room for the split of a `rows x cols` output that tensor-core products read next, where
    /// they would take one: many rows, and columns that make whole 64-column groups.
    fn products_split(&self, rows: usize, cols: usize) -> Result<Option<Arc<Split>>> {
        if rows >= MMA_MIN_TOKENS && cols.is_multiple_of(64) {
            return Ok(Some(Arc::new(self.alloc_split(rows, cols)?)));
        }
        Ok(None)
    }

    /// The split of a `rows x cols` output that its writer keeps alone, without the f32 values
    /// (`LazySplit`): from `SPLIT_ONLY_MIN_TOKENS` rows, where every product reading it takes
    /// the split.
    fn kept_split(&self, split: &Option<Arc<Split>>, rows: usize) -> Option<Arc<Split>> {
        split.clone().filter(|_| rows >= self.split_only_min_tokens)
    }

    /// A residual add with the next norm, rmsnorm(x + delta) * w, by `launch(x_in, x_out, out,
    /// split)` (a kernel of `add_rms_norm_row8`, kernels/pointwise.cu): for many rows the output
    /// kept as its split alone (`LazySplit`), remade (if ever) from the new residual, which
    /// therefore goes to a new buffer; else x changed in place and the output written whole,
    /// with its split where the products take one.
    fn residual_norm(
        &self,
        x: &mut CudaTensor,
        w: &CudaSlice<f32>,
        eps: f32,
        launch: impl Fn(u64, u64, u64, SplitArg) -> Result<()>,
    ) -> Result<CudaTensor> {
        let (rows, cols) = (x.rows, x.cols);
        let split = self.products_split(rows, cols)?;
        if let Some(split) = self.kept_split(&split, rows) {
            let x_out = self.tensor(rows, cols)?;
            launch(
                self.ptr(&x.buf),
                self.ptr(&x_out.buf),
                0,
                SplitArg::of(Some(&split)),
            )?;
            let remake = LazySplit::Residual {
                x: x_out.buf.clone(),
                gains: self.ptr(w),
                eps,
            };
            *x = x_out;
            return Ok(CudaTensor::split_only(rows, cols, split, remake));
        }
        self.unshare(x)?;
        let mut out = self.tensor(rows, cols)?;
        out.split = split;
        if rows > 0 {
            let x_ptr = self.ptr(&x.buf);
            launch(
                x_ptr,
                x_ptr,
                self.ptr(&out.buf),
                SplitArg::of(out.split.as_deref()),
            )?;
        }
        Ok(out)
    }

    /// `t`'s buffer its own before an op changes it in place: a copy where a tensor kept as
    /// its split alone would remake its values from it (`LazySplit`), or a one-token row's
    /// lazy norm reads it (`LazyNorm`).
    fn unshare(&self, t: &mut CudaTensor) -> Result<()> {
        if t.buf.shared() {
            let own = self.tensor(t.rows, t.cols)?;
            self.copy::<f32>(self.ptr(&t.buf), self.ptr(&own.buf), t.rows * t.cols)?;
            t.buf = own.buf;
        }
        Ok(())
    }

    fn alloc_split(&self, rows: usize, cols: usize) -> Result<Split> {
        if !cols.is_multiple_of(64) {
            return Err(Error::Backend(format!(
                "tensor-core product over {cols} columns (a multiple of 64 expected)"
            )));
        }
        let n = rows * cols;
        Ok(Split {
            hi: self.tmp::<u16>(n)?,
            lo: self.tmp::<u16>(n)?,
            sum: self.tmp::<f32>(n / 64)?,
        })
    }

    fn split_with(
        &self,
        split_kernel: &CudaFunction,
        src: u64,
        rows: usize,
        cols: usize,
    ) -> Result<Split> {
        let split = self.alloc_split(rows, cols)?;
        let n = rows * cols;
        if n > 0 {
            launch!(
                self,
                split_kernel,
                elementwise(n / 8),
                [
                    src,
                    split.hi.ptr,
                    split.lo.ptr,
                    split.sum.ptr,
                    (n / 8) as i64,
                    cols as i32
                ]
            )?;
        }
        Ok(split)
    }

    /// `out = x @ w^T` on the tensor cores, `x` split (`out` is `[tokens, w.rows]`).
    /// The products of `tokens` split rows by up to four matrices of one bit width, in one
    /// launch on the tensor cores: the blocks of all of them share the GPU, so a matrix of a few
    /// rows (one tile) runs beside the others instead of after them.
    fn qmma(
        &self,
        x: &Split,
        cols: usize,
        ws: &[&CudaQMatrix],
        tokens: usize,
    ) -> Result<Vec<CudaTensor>> {
        self.qmma_parts(x, cols, ws, tokens, 0)
            .map(|(outs, _)| outs)
    }

    /// `qmma`, and with `part_min_groups` > 0 split along K where its tiles would leave SMs
    /// idle: into as many parts as fill them, of at least that many 64-column groups each
    /// (`DenseTiles`, kernels/qmma.cu). Each output then holds the parts' partial sums stacked,
    /// `[parts * tokens][rows]`, for a reader that adds them (`moe_route`); returns the parts.
    fn qmma_parts(
        &self,
        x: &Split,
        cols: usize,
        ws: &[&CudaQMatrix],
        tokens: usize,
        part_min_groups: usize,
    ) -> Result<(Vec<CudaTensor>, usize)> {
        let b = bits_index(ws[0].bits, &ws[0].name)?;
        let full = &self.k.products.main;
        let blocks: usize = ws
            .iter()
            .map(|w| w.rows.div_ceil(full.rows as usize) * tokens.div_ceil(full.slots as usize))
            .sum();
        let p = self.k.products.pick(blocks, b, self.sms);
        let row_tiles: usize = ws.iter().map(|w| w.rows.div_ceil(p.rows as usize)).sum();
        let tiles = row_tiles * tokens.div_ceil(p.slots as usize);
        // Parts of part_groups groups (the last may have fewer), a grid row each.
        let groups = cols / 64;
        let wanted = match part_min_groups {
            0 => 1,
            min => (p.per_sm[b] * self.sms / tiles.max(1)).min(groups / min),
        };
        let part_groups = groups.div_ceil(wanted.max(1)).max(1);
        let parts = groups.div_ceil(part_groups).max(1);
        let (batch, row_blocks, outs) = self.qbatch(cols, ws, p.rows as usize, parts * tokens)?;
        if tokens > 0 && row_blocks > 0 {
            let least_groups = groups - (parts - 1) * part_groups;
            // The split products run kernels of their own (`dense_parts`).
            let (f, label) = if parts > 1 {
                (&p.dense_parts[b], "p.dense_parts[b]")
            } else {
                (&p.dense[b], "p.dense[b]")
            };
            let grid = (p.blocks(tiles, least_groups, b, self.sms), parts as u32);
            let args: [&dyn KernelArg; 7] = [
                &batch,
                &x.hi.ptr,
                &x.lo.ptr,
                &x.sum.ptr,
                &(tokens as i32),
                &(cols as i32),
                &((part_groups * 64) as i32),
            ];
            let bytes = ws.iter().map(|w| qbytes(w.rows, w.cols, w.bits)).sum();
            // SAFETY: the arguments are q*_wgmma's (kernels/qmma.cu, QMMA_DENSE_KERNEL) in order,
            // the outputs sized by qbatch for parts * tokens rows.
            unsafe { self.launch(f, label, cfg(grid, p.threads[b], p.smem[b]), &args, bytes) }?;
        }
        Ok((outs, parts))
    }

    /// The expert products of `moe` on the tensor cores: the pairs (and the shared expert's
    /// tokens, when `shared[0]` is set) sorted by expert, each expert's weights read once per
    /// tile of 64 of its pairs (kernels/qmma.cu).
    fn moe_grouped(
        &self,
        dims: &MoeDims,
        x: &CudaTensor,
        rt: &CudaRouting,
        [gate, up, down]: [&CudaQMatrix; 3],
        [sgate, sup, sdown]: [QMatArg; 3],
        y: &DevBuf<f32>,
    ) -> Result<()> {
        let &MoeDims {
            tokens: t,
            hidden,
            experts: e,
            inter,
            inter_s,
            pairs,
            all,
            stride,
            with_shared,
            bits: b,
        } = dims;
        let groups = e + usize::from(with_shared);
        if groups > MAX_EXPERT_GROUPS {
            return Err(Error::Backend(format!(
                "moe: {e} experts; the grouped products take at most {}",
                MAX_EXPERT_GROUPS - 1
            )));
        }
        // Each expert's run of pairs is cut into tiles of `slots`: at most one partial tile each.
        let p = self.k.products.pick_grouped(all, groups);
        let max_tiles = all.div_ceil(p.slots as usize) + groups;
        let perm = self.tmp::<i32>(all)?;
        let tiles = self.tmp::<i32>(3 * max_tiles)?;
        let ntiles = self.tmp::<i32>(1)?;
        // Sorted in three launches (kernels/qmma.cu, moe_group_count): a rank per pair, and
        // per block of MOE_GROUP_PAIRS pairs a count (then a first index) per group.
        let count_blocks = pairs.div_ceil(MOE_GROUP_PAIRS);
        let rank = self.tmp::<i32>(pairs.max(1))?;
        let counts = self.tmp::<i32>((count_blocks * groups).max(1))?;
        let start = self.tmp::<i32>(groups)?;
        if pairs > 0 {
            launch!(
                self,
                self.k.moe_group_count,
                cfg((count_blocks as u32, 1), MOE_GROUP_PAIRS as u32, 0),
                [
                    self.ptr(&rt.ids),
                    pairs as i32,
                    groups as i32,
                    rank.ptr,
                    counts.ptr
                ]
            )?;
        }
        launch!(
            self,
            self.k.moe_group_scan,
            cfg((1, 1), 1024, 0),
            [
                counts.ptr,
                count_blocks as i32,
                t as i32,
                e as i32,
                i32::from(with_shared),
                p.slots as i32,
                start.ptr,
                tiles.ptr,
                ntiles.ptr
            ]
        )?;
        if all > 0 {
            launch!(
                self,
                self.k.moe_group_scatter,
                cfg((all.div_ceil(256) as u32, 1), 256, 0),
                [
                    self.ptr(&rt.ids),
                    rank.ptr,
                    counts.ptr,
                    start.ptr,
                    pairs as i32,
                    t as i32,
                    e as i32,
                    i32::from(with_shared),
                    perm.ptr
                ]
            )?;
        }
        drop((rank, counts, start));
        let xs = self.split_of(x)?;
        let expert_bytes = |rows, cols| {
            // Every expert's matrix is read at least once (an upper bound for sparse routing).
            e.min(pairs) as u64 * qbytes(rows, cols, gate.bits)
                + if with_shared {
                    qbytes(rows, cols, gate.bits)
                } else {
                    0
                }
        };
        // Per pair: the gate's products, then the up's from column `stride`.
        let gu = self.tmp::<f32>(all * 2 * stride)?;
        let row_tiles = 2 * stride.div_ceil(p.rows as usize);
        launch!(
            self,
            p.moe_gate_up[b],
            cfg(
                (p.blocks(max_tiles * row_tiles, hidden / 64, b, self.sms), 1),
                p.threads[b],
                p.smem[b]
            ),
            [
                self.qarg(gate),
                self.qarg(up),
                sgate,
                sup,
                perm.ptr,
                tiles.ptr,
                ntiles.ptr,
                xs.hi.ptr,
                xs.lo.ptr,
                xs.sum.ptr,
                gu.ptr,
                rt.top_k as i32,
                pairs as i32,
                e as i32,
                inter as i32,
                inter_s as i32,
                hidden as i32
            ],
            bytes = 2 * expert_bytes(inter, hidden)
        )?;
        drop(xs);
        let acts = self.swiglu_split(gu.ptr, all, stride)?;
        drop(gu);
        // The shared expert's tiles have inter_s columns, the routed experts' inter.
        let down_groups = if with_shared {
            inter.min(inter_s)
        } else {
            inter
        } / 64;
        let row_tiles = hidden.div_ceil(p.rows as usize);
        launch!(
            self,
            p.moe_down[b],
            cfg(
                (p.blocks(max_tiles * row_tiles, down_groups, b, self.sms), 1),
                p.threads[b],
                p.smem[b]
            ),
            [
                self.qarg(down),
                sdown,
                perm.ptr,
                tiles.ptr,
                ntiles.ptr,
                acts.hi.ptr,
                acts.lo.ptr,
                acts.sum.ptr,
                y.ptr,
                e as i32,
                inter as i32,
                inter_s as i32,
                hidden as i32
            ],
            bytes = expert_bytes(hidden, inter)
        )
    }

    /// `gdn_recurrence`; with `gate` (one token only), the output norm's g = y * w * silu(z)
    /// written in y's place and the partial sums of squares beside it (`GdnGate`,
    /// kernels/gdn.cu; its `g` is filled in here).
    #[allow(clippy::too_many_arguments)]
    fn gdn_recurrence_with(
        &self,
        qkv: &CudaTensor,
        a: &CudaTensor,
        b: &CudaTensor,
        [a_log, dt_bias]: [&CudaSlice<f32>; 2],
        s: &mut CudaGdnState,
        sh: &GdnShape,
        gate: Option<GdnGateArg>,
    ) -> Result<CudaTensor> {
        plain!(self, a, b);
        let t = qkv.rows;
        let chunked = self.gdn_chunked_fits(sh, t);
        // The chunked recurrence's prep takes the conv's input and applies it (`LazyConv`);
        // every other reader, the conv's output.
        let (qkv, qkv_ptr, conv) = match &qkv.lazy {
            Some(Lazy::Conv(c)) if chunked => (
                Plain::Borrowed(qkv),
                c.x.ptr,
                PrepConvArg {
                    taps: c.taps,
                    window: c.window.ptr,
                },
            ),
            _ => {
                let plain = self.plain(qkv)?;
                let ptr = self.ptr(&plain.buf);
                (plain, ptr, PrepConvArg::default())
            }
        };
        let (hk, hv, dk, dv) = (sh.key_heads, sh.value_heads, sh.key_dim, sh.value_dim);
        let variant = match dk {
            64 => 0,
            128 => 1,
            256 => 2,
            _ => usize::MAX,
        };
        if variant == usize::MAX || hk == 0 || hv % hk != 0 || (hv * dv) % 4 != 0 {
            return Err(Error::Backend(format!(
                "gdn: key dim {dk} with {hk} key and {hv} value heads of dim {dv} is not supported \
                 on CUDA (key dims 64, 128 or 256; value heads a multiple of key heads)"
            )));
        }
        if qkv.cols != sh.conv_channels() || a.cols != hv || b.cols != hv {
            return Err(Error::Backend(
                "gdn: input shapes do not match the layer".into(),
            ));
        }
        let y = self.tensor(t, hv * dv)?;
        let gate = match gate {
            Some(g) if t == 1 => GdnGateArg {
                g: self.ptr(&y.buf),
                ..g
            },
            Some(_) => {
                return Err(Error::Backend(
                    "gdn: the output norm is left lazy for one token only".into(),
                ));
            }
            None => GdnGateArg::default(),
        };
        if let Some(gdn_chunk) = self.k.gdn_chunked.as_ref().filter(|_| chunked) {
            // Per (chunk, value head): [W; gamma Q], Kd, U', P and the chunk's decay.
            let (c, chunks) = (GDN_CHUNK, t.div_ceil(GDN_CHUNK));
            let blocks = chunks * hv;
            let wq = self.tmp::<f32>(blocks * 2 * c * dk)?;
            let kd = self.tmp::<f32>(blocks * c * dk)?;
            let u = self.tmp::<f32>(blocks * c * dv)?;
            let p = self.tmp::<f32>(blocks * c * c)?;
            let gch = self.tmp::<f32>(blocks)?;
            // A block per value head, or per pair of them where pairs share a key head and
            // the pairs' blocks still fill the SMs: short prompts keep a block a head, twice
            // the blocks (at 256 tokens the pairs' 64 blocks lost 0.9%, run51).
            let pairs = (hv / hk) % 2 == 0 && chunks * hv / 2 >= self.sms;
            let heads = if pairs { 2 } else { 1 };
            launch!(
                self,
                gdn_chunk.prep[heads - 1],
                cfg(
                    (chunks as u32, (hv / heads) as u32),
                    256 * heads as u32,
                    gdn_prep_smem_bytes(dk, heads)
                ),
                [
                    qkv_ptr,
                    conv,
                    self.ptr(&a.buf),
                    self.ptr(&b.buf),
                    self.ptr(a_log),
                    self.ptr(dt_bias),
                    wq.ptr,
                    kd.ptr,
                    u.ptr,
                    p.ptr,
                    gch.ptr,
                    t as i32,
                    hk as i32,
                    hv as i32,
                    GDN_L2_EPS
                ]
            )?;
            launch!(
                self,
                gdn_chunk.state,
                cfg(
                    (hv as u32, (dv / GDN_STATE_ROWS) as u32),
                    256,
                    gdn_state_smem_bytes(dk)
                ),
                [
                    wq.ptr,
                    kd.ptr,
                    u.ptr,
                    p.ptr,
                    gch.ptr,
                    self.ptr(&s.state),
                    self.ptr(&y.buf),
                    t as i32,
                    hv as i32
                ]
            )?;
        } else if t > 0 {
            // 8 state rows per block, sixteen threads each.
            launch!(
                self,
                self.k.gdn_recurrence[variant],
                cfg((hv as u32, (dv as u32).div_ceil(8)), 128, 0),
                [
                    qkv_ptr,
                    self.ptr(&a.buf),
                    self.ptr(&b.buf),
                    self.ptr(a_log),
                    self.ptr(dt_bias),
                    self.ptr(&s.state),
                    self.ptr(&y.buf),
                    qkv.rows as i32,
                    hk as i32,
                    hv as i32,
                    dv as i32,
                    GDN_L2_EPS,
                    gate
                ]
            )?;
        }
        Ok(y)
    }

    fn qarg(&self, w: &CudaQMatrix) -> QMatArg {
        QMatArg {
            codes: self.ptr(&w.codes),
            scales: self.ptr(&w.scales),
            biases: self.ptr(&w.biases),
        }
    }

    /// The `QBatch` of up to four matrices reading one token of `cols` columns, at
    /// `rows_per_block` rows per block: the batch, its blocks, and the output rows it writes.
    fn qbatch(
        &self,
        cols: usize,
        ws: &[&CudaQMatrix],
        rows_per_block: usize,
        tokens: usize,
    ) -> Result<(QBatch, i32, Vec<CudaTensor>)> {
        let mut batch = QBatch::default();
        let mut blocks = 0i32;
        let mut outs = Vec::with_capacity(ws.len());
        for (m, w) in ws.iter().enumerate() {
            self.check_q(cols, w)?;
            let out = self.tensor(tokens, w.rows)?;
            batch.codes[m] = self.ptr(&w.codes);
            batch.scales[m] = self.ptr(&w.scales);
            batch.biases[m] = self.ptr(&w.biases);
            batch.y[m] = self.ptr(&out.buf);
            batch.rows[m] = w.rows as i32;
            batch.first_block[m] = blocks;
            batch.first_row[m + 1] = batch.first_row[m] + w.rows as i32;
            blocks += w.rows.div_ceil(rows_per_block) as i32;
            outs.push(out);
        }
        batch.first_block[ws.len()..].fill(blocks);
        let rows = batch.first_row[ws.len()];
        batch.first_row[ws.len() + 1..].fill(rows);
        Ok((batch, blocks, outs))
    }

    /// The matrix-vector variant (`GEMV_SHAPES`) for products of `cols` columns at `bits` bits,
    /// `rows` rows in all (over every matrix and copy of one launch). Rows of at most 16
    /// vectors of codes go four to a half warp; otherwise four rows per warp, unless that gives
    /// fewer than two blocks per SM (the GPU would idle): then one.
    fn gemv_variant(&self, rows: usize, cols: usize, bits: u32) -> GemvShape {
        let vecs = cols * bits as usize / 128;
        let variant = if vecs <= 16 {
            2
        } else if rows.div_ceil(GEMV_SHAPES[0].rows_per_block) >= 2 * self.sms {
            0
        } else {
            1
        };
        GEMV_SHAPES[variant]
    }

    /// cuLaunchKernelEx, with programmatic dependent launch if `pdl` (and the GPU has it:
    /// kernels wait with `pdl_wait`, kernels/common.cuh), so that a kernel's launch and its
    /// weight loads overlap the tail of the one before it.
    ///
    /// # Safety
    /// `params` must match the kernel's parameter list.
    unsafe fn launch_raw(
        &self,
        function: sys::CUfunction,
        cfg: &LaunchConfig,
        params: &mut [*mut std::ffi::c_void],
        pdl: bool,
    ) -> Result<()> {
        // SAFETY: an all-zero attribute is a valid "ignored" value; the id and value are set.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(pdl),
        };
        // SAFETY: `config` and `attr` outlive the call; the caller vouches for `params`.
        unsafe {
            sys::cuLaunchKernelEx(&config, function, params.as_mut_ptr(), std::ptr::null_mut())
        }
        .result()
        .map_err(driver("kernel launch"))
    }

    fn ptr(&self, b: &impl Raw) -> u64 {
        b.raw(&self.dev.stream)
    }

    fn cu_stream(&self) -> sys::CUstream {
        self.dev.stream.cu_stream()
    }

    fn recording(&self) -> bool {
        self.capturing.load(Ordering::Relaxed)
    }

    /// The device address of the recorded step's position, or null (0) for eager launches,
    /// which pass the position by value.
    fn pos_ptr(&self) -> u64 {
        if self.recording() {
            self.ptr(&self.params) + 4
        } else {
            0
        }
    }

    /// `n` uninitialised elements (at least one: zero-sized allocations are not allowed).
    fn alloc<T: DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: every buffer from here is written by a kernel or a copy before it is read.
        unsafe { self.dev.stream.alloc::<T>(n.max(1)) }.map_err(driver("allocation"))
    }

    /// A temporary of `n` elements: from the pool, or from the arena while recording.
    fn tmp<T: DeviceRepr>(&self, n: usize) -> Result<DevBuf<T>> {
        // While profiling, temporaries must outlive the step too: the profiler replays its
        // launches afterwards, and a pool buffer freed mid-step is reused by the next op (a
        // replayed expert product would then read garbage expert ids).
        if !self.recording() && !self.replayed() {
            return Ok(DevBuf::owned(self.alloc::<T>(n)?, n, &self.dev.stream));
        }
        let mut st = self.lock_step()?;
        let bytes = (n.max(1) * std::mem::size_of::<T>()).next_multiple_of(256);
        let base = match &st.arena {
            Some(a) if st.used + bytes <= a.len() => self.ptr(a),
            _ => {
                st.overflowed = true;
                return Err(Error::Backend("decode-step arena full".into()));
            }
        };
        let ptr = base + st.used as u64;
        st.used += bytes;
        Ok(DevBuf {
            ptr,
            len: n,
            _owned: None,
        })
    }

    fn lock_step(&self) -> Result<std::sync::MutexGuard<'_, StepState>> {
        self.step
            .lock()
            .map_err(|_| Error::Backend("decode-step lock poisoned".into()))
    }

    fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.dev
            .stream
            .alloc_zeros::<T>(n.max(1))
            .map_err(driver("allocation"))
    }

    fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        let mut buf = self.alloc::<T>(data.len())?;
        if !data.is_empty() {
            self.dev
                .stream
                .memcpy_htod(data, &mut buf)
                .map_err(driver("upload"))?;
        }
        Ok(buf)
    }

    fn tensor(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        Ok(CudaTensor::new(self.tmp(rows * cols)?, rows, cols))
    }

    /// `t` as plain values: a lazily normed row (`LazyNorm`, `LazyGate`) is normed now, and
    /// rows kept as their split alone are remade (`LazySplit`), into a new tensor.
    fn plain<'a>(&self, t: &'a CudaTensor) -> Result<Plain<'a>> {
        let Some(lazy) = &t.lazy else {
            return Ok(Plain::Borrowed(t));
        };
        let out = self.tensor(t.rows, t.cols)?;
        match lazy {
            Lazy::Split(remake) => {
                self.remake_rows(remake, t.cols, 0..t.rows, self.ptr(&out.buf))?
            }
            Lazy::Norm(n) => {
                let ptrs = [n.x.ptr, n.gains, 0, self.ptr(&out.buf)];
                self.launch_norm_rows(ptrs, SplitArg::default(), t.rows, t.cols, n.eps)?;
            }
            Lazy::Gate(g) => launch!(
                self,
                self.k.head_norm_apply,
                elementwise(t.cols),
                [g.g.ptr, g.arg(), self.ptr(&out.buf), t.cols as i32]
            )?,
            // The window it was made with is its own: none is written.
            Lazy::Conv(c) => self.launch_conv(
                [c.x.ptr, c.taps, c.window.ptr, 0, self.ptr(&out.buf)],
                t.rows,
                t.cols,
                c.kernel,
            )?,
        }
        Ok(Plain::Normed(out))
    }

    /// Rows `rows` of a tensor of `cols` columns kept as its split alone, remade into `out` by
    /// the arithmetic of the kernel that wrote the split, bit for bit (`LazySplit`).
    fn remake_rows(
        &self,
        remake: &LazySplit,
        cols: usize,
        rows: Range<usize>,
        out: u64,
    ) -> Result<()> {
        let n = rows.len();
        if n == 0 {
            return Ok(());
        }
        let at = 4 * (rows.start * cols) as u64;
        match remake {
            LazySplit::Residual { x, gains, eps } => launch!(
                self,
                self.k.rms_norm_row8,
                cfg((n as u32, 1), row8_threads(cols), 0),
                [x.ptr + at, *gains, out, cols as i32, *eps]
            ),
            LazySplit::Norm {
                x,
                gains,
                z,
                cols: head,
                eps,
            } => {
                // The writer's kernel (`norm_rows8_fits`) even for a few rows, which
                // `launch_norm_rows` would give another.
                let zp = z.as_ref().map_or(0, |z| z.ptr + at);
                let ptrs = [x.ptr + at, *gains, zp, out];
                self.launch_norm_rows8(ptrs, SplitArg::default(), n * cols / head, *head, *eps)
            }
            LazySplit::Gate { x, gate } => launch!(
                self,
                self.k.sigmoid_mul,
                elementwise(n * cols),
                [x.ptr + at, gate.ptr + at, out, (n * cols) as i64]
            ),
        }
    }

    /// `plain` in place.
    fn plain_mut(&self, t: &mut CudaTensor) -> Result<()> {
        // The caller changes t: a split of its old values must not outlive them.
        t.split = None;
        if let Plain::Normed(normed) = self.plain(t)? {
            *t = normed;
        }
        Ok(())
    }

    /// The address a matrix-vector kernel reads `t` from, and its `RowNorm` (kernels/quant.cu):
    /// a lazily normed row's x * gains and partial sums, or `t`'s plain values (made now for a
    /// `LazyGate` row: the returned `Plain` holds them until the launch) and none.
    fn row_input<'a>(&self, t: &'a CudaTensor) -> Result<(Plain<'a>, u64, RowNormArg)> {
        if let Some(Lazy::Norm(lazy)) = &t.lazy {
            let nrm = RowNormArg {
                partials: lazy.partials.ptr,
                count: lazy.partials.len as i32,
                n: t.cols as i32,
                eps: lazy.eps,
                _pad: 0,
            };
            return Ok((Plain::Borrowed(t), lazy.input.ptr, nrm));
        }
        let plain = self.plain(t)?;
        let ptr = plain.buf.ptr;
        Ok((plain, ptr, RowNormArg::default()))
    }

    /// One token's residual row `x` as the lazily normed row rmsnorm(x) * w, from what the
    /// kernel that wrote x left: x * w (`input`) and the block sums of squares (`partials`).
    fn lazy_norm(
        &self,
        x: &CudaTensor,
        LazyParts { input, partials }: LazyParts,
        w: &CudaSlice<f32>,
        eps: f32,
    ) -> CudaTensor {
        CudaTensor::lazy(
            x.cols,
            Lazy::Norm(LazyNorm {
                x: x.buf.clone(),
                input: input.buf,
                partials,
                gains: self.ptr(w),
                eps,
            }),
        )
    }

    /// Copies `n` elements between device addresses (stream-ordered).
    fn copy<T>(&self, src: u64, dst: u64, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        // SAFETY: callers pass addresses inside live buffers with room for `n` elements.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                dst,
                src,
                n * std::mem::size_of::<T>(),
                self.cu_stream(),
            )
        }
        .map_err(driver("device copy"))
    }

    /// Reads a buffer back to the host (waits for the stream).
    pub fn download_buf<T: DeviceRepr + Default + Clone>(&self, b: &DevBuf<T>) -> Result<Vec<T>> {
        let mut out = vec![T::default(); b.len];
        if b.len > 0 {
            // SAFETY: `out` has room for the buffer's elements; the copy completes before
            // `synchronize` returns, while `out` is alive.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut out, b.ptr, self.cu_stream()) }
                .map_err(driver("download"))?;
        }
        self.dev
            .stream
            .synchronize()
            .map_err(driver("synchronize"))?;
        Ok(out)
    }

    /// Makes room for `rows` positions in a KV cache (at most its max_seq), keeping its rows.
    fn reserve(&self, c: &mut CudaKvCache, rows: usize) -> Result<()> {
        let rows = rows.min(c.max_seq);
        if rows <= c.capacity {
            return Ok(());
        }
        if self.recording() {
            return Err(Error::Backend(
                "a KV cache grew while a decode step was being recorded".into(),
            ));
        }
        // Geometric growth, so appends stay amortised.
        let capacity = rows.max(2 * c.capacity).min(c.max_seq);
        *c = self.kv_copy(c, c.len, capacity, c.max_seq)?;
        Ok(())
    }

    /// A new cache of `capacity` positions holding the first `len` of `c` (`len` <= both).
    fn kv_copy(
        &self,
        c: &CudaKvCache,
        len: usize,
        capacity: usize,
        max_seq: usize,
    ) -> Result<CudaKvCache> {
        let k = self.alloc::<u16>(capacity * c.row)?;
        let v = self.alloc::<u16>(capacity * c.row)?;
        self.copy::<u16>(self.ptr(&c.k), self.ptr(&k), len * c.row)?;
        self.copy::<u16>(self.ptr(&c.v), self.ptr(&v), len * c.row)?;
        Ok(CudaKvCache {
            k,
            v,
            row: c.row,
            capacity,
            len,
            max_seq,
        })
    }

    /// Attention over the cache, multiplied by sigmoid(gate) when a gate is given: in the split
    /// merge's launch for decode, by `sigmoid_mul` after flash attention. With `prep` (one
    /// token), `q` is the q|gate projection and the split kernel preps it and the new key and
    /// value itself; the gate is q's.
    fn attention_with_gate(
        &self,
        q: &CudaTensor,
        gate: Option<&CudaTensor>,
        c: &CudaKvCache,
        sh: &AttnShape,
        pos0: usize,
        prep: Option<AttnPrepArg>,
    ) -> Result<CudaTensor> {
        let (t, h, d) = (q.rows, sh.heads, sh.head_dim);
        let q_cols = if prep.is_some() { 2 * h * d } else { h * d };
        let variant = match d {
            64 => 0,
            128 => 1,
            256 => 2,
            512 => 3,
            _ => usize::MAX,
        };
        if variant == usize::MAX
            || sh.kv_heads == 0
            || h % sh.kv_heads != 0
            || h / sh.kv_heads > 16
            || q.cols != q_cols
        {
            return Err(Error::Backend(format!(
                "attention: {h} heads of {d} over {} KV heads is not supported on CUDA \
                 (head dims 64, 128, 256 and 512 are, with up to 16 query heads per KV head)",
                sh.kv_heads
            )));
        }
        if c.len < pos0 + t {
            return Err(Error::Backend(format!(
                "attention over {} positions but the cache holds {}",
                pos0 + t,
                c.len
            )));
        }
        let out = self.tensor(t, h * d)?;
        if t == 0 {
            return Ok(out);
        }
        // Flash attention: the warpgroup form where it was loaded, else the mma.sync one.
        let flash = match self.k.attention_prefill_wg.get(variant) {
            Some(Some(wg)) => Some((wg, fa_wg_smem_bytes(d))),
            _ => self
                .k
                .attention_prefill
                .get(variant)
                .and_then(Option::as_ref)
                .map(|f| (f, fa_smem_bytes(d))),
        };
        if t >= FA_MIN_TOKENS
            && prep.is_none()
            && let Some((attention_prefill, smem)) = flash
        {
            launch!(
                self,
                attention_prefill,
                cfg(
                    ((t as u32).div_ceil(FA_QUERIES as u32), h as u32),
                    256,
                    smem
                ),
                [
                    self.ptr(&q.buf),
                    self.ptr(&c.k),
                    self.ptr(&c.v),
                    self.ptr(&out.buf),
                    t as i32,
                    h as i32,
                    sh.kv_heads as i32,
                    pos0 as i32
                ]
            )?;
            return match gate {
                Some(gate) => self.sigmoid_mul(&out, gate),
                None => Ok(out),
            };
        }
        // Split the keys so that the grid fills the GPU even for one query, without more
        // partial results than there are useful blocks. A recorded step sizes the grid for the
        // longest context of its bucket; the kernel spreads the keys the step has over it.
        let kv = sh.kv_heads;
        let bound = if self.recording() {
            self.bucket.load(Ordering::Relaxed).max(pos0 + t)
        } else {
            pos0 + t
        };
        let rows = t * h;
        let ng = (h / kv).div_ceil(8);
        let smem = attn_decode_smem_bytes(d, ng);
        let Some(attention_partial) = &self.k.attention_partial[ng - 1][variant] else {
            return Err(Error::Backend(format!(
                "attention: {} query heads per KV head of dim {d} need {smem} bytes of shared \
                 memory per block, more than this GPU gives",
                h / kv
            )));
        };
        let threads = 32 * attn_decode_warps(d) as u32;
        // As many blocks as the GPU holds at once, at most: a second wave would run the tail of
        // the keys after the first (as many an SM as its registers and shared memory allow:
        // two of 107 KiB for the 35B's head dim of 256). And 256 splits
        // at most: the merge kernel keeps one weight per split in shared memory. The kernel
        // divides the keys it actually has among the splits.
        let per_sm = attention_partial
            .occupancy_max_active_blocks_per_multiprocessor(threads, smem, None)
            .map_err(driver("attention occupancy"))? as usize;
        let max_splits = (per_sm.max(1) * self.sms / (t * kv)).clamp(1, 256);
        let splits = bound.div_ceil(self.attn_min_chunk).clamp(1, max_splits);
        let part = self.tmp::<f32>(rows * splits * (d + 2))?;
        launch!(
            self,
            attention_partial,
            cfg(((t * kv) as u32, splits as u32), threads, smem),
            [
                self.ptr(&q.buf),
                self.ptr(&c.k),
                self.ptr(&c.v),
                self.ptr(&part),
                h as i32,
                kv as i32,
                self.pos_ptr(),
                pos0 as i32,
                prep.unwrap_or_default()
            ]
        )?;
        // The gate rows: attn_prep's [T, H*D], or each head's second half of q|gate.
        let (gate, gate_stride) = match (prep, gate) {
            (Some(p), _) => (p.qg + 4 * d as u64, 2 * d),
            (None, Some(g)) => (self.ptr(&g.buf), d),
            (None, None) => (0, d),
        };
        launch!(
            self,
            self.k.attention_combine,
            cfg((rows as u32, (d / 32) as u32), 256, 0),
            [
                self.ptr(&part),
                gate,
                self.ptr(&out.buf),
                d as i32,
                splits as i32,
                gate_stride as i32
            ]
        )?;
        Ok(out)
    }

    /// Room in the cache for `rows` positions from `pos0` (which must continue or rewrite what
    /// it holds); returns the end position. The caller sets `len` after writing.
    fn kv_extend(&self, c: &mut CudaKvCache, rows: usize, pos0: usize) -> Result<usize> {
        let end = pos0 + rows;
        if end > c.max_seq {
            return Err(Error::invalid(format!(
                "sequence full: {end} positions exceed max_seq {}",
                c.max_seq
            )));
        }
        if pos0 > c.len {
            return Err(Error::Backend(format!(
                "KV cache write at position {pos0} but the cache holds {}",
                c.len
            )));
        }
        self.reserve(c, end)?;
        Ok(end)
    }

    /// RMS norm over rows of `cols` (whole rows or heads), optionally gated by silu(z). With
    /// `for_products` (the output is a product's input) it writes the output's split too, where
    /// the products would take one (`split_out`).
    fn norm_rows(
        &self,
        x: &CudaTensor,
        w: &CudaSlice<f32>,
        z: Option<&CudaTensor>,
        cols: usize,
        eps: f32,
        for_products: bool,
    ) -> Result<CudaTensor> {
        if cols == 0 || !x.cols.is_multiple_of(cols) || w.len() < cols {
            return Err(Error::Backend(format!(
                "rms_norm over {cols} of {} columns with {} gains",
                x.cols,
                w.len()
            )));
        }
        let groups = x.rows * x.cols / cols;
        let zp = z.map(|z| self.ptr(&z.buf)).unwrap_or(0);
        // The kernels split each of their rows: whole 64-column groups of them.
        let split = if for_products && cols.is_multiple_of(64) {
            self.products_split(x.rows, x.cols)?
        } else {
            None
        };
        // The split alone where the kernel writes it from its registers (`LazySplit`).
        let only = self.kept_split(&split, x.rows);
        if let Some(split) = only.filter(|_| norm_rows8_fits(groups, cols)) {
            let ptrs = [self.ptr(&x.buf), self.ptr(w), zp, 0];
            self.launch_norm_rows(ptrs, SplitArg::of(Some(&split)), groups, cols, eps)?;
            let remake = LazySplit::Norm {
                x: x.buf.clone(),
                gains: self.ptr(w),
                z: z.map(|z| z.buf.clone()),
                cols,
                eps,
            };
            return Ok(CudaTensor::split_only(x.rows, x.cols, split, remake));
        }
        let mut out = self.tensor(x.rows, x.cols)?;
        out.split = split;
        self.launch_norm_rows(
            [self.ptr(&x.buf), self.ptr(w), zp, self.ptr(&out.buf)],
            SplitArg::of(out.split.as_deref()),
            groups,
            cols,
            eps,
        )?;
        Ok(out)
    }

    /// `rms_norm_rows8` over `groups` rows of `cols` (8-column blocks a lane, min(32, cols / 8)
    /// lanes a row) at the addresses `[x, gains, z (0: none), out (0: the split alone)]`.
    fn launch_norm_rows8(
        &self,
        [x, w, zp, out]: [u64; 4],
        split: SplitArg,
        groups: usize,
        cols: usize,
        eps: f32,
    ) -> Result<()> {
        let rows_per_block = 256 / (cols / 8).min(32);
        launch!(
            self,
            self.k.rms_norm_rows8,
            cfg((groups.div_ceil(rows_per_block) as u32, 1), 256, 0),
            [x, w, zp, out, split, groups as i32, cols as i32, eps]
        )
    }

    /// `rms_norm`'s kernels over `groups` rows of `cols` at the addresses `[x, gains, z (0:
    /// none), out]`, and out's split where `split` says.
    fn launch_norm_rows(
        &self,
        [x, w, zp, out]: [u64; 4],
        split: SplitArg,
        groups: usize,
        cols: usize,
        eps: f32,
    ) -> Result<()> {
        // Many short rows (a prefill chunk's per-head norms) a warp each, eight to a block; long
        // rows, and the few of one decode token (where the block kernel is faster: 1.30 against
        // 2.04 us for 32 rows of 128), a block each.
        if groups >= SHORT_NORM_MIN_ROWS && cols <= SHORT_NORM_COLS {
            // 8-column blocks a lane, min(32, cols / 8) lanes a row, where whole rows fill a
            // warp; else a warp a row.
            if norm_rows8_fits(groups, cols) {
                self.launch_norm_rows8([x, w, zp, out], split, groups, cols, eps)?;
            } else {
                launch!(
                    self,
                    self.k.rms_norm_warp,
                    cfg((groups.div_ceil(8) as u32, 1), 256, 0),
                    [x, w, zp, out, split, groups as i32, cols as i32, eps]
                )?;
            }
        } else if groups > 0 {
            let threads = if cols >= 1024 { 256 } else { 128 };
            launch!(
                self,
                self.k.rms_norm,
                cfg((groups as u32, 1), threads, 0),
                [x, w, zp, out, split, cols as i32, eps]
            )?;
        }
        Ok(())
    }

    /// A quantized product, checked: `x [T, cols] -> [T, rows]`.
    fn check_q(&self, x_cols: usize, w: &CudaQMatrix) -> Result<usize> {
        if x_cols != w.cols {
            return Err(Error::Backend(format!(
                "qmatmul {}: input has {x_cols} columns, weight {}",
                w.name, w.cols
            )));
        }
        if !w.cols.is_multiple_of(64) || gemv_smem_bytes(w.cols) > SMEM_LIMIT {
            // The widest staged x that fits: gemv_smem_bytes(cols) = 4 * 17/16 * cols.
            let widest = SMEM_LIMIT * 4 / 17 / 64 * 64;
            return Err(Error::Backend(format!(
                "{}: {} columns are not supported by the CUDA products (multiples of 64 up to {widest})",
                w.name, w.cols
            )));
        }
        bits_index(w.bits, &w.name)
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type QMatrix = CudaQMatrix;
    type Vector = CudaSlice<f32>;
    type GdnState = CudaGdnState;
    type KvCache = CudaKvCache;
    type Routing = CudaRouting;

    fn name(&self) -> String {
        format!("cuda ({}, {})", self.dev.name, self.dev.arch)
    }

    fn upload_qmatrix(&self, w: QWeight) -> Result<CudaQMatrix> {
        bits_index(w.bits, &w.name)?;
        if w.group_size != 64 {
            return Err(Error::Backend(format!(
                "{}: group size {} has no CUDA kernel (64 does)",
                w.name, w.group_size
            )));
        }
        let scales: &[u16] = bytemuck::cast_slice(&w.scales[..]);
        let biases: &[u16] = bytemuck::cast_slice(&w.biases[..]);
        Ok(CudaQMatrix {
            codes: self.upload(&w.codes[..])?,
            scales: self.upload(scales)?,
            biases: self.upload(biases)?,
            rows: w.rows,
            cols: w.cols,
            bits: w.bits,
            name: w.name,
        })
    }

    fn upload_vector(&self, v: &[f32]) -> Result<CudaSlice<f32>> {
        self.upload(v)
    }

    fn upload_tensor(&self, data: &[f32], rows: usize, cols: usize) -> Result<CudaTensor> {
        if data.len() != rows * cols {
            return Err(Error::Backend(format!(
                "upload of {} values as [{rows}, {cols}]",
                data.len()
            )));
        }
        Ok(CudaTensor::new(
            DevBuf::owned(self.upload(data)?, data.len(), &self.dev.stream),
            rows,
            cols,
        ))
    }

    fn download(&self, t: &CudaTensor) -> Result<Vec<f32>> {
        plain!(self, t);
        self.download_buf(&t.buf)
    }

    fn tensor_shape(&self, t: &CudaTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn new_gdn_state(&self, s: &GdnShape) -> Result<CudaGdnState> {
        Ok(CudaGdnState {
            window: self.zeros((s.conv_kernel - 1) * s.conv_channels())?,
            state: self.zeros(s.value_heads * s.value_dim * s.key_dim)?,
        })
    }

    fn new_kv_cache(&self, s: &AttnShape, max_seq: usize) -> Result<CudaKvCache> {
        let row = s.kv_heads * s.head_dim;
        let capacity = max_seq.min(1024);
        Ok(CudaKvCache {
            k: self.alloc(capacity * row)?,
            v: self.alloc(capacity * row)?,
            row,
            capacity,
            len: 0,
            max_seq,
        })
    }

    fn reset_gdn_state(&self, s: &mut CudaGdnState) -> Result<()> {
        let st = &self.dev.stream;
        st.memset_zeros(&mut s.window).map_err(driver("memset"))?;
        st.memset_zeros(&mut s.state).map_err(driver("memset"))
    }

    fn clone_gdn_state(&self, s: &CudaGdnState) -> Result<CudaGdnState> {
        let st = &self.dev.stream;
        Ok(CudaGdnState {
            window: st.clone_dtod(&s.window).map_err(driver("copy"))?,
            state: st.clone_dtod(&s.state).map_err(driver("copy"))?,
        })
    }

    fn clone_kv_cache(&self, c: &CudaKvCache, len: usize, max_seq: usize) -> Result<CudaKvCache> {
        let len = len.min(c.len);
        let capacity = len.next_multiple_of(256).max(256).min(max_seq).max(len);
        self.kv_copy(c, len, capacity, max_seq)
    }

    fn gdn_state_bytes(&self, s: &CudaGdnState) -> usize {
        4 * (s.window.len() + s.state.len())
    }

    fn kv_cache_bytes(&self, c: &CudaKvCache) -> usize {
        2 * (c.k.len() + c.v.len())
    }

    fn embed(&self, table: &CudaQMatrix, tokens: &[u32]) -> Result<CudaTensor> {
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= table.rows) {
            return Err(Error::invalid(format!(
                "token id {bad} is outside the vocabulary of {} entries",
                table.rows
            )));
        }
        let b = bits_index(table.bits, &table.name)?;
        // A recorded step reads its token from `params` (written before each replay).
        let uploaded;
        let ids = if self.recording() && tokens.len() == 1 {
            self.ptr(&self.params)
        } else {
            let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
            uploaded = self.upload(&ids)?;
            self.ptr(&uploaded)
        };
        let out = self.tensor(tokens.len(), table.cols)?;
        if !tokens.is_empty() {
            launch!(
                self,
                self.k.embed[b],
                cfg((tokens.len() as u32, 1), 256, 0),
                [
                    self.ptr(&table.codes),
                    self.ptr(&table.scales),
                    self.ptr(&table.biases),
                    ids,
                    self.ptr(&out.buf),
                    table.cols as i32
                ]
            )?;
        }
        Ok(out)
    }

    fn rms_norm(&self, x: &CudaTensor, w: &CudaSlice<f32>, eps: f32) -> Result<CudaTensor> {
        plain!(self, x);
        self.norm_rows(x, w, None, x.cols, eps, true)
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        plain!(self, mut x);
        plain!(self, y);
        same_shape(x, y, "add")?;
        self.unshare(x)?;
        let n = x.rows * x.cols;
        launch!(
            self,
            self.k.add_assign,
            elementwise(n),
            [self.ptr(&x.buf), self.ptr(&y.buf), n as i64]
        )
    }

    fn qmatmul(&self, x: &CudaTensor, w: &CudaQMatrix) -> Result<CudaTensor> {
        // A few tokens stream the weights once per token (bandwidth-bound, like decode); more
        // run on the tensor cores, each tile of codes serving up to 64 tokens (`qbatch` checks
        // the matrix there).
        if x.rows >= MMA_MIN_TOKENS {
            let split = self.split_of(x)?;
            return products(self.qmma(&split, x.cols, &[w], x.rows)?).map(|[out]| out);
        }
        let b = self.check_q(x.cols, w)?;
        let (_x_held, x_ptr, nrm) = self.row_input(x)?;
        let out = self.tensor(x.rows, w.rows)?;
        if x.rows == 0 || w.rows == 0 {
            return Ok(out);
        }
        // Matrices of many rows (the lm_head) on two blocks per SM walking the rows (one
        // token's 4-bit ones on the integer tensor cores), the others one pass of the variant's
        // blocks.
        let stream =
            w.rows.div_ceil(GEMV_SHAPES[0].rows_per_block) >= STREAM_MIN_BLOCKS_PER_SM * self.sms;
        let qx = self
            .k
            .gemv_qx
            .as_ref()
            .filter(|_| stream && x.rows == 1 && w.bits == 4);
        let (f, label, blocks, smem) = if let Some(GemvQx { stream: f, .. }) = qx {
            let blocks = (2 * self.sms).min(w.rows.div_ceil(QX_STREAM_ROWS_PER_BLOCK));
            (f, "gemv_stream_qx", blocks, qx_smem_bytes(w.cols))
        } else if stream {
            (
                &self.k.gemv_stream[b],
                "gemv_stream[b]",
                2 * self.sms,
                gemv_smem_bytes(w.cols),
            )
        } else {
            let shape = self.gemv_variant(w.rows * x.rows, w.cols, w.bits);
            (
                &self.k.gemv[b][shape.variant],
                "gemv[b][variant]",
                w.rows.div_ceil(shape.rows_per_block),
                gemv_smem_bytes(w.cols),
            )
        };
        let args: [&dyn KernelArg; 6] = [
            &self.qarg(w),
            &x_ptr,
            &self.ptr(&out.buf),
            &(w.rows as i32),
            &(w.cols as i32),
            &nrm,
        ];
        // SAFETY: the kernels take (QMat w, const float* x, float* y, int rows, int cols,
        // RowNorm nrm), one token per blockIdx.y (the qx kernel one token), and `smem` of shared
        // memory (kernels/quant.cu).
        unsafe {
            self.launch(
                f,
                label,
                cfg((blocks as u32, x.rows as u32), 256, smem),
                &args,
                x.rows as u64 * qbytes(w.rows, w.cols, w.bits),
            )
        }?;
        Ok(out)
    }

    fn qmatmul_many(&self, x: &CudaTensor, ws: &[&CudaQMatrix]) -> Result<Vec<CudaTensor>> {
        self.products_and_conv(x, ws, ConvTailArg::default())
            .map(|(outs, _)| outs)
    }

    fn qmatmul_many_conv1d_silu(
        &self,
        x: &CudaTensor,
        ws: &[&CudaQMatrix],
        conv: &CudaSlice<f32>,
        state: &mut CudaGdnState,
        shape: &GdnShape,
    ) -> Result<Vec<CudaTensor>> {
        let channels = shape.conv_channels();
        // The products' writers take the conv of the first matrix's rows when it is the
        // channels (one token, the conv's kernel size the one they are built for).
        let fits = x.rows == 1
            && shape.conv_kernel == CONV_K_FUSED
            && ws.first().is_some_and(|w| w.rows == channels)
            && conv.len() == channels * CONV_K_FUSED
            && state.window.len() == channels * (CONV_K_FUSED - 1)
            && self.conv_in_products;
        let tail = if fits {
            ConvTailArg {
                taps: self.ptr(conv),
                window: self.ptr(&state.window),
                channels: channels as i32,
                _pad: 0,
            }
        } else {
            ConvTailArg::default()
        };
        let (mut outs, convolved) = self.products_and_conv(x, ws, tail)?;
        if convolved {
            return Ok(outs);
        }
        let Some(qkv) = outs.first_mut() else {
            return Err(Error::Backend(
                "qmatmul_many_conv1d_silu: no matrices".into(),
            ));
        };
        // Tokens that take the chunked recurrence leave the conv to its prep (`LazyConv`).
        let k = shape.conv_kernel;
        let lazy = self.gdn_chunked_fits(shape, x.rows)
            && k == GDN_PREP_CONV_K
            && qkv.lazy.is_none()
            && qkv.cols == channels
            && channels.is_multiple_of(4)
            && conv.len() == channels * k
            && state.window.len() == channels * (k - 1)
            && x.rows >= self.conv_in_prep_min_tokens;
        if !lazy {
            *qkv = self.conv1d_silu(qkv, conv, state, shape)?;
            return Ok(outs);
        }
        let saved = self.tmp::<f32>(channels * (k - 1))?;
        launch!(
            self,
            self.k.conv1d_window,
            cfg(((channels as u32).div_ceil(256), 1), 256, 0),
            [
                self.ptr(&qkv.buf),
                self.ptr(&state.window),
                saved.ptr,
                qkv.rows as i32,
                channels as i32,
                k as i32
            ]
        )?;
        *qkv = CudaTensor {
            buf: DevBuf::empty(),
            rows: qkv.rows,
            cols: channels,
            lazy: Some(Lazy::Conv(LazyConv {
                x: qkv.buf.clone(),
                taps: self.ptr(conv),
                window: saved,
                kernel: k,
            })),
            split: None,
        };
        Ok(outs)
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        w: &CudaSlice<f32>,
        eps: f32,
    ) -> Result<CudaTensor> {
        plain!(self, mut x);
        plain!(self, y);
        same_shape(x, y, "add_rms_norm")?;
        self.add_parts_rms_norm(x, self.ptr(&y.buf), 1, w, eps)
    }

    fn qmatmul_add_rms_norm(
        &self,
        y: &CudaTensor,
        p: &CudaQMatrix,
        x: &mut CudaTensor,
        w: &CudaSlice<f32>,
        eps: f32,
    ) -> Result<CudaTensor> {
        plain!(self, mut x);
        if x.rows != y.rows || x.cols != p.rows {
            return Err(Error::Backend(format!(
                "qmatmul_add_rms_norm: a {}x{} product of {} rows into a [{}, {}] residual",
                p.rows, p.cols, y.rows, x.rows, x.cols
            )));
        }
        // Many tokens on the tensor cores: the product split along K where its tiles would
        // leave SMs idle (an output projection's 128 tiles at 256 tokens, where the GPU holds
        // 264 such blocks), the residual add summing the parts.
        if y.rows >= MMA_MIN_TOKENS && self.out_part_min_groups > 0 {
            self.check_q(y.cols, p)?;
            let split = self.split_of(y)?;
            let (outs, parts) =
                self.qmma_parts(&split, y.cols, &[p], y.rows, self.out_part_min_groups)?;
            let [projected] = products(outs)?;
            return self.add_parts_rms_norm(x, self.ptr(&projected.buf), parts, w, eps);
        }
        // One token: the product and the residual add in one launch (`gemv_add_sumsq`,
        // kernels/quant.cu), the norm left lazy; unless the matrix is one that `qmatmul` walks
        // with a grid of two blocks per SM.
        let many_rows =
            p.rows.div_ceil(GEMV_SHAPES[0].rows_per_block) >= STREAM_MIN_BLOCKS_PER_SM * self.sms;
        if y.rows != 1 || many_rows {
            // `qmatmul` reads y as it is kept (its split alone, `LazySplit`).
            let projected = self.qmatmul(y, p)?;
            return self.add_rms_norm(x, &projected, w, eps);
        }
        let b = self.check_q(y.cols, p)?;
        check_row_norm(x.cols, w)?;
        let GemvShape {
            variant,
            rows_per_block,
        } = self.gemv_variant(p.rows, p.cols, p.bits);
        // A GDN output with its norm left lazy is normed per head as it is staged.
        let y_plain;
        let (f, label, y_ptr, head_norm) = match &y.lazy {
            Some(Lazy::Gate(g)) => (
                &self.k.gemv_add_sumsq_gated[b][variant],
                "gemv_add_sumsq_gated[b][variant]",
                g.g.ptr,
                g.arg(),
            ),
            _ => {
                y_plain = self.plain(y)?;
                (
                    &self.k.gemv_add_sumsq[b][variant],
                    "gemv_add_sumsq[b][variant]",
                    y_plain.buf.ptr,
                    HeadNormArg::default(),
                )
            }
        };
        let blocks = p.rows.div_ceil(rows_per_block);
        let sum = self.tensor(1, x.cols)?;
        let parts = LazyParts {
            input: self.tensor(1, x.cols)?,
            partials: self.tmp::<f32>(blocks)?,
        };
        let args: [&dyn KernelArg; 10] = [
            &self.qarg(p),
            &y_ptr,
            &head_norm,
            &self.ptr(&x.buf),
            &self.ptr(&sum.buf),
            &self.ptr(w),
            &self.ptr(&parts.input.buf),
            &parts.partials.ptr,
            &(p.rows as i32),
            &(p.cols as i32),
        ];
        // SAFETY: both kernels take (QMat w, const float* y, HeadNorm hn, const float* x_in,
        // float* x_out, const float* gains, float* xg, float* partials, int rows, int cols), a
        // grid of one block per ROWS_PER_BLOCK rows and gemv_smem_bytes(cols) of shared memory
        // (kernels/quant.cu).
        unsafe {
            self.launch(
                f,
                label,
                cfg((blocks as u32, 1), 256, gemv_smem_bytes(p.cols)),
                &args,
                qbytes(p.rows, p.cols, p.bits),
            )
        }?;
        *x = sum;
        Ok(self.lazy_norm(x, parts, w, eps))
    }

    fn swiglu(&self, g: &CudaTensor, u: &CudaTensor) -> Result<CudaTensor> {
        plain!(self, g, u);
        same_shape(g, u, "swiglu")?;
        let out = self.tensor(g.rows, g.cols)?;
        let n = g.rows * g.cols;
        launch!(
            self,
            self.k.swiglu,
            elementwise(n),
            [
                self.ptr(&g.buf),
                self.ptr(&u.buf),
                self.ptr(&out.buf),
                n as i64
            ]
        )?;
        Ok(out)
    }

    fn last_row(&self, x: &CudaTensor) -> Result<CudaTensor> {
        // One token's lazily normed row stays lazy (the lm_head's product takes it).
        if let (1, Some(Lazy::Norm(lazy))) = (x.rows, &x.lazy) {
            return Ok(CudaTensor::lazy(x.cols, Lazy::Norm(lazy.clone())));
        }
        // Rows kept as their split alone: only the last one remade.
        if let (Some(Lazy::Split(remake)), Some(last)) = (&x.lazy, x.rows.checked_sub(1)) {
            let out = self.tensor(1, x.cols)?;
            self.remake_rows(remake, x.cols, last..x.rows, self.ptr(&out.buf))?;
            return Ok(out);
        }
        plain!(self, x);
        let out = self.tensor(1, x.cols)?;
        let start = (x.rows.max(1) - 1) * x.cols;
        self.copy::<f32>(
            self.ptr(&x.buf) + 4 * start as u64,
            self.ptr(&out.buf),
            x.cols.min(x.rows * x.cols),
        )?;
        Ok(out)
    }

    fn argmax_rows(&self, x: &CudaTensor) -> Result<Vec<u32>> {
        plain!(self, x);
        if x.rows == 0 {
            return Ok(Vec::new());
        }
        // One packed (value, index) key per row, maximised by atomics across the row's blocks
        // (kernels/pointwise.cu); zero means no non-NaN value, index 0.
        let keys = self.tmp::<u64>(x.rows)?;
        // SAFETY: `keys` holds x.rows u64.
        unsafe {
            cudarc::driver::result::memset_d8_async(keys.ptr, 0, 8 * x.rows, self.cu_stream())
        }
        .map_err(driver("memset"))?;
        launch!(
            self,
            self.k.argmax_rows,
            cfg(
                ((x.cols.div_ceil(2048)).max(1) as u32, x.rows as u32),
                256,
                0
            ),
            [self.ptr(&x.buf), keys.ptr, x.cols as i32]
        )?;
        Ok(self
            .download_buf(&keys)?
            .into_iter()
            .map(|k| if k == 0 { 0 } else { u32::MAX - k as u32 })
            .collect())
    }

    fn sample(&self, logits: &CudaTensor, req: &DeviceSampling) -> Result<DeviceSample> {
        let Some(kernels) = &self.k.sample else {
            return Ok(DeviceSample::RowNeeded { penalised: false });
        };
        plain!(self, logits);
        if logits.rows != 1 || logits.cols == 0 || logits.cols > i32::MAX as usize {
            return Err(Error::Backend(format!(
                "sampling takes one logits row, got {} x {}",
                logits.rows, logits.cols
            )));
        }
        let p = req.params;
        // The penalties' ids and amounts, uploaded only when there are any (null pointers else:
        // the kernel reads none).
        let penalties = if req.penalties.is_empty() {
            None
        } else {
            let ids: Vec<u32> = req.penalties.iter().map(|&(t, _)| t).collect();
            let amounts: Vec<f32> = req.penalties.iter().map(|&(_, a)| a).collect();
            Some((self.upload(&ids)?, self.upload(&amounts)?))
        };
        let (ids, amounts) = penalties
            .as_ref()
            .map_or((0, 0), |(i, a)| (self.ptr(i), self.ptr(a)));
        let out = self.tmp::<i32>(2)?;
        let io = SampleIo {
            penalties: (ids, amounts, req.penalties.len() as i32),
            u: req.u,
            u_at: 0,
            out: out.ptr,
            params: 0,
            host_out: 0,
        };
        self.launch_sample(kernels, logits, p, &io)?;
        let got = self.download_buf(&out)?;
        Ok(if got[1] == 0 {
            DeviceSample::Chosen(got[0] as u32)
        } else {
            DeviceSample::RowNeeded {
                penalised: !req.penalties.is_empty(),
            }
        })
    }

    fn conv1d_silu(
        &self,
        x: &CudaTensor,
        w: &CudaSlice<f32>,
        s: &mut CudaGdnState,
        sh: &GdnShape,
    ) -> Result<CudaTensor> {
        plain!(self, x);
        let c = sh.conv_channels();
        if x.cols != c || !(2..=8).contains(&sh.conv_kernel) {
            return Err(Error::Backend(format!(
                "conv1d: {} channels (expected {c}), kernel {} (2 to 8 supported)",
                x.cols, sh.conv_kernel
            )));
        }
        let out = self.tensor(x.rows, c)?;
        let window = self.ptr(&s.window);
        let ptrs = [
            self.ptr(&x.buf),
            self.ptr(w),
            window,
            window,
            self.ptr(&out.buf),
        ];
        self.launch_conv(ptrs, x.rows, c, sh.conv_kernel)?;
        Ok(out)
    }

    fn gdn_recurrence(
        &self,
        qkv: &CudaTensor,
        a: &CudaTensor,
        b: &CudaTensor,
        a_log: &CudaSlice<f32>,
        dt_bias: &CudaSlice<f32>,
        s: &mut CudaGdnState,
        sh: &GdnShape,
    ) -> Result<CudaTensor> {
        self.gdn_recurrence_with(qkv, a, b, [a_log, dt_bias], s, sh, None)
    }

    fn gdn_recurrence_gated_norm(
        &self,
        qkv: &CudaTensor,
        a: &CudaTensor,
        b: &CudaTensor,
        [a_log, dt_bias, norm]: [&CudaSlice<f32>; 3],
        z: &CudaTensor,
        s: &mut CudaGdnState,
        sh: &GdnShape,
        eps: f32,
    ) -> Result<CudaTensor> {
        plain!(self, z);
        // One token: the recurrence writes y * w * silu(z) and its blocks' sums of squares, and
        // the norm is left to the output projection (`LazyGate`), for value heads whose columns
        // a vector of codes never straddles.
        let (hv, dv) = (sh.value_heads, sh.value_dim);
        let parts = dv.div_ceil(8);
        let lazy = qkv.rows == 1
            && dv.is_multiple_of(32)
            && z.rows == 1
            && z.cols == hv * dv
            && norm.len() >= dv;
        if !lazy {
            let y = self.gdn_recurrence(qkv, a, b, a_log, dt_bias, s, sh)?;
            return self.gated_rms_norm(&y, z, norm, dv, eps);
        }
        let partials = self.tmp::<f32>(hv * parts)?;
        let gate = GdnGateArg {
            z: self.ptr(&z.buf),
            gains: self.ptr(norm),
            g: 0,
            partials: partials.ptr,
        };
        let g = self.gdn_recurrence_with(qkv, a, b, [a_log, dt_bias], s, sh, Some(gate))?;
        Ok(CudaTensor::lazy(
            g.cols,
            Lazy::Gate(LazyGate {
                g: g.buf,
                partials,
                parts,
                dim: dv,
                eps,
            }),
        ))
    }

    fn gated_rms_norm(
        &self,
        y: &CudaTensor,
        z: &CudaTensor,
        w: &CudaSlice<f32>,
        dim: usize,
        eps: f32,
    ) -> Result<CudaTensor> {
        plain!(self, y, z);
        same_shape(y, z, "gated_rms_norm")?;
        self.norm_rows(y, w, Some(z), dim, eps, true)
    }

    fn split_q_gate(
        &self,
        qg: &CudaTensor,
        heads: usize,
        d: usize,
    ) -> Result<(CudaTensor, CudaTensor)> {
        plain!(self, qg);
        if qg.cols != 2 * heads * d {
            return Err(Error::Backend(format!(
                "split_q_gate: {} columns for {heads} heads of {d}",
                qg.cols
            )));
        }
        let q = self.tensor(qg.rows, heads * d)?;
        let g = self.tensor(qg.rows, heads * d)?;
        let n = qg.rows * heads * d;
        launch!(
            self,
            self.k.split_q_gate,
            elementwise(n),
            [
                self.ptr(&qg.buf),
                self.ptr(&q.buf),
                self.ptr(&g.buf),
                qg.rows as i32,
                heads as i32,
                d as i32
            ]
        )?;
        Ok((q, g))
    }

    fn head_rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaSlice<f32>,
        dim: usize,
        eps: f32,
    ) -> Result<CudaTensor> {
        plain!(self, x);
        self.norm_rows(x, w, None, dim, eps, false)
    }

    fn rope(&self, x: &mut CudaTensor, sh: &AttnShape, pos0: usize) -> Result<()> {
        plain!(self, mut x);
        let d = sh.head_dim;
        if d == 0
            || !x.cols.is_multiple_of(d)
            || !sh.rotary_dim.is_multiple_of(2)
            || sh.rotary_dim > d
        {
            return Err(Error::Backend(format!(
                "rope: {} columns, head dim {d}, rotary dim {}",
                x.cols, sh.rotary_dim
            )));
        }
        let heads = x.cols / d;
        let n = x.rows * heads * sh.rotary_dim / 2;
        if n == 0 {
            return Ok(());
        }
        launch!(
            self,
            self.k.rope,
            elementwise(n),
            [
                self.ptr(&x.buf),
                x.rows as i32,
                heads as i32,
                d as i32,
                sh.rotary_dim as i32,
                sh.rope_theta,
                self.pos_ptr(),
                pos0 as i32
            ]
        )
    }

    fn kv_append(
        &self,
        c: &mut CudaKvCache,
        k: &CudaTensor,
        v: &CudaTensor,
        pos0: usize,
    ) -> Result<()> {
        plain!(self, k, v);
        same_shape(k, v, "kv_append")?;
        if k.cols != c.row {
            return Err(Error::Backend(format!(
                "kv_append: rows of {} values, cache rows of {}",
                k.cols, c.row
            )));
        }
        let end = self.kv_extend(c, k.rows, pos0)?;
        let n = k.rows * c.row;
        launch!(
            self,
            self.k.kv_write,
            elementwise(n),
            [
                self.ptr(&k.buf),
                self.ptr(&v.buf),
                self.ptr(&c.k),
                self.ptr(&c.v),
                n as i64,
                c.row as i32,
                self.pos_ptr(),
                pos0 as i32
            ]
        )?;
        c.len = end;
        Ok(())
    }

    fn attn_prep(
        &self,
        qg: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        [q_norm, k_norm]: [&CudaSlice<f32>; 2],
        c: &mut CudaKvCache,
        sh: &AttnShape,
        pos0: usize,
        eps: f32,
    ) -> Result<(CudaTensor, CudaTensor)> {
        plain!(self, qg, k, v);
        check_attn_prep(qg, k, v, [q_norm, k_norm], c, sh)?;
        let (h, kvh, d) = (sh.heads, sh.kv_heads, sh.head_dim);
        let end = self.kv_extend(c, k.rows, pos0)?;
        let q = self.tensor(qg.rows, h * d)?;
        let gate = self.tensor(qg.rows, h * d)?;
        // A warp a row where the head fits one warp's registers (norm_rotate_row's rotation
        // keeps a pair in one lane: rotary dims a multiple of 64); else a block a row.
        let attn_prep_rows = match d {
            64 => Some(&self.k.attn_prep_rows[0]),
            128 => Some(&self.k.attn_prep_rows[1]),
            256 => Some(&self.k.attn_prep_rows[2]),
            _ => None,
        }
        .filter(|_| sh.rotary_dim.is_multiple_of(64) && sh.rotary_dim <= d);
        let t = qg.rows;
        if t > 0 {
            let (f, label, grid, angles) = match attn_prep_rows {
                Some(f) => {
                    // (cos, sin) of each token's rotary / 2 dim pairs, shared by its rows.
                    let half = sh.rotary_dim / 2;
                    let angles = self.tmp::<f32>((2 * t * half).max(1))?;
                    if half > 0 {
                        launch!(
                            self,
                            self.k.rope_angles,
                            elementwise(t * half),
                            [
                                angles.ptr,
                                t as i32,
                                sh.rotary_dim as i32,
                                sh.rope_theta,
                                self.pos_ptr(),
                                pos0 as i32
                            ]
                        )?;
                    }
                    let grid = cfg((t as u32, (h + kvh).div_ceil(8) as u32), 256, 0);
                    (f, "attn_prep_rows", grid, Some(angles))
                }
                None => {
                    let grid = cfg((t as u32, (h + kvh) as u32), 128, 4 * d);
                    (&self.k.attn_prep, "attn_prep", grid, None)
                }
            };
            let angles_ptr = angles.as_ref().map_or(0, |a| a.ptr);
            let args: [&dyn KernelArg; 18] = [
                &self.ptr(&qg.buf),
                &self.ptr(&k.buf),
                &self.ptr(&v.buf),
                &self.ptr(q_norm),
                &self.ptr(k_norm),
                &self.ptr(&q.buf),
                &self.ptr(&gate.buf),
                &self.ptr(&c.k),
                &self.ptr(&c.v),
                &(h as i32),
                &(kvh as i32),
                &(d as i32),
                &(sh.rotary_dim as i32),
                &sh.rope_theta,
                &eps,
                &self.pos_ptr(),
                &(pos0 as i32),
                &angles_ptr,
            ];
            // SAFETY: attn_prep takes (const float* qg, k, v, q_norm, k_norm, float* q, g,
            // u16* kc, vc, int heads, kv_heads, d, rotary, double theta, float eps,
            // const int* pos_ptr, int pos0) and d floats of shared memory; attn_prep_rows the
            // same and const float2* angles, [t][rotary / 2] written just before
            // (kernels/attention.cu). The caches hold `end` positions (kv_extend).
            let nargs = if angles.is_some() { 18 } else { 17 };
            unsafe { self.launch(f, label, grid, &args[..nargs], 0) }?;
        }
        c.len = end;
        Ok((q, gate))
    }

    fn attention(
        &self,
        q: &CudaTensor,
        c: &CudaKvCache,
        sh: &AttnShape,
        pos0: usize,
    ) -> Result<CudaTensor> {
        plain!(self, q);
        self.attention_with_gate(q, None, c, sh, pos0, None)
    }

    fn attention_gated(
        &self,
        q: &CudaTensor,
        gate: &CudaTensor,
        c: &CudaKvCache,
        sh: &AttnShape,
        pos0: usize,
    ) -> Result<CudaTensor> {
        plain!(self, q, gate);
        same_shape(q, gate, "attention_gated")?;
        self.attention_with_gate(q, Some(gate), c, sh, pos0, None)
    }

    fn attention_prepped_gated(
        &self,
        qg: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        [q_norm, k_norm]: [&CudaSlice<f32>; 2],
        c: &mut CudaKvCache,
        sh: &AttnShape,
        pos0: usize,
        eps: f32,
    ) -> Result<CudaTensor> {
        plain!(self, qg, k, v);
        // One token's prep in the decode attention's blocks: head dims up to 256, and a
        // rotation whose pairs lie in one lane (rotary dims a multiple of 64).
        let d = sh.head_dim;
        let in_attention = qg.rows == 1
            && matches!(d, 64 | 128 | 256)
            && sh.rotary_dim.is_multiple_of(64)
            && self.prep_in_attention;
        if !in_attention {
            let (q, gate) = self.attn_prep(qg, k, v, [q_norm, k_norm], c, sh, pos0, eps)?;
            return self.attention_gated(&q, &gate, c, sh, pos0);
        }
        check_attn_prep(qg, k, v, [q_norm, k_norm], c, sh)?;
        // The new row is written by the attention's launch, which reads the cache up to it.
        c.len = self.kv_extend(c, 1, pos0)?;
        let prep = AttnPrepArg {
            qg: self.ptr(&qg.buf),
            k: self.ptr(&k.buf),
            v: self.ptr(&v.buf),
            q_norm: self.ptr(q_norm),
            k_norm: self.ptr(k_norm),
            theta: sh.rope_theta,
            rotary: sh.rotary_dim as i32,
            eps,
        };
        self.attention_with_gate(qg, None, c, sh, pos0, Some(prep))
    }

    fn sigmoid_mul(&self, x: &CudaTensor, gate: &CudaTensor) -> Result<CudaTensor> {
        plain!(self, x, gate);
        same_shape(x, gate, "sigmoid_mul")?;
        // Many tokens: the output gate's product input, kept as its split alone (`LazySplit`).
        let n = x.rows * x.cols;
        let split = self.products_split(x.rows, x.cols)?;
        let launch_split = |out: u64, split: &Split| {
            launch!(
                self,
                self.k.sigmoid_mul_split,
                elementwise(n / 8),
                [
                    self.ptr(&x.buf),
                    self.ptr(&gate.buf),
                    out,
                    SplitArg::of(Some(split)),
                    (n / 8) as i64
                ]
            )
        };
        if let Some(split) = self.kept_split(&split, x.rows) {
            launch_split(0, &split)?;
            let remake = LazySplit::Gate {
                x: x.buf.clone(),
                gate: gate.buf.clone(),
            };
            return Ok(CudaTensor::split_only(x.rows, x.cols, split, remake));
        }
        let mut out = self.tensor(x.rows, x.cols)?;
        if let Some(split) = split {
            launch_split(self.ptr(&out.buf), &split)?;
            out.split = Some(split);
            return Ok(out);
        }
        launch!(
            self,
            self.k.sigmoid_mul,
            elementwise(n),
            [
                self.ptr(&x.buf),
                self.ptr(&gate.buf),
                self.ptr(&out.buf),
                n as i64
            ]
        )?;
        Ok(out)
    }

    fn route(&self, logits: &CudaTensor, top_k: usize, renormalize: bool) -> Result<CudaRouting> {
        plain!(self, logits);
        let e = logits.cols;
        check_routing(e, top_k)?;
        let t = logits.rows;
        let rt = self.routing_of(t, top_k, e)?;
        self.launch_route(self.ptr(&logits.buf), &rt, renormalize)?;
        Ok(rt)
    }

    fn route_tokens(
        &self,
        h: &CudaTensor,
        router: &CudaQMatrix,
        shared_gate: &CudaQMatrix,
        top_k: usize,
        renormalize: bool,
    ) -> Result<(CudaRouting, CudaTensor)> {
        let e = router.rows;
        check_routing(e, top_k)?;
        if h.rows >= MMA_MIN_TOKENS
            && self.router_part_min_groups > 0
            && router.bits == shared_gate.bits
        {
            return self.route_tokens_in_parts(h, router, shared_gate, top_k, renormalize);
        }
        // One token: both products in one launch, the routing left to the expert gate/up
        // kernel that reads it (`CudaRouting::deferred`).
        if h.rows != 1 || router.bits != shared_gate.bits {
            return route_tokens_separately(self, h, router, shared_gate, top_k, renormalize);
        }
        let b = self.check_q(h.cols, router)?;
        let (batch, blocks, outs) = self.qbatch(
            h.cols,
            &[router, shared_gate],
            GEMV_SHAPES[1].rows_per_block,
            1,
        )?;
        let [logits, shared_gate_logit] = products(outs)?;
        let (_h_held, h_ptr, nrm) = self.row_input(h)?;
        // The product alone; the expert gate/up kernel routes its logits (`deferred`).
        launch!(
            self,
            self.k.gemv_batch[b][1],
            cfg((blocks as u32, 1), 256, gemv_smem_bytes(h.cols)),
            [batch, h_ptr, h.cols as i32, nrm],
            bytes = qbytes(router.rows, router.cols, router.bits)
                + qbytes(shared_gate.rows, shared_gate.cols, shared_gate.bits)
        )?;
        let routing = self.routing_of(1, top_k, e)?;
        routing.deferred.set(Some(DeferredRoute {
            logits,
            renormalize,
        }));
        Ok((routing, shared_gate_logit))
    }

    fn moe_experts(
        &self,
        x: &CudaTensor,
        rt: &CudaRouting,
        gate: &CudaQMatrix,
        up: &CudaQMatrix,
        down: &CudaQMatrix,
    ) -> Result<CudaTensor> {
        self.moe(x, rt, [gate, up, down], None)
    }

    fn moe_block(
        &self,
        h: &CudaTensor,
        rt: &CudaRouting,
        experts: [&CudaQMatrix; 3],
        shared: [&CudaQMatrix; 3],
        shared_gate_logit: &CudaTensor,
    ) -> Result<CudaTensor> {
        self.moe(h, rt, experts, Some((shared, shared_gate_logit)))
    }

    fn moe_block_add_rms_norm(
        &self,
        x: &mut CudaTensor,
        h: &CudaTensor,
        rt: &CudaRouting,
        experts: [&CudaQMatrix; 3],
        shared: [&CudaQMatrix; 3],
        shared_gate_logit: &CudaTensor,
        w: &CudaSlice<f32>,
        eps: f32,
    ) -> Result<CudaTensor> {
        plain!(self, mut x);
        same_shape(x, h, "moe_block_add_rms_norm")?;
        check_row_norm(x.cols, w)?;
        // One token: the new residual in a buffer of its own, its norm left lazy, if
        // `moe_down_mix` takes the products.
        let mixed = if x.rows == 1 {
            let sum = self.tensor(1, x.cols)?;
            let parts = LazyParts {
                input: self.tensor(1, x.cols)?,
                partials: self.tmp::<f32>(x.cols.div_ceil(MIX_ROWS_PER_BLOCK))?,
            };
            Some((sum, parts))
        } else {
            None
        };
        let mix = mixed.as_ref().map(|(sum, parts)| MixInto {
            x_in: self.ptr(&x.buf),
            x_out: self.ptr(&sum.buf),
            gains: self.ptr(w),
            input: self.ptr(&parts.input.buf),
            partials: parts.partials.ptr,
        });
        let shared = Some((shared, shared_gate_logit));
        let (y, logit) = match self.moe_products(h, rt, experts, shared, mix)? {
            MoeOut::Rows(y, logit) => (y, logit),
            MoeOut::Mixed => {
                let (sum, parts) = mixed.ok_or_else(|| {
                    Error::Backend("moe_block_add_rms_norm: mixed without a residual".into())
                })?;
                *x = sum;
                return Ok(self.lazy_norm(x, parts, w, eps));
            }
        };
        // The mixing kernel takes an 8-column block a thread, at most 256 threads
        // (kernels/pointwise.cu).
        if !x.cols.is_multiple_of(NORM_PER_THREAD) || x.cols > NORM_PER_THREAD * 256 {
            let moe = self.combine(&y, logit, rt, x.rows, x.cols)?;
            return self.add_rms_norm(x, &moe, w, eps);
        }
        let (rows, cols) = (x.rows, x.cols);
        let launch = |x_in: u64, x_out: u64, out: u64, split: SplitArg| {
            launch!(
                self,
                self.k.moe_combine_add_rms_norm,
                cfg((rows as u32, 1), row8_threads(cols), 0),
                [
                    y.ptr,
                    self.ptr(&rt.weights),
                    logit,
                    x_in,
                    x_out,
                    self.ptr(w),
                    out,
                    split,
                    cols as i32,
                    rt.top_k as i32,
                    eps
                ]
            )
        };
        self.residual_norm(x, w, eps, launch)
    }

    fn add_sigmoid_gated(
        &self,
        out: &mut CudaTensor,
        y: &CudaTensor,
        gate_logit: &CudaTensor,
    ) -> Result<()> {
        plain!(self, mut out);
        plain!(self, y, gate_logit);
        same_shape(out, y, "add_sigmoid_gated")?;
        if gate_logit.rows != out.rows || gate_logit.cols != 1 {
            return Err(Error::Backend(
                "add_sigmoid_gated: one gate logit per row expected".into(),
            ));
        }
        self.unshare(out)?;
        let n = out.rows * out.cols;
        launch!(
            self,
            self.k.add_sigmoid_gated,
            elementwise(n),
            [
                self.ptr(&out.buf),
                self.ptr(&y.buf),
                self.ptr(&gate_logit.buf),
                out.rows as i32,
                out.cols as i32
            ]
        )
    }

    fn default_cache_bytes(&self) -> Option<usize> {
        let _ = self.dev.ctx.bind_to_thread();
        cudarc::driver::result::mem_get_info()
            .ok()
            .map(|(free, _)| free / 4)
    }

    fn prefill_chunk(&self) -> usize {
        PREFILL_CHUNK
    }

    fn leave_out_of_decode(&self, label: &str) -> Result<()> {
        if !self.graphs {
            // Only recorded steps leave it out: eager steps would time the whole step.
            return Err(Error::Invalid(format!(
                "leaving `{label}` out: decode steps are not recorded (LILY_CUDA_GRAPHS=0)"
            )));
        }
        if label.is_empty() {
            return Err(Error::Invalid(
                "leaving kernels out: the label prefix is empty (it would leave out every kernel)"
                    .into(),
            ));
        }
        self.left_out.set(label.to_string()).map_err(|_| {
            Error::Invalid(format!(
                "leaving `{label}` out: `{}` is left out already",
                self.left_out.get().map_or("", |l| l.as_str())
            ))
        })?;
        // Steps recorded before now launched it: record again.
        let mut st = self.lock_step()?;
        st.graph = None;
        Ok(())
    }

    fn profile(
        &self,
        mode: ProfileMode,
        run: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Option<Vec<KernelCost>>> {
        let in_place = mode == ProfileMode::InPlace;
        if !in_place {
            // The traced step's temporaries go to the arena (see `tmp`); the recorded step
            // that owned it is dropped and recorded again at the next decode step.
            let mut st = self.lock_step()?;
            st.graph = None;
            st.used = 0;
            if st.arena.is_none() {
                st.arena = Some(self.alloc::<u8>(ARENA_BYTES)?);
            }
        }
        *self
            .trace
            .lock()
            .map_err(|_| Error::Backend("trace lock".into()))? = Some(Vec::new());
        self.in_place.store(in_place, Ordering::Relaxed);
        self.tracing.store(true, Ordering::Relaxed);
        let ran = run();
        self.tracing.store(false, Ordering::Relaxed);
        self.in_place.store(false, Ordering::Relaxed);
        let traced = self
            .trace
            .lock()
            .map_err(|_| Error::Backend("trace lock".into()))?
            .take()
            .unwrap_or_default();
        ran?;
        self.dev.synchronize()?;
        let mut costs: Vec<KernelCost> = Vec::new();
        for t in &traced {
            let micros = match &t.events {
                Some((start, stop)) => {
                    start.elapsed_ms(stop).map_err(driver("event"))? as f64 * 1e3
                }
                None => self.time_alone(t)?,
            };
            let name = format!(
                "{} grid {}x{} block {}",
                t.label, t.cfg.grid_dim.0, t.cfg.grid_dim.1, t.cfg.block_dim.0
            );
            match costs.iter_mut().find(|c| c.kernel == name) {
                Some(c) => {
                    c.launches += 1;
                    c.micros += micros;
                    c.weight_bytes += t.bytes;
                }
                None => costs.push(KernelCost {
                    kernel: name,
                    launches: 1,
                    micros,
                    weight_bytes: t.bytes,
                }),
            }
        }
        costs.sort_by(|a, b| b.micros.total_cmp(&a.micros));
        Ok(Some(costs))
    }

    fn decode_step(
        &self,
        state: &mut DecodeState<Self>,
        token: u32,
        forward: &mut dyn FnMut(&mut DecodeState<Self>) -> Result<CudaTensor>,
    ) -> Result<CudaTensor> {
        if !self.graphs || state.pos >= state.max_seq || self.tracing.load(Ordering::Relaxed) {
            return forward(state);
        }
        let logits = self.run_step(state, Some(token), StepEnd::Logits, forward)?;
        Ok(logits_view(logits))
    }

    fn chains_decode(&self, p: &SamplingParams) -> bool {
        self.graphs
            && self.chains
            && !self.tracing.load(Ordering::Relaxed)
            && ((p.is_greedy() && !p.has_penalties()) || self.k.sample.is_some())
    }

    fn queue_decode_step(
        &self,
        state: &mut DecodeState<Self>,
        input: StepInput,
        choice: &DeviceSampling,
        forward: &mut StepForward<'_, Self>,
    ) -> Result<QueuedStep> {
        if !self.chains_decode(choice.params) {
            return Err(Error::Backend(
                "these sampling parameters are not chained on this device".into(),
            ));
        }
        if !choice.penalties.is_empty() {
            return Err(Error::Backend(
                "a chained step counts the generated tokens itself: it takes their counts \
                 (`generated`), not the penalties' amounts"
                    .into(),
            ));
        }
        let pos = state.pos;
        if pos >= state.max_seq {
            return Err(Error::invalid(format!(
                "the context is full ({} positions)",
                state.max_seq
            )));
        }
        let slot = pos & 1;
        self.chain.chosen.clear(slot);
        if !choice.params.is_greedy() {
            self.upload_to(&self.chain.draw, &[choice.u])?;
        }
        let token = match input {
            StepInput::Host(t) => Some(t),
            StepInput::Chosen => None,
        };
        if choice.params.has_penalties() {
            self.start_generated_counts(state.max_seq, token, choice.generated)?;
        }
        // The recording's embedding reads the token from `params`: 0 stands in for it.
        let stand_in = token.unwrap_or(0);
        self.run_step(state, token, StepEnd::Chosen(choice), &mut |st| {
            forward(st, stand_in)
        })?;
        self.chain.done[slot]
            .record(&self.dev.stream)
            .map_err(driver("event"))?;
        Ok(QueuedStep { pos })
    }

    fn chosen_token(&self, step: QueuedStep) -> Result<u32> {
        let slot = step.pos & 1;
        self.chain.done[slot]
            .synchronize()
            .map_err(driver("waiting for a decode step"))?;
        let [token, status, pos] = self.chain.chosen.read(slot);
        if pos < 0 || pos as usize != step.pos {
            return Err(Error::Backend(format!(
                "the chained decode step at position {} left no token (its slot holds position {pos})",
                step.pos
            )));
        }
        if status != 0 {
            return Err(Error::Backend(
                "the device sampler asked for the logits row in a chained decode step".into(),
            ));
        }
        Ok(token as u32)
    }
}

impl CudaBackend {
    /// Replays the recorded decode step feeding `token` (or, with `None`, the token the previous
    /// chained step chose, already in `params`) at `state.pos`, recording it first where the
    /// recording is missing or stale; returns the recorded logits `(pointer, columns)`.
    fn run_step(
        &self,
        state: &mut DecodeState<Self>,
        token: Option<u32>,
        end: StepEnd,
        forward: &mut dyn FnMut(&mut DecodeState<Self>) -> Result<CudaTensor>,
    ) -> Result<(u64, usize)> {
        let pos = state.pos;
        // Recordings are per power-of-two context bucket: the attention grid is sized for the
        // bucket, and the KV caches must not move while a recording writes into them. (Work
        // still queued keeps its buffers: frees and copies are ordered on the stream.)
        let bucket = (pos + 1).next_power_of_two().max(1024).min(state.max_seq);
        let mut key = vec![bucket as u64];
        key.extend(end.key());
        if let StepEnd::Chosen(c) = end
            && c.params.has_penalties()
        {
            key.extend(self.generated_counts()?.0);
        }
        for layer in state.layers.iter_mut() {
            match layer {
                LayerState::Gdn(s) => key.extend([self.ptr(&s.window), self.ptr(&s.state)]),
                LayerState::Attn(c) => {
                    self.reserve(c, bucket)?;
                    key.extend([self.ptr(&c.k), self.ptr(&c.v)]);
                }
            }
        }
        if let Some(token) = token {
            // After a chained step the device has written both itself.
            self.upload_to(&self.params, &[token as i32, pos as i32])?;
        }
        {
            let st = self.lock_step()?;
            if let Some(g) = st.graph.as_ref().filter(|g| g.key == key) {
                g.exec.0.launch().map_err(driver("graph launch"))?;
                // Keep the attention caches' bookkeeping in step with what the graph wrote.
                advance(state);
                return Ok(g.logits);
            }
        }
        for attempt in 0..2 {
            let mut st = self.lock_step()?;
            st.graph = None;
            st.used = 0;
            st.overflowed = false;
            if st.arena.is_none() || attempt > 0 {
                let bytes = st.arena.as_ref().map_or(ARENA_BYTES, |a| 2 * a.len());
                st.arena = None;
                st.arena = Some(self.alloc::<u8>(bytes)?);
            }
            if self.left_out.get().is_some()
                && let Some(arena) = st.arena.as_mut()
            {
                // A left-out kernel's outputs are never written: the step's temporaries read
                // zeros (expert ids 0, say), not what an earlier recording (another context
                // bucket, its temporaries at other offsets) left there.
                self.dev
                    .stream
                    .memset_zeros(arena)
                    .map_err(driver("memset"))?;
            }
            drop(st);
            self.bucket.store(bucket, Ordering::Relaxed);
            self.dev
                .stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .map_err(driver("begin capture"))?;
            if let Some(t) = &self.dev.timeline {
                t.begin_step();
            }
            self.capturing.store(true, Ordering::Relaxed);
            let recorded = forward(state).and_then(|logits| {
                if let StepEnd::Chosen(choice) = end {
                    self.launch_chooser(&logits, choice)?;
                }
                Ok(logits)
            });
            self.capturing.store(false, Ordering::Relaxed);
            let graph = self
                .dev
                .stream
                .end_capture(sys::CUgraphInstantiate_flags(0));
            let logits = match recorded {
                Ok(t) => t,
                Err(e) => {
                    // Nothing ran: undo what the recording pass did to the bookkeeping.
                    rewind(state, pos);
                    if attempt == 0 && self.lock_step()?.overflowed {
                        continue;
                    }
                    return Err(e);
                }
            };
            let exec = graph
                .map_err(driver("end capture"))?
                .ok_or_else(|| Error::Backend("the decode step recorded no graph".into()))?;
            exec.launch().map_err(driver("graph launch"))?;
            let view = (logits.buf.ptr, logits.cols);
            self.lock_step()?.graph = Some(StepGraph {
                key,
                exec: GraphExec(exec),
                logits: view,
            });
            return Ok(view);
        }
        Err(Error::Backend("decode step could not be recorded".into()))
    }

    /// Readies a penalised chain's counts on the device for a step of a state of `max_seq`
    /// positions. At a step fed a host token (`token`) they become `generated` less that token's
    /// one generation, which the step's `sample_penalise_chained` counts as it counts each fed
    /// token; a step fed the previous step's choice continues them.
    fn start_generated_counts(
        &self,
        max_seq: usize,
        token: Option<u32>,
        generated: &[(u32, u32)],
    ) -> Result<()> {
        let mut held = self.chain.generated.lock().map_err(|_| {
            Error::Backend("the lock of the generated tokens' counts is poisoned".into())
        })?;
        if held.as_ref().is_none_or(|g| g.ids.len() < max_seq) {
            if token.is_none() {
                return Err(Error::Backend(
                    "a penalised chain starts with a step fed a host token".into(),
                ));
            }
            *held = Some(GeneratedCounts {
                ids: self.alloc(max_seq)?,
                counts: self.alloc(max_seq)?,
                count_n: zeroed(&self.dev, 1)?,
            });
        }
        let (Some(fed), Some(g)) = (token, held.as_ref()) else {
            return Ok(());
        };
        let (mut ids, mut counts): (Vec<u32>, Vec<u32>) =
            generated.iter().filter(|&&(_, n)| n > 0).copied().unzip();
        if let Some(j) = ids.iter().position(|&id| id == fed) {
            counts[j] -= 1;
            if counts[j] == 0 {
                ids.remove(j);
                counts.remove(j);
            }
        }
        if ids.len() >= g.ids.len() {
            return Err(Error::invalid(format!(
                "{} distinct generated tokens do not fit a state of {max_seq} positions",
                ids.len() + 1
            )));
        }
        if !ids.is_empty() {
            self.upload_to(&g.ids, &ids)?;
            self.upload_to(&g.counts, &counts)?;
        }
        self.upload_to(&g.count_n, &[ids.len() as i32])
    }

    /// The penalised chain's counts: the buffers' addresses (ids, counts, count_n) and the
    /// capacity.
    fn generated_counts(&self) -> Result<([u64; 3], usize)> {
        let held = self.chain.generated.lock().map_err(|_| {
            Error::Backend("the lock of the generated tokens' counts is poisoned".into())
        })?;
        let g = held.as_ref().ok_or_else(|| {
            Error::Backend("a penalised chained step without the generated tokens' counts".into())
        })?;
        Ok((
            [self.ptr(&g.ids), self.ptr(&g.counts), self.ptr(&g.count_n)],
            g.ids.len(),
        ))
    }

    /// Records the choice that ends a chained step: the greedy argmax, or the sampler with the
    /// draw uploaded before each replay (the penalties first, from the counts the chain keeps);
    /// either writes the token and the next position into `params` and the host's slot
    /// (kernels/common.cuh, `finish_chained_step`).
    fn launch_chooser(&self, logits: &CudaTensor, choice: &DeviceSampling) -> Result<()> {
        plain!(self, logits);
        let (n, p) = (logits.cols, choice.params);
        let (params, host_out) = (self.ptr(&self.params), self.chain.chosen.device);
        let sample_kernels = || {
            self.k
                .sample
                .as_ref()
                .ok_or_else(|| Error::Backend("the device sampler is off".into()))
        };
        if p.has_penalties() {
            let ([ids, counts, count_n], capacity) = self.generated_counts()?;
            // (Named as the kernel, for the profile's label.)
            let sample_penalise_chained = &sample_kernels()?.penalise_chained;
            launch!(
                self,
                sample_penalise_chained,
                cfg((1, 1), 1024, 0),
                [
                    self.ptr(&logits.buf),
                    n as i32,
                    params,
                    ids,
                    counts,
                    count_n,
                    capacity as i32,
                    p.presence_penalty,
                    p.frequency_penalty
                ]
            )?;
        }
        if p.is_greedy() && !p.has_penalties() {
            return launch!(
                self,
                self.k.step_argmax,
                cfg((n.div_ceil(2048) as u32, 1), 256, 0),
                [
                    self.ptr(&logits.buf),
                    self.ptr(&self.chain.key),
                    self.ptr(&self.chain.ticket),
                    n as i32,
                    params,
                    host_out
                ]
            );
        }
        let kernels = sample_kernels()?;
        // The penalties, if any, are applied above.
        let io = SampleIo {
            penalties: (0, 0, 0),
            u: 0.0,
            u_at: self.ptr(&self.chain.draw),
            out: self.ptr(&self.chain.sample_out),
            params,
            host_out,
        };
        self.launch_sample(kernels, logits, p, &io)
    }

    /// The sampler over one logits row for `p` (kernels/sample.cu), on a grid of ranges of 2,048
    /// ids where it can: the whole row at top-p 1 (`sample_row_max` then `sample_row_weights`),
    /// top-p over the whole row (`sample_row_max`, three `sample_select_pass` passes, then
    /// `sample_nucleus_draw`), a top-k whose ranges' best fit one block's candidates
    /// (`sample_row_top` then `sample_top_merge`; greedy with penalties as a top-k of 1), any
    /// other top-k up to 4,096 (three `sample_select_pass` passes counting,
    /// `sample_select_gather`, then one block's `sample_select_merge`); every other choice (a
    /// top-k past 4,096) on one block of SAMPLE_THREADS (1,024) threads (`sample_token`).
    fn launch_sample(
        &self,
        k: &SampleKernels,
        logits: &CudaTensor,
        p: &SamplingParams,
        io: &SampleIo,
    ) -> Result<()> {
        let n = logits.cols;
        // Greedy (here only with penalties: without, the argmax decodes choose) is a top-k of 1.
        let greedy = p.is_greedy();
        let limit = if greedy { 1 } else { p.candidate_limit(n) };
        let (pen_ids, pen_amounts, n_pen) = io.penalties;
        // (Named as the kernels, for the profile's labels.)
        let (sample_row_max, sample_row_weights, sample_token) =
            (&k.row_max, &k.row_weights, &k.token);
        let (sample_row_top, sample_top_merge) = (&k.row_top, &k.top_merge);
        let (sample_select_pass, sample_nucleus_draw) = (&k.select_pass, &k.nucleus_draw);
        let (sample_select_gather, sample_select_merge) = (&k.select_gather, &k.select_merge);
        // SAMPLE_ROW_RANGE (2,048) ids a block of SAMPLE_ROW_THREADS (256).
        let ranges = n.div_ceil(2048);
        let kb = limit.min(2048);
        let grid = cfg((ranges as u32, 1), 256, 0);
        let hist = self.ptr(&self.chain.select_hist);
        // The select passes over the row: weights for the nucleus (k 0), counts for a top-k.
        let select_passes = |range_max: u64, k: usize| -> Result<()> {
            for digit in 0..3i32 {
                // A top-k's first pass applies the penalties (the nucleus': sample_row_max).
                let pen = if k > 0 && digit == 0 {
                    (pen_ids, pen_amounts, n_pen)
                } else {
                    (0, 0, 0)
                };
                launch!(
                    self,
                    sample_select_pass,
                    grid,
                    [
                        self.ptr(&logits.buf),
                        n as i32,
                        pen.0,
                        pen.1,
                        pen.2,
                        range_max,
                        p.temperature,
                        p.top_p,
                        k as i32,
                        digit,
                        hist
                    ]
                )?;
            }
            Ok(())
        };
        let row_max = || -> Result<DevBuf<f32>> {
            let range_max = self.tmp::<f32>(ranges)?;
            launch!(
                self,
                sample_row_max,
                grid,
                [
                    self.ptr(&logits.buf),
                    n as i32,
                    pen_ids,
                    pen_amounts,
                    n_pen,
                    range_max.ptr
                ]
            )?;
            Ok(range_max)
        };
        // The nucleus' weights sum below 2^53 (exact in the f64 of its top-p product) for rows
        // under 2^21 ids.
        if p.temperature > 0.0 && limit >= n && p.top_p < 1.0 && n < 1 << 21 {
            let range_max = row_max()?;
            select_passes(range_max.ptr, 0)?;
            let range_mass = self.tmp::<u64>(ranges)?;
            let range_ties = self.tmp::<u32>(ranges)?;
            return launch!(
                self,
                sample_nucleus_draw,
                grid,
                [
                    self.ptr(&logits.buf),
                    n as i32,
                    range_max.ptr,
                    p.temperature,
                    p.top_p,
                    p.min_p,
                    hist,
                    io.u,
                    io.u_at,
                    range_mass.ptr,
                    range_ties.ptr,
                    self.ptr(&self.chain.row_ticket),
                    io.out,
                    io.params,
                    io.host_out
                ]
            );
        }
        if p.temperature > 0.0 && limit >= n && p.top_p >= 1.0 {
            let range_max = row_max()?;
            let range_sum = self.tmp::<f64>(ranges)?;
            return launch!(
                self,
                sample_row_weights,
                grid,
                [
                    self.ptr(&logits.buf),
                    n as i32,
                    range_max.ptr,
                    p.temperature,
                    p.min_p,
                    io.u,
                    io.u_at,
                    range_sum.ptr,
                    self.ptr(&self.chain.row_ticket),
                    io.out,
                    io.params,
                    io.host_out
                ]
            );
        }
        // SAMPLE_MAX_CAND (4,096) keys in the merging block; such a top-k never widens.
        if limit <= 4096 && kb * ranges <= 4096 {
            let range_top = self.tmp::<u64>(kb * ranges)?;
            launch!(
                self,
                sample_row_top,
                cfg((ranges as u32, 1), 256, 0),
                [
                    self.ptr(&logits.buf),
                    n as i32,
                    pen_ids,
                    pen_amounts,
                    n_pen,
                    kb as i32,
                    range_top.ptr
                ]
            )?;
            return launch!(
                self,
                sample_top_merge,
                cfg((1, 1), 1024, 0),
                [
                    range_top.ptr,
                    (kb * ranges) as i32,
                    limit as i32,
                    p.temperature,
                    p.top_p,
                    p.min_p,
                    io.u,
                    io.u_at,
                    io.out,
                    io.params,
                    io.host_out
                ]
            );
        }
        // Any other top-k up to SAMPLE_MAX_CAND: the k-th largest by counting passes, the keys
        // at or above it gathered, one block choosing among them.
        if p.temperature > 0.0 && limit <= 4096 && n < 1 << 21 {
            select_passes(0, limit)?;
            let cand = self.tmp::<u64>(4096)?;
            let counts = self.ptr(&self.chain.select_counts);
            launch!(
                self,
                sample_select_gather,
                grid,
                [
                    self.ptr(&logits.buf),
                    n as i32,
                    hist,
                    limit as i32,
                    cand.ptr,
                    counts
                ]
            )?;
            return launch!(
                self,
                sample_select_merge,
                cfg((1, 1), 1024, 0),
                [
                    self.ptr(&logits.buf),
                    n as i32,
                    cand.ptr,
                    counts,
                    hist,
                    limit as i32,
                    p.temperature,
                    p.top_p,
                    p.min_p,
                    io.u,
                    io.u_at,
                    io.out,
                    io.params,
                    io.host_out
                ]
            );
        }
        launch!(
            self,
            sample_token,
            cfg((1, 1), 1024, 0),
            [
                self.ptr(&logits.buf),
                n as i32,
                pen_ids,
                pen_amounts,
                n_pen,
                p.temperature,
                limit as i32,
                p.top_p,
                p.min_p,
                io.u,
                io.u_at,
                io.out,
                io.params,
                io.host_out
            ]
        )
    }

    /// Copies `data` into the start of `dst`, ordered on the stream.
    fn upload_to<T: DeviceRepr>(&self, dst: &CudaSlice<T>, data: &[T]) -> Result<()> {
        debug_assert!(data.len() <= dst.len());
        // SAFETY: `dst` holds at least data.len() elements, and `data` is read by the copy
        // before this call returns (a pageable-memory copy is staged by the driver at once).
        unsafe { cudarc::driver::result::memcpy_htod_async(self.ptr(dst), data, self.cu_stream()) }
            .map_err(driver("upload"))
    }
}

fn rewind(state: &mut DecodeState<CudaBackend>, pos: usize) {
    state.pos = pos;
    for layer in state.layers.iter_mut() {
        if let LayerState::Attn(c) = layer {
            c.len = c.len.min(pos);
        }
    }
}

/// What a replayed step does to the host-side state: one more position (the recording's
/// forward pass did this when it was recorded).
fn advance(state: &mut DecodeState<CudaBackend>) {
    state.pos += 1;
    for layer in state.layers.iter_mut() {
        if let LayerState::Attn(c) = layer {
            c.len = state.pos;
        }
    }
}

/// The recorded logits row, valid until the next decode step.
fn logits_view((ptr, cols): (u64, usize)) -> CudaTensor {
    let buf = DevBuf {
        ptr,
        len: cols,
        _owned: None,
    };
    CudaTensor::new(buf, 1, cols)
}
