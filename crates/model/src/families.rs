//! One small spec per family: how mlx-lm reads a `config.json` of that `model_type`, turned into
//! the decoder's switches. Tensor names follow from the switches (see `weights.rs`).
//!
//! Defaults and required fields are mlx-lm's (its `ModelArgs` dataclasses): a field mlx-lm
//! requires is required here, with an error naming it.

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

use super::config::{
    check_size, id_list, Activation, Dims, Family, Fields, Mlp, ModelConfig, Norm, QkNorm, LIMITS,
};
use super::rope::Rope;

/// `model_type`s this build runs (mistral is read as llama, as mlx-lm does).
pub const SUPPORTED_FAMILIES: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "phi3",
    "olmo2",
    "granite",
    "smollm3",
    "starcoder2",
];

impl Fields<'_> {
    pub fn opt_f64(&self, k: &str) -> Result<Option<f64>> {
        match self.0.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .with_context(|| format!("config.json field {k} is not a number")),
        }
    }
    pub fn f64(&self, k: &str) -> Result<f64> {
        self.opt_f64(k)?
            .ok_or_else(|| anyhow!("config.json lacks the field {k}"))
    }
    pub fn opt_bool(&self, k: &str) -> Result<Option<bool>> {
        match self.0.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .with_context(|| format!("config.json field {k} is not true or false")),
        }
    }
    pub fn bool(&self, k: &str) -> Result<bool> {
        self.opt_bool(k)?
            .ok_or_else(|| anyhow!("config.json lacks the field {k}"))
    }
    fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }
}

/// What every model of a family has, whichever file (config.json or GGUF) it comes from: llama's
/// switches changed where the family differs. Each reader then sets what its file decides
/// (tied head, optional biases, multipliers, RoPE, windows).
pub fn family_layout(family: Family, d: Dims, rope: Option<Rope>) -> ModelConfig {
    let hidden = d.hidden;
    let mut c = ModelConfig::llama_like(family, d, rope);
    match family {
        Family::Llama | Family::SmolLM3 | Family::Granite => {}
        Family::Qwen2 => c.qkv_bias = true,
        Family::Qwen3 => c.qk_norm = QkNorm::PerHead,
        Family::Gemma | Family::Gemma2 | Family::Gemma3 => {
            c.norm_plus_one = true;
            c.tied_embeddings = true;
            c.activation = if family == Family::Gemma {
                Activation::Gelu
            } else {
                Activation::GeluTanh
            };
            c.post_norms = family != Family::Gemma;
            c.embed_scale = Some(if family == Family::Gemma3 {
                // mlx-lm rounds gemma3's scale to bfloat16.
                half::bf16::from_f32((hidden as f32).sqrt()).to_f32()
            } else {
                (hidden as f64).sqrt() as f32
            });
            if family == Family::Gemma3 {
                c.qk_norm = QkNorm::PerHead;
            }
        }
        Family::Phi3 => {
            c.fused_qkv = true;
            c.fused_gate_up = true;
        }
        Family::Olmo2 => {
            c.pre_norms = false;
            c.post_norms = true;
            c.qk_norm = QkNorm::Whole;
        }
        Family::Starcoder2 => {
            c.norm = Norm::Layer;
            c.mlp = Mlp::Plain;
            c.activation = Activation::Gelu;
            c.qkv_bias = true;
            c.o_bias = true;
            c.mlp_bias = true;
        }
    }
    c
}

