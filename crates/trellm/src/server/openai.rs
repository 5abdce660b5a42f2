//! OpenAI's endpoints: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, streamed as
//! the official client parses them (a role chunk, content deltas, a chunk with the
//! finish_reason, a usage chunk with `choices: []` when asked, then `data: [DONE]`).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::api::{
    collect, invalid_sampling, parse, request_id, start, ApiError, Choice, ChoiceUpdate, OneOrMany,
};
use super::tools::{self, CallFilter, Tools};
use super::{authorized, unix_time, AppState};
use crate::engine::{Request, SamplerParams, Step};

/// Most choices a request may ask for.
const MAX_N: usize = 16;
/// Most top logprobs a token may report (OpenAI's limit).
const MAX_TOP_LOGPROBS: usize = 20;

#[derive(Deserialize, Debug)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Deserialize, Debug)]
struct Message {
    role: String,
    content: Option<Content>,
    /// An assistant turn's calls, a tool turn's id and name (see `tools`).
    tool_calls: Option<Value>,
    tool_call_id: Option<String>,
    name: Option<String>,
}

#[derive(Deserialize, Debug, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The sampling and length fields both endpoints take.
#[derive(Deserialize, Debug, Default)]
struct Sampling {
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    logit_bias: Option<BTreeMap<String, f32>>,
    seed: Option<u64>,
    stop: Option<OneOrMany>,
    n: Option<usize>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct ChatRequest {
    model: Option<String>,
    messages: Vec<Message>,
    #[serde(flatten)]
    sampling: Sampling,
    logprobs: Option<bool>,
    top_logprobs: Option<usize>,
    response_format: Option<Value>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    /// More variables for the chat template (e.g. `{"enable_thinking": false}`).
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    #[allow(dead_code)]
    user: Option<String>,
    // Accepted and ignored, as other local servers do.
    #[allow(dead_code)]
    parallel_tool_calls: Option<bool>,
    #[allow(dead_code)]
    metadata: Option<Value>,
    #[allow(dead_code)]
    store: Option<bool>,
    // What tunes OpenAI's service or its reasoning models: nothing here.
    #[allow(dead_code)]
    service_tier: Option<Value>,
    #[allow(dead_code)]
    prompt_cache_key: Option<String>,
    #[allow(dead_code)]
    safety_identifier: Option<String>,
    #[allow(dead_code)]
    reasoning_effort: Option<Value>,
    #[allow(dead_code)]
    verbosity: Option<Value>,
    #[allow(dead_code)]
    prompt_cache_options: Option<Value>,
    #[allow(dead_code)]
    prompt_cache_retention: Option<Value>,
    /// Output kinds: text only here.
    modalities: Option<Vec<String>>,
}

/// `/v1/completions`' prompt: one text or token list, or a batch of either (each prompt's `n`
/// choices follow the previous prompt's, as OpenAI numbers them).
#[derive(Deserialize, Debug)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

/// The most prompts one completions request may batch.
const MAX_PROMPTS: usize = 64;

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct CompletionRequest {
    model: Option<String>,
    prompt: Prompt,
    #[serde(flatten)]
    sampling: Sampling,
    logprobs: Option<usize>,
    echo: Option<bool>,
    #[allow(dead_code)]
    user: Option<String>,
}

impl Sampling {
    /// One engine request per choice (choice `i` seeded with `seed + i`).
    fn requests(
        &self,
        s: &AppState,
        prompt: Vec<u32>,
        logprobs: usize,
    ) -> Result<Vec<Request>, ApiError> {
        let n = self.n.unwrap_or(1);
        if n == 0 || n > MAX_N {
            return Err(ApiError::invalid(format!("n must be in 1..={MAX_N}")).param("n"));
        }
        let cfg = &s.model.model.cfg;
        let room = cfg.max_context.saturating_sub(prompt.len());
        if room == 0 {
            return Err(ApiError::invalid(format!(
                "the prompt has {} tokens; the model's context is {} tokens",
                prompt.len(),
                cfg.max_context
            ))
            .param("messages"));
        }
        let max_tokens = self
            .max_completion_tokens
            .or(self.max_tokens)
            .unwrap_or(room.min(4096));
        if max_tokens > room {
            return Err(ApiError::invalid(format!(
                "the prompt ({} tokens) and max_tokens ({max_tokens}) exceed the model's context of {} tokens",
                prompt.len(),
                cfg.max_context
            ))
            .param("max_tokens"));
        }
        let logit_bias = match &self.logit_bias {
            None => Vec::new(),
            Some(m) => m
                .iter()
                .map(|(k, &v)| {
                    k.trim().parse::<u32>().map(|id| (id, v)).map_err(|_| {
                        ApiError::invalid(format!("logit_bias key '{k}' is not a token id"))
                            .param("logit_bias")
                    })
                })
                .collect::<Result<_, _>>()?,
        };
        // Unset fields: the model's recommendation, then OpenAI's defaults.
        let d = &s.model.sampling;
        let base = SamplerParams {
            temp: self.temperature.or(d.temperature).unwrap_or(1.0),
            top_p: self.top_p.or(d.top_p).unwrap_or(1.0),
            min_p: self.min_p.or(d.min_p).unwrap_or(0.0),
            top_k: self.top_k.or(d.top_k).unwrap_or(0),
            repetition_penalty: self.repetition_penalty.or(d.repetition_penalty),
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias,
            seed: self.seed,
            ..Default::default()
        };
        base.validate(cfg.vocab).map_err(invalid_sampling)?;
        let stop = self
            .stop
            .clone()
            .map(OneOrMany::into_vec)
            .unwrap_or_default();
        if stop.len() > 4 {
            return Err(ApiError::invalid("stop takes at most 4 sequences").param("stop"));
        }
        Ok((0..n)
            .map(|i| Request {
                prompt: prompt.clone(),
                max_tokens,
                sampler: SamplerParams {
                    seed: base.seed.map(|s| s.wrapping_add(i as u64)),
                    ..base.clone()
                },
                logprobs,
                prompt_logprobs: 0,
                eos_ids: s.model.eos_ids(),
                stop: stop.clone(),
                constraint: None,
            })
            .collect())
    }

    fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }
    fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

pub(super) fn check_model(s: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != &s.model_name && !m.is_empty() => Err(ApiError::new(
            axum::http::StatusCode::NOT_FOUND,
            "not_found_error",
            format!(
                "the model '{m}' does not exist; this server serves '{}'",
                s.model_name
            ),
        )
        .param("model")),
        _ => Ok(()),
    }
}

fn text_of(c: Option<Content>) -> Result<String, ApiError> {
    match c {
        None => Ok(String::new()),
        Some(Content::Text(t)) => Ok(t),
        Some(Content::Parts(parts)) => parts
            .into_iter()
            .map(|p| match (p.kind.as_str(), p.text) {
                ("text", Some(t)) => Ok(t),
                (k, _) => Err(ApiError::invalid(format!(
                    "content parts of type '{k}' are not supported"
                ))
                .param("messages")),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|v| v.concat()),
    }
}

fn token_text(s: &AppState, id: u32) -> String {
    s.model
        .tokenizer()
        .and_then(|t| Ok(t.decode(&[id], false)?))
        .unwrap_or_default()
}

/// Chat logprobs of one token: `{token, logprob, bytes, top_logprobs}`.
fn chat_logprob(s: &AppState, step: &Step, top: usize) -> Value {
    let entry = |id: u32, lp: f32| {
        let t = token_text(s, id);
        json!({"token": t, "logprob": lp, "bytes": t.as_bytes()})
    };
    let mut v = entry(step.token, step.logprob);
    v["top_logprobs"] = step
        .top
        .iter()
        .take(top)
        .map(|&(id, lp)| entry(id, lp))
        .collect::<Vec<_>>()
        .into();
    v
}

/// OpenAI's name for how a choice ended (a full context is `length` there).
fn openai_reason(r: &crate::engine::FinishReason) -> &'static str {
    match r {
        crate::engine::FinishReason::Context => "length",
        r => r.as_str(),
    }
}

/// `cached`: prompt tokens whose KV came from the prefix cache.
fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn cached(choices: &[Choice]) -> usize {
    choices.iter().map(|c| c.cached).max().unwrap_or(0)
}

