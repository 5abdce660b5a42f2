//! Chat templates rendered with minijinja, set up to behave like transformers' jinja2 sandbox:
//! trim_blocks, lstrip_blocks, loop controls, Python string/dict methods, `raise_exception`,
//! a `tojson` that is `json.dumps` (no HTML escaping), `strftime_now`, and the
//! `{% generation %}` block treated as a plain block.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, UndefinedBehavior};
use serde::{Deserialize, Serialize};

use crate::TokenizerError;

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

const NAME: &str = "chat_template";

pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    /// Set when the template failed to compile: reported by every render.
    compile_error: Option<String>,
    /// Special-token strings passed as template variables (`bos_token`, `eos_token`, ...).
    vars: BTreeMap<String, String>,
}

/// Instructions a chat template may run per render.
pub const TEMPLATE_FUEL: u64 = 50_000_000;

impl ChatTemplate {
    pub(crate) fn new(source: &str, vars: BTreeMap<String, String>) -> ChatTemplate {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .expect("default delimiters are valid");
        env.set_syntax(syntax);
        // A template comes from the model file: bound its work so a hostile one (nested loops)
        // ends with an error instead of running for hours. Real templates need a few thousand
        // instructions per message.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        let compile_error = env
            .add_template_owned(NAME, strip_generation_tags(source))
            .err()
            .map(|e| one_line(&e));
        ChatTemplate {
            env,
            compile_error,
            vars,
        }
    }

    /// A template that exists but cannot be used; every render reports `msg`.
    pub(crate) fn broken(msg: String) -> ChatTemplate {
        ChatTemplate {
            env: Environment::new(),
            compile_error: Some(msg),
            vars: BTreeMap::new(),
        }
    }

    pub(crate) fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        if let Some(e) = &self.compile_error {
            return Err(TokenizerError::Template(e.clone()));
        }
        if messages.is_empty() {
            // transformers refuses this too.
            return Err(TokenizerError::Template(
                "cannot render an empty conversation".into(),
            ));
        }
        let mut ctx: BTreeMap<String, Value> = self
            .vars
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        let msgs: Vec<Value> = messages
            .iter()
            .map(|m| {
                Value::from_pairs([
                    ("role", Value::from(m.role.as_str())),
                    ("content", Value::from(m.content.as_str())),
                ])
            })
            .collect();
        ctx.insert("messages".into(), Value::from(msgs));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        ctx.insert("tools".into(), Value::from(()));
        ctx.insert("documents".into(), Value::from(()));
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| TokenizerError::Template(one_line(&e)))?;
        tmpl.render(ctx)
            .map_err(|e| TokenizerError::Template(one_line(&e)))
    }
}

fn one_line(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        let _ = write!(s, ": {inner}");
        src = inner.source();
    }
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// transformers' `{% generation %}...{% endgeneration %}` only marks assistant spans; rendering is
/// unchanged, so it becomes an always-true `if` (keeping any `-` whitespace control).
fn strip_generation_tags(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(pos) = rest.find("{%") {
        out.push_str(&rest[..pos]);
        let tag = &rest[pos..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, trail) = match body.trim_end().strip_suffix(['-', '+']) {
            Some(b) => (b, &body.trim_end()[b.len()..]),
            None => (body, ""),
        };
        match body.trim() {
            "generation" => {
                let _ = write!(out, "{{%{lead} if true {trail}%}}");
            }
            "endgeneration" => {
                let _ = write!(out, "{{%{lead} endif {trail}%}}");
            }
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// Prints `None`/`True`/`False` as Python's `str()` does; everything else as minijinja does.
fn python_formatter(
    out: &mut minijinja::Output,
    state: &mut minijinja::State,
    value: &Value,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.write_str("None").map_err(Error::from),
        ValueKind::Bool => out
            .write_str(if value.is_true() { "True" } else { "False" })
            .map_err(Error::from),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: Value, ensure_ascii: Option<bool>, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii = match kwargs.get::<Option<bool>>("ensure_ascii")? {
        Some(b) => b,
        None => ensure_ascii.unwrap_or(false),
    };
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_string()),
        Some(v) => Some(" ".repeat(usize::try_from(v).map_err(|_| {
            Error::new(
                ErrorKind::InvalidOperation,
                "tojson: indent must be a non-negative integer",
            )
        })?)),
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let opts = JsonOpts {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    let mut out = String::new();
    write_json(&mut out, &value, &opts, 0)?;
    Ok(Value::from_safe_string(out))
}

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn newline(out: &mut String, opts: &JsonOpts, level: usize) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn write_json(out: &mut String, v: &Value, opts: &JsonOpts, level: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                let _ = write!(out, "{v}");
            } else {
                out.push_str(&python_float(f64::try_from(v.clone())?));
            }
        }
        ValueKind::String => json_str(out, v.as_str().unwrap_or(""), opts.ensure_ascii),
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                keys.sort_by_key(key_string);
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, level + 1);
                json_str(out, &key_string(k), opts.ensure_ascii);
                out.push_str(&opts.key_sep);
                write_json(out, &v.get_item(k)?, opts, level + 1)?;
            }
            newline(out, opts, level);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, level + 1);
                write_json(out, item, opts, level + 1)?;
            }
            newline(out, opts, level);
            out.push(']');
        }
        _ => json_str(out, &v.to_string(), opts.ensure_ascii),
    }
    Ok(())
}

