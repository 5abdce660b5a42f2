//! The exact CPU path: f32 arithmetic on weights decoded row by row from their stored blocks.

use rayon::prelude::*;

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
fn axpy_generic(a: f32, x: &[f32], y: &mut [f32]) {
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
    if n >= GEMM_MIN_ROWS {
        return matmul_gemm(x, n, w, y);
    }
    // Weight-row-major result blocks, transposed into token-major output at the end.
    let mut yt = vec![0.0f32; n * rows];
    yt.par_chunks_mut(ROWS_PER_TASK * n)
        .enumerate()
        .for_each_init(Vec::new, |tmp, (chunk, out)| {
            let r0 = chunk * ROWS_PER_TASK;
            let m = out.len() / n;
            let wrows = w.rows_bytes(r0, m);
            for t0 in (0..n).step_by(X_ROWS_PER_PASS) {
                let nt = X_ROWS_PER_PASS.min(n - t0);
                tmp.resize(m * nt, 0.0);
                trellm_quant::dot_block(w.ty, wrows, m, &x[t0 * cols..(t0 + nt) * cols], nt, tmp);
                for i in 0..m {
                    out[i * n + t0..i * n + t0 + nt].copy_from_slice(&tmp[i * nt..(i + 1) * nt]);
                }
            }
        });
    y.par_chunks_mut(rows).enumerate().for_each(|(t, yrow)| {
        for (r, v) in yrow.iter_mut().enumerate() {
            *v = yt[r * n + t];
        }
    });
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
    p * f32::from_bits(((i as i32 + 127) << 23) as u32)
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
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn run_avx512(act: Activation, gate: &mut [f32], up: &[f32]) {
        run(act, gate, up)
    }
    #[cfg(target_arch = "x86_64")]
    if best_level() == Level::Avx512 {
        // SAFETY: the level was detected on this CPU.
        return unsafe { run_avx512(act, gate, up) };
    }
    run(act, gate, up)
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

/// In-place softmax.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0.0;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    let inv = 1.0 / s;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `log_softmax` of logits, as the reference's `logits - logsumexp(logits)`.
pub fn log_softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return;
    }
    let s: f32 = x.iter().map(|v| (v - m).exp()).sum();
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

/// `y[t][r] = sum_c x[t][c] * w[r][c]` for `n` activation rows, whatever the weight's format.
pub fn linear(x: &[f32], n: usize, w: &LinearWeight, y: &mut [f32]) {
    match w {
        LinearWeight::Ggml(m) => matmul(x, n, m, y),
        LinearWeight::Exl3(e) => exl3_matmul(x, n, e, y),
    }
}

/// EXL3: `y = H(H(x * suh) W_inner) * svh`. The Hadamards go to the activations and outputs;
/// the weights are decoded one 16x16 tile at a time, each tile once for all `n` rows. Work is
/// split into 128-output bands (8 tiles side by side in memory, one output Hadamard block).
fn exl3_matmul(x: &[f32], n: usize, w: &Exl3Matrix, y: &mut [f32]) {
    use trellm_quant::exl3;
    let (k, out) = (w.shape.k, w.shape.n);
    debug_assert_eq!(x.len(), n * k);
    debug_assert_eq!(y.len(), n * out);
    let mut xh = x.to_vec();
    xh.par_chunks_mut(k).for_each(|r| {
        r.iter_mut().zip(&w.suh).for_each(|(v, s)| *v *= s);
        exl3::hadamard128(r);
    });
    const BAND: usize = 128;
    let trellis = w.trellis();
    // Band-major results `[band][row][128]`, then scattered into token-major `y`.
    let mut bands = vec![0.0f32; n * out];
    bands
        .par_chunks_mut(n * BAND)
        .enumerate()
        .for_each(|(b, buf)| {
            let tn0 = b * BAND / 16;
            exl3::matmul_inner(&w.shape, trellis, &xh, n, tn0, tn0 + BAND / 16, buf);
            for r in buf.chunks_mut(BAND) {
                exl3::hadamard128(r);
                r.iter_mut()
                    .zip(&w.svh[b * BAND..(b + 1) * BAND])
                    .for_each(|(v, s)| *v *= s);
            }
        });
    for (b, buf) in bands.chunks(n * BAND).enumerate() {
        for (t, r) in buf.chunks(BAND).enumerate() {
            y[t * out + b * BAND..t * out + (b + 1) * BAND].copy_from_slice(r);
        }
    }
}
