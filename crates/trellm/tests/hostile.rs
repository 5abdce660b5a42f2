//! Hostile files and careless flags, one class at a time: impossible values in real files,
//! error messages that quote files, flags checked before loading, closed and full outputs,
//! paths out of the model folder, and the everyday CLI habits.

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use common::*;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// Where the value of metadata `key` starts in a GGUF file (after its key and type).
fn gguf_value_pos(bytes: &[u8], key: &str) -> usize {
    let l = common::mutate::gguf_layout(bytes);
    for (start, _) in l.kv {
        let n = u64::from_le_bytes(bytes[start..start + 8].try_into().unwrap()) as usize;
        if &bytes[start + 8..start + 8 + n] == key.as_bytes() {
            return start + 8 + n + 4;
        }
    }
    panic!("no key {key}");
}

/// A copy of the real SmolLM2 file that tests patch in place and restore.
struct Patchable {
    _dir: tempfile::TempDir,
    path: PathBuf,
    bytes: Vec<u8>,
}

impl Patchable {
    fn smollm2() -> Self {
        let dir = tmp();
        let path = dir.path().join("smollm2.gguf");
        let src = model_path("smollm2-135m-instruct");
        std::fs::copy(&src, &path).unwrap();
        Patchable {
            _dir: dir,
            path,
            bytes: std::fs::read(&src).unwrap(),
        }
    }
    /// Runs `check` with `new` written over the value of `key`, then restores the file.
    fn with(&self, key: &str, new: &[u8], check: impl FnOnce(&str)) {
        let pos = gguf_value_pos(&self.bytes, key);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&self.path)
            .unwrap();
        f.write_all_at(new, pos as u64).unwrap();
        check(self.path.to_str().unwrap());
        f.write_all_at(&self.bytes[pos..pos + new.len()], pos as u64)
            .unwrap();
    }
}

#[test]
fn impossible_values_in_the_real_gguf_are_errors() {
    let p = Patchable::smollm2();
    let cases: &[(&str, Vec<u8>, &str)] = &[
        (
            "llama.attention.layer_norm_rms_epsilon",
            (-1e-5f32).to_le_bytes().to_vec(),
            "epsilon",
        ),
        (
            "llama.attention.layer_norm_rms_epsilon",
            f32::NAN.to_le_bytes().to_vec(),
            "epsilon",
        ),
        (
            "llama.attention.layer_norm_rms_epsilon",
            0f32.to_le_bytes().to_vec(),
            "epsilon",
        ),
        (
            "llama.rope.freq_base",
            0f32.to_le_bytes().to_vec(),
            "RoPE base",
        ),
        (
            "llama.rope.freq_base",
            f32::INFINITY.to_le_bytes().to_vec(),
            "RoPE base",
        ),
        (
            "llama.rope.freq_base",
            (-10000f32).to_le_bytes().to_vec(),
            "RoPE base",
        ),
        (
            "llama.block_count",
            u32::MAX.to_le_bytes().to_vec(),
            "block_count",
        ),
        (
            "llama.block_count",
            0u32.to_le_bytes().to_vec(),
            "block_count",
        ),
        (
            "llama.attention.head_count",
            0u32.to_le_bytes().to_vec(),
            "heads",
        ),
        (
            "llama.attention.head_count",
            7u32.to_le_bytes().to_vec(),
            "heads",
        ),
        (
            "llama.attention.head_count_kv",
            0u32.to_le_bytes().to_vec(),
            "heads",
        ),
        (
            "llama.context_length",
            0u32.to_le_bytes().to_vec(),
            "context",
        ),
        (
            "llama.embedding_length",
            (1u32 << 30).to_le_bytes().to_vec(),
            "hidden size",
        ),
        (
            "llama.rope.dimension_count",
            65u32.to_le_bytes().to_vec(),
            "RoPE rotates",
        ),
        (
            "llama.rope.dimension_count",
            1000u32.to_le_bytes().to_vec(),
            "RoPE rotates",
        ),
        (
            "llama.vocab_size",
            u32::MAX.to_le_bytes().to_vec(),
            "vocabulary",
        ),
        (
            "tokenizer.ggml.bos_token_id",
            49152u32.to_le_bytes().to_vec(),
            "BOS",
        ),
    ];
    for (key, value, needle) in cases {
        p.with(key, value, |m| {
            assert_clean_error(
                &["generate", "--model", m, "--prompt-ids", "1,2", "-m", "2"],
                needle,
            )
        });
    }
    // The file itself is fine.
    let (code, _, err) = run(&[
        "generate",
        "--model",
        p.path.to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "-m",
        "2",
        "-q",
    ]);
    assert_eq!(code, 0, "{err}");
}