/// Python's `json.dumps` turns non-string keys into strings (`True` -> "true", `1` -> "1").
fn key_string(k: &Value) -> String {
    match k.kind() {
        ValueKind::String => k.as_str().unwrap_or("").to_string(),
        ValueKind::None | ValueKind::Undefined => "null".into(),
        ValueKind::Bool => if k.is_true() { "true" } else { "false" }.into(),
        ValueKind::Number if !k.is_integer() => f64::try_from(k.clone())
            .map(python_float)
            .unwrap_or_else(|_| k.to_string()),
        _ => k.to_string(),
    }
}

fn json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form outside 1e-4 <= |x| < 1e16.
pub(crate) fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let sci = format!("{x:e}");
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = format!("{x}");
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        format!("{mant}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    }
}

/// `datetime.now().strftime(fmt)` (UTC; containers rarely have a local zone).
fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&fmt, secs)
}

/// `unix_secs` (UTC) formatted as C's `strftime` does the directives templates use (`%Y`, `%m`,
/// `%d`, `%H`, `%M`, `%S`, month and day names, ...).
pub fn strftime(fmt: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let sod = unix_secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let (hh, mm, ss) = (sod / 3600, sod % 3600 / 60, sod % 60);
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    let wd = (days + 3).rem_euclid(7) as usize;
    let yday = days - days_from_civil(y, 1, 1) + 1;
    let h12 = if hh % 12 == 0 { 12 } else { hh % 12 };
    let mut out = String::new();
    let mut it = fmt.chars().peekable();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let nopad = it.peek() == Some(&'-');
        if nopad {
            it.next();
        }
        let Some(spec) = it.next() else {
            out.push('%');
            break;
        };
        let num = |out: &mut String, v: i64, w: usize| {
            if nopad {
                let _ = write!(out, "{v}");
            } else {
                let _ = write!(out, "{v:0w$}");
            }
        };
        match spec {
            'Y' => {
                let _ = write!(out, "{y}");
            }
            'y' => num(&mut out, y.rem_euclid(100), 2),
            'm' => num(&mut out, m, 2),
            'd' => num(&mut out, d, 2),
            'e' => {
                let _ = write!(out, "{d:2}");
            }
            'H' => num(&mut out, hh, 2),
            'I' => num(&mut out, h12, 2),
            'M' => num(&mut out, mm, 2),
            'S' => num(&mut out, ss, 2),
            'j' => num(&mut out, yday, 3),
            'p' => out.push_str(if hh < 12 { "AM" } else { "PM" }),
            'B' => out.push_str(MONTHS[(m - 1) as usize]),
            'b' | 'h' => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            'A' => out.push_str(DAYS[wd]),
            'a' => out.push_str(&DAYS[wd][..3]),
            'u' => {
                let _ = write!(out, "{}", wd + 1);
            }
            'w' => {
                let _ = write!(out, "{}", (wd + 1) % 7);
            }
            'F' => {
                let _ = write!(out, "{y}-{m:02}-{d:02}");
            }
            'T' => {
                let _ = write!(out, "{hh:02}:{mm:02}:{ss:02}");
            }
            'Z' => out.push_str("UTC"),
            'z' => out.push_str("+0000"),
            '%' => out.push('%'),
            other => {
                out.push('%');
                if nopad {
                    out.push('-');
                }
                out.push(other);
            }
        }
    }
    out
}

