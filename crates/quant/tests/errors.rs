//! `dequantize` rejects bad input with an error, never a panic, and the type table is consistent.

use trellm_quant::ggml::{dequantize, dequantize_row, GgmlType, QuantError};

/// Small deterministic generator (splitmix64), so failures reproduce without extra crates.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn supported() -> impl Iterator<Item = GgmlType> {
    GgmlType::ALL.into_iter().filter(|t| t.is_supported())
}

#[test]
fn ids_and_names_round_trip() {
    for t in GgmlType::ALL {
        assert_eq!(GgmlType::from_id(t.id()), Some(t));
        assert_eq!(t.bytes_for(t.block_len() * 3), Some(t.block_bytes() * 3));
        assert_eq!(t.bytes_for(0), Some(0));
    }
    let names: std::collections::HashSet<_> = GgmlType::ALL.iter().map(|t| t.name()).collect();
    assert_eq!(names.len(), GgmlType::ALL.len());
    for id in [4, 5, 31, 32, 33, 34, 39, u32::MAX] {
        assert_eq!(GgmlType::from_id(id), None, "id {id}");
    }
}

#[test]
fn supported_set_is_exactly_the_decoded_set() {
    use GgmlType::*;
    let want = [
        F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K, Q8K, IQ2XXS, IQ2XS,
        IQ2S, IQ3XXS, IQ3S, IQ4NL, IQ4XS,
    ];
    for t in GgmlType::ALL {
        assert_eq!(t.is_supported(), want.contains(&t), "{t:?}");
        let src = vec![0u8; t.block_bytes() * 2];
        let mut out = vec![0f32; t.block_len() * 2];
        let r = dequantize(t, &src, &mut out);
        assert_eq!(r.is_ok(), t.is_supported(), "{t:?}: {r:?}");
    }
}

#[test]
fn unsupported_types_name_the_type() {
    for t in GgmlType::ALL.into_iter().filter(|t| !t.is_supported()) {
        // Whatever the lengths, the type is reported first.
        for (src_len, out_len) in [(0, 0), (t.block_bytes(), t.block_len()), (1, 7)] {
            let src = vec![0u8; src_len];
            let mut out = vec![0f32; out_len];
            match dequantize(t, &src, &mut out) {
                Err(QuantError::Unsupported(name)) => {
                    assert_eq!(name, t.name());
                    let msg = QuantError::Unsupported(name).to_string();
                    assert!(msg.contains(t.name()), "{msg}");
                }
                other => panic!("{t:?}: {other:?}"),
            }
        }
    }
}

#[test]
fn truncated_input_is_misaligned() {
    for t in supported() {
        let bb = t.block_bytes();
        for blocks in [0, 1, 3] {
            for cut in 1..bb {
                let len = blocks * bb + cut;
                let src = vec![0x11u8; len];
                // Offer an output for the whole blocks and for one block more: neither may matter.
                for out_len in [blocks * t.block_len(), (blocks + 1) * t.block_len()] {
                    let mut out = vec![0f32; out_len];
                    match dequantize(t, &src, &mut out) {
                        Err(QuantError::Misaligned { ty, len: l, block }) => {
                            assert_eq!((ty, l, block), (t, len, bb));
                        }
                        other => panic!("{t:?} len {len}: {other:?}"),
                    }
                }
            }
        }
    }
}

#[test]
fn wrong_output_length_is_rejected_and_untouched() {
    for t in supported() {
        let (bb, bl) = (t.block_bytes(), t.block_len());
        for blocks in [0usize, 1, 2, 5] {
            let src = vec![0x5Au8; blocks * bb];
            let expected = blocks * bl;
            let mut lens = vec![expected + 1, expected + bl, 2 * expected + 1];
            if expected > 0 {
                lens.extend([0, expected - 1, expected.saturating_sub(bl)]);
            }
            for out_len in lens.into_iter().filter(|&n| n != expected) {
                let mut out = vec![-7.0f32; out_len];
                match dequantize(t, &src, &mut out) {
                    Err(QuantError::OutputSize {
                        ty,
                        out: o,
                        expected: e,
                    }) => {
                        assert_eq!((ty, o, e), (t, out_len, expected));
                    }
                    other => panic!("{t:?} {blocks} blocks into {out_len}: {other:?}"),
                }
                assert!(
                    out.iter().all(|&v| v == -7.0),
                    "{t:?}: output written on error"
                );
            }
        }
    }
}

#[test]
fn empty_input_is_fine() {
    for t in supported() {
        assert!(dequantize(t, &[], &mut []).is_ok(), "{t:?}");
        assert!(dequantize_row(t, &[], &mut []).is_ok(), "{t:?}");
    }
}

#[test]
fn random_inputs_never_panic_and_fail_only_for_a_reason() {
    let mut rng = Rng(0x7E11_5EED);
    for _ in 0..4000 {
        let t = GgmlType::ALL[rng.below(GgmlType::ALL.len())];
        let (bb, bl) = (t.block_bytes(), t.block_len());
        // Mostly well-formed sizes, with frequent off-by-a-little mistakes on either side.
        let blocks = rng.below(9);
        let src_len = match rng.below(4) {
            0 => rng.below(4 * bb + 3),
            _ => blocks * bb,
        };
        let out_len = match rng.below(4) {
            0 => rng.below(4 * bl + 3),
            _ => src_len / bb * bl,
        };
        let src = rng.bytes(src_len);
        let mut out = vec![0f32; out_len];
        let r = dequantize(t, &src, &mut out);
        let ok = t.is_supported() && src_len % bb == 0 && out_len == src_len / bb * bl;
        match (&r, ok) {
            (Ok(()), true) => {}
            (Err(QuantError::Unsupported(_)), false) if !t.is_supported() => {}
            (Err(QuantError::Misaligned { .. }), false) if src_len % bb != 0 => {}
            (Err(QuantError::OutputSize { .. }), false) => {}
            _ => panic!("{t:?} src {src_len} out {out_len}: {r:?}"),
        }
    }
}

