//! The exact CPU path: f32 arithmetic on weights decoded row by row from their stored blocks.

pub mod model;
pub use model::{CpuKv, CpuModel, ShardedCpu, ShardedKv};

use rayon::prelude::*;

use trellm_quant::exl3::matmul as exl3;
pub use trellm_quant::exl3::matmul::Activations as Exl3Activations;
use trellm_quant::ggml::dot::{best_level, Level};

use crate::model::config::Activation;
use crate::model::weights::{Exl3Matrix, LinearWeight, Matrix};

/// Rows per parallel task: large enough to amortize scheduling, small enough to balance.
const ROWS_PER_TASK: usize = 16;

static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
static POOL: std::sync::OnceLock<rayon::ThreadPool> = std::sync::OnceLock::new();

/// Sets the worker threads of [`pool`] (before its first use; later calls have no effect).
pub fn set_threads(n: usize) {
    let _ = THREADS.set(n.max(1));
}

/// The thread pool every forward pass runs on: `set_threads` workers, else one per core.
pub fn pool() -> &'static rayon::ThreadPool {
    POOL.get_or_init(|| {
        let n = THREADS
            .get()
            .copied()
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("trellm-cpu-{i}"))
            .build()
            .expect("cannot start the CPU worker threads")
    })
}

/// f32 dot product on the widest vector unit this CPU has.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    match best_level() {
        // SAFETY: the level was detected on this CPU.
        Level::Avx512 => return unsafe { simd::dot_avx512(a, b) },
        Level::Avx2 => return unsafe { simd::dot_avx2(a, b) },
        Level::Scalar => {}
    }
    dot_generic(a, b)
}

/// `y += a * x`, on the widest vector unit this CPU has.
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    #[cfg(target_arch = "x86_64")]
    match best_level() {
        // SAFETY: the level was detected on this CPU.
        Level::Avx512 => return unsafe { simd::axpy_avx512(a, x, y) },
        Level::Avx2 => return unsafe { simd::axpy_avx2(a, x, y) },
        Level::Scalar => {}
    }
    axpy_generic(a, x, y)
}

/// Several independent accumulators, so the compiler vectorizes it for whatever features the
/// caller was compiled with.
#[inline(always)]
fn dot_generic(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 16;
    let mut acc = [0.0f32; L];
    let (ca, ra) = a.split_at(a.len() / L * L);
    let (cb, rb) = b.split_at(ca.len());
    for (x, y) in ca.chunks_exact(L).zip(cb.chunks_exact(L)) {
        for i in 0..L {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = 0.0;
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    acc.iter().sum::<f32>() + s
}

#[inline(always)]
pub(crate) fn axpy_generic(a: f32, x: &[f32], y: &mut [f32]) {
    for (v, w) in y.iter_mut().zip(x) {
        *v += a * w;
    }
}

/// The generic loops compiled for specific instruction sets, chosen at run time.
#[cfg(target_arch = "x86_64")]
mod simd {
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
        super::dot_generic(a, b)
    }
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        super::dot_generic(a, b)
    }
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn axpy_avx512(a: f32, x: &[f32], y: &mut [f32]) {
        super::axpy_generic(a, x, y)
    }
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy_avx2(a: f32, x: &[f32], y: &mut [f32]) {
        super::axpy_generic(a, x, y)
    }
}

/// Activation rows per kernel call in prefill: their f32 values (cols × 4 bytes each) stay in L2
/// while a task's weight rows stay in L1.
const X_ROWS_PER_PASS: usize = 64;

/// `y[t][r] = sum_c x[t][c] * w[r][c]` for `n` activation rows (`x` is n × cols, `y` n × rows).
///
/// Weights are decoded inside the SIMD dot kernels (exactly, as [`matmul_reference`] decodes them)
/// and used for several activation rows per decode; parallel over blocks of weight rows.
pub fn matmul(x: &[f32], n: usize, w: &Matrix, y: &mut [f32]) {
    matmul_on(x, n, w, y, n >= GEMM_MIN_ROWS)
}

