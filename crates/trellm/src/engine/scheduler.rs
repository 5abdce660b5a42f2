//! The scheduler: many requests share one loaded model. Each step it runs every decoding
//! sequence's next token together with prefill chunks of sequences still reading their prompt
//! (at most `prefill_chunk` prompt tokens a step, so a long prompt stalls running decodes by one
//! chunk at most), samples each sequence with its own sampler and seed, applies its stops, and
//! gives its KV blocks back when it ends or is cancelled.
//!
//! Admission reserves the blocks a request can ever need (prompt + `max_tokens`, capped at the
//! context), so a running sequence never finds the pool empty: a request that does not fit waits,
//! and one that could never fit is refused with [`EngineError::ResourceExhausted`].
//!
//! With the prefix cache on, a finished sequence leaves its full KV blocks in the cache, and an
//! admitted prompt starts from the longest cached prefix of its tokens. Cached blocks nobody uses
//! count as free (they are evicted when a sequence needs the room); blocks a running sequence
//! shares are counted beside the reservations, so the guarantee above still holds. A hit changes
//! rounding, not results: the rest of the prompt is computed in other chunk shapes (and a cached
//! reply was computed one token at a time), so logprobs move in the last bits (tested within
//! 1e-4, greedy ids equal).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use trellm_model::{Batch, BlockPool, BlockTable, Logits, ModelBackend, ModelConfig, Want};
use trellm_tokenizer::{StreamDecoder, Tokenizer};

use super::constraint::Constraint;
use super::generate::{GenerationStats, Step};
use super::prefix::PrefixCache;
use super::sampler::{top_indices, Sampler, SamplerParams};
use super::stop::StopStrings;
use crate::backend::BLOCK_SIZE;

/// Errors at the engine's boundary, typed so a server can map them to status codes.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request itself is wrong (empty prompt, id outside the vocabulary, bad sampling value).
    #[error("{0}")]
    BadRequest(String),
    /// The request cannot be served with the configured resources (it needs more KV cache than
    /// the pool holds).
    #[error("{0}")]
    ResourceExhausted(String),
    /// A failure inside the engine or the backend.
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

pub type SeqId = u64;

/// One generation request, in token ids.
#[derive(Debug, Clone, Default)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampler: SamplerParams,
    /// Top-K log-probabilities to report per generated token (0: none).
    pub logprobs: usize,
    /// Top-K next-token log-probabilities at every prompt position (0: none).
    pub prompt_logprobs: usize,
    /// Token ids that end generation (reported in the ids, not in the text).
    pub eos_ids: Vec<u32>,
    /// Strings that end generation (not part of the text); need a tokenizer.
    pub stop: Vec<String>,
    /// A grammar the output must follow (compiled with [`super::Constrainer`]); the sequence
    /// ends with `Stop` once it is complete.
    pub constraint: Option<Constraint>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS token.
    Stop,
    /// A stop string (not part of the text).
    StopString(String),
    /// `max_tokens`.
    Length,
    /// The model's context is full.
    Context,
    Cancelled,
}

impl FinishReason {
    /// Its name in `--json` output (OpenAI's, plus `context`).
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::StopString(_) => "stop",
            FinishReason::Length => "length",
            FinishReason::Context => "context",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

#[derive(Debug)]
pub enum Event {
    /// A generated token and the text it made final (held back while it may start a stop
    /// string; empty without a tokenizer).
    Token { id: SeqId, step: Step, text: String },
    /// The sequence ended; `text` is what was still held back.
    Done {
        id: SeqId,
        reason: FinishReason,
        text: String,
        stats: GenerationStats,
    },
}

#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Sequences running at once.
    pub max_seqs: usize,
    /// KV blocks in the pool (of [`BLOCK_SIZE`] positions).
    pub kv_blocks: usize,
    /// Prompt tokens per step, and the chunk size prompts are cut into.
    pub prefill_chunk: usize,
    /// Keep finished sequences' KV blocks for prompts that start the same way.
    pub prefix_cache: bool,
    /// Ranks the model is split over (tensor parallelism; 1: not split). On the CPU the ranks
    /// are simulated one after another; on CUDA rank i runs on GPU i.
    pub tensor_parallel: usize,
}

