//! The CUDA decoder against the CPU decoder on the tiny fixtures (weights rounded to bf16 for
//! both): logits within bf16 tolerance, greedy ids equal except at near-ties. The GPU tests are
//! ignored here and run with `--ignored` on the GPU machine (scripts/gpu/run_cuda.sh).
#![cfg(feature = "cuda")]

mod common;

use std::path::PathBuf;

use trellm::backend::cuda;

/// Largest relative L2 error of a step's logits (bf16 weights, activations and KV cache).
const REL_TOL: f64 = 5e-2;
/// The same for EXL3 folders: the tiny random models exllamav3 converted amplify the GPU's bf16
/// activations (8 bits of mantissa) more than the bf16 fixtures do: 0.11 measured on 3inst-4.0
/// (H200, run 1 of issue 14's EXL3 path), where exllamav3's own fp16 activations already move
/// log-probabilities by up to 0.12 from the f32 CPU path (`exl3_tiny.rs`).
const REL_TOL_EXL3: f64 = 0.2;
/// Ids may differ only where the CPU's top-2 logit gap is below this.
const TIE_GAP: f32 = 5e-2;
/// The same for the EXL3 folders, whose logits move by up to 0.68 (max abs error, same run).
const TIE_GAP_EXL3: f32 = 0.25;

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
        let gpu_model = cuda::CudaModel::new(&m.model, 64, 1).unwrap();
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
        let opts = trellm::EngineOptions::for_sequences(1, 64);
        let mut engine = m.engine(Device::Cuda, opts).unwrap();
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
    let gpu_model = cuda::CudaModel::new(&m.model, 64, 1).unwrap();
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

/// One step of `batch` on `model` (its blocks from each sequence's table).
fn step_rows<M: trellm_model::ModelBackend>(
    model: &M,
    cache: &mut M::Cache,
    batch: &trellm_model::Batch,
) -> Vec<Vec<f32>> {
    let vocab = model.config().vocab;
    let out = model.step(batch, cache).unwrap();
    assert_eq!(out.len(), batch.logit_rows() * vocab);
    out.chunks(vocab).map(|r| r.to_vec()).collect()
}

fn top2_gap(x: &[f32]) -> f32 {
    let mut v = x.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    v[0] - v[1]
}

/// Ragged batches on the CUDA backend's paged cache against the CPU backend (weights rounded to
/// bf16) and against each sequence alone on the GPU: five sequences of different prompt lengths
/// prefilled in one step (one of a single token), then eight steps of one token each, every
/// logit row within bf16 tolerance and greedy ids equal except at near-ties; on fixtures with
/// GQA, sliding windows, q/k norms, biases and soft-capping.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn batched_steps_match_the_cpu_and_each_sequence_alone() {
    for name in ["llama", "qwen3", "gemma2", "gemma3", "phi3", "qwen2"] {
        check_batched(&fixtures().join(name), REL_TOL, TIE_GAP);
    }
}

/// The EXL3 folders exllamav3 converted (`oracle-data/exl3-tiny-llama`: 3INST 4.0, MCG 2.0, MUL1
/// 2.5 and 3.0 with a 6-bit head; the copy in `tests/fixtures/exl3`; `TRELLM_EXL3_TINY` points elsewhere).
fn exl3_tiny_folders() -> Vec<PathBuf> {
    let root = std::env::var_os("TRELLM_EXL3_TINY")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../tests/fixtures/exl3/tiny-llama"
            )
            .into()
        });
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("config.json").exists())
        .collect();
    dirs.sort();
    assert!(
        dirs.len() >= 4,
        "EXL3 folders missing under {}",
        root.display()
    );
    dirs
}

