//! The generation loop: prefill in chunks, then one token at a time until a stop condition.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::sampler::{top_indices, Sampler, SamplerParams};
use crate::backend::Sequence;
use crate::model::decoder::Logits;
use crate::model::ModelConfig;

/// Prompt tokens per forward pass during prefill (mlx-lm's default step).
pub const PREFILL_STEP: usize = 2048;

#[derive(Debug, Clone, Default)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampler: SamplerParams,
    /// Top-K log-probabilities to report per step (0: none).
    pub logprobs: usize,
    /// Token ids that end generation (included in the output, as mlx-lm does).
    pub eos_ids: Vec<u32>,
    /// Report the top-K next-token distribution at every prompt position too.
    pub prompt_logprobs: usize,
}

/// One generated token.
#[derive(Debug, Clone)]
pub struct Step {
    pub token: u32,
    /// `(id, logprob)` of the most likely tokens, after the processors and before the filters.
    pub top: Vec<(u32, f32)>,
}

#[derive(Debug, Clone, Default)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub prompt_time: Duration,
    pub generated_tokens: usize,
    pub generation_time: Duration,
    /// For each prompt position, the top-K of the next-token distribution (when requested).
    pub prompt_logprobs: Vec<Vec<(u32, f32)>>,
}

/// What the caller wants after each token.
pub enum Flow {
    Continue,
    Stop,
}

fn top_k(lp: &[f32], k: usize) -> Vec<(u32, f32)> {
    top_indices(lp, k)
        .into_iter()
        .map(|i| (i as u32, lp[i]))
        .collect()
}

/// Generates from `prompt` on `seq` (emptied first), calling `on_step` after every token; stops
/// at EOS, at `max_tokens`, at the context limit, or when `on_step` says so.
pub fn generate(
    cfg: &ModelConfig,
    seq: &mut dyn Sequence,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut on_step: impl FnMut(&Step) -> Flow,
) -> Result<GenerationStats> {
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= cfg.vocab) {
        bail!(
            "prompt token id {bad} is outside the vocabulary (size {})",
            cfg.vocab
        );
    }
    if prompt.len() > cfg.max_context {
        bail!(
            "the prompt has {} tokens but the model's context is {} tokens",
            prompt.len(),
            cfg.max_context
        );
    }
    opts.sampler.validate(cfg.vocab)?;
    let mut sampler = Sampler::new(opts.sampler.clone());
    seq.reset()?;
    let mut stats = GenerationStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };

    let t0 = Instant::now();
    let mut logits = Vec::new();
    let want = if opts.prompt_logprobs > 0 {
        Logits::All
    } else {
        Logits::Last
    };
    for chunk in prompt.chunks(PREFILL_STEP) {
        logits = seq.forward(chunk, want)?;
        if opts.prompt_logprobs > 0 {
            for row in logits.chunks_mut(cfg.vocab) {
                crate::backend::cpu::log_softmax(row);
                stats.prompt_logprobs.push(top_k(row, opts.prompt_logprobs));
            }
        }
    }
    if want == Logits::All {
        let v = cfg.vocab;
        logits = logits[logits.len() - v..].to_vec();
    }
    stats.prompt_time = t0.elapsed();

    let mut history = prompt.to_vec();
    let t1 = Instant::now();
    while stats.generated_tokens < opts.max_tokens {
        let mut lp = logits;
        sampler.logprobs(&mut lp, &history);
        let token = sampler.sample(&lp);
        let step = Step {
            token,
            top: if opts.logprobs > 0 {
                top_k(&lp, opts.logprobs)
            } else {
                Vec::new()
            },
        };
        stats.generated_tokens += 1;
        history.push(token);
        let flow = on_step(&step);
        if matches!(flow, Flow::Stop)
            || opts.eos_ids.contains(&token)
            || stats.generated_tokens >= opts.max_tokens
        {
            break;
        }
        if seq.len() >= cfg.max_context {
            break;
        }
        logits = seq.forward(&[token], Logits::Last)?;
    }
    stats.generation_time = t1.elapsed();
    Ok(stats)
}
