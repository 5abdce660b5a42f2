//! Constrained decoding through the library on the real default model (SmolLM2-135M-Instruct):
//! a JSON schema's output parses and validates, a regex's output matches, a constrained and an
//! unconstrained request share steps without changing each other, bad grammars are errors, and
//! the per-token cost of the mask is measured (printed with `--nocapture`).

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use trellm::engine::{Constraint, Grammar};
use trellm::{ChatMessage, Device, EngineOptions, Event, LoadedModel, Request, SamplerParams};
use trellm_tokenizer::TokenBytes;

fn model() -> LoadedModel {
    trellm::load(&model_path("smollm2-135m-instruct")).unwrap()
}

fn request(m: &LoadedModel, question: &str, max_tokens: usize, seed: u64) -> Request {
    Request {
        prompt: m
            .chat_prompt(&[ChatMessage::new("user", question)])
            .unwrap(),
        max_tokens,
        sampler: SamplerParams {
            temp: 0.8,
            seed: Some(seed),
            ..Default::default()
        },
        eos_ids: m.eos_ids(),
        ..Default::default()
    }
}

/// Runs the requests together; returns each one's text, ids and finish reason.
fn run_all(m: &LoadedModel, reqs: Vec<Request>) -> Vec<(String, Vec<u32>, String)> {
    let mut e = m
        .engine(Device::Cpu, EngineOptions::for_sequences(reqs.len(), 512))
        .unwrap();
    let mut out = vec![(String::new(), Vec::new(), String::new()); reqs.len()];
    for r in reqs {
        e.submit(r).unwrap();
    }
    while e.has_work() {
        for ev in e.step().unwrap() {
            match ev {
                Event::Token { id, step, text } => {
                    out[id as usize].0.push_str(&text);
                    out[id as usize].1.push(step.token);
                }
                Event::Done {
                    id, text, reason, ..
                } => {
                    out[id as usize].0.push_str(&text);
                    out[id as usize].2 = reason.as_str().to_string();
                }
            }
        }
    }
    out
}

const SCHEMA: &str = r#"{
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}
    },
    "required": ["name", "age", "city"],
    "additionalProperties": false
}"#;

/// Checks `v` against `SCHEMA` by hand.
fn validate(v: &Value) -> Result<(), String> {
    let o = v.as_object().ok_or("not an object")?;
    for k in o.keys() {
        if !["name", "age", "city", "tags"].contains(&k.as_str()) {
            return Err(format!("unexpected key {k}"));
        }
    }
    let name = o.get("name").and_then(Value::as_str).ok_or("name")?;
    if name.is_empty() || name.chars().count() > 24 {
        return Err(format!("name length: {name:?}"));
    }
    let age = o.get("age").and_then(Value::as_i64).ok_or("age")?;
    if !(0..=150).contains(&age) {
        return Err(format!("age {age}"));
    }
    let city = o.get("city").and_then(Value::as_str).ok_or("city")?;
    if !["Paris", "London", "Tokyo"].contains(&city) {
        return Err(format!("city {city}"));
    }
    if let Some(t) = o.get("tags") {
        let t = t.as_array().ok_or("tags")?;
        if t.len() > 3
            || t.iter()
                .any(|x| x.as_str().is_none_or(|s| s.chars().count() > 12))
        {
            return Err(format!("tags {t:?}"));
        }
    }
    Ok(())
}

#[test]
fn token_bytes_spell_the_decoded_text() {
    // Byte-level BPE (SmolLM2) and SentencePiece with byte pieces (gemma-3).
    for (alias, special) in [
        ("smollm2-135m-instruct", "<|im_end|>"),
        ("gemma-3-270m", "<end_of_turn>"),
    ] {
        let m = trellm::load(&model_path(alias)).unwrap();
        let tok = m.tokenizer().unwrap();
        let bytes = tok.vocab_bytes();
        assert_eq!(bytes.len(), tok.vocab_size());
        let text = "Grüße, 東京! {\"a\": [1, 2.5e3]}\n\ttabs 🦀";
        let ids = tok.encode(text, false).unwrap();
        let mut joined = Vec::new();
        for &id in &ids {
            match &bytes[id as usize] {
                TokenBytes::Text(b) => joined.extend_from_slice(b),
                TokenBytes::Special(s) => panic!("{alias}: {s} in plain text"),
            }
        }
        assert_eq!(String::from_utf8(joined).unwrap(), text, "{alias}");
        let id = tok.token_to_id(special).unwrap();
        assert_eq!(bytes[id as usize], TokenBytes::Special(special.into()));
    }
    // A constraint on the 262k vocabulary works the same way.
    let m = trellm::load(&model_path("gemma-3-270m")).unwrap();
    let c = m.constrainer().unwrap();
    // gemma-3-270m is a base model without a chat template: a plain prompt.
    let prompt = m
        .tokenizer()
        .unwrap()
        .encode("Question: Is water wet?\nAnswer:", true)
        .unwrap();
    let mut r = Request {
        prompt,
        max_tokens: 8,
        eos_ids: m.eos_ids(),
        ..Default::default()
    };
    r.constraint = Some(c.compile(&Grammar::Regex("(Yes|No)".into())).unwrap());
    let out = run_all(&m, vec![r]);
    assert!(["Yes", "No"].contains(&out[0].0.as_str()), "{:?}", out[0]);
}

