//! Streaming detokenization: chunks concatenate to `decode(ids)` and never show a U+FFFD that
//! the full decode does not have.

mod common;

use common::{fixture, gemma, smollm2};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use trellm_tokenizer::Tokenizer;

/// Streams `ids` and checks the chunks against the full decode; returns the chunks.
fn check_stream(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> Vec<String> {
    let full = tok.decode(ids, skip_special).unwrap();
    let mut dec = tok.stream_decoder_with(skip_special);
    let mut chunks = Vec::new();
    let mut so_far = String::new();
    for (i, &id) in ids.iter().enumerate() {
        let c = dec.push(id).unwrap();
        so_far.push_str(&c);
        // Whatever is out is final: a prefix of the full text, and of the text decoded so far.
        assert!(
            full.starts_with(&so_far),
            "step {i}: {so_far:?} is not a prefix of {full:?} (ids {ids:?})"
        );
        let partial = tok.decode(&ids[..=i], skip_special).unwrap();
        assert!(
            partial.starts_with(&so_far),
            "step {i}: {so_far:?} vs partial {partial:?}"
        );
        chunks.push(c);
    }
    let tail = dec.finish().unwrap();
    so_far.push_str(&tail);
    chunks.push(tail);
    assert_eq!(so_far, full, "stream of {ids:?}");
    chunks
}

const TEXTS: &[&str] = &[
    "Hello, world! 😀🎉👍🏽 👨‍👩‍👧‍👦",
    "中文文本测试，你好世界！日本語のテキスト",
    "Rare: 𓀀𓀁 𐌀𐌁 𠀀 ꙮ ᚠᚢᚦ ⍼ 🫨 ḁ end",
    "  spaces   and\ttabs\n\nnewlines  ",
    "<|im_start|>user\nhi<|im_end|><start_of_turn>model\n€ and 12345<end_of_turn>",
];

#[test]
fn streams_equal_decode_on_real_text() {
    let tiny = Tokenizer::from_hf_dir(&fixture("tiny-tokenizer")).unwrap();
    for tok in [smollm2(), gemma(), &tiny] {
        for t in TEXTS {
            let ids = tok.encode(t, true).unwrap();
            let chunks = check_stream(tok, &ids, false);
            assert!(chunks.iter().all(|c| !c.contains('\u{FFFD}')), "{chunks:?}");
            check_stream(tok, &ids, true);
        }
    }
}

#[test]
fn split_characters_are_held_back() {
    // Gemma: € as three byte-fallback tokens, then a normal token.
    let g = gemma();
    let b = |x: &str| g.token_to_id(x).unwrap();
    let hello = g.encode("Hello", false).unwrap();
    let mut ids = hello.clone();
    ids.extend([b("<0xE2>"), b("<0x82>"), b("<0xAC>")]);
    ids.extend(&hello);
    let chunks = check_stream(g, &ids, false);
    assert_eq!(chunks.concat(), "Hello€Hello");
    assert!(chunks.iter().all(|c| !c.contains('\u{FFFD}')));
    // The character comes out as soon as its last byte is in.
    assert_eq!(&chunks[hello.len()..hello.len() + 3], ["", "", "€"]);

    // An unfinished sequence only comes out at finish(), as decode shows it.
    let ids = [hello[0], b("<0xE2>"), b("<0x82>")];
    let mut dec = g.stream_decoder();
    let pushed: String = ids.iter().map(|&i| dec.push(i).unwrap()).collect();
    assert!(!pushed.contains('\u{FFFD}'));
    assert_eq!(
        pushed + &dec.finish().unwrap(),
        g.decode(&ids, false).unwrap()
    );

    // SmolLM2 (byte-level BPE): an emoji split over several tokens.
    let s = smollm2();
    let ids = s.encode("a😀b🫨", false).unwrap();
    assert!(ids.len() > 4, "emoji should span several tokens: {ids:?}");
    let chunks = check_stream(s, &ids, false);
    assert!(chunks.iter().all(|c| !c.contains('\u{FFFD}')));
}

/// Random ids, biased towards byte tokens and pieces of multi-byte characters.
fn random_ids(
    tok: &Tokenizer,
    rng: &mut ChaCha8Rng,
    len: usize,
    bytes: &[u32],
    pieces: &[u32],
) -> Vec<u32> {
    let n = tok.vocab_size() as u32;
    (0..len)
        .map(|_| match rng.gen_range(0..10) {
            0..=3 if !bytes.is_empty() => bytes[rng.gen_range(0..bytes.len())],
            4..=6 => pieces[rng.gen_range(0..pieces.len())],
            _ => rng.gen_range(0..n),
        })
        .collect()
}

#[test]
fn random_sequences_stream_like_decode() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for tok in [gemma(), smollm2()] {
        let bytes: Vec<u32> = (0..=255u8)
            .filter_map(|b| tok.token_to_id(&format!("<0x{b:02X}>")))
            .collect();
        let mut pieces = Vec::new();
        for t in TEXTS {
            pieces.extend(tok.encode(t, false).unwrap());
        }
        for len in [1, 2, 3, 5, 8, 16, 40] {
            for _ in 0..60 {
                let ids = random_ids(tok, &mut rng, len, &bytes, &pieces);
                check_stream(tok, &ids, false);
                check_stream(tok, &ids, true);
            }
        }
    }
}

#[test]
fn bad_ids_are_errors() {
    for tok in [gemma(), smollm2()] {
        let n = tok.vocab_size() as u32;
        assert!(tok.decode(&[n], false).is_err());
        assert!(tok.stream_decoder().push(n + 5).is_err());
    }
}

/// A `tokenizer.json` with SentencePiece-style byte fallback (`ByteFallback` decoder): runs of
/// byte tokens decode as a whole, so the stream waits for a run to end.
#[test]
fn hf_byte_fallback_streams_like_decode() {
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "hello"]
        .iter()
        .enumerate()
    {
        vocab.insert(t.to_string(), i.into());
    }
    for b in 0..=255u32 {
        vocab.insert(format!("<0x{b:02X}>"), (8 + b).into());
    }
    let tj = serde_json::json!({
        "version": "1.0",
        "added_tokens": [
            {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
        ],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"}
        ]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab, "merges": [["▁", "a"]]}
    });
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), tj.to_string()).unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true}"#,
    )
    .unwrap();
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    let ids = tok.encode("a €a", true).unwrap();
    assert_eq!(ids, vec![1, 4, 6 - 3, 8 + 0xE2, 8 + 0x82, 8 + 0xAC, 4]);
    assert_eq!(tok.decode(&ids, true).unwrap(), "a €a");
    let chunks = check_stream(&tok, &ids, false);
    assert!(chunks.iter().all(|c| !c.contains('\u{FFFD}')));

    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let bytes: Vec<u32> = (8..264).collect();
    let pieces = [
        8 + 0xE2,
        8 + 0x82,
        8 + 0xAC,
        8 + 0xF0,
        8 + 0x9F,
        8 + 0x98,
        8 + 0x80,
        4,
        6,
    ];
    for len in [1, 3, 6, 12, 30] {
        for _ in 0..100 {
            let ids = random_ids(&tok, &mut rng, len, &bytes, &pieces);
            check_stream(&tok, &ids, false);
            check_stream(&tok, &ids, true);
        }
    }
}
