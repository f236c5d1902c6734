//! Every CPU backend op against the plain reference (backend/cpu/reference.rs) on random
//! inputs, at the model's shapes and at awkward ones. Errors are normalised (NMSE, as
//! llama.cpp's test-backend-ops does) or absolute where values are O(1).

use common::{nmse, qweight, randn};
use engine::backend::cpu::reference as r;
use engine::backend::cpu::{CpuBackend, CpuTensor};
use engine::backend::{AttnShape, Backend, GdnShape};
use engine::checkpoint::{HostSlice, QWeight};
use half::bf16;
use rand::SeedableRng;
use rand::rngs::StdRng;

mod common;

fn backend() -> CpuBackend {
    CpuBackend::new(2).expect("thread pool")
}

fn tensor(b: &CpuBackend, data: Vec<f32>, rows: usize, cols: usize) -> CpuTensor {
    b.upload_tensor(&data, rows, cols).expect("upload")
}

fn assert_nmse(what: &str, a: &[f32], e: &[f32], tol: f64) {
    assert!(a.iter().all(|v| v.is_finite()), "{what}: non-finite output");
    let err = nmse(a, e);
    assert!(err <= tol, "{what}: nmse {err:e} > {tol:e}");
}

#[test]
fn qmatmul_matches_reference_for_all_paths() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(1);
    // (rows, cols, tokens): decode GEMV (t<=2) and prefill GEMM paths, model-like and awkward.
    let cases = [
        (1, 64, 1),
        (3, 128, 1),
        (65, 192, 2),
        (127, 320, 3),
        (257, 2048, 1),
        (100, 512, 17),
        (512, 2048, 5),
        (33, 64, 40),
    ];
    for bits in [4, 8] {
        for &(rows, cols, t) in &cases {
            let w = qweight(&mut rng, rows, cols, bits);
            let x = randn(&mut rng, t * cols, 1.0);
            let expect = r::qmatmul(&x, t, &w);
            let xt = tensor(&b, x, t, cols);
            let got = b.qmatmul(&xt, &w).expect("qmatmul");
            assert_eq!((got.rows, got.cols), (t, rows));
            assert_nmse(
                &format!("qmatmul q{bits} {rows}x{cols} t={t}"),
                &got.data,
                &expect,
                1e-10,
            );
        }
    }
}

#[test]
fn qmatmul_rejects_a_mismatched_input() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(2);
    let w = qweight(&mut rng, 8, 128, 4);
    let x = tensor(&b, vec![0.0; 64], 1, 64);
    let err = b.qmatmul(&x, &w).expect_err("must fail").to_string();
    assert!(err.contains("64 columns") && err.contains("128"), "{err}");
}

#[test]
fn leaving_kernels_out_of_decode_is_refused_on_the_cpu() {
    // `lily bench --without-kernel` needs recorded decode steps (the CUDA backend's).
    let err = backend()
        .leave_out_of_decode("gemv")
        .expect_err("the CPU backend records no decode steps");
    assert!(err.to_string().contains("GPU only"), "{err}");
}

#[test]
fn dequant_agrees_with_the_mlx_packing_rule() {
    // 0x22111100 holds codes 0,0,1,1,1,1,2,2 (low nibble first).
    let w = QWeight {
        name: "packing".into(),
        codes: HostSlice::from_vec(vec![0x2211_1100; 8]),
        scales: HostSlice::from_vec(vec![bf16::from_f32(0.5)]),
        biases: HostSlice::from_vec(vec![bf16::from_f32(-1.0)]),
        rows: 1,
        cols: 64,
        bits: 4,
        group_size: 64,
    };
    let mut row = vec![0.0; 64];
    r::dequant_row(&w, 0, &mut row);
    assert_eq!(&row[..8], &[-1.0, -1.0, -0.5, -0.5, -0.5, -0.5, 0.0, 0.0]);
    let b = backend();
    let e = b.embed(&w, &[0]).expect("embed");
    assert_eq!(e.data, row);
    assert!(
        b.embed(&w, &[1]).is_err(),
        "out-of-range token must be an error"
    );
}

