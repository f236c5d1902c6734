//! End to end against mlx-lm's f32 goldens on identical weights (tests/fixtures, made by
//! tools/golden/make_fixtures.sh). Two paths share one decode state type and must both agree:
//! prefill-then-decode, and decode-only (every prompt token fed as a one-token step).
//!
//! Greedy tokens must equal the golden's up to the first step whose golden top-1/top-2 margin
//! is under `MARGIN_TOL` (past a near-tie the paths may legitimately diverge), and the golden's
//! top-10 logits must agree within `LOGIT_TOL` at every compared step.

use std::path::PathBuf;

use common::cuda_or_skip;

use engine::backend::Backend;
use engine::backend::cpu::CpuBackend;
use engine::generate::Engine;
use engine::sampler::{Sampler, SamplingParams};
use serde_json::Value;

mod common;

const LOGIT_TOL: f32 = 1e-3;
/// A step is compared token for token only where the golden's margin exceeds this: twice the
/// logit tolerance, so that errors within tolerance cannot swap the top two.
const MARGIN_TOL: f32 = 2.0 * LOGIT_TOL;

/// The fixtures folder; `LILY_TEST_FIXTURES` overrides it for a test binary run elsewhere
/// (the GPU machine runs binaries built on another machine).
fn fixture(name: &str) -> PathBuf {
    std::env::var_os("LILY_TEST_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"))
        .join(name)
}

