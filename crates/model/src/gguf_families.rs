//! GGUF metadata to the decoder's switches, for every family `families.rs` reads from
//! `config.json`. The keys are those llama.cpp's converter writes (`{arch}.block_count`,
//! `{arch}.rope.*`, ...); where a GGUF cannot say something a `config.json` can (gemma's
//! `query_pre_attn_scalar`, gemma3's window pattern, smollm3's NoPE interval), the file means what
//! llama.cpp's loader makes of it, since that is what it was written for.

use anyhow::{anyhow, bail, Result};
use serde_json::{json, Value};
use trellm_formats::gguf::{Array, Gguf};

use super::config::{check_size, Dims, Family, ModelConfig, LIMITS};
use super::families::{family_layout, gemma3};
use super::rope::Rope;

/// `general.architecture` values this build runs (llama.cpp's converter writes mistral as llama).
pub const GGUF_ARCHITECTURES: &[(&str, Family)] = &[
    ("llama", Family::Llama),
    ("qwen2", Family::Qwen2),
    ("qwen3", Family::Qwen3),
    ("gemma", Family::Gemma),
    ("gemma2", Family::Gemma2),
    ("gemma3", Family::Gemma3),
    ("phi3", Family::Phi3),
    ("olmo2", Family::Olmo2),
    ("granite", Family::Granite),
    ("smollm3", Family::SmolLM3),
    ("starcoder2", Family::Starcoder2),
];

/// Metadata of one architecture, with errors that name the key.
struct Meta<'a> {
    g: &'a Gguf,
    arch: &'a str,
}

impl Meta<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }
    fn opt_usize(&self, k: &str) -> Result<Option<usize>> {
        match self.g.get(&self.key(k)) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|v| Some(usize::try_from(v).unwrap_or(usize::MAX)))
                .ok_or_else(|| anyhow!("GGUF key {} is not a non-negative integer", self.key(k))),
        }
    }
    fn usize(&self, k: &str) -> Result<usize> {
        self.opt_usize(k)?
            .ok_or_else(|| anyhow!("GGUF metadata lacks {}", self.key(k)))
    }
    /// A size in `1..=max`, refused with the key's name otherwise.
    fn size(&self, k: &str, what: &str, v: usize, max: usize) -> Result<usize> {
        if v == 0 || v > max {
            bail!(
                "GGUF {} = {v}: the model's {what} must be between 1 and {max}",
                self.key(k)
            );
        }
        Ok(v)
    }
    fn opt_f32(&self, k: &str) -> Result<Option<f32>> {
        match self.g.get(&self.key(k)) {
            None => Ok(None),
            Some(v) => v
                .as_f32()
                .map(Some)
                .ok_or_else(|| anyhow!("GGUF key {} is not a number", self.key(k))),
        }
    }
    fn f32(&self, k: &str) -> Result<f32> {
        self.opt_f32(k)?
            .ok_or_else(|| anyhow!("GGUF metadata lacks {}", self.key(k)))
    }
    /// A small f32 tensor (RoPE factors) of exactly `len` values.
    fn factors(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>> {
        let Some(t) = self.g.tensor(name) else {
            return Ok(None);
        };
        if t.n_elements() != len as u64 {
            bail!(
                "tensor {name} has {} values, expected {len} (one per rotated pair)",
                t.n_elements()
            );
        }
        let mut v = vec![0.0; len];
        trellm_quant::dequantize(t.ty, self.g.data(t), &mut v)
            .map_err(|e| anyhow!("tensor {name}: {e}"))?;
        Ok(Some(v))
    }
}

