//! Server-sent events, as OpenAI streams: a role chunk, content / reasoning_content deltas, a
//! final chunk with the finish reason, an optional usage chunk, then `data: [DONE]`.
//! The body stream owns the `Run` (and so the `GenStream`): when the client disconnects, hyper
//! drops the body, which cancels the generation.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::ReqLog;
use super::response::Meta;
use super::run::{Run, Step, log_tokens};
use super::text::Part;

struct State {
    run: Run,
    meta: Meta,
    include_usage: bool,
    log: Arc<ReqLog>,
    queue: VecDeque<Event>,
    done: bool,
}

fn data(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

impl State {
    fn push_parts(&mut self, parts: Vec<Part>) {
        for p in parts {
            let delta = match p {
                Part::Reasoning(t) => json!({"reasoning_content": t}),
                Part::Content(t) => json!({"content": t}),
            };
            let chunk = self.meta.chunk(delta, None, self.include_usage);
            self.queue.push_back(data(&chunk));
        }
    }

    fn step(&mut self, step: Step) {
        match step {
            Step::Idle => {}
            Step::Parts(parts) => self.push_parts(parts),
            Step::Done(tail, fin) => {
                self.push_parts(tail);
                let mut last =
                    self.meta
                        .chunk(json!({}), Some(fin.finish_reason), self.include_usage);
                if self.include_usage {
                    self.queue.push_back(data(&last));
                    self.queue.push_back(data(&self.meta.usage_chunk(&fin)));
                } else {
                    // lily's timings ride the last chunk.
                    if let (Some(o), Ok(t)) =
                        (last.as_object_mut(), serde_json::to_value(&fin.timings))
                    {
                        o.insert("timings".into(), t);
                    }
                    self.queue.push_back(data(&last));
                }
                self.log.set_tokens(log_tokens(&fin));
                self.finish();
            }
            Step::Failed(e) => {
                self.log.set_error(e.message());
                self.queue.push_back(data(&e.body()));
                self.finish();
            }
        }
    }

    fn finish(&mut self) {
        self.queue.push_back(Event::default().data("[DONE]"));
        self.done = true;
    }
}

pub fn sse(meta: Meta, run: Run, include_usage: bool, log: Arc<ReqLog>) -> Response {
    let mut st = State {
        run,
        meta,
        include_usage,
        log,
        queue: VecDeque::new(),
        done: false,
    };
    if st.meta.chat {
        let first = st.meta.chunk(
            json!({"role": "assistant", "content": ""}),
            None,
            include_usage,
        );
        st.queue.push_back(data(&first));
    }
    let body = futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(ev) = st.queue.pop_front() {
                return Some((Ok::<Event, Infallible>(ev), st));
            }
            if st.done {
                return None;
            }
            let step = st.run.next().await;
            st.step(step);
        }
    });
    // Comments while the request waits in the queue also reveal a client that left.
    Sse::new(body)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(10)))
        .into_response()
}
