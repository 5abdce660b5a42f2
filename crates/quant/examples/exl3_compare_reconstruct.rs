//! Our reader's weights of an EXL3 folder against exllamav3's (`get_weight_tensor`, fp16
//! `[in][out]`, as `scripts/gpu/exllamav3_peer.py` dumps them under `weight/<tag>/<name>`):
//! `cargo run --release -p trellm-quant --example exl3_compare_reconstruct -- FOLDER DUMP TAG`.
//! Prints, per projection, how many of its fp16 values differ in their bits.

use half::f16;
use safetensors::SafeTensors;
use trellm_quant::exl3::{f16_values, reconstruct, Codebook, Exl3Shape};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (folder, dump, tag) = (&args[0], &args[1], &args[2]);
    let ours_bytes = std::fs::read(format!("{folder}/model.safetensors")).expect("model");
    let ours = SafeTensors::deserialize(&ours_bytes).expect("model.safetensors");
    let theirs_bytes = std::fs::read(dump).expect("dump");
    let theirs = SafeTensors::deserialize(&theirs_bytes).expect("dump");
    let prefix = format!("weight/{tag}/");
    let (mut total, mut differ) = (0usize, 0usize);
    for (name, t) in theirs.tensors() {
        let Some(base) = name.strip_prefix(&prefix) else {
            continue;
        };
        let Ok(tr) = ours.tensor(&format!("{base}.trellis")) else {
            continue;
        };
        let cb = if ours.tensor(&format!("{base}.mul1")).is_ok() {
            Codebook::Mul1
        } else if ours.tensor(&format!("{base}.mcg")).is_ok() {
            Codebook::Mcg
        } else {
            Codebook::Inst3
        };
        let shape = Exl3Shape::from_trellis(tr.shape(), cb).expect("trellis shape");
        let suh = f16_values(ours.tensor(&format!("{base}.suh")).unwrap().data());
        let svh = f16_values(ours.tensor(&format!("{base}.svh")).unwrap().data());
        let w = reconstruct(&shape, tr.data(), &suh, &svh).expect("reconstruct");
        let theirs_w: Vec<f16> = f16_values(t.data());
        assert_eq!(w.len(), theirs_w.len(), "{base}: sizes");
        let bad = w
            .iter()
            .zip(&theirs_w)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        let max = w
            .iter()
            .zip(&theirs_w)
            .map(|(a, b)| (a.to_f32() - b.to_f32()).abs())
            .fold(0.0f32, f32::max);
        println!(
            "{base}: {} values, {bad} differ (max abs diff {max:e})",
            w.len()
        );
        total += w.len();
        differ += bad;
    }
    println!("{tag}: {total} values, {differ} differ");
}
