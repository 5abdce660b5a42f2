//! Tensor parallelism's split on the CPU: a model sharded over simulated ranks (each rank's
//! heads and MLP features run apart, the partial projections summed) gives the logits of the
//! unsharded model, within the rounding of a sum split into parts, and the same greedy ids.
//! EXL3 layers split on their 128-wide Hadamard blocks. Models that do not split (too few kv
//! heads, a q/k norm over all heads, blocks that a slice would cut) are refused with a clear
//! error.

mod common;

use std::path::{Path, PathBuf};

use trellm::backend::cpu::{CpuModel, ShardedCpu};
use trellm::backend::SoloSequence;
use trellm::model::load::load;
use trellm_model::{ModelBackend, Want};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/tiny"
    ))
    .join(name)
}

/// Logits of the prompt's every token, then of `steps` greedy decode steps (the unsharded
/// model's choices, fed to both).
fn run<M: ModelBackend>(m: &M, prompt: &[u32], ids: &[u32]) -> Vec<Vec<f32>> {
    let mut seq = SoloSequence::new(m, prompt.len() + ids.len() + 1).unwrap();
    let mut out = vec![seq.forward(prompt, Want::All).unwrap()];
    for &id in ids {
        out.push(seq.forward(&[id], Want::Last).unwrap());
    }
    out
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap() as u32
}

/// Sharded over `world` against unsharded: the largest logit difference relative to the
/// logits' scale, and whether every greedy id agrees.
fn compare(path: &Path, world: usize, prompt: &[u32], steps: usize) -> (f32, bool) {
    compare_model(&load(path).unwrap().model, world, prompt, steps)
}

fn compare_model(full: &CpuModel, world: usize, prompt: &[u32], steps: usize) -> (f32, bool) {
    let vocab = full.cfg.vocab;
    // The unsharded model's greedy continuation.
    let mut ids = Vec::new();
    {
        let mut seq = SoloSequence::new(full, prompt.len() + steps + 1).unwrap();
        let mut last = seq.forward(prompt, Want::Last).unwrap();
        for _ in 0..steps {
            let id = argmax(&last);
            ids.push(id);
            last = seq.forward(&[id], Want::Last).unwrap();
        }
    }
    let sharded = ShardedCpu::new(full, world).unwrap();
    let (a, b) = (run(full, prompt, &ids), run(&sharded, prompt, &ids));
    let (mut worst, mut same) = (0.0f32, true);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.len(), y.len());
        for (rx, ry) in x.chunks(vocab).zip(y.chunks(vocab)) {
            let scale = rx.iter().fold(1.0f32, |m, v| m.max(v.abs()));
            let d = rx
                .iter()
                .zip(ry)
                .fold(0.0f32, |m, (p, q)| m.max((p - q).abs()));
            worst = worst.max(d / scale);
            same &= argmax(rx) == argmax(ry);
        }
    }
    (worst, same)
}

/// Every tiny family with two kv heads, split over two ranks: q/k/v and gate/up by rows, o and
/// down by columns, biases (qwen2's qkv, starcoder2's o and MLP), phi3's fused projections,
/// post-norms (gemma2/3), soft-capping, sliding windows and NoPE layers.
#[test]
fn two_ranks_match_one_on_every_tiny_family() {
    let prompt: Vec<u32> = (0..13).map(|i| (i * 37 + 5) % 200).collect();
    let mut checked = Vec::new();
    for name in [
        "llama",
        "llama-rope-linear-bias",
        "llama-rope-yarn",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma2",
        "gemma3",
        "granite",
        "phi3",
        "smollm3",
        "starcoder2",
    ] {
        let (worst, same) = compare(&fixture(name), 2, &prompt, 8);
        assert!(
            worst < 1e-5 && same,
            "{name}: sharded logits differ by {worst:e} of their scale (same greedy ids: {same})"
        );
        checked.push(format!("{name} {worst:.1e}"));
    }
    eprintln!(
        "two ranks, largest relative logit difference: {}",
        checked.join(", ")
    );
}

/// The real default model (SmolLM2-135M, Q4_1: 9 heads over 3 kv heads, 1536 MLP features)
/// over three ranks: o's 192-column and down's 512-column slices fall on the 32-value blocks.
#[test]
fn three_ranks_match_one_on_smollm2() {
    let path = common::model_path("smollm2-135m-instruct");
    let prompt: Vec<u32> = vec![1, 504, 3458, 282, 4780, 314, 253, 1767, 30];
    let (worst, same) = compare(&path, 3, &prompt, 16);
    eprintln!("SmolLM2 over 3 ranks: largest relative logit difference {worst:.1e}");
    assert!(
        worst < 1e-4 && same,
        "sharded logits differ by {worst:e} of their scale (same greedy ids: {same})"
    );
}

