//! The EXL3 tile encoder (`exl3::encode`) against our decoder and against exllamav3's own
//! encodings (`tests/fixtures/exl3/layers`, see `tests/exl3_layers.rs`).

use half::f16;
use safetensors::SafeTensors;
use trellm_quant::exl3::encode::{self, Scratch};
use trellm_quant::exl3::simd::{available_levels, best_level, Level};
use trellm_quant::exl3::trellis::decode_tile_f32;
use trellm_quant::exl3::{self, codebook, hadamard128, Bitrate, Codebook, Exl3Shape};

const CODEBOOKS: [Codebook; 3] = [Codebook::Inst3, Codebook::Mcg, Codebook::Mul1];

/// A small deterministic Gaussian source (Box-Muller over an LCG).
struct Rng(u64);
impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn gauss(&mut self) -> f32 {
        let (a, b) = (self.uniform(), self.uniform());
        ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
    }
}

/// The codebooks' RMS: 3INST/MCG's 1.2437 (exllamav3's `codebook_scale`); MUL1's byte sum has
/// a standard deviation of 147.8 and is divided by 147.77, so about 1.
fn cb_rms(cb: Codebook) -> f32 {
    match cb {
        Codebook::Mul1 => 1.0,
        _ => 1.243_710_9,
    }
}

fn gaussian_tile(rng: &mut Rng) -> [f32; 256] {
    std::array::from_fn(|_| 1.243_710_9 * rng.gauss())
}

/// Squared error in position order, as the encoder sums it.
fn position_error(tile: &[f32; 256], values: &[f32; 256]) -> f32 {
    exl3::POSITION_INDEX.iter().fold(0.0f32, |acc, &i| {
        let d = values[i as usize] - tile[i as usize];
        acc + d * d
    })
}

/// A real but simple encoding: the best first state, then each next symbol chosen greedily;
/// the stream's wrap-around then changes the first positions, so it is scored by decoding.
fn greedy(tile: &[f32; 256], k: u32, cb: Codebook) -> f32 {
    let table = codebook::table(cb);
    let t = |p: usize| tile[exl3::POSITION_INDEX[p] as usize];
    let sq = |s: usize, p: usize| (table[s] - t(p)) * (table[s] - t(p));
    let mut states = [0u16; 256];
    let mut s = (0..65536)
        .min_by(|&a, &b| sq(a, 0).total_cmp(&sq(b, 0)))
        .unwrap();
    states[0] = s as u16;
    for (p, st) in states.iter_mut().enumerate().skip(1) {
        let base = (s << k) & 0xFFFF;
        s = (base..base + (1 << k))
            .min_by(|&a, &b| sq(a, p).total_cmp(&sq(b, p)))
            .unwrap();
        *st = s as u16;
    }
    let bytes = encode::pack(&states, k);
    let mut out = [0.0f32; 256];
    decode_tile_f32(&bytes, Bitrate::int(k), table, &mut out);
    position_error(tile, &out)
}

#[test]
fn encodes_decode_to_reported_cost_and_beat_greedy() {
    let mut rng = Rng(42);
    for k in 1..=8u32 {
        let mut s = Scratch::new(k);
        for cb in CODEBOOKS {
            let tile = gaussian_tile(&mut rng);
            let e = encode::encode_tile(&tile, k, cb, &mut s);
            assert_eq!(e.bytes.len(), Bitrate::int(k).tile_bytes());
            let mut dec = [0.0f32; 256];
            decode_tile_f32(&e.bytes, Bitrate::int(k), codebook::table(cb), &mut dec);
            assert_eq!(dec, e.values, "K={k} {cb:?}: decoded values differ");
            let err = position_error(&tile, &dec);
            assert_eq!(
                err.to_bits(),
                e.cost.to_bits(),
                "K={k} {cb:?}: {err} vs {}",
                e.cost
            );
            let g = greedy(&tile, k, cb);
            assert!(e.cost <= g, "K={k} {cb:?}: viterbi {} > greedy {g}", e.cost);
        }
    }
}

