//! The approximate MUL1 path (beside the exact one, never used by the engine unless asked):
//! activations quantized to int8 per 16 inputs, and MUL1 weights taken *before* their fp16
//! rounding, `w = A s + B` with `s` the byte sum of the state's hash, so that
//! `sum_r x_r w_r = A sum_r x_r s_r + B sum_r x_r` and `sum_r xq_r s_r` is one AVX-512 VNNI
//! `vpdpbusd` per 16 weights against the hash's bytes.
#![allow(clippy::needless_range_loop)]

use core::arch::x86_64::*;

use super::{tables, Order, PairIdx, RateTables};
use crate::exl3::codebook::{Codebook, MUL1_A, MUL1_B, MUL1_MUL};
use crate::exl3::Exl3Shape;

#[inline(always)]
unsafe fn ld(p: &[u16; 32]) -> __m512i {
    _mm512_load_si512(p.as_ptr().cast())
}

#[inline(always)]
unsafe fn load_tile<const BIG: bool>(tile: *const u8, t: &RateTables) -> [__m512i; 4] {
    let p = tile.cast::<i16>();
    let mut r = [_mm512_setzero_si512(); 4];
    r[0] = _mm512_maskz_loadu_epi16(t.masks[0], p);
    r[1] = _mm512_maskz_loadu_epi16(t.masks[1], p.add(32));
    if BIG {
        r[2] = _mm512_maskz_loadu_epi16(t.masks[2], p.add(64));
        r[3] = _mm512_maskz_loadu_epi16(t.masks[3], p.add(96));
    }
    r
}

/// The hash `state * MUL1_MUL` of a row pair's 32 states, as the products of the first and the
/// second row (one per dword, columns in lane order).
#[inline(always)]
unsafe fn products<const BIG: bool>(r: &[__m512i; 4], p: &PairIdx) -> [__m512i; 2] {
    let (ih, il) = (ld(&p.hi), ld(&p.lo));
    let mut h = _mm512_permutex2var_epi16(r[0], ih, r[1]);
    let mut l = _mm512_permutex2var_epi16(r[0], il, r[1]);
    if BIG {
        h = _mm512_mask_blend_epi16(p.hi_sel, h, _mm512_permutex2var_epi16(r[2], ih, r[3]));
        l = _mm512_mask_blend_epi16(p.lo_sel, l, _mm512_permutex2var_epi16(r[2], il, r[3]));
    }
    let pow = ld(&p.pow);
    let x = _mm512_or_si512(_mm512_mullo_epi16(h, pow), _mm512_mulhi_epu16(l, pow));
    let ml = _mm512_set1_epi16(MUL1_MUL as u16 as i16);
    let mh = _mm512_set1_epi16((MUL1_MUL >> 16) as u16 as i16);
    let lo = _mm512_mullo_epi16(x, ml);
    let hi = _mm512_add_epi16(_mm512_mulhi_epu16(x, ml), _mm512_mullo_epi16(x, mh));
    [_mm512_unpacklo_epi16(lo, hi), _mm512_unpackhi_epi16(lo, hi)]
}

struct Job {
    trellis: *const u8,
    tile_bytes: usize,
    tiles_n: usize,
    tiles_k: usize,
    /// `[rows][tiles_k][16]` int8 activations, each replicated into the 4 bytes of a dword.
    xq: *const u32,
    /// `[rows][tiles_k]` their scales.
    sc: *const f32,
    /// `[rows]` the sums of the dequantized activations.
    sum: *const f32,
    tn0: usize,
    tn1: usize,
    out: *mut f32,
    width: usize,
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn kernel<const BIG: bool, const M: usize, const S: usize>(
    j: &Job,
    t: &RateTables,
    pairs: &[PairIdx; 8],
) {
    let stride = j.tiles_n * j.tile_bytes;
    for tn in j.tn0..j.tn1 {
        let mut acc = [_mm512_setzero_ps(); M];
        let mut tile = j.trellis.add(tn * j.tile_bytes);
        for tk in 0..j.tiles_k {
            let ahead = tile.wrapping_add(4 * stride);
            _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(j.tile_bytes - 1).cast());
            let r = load_tile::<BIG>(tile, t);
            let mut ai = [[_mm512_setzero_si512(); S]; M];
            for rp in 0..8 {
                let p = products::<BIG>(&r, &pairs[rp]);
                for h in 0..2 {
                    for m in 0..M {
                        let q = j.xq.add((m * j.tiles_k + tk) * 16 + 2 * rp + h);
                        let xv = _mm512_set1_epi32(*q as i32);
                        ai[m][h % S] = _mm512_dpbusd_epi32(ai[m][h % S], p[h], xv);
                    }
                }
            }
            for m in 0..M {
                let mut s = ai[m][0];
                for a in 1..S {
                    s = _mm512_add_epi32(s, ai[m][a]);
                }
                let scale = _mm512_set1_ps(*j.sc.add(m * j.tiles_k + tk));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[m]);
            }
            tile = tile.add(stride);
        }
        let a = _mm512_set1_ps(MUL1_A);
        for m in 0..M {
            let b = _mm512_set1_ps(MUL1_B * *j.sum.add(m));
            let y = _mm512_fmadd_ps(acc[m], a, b);
            _mm512_storeu_ps(j.out.add(m * j.width + 16 * (tn - j.tn0)), y);
        }
    }
}

