//! `lily serve`: bind at once, load the model on the engine thread meanwhile (GET /health
//! says when it is ready), serve the OpenAI-compatible API, and shut down gracefully on
//! SIGTERM/SIGINT (new requests get 503, in-flight ones finish, then exit 0).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::DeviceArg;
use crate::api::{AppState, router};
use crate::metrics::Metrics;
use crate::scheduler::{EngineStatus, Scheduler, SchedulerConfig, model_id};

#[derive(clap::Args, Clone, Debug)]
pub struct ServeArgs {
    /// Checkpoint directory (config.json, safetensors, tokenizer files, chat template).
    #[arg(long)]
    pub model: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub bind: String,
    /// Context length per request (prompt + completion + 1); clamped to the model's limit.
    #[arg(long, default_value_t = 4096)]
    pub max_seq: usize,
    /// Compute device.
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    pub device: DeviceArg,
    /// Require `Authorization: Bearer KEY` on /v1/* (also read from LILY_API_KEY).
    #[arg(long, env = "LILY_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Requests that may wait for the engine; more get 429.
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// Session prefix cache budget in bytes (suffixes K, M, G accepted) [default: a quarter of
    /// the available memory, at least 256M].
    #[arg(long, value_parser = parse_bytes)]
    pub cache_bytes: Option<usize>,
    /// CPU threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

/// `123`, `512K`, `8M`, `16G` (binary units; a trailing `B`/`iB` is allowed).
fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim().trim_end_matches(['B', 'b']).trim_end_matches('i');
    let (num, mult) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1usize << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        Some('T') => (&t[..t.len() - 1], 1 << 40),
        _ => (t, 1),
    };
    let n: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a byte count (e.g. 512M, 8G, 1073741824)"))?;
    if !(n >= 0.0 && n.is_finite()) {
        return Err(format!("`{s}` is not a byte count"));
    }
    Ok((n * mult as f64) as usize)
}

pub fn run(args: ServeArgs) -> Result<()> {
    if !args.model.is_dir() {
        bail!("--model {}: no such directory", args.model.display());
    }
    if args.device == DeviceArg::Cuda {
        // Fail at start, before binding: a server that can never load its model is not useful.
        engine::backend::cuda::device::CudaDevice::open(0)
            .map_err(|e| anyhow::anyhow!("--device cuda: no usable GPU: {e}"))?;
    }
    if args.max_seq < 2 {
        bail!("--max-seq must be at least 2, got {}", args.max_seq);
    }
    if args.api_key.as_deref().is_some_and(str::is_empty) {
        bail!("--api-key must not be empty");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("lily-http")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(serve(args))
}

async fn serve(args: ServeArgs) -> Result<()> {
    // Bind first, so a taken port fails at once and clients can poll /health during loading.
    let listener = tokio::net::TcpListener::bind(&args.bind)
        .await
        .with_context(|| format!("binding {}", args.bind))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    let metrics = Arc::new(Metrics::default());
    let cfg = SchedulerConfig {
        model_dir: args.model.clone(),
        max_seq: args.max_seq,
        queue: args.queue,
        cache_bytes: args.cache_bytes,
        threads: args.threads,
        device: args.device,
    };
    tracing::info!(
        "listening on http://{addr} (max_seq {}, queue {}, cache {}{})",
        cfg.max_seq,
        cfg.queue,
        cfg.cache_bytes
            .map_or("budget set once loaded".to_string(), |b| format!(
                "{} MiB",
                b >> 20
            )),
        if args.api_key.is_some() {
            ", API key required"
        } else {
            ""
        }
    );
    let tty = std::io::stderr().is_terminal();
    if !tty {
        tracing::info!("loading model from {}", args.model.display());
    }
    let (scheduler, _engine_thread) = Scheduler::start(cfg, metrics.clone());
    let state = AppState::new(
        scheduler.clone(),
        metrics,
        model_id(&args.model),
        args.api_key.clone(),
    );
    tokio::spawn(show_loading(
        scheduler,
        args.model.display().to_string(),
        tty,
    ));
    axum::serve(listener, router(state.clone()))
        .with_graceful_shutdown(shutdown_signal(state))
        .await
        .context("serving HTTP")?;
    // The engine thread ends once the last Scheduler is dropped; nothing is in flight now.
    tracing::info!("server stopped");
    Ok(())
}

/// A spinner line while the model loads when stderr is a terminal; plain log lines otherwise.
async fn show_loading(scheduler: Scheduler, dir: String, tty: bool) {
    let t0 = Instant::now();
    const FRAMES: [char; 10] = ['⠋', '⠙', '⠹', '⠸', '⠼', '⠴', '⠦', '⠧', '⠇', '⠏'];
    let mut frame = 0;
    loop {
        let status = scheduler.status();
        if tty {
            // Clear the spinner line before anything else is printed on it.
            let mut err = std::io::stderr().lock();
            match status {
                EngineStatus::Loading => {
                    let _ = write!(
                        err,
                        "\r\x1b[2K{} loading {dir} … {:.1}s",
                        FRAMES[frame % FRAMES.len()],
                        t0.elapsed().as_secs_f64()
                    );
                }
                _ => {
                    let _ = write!(err, "\r\x1b[2K");
                }
            }
            let _ = err.flush();
        }
        match status {
            EngineStatus::Loading => {}
            EngineStatus::Ready => {
                let secs = t0.elapsed().as_secs_f64();
                match scheduler.model_info() {
                    Some(i) => tracing::info!(
                        "model {} loaded in {secs:.1}s (vocab {}, max_seq {}, {}); serving",
                        i.id,
                        i.vocab_size,
                        i.max_seq,
                        i.device
                    ),
                    None => tracing::info!("model loaded in {secs:.1}s; serving"),
                }
                return;
            }
            EngineStatus::Failed(e) => {
                tracing::error!(
                    "model failed to load: {e}; /health answers 503 and generation requests fail"
                );
                return;
            }
        }
        frame += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_for_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

async fn shutdown_signal(state: AppState) {
    wait_for_signal().await;
    tracing::info!(
        "shutting down: refusing new requests, finishing in-flight ones (signal again to exit now)"
    );
    state.begin_shutdown();
    tokio::spawn(async {
        wait_for_signal().await;
        tracing::warn!("second signal: exiting without waiting for in-flight requests");
        std::process::exit(130);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_parse_with_units() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("8GiB"), Ok(8 << 30));
        assert_eq!(parse_bytes("1.5k"), Ok(1536));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("-1G").is_err());
    }
}
