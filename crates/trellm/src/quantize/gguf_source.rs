//! A GGUF source made into the Hugging Face folder an EXL3 folder is built from: the weights
//! dequantized exactly to f32 (llama.cpp's q/k row permutation undone, so the rows are in the
//! order half-split RoPE and exllamav3 expect), a `config.json` from the GGUF's metadata, and
//! the GGUF's BPE vocabulary as `tokenizer.json`. Checked before use: the folder must tokenize
//! like the GGUF and give the same logits on a few tokens.

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use serde_json::json;
use trellm_formats::gguf::Gguf;

use super::folder::{write_safetensors, Tensor};
use crate::model::load::LoadedModel;
use crate::model::weights::{LinearWeight, Matrix};

fn f32_tensor(name: &str, shape: Vec<usize>, values: &[f32]) -> Tensor {
    Tensor {
        name: name.to_string(),
        dtype: "F32".into(),
        shape,
        bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// All rows of `m`, decoded exactly; with `unpermute_heads`, llama.cpp's q/k permutation
/// undone (GGUF row `h hd + 2 i + j` is HF row `h hd + j hd/2 + i`).
fn matrix(name: &str, w: &LinearWeight, unpermute_heads: Option<usize>) -> Result<Tensor> {
    let LinearWeight::Ggml(m) = w else {
        bail!("{name}: not a ggml matrix");
    };
    Ok(f32_tensor(
        name,
        vec![m.rows, m.cols],
        &rows_of(m, unpermute_heads),
    ))
}

fn rows_of(m: &Matrix, unpermute_heads: Option<usize>) -> Vec<f32> {
    let (rows, cols) = (m.rows, m.cols);
    let mut out = vec![0.0f32; rows * cols];
    let hd = unpermute_heads.map_or(rows, |h| rows / h);
    for r in 0..rows {
        let dst = match unpermute_heads {
            None => r,
            Some(_) => {
                let (h, w) = (r / hd, r % hd);
                h * hd + (w % 2) * (hd / 2) + w / 2
            }
        };
        m.dequantize_row(r, &mut out[dst * cols..(dst + 1) * cols]);
    }
    out
}

/// Writes the folder for `m` (loaded from the GGUF at `m.path`) into `dir`.
pub fn to_hf_folder(m: &LoadedModel, dir: &Path) -> Result<()> {
    let g = Gguf::open(&m.path)?;
    let arch = g.get_str("general.architecture").unwrap_or("");
    let cfg = &m.model.cfg;
    if arch != "llama" {
        bail!(
            "{}: trellm quantize takes GGUFs of the llama architecture (this one is '{}'); \
             quantize the model's Hugging Face folder instead",
            m.path.display(),
            trellm_formats::quote(arch)
        );
    }
    let key = |k: &str| format!("llama.{k}");
    let scaled = g
        .get_str(&key("rope.scaling.type"))
        .is_some_and(|t| t != "none")
        || g.tensor("rope_freqs.weight").is_some();
    let rope_dims = g
        .get_u64(&key("rope.dimension_count"))
        .map_or(cfg.head_dim, |d| d as usize);
    if scaled || rope_dims != cfg.head_dim || cfg.qkv_bias || cfg.o_bias || cfg.mlp_bias {
        bail!(
            "{}: this GGUF has RoPE scaling, partial rotary dims or biases, which trellm \
             quantize cannot carry into a Hugging Face config yet",
            m.path.display()
        );
    }
    let tok = m.tokenizer()?;
    let Some(tok_json) = tok.to_hf_json() else {
        bail!(
            "{}: its SentencePiece vocabulary cannot be written as tokenizer.json yet",
            m.path.display()
        );
    };
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;

    let w = &m.model.weights;
    let mut tensors = vec![
        f32_tensor(
            "model.embed_tokens.weight",
            vec![cfg.vocab, cfg.hidden],
            &rows_of(&w.embed, None),
        ),
        f32_tensor("model.norm.weight", vec![cfg.hidden], &w.final_norm.w),
    ];
    if !cfg.tied_embeddings {
        tensors.push(matrix("lm_head.weight", &w.lm_head, None)?);
    }
    for (l, lw) in w.layers.iter().enumerate() {
        let p = format!("model.layers.{l}.");
        let norm = |n: &Option<crate::model::weights::NormWeights>| -> Result<Vec<f32>> {
            Ok(n.as_ref()
                .context("a llama layer without its norms")?
                .w
                .clone())
        };
        let gate = lw
            .gate
            .as_ref()
            .context("a llama layer without gate_proj")?;
        tensors.extend([
            f32_tensor(
                &format!("{p}input_layernorm.weight"),
                vec![cfg.hidden],
                &norm(&lw.attn_norm)?,
            ),
            f32_tensor(
                &format!("{p}post_attention_layernorm.weight"),
                vec![cfg.hidden],
                &norm(&lw.ffn_norm)?,
            ),
            matrix(
                &format!("{p}self_attn.q_proj.weight"),
                &lw.q.w,
                Some(cfg.n_heads),
            )?,
            matrix(
                &format!("{p}self_attn.k_proj.weight"),
                &lw.k.w,
                Some(cfg.n_kv_heads),
            )?,
            matrix(&format!("{p}self_attn.v_proj.weight"), &lw.v.w, None)?,
            matrix(&format!("{p}self_attn.o_proj.weight"), &lw.o.w, None)?,
            matrix(&format!("{p}mlp.gate_proj.weight"), &gate.w, None)?,
            matrix(&format!("{p}mlp.up_proj.weight"), &lw.up.w, None)?,
            matrix(&format!("{p}mlp.down_proj.weight"), &lw.down.w, None)?,
        ]);
    }
    write_safetensors(
        &dir.join("model.safetensors"),
        &tensors.iter().collect::<Vec<_>>(),
    )?;
    drop(tensors);

    let rope_theta = g.get_f32(&key("rope.freq_base")).unwrap_or(10_000.0);
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.n_layers(),
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": rope_theta,
        "max_position_embeddings": cfg.max_context,
        "vocab_size": cfg.vocab,
        "tie_word_embeddings": cfg.tied_embeddings,
        "bos_token_id": cfg.bos_id,
        "eos_token_id": cfg.eos_ids.first(),
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "torch_dtype": "float32",
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    std::fs::write(
        dir.join("generation_config.json"),
        serde_json::to_string_pretty(
            &json!({"bos_token_id": cfg.bos_id, "eos_token_id": m.eos_ids()}),
        )?,
    )?;
    std::fs::write(dir.join("tokenizer.json"), tok_json)?;
    let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap_or_default();
    let name = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize).copied());
    let mut tc = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tok.add_bos(),
        "bos_token": name(tok.bos_id()),
        "eos_token": name(cfg.eos_ids.first().copied()),
        "model_max_length": cfg.max_context,
    });
    if let Some(t) = g.get_str("tokenizer.chat_template") {
        tc["chat_template"] = json!(t);
    }
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tc)?,
    )?;

    check_same_model(m, dir)
}

