//! Token selection from a logits row: greedy, or temperature sampling with top-k, top-p, min-p
//! and OpenAI presence/frequency penalties, from a seeded generator so that the same seed and
//! request give the same tokens.
//!
//! Order (as llama.cpp and vLLM apply them): penalties on the raw logits, then top-k, then the
//! temperature-scaled softmax, then top-p and min-p on those probabilities, then one draw.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::backend::cpu::reference::argmax;
use crate::backend::{Backend, DeviceSample, DeviceSampling};
use crate::error::Result;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 1.0 disables.
    pub top_p: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 0.0 disables.
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// None draws a fresh seed.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        }
    }
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
    pub fn has_penalties(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
    /// What the penalties subtract from the logit of a token generated `count` times (in f32,
    /// the product rounded before the sum: a device computes it the same way).
    pub fn penalty(&self, count: u32) -> f32 {
        self.presence_penalty + self.frequency_penalty * count as f32
    }
    /// Whether `choose` decides, whatever the row, by passes over it or from its
    /// `TOP_P_PREFILTER` best candidates: greedy, the whole vocabulary (with top-p or
    /// without), or a top-k of at most `TOP_P_PREFILTER`. A top-k between those can need more
    /// candidates sorted, which a device sampler leaves to the host.
    pub fn choice_is_bounded(&self, vocab: usize) -> bool {
        let limit = self.candidate_limit(vocab);
        self.is_greedy() || limit == vocab || limit <= TOP_P_PREFILTER
    }
    /// How many of a `vocab`-entry row's best logits top-k leaves to choose from (all without it).
    pub fn candidate_limit(&self, vocab: usize) -> usize {
        if self.top_k > 0 {
            self.top_k.min(vocab)
        } else {
            vocab
        }
    }
}

/// Candidates examined before falling back to a full sort for top-p: enough for any realistic
/// nucleus, and far cheaper than sorting a 248k vocabulary every step.
const TOP_P_PREFILTER: usize = 4096;

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// How often each token was generated so far (for the penalties).
    counts: HashMap<u32, u32>,
    /// `counts` by id, for a chained step's `DeviceSampling::generated`.
    generated: Vec<(u32, u32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Sampler {
            params,
            rng,
            counts: HashMap::new(),
            generated: Vec::new(),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a generated token (penalties count generated tokens only, as OpenAI does).
    pub fn accept(&mut self, token: u32) {
        *self.counts.entry(token).or_insert(0) += 1;
    }

    /// Whether `sample` needs the logits on the host (greedy without penalties does not).
    pub fn needs_logits(&self) -> bool {
        !self.params.is_greedy() || self.params.has_penalties()
    }

    /// Chooses the next token from `logits` (`[1, vocab]` on the backend) and records it:
    /// greedy without penalties takes the backend's argmax (only the id is read back); sampling
    /// runs on the backend where it can (`Backend::sample`), else the row is read to the host
    /// and sampled here. Both use the same draw from the seeded generator.
    pub fn pick<B: Backend>(&mut self, backend: &B, logits: &B::Tensor) -> Result<u32> {
        let token = if self.needs_logits() {
            let u = self.draw();
            let penalties = self.penalties();
            let request = DeviceSampling {
                params: &self.params,
                u,
                penalties: &penalties,
                generated: &[],
            };
            match backend.sample(logits, &request)? {
                DeviceSample::Chosen(token) => token,
                DeviceSample::RowNeeded { penalised } => {
                    let row = backend.download(logits)?;
                    let still_to_apply: &[(u32, f32)] = if penalised { &[] } else { &penalties };
                    choose_penalised(&self.params, &row, u, still_to_apply)
                }
            }
        } else {
            backend.argmax_row(logits)?
        };
        self.accept(token);
        Ok(token)
    }

    /// What a chained decode step chooses with on the device (`Backend::queue_decode_step`):
    /// the parameters, the next token's draw, and, for a step fed a host token (`host_fed`)
    /// with penalties, the counts so far (the device counts the tokens it chooses after that,
    /// so the other steps need none); `accept` each token once it is read.
    pub fn device_choice(&mut self, host_fed: bool) -> DeviceSampling<'_> {
        let u = self.draw();
        self.generated.clear();
        if host_fed && self.params.has_penalties() {
            self.generated
                .extend(self.counts.iter().map(|(&t, &n)| (t, n)));
            self.generated.sort_unstable();
        }
        DeviceSampling {
            params: &self.params,
            u,
            penalties: &[],
            generated: &self.generated,
        }
    }

    /// The one uniform draw a sampled token takes, in [0, 1): f64 for the whole-vocabulary
    /// paths (no top-k), f32 (widened exactly) for the candidates' path, as each sums its
    /// weights.
    fn draw(&mut self) -> f64 {
        if self.params.is_greedy() {
            0.0
        } else if self.params.top_k == 0 {
            self.rng.random::<f64>()
        } else {
            self.rng.random::<f32>() as f64
        }
    }

    /// What the penalties subtract from each generated token's logit.
    fn penalties(&self) -> Vec<(u32, f32)> {
        let p = &self.params;
        if !p.has_penalties() {
            return Vec::new();
        }
        let mut out: Vec<(u32, f32)> = self
            .counts
            .iter()
            .map(|(&tok, &n)| (tok, p.penalty(n)))
            .collect();
        out.sort_unstable_by_key(|&(tok, _)| tok);
        out
    }

    /// Chooses the next token from one logits row (drawing from the generator).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let u = self.draw();
        choose_penalised(&self.params, logits, u, &self.penalties())
    }
}

