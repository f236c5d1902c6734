//! Chat template rendering with minijinja, configured to match transformers'
//! `apply_chat_template` (jinja2) byte for byte.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Serde, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

use python::{py_float, strftime_now, tojson};

mod python;

/// Context names set by `render` itself; kwargs may not replace them.
const RESERVED: [&str; 3] = ["messages", "tools", "add_generation_prompt"];

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
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
    #[error(
        "no chat template in {}: expected chat_template.jinja or tokenizer_config.json \"chat_template\"",
        dir.display()
    )]
    NotFound { dir: PathBuf },
    #[error("{}: {message}", path.display())]
    Config { path: PathBuf, message: String },
    /// The template failed to compile; `name` is the file (or field) it came from.
    #[error("chat template {name} is invalid: {message}")]
    Syntax { name: String, message: String },
    /// The template called `raise_exception(message)`; `message` is verbatim.
    #[error("{message}")]
    Raised { message: String },
    #[error("chat template {name} failed to render: {message}")]
    Render { name: String, message: String },
    #[error("invalid chat template argument: {0}")]
    InvalidArgument(String),
}

/// A compiled chat template plus the special tokens it may reference.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    name: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl ChatTemplate {
    /// Loads `chat_template.jinja`, else `chat_template` from `tokenizer_config.json`
    /// (a string, or a list of `{name, template}` from which "default" is taken).
    /// `bos_token`/`eos_token` come from `tokenizer_config.json` when present.
    pub fn from_dir(dir: &Path) -> Result<ChatTemplate, ChatError> {
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = read_optional(&cfg_path)?
            .map(|text| {
                serde_json::from_str::<serde_json::Value>(&text).map_err(|source| ChatError::Json {
                    path: cfg_path.clone(),
                    source,
                })
            })
            .transpose()?;
        let jinja_path = dir.join("chat_template.jinja");
        let (name, source) = match read_optional(&jinja_path)? {
            Some(src) => (jinja_path.display().to_string(), src),
            None => {
                let entry = cfg.as_ref().and_then(|c| c.get("chat_template"));
                let entry = entry.ok_or_else(|| ChatError::NotFound {
                    dir: dir.to_path_buf(),
                })?;
                let src = template_from_config(entry, &cfg_path)?;
                (format!("{}:chat_template", cfg_path.display()), src)
            }
        };
        let mut tmpl = ChatTemplate::compile(name, source)?;
        if let Some(cfg) = &cfg {
            tmpl.bos_token = special_token(cfg, "bos_token", &cfg_path)?;
            tmpl.eos_token = special_token(cfg, "eos_token", &cfg_path)?;
        }
        Ok(tmpl)
    }

    /// Compiles `source`; errors name it "chat_template". No bos/eos tokens are set.
    pub fn from_source(source: &str) -> Result<ChatTemplate, ChatError> {
        ChatTemplate::compile("chat_template".to_owned(), source.to_owned())
    }

    /// Where the template came from (a path, or "chat_template").
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Renders `messages` (a JSON list of OpenAI-style messages). `kwargs` enter the
    /// template context as-is (`enable_thinking`, `preserve_thinking`, ...) and may
    /// override `bos_token`/`eos_token`, but not `messages`, `tools` or
    /// `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ChatError> {
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        let tokens = [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
        ];
        for (key, token) in tokens {
            if let Some(t) = token {
                ctx.insert(key.to_owned(), Value::from(t.as_str()));
            }
        }
        for (key, value) in kwargs {
            if RESERVED.contains(&key.as_str()) {
                return Err(ChatError::InvalidArgument(format!(
                    "kwarg {key:?} would replace a render argument"
                )));
            }
            ctx.insert(key.clone(), Value::from(Serde(value)));
        }
        ctx.insert("messages".to_owned(), Value::from(Serde(messages)));
        // transformers passes tools=None when there are none.
        let tools = tools.map_or(Value::from(()), |t| Value::from(Serde(t)));
        ctx.insert("tools".to_owned(), tools);
        let gen_prompt = Value::from(add_generation_prompt);
        ctx.insert("add_generation_prompt".to_owned(), gen_prompt);

        let result = self
            .env
            .get_template(&self.name)
            .and_then(|t| t.render(Value::from(ctx)));
        result.map_err(|e| match raised_message(&e) {
            Some(message) => ChatError::Raised { message },
            None => ChatError::Render {
                name: self.name.clone(),
                message: e.to_string(),
            },
        })
    }

    fn compile(name: String, source: String) -> Result<ChatTemplate, ChatError> {
        let mut env = Environment::new();
        // transformers: ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        // with jinja2's default keep_trailing_newline=False.
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| ChatError::Syntax {
                name: name.clone(),
                message: e.to_string(),
            })?;
        env.set_syntax(syntax);
        // Python str/dict methods (startswith, split, items, ...).
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // Python prints floats via repr(): 1e+16, not minijinja's 10000000000000000.0.
        env.set_formatter(|out, state, value| {
            if value.kind() == ValueKind::Number
                && !value.is_integer()
                && let Ok(f) = f64::try_from(value.clone())
            {
                return Ok(out.write_str(&py_float(f))?);
            }
            minijinja::escape_formatter(out, state, value)
        });
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(name.clone(), source)
            .map_err(|e| ChatError::Syntax {
                name: name.clone(),
                message: e.to_string(),
            })?;
        Ok(ChatTemplate {
            env,
            name,
            bos_token: None,
            eos_token: None,
        })
    }
}

