//! EXL3 decoding against exllamav3 1.6.5 (`tests/fixtures/exl3/layers`, written by
//! `shared/oracle/exl3_oracle.py`): one random 256x384 layer quantized per codebook and bitrate,
//! with exllamav3's reconstructed `w_inner`, `w_recon` and its forward outputs `y1`, `y16`.
//!
//! `w_inner` and `w_recon` must be bit-identical; `y` within fp16 rounding of exllamav3's
//! (which rounds its activations and outputs to fp16 on the way).

use half::f16;
use safetensors::{Dtype, SafeTensors};
use trellm_quant::exl3::{self, Bitrate, Codebook, Exl3Shape};

fn fixture(cb: &str) -> Vec<u8> {
    let p = format!(
        "{}/../../tests/fixtures/exl3/layers/exl3_oracle_{cb}.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&p).unwrap_or_else(|e| panic!("{p}: {e}"))
}

fn f16s(st: &SafeTensors, name: &str) -> Vec<f16> {
    let t = st.tensor(name).unwrap_or_else(|_| panic!("no {name}"));
    assert_eq!(t.dtype(), Dtype::F16, "{name}");
    exl3::f16_values(t.data())
}

fn f32s(st: &SafeTensors, name: &str) -> Vec<f32> {
    f16s(st, name).iter().map(|v| v.to_f32()).collect()
}

/// The bitrate tags each file holds.
fn tags(cb: &str) -> Vec<&'static str> {
    let mut t = vec!["k1", "k2", "k3", "k4", "k5", "k6", "k8"];
    if cb == "mul1" {
        t.extend(["k1p5", "k2p5", "k3p5"]);
    }
    t
}

/// Decodes every tag of one codebook's fixture and checks `w_inner`, `w_recon`, `y1`, `y16`.
fn check_codebook(cb_name: &str, expected: Codebook) {
    let bytes = fixture(cb_name);
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut report = Vec::new();
    for tag in tags(cb_name) {
        let trellis = st.tensor(&format!("{tag}.trellis")).unwrap();
        assert_eq!(trellis.dtype(), Dtype::I16);
        let has = |s: &str| st.tensor(&format!("{tag}.{s}")).is_ok();
        let cb = match (has("mcg"), has("mul1")) {
            (true, _) => Codebook::Mcg,
            (_, true) => Codebook::Mul1,
            _ => Codebook::Inst3,
        };
        assert_eq!(cb, expected, "{cb_name} {tag}: codebook marker");
        let shape = Exl3Shape::from_trellis(trellis.shape(), cb).unwrap();
        assert_eq!((shape.k, shape.n), (256, 384));
        let want_k: f32 = tag[1..].replace('p', ".").parse().unwrap();
        assert_eq!(shape.rate.bits(), want_k, "{tag}");
        let data = trellis.data();

        // W_inner: every fp16 bit pattern equal.
        let inner = exl3::reconstruct_inner(&shape, data).unwrap();
        let want = f16s(&st, &format!("{tag}.w_inner"));
        let bad = inner
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            bad,
            0,
            "{cb_name} {tag}: {bad} of {} w_inner values differ",
            want.len()
        );

        // W = diag(suh) H W_inner H diag(svh), rounded as exllamav3 rounds.
        let suh = f16s(&st, &format!("{tag}.suh"));
        let svh = f16s(&st, &format!("{tag}.svh"));
        let recon = exl3::reconstruct(&shape, data, &suh, &svh).unwrap();
        let want = f16s(&st, &format!("{tag}.w_recon"));
        let bad = recon
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            bad,
            0,
            "{cb_name} {tag}: {bad} of {} w_recon values differ",
            want.len()
        );

        // Forward, both the f32 reference and the fast kernel, against exllamav3's fp16 outputs.
        let (suh, svh) = (
            suh.iter().map(|v| v.to_f32()).collect::<Vec<_>>(),
            svh.iter().map(|v| v.to_f32()).collect::<Vec<_>>(),
        );
        for (xn, yn, m) in [("x1", "y1", 1), ("x16", "y16", 16)] {
            let x = f32s(&st, xn);
            let want = f32s(&st, &format!("{tag}.{yn}"));
            let ours = exl3::forward(&shape, data, &suh, &svh, None, &x, m).unwrap();
            let fast = fast_forward(&shape, data, &suh, &svh, &x, m);
            let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let (mut worst, mut worst_fast) = (0.0f32, 0.0f32);
            let (mut rel, mut ulps) = (0.0f32, 0.0f32);
            for ((o, f), w) in ours.iter().zip(&fast).zip(&want) {
                rel = rel.max((o - w).abs() / scale);
                ulps = ulps.max((o - w).abs() / ulp16(*w));
                // fp16 rounding of the output itself, plus that of the fp16 activations and
                // partial sums upstream, which scale with the row's magnitude.
                let tol = 2.0 * ulp16(*w) + 2e-3 * scale;
                worst = worst.max((o - w).abs() / tol);
                worst_fast = worst_fast.max((f - w).abs() / tol);
                assert!(
                    (f - o).abs() <= 1e-4 * scale,
                    "{cb_name} {tag} {yn}: fast {f} vs reference {o}"
                );
            }
            assert!(
                worst <= 1.0,
                "{cb_name} {tag} {yn}: error {worst} x tolerance"
            );
            assert!(
                worst_fast <= 1.0,
                "{cb_name} {tag} {yn}: fast error {worst_fast} x tolerance"
            );
            report.push(format!(
                "{tag} {yn} {worst:.3} (rel {rel:.1e}, {ulps:.1} ulp)"
            ));
        }
    }
    eprintln!(
        "{cb_name}: worst |y - exllamav3| / tolerance: {}",
        report.join(", ")
    );
}