/// [`matmul`] through the dense GEMM (`gemm`) or the fused dot kernels, as the caller chooses.
fn matmul_on(x: &[f32], n: usize, w: &Matrix, y: &mut [f32], gemm: bool) {
    let (rows, cols) = (w.rows, w.cols);
    debug_assert_eq!(x.len(), n * cols);
    debug_assert_eq!(y.len(), n * rows);
    if n == 1 {
        y.par_chunks_mut(ROWS_PER_TASK)
            .enumerate()
            .for_each(|(chunk, out)| {
                let r0 = chunk * ROWS_PER_TASK;
                trellm_quant::dot_block(w.ty, w.rows_bytes(r0, out.len()), out.len(), x, 1, out);
            });
        return;
    }
    if gemm {
        return matmul_gemm(x, n, w, y);
    }
    // Each task's weight rows write their columns of the token-major output in place.
    let out = SendPtr(y.as_mut_ptr());
    (0..rows.div_ceil(ROWS_PER_TASK))
        .into_par_iter()
        .for_each(|chunk| {
            let r0 = chunk * ROWS_PER_TASK;
            let m = ROWS_PER_TASK.min(rows - r0);
            let wrows = w.rows_bytes(r0, m);
            for t0 in (0..n).step_by(X_ROWS_PER_PASS) {
                let nt = X_ROWS_PER_PASS.min(n - t0);
                // SAFETY: y is n × rows; this task alone writes its rows r0..r0 + m of
                // activation rows t0..t0 + nt.
                unsafe {
                    trellm_quant::dot_block_to(
                        w.ty,
                        wrows,
                        m,
                        &x[t0 * cols..(t0 + nt) * cols],
                        nt,
                        out.get().add(t0 * rows + r0),
                        rows,
                    );
                }
            }
        });
}

/// A pointer that parallel tasks writing disjoint elements share.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub(crate) *mut f32);
// SAFETY: only used for writes to disjoint elements, each by one task.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    /// A method, so closures capture the whole (Sync) wrapper rather than its raw field.
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// Activation rows from which decoding the whole weight matrix to f32 once and running a dense
/// GEMM beats decoding blocks inside the dot kernels.
const GEMM_MIN_ROWS: usize = 24;

/// Prefill: the weights decoded exactly to f32 (in parallel), then `y = x · wᵀ` by the `gemm`
/// crate, which writes straight into the token-major output.
fn matmul_gemm(x: &[f32], n: usize, w: &Matrix, y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    let mut wf = vec![0.0f32; rows * cols];
    wf.par_chunks_mut(cols * ROWS_PER_TASK)
        .enumerate()
        .for_each(|(chunk, out)| {
            let r0 = chunk * ROWS_PER_TASK;
            let m = out.len() / cols;
            trellm_quant::dequantize(w.ty, w.rows_bytes(r0, m), out)
                .expect("row geometry validated at load");
        });
    let threads = rayon::current_num_threads();
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: dst is n x rows (row stride rows), lhs x is n x cols (row stride cols), rhs is wf
    // read as cols x rows (element (c, r) at r * cols + c); all buffers hold exactly that.
    unsafe {
        gemm::gemm(
            n,
            rows,
            cols,
            y.as_mut_ptr(),
            1,
            rows as isize,
            false,
            x.as_ptr(),
            1,
            cols as isize,
            wf.as_ptr(),
            cols as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

/// The slow exact twin of [`matmul`]: each weight row decoded with the scalar reference decoder,
/// then plain f32 dot products. Tests hold the fast path to it.
pub fn matmul_reference(x: &[f32], n: usize, w: &Matrix, y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    let mut buf = vec![0.0f32; cols];
    for r in 0..rows {
        w.dequantize_row(r, &mut buf);
        for t in 0..n {
            y[t * rows + r] = dot(&buf, &x[t * cols..(t + 1) * cols]);
        }
    }
}

/// RMSNorm as the reference computes it: `w * (x * rsqrt(mean(x^2) + eps))`.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    for (v, g) in x.iter_mut().zip(w) {
        *v = g * (*v * r);
    }
}

/// RMSNorm applied to each `w.len()`-sized chunk (per-head q/k norms).
pub fn rms_norm_chunks(x: &mut [f32], w: &[f32], eps: f32) {
    for c in x.chunks_mut(w.len()) {
        rms_norm(c, w, eps);
    }
}

#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp_poly(-x))
}