#[test]
fn json_schema_output_validates_beside_an_unconstrained_request() {
    let m = model();
    let t = Instant::now();
    let c = m.constrainer().unwrap();
    eprintln!(
        "grammar engine built in {:.0} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    let schema: Value = serde_json::from_str(SCHEMA).unwrap();
    let constraint = c.compile(&Grammar::JsonSchema(schema)).unwrap();
    let q = "Describe a person who lives in a big city, as JSON.";
    let free = request(&m, "Name a color.", 12, 3);
    let alone = run_all(&m, vec![free.clone()]);
    let mut reqs = Vec::new();
    for seed in [1, 2, 3] {
        let mut r = request(&m, q, 120, seed);
        r.constraint = Some(constraint.clone());
        reqs.push(r);
    }
    reqs.push(free);
    let out = run_all(&m, reqs);
    for (text, _, reason) in &out[..3] {
        eprintln!("constrained: {text}");
        assert_eq!(reason, "stop", "{text}");
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        validate(&v).unwrap_or_else(|e| panic!("{e}: {text}"));
    }
    // The unconstrained request in the same steps is what it is alone.
    assert_eq!(out[3], alone[0]);

    // The mask's cost per token: replay each output's ids through a fresh constraint.
    let v = m.model.cfg.vocab;
    let mut logits = vec![0.0f32; v];
    let (mut spent, mut tokens) = (Duration::ZERO, 0);
    for (_, ids, _) in &out[..3] {
        let mut k = constraint.clone();
        for &id in ids {
            logits.fill(0.0);
            let t = Instant::now();
            k.mask(&mut logits).unwrap();
            k.commit(id).unwrap();
            spent += t.elapsed();
            tokens += 1;
            assert!(logits[id as usize].is_finite(), "drawn token was masked");
        }
        assert!(k.is_finished());
    }
    eprintln!(
        "constrained decoding on a {v}-token vocabulary: {:.1} us per token (mask + commit, {tokens} tokens)",
        spent.as_secs_f64() * 1e6 / tokens as f64
    );
    // End to end, alone in the engine: time per generated token with and without the schema.
    let per_token = |r: Request| {
        let mut e = m
            .engine(Device::Cpu, EngineOptions::for_sequences(1, 512))
            .unwrap();
        let f = trellm::engine::generate(&mut e, r, |_, _| trellm::engine::Flow::Continue).unwrap();
        f.stats.generation_time.as_secs_f64() * 1e3 / f.stats.generated_tokens.max(2) as f64
    };
    let mut with = request(&m, q, 120, 1);
    with.constraint = Some(constraint.clone());
    let (a, b) = (per_token(with), per_token(request(&m, q, 40, 1)));
    eprintln!("decode alone: {a:.2} ms per token with the schema, {b:.2} ms without");
}

#[test]
fn json_object_regex_and_lark() {
    let m = model();
    let c = m.constrainer().unwrap();
    let mut reqs = Vec::new();
    for g in [
        Grammar::JsonObject,
        Grammar::Regex("(yes|no)".into()),
        Grammar::Lark("start: \"The answer is \" NUM \".\"\nNUM: /[0-9]{1,3}/\n".into()),
    ] {
        let mut r = request(&m, "Is the sky blue? Answer briefly.", 64, 5);
        r.constraint = Some(c.compile(&g).unwrap());
        reqs.push(r);
    }
    let out = run_all(&m, reqs);
    let (obj, yes_no, lark) = (&out[0], &out[1], &out[2]);
    eprintln!(
        "json_object: {:?}\nregex: {:?}\nlark: {:?}",
        obj, yes_no.0, lark.0
    );
    if obj.2 == "stop" {
        assert!(serde_json::from_str::<Value>(&obj.0).unwrap().is_object());
    } else {
        // A long object may run out of tokens; what came out is still a JSON prefix.
        assert!(obj.0.starts_with('{'), "{}", obj.0);
    }
    assert!(["yes", "no"].contains(&yes_no.0.as_str()), "{}", yes_no.0);
    assert_eq!(yes_no.2, "stop");
    let n = lark
        .0
        .strip_prefix("The answer is ")
        .and_then(|r| r.strip_suffix('.'))
        .unwrap_or_else(|| panic!("{}", lark.0));
    assert!(!n.is_empty() && n.len() <= 3 && n.bytes().all(|b| b.is_ascii_digit()));
}

#[test]
fn bad_grammars_are_errors() {
    let m = model();
    let c = m.constrainer().unwrap();
    for g in [
        Grammar::JsonSchema(json!({"type": "frobnicate"})),
        Grammar::JsonSchema(json!({"$ref": "#/$defs/missing"})),
        Grammar::JsonSchema(json!(42)),
        Grammar::Lark("start: (".into()),
        Grammar::Regex("(unclosed".into()),
    ] {
        let e: Result<Constraint, String> = c.compile(&g);
        assert!(e.is_err(), "{g:?} compiled");
    }
}
