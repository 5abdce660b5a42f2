//! `trellm chat`: a multi-turn conversation in the terminal.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Result};
use clap::Args;
use trellm_tokenizer::ChatMessage;

use super::{output, DeviceArgs, ModelArgs, SamplingArgs};
use crate::engine::{generate, FinishReason, Flow, Request};

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// System prompt for the conversation.
    #[arg(long, visible_alias = "system-prompt")]
    pub system: Option<String>,
    /// Maximum tokens per reply (`-n` / `--n-predict` as llama.cpp spells it).
    #[arg(
        long,
        short = 'm',
        short_alias = 'n',
        visible_alias = "n-predict",
        default_value_t = 256
    )]
    pub max_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// Positions the KV cache holds for a chat session (at most the model's context).
const CHAT_CONTEXT: usize = 32768;

/// Set while a reply is being generated: Ctrl-C then stops the reply, not the session.
static GENERATING: AtomicBool = AtomicBool::new(false);
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    if GENERATING.load(Ordering::SeqCst) {
        INTERRUPTED.store(true, Ordering::SeqCst);
    } else {
        // SAFETY: _exit is async-signal-safe; 130 is the shell's code for an interrupt.
        unsafe { libc::_exit(130) };
    }
}

/// Ctrl-C during a reply interrupts it and keeps the session; at the prompt it exits.
fn catch_ctrl_c() {
    // SAFETY: the handler only touches atomics and calls _exit.
    unsafe {
        libc::signal(
            libc::SIGINT,
            on_sigint as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
}

/// Where the user's lines come from: on a terminal a line editor (arrows, Ctrl-R, history kept
/// in `$TRELLM_HOME/chat_history`), else plain lines from stdin.
enum Lines<'a> {
    Editor(Box<rustyline::DefaultEditor>, PathBuf),
    Plain(std::io::StdinLock<'a>),
}

impl Lines<'_> {
    fn new() -> Self {
        use std::io::IsTerminal;
        if std::io::stdin().is_terminal() && std::io::stdout().is_terminal() {
            if let Ok(mut ed) = rustyline::DefaultEditor::new() {
                let history = trellm_hub::trellm_home().join("chat_history");
                let _ = ed.load_history(&history);
                return Lines::Editor(Box::new(ed), history);
            }
        }
        Lines::Plain(std::io::stdin().lock())
    }

    /// One line without its end; None at the end of the input.
    fn line(&mut self, prompt: &str, out: &mut dyn Write) -> Result<Option<String>> {
        match self {
            Lines::Editor(ed, _) => match ed.readline(prompt) {
                Ok(l) => Ok(Some(l)),
                // Ctrl-C at the prompt drops the line being typed.
                Err(rustyline::error::ReadlineError::Interrupted) => {
                    eprintln!("[Ctrl-D or 'q' ends the chat]");
                    Ok(Some(String::new()))
                }
                Err(rustyline::error::ReadlineError::Eof) => Ok(None),
                Err(e) => Err(anyhow::anyhow!("cannot read the terminal: {e}")),
            },
            Lines::Plain(input) => {
                if !output::emit(out, prompt)? {
                    return Ok(None);
                }
                let mut line = String::new();
                if input.read_line(&mut line)? == 0 {
                    return Ok(None);
                }
                Ok(Some(line.trim_end_matches(['\n', '\r']).to_string()))
            }
        }
    }

    /// Keeps a sent message in the editor's history (and its file).
    fn remember(&mut self, msg: &str) {
        if let Lines::Editor(ed, path) = self {
            let _ = ed.add_history_entry(msg);
            if let Some(dir) = path.parent() {
                let _ = std::fs::create_dir_all(dir);
            }
            let _ = ed.save_history(path);
        }
    }
}

/// One message from the user: a line; a line ending in `\` continues on the next; `"""` on a
/// line of its own starts and ends a block of lines. None at the end of the input.
fn read_message(input: &mut Lines, out: &mut dyn Write) -> Result<Option<String>> {
    let mut msg = String::new();
    let mut block = false;
    let mut first = true;
    loop {
        let prompt = if first { ">> " } else { ".. " };
        first = false;
        let Some(line) = input.line(prompt, out)? else {
            return Ok((!msg.is_empty()).then_some(msg));
        };
        if line.trim() == "\"\"\"" {
            if block {
                return Ok(Some(msg));
            }
            block = true;
            continue;
        }
        if block {
            msg.push_str(&line);
            msg.push('\n');
            continue;
        }
        if let Some(part) = line.strip_suffix('\\') {
            msg.push_str(part);
            msg.push('\n');
            continue;
        }
        msg.push_str(&line);
        return Ok(Some(msg));
    }
}

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
    // One engine for the session (a GPU uploads the weights once); each turn re-runs the chat.
    let capacity = m.model.cfg.max_context.min(CHAT_CONTEXT);
    let mut engine = a.device.engine(&m, 1, capacity)?;
    let first = usize::from(a.system.is_some());
    let mut history: Vec<ChatMessage> = Vec::new();
    if let Some(s) = &a.system {
        history.push(ChatMessage {
            role: "system".into(),
            content: s.clone(),
        });
    }
    let mut input = Lines::new();
    let mut out = std::io::stdout();
    eprintln!(
        "[INFO] Starting chat session with {}. To exit, enter 'q'; 'r' resets the chat; end a line \
         with \\ or wrap lines in \"\"\" for several lines; Ctrl-C stops a reply.",
        m.path.display()
    );
    catch_ctrl_c();
    loop {
        let Some(line) = read_message(&mut input, &mut out)? else {
            let _ = output::emit(&mut out, "\n");
            return Ok(());
        };
        match line.trim() {
            "q" => return Ok(()),
            "r" => {
                history.truncate(first);
                continue;
            }
            "" => continue,
            _ => {}
        }
        input.remember(&line);
        history.push(ChatMessage {
            role: "user".into(),
            content: line,
        });
        // The whole chat must fit the context with room for a reply: drop the oldest exchanges.
        let mut dropped = 0;
        let ids = loop {
            let ids = m.chat_prompt(&history)?;
            if ids.len() < capacity {
                break Some(ids);
            }
            if history.len() - first <= 1 {
                eprintln!(
                    "[this message is {} tokens, more than the model's context of {capacity}: not sent]",
                    ids.len()
                );
                history.pop();
                break None;
            }
            history.drain(first..(first + 2).min(history.len() - 1));
            dropped += 1;
        };
        if dropped > 0 {
            eprintln!(
                "[the conversation no longer fits the model's context of {capacity} tokens: \
                 the {dropped} oldest exchange(s) are dropped; 'r' starts afresh]"
            );
        }
        let Some(ids) = ids else { continue };
        let req = Request {
            max_tokens: a.max_tokens.min(capacity - ids.len() + 1),
            prompt: ids,
            sampler: sampler.clone(),
            eos_ids: eos_ids.clone(),
            ..Default::default()
        };
        let mut reply = String::new();
        let mut err = None;
        let mut closed = false;
        INTERRUPTED.store(false, Ordering::SeqCst);
        GENERATING.store(true, Ordering::SeqCst);
        let result = generate(&mut engine, req, |_, chunk| {
            if INTERRUPTED.load(Ordering::SeqCst) {
                return Flow::Stop;
            }
            reply.push_str(chunk);
            match output::emit(&mut out, chunk) {
                Ok(true) => Flow::Continue,
                Ok(false) => {
                    closed = true;
                    Flow::Stop
                }
                Err(e) => {
                    err = Some(e);
                    Flow::Stop
                }
            }
        });
        GENERATING.store(false, Ordering::SeqCst);
        let done = result?;
        if closed {
            return Ok(());
        }
        if let Some(e) = err {
            return Err(e);
        }
        reply.push_str(&done.tail);
        if !output::emit(&mut out, &format!("{}\n", done.tail))? {
            return Ok(());
        }
        if INTERRUPTED.swap(false, Ordering::SeqCst) {
            eprintln!("[interrupted]");
        } else if done.reason == FinishReason::Context
            || (done.reason == FinishReason::Length && done.stats.generated_tokens < a.max_tokens)
        {
            eprintln!(
                "[the reply reached the end of the model's context of {capacity} tokens; the next \
                 message drops the oldest exchanges, 'r' starts afresh]"
            );
        }
        history.push(ChatMessage {
            role: "assistant".into(),
            content: reply,
        });
    }
}
