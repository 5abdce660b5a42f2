//! GGUF v2/v3: header, metadata, tensor table; tensor bytes borrowed from the memory map.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use trellm_quant::GgmlType;

use crate::{corrupt, open_mmap, FormatError, Result};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) if v >= 0 => Some(v as u64),
            Value::I16(v) if v >= 0 => Some(v as u64),
            Value::I32(v) if v >= 0 => Some(v as u64),
            Value::I64(v) if v >= 0 => Some(v as u64),
            Value::Bool(v) => Some(v as u64),
            _ => None,
        }
    }
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => self.as_i64().map(|v| v as f32),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => self.as_u64().map(|v| v != 0),
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// A tensor's entry in the table. `shape` is in ggml order: `shape[0]` is the contiguous
/// (innermost) dimension, so a `[rows, cols]` matrix is stored as `shape = [cols, rows]`.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub shape: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute offset of the data in the file.
    pub offset: usize,
    pub n_bytes: usize,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.shape.iter().product()
    }
    /// Rows and columns of a matrix view: columns are the innermost dimension, every outer
    /// dimension folds into rows.
    pub fn rows_cols(&self) -> (usize, usize) {
        let cols = self.shape.first().copied().unwrap_or(1) as usize;
        let rows = self.shape.iter().skip(1).product::<u64>() as usize;
        (rows, cols)
    }
}

/// An open GGUF file. Cheap to clone (the map is shared).
#[derive(Clone)]
pub struct Gguf {
    map: Arc<memmap2::Mmap>,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    by_name: BTreeMap<String, usize>,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                corrupt(format!(
                    "truncated GGUF: file ends inside {what} (at byte {})",
                    self.pos
                ))
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N, what)?.try_into().expect("length checked"))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }
    /// A count or length: u32 in v1, u64 later; bounded by what the rest of the file could hold
    /// so a corrupt length cannot trigger a huge allocation.
    fn len(&mut self, what: &str, min_item_bytes: usize) -> Result<usize> {
        let n = self.u64(what)?;
        let remaining = (self.buf.len() - self.pos) as u64;
        if n.saturating_mul(min_item_bytes.max(1) as u64) > remaining {
            return Err(corrupt(format!(
                "corrupt GGUF: {what} of {n} exceeds the file size"
            )));
        }
        Ok(n as usize)
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.len(what, 1)?;
        let bytes = self.take(n, what)?;
        // Token strings in some vocabularies are not valid UTF-8 on their own; keep them lossless
        // enough for lookup rather than refusing the whole file.
        Ok(match std::str::from_utf8(bytes) {
            Ok(s) => s.to_owned(),
            Err(_) => String::from_utf8_lossy(bytes).into_owned(),
        })
    }
    fn value(&mut self, ty: u32, depth: u32) -> Result<Value> {
        let w = "metadata value";
        Ok(match ty {
            0 => Value::U8(self.arr::<1>(w)?[0]),
            1 => Value::I8(self.arr::<1>(w)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.arr(w)?)),
            3 => Value::I16(i16::from_le_bytes(self.arr(w)?)),
            4 => Value::U32(self.u32(w)?),
            5 => Value::I32(i32::from_le_bytes(self.arr(w)?)),
            6 => Value::F32(f32::from_le_bytes(self.arr(w)?)),
            7 => Value::Bool(self.arr::<1>(w)?[0] != 0),
            8 => Value::Str(self.string("metadata string")?),
            9 => {
                if depth > 4 {
                    return Err(corrupt("corrupt GGUF: metadata arrays nested too deeply"));
                }
                let elem = self.u32("array type")?;
                let n = self.len("array length", 1)?;
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(elem, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64(w)?),
            11 => Value::I64(i64::from_le_bytes(self.arr(w)?)),
            12 => Value::F64(f64::from_le_bytes(self.arr(w)?)),
            t => {
                return Err(corrupt(format!(
                    "corrupt GGUF: unknown metadata value type {t}"
                )))
            }
        })
    }
}

