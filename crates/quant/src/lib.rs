//! Weight codecs: the GGUF (ggml) block formats, decoded exactly to f32.
//!
//! Pure functions over byte slices; no I/O and no threading. Every fast kernel elsewhere is tested
//! against these scalar decoders.

pub mod exl3;
pub mod ggml;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use ggml::dot::{dot_block, dot_block_to, dot_rows};
pub use ggml::{dequantize, dequantize_row, GgmlType, QuantError};
