//! mlx's own float32 `exp`, `sin`/`cos` and `erf` on the CPU (Cephes-style polynomials, not
//! libm's), so that RoPE tables and exact GELU match the reference bit for bit.

// The constants are mlx's, digit for digit.
// mlx's 1.442695f is not LOG2_E to the last bit.
#[allow(clippy::excessive_precision, clippy::approx_constant)]
/// mlx's CPU `exp` for float32 (a Cephes polynomial on 2^x, not libm's).
pub fn mlx_exp(x_init: f32) -> f32 {
    if x_init.is_nan() {
        return x_init;
    }
    if x_init > 88.0 {
        return f32::INFINITY;
    }
    if x_init < -88.0 {
        return 0.0;
    }
    let x = x_init * 1.442695;
    let ipart = (x + 0.5).floor();
    let fpart = x - ipart;
    let mut p = 1.535336188319500e-4f32;
    p = p.mul_add(fpart, 1.339887440266574e-3);
    p = p.mul_add(fpart, 9.618437357674640e-3);
    p = p.mul_add(fpart, 5.550332471162809e-2);
    p = p.mul_add(fpart, 2.402264791363012e-1);
    p = p.mul_add(fpart, 6.931472028550421e-1);
    p = p.mul_add(fpart, 1.0);
    let two_i = f32::from_bits(((ipart as i32 + 127) << 23) as u32);
    two_i * p
}

#[allow(clippy::excessive_precision)]
/// mlx's CPU `sin` and `cos` for float32 (Cephes' single-precision polynomials); arguments past
/// 2^23 go to libm, as mlx does.
pub fn mlx_sin_cos(v: f32) -> (f32, f32) {
    if v.abs() > 8_388_608.0 {
        return v.sin_cos();
    }
    let negative = v < 0.0;
    let x = v.abs();
    let y = x * 1.27323954473516;
    let mut j = y as u32;
    j = (j + 1) & !1;
    let y = j as f32;
    let poly_swap = j & 2 != 0;
    let x = y.mul_add(-0.78515625, x);
    let x = y.mul_add(-2.4187564849853515625e-4, x);
    let x = y.mul_add(-3.77489497744594108e-8, x);
    let sin_negative = negative ^ (j & 4 != 0);
    let cos_positive = j.wrapping_sub(2) & 4 != 0;
    let z = x * x;
    let mut y1 = z.mul_add(2.443315711809948e-5, -1.388731625493765e-3);
    let mut y2 = z.mul_add(-1.9515295891e-4, 8.3321608736e-3);
    y1 = y1.mul_add(z, 4.166664568298827e-2);
    y2 = y2.mul_add(z, -1.6666654611e-1);
    y1 *= z;
    y2 *= z;
    y1 *= z;
    y2 = x.mul_add(y2, x);
    y1 = z.mul_add(-0.5, y1);
    y1 += 1.0;
    let s = if poly_swap { y1 } else { y2 };
    let c = if poly_swap { y2 } else { y1 };
    (
        if sin_negative { -s } else { s },
        if cos_positive { c } else { -c },
    )
}

#[allow(clippy::excessive_precision)]
/// mlx's CPU `erf` for float32 (used by its exact GELU).
pub fn mlx_erf(v: f32) -> f32 {
    let t = 1.0 / 0.3275911f32.mul_add(v.abs(), 1.0);
    let mut r = 1.061405429f32.mul_add(t, -1.453152027);
    r = r.mul_add(t, 1.421413741);
    r = r.mul_add(t, -0.284496736);
    r = r.mul_add(t, 0.254829592);
    let e = -mlx_exp(-v * v);
    let res = (e * t).mul_add(r, 1.0);
    if v > 0.0 {
        res
    } else {
        -res
    }
}
