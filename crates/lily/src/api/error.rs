//! Every error the HTTP layer returns, mapped to a status and the OpenAI error body
//! `{"error":{"message","type","param","code"}}`.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// The message of an error response, attached to the response so the request log can show it.
#[derive(Clone, Debug)]
pub struct ErrorNote(pub String);

#[derive(Debug, Clone, PartialEq)]
pub enum ApiError {
    /// A malformed or unsupported request; `param` names the offending field.
    Invalid {
        message: String,
        param: Option<String>,
        code: &'static str,
    },
    Unauthorized,
    NotFound {
        path: String,
    },
    ModelNotFound {
        model: String,
        served: String,
    },
    MethodNotAllowed {
        method: String,
        path: String,
        allow: &'static str,
    },
    TooLarge {
        limit: usize,
    },
    QueueFull {
        capacity: usize,
    },
    Loading,
    LoadFailed(String),
    ShuttingDown,
    /// The engine failed while running the request.
    Engine(String),
}

impl ApiError {
    /// A 400 naming `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::Invalid {
            message: message.into(),
            param: Some(param.into()),
            code: "invalid_value",
        }
    }

    /// A 400 for a field lily does not support (as opposed to a malformed one).
    pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::Invalid {
            message: message.into(),
            param: Some(param.into()),
            code: "unsupported_parameter",
        }
    }

    /// A 400 about the request as a whole.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::Invalid {
            message: message.into(),
            param: None,
            code: "invalid_request",
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Invalid { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::NotFound { .. } | ApiError::ModelNotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::QueueFull { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Loading | ApiError::LoadFailed(_) | ApiError::ShuttingDown => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ApiError::Engine(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn message(&self) -> String {
        match self {
            ApiError::Invalid { message, .. } => message.clone(),
            ApiError::Unauthorized => {
                "missing or incorrect API key: send the header `Authorization: Bearer <key>`".into()
            }
            ApiError::NotFound { path } => format!("no such endpoint: {path}"),
            ApiError::ModelNotFound { model, served } => {
                format!("the model `{model}` does not exist; this server serves `{served}`")
            }
            ApiError::MethodNotAllowed {
                method,
                path,
                allow,
            } => {
                format!("method {method} is not allowed on {path} (use {allow})")
            }
            ApiError::TooLarge { limit } => {
                format!("request body exceeds the limit of {limit} bytes")
            }
            ApiError::QueueFull { capacity } => {
                format!("the server is busy: {capacity} requests are already queued; retry later")
            }
            ApiError::Loading => "model is loading; retry when GET /health answers 200".into(),
            ApiError::LoadFailed(e) => format!("the model failed to load: {e}"),
            ApiError::ShuttingDown => "the server is shutting down".into(),
            ApiError::Engine(e) => format!("generation failed: {e}"),
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            ApiError::Invalid { .. }
            | ApiError::NotFound { .. }
            | ApiError::ModelNotFound { .. }
            | ApiError::MethodNotAllowed { .. }
            | ApiError::TooLarge { .. }
            | ApiError::Unauthorized => "invalid_request_error",
            ApiError::QueueFull { .. } => "rate_limit_error",
            ApiError::Loading
            | ApiError::LoadFailed(_)
            | ApiError::ShuttingDown
            | ApiError::Engine(_) => "server_error",
        }
    }

    fn param(&self) -> Option<&str> {
        match self {
            ApiError::Invalid { param, .. } => param.as_deref(),
            ApiError::ModelNotFound { .. } => Some("model"),
            _ => None,
        }
    }

    fn code(&self) -> &'static str {
        match self {
            ApiError::Invalid { code, .. } => code,
            ApiError::Unauthorized => "invalid_api_key",
            ApiError::NotFound { .. } => "not_found",
            ApiError::ModelNotFound { .. } => "model_not_found",
            ApiError::MethodNotAllowed { .. } => "method_not_allowed",
            ApiError::TooLarge { .. } => "request_too_large",
            ApiError::QueueFull { .. } => "queue_full",
            ApiError::Loading => "model_loading",
            ApiError::LoadFailed(_) => "model_load_failed",
            ApiError::ShuttingDown => "shutting_down",
            ApiError::Engine(_) => "engine_error",
        }
    }

    /// The `{"error":{...}}` body (also sent as an SSE event when a stream fails).
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message(), "type": self.kind(), "param": self.param(), "code": self.code()}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status(), axum::Json(self.body())).into_response();
        let headers = resp.headers_mut();
        match &self {
            // Clients (the openai SDK included) honour Retry-After when backing off.
            ApiError::QueueFull { .. } | ApiError::Loading => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            ApiError::MethodNotAllowed { allow, .. } => {
                headers.insert(header::ALLOW, HeaderValue::from_static(allow));
            }
            ApiError::Unauthorized => {
                headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            _ => {}
        }
        resp.extensions_mut().insert(ErrorNote(self.message()));
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bodies_have_the_openai_shape() {
        let e = ApiError::invalid("temperature", "temperature must be between 0 and 2");
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        let b = e.body();
        assert_eq!(b["error"]["param"], "temperature");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert!(
            b["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("between 0 and 2"))
        );
        let q = ApiError::QueueFull { capacity: 4 }.into_response();
        assert_eq!(q.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            q.headers()
                .get(header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok()),
            Some("1")
        );
        assert_eq!(
            ApiError::Loading.body()["error"]["param"],
            serde_json::Value::Null
        );
    }
}
