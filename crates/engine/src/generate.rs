//! The generation loop: chunked prefill, then one-token decode steps on the same state.

use std::path::Path;
use std::time::Instant;

use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::model::qwen3_5_moe::{Logits, Qwen35Moe};
use crate::model::state::DecodeState;

/// A loaded model on a backend.
pub struct Engine<B: Backend> {
    pub backend: B,
    pub model: Qwen35Moe<B>,
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was produced (it is the last token of the output).
    Stop,
    /// `max_tokens` were produced.
    Length,
    /// The caller asked to stop (client gone, stop string matched).
    Cancelled,
}

impl FinishReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    pub prefill_secs: f64,
    pub decode_secs: f64,
    /// Tokens fed through the model during decode (the last generated token is not fed).
    pub decode_fed: usize,
}

impl<B: Backend> Engine<B> {
    pub fn load(dir: &Path, backend: B) -> Result<Self> {
        let cfg = ModelConfig::from_dir(dir)?;
        let model = Qwen35Moe::load(dir, cfg, &backend)?;
        Ok(Engine { backend, model })
    }

    pub fn backend_name(&self) -> String {
        self.backend.name()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.model.cfg
    }

    pub fn new_state(&self, max_seq: usize) -> Result<DecodeState<B>> {
        self.model.new_state(&self.backend, max_seq)
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let vocab = self.model.cfg.vocab_size;
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(bad) => Err(Error::invalid(format!(
                "token id {bad} is outside the model's vocabulary of {vocab}"
            ))),
            None => Ok(()),
        }
    }

    /// Prompt tokens per prefill forward on this engine's backend.
    pub fn prefill_chunk(&self) -> usize {
        self.backend.prefill_chunk().max(1)
    }

    /// Feeds `tokens` in chunks; returns the last token's logits `[1, vocab]` on the device.
    pub fn prefill(&self, tokens: &[u32], state: &mut DecodeState<B>) -> Result<B::Tensor> {
        self.check_tokens(tokens)?;
        let chunk = self.prefill_chunk();
        let n_chunks = tokens.len().div_ceil(chunk);
        let mut chunks = tokens.chunks(chunk);
        for chunk in chunks.by_ref().take(n_chunks.saturating_sub(1)) {
            self.model
                .forward(&self.backend, chunk, state, Logits::None)?;
        }
        let last = chunks
            .next()
            .ok_or_else(|| Error::invalid("the prompt is empty"))?;
        self.logits_for(last, state)
    }

    /// Feeds `tokens` in chunks without computing any logits.
    pub fn extend(&self, tokens: &[u32], state: &mut DecodeState<B>) -> Result<()> {
        self.check_tokens(tokens)?;
        for chunk in tokens.chunks(self.prefill_chunk()) {
            self.model
                .forward(&self.backend, chunk, state, Logits::None)?;
        }
        Ok(())
    }

    /// Feeds one token; returns its logits `[1, vocab]` on the device (valid until the next
    /// step: a backend may replay a recorded step into the same buffer).
    pub fn decode_step(&self, token: u32, state: &mut DecodeState<B>) -> Result<B::Tensor> {
        self.check_tokens(&[token])?;
        self.backend
            .decode_step(state, token, &mut |st| self.logits_for(&[token], st))
    }

    fn logits_for(&self, tokens: &[u32], state: &mut DecodeState<B>) -> Result<B::Tensor> {
        self.model
            .forward(&self.backend, tokens, state, Logits::Last)?
            .ok_or_else(|| Error::Backend("forward returned no logits".into()))
    }

    /// Greedy choice from a logits row.
    pub fn argmax(&self, logits: &B::Tensor) -> Result<u32> {
        self.backend.argmax_row(logits)
    }

    /// Prefills `prompt` (continuing `state`), then decodes until a stop token, `max_tokens`,
    /// or `on_token` returns false. `pick` chooses each token from the logits.
    pub fn generate(
        &self,
        prompt: &[u32],
        max_tokens: usize,
        stop_ids: &[u32],
        state: &mut DecodeState<B>,
        pick: &mut dyn FnMut(&B, &B::Tensor) -> Result<u32>,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Generation> {
        if max_tokens == 0 {
            return Err(Error::invalid("max_tokens must be at least 1"));
        }
        let t0 = Instant::now();
        let mut logits = self.prefill(prompt, state)?;
        let mut token = pick(&self.backend, &logits)?;
        let prefill_secs = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut tokens = Vec::new();
        let mut decode_fed = 0;
        let finish = loop {
            tokens.push(token);
            let go_on = on_token(token);
            if stop_ids.contains(&token) {
                break FinishReason::Stop;
            }
            if tokens.len() >= max_tokens {
                break FinishReason::Length;
            }
            if !go_on {
                break FinishReason::Cancelled;
            }
            logits = self.decode_step(token, state)?;
            decode_fed += 1;
            token = pick(&self.backend, &logits)?;
        };
        Ok(Generation {
            tokens,
            finish,
            prefill_secs,
            decode_secs: t1.elapsed().as_secs_f64(),
            decode_fed,
        })
    }
}
