//! AVX-512 (F/BW/VL) kernels. The AVX-512 intrinsics and target features are stable since Rust
//! 1.89, the workspace's minimum.
// Index loops over the small register-tile arrays read more clearly than iterator chains here,
// and they fully unroll either way.
#![allow(clippy::needless_range_loop)]

use core::arch::x86_64::*;

use super::unpack::{self, Scales, Unpack, Unpacked};
use super::{f16_fields, k4_scales_mins, Shape};
use crate::ggml::grids::KVALUES_IQ4NL;
use crate::ggml::GgmlType;

/// One block format, decoded 32 columns (two vectors) at a time.
///
/// `prep` does the per-block work (scales, lookup tables); `chunk(c)` then yields the exact
/// weights of chunk `c`, whose vector `k` covers block columns `off(c, k) .. off(c, k) + 16`.
/// All are `inline(always)` so they compile inside the `#[target_feature]` tile kernel.
trait Fmt {
    /// Columns per block (for float rows: per step; the caller handles the remainder).
    const BL: usize;
    /// Bytes per block.
    const BB: usize;
    /// Chunks per block.
    const CH: usize;
    /// How many leading fp16 fields (scale, offset) the tile converts ahead for `prep`.
    const H: usize = 0;
    type Prep: Copy;
    /// `s` holds the block's `H` leading fp16 fields as f32.
    unsafe fn prep(b: *const u8, s: *const f32) -> Self::Prep;
    unsafe fn chunk(b: *const u8, p: &Self::Prep, c: usize) -> [__m512; 2];
    #[inline(always)]
    fn off(c: usize, k: usize) -> usize {
        32 * c + 16 * k
    }
}

#[inline(always)]
unsafe fn f16_scalar(p: *const u8) -> f32 {
    let h = p.cast::<u16>().read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))))
}

/// 16 bytes zero-extended to 16 dword lanes.
#[inline(always)]
unsafe fn u8x16(p: *const u8) -> __m512i {
    _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()))
}

/// 16 signed bytes as exact f32.
#[inline(always)]
unsafe fn i8x16_f32(p: *const u8) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())))
}

/// The 8 bytes of `v` as f32.
#[inline(always)]
unsafe fn u8x8_f32(v: u64) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)))
}

/// 0.0, 1.0, ..., 15.0: lookup-table index values.
#[inline(always)]
unsafe fn iota() -> __m512 {
    _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    )
}

/// 4-bit formats use a 16-entry table of exact weights, indexed by the nibble: `vpermps` reads
/// only the low 4 bits of each index lane, so neither nibble needs masking.
#[inline(always)]
unsafe fn lut(idx: __m512i, t: __m512) -> __m512 {
    _mm512_permutexvar_ps(idx, t)
}

struct Q40;
impl Fmt for Q40 {
    const BL: usize = 32;
    const BB: usize = 18;
    const CH: usize = 1;
    const H: usize = 1;
    type Prep = __m512;
    #[inline(always)]
    unsafe fn prep(_b: *const u8, s: *const f32) -> __m512 {
        // (q - 8) * d, exactly as the reference computes each value.
        _mm512_mul_ps(
            _mm512_sub_ps(iota(), _mm512_set1_ps(8.0)),
            _mm512_set1_ps(*s),
        )
    }
    #[inline(always)]
    unsafe fn chunk(b: *const u8, t: &__m512, _c: usize) -> [__m512; 2] {
        let q = u8x16(b.add(2));
        [lut(q, *t), lut(_mm512_srli_epi32::<4>(q), *t)]
    }
}

struct Q41;
impl Fmt for Q41 {
    const BL: usize = 32;
    const BB: usize = 20;
    const CH: usize = 1;
    const H: usize = 2;
    type Prep = __m512;
    #[inline(always)]
    unsafe fn prep(_b: *const u8, s: *const f32) -> __m512 {
        // q * d is exact, so fma(q, d, m) rounds once, like the reference's q * d + m.
        _mm512_fmadd_ps(iota(), _mm512_set1_ps(*s), _mm512_set1_ps(*s.add(1)))
    }
    #[inline(always)]
    unsafe fn chunk(b: *const u8, t: &__m512, _c: usize) -> [__m512; 2] {
        let q = u8x16(b.add(4));
        [lut(q, *t), lut(_mm512_srli_epi32::<4>(q), *t)]
    }
}

