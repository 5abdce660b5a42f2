//! Tokenization, chat templates and streaming detokenization for trellm.
//!
//! Token ids must match the reference implementations exactly:
//! - GGUF byte-level BPE (`tokenizer.ggml.model = "gpt2"`) and Hugging Face `tokenizer.json`
//!   folders run through the `tokenizers` crate, i.e. what transformers / mlx-lm do;
//! - GGUF SentencePiece vocabularies (`"llama"`, e.g. Gemma) use llama.cpp's algorithm
//!   (module `spm`), since that is where those files come from.
//!
//! Chat templates are rendered like transformers' `apply_chat_template(tokenize=False)`.

mod bytes;
mod gguf;
mod hf;
mod spm;
mod stream;
mod template;

use std::path::Path;

pub use bytes::TokenBytes;
pub use stream::StreamDecoder;
pub use template::{strftime, ChatMessage};

use spm::Spm;
use template::ChatTemplate;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {msg}")]
    Json { path: String, msg: String },
    #[error("invalid tokenizer: {0}")]
    Invalid(String),
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),
    #[error("tokenizer: {0}")]
    Backend(String),
    #[error("the model has no chat template")]
    NoChatTemplate,
    #[error("chat template: {0}")]
    Template(String),
    #[error("token id {id} is out of range (vocabulary has {vocab_size} tokens)")]
    InvalidId { id: u32, vocab_size: usize },
}

fn backend_err(e: tokenizers::Error) -> TokenizerError {
    TokenizerError::Backend(e.to_string())
}

enum Backend {
    /// `tokenizers` pipeline. `post_process`: let its post-processor add BOS/EOS (otherwise
    /// `add_bos`/`add_eos` are applied by hand, as transformers does when the config says so).
    Hf {
        tok: Box<tokenizers::Tokenizer>,
        byte_fallback: bool,
        post_process: bool,
    },
    Spm(Box<Spm>),
}

/// A model's tokenizer: vocabulary, special tokens, end-of-generation ids and chat template.
pub struct Tokenizer {
    backend: Backend,
    bos: Option<u32>,
    /// Appended when `add_eos` (the model's EOS token).
    eos: Option<u32>,
    eos_ids: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    template: Option<ChatTemplate>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field(
                "kind",
                &match self.backend {
                    Backend::Hf { .. } => "tokenizers",
                    Backend::Spm(_) => "spm",
                },
            )
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos_ids", &self.eos_ids)
            .field("add_bos", &self.add_bos)
            .field("has_chat_template", &self.template.is_some())
            .finish()
    }
}

impl Tokenizer {
    /// From the vocabulary embedded in a GGUF file (`gpt2` byte-level BPE or `llama`
    /// SentencePiece).
    pub fn from_gguf(g: &trellm_formats::gguf::Gguf) -> Result<Self, TokenizerError> {
        gguf::load(g)
    }

    /// From a Hugging Face folder: `tokenizer.json`, plus `tokenizer_config.json` (special
    /// tokens, `add_bos_token`, chat template), `chat_template.jinja`, and
    /// `generation_config.json` / `config.json` for the end-of-generation ids.
    pub fn from_hf_dir(dir: &Path) -> Result<Self, TokenizerError> {
        hf::load(dir)
    }

