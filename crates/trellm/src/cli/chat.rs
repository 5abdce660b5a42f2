//! `trellm chat`: a multi-turn conversation in the terminal.

use std::io::{BufRead, Write};

use anyhow::{bail, Result};
use clap::Args;
use trellm_tokenizer::ChatMessage;

use super::{DeviceArgs, ModelArgs, SamplingArgs};
use crate::backend;
use crate::engine::generate::Flow;
use crate::engine::{generate, GenerateOptions};

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// System prompt for the conversation.
    #[arg(long, visible_alias = "system-prompt")]
    pub system: Option<String>,
    /// Maximum tokens per reply.
    #[arg(long, short = 'm', default_value_t = 256)]
    pub max_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// Positions a GPU's KV cache holds for a chat session (at most the model's context).
const CHAT_GPU_CONTEXT: usize = 32768;

pub fn run(a: ChatArgs) -> Result<()> {
    super::flags::check_sampling(&a.sampling)?;
    let sampler = a.sampling.params()?;
    let m = a.model.load()?;
    let tok = m.tokenizer()?;
    if !tok.has_chat_template() {
        bail!(
            "{} has no chat template; use `trellm generate`",
            m.path.display()
        );
    }
    let eos_ids = m.eos_ids();
    // One sequence for the session (a GPU uploads the weights once); each turn re-runs the chat.
    let capacity = m.decoder.cfg.max_context.min(CHAT_GPU_CONTEXT);
    let mut seq = backend::sequence(&m.decoder, a.device.device, capacity)?;
    let mut history: Vec<ChatMessage> = Vec::new();
    if let Some(s) = &a.system {
        history.push(ChatMessage {
            role: "system".into(),
            content: s.clone(),
        });
    }
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    eprintln!(
        "[INFO] Starting chat session with {}. To exit, enter 'q'; 'r' resets the chat.",
        m.path.display()
    );
    loop {
        write!(out, ">> ")?;
        out.flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            writeln!(out)?;
            return Ok(());
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "q" => return Ok(()),
            "r" => {
                history.truncate(usize::from(a.system.is_some()));
                continue;
            }
            "" => continue,
            _ => {}
        }
        history.push(ChatMessage {
            role: "user".into(),
            content: line.to_string(),
        });
        let ids = tok.encode(&tok.apply_chat_template(&history, true)?, false)?;
        let opts = GenerateOptions {
            max_tokens: a.max_tokens,
            sampler: sampler.clone(),
            eos_ids: eos_ids.clone(),
            ..Default::default()
        };
        let mut dec = tok.stream_decoder();
        let mut reply = String::new();
        let mut err = None;
        generate(&m.decoder.cfg, seq.as_mut(), &ids, &opts, |step| {
            if eos_ids.contains(&step.token) {
                return Flow::Continue;
            }
            match dec.push(step.token) {
                Ok(chunk) => {
                    reply.push_str(&chunk);
                    let _ = write!(out, "{chunk}");
                    let _ = out.flush();
                    Flow::Continue
                }
                Err(e) => {
                    err = Some(e);
                    Flow::Stop
                }
            }
        })?;
        if let Some(e) = err {
            return Err(e.into());
        }
        let tail = dec.finish()?;
        reply.push_str(&tail);
        writeln!(out, "{tail}")?;
        history.push(ChatMessage {
            role: "assistant".into(),
            content: reply,
        });
    }
}
