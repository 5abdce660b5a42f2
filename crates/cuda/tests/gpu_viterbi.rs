//! GPU tests of the EXL3 tile encoder (`crates/cuda/src/viterbi.rs`) against the CPU's
//! (`trellm_quant::exl3::encode`) in the same binary: the same states, bytes, values and f32 cost
//! for every codebook x K on seeded Gaussian tiles and on odd ones (scaled, outliers, zeros,
//! non-finite). Ignored here; run with `--include-ignored` on the GPU machine. `throughput` prints
//! (and with `TRELLM_RESULTS=<file>` appends as JSON lines) the tiles/s per K.

mod common;

use common::gpu;

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use trellm_cuda::viterbi::ViterbiGpu;
use trellm_quant::exl3::encode::{self, Scratch};
use trellm_quant::exl3::simd::best_level;
use trellm_quant::exl3::Codebook;

const CODEBOOKS: [Codebook; 3] = [Codebook::Inst3, Codebook::Mcg, Codebook::Mul1];

fn gaussian(n: usize, seed: u64) -> Vec<[f32; 256]> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            std::array::from_fn(|_| {
                // Box-Muller.
                let (u, v): (f64, f64) = (r.gen_range(1e-12..1.0), r.gen());
                ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
            })
        })
        .collect()
}

