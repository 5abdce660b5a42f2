//! The fused dequantize + dot kernels against the exact decoder (`dequantize`) and an f64 dot, on
//! every supported type and every instruction-set level this machine has.

use half::{bf16, f16};
use trellm_quant::ggml::dot::{
    available_levels, best_level, dot_block, dot_block_to, dot_block_with, dot_rows, Level,
};
use trellm_quant::ggml::{dequantize, GgmlType};

/// SplitMix64: a small deterministic generator, so the suite needs no extra dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn bytes(&mut self, out: &mut [u8]) {
        for b in out {
            *b = self.next() as u8;
        }
    }
}

const TYPES: [GgmlType; 21] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::Q8K,
    GgmlType::IQ2XXS,
    GgmlType::IQ2XS,
    GgmlType::IQ2S,
    GgmlType::IQ3XXS,
    GgmlType::IQ3S,
    GgmlType::IQ4NL,
    GgmlType::IQ4XS,
];

#[test]
fn every_supported_type_is_tested() {
    for t in GgmlType::ALL {
        assert_eq!(t.is_supported(), TYPES.contains(&t), "{}", t.name());
    }
}

/// A block scale: mostly the ranges real models use, plus zero, subnormal and large ones.
fn scale(rng: &mut Rng) -> f32 {
    let sign = if rng.below(4) == 0 { -1.0 } else { 1.0 };
    sign * match rng.below(16) {
        0 => 0.0,
        1 => 3.0e-7, // fp16 subnormal
        2 => 1.0 + rng.unit().abs() * 300.0,
        _ => 1.0e-4 + rng.unit().abs() * 0.05,
    }
}

