//! AVX2 + FMA + F16C tile kernels, for CPUs without AVX-512.
//!
//! States are cut in stream order, one *group* of 8 positions at a time: positions `8 G ..
//! 8 G + 8` hold rows `2g, 2g + 1, 2g + 8, 2g + 9` (lane `j`: `2g + (j & 1) + 8 ((j >> 1) & 1)`)
//! of columns `c` (lanes 0-3) and `c + 8` (lanes 4-7), with `g = G % 4` and `c = G / 4`. The
//! tile is staged with its words in reverse order, so that its stream reads as one
//! little-endian integer in which position `p`'s window is the 16 bits from `tile_bits -
//! end_bit(p)`; a group's 8 windows then come from one 64-bit broadcast load (two from K = 6 up)
//! and two variable shifts. Gathers, the direct form, take about a cycle an element on Zen 2 and
//! left this path slower than the scalar table walk.
//!
//! The products keep that order: lane `j` of a group's values meets the activation of its row
//! (the same 4-row pattern for every group with the same `g`), and each accumulator holds column
//! `c` in lanes 0-3 and `c + 8` in lanes 4-7 until the band's sums are folded at its end.
#![allow(clippy::needless_range_loop)]

use core::arch::x86_64::*;

use std::sync::OnceLock;

use crate::exl3::codebook::{Codebook, INST3_ADD, INST3_MUL, MCG_MUL, MUL1_A, MUL1_B, MUL1_MUL};
use crate::exl3::trellis::Bitrate;
use crate::exl3::Exl3Shape;

const INST3: u8 = 0;
const MCG: u8 = 1;
const MUL1: u8 = 2;

/// `$body` for `$i` = 0..16 as constants: the accumulators it indexes by `$i` stay in registers
/// (LLVM keeps a loop over them rolled, and the arrays on the stack). Not a closure: closures
/// do not inherit their function's target features, and their intrinsics become calls.
macro_rules! unroll16 {
    ($i:ident => $body:block) => {
        unroll16!(@ $i $body; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
    };
    (@ $i:ident $body:block; $($n:literal)*) => {
        $({
            let $i: usize = $n;
            $body
        })*
    };
}

/// Where one group's 8 windows are cut from: the byte offsets of the 64-bit loads holding its
/// positions 0-3 and 4-7 (the same one below K = 6), and each position's right shift within its
/// load, even positions then odd ones.
#[repr(C, align(32))]
struct Cut {
    even: [u64; 4],
    odd: [u64; 4],
    off: [usize; 2],
}

/// A bitrate's 32 group cuts.
struct Cuts {
    groups: [Cut; 32],
    /// Whether a group's windows span more than one 64-bit load holds (K >= 6).
    two: bool,
}

fn build_cuts(rate: Bitrate) -> Cuts {
    let total = rate.tile_bits();
    // The window of position `p` starts at this bit of the staged integer.
    let bit = |p: usize| (total - rate.end_bit(p as u32)) as usize;
    let two = (0..32).any(|g| bit(8 * g) - (bit(8 * g + 7) & !7) > 48);
    let groups = std::array::from_fn(|g| {
        let off = if two {
            [bit(8 * g + 3) / 8, bit(8 * g + 7) / 8]
        } else {
            [bit(8 * g + 7) / 8; 2]
        };
        let shift = |j: usize| {
            let s = bit(8 * g + j) - 8 * off[j / 4];
            assert!(s <= 48, "a window past its load");
            s as u64
        };
        Cut {
            even: std::array::from_fn(|i| shift(2 * i)),
            odd: std::array::from_fn(|i| shift(2 * i + 1)),
            off,
        }
    });
    Cuts { groups, two }
}

fn cuts(rate: Bitrate) -> &'static Cuts {
    static T: [OnceLock<Box<Cuts>>; 17] = [const { OnceLock::new() }; 17];
    T[(2.0 * rate.bits()) as usize].get_or_init(|| Box::new(build_cuts(rate)))
}

/// A tile's stream as one little-endian integer (its words in reverse order), with its first
/// 16 bits repeated past the top for the windows that wrap around, and room for a 64-bit load
/// at any window.
#[repr(C, align(32))]
struct Staged([u8; 256 + 32]);

