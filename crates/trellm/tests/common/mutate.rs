//! Mutation fuzzing helpers: a seeded mutator for bytes and for JSON, the layout of a GGUF file
//! (so mutations can aim at its header, metadata, tensor table and data), and a tiny real GGUF.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;

pub type FuzzRng = ChaCha8Rng;

pub fn rng(seed: u64) -> FuzzRng {
    ChaCha8Rng::seed_from_u64(seed)
}

const INTERESTING_U64: &[u64] = &[
    0,
    1,
    2,
    3,
    7,
    8,
    31,
    32,
    63,
    64,
    127,
    128,
    255,
    256,
    4096,
    65535,
    65536,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x1_0000_0000,
    0x7fff_ffff_ffff_ffff,
    0x8000_0000_0000_0000,
    u64::MAX,
    u64::MAX - 1,
];

const INTERESTING_F32: &[f32] = &[
    0.0,
    -0.0,
    -1.0,
    1.0,
    f32::NAN,
    f32::INFINITY,
    f32::NEG_INFINITY,
    f32::MAX,
    f32::MIN_POSITIVE,
    1e-45,
    -1e-6,
    1e30,
];

/// One of a few kinds of edit at `pos` (or a random place when `None`): bit flips, interesting
/// bytes, integers and floats, deleted, duplicated or truncated spans.
pub fn mutate_at(rng: &mut FuzzRng, b: &mut Vec<u8>, pos: Option<usize>) {
    if b.is_empty() {
        b.push(rng.gen());
        return;
    }
    let at = pos
        .unwrap_or_else(|| rng.gen_range(0..b.len()))
        .min(b.len() - 1);
    match rng.gen_range(0..10) {
        0 | 1 => b[at] ^= 1 << rng.gen_range(0..8),
        2 => b[at] = [0u8, 0xff, 0x7f, 0x80, 1, b'\x1b', b'\n'][rng.gen_range(0..7)],
        3 | 4 => {
            let v = INTERESTING_U64[rng.gen_range(0..INTERESTING_U64.len())];
            let v = if rng.gen_bool(0.2) {
                v.wrapping_neg()
            } else {
                v
            };
            let width = if rng.gen_bool(0.5) { 8 } else { 4 };
            let bytes = v.to_le_bytes();
            for (i, &x) in bytes[..width].iter().enumerate() {
                if let Some(d) = b.get_mut(at + i) {
                    *d = x;
                }
            }
        }
        5 => {
            let v = INTERESTING_F32[rng.gen_range(0..INTERESTING_F32.len())];
            for (i, x) in v.to_le_bytes().into_iter().enumerate() {
                if let Some(d) = b.get_mut(at + i) {
                    *d = x;
                }
            }
        }
        6 => {
            let n = rng.gen_range(1..=64.min(b.len() - at));
            b.drain(at..at + n);
        }
        7 => {
            let n = rng.gen_range(1..=64.min(b.len() - at));
            let chunk: Vec<u8> = b[at..at + n].to_vec();
            let to = rng.gen_range(0..=b.len());
            b.splice(to..to, chunk);
        }
        8 => b.truncate(at.max(1)),
        _ => {
            // A small random value in a 4-byte field (counts, types, dims).
            let v: u32 = rng.gen_range(0..40);
            for (i, x) in v.to_le_bytes().into_iter().enumerate() {
                if let Some(d) = b.get_mut(at + i) {
                    *d = x;
                }
            }
        }
    }
}

/// One to four random edits anywhere.
pub fn mutate_bytes(rng: &mut FuzzRng, b: &mut Vec<u8>) {
    for _ in 0..rng.gen_range(1..=4) {
        mutate_at(rng, b, None);
    }
}

fn interesting_json(rng: &mut FuzzRng) -> Value {
    match rng.gen_range(0..16) {
        0 => Value::from(0),
        1 => Value::from(-1),
        2 => Value::from(u64::MAX),
        3 => Value::from(i64::MIN),
        4 => serde_json::json!(1e308),
        5 => serde_json::json!(-1e308),
        6 => serde_json::json!(1e-320),
        7 => serde_json::json!(0.5),
        8 => Value::Null,
        9 => Value::Bool(rng.gen()),
        10 => Value::from(""),
        11 => Value::from("\u{1b}[31m\u{0}\u{202e}x"),
        12 => Value::Array(vec![]),
        13 => serde_json::json!({}),
        14 => Value::from(rng.gen_range(0..5000u64)),
        _ => Value::from("x".repeat(rng.gen_range(1..5000))),
    }
}

/// Every value's path in `v` (object keys and array indices).
fn nodes(v: &Value, path: &mut Vec<Value>, out: &mut Vec<Vec<Value>>) {
    out.push(path.clone());
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                path.push(Value::from(k.clone()));
                nodes(x, path, out);
                path.pop();
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate().take(64) {
                path.push(Value::from(i));
                nodes(x, path, out);
                path.pop();
            }
        }
        _ => {}
    }
}

fn at_path<'a>(v: &'a mut Value, path: &[Value]) -> &'a mut Value {
    path.iter().fold(v, |v, p| match p {
        Value::String(k) => &mut v[k.as_str()],
        p => &mut v[p.as_u64().unwrap() as usize],
    })
}

