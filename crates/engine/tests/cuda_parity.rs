//! CUDA kernels against the CPU reference on random inputs (NMSE, as llama.cpp's
//! test-backend-ops does): every op of the backend interface, at the model's shapes and awkward
//! ones, run on both backends from the same inputs. Needs a GPU: without one each test prints
//! SKIPPED and why. (End to end on the tiny fixtures: tests/golden.rs.)

use std::io::Write;

use common::{cuda_or_skip, nmse, qweight, randn, skip_without_gpu};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use engine::backend::cpu::reference as r;
use engine::backend::cpu::{CpuBackend, CpuRouting};
use engine::backend::cuda::device::CudaDevice;
use engine::backend::cuda::{
    CONV_IN_PREP_MIN_TOKENS, CudaBackend, CudaQMatrix, CudaRouting, CudaTensor,
};
use engine::backend::{
    AttnShape, Backend, DeviceSample, DeviceSampling, GdnShape, attn_prep_separately,
};
use engine::checkpoint::QWeight;
use engine::sampler::{SamplingParams, choose};
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod common;

fn device_or_skip(test: &str) -> Option<CudaDevice> {
    CudaDevice::open(0)
        .map_err(|e| skip_without_gpu(test, e))
        .ok()
}

/// How a matrix-vector kernel of kernels/quant.cu is launched (256 threads a block): by rows
/// per block (`GEMV_VARIANTS`), or with a fixed grid whose warps walk the rows (`gemv_stream`).
#[derive(Clone, Copy)]
enum Grid {
    RowsPerBlock(u32),
    Blocks(u32),
}

/// The matrix-vector kernels: name suffix and launch. The stream kernel runs on 3 blocks, so
/// that every shape takes several steps of the walk.
const GEMV_KERNELS: [(&str, Grid); 4] = [
    ("", Grid::RowsPerBlock(32)),
    ("_r1", Grid::RowsPerBlock(8)),
    ("_h16", Grid::RowsPerBlock(64)),
    ("_stream", Grid::Blocks(3)),
];

/// A `QMat` kernel parameter: codes, scales and biases pointers.
#[repr(C)]
#[derive(Clone, Copy)]
struct QMatParam([u64; 3]);
// SAFETY: three device pointers, laid out as the kernels' `QMat` struct.
unsafe impl cudarc::driver::DeviceRepr for QMatParam {}

/// A `RowNorm` kernel parameter, all zero: the input used as it is.
#[repr(C)]
#[derive(Clone, Copy)]
struct NoRowNorm([u64; 3]);
// SAFETY: 24 bytes, laid out as the kernels' `RowNorm` struct (a pointer, three 4-byte fields,
// padding), zero meaning none.
unsafe impl cudarc::driver::DeviceRepr for NoRowNorm {}

/// y = w x on the GPU with one of the q4/q8 GEMV kernels (`GEMV_KERNELS`); returns y and the
/// kernel time in ms (median of `reps` launches).
fn gpu_gemv(
    dev: &CudaDevice,
    w: &QWeight,
    x: &[f32],
    (suffix, grid): (&str, Grid),
    reps: usize,
) -> (Vec<f32>, f32) {
    use cudarc::driver::DevicePtr;
    let s = &dev.stream;
    let as_u16 = |v: &[bf16]| v.iter().map(|b| b.to_bits()).collect::<Vec<u16>>();
    let codes = s.clone_htod(&w.codes[..]).expect("codes");
    let scales = s.clone_htod(&as_u16(&w.scales)).expect("scales");
    let biases = s.clone_htod(&as_u16(&w.biases)).expect("biases");
    let xd = s.clone_htod(x).expect("x");
    let mut y = s.alloc_zeros::<f32>(w.rows).expect("y");
    let qmat = QMatParam([
        codes.device_ptr(s).0,
        scales.device_ptr(s).0,
        biases.device_ptr(s).0,
    ]);
    let f = dev
        .function("quant", &format!("q{}_gemv{suffix}", w.bits))
        .expect("kernel");
    let (rows, cols) = (w.rows as i32, w.cols as i32);
    let cfg = LaunchConfig {
        grid_dim: match grid {
            Grid::RowsPerBlock(n) => ((w.rows as u32).div_ceil(n), 1, 1),
            Grid::Blocks(n) => (n, 1, 1),
        },
        block_dim: (256, 1, 1),
        // The integer tensor-core kernels stage x as digits, not floats.
        shared_mem_bytes: if suffix.ends_with("_qx") {
            engine::backend::cuda::qx_smem_bytes(w.cols)
        } else {
            engine::backend::cuda::gemv_smem_bytes(w.cols)
        } as u32,
    };
    let mut times = Vec::new();
    for _ in 0..reps.max(1) {
        let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = dev.ctx.new_event(timed).expect("event");
        let stop = dev.ctx.new_event(timed).expect("event");
        start.record(s).expect("record");
        let mut b = s.launch_builder(&f);
        let nrm = NoRowNorm([0; 3]);
        b.arg(&qmat)
            .arg(&xd)
            .arg(&mut y)
            .arg(&rows)
            .arg(&cols)
            .arg(&nrm);
        // SAFETY: the argument list matches the kernel's signature, and the grid covers every
        // row (at the variant's rows per block, or walking them), with buffers of those sizes.
        unsafe { b.launch(cfg) }.expect("launch");
        stop.record(s).expect("record");
        s.synchronize().expect("sync");
        times.push(start.elapsed_ms(&stop).expect("elapsed"));
    }
    times.sort_by(|a, b| a.total_cmp(b));
    (s.clone_dtoh(&y).expect("download"), times[times.len() / 2])
}

/// Largest normalised error accepted between the two backends: both compute in f32, so only
/// summation order differs.
const TOL: f64 = 1e-9;

/// The prefill flash attention's (chunks of 32 tokens or more, head dims up to 256): it rounds Q
/// and the probabilities to f16 once each, as the cache rounds K and V, so each term of both
/// products is off by up to 2^-11 (relative) and the output's normalised error stays near
/// (2^-11)^2 / 3 (3e-8 measured); the tolerance is (2^-11)^2.
const FLASH_TOL: f64 = 1.0 / (1u64 << 22) as f64;

fn backends_or_skip(test: &str) -> Option<(CpuBackend, CudaBackend)> {
    cuda_or_skip(test).map(|g| (CpuBackend::new(0).expect("cpu pool"), g))
}

/// The values' bits, for comparisons that must be exact.
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

fn close(what: &str, got: &[f32], want: &[f32]) {
    close_within(what, got, want, TOL);
}

fn close_within(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let err = nmse(got, want);
    assert!(err < tol, "{what}: nmse {err:e} (tolerance {tol:e})");
    let _ = writeln!(std::io::stderr(), "{what}: nmse {err:.1e}");
}

fn up<B: Backend>(b: &B, data: &[f32], rows: usize, cols: usize) -> B::Tensor {
    b.upload_tensor(data, rows, cols).expect("upload")
}

fn down<B: Backend>(b: &B, t: &B::Tensor) -> Vec<f32> {
    b.download(t).expect("download")
}

fn clone_q(w: &QWeight) -> QWeight {
    QWeight {
        name: w.name.clone(),
        codes: engine::checkpoint::HostSlice::from_vec(w.codes.to_vec()),
        scales: engine::checkpoint::HostSlice::from_vec(w.scales.to_vec()),
        biases: engine::checkpoint::HostSlice::from_vec(w.biases.to_vec()),
        ..*w
    }
}

fn qmatmul_on<B: Backend>(b: &B, w: &QWeight, x: &[f32], t: usize) -> Vec<f32> {
    let wq = b.upload_qmatrix(clone_q(w)).expect("weights");
    let y = b.qmatmul(&up(b, x, t, w.cols), &wq).expect("qmatmul");
    down(b, &y)
}

#[test]
fn every_quantized_product_matches() {
    let Some((cpu, gpu)) = backends_or_skip("every_quantized_product_matches") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(21);
    for bits in [4, 8] {
        // 4,160 columns: 65 groups, more than the tensor-core products' bias half takes in one
        // round of 64 (kernels/qmma.cu, wg_bias_product).
        for (rows, cols) in [
            (1, 64),
            (65, 192),
            (257, 2048),
            (1000, 512),
            (96, 4096),
            (33, 4160),
        ] {
            let w = qweight(&mut rng, rows, cols, bits);
            // One token (decode), a few (the per-token path), and the tensor-core tiles: one
            // partial tile of tokens, and several with a partial last one.
            for t in [1, 3, 8, 67, 200] {
                let x = randn(&mut rng, t * cols, 1.0);
                close(
                    &format!("qmatmul q{bits} {rows}x{cols} T={t}"),
                    &qmatmul_on(&gpu, &w, &x, t),
                    &qmatmul_on(&cpu, &w, &x, t),
                );
            }
        }
    }
}

fn embed_on<B: Backend>(b: &B, w: &QWeight, tokens: &[u32]) -> Vec<f32> {
    let wq = b.upload_qmatrix(clone_q(w)).expect("table");
    down(b, &b.embed(&wq, tokens).expect("embed"))
}

#[test]
fn embedding_gather_matches_and_rejects_bad_ids() {
    let Some((cpu, gpu)) = backends_or_skip("embedding_gather_matches_and_rejects_bad_ids") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(22);
    for bits in [4, 8] {
        let w = qweight(&mut rng, 1000, 256, bits);
        let tokens = [0, 999, 5, 5, 517];
        close(
            &format!("embed q{bits}"),
            &embed_on(&gpu, &w, &tokens),
            &embed_on(&cpu, &w, &tokens),
        );
        let wq = gpu.upload_qmatrix(clone_q(&w)).expect("table");
        assert!(gpu.embed(&wq, &[1000]).is_err(), "id past the vocabulary");
    }
}

fn norms_on<B: Backend>(
    b: &B,
    x: &[f32],
    z: &[f32],
    w: &[f32],
    t: usize,
    cols: usize,
    dim: usize,
) -> Vec<Vec<f32>> {
    let xt = up(b, x, t, cols);
    let zt = up(b, z, t, cols);
    let wrow = b.upload_vector(&w[..cols]).expect("w");
    let whead = b.upload_vector(&w[..dim]).expect("w");
    vec![
        down(b, &b.rms_norm(&xt, &wrow, 1e-6).expect("rms")),
        down(
            b,
            &b.head_rms_norm(&xt, &whead, dim, 1e-6).expect("head rms"),
        ),
        down(
            b,
            &b.gated_rms_norm(&xt, &zt, &whead, dim, 1e-6)
                .expect("gated rms"),
        ),
    ]
}

