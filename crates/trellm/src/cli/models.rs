//! The cache and model commands: `list`, `rm`, `info`, `completions`.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{anyhow, Context, Result};
use clap::{Args, CommandFactory};
use trellm_formats::gguf::Gguf;
use trellm_formats::safetensors::SafeTensors;

use super::output;
use crate::model::ModelConfig;

#[derive(Args, Debug)]
pub struct ListArgs {
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct RmArgs {
    /// Alias or Hugging Face repo id, as given to `pull`.
    pub model: String,
}

#[derive(Args, Debug)]
pub struct InfoArgs {
    /// A GGUF file, a model folder, a known alias or a Hugging Face repo id.
    pub model: String,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct CompletionsArgs {
    /// bash, zsh, fish, elvish or powershell.
    pub shell: clap_complete::Shell,
}

/// A load failure of a model in trellm's cache says how to fetch it again.
pub fn cached_hint(e: anyhow::Error, spec: &str, path: &Path) -> anyhow::Error {
    let home = trellm_hub::trellm_home();
    let cached = path.starts_with(home.join("models"))
        || (path.canonicalize().ok())
            .zip(home.join("models").canonicalize().ok())
            .is_some_and(|(p, h)| p.starts_with(h));
    if !cached {
        return e;
    }
    e.context(format!(
        "the cached copy of {} does not load (`trellm rm {0}` then `trellm pull {0}` fetches it again)",
        trellm_formats::quote(spec)
    ))
}

fn human(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.0} MiB", b as f64 / (1u64 << 20) as f64),
        b => format!("{:.0} KiB", b as f64 / 1024.0),
    }
}

pub fn list(a: ListArgs) -> Result<()> {
    let hub = trellm_hub::Hub::from_env();
    let cached = hub.cached_models();
    if a.json {
        let known: Vec<_> = trellm_hub::known_models()
            .iter()
            .map(|m| {
                serde_json::json!({
                    "alias": m.alias,
                    "description": m.description,
                    "bytes": m.size,
                    "cached": cached.iter().any(|c| c.name == m.alias),
                })
            })
            .collect();
        let cached: Vec<_> = cached
            .iter()
            .map(|c| {
                serde_json::json!({
                    "name": c.name, "path": c.path.display().to_string(), "bytes": c.bytes,
                })
            })
            .collect();
        let obj = serde_json::json!({
            "home": hub.home().display().to_string(),
            "known": known,
            "cached": cached,
        });
        output::print(&format!("{obj}\n"))?;
        return Ok(());
    }
    let mut s = format!("cache: {}\n", hub.models_dir().display());
    s.push_str("cached:\n");
    if cached.is_empty() {
        s.push_str("  (none)\n");
    }
    for c in &cached {
        s.push_str(&format!(
            "  {:<32} {:>10}  {}\n",
            c.name,
            human(c.bytes),
            c.path.display()
        ));
    }
    s.push_str("known (trellm pull ALIAS):\n");
    for m in trellm_hub::known_models() {
        s.push_str(&format!("  {:<32} {}\n", m.alias, m.description));
    }
    output::print(&s)?;
    Ok(())
}

pub fn rm(a: RmArgs) -> Result<()> {
    let dir = trellm_hub::Hub::from_env().remove(&a.model)?;
    eprintln!("trellm: removed {}", dir.display());
    Ok(())
}

pub fn completions(a: CompletionsArgs) -> Result<()> {
    let mut buf = Vec::new();
    clap_complete::generate(a.shell, &mut super::Cli::command(), "trellm", &mut buf);
    output::print(&String::from_utf8_lossy(&buf))?;
    Ok(())
}

/// What `info` reports.
#[derive(Default)]
struct Info {
    format: &'static str,
    architecture: Option<String>,
    name: Option<String>,
    parameters: u64,
    /// Tensor type -> (tensors, bytes).
    types: BTreeMap<String, (usize, u64)>,
    context_length: Option<u64>,
    chat_template: Option<String>,
    config: Option<ModelConfig>,
    /// Why trellm cannot run it, if it cannot.
    unsupported: Option<String>,
}

fn gguf_info(path: &Path) -> Result<Info> {
    let g = Gguf::open(path)?;
    let mut info = Info {
        format: "GGUF",
        architecture: g.architecture().map(str::to_string),
        name: g.get_str("general.name").map(str::to_string),
        chat_template: g.get_str("tokenizer.chat_template").map(str::to_string),
        ..Info::default()
    };
    for t in &g.tensors {
        info.parameters += t.n_elements();
        let e = info.types.entry(t.ty.name().to_string()).or_default();
        e.0 += 1;
        e.1 += t.n_bytes as u64;
    }
    if let Some(arch) = g.architecture() {
        info.context_length = g.get_u64(&format!("{arch}.context_length"));
    }
    match ModelConfig::from_gguf(&g) {
        Ok(c) => info.config = Some(c),
        Err(e) => info.unsupported = Some(format!("{e:#}")),
    }
    Ok(info)
}