#[test]
fn random_blocks_decode_the_same_whole_or_by_row() {
    let mut rng = Rng(42);
    for t in supported() {
        let (bb, bl) = (t.block_bytes(), t.block_len());
        let src = rng.bytes(64 * bb);
        let mut a = vec![0f32; 64 * bl];
        let mut b = vec![1f32; 64 * bl];
        dequantize(t, &src, &mut a).unwrap();
        dequantize_row(t, &src, &mut b).unwrap();
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{t:?}"
        );
    }
}

#[test]
fn hand_checked_blocks() {
    use GgmlType::*;
    let one = 0x3C00u16.to_le_bytes(); // fp16 1.0
    let half = 0x3800u16.to_le_bytes(); // fp16 0.5

    // Q4_0: byte j holds value j (low nibble) and value j + 16 (high nibble), offset by 8.
    let mut b = one.to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let mut y = [0f32; 32];
    dequantize(Q4_0, &b, &mut y).unwrap();
    for j in 0..16 {
        assert_eq!(y[j], j as f32 - 8.0);
        assert_eq!(y[j + 16], (15 - j) as f32 - 8.0);
    }

    // Q4_1: value = q * d + m.
    let mut b = half.to_vec();
    b.extend(one);
    b.extend([0x21u8; 16]);
    dequantize(Q4_1, &b, &mut y).unwrap();
    assert!(y[..16].iter().all(|&v| v == 1.5) && y[16..].iter().all(|&v| v == 2.0));

    // Q5_0: bit j of qh is bit 4 of value j.
    let mut b = one.to_vec();
    b.extend(0x8000_0001u32.to_le_bytes());
    b.extend([0xF0u8; 16]);
    dequantize(Q5_0, &b, &mut y).unwrap();
    assert_eq!(y[0], 0.0); // 0 | 16 - 16
    assert_eq!(y[1], -16.0);
    assert_eq!(y[16], -1.0); // 15 - 16
    assert_eq!(y[31], 15.0); // 15 | 16 - 16

    // Q8_0: signed bytes times d.
    let mut b = half.to_vec();
    b.extend((0..32u8).map(|j| (j as i8 - 16) as u8));
    dequantize(Q8_0, &b, &mut y).unwrap();
    for (j, v) in y.iter().enumerate() {
        assert_eq!(*v, (j as f32 - 16.0) * 0.5);
    }

    // BF16 and F16 of 1.0; F32 keeps its bits.
    let mut v = [0f32; 1];
    dequantize(BF16, &0x3F80u16.to_le_bytes(), &mut v).unwrap();
    assert_eq!(v[0], 1.0);
    dequantize(F16, &one, &mut v).unwrap();
    assert_eq!(v[0], 1.0);
    dequantize(F32, &0x7FC0_1234u32.to_le_bytes(), &mut v).unwrap();
    assert_eq!(v[0].to_bits(), 0x7FC0_1234);
}

#[test]
fn hand_checked_k_blocks() {
    use GgmlType::*;
    // Q4_K with d = 1, dmin = 0.5; sub-block j has scale j + 1 and min 2j (sub-blocks 4..8 use the
    // split 6-bit encoding, so this exercises both halves of the packing).
    let mut b = 0x3C00u16.to_le_bytes().to_vec();
    b.extend(0x3800u16.to_le_bytes());
    let (sc, mn): (Vec<u8>, Vec<u8>) = (0..8u8)
        .map(|j| (j + 1 + 40 * (j / 4), 2 * j + 33 * (j / 4)))
        .unzip();
    let mut packed = [0u8; 12];
    for j in 0..4 {
        packed[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        packed[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
        packed[j + 8] = (sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4);
    }
    b.extend(packed);
    b.extend((0..128u32).map(|i| ((i % 16) | ((15 - i % 16) << 4)) as u8));
    let mut y = [0f32; 256];
    dequantize(Q4K, &b, &mut y).unwrap();
    for (i, v) in y.iter().enumerate() {
        let sub = i / 32;
        let byte = (i / 64) * 32 + i % 32;
        let q = if sub % 2 == 0 {
            byte % 16
        } else {
            15 - byte % 16
        };
        let want = f32::from(sc[sub]) * q as f32 - 0.5 * f32::from(mn[sub]);
        assert_eq!(*v, want, "Q4_K value {i}");
    }

    // Q6_K with d = 0.5, scales 1..=16 (scale k covers values 16k..16k+16) and every 6-bit value
    // equal to (value index % 64), built through the ql/qh split.
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for i in 0..256 {
        let q = (i % 64) as u8;
        let (half, r) = (i / 128, i % 128);
        let (quarter, l) = (r / 32, r % 32);
        let lbyte = 64 * half + l + 32 * (quarter % 2);
        ql[lbyte] |= (q & 0x0F) << (4 * (quarter / 2));
        qh[32 * half + l] |= (q >> 4) << (2 * quarter);
    }
    let mut b = ql.to_vec();
    b.extend(qh);
    b.extend((1..=16i8).map(|s| s as u8));
    b.extend(0x3800u16.to_le_bytes());
    dequantize(Q6K, &b, &mut y).unwrap();
    for (i, v) in y.iter().enumerate() {
        let want = 0.5 * (i / 16 + 1) as f32 * ((i % 64) as f32 - 32.0);
        assert_eq!(*v, want, "Q6_K value {i}");
    }
}
