//! Chat completions' `response_format` and `tools`: what they ask of decoding (a grammar for
//! the engine), how tools and tool messages reach the chat template, and how tool calls in the
//! generated text come back as OpenAI `tool_calls`.
//!
//! Call formats: Hermes / Qwen `<tool_call>{"name", "arguments"}</tool_call>` and llama-3's bare
//! `{"name", "parameters"}`. A template that reads `tools` renders them itself; for one that does
//! not (SmolLM2's) the definitions go into the system message with the Hermes format spelled
//! out. `tool_choice: "required"` or a named function constrains decoding to a well-formed call.

use serde_json::{json, Value};

use super::api::ApiError;
use crate::engine::constraint::compact_json_options;
use crate::engine::Grammar;

/// The grammar `response_format` asks for (none for text).
pub fn response_grammar(format: Option<&Value>) -> Result<Option<Grammar>, ApiError> {
    let bad = |m: &str| Err(ApiError::invalid(m).param("response_format"));
    let Some(f) = format else {
        return Ok(None);
    };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::JsonObject)),
        Some("json_schema") => {
            let Some(js) = f.get("json_schema").and_then(Value::as_object) else {
                return bad("response_format json_schema needs a 'json_schema' object");
            };
            if !js.get("name").is_some_and(Value::is_string) {
                return bad("response_format json_schema needs a 'name'");
            }
            match js.get("schema") {
                None => Ok(Some(Grammar::JsonObject)),
                Some(s) if s.is_object() => Ok(Some(Grammar::JsonSchema(s.clone()))),
                Some(_) => bad("response_format json_schema 'schema' must be an object"),
            }
        }
        Some(other) => bad(&format!(
            "response_format type '{other}' is not one of text, json_object, json_schema"
        )),
        None => bad("response_format needs a 'type'"),
    }
}

/// How a model writes a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallFormat {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen, and our prompt
    /// for templates without tools).
    Hermes,
    /// `{"name": ..., "parameters": {...}}` (llama-3.1/3.2 JSON tool calling).
    Llama3,
}

#[derive(Debug, Clone)]
pub struct ToolDef {
    pub name: String,
    /// The arguments' JSON schema.
    pub parameters: Value,
}

/// Tools in play for one request.
#[derive(Debug, Clone)]
pub struct Tools {
    pub defs: Vec<ToolDef>,
    /// The request's `tools` list as given (what a template renders).
    pub raw: Value,
    /// Calls must be made: to any tool (`required`) or to this one.
    pub forced: Option<Option<String>>,
    pub format: CallFormat,
    /// The template renders `tools` itself.
    pub in_template: bool,
}