impl Gguf {
    pub fn open(path: &Path) -> Result<Self> {
        let map = open_mmap(path)?;
        Self::parse(Arc::new(map)).map_err(|e| match e {
            FormatError::Corrupt(m) => FormatError::Corrupt(format!("{}: {m}", path.display())),
            FormatError::Unsupported(m) => {
                FormatError::Unsupported(format!("{}: {m}", path.display()))
            }
            e => e,
        })
    }

    pub fn parse(map: Arc<memmap2::Mmap>) -> Result<Self> {
        let buf: &[u8] = &map;
        let mut c = Cursor { buf, pos: 0 };
        if c.take(4, "the magic")
            .map_err(|_| corrupt("not a GGUF file (too short)"))?
            != MAGIC
        {
            return Err(corrupt("not a GGUF file (bad magic)"));
        }
        let version = c.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(FormatError::Unsupported(format!(
                "GGUF version {version} (2 and 3 are supported)"
            )));
        }
        let n_tensors = c.len("tensor count", 24)?;
        let n_kv = c.len("metadata count", 12)?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string("metadata key")?;
            let ty = c.u32("metadata type")?;
            let v = c.value(ty, 0)?;
            metadata.insert(key, v);
        }
        let mut raw = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string("tensor name")?;
            let n_dims = c.u32("tensor dims")? as usize;
            if n_dims > 4 {
                return Err(corrupt(format!(
                    "corrupt GGUF: tensor {name} has {n_dims} dimensions"
                )));
            }
            let mut shape = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                shape.push(c.u64("tensor shape")?);
            }
            let type_id = c.u32("tensor type")?;
            let offset = c.u64("tensor offset")?;
            raw.push((name, shape, type_id, offset));
        }
        let alignment = match metadata.get("general.alignment") {
            Some(v) => v
                .as_u64()
                .filter(|a| a.is_power_of_two() && *a <= 1 << 20)
                .ok_or_else(|| corrupt("corrupt GGUF: general.alignment is not a power of two"))?,
            None => DEFAULT_ALIGNMENT,
        };
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
        let mut tensors = Vec::with_capacity(raw.len());
        let mut by_name = BTreeMap::new();
        for (name, shape, type_id, rel) in raw {
            let ty = GgmlType::from_id(type_id).ok_or_else(|| {
                FormatError::Unsupported(format!(
                    "tensor {name} has unknown ggml type id {type_id}"
                ))
            })?;
            let n = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let n_bytes = n
                .and_then(|n| usize::try_from(n).ok())
                .and_then(|n| ty.bytes_for(n))
                .ok_or_else(|| {
                    corrupt(format!(
                        "corrupt GGUF: tensor {name} has an invalid shape {shape:?} for {ty:?}"
                    ))
                })?;
            let offset = data_start
                .checked_add(rel)
                .filter(|o| {
                    o.checked_add(n_bytes as u64)
                        .is_some_and(|e| e <= buf.len() as u64)
                })
                .ok_or_else(|| {
                    corrupt(format!(
                        "truncated GGUF: data of tensor {name} lies beyond the end of the file"
                    ))
                })? as usize;
            if by_name.insert(name.clone(), tensors.len()).is_some() {
                return Err(corrupt(format!(
                    "corrupt GGUF: tensor {name} appears twice"
                )));
            }
            tensors.push(TensorInfo {
                name,
                shape,
                ty,
                offset,
                n_bytes,
            });
        }
        Ok(Gguf {
            map,
            version,
            metadata,
            tensors,
            by_name,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(Value::as_u64)
    }
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key).and_then(Value::as_f32)
    }
    /// A string array (e.g. `tokenizer.ggml.tokens`).
    pub fn get_str_array(&self, key: &str) -> Option<Vec<&str>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(Value::as_str)
            .collect()
    }
    pub fn get_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(Value::as_f32)
            .collect()
    }
    pub fn get_i64_array(&self, key: &str) -> Option<Vec<i64>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(Value::as_i64)
            .collect()
    }
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }
    /// The tensor's bytes, borrowed from the map (bounds were checked at parse time).
    pub fn data(&self, t: &TensorInfo) -> &[u8] {
        &self.map[t.offset..t.offset + t.n_bytes]
    }
    /// The shared map, for weights that outlive this handle.
    pub fn map(&self) -> &Arc<memmap2::Mmap> {
        &self.map
    }
}
