//! Kernel compilation: NVRTC to CUBIN for one architecture, cached on disk.
//!
//! The cache key is a hash of the full source, the options, the architecture and NVRTC's version,
//! so a changed kernel, flag or toolkit never reuses a stale binary. CUBIN (not PTX) is loaded:
//! PTX from a newer NVRTC than the driver is rejected, CUBIN is not.

use std::ffi::{c_char, CString};
use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use cudarc::nvrtc::{result as nres, sys as nsys};
use sha2::{Digest, Sha256};

use crate::kernels::KernelSource;

/// The output of one compilation.
pub struct Compiled {
    pub cubin: Vec<u8>,
    /// NVRTC's log (with `verbose`, ptxas's per-kernel resource report).
    pub log: String,
}

/// Loads NVRTC from `TRELLM_NVRTC` (a path to `libnvrtc.so*`) when set, with its builtins
/// library from the same folder, so that cudarc's lookup by name finds the loaded copies.
/// Returns whether NVRTC can be used.
pub fn load_nvrtc() -> bool {
    if let Ok(path) = std::env::var("TRELLM_NVRTC") {
        let path = PathBuf::from(path);
        if let Some(dir) = path.parent() {
            // NVRTC dlopens its builtins by soname; loading them first by path satisfies that.
            if let Ok(rd) = std::fs::read_dir(dir) {
                for e in rd.flatten() {
                    let n = e.file_name().to_string_lossy().to_string();
                    if n.starts_with("libnvrtc-builtins.so") {
                        // SAFETY: loading NVIDIA's library runs no foreign initialisers of note;
                        // the handle is leaked so the library stays loaded.
                        if let Ok(l) = unsafe { libloading::Library::new(e.path()) } {
                            std::mem::forget(l);
                        }
                    }
                }
            }
        }
        // SAFETY: as above.
        match unsafe { libloading::Library::new(&path) } {
            Ok(l) => std::mem::forget(l),
            Err(_) => return false,
        }
    }
    // SAFETY: only tries to dlopen the library.
    unsafe { nsys::is_culib_present() }
}

/// NVRTC's (major, minor) version.
pub fn version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-pointers to live ints.
    unsafe { nsys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| anyhow!("nvrtcVersion: {e:?}"))?;
    Ok((major, minor))
}

/// The options every kernel is compiled with (plus `-D` defines and, optionally, `-v`).
pub fn options(arch: &str, defines: &[String], verbose: bool) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--dopt=on".to_string(),
    ];
    o.extend(defines.iter().map(|d| format!("-D{d}")));
    if verbose {
        o.push("--ptxas-options=-v".to_string());
    }
    o
}

/// Compiles `source` (prelude included) to CUBIN for `arch` (e.g. `sm_90a`). Needs NVRTC only, no
/// GPU.
pub fn compile(
    source: &KernelSource,
    defines: &[String],
    arch: &str,
    verbose: bool,
) -> Result<Compiled> {
    if !load_nvrtc() {
        bail!("NVRTC (libnvrtc) was not found");
    }
    let src = CString::new(source.full_source()).expect("kernel sources hold no NUL");
    let name = CString::new(format!("{}.cu", source.name)).unwrap();
    let opts = options(arch, defines, verbose);
    let prog = nres::create_program(&src, Some(&name)).map_err(|e| anyhow!("NVRTC: {e:?}"))?;
    // SAFETY: `prog` is a live program; it is destroyed before returning.
    let out = unsafe {
        let compiled = nres::compile_program(prog, &opts);
        let log = nres::get_program_log(prog)
            .map(|l| {
                let bytes: Vec<u8> = l.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default();
        let result = match compiled {
            Err(e) => Err(anyhow!(
                "NVRTC failed to compile {} ({e:?}) with {opts:?}:\n{log}",
                source.name
            )),
            Ok(()) => {
                let mut size = 0usize;
                nsys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| anyhow!("nvrtcGetCUBINSize: {e:?}"))?;
                let mut cubin = vec![0u8; size];
                nsys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char)
                    .result()
                    .map_err(|e| anyhow!("nvrtcGetCUBIN: {e:?}"))?;
                Ok(Compiled { cubin, log })
            }
        };
        let _ = nres::destroy_program(prog);
        result
    };
    out
}