/// From GGUF metadata (`general.architecture` and its keys).
pub fn from_gguf(g: &Gguf) -> Result<ModelConfig> {
    let arch = g
        .architecture()
        .ok_or_else(|| anyhow!("GGUF has no general.architecture"))?;
    let family = GGUF_ARCHITECTURES
        .iter()
        .find(|(a, _)| *a == arch)
        .map(|&(_, f)| f)
        .ok_or_else(|| {
            let names: Vec<&str> = GGUF_ARCHITECTURES.iter().map(|(a, _)| *a).collect();
            anyhow!(
                "unsupported architecture '{}' in GGUF (supported in GGUF: {}; mistral is written as llama)",
                trellm_formats::quote(arch),
                names.join(", ")
            )
        })?;
    let m = Meta { g, arch };
    let d = dims(&m, family)?;
    let (hidden, n_heads, head_dim, n_layers) = (d.hidden, d.n_heads, d.head_dim, d.n_layers);
    let rope_dims = m.opt_usize("rope.dimension_count")?.unwrap_or(head_dim);
    // llama.cpp's converter permutes q/k rows for the archs llama.cpp rotates in adjacent pairs
    // ("NORM" RoPE); interleaved RoPE on the permuted rows equals half-split RoPE on the originals.
    let permuted = matches!(family, Family::Llama | Family::Granite | Family::SmolLM3);
    let max_context = d.max_context;
    let mut c = match family {
        Family::Gemma3 => {
            let window = m.opt_usize("attention.sliding_window")?.filter(|&w| w > 0);
            let global = rope(&m, rope_dims, permuted, max_context)?;
            let local_base = m.opt_f32("rope.freq_base_swa")?.unwrap_or(10_000.0);
            let local = Rope::plain(rope_dims, local_base, false, 1.0);
            let mut c = gemma3(
                d,
                window.unwrap_or(1),
                6,
                global.clone(),
                local.clone(),
                1.0,
            );
            let sliding = sliding_layers(&m, n_layers, 6)?;
            for (l, s) in c.layers.iter_mut().zip(sliding) {
                let s = s && window.is_some();
                l.sliding_window = if s { window } else { None };
                l.rope = Some(if s { local.clone() } else { global.clone() });
            }
            c
        }
        Family::Phi3 => {
            let r = phi3_rope(&m, rope_dims, max_context)?;
            family_layout(family, d, Some(r))
        }
        _ => {
            let r = rope(&m, rope_dims, permuted, max_context)?;
            family_layout(family, d, Some(r))
        }
    };
    // GGUF ties the head by leaving output.weight out.
    c.tied_embeddings = g.tensor("output.weight").is_none();
    match family {
        Family::Llama | Family::Granite | Family::SmolLM3 => {
            // Optional biases exist where the converter found them.
            let has = |t: &str| g.tensor(&format!("blk.0.{t}.bias")).is_some();
            c.qkv_bias = has("attn_q");
            c.o_bias = has("attn_output");
            c.mlp_bias = has("ffn_up");
        }
        _ => {}
    }
    match family {
        Family::Gemma2 | Family::Gemma3 => {
            // llama.cpp scales q by head_dim^-0.5, except in the 27B models (hidden / heads).
            let big = matches!(
                (family, n_layers),
                (Family::Gemma2, 46) | (Family::Gemma3, 62)
            );
            let d = if big { hidden / n_heads } else { head_dim };
            c.attn_scale = (d as f64).powf(-0.5) as f32;
            let cap = |v: Option<f32>| v.filter(|&x| x != 0.0);
            if family == Family::Gemma2 {
                // llama.cpp's defaults when the keys are missing.
                c.attn_softcap = cap(Some(m.opt_f32("attn_logit_softcapping")?.unwrap_or(50.0)));
                c.final_softcap = cap(Some(m.opt_f32("final_logit_softcapping")?.unwrap_or(30.0)));
                let window = m.opt_usize("attention.sliding_window")?.unwrap_or(4096);
                for (l, s) in c.layers.iter_mut().zip(sliding_layers(&m, n_layers, 2)?) {
                    l.sliding_window = (s && window > 0).then_some(window);
                }
            } else {
                c.final_softcap = cap(m.opt_f32("final_logit_softcapping")?);
            }
        }
        Family::Olmo2 => {
            // Olmo3 GGUFs (same arch) carry a window and a per-layer pattern; olmo2 ones neither.
            if let Some(w) = m.opt_usize("attention.sliding_window")?.filter(|&w| w > 0) {
                for (l, s) in c.layers.iter_mut().zip(sliding_layers(&m, n_layers, 1)?) {
                    l.sliding_window = s.then_some(w);
                }
            }
        }
        Family::SmolLM3 => {
            // llama.cpp: every 4th layer without RoPE (the file does not say).
            for (i, l) in c.layers.iter_mut().enumerate() {
                if (i + 1) % 4 == 0 {
                    l.rope = None;
                }
            }
        }
        Family::Granite => {
            if let Some(s) = m.opt_f32("attention.scale")?.filter(|&s| s != 0.0) {
                c.attn_scale = s;
            }
            c.embed_scale = m.opt_f32("embedding_scale")?;
            c.residual_scale = m.opt_f32("residual_scale")?;
            c.logits_divisor = m.opt_f32("logit_scale")?;
        }
        _ => {}
    }
    Ok(c)
}

