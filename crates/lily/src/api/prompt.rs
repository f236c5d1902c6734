//! Chat prompts: messages → template → tokens, rendered so that each turn of a conversation
//! token-extends the previous prompt plus the model's answer (what the session prefix cache
//! needs to resume instead of re-running the whole history).
//!
//! - Thinking off: history assistant turns are closed with an empty think block
//!   (`engine::chat::close_history_thinking`), exactly as the model produced them after a
//!   thinking-off generation prompt.
//! - Thinking on: the template's `preserve_thinking` is set, so history turns render as
//!   `<think>\n{reasoning_content}\n</think>\n\n{content}`, which is exactly what the model
//!   generated after the `<think>\n` generation prompt, provided the client sends the
//!   `reasoning_content` of its earlier answers back. Turns without it render with an empty
//!   think block (the same bytes as the thinking-off rewrite).

use engine::chat::{ChatError, ChatTemplate, close_history_thinking};
use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::types::ChatMessage;

/// Thinking is on unless the request turns it off, as the Qwen template does.
pub const DEFAULT_THINKING: bool = true;

pub struct ChatPrompt {
    pub text: String,
    /// The generation prompt ends inside an open think block.
    pub starts_in_reasoning: bool,
}

/// Renders the chat prompt. `preserve` defaults to `thinking`.
pub fn render_chat(
    template: &ChatTemplate,
    messages: &[ChatMessage],
    thinking: bool,
    preserve: Option<bool>,
) -> Result<ChatPrompt, ApiError> {
    let preserve = preserve.unwrap_or(thinking);
    let mut list = Value::Array(
        messages
            .iter()
            .map(|m| {
                let mut o = json!({"role": m.role.as_str(), "content": m.content.clone().unwrap_or_default()});
                if let (Some(r), Some(obj)) = (&m.reasoning_content, o.as_object_mut()) {
                    obj.insert("reasoning_content".into(), r.clone().into());
                }
                o
            })
            .collect(),
    );
    if !preserve {
        // With preserve_thinking the template itself writes the (possibly empty) think block;
        // closing here as well would write it twice.
        close_history_thinking(&mut list);
    }
    let mut kwargs = Map::new();
    kwargs.insert("enable_thinking".into(), thinking.into());
    kwargs.insert("preserve_thinking".into(), preserve.into());
    let text = template
        .render(&list, None, true, &kwargs)
        .map_err(|e| match e {
            // The template's own checks (system message placement, no user query, ...).
            ChatError::Raised { message } => ApiError::invalid(
                "messages",
                format!("the chat template rejected the messages: {message}"),
            ),
            other => ApiError::invalid(
                "messages",
                format!("cannot render the chat template: {other}"),
            ),
        })?;
    if text.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "the chat template produced an empty prompt",
        ));
    }
    let starts_in_reasoning = text.ends_with("<think>\n");
    Ok(ChatPrompt {
        text,
        starts_in_reasoning,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::text::{Assembler, Part};
    use crate::api::types::Role;
    use engine::tokenizer::Tokenizer;

    fn fixture() -> (Tokenizer, ChatTemplate) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tiny-qwen3_5_moe");
        (
            Tokenizer::from_dir(&dir).expect("tokenizer"),
            ChatTemplate::from_dir(&dir).expect("template"),
        )
    }

    fn msg(role: Role, content: &str) -> ChatMessage {
        ChatMessage {
            role,
            content: Some(content.into()),
            reasoning_content: None,
        }
    }

    /// What a client appends after a response: the message the server returned.
    fn answer_message(
        tok: &Tokenizer,
        generated: &[u32],
        starts_in_reasoning: bool,
    ) -> ChatMessage {
        let mut a = Assembler::new(tok, Vec::new(), Some(starts_in_reasoning));
        let mut parts = Vec::new();
        for &id in generated {
            parts.extend(a.push_token(id).expect("push"));
        }
        parts.extend(a.finish().expect("finish"));
        let (mut r, mut c) = (String::new(), String::new());
        for p in parts {
            match p {
                Part::Reasoning(t) => r.push_str(&t),
                Part::Content(t) => c.push_str(&t),
            }
        }
        ChatMessage {
            role: Role::Assistant,
            content: Some(c),
            reasoning_content: starts_in_reasoning.then_some(r),
        }
    }

    /// Turn 2's prompt must start with turn 1's prompt + the answer's tokens (the stop token
    /// excepted: the engine never feeds it, so the cached state ends before it).
    fn check_extension(thinking: bool, generated_text: &str) {
        let (tok, tmpl) = fixture();
        let mut conv = vec![
            msg(Role::System, "You are terse."),
            msg(Role::User, "What is 2+2? Answer in one word."),
        ];
        let p1 = render_chat(&tmpl, &conv, thinking, None).expect("render 1");
        assert_eq!(p1.starts_in_reasoning, thinking);
        let t1 = tok.encode(&p1.text).expect("encode 1");
        let im_end = tok.token_to_id("<|im_end|>").expect("im_end");
        let mut generated = tok.encode(generated_text).expect("encode answer");
        generated.push(im_end);
        conv.push(answer_message(&tok, &generated, p1.starts_in_reasoning));
        conv.push(msg(Role::User, "And 3+3?"));
        let p2 = render_chat(&tmpl, &conv, thinking, None).expect("render 2");
        let t2 = tok.encode(&p2.text).expect("encode 2");
        let cached: Vec<u32> = t1
            .iter()
            .chain(&generated[..generated.len() - 1])
            .copied()
            .collect();
        assert!(
            t2.len() > cached.len() && t2.starts_with(&cached),
            "thinking={thinking}: turn 2 does not extend turn 1 + answer\n{}\n---\n{}",
            p1.text,
            p2.text
        );
        // A third turn extends the second the same way.
        let gen2 = tok
            .encode(if thinking {
                "Six again.\n</think>\n\nSix."
            } else {
                "Six."
            })
            .expect("encode");
        let mut gen2 = gen2;
        gen2.push(im_end);
        conv.push(answer_message(&tok, &gen2, p2.starts_in_reasoning));
        conv.push(msg(Role::User, "Thanks"));
        let t3 = tok
            .encode(
                &render_chat(&tmpl, &conv, thinking, None)
                    .expect("render 3")
                    .text,
            )
            .expect("encode 3");
        let cached2: Vec<u32> = t2.iter().chain(&gen2[..gen2.len() - 1]).copied().collect();
        assert!(
            t3.starts_with(&cached2),
            "thinking={thinking}: turn 3 does not extend turn 2 + answer"
        );
    }

    #[test]
    fn thinking_off_turns_extend_the_previous_prompt_and_answer() {
        check_extension(false, "Four.");
        check_extension(false, "Four.\n\nWith a paragraph, and 日本語.");
    }

    #[test]
    fn thinking_on_turns_extend_when_reasoning_is_sent_back() {
        check_extension(true, "The user asks 2+2.\nThat is 4.\n</think>\n\nFour.");
        check_extension(true, "Short.\n</think>\n\nFour, and 日本語.");
    }

    #[test]
    fn thinking_on_history_without_reasoning_renders_an_empty_think_block() {
        let (_, tmpl) = fixture();
        let conv = vec![
            msg(Role::User, "hi"),
            msg(Role::Assistant, "hello"),
            msg(Role::User, "bye"),
        ];
        let on = render_chat(&tmpl, &conv, true, None).expect("render").text;
        assert!(
            on.contains("<|im_start|>assistant\n<think>\n\n</think>\n\nhello<|im_end|>"),
            "{on}"
        );
        assert!(on.ends_with("<|im_start|>assistant\n<think>\n"));
        let off = render_chat(&tmpl, &conv, false, None).expect("render").text;
        assert!(
            off.contains("<|im_start|>assistant\n<think>\n\n</think>\n\nhello<|im_end|>"),
            "{off}"
        );
        assert!(off.ends_with("<think>\n\n</think>\n\n"));
        // preserve_thinking=false with thinking on: lily's history rewrite, no double block.
        let closed = render_chat(&tmpl, &conv, true, Some(false))
            .expect("render")
            .text;
        assert_eq!(closed.matches("<think>").count(), 2, "{closed}");
    }

    #[test]
    fn template_errors_become_400_naming_messages() {
        let (_, tmpl) = fixture();
        let conv = vec![msg(Role::User, "hi"), msg(Role::System, "late system")];
        let e = render_chat(&tmpl, &conv, true, None)
            .err()
            .expect("must fail");
        assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST);
        assert!(
            e.message()
                .contains("System message must be at the beginning"),
            "{}",
            e.message()
        );
    }
}
