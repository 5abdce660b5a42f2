//! Hugging Face model folders: `config.json` and `generation_config.json` as JSON values.
//!
//! The per-family meaning of the fields lives with the model code; this module only reads files.

use std::path::Path;

use crate::{corrupt, FormatError, Result};

/// Reads a JSON file; a missing file is `Ok(None)` so callers decide whether it is required.
pub fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| corrupt(format!("{}: invalid JSON: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(FormatError::Io {
            path: path.display().to_string(),
            source,
        }),
    }
}

/// `config.json` of a model folder (required).
pub fn read_config(dir: &Path) -> Result<serde_json::Value> {
    read_json(&dir.join("config.json"))?
        .ok_or_else(|| FormatError::Missing(format!("{}: no config.json", dir.display())))
}
