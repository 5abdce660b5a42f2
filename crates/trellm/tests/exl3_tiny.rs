//! EXL3 model folders against exllamav3 1.6.5: `tests/fixtures/exl3/tiny-llama/<tag>/` holds a
//! tiny seeded-random Llama converted by exllamav3 (`shared/oracle/exl3_model_oracle.py`) and
//! `oracle_logits.safetensors`, its logits for all 32 positions of `prompt_ids`.
//!
//! Through the CLI (`--prompt-logprobs 512`, the whole vocabulary) at every position: our
//! log-probabilities against the log-softmax of exllamav3's logits (bounds below), and the same
//! top-1 token wherever exllamav3's own top-2 gap is not a tie at fp16 precision.

use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use serde_json::Value;
use trellm::backend::cpu::Exl3Activations;
use trellm::backend::SoloSequence;
use trellm::model::weights::LinearWeight;
use trellm_model::Want;

/// exllamav3 runs in fp16. Rounding our own activations to fp16 (after every projection, norm
/// and attention) moves single logprobs of these models by up to 0.04-0.11 (measured), as
/// attention scores here are large; so single entries are held to the fp16 noise floor and the
/// mean over the vocabulary to 2e-2.
const MAX_TOL: f64 = 0.2;
const MEAN_TOL: f64 = 2e-2;
/// The oracle's logits are fp16 values; top-2 gaps of a few fp16 ulps (at |logit| ~ 5 one ulp is
/// 0.004) are ties in its precision.
const TIE_GAP: f64 = 2e-2;
const VOCAB: usize = 512;
const FOLDERS: [(&str, f32); 4] = [
    ("mul1-3.0", 3.0),
    ("3inst-4.0", 4.0),
    ("mcg-2.0", 2.0),
    ("mul1-2.5", 2.5),
];

fn dir(tag: &str) -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/exl3/tiny-llama"
    ))
    .join(tag)
}

/// exllamav3's prompt ids and logits `[positions][vocab]`.
fn oracle(dir: &Path) -> (Vec<u64>, Vec<Vec<f64>>) {
    let bytes = std::fs::read(dir.join("oracle_logits.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ids: Vec<u64> = st
        .tensor("prompt_ids")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u64)
        .collect();
    let logits = st.tensor("logits").unwrap();
    assert_eq!(logits.shape(), [ids.len(), VOCAB]);
    let flat: Vec<f64> = logits
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64)
        .collect();
    (ids, flat.chunks(VOCAB).map(|r| r.to_vec()).collect())
}

fn log_softmax(x: &[f64]) -> Vec<f64> {
    let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + x.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
    x.iter().map(|v| v - lse).collect()
}

/// Our full log-probability rows for every prompt position, from `trellm generate`.
fn ours(dir: &Path, ids: &[u64]) -> Vec<Vec<f64>> {
    let ids = ids
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_trellm"))
        .arg("generate")
        .arg("--model")
        .arg(dir)
        .args(["--prompt-ids", &ids, "--json", "--max-tokens", "1"])
        .args(["--prompt-logprobs", &VOCAB.to_string()])
        .output()
        .expect("trellm runs");
    assert!(
        out.status.success(),
        "{}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON output");
    v["prompt_logprobs"]
        .as_array()
        .expect("prompt_logprobs")
        .iter()
        .map(|row| {
            let mut full = vec![f64::NAN; VOCAB];
            for p in row.as_array().unwrap() {
                full[p[0].as_u64().unwrap() as usize] = p[1].as_f64().unwrap();
            }
            full
        })
        .collect()
}

/// A copy of the mul1-3.0 folder (weights, oracle logits) whose config.json `edit` changed.
fn relabelled(edit: impl FnOnce(&mut Value)) -> tempfile::TempDir {
    let src = dir("mul1-3.0");
    let tmp = tempfile::tempdir().unwrap();
    for f in ["model.safetensors", "oracle_logits.safetensors"] {
        std::fs::copy(src.join(f), tmp.path().join(f)).unwrap();
    }
    let cfg = std::fs::read_to_string(src.join("config.json")).unwrap();
    let mut v: Value = serde_json::from_str(&cfg).unwrap();
    edit(&mut v);
    std::fs::write(tmp.path().join("config.json"), v.to_string()).unwrap();
    tmp
}

fn argmax(x: &[f64]) -> usize {
    (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b })
}

/// Our log-probability rows with every prompt position run as its own decode step (the few-row
/// kernels, on the path `acts` names), in process.
fn ours_decoding(dir: &Path, ids: &[u64], acts: Exl3Activations) -> Vec<Vec<f64>> {
    let mut lm = trellm::model::load::load(dir).unwrap();
    std::sync::Arc::get_mut(&mut lm.model)
        .unwrap()
        .exl3_activations = acts;
    let mut seq = SoloSequence::new(&*lm.model, ids.len() + 1).unwrap();
    ids.iter()
        .map(|&id| {
            let logits = seq.forward(&[id as u32], Want::Last).unwrap();
            log_softmax(&logits.iter().map(|&v| v as f64).collect::<Vec<_>>())
        })
        .collect()
}

