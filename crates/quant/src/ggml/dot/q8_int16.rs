//! Q8_0 rows against int16 activations: the decode path beside the exact f32 one.
//!
//! The exact path turns every int8 weight into an f32 (a widening, a conversion and a scale
//! multiply) before its FMA, which at 8 activation rows is about a third of its vector work. Here
//! each activation block of 32 is rounded to int16 with one scale (its largest magnitude maps to
//! 32767), a block's int8 x int16 products are summed exactly in int32 by AVX-512 VNNI
//! `vpdpwssd`, and one f32 FMA a block applies both scales. What it leaves out is the activations'
//! rounding, at most 2^-16 of each block's largest value.
//!
//! Layout: a tile takes 8 weight rows; their blocks are widened to int16 and transposed by
//! 64-bit pieces, so that vector `j` holds values `4j..4j + 4` of every row (row `r` in lanes
//! `2r`, `2r + 1`) and meets the activation's same four values broadcast. Each row thus keeps two
//! running sums (lane `2r`: its even pairs of values, lane `2r + 1`: its odd pairs), added once at
//! the end. [`dot_q8_0_int16_scalar`] does the same arithmetic in the same order, bit for bit;
//! rows past the last whole tile run through it.
#![allow(clippy::needless_range_loop)]

use half::f16;

/// Values per Q8_0 block, and per activation scale.
const QK: usize = 32;
/// Bytes per Q8_0 block: an fp16 scale, then 32 signed bytes.
const QB: usize = 34;

/// Activation rows quantized for the Q8_0 int16 path: `n` rows of `cols` (whole blocks of 32).
pub struct Int16Acts {
    n: usize,
    cols: usize,
    /// `[n][cols]`, each value `round(x / scale)` of its block.
    q: Vec<i16>,
    /// `[n][cols / 32]`: each block's largest magnitude / 32767.
    scale: Vec<f32>,
}

impl Int16Acts {
    /// Quantizes `n` rows of `cols` values (a multiple of 32), `x`: `[n][cols]`. A non-finite value
    /// makes its block's scale non-finite, so every dot with it is NaN, as an exact dot with an
    /// infinity or NaN is not finite either.
    pub fn new(x: &[f32], n: usize, cols: usize) -> Int16Acts {
        assert_eq!(
            x.len(),
            n * cols,
            "int16 activations: x must hold n × cols values"
        );
        assert!(
            cols.is_multiple_of(QK),
            "int16 activations: cols must be whole blocks"
        );
        let mut q = vec![0i16; n * cols];
        let mut scale = vec![0f32; n * cols / QK];
        for ((xb, qb), s) in x
            .chunks_exact(QK)
            .zip(q.chunks_exact_mut(QK))
            .zip(scale.iter_mut())
        {
            // The largest magnitude by the bit patterns (ordered as the values are, for
            // non-negative floats), a form that vectorizes.
            let amax_bits = xb
                .iter()
                .fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
            let amax = f32::from_bits(amax_bits);
            *s = amax / 32767.0;
            // Below 1e-30 the reciprocal could overflow; such a block adds nothing an f32
            // result keeps beside any normal-sized one.
            if amax < 1e-30 || amax_bits >= 0x7f80_0000 {
                continue;
            }
            let inv = 32767.0 / amax;
            for (o, &v) in qb.iter_mut().zip(xb) {
                *o = round_to_i16(v * inv);
            }
        }
        Int16Acts { n, cols, q, scale }
    }

    /// Activation rows.
    pub fn rows(&self) -> usize {
        self.n
    }

    /// Values per row.
    pub fn cols(&self) -> usize {
        self.cols
    }
}

/// `v` (|v| <= 32767.5) rounded to the nearest integer, ties to even: adding 1.5 · 2^23 leaves
/// the integer in the mantissa's low bits (the cast that would do it in one step is a saturating
/// one, which does not vectorize).
#[inline(always)]
fn round_to_i16(v: f32) -> i16 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23
    ((v + MAGIC).to_bits() as i32 - MAGIC.to_bits() as i32).clamp(-32767, 32767) as i16
}

/// Whether this machine runs the SIMD kernel (AVX-512 F/BW/VL with VNNI, and F16C).
pub fn q8_0_int16_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Checks the shapes of `m` Q8_0 rows against `x`; returns the bytes per row.
fn row_bytes(rows: &[u8], m: usize, x: &Int16Acts) -> usize {
    let rb = x.cols / QK * QB;
    assert_eq!(
        Some(rows.len()),
        m.checked_mul(rb),
        "q8_0 int16: {m} rows of {} values need {} bytes",
        x.cols,
        m * rb
    );
    rb
}

