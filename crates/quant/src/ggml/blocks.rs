//! Per-type block decoders. Callers ([`super::dequantize`]) have already checked that `src` is a
//! whole number of blocks and that `out` holds exactly the decoded values.
//!
//! Why exactness is robust here: fp16 → f32 is exact, and in every fp16-scaled format each
//! product (fp16 scale × sub-scale × quant or grid value: at most 11 + 6 + 7 significant bits, the
//! i-quants' `(0.5 + s) / 4` factors included) fits f32's 24-bit significand, so it is exact
//! whatever the evaluation order. The only rounding step is the final `+ m` (Q4_1, Q5_1) or
//! `- dmin * m` (Q2_K, Q4_K, Q5_K), a single rounding with or without fused multiply-add, and
//! Q8_K's f32 scale × quant, one rounding. The code still follows the reference's operation
//! order.
//!
//! Blocks are read as little-endian byte arrays, so `src` needs no alignment.

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::grids;

/// Runs `f` on each `B`-byte block of `src` and the `N` outputs it decodes to.
#[inline(always)]
fn each_block<const B: usize, const N: usize>(
    src: &[u8],
    out: &mut [f32],
    mut f: impl FnMut(&[u8; B], &mut [f32; N]),
) {
    for (s, o) in src.chunks_exact(B).zip(out.chunks_exact_mut(N)) {
        // chunks_exact guarantees the lengths, so these conversions always succeed; going through
        // fixed-size arrays lets the compiler drop every bounds check inside `f`.
        if let (Ok(s), Ok(o)) = (<&[u8; B]>::try_from(s), <&mut [f32; N]>::try_from(o)) {
            f(s, o);
        }
    }
}

#[inline(always)]
fn fp16(lo: u8, hi: u8) -> f32 {
    f16::from_le_bytes([lo, hi]).to_f32()
}

pub(super) fn float32(src: &[u8], out: &mut [f32]) {
    each_block::<4, 1>(src, out, |b, y| y[0] = f32::from_le_bytes(*b));
}

pub(super) fn float16(src: &[u8], out: &mut [f32]) {
    // Stage through an aligned buffer so `half` can use its vectorized (F16C) slice conversion.
    const CHUNK: usize = 256;
    let mut buf = [f16::ZERO; CHUNK];
    for (s, o) in src.chunks(2 * CHUNK).zip(out.chunks_mut(CHUNK)) {
        let buf = &mut buf[..o.len()];
        for (h, b) in buf.iter_mut().zip(s.chunks_exact(2)) {
            *h = f16::from_le_bytes([b[0], b[1]]);
        }
        buf.convert_to_f32_slice(o);
    }
}

pub(super) fn bfloat16(src: &[u8], out: &mut [f32]) {
    // bf16 is the top half of an f32; shifting (rather than rounding) keeps NaN payloads too.
    each_block::<2, 1>(src, out, |b, y| {
        y[0] = f32::from_bits(u32::from(u16::from_le_bytes(*b)) << 16)
    });
}

/// Q4_0: fp16 d, then 16 bytes whose low nibbles are values 0..16 and high nibbles 16..32.
pub(super) fn q4_0(src: &[u8], out: &mut [f32]) {
    each_block::<18, 32>(src, out, |b, y| {
        let d = fp16(b[0], b[1]);
        let (lo, hi) = y.split_at_mut(16);
        for ((&q, l), h) in b[2..].iter().zip(lo).zip(hi) {
            *l = (i32::from(q & 0x0F) - 8) as f32 * d;
            *h = (i32::from(q >> 4) - 8) as f32 * d;
        }
    });
}

/// Q4_1: fp16 d, fp16 m, then nibbles as in Q4_0, unsigned, value = q * d + m.
pub(super) fn q4_1(src: &[u8], out: &mut [f32]) {
    each_block::<20, 32>(src, out, |b, y| {
        let d = fp16(b[0], b[1]);
        let m = fp16(b[2], b[3]);
        let (lo, hi) = y.split_at_mut(16);
        for ((&q, l), h) in b[4..].iter().zip(lo).zip(hi) {
            *l = f32::from(q & 0x0F) * d + m;
            *h = f32::from(q >> 4) * d + m;
        }
    });
}