/// The request's `tools` and `tool_choice`; `None` when no tool can be called (none given, or
/// `tool_choice: "none"`).
pub fn parse_tools(
    tools: Option<&Value>,
    choice: Option<&Value>,
    template_uses_tools: bool,
    template_source_has: impl Fn(&str) -> bool,
) -> Result<Option<Tools>, ApiError> {
    let bad_tools = |m: String| Err(ApiError::invalid(m).param("tools"));
    let list = match tools {
        None | Some(Value::Null) => &[][..],
        Some(Value::Array(a)) => &a[..],
        Some(_) => return bad_tools("tools must be a list".into()),
    };
    let mut defs = Vec::new();
    for (i, t) in list.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return bad_tools(format!(
                "tools[{i}]: only tools of type 'function' are supported"
            ));
        }
        let Some(f) = t.get("function") else {
            return bad_tools(format!("tools[{i}] needs a 'function' object"));
        };
        let Some(name) = f
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
        else {
            return bad_tools(format!("tools[{i}].function needs a 'name'"));
        };
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p) if p.is_object() => p.clone(),
            Some(_) => {
                return bad_tools(format!(
                    "tools[{i}].function.parameters must be a JSON schema object"
                ))
            }
        };
        if defs.iter().any(|d: &ToolDef| d.name == name) {
            return bad_tools(format!("two tools are named '{name}'"));
        }
        defs.push(ToolDef {
            name: name.to_string(),
            parameters,
        });
    }
    let bad_choice = |m: String| Err(ApiError::invalid(m).param("tool_choice"));
    let forced = match choice {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => match s.as_str() {
            "none" => return Ok(None),
            "auto" => None,
            "required" => Some(None),
            other => {
                return bad_choice(format!(
                    "tool_choice '{other}' is not one of none, auto, required"
                ))
            }
        },
        Some(o) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            match (o.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(n)) if defs.iter().any(|d| d.name == n) => {
                    Some(Some(n.to_string()))
                }
                (Some("function"), Some(n)) => {
                    return bad_choice(format!("tool_choice names '{n}', which is not in tools"))
                }
                _ => {
                    return bad_choice(
                        "tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}"
                            .into(),
                    )
                }
            }
        }
    };
    if defs.is_empty() {
        if forced.is_some() {
            return bad_choice("tool_choice asks for a call but no tools are given".into());
        }
        return Ok(None);
    }
    // A template that spells `<tool_call>` uses Hermes; one with llama-3's `ipython` role and
    // no such tag calls with bare JSON; ours (no tools in the template) uses Hermes.
    let format = if template_uses_tools
        && !template_source_has("<tool_call>")
        && template_source_has("ipython")
    {
        CallFormat::Llama3
    } else {
        CallFormat::Hermes
    };
    Ok(Some(Tools {
        defs,
        raw: Value::Array(list.to_vec()),
        forced,
        format,
        in_template: template_uses_tools,
    }))
}

impl Tools {
    /// The grammar of one call when a call is forced.
    pub fn grammar(&self) -> Option<Grammar> {
        let only = self.forced.as_ref()?;
        let args_key = match self.format {
            CallFormat::Hermes => "arguments",
            CallFormat::Llama3 => "parameters",
        };
        let one = |d: &ToolDef| {
            json!({
                "type": "object",
                "properties": {"name": {"const": d.name}, args_key: d.parameters},
                "required": ["name", args_key],
                "additionalProperties": false,
            })
        };
        let options: Vec<Value> = self
            .defs
            .iter()
            .filter(|d| only.as_ref().is_none_or(|n| &d.name == n))
            .map(one)
            .collect();
        let mut schema = if options.len() == 1 {
            options.into_iter().next().expect("one option")
        } else {
            json!({"anyOf": options})
        };
        schema["x-guidance"] = compact_json_options();
        let call = format!("%json {schema}");
        Some(Grammar::Lark(match self.format {
            CallFormat::Hermes => {
                format!("start: \"<tool_call>\\n\" call \"\\n</tool_call>\"\ncall: {call}\n")
            }
            CallFormat::Llama3 => format!("start: {call}\n"),
        }))
    }

    /// The system text that teaches a template without tools the Hermes call format.
    fn system_text(&self) -> String {
        let mut defs = String::new();
        for t in self.raw.as_array().into_iter().flatten() {
            let f = t.get("function").unwrap_or(t);
            defs.push_str(&f.to_string());
            defs.push('\n');
        }
        format!(
            "You can call functions. Their signatures, as JSON, are inside <tools></tools>:\n\
             <tools>\n{defs}</tools>\n\
             To call one, reply with a JSON object holding its name and arguments inside \
             <tool_call></tool_call> tags:\n\
             <tool_call>\n{{\"name\": <function-name>, \"arguments\": <arguments-object>}}\n</tool_call>"
        )
    }
}

/// A message's `tool_calls` as a template expects them: `arguments` as an object where the
/// client sent a JSON string (transformers templates iterate over or `tojson` them).
fn template_calls(calls: &Value) -> Value {
    let mut calls = calls.clone();
    for c in calls.as_array_mut().into_iter().flatten() {
        if let Some(a) = c.pointer_mut("/function/arguments") {
            if let Some(parsed) = a
                .as_str()
                .and_then(|s| serde_json::from_str::<Value>(s).ok())
            {
                *a = parsed;
            }
        }
    }
    calls
}

