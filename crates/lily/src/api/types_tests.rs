//! Validation tests: every malformed or unsupported request is a 4xx naming its field.

use super::*;
use axum::http::StatusCode;
use serde_json::json;

fn chat(body: Value) -> Result<ChatRequest, ApiError> {
    parse_chat(body.to_string().as_bytes())
}

fn base() -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
}

fn with(key: &str, v: Value) -> Value {
    let mut b = base();
    if let Some(o) = b.as_object_mut() {
        o.insert(key.into(), v);
    }
    b
}

/// Asserts a 400 whose param is `param` and whose message contains `needle`.
fn rejects(r: Result<impl std::fmt::Debug, ApiError>, param: &str, needle: &str) {
    let e = r
        .err()
        .unwrap_or_else(|| panic!("expected an error for `{param}`"));
    assert_eq!(e.status(), StatusCode::BAD_REQUEST, "{e:?}");
    let body = e.body();
    assert_eq!(body["error"]["param"], json!(param), "{body}");
    let msg = e.message();
    assert!(msg.contains(needle), "message {msg:?} lacks {needle:?}");
}

#[test]
fn a_plain_request_gets_the_documented_defaults() {
    let r = chat(base()).expect("valid");
    assert_eq!(r.params.model.as_deref(), Some("m"));
    assert_eq!(r.params.max_tokens, None);
    assert_eq!(r.params.sampling, SamplingParams::default());
    assert_eq!(r.params.sampling.temperature, 1.0);
    assert!(!r.params.stream && !r.params.include_usage && r.params.stop.is_empty());
    assert_eq!(r.enable_thinking, None);
}

#[test]
fn sampling_fields_map_onto_sampling_params() {
    let r = chat(json!({"messages": [{"role": "user", "content": "x"}], "temperature": 0.7, "top_p": 0.9, "top_k": 20,
        "min_p": 0.05, "seed": 7, "presence_penalty": 0.5, "frequency_penalty": -0.5, "stop": "END", "max_completion_tokens": 9,
        "stream": true, "stream_options": {"include_usage": true}, "prompt_cache_key": "k", "n": 1, "user": "u",
        "metadata": {"a": "b"}, "store": false, "logprobs": false, "parallel_tool_calls": true, "tools": [], "tool_choice": "none",
        "response_format": {"type": "text"}, "enable_thinking": false, "chat_template_kwargs": {"enable_thinking": false}}))
    .expect("valid");
    let s = &r.params.sampling;
    assert_eq!(
        (s.temperature, s.top_p, s.top_k, s.min_p, s.seed),
        (0.7, 0.9, 20, 0.05, Some(7))
    );
    assert_eq!((s.presence_penalty, s.frequency_penalty), (0.5, -0.5));
    assert_eq!(r.params.stop, vec!["END".to_string()]);
    assert_eq!(r.params.max_tokens, Some(9));
    assert!(r.params.stream && r.params.include_usage);
    assert_eq!(r.params.cache_key.as_deref(), Some("k"));
    assert_eq!(r.enable_thinking, Some(false));
    // temperature 0 is exactly the engine's greedy path; top_k -1 means off.
    let g = chat(with("temperature", json!(0))).expect("valid");
    assert_eq!(g.params.sampling, SamplingParams::greedy());
    assert_eq!(
        chat(with("top_k", json!(-1)))
            .expect("valid")
            .params
            .sampling
            .top_k,
        0
    );
}

