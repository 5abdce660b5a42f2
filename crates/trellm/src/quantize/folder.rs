//! The files an EXL3 folder holds, as exllamav3 writes them: safetensors (sharded above a size,
//! with `model.safetensors.index.json`), `config.json` with `quantization_config`, and
//! `quantization_config.json` listing every module's stored tensors.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use trellm_formats::safetensors::SafeTensors;

/// A tensor to store: its safetensors dtype name (`F16`, `I16`, ...), shape and bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// Writes `tensors` as one safetensors file, atomically (a temporary file renamed into place,
/// so an interrupted run never leaves a truncated file that looks whole).
pub fn write_safetensors(path: &Path, tensors: &[&Tensor]) -> Result<()> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0usize;
    for t in tensors {
        header.insert(
            t.name.clone(),
            json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + t.bytes.len()]}),
        );
        offset += t.bytes.len();
    }
    let mut h = serde_json::to_vec(&Value::Object(header))?;
    // The data starts 8-aligned, as the safetensors library writes it.
    while (8 + h.len()) % 8 != 0 {
        h.push(b' ');
    }
    let tmp = path.with_extension("tmp");
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?,
    );
    f.write_all(&(h.len() as u64).to_le_bytes())?;
    f.write_all(&h)?;
    for t in tensors {
        f.write_all(&t.bytes)?;
    }
    f.into_inner()
        .map_err(|e| e.into_error())?
        .sync_all()
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// Every tensor of a safetensors file (or folder), in name order.
pub fn read_safetensors(path: &Path) -> Result<Vec<Tensor>> {
    let st = SafeTensors::open(path).with_context(|| path.display().to_string())?;
    Ok(st
        .tensors
        .values()
        .map(|t| Tensor {
            name: t.name.clone(),
            dtype: t.dtype_name.clone(),
            shape: t.shape.clone(),
            bytes: st.data(t).to_vec(),
        })
        .collect())
}

/// torch's name of a safetensors dtype, as `quantization_config.json` lists it.
fn torch_dtype(st: &str) -> String {
    match st {
        "F32" => "torch.float32".into(),
        "F16" => "torch.float16".into(),
        "BF16" => "torch.bfloat16".into(),
        "I16" => "torch.int16".into(),
        "I32" => "torch.int32".into(),
        "I64" => "torch.int64".into(),
        "U8" => "torch.uint8".into(),
        other => format!("torch.{}", other.to_lowercase()),
    }
}

/// The module a tensor belongs to: its name without the last component
/// (`model.layers.0.self_attn.q_proj.trellis` -> `model.layers.0.self_attn.q_proj`).
fn module_of(name: &str) -> &str {
    name.rsplit_once('.').map_or(name, |(m, _)| m)
}

/// Writes the model's tensors into `out`: one `model.safetensors`, or shards of at most
/// `shard_bytes` each (`model-0000N-of-0000M.safetensors` + the index) in the given order.
/// Returns the bytes written.
pub fn write_model(out: &Path, tensors: &[Tensor], shard_bytes: u64) -> Result<u64> {
    let mut shards: Vec<Vec<&Tensor>> = vec![Vec::new()];
    let mut size = 0u64;
    for t in tensors {
        let n = t.bytes.len() as u64;
        if size > 0 && size + n > shard_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().expect("one shard").push(t);
        size += n;
    }
    let total: u64 = tensors.iter().map(|t| t.bytes.len() as u64).sum();
    if shards.len() == 1 {
        write_safetensors(&out.join("model.safetensors"), &shards[0])?;
        return Ok(total);
    }
    let m = shards.len();
    let mut map = BTreeMap::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{m:05}.safetensors", i + 1);
        write_safetensors(&out.join(&file), shard)?;
        for t in shard {
            map.insert(t.name.clone(), file.clone());
        }
    }
    let index = json!({"metadata": {"total_size": total}, "weight_map": map});
    std::fs::write(
        out.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index)?,
    )?;
    Ok(total)
}

/// `quantization_config.json`: the `quantization_config` plus `tensor_storage`, each module's
/// stored tensors (shape, bytes, torch dtype) and, for EXL3 modules, the format, bits per
/// weight and codebook multiplier, as exllamav3 lists them.
pub fn quantization_config_json(qc: &Value, tensors: &[Tensor]) -> Value {
    let mut storage: BTreeMap<String, serde_json::Map<String, Value>> = BTreeMap::new();
    for t in tensors {
        let m = storage.entry(module_of(&t.name).to_string()).or_default();
        let stored = m
            .entry("stored_tensors")
            .or_insert_with(|| json!({}))
            .as_object_mut()
            .expect("an object");
        stored.insert(
            t.name.clone(),
            json!({"shape": t.shape, "n_bytes": t.bytes.len(), "dtype": torch_dtype(&t.dtype)}),
        );
    }
    for t in tensors {
        let module = module_of(&t.name);
        let m = storage.get_mut(module).expect("listed above");
        if t.name.ends_with(".trellis") {
            let bits = t.shape.last().copied().unwrap_or(0) as f64 / 16.0;
            m.insert("quant_format".into(), json!("exl3"));
            m.insert(
                "bits_per_weight".into(),
                if bits.fract() == 0.0 {
                    json!(bits as u64)
                } else {
                    json!(bits)
                },
            );
        }
        for marker in ["mul1", "mcg"] {
            if t.name.ends_with(&format!(".{marker}")) && t.bytes.len() == 4 {
                let v = u32::from_le_bytes(t.bytes[..4].try_into().expect("4 bytes"));
                m.insert(format!("{marker}_multiplier"), json!(v));
            }
        }
    }
    let mut q = qc.clone();
    q["tensor_storage"] = json!(storage);
    q
}

