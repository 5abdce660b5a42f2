//! `trellm generate` (and every fourth time `trellm info`) on hundreds of mutated copies of each
//! default model: edits aimed at the header, the metadata, the tensor table and the tensor data.
//! Each run must end within
//! [`RUN_TIMEOUT`] either with exit 0 and sane output or with one error line under 500
//! characters; never a panic, an abort, a signal or a hang. Every run is made under an
//! address-space limit of the file's size + the KV cache + [`MARGIN`], so a value in a file
//! that made trellm reserve memory the file does not justify aborts the run and fails the test.
//!
//! `TRELLM_MUTANTS` sets the number of copies per model (default 300 for SmolLM2, 150 for
//! gemma 3), `TRELLM_MUTANT_SEED` the seed.

mod common;

use std::io::Read;
use std::os::unix::fs::FileExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::mutate::{self, FuzzRng};
use common::*;
use rand::Rng;

const RUN_TIMEOUT: Duration = Duration::from_secs(30);
/// Address space beyond the file and the KV cache: the binary, the tokenizer's tables, the
/// decoder's buffers, two worker threads' stacks. Unmutated runs need about 60 MiB (SmolLM2)
/// and 100 MiB (gemma 3) of it.
const MARGIN: u64 = 256 << 20;
const MAX_TOKENS: usize = 4;

#[derive(Debug)]
enum Outcome {
    /// Exit 0 with sane output.
    Ran,
    /// A clean one-line error; its text.
    Refused(String),
    /// Anything else: the reason.
    Bad(String),
}

/// Runs trellm with `args` under an address-space limit and a timeout.
fn run_limited(args: &[String], as_limit: u64) -> Outcome {
    let mut cmd = trellm();
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: only setrlimit, async-signal-safe, between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let lim = libc::rlimit {
                rlim_cur: as_limit,
                rlim_max: as_limit,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("trellm starts");
    let mut out_pipe = child.stdout.take().unwrap();
    let mut err_pipe = child.stderr.take().unwrap();
    let out_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out_pipe.read_to_end(&mut v);
        v
    });
    let err_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err_pipe.read_to_end(&mut v);
        v
    });
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if t0.elapsed() > RUN_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let out = out_t.join().unwrap();
    let err = String::from_utf8_lossy(&err_t.join().unwrap()).into_owned();
    let Some(status) = status else {
        return Outcome::Bad(format!("hang (killed after {RUN_TIMEOUT:?})"));
    };
    if let Some(sig) = status.signal() {
        return Outcome::Bad(format!("signal {sig}: {}", err.trim()));
    }
    if err.contains("panicked") {
        return Outcome::Bad(format!("panic: {}", err.trim()));
    }
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    if status.code() == Some(0) {
        let Ok(text) = String::from_utf8(out) else {
            return Outcome::Bad("stdout is not UTF-8".into());
        };
        if args.iter().any(|a| a == "--json") {
            match serde_json::from_str::<serde_json::Value>(&text) {
                Ok(v) if v["finish_reason"].is_string() && v["ids"].is_array() => {}
                _ => return Outcome::Bad(format!("--json output is not a result: {text:.200}")),
            }
        }
        if lines.iter().any(|l| !l.starts_with("trellm: warning")) {
            return Outcome::Bad(format!("exit 0 with messages: {}", err.trim()));
        }
        return Outcome::Ran;
    }
    if lines.len() != 1 {
        return Outcome::Bad(format!("{} lines of error: {err:.600}", lines.len()));
    }
    let line = lines[0];
    if line.chars().count() >= 500 || !line.starts_with("error: ") {
        return Outcome::Bad(format!("malformed error line: {line:.600}"));
    }
    if line.chars().any(|c| c.is_control()) {
        return Outcome::Bad(format!("control characters in: {line:?}"));
    }
    Outcome::Refused(line.to_string())
}

/// New bytes for `old` (one field's worth, edited in place so the file keeps its length).
fn edit(rng: &mut FuzzRng, old: &[u8]) -> Vec<u8> {
    let mut b = old.to_vec();
    // Only the in-place kinds of edit: flips, bytes, integers, floats.
    loop {
        let mut t = b.clone();
        mutate::mutate_at(rng, &mut t, Some(0));
        if t.len() == b.len() && t != b {
            b = t;
            break;
        }
    }
    b
}

