//! Compute backends. The CPU backend is the exact reference path every other path is tested
//! against.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
