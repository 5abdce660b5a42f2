//! Mutation fuzzing of every reader of untrusted files, bounded in time so it runs in CI:
//! the GGUF reader (through config, tokenizer, weights and a forward pass), the safetensors
//! header, the shard index, `config.json` (through weights and a forward pass),
//! `tokenizer.json` and chat-message files.
//!
//! Each target replays `tests/fixtures/fuzz/regressions/<target>/` (inputs that once failed),
//! then its seed corpus (`tests/fixtures/fuzz/<target>/` and the fixtures named below), then
//! mutates seeds for `TRELLM_FUZZ_SECS` seconds (default 4) with a seeded RNG
//! (`TRELLM_FUZZ_SEED`, default 1, so a run is reproducible). Every input must give Ok or Err:
//! a panic fails the test and saves the input under the target directory, ready to become a
//! regression file; the process runs under an address-space limit, so a runaway allocation
//! aborts the test instead of passing.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use common::mutate::{self, FuzzRng};
use common::*;
use rand::Rng;
use trellm::backend::cpu::CpuModel;
use trellm::backend::SoloSequence;
use trellm::model::weights::{TensorSource, Weights};
use trellm::model::ModelConfig;
use trellm_formats::gguf::Gguf;
use trellm_formats::safetensors::SafeTensors;
use trellm_model::Want;
use trellm_tokenizer::{ChatMessage, Tokenizer};

/// Address space this test process may use: far above what the small inputs need, far below
/// what a size read from a corrupt file could ask for.
const FUZZ_RLIMIT_AS: u64 = 12 << 30;

