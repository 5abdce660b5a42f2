//! `trellm generate --requests FILE.jsonl`: many requests at once through the scheduler.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use trellm_tokenizer::ChatMessage;

use super::generate::{eos_ids, prompt_ids, GenerateArgs, Output, PromptSpec};
use crate::engine::{Event, FinishReason, Request, SeqId};

/// One line of the file. Unset fields take the command line's values.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Line {
    id: Option<serde_json::Value>,
    messages: Option<Vec<ChatMessage>>,
    prompt: Option<String>,
    prompt_ids: Option<Vec<u32>>,
    system: Option<String>,
    raw: Option<bool>,
    max_tokens: Option<usize>,
    logprobs: Option<usize>,
    prompt_logprobs: Option<usize>,
    stop: Option<Vec<String>>,
    temp: Option<f32>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    min_tokens_to_keep: Option<usize>,
    top_k: Option<usize>,
    seed: Option<u64>,
    repetition_penalty: Option<f32>,
    repetition_context_size: Option<usize>,
    presence_penalty: Option<f32>,
    presence_context_size: Option<usize>,
    frequency_penalty: Option<f32>,
    frequency_context_size: Option<usize>,
    logit_bias: Option<BTreeMap<String, f32>>,
}

/// Top-K `(id, logprob)` lists, one per position.
type TopLists = Vec<Vec<(u32, f32)>>;

/// A request's results as they arrive.
#[derive(Default)]
struct Collected {
    ids: Vec<u32>,
    logprobs: TopLists,
    text: String,
    /// How it ended, and its prompt logprobs.
    done: Option<(FinishReason, TopLists)>,
}

pub fn run(a: &GenerateArgs, path: &Path) -> Result<()> {
    if a.max_seqs == 0 {
        bail!("--max-seqs must be at least 1");
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let lines: Vec<(usize, Line)> = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(n, l)| {
            serde_json::from_str(l)
                .map(|v| (n + 1, v))
                .map_err(|e| anyhow!("{}:{}: {e}", path.display(), n + 1))
        })
        .collect::<Result<_>>()?;
    if lines.is_empty() {
        bail!("{}: no requests", path.display());
    }
    let m = a.model.load()?;
    let eos = eos_ids(a, &m)?;
    let mut reqs = Vec::with_capacity(lines.len());
    for (n, l) in &lines {
        let at = |e: anyhow::Error| anyhow!("{}:{n}: {e}", path.display());
        let ids = prompt_ids(
            PromptSpec {
                prompt: l.prompt.as_deref().or(a.prompt.as_deref()),
                messages: l.messages.clone(),
                prompt_ids: l.prompt_ids.as_deref(),
                system: l.system.as_deref().or(a.system.as_deref()),
                raw: l.raw.unwrap_or(a.raw),
            },
            &m,
        )
        .map_err(at)?;
        let mut s = a.sampling.clone();
        // Fields a line sets override the flags'.
        macro_rules! take {
            ($($f:ident),*) => { $( if let Some(v) = l.$f { s.$f = v; } )* };
        }
        macro_rules! take_opt {
            ($($f:ident),*) => { $( if l.$f.is_some() { s.$f = l.$f; } )* };
        }
        take!(
            temp,
            top_p,
            min_p,
            min_tokens_to_keep,
            top_k,
            repetition_context_size,
            presence_context_size,
            frequency_context_size
        );
        take_opt!(
            seed,
            repetition_penalty,
            presence_penalty,
            frequency_penalty
        );
        if let Some(b) = &l.logit_bias {
            s.logit_bias = Some(serde_json::to_string(b)?);
        }
        let logprobs = l.logprobs.unwrap_or(a.logprobs);
        let prompt_logprobs = l.prompt_logprobs.unwrap_or(a.prompt_logprobs);
        reqs.push(Request {
            prompt: ids,
            max_tokens: l.max_tokens.unwrap_or(a.max_tokens),
            sampler: s.params().map_err(at)?,
            logprobs,
            prompt_logprobs,
            eos_ids: eos.clone(),
            stop: l.stop.clone().unwrap_or_else(|| a.stop.clone()),
            constraint: None,
        });
    }
    let positions = reqs
        .iter()
        .map(|r| {
            r.prompt
                .len()
                .saturating_add(r.max_tokens.saturating_sub(1))
        })
        .max()
        .unwrap_or(1);
    let mut engine = a.device.engine(&m, a.max_seqs.min(reqs.len()), positions)?;
    let mut seq_ids: Vec<SeqId> = Vec::with_capacity(reqs.len());
    for (r, (n, _)) in reqs.iter().zip(&lines) {
        let id = engine
            .submit(r.clone())
            .map_err(|e| anyhow!("{}:{n}: {e}", path.display()))?;
        seq_ids.push(id);
    }
    let mut got: Vec<Collected> = (0..reqs.len()).map(|_| Collected::default()).collect();
    let slot = |id: SeqId| seq_ids.iter().position(|&s| s == id).expect("submitted");
    let mut stdout = std::io::stdout().lock();
    let mut printed = 0;
    while engine.has_work() {
        for ev in engine.step()? {
            match ev {
                Event::Token { id, step, text } => {
                    let c = &mut got[slot(id)];
                    c.ids.push(step.token);
                    c.logprobs.push(step.top);
                    c.text.push_str(&text);
                }
                Event::Done {
                    id,
                    reason,
                    text,
                    stats,
                } => {
                    let c = &mut got[slot(id)];
                    c.text.push_str(&text);
                    c.done = Some((reason, stats.prompt_logprobs));
                }
            }
        }
        // Results go out in input order, each as soon as those before it are out.
        while let Some(c) = got.get(printed).filter(|c| c.done.is_some()) {
            let (reason, prompt_lp) = c.done.as_ref().expect("done");
            let mut obj = Output {
                prompt_ids: &reqs[printed].prompt,
                ids: &c.ids,
                text: m.has_tokenizer().then_some(&c.text),
                logprobs: &c.logprobs,
                prompt_logprobs: (reqs[printed].prompt_logprobs > 0).then_some(prompt_lp),
                reason: reason.clone(),
            }
            .json();
            obj["id"] = lines[printed]
                .1
                .id
                .clone()
                .unwrap_or_else(|| printed.into());
            if writeln!(stdout, "{obj}")
                .and_then(|_| stdout.flush())
                .is_err()
            {
                return Ok(());
            }
            printed += 1;
        }
    }
    Ok(())
}
