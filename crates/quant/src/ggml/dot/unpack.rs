//! Unpacking shared by the AVX2 and AVX-512 kernels, for the 256-value formats whose quants are
//! not plain nibbles: each format yields its per-sub-block scales and, 32 values at a time, its
//! bits (or grid rows and signs) as signed bytes in value order. Kernels either unpack a whole
//! block into `Unpacked` first or convert each 32 values as they go (AVX-512, for the formats
//! where that measured faster). Written with AVX2 intrinsics (both levels have them); every
//! function is `inline(always)`, so it compiles inside the level's `#[target_feature]` tile.
//!
//! Exactness: each weight is `s * q` or `fma(q, s, m)` with `s * q` exact, so it rounds as the
//! reference does (see `blocks`).

use core::arch::x86_64::*;

use crate::ggml::grids::{IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};

/// A block's sub-block scales: weight `v` is `s[v / SUB] * q[v]`, plus `m[v / SUB]` for formats
/// with an offset (already negated).
#[derive(Clone, Copy)]
pub(super) struct Scales {
    pub s: [f32; 16],
    pub m: [f32; 16],
}

impl Scales {
    #[inline(always)]
    fn new() -> Self {
        Scales {
            s: [0.0; 16],
            m: [0.0; 16],
        }
    }
}

/// A whole block unpacked: its 256 quants in value order and its scales.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct Unpacked {
    pub q: [i8; 256],
    pub sc: Scales,
}

/// One unpackable format.
pub(super) trait Unpack {
    const BB: usize;
    /// Values per scale (16 or 32).
    const SUB: usize;
    /// Whether weights have the offset `m`.
    const MIN: bool;
    /// # Safety (all three)
    /// AVX2 is available; `b` points at a whole block.
    unsafe fn scales(b: *const u8) -> Scales;
    /// The signed quants of values `32 t .. 32 t + 32`.
    unsafe fn quants(b: *const u8, t: usize) -> __m256i;
    #[inline(always)]
    unsafe fn unpack(b: *const u8) -> Unpacked {
        let mut u = Unpacked {
            q: [0; 256],
            sc: Self::scales(b),
        };
        for t in 0..8 {
            _mm256_store_si256(u.q.as_mut_ptr().add(32 * t).cast(), Self::quants(b, t));
        }
        u
    }
}

#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    let h = p.cast::<u16>().read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))))
}

/// The 16 bytes at `p` as f32 times `d`, into `out[..16]`.
#[inline(always)]
unsafe fn scale16(bytes: __m128i, signed: bool, d: f32, out: *mut f32) {
    let d = _mm256_set1_ps(d);
    let (a, b) = if signed {
        (
            _mm256_cvtepi8_epi32(bytes),
            _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(bytes)),
        )
    } else {
        (
            _mm256_cvtepu8_epi32(bytes),
            _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(bytes)),
        )
    };
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(a), d));
    _mm256_storeu_ps(out.add(8), _mm256_mul_ps(_mm256_cvtepi32_ps(b), d));
}

/// Bits `shift..shift + width` of every byte of `v` (shift ≤ 6).
#[inline(always)]
unsafe fn bits(v: __m256i, shift: i32, mask: i8) -> __m256i {
    _mm256_and_si256(
        _mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)),
        _mm256_set1_epi8(mask),
    )
}

/// 0xFF in every byte of `v` that has bit `k` set, else 0.
#[inline(always)]
unsafe fn bit_set(v: __m256i, k: usize) -> __m256i {
    let m = _mm256_set1_epi8((1u8 << k) as i8);
    _mm256_cmpeq_epi8(_mm256_and_si256(v, m), m)
}