/// Whether the caller speaks Anthropic's API (its clients send `anthropic-version`): `/v1/models`
/// answers in that API's shapes and envelopes then.
fn anthropic_caller(headers: &HeaderMap) -> bool {
    headers.contains_key("anthropic-version")
}

fn model_entry(s: &AppState, anthropic: bool) -> Value {
    match anthropic {
        true => json!({"type": "model", "id": s.model_name, "display_name": s.model_name,
            "created_at": super::rfc3339(s.created)}),
        false => {
            json!({"id": s.model_name, "object": "model", "created": s.created, "owned_by": "trellm"})
        }
    }
}

pub async fn models(State(s): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let anthropic = anthropic_caller(&headers);
    if !authorized(&s, &headers) {
        let e = ApiError::unauthorized();
        return if anthropic { e.anthropic() } else { e.openai() };
    }
    let data = [model_entry(&s, anthropic)];
    axum::Json(match anthropic {
        true => json!({"data": data, "has_more": false, "first_id": s.model_name, "last_id": s.model_name}),
        false => json!({"object": "list", "data": data}),
    })
    .into_response()
}

/// `GET /v1/models/{id}`.
pub async fn model(
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let anthropic = anthropic_caller(&headers);
    let e = if !authorized(&s, &headers) {
        ApiError::unauthorized()
    } else if id != s.model_name {
        ApiError::new(
            axum::http::StatusCode::NOT_FOUND,
            "not_found_error",
            format!(
                "the model '{id}' does not exist; this server serves '{}'",
                s.model_name
            ),
        )
        .param("model")
    } else {
        return axum::Json(model_entry(&s, anthropic)).into_response();
    };
    if anthropic {
        e.anthropic()
    } else {
        e.openai()
    }
}

pub async fn chat_completions(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if !authorized(&s, &headers) {
        return ApiError::unauthorized().openai();
    }
    match chat(s, &body).await {
        Ok(r) => r,
        Err(e) => e.openai(),
    }
}

async fn chat(s: Arc<AppState>, body: &[u8]) -> Result<Response, ApiError> {
    let r: ChatRequest = parse(body)?;
    check_model(&s, &r.model)?;
    if let Some(m) = r.modalities.iter().flatten().find(|m| *m != "text") {
        return Err(ApiError::invalid(format!(
            "modalities: only text is produced here, not '{m}'"
        ))
        .param("modalities"));
    }
    let plan = tools::plan(
        &s,
        r.response_format.as_ref(),
        r.tools.as_ref(),
        r.tool_choice.as_ref(),
    )
    .await?;
    if r.messages.is_empty() {
        return Err(ApiError::invalid("messages must not be empty").param("messages"));
    }
    let messages = r
        .messages
        .into_iter()
        .map(|m| {
            Ok(tools::InMessage {
                role: m.role,
                content: text_of(m.content)?,
                tool_calls: m.tool_calls,
                tool_call_id: m.tool_call_id,
                name: m.name,
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let kwargs = r.chat_template_kwargs.as_ref();
    if let Some(k) = kwargs.and_then(|k| {
        ["messages", "tools", "add_generation_prompt"]
            .into_iter()
            .find(|&n| k.contains_key(n))
    }) {
        return Err(ApiError::invalid(format!(
            "chat_template_kwargs cannot set '{k}': it has its own request field"
        ))
        .param("chat_template_kwargs"));
    }
    let prompt = tools::chat_ids(&s, messages, plan.tools.as_ref(), kwargs)?;
    let top = r.top_logprobs.unwrap_or(0);
    if top > MAX_TOP_LOGPROBS {
        return Err(
            ApiError::invalid(format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}"))
                .param("top_logprobs"),
        );
    }
    let want_lp = r.logprobs.unwrap_or(false);
    let mut reqs = r
        .sampling
        .requests(&s, prompt.clone(), if want_lp { top.max(1) } else { 0 })?;
    for q in &mut reqs {
        q.constraint.clone_from(&plan.constraint);
    }
    let call_tools = plan.tools.map(Arc::new);
    let id = request_id("chatcmpl-");
    let created = unix_time();
    if r.sampling.stream() {
        let rx = start(&s.worker, reqs)?;
        return Ok(stream_chat(
            s,
            rx,
            id,
            created,
            prompt.len(),
            r.sampling.include_usage(),
            want_lp.then_some(top),
            call_tools,
        ));
    }
    let choices = collect(&s.worker, reqs).await?;
    let completion: usize = choices.iter().map(|c| c.steps.len()).sum();
    let out: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let (message, called) = tools::chat_message(&c.text, call_tools.as_deref());
            json!({
                "index": i,
                "message": message,
                "logprobs": want_lp.then(|| json!({"content": c.steps.iter().map(|st| chat_logprob(&s, st, top)).collect::<Vec<_>>()})),
                "finish_reason": called.or(c.reason.as_ref().map(openai_reason)),
            })
        })
        .collect();
    Ok(axum::Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": s.model_name,
        "choices": out,
        "usage": usage(prompt.len(), completion, cached(&choices)),
    }))
    .into_response())
}

