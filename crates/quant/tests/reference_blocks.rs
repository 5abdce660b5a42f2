//! Decodes the fixtures written by `scripts/gguf_dequant_fixture.py` (real blocks from two GGUF
//! models plus synthetic edge cases) and by `crates/quant/scripts/gguf_quant_types_fixture.py`
//! (real blocks of the other block types, from GGUFs llama.cpp's quantizer wrote from a real
//! model, plus synthetic edge cases), and requires bit-identical output to gguf-python's
//! reference dequantization.
//!
//! `whole_tensors_match_reference_hashes` also decodes the complete tensors listed in the first
//! index straight from the real model files, fetched into the trellm cache if missing;
//! `quantized_ggufs_match_reference_hashes` does the same for the second index's GGUFs when
//! `TRELLM_QUANT_GGUFS` names the folder `make_quant_ggufs.sh` wrote them to.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};
use trellm_quant::ggml::{dequantize, dequantize_row, GgmlType};

#[derive(Deserialize)]
struct Index {
    models: Vec<Model>,
    tensors: Vec<Tensor>,
    samples: Vec<Sample>,
}

#[derive(Deserialize)]
struct Model {
    file: String,
    sha256: String,
    type_counts: std::collections::BTreeMap<String, usize>,
}

#[derive(Deserialize)]
struct Tensor {
    model: String,
    model_sha256: String,
    name: String,
    #[serde(rename = "type")]
    type_name: String,
    type_id: u32,
    shape: Vec<u64>,
    n_elements: u64,
    n_bytes: u64,
    data_offset: u64,
    dequant_sha256: String,
}

#[derive(Deserialize)]
struct Sample {
    id: String,
    #[serde(rename = "type")]
    type_name: String,
    type_id: u32,
    n_blocks: usize,
    n_values: usize,
    raw: String,
    f32: String,
    source: String,
    tensor: Option<String>,
}

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf_dequant")
}

fn quant_types_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf_quant_types")
}