/// Reads the sizes every family has. `head_dim`: the family's rule for it.
fn dims(
    f: &Fields,
    head_dim: HeadDim,
    kv_required: bool,
    eps_key: &str,
    eps_default: Option<f64>,
    max_default: Option<usize>,
    ids: (Option<u32>, Vec<u32>),
) -> Result<Dims> {
    let hidden = f.usize("hidden_size")?;
    let n_heads = f.usize("num_attention_heads")?;
    if n_heads == 0 {
        bail!("config.json field num_attention_heads is 0");
    }
    let n_kv_heads = if kv_required {
        f.usize("num_key_value_heads")?
    } else {
        f.opt_usize("num_key_value_heads")?.unwrap_or(n_heads)
    };
    if n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
        bail!("num_attention_heads ({n_heads}) is not a multiple of num_key_value_heads ({n_kv_heads})");
    }
    let head_dim = match head_dim {
        HeadDim::Derived => hidden / n_heads,
        HeadDim::Optional => f.opt_usize("head_dim")?.unwrap_or(hidden / n_heads),
        HeadDim::Required => f.usize("head_dim")?,
    };
    let norm_eps = match (f.opt_f64(eps_key)?, eps_default) {
        (Some(e), _) | (None, Some(e)) => e as f32,
        (None, None) => bail!("config.json lacks the field {eps_key}"),
    };
    let max_context = match (f.opt_usize("max_position_embeddings")?, max_default) {
        (Some(m), _) | (None, Some(m)) => m,
        // mlx-lm sets no limit; neither does the model.
        (None, None) => usize::MAX,
    };
    // Bounded before anything is sized by them (the layer table, RoPE tables).
    check_size("head dimension", head_dim, LIMITS.head_dim)?;
    Ok(Dims {
        hidden,
        intermediate: f.usize("intermediate_size")?,
        n_heads,
        n_kv_heads,
        head_dim,
        vocab: f.usize("vocab_size")?,
        n_layers: check_size("layers", f.usize("num_hidden_layers")?, LIMITS.layers)?,
        norm_eps,
        max_context,
        bos_id: ids.0,
        eos_ids: ids.1,
    })
}

#[derive(Clone, Copy)]
enum HeadDim {
    /// `hidden_size / num_attention_heads`, whatever `head_dim` says.
    Derived,
    /// `head_dim`, else `hidden_size / num_attention_heads`.
    Optional,
    Required,
}

/// RoPE from `rope_theta`, `rope_scaling` and `max_position_embeddings` through
/// `initialize_rope`, over `dims` rotated dimensions.
fn rope(f: &Fields, dims: usize, base_default: Option<f64>, traditional: bool) -> Result<Rope> {
    let base = match (f.opt_f64("rope_theta")?, base_default) {
        (Some(b), _) | (None, Some(b)) => b,
        (None, None) => bail!("config.json lacks the field rope_theta"),
    };
    Rope::new(
        dims,
        base,
        traditional,
        f.get("rope_scaling"),
        f.opt_usize("max_position_embeddings")?,
    )
}

/// Dynamic NTK scaling exists to run past `max_position_embeddings`: allow `factor` times it.
fn extend_context(c: &mut ModelConfig, f: &Fields) {
    let dynamic = c
        .layers
        .iter()
        .any(|l| l.rope.as_ref().is_some_and(|r| r.is_dynamic()));
    if dynamic {
        let factor = f
            .get("rope_scaling")
            .and_then(|s| s.get("factor"))
            .and_then(Value::as_f64)
            .unwrap_or(1.0)
            .max(1.0);
        c.max_context = (c.max_context as f64 * factor) as usize;
    }
}

/// From a Hugging Face `config.json` (and `generation_config.json` for EOS ids, if present).
pub fn from_hf(config: &Value, generation: Option<&Value>) -> Result<ModelConfig> {
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
    let ids = (bos_id, eos_ids);
    let f = Fields(c);
    let mut cfg = match model_type {
        "llama" | "mistral" => llama(&f, Family::Llama, ids)?,
        "smollm3" => smollm3(&f, ids)?,
        "qwen2" => qwen2(&f, ids)?,
        "qwen3" => qwen3(&f, ids)?,
        "gemma" => gemma(&f, ids)?,
        "gemma2" => gemma2(&f, ids)?,
        "gemma3" | "gemma3_text" => gemma3_hf(&f, ids)?,
        "phi3" => phi3(&f, ids)?,
        "olmo2" => olmo2(&f, ids)?,
        "granite" => granite(&f, ids)?,
        "starcoder2" => starcoder2(&f, ids)?,
        other => bail!(
            "unsupported model_type '{}' (supported: {})",
            trellm_formats::quote(other),
            SUPPORTED_FAMILIES.join(", ")
        ),
    };
    extend_context(&mut cfg, &f);
    cfg.exl3 = quant_method(config)? == Some("exl3");
    Ok(cfg)
}

