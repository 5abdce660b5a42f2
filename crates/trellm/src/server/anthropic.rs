//! Anthropic's Messages API: `/v1/messages` (streamed with `message_start`,
//! `content_block_start`, `ping`, `content_block_delta`, `content_block_stop`, `message_delta`,
//! `message_stop`) and `/v1/messages/count_tokens`.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_stream::wrappers::UnboundedReceiverStream;
use trellm_tokenizer::ChatMessage;

use super::api::{collect, invalid_sampling, parse, request_id, start, ApiError, ChoiceUpdate};
use super::{authorized, AppState};
use crate::engine::{FinishReason, Request, SamplerParams};

#[derive(Deserialize, Debug)]
#[serde(untagged)]
enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Deserialize, Debug)]
struct Block {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct Message {
    role: String,
    content: Content,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct MessagesRequest {
    model: String,
    messages: Vec<Message>,
    system: Option<Content>,
    max_tokens: usize,
    stop_sequences: Option<Vec<String>>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    stream: Option<bool>,
    #[allow(dead_code)]
    metadata: Option<Value>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct CountRequest {
    model: String,
    messages: Vec<Message>,
    system: Option<Content>,
}

fn text_of(c: Content) -> Result<String, ApiError> {
    match c {
        Content::Text(t) => Ok(t),
        Content::Blocks(b) => b
            .into_iter()
            .map(|b| match (b.kind.as_str(), b.text) {
                ("text", Some(t)) => Ok(t),
                (k, _) => Err(ApiError::invalid(format!(
                    "content blocks of type '{k}' are not supported"
                ))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|v| v.concat()),
    }
}

fn prompt(
    s: &AppState,
    model: &str,
    system: Option<Content>,
    messages: Vec<Message>,
) -> Result<Vec<u32>, ApiError> {
    if model != s.model_name {
        return Err(ApiError::new(
            axum::http::StatusCode::NOT_FOUND,
            "not_found_error",
            format!("model: {model} (this server serves '{}')", s.model_name),
        ));
    }
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages: at least one message is required",
        ));
    }
    let mut chat = Vec::new();
    if let Some(sys) = system {
        chat.push(ChatMessage::new("system", text_of(sys)?));
    }
    for m in messages {
        if m.role != "user" && m.role != "assistant" {
            return Err(ApiError::invalid(format!(
                "messages: role '{}' is not user or assistant",
                m.role
            )));
        }
        chat.push(ChatMessage::new(m.role, text_of(m.content)?));
    }
    s.model
        .chat_prompt(&chat)
        .map_err(|e| ApiError::invalid(e.to_string()))
}

/// Anthropic counts cache reads apart from `input_tokens`.
fn usage(input: usize, cached: usize, output: usize) -> Value {
    json!({"input_tokens": input - cached, "output_tokens": output, "cache_read_input_tokens": cached})
}

fn stop_reason(r: &FinishReason) -> (&'static str, Option<String>) {
    match r {
        FinishReason::Stop => ("end_turn", None),
        FinishReason::StopString(s) => ("stop_sequence", Some(s.clone())),
        FinishReason::Length | FinishReason::Context | FinishReason::Cancelled => {
            ("max_tokens", None)
        }
    }
}

pub async fn count_tokens(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if !authorized(&s, &headers) {
        return ApiError::unauthorized().anthropic();
    }
    let r = parse::<CountRequest>(&body).and_then(|r| prompt(&s, &r.model, r.system, r.messages));
    match r {
        Ok(ids) => axum::Json(json!({"input_tokens": ids.len()})).into_response(),
        Err(e) => e.anthropic(),
    }
}

pub async fn messages(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    if !authorized(&s, &headers) {
        return ApiError::unauthorized().anthropic();
    }
    match run(s, &body).await {
        Ok(r) => r,
        Err(e) => e.anthropic(),
    }
}

fn event(name: &str, v: Value) -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().event(name).data(v.to_string()))
}

