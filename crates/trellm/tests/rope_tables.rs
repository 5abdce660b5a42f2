//! RoPE against mlx, bit for bit: `tests/fixtures/rope/<variant>.json`, written by
//! `scripts/oracle/rope_tables.py`, holds the frequency table mlx-lm builds for each variant
//! and what its rope module makes of given vectors at given positions.

use serde_json::Value;
use std::path::PathBuf;
use trellm::model::rope::Rope;

fn fixtures() -> Vec<(String, Value)> {
    let dir = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/rope"
    ));
    let mut out: Vec<(String, Value)> = std::fs::read_dir(&dir)
        .expect("tests/fixtures/rope exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .map(|p| {
            let v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            (p.file_stem().unwrap().to_string_lossy().into_owned(), v)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("a list of float32 bit patterns")
        .iter()
        .map(|b| f32::from_bits(b.as_u64().expect("bits") as u32))
        .collect()
}

fn build(builder: &str, a: &Value) -> Option<Rope> {
    let num = |k: &str| a[k].as_f64().unwrap_or_else(|| panic!("args.{k}"));
    let max = a["max_positions"].as_u64().map(|v| v as usize);
    match builder {
        "initialize_rope" => Some(
            Rope::new(
                a["dims"].as_u64().unwrap() as usize,
                num("base"),
                a["traditional"].as_bool().unwrap(),
                a.get("scaling"),
                max,
            )
            .unwrap(),
        ),
        "phi3" => {
            let head_dim = (num("hidden_size") / num("num_attention_heads")) as usize;
            let dims = (head_dim as f64 * num("partial_rotary_factor")) as usize;
            Some(
                Rope::phi3(
                    dims,
                    num("rope_theta"),
                    false,
                    a.get("rope_scaling"),
                    num("max_position_embeddings") as usize,
                    num("original_max_position_embeddings") as usize,
                )
                .unwrap(),
            )
        }
        "nope" => None,
        other => panic!("unknown builder {other}"),
    }
}

#[test]
fn rope_tables_match_mlx_bit_for_bit() {
    let all = fixtures();
    let names: Vec<&str> = all.iter().map(|f| f.0.as_str()).collect();
    for expected in [
        "default",
        "default-traditional",
        "partial",
        "linear",
        "dynamic",
        "llama3",
        "yarn",
        "deepseek_yarn",
        "telechat3-yarn",
        "longrope",
        "proportional",
        "phi3-su",
        "phi3-plain",
        "nope",
    ] {
        assert!(names.contains(&expected), "rope fixture {expected} missing");
    }
    let mut failures = Vec::new();
    for (name, fx) in &all {
        let rope = build(fx["builder"].as_str().unwrap(), &fx["args"]);
        let head_dim = fx["head_dim"].as_u64().unwrap() as usize;
        if let (Some(r), Some(want)) = (&rope, fx["freqs"].as_array()) {
            let want = floats(&Value::Array(want.clone()));
            match r.freqs() {
                Some(got)
                    if got
                        .iter()
                        .map(|f| f.to_bits())
                        .eq(want.iter().map(|f| f.to_bits())) => {}
                got => failures.push(format!("{name}: freqs {got:?}, mlx {want:?}")),
            }
        }
        let mut bad = 0usize;
        let mut first = None;
        let mut total = 0usize;
        for case in fx["cases"].as_array().unwrap() {
            let offset = case["offset"].as_u64().unwrap() as usize;
            let len = case["len"].as_u64().unwrap() as usize;
            let mut x = floats(&case["input"]);
            let want = floats(&case["output"]);
            assert_eq!(x.len(), len * head_dim);
            if let Some(r) = &rope {
                let inv = r.inv_freq(offset + len);
                let (mut c, mut s) = (vec![0.0; r.dims / 2], vec![0.0; r.dims / 2]);
                for (t, row) in x.chunks_mut(head_dim).enumerate() {
                    r.cos_sin((offset + t) as i64, &inv, &mut c, &mut s);
                    r.rotate(row, &c, &s);
                }
            }
            for (i, (g, w)) in x.iter().zip(&want).enumerate() {
                total += 1;
                if g.to_bits() != w.to_bits() {
                    bad += 1;
                    first.get_or_insert(format!(
                        "offset {offset} row {} dim {}: {g:e} vs mlx {w:e}",
                        i / head_dim,
                        i % head_dim
                    ));
                }
            }
        }
        if bad > 0 {
            failures.push(format!(
                "{name}: {bad} of {total} values differ from mlx; first: {}",
                first.unwrap()
            ));
        }
        eprintln!("{name}: {total} values, {bad} differ");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn unsupported_rope_type_names_the_supported_ones() {
    let s: Value = serde_json::json!({"type": "warp", "factor": 2.0});
    let e = Rope::new(32, 10000.0, false, Some(&s), Some(2048))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("warp") && e.contains("llama3") && e.contains("longrope"),
        "{e}"
    );
    let s: Value = serde_json::json!({"type": "linear"});
    let e = Rope::new(32, 10000.0, false, Some(&s), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("factor"), "{e}");
    let s: Value = serde_json::json!({"rope_type": "llama3", "factor": 8.0});
    assert!(Rope::new(32, 10000.0, false, Some(&s), None).is_ok());
    let s: Value = serde_json::json!({"type": "longrope", "long_factor": [1.0]});
    let e = Rope::new(32, 10000.0, false, Some(&s), Some(8192))
        .unwrap_err()
        .to_string();
    assert!(e.contains("original_max_position_embeddings"), "{e}");
}