/// EXL3 models on the GPU, compressed, against the CPU backend's exact EXL3 path: one sequence
/// (the exact trellis GEMV for decode, the fp16 GEMM for the prompt), then ragged batches (the
/// first step's 73 rows through the GEMM, then 5-row GEMVs).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn exl3_folders_match_the_cpu_alone_and_batched() {
    let reports: Vec<_> = exl3_tiny_folders()
        .iter()
        .map(|dir| {
            let r = cuda::check_against_cpu(dir, 32).unwrap();
            eprintln!(
                "{}: max rel err {:.3e}, max abs err {:.3e}, ids equal {}",
                dir.display(),
                r.max_rel_err,
                r.max_abs_err,
                r.ids_equal()
            );
            r
        })
        .collect();
    for r in &reports {
        assert!(r.max_rel_err < REL_TOL_EXL3, "{r:?}");
        if let Some(gap) = r.gap_at_divergence {
            assert!(gap < TIE_GAP_EXL3, "ids differ at a clear choice: {r:?}");
        }
    }
    for dir in exl3_tiny_folders() {
        check_batched(&dir, REL_TOL_EXL3, TIE_GAP_EXL3);
    }
}

/// An EXL3 folder with heads 128 wide, as Llama's (the tiny folders' are 64): its decode steps
/// of up to 16 rows run RoPE and the KV write in the q/k/v launch's epilogue, which the tiny
/// folders never reach. Made here by `trellm quantize` (MUL1, a 6-bit head) from a 2-layer llama
/// with seeded random weights, then checked as the tiny folders are: at 3 bits, and at 3.5 and
/// 3.8 bits, where the allocation leaves q below k and v (3.5) and gate below up (3.8), so those
/// parts run as one launch at two rates.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn exl3_head_dim_128_matches_the_cpu_alone_and_batched() {
    use trellm_model::weights::{Linear, LinearWeight};
    let rate = |l: &Linear| match &l.w {
        LinearWeight::Exl3(e) => e.shape.rate,
        LinearWeight::Ggml(_) => panic!("not an EXL3 layer"),
    };
    for (bits, mixed) in [(3.0, ""), (3.5, "qkv"), (3.8, "gate/up")] {
        let d = tempfile::tempdir().unwrap();
        let (src, out) = (d.path().join("src"), d.path().join("exl3"));
        common::write_llama_for_exl3(&src, &HD128_ONE_KV, 39);
        common::quantize_exl3(&src, &out, trellm_quant::exl3::Codebook::Mul1, bits);
        let m = trellm::model::load::load(&out).unwrap();
        let l0 = &m.model.weights.layers[0];
        let (q, k, v) = (rate(&l0.q), rate(&l0.k), rate(&l0.v));
        let (g, u) = (rate(l0.gate.as_ref().unwrap()), rate(&l0.up));
        match mixed {
            "qkv" => assert!(q != k && k == v && g == u, "{bits} bits: {q:?} {k:?} {v:?}"),
            "gate/up" => assert!(q == k && k == v && g != u, "{bits} bits: {g:?} {u:?}"),
            _ => assert!(q == k && k == v && g == u),
        }
        let r = cuda::check_against_cpu(&out, 32).unwrap();
        eprintln!(
            "head dim 128, {bits} bits: max rel err {:.3e}, max abs err {:.3e}, ids equal {}",
            r.max_rel_err,
            r.max_abs_err,
            r.ids_equal()
        );
        assert!(r.max_rel_err < REL_TOL_EXL3, "{bits} bits: {r:?}");
        if let Some(gap) = r.gap_at_divergence {
            assert!(
                gap < TIE_GAP_EXL3,
                "{bits} bits: ids differ at a clear choice: {r:?}"
            );
        }
        check_batched(&out, REL_TOL_EXL3, TIE_GAP_EXL3);
    }
}

/// A 2-layer llama: hidden 256, two query heads and one kv head of 128, vocabulary 512.
const HD128_ONE_KV: common::LlamaDims = common::LlamaDims {
    hidden: 256,
    inter: 512,
    layers: 2,
    heads: 2,
    kv: 1,
    head_dim: 128,
    vocab: 512,
};

