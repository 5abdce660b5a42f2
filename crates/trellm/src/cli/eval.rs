//! `trellm eval`: perplexity of a text, and KL divergence against a reference model's saved
//! distributions, as llama-perplexity measures them (see [`crate::eval`]).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::{output, DeviceArgs, ModelArgs};
use crate::backend::Device;
use crate::eval::logits_file::{BaseFile, Writer, MAX_CTX};
use crate::eval::stats::{token_kl, KlStats, KlSummary, Perplexity, TokenKl};
use crate::eval::{run_chunks, Chunking};

#[derive(Args, Debug)]
pub struct EvalArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// The text (UTF-8; one final newline is dropped, as llama-perplexity drops it). Optional
    /// with --kl-base, whose file holds the tokens; given, it must tokenize to them.
    #[arg(long, short = 'f')]
    pub file: Option<PathBuf>,
    /// Tokens a chunk [default: 512, or the --kl-base file's].
    #[arg(long, short = 'c')]
    pub ctx: Option<usize>,
    /// Chunks to evaluate [default: all the text holds].
    #[arg(long)]
    pub chunks: Option<usize>,
    /// llama-perplexity's --ppl-stride: chunks of --ctx tokens start every N tokens and the
    /// last N of each are scored (no BOS). llama-perplexity's strided pass runs with a context
    /// of its -c plus N/2, rounded up to a multiple of 256 (its log's "Calculation chunk"):
    /// `-c 512 --ppl-stride 256` there is `--ctx 768 --stride 256` here.
    #[arg(long, conflicts_with_all = ["save_logits", "kl_base"])]
    pub stride: Option<usize>,
    /// Print one JSON object: ppl, ppl_err, tokens (scored), text_tokens, chunks, ctx and, with
    /// --kl-base, kld_mean, kld (percentiles), same_top (a fraction), ppl_base, ppl_ratio, ...
    #[arg(long)]
    pub json: bool,
    /// Save the model's distributions at every scored position (llama-perplexity's
    /// --kl-divergence-base format; about 2 bytes per vocabulary entry a scored token).
    #[arg(long, conflicts_with = "kl_base")]
    pub save_logits: Option<PathBuf>,
    /// KL divergence against the distributions saved with --save-logits (or by llama-perplexity
    /// --kl-divergence-base) from a reference model on the same text.
    #[arg(long)]
    pub kl_base: Option<PathBuf>,
    /// Positions of a chunk per forward pass (llama-perplexity's -ub): 1 scores the text
    /// through the decode kernels, as generation runs them [default: the whole chunk].
    #[arg(long, short = 'u', value_parser = clap::value_parser!(u64).range(1..))]
    pub ubatch: Option<u64>,
    /// No progress bar.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

/// Text files larger than this are refused (wikitext-2's test split is 1.3 MB).
const MAX_TEXT_BYTES: u64 = 1 << 30;

/// Flag checks that need no model.
fn check_flags(a: &EvalArgs) -> Result<()> {
    if a.file.is_none() && a.kl_base.is_none() {
        bail!("eval needs --file TEXT (or --kl-base FILE, which holds its tokens)");
    }
    if let Some(c) = a.ctx {
        super::flags::check_count("--ctx", c, MAX_CTX)?;
    }
    if a.chunks == Some(0) {
        bail!("--chunks must be at least 1");
    }
    if a.device.device == Device::Cuda && a.ubatch != Some(1) {
        bail!(
            "eval on --device cuda needs --ubatch 1 (the CUDA backend returns the logits of one \
             position a sequence a step)"
        );
    }
    if a.device.tensor_parallel > 1 {
        bail!(
            "eval runs the model unsplit: --tensor-parallel is for generate, chat, serve and bench"
        );
    }
    Ok(())
}

