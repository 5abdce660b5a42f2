//! A GGUF source made into the Hugging Face folder an EXL3 folder is built from: the weights
//! dequantized exactly to f32 under their Hugging Face names (llama.cpp's q/k row permutation
//! of llama undone, so the rows are in the order half-split RoPE and exllamav3 expect; gemma's
//! norms stored as `w` again where the GGUF stores `1 + w`), a `config.json` from the GGUF's
//! metadata, and the GGUF's vocabulary as `tokenizer.json` (BPE as it is; SentencePiece as the
//! BPE pipeline transformers makes of it). Checked before use: the folder must read as the same
//! model, tokenize like the GGUF and give the same logits on a few samples.

use std::path::Path;

use anyhow::{anyhow, bail, ensure, Context, Result};
use serde_json::{json, Value};
use trellm_formats::gguf::Gguf;

use super::folder::{write_safetensors, Tensor};
use crate::model::config::ModelConfig;
use crate::model::load::LoadedModel;
use crate::model::weights::{gguf_name, hf_name, LinearWeight, Matrix, Role};

/// The GGUF architectures this converter writes a `config.json` for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Arch {
    Llama,
    Gemma3,
}

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

/// A norm's weight `gguf` (without `.weight`) as the HF tensor `hf`: the GGUF's own values
/// decoded, less the 1 llama.cpp's converter adds to gemma's norms (a loader of the folder adds
/// it back: `1 + (g - 1)`, the same f32 the GGUF loader rebuilds).
fn norm(g: &Gguf, gguf: &str, hf: &str, plus_one: bool) -> Result<Tensor> {
    let name = format!("{gguf}.weight");
    let t = g
        .tensor(&name)
        .with_context(|| format!("the GGUF has no {name}"))?;
    let n = usize::try_from(t.n_elements())?;
    let mut v = vec![0.0f32; n];
    trellm_quant::dequantize(t.ty, g.data(t), &mut v).map_err(|e| anyhow!("{name}: {e}"))?;
    if plus_one {
        v.iter_mut().for_each(|x| *x -= 1.0);
    }
    Ok(f32_tensor(&format!("{hf}.weight"), vec![n], &v))
}

/// The window pattern `config.json` can say (`sliding_window_pattern`: every `p`-th layer
/// global, the others sliding) that gives exactly the GGUF's layers.
fn window_pattern(cfg: &ModelConfig) -> Result<(usize, Option<usize>)> {
    let n = cfg.n_layers();
    let window = cfg.layers.iter().find_map(|l| l.sliding_window);
    if cfg
        .layers
        .iter()
        .any(|l| l.sliding_window.is_some_and(|w| Some(w) != window))
    {
        bail!("its layers slide over windows of different sizes, which config.json cannot say");
    }
    // p > n: every layer sliding.
    (1..=n + 1)
        .find(|&p| {
            cfg.layers
                .iter()
                .enumerate()
                .all(|(i, l)| l.sliding_window.is_some() == ((i + 1) % p != 0))
        })
        .map(|p| (p, window))
        .ok_or_else(|| {
            anyhow!("its sliding layers do not repeat with a period, which config.json cannot say")
        })
}