unsafe fn run<const BIG: bool>(j: &Job, t: &RateTables, rows: usize) {
    let p = t.pairs(Order::Unpack);
    match rows {
        1 => kernel::<BIG, 1, 2>(j, t, p),
        2 => kernel::<BIG, 2, 2>(j, t, p),
        3 => kernel::<BIG, 3, 1>(j, t, p),
        4 => kernel::<BIG, 4, 1>(j, t, p),
        5 => kernel::<BIG, 5, 1>(j, t, p),
        6 => kernel::<BIG, 6, 1>(j, t, p),
        7 => kernel::<BIG, 7, 1>(j, t, p),
        8 => kernel::<BIG, 8, 1>(j, t, p),
        9 => kernel::<BIG, 9, 1>(j, t, p),
        10 => kernel::<BIG, 10, 1>(j, t, p),
        11 => kernel::<BIG, 11, 1>(j, t, p),
        12 => kernel::<BIG, 12, 1>(j, t, p),
        13 => kernel::<BIG, 13, 1>(j, t, p),
        14 => kernel::<BIG, 14, 1>(j, t, p),
        15 => kernel::<BIG, 15, 1>(j, t, p),
        16 => kernel::<BIG, 16, 1>(j, t, p),
        _ => unreachable!("1..=16 rows per call"),
    }
}

/// Whether this machine runs [`matmul_inner_q8`].
pub fn q8_available() -> bool {
    super::Level::Avx512.is_available() && is_x86_feature_detected!("avx512vnni")
}

/// Approximate [`crate::exl3::matmul_inner`] for MUL1 layers: int8 activations (one scale per
/// 16 inputs) and unrounded MUL1 weights (see the module notes). Panics unless the layer is
/// MUL1 and [`q8_available`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_inner_q8(
    shape: &Exl3Shape,
    trellis: &[u8],
    xh: &[f32],
    m: usize,
    tn0: usize,
    tn1: usize,
    out: &mut [f32],
) {
    let (k, tiles_k) = (shape.k, shape.tiles_k());
    let width = 16 * (tn1 - tn0);
    assert_eq!(shape.codebook, Codebook::Mul1, "the int8 path is MUL1's");
    assert!(q8_available(), "the int8 path needs AVX-512 VNNI");
    assert!(tn0 <= tn1 && tn1 <= shape.tiles_n());
    assert_eq!(xh.len(), m * k);
    assert_eq!(out.len(), m * width);
    assert_eq!(trellis.len(), shape.trellis_bytes());
    let mut xq = vec![0u32; m * k];
    let mut sc = vec![0.0f32; m * tiles_k];
    let mut sum = vec![0.0f32; m];
    for t in 0..m {
        let row = &xh[t * k..(t + 1) * k];
        for (tk, blk) in row.chunks_exact(16).enumerate() {
            let amax = blk.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let s = amax / 127.0;
            sc[t * tiles_k + tk] = s;
            let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
            let mut qs = 0i32;
            for (i, v) in blk.iter().enumerate() {
                let q = (v * inv).round() as i8;
                qs += q as i32;
                xq[t * k + 16 * tk + i] = q as u8 as u32 * 0x0101_0101;
            }
            // The bias term uses the same quantized activations as the byte sums, so that
            // `A s + B` (s ~ 510, A s ~ -B) cancels as it does in the exact product.
            sum[t] += qs as f32 * s;
        }
    }
    let t = tables(shape.rate);
    let mut r0 = 0;
    while r0 < m {
        let rows = (m - r0).min(super::MAX_ROWS);
        let j = Job {
            trellis: trellis.as_ptr(),
            tile_bytes: shape.rate.tile_bytes(),
            tiles_n: shape.tiles_n(),
            tiles_k,
            xq: xq[r0 * k..].as_ptr(),
            sc: sc[r0 * tiles_k..].as_ptr(),
            sum: sum[r0..].as_ptr(),
            tn0,
            tn1,
            out: out[r0 * width..].as_mut_ptr(),
            width,
        };
        // SAFETY: features checked above; buffers sized for `rows` rows from `r0`.
        unsafe {
            if t.big() {
                run::<true>(&j, t, rows)
            } else {
                run::<false>(&j, t, rows)
            }
        }
        r0 += rows;
    }
}
