//! Models: configuration, weights, and the one decoder.

pub mod config;
pub mod decoder;
pub mod load;
pub mod weights;

pub use config::ModelConfig;
pub use decoder::{Decoder, KvCache};
