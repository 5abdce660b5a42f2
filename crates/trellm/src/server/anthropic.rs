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

use super::api::{collect, invalid_sampling, parse, request_id, start, ApiError};
use super::tools::{self, InMessage, ReplySink, ToolCall, Tools};
use super::{authorized, AppState};
use crate::engine::{FinishReason, Grammar, Request, SamplerParams};

#[derive(Deserialize, Debug)]
#[serde(untagged)]
enum Content {
    Text(String),
    /// Content blocks, read by their `type` (text, tool_use, tool_result, thinking).
    Blocks(Vec<Value>),
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct Message {
    role: String,
    content: Content,
}

/// What both endpoints read: the conversation, its tools and output options.
#[derive(Deserialize, Debug)]
struct Conversation {
    model: String,
    messages: Vec<Message>,
    system: Option<Content>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    /// `format`: structured output (a JSON schema the reply follows); `effort`: no effect here.
    output_config: Option<Value>,
    /// Accepted so clients that always send it work; this server's models answer without a
    /// thinking block.
    thinking: Option<Value>,
    /// No effect: the prefix cache reuses every prompt's blocks without markers.
    #[allow(dead_code)]
    cache_control: Option<Value>,
    #[allow(dead_code)]
    service_tier: Option<Value>,
    #[allow(dead_code)]
    speed: Option<Value>,
    // Account and cache-diagnostics fields of Anthropic's service: nothing here.
    #[allow(dead_code)]
    inference_geo: Option<Value>,
    #[allow(dead_code)]
    user_profile_id: Option<Value>,
    #[allow(dead_code)]
    workspace_id: Option<Value>,
    #[allow(dead_code)]
    diagnostics: Option<Value>,
}

impl Conversation {
    /// The OpenAI `response_format` that `output_config.format` asks for.
    fn response_format(&self) -> Result<Option<Value>, ApiError> {
        let Some(c) = &self.output_config else {
            return Ok(None);
        };
        if let Some(e) = c.get("effort").filter(|e| !e.is_null()) {
            if !matches!(
                e.as_str(),
                Some("low" | "medium" | "high" | "xhigh" | "max")
            ) {
                return Err(ApiError::invalid(
                    "output_config.effort must be low, medium, high, xhigh or max",
                ));
            }
        }
        match c.get("format") {
            None | Some(Value::Null) => Ok(None),
            Some(f)
                if kind(f) == "json_schema" && f.get("schema").is_some_and(Value::is_object) =>
            {
                Ok(Some(json!({"type": "json_schema",
                    "json_schema": {"name": "output", "schema": f["schema"]}})))
            }
            Some(_) => Err(ApiError::invalid(
                "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
            )),
        }
    }