fn put_f16(dst: &mut [u8], v: f32) {
    dst[..2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// A float weight: typical magnitudes, some zeros and a few large values.
fn weight(rng: &mut Rng) -> f32 {
    match rng.below(16) {
        0 => 0.0,
        1 => rng.unit() * 1000.0,
        _ => rng.unit() * 0.2,
    }
}

/// One random, valid block of `ty` (for float types: one value).
fn block(ty: GgmlType, rng: &mut Rng, out: &mut [u8]) {
    use GgmlType::*;
    rng.bytes(out);
    match ty {
        F32 => out.copy_from_slice(&weight(rng).to_le_bytes()),
        F16 => put_f16(out, weight(rng)),
        BF16 => out.copy_from_slice(&bf16::from_f32(weight(rng)).to_le_bytes()),
        Q4_0 | Q5_0 | Q8_0 | IQ4NL => put_f16(out, scale(rng)),
        IQ2XXS | IQ2XS | IQ2S | IQ3XXS | IQ3S | IQ4XS => put_f16(out, scale(rng) * 0.1),
        Q4_1 => {
            put_f16(out, scale(rng).abs());
            put_f16(&mut out[2..], -scale(rng).abs() * 8.0);
        }
        Q5_1 => {
            put_f16(out, scale(rng).abs());
            put_f16(&mut out[2..], -scale(rng).abs() * 16.0);
        }
        Q2K => {
            put_f16(&mut out[80..], scale(rng).abs() * 0.1);
            put_f16(&mut out[82..], scale(rng).abs() * 0.1);
            if rng.below(8) == 0 {
                out[..16].fill(0); // zero sub-block scales and mins
            }
        }
        Q3K => put_f16(&mut out[108..], scale(rng) * 0.05),
        Q8K => {
            // An f32 scale that fp16 could not hold: d * q rounds.
            let d = scale(rng) * 0.01 * (1.0 + rng.unit() * 1e-3);
            out[..4].copy_from_slice(&d.to_le_bytes());
        }
        Q4K | Q5K => {
            put_f16(out, scale(rng).abs() * 0.1);
            put_f16(&mut out[2..], scale(rng).abs() * 0.1);
            if rng.below(8) == 0 {
                out[4..16].fill(0); // zero sub-block scales and mins
            }
        }
        Q6K => {
            put_f16(&mut out[208..], scale(rng) * 0.05);
            if rng.below(8) == 0 {
                out[192..208].fill(0x80); // the most negative sub-block scale
            }
        }
        _ => unreachable!(),
    }
}

fn rows(ty: GgmlType, rng: &mut Rng, m: usize, cols: usize) -> Vec<u8> {
    let bb = ty.block_bytes();
    let mut v = vec![0u8; ty.bytes_for(cols).unwrap() * m];
    for b in v.chunks_exact_mut(bb) {
        block(ty, rng, b);
    }
    v
}

fn activations(rng: &mut Rng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| match rng.below(32) {
            0 => 0.0,
            1 => rng.unit() * 50.0,
            _ => rng.unit(),
        })
        .collect()
}

/// Copies `v` to a buffer whose start is misaligned by `shift` elements from a 64-byte boundary
/// (as far as Vec's allocation lets us tell), returning the buffer and the offset to slice at.
fn shifted<T: Copy + Default>(v: &[T], shift: usize) -> (Vec<T>, usize) {
    let mut buf = vec![T::default(); v.len() + 64];
    let base = buf.as_ptr() as usize;
    let size = std::mem::size_of::<T>();
    let mut at = 0;
    while (base + at * size) % 64 != (shift * size) % 64 {
        at += 1;
    }
    buf[at..at + v.len()].copy_from_slice(v);
    (buf, at)
}

/// Reference: exact decode, f64 dot. Returns (value, Σ|w·x|).
fn reference(ty: GgmlType, rows: &[u8], m: usize, x: &[f32], n: usize) -> Vec<(f64, f64)> {
    let row_bytes = rows.len() / m;
    let cols = row_bytes / ty.block_bytes() * ty.block_len();
    let mut w = vec![0f32; cols];
    let mut out = Vec::with_capacity(m * n);
    for row in rows.chunks_exact(row_bytes) {
        dequantize(ty, row, &mut w).unwrap();
        for t in 0..n {
            let xt = &x[t * cols..(t + 1) * cols];
            let (mut s, mut a) = (0f64, 0f64);
            for (&wv, &xv) in w.iter().zip(xt) {
                let p = f64::from(wv) * f64::from(xv);
                s += p;
                a += p.abs();
            }
            out.push((s, a));
        }
    }
    out
}

fn column_counts(ty: GgmlType) -> Vec<usize> {
    match ty.block_len() {
        1 => vec![1, 7, 16, 31, 32, 33, 64, 100, 645],
        bl => [1, 2, 3, 7, 24].iter().map(|b| b * bl).collect(),
    }
}

/// Returns the largest error seen, relative to Σ|w·x|.
fn check(level: Level, ty: GgmlType, rng: &mut Rng, m: usize, cols: usize, n: usize) -> f64 {
    let w = rows(ty, rng, m, cols);
    let x = activations(rng, n * cols);
    let (wbuf, wat) = shifted(&w, 1 + rng.below(63) as usize);
    let (xbuf, xat) = shifted(&x, 1 + rng.below(15) as usize);
    let mut out = vec![f32::NAN; m * n];
    dot_block_with(
        level,
        ty,
        &wbuf[wat..wat + w.len()],
        m,
        &xbuf[xat..xat + x.len()],
        n,
        &mut out,
    );
    let mut worst = 0f64;
    for (k, (&got, &(want, abs))) in out.iter().zip(&reference(ty, &w, m, &x, n)).enumerate() {
        let err = (f64::from(got) - want).abs();
        if abs > 0.0 {
            worst = worst.max(err / abs);
        }
        assert!(
            err <= 1e-5 * abs,
            "{} {}: m={m} cols={cols} n={n} out[{k}] = {got}, reference {want} (Σ|w·x| {abs}, \
             error {:.2e} of it)",
            level.name(),
            ty.name(),
            err / abs
        );
    }
    worst
}

#[test]
fn every_type_level_and_shape_matches_reference() {
    let mut rng = Rng(0x5EED);
    let levels = available_levels();
    assert_eq!(levels[0], Level::Scalar);
    assert!(levels.contains(&best_level()));
    for &level in &levels {
        for ty in TYPES {
            let mut worst = 0f64;
            for cols in column_counts(ty) {
                for n in [1, 2, 3, 4, 5, 6, 7, 8] {
                    for m in [1, 2, 3, 5] {
                        worst = worst.max(check(level, ty, &mut rng, m, cols, n));
                    }
                }
            }
            println!(
                "{:>6} {:>4}: worst error {worst:.1e} of Σ|w·x|",
                level.name(),
                ty.name()
            );
        }
    }
}

/// Larger problems, shaped like real projections (many rows; several activation row groups).
#[test]
fn model_sized_rows_match_reference() {
    let mut rng = Rng(42);
    for &level in &available_levels() {
        for ty in TYPES {
            let cols = if ty.block_len() == 256 { 2048 } else { 1536 };
            let worst = check(level, ty, &mut rng, 13, cols, 9);
            println!(
                "{:>6} {:>4} 13 x {cols}, n = 9: worst error {worst:.1e} of Σ|w·x|",
                level.name(),
                ty.name()
            );
        }
    }
}

/// With one-hot activations every output is a single weight, so this checks the decoded weights
/// bit for bit (the rest of the sum is exact zeros).
#[test]
fn one_hot_activations_recover_exact_weights() {
    let mut rng = Rng(7);
    for &level in &available_levels() {
        for ty in TYPES {
            for cols in column_counts(ty) {
                let m = 5;
                let n = 8;
                let w = rows(ty, &mut rng, m, cols);
                let mut dec = vec![0f32; m * cols];
                dequantize(ty, &w, &mut dec).unwrap();
                let mut x = vec![0f32; n * cols];
                let picks: Vec<usize> = (0..n).map(|_| rng.below(cols as u64) as usize).collect();
                for (t, &c) in picks.iter().enumerate() {
                    x[t * cols + c] = 1.0;
                }
                let mut out = vec![f32::NAN; m * n];
                dot_block_with(level, ty, &w, m, &x, n, &mut out);
                for i in 0..m {
                    for (t, &c) in picks.iter().enumerate() {
                        let (got, want) = (out[i * n + t], dec[i * cols + c]);
                        assert!(
                            got == want,
                            "{} {} cols={cols}: row {i} column {c}: {got:e} != {want:e}",
                            level.name(),
                            ty.name()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn levels_agree_closely_and_entry_points_are_consistent() {
    let mut rng = Rng(99);
    for ty in TYPES {
        let cols = 4 * ty.block_len().max(64);
        let (m, n) = (6, 5);
        let w = rows(ty, &mut rng, m, cols);
        let x = activations(&mut rng, n * cols);
        let mut best = vec![0f32; m * n];
        dot_block(ty, &w, m, &x, n, &mut best);
        let mut forced = vec![0f32; m * n];
        dot_block_with(best_level(), ty, &w, m, &x, n, &mut forced);
        assert_eq!(best, forced, "{}", ty.name());
        // Written activation-row-major into a wider output: the same values, the rest untouched.
        let ld = m + 3;
        let mut to = vec![f32::NAN; n * ld];
        // SAFETY: `to` holds n rows of ld >= m values.
        unsafe { dot_block_to(ty, &w, m, &x, n, to.as_mut_ptr(), ld) };
        for t in 0..n {
            for i in 0..m {
                assert_eq!(to[t * ld + i], best[i * n + t], "{}", ty.name());
            }
            assert!(to[t * ld + m..(t + 1) * ld].iter().all(|v| v.is_nan()));
        }
        // dot_rows on each row alone gives the same as the row inside a block (the tile shape
        // changes, so allow rounding).
        let rb = w.len() / m;
        let refs = reference(ty, &w, m, &x, n);
        for i in 0..m {
            let mut one = vec![0f32; n];
            dot_rows(ty, &w[i * rb..(i + 1) * rb], &x, n, &mut one);
            for t in 0..n {
                let (want, abs) = refs[i * n + t];
                assert!((f64::from(one[t]) - want).abs() <= 1e-5 * abs);
                assert!((f64::from(one[t]) - f64::from(best[i * n + t])).abs() <= 2e-5 * abs);
            }
        }
    }
}

#[test]
fn empty_shapes() {
    for &level in &available_levels() {
        let mut out = [];
        dot_block_with(level, GgmlType::Q4_0, &[], 0, &[1.0; 32], 1, &mut out);
        dot_block_with(level, GgmlType::Q4_0, &[0; 36], 2, &[], 0, &mut out);
        let mut out = [f32::NAN; 3];
        dot_block_with(level, GgmlType::F32, &[], 3, &[], 1, &mut out);
        assert_eq!(out, [0.0; 3]);
    }
}

#[test]
#[should_panic(expected = "unsupported")]
fn unsupported_type_panics() {
    dot_rows(GgmlType::IQ1S, &[0; 50], &[0.0; 256], 1, &mut [0.0]);
}

#[test]
#[should_panic(expected = "whole")]
fn partial_block_panics() {
    dot_rows(GgmlType::Q8_0, &[0; 35], &[0.0; 32], 1, &mut [0.0]);
}

#[test]
#[should_panic(expected = "x must hold")]
fn short_activations_panic() {
    dot_rows(GgmlType::Q8_0, &[0; 34], &[0.0; 31], 1, &mut [0.0]);
}

#[test]
#[should_panic(expected = "out must hold")]
fn wrong_out_len_panics() {
    dot_block(GgmlType::Q8_0, &[0; 68], 2, &[0.0; 32], 1, &mut [0.0]);
}

/// A row's result does not depend on how many weight or activation rows share its call: every
/// level gives, bit for bit, what the same weight row and activation row give alone (so a
/// batch's decode rows get exactly what each sequence gets by itself).
#[test]
fn results_do_not_depend_on_the_rows_beside_them() {
    let mut rng = Rng(0xBA7C);
    for level in available_levels() {
        for ty in TYPES {
            let cols = column_counts(ty)[2];
            let (m, n) = (7, 19);
            let w = rows(ty, &mut rng, m, cols);
            let x = activations(&mut rng, n * cols);
            let mut all = vec![f32::NAN; m * n];
            dot_block_with(level, ty, &w, m, &x, n, &mut all);
            let rb = w.len() / m;
            for i in 0..m {
                for t in 0..n {
                    let mut one = [f32::NAN];
                    let (wi, xt) = (&w[i * rb..(i + 1) * rb], &x[t * cols..(t + 1) * cols]);
                    dot_block_with(level, ty, wi, 1, xt, 1, &mut one);
                    assert_eq!(
                        one[0].to_bits(),
                        all[i * n + t].to_bits(),
                        "{} {}: row {i} activation {t}: {} alone, {} among {m} x {n}",
                        level.name(),
                        ty.name(),
                        one[0],
                        all[i * n + t]
                    );
                }
            }
        }
    }
}
