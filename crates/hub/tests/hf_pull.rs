//! Hugging Face pulls, against a tiny local HTTP server standing in for the
//! hub (loopback only), plus the real hub being unreachable here.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{names_in, sha256_bytes};
use serde_json::json;
use trellm_hub::Hub;

/// Serves fixed bodies by path; records every requested path (with query).
struct MockHub {
    url: String,
    requests: Arc<Mutex<Vec<String>>>,
    auth: Arc<Mutex<Vec<Option<String>>>>,
}

impl MockHub {
    fn start(routes: HashMap<String, Vec<u8>>) -> MockHub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let auth = Arc::new(Mutex::new(Vec::new()));
        let (reqs, auths) = (requests.clone(), auth.clone());
        // Runs until the test process exits; serves one request per connection.
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                if reader.read_line(&mut line).is_err() {
                    continue;
                }
                let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
                let mut token = None;
                loop {
                    let mut h = String::new();
                    if reader.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
                        break;
                    }
                    if let Some(v) = h.strip_prefix("Authorization: ") {
                        token = Some(v.trim().to_string());
                    }
                }
                reqs.lock().unwrap().push(path.clone());
                auths.lock().unwrap().push(token);
                let (status, body) = match routes.get(&path) {
                    Some(b) => ("200 OK", b.clone()),
                    None => ("404 Not Found", b"not found".to_vec()),
                };
                let head = format!(
                    "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = stream.write_all(head.as_bytes());
                let _ = stream.write_all(&body);
            }
        });
        MockHub {
            url,
            requests,
            auth,
        }
    }

    fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }
}

/// Builds routes for one repo: the API listing plus each file's resolve URL.
/// `lfs` files get a sha256 in the listing (optionally a wrong one).
fn repo_routes(
    repo: &str,
    files: &[(&str, Vec<u8>, bool)],
    bad_sha: bool,
) -> HashMap<String, Vec<u8>> {
    let mut routes = HashMap::new();
    let siblings: Vec<_> = files
        .iter()
        .map(|(name, data, lfs)| {
            if *lfs {
                let sha = if bad_sha { "ab".repeat(32) } else { sha256_bytes(data) };
                json!({ "rfilename": name, "size": data.len(), "lfs": { "sha256": sha, "size": data.len() } })
            } else {
                json!({ "rfilename": name, "size": data.len() })
            }
        })
        .collect();
    let listing = json!({ "id": repo, "siblings": siblings });
    routes.insert(
        format!("/api/models/{repo}?blobs=true"),
        serde_json::to_vec(&listing).unwrap(),
    );
    for (name, data, _) in files {
        routes.insert(format!("/{repo}/resolve/main/{name}"), data.clone());
    }
    routes
}