#[test]
fn norms_match() {
    let Some((cpu, gpu)) = backends_or_skip("norms_match") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(23);
    // Per-head rows: few (a block each) and many: 8-column blocks a lane (`rms_norm_rows8`) at
    // 64 (four rows a warp; 441 rows, the last warp partly empty), 128, 256 and 512 columns (two
    // blocks a lane), and a warp a row (`rms_norm_warp`) at 48, whose six blocks do not pack.
    for (t, cols, dim) in [
        (1, 2048, 128),
        (3, 4096, 256),
        (5, 64, 32),
        (2, 4096, 128),
        (100, 4096, 128),
        (7, 4032, 64),
        (90, 4096, 256),
        (70, 4096, 512),
        (100, 4800, 48),
    ] {
        let x = randn(&mut rng, t * cols, 2.0);
        let z = randn(&mut rng, t * cols, 3.0);
        let w = randn(&mut rng, cols, 1.5);
        let g = norms_on(&gpu, &x, &z, &w, t, cols, dim);
        let c = norms_on(&cpu, &x, &z, &w, t, cols, dim);
        for (name, (a, b)) in ["rms_norm", "head_rms_norm", "gated_rms_norm"]
            .iter()
            .zip(g.iter().zip(&c))
        {
            close(&format!("{name} T={t} cols={cols} dim={dim}"), a, b);
        }
    }
}

fn elementwise_on<B: Backend>(
    b: &B,
    x: &[f32],
    y: &[f32],
    gl: &[f32],
    t: usize,
    cols: usize,
) -> Vec<Vec<f32>> {
    let xt = up(b, x, t, cols);
    let yt = up(b, y, t, cols);
    let mut sum = up(b, x, t, cols);
    b.add_assign(&mut sum, &yt).expect("add");
    let mut gated = up(b, x, t, cols);
    b.add_sigmoid_gated(&mut gated, &yt, &up(b, gl, t, 1))
        .expect("gated add");
    let (q, g) = b.split_q_gate(&xt, cols / 64, 32).expect("split");
    vec![
        down(b, &sum),
        down(b, &b.swiglu(&xt, &yt).expect("swiglu")),
        down(b, &b.sigmoid_mul(&xt, &yt).expect("sigmoid_mul")),
        down(b, &gated),
        down(b, &q),
        down(b, &g),
        down(b, &b.last_row(&xt).expect("last row")),
    ]
}

#[test]
fn elementwise_ops_match() {
    let Some((cpu, gpu)) = backends_or_skip("elementwise_ops_match") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(24);
    // 40 rows: sigmoid_mul also writes its output's split (the attention's output gate).
    for (t, cols) in [(1, 2048), (7, 512), (3, 64), (40, 512)] {
        let x = randn(&mut rng, t * cols, 4.0);
        let y = randn(&mut rng, t * cols, 4.0);
        let gl = randn(&mut rng, t, 4.0);
        let g = elementwise_on(&gpu, &x, &y, &gl, t, cols);
        let c = elementwise_on(&cpu, &x, &y, &gl, t, cols);
        let names = [
            "add",
            "swiglu",
            "sigmoid_mul",
            "add_sigmoid_gated",
            "split q",
            "split gate",
            "last_row",
        ];
        for (name, (a, b)) in names.iter().zip(g.iter().zip(&c)) {
            close(&format!("{name} T={t} cols={cols}"), a, b);
        }
    }
}

#[test]
fn argmax_takes_the_first_maximum_and_skips_nan() {
    let Some((cpu, gpu)) = backends_or_skip("argmax_takes_the_first_maximum_and_skips_nan") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(25);
    let cols = 248_320;
    let mut x = randn(&mut rng, 5 * cols, 10.0);
    x[7] = 50.0; // row 0: a tie between 7 and 200_000 goes to 7
    x[200_000] = 50.0;
    x[cols] = f32::NAN; // row 1: NaN never wins
    x[cols + 3] = f32::NAN;
    x[cols + 100_000] = 99.0;
    x[2 * cols..3 * cols].fill(f32::NEG_INFINITY); // row 2: all -inf: the first
    x[3 * cols + cols - 1] = 77.0; // row 3: the last column
    x[4 * cols..5 * cols].fill(-1.0); // row 4: +0.0 above an earlier -0.0 (IEEE total order)
    x[4 * cols + 5] = -0.0;
    x[4 * cols + 9] = 0.0;
    let want = cpu.argmax_rows(&up(&cpu, &x, 5, cols)).expect("cpu");
    let got = gpu.argmax_rows(&up(&gpu, &x, 5, cols)).expect("gpu");
    assert_eq!(want, vec![7, 100_000, 0, (cols - 1) as u32, 9]);
    assert_eq!(got, want);
}

/// One sampling case: the request's parameters, the penalties, and whether the host may have to
/// read the row (the nucleus beyond the device's 4,096 candidates, or top-k above them).
struct SampleCase {
    params: SamplingParams,
    penalties: Vec<(u32, f32)>,
    row_may_be_needed: bool,
}

fn sampling(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_p,
        top_k,
        min_p,
        ..SamplingParams::greedy()
    }
}

#[test]
fn sampling_matches_the_host_sampler() {
    let Some(gpu) = cuda_or_skip("sampling_matches_the_host_sampler") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(41);
    // Logit rows: a peaked and a flat (uniform) row at the model's vocabulary, integer logits (ties at
    // every threshold), NaN and -inf among them, and vocabularies below and around one block.
    let vocab = 248_320;
    // randn is uniform in [-scale, scale]; the fifth power gives a few dominant logits, as a
    // trained model's row has (its 0.95 nucleus at T 0.6 is inside the top 4,096).
    let peaked: Vec<f32> = randn(&mut rng, vocab, 1.0)
        .iter()
        .map(|v| 20.0 * v.powi(5))
        .collect();
    let flat = randn(&mut rng, vocab, 1.0);
    let ties: Vec<f32> = randn(&mut rng, vocab, 3.0)
        .iter()
        .map(|v| v.round())
        .collect();
    let mut holes = randn(&mut rng, vocab, 6.0);
    for i in (0..vocab).step_by(97) {
        holes[i] = f32::NAN;
    }
    for i in (5..vocab).step_by(89) {
        holes[i] = f32::NEG_INFINITY;
    }
    let small = randn(&mut rng, 1000, 4.0);
    let tiny = randn(&mut rng, 5, 2.0);
    let odd = randn(&mut rng, 1025, 4.0);
    let rows: [(&str, &[f32]); 7] = [
        ("peaked", &peaked),
        ("flat", &flat),
        ("ties", &ties),
        ("nan/-inf", &holes),
        ("1,000", &small),
        ("5", &tiny),
        ("1,025", &odd),
    ];
    let penalties = vec![(3, 0.5), (17, 2.0), (999, 100.0), (4_000_000, 1.0)];
    let case = |params, penalties: &[(u32, f32)], row_may_be_needed| SampleCase {
        params,
        penalties: penalties.to_vec(),
        row_may_be_needed,
    };
    let cases = [
        case(sampling(1.0, 0, 1.0, 0.0), &[], false),
        case(sampling(0.7, 0, 1.0, 0.05), &[], false),
        case(sampling(0.7, 20, 1.0, 0.0), &[], false),
        case(sampling(0.6, 0, 0.95, 0.0), &[], false),
        case(sampling(1.0, 0, 0.5, 0.0), &[], false),
        case(sampling(0.7, 0, 0.8, 0.1), &[], false),
        case(sampling(0.8, 300_000, 0.999, 0.0), &[], false),
        case(sampling(0.9, 0, 0.9, 0.0), &penalties, false),
        case(sampling(0.7, 20, 0.8, 0.1), &[], false),
        case(sampling(1.0, 5_000, 1.0, 0.0), &[], true),
        case(sampling(1.3, 1, 1.0, 0.0), &[], false),
        case(sampling(0.0, 0, 1.0, 0.0), &penalties, false),
        case(sampling(0.8, 50, 1.0, 0.0), &penalties, false),
        case(sampling(0.7, 40, 0.95, 0.0), &[], false),
        case(sampling(0.6, 300, 1.0, 0.0), &[], false),
        case(sampling(1.0, 4096, 0.9, 0.05), &[], false),
        case(sampling(0.9, 0, 1.0, 0.0), &penalties, false),
    ];
    let (mut chosen, mut row_needed) = (0, 0);
    for (name, row) in rows {
        for c in &cases {
            let p = &c.params;
            let mut host_row = row.to_vec();
            for &(t, a) in &c.penalties {
                if let Some(l) = host_row.get_mut(t as usize) {
                    *l -= a;
                }
            }
            let whole = p.top_k == 0; // f64 draws, as Sampler::draw
            for _ in 0..6 {
                let u = if whole {
                    rng.random::<f64>()
                } else {
                    rng.random::<f32>() as f64
                };
                let t = up(&gpu, row, 1, row.len());
                let req = DeviceSampling {
                    params: p,
                    u,
                    penalties: &c.penalties,
                    generated: &[],
                };
                let what = format!("{name} row, {p:?}, u {u}");
                match gpu.sample(&t, &req).expect("gpu sample") {
                    DeviceSample::Chosen(tok) => {
                        assert_eq!(tok, choose(p, &host_row, u), "{what}");
                        chosen += 1;
                    }
                    DeviceSample::RowNeeded { penalised } => {
                        // The peaked row's nucleus fits the candidates: only top-k above them
                        // sends it back.
                        let may = c.row_may_be_needed && (name != "peaked" || p.top_k > 4096);
                        assert!(may, "{what}: the device asked for the row");
                        assert_eq!(penalised, !c.penalties.is_empty(), "{what}");
                        row_needed += 1;
                    }
                }
                // The penalties are applied to the device's row in place, as the host would.
                let got = down(&gpu, &t);
                let same = got
                    .iter()
                    .zip(&host_row)
                    .all(|(a, b)| a == b || (a.is_nan() && b.is_nan()));
                assert!(same, "{what}: the penalised row differs");
            }
        }
    }
    let _ = writeln!(
        std::io::stderr(),
        "sampling: {chosen} tokens chosen on the device, equal to the host's; {row_needed} rows read back"
    );
}

const GDN_SHAPES: [GdnShape; 2] = [
    // Qwen3.6-35B-A3B
    GdnShape {
        key_heads: 16,
        value_heads: 32,
        key_dim: 128,
        value_dim: 128,
        conv_kernel: 4,
    },
    // tiny-alt: three value heads per key head
    GdnShape {
        key_heads: 2,
        value_heads: 6,
        key_dim: 128,
        value_dim: 128,
        conv_kernel: 4,
    },
];

