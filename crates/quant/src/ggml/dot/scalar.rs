//! Portable path: decode a run of blocks with the exact reference decoders into a stack buffer,
//! then dot it with every activation row, so each block is still decoded only once.

use super::{decoder, Shape};

/// Values decoded per step: a multiple of every block length.
const RUN: usize = 256;

/// # Safety
/// `out` is valid for the writes `s` describes.
pub(super) unsafe fn run(s: &Shape, rows: &[u8], x: &[f32], out: *mut f32) {
    let decode = decoder(s.ty);
    let run_bytes = RUN / s.ty.block_len() * s.ty.block_bytes();
    let mut buf = [0f32; RUN];
    s.for_each_out(out, |o| *o = 0.0);
    for (i, row) in rows.chunks_exact(s.row_bytes).enumerate() {
        for (k, src) in row.chunks(run_bytes).enumerate() {
            let w = &mut buf[..src.len() / s.ty.block_bytes() * s.ty.block_len()];
            decode(src, w);
            let c0 = k * RUN;
            for t in 0..s.n {
                let xt = &x[t * s.cols + c0..t * s.cols + c0 + w.len()];
                *s.at(out, i, t) += dot(w, xt);
            }
        }
    }
}

/// Eight independent partial sums, so the compiler can keep them in one vector register.
fn dot(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (wc, xc) = (w.chunks_exact(8), x.chunks_exact(8));
    let tail: f32 = wc
        .remainder()
        .iter()
        .zip(xc.remainder())
        .map(|(a, b)| a * b)
        .sum();
    for (a, b) in wc.zip(xc) {
        for l in 0..8 {
            acc[l] += a[l] * b[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}