struct Q50;
impl Fmt for Q50 {
    const BL: usize = 32;
    const BB: usize = 22;
    const CH: usize = 1;
    const H: usize = 1;
    /// The table for a clear fifth bit, 16 d, and the 32 fifth bits.
    type Prep = (__m512, __m512, u32);
    #[inline(always)]
    unsafe fn prep(b: *const u8, s: *const f32) -> Self::Prep {
        let d = _mm512_set1_ps(*s);
        let lo = _mm512_mul_ps(_mm512_sub_ps(iota(), _mm512_set1_ps(16.0)), d);
        let d16 = _mm512_mul_ps(_mm512_set1_ps(16.0), d);
        (lo, d16, b.add(2).cast::<u32>().read_unaligned())
    }
    #[inline(always)]
    unsafe fn chunk(b: *const u8, p: &Self::Prep, _c: usize) -> [__m512; 2] {
        let (lo, d16, qh) = *p;
        let q = u8x16(b.add(6));
        let (w0, w1) = (lut(q, lo), lut(_mm512_srli_epi32::<4>(q), lo));
        // A set fifth bit adds 16 d: (q - 16) d + 16 d = q d exactly (all small multiples of d).
        [
            _mm512_mask_add_ps(w0, qh as u16, w0, d16),
            _mm512_mask_add_ps(w1, (qh >> 16) as u16, w1, d16),
        ]
    }
}

struct Q80;
impl Fmt for Q80 {
    const BL: usize = 32;
    const BB: usize = 34;
    const CH: usize = 1;
    type Prep = __m512;
    const H: usize = 1;
    #[inline(always)]
    unsafe fn prep(_b: *const u8, s: *const f32) -> __m512 {
        _mm512_set1_ps(*s)
    }
    #[inline(always)]
    unsafe fn chunk(b: *const u8, d: &__m512, _c: usize) -> [__m512; 2] {
        [
            _mm512_mul_ps(i8x16_f32(b.add(2)), *d),
            _mm512_mul_ps(i8x16_f32(b.add(18)), *d),
        ]
    }
}

/// Q4_K sub-block scales `d * sc` and negated offsets `-dmin * m`, both exact.
#[derive(Clone, Copy)]
struct K4Scales {
    dl: [f32; 8],
    nml: [f32; 8],
}

struct Q4k;
impl Fmt for Q4k {
    const BL: usize = 256;
    const BB: usize = 144;
    const CH: usize = 8;
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
    unsafe fn chunk(b: *const u8, s: &K4Scales, c: usize) -> [__m512; 2] {
        // Chunk c is sub-block c: the low nibbles (c even) or high nibbles (c odd) of 32 bytes.
        // fma(q, d*sc, -dmin*m) rounds once, like the reference's d*sc*q - dmin*m.
        let t = _mm512_fmadd_ps(iota(), _mm512_set1_ps(s.dl[c]), _mm512_set1_ps(s.nml[c]));
        let q = b.add(16 + 32 * (c / 2));
        let (mut qa, mut qb) = (u8x16(q), u8x16(q.add(16)));
        if c % 2 == 1 {
            qa = _mm512_srli_epi32::<4>(qa);
            qb = _mm512_srli_epi32::<4>(qb);
        }
        [lut(qa, t), lut(qb, t)]
    }
}

/// A Q6_K block's 256 signed 6-bit quants as bytes, in value order, and its 16 exact scales.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct K6 {
    q: [i8; 256],
    ds: [f32; 16],
}

struct Q6k;
impl Fmt for Q6k {
    const BL: usize = 256;
    const BB: usize = 210;
    const CH: usize = 8;
    type Prep = K6;
    #[inline(always)]
    unsafe fn prep(b: *const u8, _s: *const f32) -> K6 {
        let mut k = K6 {
            q: [0; 256],
            ds: [0.0; 16],
        };
        let d = _mm512_set1_ps(f16_scalar(b.add(208)));
        _mm512_storeu_ps(k.ds.as_mut_ptr(), _mm512_mul_ps(i8x16_f32(b.add(192)), d));
        let m4 = _mm512_set1_epi8(0x0F);
        let m2 = _mm512_set1_epi8(0x30);
        // The low 256 bits build quarters 0 and 2 of a half block, the high 256 bits quarters 1
        // and 3: the 2-bit high parts sit at qh bits 0/4 and 2/6, so they need different shifts
        // to land at bits 4..6. Shifts work on 16-bit lanes; the masks drop the bits that cross
        // from one byte into the other.
        let up = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_set1_epi16(4)),
            _mm256_set1_epi16(2),
        );
        let dn = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_set1_epi16(0)),
            _mm256_set1_epi16(2),
        );
        let off = _mm512_set1_epi8(32);
        for h in 0..2 {
            let ql = _mm512_loadu_si512(b.add(64 * h).cast());
            let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(b.add(128 + 32 * h).cast()));
            let q01 = _mm512_or_si512(
                _mm512_and_si512(ql, m4),
                _mm512_and_si512(_mm512_sllv_epi16(qh, up), m2),
            );
            let q23 = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4),
                _mm512_and_si512(_mm512_srlv_epi16(qh, dn), m2),
            );
            let dst = k.q.as_mut_ptr().add(128 * h).cast::<__m512i>();
            _mm512_store_si512(dst, _mm512_sub_epi8(q01, off));
            _mm512_store_si512(dst.add(1), _mm512_sub_epi8(q23, off));
        }
        k
    }
    #[inline(always)]
    unsafe fn chunk(_b: *const u8, k: &K6, c: usize) -> [__m512; 2] {
        let q = k.q.as_ptr().cast::<u8>().add(32 * c);
        [
            _mm512_mul_ps(i8x16_f32(q), _mm512_set1_ps(k.ds[2 * c])),
            _mm512_mul_ps(i8x16_f32(q.add(16)), _mm512_set1_ps(k.ds[2 * c + 1])),
        ]
    }
}

