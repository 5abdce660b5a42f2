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

/// `trellm serve --port 0 ARGS`, with its stderr to read.
fn spawn_serve(args: &[&str]) -> (Child, BufReader<std::process::ChildStderr>) {
    let mut child = trellm()
        .args(["serve", "--port", "0"])
        .args(args)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let err = BufReader::new(child.stderr.take().unwrap());
    (child, err)
}

fn serve(extra: &[&str]) -> Server {
    let seqs: &[&str] = if extra.contains(&"--max-seqs") {
        &[]
    } else {
        &["--max-seqs", "16"]
    };
    let (child, mut err) = spawn_serve(&[seqs, extra].concat());
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
    let (head, body) = http_with(
        port,
        &format!("{method} {path} HTTP/1.1\r\ncontent-type: application/json"),
        body,
    );
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, body)
}

/// A raw request from its first lines (request line and headers); returns the response head
/// (lowercased) and the body.
fn http_with(port: u16, head: &str, body: &[u8]) -> (String, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "{head}\r\nhost: x\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .unwrap();
    let _ = s.write_all(body);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).to_string();
    let (h, b) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    (h.to_ascii_lowercase(), b.to_string())
}

/// Posts a chat request on a connection kept open (a stream the test reads or drops).
fn post_chat(port: u16, body: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    s.write_all(body).unwrap();
    s
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

/// Runs `tests/server/SCRIPT BASE_URL MODEL EXTRA...` against a fresh server; it must exit 0.
fn client_script(script: &str, extra: &[&str]) {
    let srv = serve(&[]);
    let path = format!("{}/tests/server/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(python())
        .args([path.as_str(), &srv.base, "smollm2-135m-instruct"])
        .args(extra)
        .output()
        .expect("python with the openai and anthropic packages (see the module docs)");
    assert!(
        out.status.success(),
        "{script}\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn official_clients_talk_to_the_server() {
    client_script("clients.py", &[&generate_greedy()]);
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
                "a".repeat(100 << 20)
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
    // llama-server's paths without the version prefix answer as the prefixed ones.
    let (got, text) = http(p, "POST", "/chat/completions", ok);
    assert_eq!(got, 200, "{text}");
    assert!(text.contains("chat.completion"), "{text}");
    let (got, text) = http(
        p,
        "POST",
        "/completions",
        br#"{"prompt": "The", "max_tokens": 2}"#,
    );
    assert_eq!(got, 200, "{text}");
    assert!(text.contains("text_completion"), "{text}");
    let (got, text) = http(p, "GET", "/models", b"");
    assert_eq!(got, 200, "{text}");
    assert!(text.contains("smollm2-135m-instruct"), "{text}");
    assert_eq!(http(p, "GET", "/v1/health", b"").0, 200);
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
        streams.push(post_chat(p, body));
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

#[test]
fn the_port_answers_while_loading_and_sigterm_ends_running_streams_with_exit_0() {
    let (mut child, mut err) = spawn_serve(&["--shutdown-grace", "1"]);
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    // The first line names the bound address before the model is loaded.
    let addr = line
        .split("listening on ")
        .nth(1)
        .and_then(|r| r.split(';').next())
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    let port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
    let (status, body) = http(port, "GET", "/health", b"");
    match status {
        503 => assert!(body.contains("loading"), "{body}"),
        200 => {}
        other => panic!("/health during loading: {other} {body}"),
    }
    loop {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "the server exited");
        if line.contains("http://") {
            break;
        }
    }
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    assert_eq!(http(port, "GET", "/health", b"").0, 200);
    // A stream that would run for minutes, then SIGTERM: cancelled after the grace, exit 0.
    let body = br#"{"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 3000, "stream": true, "temperature": 0.8}"#;
    let mut s = post_chat(port, body);
    let mut buf = [0u8; 256];
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    assert!(s.read(&mut buf).unwrap() > 0);
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let t = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "no exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
}

#[test]
fn a_full_queue_gets_503_with_retry_after_and_cors_only_for_allowed_origins() {
    let srv = serve(&[
        "--max-seqs",
        "1",
        "--max-queue",
        "1",
        "--allowed-origins",
        "http://app.example",
    ]);
    let p = srv.port;
    // SmolLM2's end tokens (<|endoftext|> 0, <|im_end|> 2) suppressed: a sampled story that
    // ended early would leave the queue empty before the check below.
    let long = br#"{"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 2000, "stream": true, "temperature": 0.8, "logit_bias": {"0": -100, "2": -100}}"#;
    let wait_for = |what: &str, done: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !done() {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    // One stream running before the second is sent: two sent at once could both be waiting for
    // admission, and the queue of one would turn the second away.
    let mut held = vec![post_chat(p, long)];
    wait_for("the first stream never ran", &|| {
        metric(p, "trellm_requests_running") >= 1
    });
    held.push(post_chat(p, long));
    wait_for("the second stream was never queued", &|| {
        metric(p, "trellm_requests_running") + metric(p, "trellm_requests_waiting") >= 2
    });
    let ok = br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}"#;
    let (head, body) = http_with(
        p,
        "POST /v1/chat/completions HTTP/1.1\r\ncontent-type: application/json",
        ok,
    );
    assert!(head.starts_with("http/1.1 503"), "{head}\n{body}");
    assert!(head.contains("retry-after:"), "{head}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "overloaded_error");
    drop(held);
    // The queue drains; the server serves again.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, _) = http(p, "POST", "/v1/chat/completions", ok);
        if status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "still refused: {status}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // CORS: the allowed origin gets a preflight answer, another origin does not.
    let preflight = |origin: &str| {
        http_with(
            p,
            &format!(
                "OPTIONS /v1/chat/completions HTTP/1.1\r\norigin: {origin}\r\naccess-control-request-method: POST\r\naccess-control-request-headers: content-type"
            ),
            b"",
        )
        .0
    };
    let allowed = preflight("http://app.example");
    assert!(
        allowed.contains("access-control-allow-origin: http://app.example"),
        "{allowed}"
    );
    assert!(!preflight("http://evil.example").contains("access-control-allow-origin"));
}

#[test]
fn metrics_count_tokens_latencies_and_prefix_cache_hits() {
    let srv = serve(&[]);
    let p = srv.port;
    let (_, plain) = http_with(p, "GET /metrics HTTP/1.1", b"");
    assert!(!plain.contains("access-control"));
    let req = br#"{"messages": [{"role": "system", "content": "You are a helpful assistant who answers in one short sentence, always."}, {"role": "user", "content": "Name a color."}], "max_tokens": 6, "temperature": 0}"#;
    let (status, first) = http(p, "POST", "/v1/chat/completions", req);
    assert_eq!(status, 200, "{first}");
    let (status, second) = http(p, "POST", "/v1/chat/completions", req);
    assert_eq!(status, 200, "{second}");
    let a: serde_json::Value = serde_json::from_str(&first).unwrap();
    let b: serde_json::Value = serde_json::from_str(&second).unwrap();
    assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"]);
    let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap() as usize;
    let prompt = b["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // Every full block but the one holding the last prompt token.
    assert_eq!(cached, (prompt - 1) / 16 * 16, "{second}");
    assert_eq!(metric(p, "trellm_prefix_cache_hit_tokens_total"), cached);
    assert_eq!(metric(p, "trellm_requests_finished_total"), 2);
    assert_eq!(metric(p, "trellm_prompt_tokens_total"), 2 * prompt);
    let generated = a["usage"]["completion_tokens"].as_u64().unwrap() as usize
        + b["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    assert_eq!(metric(p, "trellm_generation_tokens_total"), generated);
    assert_eq!(metric(p, "trellm_time_to_first_token_seconds_count"), 2);
    assert!(metric(p, "trellm_kv_blocks_cached") > 0);
    // A finished sequence's blocks go back when the engine retires it, which can come just after
    // its reply was sent (seen on a loaded machine: 3 blocks short for a moment).
    let t0 = Instant::now();
    while metric(p, "trellm_kv_blocks_free") != metric(p, "trellm_kv_blocks_total")
        && t0.elapsed() < Duration::from_secs(10)
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        metric(p, "trellm_kv_blocks_free"),
        metric(p, "trellm_kv_blocks_total")
    );
}

#[test]
fn sixty_four_streaming_clients_each_get_what_they_get_alone() {
    let srv = serve(&["--max-seqs", "64"]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/load_clients.py");
    let out = Command::new(python())
        .args([script, &srv.base, "smollm2-135m-instruct"])
        .args(["--clients", "64", "--requests", "2", "--max-tokens", "16"])
        .args(["--prompts", "8", "--check"])
        .output()
        .expect("python with the openai package (see the module docs)");
    let report = String::from_utf8_lossy(&out.stdout);
    // The speeds are informative here; BENCHMARKS.md has the measured ratios.
    eprintln!("{report}");
    assert!(
        out.status.success(),
        "{report}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(report.trim()).unwrap();
    assert_eq!(v["requests"], 128);
    assert_eq!(
        v["generated_tokens"],
        128 * 16,
        "every stream ran to max_tokens"
    );
    // Afterwards the engine is idle and every block is free again.
    assert_eq!(metric(srv.port, "trellm_requests_running"), 0);
    assert_eq!(
        metric(srv.port, "trellm_kv_blocks_free"),
        metric(srv.port, "trellm_kv_blocks_total")
    );
}

#[test]
fn the_responses_api_through_the_openai_client() {
    client_script("responses.py", &[&generate_greedy()]);
}

#[test]
fn structured_output_and_tools_through_the_openai_client() {
    client_script("structured.py", &[]);
}

#[test]
fn tool_use_through_the_anthropic_client() {
    client_script("anthropic_tools.py", &[]);
}

#[test]
fn ctx_size_caps_every_endpoint_and_is_checked() {
    for bad in ["0", "100000000"] {
        let out = trellm()
            .args(["serve", "--port", "0", "--ctx-size", bad])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("--ctx-size"), "{err}");
    }
    let srv = serve(&["-c", "48"]);
    let msg = r#"[{"role":"user","content":"hi"}]"#;
    for (path, body) in [
        (
            "/v1/chat/completions",
            format!(r#"{{"messages":{msg},"max_tokens":30}}"#),
        ),
        (
            "/v1/responses",
            r#"{"input":"hi","max_output_tokens":30}"#.to_string(),
        ),
        (
            "/v1/messages",
            format!(r#"{{"model":"smollm2-135m-instruct","messages":{msg},"max_tokens":30}}"#),
        ),
    ] {
        let (status, text) = http(srv.port, "POST", path, body.as_bytes());
        assert!(
            status == 400 && text.contains("48 tokens"),
            "{path}: {status} {text}"
        );
    }
    let ok = format!(r#"{{"messages":{msg},"max_tokens":8}}"#);
    let (status, text) = http(srv.port, "POST", "/v1/chat/completions", ok.as_bytes());
    assert_eq!(status, 200, "{text}");
}

#[test]
fn tokenize_and_detokenize_round_trip_in_both_servers_spellings() {
    let srv = serve(&[]);
    let text = "The capital of France is Paris.";
    let ids_of = |body: String| {
        let (status, out) = http(srv.port, "POST", "/tokenize", body.as_bytes());
        assert_eq!(status, 200, "{out}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["count"], v["tokens"].as_array().unwrap().len());
        v["tokens"].clone()
    };
    let llama_server = ids_of(format!(r#"{{"content":"{text}"}}"#));
    let vllm = ids_of(format!(r#"{{"prompt":"{text}"}}"#));
    assert_eq!(llama_server, vllm);
    assert!(llama_server.as_array().unwrap().len() > 3);
    let (status, out) = http(
        srv.port,
        "POST",
        "/detokenize",
        format!(r#"{{"tokens":{llama_server}}}"#).as_bytes(),
    );
    assert_eq!(status, 200, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["content"], text);
    for (path, body) in [
        ("/tokenize", r#"{}"#),
        ("/tokenize", r#"{"content":"a","prompt":"b"}"#),
        ("/detokenize", r#"{"tokens":[4294967295]}"#),
    ] {
        let (status, out) = http(srv.port, "POST", path, body.as_bytes());
        assert_eq!(status, 400, "{path} {body}: {out}");
    }
}