/// conv + recurrence over chunks of `lens` tokens from a fresh state; returns every output,
/// then the final window and state.
#[allow(clippy::type_complexity)]
fn gdn_on<B: Backend>(
    b: &B,
    sh: &GdnShape,
    inputs: &[(Vec<f32>, Vec<f32>, Vec<f32>)],
    params: &(Vec<f32>, Vec<f32>, Vec<f32>),
    state_out: impl Fn(&B, &B::GdnState) -> (Vec<f32>, Vec<f32>),
) -> Vec<Vec<f32>> {
    let c = sh.conv_channels();
    let hv = sh.value_heads;
    let mut st = b.new_gdn_state(sh).expect("state");
    let conv = b.upload_vector(&params.0).expect("conv");
    let a_log = b.upload_vector(&params.1).expect("a_log");
    let dt_bias = b.upload_vector(&params.2).expect("dt_bias");
    let mut outs = Vec::new();
    for (x, a, bb) in inputs {
        let t = x.len() / c;
        let qkv = b
            .conv1d_silu(&up(b, x, t, c), &conv, &mut st, sh)
            .expect("conv");
        outs.push(down(b, &qkv));
        let y = b
            .gdn_recurrence(
                &qkv,
                &up(b, a, t, hv),
                &up(b, bb, t, hv),
                &a_log,
                &dt_bias,
                &mut st,
                sh,
            )
            .expect("gdn");
        outs.push(down(b, &y));
    }
    let (w, s) = state_out(b, &st);
    outs.push(w);
    outs.push(s);
    outs
}

#[test]
fn gated_delta_net_matches_over_chunks() {
    let Some((cpu, gpu)) = backends_or_skip("gated_delta_net_matches_over_chunks") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(26);
    for sh in &GDN_SHAPES {
        let (c, hv) = (sh.conv_channels(), sh.value_heads);
        let params = (
            randn(&mut rng, sh.conv_kernel * c, 0.5),
            randn(&mut rng, hv, 1.0),
            randn(&mut rng, hv, 1.0),
        );
        // A prefill chunk, decode steps continuing the same state, then chunks longer than the
        // conv's run per thread. 9, 1 and 4 tokens take the token loop; 130 and 150 the chunked
        // recurrence (64-token chunks: two whole and a partial one each), with a block a value
        // head; 1,100 (18 chunks, 288 blocks of head pairs at Hv 32) its prep in value-head
        // pairs where Hv / Hk is even, on GPUs of up to 288 SMs. Each form continues from a
        // state the other left.
        let inputs: Vec<_> = [9, 1, 130, 1, 4, 150, 1, 1100]
            .iter()
            .map(|&t| {
                (
                    randn(&mut rng, t * c, 2.0),
                    randn(&mut rng, t * hv, 3.0),
                    randn(&mut rng, t * hv, 3.0),
                )
            })
            .collect();
        let g = gdn_on(&gpu, sh, &inputs, &params, |b, s| {
            let st = &b.device().stream;
            (
                st.clone_dtoh(&s.window).expect("w"),
                st.clone_dtoh(&s.state).expect("s"),
            )
        });
        let c = gdn_on(&cpu, sh, &inputs, &params, |_, s| {
            (s.window.clone(), s.state.clone())
        });
        for (i, (a, b)) in g.iter().zip(&c).enumerate() {
            let what = match (i / 2, i % 2) {
                (k, 0) if k < inputs.len() => format!("conv chunk {k}"),
                (k, 1) if k < inputs.len() => format!("gdn chunk {k}"),
                (_, 0) => "conv window".into(),
                _ => "recurrent state".into(),
            };
            close(
                &format!("{what} (Hk {} Hv {})", sh.key_heads, sh.value_heads),
                a,
                b,
            );
        }
    }
}

/// The conv alone over chunks of `[tokens][channels]` from a fresh window; returns each chunk's
/// output, then the final window.
fn conv_on<B: Backend>(
    b: &B,
    sh: &GdnShape,
    taps: &[f32],
    chunks: &[Vec<f32>],
    window_out: impl Fn(&B, &B::GdnState) -> Vec<f32>,
) -> Vec<Vec<f32>> {
    let c = sh.conv_channels();
    let mut st = b.new_gdn_state(sh).expect("state");
    let w = b.upload_vector(taps).expect("taps");
    let mut outs: Vec<Vec<f32>> = chunks
        .iter()
        .map(|x| {
            let y = b
                .conv1d_silu(&up(b, x, x.len() / c, c), &w, &mut st, sh)
                .expect("conv");
            down(b, &y)
        })
        .collect();
    outs.push(window_out(b, &st));
    outs
}

#[test]
fn conv_matches_in_both_forms() {
    let Some((cpu, gpu)) = backends_or_skip("conv_matches_in_both_forms") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(27);
    // The GPU's conv takes four channels a thread for kernels of up to four taps when the
    // channels are a multiple of four, else a channel a thread: both forms, over chunks that
    // start and end inside a thread's run of tokens and chunks shorter than the window.
    // (key dim, value dim, taps): one key and one value head, 2 dk + dv channels.
    let shapes = [
        (128, 1024, 4, "four channels a thread"),
        (128, 1024, 2, "four channels a thread, two taps"),
        (128, 1024, 6, "a channel a thread: six taps"),
        (2, 5, 4, "a channel a thread: nine channels"),
    ];
    for (key_dim, value_dim, taps, form) in shapes {
        let sh = GdnShape {
            key_heads: 1,
            value_heads: 1,
            key_dim,
            value_dim,
            conv_kernel: taps,
        };
        let channels = sh.conv_channels();
        let w = randn(&mut rng, taps * channels, 0.5);
        let chunks: Vec<_> = [1, 2, 70, 1, 3, 200]
            .iter()
            .map(|&t| randn(&mut rng, t * channels, 2.0))
            .collect();
        let on_gpu = conv_on(&gpu, &sh, &w, &chunks, |b, s| {
            b.device().stream.clone_dtoh(&s.window).expect("window")
        });
        let on_cpu = conv_on(&cpu, &sh, &w, &chunks, |_, s| s.window.clone());
        for (i, (g, c)) in on_gpu.iter().zip(&on_cpu).enumerate() {
            let what = if i < chunks.len() {
                format!("conv chunk {i}")
            } else {
                "conv window".into()
            };
            close(&format!("{what} ({form})"), g, c);
        }
    }
}

/// Many tokens' conv left to the chunked recurrence's prep (`LazyConv`, from
/// `CONV_IN_PREP_MIN_TOKENS`): over prompts of 18 chunks and of 16 and a partial one (the prep
/// in value-head pairs on the 35B shape, a block a head on the other), with decode steps
/// between them and a shorter prompt whose conv runs on its own after them, the recurrence from
/// the lazy conv must give the bits it gives from the conv's values (conv1d_silu's, remade when
/// read after the window moved on), on a copy of the same state; those values must match the
/// CPU's and read the same twice.
#[test]
fn gdn_conv_left_to_the_prep_matches_the_conv_launch() {
    let Some((cpu, gpu)) = backends_or_skip("gdn_conv_left_to_the_prep_matches_the_conv_launch")
    else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(44);
    let hidden = 256;
    for sh in &GDN_SHAPES {
        let (c, hv) = (sh.conv_channels(), sh.value_heads);
        let w = qweight(&mut rng, c, hidden, 4);
        let taps = randn(&mut rng, sh.conv_kernel * c, 0.5);
        let (a_log, dt_bias) = (randn(&mut rng, hv, 1.0), randn(&mut rng, hv, 1.0));
        let (gw, ct) = (
            gpu.upload_qmatrix(clone_q(&w)).expect("w"),
            cpu.upload_qmatrix(clone_q(&w)).expect("w"),
        );
        let (gtaps, ctaps) = (
            gpu.upload_vector(&taps).expect("taps"),
            cpu.upload_vector(&taps).expect("taps"),
        );
        let [ga, gd] = [&a_log, &dt_bias].map(|v| gpu.upload_vector(v).expect("vector"));
        let mut gst = gpu.new_gdn_state(sh).expect("state");
        let mut cst = cpu.new_gdn_state(sh).expect("state");
        for t in [1100, 1, 1030, 1, 130] {
            let what = format!("T={t} (Hk {} Hv {hv})", sh.key_heads);
            let h = randn(&mut rng, t * hidden, 1.0);
            let (a, b) = (randn(&mut rng, t * hv, 3.0), randn(&mut rng, t * hv, 3.0));
            let [qkv] = engine::backend::products(
                gpu.qmatmul_many_conv1d_silu(
                    &up(&gpu, &h, t, hidden),
                    &[&gw],
                    &gtaps,
                    &mut gst,
                    sh,
                )
                .expect("in-projection with the conv"),
            )
            .expect("one product");
            let [want] = engine::backend::products(
                cpu.qmatmul_many_conv1d_silu(
                    &up(&cpu, &h, t, hidden),
                    &[&ct],
                    &ctaps,
                    &mut cst,
                    sh,
                )
                .expect("in-projection with the conv"),
            )
            .expect("one product");
            assert_eq!(
                qkv.conv_left_to_its_reader(),
                t >= CONV_IN_PREP_MIN_TOKENS,
                "{what}: conv left to the prep"
            );
            let mut copy = gpu.clone_gdn_state(&gst).expect("state copy");
            let values = down(&gpu, &qkv);
            let (ga_t, gb_t) = (up(&gpu, &a, t, hv), up(&gpu, &b, t, hv));
            let y = gpu
                .gdn_recurrence(&qkv, &ga_t, &gb_t, &ga, &gd, &mut gst, sh)
                .expect("gdn from the lazy conv");
            let y_plain = gpu
                .gdn_recurrence(
                    &up(&gpu, &values, t, c),
                    &ga_t,
                    &gb_t,
                    &ga,
                    &gd,
                    &mut copy,
                    sh,
                )
                .expect("gdn from the conv's values");
            assert_eq!(
                bits(&down(&gpu, &y)),
                bits(&down(&gpu, &y_plain)),
                "{what}: gdn output"
            );
            let st = &gpu.device().stream;
            for (part, a, b) in [
                ("state", &gst.state, &copy.state),
                ("window", &gst.window, &copy.window),
            ] {
                let (a, b) = (st.clone_dtoh(a).expect("a"), st.clone_dtoh(b).expect("b"));
                assert_eq!(bits(&a), bits(&b), "{what}: {part}");
            }
            // Read again after the recurrence: the same bits, and the CPU's values.
            assert_eq!(
                bits(&down(&gpu, &qkv)),
                bits(&values),
                "{what}: the conv read twice"
            );
            close(&format!("conv output, {what}"), &values, &down(&cpu, &want));
            cpu.gdn_recurrence(
                &want,
                &up(&cpu, &a, t, hv),
                &up(&cpu, &b, t, hv),
                &cpu.upload_vector(&a_log).expect("a_log"),
                &cpu.upload_vector(&dt_bias).expect("dt_bias"),
                &mut cst,
                sh,
            )
            .expect("cpu gdn");
        }
        let st = &gpu.device().stream;
        close(
            "final window",
            &st.clone_dtoh(&gst.window).expect("w"),
            &cst.window,
        );
        close(
            "final state",
            &st.clone_dtoh(&gst.state).expect("s"),
            &cst.state,
        );
    }
}

