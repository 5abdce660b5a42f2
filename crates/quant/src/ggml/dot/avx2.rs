//! AVX2 + FMA + F16C kernels. Same structure as the AVX-512 ones, in 16-column chunks (two
//! 8-lane vectors). With only 8-entry permutes, 4-bit quants are converted to f32 and scaled by
//! one fused multiply-add, which yields exactly the reference value.
// Index loops over the small register-tile arrays read more clearly than iterator chains here,
// and they fully unroll either way.
#![allow(clippy::needless_range_loop)]

use core::arch::x86_64::*;

use super::unpack::{self, Unpack, Unpacked};
use super::{f16_fields, k4_scales_mins, Shape};
use crate::ggml::grids::KVALUES_IQ4NL;
use crate::ggml::GgmlType;

/// One block format, decoded 16 columns (two vectors) at a time; see the AVX-512 `Fmt`.
trait Fmt {
    const BL: usize;
    const BB: usize;
    const CH: usize;
    const H: usize = 0;
    type Prep: Copy;
    unsafe fn prep(b: *const u8, s: *const f32) -> Self::Prep;
    unsafe fn chunk(b: *const u8, p: &Self::Prep, c: usize) -> [__m256; 2];
    #[inline(always)]
    fn off(c: usize, k: usize) -> usize {
        16 * c + 8 * k
    }
}

#[inline(always)]
unsafe fn f16_scalar(p: *const u8) -> f32 {
    let h = p.cast::<u16>().read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))))
}

/// 8 bytes zero-extended to 8 dword lanes.
#[inline(always)]
unsafe fn u8x8(p: *const u8) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()))
}

/// 8 signed bytes as exact f32.
#[inline(always)]
unsafe fn i8x8_f32(p: *const u8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())))
}

/// Low and high nibbles of 8 bytes as f32 (the values of columns j and j + 16 of a Q4 block).
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> [__m256; 2] {
    let q = u8x8(p);
    [
        _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(0x0F))),
        _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(q)),
    ]
}

/// Chunk c of a 32-value block holds columns 8c.. (low nibbles) and 16 + 8c.. (high nibbles).
#[inline(always)]
fn q4_off(c: usize, k: usize) -> usize {
    8 * c + 16 * k
}

struct Q40;
impl Fmt for Q40 {
    const BL: usize = 32;
    const BB: usize = 18;
    const CH: usize = 2;
    const H: usize = 1;
    type Prep = (__m256, __m256);
    #[inline(always)]
    unsafe fn prep(_b: *const u8, s: *const f32) -> Self::Prep {
        let d = _mm256_set1_ps(*s);
        (d, _mm256_mul_ps(d, _mm256_set1_ps(-8.0)))
    }
    #[inline(always)]
    unsafe fn chunk(b: *const u8, p: &Self::Prep, c: usize) -> [__m256; 2] {
        // fma(q, d, -8d) is exact: (q - 8) * d is representable, as in the reference.
        let [lo, hi] = nibbles(b.add(2 + 8 * c));
        [_mm256_fmadd_ps(lo, p.0, p.1), _mm256_fmadd_ps(hi, p.0, p.1)]
    }
    #[inline(always)]
    fn off(c: usize, k: usize) -> usize {
        q4_off(c, k)
    }
}

struct Q41;
impl Fmt for Q41 {
    const BL: usize = 32;
    const BB: usize = 20;
    const CH: usize = 2;
    const H: usize = 2;
    type Prep = (__m256, __m256);
    #[inline(always)]
    unsafe fn prep(_b: *const u8, s: *const f32) -> Self::Prep {
        (_mm256_set1_ps(*s), _mm256_set1_ps(*s.add(1)))
    }
    #[inline(always)]
    unsafe fn chunk(b: *const u8, p: &Self::Prep, c: usize) -> [__m256; 2] {
        // q * d is exact, so the fma rounds once, like the reference's q * d + m.
        let [lo, hi] = nibbles(b.add(4 + 8 * c));
        [_mm256_fmadd_ps(lo, p.0, p.1), _mm256_fmadd_ps(hi, p.0, p.1)]
    }
    #[inline(always)]
    fn off(c: usize, k: usize) -> usize {
        q4_off(c, k)
    }
}

