//! Negative log-likelihoods, KL divergences and their summaries, with llama-perplexity's
//! conventions: softmax sums in f64 over `exp(logit - max)` in f32; KL(base || model) summed over
//! the tokens whose base log-probability is above -16 (the rest are below what the base file's
//! 16-nat range keeps); "same top" compares the first maximum of each; uncertainties are the
//! standard error of the mean.

use super::logits_file::BaseRow;

/// The normalizer of one logit row: its first maximum and log-sum-exp.
#[derive(Debug, Clone, Copy)]
pub struct RowNorm {
    pub max: f32,
    pub argmax: usize,
    pub log_sum_exp: f32,
}

impl RowNorm {
    pub fn of(logits: &[f32]) -> RowNorm {
        let (mut max, mut argmax) = (logits[0], 0);
        for (i, &v) in logits.iter().enumerate().skip(1) {
            if v > max {
                (max, argmax) = (v, i);
            }
        }
        let sum: f64 = logits.iter().map(|&v| ((v - max).exp()) as f64).sum();
        RowNorm {
            max,
            argmax,
            log_sum_exp: sum.ln() as f32,
        }
    }

    /// `-log p(tok)`.
    pub fn nll(&self, logits: &[f32], tok: usize) -> f64 {
        (self.max + self.log_sum_exp - logits[tok]) as f64
    }

    /// `log p(i)`.
    pub fn log_prob(&self, logits: &[f32], i: usize) -> f32 {
        logits[i] - self.max - self.log_sum_exp
    }
}

/// Sum and sum of squares of a per-token quantity.
#[derive(Debug, Clone, Copy, Default)]
pub struct Moments {
    pub sum: f64,
    pub sum2: f64,
}

impl Moments {
    pub fn add(&mut self, v: f64) {
        self.sum += v;
        self.sum2 += v * v;
    }

    /// Mean over `n` values and its standard error (0 for 10 values or fewer, as llama does).
    pub fn mean_err(&self, n: usize) -> (f64, f64) {
        if n == 0 {
            return (0.0, 0.0);
        }
        let mean = self.sum / n as f64;
        let var = self.sum2 / n as f64 - mean * mean;
        let err = if var > 0.0 && n > 10 {
            (var / (n - 1) as f64).sqrt()
        } else {
            0.0
        };
        (mean, err)
    }
}

/// Running perplexity: the negative log-likelihood of each scored token.
#[derive(Debug, Clone, Default)]
pub struct Perplexity {
    pub nll: Moments,
    pub count: usize,
}

impl Perplexity {
    /// Adds a chunk: `rows` logit rows of `vocab`, row `j` predicting `targets[j]`.
    pub fn add_rows(&mut self, logits: &[f32], targets: &[u32], vocab: usize) {
        let nll: Vec<f64> = crate::backend::cpu::pool().install(|| {
            use rayon::prelude::*;
            logits
                .par_chunks_exact(vocab)
                .zip(targets)
                .map(|(row, &t)| RowNorm::of(row).nll(row, t as usize))
                .collect()
        });
        for v in nll {
            self.nll.add(v);
        }
        self.count += targets.len();
    }

    /// `(ppl, its uncertainty)`: exp of the mean NLL; the error is `ppl` times the mean's
    /// standard error (llama-perplexity's "Final estimate" line).
    pub fn ppl(&self) -> (f64, f64) {
        let n = self.count.max(1) as f64;
        let mean = self.nll.sum / n;
        let var = self.nll.sum2 / n - mean * mean;
        let err = if var > 0.0 && self.count > 1 {
            (var / (n - 1.0)).sqrt()
        } else {
            0.0
        };
        (mean.exp(), mean.exp() * err)
    }
}

/// One scored token against the base distribution.
#[derive(Debug, Clone, Copy)]
pub struct TokenKl {
    pub nll: f64,
    pub nll_base: f64,
    pub kld: f64,
    /// `p(tok) - p_base(tok)`.
    pub p_diff: f64,
    pub same_top: bool,
}