struct Q51;
impl Fmt for Q51 {
    const BL: usize = 32;
    const BB: usize = 24;
    const CH: usize = 1;
    const H: usize = 2;
    /// The 32-entry table (q = 0..16, then 16..32) and the 32 fifth bits.
    type Prep = (__m512, __m512, u32);
    #[inline(always)]
    unsafe fn prep(b: *const u8, s: *const f32) -> Self::Prep {
        // q * d is exact, so each fma rounds once, like the reference's q * d + m.
        let (d, m) = (_mm512_set1_ps(*s), _mm512_set1_ps(*s.add(1)));
        let hi = _mm512_add_ps(iota(), _mm512_set1_ps(16.0));
        (
            _mm512_fmadd_ps(iota(), d, m),
            _mm512_fmadd_ps(hi, d, m),
            b.add(4).cast::<u32>().read_unaligned(),
        )
    }
    #[inline(always)]
    unsafe fn chunk(b: *const u8, p: &Self::Prep, _c: usize) -> [__m512; 2] {
        let (lo, hi, qh) = *p;
        // The fifth bit goes to index bit 4, which picks the upper table (`vpermt2ps` reads the
        // low 5 bits of each index, so the low nibble's lane is masked first).
        let q = u8x16(b.add(8));
        let sixteen = _mm512_set1_epi32(16);
        let ql = _mm512_and_si512(q, _mm512_set1_epi32(0x0F));
        let i0 = _mm512_mask_or_epi32(ql, qh as u16, ql, sixteen);
        let q4 = _mm512_srli_epi32::<4>(q);
        let i1 = _mm512_mask_or_epi32(q4, (qh >> 16) as u16, q4, sixteen);
        [
            _mm512_permutex2var_ps(lo, i0, hi),
            _mm512_permutex2var_ps(lo, i1, hi),
        ]
    }
}

/// The 16 IQ4 values as f32.
#[inline(always)]
unsafe fn kvalues() -> __m512 {
    i8x16_f32(KVALUES_IQ4NL.as_ptr().cast())
}

struct Iq4nl;
impl Fmt for Iq4nl {
    const BL: usize = 32;
    const BB: usize = 18;
    const CH: usize = 1;
    const H: usize = 1;
    type Prep = __m512;
    #[inline(always)]
    unsafe fn prep(_b: *const u8, s: *const f32) -> __m512 {
        // d * value is exact (11 + 7 significant bits), as in the reference.
        _mm512_mul_ps(kvalues(), _mm512_set1_ps(*s))
    }
    #[inline(always)]
    unsafe fn chunk(b: *const u8, t: &__m512, _c: usize) -> [__m512; 2] {
        let q = u8x16(b.add(2));
        [lut(q, *t), lut(_mm512_srli_epi32::<4>(q), *t)]
    }
}

struct Iq4xs;
impl Fmt for Iq4xs {
    const BL: usize = 256;
    const BB: usize = 136;
    const CH: usize = 8;
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
    unsafe fn chunk(b: *const u8, dl: &[f32; 8], c: usize) -> [__m512; 2] {
        // Chunk c is sub-block c; dl * value is exact, as in the reference.
        let t = _mm512_mul_ps(kvalues(), _mm512_set1_ps(dl[c]));
        let q = u8x16(b.add(8 + 16 * c));
        [lut(q, t), lut(_mm512_srli_epi32::<4>(q), t)]
    }
}

