//! Shared test helpers: the real models, the CLI binary, and writers for small model files.
#![allow(dead_code)]

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
