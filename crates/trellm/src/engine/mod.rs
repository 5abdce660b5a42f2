//! Sequences and generation: sampling, the generation loop, stop conditions. No knowledge of
//! files or HTTP.

pub mod generate;
pub mod sampler;
pub mod stop;

pub use generate::{generate, GenerateOptions, GenerationStats, Step};
pub use sampler::{Sampler, SamplerParams};