struct Q8k;
impl Fmt for Q8k {
    const BL: usize = 256;
    const BB: usize = 292;
    const CH: usize = 8;
    type Prep = __m512;
    #[inline(always)]
    unsafe fn prep(b: *const u8, _s: *const f32) -> __m512 {
        _mm512_set1_ps(b.cast::<f32>().read_unaligned())
    }
    #[inline(always)]
    unsafe fn chunk(b: *const u8, d: &__m512, c: usize) -> [__m512; 2] {
        let q = b.add(4 + 32 * c);
        [
            _mm512_mul_ps(i8x16_f32(q), *d),
            _mm512_mul_ps(i8x16_f32(q.add(16)), *d),
        ]
    }
}

/// The exact weights of 32 signed quants under their sub-block scales (values `32 c..`).
#[inline(always)]
unsafe fn scaled<U: Unpack>(q: [__m512; 2], sc: &Scales, c: usize) -> [__m512; 2] {
    let mut w = q;
    for (k, w) in w.iter_mut().enumerate() {
        let j = (32 * c + 16 * k) / U::SUB;
        let s = _mm512_set1_ps(sc.s[j]);
        *w = if U::MIN {
            _mm512_fmadd_ps(*w, s, _mm512_set1_ps(sc.m[j]))
        } else {
            _mm512_mul_ps(*w, s)
        };
    }
    w
}

/// A format of `unpack`, unpacked whole per block; chunk c is values 32c..32c + 32.
struct Unp<U>(core::marker::PhantomData<U>);
impl<U: Unpack> Fmt for Unp<U> {
    const BL: usize = 256;
    const BB: usize = U::BB;
    const CH: usize = 8;
    type Prep = Unpacked;
    #[inline(always)]
    unsafe fn prep(b: *const u8, _s: *const f32) -> Unpacked {
        U::unpack(b)
    }
    #[inline(always)]
    unsafe fn chunk(_b: *const u8, u: &Unpacked, c: usize) -> [__m512; 2] {
        let q = u.q.as_ptr().cast::<u8>().add(32 * c);
        scaled::<U>([i8x16_f32(q), i8x16_f32(q.add(16))], &u.sc, c)
    }
}

/// The same formats decoded chunk by chunk straight from the block, only the scales prepared
/// per block: faster for the formats whose quants come from one grid gather per 32 values and
/// whose per-block unpacking would otherwise be stored and reloaded.
struct Direct<U>(core::marker::PhantomData<U>);
impl<U: Unpack> Fmt for Direct<U> {
    const BL: usize = 256;
    const BB: usize = U::BB;
    const CH: usize = 8;
    type Prep = Scales;
    #[inline(always)]
    unsafe fn prep(b: *const u8, _s: *const f32) -> Scales {
        U::scales(b)
    }
    #[inline(always)]
    unsafe fn chunk(b: *const u8, sc: &Scales, c: usize) -> [__m512; 2] {
        let q = U::quants(b, c);
        let f = |v: __m128i| _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
        let q = [
            f(_mm256_castsi256_si128(q)),
            f(_mm256_extracti128_si256::<1>(q)),
        ];
        scaled::<U>(q, sc, c)
    }
}

struct Flt32;
impl Fmt for Flt32 {
    const BL: usize = 32;
    const BB: usize = 128;
    const CH: usize = 1;
    type Prep = ();
    #[inline(always)]
    unsafe fn prep(_b: *const u8, _s: *const f32) {}
    #[inline(always)]
    unsafe fn chunk(b: *const u8, _p: &(), _c: usize) -> [__m512; 2] {
        [_mm512_loadu_ps(b.cast()), _mm512_loadu_ps(b.add(64).cast())]
    }
}

struct Flt16;
impl Fmt for Flt16 {
    const BL: usize = 32;
    const BB: usize = 64;
    const CH: usize = 1;
    type Prep = ();
    #[inline(always)]
    unsafe fn prep(_b: *const u8, _s: *const f32) {}
    #[inline(always)]
    unsafe fn chunk(b: *const u8, _p: &(), _c: usize) -> [__m512; 2] {
        [
            _mm512_cvtph_ps(_mm256_loadu_si256(b.cast())),
            _mm512_cvtph_ps(_mm256_loadu_si256(b.add(32).cast())),
        ]
    }
}

/// 16 bf16 values: each is the top half of an f32.
#[inline(always)]
unsafe fn bf16x16(p: *const u8) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
        _mm256_loadu_si256(p.cast()),
    )))
}

