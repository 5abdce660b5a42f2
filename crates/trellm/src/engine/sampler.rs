//! mlx-lm's logits processors and sampling filters, in mlx-lm's order:
//! logit bias, repetition, presence and frequency penalties (processors, on logits); then
//! `logprobs = logits - logsumexp(logits)`; then top-p, min-p, top-k (filters, on logprobs); then
//! a categorical draw at `1/temp` (or argmax at temp 0).

use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::backend::cpu;

#[derive(Debug, Clone)]
pub struct SamplerParams {
    pub temp: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub min_tokens_to_keep: usize,
    pub top_k: usize,
    pub logit_bias: Vec<(u32, f32)>,
    pub repetition_penalty: Option<f32>,
    pub repetition_context_size: usize,
    pub presence_penalty: Option<f32>,
    pub presence_context_size: usize,
    pub frequency_penalty: Option<f32>,
    pub frequency_context_size: usize,
    pub seed: Option<u64>,
}

/// The sampling a model's files recommend (Hugging Face `generation_config.json`, GGUF
/// `general.sampling.*`): a server's values for fields a request leaves unset. Values outside
/// their ranges are dropped (a file cannot make every request fail).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

impl SamplingDefaults {
    fn checked(self) -> Self {
        let within =
            |v: Option<f32>, lo: f32, hi: f32| v.filter(|x| x.is_finite() && (lo..=hi).contains(x));
        SamplingDefaults {
            temperature: within(self.temperature, 0.0, 100.0),
            top_p: within(self.top_p, f32::MIN_POSITIVE, 1.0),
            top_k: self.top_k.filter(|&k| k <= 1 << 20),
            min_p: within(self.min_p, 0.0, 1.0),
            repetition_penalty: within(self.repetition_penalty, f32::MIN_POSITIVE, 100.0),
        }
    }

    pub fn from_hf(generation: &serde_json::Value) -> Self {
        let f = |k: &str| {
            generation
                .get(k)
                .and_then(serde_json::Value::as_f64)
                .map(|v| v as f32)
        };
        SamplingDefaults {
            temperature: f("temperature"),
            top_p: f("top_p"),
            top_k: generation
                .get("top_k")
                .and_then(serde_json::Value::as_u64)
                .map(|k| k as usize),
            min_p: f("min_p"),
            repetition_penalty: f("repetition_penalty"),
        }
        .checked()
    }

    pub fn from_gguf(g: &trellm_formats::gguf::Gguf) -> Self {
        let f = |k: &str| g.get_f32(&format!("general.sampling.{k}"));
        SamplingDefaults {
            temperature: f("temp"),
            top_p: f("top_p"),
            top_k: g.get_u64("general.sampling.top_k").map(|k| k as usize),
            min_p: f("min_p"),
            repetition_penalty: f("penalty_repeat"),
        }
        .checked()
    }
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            temp: 0.0,
            top_p: 0.0,
            min_p: 0.0,
            min_tokens_to_keep: 1,
            top_k: 0,
            logit_bias: Vec::new(),
            repetition_penalty: None,
            repetition_context_size: 20,
            presence_penalty: None,
            presence_context_size: 20,
            frequency_penalty: None,
            frequency_context_size: 20,
            seed: None,
        }
    }
}

impl SamplerParams {
    /// Rejects values mlx-lm rejects, with the same ranges.
    pub fn validate(&self, vocab: usize) -> Result<()> {
        if !self.temp.is_finite() || self.temp < 0.0 {
            bail!("--temp must be a non-negative number, got {}", self.temp);
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            bail!("--top-p must be in [0, 1], got {}", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            bail!("--min-p must be in [0, 1], got {}", self.min_p);
        }
        if self.min_tokens_to_keep < 1 {
            bail!("--min-tokens-to-keep must be at least 1");
        }
        if self.top_k >= vocab {
            bail!(
                "--top-k must be below the vocabulary size ({vocab}), got {}",
                self.top_k
            );
        }
        if let Some(p) = self.repetition_penalty {
            if !p.is_finite() || p < 0.0 {
                bail!("--repetition-penalty must be a non-negative number, got {p}");
            }
        }
        for (name, p) in [
            ("--presence-penalty", self.presence_penalty),
            ("--frequency-penalty", self.frequency_penalty),
        ] {
            if p.is_some_and(|p| !p.is_finite()) {
                bail!("{name} must be a finite number");
            }
        }
        for &(id, b) in &self.logit_bias {
            if id as usize >= vocab {
                bail!("logit bias token id {id} is outside the vocabulary (size {vocab})");
            }
            if !b.is_finite() {
                bail!("logit bias for token {id} must be finite");
            }
        }
        Ok(())
    }
}

pub struct Sampler {
    p: SamplerParams,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(p: SamplerParams) -> Self {
        let rng = match p.seed {
            Some(s) => ChaCha8Rng::seed_from_u64(s),
            None => ChaCha8Rng::from_entropy(),
        };
        Sampler { p, rng }
    }

