//! The engine thread and its request queue. HTTP handlers submit `GenRequest`s; the engine
//! thread runs them one at a time (resuming from the session prefix cache) and streams
//! `GenEvent`s back. Dropping a `GenStream` cancels its generation at the next step.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Instant;

use engine::backend::Backend;
use engine::chat::ChatTemplate;
use engine::generate::{Engine, FinishReason};
use engine::sampler::{Sampler, SamplingParams};
use engine::tokenizer::Tokenizer;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use crate::metrics::Metrics;
use crate::session_cache::SessionCache;

/// What the server knows about the loaded model; available once loading finished.
pub struct ModelInfo {
    /// The id clients send as `model` (the checkpoint directory's name).
    pub id: String,
    pub vocab_size: usize,
    pub max_seq: usize,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    pub stop_ids: Vec<u32>,
    pub device: String,
}

#[derive(Clone, Debug)]
pub enum EngineStatus {
    Loading,
    Ready,
    Failed(String),
}

pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub cache_key: Option<String>,
}

#[derive(Clone, Debug, Default)]
pub struct GenSummary {
    pub finish: Option<FinishReason>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// Prompt tokens actually run through prefill (prompt minus cached).
    pub prefilled_tokens: usize,
    pub completion_tokens: usize,
    pub queue_ms: f64,
    pub prefill_ms: f64,
    pub decode_ms: f64,
}

#[derive(Debug)]
pub enum GenEvent {
    /// Generation began: this many prompt tokens came from the cache.
    Started {
        cached_tokens: usize,
        queue_ms: f64,
    },
    Token(u32),
    Done(GenSummary),
    /// The request failed inside the engine; the message is safe to show to the client.
    Error(String),
}

#[derive(Debug)]
pub enum SubmitError {
    NotReady,
    QueueFull { capacity: usize },
    ShuttingDown,
}

/// Receives a request's events; dropping it cancels the generation.
pub struct GenStream {
    pub events: UnboundedReceiver<GenEvent>,
    cancel: Arc<AtomicBool>,
}

impl GenStream {
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl Drop for GenStream {
    fn drop(&mut self) {
        self.cancel();
    }
}

struct Job {
    req: GenRequest,
    events: UnboundedSender<GenEvent>,
    cancel: Arc<AtomicBool>,
    enqueued: Instant,
}

struct Shared {
    status: Mutex<EngineStatus>,
    info: Mutex<Option<Arc<ModelInfo>>>,
    queue_depth: AtomicUsize,
    capacity: usize,
    shutting_down: AtomicBool,
    metrics: Arc<Metrics>,
}

#[derive(Clone)]
pub struct Scheduler {
    shared: Arc<Shared>,
    tx: mpsc::SyncSender<Job>,
}

pub struct SchedulerConfig {
    pub model_dir: PathBuf,
    pub max_seq: usize,
    pub queue: usize,
    /// Session cache budget; `None`: the backend's default (device memory on a GPU), else a
    /// quarter of the host's available memory.
    pub cache_bytes: Option<usize>,
    pub threads: usize,
    pub device: crate::DeviceArg,
}

impl Scheduler {
    /// Starts the engine thread, which loads the model and then serves the queue. Returns at
    /// once; `status()` says when the model is ready.
    pub fn start(
        cfg: SchedulerConfig,
        metrics: Arc<Metrics>,
    ) -> (Scheduler, std::thread::JoinHandle<()>) {
        let capacity = cfg.queue.max(1);
        // The channel itself is unbounded in practice; `queue_depth` enforces the limit so the
        // HTTP side can answer 429 without blocking.
        let (tx, rx) = mpsc::sync_channel::<Job>(capacity + 1);
        let shared = Arc::new(Shared {
            status: Mutex::new(EngineStatus::Loading),
            info: Mutex::new(None),
            queue_depth: AtomicUsize::new(0),
            capacity,
            shutting_down: AtomicBool::new(false),
            metrics,
        });
        let sh = shared.clone();
        let handle = std::thread::Builder::new()
            .name("lily-engine".into())
            .spawn(move || engine_thread(cfg, sh, rx))
            .expect("spawning the engine thread");
        (Scheduler { shared, tx }, handle)
    }

