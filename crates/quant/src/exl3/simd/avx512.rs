//! AVX-512 (F/BW/VL) tile kernels: a tile's 256 states cut from its stream in registers (16-bit
//! permutes across the tile's words, then variable shifts), the codebook evaluated 32 states at a
//! time, and each pair of tile rows multiplied into up to 16 activation rows' accumulators.
// Index loops over the small register arrays read more clearly than iterator chains here, and
// they fully unroll either way.
#![allow(clippy::needless_range_loop)]

use core::arch::x86_64::*;

use super::{tables, Order, PairIdx, RateTables};
use crate::exl3::codebook::{Codebook, INST3_ADD, INST3_MUL, MCG_MUL, MUL1_A, MUL1_B, MUL1_MUL};
use crate::exl3::trellis::Bitrate;
use crate::exl3::Exl3Shape;

const INST3: u8 = 0;
const MCG: u8 = 1;
const MUL1: u8 = 2;

/// The tile's int16 units in 2 (up to 64 units, K <= 4) or 4 registers; masked loads never
/// touch bytes past the tile.
#[inline(always)]
pub(super) unsafe fn load_tile<const BIG: bool>(tile: *const u8, t: &RateTables) -> [__m512i; 4] {
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

#[inline(always)]
pub(super) unsafe fn ld(p: &[u16; 32]) -> __m512i {
    _mm512_load_si512(p.as_ptr().cast())
}

/// The 32 16-bit states of one row pair, in the pair table's lane order.
#[inline(always)]
unsafe fn states<const BIG: bool>(r: &[__m512i; 4], p: &PairIdx) -> __m512i {
    let (ih, il) = (ld(&p.hi), ld(&p.lo));
    let mut h = _mm512_permutex2var_epi16(r[0], ih, r[1]);
    let mut l = _mm512_permutex2var_epi16(r[0], il, r[1]);
    if BIG {
        h = _mm512_mask_blend_epi16(p.hi_sel, h, _mm512_permutex2var_epi16(r[2], ih, r[3]));
        l = _mm512_mask_blend_epi16(p.lo_sel, l, _mm512_permutex2var_epi16(r[2], il, r[3]));
    }
    let pow = ld(&p.pow);
    _mm512_or_si512(_mm512_mullo_epi16(h, pow), _mm512_mulhi_epu16(l, pow))
}

#[inline(always)]
unsafe fn c16(v: u32) -> __m512i {
    _mm512_set1_epi16(v as u16 as i16)
}

/// `x * mul (+ add)` mod 2^32 for 16-bit `x`, as its low and high 16-bit halves.
#[inline(always)]
unsafe fn mul32(x: __m512i, mul: u32, add: Option<u32>) -> (__m512i, __m512i) {
    let (ml, mh) = (c16(mul), c16(mul >> 16));
    let lo = _mm512_mullo_epi16(x, ml);
    let hi = _mm512_add_epi16(_mm512_mulhi_epu16(x, ml), _mm512_mullo_epi16(x, mh));
    match add {
        None => (lo, hi),
        Some(a) => {
            let al = c16(a);
            let lo = _mm512_add_epi16(lo, al);
            let carry = _mm512_cmplt_epu16_mask(lo, al);
            let hi = _mm512_add_epi16(hi, c16(a >> 16));
            (lo, _mm512_mask_add_epi16(hi, carry, hi, c16(1)))
        }
    }
}

/// Rounds to fp16 (nearest even) and back.
#[inline(always)]
unsafe fn round16(v: __m512) -> __m512 {
    _mm512_cvtph_ps(_mm512_cvtps_ph::<
        { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
    >(v))
}

/// The two tile rows' f32 values (columns in lane order) from their 32 states.
#[inline(always)]
unsafe fn values<const CB: u8>(x: __m512i) -> [__m512; 2] {
    if CB == MUL1 {
        let (lo, hi) = mul32(x, MUL1_MUL, None);
        let ones = _mm512_set1_epi8(1);
        let s = _mm512_add_epi16(
            _mm512_maddubs_epi16(lo, ones),
            _mm512_maddubs_epi16(hi, ones),
        );
        // 0x4B00_0000 | s is the f32 2^23 + s; `fma(2^23 + s, scale, c)` with
        // c = 1024 scale + bias - 2^23 scale is the exact `(1024 + s) scale + bias`.
        let magic = c16(0x4B00);
        let (scale, c) = (
            _mm512_set1_ps(MUL1_A),
            _mm512_set1_ps(MUL1_B - 8388608.0 * MUL1_A),
        );
        let f0 = _mm512_castsi512_ps(_mm512_unpacklo_epi16(s, magic));
        let f1 = _mm512_castsi512_ps(_mm512_unpackhi_epi16(s, magic));
        [
            round16(_mm512_fmadd_ps(f0, scale, c)),
            round16(_mm512_fmadd_ps(f1, scale, c)),
        ]
    } else {
        let (lo, hi) = if CB == INST3 {
            mul32(x, INST3_MUL, Some(INST3_ADD))
        } else {
            mul32(x, MCG_MUL, None)
        };
        // (m & 0x8FFF) ^ 0x3B60 on each half: ternary-logic table (A & B) ^ C.
        let (mask, xor) = (c16(0x8FFF), c16(0x3B60));
        let lo = _mm512_ternarylogic_epi32::<0x6A>(lo, mask, xor);
        let hi = _mm512_ternarylogic_epi32::<0x6A>(hi, mask, xor);
        let a0 = _mm512_cvtph_ps(_mm512_castsi512_si256(lo));
        let a1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(lo));
        let b0 = _mm512_cvtph_ps(_mm512_castsi512_si256(hi));
        let b1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(hi));
        [
            round16(_mm512_add_ps(a0, b0)),
            round16(_mm512_add_ps(a1, b1)),
        ]
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn decode_inner<const CB: u8, const BIG: bool, const H16: bool>(
    tile: *const u8,
    t: &RateTables,
    order: Order,
    out: *mut f32,
    stride: usize,
) {
    let r = load_tile::<BIG>(tile, t);
    let pairs = t.pairs(order);
    let mut rows = [_mm512_setzero_ps(); 16];
    for rp in 0..8 {
        let w = values::<CB>(states::<BIG>(&r, &pairs[rp]));
        rows[2 * rp] = w[0];
        rows[2 * rp + 1] = w[1];
    }
    if H16 {
        // The unscaled 16-point Hadamard butterfly down the tile's rows.
        for h in [1, 2, 4, 8] {
            for a in (0..16).step_by(2 * h) {
                for j in a..a + h {
                    let (p, q) = (rows[j], rows[j + h]);
                    rows[j] = _mm512_add_ps(p, q);
                    rows[j + h] = _mm512_sub_ps(p, q);
                }
            }
        }
    }
    for (i, v) in rows.iter().enumerate() {
        _mm512_storeu_ps(out.add(i * stride), *v);
    }
}

/// One tile to f32, its 16 rows `stride` floats apart from `out`; with `H16`, after the unscaled
/// 16-point Hadamard butterfly down its rows. Caller: AVX-512 F/BW/VL, FMA, F16C available;
/// `tile` has `rate.tile_bytes()` bytes; `out` has room for the rows.
pub(super) unsafe fn decode_tile<const H16: bool>(
    tile: *const u8,
    rate: Bitrate,
    cb: Codebook,
    out: *mut f32,
    stride: usize,
) {
    let t = tables(rate);
    let o = Order::of(cb);
    match (cb, t.big()) {
        (Codebook::Inst3, false) => decode_inner::<INST3, false, H16>(tile, t, o, out, stride),
        (Codebook::Inst3, true) => decode_inner::<INST3, true, H16>(tile, t, o, out, stride),
        (Codebook::Mcg, false) => decode_inner::<MCG, false, H16>(tile, t, o, out, stride),
        (Codebook::Mcg, true) => decode_inner::<MCG, true, H16>(tile, t, o, out, stride),
        (Codebook::Mul1, false) => decode_inner::<MUL1, false, H16>(tile, t, o, out, stride),
        (Codebook::Mul1, true) => decode_inner::<MUL1, true, H16>(tile, t, o, out, stride),
    }
}

/// Geometry passed to the kernels.
struct Job {
    trellis: *const u8,
    tile_bytes: usize,
    tiles_n: usize,
    tiles_k: usize,
    /// The activations k-major, `[k][rows]`: every row's value at one k is at a fixed offset
    /// from one pointer (16 row pointers would not fit the general registers).
    x: *const f32,
    tn0: usize,
    tn1: usize,
    out: *mut f32,
    width: usize,
}

/// Tile rows ahead of the one being multiplied that a group's tiles are prefetched from.
const PREFETCH_ROWS: usize = 2;

/// Prefetches the `span` bytes of a column group's tiles [`PREFETCH_ROWS`] tile rows (of `stride`
/// bytes) below `row` (which may lie past the trellis: prefetches never fault).
#[inline(always)]
pub(super) unsafe fn prefetch_ahead(row: *const u8, stride: usize, span: usize) {
    let ahead = row.wrapping_add(PREFETCH_ROWS * stride);
    for line in (0..span).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line).cast());
    }
    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(span - 1).cast());
}

