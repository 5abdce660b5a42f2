//! Batched decoding of left-padded rows: each row of a batch gets the logits it gets alone.
//! Runs on the tiny fixtures of several families (sliding windows, NoPE layers, dynamic RoPE,
//! soft-capping), prefill and decode steps alike.

use std::path::PathBuf;
use trellm::model::decoder::Logits;
use trellm::model::load::load;
use trellm::model::KvCache;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/tiny"
    ))
    .join(name)
}

/// Largest |a - b|.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Two prompts of different lengths, left-padded to one length, prefilled together, then
/// decoded greedily together for `steps`; each row's logits at every step against the row
/// run alone.
fn check(name: &str, a: &[u32], b: &[u32], steps: usize) {
    let model = load(&fixture(name)).unwrap();
    let dec = &model.decoder;
    let vocab = dec.cfg.vocab;
    let rows = [a, b];
    let len = a.len().max(b.len());
    let pads: Vec<usize> = rows.iter().map(|r| len - r.len()).collect();

    // Alone: logits after the prompt and after each greedy token.
    let alone: Vec<Vec<Vec<f32>>> = rows
        .iter()
        .map(|r| {
            let mut cache = KvCache::new(&dec.cfg);
            let mut out = vec![dec.forward(r, &mut cache, Logits::Last)];
            for _ in 0..steps {
                let t = argmax(out.last().unwrap());
                out.push(dec.forward(&[t], &mut cache, Logits::Last));
            }
            out
        })
        .collect();

    let mut cache = KvCache::batch(&dec.cfg, &pads);
    let mut tokens = Vec::new();
    for (r, &p) in rows.iter().zip(&pads) {
        // The padding token's value must not matter: use a different one per row.
        tokens.extend(std::iter::repeat_n(7 + p as u32, p));
        tokens.extend_from_slice(r);
    }
    let mut logits = dec.forward_batch(&tokens, &mut cache, Logits::Last);
    let mut worst = 0.0f32;
    for step in 0..=steps {
        let mut next = Vec::new();
        for (row, al) in alone.iter().enumerate() {
            let got = &logits[row * vocab..(row + 1) * vocab];
            let d = max_diff(got, &al[step]);
            worst = worst.max(d);
            // A batch may take a different (equally exact) matmul path than a single row, which
            // reorders f32 sums: agreement is to rounding, the tolerance of the mlx-lm oracle.
            assert!(
                d <= 1e-4,
                "{name}: row {row} step {step}: batched logits differ from alone by {d:e}"
            );
            next.push(argmax(&al[step]));
        }
        if step < steps {
            logits = dec.forward_batch(&next, &mut cache, Logits::Last);
        }
    }
    eprintln!("{name}: batched vs alone max diff {worst:e}");
}

#[test]
fn left_padded_rows_match_running_alone() {
    let a: Vec<u32> = vec![11, 45, 3, 200, 17, 99, 150, 23, 64, 8, 31, 77];
    let b: Vec<u32> = vec![5, 120, 33];
    for name in [
        "llama",
        "gemma3",
        "gemma2",
        "smollm3",
        "llama-rope-dynamic",
        "phi3",
        "starcoder2",
    ] {
        // 12 + 16 positions run past llama-rope-dynamic's 24.
        check(name, &a, &b, 16);
        check(name, &b, &a, 4);
    }
}

#[test]
fn batch_of_one_is_forward() {
    let model = load(&fixture("qwen3")).unwrap();
    let dec = &model.decoder;
    let prompt = [4u32, 80, 15, 230, 9];
    let mut c1 = KvCache::new(&dec.cfg);
    let mut c2 = KvCache::batch(&dec.cfg, &[0]);
    let x = dec.forward(&prompt, &mut c1, Logits::All);
    let y = dec.forward_batch(&prompt, &mut c2, Logits::All);
    assert_eq!(x, y);
    assert_eq!(x.len(), prompt.len() * dec.cfg.vocab);
}
