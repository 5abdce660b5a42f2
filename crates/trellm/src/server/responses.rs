//! OpenAI's Responses API: `POST /v1/responses`, collected or streamed as `response.*` events.
//! Stateless: a request carries its whole conversation (`previous_response_id`, `conversation`,
//! stored prompts and background runs are refused) and nothing is stored. Fields that only tune
//! OpenAI's service (`store`, `include`, `service_tier`, `reasoning`, ...) are accepted and
//! change nothing.

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
use super::tools::{self, InMessage, ReplySink, ToolCall};
use super::{authorized, unix_time, AppState};
use crate::engine::{FinishReason, Request, SamplerParams};

#[derive(Deserialize, Debug)]
#[serde(untagged)]
enum Input {
    Text(String),
    /// Messages and function-call items, read by their `type` (a message may leave it out).
    Items(Vec<Value>),
}

#[derive(Deserialize, Debug)]
struct ResponsesRequest {
    model: Option<String>,
    input: Input,
    instructions: Option<String>,
    max_output_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    stream: Option<bool>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    /// `format`: text, json_object or json_schema.
    text: Option<Value>,
    metadata: Option<Value>,
    // What a stateless server cannot do: refused when set.
    previous_response_id: Option<Value>,
    conversation: Option<Value>,
    prompt: Option<Value>,
    background: Option<bool>,
}

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(message).param(param)
}

impl ResponsesRequest {
    fn check_stateless(&self) -> Result<(), ApiError> {
        let set = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null());
        for (name, on) in [
            ("previous_response_id", set(&self.previous_response_id)),
            ("conversation", set(&self.conversation)),
            ("prompt", set(&self.prompt)),
            ("background", self.background == Some(true)),
        ] {
            if on {
                return Err(bad(
                    name,
                    format!("{name} is not supported: this server stores nothing; send the whole conversation in input"),
                ));
            }
        }
        Ok(())
    }

    /// The chat `response_format` that `text.format` asks for.
    fn response_format(&self) -> Result<Option<Value>, ApiError> {
        let Some(f) = self.text.as_ref().and_then(|t| t.get("format")) else {
            return Ok(None);
        };
        match f.get("type").and_then(Value::as_str) {
            Some("text") => Ok(None),
            Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
            Some("json_schema") => Ok(Some(json!({"type": "json_schema", "json_schema": {
                "name": f.get("name").cloned().unwrap_or(json!("output")),
                "schema": f.get("schema").cloned().unwrap_or(json!({"type": "object"})),
            }}))),
            _ => Err(bad(
                "text.format",
                "text.format.type must be text, json_object or json_schema",
            )),
        }
    }
}

/// The Responses API's function tools (flat) as the chat machinery's (`function` nested).
fn chat_tools(list: &[Value]) -> Result<Value, ApiError> {
    let mut out = Vec::new();
    for (i, t) in list.iter().enumerate() {
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(k) => {
                return Err(bad(
                    "tools",
                    format!(
                        "tools[{i}]: built-in tools ('{k}') are not supported; only function tools"
                    ),
                ))
            }
            None => return Err(bad("tools", format!("tools[{i}] needs a 'type'"))),
        }
        if !t.get("name").is_some_and(Value::is_string) {
            return Err(bad("tools", format!("tools[{i}] needs a 'name'")));
        }
        let mut f = json!({});
        for key in ["name", "description", "parameters"] {
            if let Some(v) = t.get(key).filter(|v| !v.is_null()) {
                f[key] = v.clone();
            }
        }
        out.push(json!({"type": "function", "function": f}));
    }
    Ok(Value::Array(out))
}

/// `tool_choice` as the chat machinery reads it.
fn chat_choice(c: &Value) -> Result<Value, ApiError> {
    match c {
        Value::String(_) => Ok(c.clone()),
        _ => match (
            c.get("type").and_then(Value::as_str),
            c.get("name").and_then(Value::as_str),
        ) {
            (Some("function"), Some(n)) => Ok(json!({"type": "function", "function": {"name": n}})),
            _ => Err(bad(
                "tool_choice",
                "tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
            )),
        },
    }
}

/// A message's text: a string, or input_text / output_text parts.
fn text_of(content: &Value) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => parts
            .iter()
            .map(|p| {
                let k = p.get("type").and_then(Value::as_str).unwrap_or("");
                match (k, p.get("text").and_then(Value::as_str)) {
                    ("input_text" | "output_text" | "text", Some(t)) => Ok(t),
                    _ => Err(bad(
                        "input",
                        format!("content parts of type '{k}' are not supported"),
                    )),
                }
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|v| v.concat()),
        _ => Err(bad(
            "input",
            "a message's content is a string or a list of parts",
        )),
    }
}

