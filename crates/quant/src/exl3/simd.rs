//! Run-time dispatch of the EXL3 tile kernels, and the per-bitrate index tables they share.
//!
//! The SIMD paths decode each 16x16 tile in registers, straight from its bitstream, and
//! multiply in the same pass: the tile's 16-bit states are cut from the stream with 16-bit
//! permutes and variable shifts (AVX-512), or 8 stream positions at a time from 64-bit loads
//! and variable shifts (AVX2), the codebook is computed in integer and f16/f32 arithmetic to the
//! scalar codec's exact fp16 value (bit for bit, see `tests/exl3_simd.rs`), and the values meet
//! the activations of their rows (AVX-512: a tile row of 16 columns per broadcast activation;
//! AVX2: in stream order, see `simd/avx2.rs`). Every tile is decoded once for up to 16
//! activation rows.
//!
//! The levels are those of the ggml dot kernels ([`Level`]): AVX-512 F/BW/VL, AVX2 + FMA +
//! F16C, and the scalar table-lookup path.

use std::sync::OnceLock;

pub use crate::ggml::dot::{available_levels, best_level, Level};

use super::codebook::{self, Codebook};
use super::trellis::{decode_tile_f32, Bitrate, POSITION_INDEX};
use super::Exl3Shape;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod int16;
#[cfg(target_arch = "x86_64")]
mod int16_gemm;
#[cfg(target_arch = "x86_64")]
pub use int16::{
    int16_available, int16_levels, matmul_inner_int16, matmul_inner_int16_scalar,
    matmul_inner_int16_with, Int16Rows,
};
#[cfg(target_arch = "x86_64")]
pub use int16_gemm::{band_scalar as int16_band_scalar, GemmRows, Panel};

/// Whether this machine runs the int16 GEMM ([`Panel`]): AVX-512 with VNNI and VBMI2. (AVX2's
/// `vpmaddwd` + `vpaddd` does no more multiply-adds an instruction than an f32 FMA, so there the
/// exact GEMM stays.)
pub fn int16_gemm_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    return int16::avx512_int16();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Activation rows handled per decoded tile.
pub const MAX_ROWS: usize = 16;

/// How a codebook's kernel lays one tile row's 16 states out in 16-bit lanes so that its
/// widening steps land column `c` in f32 lane `c`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Order {
    /// Columns in order (the f16 conversions take the low and high halves as they are).
    Linear,
    /// Per 128-bit block of eight lanes, four columns of the first row then four of the second
    /// (16-bit to 32-bit `unpacklo`/`unpackhi`): MUL1's path.
    Unpack,
    /// Column `c` of both rows in the 32-bit lane `c` (first row low): the int16 path's
    /// `vpdpwssd` sums a lane's two 16-bit products, so both rows of a column land in its
    /// accumulator lane.
    Interleave,
}

impl Order {
    pub(crate) fn of(cb: Codebook) -> Order {
        match cb {
            Codebook::Mul1 => Order::Unpack,
            Codebook::Inst3 | Codebook::Mcg => Order::Linear,
        }
    }

    /// The (row offset 0/1, column) that 16-bit lane `lane` (0..32) of a row-pair vector holds.
    fn lane_element(self, lane: usize) -> (usize, usize) {
        match self {
            Order::Linear => (lane >> 4, lane & 15),
            Order::Unpack => ((lane >> 2) & 1, 4 * (lane >> 3) + (lane & 3)),
            Order::Interleave => (lane & 1, lane >> 1),
        }
    }
}

/// For one pair of tile rows `(2 rp, 2 rp + 1)`: per 16-bit lane, the memory indices (in
/// int16 units of the tile) of the two stream units its state straddles, and the shifts.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct PairIdx {
    pub hi: [u16; 32],
    pub lo: [u16; 32],
    /// `2^shift`: the state is `lo16(hi * pow) | hi16(lo * pow)` (a multiply rather than a
    /// variable shift pair, which the compiler would guard against shift counts of 16).
    pub pow: [u16; 32],
    /// The same shift as a count, for the VBMI2 funnel shift `vpshldvw`.
    pub shift: [u16; 32],
    /// Lanes whose `hi`/`lo` unit is in the tile's upper 64 units (bit 6 of the index).
    pub hi_sel: u32,
    pub lo_sel: u32,
}