struct Q50;
impl Fmt for Q50 {
    const BL: usize = 32;
    const BB: usize = 22;
    const CH: usize = 2;
    /// d, -16 d, and the 32 fifth bits in every lane.
    const H: usize = 1;
    type Prep = (__m256, __m256, __m256i);
    #[inline(always)]
    unsafe fn prep(b: *const u8, s: *const f32) -> Self::Prep {
        let d = _mm256_set1_ps(*s);
        let qh = b.add(2).cast::<i32>().read_unaligned();
        (
            d,
            _mm256_mul_ps(d, _mm256_set1_ps(-16.0)),
            _mm256_set1_epi32(qh),
        )
    }
    #[inline(always)]
    unsafe fn chunk(b: *const u8, p: &Self::Prep, c: usize) -> [__m256; 2] {
        let (d, n16d, qh) = *p;
        let [lo, hi] = nibbles(b.add(6 + 8 * c));
        // Move fifth bit j (column j) into the sign bit of lane j; where it is set the value is
        // q * d, else (q - 16) * d: both exact as one fma.
        let j = _mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24);
        let j = _mm256_sub_epi32(j, _mm256_set1_epi32(8 * c as i32));
        let sel_lo = _mm256_castsi256_ps(_mm256_sllv_epi32(qh, j));
        let sel_hi = _mm256_castsi256_ps(_mm256_sllv_epi32(
            qh,
            _mm256_sub_epi32(j, _mm256_set1_epi32(16)),
        ));
        let zero = _mm256_setzero_ps();
        [
            _mm256_fmadd_ps(lo, d, _mm256_blendv_ps(n16d, zero, sel_lo)),
            _mm256_fmadd_ps(hi, d, _mm256_blendv_ps(n16d, zero, sel_hi)),
        ]
    }
    #[inline(always)]
    fn off(c: usize, k: usize) -> usize {
        q4_off(c, k)
    }
}

struct Q80;
impl Fmt for Q80 {
    const BL: usize = 32;
    const BB: usize = 34;
    const CH: usize = 2;
    const H: usize = 1;
    type Prep = __m256;
    #[inline(always)]
    unsafe fn prep(_b: *const u8, s: *const f32) -> __m256 {
        _mm256_set1_ps(*s)
    }
    #[inline(always)]
    unsafe fn chunk(b: *const u8, d: &__m256, c: usize) -> [__m256; 2] {
        let q = b.add(2 + 16 * c);
        [
            _mm256_mul_ps(i8x8_f32(q), *d),
            _mm256_mul_ps(i8x8_f32(q.add(8)), *d),
        ]
    }
}

/// Q4_K sub-block scales `d * sc` and negated offsets `-dmin * m`, both exact.
#[derive(Clone, Copy)]
struct K4Scales {
    dl: [f32; 8],
    nml: [f32; 8],
}

/// The 8 bytes of `v` as f32.
#[inline(always)]
unsafe fn u8x8_f32(v: u64) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)))
}

struct Q4k;
impl Fmt for Q4k {
    const BL: usize = 256;
    const BB: usize = 144;
    const CH: usize = 16;
    type Prep = K4Scales;
    #[inline(always)]
    unsafe fn prep(b: *const u8, _s: *const f32) -> K4Scales {
        let (sc, mn) = k4_scales_mins(b);
        let d = _mm256_set1_ps(f16_scalar(b));
        let ndmin = _mm256_set1_ps(-f16_scalar(b.add(2)));
        let mut s = K4Scales {
            dl: [0.0; 8],
            nml: [0.0; 8],
        };
        _mm256_storeu_ps(s.dl.as_mut_ptr(), _mm256_mul_ps(u8x8_f32(sc), d));
        _mm256_storeu_ps(s.nml.as_mut_ptr(), _mm256_mul_ps(u8x8_f32(mn), ndmin));
        s
    }
    #[inline(always)]
    unsafe fn chunk(b: *const u8, s: &K4Scales, c: usize) -> [__m256; 2] {
        // Chunk c: 8 bytes of the 32-byte run p, whose low nibbles are sub-block 2p and high
        // nibbles sub-block 2p + 1. fma(q, d*sc, -dmin*m) rounds once, like the reference.
        let (p, j) = (c / 4, c % 4);
        let [lo, hi] = nibbles(b.add(16 + 32 * p + 8 * j));
        let (k0, k1) = (2 * p, 2 * p + 1);
        [
            _mm256_fmadd_ps(lo, _mm256_set1_ps(s.dl[k0]), _mm256_set1_ps(s.nml[k0])),
            _mm256_fmadd_ps(hi, _mm256_set1_ps(s.dl[k1]), _mm256_set1_ps(s.nml[k1])),
        ]
    }
    #[inline(always)]
    fn off(c: usize, k: usize) -> usize {
        64 * (c / 4) + 32 * k + 8 * (c % 4)
    }
}

