//! Mean squared error per weight of our tile encoder on tiles from a `.npy` file (f32, N x 256,
//! as `scripts/gpu/prep_exllamav3_peer.sh` writes them for exllamav3's `quantize_tiles`), to
//! compare the two encoders' quality on the same tiles:
//! `cargo run --release -p trellm-quant --example exl3_tiles_mse -- FILE.npy N K...`.

use trellm_quant::exl3::encode::encode_tiles;
use trellm_quant::exl3::Codebook;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (path, n) = (&args[0], args[1].parse::<usize>().expect("N"));
    let bytes = std::fs::read(path).expect("the .npy file");
    assert_eq!(&bytes[..6], b"\x93NUMPY", "not a .npy file");
    let header = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let data: Vec<f32> = bytes[10 + header..]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let tiles: Vec<[f32; 256]> = data
        .chunks_exact(256)
        .take(n)
        .map(|t| t.try_into().unwrap())
        .collect();
    for k in args[2..].iter().map(|k| k.parse::<u32>().expect("K")) {
        let t = std::time::Instant::now();
        let cost: f64 = encode_tiles(&tiles, k, Codebook::Mul1)
            .iter()
            .map(|e| e.cost as f64)
            .sum();
        println!(
            "K={k} mul1: {} tiles, mse {:.6} ({:.0} tiles/s)",
            tiles.len(),
            cost / (256 * tiles.len()) as f64,
            tiles.len() as f64 / t.elapsed().as_secs_f64()
        );
    }
}
