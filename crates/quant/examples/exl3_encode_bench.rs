//! Tiles per second of the EXL3 tile encoder (`exl3::encode::encode_tiles`, as the quantizer
//! calls it), per K and codebook, on one thread and on all of the pool's threads:
//! `cargo run --release -p trellm-quant --example exl3_encode_bench [K...]`.

use std::time::Instant;

use trellm_quant::exl3::encode::encode_tiles;
use trellm_quant::exl3::Codebook;

fn main() {
    let ks: Vec<u32> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let ks = if ks.is_empty() { vec![2, 3, 4] } else { ks };
    let mut seed = 1u64;
    let mut next = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0
    };
    let threads = rayon::current_num_threads();
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    for &k in &ks {
        for cb in [Codebook::Mul1, Codebook::Mcg, Codebook::Inst3] {
            let tiles: Vec<[f32; 256]> = (0..32 * threads)
                .map(|_| std::array::from_fn(|_| next()))
                .collect();
            // Warm-up: the search tables and each thread's scratch.
            one.install(|| encode_tiles(&tiles[..8], k, cb));
            encode_tiles(&tiles, k, cb);
            let t = Instant::now();
            one.install(|| encode_tiles(&tiles[..32], k, cb));
            let single = 32.0 / t.elapsed().as_secs_f64();
            let t = Instant::now();
            encode_tiles(&tiles, k, cb);
            let all = tiles.len() as f64 / t.elapsed().as_secs_f64();
            println!("K={k} {cb:?}: {single:.0} tiles/s on 1 thread, {all:.0} on {threads}");
        }
    }
}
