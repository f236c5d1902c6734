//! The generation loop: chunked prefill, then one-token decode steps on the same state.

use std::path::Path;
use std::time::Instant;

use crate::backend::{Backend, QueuedStep, StepInput};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::model::qwen3_5_moe::{Logits, Qwen35Moe};
use crate::model::state::DecodeState;
use crate::sampler::Sampler;

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
    /// Tokens fed through the model during decode: all but the last generated token, and the
    /// last too where a chained step feeding it was already queued when generation stopped
    /// (the state has then consumed it).
    pub decode_fed: usize,
}

impl Generation {
    /// Tokens chosen by decode steps (every token after the first), for decode speed.
    pub fn decode_tokens(&self) -> usize {
        self.tokens.len().saturating_sub(1)
    }
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

    /// Whether `generate` chains its decode steps with `sampler`: the backend chains them and
    /// the choice never needs the whole row (`SamplingParams::choice_is_bounded`).
    pub fn chains_decode(&self, sampler: &Sampler) -> bool {
        let p = sampler.params();
        p.choice_is_bounded(self.model.cfg.vocab_size) && self.backend.chains_decode(p)
    }

    /// Queues a chained decode step feeding `input` that chooses the next token with
    /// `sampler`'s parameters and next draw.
    fn queue_step(
        &self,
        input: StepInput,
        sampler: &mut Sampler,
        state: &mut DecodeState<B>,
    ) -> Result<QueuedStep> {
        if let StepInput::Host(token) = input {
            self.check_tokens(&[token])?;
        }
        let choice = sampler.device_choice(matches!(input, StepInput::Host(_)));
        self.backend
            .queue_decode_step(state, input, &choice, &mut |st, token| {
                self.logits_for(&[token], st)
            })
    }

    /// Prefills `prompt` (continuing `state`), then decodes until a stop token, `max_tokens`,
    /// or `on_token` returns false, each token chosen by `sampler`.
    ///
    /// Where the backend chains steps (`chains_decode`), each step is queued before the host
    /// reads the token of the step before it, which the device feeds on its own: the GPU never
    /// waits for the host. A step is not queued for a token known to be the last (`max_tokens`);
    /// a stop token or a cancel comes after its step was queued, so the state has then consumed
    /// the last token too (`Generation::decode_fed`).
    pub fn generate(
        &self,
        prompt: &[u32],
        max_tokens: usize,
        stop_ids: &[u32],
        state: &mut DecodeState<B>,
        sampler: &mut Sampler,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Generation> {
        if max_tokens == 0 {
            return Err(Error::invalid("max_tokens must be at least 1"));
        }
        let t0 = Instant::now();
        let logits = self.prefill(prompt, state)?;
        let mut token = sampler.pick(&self.backend, &logits)?;
        let prefill_secs = t0.elapsed().as_secs_f64();
        let chained = self.chains_decode(sampler);
        let t1 = Instant::now();
        let mut tokens = Vec::new();
        let mut decode_fed = 0;
        // When chained: the queued step that feeds `token`, if already queued.
        let mut queued: Option<QueuedStep> = None;
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
            decode_fed += 1;
            if chained {
                let feeding = match queued.take() {
                    Some(q) => q,
                    None => self.queue_step(StepInput::Host(token), sampler, state)?,
                };
                if tokens.len() + 1 < max_tokens {
                    queued = Some(self.queue_step(StepInput::Chosen, sampler, state)?);
                }
                token = self.backend.chosen_token(feeding)?;
                sampler.accept(token);
            } else {
                let logits = self.decode_step(token, state)?;
                token = sampler.pick(&self.backend, &logits)?;
            }
        };
        if queued.is_some() {
            // That step has fed the last token; what it chose is never read.
            decode_fed += 1;
        }
        Ok(Generation {
            tokens,
            finish,
            prefill_secs,
            decode_secs: t1.elapsed().as_secs_f64(),
            decode_fed,
        })
    }
}
