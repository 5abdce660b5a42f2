//! The fast matmul (SIMD dot kernels, tiled over activation rows) against its slow exact twin on
//! every weight type of the real models, for decode (1 row) and prefill shapes.

mod common;

use common::*;
use trellm::backend::cpu;
use trellm::model::weights::{LinearWeight, Matrix};

/// Every distinct ggml matrix type of a model, with one matrix each (large ones cut to 300 rows).
fn matrices(alias: &str) -> Vec<(String, Matrix)> {
    let m = trellm::model::load::load(&model_path(alias)).unwrap();
    let w = &m.model.weights;
    let l = &w.layers[0];
    let mut all: Vec<(String, &LinearWeight)> = vec![
        ("q".into(), &l.q.w),
        ("k".into(), &l.k.w),
        ("v".into(), &l.v.w),
        ("o".into(), &l.o.w),
        ("up".into(), &l.up.w),
        ("down".into(), &l.down.w),
        ("lm_head".into(), &w.lm_head),
    ];
    if let Some(g) = &l.gate {
        all.push(("gate".into(), &g.w));
    }
    let mut seen = Vec::new();
    let mut out = Vec::new();
    for (name, lw) in all {
        let LinearWeight::Ggml(mat) = lw else {
            continue;
        };
        if seen.contains(&mat.ty) {
            continue;
        }
        seen.push(mat.ty);
        let rows = mat.rows.min(300);
        out.push((
            format!("{alias}:{name}:{:?}", mat.ty),
            mat.rows_view(0, rows),
        ));
    }
    out
}

fn check(name: &str, w: &Matrix, n: usize) {
    let x = rand_vec(n * w.cols, n as u64 + 3, 1.0);
    let mut fast = vec![0.0f32; n * w.rows];
    let mut slow = vec![0.0f32; n * w.rows];
    cpu::matmul(&x, n, w, &mut fast);
    cpu::matmul_reference(&x, n, w, &mut slow);
    // Tolerance scales with Σ|w·x| of each output, the size of f32 rounding in a reordered sum.
    let mut row = vec![0.0f32; w.cols];
    let mut worst = 0.0f64;
    for r in 0..w.rows {
        w.dequantize_row(r, &mut row);
        for t in 0..n {
            let mag: f64 = row
                .iter()
                .zip(&x[t * w.cols..])
                .map(|(a, b)| (a * b).abs() as f64)
                .sum();
            let d = (fast[t * w.rows + r] - slow[t * w.rows + r]).abs() as f64;
            worst = worst.max(d / mag.max(1e-30));
            assert!(
                d <= 1e-5 * mag + 1e-30,
                "{name} n={n} row {r} token {t}: {} vs {}",
                fast[t * w.rows + r],
                slow[t * w.rows + r]
            );
        }
    }
    eprintln!("{name} n={n}: worst relative error {worst:.2e}");
}

#[test]
fn fast_matmul_matches_reference_on_real_weights() {
    for alias in ["smollm2-135m-instruct", "gemma-3-270m"] {
        for (name, w) in matrices(alias) {
            for n in [1, 2, 5, 70] {
                check(&name, &w, n);
            }
        }
    }
}
