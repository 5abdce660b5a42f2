//! GPU tests of the dense decoder on the tiny synthetic shape. Skipped (with a message) where no
//! CUDA driver and device are usable.

use std::sync::Arc;

use trellm_cuda::dense::{DenseModel, DenseWeights};
use trellm_cuda::{bench, Gpu};

fn gpu() -> Option<Arc<Gpu>> {
    if !trellm_cuda::available() {
        eprintln!("skipped: {}", trellm_cuda::unavailable_reason());
        return None;
    }
    Some(Arc::new(Gpu::new(0).expect("a usable device")))
}

/// Prefill of n tokens and (prefill of n-1, then one graph-replayed decode step) give the same
/// logits and the same argmax: the decode path (GEMV, split attention, graph) agrees with the
/// prefill path (cuBLAS, one split).
#[test]
fn decode_step_matches_prefill() {
    let Some(gpu) = gpu() else { return };
    let cfg = bench::shape("tiny").unwrap();
    let tokens: Vec<u32> = (0..40u32)
        .map(|i| (i * 97 + 5) % cfg.vocab as u32)
        .collect();
    let w = DenseWeights::synthetic(&gpu, &cfg, 7).unwrap();
    let mut m = DenseModel::new(gpu, cfg, w, 64, 64).unwrap();
    m.prefill(&tokens).unwrap();
    let full = m.logits().unwrap();
    m.reset().unwrap();
    m.prefill(&tokens[..39]).unwrap();
    m.set_next_token(tokens[39]).unwrap();
    m.decode_step().unwrap();
    let stepped = m.logits().unwrap();
    assert!(full.iter().all(|v| v.is_finite()));
    let num: f64 = full
        .iter()
        .zip(&stepped)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = full.iter().map(|a| (*a as f64).powi(2)).sum();
    let rel = (num / den).sqrt();
    assert!(rel < 2e-2, "relative difference {rel}");
    // Replaying the graph keeps advancing: 8 more steps, 9 ids recorded.
    m.decode(8).unwrap();
    assert_eq!(m.history().unwrap().len(), 9);
    assert_eq!(m.len(), 48);
}
