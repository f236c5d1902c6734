//! The CPU backend: host buffers, rayon for parallelism, run-time SIMD dispatch for the
//! quantized products. Activations, caches and states are f32 throughout, so the CPU engine is
//! the numerical reference that other backends are compared with.

pub mod quant;
pub mod reference;

use rayon::prelude::*;

use self::quant::Simd;
use self::reference as r;
use super::{AttnShape, Backend, DeviceSampling, GdnShape, QueuedStep, StepForward, StepInput};
use crate::checkpoint::QWeight;
use crate::error::{Error, Result};
use crate::model::state::DecodeState;
use crate::sampler::{SamplingParams, choose_penalised};

/// A row-major `[rows, cols]` f32 activation.
#[derive(Clone, Debug)]
pub struct CpuTensor {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

pub struct CpuGdnState {
    /// The last `K-1` conv inputs `[K-1, C]`, oldest first.
    pub window: Vec<f32>,
    /// Recurrent state `[Hv, Dv, Dk]`.
    pub state: Vec<f32>,
}

pub struct CpuKvCache {
    /// `[len, KVH*D]`, grown on append up to `max_seq`; each value as `reference::kv_value`
    /// rounds it (f16's values, held in f32).
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub row: usize,
    pub max_seq: usize,
}

pub struct CpuRouting {
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
    pub top_k: usize,
    pub num_experts: usize,
}

pub struct CpuBackend {
    pool: rayon::ThreadPool,
    simd: Simd,
    /// With `chaining`: what the chained steps keep, as a device would.
    chained: Option<std::sync::Mutex<Chain>>,
}

/// A chaining CPU backend's device-side state.
#[derive(Default)]
struct Chain {
    /// The tokens the last two chained steps chose, by the position each fed.
    chosen: Vec<(usize, u32)>,
    /// With penalties: each generated token's count, from `DeviceSampling::generated` at a
    /// `StepInput::Host` step, then each chosen token added.
    generated: std::collections::BTreeMap<u32, u32>,
}

impl CpuBackend {
    /// `threads == 0` uses every available core.
    pub fn new(threads: usize) -> Result<Self> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("lily-cpu-{i}"))
            .build()
            .map_err(|e| Error::Backend(format!("cannot start the CPU thread pool: {e}")))?;
        Ok(CpuBackend {
            pool,
            simd: Simd::detect(),
            chained: None,
        })
    }

    /// A backend that chains decode steps as a GPU does (`Backend::queue_decode_step`), each
    /// token chosen by the host sampler's rule as soon as its step has run: the chained loop and
    /// what it does to the state and the session cache, testable where there is no GPU. (It
    /// gains nothing here: every step has run before the host goes on.)
    pub fn chaining(threads: usize) -> Result<Self> {
        Ok(CpuBackend {
            chained: Some(Default::default()),
            ..CpuBackend::new(threads)?
        })
    }

    fn chain(&self) -> Result<std::sync::MutexGuard<'_, Chain>> {
        self.chained
            .as_ref()
            .ok_or_else(|| Error::Backend("this CPU backend does not chain decode steps".into()))?
            .lock()
            .map_err(|_| Error::Backend("chained-step lock poisoned".into()))
    }
    pub fn simd(&self) -> Simd {
        self.simd
    }
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }
}

fn tensor(data: Vec<f32>, rows: usize, cols: usize) -> CpuTensor {
    debug_assert_eq!(data.len(), rows * cols);
    CpuTensor { data, rows, cols }
}