fn limit_memory() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let lim = libc::rlimit {
            rlim_cur: FUZZ_RLIMIT_AS,
            rlim_max: FUZZ_RLIMIT_AS,
        };
        // SAFETY: setrlimit with a valid struct only changes this process's limit.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) }, 0);
    });
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|r| {
            r.flatten()
                .map(|e| e.path())
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn env_u64(k: &str, default: u64) -> u64 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One input: the seed it came from (an index into the seeds) and its bytes.
struct Input {
    seed: usize,
    bytes: Vec<u8>,
}

/// Runs `check` on the regressions, the seeds, then mutants until the time budget is spent.
/// `check` returns whether the input was accepted (Ok) or refused (Err); it must not panic.
fn fuzz(
    target: &str,
    seeds: &[Vec<u8>],
    mutate: impl Fn(&mut FuzzRng, usize, &[u8]) -> Vec<u8>,
    check: impl Fn(&Input) -> bool,
) {
    limit_memory();
    let budget = Duration::from_secs(env_u64("TRELLM_FUZZ_SECS", 4));
    let base = env_u64("TRELLM_FUZZ_SEED", 1);
    let failures = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz-failures");
    let run = |input: &Input, what: &str| -> bool {
        match catch_unwind(AssertUnwindSafe(|| check(input))) {
            Ok(accepted) => accepted,
            Err(_) => {
                std::fs::create_dir_all(&failures).unwrap();
                let p = failures.join(format!("{target}-{what}.bin"));
                std::fs::write(&p, &input.bytes).unwrap();
                panic!(
                    "fuzz target {target}: input {what} (from seed {}) panicked; saved to {} \
                     (copy it to tests/fixtures/fuzz/regressions/{target}/ once fixed)",
                    input.seed,
                    p.display()
                );
            }
        }
    };
    let mut counts = [0usize; 2];
    // Regression files name their seed as `<seed index>-<anything>`.
    for p in files_in(&fixtures().join("fuzz/regressions").join(target)) {
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let seed = name
            .split('-')
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
            % seeds.len();
        let input = Input {
            seed,
            bytes: std::fs::read(&p).unwrap(),
        };
        counts[run(&input, &name) as usize] += 1;
    }
    for (i, s) in seeds.iter().enumerate() {
        let input = Input {
            seed: i,
            bytes: s.clone(),
        };
        assert!(
            run(&input, &format!("seed{i}")),
            "fuzz target {target}: seed {i} is refused"
        );
        counts[1] += 1;
    }
    let t0 = Instant::now();
    let mut n = 0u64;
    while t0.elapsed() < budget {
        let mut rng = mutate::rng(base.wrapping_mul(0x9e37_79b9) ^ n ^ (target.len() as u64) << 40);
        let seed = rng.gen_range(0..seeds.len());
        let input = Input {
            seed,
            bytes: mutate(&mut rng, seed, &seeds[seed]),
        };
        counts[run(&input, &format!("case{n}-seed{base}")) as usize] += 1;
        n += 1;
    }
    eprintln!(
        "fuzz {target}: {} inputs ({n} mutants) in {:.1}s: {} accepted, {} refused, 0 panics",
        counts[0] + counts[1],
        t0.elapsed().as_secs_f64(),
        counts[1],
        counts[0]
    );
    assert!(n > 0, "fuzz target {target} ran no mutants");
}

/// A read-only anonymous map of `len` bytes (at least `b`'s) starting with `b`, as a file's
/// map would; the pages past `b` stay zero and cost nothing until read.
fn anon_map(b: &[u8], len: usize) -> Arc<memmap2::Mmap> {
    let mut m = memmap2::MmapMut::map_anon(len.max(b.len()).max(1)).unwrap();
    m[..b.len()].copy_from_slice(b);
    Arc::new(m.make_read_only().unwrap())
}

/// Loads the weights and runs two tokens through the decoder: a config that passed validation
/// and weights that matched it must never panic in a forward pass.
fn run_model(cfg: ModelConfig, src: &TensorSource) -> bool {
    let Ok(w) = Weights::load(src, &cfg) else {
        return false;
    };
    let vocab = cfg.vocab;
    let d = CpuModel::new(cfg, w);
    let mut seq = SoloSequence::new(&d, 2).unwrap();
    let logits = seq
        .forward(&[0, (vocab as u32 - 1).min(5)], Want::Last)
        .unwrap();
    assert_eq!(logits.len(), vocab);
    true
}

fn exercise_tokenizer(t: &Tokenizer) {
    for text in [
        "Hello the world",
        "",
        "<|im_start|>x\u{1b}[0m\u{fffd}\n\t  in",
        "日本語 🙂",
    ] {
        if let Ok(ids) = t.encode(text, true) {
            let _ = t.decode(&ids, false);
            let mut s = t.stream_decoder();
            for &id in &ids {
                let _ = s.push(id);
            }
            let _ = s.finish();
        }
    }
    for id in [0u32, 1, 255, 256, u32::MAX] {
        let _ = t.decode(&[id], true);
        let _ = t.id_to_token(id);
    }
    if t.has_chat_template() {
        let msgs = [ChatMessage {
            role: "user".into(),
            content: "hi".into(),
        }];
        let _ = t.apply_chat_template(&msgs, true);
    }
}

/// `b` is a GGUF's first bytes, `len` its length (zeros after `b`).
fn check_gguf(b: &[u8], len: usize) -> bool {
    let Ok(g) = Gguf::parse(anon_map(b, len)) else {
        return false;
    };
    let cfg = ModelConfig::from_gguf(&g);
    // Real headers: no tokenizer (a 49k-token vocabulary takes long to build).
    if b.len() < 1 << 20 {
        if let Ok(t) = Tokenizer::from_gguf(&g) {
            exercise_tokenizer(&t);
        }
    }
    match cfg {
        Ok(cfg) => run_model(cfg, &TensorSource::Gguf(g)),
        Err(_) => false,
    }
}

/// The header of the real SmolLM2 file (metadata with its 49k-token vocabulary, tensor
/// table) and the file's length: checked with zero weights after it.
fn real_gguf_header() -> (Vec<u8>, usize) {
    let real = std::fs::read(model_path("smollm2-135m-instruct")).unwrap();
    let l = mutate::gguf_layout(&real);
    (real[..l.data_start].to_vec(), real.len())
}

#[test]
fn fuzz_gguf() {
    let mut seeds: Vec<Vec<u8>> = files_in(&fixtures().join("fuzz/gguf"))
        .iter()
        .map(|p| std::fs::read(p).unwrap())
        .collect();
    assert!(!seeds.is_empty());
    let (real, real_len) = real_gguf_header();
    let layouts: Vec<_> = seeds.iter().map(|s| mutate::gguf_layout(s)).collect();
    let real_layout = mutate::gguf_layout(&real);
    seeds.push(real);
    let n_small = layouts.len();
    fuzz(
        "gguf",
        &seeds,
        |rng, i, s| {
            // The real header rarely (it is slow to parse); aim most edits at the layout.
            let i = if i >= n_small && rng.gen_bool(0.8) {
                0
            } else {
                i
            };
            let s = if i >= n_small { s } else { &seeds[i] };
            let l = layouts.get(i).unwrap_or(&real_layout);
            let mut b = s.to_vec();
            for _ in 0..rng.gen_range(1..=3) {
                if rng.gen_bool(0.8) {
                    let (_, pos) = mutate::gguf_target(rng, l);
                    mutate::mutate_at(rng, &mut b, Some(pos));
                } else {
                    mutate::mutate_at(rng, &mut b, None);
                }
            }
            b
        },
        |input| {
            let len = if input.seed >= n_small { real_len } else { 0 };
            check_gguf(&input.bytes, len)
        },
    );
}

/// The tiny llama folder: its config and its safetensors bytes.
fn tiny_llama() -> (serde_json::Value, Vec<u8>) {
    let dir = fixtures().join("tiny/llama");
    let cfg = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    (cfg, std::fs::read(dir.join("model.safetensors")).unwrap())
}

/// A fresh folder per thread, reused across inputs.
fn scratch() -> PathBuf {
    thread_local! {
        static DIR: tempfile::TempDir = tempfile::tempdir().unwrap();
    }
    DIR.with(|d| d.path().to_path_buf())
}

#[test]
fn fuzz_safetensors_header() {
    let (cfg_json, st) = tiny_llama();
    let cfg = ModelConfig::from_hf(&cfg_json, None).unwrap();
    let header_len = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&st[8..8 + header_len]).unwrap();
    fuzz(
        "safetensors",
        std::slice::from_ref(&st),
        |rng, _, s| {
            let mut b;
            if rng.gen_bool(0.5) {
                // A structurally edited header, with its length updated (or not).
                let h = mutate::mutate_json(rng, &header);
                let len = if rng.gen_bool(0.9) {
                    h.len() as u64
                } else {
                    header_len as u64
                };
                b = len.to_le_bytes().to_vec();
                b.extend(&h);
                b.extend(&s[8 + header_len..]);
            } else {
                b = s.to_vec();
                for _ in 0..rng.gen_range(1..=3) {
                    let pos = rng.gen_range(0..8 + header_len);
                    mutate::mutate_at(rng, &mut b, Some(pos));
                }
            }
            b
        },
        |input| {
            let dir = scratch();
            std::fs::write(dir.join("model.safetensors"), &input.bytes).unwrap();
            match SafeTensors::open(&dir) {
                Ok(st) => run_model(cfg.clone(), &TensorSource::SafeTensors(st)),
                Err(_) => false,
            }
        },
    );
}