/// `quantization_config.quant_method`, refusing the methods trellm cannot run.
fn quant_method(config: &Value) -> Result<Option<&str>> {
    let Some(q) = config.get("quantization_config") else {
        return Ok(None);
    };
    match q.get("quant_method").and_then(|m| m.as_str()) {
        Some("exl3") => Ok(Some("exl3")),
        Some(other) => bail!(
            "unsupported quantization method '{}' (supported: exl3)",
            trellm_formats::quote(other)
        ),
        None => bail!("config.json has a quantization_config without a quant_method"),
    }
}

/// llama (and mistral): optional biases, `rope_traditional`, every `rope_scaling`, sliding
/// layers where `layer_types` says `sliding_attention`.
fn llama(f: &Fields, family: Family, ids: (Option<u32>, Vec<u32>)) -> Result<ModelConfig> {
    let d = dims(f, HeadDim::Optional, false, "rms_norm_eps", None, None, ids)?;
    let r = rope(
        f,
        d.head_dim,
        Some(10000.0),
        f.opt_bool("rope_traditional")?.unwrap_or(false),
    )?;
    let mut c = family_layout(family, d, Some(r));
    let attention_bias = f.opt_bool("attention_bias")?.unwrap_or(false);
    c.qkv_bias = attention_bias;
    c.o_bias = attention_bias;
    c.mlp_bias = f.opt_bool("mlp_bias")?.unwrap_or(false);
    c.tied_embeddings = f.opt_bool("tie_word_embeddings")?.unwrap_or(true);
    if let Some(types) = f.get("layer_types") {
        let types = types
            .as_array()
            .ok_or_else(|| anyhow!("config.json field layer_types is not a list"))?;
        if types.len() != c.layers.len() {
            bail!(
                "config.json field layer_types has {} entries for {} layers",
                types.len(),
                c.layers.len()
            );
        }
        for (l, t) in c.layers.iter_mut().zip(types) {
            if t.as_str() == Some("sliding_attention") {
                l.sliding_window = Some(f.usize("sliding_window")?);
            }
        }
    }
    Ok(c)
}

/// smollm3: llama with NoPE layers (`no_rope_layers[i] == 0`, by default every 4th layer).
fn smollm3(f: &Fields, ids: (Option<u32>, Vec<u32>)) -> Result<ModelConfig> {
    let mut c = llama(f, Family::SmolLM3, ids)?;
    let n = c.layers.len();
    let use_rope: Vec<bool> = match f.get("no_rope_layers") {
        Some(v) => {
            let v = v
                .as_array()
                .ok_or_else(|| anyhow!("config.json field no_rope_layers is not a list"))?;
            if v.len() != n {
                bail!(
                    "config.json field no_rope_layers has {} entries for {n} layers",
                    v.len()
                );
            }
            v.iter().map(|x| x.as_u64() != Some(0)).collect()
        }
        None => {
            let every = f.opt_usize("no_rope_layer_interval")?.unwrap_or(4).max(1);
            (0..n).map(|i| (i + 1) % every != 0).collect()
        }
    };
    for (l, r) in c.layers.iter_mut().zip(use_rope) {
        if !r {
            l.rope = None;
        }
    }
    Ok(c)
}

/// qwen2: q/k/v biases, head_dim from hidden / heads.
fn qwen2(f: &Fields, ids: (Option<u32>, Vec<u32>)) -> Result<ModelConfig> {
    let d = dims(
        f,
        HeadDim::Derived,
        true,
        "rms_norm_eps",
        None,
        Some(32768),
        ids,
    )?;
    let r = rope(
        f,
        d.head_dim,
        Some(1_000_000.0),
        f.opt_bool("rope_traditional")?.unwrap_or(false),
    )?;
    let mut c = family_layout(Family::Qwen2, d, Some(r));
    c.tied_embeddings = f.opt_bool("tie_word_embeddings")?.unwrap_or(true);
    Ok(c)
}