    /// Token ids of `text`. Special-token strings in the text (e.g. `<|im_start|>`) become
    /// their tokens. `add_special_tokens` adds BOS (and EOS) where the model asks for it, as
    /// `tokenizer.encode(text)` does in transformers / mlx-lm; a rendered chat template already
    /// holds its special tokens, so encode it with `false`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::new();
        let manual = match &self.backend {
            Backend::Hf {
                tok, post_process, ..
            } => {
                let enc = tok
                    .encode_fast(text, add_special_tokens && *post_process)
                    .map_err(backend_err)?;
                ids = enc.get_ids().to_vec();
                add_special_tokens && !*post_process
            }
            Backend::Spm(spm) => {
                spm.encode(text, &mut ids);
                add_special_tokens
            }
        };
        if manual {
            if let (true, Some(b)) = (self.add_bos, self.bos) {
                ids.insert(0, b);
            }
            if let (true, Some(e)) = (self.add_eos, self.eos) {
                ids.push(e);
            }
        }
        Ok(ids)
    }

    /// Text of `ids`. With `skip_special_tokens` special tokens (BOS, EOS, `<|im_end|>`, ...)
    /// are left out. Ids outside the vocabulary are an error.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.decode_part(ids, skip_special_tokens, true)
    }

    /// `at_start`: `ids` begin the text (SentencePiece's prefix space is dropped only there).
    pub(crate) fn decode_part(
        &self,
        ids: &[u32],
        skip_special_tokens: bool,
        at_start: bool,
    ) -> Result<String, TokenizerError> {
        match &self.backend {
            Backend::Hf { tok, .. } => {
                if let Some(&id) = ids.iter().find(|&&id| tok.id_to_token(id).is_none()) {
                    return Err(TokenizerError::InvalidId {
                        id,
                        vocab_size: self.vocab_size(),
                    });
                }
                tok.decode(ids, skip_special_tokens).map_err(backend_err)
            }
            Backend::Spm(spm) => spm.decode(ids, skip_special_tokens, at_start),
        }
    }

    /// Whether `ids` end inside a run of `<0xXX>` tokens of a `tokenizers` pipeline with a
    /// `ByteFallback` decoder. Such a run is decoded as a whole (an invalid run becomes one
    /// U+FFFD per byte) and special tokens skipped in decoding do not end it, so a stream must
    /// wait for the run to end. GGUF SentencePiece decoding reads the joined bytes instead and
    /// needs no such wait.
    pub(crate) fn in_byte_run(&self, ids: &[u32], skip_special_tokens: bool) -> bool {
        let Backend::Hf {
            tok,
            byte_fallback: true,
            ..
        } = &self.backend
        else {
            return false;
        };
        let added = tok.get_added_vocabulary();
        for &id in ids.iter().rev() {
            let Some(t) = tok.id_to_token(id) else {
                return false;
            };
            if skip_special_tokens && added.is_special_token(&t) {
                continue;
            }
            return spm::parse_byte_piece(&t).is_some();
        }
        false
    }

    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// The chat rendered by the model's template, exactly as transformers'
    /// `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.template
            .as_ref()
            .ok_or(TokenizerError::NoChatTemplate)?
            .render(messages, add_generation_prompt)
    }

    /// The chat template's source, if it has a usable one.
    pub fn chat_template_source(&self) -> Option<String> {
        self.template.as_ref().and_then(|t| t.source())
    }

    /// Whether the chat template takes a `tools` list itself.
    pub fn template_uses_tools(&self) -> bool {
        self.template.as_ref().is_some_and(|t| t.uses_tools())
    }

    /// The chat rendered from JSON messages (which may carry `tool_calls`, `tool_call_id`, ...)
    /// with an optional `tools` list and more template variables, as
    /// `apply_chat_template(messages, tools=tools, **extra)`.
    pub fn apply_chat_template_json(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        extra: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<String, TokenizerError> {
        self.template
            .as_ref()
            .ok_or(TokenizerError::NoChatTemplate)?
            .render_json(messages, tools, add_generation_prompt, extra)
    }

    /// This tokenizer as a Hugging Face `tokenizer.json` (a GGUF's vocabulary, say, exported
    /// into a model folder): the `tokenizers` pipeline as it is, or for a SentencePiece
    /// vocabulary a BPE pipeline that tokenizes as trellm's own twin does (see `spm`).
    pub fn to_hf_json(&self) -> Result<String, TokenizerError> {
        match &self.backend {
            Backend::Hf { tok, .. } => tok.to_string(false).map_err(backend_err),
            Backend::Spm(spm) => spm
                .to_hf(self.bos, self.add_bos)?
                .to_string(false)
                .map_err(backend_err),
        }
    }

    /// The model's BOS token, if it has one (whether or not `encode` adds it: see [`Self::add_bos`]).
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// Whether `encode(text, true)` puts BOS in front.
    pub fn add_bos(&self) -> bool {
        match &self.backend {
            Backend::Hf {
                post_process: true, ..
            } => {
                let bos = self.bos;
                bos.is_some() && self.encode("", true).ok().and_then(|v| v.first().copied()) == bos
            }
            _ => self.add_bos && self.bos.is_some(),
        }
    }

    /// Every id that ends generation: EOS plus end-of-turn tokens (`<end_of_turn>`,
    /// `<|im_end|>`, ...) where the model lists them.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        match &self.backend {
            Backend::Hf { tok, .. } => tok.get_vocab_size(true),
            Backend::Spm(spm) => spm.len(),
        }
    }

    /// Id of a token given its text as stored in the vocabulary (e.g. `<|im_end|>`, `▁the`).
    pub fn token_to_id(&self, s: &str) -> Option<u32> {
        match &self.backend {
            Backend::Hf { tok, .. } => tok.token_to_id(s),
            Backend::Spm(spm) => spm.token_to_id(s),
        }
    }

    /// The vocabulary text of a token (inverse of [`Self::token_to_id`]).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        match &self.backend {
            Backend::Hf { tok, .. } => tok.id_to_token(id),
            Backend::Spm(spm) => spm.piece(id).map(str::to_string),
        }
    }

    /// Incremental decoder for generated ids; keeps special tokens (like `decode(ids, false)`).
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self, false)
    }

    /// Incremental decoder with a choice about special tokens.
    pub fn stream_decoder_with(&self, skip_special_tokens: bool) -> StreamDecoder<'_> {
        StreamDecoder::new(self, skip_special_tokens)
    }
}