#[test]
fn embed_and_norms_match_reference() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(3);
    let table = qweight(&mut rng, 1000, 192, 4);
    let toks = [0u32, 999, 17, 17, 500];
    let got = b.embed(&table, &toks).expect("embed");
    assert_nmse("embed", &got.data, &r::embed(&table, &toks), 0.0);

    for (rows, cols, dim) in [
        (1, 2048, 2048),
        (5, 192, 192),
        (3, 512, 128),
        (2, 1024, 256),
    ] {
        let x = randn(&mut rng, rows * cols, 3.0);
        let w = randn(&mut rng, dim, 1.5);
        let xt = tensor(&b, x.clone(), rows, cols);
        let got = b.head_rms_norm(&xt, &w, dim, 1e-6).expect("norm");
        assert_nmse(
            "head_rms_norm",
            &got.data,
            &r::rms_norm(&x, dim, &w, 1e-6),
            1e-12,
        );
        let z = randn(&mut rng, rows * cols, 3.0);
        let zt = tensor(&b, z.clone(), rows, cols);
        let got = b
            .gated_rms_norm(&xt, &zt, &w, dim, 1e-6)
            .expect("gated norm");
        assert_nmse(
            "gated_rms_norm",
            &got.data,
            &r::gated_rms_norm(&x, &z, &w, dim, 1e-6),
            1e-12,
        );
        if dim == cols {
            let got = b.rms_norm(&xt, &w, 1e-6).expect("rms_norm");
            assert_nmse(
                "rms_norm",
                &got.data,
                &r::rms_norm(&x, cols, &w, 1e-6),
                1e-12,
            );
        }
    }
}

#[test]
fn elementwise_ops_match_reference() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(4);
    let (rows, cols) = (3, 320);
    let g = randn(&mut rng, rows * cols, 6.0);
    let u = randn(&mut rng, rows * cols, 2.0);
    let (gt, ut) = (
        tensor(&b, g.clone(), rows, cols),
        tensor(&b, u.clone(), rows, cols),
    );
    assert_nmse(
        "swiglu",
        &b.swiglu(&gt, &ut).expect("swiglu").data,
        &r::swiglu(&g, &u),
        1e-14,
    );
    let sm: Vec<f32> = g.iter().zip(&u).map(|(x, y)| x * r::sigmoid(*y)).collect();
    assert_nmse(
        "sigmoid_mul",
        &b.sigmoid_mul(&gt, &ut).expect("sigmoid_mul").data,
        &sm,
        1e-14,
    );
    let mut acc = gt.clone();
    b.add_assign(&mut acc, &ut).expect("add");
    let sum: Vec<f32> = g.iter().zip(&u).map(|(x, y)| x + y).collect();
    assert_eq!(acc.data, sum);
    let gate = randn(&mut rng, rows, 4.0);
    let gate_t = tensor(&b, gate.clone(), rows, 1);
    let mut out = gt.clone();
    b.add_sigmoid_gated(&mut out, &ut, &gate_t)
        .expect("gated add");
    let expect: Vec<f32> = (0..rows * cols)
        .map(|i| g[i] + r::sigmoid(gate[i / cols]) * u[i])
        .collect();
    assert_nmse("add_sigmoid_gated", &out.data, &expect, 1e-14);
    let last = b.last_row(&gt).expect("last_row");
    assert_eq!(last.data, g[(rows - 1) * cols..].to_vec());
}