/// GELU, tanh approximation.
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    // 0.5·x·(1 + tanh(y)) = x / (1 + e^(-2y)): the same value without tanh's cost or the
    // cancellation of 1 + tanh(y) for negative y.
    let y = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    x / (1.0 + exp_poly(-2.0 * y))
}

/// Calls `run(args)` compiled for the best SIMD level this CPU has. The same operations run at
/// every level (the same results); without it an AVX2-only CPU ran them as SSE2 with libm's
/// `floorf` a value (9% of a quantize layer's time on a Zen 2 box).
macro_rules! at_best_level {
    ($run:ident($($arg:ident: $ty:ty),*) -> $ret:ty) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx2,fma")]
            unsafe fn avx512($($arg: $ty),*) -> $ret {
                $run($($arg),*)
            }
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2($($arg: $ty),*) -> $ret {
                $run($($arg),*)
            }
            match best_level() {
                // SAFETY: the level was detected on this CPU.
                Level::Avx512 => return unsafe { avx512($($arg),*) },
                Level::Avx2 => return unsafe { avx2($($arg),*) },
                _ => {}
            }
        }
        $run($($arg),*)
    }};
}

/// e^x to about one ulp, branch-free so that loops over it vectorize: 2^(x·log2 e) split into an
/// integer power (exponent bits) and a degree-6 polynomial on the fraction. Inputs are clamped to
/// the finite range of f32 results.
#[inline(always)]
fn exp_poly(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0) * std::f32::consts::LOG2_E;
    let i = (x + 0.5).floor();
    let f = x - i;
    let mut p = 1.535_336_2e-4f32;
    p = p * f + 1.339_887_4e-3;
    p = p * f + 9.618_437e-3;
    p = p * f + 5.550_332_5e-2;
    p = p * f + 2.402_264_8e-1;
    p = p * f + 6.931_472e-1;
    p = p * f + 1.0;
    // 2^i: i is a whole number in -126..=127, so i + 127 + 1.5 * 2^23 holds i + 127 exactly in
    // its low mantissa bits, shifted here into the exponent field. The same bits as
    // `(i as i32 + 127) << 23`, but that saturating cast compiled to a scalar conversion per
    // lane (the softmax was 5% of a quantize run).
    p * f32::from_bits((i + (127.0 + 12_582_912.0)).to_bits() << 23)
}

/// The largest value (NaNs ignored, -inf for none), in 16 lanes.
pub fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    acc.iter()
        .chain(chunks.remainder())
        .copied()
        .fold(f32::NEG_INFINITY, f32::max)
}

/// `e^((v - m) * scale)` for each `v` of `x` into `out` (0 for -inf), vectorized.
pub fn exp_weights(x: &[f32], m: f32, scale: f32, out: &mut [f32]) {
    #[inline(always)]
    fn run(x: &[f32], m: f32, scale: f32, out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            let e = exp_poly((v - m) * scale);
            *o = if v == f32::NEG_INFINITY { 0.0 } else { e };
        }
    }
    at_best_level!(run(x: &[f32], m: f32, scale: f32, out: &mut [f32]) -> ())
}

/// The sum of `exp_weights`, in 16 lanes (vectorized), without storing the weights.
pub fn sum_exp(x: &[f32], m: f32, scale: f32) -> f32 {
    #[inline(always)]
    fn run(x: &[f32], m: f32, scale: f32) -> f32 {
        let mut acc = [0.0f32; 16];
        let mut chunks = x.chunks_exact(16);
        for c in &mut chunks {
            for (a, &v) in acc.iter_mut().zip(c) {
                let e = exp_poly((v - m) * scale);
                *a += if v == f32::NEG_INFINITY { 0.0 } else { e };
            }
        }
        let mut s: f32 = acc.iter().sum();
        for &v in chunks.remainder() {
            if v != f32::NEG_INFINITY {
                s += exp_poly((v - m) * scale);
            }
        }
        s
    }
    at_best_level!(run(x: &[f32], m: f32, scale: f32) -> f32)
}