/// Gaussian tiles, then odd ones: scaled by 1/16 and 8, a few outliers, all zeros, constant,
/// with NaN and with +-inf.
fn tiles(n: usize, seed: u64) -> Vec<[f32; 256]> {
    let mut t = gaussian(n, seed);
    let g = gaussian(4, seed ^ 0xABCD);
    t.push(g[0].map(|v| v / 16.0));
    t.push(g[1].map(|v| v * 8.0));
    let mut o = g[2];
    o[3] = 40.0;
    o[100] = -25.0;
    o[255] = 1e6;
    t.push(o);
    t.push([0.0; 256]);
    t.push([0.75; 256]);
    let mut nan = g[3];
    nan[17] = f32::NAN;
    t.push(nan);
    let mut inf = g[0];
    inf[0] = f32::INFINITY;
    inf[200] = f32::NEG_INFINITY;
    t.push(inf);
    t
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the GPU machine"]
fn states_and_costs_match_the_cpu() {
    let mut enc = ViterbiGpu::new(gpu());
    let mut failures = Vec::new();
    for cb in CODEBOOKS {
        for k in 1..=8u32 {
            // Fewer tiles where the CPU is slow (small K has as many candidates per step, but
            // K = 1..2 run a scalar-ish step on few lanes); enough for several per block.
            let tl = tiles(if k <= 2 { 6 } else { 13 }, 1000 + k as u64);
            let t0 = Instant::now();
            let gpu_tiles = enc.encode_tiles(&tl, k, cb).unwrap();
            let gpu_s = t0.elapsed().as_secs_f64();
            let mut s = Scratch::new(k);
            let mut bad = 0;
            for (i, (t, g)) in tl.iter().zip(&gpu_tiles).enumerate() {
                let c = encode::encode_tile(t, k, cb, &mut s);
                let same = c.bytes == g.bytes
                    && c.cost.to_bits() == g.cost.to_bits()
                    && c.values
                        .iter()
                        .zip(&g.values)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                if !same {
                    bad += 1;
                    failures.push(format!(
                        "{cb:?} K={k} tile {i}: cpu cost {} gpu cost {}, bytes equal {}",
                        c.cost,
                        g.cost,
                        c.bytes == g.bytes
                    ));
                }
            }
            // The scale search's open streams (one pass, its best final cost).
            let targets: Vec<[f32; 256]> = tl.iter().map(encode::position_order).collect();
            let open = enc.open_costs(&targets, k, cb).unwrap();
            for (i, (t, g)) in targets.iter().zip(&open).enumerate() {
                let c = encode::open_cost_with(best_level(), &mut s, cb, t);
                // NaN (a tile with a NaN target) is NaN whatever its payload.
                if c.to_bits() != g.to_bits() && !(c.is_nan() && g.is_nan()) {
                    bad += 1;
                    failures.push(format!("{cb:?} K={k} tile {i}: open cost cpu {c} gpu {g}"));
                }
            }
            println!(
                "{cb:?} K={k}: {} tiles, {} differ (gpu {:.1} ms incl. compile)",
                tl.len(),
                bad,
                gpu_s * 1e3
            );
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the GPU machine"]
fn batches_of_any_size_match_one_at_a_time() {
    // Blocks loop over groups of tiles; group tails (TPB > 1 at K = 7, 8) and more tiles than
    // blocks must give what single tiles give.
    let mut enc = ViterbiGpu::new(gpu());
    let cb = Codebook::Mul1;
    for k in [3u32, 7, 8] {
        let tl = gaussian(2 * enc.gpu().sm_count * 4 + 3, 77 + k as u64);
        let all = enc.viterbi(&tl, k, cb).unwrap();
        for i in [0, 1, tl.len() / 2, tl.len() - 1] {
            let one = enc.viterbi(&tl[i..i + 1], k, cb).unwrap();
            assert_eq!(one[0].0, all[i].0, "K={k} tile {i}");
            assert_eq!(one[0].1.to_bits(), all[i].1.to_bits(), "K={k} tile {i}");
        }
    }
}

/// The first `n` tiles of `TRELLM_TILES` (a `.npy` of f32 N x 256, the tiles exllamav3's
/// quantizer is timed on in the same run: `scripts/gpu/prep_exllamav3_peer.sh`), else seeded
/// Gaussian ones.
fn bench_tiles(n: usize, seed: u64) -> Vec<[f32; 256]> {
    let Some(path) = std::env::var_os("TRELLM_TILES") else {
        return gaussian(n, seed);
    };
    let bytes = std::fs::read(&path).expect("TRELLM_TILES");
    assert_eq!(&bytes[..6], b"\x93NUMPY", "TRELLM_TILES is not a .npy file");
    let header = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let tiles: Vec<[f32; 256]> = bytes[10 + header..]
        .chunks_exact(1024)
        .take(n)
        .map(|t| {
            std::array::from_fn(|i| f32::from_le_bytes(t[4 * i..4 * i + 4].try_into().unwrap()))
        })
        .collect();
    assert_eq!(tiles.len(), n, "TRELLM_TILES holds fewer than {n} tiles");
    tiles
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on the GPU machine"]
fn throughput() {
    let mut enc = ViterbiGpu::new(gpu());
    let mut out = common::results();
    let sms = enc.gpu().sm_count;
    let name = enc.gpu().name.clone();
    let cb = Codebook::Mul1;
    for k in 1..=8u32 {
        // Sixteen waves of blocks; the call's time (upload, kernel, download, the cost summed on
        // the host), best of three, as exllamav3's quantizer is timed in the same run.
        let per_block = if k >= 6 { 1 << (k - 6) } else { 1 };
        let n = sms * per_block * 16;
        let tl = bench_tiles(n, 5 + k as u64);
        enc.viterbi(&tl[..1], k, cb).unwrap(); // compile + warm
        let mut best = f64::INFINITY;
        let mut mse = 0.0;
        for _ in 0..3 {
            let t0 = Instant::now();
            let r = enc.viterbi(&tl, k, cb).unwrap();
            best = best.min(t0.elapsed().as_secs_f64());
            assert_eq!(r.len(), n);
            mse = r.iter().map(|(_, c)| *c as f64).sum::<f64>() / (256 * n) as f64;
        }
        out(format!(
            "{{\"test\":\"viterbi_throughput\",\"gpu\":\"{name}\",\"codebook\":\"{}\",\"k\":{k},\"tiles\":{n},\"seconds\":{best:.4},\"tiles_per_s\":{:.1},\"mse\":{mse:.6e}}}",
            cb.name(),
            n as f64 / best
        ));
    }
}
