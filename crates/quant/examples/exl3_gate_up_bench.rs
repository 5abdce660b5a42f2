//! A gated MLP's gate and up projections on EXL3 weights: two `matmul_tiles` calls and the
//! activation after, against `matmul_tiles_gated` (one pass over both weights per band of outputs,
//! the activation fused), at the Llama-3.1-8B (4096 -> 14336) and SmolLM2 (640 -> 1536, its 576
//! inputs padded) shapes, 1 and 4 rows, on the threads rayon gives (`RAYON_NUM_THREADS`).
//!
//!     cargo run --release -p trellm-quant --example exl3_gate_up_bench [-- K]
//!
//! Best-of-7 runs of ~0.2 s each; the outputs of both are checked equal, bit for bit.

use std::time::Instant;

use trellm_quant::exl3::matmul::{matmul_tiles, matmul_tiles_gated, Activations::Exact, Layer};
use trellm_quant::exl3::{Bitrate, Codebook, Exl3Shape};

fn best_ms(mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::MAX;
    for _ in 0..7 {
        let (t, mut iters) = (Instant::now(), 0);
        while iters < 1 || t.elapsed().as_secs_f64() < 0.2 {
            f();
            iters += 1;
        }
        best = best.min(t.elapsed().as_secs_f64() / iters as f64);
    }
    best * 1e3
}

fn silu_mul(g: &mut [f32], u: &[f32]) {
    g.iter_mut()
        .zip(u)
        .for_each(|(g, u)| *g = *g / (1.0 + (-*g).exp()) * u);
}

fn main() {
    let bits: u32 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(3);
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    println!("threads {}, MUL1 K = {bits}", rayon::current_num_threads());
    for (k, n) in [(4096usize, 14336usize), (640, 1536)] {
        let shape = Exl3Shape {
            k,
            n,
            rate: Bitrate::int(bits),
            codebook: Codebook::Mul1,
        };
        let words = |next: &mut dyn FnMut() -> u64| -> Vec<u8> {
            (0..shape.trellis_bytes()).map(|_| next() as u8).collect()
        };
        let scales = |len: usize, next: &mut dyn FnMut() -> u64| -> Vec<f32> {
            (0..len)
                .map(|_| if next() & 1 == 0 { 0.01 } else { -0.01 })
                .collect()
        };
        let (tg, tu) = (words(&mut next), words(&mut next));
        let (sg, su) = (scales(k, &mut next), scales(k, &mut next));
        let (vg, vu) = (scales(n, &mut next), scales(n, &mut next));
        let gate = Layer {
            shape: &shape,
            trellis: &tg,
            suh: &sg,
            svh: &vg,
        };
        let up = Layer {
            shape: &shape,
            trellis: &tu,
            suh: &su,
            svh: &vu,
        };
        for rows in [1usize, 4] {
            let x: Vec<f32> = (0..rows * k)
                .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            let (mut g, mut u, mut f) = (
                vec![0.0f32; rows * n],
                vec![0.0f32; rows * n],
                vec![0.0f32; rows * n],
            );
            let apart = best_ms(|| {
                matmul_tiles(&shape, &tg, &sg, &vg, &x, rows, &mut g, Exact);
                matmul_tiles(&shape, &tu, &su, &vu, &x, rows, &mut u, Exact);
                silu_mul(&mut g, &u);
            });
            let fused =
                best_ms(|| matmul_tiles_gated(gate, up, &x, rows, &mut f, &silu_mul, Exact));
            assert!(
                f.iter().zip(&g).all(|(a, b)| a.to_bits() == b.to_bits()),
                "the fused result differs"
            );
            println!(
                "{k} -> 2 x {n}, {rows} row(s): apart {apart:.3} ms, fused {fused:.3} ms, speed-up {:.3}x",
                apart / fused
            );
        }
    }
}
