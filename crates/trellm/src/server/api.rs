//! What the OpenAI and Anthropic endpoints share: error envelopes, sampling fields, and running a
//! request's choices on the engine (collected, or streamed as they come).

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::worker::{Update, Worker};
use crate::engine::{EngineError, Event, FinishReason, Request, Step};

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI's `type` / Anthropic's `error.type`.
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }
    pub fn param(mut self, p: &str) -> Self {
        self.param = Some(p.to_string());
        self
    }
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid API key",
        )
    }
    /// 503 `overloaded_error` (sent with `Retry-After`).
    pub fn unavailable(message: &str) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded_error", message)
    }

    fn with_retry(&self, mut r: Response) -> Response {
        if self.status == StatusCode::SERVICE_UNAVAILABLE || self.status.as_u16() == 429 {
            r.headers_mut()
                .insert("retry-after", HeaderValue::from_static("1"));
        }
        r
    }

    /// OpenAI's envelope: `{"error": {"message", "type", "param", "code"}}`.
    pub fn openai(self) -> Response {
        let body = serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16().to_string(),
        }});
        let r = (self.status, axum::Json(body)).into_response();
        self.with_retry(r)
    }

    /// Anthropic's envelope: `{"type": "error", "error": {"type", "message"}}`.
    pub fn anthropic(self) -> Response {
        let body = serde_json::json!({"type": "error", "error": {
            "type": self.kind,
            "message": self.message,
        }});
        let r = (self.status, axum::Json(body)).into_response();
        self.with_retry(r)
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::BadRequest(m) | EngineError::ResourceExhausted(m) => ApiError::invalid(m),
            EngineError::Internal(e) => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "api_error",
                e.to_string(),
            ),
        }
    }
}

/// A response id: `prefix`, the time and a counter.
pub fn request_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    format!(
        "{prefix}{:x}{:06x}",
        super::unix_time(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// A sampling value the sampler refuses, named as the API names its field (`top_p`, not
/// `--top-p`).
pub fn invalid_sampling(e: anyhow::Error) -> ApiError {
    ApiError::invalid(e.to_string().replace("--", "").replace('-', "_"))
}

/// A request body parsed as `T`, with parse failures as a 400 in the endpoint's envelope.
pub fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("invalid request body: {e}")))
}

/// A string or a list of strings (`stop`).
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// One finished choice.
#[derive(Debug, Default)]
pub struct Choice {
    pub text: String,
    pub steps: Vec<Step>,
    pub reason: Option<FinishReason>,
    /// Prompt tokens reused from the prefix cache.
    pub cached: usize,
}

/// A choice's update, tagged with its index.
pub enum ChoiceUpdate {
    Token {
        step: Step,
        text: String,
    },
    Done {
        reason: FinishReason,
        text: String,
        cached: usize,
    },
    Failed(ApiError),
}

/// Submits each request (one per choice) and merges their updates, tagged by choice index.
/// Dropping the receiver cancels every choice still running.
pub fn start(
    worker: &Worker,
    reqs: Vec<Request>,
) -> Result<UnboundedReceiver<(usize, ChoiceUpdate)>, ApiError> {
    let (out, merged) = unbounded_channel();
    for (i, r) in reqs.into_iter().enumerate() {
        let (tx, mut rx) = unbounded_channel();
        if !worker.submit(r, tx) {
            return Err(ApiError::unavailable(
                "the engine is not accepting requests",
            ));
        }
        let out = out.clone();
        tokio::spawn(async move {
            while let Some(u) = rx.recv().await {
                let (msg, last) = match u {
                    Update::Event(Event::Token { step, text, .. }) => {
                        (ChoiceUpdate::Token { step, text }, false)
                    }
                    Update::Event(Event::Done {
                        reason,
                        text,
                        stats,
                        ..
                    }) => (
                        ChoiceUpdate::Done {
                            reason,
                            text,
                            cached: stats.cached_tokens,
                        },
                        true,
                    ),
                    Update::Rejected(e) => (ChoiceUpdate::Failed(e.into()), true),
                    Update::Busy => (
                        ChoiceUpdate::Failed(ApiError::unavailable(
                            "the server's queue is full; retry later",
                        )),
                        true,
                    ),
                };
                if out.send((i, msg)).is_err() || last {
                    break;
                }
            }
        });
    }
    Ok(merged)
}

/// Runs the choices to the end.
pub async fn collect(worker: &Worker, reqs: Vec<Request>) -> Result<Vec<Choice>, ApiError> {
    let n = reqs.len();
    let mut rx = start(worker, reqs)?;
    let mut choices: Vec<Choice> = (0..n).map(|_| Choice::default()).collect();
    let mut left = n;
    while left > 0 {
        let Some((i, u)) = rx.recv().await else {
            return Err(ApiError::unavailable(
                "the engine is not accepting requests",
            ));
        };
        let c = &mut choices[i];
        match u {
            ChoiceUpdate::Token { step, text } => {
                c.steps.push(step);
                c.text.push_str(&text);
            }
            ChoiceUpdate::Done {
                reason,
                text,
                cached,
            } => {
                c.text.push_str(&text);
                c.reason = Some(reason);
                c.cached = cached;
                left -= 1;
            }
            ChoiceUpdate::Failed(e) => return Err(e),
        }
    }
    Ok(choices)
}