#[test]
fn simd_matches_scalar() {
    let mut rng = Rng(7);
    for level in available_levels() {
        if level == Level::Scalar {
            continue;
        }
        for k in 1..=8u32 {
            let mut s = Scratch::new(k);
            for cb in CODEBOOKS {
                let tile = gaussian_tile(&mut rng);
                let a = encode::encode_tile_with(Level::Scalar, &tile, k, cb, &mut s);
                let b = encode::encode_tile_with(level, &tile, k, cb, &mut s);
                assert_eq!(a.bytes, b.bytes, "{level:?} K={k} {cb:?}");
                assert_eq!(a.cost.to_bits(), b.cost.to_bits(), "{level:?} K={k} {cb:?}");
                let targets: [f32; 256] =
                    std::array::from_fn(|p| tile[exl3::POSITION_INDEX[p] as usize]);
                let (oa, ob) = (
                    encode::open_cost_with(Level::Scalar, &mut s, cb, &targets),
                    encode::open_cost_with(level, &mut s, cb, &targets),
                );
                assert_eq!(oa.to_bits(), ob.to_bits(), "{level:?} K={k} {cb:?} open");
                assert!(
                    oa <= a.cost,
                    "K={k} {cb:?}: open {oa} > circular {}",
                    a.cost
                );
            }
        }
    }
}

/// The batch entry points (on AVX-512: tiles searched four at a time by one step) give what
/// the one-tile search gives (tied to the scalar twin by `simd_matches_scalar`), tile by tile,
/// including the tiles left over from the groups and tiles whose costs start infinite (a NaN
/// target).
#[test]
fn batched_search_matches_one_tile_search() {
    let mut rng = Rng(11);
    for k in 1..=8u32 {
        let mut s = Scratch::new(k);
        for cb in CODEBOOKS {
            let mut tiles: Vec<[f32; 256]> = (0..7).map(|_| gaussian_tile(&mut rng)).collect();
            tiles[2][17] = f32::NAN;
            let encoded = encode::encode_tiles(&tiles, k, cb);
            let open = encode::open_costs(&tiles, k, cb);
            for (i, tile) in tiles.iter().enumerate() {
                let a = encode::encode_tile(tile, k, cb, &mut s);
                assert_eq!(a.bytes, encoded[i].bytes, "K={k} {cb:?} tile {i}");
                assert_eq!(
                    a.cost.to_bits(),
                    encoded[i].cost.to_bits(),
                    "K={k} {cb:?} tile {i}"
                );
                let targets: [f32; 256] =
                    std::array::from_fn(|p| tile[exl3::POSITION_INDEX[p] as usize]);
                let o = encode::open_cost_with(best_level(), &mut s, cb, &targets);
                assert_eq!(o.to_bits(), open[i].to_bits(), "K={k} {cb:?} tile {i} open");
            }
        }
    }
}

/// Gaussian MSE per weight (relative to the variance) near QTIP's published rates for a
/// computed-code bitshift trellis (about 0.069 at 2 bits; rate-distortion bound 2^-2K).
#[test]
fn gaussian_distortion_near_theory() {
    let mut rng = Rng(3);
    let unit: Vec<[f32; 256]> = (0..8)
        .map(|_| std::array::from_fn(|_| rng.gauss()))
        .collect();
    for (k, hi) in [(1u32, 0.30f32), (2, 0.080), (3, 0.022), (4, 0.0062)] {
        for cb in CODEBOOKS {
            let var = cb_rms(cb) * cb_rms(cb);
            let tiles: Vec<[f32; 256]> = unit.iter().map(|t| t.map(|v| v * cb_rms(cb))).collect();
            let enc = encode::encode_tiles(&tiles, k, cb);
            let mse = enc.iter().map(|e| e.cost).sum::<f32>() / (256.0 * tiles.len() as f32);
            let rel = mse / var;
            let bound = 2f32.powi(-2 * k as i32);
            eprintln!("K={k} {cb:?}: relative MSE {rel:.4} (bound {bound:.4})");
            assert!(rel > bound && rel < hi, "K={k} {cb:?}: relative MSE {rel}");
        }
    }
}