/// Compares one folder (the prompt as one prefill through the CLI); returns (largest, mean)
/// |difference|.
fn check(dir: &Path) -> (f64, f64) {
    let (ids, _) = oracle(dir);
    let ours = ours(dir, &ids);
    check_rows(dir, &ours)
}

/// `ours` against exllamav3's rows of one folder; returns (largest, mean) |difference|.
fn check_rows(dir: &Path, ours: &[Vec<f64>]) -> (f64, f64) {
    let (ids, logits) = oracle(dir);
    assert_eq!(ours.len(), ids.len(), "one row per prompt position");
    let (mut worst, mut sum, mut count) = (0.0f64, 0.0f64, 0usize);
    for (pos, (o, l)) in ours.iter().zip(&logits).enumerate() {
        let want = log_softmax(l);
        assert!(
            o.iter().all(|v| v.is_finite()),
            "position {pos}: not the whole vocabulary"
        );
        for (a, b) in o.iter().zip(&want) {
            worst = worst.max((a - b).abs());
            sum += (a - b).abs();
            count += 1;
        }
        let mut sorted = want.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if sorted[0] - sorted[1] > TIE_GAP {
            assert_eq!(
                argmax(o),
                argmax(&want),
                "{}: top-1 differs at position {pos}",
                dir.display()
            );
        }
    }
    let mean = sum / count as f64;
    assert!(
        worst <= MAX_TOL && mean <= MEAN_TOL,
        "{}: |logprob - exllamav3| max {worst}, mean {mean}",
        dir.display()
    );
    (worst, mean)
}

#[test]
fn logits_match_exllamav3() {
    let mut report = Vec::new();
    for (tag, _) in FOLDERS {
        let (worst, mean) = check(&dir(tag));
        report.push(format!("{tag} max {worst:.3} mean {mean:.1e}"));
    }
    eprintln!("|logprob - exllamav3|: {}", report.join(", "));
}

/// The same oracle with every position a decode step, on both of the decode kernels' paths: the
/// int8 activations (MUL1's default) stay within the bounds the exact path is held to, with the
/// same top-1 token wherever exllamav3's top-2 gap is not a tie.
#[test]
fn decode_steps_match_exllamav3_on_both_paths() {
    let mut report = Vec::new();
    for (tag, _) in FOLDERS {
        let d = dir(tag);
        let (ids, _) = oracle(&d);
        for acts in [Exl3Activations::Exact, Exl3Activations::Int16] {
            let (worst, mean) = check_rows(&d, &ours_decoding(&d, &ids, acts));
            report.push(format!("{tag} {acts:?} max {worst:.3} mean {mean:.1e}"));
        }
    }
    eprintln!("|logprob - exllamav3|, decode steps: {}", report.join(", "));
}

/// The projections and the head stay compressed, at the K the shapes say.
#[test]
fn layers_load_as_exl3() {
    for (tag, bits) in FOLDERS {
        let m = trellm::model::load::load(&dir(tag)).unwrap();
        let w = &m.model.weights;
        let exl3_bits = |l: &LinearWeight| match l {
            LinearWeight::Exl3(e) => e.shape.rate.bits(),
            LinearWeight::Ggml(_) => panic!("{tag}: a projection was not loaded as EXL3"),
        };
        for lw in &w.layers {
            let gate = lw.gate.as_ref().unwrap();
            for l in [&lw.q, &lw.k, &lw.v, &lw.o, gate, &lw.up, &lw.down] {
                assert_eq!(exl3_bits(&l.w), bits, "{tag}");
            }
        }
        // head_bits = 6 in every folder's quantization_config.
        assert_eq!(exl3_bits(&w.lm_head), 6.0, "{tag}");
    }
}

/// EXL3 stores its own quantized head even for tied models: a config saying "tied" must not
/// make us use the embedding instead.
#[test]
fn quantized_head_even_when_tied() {
    let tmp = relabelled(|v| v["tie_word_embeddings"] = Value::Bool(true));
    check(tmp.path());
}

/// A phi3 EXL3 folder: exllamav3 stores phi3's fused qkv and gate_up projections as their
/// quantized parts under the parts' names. The tiny Llama relabelled as phi3 (full rotary, no
/// scaling: the same network) must load its parts and give exllamav3's logits.
#[test]
fn phi3_reads_its_projections_as_stored_parts() {
    let tmp = relabelled(|v| {
        v["model_type"] = Value::from("phi3");
        v["architectures"] = serde_json::json!(["Phi3ForCausalLM"]);
    });
    let m = trellm::model::load::load(tmp.path()).unwrap();
    assert!(m.model.cfg.fused_qkv && m.model.cfg.fused_gate_up);
    check(tmp.path());
}

