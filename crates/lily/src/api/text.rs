//! Turning generated tokens into response text: the stream decoder (never splits a UTF-8
//! character), stop strings (cut before the match, holding back a possible partial match),
//! and the split of thinking output into `reasoning_content` and `content` at `</think>`
//! (holding back a partial tag and newlines that may turn out to surround it).

use engine::tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

pub const THINK_CLOSE: &str = "</think>";

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    Reasoning(String),
    Content(String),
}

/// Finds stop strings in a text stream fed piece by piece.
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    /// Adds text; returns the text that is now safe to emit and whether a stop string matched
    /// (then the returned text ends right before it and the matcher should not be fed again).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stops.is_empty() {
            return (text.to_owned(), false);
        }
        self.held.push_str(text);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let out = self.held[..at].to_owned();
            self.held.clear();
            return (out, true);
        }
        // Hold the longest suffix that could still grow into a stop string.
        let keep_from = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&self.held[i..])))
            .unwrap_or(self.held.len());
        let out = self.held[..keep_from].to_owned();
        self.held.drain(..keep_from);
        (out, false)
    }

    /// The held text at the end of generation (it matched nothing).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Splits thinking output at `</think>`: reasoning before it (surrounding newlines stripped),
/// content after it (leading newlines stripped).
pub struct ThinkSplitter {
    in_reasoning: bool,
    /// Text not yet emitted: a possible partial tag or newlines whose role is undecided.
    held: String,
    /// Whether any reasoning / content text was emitted (leading newlines are dropped).
    reasoning_started: bool,
    content_started: bool,
}

impl ThinkSplitter {
    /// `in_reasoning`: the prompt ended inside an open think block.
    pub fn new(in_reasoning: bool) -> ThinkSplitter {
        ThinkSplitter {
            in_reasoning,
            held: String::new(),
            reasoning_started: false,
            content_started: false,
        }
    }

    #[cfg(test)]
    pub fn in_reasoning(&self) -> bool {
        self.in_reasoning
    }

    pub fn push(&mut self, text: &str) -> Vec<Part> {
        let mut out = Vec::new();
        self.held.push_str(text);
        if self.in_reasoning {
            if let Some(at) = self.held.find(THINK_CLOSE) {
                let reasoning = self.held[..at].trim_end_matches('\n').to_owned();
                self.emit_reasoning(&reasoning, &mut out);
                self.held.drain(..at + THINK_CLOSE.len());
                self.in_reasoning = false;
            } else {
                // Keep a partial tag and the newlines before it: they vanish if the tag completes.
                let tag_from = (0..self.held.len())
                    .filter(|&i| self.held.is_char_boundary(i))
                    .find(|&i| THINK_CLOSE.starts_with(&self.held[i..]))
                    .unwrap_or(self.held.len());
                let keep_from = self.held[..tag_from].trim_end_matches('\n').len();
                let ready = self.held[..keep_from].to_owned();
                self.held.drain(..keep_from);
                self.emit_reasoning(&ready, &mut out);
                return out;
            }
        }
        let text = std::mem::take(&mut self.held);
        let text = if self.content_started {
            text.as_str()
        } else {
            text.trim_start_matches('\n')
        };
        if !text.is_empty() {
            self.content_started = true;
            out.push(Part::Content(text.to_owned()));
        }
        out
    }

    /// Flushes what was held back once generation ended.
    pub fn finish(&mut self) -> Vec<Part> {
        let mut out = Vec::new();
        let held = std::mem::take(&mut self.held);
        if self.in_reasoning {
            self.emit_reasoning(held.trim_end_matches('\n'), &mut out);
        }
        // Content only ever holds leading newlines, which are dropped.
        out
    }

    fn emit_reasoning(&mut self, text: &str, out: &mut Vec<Part>) {
        let text = if self.reasoning_started {
            text
        } else {
            text.trim_start_matches('\n')
        };
        if !text.is_empty() {
            self.reasoning_started = true;
            out.push(Part::Reasoning(text.to_owned()));
        }
    }
}

/// The whole path from token ids to response parts for one request.
pub struct Assembler {
    decoder: StreamDecoder,
    stop: StopMatcher,
    /// None for raw completions: every piece is content.
    split: Option<ThinkSplitter>,
    /// Tail of the raw text, to notice `</think>` for counting reasoning tokens.
    tail: String,
    raw_in_reasoning: bool,
    /// Tokens consumed (up to and including the one that completed a stop string).
    pub tokens: usize,
    pub reasoning_tokens: usize,
    /// A stop string matched; later tokens are ignored.
    pub stopped: bool,
}