fn same_shape(a: &CpuTensor, b: &CpuTensor, op: &str) -> Result<()> {
    if a.rows != b.rows || a.cols != b.cols {
        return Err(Error::Backend(format!(
            "{op}: shape mismatch [{}, {}] vs [{}, {}]",
            a.rows, a.cols, b.rows, b.cols
        )));
    }
    Ok(())
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type QMatrix = QWeight;
    type Vector = Vec<f32>;
    type GdnState = CpuGdnState;
    type KvCache = CpuKvCache;
    type Routing = CpuRouting;

    fn name(&self) -> String {
        format!("cpu ({} threads, {:?})", self.threads(), self.simd)
    }

    fn chains_decode(&self, p: &SamplingParams) -> bool {
        let _ = p;
        self.chained.is_some()
    }

    fn queue_decode_step(
        &self,
        state: &mut DecodeState<Self>,
        input: StepInput,
        choice: &DeviceSampling,
        forward: &mut StepForward<'_, Self>,
    ) -> Result<QueuedStep> {
        let mut chain = self.chain()?;
        let pos = state.pos;
        let token = match input {
            StepInput::Host(t) => {
                chain.chosen.clear();
                chain.generated = choice.generated.iter().copied().collect();
                t
            }
            StepInput::Chosen => chain
                .chosen
                .iter()
                .find(|&&(p, _)| p + 1 == pos)
                .map(|&(_, t)| t)
                .ok_or_else(|| {
                    Error::Backend(format!("no queued step chose the token for position {pos}"))
                })?,
        };
        let logits = forward(state, token)?;
        let p = choice.params;
        let penalties: Vec<(u32, f32)> = if p.has_penalties() {
            chain
                .generated
                .iter()
                .map(|(&t, &n)| (t, p.penalty(n)))
                .collect()
        } else {
            Vec::new()
        };
        let next = choose_penalised(p, &logits.data, choice.u, &penalties);
        if p.has_penalties() {
            *chain.generated.entry(next).or_insert(0) += 1;
        }
        // As on a GPU, a step's choice stays readable until two later steps are queued.
        chain.chosen.retain(|&(p, _)| p + 1 >= pos);
        chain.chosen.push((pos, next));
        Ok(QueuedStep { pos })
    }

    fn chosen_token(&self, step: QueuedStep) -> Result<u32> {
        self.chain()?
            .chosen
            .iter()
            .find(|&&(p, _)| p == step.pos)
            .map(|&(_, t)| t)
            .ok_or_else(|| {
                Error::Backend(format!(
                    "the chained decode step at position {} left no token",
                    step.pos
                ))
            })
    }

    fn upload_qmatrix(&self, w: QWeight) -> Result<QWeight> {
        Ok(w)
    }
    fn upload_vector(&self, v: &[f32]) -> Result<Vec<f32>> {
        Ok(v.to_vec())
    }
    fn upload_tensor(&self, data: &[f32], rows: usize, cols: usize) -> Result<CpuTensor> {
        if data.len() != rows * cols {
            return Err(Error::Backend(format!(
                "upload of {} values as [{rows}, {cols}]",
                data.len()
            )));
        }
        Ok(tensor(data.to_vec(), rows, cols))
    }
    fn download(&self, t: &CpuTensor) -> Result<Vec<f32>> {
        Ok(t.data.clone())
    }
    fn tensor_shape(&self, t: &CpuTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }
    fn new_gdn_state(&self, s: &GdnShape) -> Result<CpuGdnState> {
        Ok(CpuGdnState {
            window: vec![0.0; (s.conv_kernel - 1) * s.conv_channels()],
            state: vec![0.0; s.value_heads * s.value_dim * s.key_dim],
        })
    }
    fn new_kv_cache(&self, s: &AttnShape, max_seq: usize) -> Result<CpuKvCache> {
        Ok(CpuKvCache {
            k: Vec::new(),
            v: Vec::new(),
            row: s.kv_heads * s.head_dim,
            max_seq,
        })
    }
    fn reset_gdn_state(&self, s: &mut CpuGdnState) -> Result<()> {
        s.window.fill(0.0);
        s.state.fill(0.0);
        Ok(())
    }
    fn clone_gdn_state(&self, s: &CpuGdnState) -> Result<CpuGdnState> {
        Ok(CpuGdnState {
            window: s.window.clone(),
            state: s.state.clone(),
        })
    }
    fn clone_kv_cache(&self, c: &CpuKvCache, len: usize, max_seq: usize) -> Result<CpuKvCache> {
        let n = (len * c.row).min(c.k.len());
        Ok(CpuKvCache {
            k: c.k[..n].to_vec(),
            v: c.v[..n].to_vec(),
            row: c.row,
            max_seq,
        })
    }
    fn gdn_state_bytes(&self, s: &CpuGdnState) -> usize {
        4 * (s.window.len() + s.state.len())
    }
    fn kv_cache_bytes(&self, c: &CpuKvCache) -> usize {
        4 * (c.k.capacity() + c.v.capacity())
    }

    fn embed(&self, table: &QWeight, tokens: &[u32]) -> Result<CpuTensor> {
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= table.rows) {
            return Err(Error::invalid(format!(
                "token id {bad} is outside the vocabulary of {} entries",
                table.rows
            )));
        }
        Ok(tensor(
            quant::embed(table, tokens),
            tokens.len(),
            table.cols,
        ))
    }

    fn rms_norm(&self, x: &CpuTensor, w: &Vec<f32>, eps: f32) -> Result<CpuTensor> {
        Ok(tensor(r::rms_norm(&x.data, x.cols, w, eps), x.rows, x.cols))
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        same_shape(x, y, "add")?;
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn qmatmul(&self, x: &CpuTensor, w: &QWeight) -> Result<CpuTensor> {
        if x.cols != w.cols {
            return Err(Error::Backend(format!(
                "qmatmul {}: input has {} columns, weight {}",
                w.name, x.cols, w.cols
            )));
        }
        let y = self
            .pool
            .install(|| quant::qmatmul(self.simd, &x.data, x.rows, w));
        Ok(tensor(y, x.rows, w.rows))
    }

    fn swiglu(&self, g: &CpuTensor, u: &CpuTensor) -> Result<CpuTensor> {
        same_shape(g, u, "swiglu")?;
        Ok(tensor(r::swiglu(&g.data, &u.data), g.rows, g.cols))
    }

    fn last_row(&self, x: &CpuTensor) -> Result<CpuTensor> {
        let start = (x.rows.max(1) - 1) * x.cols;
        Ok(tensor(x.data[start..].to_vec(), 1, x.cols))
    }

    fn argmax_rows(&self, x: &CpuTensor) -> Result<Vec<u32>> {
        Ok(self
            .pool
            .install(|| x.data.par_chunks(x.cols.max(1)).map(r::argmax).collect()))
    }

    fn conv1d_silu(
        &self,
        x: &CpuTensor,
        w: &Vec<f32>,
        s: &mut CpuGdnState,
        sh: &GdnShape,
    ) -> Result<CpuTensor> {
        let c = sh.conv_channels();
        if x.cols != c {
            return Err(Error::Backend(format!(
                "conv1d: input has {} channels, expected {c}",
                x.cols
            )));
        }
        Ok(tensor(
            r::conv1d_silu(&x.data, x.rows, c, w, &mut s.window, sh.conv_kernel),
            x.rows,
            c,
        ))
    }

    fn gdn_recurrence(
        &self,
        qkv: &CpuTensor,
        a: &CpuTensor,
        b: &CpuTensor,
        a_log: &Vec<f32>,
        dt_bias: &Vec<f32>,
        s: &mut CpuGdnState,
        sh: &GdnShape,
    ) -> Result<CpuTensor> {
        let t = qkv.rows;
        let (hv, dv, dk) = (sh.value_heads, sh.value_dim, sh.key_dim);
        // Value heads are independent: each runs the reference recurrence on its own slice of
        // the state, in parallel.
        let per_head: Vec<Vec<f32>> = self.pool.install(|| {
            s.state
                .par_chunks_mut(dv * dk)
                .enumerate()
                .map(|(h, st)| gdn_one_head(qkv, a, b, a_log, dt_bias, st, sh, h))
                .collect()
        });
        let mut y = vec![0.0f32; t * hv * dv];
        for (h, yh) in per_head.iter().enumerate() {
            for i in 0..t {
                y[i * hv * dv + h * dv..i * hv * dv + (h + 1) * dv]
                    .copy_from_slice(&yh[i * dv..(i + 1) * dv]);
            }
        }
        Ok(tensor(y, t, hv * dv))
    }

    fn gated_rms_norm(
        &self,
        y: &CpuTensor,
        z: &CpuTensor,
        w: &Vec<f32>,
        dim: usize,
        eps: f32,
    ) -> Result<CpuTensor> {
        same_shape(y, z, "gated_rms_norm")?;
        Ok(tensor(
            r::gated_rms_norm(&y.data, &z.data, w, dim, eps),
            y.rows,
            y.cols,
        ))
    }

    fn split_q_gate(
        &self,
        qg: &CpuTensor,
        heads: usize,
        d: usize,
    ) -> Result<(CpuTensor, CpuTensor)> {
        if qg.cols != 2 * heads * d {
            return Err(Error::Backend(format!(
                "split_q_gate: {} columns for {heads} heads of {d}",
                qg.cols
            )));
        }
        let (q, g) = r::split_q_gate(&qg.data, qg.rows, heads, d);
        Ok((tensor(q, qg.rows, heads * d), tensor(g, qg.rows, heads * d)))
    }

    fn head_rms_norm(
        &self,
        x: &CpuTensor,
        w: &Vec<f32>,
        dim: usize,
        eps: f32,
    ) -> Result<CpuTensor> {
        Ok(tensor(r::rms_norm(&x.data, dim, w, eps), x.rows, x.cols))
    }

    fn rope(&self, x: &mut CpuTensor, sh: &AttnShape, pos0: usize) -> Result<()> {
        let heads = x.cols / sh.head_dim;
        let table = rope_table(sh, pos0, x.rows);
        let (d, half) = (sh.head_dim, sh.rotary_dim / 2);
        for (i, row) in x.data.chunks_mut(x.cols).enumerate() {
            let (cos, sin) = (
                &table.0[i * half..(i + 1) * half],
                &table.1[i * half..(i + 1) * half],
            );
            for head in row.chunks_mut(d).take(heads) {
                for j in 0..half {
                    let (a, b) = (head[j], head[j + half]);
                    head[j] = a * cos[j] - b * sin[j];
                    head[j + half] = b * cos[j] + a * sin[j];
                }
            }
        }
        Ok(())
    }

    fn kv_append(
        &self,
        c: &mut CpuKvCache,
        k: &CpuTensor,
        v: &CpuTensor,
        pos0: usize,
    ) -> Result<()> {
        same_shape(k, v, "kv_append")?;
        if k.cols != c.row {
            return Err(Error::Backend(format!(
                "kv_append: rows of {} values, cache rows of {}",
                k.cols, c.row
            )));
        }
        if pos0 + k.rows > c.max_seq {
            return Err(Error::invalid(format!(
                "sequence full: {} positions exceed max_seq {}",
                pos0 + k.rows,
                c.max_seq
            )));
        }
        let start = pos0 * c.row;
        c.k.truncate(start);
        c.v.truncate(start);
        if c.k.len() != start {
            return Err(Error::Backend(format!(
                "kv_append at position {pos0} but the cache holds {}",
                c.k.len() / c.row
            )));
        }
        c.k.extend(k.data.iter().map(|&x| r::kv_value(x)));
        c.v.extend(v.data.iter().map(|&x| r::kv_value(x)));
        Ok(())
    }

    fn attention(
        &self,
        q: &CpuTensor,
        c: &CpuKvCache,
        sh: &AttnShape,
        pos0: usize,
    ) -> Result<CpuTensor> {
        let (t, h, d) = (q.rows, sh.heads, sh.head_dim);
        if c.k.len() < (pos0 + t) * c.row {
            return Err(Error::Backend(format!(
                "attention over {} positions but the cache holds {}",
                pos0 + t,
                c.k.len() / c.row
            )));
        }
        let mut out = vec![0.0f32; t * h * d];
        self.pool.install(|| {
            out.par_chunks_mut(d).enumerate().for_each(|(idx, o)| {
                let (i, hh) = (idx / h, idx % h);
                attend_one(
                    &q.data[idx * d..(idx + 1) * d],
                    &c.k,
                    &c.v,
                    sh,
                    hh,
                    pos0 + i + 1,
                    o,
                );
            })
        });
        Ok(tensor(out, t, h * d))
    }

    fn sigmoid_mul(&self, x: &CpuTensor, gate: &CpuTensor) -> Result<CpuTensor> {
        same_shape(x, gate, "sigmoid_mul")?;
        Ok(tensor(
            x.data
                .iter()
                .zip(&gate.data)
                .map(|(a, g)| a * r::sigmoid(*g))
                .collect(),
            x.rows,
            x.cols,
        ))
    }

    fn route(&self, logits: &CpuTensor, top_k: usize, renormalize: bool) -> Result<CpuRouting> {
        let (ids, weights) = r::route(&logits.data, logits.cols, top_k, renormalize);
        Ok(CpuRouting {
            ids,
            weights,
            top_k,
            num_experts: logits.cols,
        })
    }

    fn moe_experts(
        &self,
        x: &CpuTensor,
        rt: &CpuRouting,
        gate: &QWeight,
        up: &QWeight,
        down: &QWeight,
    ) -> Result<CpuTensor> {
        let (t, hdim) = (x.rows, x.cols);
        let inter = gate.rows / rt.num_experts;
        // Tokens per expert, so that each expert's weights are read once per call.
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); rt.num_experts];
        for i in 0..t {
            for j in 0..rt.top_k {
                by_expert[rt.ids[i * rt.top_k + j] as usize]
                    .push((i, rt.weights[i * rt.top_k + j]));
            }
        }
        let mut out = vec![0.0f32; t * hdim];
        self.pool.install(|| {
            for (e, toks) in by_expert.iter().enumerate().filter(|(_, v)| !v.is_empty()) {
                let n = toks.len();
                let xs: Vec<f32> = toks
                    .iter()
                    .flat_map(|&(i, _)| x.data[i * hdim..(i + 1) * hdim].iter().copied())
                    .collect();
                let mut g = vec![0.0f32; n * inter];
                let mut u = vec![0.0f32; n * inter];
                quant::qmatmul_rows(
                    self.simd,
                    &xs,
                    n,
                    gate,
                    e * inter..(e + 1) * inter,
                    &mut g,
                    inter,
                );
                quant::qmatmul_rows(
                    self.simd,
                    &xs,
                    n,
                    up,
                    e * inter..(e + 1) * inter,
                    &mut u,
                    inter,
                );
                let act = r::swiglu(&g, &u);
                let mut y = vec![0.0f32; n * hdim];
                quant::qmatmul_rows(
                    self.simd,
                    &act,
                    n,
                    down,
                    e * hdim..(e + 1) * hdim,
                    &mut y,
                    hdim,
                );
                for (j, &(i, wgt)) in toks.iter().enumerate() {
                    for (o, v) in out[i * hdim..(i + 1) * hdim]
                        .iter_mut()
                        .zip(&y[j * hdim..(j + 1) * hdim])
                    {
                        *o += wgt * v;
                    }
                }
            }
        });
        Ok(tensor(out, t, hdim))
    }

    fn add_sigmoid_gated(
        &self,
        out: &mut CpuTensor,
        y: &CpuTensor,
        gate_logit: &CpuTensor,
    ) -> Result<()> {
        same_shape(out, y, "add_sigmoid_gated")?;
        if gate_logit.rows != out.rows || gate_logit.cols != 1 {
            return Err(Error::Backend(
                "add_sigmoid_gated: one gate logit per row expected".into(),
            ));
        }
        for ((orow, yrow), g) in out
            .data
            .chunks_mut(out.cols)
            .zip(y.data.chunks(y.cols))
            .zip(&gate_logit.data)
        {
            let s = r::sigmoid(*g);
            orow.iter_mut().zip(yrow).for_each(|(o, v)| *o += s * v);
        }
        Ok(())
    }
}

