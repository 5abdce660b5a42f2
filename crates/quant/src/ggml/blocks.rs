//! Per-type block decoders. Callers ([`super::dequantize`]) have already checked that `src` is a
//! whole number of blocks and that `out` holds exactly the decoded values.
//!
//! Why exactness is robust here: fp16 → f32 is exact, and in every supported format each product
//! (fp16 scale × 6-bit sub-scale × quant, at most 11 + 8 + 5 significant bits) fits f32's 24-bit
//! significand, so it is exact whatever the evaluation order. The only rounding step is the final
//! `+ m` (Q4_1) or `- dmin * m` (Q4_K), a single rounding with or without fused multiply-add. The
//! code still follows the reference's operation order.
//!
//! Blocks are read as little-endian byte arrays, so `src` needs no alignment.

use half::f16;
use half::slice::HalfFloatSliceExt;

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
