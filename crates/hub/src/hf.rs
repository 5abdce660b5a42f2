//! Fetching models from the Hugging Face hub over HTTPS.
//!
//! Layout: `<models>/hf/<owner>--<name>/` holds the repo's files under their
//! own names, plus `.trellm-repo.json` recording which files are complete
//! and verified. Files are placed one by one with an atomic rename, so an
//! interrupted pull resumes at the first missing file.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::cache;
use crate::progress::Reporter;

pub(crate) const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
const META_FILE: &str = ".trellm-repo.json";
/// Per-read timeout: long enough for a slow CDN, short enough to not hang forever.
const READ_TIMEOUT: Duration = Duration::from_secs(60);

/// Files of a safetensors repo that the engine may use, besides the weights.
const SAFETENSORS_EXTRAS: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
];

/// Which quantisation to prefer when a GGUF repo offers several files.
const GGUF_PREFERENCE: &[&str] = &["q4_k_m", "q4_0", "q8_0"];

/// `owner/name`, optionally `owner/name:FILE` to pick one GGUF file.
#[derive(Debug, Clone)]
pub(crate) struct RepoSpec {
    pub id: String,
    pub owner: String,
    pub name: String,
    pub select: Option<String>,
}

pub(crate) fn parse_repo_spec(spec: &str) -> Option<RepoSpec> {
    let (id, select) = match spec.split_once(':') {
        Some((id, sel)) if !sel.is_empty() => (id, Some(sel.to_string())),
        Some(_) => return None,
        None => (spec, None),
    };
    let (owner, name) = id.split_once('/')?;
    let valid = |s: &str| {
        !s.is_empty()
            && s.len() <= 96
            && !s.starts_with(['.', '-'])
            && !s.contains("..")
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    if !valid(owner) || !valid(name) {
        return None;
    }
    Some(RepoSpec {
        id: id.to_string(),
        owner: owner.to_string(),
        name: name.to_string(),
        select,
    })
}

pub(crate) fn repo_dir(models_dir: &Path, spec: &RepoSpec) -> PathBuf {
    models_dir
        .join("hf")
        .join(format!("{}--{}", spec.owner, spec.name))
}

/// Settings for talking to the hub.
pub(crate) struct HubHttp<'a> {
    pub endpoint: &'a str,
    pub token: Option<&'a str>,
    pub connect_timeout: Duration,
}

// --- what is already on disk -------------------------------------------------

#[derive(Debug, Default)]
struct Meta {
    /// rfilename -> (size, sha256 if the hub gave one)
    files: BTreeMap<String, (u64, Option<String>)>,
    /// What a bare `owner/name` resolves to: "" for the folder, or a GGUF file.
    default: Option<String>,
}

fn read_meta(dir: &Path) -> Meta {
    let Ok(text) = fs::read_to_string(dir.join(META_FILE)) else {
        return Meta::default();
    };
    let Ok(v) = serde_json::from_str::<Value>(&text) else {
        return Meta::default();
    };
    let mut meta = Meta::default();
    if let Some(files) = v["files"].as_object() {
        for (name, f) in files {
            if let Some(size) = f["size"].as_u64() {
                let sha = f["sha256"].as_str().map(str::to_string);
                meta.files.insert(name.clone(), (size, sha));
            }
        }
    }
    meta.default = v["default"].as_str().map(str::to_string);
    meta
}

fn write_meta(dir: &Path, id: &str, meta: &Meta) -> Result<()> {
    let files: serde_json::Map<String, Value> = meta
        .files
        .iter()
        .map(|(k, (size, sha))| (k.clone(), json!({ "size": size, "sha256": sha })))
        .collect();
    let v = json!({ "repo": id, "files": files, "default": meta.default });
    let text = serde_json::to_vec_pretty(&v).expect("json of plain values");
    cache::write_atomic(&dir.join(META_FILE), &text)
}