/// Rows `i0..i0 + count` of the scalar arithmetic, writing `out[t * ld + i]`.
///
/// # Safety
/// `out` is valid for those writes.
unsafe fn scalar_rows(
    rows: &[u8],
    rb: usize,
    i0: usize,
    count: usize,
    x: &Int16Acts,
    out: *mut f32,
    ld: usize,
) {
    let nb = x.cols / QK;
    for i in i0..i0 + count {
        let row = &rows[i * rb..(i + 1) * rb];
        for t in 0..x.n {
            let xq = &x.q[t * x.cols..(t + 1) * x.cols];
            let xs = &x.scale[t * nb..(t + 1) * nb];
            // Lane 2r (even pairs) and lane 2r + 1 (odd pairs) of the SIMD tile.
            let mut acc = [0f32; 2];
            for b in 0..nb {
                let blk = &row[b * QB..(b + 1) * QB];
                let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                let mut sum = [0i32; 2];
                for k in 0..QK {
                    // Values 4j + {0, 1} form pair 2j (even), 4j + {2, 3} pair 2j + 1 (odd).
                    let lane = (k / 2) % 2;
                    sum[lane] += i32::from(blk[2 + k] as i8) * i32::from(xq[b * QK + k]);
                }
                let s = d * xs[b];
                for l in 0..2 {
                    acc[l] = (sum[l] as f32).mul_add(s, acc[l]);
                }
            }
            *out.add(t * ld + i) = acc[0] + acc[1];
        }
    }
}

/// The exact twin of [`dot_q8_0_int16_to`]: the same sums in the same order, on any CPU.
/// `out[t * m + i]` for weight row `i` of `rows` (`m` Q8_0 rows) and activation row `t`.
pub fn dot_q8_0_int16_scalar(rows: &[u8], m: usize, x: &Int16Acts, out: &mut [f32]) {
    let rb = row_bytes(rows, m, x);
    assert_eq!(out.len(), m * x.n, "q8_0 int16: out must hold m × n values");
    // SAFETY: out holds n × m values, written at t * m + i.
    unsafe { scalar_rows(rows, rb, 0, m, x, out.as_mut_ptr(), m) }
}