fn golden(name: &str) -> Value {
    let p = fixture(name).join("golden/golden_f32.json");
    let text =
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
    serde_json::from_str(&text).expect("golden JSON")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// Compares one logits row with a golden step record; returns the max |Δ| over its top-10.
fn compare_step(what: &str, row: &[f32], step: &Value) -> f32 {
    let gids = ids(&step["ids"]);
    let glog: Vec<f32> = step["logits"]
        .as_array()
        .expect("logits")
        .iter()
        .map(|x| x.as_f64().expect("f") as f32)
        .collect();
    let mut worst = 0.0f32;
    for (id, g) in gids.iter().zip(&glog) {
        let d = (row[*id as usize] - g).abs();
        worst = worst.max(d);
        assert!(
            d <= LOGIT_TOL,
            "{what}: logit of token {id} is {} vs golden {g} (|Δ| {d:e} > {LOGIT_TOL:e})",
            row[*id as usize]
        );
    }
    worst
}

enum Path {
    PrefillThenDecode,
    DecodeOnly,
}

/// Runs one golden case greedily along `path`; returns (steps compared token-for-token, worst |Δ|).
fn run_case<B: Backend>(eng: &Engine<B>, name: &str, case: &Value, path: &Path) -> (usize, f32) {
    let prompt = ids(&case["prompt_ids"]);
    let golden_ids = ids(&case["generated_ids"]);
    let steps = case["steps"].as_array().expect("steps");
    let mut state = eng
        .new_state(prompt.len() + golden_ids.len() + 1)
        .expect("state");
    let mut logits = match path {
        Path::PrefillThenDecode => eng.prefill(&prompt, &mut state).expect("prefill"),
        Path::DecodeOnly => {
            let mut last = None;
            for &t in &prompt {
                last = Some(eng.decode_step(t, &mut state).expect("decode"));
            }
            last.expect("non-empty prompt")
        }
    };
    let mut worst = 0.0f32;
    let mut compared = 0;
    for (j, step) in steps.iter().enumerate() {
        let row = eng.backend.download(&logits).expect("download logits");
        let what = format!("{name} step {j}");
        worst = worst.max(compare_step(&what, &row, step));
        let margin = step["margin_top1_top2"].as_f64().expect("margin") as f32;
        let tok = eng.argmax(&logits).expect("argmax");
        if tok != golden_ids[j] {
            // Only a near-tie in the golden may excuse a different token; the paths part here.
            assert!(
                margin < MARGIN_TOL,
                "{what}: greedy token {tok} != golden {} (margin {margin:e})",
                golden_ids[j]
            );
            eprintln!(
                "{what}: golden margin {margin:e} < {MARGIN_TOL:e} and the tokens differ; compared up to here"
            );
            break;
        }
        compared += 1;
        if j + 1 < steps.len() {
            logits = eng.decode_step(tok, &mut state).expect("decode");
        }
    }
    assert_eq!(
        state.pos,
        prompt.len() + compared.min(steps.len() - 1),
        "{name}: state position"
    );
    (compared, worst)
}

fn check_fixture<B: Backend>(backend: B, dir: &str, min_cases: usize) {
    let eng = Engine::load(&fixture(dir), backend).expect("load fixture");
    let dev = eng.backend_name();
    let g = golden(dir);
    let cases = g["cases"].as_object().expect("cases");
    assert!(
        cases.len() >= min_cases,
        "{dir}: golden has {} cases",
        cases.len()
    );
    for (name, case) in cases {
        for path in [Path::PrefillThenDecode, Path::DecodeOnly] {
            let label = match path {
                Path::PrefillThenDecode => "prefill+decode",
                Path::DecodeOnly => "decode-only",
            };
            let (n, worst) = run_case(&eng, &format!("{dir}/{name} ({label})"), case, &path);
            eprintln!(
                "{dev} {dir}/{name} ({label}): {n} greedy tokens identical, worst top-10 |Δlogit| {worst:.2e}"
            );
            assert!(
                n >= 4,
                "{dir}/{name}: only {n} steps compared; the golden has too many near-ties"
            );
        }
    }
}

fn cpu() -> CpuBackend {
    CpuBackend::new(0).expect("pool")
}

#[test]
fn tiny_fixture_matches_mlx_f32_golden() {
    check_fixture(cpu(), "tiny-qwen3_5_moe", 6);
}

#[test]
fn tiny_alt_shape_matches_mlx_f32_golden() {
    check_fixture(cpu(), "tiny-alt", 2);
}

#[test]
fn cuda_tiny_fixture_matches_mlx_f32_golden() {
    if let Some(b) = cuda_or_skip("cuda_tiny_fixture_matches_mlx_f32_golden") {
        check_fixture(b, "tiny-qwen3_5_moe", 6);
    }
}

#[test]
fn cuda_tiny_alt_shape_matches_mlx_f32_golden() {
    if let Some(b) = cuda_or_skip("cuda_tiny_alt_shape_matches_mlx_f32_golden") {
        check_fixture(b, "tiny-alt", 2);
    }
}

#[test]
fn every_prompt_position_matches_the_full_forward() {
    all_positions(cpu());
}

#[test]
fn cuda_every_prompt_position_matches_the_full_forward() {
    if let Some(b) = cuda_or_skip("cuda_every_prompt_position_matches_the_full_forward") {
        all_positions(b);
    }
}

fn all_positions<B: Backend>(backend: B) {
    // For two prompts the golden records the top-5 logits at every prompt position (mlx-lm's
    // no-cache forward): this checks causal masking and positions inside one prefill.
    let dir = "tiny-qwen3_5_moe";
    let g = golden(dir);
    let cases = g["cases"].as_object().expect("cases");
    let with_layers: Vec<_> = cases
        .iter()
        .filter(|(_, c)| c.get("prefill_all_positions_top5").is_some())
        .collect();
    assert!(
        !with_layers.is_empty(),
        "golden has no all-position records"
    );
    let eng = Engine::load(&fixture(dir), backend).expect("load fixture");
    for (name, case) in with_layers {
        let prompt = ids(&case["prompt_ids"]);
        let mut state = eng.new_state(prompt.len()).expect("state");
        let all = eng
            .model
            .forward(
                &eng.backend,
                &prompt,
                &mut state,
                engine::model::qwen3_5_moe::Logits::All,
            )
            .expect("forward")
            .expect("all logits");
        let all = eng.backend.download(&all).expect("download logits");
        // Every prompt position's top-5 logits (a no-cache full forward in mlx-lm).
        let vocab = eng.config().vocab_size;
        for (p, rec) in case["prefill_all_positions_top5"]
            .as_array()
            .expect("top5")
            .iter()
            .enumerate()
        {
            compare_step(
                &format!("{name} position {p}"),
                &all[p * vocab..(p + 1) * vocab],
                rec,
            );
        }
    }
}

#[test]
fn cuda_recorded_decode_steps_match_the_cpu_across_context_buckets() {
    // Decode steps on CUDA are recorded once per context bucket (powers of two from 1,024)
    // and replayed; this crosses the first bucket boundary and compares every step's logits
    // with the CPU engine on the same tokens.
    let Some(gpu) = cuda_or_skip("cuda_recorded_decode_steps_match_the_cpu_across_context_buckets")
    else {
        return;
    };
    let dir = fixture("tiny-qwen3_5_moe");
    let gpu = Engine::load(&dir, gpu).expect("load on cuda");
    let cpu = Engine::load(&dir, cpu()).expect("load on cpu");
    let vocab = cpu.config().vocab_size as u64;
    let prompt: Vec<u32> = (0..1000u64)
        .map(|i| ((i * 2_654_435_761) % (1 << 32) % vocab) as u32)
        .collect();
    let steps = 40;
    let mut sg = gpu.new_state(prompt.len() + steps + 1).expect("state");
    let mut sc = cpu.new_state(prompt.len() + steps + 1).expect("state");
    let mut lg = gpu.prefill(&prompt, &mut sg).expect("prefill");
    let mut lc = cpu.prefill(&prompt, &mut sc).expect("prefill");
    let mut worst = 0.0f32;
    for step in 0..steps {
        let (g, c) = (
            gpu.backend.download(&lg).expect("download"),
            cpu.backend.download(&lc).expect("download"),
        );
        let d = g
            .iter()
            .zip(&c)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        worst = worst.max(d);
        assert!(d <= LOGIT_TOL, "step {step}: max |Δlogit| {d:e}");
        // Both continue with the CPU's choice, so a near-tie cannot split the sequences.
        let tok = cpu.argmax(&lc).expect("argmax");
        lg = gpu.decode_step(tok, &mut sg).expect("decode");
        lc = cpu.decode_step(tok, &mut sc).expect("decode");
    }
    assert_eq!(sg.pos, sc.pos);
    eprintln!("recorded decode over positions 1000..1040: worst |Δlogit| {worst:.2e}");
}

#[test]
fn chained_decode_matches_stepwise_decode_on_the_cpu() {
    // The CPU backend chains steps only when asked (`CpuBackend::chaining`): the loop and what
    // it does to the state, checked where there is no GPU.
    let cpu = CpuBackend::chaining(2).expect("cpu backend");
    let eng = Engine::load(&fixture("tiny-qwen3_5_moe"), cpu).expect("load");
    chained_decode_matches_stepwise_decode(&eng, 24, 12);
}

#[test]
fn cuda_chained_decode_matches_stepwise_decode() {
    // On the GPU each step is queued before the token of the one before it is read, the device
    // feeding its own choice. 1,000 prompt tokens: the chained steps cross the first context
    // bucket, so a step is recorded anew while the one before it is still queued.
    let Some(gpu) = cuda_or_skip("cuda_chained_decode_matches_stepwise_decode") else {
        return;
    };
    let eng = Engine::load(&fixture("tiny-qwen3_5_moe"), gpu).expect("load on cuda");
    chained_decode_matches_stepwise_decode(&eng, 1000, 40);
}

/// Chained decode (`Engine::generate` where the backend chains) against one step at a time on
/// the same backend, for greedy and sampled choices: the same tokens, the same state; then a
/// stop token, which the chained state has consumed (its step was queued before it was read).
fn chained_decode_matches_stepwise_decode<B: Backend>(
    eng: &Engine<B>,
    prompt_len: u64,
    max_tokens: usize,
) {
    let vocab = eng.config().vocab_size as u64;
    let prompt: Vec<u32> = (0..prompt_len)
        .map(|i| ((i * 2_654_435_761) % (1 << 32) % vocab) as u32)
        .collect();
    let params = [
        SamplingParams::greedy(),
        SamplingParams {
            temperature: 1.0,
            seed: Some(5),
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.8,
            seed: Some(6),
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            seed: Some(7),
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            seed: Some(8),
            ..Default::default()
        },
        // Penalties, counted on the device. Random weights seldom repeat a token, so a negative
        // presence penalty (past the API's -2) draws the generated tokens back and a frequency
        // penalty then pushes each away after a few repeats: the counts decide every choice.
        SamplingParams {
            presence_penalty: -30.0,
            frequency_penalty: 8.0,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.8,
            presence_penalty: -30.0,
            frequency_penalty: 9.0,
            seed: Some(9),
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.5,
            top_p: 0.9,
            presence_penalty: -20.0,
            frequency_penalty: 6.0,
            seed: Some(10),
            ..Default::default()
        },
    ];
    let capacity = prompt.len() + max_tokens + 1;
    for p in params {
        let mut chained = Sampler::new(p.clone());
        if !eng.chains_decode(&chained) {
            eprintln!("SKIPPED: {p:?} is not chained here (LILY_CUDA_CHAIN=0?)");
            continue;
        }
        let mut sa = eng.new_state(capacity).expect("state");
        let g = eng
            .generate(&prompt, max_tokens, &[], &mut sa, &mut chained, &mut |_| {
                true
            })
            .expect("chained generate");
        // One step at a time: decode_step, then the sampler reads back its choice.
        let mut stepwise = Sampler::new(p.clone());
        let mut sb = eng.new_state(capacity).expect("state");
        let logits = eng.prefill(&prompt, &mut sb).expect("prefill");
        let mut want = vec![stepwise.pick(&eng.backend, &logits).expect("pick")];
        while want.len() < max_tokens {
            let logits = eng
                .decode_step(*want.last().unwrap(), &mut sb)
                .expect("step");
            want.push(stepwise.pick(&eng.backend, &logits).expect("pick"));
        }
        assert_eq!(g.tokens, want, "{p:?}");
        if p.has_penalties() {
            let distinct: std::collections::HashSet<_> = g.tokens.iter().collect();
            assert!(distinct.len() < g.tokens.len(), "{p:?}: no token repeated");
        }
        assert_eq!(g.decode_fed, max_tokens - 1, "the last token is not fed");
        assert_eq!(sa.pos, sb.pos);

        // Stop at the 11th token's first appearance: the state has consumed it, and the next
        // step from there equals the stepwise state's, fed the same tokens.
        let stop = g.tokens[10];
        let first_stop = g.tokens.iter().position(|&t| t == stop).unwrap();
        let mut sampler = Sampler::new(p.clone());
        let mut sc = eng.new_state(capacity).expect("state");
        let s = eng
            .generate(
                &prompt,
                max_tokens,
                &[stop],
                &mut sc,
                &mut sampler,
                &mut |_| true,
            )
            .expect("generate to a stop");
        assert_eq!(s.tokens, g.tokens[..=first_stop], "{p:?}");
        assert_eq!(
            s.decode_fed,
            s.tokens.len(),
            "the stop token's step was queued"
        );
        assert_eq!(sc.pos, prompt.len() + s.tokens.len());
        let mut sd = eng.new_state(capacity).expect("state");
        eng.prefill(&prompt, &mut sd).expect("prefill");
        for &t in &s.tokens {
            eng.decode_step(t, &mut sd).expect("step");
        }
        let next = 7;
        let c = eng
            .backend
            .download(&eng.decode_step(next, &mut sc).expect("step"));
        let d = eng
            .backend
            .download(&eng.decode_step(next, &mut sd).expect("step"));
        assert_eq!(
            c.expect("download"),
            d.expect("download"),
            "{p:?}: after the stop"
        );
        eprintln!(
            "chained {p:?}: {} tokens equal to stepwise; stopped after {}",
            g.tokens.len(),
            s.tokens.len()
        );
    }
}