/// cos and sin `[T, rotary_dim/2]` for positions `pos0..pos0+T`, computed in f64.
fn rope_table(sh: &AttnShape, pos0: usize, t: usize) -> (Vec<f32>, Vec<f32>) {
    let half = sh.rotary_dim / 2;
    let inv: Vec<f64> = (0..half)
        .map(|j| sh.rope_theta.powf(-2.0 * j as f64 / sh.rotary_dim as f64))
        .collect();
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    for i in 0..t {
        let pos = (pos0 + i) as f64;
        for f in &inv {
            let (s, c) = (pos * f).sin_cos();
            cos.push(c as f32);
            sin.push(s as f32);
        }
    }
    (cos, sin)
}

/// One query head over `len` cached positions (online softmax, f32).
fn attend_one(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    sh: &AttnShape,
    head: usize,
    len: usize,
    out: &mut [f32],
) {
    let (kvh, d) = (sh.kv_heads, sh.head_dim);
    let kv = head / (sh.heads / kvh);
    let scale = (d as f32).powf(-0.5);
    let mut scores = Vec::with_capacity(len);
    for p in 0..len {
        let off = (p * kvh + kv) * d;
        scores.push(r::dot(q, &k[off..off + d]) * scale);
    }
    let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut z = 0.0f32;
    for s in scores.iter_mut() {
        *s = (*s - m).exp();
        z += *s;
    }
    out.fill(0.0);
    for (p, s) in scores.iter().enumerate() {
        let off = (p * kvh + kv) * d;
        let wgt = s / z;
        out.iter_mut()
            .zip(&v[off..off + d])
            .for_each(|(o, vv)| *o += wgt * vv);
    }
}

