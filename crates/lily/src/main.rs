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
    Auto,
    Cpu,
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

/// Loads the engine on the requested device.
pub fn load_engine(
    args: &ModelArgs,
) -> Result<engine::generate::Engine<engine::backend::cpu::CpuBackend>> {
    use anyhow::Context;
    let backend = engine::backend::cpu::CpuBackend::new(args.threads)?;
    let t = std::time::Instant::now();
    let name = {
        use engine::backend::Backend;
        backend.name()
    };
    let eng = engine::generate::Engine::load(&args.model, backend)
        .with_context(|| format!("loading {}", args.model.display()))?;
    tracing::info!(
        "loaded {} on {} in {:.2}s",
        args.model.display(),
        name,
        t.elapsed().as_secs_f64()
    );
    Ok(eng)
}
