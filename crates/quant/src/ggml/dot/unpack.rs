//! Per-block unpacking shared by the AVX2 and AVX-512 kernels, for the 256-value formats whose
//! quants are not plain nibbles: their bits (or grid rows and signs) are gathered once per block
//! into 256 signed bytes in value order plus per-sub-block scales, from which each level's chunks
//! then convert and scale whole vectors. Written with AVX2 intrinsics (both levels have them); every
//! function is `inline(always)`, so it compiles inside the level's `#[target_feature]` tile.
//!
//! Exactness: each weight is `s * q` or `fma(q, s, m)` with `s * q` exact, so it rounds as the
//! reference does (see `blocks`).

use core::arch::x86_64::*;

use crate::ggml::grids::{IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS};

/// A block's quants in value order and its sub-block scales: weight `v` is `s[v / SUB] * q[v]`,
/// plus `m[v / SUB]` for formats with an offset (already negated).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct Unpacked {
    pub q: [i8; 256],
    pub s: [f32; 16],
    pub m: [f32; 16],
}

impl Unpacked {
    #[inline(always)]
    fn new() -> Self {
        Unpacked {
            q: [0; 256],
            s: [0.0; 16],
            m: [0.0; 16],
        }
    }
}

/// One unpackable format.
pub(super) trait Unpack {
    const BB: usize;
    /// Values per scale (16 or 32).
    const SUB: usize;
    /// Whether weights have the offset `m`.
    const MIN: bool;
    /// # Safety
    /// AVX2 is available; `b` points at a whole block.
    unsafe fn unpack(b: *const u8) -> Unpacked;
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

#[inline(always)]
unsafe fn store(u: &mut Unpacked, at: usize, v: __m256i) {
    _mm256_store_si256(u.q.as_mut_ptr().add(at).cast(), v);
}

pub(super) struct Q2k;
impl Unpack for Q2k {
    const BB: usize = 84;
    const SUB: usize = 16;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn unpack(b: *const u8) -> Unpacked {
        let mut u = Unpacked::new();
        let sc = _mm_loadu_si128(b.cast());
        let m4 = _mm_set1_epi8(0x0F);
        scale16(
            _mm_and_si128(sc, m4),
            false,
            f16_at(b.add(80)),
            u.s.as_mut_ptr(),
        );
        let mins = _mm_and_si128(_mm_srli_epi16::<4>(sc), m4);
        scale16(mins, false, -f16_at(b.add(82)), u.m.as_mut_ptr());
        // Half h, quarter j: bits 2j..2j+2 of the half's 32 bytes are values 128h + 32j + l.
        for h in 0..2 {
            let q = _mm256_loadu_si256(b.add(16 + 32 * h).cast());
            for j in 0..4 {
                store(&mut u, 128 * h + 32 * j, bits(q, 2 * j as i32, 3));
            }
        }
        u
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
    unsafe fn unpack(b: *const u8) -> Unpacked {
        let mut u = Unpacked::new();
        scale16(k3_scales(b), true, f16_at(b.add(108)), u.s.as_mut_ptr());
        let hm = _mm256_loadu_si256(b.cast());
        let four = _mm256_set1_epi8(4);
        for h in 0..2 {
            let q = _mm256_loadu_si256(b.add(32 + 32 * h).cast());
            for j in 0..4 {
                // Value 32 i + l: 2 low bits as in Q2_K, minus 4 where bit i of hmask[l] is clear.
                let i = 4 * h + j;
                let clear = _mm256_andnot_si256(bit_set(hm, i), four);
                let v = _mm256_sub_epi8(bits(q, 2 * j as i32, 3), clear);
                store(&mut u, 32 * i, v);
            }
        }
        u
    }
}

pub(super) struct Q5k;
impl Unpack for Q5k {
    const BB: usize = 176;
    const SUB: usize = 32;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn unpack(b: *const u8) -> Unpacked {
        let mut u = Unpacked::new();
        let (sc, mn) = super::k4_scales_mins(b);
        let d = _mm256_set1_ps(f16_at(b));
        let ndmin = _mm256_set1_ps(-f16_at(b.add(2)));
        let f = |v: u64| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)));
        _mm256_storeu_ps(u.s.as_mut_ptr(), _mm256_mul_ps(f(sc), d));
        _mm256_storeu_ps(u.m.as_mut_ptr(), _mm256_mul_ps(f(mn), ndmin));
        let qh = _mm256_loadu_si256(b.add(16).cast());
        let b16 = _mm256_set1_epi8(0x10);
        for p in 0..4 {
            let ql = _mm256_loadu_si256(b.add(48 + 32 * p).cast());
            for h in 0..2 {
                let k = 2 * p + h;
                let lo = bits(ql, 4 * h as i32, 0x0F);
                let hi = _mm256_and_si256(bit_set(qh, k), b16);
                store(&mut u, 32 * k, _mm256_or_si256(lo, hi));
            }
        }
        u
    }
}