/// The tiny llama folder with `edit` applied to its config.json.
fn tiny_with(edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let d = tmp();
    write_tiny_llama(d.path(), "llama", 64);
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.path().join("config.json")).unwrap())
            .unwrap();
    edit(&mut cfg);
    std::fs::write(d.path().join("config.json"), cfg.to_string()).unwrap();
    d
}

#[test]
fn metadata_lengths_that_claim_the_file_are_refused_before_allocating() {
    // A 300 MB sparse file whose metadata claims most of it as one string, one byte array, one
    // string array: each length fits in the file, but copying it would double the memory.
    let d = tmp();
    for (i, (ty, elem)) in [(8u32, None), (9, Some(0u32)), (9, Some(8))]
        .into_iter()
        .enumerate()
    {
        let p = d.path().join(format!("big{i}.gguf"));
        let mut b = Vec::new();
        b.extend(b"GGUF");
        b.extend(3u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        b.push(b'k');
        b.extend(ty.to_le_bytes());
        if let Some(e) = elem {
            b.extend(e.to_le_bytes());
        }
        let n: u64 = if elem == Some(8) {
            30_000_000
        } else {
            250_000_000
        };
        b.extend(n.to_le_bytes());
        std::fs::write(&p, &b).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(300_000_000).unwrap();
        let t0 = std::time::Instant::now();
        assert_clean_error(
            &[
                "generate",
                "--model",
                p.to_str().unwrap(),
                "--prompt-ids",
                "1",
            ],
            "more than 128 MiB of memory",
        );
        assert!(t0.elapsed().as_secs() < 5);
    }
}

#[test]
fn impossible_config_json_values_are_errors() {
    use serde_json::json;
    let cases: Vec<(&str, serde_json::Value, &str)> = vec![
        ("rms_norm_eps", json!(-1e-5), "epsilon"),
        ("rms_norm_eps", json!(0), "epsilon"),
        ("rms_norm_eps", json!(3.0), "epsilon"),
        ("rope_theta", json!(0), "RoPE base"),
        ("rope_theta", json!(-5.0), "RoPE base"),
        (
            "rope_scaling",
            json!({"type": "linear", "factor": 0.0}),
            "position scale",
        ),
        (
            "rope_scaling",
            json!({"type": "dynamic", "factor": -2.0}),
            "factor",
        ),
        (
            "rope_scaling",
            json!({"type": "rocket", "factor": 2.0}),
            "rope_scaling type",
        ),
        ("num_hidden_layers", json!(1u64 << 50), "layers"),
        ("num_hidden_layers", json!(0), "layers"),
        ("head_dim", json!(1u64 << 40), "head dimension"),
        ("vocab_size", json!(0), "vocabulary"),
        ("max_position_embeddings", json!(0), "context"),
        // (its head dimension, hidden / heads, is refused first)
        ("hidden_size", json!(1u64 << 40), "head dimension"),
        ("intermediate_size", json!(1u64 << 40), "intermediate size"),
        ("num_key_value_heads", json!(3), "multiple"),
    ];
    for (key, value, needle) in cases {
        let d = tiny_with(|c| c[key] = value.clone());
        assert_clean_error(
            &[
                "generate",
                "--model",
                d.path().to_str().unwrap(),
                "--prompt-ids",
                "1,2",
            ],
            needle,
        );
    }
    // A sliding window of zero positions.
    let d = tiny_with(|c| {
        c["layer_types"] = json!(["sliding_attention", "full_attention"]);
        c["sliding_window"] = json!(0);
    });
    assert_clean_error(
        &[
            "generate",
            "--model",
            d.path().to_str().unwrap(),
            "--prompt-ids",
            "1",
        ],
        "sliding window",
    );
}

/// Asserts one error line, under 500 characters, without control characters.
fn assert_bounded_error(args: &[&str]) -> String {
    let (code, _, err) = run(args);
    assert_ne!(code, 0);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{err:.1000}");
    assert!(lines[0].chars().count() < 500, "{} chars", lines[0].len());
    assert!(!lines[0].chars().any(|c| c.is_control()), "{:?}", lines[0]);
    lines[0].to_string()
}

#[test]
fn errors_quoting_files_are_bounded_and_escaped() {
    let d = tmp();
    let hostile = format!(
        "\u{1b}[2J\u{1b}]0;owned\u{7}{}\u{202e}",
        "A".repeat(100_000)
    );
    // An architecture name.
    let p = d.path().join("arch.gguf");
    GgufWriter::new()
        .str("general.architecture", &hostile)
        .write(&p);
    let line = assert_bounded_error(&[
        "generate",
        "--model",
        p.to_str().unwrap(),
        "--prompt-ids",
        "1",
    ]);
    assert!(
        line.contains("unsupported architecture '\\u{1b}[2J"),
        "{line}"
    );
    // A tensor name, with an unknown type.
    let p = d.path().join("tensor.gguf");
    GgufWriter::new()
        .str("general.architecture", "llama")
        .tensor(&hostile, &[32], 99, vec![0; 32])
        .write(&p);
    assert_bounded_error(&[
        "generate",
        "--model",
        p.to_str().unwrap(),
        "--prompt-ids",
        "1",
    ]);
    // A model_type in config.json.
    let dir = tiny_with(|c| c["model_type"] = hostile.clone().into());
    let line = assert_bounded_error(&[
        "generate",
        "--model",
        dir.path().to_str().unwrap(),
        "--prompt-ids",
        "1",
    ]);
    assert!(line.contains("unsupported model_type"), "{line}");
    // A tokenizer.json whose syntax error sits in the decoder (the tokenizers crate panicked on
    // it before the file was checked as JSON first; found by the fuzz target).
    let bad = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/fuzz/regressions/tokenizer/0-syntax-error-in-decoder.json"),
    )
    .unwrap();
    let dir = tiny_with(|_| {});
    std::fs::write(dir.path().join("tokenizer.json"), bad).unwrap();
    let line = assert_bounded_error(&[
        "generate",
        "--model",
        dir.path().to_str().unwrap(),
        "--prompt",
        "hi",
    ]);
    assert!(line.contains("tokenizer.json"), "{line}");
}