#[inline(always)]
unsafe fn stage(tile: *const u8, tb: usize, buf: &mut Staged) {
    let b = buf.0.as_mut_ptr();
    for i in 0..tb / 16 {
        let v = _mm_loadu_si128(tile.add(16 * i).cast());
        _mm_storeu_si128(
            b.add(tb - 16 * (i + 1)).cast(),
            _mm_shuffle_epi32::<0x1B>(v),
        );
    }
    b.add(tb)
        .cast::<u16>()
        .write_unaligned(b.cast::<u16>().read_unaligned());
}

/// A band's tiles staged one ahead of their use, in the order the kernels walk them (down `k`,
/// across the band): a window load that straddles two of a stage's fresh stores cannot take its
/// bytes from them and waits until both retire (7% of the kernel when staged just before use).
struct Stager {
    bufs: [Staged; 2],
    trellis: *const u8,
    tb: usize,
    tiles_n: usize,
    tn0: usize,
    cols: usize,
    count: usize,
}

impl Stager {
    #[inline(always)]
    unsafe fn new(shape: &Exl3Shape, trellis: *const u8, tn0: usize, tn1: usize) -> Stager {
        let mut s = Stager {
            bufs: [Staged([0; 256 + 32]), Staged([0; 256 + 32])],
            trellis,
            tb: shape.rate.tile_bytes(),
            tiles_n: shape.tiles_n(),
            tn0,
            cols: tn1 - tn0,
            count: shape.tiles_k() * (tn1 - tn0),
        };
        if s.count > 0 {
            s.put(0);
        }
        s
    }

    #[inline(always)]
    unsafe fn put(&mut self, t: usize) {
        let (tk, tn) = (t / self.cols, t % self.cols);
        let tile = self
            .trellis
            .add((tk * self.tiles_n + self.tn0 + tn) * self.tb);
        stage(tile, self.tb, &mut self.bufs[t & 1]);
    }

    /// Tile `t` (`tk * cols + tn`), after staging tile `t + 1`.
    #[inline(always)]
    unsafe fn take(&mut self, t: usize) -> &Staged {
        if t + 1 < self.count {
            self.put(t + 1);
        }
        &self.bufs[t & 1]
    }
}

/// Group `g`'s 8 states, dword `j` for position `8 g + j`.
#[inline(always)]
unsafe fn group_states<const TWO: bool>(buf: &Staged, cut: &Cut) -> __m256i {
    let b = buf.0.as_ptr();
    let lo = _mm256_set1_epi64x(b.add(cut.off[0]).cast::<i64>().read_unaligned());
    let raw = if TWO {
        let hi = _mm256_set1_epi64x(b.add(cut.off[1]).cast::<i64>().read_unaligned());
        _mm256_blend_epi32::<0xF0>(lo, hi)
    } else {
        lo
    };
    let even = _mm256_srlv_epi64(raw, _mm256_load_si256(cut.even.as_ptr().cast()));
    let odd = _mm256_srlv_epi64(raw, _mm256_load_si256(cut.odd.as_ptr().cast()));
    let d = _mm256_blend_epi32::<0xAA>(even, _mm256_slli_epi64::<32>(odd));
    _mm256_and_si256(d, _mm256_set1_epi32(0xFFFF))
}

/// The pairs of groups a tile is walked in: pair `i` is groups `8 q + g` and `8 q + 4 + g`
/// (`q = i / 4`, `g = i % 4`), the same rows of columns `2q` and `2q + 1` (and `+ 8`).
#[inline(always)]
fn pair_groups(i: usize) -> (usize, usize) {
    let (q, g) = (i / 4, i % 4);
    (8 * q + g, 8 * q + 4 + g)
}

/// Pair `i`'s 16 states as 16-bit lanes `[A0-3 B0-3 | A4-7 B4-7]` (A, B: its two groups).
#[inline(always)]
unsafe fn pair_states<const TWO: bool>(buf: &Staged, cuts: &Cuts, i: usize) -> __m256i {
    let (a, b) = pair_groups(i);
    _mm256_packus_epi32(
        group_states::<TWO>(buf, &cuts.groups[a]),
        group_states::<TWO>(buf, &cuts.groups[b]),
    )
}

#[inline(always)]
unsafe fn c16(v: u32) -> __m256i {
    _mm256_set1_epi16(v as u16 as i16)
}

