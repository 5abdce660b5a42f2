//! Fused dequantize + dot: stored rows of a ggml block type against f32 activation rows, without
//! materializing the decoded weights.
//!
//! Numerics: every weight is decoded exactly, to the value [`super::dequantize`] gives (up to the
//! sign of a zero weight): the SIMD paths either convert the integer quants and scale them, or
//! look them up in a per-block table of `scale * q + offset` whose entries are computed with the
//! same single rounding as the reference. The bit-packed and grid formats (Q2_K, Q3_K, Q5_K and
//! the 2- and 3-bit i-quants) are first unpacked per block into signed bytes and sub-block scales
//! (`unpack`). Products and sums are f32, in a different order than a plain sequential dot
//! (several lanes), so results match an exact dot to f32 rounding: below 1e-6 of `Σ|w·x|` in the
//! tests, for rows of up to a few thousand values. The order is the same whatever the call's
//! numbers of weight and activation rows: a row's result is bit for bit what it is alone.
//!
//! Paths: AVX-512 (F/BW/VL, with FMA and F16C), AVX2 (with FMA and F16C), and a portable scalar
//! path (the only one off x86-64). The best available one is detected once; [`dot_block_with`]
//! forces one (tests use it to cover every path the machine has).

use std::sync::OnceLock;

use super::GgmlType;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod unpack;

/// An instruction-set level the kernels are compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// Portable Rust, no explicit SIMD.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512 F/BW/VL (+ AVX2, FMA, F16C).
    Avx512,
}

impl Level {
    /// Every level, slowest first.
    pub const ALL: [Level; 3] = [Level::Scalar, Level::Avx2, Level::Avx512];

    pub fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
        }
    }

    /// Whether this machine can run the level (detected at run time, not cached).
    pub fn is_available(self) -> bool {
        match self {
            Level::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => {
                Level::Avx2.is_available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Level::Avx2 | Level::Avx512 => false,
        }
    }
}

/// The fastest level this machine supports (detected on first use, then cached).
pub fn best_level() -> Level {
    static BEST: OnceLock<Level> = OnceLock::new();
    *BEST.get_or_init(|| {
        Level::ALL
            .into_iter()
            .rev()
            .find(|l| l.is_available())
            .unwrap_or(Level::Scalar)
    })
}

/// Every level this machine supports, slowest first.
pub fn available_levels() -> Vec<Level> {
    Level::ALL
        .into_iter()
        .filter(|l| l.is_available())
        .collect()
}

/// Whether the dot kernels handle `ty` (the same types [`super::dequantize`] decodes).
pub fn is_supported(ty: GgmlType) -> bool {
    ty.is_supported()
}

/// Dot products of one stored row (whole blocks of `ty`, `cols` values) with `n` f32 activation
/// rows `x` (n × cols, row-major): `out[t] = Σ_c dequant(row)[c] * x[t*cols + c]`.
///
/// Panics if `ty` is unsupported, `row` is not whole blocks, `x.len() != n * cols` or
/// `out.len() != n`.
pub fn dot_rows(ty: GgmlType, row: &[u8], x: &[f32], n: usize, out: &mut [f32]) {
    dot_block(ty, row, 1, x, n, out);
}

/// Dot products of `m` consecutive stored rows (`rows.len() == m * row_bytes`, each row whole
/// blocks of `ty`, `cols` values) with `n` activation rows `x` (n × cols, row-major). `out` is
/// m × n, row-major by weight row: `out[i*n + t] = Σ_c dequant(row i)[c] * x[t*cols + c]`.
///
/// Each weight block is decoded once per group of up to eight (AVX-512) or four (AVX2)
/// activation rows, and several weight rows share each activation load, so calling with many
/// rows and all activation rows at once is much cheaper per dot than row by row. Weight rows are
/// taken four at a time, each group against all of `x`: keep `x` (n × cols f32) within L2, e.g.
/// by splitting a long prompt into blocks of activation rows. Any `rows`/`x` alignment works.
///
/// Panics on an unsupported `ty` or inconsistent lengths (see [`dot_rows`]).
pub fn dot_block(ty: GgmlType, rows: &[u8], m: usize, x: &[f32], n: usize, out: &mut [f32]) {
    dot_block_with(best_level(), ty, rows, m, x, n, out);
}