#[test]
fn flags_are_checked_before_anything_is_fetched() {
    // A repo id that would go to the hub (unreachable here): each bad flag must be reported
    // instead, at once.
    let m = "nobody-at-all/no-such-model";
    let cases: &[(&[&str], &str)] = &[
        (&["--temp", "-1"], "--temp"),
        (&["--temp", "NaN"], "--temp"),
        (&["--top-p", "2"], "--top-p"),
        (&["--min-p", "inf"], "--min-p"),
        (
            &["--min-tokens-to-keep", "100000000"],
            "--min-tokens-to-keep",
        ),
        (&["--top-k", "99999999999"], "--top-k"),
        (&["--repetition-penalty", "NaN"], "--repetition-penalty"),
        (&["--presence-penalty", "inf"], "--presence-penalty"),
        (&["--logit-bias", "{\"1\": NaN}"], "--logit-bias"),
        (&["--logit-bias", "{\"1\": \"x\"}"], "--logit-bias"),
        (&["--json", "--logprobs", "99999999999"], "--logprobs"),
        (&["--threads", "0"], "--threads"),
        (&["--max-tokens", "99999999999999999999999"], "--max-tokens"),
    ];
    for (extra, needle) in cases {
        let mut args = vec!["generate", "--model", m, "--prompt", "hi"];
        args.extend_from_slice(extra);
        assert_clean_error(&args, needle);
    }
    let bench: &[(&[&str], &str)] = &[
        (&["--n-prompt", "1000000000000"], "--n-prompt"),
        (&["--n-gen", "18446744073709551615"], "--n-gen"),
        (&["--repetitions", "0"], "--repetitions"),
        (&["--repetitions", "100000000"], "--repetitions"),
        (&["--exl3", "mul1:3,x=4"], "unknown projection 'x'"),
        (&["--exl3", "mul1:3,up"], "PROJECTION=BITS"),
        (&["--exl3", "mul1:2.25"], "'2.25' bits"),
    ];
    for (extra, needle) in bench {
        let mut args = vec!["bench", "--model", m];
        args.extend_from_slice(extra);
        assert_clean_error(&args, needle);
    }
    let mut args = vec!["chat", "--model", m, "--top-p", "-3"];
    args.truncate(5);
    assert_clean_error(&args, "--top-p");
}