/// `x * mul (+ add)` mod 2^32 for 16-bit `x`, as its low and high 16-bit halves.
#[inline(always)]
unsafe fn mul32(x: __m256i, mul: u32, add: Option<u32>) -> (__m256i, __m256i) {
    let (ml, mh) = (c16(mul), c16(mul >> 16));
    let lo = _mm256_mullo_epi16(x, ml);
    let hi = _mm256_add_epi16(_mm256_mulhi_epu16(x, ml), _mm256_mullo_epi16(x, mh));
    match add {
        None => (lo, hi),
        Some(a) => {
            let lo = _mm256_add_epi16(lo, c16(a));
            // Unsigned lo < a, as a signed compare with both sign bits flipped: all ones where
            // the low half carried.
            let flip = c16(0x8000);
            let carry = _mm256_cmpgt_epi16(c16(a ^ 0x8000), _mm256_xor_si256(lo, flip));
            let hi = _mm256_add_epi16(hi, c16(a >> 16));
            (lo, _mm256_sub_epi16(hi, carry))
        }
    }
}

/// MUL1's byte sums `s` (0..=1020) of 16 states' hashes, lane for lane.
#[inline(always)]
unsafe fn mul1_sums(x: __m256i) -> __m256i {
    let (lo, hi) = mul32(x, MUL1_MUL, None);
    let ones = _mm256_set1_epi8(1);
    _mm256_add_epi16(
        _mm256_maddubs_epi16(lo, ones),
        _mm256_maddubs_epi16(hi, ones),
    )
}

#[inline(always)]
unsafe fn round16(v: __m256) -> __m256 {
    _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
}

/// The exact values of a pair's states ([`pair_states`] order), one vector per group, lane `j`
/// for position `j`.
#[inline(always)]
unsafe fn pair_values<const CB: u8>(x: __m256i) -> (__m256, __m256) {
    if CB == MUL1 {
        let s = mul1_sums(x);
        // 2^23 + s as f32 bits, so one FMA gives A s + B.
        let magic = c16(0x4B00);
        let (scale, c) = (
            _mm256_set1_ps(MUL1_A),
            _mm256_set1_ps(MUL1_B - 8388608.0 * MUL1_A),
        );
        let fa = _mm256_castsi256_ps(_mm256_unpacklo_epi16(s, magic));
        let fb = _mm256_castsi256_ps(_mm256_unpackhi_epi16(s, magic));
        (
            round16(_mm256_fmadd_ps(fa, scale, c)),
            round16(_mm256_fmadd_ps(fb, scale, c)),
        )
    } else {
        // Group A in the low 128 bits, B in the high, each in position order.
        let x = _mm256_permute4x64_epi64::<0b11_01_10_00>(x);
        let (lo, hi) = if CB == INST3 {
            mul32(x, INST3_MUL, Some(INST3_ADD))
        } else {
            mul32(x, MCG_MUL, None)
        };
        let (mask, xor) = (c16(0x8FFF), c16(0x3B60));
        let lo = _mm256_xor_si256(_mm256_and_si256(lo, mask), xor);
        let hi = _mm256_xor_si256(_mm256_and_si256(hi, mask), xor);
        let (lo0, lo1) = (
            _mm256_cvtph_ps(_mm256_castsi256_si128(lo)),
            _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(lo)),
        );
        let (hi0, hi1) = (
            _mm256_cvtph_ps(_mm256_castsi256_si128(hi)),
            _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(hi)),
        );
        (
            round16(_mm256_add_ps(lo0, hi0)),
            round16(_mm256_add_ps(lo1, hi1)),
        )
    }
}

/// The activations of one tile row (16 inputs at `x`) in group lane order, per `g`: lanes
/// `[x[2g], x[2g+1], x[2g+8], x[2g+9]]` twice.
#[inline(always)]
unsafe fn group_inputs(x: *const f32) -> [__m256; 4] {
    let lo = _mm256_castps_pd(_mm256_loadu_ps(x));
    let hi = _mm256_castps_pd(_mm256_loadu_ps(x.add(8)));
    let (u02, u13) = (_mm256_unpacklo_pd(lo, hi), _mm256_unpackhi_pd(lo, hi));
    [
        _mm256_castpd_ps(_mm256_permute2f128_pd::<0x00>(u02, u02)),
        _mm256_castpd_ps(_mm256_permute2f128_pd::<0x00>(u13, u13)),
        _mm256_castpd_ps(_mm256_permute2f128_pd::<0x11>(u02, u02)),
        _mm256_castpd_ps(_mm256_permute2f128_pd::<0x11>(u13, u13)),
    ]
}

