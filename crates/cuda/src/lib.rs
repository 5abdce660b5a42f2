//! trellm's CUDA backend.
//!
//! Nothing CUDA is needed to build this crate: the driver, NVRTC and cuBLAS are loaded at run
//! time (cudarc's dynamic loading), so the same binary runs, and its tests pass, on machines
//! without a GPU ([`available`] says whether one can be used).
//!
//! - [`nvrtc`]: kernels are `.cu` sources embedded in the binary (`kernels/`), compiled on first
//!   use by the device's own NVRTC to CUBIN for the device's architecture (`sm_90a` on Hopper) and
//!   cached on disk, keyed by a hash of source, options, architecture and NVRTC version.
//! - [`Gpu`]: one device, one stream, the compiled modules and a cuBLAS handle.
//! - [`dense`]: the llama/gemma-style dense decoder over bf16 weights: cuBLAS GEMMs for prefill,
//!   our own bandwidth-bound GEMV for decode, the whole decode step captured as one CUDA graph.
//! - [`exl3`]: EXL3 trellis layers uploaded compressed, decoded in registers by the GEMV.
//! - [`bench`]: synthetic seeded weights generated on the device and the decode/prefill benchmark.
//! - [`viterbi`]: the EXL3 tile encoder (the tail-biting Viterbi), bit-identical to the CPU's.
//! - [`nccl`]: all-reduces between the GPUs of one host (tensor parallelism), NCCL loaded at run
//!   time as well.

pub mod bench;
pub mod dense;
pub mod exl3;
pub mod kernels;
pub mod nccl;
pub mod nvrtc;
pub mod viterbi;

use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Context, Result};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    result as dres, sys as dsys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice,
    CudaStream,
};
use cudarc::driver::{DevicePtr, DeviceRepr, ValidAsZeroBits};

#[cfg(not(target_endian = "little"))]
compile_error!("kernel arguments are packed for little-endian hosts");

/// Whether a CUDA driver with at least one device can be used here. Never panics: without
/// `libcuda` it returns false.
pub fn available() -> bool {
    // SAFETY: only tries to dlopen the driver library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return false;
    }
    std::panic::catch_unwind(|| {
        dres::init().is_ok() && CudaContext::device_count().map(|n| n > 0).unwrap_or(false)
    })
    .unwrap_or(false)
}

/// GPUs the driver sees (0 where [`available`] is false).
pub fn device_count() -> Result<usize> {
    if !available() {
        return Ok(0);
    }
    Ok(CudaContext::device_count()? as usize)
}

/// Why [`available`] is false, for skip messages.
pub fn unavailable_reason() -> String {
    // SAFETY: only tries to dlopen the driver library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return "no CUDA driver (libcuda) found".into();
    }
    match std::panic::catch_unwind(|| dres::init().map(|_| CudaContext::device_count())) {
        Ok(Ok(Ok(n))) if n > 0 => "a CUDA device is available".into(),
        Ok(Ok(Ok(_))) => "the CUDA driver reports no devices".into(),
        Ok(Ok(Err(e))) | Ok(Err(e)) => format!("the CUDA driver failed: {e}"),
        Err(_) => "the CUDA driver could not be loaded".into(),
    }
}

/// A kernel argument. Pointers are raw device addresses.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    F32(f32),
    U64(u64),
}

/// A device buffer's address (0 for None: kernels treat null pointers as "absent").
pub fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// Page-locked host buffers the device copies results into at full bus speed, lent out with
/// what they hold and taken back when that is dropped (a pageable destination costs a staged
/// copy: at 32 rows of the 8B shape's logits, 16 MB a step, about 1 ms of a 7 ms step).
#[derive(Clone)]
pub struct HostBuffers {
    ctx: Arc<CudaContext>,
    free: Arc<Mutex<Vec<PinnedBuf>>>,
}

/// Buffers kept for reuse; more are freed when returned.
const HOST_BUFFERS_KEPT: usize = 4;

struct PinnedBuf {
    ptr: *mut f32,
    cap: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the allocation is owned by this value alone and lives until it is dropped.
unsafe impl Send for PinnedBuf {}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by cuMemHostAlloc in `HostBuffers::take`, freed once.
        unsafe {
            let _ = dres::free_host(self.ptr as *mut c_void);
        }
    }
}

