//! GGUF v2/v3: header, metadata, tensor table; tensor bytes borrowed from the memory map.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use trellm_quant::GgmlType;

use crate::{corrupt, open_mmap, quote, FormatError, Result};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// Memory the metadata and tensor table may take once parsed. Released models need a few tens of
/// MiB at most (a 262k-token vocabulary with its scores is about 10 MiB); a corrupt length that
/// points at the rest of the file must not copy the file into memory.
pub const MAX_METADATA_MEMORY: usize = 128 << 20;

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
    Array(Array),
}

/// A metadata array, stored as compactly as in the file (a `u8` array costs one byte an
/// element), so that no array takes much more memory than the file bytes that hold it.
#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    Str(Vec<String>),
    Array(Vec<Array>),
}

impl Array {
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::F64(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::Str(v) => v.len(),
            Array::Array(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The first `n` elements (for display).
    pub fn prefix(&self, n: usize) -> Array {
        fn p<T: Clone>(v: &[T], n: usize) -> Vec<T> {
            v[..v.len().min(n)].to_vec()
        }
        match self {
            Array::U8(v) => Array::U8(p(v, n)),
            Array::I8(v) => Array::I8(p(v, n)),
            Array::U16(v) => Array::U16(p(v, n)),
            Array::I16(v) => Array::I16(p(v, n)),
            Array::U32(v) => Array::U32(p(v, n)),
            Array::I32(v) => Array::I32(p(v, n)),
            Array::U64(v) => Array::U64(p(v, n)),
            Array::I64(v) => Array::I64(p(v, n)),
            Array::F32(v) => Array::F32(p(v, n)),
            Array::F64(v) => Array::F64(p(v, n)),
            Array::Bool(v) => Array::Bool(p(v, n)),
            Array::Str(v) => Array::Str(p(v, n)),
            Array::Array(v) => Array::Array(p(v, n)),
        }
    }
    /// The elements as integers (None if any is not one).
    pub fn to_i64(&self) -> Option<Vec<i64>> {
        fn conv<T: Copy>(v: &[T], f: impl Fn(T) -> Option<i64>) -> Option<Vec<i64>> {
            v.iter().map(|&x| f(x)).collect()
        }
        match self {
            Array::U8(v) => conv(v, |x| Some(x as i64)),
            Array::I8(v) => conv(v, |x| Some(x as i64)),
            Array::U16(v) => conv(v, |x| Some(x as i64)),
            Array::I16(v) => conv(v, |x| Some(x as i64)),
            Array::U32(v) => conv(v, |x| Some(x as i64)),
            Array::I32(v) => conv(v, |x| Some(x as i64)),
            Array::U64(v) => conv(v, |x| i64::try_from(x).ok()),
            Array::I64(v) => Some(v.clone()),
            Array::Bool(v) => conv(v, |x| Some(x as i64)),
            _ => None,
        }
    }
    /// The elements as f32 (None if any is not a number).
    pub fn to_f32(&self) -> Option<Vec<f32>> {
        match self {
            Array::F32(v) => Some(v.clone()),
            Array::F64(v) => Some(v.iter().map(|&x| x as f32).collect()),
            a => a
                .to_i64()
                .map(|v| v.into_iter().map(|x| x as f32).collect()),
        }
    }
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
    pub fn as_array(&self) -> Option<&Array> {
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
    /// Absolute offset of the data in its file.
    pub offset: usize,
    pub n_bytes: usize,
    /// Which file of a split GGUF holds the data (0: the first, or the only one).
    pub part: usize,
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

/// An open GGUF file, or every part of one split as llama-gguf-split splits it
/// (`NAME-00001-of-00003.gguf` ...). Cheap to clone (the maps are shared).
#[derive(Clone)]
pub struct Gguf {
    /// One map per part, in part order.
    maps: Vec<Arc<memmap2::Mmap>>,
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
    /// What the parsed values may still take in memory.
    mem_left: usize,
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
    /// Counts `bytes` of parsed values against [`MAX_METADATA_MEMORY`], before they are
    /// allocated.
    fn charge(&mut self, bytes: usize) -> Result<()> {
        self.mem_left = self.mem_left.checked_sub(bytes).ok_or_else(|| {
            corrupt(format!(
                "corrupt GGUF: its metadata would take more than {} MiB of memory (at byte {})",
                MAX_METADATA_MEMORY >> 20,
                self.pos
            ))
        })?;
        Ok(())
    }
    fn string(&mut self, what: &str) -> Result<String> {
        self.charge(std::mem::size_of::<String>())?;
        self.string_data(what)
    }
    /// A string whose `String` itself is already charged (an array element).
    fn string_data(&mut self, what: &str) -> Result<String> {
        let n = self.len(what, 1)?;
        self.charge(n)?;
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
                Value::Array(self.array(depth)?)
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

impl Cursor<'_> {
    /// An array: its element type, its length (bounded by the bytes left at the element type's
    /// size, before anything is reserved), its elements.
    fn array(&mut self, depth: u32) -> Result<Array> {
        if depth > 4 {
            return Err(corrupt("corrupt GGUF: metadata arrays nested too deeply"));
        }
        let elem = self.u32("array type")?;
        // Bytes one element takes at least in the file: a string its length, an array its type
        // and length.
        let min = match elem {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 | 10..=12 => 8,
            9 => 12,
            t => {
                return Err(corrupt(format!(
                    "corrupt GGUF: unknown metadata array element type {t}"
                )))
            }
        };
        let n = self.len("array length", min)?;
        // The vector before it is reserved; strings charge their text as they are read.
        let elem_mem = match elem {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 => std::mem::size_of::<String>(),
            9 => std::mem::size_of::<Array>(),
            _ => 8,
        };
        self.charge(n.saturating_mul(elem_mem))?;
        let w = "metadata array";
        macro_rules! nums {
            ($variant:ident, $t:ty) => {{
                let bytes = self.take(n * std::mem::size_of::<$t>(), w)?;
                Array::$variant(
                    bytes
                        .chunks_exact(std::mem::size_of::<$t>())
                        .map(|c| <$t>::from_le_bytes(c.try_into().expect("chunk size")))
                        .collect(),
                )
            }};
        }
        Ok(match elem {
            0 => nums!(U8, u8),
            1 => nums!(I8, i8),
            2 => nums!(U16, u16),
            3 => nums!(I16, i16),
            4 => nums!(U32, u32),
            5 => nums!(I32, i32),
            6 => nums!(F32, f32),
            7 => Array::Bool(self.take(n, w)?.iter().map(|&b| b != 0).collect()),
            8 => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.string_data("metadata string")?);
                }
                Array::Str(v)
            }
            9 => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.array(depth + 1)?);
                }
                Array::Array(v)
            }
            10 => nums!(U64, u64),
            11 => nums!(I64, i64),
            _ => nums!(F64, f64),
        })
    }
}