fn sse(v: &Value) -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().data(v.to_string()))
}

type SseSender = tokio::sync::mpsc::UnboundedSender<Result<SseEvent, Infallible>>;

/// An error in the middle of a stream (the status line has gone out already).
fn stream_error(tx: &SseSender, e: ApiError) {
    let _ = tx.send(sse(
        &json!({"error": {"message": e.message, "type": e.kind}}),
    ));
}

/// The end of a stream: the usage chunk when it was asked for, then `[DONE]`.
fn end_stream(tx: &SseSender, usage_chunk: Option<Value>) {
    if let Some(u) = usage_chunk {
        let _ = tx.send(sse(&u));
    }
    let _ = tx.send(Ok(SseEvent::default().data("[DONE]")));
}

#[allow(clippy::too_many_arguments)] // one call site; a struct would only rename them
fn stream_chat(
    s: Arc<AppState>,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<(usize, ChoiceUpdate)>,
    id: String,
    created: u64,
    prompt_tokens: usize,
    include_usage: bool,
    logprobs: Option<usize>,
    call_tools: Option<Arc<Tools>>,
) -> Response {
    let (tx, out) = tokio::sync::mpsc::unbounded_channel();
    // The merged receiver ends once every choice has ended.
    tokio::spawn(async move {
        let chunk = |choices: Value| json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": s.model_name, "choices": choices});
        let mut started = std::collections::HashSet::new();
        let mut completion = 0usize;
        let mut cached = 0usize;
        // With tools, text that may be a call is held back per choice until it ends.
        let mut filters: BTreeMap<usize, CallFilter> = BTreeMap::new();
        while let Some((i, u)) = rx.recv().await {
            if started.insert(i) {
                let first = chunk(
                    json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
                );
                if tx.send(sse(&first)).is_err() {
                    return;
                }
            }
            let msg = match u {
                ChoiceUpdate::Token { step, mut text } => {
                    completion += 1;
                    if call_tools.is_some() {
                        text = filters.entry(i).or_default().push(&text);
                    }
                    let lp = logprobs.map(|top| json!({"content": [chat_logprob(&s, &step, top)]}));
                    if text.is_empty() && lp.is_none() {
                        continue;
                    }
                    chunk(
                        json!([{"index": i, "delta": {"content": text}, "logprobs": lp, "finish_reason": null}]),
                    )
                }
                ChoiceUpdate::Done {
                    reason,
                    mut text,
                    cached: c,
                } => {
                    cached = cached.max(c);
                    let mut calls = Vec::new();
                    if let Some(t) = &call_tools {
                        let f = filters.entry(i).or_default();
                        let pushed = f.push(&text);
                        let (rest, found) = f.finish(t);
                        text = pushed + &rest;
                        calls = found;
                    }
                    if !text.is_empty() {
                        let c = chunk(
                            json!([{"index": i, "delta": {"content": text}, "logprobs": null, "finish_reason": null}]),
                        );
                        if tx.send(sse(&c)).is_err() {
                            return;
                        }
                    }
                    let mut finish = openai_reason(&reason);
                    if !calls.is_empty() {
                        let c = chunk(
                            json!([{"index": i, "delta": tools::calls_delta(&calls), "logprobs": null, "finish_reason": null}]),
                        );
                        if tx.send(sse(&c)).is_err() {
                            return;
                        }
                        finish = "tool_calls";
                    }
                    chunk(
                        json!([{"index": i, "delta": {}, "logprobs": null, "finish_reason": finish}]),
                    )
                }
                ChoiceUpdate::Failed(e) => {
                    stream_error(&tx, e);
                    return;
                }
            };
            if tx.send(sse(&msg)).is_err() {
                return;
            }
        }
        let mut u = chunk(json!([]));
        u["usage"] = usage(prompt_tokens, completion, cached);
        end_stream(&tx, include_usage.then_some(u));
    });
    Sse::new(UnboundedReceiverStream::new(out)).into_response()
}

