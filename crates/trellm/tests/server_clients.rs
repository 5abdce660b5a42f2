//! `trellm serve` against the official `openai` and `anthropic` Python clients, and the HTTP
//! details they do not cover: error envelopes, oversized bodies, many concurrent streams that
//! each get what they get alone, clients that disconnect mid-stream.
//!
//! The clients come from pip (CI installs them into `target/venv-clients`; elsewhere set
//! `TRELLM_TEST_PYTHON` to a python that has `openai` and `anthropic`).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

struct Server {
    child: Child,
    base: String,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(extra: &[&str]) -> Server {
    let mut child = trellm()
        .args(["serve", "--port", "0", "--max-seqs", "16"])
        .args(extra)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    let base = loop {
        line.clear();
        assert!(Instant::now() < deadline, "the server did not start");
        assert!(err.read_line(&mut line).unwrap() > 0, "the server exited");
        if let Some(at) = line.find("http://") {
            break line[at..].trim().to_string();
        }
    };
    // Keep draining stderr so the server never blocks on it.
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    let port = base.rsplit(':').next().unwrap().parse().unwrap();
    Server { child, base, port }
}

fn python() -> PathBuf {
    if let Ok(p) = std::env::var("TRELLM_TEST_PYTHON") {
        return p.into();
    }
    let venv = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../target/venv-clients/bin/python"
    ));
    if venv.exists() {
        venv
    } else {
        "python3".into()
    }
}

/// A raw HTTP/1.1 request; returns the status and the body.
fn http(port: u16, method: &str, path: &str, body: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .unwrap();
    let _ = s.write_all(body);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body)
}

fn generate_greedy() -> String {
    let (code, out, err) = run(&[
        "generate",
        "--prompt",
        "What is the capital of France?",
        "-m",
        "24",
        "--json",
        "-q",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    v["text"].as_str().unwrap().to_string()
}

#[test]
fn official_clients_talk_to_the_server() {
    let expected = generate_greedy();
    let srv = serve(&[]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/server/clients.py");
    let out = Command::new(python())
        .args([script, &srv.base, "smollm2-135m-instruct", &expected])
        .output()
        .expect("python with the openai and anthropic packages (see the module docs)");
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn bad_requests_get_envelopes_and_the_server_keeps_serving() {
    let srv = serve(&["--kv-memory", "64M"]);
    let p = srv.port;
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "/v1/chat/completions",
            b"{not json".to_vec(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/chat/completions",
            br#"{"messages": "hi"}"#.to_vec(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/chat/completions",
            br#"{"messages": [{"role": "user", "content": "hi"}], "bogus": 1}"#.to_vec(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/chat/completions",
            br#"{"messages": [{"role": "user", "content": "hi"}], "top_p": 7}"#.to_vec(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/completions",
            br#"{"prompt": [1, 99999999], "max_tokens": 3}"#.to_vec(),
            400,
            "invalid_request_error",
        ),
        ("/v1/nope", b"{}".to_vec(), 404, "not_found_error"),
        (
            "/v1/messages",
            br#"{"model": "x"}"#.to_vec(),
            400,
            "invalid_request_error",
        ),
        (
            "/v1/chat/completions",
            format!(
                r#"{{"messages": [{{"role": "user", "content": "{}"}}]}}"#,
                "a".repeat(9 << 20)
            )
            .into_bytes(),
            413,
            "",
        ),
    ];
    for (path, body, status, kind) in cases {
        let (got, text) = http(p, "POST", path, &body);
        assert_eq!(got, status, "{path}: {text}");
        if !kind.is_empty() {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            let k = v["error"]["type"].as_str().unwrap();
            assert_eq!(k, kind, "{text}");
        }
    }
    // A request the KV cache can never hold is refused; the server still answers.
    let big = br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8000}"#;
    let (got, text) = http(p, "POST", "/v1/chat/completions", big);
    assert_eq!(got, 400, "{text}");
    let ok = br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}"#;
    let (got, text) = http(p, "POST", "/v1/chat/completions", ok);
    assert_eq!(got, 200, "{text}");
}

fn metric(port: u16, name: &str) -> usize {
    let (_, body) = http(port, "GET", "/metrics", b"");
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn clients_that_disconnect_mid_stream_free_their_blocks() {
    let srv = serve(&[]);
    let p = srv.port;
    let total = metric(p, "trellm_kv_blocks_total");
    let body = br#"{"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 400, "stream": true}"#;
    let mut streams = Vec::new();
    for _ in 0..32 {
        let mut s = TcpStream::connect(("127.0.0.1", p)).unwrap();
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        )
        .unwrap();
        s.write_all(body).unwrap();
        streams.push(s);
    }
    // Read a little of each stream, then hang up.
    for s in &mut streams {
        let mut buf = [0u8; 512];
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let n = s.read(&mut buf).unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).contains("200"));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while metric(p, "trellm_requests_running") + metric(p, "trellm_requests_waiting") < 32 {
        assert!(Instant::now() < deadline, "the streams never ran");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        metric(p, "trellm_kv_blocks_free") < total,
        "the streams hold blocks"
    );
    drop(streams);
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(p, "trellm_kv_blocks_free") != total || metric(p, "trellm_requests_running") != 0 {
        assert!(Instant::now() < deadline, "blocks were not freed");
        std::thread::sleep(Duration::from_millis(100));
    }
}
