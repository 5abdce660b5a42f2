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

/// Attention's softmax (vectorized exp and sum) against the float64 softmax: each weight within
/// a few ulp of it plus what rounding `v - max` to f32 alone costs (the relative error of
/// `e^t` grows as `|t| 2^-24`), masked (-inf) scores exactly 0, at lengths that leave every
/// remainder.
#[test]
fn attention_softmax_matches_f64() {
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut worst = 0.0f64;
    for len in (1..70).chain([255, 256, 257, 2048]) {
        for spread in [0.1f64, 3.0, 30.0, 150.0] {
            let mut x: Vec<f32> = (0..len)
                .map(|_| ((next() - 0.5) * 2.0 * spread) as f32)
                .collect();
            if len > 3 {
                x[len / 3] = f32::NEG_INFINITY;
            }
            let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let e: Vec<f64> = x.iter().map(|&v| (v as f64 - m).exp()).collect();
            let s: f64 = e.iter().sum();
            let mut y = x.clone();
            cpu::softmax(&mut y);
            for (i, (&got, &want)) in y.iter().zip(&e).enumerate() {
                let want = want / s;
                if x[i] == f32::NEG_INFINITY {
                    assert_eq!(got, 0.0, "len {len}: a masked score got weight");
                    continue;
                }
                // exp_poly flushes below e^-87, far under an f32 ulp of the sum (>= 1).
                let err = (got as f64 - want).abs() / want.max(1e-30);
                let bound = 2e-6 + 2e-7 * (x[i] as f64 - m).abs();
                if want > 1e-30 {
                    worst = worst.max(err / bound);
                }
                assert!(
                    err < bound || (got as f64 - want).abs() < 1e-37,
                    "len {len} spread {spread} [{i}]: {got} against {want}"
                );
            }
            let total: f64 = y.iter().map(|&v| v as f64).sum();
            assert!((total - 1.0).abs() < 1e-5, "len {len}: sums to {total}");
        }
    }
    assert!(worst > 0.0, "no error at all: not the vectorized path?");
}