/// `instructions` and `input` as the chat machinery's messages: a run of `function_call` items
/// joins the assistant turn before it, a `function_call_output` is a tool turn; reasoning items
/// are dropped.
fn in_messages(instructions: Option<String>, input: Input) -> Result<Vec<InMessage>, ApiError> {
    let msg = InMessage::new;
    let mut out = Vec::new();
    if let Some(i) = instructions {
        out.push(msg("system", i));
    }
    let items = match input {
        Input::Text(t) => {
            out.push(msg("user", t));
            return Ok(out);
        }
        Input::Items(items) => items,
    };
    let mut names = std::collections::HashMap::new();
    for item in items {
        let kind = item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message");
        match kind {
            "message" => {
                let role = match item.get("role").and_then(Value::as_str) {
                    Some("developer" | "system") => "system",
                    Some(r @ ("user" | "assistant")) => r,
                    r => {
                        return Err(bad(
                            "input",
                            format!("a message's role must be user, assistant, system or developer, not {r:?}"),
                        ))
                    }
                };
                let content = text_of(item.get("content").unwrap_or(&Value::Null))?;
                out.push(msg(role, content));
            }
            "function_call" => {
                let (Some(id), Some(name), Some(args)) = (
                    item.get("call_id").and_then(Value::as_str),
                    item.get("name").and_then(Value::as_str),
                    item.get("arguments").and_then(Value::as_str),
                ) else {
                    return Err(bad(
                        "input",
                        "a function_call item needs call_id, name and arguments",
                    ));
                };
                names.insert(id.to_string(), name.to_string());
                let call = json!({"id": id, "type": "function",
                    "function": {"name": name, "arguments": args}});
                match out.last_mut() {
                    Some(m) if m.role == "assistant" => {
                        let calls = m.tool_calls.get_or_insert_with(|| json!([]));
                        if let Some(a) = calls.as_array_mut() {
                            a.push(call);
                        }
                    }
                    _ => out.push(InMessage {
                        tool_calls: Some(json!([call])),
                        ..msg("assistant", String::new())
                    }),
                }
            }
            "function_call_output" => {
                let Some(id) = item.get("call_id").and_then(Value::as_str) else {
                    return Err(bad(
                        "input",
                        "a function_call_output item needs its call_id",
                    ));
                };
                let output = text_of(item.get("output").unwrap_or(&Value::Null))?;
                out.push(InMessage {
                    tool_call_id: Some(id.to_string()),
                    name: names.get(id).cloned(),
                    ..msg("tool", output)
                });
            }
            "reasoning" => {}
            k => {
                return Err(bad(
                    "input",
                    format!("input items of type '{k}' are not supported"),
                ))
            }
        }
    }
    if out.iter().all(|m| m.role == "system") {
        return Err(bad("input", "input holds no message"));
    }
    Ok(out)
}

/// What the response object echoes of its request.
struct Echo {
    model: String,
    instructions: Option<String>,
    max_output_tokens: Option<usize>,
    temperature: f32,
    top_p: f32,
    tools: Value,
    tool_choice: Value,
    text: Value,
    metadata: Value,
}

/// The response object; `output` and `usage` empty while it runs.
fn response(
    id: &str,
    created: u64,
    e: &Echo,
    status: &str,
    output: &[Value],
    usage: Option<Value>,
) -> Value {
    let incomplete = (status == "incomplete").then(|| json!({"reason": "max_output_tokens"}));
    json!({
        "id": id, "object": "response", "created_at": created, "status": status,
        "completed_at": (status != "in_progress").then(unix_time),
        "model": e.model, "output": output, "error": null, "incomplete_details": incomplete,
        "instructions": e.instructions, "max_output_tokens": e.max_output_tokens,
        "temperature": e.temperature, "top_p": e.top_p, "tools": e.tools,
        "tool_choice": e.tool_choice, "parallel_tool_calls": true, "text": e.text,
        "metadata": e.metadata, "previous_response_id": null, "store": false,
        "truncation": "disabled", "usage": usage,
    })
}

fn usage(input: usize, cached: usize, output: usize) -> Value {
    json!({
        "input_tokens": input, "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input + output,
    })
}

