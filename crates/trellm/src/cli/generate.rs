//! `trellm generate`.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use trellm_tokenizer::ChatMessage;

use super::{output, print_stats, DeviceArgs, ModelArgs, SamplingArgs};
use crate::backend;
use crate::engine::generate::Flow;
use crate::engine::stop::StopStrings;
use crate::engine::{generate, GenerateOptions};
use crate::model::load::LoadedModel;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// The prompt (rendered through the chat template unless --raw); `-` reads it from stdin.
    #[arg(long, short = 'p', conflicts_with_all = ["messages", "prompt_ids", "file"])]
    pub prompt: Option<String>,
    /// Read the prompt from this file.
    #[arg(long, short = 'f', conflicts_with_all = ["messages", "prompt_ids"])]
    pub file: Option<PathBuf>,
    /// A JSON file with a chat: [{"role": "user", "content": "..."}, ...].
    #[arg(long, conflicts_with = "prompt_ids")]
    pub messages: Option<PathBuf>,
    /// Prompt token ids, comma separated; no tokenizer needed.
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// System prompt placed before the user's message.
    #[arg(long, visible_alias = "system-prompt")]
    pub system: Option<String>,
    /// Use the prompt as is, without the chat template.
    #[arg(long, visible_alias = "ignore-chat-template")]
    pub raw: bool,
    /// Maximum tokens to generate.
    #[arg(
        long,
        short = 'm',
        default_value_t = 100,
        allow_negative_numbers = true
    )]
    pub max_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Stop when the text contains this string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Extra token that ends generation (repeatable), as text.
    #[arg(long)]
    pub extra_eos_token: Vec<String>,
    /// Print one JSON object (prompt ids, ids, text, logprobs) instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Report the top-K log-probabilities at each generated step (with --json).
    #[arg(long, default_value_t = 0)]
    pub logprobs: usize,
    /// Report the top-K next-token log-probabilities at each prompt position (with --json).
    #[arg(long, default_value_t = 0)]
    pub prompt_logprobs: usize,
    /// Print no statistics.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

/// Turns the prompt flags into token ids.
fn prompt_ids(a: &GenerateArgs, m: &LoadedModel, prompt: Option<String>) -> Result<Vec<u32>> {
    if let Some(ids) = &a.prompt_ids {
        return Ok(ids.clone());
    }
    let tok = m.tokenizer()?;
    let mut messages = Vec::new();
    if let Some(path) = &a.messages {
        let text = read_text(path)?;
        messages = serde_json::from_str::<Vec<ChatMessage>>(&text).map_err(|e| {
            anyhow!(
                "{}: not a JSON list of {{role, content}} messages ({e})",
                path.display()
            )
        })?;
        if messages.is_empty() {
            bail!("{}: the chat is empty", path.display());
        }
    }
    let prompt = prompt.unwrap_or_else(|| "hello".to_string());
    let use_template = !a.raw && tok.has_chat_template();
    if a.messages.is_some() && !use_template {
        bail!("--messages needs a model with a chat template (and no --raw)");
    }
    let ids = if use_template {
        if a.messages.is_none() {
            if let Some(s) = &a.system {
                messages.push(ChatMessage {
                    role: "system".into(),
                    content: s.clone(),
                });
            }
            messages.push(ChatMessage {
                role: "user".into(),
                content: prompt,
            });
        }
        let text = tok.apply_chat_template(&messages, true)?;
        tok.encode(&text, false)?
    } else {
        tok.encode(&prompt, true)?
    };
    Ok(ids)
}