/// Everything that depends only on the bitrate (and the codebook's lane order).
pub(crate) struct RateTables {
    /// int16 units in a tile.
    pub units: usize,
    /// Masked-load masks for the four 32-unit registers of a tile.
    pub masks: [u32; 4],
    /// Row pairs, per [`Order`] (Linear, Unpack, Interleave).
    pub pairs: [[PairIdx; 8]; 3],
}

impl RateTables {
    pub(crate) fn pairs(&self, order: Order) -> &[PairIdx; 8] {
        &self.pairs[order as usize]
    }

    /// More than 64 units: states need the upper two registers too.
    pub(crate) fn big(&self) -> bool {
        self.units > 64
    }
}

/// Position of the tile element `(row, col)` in the stream (inverse of `POSITION_INDEX`).
const ELEMENT_POSITION: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut p = 0;
    while p < 256 {
        t[POSITION_INDEX[p] as usize] = p as u8;
        p += 1;
    }
    t
};

fn build(rate: Bitrate) -> RateTables {
    let total = rate.tile_bits();
    let units = total as usize / 16;
    let mut masks = [0u32; 4];
    for (j, m) in masks.iter_mut().enumerate() {
        let avail = units.saturating_sub(32 * j).min(32);
        *m = ((1u64 << avail) - 1) as u32;
    }
    let empty = PairIdx {
        hi: [0; 32],
        lo: [0; 32],
        pow: [0; 32],
        shift: [0; 32],
        hi_sel: 0,
        lo_sel: 0,
    };
    let mut pairs = [[empty; 8]; 3];
    for (oi, order) in [Order::Linear, Order::Unpack, Order::Interleave]
        .into_iter()
        .enumerate()
    {
        for (rp, pair) in pairs[oi].iter_mut().enumerate() {
            for lane in 0..32 {
                let (dr, c) = order.lane_element(lane);
                let p = ELEMENT_POSITION[(2 * rp + dr) * 16 + c] as u32;
                let start = (rate.end_bit(p) + total - 16) % total;
                let a = start as usize / 16;
                // Stream unit `u` is int16 `u ^ 1` in memory (word halves swapped).
                let hi = a ^ 1;
                let lo = ((a + 1) % units) ^ 1;
                pair.hi[lane] = hi as u16;
                pair.lo[lane] = lo as u16;
                pair.pow[lane] = 1 << (start % 16);
                pair.shift[lane] = (start % 16) as u16;
                pair.hi_sel |= ((hi >> 6) as u32 & 1) << lane;
                pair.lo_sel |= ((lo >> 6) as u32 & 1) << lane;
            }
        }
    }
    RateTables {
        units,
        masks,
        pairs,
    }
}

/// The tables of a bitrate, built on first use.
pub(crate) fn tables(rate: Bitrate) -> &'static RateTables {
    static T: [OnceLock<Box<RateTables>>; 17] = [const { OnceLock::new() }; 17];
    let i = (2.0 * rate.bits()) as usize;
    T[i].get_or_init(|| Box::new(build(rate)))
}

