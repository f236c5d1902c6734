//! config.json -> a validated model configuration for the `qwen3_5_moe` family.
//!
//! mlx-community checkpoints wrap the text model's fields in `text_config` and carry a top-level
//! `quantization` block (default mode/bits/group plus per-module overrides, e.g. the 8-bit router).
//! Every field the graph depends on is read here and checked against what the kernels support, so
//! that a bad checkpoint fails at load with a message naming the field.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};

/// The architecture string this engine implements.
pub const MODEL_TYPE: &str = "qwen3_5_moe";
/// MLX affine quantization group size: the only one the kernels implement.
pub const GROUP_SIZE: usize = 64;

/// What one decoder layer mixes tokens with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (linear attention with a recurrent state).
    LinearAttention,
    /// Gated full attention with a KV cache.
    FullAttention,
}

/// Quantization of one module: MLX affine, `bits` per weight, one scale and bias per group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantSpec {
    pub bits: u32,
    pub group_size: usize,
}

/// The checkpoint's quantization block: a default plus per-module overrides (keyed by the
/// module path without `.weight`, e.g. `language_model.model.layers.0.mlp.gate`).
#[derive(Clone, Debug)]
pub struct QuantConfig {
    pub default: QuantSpec,
    pub overrides: BTreeMap<String, QuantSpec>,
}

impl QuantConfig {
    /// The spec that applies to module `path`.
    pub fn spec_for(&self, path: &str) -> QuantSpec {
        self.overrides.get(path).copied().unwrap_or(self.default)
    }
}

/// Everything the `qwen3_5_moe` graph needs to know, validated.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub layer_types: Vec<LayerKind>,
    // Gated full attention.
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub rope_theta: f64,
    // Gated DeltaNet.
    pub linear_key_heads: usize,
    pub linear_value_heads: usize,
    pub linear_key_dim: usize,
    pub linear_value_dim: usize,
    pub conv_kernel: usize,
    // Mixture of experts.
    pub num_experts: usize,
    pub top_k: usize,
    pub moe_intermediate: usize,
    pub shared_intermediate: usize,
    pub norm_topk_prob: bool,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// `eos_token_id` from config.json (top level overrides text_config).
    pub eos_token_ids: Vec<u32>,
    pub quant: QuantConfig,
}

