//! Quantizing whole layers (`exl3::quantize`), read back through the engine's EXL3 matmul, and
//! compared with exllamav3 1.6.5's quantization of the same layer (`tests/fixtures/exl3/layers`).

use safetensors::SafeTensors;
use trellm_quant::exl3::quantize::{quantize_layer, LayerOptions, QuantizeError};
use trellm_quant::exl3::{self, Codebook, Exl3Shape};

struct Rng(u64);
impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn gauss(&mut self) -> f32 {
        let (a, b) = (self.uniform(), self.uniform());
        ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
    }
    fn matrix(&mut self, r: usize, c: usize, s: f32) -> Vec<f32> {
        (0..r * c).map(|_| s * self.gauss()).collect()
    }
}

fn f32s(st: &SafeTensors, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap_or_else(|_| panic!("no {name}"));
    match t.dtype() {
        safetensors::Dtype::F16 => exl3::f16_values(t.data())
            .iter()
            .map(|v| v.to_f32())
            .collect(),
        safetensors::Dtype::F32 => t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        d => panic!("{name}: {d:?}"),
    }
}

fn matmul(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; m * n];
    for t in 0..m {
        for i in 0..k {
            let a = x[t * k + i];
            for c in 0..n {
                y[t * n + c] += a * w[i * n + c];
            }
        }
    }
    y
}