/// exllamav3 pads dimensions that are not multiples of 128 (its Hadamard blocks; e.g. SmolLM2's
/// hidden size 576) and stores the padded trellis. The tiny model relabelled with an
/// intermediate size of 700 (its trellises hold 768) must load, give the gate/up projections 700
/// outputs (the first 700 of the stored 768) and the down projection 700 inputs (zero-extended).
#[test]
fn padded_layers_take_the_model_dims() {
    use trellm::backend::cpu::linear;
    let src = dir("mul1-3.0");
    let tmp = relabelled(|v| v["intermediate_size"] = Value::from(700));
    let full = trellm::model::load::load(&src).unwrap();
    let cut = trellm::model::load::load(tmp.path()).unwrap();
    let (fl, cl) = (&full.model.weights.layers[1], &cut.model.weights.layers[1]);
    let h = full.model.cfg.hidden;
    let x: Vec<f32> = (0..h)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
        .collect();
    for acts in [Exl3Activations::Exact, Exl3Activations::Int16] {
        let (mut yf, mut yc) = (vec![0.0f32; 768], vec![0.0f32; 700]);
        linear(&x, 1, &fl.up.w, &mut yf, acts);
        linear(&x, 1, &cl.up.w, &mut yc, acts);
        assert_eq!(cl.up.w.rows(), 700);
        assert_eq!(&yf[..700], &yc[..]);
        let a: Vec<f32> = (0..700)
            .map(|i| ((i * 53 % 89) as f32 - 44.0) / 30.0)
            .collect();
        let mut a_full = a.clone();
        a_full.resize(768, 0.0);
        let (mut df, mut dc) = (vec![0.0f32; h], vec![0.0f32; h]);
        linear(&a_full, 1, &fl.down.w, &mut df, acts);
        linear(&a, 1, &cl.down.w, &mut dc, acts);
        assert_eq!(cl.down.w.cols(), 700);
        assert_eq!(df, dc);
    }
    // And the whole model runs on it.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_trellm"))
        .args(["generate", "--model"])
        .arg(tmp.path())
        .args(["--prompt-ids", "1,2,3", "--max-tokens", "4", "--json", "-q"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The CPU's gate/up in one pass over both EXL3 weights (`gated_exl3`) equals the two
/// projections run apart with the activation after, bit for bit: every folder, every layer, one
/// sequence of 1, 3 or 8 rows and a batch of three, and the padded intermediate size (700 of the
/// stored 768). Many rows (the GEMM path) are left to the projections apart.
#[test]
fn fused_gate_up_equals_the_projections_apart() {
    use trellm::backend::cpu::{gated_activation, gated_exl3, linear_batched};
    use trellm::model::config::Activation;
    let padded = relabelled(|v| v["intermediate_size"] = Value::from(700));
    let mut dirs: Vec<PathBuf> = FOLDERS.iter().map(|(tag, _)| dir(tag)).collect();
    dirs.push(padded.path().to_path_buf());
    for d in &dirs {
        let m = trellm::model::load::load(d).unwrap();
        let (h, ff) = (m.model.cfg.hidden, m.model.cfg.intermediate);
        for (l, lw) in m.model.weights.layers.iter().enumerate() {
            let gate = lw.gate.as_ref().unwrap();
            for (seq_rows, acts) in [vec![1usize], vec![3], vec![8], vec![2, 5, 1], vec![17]]
                .into_iter()
                .flat_map(|r| {
                    [
                        (r.clone(), Exl3Activations::Exact),
                        (r, Exl3Activations::Int16),
                    ]
                })
            {
                let n: usize = seq_rows.iter().sum();
                let x: Vec<f32> = (0..n * h)
                    .map(|i| ((i * 37 + l * 11) % 101) as f32 / 25.0 - 2.0)
                    .collect();
                let mut fused = vec![0.0f32; n * ff];
                let took = gated_exl3(
                    &x,
                    &seq_rows,
                    gate,
                    &lw.up,
                    Activation::Silu,
                    &mut fused,
                    acts,
                );
                assert_eq!(took, n < 17, "{}: {seq_rows:?}", d.display());
                if !took {
                    continue;
                }
                let (mut g, mut u) = (vec![0.0f32; n * ff], vec![0.0f32; n * ff]);
                linear_batched(&x, &seq_rows, &gate.w, &mut g, acts);
                linear_batched(&x, &seq_rows, &lw.up.w, &mut u, acts);
                gated_activation(Activation::Silu, &mut g, &u);
                assert!(
                    fused
                        .iter()
                        .zip(&g)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{} layer {l} {seq_rows:?} {acts:?}: the fused gate/up differs",
                    d.display()
                );
            }
        }
    }
}
