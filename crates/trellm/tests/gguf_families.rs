//! GGUF files of every family, as llama.cpp's converter writes them: `tests/fixtures/gguf-tiny`,
//! made by `scripts/gguf_fixtures/make.py` from the tiny folders of `tests/fixtures/tiny` (CI only
//! reads the committed files), with llama.cpp's own outputs on them in `llama_cpp.json`.
//!
//! - Each converted F32 file gives the same greedy ids as its Hugging Face folder and logprobs
//!   within 1e-4 (top-20 at every step, the whole vocabulary at step 0).
//! - Tokenizer ids and chat renderings equal llama.cpp's on the same file.
//! - Quantized files: greedy ids and logprobs against llama.cpp's on the same file.
//! - Files whose metadata disagrees with their tensors fail with one line naming the key or tensor.

mod common;

use std::path::{Path, PathBuf};

use serde_json::Value;
use trellm_formats::gguf::{Array, Gguf, Value as Meta};
use trellm_tokenizer::{ChatMessage, Tokenizer};

const LOGPROB_TOL: f64 = 1e-4;
/// Past a step whose top-2 gap is below this, the choice is a coin toss.
const TIE_GAP: f64 = 1e-4;
const STEPS: usize = 12;

fn root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}
fn gguf_dir() -> PathBuf {
    root().join("tests/fixtures/gguf-tiny")
}

/// Families (fixture names) and what their HF folder's config.json must say to mean what the
/// GGUF means: a GGUF cannot carry gemma's `query_pre_attn_scalar` (llama.cpp scales by
/// head_dim^-0.5), gemma3's `sliding_window_pattern` (llama.cpp: 6) or smollm3's NoPE interval
/// (llama.cpp: 4), so those folders are compared with the values llama.cpp assumes.
fn families() -> Vec<(&'static str, Value)> {
    use serde_json::json;
    vec![
        ("llama", json!({})),
        ("llama-untied", json!({})),
        ("llama-rope-linear-bias", json!({})),
        ("llama-rope-llama3", json!({})),
        ("mistral", json!({})),
        ("qwen2", json!({})),
        ("qwen3", json!({})),
        ("gemma", json!({})),
        ("gemma2", json!({"query_pre_attn_scalar": 16})),
        (
            "gemma3",
            json!({"query_pre_attn_scalar": 16, "sliding_window_pattern": 6}),
        ),
        ("phi3", json!({})),
        ("olmo2", json!({})),
        ("granite", json!({})),
        ("smollm3", json!({"no_rope_layer_interval": 4})),
        ("starcoder2", json!({})),
    ]
}

fn read_json(p: &Path) -> Value {
    let t = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&t).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The HF folder of `name` with `patch` merged into its config.json.
fn hf_folder(name: &str, patch: &Value) -> (tempfile::TempDir, PathBuf) {
    let src = root().join("tests/fixtures/tiny").join(name);
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = read_json(&src.join("config.json"));
    for (k, v) in patch.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
    std::os::unix::fs::symlink(
        src.join("model.safetensors"),
        tmp.path().join("model.safetensors"),
    )
    .unwrap();
    let p = tmp.path().to_path_buf();
    (tmp, p)
}

/// `trellm generate` from `prompt`: (ids, per-step `[(id, logprob)]`).
type Run = (Vec<u64>, Vec<Vec<(u64, f64)>>);

fn generate(model: &Path, prompt: &[u64], steps: usize, top: usize) -> Run {
    let ids: Vec<String> = prompt.iter().map(|i| i.to_string()).collect();
    let (code, out, err) = common::run(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        &ids.join(","),
        "--max-tokens",
        &steps.to_string(),
        "--json",
        "--logprobs",
        &top.to_string(),
        "--quiet",
    ]);
    assert_eq!(code, 0, "{}: {err}", model.display());
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    let ids = v["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    let lps = v["logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(pairs)
        .collect();
    (ids, lps)
}

fn pairs(v: &Value) -> Vec<(u64, f64)> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
        .collect()
}