/// Q5_0: fp16 d, a u32 holding bit 4 of each of the 32 values, then nibbles as in Q4_0.
pub(super) fn q5_0(src: &[u8], out: &mut [f32]) {
    each_block::<22, 32>(src, out, |b, y| {
        let d = fp16(b[0], b[1]);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let (lo, hi) = y.split_at_mut(16);
        for (j, ((&q, l), h)) in b[6..].iter().zip(lo).zip(hi).enumerate() {
            let bit_lo = ((qh >> j) & 1) as i32;
            let bit_hi = ((qh >> (j + 16)) & 1) as i32;
            *l = ((i32::from(q & 0x0F) | (bit_lo << 4)) - 16) as f32 * d;
            *h = ((i32::from(q >> 4) | (bit_hi << 4)) - 16) as f32 * d;
        }
    });
}

/// Q8_0: fp16 d, then 32 signed bytes.
pub(super) fn q8_0(src: &[u8], out: &mut [f32]) {
    each_block::<34, 32>(src, out, |b, y| {
        let d = fp16(b[0], b[1]);
        for (&q, v) in b[2..].iter().zip(y.iter_mut()) {
            *v = f32::from(q as i8) * d;
        }
    });
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K block: sub-blocks 0..4 sit in
/// the low 6 bits of bytes 0..8; sub-blocks 4..8 are split between the nibbles of bytes 8..12
/// and the top 2 bits of bytes 0..8.
#[inline(always)]
fn k4_scale_min(j: usize, s: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 0x3F, s[j + 4] & 0x3F)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q4_K: fp16 d, fp16 dmin, 12 bytes of packed 6-bit scales/mins for 8 sub-blocks of 32, then 128
/// bytes: each 32-byte run holds two sub-blocks (low nibbles first).
pub(super) fn q4_k(src: &[u8], out: &mut [f32]) {
    each_block::<144, 256>(src, out, |b, y| {
        let d = fp16(b[0], b[1]);
        let dmin = fp16(b[2], b[3]);
        let mut scales = [0u8; 12];
        scales.copy_from_slice(&b[4..16]);
        let mut dl = [0f32; 8];
        let mut ml = [0f32; 8];
        for j in 0..8 {
            let (sc, m) = k4_scale_min(j, &scales);
            dl[j] = d * f32::from(sc);
            ml[j] = dmin * f32::from(m);
        }
        for (k, (q, y)) in b[16..]
            .chunks_exact(32)
            .zip(y.chunks_exact_mut(64))
            .enumerate()
        {
            let (d1, m1, d2, m2) = (dl[2 * k], ml[2 * k], dl[2 * k + 1], ml[2 * k + 1]);
            let (lo, hi) = y.split_at_mut(32);
            for ((&q, l), h) in q.iter().zip(lo).zip(hi) {
                *l = d1 * f32::from(q & 0x0F) - m1;
                *h = d2 * f32::from(q >> 4) - m2;
            }
        }
    });
}

/// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 signed 8-bit scales (one per
/// 16 values), then fp16 d. Each half block of 128 values uses 64 low bytes and 32 high bytes.
pub(super) fn q6_k(src: &[u8], out: &mut [f32]) {
    each_block::<210, 256>(src, out, |b, y| {
        let d = fp16(b[208], b[209]);
        let mut ds = [0f32; 16];
        for (s, &sc) in ds.iter_mut().zip(&b[192..208]) {
            *s = d * f32::from(sc as i8);
        }
        let (ql, qh) = (&b[..128], &b[128..192]);
        for (n, y) in y.chunks_exact_mut(128).enumerate() {
            let ql = &ql[64 * n..64 * n + 64];
            let qh = &qh[32 * n..32 * n + 32];
            let ds = &ds[8 * n..8 * n + 8];
            // Output i of this half uses scale i / 16; its 6-bit value is assembled from a nibble
            // of ql and 2 bits of qh, both picked by which quarter (32 values) it falls in.
            let (y01, y23) = y.split_at_mut(64);
            let (y0, y1) = y01.split_at_mut(32);
            let (y2, y3) = y23.split_at_mut(32);
            for l in 0..32 {
                let is = l / 16;
                let (a, c, h) = (ql[l], ql[l + 32], qh[l]);
                let q0 = i32::from((a & 0x0F) | ((h & 3) << 4)) - 32;
                let q1 = i32::from((c & 0x0F) | (((h >> 2) & 3) << 4)) - 32;
                let q2 = i32::from((a >> 4) | (((h >> 4) & 3) << 4)) - 32;
                let q3 = i32::from((c >> 4) | (((h >> 6) & 3) << 4)) - 32;
                y0[l] = ds[is] * q0 as f32;
                y1[l] = ds[is + 2] * q1 as f32;
                y2[l] = ds[is + 4] * q2 as f32;
                y3[l] = ds[is + 6] * q3 as f32;
            }
        }
    });
}

/// Q5_1: fp16 d, fp16 m, the 32 fifth bits, then nibbles as in Q4_0; value = q * d + m.
pub(super) fn q5_1(src: &[u8], out: &mut [f32]) {
    each_block::<24, 32>(src, out, |b, y| {
        let d = fp16(b[0], b[1]);
        let m = fp16(b[2], b[3]);
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let (lo, hi) = y.split_at_mut(16);
        for (j, ((&q, l), h)) in b[8..].iter().zip(lo).zip(hi).enumerate() {
            let bit_lo = ((qh >> j) & 1) as u8;
            let bit_hi = ((qh >> (j + 16)) & 1) as u8;
            *l = f32::from((q & 0x0F) | (bit_lo << 4)) * d + m;
            *h = f32::from((q >> 4) | (bit_hi << 4)) * d + m;
        }
    });
}

/// Q2_K: 16 bytes of 4-bit scale / 4-bit min pairs (one per 16 values), 64 bytes of 2-bit quants,
/// fp16 d, fp16 dmin. Each half block of 128 values takes 32 quant bytes, 2 bits per quarter.
pub(super) fn q2_k(src: &[u8], out: &mut [f32]) {
    each_block::<84, 256>(src, out, |b, y| {
        let d = fp16(b[80], b[81]);
        let dmin = fp16(b[82], b[83]);
        let mut dl = [0f32; 16];
        let mut ml = [0f32; 16];
        for (k, &sc) in b[..16].iter().enumerate() {
            dl[k] = d * f32::from(sc & 0x0F);
            ml[k] = dmin * f32::from(sc >> 4);
        }
        for (h, y) in y.chunks_exact_mut(128).enumerate() {
            let qs = &b[16 + 32 * h..48 + 32 * h];
            for (j, y) in y.chunks_exact_mut(32).enumerate() {
                // Values 128 h + 32 j + l: scales 8 h + 2 j (l < 16) and 8 h + 2 j + 1.
                let k = 8 * h + 2 * j;
                for (l, (y, &q)) in y.iter_mut().zip(qs).enumerate() {
                    let k = k + l / 16;
                    *y = dl[k] * f32::from((q >> (2 * j)) & 3) - ml[k];
                }
            }
        }
    });
}

/// The 16 signed 6-bit scales of a Q3_K block (bytes 96..108): low nibbles from bytes 0..8
/// (scales 0..8 the low nibbles, 8..16 the high ones), 2 high bits each from bytes 8..12.
#[inline(always)]
fn k3_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (k, o) in out.iter_mut().enumerate() {
        let lo = (s[k % 8] >> (4 * (k / 8))) & 0x0F;
        let hi = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
        *o = (lo | (hi << 4)) as i8 - 32;
    }
    out
}

