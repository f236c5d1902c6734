//! `lily bench`: lily's benchmark contract (prompt formula, timers, digest, JSON), so that
//! numbers are comparable with the original lily and with the peer harnesses.
//!
//! Prompt: `tok(i) = (i * 2654435761 mod 2^32) mod vocab`. Prefill is timed from the start of
//! prefill until the first token is known on the host; decode times `steps` single-token steps.
//! The digest is FNV-1a-64 over the `steps` tokens after the first; stop tokens are ignored.
//! Tokens are greedy unless `--temperature` asks for the server's sampler (seeded, so runs with
//! the same seed draw the same tokens).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use serde_json::json;

use engine::backend::ProfileMode;
use engine::sampler::{Sampler, SamplingParams};

use crate::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 256)]
    pub prompt_len: usize,
    /// Decode steps after the first token.
    #[arg(long, default_value_t = 64)]
    pub decode_steps: usize,
    /// Also write the JSON report to this file.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// After the timed run, time each kernel of one more decode step on its own, and each
    /// kernel of one prefill chunk where it runs (GPU only), and report the cost per kernel.
    #[arg(long)]
    pub profile: bool,
    /// Leave every launch of one kernel family (a prefix of its profile label, e.g.
    /// `gemv_batch_stream`) out of the recorded decode steps, to measure what the family costs
    /// inside the step against a run without this flag. The decoded tokens are then meaningless
    /// (GPU only).
    #[arg(long, value_name = "LABEL")]
    pub without_kernel: Option<String>,
    /// The state's capacity in positions, as `lily serve --max-seq` sizes it (default: the
    /// prompt and decode steps). Recorded decode steps size their attention grid for the
    /// power-of-two bucket of the context, capped at this.
    #[arg(long)]
    pub max_seq: Option<usize>,
    /// Pick tokens by sampling, as `lily serve` does for a request with this temperature
    /// (0: greedy, the contract's default).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling's probability mass (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Sample among the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Drop tokens below this fraction of the most likely one's probability (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Subtracted once from the logit of each token generated so far, as the API's
    /// `presence_penalty` (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Subtracted per generation of each token so far, as the API's `frequency_penalty` (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// The sampler's seed, so that runs draw the same tokens.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl BenchArgs {
    fn sampling(&self) -> Result<SamplingParams> {
        anyhow::ensure!(
            self.temperature.is_finite() && (0.0..=2.0).contains(&self.temperature),
            "--temperature must be between 0 and 2, got {}",
            self.temperature
        );
        anyhow::ensure!(
            self.top_p > 0.0 && self.top_p <= 1.0,
            "--top-p must be above 0 and at most 1, got {}",
            self.top_p
        );
        anyhow::ensure!(
            (0.0..1.0).contains(&self.min_p),
            "--min-p must be at least 0 and below 1, got {}",
            self.min_p
        );
        for (flag, v) in [
            ("--presence-penalty", self.presence_penalty),
            ("--frequency-penalty", self.frequency_penalty),
        ] {
            anyhow::ensure!(
                v.is_finite() && (-2.0..=2.0).contains(&v),
                "{flag} must be between -2 and 2, got {v}"
            );
        }
        Ok(SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: Some(self.seed),
        })
    }
}

pub fn bench_prompt(len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(2_654_435_761) % (1u64 << 32) % vocab as u64) as u32)
        .collect()
}