/// The text as llama-perplexity reads it: the whole file, one final newline dropped.
fn read_text(path: &Path) -> Result<String> {
    let name = path.display();
    let meta = std::fs::metadata(path).with_context(|| format!("--file: cannot read {name}"))?;
    if meta.len() > MAX_TEXT_BYTES {
        bail!(
            "--file: {name} is {} bytes, more than the 1 GiB eval reads",
            meta.len()
        );
    }
    let bytes = std::fs::read(path).with_context(|| format!("--file: cannot read {name}"))?;
    let mut text = String::from_utf8(bytes)
        .map_err(|e| anyhow::anyhow!("--file: {name} is not UTF-8 text ({e})"))?;
    if text.ends_with('\n') {
        text.pop();
    }
    if text.is_empty() {
        bail!("--file: {name} is empty");
    }
    Ok(text)
}

pub fn run(a: EvalArgs) -> Result<()> {
    check_flags(&a)?;
    let text = a.file.as_deref().map(read_text).transpose()?;
    let m = a.model.load()?;
    let cfg = &m.model.cfg;
    let tok = m.tokenizer()?;
    let bos = if tok.add_bos() { tok.bos_id() } else { None };
    let text_tokens = match &text {
        Some(t) => Some(tok.encode(t, true)?),
        None => None,
    };
    let mut base = match &a.kl_base {
        Some(p) => Some(BaseFile::open(p, cfg.vocab)?),
        None => None,
    };
    let tokens: Vec<u32> = match (&base, text_tokens) {
        (Some(b), t) => {
            if let Some(c) = a.ctx.filter(|&c| c != b.ctx) {
                bail!(
                    "--ctx {c}: the base file was saved with chunks of {}",
                    b.ctx
                );
            }
            if let Some(t) = t {
                let diff = b.tokens.iter().zip(&t).position(|(x, y)| x != y);
                if diff.is_some() || t.len() < b.tokens.len() {
                    bail!(
                        "the text does not tokenize to the base file's tokens (they differ from token {}): another text or tokenizer",
                        diff.unwrap_or(t.len())
                    );
                }
            }
            b.tokens.clone()
        }
        (None, Some(t)) => t,
        (None, None) => unreachable!("checked by check_flags"),
    };
    let ctx = base.as_ref().map_or(a.ctx.unwrap_or(512), |b| b.ctx);
    if ctx > cfg.max_context {
        bail!(
            "--ctx {ctx} is more than the model's context of {} tokens",
            cfg.max_context
        );
    }
    let chunking = Chunking::new(tokens.len(), ctx, a.stride, a.chunks, bos)?;
    let mut writer = match &a.save_logits {
        Some(p) => Some(Writer::create(
            p,
            ctx,
            cfg.vocab,
            chunking.chunks,
            &tokens[..ctx * chunking.chunks],
        )?),
        None => None,
    };
    if !a.quiet {
        eprintln!(
            "trellm eval: {}: {} tokens, {} chunks of {ctx}, {} scored each{}",
            m.path.display(),
            tokens.len(),
            chunking.chunks,
            chunking.scored(),
            if bos.is_some() { ", BOS first" } else { "" }
        );
    }
    let pb = progress(chunking.chunks, a.quiet);
    // In a log with --json (no result lines), a progress line every few seconds instead.
    let log_lines = a.json && !a.quiet && !std::io::stderr().is_terminal();
    let mut last_line = Instant::now();
    let mut say = Say {
        on: !a.json,
        pb: &pb,
    };
    if base.is_some() {
        say.line(
            "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p",
        )?;
    }
    let vocab = cfg.vocab;
    let mut ppl = Perplexity::default();
    let mut kl = KlStats::default();
    let t0 = Instant::now();
    let ubatch = a.ubatch.map_or(ctx, |u| (u as usize).min(ctx));
    let each = |c: crate::eval::ChunkLogits<'_>| -> Result<()> {
        if let Some(w) = writer.as_mut() {
            w.chunk(c.logits)?;
        }
        match base.as_mut() {
            None => {
                ppl.add_rows(c.logits, c.targets, vocab);
                let (p, e) = ppl.ppl();
                say.line(&format!("[{}]{p:.4} ± {e:.4}", c.index + 1))?;
                pb.set_message(format!("PPL {p:.4}"));
            }
            Some(b) => {
                b.next_chunk()?;
                let b = &*b;
                let rows: Vec<TokenKl> = crate::backend::cpu::pool().install(|| {
                    use rayon::prelude::*;
                    c.logits
                        .par_chunks_exact(vocab)
                        .zip(c.targets)
                        .enumerate()
                        .map(|(j, (row, &t))| token_kl(row, &b.row(j), t as usize))
                        .collect()
                });
                rows.into_iter().for_each(|t| kl.add(t));
                let s = kl.summary();
                say.line(&kl_row(c.index + 1, &s))?;
                pb.set_message(format!("KLD {:.5}", s.kld.0));
            }
        }
        pb.inc(1);
        if log_lines && last_line.elapsed().as_secs() >= 5 {
            last_line = Instant::now();
            eprintln!(
                "trellm eval: {}/{} chunks, {}",
                c.index + 1,
                chunking.chunks,
                pb.message()
            );
        }
        Ok(())
    };
    match a.device.device {
        Device::Cpu => run_chunks(&*m.model, &tokens, &chunking, ubatch, each)?,
        Device::Cuda => {
            let gpu = crate::backend::cuda::CudaModel::new(&m.model, ctx, 1)?;
            run_chunks(&gpu, &tokens, &chunking, ubatch, each)?
        }
    }
    pb.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    if let Some(w) = writer {
        w.finish()?;
    }
    let evaluated = chunking.chunks * ctx;
    if !a.quiet {
        eprintln!(
            "trellm eval: {evaluated} tokens in {secs:.2} s ({:.1} tok/s, {} threads)",
            evaluated as f64 / secs.max(1e-9),
            crate::backend::cpu::pool().current_num_threads()
        );
    }
    let summary = base.is_some().then(|| kl.summary());
    if a.json {
        let (p, e, n) = match &summary {
            Some(s) => (s.ppl.0, s.ppl.1, s.count),
            None => (ppl.ppl().0, ppl.ppl().1, ppl.count),
        };
        let mut obj = serde_json::json!({
            "model": m.path.display().to_string(),
            "file": a.file.as_ref().map(|f| f.display().to_string()),
            "ctx": ctx,
            "stride": a.stride,
            "ubatch": ubatch,
            "chunks": chunking.chunks,
            "text_tokens": tokens.len(),
            "tokens": n,
            "ppl": p,
            "ppl_err": e,
            "seconds": secs,
        });
        if let Some(s) = &summary {
            let q = |qs: &crate::eval::stats::Quantiles| {
                serde_json::Value::Object(
                    qs.0.iter()
                        .map(|(k, v)| (k.to_string(), serde_json::json!(v)))
                        .collect(),
                )
            };
            let extra = serde_json::json!({
                "kl_base": a.kl_base.as_ref().map(|f| f.display().to_string()),
                "ppl_base": s.ppl_base.0, "ppl_base_err": s.ppl_base.1,
                "ln_ppl_ratio": s.ln_ppl_ratio.0, "ln_ppl_ratio_err": s.ln_ppl_ratio.1,
                "ppl_ratio": s.ppl_ratio.0, "ppl_ratio_err": s.ppl_ratio.1,
                "ppl_diff": s.ppl_diff.0, "ppl_diff_err": s.ppl_diff.1,
                "ln_ppl_cor": s.ln_ppl_cor,
                "kld_mean": s.kld.0, "kld_err": s.kld.1, "kld": q(&s.kld_quantiles),
                "same_top": s.same_top.0, "same_top_err": s.same_top.1,
                "dp_mean": s.p_diff.0, "dp_err": s.p_diff.1, "dp": q(&s.p_diff_quantiles),
                "rms_dp": s.rms_p_diff.0, "rms_dp_err": s.rms_p_diff.1,
            });
            if let (Some(o), serde_json::Value::Object(x)) = (obj.as_object_mut(), extra) {
                o.extend(x);
            }
        }
        output::print(&format!("{obj}\n"))?;
    } else {
        match &summary {
            None => {
                let (p, e) = ppl.ppl();
                say.line(&format!("Final estimate: PPL = {p:.4} +/- {e:.5}"))?;
            }
            Some(s) => say.line(&kl_report(s))?,
        }
    }
    Ok(())
}