struct BFlt16;
impl Fmt for BFlt16 {
    const BL: usize = 32;
    const BB: usize = 64;
    const CH: usize = 1;
    type Prep = ();
    #[inline(always)]
    unsafe fn prep(_b: *const u8, _s: *const f32) {}
    #[inline(always)]
    unsafe fn chunk(b: *const u8, _p: &(), _c: usize) -> [__m512; 2] {
        [bf16x16(b), bf16x16(b.add(32))]
    }
}

/// Blocks per group whose fp16 scales are converted ahead (see `f16_fields`), and the room their
/// converted values take per row.
const GROUP: usize = 32;
const SC: usize = 2 * GROUP + 8;

/// `MR` weight rows (stride `rb` bytes, `nb` blocks each) against `NR` activation rows (stride
/// `cols`); writes `out[i * oi + t * ot]`. Each chunk is decoded once for all `NR` rows and each
/// activation load serves all `MR` rows. Every dot is one accumulator taking the chunk's two
/// FMAs in order, whatever the tile's shape: a row's result never depends on how many rows
/// share its tile (a batch's decode rows get exactly what each gets alone).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
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
    let mut acc = [[_mm512_setzero_ps(); NR]; MR];
    // Per-row converted scales of the current group; written before being read, so left
    // uninitialized (zeroing it would cost as much as a short row's work).
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
                let mut wv = [[_mm512_setzero_ps(); 2]; MR];
                for i in 0..MR {
                    wv[i] = F::chunk(wb.add(i * rb), &p[i], c);
                }
                for t in 0..NR {
                    let xt = xb.add(t * cols);
                    let x0 = _mm512_loadu_ps(xt.add(F::off(c, 0)));
                    let x1 = _mm512_loadu_ps(xt.add(F::off(c, 1)));
                    for i in 0..MR {
                        acc[i][t] = _mm512_fmadd_ps(wv[i][0], x0, acc[i][t]);
                        acc[i][t] = _mm512_fmadd_ps(wv[i][1], x1, acc[i][t]);
                    }
                }
            }
        }
        g0 += count;
    }
    for i in 0..MR {
        for t in 0..NR {
            *out.add(i * oi + t * ot) = _mm512_reduce_add_ps(acc[i][t]);
        }
    }
}

/// Runs the whole problem in register tiles; returns how many leading columns it covered (all of
/// them for block formats, whole 32-column steps for float rows).
///
/// Tiles: up to four activation rows with four weight rows; five to eight activation rows with
/// two weight rows (at most 16 accumulators, of 32 registers).
unsafe fn run_fmt<F: Fmt>(s: &Shape, w: *const u8, x: *const f32, out: *mut f32) -> usize {
    let nb = s.cols / F::BL;
    let rows_for = |nr: usize| if nr <= 4 { 4 } else { 2 };
    super::schedule(s.m, s.n, 8, rows_for, |i0, mr, t0, nr| {
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
            (4, 2) => go!(4, 2),
            (4, 3) => go!(4, 3),
            (4, 4) => go!(4, 4),
            (2, 1) => go!(2, 1),
            (2, 2) => go!(2, 2),
            (2, 3) => go!(2, 3),
            (2, 4) => go!(2, 4),
            (2, 5) => go!(2, 5),
            (2, 6) => go!(2, 6),
            (2, 7) => go!(2, 7),
            (2, 8) => go!(2, 8),
            (1, 1) => go!(1, 1),
            (1, 2) => go!(1, 2),
            (1, 3) => go!(1, 3),
            (1, 4) => go!(1, 4),
            (1, 5) => go!(1, 5),
            (1, 6) => go!(1, 6),
            (1, 7) => go!(1, 7),
            (1, 8) => go!(1, 8),
            _ => unreachable!("schedule yields mr ∈ {{1, 2, 4}}, nr ∈ 1..=8"),
        }
    });
    nb * F::BL
}

/// # Safety
/// The CPU has AVX-512 F/BW/VL, AVX2, FMA and F16C; `w`, `x` and `out` hold the buffers `s`
/// describes.
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
        IQ2XXS => run_fmt::<Direct<unpack::Iq2xxs>>(s, w, x, out),
        IQ2XS => run_fmt::<Direct<unpack::Iq2xs>>(s, w, x, out),
        IQ2S => run_fmt::<Unp<unpack::Iq2s>>(s, w, x, out),
        IQ3XXS => run_fmt::<Direct<unpack::Iq3xxs>>(s, w, x, out),
        IQ3S => run_fmt::<Unp<unpack::Iq3s>>(s, w, x, out),
        IQ4NL => run_fmt::<Iq4nl>(s, w, x, out),
        IQ4XS => run_fmt::<Iq4xs>(s, w, x, out),
        _ => unreachable!("checked by is_supported"),
    }
}
