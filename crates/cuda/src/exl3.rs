//! EXL3 linear layers on the GPU, exact path, one activation row (`kernels/exl3.cu`).
//!
//! A layer is uploaded compressed ([`Exl3Linear`]: the trellis words as stored, `suh`/`svh` and the
//! bias as f32), so device memory is about the file's size. [`Exl3Linear::gemv`] runs
//! `y = H(H(x * suh) W_inner) * svh + bias` as three launches: the input Hadamard, the trellis
//! decoded in registers with f32 partial sums over a split of the tile rows, and the output
//! Hadamard with the scales. The CPU twin is `trellm_quant::exl3::matmul::matmul_tiles`.

use anyhow::{ensure, Result};
use cudarc::driver::{CudaFunction, CudaSlice};

use trellm_model::weights::Exl3Matrix;
use trellm_quant::exl3::{Bitrate, Codebook, Exl3Shape};

use crate::kernels::{KernelSource, EXL3};
use crate::{Arg, Gpu};

/// The `-D` defines of the module for a codebook and bitrate.
pub fn defines(codebook: Codebook, rate: Bitrate) -> Vec<String> {
    let cb = match codebook {
        Codebook::Inst3 => 0,
        Codebook::Mcg => 1,
        Codebook::Mul1 => 2,
    };
    let twice = (rate.bits() * 2.0) as u32;
    vec![format!("EXL3_CB={cb}"), format!("EXL3_TWICE={twice}")]
}

/// Every codebook x bitrate module CI compiles (`kernels::EXL3.variants`).
pub const VARIANTS: &[&str] = &[
    "EXL3_CB=0,EXL3_TWICE=2",
    "EXL3_CB=0,EXL3_TWICE=3",
    "EXL3_CB=0,EXL3_TWICE=4",
    "EXL3_CB=0,EXL3_TWICE=5",
    "EXL3_CB=0,EXL3_TWICE=6",
    "EXL3_CB=0,EXL3_TWICE=7",
    "EXL3_CB=0,EXL3_TWICE=8",
    "EXL3_CB=0,EXL3_TWICE=10",
    "EXL3_CB=0,EXL3_TWICE=12",
    "EXL3_CB=0,EXL3_TWICE=14",
    "EXL3_CB=0,EXL3_TWICE=16",
    "EXL3_CB=1,EXL3_TWICE=2",
    "EXL3_CB=1,EXL3_TWICE=3",
    "EXL3_CB=1,EXL3_TWICE=4",
    "EXL3_CB=1,EXL3_TWICE=5",
    "EXL3_CB=1,EXL3_TWICE=6",
    "EXL3_CB=1,EXL3_TWICE=7",
    "EXL3_CB=1,EXL3_TWICE=8",
    "EXL3_CB=1,EXL3_TWICE=10",
    "EXL3_CB=1,EXL3_TWICE=12",
    "EXL3_CB=1,EXL3_TWICE=14",
    "EXL3_CB=1,EXL3_TWICE=16",
    "EXL3_CB=2,EXL3_TWICE=2",
    "EXL3_CB=2,EXL3_TWICE=3",
    "EXL3_CB=2,EXL3_TWICE=4",
    "EXL3_CB=2,EXL3_TWICE=5",
    "EXL3_CB=2,EXL3_TWICE=6",
    "EXL3_CB=2,EXL3_TWICE=7",
    "EXL3_CB=2,EXL3_TWICE=8",
    "EXL3_CB=2,EXL3_TWICE=10",
    "EXL3_CB=2,EXL3_TWICE=12",
    "EXL3_CB=2,EXL3_TWICE=14",
    "EXL3_CB=2,EXL3_TWICE=16",
];

/// A variant string of [`VARIANTS`] as the defines list NVRTC gets.
pub fn variant_defines(v: &str) -> Vec<String> {
    v.split(',').map(str::to_string).collect()
}

/// The four kernels of one codebook x bitrate module.
pub struct Exl3Kernels {
    pub input: CudaFunction,
    pub gemv: CudaFunction,
    pub output: CudaFunction,
    pub dequant: CudaFunction,
}

impl Exl3Kernels {
    pub fn load(gpu: &Gpu, codebook: Codebook, rate: Bitrate) -> Result<Exl3Kernels> {
        Self::load_with(gpu, codebook, rate, &[])
    }