/// The folder tokenizes a sample like the GGUF and gives the same logits on it (up to the
/// summation order the RoPE layouts differ by).
fn check_same_model(m: &LoadedModel, dir: &Path) -> Result<()> {
    use trellm_model::{Batch, ModelBackend, Want};
    let hf = crate::model::load::load(dir)?;
    let sample = "The quick brown fox jumps over the lazy dog. 1234";
    let (a, b) = (
        m.tokenizer()?.encode(sample, true)?,
        hf.tokenizer()?.encode(sample, true)?,
    );
    ensure!(
        a == b,
        "the converted tokenizer does not tokenize like the GGUF's ({a:?} vs {b:?})"
    );
    let logits = |model: &crate::backend::cpu::CpuModel| -> Result<Vec<f32>> {
        let n = a.len().div_ceil(crate::backend::BLOCK_SIZE);
        let mut cache = model.new_cache(n, crate::backend::BLOCK_SIZE)?;
        let mut batch = Batch::default();
        batch.push(&a, 0, (0..n as u32).collect(), Want::All);
        model.step(&batch, &mut cache)
    };
    let (x, y) = (logits(&m.model)?, logits(&hf.model)?);
    let worst = x
        .iter()
        .zip(&y)
        .map(|(p, q)| (p - q).abs())
        .fold(0.0f32, f32::max);
    ensure!(
        worst < 1e-2,
        "the converted model's logits differ from the GGUF's by {worst} (a layout the converter does not know)"
    );
    Ok(())
}
