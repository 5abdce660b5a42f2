//! EXL3 matmul throughput on one core: weights decoded and multiplied per second for a
//! 4096x14336 layer, K = 2, 3, 4 on each codebook, 1/4/16 activation rows, on every kernel level
//! this machine has; next to the dense F32 and Q4_0 dot kernels on the same shape.
//!
//!     cargo run --release -p trellm-quant --example exl3_bench [-- K_IN N_OUT [LEVEL...]]
//!
//! LEVEL is scalar, avx2 or avx512 (default: all available); `mul1`, `mcg`, `inst3` pick
//! codebooks (default: all), `nodense` skips the F32/Q4_0 references. Timings are best-of-5 runs of
//! ~0.1 s each, so other load on the machine shows as little as possible.

use std::time::Instant;

use trellm_quant::exl3::simd::{available_levels, matmul_inner_with, Level};
use trellm_quant::exl3::{self, Bitrate, Codebook, Exl3Shape};
use trellm_quant::{dot_block, GgmlType};

const ROWS: [usize; 3] = [1, 4, 16];

/// Best-of-5 G weights/s of `f`, which processes `weights` weights per call.
fn rate(weights: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::MAX;
    for _ in 0..5 {
        let (t, mut iters) = (Instant::now(), 0);
        while iters < 1 || t.elapsed().as_secs_f64() < 0.1 {
            f();
            iters += 1;
        }
        best = best.min(t.elapsed().as_secs_f64() / iters as f64);
    }
    weights as f64 / best / 1e9
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let nums: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let (k, n) = (
        *nums.first().unwrap_or(&4096),
        *nums.get(1).unwrap_or(&14336),
    );
    let named: Vec<Level> = available_levels()
        .into_iter()
        .filter(|l| args.iter().any(|a| a == l.name()))
        .collect();
    let levels = if named.is_empty() {
        available_levels()
    } else {
        named
    };
    // A xorshift stream: trellis contents are uniform bits for any real encoder anyway.
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let xs: Vec<Vec<f32>> = ROWS
        .iter()
        .map(|&m| {
            (0..m * k)
                .map(|_| (next() % 1000) as f32 / 500.0 - 1.0)
                .collect()
        })
        .collect();
    println!("{k}x{n} (in x out), one thread, G weights/s (best of 5)");
    println!(
        "{:<8} {:<6} {:>3} {:>8} {:>8} {:>8}  {:>6}",
        "kernel", "format", "K", "1 row", "4 rows", "16 rows", "16/1"
    );
    let print = |kernel: &str, fmt: &str, bits: &str, r: &[f64]| {
        println!(
            "{kernel:<8} {fmt:<6} {bits:>3} {:>8.3} {:>8.3} {:>8.3}  {:>5.2}x",
            r[0],
            r[1],
            r[2],
            r[0] / r[2]
        );
    };
    let cbs: Vec<Codebook> = [Codebook::Mul1, Codebook::Mcg, Codebook::Inst3]
        .into_iter()
        .filter(|cb| {
            let name = format!("{cb:?}").to_lowercase();
            !args
                .iter()
                .any(|a| ["mul1", "mcg", "inst3"].contains(&a.as_str()))
                || args.contains(&name)
        })
        .collect();
    let dense = !args.iter().any(|a| a == "nodense");
    // Dense references: `dot_block` over all n stored rows of k values.
    for (ty, name) in [(GgmlType::F32, "F32"), (GgmlType::Q4_0, "Q4_0")] {
        if !dense {
            continue;
        }
        let bytes = ty.bytes_for(k).unwrap() * n;
        let w: Vec<u8> = match ty {
            GgmlType::F32 => (0..n * k)
                .flat_map(|_| ((next() % 1000) as f32 / 500.0 - 1.0).to_le_bytes())
                .collect(),
            // Q4_0 blocks: an fp16 scale (kept small and finite), then 16 bytes of nibbles.
            _ => (0..bytes / 18)
                .flat_map(|_| {
                    let mut b = [0u8; 18];
                    b[..2].copy_from_slice(&0x2C00u16.to_le_bytes());
                    b[2..].iter_mut().for_each(|v| *v = next() as u8);
                    b
                })
                .collect(),
        };
        let r: Vec<f64> = ROWS
            .iter()
            .zip(&xs)
            .map(|(&m, x)| {
                let mut y = vec![0.0f32; n * m];
                rate(k * n, || dot_block(ty, &w, n, x, m, &mut y))
            })
            .collect();
        print("dot", name, "", &r);
    }
    for &cb in &cbs {
        for rt in [
            Bitrate::int(2),
            Bitrate::half(2),
            Bitrate::int(3),
            Bitrate::int(4),
        ] {
            let bits = rt.bits().to_string();
            let shape = Exl3Shape::from_trellis(&[k / 16, n / 16, rt.tile_words()], cb).unwrap();
            let trellis: Vec<u8> = (0..shape.trellis_bytes()).map(|_| next() as u8).collect();
            for &level in &levels {
                let r: Vec<f64> = ROWS
                    .iter()
                    .zip(&xs)
                    .map(|(&m, x)| {
                        let mut y = vec![0.0f32; m * n];
                        rate(k * n, || {
                            matmul_inner_with(level, &shape, &trellis, x, m, 0, n / 16, &mut y)
                        })
                    })
                    .collect();
                print(level.name(), &format!("{cb:?}"), &bits, &r);
                std::hint::black_box(&trellis);
            }
            if cb == Codebook::Mul1 && exl3::simd::int16_available() {
                // The int16-activation path, and its error against the exact one:
                // RMS over all outputs of 16 rows, relative to the outputs' RMS.
                let r: Vec<f64> = ROWS
                    .iter()
                    .zip(&xs)
                    .map(|(&m, x)| {
                        let mut y = vec![0.0f32; m * n];
                        // The activations quantized once per call, as a layer does.
                        rate(k * n, || {
                            let q = exl3::simd::Int16Rows::new(x, m, k);
                            exl3::simd::matmul_inner_int16(&shape, &trellis, &q, 0, n / 16, &mut y)
                        })
                    })
                    .collect();
                let (x, m) = (&xs[2], 16);
                let (mut a, mut b) = (vec![0.0f32; m * n], vec![0.0f32; m * n]);
                exl3::matmul_inner(&shape, &trellis, x, m, 0, n / 16, &mut a);
                let q = exl3::simd::Int16Rows::new(x, m, k);
                exl3::simd::matmul_inner_int16(&shape, &trellis, &q, 0, n / 16, &mut b);
                let e2: f64 = a
                    .iter()
                    .zip(&b)
                    .map(|(p, q)| ((p - q) as f64).powi(2))
                    .sum();
                let y2: f64 = a.iter().map(|p| (*p as f64).powi(2)).sum();
                print("int16", &format!("{cb:?}"), &bits, &r);
                println!(
                    "{:>18} rel. RMS error vs exact: {:.2e}",
                    "",
                    (e2 / y2).sqrt()
                );
            }
        }
    }
}