/// A Q6_K block's 256 signed 6-bit quants as bytes, in value order, and its 16 exact scales.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct K6 {
    q: [i8; 256],
    ds: [f32; 16],
}

/// Signed 6-bit quants from the low nibbles of `ql` and bits 4..6 of `hi`, minus 32.
#[inline(always)]
unsafe fn quarter(ql: __m256i, hi: __m256i) -> __m256i {
    let lo = _mm256_and_si256(ql, _mm256_set1_epi8(0x0F));
    let hi = _mm256_and_si256(hi, _mm256_set1_epi8(0x30));
    _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32))
}

struct Q6k;
impl Fmt for Q6k {
    const BL: usize = 256;
    const BB: usize = 210;
    const CH: usize = 16;
    type Prep = K6;
    #[inline(always)]
    unsafe fn prep(b: *const u8, _s: *const f32) -> K6 {
        let mut k = K6 {
            q: [0; 256],
            ds: [0.0; 16],
        };
        let d = _mm256_set1_ps(f16_scalar(b.add(208)));
        _mm256_storeu_ps(k.ds.as_mut_ptr(), _mm256_mul_ps(i8x8_f32(b.add(192)), d));
        _mm256_storeu_ps(
            k.ds.as_mut_ptr().add(8),
            _mm256_mul_ps(i8x8_f32(b.add(200)), d),
        );
        // Quarter k of a half block: a nibble of ql plus 2 bits of qh (bits 2k..2k+2) moved to
        // bits 4..6. Shifts work on 16-bit lanes; the masks in `quarter` drop bits crossing
        // between bytes.
        for h in 0..2 {
            let a = _mm256_loadu_si256(b.add(64 * h).cast());
            let c = _mm256_loadu_si256(b.add(64 * h + 32).cast());
            let qh = _mm256_loadu_si256(b.add(128 + 32 * h).cast());
            let dst = k.q.as_mut_ptr().add(128 * h).cast::<__m256i>();
            _mm256_store_si256(dst, quarter(a, _mm256_slli_epi16::<4>(qh)));
            _mm256_store_si256(dst.add(1), quarter(c, _mm256_slli_epi16::<2>(qh)));
            _mm256_store_si256(dst.add(2), quarter(_mm256_srli_epi16::<4>(a), qh));
            _mm256_store_si256(
                dst.add(3),
                quarter(_mm256_srli_epi16::<4>(c), _mm256_srli_epi16::<2>(qh)),
            );
        }
        k
    }
    #[inline(always)]
    unsafe fn chunk(_b: *const u8, k: &K6, c: usize) -> [__m256; 2] {
        let q = k.q.as_ptr().cast::<u8>().add(16 * c);
        let s = _mm256_set1_ps(k.ds[c]);
        [
            _mm256_mul_ps(i8x8_f32(q), s),
            _mm256_mul_ps(i8x8_f32(q.add(8)), s),
        ]
    }
}

struct Q51;
impl Fmt for Q51 {
    const BL: usize = 32;
    const BB: usize = 24;
    const CH: usize = 2;
    const H: usize = 2;
    /// d, m, and the 32 fifth bits in every lane.
    type Prep = (__m256, __m256, __m256i);
    #[inline(always)]
    unsafe fn prep(b: *const u8, s: *const f32) -> Self::Prep {
        let qh = b.add(4).cast::<i32>().read_unaligned();
        (
            _mm256_set1_ps(*s),
            _mm256_set1_ps(*s.add(1)),
            _mm256_set1_epi32(qh),
        )
    }
    #[inline(always)]
    unsafe fn chunk(b: *const u8, p: &Self::Prep, c: usize) -> [__m256; 2] {
        let (d, m, qh) = *p;
        let q = u8x8(b.add(8 + 8 * c));
        // Fifth bit of column j moved to bit 4 of lane j; q * d is exact, so the fma rounds once
        // like the reference's q * d + m.
        let j = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let j = _mm256_add_epi32(j, _mm256_set1_epi32(8 * c as i32));
        let b16 = _mm256_set1_epi32(0x10);
        let h_lo = _mm256_and_si256(_mm256_slli_epi32::<4>(_mm256_srlv_epi32(qh, j)), b16);
        let j = _mm256_add_epi32(j, _mm256_set1_epi32(16));
        let h_hi = _mm256_and_si256(_mm256_slli_epi32::<4>(_mm256_srlv_epi32(qh, j)), b16);
        let lo = _mm256_or_si256(_mm256_and_si256(q, _mm256_set1_epi32(0x0F)), h_lo);
        let hi = _mm256_or_si256(_mm256_srli_epi32::<4>(q), h_hi);
        [
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), d, m),
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), d, m),
        ]
    }
    #[inline(always)]
    fn off(c: usize, k: usize) -> usize {
        q4_off(c, k)
    }
}