#[test]
fn argmax_takes_the_first_maximum_and_skips_nan() {
    let b = backend();
    let mut row = vec![0.0f32; 4096];
    row[513] = 7.0;
    row[3501] = 7.0;
    row[10] = f32::NAN;
    let t = tensor(&b, row, 1, 4096);
    assert_eq!(b.argmax_rows(&t).expect("argmax"), vec![513]);
    assert_eq!(r::argmax(&[f32::NAN, -1.0, -1.0]), 1);
    let two = tensor(&b, vec![1.0, 3.0, 2.0, 5.0, 5.0, 0.0], 2, 3);
    assert_eq!(b.argmax_rows(&two).expect("argmax"), vec![1, 0]);
    // -0.0 is below +0.0 (IEEE total order, as the GPU's packed keys): a later +0.0 wins.
    assert_eq!(r::argmax(&[-1.0, -0.0, 0.0, -0.0]), 2);
    assert_eq!(r::argmax(&[0.0, -0.0]), 0);
    assert_eq!(r::argmax(&[f32::NAN, f32::NAN]), 0);
}

fn gdn_shapes() -> Vec<GdnShape> {
    vec![
        GdnShape {
            key_heads: 2,
            value_heads: 4,
            key_dim: 128,
            value_dim: 128,
            conv_kernel: 4,
        },
        GdnShape {
            key_heads: 2,
            value_heads: 6,
            key_dim: 128,
            value_dim: 128,
            conv_kernel: 4,
        },
        GdnShape {
            key_heads: 1,
            value_heads: 1,
            key_dim: 16,
            value_dim: 24,
            conv_kernel: 2,
        },
    ]
}

#[test]
fn conv_and_gated_delta_rule_match_reference_and_resume_exactly() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(5);
    for sh in gdn_shapes() {
        let c = sh.conv_channels();
        let t = 9;
        let x = randn(&mut rng, t * c, 1.0);
        let w = randn(&mut rng, sh.conv_kernel * c, 0.5);
        let a = randn(&mut rng, t * sh.value_heads, 2.0);
        let beta = randn(&mut rng, t * sh.value_heads, 2.0);
        let a_log = randn(&mut rng, sh.value_heads, 1.0);
        let dt_bias = randn(&mut rng, sh.value_heads, 1.0);

        // Reference over all tokens at once.
        let mut window = vec![0.0; (sh.conv_kernel - 1) * c];
        let conv_ref = r::conv1d_silu(&x, t, c, &w, &mut window, sh.conv_kernel);
        let mut s_ref = vec![0.0; sh.value_heads * sh.value_dim * sh.key_dim];
        let y_ref = r::gdn_recurrence(&conv_ref, &a, &beta, &a_log, &dt_bias, &mut s_ref, &sh, t);

        // Backend in two pieces (prefill of 5, then 4 single-token decode steps) on one state.
        let mut st = b.new_gdn_state(&sh).expect("state");
        let mut conv_out = Vec::new();
        let mut y_out = Vec::new();
        let pieces: [(usize, usize); 5] = [(0, 5), (5, 6), (6, 7), (7, 8), (8, 9)];
        for (lo, hi) in pieces {
            let n = hi - lo;
            let xt = tensor(&b, x[lo * c..hi * c].to_vec(), n, c);
            let conv = b.conv1d_silu(&xt, &w, &mut st, &sh).expect("conv");
            let hv = sh.value_heads;
            let at = tensor(&b, a[lo * hv..hi * hv].to_vec(), n, hv);
            let bt = tensor(&b, beta[lo * hv..hi * hv].to_vec(), n, hv);
            let y = b
                .gdn_recurrence(&conv, &at, &bt, &a_log, &dt_bias, &mut st, &sh)
                .expect("gdn");
            conv_out.extend(conv.data);
            y_out.extend(y.data);
        }
        assert_nmse(&format!("conv1d {sh:?}"), &conv_out, &conv_ref, 1e-14);
        assert_nmse(&format!("gdn output {sh:?}"), &y_out, &y_ref, 1e-10);
        assert_nmse(&format!("gdn state {sh:?}"), &st.state, &s_ref, 1e-10);
        assert_eq!(st.window, window, "conv window after resuming");

        // Reset returns to a fresh sequence.
        b.reset_gdn_state(&mut st).expect("reset");
        assert!(st.state.iter().chain(&st.window).all(|v| *v == 0.0));
    }
}

