//! The EXL3 tile encoder on the GPU (`kernels/viterbi.cu`): the tail-biting Viterbi of
//! [`trellm_quant::exl3::encode::viterbi_with`], bit for bit (the same states and f32 cost), many
//! tiles a launch.
//!
//! One module per K; the codebook's 65536 fp16 values are uploaded once per codebook and copied
//! into each block's shared memory. A block of 1024 threads runs one tile (K <= 6) or 2^(K-6)
//! tiles in lock step, one thread per edge (or per 2^(6-K) edges); back-pointers, one byte per edge
//! and step, go to a global region per tile in flight (256 x 2^(16-K) bytes: 8 MiB at K = 1,
//! 64 KiB at K = 8), and thread 0 of a tile traces them back.
//!
//! [`GpuEncoder`] is the quantizer's [`TileEncoder`] on a GPU.

use std::sync::{Arc, Mutex};

use anyhow::{ensure, Result};
use cudarc::driver::sys::CUfunction_attribute_enum as FnAttr;
use cudarc::driver::{CudaFunction, CudaSlice};

use trellm_quant::exl3::codebook::{self, Codebook};
use trellm_quant::exl3::encode::{self, EncodedTile};
use trellm_quant::exl3::quantize::{CpuEncoder, TileEncoder};

use crate::kernels::VITERBI;
use crate::{Arg, Gpu};

/// Every module CI compiles (`kernels::VITERBI.variants`): K = 1..8.
pub const VARIANTS: &[&str] = &[
    "VIT_K=1", "VIT_K=2", "VIT_K=3", "VIT_K=4", "VIT_K=5", "VIT_K=6", "VIT_K=7", "VIT_K=8",
];

/// Threads per block (the kernel's `THREADS`).
const THREADS: u32 = 1024;

/// Tiles one launch takes at most (bounds the targets and states buffers).
const MAX_TILES_PER_LAUNCH: usize = 1 << 16;

/// Tiles a block runs at once for K (the kernel's `TPB`).
fn tiles_per_block(k: u32) -> usize {
    if k >= 6 {
        1 << (k - 6)
    } else {
        1
    }
}

/// Dynamic shared memory of the kernel for K (the kernel's layout).
fn shared_bytes(k: u32) -> usize {
    let edges = 1usize << (16 - k);
    let tpb = tiles_per_block(k);
    let costs = if k >= 3 { tpb * 2 * edges * 4 } else { 0 };
    65536 * 2 + costs + tpb * 256 * 4 + 64 * 4 + tpb * 4
}

/// The encoder's device state: kernels, codebook tables, scratch (grown on demand).
pub struct ViterbiGpu {
    gpu: Arc<Gpu>,
    kernels: [Option<CudaFunction>; 8],
    tables: [Option<CudaSlice<u16>>; 3],
    bp: Option<CudaSlice<u8>>,
    costs: Option<CudaSlice<f32>>,
    targets: Option<CudaSlice<f32>>,
    states: Option<CudaSlice<u16>>,
    open: Option<CudaSlice<f32>>,
}

fn cb_index(cb: Codebook) -> usize {
    match cb {
        Codebook::Inst3 => 0,
        Codebook::Mcg => 1,
        Codebook::Mul1 => 2,
    }
}

/// `buf` holding at least `n` elements (reallocated when smaller).
fn grow<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    gpu: &Gpu,
    buf: &mut Option<CudaSlice<T>>,
    n: usize,
) -> Result<u64> {
    if buf.as_ref().is_none_or(|b| b.len() < n) {
        *buf = None;
        *buf = Some(gpu.alloc::<T>(n)?);
    }
    Ok(gpu.ptr(buf.as_ref().unwrap()))
}