/// Files besides the weights that a model folder carries over (tokenizer, chat template,
/// generation defaults).
const CARRIED: [&str; 9] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
];

pub fn copy_side_files(src: &Path, out: &Path) -> Result<()> {
    for f in CARRIED {
        if src.join(f).is_file() {
            std::fs::copy(src.join(f), out.join(f))
                .with_context(|| format!("cannot copy {f} into {}", out.display()))?;
        }
    }
    Ok(())
}

/// The checkpoint of an unfinished run: `OUT/.checkpoint/` with `job.json` (what is being made
/// and how far it got), one safetensors file of quantized tensors per finished layer, and the
/// calibration state (the hidden rows entering the next layer) at the last save.
pub struct Checkpoint {
    pub dir: std::path::PathBuf,
}

impl Checkpoint {
    pub fn new(out: &Path) -> Checkpoint {
        Checkpoint {
            dir: out.join(".checkpoint"),
        }
    }

    pub fn layer_file(&self, l: usize) -> std::path::PathBuf {
        self.dir.join(format!("layer-{l:05}.safetensors"))
    }

    pub fn head_file(&self) -> std::path::PathBuf {
        self.dir.join("head.safetensors")
    }

    fn state_file(&self) -> std::path::PathBuf {
        self.dir.join("state.safetensors")
    }

    /// The layer to start at and the state entering it, if an earlier run of the same job left
    /// one; an error if `OUT` holds another job's checkpoint.
    pub fn resume(&self, job: &Value, hidden: usize) -> Result<Option<(usize, Vec<Vec<f32>>)>> {
        let path = self.dir.join("job.json");
        if !path.exists() {
            return Ok(None);
        }
        let saved: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        if saved.get("job") != Some(job) {
            bail!(
                "{} holds the checkpoint of another quantization (other model, bits or \
                 calibration); remove that folder or choose another --out",
                self.dir.display()
            );
        }
        let Some(next) = saved.get("state_layer").and_then(Value::as_u64) else {
            return Ok(None);
        };
        let rows = read_safetensors(&self.state_file())?;
        let mut state = vec![Vec::new(); rows.len()];
        for t in rows {
            let i: usize = t
                .name
                .strip_prefix("row.")
                .and_then(|s| s.parse().ok())
                .filter(|&i| i < state.len())
                .with_context(|| format!("checkpoint state: unexpected tensor {}", t.name))?;
            if t.dtype != "F32" || t.shape.len() != 2 || t.shape[1] != hidden {
                bail!("checkpoint state: row {i} is not F32 [tokens, {hidden}]");
            }
            state[i] = t
                .bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect();
        }
        Ok(Some((next as usize, state)))
    }

    /// Starts (or restarts) the checkpoint of `job`.
    pub fn begin(&self, job: &Value) -> Result<()> {
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("cannot create {}", self.dir.display()))?;
        if !self.dir.join("job.json").exists() {
            self.write_job(job, None)?;
        }
        Ok(())
    }

    fn write_job(&self, job: &Value, state_layer: Option<usize>) -> Result<()> {
        let path = self.dir.join("job.json");
        let tmp = path.with_extension("tmp");
        std::fs::write(
            &tmp,
            serde_json::to_string_pretty(&json!({"job": job, "state_layer": state_layer}))?,
        )?;
        std::fs::rename(&tmp, &path)?;
        Ok(())
    }

    /// Saves the state entering layer `next`.
    pub fn save_state(
        &self,
        job: &Value,
        next: usize,
        state: &[Vec<f32>],
        hidden: usize,
    ) -> Result<()> {
        let rows: Vec<Tensor> = state
            .iter()
            .enumerate()
            .map(|(i, r)| Tensor {
                name: format!("row.{i}"),
                dtype: "F32".into(),
                shape: vec![r.len() / hidden, hidden],
                bytes: r.iter().flat_map(|v| v.to_le_bytes()).collect(),
            })
            .collect();
        write_safetensors(&self.state_file(), &rows.iter().collect::<Vec<_>>())?;
        self.write_job(job, Some(next))
    }

    pub fn remove(&self) -> Result<()> {
        std::fs::remove_dir_all(&self.dir)
            .with_context(|| format!("cannot remove {}", self.dir.display()))
    }
}
