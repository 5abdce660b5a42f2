//! `trellm quantize` end to end on a tiny llama (hidden 64, so every projection is padded to
//! 128s; 512-token vocabulary with the BPE tokenizer of the EXL3 fixtures): the folder it writes
//! loads in trellm with the stored bytes as written, its logits stay close to the source's
//! (closer at 4 bits than at 2), an interrupted run resumes to the same bytes, shards split as
//! asked, bad numerics quantize with warnings, and what cannot be quantized fails with one line.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use serde_json::Value;
use trellm::model::weights::LinearWeight;
use trellm_model::{Batch, ModelBackend, Want};

const TOKENIZER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/fixtures/exl3/tiny-llama/mul1-3.0"
);

/// Plain English the tiny tokenizer (trained on wikitext) cuts into a few hundred tokens.
const TEXT: &str = "The river rises in the hills north of the town and runs south through a \
narrow valley of farms and woods before it reaches the sea. In the eighteenth century its banks \
held a dozen mills, which ground grain for the markets of three counties and later spun cotton \
and wool. The first bridge was built of timber in 1742; a flood carried it away twenty years \
later, and the stone bridge that replaced it still carries the main road. When the railway came \
in 1851 the mills lost their trade to larger factories in the cities, and most of them closed \
within a generation. Some were turned into houses, one became a school, and the largest is now \
a museum of local history, where visitors can see the old water wheel turning again.\n\
The town itself grew up around a market square. Its church, begun in the twelfth century, has \
a tower that can be seen from every part of the valley, and its records of births, marriages \
and deaths go back more than four hundred years.\n";

/// Held-out text for the comparison (not in the calibration text).
const HELD_OUT: &str = "In the square stand the old market hall, two inns and a row of shops \
whose fronts were rebuilt in the Victorian style. Every summer the town holds a fair with music, \
games and a procession of boats on the river, a custom said to be as old as the bridge.";

/// A tiny HF llama folder with seeded random weights. `scale_up` multiplies layer 0's up
/// projection (a huge value there makes the down projection's inputs overflow to inf).
fn tiny_model(dir: &Path, tied: bool, scale_up: f32) {
    let d = LlamaDims {
        hidden: 64,
        inter: 96,
        layers: 2,
        heads: 4,
        kv: 2,
        head_dim: 16,
        vocab: 512,
    };
    let s = 1.7 / (d.hidden as f32).sqrt();
    write_llama(dir, &d, tied, serde_json::json!({}), 100, |name| {
        if name.ends_with("norm.weight") {
            0.0
        } else if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
            0.8
        } else if name == "model.layers.0.mlp.up_proj.weight" {
            s * scale_up
        } else {
            s
        }
    });
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(Path::new(TOKENIZER).join(f), dir.join(f)).unwrap();
    }
}

