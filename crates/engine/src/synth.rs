//! Synthetic checkpoints: random weights of any `qwen3_5_moe` shape, written in exactly the
//! layout mlx-community publishes (MLX affine 4-bit, 8-bit router and shared-expert gate, the
//! `language_model.` prefix, `model.safetensors.index.json`, the multimodal config wrapper).
//!
//! No real weights can be downloaded on the benchmark machines, so GPU benchmarks run on these.
//! The writer streams: each tensor is cut into fixed-size chunks, every chunk is generated from
//! its own PRNG stream (seeded by seed, tensor name and chunk index, so the bytes do not depend on
//! the thread count or the shard size) and written with a positioned write from a rayon pool.
//! Memory stays at a few MB per thread however large the checkpoint.
//!
//! The values are chosen so that a forward pass is finite and neither routing nor argmax is
//! degenerate: uniform codes, scales giving each projection a dequantized std of
//! `gain/sqrt(in_features)` (gain 3 on the router and 2 on the lm_head, as the tiny fixture's
//! generator does), embedding rows of std 1, norm gains near 1 (MLX stores them with the `+1`
//! already folded in), `A_log = ln U(1, 16)`, `dt_bias ≈ 1 ± 0.5` and conv taps `N(0, 0.5)`.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use half::bf16;
use rayon::prelude::*;
use serde::Serialize;
use serde_json::{Value, json};

use crate::config::{GROUP_SIZE, ModelConfig};
use crate::error::{Error, Result};

/// mlx-lm's `MAX_FILE_SIZE_GB = 5`, applied as `5 << 30` bytes of tensor data per shard.
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5 << 30;

/// Bytes generated and written per job. Fixed (not derived from the thread count) because chunk
/// boundaries decide which PRNG stream produces which bytes.
const CHUNK_BYTES: usize = 4 << 20;

/// Tokenizer-side files copied from `tokenizer_from`; `tokenizer.json` is required.
const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
];

/// Token ids of the real Qwen3.6 tokenizer that config.json carries.
const BOS_TOKEN_ID: u32 = 248_044;
const IMAGE_TOKEN_ID: u32 = 248_056;
const VIDEO_TOKEN_ID: u32 = 248_057;
const VISION_START_TOKEN_ID: u32 = 248_053;
const VISION_END_TOKEN_ID: u32 = 248_054;

/// The shape of a synthetic `qwen3_5_moe` checkpoint and the seed of its weights.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthSpec {
    pub hidden: usize,
    pub layers: usize,
    /// Layer `i` is full attention iff `(i + 1) % full_attention_interval == 0`.
    pub full_attention_interval: usize,
    pub vocab: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub linear_key_heads: usize,
    pub linear_value_heads: usize,
    pub linear_key_dim: usize,
    pub linear_value_dim: usize,
    pub conv_kernel: usize,
    pub experts: usize,
    pub top_k: usize,
    pub moe_inter: usize,
    pub shared_inter: usize,
    pub rope_theta: f64,
    pub partial_rotary_factor: f64,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    pub eos_token_ids: Vec<u32>,
    pub seed: u64,
    /// Tensor bytes per shard before a new shard is started (mlx-lm's rule: a tensor larger
    /// than this gets a shard of its own). Tests lower it to force several shards.
    pub max_shard_bytes: u64,
}

/// What `write_checkpoint` wrote.
#[derive(Clone, Debug, Serialize)]
pub struct SynthReport {
    /// Bytes of all safetensors shards (headers included).
    pub bytes: u64,
    /// Tensor data bytes (the index's `metadata.total_size`).
    pub tensor_bytes: u64,
    pub tensors: usize,
    pub shards: usize,
    pub seconds: f64,
    pub out_dir: PathBuf,
}

/// How `write_checkpoint_with` writes.
#[derive(Clone, Debug, Default)]
pub struct WriteOptions<'a> {
    /// A directory holding `tokenizer.json` (and optionally tokenizer_config.json,
    /// chat_template.jinja, generation_config.json) to copy next to the weights.
    pub tokenizer_from: Option<&'a Path>,
    /// Writer threads; 0 uses every core.
    pub threads: usize,
    /// Replace a non-empty `out_dir` (only after the new checkpoint is complete).
    pub force: bool,
}