    pub fn status(&self) -> EngineStatus {
        self.shared
            .status
            .lock()
            .map(|s| s.clone())
            .unwrap_or(EngineStatus::Failed("status lock poisoned".into()))
    }

    pub fn model_info(&self) -> Option<Arc<ModelInfo>> {
        self.shared.info.lock().ok().and_then(|i| i.clone())
    }

    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    pub fn queue_depth(&self) -> usize {
        self.shared.queue_depth.load(Ordering::Relaxed)
    }

    pub fn submit(&self, req: GenRequest) -> Result<GenStream, SubmitError> {
        if self.shared.shutting_down.load(Ordering::Relaxed) {
            return Err(SubmitError::ShuttingDown);
        }
        if !matches!(self.status(), EngineStatus::Ready) {
            return Err(SubmitError::NotReady);
        }
        let depth = self.shared.queue_depth.fetch_add(1, Ordering::SeqCst);
        if depth >= self.shared.capacity {
            self.shared.queue_depth.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull {
                capacity: self.shared.capacity,
            });
        }
        let (etx, erx) = unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let job = Job {
            req,
            events: etx,
            cancel: cancel.clone(),
            enqueued: Instant::now(),
        };
        if let Err(e) = self.tx.try_send(job) {
            self.shared.queue_depth.fetch_sub(1, Ordering::SeqCst);
            return Err(match e {
                mpsc::TrySendError::Full(_) => SubmitError::QueueFull {
                    capacity: self.shared.capacity,
                },
                // The engine thread is gone: nothing will ever run this request.
                mpsc::TrySendError::Disconnected(_) => SubmitError::ShuttingDown,
            });
        }
        self.shared
            .metrics
            .queue_depth
            .store(self.queue_depth() as u64, Ordering::Relaxed);
        Ok(GenStream {
            events: erx,
            cancel,
        })
    }

    /// Refuses new work; queued requests still run. The engine thread exits once the last
    /// `Scheduler` clone is dropped and the queue is empty.
    pub fn begin_shutdown(&self) {
        self.shared.shutting_down.store(true, Ordering::Relaxed);
    }
}

fn set_status(sh: &Shared, s: EngineStatus) {
    if let Ok(mut g) = sh.status.lock() {
        *g = s;
    }
}

fn engine_thread(cfg: SchedulerConfig, sh: Arc<Shared>, rx: mpsc::Receiver<Job>) {
    match crate::open_device(cfg.device, cfg.threads) {
        Ok(crate::Device::Cpu(b)) => engine_loop(b, &cfg, &sh, &rx),
        Ok(crate::Device::Cuda(b)) => engine_loop(*b, &cfg, &sh, &rx),
        Err(e) => load_failed(&cfg, &sh, &rx, e),
    }
}

/// Logs why the model is not served and answers every queued request with an error.
fn load_failed(cfg: &SchedulerConfig, sh: &Shared, rx: &mpsc::Receiver<Job>, e: anyhow::Error) {
    tracing::error!("loading {} failed: {e:#}", cfg.model_dir.display());
    set_status(sh, EngineStatus::Failed(format!("{e:#}")));
    while let Ok(job) = rx.recv() {
        sh.queue_depth.fetch_sub(1, Ordering::SeqCst);
        let _ = job
            .events
            .send(GenEvent::Error("the model failed to load".into()));
    }
}