    /// With `extra` defines (variants for a measurement).
    pub fn load_with(
        gpu: &Gpu,
        codebook: Codebook,
        rate: Bitrate,
        extra: &[String],
    ) -> Result<Exl3Kernels> {
        let mut d = defines(codebook, rate);
        d.extend_from_slice(extra);
        let src: &KernelSource = &EXL3;
        Ok(Exl3Kernels {
            input: gpu.function(src, &d, "exl3_in")?,
            gemv: gpu.function(src, &d, "exl3_gemv")?,
            output: gpu.function(src, &d, "exl3_out")?,
            dequant: gpu.function(src, &d, "exl3_dequant")?,
        })
    }
}

/// Blocks the GEMV aims for per SM when it picks its split of the tile rows (`gpu_exl3::timing`
/// sweeps it; H200 run 1: 16 and 32 tied as the fastest for the trellis kernel, 8 and 16 within
/// 3% of each other for the whole layer).
pub const BLOCKS_PER_SM: usize = 16;

/// Tile rows a split takes at least (fewer would make the partial sums' traffic matter).
const MIN_TILES_PER_SPLIT: usize = 4;

/// The GEMV's split of a layer's tile rows: about `blocks_per_sm` blocks per SM, at least
/// [`MIN_TILES_PER_SPLIT`] tile rows a split (as far as the layer allows). Returns (splits, tile
/// rows per split); the splits cover every tile row.
pub fn split_for(shape: &Exl3Shape, sm_count: usize, blocks_per_sm: usize) -> (usize, usize) {
    let tiles_k = shape.tiles_k().max(1);
    let bands = (shape.n / 128).max(1);
    let want = (sm_count * blocks_per_sm).div_ceil(bands);
    let splits = want.clamp(1, (tiles_k / MIN_TILES_PER_SPLIT).max(1));
    let per = tiles_k.div_ceil(splits);
    (tiles_k.div_ceil(per), per)
}

/// An EXL3 linear layer on the device, compressed.
pub struct Exl3Linear {
    pub shape: Exl3Shape,
    /// Outputs the model uses (`<= shape.n`) and inputs it gives (`<= shape.k`).
    pub rows: usize,
    pub cols: usize,
    trellis: CudaSlice<u8>,
    suh: CudaSlice<f32>,
    svh: CudaSlice<f32>,
    bias: Option<CudaSlice<f32>>,
    k: Exl3Kernels,
}

/// Scratch buffers the GEMV passes through: the rotated input and the split's partial sums.
pub struct Exl3Scratch {
    xh: CudaSlice<f32>,
    partial: CudaSlice<f32>,
}

impl Exl3Scratch {
    /// For layers of up to `max_k` inputs and `max_partial` partial sums
    /// ([`Exl3Linear::partial_len`]).
    pub fn new(gpu: &Gpu, max_k: usize, max_partial: usize) -> Result<Exl3Scratch> {
        Ok(Exl3Scratch {
            xh: gpu.alloc(max_k)?,
            partial: gpu.alloc(max_partial)?,
        })
    }
}

impl Exl3Linear {
    /// From a loaded model's layer (its trellis stays compressed), with the projection's bias.
    pub fn upload(gpu: &Gpu, m: &Exl3Matrix, bias: Option<&[f32]>) -> Result<Exl3Linear> {
        Self::from_parts(
            gpu,
            m.shape,
            m.rows,
            m.cols,
            m.trellis(),
            &m.suh,
            &m.svh,
            bias,
        )
    }

    /// From the parts, each checked against the shape (an error, never a panic, on a mismatch).
    #[allow(clippy::too_many_arguments)]
    pub fn from_parts(
        gpu: &Gpu,
        shape: Exl3Shape,
        rows: usize,
        cols: usize,
        trellis: &[u8],
        suh: &[f32],
        svh: &[f32],
        bias: Option<&[f32]>,
    ) -> Result<Exl3Linear> {
        ensure!(
            shape.k > 0
                && shape.n > 0
                && shape.k.is_multiple_of(128)
                && shape.n.is_multiple_of(128),
            "EXL3 dimensions must be multiples of 128, got {}x{}",
            shape.k,
            shape.n
        );
        ensure!(
            (1..=shape.n).contains(&rows) && (1..=shape.k).contains(&cols),
            "EXL3 layer uses {rows}x{cols} of {}x{}",
            shape.n,
            shape.k
        );
        shape.check_trellis(trellis)?;
        ensure!(
            suh.len() == shape.k,
            "suh has {} values for k = {}",
            suh.len(),
            shape.k
        );
        ensure!(
            svh.len() == shape.n,
            "svh has {} values for n = {}",
            svh.len(),
            shape.n
        );
        if let Some(b) = bias {
            ensure!(
                b.len() == rows,
                "bias has {} values for {rows} outputs",
                b.len()
            );
        }
        Ok(Exl3Linear {
            shape,
            rows,
            cols,
            trellis: gpu.upload(trellis)?,
            suh: gpu.upload(suh)?,
            svh: gpu.upload(svh)?,
            bias: bias.map(|b| gpu.upload(b)).transpose()?,
            k: Exl3Kernels::load(gpu, shape.codebook, shape.rate)?,
        })
    }