/// Structure-aware edits of a JSON document: a value replaced by an interesting one, a key
/// removed, a value duplicated under another key, or a small number scaled; sometimes the text
/// itself is then byte-mutated.
pub fn mutate_json(rng: &mut FuzzRng, v: &Value) -> Vec<u8> {
    let mut v = v.clone();
    for _ in 0..rng.gen_range(1..=3) {
        let mut all = Vec::new();
        nodes(&v, &mut Vec::new(), &mut all);
        let path = all[rng.gen_range(0..all.len())].clone();
        match rng.gen_range(0..6) {
            0 if !path.is_empty() => {
                let (last, parent) = path.split_last().unwrap();
                let p = at_path(&mut v, parent);
                match (p, last) {
                    (Value::Object(m), Value::String(k)) => {
                        m.remove(k);
                    }
                    (Value::Array(a), i) => {
                        let i = i.as_u64().unwrap() as usize;
                        if i < a.len() {
                            a.remove(i);
                        }
                    }
                    _ => {}
                }
            }
            1 => {
                let x = at_path(&mut v, &path);
                if let Some(n) = x.as_f64() {
                    *x = serde_json::json!(n * [-1.0, 0.0, 1e6, 1e-6, 1.5][rng.gen_range(0..5)]);
                } else {
                    *x = interesting_json(rng);
                }
            }
            2 => {
                let x = at_path(&mut v, &path).clone();
                if let Value::Object(m) = &mut v {
                    m.insert(format!("k{}", rng.gen_range(0..4)), x);
                }
            }
            _ => *at_path(&mut v, &path) = interesting_json(rng),
        }
    }
    let mut text = serde_json::to_vec(&v).unwrap();
    if rng.gen_bool(0.15) {
        mutate_bytes(rng, &mut text);
    }
    text
}

/// Where the parts of a GGUF file lie: each metadata entry, each tensor-table entry, the data.
#[derive(Debug, Clone)]
pub struct GgufLayout {
    /// Byte ranges of the metadata entries (key, type, value).
    pub kv: Vec<(usize, usize)>,
    /// Byte ranges of the tensor-table entries.
    pub tensors: Vec<(usize, usize)>,
    pub data_start: usize,
    pub len: usize,
}

/// Walks a well-formed GGUF v3 header (test files only; panics on anything else).
pub fn gguf_layout(b: &[u8]) -> GgufLayout {
    let u32_at = |p: usize| u32::from_le_bytes(b[p..p + 4].try_into().unwrap());
    let u64_at = |p: usize| u64::from_le_bytes(b[p..p + 8].try_into().unwrap()) as usize;
    fn skip_value(b: &[u8], p: usize, ty: u32) -> usize {
        let u32_at = |p: usize| u32::from_le_bytes(b[p..p + 4].try_into().unwrap());
        let u64_at = |p: usize| u64::from_le_bytes(b[p..p + 8].try_into().unwrap()) as usize;
        match ty {
            0 | 1 | 7 => p + 1,
            2 | 3 => p + 2,
            4..=6 => p + 4,
            10..=12 => p + 8,
            8 => p + 8 + u64_at(p),
            9 => {
                let elem = u32_at(p);
                let n = u64_at(p + 4);
                let mut q = p + 12;
                for _ in 0..n {
                    q = skip_value(b, q, elem);
                }
                q
            }
            t => panic!("type {t}"),
        }
    }
    let n_tensors = u64_at(8);
    let n_kv = u64_at(16);
    let mut p = 24;
    let mut kv = Vec::new();
    for _ in 0..n_kv {
        let start = p;
        p += 8 + u64_at(p);
        let ty = u32_at(p);
        p = skip_value(b, p + 4, ty);
        kv.push((start, p));
    }
    let mut tensors = Vec::new();
    for _ in 0..n_tensors {
        let start = p;
        p += 8 + u64_at(p);
        let dims = u32_at(p) as usize;
        p += 4 + 8 * dims + 4 + 8;
        tensors.push((start, p));
    }
    GgufLayout {
        kv,
        tensors,
        data_start: p.div_ceil(32) * 32,
        len: b.len(),
    }
}

/// Where in a GGUF to aim one mutation: the fixed header, a metadata entry's fields, a
/// tensor-table entry, or the data; returns the region's name and a position.
pub fn gguf_target(rng: &mut FuzzRng, l: &GgufLayout) -> (&'static str, usize) {
    let pick = |rng: &mut FuzzRng, (s, e): (usize, usize)| -> usize {
        // Mostly the entry's last 8..24 bytes (type, counts, value, dims, offset), else anywhere.
        if rng.gen_bool(0.7) && e - s > 24 {
            e - rng.gen_range(1..=24)
        } else {
            rng.gen_range(s..e)
        }
    };
    match rng.gen_range(0..10) {
        0 => ("header", rng.gen_range(0..24)),
        1..=3 if !l.kv.is_empty() => {
            let kv = l.kv[rng.gen_range(0..l.kv.len())];
            ("metadata", pick(rng, kv))
        }
        4..=6 if !l.tensors.is_empty() => {
            let t = l.tensors[rng.gen_range(0..l.tensors.len())];
            ("tensor table", pick(rng, t))
        }
        _ if l.len > l.data_start => ("data", rng.gen_range(l.data_start..l.len)),
        _ => ("header", rng.gen_range(0..24)),
    }
}

/// The GPT-2 byte-to-character table of byte-level BPE.
pub fn byte_level_alphabet() -> Vec<char> {
    let mut keep: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
    let mut all = vec![' '; 256];
    let mut extra = 0;
    for b in 0..256u32 {
        let c = if keep.contains(&b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
        all[b as usize] = char::from_u32(c).unwrap();
    }
    keep.clear();
    all
}