/// One tile decoded to f32, row-major `[in 16][out 16]`, on a chosen level: the values are the
/// scalar codec's fp16 values exactly. Panics if the machine lacks the level.
pub fn decode_tile_with(
    level: Level,
    tile: &[u8],
    rate: Bitrate,
    cb: Codebook,
    out: &mut [f32; 256],
) {
    assert_eq!(tile.len(), rate.tile_bytes());
    assert!(
        level.is_available(),
        "exl3: this CPU lacks {}",
        level.name()
    );
    match level {
        Level::Scalar => decode_tile_f32(tile, rate, codebook::table(cb), out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the features were checked; the tile has `rate.tile_bytes()` bytes.
        Level::Avx512 => unsafe {
            avx512::decode_tile::<false>(tile.as_ptr(), rate, cb, out.as_mut_ptr(), 16)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Level::Avx2 => unsafe { avx2::decode_tile(tile.as_ptr(), rate, cb, out.as_mut_ptr(), 16) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!(),
    }
}

/// Asks for `bytes` to be brought into the cache (a hint; nothing elsewhere).
#[inline]
pub fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch of an address inside a live slice; it reads nothing.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast(),
            )
        };
    }
}

/// One tile decoded exactly (as [`decode_tile_with`] on the best level), then the unscaled
/// 16-point Hadamard butterfly down its rows (the first four stages of a 128-point one over
/// `k`), into 16 rows of 16 values: row `r` is `out[r * stride..][..16]`.
pub fn decode_tile_rows_h16(
    tile: &[u8],
    rate: Bitrate,
    cb: Codebook,
    out: &mut [f32],
    stride: usize,
) {
    assert_eq!(tile.len(), rate.tile_bytes());
    assert!(stride >= 16 && out.len() >= 15 * stride + 16);
    #[cfg(target_arch = "x86_64")]
    if best_level() == Level::Avx512 {
        // SAFETY: the features were checked; the tile has `rate.tile_bytes()` bytes and `out`
        // room for 16 rows of 16 `stride` apart.
        return unsafe {
            avx512::decode_tile::<true>(tile.as_ptr(), rate, cb, out.as_mut_ptr(), stride)
        };
    }
    let mut t = [0.0f32; 256];
    decode_tile_with(best_level(), tile, rate, cb, &mut t);
    let mut h = 1;
    while h < 16 {
        for a in (0..16).step_by(2 * h) {
            for j in a..a + h {
                for c in 0..16 {
                    let (p, q) = (t[16 * j + c], t[16 * (j + h) + c]);
                    t[16 * j + c] = p + q;
                    t[16 * (j + h) + c] = p - q;
                }
            }
        }
        h *= 2;
    }
    for r in 0..16 {
        out[r * stride..r * stride + 16].copy_from_slice(&t[16 * r..16 * r + 16]);
    }
}

/// [`super::matmul_inner`] on a chosen level. Panics if the machine lacks it.
#[allow(clippy::too_many_arguments)]
pub fn matmul_inner_with(
    level: Level,
    shape: &Exl3Shape,
    trellis: &[u8],
    xh: &[f32],
    m: usize,
    tn0: usize,
    tn1: usize,
    out: &mut [f32],
) {
    let k = shape.k;
    let width = 16 * (tn1 - tn0);
    assert!(tn0 <= tn1 && tn1 <= shape.tiles_n());
    assert_eq!(xh.len(), m * k);
    assert_eq!(out.len(), m * width);
    assert_eq!(trellis.len(), shape.trellis_bytes());
    assert!(
        level.is_available(),
        "exl3: this CPU lacks {}",
        level.name()
    );
    match level {
        Level::Scalar => super::kernel::matmul_inner_scalar(shape, trellis, xh, m, tn0, tn1, out),
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 | Level::Avx2 => {
            let mut r0 = 0;
            while r0 < m {
                let rows = (m - r0).min(MAX_ROWS);
                let o = &mut out[r0 * width..(r0 + rows) * width];
                let x = &xh[r0 * k..(r0 + rows) * k];
                // SAFETY: features checked above; `x` holds `rows` rows of `k`, `o` holds
                // `rows` rows of `width`, and every tile index is within `trellis`.
                unsafe {
                    if level == Level::Avx512 {
                        avx512::matmul(shape, trellis.as_ptr(), x.as_ptr(), rows, tn0, tn1, o);
                    } else {
                        avx2::matmul(shape, trellis.as_ptr(), x.as_ptr(), rows, tn0, tn1, o);
                    }
                }
                r0 += rows;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!(),
    }
}
