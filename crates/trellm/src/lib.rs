//! trellm: an LLM inference engine for GGUF and trellis-quantized (EXL3) models.
//!
//! The crate follows the data flow: `model` turns files into a decoder, `backend` holds the
//! arithmetic, `engine` runs sequences, `cli` is the command line.

pub mod backend;
pub mod cli;
pub mod engine;
pub mod model;