/// Q3_K: 32 bytes of high bits (bit i of byte l belongs to value 32 i + l), 64 bytes of 2-bit
/// quants laid out as in Q2_K, 12 bytes of 6-bit scales (one per 16 values), fp16 d. A quant is
/// its 2 low bits minus 4 when its high bit is clear.
pub(super) fn q3_k(src: &[u8], out: &mut [f32]) {
    each_block::<110, 256>(src, out, |b, y| {
        let d = fp16(b[108], b[109]);
        let sc = k3_scales(&b[96..108]);
        let mut dl = [0f32; 16];
        for (dl, &s) in dl.iter_mut().zip(&sc) {
            *dl = d * f32::from(s);
        }
        let hmask = &b[..32];
        for (h, y) in y.chunks_exact_mut(128).enumerate() {
            let qs = &b[32 + 32 * h..64 + 32 * h];
            for (j, y) in y.chunks_exact_mut(32).enumerate() {
                let i = 4 * h + j;
                for (l, ((y, &q), &hm)) in y.iter_mut().zip(qs).zip(hmask).enumerate() {
                    let lo = ((q >> (2 * j)) & 3) as i8;
                    let q = lo - if (hm >> i) & 1 == 0 { 4 } else { 0 };
                    *y = dl[2 * i + l / 16] * f32::from(q);
                }
            }
        }
    });
}

