//! A GGUF SentencePiece vocabulary written as `tokenizer.json` (`Tokenizer::to_hf_json`) and read
//! back as a Hugging Face folder tokenizes exactly as trellm's llama.cpp twin does:
//! gemma-3-270m's 262144 pieces, on the reference texts and (when the repository's shared data is there) the whole wikitext-2 test
//! file the quantizer calibrates and evaluates on.

mod common;

use std::path::Path;

use common::{fixture, gemma};
use serde_json::Value;
use trellm_tokenizer::Tokenizer;

fn texts() -> Vec<String> {
    let s = std::fs::read_to_string(fixture("reference.json")).expect("reference.json");
    let v: Value = serde_json::from_str(&s).expect("reference JSON");
    v["encodings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["text"].as_str().unwrap().to_string())
        .collect()
}

/// The tokenizer.json of `gguf` in a folder of its own, with the BOS setting a converter writes.
fn converted(gguf: &Tokenizer, dir: &Path) -> Tokenizer {
    std::fs::write(dir.join("tokenizer.json"), gguf.to_hf_json().unwrap()).unwrap();
    let bos = gguf.bos_id().and_then(|b| gguf.id_to_token(b));
    let cfg = serde_json::json!({"add_bos_token": gguf.add_bos(), "bos_token": bos});
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    Tokenizer::from_hf_dir(dir).unwrap()
}

fn assert_same(a: &Tokenizer, b: &Tokenizer, text: &str) {
    for special in [false, true] {
        let (x, y) = (
            a.encode(text, special).unwrap(),
            b.encode(text, special).unwrap(),
        );
        if x != y {
            let at = x
                .iter()
                .zip(&y)
                .position(|(p, q)| p != q)
                .unwrap_or(x.len().min(y.len()));
            let lo = at.saturating_sub(3);
            panic!(
                "{text:?} (add_special_tokens {special}): ids differ at {at}: GGUF {:?} vs tokenizer.json {:?}",
                x[lo..(at + 4).min(x.len())].iter().map(|&i| a.id_to_token(i).unwrap()).collect::<Vec<_>>(),
                y[lo..(at + 4).min(y.len())].iter().map(|&i| b.id_to_token(i).unwrap()).collect::<Vec<_>>(),
            );
        }
    }
    assert_eq!(
        a.decode(&a.encode(text, false).unwrap(), false).unwrap(),
        b.decode(&b.encode(text, false).unwrap(), false).unwrap(),
        "decode of {text:?}"
    );
}

#[test]
fn a_vocabulary_without_byte_pieces_is_refused() {
    // The tiny fixture vocabulary has no <0xXX> pieces: llama.cpp keeps a character outside it
    // as a symbol that blocks merges, which a tokenizer.json cannot say.
    let g = trellm_formats::gguf::Gguf::open(
        &common::crate_dir().join("../../tests/fixtures/gguf-tiny/llama.f32.gguf"),
    )
    .unwrap();
    let e = Tokenizer::from_gguf(&g).unwrap().to_hf_json().unwrap_err();
    assert!(e.to_string().contains("byte piece <0x00>"), "{e}");
}

#[test]
fn gemma_vocabulary_as_tokenizer_json() {
    let a = gemma();
    let d = tempfile::tempdir().unwrap();
    let b = converted(a, d.path());
    assert_eq!(a.vocab_size(), b.vocab_size());
    for t in texts() {
        assert_same(a, &b, &t);
    }
    let wiki = common::crate_dir().join("../../../shared/data/wikitext-2-raw-test.raw");
    if let Ok(text) = std::fs::read_to_string(&wiki) {
        let text = text.replace('\r', "");
        let x = a.encode(&text, true).unwrap();
        assert_eq!(x, b.encode(&text, true).unwrap(), "wikitext-2 test");
        eprintln!("wikitext-2 test: {} ids, the same", x.len());
    }
}
