//! EXL3 (exllamav3's trellis format, after QTIP): decoding and multiplying linear layers.
//!
//! A layer `y = x W` with `W` of shape `[k in, n out]` is stored as
//! `W = diag(suh) H W_inner H diag(svh)`, `H` the 128-blocked Sylvester Hadamard (scaled by
//! 1/sqrt(128)), and `W_inner` as `trellis`: int16 `[k/16, n/16, 16 K]`, one tail-biting
//! bitstream per 16x16 tile. The format's sources and derivation are in
//! `shared/research/trellis.md`; everything here is checked bit for bit against exllamav3.
//!
//! `reconstruct_inner`/`reconstruct` are the scalar references (fp16, as exllamav3 computes
//! them); `forward` is the f32 reference forward pass; `matmul_inner` is the fast tile kernel the
//! engine runs (Hadamards applied to activations, weights never expanded beyond one tile).

pub mod codebook;
pub mod encode;
pub mod hadamard;
mod kernel;
pub mod matmul;
pub mod quantize;
pub mod rates;
pub mod simd;
pub mod trellis;

use half::f16;

pub use codebook::Codebook;
pub use hadamard::hadamard128;
pub use kernel::matmul_inner;
pub use rates::{Exl3Rates, PROJECTIONS};
pub use trellis::{Bitrate, POSITION_INDEX};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Exl3Error {
    #[error("trellis tiles of {0} int16 words are no EXL3 bitrate (16 K words, K = 1..8 or 1.5/2.5/3.5)")]
    Bitrate(usize),
    #[error("trellis shape {0:?} is not [in/16, out/16, 16 K] for a {1}x{2} layer")]
    Shape(Vec<usize>, usize, usize),
    #[error("EXL3 dimensions must be multiples of 128, got {0}x{1}")]
    NotBlocked(usize, usize),
    #[error("{what} has {got} bytes, expected {expected}")]
    Bytes {
        what: &'static str,
        got: usize,
        expected: usize,
    },
}

/// The geometry of one EXL3 linear layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exl3Shape {
    /// in_features (rows of `W_inner`).
    pub k: usize,
    /// out_features.
    pub n: usize,
    pub rate: Bitrate,
    pub codebook: Codebook,
}

impl Exl3Shape {
    /// From the `trellis` tensor's shape; `k`/`n` follow from it.
    pub fn from_trellis(shape: &[usize], codebook: Codebook) -> Result<Self, Exl3Error> {
        let [tk, tn, words] = shape else {
            return Err(Exl3Error::Shape(shape.to_vec(), 0, 0));
        };
        let (k, n) = (tk * 16, tn * 16);
        if k == 0 || n == 0 || k % 128 != 0 || n % 128 != 0 {
            return Err(Exl3Error::NotBlocked(k, n));
        }
        Ok(Exl3Shape {
            k,
            n,
            rate: Bitrate::from_tile_words(*words)?,
            codebook,
        })
    }

    pub fn tiles_k(&self) -> usize {
        self.k / 16
    }
    pub fn tiles_n(&self) -> usize {
        self.n / 16
    }

    pub fn trellis_bytes(&self) -> usize {
        self.tiles_k() * self.tiles_n() * self.rate.tile_bytes()
    }

    /// The stored bytes of tile `(tk, tn)`.
    #[inline]
    pub fn tile<'a>(&self, trellis: &'a [u8], tk: usize, tn: usize) -> &'a [u8] {
        let tb = self.rate.tile_bytes();
        let s = (tk * self.tiles_n() + tn) * tb;
        &trellis[s..s + tb]
    }

    pub fn check_trellis(&self, trellis: &[u8]) -> Result<(), Exl3Error> {
        if trellis.len() != self.trellis_bytes() {
            return Err(Exl3Error::Bytes {
                what: "trellis",
                got: trellis.len(),
                expected: self.trellis_bytes(),
            });
        }
        Ok(())
    }
}

/// fp16 values from little-endian bytes (`suh`, `svh`, `bias` as stored).
pub fn f16_values(bytes: &[u8]) -> Vec<f16> {
    bytes
        .chunks_exact(2)
        .map(|b| f16::from_le_bytes([b[0], b[1]]))
        .collect()
}

/// Legacy packed signs (`su`/`sv`, int16 `[len/16]`): element `16 j + i` is bit `i` of word
/// `j`; a set bit means -1.
pub fn unpack_signs(packed: &[u8]) -> Vec<f16> {
    let mut out = Vec::with_capacity(packed.len() * 8);
    for w in packed.chunks_exact(2) {
        let w = u16::from_le_bytes([w[0], w[1]]);
        out.extend((0..16).map(|i| {
            if w >> i & 1 == 1 {
                f16::from_f32(-1.0)
            } else {
                f16::from_f32(1.0)
            }
        }));
    }
    out
}

