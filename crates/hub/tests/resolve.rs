//! Resolution rules that need no download.

use std::fs;

use trellm_hub::{find_known, known_models, Hub};

#[test]
fn local_paths_resolve_to_themselves() {
    let home = tempfile::tempdir().unwrap();
    // A python that cannot run: nothing here may try to download.
    let hub = Hub::new(home.path()).with_python("/nonexistent");
    let file = home.path().join("my.gguf");
    fs::write(&file, b"GGUF").unwrap();
    let spec = file.to_str().unwrap();
    assert_eq!(hub.resolve(spec).unwrap(), file);
    let dir = home.path().join("owner").join("name");
    fs::create_dir_all(&dir).unwrap();
    assert_eq!(hub.resolve(dir.to_str().unwrap()).unwrap(), dir);

    let err = hub.pull(spec).unwrap_err().to_string();
    assert!(err.contains("is a local path"), "{err}");
}

#[test]
fn missing_local_path_is_not_sent_to_the_hub() {
    let home = tempfile::tempdir().unwrap();
    let hub = Hub::new(home.path()).with_hf_endpoint("http://127.0.0.1:9");
    for spec in ["./nope.gguf", "/no/such/model", "models/nope.gguf"] {
        let err = hub.resolve(spec).unwrap_err().to_string();
        assert_eq!(err, format!("no such file or folder: {spec}"));
    }
}

#[test]
fn unknown_model_lists_the_aliases() {
    let home = tempfile::tempdir().unwrap();
    let hub = Hub::new(home.path());
    for spec in ["no-such-alias", "a/b/c", "bad name"] {
        let err = format!("{:#}", hub.resolve(spec).unwrap_err());
        assert!(err.starts_with(&format!("unknown model `{spec}`")), "{err}");
        for m in known_models() {
            assert!(err.contains(m.alias), "{err}");
        }
        assert!(!err.contains('\n'), "{err}");
        let err = hub.pull(spec).unwrap_err().to_string();
        assert!(err.contains("smollm2-135m-instruct"), "{err}");
    }
    assert!(names_empty(&hub.models_dir()));
}

fn names_empty(dir: &std::path::Path) -> bool {
    fs::read_dir(dir)
        .map(|mut d| d.next().is_none())
        .unwrap_or(true)
}

#[test]
fn registry_is_consistent() {
    let models = known_models();
    assert!(models.len() >= 2);
    for (i, m) in models.iter().enumerate() {
        assert_eq!(m.sha256.len(), 64, "{}", m.alias);
        assert!(m
            .sha256
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert!(!m.parts.is_empty() && m.size > 0 && !m.description.contains('\n'));
        assert!(
            !m.alias.contains('/'),
            "aliases must not look like repo ids"
        );
        assert!(
            models[..i].iter().all(|o| o.alias != m.alias),
            "duplicate {}",
            m.alias
        );
        assert_eq!(find_known(m.alias), Some(m));
    }
    let gemma = find_known("gemma-3-270m").unwrap();
    let members: Vec<_> = gemma.parts.iter().map(|p| p.member).collect();
    let mut sorted = members.clone();
    sorted.sort();
    assert_eq!(members, sorted, "parts must be concatenated in order");
}
