//! One submitted generation as the HTTP layer sees it: engine events in, response parts out.
//! Owning the `GenStream` here means whoever owns the `Run` (the handler future, or the SSE
//! body stream) cancels the engine by being dropped, e.g. when the client disconnects.

use engine::generate::FinishReason;

use super::error::ApiError;
use super::response::Finished;
use super::text::{Assembler, Part};
use std::sync::Arc;

use super::{LogTokens, ReqLog};
use crate::scheduler::{GenEvent, GenStream};

pub enum Step {
    /// Nothing to send (e.g. the engine started).
    Idle,
    Parts(Vec<Part>),
    /// Generation ended; the last parts that were held back, then the summary.
    Done(Vec<Part>, Finished),
    Failed(ApiError),
}

pub struct Run {
    stream: GenStream,
    asm: Assembler,
    finished: bool,
    log: Arc<ReqLog>,
    prompt_tokens: usize,
    cached_tokens: usize,
}

impl Run {
    pub fn new(stream: GenStream, asm: Assembler, log: Arc<ReqLog>, prompt_tokens: usize) -> Run {
        Run {
            stream,
            asm,
            finished: false,
            log,
            prompt_tokens,
            cached_tokens: 0,
        }
    }

    /// Waits for the next engine event. After `Done` or `Failed` it keeps returning `Failed`.
    pub async fn next(&mut self) -> Step {
        if self.finished {
            return Step::Failed(ApiError::Engine("the request already finished".into()));
        }
        let Some(ev) = self.stream.events.recv().await else {
            self.finished = true;
            return Step::Failed(ApiError::Engine(
                "the engine stopped before finishing the request".into(),
            ));
        };
        match ev {
            GenEvent::Started {
                cached_tokens,
                queue_ms,
            } => {
                self.cached_tokens = cached_tokens;
                tracing::debug!(
                    "generation started after {queue_ms:.1}ms in the queue, {cached_tokens} prompt tokens cached"
                );
                Step::Idle
            }
            GenEvent::Token(id) => match self.asm.push_token(id) {
                Ok(parts) => {
                    if self.asm.stopped {
                        // A stop string matched: stop the engine at its next step; its Done
                        // event still arrives with the timings.
                        self.stream.cancel();
                    }
                    Step::Parts(parts)
                }
                Err(e) => self.fail(ApiError::Engine(format!(
                    "detokenizing the output failed: {e}"
                ))),
            },
            GenEvent::Done(summary) => {
                self.finished = true;
                let tail = match self.asm.finish() {
                    Ok(t) => t,
                    Err(e) => {
                        return Step::Failed(ApiError::Engine(format!(
                            "detokenizing the output failed: {e}"
                        )));
                    }
                };
                let reason = match summary.finish {
                    _ if self.asm.stopped => "stop",
                    Some(FinishReason::Length) => "length",
                    _ => "stop",
                };
                // With a stop string, the client is charged up to the token that completed it.
                let completion = if self.asm.stopped {
                    self.asm.tokens
                } else {
                    summary.completion_tokens
                };
                Step::Done(
                    tail,
                    Finished::new(
                        &summary,
                        reason,
                        completion,
                        self.asm.reasoning_tokens.min(completion),
                    ),
                )
            }
            GenEvent::Error(msg) => self.fail(ApiError::Engine(msg)),
        }
    }

    fn fail(&mut self, e: ApiError) -> Step {
        self.finished = true;
        self.stream.cancel();
        Step::Failed(e)
    }
}

impl Drop for Run {
    /// Dropped before the end: the client went away (the GenStream's drop cancels the engine).
    fn drop(&mut self) {
        if !self.finished {
            self.log.set_tokens(LogTokens {
                prompt: self.prompt_tokens,
                cached: self.cached_tokens,
                completion: self.asm.tokens,
                decode_ms: 0.0,
            });
            self.log
                .set_error("client disconnected; generation cancelled".into());
        }
    }
}

pub fn log_tokens(fin: &Finished) -> LogTokens {
    LogTokens {
        prompt: fin.usage.prompt_tokens,
        cached: fin.usage.prompt_tokens_details.cached_tokens,
        completion: fin.usage.completion_tokens,
        decode_ms: fin.timings.decode_ms,
    }
}