#[test]
fn fuzz_safetensors_index() {
    let (cfg_json, st) = tiny_llama();
    let cfg = ModelConfig::from_hf(&cfg_json, None).unwrap();
    let seeds: Vec<Vec<u8>> = files_in(&fixtures().join("fuzz/index"))
        .iter()
        .map(|p| std::fs::read(p).unwrap())
        .collect();
    let parsed: Vec<serde_json::Value> = seeds
        .iter()
        .map(|s| serde_json::from_slice(s).unwrap())
        .collect();
    fuzz(
        "index",
        &seeds,
        |rng, i, _| {
            let mut v = parsed[i].clone();
            // Shard names are what an index can abuse: aim half the edits there.
            if rng.gen_bool(0.5) {
                let names = [
                    "../model.safetensors",
                    "/etc/passwd",
                    "sub/../../x.safetensors",
                    "",
                    "model.safetensors\u{0}",
                    "./model.safetensors",
                    "C:\\x.safetensors",
                    "nested/model.safetensors",
                ];
                let m = v["weight_map"].as_object_mut().unwrap();
                let k = m.keys().nth(rng.gen_range(0..m.len())).unwrap().clone();
                m[&k] = names[rng.gen_range(0..names.len())].into();
                return serde_json::to_vec(&v).unwrap();
            }
            mutate::mutate_json(rng, &v)
        },
        |input| {
            let dir = scratch().join("index");
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("model.safetensors"), &st).unwrap();
            std::fs::write(dir.join("model.safetensors.index.json"), &input.bytes).unwrap();
            match SafeTensors::open(&dir) {
                Ok(s) => {
                    for (p, _) in &s.shards {
                        let rel = p.strip_prefix(&dir).expect("shard outside the folder");
                        assert!(
                            rel.components()
                                .all(|c| matches!(c, std::path::Component::Normal(_))),
                            "shard {} escapes the folder",
                            p.display()
                        );
                    }
                    run_model(cfg.clone(), &TensorSource::SafeTensors(s))
                }
                Err(_) => false,
            }
        },
    );
}