/// Mutates `n` copies of the model at `alias` one after another (one working copy, each edit
/// undone after its run) and checks every run.
fn mutants(alias: &str, default_n: usize, kv_bytes_per_token: u64, seed: u64) {
    let src = model_path(alias);
    let n = std::env::var("TRELLM_MUTANTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_n);
    let seed = std::env::var("TRELLM_MUTANT_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(seed);
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("mutant.gguf");
    std::fs::copy(&src, &copy).unwrap();
    let real = std::fs::read(&src).unwrap();
    let layout = mutate::gguf_layout(&real);
    // Generous: prompt + generated tokens, far below the context.
    let kv = kv_bytes_per_token * 256;
    let limit = real.len() as u64 + kv + MARGIN;
    let file = std::fs::OpenOptions::new().write(true).open(&copy).unwrap();
    let model = copy.to_str().unwrap().to_string();
    let mut rng = mutate::rng(seed);
    let (mut ran, mut refused, mut bad) = (0usize, 0usize, Vec::new());
    let mut by_region: std::collections::BTreeMap<&str, [usize; 2]> = Default::default();
    let mut reasons: std::collections::BTreeMap<String, usize> = Default::default();
    let t0 = Instant::now();
    for i in 0..n {
        let mut edits = Vec::new();
        let mut region = "";
        for _ in 0..rng.gen_range(1..=2) {
            let (r, pos) = mutate::gguf_target(&mut rng, &layout);
            region = r;
            let w = 8.min(real.len() - pos);
            let old = real[pos..pos + w].to_vec();
            let new = edit(&mut rng, &old);
            file.write_all_at(&new, pos as u64).unwrap();
            edits.push((pos, old, new));
        }
        let mut args: Vec<String> = ["generate", "--model", &model, "--threads", "2", "-q"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.extend(["--max-tokens".into(), MAX_TOKENS.to_string()]);
        match i % 4 {
            0 => args.extend(["--prompt".into(), "Hi there".into()]),
            1 => args.extend(["--prompt".into(), "The".into(), "--raw".into()]),
            2 => args.extend(["--prompt-ids".into(), "1,2,3".into(), "--json".into()]),
            // `info` reads (and prints) what generate skips: names, the template.
            _ => args = vec!["info".into(), model.clone()],
        }
        let outcome = run_limited(&args, limit);
        // Undo, last edit first (they may overlap).
        for (pos, old, _) in edits.iter().rev() {
            file.write_all_at(old, *pos as u64).unwrap();
        }
        let e = by_region.entry(region).or_default();
        match outcome {
            Outcome::Ran => {
                ran += 1;
                e[0] += 1;
            }
            Outcome::Refused(line) => {
                refused += 1;
                e[1] += 1;
                // Group by the message without its numbers and paths.
                let key: String = line
                    .replace(&model, "FILE")
                    .split_whitespace()
                    .take(7)
                    .collect::<Vec<_>>()
                    .join(" ")
                    .chars()
                    .filter(|c| !c.is_ascii_digit())
                    .collect();
                *reasons.entry(key).or_default() += 1;
            }
            Outcome::Bad(why) => {
                // Enough to rebuild the copy: each edit's offset and new bytes.
                let e: Vec<String> = edits
                    .iter()
                    .map(|(p, _, new)| format!("at {p}: {new:02x?}"))
                    .collect();
                bad.push(format!("mutant {i} ({region}; {}): {why}", e.join(", ")))
            }
        }
    }
    eprintln!(
        "{alias}: {n} mutated copies in {:.0}s, limit {} MiB (file {} MiB + KV + {} MiB): \
         {ran} ran (exit 0), {refused} refused with one error line, {} bad",
        t0.elapsed().as_secs_f64(),
        limit >> 20,
        real.len() >> 20,
        MARGIN >> 20,
        bad.len()
    );
    for (r, [ok, err]) in &by_region {
        eprintln!("  {r}: {ok} ran, {err} refused");
    }
    let mut reasons: Vec<_> = reasons.into_iter().collect();
    reasons.sort_by_key(|r| std::cmp::Reverse(r.1));
    for (r, c) in reasons.iter().take(12) {
        eprintln!("  {c:>4} x {r}");
    }
    assert!(
        bad.is_empty(),
        "{} bad runs:\n{}",
        bad.len(),
        bad.join("\n")
    );
    // The unmutated copy still runs under the same limit.
    let args: Vec<String> = [
        "generate",
        "--model",
        &model,
        "--threads",
        "2",
        "-q",
        "--prompt",
        "Hi",
        "--max-tokens",
        "4",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    assert!(matches!(run_limited(&args, limit), Outcome::Ran));
}

#[test]
fn mutated_smollm2() {
    // 30 layers x K and V x 3 heads x 64 x f32.
    mutants("smollm2-135m-instruct", 300, 30 * 2 * 3 * 64 * 4, 1);
}

#[test]
fn mutated_gemma3() {
    // 18 layers x K and V x 1 head x 256 x f32.
    mutants("gemma-3-270m", 150, 18 * 2 * 256 * 4, 2);
}

/// Mutant 145 of the first gemma run (seed 2): a metadata key's bytes and a later length edited,
/// so that the parser read the rest of the file as metadata and copied 256 MiB of it (beyond the
/// limit; it aborted). Metadata memory is now bounded, and the copy is refused at once.
#[test]
fn regression_gemma3_metadata_reading_the_whole_file() {
    let src = model_path("gemma-3-270m");
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("m145.gguf");
    std::fs::copy(&src, &copy).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&copy).unwrap();
    f.write_all_at(&[8, 0, 0, 0, 0, 0, 0, 0], 6511008).unwrap();
    f.write_all_at(&[0xbd, 0x37, 0x86, 0xb5, 0x70, 0x65, 0x2e, 0x66], 727)
        .unwrap();
    let len = std::fs::metadata(&copy).unwrap().len();
    let args: Vec<String> = [
        "generate",
        "--model",
        copy.to_str().unwrap(),
        "--prompt",
        "Hi",
        "-q",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    match run_limited(&args, len + MARGIN) {
        Outcome::Refused(line) => assert!(line.contains("more than 128 MiB"), "{line}"),
        o => panic!("{o:?}"),
    }
}
