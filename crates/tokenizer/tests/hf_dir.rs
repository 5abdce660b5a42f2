//! Loading Hugging Face folders and GGUF files: options, and clean errors for bad input.

mod common;

use std::path::Path;

use common::fixture;
use serde_json::json;
use trellm_tokenizer::{ChatMessage, Tokenizer, TokenizerError};

fn tiny_with(dir: &Path, config: serde_json::Value) {
    std::fs::copy(
        fixture("tiny-tokenizer/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

fn user(s: &str) -> Vec<ChatMessage> {
    vec![ChatMessage::new("user", s)]
}

#[test]
fn loads_the_tiny_fixture() {
    let tok = Tokenizer::from_hf_dir(&fixture("tiny-tokenizer")).unwrap();
    assert!(tok.has_chat_template());
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    let text = tok.apply_chat_template(&user("hello there"), true).unwrap();
    assert_eq!(
        text,
        "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = tok.encode(&text, false).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    assert_eq!(
        tok.decode(&ids, true).unwrap(),
        "user\nhello there\nassistant\n"
    );
}

#[test]
fn missing_folder_or_tokenizer_json() {
    let dir = tempfile::tempdir().unwrap();
    let e = Tokenizer::from_hf_dir(dir.path()).unwrap_err();
    assert!(matches!(e, TokenizerError::Io { .. }), "{e:?}");
    assert!(e.to_string().contains("tokenizer.json"), "{e}");
    assert!(Tokenizer::from_hf_dir(&dir.path().join("nope")).is_err());
}

#[test]
fn corrupt_json_files() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("tokenizer.json"),
        "{\"version\": \"1.0\", \"model\": ",
    )
    .unwrap();
    let e = Tokenizer::from_hf_dir(dir.path()).unwrap_err();
    assert!(matches!(e, TokenizerError::Json { .. }), "{e:?}");

    std::fs::write(
        dir.path().join("tokenizer.json"),
        "{\"not\": \"a tokenizer\"}",
    )
    .unwrap();
    assert!(matches!(
        Tokenizer::from_hf_dir(dir.path()).unwrap_err(),
        TokenizerError::Json { .. }
    ));

    tiny_with(dir.path(), json!({}));
    std::fs::write(dir.path().join("tokenizer_config.json"), "{ broken").unwrap();
    let e = Tokenizer::from_hf_dir(dir.path()).unwrap_err();
    assert!(e.to_string().contains("tokenizer_config.json"), "{e}");

    tiny_with(dir.path(), json!({}));
    std::fs::write(dir.path().join("generation_config.json"), "[1,").unwrap();
    assert!(Tokenizer::from_hf_dir(dir.path()).is_err());
}

#[test]
fn template_errors_are_clean() {
    let dir = tempfile::tempdir().unwrap();
    tiny_with(
        dir.path(),
        json!({"chat_template": "{% if messages[0]['role'] != 'system' %}{{ raise_exception('System message required!') }}{% endif %}ok"}),
    );
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    let e = tok.apply_chat_template(&user("x"), true).unwrap_err();
    assert!(matches!(e, TokenizerError::Template(_)), "{e:?}");
    assert!(e.to_string().contains("System message required!"), "{e}");
    assert!(!e.to_string().contains('\n'));
    assert_eq!(
        tok.apply_chat_template(&[ChatMessage::new("system", "s")], true)
            .unwrap(),
        "ok"
    );

    // Syntax errors load fine and fail when rendering.
    tiny_with(
        dir.path(),
        json!({"chat_template": "{% for m in messages %}{{ m.content }"}),
    );
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert!(tok.has_chat_template());
    let e = tok.apply_chat_template(&user("x"), true).unwrap_err();
    assert!(matches!(e, TokenizerError::Template(_)), "{e:?}");
    assert!(!e.to_string().contains('\n'));

    // Errors raised at runtime by the engine itself (unknown filter, bad operation).
    tiny_with(
        dir.path(),
        json!({"chat_template": "{{ messages[0].content | no_such_filter }}"}),
    );
    assert!(Tokenizer::from_hf_dir(dir.path())
        .unwrap()
        .apply_chat_template(&user("x"), true)
        .is_err());
    tiny_with(
        dir.path(),
        json!({"chat_template": "{{ messages[0].content + 1 }}"}),
    );
    assert!(Tokenizer::from_hf_dir(dir.path())
        .unwrap()
        .apply_chat_template(&user("x"), true)
        .is_err());

    // No template at all.
    tiny_with(dir.path(), json!({}));
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert!(!tok.has_chat_template());
    assert!(matches!(
        tok.apply_chat_template(&user("x"), true),
        Err(TokenizerError::NoChatTemplate)
    ));
}

#[test]
fn config_variants() {
    let dir = tempfile::tempdir().unwrap();
    // Special tokens as AddedToken objects, add_bos_token, named templates, EOS lists.
    tiny_with(
        dir.path(),
        json!({
            "bos_token": {"content": "<|im_start|>", "lstrip": false, "__type": "AddedToken"},
            "eos_token": {"content": "<|im_end|>"},
            "add_bos_token": true,
            "chat_template": [
                {"name": "tool_use", "template": "tools"},
                {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}
            ]
        }),
    );
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"eos_token_id": [2, 0]}"#,
    )
    .unwrap();
    std::fs::write(dir.path().join("config.json"), r#"{"eos_token_id": 7}"#).unwrap();
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert_eq!(tok.bos_id(), Some(1));
    assert!(tok.add_bos());
    assert_eq!(tok.eos_ids(), &[2, 0]);
    assert_eq!(
        tok.apply_chat_template(&user("hi"), true).unwrap(),
        "<|im_start|>hi<|im_end|>"
    );
    let plain = tok.encode("hi", false).unwrap();
    assert_eq!(tok.encode("hi", true).unwrap(), [vec![1], plain].concat());

    // config.json's eos_token_id when there is no generation_config.json.
    std::fs::remove_file(dir.path().join("generation_config.json")).unwrap();
    assert_eq!(
        Tokenizer::from_hf_dir(dir.path()).unwrap().eos_ids(),
        &[2, 7]
    );

    // Named templates without a "default" one: an error when used.
    tiny_with(
        dir.path(),
        json!({"chat_template": [{"name": "rag", "template": "x"}]}),
    );
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert!(tok
        .apply_chat_template(&user("hi"), true)
        .unwrap_err()
        .to_string()
        .contains("default"));

    // chat_template.jinja wins over tokenizer_config.json.
    tiny_with(dir.path(), json!({"chat_template": "from config"}));
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "from jinja {{ messages | length }}\n",
    )
    .unwrap();
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert_eq!(
        tok.apply_chat_template(&user("hi"), false).unwrap(),
        "from jinja 1"
    );
}