/// KL(base || model) at one position: `row` the model's logits, `base` the saved distribution.
pub fn token_kl(row: &[f32], base: &BaseRow<'_>, tok: usize) -> TokenKl {
    let norm = RowNorm::of(row);
    let nll = norm.nll(row, tok);
    let nll_base = -(base.log_prob(tok) as f64);
    let mut kld = 0.0f64;
    let (mut base_max, mut base_argmax) = (f32::NEG_INFINITY, 0);
    for i in 0..row.len() {
        let lb = base.log_prob(i);
        if i == 0 || lb > base_max {
            (base_max, base_argmax) = (lb, i);
        }
        if lb > -16.0 {
            kld += (lb.exp() * (lb - norm.log_prob(row, i))) as f64;
        }
    }
    TokenKl {
        nll,
        nll_base,
        kld,
        p_diff: (-nll).exp() - (-nll_base).exp(),
        same_top: norm.argmax == base_argmax,
    }
}

/// Everything `--kl-base` reports, accumulated token by token.
#[derive(Debug, Clone, Default)]
pub struct KlStats {
    pub nll: Moments,
    pub nll_base: Moments,
    pub nll_cross: f64,
    pub kld: Moments,
    pub p_diff: Moments,
    pub p_diff2: Moments,
    pub same_top: usize,
    pub klds: Vec<f32>,
    pub p_diffs: Vec<f32>,
}

impl KlStats {
    pub fn add(&mut self, t: TokenKl) {
        self.nll.add(t.nll);
        self.nll_base.add(t.nll_base);
        self.nll_cross += t.nll * t.nll_base;
        self.kld.add(t.kld);
        self.p_diff.add(t.p_diff);
        self.p_diff2.add(t.p_diff * t.p_diff);
        self.same_top += t.same_top as usize;
        self.klds.push(t.kld as f32);
        self.p_diffs.push(t.p_diff as f32);
    }

    pub fn count(&self) -> usize {
        self.klds.len()
    }

    /// The summary llama-perplexity prints after `--kl-divergence`.
    pub fn summary(&self) -> KlSummary {
        let n = self.count();
        let (ln_ppl, ln_ppl_err) = self.nll.mean_err(n);
        let (ln_base, ln_base_err) = self.nll_base.mean_err(n);
        // Covariance of the two mean log-perplexities (they are measured on the same tokens).
        let cov = if n < 10 {
            0.0
        } else {
            (self.nll_cross / n as f64 - ln_ppl * ln_base) / (n - 1) as f64
        };
        let ln_ratio = ln_ppl - ln_base;
        let ln_ratio_err = (ln_ppl_err.powi(2) + ln_base_err.powi(2) - 2.0 * cov)
            .max(0.0)
            .sqrt();
        let (ppl, ppl_base) = (ln_ppl.exp(), ln_base.exp());
        let (ppl_err, ppl_base_err) = (ppl * ln_ppl_err, ppl_base * ln_base_err);
        let ppl_diff_err = (ppl_err.powi(2) + ppl_base_err.powi(2) - 2.0 * ppl * ppl_base * cov)
            .max(0.0)
            .sqrt();
        let (mse, mse_err) = self.p_diff2.mean_err(n);
        let rms = mse.sqrt();
        let same = self.same_top as f64 / n.max(1) as f64;
        let mut klds = self.klds.clone();
        klds.sort_by(f32::total_cmp);
        let mut p_diffs = self.p_diffs.clone();
        p_diffs.sort_by(f32::total_cmp);
        KlSummary {
            count: n,
            ppl: (ppl, ppl_err),
            ppl_base: (ppl_base, ppl_base_err),
            ln_ppl_ratio: (ln_ratio, ln_ratio_err),
            ppl_ratio: (ln_ratio.exp(), ln_ratio.exp() * ln_ratio_err),
            ppl_diff: (ppl - ppl_base, ppl_diff_err),
            ln_ppl_cor: if ln_ppl_err > 0.0 && ln_base_err > 0.0 {
                cov / (ln_ppl_err * ln_base_err)
            } else {
                0.0
            },
            kld: self.kld.mean_err(n),
            kld_quantiles: Quantiles::of(&klds),
            p_diff: self.p_diff.mean_err(n),
            p_diff_quantiles: Quantiles::of(&p_diffs),
            rms_p_diff: (rms, if rms > 0.0 { 0.5 / rms * mse_err } else { 0.0 }),
            same_top: (
                same,
                (same * (1.0 - same) / (n.saturating_sub(1).max(1)) as f64).sqrt(),
            ),
        }
    }
}

