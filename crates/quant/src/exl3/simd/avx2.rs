//! AVX2 + FMA + F16C tile kernels: the 256 states cut from the stream 8 at a time (gathers of the
//! two words around each state's window, shifts by lane on 32-bit lanes), then the codebook
//! evaluated one tile row (16 states) per vector, the tile kept in f32 on the stack and
//! multiplied into up to four activation rows at a time, accumulating in `out`.
#![allow(clippy::needless_range_loop)]

use core::arch::x86_64::*;

use std::sync::OnceLock;

use super::{state_destinations, Order};
use crate::exl3::codebook::{Codebook, INST3_ADD, INST3_MUL, MCG_MUL, MUL1_A, MUL1_B, MUL1_MUL};
use crate::exl3::trellis::Bitrate;
use crate::exl3::Exl3Shape;

const INST3: u8 = 0;
const MCG: u8 = 1;
const MUL1: u8 = 2;

/// The position whose state each of the 256 slots holds (the inverse of [`state_destinations`]).
fn state_sources(order: Order) -> &'static [i32; 256] {
    static T: [OnceLock<[i32; 256]>; 2] = [OnceLock::new(), OnceLock::new()];
    T[order as usize].get_or_init(|| {
        let mut src = [0i32; 256];
        for (p, &slot) in state_destinations(order).iter().enumerate() {
            src[slot as usize] = p as i32;
        }
        src
    })
}

/// The states of 8 slots whose positions are `p`: the 16 stream bits ending at each position's
/// end bit (`(p + 1) K`, plus one per odd position before it at half rates), circularly, read
/// from the tile's big-endian words `w` (with its first two repeated past the end).
#[inline(always)]
unsafe fn states8(w: &[u32; 66], p: __m256i, ka: i32, half: i32, total: i32) -> __m256i {
    let p1 = _mm256_add_epi32(p, _mm256_set1_epi32(1));
    let end = _mm256_add_epi32(
        _mm256_mullo_epi32(p1, _mm256_set1_epi32(ka)),
        _mm256_and_si256(_mm256_srli_epi32::<1>(p1), _mm256_set1_epi32(-half)),
    );
    // end - 16, wrapped into the tile where it would start before bit 0.
    let wrap = _mm256_and_si256(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(16), end),
        _mm256_set1_epi32(total),
    );
    let start = _mm256_add_epi32(_mm256_sub_epi32(end, _mm256_set1_epi32(16)), wrap);
    let i = _mm256_srli_epi32::<5>(start);
    let sh = _mm256_and_si256(start, _mm256_set1_epi32(31));
    let base = w.as_ptr().cast::<i32>();
    let hi = _mm256_i32gather_epi32::<4>(base, i);
    let lo = _mm256_i32gather_epi32::<4>(base.add(1), i);
    // The 32 bits from `sh` bits into w[i] (a shift by 32 gives 0), then their top 16.
    let win = _mm256_or_si256(
        _mm256_sllv_epi32(hi, sh),
        _mm256_srlv_epi32(lo, _mm256_sub_epi32(_mm256_set1_epi32(32), sh)),
    );
    _mm256_srli_epi32::<16>(win)
}

/// The tile's 256 states in slot order (`src[slot]` is the slot's position).
#[inline(always)]
unsafe fn tile_states(tile: *const u8, rate: Bitrate, src: &[i32; 256], st: &mut [u16; 256]) {
    let total = rate.tile_bits() as i32;
    let n_words = total as usize / 32;
    let mut w = [0u32; 64 + 2];
    for i in 0..n_words {
        w[i] = u32::from_le(tile.add(4 * i).cast::<u32>().read_unaligned());
    }
    w[n_words] = w[0];
    w[n_words + 1] = w[1];
    let (ka, half) = (rate.floor() as i32, rate.is_half() as i32);
    for q in (0..256).step_by(16) {
        let a = states8(
            &w,
            _mm256_loadu_si256(src.as_ptr().add(q).cast()),
            ka,
            half,
            total,
        );
        let b = states8(
            &w,
            _mm256_loadu_si256(src.as_ptr().add(q + 8).cast()),
            ka,
            half,
            total,
        );
        // packus interleaves the 128-bit halves: a0-3 b0-3 a4-7 b4-7, put back in order.
        let ab = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(a, b));
        _mm256_storeu_si256(st.as_mut_ptr().add(q).cast(), ab);
    }
}

#[inline(always)]
unsafe fn c16(v: u32) -> __m256i {
    _mm256_set1_epi16(v as u16 as i16)
}

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

#[inline(always)]
unsafe fn round16(v: __m256) -> __m256 {
    _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
}