    fn check_thinking(&self) -> Result<(), ApiError> {
        match &self.thinking {
            None => Ok(()),
            Some(t)
                if matches!(
                    kind(t),
                    "enabled" | "disabled" | "adaptive" | "between_tools"
                ) =>
            {
                Ok(())
            }
            Some(_) => Err(ApiError::invalid(
                "thinking.type must be enabled, disabled, adaptive or between_tools",
            )),
        }
    }
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct MessagesRequest {
    #[serde(flatten)]
    conversation: Conversation,
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
    #[serde(flatten)]
    conversation: Conversation,
}

/// A block's `type`.
fn kind(b: &Value) -> &str {
    b.get("type").and_then(Value::as_str).unwrap_or("")
}

fn unsupported(k: &str) -> ApiError {
    ApiError::invalid(format!("content blocks of type '{k}' are not supported"))
}

/// The text of a system prompt or a tool result: a string or text blocks.
fn text_of(c: Content) -> Result<String, ApiError> {
    match c {
        Content::Text(t) => Ok(t),
        Content::Blocks(b) => b
            .iter()
            .map(|b| match (kind(b), b.get("text").and_then(Value::as_str)) {
                ("text", Some(t)) => Ok(t),
                (k, _) => Err(unsupported(k)),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|v| v.concat()),
    }
}

/// Anthropic's tools as the OpenAI function tools the chat machinery reads.
fn openai_tools(list: &[Value]) -> Result<Value, ApiError> {
    let mut out = Vec::new();
    for (i, t) in list.iter().enumerate() {
        if let Some(k) = t
            .get("type")
            .and_then(Value::as_str)
            .filter(|&k| k != "custom")
        {
            return Err(ApiError::invalid(format!(
                "tools.{i}: server tools ('{k}') are not supported; only client tools with an input_schema"
            )));
        }
        let Some(name) = t.get("name").and_then(Value::as_str) else {
            return Err(ApiError::invalid(format!(
                "tools.{i}: a tool needs a 'name'"
            )));
        };
        let Some(schema) = t.get("input_schema").filter(|v| v.is_object()) else {
            return Err(ApiError::invalid(format!(
                "tools.{i}.input_schema: a JSON schema object is required"
            )));
        };
        let mut f = json!({"name": name, "parameters": schema});
        if let Some(d) = t.get("description") {
            f["description"] = d.clone();
        }
        out.push(json!({"type": "function", "function": f}));
    }
    Ok(Value::Array(out))
}

/// Anthropic's `tool_choice` (auto, any, tool, none) as OpenAI's.
fn openai_choice(c: &Value) -> Result<Value, ApiError> {
    match (kind(c), c.get("name").and_then(Value::as_str)) {
        ("auto", _) => Ok(json!("auto")),
        ("any", _) => Ok(json!("required")),
        ("none", _) => Ok(json!("none")),
        ("tool", Some(n)) => Ok(json!({"type": "function", "function": {"name": n}})),
        _ => Err(ApiError::invalid(
            "tool_choice must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", \"name\": ...}",
        )),
    }
}

/// The conversation as the chat machinery's messages: an assistant turn's `tool_use` blocks
/// become its tool calls, a user turn's `tool_result` blocks tool turns (before its text).
/// Thinking blocks of earlier turns are dropped (this model does not read them back).
fn in_messages(
    system: Option<Content>,
    messages: Vec<Message>,
) -> Result<Vec<InMessage>, ApiError> {
    let msg = InMessage::new;
    let mut out = Vec::new();
    if let Some(sys) = system {
        out.push(msg("system", text_of(sys)?));
    }
    // Tool names by call id, for the results that answer them.
    let mut names = std::collections::HashMap::new();
    for m in messages {
        if m.role != "user" && m.role != "assistant" {
            return Err(ApiError::invalid(format!(
                "messages: role '{}' is not user or assistant",
                m.role
            )));
        }
        let blocks = match m.content {
            Content::Text(t) => {
                out.push(msg(&m.role, t));
                continue;
            }
            Content::Blocks(b) => b,
        };
        let mut text = String::new();
        let mut calls = Vec::new();
        for b in blocks {
            match (m.role.as_str(), kind(&b)) {
                (_, "text") => match b.get("text").and_then(Value::as_str) {
                    Some(t) => text.push_str(t),
                    None => return Err(ApiError::invalid("a text block needs its 'text'")),
                },
                ("assistant", "thinking" | "redacted_thinking") => {}
                ("assistant", "tool_use") => {
                    let (Some(id), Some(name)) = (
                        b.get("id").and_then(Value::as_str),
                        b.get("name").and_then(Value::as_str),
                    ) else {
                        return Err(ApiError::invalid("a tool_use block needs 'id' and 'name'"));
                    };
                    names.insert(id.to_string(), name.to_string());
                    let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                    calls.push(json!({"id": id, "type": "function",
                        "function": {"name": name, "arguments": input}}));
                }
                ("user", "tool_result") => {
                    let Some(id) = b.get("tool_use_id").and_then(Value::as_str) else {
                        return Err(ApiError::invalid(
                            "a tool_result block needs its 'tool_use_id'",
                        ));
                    };
                    let content = match b.get("content") {
                        None | Some(Value::Null) => String::new(),
                        Some(c) => text_of(serde_json::from_value(c.clone()).map_err(|_| {
                            ApiError::invalid("a tool_result's content is a string or text blocks")
                        })?)?,
                    };
                    out.push(InMessage {
                        tool_call_id: Some(id.to_string()),
                        name: names.get(id).cloned(),
                        ..msg("tool", content)
                    });
                }
                (_, k) => return Err(unsupported(k)),
            }
        }
        if !calls.is_empty() {
            out.push(InMessage {
                tool_calls: Some(Value::Array(calls)),
                ..msg("assistant", text)
            });
        } else if !text.is_empty() || out.last().is_none_or(|l| l.role != "tool") {
            out.push(msg(&m.role, text));
        }
    }
    Ok(out)
}

/// A request's prompt ids, the tools in play and the grammar `output_config.format` asks for
/// (compiled only by a request that decodes: counting tokens needs none).
struct Prompt {
    ids: Vec<u32>,
    tools: Option<Tools>,
    from_format: Option<Grammar>,
}

fn prompt(s: &AppState, c: Conversation) -> Result<Prompt, ApiError> {
    if c.model != s.model_name {
        return Err(ApiError::new(
            axum::http::StatusCode::NOT_FOUND,
            "not_found_error",
            format!("model: {} (this server serves '{}')", c.model, s.model_name),
        ));
    }
    if c.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages: at least one message is required",
        ));
    }
    let tool_list = c.tools.as_deref().map(openai_tools).transpose()?;
    let tool_choice = c.tool_choice.as_ref().map(openai_choice).transpose()?;
    c.check_thinking()?;
    let from_format = tools::response_grammar(c.response_format()?.as_ref())?;
    let call_tools = tools::read_tools(s, tool_list.as_ref(), tool_choice.as_ref())?;
    let messages = in_messages(c.system, c.messages)?;
    let ids = tools::chat_ids(s, messages, call_tools.as_ref(), None)?;
    Ok(Prompt {
        ids,
        tools: call_tools,
        from_format,
    })
}

