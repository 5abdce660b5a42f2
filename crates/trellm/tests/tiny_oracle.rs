//! Fidelity against mlx-lm on tiny seeded-random models, one per architecture variant:
//! `tests/fixtures/tiny/<name>/{config.json, model.safetensors, oracle.json}`, written by
//! `scripts/oracle/tiny_models.py` (which calls mlx-lm; CI only reads the committed files).
//!
//! For every folder and every case: greedy ids equal at every step (until a step where the
//! oracle's top-2 gap is a near-tie), every step's top-20 logprobs within 1e-4 of mlx-lm's,
//! and step 0's logprobs over the whole vocabulary within 1e-4.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Largest allowed |ours - mlx-lm| for a logprob (both float32 computations).
const LOGPROB_TOL: f64 = 1e-4;
/// Past a step whose oracle top-2 gap is below this, the reference's choice is a coin toss.
const TIE_GAP: f64 = 1e-4;
/// Each step's oracle records this many top logprobs.
const TOP_K: usize = 20;
/// At most this many messages per case: after the first divergence the rest is noise.
const MAX_ERRORS: usize = 4;

fn fixtures_dir() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/tiny"
    ))
}

/// Every fixture folder (those with an oracle.json), sorted by name.
fn model_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .expect("tests/fixtures/tiny exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("oracle.json").is_file())
        .collect();
    dirs.sort();
    dirs
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("an id list")
        .iter()
        .map(|x| x.as_u64().expect("an id"))
        .collect()
}

/// `[[id, logprob], ...]` as pairs.
fn pairs(v: &Value) -> Vec<(u64, f64)> {
    v.as_array()
        .expect("a list of [id, logprob]")
        .iter()
        .map(|p| {
            (
                p[0].as_u64().expect("an id"),
                p[1].as_f64().expect("a logprob"),
            )
        })
        .collect()
}