impl SynthSpec {
    /// Names accepted by [`SynthSpec::preset`].
    pub const PRESETS: &'static [&'static str] = &["35b-a3b", "tiny"];

    /// `"35b-a3b"`: the real Qwen3.6-35B-A3B shape (~19.5 GB). `"tiny"`: the repo's tiny
    /// fixture shape (tests/fixtures/tiny-qwen3_5_moe), real vocabulary, ~20 MB.
    pub fn preset(name: &str) -> Result<Self> {
        let big = SynthSpec {
            hidden: 2048,
            layers: 40,
            full_attention_interval: 4,
            vocab: 248_320,
            heads: 16,
            kv_heads: 2,
            head_dim: 256,
            linear_key_heads: 16,
            linear_value_heads: 32,
            linear_key_dim: 128,
            linear_value_dim: 128,
            conv_kernel: 4,
            experts: 256,
            top_k: 8,
            moe_inter: 512,
            shared_inter: 512,
            rope_theta: 1e7,
            partial_rotary_factor: 0.25,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 262_144,
            eos_token_ids: vec![248_046, 248_044],
            seed: 0,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
        };
        match name {
            "35b-a3b" | "35b" | "qwen3.6-35b-a3b" => Ok(big),
            "tiny" => Ok(SynthSpec {
                hidden: 64,
                layers: 8,
                heads: 4,
                kv_heads: 2,
                linear_key_heads: 2,
                linear_value_heads: 4,
                experts: 32,
                top_k: 8,
                moe_inter: 64,
                shared_inter: 64,
                ..big
            }),
            other => Err(Error::invalid(format!(
                "unknown synth preset {other:?}; known presets: {}",
                Self::PRESETS.join(", ")
            ))),
        }
    }

    pub fn is_full_attention(&self, layer: usize) -> bool {
        (layer + 1).is_multiple_of(self.full_attention_interval.max(1))
    }

    fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }

    fn conv_dim(&self) -> usize {
        2 * self.linear_key_heads * self.linear_key_dim
            + self.linear_value_heads * self.linear_value_dim
    }

    /// Checks the shape by parsing the config it would write, so anything the engine would
    /// reject at load is rejected before writing gigabytes.
    pub fn validate(&self) -> Result<ModelConfig> {
        if self.full_attention_interval == 0 {
            return Err(Error::invalid("full_attention_interval must be positive"));
        }
        if self.conv_kernel < 2 {
            // A [C, 1, 1] conv weight would be ambiguous between the mlx and HF layouts.
            return Err(Error::invalid("conv kernel must be at least 2"));
        }
        if !self.linear_key_dim.is_multiple_of(2) || !self.head_dim.is_multiple_of(2) {
            return Err(Error::invalid("head dims must be even"));
        }
        if self.max_shard_bytes == 0 {
            return Err(Error::invalid("max_shard_bytes must be positive"));
        }
        ModelConfig::from_json(&self.config_json())
            .map_err(|e| Error::invalid(format!("synth shape rejected: {e}")))
    }

    /// The per-module quantization entries mlx-lm writes: 8-bit router and shared-expert gate.
    fn quantization_block(&self) -> Value {
        let mut q = serde_json::Map::new();
        q.insert("group_size".into(), json!(GROUP_SIZE));
        q.insert("bits".into(), json!(4));
        q.insert("mode".into(), json!("affine"));
        for i in 0..self.layers {
            for m in ["mlp.gate", "mlp.shared_expert_gate"] {
                q.insert(
                    format!("language_model.model.layers.{i}.{m}"),
                    json!({"group_size": GROUP_SIZE, "bits": 8}),
                );
            }
        }
        Value::Object(q)
    }

    /// config.json in the mlx-community shape (the tiny fixture's field set and order: top-level
    /// keys sorted as mlx-lm's `save_config` does, text_config in Hugging Face order).
    pub fn config_json(&self) -> Value {
        let layer_types: Vec<&str> = (0..self.layers)
            .map(|i| {
                if self.is_full_attention(i) {
                    "full_attention"
                } else {
                    "linear_attention"
                }
            })
            .collect();
        // Interleaved mrope splits the rotary half-dims over (t, h, w); [11, 11, 10] for 64.
        let half = self.rotary_dim() / 2;
        let mrope_section: Vec<usize> = (0..3)
            .map(|i| half / 3 + usize::from(i < half % 3))
            .collect();
        let theta = if self.rope_theta.fract() == 0.0 && self.rope_theta.abs() < 1e15 {
            json!(self.rope_theta as i64)
        } else {
            json!(self.rope_theta)
        };
        let eos_text = self.eos_token_ids.first().copied();
        let text_config = json!({
            "model_type": "qwen3_5_moe_text",
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "vocab_size": self.vocab,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "attn_output_gate": true,
            "attention_bias": false,
            "attention_dropout": 0.0,
            "linear_num_key_heads": self.linear_key_heads,
            "linear_num_value_heads": self.linear_value_heads,
            "linear_key_head_dim": self.linear_key_dim,
            "linear_value_head_dim": self.linear_value_dim,
            "linear_conv_kernel_dim": self.conv_kernel,
            "num_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.moe_inter,
            "shared_expert_intermediate_size": self.shared_inter,
            "norm_topk_prob": true,
            "decoder_sparse_step": 1,
            "router_aux_loss_coef": 0.001,
            "output_router_logits": false,
            "full_attention_interval": self.full_attention_interval,
            "layer_types": layer_types,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "initializer_range": 0.02,
            "max_position_embeddings": self.max_position_embeddings,
            "partial_rotary_factor": self.partial_rotary_factor,
            "rope_parameters": {
                "mrope_interleaved": true,
                "mrope_section": mrope_section,
                "rope_theta": theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "type": "default"
            },
            "tie_word_embeddings": false,
            "use_cache": true,
            "dtype": "bfloat16",
            "mamba_ssm_dtype": "float32",
            "mtp_num_hidden_layers": 0,
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": eos_text,
            "pad_token_id": null
        });
        let q = self.quantization_block();
        json!({
            "_synthetic": format!(
                "random weights, seed={}, written by lily synth; structure of Qwen3.6-35B-A3B, not a trained model",
                self.seed
            ),
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "eos_token_id": self.eos_token_ids,
            "image_token_id": IMAGE_TOKEN_ID,
            "model_type": "qwen3_5_moe",
            "quantization": q.clone(),
            "quantization_config": q,
            "text_config": text_config,
            "tie_word_embeddings": false,
            "transformers_version": "5.24.0",
            "video_token_id": VIDEO_TOKEN_ID,
            "vision_end_token_id": VISION_END_TOKEN_ID,
            "vision_start_token_id": VISION_START_TOKEN_ID
        })
    }

    fn generation_config_json(&self) -> Value {
        json!({
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": self.eos_token_ids,
            "pad_token_id": BOS_TOKEN_ID,
            "do_sample": true,
            "temperature": 1.0,
            "top_k": 20,
            "top_p": 0.95
        })
    }

    /// Every tensor in mlx-lm's `tree_flatten(model.parameters())` order, which decides the
    /// shard each tensor lands in.
    fn plan(&self) -> Vec<Planned> {
        let mut p = Planner { out: Vec::new() };
        let h = self.hidden;
        let inv = |n: usize| 1.0 / (n as f64).sqrt();
        p.quant(
            "language_model.model.embed_tokens",
            &[],
            self.vocab,
            h,
            4,
            1.0,
        );
        for i in 0..self.layers {
            let l = format!("language_model.model.layers.{i}.");
            if self.is_full_attention(i) {
                let a = format!("{l}self_attn.");
                let qd = self.heads * self.head_dim;
                let kvd = self.kv_heads * self.head_dim;
                p.quant(&format!("{a}q_proj"), &[], 2 * qd, h, 4, inv(h));
                p.quant(&format!("{a}k_proj"), &[], kvd, h, 4, inv(h));
                p.quant(&format!("{a}v_proj"), &[], kvd, h, 4, inv(h));
                p.quant(&format!("{a}o_proj"), &[], h, qd, 4, inv(qd));
                p.dense(
                    &format!("{a}q_norm.weight"),
                    Dtype::BF16,
                    vec![self.head_dim],
                    Init::Gain,
                );
                p.dense(
                    &format!("{a}k_norm.weight"),
                    Dtype::BF16,
                    vec![self.head_dim],
                    Init::Gain,
                );
            } else {
                let a = format!("{l}linear_attn.");
                let (c, hv) = (self.conv_dim(), self.linear_value_heads);
                let vd = hv * self.linear_value_dim;
                p.dense(
                    &format!("{a}conv1d.weight"),
                    Dtype::BF16,
                    vec![c, self.conv_kernel, 1],
                    Init::Normal {
                        mean: 0.0,
                        std: 0.5,
                    },
                );
                p.quant(&format!("{a}in_proj_qkv"), &[], c, h, 4, inv(h));
                p.quant(&format!("{a}in_proj_z"), &[], vd, h, 4, inv(h));
                p.quant(&format!("{a}in_proj_b"), &[], hv, h, 4, inv(h));
                p.quant(&format!("{a}in_proj_a"), &[], hv, h, 4, inv(h));
                p.dense(
                    &format!("{a}dt_bias"),
                    Dtype::BF16,
                    vec![hv],
                    Init::Normal {
                        mean: 1.0,
                        std: 0.5,
                    },
                );
                p.dense(&format!("{a}A_log"), Dtype::F32, vec![hv], Init::ALog);
                p.dense(
                    &format!("{a}norm.weight"),
                    Dtype::BF16,
                    vec![self.linear_value_dim],
                    Init::Gain,
                );
                p.quant(&format!("{a}out_proj"), &[], h, vd, 4, inv(vd));
            }
            p.dense(
                &format!("{l}input_layernorm.weight"),
                Dtype::BF16,
                vec![h],
                Init::Gain,
            );
            p.dense(
                &format!("{l}post_attention_layernorm.weight"),
                Dtype::BF16,
                vec![h],
                Init::Gain,
            );
            let m = format!("{l}mlp.");
            let (e, mi, si) = (self.experts, self.moe_inter, self.shared_inter);
            // Gain 3 on the router: decisive routing, few top-k near-ties (as the tiny fixture).
            p.quant(&format!("{m}gate"), &[], e, h, 8, 3.0 * inv(h));
            p.quant(&format!("{m}switch_mlp.gate_proj"), &[e], mi, h, 4, inv(h));
            p.quant(&format!("{m}switch_mlp.up_proj"), &[e], mi, h, 4, inv(h));
            p.quant(&format!("{m}switch_mlp.down_proj"), &[e], h, mi, 4, inv(mi));
            p.quant(
                &format!("{m}shared_expert.gate_proj"),
                &[],
                si,
                h,
                4,
                inv(h),
            );
            p.quant(
                &format!("{m}shared_expert.down_proj"),
                &[],
                h,
                si,
                4,
                inv(si),
            );
            p.quant(&format!("{m}shared_expert.up_proj"), &[], si, h, 4, inv(h));
            p.quant(&format!("{m}shared_expert_gate"), &[], 1, h, 8, inv(h));
        }
        p.dense(
            "language_model.model.norm.weight",
            Dtype::BF16,
            vec![h],
            Init::Gain,
        );
        // Gain 2 on the head: a clear argmax.
        p.quant(
            "language_model.lm_head",
            &[],
            self.vocab,
            h,
            4,
            2.0 * inv(h),
        );
        p.out
    }

    /// Logical parameter count as mlx-lm's `get_total_parameters` reports it.
    pub fn total_parameters(&self) -> u64 {
        self.plan().iter().map(|t| t.logical_params).sum()
    }

    /// Tensor data bytes the checkpoint will hold (excluding headers and tokenizer files).
    pub fn tensor_bytes(&self) -> u64 {
        self.plan().iter().map(Planned::nbytes).sum()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dtype {
    U32,
    BF16,
    F32,
}

impl Dtype {
    fn size(self) -> usize {
        match self {
            Dtype::U32 | Dtype::F32 => 4,
            Dtype::BF16 => 2,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Dtype::U32 => "U32",
            Dtype::BF16 => "BF16",
            Dtype::F32 => "F32",
        }
    }
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug)]
enum Init {
    /// Packed quantization codes: every bit pattern is a valid code, so random bits give
    /// codes uniform over `0..2^bits`.
    Codes,
    /// Per-group scales (or biases) of a quantized projection whose dequantized weight should
    /// have std `target_std`; `group_key` ties the scales and biases of one projection together.
    Scales {
        bits: u32,
        target_std: f64,
        group_key: u64,
    },
    Biases {
        bits: u32,
        target_std: f64,
        group_key: u64,
    },
    /// Norm gain `1 + N(0, 0.1)` (MLX stores Qwen's zero-centred gains with the +1 folded in).
    Gain,
    Normal {
        mean: f64,
        std: f64,
    },
    /// `ln U(1, 16)`.
    ALog,
}