/// A recorded file still on disk with its recorded size.
fn present(dir: &Path, meta: &Meta, name: &str) -> bool {
    meta.files
        .get(name)
        .is_some_and(|(size, _)| fs::metadata(dir.join(name)).is_ok_and(|m| m.len() == *size))
}

/// The cached result for `spec`, without touching the network.
pub(crate) fn cached(models_dir: &Path, spec: &RepoSpec) -> Option<PathBuf> {
    let dir = repo_dir(models_dir, spec);
    let meta = read_meta(&dir);
    if meta.files.is_empty() || !meta.files.keys().all(|n| present(&dir, &meta, n)) {
        return None;
    }
    let rel = match &spec.select {
        None => meta.default.clone()?,
        Some(sel) => {
            let ggufs: Vec<&str> = meta
                .files
                .keys()
                .map(String::as_str)
                .filter(|n| is_gguf(n))
                .collect();
            select_gguf(&ggufs, sel).ok()?.to_string()
        }
    };
    Some(if rel.is_empty() { dir } else { dir.join(rel) })
}

// --- pulling ---------------------------------------------------------------------

struct Sibling {
    name: String,
    size: Option<u64>,
    sha256: Option<String>,
}

pub(crate) fn pull(
    models_dir: &Path,
    http: &HubHttp,
    spec: &RepoSpec,
    rep: &Reporter,
) -> Result<PathBuf> {
    let dir = repo_dir(models_dir, spec);
    let lock_path = models_dir
        .join("hf")
        .join(format!("{}--{}.lock", spec.owner, spec.name));
    let _lock = cache::lock_exclusive(&lock_path, rep, &spec.id)?;
    if let Some(done) = cached(models_dir, spec) {
        return Ok(done);
    }

    let agent = ureq::AgentBuilder::new()
        .timeout_connect(http.connect_timeout)
        .timeout_read(READ_TIMEOUT)
        .try_proxy_from_env(true)
        .user_agent(concat!("trellm/", env!("CARGO_PKG_VERSION")))
        .build();
    let endpoint = http.endpoint.trim_end_matches('/');

    rep.phase(&format!(
        "listing files of {} on the Hugging Face hub",
        spec.id
    ));
    let api_url = format!(
        "{endpoint}/api/models/{}/{}?blobs=true",
        spec.owner, spec.name
    );
    let listing = get(&agent, &api_url, http.token, &spec.id, "its file list")?
        .into_string()
        .map_err(|e| {
            anyhow!(
                "cannot read the file list of {} from the Hugging Face hub: {e}",
                spec.id
            )
        })?;
    let siblings = parse_siblings(&listing).with_context(|| {
        format!(
            "unexpected answer from the Hugging Face hub for {}",
            spec.id
        )
    })?;
    let (wanted, result_rel) = choose_files(&spec.id, &siblings, spec.select.as_deref())?;

    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    cache::remove_stale(&dir);
    let mut meta = read_meta(&dir);
    // Drop records of files that vanished, so `cached` stays honest.
    let gone: Vec<String> = meta
        .files
        .keys()
        .filter(|n| !present(&dir, &meta, n))
        .cloned()
        .collect();
    for n in gone {
        meta.files.remove(&n);
    }

    for sib in wanted {
        let up_to_date = present(&dir, &meta, &sib.name)
            && meta.files.get(&sib.name).is_some_and(|(size, sha)| {
                sib.size.is_none_or(|s| s == *size) && (sib.sha256.is_none() || sha == &sib.sha256)
            });
        if up_to_date {
            continue;
        }
        let url = format!(
            "{endpoint}/{}/{}/resolve/main/{}",
            spec.owner,
            spec.name,
            encode_path(&sib.name)
        );
        let (size, sha) = download(&agent, &url, http.token, &dir, sib, &spec.id, rep)?;
        meta.files.insert(sib.name.clone(), (size, Some(sha)));
        // Record after each file so an interrupted pull resumes here.
        write_meta(&dir, &spec.id, &meta)?;
    }
    if spec.select.is_none() {
        meta.default = Some(result_rel.clone());
    }
    write_meta(&dir, &spec.id, &meta)?;
    let out = if result_rel.is_empty() {
        dir
    } else {
        dir.join(&result_rel)
    };
    rep.note(&format!("{} saved to {}", spec.id, out.display()));
    Ok(out)
}