impl ViterbiGpu {
    pub fn new(gpu: Arc<Gpu>) -> ViterbiGpu {
        ViterbiGpu {
            gpu,
            kernels: Default::default(),
            tables: Default::default(),
            bp: None,
            costs: None,
            targets: None,
            states: None,
            open: None,
        }
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    fn kernel(&mut self, k: u32) -> Result<CudaFunction> {
        let slot = &mut self.kernels[k as usize - 1];
        if slot.is_none() {
            let defines = [format!("VIT_K={k}")];
            let f = self.gpu.function(&VITERBI, &defines, "viterbi_tiles")?;
            f.set_attribute(
                FnAttr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared_bytes(k) as i32,
            )?;
            *slot = Some(f);
        }
        Ok(slot.clone().unwrap())
    }

    fn table(&mut self, cb: Codebook) -> Result<u64> {
        let slot = &mut self.tables[cb_index(cb)];
        if slot.is_none() {
            let t: Vec<u16> = (0..=u16::MAX)
                .map(|s| codebook::decode(cb, s).to_bits())
                .collect();
            *slot = Some(self.gpu.upload(&t)?);
        }
        Ok(self.gpu.ptr(slot.as_ref().unwrap()))
    }

    /// [`encode::viterbi_with`] for every target tile (position order): the states and the cost,
    /// the decoded tile's squared error summed in position order on the host.
    pub fn viterbi(
        &mut self,
        targets: &[[f32; 256]],
        k: u32,
        cb: Codebook,
    ) -> Result<Vec<([u16; 256], f32)>> {
        ensure!((1..=8).contains(&k), "K must be 1..=8, got {k}");
        let mut out = Vec::with_capacity(targets.len());
        for chunk in targets.chunks(MAX_TILES_PER_LAUNCH) {
            self.launch(chunk, k, cb, false)?;
            let n = chunk.len();
            let states = self
                .gpu
                .stream
                .clone_dtoh(&self.states.as_ref().unwrap().slice(..n * 256))?;
            for (i, t) in chunk.iter().enumerate() {
                let mut st = [0u16; 256];
                st.copy_from_slice(&states[i * 256..(i + 1) * 256]);
                out.push((st, encode::stream_cost(&st, t, cb)));
            }
        }
        Ok(out)
    }

    /// [`encode::open_cost_with`] for every target tile (position order).
    pub fn open_costs(&mut self, targets: &[[f32; 256]], k: u32, cb: Codebook) -> Result<Vec<f32>> {
        ensure!((1..=8).contains(&k), "K must be 1..=8, got {k}");
        let mut out = Vec::with_capacity(targets.len());
        for chunk in targets.chunks(MAX_TILES_PER_LAUNCH) {
            self.launch(chunk, k, cb, true)?;
            let open = self.open.as_ref().unwrap().slice(..chunk.len());
            out.extend(self.gpu.stream.clone_dtoh(&open)?);
        }
        Ok(out)
    }

    /// Queues one launch over `targets` (at most [`MAX_TILES_PER_LAUNCH`]); results in
    /// `self.states`, or with `open` the open streams' costs in `self.open`.
    fn launch(&mut self, targets: &[[f32; 256]], k: u32, cb: Codebook, open: bool) -> Result<()> {
        let n = targets.len();
        if n == 0 {
            return Ok(());
        }
        let f = self.kernel(k)?;
        let table = self.table(cb)?;
        let gpu = self.gpu.clone();
        let tpb = tiles_per_block(k);
        let grid = n.div_ceil(tpb).min(gpu.sm_count).max(1);
        let edges = 1usize << (16 - k);
        let slots = grid * tpb;
        let bp = grow(&gpu, &mut self.bp, slots * 256 * edges)?;
        let costs = if k < 3 {
            grow(&gpu, &mut self.costs, slots * 2 * edges)?
        } else {
            0
        };
        let flat: Vec<f32> = targets.iter().flatten().copied().collect();
        if self.targets.as_ref().is_none_or(|b| b.len() < flat.len()) {
            self.targets = Some(gpu.upload(&flat)?);
        } else {
            gpu.stream.memcpy_htod(
                &flat,
                &mut self.targets.as_mut().unwrap().slice_mut(..flat.len()),
            )?;
        }
        let tg = gpu.ptr(self.targets.as_ref().unwrap());
        let states = grow(&gpu, &mut self.states, n * 256)?;
        let (open_out, p) = if open {
            let all = encode::Pass1 {
                first: 0,
                steps: 256,
                traced: 256,
            };
            (grow(&gpu, &mut self.open, n)?, all)
        } else {
            (0, encode::PASS1)
        };
        gpu.launch_shared(
            &f,
            (grid as u32, 1, 1),
            THREADS,
            shared_bytes(k) as u32,
            &[
                Arg::Ptr(table),
                Arg::Ptr(tg),
                Arg::I32(n as i32),
                Arg::Ptr(bp),
                Arg::Ptr(costs),
                Arg::Ptr(states),
                Arg::Ptr(open_out),
                Arg::I32(p.steps as i32),
                Arg::I32(p.first as i32),
                Arg::I32(p.traced as i32),
            ],
        )
    }

    /// Encodes tiles given row-major (`[in 16][out 16]`), as [`encode::encode_tiles`] does.
    pub fn encode_tiles(
        &mut self,
        tiles: &[[f32; 256]],
        k: u32,
        cb: Codebook,
    ) -> Result<Vec<EncodedTile>> {
        let targets: Vec<[f32; 256]> = tiles.iter().map(encode::position_order).collect();
        Ok(self
            .viterbi(&targets, k, cb)?
            .iter()
            .map(|(states, cost)| EncodedTile::from_states(states, *cost, k, cb))
            .collect())
    }
}

/// Encodes tiles given row-major on `gpu` (a one-off [`ViterbiGpu`]; keep one for many calls).
pub fn encode_tiles(
    gpu: Arc<Gpu>,
    tiles: &[[f32; 256]],
    k: u32,
    cb: Codebook,
) -> Result<Vec<EncodedTile>> {
    ViterbiGpu::new(gpu).encode_tiles(tiles, k, cb)
}

/// The quantizer's tile encoder on a GPU. Calls from several threads take turns. A GPU failure
/// is kept ([`GpuEncoder::error`]) and that call and every later one are encoded on the CPU
/// instead (the same bytes), so a caller checks `error` after each layer.
pub struct GpuEncoder {
    inner: Mutex<ViterbiGpu>,
    error: Mutex<Option<String>>,
}

impl GpuEncoder {
    pub fn new(gpu: Arc<Gpu>) -> GpuEncoder {
        GpuEncoder {
            inner: Mutex::new(ViterbiGpu::new(gpu)),
            error: Mutex::new(None),
        }
    }