#[test]
fn messages_accept_text_parts_developer_names_and_reasoning() {
    let r = chat(json!({"messages": [
        {"role": "developer", "content": "be brief", "name": "ops"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c", "reasoning_content": "r", "refusal": null, "tool_calls": null, "annotations": []},
        {"role": "user", "content": "d"},
        {"role": "assistant", "content": null},
        {"role": "tool", "content": "out", "tool_call_id": "t1"}]}))
    .expect("valid");
    assert_eq!(r.messages[0].role, Role::System);
    assert_eq!(r.messages[1].content.as_deref(), Some("ab"));
    assert_eq!(r.messages[2].reasoning_content.as_deref(), Some("r"));
    assert_eq!(r.messages[4].content, None);
}

#[test]
fn malformed_bodies_are_400s_naming_the_problem() {
    let e = parse_chat(b"{\"messages\": [").expect_err("invalid JSON");
    assert!(
        e.message().contains("invalid JSON") && e.message().contains("line 1"),
        "{}",
        e.message()
    );
    assert!(
        parse_chat(b"")
            .expect_err("empty")
            .message()
            .contains("empty")
    );
    assert!(
        parse_chat(b"[1,2]")
            .expect_err("array")
            .message()
            .contains("JSON object")
    );
}

#[test]
fn each_bad_field_is_named() {
    rejects(chat(json!({"model": "m"})), "messages", "required");
    rejects(
        chat(with("messages", json!([]))),
        "messages",
        "must not be empty",
    );
    rejects(
        chat(with("messages", json!("hi"))),
        "messages",
        "must be an array",
    );
    rejects(
        chat(with("messages", json!([{"role": "robot", "content": "x"}]))),
        "messages[0].role",
        "robot",
    );
    rejects(
        chat(with("messages", json!([{"content": "x"}]))),
        "messages[0].role",
        "required",
    );
    rejects(
        chat(with("messages", json!([{"role": "user", "content": 5}]))),
        "messages[0].content",
        "must be a string",
    );
    rejects(
        chat(with("messages", json!([{"role": "user"}]))),
        "messages[0].content",
        "required",
    );
    rejects(
        chat(with(
            "messages",
            json!([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]),
        )),
        "messages",
        "last message",
    );
    rejects(
        chat(with(
            "messages",
            json!([{"role": "user", "content": "x", "colour": "red"}]),
        )),
        "messages[0].colour",
        "unknown field",
    );
    rejects(
        chat(with(
            "messages",
            json!([{"role": "user", "content": "x", "reasoning_content": "r"}]),
        )),
        "messages[0].reasoning_content",
        "assistant",
    );
    rejects(
        chat(with("messages", json!(["hi"]))),
        "messages[0]",
        "JSON object",
    );
    rejects(
        chat(with(
            "messages",
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}]),
        )),
        "messages[0].content[0].type",
        "image_url",
    );
    rejects(
        chat(with(
            "messages",
            json!([{"role": "user", "content": [{"type": "input_audio"}]}]),
        )),
        "messages[0].content[0].type",
        "input_audio",
    );
    rejects(
        chat(with(
            "messages",
            json!([{"role": "user", "content": [{"type": "text"}]}]),
        )),
        "messages[0].content[0].text",
        "required",
    );
    rejects(
        chat(with(
            "messages",
            json!([{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}, {"role": "user", "content": "y"}]),
        )),
        "messages[0].tool_calls",
        "tool calling",
    );
    rejects(
        chat(with("temperature", json!(2.5))),
        "temperature",
        "between 0 and 2",
    );
    rejects(
        chat(with("temperature", json!("hot"))),
        "temperature",
        "must be a number",
    );
    rejects(chat(with("top_p", json!(0))), "top_p", "greater than 0");
    rejects(chat(with("top_p", json!(1.5))), "top_p", "at most 1");
    rejects(chat(with("top_k", json!(-2))), "top_k", "at least 0");
    rejects(chat(with("top_k", json!(2.5))), "top_k", "integer");
    rejects(chat(with("min_p", json!(1.1))), "min_p", "between 0 and 1");
    rejects(
        chat(with("presence_penalty", json!(3))),
        "presence_penalty",
        "between -2 and 2",
    );
    rejects(
        chat(with("frequency_penalty", json!(-2.1))),
        "frequency_penalty",
        "between -2 and 2",
    );
    rejects(chat(with("seed", json!("abc"))), "seed", "integer");
    rejects(
        chat(with("max_tokens", json!(0))),
        "max_tokens",
        "at least 1",
    );
    rejects(
        chat(with("max_tokens", json!(-5))),
        "max_tokens",
        "at least 1",
    );
    let both = json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 6});
    rejects(chat(both), "max_completion_tokens", "disagree");
    rejects(
        chat(with("stop", json!(["a", "b", "c", "d", "e"]))),
        "stop",
        "at most 4",
    );
    rejects(chat(with("stop", json!(""))), "stop", "must not be empty");
    rejects(chat(with("stop", json!([1]))), "stop", "strings");
    rejects(chat(with("stop", json!(7))), "stop", "string or an array");
    rejects(chat(with("n", json!(2))), "n", "must be 1");
    rejects(chat(with("stream", json!("yes"))), "stream", "boolean");
    rejects(
        chat(with("stream_options", json!({"include_usage": true}))),
        "stream_options",
        "only allowed when `stream` is true",
    );
    let so = json!({"messages": [{"role": "user", "content": "x"}], "stream": true, "stream_options": {"include_usage": true, "x": 1}});
    rejects(chat(so), "stream_options", "unknown field `x`");
    rejects(
        chat(with("response_format", json!({"type": "json_object"}))),
        "response_format",
        "json_object",
    );
    rejects(
        chat(with(
            "chat_template_kwargs",
            json!({"reasoning_effort": "low"}),
        )),
        "chat_template_kwargs",
        "reasoning_effort",
    );
    let dis = json!({"messages": [{"role": "user", "content": "x"}], "enable_thinking": true, "chat_template_kwargs": {"enable_thinking": false}});
    rejects(
        chat(dis),
        "chat_template_kwargs.enable_thinking",
        "disagree",
    );
    rejects(
        chat(with("enable_thinking", json!("no"))),
        "enable_thinking",
        "boolean",
    );
    rejects(chat(with("model", json!(3))), "model", "string");
    rejects(chat(with("metadata", json!("x"))), "metadata", "object");
    rejects(
        chat(with("prompt_cache_key", json!(1))),
        "prompt_cache_key",
        "string",
    );
    rejects(
        chat(with("frobnicate", json!(1))),
        "frobnicate",
        "unknown field",
    );
}