pub async fn completions(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if !authorized(&s, &headers) {
        return ApiError::unauthorized().openai();
    }
    match completion(s, &body).await {
        Ok(r) => r,
        Err(e) => e.openai(),
    }
}

/// Completions logprobs of a choice: `{tokens, token_logprobs, top_logprobs, text_offset}`.
fn completion_logprobs(s: &AppState, c: &Choice, top: usize) -> Value {
    let mut offset = 0;
    let (mut tokens, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for st in &c.steps {
        let t = token_text(s, st.token);
        offsets.push(offset);
        offset += t.len();
        tokens.push(t);
        lps.push(st.logprob);
        let m: serde_json::Map<String, Value> = st
            .top
            .iter()
            .take(top)
            .map(|&(id, lp)| (token_text(s, id), json!(lp)))
            .collect();
        tops.push(Value::Object(m));
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

async fn completion(s: Arc<AppState>, body: &[u8]) -> Result<Response, ApiError> {
    let r: CompletionRequest = parse(body)?;
    check_model(&s, &r.model)?;
    // Each prompt's ids and, with `echo`, its text.
    let encode = |t: &String| -> Result<(Vec<u32>, String), ApiError> {
        let tok = s
            .model
            .tokenizer()
            .map_err(|e| ApiError::invalid(e.to_string()))?;
        let ids = tok
            .encode(t, true)
            .map_err(|e| ApiError::invalid(e.to_string()).param("prompt"))?;
        Ok((ids, t.clone()))
    };
    let prompts: Vec<(Vec<u32>, String)> = match &r.prompt {
        Prompt::Ids(ids) => vec![(ids.clone(), String::new())],
        Prompt::Text(t) => vec![encode(t)?],
        Prompt::IdLists(l) => l.iter().map(|ids| (ids.clone(), String::new())).collect(),
        Prompt::Texts(l) => l.iter().map(encode).collect::<Result<_, _>>()?,
    };
    if prompts.is_empty() || prompts.len() > MAX_PROMPTS {
        return Err(
            ApiError::invalid(format!("prompt takes 1..={MAX_PROMPTS} prompts")).param("prompt"),
        );
    }
    if prompts.iter().any(|(ids, _)| ids.is_empty()) {
        return Err(ApiError::invalid("the prompt is empty").param("prompt"));
    }
    let top = r.logprobs.unwrap_or(0);
    if top > 5 {
        return Err(ApiError::invalid("logprobs must be at most 5").param("logprobs"));
    }
    let mut reqs = Vec::new();
    for (ids, _) in &prompts {
        reqs.extend(r.sampling.requests(
            &s,
            ids.clone(),
            top.max(usize::from(r.logprobs.is_some())),
        )?);
    }
    let n = reqs.len() / prompts.len();
    let prompt_tokens: usize = prompts.iter().map(|(ids, _)| ids.len()).sum();
    // Choice i's echo: its prompt's text when asked for.
    let echo: Vec<String> = match r.echo.unwrap_or(false) {
        true => prompts.into_iter().map(|(_, t)| t).collect(),
        false => vec![String::new(); prompts.len()],
    };
    let id = request_id("cmpl-");
    let created = unix_time();
    if r.sampling.stream() {
        let mut rx = start(&s.worker, reqs)?;
        let include_usage = r.sampling.include_usage();
        let (tx, out) = tokio::sync::mpsc::unbounded_channel();
        let name = s.model_name.clone();
        tokio::spawn(async move {
            let chunk = |choices: Value| json!({"id": id, "object": "text_completion", "created": created, "model": name, "choices": choices});
            let mut completion = 0usize;
            let mut cached = 0usize;
            let mut echoed = std::collections::HashSet::new();
            while let Some((i, u)) = rx.recv().await {
                let mut text = String::new();
                if echoed.insert(i) {
                    text.push_str(&echo[i / n]);
                }
                let msg = match u {
                    ChoiceUpdate::Token { text: t, .. } => {
                        completion += 1;
                        text.push_str(&t);
                        if text.is_empty() {
                            continue;
                        }
                        chunk(
                            json!([{"index": i, "text": text, "logprobs": null, "finish_reason": null}]),
                        )
                    }
                    ChoiceUpdate::Done {
                        reason,
                        text: t,
                        cached: c,
                    } => {
                        cached = cached.max(c);
                        text.push_str(&t);
                        chunk(
                            json!([{"index": i, "text": text, "logprobs": null, "finish_reason": openai_reason(&reason)}]),
                        )
                    }
                    ChoiceUpdate::Failed(e) => {
                        stream_error(&tx, e);
                        return;
                    }
                };
                if tx.send(sse(&msg)).is_err() {
                    return;
                }
            }
            let mut u = chunk(json!([]));
            u["usage"] = usage(prompt_tokens, completion, cached);
            end_stream(&tx, include_usage.then_some(u));
        });
        return Ok(Sse::new(UnboundedReceiverStream::new(out)).into_response());
    }
    let choices = collect(&s.worker, reqs).await?;
    let completion: usize = choices.iter().map(|c| c.steps.len()).sum();
    let out: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({
                "index": i,
                "text": format!("{}{}", echo[i / n], c.text),
                "logprobs": r.logprobs.map(|_| completion_logprobs(&s, c, top)),
                "finish_reason": c.reason.as_ref().map(openai_reason),
            })
        })
        .collect();
    Ok(axum::Json(json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": s.model_name,
        "choices": out,
        "usage": usage(prompt_tokens, completion, cached(&choices)),
    }))
    .into_response())
}