fn check_batched(path: &std::path::Path, tol: f64, tie_gap: f32) {
    use trellm::backend::cpu::{CpuModel, Exl3Activations};
    use trellm::backend::SoloSequence;
    use trellm_model::{Batch, BlockPool, BlockTable, ModelBackend, Want};
    const BS: usize = 16;
    let name = path.display().to_string();
    {
        // Both backends on their exact EXL3 paths.
        let mut m = trellm::model::load::load(path).unwrap();
        std::sync::Arc::get_mut(&mut m.model)
            .unwrap()
            .exl3_activations = Exl3Activations::Exact;
        let cfg = m.model.cfg.clone();
        let mut cpu = CpuModel::new(cfg.clone(), cuda::bf16_rounded(&m.model.weights).unwrap());
        cpu.exl3_activations = Exl3Activations::Exact;
        let gpu = cuda::CudaModel::new(&m.model, 96, 1).unwrap();
        let vocab = cfg.vocab as u32;
        let lens = [7usize, 33, 1, 20, 12];
        let blocks = lens.len() * 96usize.div_ceil(BS);
        let mut pool = BlockPool::new(blocks, BS);
        let (mut cc, mut gc) = (
            cpu.new_cache(blocks, BS).unwrap(),
            gpu.new_cache(blocks, BS).unwrap(),
        );
        let mut tables: Vec<BlockTable> = lens.iter().map(|_| BlockTable::default()).collect();
        let prompts: Vec<Vec<u32>> = (lens.iter().enumerate())
            .map(|(s, &n)| {
                (0..n as u32)
                    .map(|i| (i * 31 + 7 * s as u32 + 3) % vocab)
                    .collect()
            })
            .collect();
        let mut alone: Vec<_> = lens
            .iter()
            .map(|_| SoloSequence::new(&gpu, 96).unwrap())
            .collect();
        let mut next: Vec<Vec<u32>> = prompts.clone();
        let mut lens_now = vec![0usize; lens.len()];
        for step in 0..9 {
            let mut batch = Batch::default();
            for (s, t) in tables.iter_mut().enumerate() {
                pool.grow(t, lens_now[s] + next[s].len()).unwrap();
                batch.push(&next[s], lens_now[s], t.blocks().to_vec(), Want::Last);
            }
            let c = step_rows(&cpu, &mut cc, &batch);
            let g = step_rows(&gpu, &mut gc, &batch);
            for s in 0..lens.len() {
                let a = alone[s].forward(&next[s], Want::Last).unwrap();
                let (rel, _) = cuda::errors(&g[s], &c[s]);
                assert!(rel < tol, "{name} step {step} seq {s}: vs CPU {rel}");
                let (rel_alone, _) = cuda::errors(&g[s], &a);
                assert!(
                    rel_alone < tol,
                    "{name} step {step} seq {s}: vs alone {rel_alone}"
                );
                let want = trellm::engine::sampler::argmax(&c[s]);
                for (what, row) in [("batched", &g[s]), ("alone", &a)] {
                    let got = trellm::engine::sampler::argmax(row);
                    assert!(
                        got == want || top2_gap(&c[s]) < tie_gap,
                        "{name} step {step} seq {s}: {what} GPU id {got}, CPU {want}"
                    );
                }
                lens_now[s] += next[s].len();
                // Every backend continues from the CPU's token.
                next[s] = vec![want];
            }
        }
    }
}

