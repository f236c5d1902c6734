//! Qwen3.5/3.6 hybrid MoE (`qwen3_5_moe`): the weights and the per-layer graph.
//!
//! ```text
//! x = embed(tokens)
//! per layer:  x += mixer(rmsnorm(x) * w_in)      mixer = GDN, or gated attention every few layers
//!             x += moe(rmsnorm(x) * w_post)
//! logits = lm_head(rmsnorm(x) * w_final)
//! ```
//! MLX checkpoints already fold the `1 +` of Qwen's zero-centred norms into the stored gains, so
//! every norm multiplies by the stored weight as is.

use std::path::Path;

use crate::backend::{AttnShape, Backend, GdnShape, products};
use crate::checkpoint::{Checkpoint, QWeight};
use crate::config::{LayerKind, ModelConfig};
use crate::error::{Error, Result};
use crate::model::state::{DecodeState, LayerState};

const PREFIX: &str = "language_model.model.";
const LM_HEAD: &str = "language_model.lm_head";

pub struct GdnWeights<B: Backend> {
    pub in_proj_qkv: B::QMatrix,
    pub in_proj_z: B::QMatrix,
    pub in_proj_a: B::QMatrix,
    pub in_proj_b: B::QMatrix,
    /// Causal conv taps, tap-major `[K, C]`.
    pub conv: B::Vector,
    pub a_log: B::Vector,
    pub dt_bias: B::Vector,
    pub norm: B::Vector,
    pub out_proj: B::QMatrix,
}

pub struct AttnWeights<B: Backend> {
    /// Per head `[query | gate]`, `2 * head_dim` rows each.
    pub q_proj: B::QMatrix,
    pub k_proj: B::QMatrix,
    pub v_proj: B::QMatrix,
    pub q_norm: B::Vector,
    pub k_norm: B::Vector,
    pub o_proj: B::QMatrix,
}

pub struct MoeWeights<B: Backend> {
    pub router: B::QMatrix,
    pub gate_exps: B::QMatrix,
    pub up_exps: B::QMatrix,
    pub down_exps: B::QMatrix,
    pub shared_gate: B::QMatrix,
    pub shared_up: B::QMatrix,
    pub shared_down: B::QMatrix,
    pub shared_expert_gate: B::QMatrix,
}

pub enum Mixer<B: Backend> {
    Gdn(GdnWeights<B>),
    Attn(AttnWeights<B>),
}

pub struct Layer<B: Backend> {
    pub input_norm: B::Vector,
    pub post_norm: B::Vector,
    pub mixer: Mixer<B>,
    pub moe: MoeWeights<B>,
}

/// Which logits a forward pass computes (the lm_head is the largest single product).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// None: the tokens only extend the state (prefill chunks before the last).
    None,
    /// The last token's row.
    Last,
    /// Every token's row (tests compare every prompt position).
    All,
}

pub struct Qwen35Moe<B: Backend> {
    pub cfg: ModelConfig,
    pub gdn_shape: GdnShape,
    pub attn_shape: AttnShape,
    embed: B::QMatrix,
    layers: Vec<Layer<B>>,
    final_norm: B::Vector,
    lm_head: B::QMatrix,
}

/// Reads tensors under their checkpoint names with the config's quantization for each module.
struct Loader<'a, B: Backend> {
    ckpt: Checkpoint,
    cfg: &'a ModelConfig,
    backend: &'a B,
}

impl<B: Backend> Loader<'_, B> {
    fn q(&mut self, path: &str, lead: &[usize], out: usize, inp: usize) -> Result<B::QMatrix> {
        let spec = self.cfg.quant.spec_for(path);
        let w: QWeight =
            self.ckpt
                .take_quantized(path, lead, out, inp, spec.bits, spec.group_size)?;
        self.backend.upload_qmatrix(w)
    }
    fn bf16_vector(&mut self, name: &str, len: usize) -> Result<B::Vector> {
        let v = self.ckpt.take_bf16(name, &[len])?;
        self.backend.upload_vector(&v)
    }
}