/// `M` activation rows, `CG` output tile columns at a time: the group walks down `k` one tile
/// row at a time, its `CG` tiles side by side in memory (a tile column alone would be one tile
/// per page, each load a cache and TLB miss), keeping the `CG x M` 16-wide sums in registers.
/// Columns `tn0..tn1` not filling a whole group go one at a time. Every output's sum runs in the
/// same order whatever `CG` and `M` are.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn kernel<const CB: u8, const BIG: bool, const M: usize, const CG: usize>(
    j: &Job,
    t: &RateTables,
    pairs: &[PairIdx; 8],
) {
    let mut tn = j.tn0;
    while tn + CG <= j.tn1 {
        columns::<CB, BIG, M, CG>(j, t, pairs, tn);
        tn += CG;
    }
    while tn < j.tn1 {
        columns::<CB, BIG, M, 1>(j, t, pairs, tn);
        tn += 1;
    }
}

/// Output tile columns `tn .. tn + CG` of [`kernel`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn columns<const CB: u8, const BIG: bool, const M: usize, const CG: usize>(
    j: &Job,
    t: &RateTables,
    pairs: &[PairIdx; 8],
    tn: usize,
) {
    let stride = j.tiles_n * j.tile_bytes;
    let span = CG * j.tile_bytes;
    let mut acc = [[_mm512_setzero_ps(); M]; CG];
    let mut row = j.trellis.add(tn * j.tile_bytes);
    let mut xk = j.x;
    for _ in 0..j.tiles_k {
        prefetch_ahead(row, stride, span);
        for c in 0..CG {
            let r = load_tile::<BIG>(row.add(c * j.tile_bytes), t);
            for rp in 0..8 {
                let w = values::<CB>(states::<BIG>(&r, &pairs[rp]));
                for h in 0..2 {
                    for m in 0..M {
                        let xv = _mm512_set1_ps(*xk.add((2 * rp + h) * M + m));
                        acc[c][m] = _mm512_fmadd_ps(xv, w[h], acc[c][m]);
                    }
                }
            }
        }
        row = row.add(stride);
        xk = xk.add(16 * M);
    }
    for c in 0..CG {
        for m in 0..M {
            _mm512_storeu_ps(j.out.add(m * j.width + 16 * (tn + c - j.tn0)), acc[c][m]);
        }
    }
}