/// `choose` on the row with `penalties` (id, amount) subtracted first (none when the row has
/// them already).
pub fn choose_penalised(
    p: &SamplingParams,
    logits: &[f32],
    u: f64,
    penalties: &[(u32, f32)],
) -> u32 {
    if penalties.is_empty() {
        return choose(p, logits, u);
    }
    let mut row = logits.to_vec();
    for &(tok, amount) in penalties {
        if let Some(l) = row.get_mut(tok as usize) {
            *l -= amount;
        }
    }
    choose(p, &row, u)
}

/// The token `Sampler` picks from a logits row (penalties already applied) with the draw `u` in
/// [0, 1): the sampler's whole rule, without its generator, so that a backend's sampling can be
/// tested against it with the same draw.
pub fn choose(p: &SamplingParams, logits: &[f32], u: f64) -> u32 {
    if p.is_greedy() {
        return argmax(logits);
    }
    let limit = p.candidate_limit(logits.len());
    if limit == logits.len() {
        return if p.top_p >= 1.0 {
            sample_whole_vocabulary(p, logits, u)
        } else {
            sample_nucleus(p, logits, u)
        };
    }
    // Candidates (id, logit), best first, limited by top-k and the top-p prefilter.
    let mut cand = top_candidates(logits, limit.min(TOP_P_PREFILTER));
    let mut probs = softmax_scaled(&cand, p.temperature);
    if limit > cand.len() && p.top_p < 1.0 {
        // The prefilter is only exact if the nucleus fits inside it; check against the
        // full distribution and widen when it does not.
        let covered = covered_mass(logits, &cand, p.temperature);
        if covered < p.top_p {
            cand = top_candidates(logits, limit);
            probs = softmax_scaled(&cand, p.temperature);
        }
    } else if limit > cand.len() {
        cand = top_candidates(logits, limit);
        probs = softmax_scaled(&cand, p.temperature);
    }
    if cand.is_empty() {
        return argmax(logits); // every logit NaN
    }
    let mut keep = cand.len();
    if p.top_p < 1.0 {
        let mut acc = 0.0f32;
        for (i, pr) in probs.iter().enumerate() {
            acc += pr;
            if acc >= p.top_p {
                keep = i + 1;
                break;
            }
        }
    }
    if p.min_p > 0.0 {
        let floor = p.min_p * probs[0];
        keep = keep.min(probs.iter().take_while(|&&pr| pr >= floor).count().max(1));
    }
    let total: f32 = probs[..keep].iter().sum();
    let mut u = u as f32 * total;
    for (i, pr) in probs[..keep].iter().enumerate() {
        if u < *pr {
            return cand[i].0;
        }
        u -= pr;
    }
    cand[keep - 1].0
}

/// Temperature (and min-p) sampling over the whole vocabulary: one pass for the weights and
/// one draw, no sort (the OpenAI default `top_p = 1` must not cost a 248k-entry sort).
fn sample_whole_vocabulary(p: &SamplingParams, logits: &[f32], u: f64) -> u32 {
    let t = p.temperature;
    let m = valid_max(logits);
    let cutoff = min_p_cutoff(p, m);
    let weights: Vec<f32> = logits
        .iter()
        .map(|&l| {
            if l >= cutoff {
                ((l - m) / t).exp()
            } else {
                0.0
            }
        })
        .collect();
    let total: f64 = weights.iter().map(|&w| w as f64).sum();
    let mut u = u * total;
    let mut last = argmax(logits);
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            if u < w as f64 {
                return i as u32;
            }
            u -= w as f64;
            last = i as u32;
        }
    }
    last
}

