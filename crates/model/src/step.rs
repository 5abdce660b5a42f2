//! The contract between the scheduler and a backend: one forward pass over a ragged batch of
//! tokens from many sequences, each reading and extending its own blocks of a paged KV cache.

use std::ops::Deref;

use anyhow::Result;

use crate::config::ModelConfig;

/// Which of a sequence's new tokens need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// None (a prefill chunk that is not the prompt's last).
    None,
    /// The last new token's.
    Last,
    /// Every new token's (prompt logprobs).
    All,
}

impl Want {
    /// Logit rows this sequence gets from a step of `len` new tokens.
    pub fn rows(self, len: usize) -> usize {
        match self {
            Want::None => 0,
            Want::Last => 1,
            Want::All => len,
        }
    }
}

/// One sequence's part of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqStep {
    /// Its new tokens are `Batch::tokens[offset..offset + len]`.
    pub offset: usize,
    pub len: usize,
    /// Positions already in its cache: the new tokens sit at positions `start..start + len`.
    pub start: usize,
    /// Its KV blocks in position order, holding at least `start + len` positions.
    pub blocks: Vec<u32>,
    pub want: Want,
}

/// Ragged tokens of many sequences (prefill chunks and single decode tokens mixed).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    pub tokens: Vec<u32>,
    pub seqs: Vec<SeqStep>,
}

impl Batch {
    /// Appends a sequence's new tokens.
    pub fn push(&mut self, tokens: &[u32], start: usize, blocks: Vec<u32>, want: Want) {
        self.seqs.push(SeqStep {
            offset: self.tokens.len(),
            len: tokens.len(),
            start,
            blocks,
            want,
        });
        self.tokens.extend_from_slice(tokens);
    }

    /// Logit rows the step returns, sequence by sequence.
    pub fn logit_rows(&self) -> usize {
        self.seqs.iter().map(|s| s.want.rows(s.len)).sum()
    }
}

/// A step's logits, `vocab` values a row, sequence by sequence: a vector, or a buffer the backend
/// lends until this is dropped (a GPU's page-locked host memory it copied them into, as
/// llama.cpp's output buffer is: no second copy on the host).
pub enum Logits {
    Owned(Vec<f32>),
    Lent(Box<dyn AsRef<[f32]> + Send>),
}

impl Logits {
    /// The values as a vector (copied only when lent).
    pub fn into_vec(self) -> Vec<f32> {
        match self {
            Logits::Owned(v) => v,
            Logits::Lent(b) => (*b).as_ref().to_vec(),
        }
    }
}

impl Deref for Logits {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            Logits::Owned(v) => v,
            Logits::Lent(b) => (**b).as_ref(),
        }
    }
}

impl From<Vec<f32>> for Logits {
    fn from(v: Vec<f32>) -> Logits {
        Logits::Owned(v)
    }
}

impl std::fmt::Debug for Logits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Logits({} values)", self.len())
    }
}

/// A loaded model on one backend: immutable and shared by every sequence (`Arc`), with a KV
/// cache of fixed-size blocks that the backend stores and the caller hands out ([`crate::kv`]).
pub trait ModelBackend: Send + Sync {
    /// The backend's KV storage.
    type Cache: Send;

    fn config(&self) -> &ModelConfig;

    /// Storage for `n_blocks` blocks of `block_size` positions.
    fn new_cache(&self, n_blocks: usize, block_size: usize) -> Result<Self::Cache>;

    /// Bytes one block of `block_size` positions takes (to size a pool from a memory budget).
    fn block_bytes(&self, block_size: usize) -> usize;

    /// Copies whole blocks `(src, dst)` (copy-on-write of a shared block before it is extended).
    fn copy_blocks(&self, cache: &mut Self::Cache, copies: &[(u32, u32)]) -> Result<()>;

    /// Runs `batch`: writes each new token's keys and values at its position in its sequence's
    /// blocks and returns the wanted logits, `vocab` values a row, sequence by sequence.
    fn step(&self, batch: &Batch, cache: &mut Self::Cache) -> Result<Logits>;
}