unsafe fn run<const CB: u8, const BIG: bool>(j: &Job, t: &RateTables, rows: usize) {
    let p = t.pairs(if CB == MUL1 {
        Order::Unpack
    } else {
        Order::Linear
    });
    // Column groups as wide as 16 accumulators allow; one accumulator an output at every row
    // count, so that a row's sums do not depend on the rows beside it (and enough independent
    // chains for the FMA latency come from the columns).
    match rows {
        1 => kernel::<CB, BIG, 1, 16>(j, t, p),
        2 => kernel::<CB, BIG, 2, 8>(j, t, p),
        3 => kernel::<CB, BIG, 3, 4>(j, t, p),
        4 => kernel::<CB, BIG, 4, 4>(j, t, p),
        5 => kernel::<CB, BIG, 5, 2>(j, t, p),
        6 => kernel::<CB, BIG, 6, 2>(j, t, p),
        7 => kernel::<CB, BIG, 7, 2>(j, t, p),
        8 => kernel::<CB, BIG, 8, 2>(j, t, p),
        9 => kernel::<CB, BIG, 9, 1>(j, t, p),
        10 => kernel::<CB, BIG, 10, 1>(j, t, p),
        11 => kernel::<CB, BIG, 11, 1>(j, t, p),
        12 => kernel::<CB, BIG, 12, 1>(j, t, p),
        13 => kernel::<CB, BIG, 13, 1>(j, t, p),
        14 => kernel::<CB, BIG, 14, 1>(j, t, p),
        15 => kernel::<CB, BIG, 15, 1>(j, t, p),
        16 => kernel::<CB, BIG, 16, 1>(j, t, p),
        _ => unreachable!("1..=16 rows per call"),
    }
}

/// `rows` (1..=16) activation rows `x` (`[rows][k]`) times the output tiles `tn0..tn1`, into
/// `out` (`[rows][16 (tn1 - tn0)]`, overwritten). Caller: AVX-512 F/BW/VL, FMA, F16C available,
/// lengths checked.
pub(super) unsafe fn matmul(
    shape: &Exl3Shape,
    trellis: *const u8,
    x: *const f32,
    rows: usize,
    tn0: usize,
    tn1: usize,
    out: &mut [f32],
) {
    let t = tables(shape.rate);
    let k = shape.k;
    let xt: Vec<f32>;
    let x = if rows == 1 {
        x
    } else {
        // SAFETY: the caller checked `x` holds `rows * k` values.
        let xs = unsafe { std::slice::from_raw_parts(x, rows * k) };
        xt = (0..k * rows)
            .map(|i| xs[(i % rows) * k + i / rows])
            .collect();
        xt.as_ptr()
    };
    let j = Job {
        trellis,
        tile_bytes: shape.rate.tile_bytes(),
        tiles_n: shape.tiles_n(),
        tiles_k: shape.tiles_k(),
        x,
        tn0,
        tn1,
        out: out.as_mut_ptr(),
        width: 16 * (tn1 - tn0),
    };
    match (shape.codebook, t.big()) {
        (Codebook::Inst3, false) => run::<INST3, false>(&j, t, rows),
        (Codebook::Inst3, true) => run::<INST3, true>(&j, t, rows),
        (Codebook::Mcg, false) => run::<MCG, false>(&j, t, rows),
        (Codebook::Mcg, true) => run::<MCG, true>(&j, t, rows),
        (Codebook::Mul1, false) => run::<MUL1, false>(&j, t, rows),
        (Codebook::Mul1, true) => run::<MUL1, true>(&j, t, rows),
    }
}
