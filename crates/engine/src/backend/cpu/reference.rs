//! Plain, obviously-correct implementations of every backend op, single-threaded with f32
//! accumulation. They define the semantics; the fast CPU ops (and later the CUDA kernels) are
//! tested against them on random inputs. Nothing here is tuned.

use crate::backend::{AttnShape, GdnShape};
use crate::checkpoint::QWeight;

/// Row `r` of a quantized matrix, dequantized: `scale * q + bias` per group, in f32.
pub fn dequant_row(w: &QWeight, r: usize, out: &mut [f32]) {
    let per_word = 32 / w.bits as usize;
    let mask = (1u32 << w.bits) - 1;
    let words = &w.codes[r * w.words_per_row()..(r + 1) * w.words_per_row()];
    let gpr = w.groups_per_row();
    for (c, o) in out.iter_mut().enumerate().take(w.cols) {
        let q = (words[c / per_word] >> (w.bits as usize * (c % per_word))) & mask;
        let g = r * gpr + c / w.group_size;
        *o = w.scales[g].to_f32() * q as f32 + w.biases[g].to_f32();
    }
}

/// `y[t][n] = sum_k x[t][k] * w[n][k]`.
pub fn qmatmul(x: &[f32], t: usize, w: &QWeight) -> Vec<f32> {
    let k = w.cols;
    let mut row = vec![0.0f32; k];
    let mut y = vec![0.0f32; t * w.rows];
    for n in 0..w.rows {
        dequant_row(w, n, &mut row);
        for i in 0..t {
            y[i * w.rows + n] = dot(&x[i * k..(i + 1) * k], &row);
        }
    }
    y
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

pub fn embed(table: &QWeight, tokens: &[u32]) -> Vec<f32> {
    let mut out = vec![0.0f32; tokens.len() * table.cols];
    for (i, &tok) in tokens.iter().enumerate() {
        dequant_row(
            table,
            tok as usize,
            &mut out[i * table.cols..(i + 1) * table.cols],
        );
    }
    out
}

pub fn rms_norm(x: &[f32], cols: usize, w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    for (xr, or) in x.chunks(cols).zip(out.chunks_mut(cols)) {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / cols as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((o, v), g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * inv * g;
        }
    }
    out
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

pub fn swiglu(g: &[f32], u: &[f32]) -> Vec<f32> {
    g.iter().zip(u).map(|(g, u)| silu(*g) * u).collect()
}

/// First index of the maximum; NaN never wins (index 0 when every value is NaN). Values compare
/// in IEEE total order, so -0.0 is below +0.0, as the GPU's packed keys and the sampler's
/// candidates order them.
pub fn argmax(row: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in row.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|(_, b)| v.total_cmp(&b).is_gt()) {
            best = Some((i, v));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

/// Causal depthwise conv. `window` holds the previous `K-1` inputs `[K-1, C]`, oldest first;
/// `w` is tap-major `[K, C]` (tap `K-1` multiplies the current input).
pub fn conv1d_silu(
    x: &[f32],
    t: usize,
    c: usize,
    w: &[f32],
    window: &mut [f32],
    k: usize,
) -> Vec<f32> {
    let mut hist: Vec<f32> = window.to_vec();
    hist.extend_from_slice(&x[..t * c]);
    let mut y = vec![0.0f32; t * c];
    for i in 0..t {
        for ch in 0..c {
            let mut acc = 0.0f32;
            for j in 0..k {
                acc += w[j * c + ch] * hist[(i + j) * c + ch];
            }
            y[i * c + ch] = silu(acc);
        }
    }
    let keep = (k - 1) * c;
    window.copy_from_slice(&hist[hist.len() - keep..]);
    y
}

/// `x / sqrt(sum(x^2) + eps)`, as mlx-lm normalises GDN queries and keys.
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

pub const GDN_L2_EPS: f32 = 1e-6;

/// The gated delta rule, token by token. State `s` is `[Hv, Dv, Dk]` f32.
#[allow(clippy::too_many_arguments)]
pub fn gdn_recurrence(
    qkv: &[f32],
    a: &[f32],
    b: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    s: &mut [f32],
    sh: &GdnShape,
    t: usize,
) -> Vec<f32> {
    let (hk, hv, dk, dv) = (sh.key_heads, sh.value_heads, sh.key_dim, sh.value_dim);
    let c = sh.conv_channels();
    let kd = hk * dk;
    let rep = hv / hk;
    let mut y = vec![0.0f32; t * hv * dv];
    for i in 0..t {
        let row = &qkv[i * c..(i + 1) * c];
        for h in 0..hv {
            let kh = h / rep;
            let mut q = row[kh * dk..(kh + 1) * dk].to_vec();
            let mut k = row[kd + kh * dk..kd + (kh + 1) * dk].to_vec();
            let v = &row[2 * kd + h * dv..2 * kd + (h + 1) * dv];
            l2_normalize(&mut q, GDN_L2_EPS);
            l2_normalize(&mut k, GDN_L2_EPS);
            let qs = (dk as f32).powf(-0.5);
            q.iter_mut().for_each(|x| *x *= qs);
            let decay = (-a_log[h].exp() * softplus(a[i * hv + h] + dt_bias[h])).exp();
            let beta = sigmoid(b[i * hv + h]);
            let st = &mut s[h * dv * dk..(h + 1) * dv * dk];
            st.iter_mut().for_each(|x| *x *= decay);
            for vi in 0..dv {
                let srow = &mut st[vi * dk..(vi + 1) * dk];
                let delta = (v[vi] - dot(srow, &k)) * beta;
                for (sv, kv) in srow.iter_mut().zip(&k) {
                    *sv += delta * kv;
                }
                y[i * hv * dv + h * dv + vi] = dot(srow, &q);
            }
        }
    }
    y
}

/// Per head of `dim`: `rmsnorm(y) * w * silu(z)`.
pub fn gated_rms_norm(y: &[f32], z: &[f32], w: &[f32], dim: usize, eps: f32) -> Vec<f32> {
    let normed = rms_norm(y, dim, w, eps);
    normed.iter().zip(z).map(|(n, z)| n * silu(*z)).collect()
}

pub fn split_q_gate(qg: &[f32], t: usize, heads: usize, d: usize) -> (Vec<f32>, Vec<f32>) {
    let mut q = Vec::with_capacity(t * heads * d);
    let mut g = Vec::with_capacity(t * heads * d);
    for chunk in qg.chunks(2 * d).take(t * heads) {
        q.extend_from_slice(&chunk[..d]);
        g.extend_from_slice(&chunk[d..]);
    }
    (q, g)
}

/// Rotate-half RoPE on the first `rotary_dim` dims of every head of every row.
pub fn rope(x: &mut [f32], t: usize, sh: &AttnShape, heads: usize, pos0: usize) {
    let (d, rd) = (sh.head_dim, sh.rotary_dim);
    let half = rd / 2;
    for i in 0..t {
        let pos = (pos0 + i) as f64;
        for h in 0..heads {
            let base = (i * heads + h) * d;
            for j in 0..half {
                let inv_freq = sh.rope_theta.powf(-2.0 * j as f64 / rd as f64);
                let (sin, cos) = (pos * inv_freq).sin_cos();
                let (a, b) = (x[base + j], x[base + j + half]);
                x[base + j] = a * cos as f32 - b * sin as f32;
                x[base + j + half] = b * cos as f32 + a * sin as f32;
            }
        }
    }
}

/// The value a KV cache holds for `x`: rounded to f16 (nearest even), magnitudes past f16's
/// largest finite value saturated to it (NaN stays NaN). Every backend stores K and V so: half
/// the bytes of f32 for decode attention to read, as llama.cpp's default cache holds.
pub fn kv_value(x: f32) -> f32 {
    half::f16::from_f32(x.clamp(-65504.0, 65504.0)).to_f32()
}

/// Causal GQA attention: q rows at positions `pos0..pos0+t` over `k`/`v` caches `[len, KVH*D]`.
pub fn attention(
    q: &[f32],
    t: usize,
    k: &[f32],
    v: &[f32],
    sh: &AttnShape,
    pos0: usize,
) -> Vec<f32> {
    let (h, kvh, d) = (sh.heads, sh.kv_heads, sh.head_dim);
    let group = h / kvh;
    let scale = (d as f32).powf(-0.5);
    let mut out = vec![0.0f32; t * h * d];
    for i in 0..t {
        let len = pos0 + i + 1;
        for hh in 0..h {
            let kv = hh / group;
            let qv = &q[(i * h + hh) * d..(i * h + hh + 1) * d];
            let scores: Vec<f32> = (0..len)
                .map(|p| dot(qv, &k[(p * kvh + kv) * d..(p * kvh + kv + 1) * d]) * scale)
                .collect();
            let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f32 = e.iter().sum();
            let o = &mut out[(i * h + hh) * d..(i * h + hh + 1) * d];
            for (p, ep) in e.iter().enumerate() {
                let vr = &v[(p * kvh + kv) * d..(p * kvh + kv + 1) * d];
                for (ov, vv) in o.iter_mut().zip(vr) {
                    *ov += ep / z * vv;
                }
            }
        }
    }
    out
}

/// Softmax over each row of router logits, top-k (ties to the lowest id; -0.0 below +0.0, as in
/// `argmax`), optionally renormalised. Returns `(ids, weights)`, `top_k` per row.
pub fn route(logits: &[f32], e: usize, top_k: usize, renormalize: bool) -> (Vec<u32>, Vec<f32>) {
    let mut ids = Vec::new();
    let mut ws = Vec::new();
    for row in logits.chunks(e) {
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let ex: Vec<f32> = row.iter().map(|l| (l - m).exp()).collect();
        let z: f32 = ex.iter().sum();
        let p: Vec<f32> = ex.iter().map(|x| x / z).collect();
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&i, &j| {
            let (a, b) = (row[j], row[i]);
            let by_value = if a.is_nan() || b.is_nan() {
                std::cmp::Ordering::Equal
            } else {
                a.total_cmp(&b)
            };
            by_value.then(i.cmp(&j))
        });
        let chosen = &order[..top_k];
        let total: f32 = chosen.iter().map(|&i| p[i]).sum();
        for &i in chosen {
            ids.push(i as u32);
            ws.push(if renormalize { p[i] / total } else { p[i] });
        }
    }
    (ids, ws)
}

/// Rows `[e*rows_per, (e+1)*rows_per)` of a stacked expert matrix times `x`.
fn expert_matvec(w: &QWeight, e: usize, rows_per: usize, x: &[f32]) -> Vec<f32> {
    let mut row = vec![0.0f32; w.cols];
    (0..rows_per)
        .map(|r| {
            dequant_row(w, e * rows_per + r, &mut row);
            dot(x, &row)
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
pub fn moe_experts(
    x: &[f32],
    t: usize,
    ids: &[u32],
    ws: &[f32],
    top_k: usize,
    num_experts: usize,
    gate: &QWeight,
    up: &QWeight,
    down: &QWeight,
) -> Vec<f32> {
    let hdim = gate.cols;
    let inter = gate.rows / num_experts;
    let mut out = vec![0.0f32; t * hdim];
    for i in 0..t {
        let xr = &x[i * hdim..(i + 1) * hdim];
        for j in 0..top_k {
            let e = ids[i * top_k + j] as usize;
            let g = expert_matvec(gate, e, inter, xr);
            let u = expert_matvec(up, e, inter, xr);
            let h = swiglu(&g, &u);
            let y = expert_matvec(down, e, hdim, &h);
            for (o, yv) in out[i * hdim..(i + 1) * hdim].iter_mut().zip(&y) {
                *o += ws[i * top_k + j] * yv;
            }
        }
    }
    out
}