/// Byte masks of sign bits: 0xFF in byte j where bit j of the index is set.
const fn sign_masks<const N: usize>(signs: &[u8; N]) -> [u64; N] {
    let mut out = [0u64; N];
    let mut i = 0;
    while i < N {
        let mut j = 0;
        while j < 8 {
            if (signs[i] >> j) & 1 == 1 {
                out[i] |= 0xFF << (8 * j);
            }
            j += 1;
        }
        i += 1;
    }
    out
}

const fn identity() -> [u8; 256] {
    let mut out = [0u8; 256];
    let mut i = 0;
    while i < 256 {
        out[i] = i as u8;
        i += 1;
    }
    out
}

/// Masks for a group's 7 stored sign bits (through `KSIGNS`) and for a plain sign byte.
static KMASK7: [u64; 128] = sign_masks(&KSIGNS);
static KMASK8: [u64; 256] = sign_masks(&identity());

/// Eight grid bytes (each below 128) negated where `mask` has 0xFF: `!g + 1` per byte, which
/// never carries into the next byte.
#[inline(always)]
fn signed(g: u64, mask: u64) -> u64 {
    (g ^ mask) + (mask & 0x0101_0101_0101_0101)
}

#[inline(always)]
unsafe fn put8(u: &mut Unpacked, group: usize, v: u64) {
    u.q.as_mut_ptr().add(8 * group).cast::<u64>().write(v);
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
    unsafe fn unpack(b: *const u8) -> Unpacked {
        let mut u = Unpacked::new();
        let d = f16_at(b);
        for ib in 0..8 {
            let idx = u32_at(b, 2 + 8 * ib);
            let aux = u32_at(b, 6 + 8 * ib);
            u.s[ib] = d * (0.5 + (aux >> 28) as f32) * 0.25;
            for l in 0..4 {
                let g = IQ2XXS_GRID[((idx >> (8 * l)) & 0xFF) as usize];
                let m = KMASK7[((aux >> (7 * l)) & 0x7F) as usize];
                put8(&mut u, 4 * ib + l, signed(g, m));
            }
        }
        u
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
    unsafe fn unpack(b: *const u8) -> Unpacked {
        let mut u = Unpacked::new();
        iq2_scales(f16_at(b), b.add(66), &mut u.s);
        for g in 0..32 {
            let q = b.add(2 + 2 * g).cast::<u16>().read_unaligned();
            let v = signed(
                IQ2XS_GRID[usize::from(q & 511)],
                KMASK7[usize::from(q >> 9)],
            );
            put8(&mut u, g, v);
        }
        u
    }
}

pub(super) struct Iq2s;
impl Unpack for Iq2s {
    const BB: usize = 82;
    const SUB: usize = 16;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn unpack(b: *const u8) -> Unpacked {
        let mut u = Unpacked::new();
        iq2_scales(f16_at(b), b.add(74), &mut u.s);
        let qh = b.add(66).cast::<u64>().read_unaligned();
        for g in 0..32 {
            let idx = usize::from(*b.add(2 + g)) | ((((qh >> (2 * g)) & 3) as usize) << 8);
            let v = signed(IQ2S_GRID[idx], KMASK8[usize::from(*b.add(34 + g))]);
            put8(&mut u, g, v);
        }
        u
    }
}

pub(super) struct Iq3xxs;
impl Unpack for Iq3xxs {
    const BB: usize = 98;
    const SUB: usize = 32;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn unpack(b: *const u8) -> Unpacked {
        let mut u = Unpacked::new();
        let d = f16_at(b);
        for ib in 0..8 {
            let aux = u32_at(b, 66 + 4 * ib);
            u.s[ib] = d * (0.5 + (aux >> 28) as f32) * 0.5;
            for l in 0..4 {
                let k = 2 + 8 * ib + 2 * l;
                let g = u64::from(IQ3XXS_GRID[usize::from(*b.add(k))])
                    | (u64::from(IQ3XXS_GRID[usize::from(*b.add(k + 1))]) << 32);
                let m = KMASK7[((aux >> (7 * l)) & 0x7F) as usize];
                put8(&mut u, 4 * ib + l, signed(g, m));
            }
        }
        u
    }
}

pub(super) struct Iq3s;
impl Unpack for Iq3s {
    const BB: usize = 110;
    const SUB: usize = 32;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn unpack(b: *const u8) -> Unpacked {
        let mut u = Unpacked::new();
        let d = f16_at(b);
        let sc = u32_at(b, 106);
        for (ib, s) in u.s[..8].iter_mut().enumerate() {
            *s = d * (1 + 2 * ((sc >> (4 * ib)) & 0x0F)) as f32;
        }
        let qh = b.add(66).cast::<u64>().read_unaligned();
        let idx = |j: usize| usize::from(*b.add(2 + j)) | ((((qh >> j) & 1) as usize) << 8);
        for g in 0..32 {
            let grid =
                u64::from(IQ3S_GRID[idx(2 * g)]) | (u64::from(IQ3S_GRID[idx(2 * g + 1)]) << 32);
            put8(&mut u, g, signed(grid, KMASK8[usize::from(*b.add(74 + g))]));
        }
        u
    }
}