/// `W_inner` as exllamav3's `reconstruct` writes it: fp16 `[k][n]`, row-major.
pub fn reconstruct_inner(shape: &Exl3Shape, trellis: &[u8]) -> Result<Vec<f16>, Exl3Error> {
    shape.check_trellis(trellis)?;
    let mut w = vec![f16::ZERO; shape.k * shape.n];
    let mut tile = [f16::ZERO; 256];
    for tk in 0..shape.tiles_k() {
        for tn in 0..shape.tiles_n() {
            trellis::decode_tile(
                shape.tile(trellis, tk, tn),
                shape.rate,
                shape.codebook,
                &mut tile,
            );
            for r in 0..16 {
                let dst = (tk * 16 + r) * shape.n + tn * 16;
                w[dst..dst + 16].copy_from_slice(&tile[r * 16..r * 16 + 16]);
            }
        }
    }
    Ok(w)
}

/// The layer's weight `W = diag(suh) H W_inner H diag(svh)`, fp16 `[k][n]`, rounded where
/// exllamav3's `get_weight_tensor` rounds: after each Hadamard (f32 products summed in order, as
/// its f32 matmul does) and after each fp16 scale.
pub fn reconstruct(
    shape: &Exl3Shape,
    trellis: &[u8],
    suh: &[f16],
    svh: &[f16],
) -> Result<Vec<f16>, Exl3Error> {
    let (k, n) = (shape.k, shape.n);
    for (what, v, len) in [("suh", suh, k), ("svh", svh, n)] {
        if v.len() != len {
            return Err(Exl3Error::Bytes {
                what,
                got: 2 * v.len(),
                expected: 2 * len,
            });
        }
    }
    let inner = reconstruct_inner(shape, trellis)?;
    let h = hadamard::scaled_sign_matrix();
    let mut w: Vec<f32> = inner.iter().map(|v| v.to_f32()).collect();
    // Left: each 128-row block of W becomes H @ block.
    let mut col = [0.0f32; 128];
    for b in 0..k / 128 {
        for c in 0..n {
            for (j, v) in col.iter_mut().enumerate() {
                *v = w[(b * 128 + j) * n + c];
            }
            for i in 0..128 {
                let acc = (0..128).fold(0.0f32, |acc, j| h[i * 128 + j].mul_add(col[j], acc));
                let r = f16::from_f32(acc).to_f32();
                w[(b * 128 + i) * n + c] = f16::from_f32(r * suh[b * 128 + i].to_f32()).to_f32();
            }
        }
    }
    // Right: each row's 128-column blocks become block @ H.
    let mut out = vec![f16::ZERO; k * n];
    let mut blk = [0.0f32; 128];
    for r in 0..k {
        for b in 0..n / 128 {
            blk.copy_from_slice(&w[r * n + b * 128..r * n + b * 128 + 128]);
            for c in 0..128 {
                let acc = (0..128).fold(0.0f32, |acc, j| blk[j].mul_add(h[j * 128 + c], acc));
                let v = f16::from_f32(acc).to_f32() * svh[b * 128 + c].to_f32();
                out[r * n + b * 128 + c] = f16::from_f32(v);
            }
        }
    }
    Ok(out)
}

/// Reference forward pass in f32: `y = H(H(x * suh) W_inner) * svh (+ bias)` for `m` rows of
/// `x` (`[m][k]`), giving `[m][n]`.
pub fn forward(
    shape: &Exl3Shape,
    trellis: &[u8],
    suh: &[f32],
    svh: &[f32],
    bias: Option<&[f32]>,
    x: &[f32],
    m: usize,
) -> Result<Vec<f32>, Exl3Error> {
    let (k, n) = (shape.k, shape.n);
    let inner = reconstruct_inner(shape, trellis)?;
    let mut y = vec![0.0f32; m * n];
    let mut xh = vec![0.0f32; k];
    for t in 0..m {
        for (d, (a, s)) in xh.iter_mut().zip(x[t * k..(t + 1) * k].iter().zip(suh)) {
            *d = a * s;
        }
        hadamard128(&mut xh);
        let yr = &mut y[t * n..(t + 1) * n];
        for (i, &a) in xh.iter().enumerate() {
            for (o, w) in yr.iter_mut().zip(&inner[i * n..(i + 1) * n]) {
                *o += a * w.to_f32();
            }
        }
        hadamard128(yr);
        for (c, o) in yr.iter_mut().enumerate() {
            *o = *o * svh[c] + bias.map_or(0.0, |b| b[c]);
        }
    }
    Ok(y)
}
