//! Opening a model from a path: a GGUF file, a folder holding one, or a Hugging Face folder.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use trellm_formats::gguf::Gguf;
use trellm_formats::safetensors::SafeTensors;
use trellm_tokenizer::Tokenizer;

use crate::backend::cpu::{CpuModel, ShardedCpu};
use crate::backend::Device;
use crate::engine::{Engine, EngineOptions, SamplingDefaults};

use super::config::ModelConfig;
use super::weights::{TensorSource, Weights};

pub struct LoadedModel {
    pub path: PathBuf,
    /// The model on the CPU (weights in the memory map); other backends upload from it.
    pub model: Arc<CpuModel>,
    /// The tokenizer, or why there is none (then only `--prompt-ids` works).
    tokenizer: std::result::Result<Tokenizer, String>,
    /// Bytes of weights in the memory map(s).
    pub weight_bytes: usize,
    /// The sampling the model's files recommend.
    pub sampling: SamplingDefaults,
    /// The grammar engine over this tokenizer, built on first use (constrained decoding).
    constrainer: std::sync::OnceLock<std::result::Result<crate::engine::Constrainer, String>>,
}

pub fn load(path: &Path) -> Result<LoadedModel> {
    load_with(path, true)
}

/// [`load`], optionally skipping the tokenizer (benchmarks need none, and a large vocabulary's
/// tables would count against their peak memory).
pub fn load_with(path: &Path, tokenizer: bool) -> Result<LoadedModel> {
    if !path.exists() {
        bail!("no such model file or folder: {}", path.display());
    }
    if path.is_dir() {
        if path.join("config.json").exists() {
            return load_hf(path, tokenizer);
        }
        let ggufs: Vec<PathBuf> = std::fs::read_dir(path)
            .with_context(|| format!("cannot read {}", path.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
            .collect();
        // The parts of one split GGUF name one model: its first part.
        let first_parts: Vec<&PathBuf> = ggufs
            .iter()
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.contains("-00001-of-"))
            })
            .collect();
        if let [first] = first_parts.as_slice() {
            let stem = first
                .to_string_lossy()
                .split("-00001-of-")
                .next()
                .unwrap_or("")
                .to_string();
            if ggufs.iter().all(|p| p.to_string_lossy().starts_with(&stem)) {
                return load_gguf(first, tokenizer);
            }
        }
        return match ggufs.as_slice() {
            [one] => load_gguf(one, tokenizer),
            [] => bail!("{}: neither a config.json nor a .gguf file", path.display()),
            _ => bail!("{}: holds several .gguf files; name one", path.display()),
        };
    }
    load_gguf(path, tokenizer)
}

const SKIPPED: &str = "not loaded";

fn load_gguf(path: &Path, with_tokenizer: bool) -> Result<LoadedModel> {
    let g = Gguf::open(path)?;
    let cfg = ModelConfig::from_gguf(&g).with_context(|| path.display().to_string())?;
    // A vocabulary larger than the embedding has tokens the model cannot embed (and would size
    // the tokenizer's tables beyond what the weights justify).
    let n_tokens = g
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.as_array())
        .map(|a| a.len());
    let tokenizer = match (with_tokenizer, n_tokens) {
        (false, _) => Err(SKIPPED.to_string()),
        (true, Some(n)) if n > cfg.vocab => Err(format!(
            "tokenizer.ggml.tokens has {n} tokens for a vocabulary of {}",
            cfg.vocab
        )),
        (true, _) => Tokenizer::from_gguf(&g).map_err(|e| e.to_string()),
    };
    let sampling = SamplingDefaults::from_gguf(&g);
    let src = TensorSource::Gguf(g);
    let weights = Weights::load(&src, &cfg).with_context(|| path.display().to_string())?;
    let weight_bytes = match &src {
        TensorSource::Gguf(g) => g.mapped_bytes(),
        TensorSource::SafeTensors(_) => 0,
    };
    Ok(LoadedModel {
        path: path.to_path_buf(),
        model: Arc::new(CpuModel::new(cfg, weights)),
        tokenizer,
        weight_bytes,
        sampling,
        constrainer: Default::default(),
    })
}