/// An EXL3 model our quantizer writes (2 layers, four 128-wide query heads over two kv heads, 512
/// MLP features; MUL1 at 3 bits and 3INST at 2.5), over two ranks: q/k/v and gate/up by whole
/// 128-output Hadamard blocks, o and down by 128-input ones, each rank's partial product with
/// the output Hadamard and scales applied. On the exact path, and on MUL1's int16 activations:
/// those round per 16 inputs, so a rank's slice rounds as the whole does, but each product ends
/// in `A s + B` with A s ~ -B (MUL1's offset times the activations' sum), and that cancellation
/// in f32 per rank instead of once costs more than a plain split sum.
#[test]
fn two_ranks_match_one_on_exl3_models() {
    use trellm::backend::cpu::Exl3Activations;
    use trellm_quant::exl3::Codebook;
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    common::write_llama_for_exl3(&src, &common::HD128_TWO_KV, 41);
    let prompt: Vec<u32> = (0..13).map(|i| (i * 53 + 7) % 512).collect();
    let mut checked = Vec::new();
    for (codebook, bits) in [(Codebook::Mul1, 3.0), (Codebook::Inst3, 2.5)] {
        let out = d.path().join(format!("{codebook:?}-{bits}"));
        common::quantize_exl3(&src, &out, codebook, bits);
        let mut lm = load(&out).unwrap();
        for acts in [Exl3Activations::Exact, Exl3Activations::Int16] {
            std::sync::Arc::get_mut(&mut lm.model)
                .unwrap()
                .exl3_activations = acts;
            let (worst, same) = compare_model(&lm.model, 2, &prompt, 8);
            let bound = match acts {
                Exl3Activations::Exact => 1e-5,
                Exl3Activations::Int16 => 2e-4,
            };
            assert!(
                worst < bound && same,
                "{codebook:?} {bits} {acts:?}: sharded logits differ by {worst:e} of their \
                 scale (same greedy ids: {same})"
            );
            checked.push(format!("{codebook:?} {bits} {acts:?} {worst:.1e}"));
        }
    }
    eprintln!(
        "EXL3 over two ranks, largest relative logit difference: {}",
        checked.join(", ")
    );
}

#[test]
fn models_that_do_not_split_are_refused_clearly() {
    let refusal = |path: &Path, world: usize| {
        let lm = load(path).unwrap();
        match ShardedCpu::new(&lm.model, world) {
            Ok(_) => panic!("{} over {world} ranks was accepted", path.display()),
            Err(e) => format!("{e:#}"),
        }
    };
    let err = |name: &str, world: usize| refusal(&fixture(name), world);
    assert!(err("gemma", 2).contains("kv heads"), "{}", err("gemma", 2));
    assert!(err("olmo2", 2).contains("q/k norm"), "{}", err("olmo2", 2));
    assert!(err("llama", 4).contains("kv heads"), "{}", err("llama", 4));
    assert!(err("llama", 0).contains("0 ranks"), "{}", err("llama", 0));
    // SmolLM2 (Q4_1, 32-value blocks) over 9 ranks would need a 3-kv-head split: refused; over
    // 3 it splits (tested above).
    let e = refusal(&common::model_path("smollm2-135m-instruct"), 9);
    assert!(e.contains("kv heads"), "{e}");
    // exllamav3's tiny conversion has 64-wide heads: one rank's k would cut a Hadamard block.
    let exl3 = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/exl3/tiny-llama/mcg-2.0"
    ));
    let e = refusal(&exl3, 2);
    assert!(
        e.contains("layer 0 k") && e.contains("Hadamard block"),
        "{e}"
    );
}

/// `trellm generate --tensor-parallel 2` (simulated ranks on the CPU) prints the tokens of the
/// unsplit model; a model that does not split is a clear one-line error.
#[test]
fn generate_over_two_ranks_prints_the_same_tokens() {
    let dir = fixture("qwen3");
    let dir = dir.to_str().unwrap();
    let args = [
        "generate",
        "-M",
        dir,
        "--prompt-ids",
        "1,2,3,4,5",
        "-m",
        "16",
        "--json",
        "-q",
    ];
    let (rc, one, err) = common::run(&args);
    assert_eq!(rc, 0, "{err}");
    let mut split = args.to_vec();
    split.extend(["--tensor-parallel", "2"]);
    let (rc, two, err) = common::run(&split);
    assert_eq!(rc, 0, "{err}");
    let ids = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap()["ids"].clone();
    assert_eq!(ids(&one), ids(&two));
    let gemma = fixture("gemma");
    common::assert_clean_error(
        &[
            "generate",
            "-M",
            gemma.to_str().unwrap(),
            "--prompt-ids",
            "1,2",
            "-m",
            "2",
            "--tensor-parallel",
            "2",
        ],
        "kv heads do not split",
    );
}