pub(super) struct Q2k;
impl Unpack for Q2k {
    const BB: usize = 84;
    const SUB: usize = 16;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn scales(b: *const u8) -> Scales {
        let mut u = Scales::new();
        let sc = _mm_loadu_si128(b.cast());
        let m4 = _mm_set1_epi8(0x0F);
        let d = f16_at(b.add(80));
        scale16(_mm_and_si128(sc, m4), false, d, u.s.as_mut_ptr());
        let mins = _mm_and_si128(_mm_srli_epi16::<4>(sc), m4);
        scale16(mins, false, -f16_at(b.add(82)), u.m.as_mut_ptr());
        u
    }
    #[inline(always)]
    unsafe fn quants(b: *const u8, t: usize) -> __m256i {
        // Half h, quarter j: bits 2j..2j+2 of the half's 32 bytes are values 128h + 32j + l.
        let (h, j) = (t / 4, t % 4);
        bits(
            _mm256_loadu_si256(b.add(16 + 32 * h).cast()),
            2 * j as i32,
            3,
        )
    }
}

/// The 16 signed 6-bit Q3_K scales (bytes 96..108 of the block), as bytes.
#[inline(always)]
unsafe fn k3_scales(b: *const u8) -> __m128i {
    let lo8 = b.add(96).cast::<u64>().read_unaligned();
    let hs = u64::from(b.add(104).cast::<u32>().read_unaligned());
    const M4: u64 = 0x0F0F_0F0F_0F0F_0F0F;
    const M2: u64 = 0x0303_0303;
    // Scale k: its low nibble is nibble k / 8 of byte k % 8; its top 2 bits are bits
    // 2 (k / 4).. of byte 8 + k % 4.
    let hi_a = (hs & M2) | (((hs >> 2) & M2) << 32);
    let hi_b = ((hs >> 4) & M2) | (((hs >> 6) & M2) << 32);
    let a = (lo8 & M4) | (hi_a << 4);
    let c = ((lo8 >> 4) & M4) | (hi_b << 4);
    _mm_sub_epi8(_mm_set_epi64x(c as i64, a as i64), _mm_set1_epi8(32))
}

pub(super) struct Q3k;
impl Unpack for Q3k {
    const BB: usize = 110;
    const SUB: usize = 16;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn scales(b: *const u8) -> Scales {
        let mut u = Scales::new();
        scale16(k3_scales(b), true, f16_at(b.add(108)), u.s.as_mut_ptr());
        u
    }
    #[inline(always)]
    unsafe fn quants(b: *const u8, t: usize) -> __m256i {
        // Value 32 t + l: 2 low bits as in Q2_K, minus 4 where bit t of hmask[l] is clear.
        let (h, j) = (t / 4, t % 4);
        let q = _mm256_loadu_si256(b.add(32 + 32 * h).cast());
        let hm = _mm256_loadu_si256(b.cast());
        let clear = _mm256_andnot_si256(bit_set(hm, t), _mm256_set1_epi8(4));
        _mm256_sub_epi8(bits(q, 2 * j as i32, 3), clear)
    }
}

pub(super) struct Q5k;
impl Unpack for Q5k {
    const BB: usize = 176;
    const SUB: usize = 32;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn scales(b: *const u8) -> Scales {
        let mut u = Scales::new();
        let (sc, mn) = super::k4_scales_mins(b);
        let d = _mm256_set1_ps(f16_at(b));
        let ndmin = _mm256_set1_ps(-f16_at(b.add(2)));
        let f = |v: u64| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)));
        _mm256_storeu_ps(u.s.as_mut_ptr(), _mm256_mul_ps(f(sc), d));
        _mm256_storeu_ps(u.m.as_mut_ptr(), _mm256_mul_ps(f(mn), ndmin));
        u
    }
    #[inline(always)]
    unsafe fn quants(b: *const u8, t: usize) -> __m256i {
        // Sub-block t: nibble t % 2 of the run t / 2, fifth bits from bit t of qh.
        let ql = _mm256_loadu_si256(b.add(48 + 32 * (t / 2)).cast());
        let qh = _mm256_loadu_si256(b.add(16).cast());
        let lo = bits(ql, 4 * (t % 2) as i32, 0x0F);
        _mm256_or_si256(lo, _mm256_and_si256(bit_set(qh, t), _mm256_set1_epi8(0x10)))
    }
}

/// Negates byte j of the 32 in `v` where bit j % 8 of byte j / 8 of `signs` is set.
#[inline(always)]
unsafe fn apply_signs(v: __m256i, signs: u32) -> __m256i {
    // Both 128-bit lanes hold all four sign bytes, so the in-lane shuffle can spread each one
    // over its 8 values.
    let s = _mm256_set1_epi32(signs as i32);
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    let m = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(s, spread), bit), bit);
    // (v ^ m) - m: -v where m is all ones, v where it is zero.
    _mm256_sub_epi8(_mm256_xor_si256(v, m), m)
}

