//! EXL3 linear layers on the GPU (`kernels/exl3.cu`).
//!
//! A layer is uploaded compressed ([`Exl3Linear`]: the trellis words as stored, `suh`/`svh` and the
//! bias as f32), so device memory is about the file's size. [`Exl3Linear::forward`] runs
//! `y = H(H(x * suh) W_inner) * svh + bias` for `m` rows in the [`Regime`] for `m`:
//! - up to [`MMA_ROWS`] rows (decode, batches): one launch on tensor cores, both Hadamards inside,
//!   each tile decoded once in registers into an mma operand (the codebook's exact fp16 values;
//!   up to 8 rows the decoded tile is the A operand, one mma a tile), fp16 activations, f32
//!   accumulation;
//! - more rows (prefill): the input Hadamard rounded to fp16, `W_inner` decoded to fp16 (exactly:
//!   every codebook value is an fp16) in bands, a cuBLAS tensor-core GEMM with f32 accumulation,
//!   then the output Hadamard.
//!
//! Their one rounding beyond the exact path is the activations' to fp16, as exllamav3 computes
//! throughout. [`Regime::Int8`] is the fast path for MUL1's one-row steps (int8 activations,
//! dp4a), the decoder's default as exllamav3's (`dense::Options::exl3_int8`). The exact path ([`Regime::Gemv`]: f32 activations, one row a launch) is the twin
//! they are tested against; its CPU twin is `trellm_quant::exl3::matmul::matmul_tiles`.
//!
//! Layers that share their input run as one launch in the tensor-core and int8 regimes
//! ([`Exl3Linear::forward_parts`]: q, k, v; gate, up), and a gated MLP's gate and up with the
//! activation fused into the band's epilogue ([`Exl3Linear::forward_gated`]).

use anyhow::{bail, ensure, Context, Result};
use cudarc::cublas::sys as bsys;
use cudarc::driver::{CudaFunction, CudaSlice};

use trellm_model::weights::Exl3Matrix;
use trellm_quant::exl3::{Bitrate, Codebook, Exl3Shape};

use crate::kernels::{KernelSource, EXL3};
use crate::{Arg, Gpu};

/// The `-D` defines of the module for a codebook and bitrate.
pub fn defines(codebook: Codebook, rate: Bitrate) -> Vec<String> {
    part_defines(codebook, &[rate])
}

/// The `-D` defines of the module whose multi-part kernels take parts at `rates` (part 0's, the
/// one-layer kernels' rate first; a part past the list at the last one's, as the kernel's
/// defaults have it).
pub fn part_defines(codebook: Codebook, rates: &[Bitrate]) -> Vec<String> {
    let cb = match codebook {
        Codebook::Inst3 => 0,
        Codebook::Mcg => 1,
        Codebook::Mul1 => 2,
    };
    let twice = |r: Bitrate| (r.bits() * 2.0) as u32;
    let mut d = vec![
        format!("EXL3_CB={cb}"),
        format!("EXL3_TWICE={}", twice(rates[0])),
    ];
    for (i, w) in rates.windows(2).enumerate().take(MAX_PARTS - 1) {
        if w[1] != w[0] {
            d.push(format!("EXL3_TWICE{}={}", i + 1, twice(w[1])));
        }
    }
    d
}

/// Every codebook x bitrate module CI compiles (`kernels::EXL3.variants`), and some modules for
/// parts at several rates.
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
    // Multi-part kernels whose parts differ in rate (`Exl3Linear::join`).
    "EXL3_CB=2,EXL3_TWICE=6,EXL3_TWICE1=8",
    "EXL3_CB=2,EXL3_TWICE=4,EXL3_TWICE1=6,EXL3_TWICE2=8",
    "EXL3_CB=0,EXL3_TWICE=5,EXL3_TWICE1=16",
    "EXL3_CB=1,EXL3_TWICE=16,EXL3_TWICE1=14,EXL3_TWICE2=2",
];

/// A variant string of [`VARIANTS`] as the defines list NVRTC gets.
pub fn variant_defines(v: &str) -> Vec<String> {
    v.split(',').map(str::to_string).collect()
}

/// Rows each warp of the input Hadamard (`exl3_in`) takes, its loads issued together (`IN_ROWS`
/// in exl3.cu).
const IN_ROWS: usize = 4;
/// Tile rows each block of the decode to fp16 (`exl3_dequant`) takes (`DQ_TILES` in exl3.cu).
const DQ_TILES: usize = 4;

/// Most rows the tensor-core GEMV takes (its widest instantiation, `exl3_mma64`).
pub const MMA_ROWS: usize = 64;

/// Rows from which the tensor-core GEMV's inputs are rotated by one `exl3_in` launch for all of
/// a launch's parts instead of inside each block (whose prologue would rotate the same rows
/// again for every band: at 32 rows that was ~30% of the layer's instructions). Measured end to
/// end (H200, 8B shape, K = 3, S_TG): rotating once is 2-4% slower at 2 and 4 rows, 2-7% faster
/// at 5-8 (`results/2026-12-02-s10-prerotate-ab.jsonl`).
pub const PREROTATE_ROWS: usize = 5;

/// Rows from which a layer runs as decode-to-fp16 + cuBLAS GEMM.
pub const GEMM_MIN_ROWS: usize = MMA_ROWS + 1;

/// How a layer runs its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Regime {
    /// The exact trellis GEMV (f32 activations), one row a launch: the twin the others are tested
    /// against.
    Gemv,
    /// The tensor-core GEMV: each tile decoded once to fp16 in registers as the mma B operand,
    /// fp16 activations, f32 accumulation; up to [`MMA_ROWS`] rows.
    Mma,
    /// Decode to fp16 in bands, then a cuBLAS tensor-core GEMM.
    Gemm,
    /// The fast path (MUL1 only), one row a launch (`exl3_q8`, both Hadamards inside): int8
    /// activations with a scale per 128-block, each weight's decode and product one dp4a; not
    /// exact (the weights' fp16 rounding is skipped, the activations keep about 7 bits): where
    /// `dense::Options::exl3_int8` (the default; `--exl3-exact` turns it off).
    Int8,
}

impl Regime {
    /// The regime for `m` rows (the crossovers measured by `gpu_exl3::timing`).
    pub fn for_rows(m: usize) -> Regime {
        if m >= GEMM_MIN_ROWS {
            Regime::Gemm
        } else {
            Regime::Mma
        }
    }
}