/// One input message: role, text, and the tool fields OpenAI allows.
pub struct InMessage {
    pub role: String,
    pub content: String,
    pub tool_calls: Option<Value>,
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

impl InMessage {
    /// A plain message (no tool fields).
    pub fn new(role: &str, content: String) -> Self {
        InMessage {
            role: role.to_string(),
            content,
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// The messages as the template's JSON input. With `tools` the template cannot render, the
/// definitions join the system message, past calls become `<tool_call>` text and tool results
/// `<tool_response>` user turns.
pub fn template_messages(messages: &[InMessage], tools: Option<&Tools>, native: bool) -> Value {
    let mut out = Vec::new();
    if let Some(t) = tools.filter(|t| !t.in_template) {
        let text = t.system_text();
        match messages.first() {
            Some(m) if m.role == "system" => {}
            _ => out.push(json!({"role": "system", "content": text})),
        }
    }
    for (i, m) in messages.iter().enumerate() {
        let mut content = m.content.clone();
        if i == 0 && m.role == "system" {
            if let Some(t) = tools.filter(|t| !t.in_template) {
                content = format!("{content}\n\n{}", t.system_text());
            }
        }
        if native {
            let mut v = json!({"role": m.role, "content": content});
            if let Some(c) = &m.tool_calls {
                v["tool_calls"] = template_calls(c);
            }
            if let Some(id) = &m.tool_call_id {
                v["tool_call_id"] = json!(id);
            }
            if let Some(n) = &m.name {
                v["name"] = json!(n);
            }
            out.push(v);
            continue;
        }
        match (m.role.as_str(), &m.tool_calls) {
            ("tool", _) => out.push(json!({
                "role": "user",
                "content": format!("<tool_response>\n{content}\n</tool_response>"),
            })),
            ("assistant", Some(calls)) => {
                for c in template_calls(calls).as_array().into_iter().flatten() {
                    let f = c.get("function").unwrap_or(c);
                    let call = json!({
                        "name": f.get("name").cloned().unwrap_or(Value::Null),
                        "arguments": f.get("arguments").cloned().unwrap_or(json!({})),
                    });
                    if !content.is_empty() {
                        content.push('\n');
                    }
                    content.push_str(&format!("<tool_call>\n{call}\n</tool_call>"));
                }
                out.push(json!({"role": "assistant", "content": content}));
            }
            _ => out.push(json!({"role": m.role, "content": content})),
        }
    }
    Value::Array(out)
}

/// A call found in the output.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as a JSON text (OpenAI's `function.arguments`).
    pub arguments: String,
}

impl ToolCall {
    pub fn to_openai(&self, id: &str) -> Value {
        json!({"id": id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// A call object `{"name", "arguments" | "parameters"}` naming a known tool.
fn call_of(v: &Value, tools: &Tools) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?;
    if !tools.defs.iter().any(|d| d.name == name) {
        return None;
    }
    let args = v
        .get("arguments")
        .or_else(|| v.get("parameters"))
        .cloned()
        .unwrap_or_else(|| json!({}));
    // Some models write the arguments as a JSON string.
    let args = match args {
        Value::String(s) => serde_json::from_str::<Value>(&s).ok()?,
        a => a,
    };
    if !args.is_object() {
        return None;
    }
    Some(ToolCall {
        name: name.to_string(),
        arguments: args.to_string(),
    })
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

/// Splits generated text into content and tool calls. Text that does not parse as a call to a
/// known tool stays content.
pub fn parse_calls(text: &str, tools: &Tools) -> (String, Vec<ToolCall>) {
    let mut calls = Vec::new();
    let mut content = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(OPEN) {
        let after = &rest[at + OPEN.len()..];
        let (inner, block_end) = match after.find(CLOSE) {
            Some(end) => (&after[..end], at + OPEN.len() + end + CLOSE.len()),
            None => (after, rest.len()),
        };
        match serde_json::from_str::<Value>(inner.trim())
            .ok()
            .and_then(|v| call_of(&v, tools))
        {
            Some(c) => {
                content.push_str(&rest[..at]);
                calls.push(c);
            }
            None => content.push_str(&rest[..block_end]),
        }
        rest = &rest[block_end..];
    }
    content.push_str(rest);
    if calls.is_empty() {
        // llama-3 style: the whole reply is one call object, or a list of them.
        let body = text.trim().trim_start_matches(PYTHON_TAG).trim();
        if let Ok(v) = serde_json::from_str::<Value>(body) {
            let items = match &v {
                Value::Array(a) => a.iter().collect(),
                o => vec![o],
            };
            let found: Option<Vec<ToolCall>> = items.iter().map(|o| call_of(o, tools)).collect();
            if let Some(found) = found.filter(|f| !f.is_empty()) {
                return (String::new(), found);
            }
        }
        return (text.to_string(), calls);
    }
    (content.trim().to_string(), calls)
}

/// Streams content while holding back what may be a tool call: from a `<tool_call>` tag (or a
/// reply that opens with `{`, `[` or `<|python_tag|>`) everything is kept until the end, where
/// [`parse_calls`] decides.
#[derive(Debug, Default)]
pub struct CallFilter {
    held: String,
    capturing: bool,
    /// Content other than whitespace went out already: a bare-JSON call can no longer start.
    spoke: bool,
}

impl CallFilter {
    /// The text that can go out now.
    pub fn push(&mut self, text: &str) -> String {
        self.held.push_str(text);
        if self.capturing {
            return String::new();
        }
        if let Some(at) = self.held.find(OPEN) {
            self.capturing = true;
            let out: String = self.held.drain(..at).collect();
            return out;
        }
        let lead = self.held.trim_start();
        if !self.spoke {
            if lead.starts_with('{') || lead.starts_with('[') || lead.starts_with(PYTHON_TAG) {
                self.capturing = true;
                return String::new();
            }
            if lead.is_empty() || PYTHON_TAG.starts_with(lead) {
                return String::new();
            }
        }
        // Keep a tail that could still grow into the opening tag.
        let keep = (1..OPEN.len().min(self.held.len() + 1))
            .rev()
            .find(|&k| {
                self.held.is_char_boundary(self.held.len() - k)
                    && OPEN.starts_with(&self.held[self.held.len() - k..])
            })
            .unwrap_or(0);
        let out: String = self.held.drain(..self.held.len() - keep).collect();
        if !out.trim().is_empty() {
            self.spoke = true;
        }
        out
    }

    /// What was held back, split into content and calls.
    pub fn finish(&mut self, tools: &Tools) -> (String, Vec<ToolCall>) {
        let held = std::mem::take(&mut self.held);
        parse_calls(&held, tools)
    }
}

/// Where a streamed reply of one choice goes (the Anthropic and Responses streams). `text` fails
/// once the client has gone.
pub trait ReplySink {
    fn text(&mut self, t: &str) -> Result<(), ()>;
    /// The reply's rest of text and its calls (`generated`: tokens it took).
    fn done(
        &mut self,
        text: &str,
        calls: &[ToolCall],
        reason: crate::engine::FinishReason,
        cached: usize,
        generated: usize,
    );
    fn failed(&mut self, e: ApiError);
}

/// Drives one choice's updates into `sink`: text as it comes, except what may be a tool call
/// (held back to the end, where [`parse_calls`] decides), then the rest and the calls.
pub async fn drive_reply(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<(usize, super::api::ChoiceUpdate)>,
    tools: Option<&Tools>,
    sink: &mut impl ReplySink,
) {
    use super::api::ChoiceUpdate;
    let mut filter = CallFilter::default();
    let mut generated = 0usize;
    while let Some((_, u)) = rx.recv().await {
        match u {
            ChoiceUpdate::Token { mut text, .. } => {
                generated += 1;
                if tools.is_some() {
                    text = filter.push(&text);
                }
                if !text.is_empty() && sink.text(&text).is_err() {
                    return;
                }
            }
            ChoiceUpdate::Done {
                reason,
                mut text,
                cached,
            } => {
                let mut calls = Vec::new();
                if let Some(t) = tools {
                    let pushed = filter.push(&text);
                    let (rest, found) = filter.finish(t);
                    text = pushed + &rest;
                    calls = found;
                }
                sink.done(&text, &calls, reason, cached, generated);
                return;
            }
            ChoiceUpdate::Failed(e) => {
                sink.failed(e);
                return;
            }
        }
    }
}

/// What `response_format` and `tools` make of one chat request.
pub struct ChatPlan {
    pub tools: Option<Tools>,
    /// The constraint each choice decodes under.
    pub constraint: Option<crate::engine::Constraint>,
}

/// Reads `response_format`, `tools` and `tool_choice`, and compiles the grammar they ask for.
pub async fn plan(
    s: &std::sync::Arc<super::AppState>,
    response_format: Option<&Value>,
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
) -> Result<ChatPlan, ApiError> {
    let from_format = response_grammar(response_format)?;
    let tools = read_tools(s, tools, tool_choice)?;
    let constraint = constraint(s, tools.as_ref(), from_format).await?;
    Ok(ChatPlan { tools, constraint })
}

/// The request's `tools` and `tool_choice` as the chat template will render them (see
/// [`parse_tools`]).
pub fn read_tools(
    s: &super::AppState,
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
) -> Result<Option<Tools>, ApiError> {
    let source = s
        .model
        .tokenizer()
        .ok()
        .and_then(|t| t.chat_template_source())
        .unwrap_or_default();
    parse_tools(tools, tool_choice, source.contains("tools"), |p| {
        source.contains(p)
    })
}

/// The constraint a request decodes under: a forced call's grammar, else `response_format`'s
/// (`from_format`), compiled off the async threads (the tokenizer's grammar engine is built on
/// first use).
pub async fn constraint(
    s: &std::sync::Arc<super::AppState>,
    tools: Option<&Tools>,
    from_format: Option<Grammar>,
) -> Result<Option<crate::engine::Constraint>, ApiError> {
    let (grammar, param) = match tools.and_then(Tools::grammar) {
        Some(g) => (Some(g), "tools"),
        None => (from_format, "response_format"),
    };
    let Some(grammar) = grammar else {
        return Ok(None);
    };
    let st = s.clone();
    let compiled = tokio::task::spawn_blocking(move || {
        let c = st
            .model
            .constrainer()
            .map_err(|e| ApiError::invalid(e.to_string()))?;
        c.compile(&grammar)
            .map_err(|e| ApiError::invalid(format!("invalid {param}: {e}")).param(param))
    })
    .await
    .map_err(|e| {
        ApiError::new(
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            "api_error",
            format!("compiling the grammar failed: {e}"),
        )
    })??;
    Ok(Some(compiled))
}

/// Whether the conversation needs the structured rendering (tools, or tool turns in it).
pub fn needs_json_render(messages: &[InMessage], tools: Option<&Tools>) -> bool {
    tools.is_some()
        || messages
            .iter()
            .any(|m| m.role == "tool" || m.tool_calls.is_some())
}

/// The prompt ids of a conversation with tools (and the request's `chat_template_kwargs`).
pub fn prompt_with_tools(
    tok: &trellm_tokenizer::Tokenizer,
    messages: &[InMessage],
    tools: Option<&Tools>,
    kwargs: Option<&serde_json::Map<String, Value>>,
) -> Result<Vec<u32>, ApiError> {
    let native = tok.template_uses_tools();
    let msgs = template_messages(messages, tools, native);
    let raw = tools.filter(|t| t.in_template).map(|t| &t.raw);
    let text = tok
        .apply_chat_template_json(&msgs, raw, true, kwargs)
        .map_err(|e| ApiError::invalid(e.to_string()).param("messages"))?;
    tok.encode(&text, false)
        .map_err(|e| ApiError::invalid(e.to_string()).param("messages"))
}

/// A conversation's prompt ids: through the template's JSON rendering where tools or tool turns
/// (or `chat_template_kwargs`) are in play, else the plain chat prompt.
pub fn chat_ids(
    s: &super::AppState,
    messages: Vec<InMessage>,
    tools: Option<&Tools>,
    kwargs: Option<&serde_json::Map<String, Value>>,
) -> Result<Vec<u32>, ApiError> {
    if kwargs.is_some() || needs_json_render(&messages, tools) {
        let tok = s
            .model
            .tokenizer()
            .map_err(|e| ApiError::invalid(e.to_string()))?;
        return prompt_with_tools(tok, &messages, tools, kwargs);
    }
    let messages: Vec<trellm_tokenizer::ChatMessage> = messages
        .into_iter()
        .map(|m| trellm_tokenizer::ChatMessage::new(m.role, m.content))
        .collect();
    s.model
        .chat_prompt(&messages)
        .map_err(|e| ApiError::invalid(e.to_string()).param("messages"))
}

/// A finished choice's `message` and, when it called tools, the finish reason `tool_calls`.
pub fn chat_message(text: &str, tools: Option<&Tools>) -> (Value, Option<&'static str>) {
    if let Some(t) = tools {
        let (content, calls) = parse_calls(text, t);
        if !calls.is_empty() {
            let calls: Vec<Value> = calls
                .iter()
                .map(|c| c.to_openai(&super::api::request_id("call_")))
                .collect();
            let content = (!content.is_empty()).then_some(content);
            return (
                json!({"role": "assistant", "content": content, "tool_calls": calls}),
                Some("tool_calls"),
            );
        }
    }
    (json!({"role": "assistant", "content": text}), None)
}

/// The streaming `delta` of a choice's calls (each whole, in one chunk).
pub fn calls_delta(calls: &[ToolCall]) -> Value {
    let calls: Vec<Value> = calls
        .iter()
        .enumerate()
        .map(|(k, c)| {
            let mut v = c.to_openai(&super::api::request_id("call_"));
            v["index"] = json!(k);
            v
        })
        .collect();
    json!({"tool_calls": calls})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Tools {
        parse_tools(
            Some(
                &json!([{"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}}]),
            ),
            Some(&json!("required")),
            false,
            |_| false,
        )
        .unwrap()
        .unwrap()
    }

    #[test]
    fn hermes_and_llama_calls_parse() {
        let t = tools();
        let (c, calls) = parse_calls(
            "ok <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            &t,
        );
        assert_eq!(c, "ok");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].arguments, r#"{"city":"Paris"}"#);
        let (c, calls) = parse_calls(
            "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}",
            &t,
        );
        assert!(c.is_empty());
        assert_eq!(calls[0].name, "get_weather");
        // Unknown tools and broken JSON stay text.
        let s = "<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>";
        assert_eq!(parse_calls(s, &t), (s.to_string(), vec![]));
        let s = "<tool_call>{\"name\": ";
        assert_eq!(parse_calls(s, &t).1, vec![]);
    }

    #[test]
    fn filter_holds_calls_and_passes_text() {
        let t = tools();
        let mut f = CallFilter::default();
        let mut out = String::new();
        for piece in [
            "Hel",
            "lo <tool",
            "_call>\n{\"name\": \"get_weather\", ",
            "\"arguments\": {\"city\": \"X\"}}\n</tool_call>",
        ] {
            out.push_str(&f.push(piece));
        }
        assert_eq!(out, "Hello ");
        let (rest, calls) = f.finish(&t);
        assert_eq!((rest.as_str(), calls.len()), ("", 1));
        // A `<` that does not become the tag goes out.
        let mut f = CallFilter::default();
        let mut out = f.push("a <");
        out.push_str(&f.push("b"));
        assert_eq!(out, "a <b");
    }

    #[test]
    fn forced_call_grammars_take_only_calls_to_the_tools() {
        let c = crate::engine::Constrainer::single_byte();
        let mut t = tools();
        let hermes = c.compile(&t.grammar().unwrap()).unwrap();
        let good = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        let mut k = hermes.clone();
        assert!(k.accepts_bytes(good));
        assert!(k.is_accepting());
        assert!(!hermes
            .clone()
            .accepts_bytes("<tool_call>\n{\"name\": \"other\""));
        assert!(!hermes
            .clone()
            .accepts_bytes("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}"));
        t.format = CallFormat::Llama3;
        let mut k = c.compile(&t.grammar().unwrap()).unwrap();
        assert!(
            k.accepts_bytes("{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}")
        );
        assert!(k.is_accepting());
    }

    #[test]
    fn template_formats_and_native_messages() {
        let list = json!([{"type": "function", "function": {"name": "f"}}]);
        let fmt = |src: &'static str| {
            parse_tools(Some(&list), None, src.contains("tools"), |p| {
                src.contains(p)
            })
            .unwrap()
            .unwrap()
            .format
        };
        assert_eq!(fmt("{{ tools }} <tool_call>"), CallFormat::Hermes);
        assert_eq!(fmt("{{ tools }} ipython"), CallFormat::Llama3);
        assert_eq!(fmt("no tool support"), CallFormat::Hermes);
        assert!(
            parse_tools(Some(&list), Some(&json!("none")), true, |_| true)
                .unwrap()
                .is_none()
        );
        let msgs = [
            InMessage {
                role: "assistant".into(),
                content: String::new(),
                tool_calls: Some(json!([{"id": "c1", "type": "function",
                    "function": {"name": "f", "arguments": "{\"x\": 1}"}}])),
                tool_call_id: None,
                name: None,
            },
            InMessage {
                role: "tool".into(),
                content: "42".into(),
                tool_calls: None,
                tool_call_id: Some("c1".into()),
                name: None,
            },
        ];
        // Native: the template gets the calls with object arguments and the tool turn as is.
        let v = template_messages(&msgs, None, true);
        assert_eq!(
            v[0]["tool_calls"][0]["function"]["arguments"],
            json!({"x": 1})
        );
        assert_eq!(
            (v[1]["role"].as_str(), v[1]["tool_call_id"].as_str()),
            (Some("tool"), Some("c1"))
        );
        // Without tool support: a system message with the tools, calls and results as text.
        let t = parse_tools(Some(&list), None, false, |_| false)
            .unwrap()
            .unwrap();
        let v = template_messages(&msgs, Some(&t), false);
        assert!(v[0]["content"].as_str().unwrap().contains("<tools>"));
        let call = v[1]["content"].as_str().unwrap();
        let inner = call
            .strip_prefix("<tool_call>\n")
            .and_then(|c| c.strip_suffix("\n</tool_call>"))
            .unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(inner).unwrap(),
            json!({"name": "f", "arguments": {"x": 1}})
        );
        assert_eq!(v[2]["content"], "<tool_response>\n42\n</tool_response>");
    }

    #[test]
    fn bad_tool_fields_are_400s() {
        for (tools, choice) in [
            (json!({"a": 1}), json!("auto")),
            (json!([{"type": "function", "function": {}}]), json!("auto")),
            (
                json!([{"type": "function", "function": {"name": "f"}}]),
                json!("sometimes"),
            ),
            (
                json!([{"type": "function", "function": {"name": "f"}}]),
                json!({"type": "function", "function": {"name": "g"}}),
            ),
            (json!([]), json!("required")),
        ] {
            let e = parse_tools(Some(&tools), Some(&choice), false, |_| false).unwrap_err();
            assert_eq!(e.status, 400);
        }
        assert!(response_grammar(Some(&json!({"type": "yaml"}))).is_err());
        assert!(response_grammar(Some(
            &json!({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}})
        ))
        .is_err());
    }
}