pub fn fnv1a64(tokens: &[u32]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in tokens {
        h = (h ^ t as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

pub fn run(a: BenchArgs) -> Result<()> {
    anyhow::ensure!(a.prompt_len >= 1, "--prompt-len must be at least 1");
    anyhow::ensure!(
        !(a.profile && a.without_kernel.is_some()),
        "--profile times every kernel of a whole step; --without-kernel leaves one family out: pass one of them"
    );
    let sampling = a.sampling()?;
    let device = crate::open_device(a.model.device, a.model.threads)?;
    crate::with_engine!(device, &a.model.model, |eng| bench_on(&eng, &a, &sampling))
}

fn bench_on<B: engine::backend::Backend>(
    eng: &engine::generate::Engine<B>,
    a: &BenchArgs,
    sampling: &SamplingParams,
) -> Result<()> {
    let vocab = eng.config().vocab_size;
    let prompt = bench_prompt(a.prompt_len, vocab);
    // One more position for the profiled step.
    let needed = a.prompt_len + a.decode_steps + 2;
    let max_seq = a.max_seq.unwrap_or(needed);
    anyhow::ensure!(
        max_seq >= needed,
        "--max-seq {max_seq} is below the {needed} positions the prompt and decode steps need"
    );

    if let Some(label) = &a.without_kernel {
        eng.backend.leave_out_of_decode(label)?;
        eprintln!(
            "--without-kernel {label}: left out of every recorded decode step; the decoded tokens are meaningless"
        );
    }

    // Warm-up on a throwaway state: one prefill chunk and two decode steps.
    {
        let warm = &prompt[..prompt.len().min(eng.prefill_chunk())];
        let mut st = eng.new_state(warm.len() + 3)?;
        let mut sampler = Sampler::new(sampling.clone());
        eng.generate(warm, 3, &[], &mut st, &mut sampler, &mut |_| true)?;
    }

    // The server's loop (`Engine::generate`), without stop tokens: prefill until the first token
    // is on the host, then `decode_steps` more, each timed from the token before it.
    let mut sampler = Sampler::new(sampling.clone());
    let chained = eng.chains_decode(&sampler);
    // Greedy without penalties: the contract's default, reported as "greedy".
    let plain_greedy = sampling.is_greedy() && !sampling.has_penalties();
    let mut state = eng.new_state(max_seq)?;
    let mut arrivals = Vec::with_capacity(a.decode_steps + 1);
    let g = eng.generate(
        &prompt,
        a.decode_steps + 1,
        &[],
        &mut state,
        &mut sampler,
        &mut |_| {
            arrivals.push(Instant::now());
            true
        },
    )?;
    anyhow::ensure!(
        g.tokens.len() == a.decode_steps + 1,
        "decode stopped after {} of {} tokens",
        g.tokens.len(),
        a.decode_steps + 1
    );
    let (prefill_secs, decode_secs) = (g.prefill_secs, g.decode_secs);
    let first = g.tokens[0];
    let tokens = g.tokens[1..].to_vec();
    let step_wall: Vec<f64> = arrivals
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64())
        .collect();
    let tok = *g.tokens.last().expect("at least one token");
    let (profile, prefill_profile) = if a.profile {
        let costs = eng.backend.profile(ProfileMode::Isolated, &mut || {
            // The step as the server takes it: its logits, then the sampler's choice from them.
            let lg = eng.decode_step(tok, &mut state)?;
            sampler.pick(&eng.backend, &lg).map(|_| ())
        })?;
        if costs.is_none() {
            eprintln!(
                "--profile: the {} backend has no kernels to time",
                eng.backend_name()
            );
        }
        let decode = costs.map(|c| {
            profile_report(
                "one decode step",
                "each launch of one decode step replayed alone: 20 copies in a CUDA graph, 5 replays; weights may hit L2 when they fit",
                &c,
                decode_secs / a.decode_steps.max(1) as f64,
            )
        });
        // The first chunk of the prompt on a fresh state (its attention sees only itself).
        let chunk = &prompt[..prompt.len().min(eng.prefill_chunk())];
        let mut fresh = eng.new_state(chunk.len())?;
        let t = Instant::now();
        let costs = eng.backend.profile(ProfileMode::InPlace, &mut || {
            eng.prefill(chunk, &mut fresh).map(|_| ())
        })?;
        let chunk_secs = t.elapsed().as_secs_f64();
        let prefill = costs.map(|c| {
            profile_report(
                &format!("one prefill chunk of {} tokens", chunk.len()),
                "each launch of the first prefill chunk timed where it ran, by events around it",
                &c,
                chunk_secs,
            )
        });
        (decode, prefill)
    } else {
        (None, None)
    };

    let report = json!({
        "schema_version": 1,
        "meta": {
            "engine": "lily",
            "crate_version": env!("CARGO_PKG_VERSION"),
            "source_id": option_env!("LILY_BENCH_SOURCE_ID").unwrap_or("unknown"),
            "harness": "lily bench",
            "device": eng.backend_name(),
            "model": a.model.model.display().to_string(),
        },
        "workload": {
            "prompt_len": a.prompt_len,
            "prompt_kind": "u32_golden_ratio_hash_mod_vocab",
            "decode_steps": a.decode_steps,
            // chained: each step queued before the token of the one before it is read.
            "decode_mode": if chained { "chained" } else { "sequential" },
            "max_seq": max_seq,
            "without_kernel": a.without_kernel,
            "sampling": if plain_greedy {
                json!("greedy")
            } else {
                json!({
                    "temperature": sampling.temperature,
                    "top_p": sampling.top_p,
                    "top_k": sampling.top_k,
                    "min_p": sampling.min_p,
                    "presence_penalty": sampling.presence_penalty,
                    "frequency_penalty": sampling.frequency_penalty,
                    "seed": a.seed,
                })
            },
        },
        "results": {
            "prefill": {
                "wall_secs": prefill_secs,
                "tok_s": a.prompt_len as f64 / prefill_secs,
                "first_token_id": first,
            },
            "decode": {
                "wall_secs": decode_secs,
                "tok_s": a.decode_steps as f64 / decode_secs,
                "step_wall_secs": step_wall,
                "token_digest": fnv1a64(&tokens),
                "token_ids": tokens,
            },
        },
        "profile": profile,
        "prefill_profile": prefill_profile,
    });
    let text = serde_json::to_string_pretty(&report)?;
    if let Some(p) = &a.json_out {
        std::fs::write(p, &text)?;
    }
    println!("{text}");
    eprintln!(
        "prompt {} tokens: prefill {:.1} tok/s ({:.3} s); decode {:.2} tok/s over {} steps{}; digest {}",
        a.prompt_len,
        a.prompt_len as f64 / prefill_secs,
        prefill_secs,
        a.decode_steps as f64 / decode_secs,
        a.decode_steps,
        if plain_greedy {
            String::new()
        } else {
            format!(
                " (sampled: temperature {}, top-p {}, top-k {}, min-p {}{})",
                sampling.temperature,
                sampling.top_p,
                sampling.top_k,
                sampling.min_p,
                if sampling.has_penalties() {
                    format!(
                        ", presence penalty {}, frequency penalty {}",
                        sampling.presence_penalty, sampling.frequency_penalty
                    )
                } else {
                    String::new()
                }
            )
        },
        fnv1a64(&tokens)
    );
    Ok(())
}

/// The profile as JSON, with a table on stderr: kernels by total time, against the measured
/// wall time of what was profiled.
fn profile_report(
    what: &str,
    method: &str,
    costs: &[engine::backend::KernelCost],
    step_secs: f64,
) -> serde_json::Value {
    let total_us: f64 = costs.iter().map(|c| c.micros).sum();
    let launches: usize = costs.iter().map(|c| c.launches).sum();
    let bytes: u64 = costs.iter().map(|c| c.weight_bytes).sum();
    eprintln!(
        "profile of {what}: {launches} launches, {total_us:.0} us summed \
         ({:.0} us measured), {:.2} GB of weights",
        step_secs * 1e6,
        bytes as f64 / 1e9
    );
    eprintln!(
        "{:>9} {:>6} {:>8} {:>8}  kernel",
        "us", "count", "us/each", "GB/s"
    );
    for c in costs {
        let gbs = if c.weight_bytes > 0 {
            format!("{:.0}", c.weight_bytes as f64 / (c.micros * 1e3))
        } else {
            "-".into()
        };
        eprintln!(
            "{:>9.1} {:>6} {:>8.2} {:>8}  {}",
            c.micros,
            c.launches,
            c.micros / c.launches as f64,
            gbs,
            c.kernel
        );
    }
    json!({
        "what": what,
        "method": method,
        "step_us_measured": step_secs * 1e6,
        "sum_alone_us": total_us,
        "launches": launches,
        "weight_bytes": bytes,
        "kernels": costs.iter().map(|c| json!({
            "kernel": c.kernel, "launches": c.launches, "us": c.micros, "weight_bytes": c.weight_bytes,
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_formula_matches_the_contract() {
        // i * 2654435761 mod 2^32, then mod vocab.
        assert_eq!(
            bench_prompt(3, 248_320),
            vec![
                0,
                2_654_435_761 % 248_320,
                ((2u64 * 2_654_435_761) % (1 << 32) % 248_320) as u32
            ]
        );
    }

    fn tiny_args(json_out: &std::path::Path, temperature: f32, seed: u64) -> BenchArgs {
        BenchArgs {
            model: ModelArgs {
                model: PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                    .join("../../tests/fixtures/tiny-qwen3_5_moe"),
                device: crate::DeviceArg::Cpu,
                threads: 2,
            },
            prompt_len: 8,
            decode_steps: 12,
            json_out: Some(json_out.to_path_buf()),
            profile: false,
            without_kernel: None,
            max_seq: None,
            temperature,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed,
        }
    }

    fn decoded(path: &std::path::Path) -> (serde_json::Value, Vec<u64>) {
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).expect("report")).expect("json");
        let ids = report["results"]["decode"]["token_ids"]
            .as_array()
            .expect("token ids")
            .iter()
            .map(|t| t.as_u64().expect("id"))
            .collect();
        (report["workload"]["sampling"].clone(), ids)
    }

    #[test]
    fn sampled_runs_repeat_with_their_seed_and_differ_from_greedy() {
        let dir = std::env::temp_dir().join(format!("lily-bench-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let out = |name: &str| dir.join(name);
        run(tiny_args(&out("greedy.json"), 0.0, 0)).expect("greedy bench");
        run(tiny_args(&out("a.json"), 1.5, 7)).expect("sampled bench");
        run(tiny_args(&out("b.json"), 1.5, 7)).expect("sampled bench again");
        let (greedy_mode, greedy) = decoded(&out("greedy.json"));
        let (mode, a) = decoded(&out("a.json"));
        let (_, b) = decoded(&out("b.json"));
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!(greedy_mode, serde_json::json!("greedy"));
        assert_eq!(mode["temperature"], serde_json::json!(1.5));
        assert_eq!(mode["seed"], serde_json::json!(7));
        assert_eq!(a, b, "the same seed draws the same tokens");
        // Twelve draws at temperature 1.5 over the tiny model's broad distribution all landing
        // on the argmax would mean the sampler was never used.
        assert_ne!(a, greedy, "sampled tokens equal the greedy ones");
    }

    #[test]
    fn bad_sampling_flags_are_named() {
        let mut a = tiny_args(std::path::Path::new("unused.json"), 0.7, 0);
        a.top_p = 0.0;
        let err = run(a).expect_err("top-p 0").to_string();
        assert!(err.contains("--top-p"), "{err}");
        let err = run(tiny_args(std::path::Path::new("unused.json"), -1.0, 0))
            .expect_err("negative temperature")
            .to_string();
        assert!(err.contains("--temperature"), "{err}");
        let mut a = tiny_args(std::path::Path::new("unused.json"), 0.7, 0);
        a.frequency_penalty = 2.5;
        let err = run(a).expect_err("frequency penalty 2.5").to_string();
        assert!(err.contains("--frequency-penalty"), "{err}");
    }

    #[test]
    fn penalised_runs_report_their_penalties_and_decode_mode() {
        let dir = std::env::temp_dir().join(format!("lily-bench-pen-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("pen.json");
        let mut a = tiny_args(&path, 0.0, 0);
        a.presence_penalty = 1.5;
        run(a).expect("penalised bench");
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("report")).expect("json");
        std::fs::remove_dir_all(&dir).ok();
        let workload = &report["workload"];
        assert_eq!(
            workload["sampling"]["presence_penalty"],
            serde_json::json!(1.5)
        );
        // The CPU backend never chains its steps (a GPU chains penalised ones too).
        assert_eq!(workload["decode_mode"], serde_json::json!("sequential"));
    }

    #[test]
    fn fnv1a64_of_known_values() {
        assert_eq!(fnv1a64(&[]), "cbf29ce484222325");
        // One step by hand: (basis ^ 1) * prime mod 2^64.
        let h = (0xcbf2_9ce4_8422_2325u64 ^ 1).wrapping_mul(0x100000001b3);
        assert_eq!(fnv1a64(&[1]), format!("{h:016x}"));
    }
}
