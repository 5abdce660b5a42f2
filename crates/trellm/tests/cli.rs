//! The CLI as a person uses it: chat over stdin, pull, seeded sampling, stop strings, streaming.

mod common;

use std::io::Write;
use std::process::Stdio;

use common::*;

#[test]
fn chat_answers_and_keeps_the_conversation() {
    let mut child = trellm()
        .args([
            "chat",
            "--model",
            "smollm2-135m-instruct",
            "--max-tokens",
            "24",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"What is the capital of France?\nr\nWhat is the capital of France?\nq\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    // Greedy and reset in between: both turns give the same answer, which names Paris.
    assert_eq!(text.matches("Paris").count(), 2, "{text}");
}

#[test]
fn pull_prints_the_model_path_last() {
    let (code, out, err) = run(&["pull", "smollm2-135m-instruct"]);
    assert_eq!(code, 0, "{err}");
    let last = out.lines().last().unwrap();
    assert!(
        last.ends_with(".gguf") && std::path::Path::new(last).is_file(),
        "{out}"
    );
}

#[test]
fn seeded_sampling_repeats_and_seeds_differ() {
    let gen = |seed: &str| {
        let (code, out, err) = run(&[
            "generate",
            "--prompt",
            "Write a story.",
            "--temp",
            "1.0",
            "--top-p",
            "0.95",
            "--min-p",
            "0.02",
            "--top-k",
            "50",
            "--seed",
            seed,
            "--max-tokens",
            "24",
            "--json",
            "--quiet",
        ]);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        v["ids"].clone()
    };
    assert_eq!(gen("1"), gen("1"));
    assert_ne!(gen("1"), gen("2"));
}

#[test]
fn stop_strings_end_the_text_and_are_not_printed() {
    let args = [
        "generate",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "16",
        "--quiet",
    ];
    let (code, full, err) = run(&args);
    assert_eq!(code, 0, "{err}");
    assert!(full.contains("Paris"), "{full}");
    let mut with_stop = args.to_vec();
    with_stop.extend(["--stop", "Paris"]);
    let (code, out, err) = run(&with_stop);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out.trim_end(),
        full[..full.find("Paris").unwrap()].trim_end()
    );
}

#[test]
fn stats_go_to_stderr() {
    let (code, out, err) = run(&["generate", "--prompt", "Hi", "--max-tokens", "4"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("Prompt:") && err.contains("Generation:") && err.contains("Peak memory:"),
        "{err}"
    );
    assert!(!out.contains("tokens-per-sec"));
}

#[test]
fn llama_cpp_spellings_of_the_token_limit_match_max_tokens() {
    let greedy = |flag: &str| {
        let (code, out, err) = run(&[
            "generate", "--prompt", "Hi", "--temp", "0", flag, "5", "--json",
        ]);
        assert_eq!(code, 0, "{flag}: {err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        (v["ids"].clone(), v["text"].clone())
    };
    let want = greedy("--max-tokens");
    assert_eq!(want.0.as_array().map(Vec::len), Some(5));
    for flag in ["-m", "-n", "--n-predict"] {
        assert_eq!(greedy(flag), want, "{flag}");
    }
}