/// A GDN layer's weights for `gdn_mixer_on`: the in-projections (qkv, z, a, b), conv taps, a_log,
/// dt_bias, the output norm's gains, the output projection and the next norm's gains.
struct GdnLayer {
    in_proj: [QWeight; 4],
    conv: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    norm: Vec<f32>,
    out_proj: QWeight,
    post_norm: Vec<f32>,
}

/// The GDN mixer as the model runs it (qwen3_5_moe.rs `gdn`, then its output projection into
/// the residual with the next norm) over chunks of tokens `(h, x)` from a fresh state. Per chunk:
/// the conv output, z, a, b, the gated norm of the recurrence's output, the residual and its
/// norm; then the final window and state. One token takes CUDA's lazy norm: the recurrence
/// leaves it to the output projection's staging (and the download makes it plain); on the 35B
/// shape its conv runs in the in-projections' writers.
fn gdn_mixer_on<B: Backend>(
    b: &B,
    sh: &GdnShape,
    l: &GdnLayer,
    chunks: &[(Vec<f32>, Vec<f32>)],
    state_out: impl Fn(&B, &B::GdnState) -> (Vec<f32>, Vec<f32>),
) -> Vec<Vec<f32>> {
    let q = |w: &QWeight| b.upload_qmatrix(clone_q(w)).expect("upload");
    let in_proj = l.in_proj.each_ref().map(q);
    let out_proj = q(&l.out_proj);
    let v = |x: &[f32]| b.upload_vector(x).expect("vector");
    let (conv, a_log, dt_bias, norm, post) = (
        v(&l.conv),
        v(&l.a_log),
        v(&l.dt_bias),
        v(&l.norm),
        v(&l.post_norm),
    );
    let (hidden, hv) = (l.out_proj.rows, sh.value_heads);
    let mut st = b.new_gdn_state(sh).expect("state");
    let mut outs = Vec::new();
    for (h, x) in chunks {
        let t = h.len() / hidden;
        let [qkv, z, a, beta] = engine::backend::products(
            b.qmatmul_many_conv1d_silu(
                &up(b, h, t, hidden),
                &in_proj.each_ref(),
                &conv,
                &mut st,
                sh,
            )
            .expect("in-projections with the conv"),
        )
        .expect("four products");
        let gated = b
            .gdn_recurrence_gated_norm(
                &qkv,
                &a,
                &beta,
                [&a_log, &dt_bias, &norm],
                &z,
                &mut st,
                sh,
                1e-6,
            )
            .expect("gdn with its gated norm");
        let mut residual = up(b, x, t, hidden);
        let normed = b
            .qmatmul_add_rms_norm(&gated, &out_proj, &mut residual, &post, 1e-6)
            .expect("output projection");
        assert_eq!(b.tensor_shape(&beta), (t, hv));
        for r in [&qkv, &z, &a, &beta, &gated, &residual, &normed] {
            outs.push(down(b, r));
        }
    }
    let (w, s) = state_out(b, &st);
    outs.push(w);
    outs.push(s);
    outs
}

#[test]
fn gdn_mixer_with_its_lazy_output_norm_matches() {
    let Some((cpu, gpu)) = backends_or_skip("gdn_mixer_with_its_lazy_output_norm_matches") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(41);
    // (shape, hidden): the 35B (output projection one row per warp); three value heads per key
    // head on a 256-wide model; four value heads on a 2048-wide one (output projection four rows
    // per half warp).
    let narrow = GdnShape {
        value_heads: 4,
        ..GDN_SHAPES[1]
    };
    for (sh, hidden) in [(GDN_SHAPES[0], 2048), (GDN_SHAPES[1], 256), (narrow, 2048)] {
        let (c, hv, dv) = (sh.conv_channels(), sh.value_heads, sh.value_dim);
        let l = GdnLayer {
            in_proj: [c, hv * dv, hv, hv].map(|rows| qweight(&mut rng, rows, hidden, 4)),
            conv: randn(&mut rng, sh.conv_kernel * c, 0.5),
            a_log: randn(&mut rng, hv, 1.0),
            dt_bias: randn(&mut rng, hv, 1.0),
            norm: randn(&mut rng, dv, 1.0),
            out_proj: qweight(&mut rng, hidden, hv * dv, 4),
            post_norm: randn(&mut rng, hidden, 1.0),
        };
        // A short prompt (one product per token), decode steps, a prompt on the tensor cores
        // and the token loop, a decode step, then two prompts that take the chunked recurrence
        // (the conv on its own, then in the prep) and a decode step after them.
        let chunks: Vec<_> = [5, 1, 1, 1, 70, 1, 130, 1030, 1]
            .iter()
            .map(|&t| {
                (
                    randn(&mut rng, t * hidden, 1.0),
                    randn(&mut rng, t * hidden, 1.0),
                )
            })
            .collect();
        let g = gdn_mixer_on(&gpu, &sh, &l, &chunks, |b, s| {
            let st = &b.device().stream;
            (
                st.clone_dtoh(&s.window).expect("w"),
                st.clone_dtoh(&s.state).expect("s"),
            )
        });
        let want = gdn_mixer_on(&cpu, &sh, &l, &chunks, |_, s| {
            (s.window.clone(), s.state.clone())
        });
        assert_eq!(g.len(), want.len());
        let parts = [
            "conv output",
            "z",
            "a",
            "b",
            "gated norm",
            "residual",
            "its norm",
        ];
        for (i, (a, b)) in g.iter().zip(&want).enumerate() {
            let what = match parts.get(i % parts.len()) {
                Some(p) if i < chunks.len() * parts.len() => {
                    format!("{p} of chunk {}", i / parts.len())
                }
                _ if i == chunks.len() * parts.len() => "conv window".into(),
                _ => "recurrent state".into(),
            };
            close(&format!("{what} (Hv {hv}, hidden {hidden})"), a, b);
        }
    }
}

const ATTN: AttnShape = AttnShape {
    heads: 16,
    kv_heads: 2,
    head_dim: 256,
    rotary_dim: 64,
    rope_theta: 1e7,
};

/// q/k norms, RoPE, cache append and attention (plain and gated) over chunks of (q|gate, k, v):
/// even chunks prepared by `attn_prep` (one launch on the GPU), odd ones by the separate ops,
/// into the same cache; then each chunk's gated attention again from its projections
/// (`attention_prepped_gated`).
fn attention_on<B: Backend>(
    b: &B,
    sh: &AttnShape,
    norms: &[Vec<f32>; 2],
    chunks: &[(Vec<f32>, Vec<f32>, Vec<f32>)],
) -> Vec<Vec<f32>> {
    let (h, kvh, d) = (sh.heads, sh.kv_heads, sh.head_dim);
    let total: usize = chunks.iter().map(|c| c.0.len() / (2 * h * d)).sum();
    let mut cache = b.new_kv_cache(sh, total + 3).expect("cache");
    let [qn, kn] = [0, 1].map(|i| b.upload_vector(&norms[i]).expect("norm"));
    let mut pos = 0;
    let mut outs = Vec::new();
    for (i, (qg, k, v)) in chunks.iter().enumerate() {
        let t = qg.len() / (2 * h * d);
        let (qg, k, v) = (
            up(b, qg, t, 2 * h * d),
            up(b, k, t, kvh * d),
            up(b, v, t, kvh * d),
        );
        let (q, gate) = if i % 2 == 0 {
            b.attn_prep(&qg, &k, &v, [&qn, &kn], &mut cache, sh, pos, 1e-6)
                .expect("attn_prep")
        } else {
            attn_prep_separately(b, &qg, &k, &v, [&qn, &kn], &mut cache, sh, pos, 1e-6)
                .expect("separate ops")
        };
        outs.push(down(b, &q));
        outs.push(down(b, &gate));
        outs.push(down(
            b,
            &b.attention(&q, &cache, sh, pos).expect("attention"),
        ));
        outs.push(down(
            b,
            &b.attention_gated(&q, &gate, &cache, sh, pos)
                .expect("gated attention"),
        ));
        // The layer's op from the projections (one token on a GPU: the prep in the attention's
        // blocks), rewriting the chunk's cache rows with the same values.
        outs.push(down(
            b,
            &b.attention_prepped_gated(&qg, &k, &v, [&qn, &kn], &mut cache, sh, pos, 1e-6)
                .expect("prepped gated attention"),
        ));
        pos += t;
    }
    // A snapshot continues like the original.
    let snap = b.clone_kv_cache(&cache, pos, total + 3).expect("clone");
    let q1 = up(b, &outs[0][..h * d], 1, h * d);
    outs.push(down(
        b,
        &b.attention(&q1, &snap, sh, pos - 1)
            .expect("attention on a snapshot"),
    ));
    outs
}