/// Writes the folder for `m` (loaded from the GGUF at `m.path`) into `dir`.
pub fn to_hf_folder(m: &LoadedModel, dir: &Path) -> Result<()> {
    let g = Gguf::open(&m.path)?;
    let arch_name = g.get_str("general.architecture").unwrap_or("");
    let cfg = &m.model.cfg;
    let arch = match arch_name {
        "llama" => Arch::Llama,
        "gemma3" => Arch::Gemma3,
        _ => bail!(
            "{}: trellm quantize takes GGUFs of the llama and gemma3 architectures (this one is '{}'); \
             quantize the model's Hugging Face folder instead",
            m.path.display(),
            trellm_formats::quote(arch_name)
        ),
    };
    let key = |k: &str| format!("{arch_name}.{k}");
    let scaling = g
        .get_str(&key("rope.scaling.type"))
        .filter(|&t| t != "none");
    // gemma3's linear scaling of its global RoPE is a config.json field; nothing else is yet.
    let carried = arch == Arch::Gemma3 && scaling == Some("linear");
    let scaled = (scaling.is_some() && !carried) || g.tensor("rope_freqs.weight").is_some();
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
    let tok_json = tok.to_hf_json().map_err(|e| {
        anyhow!(
            "{}: its vocabulary cannot be written as tokenizer.json: {e}",
            m.path.display()
        )
    })?;
    let rope_theta = g.get_f32(&key("rope.freq_base")).unwrap_or(10_000.0);
    let mut config = json!({
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
        "attention_bias": false,
        "torch_dtype": "float32",
    });
    let extra = match arch {
        Arch::Llama => json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "mlp_bias": false,
        }),
        Arch::Gemma3 => {
            let (pattern, window) =
                window_pattern(cfg).map_err(|e| anyhow!("{}: {e}", m.path.display()))?;
            let layer_types: Vec<&str> = cfg
                .layers
                .iter()
                .map(|l| {
                    if l.sliding_window.is_some() {
                        "sliding_attention"
                    } else {
                        "full_attention"
                    }
                })
                .collect();
            let rope_scaling = match scaling {
                Some(_) => {
                    let f = g
                        .get_f32(&key("rope.scaling.factor"))
                        .context("the GGUF has linear RoPE scaling without a factor")?;
                    json!({"rope_type": "linear", "factor": f})
                }
                None => Value::Null,
            };
            // What the GGUF loader scales q by (head_dim^-0.5, or hidden / heads in the 27B
            // model), as the scalar config.json takes.
            let scalar = (1.0 / (cfg.attn_scale as f64).powi(2)).round();
            json!({
                "architectures": ["Gemma3ForCausalLM"],
                "model_type": "gemma3_text",
                "hidden_activation": "gelu_pytorch_tanh",
                "query_pre_attn_scalar": scalar,
                "sliding_window": window.unwrap_or(cfg.max_context),
                "sliding_window_pattern": pattern,
                "layer_types": layer_types,
                "rope_local_base_freq": g.get_f32(&key("rope.freq_base_swa")).unwrap_or(10_000.0),
                "rope_scaling": rope_scaling,
                "final_logit_softcapping": cfg.final_softcap,
                "attn_logit_softcapping": cfg.attn_softcap,
                "attention_dropout": 0.0,
                "pad_token_id": g.get_u64("tokenizer.ggml.padding_token_id"),
                "use_cache": true,
            })
        }
    };
    for (k, v) in extra.as_object().expect("an object") {
        config[k] = v.clone();
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;

    let w = &m.model.weights;
    let plus_one = cfg.norm_plus_one;
    let mut tensors = vec![
        f32_tensor(
            "model.embed_tokens.weight",
            vec![cfg.vocab, cfg.hidden],
            &rows_of(&w.embed, None),
        ),
        norm(&g, "output_norm", "model.norm", plus_one)?,
    ];
    if !cfg.tied_embeddings {
        tensors.push(matrix("lm_head.weight", &w.lm_head, None)?);
    }
    for (l, lw) in w.layers.iter().enumerate() {
        let norms = [
            (Role::AttnNorm, lw.attn_norm.is_some()),
            (Role::QNorm, lw.q_norm.is_some()),
            (Role::KNorm, lw.k_norm.is_some()),
            (Role::PostAttnNorm, lw.post_attn_norm.is_some()),
            (Role::FfnNorm, lw.ffn_norm.is_some()),
            (Role::PostFfnNorm, lw.post_ffn_norm.is_some()),
        ];
        for (role, _) in norms.iter().filter(|n| n.1) {
            tensors.push(norm(
                &g,
                &gguf_name(*role, l),
                &hf_name(cfg, *role, l),
                plus_one,
            )?);
        }
        // llama.cpp permutes llama's q/k rows (for its adjacent-pair RoPE), not gemma's.
        let permuted = arch == Arch::Llama;
        let gate = lw.gate.as_ref().context("a layer without gate_proj")?;
        for (role, lin, heads) in [
            (Role::Q, &lw.q, permuted.then_some(cfg.n_heads)),
            (Role::K, &lw.k, permuted.then_some(cfg.n_kv_heads)),
            (Role::V, &lw.v, None),
            (Role::O, &lw.o, None),
            (Role::Gate, gate, None),
            (Role::Up, &lw.up, None),
            (Role::Down, &lw.down, None),
        ] {
            let name = format!("{}.weight", hf_name(cfg, role, l));
            tensors.push(matrix(&name, &lin.w, heads)?);
        }
    }
    write_safetensors(
        &dir.join("model.safetensors"),
        &tensors.iter().collect::<Vec<_>>(),
    )?;
    drop(tensors);

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
        "add_eos_token": false,
        "bos_token": name(tok.bos_id()),
        "eos_token": name(cfg.eos_ids.first().copied()),
        "model_max_length": cfg.max_context,
    });
    for (k, id) in [
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ] {
        if let Some(t) = name(g.get_u64(id).map(|i| i as u32)) {
            tc[k] = json!(t);
        }
    }
    if let Some(t) = g.get_str("tokenizer.chat_template") {
        tc["chat_template"] = json!(t);
    }
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tc)?,
    )?;

    check_same_model(m, dir)
}

