//! `trellm bench`: prompt processing (ppN: N prompt tokens in one pass) and text generation (tgN:
//! N tokens one at a time from an empty cache), as llama-bench defines them; median of runs.

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;

use trellm_model::{Batch, BlockPool, BlockTable, ModelBackend, Want};
use trellm_quant::exl3::Exl3Rates;

use super::ModelArgs;
use crate::backend::{Device, SoloSequence, BLOCK_SIZE};
use crate::model::load::LoadedModel;

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
    /// cuda: synthetic seeded weights of a named shape (llama-3.1-8b, llama-3.1-70b, tiny), made
    /// on the GPU.
    #[arg(long)]
    pub shape: Option<String>,
    /// cuda: compare the GPU decoder with the CPU decoder on `--model` (weights rounded to bf16)
    /// over `--n-gen` greedy steps instead of timing.
    #[arg(long)]
    pub check: bool,
    /// Batch sizes to measure as llama-batched-bench does (e.g. 1,2,4,8): B sequences of
    /// `--n-prompt` tokens prefilled in one step, then `--n-gen` steps of B tokens.
    #[arg(long, value_delimiter = ',')]
    pub batch: Option<Vec<usize>>,
    /// cuda: context length the decode steps start at.
    #[arg(long, default_value_t = 512)]
    pub context: usize,
    /// cuda, with `--shape`: every projection as synthetic EXL3 weights, `CODEBOOK:BITS`
    /// (mul1, mcg or 3inst; 1..8, or 1.5, 2.5, 3.5), some at other rates with `,PROJ=BITS`
    /// (q, k, v, o, gate, up, down; e.g. `mul1:3,k=4,v=4,up=4`); the head at 6 bits as exllamav3
    /// converts it.
    #[arg(long, value_name = "CODEBOOK:BITS[,PROJ=BITS...]", value_parser = Exl3Rates::parse)]
    pub exl3: Option<Exl3Rates>,
    /// cuda, with `--model` or `--shape --batch`: split the model over GPUs 0..N (tensor
    /// parallelism, NCCL).
    #[arg(long, default_value_t = 1, value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u16).range(1..=64), usize::from))]
    pub tensor_parallel: usize,
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
    if a.exl3.is_some() && (a.device != Device::Cuda || a.shape.is_none()) {
        bail!("--exl3 makes synthetic weights: it needs --device cuda --shape NAME");
    }
    if a.tensor_parallel > 1
        && (a.device != Device::Cuda || a.check || (a.shape.is_some() && a.batch.is_none()))
    {
        bail!(
            "--tensor-parallel splits a model over GPUs: it needs --device cuda with --model M, or \
             --shape NAME --batch B"
        );
    }
    Ok(())
}