/// `len` values in a buffer lent by [`HostBuffers`].
pub struct HostRows {
    buf: Option<PinnedBuf>,
    len: usize,
    home: Arc<Mutex<Vec<PinnedBuf>>>,
}

impl HostRows {
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        let b = self.buf.as_ref().expect("a lent buffer");
        // SAFETY: `len <= cap` values of an allocation this value owns exclusively.
        unsafe { std::slice::from_raw_parts_mut(b.ptr, self.len) }
    }
}

impl std::ops::Deref for HostRows {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        let b = self.buf.as_ref().expect("a lent buffer");
        // SAFETY: as in `as_mut_slice`.
        unsafe { std::slice::from_raw_parts(b.ptr, self.len) }
    }
}

impl AsRef<[f32]> for HostRows {
    fn as_ref(&self) -> &[f32] {
        self
    }
}

impl Drop for HostRows {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            let mut free = self.home.lock().unwrap();
            free.push(b);
            if free.len() > HOST_BUFFERS_KEPT {
                // The smallest goes: steps of many rows must not allocate every time.
                let i = (0..free.len()).min_by_key(|&i| free[i].cap).unwrap_or(0);
                free.swap_remove(i);
            }
        }
    }
}

impl HostBuffers {
    pub fn new(ctx: Arc<CudaContext>) -> HostBuffers {
        HostBuffers {
            ctx,
            free: Arc::new(Mutex::new(Vec::new())),
        }
    }

    /// A buffer of `len` values (contents unspecified): the smallest returned one that is large
    /// enough, else a new allocation.
    pub fn take(&self, len: usize) -> Result<HostRows> {
        let reused = {
            let mut free = self.free.lock().unwrap();
            (0..free.len())
                .filter(|&i| free[i].cap >= len)
                .min_by_key(|&i| free[i].cap)
                .map(|i| free.swap_remove(i))
        };
        let buf = match reused {
            Some(b) => b,
            None => {
                let cap = len.max(1);
                self.ctx.bind_to_thread()?;
                // SAFETY: a plain page-locked allocation (cached: the host reads it).
                let ptr = unsafe { dres::malloc_host(cap * std::mem::size_of::<f32>(), 0) }
                    .with_context(|| format!("page-locking {} bytes of host memory", cap * 4))?;
                PinnedBuf {
                    ptr: ptr as *mut f32,
                    cap,
                    ctx: self.ctx.clone(),
                }
            }
        };
        Ok(HostRows {
            buf: Some(buf),
            len,
            home: self.free.clone(),
        })
    }
}

/// One device: its context, the stream everything runs on, compiled modules, cuBLAS.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub blas: CudaBlas,
    /// NVRTC's target, e.g. `sm_90a`.
    pub arch: String,
    pub name: String,
    pub sm_count: usize,
    modules: Mutex<HashMap<String, Arc<CudaModule>>>,
    /// Kernel names by function handle, for the profile.
    names: Mutex<HashMap<usize, String>>,
    /// Function handles launched with programmatic dependent launch (sources marked
    /// `dependent_launch`, sm_90+).
    dependent: Mutex<HashSet<usize>>,
    /// While profiling: every launch and cuBLAS call since [`Gpu::start_profile`], between two
    /// events.
    profile: Mutex<Option<Vec<(String, CudaEvent, CudaEvent)>>>,
}

/// Time spent in one kernel (or cuBLAS call) over a profiled stretch of work.
#[derive(Debug, Clone)]
pub struct KernelTime {
    pub name: String,
    pub calls: usize,
    pub ms: f64,
}

