//! The decoder's switches, read from GGUF metadata or a Hugging Face `config.json`.
//!
//! One `ModelConfig` drives the one decoder; each family only says how its files map onto it.

use anyhow::{anyhow, bail, Context, Result};
use trellm_formats::gguf::Gguf;

/// The families this build can run, as named in GGUF `general.architecture` / HF `model_type`.
pub const SUPPORTED_FAMILIES: &[&str] = &["llama", "gemma3"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Gemma3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU: silu(gate) * up.
    Silu,
    /// GeGLU with the tanh approximation of GELU.
    GeluTanh,
}

/// Rotary embedding of one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeSpec {
    /// Rotated dimensions per head (the rest pass through).
    pub dims: usize,
    pub base: f32,
    /// Linear position scaling (positions are multiplied by this).
    pub position_scale: f32,
    /// Pairs are adjacent (x[2i], x[2i+1]) rather than split halves (x[i], x[i + dims/2]).
    /// GGUF llama files store Q/K rows permuted for this layout.
    pub interleaved: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LayerSpec {
    /// Attend only to the last `n` positions (including the current one).
    pub sliding_window: Option<usize>,
    pub rope: RopeSpec,
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
    pub activation: Activation,
    /// RMSNorm over each head of q and k before RoPE.
    pub qk_norm: bool,
    /// Norms after attention and after the MLP, before each residual add (gemma).
    pub sandwich_norms: bool,
    /// Multiplier applied to the token embedding.
    pub embed_scale: Option<f32>,
    /// Multiplier on q·k.
    pub attn_scale: f32,
    pub layers: Vec<LayerSpec>,
    pub bos_id: Option<u32>,
    pub eos_ids: Vec<u32>,
}

