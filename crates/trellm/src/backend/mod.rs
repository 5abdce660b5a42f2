//! Compute backends. Each one implements [`ModelBackend`]: a loaded model shared by every
//! sequence and a batched step over its paged KV cache. The CPU backend is the exact reference
//! path every other path is tested against.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use anyhow::{anyhow, Result};
pub use trellm_model::ModelBackend;
use trellm_model::{Batch, BlockPool, BlockTable, Logits, Want};

/// Where forward passes run (`--device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Device {
    /// This machine's cores (exact f32 activations).
    #[default]
    Cpu,
    /// The first NVIDIA GPU (bf16 weights and activations, f32 accumulation).
    Cuda,
}

impl Device {
    /// The name `--device` takes.
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }
}

/// Positions per KV block.
pub const BLOCK_SIZE: usize = 16;

/// One sequence alone on a model, with a pool of its own: the smallest client of a step (checks,
/// tests, benchmarks of one sequence).
pub struct SoloSequence<'a, M: ModelBackend> {
    model: &'a M,
    cache: M::Cache,
    pool: BlockPool,
    table: BlockTable,
}

impl<'a, M: ModelBackend> SoloSequence<'a, M> {
    /// Room for `capacity` positions.
    pub fn new(model: &'a M, capacity: usize) -> Result<Self> {
        let blocks = capacity.div_ceil(BLOCK_SIZE).max(1);
        Ok(SoloSequence {
            model,
            cache: model.new_cache(blocks, BLOCK_SIZE)?,
            pool: BlockPool::new(blocks, BLOCK_SIZE),
            table: BlockTable::default(),
        })
    }

    /// Runs `tokens` at the next positions; returns the logits of the last one, or of each.
    pub fn forward(&mut self, tokens: &[u32], want: Want) -> Result<Vec<f32>> {
        let start = self.table.len();
        self.pool
            .grow(&mut self.table, start + tokens.len())
            .map_err(|e| anyhow!("{e}"))?;
        let mut b = Batch::default();
        b.push(tokens, start, self.table.blocks().to_vec(), want);
        let out = self.model.step(&b, &mut self.cache).map(Logits::into_vec);
        if out.is_err() {
            self.pool.truncate(&mut self.table, start);
        }
        out
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }
}