struct Planned {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    init: Init,
    /// Stable per-name key: the PRNG streams do not shift when other tensors are added.
    key: u64,
    /// Parameters this tensor counts for in `total_parameters` (codes count unpacked).
    logical_params: u64,
}

impl Planned {
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    fn nbytes(&self) -> u64 {
        (self.numel() * self.dtype.size()) as u64
    }
}

struct Planner {
    out: Vec<Planned>,
}

impl Planner {
    fn dense(&mut self, name: &str, dtype: Dtype, shape: Vec<usize>, init: Init) {
        let n: usize = shape.iter().product();
        self.out.push(Planned {
            name: name.to_string(),
            dtype,
            shape,
            init,
            key: fnv1a(name),
            logical_params: n as u64,
        });
    }

    /// An MLX affine quantized projection `base` with logical shape `lead ++ [out, inp]`:
    /// `.weight` U32 `[.., out, inp*bits/32]` then `.scales`/`.biases` BF16 `[.., out, inp/64]`.
    fn quant(
        &mut self,
        base: &str,
        lead: &[usize],
        out: usize,
        inp: usize,
        bits: u32,
        target_std: f64,
    ) {
        let group_key = fnv1a(base);
        let shape = |last: usize| {
            let mut s = lead.to_vec();
            s.extend([out, last]);
            s
        };
        let logical = (lead.iter().product::<usize>() * out * inp) as u64;
        let words = inp * bits as usize / 32;
        let groups = inp / GROUP_SIZE;
        let mut push = |suffix: &str, dtype: Dtype, shape: Vec<usize>, init: Init, params: u64| {
            let name = format!("{base}.{suffix}");
            let key = fnv1a(&name);
            self.out.push(Planned {
                name,
                dtype,
                shape,
                init,
                key,
                logical_params: params,
            });
        };
        push("weight", Dtype::U32, shape(words), Init::Codes, logical);
        push(
            "scales",
            Dtype::BF16,
            shape(groups),
            Init::Scales {
                bits,
                target_std,
                group_key,
            },
            0,
        );
        push(
            "biases",
            Dtype::BF16,
            shape(groups),
            Init::Biases {
                bits,
                target_std,
                group_key,
            },
            0,
        );
    }
}