#[test]
fn attention_matches_at_short_and_long_contexts() {
    let Some((cpu, gpu)) = backends_or_skip("attention_matches_at_short_and_long_contexts") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(27);
    let small = AttnShape {
        heads: 6,
        kv_heads: 2,
        head_dim: 64,
        rotary_dim: 16,
        rope_theta: 1e4,
    };
    let mid = AttnShape {
        heads: 4,
        kv_heads: 1,
        head_dim: 128,
        rotary_dim: 32,
        rope_theta: 1e6,
    };
    // Qwen3.8-Flash-Next's group of 12 query heads per KV head (two tiles of 8 on the tensor cores).
    let wide = AttnShape {
        heads: 24,
        kv_heads: 2,
        head_dim: 256,
        rotary_dim: 64,
        rope_theta: 1e7,
    };
    // Head dim 512, which the split-K kernels serve at every length (no flash-attention tile).
    let deep = AttnShape {
        heads: 4,
        kv_heads: 1,
        head_dim: 512,
        rotary_dim: 64,
        rope_theta: 1e7,
    };
    // Rotary dims a multiple of 64 at head dims 64 and 128 (the whole head): prefill's attn_prep
    // then takes a warp a row, as at the 35B's 256 (ATTN, wide); small and mid keep a block a row.
    let full64 = AttnShape {
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        rotary_dim: 64,
        rope_theta: 1e4,
    };
    let full128 = AttnShape {
        heads: 4,
        kv_heads: 1,
        head_dim: 128,
        rotary_dim: 128,
        rope_theta: 1e6,
    };
    for sh in [ATTN, small, mid, wide, deep, full64, full128] {
        let (h, kvh, d) = (sh.heads, sh.kv_heads, sh.head_dim);
        // Prefill 9 (split-K), decode 1, a long chunk (flash attention: past the cache's first
        // capacity, partial tiles at both ends), a chunk of 70 after 1,311 positions, then
        // decode steps at positions over 1,380.
        let lens = [9, 1, 1300, 70, 1, 1];
        let chunks: Vec<_> = lens
            .iter()
            .map(|&t| {
                (
                    randn(&mut rng, t * 2 * h * d, 1.0),
                    randn(&mut rng, t * kvh * d, 1.0),
                    randn(&mut rng, t * kvh * d, 1.0),
                )
            })
            .collect();
        let norms = [randn(&mut rng, d, 0.5), randn(&mut rng, d, 0.5)];
        let g = attention_on(&gpu, &sh, &norms, &chunks);
        let c = attention_on(&cpu, &sh, &norms, &chunks);
        for (i, (a, b)) in g.iter().zip(&c).enumerate() {
            // Five outputs a chunk (q, gate, attention, gated attention, the same from the
            // projections), then the snapshot's.
            let flash = i % 5 >= 2 && lens.get(i / 5).is_some_and(|&t| t >= 32) && d <= 256;
            let tol = if flash { FLASH_TOL } else { TOL };
            close_within(&format!("attention (H {h}, D {d}) output {i}"), a, b, tol);
        }
    }
}

/// One query over a long cache filled by `kv_append` (no attention on the way), plain and gated.
fn long_decode_attention_on<B: Backend>(
    b: &B,
    sh: &AttnShape,
    [q, gate, k, v]: [&[f32]; 4],
    keys: usize,
) -> Vec<Vec<f32>> {
    let (h, kvh, d) = (sh.heads, sh.kv_heads, sh.head_dim);
    let mut cache = b.new_kv_cache(sh, keys).expect("cache");
    b.kv_append(
        &mut cache,
        &up(b, k, keys, kvh * d),
        &up(b, v, keys, kvh * d),
        0,
    )
    .expect("append");
    let (q, gate) = (up(b, q, 1, h * d), up(b, gate, 1, h * d));
    vec![
        down(
            b,
            &b.attention(&q, &cache, sh, keys - 1).expect("attention"),
        ),
        down(
            b,
            &b.attention_gated(&q, &gate, &cache, sh, keys - 1)
                .expect("gated attention"),
        ),
    ]
}

#[test]
fn decode_attention_over_many_tiles_a_split_matches() {
    let Some((cpu, gpu)) = backends_or_skip("decode_attention_over_many_tiles_a_split_matches")
    else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(28);
    let wide = AttnShape { heads: 24, ..ATTN };
    // 20,011 keys: the split count is capped by what the GPU holds at once, so each split walks
    // several tiles (past the kernel's stages, the last one partial).
    let keys = 20_011;
    for sh in [ATTN, wide] {
        let (h, kvh, d) = (sh.heads, sh.kv_heads, sh.head_dim);
        let q = randn(&mut rng, h * d, 1.0);
        let gate = randn(&mut rng, h * d, 1.0);
        let mut k = randn(&mut rng, keys * kvh * d, 1.0);
        let mut v = randn(&mut rng, keys * kvh * d, 1.0);
        // Values past f16's range are stored saturated, by both backends.
        k[5] = -7e4;
        v[kvh * d * 17 + 3] = 1e5;
        let inputs = [&q[..], &gate[..], &k[..], &v[..]];
        let g = long_decode_attention_on(&gpu, &sh, inputs, keys);
        let c = long_decode_attention_on(&cpu, &sh, inputs, keys);
        for (i, (a, b)) in g.iter().zip(&c).enumerate() {
            close(
                &format!("decode attention over {keys} keys (H {h}) output {i}"),
                a,
                b,
            );
        }
    }
}

/// The GPU's routing against the CPU's: the ids exactly, the weights within `TOL`.
fn same_routing(what: &str, gpu: &CudaBackend, rg: &CudaRouting, rc: &CpuRouting) {
    let n = rc.ids.len();
    let (ids, weights) = gpu.routing(rg).expect("routing");
    let ids: Vec<u32> = gpu
        .download_buf(ids)
        .expect("ids")
        .iter()
        .map(|&i| i as u32)
        .collect();
    assert_eq!(ids[..n], rc.ids[..], "routing ids {what}");
    let weights = gpu.download_buf(weights).expect("weights");
    close(
        &format!("routing weights {what}"),
        &weights[..n],
        &rc.weights,
    );
}

#[allow(clippy::too_many_arguments)]
fn moe_on<B: Backend>(
    b: &B,
    logits: &[f32],
    x: &[f32],
    w: &[QWeight; 3],
    t: usize,
    e: usize,
    k: usize,
    renorm: bool,
) -> Vec<f32> {
    let rt = b.route(&up(b, logits, t, e), k, renorm).expect("route");
    let [g, u, d] = w
        .each_ref()
        .map(|q| b.upload_qmatrix(clone_q(q)).expect("experts"));
    down(
        b,
        &b.moe_experts(&up(b, x, t, w[0].cols), &rt, &g, &u, &d)
            .expect("moe"),
    )
}

#[test]
fn routing_and_experts_match() {
    let Some((cpu, gpu)) = backends_or_skip("routing_and_experts_match") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(28);
    // (experts, top_k, hidden, intermediate, renormalise, bits)
    for (e, k, hidden, inter, renorm, bits) in [
        (256, 8, 2048, 512, true, 4),
        (8, 4, 192, 128, true, 4),
        (32, 8, 64, 64, false, 4),
        (8, 2, 128, 64, true, 8),
    ] {
        let w = [
            qweight(&mut rng, e * inter, hidden, bits),
            qweight(&mut rng, e * inter, hidden, bits),
            qweight(&mut rng, e * hidden, inter, bits),
        ];
        // Per pair (1, 5 tokens) and grouped by expert on the tensor cores (70: the 256-expert
        // shape leaves most experts a partial tile, the 8-expert one several full tiles).
        for t in [1, 5, 70] {
            let mut logits = randn(&mut rng, t * e, 3.0);
            logits[1] = logits[0]; // a tie: the lower id must win on both
            let x = randn(&mut rng, t * hidden, 1.0);
            let rc = cpu
                .route(&up(&cpu, &logits, t, e), k, renorm)
                .expect("route");
            let rg = gpu
                .route(&up(&gpu, &logits, t, e), k, renorm)
                .expect("route");
            same_routing(&format!("E={e} k={k} T={t}"), &gpu, &rg, &rc);
            close(
                &format!("experts E={e} k={k} hidden {hidden} inter {inter} q{bits} T={t}"),
                &moe_on(&gpu, &logits, &x, &w, t, e, k, renorm),
                &moe_on(&cpu, &logits, &x, &w, t, e, k, renorm),
            );
        }
    }
}

#[test]
fn experts_grouped_from_more_pairs_than_one_batch() {
    let Some((cpu, gpu)) = backends_or_skip("experts_grouped_from_more_pairs_than_one_batch")
    else {
        return;
    };
    // 4,200 tokens x 8 experts: 33,600 pairs, 33 blocks of moe_group_count (1,024 pairs each,
    // kernels/qmma.cu), so that moe_group_scan loads their counts in three batches of 16, on a
    // small shape so that the CPU reference stays quick.
    let mut rng = StdRng::seed_from_u64(29);
    let (e, k, hidden, inter, t) = (16, 8, 64, 64, 4200);
    let w = [
        qweight(&mut rng, e * inter, hidden, 4),
        qweight(&mut rng, e * inter, hidden, 4),
        qweight(&mut rng, e * hidden, inter, 4),
    ];
    let logits = randn(&mut rng, t * e, 3.0);
    let x = randn(&mut rng, t * hidden, 1.0);
    close(
        &format!("experts E={e} k={k} T={t}"),
        &moe_on(&gpu, &logits, &x, &w, t, e, k, true),
        &moe_on(&cpu, &logits, &x, &w, t, e, k, true),
    );
}

#[test]
fn quantized_gemv_matches_the_cpu_reference() {
    let Some(dev) = device_or_skip("quantized_gemv_matches_the_cpu_reference") else {
        return;
    };
    eprintln!("device {} ({})", dev.name, dev.arch);
    let mut rng = StdRng::seed_from_u64(11);
    for bits in [4, 8] {
        for (rows, cols) in [
            (1, 64),
            (3, 128),
            (65, 192),
            (257, 2048),
            (512, 4096),
            (1000, 512),
        ] {
            let w = qweight(&mut rng, rows, cols, bits);
            let x: Vec<f32> = (0..cols).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect();
            let want = r::qmatmul(&x, 1, &w);
            // Every kernel at every shape, whichever the backend would choose; the 4-bit ones
            // also on the integer tensor cores (on 3 blocks: several 16-row tiles a warp).
            let qx = [("_stream_qx", Grid::Blocks(3))];
            let qx = if bits == 4 { &qx[..] } else { &[] };
            for &variant in GEMV_KERNELS.iter().chain(qx) {
                let (got, _) = gpu_gemv(&dev, &w, &x, variant, 1);
                let err = nmse(&got, &want);
                assert!(
                    err < 1e-10,
                    "q{bits} gemv{} {rows}x{cols}: nmse {err:e}",
                    variant.0
                );
            }
        }
    }
}

#[test]
fn quantized_gemv_bandwidth_is_reported() {
    // A measurement, printed for docs/performance.md; nothing is asserted about its speed.
    let Some(dev) = device_or_skip("quantized_gemv_bandwidth_is_reported") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(12);
    let (rows, cols) = (248_320, 2048); // the lm_head of Qwen3.6-35B-A3B
    let w = qweight(&mut rng, rows, cols, 4);
    let x: Vec<f32> = (0..cols).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect();
    let expect = r::qmatmul(&x, 1, &w);
    let bytes = (rows * cols / 2 + 4 * rows * cols / 64) as f64;
    let sms = dev
        .ctx
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .expect("SM count") as u32;
    for (name, grid) in [
        ("four rows per warp", GEMV_KERNELS[0]),
        ("stream", ("_stream", Grid::Blocks(2 * sms))),
        (
            "integer tensor cores",
            ("_stream_qx", Grid::Blocks(2 * sms)),
        ),
    ] {
        let (got, ms) = gpu_gemv(&dev, &w, &x, grid, 20);
        assert!(nmse(&got, &expect) < 1e-10);
        let _ = writeln!(
            std::io::stderr(),
            "q4 GEMV ({name}) {rows}x{cols} on {}: {ms:.3} ms, {:.0} GB/s",
            dev.name,
            bytes / (ms as f64 * 1e-3) / 1e9
        );
    }
}