/// A tile column's 16 sums from its 8 split accumulators (`acc[c]`: column `c` in lanes 0-3,
/// `c + 8` in lanes 4-7), as columns 0-7 and 8-15.
#[inline(always)]
unsafe fn fold(acc: &[__m256; 8]) -> (__m256, __m256) {
    let h01 = _mm256_hadd_ps(acc[0], acc[1]);
    let h23 = _mm256_hadd_ps(acc[2], acc[3]);
    let h45 = _mm256_hadd_ps(acc[4], acc[5]);
    let h67 = _mm256_hadd_ps(acc[6], acc[7]);
    // [c0 c1 c2 c3 | c8 c9 c10 c11] and [c4 c5 c6 c7 | c12 c13 c14 c15].
    let u = _mm256_hadd_ps(h01, h23);
    let v = _mm256_hadd_ps(h45, h67);
    (
        _mm256_permute2f128_ps::<0x20>(u, v),
        _mm256_permute2f128_ps::<0x31>(u, v),
    )
}

/// One tile to f32, row-major `[in 16][out 16]` at `stride` floats a row.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_inner<const CB: u8, const TWO: bool>(
    tile: *const u8,
    rate: Bitrate,
    out: *mut f32,
    stride: usize,
) {
    let cuts = cuts(rate);
    let mut buf = Staged([0; 256 + 32]);
    stage(tile, rate.tile_bytes(), &mut buf);
    // vals[G]: group G's values in lane (position) order.
    let mut vals = [_mm256_setzero_ps(); 32];
    unroll16!(i => {
        let (ga, gb) = pair_groups(i);
        (vals[ga], vals[gb]) = pair_values::<CB>(pair_states::<TWO>(&buf, cuts, i));
    });
    // For each g, the 8 groups 4c + g transposed: lane c of row j is column c (+ 8 from j = 4)
    // of row 2g + (j & 1) + 8 ((j >> 1) & 1).
    for g in 0..4 {
        let v: [__m256; 8] = std::array::from_fn(|c| vals[4 * c + g]);
        let t0 = _mm256_unpacklo_ps(v[0], v[1]);
        let t1 = _mm256_unpackhi_ps(v[0], v[1]);
        let t2 = _mm256_unpacklo_ps(v[2], v[3]);
        let t3 = _mm256_unpackhi_ps(v[2], v[3]);
        let t4 = _mm256_unpacklo_ps(v[4], v[5]);
        let t5 = _mm256_unpackhi_ps(v[4], v[5]);
        let t6 = _mm256_unpacklo_ps(v[6], v[7]);
        let t7 = _mm256_unpackhi_ps(v[6], v[7]);
        let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        let rows = [
            _mm256_permute2f128_ps::<0x20>(s0, s4),
            _mm256_permute2f128_ps::<0x20>(s1, s5),
            _mm256_permute2f128_ps::<0x20>(s2, s6),
            _mm256_permute2f128_ps::<0x20>(s3, s7),
            _mm256_permute2f128_ps::<0x31>(s0, s4),
            _mm256_permute2f128_ps::<0x31>(s1, s5),
            _mm256_permute2f128_ps::<0x31>(s2, s6),
            _mm256_permute2f128_ps::<0x31>(s3, s7),
        ];
        for (j, r) in rows.into_iter().enumerate() {
            let row = 2 * g + (j & 1) + 8 * ((j >> 1) & 1);
            _mm256_storeu_ps(out.add(row * stride + 8 * (j >> 2)), r);
        }
    }
}

/// One tile to f32, row-major `[in 16][out 16]` rows `stride` apart. Caller: AVX2, FMA, F16C
/// available; `tile` has `rate.tile_bytes()` bytes and `out` room for the 16 rows.
pub(super) unsafe fn decode_tile(
    tile: *const u8,
    rate: Bitrate,
    cb: Codebook,
    out: *mut f32,
    stride: usize,
) {
    let two = cuts(rate).two;
    match (cb, two) {
        (Codebook::Inst3, false) => decode_inner::<INST3, false>(tile, rate, out, stride),
        (Codebook::Inst3, true) => decode_inner::<INST3, true>(tile, rate, out, stride),
        (Codebook::Mcg, false) => decode_inner::<MCG, false>(tile, rate, out, stride),
        (Codebook::Mcg, true) => decode_inner::<MCG, true>(tile, rate, out, stride),
        (Codebook::Mul1, false) => decode_inner::<MUL1, false>(tile, rate, out, stride),
        (Codebook::Mul1, true) => decode_inner::<MUL1, true>(tile, rate, out, stride),
    }
}

