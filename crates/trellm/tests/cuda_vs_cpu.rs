//! The CUDA decoder against the CPU decoder on the tiny fixtures (weights rounded to bf16 for
//! both): logits within bf16 tolerance, greedy ids equal except at near-ties. Skipped where no
//! CUDA device is usable (the H200 run does the same through `trellm bench --device cuda --check`,
//! see scripts/gpu/run_cuda.sh).
#![cfg(feature = "cuda")]

use std::path::PathBuf;

use trellm::backend::cuda;

/// Largest relative L2 error of a step's logits (bf16 weights, activations and KV cache).
const REL_TOL: f64 = 5e-2;
/// Ids may differ only where the CPU's top-2 logit gap is below this.
const TIE_GAP: f32 = 5e-2;

#[test]
fn tiny_fixtures_match_the_cpu() {
    if !cuda::available() {
        eprintln!("skipped: {}", cuda::unavailable_reason());
        return;
    }
    let dir = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/tiny"
    ));
    for name in [
        "llama",
        "gemma2",
        "gemma3",
        "qwen3",
        "phi3",
        "olmo2",
        "starcoder2",
        "granite",
    ] {
        let r = cuda::check_against_cpu(&dir.join(name), 32).unwrap();
        assert!(r.max_rel_err < REL_TOL, "{name}: {r:?}");
        if let Some(gap) = r.gap_at_divergence {
            assert!(gap < TIE_GAP, "{name}: ids differ at a clear choice: {r:?}");
        }
    }
}
