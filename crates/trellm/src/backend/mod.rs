//! Compute backends. The CPU backend is the exact reference path every other path is tested
//! against. The engine drives one sequence at a time through [`Sequence`], whichever device
//! runs it.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use anyhow::Result;

use crate::model::decoder::Logits;
use crate::model::{Decoder, KvCache};

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

/// One sequence on a backend: its KV cache and its forward passes.
pub trait Sequence {
    /// Runs `tokens` at the next positions and returns the logits of the last position, or of
    /// every position (`Logits::All`, row by row).
    fn forward(&mut self, tokens: &[u32], want: Logits) -> Result<Vec<f32>>;
    /// Positions in the cache.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Empties the cache.
    fn reset(&mut self) -> Result<()>;
}

/// The CPU decoder with its own cache.
pub struct CpuSequence<'a> {
    dec: &'a Decoder,
    cache: KvCache,
}

impl Sequence for CpuSequence<'_> {
    fn forward(&mut self, tokens: &[u32], want: Logits) -> Result<Vec<f32>> {
        Ok(self.dec.forward(tokens, &mut self.cache, want))
    }
    fn len(&self) -> usize {
        self.cache.len()
    }
    fn reset(&mut self) -> Result<()> {
        self.cache = KvCache::new(&self.dec.cfg);
        Ok(())
    }
}

/// A sequence of `dec` on `device` with room for `capacity` positions (the CPU cache grows as
/// needed; a GPU allocates its cache up front).
pub fn sequence<'a>(
    dec: &'a Decoder,
    device: Device,
    capacity: usize,
) -> Result<Box<dyn Sequence + 'a>> {
    match device {
        Device::Cpu => Ok(Box::new(CpuSequence {
            dec,
            cache: KvCache::new(&dec.cfg),
        })),
        Device::Cuda => cuda_sequence(dec, capacity),
    }
}

#[cfg(feature = "cuda")]
fn cuda_sequence<'a>(dec: &'a Decoder, capacity: usize) -> Result<Box<dyn Sequence + 'a>> {
    Ok(Box::new(cuda::CudaSequence::new(dec, capacity)?))
}

#[cfg(not(feature = "cuda"))]
fn cuda_sequence<'a>(_: &'a Decoder, _: usize) -> Result<Box<dyn Sequence + 'a>> {
    anyhow::bail!("--device cuda: this trellm was built without the cuda feature")
}
