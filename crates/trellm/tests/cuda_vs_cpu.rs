//! The CUDA decoder against the CPU decoder on the tiny fixtures (weights rounded to bf16 for
//! both): logits within bf16 tolerance, greedy ids equal except at near-ties. The GPU tests are
//! ignored here and run with `--ignored` on the GPU machine (scripts/gpu/run_cuda.sh).
#![cfg(feature = "cuda")]

use std::path::PathBuf;

use trellm::backend::cuda;

/// Largest relative L2 error of a step's logits (bf16 weights, activations and KV cache).
const REL_TOL: f64 = 5e-2;
/// Ids may differ only where the CPU's top-2 logit gap is below this.
const TIE_GAP: f32 = 5e-2;

fn fixtures() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/tiny"
    ))
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn tiny_fixtures_match_the_cpu() {
    let dir = fixtures();
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(names.len() >= 16, "fixtures missing: {names:?}");
    for name in &names {
        let r = cuda::check_against_cpu(&dir.join(name), 32).unwrap();
        assert!(r.max_rel_err < REL_TOL, "{name}: {r:?}");
        if let Some(gap) = r.gap_at_divergence {
            assert!(gap < TIE_GAP, "{name}: ids differ at a clear choice: {r:?}");
        }
    }
}

/// `generate` runs on the GPU through the same engine as on the CPU: the prefill's logits agree
/// within bf16 tolerance and a greedy run completes.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn generate_runs_on_the_gpu_engine() {
    use trellm::backend::{Device, SoloSequence};
    use trellm::engine::{generate, Flow, Request};
    use trellm_model::Want;
    let dir = fixtures();
    for name in ["llama", "qwen3", "gemma3", "phi3"] {
        let m = trellm::model::load::load(&dir.join(name)).unwrap();
        let vocab = m.model.cfg.vocab as u32;
        let prompt: Vec<u32> = (0..9u32).map(|i| (i * 29 + 5) % vocab).collect();
        let gpu_model = cuda::CudaModel::new(&m.model, 64).unwrap();
        let c = SoloSequence::new(&*m.model, 64)
            .unwrap()
            .forward(&prompt, Want::Last)
            .unwrap();
        let g = SoloSequence::new(&gpu_model, 64)
            .unwrap()
            .forward(&prompt, Want::Last)
            .unwrap();
        assert!(
            cuda::errors(&g, &c).0 < REL_TOL,
            "{name}: prefill logits differ"
        );
        let mut engine = trellm::cli::engine_on(Device::Cuda, &m, 1, 64).unwrap();
        let req = Request {
            prompt: prompt.clone(),
            max_tokens: 16,
            ..Default::default()
        };
        let mut ids = Vec::new();
        generate(&mut engine, req, |s, _| {
            ids.push(s.token);
            Flow::Continue
        })
        .unwrap();
        assert_eq!(ids.len(), 16, "{name}");
    }
}

/// The same batch twice through the CUDA backend gives bit-identical logits at every step (the
/// prefill's and 24 greedy decode steps'), on the tiny llama fixture.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn cuda_steps_are_bit_identical_run_to_run() {
    use trellm::backend::SoloSequence;
    use trellm_model::Want;
    let m = trellm::model::load::load(&fixtures().join("llama")).unwrap();
    let gpu_model = cuda::CudaModel::new(&m.model, 64).unwrap();
    let vocab = m.model.cfg.vocab as u32;
    let prompt: Vec<u32> = (0..11u32).map(|i| (i * 37 + 3) % vocab).collect();
    let run = || {
        let mut s = SoloSequence::new(&gpu_model, 64).unwrap();
        let mut logits = s.forward(&prompt, Want::Last).unwrap();
        let mut all = vec![logits.iter().map(|v| v.to_bits()).collect::<Vec<_>>()];
        for _ in 0..24 {
            let next = trellm::engine::sampler::argmax(&logits);
            logits = s.forward(&[next], Want::Last).unwrap();
            all.push(logits.iter().map(|v| v.to_bits()).collect());
        }
        all
    };
    let (a, b) = (run(), run());
    for (step, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            x == y,
            "step {step}: logits differ between two identical runs"
        );
    }
}

/// Without a usable GPU, `--device cuda` is a one-line error and a non-zero exit.
#[test]
fn device_cuda_without_a_gpu_is_a_clean_error() {
    if cuda::available() {
        return;
    }
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/tiny/llama"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_trellm"))
        .args([
            "generate",
            "-M",
            dir,
            "--prompt-ids",
            "1,2,3",
            "--device",
            "cuda",
        ])
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(
        err.lines().filter(|l| !l.trim().is_empty()).count(),
        1,
        "{err}"
    );
    assert!(err.contains("--device cuda"), "{err}");
}
