//! The environment-reading wrappers. One test only: env vars are process-wide.

use trellm_hub::{resolve_model_in, trellm_home};

#[test]
fn env_vars_are_honoured() {
    let home = tempfile::tempdir().unwrap();
    std::env::set_var("TRELLM_HOME", home.path());
    assert_eq!(trellm_home(), home.path());
    std::env::remove_var("TRELLM_HOME");
    assert!(trellm_home().ends_with("trellm"));

    std::env::set_var("TRELLM_PYTHON", "/nonexistent/python3");
    let err = resolve_model_in(home.path(), "smollm2-135m-instruct", false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("/nonexistent/python3"), "{err}");
    std::env::remove_var("TRELLM_PYTHON");
}