#[test]
fn unsupported_features_are_400s_saying_why() {
    let tool = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    rejects(chat(with("tools", tool)), "tools", "tool calling");
    rejects(
        chat(with("tool_choice", json!("required"))),
        "tool_choice",
        "tool calling",
    );
    rejects(
        chat(with("functions", json!([{"name": "f"}]))),
        "functions",
        "tool calling",
    );
    rejects(
        chat(with("logit_bias", json!({"1": 5}))),
        "logit_bias",
        "not supported",
    );
    rejects(
        chat(with("logprobs", json!(true))),
        "logprobs",
        "log probabilities",
    );
    rejects(
        chat(with("top_logprobs", json!(3))),
        "top_logprobs",
        "log probabilities",
    );
    rejects(
        chat(with("audio", json!({"voice": "x"}))),
        "audio",
        "text only",
    );
    rejects(
        chat(with("modalities", json!(["text", "audio"]))),
        "modalities",
        "text only",
    );
    rejects(chat(with("store", json!(true))), "store", "not supported");
    rejects(
        chat(with("reasoning_effort", json!("low"))),
        "reasoning_effort",
        "enable_thinking",
    );
    rejects(
        chat(with("prompt", json!("x"))),
        "prompt",
        "/v1/completions",
    );
}

fn completion(body: Value) -> Result<CompletionRequest, ApiError> {
    parse_completion(body.to_string().as_bytes())
}

#[test]
fn completion_requests_validate_their_own_fields() {
    let r = completion(json!({"model": "m", "prompt": ["Once upon"], "max_tokens": 4, "echo": false, "temperature": 0})).expect("valid");
    assert_eq!(r.prompt, "Once upon");
    assert_eq!(r.params.max_tokens, Some(4));
    assert_eq!(r.params.sampling, SamplingParams::greedy());
    rejects(completion(json!({"model": "m"})), "prompt", "required");
    rejects(
        completion(json!({"prompt": ""})),
        "prompt",
        "must not be empty",
    );
    rejects(
        completion(json!({"prompt": ["a", "b"]})),
        "prompt",
        "batches",
    );
    rejects(
        completion(json!({"prompt": [1, 2, 3]})),
        "prompt",
        "token-id",
    );
    rejects(completion(json!({"prompt": 5})), "prompt", "string");
    rejects(
        completion(json!({"prompt": "x", "echo": true})),
        "echo",
        "echo",
    );
    rejects(
        completion(json!({"prompt": "x", "suffix": "end"})),
        "suffix",
        "fill-in-the-middle",
    );
    rejects(
        completion(json!({"prompt": "x", "logprobs": 5})),
        "logprobs",
        "log probabilities",
    );
    rejects(
        completion(json!({"prompt": "x", "best_of": 3})),
        "best_of",
        "one candidate",
    );
    rejects(
        completion(json!({"prompt": "x", "messages": []})),
        "messages",
        "/v1/chat/completions",
    );
    rejects(
        completion(json!({"prompt": "x", "max_completion_tokens": 5})),
        "max_completion_tokens",
        "/v1/chat/completions",
    );
    rejects(
        completion(json!({"prompt": "x", "top_p": -1})),
        "top_p",
        "greater than 0",
    );
}