/// qwen3: per-head q/k RMSNorm; `rope_parameters` (transformers 5) stands in for
/// `rope_theta`/`rope_scaling`.
fn qwen3(f: &Fields, ids: (Option<u32>, Vec<u32>)) -> Result<ModelConfig> {
    f.usize("max_position_embeddings")?;
    let d = dims(f, HeadDim::Required, true, "rms_norm_eps", None, None, ids)?;
    let params = f.get("rope_parameters").filter(|p| p.is_object());
    let base = match (f.opt_f64("rope_theta")?, params) {
        (Some(b), _) => b,
        (None, Some(p)) => p
            .get("rope_theta")
            .and_then(Value::as_f64)
            .ok_or_else(|| anyhow!("config.json lacks the field rope_theta"))?,
        (None, None) => bail!("config.json lacks the field rope_theta"),
    };
    let scaling = f.get("rope_scaling").or(params);
    let r = Rope::new(
        d.head_dim,
        base,
        false,
        scaling,
        f.opt_usize("max_position_embeddings")?,
    )?;
    let mut c = family_layout(Family::Qwen3, d, Some(r));
    c.tied_embeddings = f.bool("tie_word_embeddings")?;
    Ok(c)
}

/// gemma: `(1 + w)` norms, embedding scaled by sqrt(hidden), exact-GELU GeGLU, tied head.
fn gemma(f: &Fields, ids: (Option<u32>, Vec<u32>)) -> Result<ModelConfig> {
    let d = dims(f, HeadDim::Required, true, "rms_norm_eps", None, None, ids)?;
    let r = rope(
        f,
        d.head_dim,
        Some(10000.0),
        f.opt_bool("rope_traditional")?.unwrap_or(false),
    )?;
    Ok(family_layout(Family::Gemma, d, Some(r)))
}

/// gemma2: gemma with sandwich norms, tanh-GELU, attention and final logit soft-capping, and
/// `query_pre_attn_scalar`. mlx-lm's gemma2 attends over the whole context in every layer
/// (it does not read `sliding_window`), and so does this.
fn gemma2(f: &Fields, ids: (Option<u32>, Vec<u32>)) -> Result<ModelConfig> {
    let d = dims(f, HeadDim::Required, true, "rms_norm_eps", None, None, ids)?;
    let r = rope(
        f,
        d.head_dim,
        Some(10000.0),
        f.opt_bool("rope_traditional")?.unwrap_or(false),
    )?;
    let mut c = family_layout(Family::Gemma2, d, Some(r));
    c.attn_scale = (1.0 / f.opt_f64("query_pre_attn_scalar")?.unwrap_or(144.0).sqrt()) as f32;
    c.attn_softcap = Some(f.opt_f64("attn_logit_softcapping")?.unwrap_or(50.0) as f32);
    c.final_softcap = Some(f.opt_f64("final_logit_softcapping")?.unwrap_or(30.0) as f32);
    Ok(c)
}

fn gemma3_hf(f: &Fields, ids: (Option<u32>, Vec<u32>)) -> Result<ModelConfig> {
    // mlx-lm's gemma3_text defaults every size.
    let get = |k: &str, d: usize| -> Result<usize> { Ok(f.opt_usize(k)?.unwrap_or(d)) };
    let n_heads = get("num_attention_heads", 4)?;
    let d = Dims {
        hidden: get("hidden_size", 1152)?,
        intermediate: get("intermediate_size", 6912)?,
        n_heads,
        n_kv_heads: get("num_key_value_heads", 1)?,
        head_dim: check_size("head dimension", get("head_dim", 256)?, LIMITS.head_dim)?,
        vocab: get("vocab_size", 262144)?,
        n_layers: check_size("layers", get("num_hidden_layers", 26)?, LIMITS.layers)?,
        norm_eps: f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
        max_context: get("max_position_embeddings", 32768)?,
        bos_id: ids.0,
        eos_ids: ids.1,
    };
    let head_dim = d.head_dim;
    let local = Rope::new(
        head_dim,
        f.opt_f64("rope_local_base_freq")?.unwrap_or(10_000.0),
        false,
        None,
        None,
    )?;
    let global = Rope::new(
        head_dim,
        f.opt_f64("rope_theta")?.unwrap_or(1_000_000.0),
        false,
        f.get("rope_scaling"),
        Some(d.max_context),
    )?;
    let window = get("sliding_window", 512)?;
    // mlx-lm follows sliding_window_pattern, not layer_types.
    let pattern = get("sliding_window_pattern", 6)?.max(1);
    let scalar = f.opt_f64("query_pre_attn_scalar")?.unwrap_or(256.0);
    Ok(gemma3(d, window, pattern, global, local, scalar))
}