/// Compares `got` against `want` step by step: logprobs of `want`'s top tokens, and ids until
/// `want`'s first step whose top-2 gap is below `tie_gap`. Returns (max logprob difference, steps compared) or the first error.
fn compare(got: &Run, want: &Run, tol: f64, tie_gap: f64) -> Result<(f64, usize), String> {
    let mut worst = 0.0f64;
    for (s, want_top) in want.1.iter().enumerate() {
        let Some(got_top) = got.1.get(s) else {
            // A run may stop on an end-of-turn id the other side's vocabulary does not mark
            // (the HF folders have no tokenizer); every id up to there was equal.
            if s > 0 && got.0.len() == s {
                return Ok((worst, s));
            }
            return Err(format!("step {s}: no logprobs"));
        };
        let floor = got_top.last().map_or(f64::NEG_INFINITY, |p| p.1);
        for &(id, lp) in want_top {
            match got_top.iter().find(|p| p.0 == id) {
                Some(&(_, g)) => worst = worst.max((g - lp).abs()),
                // Outside our top-k only at its edge.
                None if lp <= floor + tol => {}
                None => return Err(format!("step {s}: token {id} ({lp}) missing")),
            }
        }
        if worst > tol {
            return Err(format!("step {s}: logprobs differ by {worst:.2e}"));
        }
        let gap = want_top[0].1 - want_top.get(1).map_or(f64::NEG_INFINITY, |p| p.1);
        if gap < tie_gap {
            return Ok((worst, s + 1));
        }
        if got.0.get(s) != want.0.get(s) {
            return Err(format!(
                "step {s}: greedy id {:?}, expected {:?} (ids {:?} vs {:?})",
                got.0.get(s),
                want.0.get(s),
                got.0,
                want.0
            ));
        }
    }
    Ok((worst, want.1.len()))
}