    /// Applies the processors to `logits` given every token so far (prompt and generated), then
    /// turns them into log-probabilities in place. These are the logprobs mlx-lm reports.
    pub fn logprobs(&self, logits: &mut [f32], history: &[u32]) {
        let p = &self.p;
        for &(id, b) in &p.logit_bias {
            logits[id as usize] += b;
        }
        if let Some(pen) = p.repetition_penalty.filter(|&x| x != 0.0) {
            let ctx = tail(history, p.repetition_context_size);
            // Every occurrence is set from the unpenalized value, so duplicates count once.
            let orig: Vec<f32> = ctx.iter().map(|&t| logits[t as usize]).collect();
            for (&t, &v) in ctx.iter().zip(&orig) {
                logits[t as usize] = if v < 0.0 { v * pen } else { v / pen };
            }
        }
        if let Some(pen) = p.presence_penalty.filter(|&x| x != 0.0) {
            let ctx = tail(history, p.presence_context_size);
            let orig: Vec<f32> = ctx.iter().map(|&t| logits[t as usize]).collect();
            for (&t, &v) in ctx.iter().zip(&orig) {
                logits[t as usize] = v - pen;
            }
        }
        if let Some(pen) = p.frequency_penalty.filter(|&x| x != 0.0) {
            for &t in tail(history, p.frequency_context_size) {
                logits[t as usize] -= pen;
            }
        }
        cpu::log_softmax(logits);
    }

    /// Filters and draws from log-probabilities (as returned by [`Sampler::logprobs`]).
    pub fn sample(&mut self, logprobs: &[f32]) -> u32 {
        let p = &self.p;
        if p.temp == 0.0 {
            return argmax(logprobs);
        }
        let mut lp = logprobs.to_vec();
        if 0.0 < p.top_p && p.top_p < 1.0 {
            apply_top_p(&mut lp, p.top_p);
        }
        if p.min_p != 0.0 {
            apply_min_p(&mut lp, p.min_p, p.min_tokens_to_keep);
        }
        if p.top_k > 0 {
            apply_top_k(&mut lp, p.top_k);
        }
        self.categorical(&lp, 1.0 / p.temp)
    }