/// One tile row's 16 values (columns 0-7, 8-15) from its states in the codebook's lane order.
#[inline(always)]
unsafe fn values<const CB: u8>(x: __m256i) -> [__m256; 2] {
    if CB == MUL1 {
        let (lo, hi) = mul32(x, MUL1_MUL, None);
        let ones = _mm256_set1_epi8(1);
        let s = _mm256_add_epi16(
            _mm256_maddubs_epi16(lo, ones),
            _mm256_maddubs_epi16(hi, ones),
        );
        let magic = c16(0x4B00);
        let (scale, c) = (
            _mm256_set1_ps(MUL1_A),
            _mm256_set1_ps(MUL1_B - 8388608.0 * MUL1_A),
        );
        let f0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(s, magic));
        let f1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(s, magic));
        [
            round16(_mm256_fmadd_ps(f0, scale, c)),
            round16(_mm256_fmadd_ps(f1, scale, c)),
        ]
    } else {
        let (lo, hi) = if CB == INST3 {
            mul32(x, INST3_MUL, Some(INST3_ADD))
        } else {
            mul32(x, MCG_MUL, None)
        };
        let (mask, xor) = (c16(0x8FFF), c16(0x3B60));
        let lo = _mm256_xor_si256(_mm256_and_si256(lo, mask), xor);
        let hi = _mm256_xor_si256(_mm256_and_si256(hi, mask), xor);
        let a0 = _mm256_cvtph_ps(_mm256_castsi256_si128(lo));
        let a1 = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(lo));
        let b0 = _mm256_cvtph_ps(_mm256_castsi256_si128(hi));
        let b1 = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(hi));
        [
            round16(_mm256_add_ps(a0, b0)),
            round16(_mm256_add_ps(a1, b1)),
        ]
    }
}

#[inline(always)]
unsafe fn decode<const CB: u8>(tile: *const u8, rate: Bitrate, src: &[i32; 256], out: *mut f32) {
    let mut st = [0u16; 256];
    tile_states(tile, rate, src, &mut st);
    for r in 0..16 {
        let x = _mm256_loadu_si256(st.as_ptr().add(16 * r).cast());
        let w = values::<CB>(x);
        _mm256_storeu_ps(out.add(16 * r), w[0]);
        _mm256_storeu_ps(out.add(16 * r + 8), w[1]);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_inner<const CB: u8>(tile: *const u8, rate: Bitrate, out: &mut [f32; 256]) {
    let src = state_sources(if CB == MUL1 {
        Order::Unpack
    } else {
        Order::Linear
    });
    decode::<CB>(tile, rate, src, out.as_mut_ptr());
}

/// One tile to f32, row-major. Caller: AVX2, FMA, F16C available; `tile` has
/// `rate.tile_bytes()` bytes.
pub(super) unsafe fn decode_tile(
    tile: *const u8,
    rate: Bitrate,
    cb: Codebook,
    out: &mut [f32; 256],
) {
    match cb {
        Codebook::Inst3 => decode_inner::<INST3>(tile, rate, out),
        Codebook::Mcg => decode_inner::<MCG>(tile, rate, out),
        Codebook::Mul1 => decode_inner::<MUL1>(tile, rate, out),
    }
}

/// `M` activation rows (stride `k`) against one decoded tile `w`, accumulated into `out`
/// (stride `width`).
#[inline(always)]
unsafe fn rows_tile<const M: usize>(
    w: *const f32,
    x: *const f32,
    k: usize,
    out: *mut f32,
    width: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; M];
    for m in 0..M {
        acc[m][0] = _mm256_loadu_ps(out.add(m * width));
        acc[m][1] = _mm256_loadu_ps(out.add(m * width + 8));
    }
    for r in 0..16 {
        let (w0, w1) = (
            _mm256_loadu_ps(w.add(16 * r)),
            _mm256_loadu_ps(w.add(16 * r + 8)),
        );
        for m in 0..M {
            let xv = _mm256_broadcast_ss(&*x.add(m * k + r));
            acc[m][0] = _mm256_fmadd_ps(xv, w0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(xv, w1, acc[m][1]);
        }
    }
    for m in 0..M {
        _mm256_storeu_ps(out.add(m * width), acc[m][0]);
        _mm256_storeu_ps(out.add(m * width + 8), acc[m][1]);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kernel<const CB: u8>(
    shape: &Exl3Shape,
    trellis: *const u8,
    x: *const f32,
    rows: usize,
    tn0: usize,
    tn1: usize,
    out: *mut f32,
) {
    let src = state_sources(if CB == MUL1 {
        Order::Unpack
    } else {
        Order::Linear
    });
    let (k, width, tb) = (shape.k, 16 * (tn1 - tn0), shape.rate.tile_bytes());
    let mut w = [0.0f32; 256];
    for tk in 0..shape.tiles_k() {
        for tn in tn0..tn1 {
            let tile = trellis.add((tk * shape.tiles_n() + tn) * tb);
            decode::<CB>(tile, shape.rate, src, w.as_mut_ptr());
            let mut m0 = 0;
            while m0 < rows {
                let xs = x.add(m0 * k + 16 * tk);
                let o = out.add(m0 * width + 16 * (tn - tn0));
                match rows - m0 {
                    1 => rows_tile::<1>(w.as_ptr(), xs, k, o, width),
                    2 => rows_tile::<2>(w.as_ptr(), xs, k, o, width),
                    3 => rows_tile::<3>(w.as_ptr(), xs, k, o, width),
                    _ => rows_tile::<4>(w.as_ptr(), xs, k, o, width),
                }
                m0 += 4;
            }
        }
    }
}

/// `rows` activation rows `x` (`[rows][k]`) times the output tiles `tn0..tn1` into `out`
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
    out.fill(0.0);
    let o = out.as_mut_ptr();
    match shape.codebook {
        Codebook::Inst3 => kernel::<INST3>(shape, trellis, x, rows, tn0, tn1, o),
        Codebook::Mcg => kernel::<MCG>(shape, trellis, x, rows, tn0, tn1, o),
        Codebook::Mul1 => kernel::<MUL1>(shape, trellis, x, rows, tn0, tn1, o),
    }
}