/// Texts the converted tokenizer must split exactly as the GGUF's: words, digits, whitespace
/// runs, punctuation, accents, CJK, emoji, byte fallback, special tokens.
pub const SAMPLES: &[&str] = &[
    "The quick brown fox jumps over the lazy dog. 1234",
    " = Valkyria Chronicles III = \n\n Senjō no Valkyria 3 : Unrecorded Chronicles ( Japanese : 戦場のヴァルキュリア3 , lit . Valkyria of the Battlefield 3 ) \n",
    "3.14159 + 2,718 = 5.85959; 1e-6 * 10^9 = 1000 (approx.) 0x7fff 007",
    "  two spaces,   three,\tone tab,\t\ttwo tabs,\n\n\nthree newlines, \r\n CRLF    and trailing   ",
    "naïve café Straße Ærøskøbing Ελληνικά русский язык עברית العربية हिन्दी 日本語 한국어 中文",
    "emoji 😀👍🏽 🇫🇷 ∑∫√ ≤≥ — “quotes” ‘single’ … \u{13000}\u{10FFFD} ",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n<s></s><unk><bos><eos><pad>",
    "fn main() {\n    println!(\"{}\", x + 1);\n}\n<html><body><h1>Title</h1></body></html>",
];

/// The folder reads as the same model, tokenizes [`SAMPLES`] like the GGUF and gives the same
/// logits on the first (up to the summation order the weight formats differ by).
fn check_same_model(m: &LoadedModel, dir: &Path) -> Result<()> {
    use trellm_model::{Batch, ModelBackend, Want};
    let hf = crate::model::load::load(dir)?;
    let (a, b) = (&m.model.cfg, &hf.model.cfg);
    // A llama GGUF's permuted q/k rows rotate in adjacent pairs, the folder's in halves.
    let layers = |c: &ModelConfig| -> Vec<_> {
        c.layers
            .iter()
            .map(|l| {
                let rope = l.rope.clone().map(|mut r| {
                    r.traditional = false;
                    r
                });
                (l.sliding_window, rope)
            })
            .collect()
    };
    ensure!(
        layers(a) == layers(b)
            && a.attn_scale == b.attn_scale
            && a.attn_softcap == b.attn_softcap
            && a.final_softcap == b.final_softcap
            && a.embed_scale == b.embed_scale
            && a.tied_embeddings == b.tied_embeddings
            && (a.family, a.activation, a.qk_norm, a.norm_plus_one)
                == (b.family, b.activation, b.qk_norm, b.norm_plus_one),
        "the converted config.json does not describe the GGUF's model"
    );
    let (gt, ht) = (m.tokenizer()?, hf.tokenizer()?);
    for sample in SAMPLES {
        let (x, y) = (gt.encode(sample, true)?, ht.encode(sample, true)?);
        ensure!(
            x == y,
            "the converted tokenizer does not tokenize {sample:?} like the GGUF's ({x:?} vs {y:?})"
        );
    }
    let ids = gt.encode(SAMPLES[0], true)?;
    let logits = |model: &crate::backend::cpu::CpuModel| -> Result<Vec<f32>> {
        let n = ids.len().div_ceil(crate::backend::BLOCK_SIZE);
        let mut cache = model.new_cache(n, crate::backend::BLOCK_SIZE)?;
        let mut batch = Batch::default();
        batch.push(&ids, 0, (0..n as u32).collect(), Want::All);
        model
            .step(&batch, &mut cache)
            .map(trellm_model::Logits::into_vec)
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
