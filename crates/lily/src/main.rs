//! The `lily` binary: serve (the OpenAI-compatible server), generate, bench and synth.

mod api;
mod bench;
mod cpu_bench;
mod generate_cmd;
mod metrics;
mod scheduler;
mod serve;
mod session_cache;
mod synth_cmd;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "lily",
    version,
    about = "Fast, exact inference for Qwen hybrid MoE models"
)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// `lily --model DIR [--bind ADDR] [--max-seq N] ...` is `lily serve ...`.
    #[command(flatten)]
    serve: Option<serve::ServeArgs>,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum DeviceArg {
    /// The GPU when one is usable (driver, NVRTC, compute capability 8.0+), else the CPU.
    Auto,
    Cpu,
    /// The first GPU; an error when none is usable.
    Cuda,
}

/// The backend a command runs on.
pub enum Device {
    Cpu(engine::backend::cpu::CpuBackend),
    Cuda(Box<engine::backend::cuda::CudaBackend>),
}

/// Opens the requested device; `auto` says in the log which one it took and why.
pub fn open_device(device: DeviceArg, threads: usize) -> Result<Device> {
    use anyhow::Context;
    use engine::backend::cpu::CpuBackend;
    use engine::backend::cuda::CudaBackend;
    let cpu = || -> Result<Device> { Ok(Device::Cpu(CpuBackend::new(threads)?)) };
    match device {
        DeviceArg::Cpu => cpu(),
        DeviceArg::Cuda => CudaBackend::new(0)
            .map(|b| Device::Cuda(Box::new(b)))
            .context("--device cuda: no usable GPU"),
        DeviceArg::Auto => match CudaBackend::new(0) {
            Ok(b) => {
                tracing::info!("device auto: using the GPU");
                Ok(Device::Cuda(Box::new(b)))
            }
            Err(e) => {
                tracing::info!("device auto: no usable GPU ({e}); using the CPU");
                cpu()
            }
        },
    }
}

/// Runs `$body` with `$eng` bound to the engine loaded on `$device` (one copy per backend).
#[macro_export]
macro_rules! with_engine {
    ($device:expr, $dir:expr, |$eng:ident| $body:expr) => {
        match $device {
            $crate::Device::Cpu(b) => {
                let $eng = $crate::load_engine_on($dir, b)?;
                $body
            }
            $crate::Device::Cuda(b) => {
                let $eng = $crate::load_engine_on($dir, *b)?;
                $body
            }
        }
    };
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible HTTP API (also the default: `lily --model DIR`).
    Serve(serve::ServeArgs),
    /// Generate greedily from a prompt.
    Generate(generate_cmd::GenerateArgs),
    /// Measure prefill and decode speed (lily's bench contract).
    Bench(bench::BenchArgs),
    /// Measure this machine's memory bandwidth and the CPU 4-bit matrix-vector product.
    BenchCpu(cpu_bench::CpuBenchArgs),
    /// Write a random-weight checkpoint of the qwen3_5_moe family in the mlx-community layout.
    Synth(synth_cmd::SynthArgs),
}

/// Common options for commands that load a model.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// Checkpoint directory (config.json, safetensors, tokenizer files).
    #[arg(long)]
    pub model: PathBuf,
    /// Compute device.
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    pub device: DeviceArg,
    /// CPU threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LILY_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result: Result<()> = match (cli.command, cli.serve) {
        (Some(Command::Serve(a)), _) | (None, Some(a)) => serve::run(a),
        (None, None) => {
            let _ = <Cli as clap::CommandFactory>::command().print_help();
            std::process::exit(2);
        }
        (Some(Command::Generate(a)), _) => generate_cmd::run(a),
        (Some(Command::Bench(a)), _) => bench::run(a),
        (Some(Command::BenchCpu(a)), _) => cpu_bench::run(a),
        (Some(Command::Synth(a)), _) => synth_cmd::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Loads the checkpoint in `dir` onto `backend`, logging the time it took.
pub fn load_engine_on<B: engine::backend::Backend>(
    dir: &std::path::Path,
    backend: B,
) -> Result<engine::generate::Engine<B>> {
    use anyhow::Context;
    let t = std::time::Instant::now();
    let name = backend.name();
    let eng = engine::generate::Engine::load(dir, backend)
        .with_context(|| format!("loading {}", dir.display()))?;
    tracing::info!(
        "loaded {} on {} in {:.2}s",
        dir.display(),
        name,
        t.elapsed().as_secs_f64()
    );
    Ok(eng)
}
