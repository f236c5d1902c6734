//! Endpoint handlers. Generation handlers validate fully before touching the engine: bad
//! input is a 4xx, never a 5xx.

use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::{Extension, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{Value, json};

use super::error::ApiError;
use super::prompt::{DEFAULT_THINKING, render_chat};
use super::response::Meta;
use super::run::{Run, Step, log_tokens};
use super::text::{Assembler, Part};
use super::types::{GenParams, parse_chat, parse_completion};
use super::{AppState, BODY_LIMIT, ReqLog, stream};
use crate::scheduler::{EngineStatus, GenRequest, ModelInfo, SubmitError};

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Reads the body up to `BODY_LIMIT` (the limit is checked while reading, so a body without
/// Content-Length cannot exceed it either).
async fn read_body(headers: &HeaderMap, body: Body) -> Result<Vec<u8>, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > BODY_LIMIT) {
        return Err(ApiError::TooLarge { limit: BODY_LIMIT });
    }
    let mut data = body.into_data_stream();
    let mut buf = Vec::with_capacity(declared.unwrap_or(0));
    while let Some(chunk) = data.next().await {
        let chunk = chunk
            .map_err(|e| ApiError::bad_request(format!("cannot read the request body: {e}")))?;
        if buf.len() + chunk.len() > BODY_LIMIT {
            return Err(ApiError::TooLarge { limit: BODY_LIMIT });
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf)
}

fn check_model(st: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if *m != st.model_id => Err(ApiError::ModelNotFound {
            model: m.clone(),
            served: st.model_id.clone(),
        }),
        _ => Ok(()),
    }
}

fn ready_model(st: &AppState) -> Result<Arc<ModelInfo>, ApiError> {
    if st.is_shutting_down() {
        return Err(ApiError::ShuttingDown);
    }
    if let Some(info) = st.scheduler.model_info() {
        return Ok(info);
    }
    match st.scheduler.status() {
        EngineStatus::Failed(e) => Err(ApiError::LoadFailed(e)),
        _ => Err(ApiError::Loading),
    }
}

/// max_tokens, checked against the context: prompt + max_tokens + 1 must fit in max_seq.
/// Without max_tokens the completion may fill the context.
fn token_budget(
    prompt: usize,
    requested: Option<usize>,
    max_seq: usize,
    prompt_param: &str,
) -> Result<usize, ApiError> {
    match requested {
        Some(m) => {
            let need = prompt.saturating_add(m).saturating_add(1);
            if need > max_seq {
                return Err(ApiError::invalid(
                    "max_tokens",
                    format!(
                        "this request needs {need} tokens (prompt {prompt} + max_tokens {m} + 1) but the server's max_seq is {max_seq}"
                    ),
                ));
            }
            Ok(m)
        }
        None if prompt + 2 > max_seq => Err(ApiError::invalid(
            prompt_param,
            format!(
                "the prompt has {prompt} tokens, which leaves no room for a completion within the server's max_seq of {max_seq}"
            ),
        )),
        None => Ok(max_seq - prompt - 1),
    }
}

/// Tokenizes off the async runtime: long prompts take milliseconds.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Engine(format!("prompt preparation failed: {e}")))?
}

fn submit(
    st: &AppState,
    prompt: Vec<u32>,
    max_tokens: usize,
    params: &GenParams,
) -> Result<crate::scheduler::GenStream, ApiError> {
    let req = GenRequest {
        prompt,
        max_tokens,
        sampling: params.sampling.clone(),
        cache_key: params.cache_key.clone(),
    };
    st.scheduler.submit(req).map_err(|e| match e {
        SubmitError::QueueFull { capacity } => ApiError::QueueFull { capacity },
        SubmitError::NotReady => ApiError::Loading,
        SubmitError::ShuttingDown => ApiError::ShuttingDown,
    })
}

