//! Reading a JSON object field by field, so that every error names its field (`param`):
//! a wrong type, a value out of range, or a field left over (unknown, or known but
//! unsupported, with the reason).

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::error::ApiError;

/// A JSON object being consumed field by field; `at` prefixes params ("messages[2].").
pub(crate) struct Obj {
    pub(crate) map: Map<String, Value>,
    at: String,
}

impl Obj {
    pub fn new(value: Value, at: &str, what: &str) -> Result<Obj, ApiError> {
        match value {
            Value::Object(map) => Ok(Obj {
                map,
                at: at.to_owned(),
            }),
            other => {
                let param = at.trim_end_matches('.');
                let msg = format!(
                    "{} must be a JSON object, got {}",
                    if param.is_empty() { what } else { param },
                    kind_of(&other)
                );
                Err(if param.is_empty() {
                    ApiError::bad_request(msg)
                } else {
                    ApiError::invalid(param, msg)
                })
            }
        }
    }

    pub(crate) fn param(&self, key: &str) -> String {
        format!("{}{key}", self.at)
    }

    /// Removes `key`; JSON null counts as absent, as in OpenAI's API.
    pub(crate) fn take(&mut self, key: &str) -> Option<Value> {
        self.map.remove(key).filter(|v| !v.is_null())
    }

    pub(crate) fn string(&mut self, key: &str) -> Result<Option<String>, ApiError> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong_type(key, "a string", &v)),
        }
    }

    pub(crate) fn boolean(&mut self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(v) => Err(self.wrong_type(key, "a boolean", &v)),
        }
    }

    /// A number within `lo..=hi` (`lo` excluded when `open_lo`).
    pub(crate) fn number(
        &mut self,
        key: &str,
        lo: f64,
        hi: f64,
        open_lo: bool,
    ) -> Result<Option<f32>, ApiError> {
        let Some(v) = self.take(key) else {
            return Ok(None);
        };
        let Some(x) = v.as_f64() else {
            return Err(self.wrong_type(key, "a number", &v));
        };
        let ok = if open_lo { x > lo } else { x >= lo } && x <= hi;
        if !ok {
            let range = if open_lo {
                format!("greater than {lo} and at most {hi}")
            } else {
                format!("between {lo} and {hi}")
            };
            return Err(ApiError::invalid(
                self.param(key),
                format!("`{}` must be {range}, got {x}", self.param(key)),
            ));
        }
        Ok(Some(x as f32))
    }

    pub(crate) fn integer(&mut self, key: &str) -> Result<Option<i64>, ApiError> {
        match self.take(key) {
            None => Ok(None),
            Some(v) => match v.as_i64() {
                Some(n) => Ok(Some(n)),
                // Seeds are often u64 hashes.
                None => match v.as_u64() {
                    Some(n) => Ok(Some(n as i64)),
                    None => Err(self.wrong_type(key, "an integer", &v)),
                },
            },
        }
    }

    /// A nested object deserialized with serde (`deny_unknown_fields` names stray keys).
    pub(crate) fn nested<T: DeserializeOwned>(&mut self, key: &str) -> Result<Option<T>, ApiError> {
        let Some(v) = self.take(key) else {
            return Ok(None);
        };
        let param = self.param(key);
        if !v.is_object() {
            return Err(self.wrong_type(key, "an object", &v));
        }
        serde_json::from_value(v)
            .map(Some)
            .map_err(|e| ApiError::invalid(&param, format!("`{param}`: {e}")))
    }

    pub(crate) fn wrong_type(&self, key: &str, want: &str, got: &Value) -> ApiError {
        let p = self.param(key);
        ApiError::invalid(&p, format!("`{p}` must be {want}, got {}", kind_of(got)))
    }

    /// Fails on the first field left over: a known-but-unsupported one with its reason, else
    /// as unknown.
    pub(crate) fn finish(
        self,
        unsupported: &dyn Fn(&str) -> Option<&'static str>,
    ) -> Result<(), ApiError> {
        let Some(key) = self.map.keys().next() else {
            return Ok(());
        };
        let p = format!("{}{key}", self.at);
        Err(match unsupported(key) {
            Some(why) => ApiError::unsupported(&p, format!("`{p}` is not supported: {why}")),
            None => ApiError::invalid(&p, format!("unknown field `{p}`")),
        })
    }
}

pub(crate) fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Parses a body into a JSON object, naming the syntax problem.
pub fn parse_body(body: &[u8]) -> Result<Obj, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request(
            "the request body is empty; send a JSON object",
        ));
    }
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON in the request body: {e}")))?;
    Obj::new(v, "", "the request body")
}

/// A positive integer field (token counts).
pub(crate) fn positive(o: &mut Obj, key: &str) -> Result<Option<usize>, ApiError> {
    match o.integer(key)? {
        None => Ok(None),
        Some(n) if n >= 1 => Ok(Some(n as usize)),
        Some(n) => Err(ApiError::invalid(
            key,
            format!("`{key}` must be at least 1, got {n}"),
        )),
    }
}

/// Fields tolerated at harmless values only; anything else is left for `finish` to refuse.
pub(crate) fn take_harmless(o: &mut Obj, key: &str, ok: impl Fn(&Value) -> bool) {
    if o.map.get(key).is_some_and(|v| v.is_null() || ok(v)) {
        o.map.remove(key);
    }
}