fn hf_info(dir: &Path) -> Result<Info> {
    let config = trellm_formats::hf::read_config(dir)?;
    let text = config.get("text_config").filter(|t| t.is_object());
    let field = |k: &str| {
        text.and_then(|t| t.get(k))
            .or_else(|| config.get(k))
            .cloned()
    };
    let mut info = Info {
        format: "safetensors",
        architecture: field("model_type").and_then(|v| v.as_str().map(str::to_string)),
        name: field("_name_or_path").and_then(|v| v.as_str().map(str::to_string)),
        context_length: field("max_position_embeddings").and_then(|v| v.as_u64()),
        ..Info::default()
    };
    let st = SafeTensors::open(dir)?;
    for t in st.tensors.values() {
        let n: u64 = t.shape.iter().map(|&d| d as u64).product();
        info.parameters += n;
        let e = info.types.entry(t.dtype_name.clone()).or_default();
        e.0 += 1;
        e.1 += (t.end - t.start) as u64;
    }
    if let Ok(Some(tc)) = trellm_formats::hf::read_json(&dir.join("tokenizer_config.json")) {
        info.chat_template = match tc.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
            _ => None,
        };
    }
    if info.chat_template.is_none() {
        info.chat_template = std::fs::read_to_string(dir.join("chat_template.jinja")).ok();
    }
    let generation = trellm_formats::hf::read_json(&dir.join("generation_config.json"))?;
    match ModelConfig::from_hf(&config, generation.as_ref()) {
        Ok(c) => info.config = Some(c),
        Err(e) => info.unsupported = Some(format!("{e:#}")),
    }
    Ok(info)
}

/// Text from a file, shown on a terminal: control characters other than newlines and tabs
/// escaped.
fn printable(s: &str) -> String {
    s.chars()
        .flat_map(|c| match c {
            '\n' | '\t' => vec![c],
            c if c.is_control() => c.escape_default().collect(),
            c => vec![c],
        })
        .collect()
}

pub fn info(a: InfoArgs) -> Result<()> {
    let path = trellm_hub::resolve_model(&a.model, true)?;
    let gguf_in_dir = || -> Option<std::path::PathBuf> {
        let mut v: Vec<_> = std::fs::read_dir(&path)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
            .collect();
        (v.len() == 1).then(|| v.remove(0))
    };
    let info = if path.is_dir() && path.join("config.json").exists() {
        hf_info(&path)
    } else if path.is_dir() {
        let one = gguf_in_dir().ok_or_else(|| {
            anyhow!(
                "{}: neither a config.json nor one .gguf file",
                path.display()
            )
        })?;
        gguf_info(&one)
    } else {
        gguf_info(&path)
    }
    .with_context(|| path.display().to_string())?;
    let cfg = info.config.as_ref();
    let context = cfg
        .map(|c| c.max_context as u64)
        .filter(|&c| c != usize::MAX as u64)
        .or(info.context_length);
    if a.json {
        let types: serde_json::Map<String, serde_json::Value> = info
            .types
            .iter()
            .map(|(k, (n, b))| (k.clone(), serde_json::json!({"tensors": n, "bytes": b})))
            .collect();
        let obj = serde_json::json!({
            "path": path.display().to_string(),
            "format": info.format,
            "architecture": info.architecture,
            "name": info.name,
            "parameters": info.parameters,
            "tensor_types": types,
            "context_length": context,
            "layers": cfg.map(|c| c.n_layers()),
            "hidden_size": cfg.map(|c| c.hidden),
            "attention_heads": cfg.map(|c| c.n_heads),
            "kv_heads": cfg.map(|c| c.n_kv_heads),
            "head_dim": cfg.map(|c| c.head_dim),
            "vocab_size": cfg.map(|c| c.vocab),
            "chat_template": info.chat_template,
            "supported": info.unsupported.is_none(),
            "unsupported_reason": info.unsupported,
        });
        output::print(&format!("{obj}\n"))?;
        return Ok(());
    }
    let q = |s: &Option<String>| s.as_deref().map_or("-".to_string(), trellm_formats::quote);
    let mut s = String::new();
    s.push_str(&format!("path           {}\n", path.display()));
    s.push_str(&format!("format         {}\n", info.format));
    s.push_str(&format!("architecture   {}\n", q(&info.architecture)));
    if info.name.is_some() {
        s.push_str(&format!("name           {}\n", q(&info.name)));
    }
    let p = info.parameters as f64;
    let params = if p >= 1e9 {
        format!("{:.2}B", p / 1e9)
    } else {
        format!("{:.1}M", p / 1e6)
    };
    s.push_str(&format!("parameters     {params} ({})\n", info.parameters));
    let types: Vec<String> = info
        .types
        .iter()
        .map(|(k, (n, b))| format!("{k} x{n} ({})", human(*b)))
        .collect();
    s.push_str(&format!("tensor types   {}\n", types.join(", ")));
    match context {
        Some(c) => s.push_str(&format!("context length {c}\n")),
        None => s.push_str("context length (not set)\n"),
    }
    if let Some(c) = cfg {
        s.push_str(&format!(
            "layers         {}  hidden {}  heads {} (kv {})  head dim {}  vocabulary {}\n",
            c.n_layers(),
            c.hidden,
            c.n_heads,
            c.n_kv_heads,
            c.head_dim,
            c.vocab
        ));
    }
    if let Some(why) = &info.unsupported {
        s.push_str(&format!(
            "runs           no: {}\n",
            trellm_formats::quote_max(why, 300)
        ));
    }
    match &info.chat_template {
        Some(t) => s.push_str(&format!("chat template\n{}\n", printable(t))),
        None => s.push_str("chat template  (none)\n"),
    }
    output::print(&s)?;
    Ok(())
}
