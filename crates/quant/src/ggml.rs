//! ggml tensor types: their block geometry and exact dequantization.

use thiserror::Error;

mod blocks;
pub mod dot;
mod grids;

#[derive(Debug, Error)]
pub enum QuantError {
    #[error("unsupported tensor type {0}")]
    Unsupported(String),
    #[error("{ty:?}: {len} bytes is not a whole number of {block}-byte blocks")]
    Misaligned {
        ty: GgmlType,
        len: usize,
        block: usize,
    },
    #[error("{ty:?}: output holds {out} values but the input decodes to {expected}")]
    OutputSize {
        ty: GgmlType,
        out: usize,
        expected: usize,
    },
}

/// The ggml type ids as numbered in GGUF files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    IQ2XXS,
    IQ2XS,
    IQ3XXS,
    IQ1S,
    IQ4NL,
    IQ3S,
    IQ2S,
    IQ4XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1M,
    BF16,
}

impl GgmlType {
    /// Every type, in id order.
    pub const ALL: [GgmlType; 29] = {
        use GgmlType::*;
        [
            F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2K, Q3K, Q4K, Q5K, Q6K, Q8K, IQ2XXS,
            IQ2XS, IQ3XXS, IQ1S, IQ4NL, IQ3S, IQ2S, IQ4XS, I8, I16, I32, I64, F64, IQ1M, BF16,
        ]
    };

    /// The GGUF type id (inverse of [`GgmlType::from_id`]).
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2K => 10,
            Q3K => 11,
            Q4K => 12,
            Q5K => 13,
            Q6K => 14,
            Q8K => 15,
            IQ2XXS => 16,
            IQ2XS => 17,
            IQ3XXS => 18,
            IQ1S => 19,
            IQ4NL => 20,
            IQ3S => 21,
            IQ2S => 22,
            IQ4XS => 23,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            IQ1M => 29,
            BF16 => 30,
        }
    }

    /// The name GGUF tooling prints for this type (`"Q4_K"`, `"BF16"`, ...).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2K => "Q2_K",
            Q3K => "Q3_K",
            Q4K => "Q4_K",
            Q5K => "Q5_K",
            Q6K => "Q6_K",
            Q8K => "Q8_K",
            IQ2XXS => "IQ2_XXS",
            IQ2XS => "IQ2_XS",
            IQ3XXS => "IQ3_XXS",
            IQ1S => "IQ1_S",
            IQ4NL => "IQ4_NL",
            IQ3S => "IQ3_S",
            IQ2S => "IQ2_S",
            IQ4XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            IQ1M => "IQ1_M",
            BF16 => "BF16",
        }
    }

    /// Maps a GGUF type id; ids we do not know at all are `None`.
    pub fn from_id(id: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            16 => IQ2XXS,
            17 => IQ2XS,
            18 => IQ3XXS,
            19 => IQ1S,
            20 => IQ4NL,
            21 => IQ3S,
            22 => IQ2S,
            23 => IQ4XS,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            29 => IQ1M,
            30 => BF16,
            _ => return None,
        })
    }

    /// Values per block.
    pub fn block_len(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | IQ4NL => 32,
            Q2K | Q3K | Q4K | Q5K | Q6K | Q8K | IQ2XXS | IQ2XS | IQ3XXS | IQ1S | IQ3S | IQ2S
            | IQ4XS | IQ1M => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | I32 => 4,
            F16 | BF16 | I16 => 2,
            I8 => 1,
            I64 | F64 => 8,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 36,
            Q2K => 84,
            Q3K => 110,
            Q4K => 144,
            Q5K => 176,
            Q6K => 210,
            Q8K => 292,
            IQ2XXS => 66,
            IQ2XS => 74,
            IQ3XXS => 98,
            IQ1S => 50,
            IQ4NL => 18,
            IQ3S => 110,
            IQ2S => 82,
            IQ4XS => 136,
            IQ1M => 56,
        }
    }

    /// Bytes needed for `n` values (n must be a multiple of the block length).
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_len()) {
            return None;
        }
        (n / self.block_len()).checked_mul(self.block_bytes())
    }

    /// Whether [`dequantize`] decodes this type.
    pub fn is_supported(self) -> bool {
        decoder(self).is_some()
    }
}

/// A block decoder: whole blocks in, exactly their values out.
type Decoder = fn(&[u8], &mut [f32]);

/// The exact block decoder of `ty`, if this crate has one.
fn decoder(ty: GgmlType) -> Option<Decoder> {
    use GgmlType::*;
    Some(match ty {
        F32 => blocks::float32,
        F16 => blocks::float16,
        BF16 => blocks::bfloat16,
        Q4_0 => blocks::q4_0,
        Q4_1 => blocks::q4_1,
        Q5_0 => blocks::q5_0,
        Q5_1 => blocks::q5_1,
        Q8_0 => blocks::q8_0,
        Q2K => blocks::q2_k,
        Q3K => blocks::q3_k,
        Q4K => blocks::q4_k,
        Q5K => blocks::q5_k,
        Q6K => blocks::q6_k,
        Q8K => blocks::q8_k,
        IQ2XXS => blocks::iq2_xxs,
        IQ2XS => blocks::iq2_xs,
        IQ2S => blocks::iq2_s,
        IQ3XXS => blocks::iq3_xxs,
        IQ3S => blocks::iq3_s,
        IQ4NL => blocks::iq4_nl,
        IQ4XS => blocks::iq4_xs,
        Q8_1 | IQ1S | IQ1M | I8 | I16 | I32 | I64 | F64 => return None,
    })
}

/// Decodes `src` (whole blocks of `ty`) into `out`, exactly as ggml's reference dequantizers do.
///
/// `src` may start at any address (it is usually a slice of an mmapped file). Every output value is
/// bit-identical to ggml's scalar reference (`dequantize_row_*`), NaN payloads aside.
///
/// Errors, checked in this order: `Unsupported` for types this crate does not decode,
/// `Misaligned` when `src` is not a whole number of blocks, `OutputSize` when `out` does not hold
/// exactly the decoded values. Never panics.
pub fn dequantize(ty: GgmlType, src: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    let kernel = decoder(ty).ok_or_else(|| QuantError::Unsupported(ty.name().to_string()))?;
    let block = ty.block_bytes();
    if !src.len().is_multiple_of(block) {
        return Err(QuantError::Misaligned {
            ty,
            len: src.len(),
            block,
        });
    }
    let expected = src.len() / block * ty.block_len();
    if out.len() != expected {
        return Err(QuantError::OutputSize {
            ty,
            out: out.len(),
            expected,
        });
    }
    kernel(src, out);
    Ok(())
}

/// Decodes one row: same as [`dequantize`]; named for call sites that walk a matrix row by row.
pub fn dequantize_row(ty: GgmlType, src: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    dequantize(ty, src, out)
}
