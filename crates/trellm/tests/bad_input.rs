//! Bad input gives one clean error line and a non-zero exit, never a panic.

mod common;

use common::*;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

#[test]
fn missing_path() {
    assert_clean_error(
        &[
            "generate",
            "--model",
            "/nonexistent/model.gguf",
            "--prompt",
            "hi",
        ],
        "model",
    );
}

#[test]
fn truncated_gguf() {
    let real = std::fs::read(model_path("smollm2-135m-instruct")).unwrap();
    let d = tmp();
    for (i, len) in [3usize, 20, 4096, real.len() / 2, real.len() - 1]
        .into_iter()
        .enumerate()
    {
        let p = d.path().join(format!("cut{i}.gguf"));
        std::fs::write(&p, &real[..len]).unwrap();
        assert_clean_error(
            &["generate", "--model", p.to_str().unwrap(), "--prompt", "hi"],
            "GGUF",
        );
    }
}

#[test]
fn corrupted_gguf() {
    let real = std::fs::read(model_path("smollm2-135m-instruct")).unwrap();
    let d = tmp();
    // Bad magic.
    let mut bad = real[..1 << 20].to_vec();
    bad[0] = b'X';
    let p = d.path().join("magic.gguf");
    std::fs::write(&p, &bad).unwrap();
    assert_clean_error(
        &["generate", "--model", p.to_str().unwrap(), "--prompt", "hi"],
        "not a GGUF",
    );
    // A metadata count far beyond the file.
    let mut bad = real[..1 << 20].to_vec();
    bad[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    let p = d.path().join("count.gguf");
    std::fs::write(&p, &bad).unwrap();
    assert_clean_error(
        &["generate", "--model", p.to_str().unwrap(), "--prompt", "hi"],
        "corrupt",
    );
    // Unsupported version.
    let mut bad = real[..1 << 20].to_vec();
    bad[4..8].copy_from_slice(&9u32.to_le_bytes());
    let p = d.path().join("version.gguf");
    std::fs::write(&p, &bad).unwrap();
    assert_clean_error(
        &["generate", "--model", p.to_str().unwrap(), "--prompt", "hi"],
        "version",
    );
}

#[test]
fn gguf_parser_survives_random_corruption() {
    // Flip bytes all over the header region; every outcome must be Ok or Err, never a panic.
    let real = std::fs::read(model_path("smollm2-135m-instruct")).unwrap();
    let header_len = 2 << 20;
    let d = tmp();
    let p = d.path().join("fuzz.gguf");
    let noise = rand_vec(4000, 99, 1.0);
    for round in 0..200 {
        let mut b = real[..header_len.min(real.len())].to_vec();
        for k in 0..8 {
            let r = noise[(round * 8 + k) % noise.len()].abs();
            let i = ((r * 1e6) as usize * 7919 + round * 131) % 4096.min(b.len());
            b[i] = b[i].wrapping_add(1 + (round as u8 % 200));
        }
        std::fs::write(&p, &b).unwrap();
        let _ = trellm_formats::gguf::Gguf::open(&p);
    }
}

#[test]
fn unknown_architecture() {
    let d = tmp();
    let p = d.path().join("x.gguf");
    GgufWriter::new()
        .str("general.architecture", "mamba")
        .write(&p);
    assert_clean_error(
        &[
            "generate",
            "--model",
            p.to_str().unwrap(),
            "--prompt-ids",
            "1,2",
        ],
        "unsupported architecture 'mamba'",
    );
    let dir = d.path().join("hf");
    write_tiny_llama(&dir, "rwkv7", 64);
    assert_clean_error(
        &[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            "1,2",
        ],
        "unsupported model_type 'rwkv7'",
    );
}

#[test]
fn unsupported_tensor_type() {
    // A llama GGUF whose q projection is IQ1_S (type 19), which trellm does not decode.
    let d = tmp();
    let p = d.path().join("iq1s.gguf");
    let (h, vocab) = (32u64, 8u64);
    let mut w = GgufWriter::new()
        .str("general.architecture", "llama")
        .u32("llama.embedding_length", h as u32)
        .u32("llama.attention.head_count", 2)
        .u32("llama.block_count", 1)
        .u32("llama.feed_forward_length", 64)
        .u32("llama.context_length", 64)
        .u32("llama.vocab_size", vocab as u32)
        .f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .str("tokenizer.ggml.model", "gpt2")
        .str_array(
            "tokenizer.ggml.tokens",
            &["a", "b", "c", "d", "e", "f", "g", "h"],
        )
        .str_array("tokenizer.ggml.merges", &[]);
    w = w.f32_tensor(
        "token_embd.weight",
        &[h, vocab],
        &rand_vec((h * vocab) as usize, 1, 0.1),
    );
    w = w.f32_tensor("output_norm.weight", &[h], &vec![1.0; h as usize]);
    w = w.f32_tensor("blk.0.attn_norm.weight", &[h], &vec![1.0; h as usize]);
    w = w.tensor(
        "blk.0.attn_q.weight",
        &[h, h],
        19,
        vec![0u8; (h * h / 256 * 50) as usize],
    );
    w.write(&p);
    assert_clean_error(
        &[
            "generate",
            "--model",
            p.to_str().unwrap(),
            "--prompt-ids",
            "1,2",
        ],
        "IQ1",
    );
}

#[test]
fn truncated_and_corrupted_safetensors() {
    let d = tmp();
    let dir = d.path().join("hf");
    write_tiny_llama(&dir, "llama", 64);
    let st = dir.join("model.safetensors");
    let full = std::fs::read(&st).unwrap();
    let args = [
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "--max-tokens",
        "2",
    ];
    // The intact folder works.
    let (code, _, err) = run(&args);
    assert_eq!(code, 0, "{err}");
    for len in [4, 8, 100, full.len() / 2, full.len() - 1] {
        std::fs::write(&st, &full[..len]).unwrap();
        assert_clean_error(&args, "safetensors");
    }
    let mut bad = full.clone();
    bad[8] = b'#';
    std::fs::write(&st, &bad).unwrap();
    assert_clean_error(&args, "safetensors");
    let mut bad = full.clone();
    bad[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&st, &bad).unwrap();
    assert_clean_error(&args, "safetensors");
    std::fs::write(dir.join("config.json"), "{\"model_type\": \"llama\",").unwrap();
    assert_clean_error(&args, "config.json");
}

#[test]
fn config_missing_a_field() {
    let d = tmp();
    let dir = d.path().join("hf");
    write_tiny_llama(&dir, "llama", 64);
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("intermediate_size");
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    assert_clean_error(
        &[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            "1",
        ],
        "intermediate_size",
    );
}

#[test]
fn prompt_longer_than_context() {
    let d = tmp();
    let dir = d.path().join("hf");
    write_tiny_llama(&dir, "llama", 16);
    let ids: Vec<String> = (0..20).map(|i| (i % 90).to_string()).collect();
    assert_clean_error(
        &[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            &ids.join(","),
        ],
        "context",
    );
    // A token id outside the vocabulary.
    assert_clean_error(
        &[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            "1,5000",
        ],
        "vocabulary",
    );
    // No tokenizer: text prompts are refused, ids work.
    assert_clean_error(
        &[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            "hi",
        ],
        "tokenizer",
    );
}

#[test]
fn invalid_flag_values() {
    let d = tmp();
    let dir = d.path().join("hf");
    write_tiny_llama(&dir, "llama", 64);
    let m = dir.to_str().unwrap();
    let base = ["generate", "--model", m, "--prompt-ids", "1,2"];
    let cases: &[(&[&str], &str)] = &[
        (&["--temp", "-1"], "temp"),
        (&["--temp", "abc"], "temp"),
        (&["--top-p", "1.5"], "top-p"),
        (&["--min-p", "-0.1"], "min-p"),
        (&["--top-k", "100000"], "top-k"),
        (&["--max-tokens", "-3"], "max-tokens"),
        (&["--threads", "0"], "threads"),
        (&["--logit-bias", "{oops"], "logit-bias"),
        (&["--logit-bias", "{\"99999\": 1.0}"], "vocabulary"),
        (&["--repetition-penalty", "-2"], "repetition-penalty"),
        (&["--logprobs", "5"], "--json"),
        (&["--no-such-flag"], "no-such-flag"),
        (&["--device", "tpu"], "device"),
    ];
    for (extra, needle) in cases {
        let mut args: Vec<&str> = base.to_vec();
        args.extend_from_slice(extra);
        assert_clean_error(&args, needle);
    }
    assert_clean_error(
        &["generate", "--model", m, "--prompt-ids", "1,x"],
        "prompt-ids",
    );
    let msgs = d.path().join("m.json");
    std::fs::write(&msgs, "[{\"role\": 1}]").unwrap();
    assert_clean_error(
        &[
            "generate",
            "--model",
            "smollm2-135m-instruct",
            "--messages",
            msgs.to_str().unwrap(),
        ],
        "messages",
    );
}

#[test]
fn weights_that_compute_nan_are_an_error_not_garbage() {
    // A model whose embedding holds NaN in its data (a corrupt download) must not print text
    // with exit 0.
    let d = tmp();
    write_tiny_llama(d.path(), "llama", 64);
    let st = d.path().join("model.safetensors");
    let mut bytes = std::fs::read(&st).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let off = &header["model.embed_tokens.weight"]["data_offsets"];
    let (a, b) = (
        8 + n + off[0].as_u64().unwrap() as usize,
        8 + n + off[1].as_u64().unwrap() as usize,
    );
    for c in bytes[a..b].chunks_exact_mut(4) {
        c.copy_from_slice(&f32::NAN.to_le_bytes());
    }
    std::fs::write(&st, bytes).unwrap();
    assert_clean_error(
        &[
            "generate",
            "--model",
            d.path().to_str().unwrap(),
            "--prompt-ids",
            "1,2,3",
        ],
        "non-finite",
    );
}
