//! Opening a model from a path: a GGUF file, a folder holding one, or a Hugging Face folder.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use trellm_formats::gguf::Gguf;
use trellm_formats::safetensors::SafeTensors;
use trellm_tokenizer::Tokenizer;

use super::config::ModelConfig;
use super::decoder::Decoder;
use super::weights::{TensorSource, Weights};

pub struct LoadedModel {
    pub path: PathBuf,
    pub decoder: Decoder,
    /// The tokenizer, or why there is none (then only `--prompt-ids` works).
    tokenizer: std::result::Result<Tokenizer, String>,
    /// Bytes of weights in the memory map(s).
    pub weight_bytes: usize,
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
    let src = TensorSource::Gguf(g);
    let weights = Weights::load(&src, &cfg).with_context(|| path.display().to_string())?;
    let weight_bytes = match &src {
        TensorSource::Gguf(g) => g.map().len(),
        TensorSource::SafeTensors(_) => 0,
    };
    Ok(LoadedModel {
        path: path.to_path_buf(),
        decoder: Decoder::new(cfg, weights),
        tokenizer,
        weight_bytes,
    })
}

fn load_hf(dir: &Path, with_tokenizer: bool) -> Result<LoadedModel> {
    let config = trellm_formats::hf::read_config(dir)?;
    let generation = trellm_formats::hf::read_json(&dir.join("generation_config.json"))?;
    let cfg = ModelConfig::from_hf(&config, generation.as_ref())
        .with_context(|| dir.display().to_string())?;
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
        decoder: Decoder::new(cfg, weights),
        tokenizer,
        weight_bytes,
    })
}

impl LoadedModel {
    /// The tokenizer, or an error saying why there is none.
    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer.as_ref().map_err(|why| {
            anyhow!(
                "{}: no usable tokenizer ({why}); pass --prompt-ids",
                self.path.display()
            )
        })
    }

    pub fn has_tokenizer(&self) -> bool {
        self.tokenizer.is_ok()
    }

    /// Token ids that end generation: the tokenizer's set where there is one, else the config's.
    pub fn eos_ids(&self) -> Vec<u32> {
        let mut ids = self.decoder.cfg.eos_ids.clone();
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
