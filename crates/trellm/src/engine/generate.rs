//! One request at a time through the scheduler: the path of `trellm generate` and `chat`.

use std::time::Duration;

use anyhow::{anyhow, Result};

use super::scheduler::{Engine, EngineError, Event, FinishReason, Request};

/// Prompt tokens per forward pass during prefill (mlx-lm's default step).
pub const PREFILL_STEP: usize = 2048;

/// Prompt tokens per step when serving many: a prompt delays running streams by about one
/// chunk's prefill.
pub const PREFILL_CHUNK_SERVE: usize = 512;

/// One generated token.
#[derive(Debug, Clone)]
pub struct Step {
    pub token: u32,
    /// Its log-probability (after the processors, before the filters).
    pub logprob: f32,
    /// `(id, logprob)` of the most likely tokens, after the processors and before the filters.
    pub top: Vec<(u32, f32)>,
}

#[derive(Debug, Clone, Default)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
    pub prompt_time: Duration,
    pub generated_tokens: usize,
    /// From the first generated token to the last.
    pub generation_time: Duration,
    /// For each prompt position, the top-K of the next-token distribution (when requested).
    pub prompt_logprobs: Vec<Vec<(u32, f32)>>,
}

/// What the caller wants after each token.
pub enum Flow {
    Continue,
    Stop,
}

/// How a generation ended.
#[derive(Debug)]
pub struct Finished {
    pub reason: FinishReason,
    /// Text held back until the end (a possible start of a stop string that was not one).
    pub tail: String,
    pub stats: GenerationStats,
}

/// Runs `req` alone on `engine`, calling `on_token` with each token and the text it made final;
/// `Flow::Stop` cancels the request.
pub fn generate(
    engine: &mut Engine<'_>,
    req: Request,
    mut on_token: impl FnMut(&Step, &str) -> Flow,
) -> Result<Finished> {
    let id = engine.submit(req).map_err(anyhow::Error::from)?;
    loop {
        if !engine.has_work() {
            return Err(anyhow!("the request vanished from the engine"));
        }
        for ev in engine
            .step()
            .map_err(|e: EngineError| anyhow::Error::from(e))?
        {
            match ev {
                Event::Token { id: i, step, text } if i == id => {
                    if let Flow::Stop = on_token(&step, &text) {
                        engine.cancel(id);
                    }
                }
                Event::Done {
                    id: i,
                    reason,
                    text,
                    stats,
                } if i == id => {
                    return Ok(Finished {
                        reason,
                        tail: text,
                        stats,
                    });
                }
                _ => {}
            }
        }
    }
}
