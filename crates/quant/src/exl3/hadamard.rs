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
/// `H x` and `x H`. Runs the AVX-512 or AVX2 butterfly where the CPU has it (the same sums and
/// differences in the same order, so the same bits as [`hadamard128_scalar`]).
pub fn hadamard128(x: &mut [f32]) {
    assert!(x.len().is_multiple_of(128), "Hadamard blocks are 128 wide");
    #[cfg(target_arch = "x86_64")]
    {
        use crate::ggml::dot::Level;
        if Level::Avx512.is_available() {
            // SAFETY: AVX-512 F is available; `x` holds whole 128-blocks.
            unsafe { avx512::hadamard128(x) };
            return;
        }
        if Level::Avx2.is_available() {
            // SAFETY: AVX2 and FMA are available; `x` holds whole 128-blocks.
            unsafe { avx2::hadamard128(x) };
            return;
        }
    }
    hadamard128_scalar(x);
}

/// The unscaled butterfly of one 128-block `v`, times `col[c] * s`, written to `dst[0..128]`
/// (the prefill's last pass over a block of `W_eff`, fused). `dst` may be uninitialized.
///
/// # Safety
/// `dst` must be valid for 128 writes of f32.
pub unsafe fn butterfly128_scaled_into(v: &[f32; 128], col: &[f32], s: f32, dst: *mut f32) {
    assert_eq!(col.len(), 128);
    #[cfg(target_arch = "x86_64")]
    {
        use crate::ggml::dot::Level;
        if Level::Avx512.is_available() {
            // SAFETY: AVX-512 F is available; the caller vouches for `dst`.
            unsafe { avx512::butterfly128_scaled_into(v, col, s, dst) };
            return;
        }
        if Level::Avx2.is_available() {
            // SAFETY: AVX2 and FMA are available; the caller vouches for `dst`.
            unsafe { avx2::butterfly128_scaled_into(v, col, s, dst) };
            return;
        }
    }
    let mut b = *v;
    butterfly128(&mut b);
    for (c, (x, o)) in b.iter().zip(col).enumerate() {
        // SAFETY: the caller vouches for 128 writes.
        unsafe { dst.add(c).write(x * (o * s)) };
    }
}

/// The unscaled butterfly of one 128-block.
fn butterfly128(b: &mut [f32]) {
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
}

