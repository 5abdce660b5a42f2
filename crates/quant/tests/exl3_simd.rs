//! The SIMD EXL3 kernels against the scalar codec: decoded tiles bit for bit (every codebook,
//! every bitrate, every level this machine has) and the tile matmul within f32 rounding of the
//! scalar kernel, for 1-17 activation rows.

use half::f16;
use trellm_quant::exl3::simd::{available_levels, decode_tile_with, matmul_inner_with, Level};
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
}

const CODEBOOKS: [Codebook; 3] = [Codebook::Inst3, Codebook::Mcg, Codebook::Mul1];

fn rates(cb: Codebook) -> Vec<Bitrate> {
    let mut r: Vec<Bitrate> = (1..=8).map(Bitrate::int).collect();
    if cb == Codebook::Mul1 {
        r.extend((1..=3).map(Bitrate::half));
    }
    r
}

fn check_tile(level: Level, tile: &[u8], rate: Bitrate, cb: Codebook) {
    let mut want = [f16::ZERO; 256];
    exl3::trellis::decode_tile(tile, rate, cb, &mut want);
    let mut got = [f32::NAN; 256];
    decode_tile_with(level, tile, rate, cb, &mut got);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_f32().to_bits(),
            "{} {cb:?} K={} element {i}: {g} vs {w}",
            level.name(),
            rate.bits()
        );
    }
}

#[test]
fn decoded_tiles_are_bit_identical() {
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let levels = available_levels();
    eprintln!("levels: {:?}", levels);
    for cb in CODEBOOKS {
        for rate in rates(cb) {
            for i in 0..200 {
                let mut tile = rng.bytes(rate.tile_bytes());
                // A few all-zero / all-one tiles (and one bit set) for the extremes.
                match i {
                    0 => tile.fill(0),
                    1 => tile.fill(0xFF),
                    2 => {
                        tile.fill(0);
                        tile[rate.tile_bytes() - 1] = 1;
                    }
                    _ => {}
                }
                for &level in &levels {
                    check_tile(level, &tile, rate, cb);
                }
            }
        }
    }
}

/// K = 8 tiles, where every state is two consecutive stream bytes: the streams `a b0 a b1 ...`
/// for every byte `a` and `b` cover all 65536 states of each codebook (checked).
#[test]
fn every_state_of_every_codebook() {
    let rate = Bitrate::int(8);
    let mut tiles = Vec::new();
    for a in 0..=255u8 {
        for half in 0..2u8 {
            let mut t = vec![0u8; rate.tile_bytes()];
            for i in 0..128u8 {
                // Stream byte j is memory byte j ^ 3 (big-endian bits in little-endian words).
                t[(2 * i as usize) ^ 3] = a;
                t[(2 * i as usize + 1) ^ 3] = 128 * half + i;
            }
            tiles.push(t);
        }
    }
    let mut seen = vec![false; 65536];
    for t in &tiles {
        for p in 0..256 {
            seen[exl3::trellis::state(t, rate, p) as usize] = true;
        }
    }
    assert!(seen.iter().all(|s| *s), "not every state covered");
    for cb in CODEBOOKS {
        for level in available_levels() {
            for t in &tiles {
                check_tile(level, t, rate, cb);
            }
        }
    }
}

/// `Σ_i |xh[t][i] · w[i][c]|` for the error bound.
fn abs_matmul(shape: &Exl3Shape, trellis: &[u8], xh: &[f32], m: usize) -> Vec<f32> {
    let w = exl3::reconstruct_inner(shape, trellis).unwrap();
    let (k, n) = (shape.k, shape.n);
    let mut y = vec![0.0f32; m * n];
    for t in 0..m {
        for i in 0..k {
            let a = xh[t * k + i].abs();
            for c in 0..n {
                y[t * n + c] += a * w[i * n + c].to_f32().abs();
            }
        }
    }
    y
}