fn fused_on<B: Backend>(b: &B, ws: &[QWeight], t: usize, [x, y, g]: [&[f32]; 3]) -> Vec<Vec<f32>> {
    let cols = ws[0].cols;
    let qs: Vec<_> = ws
        .iter()
        .map(|w| b.upload_qmatrix(clone_q(w)).expect("w"))
        .collect();
    let refs: Vec<_> = qs.iter().collect();
    let xt = up(b, x, t, cols);
    let mut outs: Vec<Vec<f32>> = b
        .qmatmul_many(&xt, &refs)
        .expect("qmatmul_many")
        .iter()
        .map(|t| down(b, t))
        .collect();
    let mut acc = up(b, x, t, cols);
    let gain = b.upload_vector(g).expect("gain");
    let normed = b
        .add_rms_norm(&mut acc, &up(b, y, t, cols), &gain, 1e-6)
        .expect("add_rms_norm");
    outs.push(down(b, &acc));
    outs.push(down(b, &normed));
    outs
}

#[test]
fn fused_projections_and_residual_norm_match() {
    let Some((cpu, gpu)) = backends_or_skip("fused_projections_and_residual_norm_match") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(29);
    let cols = 2048;
    // The MoE block's shape: two 8-bit matrices, then two 4-bit ones; a run of five 4-bit
    // matrices (more than one launch holds; the GDN in-projections' four walk their rows on a
    // grid of two blocks per SM, `gemv_batch_stream`); the attention in-projections; odd row
    // counts (four-row warps instead of the walk); 8-bit rows walked. One token (the
    // matrix-vector kernels), 40 (the tensor cores: each launch of up to four matrices of one
    // bit width, with a partial tile of tokens) and 90 (on 64-slot tiles, a full tile and one of
    // 26 tokens).
    let sets: [Vec<(usize, u32)>; 5] = [
        vec![(256, 8), (1, 8), (512, 4), (512, 4)],
        vec![(8192, 4), (4096, 4), (32, 4), (32, 4), (100, 4)],
        vec![(8192, 4), (512, 4), (512, 4)],
        vec![(8191, 4), (4097, 4)],
        vec![(12288, 8), (2, 8)],
    ];
    for set in sets {
        let ws: Vec<QWeight> = set
            .iter()
            .map(|&(r, bits)| qweight(&mut rng, r, cols, bits))
            .collect();
        for t in [1, 40, 90] {
            let x = randn(&mut rng, t * cols, 1.0);
            let y = randn(&mut rng, t * cols, 1.0);
            let g = randn(&mut rng, cols, 1.0);
            let got = fused_on(&gpu, &ws, t, [&x, &y, &g]);
            let want = fused_on(&cpu, &ws, t, [&x, &y, &g]);
            assert_eq!(got.len(), want.len());
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                close(&format!("fused output {i} of {set:?}, T={t}"), a, b);
            }
        }
    }
}

/// A mixer's output projection into the residual with the next norm: [x + y @ p^T, the norm].
fn projection_into_residual_on<B: Backend>(
    b: &B,
    p: &QWeight,
    t: usize,
    [y, x, g]: [&[f32]; 3],
) -> [Vec<f32>; 2] {
    let pq = b.upload_qmatrix(clone_q(p)).expect("p");
    let mut residual = up(b, x, t, p.rows);
    let normed = b
        .qmatmul_add_rms_norm(
            &up(b, y, t, p.cols),
            &pq,
            &mut residual,
            &b.upload_vector(g).expect("gains"),
            1e-6,
        )
        .expect("qmatmul_add_rms_norm");
    [down(b, &residual), down(b, &normed)]
}

#[test]
fn projection_into_the_residual_with_its_norm_matches() {
    let Some((cpu, gpu)) = backends_or_skip("projection_into_the_residual_with_its_norm_matches")
    else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(31);
    // (rows, cols, bits): the 35B's output projections (one row per warp), at 8 bits too; rows
    // of 16 vectors (four rows per half warp); tiny shapes with a partial block of rows. One
    // token runs `gemv_add_norm`, three the product and the residual norm apart; 70 and 130 the
    // tensor cores, split along K where the tiles leave SMs idle (the 35B's shape in 6 parts of
    // 11 or 9 groups at 70 tokens, 3 at 130), the residual add summing the parts.
    for (rows, cols, bits) in [
        (2048, 4096, 4),
        (2048, 4096, 8),
        (2048, 512, 4),
        (192, 256, 4),
        (100, 128, 8),
    ] {
        let p = qweight(&mut rng, rows, cols, bits);
        for t in [1, 3, 70, 130] {
            let y = randn(&mut rng, t * cols, 1.0);
            let x = randn(&mut rng, t * rows, 1.0);
            let g = randn(&mut rng, rows, 1.0);
            let got = projection_into_residual_on(&gpu, &p, t, [&y, &x, &g]);
            let want = projection_into_residual_on(&cpu, &p, t, [&y, &x, &g]);
            for (part, (a, b)) in ["x + y @ p", "its norm"].iter().zip(got.iter().zip(&want)) {
                close(&format!("{part}, {rows}x{cols} q{bits} T={t}"), a, b);
            }
        }
    }
}

/// One decode step's residual stream in miniature: x += y @ p (its norm lazy on CUDA), then every
/// kind of product that reads the normed row (a matrix walked by the whole grid, a small one,
/// the in-projections' batches, the router with its top-k), the MoE block mixed into the
/// residual (its norm lazy again) and a product of that. Returns each result.
#[allow(clippy::too_many_arguments)]
fn lazy_norm_chain_on<B: Backend>(
    b: &B,
    ws: &[QWeight],
    [moe_gate, moe_up, moe_down]: &[QWeight; 3],
    [s_gate, s_up, s_down]: &[QWeight; 3],
    [y, x, g, g2]: [&[f32]; 4],
    k: usize,
) -> Vec<Vec<f32>> {
    let q = |w: &QWeight| b.upload_qmatrix(clone_q(w)).expect("upload");
    let [p, lm, small, router, sgate] = [0, 1, 2, 3, 4].map(|i| q(&ws[i]));
    let many: Vec<_> = ws[5..].iter().map(q).collect();
    let hidden = ws[0].rows;
    let mut residual = up(b, x, 1, hidden);
    let (gains, gains2) = (
        b.upload_vector(g).expect("g"),
        b.upload_vector(g2).expect("g2"),
    );
    let h = b
        .qmatmul_add_rms_norm(&up(b, y, 1, ws[0].cols), &p, &mut residual, &gains, 1e-6)
        .expect("qmatmul_add_rms_norm");
    let mut outs = vec![
        down(b, &residual),
        down(b, &b.qmatmul(&h, &lm).expect("lm")),
        down(
            b,
            &b.qmatmul(&b.last_row(&h).expect("last row"), &small)
                .expect("small"),
        ),
    ];
    let refs: Vec<_> = many.iter().collect();
    outs.extend(
        b.qmatmul_many(&h, &refs)
            .expect("many")
            .iter()
            .map(|t| down(b, t)),
    );
    let (rt, shared_logit) = b.route_tokens(&h, &router, &sgate, k, true).expect("route");
    outs.push(down(b, &shared_logit));
    let experts = [q(moe_gate), q(moe_up), q(moe_down)];
    let shared = [q(s_gate), q(s_up), q(s_down)];
    let h2 = b
        .moe_block_add_rms_norm(
            &mut residual,
            &h,
            &rt,
            experts.each_ref(),
            shared.each_ref(),
            &shared_logit,
            &gains2,
            1e-6,
        )
        .expect("moe_block_add_rms_norm");
    outs.push(down(b, &residual));
    outs.push(down(b, &h2));
    outs.push(down(
        b,
        &b.qmatmul(&h2, &small).expect("small after the MoE block"),
    ));
    outs
}

#[test]
fn products_of_a_lazily_normed_row_match() {
    let Some((cpu, gpu)) = backends_or_skip("products_of_a_lazily_normed_row_match") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(35);
    // The 35B's shapes: the output projection, an lm_head-sized matrix (walked by the grid), a
    // small 8-bit one, the router and shared-expert gate, the GDN in-projections; its experts.
    let (hidden, e, k, inter) = (2048, 256, 8, 512);
    let shapes = [
        (hidden, 4096, 4),
        (40_000, hidden, 4),
        (100, hidden, 8),
        (e, hidden, 8),
        (1, hidden, 8),
        (8192, hidden, 4),
        (4096, hidden, 4),
        (32, hidden, 4),
        (32, hidden, 4),
    ];
    let ws: Vec<QWeight> = shapes
        .iter()
        .map(|&(r, c, bits)| qweight(&mut rng, r, c, bits))
        .collect();
    let experts = [
        qweight(&mut rng, e * inter, hidden, 4),
        qweight(&mut rng, e * inter, hidden, 4),
        qweight(&mut rng, e * hidden, inter, 4),
    ];
    let shared = [
        qweight(&mut rng, inter, hidden, 4),
        qweight(&mut rng, inter, hidden, 4),
        qweight(&mut rng, hidden, inter, 4),
    ];
    let y = randn(&mut rng, 4096, 1.0);
    let x = randn(&mut rng, hidden, 1.0);
    let g = randn(&mut rng, hidden, 1.0);
    let g2 = randn(&mut rng, hidden, 1.0);
    let args = [&y[..], &x[..], &g[..], &g2[..]];
    let got = lazy_norm_chain_on(&gpu, &ws, &experts, &shared, args, k);
    let want = lazy_norm_chain_on(&cpu, &ws, &experts, &shared, args, k);
    assert_eq!(got.len(), want.len());
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        close(&format!("result {i} of the lazily normed chain"), a, b);
    }
}

#[test]
fn routing_breaks_ties_to_the_lowest_id() {
    let Some((cpu, gpu)) = backends_or_skip("routing_breaks_ties_to_the_lowest_id") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(33);
    for (e, k) in [(256, 8), (512, 10), (40, 32), (8, 8)] {
        // Logits from four values: most of the top k are ties.
        let t = 4;
        let logits: Vec<f32> = (0..t * e)
            .map(|_| rng.random_range(0..4) as f32 * 0.5)
            .collect();
        let rc = cpu.route(&up(&cpu, &logits, t, e), k, true).expect("cpu");
        let rg = gpu.route(&up(&gpu, &logits, t, e), k, true).expect("gpu");
        same_routing(&format!("of tied logits E={e} k={k}"), &gpu, &rg, &rc);
    }
    // Signed zeros among the ties: -0.0 below +0.0 on both (IEEE total order, reference::route).
    let signed: Vec<f32> = (0..4 * 256)
        .map(|_| [-0.5f32, -0.0, 0.0, 0.5][rng.random_range(0..4)])
        .collect();
    let rc = cpu.route(&up(&cpu, &signed, 4, 256), 8, true).expect("cpu");
    let rg = gpu.route(&up(&gpu, &signed, 4, 256), 8, true).expect("gpu");
    same_routing("of signed zeros", &gpu, &rg, &rc);
    // Past what the kernel holds: a clear error, not a wrong answer.
    let logits = vec![0.0f32; 600];
    let err = gpu
        .route(&up(&gpu, &logits, 1, 600), 8, true)
        .err()
        .expect("600 experts are refused");
    assert!(err.to_string().contains("600 experts"), "{err}");
}