/// [`dot_block`] on a chosen level. Panics if the machine lacks it.
pub fn dot_block_with(
    level: Level,
    ty: GgmlType,
    rows: &[u8],
    m: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    assert_eq!(
        Some(out.len()),
        m.checked_mul(n),
        "dot: out must hold m × n values"
    );
    // SAFETY: out holds the m × n values written at i * n + t, and is borrowed exclusively.
    unsafe { dot_block_raw(level, ty, rows, m, x, n, out.as_mut_ptr(), n, 1) }
}

/// [`dot_block`] writing activation-row-major, as a matmul's output: `out[t * ld + i]` (for
/// `ld` >= `m`). Parallel tasks over disjoint weight rows can then fill one token-major result
/// in place, with the same arithmetic as [`dot_block`].
///
/// # Safety
/// `out` is valid for writes at `t * ld + i` for every `t < n`, `i < m`, and nothing else reads
/// or writes those elements during the call.
pub unsafe fn dot_block_to(
    ty: GgmlType,
    rows: &[u8],
    m: usize,
    x: &[f32],
    n: usize,
    out: *mut f32,
    ld: usize,
) {
    assert!(n <= 1 || ld >= m, "dot: ld {ld} is below m = {m}");
    dot_block_raw(best_level(), ty, rows, m, x, n, out, 1, ld)
}

/// Validates and runs one problem, writing `out[i * oi + t * ot]`.
///
/// # Safety
/// `out` is valid for writes at every `i * oi + t * ot` (`i < m`, `t < n`), and nothing else
/// accesses those elements during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn dot_block_raw(
    level: Level,
    ty: GgmlType,
    rows: &[u8],
    m: usize,
    x: &[f32],
    n: usize,
    out: *mut f32,
    oi: usize,
    ot: usize,
) {
    assert!(ty.is_supported(), "dot: unsupported type {}", ty.name());
    if m == 0 {
        assert!(rows.is_empty(), "dot: m == 0 but rows is not empty");
        return;
    }
    assert!(
        rows.len().is_multiple_of(m),
        "dot: {} bytes do not split into {m} rows",
        rows.len()
    );
    let row_bytes = rows.len() / m;
    let (bl, bb) = (ty.block_len(), ty.block_bytes());
    assert!(
        row_bytes.is_multiple_of(bb),
        "dot: {}: a {row_bytes}-byte row is not whole {bb}-byte blocks",
        ty.name()
    );
    let cols = row_bytes / bb * bl;
    assert_eq!(
        Some(x.len()),
        n.checked_mul(cols),
        "dot: x must hold n × cols = {n} × {cols} values"
    );
    if n == 0 {
        return;
    }
    let shape = Shape {
        ty,
        row_bytes,
        m,
        cols,
        n,
        oi,
        ot,
    };
    if cols == 0 {
        shape.for_each_out(out, |o| *o = 0.0);
        return;
    }
    match level {
        Level::Scalar => scalar::run(&shape, rows, x, out),
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => {
            // Levels are ordered: the best available one implies every lower one.
            assert!(level <= best_level(), "dot: this CPU lacks AVX2/FMA/F16C");
            // SAFETY: the features were just checked; lengths were validated above.
            let done = avx2::run(&shape, rows.as_ptr(), x.as_ptr(), out);
            float_tail(&shape, done, rows, x, out);
        }
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => {
            assert!(level <= best_level(), "dot: this CPU lacks AVX-512 F/BW/VL");
            // SAFETY: as above.
            let done = avx512::run(&shape, rows.as_ptr(), x.as_ptr(), out);
            float_tail(&shape, done, rows, x, out);
        }
        #[cfg(not(target_arch = "x86_64"))]
        Level::Avx2 | Level::Avx512 => panic!("dot: {} needs x86-64", level.name()),
    }
}