#[test]
fn matmul_matches_scalar() {
    let mut rng = Rng(0xD1B5_4A32_D192_ED03);
    let (k, n) = (256, 384);
    for cb in CODEBOOKS {
        for rate in rates(cb) {
            let shape = Exl3Shape::from_trellis(&[k / 16, n / 16, rate.tile_words()], cb).unwrap();
            let trellis = rng.bytes(shape.trellis_bytes());
            for m in [1usize, 2, 3, 4, 5, 8, 16, 17] {
                let xh: Vec<f32> = (0..m * k)
                    .map(|_| (rng.next() % 2001) as f32 / 1000.0 - 1.0)
                    .collect();
                let bound = abs_matmul(&shape, &trellis, &xh, m);
                // Whole width, and a band in the middle.
                for (tn0, tn1) in [(0, n / 16), (8, 16)] {
                    let width = 16 * (tn1 - tn0);
                    let mut want = vec![0.0f32; m * width];
                    matmul_inner_with(Level::Scalar, &shape, &trellis, &xh, m, tn0, tn1, &mut want);
                    for level in available_levels() {
                        let mut got = vec![f32::NAN; m * width];
                        matmul_inner_with(level, &shape, &trellis, &xh, m, tn0, tn1, &mut got);
                        for t in 0..m {
                            for c in 0..width {
                                let (g, w) = (got[t * width + c], want[t * width + c]);
                                let b = bound[t * n + 16 * tn0 + c];
                                assert!(
                                    (g - w).abs() <= 1e-6 * b + 1e-30,
                                    "{} {cb:?} K={} m={m} row {t} col {c}: {g} vs {w} (bound {b})",
                                    level.name(),
                                    rate.bits()
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The default entry point picks the best level and agrees with it exactly.
#[test]
fn default_entry_is_best_level() {
    let mut rng = Rng(7);
    let shape =
        Exl3Shape::from_trellis(&[8, 8, Bitrate::int(3).tile_words()], Codebook::Mul1).unwrap();
    let trellis = rng.bytes(shape.trellis_bytes());
    let xh: Vec<f32> = (0..2 * 128).map(|i| (i as f32 * 0.37).sin()).collect();
    let (mut a, mut b) = (vec![0.0; 2 * 128], vec![0.0; 2 * 128]);
    exl3::matmul_inner(&shape, &trellis, &xh, 2, 0, 8, &mut a);
    let best = trellm_quant::exl3::simd::best_level();
    matmul_inner_with(best, &shape, &trellis, &xh, 2, 0, 8, &mut b);
    assert_eq!(a, b);
}

/// The int16-activation MUL1 kernel against its scalar twin, bit for bit: every bitrate, 1-17
/// and 33 activation rows, column ranges that start off a column group and end with a partial one.
#[cfg(target_arch = "x86_64")]
#[test]
fn int16_kernel_matches_its_scalar_twin() {
    use trellm_quant::exl3::simd::{
        int16_levels, matmul_inner_int16_scalar, matmul_inner_int16_with, Int16Rows,
    };
    let levels = int16_levels();
    if levels.is_empty() {
        eprintln!("skipped: this CPU lacks AVX2 (the int16 path is not used here)");
        return;
    }
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for rate in rates(Codebook::Mul1) {
        let shape = Exl3Shape::from_trellis(&[8, 24, rate.tile_words()], Codebook::Mul1).unwrap();
        let trellis = rng.bytes(shape.trellis_bytes());
        for m in [1usize, 2, 3, 4, 5, 6, 8, 11, 16, 17, 33] {
            let x: Vec<f32> = (0..m * 128)
                .map(|_| (rng.next() % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            let q = Int16Rows::new(&x, m, 128);
            for (tn0, tn1) in [(0, 24), (3, 21), (5, 6)] {
                let w = 16 * (tn1 - tn0);
                let (mut a, mut b) = (vec![f32::NAN; m * w], vec![f32::NAN; m * w]);
                matmul_inner_int16_scalar(&shape, &trellis, &q, tn0, tn1, &mut b);
                for &level in &levels {
                    a.fill(f32::NAN);
                    matmul_inner_int16_with(level, &shape, &trellis, &q, tn0, tn1, &mut a);
                    assert!(
                        a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()),
                        "{level:?} K={} m={m} tiles {tn0}..{tn1}: the kernel differs from its twin",
                        rate.bits()
                    );
                }
            }
        }
    }
}

/// The int16-activation MUL1 path (where the machine has AVX2 or AVX-512) stays within
/// 0.1% RMS of the exact kernel (measured: 0.02%, mostly the weights' fp16 rounding it skips).
#[cfg(target_arch = "x86_64")]
#[test]
fn int16_path_is_close() {
    use trellm_quant::exl3::simd::{int16_available, matmul_inner_int16, Int16Rows};
    if !int16_available() {
        eprintln!("skipped: this CPU lacks AVX2 (the int16 path is not used here)");
        return;
    }
    let mut rng = Rng(99);
    for rate in [
        Bitrate::int(2),
        Bitrate::int(3),
        Bitrate::half(2),
        Bitrate::int(6),
    ] {
        let shape = Exl3Shape::from_trellis(&[16, 24, rate.tile_words()], Codebook::Mul1).unwrap();
        let trellis = rng.bytes(shape.trellis_bytes());
        for m in [1usize, 3, 16, 17] {
            let xh: Vec<f32> = (0..m * 256)
                .map(|_| (rng.next() % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            let (mut a, mut b) = (vec![0.0f32; m * 384], vec![0.0f32; m * 384]);
            exl3::matmul_inner(&shape, &trellis, &xh, m, 0, 24, &mut a);
            matmul_inner_int16(
                &shape,
                &trellis,
                &Int16Rows::new(&xh, m, 256),
                0,
                24,
                &mut b,
            );
            let e2: f64 = a
                .iter()
                .zip(&b)
                .map(|(p, q)| ((p - q) as f64).powi(2))
                .sum();
            let y2: f64 = a.iter().map(|p| (*p as f64).powi(2)).sum();
            let rel = (e2 / y2).sqrt();
            assert!(
                rel < 1e-3,
                "K={} m={m}: relative RMS error {rel}",
                rate.bits()
            );
        }
    }
}

/// The int16 GEMM (decoded bands, then the integer kernel) against its scalar twin, bit for bit:
/// every MUL1 bitrate, 1-7, 13, 48 and 49 activation rows (every row remainder of the kernel's 6,
/// a task's 48 and one more), row ranges starting off 0, three 128-input blocks, every band of a
/// two-pass panel; activations of three magnitudes with zero, NaN and infinite ones among them.
#[cfg(target_arch = "x86_64")]
#[test]
fn int16_gemm_matches_its_scalar_twin() {
    use trellm_quant::exl3::simd::{int16_band_scalar, int16_gemm_available, GemmRows, Panel};
    if !int16_gemm_available() {
        eprintln!("skipped: this CPU lacks AVX-512 VNNI + VBMI2 (the int16 GEMM is not used here)");
        return;
    }
    let mut rng = Rng(0xD1B5_4A32_D192_ED03);
    for rate in rates(Codebook::Mul1) {
        let shape = Exl3Shape::from_trellis(&[24, 24, rate.tile_words()], Codebook::Mul1).unwrap();
        let trellis = rng.bytes(shape.trellis_bytes());
        let k = shape.k;
        for m in [1usize, 2, 3, 4, 5, 6, 7, 13, 48, 49] {
            let mut x: Vec<f32> = (0..m * k)
                .map(|i| {
                    let v = (rng.next() % 2001) as f32 / 1000.0 - 1.0;
                    v * [1e-3, 1.0, 300.0][i / 128 % 3]
                })
                .collect();
            x[5] = 0.0;
            x[130] = f32::NAN;
            if m > 1 {
                // (A row with an infinite input is NaN and infinities throughout.)
                x[(m - 1) * k + 300] = f32::INFINITY;
            }
            let q = GemmRows::new(&x, m, k);
            for (b0, bands) in [(0, 2), (2, 1)] {
                let panel = Panel::new(&shape, &trellis, b0, bands);
                for (r0, r1) in [(0, m), (m / 2, m)] {
                    for bi in 0..bands {
                        let n = (r1 - r0) * 128;
                        let (mut a, mut b) = (vec![f32::NAN; n], vec![f32::NAN; n]);
                        panel.band(&q, r0, r1, bi, &mut a);
                        int16_band_scalar(&shape, &trellis, &q, r0, r1, b0 + bi, &mut b);
                        assert!(
                            a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()),
                            "K={} m={m} rows {r0}..{r1} band {}: the GEMM differs from its twin",
                            rate.bits(),
                            b0 + bi
                        );
                    }
                }
            }
        }
    }
}

/// The prefill's tile decode with the 16-point butterfly down its rows equals the scalar codec's
/// tile and a plain butterfly, bit for bit, for every codebook and bitrate, at a row stride.
#[test]
fn decode_with_row_butterfly_matches_scalar() {
    use trellm_quant::exl3::simd::decode_tile_rows_h16;
    let mut rng = Rng(0xA076_1D64_78BD_642F);
    for cb in CODEBOOKS {
        for rate in rates(cb) {
            let tile = rng.bytes(rate.tile_bytes());
            let mut want = [0.0f32; 256];
            decode_tile_with(Level::Scalar, &tile, rate, cb, &mut want);
            let mut h = 1;
            while h < 16 {
                for a in (0..16).step_by(2 * h) {
                    for j in a..a + h {
                        for c in 0..16 {
                            let (p, q) = (want[16 * j + c], want[16 * (j + h) + c]);
                            want[16 * j + c] = p + q;
                            want[16 * (j + h) + c] = p - q;
                        }
                    }
                }
                h *= 2;
            }
            let stride = 40;
            let mut got = vec![f32::NAN; 15 * stride + 16];
            decode_tile_rows_h16(&tile, rate, cb, &mut got, stride);
            for r in 0..16 {
                for c in 0..16 {
                    assert_eq!(
                        got[r * stride + c].to_bits(),
                        want[16 * r + c].to_bits(),
                        "{cb:?} K={} row {r} column {c}",
                        rate.bits()
                    );
                }
            }
        }
    }
}