fn weights(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn safetensors_repo_is_downloaded_verified_and_cached() {
    let files = [
        ("config.json", br#"{"model_type":"llama"}"#.to_vec(), false),
        ("tokenizer.json", b"{}".to_vec(), false),
        (
            "model-00001-of-00002.safetensors",
            weights(300_000, 1),
            true,
        ),
        (
            "model-00002-of-00002.safetensors",
            weights(200_000, 2),
            true,
        ),
        ("model.safetensors.index.json", b"{}".to_vec(), false),
        ("README.md", b"# not needed".to_vec(), false),
        ("onnx/model.safetensors", weights(10, 3), true),
    ];
    let mock = MockHub::start(repo_routes("acme/tiny", &files, false));
    let home = tempfile::tempdir().unwrap();
    let hub = Hub::new(home.path())
        .with_hf_endpoint(&mock.url)
        .with_hf_token(Some("secret".into()));

    let dir = hub.resolve("acme/tiny").unwrap();
    assert_eq!(dir, hub.models_dir().join("hf").join("acme--tiny"));
    assert_eq!(
        names_in(&dir),
        vec![
            ".trellm-repo.json",
            "config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json",
        ]
    );
    assert_eq!(
        std::fs::read(dir.join("model-00002-of-00002.safetensors")).unwrap(),
        files[3].1
    );
    assert!(mock
        .auth
        .lock()
        .unwrap()
        .iter()
        .all(|t| t.as_deref() == Some("Bearer secret")));

    // Cached: no further requests, for resolve and for pull.
    let before = mock.requests().len();
    assert_eq!(hub.resolve("acme/tiny").unwrap(), dir);
    assert_eq!(hub.pull("acme/tiny").unwrap(), dir);
    assert_eq!(hub.cached("acme/tiny"), Some(dir.clone()));
    assert_eq!(mock.requests().len(), before);

    // A lost weight file is fetched again, and only that one.
    std::fs::remove_file(dir.join("model-00001-of-00002.safetensors")).unwrap();
    assert_eq!(hub.cached("acme/tiny"), None);
    hub.resolve("acme/tiny").unwrap();
    let new: Vec<String> = mock.requests()[before..].to_vec();
    assert_eq!(
        new,
        vec![
            "/api/models/acme/tiny?blobs=true".to_string(),
            "/acme/tiny/resolve/main/model-00001-of-00002.safetensors".to_string(),
        ]
    );
    assert_eq!(
        std::fs::read(dir.join("model-00001-of-00002.safetensors")).unwrap(),
        files[2].1
    );
}

#[test]
fn gguf_repo_picks_a_file() {
    let files = [
        ("tiny-Q8_0.gguf", weights(4000, 8), true),
        ("tiny-Q4_K_M.gguf", weights(2000, 4), true),
        ("tiny-F16.gguf", weights(8000, 16), true),
    ];
    let mock = MockHub::start(repo_routes("acme/tiny-GGUF", &files, false));
    let home = tempfile::tempdir().unwrap();
    let hub = Hub::new(home.path()).with_hf_endpoint(&mock.url);
    let dir = hub.models_dir().join("hf").join("acme--tiny-GGUF");

    // Bare id: the preferred quantisation, returned as the file itself.
    assert_eq!(
        hub.pull("acme/tiny-GGUF").unwrap(),
        dir.join("tiny-Q4_K_M.gguf")
    );
    // Explicit pick, by substring (case-insensitive) or by exact name.
    assert_eq!(
        hub.resolve("acme/tiny-GGUF:q8_0").unwrap(),
        dir.join("tiny-Q8_0.gguf")
    );
    assert_eq!(
        hub.resolve("acme/tiny-GGUF:tiny-F16.gguf").unwrap(),
        dir.join("tiny-F16.gguf")
    );
    assert_eq!(
        std::fs::read(dir.join("tiny-F16.gguf")).unwrap(),
        files[2].1
    );
    // All three now cached; the bare id still means Q4_K_M.
    let before = mock.requests().len();
    assert_eq!(
        hub.resolve("acme/tiny-GGUF").unwrap(),
        dir.join("tiny-Q4_K_M.gguf")
    );
    assert_eq!(
        hub.resolve("acme/tiny-GGUF:Q8").unwrap(),
        dir.join("tiny-Q8_0.gguf")
    );
    assert_eq!(mock.requests().len(), before);

    let err = hub.resolve("acme/tiny-GGUF:Q2_K").unwrap_err().to_string();
    assert!(err.contains("no GGUF file matches `Q2_K`"), "{err}");
    assert!(err.contains("tiny-Q8_0.gguf"), "{err}");
    let err = hub.resolve("acme/tiny-GGUF:tiny").unwrap_err().to_string();
    assert!(err.contains("matches several"), "{err}");
}

#[test]
fn sha_mismatch_from_the_hub_leaves_nothing() {
    let files = [("tiny.gguf", weights(5000, 7), true)];
    let mock = MockHub::start(repo_routes("acme/broken", &files, true));
    let home = tempfile::tempdir().unwrap();
    let hub = Hub::new(home.path()).with_hf_endpoint(&mock.url);
    let err = hub.pull("acme/broken").unwrap_err().to_string();
    assert!(
        err.contains("sha256 mismatch for acme/broken/tiny.gguf"),
        "{err}"
    );
    assert!(err.contains(&"ab".repeat(32)), "{err}");
    assert!(err.contains(&sha256_bytes(&files[0].1)), "{err}");
    let dir = hub.models_dir().join("hf").join("acme--broken");
    assert!(names_in(&dir).is_empty(), "{:?}", names_in(&dir));
    assert_eq!(hub.cached("acme/broken"), None);
}

#[test]
fn missing_repo_and_unusable_repo_are_clear_errors() {
    let mut routes = repo_routes("acme/empty", &[("README.md", b"hi".to_vec(), false)], false);
    routes.extend(repo_routes(
        "acme/noconfig",
        &[("model.safetensors", weights(10, 0), true)],
        false,
    ));
    let mock = MockHub::start(routes);
    let home = tempfile::tempdir().unwrap();
    let hub = Hub::new(home.path()).with_hf_endpoint(&mock.url);

    let err = hub.pull("acme/missing").unwrap_err().to_string();
    assert!(
        err.contains("acme/missing") && err.contains("HTTP 404"),
        "{err}"
    );
    let err = hub.pull("acme/empty").unwrap_err().to_string();
    assert!(
        err.contains("neither safetensors weights nor a GGUF file"),
        "{err}"
    );
    let err = hub.pull("acme/noconfig").unwrap_err().to_string();
    assert!(err.contains("no config.json"), "{err}");
}

#[test]
fn refused_connection_is_a_one_line_error() {
    // Bind then drop, so the port is (almost certainly) closed.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let home = tempfile::tempdir().unwrap();
    let hub = Hub::new(home.path()).with_hf_endpoint(format!("http://127.0.0.1:{port}"));
    let err = format!("{:#}", hub.resolve("acme/tiny").unwrap_err());
    assert!(
        err.starts_with("cannot reach the Hugging Face hub for acme/tiny: "),
        "{err}"
    );
    assert!(!err.contains('\n'), "{err}");
}

#[test]
fn real_hub_without_network_fails_fast_and_cleanly() {
    // No network on this machine; elsewhere the hub answers 401/404 for this id.
    let home = tempfile::tempdir().unwrap();
    let hub = Hub::new(home.path()).with_connect_timeout(Duration::from_secs(10));
    let start = Instant::now();
    let err = format!(
        "{:#}",
        hub.resolve("trellm-test/no-such-model").unwrap_err()
    );
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "took {:?}",
        start.elapsed()
    );
    assert!(err.contains("trellm-test/no-such-model"), "{err}");
    assert!(err.contains("Hugging Face hub"), "{err}");
    assert!(!err.contains('\n'), "{err}");
    let dir = hub
        .models_dir()
        .join("hf")
        .join("trellm-test--no-such-model");
    assert!(names_in(&dir).is_empty());
}