pub async fn chat(
    State(st): State<AppState>,
    Extension(log): Extension<Arc<ReqLog>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    chat_inner(st, log, headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat_inner(
    st: AppState,
    log: Arc<ReqLog>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let bytes = read_body(&headers, body).await?;
    let req = parse_chat(&bytes)?;
    check_model(&st, &req.params.model)?;
    let info = ready_model(&st)?;
    let thinking = req.enable_thinking.unwrap_or(DEFAULT_THINKING);
    let (messages, preserve, inf) = (req.messages, req.preserve_thinking, info.clone());
    let (prompt, starts_in_reasoning) = blocking(move || {
        let p = render_chat(&inf.template, &messages, thinking, preserve)?;
        let tokens = inf.tokenizer.encode(&p.text).map_err(|e| {
            ApiError::invalid("messages", format!("cannot tokenize the prompt: {e}"))
        })?;
        Ok((tokens, p.starts_in_reasoning))
    })
    .await?;
    let max_tokens = token_budget(
        prompt.len(),
        req.params.max_tokens,
        info.max_seq,
        "messages",
    )?;
    let prompt_len = prompt.len();
    let events = submit(&st, prompt, max_tokens, &req.params)?;
    let asm = Assembler::new(
        &info.tokenizer,
        req.params.stop.clone(),
        Some(starts_in_reasoning),
    );
    let meta = Meta {
        id: st.new_id("chatcmpl-"),
        created: unix_now(),
        model: info.id.clone(),
        chat: true,
    };
    generate(
        Run::new(events, asm, log.clone(), prompt_len),
        meta,
        &req.params,
        thinking,
        log,
    )
    .await
}

pub async fn completions(
    State(st): State<AppState>,
    Extension(log): Extension<Arc<ReqLog>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    completions_inner(st, log, headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completions_inner(
    st: AppState,
    log: Arc<ReqLog>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let bytes = read_body(&headers, body).await?;
    let req = parse_completion(&bytes)?;
    check_model(&st, &req.params.model)?;
    let info = ready_model(&st)?;
    let (text, inf) = (req.prompt, info.clone());
    // Raw text, no template; special-token strings in it become their ids.
    let prompt = blocking(move || {
        inf.tokenizer
            .encode(&text)
            .map_err(|e| ApiError::invalid("prompt", format!("cannot tokenize the prompt: {e}")))
    })
    .await?;
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            "prompt",
            "the prompt encodes to no tokens",
        ));
    }
    let max_tokens = token_budget(prompt.len(), req.params.max_tokens, info.max_seq, "prompt")?;
    let prompt_len = prompt.len();
    let events = submit(&st, prompt, max_tokens, &req.params)?;
    let asm = Assembler::new(&info.tokenizer, req.params.stop.clone(), None);
    let meta = Meta {
        id: st.new_id("cmpl-"),
        created: unix_now(),
        model: info.id.clone(),
        chat: false,
    };
    generate(
        Run::new(events, asm, log.clone(), prompt_len),
        meta,
        &req.params,
        false,
        log,
    )
    .await
}

/// Streams, or runs to the end and answers with one object. Either way the `Run` (and its
/// `GenStream`) lives exactly as long as the client is there to receive.
async fn generate(
    mut run: Run,
    meta: Meta,
    params: &GenParams,
    thinking: bool,
    log: Arc<ReqLog>,
) -> Result<Response, ApiError> {
    if params.stream {
        return Ok(stream::sse(meta, run, params.include_usage, log));
    }
    let (mut reasoning, mut content) = (String::new(), String::new());
    loop {
        let (parts, fin) = match run.next().await {
            Step::Idle => continue,
            Step::Parts(parts) => (parts, None),
            Step::Done(parts, fin) => (parts, Some(fin)),
            Step::Failed(e) => return Err(e),
        };
        for p in parts {
            match p {
                Part::Reasoning(t) => reasoning.push_str(&t),
                Part::Content(t) => content.push_str(&t),
            }
        }
        if let Some(fin) = fin {
            log.set_tokens(log_tokens(&fin));
            let body = meta.completion(thinking.then_some(reasoning.as_str()), &content, &fin);
            return Ok(Json(body).into_response());
        }
    }
}

fn model_object(st: &AppState) -> Value {
    json!({"id": st.model_id, "object": "model", "created": st.created, "owned_by": "lily"})
}

pub async fn models(State(st): State<AppState>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&st)]}))
}

pub async fn model(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if id != st.model_id {
        return Err(ApiError::ModelNotFound {
            model: id,
            served: st.model_id.clone(),
        });
    }
    Ok(Json(model_object(&st)))
}

pub async fn health(State(st): State<AppState>) -> (StatusCode, Json<Value>) {
    if st.is_shutting_down() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "shutting_down"})),
        );
    }
    match st.scheduler.status() {
        EngineStatus::Ready => (StatusCode::OK, Json(json!({"status": "ok"}))),
        EngineStatus::Loading => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "loading"})),
        ),
        EngineStatus::Failed(message) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "error", "message": message})),
        ),
    }
}

pub async fn metrics(State(st): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        st.scheduler.metrics().render(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_budget_names_both_numbers() {
        assert_eq!(token_budget(10, Some(5), 16, "messages"), Ok(5));
        let e = token_budget(10, Some(6), 16, "messages").expect_err("too long");
        assert!(
            e.message().contains("prompt 10 + max_tokens 6 + 1")
                && e.message().contains("max_seq is 16"),
            "{}",
            e.message()
        );
        assert_eq!(token_budget(10, None, 16, "messages"), Ok(5));
        let e = token_budget(15, None, 16, "prompt").expect_err("no room");
        assert_eq!(e.body()["error"]["param"], "prompt");
    }
}
