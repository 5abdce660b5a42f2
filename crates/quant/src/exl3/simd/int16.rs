//! The integer MUL1 path (beside the exact one): activations quantized to int16 per 16 inputs,
//! and MUL1 weights taken *before* their fp16 rounding, `w = A s + B` with `s` the byte sum of
//! the state's hash, so that `sum_r x_r w_r = A sum_r x_r s_r + B sum_r x_r` and
//! `sum_r xq_r s_r` is one AVX-512 VNNI `vpdpwssd` per 32 weights and activation row on the
//! 16-bit byte sums (AVX2: one `vpmaddwd` and an add per 16, `simd/avx2.rs`), against the exact
//! path's widening, fp16 rounding and two FMAs. What it
//! leaves out is each weight's fp16 rounding (relative 2^-12 at most) and the activations' int16
//! rounding (2^-16 of each 16's largest): int8 activations (two `vpdpbusd` straight on the
//! hash's bytes, ~10% faster at one row) measured outside exllamav3's own fp16 noise on its tiny
//! oracle models, int16 inside it.
#![allow(clippy::needless_range_loop)]

use core::arch::x86_64::*;

use super::avx512::{ld, load_tile, prefetch_ahead};
use super::{tables, Order, PairIdx, RateTables};
use crate::exl3::codebook::{Codebook, MUL1_A, MUL1_B, MUL1_MUL};
use crate::exl3::trellis::state;
use crate::exl3::Exl3Shape;
use crate::x86::dpwssd;

/// The hash `state * MUL1_MUL` of a row pair's 32 states ([`Order::Interleave`]: column `c` of
/// both rows in dword `c`), as its low and high 16-bit halves. The states are cut with the
/// VBMI2 funnel shift.
#[inline(always)]
pub(super) unsafe fn products<const BIG: bool>(
    r: &[__m512i; 4],
    p: &PairIdx,
) -> (__m512i, __m512i) {
    let (ih, il) = (ld(&p.hi), ld(&p.lo));
    let mut h = _mm512_permutex2var_epi16(r[0], ih, r[1]);
    let mut l = _mm512_permutex2var_epi16(r[0], il, r[1]);
    if BIG {
        h = _mm512_mask_blend_epi16(p.hi_sel, h, _mm512_permutex2var_epi16(r[2], ih, r[3]));
        l = _mm512_mask_blend_epi16(p.lo_sel, l, _mm512_permutex2var_epi16(r[2], il, r[3]));
    }
    let x = _mm512_shldv_epi16(h, l, ld(&p.shift));
    let ml = _mm512_set1_epi16(MUL1_MUL as u16 as i16);
    let mh = _mm512_set1_epi16((MUL1_MUL >> 16) as u16 as i16);
    let lo = _mm512_mullo_epi16(x, ml);
    let hi = _mm512_add_epi16(_mm512_mulhi_epu16(x, ml), _mm512_mullo_epi16(x, mh));
    (lo, hi)
}

/// The 16-bit byte sums `s` (0..=1020) of the hashes' low and high halves.
#[inline(always)]
pub(super) unsafe fn byte_sums(lo: __m512i, hi: __m512i) -> __m512i {
    let ones = _mm512_set1_epi8(1);
    _mm512_add_epi16(
        _mm512_maddubs_epi16(lo, ones),
        _mm512_maddubs_epi16(hi, ones),
    )
}

/// `blk` as int16 with one scale, `s` = its largest magnitude / 32767 (NaNs ignored): each
/// value's `round(v / s)` as 16-bit two's complement bits, clamped to the int16 range (as the
/// saturating cast clamps; an infinite `1 / s` can get past 32767), NaN as 0 (as the cast
/// gives). Written so that it vectorizes where it is compiled for AVX2 or AVX-512.
#[inline(always)]
pub(super) fn quantize_block<const N: usize>(blk: &[f32; N]) -> ([u16; N], f32) {
    // The largest magnitude, NaNs ignored (as `f32::max` does), by halving (the maximum of
    // values that are not NaN does not depend on the order).
    let mut top: [f32; N] = std::array::from_fn(|i| {
        let a = blk[i].abs();
        if a > 0.0 {
            a
        } else {
            0.0
        }
    });
    let mut w = N / 2;
    while w >= 1 {
        for i in 0..w {
            top[i] = if top[i + w] > top[i] {
                top[i + w]
            } else {
                top[i]
            };
        }
        w /= 2;
    }
    let s = top[0] / 32767.0;
    let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
    // `value + 1.5 * 2^23` holds the rounded value in the low 16 bits of its mantissa, in two's
    // complement (the `as i16` cast compiled to a scalar conversion a value).
    let q = std::array::from_fn(|i| {
        let v = (blk[i] * inv).round().clamp(-32768.0, 32767.0);
        (v + 12_582_912.0).to_bits() as u16
    });
    (q, s)
}