async fn run(s: Arc<AppState>, body: &[u8]) -> Result<Response, ApiError> {
    let r: MessagesRequest = parse(body)?;
    let ids = prompt(&s, &r.model, r.system, r.messages)?;
    let cfg = &s.model.model.cfg;
    if r.max_tokens == 0 || ids.len() + r.max_tokens > cfg.max_context {
        return Err(ApiError::invalid(format!(
            "max_tokens: the prompt ({} tokens) and max_tokens ({}) must fit the model's context of {} tokens",
            ids.len(),
            r.max_tokens,
            cfg.max_context
        )));
    }
    // Unset fields: the model's recommendation, then Anthropic's defaults.
    let d = &s.model.sampling;
    let sampler = SamplerParams {
        temp: r.temperature.or(d.temperature).unwrap_or(1.0),
        top_p: r.top_p.or(d.top_p).unwrap_or(1.0),
        top_k: r.top_k.or(d.top_k).unwrap_or(0),
        min_p: d.min_p.unwrap_or(0.0),
        repetition_penalty: d.repetition_penalty,
        ..Default::default()
    };
    sampler.validate(cfg.vocab).map_err(invalid_sampling)?;
    let req = Request {
        prompt: ids.clone(),
        max_tokens: r.max_tokens,
        sampler,
        eos_ids: s.model.eos_ids(),
        stop: r.stop_sequences.unwrap_or_default(),
        ..Default::default()
    };
    let id = request_id("msg_");
    let input = ids.len();
    if !r.stream.unwrap_or(false) {
        let c = collect(&s.worker, vec![req]).await?.remove(0);
        let (reason, seq) = stop_reason(c.reason.as_ref().unwrap_or(&FinishReason::Length));
        return Ok(axum::Json(json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": s.model_name,
            "content": [{"type": "text", "text": c.text}],
            "stop_reason": reason,
            "stop_sequence": seq,
            "usage": usage(input, c.cached, c.steps.len()),
        }))
        .into_response());
    }
    let mut rx = start(&s.worker, vec![req])?;
    let (tx, out) = tokio::sync::mpsc::unbounded_channel();
    let name = s.model_name.clone();
    tokio::spawn(async move {
        let head = [
            event(
                "message_start",
                json!({"type": "message_start", "message": {
                    "id": id, "type": "message", "role": "assistant", "model": name,
                    "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": input, "output_tokens": 0, "cache_read_input_tokens": 0},
                }}),
            ),
            event(
                "content_block_start",
                json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            ),
            event("ping", json!({"type": "ping"})),
        ];
        for e in head {
            if tx.send(e).is_err() {
                return;
            }
        }
        let delta = |t: &str| {
            event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}}),
            )
        };
        let mut output = 0usize;
        while let Some((_, u)) = rx.recv().await {
            match u {
                ChoiceUpdate::Token { text, .. } => {
                    output += 1;
                    if !text.is_empty() && tx.send(delta(&text)).is_err() {
                        return;
                    }
                }
                ChoiceUpdate::Done {
                    reason,
                    text,
                    cached,
                } => {
                    if !text.is_empty() && tx.send(delta(&text)).is_err() {
                        return;
                    }
                    let (reason, seq) = stop_reason(&reason);
                    let tail = [
                        event(
                            "content_block_stop",
                            json!({"type": "content_block_stop", "index": 0}),
                        ),
                        event(
                            "message_delta",
                            json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": usage(input, cached, output)}),
                        ),
                        event("message_stop", json!({"type": "message_stop"})),
                    ];
                    for e in tail {
                        if tx.send(e).is_err() {
                            return;
                        }
                    }
                    return;
                }
                ChoiceUpdate::Failed(e) => {
                    let _ = tx.send(event(
                        "error",
                        json!({"type": "error", "error": {"type": e.kind, "message": e.message}}),
                    ));
                    return;
                }
            }
        }
    });
    Ok(Sse::new(UnboundedReceiverStream::new(out)).into_response())
}
