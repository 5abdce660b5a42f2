//! The model described once, below every backend: each family's configuration (`config`,
//! `families` for config.json, `gguf_families` for GGUF), RoPE with mlx's own float math (`rope`, `mlx_math`), the weight descriptors
//! borrowed from the file's memory map (`weights`), the per-layer op list both backends execute
//! (`plan`), the contract of a batched step over a paged KV cache (`step`, `kv`), and the split of
//! a model over tensor-parallel ranks (`shard`).

pub mod config;
pub mod families;
pub mod gguf_families;
pub mod kv;
pub mod mlx_math;
pub mod plan;
pub mod rope;
pub mod shard;
pub mod step;
pub mod weights;

pub use config::ModelConfig;
pub use kv::{BlockPool, BlockTable, PoolFull};
pub use plan::Plan;
pub use shard::Shard;
pub use step::{Batch, Logits, ModelBackend, SeqStep, Want};