pub fn run(a: BenchArgs) -> Result<()> {
    check_sizes(&a)?;
    if a.device == Device::Cuda && (a.shape.is_some() || a.check) {
        return super::bench_cuda::run(&a);
    }
    let m = a.model.load_with(false)?;
    let cfg = &m.model.cfg;
    if a.n_prompt + a.n_gen > cfg.max_context {
        bail!(
            "pp{} + tg{} exceeds the model's context of {} tokens",
            a.n_prompt,
            a.n_gen,
            cfg.max_context
        );
    }
    if let Some(batch) = &a.batch {
        return batched(&a, &m, batch);
    }
    // Deterministic token ids spread over the vocabulary, as llama-bench uses random ones.
    let tokens: Vec<u32> = (0..a.n_prompt.max(1) as u64)
        .map(|i| ((i.wrapping_mul(2654435761) + 7) % cfg.vocab as u64) as u32)
        .collect();
    // The same passes as generation, on whichever device: each returns its logits to the host.
    let capacity = a.n_prompt.max(a.n_gen) + 1;
    let (pp, tg) = match a.device {
        Device::Cpu => pp_tg(&a, &*m.model, &tokens, capacity)?,
        Device::Cuda => pp_tg_cuda(&a, &m, &tokens, capacity)?,
    };
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

/// pp and tg rates (tok/s) of each measured run: one sequence through the model's step.
fn pp_tg<M: ModelBackend>(
    a: &BenchArgs,
    model: &M,
    tokens: &[u32],
    capacity: usize,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let cfg = model.config();
    let (mut pp, mut tg) = (Vec::new(), Vec::new());
    for rep in 0..=a.repetitions {
        if a.n_prompt > 0 {
            let mut seq = SoloSequence::new(model, capacity)?;
            let t = Instant::now();
            seq.forward(&tokens[..a.n_prompt], Want::Last)?;
            if rep > 0 {
                pp.push(a.n_prompt as f64 / t.elapsed().as_secs_f64());
            }
        }
        if a.n_gen > 0 {
            let mut seq = SoloSequence::new(model, capacity)?;
            let mut tok = cfg.bos_id.unwrap_or(0);
            let t = Instant::now();
            for _ in 0..a.n_gen {
                let logits = seq.forward(&[tok], Want::Last)?;
                tok = crate::engine::sampler::argmax(&logits);
            }
            if rep > 0 {
                tg.push(a.n_gen as f64 / t.elapsed().as_secs_f64());
            }
        }
    }
    Ok((pp, tg))
}

#[cfg(feature = "cuda")]
fn pp_tg_cuda(
    a: &BenchArgs,
    m: &LoadedModel,
    tokens: &[u32],
    capacity: usize,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let model = crate::backend::cuda::CudaModel::new(&m.model, capacity, a.tensor_parallel)?;
    pp_tg(a, &model, tokens, capacity)
}

#[cfg(not(feature = "cuda"))]
fn pp_tg_cuda(_: &BenchArgs, _: &LoadedModel, _: &[u32], _: usize) -> Result<(Vec<f64>, Vec<f64>)> {
    bail!("--device cuda: this trellm was built without the cuda feature")
}

/// One row of llama-batched-bench's table.
struct BatchRow {
    b: usize,
    n_kv: usize,
    t_pp: f64,
    t_tg: f64,
}

/// `--batch`: for each B, B sequences of `n_prompt` copies of one token prefilled in one step
/// (logits of each sequence's last token only), then `n_gen` steps of one token per sequence,
/// no sampling; reported with llama-batched-bench's columns.
fn batched(a: &BenchArgs, m: &LoadedModel, sizes: &[usize]) -> Result<()> {
    let label = m.path.display().to_string();
    match a.device {
        Device::Cpu => batched_on(a, &*m.model, &label, sizes),
        Device::Cuda => batched_cuda(a, m, &label, sizes),
    }
}

#[cfg(feature = "cuda")]
fn batched_cuda(a: &BenchArgs, m: &LoadedModel, label: &str, sizes: &[usize]) -> Result<()> {
    let model =
        crate::backend::cuda::CudaModel::new(&m.model, a.n_prompt + a.n_gen, a.tensor_parallel)?;
    batched_on(a, &model, label, sizes)
}

#[cfg(not(feature = "cuda"))]
fn batched_cuda(_: &BenchArgs, _: &LoadedModel, _: &str, _: &[usize]) -> Result<()> {
    bail!("--device cuda: this trellm was built without the cuda feature")
}

/// [`batched`] on any backend (`label` names the model in the table's header).
pub(super) fn batched_on<M: ModelBackend>(
    a: &BenchArgs,
    model: &M,
    label: &str,
    sizes: &[usize],
) -> Result<()> {
    if sizes.is_empty() || sizes.contains(&0) {
        bail!("--batch takes batch sizes of at least 1, e.g. 1,2,4,8");
    }
    if a.n_prompt == 0 {
        bail!("bench --batch needs --n-prompt of at least 1");
    }
    let cfg = model.config();
    let tok = cfg.bos_id.unwrap_or(0).min(cfg.vocab as u32 - 1);
    let threads = crate::backend::cpu::pool().current_num_threads();
    if !a.json {
        println!(
            "model: {label}  device: {}  threads: {threads}  (as llama-batched-bench: PP prompt \
             tokens and TG generated tokens per sequence, B sequences)",
            a.device.name()
        );
        println!(
            "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |"
        );
        println!(
            "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|"
        );
    }
    // A warm-up pass, as llama-batched-bench runs one.
    run_batch(model, tok, 1, a.n_prompt.min(16), 1)?;
    for &b in sizes {
        let r = run_batch(model, tok, b, a.n_prompt, a.n_gen)?;
        let (pp, tg) = ((b * a.n_prompt) as f64, (b * a.n_gen) as f64);
        let t = r.t_pp + r.t_tg;
        let s_tg = if a.n_gen > 0 { tg / r.t_tg } else { 0.0 };
        if a.json {
            println!(
                "{}",
                serde_json::json!({
                    "device": a.device.name(), "pp": a.n_prompt, "tg": a.n_gen, "b": r.b, "n_kv": r.n_kv,
                    "t_pp": r.t_pp, "s_pp": pp / r.t_pp, "t_tg": r.t_tg, "s_tg": s_tg,
                    "t": t, "s": r.n_kv as f64 / t,
                })
            );
        } else {
            println!(
                "| {:5} | {:6} | {:4} | {:6} | {:8.3} | {:8.2} | {:8.3} | {:8.2} | {:8.3} | {:8.2} |",
                a.n_prompt,
                a.n_gen,
                r.b,
                r.n_kv,
                r.t_pp,
                pp / r.t_pp,
                r.t_tg,
                s_tg,
                t,
                r.n_kv as f64 / t
            );
        }
    }
    Ok(())
}

fn run_batch<M: ModelBackend>(
    model: &M,
    tok: u32,
    b: usize,
    n_prompt: usize,
    n_gen: usize,
) -> Result<BatchRow> {
    let positions = n_prompt + n_gen;
    let blocks = b
        .checked_mul(positions.div_ceil(BLOCK_SIZE))
        .filter(|&n| n <= u32::MAX as usize)
        .ok_or_else(|| anyhow::anyhow!("--batch {b} is too large"))?;
    let mut cache = model.new_cache(blocks, BLOCK_SIZE)?;
    let mut pool = BlockPool::new(blocks, BLOCK_SIZE);
    let mut tables: Vec<BlockTable> = (0..b).map(|_| BlockTable::default()).collect();
    for t in &mut tables {
        pool.grow(t, positions)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let prompt = vec![tok; n_prompt];
    let mut batch = Batch::default();
    for t in &tables {
        batch.push(&prompt, 0, t.blocks().to_vec(), Want::Last);
    }
    let t0 = Instant::now();
    model.step(&batch, &mut cache)?;
    let t_pp = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for i in 0..n_gen {
        let mut batch = Batch::default();
        for t in &tables {
            batch.push(&[tok], n_prompt + i, t.blocks().to_vec(), Want::Last);
        }
        model.step(&batch, &mut cache)?;
    }
    Ok(BatchRow {
        b,
        n_kv: b * positions,
        t_pp,
        t_tg: t1.elapsed().as_secs_f64(),
    })
}