#[test]
fn attention_with_cache_matches_reference() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(6);
    let shapes = [
        AttnShape {
            heads: 4,
            kv_heads: 2,
            head_dim: 256,
            rotary_dim: 64,
            rope_theta: 1e7,
        },
        AttnShape {
            heads: 6,
            kv_heads: 2,
            head_dim: 256,
            rotary_dim: 64,
            rope_theta: 1e7,
        },
        AttnShape {
            heads: 3,
            kv_heads: 3,
            head_dim: 32,
            rotary_dim: 32,
            rope_theta: 1e4,
        },
    ];
    for sh in shapes {
        let (h, kvh, d) = (sh.heads, sh.kv_heads, sh.head_dim);
        let t_total = 13;
        let q_gate = randn(&mut rng, t_total * 2 * h * d, 1.0);
        let k = randn(&mut rng, t_total * kvh * d, 1.0);
        let v = randn(&mut rng, t_total * kvh * d, 1.0);
        let (q, gate) = r::split_q_gate(&q_gate, t_total, h, d);
        let qgt = tensor(&b, q_gate.clone(), t_total, 2 * h * d);
        let (bq, bg) = b.split_q_gate(&qgt, h, d).expect("split");
        assert_eq!(bq.data, q);
        assert_eq!(bg.data, gate);

        let mut q_ref = q.clone();
        let mut k_ref = k.clone();
        r::rope(&mut q_ref, t_total, &sh, h, 0);
        r::rope(&mut k_ref, t_total, &sh, kvh, 0);
        // The cache holds K and V as f16 values.
        let k_held: Vec<f32> = k_ref.iter().map(|&x| r::kv_value(x)).collect();
        let v_held: Vec<f32> = v.iter().map(|&x| r::kv_value(x)).collect();
        let o_ref = r::attention(&q_ref, t_total, &k_held, &v_held, &sh, 0);

        // Prefill 8 rows, then 5 decode rows, continuing the cache.
        let mut cache = b.new_kv_cache(&sh, 64).expect("cache");
        let mut out = Vec::new();
        for (lo, hi) in [(0, 8), (8, 9), (9, 10), (10, 11), (11, 12), (12, 13)] {
            let n = hi - lo;
            let mut qt = tensor(&b, q[lo * h * d..hi * h * d].to_vec(), n, h * d);
            let mut kt = tensor(&b, k[lo * kvh * d..hi * kvh * d].to_vec(), n, kvh * d);
            let vt = tensor(&b, v[lo * kvh * d..hi * kvh * d].to_vec(), n, kvh * d);
            b.rope(&mut qt, &sh, lo).expect("rope q");
            b.rope(&mut kt, &sh, lo).expect("rope k");
            assert_nmse("rope q", &qt.data, &q_ref[lo * h * d..hi * h * d], 1e-12);
            b.kv_append(&mut cache, &kt, &vt, lo).expect("append");
            out.extend(b.attention(&qt, &cache, &sh, lo).expect("attention").data);
        }
        assert_nmse(&format!("attention {sh:?}"), &out, &o_ref, 1e-11);

        // A full cache refuses more rows instead of panicking.
        let mut small = b.new_kv_cache(&sh, 2).expect("cache");
        let kt = tensor(&b, k[..3 * kvh * d].to_vec(), 3, kvh * d);
        let vt = tensor(&b, v[..3 * kvh * d].to_vec(), 3, kvh * d);
        let err = b
            .kv_append(&mut small, &kt, &vt, 0)
            .expect_err("must fail")
            .to_string();
        assert!(err.contains("max_seq"), "{err}");
    }
}

