//! `trellm bench`: prompt processing (ppN: N prompt tokens in one pass) and text generation (tgN:
//! N tokens one at a time from an empty cache), as llama-bench defines them; median of runs.

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;

use super::ModelArgs;
use crate::backend::{self, Device};
use crate::model::decoder::Logits;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt tokens processed in one pass (0: skip).
    #[arg(long, short = 'p', default_value_t = 512)]
    pub n_prompt: usize,
    /// Tokens generated one at a time (0: skip).
    #[arg(long, short = 'n', default_value_t = 128)]
    pub n_gen: usize,
    /// Measured runs per test (after one warm-up run).
    #[arg(long, short = 'r', default_value_t = 5)]
    pub repetitions: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// `cpu`, or `cuda`: `--model` on the first GPU (weights as bf16), or with `--shape` /
    /// `--check` the GPU benchmark on synthetic weights / the GPU-against-CPU check.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// cuda: synthetic seeded weights of a named shape (llama-3.1-8b, tiny), made on the GPU.
    #[arg(long)]
    pub shape: Option<String>,
    /// cuda: compare the GPU decoder with the CPU decoder on `--model` (weights rounded to bf16)
    /// over `--n-gen` greedy steps instead of timing.
    #[arg(long)]
    pub check: bool,
    /// cuda: context length the decode steps start at.
    #[arg(long, default_value_t = 512)]
    pub context: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Sizes beyond any context trellm runs; larger values are typing errors.
const MAX_BENCH_TOKENS: usize = 1 << 20;

/// Size flags checked before the model is loaded.
fn check_sizes(a: &BenchArgs) -> Result<()> {
    use super::flags::check_count;
    if a.repetitions == 0 {
        bail!("--repetitions must be at least 1");
    }
    check_count("--repetitions", a.repetitions, 10_000)?;
    check_count("--n-prompt", a.n_prompt, MAX_BENCH_TOKENS)?;
    check_count("--n-gen", a.n_gen, MAX_BENCH_TOKENS)?;
    check_count("--context", a.context, MAX_BENCH_TOKENS)?;
    Ok(())
}

pub fn run(a: BenchArgs) -> Result<()> {
    check_sizes(&a)?;
    if a.device == Device::Cuda && (a.shape.is_some() || a.check) {
        return super::bench_cuda::run(&a);
    }
    let m = a.model.load_with(false)?;
    let dec = &m.decoder;
    let cfg = &dec.cfg;
    if a.n_prompt + a.n_gen > cfg.max_context {
        bail!(
            "pp{} + tg{} exceeds the model's context of {} tokens",
            a.n_prompt,
            a.n_gen,
            cfg.max_context
        );
    }
    // Deterministic token ids spread over the vocabulary, as llama-bench uses random ones.
    let tokens: Vec<u32> = (0..a.n_prompt.max(1) as u64)
        .map(|i| ((i.wrapping_mul(2654435761) + 7) % cfg.vocab as u64) as u32)
        .collect();
    // The same passes as generation, on whichever device: each returns its logits to the host.
    let mut seq = backend::sequence(dec, a.device, a.n_prompt.max(a.n_gen) + 1)?;
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    for rep in 0..=a.repetitions {
        if a.n_prompt > 0 {
            seq.reset()?;
            let t = Instant::now();
            seq.forward(&tokens[..a.n_prompt], Logits::Last)?;
            if rep > 0 {
                pp.push(a.n_prompt as f64 / t.elapsed().as_secs_f64());
            }
        }
        if a.n_gen > 0 {
            seq.reset()?;
            let mut tok = cfg.bos_id.unwrap_or(0);
            let t = Instant::now();
            for _ in 0..a.n_gen {
                let logits = seq.forward(&[tok], Logits::Last)?;
                tok = crate::engine::sampler::argmax(&logits);
            }
            if rep > 0 {
                tg.push(a.n_gen as f64 / t.elapsed().as_secs_f64());
            }
        }
    }
    let threads = crate::backend::cpu::pool().current_num_threads();
    let pp_tok_s = (!pp.is_empty()).then(|| median(pp));
    let tg_tok_s = (!tg.is_empty()).then(|| median(tg));
    if a.json {
        let obj = serde_json::json!({
            "model": m.path.display().to_string(),
            "device": a.device.name(),
            "threads": threads,
            "n_prompt": a.n_prompt,
            "n_gen": a.n_gen,
            "repetitions": a.repetitions,
            "pp_tok_s": pp_tok_s,
            "tg_tok_s": tg_tok_s,
            "peak_rss_bytes": super::peak_rss_bytes(),
            "weight_bytes": m.weight_bytes,
        });
        super::output::print(&format!("{obj}\n"))?;
    } else {
        let mut s = format!(
            "model: {}  threads: {threads}  runs: {}\n",
            m.path.display(),
            a.repetitions
        );
        if let Some(v) = pp_tok_s {
            s.push_str(&format!("pp{:<5} {v:>10.2} tok/s\n", a.n_prompt));
        }
        if let Some(v) = tg_tok_s {
            s.push_str(&format!("tg{:<5} {v:>10.2} tok/s\n", a.n_gen));
        }
        super::output::print(&s)?;
    }
    Ok(())
}
