//! `lily generate`: one prompt, greedy, printed as text or as one JSON object.

use anyhow::{Context, Result, bail};
use engine::chat::ChatTemplate;
use engine::sampler::{Sampler, SamplingParams};
use engine::tokenizer::Tokenizer;
use serde_json::json;

use crate::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt text (tokenized as is, or wrapped as one user message with --chat).
    #[arg(long, conflicts_with = "prompt_ids")]
    pub prompt: Option<String>,
    /// Apply the chat template to --prompt as a single user message.
    #[arg(long, requires = "prompt")]
    pub chat: bool,
    /// With --chat: render the template with thinking disabled.
    #[arg(long, requires = "chat")]
    pub no_think: bool,
    /// Comma-separated prompt token ids, e.g. 1,2,3.
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Maximum tokens to generate (the stop token counts).
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Print one JSON object instead of the text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let dir = &a.model.model;
    let tokenizer = if dir.join("tokenizer.json").exists() {
        Some(Tokenizer::from_dir(dir)?)
    } else {
        None
    };
    let prompt_ids: Vec<u32> = match (&a.prompt, &a.prompt_ids) {
        (Some(text), None) => {
            let tok = tokenizer
                .as_ref()
                .with_context(|| format!("--prompt needs {}/tokenizer.json", dir.display()))?;
            let text = if a.chat {
                let template = ChatTemplate::from_dir(dir)?;
                let messages = json!([{"role": "user", "content": text}]);
                let mut kwargs = serde_json::Map::new();
                kwargs.insert("enable_thinking".into(), json!(!a.no_think));
                template.render(&messages, None, true, &kwargs)?
            } else {
                text.clone()
            };
            tok.encode(&text)?
        }
        (None, Some(ids)) => ids.clone(),
        _ => bail!("give exactly one of --prompt or --prompt-ids"),
    };
    if prompt_ids.is_empty() {
        bail!("the prompt is empty");
    }
    let t_load = std::time::Instant::now();
    let device = crate::open_device(a.model.device, a.model.threads)?;
    crate::with_engine!(device, &a.model.model, |eng| {
        let load_secs = t_load.elapsed().as_secs_f64();
        generate_on(&eng, &a, tokenizer.as_ref(), &prompt_ids, load_secs)
    })
}

fn generate_on<B: engine::backend::Backend>(
    eng: &engine::generate::Engine<B>,
    a: &GenerateArgs,
    tokenizer: Option<&engine::tokenizer::Tokenizer>,
    prompt_ids: &[u32],
    load_secs: f64,
) -> Result<()> {
    let stop_ids: Vec<u32> = match tokenizer {
        Some(t) => t.stop_ids().to_vec(),
        None => eng.config().eos_token_ids.clone(),
    };
    let mut state = eng.new_state(prompt_ids.len() + a.max_tokens + 1)?;
    let mut sampler = Sampler::new(SamplingParams::greedy());
    let streaming = !a.json;
    let mut stream = tokenizer.map(|t| t.stream_decoder());
    let mut on_token = |tok: u32| {
        if streaming
            && let Some(s) = stream.as_mut()
            && let Ok(piece) = s.push(tok)
        {
            use std::io::Write;
            print!("{piece}");
            let _ = std::io::stdout().flush();
        }
        true
    };
    let g = eng.generate(
        prompt_ids,
        a.max_tokens,
        &stop_ids,
        &mut state,
        &mut sampler,
        &mut on_token,
    )?;
    let text = match tokenizer {
        Some(t) => Some(t.decode(&g.tokens, true)?),
        None => None,
    };
    if a.json {
        let decode_steps = g.decode_tokens();
        let out = json!({
            "prompt_ids": prompt_ids,
            "tokens": g.tokens,
            "text": text,
            "finish_reason": g.finish.as_str(),
            "timings": {
                "load_ms": load_secs * 1e3,
                "prompt_tokens": prompt_ids.len(),
                "prefill_ms": g.prefill_secs * 1e3,
                "prefill_tok_s": prompt_ids.len() as f64 / g.prefill_secs.max(1e-9),
                "decode_steps": decode_steps,
                "decode_ms": g.decode_secs * 1e3,
                "decode_tok_s": decode_steps as f64 / g.decode_secs.max(1e-9),
            },
            "device": eng.backend_name(),
        });
        println!("{}", serde_json::to_string(&out)?);
    } else {
        if let Some(s) = stream.as_mut() {
            print!("{}", s.finish()?);
        }
        println!();
        eprintln!(
            "[{} prompt tokens, {:.1} tok/s prefill; {} tokens, {:.1} tok/s decode; finish {}]",
            prompt_ids.len(),
            prompt_ids.len() as f64 / g.prefill_secs.max(1e-9),
            g.tokens.len(),
            g.decode_tokens() as f64 / g.decode_secs.max(1e-9),
            g.finish.as_str()
        );
    }
    Ok(())
}