/// Runs `trellm generate` on the folder from `prompt` and returns its JSON output.
fn generate(dir: &Path, prompt: &[u64], max_tokens: usize, top: usize) -> Result<Value, String> {
    let prompt = prompt
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let out = Command::new(env!("CARGO_BIN_EXE_trellm"))
        .arg("generate")
        .arg("--model")
        .arg(dir)
        .args([
            "--prompt-ids",
            &prompt,
            "--max-tokens",
            &max_tokens.to_string(),
        ])
        .args(["--json", "--logprobs", &top.to_string(), "--quiet"])
        .output()
        .map_err(|e| format!("cannot run trellm: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "trellm exited with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    serde_json::from_str(stdout.trim())
        .map_err(|e| format!("trellm's output is not JSON ({e}): {stdout}"))
}

/// What one case's comparison saw.
#[derive(Default)]
struct CaseResult {
    max_top_diff: f64,
    max_step0_diff: f64,
    steps_compared: usize,
    note: Option<String>,
    errors: Vec<String>,
    more_errors: usize,
}

impl CaseResult {
    fn fail(&mut self, msg: String) {
        if self.errors.len() < MAX_ERRORS {
            self.errors.push(msg);
        } else {
            self.more_errors += 1;
        }
    }
}

/// Greedy ids and top-20 logprobs at every step.
fn check_greedy(dir: &Path, case: &Value, r: &mut CaseResult) {
    let prompt = ids(&case["prompt_ids"]);
    let want = ids(&case["greedy_ids"]);
    let steps = case["steps"].as_array().expect("steps");
    let got = match generate(dir, &prompt, want.len(), TOP_K) {
        Ok(v) => v,
        Err(e) => return r.fail(e),
    };
    if ids(&got["prompt_ids"]) != prompt {
        r.fail(format!(
            "prompt ids echoed as {:?}, expected {prompt:?}",
            ids(&got["prompt_ids"])
        ));
    }
    let got_ids = ids(&got["ids"]);
    let got_lp = got["logprobs"]
        .as_array()
        .map(|a| a.as_slice())
        .unwrap_or_default();
    for (s, step) in steps.iter().enumerate() {
        let gold = pairs(&step["top"]);
        let gap = gold[0].1 - gold[1].1;
        let Some(ours) = got_lp.get(s).map(pairs) else {
            r.fail(format!(
                "step {s}: no logprobs (trellm gave {} steps, ids {got_ids:?})",
                got_lp.len()
            ));
            return;
        };
        if ours.len() < TOP_K {
            r.fail(format!(
                "step {s}: {} logprobs, expected {TOP_K}",
                ours.len()
            ));
        }
        let floor = ours.last().map_or(f64::NEG_INFINITY, |p| p.1);
        let mut step_diff = 0.0f64;
        let mut bad = Vec::new();
        for &(tid, lp) in &gold {
            match ours.iter().find(|p| p.0 == tid) {
                Some(&(_, o)) => {
                    step_diff = step_diff.max((o - lp).abs());
                    if (o - lp).abs() > LOGPROB_TOL {
                        bad.push(format!("token {tid}: {o:.7} vs {lp:.7}"));
                    }
                }
                // Missing from our top-20 only if it sits at the edge, tied with our 20th.
                None if (lp - floor).abs() <= LOGPROB_TOL => {}
                None => bad.push(format!(
                    "token {tid} ({lp:.7}) missing from ours (our 20th: {floor:.7})"
                )),
            }
        }
        r.max_top_diff = r.max_top_diff.max(step_diff);
        r.steps_compared = s + 1;
        if !bad.is_empty() {
            r.fail(format!(
                "step {s}: top-{TOP_K} logprobs differ by up to {step_diff:.2e} ({} tokens off; {})",
                bad.len(),
                bad.iter().take(3).cloned().collect::<Vec<_>>().join(", ")
            ));
        }
        if gap < TIE_GAP {
            // The id at a near-tie is the reference's coin toss; later steps follow from it.
            r.note = Some(format!(
                "near-tie at step {s} (gap {gap:.1e}); later steps not compared"
            ));
            return;
        }
        match got_ids.get(s) {
            Some(&g) if g == want[s] => {}
            other => {
                r.fail(format!(
                    "step {s}: greedy id {other:?}, mlx-lm {} (oracle top-2 gap {gap:.2e}); ids {got_ids:?} vs {want:?}",
                    want[s]
                ));
                return;
            }
        }
    }
    if got_ids.len() != want.len() {
        r.fail(format!(
            "{} ids, mlx-lm {} ({got_ids:?} vs {want:?})",
            got_ids.len(),
            want.len()
        ));
    }
}

/// Step 0's logprobs over the whole vocabulary.
fn check_step0(dir: &Path, case: &Value, r: &mut CaseResult) {
    let prompt = ids(&case["prompt_ids"]);
    let gold: Vec<f64> = case["step0_logprobs"]
        .as_array()
        .expect("step0_logprobs")
        .iter()
        .map(|v| v.as_f64().expect("a logprob"))
        .collect();
    let got = match generate(dir, &prompt, 1, gold.len()) {
        Ok(v) => v,
        Err(e) => return r.fail(format!("step 0, full vocabulary: {e}")),
    };
    let Some(ours) = got["logprobs"]
        .as_array()
        .and_then(|a| a.first())
        .map(pairs)
    else {
        return r.fail("step 0, full vocabulary: no logprobs".into());
    };
    let mut seen = vec![false; gold.len()];
    let mut worst = (0.0f64, 0usize);
    for (tid, lp) in ours {
        let Some(&g) = gold.get(tid as usize) else {
            return r.fail(format!(
                "step 0: token id {tid} outside the vocabulary ({})",
                gold.len()
            ));
        };
        seen[tid as usize] = true;
        if (lp - g).abs() > worst.0 {
            worst = ((lp - g).abs(), tid as usize);
        }
    }
    r.max_step0_diff = worst.0;
    let missing = seen.iter().filter(|s| !**s).count();
    if missing > 0 {
        r.fail(format!(
            "step 0: {missing} of {} vocabulary logprobs missing",
            gold.len()
        ));
    }
    if worst.0 > LOGPROB_TOL {
        r.fail(format!(
            "step 0, full vocabulary: max diff {:.2e} at token {} (mlx-lm {:.7})",
            worst.0, worst.1, gold[worst.1]
        ));
    }
}

#[test]
fn tiny_models_match_mlx_lm() {
    let dirs = model_dirs();
    let names: Vec<String> = dirs
        .iter()
        .map(|d| d.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    // One fixture per family, plus rope-scaling variants.
    for expected in [
        "llama",
        "llama-untied",
        "llama-rope-llama3",
        "llama-rope-yarn",
        "llama-rope-dynamic",
        "llama-rope-linear-bias",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma",
        "gemma2",
        "gemma3",
        "phi3",
        "olmo2",
        "granite",
        "smollm3",
        "starcoder2",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "fixture {expected} missing from {}",
            fixtures_dir().display()
        );
    }
    let (mut failures, mut summary) = (Vec::new(), Vec::new());
    for (dir, name) in dirs.iter().zip(&names) {
        let oracle = read_json(&dir.join("oracle.json"));
        let (mut top, mut step0) = (0.0f64, 0.0f64);
        for case in oracle["cases"].as_array().expect("cases") {
            let id = case["id"].as_str().unwrap_or("?");
            let mut r = CaseResult::default();
            check_step0(dir, case, &mut r);
            check_greedy(dir, case, &mut r);
            if r.more_errors > 0 {
                r.errors.push(format!("... and {} more", r.more_errors));
            }
            top = top.max(r.max_top_diff);
            step0 = step0.max(r.max_step0_diff);
            eprintln!(
                "{name}/{id}: {} steps compared, max top-{TOP_K} diff {:.2e}, step-0 vocabulary diff {:.2e}{}",
                r.steps_compared,
                r.max_top_diff,
                r.max_step0_diff,
                r.note.as_deref().map(|n| format!("; {n}")).unwrap_or_default()
            );
            failures.extend(r.errors.into_iter().map(|e| format!("{name}/{id}: {e}")));
        }
        summary.push(format!(
            "{name}: max top-{TOP_K} diff {top:.2e}, max step-0 vocabulary diff {step0:.2e}"
        ));
        eprintln!("{}", summary.last().unwrap());
    }
    assert!(
        failures.is_empty(),
        "trellm differs from mlx-lm (tolerance {LOGPROB_TOL:.0e}):\n{}\n{}",
        failures.join("\n"),
        summary.join("\n")
    );
}