    /// The first GPU failure, if any.
    pub fn error(&self) -> Option<String> {
        self.error.lock().unwrap().clone()
    }
}

impl GpuEncoder {
    /// `f` on the GPU unless it has failed before; a failure is kept and gives `None`.
    fn try_gpu<T>(&self, f: impl FnOnce(&mut ViterbiGpu) -> Result<T>) -> Option<T> {
        if self.error.lock().unwrap().is_some() {
            return None;
        }
        f(&mut self.inner.lock().unwrap())
            .map_err(|e| *self.error.lock().unwrap() = Some(format!("{e:#}")))
            .ok()
    }
}

impl TileEncoder for GpuEncoder {
    fn encode_tiles(&self, tiles: &[[f32; 256]], k: u32, cb: Codebook) -> Vec<EncodedTile> {
        self.try_gpu(|g| g.encode_tiles(tiles, k, cb))
            .unwrap_or_else(|| CpuEncoder.encode_tiles(tiles, k, cb))
    }

    fn open_costs(&self, tiles: &[[f32; 256]], k: u32, cb: Codebook) -> Vec<f32> {
        let targets: Vec<[f32; 256]> = tiles.iter().map(encode::position_order).collect();
        self.try_gpu(|g| g.open_costs(&targets, k, cb))
            .unwrap_or_else(|| CpuEncoder.open_costs(tiles, k, cb))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_k_has_a_variant() {
        for k in 1..=8 {
            let v = format!("VIT_K={k}");
            assert!(VARIANTS.contains(&v.as_str()), "{v}");
        }
    }

    #[test]
    fn shared_memory_fits_hopper() {
        for k in 1..=8 {
            assert!(
                shared_bytes(k) <= 227 * 1024,
                "K = {k}: {}",
                shared_bytes(k)
            );
        }
    }
}
