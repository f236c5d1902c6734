//! Request types of /v1/chat/completions and /v1/completions, and their validation.
//!
//! Bodies are parsed into a JSON object first and then field by field (`fields::Obj`), so that
//! every error names its field (`param`): a bad type, a value out of range, a field lily does
//! not support (with why), or an unknown field. Nested objects use serde with
//! `deny_unknown_fields`.

use engine::sampler::SamplingParams;
use serde::Deserialize;
use serde_json::Value;

use super::error::ApiError;
use super::fields::{Obj, kind_of, parse_body, positive, take_harmless};

/// Sampling and output fields shared by both endpoints, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct GenParams {
    pub model: Option<String>,
    /// None: fill the context up to max_seq.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub cache_key: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct ChatMessage {
    pub role: Role,
    /// Text parts joined; None only for an assistant message without content.
    pub content: Option<String>,
    pub reasoning_content: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    /// None: the default (thinking on).
    pub enable_thinking: Option<bool>,
    pub preserve_thinking: Option<bool>,
    pub params: GenParams,
}

#[derive(Clone, Debug, PartialEq)]
pub struct CompletionRequest {
    pub prompt: String,
    pub params: GenParams,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResponseFormat {
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TemplateKwargs {
    enable_thinking: Option<bool>,
    preserve_thinking: Option<bool>,
}

/// Fields shared by both endpoints. Values that are harmless (n=1, logprobs=false, ...) are
/// accepted; anything lily cannot honour is refused by `finish`.
fn gen_params(o: &mut Obj, chat: bool) -> Result<GenParams, ApiError> {
    let model = o.string("model")?;
    let mut max_tokens = positive(o, "max_tokens")?;
    if chat {
        let mct = positive(o, "max_completion_tokens")?;
        if let (Some(a), Some(b)) = (max_tokens, mct)
            && a != b
        {
            return Err(ApiError::invalid(
                "max_completion_tokens",
                format!(
                    "`max_tokens` ({a}) and `max_completion_tokens` ({b}) disagree; send one of them"
                ),
            ));
        }
        max_tokens = max_tokens.or(mct);
    }
    let stream = o.boolean("stream")?.unwrap_or(false);
    let include_usage = match o.nested::<StreamOptions>("stream_options")? {
        Some(_) if !stream => {
            return Err(ApiError::invalid(
                "stream_options",
                "`stream_options` is only allowed when `stream` is true",
            ));
        }
        Some(so) => so.include_usage.unwrap_or(false),
        None => false,
    };
    let temperature = o.number("temperature", 0.0, 2.0, false)?.unwrap_or(1.0);
    let top_p = o.number("top_p", 0.0, 1.0, true)?.unwrap_or(1.0);
    let top_k = match o.integer("top_k")? {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` must be at least 0 (or -1 for off), got {k}"),
            ));
        }
    };
    let min_p = o.number("min_p", 0.0, 1.0, false)?.unwrap_or(0.0);
    let presence_penalty = o
        .number("presence_penalty", -2.0, 2.0, false)?
        .unwrap_or(0.0);
    let frequency_penalty = o
        .number("frequency_penalty", -2.0, 2.0, false)?
        .unwrap_or(0.0);
    let seed = o.integer("seed")?.map(|s| s as u64);
    let sampling = if temperature == 0.0 {
        // Greedy is the engine's argmax path; penalties (if any) still apply before it.
        SamplingParams {
            presence_penalty,
            frequency_penalty,
            ..SamplingParams::greedy()
        }
    } else {
        SamplingParams {
            temperature,
            top_p,
            top_k,
            min_p,
            presence_penalty,
            frequency_penalty,
            seed,
        }
    };
    let stop = stop_strings(o)?;
    if let Some(n) = o.integer("n")?
        && n != 1
    {
        return Err(ApiError::unsupported(
            "n",
            format!("`n` must be 1 (lily generates one choice per request), got {n}"),
        ));
    }
    let cache_key = o.string("prompt_cache_key")?;
    o.string("user")?;
    if let Some(m) = o.take("metadata")
        && !m.is_object()
    {
        return Err(o.wrong_type("metadata", "an object", &m));
    }
    if let Some(lb) = o.take("logit_bias") {
        match lb.as_object() {
            Some(m) if m.is_empty() => {}
            Some(_) => {
                return Err(ApiError::unsupported(
                    "logit_bias",
                    "`logit_bias` is not supported",
                ));
            }
            None => return Err(o.wrong_type("logit_bias", "an object", &lb)),
        }
    }
    Ok(GenParams {
        model,
        max_tokens,
        sampling,
        stop,
        stream,
        include_usage,
        cache_key,
    })
}

fn stop_strings(o: &mut Obj) -> Result<Vec<String>, ApiError> {
    let list = match o.take("stop") {
        None => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![Value::String(s)],
        Some(Value::Array(a)) => a,
        Some(v) => return Err(o.wrong_type("stop", "a string or an array of strings", &v)),
    };
    if list.len() > 4 {
        return Err(ApiError::invalid(
            "stop",
            format!("`stop` may hold at most 4 strings, got {}", list.len()),
        ));
    }
    list.into_iter()
        .map(|v| match v {
            Value::String(s) if !s.is_empty() => Ok(s),
            Value::String(_) => Err(ApiError::invalid(
                "stop",
                "`stop` strings must not be empty",
            )),
            other => Err(ApiError::invalid(
                "stop",
                format!("`stop` must hold strings, got {}", kind_of(&other)),
            )),
        })
        .collect()
}

/// Fields of the chat API that lily knows but cannot honour, with the reason.
fn chat_unsupported(key: &str) -> Option<&'static str> {
    Some(match key {
        "tools" | "tool_choice" | "functions" | "function_call" => {
            "lily does not do tool calling yet"
        }
        "logprobs" | "top_logprobs" => "lily does not return log probabilities",
        "audio" | "modalities" => "lily generates text only",
        "response_format" => "only {\"type\":\"text\"} is supported (no JSON mode or schemas)",
        "reasoning_effort" => {
            "use `enable_thinking` (or `chat_template_kwargs.enable_thinking`) to turn thinking on or off"
        }
        "prediction" => "predicted outputs are not supported",
        "web_search_options" => "lily has no web search",
        "service_tier" => "lily has one service tier",
        "store" => "lily does not store completions",
        "best_of" | "echo" | "suffix" | "prompt" => "this is a /v1/completions field",
        _ => return None,
    })
}

fn completion_unsupported(key: &str) -> Option<&'static str> {
    Some(match key {
        "echo" => "lily does not echo the prompt",
        "suffix" => "lily does not do fill-in-the-middle",
        "logprobs" => "lily does not return log probabilities",
        "best_of" => "lily generates one candidate per request",
        "messages"
        | "max_completion_tokens"
        | "enable_thinking"
        | "chat_template_kwargs"
        | "tools"
        | "tool_choice" => "this is a /v1/chat/completions field",
        "response_format" | "store" | "reasoning_effort" => "not supported on /v1/completions",
        _ => return None,
    })
}

pub fn parse_chat(body: &[u8]) -> Result<ChatRequest, ApiError> {
    let mut o = parse_body(body)?;
    let messages = match o.take("messages") {
        None => return Err(ApiError::invalid("messages", "`messages` is required")),
        Some(Value::Array(list)) => list,
        Some(v) => return Err(o.wrong_type("messages", "an array of messages", &v)),
    };
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must not be empty",
        ));
    }
    let messages = messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| parse_message(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(last) = messages.last()
        && !matches!(last.role, Role::User | Role::Tool)
    {
        return Err(ApiError::invalid(
            "messages",
            format!(
                "the last message must have role `user` or `tool`, got `{}`",
                last.role.as_str()
            ),
        ));
    }
    let params = gen_params(&mut o, true)?;
    let top = o.boolean("enable_thinking")?;
    let kwargs = o.nested::<TemplateKwargs>("chat_template_kwargs")?;
    let (kw_think, preserve_thinking) =
        kwargs.map_or((None, None), |k| (k.enable_thinking, k.preserve_thinking));
    if let (Some(a), Some(b)) = (top, kw_think)
        && a != b
    {
        return Err(ApiError::invalid(
            "chat_template_kwargs.enable_thinking",
            "`enable_thinking` and `chat_template_kwargs.enable_thinking` disagree",
        ));
    }
    if let Some(rf) = o.nested::<ResponseFormat>("response_format")?
        && rf.kind != "text"
    {
        return Err(ApiError::unsupported(
            "response_format",
            format!(
                "`response_format` type `{}` is not supported: only `text`",
                rf.kind
            ),
        ));
    }
    // Harmless values of unsupported features, as SDKs and agents send them by default.
    take_harmless(&mut o, "logprobs", |v| v == &Value::Bool(false));
    take_harmless(&mut o, "top_logprobs", |v| v.as_u64() == Some(0));
    take_harmless(&mut o, "store", |v| v == &Value::Bool(false));
    take_harmless(&mut o, "parallel_tool_calls", Value::is_boolean);
    take_harmless(&mut o, "tools", |v| v.as_array().is_some_and(Vec::is_empty));
    take_harmless(&mut o, "tool_choice", |v| v == "none" || v == "auto");
    take_harmless(&mut o, "modalities", |v| {
        v.as_array().is_some_and(|a| a.iter().all(|m| m == "text"))
    });
    o.finish(&chat_unsupported)?;
    Ok(ChatRequest {
        messages,
        enable_thinking: top.or(kw_think),
        preserve_thinking,
        params,
    })
}

pub fn parse_completion(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    let mut o = parse_body(body)?;
    let prompt = match o.take("prompt") {
        None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(Value::String(s)) => s,
        Some(Value::Array(list)) => match list.as_slice() {
            [Value::String(s)] => s.clone(),
            [] => return Err(ApiError::invalid("prompt", "`prompt` must not be empty")),
            l if l.iter().any(|v| v.is_number() || v.is_array()) => {
                return Err(ApiError::unsupported(
                    "prompt",
                    "token-id prompts are not supported; send the prompt as a string",
                ));
            }
            [_] => {
                return Err(ApiError::invalid(
                    "prompt",
                    "`prompt` must be a string or a list of one string",
                ));
            }
            l => {
                return Err(ApiError::unsupported(
                    "prompt",
                    format!(
                        "`prompt` must be one string (batches are not supported), got {} items",
                        l.len()
                    ),
                ));
            }
        },
        Some(v) => return Err(o.wrong_type("prompt", "a string", &v)),
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` must not be empty"));
    }
    let params = gen_params(&mut o, false)?;
    take_harmless(&mut o, "echo", |v| v == &Value::Bool(false));
    take_harmless(&mut o, "suffix", |v| v == "");
    take_harmless(&mut o, "logprobs", |v| {
        v.as_u64() == Some(0) || v == &Value::Bool(false)
    });
    take_harmless(&mut o, "best_of", |v| v.as_u64() == Some(1));
    o.finish(&completion_unsupported)?;
    Ok(CompletionRequest { prompt, params })
}

fn parse_message(i: usize, v: Value) -> Result<ChatMessage, ApiError> {
    let at = format!("messages[{i}].");
    let mut o = Obj::new(v, &at, "message")?;
    let role_param = o.param("role");
    let role = match o.string("role")?.as_deref() {
        Some("system") | Some("developer") => Role::System,
        Some("user") => Role::User,
        Some("assistant") => Role::Assistant,
        Some("tool") => Role::Tool,
        Some(other) => {
            return Err(ApiError::invalid(
                &role_param,
                format!(
                    "`{role_param}` must be one of system, developer, user, assistant, tool; got `{other}`"
                ),
            ));
        }
        None => {
            return Err(ApiError::invalid(
                &role_param,
                format!("`{role_param}` is required"),
            ));
        }
    };
    let content = match o.take("content") {
        None => None,
        Some(Value::String(s)) => Some(s),
        Some(Value::Array(parts)) => Some(text_parts(&at, parts)?),
        Some(v) => {
            return Err(o.wrong_type("content", "a string or an array of content parts", &v));
        }
    };
    if content.is_none() && role != Role::Assistant {
        let p = o.param("content");
        return Err(ApiError::invalid(
            &p,
            format!("`{p}` is required for role `{}`", role.as_str()),
        ));
    }
    let reasoning_content = o.string("reasoning_content")?;
    if reasoning_content.is_some() && role != Role::Assistant {
        let p = o.param("reasoning_content");
        return Err(ApiError::invalid(
            &p,
            format!("`{p}` is only allowed on assistant messages"),
        ));
    }
    o.string("name")?;
    if role == Role::Tool {
        o.string("tool_call_id")?;
    }
    // An assistant message echoed back from a response object carries these as null/empty.
    for key in ["tool_calls", "annotations"] {
        take_harmless(&mut o, key, |v| v.as_array().is_some_and(Vec::is_empty));
    }
    for key in ["refusal", "audio", "function_call"] {
        take_harmless(&mut o, key, |_| false);
    }
    o.finish(&|key| match key {
        "tool_calls" | "function_call" => Some("lily does not do tool calling yet"),
        "audio" => Some("lily handles text only"),
        _ => None,
    })?;
    Ok(ChatMessage {
        role,
        content,
        reasoning_content,
    })
}

/// Joins `[{"type":"text","text":...}]` parts as the template does (no separator).
fn text_parts(at: &str, parts: Vec<Value>) -> Result<String, ApiError> {
    let mut out = String::new();
    for (j, part) in parts.into_iter().enumerate() {
        let mut p = Obj::new(part, &format!("{at}content[{j}]."), "content part")?;
        let type_param = p.param("type");
        match p.string("type")?.as_deref() {
            Some("text") => {}
            Some(other) => {
                return Err(ApiError::unsupported(
                    &type_param,
                    format!(
                        "content part type `{other}` is not supported: lily accepts text parts only"
                    ),
                ));
            }
            None => {
                return Err(ApiError::invalid(
                    &type_param,
                    format!("`{type_param}` is required"),
                ));
            }
        }
        match p.string("text")? {
            Some(t) => out.push_str(&t),
            None => {
                let tp = p.param("text");
                return Err(ApiError::invalid(
                    &tp,
                    format!("`{tp}` is required for a text part"),
                ));
            }
        }
        p.finish(&|_| None)?;
    }
    Ok(out)
}

#[cfg(test)]
#[path = "types_tests.rs"]
mod tests;
