//! A first whole-model EXL3 quantizer, without calibration (H = identity): every
//! `model.layers.*_proj.weight` of a Hugging Face folder (f32/f16/bf16 safetensors, one file)
//! becomes `trellis`/`suh`/`svh` (+ the codebook marker), zero-padded to multiples of 128 as
//! exllamav3 pads; everything else is copied. Writes `config.json` with `quantization_config`,
//! `model.safetensors` and the tokenizer files, a folder `trellm generate --model` loads.
//!
//! `cargo run --release -p trellm-quant --example exl3_quantize_model -- SRC OUT BITS [mul1|mcg|3inst]`

use std::time::Instant;

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use trellm_quant::exl3::quantize::{quantize_layer, LayerOptions};
use trellm_quant::exl3::Codebook;

fn to_f32(t: &TensorView) -> Result<Vec<f32>, String> {
    let d = t.data();
    Ok(match t.dtype() {
        Dtype::F32 => d
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        Dtype::F16 => d
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => d
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => return Err(format!("unsupported dtype {other:?}")),
    })
}

fn run() -> Result<(), String> {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 4 {
        return Err("usage: SRC OUT BITS [mul1|mcg|3inst]".into());
    }
    let (src, out) = (std::path::Path::new(&a[1]), std::path::Path::new(&a[2]));
    let bits: u32 = a[3].parse().map_err(|_| format!("bad bits '{}'", a[3]))?;
    let (cb, cb_name) = match a.get(4).map(String::as_str).unwrap_or("mul1") {
        "mul1" => (Codebook::Mul1, "mul1"),
        "mcg" => (Codebook::Mcg, "mcg"),
        "3inst" => (Codebook::Inst3, "3inst"),
        o => return Err(format!("unknown codebook '{o}'")),
    };
    let bytes = std::fs::read(src.join("model.safetensors"))
        .map_err(|e| format!("{}: {e}", src.display()))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(out).map_err(|e| e.to_string())?;
    let mut outputs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    let linears: Vec<&String> = names
        .iter()
        .filter(|n| n.starts_with("model.layers.") && n.ends_with("_proj.weight"))
        .collect();
    let t0 = Instant::now();
    let (mut weights, mut tiles_done) = (0usize, 0usize);
    for (i, name) in linears.iter().enumerate() {
        let t = st.tensor(name).map_err(|e| e.to_string())?;
        let [rows, cols] = t.shape()[..] else {
            return Err(format!("{name}: not a matrix"));
        };
        let w = to_f32(&t).map_err(|e| format!("{name}: {e}"))?;
        // HF stores [out][in]; the quantizer takes [in][out], zero-padded to 128s.
        let (k, n) = (cols.next_multiple_of(128), rows.next_multiple_of(128));
        let mut wt = vec![0.0f32; k * n];
        for r in 0..rows {
            for c in 0..cols {
                wt[c * n + r] = w[r * cols + c];
            }
        }
        let q = quantize_layer(&wt, k, n, None, &LayerOptions::new(bits, cb))
            .map_err(|e| format!("{name}: {e}"))?;
        for w in &q.warnings {
            eprintln!("warning: {name}: {w}");
        }
        let base = name.trim_end_matches(".weight");
        outputs.push((
            format!("{base}.trellis"),
            Dtype::I16,
            vec![k / 16, n / 16, 16 * bits as usize],
            q.trellis,
        ));
        outputs.push((
            format!("{base}.suh"),
            Dtype::F16,
            vec![k],
            q.suh.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ));
        outputs.push((
            format!("{base}.svh"),
            Dtype::F16,
            vec![n],
            q.svh.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ));
        if cb != Codebook::Inst3 {
            let m: u32 = if cb == Codebook::Mcg {
                0xCBAC_1FED
            } else {
                0x83DC_D12D
            };
            outputs.push((
                format!("{base}.{cb_name}"),
                Dtype::I32,
                vec![],
                m.to_le_bytes().to_vec(),
            ));
        }
        weights += rows * cols;
        tiles_done += k * n / 256;
        let s = t0.elapsed().as_secs_f64();
        eprintln!(
            "[{}/{}] {name} {rows}x{cols} proxy {:.5} scale {:.3} | {:.0} tiles/s, {:.0}s",
            i + 1,
            linears.len(),
            q.proxy_err,
            q.global_scale,
            tiles_done as f64 / s,
            s
        );
    }
    for name in names.iter().filter(|n| !linears.contains(n)) {
        let t = st.tensor(name).map_err(|e| e.to_string())?;
        outputs.push((
            name.clone(),
            t.dtype(),
            t.shape().to_vec(),
            t.data().to_vec(),
        ));
    }
    let views: Vec<(String, TensorView)> = outputs
        .iter()
        .map(|(n, d, s, b)| {
            Ok((
                n.clone(),
                TensorView::new(*d, s.clone(), b).map_err(|e| e.to_string())?,
            ))
        })
        .collect::<Result<_, String>>()?;
    safetensors::serialize_to_file(views, None, &out.join("model.safetensors"))
        .map_err(|e| e.to_string())?;
    let cfg_text = std::fs::read_to_string(src.join("config.json")).map_err(|e| e.to_string())?;
    let mut cfg: serde_json::Value = serde_json::from_str(&cfg_text).map_err(|e| e.to_string())?;
    cfg["quantization_config"] = serde_json::json!({
        "quant_method": "exl3", "version": "trellm", "bits": bits as f64, "head_bits": 16,
        "calibration": {"rows": 0, "cols": 0}, "out_scales": "always", "codebook": cb_name,
    });
    std::fs::write(
        out.join("config.json"),
        serde_json::to_string_pretty(&cfg).unwrap(),
    )
    .map_err(|e| e.to_string())?;
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "special_tokens_map.json",
    ] {
        if src.join(f).exists() {
            std::fs::copy(src.join(f), out.join(f)).map_err(|e| format!("{f}: {e}"))?;
        }
    }
    eprintln!(
        "{} linear weights in {} layers at {bits} bpw ({cb_name}) in {:.0}s",
        weights,
        linears.len(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