fn ulp16(v: f32) -> f32 {
    let h = f16::from_f32(v.abs());
    f16::from_bits(h.to_bits() + 1).to_f32() - h.to_f32()
}

/// The engine's path: Hadamard on the activations, tile kernel, Hadamard on the outputs.
fn fast_forward(
    shape: &Exl3Shape,
    data: &[u8],
    suh: &[f32],
    svh: &[f32],
    x: &[f32],
    m: usize,
) -> Vec<f32> {
    let mut xh: Vec<f32> = x
        .chunks(shape.k)
        .flat_map(|r| r.iter().zip(suh).map(|(a, s)| a * s))
        .collect();
    exl3::hadamard128(&mut xh);
    let mut y = vec![0.0f32; m * shape.n];
    exl3::matmul_inner(shape, data, &xh, m, 0, shape.tiles_n(), &mut y);
    exl3::hadamard128(&mut y);
    for r in y.chunks_mut(shape.n) {
        r.iter_mut().zip(svh).for_each(|(v, s)| *v *= s);
    }
    y
}

#[test]
fn inst3_matches_exllamav3() {
    check_codebook("3inst", Codebook::Inst3);
}

#[test]
fn mcg_matches_exllamav3() {
    check_codebook("mcg", Codebook::Mcg);
}

#[test]
fn mul1_matches_exllamav3() {
    check_codebook("mul1", Codebook::Mul1);
}

#[test]
fn bitrates_from_tile_words() {
    for k in 1..=8 {
        assert_eq!(
            Bitrate::from_tile_words(16 * k).unwrap(),
            Bitrate::int(k as u32)
        );
    }
    for k in 1..=3 {
        assert_eq!(
            Bitrate::from_tile_words(16 * k + 8).unwrap(),
            Bitrate::half(k as u32)
        );
    }
    for bad in [0, 8, 15, 17, 72, 136, 144] {
        assert!(Bitrate::from_tile_words(bad).is_err(), "{bad}");
    }
}

#[test]
fn legacy_packed_signs() {
    // Word 0 = 0b...0101: elements 0 and 2 negative; word 1 = 0x8000: element 31 negative.
    let packed = [0x05u8, 0x00, 0x00, 0x80];
    let s = exl3::unpack_signs(&packed);
    assert_eq!(s.len(), 32);
    for (i, v) in s.iter().enumerate() {
        let neg = matches!(i, 0 | 2 | 31);
        assert_eq!(v.to_f32(), if neg { -1.0 } else { 1.0 }, "{i}");
    }
}

#[test]
fn hadamard_is_its_own_inverse() {
    let mut x: Vec<f32> = (0..256)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
        .collect();
    let orig = x.clone();
    exl3::hadamard128(&mut x);
    assert!(x.iter().zip(&orig).any(|(a, b)| (a - b).abs() > 1e-3));
    exl3::hadamard128(&mut x);
    for (a, b) in x.iter().zip(&orig) {
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
}

/// The table-driven tile decoder the engine uses equals the scalar reference, for every codebook
/// and bitrate, on pseudo-random tiles (all bit patterns are valid trellis contents).
#[test]
fn fast_tile_decode_matches_reference() {
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let mut rates: Vec<Bitrate> = (1..=8).map(Bitrate::int).collect();
    rates.extend((1..=3).map(Bitrate::half));
    for cb in [Codebook::Inst3, Codebook::Mcg, Codebook::Mul1] {
        let table = exl3::codebook::table(cb);
        for &rate in &rates {
            for _ in 0..50 {
                let tile: Vec<u8> = (0..rate.tile_bytes())
                    .map(|_| {
                        s ^= s << 13;
                        s ^= s >> 7;
                        s ^= s << 17;
                        s as u8
                    })
                    .collect();
                let mut want = [f16::ZERO; 256];
                exl3::trellis::decode_tile(&tile, rate, cb, &mut want);
                let mut got = [0.0f32; 256];
                exl3::trellis::decode_tile_f32(&tile, rate, table, &mut got);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_f32().to_bits(),
                        "{cb:?} {rate:?} element {i}"
                    );
                }
            }
        }
    }
}