/// `out[t * ld + i] = Σ_c w[i][c] · x[t][c]` for the `m` Q8_0 rows of `rows` and every row of
/// `x`, on the SIMD kernel for whole tiles of 8 rows and the scalar twin for the rest.
///
/// # Safety
/// [`q8_0_int16_available`] is true; `out` is valid for writes at `t * ld + i` for every
/// `t < x.rows()`, `i < m`, and nothing else accesses them during the call; `ld >= m` when
/// `x.rows() > 1`.
pub unsafe fn dot_q8_0_int16_to(rows: &[u8], m: usize, x: &Int16Acts, out: *mut f32, ld: usize) {
    let rb = row_bytes(rows, m, x);
    #[cfg(target_arch = "x86_64")]
    let whole = m / 8 * 8;
    #[cfg(not(target_arch = "x86_64"))]
    let whole = 0;
    #[cfg(target_arch = "x86_64")]
    for i0 in (0..whole).step_by(8) {
        let mut t0 = 0;
        while t0 < x.n {
            let nr = (x.n - t0).min(8);
            avx512::tile(
                rows.as_ptr().add(i0 * rb),
                rb,
                x,
                t0,
                nr,
                out.add(t0 * ld + i0),
                ld,
            );
            t0 += nr;
        }
    }
    scalar_rows(rows, rb, whole, m - whole, x, out, ld);
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Int16Acts, QB, QK};
    use crate::x86::dpwssd;
    use core::arch::x86_64::*;

    /// Rows `2r`, `2r + 1` of each 128-bit lane pair: 64-bit pieces `j` of `a` and `b`
    /// interleaved (`unpacklo/hi_epi64` per 128-bit lane).
    #[inline(always)]
    unsafe fn unpack64(a: __m512i, b: __m512i) -> (__m512i, __m512i) {
        (_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b))
    }

    /// 8 rows (`w`, stride `rb`) against activation rows `t0..t0 + nr` of `x`, writing
    /// `out[t * ld + i]` (out already offset to row `t0`, weight row 0).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn tile(
        w: *const u8,
        rb: usize,
        x: &Int16Acts,
        t0: usize,
        nr: usize,
        out: *mut f32,
        ld: usize,
    ) {
        macro_rules! go {
            ($nr:literal) => {
                tile_n::<$nr>(w, rb, x, t0, out, ld)
            };
        }
        match nr {
            1 => go!(1),
            2 => go!(2),
            3 => go!(3),
            4 => go!(4),
            5 => go!(5),
            6 => go!(6),
            7 => go!(7),
            8 => go!(8),
            _ => unreachable!("tiles take 1..=8 activation rows"),
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile_n<const NR: usize>(
        w: *const u8,
        rb: usize,
        x: &Int16Acts,
        t0: usize,
        out: *mut f32,
        ld: usize,
    ) {
        let nb = x.cols / QK;
        let xq = x.q.as_ptr().add(t0 * x.cols);
        let xs = x.scale.as_ptr().add(t0 * nb);
        // Lane 2r + l of each sum: row r's scale.
        let dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        let mut acc = [_mm512_setzero_ps(); NR];
        for b in 0..nb {
            let wb = w.add(b * QB);
            // The hardware prefetchers do not follow 8 interleaved row streams well: fetch this
            // block of the next tile's rows into L2 (past the matrix end, a harmless prefetch).
            for r in 8..16 {
                _mm_prefetch::<_MM_HINT_T1>(wb.wrapping_add(r * rb).cast());
            }
            // The 8 rows' fp16 scales, packed by integer shifts (off the vector ports).
            let mut lo = 0u64;
            let mut hi = 0u64;
            for r in 0..4 {
                lo |= u64::from(wb.add(r * rb).cast::<u16>().read_unaligned()) << (16 * r);
                hi |= u64::from(wb.add((r + 4) * rb).cast::<u16>().read_unaligned()) << (16 * r);
            }
            let d8 = _mm256_cvtph_ps(_mm_set_epi64x(hi as i64, lo as i64));
            let d = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(d8));
            // Row r widened to int16: 64-bit piece j holds its values 4j..4j + 4.
            let mut rr = [_mm512_setzero_si512(); 8];
            for r in 0..8 {
                rr[r] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(wb.add(r * rb + 2).cast()));
            }
            // Transpose 8 x 8 pieces: v[j] holds piece j of rows 0..8 in order.
            let (a0, a1) = unpack64(rr[0], rr[1]);
            let (a2, a3) = unpack64(rr[2], rr[3]);
            let (a4, a5) = unpack64(rr[4], rr[5]);
            let (a6, a7) = unpack64(rr[6], rr[7]);
            // a0: 128-bit lane k = (row0, row1) piece 2k; a1: piece 2k + 1; likewise a2/a3 for
            // rows 2, 3 and so on. Gather lanes: rows 0-3 of pieces {0, 4} / {2, 6} ...
            let b0 = _mm512_shuffle_i64x2::<0b10_00_10_00>(a0, a2); // pieces 0,4 | 0,4 of rows01,23
            let b1 = _mm512_shuffle_i64x2::<0b11_01_11_01>(a0, a2); // pieces 2,6
            let b2 = _mm512_shuffle_i64x2::<0b10_00_10_00>(a1, a3); // pieces 1,5
            let b3 = _mm512_shuffle_i64x2::<0b11_01_11_01>(a1, a3); // pieces 3,7
            let b4 = _mm512_shuffle_i64x2::<0b10_00_10_00>(a4, a6);
            let b5 = _mm512_shuffle_i64x2::<0b11_01_11_01>(a4, a6);
            let b6 = _mm512_shuffle_i64x2::<0b10_00_10_00>(a5, a7);
            let b7 = _mm512_shuffle_i64x2::<0b11_01_11_01>(a5, a7);
            // b0 lanes: [r01 p0, r01 p4, r23 p0, r23 p4]; b4 the same for rows 4-7.
            let v = [
                _mm512_shuffle_i64x2::<0b10_00_10_00>(b0, b4), // piece 0: r01 r23 r45 r67
                _mm512_shuffle_i64x2::<0b10_00_10_00>(b2, b6), // piece 1
                _mm512_shuffle_i64x2::<0b10_00_10_00>(b1, b5), // piece 2
                _mm512_shuffle_i64x2::<0b10_00_10_00>(b3, b7), // piece 3
                _mm512_shuffle_i64x2::<0b11_01_11_01>(b0, b4), // piece 4
                _mm512_shuffle_i64x2::<0b11_01_11_01>(b2, b6), // piece 5
                _mm512_shuffle_i64x2::<0b11_01_11_01>(b1, b5), // piece 6
                _mm512_shuffle_i64x2::<0b11_01_11_01>(b3, b7), // piece 7
            ];
            for t in 0..NR {
                let xb = xq.add(t * x.cols + b * QK);
                // Two chains of exact integer sums: half the latency of one.
                let mut s = [_mm512_setzero_si512(); 2];
                for j in 0..8 {
                    let xj = _mm512_set1_epi64(xb.add(4 * j).cast::<i64>().read_unaligned());
                    s[j % 2] = dpwssd(s[j % 2], v[j], xj);
                }
                let s = _mm512_add_epi32(s[0], s[1]);
                let sc = _mm512_mul_ps(d, _mm512_set1_ps(*xs.add(t * nb + b)));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc[t]);
            }
        }
        // Lane 2r + 1 added to lane 2r, then the even lanes in row order.
        let even = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 12, 10, 8, 6, 4, 2, 0);
        for t in 0..NR {
            let swapped = _mm512_permute_ps::<0b10_11_00_01>(acc[t]);
            let sum = _mm512_add_ps(acc[t], swapped);
            let rows = _mm512_castps512_ps256(_mm512_permutexvar_ps(even, sum));
            _mm256_storeu_ps(out.add(t * ld), rows);
        }
    }
}
