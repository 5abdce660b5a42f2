#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use trellm_tokenizer::Tokenizer;

/// Local path of a test model, fetched into the trellm cache by the hub on first use.
pub fn model_path(alias: &str) -> PathBuf {
    trellm_hub::resolve_model(alias, false)
        .unwrap_or_else(|e| panic!("cannot get model {alias}: {e:#}"))
}

pub fn load_gguf(alias: &str) -> Tokenizer {
    let g = trellm_formats::gguf::Gguf::open(&model_path(alias)).expect("open GGUF");
    Tokenizer::from_gguf(&g).expect("tokenizer from GGUF")
}

/// SmolLM2-135M-Instruct's tokenizer (byte-level BPE), built once per test binary.
pub fn smollm2() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| load_gguf("smollm2-135m-instruct"))
}

/// Gemma-3-270m's tokenizer (SentencePiece, 262144 pieces), built once per test binary.
pub fn gemma() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| load_gguf("gemma-3-270m"))
}

pub fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

pub fn fixture(rel: &str) -> PathBuf {
    crate_dir().join("tests/fixtures").join(rel)
}

/// The repository's mlx-lm goldens for a model alias.
pub fn goldens(alias: &str) -> serde_json::Value {
    let p = crate_dir()
        .join("../../tests/fixtures/goldens")
        .join(alias)
        .join("greedy.json");
    let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&s).expect("golden JSON")
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}