fn message_item(id: &str, status: &str, text: Option<&str>) -> Value {
    let content = match text {
        Some(t) => json!([{"type": "output_text", "text": t, "annotations": [], "logprobs": []}]),
        None => json!([]),
    };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn call_item(id: &str, c: &ToolCall, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": request_id("call_"), "name": c.name,
        "arguments": arguments, "status": status})
}

/// `completed`, or `incomplete` when the reply was cut by its token limit or the context.
fn status_of(r: &FinishReason) -> &'static str {
    match r {
        FinishReason::Stop | FinishReason::StopString(_) => "completed",
        FinishReason::Length | FinishReason::Context | FinishReason::Cancelled => "incomplete",
    }
}

pub async fn create(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    if !authorized(&s, &headers) {
        return ApiError::unauthorized().openai();
    }
    match run(s, &body).await {
        Ok(r) => r,
        Err(e) => e.openai(),
    }
}

async fn run(s: Arc<AppState>, body: &[u8]) -> Result<Response, ApiError> {
    let r: ResponsesRequest = parse(body)?;
    super::openai::check_model(&s, &r.model)?;
    r.check_stateless()?;
    let format = r.response_format()?;
    let tool_list = r.tools.as_deref().map(chat_tools).transpose()?;
    let tool_choice = r.tool_choice.as_ref().map(chat_choice).transpose()?;
    let plan = tools::plan(
        &s,
        format.as_ref(),
        tool_list.as_ref(),
        tool_choice.as_ref(),
    )
    .await?;
    let messages = in_messages(r.instructions.clone(), r.input)?;
    let ids = tools::chat_ids(&s, messages, plan.tools.as_ref(), None)?;
    let cfg = &s.model.model.cfg;
    let room = cfg.max_context.saturating_sub(ids.len());
    let max_tokens = r.max_output_tokens.unwrap_or(room.min(4096));
    if max_tokens == 0 || max_tokens > room {
        return Err(bad(
            "max_output_tokens",
            format!(
                "the input ({} tokens) and max_output_tokens ({max_tokens}) must fit the model's context of {} tokens",
                ids.len(),
                cfg.max_context
            ),
        ));
    }
    // Unset fields: the model's recommendation, then OpenAI's defaults.
    let d = &s.model.sampling;
    let sampler = SamplerParams {
        temp: r.temperature.or(d.temperature).unwrap_or(1.0),
        top_p: r.top_p.or(d.top_p).unwrap_or(1.0),
        top_k: d.top_k.unwrap_or(0),
        min_p: d.min_p.unwrap_or(0.0),
        repetition_penalty: d.repetition_penalty,
        ..Default::default()
    };
    sampler.validate(cfg.vocab).map_err(invalid_sampling)?;
    let echo = Echo {
        model: s.model_name.clone(),
        instructions: r.instructions,
        max_output_tokens: r.max_output_tokens,
        temperature: sampler.temp,
        top_p: sampler.top_p,
        tools: json!(r.tools.unwrap_or_default()),
        tool_choice: r.tool_choice.unwrap_or(json!("auto")),
        text: r.text.unwrap_or(json!({"format": {"type": "text"}})),
        metadata: r.metadata.unwrap_or(json!({})),
    };
    let req = Request {
        prompt: ids.clone(),
        max_tokens,
        sampler,
        eos_ids: s.model.eos_ids(),
        constraint: plan.constraint,
        ..Default::default()
    };
    let call_tools = plan.tools;
    let id = request_id("resp_");
    let created = unix_time();
    let input = ids.len();
    if !r.stream.unwrap_or(false) {
        let c = collect(&s.worker, vec![req]).await?.remove(0);
        let (text, calls) = match &call_tools {
            Some(t) => tools::parse_calls(&c.text, t),
            None => (c.text, Vec::new()),
        };
        let status = match calls.is_empty() {
            true => status_of(c.reason.as_ref().unwrap_or(&FinishReason::Length)),
            false => "completed",
        };
        let mut output = Vec::new();
        if !text.is_empty() || calls.is_empty() {
            output.push(message_item(&request_id("msg_"), status, Some(&text)));
        }
        for c in &calls {
            output.push(call_item(&request_id("fc_"), c, &c.arguments, "completed"));
        }
        let u = usage(input, c.cached, c.steps.len());
        return Ok(
            axum::Json(response(&id, created, &echo, status, &output, Some(u))).into_response(),
        );
    }
    let rx = start(&s.worker, vec![req])?;
    let (tx, out) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut w = Events {
            tx,
            seq: 0,
            output: Vec::new(),
            message: None,
            id,
            created,
            echo,
            input,
        };
        let running = response(&w.id, created, &w.echo, "in_progress", &[], None);
        if w.send("response.created", json!({"response": running}))
            .is_err()
            || w.send("response.in_progress", json!({"response": running}))
                .is_err()
        {
            return;
        }
        tools::drive_reply(rx, call_tools.as_ref(), &mut w).await;
    });
    Ok(Sse::new(UnboundedReceiverStream::new(out)).into_response())
}