impl Gpu {
    /// Opens device `ordinal`. Fails (without panicking) where [`available`] is false.
    pub fn new(ordinal: usize) -> Result<Gpu> {
        if !available() {
            bail!("CUDA is not usable here: {}", unavailable_reason());
        }
        let ctx = CudaContext::new(ordinal).context("creating the CUDA context")?;
        // One stream, buffers addressed by raw pointers: cudarc's cross-stream event tracking
        // would only add work (and breaks graph capture).
        // SAFETY: called before any buffer exists.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| anyhow!("cuBLAS: {e:?}"))?;
        let (major, minor) = ctx.compute_capability()?;
        // Architecture-specific targets (wgmma, setmaxnreg) exist from sm_90 on.
        let arch = if major >= 9 {
            format!("sm_{major}{minor}a")
        } else {
            format!("sm_{major}{minor}")
        };
        let sm_count = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as usize;
        Ok(Gpu {
            name: ctx.name()?,
            ctx,
            stream,
            blas,
            arch,
            sm_count,
            modules: Mutex::new(HashMap::new()),
            names: Mutex::new(HashMap::new()),
            dependent: Mutex::new(HashSet::new()),
            profile: Mutex::new(None),
        })
    }

    /// A kernel function of `source` compiled with `defines` (`NAME=VALUE`), compiled (or read
    /// from the disk cache) and loaded on first use.
    pub fn function(
        &self,
        source: &kernels::KernelSource,
        defines: &[String],
        name: &str,
    ) -> Result<CudaFunction> {
        let key = format!("{}|{}", source.name, defines.join(","));
        let module = {
            let mut mods = self.modules.lock().unwrap();
            match mods.get(&key) {
                Some(m) => m.clone(),
                None => {
                    let c = nvrtc::compile_cached(source, defines, &self.arch)?;
                    let m = self
                        .ctx
                        .load_module(cudarc::nvrtc::Ptx::from_binary(c))
                        .with_context(|| format!("loading the CUBIN of {}", source.name))?;
                    mods.insert(key, m.clone());
                    m
                }
            }
        };
        let f = module
            .load_function(name)
            .with_context(|| format!("kernel {name} in {}", source.name))?;
        self.names
            .lock()
            .unwrap()
            .insert(f.cu_function() as usize, name.to_string());
        if self.sm90_or_newer() && source.dependent_launch {
            self.dependent
                .lock()
                .unwrap()
                .insert(f.cu_function() as usize);
        }
        Ok(f)
    }

    /// Whether launches are being timed ([`Gpu::start_profile`]).
    pub fn profiling(&self) -> bool {
        self.profile.lock().unwrap().is_some()
    }

    /// Starts recording the time of every launch and cuBLAS call (outside graph capture only).
    pub fn start_profile(&self) {
        *self.profile.lock().unwrap() = Some(Vec::new());
    }

    /// Stops recording and returns the time per kernel name, in order of first launch. The times
    /// are exact for work that was queued before the device reached it (see [`Gpu::spin`]).
    pub fn finish_profile(&self) -> Result<Vec<KernelTime>> {
        let spans = self.profile.lock().unwrap().take().unwrap_or_default();
        self.sync()?;
        let mut out: Vec<KernelTime> = Vec::new();
        for (name, a, b) in spans {
            let ms = a.elapsed_ms(&b)? as f64;
            match out.iter_mut().find(|k| k.name == name) {
                Some(k) => {
                    k.calls += 1;
                    k.ms += ms;
                }
                None => out.push(KernelTime { name, calls: 1, ms }),
            }
        }
        Ok(out)
    }

    /// Runs `f` (which enqueues work) between two events when profiling.
    pub fn timed<R>(&self, name: &str, f: impl FnOnce() -> Result<R>) -> Result<R> {
        if self.profile.lock().unwrap().is_none() {
            return f();
        }
        let flags = Some(dsys::CUevent_flags::CU_EVENT_DEFAULT);
        let a = self.ctx.new_event(flags)?;
        a.record(&self.stream)?;
        let r = f()?;
        let b = self.ctx.new_event(flags)?;
        b.record(&self.stream)?;
        if let Some(spans) = self.profile.lock().unwrap().as_mut() {
            spans.push((name.to_string(), a, b));
        }
        Ok(r)
    }

    /// Keeps the device busy for `ms` milliseconds, so that work enqueued next is all queued
    /// before it starts (a profile then times kernels, not the host's launch rate).
    pub fn spin(&self, ms: f64) -> Result<()> {
        let f = self.function(&kernels::ELEMENTWISE, &[], "spin_ns")?;
        self.launch(&f, (1, 1, 1), 32, &[Arg::U64((ms * 1e6) as u64)])
    }