/// Values (mean, uncertainty) of the KL summary.
#[derive(Debug, Clone)]
pub struct KlSummary {
    pub count: usize,
    pub ppl: (f64, f64),
    pub ppl_base: (f64, f64),
    pub ln_ppl_ratio: (f64, f64),
    pub ppl_ratio: (f64, f64),
    pub ppl_diff: (f64, f64),
    pub ln_ppl_cor: f64,
    pub kld: (f64, f64),
    pub kld_quantiles: Quantiles,
    pub p_diff: (f64, f64),
    pub p_diff_quantiles: Quantiles,
    pub rms_p_diff: (f64, f64),
    /// Fraction of tokens whose most likely next token is the base's.
    pub same_top: (f64, f64),
}

/// The fractions llama-perplexity reports percentiles at, highest first ("Median" is 0.5).
pub const FRACTIONS: [(f64, &str); 13] = [
    (1.0, "max"),
    (0.999, "99.9"),
    (0.99, "99.0"),
    (0.95, "95.0"),
    (0.90, "90.0"),
    (0.75, "75.0"),
    (0.5, "median"),
    (0.25, "25.0"),
    (0.10, "10.0"),
    (0.05, "5.0"),
    (0.01, "1.0"),
    (0.001, "0.1"),
    (0.0, "min"),
];

/// Percentiles of sorted values at [`FRACTIONS`].
#[derive(Debug, Clone, Default)]
pub struct Quantiles(pub Vec<(&'static str, f64)>);

impl Quantiles {
    pub fn of(sorted: &[f32]) -> Quantiles {
        if sorted.is_empty() {
            return Quantiles::default();
        }
        Quantiles(
            FRACTIONS
                .iter()
                .map(|&(f, name)| (name, percentile(sorted, f)))
                .collect(),
        )
    }

    pub fn get(&self, name: &str) -> f64 {
        self.0
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(f64::NAN, |p| p.1)
    }
}

/// Linear interpolation between the closest ranks at `fraction * (n - 1)`; the median of an
/// even count is the mean of the middle two (the same value).
pub fn percentile(sorted: &[f32], fraction: f64) -> f64 {
    let n = sorted.len();
    let p = fraction.clamp(0.0, 1.0) * (n - 1) as f64;
    let i = p.floor() as usize;
    let w = p - i as f64;
    let next = sorted[(i + 1).min(n - 1)] as f64;
    (1.0 - w) * sorted[i] as f64 + w * next
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_of_a_uniform_row_is_log_vocab() {
        let row = vec![0.5f32; 8];
        let n = RowNorm::of(&row);
        assert!((n.nll(&row, 3) - 8f64.ln()).abs() < 1e-6);
        assert_eq!(n.argmax, 0);
    }

    #[test]
    fn perplexity_of_known_probabilities() {
        // Two rows over 2 tokens: p(target) = 0.5 and 1/(1+e).
        let logits = [0.0f32, 0.0, 1.0, 0.0];
        let mut p = Perplexity::default();
        p.add_rows(&logits, &[0, 1], 2);
        let want = ((2f64.ln() + (1.0 + 1f64.exp()).ln()) / 2.0).exp();
        assert!((p.ppl().0 - want).abs() < 1e-5, "{:?}", p.ppl());
    }

    #[test]
    fn percentiles_interpolate() {
        let v = [0.0f32, 1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 0.5), 2.0);
        assert!((percentile(&v, 0.1) - 0.4).abs() < 1e-12);
        assert_eq!(percentile(&v, 1.0), 4.0);
        assert_eq!(percentile(&[7.0], 0.99), 7.0);
    }
}