/// Q5_K: fp16 d, fp16 dmin, 6-bit scales/mins as in Q4_K, 32 bytes of fifth bits (bit i of byte
/// l belongs to sub-block i, value l), then the nibbles as in Q4_K.
pub(super) fn q5_k(src: &[u8], out: &mut [f32]) {
    each_block::<176, 256>(src, out, |b, y| {
        let d = fp16(b[0], b[1]);
        let dmin = fp16(b[2], b[3]);
        let mut scales = [0u8; 12];
        scales.copy_from_slice(&b[4..16]);
        let qh = &b[16..48];
        for (k, y) in y.chunks_exact_mut(32).enumerate() {
            let (sc, m) = k4_scale_min(k, &scales);
            let (dl, ml) = (d * f32::from(sc), dmin * f32::from(m));
            let ql = &b[48 + 32 * (k / 2)..48 + 32 * (k / 2) + 32];
            for (l, y) in y.iter_mut().enumerate() {
                let q = ((ql[l] >> (4 * (k % 2))) & 0x0F) | (((qh[l] >> k) & 1) << 4);
                *y = dl * f32::from(q) - ml;
            }
        }
    });
}

/// Q8_K: f32 d, 256 signed bytes, then 16 i16 block sums (not needed to decode).
pub(super) fn q8_k(src: &[u8], out: &mut [f32]) {
    each_block::<292, 256>(src, out, |b, y| {
        let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        for (&q, v) in b[4..260].iter().zip(y.iter_mut()) {
            *v = d * f32::from(q as i8);
        }
    });
}

/// Eight grid values times `db`, negated where `signs` has a bit set (bit j for value j).
#[inline(always)]
fn signed_grid(y: &mut [f32], db: f32, grid: &[u8; 8], signs: u8) {
    for (j, (y, &g)) in y.iter_mut().zip(grid).enumerate() {
        // Negating the exact product sets its sign bit, as the reference's `* -1.0` does.
        let neg = u32::from((signs >> j) & 1) << 31;
        *y = f32::from_bits((db * f32::from(g)).to_bits() ^ neg);
    }
}

#[inline(always)]
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// IQ2_XXS: fp16 d, then per 32 values two u32s: four 8-bit grid indices, and four 7-bit sign
/// indices plus a 4-bit scale in the top bits.
pub(super) fn iq2_xxs(src: &[u8], out: &mut [f32]) {
    each_block::<66, 256>(src, out, |b, y| {
        let d = fp16(b[0], b[1]);
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let idx = u32_at(b, 2 + 8 * ib).to_le_bytes();
            let aux = u32_at(b, 6 + 8 * ib);
            let db = d * (0.5 + (aux >> 28) as f32) * 0.25;
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let grid = grids::IQ2XXS_GRID[usize::from(idx[l])].to_le_bytes();
                let signs = grids::KSIGNS[((aux >> (7 * l)) & 0x7F) as usize];
                signed_grid(y, db, &grid, signs);
            }
        }
    });
}

/// The IQ2_XS / IQ2_S scale of group `g` (8 values): a nibble per 16 values.
#[inline(always)]
fn iq2_db(d: f32, scales: &[u8], g: usize) -> f32 {
    let s = (scales[g / 4] >> (4 * ((g % 4) / 2))) & 0x0F;
    d * (0.5 + f32::from(s)) * 0.25
}

/// IQ2_XS: fp16 d, 32 u16s (9-bit grid index, 7-bit sign index per 8 values), 8 bytes of 4-bit
/// scales.
pub(super) fn iq2_xs(src: &[u8], out: &mut [f32]) {
    each_block::<74, 256>(src, out, |b, y| {
        let d = fp16(b[0], b[1]);
        let scales = &b[66..74];
        for (g, y) in y.chunks_exact_mut(8).enumerate() {
            let q = u16::from_le_bytes([b[2 + 2 * g], b[3 + 2 * g]]);
            let grid = grids::IQ2XS_GRID[usize::from(q & 511)].to_le_bytes();
            let signs = grids::KSIGNS[usize::from(q >> 9)];
            signed_grid(y, iq2_db(d, scales, g), &grid, signs);
        }
    });
}

/// IQ2_S: fp16 d, 32 low bytes of the 10-bit grid indices, 32 sign bytes, 8 bytes holding the
/// indices' top 2 bits, 8 bytes of 4-bit scales.
pub(super) fn iq2_s(src: &[u8], out: &mut [f32]) {
    each_block::<82, 256>(src, out, |b, y| {
        let d = fp16(b[0], b[1]);
        let scales = &b[74..82];
        for (g, y) in y.chunks_exact_mut(8).enumerate() {
            let hi = (b[66 + g / 4] >> (2 * (g % 4))) & 3;
            let idx = usize::from(b[2 + g]) | (usize::from(hi) << 8);
            let grid = grids::IQ2S_GRID[idx].to_le_bytes();
            signed_grid(y, iq2_db(d, scales, g), &grid, b[34 + g]);
        }
    });
}