impl<B: Backend> Qwen35Moe<B> {
    pub fn load(dir: &Path, cfg: ModelConfig, backend: &B) -> Result<Self> {
        let ckpt = Checkpoint::open(dir)?;
        if !ckpt.contains(&format!("{PREFIX}embed_tokens.weight")) {
            return Err(Error::checkpoint(format!(
                "unsupported checkpoint layout: no {PREFIX}embed_tokens.weight; expected an mlx-community qwen3_5_moe checkpoint"
            )));
        }
        let mut ld = Loader {
            ckpt,
            cfg: &cfg,
            backend,
        };
        let (hdim, vocab) = (cfg.hidden_size, cfg.vocab_size);
        let embed = ld.q(&format!("{PREFIX}embed_tokens"), &[], vocab, hdim)?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for (i, kind) in cfg.layer_types.iter().enumerate() {
            let p = format!("{PREFIX}layers.{i}.");
            let mixer = match kind {
                LayerKind::LinearAttention => {
                    Mixer::Gdn(load_gdn(&mut ld, &format!("{p}linear_attn."))?)
                }
                LayerKind::FullAttention => {
                    Mixer::Attn(load_attn(&mut ld, &format!("{p}self_attn."))?)
                }
            };
            layers.push(Layer {
                input_norm: ld.bf16_vector(&format!("{p}input_layernorm.weight"), hdim)?,
                post_norm: ld.bf16_vector(&format!("{p}post_attention_layernorm.weight"), hdim)?,
                mixer,
                moe: load_moe(&mut ld, &format!("{p}mlp."))?,
            });
        }
        let final_norm = ld.bf16_vector(&format!("{PREFIX}norm.weight"), hdim)?;
        let lm_head = ld.q(LM_HEAD, &[], vocab, hdim)?;
        ld.ckpt.finish()?;
        let gdn_shape = GdnShape {
            key_heads: cfg.linear_key_heads,
            value_heads: cfg.linear_value_heads,
            key_dim: cfg.linear_key_dim,
            value_dim: cfg.linear_value_dim,
            conv_kernel: cfg.conv_kernel,
        };
        let attn_shape = AttnShape {
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            rotary_dim: cfg.rotary_dim,
            rope_theta: cfg.rope_theta,
        };
        Ok(Qwen35Moe {
            cfg,
            gdn_shape,
            attn_shape,
            embed,
            layers,
            final_norm,
            lm_head,
        })
    }

