//! Server counters, exported at GET /metrics in the Prometheus text format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::scheduler::GenSummary;

#[derive(Default)]
pub struct Metrics {
    /// Responses by (path, status).
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub prefilled_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Microseconds spent in prefill and decode.
    pub prefill_us: AtomicU64,
    pub decode_us: AtomicU64,
    pub queue_depth: AtomicU64,
    pub cache_entries: AtomicU64,
    pub cache_bytes: AtomicU64,
}

impl Metrics {
    pub fn record_request(&self, path: &str, status: u16) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((path.to_string(), status)).or_insert(0) += 1;
        }
    }

    pub fn record_generation(&self, s: &GenSummary) {
        self.prompt_tokens
            .fetch_add(s.prompt_tokens as u64, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(s.cached_tokens as u64, Ordering::Relaxed);
        self.prefilled_tokens
            .fetch_add(s.prefilled_tokens as u64, Ordering::Relaxed);
        self.generated_tokens
            .fetch_add(s.completion_tokens as u64, Ordering::Relaxed);
        self.prefill_us
            .fetch_add((s.prefill_ms * 1e3) as u64, Ordering::Relaxed);
        self.decode_us
            .fetch_add((s.decode_ms * 1e3) as u64, Ordering::Relaxed);
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "# HELP lily_requests_total HTTP responses by path and status.\n# TYPE lily_requests_total counter"
        );
        if let Ok(m) = self.requests.lock() {
            for ((path, status), n) in m.iter() {
                let _ = writeln!(
                    out,
                    "lily_requests_total{{path=\"{path}\",status=\"{status}\"}} {n}"
                );
            }
        }
        let counters = [
            (
                "lily_prompt_tokens_total",
                "Prompt tokens of completed requests.",
                g(&self.prompt_tokens),
            ),
            (
                "lily_cached_tokens_total",
                "Prompt tokens served from the session cache.",
                g(&self.cached_tokens),
            ),
            (
                "lily_prefilled_tokens_total",
                "Prompt tokens run through prefill.",
                g(&self.prefilled_tokens),
            ),
            (
                "lily_generated_tokens_total",
                "Generated tokens.",
                g(&self.generated_tokens),
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        }
        let secs = |us: u64| us as f64 / 1e6;
        let rate = |n: u64, us: u64| if us == 0 { 0.0 } else { n as f64 / secs(us) };
        let gauges = [
            (
                "lily_prefill_seconds_total",
                "Seconds spent in prefill.",
                secs(g(&self.prefill_us)),
            ),
            (
                "lily_decode_seconds_total",
                "Seconds spent decoding.",
                secs(g(&self.decode_us)),
            ),
            (
                "lily_prefill_tokens_per_second",
                "Mean prefill rate over all requests.",
                rate(g(&self.prefilled_tokens), g(&self.prefill_us)),
            ),
            (
                "lily_decode_tokens_per_second",
                "Mean decode rate over all requests.",
                rate(g(&self.generated_tokens), g(&self.decode_us)),
            ),
            (
                "lily_queue_depth",
                "Requests waiting for the engine.",
                g(&self.queue_depth) as f64,
            ),
            (
                "lily_cache_entries",
                "Session cache entries.",
                g(&self.cache_entries) as f64,
            ),
            (
                "lily_cache_bytes",
                "Bytes held by the session cache.",
                g(&self.cache_bytes) as f64,
            ),
        ];
        for (name, help, v) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        out
    }
}