impl EngineOptions {
    /// Room for `max_seqs` sequences of `positions` each.
    pub fn for_sequences(max_seqs: usize, positions: usize) -> EngineOptions {
        EngineOptions {
            max_seqs,
            kv_blocks: max_seqs * positions.div_ceil(BLOCK_SIZE),
            prefill_chunk: super::generate::PREFILL_STEP,
            prefix_cache: true,
            tensor_parallel: 1,
        }
    }
}

struct Seq<'t> {
    id: SeqId,
    req: Request,
    table: BlockTable,
    /// Blocks reserved at admission.
    reserved: usize,
    /// Prompt tokens in the cache.
    prefilled: usize,
    /// Prompt and generated ids (the penalties' history).
    history: Vec<u32>,
    /// The sampled token not yet in the cache.
    pending: Option<u32>,
    sampler: Sampler,
    decoder: Option<StreamDecoder<'t>>,
    stops: StopStrings,
    stats: GenerationStats,
    started: Option<Instant>,
    first_token: Option<Instant>,
}

/// A model on some backend with its KV cache, the backend's type erased.
trait Runner: Send {
    fn step(&mut self, batch: &Batch) -> anyhow::Result<Logits>;
    fn copy_blocks(&mut self, copies: &[(u32, u32)]) -> anyhow::Result<()>;
}

struct Bound<M: ModelBackend> {
    model: Arc<M>,
    cache: M::Cache,
}

impl<M: ModelBackend> Runner for Bound<M> {
    fn step(&mut self, batch: &Batch) -> anyhow::Result<Logits> {
        self.model.step(batch, &mut self.cache)
    }
    fn copy_blocks(&mut self, copies: &[(u32, u32)]) -> anyhow::Result<()> {
        self.model.copy_blocks(&mut self.cache, copies)
    }
}

/// A model, its KV cache and the sequences sharing them.
pub struct Engine<'t> {
    cfg: ModelConfig,
    runner: Box<dyn Runner + 't>,
    pool: BlockPool,
    tokenizer: Option<&'t Tokenizer>,
    opts: EngineOptions,
    waiting: VecDeque<Seq<'t>>,
    running: Vec<Seq<'t>>,
    reserved: usize,
    prefix: PrefixCache,
    next_id: SeqId,
    /// Events of sequences that ended outside a step (cancelled while waiting).
    pending_events: Vec<Event>,
}

