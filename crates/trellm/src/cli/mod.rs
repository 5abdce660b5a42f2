//! The `trellm` command line: parse, call the engine, format.

mod bench;
mod bench_cuda;
mod chat;
mod eval;
mod flags;
mod generate;
mod models;
pub mod output;
mod quantize;
pub mod report;
mod requests;
mod serve;

use std::io::Write;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};

use crate::backend::Device;
use crate::engine::SamplerParams;
use crate::engine::{Engine, EngineOptions};
use crate::model::load::{load_with, LoadedModel};

pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct";

#[derive(Parser, Debug)]
#[command(
    name = "trellm",
    version,
    about = "Run LLMs (GGUF, Hugging Face folders) on the CPU"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate text from a prompt.
    Generate(generate::GenerateArgs),
    /// Serve the model over OpenAI- and Anthropic-compatible HTTP APIs.
    Serve(serve::ServeArgs),
    /// Chat with a model in the terminal.
    Chat(chat::ChatArgs),
    /// Measure prompt processing and generation speed (llama-bench's pp/tg).
    Bench(bench::BenchArgs),
    /// Perplexity of a text and KL divergence against a reference (llama-perplexity's method).
    Eval(eval::EvalArgs),
    /// Quantize a model to EXL3 (trellis) on the CPU, calibrated on text; exllamav3 loads it too.
    Quantize(quantize::QuantizeArgs),
    /// Download a known model (or a Hugging Face repo) into the cache; prints its path last.
    Pull {
        /// Alias (smollm2-135m-instruct, gemma-3-270m) or Hugging Face repo id.
        model: String,
    },
    /// List the known models and the cached ones.
    List(models::ListArgs),
    /// Remove a model from the cache.
    Rm(models::RmArgs),
    /// Describe a model: architecture, parameters, tensor types, context length, chat template.
    Info(models::InfoArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions(models::CompletionsArgs),
}

/// Which model and how many threads.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: a GGUF file, a model folder, a known alias or a Hugging Face repo id.
    #[arg(long, short = 'M', default_value = DEFAULT_MODEL)]
    pub model: String,
    /// Worker threads (default: all cores).
    #[arg(long, short = 't', allow_negative_numbers = true)]
    pub threads: Option<usize>,
    /// Run EXL3 MUL1 layers on the exact path (the activations times each weight's fp16
    /// value): on the CPU instead of int16 activations in decode and prefill (mean KLD ~2e-6
    /// against it, ~1.9x and ~1.3x faster), on CUDA instead of int8 activations in one-row steps
    /// (as exllamav3's default; ~1.17x faster).
    #[arg(long)]
    pub exl3_exact: bool,
}

/// Where generation runs.
#[derive(Args, Debug)]
pub struct DeviceArgs {
    /// Device for the forward passes: cpu, or cuda (the first NVIDIA GPU; weights in bf16).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// Split the model over N ranks (tensor parallelism): on cuda, GPUs 0..N (NCCL's
    /// all-reduces); on cpu, N simulated ranks run one after another (a check of the split).
    #[arg(long, default_value_t = 1, value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u16).range(1..=64), usize::from))]
    pub tensor_parallel: usize,
}

impl DeviceArgs {
    /// An engine for `m` on this device, for `max_seqs` sequences of up to `positions` each.
    pub fn engine<'t>(
        &self,
        m: &'t LoadedModel,
        max_seqs: usize,
        positions: usize,
    ) -> Result<Engine<'t>> {
        let positions = positions.clamp(1, m.model.cfg.max_context.max(1));
        m.engine(
            self.device,
            EngineOptions {
                tensor_parallel: self.tensor_parallel,
                ..EngineOptions::for_sequences(max_seqs, positions)
            },
        )
    }
}

impl ModelArgs {
    pub fn load(&self) -> Result<LoadedModel> {
        self.load_with(true)
    }

    /// Loads the model, with or without its tokenizer.
    pub fn load_with(&self, tokenizer: bool) -> Result<LoadedModel> {
        if let Some(n) = flags::check_threads(self.threads)? {
            crate::backend::cpu::set_threads(n);
        }
        let path = trellm_hub::resolve_model(&self.model, true)?;
        let mut m =
            load_with(&path, tokenizer).map_err(|e| models::cached_hint(e, &self.model, &path))?;
        if self.exl3_exact {
            std::sync::Arc::get_mut(&mut m.model)
                .expect("a model just loaded is not shared yet")
                .exl3_activations = crate::backend::cpu::Exl3Activations::Exact;
        }
        Ok(m)
    }
}

