//! NCCL, for the sums over tensor-parallel ranks (the all-reduces after a layer's row-parallel
//! projections). Loaded at run time through cudarc like the driver and cuBLAS: a trellm without
//! NCCL still runs, and only asks for it when more than one rank is wanted.

use anyhow::{bail, ensure, Result};
use cudarc::nccl::{result as nres, sys as nsys};

use crate::Gpu;

/// Whether NCCL's library (`libnccl.so` on the loader's path) can be loaded.
pub fn available() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { nsys::is_culib_present() }
}

/// One rank's communicator: rank `rank` of `world`, on one GPU.
pub struct Comm {
    comm: nsys::ncclComm_t,
    pub rank: usize,
    pub world: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time (`&mut`-free
// calls here only enqueue work on a stream the caller owns).
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Comm {
    /// Communicators for `gpus`, rank i on `gpus[i]`, all driven by this process (one
    /// `ncclCommInitAll`).
    pub fn for_gpus(gpus: &[&Gpu]) -> Result<Vec<Comm>> {
        if !available() {
            bail!("tensor parallelism needs NCCL: libnccl.so was not found on the loader's path");
        }
        ensure!(!gpus.is_empty(), "NCCL over no GPUs");
        let ordinals: Vec<i32> = gpus.iter().map(|g| g.ctx.ordinal() as i32).collect();
        let mut comms = vec![std::ptr::null_mut(); gpus.len()];
        // SAFETY: `comms` has room for one communicator per listed device.
        unsafe { nres::comm_init_all(comms.as_mut_ptr(), gpus.len() as i32, ordinals.as_ptr()) }
            .map_err(|e| anyhow::anyhow!("ncclCommInitAll over GPUs {ordinals:?}: {e:?}"))?;
        let world = comms.len();
        Ok(comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| Comm { comm, rank, world })
            .collect())
    }

    /// `n` f32 at device address `ptr` become their sum over the ranks, in place, on `gpu`'s
    /// stream (so it can be captured in the step's CUDA graph). With several ranks driven from
    /// one thread, every rank's call goes between [`group_start`] and [`group_end`].
    pub fn all_reduce_sum_f32(&self, gpu: &Gpu, ptr: u64, n: usize) -> Result<()> {
        gpu.timed("nccl_all_reduce", || {
            // SAFETY: `ptr` holds `n` f32 on the communicator's device; the stream is that
            // device's.
            unsafe {
                nres::all_reduce(
                    ptr as *const _,
                    ptr as *mut _,
                    n,
                    nsys::ncclDataType_t::ncclFloat32,
                    nsys::ncclRedOp_t::ncclSum,
                    self.comm,
                    gpu.stream.cu_stream() as _,
                )
            }
            .map(|_| ())
            .map_err(|e| anyhow::anyhow!("ncclAllReduce of {n} values: {e:?}"))
        })
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: the communicator is live and dropped once.
        let _ = unsafe { nres::comm_destroy(self.comm) };
    }
}

/// Opens a group of collective calls (one per rank) that NCCL launches together.
pub fn group_start() -> Result<()> {
    nres::group_start()
        .map(|_| ())
        .map_err(|e| anyhow::anyhow!("ncclGroupStart: {e:?}"))
}

pub fn group_end() -> Result<()> {
    nres::group_end()
        .map(|_| ())
        .map_err(|e| anyhow::anyhow!("ncclGroupEnd: {e:?}"))
}