/// The 8-bit sign patterns of four groups from their 7-bit indices, one per byte of `v`: the
/// eighth bit makes each byte's parity even (what `KSIGNS` tabulates), computed four at a time.
#[inline(always)]
fn ksigns4(v: u32) -> u32 {
    // Fold each byte's bits onto its bit 0; bits shifted in from the next byte only reach bits
    // that later steps ignore.
    let mut p = v ^ (v >> 4);
    p ^= p >> 2;
    p ^= p >> 1;
    v | ((p & 0x0101_0101) << 7)
}

/// The four 7-bit fields at bits 0, 7, 14, 21 of `aux`, one per byte.
#[inline(always)]
fn fields7(aux: u32) -> u32 {
    (aux & 0x7F) | ((aux << 1) & 0x7F00) | ((aux << 2) & 0x7F_0000) | ((aux << 3) & 0x7F00_0000)
}

/// Four 8-value grid rows (32 bytes) by index.
#[inline(always)]
unsafe fn rows8(grid: &[u64], idx: __m128i) -> __m256i {
    _mm256_i32gather_epi64::<8>(grid.as_ptr().cast(), idx)
}

/// Eight 4-value grid rows (32 bytes) by index.
#[inline(always)]
unsafe fn rows4(grid: &[u32], idx: __m256i) -> __m256i {
    _mm256_i32gather_epi32::<4>(grid.as_ptr().cast(), idx)
}

#[inline(always)]
unsafe fn u32_at(b: *const u8, at: usize) -> u32 {
    b.add(at).cast::<u32>().read_unaligned()
}

pub(super) struct Iq2xxs;
impl Unpack for Iq2xxs {
    const BB: usize = 66;
    const SUB: usize = 32;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn scales(b: *const u8) -> Scales {
        let mut u = Scales::new();
        let d = f16_at(b);
        for (ib, s) in u.s[..8].iter_mut().enumerate() {
            *s = d * (0.5 + (u32_at(b, 6 + 8 * ib) >> 28) as f32) * 0.25;
        }
        u
    }
    #[inline(always)]
    unsafe fn quants(b: *const u8, t: usize) -> __m256i {
        // Per 32 values: four grid-row bytes, then a u32 of sign indices (and the scale).
        let idx = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(u32_at(b, 2 + 8 * t) as i32));
        let aux = u32_at(b, 6 + 8 * t);
        apply_signs(rows8(&IQ2XXS_GRID, idx), ksigns4(fields7(aux)))
    }
}

/// The 16 IQ2_XS / IQ2_S scales (a nibble per 16 values) from the 8 bytes at `p`.
#[inline(always)]
unsafe fn iq2_scales(d: f32, p: *const u8, out: &mut [f32; 16]) {
    for (k, o) in out.iter_mut().enumerate() {
        let s = (*p.add(k / 2) >> (4 * (k % 2))) & 0x0F;
        *o = d * (0.5 + f32::from(s)) * 0.25;
    }
}

pub(super) struct Iq2xs;
impl Unpack for Iq2xs {
    const BB: usize = 74;
    const SUB: usize = 16;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn scales(b: *const u8) -> Scales {
        let mut u = Scales::new();
        iq2_scales(f16_at(b), b.add(66), &mut u.s);
        u
    }
    #[inline(always)]
    unsafe fn quants(b: *const u8, t: usize) -> __m256i {
        // Four groups' u16s: a 9-bit grid row and a 7-bit sign index each.
        let q = b.add(2 + 8 * t).cast::<u64>().read_unaligned();
        let idx = _mm_and_si128(
            _mm_cvtepu16_epi32(_mm_cvtsi64_si128(q as i64)),
            _mm_set1_epi32(511),
        );
        // The sign indices (bits 9.. of each u16) packed into one byte each.
        let v = (q >> 9) & 0x007F_007F_007F_007F;
        let v = v | (v >> 8);
        let signs = ksigns4(((v & 0xFFFF) | ((v >> 16) & 0xFFFF_0000)) as u32);
        apply_signs(rows8(&IQ2XS_GRID, idx), signs)
    }
}