fn tool_use(c: &ToolCall) -> Value {
    let input: Value = serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": request_id("toolu_"), "name": c.name, "input": input})
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
    let r = match parse::<CountRequest>(&body) {
        Ok(r) => prompt(&s, r.conversation),
        Err(e) => Err(e),
    };
    match r {
        Ok(p) => axum::Json(json!({"input_tokens": p.ids.len()})).into_response(),
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

type Sender = tokio::sync::mpsc::UnboundedSender<Result<SseEvent, Infallible>>;

/// A streamed message's content blocks: the text block opens with its first text, each tool
/// call is a `tool_use` block of its own after it. Sends fail only once the client has gone.
struct Blocks {
    tx: Sender,
    next: usize,
    text_open: bool,
    /// Prompt tokens (the usage at the end).
    input: usize,
}

impl Blocks {
    fn send(&self, name: &str, v: Value) -> Result<(), ()> {
        self.tx.send(event(name, v)).map_err(|_| ())
    }

    fn close_text(&mut self) -> Result<(), ()> {
        if self.text_open {
            self.send(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": self.next}),
            )?;
            self.text_open = false;
            self.next += 1;
        }
        Ok(())
    }

    fn call(&mut self, c: &ToolCall) -> Result<(), ()> {
        self.close_text()?;
        let mut block = tool_use(c);
        block["input"] = json!({});
        let i = self.next;
        self.send(
            "content_block_start",
            json!({"type": "content_block_start", "index": i, "content_block": block}),
        )?;
        self.send(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": i, "delta": {"type": "input_json_delta", "partial_json": c.arguments}}),
        )?;
        self.send(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": i}),
        )?;
        self.next += 1;
        Ok(())
    }

    /// The rest of the text, the calls, and the message's end. A message without calls keeps
    /// its text block, if empty.
    fn end(
        &mut self,
        text: &str,
        calls: &[ToolCall],
        usage: Value,
        reason: &str,
        seq: Option<String>,
    ) -> Result<(), ()> {
        if !text.is_empty() || calls.is_empty() {
            self.text(text)?;
        }
        self.close_text()?;
        for c in calls {
            self.call(c)?;
        }
        self.send(
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": usage}),
        )?;
        self.send("message_stop", json!({"type": "message_stop"}))
    }
}

impl ReplySink for Blocks {
    fn text(&mut self, t: &str) -> Result<(), ()> {
        if !self.text_open {
            self.send(
                "content_block_start",
                json!({"type": "content_block_start", "index": self.next, "content_block": {"type": "text", "text": ""}}),
            )?;
            self.text_open = true;
        }
        if t.is_empty() {
            return Ok(());
        }
        self.send(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.next, "delta": {"type": "text_delta", "text": t}}),
        )
    }

    fn done(
        &mut self,
        text: &str,
        calls: &[ToolCall],
        reason: FinishReason,
        cached: usize,
        generated: usize,
    ) {
        let (reason, seq) = match calls.is_empty() {
            true => stop_reason(&reason),
            false => ("tool_use", None),
        };
        // Failing here means the client has gone: nothing is left to do.
        let _ = self.end(
            text,
            calls,
            usage(self.input, cached, generated),
            reason,
            seq,
        );
    }

    fn failed(&mut self, e: ApiError) {
        let _ = self.send(
            "error",
            json!({"type": "error", "error": {"type": e.kind, "message": e.message}}),
        );
    }
}