impl Assembler {
    /// `think`: Some(starts inside a think block) for chat, None for raw completions.
    pub fn new(tokenizer: &Tokenizer, stops: Vec<String>, think: Option<bool>) -> Assembler {
        Assembler {
            decoder: tokenizer.stream_decoder(),
            stop: StopMatcher::new(stops),
            split: think.map(ThinkSplitter::new),
            tail: String::new(),
            raw_in_reasoning: think == Some(true),
            tokens: 0,
            reasoning_tokens: 0,
            stopped: false,
        }
    }

    pub fn push_token(&mut self, id: u32) -> Result<Vec<Part>, TokenizerError> {
        if self.stopped {
            return Ok(Vec::new());
        }
        self.tokens += 1;
        if self.raw_in_reasoning {
            self.reasoning_tokens += 1;
        }
        let text = self.decoder.push(id)?;
        self.note_raw(&text);
        let (ready, hit) = self.stop.push(&text);
        self.stopped = hit;
        let mut parts = self.route(&ready);
        if hit {
            parts.extend(
                self.split
                    .as_mut()
                    .map(ThinkSplitter::finish)
                    .unwrap_or_default(),
            );
        }
        Ok(parts)
    }

    /// Flushes held text at the end of generation (not needed after a stop-string match).
    pub fn finish(&mut self) -> Result<Vec<Part>, TokenizerError> {
        if self.stopped {
            return Ok(Vec::new());
        }
        let text = self.decoder.finish()?;
        let (mut ready, hit) = self.stop.push(&text);
        self.stopped = hit;
        if !hit {
            ready.push_str(&self.stop.finish());
        }
        let mut parts = self.route(&ready);
        parts.extend(
            self.split
                .as_mut()
                .map(ThinkSplitter::finish)
                .unwrap_or_default(),
        );
        Ok(parts)
    }

    fn route(&mut self, text: &str) -> Vec<Part> {
        match &mut self.split {
            Some(s) => s.push(text),
            None if text.is_empty() => Vec::new(),
            None => vec![Part::Content(text.to_owned())],
        }
    }

