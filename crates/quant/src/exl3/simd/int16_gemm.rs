//! The int16 MUL1 path for many rows (prefill), beside [`super::int16`]'s tile kernels for few:
//! each 128-output band's weights are decoded once into their 16-bit byte sums `s`, less 510,
//! laid out as `vpdpwssd` reads them, and multiplied by the rotated activations quantized to int16
//! per 128 inputs. One `vpdpwssd` is 32 multiply-adds where an f32 FMA is 16, at the same rate (2
//! a cycle on Zen 5, measured), so this GEMM does twice the work per instruction of the f32 one
//! the exact path folds its weights for, and its weights need no Hadamards or scales folded in:
//! those run on the activations (in) and on the results (out).
//!
//! A row's result is `A sum_i xq_i sc_i (s_i - 510) + (510 A + B) sum_i xq_i sc_i`, which is
//! `sum_i xq_i sc_i (A s_i + B)`: MUL1's values before their fp16 rounding, as in
//! [`super::int16`]. With `|s - 510| <= 510` and `|xq| <= 32768`, a 128-input integer sum is at
//! most `128 * 32768 * 510 < 2^31`, so it is exact in int32; the sums of a row's 128-blocks are
//! then added in f32, each times its scale, in order of `k`. A row's arithmetic does not depend on
//! the other rows.
#![allow(clippy::needless_range_loop)]

use core::arch::x86_64::*;
use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::avx512::load_tile;
use super::int16::{byte_sums, products, quantize_block};
use super::{tables, Order, RateTables};
use crate::exl3::codebook::{Codebook, MUL1_A, MUL1_B, MUL1_MUL};
use crate::exl3::trellis::state;
use crate::exl3::Exl3Shape;
use crate::x86::dpwssd;

/// Inputs per activation scale, and per exact integer sum: one Hadamard block.
const KC: usize = 128;
/// Subtracted from every byte sum (0..=1020) so that 128 products fit an int32.
const CENTER: i16 = 510;
/// The bias per unit of a row's activation sum: `w = A (s - 510) + (510 A + B)`.
const CENTER_BIAS: f32 = MUL1_A * CENTER as f32 + MUL1_B;
/// Output tile columns a kernel call covers (4 x 16 outputs), half a 128-output band.
const COLS: usize = 4;
/// Activation rows a kernel call covers: `ROWS x COLS` int32 sums in registers.
const ROWS: usize = 6;

/// Activation rows for [`Panel::band`]: the rotated inputs as int16 per 128, row-major.
pub struct GemmRows {
    k: usize,
    rows: usize,
    /// `[rows][k]`.
    q: Vec<i16>,
    /// `[rows][k / 128]`: the scale of each 128.
    sc: Vec<f32>,
    /// `[rows]`: `510 A + B` times the row's sum of quantized activations (as the products meet
    /// them).
    bias: Vec<f32>,
}

impl GemmRows {
    /// Quantizes `rows` rows of `k` (a multiple of 128) values, `x`: `[rows][k]`, to int16 with
    /// one scale per 128 (their largest magnitude maps to 32767), the rows in parallel.
    pub fn new(x: &[f32], rows: usize, k: usize) -> GemmRows {
        assert_eq!(x.len(), rows * k);
        GemmRows::from_rows(rows, k, |r, row| {
            row.copy_from_slice(&x[r * k..(r + 1) * k])
        })
    }

    /// As [`GemmRows::new`], row `r`'s `k` values written by `fill(r, row)` (in parallel, into a
    /// buffer per thread), so that a row can be made and quantized while it is in L1.
    pub fn from_rows(rows: usize, k: usize, fill: impl Fn(usize, &mut [f32]) + Sync) -> GemmRows {
        assert_eq!(k % KC, 0, "EXL3 inputs are whole Hadamard blocks");
        let kbs = k / KC;
        let mut g = GemmRows {
            k,
            rows,
            q: vec![0; rows * k],
            sc: vec![0.0; rows * kbs],
            bias: vec![0.0; rows],
        };
        g.q.par_chunks_mut(k)
            .zip(g.sc.par_chunks_mut(kbs))
            .zip(g.bias.par_iter_mut())
            .enumerate()
            .for_each_init(
                || vec![0.0f32; k],
                |row, (r, ((q, sc), bias))| {
                    fill(r, row);
                    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
                    unsafe fn wide(q: &mut [i16], sc: &mut [f32], x: &[f32]) -> f32 {
                        quantize_row(q, sc, x)
                    }
                    *bias = if super::Level::Avx512.is_available() {
                        // SAFETY: AVX-512 is available.
                        unsafe { wide(q, sc, row) }
                    } else {
                        quantize_row(q, sc, row)
                    };
                },
            );
        g
    }
}

