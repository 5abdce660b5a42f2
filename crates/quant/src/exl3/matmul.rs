//! The EXL3 matmul over whole layers: the input Hadamard once per row, then per 128-output band
//! either the tile kernels (few rows: each tile decoded once per 16 rows) or the band decoded
//! exactly to f32 once and a GEMM (many rows), then the output Hadamard and scales per band.
//! Bands run in parallel on the caller's rayon pool.

use rayon::prelude::*;

use super::simd::{self, Level};
use super::{hadamard128, matmul_inner, Exl3Shape};

/// Activation rows from which decoding each 128-output band of `W_inner` to f32 once and
/// multiplying it with a GEMM beats the tile kernels (which decode every tile once per 16 rows).
/// Measured (`examples/exl3_prefill_bench.rs sweep`, 4096x4096 MUL1 K=3, one thread): even at 16
/// rows, 1.3x faster from 24; at 17 the tile kernels would need a second pass.
pub const GEMM_MIN_ROWS: usize = 17;

/// Output columns per EXL3 task: one output Hadamard block, 8 tiles side by side in memory.
const BAND_OUT: usize = 128;

/// `y = H(H(x * suh) W_inner) * svh` on a layer given by parts (`suh`: `k` values, `svh`: `n` values, `x`:
/// `[rows][k]`, `y`: `[rows][n]`): picks [`matmul_tiles`] or [`matmul_gemm`] by the
/// number of rows.
pub fn linear(
    shape: &Exl3Shape,
    trellis: &[u8],
    suh: &[f32],
    svh: &[f32],
    x: &[f32],
    rows: usize,
    y: &mut [f32],
) {
    if rows >= GEMM_MIN_ROWS {
        matmul_gemm(shape, trellis, suh, svh, x, rows, y);
    } else {
        matmul_tiles(shape, trellis, suh, svh, x, rows, y);
    }
}

/// `H(x * suh)` for each of the `rows` activation rows.
fn rotate_inputs(k: usize, suh: &[f32], x: &[f32]) -> Vec<f32> {
    let mut xh = x.to_vec();
    xh.par_chunks_mut(k).for_each(|r| {
        r.iter_mut().zip(suh).for_each(|(v, s)| *v *= s);
        hadamard128(r);
    });
    xh
}

/// `H(r) * svh` on one band's 128 outputs of one row.
#[inline]
fn rotate_outputs(r: &mut [f32], svh: &[f32]) {
    hadamard128(r);
    r.iter_mut().zip(svh).for_each(|(v, s)| *v *= s);
}

/// The tile-kernel path: the weights are decoded one 16x16 tile at a time, each tile once for
/// up to 16 rows. Work is split into 128-output bands. Also the exact twin that tests hold
/// [`matmul_gemm`] to.
pub fn matmul_tiles(
    shape: &Exl3Shape,
    trellis: &[u8],
    suh: &[f32],
    svh: &[f32],
    x: &[f32],
    n: usize,
    y: &mut [f32],
) {
    let (k, out) = (shape.k, shape.n);
    assert_eq!(x.len(), n * k);
    assert_eq!(y.len(), n * out);
    let xh = rotate_inputs(k, suh, x);
    const BAND: usize = BAND_OUT;
    // Band-major results `[band][row][128]`, then scattered into token-major `y`.
    let mut bands = vec![0.0f32; n * out];
    bands
        .par_chunks_mut(n * BAND)
        .enumerate()
        .for_each(|(b, buf)| {
            let tn0 = b * BAND / 16;
            matmul_inner(shape, trellis, &xh, n, tn0, tn0 + BAND / 16, buf);
            for r in buf.chunks_mut(BAND) {
                rotate_outputs(r, &svh[b * BAND..(b + 1) * BAND]);
            }
        });
    scatter_bands(&bands, n, out, y);
}

/// Band-major results `[band][row][128]` into token-major `y` (`[row][out]`).
fn scatter_bands(bands: &[f32], n: usize, out: usize, y: &mut [f32]) {
    const BAND: usize = BAND_OUT;
    for (b, buf) in bands.chunks(n * BAND).enumerate() {
        for (t, r) in buf.chunks(BAND).enumerate() {
            y[t * out + b * BAND..t * out + (b + 1) * BAND].copy_from_slice(r);
        }
    }
}

/// One EXL3 layer by its parts (as [`matmul_tiles`] takes them).
#[derive(Clone, Copy)]
pub struct Layer<'a> {
    pub shape: &'a Exl3Shape,
    pub trellis: &'a [u8],
    pub suh: &'a [f32],
    pub svh: &'a [f32],
}