/// A minimal GGUF v3 file with string / array metadata and no tensors.
fn write_gguf(path: &Path, kvs: &[(&str, Kv)]) {
    fn s(out: &mut Vec<u8>, x: &str) {
        out.extend((x.len() as u64).to_le_bytes());
        out.extend(x.as_bytes());
    }
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(0u64.to_le_bytes());
    out.extend((kvs.len() as u64).to_le_bytes());
    for (k, v) in kvs {
        s(&mut out, k);
        match v {
            Kv::Str(x) => {
                out.extend(8u32.to_le_bytes());
                s(&mut out, x);
            }
            Kv::U32(x) => {
                out.extend(4u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            Kv::Bool(x) => {
                out.extend(7u32.to_le_bytes());
                out.push(u8::from(*x));
            }
            Kv::Strs(xs) => {
                out.extend(9u32.to_le_bytes());
                out.extend(8u32.to_le_bytes());
                out.extend((xs.len() as u64).to_le_bytes());
                for x in xs {
                    s(&mut out, x);
                }
            }
            Kv::F32s(xs) => {
                out.extend(9u32.to_le_bytes());
                out.extend(6u32.to_le_bytes());
                out.extend((xs.len() as u64).to_le_bytes());
                for x in xs {
                    out.extend(x.to_le_bytes());
                }
            }
            Kv::I32s(xs) => {
                out.extend(9u32.to_le_bytes());
                out.extend(5u32.to_le_bytes());
                out.extend((xs.len() as u64).to_le_bytes());
                for x in xs {
                    out.extend(x.to_le_bytes());
                }
            }
        }
    }
    std::fs::write(path, out).unwrap();
}

enum Kv {
    Str(&'static str),
    U32(u32),
    Bool(bool),
    Strs(Vec<&'static str>),
    F32s(Vec<f32>),
    I32s(Vec<i32>),
}

fn gguf_tokenizer(kvs: &[(&str, Kv)]) -> Result<Tokenizer, TokenizerError> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.gguf");
    write_gguf(&p, kvs);
    let g = trellm_formats::gguf::Gguf::open(&p).unwrap();
    Tokenizer::from_gguf(&g)
}

#[test]
fn gguf_errors() {
    let e = gguf_tokenizer(&[("general.architecture", Kv::Str("bert"))]).unwrap_err();
    assert!(e.to_string().contains("tokenizer.ggml.model"), "{e}");
    let e = gguf_tokenizer(&[
        ("tokenizer.ggml.model", Kv::Str("bert")),
        ("tokenizer.ggml.tokens", Kv::Strs(vec!["a"])),
    ])
    .unwrap_err();
    assert!(matches!(e, TokenizerError::Unsupported(_)), "{e:?}");
    assert!(e.to_string().contains("bert"));
    // SentencePiece without scores, BPE without merges.
    let e = gguf_tokenizer(&[
        ("tokenizer.ggml.model", Kv::Str("llama")),
        ("tokenizer.ggml.tokens", Kv::Strs(vec!["a"])),
    ])
    .unwrap_err();
    assert!(e.to_string().contains("scores"), "{e}");
    let e = gguf_tokenizer(&[
        ("tokenizer.ggml.model", Kv::Str("gpt2")),
        ("tokenizer.ggml.tokens", Kv::Strs(vec!["a"])),
    ])
    .unwrap_err();
    assert!(e.to_string().contains("merges"), "{e}");
}

/// A Llama-2 style vocabulary (add_space_prefix on): a space is put in front of the text and of
/// each run of text after a special token, and decode drops it again at the start.
#[test]
fn gguf_spm_with_space_prefix() {
    let pieces = vec![
        "<unk>", "<s>", "</s>", "<0x41>", "▁", "a", "b", "▁a", "ab", "▁ab", "▁b", "c", "<0xC3>",
        "<0xA9>",
    ];
    let scores = vec![
        0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0, 0.0, 0.0,
    ];
    let types = vec![2, 3, 3, 6, 1, 1, 1, 1, 1, 1, 1, 1, 6, 6];
    let tok = gguf_tokenizer(&[
        ("tokenizer.ggml.model", Kv::Str("llama")),
        ("tokenizer.ggml.tokens", Kv::Strs(pieces)),
        ("tokenizer.ggml.scores", Kv::F32s(scores)),
        ("tokenizer.ggml.token_type", Kv::I32s(types)),
        ("tokenizer.ggml.bos_token_id", Kv::U32(1)),
        ("tokenizer.ggml.eos_token_id", Kv::U32(2)),
        ("tokenizer.ggml.unknown_token_id", Kv::U32(0)),
        ("tokenizer.ggml.add_space_prefix", Kv::Bool(true)),
        (
            "tokenizer.chat_template",
            Kv::Str("{{ bos_token }}[{{ messages[0].content }}]{{ eos_token }}"),
        ),
    ])
    .unwrap();
    // "▁ab" outranks the pieces it can be built from only through "▁a" + "b" -> ("▁a" first).
    assert_eq!(tok.encode("ab", true).unwrap(), vec![1, 9]);
    assert_eq!(tok.encode("ab b", false).unwrap(), vec![9, 10]);
    assert_eq!(tok.encode("a</s>b", false).unwrap(), vec![7, 2, 10]);
    assert_eq!(tok.encode("é", false).unwrap(), vec![4, 12, 13]);
    assert_eq!(tok.decode(&[1, 9, 10], true).unwrap(), "ab b");
    assert_eq!(tok.decode(&[1, 9, 10], false).unwrap(), "<s> ab b");
    assert_eq!(tok.decode(&[4, 12, 13], false).unwrap(), "é");
    assert_eq!(
        tok.apply_chat_template(&user("q"), true).unwrap(),
        "<s>[q]</s>",
    );
    assert_eq!(tok.eos_ids(), &[2]);
}

#[test]
fn empty_chat_is_an_error_and_tokenizer_is_shareable() {
    fn shareable<T: Send + Sync>() {}
    shareable::<Tokenizer>();
    let tok = Tokenizer::from_hf_dir(&fixture("tiny-tokenizer")).unwrap();
    assert!(matches!(
        tok.apply_chat_template(&[], true),
        Err(TokenizerError::Template(_))
    ));
}

/// Byte-level BPE GGUFs with the common pre-tokenizers build and split as expected.
#[test]
fn gguf_bpe_pre_tokenizers() {
    let bpe = |pre: &'static str| {
        gguf_tokenizer(&[
            ("tokenizer.ggml.model", Kv::Str("gpt2")),
            ("tokenizer.ggml.pre", Kv::Str(pre)),
            (
                "tokenizer.ggml.tokens",
                Kv::Strs(vec![
                    "<|end|>", "a", "b", "Ġ", "c", "ab", "1", "2", "12", "Ġc",
                ]),
            ),
            (
                "tokenizer.ggml.token_type",
                Kv::I32s(vec![3, 1, 1, 1, 1, 1, 1, 1, 1, 1]),
            ),
            ("tokenizer.ggml.merges", Kv::Strs(vec!["a b", "1 2", "Ġ c"])),
            ("tokenizer.ggml.eos_token_id", Kv::U32(0)),
        ])
    };
    for pre in ["llama-bpe", "qwen2", "gpt-2", "smollm"] {
        let tok = bpe(pre).unwrap();
        assert_eq!(
            tok.encode("ab c<|end|>", true).unwrap(),
            vec![5, 9, 0],
            "{pre}"
        );
        // Digits: llama3 and gpt-2 keep "12" together, qwen2 and smollm split digits.
        let want: &[u32] = if matches!(pre, "qwen2" | "smollm") {
            &[6, 7]
        } else {
            &[8]
        };
        assert_eq!(tok.encode("12", false).unwrap(), want, "{pre}");
        assert_eq!(tok.decode(&[5, 9, 0], false).unwrap(), "ab c<|end|>");
        assert_eq!(tok.decode(&[5, 9, 0], true).unwrap(), "ab c");
        assert_eq!(tok.eos_ids(), &[0]);
        assert!(!tok.add_bos());
    }
    let e = bpe("no-such-pre").unwrap_err();
    assert!(matches!(e, TokenizerError::Unsupported(_)), "{e:?}");
}