/// One row: its int16 values and scales; returns its bias.
#[inline(always)]
fn quantize_row(q: &mut [i16], sc: &mut [f32], x: &[f32]) -> f32 {
    let mut sum = 0.0f32;
    for ((q, sc), blk) in q.chunks_exact_mut(KC).zip(sc).zip(x.chunks_exact(KC)) {
        let (v, s) = quantize_block::<KC>(blk.try_into().unwrap());
        q.iter_mut().zip(&v).for_each(|(q, &v)| *q = v as i16);
        *sc = s;
        sum += v.iter().map(|&v| v as i16 as i32).sum::<i32>() as f32 * s;
    }
    CENTER_BIAS * sum
}

/// 32 int16 lanes on one cache line.
#[repr(C, align(64))]
struct Line([i16; 32]);

/// A layer's decoded weights for a run of 128-output bands: per band, per half (4 tile columns),
/// per input pair `p` (inputs `2p`, `2p + 1`), the 4 tile columns' lines: lane pair `c` of a line
/// holds `s - 510` of inputs `2p` and `2p + 1` at output `c`, as `vpdpwssd` pairs them.
pub struct Panel {
    k: usize,
    bands: usize,
    /// Every one written by [`Panel::new`].
    lines: Vec<MaybeUninit<Line>>,
}

impl Panel {
    /// Lines of one band half.
    fn half_lines(k: usize) -> usize {
        k / 2 * COLS
    }

    /// Bands `b0 .. b0 + bands` of a MUL1 layer decoded (in parallel, a task per band half).
    /// Panics unless the CPU has AVX-512 VNNI and VBMI2
    /// ([`super::int16_gemm_available`]).
    pub fn new(shape: &Exl3Shape, trellis: &[u8], b0: usize, bands: usize) -> Panel {
        assert!(super::int16::avx512_int16(), "no AVX-512 VNNI + VBMI2");
        assert_eq!(shape.codebook, Codebook::Mul1, "the int16 path is MUL1's");
        assert_eq!(trellis.len(), shape.trellis_bytes());
        assert!((b0 + bands) * 128 <= shape.n);
        let k = shape.k;
        let per = Self::half_lines(k);
        // Not zeroed first: `pack_half` writes every line.
        let mut lines: Vec<MaybeUninit<Line>> = Vec::with_capacity(2 * bands * per);
        lines.resize_with(2 * bands * per, MaybeUninit::uninit);
        let t = tables(shape.rate);
        lines.par_chunks_mut(per).enumerate().for_each(|(h, dst)| {
            let tn0 = b0 * 8 + h * COLS;
            // SAFETY: the features were checked; `dst` holds the half's `k / 2 * 4` lines,
            // and its tiles lie within `trellis`.
            unsafe {
                if t.big() {
                    pack_half::<true>(shape, trellis, t, tn0, dst)
                } else {
                    pack_half::<false>(shape, trellis, t, tn0, dst)
                }
            }
        });
        Panel { k, bands, lines }
    }

    /// Rows `r0..r1` of `x` times band `band` (of this panel), before the output Hadamard:
    /// `out` (`[r1 - r0][128]`) gets `fma(acc, A, bias)` per output, `acc` the chain of
    /// `fma(sum, scale, acc)` over the 128-input blocks.
    pub fn band(&self, x: &GemmRows, r0: usize, r1: usize, band: usize, out: &mut [f32]) {
        assert_eq!(x.k, self.k);
        assert!(band < self.bands && r0 <= r1 && r1 <= x.rows);
        assert_eq!(out.len(), (r1 - r0) * 128);
        let (k, kbs) = (self.k, self.k / KC);
        let per = Self::half_lines(k);
        for h in 0..2 {
            let lines = self.lines[(2 * band + h) * per..][..per]
                .as_ptr()
                .cast::<Line>();
            for kb in 0..kbs {
                let mut m = r0;
                while m < r1 {
                    let mr = (r1 - m).min(ROWS);
                    // SAFETY: the features were checked when the panel was made; rows m..m + mr
                    // of `x` and of `out`, the half's lines of block kb.
                    unsafe {
                        let q = x.q.as_ptr().add(m * k + kb * KC);
                        let sc = x.sc.as_ptr().add(m * kbs + kb);
                        let l = lines.add(kb * KC / 2 * COLS);
                        let o = out.as_mut_ptr().add((m - r0) * 128 + h * 64);
                        let bias = x.bias.as_ptr().add(m);
                        let ends = (kb == 0, kb + 1 == kbs);
                        match mr {
                            6 => block::<6>(q, k, sc, kbs, l, o, bias, ends),
                            5 => block::<5>(q, k, sc, kbs, l, o, bias, ends),
                            4 => block::<4>(q, k, sc, kbs, l, o, bias, ends),
                            3 => block::<3>(q, k, sc, kbs, l, o, bias, ends),
                            2 => block::<2>(q, k, sc, kbs, l, o, bias, ends),
                            _ => block::<1>(q, k, sc, kbs, l, o, bias, ends),
                        }
                    }
                    m += mr;
                }
            }
        }
    }
}