    /// A draw with probabilities `e^(lp * inv_temp)` (normalized; -inf entries never drawn).
    fn categorical(&mut self, lp: &[f32], inv_temp: f32) -> u32 {
        const CHUNK: usize = 4096;
        let m = cpu::max(lp);
        let mut weights = vec![0.0f32; lp.len()];
        cpu::exp_weights(lp, m, inv_temp, &mut weights);
        // Chunk sums first: the walk then skips whole chunks.
        let sums: Vec<f64> = weights
            .chunks(CHUNK)
            .map(|c| c.iter().map(|&w| w as f64).sum())
            .collect();
        let total: f64 = sums.iter().sum();
        let mut u = self.rng.gen::<f64>() * total;
        for (c, &cs) in sums.iter().enumerate() {
            if u >= cs {
                u -= cs;
                continue;
            }
            for (i, &w) in weights[c * CHUNK..].iter().take(CHUNK).enumerate() {
                if w > 0.0 {
                    if u < w as f64 {
                        return (c * CHUNK + i) as u32;
                    }
                    u -= w as f64;
                }
            }
        }
        argmax(lp)
    }
}

fn tail(h: &[u32], n: usize) -> &[u32] {
    &h[h.len().saturating_sub(n)..]
}

/// The first index of the maximum, as `argmax` does.
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Keeps the smallest set of most likely tokens whose mass reaches `top_p` of the total, with
/// mlx-lm's arithmetic: sorted ascending, mass strictly above each entry, threshold by count.
///
/// Only entries within [`TOP_P_NATS`] of the largest are sorted: the running f32 sum taken from
/// the top already holds the largest probability, and each smaller one is below half its ulp,
/// so adding them changes no sum and they are always dropped; the rest is radix-sorted. The
/// result is the full comparison sort's ([`apply_top_p_full`]) bit for bit; on gemma-3's 262k
/// vocabulary (111k candidates) 3 ms instead of 9 a token.
pub fn apply_top_p(lp: &mut [f32], top_p: f32) {
    let top = cpu::max(lp);
    let floor = top - TOP_P_NATS;
    let mut candidates: Vec<f32> = lp.iter().copied().filter(|&v| v >= floor).collect();
    // A radix sort, in `f32::total_cmp` order: several times a comparison sort on 100k entries.
    radsort::sort(&mut candidates);
    let threshold = top_p_threshold(&candidates, top_p);
    for v in lp.iter_mut() {
        if *v < threshold {
            *v = f32::NEG_INFINITY;
        }
    }
}

/// How far below the largest log-probability an entry still can move the sums: e^-20 is 15
/// times below 2^-25, under half an f32 ulp of any sum holding the largest probability.
const TOP_P_NATS: f32 = 20.0;

/// The smallest value `apply_top_p` keeps, from (at least) its candidates sorted ascending.
fn top_p_threshold(sorted: &[f32], top_p: f32) -> f32 {
    let probs: Vec<f32> = sorted.iter().map(|v| v.exp()).collect();
    let n = probs.len();
    let mut mass_above = vec![0.0f32; n];
    let mut acc = 0.0f32;
    for i in (0..n).rev() {
        mass_above[i] = acc;
        acc += probs[i];
    }
    let total = mass_above[0] + probs[0];
    let dropped = mass_above.iter().filter(|&&m| m >= top_p * total).count();
    sorted[dropped.min(n - 1)]
}

/// [`apply_top_p`] sorting every entry with a comparison sort: the slow exact twin it is tested
/// against.
pub fn apply_top_p_full(lp: &mut [f32], top_p: f32) {
    let mut sorted = lp.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let threshold = top_p_threshold(&sorted, top_p);
    for v in lp.iter_mut() {
        if *v < threshold {
            *v = f32::NEG_INFINITY;
        }
    }
}

/// Drops tokens whose probability is below `min_p` times the top token's.
pub fn apply_min_p(lp: &mut [f32], min_p: f32, min_keep: usize) {
    let top = cpu::max(lp);
    let cut = top + (min_p as f64).ln() as f32;
    let keep: Vec<usize> = if min_keep > 1 {
        top_indices(lp, min_keep)
    } else {
        Vec::new()
    };
    for (i, v) in lp.iter_mut().enumerate() {
        if *v < cut && !keep.contains(&i) {
            *v = f32::NEG_INFINITY;
        }
    }
}

/// Keeps the `k` most likely tokens.
pub fn apply_top_k(lp: &mut [f32], k: usize) {
    if k >= lp.len() {
        return;
    }
    let keep = top_indices(lp, k);
    let mut mask = vec![false; lp.len()];
    for i in keep {
        mask[i] = true;
    }
    for (v, m) in lp.iter_mut().zip(mask) {
        if !m {
            *v = f32::NEG_INFINITY;
        }
    }
}

/// Indices of the `k` largest values, largest first (ties broken by lower index).
pub fn top_indices(x: &[f32], k: usize) -> Vec<usize> {
    let k = k.min(x.len());
    if k == 0 {
        return Vec::new();
    }
    let mut idx: Vec<usize> = (0..x.len()).collect();
    let cmp = |a: &usize, b: &usize| x[*b].total_cmp(&x[*a]).then(a.cmp(b));
    idx.select_nth_unstable_by(k - 1, cmp);
    idx.truncate(k);
    idx.sort_by(cmp);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_defaults_come_from_generation_config_within_range() {
        let g = serde_json::json!({"do_sample": true, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                   "repetition_penalty": -1.0, "min_p": 2.0});
        let d = SamplingDefaults::from_hf(&g);
        assert_eq!(d.temperature, Some(0.6));
        assert_eq!(d.top_p, Some(0.9));
        assert_eq!(d.top_k, Some(20));
        // Out of range: dropped, so a request without the field still works.
        assert_eq!((d.repetition_penalty, d.min_p), (None, None));
        assert_eq!(
            SamplingDefaults::from_hf(&serde_json::json!({"eos_token_id": 2})),
            SamplingDefaults::default()
        );
    }

    /// Draws follow `p^(1/temp)` (normalized) and never pick a filtered (-inf) entry.
    #[test]
    fn categorical_frequencies() {
        let p = [0.5f32, 0.3, 0.2];
        let mut lp: Vec<f32> = p.iter().map(|v| v.ln()).collect();
        lp.push(f32::NEG_INFINITY);
        // Spread over chunks of the walk: a long tail of filtered entries in between.
        lp.splice(1..1, std::iter::repeat_n(f32::NEG_INFINITY, 9000));
        for temp in [1.0f32, 0.5] {
            let mut s = Sampler::new(SamplerParams {
                temp,
                seed: Some(7),
                ..Default::default()
            });
            let n = 40_000;
            let mut counts = [0usize; 3];
            for _ in 0..n {
                match s.sample(&lp) {
                    0 => counts[0] += 1,
                    9001 => counts[1] += 1,
                    9002 => counts[2] += 1,
                    other => panic!("drew filtered entry {other}"),
                }
            }
            let w: Vec<f32> = p.iter().map(|v| v.powf(1.0 / temp)).collect();
            let z: f32 = w.iter().sum();
            for (c, wi) in counts.iter().zip(&w) {
                let f = *c as f32 / n as f32;
                assert!((f - wi / z).abs() < 0.01, "temp {temp}: {counts:?}");
            }
        }
    }

    /// The candidate-only top-p equals the full sort on peaked, flat and tied distributions over
    /// a 262k vocabulary, for many thresholds.
    #[test]
    fn top_p_candidates_match_the_full_sort() {
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32
        };
        for (spread, peak) in [(30.0f32, 0.0f32), (3.0, 0.0), (60.0, 25.0), (0.0, 0.0)] {
            let mut lp: Vec<f32> = (0..262_144).map(|_| next() * spread).collect();
            lp[1234] += peak;
            cpu::log_softmax(&mut lp);
            for top_p in [0.05f32, 0.5, 0.9, 0.95, 0.999, 0.9999999] {
                let (mut a, mut b) = (lp.clone(), lp.clone());
                apply_top_p(&mut a, top_p);
                apply_top_p_full(&mut b, top_p);
                assert!(
                    a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "spread {spread} peak {peak} top_p {top_p}"
                );
            }
        }
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        // probs 0.5, 0.3, 0.15, 0.05
        let mut lp: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        apply_top_p(&mut lp, 0.7);
        assert!(lp[0].is_finite() && lp[1].is_finite());
        assert!(lp[2] == f32::NEG_INFINITY && lp[3] == f32::NEG_INFINITY);
    }

