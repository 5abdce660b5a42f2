//! The repository's mlx-lm goldens: chat rendering, prompt ids and decoded continuations.

mod common;

use common::{gemma, goldens, ids, smollm2};
use trellm_tokenizer::ChatMessage;

const SMOL_DEFAULT_SYSTEM: &str =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

/// `<|im_start|>role\ncontent<|im_end|>\n` blocks of a rendered ChatML prompt, without the
/// trailing generation prompt.
fn parse_chatml(text: &str) -> Option<Vec<ChatMessage>> {
    let body = text.strip_suffix("<|im_start|>assistant\n")?;
    let mut out = Vec::new();
    for block in body.split("<|im_start|>").skip(1) {
        let block = block.strip_suffix("<|im_end|>\n")?;
        let (role, content) = block.split_once('\n')?;
        out.push(ChatMessage::new(role, content));
    }
    Some(out)
}

#[test]
fn smollm2_goldens() {
    let tok = smollm2();
    let g = goldens("smollm2-135m-instruct");
    let mut templated = 0;
    for case in g["cases"].as_array().unwrap() {
        let id = case["id"].as_str().unwrap();
        let text = case["prompt_text"].as_str().unwrap();
        assert_eq!(
            tok.encode(text, false).unwrap(),
            ids(&case["prompt_ids"]),
            "prompt ids of {id}"
        );
        if let Some(mut msgs) = parse_chatml(text) {
            // The template inserts the default system prompt itself when the chat has none.
            if msgs[0].role == "system" && msgs[0].content == SMOL_DEFAULT_SYSTEM {
                msgs.remove(0);
            }
            assert_eq!(
                tok.apply_chat_template(&msgs, true).unwrap(),
                text,
                "template of {id}"
            );
            templated += 1;
        }
        if let Some(want) = case["greedy_text"].as_str() {
            assert_eq!(
                tok.decode(&ids(&case["greedy_ids"]), false).unwrap(),
                want,
                "greedy text of {id}"
            );
        }
    }
    assert!(templated >= 4, "expected the chat cases to be checked");
}

#[test]
fn gemma_goldens() {
    let tok = gemma();
    let g = goldens("gemma-3-270m");
    for case in g["cases"].as_array().unwrap() {
        let id = case["id"].as_str().unwrap();
        let text = case["prompt_text"].as_str().unwrap();
        assert_eq!(
            tok.encode(text, true).unwrap(),
            ids(&case["prompt_ids"]),
            "prompt ids of {id}"
        );
        if let Some(want) = case["greedy_text"].as_str() {
            assert_eq!(
                tok.decode(&ids(&case["greedy_ids"]), false).unwrap(),
                want,
                "greedy text of {id}"
            );
        }
    }
}

#[test]
fn model_facts() {
    let s = smollm2();
    assert_eq!(s.vocab_size(), 49152);
    assert_eq!(s.bos_id(), Some(1));
    assert!(!s.add_bos());
    assert_eq!(s.eos_ids()[0], 2);
    assert!(
        s.eos_ids().contains(&0),
        "<|endoftext|> ends generation too"
    );
    assert!(s.has_chat_template());
    assert_eq!(s.token_to_id("<|im_end|>"), Some(2));
    assert_eq!(
        s.encode("hi", true).unwrap(),
        s.encode("hi", false).unwrap()
    );

    let g = gemma();
    assert_eq!(g.vocab_size(), 262144);
    assert_eq!(g.bos_id(), Some(2));
    assert!(g.add_bos());
    assert_eq!(g.eos_ids(), &[1, 106]);
    assert!(!g.has_chat_template());
    assert!(g
        .apply_chat_template(&[ChatMessage::new("user", "hi")], true)
        .is_err());
    assert_eq!(g.token_to_id("<end_of_turn>"), Some(106));
    assert_eq!(g.encode("", true).unwrap(), vec![2]);
    assert_eq!(g.encode("", false).unwrap(), Vec::<u32>::new());
}

#[test]
fn gemma_builds_fast() {
    let g = trellm_formats::gguf::Gguf::open(&common::model_path("gemma-3-270m")).unwrap();
    let t0 = std::time::Instant::now();
    let tok = trellm_tokenizer::Tokenizer::from_gguf(&g).unwrap();
    let build = t0.elapsed();
    let t1 = std::time::Instant::now();
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(200);
    let ids = tok.encode(&text, true).unwrap();
    let enc = t1.elapsed();
    eprintln!(
        "gemma tokenizer: built in {build:?}; {} ids from {} bytes in {enc:?}",
        ids.len(),
        text.len()
    );
    // About 0.1 s in release; generous for loaded CI machines.
    assert!(build.as_secs_f64() < 3.0, "building took {build:?}");
}
