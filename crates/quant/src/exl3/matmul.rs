//! The EXL3 matmul over whole layers. Few rows: the input Hadamard once per row, the tile
//! kernels per 128-output band (each tile decoded once per 16 rows, on f32 or int16
//! activations), then the output Hadamard and scales per band. Many rows, exactly: the Hadamards
//! and scales folded into the exactly decoded weights, then one f32 GEMM per 512 outputs; on
//! int16 activations (MUL1, AVX-512 VNNI): the weights decoded once to their byte sums and an
//! integer GEMM between the Hadamards. All run on the caller's rayon pool.

use rayon::prelude::*;

use super::hadamard::{butterfly128_scaled_into, SCALE};
use super::simd;
use super::{hadamard128, matmul_inner, Codebook, Exl3Shape};

/// Activation rows from which decoding the weights to f32 once and multiplying with a GEMM
/// ([`matmul_gemm`]) beats the tile kernels (which decode every tile once per 16 rows).
/// Measured on the earlier band-by-band GEMM path (`examples/exl3_prefill_bench.rs sweep`,
/// 4096x4096 MUL1 K=3, one thread): even at 16 rows, 1.3x faster from 24; at 17 the tile kernels
/// would need a second pass.
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
        matmul_tiles(shape, trellis, suh, svh, x, rows, y, Activations::Exact);
    }
}

/// What the tile kernels multiply the weights with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activations {
    /// The f32 activations and each weight's exact fp16 codebook value, f32 sums.
    #[default]
    Exact,
    /// On MUL1 layers where the CPU has AVX2 or AVX-512: the activations as int16 and MUL1's
    /// values before their fp16 rounding, integer sums: per 16 inputs in the tile kernels
    /// ([`simd::matmul_inner_int16`]), per 128 in the many-row GEMM ([`matmul_gemm_int16`],
    /// AVX-512 VNNI only); elsewhere [`Activations::Exact`].
    Int16,
}

/// A layer's rotated input rows as one of its bands' tile kernels takes them.
enum Inputs {
    F32(Vec<f32>),
    Int16(simd::Int16Rows),
}

impl Inputs {
    fn new(shape: &Exl3Shape, suh: &[f32], x: &[f32], n: usize, acts: Activations) -> Inputs {
        let xh = rotate_inputs(shape.k, suh, x);
        if acts == Activations::Int16 && shape.codebook == Codebook::Mul1 && simd::int16_available()
        {
            Inputs::Int16(simd::Int16Rows::new(&xh, n, shape.k))
        } else {
            Inputs::F32(xh)
        }
    }

    /// Output tiles `tn0..tn1` for all `n` rows into `out` (`[n][16 (tn1 - tn0)]`).
    fn tiles(
        &self,
        shape: &Exl3Shape,
        trellis: &[u8],
        n: usize,
        tn0: usize,
        tn1: usize,
        out: &mut [f32],
    ) {
        match self {
            Inputs::F32(xh) => matmul_inner(shape, trellis, xh, n, tn0, tn1, out),
            Inputs::Int16(q) => simd::matmul_inner_int16(shape, trellis, q, tn0, tn1, out),
        }
    }
}

/// `H(x * suh)` for each of the `rows` activation rows.
fn rotate_inputs(k: usize, suh: &[f32], x: &[f32]) -> Vec<f32> {
    let mut xh = x.to_vec();
    xh.par_chunks_mut(k).for_each(|r| rotate_row(r, suh));
    xh
}

/// `H(r * suh)` on one row of inputs.
#[inline]
fn rotate_row(r: &mut [f32], suh: &[f32]) {
    r.iter_mut().zip(suh).for_each(|(v, s)| *v *= s);
    hadamard128(r);
}

/// `H(r) * svh` on one band's 128 outputs of one row.
#[inline]
fn rotate_outputs(r: &mut [f32], svh: &[f32]) {
    hadamard128(r);
    r.iter_mut().zip(svh).for_each(|(v, s)| *v *= s);
}

