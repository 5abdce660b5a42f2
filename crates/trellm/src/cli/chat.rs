//! `trellm chat`: a multi-turn conversation in the terminal.

use std::io::{BufRead, Write};

use anyhow::{bail, Result};
use clap::Args;
use trellm_tokenizer::ChatMessage;

use super::{DeviceArgs, ModelArgs, SamplingArgs};
use crate::engine::{generate, Flow, Request};

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

/// Positions the KV cache holds for a chat session (at most the model's context).
const CHAT_CONTEXT: usize = 32768;

pub fn run(a: ChatArgs) -> Result<()> {
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
    // One engine for the session (a GPU uploads the weights once); each turn re-runs the chat.
    let capacity = m.model.cfg.max_context.min(CHAT_CONTEXT);
    let mut engine = a.device.engine(&m, 1, capacity)?;
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
        let req = Request {
            max_tokens: a.max_tokens.min(capacity.saturating_sub(ids.len()) + 1),
            prompt: ids,
            sampler: sampler.clone(),
            eos_ids: eos_ids.clone(),
            ..Default::default()
        };
        let mut reply = String::new();
        let done = generate(&mut engine, req, |_, chunk| {
            reply.push_str(chunk);
            let _ = write!(out, "{chunk}");
            let _ = out.flush();
            Flow::Continue
        })?;
        reply.push_str(&done.tail);
        writeln!(out, "{}", done.tail)?;
        history.push(ChatMessage {
            role: "assistant".into(),
            content: reply,
        });
    }
}