/// `gate = act(gate) * up` (gated MLPs) over whole rows, vectorized.
pub fn gated_activation(act: Activation, gate: &mut [f32], up: &[f32]) {
    #[inline(always)]
    fn run(act: Activation, gate: &mut [f32], up: &[f32]) {
        match act {
            Activation::Silu => gate.iter_mut().zip(up).for_each(|(g, u)| *g = silu(*g) * u),
            Activation::GeluTanh => gate
                .iter_mut()
                .zip(up)
                .for_each(|(g, u)| *g = gelu_tanh(*g) * u),
            Activation::Gelu => gate.iter_mut().zip(up).for_each(|(g, u)| *g = gelu(*g) * u),
        }
    }
    at_best_level!(run(act: Activation, gate: &mut [f32], up: &[f32]) -> ())
}

/// `out = act(x)` (plain MLPs).
pub fn activation(act: Activation, x: &[f32], out: &mut [f32]) {
    let f = match act {
        Activation::Silu => silu,
        Activation::GeluTanh => gelu_tanh,
        Activation::Gelu => gelu,
    };
    out.iter_mut().zip(x).for_each(|(o, v)| *o = f(*v));
}

/// In-place softmax (attention's), vectorized: [`exp_poly`] (0 for -inf) and the sum in 16
/// lanes, as [`sum_exp`]. A prefill spent half its attention time in libm's scalar `exp` and a
/// serial sum.
pub fn softmax(x: &mut [f32]) {
    #[inline(always)]
    fn run(x: &mut [f32]) {
        let m = max(x);
        let e = |v: f32| {
            if v == f32::NEG_INFINITY {
                0.0
            } else {
                exp_poly(v - m)
            }
        };
        let mut acc = [0.0f32; 16];
        let mut chunks = x.chunks_exact_mut(16);
        for c in &mut chunks {
            for (a, v) in acc.iter_mut().zip(c.iter_mut()) {
                *v = e(*v);
                *a += *v;
            }
        }
        let mut s: f32 = acc.iter().sum();
        for v in chunks.into_remainder() {
            *v = e(*v);
            s += *v;
        }
        let inv = 1.0 / s;
        x.iter_mut().for_each(|v| *v *= inv);
    }
    at_best_level!(run(x: &mut [f32]) -> ())
}

/// `log_softmax` of logits, as the reference's `logits - logsumexp(logits)`.
pub fn log_softmax(x: &mut [f32]) {
    let m = max(x);
    if !m.is_finite() {
        return;
    }
    let s = sum_exp(x, m, 1.0);
    let lse = m + s.ln();
    for v in x.iter_mut() {
        *v -= lse;
    }
}

/// Rotates one head vector in place. `inv_freq` has one entry per rotated pair.
pub fn rope(x: &mut [f32], pos: f32, inv_freq: &[f32], interleaved: bool) {
    let half = inv_freq.len();
    for (i, &f) in inv_freq.iter().enumerate() {
        let theta = pos * f;
        let (s, c) = theta.sin_cos();
        let (a, b) = if interleaved {
            (2 * i, 2 * i + 1)
        } else {
            (i, i + half)
        };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * c - x1 * s;
        x[b] = x0 * s + x1 * c;
    }
}

/// LayerNorm as the reference computes it: `(x - mean) * rsqrt(var + eps) * w + b`.
pub fn layer_norm(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let r = 1.0 / (var + eps).sqrt();
    for ((v, g), c) in x.iter_mut().zip(w).zip(b) {
        *v = ((*v - mean) * r) * g + c;
    }
}

/// GELU with erf, `x * (1 + erf(x / sqrt(2))) / 2`, using the reference's float32 erf.
#[inline]
pub fn gelu(x: f32) -> f32 {
    x * (1.0 + crate::model::mlx_math::mlx_erf(x / std::f32::consts::SQRT_2)) / 2.0
}

/// Soft-capping: `cap * tanh(x / cap)`.
#[inline]
pub fn softcap(x: f32, cap: f32) -> f32 {
    (x / cap).tanh() * cap
}

