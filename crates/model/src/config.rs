//! The decoder's switches, read from GGUF metadata or a Hugging Face `config.json`.
//!
//! One `ModelConfig` drives the one decoder; each family (`families.rs` for `config.json`,
//! `gguf_families.rs` for GGUF) only says how its files map onto these switches.

use anyhow::{anyhow, bail, Context, Result};
use trellm_formats::gguf::Gguf;

use super::rope::Rope;

pub use super::families::SUPPORTED_FAMILIES;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Qwen2,
    Qwen3,
    Gemma,
    Gemma2,
    Gemma3,
    Phi3,
    Olmo2,
    Granite,
    SmolLM3,
    Starcoder2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// silu(x) = x * sigmoid(x).
    Silu,
    /// GELU, tanh approximation.
    GeluTanh,
    /// GELU with erf (exact).
    Gelu,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mlp {
    /// `down(act(gate(x)) * up(x))`.
    Gated,
    /// `down(act(up(x)))`.
    Plain,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Norm {
    /// RMSNorm with a weight.
    Rms,
    /// LayerNorm with a weight and a bias.
    Layer,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// RMSNorm over each head of q and k (weights of `head_dim`).
    PerHead,
    /// RMSNorm over the whole q and k projections (olmo2).
    Whole,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LayerSpec {
    /// Attend only to the last `n` positions (including the current one).
    pub sliding_window: Option<usize>,
    /// None: no positional encoding in this layer (NoPE).
    pub rope: Option<Rope>,
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub family: Family,
    pub hidden: usize,
    pub intermediate: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub norm_eps: f32,
    pub max_context: usize,
    pub norm: Norm,
    /// Norm weights are stored as `w` for a scale of `1 + w` (gemma).
    pub norm_plus_one: bool,
    /// Norms on the residual stream before attention and before the MLP.
    pub pre_norms: bool,
    /// Norms on attention's and the MLP's outputs, before each residual add (gemma2/3, olmo2).
    pub post_norms: bool,
    pub qk_norm: QkNorm,
    pub activation: Activation,
    pub mlp: Mlp,
    /// Biases on the q, k, v projections / on the output projection / on the MLP's projections.
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// q, k, v stored as one matrix (`qkv_proj`), gate and up as one (`gate_up_proj`): phi3.
    pub fused_qkv: bool,
    pub fused_gate_up: bool,
    /// The output projection is the embedding matrix.
    pub tied_embeddings: bool,
    /// An EXL3 folder (`quantization_config.quant_method == "exl3"`): projections stored as
    /// trellises where the folder has them.
    pub exl3: bool,
    /// Multiplier applied to the token embedding.
    pub embed_scale: Option<f32>,
    /// Multiplier on each layer's attention and MLP outputs before the residual add (granite).
    pub residual_scale: Option<f32>,
    /// Multiplier on q·k.
    pub attn_scale: f32,
    /// Attention scores become `cap * tanh(scores / cap)` (gemma2).
    pub attn_softcap: Option<f32>,
    /// Logits become `cap * tanh(logits / cap)` (gemma2).
    pub final_softcap: Option<f32>,
    /// Logits are divided by this (granite's `logits_scaling`).
    pub logits_divisor: Option<f32>,
    pub layers: Vec<LayerSpec>,
    pub bos_id: Option<u32>,
    pub eos_ids: Vec<u32>,
}

impl ModelConfig {
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// From a Hugging Face `config.json` (and `generation_config.json` for EOS ids, if present).
    pub fn from_hf(
        config: &serde_json::Value,
        generation: Option<&serde_json::Value>,
    ) -> Result<Self> {
        let cfg = super::families::from_hf(config, generation)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// From GGUF metadata (see `gguf_families`).
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let cfg = super::gguf_families::from_gguf(g)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Refuses values no model has (they would give garbage or fail deep inside a forward pass):
    /// sizes zero, overflowing or beyond [`LIMITS`], norm epsilon and multipliers not finite and
    /// positive, heads that do not group, windows of zero, a RoPE that [`Rope::validate`] refuses,
    /// a BOS id outside the vocabulary.
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("hidden size", self.hidden, LIMITS.hidden),
            ("intermediate size", self.intermediate, LIMITS.intermediate),
            ("attention heads", self.n_heads, LIMITS.heads),
            ("key/value heads", self.n_kv_heads, LIMITS.heads),
            ("head dimension", self.head_dim, LIMITS.head_dim),
            ("vocabulary size", self.vocab, LIMITS.vocab),
            ("layers", self.n_layers(), LIMITS.layers),
        ];
        for (what, v, max) in sizes {
            check_size(what, v, max)?;
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            bail!(
                "{} attention heads do not group over {} key/value heads",
                self.n_heads,
                self.n_kv_heads
            );
        }
        if self.max_context == 0 {
            bail!("the model's context length is 0");
        }
        let positive = |what: &str, v: f32| -> Result<()> {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                bail!("{what} must be finite and positive, got {v}")
            }
        };
        positive("the norm epsilon", self.norm_eps)?;
        if self.norm_eps >= 1.0 {
            bail!("the norm epsilon must be below 1, got {}", self.norm_eps);
        }
        positive("the attention scale", self.attn_scale)?;
        let optional = [
            ("the embedding multiplier", self.embed_scale),
            ("the residual multiplier", self.residual_scale),
            ("the attention logit soft-cap", self.attn_softcap),
            ("the final logit soft-cap", self.final_softcap),
            ("logits_scaling", self.logits_divisor),
        ];
        for (what, v) in optional {
            if let Some(v) = v {
                positive(what, v)?;
            }
        }
        for (i, l) in self.layers.iter().enumerate() {
            if l.sliding_window == Some(0) {
                bail!("layer {i} has a sliding window of 0 positions");
            }
            if let Some(r) = &l.rope {
                r.validate(self.head_dim)
                    .map_err(|e| anyhow!("layer {i}: {e}"))?;
            }
        }
        if let Some(b) = self.bos_id {
            if b as usize >= self.vocab {
                bail!(
                    "the BOS token id {b} is outside the vocabulary (size {})",
                    self.vocab
                );
            }
        }
        Ok(())
    }

    /// Llama's switches (pre-norm RMSNorm, SwiGLU, no biases, tied head, `head_dim^-0.5`), the
    /// same RoPE in every layer; families change what differs.
    pub fn llama_like(family: Family, d: Dims, rope: Option<Rope>) -> ModelConfig {
        ModelConfig {
            family,
            hidden: d.hidden,
            intermediate: d.intermediate,
            n_heads: d.n_heads,
            n_kv_heads: d.n_kv_heads,
            head_dim: d.head_dim,
            vocab: d.vocab,
            norm_eps: d.norm_eps,
            max_context: d.max_context,
            norm: Norm::Rms,
            norm_plus_one: false,
            pre_norms: true,
            post_norms: false,
            qk_norm: QkNorm::None,
            activation: Activation::Silu,
            mlp: Mlp::Gated,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            fused_qkv: false,
            fused_gate_up: false,
            tied_embeddings: true,
            exl3: false,
            embed_scale: None,
            residual_scale: None,
            attn_scale: (d.head_dim as f64).powf(-0.5) as f32,
            attn_softcap: None,
            final_softcap: None,
            logits_divisor: None,
            layers: vec![
                LayerSpec {
                    sliding_window: None,
                    rope,
                };
                d.n_layers
            ],
            bos_id: d.bos_id,
            eos_ids: d.eos_ids,
        }
    }
}

