//! HF `tokenizer.json` wrapper: encode/decode, stop ids, and a streaming detokenizer.
//!
//! Matches HF `tokenizers` (`add_special_tokens=False`): special-token strings in the
//! input are matched before NFC normalization, so they always map to their ids.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

/// Errors from loading or using the tokenizer; file errors name the file.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("required file {} is missing", path.display())]
    MissingFile { path: PathBuf },
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("invalid JSON in {}: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("cannot load tokenizer from {}: {message}", path.display())]
    Load { path: PathBuf, message: String },
    #[error("{}: {message}", path.display())]
    Config { path: PathBuf, message: String },
    #[error("encode failed: {0}")]
    Encode(String),
    #[error("decode failed: {0}")]
    Decode(String),
}

/// A loaded tokenizer plus the model's stop ids. Cloning is cheap (shared inner).
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    stop_ids: Vec<u32>,
    vocab_size: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("stop_ids", &self.stop_ids)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` (required) and the stop ids from `tokenizer_config.json`,
    /// `generation_config.json` and `config.json` (all optional) in `dir`.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        let path = dir.join("tokenizer.json");
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(TokenizerError::MissingFile { path });
            }
            Err(source) => return Err(TokenizerError::Io { path, source }),
        };
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| TokenizerError::Load {
                path: path.clone(),
                message: e.to_string(),
            })?;
        let vocab_size = inner.get_vocab_size(true);
        let mut tok = Tokenizer {
            inner: Arc::new(inner),
            stop_ids: Vec::new(),
            vocab_size,
        };
        tok.stop_ids = tok.read_stop_ids(dir)?;
        Ok(tok)
    }

    /// The eos token's id first, then every configured `eos_token_id`, deduplicated.
    /// Empty if no file names one.
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// Whether `id` ends generation.
    pub fn is_stop(&self, id: u32) -> bool {
        self.stop_ids.contains(&id)
    }

    /// Token ids of `text`, with no BOS/EOS added; special-token strings become their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        // encode_fast skips offset tracking; the ids are identical.
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`. Invalid UTF-8 becomes U+FFFD; ids outside the vocabulary are
    /// dropped (as HF does).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        decode_with(&self.inner, ids, skip_special)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The wrapped HF tokenizer, for anything this wrapper does not cover.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// A streaming detokenizer that skips special tokens, like `decode(ids, true)`.
    /// Use `StreamDecoder::new` to keep them.
    pub fn stream_decoder(&self) -> StreamDecoder {
        StreamDecoder::new(self, true)
    }

    fn read_stop_ids(&self, dir: &Path) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::new();
        let path = dir.join("tokenizer_config.json");
        let cfg = read_optional_json(&path)?;
        let eos = cfg.as_ref().and_then(|c| c.get("eos_token"));
        if let Some(token) = token_string(eos, &path, "eos_token")? {
            let id = self
                .token_to_id(&token)
                .ok_or_else(|| TokenizerError::Config {
                    path: path.clone(),
                    message: format!("eos_token {token:?} is not in the vocabulary"),
                })?;
            ids.push(id);
        }
        let path = dir.join("generation_config.json");
        if let Some(cfg) = read_optional_json(&path)? {
            self.push_eos_ids(cfg.get("eos_token_id"), &path, "eos_token_id", &mut ids)?;
        }
        let path = dir.join("config.json");
        if let Some(cfg) = read_optional_json(&path)? {
            self.push_eos_ids(cfg.get("eos_token_id"), &path, "eos_token_id", &mut ids)?;
            // Multimodal configs (qwen3_5_moe) keep the text model's fields here.
            let nested = cfg.get("text_config").and_then(|t| t.get("eos_token_id"));
            self.push_eos_ids(nested, &path, "text_config.eos_token_id", &mut ids)?;
        }
        Ok(ids)
    }

    fn push_eos_ids(
        &self,
        value: Option<&Value>,
        path: &Path,
        field: &str,
        ids: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        let items: &[Value] = match value {
            None | Some(Value::Null) => return Ok(()),
            Some(Value::Array(list)) => list,
            Some(v) => std::slice::from_ref(v),
        };
        for item in items {
            let id = item
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| TokenizerError::Config {
                    path: path.to_path_buf(),
                    message: format!("{field} must be a token id or a list of them, got {item}"),
                })?;
            if id as usize >= self.vocab_size {
                return Err(TokenizerError::Config {
                    path: path.to_path_buf(),
                    message: format!(
                        "{field} {id} is outside the vocabulary (size {})",
                        self.vocab_size
                    ),
                });
            }
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        Ok(())
    }
}

fn decode_with(
    tok: &tokenizers::Tokenizer,
    ids: &[u32],
    skip_special: bool,
) -> Result<String, TokenizerError> {
    tok.decode(ids, skip_special)
        .map_err(|e| TokenizerError::Decode(e.to_string()))
}