fn read_index(dir: &Path) -> Index {
    let path = dir.join("index.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("index.json")
}

fn index() -> Index {
    read_index(&fixture_dir())
}

/// Every sample of both fixture sets, with the folder its files are in.
fn all_samples() -> Vec<(PathBuf, Sample)> {
    let mut out = Vec::new();
    for dir in [fixture_dir(), quant_types_dir()] {
        let index = read_index(&dir);
        assert!(!index.samples.is_empty(), "{}", dir.display());
        out.extend(index.samples.into_iter().map(|s| (dir.clone(), s)));
    }
    out
}

fn ty(id: u32, name: &str) -> GgmlType {
    let ty = GgmlType::from_id(id).unwrap_or_else(|| panic!("unknown type id {id}"));
    assert_eq!(ty.name(), name, "type id {id}");
    ty
}

struct Loaded {
    ty: GgmlType,
    raw: Vec<u8>,
    expected: Vec<f32>,
}

fn load(dir: &Path, s: &Sample) -> Loaded {
    let ty = ty(s.type_id, &s.type_name);
    let raw = std::fs::read(dir.join(&s.raw)).expect("raw");
    let bytes = std::fs::read(dir.join(&s.f32)).expect("f32");
    let expected: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(raw.len(), s.n_blocks * ty.block_bytes(), "{}", s.id);
    assert_eq!(expected.len(), s.n_values, "{}", s.id);
    Loaded { ty, raw, expected }
}

fn same(a: f32, b: f32) -> bool {
    // NaN payloads differ between fp16 converters (some quiet them); NaN-ness must still match.
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Panics with the first few differences, if any.
fn assert_bits_eq(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let bad: Vec<String> = (0..got.len())
        .filter(|&i| !same(got[i], want[i]))
        .take(8)
        .map(|i| {
            format!(
                "[{i}] got {:e} ({:#010x}) want {:e} ({:#010x})",
                got[i],
                got[i].to_bits(),
                want[i],
                want[i].to_bits()
            )
        })
        .collect();
    assert!(
        bad.is_empty(),
        "{what}: differs from the reference:\n{}",
        bad.join("\n")
    );
}

#[test]
fn fixtures_match_reference_bit_for_bit() {
    for (dir, s) in &all_samples() {
        let l = load(dir, s);
        let mut out = vec![f32::NAN; l.expected.len()];
        dequantize(l.ty, &l.raw, &mut out).unwrap_or_else(|e| panic!("{}: {e}", s.id));
        assert_bits_eq(&s.id, &out, &l.expected);
    }
}

#[test]
fn unaligned_sources_decode_identically() {
    // Tensor data in an mmapped file has no alignment guarantee; shift the bytes off every
    // natural alignment.
    for (dir, s) in &all_samples() {
        let l = load(dir, s);
        for shift in 1..8 {
            let mut buf = vec![0u8; shift + l.raw.len()];
            buf[shift..].copy_from_slice(&l.raw);
            let mut out = vec![0f32; l.expected.len()];
            dequantize(l.ty, &buf[shift..], &mut out).unwrap();
            assert_bits_eq(&format!("{} shifted by {shift}", s.id), &out, &l.expected);
        }
    }
}

#[test]
fn block_by_block_equals_whole() {
    for (dir, s) in &all_samples() {
        let l = load(dir, s);
        let mut out = vec![0f32; l.expected.len()];
        let (bb, bl) = (l.ty.block_bytes(), l.ty.block_len());
        for (src, dst) in l.raw.chunks(bb).zip(out.chunks_mut(bl)) {
            dequantize_row(l.ty, src, dst).unwrap();
        }
        assert_bits_eq(&s.id, &out, &l.expected);
    }
}

#[test]
fn fixtures_cover_every_supported_type_and_every_model_type() {
    let samples = all_samples();
    let sampled: BTreeSet<&str> = samples.iter().map(|(_, s)| s.type_name.as_str()).collect();
    for t in GgmlType::ALL.iter().filter(|t| t.is_supported()) {
        assert!(sampled.contains(t.name()), "no fixture for {}", t.name());
    }
    // Real blocks of every type either model set holds, and of every type added for the
    // quantized set (Q8_K aside: no tool writes it into a file, so its samples are synthetic).
    let real: BTreeSet<&str> = samples
        .iter()
        .filter(|(_, s)| s.source == "model" && s.tensor.is_some())
        .map(|(_, s)| s.type_name.as_str())
        .collect();
    use GgmlType::*;
    for t in [
        Q5_1, Q2K, Q3K, Q5K, IQ4NL, IQ4XS, IQ2XXS, IQ2XS, IQ2S, IQ3XXS, IQ3S,
    ] {
        assert!(real.contains(t.name()), "no real sample of {}", t.name());
    }
    for dir in [fixture_dir(), quant_types_dir()] {
        for m in &read_index(&dir).models {
            for name in m.type_counts.keys() {
                assert!(
                    real.contains(name.as_str()),
                    "{}: no real sample of {name}",
                    m.file
                );
                let t = GgmlType::ALL.iter().find(|t| t.name() == name);
                assert!(
                    t.is_some_and(|t| t.is_supported()),
                    "{}: holds {name}, which we cannot decode",
                    m.file
                );
            }
        }
    }
}

/// The real model file with this name, from the trellm cache (pulled on first use).
fn model_file(file: &str) -> PathBuf {
    let known = trellm_hub::known_models()
        .iter()
        .find(|k| k.file_name == file)
        .unwrap_or_else(|| panic!("{file} is not one of the known models"));
    trellm_hub::resolve_model(known.alias, false)
        .unwrap_or_else(|e| panic!("cannot fetch {}: {e:#}", known.alias))
}

fn file_sha256(path: &Path) -> std::io::Result<String> {
    let mut f = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// sha256 of the whole tensor decoded to little-endian f32, read in bounded chunks.
fn tensor_sha256(path: &Path, t: &Tensor, ty: GgmlType) -> String {
    let mut f = File::open(path).unwrap();
    f.seek(SeekFrom::Start(t.data_offset)).unwrap();
    let (bb, bl) = (ty.block_bytes(), ty.block_len());
    let chunk_blocks = (1 << 20) / bb;
    let mut raw = vec![0u8; chunk_blocks * bb];
    let mut out = vec![0f32; chunk_blocks * bl];
    let mut bytes = Vec::with_capacity(out.len() * 4);
    let mut h = Sha256::new();
    let mut left = usize::try_from(t.n_bytes).unwrap();
    while left > 0 {
        let n = left.min(raw.len());
        f.read_exact(&mut raw[..n]).unwrap();
        let vals = n / bb * bl;
        dequantize(ty, &raw[..n], &mut out[..vals]).unwrap();
        bytes.clear();
        bytes.extend(out[..vals].iter().flat_map(|v| v.to_le_bytes()));
        h.update(&bytes);
        left -= n;
    }
    hex(&h.finalize())
}

#[test]
fn whole_tensors_match_reference_hashes() {
    check_whole_tensors(&index(), model_file);
}

/// The second fixture set's whole tensors, from the GGUFs in `$TRELLM_QUANT_GGUFS` (written by
/// `make_quant_ggufs.sh`; too big to commit, and building llama.cpp to make them is not a test's
/// job): run with `--ignored` where they exist.
#[test]
#[ignore = "needs TRELLM_QUANT_GGUFS (the GGUFs make_quant_ggufs.sh writes)"]
fn quantized_ggufs_match_reference_hashes() {
    let dir = std::env::var_os("TRELLM_QUANT_GGUFS").expect("TRELLM_QUANT_GGUFS names the folder");
    check_whole_tensors(&read_index(&quant_types_dir()), |f| Path::new(&dir).join(f));
}

fn check_whole_tensors(index: &Index, file: impl Fn(&str) -> PathBuf) {
    assert!(!index.tensors.is_empty());
    let mut checked = 0;
    for m in &index.models {
        let path = file(&m.file);
        assert_eq!(file_sha256(&path).unwrap(), m.sha256, "{}", path.display());
        for t in index.tensors.iter().filter(|t| t.model == m.file) {
            assert_eq!(t.model_sha256, m.sha256);
            let ty = ty(t.type_id, &t.type_name);
            assert_eq!(t.shape.iter().product::<u64>(), t.n_elements, "{}", t.name);
            let n = usize::try_from(t.n_elements).unwrap();
            assert_eq!(
                ty.bytes_for(n).map(|b| b as u64),
                Some(t.n_bytes),
                "{}",
                t.name
            );
            assert_eq!(
                tensor_sha256(&path, t, ty),
                t.dequant_sha256,
                "{}: {}",
                m.file,
                t.name
            );
            checked += 1;
        }
    }
    assert_eq!(checked, index.tensors.len());
}