fn calib_file(dir: &Path, text: &str) -> String {
    let p = dir.join("calib.txt");
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

/// Runs `trellm quantize` and returns its stderr; the run must succeed.
fn quantize(src: &Path, out: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "quantize",
        "--model",
        src.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--threads",
        "2",
    ];
    args.extend_from_slice(extra);
    let (code, _, err) = run(&args);
    assert_eq!(code, 0, "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

/// Log-probabilities `[positions][vocab]` of `ids` under the model in `dir`.
fn logprobs(dir: &Path, ids: &[u32]) -> Vec<Vec<f64>> {
    let m = trellm::load(dir).unwrap();
    let model = &*m.model;
    let blocks = ids.len().div_ceil(16);
    let mut cache = model.new_cache(blocks, 16).unwrap();
    let mut batch = Batch::default();
    batch.push(ids, 0, (0..blocks as u32).collect(), Want::All);
    let logits = model.step(&batch, &mut cache).unwrap();
    let vocab = model.cfg.vocab;
    logits
        .chunks(vocab)
        .map(|r| {
            let max = r.iter().fold(f64::MIN, |a, &v| a.max(v as f64));
            let lse = max + r.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
            r.iter().map(|&v| v as f64 - lse).collect()
        })
        .collect()
}

/// Mean KL(source || quantized) and top-1 agreement over the held-out text.
fn kld_vs(src: &Path, q: &Path) -> (f64, f64) {
    let m = trellm::load(src).unwrap();
    let ids = m.tokenizer().unwrap().encode(HELD_OUT, false).unwrap();
    let (a, b) = (logprobs(src, &ids), logprobs(q, &ids));
    let argmax = |r: &[f64]| {
        r.iter()
            .enumerate()
            .max_by(|x, y| x.1.total_cmp(y.1))
            .unwrap()
            .0
    };
    let mut kl = 0.0;
    let mut same = 0;
    for (p, q) in a.iter().zip(&b) {
        kl += p
            .iter()
            .zip(q)
            .map(|(lp, lq)| lp.exp() * (lp - lq))
            .sum::<f64>();
        same += usize::from(argmax(p) == argmax(q));
    }
    (kl / a.len() as f64, same as f64 / a.len() as f64)
}

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

fn json(p: PathBuf) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn quantized_folder_loads_exactly_and_tracks_the_source() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    tiny_model(&src, true, 1.0);
    let cal = calib_file(d.path(), TEXT);
    // The short names of the calibration size (`--calib-rows`, `--calib-cols`).
    let calib = ["--calibration", &cal, "--rows", "4", "--cols", "64"];
    let mut out = Vec::new();
    for bits in ["2", "4"] {
        let o = d.path().join(format!("q{bits}"));
        let mut extra = vec!["--bits", bits];
        extra.extend_from_slice(&calib);
        let err = quantize(&src, &o, &extra);
        assert!(!err.contains("warning"), "{err}");
        out.push(o);
    }
    let q4 = &out[1];

    // config.json and quantization_config.json as exllamav3 writes them.
    let cfg = json(q4.join("config.json"));
    let qc = &cfg["quantization_config"];
    assert_eq!(qc["quant_method"], "exl3");
    assert_eq!(qc["bits"], 4.0);
    assert_eq!(qc["head_bits"], 6);
    assert_eq!(qc["codebook"], "mul1");
    assert_eq!(qc["calibration"]["rows"], 4);
    assert_eq!(cfg["tie_word_embeddings"], false);
    let storage = &json(q4.join("quantization_config.json"))["tensor_storage"];
    let q_proj = &storage["model.layers.1.self_attn.q_proj"];
    assert_eq!(q_proj["quant_format"], "exl3");
    assert_eq!(q_proj["bits_per_weight"], 4);
    assert_eq!(q_proj["mul1_multiplier"], 0x83DC_D12Du32);
    let trellis = &q_proj["stored_tensors"]["model.layers.1.self_attn.q_proj.trellis"];
    assert_eq!(trellis["shape"], serde_json::json!([8, 8, 64]));
    assert_eq!(trellis["dtype"], "torch.int16");
    assert_eq!(storage["lm_head"]["bits_per_weight"], 6);
    assert!(q4.join("tokenizer.json").exists());
    assert!(!q4.join(".checkpoint").exists());

    // trellm's reader takes every projection and the head as stored, bit for bit.
    let st = trellm_formats::safetensors::SafeTensors::open(q4).unwrap();
    let m = trellm::load(q4).unwrap();
    let bytes = |name: &str| st.data(st.get(name).unwrap()).to_vec();
    let f16s = |name: &str| -> Vec<f32> {
        bytes(name)
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect()
    };
    let check = |w: &LinearWeight, base: &str, rows: usize, cols: usize| {
        let LinearWeight::Exl3(e) = w else {
            panic!("{base} is not EXL3")
        };
        assert_eq!((e.rows, e.cols), (rows, cols), "{base}");
        assert_eq!(
            e.trellis(),
            &bytes(&format!("{base}.trellis"))[..],
            "{base}"
        );
        assert_eq!(e.suh, f16s(&format!("{base}.suh")), "{base}");
        assert_eq!(e.svh, f16s(&format!("{base}.svh")), "{base}");
    };
    for (l, lw) in m.model.weights.layers.iter().enumerate() {
        let p = format!("model.layers.{l}.");
        check(&lw.q.w, &format!("{p}self_attn.q_proj"), 64, 64);
        check(&lw.k.w, &format!("{p}self_attn.k_proj"), 32, 64);
        check(&lw.v.w, &format!("{p}self_attn.v_proj"), 32, 64);
        check(&lw.o.w, &format!("{p}self_attn.o_proj"), 64, 64);
        check(
            &lw.gate.as_ref().unwrap().w,
            &format!("{p}mlp.gate_proj"),
            96,
            64,
        );
        check(&lw.up.w, &format!("{p}mlp.up_proj"), 96, 64);
        check(&lw.down.w, &format!("{p}mlp.down_proj"), 64, 96);
    }
    check(&m.model.weights.lm_head, "lm_head", 512, 64);

    // Close to the source, closer at 4 bits than at 2.
    let (kl2, same2) = kld_vs(&src, &out[0]);
    let (kl4, same4) = kld_vs(&src, q4);
    eprintln!("KLD 2-bit {kl2:.4} (same top {same2:.3}), 4-bit {kl4:.4} (same top {same4:.3})");
    assert!(
        kl4 < 0.08 && same4 >= 0.8,
        "4-bit: KLD {kl4}, same top {same4}"
    );
    assert!(kl4 < 0.25 * kl2, "2-bit {kl2} vs 4-bit {kl4}");

    // It generates and evaluates through the CLI like any model.
    let f = calib_file(d.path(), HELD_OUT);
    let (code, o, err) = run(&[
        "eval",
        "--model",
        q4.to_str().unwrap(),
        "--file",
        &f,
        "--ctx",
        "16",
        "--json",
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    let ppl = serde_json::from_str::<Value>(o.trim()).unwrap()["ppl"]
        .as_f64()
        .unwrap();
    assert!(ppl.is_finite() && ppl > 1.0, "{ppl}");
}

#[test]
fn an_interrupted_run_resumes_to_the_same_bytes_and_shards_split() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    tiny_model(&src, false, 1.0);
    let cal = calib_file(d.path(), TEXT);
    let args = [
        "--bits",
        "2.5",
        "--calibration",
        &cal,
        "--calib-rows",
        "3",
        "--calib-cols",
        "48",
        "--shard-size",
        "0.1",
        "--head-bits",
        "3",
    ];
    let whole = d.path().join("whole");
    quantize(&src, &whole, &args);
    let part = d.path().join("part");
    let mut stop = args.to_vec();
    stop.extend_from_slice(&["--stop-after-layers", "1"]);
    let err = quantize(&src, &part, &stop);
    assert!(err.contains("resume"), "{err}");
    assert!(part.join(".checkpoint/layer-00000.safetensors").exists());
    assert!(!part.join(".checkpoint/layer-00001.safetensors").exists());
    assert!(!part.join("config.json").exists());
    let err = quantize(&src, &part, &args);
    assert!(err.contains("resuming at layer 1"), "{err}");
    let (a, b) = (files(&whole), files(&part));
    assert_eq!(
        a.iter().map(|f| &f.0).collect::<Vec<_>>(),
        b.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    for (x, y) in a.iter().zip(&b) {
        assert!(x.1 == y.1, "{} differs after the resume", x.0);
    }
    // Shards of at most 0.1 MB, with an index naming every tensor's file.
    let shards: Vec<&String> = a
        .iter()
        .map(|f| &f.0)
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    assert!(shards.len() >= 2, "{shards:?}");
    assert!(shards
        .iter()
        .all(|n| n.contains(&format!("-of-{:05}", shards.len()))));
    let index = json(whole.join("model.safetensors.index.json"));
    let map = index["weight_map"].as_object().unwrap();
    assert!(map.contains_key("lm_head.trellis") && map.contains_key("model.embed_tokens.weight"));
    // Another job in the same folder is refused, not mixed in.
    let other = d.path().join("other");
    quantize(&src, &other, &stop);
    let refused = |flags: &[&str]| {
        let head = [
            "quantize",
            "--model",
            src.to_str().unwrap(),
            "--out",
            other.to_str().unwrap(),
        ];
        let (code, _, err) = run(&[&head[..], flags].concat());
        assert_ne!(code, 0, "{flags:?}");
        assert!(err.contains("another quantization"), "{err}");
    };
    let mut four = stop.clone();
    four[1] = "4";
    refused(&four);
    // Another seed is another job too; from scratch it makes other signs, a folder that loads.
    refused(&[&stop[..], &["--seed", "7"]].concat());
    let seven = d.path().join("seven");
    quantize(&src, &seven, &[&args[..], &["--seed", "7"]].concat());
    let tensors = |dir: &Path| {
        files(dir)
            .into_iter()
            .filter(|f| f.0.ends_with(".safetensors"))
            .map(|f| f.1)
            .collect::<Vec<_>>()
    };
    assert_ne!(
        tensors(&whole),
        tensors(&seven),
        "--seed 7 made the same tensors"
    );
    trellm::load(&seven).unwrap();
    trellm::load(&whole).unwrap();
    // 2.5 bits on average over the stored weights: some projections at 2, some at 3.
    let storage = json(whole.join("quantization_config.json"))["tensor_storage"].clone();
    let (mut bits, mut weights) = (0.0, 0.0);
    let mut seen = std::collections::BTreeSet::new();
    for (name, m) in storage.as_object().unwrap() {
        if name.starts_with("model.layers.") && m["quant_format"] == "exl3" {
            let t = &m["stored_tensors"][format!("{name}.trellis")]["shape"];
            let w = (t[0].as_u64().unwrap() * t[1].as_u64().unwrap() * 256) as f64;
            let b = m["bits_per_weight"].as_f64().unwrap();
            seen.insert(b as u32);
            bits += b * w;
            weights += w;
        }
    }
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![2, 3]);
    let avg = bits / weights;
    assert!(avg <= 2.5 && avg > 2.3, "{avg}");
}

#[test]
fn bad_numerics_and_tiny_calibration_warn_but_quantize() {
    let d = tempfile::tempdir().unwrap();
    // Layer 0's up projection so large that the down projection's inputs overflow.
    let src = d.path().join("inf");
    tiny_model(&src, true, 1e36);
    let cal = calib_file(d.path(), TEXT);
    let out = d.path().join("q-inf");
    let err = quantize(
        &src,
        &out,
        &[
            "--bits",
            "2",
            "--calibration",
            &cal,
            "--calib-rows",
            "2",
            "--calib-cols",
            "32",
            "--head-bits",
            "2",
        ],
    );
    assert!(err.contains("inf/NaN"), "{err}");
    trellm::load(&out).unwrap();

    // Five tokens of calibration: every H is rank-deficient.
    let src = d.path().join("ok");
    tiny_model(&src, true, 1.0);
    let tiny = calib_file(d.path(), "The river rises.");
    let out = d.path().join("q-tiny");
    let err = quantize(
        &src,
        &out,
        &["--bits", "2", "--calibration", &tiny, "--head-bits", "2"],
    );
    assert!(err.contains("rank-deficient"), "{err}");
    assert!(err.contains("fewer than --calib-rows"), "{err}");
    trellm::load(&out).unwrap();

    // No calibration at all.
    let out = d.path().join("q-none");
    let err = quantize(
        &src,
        &out,
        &["--bits", "2", "--calib-rows", "0", "--head-bits", "none"],
    );
    assert!(!err.contains("warning"), "{err}");
    let cfg = json(out.join("config.json"));
    assert_eq!(cfg["tie_word_embeddings"], true);
    assert!(
        !json(out.join("quantization_config.json"))["tensor_storage"]
            .as_object()
            .unwrap()
            .contains_key("lm_head")
    );
    trellm::load(&out).unwrap();
}

#[test]
fn what_cannot_be_quantized_fails_with_one_line() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    tiny_model(&src, true, 1.0);
    let s = src.to_str().unwrap();
    let o = d.path().join("o");
    let o = o.to_str().unwrap();
    let base = ["quantize", "--model", s, "--out", o, "--calib-rows", "0"];
    fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
        [base, extra].concat()
    }
    assert_clean_error(&with(&base, &["--bits", "9"]), "--bits");
    assert_clean_error(&with(&base, &["--bits", "0.5"]), "--bits");
    assert_clean_error(&with(&base, &["--bits", "x"]), "--bits");
    assert_clean_error(
        &with(&base, &["--bits", "2", "--head-bits", "12"]),
        "--head-bits",
    );
    assert_clean_error(
        &with(&base, &["--bits", "2", "--codebook", "e8p"]),
        "--codebook",
    );
    assert_clean_error(
        &with(&base, &["--bits", "2", "--shard-size", "0"]),
        "--shard-size",
    );
    let missing = d.path().join("none.txt");
    assert_clean_error(
        &[
            "quantize",
            "--model",
            s,
            "--out",
            o,
            "--bits",
            "2",
            "--calibration",
            missing.to_str().unwrap(),
        ],
        "--calibration",
    );
    // An EXL3 folder, a GGUF file, a folder missing a tensor.
    assert_clean_error(
        &[
            "quantize",
            "--model",
            TOKENIZER,
            "--out",
            o,
            "--bits",
            "2",
            "--calib-rows",
            "0",
        ],
        "already an EXL3",
    );
    // GGUFs: llama and gemma3 only, with a vocabulary tokenizer.json can hold (the tiny
    // SentencePiece one has no byte pieces).
    for (f, needle) in [
        ("llama.f32.gguf", "byte piece"),
        ("qwen2.f32.gguf", "llama and gemma3 architectures"),
    ] {
        let g = format!(
            "{}/../../tests/fixtures/gguf-tiny/{f}",
            env!("CARGO_MANIFEST_DIR")
        );
        let args = [
            "quantize",
            "--model",
            &g,
            "--out",
            o,
            "--bits",
            "2",
            "--calib-rows",
            "0",
        ];
        assert_clean_error(&args, needle);
    }
    let broken = d.path().join("broken");
    tiny_model(&broken, true, 1.0);
    let m = trellm_formats::safetensors::SafeTensors::open(&broken).unwrap();
    let kept: Vec<(String, Vec<usize>, Vec<f32>)> = m
        .tensors
        .values()
        .filter(|t| t.name != "model.layers.1.mlp.down_proj.weight")
        .map(|t| {
            let v = m
                .data(t)
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (t.name.clone(), t.shape.clone(), v)
        })
        .collect();
    drop(m);
    write_safetensors(&broken.join("model.safetensors"), &kept);
    assert_clean_error(
        &[
            "quantize",
            "--model",
            broken.to_str().unwrap(),
            "--out",
            o,
            "--bits",
            "2",
            "--calib-rows",
            "0",
        ],
        "down_proj",
    );
}
