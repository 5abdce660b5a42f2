//! Cache plumbing shared by the pip and Hugging Face fetchers: locks,
//! hashing, "verified" markers and atomic file placement.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use anyhow::{anyhow, Context, Result};
use fs4::fs_std::FileExt;
use indicatif::ProgressBar;
use sha2::{Digest, Sha256};
use tempfile::NamedTempFile;

use crate::progress::Reporter;

/// Prefix of in-flight files and folders; anything with it is garbage once
/// we hold the lock, because only the lock holder writes them.
pub(crate) const PARTIAL_PREFIX: &str = ".partial-";
pub(crate) const DOWNLOAD_PREFIX: &str = ".download-";

const COPY_BUF: usize = 1 << 20;

/// An exclusive lock held until dropped (the OS releases it with the fd,
/// also when the process dies, so a crash never leaves a stuck lock).
pub(crate) struct Lock {
    _file: File,
}

pub(crate) fn lock_exclusive(path: &Path, rep: &Reporter, what: &str) -> Result<Lock> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("cannot open lock file {}", path.display()))?;
    // Try first so we can tell the user why we are waiting.
    match FileExt::try_lock_exclusive(&file) {
        Ok(true) => {}
        Ok(false) => {
            rep.note(&format!(
                "waiting for another trellm process to finish pulling {what}"
            ));
            FileExt::lock_exclusive(&file)
                .with_context(|| format!("cannot lock {}", path.display()))?;
        }
        Err(e) => return Err(anyhow!("cannot lock {}: {e}", path.display())),
    }
    Ok(Lock { _file: file })
}

/// Removes leftovers of interrupted pulls in `dir`. Call only under the lock.
pub(crate) fn remove_stale(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(PARTIAL_PREFIX) || name.starts_with(DOWNLOAD_PREFIX) {
            let p = entry.path();
            // Best effort: a leftover we cannot delete only wastes space.
            let _ = if p.is_dir() {
                fs::remove_dir_all(&p)
            } else {
                fs::remove_file(&p)
            };
        }
    }
}

pub(crate) fn to_hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Copies `src` into `dst`, hashing what passes and advancing `pb`.
/// Returns the number of bytes copied.
pub(crate) fn copy_hashing(
    src: &mut dyn Read,
    dst: &mut dyn Write,
    hasher: &mut Sha256,
    pb: &ProgressBar,
) -> io::Result<u64> {
    let mut buf = vec![0u8; COPY_BUF];
    let mut total = 0u64;
    loop {
        let n = match src.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
        dst.write_all(&buf[..n])?;
        total += n as u64;
        pb.inc(n as u64);
    }
}

pub(crate) fn sha256_file(path: &Path, rep: &Reporter) -> Result<String> {
    let mut f = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let len = f.metadata().map(|m| m.len()).ok();
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    rep.phase(&format!("verifying sha256 of {name}"));
    let pb = rep.bytes(len, format!("verifying {name}"));
    let mut hasher = Sha256::new();
    copy_hashing(&mut f, &mut io::sink(), &mut hasher, &pb)
        .with_context(|| format!("cannot read {}", path.display()))?;
    pb.finish_and_clear();
    Ok(to_hex(&hasher.finalize()))
}

/// A temp file next to its final place, so the final rename is atomic.
/// Dropping it without `persist` deletes it.
pub(crate) fn partial_file_in(dir: &Path) -> Result<NamedTempFile> {
    let mut builder = tempfile::Builder::new();
    builder.prefix(PARTIAL_PREFIX);
    // tempfile defaults to 0600; a cache shared between users needs 0644 (umask applies).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(fs::Permissions::from_mode(0o644));
    }
    builder
        .tempfile_in(dir)
        .with_context(|| format!("cannot create a temporary file in {}", dir.display()))
}

pub(crate) fn buffered(f: &mut File) -> BufWriter<&mut File> {
    BufWriter::with_capacity(COPY_BUF, f)
}

/// Flushes to disk and atomically moves `tmp` to `dest`.
pub(crate) fn persist(tmp: NamedTempFile, dest: &Path) -> Result<()> {
    tmp.as_file()
        .sync_all()
        .with_context(|| format!("cannot write {}", dest.display()))?;
    tmp.persist(dest).map_err(|e| {
        anyhow!(
            "cannot move the downloaded file to {}: {}",
            dest.display(),
            e.error
        )
    })?;
    Ok(())
}

/// Writes `contents` to `dest` atomically (temp file + rename).
pub(crate) fn write_atomic(dest: &Path, contents: &[u8]) -> Result<()> {
    let dir = dest.parent().unwrap_or(Path::new("."));
    let mut tmp = partial_file_in(dir)?;
    tmp.write_all(contents)
        .with_context(|| format!("cannot write {}", dest.display()))?;
    persist(tmp, dest)
}

// --- "verified" markers -----------------------------------------------------
//
// Hashing 250 MB on every run is too slow, so after a successful check we
// record the sha together with the file's size and mtime. Any change to the
// file (size or mtime) invalidates the marker and forces a re-hash.

pub(crate) fn marker_path(file: &Path) -> PathBuf {
    let mut name = file.file_name().unwrap_or_default().to_os_string();
    name.push(".verified");
    file.with_file_name(name)
}

fn fingerprint(file: &Path) -> Option<(u64, u128)> {
    let meta = fs::metadata(file).ok()?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    Some((meta.len(), mtime))
}

/// True when `file` exists and a marker says it was verified against `sha256`
/// and it has not changed since.
pub(crate) fn marker_ok(file: &Path, sha256: &str, size: u64) -> bool {
    let Some((len, mtime)) = fingerprint(file) else {
        return false;
    };
    if len != size {
        return false;
    }
    let Ok(text) = fs::read_to_string(marker_path(file)) else {
        return false;
    };
    text == marker_text(sha256, len, mtime)
}

pub(crate) fn write_marker(file: &Path, sha256: &str) -> Result<()> {
    let (len, mtime) =
        fingerprint(file).ok_or_else(|| anyhow!("{} vanished after download", file.display()))?;
    write_atomic(
        &marker_path(file),
        marker_text(sha256, len, mtime).as_bytes(),
    )
}

pub(crate) fn remove_with_marker(file: &Path) {
    // Best effort: a missing file is the goal anyway.
    let _ = fs::remove_file(marker_path(file));
    let _ = fs::remove_file(file);
}

fn marker_text(sha256: &str, len: u64, mtime: u128) -> String {
    format!("sha256={sha256}\nsize={len}\nmtime_ns={mtime}\n")
}