#[test]
fn thread_counts_are_capped_to_the_machine_and_sizes_do_not_overflow() {
    let d = tmp();
    write_tiny_llama(d.path(), "llama", 32);
    let m = d.path().to_str().unwrap();
    let (code, out, err) = run(&[
        "generate",
        "--model",
        m,
        "--prompt-ids",
        "1,2",
        "--threads",
        "1000000",
        "--max-tokens",
        &usize::MAX.to_string(),
        "--json",
        "-q",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("--threads 1000000 is more than"), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    // Generation ends at the 32-position context, not at the max tokens.
    assert_eq!(v["finish_reason"], "context", "{out}");
    assert_eq!(v["ids"].as_array().unwrap().len(), 31);
}

#[test]
fn closed_stdout_ends_quietly() {
    let mut child = trellm()
        .args([
            "generate",
            "--prompt",
            "Tell me a long story about a dragon.",
            "--max-tokens",
            "300",
            "-q",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut one = [0u8; 1];
    out.read_exact(&mut one).unwrap();
    drop(out);
    let t0 = std::time::Instant::now();
    let status = child.wait().unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    // As `cat` into `head -c1`: no message; success (trellm ignores SIGPIPE and stops).
    assert!(err.is_empty(), "{err}");
    assert_eq!(status.code(), Some(0));
    // It stopped rather than generating the 300 tokens.
    assert!(t0.elapsed().as_secs() < 20);
}

#[test]
fn write_errors_are_errors() {
    let dev_full = || {
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap()
    };
    let cases: &[&[&str]] = &[
        &["generate", "--prompt", "Hi", "--max-tokens", "5", "-q"],
        &[
            "generate",
            "--prompt-ids",
            "1,2",
            "--max-tokens",
            "2",
            "--json",
            "-q",
        ],
        &["info", "smollm2-135m-instruct"],
        &["list"],
        &["completions", "bash"],
        &["pull", "smollm2-135m-instruct"],
    ];
    for args in cases {
        let out = trellm().args(*args).stdout(dev_full()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_ne!(
            out.status.code(),
            Some(0),
            "{args:?} succeeded on a full disk"
        );
        assert!(err.contains("cannot write the output"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn index_shards_stay_inside_the_model_folder() {
    let d = tmp();
    let dir = d.path().join("m");
    write_tiny_llama(&dir, "llama", 64);
    // A real shard outside the folder, which the index points at.
    std::fs::copy(
        dir.join("model.safetensors"),
        d.path().join("outside.safetensors"),
    )
    .unwrap();
    for name in [
        "../outside.safetensors",
        "/etc/passwd",
        "a/../../outside.safetensors",
    ] {
        let index = serde_json::json!({"weight_map": {"model.embed_tokens.weight": name}});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
        assert_clean_error(
            &[
                "generate",
                "--model",
                dir.to_str().unwrap(),
                "--prompt-ids",
                "1",
            ],
            "outside the model folder",
        );
    }
}

#[test]
fn local_looking_paths_that_do_not_exist_are_not_hub_lookups() {
    for p in [
        "./nope.gguf",
        "/no/such/folder",
        "models/x.gguf",
        "~/m.safetensors",
    ] {
        assert_clean_error(
            &["generate", "--model", p, "--prompt", "hi"],
            "no such file or folder",
        );
        assert_clean_error(&["info", p], "no such file or folder");
    }
}

/// A `TRELLM_HOME` holding one Hugging Face repo, `test-owner/broken`, whose GGUF is cut short.
fn home_with_broken_repo() -> tempfile::TempDir {
    let home = tmp();
    let dir = home.path().join("models/hf/test-owner--broken");
    std::fs::create_dir_all(&dir).unwrap();
    let real = std::fs::read(model_path("smollm2-135m-instruct")).unwrap();
    let cut = &real[..1 << 20];
    std::fs::write(dir.join("m.gguf"), cut).unwrap();
    let meta = serde_json::json!({
        "repo": "test-owner/broken",
        "files": {"m.gguf": {"size": cut.len(), "sha256": null}},
        "default": "m.gguf",
    });
    std::fs::write(dir.join(".trellm-repo.json"), meta.to_string()).unwrap();
    home
}

#[test]
fn a_cached_model_that_does_not_load_says_how_to_fetch_it_again() {
    let home = home_with_broken_repo();
    let with_home = |args: &[&str]| {
        let out = trellm()
            .env("TRELLM_HOME", home.path())
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, _, err) = with_home(&["generate", "--model", "test-owner/broken", "--prompt", "hi"]);
    assert_eq!(code, Some(1));
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("`trellm rm test-owner/broken` then `trellm pull test-owner/broken`"),
        "{err}"
    );
    assert!(err.contains("m.gguf: corrupt GGUF"), "{err}");
    // list shows it, rm removes it, a second rm says it is gone.
    let (code, out, _) = with_home(&["list"]);
    assert_eq!(code, Some(0));
    assert!(out.contains("test-owner/broken"), "{out}");
    let (code, _, err) = with_home(&["rm", "test-owner/broken"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(!home.path().join("models/hf/test-owner--broken").exists());
    let (code, out, _) = with_home(&["list", "--json"]);
    assert_eq!(code, Some(0));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["cached"].as_array().unwrap().len(), 0, "{out}");
    let (code, _, err) = with_home(&["rm", "test-owner/broken"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("not in the cache"), "{err}");
}

fn json_run(args: &[&str], stdin: Option<&str>) -> serde_json::Value {
    let mut child = trellm()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    if let Some(s) = stdin {
        input.write_all(s.as_bytes()).unwrap();
    }
    drop(input);
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn prompt_from_stdin_or_a_file_and_json_results() {
    let d = tmp();
    let f = d.path().join("prompt.txt");
    std::fs::write(&f, "What is the capital of France?").unwrap();
    let base = ["generate", "--json", "-q"];
    let with = |extra: &[&str], stdin| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        json_run(&a, stdin)
    };
    let direct = with(
        &["--prompt", "What is the capital of France?", "-m", "3"],
        None,
    );
    let piped = with(
        &["--prompt", "-", "-m", "3"],
        Some("What is the capital of France?"),
    );
    let file = with(&["--file", f.to_str().unwrap(), "-m", "3"], None);
    assert_eq!(direct["prompt_ids"], piped["prompt_ids"]);
    assert_eq!(direct["prompt_ids"], file["prompt_ids"]);
    assert_eq!(direct["ids"], file["ids"]);
    assert_eq!(direct["finish_reason"], "length");
    let t = &direct["timings"];
    assert_eq!(
        t["prompt_n"],
        direct["prompt_ids"].as_array().unwrap().len()
    );
    assert_eq!(t["predicted_n"], 3);
    assert!(t["prompt_ms"].as_f64().unwrap() > 0.0);
    assert!(t["predicted_per_second"].as_f64().unwrap() > 0.0);
    // A reply that ends by itself says "stop".
    let done = with(&["--prompt", "Say just: yes", "--max-tokens", "200"], None);
    assert_eq!(done["finish_reason"], "stop", "{done}");
    // Unreadable or oversized prompt files are one clean error.
    assert_clean_error(&["generate", "--file", "/no/such/prompt.txt"], "prompt.txt");
    let (code, _, err) = run(&["generate", "--file", f.to_str().unwrap(), "--prompt", "x"]);
    assert_eq!(code, 2, "{err}");
}

#[test]
fn flags_without_effect_warn() {
    let (code, _, err) = run(&[
        "generate",
        "--prompt",
        "The",
        "--raw",
        "--system",
        "Be terse.",
        "-m",
        "1",
        "-q",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("--system has no effect"), "{err}");
    let (_, _, err) = run(&["generate", "--prompt", "The", "-m", "1", "-q"]);
    assert!(!err.contains("warning"), "{err}");
}

#[test]
fn info_version_and_completions() {
    let (code, out, err) = run(&["info", "smollm2-135m-instruct"]);
    assert_eq!(code, 0, "{err}");
    for want in [
        "architecture   llama",
        "parameters     134.5M",
        "Q4_1 x210",
        "context length 8192",
        "layers         30  hidden 576  heads 9 (kv 3)",
        "chat template\n{% for message in messages %}",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
    let (code, out, err) = run(&["info", "gemma-3-270m", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["architecture"], "gemma3");
    assert_eq!(v["context_length"], 32768);
    assert_eq!(v["supported"], true);
    assert_eq!(v["head_dim"], 256);
    assert!(v["tensor_types"]["Q4_K"]["tensors"].as_u64().unwrap() > 0);
    // An HF folder.
    let d = tmp();
    write_tiny_llama(d.path(), "llama", 64);
    let (code, out, err) = run(&["info", d.path().to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("format         safetensors"), "{out}");
    assert!(out.contains("context length 64"), "{out}");
    assert!(out.contains("F32 x"), "{out}");

    let (code, out, _) = run(&["--version"]);
    assert_eq!(code, 0);
    assert_eq!(out.trim(), format!("trellm {}", env!("CARGO_PKG_VERSION")));
    for (shell, marker) in [
        ("bash", "_trellm()"),
        ("zsh", "#compdef trellm"),
        ("fish", "complete -c trellm"),
    ] {
        let (code, out, err) = run(&["completions", shell]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains(marker), "{shell}: {out:.300}");
        assert!(out.contains("generate"), "{shell}");
    }
}

/// The tiny EXL3 llama (a real tokenizer and chat template) with a context of `ctx` positions.
fn tiny_chat_model(ctx: usize) -> tempfile::TempDir {
    let src =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/exl3/tiny-llama/mul1-3.0");
    let d = tmp();
    for e in std::fs::read_dir(&src).unwrap().flatten() {
        std::fs::copy(e.path(), d.path().join(e.file_name())).unwrap();
    }
    let p = d.path().join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    cfg["max_position_embeddings"] = ctx.into();
    std::fs::write(&p, cfg.to_string()).unwrap();
    d
}

fn chat(model: &Path, extra: &[&str], input: &str) -> (i32, String, String) {
    let mut child = trellm()
        .args(["chat", "--model", model.to_str().unwrap()])
        .args(extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn chat_takes_several_lines_and_goes_on_when_the_context_is_full() {
    let m = tiny_chat_model(64);
    // Several lines: continued with \ and in a """ block (the prompt becomes "..").
    let (code, out, err) = chat(
        m.path(),
        &["--max-tokens", "2"],
        "one \\\ntwo\n\"\"\"\nthree\nfour\n\"\"\"\nq\n",
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.matches(".. ").count(), 4, "{out}");
    // Three messages of ~20 tokens in a 64-token context: the third drops the first exchange.
    let msg = "the cat sat on the mat and the dog ran in the park\n";
    let (code, _, err) = chat(m.path(), &["--max-tokens", "4"], &msg.repeat(3));
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("no longer fits the model's context of 64 tokens"),
        "{err}"
    );
    // One message larger than the context is not sent, and the session goes on.
    let long = format!("{}\nhi\n", "the cat sat on the mat ".repeat(20));
    let (code, _, err) = chat(m.path(), &["--max-tokens", "2"], &long);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("more than the model's context of 64: not sent"),
        "{err}"
    );
}

#[test]
fn ctrl_c_stops_the_reply_and_keeps_the_chat() {
    let m = tiny_chat_model(2048);
    let mut child = trellm()
        .args([
            "chat",
            "--model",
            m.path().to_str().unwrap(),
            "--max-tokens",
            "100000",
        ])
        .args(["--logit-bias", "{\"2\": -1000}"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    stdin.write_all(b"tell me everything\n").unwrap();
    // Wait for the reply to stream, then press Ctrl-C.
    let mut seen = Vec::new();
    let mut buf = [0u8; 64];
    while seen.len() < 40 {
        let n = stdout.read(&mut buf).unwrap();
        assert!(n > 0, "chat ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    stdin.write_all(b"and again\nq\n").unwrap();
    drop(stdin);
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    let status = child.wait().unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(err.contains("[interrupted]"), "{err}");
    // The session went on: a second prompt and reply after the interrupted one.
    assert!(rest.matches(">> ").count() >= 2, "{rest:.500}");
}

#[test]
fn chat_on_a_terminal_edits_lines_and_keeps_history() {
    use std::os::fd::{FromRawFd, OwnedFd};
    let m = tiny_chat_model(256);
    let home = tmp();
    let (mut master, mut slave) = (0, 0);
    // SAFETY: openpty fills two descriptors we then own.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0);
    // SAFETY: fresh descriptors from openpty, each owned once.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    let mut child = trellm()
        .args([
            "chat",
            "--model",
            m.path().to_str().unwrap(),
            "--max-tokens",
            "3",
        ])
        .env("TRELLM_HOME", home.path())
        .stdin(slave.try_clone().unwrap())
        .stdout(slave.try_clone().unwrap())
        .stderr(slave)
        .spawn()
        .unwrap();
    let mut w = std::fs::File::from(master.try_clone().unwrap());
    let mut r = std::fs::File::from(master);
    let screen = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let s2 = screen.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = r.read(&mut buf) {
            if n == 0 {
                break;
            }
            s2.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    let wait_for = |what: &str, count: usize| {
        let t0 = std::time::Instant::now();
        while screen.lock().unwrap().matches(what).count() < count {
            assert!(
                t0.elapsed().as_secs() < 30,
                "no {what:?} in {:?}",
                screen.lock().unwrap()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    wait_for(">> ", 1);
    // "helo", left arrow, "l": the editor makes it "hello".
    w.write_all(b"helo\x1b[Dl\r").unwrap();
    wait_for(">> ", 2);
    w.write_all(b"q\r").unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{}", screen.lock().unwrap());
    let history = std::fs::read_to_string(home.path().join("chat_history")).unwrap();
    assert!(history.lines().any(|l| l == "hello"), "{history:?}");
}

#[test]
fn hostile_chat_templates_end_with_an_error() {
    let cases = [
        // Runs for hours without a bound on its work.
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}",
        // Endless recursion.
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        // A string of 10^12 characters.
        "{{ 'xxxxxxxxxx' * 100000000000 }}",
    ];
    for t in cases {
        let m = tiny_chat_model(256);
        let p = m.path().join("tokenizer_config.json");
        let mut cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        cfg["chat_template"] = t.into();
        std::fs::write(&p, cfg.to_string()).unwrap();
        let t0 = std::time::Instant::now();
        assert_clean_error(
            &[
                "generate",
                "--model",
                m.path().to_str().unwrap(),
                "--prompt",
                "hi",
            ],
            "template",
        );
        assert!(t0.elapsed().as_secs() < 20, "{t}: {:?}", t0.elapsed());
    }
}
