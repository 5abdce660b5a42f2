//! The 128-point Sylvester Hadamard transform, `H[i][j] = (-1)^popcount(i & j) / sqrt(128)`.

/// 1/sqrt(128) rounded to f32 (0x3DB504F3), as exllamav3 scales its f32 Hadamard matrix; one
/// ulp off and about 1% of reconstructed fp16 weights change.
pub const SCALE: f32 = std::f32::consts::FRAC_1_SQRT_2 / 8.0;

/// `H` as a row-major f32 matrix (the reference reconstruct multiplies by it explicitly).
pub fn scaled_sign_matrix() -> Vec<f32> {
    (0..128 * 128usize)
        .map(|ij| {
            let (i, j) = (ij / 128, ij % 128);
            if (i & j).count_ones() % 2 == 0 {
                SCALE
            } else {
                -SCALE
            }
        })
        .collect()
}

/// In place, on every 128-block of `x` (whose length must be a multiple of 128): the fast
/// Walsh-Hadamard butterfly, then the 1/sqrt(128) scale. `H` is symmetric, so this is both
/// `H x` and `x H`.
pub fn hadamard128(x: &mut [f32]) {
    assert!(x.len().is_multiple_of(128), "Hadamard blocks are 128 wide");
    for b in x.chunks_exact_mut(128) {
        let mut h = 1;
        while h < 128 {
            for i in (0..128).step_by(2 * h) {
                for j in i..i + h {
                    let (a, c) = (b[j], b[j + h]);
                    b[j] = a + c;
                    b[j + h] = a - c;
                }
            }
            h *= 2;
        }
        b.iter_mut().for_each(|v| *v *= SCALE);
    }
}