fn engine_loop<B: Backend>(
    backend: B,
    cfg: &SchedulerConfig,
    sh: &Arc<Shared>,
    rx: &mpsc::Receiver<Job>,
) {
    let loaded = (|| -> anyhow::Result<(Engine<B>, ModelInfo)> {
        let tokenizer = Tokenizer::from_dir(&cfg.model_dir)?;
        let template = ChatTemplate::from_dir(&cfg.model_dir)?;
        let device = backend.name();
        let eng = crate::load_engine_on(&cfg.model_dir, backend)?;
        let max_seq = cfg.max_seq.min(eng.config().max_position_embeddings.max(2));
        let mut stop_ids = tokenizer.stop_ids().to_vec();
        for id in &eng.config().eos_token_ids {
            if !stop_ids.contains(id) {
                stop_ids.push(*id);
            }
        }
        let id = model_id(&cfg.model_dir);
        let info = ModelInfo {
            id,
            vocab_size: eng.config().vocab_size,
            max_seq,
            tokenizer,
            template,
            stop_ids,
            device,
        };
        Ok((eng, info))
    })();
    let (eng, info) = match loaded {
        Ok(v) => v,
        Err(e) => return load_failed(cfg, sh, rx, e),
    };
    let info = Arc::new(info);
    tracing::info!(
        "model {} ready on {} (max_seq {})",
        info.id,
        info.device,
        info.max_seq
    );
    if let Ok(mut g) = sh.info.lock() {
        *g = Some(info.clone());
    }
    set_status(sh, EngineStatus::Ready);

    let budget = cfg
        .cache_bytes
        .or_else(|| eng.backend.default_cache_bytes())
        .unwrap_or_else(crate::session_cache::default_budget_bytes);
    tracing::info!("session cache budget {} MiB", budget >> 20);
    let mut cache: SessionCache<B> = SessionCache::new(budget);
    while let Ok(job) = rx.recv() {
        let depth = sh
            .queue_depth
            .fetch_sub(1, Ordering::SeqCst)
            .saturating_sub(1);
        sh.metrics
            .queue_depth
            .store(depth as u64, Ordering::Relaxed);
        // A bug in one request must not take the server down: the job's state was checked
        // out of the cache, so dropping it on a panic leaves the cache consistent.
        let events = job.events.clone();
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_job(&eng, &info, &mut cache, job, &sh.metrics)
        }));
        if ran.is_err() {
            tracing::error!("a request panicked in the engine; it was answered with an error");
            let _ = events.send(GenEvent::Error("internal error in the engine".into()));
        }
        sh.metrics
            .cache_entries
            .store(cache.len() as u64, Ordering::Relaxed);
        sh.metrics
            .cache_bytes
            .store(cache.bytes() as u64, Ordering::Relaxed);
    }
    tracing::info!("engine thread drained its queue and stops");
}

/// The served model id: the checkpoint directory's name (e.g. `Qwen3.6-35B-A3B-4bit`).
pub fn model_id(dir: &std::path::Path) -> String {
    let canon = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    canon
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "lily".into())
}

