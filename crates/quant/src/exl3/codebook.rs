//! The three EXL3 codebooks: a 16-bit trellis state in, one fp16 weight out.
//!
//! exllamav3 computes these with fp16 adds and fmas on the GPU. Every intermediate here is exact
//! in f32 (see the per-codebook notes), so one final f32 -> f16 rounding (round to nearest even,
//! as the GPU's) gives the same bits.

use std::sync::OnceLock;

use half::f16;

/// Which procedural codebook maps states to values; chosen per tensor by the presence of an
/// `mcg` or `mul1` tensor, neither meaning 3INST.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codebook {
    /// QTIP's 3INST: an LCG step, a mask/xor that lands two fp16 halves in [0.125, 2), their sum.
    Inst3,
    /// The same mask/xor/sum after a multiplicative congruential step (no additive constant).
    Mcg,
    /// A multiply, then the sum of the product's four bytes, scaled and centred.
    Mul1,
}

impl Codebook {
    /// Every codebook by the name exllamav3's `quantization_config` gives it.
    pub const ALL: [(Codebook, &'static str); 3] = [
        (Codebook::Mul1, "mul1"),
        (Codebook::Mcg, "mcg"),
        (Codebook::Inst3, "3inst"),
    ];

    /// exllamav3's name for it (`mul1`, `mcg`, `3inst`).
    pub fn name(self) -> &'static str {
        Self::ALL.iter().find(|(c, _)| *c == self).unwrap().1
    }

    /// The codebook of a name (case-insensitive), if it is one.
    pub fn from_name(s: &str) -> Option<Codebook> {
        let s = s.to_ascii_lowercase();
        Self::ALL.iter().find(|(_, n)| *n == s).map(|(c, _)| *c)
    }
}

const MASK: u32 = 0x8FFF_8FFF;
const XOR: u32 = 0x3B60_3B60;
pub const INST3_MUL: u32 = 89_226_354;
pub const INST3_ADD: u32 = 64_248_484;
pub const MCG_MUL: u32 = 0xCBAC_1FED;
pub const MUL1_MUL: u32 = 0x83DC_D12D;
/// fp16 0x1EEE (~1/147.77) and 0xC931 (~-10.38): MUL1's fp16 fma operands.
const MUL1_SCALE: u16 = 0x1EEE;
const MUL1_BIAS: u16 = 0xC931;

/// The two fp16 halves left by the mask/xor: exponents 12..=15 (values in [2^-3, 2)), so their
/// f32 sum is exact and rounding it once equals the GPU's `__hadd`.
#[inline]
fn half_pair_sum(m: u32) -> f32 {
    let m = (m & MASK) ^ XOR;
    f16::from_bits(m as u16).to_f32() + f16::from_bits((m >> 16) as u16).to_f32()
}

/// MUL1's value from the byte sum `s` (0..=1020): `fma(1024 + s, scale, bias)` in fp16. Both
/// operands are multiples of 2^-18 below 2^4, so the f32 product and sum are exact.
#[inline]
pub fn mul1_value(s: u32) -> f32 {
    let h = (1024 + s) as f32;
    h * f16::from_bits(MUL1_SCALE).to_f32() + f16::from_bits(MUL1_BIAS).to_f32()
}

/// MUL1's value before rounding is `MUL1_A * s + MUL1_B` for the byte sum `s`, exactly:
/// `MUL1_A` is fp16 0x1EEE (1774 / 2^18) and `MUL1_B` = 1024 `MUL1_A` + fp16 0xC931.
pub const MUL1_A: f32 = 1774.0 / 262144.0;
pub const MUL1_B: f32 = 1024.0 * MUL1_A - 1329.0 / 128.0;

#[test]
fn mul1_affine_constants() {
    assert_eq!(MUL1_A, f16::from_bits(MUL1_SCALE).to_f32());
    assert_eq!(MUL1_B, 1024.0 * MUL1_A + f16::from_bits(MUL1_BIAS).to_f32());
    for s in 0..=1020 {
        assert_eq!(mul1_value(s), MUL1_A * s as f32 + MUL1_B);
    }
}

/// The codebook's fp16 value for a 16-bit state.
#[inline]
pub fn decode(cb: Codebook, state: u16) -> f16 {
    let x = state as u32;
    let v = match cb {
        Codebook::Inst3 => half_pair_sum(x.wrapping_mul(INST3_MUL).wrapping_add(INST3_ADD)),
        Codebook::Mcg => half_pair_sum(x.wrapping_mul(MCG_MUL)),
        Codebook::Mul1 => {
            let p = x.wrapping_mul(MUL1_MUL);
            mul1_value(p.to_le_bytes().iter().map(|&b| b as u32).sum())
        }
    };
    f16::from_f32(v)
}

/// A codebook's 65536 values as f32 on 64-byte cache lines, so vector loads of them never
/// straddle two lines (the tile search streams a table like this every step).
#[repr(C, align(64))]
pub(crate) struct Table(pub [f32; 65536]);

/// All 65536 values of a codebook as f32, built once: the fast paths decode by table look-up.
pub fn table(cb: Codebook) -> &'static [f32; 65536] {
    static TABLES: [OnceLock<Box<Table>>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let i = match cb {
        Codebook::Inst3 => 0,
        Codebook::Mcg => 1,
        Codebook::Mul1 => 2,
    };
    &TABLES[i]
        .get_or_init(|| {
            let mut t = Box::new(Table([0.0f32; 65536]));
            for (s, v) in t.0.iter_mut().enumerate() {
                *v = decode(cb, s as u16).to_f32();
            }
            t
        })
        .0
}