/// `||a - b|| / ||b||`.
fn rel(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// The layer's output on `x` through the engine's EXL3 matmul.
fn run_layer(q: &exl3::quantize::QuantizedLayer, x: &[f32], m: usize) -> Vec<f32> {
    let shape = Exl3Shape::from_trellis(
        &[q.shape.k / 16, q.shape.n / 16, q.shape.rate.tile_words()],
        q.shape.codebook,
    )
    .unwrap();
    let suh: Vec<f32> = q.suh.iter().map(|v| v.to_f32()).collect();
    let svh: Vec<f32> = q.svh.iter().map(|v| v.to_f32()).collect();
    let mut y = vec![0.0f32; m * q.shape.n];
    exl3::matmul::linear(&shape, &q.trellis, &suh, &svh, x, m, &mut y);
    y
}

/// exllamav3's layer (256 x 384, W ~ 0.02 N(0,1); its first 128 outputs, to keep the test
/// fast) quantized by us without calibration, at K = 2, 3, 4: the output error on its 16 test
/// rows falls with K and is within 1.3x of exllamav3's own file's on the same outputs (which
/// was calibrated on other inputs).
#[test]
fn oracle_layer_error_falls_with_k_and_matches_exllamav3() {
    let bytes = std::fs::read(format!(
        "{}/../../tests/fixtures/exl3/layers/exl3_oracle_mul1.safetensors",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (k, n) = (256, 128);
    let first_cols =
        |m: Vec<f32>| -> Vec<f32> { m.chunks(384).flat_map(|r| r[..n].to_vec()).collect() };
    let w = first_cols(f32s(&st, "weight"));
    let x = f32s(&st, "x16");
    let exact = matmul(&x, &w, 16, k, n);
    let mut last = f64::INFINITY;
    for bits in [2u32, 3, 4] {
        let q = quantize_layer(&w, k, n, None, &LayerOptions::new(bits, Codebook::Mul1)).unwrap();
        assert!(q.warnings.is_empty(), "{:?}", q.warnings);
        let ours = rel(&run_layer(&q, &x, 16), &exact);
        let theirs = rel(
            &matmul(
                &x,
                &first_cols(f32s(&st, &format!("k{bits}.w_recon"))),
                16,
                k,
                n,
            ),
            &exact,
        );
        eprintln!(
            "K={bits}: output error ours {ours:.4}, exllamav3 {theirs:.4}, proxy {:.5}, scale {:.3}",
            q.proxy_err, q.global_scale
        );
        assert!(ours < last, "K={bits}: {ours} not below {last}");
        assert!(
            ours <= 1.3 * theirs,
            "K={bits}: ours {ours} vs exllamav3 {theirs}"
        );
        last = ours;
    }
}

/// Inputs with correlated features (`x = z A`, as the oracle's calibration): LDLQ with their
/// second moment beats quantizing without it, on fresh inputs from the same distribution.
#[test]
fn ldlq_with_h_beats_no_calibration() {
    let (k, n) = (256, 128);
    let mut rng = Rng(11);
    let mut a = rng.matrix(k, k, 0.15);
    for i in 0..k {
        a[i * k + i] += 1.0;
    }
    let calib = matmul(&rng.matrix(2048, k, 1.0), &a, 2048, k, k);
    let mut h = vec![0.0f64; k * k];
    for row in calib.chunks(k) {
        for i in 0..k {
            for j in 0..k {
                h[i * k + j] += row[i] as f64 * row[j] as f64;
            }
        }
    }
    h.iter_mut().for_each(|v| *v /= 2048.0);
    let w = rng.matrix(k, n, 0.02);
    let test = matmul(&rng.matrix(64, k, 1.0), &a, 64, k, k);
    let exact = matmul(&test, &w, 64, k, n);
    let opts = LayerOptions::new(3, Codebook::Mcg);
    let with = quantize_layer(&w, k, n, Some(&h), &opts).unwrap();
    assert!(with.warnings.is_empty(), "{:?}", with.warnings);
    let without = quantize_layer(&w, k, n, None, &opts).unwrap();
    let (e_with, e_without) = (
        rel(&run_layer(&with, &test, 64), &exact),
        rel(&run_layer(&without, &test, 64), &exact),
    );
    eprintln!("K=3 output error: LDLQ {e_with:.4}, no calibration {e_without:.4}");
    assert!(e_with < 0.9 * e_without, "{e_with} vs {e_without}");
}

#[test]
fn bad_hessians_warn_and_still_quantize() {
    let (k, n) = (128, 128);
    let mut rng = Rng(5);
    let w = rng.matrix(k, n, 0.02);
    let opts = LayerOptions::new(2, Codebook::Mul1);
    // Rank 8: eight calibration rows.
    let rows = rng.matrix(8, k, 1.0);
    let mut h = vec![0.0f64; k * k];
    for row in rows.chunks(k) {
        for i in 0..k {
            for j in 0..k {
                h[i * k + j] += row[i] as f64 * row[j] as f64 / 8.0;
            }
        }
    }
    let q = quantize_layer(&w, k, n, Some(&h), &opts).unwrap();
    assert!(
        q.warnings.iter().any(|w| w.contains("rank")),
        "{:?}",
        q.warnings
    );
    assert!(q.proxy_err.is_finite());
    // Non-finite entries.
    let mut bad = h.clone();
    bad[5] = f64::NAN;
    bad[k + 3] = f64::INFINITY;
    let q = quantize_layer(&w, k, n, Some(&bad), &opts).unwrap();
    assert!(
        q.warnings.iter().any(|w| w.contains("non-finite")),
        "{:?}",
        q.warnings
    );
    // All zero (no activations).
    let q = quantize_layer(&w, k, n, Some(&vec![0.0; k * k]), &opts).unwrap();
    assert!(!q.warnings.is_empty());
    // Non-finite weights.
    let mut wb = w.clone();
    wb[7] = f32::NAN;
    let q = quantize_layer(&wb, k, n, None, &opts).unwrap();
    assert!(
        q.warnings.iter().any(|w| w.contains("weights")),
        "{:?}",
        q.warnings
    );
    assert!(q.suh.iter().chain(&q.svh).all(|v| v.is_finite()));
}

#[test]
fn bad_shapes_are_errors() {
    let opts = LayerOptions::new(2, Codebook::Mul1);
    assert_eq!(
        quantize_layer(&[0.0; 576 * 128], 576, 128, None, &opts).unwrap_err(),
        QuantizeError::NotBlocked(576, 128)
    );
    assert!(quantize_layer(&[0.0; 10], 128, 128, None, &opts).is_err());
    assert!(quantize_layer(
        &[0.0; 128 * 128],
        128,
        128,
        None,
        &LayerOptions::new(9, Codebook::Mul1)
    )
    .is_err());
    // An all-zero layer quantizes to zeros.
    let q = quantize_layer(&[0.0; 128 * 128], 128, 128, None, &opts).unwrap();
    let y = run_layer(&q, &[1.0; 128], 1);
    assert!(y.iter().all(|v| *v == 0.0), "{:?}", &y[..4]);
}