/// fp16 elements of the decoded band the GEMM path multiplies at once (bounds its scratch: 128 MB;
/// an 8B-shape layer's gate, up or down in one GEMM).
const BAND_ELEMS: usize = 64 << 20;

/// The kernels of one codebook x bitrate module.
pub struct Exl3Kernels {
    /// The rates of the parts its multi-part kernels (`q8`, `mma`) take, part 0's first (the
    /// one-layer kernels' rate).
    rates: [Bitrate; MAX_PARTS],
    pub input: CudaFunction,
    /// The fast path's one-row layer (MUL1 modules).
    pub q8: CudaFunction,
    /// The exact one-row GEMV.
    pub gemv: CudaFunction,
    /// The tensor-core GEMV for up to 8, 16, 32 and 64 rows.
    pub mma: [CudaFunction; 4],
    pub output: CudaFunction,
    pub dequant: CudaFunction,
}

impl Exl3Kernels {
    pub fn load(gpu: &Gpu, codebook: Codebook, rate: Bitrate) -> Result<Exl3Kernels> {
        Self::load_with(gpu, codebook, rate, &[])
    }

    /// The module whose multi-part kernels take layers at `rates` (one launch for q, k and v, or
    /// gate and up, quantized at different rates).
    pub fn load_parts(gpu: &Gpu, codebook: Codebook, rates: &[Bitrate]) -> Result<Exl3Kernels> {
        ensure!(
            (1..=MAX_PARTS).contains(&rates.len()),
            "{} EXL3 parts in one launch",
            rates.len()
        );
        Self::load_defines(gpu, part_defines(codebook, rates), rates)
    }

    /// Whether the multi-part kernels take these layers (their rates, part by part).
    /// (Up to [`MAX_PARTS`] of them, which `Exl3Linear::joinable` checks.)
    fn takes(&self, parts: &[Exl3Linear]) -> bool {
        parts
            .iter()
            .zip(&self.rates)
            .all(|(p, &r)| p.shape.rate == r)
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
        Self::load_defines(gpu, d, &[rate])
    }

    fn load_defines(gpu: &Gpu, d: Vec<String>, rates: &[Bitrate]) -> Result<Exl3Kernels> {
        let src: &KernelSource = &EXL3;
        let f = |name: &str| gpu.function(src, &d, name);
        let last = rates[rates.len() - 1];
        Ok(Exl3Kernels {
            rates: std::array::from_fn(|i| rates.get(i).copied().unwrap_or(last)),
            input: f("exl3_in")?,
            q8: f("exl3_q8")?,
            gemv: f("exl3_gemv")?,
            mma: [
                f("exl3_mma8")?,
                f("exl3_mma16")?,
                f("exl3_mma32")?,
                f("exl3_mma64")?,
            ],
            output: f("exl3_out")?,
            dequant: f("exl3_dequant")?,
        })
    }
}

/// Blocks the GEMV aims for per SM when it picks its split of the tile rows (`gpu_exl3::timing`
/// sweeps it; H200 run 1: 16 and 32 tied as the fastest for the trellis kernel, 8 and 16 within
/// 3% of each other for the whole layer).
pub const BLOCKS_PER_SM: usize = 16;

/// Blocks per SM the tensor-core GEMV splits a layer for at more than 8 rows (fewer rows a
/// block: fewer, longer splits; up to 8 rows, [`mma_split`]'s rule). Measured before that rule,
/// when it served every row count: H200, Llama-3.1-8B shape, MUL1 K = 2 / 3 / 4 end to end
/// (session 9, one binary): 4 / 6 / 8 / 12 / 16 gave decode 274-281 / 279-286 / 273-280 /
/// 259-265 / 255-261 tok/s; batches of 8 and 32 rows: 6 against 16 gave 1549 / 2600 against
/// 1477 / 2546 tok/s.
pub const MMA_BLOCKS_PER_SM: usize = 6;

/// Most blocks per SM a scratch's partial sums allow the tensor-core GEMV to split for.
pub const MMA_SWEEP_MAX: usize = 32;

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