// ---- random numbers -------------------------------------------------------------------------

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The splitmix64 output function: a strong 64-bit mixer.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A stream seed for (checkpoint seed, tensor key, index).
fn stream_seed(seed: u64, key: u64, index: u64) -> u64 {
    mix64(mix64(seed ^ mix64(key)).wrapping_add(index.wrapping_mul(GOLDEN)))
}

/// splitmix64: one add and a mix per output, fast enough to generate GB/s per core.
struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix64(self.0)
    }
    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    /// Standard normal (Box-Muller; only small tensors use it).
    fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform(); // (0, 1]: ln is finite
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// Scale and bias of group `g` of a quantized projection, identical whichever of the two
/// tensors (or chunk) asks. Codes are uniform over `0..2^bits`; the scale gives the
/// dequantized weight std `target_std`, the bias centres it; both get mild per-group jitter.
fn group_affine(seed: u64, bits: u32, target_std: f64, group_key: u64, g: u64) -> (bf16, bf16) {
    let levels = f64::from(1u32 << bits);
    let code_mean = (levels - 1.0) / 2.0;
    let code_std = ((levels * levels - 1.0) / 12.0).sqrt();
    let mut r = SplitMix(stream_seed(seed, group_key, g));
    let scale = bf16::from_f64(target_std / code_std * (1.0 + 0.1 * (2.0 * r.uniform() - 1.0)));
    let offset = code_mean + 0.1 * code_std * (2.0 * r.uniform() - 1.0);
    let bias = bf16::from_f64(-scale.to_f64() * offset);
    (scale, bias)
}