/// Activation rows quantized for [`matmul_inner_int16`]: per group of up to 16 rows (one kernel
/// pass), k-major so that the rows' values at one row pair sit side by side.
pub struct Int16Rows {
    k: usize,
    rows: usize,
    /// Per group `[tiles_k][8][rows_g]`: rows `2 rp` and `2 rp + 1` of tile row `tk` as the
    /// low and high int16 of a dword, matching [`Order::Interleave`]'s dwords.
    xq: Vec<u32>,
    /// Per group `[tiles_k][rows_g]`: the scale of each 16 inputs.
    sc: Vec<f32>,
    /// `[rows]`: `MUL1_B` times the sum of the row's quantized activations (the same values
    /// as the byte sums meet, so that `A s + B`, s ~ 510 and A s ~ -B, cancels as in the exact
    /// product).
    bias: Vec<f32>,
}

impl Int16Rows {
    /// Quantizes `rows` rows of `k` (a multiple of 16) values, `x`: `[rows][k]`, to int16 with one
    /// scale per 16 (their largest magnitude maps to 32767).
    pub fn new(x: &[f32], rows: usize, k: usize) -> Int16Rows {
        assert_eq!(x.len(), rows * k);
        assert_eq!(k % 16, 0, "EXL3 inputs are whole tiles");
        let tiles_k = k / 16;
        let mut q = Int16Rows {
            k,
            rows,
            xq: vec![0u32; rows * tiles_k * 8],
            sc: vec![0.0f32; rows * tiles_k],
            bias: vec![0.0f32; rows],
        };
        // Compiled for the SIMD level at hand (this module only runs where AVX2 or AVX-512 is),
        // so the rounding vectorizes: as baseline x86-64 it was a libm `roundf` call a value, 5%
        // of an EXL3 decode step on one thread.
        match super::best_level() {
            super::Level::Avx512 => {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
                unsafe fn wide(q: &mut Int16Rows, x: &[f32]) {
                    q.fill(x)
                }
                // SAFETY: AVX-512 is available.
                unsafe { wide(&mut q, x) };
            }
            super::Level::Avx2 => {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn narrow(q: &mut Int16Rows, x: &[f32]) {
                    q.fill(x)
                }
                // SAFETY: AVX2 and FMA are available.
                unsafe { narrow(&mut q, x) };
            }
            super::Level::Scalar => q.fill(x),
        }
        q
    }

    #[inline(always)]
    fn fill(&mut self, x: &[f32]) {
        let (k, rows) = (self.k, self.rows);
        let tiles_k = k / 16;
        for g0 in (0..rows).step_by(super::MAX_ROWS) {
            let rg = (rows - g0).min(super::MAX_ROWS);
            let (xq, sc) = (
                &mut self.xq[g0 * tiles_k * 8..],
                &mut self.sc[g0 * tiles_k..],
            );
            for m in 0..rg {
                let row = &x[(g0 + m) * k..(g0 + m + 1) * k];
                let mut sum = 0.0f32;
                for (tk, blk) in row.chunks_exact(16).enumerate() {
                    let (q, s) = quantize_block::<16>(blk.try_into().unwrap());
                    for rp in 0..8 {
                        let (a, b) = (q[2 * rp] as u32, q[2 * rp + 1] as u32);
                        xq[(tk * 8 + rp) * rg + m] = a | b << 16;
                    }
                    sc[tk * rg + m] = s;
                    sum += q.iter().map(|&v| v as i16 as i32).sum::<i32>() as f32 * s;
                }
                self.bias[g0 + m] = MUL1_B * sum;
            }
        }
    }

    /// Row `m`'s quantized activation `i` and the scale of its 16.
    fn value(&self, m: usize, i: usize) -> (i32, f32) {
        let tiles_k = self.k / 16;
        let (g0, mg) = (m - m % super::MAX_ROWS, m % super::MAX_ROWS);
        let rg = (self.rows - g0).min(super::MAX_ROWS);
        let (tk, r) = (i / 16, i % 16);
        let dword = self.xq[g0 * tiles_k * 8 + (tk * 8 + r / 2) * rg + mg];
        let q = (dword >> (16 * (r % 2))) as u16 as i16 as i32;
        (q, self.sc[g0 * tiles_k + tk * rg + mg])
    }
}