impl<'t> Engine<'t> {
    pub fn new<M: ModelBackend + 't>(
        model: Arc<M>,
        tokenizer: Option<&'t Tokenizer>,
        opts: EngineOptions,
    ) -> Result<Self, EngineError> {
        if opts.max_seqs == 0 || opts.kv_blocks == 0 || opts.prefill_chunk == 0 {
            return Err(EngineError::BadRequest(
                "the engine needs at least one sequence, one KV block and one prefill token a step"
                    .into(),
            ));
        }
        let cache = model.new_cache(opts.kv_blocks, BLOCK_SIZE)?;
        Ok(Engine {
            cfg: model.config().clone(),
            runner: Box::new(Bound { model, cache }),
            pool: BlockPool::new(opts.kv_blocks, BLOCK_SIZE),
            tokenizer,
            opts,
            waiting: VecDeque::new(),
            running: Vec::new(),
            reserved: 0,
            prefix: PrefixCache::default(),
            next_id: 0,
            pending_events: Vec::new(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// KV blocks a new sequence can get (free, or cached and unused) and the pool's total.
    pub fn kv_blocks(&self) -> (usize, usize) {
        (
            self.pool.free_blocks() + self.prefix.evictable(&self.pool),
            self.pool.total_blocks(),
        )
    }

    /// KV blocks the prefix cache holds.
    pub fn cached_blocks(&self) -> usize {
        self.prefix.len()
    }

    /// Cached blocks a running sequence shares: they are not in any reservation.
    fn pinned(&self) -> usize {
        self.prefix.len() - self.prefix.evictable(&self.pool)
    }

    /// Sequences running and waiting.
    pub fn load(&self) -> (usize, usize) {
        (self.running.len(), self.waiting.len())
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty() || !self.pending_events.is_empty()
    }

    /// Queues a request; it starts when a slot and its KV blocks are free.
    pub fn submit(&mut self, req: Request) -> Result<SeqId, EngineError> {
        let cfg = &self.cfg;
        let bad = |m: String| Err(EngineError::BadRequest(m));
        if req.prompt.is_empty() {
            return bad("the prompt is empty".into());
        }
        if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= cfg.vocab) {
            return bad(format!(
                "prompt token id {t} is outside the vocabulary (size {})",
                cfg.vocab
            ));
        }
        if req.prompt.len() > cfg.max_context {
            return bad(format!(
                "the prompt has {} tokens but the model's context is {} tokens",
                req.prompt.len(),
                cfg.max_context
            ));
        }
        if !req.stop.is_empty() && self.tokenizer.is_none() {
            return bad("stop strings need a tokenizer".into());
        }
        req.sampler
            .validate(cfg.vocab)
            .map_err(|e| EngineError::BadRequest(e.to_string()))?;
        let reserved = self.pool.blocks_for(self.positions_needed(&req));
        if reserved > self.pool.total_blocks() {
            return Err(EngineError::ResourceExhausted(format!(
                "the request needs {} KV positions ({reserved} blocks) but the cache holds {} \
                 ({} blocks); lower max_tokens or give the KV cache more memory",
                self.positions_needed(&req),
                self.pool.total_blocks() * BLOCK_SIZE,
                self.pool.total_blocks()
            )));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back(Seq {
            id,
            table: BlockTable::default(),
            reserved,
            prefilled: 0,
            history: req.prompt.clone(),
            pending: None,
            sampler: Sampler::new(req.sampler.clone()),
            decoder: self.tokenizer.map(|t| t.stream_decoder()),
            stops: StopStrings::new(req.stop.clone()),
            stats: GenerationStats {
                prompt_tokens: req.prompt.len(),
                ..Default::default()
            },
            started: None,
            first_token: None,
            req,
        });
        Ok(id)
    }

    /// Positions a request can ever occupy: the last generated token is never fed back.
    fn positions_needed(&self, req: &Request) -> usize {
        req.prompt
            .len()
            .saturating_add(req.max_tokens.saturating_sub(1))
            .min(self.cfg.max_context)
    }

    /// Ends a sequence now; its `Done` event comes with the next step.
    pub fn cancel(&mut self, id: SeqId) {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            let s = self.waiting.remove(i).expect("found");
            self.pending_events.push(Event::Done {
                id,
                reason: FinishReason::Cancelled,
                text: String::new(),
                stats: s.stats,
            });
        } else if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.swap_remove(i);
            let ev = self.finish(s, FinishReason::Cancelled);
            self.pending_events.push(ev);
        }
    }

    fn finish(&mut self, mut s: Seq<'t>, reason: FinishReason) -> Event {
        self.reserved -= s.reserved;
        // Prompt and reply: a next turn's prompt usually starts with both. (A cancelled
        // sequence may have grown blocks that a failed step never wrote.)
        if self.opts.prefix_cache && reason != FinishReason::Cancelled {
            let n = s.table.len().min(s.history.len());
            self.prefix
                .insert(&mut self.pool, &s.history[..n], s.table.blocks());
        }
        self.pool.release(std::mem::take(&mut s.table));
        let mut text = String::new();
        if reason != FinishReason::Cancelled {
            if let Some(d) = s.decoder.as_mut() {
                if let Ok(tail) = d.finish() {
                    text.push_str(s.stops.push(&tail));
                }
            }
            text.push_str(s.stops.finish());
        }
        if let Some(t) = s.first_token {
            s.stats.generation_time = t.elapsed();
        }
        Event::Done {
            id: s.id,
            reason,
            text,
            stats: s.stats,
        }
    }

    /// Moves waiting requests in while slots and blocks allow (in arrival order), each starting
    /// from the longest cached prefix of its prompt.
    fn admit(&mut self) {
        while self.running.len() < self.opts.max_seqs {
            let Some(s) = self.waiting.front() else {
                break;
            };
            // The last prompt token is always computed (its logits start generation), and
            // prompt logprobs need every position computed.
            let hit = if self.opts.prefix_cache && s.req.prompt_logprobs == 0 {
                let most = (s.req.prompt.len() - 1) / BLOCK_SIZE;
                self.prefix.lookup(&s.req.prompt, BLOCK_SIZE, most)
            } else {
                Vec::new()
            };
            let need = s.reserved - hit.len();
            // Hit blocks only the cache holds become pinned by this sequence.
            let newly_pinned = hit.iter().filter(|&&b| self.pool.holders(b) == 1).count();
            let pinned = self.pinned() + newly_pinned;
            if self.reserved + need + pinned > self.pool.total_blocks() {
                break;
            }
            let mut s = self.waiting.pop_front().expect("front exists");
            s.table = self.pool.share(&hit);
            s.prefilled = s.table.len();
            s.stats.cached_tokens = s.prefilled;
            s.reserved = need;
            self.reserved += need;
            self.running.push(s);
        }
    }

    /// Runs one step of the model over every running sequence; returns what happened.
    pub fn step(&mut self) -> Result<Vec<Event>, EngineError> {
        let mut events = std::mem::take(&mut self.pending_events);
        self.admit();
        if self.running.is_empty() {
            return Ok(events);
        }
        let max_context = self.cfg.max_context;
        let v = self.cfg.vocab;
        let chunk = self.opts.prefill_chunk;
        let mut batch = Batch::default();
        // (index into running, tokens in this step, ends the prompt)
        let mut members: Vec<(usize, usize, bool)> = Vec::new();
        let mut copies = Vec::new();
        let mut budget = chunk;
        for (i, s) in self.running.iter_mut().enumerate() {
            let start = s.table.len();
            let (tokens, last, want) = match s.pending {
                Some(t) => (vec![t], true, Want::Last),
                None => {
                    // Chunks start at multiples of `chunk`, so a prompt is cut the same way
                    // whatever else runs beside it.
                    let end = ((s.prefilled / chunk + 1) * chunk).min(s.req.prompt.len());
                    let n = end - s.prefilled;
                    if n > budget {
                        continue;
                    }
                    budget -= n;
                    let last = end == s.req.prompt.len();
                    let want = match (s.req.prompt_logprobs > 0, last) {
                        (true, _) => Want::All,
                        (false, true) => Want::Last,
                        (false, false) => Want::None,
                    };
                    s.started.get_or_insert_with(Instant::now);
                    (s.req.prompt[s.prefilled..end].to_vec(), last, want)
                }
            };
            let short = self
                .pool
                .needed(&s.table, start + tokens.len())
                .saturating_sub(self.pool.free_blocks());
            self.prefix.evict(&mut self.pool, short);
            let c = self
                .pool
                .grow(&mut s.table, start + tokens.len())
                .map_err(|e| EngineError::Internal(anyhow::anyhow!("{e} (reservation broken)")))?;
            copies.extend(c);
            batch.push(&tokens, start, s.table.blocks().to_vec(), want);
            members.push((i, tokens.len(), last));
        }
        if !copies.is_empty() {
            self.runner.copy_blocks(&copies)?;
        }
        let logits = self.runner.step(&batch)?;
        // Corrupt weights (NaN or huge values in the tensor data) show up here; garbage text
        // with a success would hide them.
        if logits.iter().any(|x| !x.is_finite()) {
            return Err(EngineError::Internal(anyhow::anyhow!(
                "the model computed non-finite logits (NaN or infinity): its weights are likely corrupt"
            )));
        }

        let mut row = 0;
        let mut ended = Vec::new();
        for (&(i, n, last), seq_step) in members.iter().zip(&batch.seqs) {
            let rows = seq_step.want.rows(n);
            let mine = &logits[row * v..(row + rows) * v];
            row += rows;
            let s = &mut self.running[i];
            if s.pending.take().is_none() {
                s.prefilled += n;
                if s.req.prompt_logprobs > 0 {
                    for r in mine.chunks(v) {
                        let mut lp = r.to_vec();
                        crate::backend::cpu::log_softmax(&mut lp);
                        s.stats
                            .prompt_logprobs
                            .push(top_k(&lp, s.req.prompt_logprobs));
                    }
                }
                if !last {
                    continue;
                }
                s.stats.prompt_time = s.started.map_or(Duration::ZERO, |t| t.elapsed());
            }
            if s.req.max_tokens == 0 {
                ended.push((i, FinishReason::Length));
                continue;
            }
            let mut lp = mine[mine.len() - v..].to_vec();
            if let Some(c) = s.req.constraint.as_mut() {
                if let Err(e) = c.mask(&mut lp) {
                    // Only this sequence is stuck; the others in the step go on.
                    eprintln!("trellm: sequence {}: constrained decoding: {e}", s.id);
                    ended.push((i, FinishReason::Stop));
                    continue;
                }
            }
            s.sampler.logprobs(&mut lp, &s.history);
            let token = s.sampler.sample(&lp);
            let step = Step {
                token,
                logprob: lp[token as usize],
                top: if s.req.logprobs > 0 {
                    top_k(&lp, s.req.logprobs)
                } else {
                    Vec::new()
                },
            };
            s.first_token.get_or_insert_with(Instant::now);
            s.stats.generated_tokens += 1;
            s.history.push(token);
            let eos = s.req.eos_ids.contains(&token);
            // The grammar sees every token but EOS (which only ever ends it).
            let mut grammar_done = false;
            if let (Some(c), false) = (s.req.constraint.as_mut(), eos) {
                if let Err(e) = c.commit(token) {
                    eprintln!("trellm: sequence {}: constrained decoding: {e}", s.id);
                    grammar_done = true;
                } else {
                    grammar_done = c.is_finished();
                }
            }
            let mut text = String::new();
            if !eos {
                if let Some(d) = s.decoder.as_mut() {
                    let chunk = d.push(token).map_err(|e| EngineError::Internal(e.into()))?;
                    text = s.stops.push(&chunk).to_string();
                }
            }
            events.push(Event::Token {
                id: s.id,
                step,
                text,
            });
            if eos {
                ended.push((i, FinishReason::Stop));
            } else if let Some(m) = s.stops.matched() {
                ended.push((i, FinishReason::StopString(m.to_string())));
            } else if grammar_done {
                ended.push((i, FinishReason::Stop));
            } else if s.stats.generated_tokens >= s.req.max_tokens {
                ended.push((i, FinishReason::Length));
            } else if s.table.len() >= max_context {
                ended.push((i, FinishReason::Context));
            } else {
                s.pending = Some(token);
            }
        }
        // Highest index first, so swap_remove leaves the lower ones in place.
        ended.sort_by_key(|e| std::cmp::Reverse(e.0));
        for (i, reason) in ended {
            let s = self.running.swap_remove(i);
            events.push(self.finish(s, reason));
        }
        Ok(events)
    }
}

fn top_k(lp: &[f32], k: usize) -> Vec<(u32, f32)> {
    top_indices(lp, k)
        .into_iter()
        .map(|i| (i as u32, lp[i]))
        .collect()
}