/// A validated problem: `m` rows of `row_bytes` bytes (`cols` values each) against `n` activation
/// rows of `cols` values; the result of weight row `i` and activation row `t` goes to
/// `out[i * oi + t * ot]`.
struct Shape {
    ty: GgmlType,
    row_bytes: usize,
    m: usize,
    cols: usize,
    n: usize,
    oi: usize,
    ot: usize,
}

impl Shape {
    /// Runs `f` on the output of weight row `i` and activation row `t`.
    ///
    /// # Safety
    /// `out` is valid as [`dot_block_raw`] requires.
    #[inline]
    unsafe fn at(&self, out: *mut f32, i: usize, t: usize) -> *mut f32 {
        out.add(i * self.oi + t * self.ot)
    }

    /// # Safety
    /// As [`Shape::at`].
    unsafe fn for_each_out(&self, out: *mut f32, mut f: impl FnMut(&mut f32)) {
        for i in 0..self.m {
            for t in 0..self.n {
                f(&mut *self.at(out, i, t));
            }
        }
    }
}

/// How many rows past a tile's first row its kernel prefetches the weights it will need next: the
/// next tile's rows, and never less than `PREFETCH_BYTES` ahead: with short rows (gemma-3's and
/// SmolLM2's Q8_0 heads: 680 and 612 bytes) one tile ahead arrives too late to hide the memory's
/// latency (BENCHMARKS.md, "Session 22").
#[cfg(target_arch = "x86_64")]
fn prefetch_rows_ahead(mr: usize, row_bytes: usize) -> usize {
    const PREFETCH_BYTES: usize = 8192;
    mr.max(PREFETCH_BYTES.div_ceil(row_bytes))
}

/// Streaming a matrix bigger than the caches: the hardware prefetchers do not follow MR
/// interleaved row streams well, so while on block `wb` (`bb` bytes) of a tile's `MR` rows
/// (stride `rb`), the tile kernels of every level fetch the same block of the `MR` rows `ahead`
/// rows on ([`prefetch_rows_ahead`]) into L2, every cache line of it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_rows_on<const MR: usize>(wb: *const u8, rb: usize, bb: usize, ahead: usize) {
    use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    for i in 0..MR {
        let mut o = 0;
        while o < bb {
            // Past the matrix end this is a harmless prefetch, hence the wrapping arithmetic.
            _mm_prefetch::<_MM_HINT_T1>(wb.wrapping_add((ahead + i) * rb + o).cast());
            o += 64;
        }
    }
}

/// Splits an `m` × `n` problem into register tiles and calls `tile(i0, mr, t0, nr)` for weight
/// rows `i0..i0 + mr` against activation rows `t0..t0 + nr`.
///
/// Weight rows go in panels of up to four, which stay in cache while every activation group
/// passes over them; activation rows go in groups of up to `max_nr`, and `rows_for(nr)` (a power
/// of two up to 4) says how many weight rows share a tile with `nr` activation rows. Remainders
/// use smaller tiles, so `tile` sees `mr` ∈ {1, 2, 4} with `mr <= rows_for(nr)` and
/// `nr` ∈ 1..=max_nr.
#[cfg(target_arch = "x86_64")]
fn schedule(
    m: usize,
    n: usize,
    max_nr: usize,
    rows_for: impl Fn(usize) -> usize,
    mut tile: impl FnMut(usize, usize, usize, usize),
) {
    let mut p0 = 0;
    while p0 < m {
        let panel = (m - p0).min(4);
        let mut t0 = 0;
        while t0 < n {
            let nr = (n - t0).min(max_nr);
            let mut i0 = p0;
            while i0 < p0 + panel {
                let left = p0 + panel - i0;
                let mr = [4, 2, 1]
                    .into_iter()
                    .find(|&r| r <= left && r <= rows_for(nr))
                    .unwrap_or(1);
                tile(i0, mr, t0, nr);
                i0 += mr;
            }
            t0 += nr;
        }
        p0 += panel;
    }
}

/// The per-type block decoder of the reference path.
fn decoder(ty: GgmlType) -> fn(&[u8], &mut [f32]) {
    super::decoder(ty).expect("checked by is_supported")
}

