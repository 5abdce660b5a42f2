//! trellm: an LLM inference engine for GGUF, Hugging Face and trellis-quantized (EXL3) models.
//!
//! The crate follows the data flow: `model` turns files into a model (its description lives in
//! `trellm-model`, shared by every backend), `backend` holds the arithmetic of each device,
//! `engine` schedules many sequences over one loaded model, `eval` measures perplexity and KL
//! divergence over a text, `cli` is the command line.
//!
//! # Embedding it
//!
//! Load a model once, make an [`Engine`] on a device, submit requests (each with its own sampler,
//! seed, length and stops), and step the engine: every step advances all running requests
//! together and reports their new tokens as [`Event`]s. [`Engine::cancel`] ends a request and
//! frees its KV blocks. Errors at this boundary are [`EngineError`]s: a bad request, exhausted
//! resources (the KV cache cannot hold the request), or an internal failure.
//!
//! ```
//! use trellm::{ChatMessage, Device, EngineOptions, Event, Request, SamplerParams};
//!
//! # fn main() -> anyhow::Result<()> {
//! // A local path, an alias of a default model (fetched on first use) or a Hugging Face id.
//! let path = trellm::resolve_model("smollm2-135m-instruct")?;
//! let model = trellm::load(&path)?;
//! // Room for 4 sequences of up to 256 positions each.
//! let mut engine = model.engine(Device::Cpu, EngineOptions::for_sequences(4, 256))?;
//! let mut ids = Vec::new();
//! for (question, seed) in [("What is the capital of France?", None), ("Name a color.", Some(7))] {
//!     let prompt = model.chat_prompt(&[ChatMessage::new("user", question)])?;
//!     let sampler = SamplerParams { temp: if seed.is_some() { 0.7 } else { 0.0 }, seed, ..Default::default() };
//!     ids.push(engine.submit(Request {
//!         prompt,
//!         max_tokens: 24,
//!         sampler,
//!         eos_ids: model.eos_ids(),
//!         ..Default::default()
//!     })?);
//! }
//! // Sequence ids count from 0 in each engine.
//! let mut answers = vec![String::new(); ids.len()];
//! while engine.has_work() {
//!     for event in engine.step()? {
//!         match event {
//!             // Text comes out as it becomes final (never half a UTF-8 character).
//!             Event::Token { id, text, .. } => answers[id as usize].push_str(&text),
//!             Event::Done { id, text, reason, .. } => {
//!                 answers[id as usize].push_str(&text);
//!                 println!("{id} ({}): {}", reason.as_str(), answers[id as usize]);
//!             }
//!         }
//!     }
//! }
//! assert!(answers[0].contains("Paris"));
//! # Ok(())
//! # }
//! ```

pub mod backend;
pub mod cli;
pub mod engine;
pub mod eval;
pub mod model;
pub mod quantize;
pub mod server;

pub use backend::Device;
pub use engine::{
    Engine, EngineError, EngineOptions, Event, FinishReason, Request, SamplerParams, SeqId,
};
pub use model::load::{load, LoadedModel};
pub use trellm_tokenizer::ChatMessage;

/// A model argument (a local GGUF file or folder, an alias such as `smollm2-135m-instruct`, or a
/// Hugging Face repo id) as a local path, fetching it into the cache if needed.
pub fn resolve_model(spec: &str) -> anyhow::Result<std::path::PathBuf> {
    trellm_hub::resolve_model(spec, false)
}