/// The routing kernel settles the top k from the keys at or above the k-th largest of its 32
/// lanes' largest keys (lane l holds experts l, l + 32, ...), and falls back to k rounds of warp
/// maxima when more than 32 keys reach that threshold. Large logits on the experts of a few lanes
/// make it do so; random ones take the threshold path. Both must choose as the reference does.
#[test]
fn routing_with_its_largest_logits_in_few_lanes_matches() {
    let Some((cpu, gpu)) = backends_or_skip("routing_with_its_largest_logits_in_few_lanes_matches")
    else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(34);
    for (e, k, lanes) in [(256, 8, 7), (256, 8, 1), (512, 10, 4), (512, 10, 0)] {
        let t = 3;
        let mut logits = randn(&mut rng, t * e, 1.0);
        for (i, l) in logits.iter_mut().enumerate() {
            if (i % e) % 32 < lanes {
                *l += 10.0;
            }
        }
        let rc = cpu.route(&up(&cpu, &logits, t, e), k, true).expect("cpu");
        let rg = gpu.route(&up(&gpu, &logits, t, e), k, true).expect("gpu");
        same_routing(
            &format!("E={e} k={k}, the largest logits in {lanes} lanes"),
            &gpu,
            &rg,
            &rc,
        );
    }
}

#[test]
fn router_product_with_its_routing_matches() {
    let Some((cpu, gpu)) = backends_or_skip("router_product_with_its_routing_matches") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(31);
    // (experts, top_k, hidden, bits, renormalise): one token's routing is left pending by the
    // router product on CUDA and done when read (here by `routing`, in a MoE block by its
    // gate/up kernel); more tokens take the product and the routing launch.
    for (e, k, hidden, bits, renorm) in [
        (256, 8, 2048, 8, true),
        (8, 4, 192, 4, true),
        (32, 8, 64, 8, false),
        (256, 8, 64, 8, true),
        // qwen4_exp's 512 experts, top 10; and a count between the kernel's two key widths.
        (512, 10, 2048, 8, true),
        (300, 10, 512, 8, false),
    ] {
        let router = qweight(&mut rng, e, hidden, bits);
        let gate = qweight(&mut rng, 1, hidden, bits);
        for t in [1, 3] {
            let x = randn(&mut rng, t * hidden, 1.0);
            let (rc, gc) = cpu
                .route_tokens(
                    &up(&cpu, &x, t, hidden),
                    &clone_q(&router),
                    &clone_q(&gate),
                    k,
                    renorm,
                )
                .expect("route_tokens");
            let (rg, gg) = gpu
                .route_tokens(
                    &up(&gpu, &x, t, hidden),
                    &gpu.upload_qmatrix(clone_q(&router)).expect("router"),
                    &gpu.upload_qmatrix(clone_q(&gate)).expect("gate"),
                    k,
                    renorm,
                )
                .expect("route_tokens");
            let what = format!("E={e} k={k} hidden {hidden} q{bits} T={t}");
            same_routing(&what, &gpu, &rg, &rc);
            close(
                &format!("shared gate logit {what}"),
                &down(&gpu, &gg),
                &down(&cpu, &gc),
            );
        }
    }
}

#[test]
fn many_tokens_routed_from_a_router_product_in_parts_match() {
    let Some((cpu, gpu)) =
        backends_or_skip("many_tokens_routed_from_a_router_product_in_parts_match")
    else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(32);
    // (experts, top_k, hidden, router bits, shared gate bits, renormalise). From 8 tokens the
    // router's and the shared gate's products run on the tensor cores in one launch, split along
    // K into as many parts as fill the GPU where their tiles would not (for the 35B shape 8 parts
    // of 4 groups at 8 and 70 tokens, 3 of 11, 11 and 10 at 1,100; 9 groups: parts of 5 and 4;
    // 3 groups or 1: one part), and moe_route adds the parts of both. A router and gate of
    // different widths take two launches, unsplit.
    for (e, k, hidden, router_bits, gate_bits, renorm) in [
        (256, 8, 2048, 8, 8, true),
        (8, 4, 192, 4, 8, true),
        (32, 8, 64, 8, 8, false),
        (512, 10, 2048, 8, 8, true),
        (300, 10, 576, 8, 8, false),
    ] {
        let router = qweight(&mut rng, e, hidden, router_bits);
        let gate = qweight(&mut rng, 1, hidden, gate_bits);
        let gpu_router = gpu.upload_qmatrix(clone_q(&router)).expect("router");
        let gpu_gate = gpu.upload_qmatrix(clone_q(&gate)).expect("gate");
        let (mut compared, mut tokens) = (0, 0);
        for t in [8, 70, 1100] {
            let x = randn(&mut rng, t * hidden, 1.0);
            let what =
                format!("E={e} k={k} hidden {hidden} q{router_bits} gate q{gate_bits} T={t}");
            // The reference, as the CPU's route_tokens computes it (the products, then the
            // routing), keeping the logits for the margins below.
            let logits = qmatmul_on(&cpu, &router, &x, t);
            let rc = cpu
                .route(&up(&cpu, &logits, t, e), k, renorm)
                .expect("route");
            let gate_want = qmatmul_on(&cpu, &gate, &x, t);
            let route = || {
                let (rt, gl) = gpu
                    .route_tokens(&up(&gpu, &x, t, hidden), &gpu_router, &gpu_gate, k, renorm)
                    .expect("route_tokens");
                let (ids, weights) = gpu.routing(&rt).expect("routing");
                let ids = gpu.download_buf(ids).expect("ids");
                let weights = gpu.download_buf(weights).expect("weights");
                (ids, weights, down(&gpu, &gl))
            };
            let (ids, weights, gate_logits) = route();
            close(
                &format!("shared gate logit {what}"),
                &gate_logits,
                &gate_want,
            );
            // The parts add in a fixed order: the same bits every time.
            let again = route();
            assert_eq!(ids, again.0, "ids read twice {what}");
            assert_eq!(bits(&weights), bits(&again.1), "weights read twice {what}");
            assert_eq!(bits(&gate_logits), bits(&again.2), "gate read twice {what}");
            // The chosen experts compared where the reference's k-th and (k+1)-th logits are
            // further apart than the products' rounding can move them.
            let (mut want_w, mut got_w) = (Vec::new(), Vec::new());
            tokens += t;
            for tok in 0..t {
                let mut row = logits[tok * e..(tok + 1) * e].to_vec();
                row.sort_by(|a, b| b.total_cmp(a));
                let scale = row[0].abs().max(row[e - 1].abs()).max(1.0);
                if k < e && row[k - 1] - row[k] < 1e-4 * scale {
                    continue;
                }
                compared += 1;
                // The chosen set, by id: two chosen experts whose logits nearly tie may come in
                // either order.
                let span = tok * k..(tok + 1) * k;
                let mut got: Vec<(u32, f32)> = ids[span.clone()]
                    .iter()
                    .map(|&i| i as u32)
                    .zip(weights[span.clone()].iter().copied())
                    .collect();
                let mut want: Vec<(u32, f32)> = rc.ids[span.clone()]
                    .iter()
                    .copied()
                    .zip(rc.weights[span].iter().copied())
                    .collect();
                got.sort_by_key(|p| p.0);
                want.sort_by_key(|p| p.0);
                let ids_of = |v: &[(u32, f32)]| v.iter().map(|p| p.0).collect::<Vec<_>>();
                assert_eq!(
                    ids_of(&got),
                    ids_of(&want),
                    "routing ids {what} token {tok}"
                );
                got_w.extend(got.iter().map(|p| p.1));
                want_w.extend(want.iter().map(|p| p.1));
            }
            close(&format!("routing weights {what}"), &got_w, &want_w);
        }
        assert!(
            compared * 20 >= tokens * 19,
            "E={e} k={k}: only {compared} of {tokens} tokens had a clear k-th expert"
        );
    }
}

/// `t`'s products, from the split that the op which wrote `t` wrote with it (or without one,
/// `split` false), against the products of the same values uploaded afresh, which the split pass
/// splits: bit for bit the same, as a split has the same bits whichever kernel wrote it.
fn products_as_from_the_split_pass(
    what: &str,
    gpu: &CudaBackend,
    t: &CudaTensor,
    w: &CudaQMatrix,
    split: bool,
) {
    assert_eq!(t.has_split(), split, "{what}: split written");
    let (rows, cols) = gpu.tensor_shape(t);
    let fresh = up(gpu, &down(gpu, t), rows, cols);
    assert!(!fresh.has_split(), "an uploaded tensor carries no split");
    let got = down(gpu, &gpu.qmatmul(t, w).expect("product"));
    let want = down(gpu, &gpu.qmatmul(&fresh, w).expect("product"));
    let same = got
        .iter()
        .zip(&want)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "{what}: the products differ from the split pass's");
    let _ = writeln!(
        std::io::stderr(),
        "{what}: split {split}, products bit for bit"
    );
}