pub(super) struct Iq2s;
impl Unpack for Iq2s {
    const BB: usize = 82;
    const SUB: usize = 16;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn scales(b: *const u8) -> Scales {
        let mut u = Scales::new();
        iq2_scales(f16_at(b), b.add(74), &mut u.s);
        u
    }
    #[inline(always)]
    unsafe fn quants(b: *const u8, t: usize) -> __m256i {
        // Four groups: low index bytes, 2 high bits each from one qh byte, raw sign bytes.
        let lo = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(u32_at(b, 2 + 4 * t) as i32));
        let qh = _mm_set1_epi32(i32::from(*b.add(66 + t)));
        let hi = _mm_and_si128(
            _mm_srlv_epi32(qh, _mm_setr_epi32(0, 2, 4, 6)),
            _mm_set1_epi32(3),
        );
        let idx = _mm_or_si128(lo, _mm_slli_epi32::<8>(hi));
        apply_signs(rows8(&IQ2S_GRID, idx), u32_at(b, 34 + 4 * t))
    }
}

pub(super) struct Iq3xxs;
impl Unpack for Iq3xxs {
    const BB: usize = 98;
    const SUB: usize = 32;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn scales(b: *const u8) -> Scales {
        let mut u = Scales::new();
        let d = f16_at(b);
        for (ib, s) in u.s[..8].iter_mut().enumerate() {
            *s = d * (0.5 + (u32_at(b, 66 + 4 * ib) >> 28) as f32) * 0.5;
        }
        u
    }
    #[inline(always)]
    unsafe fn quants(b: *const u8, t: usize) -> __m256i {
        let idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(b.add(2 + 8 * t).cast()));
        let aux = u32_at(b, 66 + 4 * t);
        apply_signs(rows4(&IQ3XXS_GRID, idx), ksigns4(fields7(aux)))
    }
}

pub(super) struct Iq3s;
impl Unpack for Iq3s {
    const BB: usize = 110;
    const SUB: usize = 32;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn scales(b: *const u8) -> Scales {
        let mut u = Scales::new();
        let d = f16_at(b);
        let sc = u32_at(b, 106);
        for (ib, s) in u.s[..8].iter_mut().enumerate() {
            *s = d * (1 + 2 * ((sc >> (4 * ib)) & 0x0F)) as f32;
        }
        u
    }
    #[inline(always)]
    unsafe fn quants(b: *const u8, t: usize) -> __m256i {
        // The 8 grid rows of 32 values: 8 index bytes, their ninth bits in one qh byte.
        let lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(b.add(2 + 8 * t).cast()));
        let qh = _mm256_set1_epi32(i32::from(*b.add(66 + t)));
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let hi = _mm256_and_si256(_mm256_srlv_epi32(qh, lanes), _mm256_set1_epi32(1));
        let idx = _mm256_or_si256(lo, _mm256_slli_epi32::<8>(hi));
        apply_signs(rows4(&IQ3S_GRID, idx), u32_at(b, 74 + 4 * t))
    }
}

#[cfg(test)]
mod tests {
    use super::{fields7, ksigns4};
    use crate::ggml::grids::KSIGNS;

    #[test]
    fn computed_signs_match_the_table() {
        for i in 0..128u32 {
            // Each byte position, with different neighbours on either side.
            let v = i | ((127 - i) << 8) | (((i * 37) % 128) << 16) | (i << 24);
            let want: u32 = (0..4)
                .map(|l| u32::from(KSIGNS[((v >> (8 * l)) & 0x7F) as usize]) << (8 * l))
                .sum();
            assert_eq!(ksigns4(v), want, "{v:#010x}");
            let aux = (v & 0x7F)
                | (((v >> 8) & 0x7F) << 7)
                | (((v >> 16) & 0x7F) << 14)
                | (((v >> 24) & 0x7F) << 21)
                | (0xF << 28);
            assert_eq!(fields7(aux), v);
        }
    }
}
