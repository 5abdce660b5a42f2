//! Ids, decodes and chat renderings against reference data made by scripts/make_reference.py
//! (HF tokenizers/transformers for SmolLM2 and the tiny tokenizer, llama.cpp for Gemma).

mod common;

use std::path::Path;

use common::{fixture, gemma, ids, smollm2};
use serde_json::Value;
use trellm_tokenizer::{ChatMessage, Tokenizer};

fn reference() -> Value {
    let s = std::fs::read_to_string(fixture("reference.json")).expect("reference.json");
    serde_json::from_str(&s).expect("reference JSON")
}

fn messages(v: &Value) -> Vec<ChatMessage> {
    serde_json::from_value(v.clone()).expect("messages")
}

fn tiny() -> Tokenizer {
    Tokenizer::from_hf_dir(&fixture("tiny-tokenizer")).expect("tiny tokenizer")
}

#[test]
fn smollm2_ids_and_round_trip() {
    let tok = smollm2();
    for e in reference()["encodings"].as_array().unwrap() {
        let text = e["text"].as_str().unwrap();
        let want = ids(&e["smollm2"]);
        assert_eq!(tok.encode(text, false).unwrap(), want, "ids of {text:?}");
        assert_eq!(
            tok.decode(&want, false).unwrap(),
            e["smollm2_decoded"].as_str().unwrap(),
            "decode of {text:?}"
        );
        assert_eq!(
            tok.decode(&want, false).unwrap(),
            text,
            "round trip of {text:?}"
        );
    }
}

#[test]
fn smollm2_splits_digits_and_parses_specials() {
    let tok = smollm2();
    let digits: Vec<String> = tok
        .encode("12345", false)
        .unwrap()
        .iter()
        .map(|&id| tok.decode(&[id], false).unwrap())
        .collect();
    assert_eq!(digits, ["1", "2", "3", "4", "5"]);
    let ids = tok.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(ids.last(), Some(&2));
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi");
}

#[test]
fn gemma_ids_match_llama_cpp() {
    let tok = gemma();
    for e in reference()["encodings"].as_array().unwrap() {
        let text = e["text"].as_str().unwrap();
        let want = ids(&e["gemma"]);
        assert_eq!(tok.encode(text, false).unwrap(), want, "ids of {text:?}");
        let mut with_bos = vec![2];
        with_bos.extend(&want);
        assert_eq!(
            tok.encode(text, true).unwrap(),
            with_bos,
            "ids with BOS of {text:?}"
        );
        assert_eq!(
            tok.decode(&want, false).unwrap(),
            text,
            "round trip of {text:?}"
        );
    }
}

#[test]
fn gemma_byte_fallback() {
    let tok = gemma();
    // U+13000 (Egyptian hieroglyph A001) is not a piece: four byte tokens.
    let ids = tok.encode("\u{13000}", false).unwrap();
    let pieces: Vec<String> = ids.iter().map(|&i| tok.id_to_token(i).unwrap()).collect();
    assert_eq!(pieces, ["<0xF0>", "<0x93>", "<0x80>", "<0x80>"]);
    assert_eq!(tok.decode(&ids, false).unwrap(), "\u{13000}");
    // Bytes that are not text: the joined bytes read with Python's errors="replace" rules (one
    // U+FFFD per invalid or unfinished sequence), which is what llama.cpp's detokenized bytes give.
    let b = |x: &str| tok.token_to_id(x).unwrap();
    let a = b("a");
    assert_eq!(
        tok.decode(&[a, b("<0x80>"), a], false).unwrap(),
        "a\u{FFFD}a"
    );
    assert_eq!(
        tok.decode(&[a, b("<0xE2>"), b("<0x82>"), a], false)
            .unwrap(),
        "a\u{FFFD}a"
    );
    let euro = [b("<0xE2>"), b("<0x82>"), b("<0xAC>")];
    assert_eq!(
        tok.decode(&[euro[0], euro[1], euro[2], euro[0], euro[1]], false)
            .unwrap(),
        "€\u{FFFD}"
    );
}

#[test]
fn gemma_special_and_whitespace_tokens() {
    let tok = gemma();
    let ids = tok
        .encode("<start_of_turn>user\nhi<end_of_turn>\n", false)
        .unwrap();
    assert_eq!(ids[0], 105);
    assert!(ids.contains(&106));
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi\n");
    // Runs of spaces and newlines are single (user-defined) tokens.
    assert_eq!(tok.encode("    ", false).unwrap(), vec![140]);
    assert_eq!(tok.encode("\n\n", false).unwrap(), vec![108]);
}

#[test]
fn smollm2_chat_renderings() {
    let tok = smollm2();
    for c in reference()["smollm2_chats"].as_array().unwrap() {
        let msgs = messages(&c["messages"]);
        let got = tok
            .apply_chat_template(&msgs, c["add_generation_prompt"].as_bool().unwrap())
            .unwrap();
        assert_eq!(got, c["rendered"].as_str().unwrap());
    }
}

#[test]
fn tiny_tokenizer_matches_transformers() {
    let tok = tiny();
    let r = reference();
    for e in r["encodings"].as_array().unwrap() {
        let text = e["text"].as_str().unwrap();
        let want = ids(&e["tiny"]);
        assert_eq!(tok.encode(text, false).unwrap(), want, "ids of {text:?}");
        // add_bos_token=false in its config: nothing is added.
        assert_eq!(tok.encode(text, true).unwrap(), want);
    }
    for c in r["tiny_chats"].as_array().unwrap() {
        let msgs = messages(&c["messages"]);
        let got = tok
            .apply_chat_template(&msgs, c["add_generation_prompt"].as_bool().unwrap())
            .unwrap();
        assert_eq!(got, c["rendered"].as_str().unwrap());
    }
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), &[0]);
    assert!(!tok.add_bos());
}

/// A scratch HF folder: the tiny tokenizer with the given tokenizer_config.json.
fn hf_dir_with_config(dir: &Path, config: &Value) {
    std::fs::copy(
        fixture("tiny-tokenizer/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string(config).unwrap(),
    )
    .unwrap();
}

#[test]
fn template_features_match_transformers() {
    let r = reference();
    let specials = &r["smollm2_special_tokens"];
    let dir = tempfile::tempdir().unwrap();
    for (i, c) in r["templates"].as_array().unwrap().iter().enumerate() {
        let mut cfg = specials.clone();
        cfg["chat_template"] = c["template"].clone();
        hf_dir_with_config(dir.path(), &cfg);
        let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
        let got = tok.apply_chat_template(
            &messages(&c["messages"]),
            c["add_generation_prompt"].as_bool().unwrap(),
        );
        match (&c["rendered"], &c["error"]) {
            (Value::String(want), _) => {
                assert_eq!(&got.unwrap(), want, "template case {i}: {}", c["template"])
            }
            (_, Value::String(err)) => {
                let e = got.expect_err("template should fail").to_string();
                let msg = err.split_once(": ").map_or(err.as_str(), |(_, m)| m);
                assert!(
                    e.contains(msg),
                    "case {i}: error {e:?} should mention {msg:?}"
                );
                assert!(!e.contains('\n'), "one-line error: {e:?}");
            }
            _ => panic!("bad reference case {i}"),
        }
    }
}