/// The exact kernel: walks the tiles in memory order (a tile row of `k` at a time, its bands'
/// tiles side by side), each tile decoded once for all `rows` activation rows; every output's
/// sums are split over 4 lanes and folded at the end, in the same order for any `rows`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kernel<const CB: u8, const TWO: bool>(
    shape: &Exl3Shape,
    trellis: *const u8,
    x: *const f32,
    rows: usize,
    tn0: usize,
    tn1: usize,
    out: *mut f32,
) {
    let cuts = cuts(shape.rate);
    let (k, cols) = (shape.k, tn1 - tn0);
    let width = 16 * cols;
    let mut stager = Stager::new(shape, trellis, tn0, tn1);
    // acc[(m * cols + tn) * 8 + c]: row m, tile column tn, split column c.
    let mut acc = vec![_mm256_setzero_ps(); rows * cols * 8];
    let mut xs = [[_mm256_setzero_ps(); 4]; super::MAX_ROWS];
    let mut vals = [_mm256_setzero_ps(); 32];
    for tk in 0..shape.tiles_k() {
        for m in 0..rows {
            xs[m] = group_inputs(x.add(m * k + 16 * tk));
        }
        for tn in 0..cols {
            let buf = stager.take(tk * cols + tn);
            if rows == 1 {
                let a = &mut acc[8 * tn..8 * tn + 8];
                let mut r: [__m256; 8] = std::array::from_fn(|c| a[c]);
                let xg = &xs[0];
                unroll16!(i => {
                    let (va, vb) = pair_values::<CB>(pair_states::<TWO>(buf, cuts, i));
                    let (q, g) = (i / 4, i % 4);
                    r[2 * q] = _mm256_fmadd_ps(xg[g], va, r[2 * q]);
                    r[2 * q + 1] = _mm256_fmadd_ps(xg[g], vb, r[2 * q + 1]);
                });
                a.copy_from_slice(&r);
                continue;
            }
            unroll16!(i => {
                (vals[2 * i], vals[2 * i + 1]) =
                    pair_values::<CB>(pair_states::<TWO>(buf, cuts, i));
            });
            for m in 0..rows {
                let a = &mut acc[(m * cols + tn) * 8..][..8];
                let mut r: [__m256; 8] = std::array::from_fn(|c| a[c]);
                let xg = &xs[m];
                unroll16!(i => {
                    let (q, g) = (i / 4, i % 4);
                    r[2 * q] = _mm256_fmadd_ps(xg[g], vals[2 * i], r[2 * q]);
                    r[2 * q + 1] = _mm256_fmadd_ps(xg[g], vals[2 * i + 1], r[2 * q + 1]);
                });
                a.copy_from_slice(&r);
            }
        }
    }
    for m in 0..rows {
        for tn in 0..cols {
            let a: &[__m256; 8] = acc[(m * cols + tn) * 8..][..8].try_into().unwrap();
            let (lo, hi) = fold(a);
            let o = out.add(m * width + 16 * tn);
            _mm256_storeu_ps(o, lo);
            _mm256_storeu_ps(o.add(8), hi);
        }
    }
}

/// `rows` (1..=16) activation rows `x` (`[rows][k]`) times the output tiles `tn0..tn1` into `out`
/// (`[rows][16 (tn1 - tn0)]`, overwritten). Caller: AVX2, FMA, F16C available, lengths checked.
pub(super) unsafe fn matmul(
    shape: &Exl3Shape,
    trellis: *const u8,
    x: *const f32,
    rows: usize,
    tn0: usize,
    tn1: usize,
    out: &mut [f32],
) {
    let o = out.as_mut_ptr();
    let two = cuts(shape.rate).two;
    match (shape.codebook, two) {
        (Codebook::Inst3, false) => kernel::<INST3, false>(shape, trellis, x, rows, tn0, tn1, o),
        (Codebook::Inst3, true) => kernel::<INST3, true>(shape, trellis, x, rows, tn0, tn1, o),
        (Codebook::Mcg, false) => kernel::<MCG, false>(shape, trellis, x, rows, tn0, tn1, o),
        (Codebook::Mcg, true) => kernel::<MCG, true>(shape, trellis, x, rows, tn0, tn1, o),
        (Codebook::Mul1, false) => kernel::<MUL1, false>(shape, trellis, x, rows, tn0, tn1, o),
        (Codebook::Mul1, true) => kernel::<MUL1, true>(shape, trellis, x, rows, tn0, tn1, o),
    }
}

/// One group of up to 16 rows of [`super::Int16Rows`]: `[tiles_k][8][rows]` activation dwords
/// (rows `2 rp`, `2 rp + 1` of a tile row), `[tiles_k][rows]` scales, `[rows]` biases.
pub(super) struct Int16Group {
    pub xq: *const u32,
    pub sc: *const f32,
    pub bias: *const f32,
    pub rows: usize,
}