    fn note_raw(&mut self, text: &str) {
        if !self.raw_in_reasoning {
            return;
        }
        self.tail.push_str(text);
        if self.tail.contains(THINK_CLOSE) {
            self.raw_in_reasoning = false;
            self.tail.clear();
            return;
        }
        // Only the last few bytes can start a tag that later completes.
        let mut cut = self.tail.len().saturating_sub(THINK_CLOSE.len());
        while !self.tail.is_char_boundary(cut) {
            cut -= 1;
        }
        self.tail.drain(..cut);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stop_run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (t, hit) = m.push(p);
            out.push_str(&t);
            if hit {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_strings_split_across_pieces_are_found_and_cut() {
        assert_eq!(
            stop_run(&["END"], &["abc E", "N", "D tail"]),
            ("abc ".into(), true)
        );
        assert_eq!(
            stop_run(&["\n\n"], &["line\n", "\nnext"]),
            ("line".into(), true)
        );
        // A partial match that fails is released unchanged.
        assert_eq!(
            stop_run(&["END"], &["EN", "x", "E"]),
            ("ENxE".into(), false)
        );
        // The earliest of several stops wins.
        assert_eq!(stop_run(&["b", "xa"], &["x", "ab"]), ("".into(), true));
        assert_eq!(stop_run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn stop_matching_respects_multibyte_characters() {
        // "日本" split across pieces; the stop is a two-character CJK string.
        assert_eq!(
            stop_run(&["本語"], &["こんにちは日", "本", "語です"]),
            ("こんにちは日".into(), true)
        );
        assert_eq!(
            stop_run(&["é!"], &["caf", "é", "?é", "!"]),
            ("café?".into(), true)
        );
        // Held text is released on char boundaries only (no panic on slicing).
        let mut m = StopMatcher::new(vec!["😀x".into()]);
        assert_eq!(m.push("a😀"), ("a".into(), false));
        assert_eq!(m.push("y"), ("😀y".into(), false));
    }

    fn split_run(start: bool, pieces: &[&str]) -> (String, String) {
        let mut s = ThinkSplitter::new(start);
        let mut parts = Vec::new();
        for p in pieces {
            parts.extend(s.push(p));
        }
        parts.extend(s.finish());
        let (mut r, mut c) = (String::new(), String::new());
        for p in parts {
            match p {
                Part::Reasoning(t) => r.push_str(&t),
                Part::Content(t) => c.push_str(&t),
            }
        }
        (r, c)
    }

    #[test]
    fn think_splitter_separates_reasoning_and_content_on_chunked_input() {
        let whole = ("Let me think.\nDone".to_string(), "The answer.".to_string());
        assert_eq!(
            split_run(true, &["Let me think.\nDone\n</think>\n\nThe answer."]),
            whole
        );
        // The tag split across tokens, newlines on both sides in separate pieces.
        assert_eq!(
            split_run(
                true,
                &[
                    "\nLet me ",
                    "think.\n",
                    "Done",
                    "\n",
                    "</",
                    "thi",
                    "nk>",
                    "\n",
                    "\n",
                    "The ",
                    "answer."
                ]
            ),
            whole
        );
        // A partial tag that never completes is reasoning text.
        assert_eq!(
            split_run(true, &["a </thi", "s b\n"]),
            ("a </this b".into(), String::new())
        );
        // Thinking off: everything is content (leading newlines dropped).
        assert_eq!(
            split_run(false, &["\n", "Hi </think> x"]),
            (String::new(), "Hi </think> x".into())
        );
        // Reasoning cut by the end of generation keeps inner newlines only.
        assert_eq!(
            split_run(true, &["a\n\nb", "\n\n"]),
            ("a\n\nb".into(), String::new())
        );
        assert_eq!(
            split_run(true, &["</think>", "x"]),
            (String::new(), "x".into())
        );
    }

    #[test]
    fn streamed_parts_never_split_the_tag_and_hold_only_what_is_undecided() {
        let mut s = ThinkSplitter::new(true);
        assert_eq!(s.push("think"), vec![Part::Reasoning("think".into())]);
        assert_eq!(s.push("ing\n</th"), vec![Part::Reasoning("ing".into())]);
        assert!(s.in_reasoning());
        assert_eq!(s.push("ink>\n\nok"), vec![Part::Content("ok".into())]);
        assert!(!s.in_reasoning());
        assert_eq!(s.push("é"), vec![Part::Content("é".into())]);
    }

    fn fixture_tokenizer() -> Tokenizer {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tiny-qwen3_5_moe");
        Tokenizer::from_dir(&dir).expect("fixture tokenizer")
    }

    #[test]
    fn assembler_cuts_stop_strings_across_tokens_and_counts_reasoning_tokens() {
        let tok = fixture_tokenizer();
        let ids = tok
            .encode("Hmm, 日本語 ok\n</think>\n\nAnswer: café STOP here")
            .expect("encode");
        let mut a = Assembler::new(&tok, vec!["STOP".into()], Some(true));
        let mut parts = Vec::new();
        for &id in &ids {
            parts.extend(a.push_token(id).expect("push"));
            if a.stopped {
                break;
            }
        }
        parts.extend(a.finish().expect("finish"));
        let reasoning: String = parts
            .iter()
            .filter_map(|p| {
                if let Part::Reasoning(t) = p {
                    Some(t.as_str())
                } else {
                    None
                }
            })
            .collect();
        let content: String = parts
            .iter()
            .filter_map(|p| {
                if let Part::Content(t) = p {
                    Some(t.as_str())
                } else {
                    None
                }
            })
            .collect();
        assert_eq!(reasoning, "Hmm, 日本語 ok");
        assert_eq!(content, "Answer: café ");
        assert!(a.stopped && a.tokens < ids.len());
        let think_ids = tok
            .encode("Hmm, 日本語 ok\n</think>")
            .expect("encode")
            .len();
        assert_eq!(a.reasoning_tokens, think_ids);
    }

    #[test]
    fn assembler_streams_multibyte_text_byte_by_byte_tokens() {
        let tok = fixture_tokenizer();
        // Byte-level tokens of an emoji: the decoder holds partial characters back.
        let text = "a😀b";
        let ids = tok.encode(text).expect("encode");
        let mut a = Assembler::new(&tok, vec!["😀b".into()], None);
        let mut out = String::new();
        for &id in &ids {
            for p in a.push_token(id).expect("push") {
                if let Part::Content(t) = p {
                    out.push_str(&t);
                }
            }
        }
        assert!(a.stopped);
        assert_eq!(out, "a");
    }
}
