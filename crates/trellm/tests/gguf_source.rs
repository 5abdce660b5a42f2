//! `trellm quantize`'s GGUF source on gemma-3-270m (gemma3, SentencePiece vocabulary of 262144
//! pieces, Q4_K_M): the GGUF becomes a Gemma3ForCausalLM folder (f32 weights under their
//! Hugging Face names, norms as `w` again, `config.json`, `tokenizer.json`) that trellm reads as
//! the same model, tokenizes exactly as the GGUF and runs with the same logits, past the sliding
//! window too; and SmolLM2 (llama, BPE) as before.

mod common;

use std::time::Instant;

use serde_json::Value;
use trellm::quantize::gguf_source::{to_hf_folder, SAMPLES};
use trellm_model::{Batch, ModelBackend, Want};

/// The last position's logits of `ids` (one sequence from position 0).
fn last_logits(m: &trellm::LoadedModel, ids: &[u32]) -> Vec<f32> {
    let bs = trellm::backend::BLOCK_SIZE;
    let n = ids.len().div_ceil(bs);
    let mut cache = m.model.new_cache(n, bs).unwrap();
    let mut batch = Batch::default();
    batch.push(ids, 0, (0..n as u32).collect(), Want::Last);
    m.model.step(&batch, &mut cache).unwrap().into_vec()
}

#[test]
fn gemma3_gguf_becomes_a_folder_that_tokenizes_and_computes_like_it() {
    let src = common::model_path("gemma-3-270m");
    let g = trellm::load(&src).unwrap();
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("gemma");
    let t = Instant::now();
    // Checks itself: the same config, SAMPLES tokenized alike, logits of the first alike.
    to_hf_folder(&g, &dir).unwrap();
    eprintln!("converted and checked in {:.1}s", t.elapsed().as_secs_f64());

    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    for (k, v) in [
        ("model_type", Value::from("gemma3_text")),
        ("head_dim", 256.into()),
        ("query_pre_attn_scalar", 256.0.into()),
        ("sliding_window", 512.into()),
        ("sliding_window_pattern", 6.into()),
        ("rope_theta", 1_000_000.0.into()),
        ("rope_local_base_freq", 10_000.0.into()),
        ("hidden_activation", "gelu_pytorch_tanh".into()),
        ("tie_word_embeddings", true.into()),
        ("vocab_size", 262_144.into()),
        ("num_hidden_layers", 18.into()),
    ] {
        assert_eq!(cfg[k], v, "config.json {k}");
    }
    let types = cfg["layer_types"].as_array().unwrap();
    assert_eq!(types[5], "full_attention");
    assert_eq!(types[4], "sliding_attention");
    let st = trellm_formats::safetensors::SafeTensors::open(&dir).unwrap();
    for name in [
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.pre_feedforward_layernorm.weight",
        "model.layers.17.post_feedforward_layernorm.weight",
    ] {
        assert!(st.tensors.contains_key(name), "{name}");
    }
    drop(st);

    let f = trellm::load(&dir).unwrap();
    let (gt, ft) = (g.tokenizer().unwrap(), f.tokenizer().unwrap());
    let mut ids = Vec::new();
    while ids.len() < 600 {
        for s in SAMPLES {
            let (a, b) = (gt.encode(s, true).unwrap(), ft.encode(s, true).unwrap());
            assert_eq!(a, b, "{s:?}");
            ids.extend(&a[1..]);
        }
    }
    // 600 tokens: the sliding layers' window of 512 is passed.
    ids[0] = gt.bos_id().unwrap();
    ids.truncate(600);
    let t = Instant::now();
    let (x, y) = (last_logits(&g, &ids), last_logits(&f, &ids));
    let worst = max_abs_diff(&x, &y);
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0
    };
    eprintln!(
        "600 tokens: logits differ by at most {worst:e} ({:.1}s)",
        t.elapsed().as_secs_f64()
    );
    assert!(worst < 1e-2, "{worst}");
    assert_eq!(argmax(&x), argmax(&y));
}

#[test]
fn llama_gguf_with_bpe_vocabulary_still_converts() {
    // SmolLM2 (llama, Q4_1, byte-level BPE): q/k rows un-permuted, the same check passes.
    let g = trellm::load(&common::model_path("smollm2-135m-instruct")).unwrap();
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("smollm2");
    to_hf_folder(&g, &dir).unwrap();
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "llama");
    let f = trellm::load(&dir).unwrap();
    let ids = g.tokenizer().unwrap().encode(SAMPLES[1], true).unwrap();
    let (x, y) = (last_logits(&g, &ids), last_logits(&f, &ids));
    let worst = max_abs_diff(&x, &y);
    assert!(worst < 1e-3, "{worst}");
}

/// The largest elementwise difference of two logit rows.
fn max_abs_diff(x: &[f32], y: &[f32]) -> f32 {
    x.iter()
        .zip(y)
        .map(|(p, q)| (p - q).abs())
        .fold(0.0f32, f32::max)
}