#[test]
fn converted_ggufs_match_their_hf_folders() {
    let mut failures = Vec::new();
    for (name, patch) in families() {
        let gguf = gguf_dir().join(format!("{name}.f32.gguf"));
        let (_tmp, hf) = hf_folder(name, &patch);
        let oracle = read_json(
            &root()
                .join("tests/fixtures/tiny")
                .join(name)
                .join("oracle.json"),
        );
        let mut worst = 0.0f64;
        for case in oracle["cases"].as_array().unwrap().iter().take(2) {
            let prompt: Vec<u64> = case["prompt_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            let want = generate(&hf, &prompt, STEPS, 20);
            let got = generate(&gguf, &prompt, STEPS, 20);
            match compare(&got, &want, LOGPROB_TOL, TIE_GAP) {
                Ok((d, _)) => worst = worst.max(d),
                Err(e) => failures.push(format!("{name}: {e}")),
            }
            // The whole vocabulary at step 0.
            let want = generate(&hf, &prompt, 1, 256);
            let got = generate(&gguf, &prompt, 1, 256);
            match compare(&got, &want, LOGPROB_TOL, TIE_GAP) {
                Ok((d, _)) => worst = worst.max(d),
                Err(e) => failures.push(format!("{name} (vocabulary): {e}")),
            }
        }
        eprintln!("{name}: GGUF vs HF folder, max logprob difference {worst:.2e}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn llama_cpp() -> Value {
    read_json(&gguf_dir().join("llama_cpp.json"))
}

#[test]
fn tokenizers_match_llama_cpp() {
    let rec = llama_cpp();
    let mut checked = 0;
    let mut failures = Vec::new();
    for (file, r) in rec["files"].as_object().unwrap() {
        if !file.ends_with(".f32.gguf") {
            continue;
        }
        let g = Gguf::open(&gguf_dir().join(file)).unwrap();
        let tok = Tokenizer::from_gguf(&g).unwrap();
        for t in r["tokenize"].as_array().unwrap() {
            let text = t["text"].as_str().unwrap();
            let add = t["add_special"].as_bool().unwrap();
            let want: Vec<u32> = t["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let got = tok.encode(text, add).unwrap();
            if got != want {
                failures.push(format!(
                    "{file}: {text:?} (add_special {add}): {got:?}, llama.cpp {want:?}"
                ));
            }
            checked += 1;
        }
        for c in r["chat"].as_array().unwrap() {
            let msgs: Vec<ChatMessage> = c["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| {
                    ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap())
                })
                .collect();
            let want = c["prompt"].as_str().unwrap();
            // llama-server drops a rendered leading BOS (its tokenizer adds one); so do we
            // before comparing.
            let bos = tok
                .bos_id()
                .and_then(|b| tok.id_to_token(b))
                .unwrap_or_default();
            match tok.apply_chat_template(&msgs, true) {
                Ok(got) if got == want || got.strip_prefix(bos.as_str()) == Some(want) => {}
                other => failures.push(format!("{file}: chat {other:?}, llama.cpp {want:?}")),
            }
            checked += 1;
        }
    }
    eprintln!("{checked} tokenizer and template cases against llama.cpp");
    assert!(checked > 100, "only {checked} cases");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// llama.cpp's CPU path computes in its own order and precision: on F32 files (f32 KV cache)
/// its logprobs differ from trellm's (and so from mlx-lm's) by up to 1.1e-2 on these models.
const LLAMA_CPP_F32_TOL: f64 = 2e-2;
/// On quantized files llama.cpp also rounds the activations to 8 bits before each quantized dot
/// product, where trellm keeps them exact; logprobs then differ by this much on these models.
const LLAMA_CPP_QUANT_TOL: f64 = 0.25;

#[test]
fn greedy_runs_match_llama_cpp() {
    let rec = llama_cpp();
    let mut failures = Vec::new();
    for (file, r) in rec["files"].as_object().unwrap() {
        let mut worst = (0.0f64, 0usize);
        for case in r["greedy"].as_array().unwrap() {
            let prompt: Vec<u64> = case["prompt_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            let steps = case["steps"].as_array().unwrap();
            let want: Run = (
                steps.iter().map(|s| s["id"].as_u64().unwrap()).collect(),
                steps.iter().map(|s| pairs(&s["top"])).collect(),
            );
            let got = generate(&gguf_dir().join(file), &prompt, want.0.len(), 20);
            let tol = if file.ends_with(".f32.gguf") {
                LLAMA_CPP_F32_TOL
            } else {
                LLAMA_CPP_QUANT_TOL
            };
            // Ids are compared until llama.cpp's first step whose top-2 gap is within the
            // tolerance (a near-tie for two computations that differ that much).
            match compare(&got, &want, tol, 2.0 * tol) {
                Ok((d, n)) => worst = (worst.0.max(d), worst.1 + n),
                Err(e) => failures.push(format!("{file}: {e}")),
            }
        }
        eprintln!(
            "{file}: against llama.cpp, {} steps compared, max logprob difference {:.2e}",
            worst.1, worst.0
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A copy of the fixture `name` with `edit` applied to its metadata and tensors.
fn rewrite(
    name: &str,
    edit: impl Fn(&str, &Meta) -> Option<Meta>,
    tensor: impl Fn(&str, &[u64]) -> Option<Vec<u64>>,
) -> Vec<u8> {
    let g = Gguf::open(&gguf_dir().join(format!("{name}.f32.gguf"))).unwrap();
    let mut w = common::GgufWriter::new();
    for (k, v) in &g.metadata {
        let Some(v) = edit(k, v) else { continue };
        w = match &v {
            Meta::U32(x) => w.u32(k, *x),
            Meta::F32(x) => w.f32(k, *x),
            Meta::Bool(x) => w.bool(k, *x),
            Meta::Str(x) => w.str(k, x),
            Meta::Array(Array::Str(a)) => {
                w.str_array(k, &a.iter().map(String::as_str).collect::<Vec<_>>())
            }
            Meta::Array(Array::I32(a)) => w.i32_array(k, a),
            Meta::Array(Array::F32(a)) => w.f32_array(k, a),
            other => panic!("{k}: no writer for {other:?}"),
        };
    }
    for t in &g.tensors {
        let Some(shape) = tensor(&t.name, &t.shape) else {
            continue;
        };
        let n: u64 = shape.iter().product();
        let mut data = g.data(t).to_vec();
        data.resize(n as usize * 4, 0);
        w = w.tensor(&t.name, &shape, 0, data);
    }
    w.bytes()
}

#[test]
fn ggufs_that_disagree_with_their_tensors_are_one_line_errors() {
    let keep = |_: &str, v: &Meta| Some(v.clone());
    let same = |_: &str, s: &[u64]| Some(s.to_vec());
    let set = |key: &'static str, v: Meta| {
        move |k: &str, old: &Meta| Some(if k == key { v.clone() } else { old.clone() })
    };
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "phi3 without a fused qkv",
            rewrite("phi3", keep, |n, s| {
                (n != "blk.1.attn_qkv.weight").then(|| s.to_vec())
            }),
            "blk.1.attn_qkv.weight",
        ),
        (
            "phi3 gate/up of half the rows",
            rewrite("phi3", keep, |n, s| {
                Some(if n == "blk.0.ffn_up.weight" {
                    vec![s[0], s[1] / 2]
                } else {
                    s.to_vec()
                })
            }),
            "blk.0.ffn_up.weight",
        ),
        (
            "qwen2 bias of the wrong length",
            rewrite("qwen2", keep, |n, s| {
                Some(if n == "blk.0.attn_k.bias" {
                    vec![s[0] + 1]
                } else {
                    s.to_vec()
                })
            }),
            "blk.0.attn_k.bias",
        ),
        (
            "starcoder2 without its norm bias",
            rewrite("starcoder2", keep, |n, s| {
                (n != "blk.0.ffn_norm.bias").then(|| s.to_vec())
            }),
            "blk.0.ffn_norm.bias",
        ),
        (
            "olmo2 without a post-norm",
            rewrite("olmo2", keep, |n, s| {
                (n != "blk.1.post_ffw_norm.weight").then(|| s.to_vec())
            }),
            "blk.1.post_ffw_norm.weight",
        ),
        (
            "qwen3 heads that do not group",
            rewrite("qwen3", set("qwen3.attention.head_count_kv", Meta::U32(3)), same),
            "qwen3.attention.head_count_kv",
        ),
        (
            "gemma2 with more heads than its tensors",
            rewrite("gemma2", set("gemma2.attention.head_count", Meta::U32(8)), same),
            "blk.0.attn_q.weight",
        ),
        (
            "granite with an absurd layer count",
            rewrite("granite", set("granite.block_count", Meta::U32(1 << 30)), same),
            "granite.block_count",
        ),
        (
            "gemma3 with an absurd hidden size",
            rewrite("gemma3", set("gemma3.embedding_length", Meta::U32(u32::MAX)), same),
            "gemma3.embedding_length",
        ),
        (
            "qwen3 with an absurd head dimension",
            rewrite("qwen3", set("qwen3.attention.key_length", Meta::U32(1 << 30)), same),
            "qwen3.attention.key_length",
        ),
        (
            "phi3 with RoPE factors of the wrong length",
            rewrite("phi3", keep, |n, s| {
                Some(if n == "rope_factors_long.weight" {
                    vec![s[0] + 2]
                } else {
                    s.to_vec()
                })
            }),
            "rope_factors_long.weight",
        ),
        (
            "an unknown architecture",
            rewrite("llama", set("general.architecture", Meta::Str("mamba".into())), same),
            "supported in GGUF: llama, qwen2, qwen3, gemma, gemma2, gemma3, phi3, olmo2, granite, smollm3, starcoder2",
        ),
    ];
    for (i, (what, bytes, needle)) in cases.iter().enumerate() {
        let p = dir.path().join(format!("bad{i}.gguf"));
        std::fs::write(&p, bytes).unwrap();
        eprintln!("{what}");
        common::assert_clean_error(
            &[
                "generate",
                "--model",
                p.to_str().unwrap(),
                "--prompt-ids",
                "1",
                "--max-tokens",
                "1",
            ],
            needle,
        );
    }
}