/// `y[t][r] = sum_c x[t][c] * w[r][c]` for `n` activation rows, whatever the weight's format;
/// `acts` says what EXL3 layers' few-row kernels multiply by.
pub fn linear(x: &[f32], n: usize, w: &LinearWeight, y: &mut [f32], acts: Exl3Activations) {
    linear_on(x, n, w, y, n >= many_rows(w), acts)
}

/// Rows from which a format's many-row path (weights decoded once, then a GEMM) is taken.
fn many_rows(w: &LinearWeight) -> usize {
    match w {
        LinearWeight::Ggml(_) => GEMM_MIN_ROWS,
        LinearWeight::Exl3(_) => exl3::GEMM_MIN_ROWS,
    }
}

fn linear_on(
    x: &[f32],
    n: usize,
    w: &LinearWeight,
    y: &mut [f32],
    many: bool,
    acts: Exl3Activations,
) {
    match w {
        LinearWeight::Ggml(m) => matmul_on(x, n, m, y, many),
        LinearWeight::Exl3(e) => exl3_matmul(x, n, e, y, many, acts),
    }
}

/// [`linear`] on a batch whose rows belong to sequences of `seq_rows` rows each (in order). The
/// rows of sequences with few rows go through the few-row kernels together (each weight block
/// read once for all of them), and those of sequences with many rows through the many-row path
/// together (a row's GEMM result does not depend on the other rows): every row gets the
/// arithmetic it gets when its sequence runs alone.
pub fn linear_batched(
    x: &[f32],
    seq_rows: &[usize],
    w: &LinearWeight,
    y: &mut [f32],
    acts: Exl3Activations,
) {
    let (cols, rows) = (w.cols(), w.rows());
    let n: usize = seq_rows.iter().sum();
    debug_assert_eq!(x.len(), n * cols);
    let many = many_rows(w);
    let is_many = |r: usize| r >= many;
    if seq_rows.iter().all(|&r| is_many(r)) || seq_rows.iter().all(|&r| !is_many(r)) {
        return linear_on(x, n, w, y, is_many(seq_rows[0]), acts);
    }
    let spans: Vec<(usize, usize)> = seq_rows
        .iter()
        .scan(0, |at, &r| {
            let s = *at;
            *at += r;
            Some((s, r))
        })
        .collect();
    for path in [false, true] {
        let mut xs = Vec::new();
        for &(s, r) in spans.iter().filter(|(_, r)| is_many(*r) == path) {
            xs.extend_from_slice(&x[s * cols..(s + r) * cols]);
        }
        let ns = xs.len() / cols;
        let mut ys = vec![0.0f32; ns * rows];
        linear_on(&xs, ns, w, &mut ys, path, acts);
        let mut at = 0;
        for &(s, r) in spans.iter().filter(|(_, r)| is_many(*r) == path) {
            y[s * rows..(s + r) * rows].copy_from_slice(&ys[at * rows..(at + r) * rows]);
            at += r;
        }
    }
}

/// A gated MLP's `gate = act(gate(x)) * up(x)` in one pass over both EXL3 weights
/// ([`exl3::matmul_tiles_gated`]), where that is the arithmetic [`linear_batched`] would do: both
/// EXL3 layers of one shape and use, no biases, every sequence on the few-row path. Returns
/// false, having written nothing, otherwise (the caller runs them apart).
pub fn gated_exl3(
    x: &[f32],
    seq_rows: &[usize],
    gate: &crate::model::weights::Linear,
    up: &crate::model::weights::Linear,
    act: Activation,
    out: &mut [f32],
    acts: Exl3Activations,
) -> bool {
    let (LinearWeight::Exl3(g), LinearWeight::Exl3(u)) = (&gate.w, &up.w) else {
        return false;
    };
    let n: usize = seq_rows.iter().sum();
    if gate.b.is_some()
        || up.b.is_some()
        || g.shape.k != u.shape.k
        || g.shape.n != u.shape.n
        || (g.rows, g.cols) != (u.rows, u.cols)
        || seq_rows.iter().any(|&r| r >= exl3::GEMM_MIN_ROWS)
        || n == 0
    {
        return false;
    }
    let combine = |gb: &mut [f32], ub: &[f32]| gated_activation(act, gb, ub);
    let (k, width) = (g.shape.k, g.shape.n);
    if (g.cols, g.rows) == (k, width) {
        exl3::matmul_tiles_gated(exl3_layer(g), exl3_layer(u), x, n, out, &combine, acts);
        return true;
    }
    // Padded to 128s: as exl3_matmul (the padded outputs are act(0) * 0 = 0, then dropped).
    let mut xp = vec![0.0f32; n * k];
    for (d, s) in xp.chunks_mut(k).zip(x.chunks(g.cols)) {
        d[..g.cols].copy_from_slice(s);
    }
    let mut yp = vec![0.0f32; n * width];
    exl3::matmul_tiles_gated(
        exl3_layer(g),
        exl3_layer(u),
        &xp,
        n,
        &mut yp,
        &combine,
        acts,
    );
    for (d, s) in out.chunks_mut(g.rows).zip(yp.chunks(width)) {
        d.copy_from_slice(&s[..g.rows]);
    }
    true
}