/// The tile-kernel path: the weights are decoded one 16x16 tile at a time, each tile once for
/// up to 16 rows. Work is split into 128-output bands. With [`Activations::Exact`], also the
/// exact twin that tests hold [`matmul_gemm`] and the int16 path to.
#[allow(clippy::too_many_arguments)]
pub fn matmul_tiles(
    shape: &Exl3Shape,
    trellis: &[u8],
    suh: &[f32],
    svh: &[f32],
    x: &[f32],
    n: usize,
    y: &mut [f32],
    acts: Activations,
) {
    let (k, out) = (shape.k, shape.n);
    assert_eq!(x.len(), n * k);
    assert_eq!(y.len(), n * out);
    let xh = Inputs::new(shape, suh, x, n, acts);
    const BAND: usize = BAND_OUT;
    // Band-major results `[band][row][128]`, then scattered into token-major `y`.
    let mut bands = vec![0.0f32; n * out];
    bands
        .par_chunks_mut(n * BAND)
        .enumerate()
        .for_each(|(b, buf)| {
            let tn0 = b * BAND / 16;
            xh.tiles(shape, trellis, n, tn0, tn0 + BAND / 16, buf);
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
    acts: Activations,
) {
    let (k, out) = (gate.shape.k, gate.shape.n);
    assert!(
        up.shape.k == k && up.shape.n == out,
        "gate and up of different shapes"
    );
    assert_eq!(x.len(), n * k);
    assert_eq!(y.len(), n * out);
    let xg = Inputs::new(gate.shape, gate.suh, x, n, acts);
    let xu = Inputs::new(up.shape, up.suh, x, n, acts);
    const BAND: usize = BAND_OUT;
    let mut bands = vec![0.0f32; n * out];
    bands
        .par_chunks_mut(n * BAND)
        .enumerate()
        .for_each(|(b, buf)| {
            let (tn0, tn1) = (b * BAND / 16, (b + 1) * BAND / 16);
            let mut ub = vec![0.0f32; n * BAND];
            xg.tiles(gate.shape, gate.trellis, n, tn0, tn1, buf);
            xu.tiles(up.shape, up.trellis, n, tn0, tn1, &mut ub);
            let bs = b * BAND..(b + 1) * BAND;
            for (g, u) in buf.chunks_mut(BAND).zip(ub.chunks_mut(BAND)) {
                rotate_outputs(g, &gate.svh[bs.clone()]);
                rotate_outputs(u, &up.svh[bs.clone()]);
                combine(g, u);
            }
        });
    scatter_bands(&bands, n, out, y);
}

/// Output bands a [`matmul_gemm`] pass folds and multiplies at once: 512 outputs (1.3 MB of f32
/// at SmolLM2's k = 640, so the GEMM reads the block from L2 while it is still there; 1024
/// outputs measured 5-6% slower in prefill, BENCHMARKS.md "session 22"), and a vocabulary-sized
/// head never needs its whole f32 copy.
const GEMM_BANDS: usize = 4;

/// `W_eff = diag(suh) H W_inner H diag(svh)` for the output bands `b0..b0 + width / 128`, into
/// `w` (`[k][stride]`, the first `width` columns), one 128 x 128 block at a time: its 64 tiles
/// decoded exactly in memory order (each tile row of a band is contiguous in the file), the
/// input Hadamard down its columns, then per row the output Hadamard, `svh` and `suh`. Blocks
/// run in parallel, each writing only its own part of `w`.
#[allow(clippy::too_many_arguments)]
fn fold_bands(
    shape: &Exl3Shape,
    trellis: &[u8],
    suh: &[f32],
    svh: &[f32],
    b0: usize,
    width: usize,
    stride: usize,
    w: &mut [std::mem::MaybeUninit<f32>],
) {
    const BAND: usize = BAND_OUT;
    let k = shape.k;
    assert!(w.len() >= k * stride && width <= stride);
    let wp = SendPtr(w.as_mut_ptr().cast());
    // A task per 128 x 128 block: a layer's few bands alone would leave threads idle.
    let k_blocks = k / 128;
    (0..width / BAND * k_blocks).into_par_iter().for_each_init(
        || vec![[0.0f32; BAND]; 128],
        |block, task| {
            let (i, k0) = (task / k_blocks, task % k_blocks * 128);
            let b = b0 + i;
            let svh = &svh[b * BAND..(b + 1) * BAND];
            let tb = shape.rate.tile_bytes();
            for t in 0..8 {
                // The band's tiles two tile rows ahead (without it, 2-7% slower prefill, measured):
                // a tile row's are contiguous, but the next one is a whole row of the trellis away.
                let ahead = k0 / 16 + t + 2;
                if ahead < shape.tiles_k() {
                    let first = shape.tile(trellis, ahead, b * BAND / 16).as_ptr();
                    let at = first as usize - trellis.as_ptr() as usize;
                    simd::prefetch(&trellis[at..at + BAND / 16 * tb]);
                }
                let rows = block[16 * t..16 * t + 16].as_flattened_mut();
                for j in 0..BAND / 16 {
                    simd::decode_tile_rows_h16(
                        shape.tile(trellis, k0 / 16 + t, b * BAND / 16 + j),
                        shape.rate,
                        shape.codebook,
                        &mut rows[16 * j..],
                        BAND,
                    );
                }
            }
            hadamard128_down(block);
            for (r, v) in block.iter().enumerate() {
                // Both Hadamards' 1/sqrt(128), and suh, which scales the whole row.
                let s = suh[k0 + r] * SCALE * SCALE;
                // SAFETY: row k0 + r's columns 128 i .. 128 i + 128 of `w`, which only this task
                // writes.
                unsafe {
                    butterfly128_scaled_into(v, svh, s, wp.get().add((k0 + r) * stride + i * BAND))
                };
            }
        },
    );
}

/// The last three stages (spans 16, 32, 64) of the unscaled 128-point Hadamard butterfly down
/// the 128 rows of a block, 16 columns at a time (each row's elements in parallel); the first
/// four ran down each tile as it was decoded.
fn hadamard128_down(s: &mut [[f32; BAND_OUT]]) {
    /// The butterfly over `v` (spans 1 .. v.len() / 2), a lane-wise vector per element.
    #[inline(always)]
    fn butterfly<const N: usize>(v: &mut [[f32; 16]; N]) {
        let mut h = 1;
        while h < N {
            for a in (0..N).step_by(2 * h) {
                for r in a..a + h {
                    let (p, q) = (v[r], v[r + h]);
                    for l in 0..16 {
                        v[r][l] = p[l] + q[l];
                        v[r + h][l] = p[l] - q[l];
                    }
                }
            }
            h *= 2;
        }
    }
    #[inline(always)]
    fn run(s: &mut [[f32; BAND_OUT]]) {
        for c in (0..BAND_OUT).step_by(16) {
            for r in 0..16 {
                let mut v: [[f32; 16]; 8] =
                    std::array::from_fn(|g| s[16 * g + r][c..c + 16].try_into().unwrap());
                butterfly(&mut v);
                for (g, x) in v.iter().enumerate() {
                    s[16 * g + r][c..c + 16].copy_from_slice(x);
                }
            }
        }
    }
    assert_eq!(s.len(), 128);
    #[cfg(target_arch = "x86_64")]
    if simd::Level::Avx512.is_available() {
        #[target_feature(enable = "avx512f")]
        unsafe fn wide(s: &mut [[f32; BAND_OUT]]) {
            run(s)
        }
        // SAFETY: AVX-512 F is available.
        return unsafe { wide(s) };
    }
    run(s)
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

/// The inputs and outputs a row of `x` and `y` holds (`n` rows each) on a many-row path, which
/// takes whole rows of at most the layer's padded dims; panics on anything else.
fn many_dims(l: Layer<'_>, x: &[f32], n: usize, y: &[f32]) -> (usize, usize) {
    let shape = l.shape;
    assert!(n > 0, "no rows");
    let (cols, rows) = (x.len() / n, y.len() / n);
    assert!(
        x.len() == n * cols && y.len() == n * rows && cols <= shape.k && rows <= shape.n,
        "x, y: whole rows of at most the layer's (padded) dims"
    );
    assert_eq!(l.suh.len(), shape.k);
    assert_eq!(l.svh.len(), shape.n);
    assert_eq!(l.trellis.len(), shape.trellis_bytes());
    (cols, rows)
}

/// The prefill path: the Hadamards and scales folded into the weights, `W_eff = diag(suh) H
/// W_inner H diag(svh)`, built in f32 from the exact decoded values for up to [`GEMM_BANDS`]
/// output bands at a time, then `x · W_eff` by the `gemm` crate straight from `x` into `y`. `x`
/// may hold fewer than `k` inputs a row and `y` fewer than `n` outputs (exllamav3 pads both to
/// 128s): the GEMM reads only the model's columns of `W_eff`, so neither the padding nor the
/// per-row rotations cost anything here.
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
    let l = Layer {
        shape,
        trellis,
        suh,
        svh,
    };
    let (cols, rows) = many_dims(l, x, n, y);
    let threads = rayon::current_num_threads();
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // Rows a little longer than a power of two: the input Hadamard walks down the columns, and
    // rows 4 KB apart would all fall in the same L1 sets.
    let stride = GEMM_BANDS.min(out / BAND) * BAND + 16;
    // Every element the GEMM reads is written by `fold_bands` first.
    let mut w: Vec<std::mem::MaybeUninit<f32>> = Vec::with_capacity(k * stride);
    // SAFETY: MaybeUninit needs no initialization.
    unsafe { w.set_len(k * stride) };
    for b0 in (0..out / BAND).step_by(GEMM_BANDS) {
        let (c0, c1) = (b0 * BAND, ((b0 + GEMM_BANDS) * BAND).min(out));
        if c0 >= rows {
            break;
        }
        fold_bands(shape, trellis, suh, svh, b0, c1 - c0, stride, &mut w);
        let c1 = c1.min(rows);
        // SAFETY: dst is rows 0..n, columns c0..c1 of y (row stride `rows`); lhs is x, n x cols
        // (row stride cols); rhs is W_eff's columns c0..c1 over its first `cols` inputs, element
        // (i, j) at i stride + j - c0 in `w`. All lie within their buffers.
        unsafe {
            gemm::gemm(
                n,
                c1 - c0,
                cols,
                y.as_mut_ptr().add(c0),
                1,
                rows as isize,
                false,
                x.as_ptr(),
                1,
                cols as isize,
                w.as_ptr().cast(),
                1,
                stride as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                par,
            );
        }
    }
}

/// Bands a [`matmul_gemm_int16`] pass decodes and multiplies at once (1024 outputs: 1.3 MB of
/// int16 at SmolLM2's k = 640, 8 MB at an 8B model's 4096).
const INT16_BANDS: usize = 8;
/// Activation rows a [`matmul_gemm_int16`] task multiplies by one band.
const INT16_TASK_ROWS: usize = 48;

/// The many-row path on int16 activations (MUL1 layers, CPUs with AVX-512 VNNI + VBMI2,
/// [`simd::int16_gemm_available`]): the inputs rotated and quantized to int16 per 128 once, each
/// band's weights decoded once into their byte sums ([`simd::Panel`]), then a task per (48 rows,
/// band): the integer GEMM, `A` and the bias, the output Hadamard and `svh`. Takes `x` and `y` as
/// [`matmul_gemm`] does. What it leaves out against [`matmul_gemm`]: the activations' int16
/// rounding (2^-16 of each 128's largest) and the weights' fp16 rounding.
pub fn matmul_gemm_int16(l: Layer<'_>, x: &[f32], n: usize, y: &mut [f32]) {
    const BAND: usize = BAND_OUT;
    let (cols, rows) = many_dims(l, x, n, y);
    let (shape, k) = (l.shape, l.shape.k);
    // Each row rotated (zero-extended to `k`) and quantized while it is in L1.
    let q = simd::GemmRows::from_rows(n, k, |r, row| {
        row[..cols].copy_from_slice(&x[r * cols..(r + 1) * cols]);
        row[cols..].fill(0.0);
        rotate_row(row, l.suh);
    });
    let row_blocks = n.div_ceil(INT16_TASK_ROWS);
    let yp = SendPtr(y.as_mut_ptr());
    for b0 in (0..rows.div_ceil(BAND)).step_by(INT16_BANDS) {
        let bands = INT16_BANDS.min(rows.div_ceil(BAND) - b0);
        let panel = simd::Panel::new(shape, l.trellis, b0, bands);
        // Consecutive tasks share a band, so a thread's run of them reuses its lines in L2.
        (0..bands * row_blocks).into_par_iter().for_each_init(
            || vec![0.0f32; INT16_TASK_ROWS * BAND],
            |buf, task| {
                let (bi, rb) = (task / row_blocks, task % row_blocks);
                let (r0, r1) = (rb * INT16_TASK_ROWS, ((rb + 1) * INT16_TASK_ROWS).min(n));
                let c0 = (b0 + bi) * BAND;
                let width = (rows - c0).min(BAND);
                let buf = &mut buf[..(r1 - r0) * BAND];
                panel.band(&q, r0, r1, bi, buf);
                for (i, r) in buf.chunks_mut(BAND).enumerate() {
                    rotate_outputs(r, &l.svh[c0..c0 + BAND]);
                    // SAFETY: row r0 + i, columns c0 .. c0 + width of `y` (row stride `rows`),
                    // which only this task writes.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            r.as_ptr(),
                            yp.get().add((r0 + i) * rows + c0),
                            width,
                        )
                    };
                }
            },
        );
    }
}

/// The many-row path for `acts`: [`matmul_gemm_int16`] where [`Activations::Int16`] can take it
/// (a MUL1 layer, a CPU with [`simd::int16_gemm_available`]), else [`matmul_gemm`].
pub fn matmul_many(l: Layer<'_>, x: &[f32], n: usize, y: &mut [f32], acts: Activations) {
    if acts == Activations::Int16
        && l.shape.codebook == Codebook::Mul1
        && simd::int16_gemm_available()
    {
        matmul_gemm_int16(l, x, n, y)
    } else {
        matmul_gemm(l.shape, l.trellis, l.suh, l.svh, x, n, y)
    }
}
