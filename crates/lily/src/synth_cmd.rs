//! `lily synth`: write a random-weight checkpoint of the qwen3_5_moe family in the
//! mlx-community layout (for benchmarks where no real weights can be downloaded).

use std::path::PathBuf;

use anyhow::{Context, Result};
use engine::synth::{SynthSpec, WriteOptions, write_checkpoint_with};

#[derive(clap::Args, Debug)]
pub struct SynthArgs {
    /// Output checkpoint directory (must not exist or be empty, unless --force).
    #[arg(long)]
    pub out: PathBuf,
    /// Shape to start from: 35b-a3b (Qwen3.6-35B-A3B, ~19.5 GB) or tiny (the test fixture's shape).
    #[arg(long, default_value = "35b-a3b")]
    pub preset: String,
    /// Seed of the random weights (same seed and shape = byte-identical shards).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Copy tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json
    /// from this directory.
    #[arg(long)]
    pub tokenizer_from: Option<PathBuf>,
    /// Writer threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Replace a non-empty output directory (only once the new checkpoint is complete).
    #[arg(long)]
    pub force: bool,
    /// Maximum tensor bytes per shard, in MiB (default: mlx-lm's 5 GiB).
    #[arg(long)]
    pub max_shard_mib: Option<u64>,

    /// Overrides of the preset's shape (boxed: they would make `SynthArgs` the largest variant
    /// of the command enum by far).
    #[command(flatten)]
    pub shape: Box<ShapeArgs>,
}

/// Per-field overrides of a preset's shape.
#[derive(clap::Args, Debug, Default)]
pub struct ShapeArgs {
    /// Hidden size (a multiple of 64).
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Decoder layers.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Every N-th layer is full attention (layer i iff (i+1) % N == 0).
    #[arg(long)]
    pub full_attention_interval: Option<usize>,
    /// Vocabulary rows of the embedding and lm_head.
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Attention query heads.
    #[arg(long)]
    pub heads: Option<usize>,
    /// Attention key/value heads.
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Attention head dim.
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// Gated DeltaNet key heads.
    #[arg(long)]
    pub linear_key_heads: Option<usize>,
    /// Gated DeltaNet value heads.
    #[arg(long)]
    pub linear_value_heads: Option<usize>,
    /// Gated DeltaNet key head dim.
    #[arg(long)]
    pub linear_key_dim: Option<usize>,
    /// Gated DeltaNet value head dim.
    #[arg(long)]
    pub linear_value_dim: Option<usize>,
    /// Gated DeltaNet causal conv kernel size.
    #[arg(long)]
    pub conv_kernel: Option<usize>,
    /// Routed experts per layer.
    #[arg(long)]
    pub experts: Option<usize>,
    /// Experts per token.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Routed expert intermediate size (a multiple of 64).
    #[arg(long)]
    pub moe_inter: Option<usize>,
    /// Shared expert intermediate size (a multiple of 64).
    #[arg(long)]
    pub shared_inter: Option<usize>,
    /// RoPE base.
    #[arg(long)]
    pub rope_theta: Option<f64>,
    /// Fraction of each attention head that is rotated.
    #[arg(long)]
    pub partial_rotary_factor: Option<f64>,
    /// RMSNorm epsilon.
    #[arg(long)]
    pub rms_norm_eps: Option<f64>,
    /// max_position_embeddings written to config.json.
    #[arg(long)]
    pub max_position_embeddings: Option<usize>,
    /// End-of-sequence token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub eos: Option<Vec<u32>>,
}

impl SynthArgs {
    fn spec(&self) -> Result<SynthSpec> {
        let mut s = SynthSpec::preset(&self.preset)?;
        macro_rules! set {
            ($($field:ident <- $arg:ident),* $(,)?) => {
                $(if let Some(v) = self.shape.$arg { s.$field = v; })*
            };
        }
        set!(
            hidden <- hidden,
            layers <- layers,
            full_attention_interval <- full_attention_interval,
            vocab <- vocab,
            heads <- heads,
            kv_heads <- kv_heads,
            head_dim <- head_dim,
            linear_key_heads <- linear_key_heads,
            linear_value_heads <- linear_value_heads,
            linear_key_dim <- linear_key_dim,
            linear_value_dim <- linear_value_dim,
            conv_kernel <- conv_kernel,
            experts <- experts,
            top_k <- top_k,
            moe_inter <- moe_inter,
            shared_inter <- shared_inter,
            rope_theta <- rope_theta,
            partial_rotary_factor <- partial_rotary_factor,
            rms_norm_eps <- rms_norm_eps,
            max_position_embeddings <- max_position_embeddings,
        );
        if let Some(seed) = self.seed {
            s.seed = seed;
        }
        if let Some(eos) = &self.shape.eos {
            s.eos_token_ids = eos.clone();
        }
        if let Some(mib) = self.max_shard_mib {
            s.max_shard_bytes = mib
                .checked_mul(1 << 20)
                .context("--max-shard-mib is too large")?;
        }
        Ok(s)
    }
}

pub fn run(a: SynthArgs) -> Result<()> {
    let spec = a.spec()?;
    let opts = WriteOptions {
        tokenizer_from: a.tokenizer_from.as_deref(),
        threads: a.threads,
        force: a.force,
    };
    let r = write_checkpoint_with(&spec, &a.out, &opts)
        .with_context(|| format!("writing {}", a.out.display()))?;
    let gb = r.bytes as f64 / 1e9;
    println!(
        "wrote {}: {} bytes ({gb:.2} GB), {} tensors in {} shard(s), {:.1}s, {:.2} GB/s",
        r.out_dir.display(),
        r.bytes,
        r.tensors,
        r.shards,
        r.seconds,
        gb / r.seconds.max(1e-9)
    );
    Ok(())
}
