//! Sequences and generation: the scheduler many requests share, sampling, stop conditions, and
//! the one-request loop of the CLI. No knowledge of files or HTTP.

pub mod constraint;
pub mod generate;
mod prefix;
pub mod sampler;
pub mod scheduler;
pub mod stop;

pub use constraint::{Constrainer, Constraint, Grammar};
pub use generate::{generate, Finished, Flow, GenerationStats, Step, PREFILL_CHUNK_SERVE};
pub use sampler::{Sampler, SamplerParams, SamplingDefaults};
pub use scheduler::{Engine, EngineError, EngineOptions, Event, FinishReason, Request, SeqId};