/// Fills `buf` with the bytes of elements `first..first + buf.len()/size` of tensor `t`.
fn fill(t: &Planned, seed: u64, chunk: u64, first: u64, buf: &mut [u8]) {
    let mut r = SplitMix(stream_seed(seed, t.key, chunk));
    match t.init {
        Init::Codes => {
            let mut words = buf.chunks_exact_mut(8);
            for w in &mut words {
                w.copy_from_slice(&r.next_u64().to_le_bytes());
            }
            let rest = words.into_remainder();
            let last = r.next_u64().to_le_bytes();
            rest.copy_from_slice(&last[..rest.len()]);
        }
        Init::Scales {
            bits,
            target_std,
            group_key,
        }
        | Init::Biases {
            bits,
            target_std,
            group_key,
        } => {
            let want_scale = matches!(t.init, Init::Scales { .. });
            for (i, out) in buf.chunks_exact_mut(2).enumerate() {
                let (s, b) = group_affine(seed, bits, target_std, group_key, first + i as u64);
                out.copy_from_slice(&(if want_scale { s } else { b }).to_le_bytes());
            }
        }
        Init::Gain | Init::Normal { .. } | Init::ALog => {
            let size = t.dtype.size();
            for out in buf.chunks_exact_mut(size) {
                let v = match t.init {
                    Init::Gain => 1.0 + 0.1 * r.normal(),
                    Init::Normal { mean, std } => mean + std * r.normal(),
                    _ => (1.0 + 15.0 * r.uniform()).ln(),
                };
                match t.dtype {
                    Dtype::BF16 => out.copy_from_slice(&bf16::from_f64(v).to_le_bytes()),
                    Dtype::F32 => out.copy_from_slice(&(v as f32).to_le_bytes()),
                    Dtype::U32 => out.copy_from_slice(&(v as u32).to_le_bytes()),
                }
            }
        }
    }
}

// ---- writing --------------------------------------------------------------------------------

/// One shard: its file name, tensors (indices into the plan, sorted by name) and data offsets.
struct Shard {
    file: String,
    tensors: Vec<usize>,
    /// Byte offset of each tensor's data relative to the data section, same order as `tensors`.
    offsets: Vec<u64>,
    header: Vec<u8>,
    data_bytes: u64,
}