/// The IQ4 values of the nibbles in the low 8 bytes of `n` (each below 16), as f32.
#[inline(always)]
unsafe fn iq4x8(n: __m128i) -> __m256 {
    let kv = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast());
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_shuffle_epi8(kv, n)))
}

struct Iq4nl;
impl Fmt for Iq4nl {
    const BL: usize = 32;
    const BB: usize = 18;
    const CH: usize = 2;
    const H: usize = 1;
    type Prep = __m256;
    #[inline(always)]
    unsafe fn prep(_b: *const u8, s: *const f32) -> __m256 {
        _mm256_set1_ps(*s)
    }
    #[inline(always)]
    unsafe fn chunk(b: *const u8, d: &__m256, c: usize) -> [__m256; 2] {
        // d * value is exact (11 + 7 significant bits), as in the reference.
        let q = _mm_loadl_epi64(b.add(2 + 8 * c).cast());
        let m4 = _mm_set1_epi8(0x0F);
        let lo = iq4x8(_mm_and_si128(q, m4));
        let hi = iq4x8(_mm_and_si128(_mm_srli_epi16::<4>(q), m4));
        [_mm256_mul_ps(lo, *d), _mm256_mul_ps(hi, *d)]
    }
    #[inline(always)]
    fn off(c: usize, k: usize) -> usize {
        q4_off(c, k)
    }
}

struct Iq4xs;
impl Fmt for Iq4xs {
    const BL: usize = 256;
    const BB: usize = 136;
    const CH: usize = 16;
    /// The exact sub-block scales `d * (ls - 32)`.
    type Prep = [f32; 8];
    #[inline(always)]
    unsafe fn prep(b: *const u8, _s: *const f32) -> [f32; 8] {
        let d = f16_scalar(b);
        let sh = u32::from(b.add(2).cast::<u16>().read_unaligned());
        let sl = b.add(4).cast::<u32>().read_unaligned();
        let mut out = [0f32; 8];
        for (ib, o) in out.iter_mut().enumerate() {
            let ls = ((sl >> (4 * ib)) & 0x0F) | (((sh >> (2 * ib)) & 3) << 4);
            *o = d * (ls as i32 - 32) as f32;
        }
        out
    }
    #[inline(always)]
    unsafe fn chunk(b: *const u8, dl: &[f32; 8], c: usize) -> [__m256; 2] {
        // Chunk c: the low (c even) or high (c odd) nibbles of sub-block c / 2's 16 bytes.
        let q = _mm_loadu_si128(b.add(8 + 16 * (c / 2)).cast());
        let q = if c % 2 == 1 {
            _mm_srli_epi16::<4>(q)
        } else {
            q
        };
        let n = _mm_and_si128(q, _mm_set1_epi8(0x0F));
        let s = _mm256_set1_ps(dl[c / 2]);
        [
            _mm256_mul_ps(iq4x8(n), s),
            _mm256_mul_ps(iq4x8(_mm_srli_si128::<8>(n)), s),
        ]
    }
}

struct Q8k;
impl Fmt for Q8k {
    const BL: usize = 256;
    const BB: usize = 292;
    const CH: usize = 16;
    type Prep = __m256;
    #[inline(always)]
    unsafe fn prep(b: *const u8, _s: *const f32) -> __m256 {
        _mm256_set1_ps(b.cast::<f32>().read_unaligned())
    }
    #[inline(always)]
    unsafe fn chunk(b: *const u8, d: &__m256, c: usize) -> [__m256; 2] {
        let q = b.add(4 + 16 * c);
        [
            _mm256_mul_ps(i8x8_f32(q), *d),
            _mm256_mul_ps(i8x8_f32(q.add(8)), *d),
        ]
    }
}

