//! The OpenAI-compatible HTTP layer on top of `Scheduler`: routes, auth, the per-request log
//! line and metrics. Handlers live in `handlers`, SSE in `stream`.

pub mod error;
mod fields;
mod handlers;
pub mod prompt;
mod response;
mod run;
mod stream;
pub mod text;
pub mod types;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{Method, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::metrics::Metrics;
use crate::scheduler::Scheduler;
use error::{ApiError, ErrorNote};

/// Largest accepted request body.
pub const BODY_LIMIT: usize = 4 << 20;

pub struct AppInner {
    pub scheduler: Scheduler,
    pub metrics: Arc<Metrics>,
    /// The served model id (known before loading finishes).
    pub model_id: String,
    /// Server start, unix seconds (the model's `created`).
    pub created: u64,
    pub api_key: Option<String>,
    shutting_down: AtomicBool,
    next_id: AtomicU64,
    id_salt: u64,
}

#[derive(Clone)]
pub struct AppState(pub Arc<AppInner>);

impl std::ops::Deref for AppState {
    type Target = AppInner;
    fn deref(&self) -> &AppInner {
        &self.0
    }
}

impl AppState {
    pub fn new(
        scheduler: Scheduler,
        metrics: Arc<Metrics>,
        model_id: String,
        api_key: Option<String>,
    ) -> AppState {
        use std::hash::{BuildHasher, Hasher};
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        // A random salt so ids differ across restarts without a rand dependency.
        let id_salt = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        AppState(Arc::new(AppInner {
            scheduler,
            metrics,
            model_id,
            created,
            api_key,
            shutting_down: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            id_salt,
        }))
    }

    /// New requests get 503 from now on; in-flight ones finish.
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        self.scheduler.begin_shutdown();
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// A unique response id: `prefix` + 24 hex digits.
    pub fn new_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mix = (n ^ self.id_salt)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(29)
            ^ self.id_salt;
        format!("{prefix}{:08x}{mix:016x}", self.created as u32)
    }
}

pub fn router(state: AppState) -> Router {
    let na = |allow: &'static str| {
        move |method: Method, uri: axum::http::Uri| async move {
            ApiError::MethodNotAllowed {
                method: method.to_string(),
                path: uri.path().to_owned(),
                allow,
            }
        }
    };
    Router::new()
        .route(
            "/v1/chat/completions",
            post(handlers::chat).fallback(na("POST")),
        )
        .route(
            "/v1/completions",
            post(handlers::completions).fallback(na("POST")),
        )
        .route("/v1/models", get(handlers::models).fallback(na("GET")))
        .route("/v1/models/{id}", get(handlers::model).fallback(na("GET")))
        .route("/health", get(handlers::health).fallback(na("GET")))
        .route("/metrics", get(handlers::metrics).fallback(na("GET")))
        .fallback(|uri: axum::http::Uri| async move {
            ApiError::NotFound {
                path: uri.path().to_owned(),
            }
        })
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(middleware::from_fn_with_state(state.clone(), log_requests))
        .layer(middleware::from_fn(close_if_body_unread))
        .with_state(state)
}

/// A response sent before its request's body was read to the end says `Connection: close`. The
/// server cannot reuse such a connection (the rest of the body is still on it) and drops it after
/// the response; without the header a client that keeps connections alive would send its next
/// request on it and see the connection closed instead of an answer. It happens wherever an
/// answer needs no body: an unknown path, a wrong method, a missing API key, a body over the
/// limit.
async fn close_if_body_unread(req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let has_body =
        declared.is_some_and(|n| n > 0) || parts.headers.contains_key(header::TRANSFER_ENCODING);
    if !has_body {
        return next.run(Request::from_parts(parts, body)).await;
    }
    let read = Arc::new(AtomicBool::new(false));
    let watched = ReadToEnd {
        data: body.into_data_stream(),
        read: read.clone(),
    };
    let mut resp = next
        .run(Request::from_parts(
            parts,
            axum::body::Body::from_stream(watched),
        ))
        .await;
    if !read.load(Ordering::Acquire) {
        resp.headers_mut().insert(
            header::CONNECTION,
            header::HeaderValue::from_static("close"),
        );
    }
    resp
}