// Proleptic Gregorian calendar <-> days since 1970-01-01 (H. Hinnant's algorithms).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// A JSON value as a template value (objects keep their key order).
fn json_value(v: &serde_json::Value) -> Value {
    use serde_json::Value as J;
    match v {
        J::Null => Value::from(()),
        J::Bool(b) => Value::from(*b),
        J::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::from(i),
            (_, Some(u)) => Value::from(u),
            _ => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        J::String(s) => Value::from(s.as_str()),
        J::Array(a) => Value::from(a.iter().map(json_value).collect::<Vec<_>>()),
        J::Object(o) => Value::from_pairs(o.iter().map(|(k, v)| (k.as_str(), json_value(v)))),
    }
}

/// Rendering with structured messages and tools (OpenAI's `tool_calls` / `role: "tool"`
/// messages, a `tools` list), as transformers' `apply_chat_template(messages, tools=...)`.
impl ChatTemplate {
    /// Whether the template reads a `tools` variable (otherwise tool definitions must travel
    /// in a message).
    pub(crate) fn uses_tools(&self) -> bool {
        self.source().is_some_and(|s| s.contains("tools"))
    }

    /// The template's source (none when it failed to compile).
    pub(crate) fn source(&self) -> Option<String> {
        if self.compile_error.is_some() {
            return None;
        }
        self.env
            .get_template(NAME)
            .ok()
            .map(|t| t.source().to_string())
    }

    /// `messages`: a JSON list of message objects (any fields); `tools`: a JSON list or none;
    /// `extra`: more template variables (a request's `chat_template_kwargs`, e.g.
    /// `enable_thinking`), which never replace `messages`, `tools` or `add_generation_prompt`.
    pub(crate) fn render_json(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        extra: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<String, TokenizerError> {
        if let Some(e) = &self.compile_error {
            return Err(TokenizerError::Template(e.clone()));
        }
        if messages.as_array().is_none_or(|m| m.is_empty()) {
            return Err(TokenizerError::Template(
                "cannot render an empty conversation".into(),
            ));
        }
        let mut ctx: BTreeMap<String, Value> = self
            .vars
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        for (k, v) in extra.into_iter().flatten() {
            ctx.insert(k.clone(), json_value(v));
        }
        ctx.insert("messages".into(), json_value(messages));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        ctx.insert("tools".into(), tools.map_or(Value::from(()), json_value));
        ctx.insert("documents".into(), Value::from(()));
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| TokenizerError::Template(one_line(&e)))?;
        tmpl.render(ctx)
            .map_err(|e| TokenizerError::Template(one_line(&e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_like_python() {
        assert_eq!(python_float(1.0), "1.0");
        assert_eq!(python_float(0.1), "0.1");
        assert_eq!(python_float(1e16), "1e+16");
        assert_eq!(python_float(1.5e-7), "1.5e-07");
        assert_eq!(python_float(123456.789), "123456.789");
        assert_eq!(python_float(-2.5), "-2.5");
    }

    #[test]
    fn dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(strftime("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(
            strftime("%A %B %-d, %I %p %j", t),
            "Thursday February 29, 01 PM 060"
        );
    }

    #[test]
    fn json_messages_and_tools_render() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %};{% endfor %}{{ tools | length }}",
            BTreeMap::new(),
        );
        assert!(t.uses_tools());
        let msgs = serde_json::json!([
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
        ]);
        let tools = serde_json::json!([{"type": "function"}, {"type": "function"}]);
        assert_eq!(
            t.render_json(&msgs, Some(&tools), false, None).unwrap(),
            "user:hi;assistant:[f {\"a\": 1}];2"
        );
    }

    #[test]
    fn template_kwargs_are_variables_but_not_the_conversation() {
        let t = ChatTemplate::new(
            "{% if enable_thinking is false %}no-think {% endif %}{{ messages[0].content }}{{ add_generation_prompt }}",
            BTreeMap::new(),
        );
        let msgs = serde_json::json!([{"role": "user", "content": "hi"}]);
        let kw = serde_json::json!({"enable_thinking": false, "messages": [], "add_generation_prompt": false});
        assert_eq!(
            t.render_json(&msgs, None, true, kw.as_object()).unwrap(),
            "no-think hiTrue"
        );
        assert_eq!(t.render_json(&msgs, None, true, None).unwrap(), "hiTrue");
    }

    #[test]
    fn generation_tags() {
        assert_eq!(
            strip_generation_tags("a{% generation %}b{%- endgeneration -%}c{{ x }}"),
            "a{% if true %}b{%- endif -%}c{{ x }}"
        );
    }
}
