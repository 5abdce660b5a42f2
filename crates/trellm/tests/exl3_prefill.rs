//! The EXL3 prefill path (the Hadamards and scales folded into the exactly decoded weights,
//! then a GEMM) against the tile-kernel path, its exact twin, on random layers: every codebook,
//! several K, 17/64/100 activation rows, layers of more output bands than one GEMM pass takes,
//! and layers padded to 128s (fewer inputs and outputs than stored), within f32 rounding of
//! `sum |x w|`. Also the rows where `exl3_linear` switches from one to the other.

use trellm_quant::exl3::matmul::{
    linear as exl3_linear, matmul_gemm as exl3_matmul_gemm, matmul_tiles as exl3_matmul_tiles,
    Activations::Exact, GEMM_MIN_ROWS as EXL3_GEMM_MIN_ROWS,
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

struct Layer {
    shape: Exl3Shape,
    trellis: Vec<u8>,
    suh: Vec<f32>,
    svh: Vec<f32>,
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
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap();
    pool.install(|| {
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
        let x: Vec<f32> = (0..rows * cols).map(|_| rng.f32()).collect();
        let mut xp = vec![0.0f32; rows * k];
        for (d, s) in xp.chunks_mut(k).zip(x.chunks(cols)) {
            d[..cols].copy_from_slice(s);
        }
        let mut full = vec![f32::NAN; rows * n];
        exl3_matmul_tiles(
            &l.shape, &l.trellis, &l.suh, &l.svh, &xp, rows, &mut full, Exact,
        );
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