/// An EXL3 weight's parts, as the layer-wide matmuls take them.
fn exl3_layer(e: &Exl3Matrix) -> exl3::Layer<'_> {
    exl3::Layer {
        shape: &e.shape,
        trellis: e.trellis(),
        suh: &e.suh,
        svh: &e.svh,
    }
}

/// EXL3: `y = H(H(x * suh) W_inner) * svh`, for `n` activation rows: the tile kernels for
/// few rows, a GEMM for many (`trellm_quant::exl3::matmul`), each on `acts`.
fn exl3_matmul(
    x: &[f32],
    n: usize,
    w: &Exl3Matrix,
    y: &mut [f32],
    many: bool,
    acts: Exl3Activations,
) {
    if many {
        // Reads only the model's dims of the padded layer.
        return exl3::matmul_many(exl3_layer(w), x, n, y, acts);
    }
    let (k, out) = (w.shape.k, w.shape.n);
    if (w.cols, w.rows) == (k, out) {
        return exl3::matmul_tiles(&w.shape, w.trellis(), &w.suh, &w.svh, x, n, y, acts);
    }
    // Padded to 128s (as exllamav3 stores dimensions that are not): zero-extend the inputs (the
    // padded weight rows are zeros), keep the first `rows` outputs.
    let mut xp = vec![0.0f32; n * k];
    for (d, s) in xp.chunks_mut(k).zip(x.chunks(w.cols)) {
        d[..w.cols].copy_from_slice(s);
    }
    let mut yp = vec![0.0f32; n * out];
    exl3::matmul_tiles(&w.shape, w.trellis(), &w.suh, &w.svh, &xp, n, &mut yp, acts);
    for (d, s) in y.chunks_mut(w.rows).zip(yp.chunks(out)) {
        d.copy_from_slice(&s[..w.rows]);
    }
}

#[cfg(test)]
mod tests {
    use super::exp_poly;

    /// The exponent built from the float's bits equals the one built by the integer cast, for
    /// every input from below the clamp to above it (and the special values).
    #[test]
    fn exp_poly_exponent_matches_the_integer_cast() {
        fn by_cast(x: f32) -> f32 {
            let x = x.clamp(-87.0, 88.0) * std::f32::consts::LOG2_E;
            let i = (x + 0.5).floor();
            let f = x - i;
            let mut p = 1.535_336_2e-4f32;
            for c in [
                1.339_887_4e-3,
                9.618_437e-3,
                5.550_332_5e-2,
                2.402_264_8e-1,
                6.931_472e-1,
                1.0,
            ] {
                p = p * f + c;
            }
            p * f32::from_bits(((i as i32 + 127) << 23) as u32)
        }
        let sweep = (0..2_000_000).map(|j| -100.0 + j as f32 * 1e-4);
        let special = [
            0.0,
            -0.0,
            87.0,
            88.0,
            89.0,
            -87.0,
            -88.0,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
        ];
        for x in sweep.chain(special) {
            assert_eq!(exp_poly(x).to_bits(), by_cast(x).to_bits(), "e^{x}");
        }
        assert!(
            exp_poly(f32::NAN).is_nan()
                && exp_poly(f32::NEG_INFINITY) == by_cast(f32::NEG_INFINITY)
        );
    }
}