    /// Launches `f` on the stream.
    pub fn launch(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_cluster(f, grid, block, None, args)
    }

    /// Launches `f` with `shared` bytes of dynamic shared memory (more than 48 KiB needs the
    /// function's `MAX_DYNAMIC_SHARED_SIZE_BYTES` attribute set first).
    pub fn launch_shared(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_profiled(f, grid, block, None, shared, args)
    }

    /// Launches `f` with its blocks grouped in thread-block clusters of `cluster` (sm_90+).
    pub fn launch_cluster(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        cluster: Option<(u32, u32, u32)>,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_profiled(f, grid, block, cluster, 0, args)
    }

    /// [`Self::launch_now`], timed under the kernel's name while a profile is on.
    fn launch_profiled(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        cluster: Option<(u32, u32, u32)>,
        shared: u32,
        args: &[Arg],
    ) -> Result<()> {
        if self.profile.lock().unwrap().is_some() {
            let name = self
                .names
                .lock()
                .unwrap()
                .get(&(f.cu_function() as usize))
                .cloned();
            return self.timed(name.as_deref().unwrap_or("?"), || {
                self.launch_now(f, grid, block, cluster, shared, args)
            });
        }
        self.launch_now(f, grid, block, cluster, shared, args)
    }

    fn launch_now(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        cluster: Option<(u32, u32, u32)>,
        shared: u32,
        args: &[Arg],
    ) -> Result<()> {
        let mut store: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(v) | Arg::U64(v) => v,
                Arg::I32(v) => v as u32 as u64,
                Arg::F32(v) => v.to_bits() as u64,
            })
            .collect();
        // The driver reads each parameter's size from its address; on a little-endian host the
        // low 4 bytes of the u64 are the i32/f32 value.
        let mut params: Vec<*mut c_void> = store
            .iter_mut()
            .map(|v| v as *mut u64 as *mut c_void)
            .collect();
        let mut attrs = Vec::new();
        if self
            .dependent
            .lock()
            .unwrap()
            .contains(&(f.cu_function() as usize))
        {
            // SAFETY: an all-zero union is a valid value; the field is then set.
            let mut value: dsys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
            value.programmaticStreamSerializationAllowed = 1;
            attrs.push(dsys::CUlaunchAttribute {
                id: dsys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                value,
            });
        }
        if let Some((x, y, z)) = cluster {
            // SAFETY: as above.
            let mut value: dsys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
            value.clusterDim.x = x;
            value.clusterDim.y = y;
            value.clusterDim.z = z;
            attrs.push(dsys::CUlaunchAttribute {
                id: dsys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
                pad: [0; 4],
                value,
            });
        }
        if !attrs.is_empty() {
            let cfg = dsys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: shared,
                hStream: self.stream.cu_stream(),
                attrs: attrs.as_mut_ptr(),
                numAttrs: attrs.len() as u32,
            };
            // SAFETY: as below; `cfg` and `attrs` outlive the call.
            return unsafe {
                dsys::cuLaunchKernelEx(
                    &cfg,
                    f.cu_function(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
            .result()
            .context("kernel launch (extended attributes)");
        }
        // SAFETY: the argument list matches the kernel's signature (each launcher is written
        // against its .cu source) and every pointer is a live device allocation.
        unsafe {
            dres::launch_kernel(
                f.cu_function(),
                grid,
                (block, 1, 1),
                shared,
                self.stream.cu_stream(),
                &mut params,
            )
        }
        .context("kernel launch")
    }

    /// Whether the device has sm_90's launch features (thread-block clusters, programmatic
    /// dependent launch).
    pub fn sm90_or_newer(&self) -> bool {
        self.arch.starts_with("sm_9") || self.arch.starts_with("sm_1")
    }

    pub fn alloc<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros::<T>(n.max(1))
            .with_context(|| format!("allocating {} bytes", n * std::mem::size_of::<T>()))
    }

    pub fn upload<T: DeviceRepr>(&self, v: &[T]) -> Result<CudaSlice<T>> {
        Ok(self.stream.clone_htod(v)?)
    }

    pub fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        ptr(s, &self.stream)
    }

    pub fn sync(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }
}