impl ModelConfig {
    /// Channels of the GDN causal conv: q and k (key heads) and v (value heads).
    pub fn conv_dim(&self) -> usize {
        2 * self.linear_key_heads * self.linear_key_dim
            + self.linear_value_heads * self.linear_value_dim
    }
    pub fn key_dim(&self) -> usize {
        self.linear_key_heads * self.linear_key_dim
    }
    pub fn value_dim(&self) -> usize {
        self.linear_value_heads * self.linear_value_dim
    }
    pub fn num_full_attention_layers(&self) -> usize {
        self.layer_types
            .iter()
            .filter(|k| **k == LayerKind::FullAttention)
            .count()
    }

    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| Error::config(format!("cannot read {}: {e}", path.display())))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| Error::config(format!("{} is not valid JSON: {e}", path.display())))?;
        Self::from_json(&json)
    }

    pub fn from_json(root: &Value) -> Result<Self> {
        let root_obj = root
            .as_object()
            .ok_or_else(|| Error::config("config.json is not a JSON object"))?;
        let model_type = root_obj
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("<missing>");
        if model_type != MODEL_TYPE {
            return Err(Error::config(format!(
                "unsupported model_type {model_type:?}; lily supports {MODEL_TYPE:?} (Qwen3.5/3.6 MoE)"
            )));
        }
        // mlx-community configs nest the text model; accept a flat config too.
        let tc = match root_obj.get("text_config") {
            Some(Value::Object(m)) => m,
            Some(_) => return Err(Error::config("text_config is not an object")),
            None => root_obj,
        };
        let f = Fields(tc);

        let hidden_size = f.usize("hidden_size")?;
        let num_layers = f.usize("num_hidden_layers")?;
        let layer_types = match tc.get("layer_types") {
            Some(Value::Array(items)) => {
                let kinds = items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| match v.as_str() {
                        Some("linear_attention") => Ok(LayerKind::LinearAttention),
                        Some("full_attention") => Ok(LayerKind::FullAttention),
                        _ => Err(Error::config(format!("layer_types[{i}] is {v}; expected \"linear_attention\" or \"full_attention\""))),
                    })
                    .collect::<Result<Vec<_>>>()?;
                if kinds.len() != num_layers {
                    return Err(Error::config(format!(
                        "layer_types has {} entries for {num_layers} layers",
                        kinds.len()
                    )));
                }
                kinds
            }
            Some(_) => return Err(Error::config("layer_types is not a list")),
            None => {
                let interval = f.usize("full_attention_interval")?;
                if interval == 0 {
                    return Err(Error::config("full_attention_interval must be positive"));
                }
                (0..num_layers)
                    .map(|i| {
                        if (i + 1) % interval == 0 {
                            LayerKind::FullAttention
                        } else {
                            LayerKind::LinearAttention
                        }
                    })
                    .collect()
            }
        };

        let rope = tc.get("rope_parameters").and_then(Value::as_object);
        let lookup = |key: &str| rope.and_then(|r| r.get(key)).or_else(|| tc.get(key));
        let rope_theta = lookup("rope_theta")
            .and_then(Value::as_f64)
            .unwrap_or(10_000_000.0);
        let partial = lookup("partial_rotary_factor")
            .and_then(Value::as_f64)
            .unwrap_or(1.0);
        let head_dim = f.usize("head_dim")?;
        let rotary_dim = (head_dim as f64 * partial) as usize;

        if let Some(v) = tc.get("attn_output_gate")
            && v.as_bool() != Some(true)
        {
            return Err(Error::config(
                "attn_output_gate must be true for qwen3_5_moe",
            ));
        }

        let eos_token_ids = root_obj
            .get("eos_token_id")
            .or_else(|| tc.get("eos_token_id"))
            .map(token_id_list)
            .transpose()?
            .unwrap_or_default();

        let cfg = ModelConfig {
            hidden_size,
            num_layers,
            vocab_size: f.usize("vocab_size")?,
            rms_norm_eps: f.f64("rms_norm_eps")? as f32,
            layer_types,
            num_heads: f.usize("num_attention_heads")?,
            num_kv_heads: f.usize("num_key_value_heads")?,
            head_dim,
            rotary_dim,
            rope_theta,
            linear_key_heads: f.usize("linear_num_key_heads")?,
            linear_value_heads: f.usize("linear_num_value_heads")?,
            linear_key_dim: f.usize("linear_key_head_dim")?,
            linear_value_dim: f.usize("linear_value_head_dim")?,
            conv_kernel: f.usize("linear_conv_kernel_dim")?,
            num_experts: f.usize("num_experts")?,
            top_k: f.usize("num_experts_per_tok")?,
            moe_intermediate: f.usize("moe_intermediate_size")?,
            shared_intermediate: f.usize("shared_expert_intermediate_size")?,
            norm_topk_prob: tc
                .get("norm_topk_prob")
                .and_then(Value::as_bool)
                .unwrap_or(true),
            max_position_embeddings: f.usize_or("max_position_embeddings", 262_144)?,
            tie_word_embeddings: root_obj
                .get("tie_word_embeddings")
                .or_else(|| tc.get("tie_word_embeddings"))
                .and_then(Value::as_bool)
                .unwrap_or(false),
            eos_token_ids,
            quant: parse_quantization(root_obj)?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The structural limits of the kernels (docs/architecture.md lists them).
    fn validate(&self) -> Result<()> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_layers),
            ("vocab_size", self.vocab_size),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("linear_num_key_heads", self.linear_key_heads),
            ("linear_num_value_heads", self.linear_value_heads),
            ("linear_key_head_dim", self.linear_key_dim),
            ("linear_value_head_dim", self.linear_value_dim),
            ("linear_conv_kernel_dim", self.conv_kernel),
            ("num_experts", self.num_experts),
            ("num_experts_per_tok", self.top_k),
            ("moe_intermediate_size", self.moe_intermediate),
            ("shared_expert_intermediate_size", self.shared_intermediate),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(Error::config(format!("{name} must be positive")));
            }
        }
        let g = self.quant.default.group_size;
        for (name, v) in [
            ("hidden_size", self.hidden_size),
            ("moe_intermediate_size", self.moe_intermediate),
            ("shared_expert_intermediate_size", self.shared_intermediate),
            (
                "num_attention_heads*head_dim",
                self.num_heads * self.head_dim,
            ),
            ("linear value dim", self.value_dim()),
        ] {
            if !v.is_multiple_of(g) {
                return Err(Error::config(format!(
                    "{name} = {v} is not a multiple of the quantization group size {g}"
                )));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(Error::config(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_heads, self.num_kv_heads
            )));
        }
        if !self
            .linear_value_heads
            .is_multiple_of(self.linear_key_heads)
        {
            return Err(Error::config(format!(
                "linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
                self.linear_value_heads, self.linear_key_heads
            )));
        }
        if !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > self.head_dim {
            return Err(Error::config(format!(
                "rotary dim {} must be even and at most head_dim {}",
                self.rotary_dim, self.head_dim
            )));
        }
        if self.top_k > self.num_experts {
            return Err(Error::config(format!(
                "num_experts_per_tok {} exceeds num_experts {}",
                self.top_k, self.num_experts
            )));
        }
        if self.tie_word_embeddings {
            return Err(Error::config(
                "tie_word_embeddings=true is not supported (qwen3_5_moe has a separate lm_head)",
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(Error::config(format!(
                "rms_norm_eps {} must be positive",
                self.rms_norm_eps
            )));
        }
        Ok(())
    }
}