    /// A fresh decode state with room for `max_seq` positions.
    pub fn new_state(&self, b: &B, max_seq: usize) -> Result<DecodeState<B>> {
        let layers = self
            .cfg
            .layer_types
            .iter()
            .map(|k| match k {
                LayerKind::LinearAttention => b.new_gdn_state(&self.gdn_shape).map(LayerState::Gdn),
                LayerKind::FullAttention => b
                    .new_kv_cache(&self.attn_shape, max_seq)
                    .map(LayerState::Attn),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DecodeState {
            pos: 0,
            max_seq,
            layers,
        })
    }

    /// Runs `tokens` through the model from `state.pos`, advancing the state, and returns the
    /// logits that `want` asks for (`[1, vocab]` for the last token, `[T, vocab]` for all).
    pub fn forward(
        &self,
        b: &B,
        tokens: &[u32],
        state: &mut DecodeState<B>,
        want: Logits,
    ) -> Result<Option<B::Tensor>> {
        if tokens.is_empty() {
            return Err(Error::invalid("forward needs at least one token"));
        }
        if state.pos + tokens.len() > state.max_seq {
            return Err(Error::invalid(format!(
                "sequence full: {} + {} tokens exceed max_seq {}",
                state.pos,
                tokens.len(),
                state.max_seq
            )));
        }
        let eps = self.cfg.rms_norm_eps;
        let pos = state.pos;
        let mut x = b.embed(&self.embed, tokens)?;
        // Each residual add is fused with the norm that follows it: the post-mixer norm, the
        // next layer's input norm, or the final norm.
        let mut h = b.rms_norm(&x, &self.layers[0].input_norm, eps)?;
        for (i, (layer, ls)) in self.layers.iter().zip(state.layers.iter_mut()).enumerate() {
            // The mixer's output before its output projection, and that projection.
            let (mixed, out_proj) = match (&layer.mixer, ls) {
                (Mixer::Gdn(w), LayerState::Gdn(s)) => (self.gdn(b, w, &h, s)?, &w.out_proj),
                (Mixer::Attn(w), LayerState::Attn(c)) => {
                    (self.attention(b, w, &h, c, pos)?, &w.o_proj)
                }
                _ => {
                    return Err(Error::Backend(
                        "decode state does not match the layer types".into(),
                    ));
                }
            };
            // x += mixed @ out_proj^T; h_post = rmsnorm(x) * post_norm
            let h_post = b.qmatmul_add_rms_norm(&mixed, out_proj, &mut x, &layer.post_norm, eps)?;
            let next_norm = self
                .layers
                .get(i + 1)
                .map_or(&self.final_norm, |l| &l.input_norm);
            // x += moe(h_post); h = rmsnorm(x) * next_norm
            h = self.moe_add_rms_norm(b, &layer.moe, &h_post, &mut x, next_norm)?;
        }
        state.pos += tokens.len();
        let h = match want {
            Logits::None => return Ok(None),
            Logits::Last => b.last_row(&h)?,
            Logits::All => h,
        };
        b.qmatmul(&h, &self.lm_head).map(Some)
    }

    /// The Gated DeltaNet mixer on `h`, up to its output projection (`forward` adds that to
    /// the residual with the next norm).
    fn gdn(
        &self,
        b: &B,
        w: &GdnWeights<B>,
        h: &B::Tensor,
        s: &mut B::GdnState,
    ) -> Result<B::Tensor> {
        let sh = &self.gdn_shape;
        // qkv = silu(causal conv of h @ in_proj_qkv^T), its window in s
        let [qkv, z, a, beta_logit] = products(b.qmatmul_many_conv1d_silu(
            h,
            &[&w.in_proj_qkv, &w.in_proj_z, &w.in_proj_a, &w.in_proj_b],
            &w.conv,
            s,
            sh,
        )?)?;
        // rmsnorm(y) * norm * silu(z) per value head, y the gated delta rule's output
        b.gdn_recurrence_gated_norm(
            &qkv,
            &a,
            &beta_logit,
            [&w.a_log, &w.dt_bias, &w.norm],
            &z,
            s,
            sh,
            self.cfg.rms_norm_eps,
        )
    }

    /// The gated attention mixer on `h`, up to its output projection (as `gdn`).
    fn attention(
        &self,
        b: &B,
        w: &AttnWeights<B>,
        h: &B::Tensor,
        cache: &mut B::KvCache,
        pos: usize,
    ) -> Result<B::Tensor> {
        let sh = &self.attn_shape;
        let eps = self.cfg.rms_norm_eps;
        let [q_gate, k, v] = products(b.qmatmul_many(h, &[&w.q_proj, &w.k_proj, &w.v_proj])?)?;
        // q, k = rope(head_rms_norm(q)), rope(head_rms_norm(k)); k and v appended to the cache;
        // attention(q) * sigmoid(gate)
        b.attention_prepped_gated(&q_gate, &k, &v, [&w.q_norm, &w.k_norm], cache, sh, pos, eps)
    }

    /// The MoE block on `h` added to the residual `x`, and the next norm (gains `norm`) of it.
    fn moe_add_rms_norm(
        &self,
        b: &B,
        w: &MoeWeights<B>,
        h: &B::Tensor,
        x: &mut B::Tensor,
        norm: &B::Vector,
    ) -> Result<B::Tensor> {
        let (routing, shared_gate_logit) = b.route_tokens(
            h,
            &w.router,
            &w.shared_expert_gate,
            self.cfg.top_k,
            self.cfg.norm_topk_prob,
        )?;
        b.moe_block_add_rms_norm(
            x,
            h,
            &routing,
            [&w.gate_exps, &w.up_exps, &w.down_exps],
            [&w.shared_gate, &w.shared_up, &w.shared_down],
            &shared_gate_logit,
            norm,
            self.cfg.rms_norm_eps,
        )
    }
}

fn load_gdn<B: Backend>(ld: &mut Loader<'_, B>, p: &str) -> Result<GdnWeights<B>> {
    let cfg = ld.cfg;
    let (hdim, hv, c, k) = (
        cfg.hidden_size,
        cfg.linear_value_heads,
        cfg.conv_dim(),
        cfg.conv_kernel,
    );
    let conv_name = format!("{p}conv1d.weight");
    // mlx stores depthwise conv weights [C, K, 1]; the HF layout is [C, 1, K]. Both hold
    // taps in order for each channel; kernels want them tap-major [K, C].
    let conv_shape = ld
        .ckpt
        .shape(&conv_name)
        .map(|s| s.to_vec())
        .unwrap_or_default();
    let conv_raw = if conv_shape == [c, 1, k] {
        ld.ckpt.take_bf16(&conv_name, &[c, 1, k])?
    } else {
        ld.ckpt.take_bf16(&conv_name, &[c, k, 1])?
    };
    let mut conv = vec![0.0f32; c * k];
    for ch in 0..c {
        for j in 0..k {
            conv[j * c + ch] = conv_raw[ch * k + j];
        }
    }
    Ok(GdnWeights {
        in_proj_qkv: ld.q(&format!("{p}in_proj_qkv"), &[], c, hdim)?,
        in_proj_z: ld.q(&format!("{p}in_proj_z"), &[], cfg.value_dim(), hdim)?,
        in_proj_a: ld.q(&format!("{p}in_proj_a"), &[], hv, hdim)?,
        in_proj_b: ld.q(&format!("{p}in_proj_b"), &[], hv, hdim)?,
        conv: ld.backend.upload_vector(&conv)?,
        a_log: {
            let v = ld.ckpt.take_f32_or_bf16(&format!("{p}A_log"), &[hv])?;
            ld.backend.upload_vector(&v)?
        },
        dt_bias: ld.bf16_vector(&format!("{p}dt_bias"), hv)?,
        norm: ld.bf16_vector(&format!("{p}norm.weight"), cfg.linear_value_dim)?,
        out_proj: ld.q(&format!("{p}out_proj"), &[], hdim, cfg.value_dim())?,
    })
}

fn load_attn<B: Backend>(ld: &mut Loader<'_, B>, p: &str) -> Result<AttnWeights<B>> {
    let cfg = ld.cfg;
    let (hdim, h, kvh, d) = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
    );
    Ok(AttnWeights {
        q_proj: ld.q(&format!("{p}q_proj"), &[], 2 * h * d, hdim)?,
        k_proj: ld.q(&format!("{p}k_proj"), &[], kvh * d, hdim)?,
        v_proj: ld.q(&format!("{p}v_proj"), &[], kvh * d, hdim)?,
        q_norm: ld.bf16_vector(&format!("{p}q_norm.weight"), d)?,
        k_norm: ld.bf16_vector(&format!("{p}k_norm.weight"), d)?,
        o_proj: ld.q(&format!("{p}o_proj"), &[], hdim, h * d)?,
    })
}

fn load_moe<B: Backend>(ld: &mut Loader<'_, B>, p: &str) -> Result<MoeWeights<B>> {
    let cfg = ld.cfg;
    let (hdim, e, inter, si) = (
        cfg.hidden_size,
        cfg.num_experts,
        cfg.moe_intermediate,
        cfg.shared_intermediate,
    );
    Ok(MoeWeights {
        router: ld.q(&format!("{p}gate"), &[], e, hdim)?,
        gate_exps: ld.q(&format!("{p}switch_mlp.gate_proj"), &[e], inter, hdim)?,
        up_exps: ld.q(&format!("{p}switch_mlp.up_proj"), &[e], inter, hdim)?,
        down_exps: ld.q(&format!("{p}switch_mlp.down_proj"), &[e], hdim, inter)?,
        shared_gate: ld.q(&format!("{p}shared_expert.gate_proj"), &[], si, hdim)?,
        shared_up: ld.q(&format!("{p}shared_expert.up_proj"), &[], si, hdim)?,
        shared_down: ld.q(&format!("{p}shared_expert.down_proj"), &[], hdim, si)?,
        shared_expert_gate: ld.q(&format!("{p}shared_expert_gate"), &[], 1, hdim)?,
    })
}
