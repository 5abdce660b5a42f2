//! EXL3 prefill on the CPU: the tile kernels (each tile decoded once per 16 rows) against
//! decode-to-f32 + GEMM, on one layer, at one and two threads, interleaved in the same run.
//!
//!     cargo run --release -p trellm-quant --example exl3_prefill_bench [-- K_IN N_OUT ROWS [REPS]]
//!
//! Defaults: a 4096x14336 (in x out) 3-bit MUL1 layer, 512 rows, 5 repetitions; each line is the
//! best of the repetitions. `sweep` as an argument times a few row counts on a 4096x4096 layer
//! instead (where the two paths cross).

use std::time::Instant;

use trellm_quant::exl3::matmul::{
    matmul_gemm, matmul_gemm_int16, matmul_tiles, Activations::Exact, Layer,
};
use trellm_quant::exl3::{Bitrate, Codebook, Exl3Shape};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let nums: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let sweep = args.iter().any(|a| a == "sweep");
    let (k, n) = if sweep {
        (4096, 4096)
    } else {
        (
            *nums.first().unwrap_or(&4096),
            *nums.get(1).unwrap_or(&14336),
        )
    };
    let rows_list: Vec<usize> = if sweep {
        vec![8, 16, 24, 32, 48, 64]
    } else {
        vec![*nums.get(2).unwrap_or(&512)]
    };
    let reps = *nums.get(3).unwrap_or(&5);
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let rate = Bitrate::int(3);
    let shape =
        Exl3Shape::from_trellis(&[k / 16, n / 16, rate.tile_bytes() / 2], Codebook::Mul1).unwrap();
    let trellis: Vec<u8> = (0..shape.trellis_bytes()).map(|_| next() as u8).collect();
    let mut f = || (next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
    let suh: Vec<f32> = (0..k).map(|_| f() * 0.1).collect();
    let svh: Vec<f32> = (0..n).map(|_| f() * 0.1).collect();
    let pools: Vec<rayon::ThreadPool> = [1, 2]
        .iter()
        .map(|&t| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .unwrap()
        })
        .collect();
    println!("EXL3 MUL1 K=3, {k}x{n} (in x out), best of {reps}, seconds per call");
    for rows in rows_list {
        let x: Vec<f32> = (0..rows * k).map(|_| f()).collect();
        let mut y = vec![0.0f32; rows * n];
        // best[pool][path]
        let mut best = [[f64::MAX; 3]; 2];
        for _ in 0..reps {
            for (pi, pool) in pools.iter().enumerate() {
                for (path, b) in best[pi].iter_mut().enumerate() {
                    let t = Instant::now();
                    pool.install(|| match path {
                        0 => matmul_tiles(&shape, &trellis, &suh, &svh, &x, rows, &mut y, Exact),
                        1 => matmul_gemm(&shape, &trellis, &suh, &svh, &x, rows, &mut y),
                        _ => {
                            let l = Layer {
                                shape: &shape,
                                trellis: &trellis,
                                suh: &suh,
                                svh: &svh,
                            };
                            matmul_gemm_int16(l, &x, rows, &mut y)
                        }
                    });
                    *b = b.min(t.elapsed().as_secs_f64());
                }
            }
        }
        for (pi, b) in best.iter().enumerate() {
            let gflop = 2.0 * (rows * k * n) as f64 / 1e9;
            println!(
                "rows {rows:4}, {} thread(s): tiles {:.4} s ({:.1} GFLOP/s), gemm {:.4} s ({:.1} GFLOP/s), int16 gemm {:.4} s ({:.1} GFLOP/s), gemm / int16 {:.2}x",
                pi + 1,
                b[0],
                gflop / b[0],
                b[1],
                gflop / b[1],
                b[2],
                gflop / b[2],
                b[1] / b[2]
            );
        }
    }
}
