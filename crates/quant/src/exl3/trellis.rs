//! The bitshift trellis: one 16x16 tile is a circular bitstream of 256 codes; each position's
//! 16-bit state is the window of the stream ending at its last bit.

use super::codebook::{self, Codebook};
use super::Exl3Error;

/// Bits per weight: K = 1..=8, or (MUL1 from exllamav3 1.6) 1.5, 2.5, 3.5, where even positions
/// take floor(K) bits and odd positions one more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bitrate {
    twice: u8,
}

impl Bitrate {
    /// From the last dimension of a `trellis` tensor: 16 int16 words per bit of K.
    pub fn from_tile_words(words: usize) -> Result<Self, Exl3Error> {
        let twice = words / 8;
        let ok = words.is_multiple_of(8)
            && ((2..=16).contains(&twice) && twice.is_multiple_of(2) || matches!(twice, 3 | 5 | 7));
        if !ok {
            return Err(Exl3Error::Bitrate(words));
        }
        Ok(Bitrate { twice: twice as u8 })
    }

    /// An integer K in 1..=8.
    pub fn int(k: u32) -> Self {
        assert!((1..=8).contains(&k), "K must be 1..=8");
        Bitrate { twice: 2 * k as u8 }
    }

    /// K = `k` + 0.5 for `k` in 1..=3.
    pub fn half(k: u32) -> Self {
        assert!((1..=3).contains(&k), "half rates are 1.5, 2.5, 3.5");
        Bitrate {
            twice: 2 * k as u8 + 1,
        }
    }

    pub fn bits(self) -> f32 {
        self.twice as f32 / 2.0
    }

    /// Whole bits of the narrower positions.
    pub fn floor(self) -> u32 {
        self.twice as u32 / 2
    }

    pub fn is_half(self) -> bool {
        self.twice % 2 == 1
    }

    /// int16 words per tile.
    pub fn tile_words(self) -> usize {
        8 * self.twice as usize
    }

    /// Bytes per tile.
    pub fn tile_bytes(self) -> usize {
        2 * self.tile_words()
    }

    /// Bits in a tile's stream.
    pub fn tile_bits(self) -> u32 {
        128 * self.twice as u32
    }

    /// One past the last stream bit of position `p`.
    #[inline]
    pub fn end_bit(self, p: u32) -> u32 {
        let ka = self.floor();
        if self.is_half() {
            // Positions 1, 3, 5, ... (mask 0xAAAA) carry the extra bit; ceil(p / 2) of them end
            // at or before p.
            (p + 1) * ka + p.div_ceil(2)
        } else {
            (p + 1) * ka
        }
    }
}

/// The tensor-core (mma B-fragment) order: position `p` of a tile holds element
/// `(row, col)` = (in-feature, out-feature) within the 16x16 tile. Lane `p / 8` of a warp decodes
/// positions `8 * lane ..`.
#[inline]
pub const fn position_to_element(p: usize) -> (usize, usize) {
    let (lane, j) = (p >> 3, p & 7);
    let row = 2 * (lane & 3) + (j & 1) + 8 * ((j >> 1) & 1);
    let col = (lane >> 2) + 8 * (j >> 2);
    (row, col)
}

/// For each position, its row-major index `row * 16 + col` in the tile.
pub const POSITION_INDEX: [u16; 256] = {
    let mut t = [0u16; 256];
    let mut p = 0;
    while p < 256 {
        let (r, c) = position_to_element(p);
        t[p] = (r * 16 + c) as u16;
        p += 1;
    }
    t
};

/// The stream as big-endian bit order within little-endian u32 words: int16 word pairs are
/// stored half-swapped so that this view is right.
#[inline]
fn word(tile: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(tile[4 * i..4 * i + 4].try_into().unwrap())
}

/// The 16-bit state of position `p`: the circular window of 16 stream bits ending at
/// `rate.end_bit(p)` (most significant bit first).
#[inline]
pub fn state(tile: &[u8], rate: Bitrate, p: u32) -> u16 {
    let total = rate.tile_bits();
    let start = (rate.end_bit(p) + total - 16) % total;
    let n_words = total as usize / 32;
    let i = start as usize / 32;
    let hi = word(tile, i) as u64;
    let lo = word(tile, (i + 1) % n_words) as u64;
    (((hi << 32) | lo) >> (48 - start % 32)) as u16
}

/// Decodes one tile (`rate.tile_bytes()` bytes) into its 256 fp16 values, row-major
/// `[in 16][out 16]`: the scalar reference.
pub fn decode_tile(tile: &[u8], rate: Bitrate, cb: Codebook, out: &mut [half::f16; 256]) {
    debug_assert_eq!(tile.len(), rate.tile_bytes());
    for p in 0..256u32 {
        out[POSITION_INDEX[p as usize] as usize] = codebook::decode(cb, state(tile, rate, p));
    }
}

/// Decodes one tile into f32 through the codebook's table, row-major `[in 16][out 16]`: the
/// engine's path. Walks the positions in order, so each window start follows from the last
/// without divisions; the words are copied once with the first two repeated after the end, so
/// the circular windows at the start read straight through.
#[inline]
pub fn decode_tile_f32(tile: &[u8], rate: Bitrate, table: &[f32; 65536], out: &mut [f32; 256]) {
    debug_assert_eq!(tile.len(), rate.tile_bytes());
    let total = rate.tile_bits();
    let n_words = total as usize / 32;
    let mut w = [0u32; 64 + 2];
    for (i, v) in w[..n_words].iter_mut().enumerate() {
        *v = word(tile, i);
    }
    w[n_words] = w[0];
    w[n_words + 1] = w[1];
    let (ka, half) = (rate.floor(), rate.is_half() as u32);
    let mut end = 0u32;
    for (p, &dst) in POSITION_INDEX.iter().enumerate() {
        end += ka + (half & p as u32);
        let start = if end >= 16 {
            end - 16
        } else {
            end + total - 16
        };
        let i = (start >> 5) as usize;
        let pair = ((w[i] as u64) << 32) | w[i + 1] as u64;
        out[dst as usize] = table[(pair >> (48 - (start & 31))) as u16 as usize];
    }
}