impl Shard {
    fn file_bytes(&self) -> u64 {
        self.header.len() as u64 + self.data_bytes
    }
}

/// One unit of parallel work: chunk `chunk` of tensor `tensor`, written at `file_offset`.
struct Job {
    shard: usize,
    tensor: usize,
    chunk: u64,
    file_offset: u64,
    len: usize,
}

/// The safetensors header as mlx writes it (`__metadata__` first, tensors sorted by name, keys
/// `data_offsets`/`dtype`/`shape`), padded with spaces to a multiple of 8 so that the data
/// section is 8-byte aligned; prefixed by its little-endian u64 length.
fn header_bytes(plan: &[Planned], tensors: &[usize], offsets: &[u64]) -> Result<Vec<u8>> {
    let mut s = String::from("{\"__metadata__\":{\"format\":\"mlx\"}");
    for (&i, &off) in tensors.iter().zip(offsets) {
        let t = &plan[i];
        let name = serde_json::to_string(&t.name)
            .map_err(|e| Error::invalid(format!("tensor name {}: {e}", t.name)))?;
        let shape: Vec<String> = t.shape.iter().map(usize::to_string).collect();
        s.push_str(&format!(
            ",{name}:{{\"data_offsets\":[{off},{}],\"dtype\":\"{}\",\"shape\":[{}]}}",
            off + t.nbytes(),
            t.dtype.name(),
            shape.join(",")
        ));
    }
    s.push('}');
    while !s.len().is_multiple_of(8) {
        s.push(' ');
    }
    let mut out = Vec::with_capacity(8 + s.len());
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
    Ok(out)
}

/// mlx-lm's `make_shards`: fill shards in model order, starting a new one when the next tensor
/// would push it past the limit.
fn make_shards(plan: &[Planned], max_bytes: u64) -> Result<Vec<Shard>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut size = 0u64;
    for (i, t) in plan.iter().enumerate() {
        match groups.last_mut() {
            Some(g) if size + t.nbytes() <= max_bytes => g.push(i),
            _ => {
                groups.push(vec![i]);
                size = 0;
            }
        }
        size += t.nbytes();
    }
    let count = groups.len();
    groups
        .into_iter()
        .enumerate()
        .map(|(n, mut tensors)| {
            tensors.sort_by(|&a, &b| plan[a].name.cmp(&plan[b].name));
            let mut offsets = Vec::with_capacity(tensors.len());
            let mut off = 0u64;
            for &i in &tensors {
                offsets.push(off);
                off += plan[i].nbytes();
            }
            let file = if count > 1 {
                format!("model-{:05}-of-{count:05}.safetensors", n + 1)
            } else {
                "model.safetensors".to_string()
            };
            let header = header_bytes(plan, &tensors, &offsets)?;
            Ok(Shard {
                file,
                tensors,
                offsets,
                header,
                data_bytes: off,
            })
        })
        .collect()
}