impl ModelConfig {
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let arch = g
            .architecture()
            .ok_or_else(|| anyhow!("GGUF has no general.architecture"))?;
        let family = match arch {
            "llama" => Family::Llama,
            "gemma3" => Family::Gemma3,
            other => bail!(
                "unsupported architecture '{other}' (supported: {})",
                SUPPORTED_FAMILIES.join(", ")
            ),
        };
        let key = |k: &str| format!("{arch}.{k}");
        let req = |k: &str| -> Result<usize> {
            g.get_u64(&key(k))
                .map(|v| v as usize)
                .ok_or_else(|| anyhow!("GGUF metadata lacks {}", key(k)))
        };
        let hidden = req("embedding_length")?;
        let n_heads = req("attention.head_count")?;
        let n_kv_heads = g
            .get_u64(&key("attention.head_count_kv"))
            .map(|v| v as usize)
            .unwrap_or(n_heads);
        let n_layers = req("block_count")?;
        let head_dim = g
            .get_u64(&key("attention.key_length"))
            .map(|v| v as usize)
            .unwrap_or(hidden / n_heads.max(1));
        let vocab = match g.get_u64(&key("vocab_size")) {
            Some(v) => v as usize,
            None => g
                .tensor("token_embd.weight")
                .map(|t| t.rows_cols().0)
                .ok_or_else(|| anyhow!("GGUF has no token_embd.weight"))?,
        };
        let norm_eps = g
            .get_f32(&key("attention.layer_norm_rms_epsilon"))
            .ok_or_else(|| {
                anyhow!(
                    "GGUF metadata lacks {}",
                    key("attention.layer_norm_rms_epsilon")
                )
            })?;
        let rope_base = g.get_f32(&key("rope.freq_base")).unwrap_or(10000.0);
        let rope_dims = g
            .get_u64(&key("rope.dimension_count"))
            .map(|v| v as usize)
            .unwrap_or(head_dim);
        let linear_scale = match g.get_str(&key("rope.scaling.type")) {
            Some("linear") => 1.0 / g.get_f32(&key("rope.scaling.factor")).unwrap_or(1.0),
            Some("none") | None => 1.0,
            Some(other) => bail!("unsupported rope scaling '{other}' in GGUF"),
        };
        let max_context = req("context_length")?;
        let bos_id = g.get_u64("tokenizer.ggml.bos_token_id").map(|v| v as u32);
        let eos_ids = g
            .get_u64("tokenizer.ggml.eos_token_id")
            .map(|v| vec![v as u32])
            .unwrap_or_default();
        let cfg = match family {
            Family::Llama => {
                let rope = RopeSpec {
                    dims: rope_dims,
                    base: rope_base,
                    position_scale: linear_scale,
                    interleaved: true,
                };
                ModelConfig {
                    family,
                    hidden,
                    intermediate: req("feed_forward_length")?,
                    n_heads,
                    n_kv_heads,
                    head_dim,
                    vocab,
                    norm_eps,
                    max_context,
                    activation: Activation::Silu,
                    qk_norm: false,
                    sandwich_norms: false,
                    embed_scale: None,
                    attn_scale: (head_dim as f32).powf(-0.5),
                    layers: vec![
                        LayerSpec {
                            sliding_window: None,
                            rope
                        };
                        n_layers
                    ],
                    bos_id,
                    eos_ids,
                }
            }
            Family::Gemma3 => {
                let window = req("attention.sliding_window")?;
                // llama.cpp's gemma3 GGUFs do not record these; they are fixed for the family.
                let pattern = 6;
                let local_base = 10000.0;
                gemma3(Gemma3Params {
                    hidden,
                    intermediate: req("feed_forward_length")?,
                    n_heads,
                    n_kv_heads,
                    head_dim,
                    vocab,
                    norm_eps,
                    max_context,
                    n_layers,
                    window,
                    is_sliding: Box::new(move |i| (i + 1) % pattern != 0),
                    global_base: rope_base,
                    local_base,
                    global_scale: linear_scale,
                    query_pre_attn_scalar: head_dim as f32,
                    bos_id,
                    eos_ids,
                })
            }
        };
        Ok(cfg)
    }

    /// From a Hugging Face `config.json` (and `generation_config.json` for EOS ids, if present).
    pub fn from_hf(
        config: &serde_json::Value,
        generation: Option<&serde_json::Value>,
    ) -> Result<Self> {
        // Multimodal gemma3 folders nest the text model.
        let c = match config.get("text_config") {
            Some(t) if t.is_object() => t,
            _ => config,
        };
        let model_type = c
            .get("model_type")
            .or_else(|| config.get("model_type"))
            .and_then(|v| v.as_str())
            .ok_or_else(|| anyhow!("config.json has no model_type"))?;
        let family = match model_type {
            "llama" | "mistral" => Family::Llama,
            "gemma3" | "gemma3_text" => Family::Gemma3,
            other => bail!(
                "unsupported model_type '{other}' (supported: {})",
                SUPPORTED_FAMILIES.join(", ")
            ),
        };
        let f = Fields(c);
        let hidden = f.usize("hidden_size")?;
        let n_heads = f.usize("num_attention_heads")?;
        let n_kv_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(n_heads);
        let n_layers = f.usize("num_hidden_layers")?;
        let head_dim = f.opt_usize("head_dim")?.unwrap_or(hidden / n_heads.max(1));
        let vocab = f.usize("vocab_size")?;
        let eos_ids = generation
            .and_then(|g| g.get("eos_token_id"))
            .or_else(|| c.get("eos_token_id"))
            .or_else(|| config.get("eos_token_id"))
            .map(id_list)
            .unwrap_or_default();
        let bos_id = c
            .get("bos_token_id")
            .and_then(|v| v.as_u64())
            .map(|v| v as u32);
        Ok(match family {
            Family::Llama => {
                let base = f.opt_f32("rope_theta")?.unwrap_or(10000.0);
                let position_scale = match c.get("rope_scaling") {
                    Some(s) if s.is_object() => {
                        let ty = s
                            .get("type")
                            .or_else(|| s.get("rope_type"))
                            .and_then(|t| t.as_str());
                        match ty {
                            Some("linear") => {
                                1.0 / s.get("factor").and_then(|v| v.as_f64()).unwrap_or(1.0) as f32
                            }
                            Some("default") | None => 1.0,
                            Some(other) => {
                                bail!("rope_scaling type '{other}' is not supported yet")
                            }
                        }
                    }
                    _ => 1.0,
                };
                let rope = RopeSpec {
                    dims: head_dim,
                    base,
                    position_scale,
                    interleaved: false,
                };
                ModelConfig {
                    family,
                    hidden,
                    intermediate: f.usize("intermediate_size")?,
                    n_heads,
                    n_kv_heads,
                    head_dim,
                    vocab,
                    norm_eps: f.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
                    max_context: f.opt_usize("max_position_embeddings")?.unwrap_or(4096),
                    activation: Activation::Silu,
                    qk_norm: false,
                    sandwich_norms: false,
                    embed_scale: None,
                    attn_scale: (head_dim as f32).powf(-0.5),
                    layers: vec![
                        LayerSpec {
                            sliding_window: None,
                            rope
                        };
                        n_layers
                    ],
                    bos_id,
                    eos_ids,
                }
            }
            Family::Gemma3 => {
                let pattern = f.opt_usize("sliding_window_pattern")?.unwrap_or(6).max(1);
                let global_scale = match c.get("rope_scaling") {
                    Some(s) if s.is_object() => {
                        1.0 / s.get("factor").and_then(|v| v.as_f64()).unwrap_or(1.0) as f32
                    }
                    _ => 1.0,
                };
                gemma3(Gemma3Params {
                    hidden,
                    intermediate: f.usize("intermediate_size")?,
                    n_heads,
                    n_kv_heads,
                    head_dim,
                    vocab,
                    norm_eps: f.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
                    max_context: f.opt_usize("max_position_embeddings")?.unwrap_or(32768),
                    n_layers,
                    window: f.opt_usize("sliding_window")?.unwrap_or(512),
                    // mlx-lm follows sliding_window_pattern, not layer_types.
                    is_sliding: Box::new(move |i| (i + 1) % pattern != 0),
                    global_base: f.opt_f32("rope_theta")?.unwrap_or(1_000_000.0),
                    local_base: f.opt_f32("rope_local_base_freq")?.unwrap_or(10_000.0),
                    global_scale,
                    query_pre_attn_scalar: f.opt_f32("query_pre_attn_scalar")?.unwrap_or(256.0),
                    bos_id,
                    eos_ids,
                })
            }
        })
    }
}

