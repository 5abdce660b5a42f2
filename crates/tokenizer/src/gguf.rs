//! Tokenizers from GGUF metadata (`tokenizer.ggml.*`).

use std::collections::BTreeMap;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};
use trellm_formats::gguf::Gguf;

use crate::spm::{Kind, Spm};
use crate::template::ChatTemplate;
use crate::{backend_err, Backend, Tokenizer, TokenizerError};

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// End-of-turn markers that stop generation when the vocabulary has them as control tokens
/// (the same names llama.cpp treats as end-of-generation).
const END_OF_TURN: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
];

fn id_key(g: &Gguf, key: &str, n: usize) -> Option<u32> {
    let id = g.get_u64(key)?;
    // Some converters write -1 / out-of-range ids for "none".
    (id < n as u64).then_some(id as u32)
}

fn flag(g: &Gguf, key: &str) -> Option<bool> {
    g.get(key).and_then(|v| v.as_bool())
}

pub(crate) fn load(g: &Gguf) -> Result<Tokenizer, TokenizerError> {
    let model = g
        .get_str("tokenizer.ggml.model")
        .ok_or_else(|| TokenizerError::Invalid("GGUF has no tokenizer.ggml.model".into()))?;
    if !matches!(model, "gpt2" | "llama") {
        return Err(TokenizerError::Unsupported(format!(
            "GGUF tokenizer.ggml.model = '{}' (supported: \"gpt2\" byte-level BPE, \"llama\" SentencePiece)",
            trellm_formats::quote(model)
        )));
    }
    let tokens = g.get_str_array("tokenizer.ggml.tokens").ok_or_else(|| {
        TokenizerError::Invalid("GGUF has no tokenizer.ggml.tokens string array".into())
    })?;
    let n = tokens.len();
    let types = match g.get_i64_array("tokenizer.ggml.token_type") {
        Some(t) if t.len() == n => t,
        Some(t) => {
            return Err(TokenizerError::Invalid(format!(
                "tokenizer.ggml.token_type has {} entries for {n} tokens",
                t.len()
            )))
        }
        None => vec![1; n],
    };
    let bos = id_key(g, "tokenizer.ggml.bos_token_id", n);
    let eos = id_key(g, "tokenizer.ggml.eos_token_id", n);
    let unk = id_key(g, "tokenizer.ggml.unknown_token_id", n);
    let pad = id_key(g, "tokenizer.ggml.padding_token_id", n);
    let spm = model == "llama";
    // llama.cpp's defaults when the flags are missing.
    let add_bos = flag(g, "tokenizer.ggml.add_bos_token").unwrap_or(spm);
    let add_eos = flag(g, "tokenizer.ggml.add_eos_token").unwrap_or(false);

    let backend = if spm {
        let scores = match g.get_f32_array("tokenizer.ggml.scores") {
            Some(s) if s.len() == n => s,
            _ => {
                return Err(TokenizerError::Invalid(
                    "SentencePiece GGUF needs tokenizer.ggml.scores with one score per token"
                        .into(),
                ))
            }
        };
        let kinds = tokens
            .iter()
            .zip(&types)
            .map(|(p, &t)| Kind::from_gguf(t, p))
            .collect();
        let pieces = tokens.iter().map(|s| s.to_string()).collect();
        let add_space_prefix = flag(g, "tokenizer.ggml.add_space_prefix").unwrap_or(true);
        Backend::Spm(Box::new(Spm::new(
            pieces,
            scores,
            kinds,
            add_space_prefix,
            unk,
        )?))
    } else {
        let pre = g.get_str("tokenizer.ggml.pre").unwrap_or("(missing)");
        Backend::Hf {
            tok: Box::new(byte_level_bpe(g, &tokens, &types, pre)?),
            byte_fallback: false,
            post_process: false,
        }
    };

    let mut eos_ids: Vec<u32> = Vec::new();
    let mut add_eos_id = |id: Option<u32>| {
        if let Some(id) = id {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
    };
    add_eos_id(eos);
    add_eos_id(id_key(g, "tokenizer.ggml.eot_token_id", n));
    add_eos_id(id_key(g, "tokenizer.ggml.eom_token_id", n));
    for (id, (t, &ty)) in tokens.iter().zip(&types).enumerate() {
        if ty == 3 && END_OF_TURN.contains(t) {
            add_eos_id(Some(id as u32));
        }
    }

    let template = g.get_str("tokenizer.chat_template").map(|src| {
        let mut vars = BTreeMap::new();
        for (name, id) in [
            ("bos_token", bos),
            ("eos_token", eos),
            ("unk_token", unk),
            ("pad_token", pad),
        ] {
            if let Some(id) = id {
                vars.insert(name.to_string(), tokens[id as usize].to_string());
            }
        }
        ChatTemplate::new(src, vars)
    });

    Ok(Tokenizer {
        backend,
        bos,
        eos,
        eos_ids,
        add_bos,
        add_eos,
        template,
    })
}

/// GPT-2 style byte-level BPE; the pre-tokenizer follows `tokenizer.ggml.pre`.
fn byte_level_bpe(
    g: &Gguf,
    tokens: &[&str],
    types: &[i64],
    pre: &str,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let merges = g
        .get_str_array("tokenizer.ggml.merges")
        .ok_or_else(|| TokenizerError::Invalid("BPE GGUF has no tokenizer.ggml.merges".into()))?;
    let merges: Vec<(String, String)> = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| {
                    TokenizerError::Invalid(format!(
                        "malformed merge '{}'",
                        trellm_formats::quote(m)
                    ))
                })
        })
        .collect::<Result<_, _>>()?;
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(backend_err)?;
    let byte_level = || ByteLevel::new(false, true, true);
    let split = |re: &str| -> Result<Vec<PreTokenizerWrapper>, TokenizerError> {
        let s = Split::new(
            SplitPattern::Regex(re.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(backend_err)?;
        Ok(vec![s.into(), ByteLevel::new(false, true, false).into()])
    };
    // Grouped as llama.cpp groups `tokenizer.ggml.pre` values that share a split regex.
    let pre_tok: PreTokenizerWrapper = match pre {
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" => {
            Sequence::new(vec![Digits::new(true).into(), byte_level().into()]).into()
        }
        "gpt-2" | "gpt2" | "mpt" | "olmo" | "jais" => byte_level().into(),
        "llama-bpe" | "llama3" | "llama-v3" | "dbrx" | "smaug-bpe" | "falcon3" => {
            Sequence::new(split(LLAMA3_SPLIT)?).into()
        }
        "qwen2" | "stablelm2" | "deepseek-r1-qwen" => Sequence::new(split(QWEN2_SPLIT)?).into(),
        other => {
            return Err(TokenizerError::Unsupported(format!(
            "GGUF BPE pre-tokenizer '{}' (supported: smollm/starcoder-like, gpt-2, llama3, qwen2)",
            trellm_formats::quote(other)
        )))
        }
    };
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(pre_tok));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    let special: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .filter(|(_, &t)| t == 3)
        .map(|(t, _)| AddedToken::from(t.to_string(), true).normalized(false))
        .collect();
    let user: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .filter(|(_, &t)| t == 4)
        .map(|(t, _)| AddedToken::from(t.to_string(), false).normalized(false))
        .collect();
    tok.add_special_tokens(special).map_err(backend_err)?;
    tok.add_tokens(user).map_err(backend_err)?;
    Ok(tok)
}