fn run_job<B: Backend>(
    eng: &Engine<B>,
    info: &ModelInfo,
    cache: &mut SessionCache<B>,
    job: Job,
    metrics: &Metrics,
) {
    let Job {
        req,
        events,
        cancel,
        enqueued,
    } = job;
    let queue_ms = enqueued.elapsed().as_secs_f64() * 1e3;
    if cancel.load(Ordering::Relaxed) {
        return; // the client left while queued
    }
    let prompt_tokens = req.prompt.len();
    let outcome = (|| -> engine::Result<GenSummary> {
        let (mut state, mut tokens) = match cache.acquire(&req.prompt, req.cache_key.as_deref()) {
            Some(hit) => hit,
            None => (eng.new_state(info.max_seq)?, Vec::new()),
        };
        let cached = tokens.len();
        let _ = events.send(GenEvent::Started {
            cached_tokens: cached,
            queue_ms,
        });
        let mut sampler = Sampler::new(req.sampling.clone());
        let mut on_token =
            |tok: u32| events.send(GenEvent::Token(tok)).is_ok() && !cancel.load(Ordering::Relaxed);
        let suffix = &req.prompt[cached..];
        // Also keep the state at the prompt minus its last token as an entry of its own, so a
        // repeated or regenerated request, or a next turn that renders this answer differently
        // (thinking history without reasoning_content), resumes from the whole prompt.
        let t_snapshot = std::time::Instant::now();
        let fed_before = if suffix.len() >= 2 {
            let head = &suffix[..suffix.len() - 1];
            eng.extend(head, &mut state)?;
            let snapshot = state.snapshot(&eng.backend)?;
            let prompt_head = req.prompt[..req.prompt.len() - 1].to_vec();
            cache.release(prompt_head, snapshot, req.cache_key.clone(), &eng.backend);
            head.len()
        } else {
            0
        };
        let head_secs = t_snapshot.elapsed().as_secs_f64();
        let result = eng.generate(
            &suffix[fed_before..],
            req.max_tokens,
            &info.stop_ids,
            &mut state,
            &mut sampler,
            &mut on_token,
        );
        let g = match result {
            Ok(g) => g,
            Err(e) => {
                // The state may be half-updated: it is dropped, never cached.
                return Err(e);
            }
        };
        tokens.extend_from_slice(suffix);
        tokens.extend_from_slice(&g.tokens[..g.decode_fed]);
        debug_assert_eq!(state.pos, tokens.len());
        if state.pos == tokens.len() {
            cache.release(tokens, state, req.cache_key.clone(), &eng.backend);
        }
        Ok(GenSummary {
            finish: Some(g.finish),
            prompt_tokens,
            cached_tokens: cached,
            prefilled_tokens: suffix.len(),
            completion_tokens: g.tokens.len(),
            queue_ms,
            prefill_ms: (head_secs + g.prefill_secs) * 1e3,
            decode_ms: g.decode_secs * 1e3,
        })
    })();
    match outcome {
        Ok(summary) => {
            metrics.record_generation(&summary);
            let _ = events.send(GenEvent::Done(summary));
        }
        Err(e) => {
            tracing::warn!("generation failed: {e}");
            let _ = events.send(GenEvent::Error(e.to_string()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(stream: &mut GenStream) -> (usize, Vec<u32>, GenSummary) {
        let mut cached = usize::MAX;
        let mut tokens = Vec::new();
        loop {
            match stream.events.blocking_recv() {
                Some(GenEvent::Started { cached_tokens, .. }) => cached = cached_tokens,
                Some(GenEvent::Token(t)) => tokens.push(t),
                Some(GenEvent::Done(s)) => return (cached, tokens, s),
                Some(GenEvent::Error(e)) => panic!("generation failed: {e}"),
                None => panic!("the engine dropped the stream"),
            }
        }
    }

    #[test]
    fn repeated_and_continued_prompts_resume_from_the_cache_with_identical_tokens() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tiny-qwen3_5_moe");
        let cfg = SchedulerConfig {
            device: crate::DeviceArg::Cpu,
            model_dir: dir,
            max_seq: 256,
            queue: 4,
            cache_bytes: Some(1 << 30),
            threads: 2,
        };
        let (sched, _engine) = Scheduler::start(cfg, Arc::new(Metrics::default()));
        while matches!(sched.status(), EngineStatus::Loading) {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(
            matches!(sched.status(), EngineStatus::Ready),
            "{:?}",
            sched.status()
        );
        let prompt: Vec<u32> = vec![
            248045, 846, 198, 12675, 1017, 0, 248046, 198, 248045, 74455, 198,
        ];
        let req = |p: &[u32]| GenRequest {
            prompt: p.to_vec(),
            max_tokens: 6,
            sampling: SamplingParams::greedy(),
            cache_key: None,
        };

        let (cached, first, s1) = collect(&mut sched.submit(req(&prompt)).expect("submit"));
        assert_eq!((cached, s1.prefilled_tokens), (0, prompt.len()));
        // The same request again: everything but the last prompt token comes from the cache,
        // and greedy decoding from the restored state gives the same tokens.
        let (cached, again, _) = collect(&mut sched.submit(req(&prompt)).expect("submit"));
        assert_eq!(cached, prompt.len() - 1);
        assert_eq!(again, first);
        // A continuation of prompt + answer resumes after the fed answer tokens.
        let mut next = prompt.clone();
        next.extend_from_slice(&first);
        next.extend_from_slice(&[198, 248045, 846]);
        let (cached, _, _) = collect(&mut sched.submit(req(&next)).expect("submit"));
        assert_eq!(
            cached,
            prompt.len() + first.len() - 1,
            "all but the last (unfed) answer token"
        );
    }
}