fn load_hf(dir: &Path, with_tokenizer: bool) -> Result<LoadedModel> {
    let config = trellm_formats::hf::read_config(dir)?;
    let generation = trellm_formats::hf::read_json(&dir.join("generation_config.json"))?;
    let cfg = ModelConfig::from_hf(&config, generation.as_ref())
        .with_context(|| dir.display().to_string())?;
    let sampling = generation
        .as_ref()
        .map(SamplingDefaults::from_hf)
        .unwrap_or_default();
    let st = SafeTensors::open(dir)?;
    let weight_bytes = st.shards.iter().map(|(_, m)| m.len()).sum();
    let src = TensorSource::SafeTensors(st);
    let weights = Weights::load(&src, &cfg).with_context(|| dir.display().to_string())?;
    let tokenizer = if !with_tokenizer {
        Err(SKIPPED.to_string())
    } else if dir.join("tokenizer.json").exists() {
        Tokenizer::from_hf_dir(dir).map_err(|e| e.to_string())
    } else {
        Err("the folder has no tokenizer.json".to_string())
    };
    Ok(LoadedModel {
        path: dir.to_path_buf(),
        model: Arc::new(CpuModel::new(cfg, weights)),
        tokenizer,
        weight_bytes,
        sampling,
        constrainer: Default::default(),
    })
}

impl LoadedModel {
    /// An engine serving this model on `device`: the CPU model is shared; a GPU gets a copy of
    /// the weights, uploaded now (each rank its shard, with `opts.tensor_parallel` ranks).
    pub fn engine(&self, device: Device, opts: EngineOptions) -> Result<Engine<'_>> {
        let tok = self.tokenizer.as_ref().ok();
        Ok(match device {
            Device::Cpu if opts.tensor_parallel > 1 => {
                let m = &self.model;
                let sharded = ShardedCpu::new(m, opts.tensor_parallel)?;
                Engine::new(Arc::new(sharded), tok, opts)?
            }
            Device::Cpu => Engine::new(self.model.clone(), tok, opts)?,
            Device::Cuda => self.cuda_engine(tok, opts)?,
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_engine<'t>(
        &'t self,
        tok: Option<&'t Tokenizer>,
        opts: EngineOptions,
    ) -> Result<Engine<'t>> {
        let positions = opts.kv_blocks * crate::backend::BLOCK_SIZE;
        let model =
            crate::backend::cuda::CudaModel::new(&self.model, positions, opts.tensor_parallel)?;
        Ok(Engine::new(Arc::new(model), tok, opts)?)
    }

    #[cfg(not(feature = "cuda"))]
    fn cuda_engine<'t>(&'t self, _: Option<&'t Tokenizer>, _: EngineOptions) -> Result<Engine<'t>> {
        bail!("--device cuda: this trellm was built without the cuda feature")
    }

    /// Token ids of a chat rendered through the model's template (with the generation prompt).
    pub fn chat_prompt(&self, messages: &[trellm_tokenizer::ChatMessage]) -> Result<Vec<u32>> {
        let tok = self.tokenizer()?;
        Ok(tok.encode(&tok.apply_chat_template(messages, true)?, false)?)
    }

    /// The tokenizer, or an error saying why there is none.
    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer.as_ref().map_err(|why| {
            anyhow!(
                "{}: no usable tokenizer ({why}); pass --prompt-ids",
                self.path.display()
            )
        })
    }

    /// The grammar engine for this model's tokenizer (built once, on first call: about a
    /// second for a 50k vocabulary).
    pub fn constrainer(&self) -> Result<&crate::engine::Constrainer> {
        self.constrainer
            .get_or_init(|| {
                let tok = self.tokenizer().map_err(|e| e.to_string())?;
                crate::engine::Constrainer::new(tok, self.model.cfg.vocab, &self.eos_ids())
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| anyhow!("constrained decoding is unavailable: {e}"))
    }

    pub fn has_tokenizer(&self) -> bool {
        self.tokenizer.is_ok()
    }

    /// Token ids that end generation: the tokenizer's set where there is one, else the config's.
    pub fn eos_ids(&self) -> Vec<u32> {
        let mut ids = self.model.cfg.eos_ids.clone();
        if let Ok(t) = &self.tokenizer {
            for &id in t.eos_ids() {
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
        }
        ids
    }
}