/// Python `json.dump(obj, f, indent=N)` style (what mlx-lm and transformers write).
fn pretty_json(v: &Value, indent: &[u8]) -> Result<Vec<u8>> {
    let mut buf = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(
        &mut buf,
        serde_json::ser::PrettyFormatter::with_indent(indent),
    );
    v.serialize(&mut ser)
        .map_err(|e| Error::invalid(format!("serializing JSON: {e}")))?;
    Ok(buf)
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f =
        File::create(path).map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
    f.write_all(bytes)
        .map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

/// Writes a random-weight checkpoint of `spec` to `out_dir` (which must not exist or be empty).
pub fn write_checkpoint(
    spec: &SynthSpec,
    out_dir: &Path,
    tokenizer_from: Option<&Path>,
    threads: usize,
) -> Result<SynthReport> {
    write_checkpoint_with(
        spec,
        out_dir,
        &WriteOptions {
            tokenizer_from,
            threads,
            force: false,
        },
    )
}

/// [`write_checkpoint`] with every option. Everything is written into a hidden sibling
/// directory and renamed to `out_dir` at the end, so a partial run never looks complete.
pub fn write_checkpoint_with(
    spec: &SynthSpec,
    out_dir: &Path,
    opts: &WriteOptions<'_>,
) -> Result<SynthReport> {
    let t0 = Instant::now();
    spec.validate()?;
    let name = out_dir
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| {
            Error::invalid(format!(
                "output path {} has no usable directory name",
                out_dir.display()
            ))
        })?
        .to_string();
    let replace_existing = check_out_dir(out_dir, opts.force)?;
    if let Some(dir) = opts.tokenizer_from
        && !dir.join("tokenizer.json").is_file()
    {
        return Err(Error::invalid(format!(
            "--tokenizer-from {}: no tokenizer.json there",
            dir.display()
        )));
    }
    let parent = out_dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let tmp = parent.join(format!(".{name}.synth-tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)
            .map_err(|e| Error::io(format!("removing stale {}", tmp.display()), e))?;
    }
    std::fs::create_dir_all(&tmp)
        .map_err(|e| Error::io(format!("creating {}", tmp.display()), e))?;
    let result = write_into(spec, &tmp, opts);
    let report = match result {
        Ok(r) => r,
        Err(e) => {
            // Best effort: the error that matters is the one being returned.
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    if let Err(e) = publish(&tmp, out_dir, parent, &name, replace_existing) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    Ok(SynthReport {
        seconds: t0.elapsed().as_secs_f64(),
        out_dir: out_dir.to_path_buf(),
        ..report
    })
}

/// Returns whether `out_dir` exists and will be replaced; refuses a non-empty one without force.
fn check_out_dir(out_dir: &Path, force: bool) -> Result<bool> {
    match std::fs::metadata(out_dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io(format!("checking {}", out_dir.display()), e)),
        Ok(m) if !m.is_dir() => Err(Error::invalid(format!(
            "{} exists and is not a directory",
            out_dir.display()
        ))),
        Ok(_) => {
            let mut entries = std::fs::read_dir(out_dir)
                .map_err(|e| Error::io(format!("reading {}", out_dir.display()), e))?;
            if entries.next().is_some() && !force {
                return Err(Error::invalid(format!(
                    "{} is not empty; pass --force to replace it",
                    out_dir.display()
                )));
            }
            Ok(true)
        }
    }
}

/// Moves the finished `tmp` to `out_dir`, replacing an existing one only now that the new
/// checkpoint is complete.
fn publish(
    tmp: &Path,
    out_dir: &Path,
    parent: &Path,
    name: &str,
    replace_existing: bool,
) -> Result<()> {
    let old = parent.join(format!(".{name}.synth-old-{}", std::process::id()));
    if replace_existing && out_dir.exists() {
        std::fs::rename(out_dir, &old)
            .map_err(|e| Error::io(format!("moving {} aside", out_dir.display()), e))?;
    }
    std::fs::rename(tmp, out_dir).map_err(|e| {
        Error::io(
            format!("renaming {} to {}", tmp.display(), out_dir.display()),
            e,
        )
    })?;
    if old.exists() {
        std::fs::remove_dir_all(&old)
            .map_err(|e| Error::io(format!("removing the replaced {}", old.display()), e))?;
    }
    Ok(())
}

fn write_into(spec: &SynthSpec, dir: &Path, opts: &WriteOptions<'_>) -> Result<SynthReport> {
    let t0 = Instant::now();
    let plan = spec.plan();
    let shards = make_shards(&plan, spec.max_shard_bytes)?;

    // Create every shard at its final size, header in place, then fill the data in parallel.
    let mut files = Vec::with_capacity(shards.len());
    for s in &shards {
        let path = dir.join(&s.file);
        let f = File::create(&path)
            .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
        f.set_len(s.file_bytes())
            .map_err(|e| Error::io(format!("sizing {}", path.display()), e))?;
        f.write_all_at(&s.header, 0)
            .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
        files.push(f);
    }
    let mut jobs = Vec::new();
    for (si, s) in shards.iter().enumerate() {
        let base = s.header.len() as u64;
        for (&ti, &off) in s.tensors.iter().zip(&s.offsets) {
            let n = plan[ti].nbytes();
            let chunks = n.div_ceil(CHUNK_BYTES as u64);
            for c in 0..chunks {
                let start = c * CHUNK_BYTES as u64;
                let len = (n - start).min(CHUNK_BYTES as u64) as usize;
                jobs.push(Job {
                    shard: si,
                    tensor: ti,
                    chunk: c,
                    file_offset: base + off + start,
                    len,
                });
            }
        }
    }
    let tensor_bytes: u64 = shards.iter().map(|s| s.data_bytes).sum();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.threads)
        .thread_name(|i| format!("lily-synth-{i}"))
        .build()
        .map_err(|e| Error::Backend(format!("cannot start the synth thread pool: {e}")))?;
    tracing::info!(
        "synth: {} tensors, {:.2} GB in {} shard(s), {} threads -> {}",
        plan.len(),
        tensor_bytes as f64 / 1e9,
        shards.len(),
        pool.current_num_threads(),
        dir.display()
    );
    let done = AtomicU64::new(0);
    pool.install(|| {
        jobs.par_iter().with_max_len(1).try_for_each_init(
            Vec::new,
            |buf: &mut Vec<u8>, job| -> Result<()> {
                let t = &plan[job.tensor];
                buf.resize(job.len, 0);
                let first = job.chunk * (CHUNK_BYTES / t.dtype.size()) as u64;
                fill(t, spec.seed, job.chunk, first, buf);
                files[job.shard]
                    .write_all_at(buf, job.file_offset)
                    .map_err(|e| {
                        Error::io(
                            format!("writing {} into {}", t.name, shards[job.shard].file),
                            e,
                        )
                    })?;
                let before = done.fetch_add(job.len as u64, Ordering::Relaxed);
                let after = before + job.len as u64;
                if tensor_bytes > (1 << 30)
                    && before * 10 / tensor_bytes != after * 10 / tensor_bytes
                {
                    tracing::info!(
                        "synth: {}% ({:.1} GB, {:.1}s)",
                        after * 100 / tensor_bytes,
                        after as f64 / 1e9,
                        t0.elapsed().as_secs_f64()
                    );
                }
                Ok(())
            },
        )
    })?;
    // Durable before the rename publishes it.
    pool.install(|| {
        files.par_iter().zip(&shards).try_for_each(|(f, s)| {
            f.sync_all()
                .map_err(|e| Error::io(format!("syncing {}", s.file), e))
        })
    })?;
    drop(files);

    let plan_ref = &plan;
    let mut weight_map: Vec<(&str, &str)> = shards
        .iter()
        .flat_map(|s| {
            s.tensors
                .iter()
                .map(move |&i| (plan_ref[i].name.as_str(), s.file.as_str()))
        })
        .collect();
    weight_map.sort();
    let mut wm = serde_json::Map::new();
    for (n, f) in weight_map {
        wm.insert(n.to_string(), json!(f));
    }
    let index = json!({
        "metadata": {"total_size": tensor_bytes, "total_parameters": spec.total_parameters()},
        "weight_map": Value::Object(wm),
    });
    write_file(
        &dir.join("model.safetensors.index.json"),
        &pretty_json(&index, b"    ")?,
    )?;
    write_file(
        &dir.join("config.json"),
        &pretty_json(&spec.config_json(), b"    ")?,
    )?;
    write_file(
        &dir.join("generation_config.json"),
        &pretty_json(&spec.generation_config_json(), b"  ")?,
    )?;
    if let Some(src) = opts.tokenizer_from {
        for f in TOKENIZER_FILES {
            let from = src.join(f);
            if from.is_file() {
                // Read and write rather than fs::copy: a read-only source (a shared fixture)
                // must not make the checkpoint's files read-only.
                let bytes = std::fs::read(&from)
                    .map_err(|e| Error::io(format!("reading {}", from.display()), e))?;
                write_file(&dir.join(f), &bytes)?;
            }
        }
    }
    Ok(SynthReport {
        bytes: shards.iter().map(Shard::file_bytes).sum(),
        tensor_bytes,
        tensors: plan.len(),
        shards: shards.len(),
        seconds: t0.elapsed().as_secs_f64(),
        out_dir: dir.to_path_buf(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_validate_and_size() {
        let big = SynthSpec::preset("35b-a3b").unwrap();
        big.validate().unwrap();
        let gb = big.tensor_bytes() as f64 / 1e9;
        assert!((19.0..20.5).contains(&gb), "35b-a3b is {gb} GB");
        SynthSpec::preset("tiny").unwrap().validate().unwrap();
        assert!(SynthSpec::preset("nope").is_err());
    }

    #[test]
    fn mrope_section_matches_real_config() {
        let v = SynthSpec::preset("35b-a3b").unwrap().config_json();
        assert_eq!(
            v["text_config"]["rope_parameters"]["mrope_section"],
            json!([11, 11, 10])
        );
        assert_eq!(
            v["text_config"]["rope_parameters"]["rope_theta"],
            json!(10_000_000)
        );
    }

    #[test]
    fn shards_follow_mlx_rule() {
        let spec = SynthSpec::preset("35b-a3b").unwrap();
        let plan = spec.plan();
        let shards = make_shards(&plan, spec.max_shard_bytes).unwrap();
        assert_eq!(shards.len(), 4);
        assert!(
            shards
                .iter()
                .all(|s| s.data_bytes <= DEFAULT_MAX_SHARD_BYTES)
        );
        assert!(shards.iter().all(|s| s.header.len() % 8 == 0));
        assert_eq!(shards[0].file, "model-00001-of-00004.safetensors");
    }

    #[test]
    fn group_affine_centres_codes() {
        let (s, b) = group_affine(7, 4, 0.1, 1, 3);
        let mean = s.to_f64() * 7.5 + b.to_f64();
        assert!(mean.abs() < 0.05, "{mean}");
        assert!((s.to_f64() * (255.0f64 / 12.0).sqrt() - 0.1).abs() < 0.011);
    }
}
