//! Flag checks that run before anything is downloaded or loaded, so a careless value fails in
//! a moment with a message naming the flag (values that need the model, such as a logit bias's
//! token id against the vocabulary, are checked again once it is loaded).

use anyhow::{bail, Result};

use super::SamplingArgs;
use crate::model::config::LIMITS;

/// Tokens `--min-tokens-to-keep` may ask for: min-p keeps them by a scan per token, and no
/// sampler needs more.
pub const MAX_MIN_TOKENS_TO_KEEP: usize = 1024;

/// Sampling values with the ranges mlx-lm accepts, against the largest vocabulary trellm loads.
pub fn check_sampling(s: &SamplingArgs) -> Result<()> {
    if s.min_tokens_to_keep > MAX_MIN_TOKENS_TO_KEEP {
        bail!(
            "--min-tokens-to-keep must be between 1 and {MAX_MIN_TOKENS_TO_KEEP}, got {}",
            s.min_tokens_to_keep
        );
    }
    s.params()?.validate(LIMITS.vocab)
}

/// `--threads`: at least 1, at most the machine's cores (more only time-slice the same cores
/// and, far beyond, exhaust the process's threads); a larger value is capped with a notice.
pub fn check_threads(threads: Option<usize>) -> Result<Option<usize>> {
    let Some(n) = threads else {
        return Ok(None);
    };
    if n == 0 {
        bail!("--threads must be at least 1");
    }
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    if n > cores {
        eprintln!(
            "trellm: --threads {n} is more than the {cores} cores of this machine; using {cores}"
        );
        return Ok(Some(cores));
    }
    Ok(Some(n))
}

/// A count of tokens or runs given on the command line: at most `max`.
pub fn check_count(flag: &str, v: usize, max: usize) -> Result<usize> {
    if v > max {
        bail!("{flag} must be at most {max}, got {v}");
    }
    Ok(v)
}

/// Top-K log-probabilities a step may report: at most the vocabulary.
pub fn check_logprobs(flag: &str, k: usize, vocab: usize) -> Result<()> {
    if k > vocab {
        bail!("{flag} must be at most the vocabulary size ({vocab}), got {k}");
    }
    Ok(())
}
