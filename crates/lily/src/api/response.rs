//! Response bodies: chat.completion, text_completion, their stream chunks, usage and timings.

use serde::Serialize;
use serde_json::{Value, json};

use crate::scheduler::GenSummary;

#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptDetails,
    pub completion_tokens_details: CompletionDetails,
}

#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct PromptDetails {
    pub cached_tokens: usize,
}

#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct CompletionDetails {
    pub reasoning_tokens: usize,
}

/// lily's per-request timings (not part of OpenAI's API; clients ignore unknown fields).
#[derive(Serialize, Clone, Debug, PartialEq)]
pub struct Timings {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub prefilled_tokens: usize,
    pub prefill_ms: f64,
    pub prefill_tok_s: f64,
    pub generated_tokens: usize,
    pub decode_ms: f64,
    pub decode_tok_s: f64,
    pub queue_ms: f64,
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn rate(n: usize, ms: f64) -> f64 {
    if ms > 0.0 {
        round2(n as f64 / (ms / 1e3))
    } else {
        0.0
    }
}

impl Timings {
    pub fn from_summary(s: &GenSummary) -> Timings {
        Timings {
            prompt_tokens: s.prompt_tokens,
            cached_tokens: s.cached_tokens,
            prefilled_tokens: s.prefilled_tokens,
            prefill_ms: round2(s.prefill_ms),
            prefill_tok_s: rate(s.prefilled_tokens, s.prefill_ms),
            generated_tokens: s.completion_tokens,
            decode_ms: round2(s.decode_ms),
            decode_tok_s: rate(s.completion_tokens, s.decode_ms),
            queue_ms: round2(s.queue_ms),
        }
    }
}

/// The outcome of one generation, as both endpoints report it.
#[derive(Clone, Debug)]
pub struct Finished {
    pub finish_reason: &'static str,
    pub usage: Usage,
    pub timings: Timings,
}

impl Finished {
    /// `completion_tokens`: tokens the client got (a stop string ends the count at its token).
    pub fn new(
        summary: &GenSummary,
        finish_reason: &'static str,
        completion_tokens: usize,
        reasoning_tokens: usize,
    ) -> Finished {
        Finished {
            finish_reason,
            usage: Usage {
                prompt_tokens: summary.prompt_tokens,
                completion_tokens,
                total_tokens: summary.prompt_tokens + completion_tokens,
                prompt_tokens_details: PromptDetails {
                    cached_tokens: summary.cached_tokens,
                },
                completion_tokens_details: CompletionDetails { reasoning_tokens },
            },
            timings: Timings::from_summary(summary),
        }
    }
}

/// What every response object of one request shares.
#[derive(Clone, Debug)]
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
    /// chat.completion vs text_completion.
    pub chat: bool,
}

impl Meta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.chat, chunk) {
            (true, false) => "chat.completion",
            (true, true) => "chat.completion.chunk",
            (false, _) => "text_completion",
        }
    }

    /// The non-streaming response.
    pub fn completion(&self, reasoning: Option<&str>, content: &str, fin: &Finished) -> Value {
        let choice = if self.chat {
            let mut message = json!({"role": "assistant", "content": content});
            if let (Some(r), Some(m)) = (reasoning, message.as_object_mut()) {
                m.insert("reasoning_content".into(), r.into());
            }
            json!({"index": 0, "message": message, "logprobs": null, "finish_reason": fin.finish_reason})
        } else {
            json!({"index": 0, "text": content, "logprobs": null, "finish_reason": fin.finish_reason})
        };
        json!({
            "id": self.id, "object": self.object(false), "created": self.created, "model": self.model,
            "choices": [choice], "usage": fin.usage, "timings": fin.timings,
        })
    }

    /// A stream chunk carrying `delta` (chat) or text (completions). `usage` is null in every
    /// chunk but the last when the client asked for usage, as OpenAI does.
    pub fn chunk(&self, delta: Value, finish_reason: Option<&str>, with_usage_null: bool) -> Value {
        let choice = if self.chat {
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason})
        } else {
            let text = delta.get("content").cloned().unwrap_or_else(|| "".into());
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason})
        };
        let mut v = json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": [choice]});
        if with_usage_null && let Some(o) = v.as_object_mut() {
            o.insert("usage".into(), Value::Null);
        }
        v
    }

    /// The usage chunk after the final one: no choices.
    pub fn usage_chunk(&self, fin: &Finished) -> Value {
        json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "choices": [], "usage": fin.usage, "timings": fin.timings,
        })
    }
}