/// Where compiled kernels are cached: `$TRELLM_CUDA_CACHE`, else `<cache dir>/trellm/cuda`.
pub fn cache_dir() -> PathBuf {
    match std::env::var_os("TRELLM_CUDA_CACHE") {
        Some(d) => PathBuf::from(d),
        None => dirs::cache_dir()
            .unwrap_or_else(std::env::temp_dir)
            .join("trellm")
            .join("cuda"),
    }
}

/// The CUBIN of `source` for `arch`, from the disk cache or freshly compiled (and then cached;
/// a cache that cannot be written is skipped).
pub fn compile_cached(source: &KernelSource, defines: &[String], arch: &str) -> Result<Vec<u8>> {
    if !load_nvrtc() {
        bail!("NVRTC (libnvrtc) was not found; it ships with the CUDA toolkit (libnvrtc.so)");
    }
    let (major, minor) = version()?;
    let mut h = Sha256::new();
    h.update(source.full_source().as_bytes());
    h.update([0]);
    h.update(options(arch, defines, false).join(" ").as_bytes());
    h.update([0]);
    h.update(format!("{arch} nvrtc {major}.{minor}").as_bytes());
    let key: String = h.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let path = cache_dir().join(format!("{}-{arch}-{key}.cubin", source.name));
    if let Ok(b) = std::fs::read(&path) {
        if !b.is_empty() {
            return Ok(b);
        }
    }
    let c = compile(source, defines, arch, false)?;
    let dir = cache_dir();
    if std::fs::create_dir_all(&dir).is_ok() {
        let tmp = dir.join(format!(".{}.{}.tmp", key, std::process::id()));
        if std::fs::write(&tmp, &c.cubin).is_ok() {
            std::fs::rename(&tmp, &path)
                .with_context(|| format!("caching {}", path.display()))
                .ok();
        }
    }
    Ok(c.cubin)
}

/// One kernel's resources from ptxas's `-v` report.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KernelResources {
    pub name: String,
    pub registers: u32,
    pub stack_frame: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
}

/// Parses ptxas's `-v` report: `Compiling entry function 'NAME'`, then lines with
/// `N bytes stack frame, N bytes spill stores, N bytes spill loads` and `Used N registers`.
pub fn parse_ptxas_report(log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    let num_before = |line: &str, what: &str| -> Option<u32> {
        let i = line.find(what)?;
        line[..i].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        if let Some(i) = line.find("Compiling entry function '") {
            let rest = &line[i + "Compiling entry function '".len()..];
            let name = rest.split('\'').next().unwrap_or("").to_string();
            out.push(KernelResources {
                name,
                ..Default::default()
            });
            continue;
        }
        let Some(k) = out.last_mut() else { continue };
        if let Some(v) = num_before(line, "bytes stack frame") {
            k.stack_frame = v;
        }
        if let Some(v) = num_before(line, "bytes spill stores") {
            k.spill_stores = v;
        }
        if let Some(v) = num_before(line, "bytes spill loads") {
            k.spill_loads = v;
        }
        if let Some(i) = line.find("Used ") {
            if let Some(v) = line[i + 5..]
                .split_whitespace()
                .next()
                .and_then(|s| s.parse().ok())
            {
                if line.contains("registers") {
                    k.registers = v;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ptxas_report() {
        let log = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'gemv_f32' for 'sm_90a'\n\
ptxas info    : Function properties for gemv_f32\n\
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 40 registers, used 0 barriers, 392 bytes cmem[0]\n\
ptxas info    : Compiling entry function 'embed_rows' for 'sm_90a'\n\
ptxas info    : Function properties for embed_rows\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 12 registers, 376 bytes cmem[0]\n";
        let r = parse_ptxas_report(log);
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            KernelResources {
                name: "gemv_f32".into(),
                registers: 40,
                stack_frame: 8,
                spill_stores: 4,
                spill_loads: 12
            }
        );
        assert_eq!(r[1].registers, 12);
        assert_eq!(r[1].spill_stores, 0);
    }

    #[test]
    fn cache_key_options_are_stable() {
        let o = options("sm_90a", &["HEAD_DIM=128".into()], false);
        assert_eq!(o[0], "--gpu-architecture=sm_90a");
        assert!(o.contains(&"-DHEAD_DIM=128".to_string()));
    }
}
