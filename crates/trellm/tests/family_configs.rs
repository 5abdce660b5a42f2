//! Family specs read from config.json: the supported `model_type`s, clear errors for the rest,
//! and errors that name the field a family needs when a config lacks it.

use serde_json::{json, Value};
use trellm::model::config::{Activation, Family, QkNorm};
use trellm::model::families::SUPPORTED_FAMILIES;
use trellm::model::ModelConfig;

fn fixture_config(name: &str) -> Value {
    let p = format!(
        "{}/../../tests/fixtures/tiny/{name}/config.json",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn err(c: &Value) -> String {
    format!("{:#}", ModelConfig::from_hf(c, None).unwrap_err())
}

#[test]
fn unsupported_model_type_lists_the_supported_ones() {
    let mut c = fixture_config("llama");
    c["model_type"] = json!("mamba2");
    let e = err(&c);
    assert!(e.contains("unsupported model_type 'mamba2'"), "{e}");
    for f in SUPPORTED_FAMILIES {
        assert!(e.contains(f), "{e} does not list {f}");
    }
}

#[test]
fn missing_fields_are_named() {
    for (fixture, field) in [
        ("llama", "rms_norm_eps"),
        ("llama", "hidden_size"),
        ("qwen3", "head_dim"),
        ("qwen3", "tie_word_embeddings"),
        ("qwen3", "rope_theta"),
        ("qwen2", "num_key_value_heads"),
        ("gemma", "head_dim"),
        ("granite", "logits_scaling"),
        ("granite", "attention_multiplier"),
        ("granite", "residual_multiplier"),
        ("granite", "embedding_multiplier"),
        ("starcoder2", "intermediate_size"),
        ("phi3", "vocab_size"),
    ] {
        let mut c = fixture_config(fixture);
        c.as_object_mut().unwrap().remove(field);
        let e = err(&c);
        assert!(e.contains(field), "{fixture} without {field}: {e}");
    }
    // A rope_scaling type's own fields.
    let mut c = fixture_config("llama-rope-llama3");
    c["rope_scaling"].as_object_mut().unwrap().remove("factor");
    assert!(err(&c).contains("factor"), "{}", err(&c));
    let mut c = fixture_config("phi3");
    c["rope_scaling"]
        .as_object_mut()
        .unwrap()
        .remove("long_factor");
    assert!(err(&c).contains("long_factor"), "{}", err(&c));
}

#[test]
fn families_set_their_switches() {
    let get = |n: &str| ModelConfig::from_hf(&fixture_config(n), None).unwrap();
    let c = get("mistral");
    assert_eq!(c.family, Family::Llama);
    assert!(!c.tied_embeddings && c.head_dim == 32);
    let c = get("qwen2");
    assert!(c.qkv_bias && !c.o_bias);
    assert_eq!(get("qwen3").qk_norm, QkNorm::PerHead);
    let c = get("olmo2");
    assert!(!c.pre_norms && c.post_norms && c.qk_norm == QkNorm::Whole);
    let c = get("gemma2");
    assert!(c.attn_softcap.is_some() && c.final_softcap.is_some() && c.post_norms);
    assert_eq!(get("gemma").activation, Activation::Gelu);
    let c = get("smollm3");
    let nope: Vec<bool> = c.layers.iter().map(|l| l.rope.is_none()).collect();
    assert_eq!(nope, [false, true, false, true]);
    let c = get("phi3");
    assert!(c.fused_qkv && c.fused_gate_up);
    assert_eq!(c.layers[0].rope.as_ref().unwrap().dims, 8);
    let c = get("granite");
    assert!(c.embed_scale.is_some() && c.residual_scale.is_some() && c.logits_divisor.is_some());
    // Dynamic NTK runs past max_position_embeddings.
    assert!(get("llama-rope-dynamic").max_context > 24);
}