/// GET with the token; errors become one-line messages about `what` of `id`.
fn get(
    agent: &ureq::Agent,
    url: &str,
    token: Option<&str>,
    id: &str,
    what: &str,
) -> Result<ureq::Response> {
    let mut req = agent.get(url);
    if let Some(t) = token {
        req = req.set("Authorization", &format!("Bearer {t}"));
    }
    req.call().map_err(|e| http_error(id, what, e))
}

fn http_error(id: &str, what: &str, e: ureq::Error) -> anyhow::Error {
    match e {
        ureq::Error::Status(code @ (401 | 403), _) => anyhow!(
            "the Hugging Face hub refused {what} of {id} (HTTP {code}): the repo does not exist, \
             or it is gated or private and needs HF_TOKEN"
        ),
        ureq::Error::Status(404, _) => {
            anyhow!("the Hugging Face hub has no {what} of {id} (HTTP 404)")
        }
        ureq::Error::Status(code, _) => {
            anyhow!("the Hugging Face hub answered HTTP {code} for {what} of {id}")
        }
        ureq::Error::Transport(t) => {
            let msg = t.to_string().replace(['\n', '\r'], " ");
            anyhow!("cannot reach the Hugging Face hub for {id}: {msg}")
        }
    }
}

fn parse_siblings(text: &str) -> Result<Vec<Sibling>> {
    let v: Value = serde_json::from_str(text).context("not JSON")?;
    let list = v["siblings"]
        .as_array()
        .ok_or_else(|| anyhow!("no `siblings` list"))?;
    let mut out = Vec::new();
    for s in list {
        let Some(name) = s["rfilename"].as_str() else {
            continue;
        };
        let lfs = &s["lfs"];
        out.push(Sibling {
            name: name.to_string(),
            size: s["size"].as_u64().or_else(|| lfs["size"].as_u64()),
            // Only LFS files carry a sha256; small git files have a sha1 blob id.
            sha256: lfs["sha256"].as_str().map(str::to_ascii_lowercase),
        });
    }
    Ok(out)
}

fn is_gguf(name: &str) -> bool {
    name.to_ascii_lowercase().ends_with(".gguf")
}

/// Picks the files to download and what the pull returns ("" = the folder).
fn choose_files<'a>(
    id: &str,
    siblings: &'a [Sibling],
    select: Option<&str>,
) -> Result<(Vec<&'a Sibling>, String)> {
    let ggufs: Vec<&str> = siblings
        .iter()
        .map(|s| s.name.as_str())
        .filter(|n| is_gguf(n))
        .collect();
    let by_name = |n: &str| siblings.iter().find(|s| s.name == n);

    if let Some(sel) = select {
        if ggufs.is_empty() {
            bail!("{id} has no GGUF file, so `:{sel}` cannot select one");
        }
        let name = select_gguf(&ggufs, sel).map_err(|e| anyhow!("{id}: {e}"))?;
        return Ok((vec![by_name(name).expect("listed")], name.to_string()));
    }

    let weights: Vec<&Sibling> = siblings
        .iter()
        .filter(|s| !s.name.contains('/') && s.name.ends_with(".safetensors"))
        .collect();
    if !weights.is_empty() {
        if by_name("config.json").is_none() {
            bail!("{id} has safetensors weights but no config.json");
        }
        let mut files: Vec<&Sibling> = SAFETENSORS_EXTRAS
            .iter()
            .filter_map(|n| by_name(n))
            .collect();
        files.extend(weights);
        return Ok((files, String::new()));
    }

    match ggufs.as_slice() {
        [] => bail!("{id} has neither safetensors weights nor a GGUF file"),
        [one] => Ok((vec![by_name(one).expect("listed")], one.to_string())),
        many => {
            let preferred = GGUF_PREFERENCE.iter().find_map(|q| {
                let mut hits: Vec<&str> = many
                    .iter()
                    .copied()
                    .filter(|n| n.to_ascii_lowercase().contains(q))
                    .collect();
                hits.sort();
                hits.first().copied()
            });
            match preferred {
                Some(n) => Ok((vec![by_name(n).expect("listed")], n.to_string())),
                None => bail!(
                    "{id} has {} GGUF files; pick one with {id}:FILE (one of: {})",
                    many.len(),
                    short_list(many)
                ),
            }
        }
    }
}