/// The scalar twin of [`matmul_inner_int16`], one output at a time in the same order of operations
/// (each tile's integer sum, then `fma(sum, scale, acc)` down `k`, then `fma(acc, A, bias)`), so
/// the two agree bit for bit.
pub fn matmul_inner_int16_scalar(
    shape: &Exl3Shape,
    trellis: &[u8],
    x: &Int16Rows,
    tn0: usize,
    tn1: usize,
    out: &mut [f32],
) {
    let width = 16 * (tn1 - tn0);
    assert_eq!(shape.codebook, Codebook::Mul1, "the int16 path is MUL1's");
    assert_eq!(x.k, shape.k);
    assert_eq!(out.len(), x.rows * width);
    for m in 0..x.rows {
        for c in 0..width {
            let (tn, col) = (tn0 + c / 16, c % 16);
            let mut acc = 0.0f32;
            for tk in 0..shape.tiles_k() {
                let tile = shape.tile(trellis, tk, tn);
                let mut sum = 0i32;
                for r in 0..16 {
                    let p = super::ELEMENT_POSITION[16 * r + col] as u32;
                    let h = (state(tile, shape.rate, p) as u32).wrapping_mul(MUL1_MUL);
                    let s: i32 = h.to_le_bytes().iter().map(|&b| b as i32).sum();
                    sum += x.value(m, 16 * tk + r).0 * s;
                }
                acc = (sum as f32).mul_add(x.value(m, 16 * tk).1, acc);
            }
            out[m * width + c] = acc.mul_add(MUL1_A, x.bias[m]);
        }
    }
}

struct Job {
    trellis: *const u8,
    tile_bytes: usize,
    tiles_n: usize,
    tiles_k: usize,
    /// This group's `[tiles_k][8][M]` activation dwords and `[tiles_k][M]` scales.
    xq: *const u32,
    sc: *const f32,
    bias: *const f32,
    tn0: usize,
    tn1: usize,
    out: *mut f32,
    width: usize,
}