/// Result lines to stdout (not with --json), around the progress bar; a closed pipe stops them.
struct Say<'a> {
    on: bool,
    pb: &'a ProgressBar,
}

impl Say<'_> {
    fn line(&mut self, s: &str) -> Result<()> {
        if self.on {
            self.on = self.pb.suspend(|| output::print(&format!("{s}\n")))?;
        }
        Ok(())
    }
}

/// A bar of chunks on a terminal's stderr; hidden otherwise (result lines say the progress).
fn progress(chunks: usize, quiet: bool) -> ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(Some(chunks as u64), ProgressDrawTarget::stderr());
    pb.set_style(
        ProgressStyle::with_template("eval [{bar:30}] {pos}/{len} chunks {msg} eta {eta}")
            .expect("static template")
            .progress_chars("=> "),
    );
    pb
}

/// A chunk's line of the KL table (running values), in llama-perplexity's columns.
fn kl_row(chunk: usize, s: &KlSummary) -> String {
    format!(
        "{chunk:4}    {:9.4} ± {:9.4}    {:10.5} ± {:10.5}    {:10.5} ± {:10.5}    {:6.3} ± {:6.3} %    {:6.3} ± {:6.3} %",
        s.ppl.0,
        s.ppl.1,
        s.ln_ppl_ratio.0,
        s.ln_ppl_ratio.1,
        s.kld.0,
        s.kld.1,
        100.0 * s.rms_p_diff.0,
        100.0 * s.rms_p_diff.1,
        100.0 * s.same_top.0,
        100.0 * s.same_top.1,
    )
}

