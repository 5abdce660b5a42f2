//! Shared test helpers: the real models, the CLI binary, and writers for small model files.
#![allow(dead_code)]

pub mod mutate;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A real model from the cache, pulled on first use.
pub fn model_path(alias: &str) -> PathBuf {
    trellm_hub::resolve_model(alias, false).unwrap_or_else(|e| panic!("cannot get {alias}: {e:#}"))
}

pub fn trellm() -> Command {
    Command::new(env!("CARGO_BIN_EXE_trellm"))
}

/// Runs trellm with `args`; returns (exit code, stdout, stderr).
pub fn run(args: &[&str]) -> (i32, String, String) {
    let out: Output = trellm().args(args).output().expect("trellm runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts a clean failure: non-zero exit, one line on stderr mentioning `needle`, no panic.
pub fn assert_clean_error(args: &[&str], needle: &str) {
    let (code, _out, err) = run(args);
    assert_ne!(code, 0, "expected failure for {args:?}");
    assert!(!err.contains("panicked"), "panic for {args:?}: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(
        lines.len(),
        1,
        "expected one error line for {args:?}, got: {err}"
    );
    assert!(
        err.to_lowercase().contains(&needle.to_lowercase()),
        "error for {args:?} should mention '{needle}': {err}"
    );
}

/// A minimal GGUF v3 writer for crafted test files.
pub struct GgufWriter {
    kv: Vec<u8>,
    n_kv: u64,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

impl GgufWriter {
    pub fn new() -> Self {
        GgufWriter {
            kv: Vec::new(),
            n_kv: 0,
            tensors: Vec::new(),
        }
    }
    fn key(&mut self, k: &str, ty: u32) {
        self.kv.extend((k.len() as u64).to_le_bytes());
        self.kv.extend(k.as_bytes());
        self.kv.extend(ty.to_le_bytes());
        self.n_kv += 1;
    }
    pub fn str(mut self, k: &str, v: &str) -> Self {
        self.key(k, 8);
        self.kv.extend((v.len() as u64).to_le_bytes());
        self.kv.extend(v.as_bytes());
        self
    }
    pub fn u32(mut self, k: &str, v: u32) -> Self {
        self.key(k, 4);
        self.kv.extend(v.to_le_bytes());
        self
    }
    pub fn f32(mut self, k: &str, v: f32) -> Self {
        self.key(k, 6);
        self.kv.extend(v.to_le_bytes());
        self
    }
    pub fn str_array(mut self, k: &str, v: &[&str]) -> Self {
        self.key(k, 9);
        self.kv.extend(8u32.to_le_bytes());
        self.kv.extend((v.len() as u64).to_le_bytes());
        for s in v {
            self.kv.extend((s.len() as u64).to_le_bytes());
            self.kv.extend(s.as_bytes());
        }
        self
    }
    pub fn i32_array(mut self, k: &str, v: &[i32]) -> Self {
        self.key(k, 9);
        self.kv.extend(5u32.to_le_bytes());
        self.kv.extend((v.len() as u64).to_le_bytes());
        for x in v {
            self.kv.extend(x.to_le_bytes());
        }
        self
    }
    pub fn f32_array(mut self, k: &str, v: &[f32]) -> Self {
        self.key(k, 9);
        self.kv.extend(6u32.to_le_bytes());
        self.kv.extend((v.len() as u64).to_le_bytes());
        for x in v {
            self.kv.extend(x.to_le_bytes());
        }
        self
    }
    pub fn bool(mut self, k: &str, v: bool) -> Self {
        self.key(k, 7);
        self.kv.push(v as u8);
        self
    }
    /// A `[rows][cols]` matrix (`cols` a multiple of 32) as Q8_0 blocks.
    pub fn q8_0_tensor(self, name: &str, shape: &[u64], values: &[f32]) -> Self {
        let mut data = Vec::new();
        for block in values.chunks(32) {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            data.extend(half::f16::from_f32(d).to_le_bytes());
            for v in block {
                let q = if d == 0.0 { 0.0 } else { (v / d).round() };
                data.push(q as i8 as u8);
            }
        }
        self.tensor(name, shape, 8, data)
    }
    pub fn f16_tensor(self, name: &str, shape: &[u64], values: &[f32]) -> Self {
        let data = values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect();
        self.tensor(name, shape, 1, data)
    }
    /// `shape` in ggml order (innermost first); `ty` a ggml type id; raw data bytes.
    pub fn tensor(mut self, name: &str, shape: &[u64], ty: u32, data: Vec<u8>) -> Self {
        self.tensors
            .push((name.to_string(), shape.to_vec(), ty, data));
        self
    }
    pub fn f32_tensor(self, name: &str, shape: &[u64], values: &[f32]) -> Self {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, shape, 0, data)
    }
    pub fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(b"GGUF");
        b.extend(3u32.to_le_bytes());
        b.extend((self.tensors.len() as u64).to_le_bytes());
        b.extend(self.n_kv.to_le_bytes());
        b.extend(&self.kv);
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, shape, ty, data) in &self.tensors {
            b.extend((name.len() as u64).to_le_bytes());
            b.extend(name.as_bytes());
            b.extend((shape.len() as u32).to_le_bytes());
            for d in shape {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.to_le_bytes());
            b.extend(offset.to_le_bytes());
            offsets.push(offset);
            offset += (data.len() as u64).div_ceil(32) * 32;
        }
        while b.len() % 32 != 0 {
            b.push(0);
        }
        for (_, _, _, data) in &self.tensors {
            b.extend(data);
            while b.len() % 32 != 0 {
                b.push(0);
            }
        }
        b
    }
    pub fn write(&self, path: &Path) {
        std::fs::write(path, self.bytes()).unwrap();
    }
}