/// Upper bounds on a model's sizes, far above any released model's; a file claiming more is
/// corrupt. They keep every size product (`heads * head_dim * hidden`, ...) well inside `usize`.
pub struct Limits {
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub layers: usize,
}

pub const LIMITS: Limits = Limits {
    hidden: 1 << 17,
    intermediate: 1 << 20,
    heads: 1 << 12,
    head_dim: 1 << 13,
    vocab: 1 << 24,
    layers: 1 << 12,
};

/// `v` must be in `1..=max`.
pub(crate) fn check_size(what: &str, v: usize, max: usize) -> Result<usize> {
    if v == 0 || v > max {
        bail!("the model's {what} is {v} (must be between 1 and {max})");
    }
    Ok(v)
}

/// The sizes every family has.
pub struct Dims {
    pub hidden: usize,
    pub intermediate: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub n_layers: usize,
    pub norm_eps: f32,
    pub max_context: usize,
    pub bos_id: Option<u32>,
    pub eos_ids: Vec<u32>,
}

pub fn id_list(v: &serde_json::Value) -> Vec<u32> {
    match v {
        serde_json::Value::Array(a) => a
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|x| x as u32)
            .collect(),
        v => v.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
    }
}

/// Typed access to config fields with errors that name the field.
pub struct Fields<'a>(pub &'a serde_json::Value);

impl Fields<'_> {
    pub fn opt_usize(&self, k: &str) -> Result<Option<usize>> {
        match self.0.get(k) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|v| Some(v as usize))
                .with_context(|| format!("config.json field {k} is not a non-negative integer")),
        }
    }
    pub fn usize(&self, k: &str) -> Result<usize> {
        self.opt_usize(k)?
            .ok_or_else(|| anyhow!("config.json lacks the field {k}"))
    }
}