/// The gated delta rule for value head `h` over all rows, on that head's state slice.
#[allow(clippy::too_many_arguments)]
fn gdn_one_head(
    qkv: &CpuTensor,
    a: &CpuTensor,
    b: &CpuTensor,
    a_log: &[f32],
    dt_bias: &[f32],
    st: &mut [f32],
    sh: &GdnShape,
    h: usize,
) -> Vec<f32> {
    let (hk, hv, dk, dv) = (sh.key_heads, sh.value_heads, sh.key_dim, sh.value_dim);
    let kd = hk * dk;
    let kh = h / (hv / hk);
    let qs = (dk as f32).powf(-0.5);
    let mut y = vec![0.0f32; qkv.rows * dv];
    let mut q = vec![0.0f32; dk];
    let mut k = vec![0.0f32; dk];
    for i in 0..qkv.rows {
        let row = &qkv.data[i * qkv.cols..(i + 1) * qkv.cols];
        q.copy_from_slice(&row[kh * dk..(kh + 1) * dk]);
        k.copy_from_slice(&row[kd + kh * dk..kd + (kh + 1) * dk]);
        let v = &row[2 * kd + h * dv..2 * kd + (h + 1) * dv];
        r::l2_normalize(&mut q, r::GDN_L2_EPS);
        r::l2_normalize(&mut k, r::GDN_L2_EPS);
        q.iter_mut().for_each(|x| *x *= qs);
        let decay = (-a_log[h].exp() * r::softplus(a.data[i * hv + h] + dt_bias[h])).exp();
        let beta = r::sigmoid(b.data[i * hv + h]);
        for (vi, srow) in st.chunks_mut(dk).enumerate() {
            let mut kv = 0.0f32;
            for (s, kk) in srow.iter_mut().zip(&k) {
                *s *= decay;
                kv += *s * kk;
            }
            let delta = (v[vi] - kv) * beta;
            let mut o = 0.0f32;
            for ((s, kk), qq) in srow.iter_mut().zip(&k).zip(&q) {
                *s += delta * kk;
                o += *s * qq;
            }
            y[i * dv + vi] = o;
        }
    }
    y
}
