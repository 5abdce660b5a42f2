//! Models: the description shared by every backend (`trellm-model`) and loading a model from a path.

pub use trellm_model::{config, families, mlx_math, plan, rope, weights};
pub mod load;

pub use config::ModelConfig;