/// The summary llama-perplexity prints after `--kl-divergence`, with its labels.
fn kl_report(s: &KlSummary) -> String {
    let mut o = String::new();
    let mut pm = |label: &str, (v, e): (f64, f64)| {
        o.push_str(&format!("{label:<30}: {v:10.6} ± {e:10.6}\n"));
    };
    pm("Mean PPL(Q)", s.ppl);
    pm("Mean PPL(base)", s.ppl_base);
    let mut o2 = format!(
        "Cor(ln(PPL(Q)), ln(PPL(base))): {:6.2}%\n",
        100.0 * s.ln_ppl_cor
    );
    let mut pm = |label: &str, (v, e): (f64, f64)| {
        o2.push_str(&format!("{label:<30}: {v:10.6} ± {e:10.6}\n"));
    };
    pm("Mean ln(PPL(Q)/PPL(base))", s.ln_ppl_ratio);
    pm("Mean PPL(Q)/PPL(base)", s.ppl_ratio);
    pm("Mean PPL(Q)-PPL(base)", s.ppl_diff);
    o.push_str(&o2);
    o.push_str("\n====== KL divergence statistics ======\n");
    o.push_str(&format!(
        "Mean    KLD: {:10.6} ± {:10.6}\n",
        s.kld.0, s.kld.1
    ));
    for (name, v) in &s.kld_quantiles.0 {
        if *name == "75.0" || *name == "25.0" {
            continue; // llama-perplexity reports these for Δp only
        }
        o.push_str(&format!("{:<8}KLD: {v:10.6}\n", label(name)));
    }
    o.push_str("\n====== Token probability statistics ======\n");
    o.push_str(&format!(
        "Mean    Δp: {:6.3} ± {:5.3} %\n",
        100.0 * s.p_diff.0,
        100.0 * s.p_diff.1
    ));
    for (name, v) in &s.p_diff_quantiles.0 {
        o.push_str(&format!("{:<8}Δp: {:6.3}%\n", label(name), 100.0 * v));
    }
    o.push_str(&format!(
        "RMS Δp    : {:6.3} ± {:5.3} %\n",
        100.0 * s.rms_p_diff.0,
        100.0 * s.rms_p_diff.1
    ));
    o.push_str(&format!(
        "Same top p: {:6.3} ± {:5.3} %",
        100.0 * s.same_top.0,
        100.0 * s.same_top.1
    ));
    format!("====== Perplexity statistics ======\n{o}")
}

fn label(name: &str) -> String {
    match name {
        "max" => "Maximum".into(),
        "min" => "Minimum".into(),
        "median" => "Median".into(),
        p => format!("{p:>4}%"),
    }
}