#[test]
fn fuzz_config_json() {
    // Every family's tiny folder and the EXL3 ones: its config.json is the seed, its tensors
    // check the result.
    let dirs: Vec<PathBuf> = {
        // And the EXL3 folders (trellis weights, quantization_config).
        let mut v: Vec<PathBuf> = ["tiny", "exl3/tiny-llama"]
            .iter()
            .flat_map(|d| std::fs::read_dir(fixtures().join(d)).unwrap().flatten())
            .map(|e| e.path())
            .filter(|p| p.join("config.json").exists())
            .collect();
        v.sort();
        v
    };
    let seeds: Vec<Vec<u8>> = dirs
        .iter()
        .map(|d| std::fs::read(d.join("config.json")).unwrap())
        .collect();
    let parsed: Vec<serde_json::Value> = seeds
        .iter()
        .map(|s| serde_json::from_slice(s).unwrap())
        .collect();
    let tensors: Vec<Arc<TensorSource>> = dirs
        .iter()
        .map(|d| Arc::new(TensorSource::SafeTensors(SafeTensors::open(d).unwrap())))
        .collect();
    fuzz(
        "config",
        &seeds,
        |rng, i, _| mutate::mutate_json(rng, &parsed[i]),
        |input| {
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&input.bytes) else {
                return false;
            };
            match ModelConfig::from_hf(&v, None) {
                Ok(cfg) => run_model(cfg, &tensors[input.seed]),
                Err(_) => false,
            }
        },
    );
}

#[test]
fn fuzz_tokenizer_json() {
    let dir = fixtures().join("exl3/tiny-llama/mul1-3.0");
    let seed = std::fs::read(dir.join("tokenizer.json")).unwrap();
    let tok_cfg = std::fs::read(dir.join("tokenizer_config.json")).unwrap();
    let parsed: serde_json::Value = serde_json::from_slice(&seed).unwrap();
    fuzz(
        "tokenizer",
        &[seed],
        |rng, _, s| {
            if rng.gen_bool(0.8) {
                mutate::mutate_json(rng, &parsed)
            } else {
                let mut b = s.to_vec();
                mutate::mutate_bytes(rng, &mut b);
                b
            }
        },
        |input| {
            let d = scratch().join("tok");
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("tokenizer.json"), &input.bytes).unwrap();
            std::fs::write(d.join("tokenizer_config.json"), &tok_cfg).unwrap();
            match Tokenizer::from_hf_dir(&d) {
                Ok(t) => {
                    exercise_tokenizer(&t);
                    true
                }
                Err(_) => false,
            }
        },
    );
}

#[test]
fn fuzz_chat_messages() {
    let g = Gguf::open(&model_path("smollm2-135m-instruct")).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let seeds: Vec<Vec<u8>> = files_in(&fixtures().join("fuzz/messages"))
        .iter()
        .map(|p| std::fs::read(p).unwrap())
        .collect();
    let parsed: Vec<serde_json::Value> = seeds
        .iter()
        .map(|s| serde_json::from_slice(s).unwrap())
        .collect();
    fuzz(
        "messages",
        &seeds,
        |rng, i, _| mutate::mutate_json(rng, &parsed[i]),
        |input| {
            // What `generate --messages` does with the file.
            let Ok(msgs) = serde_json::from_slice::<Vec<ChatMessage>>(&input.bytes) else {
                return false;
            };
            if msgs.is_empty() {
                return false;
            }
            match tok.apply_chat_template(&msgs, true) {
                Ok(text) => tok.encode(&text, false).is_ok(),
                Err(_) => false,
            }
        },
    );
}

/// Rewrites the generated part of the seed corpus (`cargo test --test fuzz -- --ignored`).
#[test]
#[ignore]
fn write_seed_corpus() {
    let f = fixtures().join("fuzz");
    std::fs::create_dir_all(f.join("gguf")).unwrap();
    std::fs::write(f.join("gguf/tiny-llama.gguf"), tiny_llama_gguf()).unwrap();
    let (_, st) = tiny_llama();
    let header_len = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&st[8..8 + header_len]).unwrap();
    let map: serde_json::Map<String, serde_json::Value> = header
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .map(|k| (k.clone(), "model.safetensors".into()))
        .collect();
    let index = serde_json::json!({"metadata": {"total_size": st.len()}, "weight_map": map});
    std::fs::create_dir_all(f.join("index")).unwrap();
    std::fs::write(
        f.join("index/model.safetensors.index.json"),
        serde_json::to_string_pretty(&index).unwrap(),
    )
    .unwrap();
}
