//! The exact CPU path: f32 arithmetic on weights decoded row by row from their stored blocks.

use rayon::prelude::*;

use crate::model::weights::Matrix;

/// Rows per parallel task: large enough to amortize scheduling, small enough to balance.
const ROWS_PER_TASK: usize = 16;

/// f32 dot product with several independent accumulators, so the compiler can vectorize it.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
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

/// `y[t][r] = sum_c x[t][c] * w[r][c]` for `n` activation rows. Each weight row is decoded once
/// and used for every activation row.
pub fn matmul(x: &[f32], n: usize, w: &Matrix, y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    debug_assert_eq!(x.len(), n * cols);
    debug_assert_eq!(y.len(), n * rows);
    if n == 1 {
        y.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each_init(
            || vec![0.0f32; cols],
            |buf, (chunk, out)| {
                for (i, o) in out.iter_mut().enumerate() {
                    w.dequantize_row(chunk * ROWS_PER_TASK + i, buf);
                    *o = dot(buf, x);
                }
            },
        );
        return;
    }
    // Row-major over weights, then transposed into token-major output.
    let mut yt = vec![0.0f32; n * rows];
    yt.par_chunks_mut(ROWS_PER_TASK * n)
        .enumerate()
        .for_each_init(
            || vec![0.0f32; cols],
            |buf, (chunk, out)| {
                for (i, orow) in out.chunks_mut(n).enumerate() {
                    w.dequantize_row(chunk * ROWS_PER_TASK + i, buf);
                    for (t, o) in orow.iter_mut().enumerate() {
                        *o = dot(buf, &x[t * cols..(t + 1) * cols]);
                    }
                }
            },
        );
    for r in 0..rows {
        for t in 0..n {
            y[t * rows + r] = yt[r * n + t];
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

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
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
