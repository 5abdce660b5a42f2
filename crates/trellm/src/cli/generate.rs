//! `trellm generate`.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use trellm_tokenizer::ChatMessage;

use super::{output, print_stats, DeviceArgs, ModelArgs, SamplingArgs};
use crate::engine::{generate, FinishReason, Flow, Request};
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
    /// Maximum tokens to generate (`-n` / `--n-predict` as llama.cpp spells it).
    #[arg(
        long,
        short = 'm',
        short_alias = 'n',
        visible_alias = "n-predict",
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
    /// Run many requests at once from a JSON-lines file: one object a line with `messages`,
    /// `prompt` (and `raw`) or `prompt_ids`, plus `max_tokens`, `seed`, `logprobs`, `stop` and
    /// the sampling fields named as the flags are (the flags give the defaults). Prints one
    /// JSON line per request, in input order, as --json does, with `id` and `finish_reason`.
    #[arg(long, conflicts_with_all = ["prompt", "messages", "prompt_ids", "file"])]
    pub requests: Option<PathBuf>,
    /// Requests running at once with --requests.
    #[arg(long, default_value_t = 16)]
    pub max_seqs: usize,
    /// Print no statistics.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

/// A prompt as the flags (or a `--requests` line) give it.
pub struct PromptSpec<'a> {
    pub prompt: Option<&'a str>,
    pub messages: Option<Vec<ChatMessage>>,
    pub prompt_ids: Option<&'a [u32]>,
    pub system: Option<&'a str>,
    pub raw: bool,
}

/// Turns a prompt into token ids: ids as given, or text through the chat template (unless raw
/// or the model has none).
pub fn prompt_ids(p: PromptSpec<'_>, m: &LoadedModel) -> Result<Vec<u32>> {
    if let Some(ids) = p.prompt_ids {
        return Ok(ids.to_vec());
    }
    let tok = m.tokenizer()?;
    let prompt = p.prompt.unwrap_or("hello").to_string();
    let use_template = !p.raw && tok.has_chat_template();
    if p.messages.is_some() && !use_template {
        bail!("messages need a model with a chat template (and no --raw)");
    }
    let ids = if use_template {
        let messages = match p.messages {
            Some(m) => m,
            None => {
                let mut v = Vec::new();
                if let Some(s) = p.system {
                    v.push(ChatMessage::new("system", s));
                }
                v.push(ChatMessage::new("user", prompt));
                v
            }
        };
        m.chat_prompt(&messages)?
    } else {
        tok.encode(&prompt, true)?
    };
    Ok(ids)
}

/// Reads a `--messages` file.
fn read_messages(path: &Path) -> Result<Vec<ChatMessage>> {
    let text = read_text(path)?;
    let messages = serde_json::from_str::<Vec<ChatMessage>>(&text).map_err(|e| {
        anyhow!(
            "{}: not a JSON list of {{role, content}} messages ({e})",
            path.display()
        )
    })?;
    if messages.is_empty() {
        bail!("{}: the chat is empty", path.display());
    }
    Ok(messages)
}

/// Token ids that end generation: the model's, plus `--extra-eos-token`s.
pub fn eos_ids(a: &GenerateArgs, m: &LoadedModel) -> Result<Vec<u32>> {
    let mut eos_ids = m.eos_ids();
    for t in &a.extra_eos_token {
        let tok = m.tokenizer()?;
        eos_ids.push(
            tok.token_to_id(t)
                .ok_or_else(|| anyhow!("--extra-eos-token '{t}' is not a token"))?,
        );
    }
    Ok(eos_ids)
}