/// A format unpacked per block by `unpack` (see there); chunk c is values 16c..16c + 16, under
/// one scale.
struct Unp<U>(core::marker::PhantomData<U>);
impl<U: Unpack> Fmt for Unp<U> {
    const BL: usize = 256;
    const BB: usize = U::BB;
    const CH: usize = 16;
    type Prep = Unpacked;
    #[inline(always)]
    unsafe fn prep(b: *const u8, _s: *const f32) -> Unpacked {
        U::unpack(b)
    }
    #[inline(always)]
    unsafe fn chunk(_b: *const u8, u: &Unpacked, c: usize) -> [__m256; 2] {
        let q = u.q.as_ptr().cast::<u8>().add(16 * c);
        let j = 16 * c / U::SUB;
        let s = _mm256_set1_ps(u.sc.s[j]);
        let w = [i8x8_f32(q), i8x8_f32(q.add(8))];
        if U::MIN {
            let m = _mm256_set1_ps(u.sc.m[j]);
            [_mm256_fmadd_ps(w[0], s, m), _mm256_fmadd_ps(w[1], s, m)]
        } else {
            [_mm256_mul_ps(w[0], s), _mm256_mul_ps(w[1], s)]
        }
    }
}

struct Flt32;
impl Fmt for Flt32 {
    const BL: usize = 16;
    const BB: usize = 64;
    const CH: usize = 1;
    type Prep = ();
    #[inline(always)]
    unsafe fn prep(_b: *const u8, _s: *const f32) {}
    #[inline(always)]
    unsafe fn chunk(b: *const u8, _p: &(), _c: usize) -> [__m256; 2] {
        [_mm256_loadu_ps(b.cast()), _mm256_loadu_ps(b.add(32).cast())]
    }
}

struct Flt16;
impl Fmt for Flt16 {
    const BL: usize = 16;
    const BB: usize = 32;
    const CH: usize = 1;
    type Prep = ();
    #[inline(always)]
    unsafe fn prep(_b: *const u8, _s: *const f32) {}
    #[inline(always)]
    unsafe fn chunk(b: *const u8, _p: &(), _c: usize) -> [__m256; 2] {
        [
            _mm256_cvtph_ps(_mm_loadu_si128(b.cast())),
            _mm256_cvtph_ps(_mm_loadu_si128(b.add(16).cast())),
        ]
    }
}

/// 8 bf16 values: each is the top half of an f32.
#[inline(always)]
unsafe fn bf16x8(p: *const u8) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
        _mm_loadu_si128(p.cast()),
    )))
}

struct BFlt16;
impl Fmt for BFlt16 {
    const BL: usize = 16;
    const BB: usize = 32;
    const CH: usize = 1;
    type Prep = ();
    #[inline(always)]
    unsafe fn prep(_b: *const u8, _s: *const f32) {}
    #[inline(always)]
    unsafe fn chunk(b: *const u8, _p: &(), _c: usize) -> [__m256; 2] {
        [bf16x8(b), bf16x8(b.add(16))]
    }
}

/// Horizontal sum of 8 lanes.
#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// See the AVX-512 `GROUP`.
const GROUP: usize = 32;
const SC: usize = 2 * GROUP + 8;

/// `MR` weight rows against `NR` activation rows; see the AVX-512 `tile`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<F: Fmt, const MR: usize, const NR: usize>(
    w: *const u8,
    rb: usize,
    nb: usize,
    x: *const f32,
    cols: usize,
    out: *mut f32,
    oi: usize,
    ot: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); NR]; MR];
    let mut sc = core::mem::MaybeUninit::<[[f32; SC]; MR]>::uninit();
    let sc = sc.as_mut_ptr().cast::<f32>();
    let ahead = super::prefetch_rows_ahead(MR, rb);
    let mut g0 = 0;
    while g0 < nb {
        let count = (nb - g0).min(GROUP);
        if F::H > 0 {
            for i in 0..MR {
                let b = w.add(i * rb + g0 * F::BB);
                f16_fields(b, F::BB, F::H, count, sc.add(i * SC));
            }
        }
        for g in 0..count {
            let blk = g0 + g;
            let wb = w.add(blk * F::BB);
            let xb = x.add(blk * F::BL);
            super::prefetch_rows_on::<MR>(wb, rb, F::BB, ahead);
            let mut p = [F::prep(wb, sc.add(g * F::H)); MR];
            for i in 1..MR {
                p[i] = F::prep(wb.add(i * rb), sc.add(i * SC + g * F::H));
            }
            for c in 0..F::CH {
                let mut wv = [[_mm256_setzero_ps(); 2]; MR];
                for i in 0..MR {
                    wv[i] = F::chunk(wb.add(i * rb), &p[i], c);
                }
                for t in 0..NR {
                    let xt = xb.add(t * cols);
                    let x0 = _mm256_loadu_ps(xt.add(F::off(c, 0)));
                    let x1 = _mm256_loadu_ps(xt.add(F::off(c, 1)));
                    for i in 0..MR {
                        acc[i][t] = _mm256_fmadd_ps(wv[i][0], x0, acc[i][t]);
                        acc[i][t] = _mm256_fmadd_ps(wv[i][1], x1, acc[i][t]);
                    }
                }
            }
        }
        g0 += count;
    }
    for i in 0..MR {
        for t in 0..NR {
            *out.add(i * oi + t * ot) = hsum(acc[i][t]);
        }
    }
}