/// `sel` is an exact file name, or a case-insensitive part of exactly one name.
fn select_gguf<'a>(ggufs: &[&'a str], sel: &str) -> Result<&'a str> {
    if let Some(exact) = ggufs
        .iter()
        .find(|n| **n == sel || Path::new(n).file_name().is_some_and(|f| f == sel))
    {
        return Ok(exact);
    }
    let needle = sel.to_ascii_lowercase();
    let hits: Vec<&str> = ggufs
        .iter()
        .copied()
        .filter(|n| n.to_ascii_lowercase().contains(&needle))
        .collect();
    match hits.as_slice() {
        [one] => Ok(one),
        [] => bail!(
            "no GGUF file matches `{sel}` (files: {})",
            short_list(ggufs)
        ),
        many => bail!("`{sel}` matches several GGUF files: {}", short_list(many)),
    }
}

fn short_list(names: &[&str]) -> String {
    const MAX: usize = 12;
    let mut s = names
        .iter()
        .take(MAX)
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > MAX {
        s.push_str(&format!(", … ({} more)", names.len() - MAX));
    }
    s
}

/// Percent-encodes a repo file path for a URL, keeping the `/` separators.
fn encode_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for b in path.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn download(
    agent: &ureq::Agent,
    url: &str,
    token: Option<&str>,
    dir: &Path,
    sib: &Sibling,
    id: &str,
    rep: &Reporter,
) -> Result<(u64, String)> {
    // The name comes from the server: never let it escape the repo folder.
    let rel = Path::new(&sib.name);
    if !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        bail!("{id} lists a file with an unsafe name: {}", sib.name);
    }
    let dest = dir.join(rel);
    let parent = dest.parent().expect("joined path has a parent");
    fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;

    rep.phase(&format!("downloading {} from {id}", sib.name));
    let resp = get(agent, url, token, id, &sib.name)?;
    let total = resp
        .header("content-length")
        .and_then(|v| v.parse::<u64>().ok())
        .or(sib.size);
    let mut tmp = cache::partial_file_in(parent)?;
    let pb = rep.bytes(total, sib.name.clone());
    let mut hasher = Sha256::new();
    let written = {
        let mut out = cache::buffered(tmp.as_file_mut());
        let n = cache::copy_hashing(&mut resp.into_reader(), &mut out, &mut hasher, &pb)
            .map_err(|e| anyhow!("download of {} from {id} failed: {e}", sib.name))?;
        out.flush()
            .with_context(|| format!("cannot write into {}", parent.display()))?;
        n
    };
    pb.finish_and_clear();

    let actual = cache::to_hex(&hasher.finalize());
    if let Some(size) = sib.size {
        if written != size {
            bail!(
                "download of {} from {id} is incomplete: got {written} of {size} bytes",
                sib.name
            );
        }
    }
    if let Some(expected) = &sib.sha256 {
        if &actual != expected {
            bail!(
                "sha256 mismatch for {id}/{}: expected {expected}, got {actual}",
                sib.name
            );
        }
    }
    cache::persist(tmp, &dest)?;
    Ok((written, actual))
}