/// The empty think block of a thinking-disabled generation prompt.
const EMPTY_THINK: &str = "<think>\n\n</think>\n\n";

/// lily's history rewrite for thinking-disabled serving: each assistant turn before the
/// last user message gets `content` prefixed with the empty think block (if missing)
/// and `reasoning_content: ""`. The template then renders the turn exactly as the model
/// produced it, so each new prompt extends the previous prompt + reply token for token
/// (which the session prefix cache relies on). Non-string contents are left alone.
pub fn close_history_thinking(messages: &mut serde_json::Value) {
    let Some(list) = messages.as_array_mut() else {
        return;
    };
    let Some(last_user) = list.iter().rposition(|m| m["role"] == "user") else {
        return;
    };
    for msg in &mut list[..last_user] {
        let Some(msg) = msg.as_object_mut() else {
            continue;
        };
        if msg.get("role").and_then(|r| r.as_str()) != Some("assistant") {
            continue;
        }
        let content = match msg.get("content") {
            None | Some(serde_json::Value::Null) => "",
            Some(serde_json::Value::String(s)) => s.as_str(),
            Some(_) => continue,
        };
        if !content.starts_with(EMPTY_THINK) {
            let prefixed = format!("{EMPTY_THINK}{content}");
            msg.insert("content".to_owned(), prefixed.into());
        }
        msg.insert("reasoning_content".to_owned(), "".into());
    }
}

fn read_optional(path: &Path) -> Result<Option<String>, ChatError> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(ChatError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn template_from_config(entry: &serde_json::Value, path: &Path) -> Result<String, ChatError> {
    let bad = |message: &str| ChatError::Config {
        path: path.to_path_buf(),
        message: message.to_owned(),
    };
    match entry {
        serde_json::Value::String(s) => Ok(s.clone()),
        serde_json::Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .ok_or_else(|| bad("chat_template list has no entry named \"default\""))?
            .get("template")
            .and_then(|t| t.as_str())
            .map(str::to_owned)
            .ok_or_else(|| bad("chat_template \"default\" entry has no string \"template\"")),
        _ => Err(bad(
            "chat_template must be a string or a list of {name, template}",
        )),
    }
}

/// A special token entry: a string, `{"content": ...}`, or null/absent.
fn special_token(
    cfg: &serde_json::Value,
    key: &str,
    path: &Path,
) -> Result<Option<String>, ChatError> {
    match cfg.get(key) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => match v.get("content").and_then(|c| c.as_str()) {
            Some(s) => Ok(Some(s.to_owned())),
            None => Err(ChatError::Config {
                path: path.to_path_buf(),
                message: format!("{key} must be a string or {{\"content\": ...}}"),
            }),
        },
    }
}

/// Marks an error as coming from `raise_exception`, so `render` can tell it apart.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Raised(String);

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

fn raised_message(err: &Error) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(r) = e.downcast_ref::<Raised>() {
            return Some(r.0.clone());
        }
        cur = e.source();
    }
    None
}
