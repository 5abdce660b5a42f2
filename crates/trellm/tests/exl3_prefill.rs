//! The EXL3 prefill path (the Hadamards and scales folded into the exactly decoded weights,
//! then a GEMM) against the tile-kernel path, its exact twin, on random layers: every codebook,
//! several K, 17/64/100 activation rows, layers of more output bands than one GEMM pass takes,
//! and layers padded to 128s (fewer inputs and outputs than stored), within f32 rounding of
//! `sum |x w|`. Also the rows where `exl3_linear` switches from one to the other, and the int16
//! GEMM (the default many-row path on MUL1 layers) against the same exact twin.

use trellm_quant::exl3::matmul::{
    linear as exl3_linear, matmul_gemm as exl3_matmul_gemm, matmul_many as exl3_matmul_many,
    matmul_tiles as exl3_matmul_tiles, Activations::Exact, Activations::Int16,
    GEMM_MIN_ROWS as EXL3_GEMM_MIN_ROWS,
};
use trellm_quant::exl3::{self, Bitrate, Codebook, Exl3Shape};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// Uniform in [-1, 1).
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// `f` on a pool of `n` threads.
fn on_threads(n: usize, f: impl FnOnce() + Send) {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build()
        .unwrap()
        .install(f)
}

struct Layer {
    shape: Exl3Shape,
    trellis: Vec<u8>,
    suh: Vec<f32>,
    svh: Vec<f32>,
}

impl Layer {
    fn parts(&self) -> exl3::matmul::Layer<'_> {
        exl3::matmul::Layer {
            shape: &self.shape,
            trellis: &self.trellis,
            suh: &self.suh,
            svh: &self.svh,
        }
    }
}

fn layer(rng: &mut Rng, k: usize, n: usize, rate: Bitrate, cb: Codebook) -> Layer {
    let shape = Exl3Shape::from_trellis(&[k / 16, n / 16, rate.tile_bytes() / 2], cb).unwrap();
    Layer {
        shape,
        trellis: rng.bytes(shape.trellis_bytes()),
        suh: (0..k).map(|_| rng.f32() * 0.1).collect(),
        svh: (0..n).map(|_| rng.f32() * 0.1).collect(),
    }
}

/// Per row and output: `sum_i |xh_i W_inner[i][c]|` maximized over the output's 128-band, times
/// `sqrt(128) |svh|` (the output Hadamard adds up 128 errors of weight 1/sqrt(128)).
fn scales(l: &Layer, x: &[f32], rows: usize) -> Vec<f32> {
    let (k, n) = (l.shape.k, l.shape.n);
    let inner = exl3::reconstruct_inner(&l.shape, &l.trellis).unwrap();
    let mut s = vec![0.0f32; rows * n];
    for t in 0..rows {
        let mut xh: Vec<f32> = x[t * k..(t + 1) * k]
            .iter()
            .zip(&l.suh)
            .map(|(a, b)| a * b)
            .collect();
        exl3::hadamard128(&mut xh);
        let mut abs = vec![0.0f32; n];
        for (i, a) in xh.iter().enumerate() {
            for (o, w) in abs.iter_mut().zip(&inner[i * n..(i + 1) * n]) {
                *o += (a * w.to_f32()).abs();
            }
        }
        for b in 0..n / 128 {
            let m = abs[b * 128..(b + 1) * 128]
                .iter()
                .fold(0.0f32, |m, v| m.max(*v));
            for c in b * 128..(b + 1) * 128 {
                s[t * n + c] = m * 128f32.sqrt() * l.svh[c].abs();
            }
        }
    }
    s
}