pub fn run(a: GenerateArgs) -> Result<()> {
    check_flags(&a)?;
    let prompt = read_prompt(&a)?;
    let sampler = a.sampling.params()?;
    let m = a.model.load()?;
    for (flag, k) in [
        ("--logprobs", a.logprobs),
        ("--prompt-logprobs", a.prompt_logprobs),
    ] {
        super::flags::check_logprobs(flag, k, m.decoder.cfg.vocab)?;
    }
    let ids = prompt_ids(&a, &m, prompt)?;
    let mut eos_ids = m.eos_ids();
    for t in &a.extra_eos_token {
        let tok = m.tokenizer()?;
        eos_ids.push(
            tok.token_to_id(t)
                .ok_or_else(|| anyhow!("--extra-eos-token '{t}' is not a token"))?,
        );
    }
    let opts = GenerateOptions {
        max_tokens: a.max_tokens,
        sampler,
        logprobs: a.logprobs,
        eos_ids: eos_ids.clone(),
        prompt_logprobs: a.prompt_logprobs,
    };
    let mut decoder = m.tokenizer().ok().map(|t| t.stream_decoder());
    let mut stops = StopStrings::new(a.stop.clone());
    let mut out_ids = Vec::new();
    let mut logprobs = Vec::new();
    let mut stdout = std::io::stdout().lock();
    let mut failure: Option<anyhow::Error> = None;
    // The reader of stdout went away: stop, and end quietly as `cat` does.
    let mut closed = false;
    let capacity = (ids.len().saturating_add(a.max_tokens).saturating_add(1))
        .min(m.decoder.cfg.max_context.saturating_add(1));
    let mut seq = backend::sequence(&m.decoder, a.device.device, capacity)?;
    let stats = generate(&m.decoder.cfg, seq.as_mut(), &ids, &opts, |step| {
        out_ids.push(step.token);
        logprobs.push(step.top.clone());
        // EOS ends the text; it is reported in the ids.
        if eos_ids.contains(&step.token) {
            return Flow::Continue;
        }
        if let Some(d) = decoder.as_mut() {
            let chunk = match d.push(step.token) {
                Ok(c) => c,
                Err(e) => {
                    failure = Some(e.into());
                    return Flow::Stop;
                }
            };
            let shown = stops.push(&chunk);
            if !a.json && !shown.is_empty() {
                match output::emit(&mut stdout, shown) {
                    Ok(true) => {}
                    Ok(false) => {
                        closed = true;
                        return Flow::Stop;
                    }
                    Err(e) => {
                        failure = Some(e);
                        return Flow::Stop;
                    }
                }
            }
            if stops.stopped() {
                return Flow::Stop;
            }
        }
        Flow::Continue
    })?;
    if let Some(e) = failure {
        return Err(e);
    }
    if let Some(d) = decoder.as_mut() {
        let tail = d.finish()?;
        stops.push(&tail);
    }
    let rest = stops.finish().to_string();
    if a.json {
        let text = m.has_tokenizer().then(|| stops.text().to_string());
        let pairs = |v: &Vec<(u32, f32)>| {
            v.iter()
                .map(|&(i, p)| serde_json::json!([i, p]))
                .collect::<Vec<_>>()
        };
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let per_s = |n: usize, d: std::time::Duration| n as f64 / d.as_secs_f64().max(1e-9);
        let last_eos = out_ids.last().is_some_and(|t| eos_ids.contains(t));
        let finish_reason = if last_eos || stops.stopped() {
            "stop"
        } else if out_ids.len() >= a.max_tokens {
            "length"
        } else {
            "context"
        };
        let mut obj = serde_json::json!({
            "prompt_ids": ids,
            "ids": out_ids,
            "text": text,
            "logprobs": logprobs.iter().map(pairs).collect::<Vec<_>>(),
            "finish_reason": finish_reason,
            "timings": {
                "prompt_n": stats.prompt_tokens,
                "prompt_ms": ms(stats.prompt_time),
                "prompt_per_second": per_s(stats.prompt_tokens, stats.prompt_time),
                "predicted_n": stats.generated_tokens,
                "predicted_ms": ms(stats.generation_time),
                "predicted_per_second": per_s(stats.generated_tokens, stats.generation_time),
            },
        });
        if a.prompt_logprobs > 0 {
            obj["prompt_logprobs"] = stats
                .prompt_logprobs
                .iter()
                .map(pairs)
                .collect::<Vec<_>>()
                .into();
        }
        output::emit(&mut stdout, &format!("{obj}\n"))?;
    } else if !closed {
        output::emit(&mut stdout, &format!("{rest}\n"))?;
    }
    if !a.quiet {
        print_stats(&stats);
    }
    Ok(())
}

/// Flag checks that need no model, before anything is loaded; warnings for flags that would
/// have no effect.
fn check_flags(a: &GenerateArgs) -> Result<()> {
    if (a.logprobs > 0 || a.prompt_logprobs > 0) && !a.json {
        bail!("--logprobs and --prompt-logprobs need --json");
    }
    super::flags::check_sampling(&a.sampling)?;
    for (flag, k) in [
        ("--logprobs", a.logprobs),
        ("--prompt-logprobs", a.prompt_logprobs),
    ] {
        super::flags::check_logprobs(flag, k, crate::model::config::LIMITS.vocab)?;
    }
    if a.system.is_some() {
        let why = if a.raw {
            Some("--raw skips the chat template")
        } else if a.messages.is_some() {
            Some("--messages gives the whole chat")
        } else if a.prompt_ids.is_some() {
            Some("--prompt-ids are used as they are")
        } else {
            None
        };
        if let Some(why) = why {
            eprintln!("trellm: warning: --system has no effect: {why}");
        }
    }
    if a.raw && a.prompt_ids.is_some() {
        eprintln!("trellm: warning: --raw has no effect with --prompt-ids");
    }
    Ok(())
}

/// Bytes a prompt or chat file may hold (far beyond any model's context).
const MAX_PROMPT_BYTES: u64 = 64 << 20;

/// The prompt text: `--prompt TEXT`, `--prompt -` (stdin), `--file FILE`, or none.
fn read_prompt(a: &GenerateArgs) -> Result<Option<String>> {
    use std::io::Read;
    if let Some(path) = &a.file {
        return read_text(path).map(Some);
    }
    match a.prompt.as_deref() {
        Some("-") => {
            let mut buf = Vec::new();
            std::io::stdin()
                .lock()
                .take(MAX_PROMPT_BYTES + 1)
                .read_to_end(&mut buf)
                .context("cannot read the prompt from stdin")?;
            if buf.len() as u64 > MAX_PROMPT_BYTES {
                bail!(
                    "the prompt on stdin is larger than {} MiB",
                    MAX_PROMPT_BYTES >> 20
                );
            }
            String::from_utf8(buf)
                .map(Some)
                .map_err(|_| anyhow!("the prompt on stdin is not UTF-8 text"))
        }
        p => Ok(p.map(str::to_string)),
    }
}

/// A text file given by a flag, at most [`MAX_PROMPT_BYTES`].
fn read_text(path: &std::path::Path) -> Result<String> {
    use std::io::Read;
    let f = std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut buf = Vec::new();
    f.take(MAX_PROMPT_BYTES + 1)
        .read_to_end(&mut buf)
        .with_context(|| format!("cannot read {}", path.display()))?;
    if buf.len() as u64 > MAX_PROMPT_BYTES {
        bail!(
            "{} is larger than {} MiB",
            path.display(),
            MAX_PROMPT_BYTES >> 20
        );
    }
    String::from_utf8(buf).map_err(|_| anyhow!("{} is not UTF-8 text", path.display()))
}