/// The sizes every family has, bounded before anything is sized by them.
fn dims(m: &Meta, family: Family) -> Result<Dims> {
    let g = m.g;
    let sized =
        |k: &str, what: &str, max: usize| -> Result<usize> { m.size(k, what, m.usize(k)?, max) };
    let hidden = sized("embedding_length", "hidden size", LIMITS.hidden)?;
    let n_heads = sized(
        "attention.head_count",
        "number of attention heads",
        LIMITS.heads,
    )?;
    let n_kv_heads = match m.opt_usize("attention.head_count_kv")? {
        Some(v) => m.size(
            "attention.head_count_kv",
            "number of key/value heads",
            v,
            LIMITS.heads,
        )?,
        None => n_heads,
    };
    if !n_heads.is_multiple_of(n_kv_heads) {
        bail!(
            "GGUF {} = {n_heads} is not a multiple of {} = {n_kv_heads} (attention heads must group over key/value heads)",
            m.key("attention.head_count"),
            m.key("attention.head_count_kv")
        );
    }
    let n_layers = m.usize("block_count")?;
    // Every layer has tensors: a count beyond the file's tensors is corrupt (and would make
    // the layer table as large as the number says).
    if n_layers == 0 || n_layers > g.tensors.len() {
        bail!(
            "GGUF {} = {n_layers}, but the file has {} tensors",
            m.key("block_count"),
            g.tensors.len()
        );
    }
    let head_dim = match m.opt_usize("attention.key_length")? {
        Some(v) => m.size("attention.key_length", "head dimension", v, LIMITS.head_dim)?,
        None => check_size("head dimension", hidden / n_heads, LIMITS.head_dim)?,
    };
    let vocab = match m.opt_usize("vocab_size")? {
        Some(v) => m.size("vocab_size", "vocabulary size", v, LIMITS.vocab)?,
        None => g
            .tensor("token_embd.weight")
            .map(|t| t.rows_cols().0)
            .ok_or_else(|| anyhow!("GGUF has no token_embd.weight"))?,
    };
    // starcoder2 uses LayerNorm; llama.cpp reads its epsilon under its own key.
    let eps_key = if family == Family::Starcoder2 {
        "attention.layer_norm_epsilon"
    } else {
        "attention.layer_norm_rms_epsilon"
    };
    let id = |k: &str| g.get_u64(k).and_then(|v| u32::try_from(v).ok());
    Ok(Dims {
        hidden,
        intermediate: sized(
            "feed_forward_length",
            "intermediate size",
            LIMITS.intermediate,
        )?,
        n_heads,
        n_kv_heads,
        head_dim,
        vocab,
        n_layers,
        norm_eps: m.f32(eps_key)?,
        max_context: m.size(
            "context_length",
            "context length",
            m.usize("context_length")?,
            usize::MAX,
        )?,
        bos_id: id("tokenizer.ggml.bos_token_id"),
        eos_ids: id("tokenizer.ggml.eos_token_id").into_iter().collect(),
    })
}