/// The largest logit that is not NaN (-inf where there is none).
fn valid_max(logits: &[f32]) -> f32 {
    logits
        .iter()
        .copied()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, f32::max)
}

/// The logits that are not NaN, as (id, logit).
fn valid_logits(logits: &[f32]) -> Vec<(u32, f32)> {
    logits
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.is_nan())
        .map(|(i, &l)| (i as u32, l))
        .collect()
}

/// The order of candidates: the larger logit first, ties to the lower id.
fn best_first(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// min-p keeps tokens with p >= min_p * p_max, i.e. logit >= max + T ln(min_p) (-inf without
/// min-p).
fn min_p_cutoff(p: &SamplingParams, max: f32) -> f32 {
    if p.min_p > 0.0 {
        max + p.temperature * p.min_p.ln()
    } else {
        f32::NEG_INFINITY
    }
}

/// A weight in units of 2^-32 of the largest (which is 1): exact integers, so that the nucleus
/// and the draw add them in any order (a device's grid does) to the same sums.
fn fixed_weight(logit: f32, max: f32, temperature: f32) -> u64 {
    // `as` truncates, and takes NaN (an infinite maximum's own weight) to 0.
    (((logit - max) / temperature).exp() * 4_294_967_296.0) as u64
}

/// Top-p over the whole vocabulary (no top-k below it), exact and without sorting the row:
/// - each valid logit's weight exp((l - max) / T) in fixed point (`fixed_weight`), Z their sum;
/// - the nucleus: the best logits (ties to the lower id) until their weights reach
///   ceil(top_p * Z), the smallest such set;
/// - min-p then zeroes the members below max + T ln(min_p) (never the best);
/// - the draw t = floor(u * S), S the members' sum, picks the member whose interval of the
///   cumulative weights, in id order, holds t.
///
/// Every step is integer arithmetic on the weights, so the CUDA sampler's grid
/// (`sample_nucleus_*` in kernels/sample.cu) chooses the same token. An infinite logit leaves no
/// finite weight: the argmax then.
fn sample_nucleus(p: &SamplingParams, logits: &[f32], u: f64) -> u32 {
    let max = valid_max(logits);
    // Each weight once (an exp a logit); NaN weighs 0.
    let weights: Vec<u64> = logits
        .iter()
        .map(|&l| fixed_weight(l, max, p.temperature))
        .collect();
    let weight = |id: u32| weights[id as usize];
    let z: u64 = weights.iter().sum();
    if z == 0 {
        return argmax(logits);
    }
    let need = ((p.top_p as f64 * z as f64).ceil() as u64).clamp(1, z);
    // The nucleus, from the best `k` in order, k growing until their weights reach `need`.
    let mut valid = valid_logits(logits);
    let mut k = TOP_P_PREFILTER.min(valid.len());
    let members = loop {
        if k < valid.len() {
            valid.select_nth_unstable_by(k - 1, best_first);
        }
        valid[..k].sort_by(best_first);
        let mut mass = 0u64;
        let reached = valid[..k].iter().position(|&(id, _)| {
            mass += weight(id);
            mass >= need
        });
        if let Some(last) = reached {
            break &mut valid[..=last];
        }
        k = (k * 8).min(valid.len());
    };
    let cutoff = min_p_cutoff(p, max);
    members.sort_by_key(|&(id, _)| id);
    let member_weight = |(id, l): (u32, f32)| if l >= cutoff { weight(id) } else { 0 };
    let s: u64 = members.iter().map(|&m| member_weight(m)).sum();
    if s == 0 {
        return argmax(logits); // min-p above 1 (requests cannot ask for it)
    }
    let mut left = ((u * s as f64).floor() as u64).min(s - 1);
    for &(id, l) in members.iter() {
        let w = member_weight((id, l));
        if left < w {
            return id;
        }
        left -= w;
    }
    argmax(logits) // not reached: left < s
}

/// The `n` largest logits as (id, logit), sorted descending, ties to the lower id; NaN never
/// selected.
fn top_candidates(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut all = valid_logits(logits);
    let n = n.min(all.len()).max(1).min(all.len());
    if n < all.len() {
        all.select_nth_unstable_by(n - 1, best_first);
        all.truncate(n);
    }
    all.sort_by(best_first);
    all
}

fn softmax_scaled(cand: &[(u32, f32)], temperature: f32) -> Vec<f32> {
    let m = cand.first().map_or(0.0, |c| c.1);
    let e: Vec<f32> = cand
        .iter()
        .map(|c| ((c.1 - m) / temperature).exp())
        .collect();
    let z: f32 = e.iter().sum();
    e.into_iter().map(|x| x / z).collect()
}

/// Fraction of the full softmax mass held by `cand`.
fn covered_mass(logits: &[f32], cand: &[(u32, f32)], temperature: f32) -> f32 {
    let m = cand.first().map_or(0.0, |c| c.1);
    let total: f64 = logits
        .iter()
        .filter(|l| !l.is_nan())
        .map(|l| (((l - m) / temperature) as f64).exp())
        .sum();
    let part: f64 = cand
        .iter()
        .map(|c| (((c.1 - m) / temperature) as f64).exp())
        .sum();
    (part / total) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            seed: Some(7),
            ..Default::default()
        }
    }

    #[test]
    fn pick_through_a_backend_draws_and_penalises_as_sample_does() {
        use crate::backend::cpu::CpuBackend;
        let cpu = CpuBackend::new(1).expect("cpu backend");
        let logits: Vec<f32> = (0..3000).map(|i| ((i * 53) % 211) as f32 * 0.03).collect();
        let row = cpu.upload_tensor(&logits, 1, logits.len()).expect("upload");
        for p in [
            params(0.9),
            SamplingParams {
                top_k: 40,
                top_p: 0.9,
                presence_penalty: 0.4,
                frequency_penalty: 0.3,
                ..params(1.2)
            },
            SamplingParams {
                presence_penalty: 1.0,
                ..SamplingParams::greedy()
            },
        ] {
            let (mut a, mut b) = (Sampler::new(p.clone()), Sampler::new(p.clone()));
            let picked: Vec<u32> = (0..30).map(|_| a.pick(&cpu, &row).expect("pick")).collect();
            let sampled: Vec<u32> = (0..30)
                .map(|_| {
                    let t = b.sample(&logits);
                    b.accept(t);
                    t
                })
                .collect();
            assert_eq!(picked, sampled, "{p:?}");
            if p.has_penalties() {
                // The penalties pushed the first choices down, so the tokens vary.
                assert!(picked.iter().any(|&t| t != picked[0]), "{p:?}: {picked:?}");
            }
        }
    }

    #[test]
    fn greedy_is_the_first_argmax() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.0, 2.0, 2.0, 1.0]), 1);
        assert!(!s.needs_logits());
    }

    #[test]
    fn the_same_seed_gives_the_same_draws() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 * 0.05).collect();
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams {
                seed: Some(seed),
                ..params(1.0)
            });
            (0..50).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(1), draw(1));
        assert_ne!(draw(1), draw(2));
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let logits = [0.5, 3.0, 2.9, -1.0];
        let mut s = Sampler::new(SamplingParams {
            top_k: 1,
            ..params(1.0)
        });
        assert!((0..100).all(|_| s.sample(&logits) == 1));
        let mut s = Sampler::new(SamplingParams {
            top_p: 1e-6,
            ..params(1.0)
        });
        assert!((0..100).all(|_| s.sample(&logits) == 1));
        let mut s = Sampler::new(SamplingParams {
            min_p: 0.99,
            ..params(1.0)
        });
        assert!((0..100).all(|_| s.sample(&logits) == 1));
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // Two tokens with probabilities 0.2 and 0.8 at temperature 1.
        let logits = [0.0, 4f32.ln()];
        let mut s = Sampler::new(params(1.0));
        let n = 20_000;
        let ones = (0..n).filter(|_| s.sample(&logits) == 1).count();
        let f = ones as f64 / n as f64;
        assert!(
            (f - 0.8).abs() < 0.02,
            "frequency of the likelier token {f}"
        );
    }

    #[test]
    fn a_chain_gets_the_counts_at_its_host_fed_step_only() {
        let mut s = Sampler::new(SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..SamplingParams::greedy()
        });
        for t in [7, 3, 7, 9, 7] {
            s.accept(t);
        }
        assert_eq!(s.device_choice(true).generated, &[(3, 1), (7, 3), (9, 1)]);
        assert!(s.device_choice(false).generated.is_empty());
        assert_eq!(s.params().penalty(3), 0.5 + 0.25 * 3.0);
        let mut plain = Sampler::new(SamplingParams::greedy());
        plain.accept(7);
        assert!(plain.device_choice(true).generated.is_empty());
    }

    #[test]
    fn penalties_discourage_repeats() {
        let logits = [1.0, 0.9];
        let mut s = Sampler::new(SamplingParams {
            presence_penalty: 0.5,
            ..SamplingParams::greedy()
        });
        assert!(s.needs_logits());
        assert_eq!(s.sample(&logits), 0);
        s.accept(0);
        assert_eq!(s.sample(&logits), 1);
    }

    #[test]
    fn whole_vocabulary_sampling_follows_the_distribution_and_min_p() {
        // Three tokens with probabilities 0.1, 0.3, 0.6 at temperature 1; min_p 0.4 drops the first.
        let logits = [0.1f32.ln(), 0.3f32.ln(), 0.6f32.ln()];
        let mut s = Sampler::new(params(1.0));
        let n = 30_000;
        let mut counts = [0usize; 3];
        (0..n).for_each(|_| counts[s.sample(&logits) as usize] += 1);
        for (c, p) in counts.iter().zip([0.1, 0.3, 0.6]) {
            assert!(
                (*c as f64 / n as f64 - p).abs() < 0.015,
                "counts {counts:?}"
            );
        }
        let mut s = Sampler::new(SamplingParams {
            min_p: 0.4,
            ..params(1.0)
        });
        assert!((0..2000).all(|_| s.sample(&logits) != 0));
    }

    #[test]
    fn bounded_choices_are_those_the_candidates_or_one_pass_decide() {
        let vocab = 248_320;
        let with = |top_k, top_p| SamplingParams {
            top_k,
            top_p,
            ..params(0.7)
        };
        assert!(SamplingParams::greedy().choice_is_bounded(vocab));
        assert!(
            with(0, 1.0).choice_is_bounded(vocab),
            "the whole row, one pass"
        );
        assert!(
            with(vocab + 5, 1.0).choice_is_bounded(vocab),
            "top-k past the row"
        );
        assert!(with(20, 0.8).choice_is_bounded(vocab));
        assert!(with(TOP_P_PREFILTER, 0.5).choice_is_bounded(vocab));
        assert!(
            with(0, 0.95).choice_is_bounded(vocab),
            "top-p over the whole row, by passes"
        );
        assert!(!with(TOP_P_PREFILTER + 1, 1.0).choice_is_bounded(vocab));
        assert!(
            !with(TOP_P_PREFILTER + 1, 0.9).choice_is_bounded(vocab),
            "a nucleus may pass the prefilter"
        );
        assert!(
            with(TOP_P_PREFILTER + 1, 0.9).choice_is_bounded(TOP_P_PREFILTER + 1),
            "a top-k at the vocabulary is the whole row"
        );
    }

    /// How often each id is chosen over `n` draws.
    fn frequencies(p: &SamplingParams, logits: &[f32], n: usize) -> Vec<f64> {
        let mut s = Sampler::new(p.clone());
        let mut counts = vec![0usize; logits.len()];
        (0..n).for_each(|_| counts[s.sample(logits) as usize] += 1);
        counts.iter().map(|&c| c as f64 / n as f64).collect()
    }

    #[test]
    fn the_nucleus_is_the_smallest_set_reaching_top_p() {
        // Probabilities 0.05, 0.5, 0.15, 0.3 at temperature 1 (the best not first).
        let logits = [0.05f32.ln(), 0.5f32.ln(), 0.15f32.ln(), 0.3f32.ln()];
        let with = |top_p| SamplingParams {
            top_p,
            ..params(1.0)
        };
        let close = |got: &[f64], want: [f64; 4]| {
            got.iter()
                .zip(want)
                .all(|(g, w)| (g - w).abs() < 0.015 && (w > 0.0 || *g == 0.0))
        };
        let f = frequencies(&with(0.75), &logits, 20_000);
        assert!(close(&f, [0.0, 0.625, 0.0, 0.375]), "top-p 0.75: {f:?}");
        let f = frequencies(&with(0.85), &logits, 20_000);
        assert!(
            close(&f, [0.0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95]),
            "top-p 0.85: {f:?}"
        );
        let min_p = SamplingParams {
            min_p: 0.5,
            ..with(0.85)
        };
        let f = frequencies(&min_p, &logits, 20_000);
        assert!(close(&f, [0.0, 0.625, 0.0, 0.375]), "min-p 0.5: {f:?}");
    }

    #[test]
    fn the_nucleus_takes_tied_logits_by_lower_id() {
        // Ten equal logits: top-p 0.45 needs 4.5 of them, so five, the lowest ids.
        let logits = [1.5f32; 10];
        let p = SamplingParams {
            top_p: 0.45,
            ..params(0.8)
        };
        let f = frequencies(&p, &logits, 10_000);
        assert!(f[..5].iter().all(|&x| (x - 0.2).abs() < 0.02), "{f:?}");
        assert!(f[5..].iter().all(|&x| x == 0.0), "{f:?}");
    }

    #[test]
    fn the_nucleus_of_a_row_without_finite_weights_is_its_argmax() {
        let p = SamplingParams {
            top_p: 0.9,
            ..params(0.7)
        };
        let inf = f32::INFINITY;
        for (row, want) in [
            (vec![0.5, inf, 2.0, inf], 1),           // the first infinite logit
            (vec![-inf, -inf, -inf], 0),             // nothing finite at all
            (vec![f32::NAN, f32::NAN, 3.0, 1.0], 2), // NaN never chosen
        ] {
            for u in [0.0, 0.5, 0.999] {
                assert_eq!(choose(&p, &row, u), want, "{row:?}, u {u}");
            }
        }
        let all_nan = [f32::NAN; 4];
        assert!((choose(&p, &all_nan, 0.3) as usize) < all_nan.len());
    }

    /// `sample_nucleus` by its definition: the whole row sorted.
    fn nucleus_by_sorting(p: &SamplingParams, logits: &[f32], u: f64) -> u32 {
        let max = valid_max(logits);
        let w = |l: f32| fixed_weight(l, max, p.temperature);
        let mut all = valid_logits(logits);
        all.sort_by(best_first);
        let z: u64 = all.iter().map(|&(_, l)| w(l)).sum();
        let need = ((p.top_p as f64 * z as f64).ceil() as u64).clamp(1, z);
        let mut mass = 0;
        let mut members: Vec<(u32, f32)> = Vec::new();
        for &(i, l) in &all {
            if mass >= need {
                break;
            }
            mass += w(l);
            members.push((i, l));
        }
        members.sort_by_key(|m| m.0);
        let cutoff = min_p_cutoff(p, max);
        let weights: Vec<u64> = members
            .iter()
            .map(|&(_, l)| if l >= cutoff { w(l) } else { 0 })
            .collect();
        let s: u64 = weights.iter().sum();
        let mut t = ((u * s as f64).floor() as u64).min(s - 1);
        for (m, w) in members.iter().zip(weights) {
            if t < w {
                return m.0;
            }
            t -= w;
        }
        unreachable!()
    }

    #[test]
    fn the_nucleus_matches_its_definition_on_random_rows() {
        let mut rng = StdRng::seed_from_u64(5);
        for case in 0..60 {
            let n = [7, 300, 5_000, 40_000][case % 4];
            let mut row: Vec<f32> = (0..n).map(|_| rng.random::<f32>() * 8.0 - 4.0).collect();
            match case % 3 {
                0 => row.iter_mut().for_each(|l| *l = l.round()), // ties everywhere
                1 => row.iter_mut().step_by(11).for_each(|l| *l = f32::NAN),
                _ => row.iter_mut().for_each(|l| *l = l.powi(3)), // peaked
            }
            let p = SamplingParams {
                top_p: [0.3, 0.8, 0.95, 0.999][case % 4],
                min_p: [0.0, 0.0, 0.02][case % 3],
                ..params([0.5, 1.0, 1.7][case % 3])
            };
            for _ in 0..5 {
                let u = rng.random::<f64>();
                assert_eq!(
                    choose(&p, &row, u),
                    nucleus_by_sorting(&p, &row, u),
                    "case {case}, {p:?}, u {u}"
                );
            }
        }
    }

    #[test]
    fn top_p_beyond_the_prefilter_is_exact() {
        // A flat distribution over 10k tokens: the nucleus at 0.9 needs 9000 of them.
        let logits = vec![0.0f32; 10_000];
        let mut s = Sampler::new(SamplingParams {
            top_p: 0.9,
            ..params(1.0)
        });
        let max = (0..2000).map(|_| s.sample(&logits)).max().unwrap_or(0);
        assert!(
            max > TOP_P_PREFILTER as u32,
            "draws never left the prefilter (max id {max})"
        );
    }
}