fn check(l: &Layer, rng: &mut Rng, rows: usize, what: &str) {
    let (k, n) = (l.shape.k, l.shape.n);
    let x: Vec<f32> = (0..rows * k).map(|_| rng.f32()).collect();
    let mut want = vec![f32::NAN; rows * n];
    exl3_matmul_tiles(
        &l.shape, &l.trellis, &l.suh, &l.svh, &x, rows, &mut want, Exact,
    );
    let mut got = vec![f32::NAN; rows * n];
    exl3_matmul_gemm(&l.shape, &l.trellis, &l.suh, &l.svh, &x, rows, &mut got);
    let s = scales(l, &x, rows);
    let mut worst = 0.0f32;
    for (i, ((g, w), s)) in got.iter().zip(&want).zip(&s).enumerate() {
        let err = (g - w).abs();
        assert!(
            err <= 1e-5 * s,
            "{what} rows={rows}: element {i} (row {}, col {}): {g} vs {w}, |err| {err} > 1e-5 * {s}",
            i / n,
            i % n
        );
        worst = worst.max(err / s.max(f32::MIN_POSITIVE));
    }
    eprintln!("{what} rows={rows}: worst |err| / scale {worst:.2e}");
}

#[test]
fn gemm_path_matches_tile_path() {
    // Four threads: more than some layers have bands.
    on_threads(4, || {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let cases = [
            (Codebook::Inst3, Bitrate::int(2), 256, 384),
            (Codebook::Inst3, Bitrate::int(4), 128, 128),
            (Codebook::Mcg, Bitrate::int(3), 384, 256),
            (Codebook::Mcg, Bitrate::int(8), 128, 128),
            (Codebook::Mul1, Bitrate::int(1), 256, 128),
            (Codebook::Mul1, Bitrate::half(2), 128, 256),
            (Codebook::Mul1, Bitrate::int(3), 512, 384),
            (Codebook::Mul1, Bitrate::int(6), 256, 256),
            (Codebook::Mcg, Bitrate::int(4), 2048, 128),
            (Codebook::Mul1, Bitrate::int(3), 128, 1280),
        ];
        for (cb, rate, k, n) in cases {
            let l = layer(&mut rng, k, n, rate, cb);
            for rows in [17, 64, 100] {
                check(
                    &l,
                    &mut rng,
                    rows,
                    &format!("{cb:?} K={} {k}x{n}", rate.bits()),
                );
            }
        }
    });
}

#[test]
fn linear_switches_paths_at_the_threshold() {
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let l = layer(&mut rng, 256, 256, Bitrate::int(3), Codebook::Mul1);
    for rows in [1, EXL3_GEMM_MIN_ROWS - 1, EXL3_GEMM_MIN_ROWS] {
        let x: Vec<f32> = (0..rows * l.shape.k).map(|_| rng.f32()).collect();
        let mut got = vec![f32::NAN; rows * l.shape.n];
        exl3_linear(&l.shape, &l.trellis, &l.suh, &l.svh, &x, rows, &mut got);
        let mut want = vec![f32::NAN; rows * l.shape.n];
        if rows >= EXL3_GEMM_MIN_ROWS {
            exl3_matmul_gemm(&l.shape, &l.trellis, &l.suh, &l.svh, &x, rows, &mut want);
        } else {
            exl3_matmul_tiles(
                &l.shape, &l.trellis, &l.suh, &l.svh, &x, rows, &mut want, Exact,
            );
        }
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "rows={rows}"
        );
    }
}

/// `rows` random input rows of `cols` values for a layer padded to `k` inputs, the same rows
/// zero-extended to `k`, and the exact tile path's outputs for those (all `n` of them).
fn padded_case(
    l: &Layer,
    rng: &mut Rng,
    rows: usize,
    cols: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (k, n) = (l.shape.k, l.shape.n);
    let x: Vec<f32> = (0..rows * cols).map(|_| rng.f32()).collect();
    let mut xp = vec![0.0f32; rows * k];
    for (d, s) in xp.chunks_mut(k).zip(x.chunks(cols)) {
        d[..cols].copy_from_slice(s);
    }
    let mut full = vec![f32::NAN; rows * n];
    exl3_matmul_tiles(
        &l.shape, &l.trellis, &l.suh, &l.svh, &xp, rows, &mut full, Exact,
    );
    (x, xp, full)
}