/// One band half (tile columns `tn0 .. tn0 + 4`, every tile row) into `dst`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi2,avx2,fma")]
unsafe fn pack_half<const BIG: bool>(
    shape: &Exl3Shape,
    trellis: &[u8],
    t: &RateTables,
    tn0: usize,
    dst: &mut [MaybeUninit<Line>],
) {
    let pairs = t.pairs(Order::Interleave);
    let center = _mm512_set1_epi16(CENTER);
    for tk in 0..shape.tiles_k() {
        for c in 0..COLS {
            let r = load_tile::<BIG>(shape.tile(trellis, tk, tn0 + c).as_ptr(), t);
            for (rp, pair) in pairs.iter().enumerate() {
                let (lo, hi) = products::<BIG>(&r, pair);
                let s = _mm512_sub_epi16(byte_sums(lo, hi), center);
                let line = &mut dst[(8 * tk + rp) * COLS + c];
                _mm512_store_si512(line.as_mut_ptr().cast(), s);
            }
        }
    }
}

/// `R` rows x 64 outputs over one 128-input block: the integer sums in registers, then
/// `o = fma(sum, scale, o)` (`o` taken as 0 on the first block; on the last, then
/// `o = fma(o, A, bias)`). `q`: the rows' int16 values at the block (row stride `k`); `sc`: their
/// scales at the block (row stride `kbs`); `l`: the half's lines at the block; `o`: the rows' 64
/// outputs (row stride 128); `bias`: the rows' biases; `(first, last)`: which blocks this is.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn block<const R: usize>(
    q: *const i16,
    k: usize,
    sc: *const f32,
    kbs: usize,
    l: *const Line,
    o: *mut f32,
    bias: *const f32,
    (first, last): (bool, bool),
) {
    let mut acc = [[_mm512_setzero_si512(); COLS]; R];
    for p in 0..KC / 2 {
        let lp = l.add(p * COLS);
        let b: [__m512i; COLS] = std::array::from_fn(|c| ld_line(&*lp.add(c)));
        for m in 0..R {
            let a = _mm512_set1_epi32(q.add(m * k + 2 * p).cast::<i32>().read_unaligned());
            for c in 0..COLS {
                acc[m][c] = dpwssd(acc[m][c], b[c], a);
            }
        }
    }
    for m in 0..R {
        let s = _mm512_set1_ps(*sc.add(m * kbs));
        for c in 0..COLS {
            let d = o.add(m * 128 + 16 * c);
            let prev = if first {
                _mm512_setzero_ps()
            } else {
                _mm512_loadu_ps(d)
            };
            let mut v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][c]), s, prev);
            if last {
                v = _mm512_fmadd_ps(v, _mm512_set1_ps(MUL1_A), _mm512_set1_ps(*bias.add(m)));
            }
            _mm512_storeu_ps(d, v);
        }
    }
}

#[inline(always)]
unsafe fn ld_line(l: &Line) -> __m512i {
    _mm512_load_si512(l.0.as_ptr().cast())
}

/// The scalar twin of [`Panel::new`] + [`Panel::band`] for band `b` of the layer (absolute), in
/// the same order of operations, so the two agree bit for bit.
pub fn band_scalar(
    shape: &Exl3Shape,
    trellis: &[u8],
    x: &GemmRows,
    r0: usize,
    r1: usize,
    b: usize,
    out: &mut [f32],
) {
    assert_eq!(shape.codebook, Codebook::Mul1, "the int16 path is MUL1's");
    assert_eq!(x.k, shape.k);
    assert_eq!(out.len(), (r1 - r0) * 128);
    let kbs = shape.k / KC;
    // The centred byte sums of the band, `[k][128]`.
    let mut s = vec![0i32; shape.k * 128];
    for (i, row) in s.chunks_mut(128).enumerate() {
        for (c, v) in row.iter_mut().enumerate() {
            let tile = shape.tile(trellis, i / 16, b * 8 + c / 16);
            let p = super::ELEMENT_POSITION[16 * (i % 16) + c % 16] as u32;
            let h = (state(tile, shape.rate, p) as u32).wrapping_mul(MUL1_MUL);
            *v = h.to_le_bytes().iter().map(|&b| b as i32).sum::<i32>() - CENTER as i32;
        }
    }
    for m in r0..r1 {
        for c in 0..128 {
            let mut acc = 0.0f32;
            for kb in 0..kbs {
                let sum: i32 = (kb * KC..(kb + 1) * KC)
                    .map(|i| x.q[m * x.k + i] as i32 * s[i * 128 + c])
                    .sum();
                acc = (sum as f32).mul_add(x.sc[m * kbs + kb], acc);
            }
            out[(m - r0) * 128 + c] = acc.mul_add(MUL1_A, x.bias[m]);
        }
    }
}
