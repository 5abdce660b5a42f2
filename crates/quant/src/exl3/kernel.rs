//! The engine's EXL3 matmul: each tile decoded once (by table look-up) into a 16x16 f32 block
//! and used for every activation row, with the Hadamard-rotated activations.

use super::trellis::decode_tile_f32;
use super::{codebook, Exl3Shape};

/// `out[t][c] = sum_i xh[t][i] * W_inner[i][16 tn0 + c]` for the output tiles `tn0..tn1` and
/// `m` rows of `xh` (`[m][k]`, already `H(x * suh)`); `out` is `[m][16 (tn1 - tn0)]`,
/// overwritten. Runs the best kernel this machine has ([`super::simd`]).
#[allow(clippy::too_many_arguments)]
pub fn matmul_inner(
    shape: &Exl3Shape,
    trellis: &[u8],
    xh: &[f32],
    m: usize,
    tn0: usize,
    tn1: usize,
    out: &mut [f32],
) {
    super::simd::matmul_inner_with(
        super::simd::best_level(),
        shape,
        trellis,
        xh,
        m,
        tn0,
        tn1,
        out,
    );
}

/// The scalar path: each tile decoded by table look-up into f32, then multiplied. Arguments are
/// validated by its one caller, [`super::simd::matmul_inner_with`].
pub(crate) fn matmul_inner_scalar(
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
    let table = codebook::table(shape.codebook);
    out.fill(0.0);
    let mut tile = [0.0f32; 256];
    for tk in 0..shape.tiles_k() {
        for tn in tn0..tn1 {
            decode_tile_f32(shape.tile(trellis, tk, tn), shape.rate, table, &mut tile);
            let c0 = 16 * (tn - tn0);
            for t in 0..m {
                let x = &xh[t * k + 16 * tk..t * k + 16 * tk + 16];
                let acc: &mut [f32; 16] = (&mut out[t * width + c0..t * width + c0 + 16])
                    .try_into()
                    .unwrap();
                for (r, &a) in x.iter().enumerate() {
                    let w = &tile[16 * r..16 * r + 16];
                    for c in 0..16 {
                        acc[c] += a * w[c];
                    }
                }
            }
        }
    }
}