/// Columns of `W_inner` the GEMM path decodes at once for a layer of `k` inputs and `n` outputs
/// (a multiple of 128 dividing into [`BAND_ELEMS`]).
fn band_cols(k: usize, n: usize) -> usize {
    ((BAND_ELEMS / k.max(1)) / 128 * 128).clamp(128, n)
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

/// Scratch buffers the layers pass through: the rotated input (f32 for the GEMV, fp16 for the
/// GEMM), the GEMV split's partial sums, the decoded band and the GEMM's output before the output
/// Hadamard. One scratch serves every layer it was sized for, one call at a time.
pub struct Exl3Scratch {
    xh: CudaSlice<f32>,
    partial: CudaSlice<f32>,
    xh16: CudaSlice<u16>,
    band: CudaSlice<u16>,
    yg: CudaSlice<f32>,
    /// The tensor-core GEMV's finished splits per band (zero between launches).
    counters: CudaSlice<u32>,
    /// One-row calls of MUL1 layers take the fast path ([`Regime::Int8`]).
    pub int8: bool,
    /// Blocks per SM the tensor-core and int8 GEMVs split for (at most [`MMA_SWEEP_MAX`], which
    /// the partial sums are sized for); `None`: [`mma_split`]'s rule.
    pub mma_per_sm: Option<usize>,
    /// Rows from which the tensor-core GEMV takes its inputs rotated beforehand by one
    /// `exl3_in` launch ([`PREROTATE_ROWS`]; the timing test moves it).
    pub prerotate_rows: usize,
}

impl Exl3Scratch {
    /// For `layers`, each run on up to its number of rows at once.
    pub fn new(gpu: &Gpu, layers: &[(&Exl3Linear, usize)]) -> Result<Exl3Scratch> {
        let groups: Vec<(&[Exl3Linear], usize)> = layers
            .iter()
            .map(|&(l, rows)| (std::slice::from_ref(l), rows))
            .collect();
        Self::for_groups(gpu, &groups)
    }

    /// For groups of layers run together ([`Exl3Linear::forward_parts`]), each on up to its
    /// number of rows at once.
    pub fn for_groups(gpu: &Gpu, groups: &[(&[Exl3Linear], usize)]) -> Result<Exl3Scratch> {
        let (mut xh, mut partial, mut xh16, mut band, mut yg, mut bands) = (1, 1, 1, 1, 1, 1);
        for &(parts, rows) in groups {
            let all: Vec<&Exl3Linear> = parts.iter().collect();
            if let Some(&first) = all.first() {
                // The parts as one launch: their outputs side by side.
                let shape = parts_shape(&all);
                bands = bands.max(shape.n / 128);
                for mma_rows in 1..=rows.clamp(1, MMA_ROWS) {
                    let splits = mma_split_for(&shape, gpu.sm_count, mma_rows, MMA_SWEEP_MAX)
                        .0
                        .max(mma_split(&shape, gpu.sm_count, mma_rows).0);
                    partial = partial.max(splits * mma_rows * shape.n);
                }
                xh = xh.max(first.shape.k);
                // The tensor-core GEMV's inputs rotated beforehand, fp16, every part's.
                xh16 = xh16.max(all.len() * rows.min(MMA_ROWS) * first.shape.k);
            }
            for l in parts {
                let (k, n) = (l.shape.k, l.shape.n);
                partial = partial.max(l.split(gpu.sm_count, BLOCKS_PER_SM).0 * n);
                if rows >= GEMM_MIN_ROWS {
                    xh16 = xh16.max(rows * k);
                    band = band.max(k * band_cols(k, n));
                    yg = yg.max(rows * n);
                }
            }
        }
        Ok(Exl3Scratch {
            xh: gpu.alloc(xh)?,
            partial: gpu.alloc(partial)?,
            xh16: gpu.alloc(xh16)?,
            band: gpu.alloc(band)?,
            yg: gpu.alloc(yg)?,
            counters: gpu.alloc(bands)?,
            int8: false,
            mma_per_sm: None,
            prerotate_rows: PREROTATE_ROWS,
        })
    }

    /// For one layer run one row at a time with `blocks_per_sm` of its GEMV (the timing sweep).
    pub fn for_gemv(gpu: &Gpu, l: &Exl3Linear, blocks_per_sm: usize) -> Result<Exl3Scratch> {
        let mut s = Self::new(gpu, &[(l, 1)])?;
        s.partial = gpu.alloc(l.partial_len(gpu.sm_count, blocks_per_sm).max(1))?;
        Ok(s)
    }
}

/// Where a layer reads its input: a device pointer to `m` rows of f32 or bf16 values, `ld` apart.
#[derive(Clone, Copy, Debug)]
pub struct Rows {
    pub ptr: u64,
    pub bf16: bool,
    pub ld: usize,
}

impl Rows {
    /// The rows from row `r` on.
    fn offset(self, r: usize) -> Rows {
        Rows {
            ptr: self.ptr + (r * self.ld * if self.bf16 { 2 } else { 4 }) as u64,
            ..self
        }
    }
}

/// Blocks per SM the tensor-core GEMV aims for with `mt` 16-row tiles, from `per_sm` for one
/// (more rows: fewer splits, so the partial sums' traffic stays below the weights').
fn mma_blocks_per_sm(mt: usize, per_sm: usize) -> usize {
    (per_sm / mt).max(1)
}

/// fp16 values of the rotated input a tensor-core GEMV block holds (`XS_HALVES` in exl3.cu).
const XS_HALVES: usize = 24320;

/// Most rows of the one-tile tensor-core GEMV (`exl3_mma8`).
const MMA8_ROWS: usize = 8;
/// Most rows a launch with the RoPE epilogue takes (the 8- and 16-row kernels have it; in the
/// wider ones it would spill at some rates).
const ROPE_ROWS: usize = 16;

/// Blocks of the one-tile tensor-core GEMV (`exl3_mma8`, up to 8 rows) resident on an SM: its
/// registers are bounded for that many (`MMA_MIN_BLOCKS` in exl3.cu: 64 registers x 256 threads),
/// and its shared memory allows it.
const MMA8_RESIDENT: usize = 4;

/// What a block's start and finish (prologue, the first loads, the split's epilogue) cost, in
/// tile rows of its main loop: the fit of [`mma_split`]'s rule to `gpu_exl3::one_row_split_sweep`.
const BLOCK_COST_TILES: usize = 8;

/// The tensor-core GEMV's split for `m` rows, in whole pairs of its steps (8 tile rows, whole
/// 128-input blocks: its blocks rotate their own inputs), each split's rows of inputs fitting the
/// block's [`XS_HALVES`] (with the 8 of padding a row). Returns (splits, tile rows per split).
///
/// Up to 8 rows (`exl3_mma8`): the split whose blocks fill every SM's resident slots at least once
/// (at most one SM short of it) and whose busiest SM finishes first, counting each block as its
/// tile rows plus [`BLOCK_COST_TILES`]. Measured on the H200 at the 8B shape, MUL1 K = 3, one row
/// (`one_row_split_sweep`, session 12), it picks the fastest split of every group: q/k/v 11 splits
/// (12.5 us against 13.5 at the 16 of the rule before), o 16 (9.8), gate/up 4 (40.2), down 16 (21.9
/// against 24.1 at 23). More rows: [`MMA_BLOCKS_PER_SM`].
pub fn mma_split(shape: &Exl3Shape, sm_count: usize, m: usize) -> (usize, usize) {
    mma_split_capped(shape, sm_count, m, mma_per_max(m))
}

/// [`mma_split`] with at most `per_max` tile rows a split.
fn mma_split_capped(
    shape: &Exl3Shape,
    sm_count: usize,
    m: usize,
    per_max: usize,
) -> (usize, usize) {
    if m > MMA8_ROWS {
        return mma_split_for_capped(shape, sm_count, m, MMA_BLOCKS_PER_SM, per_max);
    }
    let tiles_k = shape.tiles_k().max(8);
    let bands = (shape.n / 128).max(1);
    let sms = sm_count.max(1);
    (8..=tiles_k.next_multiple_of(8).min(per_max))
        .step_by(8)
        .map(|per| {
            let splits = tiles_k.div_ceil(per);
            // The shortest split that gives this many.
            let per = tiles_k.div_ceil(splits).next_multiple_of(8);
            let blocks = bands * splits;
            let rounds = blocks.div_ceil(sms);
            let key = (
                rounds < MMA8_RESIDENT,
                rounds * (per + BLOCK_COST_TILES),
                blocks,
            );
            (key, (splits, per))
        })
        .min_by_key(|&(key, _)| key)
        .map_or((1, 8), |(_, split)| split)
}

/// Most tile rows a split of the int8 GEMV (`exl3_q8`) takes: its inputs as 4-byte splats fit
/// `Q8_INPUTS` (exl3.cu).
const Q8_PER_MAX: usize = 744;

/// Most tile rows a split of the tensor-core GEMV takes for `m` rows: its inputs of every row fit
/// the block's [`XS_HALVES`] (with the 8 of padding a row).
fn mma_per_max(m: usize) -> usize {
    (((XS_HALVES / m.max(1) - 8) / 16) / 8 * 8).max(8)
}

/// [`mma_split`] aiming for `per_sm` blocks per SM at one row (`gpu_exl3::timing` sweeps it).
pub fn mma_split_for(
    shape: &Exl3Shape,
    sm_count: usize,
    m: usize,
    per_sm: usize,
) -> (usize, usize) {
    mma_split_for_capped(shape, sm_count, m, per_sm, mma_per_max(m))
}

/// [`mma_split_for`] with at most `per_max` tile rows a split.
fn mma_split_for_capped(
    shape: &Exl3Shape,
    sm_count: usize,
    m: usize,
    per_sm: usize,
    per_max: usize,
) -> (usize, usize) {
    let mt = m.div_ceil(16).next_power_of_two();
    let tiles_k = shape.tiles_k().max(8);
    let bands = (shape.n / 128).max(1);
    let want = (sm_count * mma_blocks_per_sm(mt, per_sm)).div_ceil(bands);
    let splits = want.clamp(1, (tiles_k / 8).max(1));
    let per = tiles_k.div_ceil(splits).next_multiple_of(8).min(per_max);
    (tiles_k.div_ceil(per), per)
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
        check_dims(&shape, rows, cols)?;
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

    /// A layer of random trellis words generated on the device (every bit pattern is a valid
    /// code), `suh` = 1 and `svh` = 1/sqrt(k) so outputs keep the inputs' scale: the speed of a
    /// real layer of this shape without a file.
    pub fn synthetic(gpu: &Gpu, shape: Exl3Shape, seed: u64) -> Result<Exl3Linear> {
        check_dims(&shape, shape.n, shape.k)?;
        let fill_u = gpu.function(&crate::kernels::ELEMENTWISE, &[], "fill_random_u32")?;
        let fill_f = gpu.function(&crate::kernels::ELEMENTWISE, &[], "fill_f32")?;
        let bytes = shape.trellis_bytes();
        let trellis = gpu.alloc::<u8>(bytes)?;
        let grid = (gpu.sm_count as u32 * 8, 1, 1);
        gpu.launch(
            &fill_u,
            grid,
            256,
            &[
                Arg::Ptr(gpu.ptr(&trellis)),
                Arg::U64((bytes / 4) as u64),
                Arg::U64(seed.wrapping_mul(0x2545_f491_4f6c_dd1d)),
            ],
        )?;
        let vec = |n: usize, v: f32| -> Result<CudaSlice<f32>> {
            let s = gpu.alloc::<f32>(n)?;
            gpu.launch(
                &fill_f,
                grid,
                256,
                &[Arg::Ptr(gpu.ptr(&s)), Arg::U64(n as u64), Arg::F32(v)],
            )?;
            Ok(s)
        };
        Ok(Exl3Linear {
            shape,
            rows: shape.n,
            cols: shape.k,
            trellis,
            suh: vec(shape.k, 1.0)?,
            svh: vec(shape.n, 1.0 / (shape.k as f32).sqrt())?,
            bias: None,
            k: Exl3Kernels::load(gpu, shape.codebook, shape.rate)?,
        })
    }

    /// The layer using only its first `rows` outputs and `cols` inputs (a padded layer).
    pub fn used(mut self, rows: usize, cols: usize) -> Exl3Linear {
        self.rows = rows.clamp(1, self.shape.n);
        self.cols = cols.clamp(1, self.shape.k);
        self
    }

    /// Whether layers that take the same input run as one launch in the tensor-core and int8
    /// regimes: one input width and codebook, and rates the first layer's kernels take (all one
    /// rate, or the rates [`Self::join`] prepared them for).
    pub fn one_launch(parts: &[Exl3Linear]) -> bool {
        let Some(first) = parts.first() else {
            return false;
        };
        first.k.takes(parts) && Self::joinable(parts)
    }

    fn joinable(parts: &[Exl3Linear]) -> bool {
        let first = &parts[0];
        parts.len() <= MAX_PARTS
            && parts.iter().all(|p| {
                p.shape.k == first.shape.k
                    && p.cols == first.cols
                    && p.shape.codebook == first.shape.codebook
            })
    }

    /// Prepares layers that take the same input (q, k, v; gate, up) to run as one launch where
    /// their rates differ: the first gets the module whose multi-part kernels take the parts'
    /// rates (uniform parts need nothing more).
    pub fn join(gpu: &Gpu, parts: &mut [Exl3Linear]) -> Result<()> {
        let Some(first) = parts.first() else {
            return Ok(());
        };
        if parts.len() > 1 && Self::joinable(parts) && !first.k.takes(parts) {
            let codebook = first.shape.codebook;
            let rates: Vec<Bitrate> = parts.iter().map(|p| p.shape.rate).collect();
            parts[0].k = Exl3Kernels::load_parts(gpu, codebook, &rates)?;
        }
        Ok(())
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

    /// Partial sums the one-row GEMV writes at `blocks_per_sm`.
    pub fn partial_len(&self, sm_count: usize, blocks_per_sm: usize) -> usize {
        self.split(sm_count, blocks_per_sm).0 * self.shape.n
    }

    /// `y[..rows] = layer(x[..cols])` for one row of f32; `x` and `y` are device f32 buffers.
    pub fn gemv(&self, gpu: &Gpu, s: &Exl3Scratch, x: u64, y: u64) -> Result<()> {
        self.gemv_rows(gpu, s, 1, self.f32_rows(x), y, self.rows, BLOCKS_PER_SM)
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
        self.gemv_rows(gpu, s, 1, self.f32_rows(x), y, self.rows, blocks_per_sm)
    }

    fn f32_rows(&self, x: u64) -> Rows {
        Rows {
            ptr: x,
            bf16: false,
            ld: self.cols,
        }
    }

    /// `y[r][..rows] = layer(x[r][..cols])` for the `m` rows of `x`, `y` f32 with row stride
    /// `ldy`, in the regime for `m` rows ([`Regime::for_rows`]).
    pub fn forward(
        &self,
        gpu: &Gpu,
        s: &Exl3Scratch,
        m: usize,
        x: Rows,
        y: u64,
        ldy: usize,
    ) -> Result<()> {
        Self::forward_parts(gpu, s, std::slice::from_ref(self), m, x, y, ldy)
    }

    /// [`Self::forward`] for layers that take the same input (q, k, v; gate, up), their outputs
    /// side by side in `y` (each part's `rows`). Parts of one module run as one launch in the
    /// tensor-core and int8 regimes (one ramp and tail instead of one a part).
    pub fn forward_parts(
        gpu: &Gpu,
        s: &Exl3Scratch,
        parts: &[Exl3Linear],
        m: usize,
        x: Rows,
        y: u64,
        ldy: usize,
    ) -> Result<()> {
        Self::run_parts(gpu, s, parts, m, x, y, ldy, Epilogue::Plain).map(|_| ())
    }

    /// A gated MLP's gate and up layers (`parts`, equally wide) with the activation fused: writes
    /// `out[r][c] = bf16(act(gate) * up)` (`act` a prelude activation code, row stride the
    /// layers' `rows`) in one launch and returns true where the regime for `m` rows allows it;
    /// returns false, having run nothing, where it does not (the caller runs the layers and the
    /// activation apart).
    pub fn forward_gated(
        gpu: &Gpu,
        s: &Exl3Scratch,
        parts: &[Exl3Linear],
        m: usize,
        x: Rows,
        act: i32,
        out: u64,
    ) -> Result<bool> {
        let pair = parts.len() == 2
            && parts[0].shape.n == parts[1].shape.n
            && parts[0].rows == parts[1].rows;
        if !pair {
            return Ok(false);
        }
        Self::run_parts(gpu, s, parts, m, x, 0, 0, Epilogue::Gated { act, out })
    }

    /// An attention's q, k and v layers (`parts`: one band a head, so a head dimension of 128,
    /// and no padded outputs) with RoPE and the KV-cache write fused into their launch's
    /// epilogue ([`RopeKv`]); nothing goes to a y. Returns true where the regime for `m` rows
    /// (up to [`ROPE_ROWS`]) allows it; false, having run nothing, where it does not or the
    /// layers do not fit (the caller runs the layers and the rope kernel apart).
    pub fn forward_rope(
        gpu: &Gpu,
        s: &Exl3Scratch,
        parts: &[Exl3Linear],
        m: usize,
        x: Rows,
        rope: &RopeKv,
    ) -> Result<bool> {
        let heads = |p: &Exl3Linear, n: usize| p.rows == p.shape.n && p.shape.n == 128 * n;
        let fits = m <= ROPE_ROWS
            && parts.len() == 3
            && heads(&parts[0], rope.n_heads)
            && heads(&parts[1], rope.n_kv)
            && heads(&parts[2], rope.n_kv);
        if !fits {
            return Ok(false);
        }
        Self::run_parts(gpu, s, parts, m, x, 0, 0, Epilogue::Rope(*rope))
    }

    /// [`Self::forward_parts`] with a fused epilogue; returns whether the layers ran (always with
    /// [`Epilogue::Plain`]).
    #[allow(clippy::too_many_arguments)]
    fn run_parts(
        gpu: &Gpu,
        s: &Exl3Scratch,
        parts: &[Exl3Linear],
        m: usize,
        x: Rows,
        y: u64,
        ldy: usize,
        epi: Epilogue,
    ) -> Result<bool> {
        let first = parts.first().context("no EXL3 layers")?;
        let regime = if s.int8 && m == 1 && first.shape.codebook == Codebook::Mul1 {
            Regime::Int8
        } else {
            Regime::for_rows(m)
        };
        let fused = Self::one_launch(parts);
        let all: Vec<&Exl3Linear> = parts.iter().collect();
        match regime {
            Regime::Mma if fused => {
                let mut r = 0;
                while r < m {
                    let g = (m - r).min(MMA_ROWS);
                    let epi = epi.at_row(r, first.rows);
                    let y = y + (4 * r * ldy) as u64;
                    mma_rows(gpu, s, &all, g, x.offset(r), y, ldy, epi)?;
                    r += g;
                }
                Ok(true)
            }
            Regime::Int8 if fused => int8_row(gpu, s, &all, x, y, ldy, epi).map(|_| true),
            _ if !matches!(epi, Epilogue::Plain) => Ok(false),
            _ => {
                let mut off = 0;
                for p in parts {
                    p.forward_in(gpu, s, regime, m, x, y + (4 * off) as u64, ldy)?;
                    off += p.rows;
                }
                Ok(true)
            }
        }
    }

    /// [`Self::forward`] in a given regime (the tests and the crossover's timing).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_in(
        &self,
        gpu: &Gpu,
        s: &Exl3Scratch,
        regime: Regime,
        m: usize,
        x: Rows,
        y: u64,
        ldy: usize,
    ) -> Result<()> {
        ensure!(
            m >= 1 && ldy >= self.rows,
            "EXL3 layer of {m} rows, ldy {ldy}"
        );
        match regime {
            Regime::Gemm => return self.gemm_rows(gpu, s, m, x, y, ldy),
            Regime::Mma => {
                let mut r = 0;
                while r < m {
                    let g = (m - r).min(MMA_ROWS);
                    let y = y + (4 * r * ldy) as u64;
                    mma_rows(gpu, s, &[self], g, x.offset(r), y, ldy, Epilogue::Plain)?;
                    r += g;
                }
                return Ok(());
            }
            Regime::Int8 => {
                for r in 0..m {
                    int8_row(
                        gpu,
                        s,
                        &[self],
                        x.offset(r),
                        y + (4 * r * ldy) as u64,
                        ldy,
                        Epilogue::Plain,
                    )?;
                }
                return Ok(());
            }
            Regime::Gemv => {}
        }
        for r in 0..m {
            let y = y + (4 * r * ldy) as u64;
            self.gemv_rows(gpu, s, 1, x.offset(r), y, ldy, BLOCKS_PER_SM)?;
        }
        Ok(())
    }

    /// The exact path for `m` (one) rows.
    #[allow(clippy::too_many_arguments)]
    fn gemv_rows(
        &self,
        gpu: &Gpu,
        s: &Exl3Scratch,
        m: usize,
        x: Rows,
        y: u64,
        ldy: usize,
        blocks_per_sm: usize,
    ) -> Result<()> {
        let (k, n) = (self.shape.k, self.shape.n);
        let (splits, per) = self.split(gpu.sm_count, blocks_per_sm);
        ensure!(
            m == 1 && s.xh.len() >= m * k && s.partial.len() >= splits * m * n,
            "EXL3 scratch too small for {m} rows of {k}x{n}"
        );
        let (xh, partial) = (gpu.ptr(&s.xh), gpu.ptr(&s.partial));
        self.launch_input(gpu, m, x, xh, false)?;
        self.launch_inner_rows(gpu, m, xh, partial, splits, per)?;
        self.launch_output(gpu, m, partial, splits, y, ldy)
    }

    /// The GEMM path: fp16 input Hadamard, `W_inner` decoded band by band into fp16 and multiplied
    /// on tensor cores (f32 accumulation) into `yg`, then the output Hadamard.
    fn gemm_rows(
        &self,
        gpu: &Gpu,
        s: &Exl3Scratch,
        m: usize,
        x: Rows,
        y: u64,
        ldy: usize,
    ) -> Result<()> {
        let (k, n) = (self.shape.k, self.shape.n);
        let bc = band_cols(k, n);
        ensure!(
            s.xh16.len() >= m * k && s.band.len() >= k * bc && s.yg.len() >= m * n,
            "EXL3 scratch too small for {m} rows of {k}x{n}"
        );
        let (xh, band, yg) = (gpu.ptr(&s.xh16), gpu.ptr(&s.band), gpu.ptr(&s.yg));
        self.launch_input(gpu, m, x, xh, true)?;
        // Without padded outputs or a bias, the output Hadamard and svh are folded into the
        // decoded band and the GEMM writes y itself (no pass over an f32 intermediate).
        let folded = self.rows == n && self.bias.is_none();
        let svh = if folded { gpu.ptr(&self.svh) } else { 0 };
        let mut c0 = 0;
        while c0 < n {
            let cols = bc.min(n - c0);
            gpu.launch(
                &self.k.dequant,
                ((cols / 128) as u32, (k / 16 / DQ_TILES) as u32, 1),
                256,
                &[
                    Arg::Ptr(gpu.ptr(&self.trellis)),
                    Arg::Ptr(band),
                    Arg::I32(1),
                    Arg::I32(self.shape.tiles_n() as i32),
                    Arg::I32((c0 / 128) as i32),
                    Arg::I32(cols as i32),
                    Arg::Ptr(svh),
                ],
            )?;
            if folded {
                gemm_f16(gpu, (m, cols, k), xh, band, y + (4 * c0) as u64, ldy)?;
            } else {
                gemm_f16(gpu, (m, cols, k), xh, band, yg + (4 * c0) as u64, n)?;
            }
            c0 += cols;
        }
        if folded {
            return Ok(());
        }
        self.launch_output(gpu, m, yg, 1, y, ldy)
    }

    fn launch_input(&self, gpu: &Gpu, m: usize, x: Rows, xh: u64, f16: bool) -> Result<()> {
        launch_input(gpu, &[self], m, x, xh, f16)
    }

    fn launch_output(
        &self,
        gpu: &Gpu,
        m: usize,
        partial: u64,
        splits: usize,
        y: u64,
        ldy: usize,
    ) -> Result<()> {
        let n = self.shape.n;
        gpu.launch(
            &self.k.output,
            ((n / 128).div_ceil(4) as u32, m as u32, 1),
            128,
            &[
                Arg::Ptr(partial),
                Arg::I32(splits as i32),
                Arg::I32(n as i32),
                Arg::I32(m as i32),
                Arg::Ptr(gpu.ptr(&self.svh)),
                Arg::Ptr(self.bias.as_ref().map_or(0, |b| gpu.ptr(b))),
                Arg::Ptr(y),
                Arg::I32(ldy as i32),
                Arg::I32(self.rows as i32),
            ],
        )
    }

    /// The trellis kernel alone for one row: `partial[split][n]` from an already rotated `xh`
    /// (the timing).
    pub fn launch_inner(
        &self,
        gpu: &Gpu,
        xh: u64,
        partial: u64,
        splits: usize,
        per: usize,
    ) -> Result<()> {
        self.launch_inner_rows(gpu, 1, xh, partial, splits, per)
    }

    /// The trellis kernel alone for `m` (one) rows: `partial[split][row][n]`.
    pub fn launch_inner_rows(
        &self,
        gpu: &Gpu,
        m: usize,
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
        ensure!(m == 1, "the exact trellis GEMV takes one row, not {m}");
        let f = &self.k.gemv;
        gpu.launch(
            f,
            ((self.shape.n / 128) as u32, splits as u32, 1),
            256,
            &[
                Arg::Ptr(gpu.ptr(&self.trellis)),
                Arg::Ptr(xh),
                Arg::Ptr(partial),
                Arg::I32(self.shape.tiles_k() as i32),
                Arg::I32(self.shape.tiles_n() as i32),
                Arg::I32(per as i32),
                Arg::I32(m as i32),
            ],
        )
    }

    /// `W_inner` decoded on the device, row-major `[k][n]` (the decode's exactness check): by the
    /// f32 decoder of the exact GEMV, and by the fp16 one of the tensor-core kernels.
    pub fn dequant(&self, gpu: &Gpu) -> Result<(Vec<f32>, Vec<u16>)> {
        let (k, n) = (self.shape.k, self.shape.n);
        let w = gpu.alloc::<f32>(k * n)?;
        let h = gpu.alloc::<u16>(k * n)?;
        for (ptr, f16) in [(gpu.ptr(&w), 0), (gpu.ptr(&h), 1)] {
            gpu.launch(
                &self.k.dequant,
                ((n / 128) as u32, (k / 16 / DQ_TILES) as u32, 1),
                256,
                &[
                    Arg::Ptr(gpu.ptr(&self.trellis)),
                    Arg::Ptr(ptr),
                    Arg::I32(f16),
                    Arg::I32(self.shape.tiles_n() as i32),
                    Arg::I32(0),
                    Arg::I32(n as i32),
                    Arg::Ptr(0),
                ],
            )?;
        }
        gpu.sync()?;
        Ok((gpu.stream.clone_dtoh(&w)?, gpu.stream.clone_dtoh(&h)?))
    }
}

/// Most layers one launch takes (`PART_PARAMS` in exl3.cu).
const MAX_PARTS: usize = 3;

/// RoPE and the KV-cache write of an attention's q/k/v launch, as `qkv_rope` does them (the
/// `RopeKv` of exl3.cu): device pointers to the rows' positions, the layer's inverse
/// frequencies (the first 64: all 128 dims rotate, half-split), q's f32 output (`n_heads` x 128
/// a row), the layer's key and value caches, and the block tables (0 for a contiguous cache).
#[derive(Debug, Clone, Copy)]
pub struct RopeKv {
    pub pos: u64,
    pub inv_freq: u64,
    pub n_heads: usize,
    pub n_kv: usize,
    pub pos_scale: f32,
    pub in_scale: f32,
    pub q_scale: f32,
    pub q: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub tables: u64,
    pub table_off: u64,
    pub block: usize,
}

/// What the last block of a band does with the band's outputs.
#[derive(Debug, Clone, Copy)]
enum Epilogue {
    /// Writes them to y (with svh and the bias, as every epilogue applies them).
    Plain,
    /// A gated MLP: `out[r][c] = bf16(act(gate) * up)` (a prelude activation code) instead of y.
    Gated { act: i32, out: u64 },
    /// q/k/v: RoPE, q out, k and v into the cache instead of y.
    Rope(RopeKv),
}

impl Epilogue {
    /// The epilogue of the launch that starts at row `r` (`rows` outputs a row of a gated MLP).
    fn at_row(self, r: usize, rows: usize) -> Epilogue {
        let r64 = r as u64;
        match self {
            Epilogue::Plain => Epilogue::Plain,
            Epilogue::Gated { act, out } => Epilogue::Gated {
                act,
                out: out + 2 * r64 * rows as u64,
            },
            Epilogue::Rope(e) => Epilogue::Rope(RopeKv {
                pos: e.pos + 4 * r64,
                q: e.q + 4 * r64 * (128 * e.n_heads) as u64,
                table_off: if e.table_off == 0 {
                    0
                } else {
                    e.table_off + 4 * r64
                },
                ..e
            }),
        }
    }
}

/// The parts' launch arguments (`PART_PARAMS`): pointers, used outputs and bands of up to
/// [`MAX_PARTS`] layers (absent ones null, with no bands), the epilogue's (the fused activation's
/// code and bf16 output, or -1; RoPE's, or no heads), and the bands in all.
fn part_args(gpu: &Gpu, parts: &[&Exl3Linear], epi: Epilogue) -> Result<(Vec<Arg>, usize)> {
    ensure!(
        (1..=MAX_PARTS).contains(&parts.len()),
        "{} EXL3 layers in one launch",
        parts.len()
    );
    let get = |i: usize| parts.get(i).copied();
    let mut a = Vec::with_capacity(30);
    for i in 0..MAX_PARTS {
        a.push(Arg::Ptr(get(i).map_or(0, |l| gpu.ptr(&l.trellis))));
    }
    for i in 0..MAX_PARTS {
        a.push(Arg::Ptr(get(i).map_or(0, |l| gpu.ptr(&l.suh))));
    }
    for i in 0..MAX_PARTS {
        a.push(Arg::Ptr(get(i).map_or(0, |l| gpu.ptr(&l.svh))));
    }
    for i in 0..MAX_PARTS {
        let bias = get(i).and_then(|l| l.bias.as_ref());
        a.push(Arg::Ptr(bias.map_or(0, |b| gpu.ptr(b))));
    }
    for i in 0..MAX_PARTS {
        a.push(Arg::I32(get(i).map_or(0, |l| l.rows) as i32));
    }
    let bands = |i: usize| get(i).map_or(0, |l| l.shape.n / 128);
    a.push(Arg::I32(bands(0) as i32));
    a.push(Arg::I32(bands(1) as i32));
    let (act, act_out) = match epi {
        Epilogue::Gated { act, out } => (act, out),
        _ => (-1, 0),
    };
    a.push(Arg::I32(act));
    a.push(Arg::Ptr(act_out));
    let rope = match epi {
        Epilogue::Rope(e) => e,
        _ => RopeKv {
            pos: 0,
            inv_freq: 0,
            n_heads: 0,
            n_kv: 0,
            pos_scale: 1.0,
            in_scale: 1.0,
            q_scale: 1.0,
            q: 0,
            k_cache: 0,
            v_cache: 0,
            tables: 0,
            table_off: 0,
            block: 0,
        },
    };
    a.extend([
        Arg::Ptr(rope.pos),
        Arg::Ptr(rope.inv_freq),
        Arg::I32(rope.n_heads as i32),
        Arg::I32(rope.n_kv as i32),
        Arg::F32(rope.pos_scale),
        Arg::F32(rope.in_scale),
        Arg::F32(rope.q_scale),
        Arg::Ptr(rope.q),
        Arg::Ptr(rope.k_cache),
        Arg::Ptr(rope.v_cache),
        Arg::Ptr(rope.tables),
        Arg::Ptr(rope.table_off),
        Arg::I32(rope.block as i32),
    ]);
    Ok((a, (0..MAX_PARTS).map(bands).sum()))
}

/// The shape the parts make side by side (`n` their outputs in all).
fn parts_shape(parts: &[&Exl3Linear]) -> Exl3Shape {
    Exl3Shape {
        n: parts.iter().map(|l| l.shape.n).sum(),
        ..parts[0].shape
    }
}

/// The fast path for one row: one launch (`exl3_q8`) for all `parts`, split as the tensor-core
/// GEMV's.
fn int8_row(
    gpu: &Gpu,
    s: &Exl3Scratch,
    parts: &[&Exl3Linear],
    x: Rows,
    y: u64,
    ldy: usize,
    epi: Epilogue,
) -> Result<()> {
    let l = parts[0];
    ensure!(
        l.shape.codebook == Codebook::Mul1,
        "the int8 trellis GEMV is MUL1's, not {:?}'s",
        l.shape.codebook
    );
    launch_rows(gpu, s, &l.k.q8, Q8_PER_MAX, parts, 1, x, y, ldy, epi)
}

/// The tensor-core GEMV for `m <= MMA_ROWS` rows of all `parts`: one launch, both Hadamards
/// included.
#[allow(clippy::too_many_arguments)]
fn mma_rows(
    gpu: &Gpu,
    s: &Exl3Scratch,
    parts: &[&Exl3Linear],
    m: usize,
    x: Rows,
    y: u64,
    ldy: usize,
    epi: Epilogue,
) -> Result<()> {
    let k = &parts[0].k;
    let f = match m {
        1..=MMA8_ROWS => &k.mma[0],
        9..=16 => &k.mma[1],
        17..=32 => &k.mma[2],
        33..=MMA_ROWS => &k.mma[3],
        _ => bail!("the tensor-core GEMV takes 1..={MMA_ROWS} rows, not {m}"),
    };
    launch_rows(gpu, s, f, mma_per_max(m), parts, m, x, y, ldy, epi)
}

/// Launches `f` (a tensor-core or int8 GEMV: `PART_PARAMS` and the rows' arguments) on `m` rows
/// of `parts`, split for the scratch's blocks per SM, at most `per_max` tile rows a split (what
/// its shared inputs hold).
#[allow(clippy::too_many_arguments)]
fn launch_rows(
    gpu: &Gpu,
    s: &Exl3Scratch,
    f: &CudaFunction,
    per_max: usize,
    parts: &[&Exl3Linear],
    m: usize,
    x: Rows,
    y: u64,
    ldy: usize,
    epi: Epilogue,
) -> Result<()> {
    let shape = parts_shape(parts);
    let n = shape.n;
    let (splits, per) = match s.mma_per_sm {
        Some(per_sm) => mma_split_for_capped(&shape, gpu.sm_count, m, per_sm, per_max),
        None => mma_split_capped(&shape, gpu.sm_count, m, per_max),
    };
    ensure!(
        s.partial.len() >= splits * m * n && s.counters.len() >= n / 128 && per <= per_max,
        "EXL3 scratch too small for {m} rows of {}x{n}",
        shape.k
    );
    let xh_pre = if m >= s.prerotate_rows {
        ensure!(
            s.xh16.len() >= parts.len() * m * shape.k,
            "EXL3 scratch too small for {m} rotated rows of {}",
            shape.k
        );
        let xh = gpu.ptr(&s.xh16);
        launch_input(gpu, parts, m, x, xh, true)?;
        xh
    } else {
        0
    };
    let (mut args, bands) = part_args(gpu, parts, epi)?;
    args.extend([
        Arg::Ptr(x.ptr),
        Arg::I32(x.bf16 as i32),
        Arg::I32(x.ld as i32),
        Arg::I32(parts[0].cols as i32),
        Arg::Ptr(xh_pre),
        Arg::Ptr(gpu.ptr(&s.partial)),
        Arg::Ptr(gpu.ptr(&s.counters)),
        Arg::Ptr(y),
        Arg::I32(ldy as i32),
        Arg::I32(shape.tiles_k() as i32),
        Arg::I32(per as i32),
        Arg::I32(m as i32),
    ]);
    gpu.launch(f, (bands as u32, splits as u32, 1), 256, &args)
}

/// `exl3_in`: the input Hadamard, xh = H128(x * suh), of `m` rows for each of `parts` (up to
/// [`MAX_PARTS`] layers of one input, `m` rows of k apart in xh), f32 or fp16 (`f16`).
fn launch_input(
    gpu: &Gpu,
    parts: &[&Exl3Linear],
    m: usize,
    x: Rows,
    xh: u64,
    f16: bool,
) -> Result<()> {
    let k = parts[0].shape.k;
    let suh = |i: usize| parts.get(i).map_or(0, |l| gpu.ptr(&l.suh));
    gpu.launch(
        &parts[0].k.input,
        (
            (k / 128).div_ceil(4) as u32,
            m.div_ceil(IN_ROWS) as u32,
            parts.len() as u32,
        ),
        128,
        &[
            Arg::Ptr(x.ptr),
            Arg::I32(x.bf16 as i32),
            Arg::I32(x.ld as i32),
            Arg::I32(parts[0].cols as i32),
            Arg::Ptr(suh(0)),
            Arg::Ptr(suh(1)),
            Arg::Ptr(suh(2)),
            Arg::U64((m * k) as u64),
            Arg::Ptr(xh),
            Arg::I32(f16 as i32),
            Arg::I32(k as i32),
            Arg::I32(m as i32),
        ],
    )
}

fn check_dims(shape: &Exl3Shape, rows: usize, cols: usize) -> Result<()> {
    ensure!(
        shape.k > 0 && shape.n > 0 && shape.k.is_multiple_of(128) && shape.n.is_multiple_of(128),
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
    Ok(())
}

/// `y[m][ldy] (f32, row-major, the first n columns) = xh[m][k] (fp16) . w[k][n] (fp16)`, f32
/// accumulation on tensor cores (cuBLAS).
fn gemm_f16(
    gpu: &Gpu,
    (m, n, k): (usize, usize, usize),
    xh: u64,
    w: u64,
    y: u64,
    ldy: usize,
) -> Result<()> {
    // Row-major Y = XH W is column-major Y^T (n x m) = W^T (n x k, w's rows as columns) . XH^T.
    let f16t = bsys::cudaDataType::CUDA_R_16F;
    let none = bsys::cublasOperation_t::CUBLAS_OP_N;
    crate::dense::gemm_ex(
        gpu,
        "cublas_gemm_f16",
        (none, none),
        (n, m, k),
        (w, f16t, n),
        (xh, f16t, k),
        (y, bsys::cudaDataType::CUDA_R_32F, ldy),
    )
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
    fn mma_splits_are_whole_hadamard_blocks_that_fit_the_block() {
        for &(k, n) in &[
            (128, 128),
            (4096, 14336),
            (14336, 4096),
            (4096, 128256),
            (640, 1024),
        ] {
            let shape = Exl3Shape {
                k,
                n,
                rate: Bitrate::int(3),
                codebook: Codebook::Mul1,
            };
            for m in 1..=MMA_ROWS {
                let (splits, per) = mma_split(&shape, 132, m);
                let tiles_k = k / 16;
                assert!(per % 8 == 0 && per >= 8, "{k}x{n} m={m}: {per}");
                assert!(
                    splits * per >= tiles_k && (splits - 1) * per < tiles_k,
                    "{k}x{n} m={m}"
                );
                assert!(m * (16 * per + 8) <= XS_HALVES, "{k}x{n} m={m}: {per}");
            }
        }
    }

    /// The rule's picks at the 8B shape's groups on 132 SMs are the fastest splits measured there
    /// (`gpu_exl3::one_row_split_sweep`, session 12).
    #[test]
    fn one_row_split_rule_picks_the_measured_fastest() {
        for &(k, n, splits) in &[
            (4096, 6144, 11),
            (4096, 4096, 16),
            (4096, 28672, 4),
            (14336, 4096, 16),
        ] {
            let shape = Exl3Shape {
                k,
                n,
                rate: Bitrate::int(3),
                codebook: Codebook::Mul1,
            };
            for m in [1, 8] {
                assert_eq!(mma_split(&shape, 132, m).0, splits, "{k}x{n}, {m} rows");
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