/// Deterministic pseudo-random values in [-scale, scale).
pub fn rand_vec(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// A tiny Hugging Face llama folder (random f32 weights, no tokenizer) in `dir`.
pub fn write_tiny_llama(dir: &Path, model_type: &str, max_pos: usize) {
    let (h, inter, layers, heads, kv, vocab) = (64usize, 128usize, 2usize, 4usize, 2usize, 96usize);
    let hd = h / heads;
    let config = serde_json::json!({
        "model_type": model_type, "hidden_size": h, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": max_pos, "tie_word_embeddings": true, "eos_token_id": 2, "bos_token_id": 1
    });
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let mut seed = 1;
    let mut add = |name: String, shape: Vec<usize>, ones: bool| {
        let n = shape.iter().product();
        seed += 1;
        let v = if ones {
            vec![1.0; n]
        } else {
            rand_vec(n, seed, 0.2)
        };
        tensors.push((name, shape, v));
    };
    add("model.embed_tokens.weight".into(), vec![vocab, h], false);
    add("model.norm.weight".into(), vec![h], true);
    for l in 0..layers {
        let p = format!("model.layers.{l}.");
        add(format!("{p}input_layernorm.weight"), vec![h], true);
        add(format!("{p}post_attention_layernorm.weight"), vec![h], true);
        add(
            format!("{p}self_attn.q_proj.weight"),
            vec![heads * hd, h],
            false,
        );
        add(
            format!("{p}self_attn.k_proj.weight"),
            vec![kv * hd, h],
            false,
        );
        add(
            format!("{p}self_attn.v_proj.weight"),
            vec![kv * hd, h],
            false,
        );
        add(
            format!("{p}self_attn.o_proj.weight"),
            vec![h, heads * hd],
            false,
        );
        add(format!("{p}mlp.gate_proj.weight"), vec![inter, h], false);
        add(format!("{p}mlp.up_proj.weight"), vec![inter, h], false);
        add(format!("{p}mlp.down_proj.weight"), vec![h, inter], false);
    }
    write_safetensors(&dir.join("model.safetensors"), &tensors);
}

/// The sizes of a Hugging Face llama for [`write_llama`].
pub struct LlamaDims {
    pub hidden: usize,
    pub inter: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv: usize,
    pub head_dim: usize,
    pub vocab: usize,
}

/// A Hugging Face llama folder in `dir` (`config.json` with `extra` merged in, and
/// `model.safetensors`): tensor i seeded with `seed + i + 1`, scaled by `scale(name)`, or all ones
/// where that is 0 (the norms); an `lm_head` only when not `tied`.
pub fn write_llama(
    dir: &Path,
    d: &LlamaDims,
    tied: bool,
    extra: serde_json::Value,
    seed: u64,
    scale: impl Fn(&str) -> f32,
) {
    let (h, hd) = (d.hidden, d.head_dim);
    let mut config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": d.inter, "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads, "num_key_value_heads": d.kv, "head_dim": hd,
        "vocab_size": d.vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 2048, "tie_word_embeddings": tied,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"
    });
    if let (Some(c), Some(e)) = (config.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![d.vocab, h]),
        ("model.norm.weight".into(), vec![h]),
    ];
    if !tied {
        shapes.push(("lm_head.weight".into(), vec![d.vocab, h]));
    }
    for l in 0..d.layers {
        let p = format!("model.layers.{l}.");
        shapes.extend([
            (format!("{p}input_layernorm.weight"), vec![h]),
            (format!("{p}post_attention_layernorm.weight"), vec![h]),
            (format!("{p}self_attn.q_proj.weight"), vec![d.heads * hd, h]),
            (format!("{p}self_attn.k_proj.weight"), vec![d.kv * hd, h]),
            (format!("{p}self_attn.v_proj.weight"), vec![d.kv * hd, h]),
            (format!("{p}self_attn.o_proj.weight"), vec![h, d.heads * hd]),
            (format!("{p}mlp.gate_proj.weight"), vec![d.inter, h]),
            (format!("{p}mlp.up_proj.weight"), vec![d.inter, h]),
            (format!("{p}mlp.down_proj.weight"), vec![h, d.inter]),
        ]);
    }
    let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = shapes
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let n = shape.iter().product();
            let v = match scale(&name) {
                0.0 => vec![1.0; n],
                s => rand_vec(n, seed + i as u64 + 1, s),
            };
            (name, shape, v)
        })
        .collect();
    write_safetensors(&dir.join("model.safetensors"), &tensors);
}