struct Gemma3Params {
    hidden: usize,
    intermediate: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    vocab: usize,
    norm_eps: f32,
    max_context: usize,
    n_layers: usize,
    window: usize,
    is_sliding: Box<dyn Fn(usize) -> bool>,
    global_base: f32,
    local_base: f32,
    global_scale: f32,
    query_pre_attn_scalar: f32,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
}

fn gemma3(p: Gemma3Params) -> ModelConfig {
    let layers = (0..p.n_layers)
        .map(|i| {
            let sliding = (p.is_sliding)(i);
            let rope = RopeSpec {
                dims: p.head_dim,
                base: if sliding { p.local_base } else { p.global_base },
                position_scale: if sliding { 1.0 } else { p.global_scale },
                interleaved: false,
            };
            LayerSpec {
                sliding_window: sliding.then_some(p.window),
                rope,
            }
        })
        .collect();
    ModelConfig {
        family: Family::Gemma3,
        hidden: p.hidden,
        intermediate: p.intermediate,
        n_heads: p.n_heads,
        n_kv_heads: p.n_kv_heads,
        head_dim: p.head_dim,
        vocab: p.vocab,
        norm_eps: p.norm_eps,
        max_context: p.max_context,
        activation: Activation::GeluTanh,
        qk_norm: true,
        sandwich_norms: true,
        // The reference rounds sqrt(hidden) to bfloat16 before scaling.
        embed_scale: Some(half::bf16::from_f32((p.hidden as f32).sqrt()).to_f32()),
        attn_scale: p.query_pre_attn_scalar.powf(-0.5),
        layers,
        bos_id: p.bos_id,
        eos_ids: p.eos_ids,
    }
}

fn id_list(v: &serde_json::Value) -> Vec<u32> {
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
struct Fields<'a>(&'a serde_json::Value);

impl Fields<'_> {
    fn opt_usize(&self, k: &str) -> Result<Option<usize>> {
        match self.0.get(k) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|v| Some(v as usize))
                .with_context(|| format!("config.json field {k} is not a non-negative integer")),
        }
    }
    fn usize(&self, k: &str) -> Result<usize> {
        self.opt_usize(k)?
            .ok_or_else(|| anyhow!("config.json lacks the field {k}"))
    }
    fn opt_f32(&self, k: &str) -> Result<Option<f32>> {
        match self.0.get(k) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|v| Some(v as f32))
                .with_context(|| format!("config.json field {k} is not a number")),
        }
    }
}