    /// Runs with other kernels of the same codebook and bitrate (the timing sweep's variants).
    pub fn set_kernels(&mut self, k: Exl3Kernels) {
        self.k = k;
    }

    /// Bytes this layer holds on the device.
    pub fn device_bytes(&self) -> usize {
        self.shape.trellis_bytes()
            + 4 * (self.shape.k + self.shape.n)
            + self.bias.as_ref().map_or(0, |_| 4 * self.rows)
    }

    /// The split of the tile rows for `blocks_per_sm`: (splits, tile rows per split).
    pub fn split(&self, sm_count: usize, blocks_per_sm: usize) -> (usize, usize) {
        split_for(&self.shape, sm_count, blocks_per_sm)
    }

    /// Partial sums the GEMV writes at `blocks_per_sm`.
    pub fn partial_len(&self, sm_count: usize, blocks_per_sm: usize) -> usize {
        self.split(sm_count, blocks_per_sm).0 * self.shape.n
    }

    /// `y[..rows] = layer(x[..cols])` for one row; `x` and `y` are device f32 buffers. The
    /// scratch must hold this layer ([`Exl3Scratch::new`]).
    pub fn gemv(&self, gpu: &Gpu, s: &Exl3Scratch, x: u64, y: u64) -> Result<()> {
        self.gemv_with(gpu, s, x, y, BLOCKS_PER_SM)
    }

    /// [`Self::gemv`] with another target of blocks per SM (the timing sweep).
    pub fn gemv_with(
        &self,
        gpu: &Gpu,
        s: &Exl3Scratch,
        x: u64,
        y: u64,
        blocks_per_sm: usize,
    ) -> Result<()> {
        let (k, n) = (self.shape.k, self.shape.n);
        let (splits, per) = self.split(gpu.sm_count, blocks_per_sm);
        ensure!(
            s.xh.len() >= k && s.partial.len() >= splits * n,
            "EXL3 scratch too small"
        );
        let (xh, partial) = (gpu.ptr(&s.xh), gpu.ptr(&s.partial));
        gpu.launch(
            &self.k.input,
            ((k / 128).div_ceil(4) as u32, 1, 1),
            128,
            &[
                Arg::Ptr(x),
                Arg::I32(self.cols as i32),
                Arg::Ptr(gpu.ptr(&self.suh)),
                Arg::Ptr(xh),
                Arg::I32(k as i32),
            ],
        )?;
        self.launch_inner(gpu, xh, partial, splits, per)?;
        gpu.launch(
            &self.k.output,
            ((n / 128).div_ceil(4) as u32, 1, 1),
            128,
            &[
                Arg::Ptr(partial),
                Arg::I32(splits as i32),
                Arg::I32(n as i32),
                Arg::Ptr(gpu.ptr(&self.svh)),
                Arg::Ptr(self.bias.as_ref().map_or(0, |b| gpu.ptr(b))),
                Arg::Ptr(y),
                Arg::I32(self.rows as i32),
            ],
        )
    }

    /// The trellis kernel alone: `partial[split][n]` from an already rotated `xh` (the timing).
    pub fn launch_inner(
        &self,
        gpu: &Gpu,
        xh: u64,
        partial: u64,
        splits: usize,
        per: usize,
    ) -> Result<()> {
        ensure!(
            per >= 1 && splits * per >= self.shape.tiles_k(),
            "a split of {splits} x {per} tile rows does not cover {}",
            self.shape.tiles_k()
        );
        gpu.launch(
            &self.k.gemv,
            ((self.shape.n / 128) as u32, splits as u32, 1),
            256,
            &[
                Arg::Ptr(gpu.ptr(&self.trellis)),
                Arg::Ptr(xh),
                Arg::Ptr(partial),
                Arg::I32(self.shape.tiles_k() as i32),
                Arg::I32(self.shape.tiles_n() as i32),
                Arg::I32(per as i32),
            ],
        )
    }

