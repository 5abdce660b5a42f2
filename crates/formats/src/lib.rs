//! Model file formats: parsing only, no arithmetic.
//!
//! Every reader takes untrusted bytes and returns an error (never panics) on truncated or corrupt
//! input. Tensor data stays in the memory map; readers hand out borrowed slices.

pub mod gguf;
pub mod hf;
pub mod safetensors;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum FormatError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Corrupt(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Missing(String),
}

pub type Result<T> = std::result::Result<T, FormatError>;

pub(crate) fn corrupt(msg: impl Into<String>) -> FormatError {
    FormatError::Corrupt(msg.into())
}

pub(crate) fn open_mmap(path: &std::path::Path) -> Result<memmap2::Mmap> {
    let io = |source| FormatError::Io {
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    // SAFETY: the map is read-only; a file truncated underneath us by another process is outside
    // what any mmap-based loader can guard against.
    unsafe { memmap2::Mmap::map(&file) }.map_err(io)
}