/// The int16 kernel (see `int16.rs`): per tile and row the integer sums of `s * xq` (one
/// `vpmaddwd` per pair of groups, the two rows of a column in a dword), folded to the 16 columns
/// with two horizontal adds, then `fma(sum, scale, acc)` down `k` and `fma(acc, A, bias)`, the
/// scalar twin's order, so the result is its bits.
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel_int16<const TWO: bool>(
    shape: &Exl3Shape,
    trellis: *const u8,
    x: &Int16Group,
    tn0: usize,
    tn1: usize,
    out: *mut f32,
) {
    let cuts = cuts(shape.rate);
    let (rows, cols) = (x.rows, tn1 - tn0);
    let width = 16 * cols;
    let mut stager = Stager::new(shape, trellis, tn0, tn1);
    // acc[(m * cols + tn) * 2 ..]: columns [0-3 | 8-11] and [4-7 | 12-15].
    let mut acc = vec![_mm256_setzero_ps(); rows * cols * 2];
    let mut xs = [[_mm256_setzero_si256(); 4]; super::MAX_ROWS];
    let mut sums = [_mm256_setzero_si256(); 16];
    for tk in 0..shape.tiles_k() {
        for m in 0..rows {
            for g in 0..4 {
                let d = x.xq.add((tk * 8 + g) * rows + m);
                let pair = *d as u64 | (*d.add(4 * rows) as u64) << 32;
                xs[m][g] = _mm256_set1_epi64x(pair as i64);
            }
        }
        for tn in 0..cols {
            let buf = stager.take(tk * cols + tn);
            let mut q = [_mm256_setzero_si256(); 4];
            if rows == 1 {
                let xg = &xs[0];
                unroll16!(i => {
                    let s = mul1_sums(pair_states::<TWO>(buf, cuts, i));
                    q[i / 4] = _mm256_add_epi32(q[i / 4], _mm256_madd_epi16(s, xg[i % 4]));
                });
            } else {
                unroll16!(i => {
                    sums[i] = mul1_sums(pair_states::<TWO>(buf, cuts, i));
                });
            }
            for m in 0..rows {
                if rows > 1 {
                    let xg = &xs[m];
                    q = [_mm256_setzero_si256(); 4];
                    unroll16!(i => {
                        let p = _mm256_madd_epi16(sums[i], xg[i % 4]);
                        q[i / 4] = _mm256_add_epi32(q[i / 4], p);
                    });
                }
                let scale = _mm256_set1_ps(*x.sc.add(tk * rows + m));
                let a = &mut acc[(m * cols + tn) * 2..][..2];
                let u = _mm256_cvtepi32_ps(_mm256_hadd_epi32(q[0], q[1]));
                let v = _mm256_cvtepi32_ps(_mm256_hadd_epi32(q[2], q[3]));
                a[0] = _mm256_fmadd_ps(u, scale, a[0]);
                a[1] = _mm256_fmadd_ps(v, scale, a[1]);
            }
        }
    }
    let am = _mm256_set1_ps(MUL1_A);
    for m in 0..rows {
        let bias = _mm256_set1_ps(*x.bias.add(m));
        for tn in 0..cols {
            let a = &acc[(m * cols + tn) * 2..][..2];
            let (u, v) = (
                _mm256_fmadd_ps(a[0], am, bias),
                _mm256_fmadd_ps(a[1], am, bias),
            );
            let o = out.add(m * width + 16 * tn);
            _mm256_storeu_ps(o, _mm256_permute2f128_ps::<0x20>(u, v));
            _mm256_storeu_ps(o.add(8), _mm256_permute2f128_ps::<0x31>(u, v));
        }
    }
}

/// The int16 path's MUL1 kernel for one row group, into `out` (`[rows][16 (tn1 - tn0)]`).
/// Caller: AVX2 and FMA available, the layer MUL1, lengths checked.
pub(super) unsafe fn matmul_int16(
    shape: &Exl3Shape,
    trellis: *const u8,
    x: &Int16Group,
    tn0: usize,
    tn1: usize,
    out: *mut f32,
) {
    if cuts(shape.rate).two {
        kernel_int16::<true>(shape, trellis, x, tn0, tn1, out)
    } else {
        kernel_int16::<false>(shape, trellis, x, tn0, tn1, out)
    }
}