async fn run(s: Arc<AppState>, body: &[u8]) -> Result<Response, ApiError> {
    let r: MessagesRequest = parse(body)?;
    let Prompt {
        ids,
        tools: call_tools,
        from_format,
    } = prompt(&s, r.conversation)?;
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
        constraint: tools::constraint(&s, call_tools.as_ref(), from_format).await?,
        ..Default::default()
    };
    let id = request_id("msg_");
    let input = ids.len();
    if !r.stream.unwrap_or(false) {
        let c = collect(&s.worker, vec![req]).await?.remove(0);
        let (text, calls) = match &call_tools {
            Some(t) => tools::parse_calls(&c.text, t),
            None => (c.text, Vec::new()),
        };
        let (reason, seq) = match calls.is_empty() {
            true => stop_reason(c.reason.as_ref().unwrap_or(&FinishReason::Length)),
            false => ("tool_use", None),
        };
        let mut content = Vec::new();
        if !text.is_empty() || calls.is_empty() {
            content.push(json!({"type": "text", "text": text}));
        }
        content.extend(calls.iter().map(tool_use));
        return Ok(axum::Json(json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": s.model_name,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": seq,
            "usage": usage(input, c.cached, c.steps.len()),
        }))
        .into_response());
    }
    let rx = start(&s.worker, vec![req])?;
    let (tx, out) = tokio::sync::mpsc::unbounded_channel();
    let name = s.model_name.clone();
    tokio::spawn(async move {
        let mut b = Blocks {
            tx,
            next: 0,
            text_open: false,
            input,
        };
        let head = b
            .send(
                "message_start",
                json!({"type": "message_start", "message": {
                    "id": id, "type": "message", "role": "assistant", "model": name,
                    "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": input, "output_tokens": 0, "cache_read_input_tokens": 0},
                }}),
            )
            .and_then(|_| b.send("ping", json!({"type": "ping"})));
        if head.is_err() {
            return;
        }
        tools::drive_reply(rx, call_tools.as_ref(), &mut b).await;
    });
    Ok(Sse::new(UnboundedReceiverStream::new(out)).into_response())
}