fn token_id_list(v: &Value) -> Result<Vec<u32>> {
    let one = |x: &Value| {
        x.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| Error::config(format!("eos_token_id entry {x} is not a token id")))
    };
    match v {
        Value::Array(items) => items.iter().map(one).collect(),
        Value::Null => Ok(Vec::new()),
        other => Ok(vec![one(other)?]),
    }
}

fn parse_quantization(root: &serde_json::Map<String, Value>) -> Result<QuantConfig> {
    let q = root
        .get("quantization")
        .or_else(|| root.get("quantization_config"))
        .and_then(Value::as_object)
        .ok_or_else(|| {
            Error::config(
                "config.json has no quantization block: lily needs an MLX affine 4-bit checkpoint",
            )
        })?;
    let mode = q.get("mode").and_then(Value::as_str).unwrap_or("affine");
    let bits = q.get("bits").and_then(Value::as_u64).unwrap_or(0);
    let group_size = q.get("group_size").and_then(Value::as_u64).unwrap_or(0);
    if mode != "affine" || bits != 4 || group_size != GROUP_SIZE as u64 {
        return Err(Error::config(format!(
            "unsupported quantization: mode={mode:?}, bits={bits}, group_size={group_size}; expected MLX affine 4-bit with group_size 64"
        )));
    }
    let default = QuantSpec {
        bits: 4,
        group_size: GROUP_SIZE,
    };
    let mut overrides = BTreeMap::new();
    for (path, spec) in q {
        let Some(spec) = spec.as_object() else {
            continue;
        };
        let bits = spec.get("bits").and_then(Value::as_u64).unwrap_or(4);
        let gs = spec
            .get("group_size")
            .and_then(Value::as_u64)
            .unwrap_or(GROUP_SIZE as u64);
        let smode = spec.get("mode").and_then(Value::as_str).unwrap_or("affine");
        if !(bits == 4 || bits == 8) || gs != GROUP_SIZE as u64 || smode != "affine" {
            return Err(Error::config(format!(
                "unsupported quantization for {path}: mode={smode:?}, bits={bits}, group_size={gs}; expected affine 4- or 8-bit with group_size 64"
            )));
        }
        overrides.insert(
            path.clone(),
            QuantSpec {
                bits: bits as u32,
                group_size: GROUP_SIZE,
            },
        );
    }
    Ok(QuantConfig { default, overrides })
}

/// Typed access to required config fields with errors that name the field.
struct Fields<'a>(&'a serde_json::Map<String, Value>);

impl Fields<'_> {
    fn usize(&self, key: &str) -> Result<usize> {
        match self.0.get(key) {
            Some(v) => v.as_u64().map(|n| n as usize).ok_or_else(|| {
                Error::config(format!(
                    "config field {key} is {v}; expected a non-negative integer"
                ))
            }),
            None => Err(Error::config(format!("config field {key} is missing"))),
        }
    }
    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        if self.0.get(key).is_none_or(Value::is_null) {
            Ok(default)
        } else {
            self.usize(key)
        }
    }
    fn f64(&self, key: &str) -> Result<f64> {
        match self.0.get(key) {
            Some(v) => v.as_f64().ok_or_else(|| {
                Error::config(format!("config field {key} is {v}; expected a number"))
            }),
            None => Err(Error::config(format!("config field {key} is missing"))),
        }
    }
}
