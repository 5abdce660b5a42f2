//! Perplexity and KL divergence over a text, as llama.cpp's `llama-perplexity` measures them.
//!
//! The text is tokenized once (BOS in front where the model adds one) and cut into disjoint
//! chunks of `ctx` tokens; where the model adds BOS, each chunk's first token is replaced by BOS.
//! Each chunk is run from an empty cache and only its second half is scored: the logits at
//! positions `ctx/2 .. ctx-1` predict the tokens at `ctx/2 + 1 .. ctx` (so every scored token
//! has at least `ctx/2` tokens of context), `ctx - 1 - ctx/2` tokens a chunk.
//!
//! With a stride (llama-perplexity's `--ppl-stride`) chunks of `ctx` tokens start every `stride`
//! tokens and the last `stride` tokens of each are scored. llama-perplexity's strided pass puts
//! BOS in the token list only after its forward pass, so the model sees the text's own first
//! token; this does the same, to measure the same thing.
//!
//! One difference: special-token strings in the text (`<|im_start|>`) become their tokens here,
//! where llama-perplexity tokenizes them as plain text; ordinary text (wikitext) has none.
//!
//! [`run_chunks`] drives a [`ModelBackend`] over the chunks and hands each chunk's scored logit
//! rows to a callback; [`stats`] turns rows into negative log-likelihoods and KL divergences;
//! [`logits_file`] saves and reads a reference model's distributions.

pub mod logits_file;
pub mod stats;

use anyhow::{anyhow, bail, Result};
use trellm_model::{Batch, BlockPool, BlockTable, ModelBackend, Want};

use crate::backend::BLOCK_SIZE;

/// How a token list is cut into chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunking {
    /// Tokens a chunk (the context each chunk runs with).
    pub ctx: usize,
    /// `Some(s)`: chunks start every `s` tokens and the last `s` of each are scored, no BOS;
    /// `None`: disjoint chunks, BOS first where `bos` is set, the second half scored.
    pub stride: Option<usize>,
    /// Chunks to run: at most the text's.
    pub chunks: usize,
    /// The BOS id that replaces each disjoint chunk's first token (the model adds BOS).
    pub bos: Option<u32>,
}

impl Chunking {
    /// Disjoint chunks of `ctx` over `n_tokens` (at most `max_chunks`), or strided ones.
    pub fn new(
        n_tokens: usize,
        ctx: usize,
        stride: Option<usize>,
        max_chunks: Option<usize>,
        bos: Option<u32>,
    ) -> Result<Chunking> {
        if ctx < 3 {
            bail!("--ctx must be at least 3 (half of each chunk is context, the rest is scored)");
        }
        let available = match stride {
            None => n_tokens / ctx,
            Some(s) => {
                if s == 0 || s >= ctx {
                    bail!(
                        "--stride must be between 1 and --ctx - 1 ({}), got {s}",
                        ctx - 1
                    );
                }
                if n_tokens < ctx {
                    0
                } else {
                    (n_tokens - ctx) / s + 1
                }
            }
        };
        if available == 0 {
            bail!("the text is {n_tokens} tokens long; one chunk of --ctx {ctx} needs {ctx}");
        }
        let chunks = max_chunks.map_or(available, |c| c.min(available));
        if chunks == 0 {
            bail!("--chunks must be at least 1");
        }
        Ok(Chunking {
            ctx,
            stride,
            chunks,
            bos: if stride.is_none() { bos } else { None },
        })
    }

    /// Index in a chunk of the first logit row that is scored.
    pub fn first_scored(&self) -> usize {
        match self.stride {
            None => self.ctx / 2,
            Some(s) => self.ctx - s - 1,
        }
    }

    /// Scored tokens a chunk (logit rows `first_scored() .. ctx - 1`).
    pub fn scored(&self) -> usize {
        self.ctx - 1 - self.first_scored()
    }

    /// Where chunk `i` starts in the token list.
    pub fn start(&self, i: usize) -> usize {
        i * self.stride.unwrap_or(self.ctx)
    }

    /// Chunk `i`'s tokens as the model reads them (BOS first where it applies).
    pub fn input(&self, tokens: &[u32], i: usize) -> Vec<u32> {
        let s = self.start(i);
        let mut v = tokens[s..s + self.ctx].to_vec();
        if let Some(b) = self.bos {
            v[0] = b;
        }
        v
    }
}

/// Logits of one step at most (floats): the rows a step returns are cut to stay within it, so a
/// 262k vocabulary costs 128 MiB per step, not a whole chunk's.
const MAX_STEP_LOGITS: usize = 32 << 20;

/// Tokens one step carries: short chunks run several to a step so the GEMMs get enough rows.
const TOKENS_PER_STEP: usize = 512;

/// One chunk's scored part: `logits` holds `scored` rows of `vocab`; row `j` predicts
/// `targets[j]`.
pub struct ChunkLogits<'a> {
    pub index: usize,
    pub logits: &'a [f32],
    pub targets: &'a [u32],
}