/// Sampling flags, named as mlx-lm names them.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temp: f32,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the top token.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Tokens min-p never removes.
    #[arg(long, default_value_t = 1)]
    pub min_tokens_to_keep: usize,
    /// Keep only the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub top_k: usize,
    /// Random seed for sampling.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Multiplicative penalty on recently seen tokens (1: off).
    #[arg(long, allow_negative_numbers = true)]
    pub repetition_penalty: Option<f32>,
    #[arg(long, default_value_t = 20)]
    pub repetition_context_size: usize,
    /// Subtracted once from the logit of each recently seen token.
    #[arg(long, allow_negative_numbers = true)]
    pub presence_penalty: Option<f32>,
    #[arg(long, default_value_t = 20)]
    pub presence_context_size: usize,
    /// Subtracted from a token's logit for each recent occurrence.
    #[arg(long, allow_negative_numbers = true)]
    pub frequency_penalty: Option<f32>,
    #[arg(long, default_value_t = 20)]
    pub frequency_context_size: usize,
    /// Additive logit bias as JSON, e.g. '{"504": -100}'.
    #[arg(long)]
    pub logit_bias: Option<String>,
}

impl SamplingArgs {
    pub fn params(&self) -> Result<SamplerParams> {
        let logit_bias = match &self.logit_bias {
            None => Vec::new(),
            Some(s) => {
                let m: std::collections::BTreeMap<String, f32> =
                    serde_json::from_str(s).map_err(|e| {
                        anyhow::anyhow!("--logit-bias must be a JSON object of id: bias ({e})")
                    })?;
                m.into_iter()
                    .map(|(k, v)| {
                        k.trim().parse::<u32>().map(|id| (id, v)).map_err(|_| {
                            anyhow::anyhow!("--logit-bias key '{k}' is not a token id")
                        })
                    })
                    .collect::<Result<_>>()?
            }
        };
        Ok(SamplerParams {
            temp: self.temp,
            top_p: self.top_p,
            min_p: self.min_p,
            min_tokens_to_keep: self.min_tokens_to_keep,
            top_k: self.top_k,
            logit_bias,
            repetition_penalty: self.repetition_penalty,
            repetition_context_size: self.repetition_context_size,
            presence_penalty: self.presence_penalty,
            presence_context_size: self.presence_context_size,
            frequency_penalty: self.frequency_penalty,
            frequency_context_size: self.frequency_context_size,
            seed: self.seed,
        })
    }
}

pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Eval(a) => eval::run(a),
        Command::Quantize(a) => quantize::run(a),
        Command::Pull { model } => {
            let path = trellm_hub::pull(&model, true)?;
            output::print(&format!("{}\n", path.display()))?;
            Ok(())
        }
        Command::List(a) => models::list(a),
        Command::Rm(a) => models::rm(a),
        Command::Info(a) => models::info(a),
        Command::Completions(a) => models::completions(a),
    }
}

/// Peak resident memory of this process in bytes (Linux), if known.
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// mlx-lm style statistics on stderr.
pub fn print_stats(stats: &crate::engine::GenerationStats) {
    let rate = |n: usize, d: std::time::Duration| n as f64 / d.as_secs_f64().max(1e-9);
    let mut e = std::io::stderr().lock();
    let _ = writeln!(e, "==========");
    let _ = writeln!(
        e,
        "Prompt: {} tokens, {:.3} tokens-per-sec",
        stats.prompt_tokens,
        rate(stats.prompt_tokens, stats.prompt_time)
    );
    let _ = writeln!(
        e,
        "Generation: {} tokens, {:.3} tokens-per-sec",
        stats.generated_tokens,
        rate(stats.generated_tokens, stats.generation_time)
    );
    if let Some(b) = peak_rss_bytes() {
        let _ = writeln!(e, "Peak memory: {:.3} GB", b as f64 / 1e9);
    }
}