/// `M` activation rows, `CG` output tile columns at a time, walking down `k` one tile row at a
/// time with the group's tiles side by side in memory (as the exact kernel does).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi2,avx2,fma")]
unsafe fn kernel<const BIG: bool, const M: usize, const S: usize, const CG: usize>(
    j: &Job,
    t: &RateTables,
    pairs: &[PairIdx; 8],
) {
    let mut tn = j.tn0;
    while tn + CG <= j.tn1 {
        columns::<BIG, M, S, CG>(j, t, pairs, tn);
        tn += CG;
    }
    while tn < j.tn1 {
        columns::<BIG, M, S, 1>(j, t, pairs, tn);
        tn += 1;
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi2,avx2,fma")]
unsafe fn columns<const BIG: bool, const M: usize, const S: usize, const CG: usize>(
    j: &Job,
    t: &RateTables,
    pairs: &[PairIdx; 8],
    tn: usize,
) {
    let stride = j.tiles_n * j.tile_bytes;
    let span = CG * j.tile_bytes;
    let mut acc = [[_mm512_setzero_ps(); M]; CG];
    let mut row = j.trellis.add(tn * j.tile_bytes);
    let (mut xk, mut sk) = (j.xq, j.sc);
    for _ in 0..j.tiles_k {
        prefetch_ahead(row, stride, span);
        for c in 0..CG {
            let r = load_tile::<BIG>(row.add(c * j.tile_bytes), t);
            // `S` integer chains a row: with few rows the tile's 8 dependent steps would
            // otherwise run at vpdpwssd's latency.
            let mut ai = [[_mm512_setzero_si512(); S]; M];
            for rp in 0..8 {
                let (lo, hi) = products::<BIG>(&r, &pairs[rp]);
                let s = byte_sums(lo, hi);
                for m in 0..M {
                    let xv = _mm512_set1_epi32(*xk.add(rp * M + m) as i32);
                    ai[m][rp % S] = dpwssd(ai[m][rp % S], s, xv);
                }
            }
            for m in 0..M {
                let mut s = ai[m][0];
                for a in 1..S {
                    s = _mm512_add_epi32(s, ai[m][a]);
                }
                let scale = _mm512_set1_ps(*sk.add(m));
                acc[c][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[c][m]);
            }
        }
        row = row.add(stride);
        xk = xk.add(8 * M);
        sk = sk.add(M);
    }
    let a = _mm512_set1_ps(MUL1_A);
    for c in 0..CG {
        for m in 0..M {
            let y = _mm512_fmadd_ps(acc[c][m], a, _mm512_set1_ps(*j.bias.add(m)));
            _mm512_storeu_ps(j.out.add(m * j.width + 16 * (tn + c - j.tn0)), y);
        }
    }
}

unsafe fn run<const BIG: bool>(j: &Job, t: &RateTables, rows: usize) {
    let p = t.pairs(Order::Interleave);
    // Column groups as wide as the registers allow (`CG x M` float sums, `2 M` integer ones).
    match rows {
        1 => kernel::<BIG, 1, 2, 8>(j, t, p),
        2 => kernel::<BIG, 2, 2, 4>(j, t, p),
        3 => kernel::<BIG, 3, 2, 2>(j, t, p),
        4 => kernel::<BIG, 4, 2, 2>(j, t, p),
        5 => kernel::<BIG, 5, 1, 2>(j, t, p),
        6 => kernel::<BIG, 6, 1, 1>(j, t, p),
        7 => kernel::<BIG, 7, 1, 1>(j, t, p),
        8 => kernel::<BIG, 8, 1, 1>(j, t, p),
        9 => kernel::<BIG, 9, 1, 1>(j, t, p),
        10 => kernel::<BIG, 10, 1, 1>(j, t, p),
        11 => kernel::<BIG, 11, 1, 1>(j, t, p),
        12 => kernel::<BIG, 12, 1, 1>(j, t, p),
        13 => kernel::<BIG, 13, 1, 1>(j, t, p),
        14 => kernel::<BIG, 14, 1, 1>(j, t, p),
        15 => kernel::<BIG, 15, 1, 1>(j, t, p),
        16 => kernel::<BIG, 16, 1, 1>(j, t, p),
        _ => unreachable!("1..=16 rows per call"),
    }
}

/// Whether this machine has the AVX-512 int16 kernel (VNNI and VBMI2: Zen 4, Ice Lake and later).
pub(super) fn avx512_int16() -> bool {
    super::Level::Avx512.is_available()
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx512vbmi2")
}

/// The levels whose int16 kernel this machine runs, the fastest first: AVX-512 with VNNI and
/// VBMI2, and AVX2 with FMA (`vpmaddwd` on the same 16-bit byte sums, the same bits).
pub fn int16_levels() -> Vec<super::Level> {
    let mut levels = Vec::new();
    if avx512_int16() {
        levels.push(super::Level::Avx512);
    }
    if super::Level::Avx2.is_available() {
        levels.push(super::Level::Avx2);
    }
    levels
}

/// Whether this machine runs [`matmul_inner_int16`].
pub fn int16_available() -> bool {
    !int16_levels().is_empty()
}

/// [`crate::exl3::matmul_inner`] for MUL1 layers on int16 activations ([`Int16Rows`] of the rotated
/// inputs) and unrounded MUL1 weights (see the module notes): `out` is `[rows][16 (tn1 - tn0)]`,
/// overwritten. Panics unless the layer is MUL1 and [`int16_available`].
pub fn matmul_inner_int16(
    shape: &Exl3Shape,
    trellis: &[u8],
    x: &Int16Rows,
    tn0: usize,
    tn1: usize,
    out: &mut [f32],
) {
    let level = if avx512_int16() {
        super::Level::Avx512
    } else {
        super::Level::Avx2
    };
    matmul_inner_int16_with(level, shape, trellis, x, tn0, tn1, out)
}

/// [`matmul_inner_int16`] on a chosen level (one of [`int16_levels`]); every level gives the same
/// bits.
pub fn matmul_inner_int16_with(
    level: super::Level,
    shape: &Exl3Shape,
    trellis: &[u8],
    x: &Int16Rows,
    tn0: usize,
    tn1: usize,
    out: &mut [f32],
) {
    let (m, tiles_k) = (x.rows, shape.tiles_k());
    let width = 16 * (tn1 - tn0);
    assert_eq!(shape.codebook, Codebook::Mul1, "the int16 path is MUL1's");
    assert!(
        int16_levels().contains(&level),
        "this machine has no int16 kernel at {level:?}"
    );
    assert!(tn0 <= tn1 && tn1 <= shape.tiles_n());
    assert_eq!(x.k, shape.k);
    assert_eq!(out.len(), m * width);
    assert_eq!(trellis.len(), shape.trellis_bytes());
    let wide = level == super::Level::Avx512;
    for g0 in (0..m).step_by(super::MAX_ROWS) {
        let rows = (m - g0).min(super::MAX_ROWS);
        let (xq, sc, bias) = (
            x.xq[g0 * tiles_k * 8..].as_ptr(),
            x.sc[g0 * tiles_k..].as_ptr(),
            x.bias[g0..].as_ptr(),
        );
        let out = out[g0 * width..].as_mut_ptr();
        if !wide {
            let g = super::avx2::Int16Group { xq, sc, bias, rows };
            // SAFETY: AVX2 and FMA are available (int16_levels); the group's activations,
            // scales and outputs hold `rows` rows from `g0`; every tile index is in `trellis`.
            unsafe { super::avx2::matmul_int16(shape, trellis.as_ptr(), &g, tn0, tn1, out) };
            continue;
        }
        let t = tables(shape.rate);
        let j = Job {
            trellis: trellis.as_ptr(),
            tile_bytes: shape.rate.tile_bytes(),
            tiles_n: shape.tiles_n(),
            tiles_k,
            xq,
            sc,
            bias,
            tn0,
            tn1,
            out,
            width,
        };
        // SAFETY: features checked above; the group's activations, scales and outputs hold
        // `rows` rows from `g0`, and every tile index is within `trellis`.
        unsafe {
            if t.big() {
                run::<true>(&j, t, rows)
            } else {
                run::<false>(&j, t, rows)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`Int16Rows::new`] as first written: scalar, with `as i16` (the twin of the vectorized
    /// rounding and bit-level conversion).
    fn reference(x: &[f32], rows: usize, k: usize) -> (Vec<u32>, Vec<f32>, Vec<f32>) {
        let tiles_k = k / 16;
        let mut xq = vec![0u32; rows * tiles_k * 8];
        let mut sc = vec![0.0f32; rows * tiles_k];
        let mut bias = vec![0.0f32; rows];
        for g0 in (0..rows).step_by(super::super::MAX_ROWS) {
            let rg = (rows - g0).min(super::super::MAX_ROWS);
            for m in 0..rg {
                let row = &x[(g0 + m) * k..(g0 + m + 1) * k];
                let mut sum = 0.0f32;
                for (tk, blk) in row.chunks_exact(16).enumerate() {
                    let amax = blk.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                    let s = amax / 32767.0;
                    let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
                    let q: [i16; 16] = std::array::from_fn(|i| (blk[i] * inv).round() as i16);
                    for rp in 0..8 {
                        let (a, b) = (q[2 * rp] as u16 as u32, q[2 * rp + 1] as u16 as u32);
                        xq[g0 * tiles_k * 8 + (tk * 8 + rp) * rg + m] = a | b << 16;
                    }
                    sc[g0 * tiles_k + tk * rg + m] = s;
                    sum += q.iter().map(|&v| v as i32).sum::<i32>() as f32 * s;
                }
                bias[g0 + m] = MUL1_B * sum;
            }
        }
        (xq, sc, bias)
    }

    #[test]
    fn quantized_rows_match_the_scalar_cast() {
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let k = 96;
        for rows in [1, 3, 16, 17, 40] {
            let mut x: Vec<f32> = (0..rows * k)
                .map(|_| {
                    let v = (next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
                    v * [1e-3, 1.0, 300.0][(next() % 3) as usize]
                })
                .collect();
            // Blocks of zeros, of values so small that 1 / scale overflows, halves, and
            // non-finite values.
            x[..16].fill(0.0);
            x[16..32]
                .iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v = i as f32 * 1e-40);
            x[32] = 0.5 * 32767.0 / 3.0;
            x[33] = 3.0;
            x[48] = f32::NAN;
            x[64] = f32::INFINITY;
            x[65] = f32::NEG_INFINITY;
            let q = Int16Rows::new(&x, rows, k);
            let (xq, sc, bias) = reference(&x, rows, k);
            assert_eq!(q.xq, xq, "{rows} rows: quantized values");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&q.sc), bits(&sc), "{rows} rows: scales");
            assert_eq!(bits(&q.bias), bits(&bias), "{rows} rows: biases");
        }
    }
}