#[test]
fn splits_written_with_the_products_inputs_match_the_split_pass() {
    let Some(gpu) = cuda_or_skip("splits_written_with_the_products_inputs_match_the_split_pass")
    else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(41);
    let (cols, dim, eps) = (512, 128, 1e-6);
    let w = gpu
        .upload_qmatrix(qweight(&mut rng, 96, cols, 4))
        .expect("w");
    let gains = gpu
        .upload_vector(&randn(&mut rng, cols, 1.0))
        .expect("gains");
    let head_gains = gpu
        .upload_vector(&randn(&mut rng, dim, 1.0))
        .expect("gains");
    // 40 tokens: the norms' block-a-row kernels (and 160 heads of the gated norm, a block each);
    // 300: 1,200 heads, two rows a warp. 7: too few rows for the tensor cores, so no split.
    for t in [40, 300, 7] {
        let split = t >= 8;
        let x = randn(&mut rng, t * cols, 2.0);
        let y = up(&gpu, &randn(&mut rng, t * cols, 2.0), t, cols);
        let z = up(&gpu, &randn(&mut rng, t * cols, 3.0), t, cols);
        let xt = up(&gpu, &x, t, cols);
        let what = |op: &str| format!("{op}, T={t}");
        let normed = gpu.rms_norm(&xt, &gains, eps).expect("rms_norm");
        products_as_from_the_split_pass(&what("rms_norm"), &gpu, &normed, &w, split);
        let gated = gpu
            .gated_rms_norm(&xt, &z, &head_gains, dim, eps)
            .expect("gated_rms_norm");
        products_as_from_the_split_pass(&what("gated_rms_norm"), &gpu, &gated, &w, split);
        // Heads as wide as the row: at 300 tokens two 8-column blocks a lane (`rms_norm_rows8`).
        let wide = gpu
            .gated_rms_norm(&xt, &z, &gains, cols, eps)
            .expect("gated_rms_norm");
        products_as_from_the_split_pass(
            &what("gated_rms_norm, 512-wide heads"),
            &gpu,
            &wide,
            &w,
            split,
        );
        let mut resid = up(&gpu, &x, t, cols);
        let added = gpu
            .add_rms_norm(&mut resid, &y, &gains, eps)
            .expect("add_rms_norm");
        products_as_from_the_split_pass(&what("add_rms_norm"), &gpu, &added, &w, split);
        let gate = gpu.sigmoid_mul(&xt, &y).expect("sigmoid_mul");
        products_as_from_the_split_pass(&what("sigmoid_mul"), &gpu, &gate, &w, split);
        // Not a product's input: no split.
        let heads = gpu
            .head_rms_norm(&xt, &head_gains, dim, eps)
            .expect("head_rms_norm");
        products_as_from_the_split_pass(&what("head_rms_norm"), &gpu, &heads, &w, false);
        // Changed in place: the split of its old values goes.
        let mut changed = gpu.rms_norm(&xt, &gains, eps).expect("rms_norm");
        gpu.add_assign(&mut changed, &y).expect("add");
        products_as_from_the_split_pass(
            &what("rms_norm, then added to"),
            &gpu,
            &changed,
            &w,
            false,
        );
        // The MoE block's residual add and next norm (8 experts, top 2, shared expert).
        let (e, k, inter) = (8, 2, 128);
        let q = [
            qweight(&mut rng, e * inter, cols, 4),
            qweight(&mut rng, e * inter, cols, 4),
            qweight(&mut rng, e * cols, inter, 4),
            qweight(&mut rng, inter, cols, 4),
            qweight(&mut rng, inter, cols, 4),
            qweight(&mut rng, cols, inter, 4),
        ]
        .map(|q| gpu.upload_qmatrix(q).expect("experts"));
        let rt = gpu
            .route(&up(&gpu, &randn(&mut rng, t * e, 3.0), t, e), k, true)
            .expect("route");
        let gl = up(&gpu, &randn(&mut rng, t, 3.0), t, 1);
        let mut resid = up(&gpu, &x, t, cols);
        let mixed = gpu
            .moe_block_add_rms_norm(
                &mut resid,
                &normed,
                &rt,
                [&q[0], &q[1], &q[2]],
                [&q[3], &q[4], &q[5]],
                &gl,
                &gains,
                eps,
            )
            .expect("moe_block_add_rms_norm");
        products_as_from_the_split_pass(&what("moe_block_add_rms_norm"), &gpu, &mixed, &w, split);
    }
}

/// Outputs kept as their split alone (`kept_as_split`: many tokens' norms and output gate)
/// read as values after what they were made of has moved on: the residual added to again, the
/// gated norm's z and the gate's input changed in place. Each must read as the CPU's values of
/// the inputs it was made from, and its last row (remade alone) as the last row of the whole.
#[test]
fn values_kept_as_a_split_are_remade_from_their_own_inputs() {
    let Some((cpu, gpu)) =
        backends_or_skip("values_kept_as_a_split_are_remade_from_their_own_inputs")
    else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(43);
    let (t, cols, dim, eps) = (300, 512, 128, 1e-6);
    let [x, y, y2, z] = [2.0, 2.0, 2.0, 3.0].map(|s| randn(&mut rng, t * cols, s));
    let gains = randn(&mut rng, cols, 1.0);
    let head_gains = randn(&mut rng, dim, 1.0);
    let want = |b: &CpuBackend| {
        let g = b.upload_vector(&gains).expect("gains");
        let hg = b.upload_vector(&head_gains).expect("gains");
        let mut resid = up(b, &x, t, cols);
        let first = b.add_rms_norm(&mut resid, &up(b, &y, t, cols), &g, eps);
        let gated = b.gated_rms_norm(&up(b, &x, t, cols), &up(b, &z, t, cols), &hg, dim, eps);
        let gate = b.sigmoid_mul(&up(b, &x, t, cols), &up(b, &y, t, cols));
        [first, gated, gate].map(|o| down(b, &o.expect("op")))
    };
    let want = want(&cpu);
    let g = gpu.upload_vector(&gains).expect("gains");
    let hg = gpu.upload_vector(&head_gains).expect("gains");
    let mut resid = up(&gpu, &x, t, cols);
    let first = gpu
        .add_rms_norm(&mut resid, &up(&gpu, &y, t, cols), &g, eps)
        .expect("add_rms_norm");
    // The next residual add, then an add in place, while `first` still remakes from the
    // residual it made.
    let second = gpu
        .add_rms_norm(&mut resid, &up(&gpu, &y2, t, cols), &g, eps)
        .expect("add_rms_norm");
    gpu.add_assign(&mut resid, &up(&gpu, &y2, t, cols))
        .expect("add");
    let (xt, mut zt, mut yt) = (
        up(&gpu, &x, t, cols),
        up(&gpu, &z, t, cols),
        up(&gpu, &y, t, cols),
    );
    let gated = gpu
        .gated_rms_norm(&xt, &zt, &hg, dim, eps)
        .expect("gated_rms_norm");
    let gate = gpu.sigmoid_mul(&xt, &yt).expect("sigmoid_mul");
    // The caller's tensors that those two remake from, changed in place.
    gpu.add_assign(&mut zt, &up(&gpu, &y2, t, cols))
        .expect("add");
    gpu.add_assign(&mut yt, &up(&gpu, &y2, t, cols))
        .expect("add");
    for (what, out, want) in [
        ("add_rms_norm", &first, &want[0]),
        ("gated_rms_norm", &gated, &want[1]),
        ("sigmoid_mul", &gate, &want[2]),
    ] {
        assert!(out.kept_as_split(), "{what}: kept as its split");
        let got = down(&gpu, out);
        close(&format!("{what} remade, T={t}"), &got, want);
        let last = down(&gpu, &gpu.last_row(out).expect("last_row"));
        assert_eq!(
            bits(&last),
            bits(&got[(t - 1) * cols..]),
            "{what}: the last row remade alone"
        );
    }
    assert!(second.kept_as_split(), "the second add_rms_norm: kept");
}

/// The MoE block's output, and (with a residual and norm gains) the fused residual add and norm:
/// [moe, x + moe, rmsnorm(x + moe) * g].
#[allow(clippy::too_many_arguments)]
fn moe_block_on<B: Backend>(
    b: &B,
    logits: &[f32],
    x: &[f32],
    gl: &[f32],
    (resid, gains): (&[f32], &[f32]),
    w: &[QWeight; 6],
    t: usize,
    e: usize,
    k: usize,
) -> [Vec<f32>; 3] {
    let rt = b.route(&up(b, logits, t, e), k, true).expect("route");
    let q: Vec<_> = w
        .iter()
        .map(|q| b.upload_qmatrix(clone_q(q)).expect("w"))
        .collect();
    let hidden = w[0].cols;
    let (h, gl) = (up(b, x, t, hidden), up(b, gl, t, 1));
    let experts = [&q[0], &q[1], &q[2]];
    let shared = [&q[3], &q[4], &q[5]];
    let out = b
        .moe_block(&h, &rt, experts, shared, &gl)
        .expect("moe_block");
    let mut residual = up(b, resid, t, hidden);
    let normed = b
        .moe_block_add_rms_norm(
            &mut residual,
            &h,
            &rt,
            experts,
            shared,
            &gl,
            &b.upload_vector(gains).expect("gains"),
            1e-6,
        )
        .expect("moe_block_add_rms_norm");
    [down(b, &out), down(b, &residual), down(b, &normed)]
}

#[test]
fn moe_block_with_the_shared_expert_matches() {
    let Some((cpu, gpu)) = backends_or_skip("moe_block_with_the_shared_expert_matches") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(30);
    // (experts, top_k, hidden, expert intermediate, shared intermediate, bits): the 35B shape;
    // tiny-alt's, whose shared expert is narrower than its experts; 8-bit experts with top 9, the
    // most pairs one token's fused down-and-mix kernel holds (`moe_down_mix`); expert rows of 32
    // vectors of codes, which that kernel's half warps walk in two rounds; rows wider than the
    // mixing kernel takes (2,048), mixed and then normed by add_rms_norm.
    for (e, k, hidden, inter, inter_s, bits) in [
        (256, 8, 2048, 512, 512, 4),
        (8, 4, 192, 128, 64, 4),
        (16, 9, 320, 256, 128, 8),
        (16, 4, 256, 1024, 512, 4),
        (8, 2, 2560, 64, 64, 4),
    ] {
        let w = [
            qweight(&mut rng, e * inter, hidden, bits),
            qweight(&mut rng, e * inter, hidden, bits),
            qweight(&mut rng, e * hidden, inter, bits),
            qweight(&mut rng, inter_s, hidden, bits),
            qweight(&mut rng, inter_s, hidden, bits),
            qweight(&mut rng, hidden, inter_s, bits),
        ];
        for t in [1, 3, 100] {
            let logits = randn(&mut rng, t * e, 3.0);
            let x = randn(&mut rng, t * hidden, 1.0);
            let gl = randn(&mut rng, t, 3.0);
            let resid = randn(&mut rng, t * hidden, 1.0);
            let gains = randn(&mut rng, hidden, 1.0);
            let norm = (&resid[..], &gains[..]);
            let g = moe_block_on(&gpu, &logits, &x, &gl, norm, &w, t, e, k);
            let c = moe_block_on(&cpu, &logits, &x, &gl, norm, &w, t, e, k);
            for (part, (g, c)) in ["moe_block", "+ residual", "+ residual, normed"]
                .iter()
                .zip(g.iter().zip(&c))
            {
                close(
                    &format!("{part} E={e} k={k} inter {inter} shared {inter_s} q{bits} T={t}"),
                    g,
                    c,
                );
            }
        }
    }
}
