//! What the GPU test binaries share.

use std::io::Write;

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