/// A layer stored padded to 128s (exllamav3's layout for dims that are not multiples of 128):
/// the GEMM path takes the model's `cols` inputs and gives its `rows` outputs directly, equal
/// (within rounding) to the tile path on the zero-extended inputs, its outputs cut.
#[test]
fn gemm_path_takes_padded_dims() {
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    for (k, n, cols, rows_out) in [
        (256, 384, 200, 300),
        (640, 1280, 576, 1152),
        (128, 256, 128, 130),
    ] {
        let l = layer(&mut rng, k, n, Bitrate::int(3), Codebook::Mul1);
        let rows = 40;
        let (x, xp, full) = padded_case(&l, &mut rng, rows, cols);
        let mut got = vec![f32::NAN; rows * rows_out];
        exl3_matmul_gemm(&l.shape, &l.trellis, &l.suh, &l.svh, &x, rows, &mut got);
        let s = scales(&l, &xp, rows);
        for t in 0..rows {
            for c in 0..rows_out {
                let (g, w) = (got[t * rows_out + c], full[t * n + c]);
                assert!(
                    (g - w).abs() <= 1e-5 * s[t * n + c],
                    "{k}x{n} as {cols}x{rows_out}: row {t} output {c}: {g} against {w}"
                );
            }
        }
    }
}

/// The int16 GEMM (`matmul_many` with `Int16` on a MUL1 layer, where the CPU has AVX-512 VNNI)
/// against the exact tile path: each output within `1e-3 sum |x w|` (the weights' fp16 rounding
/// it skips is at most 2^-11 of each product; the activations' int16 rounding 2^-16 of each 128's
/// largest), and within 1e-3 RMS over all; every K of MUL1 it is used for, rows around the
/// kernel's and a task's sizes, padded dims, more bands than a pass takes. On other codebooks
/// `matmul_many` is the exact GEMM, bit for bit.
#[test]
fn int16_gemm_is_close_to_the_exact_path() {
    if !trellm_quant::exl3::simd::int16_gemm_available() {
        eprintln!("skipped: this CPU lacks AVX-512 VNNI + VBMI2 (the int16 GEMM is not used here)");
        return;
    }
    on_threads(3, || {
        let mut rng = Rng(0x6A09_E667_F3BC_C908);
        let cases = [
            (Bitrate::int(1), 256, 128, 256, 128),
            (Bitrate::int(2), 640, 1280, 576, 1152),
            (Bitrate::half(2), 384, 256, 384, 256),
            (Bitrate::int(3), 128, 1280, 128, 1280),
            (Bitrate::int(4), 256, 384, 200, 300),
            (Bitrate::int(6), 256, 2304, 256, 2304),
        ];
        for (rate, k, n, cols, rows_out) in cases {
            let l = layer(&mut rng, k, n, rate, Codebook::Mul1);
            for rows in [17, 49, 100] {
                let (x, xp, full) = padded_case(&l, &mut rng, rows, cols);
                let mut got = vec![f32::NAN; rows * rows_out];
                exl3_matmul_many(l.parts(), &x, rows, &mut got, Int16);
                let s = scales(&l, &xp, rows);
                let (mut e2, mut y2) = (0.0f64, 0.0f64);
                for t in 0..rows {
                    for c in 0..rows_out {
                        let (g, w) = (got[t * rows_out + c], full[t * n + c]);
                        assert!(
                            (g - w).abs() <= 1e-3 * s[t * n + c],
                            "K={} {k}x{n} as {cols}x{rows_out}, {rows} rows: row {t} output {c}: {g} against {w}",
                            rate.bits()
                        );
                        e2 += ((g - w) as f64).powi(2);
                        y2 += (w as f64).powi(2);
                    }
                }
                let rel = (e2 / y2).sqrt();
                eprintln!(
                    "K={} {k}x{n}, {rows} rows: relative RMS {rel:.2e}",
                    rate.bits()
                );
                assert!(rel < 1e-3, "K={} {k}x{n}: relative RMS {rel}", rate.bits());
            }
        }
        let l = layer(&mut rng, 256, 256, Bitrate::int(3), Codebook::Mcg);
        let x: Vec<f32> = (0..40 * 256).map(|_| rng.f32()).collect();
        let (mut a, mut b) = (vec![f32::NAN; 40 * 256], vec![f32::NAN; 40 * 256]);
        exl3_matmul_many(l.parts(), &x, 40, &mut a, Int16);
        exl3_matmul_gemm(&l.shape, &l.trellis, &l.suh, &l.svh, &x, 40, &mut b);
        assert_eq!(
            a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "MCG: matmul_many is the exact GEMM"
        );
    });
}