/// A 2-layer llama that splits over two ranks on EXL3's 128-wide blocks: hidden 256, four query
/// heads of 128 over two kv heads, 512 MLP features, vocabulary 512.
pub const HD128_TWO_KV: LlamaDims = LlamaDims {
    hidden: 256,
    inter: 512,
    layers: 2,
    heads: 4,
    kv: 2,
    head_dim: 128,
    vocab: 512,
};

/// An EXL3 folder `out` that our quantizer writes from the HF folder `src` (head at 6 bits,
/// calibrated on 4 seeded rows of 64 tokens).
pub fn quantize_exl3(src: &Path, out: &Path, codebook: trellm_quant::exl3::Codebook, bits: f64) {
    use trellm::quantize::{quantize, Calibration, Options};
    let m = trellm::model::load::load(src).unwrap();
    let vocab = m.model.cfg.vocab as u32;
    let rows: Vec<Vec<u32>> = (0..4u32)
        .map(|r| (0..64u32).map(|i| (i * 37 + r * 11 + 1) % vocab).collect())
        .collect();
    let cal = Calibration {
        rows,
        asked: (4, 64),
        text: "token rows of this test".into(),
    };
    let opts = Options {
        bits,
        head_bits: Some(6),
        codebook,
        shard_bytes: 1 << 30,
        stop_after: None,
        quiet: true,
        device: trellm::backend::Device::Cpu,
        seed: 0,
    };
    quantize(&m, out, &cal, &opts).unwrap();
}

/// A seeded llama of `d` in `dir` at the weight scales the EXL3 tests quantize (norms and
/// embedding 1, the rest 0.1; RoPE theta 500000).
pub fn write_llama_for_exl3(dir: &Path, d: &LlamaDims, seed: u64) {
    let extra = serde_json::json!({ "rope_theta": 500000.0 });
    write_llama(dir, d, false, extra, seed, |name| {
        if name.ends_with("norm.weight") {
            0.0
        } else if name == "model.embed_tokens.weight" {
            1.0
        } else {
            0.1
        }
    });
}

