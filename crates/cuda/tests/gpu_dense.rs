//! GPU tests of the dense decoder on synthetic weights. Ignored here; run with `--ignored` on the
//! GPU machine (scripts/gpu/run_cuda.sh).

use std::sync::Arc;

use trellm_cuda::dense::{DenseModel, DenseWeights};
use trellm_cuda::{bench, Gpu};
use trellm_model::rope::Rope;
use trellm_model::{ModelConfig, Plan};

/// The decoder for `cfg` with its plan.
fn model(gpu: Arc<Gpu>, cfg: &ModelConfig, w: DenseWeights, ctx: usize) -> DenseModel {
    DenseModel::new(gpu, cfg, &Plan::new(cfg), w, ctx, ctx).unwrap()
}

fn gpu() -> Arc<Gpu> {
    assert!(
        trellm_cuda::available(),
        "{}",
        trellm_cuda::unavailable_reason()
    );
    Arc::new(Gpu::new(0).expect("a usable device"))
}

/// Prefill of n tokens and (prefill of n-1, then one graph-replayed decode step) give the same
/// logits and the same argmax: the decode path (GEMV, split attention, graph) agrees with the
/// prefill path (cuBLAS, one split).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn decode_step_matches_prefill() {
    let gpu = gpu();
    let cfg = bench::shape("tiny").unwrap();
    let tokens: Vec<u32> = (0..40u32)
        .map(|i| (i * 97 + 5) % cfg.vocab as u32)
        .collect();
    let w = DenseWeights::synthetic(&gpu, &cfg, 7).unwrap();
    let mut m = model(gpu, &cfg, w, 64);
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

/// A tiny synthetic model with the given attention geometry (sliding window on layer 0).
fn geometry(head_dim: usize, n_heads: usize, n_kv: usize, window: Option<usize>) -> ModelConfig {
    let mut cfg = bench::shape("tiny").unwrap();
    cfg.head_dim = head_dim;
    cfg.n_heads = n_heads;
    cfg.n_kv_heads = n_kv;
    cfg.attn_scale = (head_dim as f32).powf(-0.5);
    for (l, spec) in cfg.layers.iter_mut().enumerate() {
        spec.rope = Some(Rope::plain(head_dim, 10000.0, false, 1.0));
        spec.sliding_window = if l == 0 { window } else { None };
    }
    cfg
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Every decode attention path against the prefill's attention (cuBLAS GEMMs), for head dims 64
/// to 256 (each a separately compiled kernel), GQA groups of 1, 4 and 7 and a sliding window: a
/// step at a short context runs the cluster attention, one past `cluster_ctx` (1024) the splits
/// and the combine kernel.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn decode_attention_paths_match_prefill_across_geometries() {
    let gpu = gpu();
    for (hd, nh, nkv, window) in [
        (64, 4, 4, None),
        (80, 8, 2, Some(300)),
        (96, 7, 1, None),
        (128, 8, 2, Some(40)),
        (256, 4, 1, None),
    ] {
        let cfg = geometry(hd, nh, nkv, window);
        for n in [40usize, 1100] {
            let tokens: Vec<u32> = (0..n as u32)
                .map(|i| (i * 97 + 5) % cfg.vocab as u32)
                .collect();
            let w = DenseWeights::synthetic(&gpu, &cfg, 11).unwrap();
            let mut m = model(gpu.clone(), &cfg, w, 1200);
            m.prefill(&tokens).unwrap();
            let full = m.logits().unwrap();
            m.reset().unwrap();
            m.prefill(&tokens[..n - 1]).unwrap();
            m.set_next_token(tokens[n - 1]).unwrap();
            m.decode_step().unwrap();
            let stepped = m.logits().unwrap();
            assert!(full.iter().all(|v| v.is_finite()), "hd {hd}, n {n}");
            let rel = rel_err(&full, &stepped);
            assert!(
                rel < 2e-2,
                "hd {hd} heads {nh}/{nkv} window {window:?} n {n}: {rel}"
            );
        }
    }
}

/// The prefill's logits and every decode step's, as bits.
fn run_bits(m: &mut DenseModel, prompt: &[u32], steps: usize) -> Vec<Vec<u32>> {
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    m.reset().unwrap();
    m.prefill(prompt).unwrap();
    let mut out = vec![bits(m.logits().unwrap())];
    for _ in 0..steps {
        // The step's input is the previous argmax, left on the device by the graph.
        m.decode_step().unwrap();
        out.push(bits(m.logits().unwrap()));
    }
    out
}

/// The same request twice gives bit-identical logits at every step (no reduction whose order
/// depends on which block finishes first), on a shape wide enough for the deferred-norm sums to
/// take 512 blocks' partials, at contexts on both decode attention paths (cluster and splits).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn decode_is_bit_identical_run_to_run() {
    let gpu = gpu();
    let mut cfg = geometry(128, 16, 4, None);
    cfg.hidden = 2048;
    cfg.intermediate = 5632;
    cfg.vocab = 8192;
    let w = DenseWeights::synthetic(&gpu, &cfg, 3).unwrap();
    let mut m = model(gpu, &cfg, w, 1200);
    for n in [20usize, 1030] {
        let prompt: Vec<u32> = (0..n as u32)
            .map(|i| (i * 131 + 17) % cfg.vocab as u32)
            .collect();
        let a = run_bits(&mut m, &prompt, 24);
        let b = run_bits(&mut m, &prompt, 24);
        for (step, (x, y)) in a.iter().zip(&b).enumerate() {
            let diff = x.iter().zip(y).filter(|(p, q)| p != q).count();
            assert_eq!(diff, 0, "prompt {n}: step {step}: {diff} logits differ");
        }
    }
}
