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

/// Characters of file-provided text that an error message quotes at most.
pub const QUOTE_MAX_CHARS: usize = 120;

/// File-provided text made safe to print in an error: control characters (terminal escapes,
/// newlines) and the replacement character of invalid UTF-8 are escaped, and the text is cut to
/// [`QUOTE_MAX_CHARS`] characters with `...` and the full length appended.
pub fn quote(s: &str) -> String {
    quote_max(s, QUOTE_MAX_CHARS)
}

/// [`quote`] with an explicit character budget.
pub fn quote_max(s: &str, max_chars: usize) -> String {
    let mut out = String::new();
    for (n, c) in s.chars().enumerate() {
        if n >= max_chars {
            out.push_str(&format!("... ({} bytes)", s.len()));
            return out;
        }
        match c {
            c if c.is_control() || c == '\u{fffd}' || is_bidi_control(c) => {
                out.extend(c.escape_default())
            }
            c => out.push(c),
        }
    }
    out
}

/// Bidirectional overrides and isolates, which can make a terminal show text reordered.
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}')
}

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