/// The SIMD paths cover float rows (block length 1) in whole vectors only; this adds the last
/// `cols - done` columns, decoded exactly, into `out`.
///
/// # Safety
/// `out` is valid as [`dot_block_raw`] requires.
#[cfg(target_arch = "x86_64")]
unsafe fn float_tail(s: &Shape, done: usize, rows: &[u8], x: &[f32], out: *mut f32) {
    if done == s.cols {
        return;
    }
    debug_assert_eq!(s.ty.block_len(), 1);
    let bb = s.ty.block_bytes();
    let len = s.cols - done;
    let mut buf = [0f32; 64];
    let w = &mut buf[..len];
    for (i, row) in rows.chunks_exact(s.row_bytes).enumerate() {
        decoder(s.ty)(&row[done * bb..], w);
        for t in 0..s.n {
            let xt = &x[t * s.cols + done..(t + 1) * s.cols];
            *s.at(out, i, t) += w.iter().zip(xt).map(|(a, b)| a * b).sum::<f32>();
        }
    }
}

/// Unpacks the eight 6-bit scales and mins of a Q4_K block (bytes 4..16) as two u64s of bytes,
/// the same values `blocks::k4_scale_min` yields one at a time.
///
/// # Safety
/// `b` points at a whole Q4_K block.
#[inline(always)]
#[cfg(target_arch = "x86_64")]
unsafe fn k4_scales_mins(b: *const u8) -> (u64, u64) {
    let s0 = b.add(4).cast::<u32>().read_unaligned();
    let s1 = b.add(8).cast::<u32>().read_unaligned();
    let s2 = b.add(12).cast::<u32>().read_unaligned();
    const M6: u32 = 0x3F3F_3F3F;
    const M4: u32 = 0x0F0F_0F0F;
    const M2: u32 = 0x0303_0303;
    let sc_hi = (s2 & M4) | (((s0 >> 6) & M2) << 4);
    let mn_hi = ((s2 >> 4) & M4) | (((s1 >> 6) & M2) << 4);
    (
        u64::from(s0 & M6) | (u64::from(sc_hi) << 32),
        u64::from(s1 & M6) | (u64::from(mn_hi) << 32),
    )
}

/// Converts the `h` (1 or 2) leading fp16 fields of `count` consecutive blocks of `bb` bytes (their
/// scale, or scale and offset) to f32: `out[j * h + k]` for field `k` of block `j`. Converting
/// four blocks' fields with one F16C instruction, ahead of the decode loop, costs far less than a
/// conversion and a broadcast per block. May write up to `8 - h` floats past `count * h`.
///
/// # Safety
/// F16C is available; `b` points at `count` blocks; `out` has room for `count * h + 8` floats.
#[inline(always)]
#[cfg(target_arch = "x86_64")]
unsafe fn f16_fields(b: *const u8, bb: usize, h: usize, count: usize, out: *mut f32) {
    use core::arch::x86_64::*;
    // Four blocks' fields packed into one (h = 1) or two (h = 2) u64s per conversion; blocks past
    // `count` are not read (they may lie past the end of the row).
    let mut j = 0;
    while j < count {
        let n = (count - j).min(4);
        let (mut lo, mut hi) = (0u64, 0u64);
        for k in 0..4 {
            if k < n {
                let p = b.add((j + k) * bb);
                if h == 1 {
                    lo |= u64::from(p.cast::<u16>().read_unaligned()) << (16 * k);
                } else {
                    let v = u64::from(p.cast::<u32>().read_unaligned());
                    if k < 2 {
                        lo |= v << (32 * k);
                    } else {
                        hi |= v << (32 * (k - 2));
                    }
                }
            }
        }
        let v = _mm_set_epi64x(hi as i64, lo as i64);
        if h == 1 {
            _mm_storeu_ps(out.add(j), _mm_cvtph_ps(v));
        } else {
            _mm256_storeu_ps(out.add(2 * j), _mm256_cvtph_ps(v));
        }
        j += 4;
    }
}