/// Runs every chunk of `tokens` through `model` and calls `each` with its scored logits, in
/// chunk order. Several short chunks share a step; the scored half runs in pieces whose
/// logits stay within [`MAX_STEP_LOGITS`]. A step carries at most `ubatch` positions of a chunk
/// (llama-perplexity's `-ub`): 1 runs every position as a decode step.
pub fn run_chunks<M: ModelBackend>(
    model: &M,
    tokens: &[u32],
    c: &Chunking,
    ubatch: usize,
    mut each: impl FnMut(ChunkLogits<'_>) -> Result<()>,
) -> Result<()> {
    let vocab = model.config().vocab;
    let (ctx, first) = (c.ctx, c.first_scored());
    // Rows a chunk asks logits for: the scored ones plus the last position's (which predicts
    // nothing in the chunk but keeps each piece one contiguous `Want::All` run).
    let wanted = ctx - first;
    let per_step = (TOKENS_PER_STEP / ctx).clamp(1, c.chunks);
    let rows_per_step = (MAX_STEP_LOGITS / vocab).max(1);
    let positions = ctx.div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
    let n_blocks = per_step * positions / BLOCK_SIZE;
    let mut cache = model.new_cache(n_blocks, BLOCK_SIZE)?;
    let mut pool = BlockPool::new(n_blocks, BLOCK_SIZE);
    // The same blocks serve every group: each step writes a position before any step reads it.
    let mut tables: Vec<BlockTable> = Vec::with_capacity(per_step);
    for _ in 0..per_step {
        let mut t = BlockTable::default();
        pool.grow(&mut t, ctx).map_err(|e| anyhow!("{e}"))?;
        tables.push(t);
    }
    let mut chunk_logits: Vec<Vec<f32>> = vec![Vec::new(); per_step];
    let mut i = 0;
    while i < c.chunks {
        let group = per_step.min(c.chunks - i);
        let inputs: Vec<Vec<u32>> = (i..i + group).map(|k| c.input(tokens, k)).collect();
        // The unscored first part, logits of none.
        let mut at = 0;
        while at < first {
            let n = ubatch.min(first - at);
            let mut b = Batch::default();
            for (inp, t) in inputs.iter().zip(&tables) {
                b.push(&inp[at..at + n], at, t.blocks().to_vec(), Want::None);
            }
            model.step(&b, &mut cache)?;
            at += n;
        }
        for l in &mut chunk_logits {
            l.clear();
        }
        // The scored part in pieces of `piece` positions of every chunk of the group.
        let piece = (rows_per_step / group).clamp(1, wanted).min(ubatch);
        let mut at = first;
        while at < ctx {
            let n = piece.min(ctx - at);
            let mut b = Batch::default();
            for (inp, t) in inputs.iter().zip(&tables) {
                b.push(&inp[at..at + n], at, t.blocks().to_vec(), Want::All);
            }
            let out = model.step(&b, &mut cache)?;
            if out.len() != group * n * vocab {
                bail!(
                    "the backend returned {} logits for {} rows of {vocab}",
                    out.len(),
                    group * n
                );
            }
            for (g, rows) in out.chunks_exact(n * vocab).enumerate() {
                chunk_logits[g].extend_from_slice(rows);
            }
            at += n;
        }
        for (g, l) in chunk_logits.iter().take(group).enumerate() {
            let s = c.start(i + g);
            each(ChunkLogits {
                index: i + g,
                logits: &l[..c.scored() * vocab],
                targets: &tokens[s + first + 1..s + ctx],
            })?;
        }
        i += group;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disjoint_chunks_score_the_second_half() {
        let c = Chunking::new(1100, 512, None, None, Some(1)).unwrap();
        assert_eq!((c.chunks, c.first_scored(), c.scored()), (2, 256, 255));
        assert_eq!(c.start(1), 512);
        let toks: Vec<u32> = (0..1100).collect();
        assert_eq!(&c.input(&toks, 1)[..2], &[1, 513]);
        assert_eq!(
            Chunking::new(1100, 512, None, Some(1), None)
                .unwrap()
                .chunks,
            1
        );
    }

    #[test]
    fn strided_chunks_score_the_last_stride_without_bos() {
        let c = Chunking::new(1000, 512, Some(128), None, Some(1)).unwrap();
        // Starts 0, 128, 256, 384 (the last ends at 896 <= 1000).
        assert_eq!((c.chunks, c.first_scored(), c.scored()), (4, 383, 128));
        let toks: Vec<u32> = (0..1000).collect();
        assert_eq!(c.input(&toks, 1)[0], 128);
    }

    #[test]
    fn too_short_or_bad_sizes_are_errors() {
        assert!(Chunking::new(100, 512, None, None, None).is_err());
        assert!(Chunking::new(1000, 2, None, None, None).is_err());
        assert!(Chunking::new(1000, 512, Some(512), None, None).is_err());
        assert!(Chunking::new(1000, 512, Some(0), None, None).is_err());
        assert!(Chunking::new(1000, 512, None, Some(0), None).is_err());
    }
}