#[test]
fn non_finite_targets_give_a_valid_stream() {
    let mut tile = [0.5f32; 256];
    tile[3] = f32::NAN;
    tile[100] = f32::INFINITY;
    tile[200] = -1e38;
    for k in [1u32, 3, 8] {
        let mut s = Scratch::new(k);
        let e = encode::encode_tile(&tile, k, Codebook::Mul1, &mut s);
        assert_eq!(e.bytes.len(), Bitrate::int(k).tile_bytes());
        assert!(e.values.iter().all(|v| v.is_finite()));
    }
}

fn fixture(cb: &str) -> Vec<u8> {
    let p = format!(
        "{}/../../tests/fixtures/exl3/layers/exl3_oracle_{cb}.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&p).unwrap_or_else(|e| panic!("{p}: {e}"))
}

fn f32s(st: &SafeTensors, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap_or_else(|_| panic!("no {name}"));
    match t.dtype() {
        safetensors::Dtype::F16 => exl3::f16_values(t.data())
            .iter()
            .map(|v| v.to_f32())
            .collect(),
        safetensors::Dtype::F32 => t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        d => panic!("{name}: {d:?}"),
    }
}

/// `H diag(1/suh) W diag(1/svh) H`, 128-blocked: the weight in the inner (`W_inner`) frame
/// that exllamav3's trellis approximates.
fn inner_target(w: &[f32], suh: &[f32], svh: &[f32], k: usize, n: usize) -> Vec<f32> {
    let mut t: Vec<f32> = (0..k * n).map(|i| w[i] / suh[i / n] / svh[i % n]).collect();
    for r in t.chunks_mut(n) {
        hadamard128(r);
    }
    let mut col = vec![0.0f32; k];
    for c in 0..n {
        for r in 0..k {
            col[r] = t[r * n + c];
        }
        hadamard128(&mut col);
        for r in 0..k {
            t[r * n + c] = col[r];
        }
    }
    t
}

/// On the tiles of exllamav3's own layers: our encoding of the inner-frame weight is at least
/// as close to it as exllamav3's stored trellis (which LDLQ pulled off the plain optimum).
#[test]
fn no_worse_than_exllamav3_on_its_layers() {
    for (name, cb) in [
        ("3inst", Codebook::Inst3),
        ("mcg", Codebook::Mcg),
        ("mul1", Codebook::Mul1),
    ] {
        let bytes = fixture(name);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let w = f32s(&st, "weight");
        let (k, n) = (256, 384);
        for kb in [1u32, 2, 3, 4, 5, 6, 8] {
            let tag = format!("k{kb}");
            let tr = st.tensor(&format!("{tag}.trellis")).unwrap();
            let shape = Exl3Shape::from_trellis(tr.shape(), cb).unwrap();
            let target = inner_target(
                &w,
                &f32s(&st, &format!("{tag}.suh")),
                &f32s(&st, &format!("{tag}.svh")),
                k,
                n,
            );
            // 12 tiles of the first tile row.
            let tiles: Vec<[f32; 256]> = (0..12)
                .map(|tn| std::array::from_fn(|i| target[(i / 16) * n + 16 * tn + i % 16]))
                .collect();
            let ours: f64 = encode::encode_tiles(&tiles, kb, cb)
                .iter()
                .map(|e| e.cost as f64)
                .sum();
            let mut theirs = 0.0f64;
            let mut dec = [0.0f32; 256];
            for (tn, t) in tiles.iter().enumerate() {
                decode_tile_f32(
                    shape.tile(tr.data(), 0, tn),
                    shape.rate,
                    codebook::table(cb),
                    &mut dec,
                );
                theirs += position_error(t, &dec) as f64;
            }
            eprintln!("{name} K={kb}: ours/exllamav3 MSE {:.4}", ours / theirs);
            assert!(
                ours <= 1.05 * theirs,
                "{name} K={kb}: ours {ours} vs exllamav3 {theirs}"
            );
        }
    }
    let _ = f16::ZERO;
}
