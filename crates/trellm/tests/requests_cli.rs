//! `trellm generate --requests FILE.jsonl`: many requests in one run of the scheduler give, line
//! by line and in input order, what `trellm generate --json` gives each of them alone.

mod common;

use common::*;
use serde_json::Value;

fn json_lines(s: &str) -> Vec<Value> {
    s.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn requests_file_matches_each_request_alone() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("reqs.jsonl");
    // Each line with the flags that ask for the same request alone.
    let cases: Vec<(&str, Vec<&str>)> = vec![
        (
            r#"{"prompt": "What is the capital of France?", "max_tokens": 12, "logprobs": 3}"#,
            vec![
                "--prompt",
                "What is the capital of France?",
                "-m",
                "12",
                "--logprobs",
                "3",
            ],
        ),
        (
            r#"{"id": "b", "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 9, "temp": 0.7, "seed": 3}"#,
            vec![
                "--messages",
                "MSG",
                "-m",
                "9",
                "--temp",
                "0.7",
                "--seed",
                "3",
            ],
        ),
        (
            r#"{"prompt": "Once upon a time", "raw": true, "max_tokens": 20, "top_k": 5, "temp": 1.0, "seed": 9, "stop": [","]}"#,
            vec![
                "--prompt",
                "Once upon a time",
                "--raw",
                "-m",
                "20",
                "--top-k",
                "5",
                "--temp",
                "1.0",
                "--seed",
                "9",
                "--stop",
                ",",
            ],
        ),
        (
            r#"{"prompt_ids": [1, 2, 3, 4, 5], "max_tokens": 4, "prompt_logprobs": 2}"#,
            vec![
                "--prompt-ids",
                "1,2,3,4,5",
                "-m",
                "4",
                "--prompt-logprobs",
                "2",
            ],
        ),
        (
            r#"{"prompt": "List three fruits.", "max_tokens": 16, "repetition_penalty": 1.3, "system": "Be brief."}"#,
            vec![
                "--prompt",
                "List three fruits.",
                "-m",
                "16",
                "--repetition-penalty",
                "1.3",
                "--system",
                "Be brief.",
            ],
        ),
    ];
    let msg = dir.path().join("msg.json");
    std::fs::write(&msg, r#"[{"role": "user", "content": "Name a color."}]"#).unwrap();
    let body: Vec<&str> = cases.iter().map(|c| c.0).collect();
    std::fs::write(&file, body.join("\n") + "\n").unwrap();

    let (code, out, err) = run(&["generate", "--requests", file.to_str().unwrap(), "-q"]);
    assert_eq!(code, 0, "{err}");
    let batched = json_lines(&out);
    assert_eq!(batched.len(), cases.len());
    for (i, ((_, flags), b)) in cases.iter().zip(&batched).enumerate() {
        let mut args = vec!["generate", "--json", "-q"];
        let m = msg.to_str().unwrap();
        args.extend(flags.iter().map(|f| if *f == "MSG" { m } else { f }));
        let (code, out, err) = run(&args);
        assert_eq!(code, 0, "{err}");
        let alone: Value = serde_json::from_str(out.trim()).unwrap();
        let want_id = if i == 1 {
            Value::from("b")
        } else {
            Value::from(i)
        };
        assert_eq!(b["id"], want_id);
        for k in ["prompt_ids", "ids", "text", "finish_reason"] {
            assert_eq!(b[k], alone[k], "request {i}: {k}");
        }
        for k in ["logprobs", "prompt_logprobs"] {
            let (x, y) = (&b[k], &alone[k]);
            assert_eq!(x.is_null(), y.is_null(), "request {i}: {k}");
            let flat = |v: &Value| -> Vec<f64> {
                v.as_array()
                    .into_iter()
                    .flatten()
                    .flat_map(|s| s.as_array().unwrap().iter().map(|p| p[1].as_f64().unwrap()))
                    .collect()
            };
            let (fx, fy) = (flat(x), flat(y));
            assert_eq!(fx.len(), fy.len(), "request {i}: {k}");
            for (p, q) in fx.iter().zip(&fy) {
                assert!((p - q).abs() <= 1e-4, "request {i}: {k}: {p} vs {q}");
            }
        }
    }
    assert_eq!(
        batched[2]["finish_reason"], "stop",
        "the stop string ends it"
    );
}

#[test]
fn a_bad_requests_line_is_a_clean_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.jsonl");
    std::fs::write(
        &file,
        "{\"prompt\": \"hi\"}\n{\"prompt\": \"x\", \"tmep\": 1}\n",
    )
    .unwrap();
    assert_clean_error(
        &["generate", "--requests", file.to_str().unwrap()],
        "bad.jsonl:2",
    );
    std::fs::write(&file, "{\"prompt_ids\": [1, 999999]}\n").unwrap();
    assert_clean_error(
        &["generate", "--requests", file.to_str().unwrap()],
        "outside the vocabulary",
    );
}