/// Which layers use the sliding window: `attention.sliding_window_pattern` as one flag per layer
/// or as a period `n` (every `n`-th layer global, llama.cpp's `set_swa_pattern`), else
/// `default_period`.
fn sliding_layers(m: &Meta, n_layers: usize, default_period: usize) -> Result<Vec<bool>> {
    let k = m.key("attention.sliding_window_pattern");
    let period = match m.g.get(&k) {
        None => default_period,
        Some(v) => match v.as_array() {
            Some(Array::Bool(flags)) => {
                if flags.len() != n_layers {
                    bail!("GGUF {k} has {} entries for {n_layers} layers", flags.len());
                }
                return Ok(flags.clone());
            }
            Some(_) => bail!("GGUF {k} is neither a number nor a list of booleans"),
            None => v
                .as_u64()
                .and_then(|p| usize::try_from(p).ok())
                .ok_or_else(|| anyhow!("GGUF {k} is not a non-negative integer"))?,
        },
    };
    Ok((0..n_layers)
        .map(|i| period == 0 || i % period < period - 1)
        .collect())
}

/// RoPE from `rope.freq_base`, `rope.scaling.*` and a `rope_freqs.weight` tensor (llama3's
/// per-pair factors), built by the same constructors as a `config.json`'s `rope_scaling`.
fn rope(m: &Meta, dims: usize, traditional: bool, max_context: usize) -> Result<Rope> {
    let base = m.opt_f32("rope.freq_base")?.unwrap_or(10_000.0);
    if dims == 0 || !dims.is_multiple_of(2) {
        bail!(
            "RoPE rotates {dims} dimensions (GGUF {}; must be even and positive)",
            m.key("rope.dimension_count")
        );
    }
    if let Some(f) = m.factors("rope_freqs.weight", dims / 2)? {
        return Ok(Rope::with_factors(dims, base, traditional, &f));
    }
    let ty = m.g.get_str(&m.key("rope.scaling.type"));
    let scaling: Option<Value> = match ty {
        None | Some("none") => None,
        Some("linear") => Some(json!({"type": "linear", "factor": m.f32("rope.scaling.factor")?})),
        Some("yarn") => {
            // llama.cpp's YaRN: mscale 0.1 ln(factor) + 1, which is mlx's with its defaults.
            let mut s = json!({
                "type": "yarn",
                "factor": m.f32("rope.scaling.factor")?,
                "original_max_position_embeddings": m.usize("rope.scaling.original_context_length")?,
            });
            for (k, name) in [
                ("rope.scaling.yarn_beta_fast", "beta_fast"),
                ("rope.scaling.yarn_beta_slow", "beta_slow"),
            ] {
                if let Some(v) = m.opt_f32(k)? {
                    s[name] = json!(v);
                }
            }
            Some(s)
        }
        Some(other) => bail!(
            "unsupported rope scaling '{}' in GGUF {}",
            trellm_formats::quote(other),
            m.key("rope.scaling.type")
        ),
    };
    Rope::new(
        dims,
        base as f64,
        traditional,
        scaling.as_ref(),
        Some(max_context),
    )
}

/// phi3's RoPE: longrope from the `rope_factors_long`/`_short` tensors and
/// `rope.scaling.original_context_length`, through the same construction as its `config.json`.
fn phi3_rope(m: &Meta, dims: usize, max_context: usize) -> Result<Rope> {
    let base = m.opt_f32("rope.freq_base")?.unwrap_or(10_000.0) as f64;
    if dims == 0 || !dims.is_multiple_of(2) {
        bail!(
            "RoPE rotates {dims} dimensions (GGUF {}; must be even and positive)",
            m.key("rope.dimension_count")
        );
    }
    let long = m.factors("rope_factors_long.weight", dims / 2)?;
    let short = m.factors("rope_factors_short.weight", dims / 2)?;
    let Some(long) = long else {
        return Rope::phi3(dims, base, false, None, max_context, max_context);
    };
    let orig = m.usize("rope.scaling.original_context_length")?;
    let scaling = json!({
        "type": "longrope",
        "long_factor": long,
        "short_factor": short.unwrap_or_default(),
    });
    Rope::phi3(dims, base, false, Some(&scaling), max_context, orig)
}