/// A gated MLP's gate and up projections in one pass: each task decodes and multiplies one
/// 128-output band of both layers (the input rotated once per layer), rotates both bands back and
/// applies `combine(gate_band_row, up_band_row)` there (the activation: `gate = act(gate) * up`),
/// so `y` (`[rows][n]`) holds the combined result. Each band's arithmetic is that of
/// [`matmul_tiles`], so `y` is bit-identical to two [`matmul_tiles`] calls and `combine` after.
pub fn matmul_tiles_gated(
    gate: Layer<'_>,
    up: Layer<'_>,
    x: &[f32],
    n: usize,
    y: &mut [f32],
    combine: &(dyn Fn(&mut [f32], &[f32]) + Sync),
) {
    let (k, out) = (gate.shape.k, gate.shape.n);
    assert!(
        up.shape.k == k && up.shape.n == out,
        "gate and up of different shapes"
    );
    assert_eq!(x.len(), n * k);
    assert_eq!(y.len(), n * out);
    let (xg, xu) = (rotate_inputs(k, gate.suh, x), rotate_inputs(k, up.suh, x));
    const BAND: usize = BAND_OUT;
    let mut bands = vec![0.0f32; n * out];
    bands
        .par_chunks_mut(n * BAND)
        .enumerate()
        .for_each(|(b, buf)| {
            let (tn0, tn1) = (b * BAND / 16, (b + 1) * BAND / 16);
            let mut ub = vec![0.0f32; n * BAND];
            matmul_inner(gate.shape, gate.trellis, &xg, n, tn0, tn1, buf);
            matmul_inner(up.shape, up.trellis, &xu, n, tn0, tn1, &mut ub);
            let bs = b * BAND..(b + 1) * BAND;
            for (g, u) in buf.chunks_mut(BAND).zip(ub.chunks_mut(BAND)) {
                rotate_outputs(g, &gate.svh[bs.clone()]);
                rotate_outputs(u, &up.svh[bs.clone()]);
                combine(g, u);
            }
        });
    scatter_bands(&bands, n, out, y);
}

/// `W_inner[:, 128 b .. 128 b + 128]` decoded exactly (the codec's fp16 values as f32, tile
/// by tile with the SIMD decoder) into `band`, row-major `[k][128]`.
fn decode_band(shape: &Exl3Shape, trellis: &[u8], level: Level, b: usize, band: &mut [f32]) {
    const BAND: usize = BAND_OUT;
    debug_assert_eq!(band.len(), shape.k * BAND);
    let mut tile = [0.0f32; 256];
    for tk in 0..shape.tiles_k() {
        let rows = &mut band[tk * 16 * BAND..(tk + 1) * 16 * BAND];
        for j in 0..BAND / 16 {
            simd::decode_tile_with(
                level,
                shape.tile(trellis, tk, b * BAND / 16 + j),
                shape.rate,
                shape.codebook,
                &mut tile,
            );
            for r in 0..16 {
                rows[r * BAND + 16 * j..r * BAND + 16 * j + 16]
                    .copy_from_slice(&tile[16 * r..16 * r + 16]);
            }
        }
    }
}

/// A pointer that may cross threads: tasks write disjoint parts of what it points to.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: only used for writes to disjoint regions by the tasks of one parallel loop.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// (A method, so that closures capture the whole `Send` wrapper, not its raw field.)
    #[inline]
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// The prefill path: each 128-output band of `W_inner` decoded exactly to f32 once (per task),
/// then `xh · band` by the `gemm` crate, written straight into `y`'s columns and rotated there.
/// Bands run in parallel; where they are fewer than the threads, the rows are split too (each
/// part decodes its band again). Wider blocks than one band measured no faster.
pub fn matmul_gemm(
    shape: &Exl3Shape,
    trellis: &[u8],
    suh: &[f32],
    svh: &[f32],
    x: &[f32],
    n: usize,
    y: &mut [f32],
) {
    const BAND: usize = BAND_OUT;
    let (k, out) = (shape.k, shape.n);
    assert_eq!(x.len(), n * k);
    assert_eq!(y.len(), n * out);
    assert_eq!(suh.len(), k);
    assert_eq!(svh.len(), out);
    assert_eq!(trellis.len(), shape.trellis_bytes());
    let xh = rotate_inputs(k, suh, x);
    let level = simd::best_level();
    let bands = out / BAND;
    let threads = rayon::current_num_threads();
    // Row parts per band: enough tasks for every thread, at least 64 rows each.
    let parts = threads.div_ceil(bands).min(n.div_ceil(64)).max(1);
    let rows_per_part = n.div_ceil(parts);
    let yp = SendPtr(y.as_mut_ptr());
    (0..bands * parts).into_par_iter().for_each_init(
        || vec![0.0f32; k * BAND],
        |band, task| {
            let (b, p) = (task / parts, task % parts);
            let t0 = p * rows_per_part;
            let t1 = ((p + 1) * rows_per_part).min(n);
            if t0 >= t1 {
                return;
            }
            decode_band(shape, trellis, level, b, band);
            // SAFETY: dst is rows t0..t1, columns 128 b..128 b + 128 of y (row stride `out`),
            // which no other task touches; lhs is rows t0..t1 of xh (row stride k); rhs is
            // `band`, k x 128 row-major. All lie within their buffers.
            unsafe {
                gemm::gemm(
                    t1 - t0,
                    BAND,
                    k,
                    yp.get().add(t0 * out + b * BAND),
                    1,
                    out as isize,
                    false,
                    xh.as_ptr().add(t0 * k),
                    1,
                    k as isize,
                    band.as_ptr(),
                    1,
                    BAND as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            for t in t0..t1 {
                // SAFETY: the same disjoint columns of row t, written by this task only.
                let r = unsafe {
                    std::slice::from_raw_parts_mut(yp.get().add(t * out + b * BAND), BAND)
                };
                rotate_outputs(r, &svh[b * BAND..(b + 1) * BAND]);
            }
        },
    );
}
