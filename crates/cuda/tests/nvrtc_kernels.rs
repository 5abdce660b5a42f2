//! Compile-checks every kernel with NVRTC for sm_90a (the H200) and fails on register spills or
//! stack frames in hot kernels. Needs only NVRTC, no GPU: set `TRELLM_NVRTC` to a libnvrtc.so
//! (`eval "$(scripts/ci_nvrtc_setup.sh)"` installs the pinned wheels); skipped when it is unset.

use trellm_cuda::kernels::{self, KernelSource};
use trellm_cuda::nvrtc;

const ARCH: &str = "sm_90a";

fn nvrtc_ready() -> bool {
    if std::env::var_os("TRELLM_NVRTC").is_none() {
        eprintln!("skipped: TRELLM_NVRTC is not set (see scripts/ci_nvrtc_setup.sh)");
        return false;
    }
    assert!(
        nvrtc::load_nvrtc(),
        "TRELLM_NVRTC is set but libnvrtc could not be loaded from it"
    );
    true
}

fn variants(k: &KernelSource) -> Vec<Vec<String>> {
    if k.variants.is_empty() {
        vec![vec![]]
    } else {
        k.variants
            .iter()
            .map(|v| v.split(',').map(str::to_string).collect())
            .collect()
    }
}

#[test]
fn every_kernel_compiles_without_spills() {
    if !nvrtc_ready() {
        return;
    }
    let (major, minor) = nvrtc::version().unwrap();
    eprintln!("NVRTC {major}.{minor}, target {ARCH}");
    let mut failures = Vec::new();
    for k in kernels::ALL {
        for defines in variants(k) {
            let c = nvrtc::compile(k, &defines, ARCH, true)
                .unwrap_or_else(|e| panic!("{} {defines:?}: {e:#}", k.name));
            assert!(!c.cubin.is_empty(), "{}: empty CUBIN", k.name);
            let report = nvrtc::parse_ptxas_report(&c.log);
            for f in k.functions {
                let r = report
                    .iter()
                    .find(|r| r.name == *f)
                    .unwrap_or_else(|| panic!("{}: no ptxas report for {f}:\n{}", k.name, c.log));
                eprintln!(
                    "{:<12} {:<24} {:<14} {:>3} registers, {} B stack, {} B spill stores, {} B spill loads",
                    k.name,
                    f,
                    defines.join(","),
                    r.registers,
                    r.stack_frame,
                    r.spill_stores,
                    r.spill_loads
                );
                if k.hot && (r.spill_stores > 0 || r.spill_loads > 0 || r.stack_frame > 0) {
                    failures.push(format!("{f} {defines:?}: {r:?}"));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "hot kernels spill:\n{}",
        failures.join("\n")
    );
}

#[test]
fn a_broken_kernel_reports_its_error() {
    if !nvrtc_ready() {
        return;
    }
    let bad = KernelSource {
        name: "broken",
        source: "extern \"C\" __global__ void k(float* p) { p[0] = undefined_name; }",
        functions: &["k"],
        hot: false,
        variants: &[],
        dependent_launch: false,
    };
    let err = nvrtc::compile(&bad, &[], ARCH, false)
        .err()
        .expect("must fail");
    assert!(
        format!("{err:#}").contains("undefined_name"),
        "the log names the error: {err:#}"
    );
}

/// A kernel launched with programmatic dependent launch may start while the one before still
/// runs: sources launched that way wait (`pdl_wait`), and sources that never wait are not.
/// (Kernels defined through a macro or sharing a helper wait once in the text, so this counts
/// sources, not kernels: review checks each kernel.)
#[test]
fn dependent_launch_matches_the_waits() {
    for k in kernels::ALL {
        assert_eq!(
            k.dependent_launch,
            k.source.contains("pdl_wait();"),
            "{}: dependent_launch is {} but its source {} pdl_wait",
            k.name,
            k.dependent_launch,
            if k.dependent_launch {
                "never calls"
            } else {
                "calls"
            }
        );
    }
}