impl Gguf {
    /// Opens a GGUF file; given the first part of a split one, opens every part.
    pub fn open(path: &Path) -> Result<Self> {
        let mut g = Self::open_one(path)?;
        let count = g.get_u64("split.count").unwrap_or(1);
        if count <= 1 {
            return Ok(g);
        }
        let at = |m: String| corrupt(format!("{}: {m}", path.display()));
        // Part names carry 5-digit numbers, so no split has more parts.
        if count > 99_999 {
            return Err(at(format!("split.count = {count} is out of range")));
        }
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let suffix = format!("-00001-of-{count:05}.gguf");
        let no = g.get_u64("split.no").unwrap_or(0);
        let Some(stem) = name.strip_suffix(&suffix).filter(|_| no == 0) else {
            return Err(at(format!(
                "part {} of a GGUF split in {count}: open its first part (a name ending in {suffix})",
                no + 1
            )));
        };
        for i in 1..count as usize {
            let part_path = path.with_file_name(format!("{stem}-{:05}-of-{count:05}.gguf", i + 1));
            if !part_path.exists() {
                return Err(at(format!(
                    "part {} of {count} is missing: {}",
                    i + 1,
                    part_path.display()
                )));
            }
            let part = Self::open_one(&part_path)?;
            if part.get_u64("split.no") != Some(i as u64)
                || part.get_u64("split.count") != Some(count)
            {
                return Err(corrupt(format!(
                    "{}: not part {} of {count} of this split (its split.no / split.count differ)",
                    part_path.display(),
                    i + 1
                )));
            }
            for mut t in part.tensors {
                t.part = i;
                if g.by_name.insert(t.name.clone(), g.tensors.len()).is_some() {
                    return Err(corrupt(format!(
                        "{}: tensor {} appears in two parts",
                        part_path.display(),
                        quote(&t.name)
                    )));
                }
                g.tensors.push(t);
            }
            g.maps.extend(part.maps);
        }
        if let Some(n) = g.get_u64("split.tensors.count") {
            if n != g.tensors.len() as u64 {
                return Err(at(format!(
                    "split.tensors.count = {n}, but the parts hold {} tensors",
                    g.tensors.len()
                )));
            }
        }
        Ok(g)
    }