/// A request body's data that sets `read` once it has given its last chunk.
struct ReadToEnd {
    data: axum::body::BodyDataStream,
    read: Arc<AtomicBool>,
}

impl futures_util::Stream for ReadToEnd {
    type Item = Result<axum::body::Bytes, axum::Error>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let next = std::pin::Pin::new(&mut self.data).poll_next(cx);
        if let std::task::Poll::Ready(None) = next {
            self.read.store(true, Ordering::Release);
        }
        next
    }
}

/// /v1/* needs `Authorization: Bearer KEY` when the server has a key; /health and /metrics
/// stay open for probes and scrapers.
async fn auth(State(st): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.api_key
        && req.uri().path().starts_with("/v1/")
    {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| constant_time_eq(g.trim().as_bytes(), key.as_bytes())) {
            return ApiError::Unauthorized.into_response();
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Token counts a generation handler reports for the log line.
#[derive(Default, Clone, Debug)]
pub struct LogTokens {
    pub prompt: usize,
    pub cached: usize,
    pub completion: usize,
    pub decode_ms: f64,
}

#[derive(Default)]
struct LogData {
    status: Option<u16>,
    tokens: Option<LogTokens>,
    error: Option<String>,
}

/// One request's log line and metrics, written when the last holder drops it: right after the
/// response for plain requests, when the stream ends (or the client leaves) for SSE.
pub struct ReqLog {
    method: Method,
    path: String,
    start: Instant,
    metrics: Arc<Metrics>,
    data: Mutex<LogData>,
}

impl ReqLog {
    pub fn set_tokens(&self, t: LogTokens) {
        if let Ok(mut d) = self.data.lock() {
            d.tokens = Some(t);
        }
    }

    pub fn set_error(&self, e: String) {
        if let Ok(mut d) = self.data.lock() {
            d.error = Some(e);
        }
    }

    fn set_status(&self, status: u16) {
        if let Ok(mut d) = self.data.lock() {
            d.status = Some(status);
        }
    }
}

/// The metrics label of a path: known routes as themselves, anything else as "other" (so
/// scanners cannot blow up the label set).
fn path_label(path: &str) -> &str {
    match path {
        "/v1/chat/completions" | "/v1/completions" | "/v1/models" | "/health" | "/metrics" => path,
        p if p.starts_with("/v1/models/") => "/v1/models/{id}",
        _ => "other",
    }
}

impl Drop for ReqLog {
    fn drop(&mut self) {
        let d = self.data.get_mut().map(std::mem::take).unwrap_or_default();
        // 499: the client went away before a response was produced (nginx's convention).
        let status = d.status.unwrap_or(499);
        self.metrics.record_request(path_label(&self.path), status);
        let ms = self.start.elapsed().as_millis();
        let mut line = format!("{} {} {status} {ms}ms", self.method, self.path);
        if let Some(t) = &d.tokens {
            let tps = if t.decode_ms > 0.0 {
                t.completion as f64 / (t.decode_ms / 1e3)
            } else {
                0.0
            };
            line.push_str(&format!(
                " prompt={} cached={} completion={} tok/s={tps:.1}",
                t.prompt, t.cached, t.completion
            ));
        }
        if let Some(e) = &d.error {
            line.push_str(&format!(" error={e:?}"));
        }
        // Probes and scrapers poll these; keep them out of the info log unless they fail.
        let quiet = matches!(self.path.as_str(), "/health" | "/metrics") && status == 200;
        if quiet {
            tracing::debug!("{line}");
        } else {
            tracing::info!("{line}");
        }
    }
}

async fn log_requests(State(st): State<AppState>, mut req: Request, next: Next) -> Response {
    let log = Arc::new(ReqLog {
        method: req.method().clone(),
        path: req.uri().path().to_owned(),
        start: Instant::now(),
        metrics: st.metrics.clone(),
        data: Mutex::new(LogData::default()),
    });
    req.extensions_mut().insert(log.clone());
    let resp = next.run(req).await;
    log.set_status(resp.status().as_u16());
    if let Some(ErrorNote(msg)) = resp.extensions().get::<ErrorNote>() {
        log.set_error(msg.clone());
    }
    resp
}