    /// `W_inner` decoded on the device, f32 row-major `[k][n]` (the decode's exactness check).
    pub fn dequant(&self, gpu: &Gpu) -> Result<Vec<f32>> {
        let (k, n) = (self.shape.k, self.shape.n);
        let w = gpu.alloc::<f32>(k * n)?;
        gpu.launch(
            &self.k.dequant,
            ((n / 128) as u32, (k / 16) as u32, 1),
            256,
            &[
                Arg::Ptr(gpu.ptr(&self.trellis)),
                Arg::Ptr(gpu.ptr(&w)),
                Arg::I32(self.shape.tiles_n() as i32),
            ],
        )?;
        gpu.sync()?;
        Ok(gpu.stream.clone_dtoh(&w)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trellm_quant::exl3::trellis;

    /// A host model of the kernel's per-lane bit extraction (`lane_start`, `pos_off`,
    /// `lane_words`, `decode8` in exl3.cu), against the codec's `state` for every rate: the index
    /// arithmetic is checked here, without a GPU.
    #[test]
    fn lane_extraction_matches_the_codec() {
        let rates: Vec<Bitrate> = (1..=8)
            .map(Bitrate::int)
            .chain((1..=3).map(Bitrate::half))
            .collect();
        let mut seed = 0x1234_5678_9abc_def0u64;
        for rate in rates {
            let (ka, half) = (rate.floor() as i64, rate.is_half() as i64);
            let tile_bits = rate.tile_bits() as i64;
            let tile_words = tile_bits / 32;
            let end_bit = |p: i64| (p + 1) * ka + if half == 1 { (p + 1) / 2 } else { 0 };
            let pos_off = |j: i64| j * ka + if half == 1 { (j + 1) / 2 } else { 0 };
            let lane_start = |l: i64| (end_bit(8 * l) - 16 + tile_bits) % tile_bits;
            let nload = (0..32)
                .map(|l| ((lane_start(l) & 31) + pos_off(7) + 16 + 31) / 32)
                .max()
                .unwrap();
            let nalign = (pos_off(7) + 16 + 31) / 32;
            let tile: Vec<u8> = (0..rate.tile_bytes())
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            let word = |i: i64| u32::from_le_bytes(tile[4 * i as usize..][..4].try_into().unwrap());
            let funnel =
                |lo: u32, hi: u32, s: i64| ((((hi as u64) << 32) | lo as u64) << s >> 32) as u32;
            for lane in 0..32i64 {
                let s0 = lane_start(lane);
                let w: Vec<u32> = (0..nload)
                    .map(|i| {
                        let x = (s0 >> 5) + i;
                        word(if x >= tile_words { x - tile_words } else { x })
                    })
                    .collect();
                let a: Vec<u32> = (0..=nalign)
                    .map(|i| {
                        let hi = if i < nload { w[i as usize] } else { 0 };
                        let lo = if i + 1 < nload { w[i as usize + 1] } else { 0 };
                        funnel(lo, hi, s0 & 31)
                    })
                    .collect();
                for j in 0..8 {
                    let o = pos_off(j);
                    let (q, r) = ((o >> 5) as usize, o & 31);
                    let st = (funnel(a[q + 1], a[q], r) >> 16) as u16;
                    let p = (8 * lane + j) as u32;
                    assert_eq!(
                        st,
                        trellis::state(&tile, rate, p),
                        "rate {} lane {lane} j {j}",
                        rate.bits()
                    );
                }
            }
        }
    }

    #[test]
    fn splits_cover_every_tile_row() {
        for &(k, n) in &[
            (128, 128),
            (4096, 14336),
            (14336, 4096),
            (28672, 128),
            (640, 1024),
        ] {
            let shape = Exl3Shape {
                k,
                n,
                rate: Bitrate::int(3),
                codebook: Codebook::Mul1,
            };
            for sm in [1, 132] {
                for bps in [1, 2, 8, 16, 32, 1000] {
                    let (splits, per) = split_for(&shape, sm, bps);
                    assert!(per >= 1, "{k}x{n}: {per}");
                    assert!(
                        splits * per >= k / 16 && (splits - 1) * per < k / 16,
                        "{k}x{n}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_codebook_and_rate_has_a_variant() {
        for cb in [Codebook::Inst3, Codebook::Mcg, Codebook::Mul1] {
            for rate in (1..=8).map(Bitrate::int).chain((1..=3).map(Bitrate::half)) {
                assert!(VARIANTS.contains(&defines(cb, rate).join(",").as_str()));
            }
        }
    }
}
