//! Models: configuration, weights, and the one decoder.

pub mod config;
pub mod decoder;
pub mod families;
pub mod load;
pub mod mlx_math;
pub mod rope;
pub mod weights;

pub use config::ModelConfig;
pub use decoder::{Decoder, KvCache};
