//! What the GPU test binaries share.

use std::io::Write;
use std::sync::Arc;

use trellm_cuda::Gpu;

/// The first GPU; fails the test, saying why, where none can be used (GPU tests are
/// `#[ignore]`d and run with `--include-ignored` on the GPU machine).
pub fn gpu() -> Arc<Gpu> {
    assert!(
        trellm_cuda::available(),
        "{}",
        trellm_cuda::unavailable_reason()
    );
    Arc::new(Gpu::new(0).expect("a usable device"))
}

/// A sink for one timing test's result lines: each is printed, and appended to the file
/// `TRELLM_RESULTS` names, if it is set.
pub fn results() -> impl FnMut(String) {
    let mut out = std::env::var_os("TRELLM_RESULTS").map(|p| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .unwrap()
    });
    move |line: String| {
        println!("{line}");
        if let Some(f) = out.as_mut() {
            writeln!(f, "{line}").unwrap();
        }
    }
}