type Sender = tokio::sync::mpsc::UnboundedSender<Result<SseEvent, Infallible>>;

/// A streamed response's events, numbered, and the output items finished so far. The message
/// item opens with the first text; each call is a `function_call` item after it. Sends fail only
/// once the client has gone.
struct Events {
    tx: Sender,
    seq: usize,
    output: Vec<Value>,
    /// The open message item: its id and text so far.
    message: Option<(String, String)>,
    /// The response's id, creation time, request echo and input tokens.
    id: String,
    created: u64,
    echo: Echo,
    input: usize,
}

impl ReplySink for Events {
    fn text(&mut self, t: &str) -> Result<(), ()> {
        let at = self.output.len();
        if self.message.is_none() {
            let id = request_id("msg_");
            self.send(
                "response.output_item.added",
                json!({"output_index": at, "item": message_item(&id, "in_progress", None)}),
            )?;
            self.send(
                "response.content_part.added",
                json!({"item_id": id, "output_index": at, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
            )?;
            self.message = Some((id, String::new()));
        }
        if t.is_empty() {
            return Ok(());
        }
        let (id, text) = self.message.as_mut().expect("opened above");
        text.push_str(t);
        let id = id.clone();
        self.send(
            "response.output_text.delta",
            json!({"item_id": id, "output_index": at, "content_index": 0, "delta": t, "logprobs": []}),
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
        let status = match calls.is_empty() {
            true => status_of(&reason),
            false => "completed",
        };
        // Failing here means the client has gone: nothing is left to do.
        let _ = self.end(text, calls, status).and_then(|_| {
            let u = usage(self.input, cached, generated);
            let done = response(
                &self.id,
                self.created,
                &self.echo,
                status,
                &self.output,
                Some(u),
            );
            let name = match status {
                "completed" => "response.completed",
                _ => "response.incomplete",
            };
            self.send(name, json!({"response": done}))
        });
    }

    fn failed(&mut self, e: ApiError) {
        let _ = self.send("error", json!({"code": e.kind, "message": e.message}));
    }
}

impl Events {
    fn send(&mut self, kind: &str, mut v: Value) -> Result<(), ()> {
        v["type"] = json!(kind);
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        self.tx
            .send(Ok(SseEvent::default().event(kind).data(v.to_string())))
            .map_err(|_| ())
    }

    /// The rest of the text, the message item closed, then the calls. A reply without calls
    /// keeps its message item, if empty.
    fn end(&mut self, text: &str, calls: &[ToolCall], status: &str) -> Result<(), ()> {
        if !text.is_empty() || calls.is_empty() {
            self.text(text)?;
        }
        if let Some((id, text)) = self.message.take() {
            let at = self.output.len();
            self.send(
                "response.output_text.done",
                json!({"item_id": id, "output_index": at, "content_index": 0, "text": text, "logprobs": []}),
            )?;
            self.send(
                "response.content_part.done",
                json!({"item_id": id, "output_index": at, "content_index": 0,
                    "part": {"type": "output_text", "text": text, "annotations": [], "logprobs": []}}),
            )?;
            let item = message_item(&id, status, Some(&text));
            self.send(
                "response.output_item.done",
                json!({"output_index": at, "item": item}),
            )?;
            self.output.push(item);
        }
        for c in calls {
            let at = self.output.len();
            let id = request_id("fc_");
            let mut item = call_item(&id, c, "", "in_progress");
            self.send(
                "response.output_item.added",
                json!({"output_index": at, "item": item}),
            )?;
            self.send(
                "response.function_call_arguments.delta",
                json!({"item_id": id, "output_index": at, "delta": c.arguments}),
            )?;
            self.send(
                "response.function_call_arguments.done",
                json!({"item_id": id, "output_index": at, "arguments": c.arguments}),
            )?;
            item["arguments"] = json!(c.arguments);
            item["status"] = json!("completed");
            self.send(
                "response.output_item.done",
                json!({"output_index": at, "item": item}),
            )?;
            self.output.push(item);
        }
        Ok(())
    }
}