/// [`hadamard128`]'s scalar twin.
pub fn hadamard128_scalar(x: &mut [f32]) {
    assert!(x.len().is_multiple_of(128), "Hadamard blocks are 128 wide");
    for b in x.chunks_exact_mut(128) {
        butterfly128(b);
        b.iter_mut().for_each(|v| *v *= SCALE);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use core::arch::x86_64::*;

    /// One in-register stage of span `h` (1, 2 or 4 lanes), as the AVX-512 one: `v * (+-1) + p`
    /// with `p` the lane `j ^ h`, exact in the FMA.
    #[inline(always)]
    unsafe fn stage<const H: u32>(v: __m256) -> __m256 {
        let p = match H {
            1 => _mm256_permute_ps::<0b10_11_00_01>(v),
            2 => _mm256_permute_ps::<0b01_00_11_10>(v),
            _ => _mm256_permute2f128_ps::<0x01>(v, v),
        };
        let sign = match H {
            1 => _mm256_setr_ps(1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0),
            2 => _mm256_setr_ps(1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0),
            _ => _mm256_setr_ps(1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0),
        };
        _mm256_fmadd_ps(v, sign, p)
    }

    /// The unscaled butterfly of the 128 values at `p`.
    #[inline(always)]
    unsafe fn butterfly(p: *const f32) -> [__m256; 16] {
        // (No closures here: they would not inherit the caller's target features.)
        let mut v = [_mm256_setzero_ps(); 16];
        for (i, r) in v.iter_mut().enumerate() {
            *r = stage::<4>(stage::<2>(stage::<1>(_mm256_loadu_ps(p.add(8 * i)))));
        }
        // Spans of 8 to 64 lanes: between registers.
        for h in [1, 2, 4, 8] {
            for i in (0..16).step_by(2 * h) {
                for j in i..i + h {
                    let (a, c) = (v[j], v[j + h]);
                    v[j] = _mm256_add_ps(a, c);
                    v[j + h] = _mm256_sub_ps(a, c);
                }
            }
        }
        v
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn hadamard128(x: &mut [f32]) {
        let scale = _mm256_set1_ps(super::SCALE);
        for b in x.chunks_exact_mut(128) {
            let p = b.as_mut_ptr();
            for (i, r) in butterfly(p).iter().enumerate() {
                _mm256_storeu_ps(p.add(8 * i), _mm256_mul_ps(*r, scale));
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn butterfly128_scaled_into(
        v: &[f32; 128],
        col: &[f32],
        s: f32,
        dst: *mut f32,
    ) {
        let s = _mm256_set1_ps(s);
        for (i, r) in butterfly(v.as_ptr()).iter().enumerate() {
            let c = _mm256_mul_ps(_mm256_loadu_ps(col.as_ptr().add(8 * i)), s);
            _mm256_storeu_ps(dst.add(8 * i), _mm256_mul_ps(*r, c));
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use core::arch::x86_64::*;

    /// One in-register stage of span `h` (1, 2, 4 or 8 lanes): lane `j` becomes
    /// `v[j] + v[j ^ h]` where `j & h == 0` and `v[j ^ h] - v[j]` elsewhere, as one FMA with a
    /// sign of +-1 (exact, so the same rounding as the scalar sum or difference).
    #[inline(always)]
    unsafe fn stage(v: __m512, h: u32) -> __m512 {
        let idx: [i32; 16] = core::array::from_fn(|j| (j as u32 ^ h) as i32);
        let sign: [f32; 16] = core::array::from_fn(|j| if j as u32 & h == 0 { 1.0 } else { -1.0 });
        let p = _mm512_permutexvar_ps(_mm512_loadu_si512(idx.as_ptr().cast()), v);
        _mm512_fmadd_ps(v, _mm512_loadu_ps(sign.as_ptr()), p)
    }

    /// The unscaled butterfly of the 128 values at `p`, in registers.
    #[inline(always)]
    unsafe fn butterfly(p: *const f32) -> [__m512; 8] {
        let mut v: [__m512; 8] = core::array::from_fn(|i| _mm512_loadu_ps(p.add(16 * i)));
        for h in [1, 2, 4, 8] {
            for r in v.iter_mut() {
                *r = stage(*r, h);
            }
        }
        // Spans of 16, 32 and 64 lanes: between registers.
        for h in [1, 2, 4] {
            for i in (0..8).step_by(2 * h) {
                for j in i..i + h {
                    let (a, c) = (v[j], v[j + h]);
                    v[j] = _mm512_add_ps(a, c);
                    v[j + h] = _mm512_sub_ps(a, c);
                }
            }
        }
        v
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn hadamard128(x: &mut [f32]) {
        let scale = _mm512_set1_ps(super::SCALE);
        for b in x.chunks_exact_mut(128) {
            let p = b.as_mut_ptr();
            for (i, r) in butterfly(p).iter().enumerate() {
                _mm512_storeu_ps(p.add(16 * i), _mm512_mul_ps(*r, scale));
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn butterfly128_scaled_into(
        v: &[f32; 128],
        col: &[f32],
        s: f32,
        dst: *mut f32,
    ) {
        let s = _mm512_set1_ps(s);
        for (i, r) in butterfly(v.as_ptr()).iter().enumerate() {
            let c = _mm512_mul_ps(_mm512_loadu_ps(col.as_ptr().add(16 * i)), s);
            _mm512_storeu_ps(dst.add(16 * i), _mm512_mul_ps(*r, c));
        }
    }
}

#[cfg(test)]
mod tests {
    /// The vector butterfly against the scalar one, bit for bit, on values whose sums round.
    #[test]
    fn simd_equals_scalar() {
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        let x: Vec<f32> = (0..128 * 7)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 2_000_001) as f32 / 1e6 - 1.0 + (s >> 40) as f32 * 1e-9
            })
            .collect();
        let (mut a, mut b) = (x.clone(), x);
        super::hadamard128(&mut a);
        super::hadamard128_scalar(&mut b);
        assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()));
    }
}
