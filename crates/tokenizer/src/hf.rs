//! Tokenizers from a Hugging Face folder, configured the way transformers (v5) loads them.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value as Json;

use crate::template::ChatTemplate;
use crate::{Backend, Tokenizer, TokenizerError};

const SPECIAL_NAMES: &[&str] = &[
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

fn read(path: &Path) -> Result<Vec<u8>, TokenizerError> {
    std::fs::read(path).map_err(|source| TokenizerError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// A JSON file that may be absent; present but unreadable or malformed is an error.
fn read_json_opt(path: &Path) -> Result<Option<Json>, TokenizerError> {
    if !path.exists() {
        return Ok(None);
    }
    let bytes = read(path)?;
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| TokenizerError::Json {
            path: path.display().to_string(),
            msg: e.to_string(),
        })
}

/// A special token given as `"<s>"` or as an AddedToken object `{"content": "<s>", ...}`.
fn token_string(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(m) => m.get("content").and_then(Json::as_str).map(str::to_string),
        _ => None,
    }
}

/// `eos_token_id` as an int or a list of ints.
fn id_list(v: Option<&Json>) -> Option<Vec<u32>> {
    match v? {
        Json::Number(n) => n.as_u64().map(|id| vec![id as u32]),
        Json::Array(a) => Some(
            a.iter()
                .filter_map(Json::as_u64)
                .map(|id| id as u32)
                .collect(),
        ),
        _ => None,
    }
}

/// Runs `f`, turning a panic inside it (in a dependency, on input it did not expect) into None
/// without the panic message on stderr.
fn without_panics<T>(f: impl FnOnce() -> T) -> Option<T> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).ok();
    std::panic::set_hook(hook);
    r
}

pub(crate) fn load(dir: &Path) -> Result<Tokenizer, TokenizerError> {
    let tj = dir.join("tokenizer.json");
    let bytes = read(&tj)?;
    let json_err = |msg: String| TokenizerError::Json {
        path: tj.display().to_string(),
        msg: trellm_formats::quote_max(&msg, 200),
    };
    // UTF-8 and JSON first: the tokenizers crate panics (instead of failing) on some malformed
    // files, e.g. a syntax error or invalid UTF-8 inside the decoder object.
    let text = std::str::from_utf8(&bytes).map_err(|e| json_err(format!("not UTF-8 text: {e}")))?;
    serde_json::from_str::<Json>(text).map_err(|e| json_err(e.to_string()))?;
    let tok = without_panics(|| <tokenizers::Tokenizer as std::str::FromStr>::from_str(text))
        .ok_or_else(|| json_err("the tokenizers library cannot read this file".into()))?
        .map_err(|e| json_err(e.to_string()))?;
    let cfg = read_json_opt(&dir.join("tokenizer_config.json"))?.unwrap_or(Json::Null);
    let legacy_map = read_json_opt(&dir.join("special_tokens_map.json"))?.unwrap_or(Json::Null);

    let mut specials = BTreeMap::new();
    for &name in SPECIAL_NAMES {
        if let Some(s) = cfg
            .get(name)
            .and_then(token_string)
            .or_else(|| legacy_map.get(name).and_then(token_string))
        {
            specials.insert(name.to_string(), s);
        }
    }
    let id_of = |name: &str| specials.get(name).and_then(|s| tok.token_to_id(s));
    let bos = id_of("bos_token");
    let eos = id_of("eos_token");

    // transformers rebuilds the post-processor from add_bos_token/add_eos_token when the config
    // sets either, or when tokenizer.json has none; otherwise tokenizer.json's is used.
    let add_bos_cfg = cfg.get("add_bos_token").and_then(Json::as_bool);
    let add_eos_cfg = cfg.get("add_eos_token").and_then(Json::as_bool);
    let explicit = cfg.get("add_bos_token").is_some() || cfg.get("add_eos_token").is_some();
    let post_process = !explicit && tok.get_post_processor().is_some();

    let byte_fallback = tok
        .get_decoder()
        .and_then(|d| serde_json::to_string(d).ok())
        .is_some_and(|s| s.contains("\"ByteFallback\""));

    // mlx-lm: generation_config's eos_token_id replaces config.json's; the tokenizer's EOS joins.
    let gen = read_json_opt(&dir.join("generation_config.json"))?.unwrap_or(Json::Null);
    let model_cfg = read_json_opt(&dir.join("config.json"))?.unwrap_or(Json::Null);
    let listed = id_list(gen.get("eos_token_id"))
        .or_else(|| id_list(model_cfg.get("eos_token_id")))
        .or_else(|| {
            id_list(
                model_cfg
                    .get("text_config")
                    .and_then(|t| t.get("eos_token_id")),
            )
        })
        .unwrap_or_default();
    let mut eos_ids = Vec::new();
    for id in eos.into_iter().chain(listed) {
        if !eos_ids.contains(&id) {
            eos_ids.push(id);
        }
    }

    let template = chat_template_source(dir, &cfg)?.map(|src| match src {
        Ok(src) => ChatTemplate::new(&src, specials.clone()),
        Err(msg) => ChatTemplate::broken(msg),
    });

    Ok(Tokenizer {
        backend: Backend::Hf {
            tok: Box::new(tok),
            byte_fallback,
            post_process,
        },
        bos,
        eos,
        eos_ids,
        add_bos: add_bos_cfg.unwrap_or(false),
        add_eos: add_eos_cfg.unwrap_or(false),
        template,
    })
}

/// The template source: `chat_template.jinja` wins over tokenizer_config's `chat_template`
/// (a string, or a list of named templates of which "default" is used), then
/// `chat_template.json`. `Some(Err)` is a template that exists but cannot be chosen.
fn chat_template_source(
    dir: &Path,
    cfg: &Json,
) -> Result<Option<Result<String, String>>, TokenizerError> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        let bytes = read(&jinja)?;
        return String::from_utf8(bytes)
            .map(|s| Some(Ok(s)))
            .map_err(|_| TokenizerError::Invalid(format!("{}: not UTF-8", jinja.display())));
    }
    let from_value = |v: &Json| -> Option<Result<String, String>> {
        match v {
            Json::String(s) => Some(Ok(s.clone())),
            Json::Array(list) => {
                let named = |want: &str| {
                    list.iter().find_map(|t| {
                        (t.get("name")?.as_str()? == want)
                            .then(|| t.get("template")?.as_str().map(str::to_string))?
                    })
                };
                Some(named("default").ok_or_else(|| {
                    let names: Vec<&str> = list
                        .iter()
                        .filter_map(|t| t.get("name").and_then(Json::as_str))
                        .collect();
                    format!(
                        "several chat templates and none is named \"default\" (found {names:?})"
                    )
                }))
            }
            _ => None,
        }
    };
    if let Some(t) = cfg.get("chat_template").and_then(from_value) {
        return Ok(Some(t));
    }
    let json = read_json_opt(&dir.join("chat_template.json"))?.unwrap_or(Json::Null);
    Ok(json.get("chat_template").and_then(from_value))
}