/// IQ3_XXS: fp16 d, 64 grid indices (4 values each), then per 32 values a u32 of four 7-bit sign
/// indices plus a 4-bit scale in the top bits.
pub(super) fn iq3_xxs(src: &[u8], out: &mut [f32]) {
    each_block::<98, 256>(src, out, |b, y| {
        let d = fp16(b[0], b[1]);
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let aux = u32_at(b, 66 + 4 * ib);
            let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let k = 2 + 8 * ib + 2 * l;
                let g0 = grids::IQ3XXS_GRID[usize::from(b[k])].to_le_bytes();
                let g1 = grids::IQ3XXS_GRID[usize::from(b[k + 1])].to_le_bytes();
                let grid = [g0[0], g0[1], g0[2], g0[3], g1[0], g1[1], g1[2], g1[3]];
                let signs = grids::KSIGNS[((aux >> (7 * l)) & 0x7F) as usize];
                signed_grid(y, db, &grid, signs);
            }
        }
    });
}

/// IQ3_S: fp16 d, 64 low bytes of the 9-bit grid indices (4 values each), 8 bytes of their top
/// bits, 32 sign bytes, 4 bytes of 4-bit scales (one per 32 values, odd multiples of d).
pub(super) fn iq3_s(src: &[u8], out: &mut [f32]) {
    each_block::<110, 256>(src, out, |b, y| {
        let d = fp16(b[0], b[1]);
        let index =
            |k: usize| usize::from(b[2 + k]) | (usize::from((b[66 + k / 8] >> (k % 8)) & 1) << 8);
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let s = (b[106 + ib / 2] >> (4 * (ib % 2))) & 0x0F;
            let db = d * f32::from(1 + 2 * s);
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let k = 8 * ib + 2 * l;
                let g0 = grids::IQ3S_GRID[index(k)].to_le_bytes();
                let g1 = grids::IQ3S_GRID[index(k + 1)].to_le_bytes();
                let grid = [g0[0], g0[1], g0[2], g0[3], g1[0], g1[1], g1[2], g1[3]];
                signed_grid(y, db, &grid, b[74 + 4 * ib + l]);
            }
        }
    });
}

/// IQ4_NL: fp16 d, then nibbles as in Q4_0 that index the non-linear value table.
pub(super) fn iq4_nl(src: &[u8], out: &mut [f32]) {
    each_block::<18, 32>(src, out, |b, y| {
        let d = fp16(b[0], b[1]);
        let kv = &grids::KVALUES_IQ4NL;
        let (lo, hi) = y.split_at_mut(16);
        for ((&q, l), h) in b[2..].iter().zip(lo).zip(hi) {
            *l = d * f32::from(kv[usize::from(q & 0x0F)]);
            *h = d * f32::from(kv[usize::from(q >> 4)]);
        }
    });
}

/// The signed 6-bit scale of IQ4_XS sub-block `ib` (0..8): a nibble of bytes 4..8 plus 2 bits
/// of the u16 at bytes 2..4.
#[inline(always)]
fn iq4xs_scale(b: &[u8], ib: usize) -> i8 {
    let lo = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F;
    let hi = ((u16::from_le_bytes([b[2], b[3]]) >> (2 * ib)) & 3) as u8;
    (lo | (hi << 4)) as i8 - 32
}

/// IQ4_XS: fp16 d, 6-bit scales (one per 32 values), then per 32 values 16 bytes of nibbles as
/// in IQ4_NL.
pub(super) fn iq4_xs(src: &[u8], out: &mut [f32]) {
    each_block::<136, 256>(src, out, |b, y| {
        let d = fp16(b[0], b[1]);
        let kv = &grids::KVALUES_IQ4NL;
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let dl = d * f32::from(iq4xs_scale(b, ib));
            let (lo, hi) = y.split_at_mut(16);
            for ((&q, l), h) in b[8 + 16 * ib..24 + 16 * ib].iter().zip(lo).zip(hi) {
                *l = dl * f32::from(kv[usize::from(q & 0x0F)]);
                *h = dl * f32::from(kv[usize::from(q >> 4)]);
            }
        }
    });
}