pub fn run(a: GenerateArgs) -> Result<()> {
    check_flags(&a)?;
    let prompt = read_prompt(&a)?;
    let sampler = a.sampling.params()?;
    if let Some(path) = &a.requests {
        return super::requests::run(&a, path);
    }
    let m = a.model.load()?;
    for (flag, k) in [
        ("--logprobs", a.logprobs),
        ("--prompt-logprobs", a.prompt_logprobs),
    ] {
        super::flags::check_logprobs(flag, k, m.model.cfg.vocab)?;
    }
    let messages = a.messages.as_deref().map(read_messages).transpose()?;
    let ids = prompt_ids(
        PromptSpec {
            prompt: prompt.as_deref(),
            messages,
            prompt_ids: a.prompt_ids.as_deref(),
            system: a.system.as_deref(),
            raw: a.raw,
        },
        &m,
    )?;
    let eos_ids = eos_ids(&a, &m)?;
    let req = Request {
        prompt: ids.clone(),
        max_tokens: a.max_tokens,
        sampler,
        logprobs: a.logprobs,
        prompt_logprobs: a.prompt_logprobs,
        eos_ids,
        stop: a.stop.clone(),
        constraint: None,
    };
    let mut engine = a.device.engine(
        &m,
        1,
        ids.len().saturating_add(a.max_tokens.saturating_sub(1)),
    )?;
    let mut out_ids = Vec::new();
    let mut logprobs = Vec::new();
    let mut text = String::new();
    let mut stdout = std::io::stdout().lock();
    let mut failure: Option<anyhow::Error> = None;
    // The reader of stdout went away: stop, and end quietly as `cat` does.
    let mut closed = false;
    let done = generate(&mut engine, req, |step, shown| {
        out_ids.push(step.token);
        logprobs.push(step.top.clone());
        text.push_str(shown);
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
        Flow::Continue
    })?;
    if let Some(e) = failure {
        return Err(e);
    }
    text.push_str(&done.tail);
    let stats = done.stats;
    if a.json {
        let mut obj = Output {
            prompt_ids: &ids,
            ids: &out_ids,
            text: m.has_tokenizer().then_some(&text),
            logprobs: &logprobs,
            prompt_logprobs: (a.prompt_logprobs > 0).then_some(&stats.prompt_logprobs),
            reason: done.reason,
        }
        .json();
        obj["timings"] = timings(&stats);
        output::emit(&mut stdout, &format!("{obj}\n"))?;
    } else if !closed {
        output::emit(&mut stdout, &format!("{}\n", done.tail))?;
    }
    if !a.quiet {
        print_stats(&stats);
    }
    Ok(())
}

/// Prompt and generation times, named as llama.cpp's server names them.
pub fn timings(stats: &crate::engine::GenerationStats) -> serde_json::Value {
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let per_s = |n: usize, d: std::time::Duration| n as f64 / d.as_secs_f64().max(1e-9);
    serde_json::json!({
        "prompt_n": stats.prompt_tokens,
        "prompt_ms": ms(stats.prompt_time),
        "prompt_per_second": per_s(stats.prompt_tokens, stats.prompt_time),
        "predicted_n": stats.generated_tokens,
        "predicted_ms": ms(stats.generation_time),
        "predicted_per_second": per_s(stats.generated_tokens, stats.generation_time),
    })
}

/// Flag checks that need no model, before anything is loaded; warnings for flags that would
/// have no effect.
fn check_flags(a: &GenerateArgs) -> Result<()> {
    if (a.logprobs > 0 || a.prompt_logprobs > 0) && !a.json && a.requests.is_none() {
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
pub fn read_text(path: &Path) -> Result<String> {
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

/// What `--json` prints for one generation.
pub struct Output<'a> {
    pub prompt_ids: &'a [u32],
    pub ids: &'a [u32],
    pub text: Option<&'a String>,
    pub logprobs: &'a [Vec<(u32, f32)>],
    pub prompt_logprobs: Option<&'a Vec<Vec<(u32, f32)>>>,
    pub reason: FinishReason,
}

impl Output<'_> {
    pub fn json(&self) -> serde_json::Value {
        let pairs = |v: &Vec<(u32, f32)>| {
            v.iter()
                .map(|&(i, p)| serde_json::json!([i, p]))
                .collect::<Vec<_>>()
        };
        let mut obj = serde_json::json!({
            "prompt_ids": self.prompt_ids,
            "ids": self.ids,
            "text": self.text,
            "logprobs": self.logprobs.iter().map(pairs).collect::<Vec<_>>(),
            "finish_reason": self.reason.as_str(),
        });
        if let Some(p) = self.prompt_logprobs {
            obj["prompt_logprobs"] = p.iter().map(pairs).collect::<Vec<_>>().into();
        }
        obj
    }
}