/// gemma3: sandwich norms, per-head q/k norms, sliding layers with a local RoPE except every
/// `pattern`-th, embedding scale sqrt(hidden) rounded to bfloat16 as mlx-lm computes it.
pub fn gemma3(
    d: Dims,
    window: usize,
    pattern: usize,
    global: Rope,
    local: Rope,
    query_pre_attn_scalar: f64,
) -> ModelConfig {
    let mut c = family_layout(Family::Gemma3, d, None);
    for (i, l) in c.layers.iter_mut().enumerate() {
        let sliding = (i + 1) % pattern != 0;
        l.sliding_window = sliding.then_some(window);
        l.rope = Some(if sliding {
            local.clone()
        } else {
            global.clone()
        });
    }
    c.attn_scale = query_pre_attn_scalar.powf(-0.5) as f32;
    c
}

/// phi3: fused qkv and gate_up, partial rotary, its own su/longrope construction.
fn phi3(f: &Fields, ids: (Option<u32>, Vec<u32>)) -> Result<ModelConfig> {
    let d = dims(
        f,
        HeadDim::Derived,
        false,
        "rms_norm_eps",
        None,
        Some(131072),
        ids,
    )?;
    let partial = f.opt_f64("partial_rotary_factor")?.unwrap_or(1.0);
    if !(partial > 0.0 && partial <= 1.0) {
        bail!("config.json field partial_rotary_factor must be in (0, 1], got {partial}");
    }
    let r = Rope::phi3(
        (d.head_dim as f64 * partial) as usize,
        f.opt_f64("rope_theta")?.unwrap_or(10000.0),
        f.opt_bool("rope_traditional")?.unwrap_or(false),
        f.get("rope_scaling"),
        d.max_context,
        f.opt_usize("original_max_position_embeddings")?
            .unwrap_or(4096),
    )?;
    let mut c = family_layout(Family::Phi3, d, Some(r));
    c.tied_embeddings = f.opt_bool("tie_word_embeddings")?.unwrap_or(false);
    Ok(c)
}

/// olmo2: norms after attention and the MLP only, RMSNorm over the whole q and k projections.
fn olmo2(f: &Fields, ids: (Option<u32>, Vec<u32>)) -> Result<ModelConfig> {
    let mut c = llama(f, Family::Olmo2, ids)?;
    for l in &mut c.layers {
        l.sliding_window = None;
    }
    Ok(c)
}

/// granite: llama with embedding, residual, attention and logits multipliers.
fn granite(f: &Fields, ids: (Option<u32>, Vec<u32>)) -> Result<ModelConfig> {
    for k in ["max_position_embeddings", "num_key_value_heads"] {
        f.usize(k)?;
    }
    let d = dims(f, HeadDim::Derived, true, "rms_norm_eps", None, None, ids)?;
    let r = rope(f, d.head_dim, None, false)?;
    let mut c = family_layout(Family::Granite, d, Some(r));
    let attention_bias = f.bool("attention_bias")?;
    c.qkv_bias = attention_bias;
    c.o_bias = attention_bias;
    c.mlp_bias = f.bool("mlp_bias")?;
    c.attn_scale = f.f64("attention_multiplier")? as f32;
    c.embed_scale = Some(f.f64("embedding_multiplier")? as f32);
    c.residual_scale = Some(f.f64("residual_multiplier")? as f32);
    c.logits_divisor = Some(f.f64("logits_scaling")? as f32);
    c.tied_embeddings = f.opt_bool("tie_word_embeddings")?.unwrap_or(true);
    Ok(c)
}

/// starcoder2: LayerNorm with bias, a plain exact-GELU MLP (`c_fc`, `c_proj`), biases
/// everywhere.
fn starcoder2(f: &Fields, ids: (Option<u32>, Vec<u32>)) -> Result<ModelConfig> {
    let d = dims(
        f,
        HeadDim::Derived,
        true,
        "norm_epsilon",
        Some(1e-5),
        None,
        ids,
    )?;
    let r = rope(f, d.head_dim, Some(100_000.0), false)?;
    let mut c = family_layout(Family::Starcoder2, d, Some(r));
    c.tied_embeddings = f.opt_bool("tie_word_embeddings")?.unwrap_or(true);
    Ok(c)
}