pub fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, v)| {
            (
                n.clone(),
                s.clone(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = bytes
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// A complete tiny llama GGUF (2 layers, hidden 32, GQA 4/2, Q8_0/F16/F32 tensors) with a
/// byte-level BPE vocabulary (the 256 byte tokens, a few merges, ChatML specials) and a chat
/// template: every part of a real file, in a few tens of kilobytes.
pub fn tiny_llama_gguf() -> Vec<u8> {
    let (h, heads, kv, ff, layers) = (32u64, 4u64, 2u64, 64u64, 2usize);
    let hd = h / heads;
    let mut tokens: Vec<String> = mutate::byte_level_alphabet()
        .into_iter()
        .map(|c| c.to_string())
        .collect();
    let merges = ["\u{120} t", "h e", "\u{120}t he", "i n"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    tokens.push("<|im_start|>".into());
    tokens.push("<|im_end|>".into());
    let vocab = tokens.len() as u64;
    let mut types = vec![1i32; tokens.len()];
    let n = types.len();
    types[n - 2] = 3;
    types[n - 1] = 3;
    let tok_refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    let template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let mut w = GgufWriter::new()
        .str("general.architecture", "llama")
        .str("general.name", "tiny")
        .u32("general.alignment", 32)
        .u32("llama.embedding_length", h as u32)
        .u32("llama.attention.head_count", heads as u32)
        .u32("llama.attention.head_count_kv", kv as u32)
        .u32("llama.block_count", layers as u32)
        .u32("llama.feed_forward_length", ff as u32)
        .u32("llama.context_length", 256)
        .u32("llama.rope.dimension_count", hd as u32)
        .f32("llama.rope.freq_base", 10000.0)
        .f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .str("tokenizer.ggml.model", "gpt2")
        .str("tokenizer.ggml.pre", "gpt2")
        .str_array("tokenizer.ggml.tokens", &tok_refs)
        .i32_array("tokenizer.ggml.token_type", &types)
        .str_array("tokenizer.ggml.merges", &merges)
        .u32("tokenizer.ggml.bos_token_id", (vocab - 2) as u32)
        .u32("tokenizer.ggml.eos_token_id", (vocab - 1) as u32)
        .bool("tokenizer.ggml.add_bos_token", false)
        .str("tokenizer.chat_template", template);
    let mut seed = 10;
    let mut r = |n: u64| {
        seed += 1;
        rand_vec(n as usize, seed, 0.3)
    };
    w = w.q8_0_tensor("token_embd.weight", &[h, vocab], &r(h * vocab));
    w = w.f32_tensor("output_norm.weight", &[h], &vec![1.0; h as usize]);
    for l in 0..layers {
        let p = format!("blk.{l}.");
        w = w.f32_tensor(
            &format!("{p}attn_norm.weight"),
            &[h],
            &vec![1.0; h as usize],
        );
        w = w.f32_tensor(&format!("{p}ffn_norm.weight"), &[h], &vec![1.0; h as usize]);
        w = w.f16_tensor(&format!("{p}attn_q.weight"), &[h, heads * hd], &r(h * h));
        w = w.f16_tensor(&format!("{p}attn_k.weight"), &[h, kv * hd], &r(h * kv * hd));
        w = w.f16_tensor(&format!("{p}attn_v.weight"), &[h, kv * hd], &r(h * kv * hd));
        w = w.f16_tensor(
            &format!("{p}attn_output.weight"),
            &[heads * hd, h],
            &r(h * h),
        );
        w = w.q8_0_tensor(&format!("{p}ffn_gate.weight"), &[h, ff], &r(h * ff));
        w = w.q8_0_tensor(&format!("{p}ffn_up.weight"), &[h, ff], &r(h * ff));
        w = w.q8_0_tensor(&format!("{p}ffn_down.weight"), &[ff, h], &r(h * ff));
    }
    w.bytes()
}