/// Runs the whole problem in register tiles; returns how many leading columns it covered.
///
/// With 16 registers: four weight rows for one activation row (four independent FMA chains, as
/// many as the 8 weight and 2 activation registers leave room for), two weight rows with up to
/// four activation rows (at most 8 accumulators).
unsafe fn run_fmt<F: Fmt>(s: &Shape, w: *const u8, x: *const f32, out: *mut f32) -> usize {
    let nb = s.cols / F::BL;
    super::schedule(
        s.m,
        s.n,
        4,
        |nr| if nr == 1 { 4 } else { 2 },
        |i0, mr, t0, nr| {
            let (wp, xp, op) = (
                w.add(i0 * s.row_bytes),
                x.add(t0 * s.cols),
                out.add(i0 * s.oi + t0 * s.ot),
            );
            macro_rules! go {
                ($mr:literal, $nr:literal) => {
                    tile::<F, $mr, $nr>(wp, s.row_bytes, nb, xp, s.cols, op, s.oi, s.ot)
                };
            }
            match (mr, nr) {
                (4, 1) => go!(4, 1),
                (2, 1) => go!(2, 1),
                (2, 2) => go!(2, 2),
                (2, 3) => go!(2, 3),
                (2, 4) => go!(2, 4),
                (1, 1) => go!(1, 1),
                (1, 2) => go!(1, 2),
                (1, 3) => go!(1, 3),
                (1, 4) => go!(1, 4),
                _ => unreachable!("schedule yields mr <= rows_for(nr), nr ∈ 1..=4"),
            }
        },
    );
    nb * F::BL
}

/// # Safety
/// The CPU has AVX2, FMA and F16C; `w`, `x` and `out` hold the buffers `s` describes.
pub(super) unsafe fn run(s: &Shape, w: *const u8, x: *const f32, out: *mut f32) -> usize {
    use GgmlType::*;
    match s.ty {
        F32 => run_fmt::<Flt32>(s, w, x, out),
        F16 => run_fmt::<Flt16>(s, w, x, out),
        BF16 => run_fmt::<BFlt16>(s, w, x, out),
        Q4_0 => run_fmt::<Q40>(s, w, x, out),
        Q4_1 => run_fmt::<Q41>(s, w, x, out),
        Q5_0 => run_fmt::<Q50>(s, w, x, out),
        Q8_0 => run_fmt::<Q80>(s, w, x, out),
        Q4K => run_fmt::<Q4k>(s, w, x, out),
        Q6K => run_fmt::<Q6k>(s, w, x, out),
        Q5_1 => run_fmt::<Q51>(s, w, x, out),
        Q2K => run_fmt::<Unp<unpack::Q2k>>(s, w, x, out),
        Q3K => run_fmt::<Unp<unpack::Q3k>>(s, w, x, out),
        Q5K => run_fmt::<Unp<unpack::Q5k>>(s, w, x, out),
        Q8K => run_fmt::<Q8k>(s, w, x, out),
        IQ2XXS => run_fmt::<Unp<unpack::Iq2xxs>>(s, w, x, out),
        IQ2XS => run_fmt::<Unp<unpack::Iq2xs>>(s, w, x, out),
        IQ2S => run_fmt::<Unp<unpack::Iq2s>>(s, w, x, out),
        IQ3XXS => run_fmt::<Unp<unpack::Iq3xxs>>(s, w, x, out),
        IQ3S => run_fmt::<Unp<unpack::Iq3s>>(s, w, x, out),
        IQ4NL => run_fmt::<Iq4nl>(s, w, x, out),
        IQ4XS => run_fmt::<Iq4xs>(s, w, x, out),
        _ => unreachable!("checked by is_supported"),
    }
}