#[test]
fn kv_values_are_f16_saturated_and_keep_nan() {
    // Round to nearest even at f16's 11 significant bits.
    assert_eq!(r::kv_value(1.0), 1.0);
    assert_eq!(r::kv_value(1.0 + 2f32.powi(-11)), 1.0);
    assert_eq!(r::kv_value(1.0 + 3.0 * 2f32.powi(-11)), 1.0 + 2f32.powi(-9));
    assert_eq!(r::kv_value(-0.1), -0.099975586);
    // Past the largest finite f16 the value saturates instead of becoming infinite.
    assert_eq!(r::kv_value(1e6), 65504.0);
    assert_eq!(r::kv_value(f32::NEG_INFINITY), -65504.0);
    assert!(r::kv_value(f32::NAN).is_nan());
}

#[test]
fn router_picks_top_k_with_ties_to_lowest_id() {
    let b = backend();
    // Experts 1, 2 and 5 tie; top-2 must be 1 and 2, weights equal after renormalisation.
    let logits = vec![0.0, 3.0, 3.0, -1.0, f32::NEG_INFINITY, 3.0];
    let lt = tensor(&b, logits.clone(), 1, 6);
    let rt = b.route(&lt, 2, true).expect("route");
    assert_eq!(rt.ids, vec![1, 2]);
    assert!((rt.weights[0] - 0.5).abs() < 1e-7 && (rt.weights[1] - 0.5).abs() < 1e-7);
    // Without renormalisation the weights are the full-softmax probabilities.
    let rt = b.route(&lt, 3, false).expect("route");
    assert_eq!(rt.ids, vec![1, 2, 5]);
    // -0.0 below +0.0, as in argmax.
    let signed = b
        .route(&tensor(&b, vec![-1.0, -0.0, 0.0, -2.0], 1, 4), 2, true)
        .expect("route");
    assert_eq!(signed.ids, vec![2, 1]);
    let z: f32 = logits.iter().map(|l| l.exp()).sum();
    assert!((rt.weights[0] - 3f32.exp() / z).abs() < 1e-6);
    let mut rng = StdRng::seed_from_u64(7);
    for (e, k, t) in [(32, 8, 5), (256, 8, 3), (16, 4, 1), (12, 3, 2)] {
        let l = randn(&mut rng, t * e, 4.0);
        let got = b
            .route(&tensor(&b, l.clone(), t, e), k, true)
            .expect("route");
        let (ids, ws) = r::route(&l, e, k, true);
        assert_eq!(got.ids, ids);
        assert_nmse("route weights", &got.weights, &ws, 1e-14);
        for row in got.weights.chunks(k) {
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        }
    }
}

#[test]
fn moe_experts_match_reference() {
    let b = backend();
    let mut rng = StdRng::seed_from_u64(8);
    for (hdim, inter, e, k, t) in [
        (64, 64, 32, 8, 1),
        (192, 128, 12, 3, 7),
        (128, 64, 4, 4, 2),
        (256, 128, 16, 2, 20),
    ] {
        let gate = qweight(&mut rng, e * inter, hdim, 4);
        let up = qweight(&mut rng, e * inter, hdim, 4);
        let down = qweight(&mut rng, e * hdim, inter, 4);
        let x = randn(&mut rng, t * hdim, 1.0);
        let logits = randn(&mut rng, t * e, 3.0);
        let xt = tensor(&b, x.clone(), t, hdim);
        let rt = b.route(&tensor(&b, logits, t, e), k, true).expect("route");
        let got = b.moe_experts(&xt, &rt, &gate, &up, &down).expect("moe");
        let expect = r::moe_experts(&x, t, &rt.ids, &rt.weights, k, e, &gate, &up, &down);
        assert_nmse(
            &format!("moe h{hdim} i{inter} e{e} k{k} t{t}"),
            &got.data,
            &expect,
            1e-10,
        );
    }
}