/// Parses `path` if it exists; `Ok(None)` when it does not.
fn read_optional_json(path: &Path) -> Result<Option<Value>, TokenizerError> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(TokenizerError::Io {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| TokenizerError::Json {
            path: path.to_path_buf(),
            source,
        })
}

/// A special-token entry of tokenizer_config.json: a string, `{"content": ...}`, or null.
fn token_string(
    value: Option<&Value>,
    path: &Path,
    field: &str,
) -> Result<Option<String>, TokenizerError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(m)) => match m.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(TokenizerError::Config {
                path: path.to_path_buf(),
                message: format!("{field} object has no string \"content\""),
            }),
        },
        Some(other) => Err(TokenizerError::Config {
            path: path.to_path_buf(),
            message: format!("{field} must be a string or {{\"content\": ...}}, got {other}"),
        }),
    }
}

/// Once the window holds this many ids while its text still ends in U+FFFD, try to
/// drop ids from its front (a run of real U+FFFD output would otherwise grow it).
const MAX_WINDOW: usize = 8;
const REPLACEMENT: char = '\u{FFFD}';

/// Incremental detokenizer: each `push` returns only newly completed text.
///
/// It decodes a short window of recent ids (like TGI's prefix/read offsets) instead of
/// the whole sequence. A trailing U+FFFD may be an incomplete UTF-8 character, so it is
/// held back until a later id completes it or `finish` flushes it. Concatenating every
/// `push` and `finish` result equals `Tokenizer::decode(all_ids, skip_special)` (for
/// prefix-stable decoders such as byte-level BPE; a violation is reported as an error).
pub struct StreamDecoder {
    inner: Arc<tokenizers::Tokenizer>,
    skip_special: bool,
    /// Recent ids. Text before the window is final, so older ids are dropped.
    window: Vec<u32>,
    /// Bytes of `decode(window)` already returned.
    emitted: usize,
}

impl StreamDecoder {
    pub fn new(tokenizer: &Tokenizer, skip_special: bool) -> StreamDecoder {
        StreamDecoder {
            inner: Arc::clone(&tokenizer.inner),
            skip_special,
            window: Vec::new(),
            emitted: 0,
        }
    }

    /// Adds one id; returns the text it completes (often empty).
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        self.window.push(id);
        let text = self.decode(&self.window)?;
        let pending = self.unemitted(&text)?;
        if let Some(stable) = pending.strip_suffix(REPLACEMENT) {
            let out = stable.to_owned();
            self.emitted += out.len();
            if self.window.len() > MAX_WINDOW {
                self.shrink_window(&text)?;
            }
            return Ok(out);
        }
        let out = pending.to_owned();
        // Everything is final: keep only the last id as context for the next decode
        // (decoders such as Metaspace render a token differently at the start).
        let last = self.window.len() - 1;
        self.window.drain(..last);
        self.emitted = self.decode(&self.window)?.len();
        Ok(out)
    }

    /// Returns any held-back text (e.g. a dangling U+FFFD) and resets the decoder.
    pub fn finish(&mut self) -> Result<String, TokenizerError> {
        let text = self.decode(&self.window)?;
        let out = self.unemitted(&text)?.to_owned();
        self.window.clear();
        self.emitted = 0;
        Ok(out)
    }

    /// Ids currently kept for context (small unless the output is pathological).
    pub fn window_len(&self) -> usize {
        self.window.len()
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        decode_with(&self.inner, ids, self.skip_special)
    }

    fn unemitted<'t>(&self, text: &'t str) -> Result<&'t str, TokenizerError> {
        // Holds for prefix-stable decoders (byte-level BPE is); anything else is a bug.
        text.get(self.emitted..).ok_or_else(|| {
            TokenizerError::Decode(format!(
                "stream decoder out of sync: {} bytes emitted, window decodes to {text:?}",
                self.emitted
            ))
        })
    }

    /// Called when `text` (the window's decode) ends in a held-back U+FFFD and all before
    /// it is emitted. Finds a split id `j` among the last few such that the window's text
    /// is exactly `decode(..j) + decode(j..)` and the suffix holds at least two characters;
    /// then the held character lies after `j`, so ids before `j` can be dropped.
    fn shrink_window(&mut self, text: &str) -> Result<(), TokenizerError> {
        let n = self.window.len();
        for j in (n.saturating_sub(4).max(1)..n).rev() {
            let suffix = self.decode(&self.window[j..])?;
            if suffix.chars().nth(1).is_none() || !text.ends_with(&suffix) {
                continue;
            }
            let head = self.decode(&self.window[..j])?;
            if head.len() + suffix.len() == text.len() && text.starts_with(&head) {
                self.window.drain(..j);
                self.emitted = suffix.len() - REPLACEMENT.len_utf8();
                return Ok(());
            }
        }
        Ok(())
    }
}