/// Copy-on-write of a shared block on the GPU: a sequence forked from a 20-token prompt (its
/// second block shared and partial) and extended with its own token gives the logits of that
/// prompt and token run alone, and the original's next step is unchanged.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn forked_sequences_copy_their_shared_block() {
    use trellm::backend::SoloSequence;
    use trellm_model::{Batch, BlockPool, BlockTable, ModelBackend, Want};
    let m = trellm::model::load::load(&fixtures().join("llama")).unwrap();
    let gpu = cuda::CudaModel::new(&m.model, 64, 1).unwrap();
    let vocab = m.model.cfg.vocab as u32;
    let prompt: Vec<u32> = (0..20u32).map(|i| (i * 13 + 5) % vocab).collect();
    let mut pool = BlockPool::new(8, 16);
    let mut cache = gpu.new_cache(8, 16).unwrap();
    let mut a = BlockTable::default();
    pool.grow(&mut a, 20).unwrap();
    let mut batch = Batch::default();
    batch.push(&prompt, 0, a.blocks().to_vec(), Want::Last);
    gpu.step(&batch, &mut cache).unwrap();
    let mut b = pool.fork(&a);
    let mut copies = pool.grow(&mut a, 21).unwrap();
    copies.extend(pool.grow(&mut b, 21).unwrap());
    assert_eq!(copies.len(), 1, "one shared partial block to copy");
    gpu.copy_blocks(&mut cache, &copies).unwrap();
    let (ta, tb) = (1u32, 2u32);
    let mut batch = Batch::default();
    batch.push(&[ta], 20, a.blocks().to_vec(), Want::Last);
    batch.push(&[tb], 20, b.blocks().to_vec(), Want::Last);
    let rows = step_rows(&gpu, &mut cache, &batch);
    for (tok, row) in [(ta, &rows[0]), (tb, &rows[1])] {
        let mut s = SoloSequence::new(&gpu, 64).unwrap();
        s.forward(&prompt, Want::Last).unwrap();
        let alone = s.forward(&[tok], Want::Last).unwrap();
        let (rel, _) = cuda::errors(row, &alone);
        assert!(rel < 2e-2, "token {tok}: {rel}");
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

/// Tensor parallelism over two GPUs (NCCL) against one GPU on the tiny fixtures that split over
/// two ranks and on an EXL3 model our quantizer writes (MUL1, 3 bits, 128-wide heads): logits
/// within bf16 tolerance and the same greedy ids (except at near-ties), prefill and decode. Needs
/// two GPUs: run_cuda.sh skips it (`--skip multi_gpu`) on a one-GPU machine.
#[test]
#[ignore = "needs two NVIDIA GPUs and NCCL: run with --ignored on a multi-GPU machine"]
fn multi_gpu_two_ranks_match_one_gpu() {
    use trellm::backend::SoloSequence;
    use trellm_model::Want;
    assert!(
        trellm_cuda::device_count().unwrap() >= 2,
        "this test needs two GPUs"
    );
    let tmp = tempfile::tempdir().unwrap();
    let (src, exl3) = (tmp.path().join("src"), tmp.path().join("exl3"));
    common::write_llama_for_exl3(&src, &common::HD128_TWO_KV, 43);
    common::quantize_exl3(&src, &exl3, trellm_quant::exl3::Codebook::Mul1, 3.0);
    let dir = fixtures();
    let names = ["llama", "qwen2", "qwen3", "gemma3", "phi3", "starcoder2"];
    let paths = names.iter().map(|n| dir.join(n)).chain([exl3]);
    for path in paths {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let m = trellm::model::load::load(&path).unwrap();
        let vocab = m.model.cfg.vocab;
        let prompt: Vec<u32> = (0..11u32).map(|i| (i * 31 + 3) % vocab as u32).collect();
        let one = cuda::CudaModel::new(&m.model, 64, 1).unwrap();
        let two = cuda::CudaModel::new(&m.model, 64, 2).unwrap();
        let (mut a, mut b) = (
            SoloSequence::new(&one, 64).unwrap(),
            SoloSequence::new(&two, 64).unwrap(),
        );
        let (mut la, mut lb) = (
            a.forward(&prompt, Want::Last).unwrap(),
            b.forward(&prompt, Want::Last).unwrap(),
        );
        for step in 0..16 {
            let (rel, _) = cuda::errors(&lb, &la);
            assert!(rel < REL_TOL, "{name} step {step}: relative error {rel}");
            let id = (0..vocab).max_by(|&i, &j| la[i].total_cmp(&la[j])).unwrap() as u32;
            la = a.forward(&[id], Want::Last).unwrap();
            lb = b.forward(&[id], Want::Last).unwrap();
        }
    }
}

/// The EXL3 fast path (MUL1 layers' one-row steps with int8 activations through dp4a, the
/// default) against the exact CPU path on the tiny MUL1 folders, beside the GPU's exact path (fp16
/// activations on tensor cores): mean and largest KL divergence of each step's distribution from the CPU's over
/// a prefill and 24 decode steps fed the CPU's greedy ids, and how many greedy ids agree.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn exl3_int8_path_kl_against_the_exact_path() {
    use std::sync::Arc;
    use trellm::backend::SoloSequence;
    use trellm_model::Want;
    let kl = |p: &[f32], q: &[f32]| -> f64 {
        let lse = |v: &[f32]| {
            let m = v.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
            m + v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
        };
        let (lp, lq) = (lse(p), lse(q));
        p.iter()
            .zip(q)
            .map(|(&a, &b)| {
                let la = a as f64 - lp;
                la.exp() * (la - (b as f64 - lq))
            })
            .sum()
    };
    let argmax = |v: &[f32]| (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap() as u32;
    let dirs: Vec<_> = exl3_tiny_folders()
        .into_iter()
        .filter(|d| d.file_name().unwrap().to_string_lossy().starts_with("mul1"))
        .collect();
    assert!(!dirs.is_empty(), "no MUL1 folders");
    for dir in dirs {
        let mut m = trellm::model::load::load(&dir).unwrap();
        Arc::get_mut(&mut m.model).unwrap().exl3_activations =
            trellm::backend::cpu::Exl3Activations::Exact;
        let vocab = m.model.cfg.vocab;
        let prompt: Vec<u32> = (0..12u32).map(|i| (i * 37 + 11) % vocab as u32).collect();
        let steps = 24;
        // The CPU's logits and greedy ids.
        let mut seq = SoloSequence::new(&*m.model, 64).unwrap();
        let mut want = vec![seq.forward(&prompt, Want::Last).unwrap()];
        let mut ids = Vec::new();
        for _ in 0..steps {
            let id = argmax(want.last().unwrap());
            ids.push(id);
            want.push(seq.forward(&[id], Want::Last).unwrap());
        }
        let gpu = Arc::new(trellm_cuda::Gpu::new(0).unwrap());
        let mut report = Vec::new();
        for int8 in [false, true] {
            let opts = trellm_cuda::dense::Options {
                exl3_int8: int8,
                ..Default::default()
            };
            let mut d = cuda::upload_with(gpu.clone(), &m.model, 64, 64, opts).unwrap();
            d.prefill(&prompt).unwrap();
            let mut got = vec![d.logits().unwrap()];
            for &id in &ids {
                d.set_next_token(id).unwrap();
                d.decode_step().unwrap();
                got.push(d.logits().unwrap());
            }
            let kls: Vec<f64> = want.iter().zip(&got).map(|(p, q)| kl(p, q)).collect();
            let mean = kls.iter().sum::<f64>() / kls.len() as f64;
            let max = kls.iter().cloned().fold(0.0, f64::max);
            let same = want
                .iter()
                .zip(&got)
                .filter(|(p, q)| argmax(p) == argmax(q))
                .count();
            assert!(
                kls.iter().all(|k| k.is_finite()) && max < 1.0,
                "{}: int8 {int8}: KL {kls:?}",
                dir.display()
            );
            report.push(format!(
                "{}: mean KL {mean:.2e}, max {max:.2e}, same greedy id {same}/{}",
                if int8 {
                    "int8 fast path (the default)"
                } else {
                    "exact path (fp16 tensor cores)"
                },
                want.len()
            ));
        }
        eprintln!("{}: {}", dir.display(), report.join("; "));
    }
}