/// `/tokenize` as llama-server (`content`, `add_special` default false) and vLLM (`prompt`,
/// `add_special_tokens` default true) take it; the answer carries both servers' fields.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct TokenizeRequest {
    model: Option<String>,
    content: Option<String>,
    prompt: Option<String>,
    add_special: Option<bool>,
    add_special_tokens: Option<bool>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

/// A JSON answer computed on the spot, behind the API key, errors in OpenAI's envelope.
fn answer(
    s: &AppState,
    headers: &HeaderMap,
    f: impl FnOnce() -> Result<Value, ApiError>,
) -> Response {
    if !authorized(s, headers) {
        return ApiError::unauthorized().openai();
    }
    match f() {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.openai(),
    }
}

pub async fn tokenize(State(s): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    answer(&s, &headers, || {
        let r: TokenizeRequest = parse(&body)?;
        check_model(&s, &r.model)?;
        let (text, special) = match (r.content, r.prompt) {
            (Some(t), None) => (t, r.add_special.or(r.add_special_tokens).unwrap_or(false)),
            (None, Some(t)) => (t, r.add_special_tokens.or(r.add_special).unwrap_or(true)),
            _ => {
                return Err(
                    ApiError::invalid("give the text as 'content' or as 'prompt'").param("content"),
                )
            }
        };
        let tok = s
            .model
            .tokenizer()
            .map_err(|e| ApiError::invalid(e.to_string()))?;
        let ids = tok
            .encode(&text, special)
            .map_err(|e| ApiError::invalid(e.to_string()).param("content"))?;
        Ok(
            json!({"tokens": ids, "count": ids.len(), "max_model_len": s.model.model.cfg.max_context}),
        )
    })
}

pub async fn detokenize(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(&s, &headers, || {
        let r: DetokenizeRequest = parse(&body)?;
        check_model(&s, &r.model)?;
        let vocab = s.model.model.cfg.vocab;
        if let Some(id) = r.tokens.iter().find(|&&id| id as usize >= vocab) {
            return Err(ApiError::invalid(format!(
                "token id {id} is outside the vocabulary (size {vocab})"
            ))
            .param("tokens"));
        }
        let tok = s
            .model
            .tokenizer()
            .map_err(|e| ApiError::invalid(e.to_string()))?;
        let text = tok
            .decode(&r.tokens, false)
            .map_err(|e| ApiError::invalid(e.to_string()).param("tokens"))?;
        Ok(json!({"content": text, "prompt": text}))
    })
}