    #[test]
    fn min_p_is_relative_to_the_top() {
        let mut lp: Vec<f32> = [0.6f32, 0.3, 0.05, 0.05].iter().map(|p| p.ln()).collect();
        apply_min_p(&mut lp, 0.2, 1);
        assert!(lp[1].is_finite() && lp[2] == f32::NEG_INFINITY);
        let mut lp: Vec<f32> = [0.6f32, 0.3, 0.06, 0.04].iter().map(|p| p.ln()).collect();
        apply_min_p(&mut lp, 0.9, 3);
        assert!(lp[2].is_finite() && lp[3] == f32::NEG_INFINITY);
    }

    #[test]
    fn top_k_and_argmax() {
        let mut lp = vec![-3.0, -1.0, -2.0, -0.5];
        apply_top_k(&mut lp, 2);
        assert_eq!(lp, vec![f32::NEG_INFINITY, -1.0, f32::NEG_INFINITY, -0.5]);
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1);
    }

    #[test]
    fn penalties_follow_mlx_lm() {
        let s = Sampler::new(SamplerParams {
            repetition_penalty: Some(2.0),
            presence_penalty: Some(0.5),
            frequency_penalty: Some(0.25),
            logit_bias: vec![(3, 1.0)],
            ..Default::default()
        });
        let mut logits = vec![2.0, -2.0, 1.0, 0.0];
        // Before log-softmax: bias on 3; tokens 0,1,1 seen: rep -> 1.0, -4.0; presence once ->
        // 0.5, -4.5; frequency per hit -> 0.25, -5.0.
        s.logprobs(&mut logits, &[0, 1, 1]);
        let expect = [0.25f32, -5.0, 1.0, 1.0];
        let lse = expect.iter().map(|v| v.exp()).sum::<f32>().ln();
        for (a, b) in logits.iter().zip(expect) {
            assert!((a - (b - lse)).abs() < 1e-6);
        }
    }

    #[test]
    fn seeded_sampling_repeats() {
        let lp: Vec<f32> = [0.25f32; 4].iter().map(|p| p.ln()).collect();
        let draw = |seed| {
            let mut s = Sampler::new(SamplerParams {
                temp: 1.0,
                seed: Some(seed),
                ..Default::default()
            });
            (0..32).map(|_| s.sample(&lp)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }
}