    fn open_one(path: &Path) -> Result<Self> {
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
        let mut c = Cursor {
            buf,
            pos: 0,
            mem_left: MAX_METADATA_MEMORY,
        };
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
        // Each entry's map node and value.
        c.charge(n_kv.saturating_mul(2 * std::mem::size_of::<Value>()))?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string("metadata key")?;
            let ty = c.u32("metadata type")?;
            let v = c.value(ty, 0)?;
            metadata.insert(key, v);
        }
        c.charge(n_tensors.saturating_mul(2 * std::mem::size_of::<TensorInfo>()))?;
        let mut raw = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string("tensor name")?;
            // The by-name index holds a second copy.
            c.charge(name.len())?;
            let n_dims = c.u32("tensor dims")? as usize;
            if n_dims > 4 {
                return Err(corrupt(format!(
                    "corrupt GGUF: tensor {} has {n_dims} dimensions",
                    quote(&name)
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
                    "tensor {} has unknown ggml type id {type_id}",
                    quote(&name)
                ))
            })?;
            let n = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let n_bytes = n
                .and_then(|n| usize::try_from(n).ok())
                .and_then(|n| ty.bytes_for(n))
                .ok_or_else(|| {
                    corrupt(format!(
                        "corrupt GGUF: tensor {} has an invalid shape {shape:?} for {ty:?}",
                        quote(&name)
                    ))
                })?;
            if rel % alignment != 0 {
                return Err(corrupt(format!(
                    "corrupt GGUF: tensor {} has offset {rel}, not a multiple of the alignment {alignment}",
                    quote(&name)
                )));
            }
            let offset = data_start
                .checked_add(rel)
                .filter(|o| {
                    o.checked_add(n_bytes as u64)
                        .is_some_and(|e| e <= buf.len() as u64)
                })
                .ok_or_else(|| {
                    corrupt(format!(
                        "truncated GGUF: data of tensor {} lies beyond the end of the file",
                        quote(&name)
                    ))
                })? as usize;
            if by_name.insert(name.clone(), tensors.len()).is_some() {
                return Err(corrupt(format!(
                    "corrupt GGUF: tensor {} appears twice",
                    quote(&name)
                )));
            }
            tensors.push(TensorInfo {
                name,
                shape,
                ty,
                offset,
                n_bytes,
                part: 0,
            });
        }
        Ok(Gguf {
            maps: vec![map],
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
        match self.get(key)?.as_array()? {
            Array::Str(v) => Some(v.iter().map(String::as_str).collect()),
            a if a.is_empty() => Some(Vec::new()),
            _ => None,
        }
    }
    pub fn get_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        self.get(key)?.as_array()?.to_f32()
    }
    pub fn get_i64_array(&self, key: &str) -> Option<Vec<i64>> {
        self.get(key)?.as_array()?.to_i64()
    }
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }
    /// The tensor's bytes, borrowed from its part's map (bounds were checked at parse time).
    pub fn data(&self, t: &TensorInfo) -> &[u8] {
        &self.maps[t.part][t.offset..t.offset + t.n_bytes]
    }
    /// The shared map holding `t`, for weights that outlive this handle.
    pub fn map_of(&self, t: &TensorInfo) -> &Arc<memmap2::Mmap> {
        &self.maps[t.part]
    }
    /// Bytes mapped, over every part.
    pub fn mapped_bytes(&self) -> usize {
        self.maps.iter().map(|m| m.len()).sum()
    }
}
