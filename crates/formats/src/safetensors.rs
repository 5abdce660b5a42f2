//! safetensors files, single and sharded (`model.safetensors.index.json`), memory-mapped.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::{corrupt, open_mmap, quote, FormatError, Result};

/// Element types we read; anything else is reported by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F16,
    BF16,
    I16,
    I32,
    Other,
}

#[derive(Debug, Clone)]
pub struct StTensor {
    pub name: String,
    pub dtype: Dtype,
    pub dtype_name: String,
    pub shape: Vec<usize>,
    /// Index of the shard holding the data.
    pub shard: usize,
    /// Absolute byte range in the shard file.
    pub start: usize,
    pub end: usize,
}

/// All tensors of a model folder (one file or several shards).
pub struct SafeTensors {
    pub shards: Vec<(PathBuf, Arc<memmap2::Mmap>)>,
    pub tensors: BTreeMap<String, StTensor>,
    /// The `__metadata__` map of the first shard.
    pub metadata: BTreeMap<String, String>,
}

impl SafeTensors {
    /// Opens `dir/model.safetensors.index.json` if present, else every `*.safetensors` in `dir`
    /// (or a single file path).
    pub fn open(path: &Path) -> Result<Self> {
        let files = if path.is_file() {
            vec![path.to_path_buf()]
        } else {
            let index = path.join("model.safetensors.index.json");
            if index.exists() {
                shard_files_from_index(&index)?
            } else {
                let mut v: Vec<PathBuf> = std::fs::read_dir(path)
                    .map_err(|source| FormatError::Io {
                        path: path.display().to_string(),
                        source,
                    })?
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
                    .collect();
                v.sort();
                if v.is_empty() {
                    return Err(FormatError::Missing(format!(
                        "{}: no *.safetensors files",
                        path.display()
                    )));
                }
                v
            }
        };
        let mut st = SafeTensors {
            shards: Vec::new(),
            tensors: BTreeMap::new(),
            metadata: BTreeMap::new(),
        };
        for (i, f) in files.iter().enumerate() {
            let map = Arc::new(open_mmap(f)?);
            let (tensors, meta) =
                parse_header(&map).map_err(|e| corrupt(format!("{}: {e}", f.display())))?;
            if i == 0 {
                st.metadata = meta;
            }
            for (name, mut t) in tensors {
                t.shard = i;
                if st.tensors.insert(name.clone(), t).is_some() {
                    return Err(corrupt(format!(
                        "{}: tensor {} appears in two shards",
                        f.display(),
                        quote(&name)
                    )));
                }
            }
            st.shards.push((f.clone(), map));
        }
        Ok(st)
    }

    pub fn get(&self, name: &str) -> Option<&StTensor> {
        self.tensors.get(name)
    }
    pub fn data(&self, t: &StTensor) -> &[u8] {
        &self.shards[t.shard].1[t.start..t.end]
    }
}

fn shard_files_from_index(index: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index).map_err(|source| FormatError::Io {
        path: index.display().to_string(),
        source,
    })?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| corrupt(format!("{}: invalid JSON: {e}", index.display())))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| corrupt(format!("{}: no weight_map", index.display())))?;
    let mut files: Vec<String> = map
        .values()
        .filter_map(|f| f.as_str().map(str::to_owned))
        .collect();
    files.sort();
    files.dedup();
    if files.is_empty() {
        return Err(corrupt(format!(
            "{}: weight_map names no shard files",
            index.display()
        )));
    }
    let dir = index.parent().unwrap_or(Path::new("."));
    files
        .into_iter()
        .map(|f| shard_path(index, dir, &f))
        .collect()
}

/// A shard named by the index, which must stay inside the model folder: a plain relative path
/// (no `..`, no root, no drive). Symlinks placed in the folder are the user's and are followed
/// (a Hugging Face cache snapshot links every file into its blob store).
fn shard_path(index: &Path, dir: &Path, name: &str) -> Result<PathBuf> {
    use std::path::Component;
    let outside = || {
        corrupt(format!(
            "{}: shard {} lies outside the model folder",
            index.display(),
            quote(name)
        ))
    };
    let rel = Path::new(name);
    if name.is_empty()
        || name.contains('\0')
        || !rel
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
    {
        return Err(outside());
    }
    Ok(dir.join(rel))
}

type Header = (BTreeMap<String, StTensor>, BTreeMap<String, String>);

/// Header parsing and validation (offsets within the buffer, sizes matching shapes) is the
/// `safetensors` crate's; we keep only absolute byte ranges so data can be borrowed from our map.
fn parse_header(buf: &[u8]) -> std::result::Result<Header, String> {
    use safetensors::Dtype as D;
    let (n, meta) = safetensors::SafeTensors::read_metadata(buf).map_err(|e| {
        format!(
            "corrupt or truncated safetensors file: {}",
            quote(&e.to_string())
        )
    })?;
    let header_end = 8 + n;
    let mut tensors = BTreeMap::new();
    for (name, info) in meta.tensors() {
        let dtype = match info.dtype {
            D::F32 => Dtype::F32,
            D::F16 => Dtype::F16,
            D::BF16 => Dtype::BF16,
            D::I16 => Dtype::I16,
            D::I32 => Dtype::I32,
            _ => Dtype::Other,
        };
        let (s, e) = info.data_offsets;
        if header_end + e > buf.len() {
            return Err(format!(
                "truncated safetensors file: data of {} lies beyond the end",
                quote(&name)
            ));
        }
        let t = StTensor {
            name: name.clone(),
            dtype,
            dtype_name: format!("{:?}", info.dtype),
            shape: info.shape.clone(),
            shard: 0,
            start: header_end + s,
            end: header_end + e,
        };
        tensors.insert(name, t);
    }
    let metadata = meta
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    Ok((tensors, metadata))
}
