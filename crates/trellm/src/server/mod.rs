//! `trellm serve`: OpenAI- (chat completions, completions, responses) and Anthropic-compatible
//! (messages) HTTP endpoints over one engine, on tokio + axum. Handlers parse and validate a request, turn it into engine requests (one per choice),
//! and stream or collect the engine's events; the engine thread (`worker`) batches every running
//! request into each step.
//!
//! The port is bound before the model loads: until it is ready `/health` answers 503 and every
//! other path 503 with `Retry-After`, so a supervisor can tell loading from dead.

mod anthropic;
mod api;
mod metrics;
mod openai;
mod responses;
mod tools;
mod worker;

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::engine::EngineOptions;
use crate::model::load::LoadedModel;
use crate::Device;
pub use worker::Worker;

/// Largest request body accepted.
pub const MAX_BODY_BYTES: usize = 8 << 20;

pub struct ServeOptions {
    pub addr: SocketAddr,
    pub device: Device,
    /// Requests must carry this key (`Authorization: Bearer` or `x-api-key`).
    pub api_key: Option<String>,
    /// The name `/v1/models` lists and requests may name.
    pub model_name: String,
    /// Origins browsers may call from (CORS); none: no CORS headers. `*`: any.
    pub allowed_origins: Vec<String>,
    /// Requests that may wait for a slot; more get 503 with `Retry-After`.
    pub max_waiting: usize,
    /// How long running requests may go on after SIGINT/SIGTERM.
    pub grace: Duration,
}

pub struct AppState {
    pub model: Arc<LoadedModel>,
    pub worker: Worker,
    pub model_name: String,
    pub api_key: Option<String>,
    pub created: u64,
}

pub fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `secs` after the Unix epoch as RFC 3339 UTC (`2026-12-06T03:04:05Z`).
pub fn rfc3339(secs: u64) -> String {
    trellm_tokenizer::strftime("%Y-%m-%dT%H:%M:%SZ", secs as i64)
}

/// The router over a started engine.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{id}", get(openai::model))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/responses", post(responses::create))
        .route("/tokenize", post(openai::tokenize))
        .route("/detokenize", post(openai::detokenize))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/metrics", get(metrics))
        // llama-server's aliases without the version prefix, for clients whose base URL leaves
        // it out.
        .route("/v1/health", get(health))
        .route("/models", get(openai::models))
        .route("/chat/completions", post(openai::chat_completions))
        .route("/completions", post(openai::completions))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// What answers while the model loads.
fn loading_router() -> Router {
    Router::new()
        .route(
            "/health",
            get(|| async {
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    axum::Json(serde_json::json!({"status": "loading"})),
                )
            }),
        )
        .fallback(|| async { api::ApiError::unavailable("the model is still loading").openai() })
}

/// CORS for the given origins (`*`: any); `None` when no origin is allowed.
fn cors(origins: &[String]) -> Result<Option<CorsLayer>> {
    if origins.is_empty() {
        return Ok(None);
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        let list = origins
            .iter()
            .map(|o| {
                HeaderValue::from_str(o)
                    .with_context(|| format!("--allowed-origins: '{o}' is not a valid origin"))
            })
            .collect::<Result<Vec<_>>>()?;
        AllowOrigin::list(list)
    };
    Ok(Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
            .allow_headers([
                axum::http::header::CONTENT_TYPE,
                axum::http::header::AUTHORIZATION,
                "x-api-key".parse().expect("a valid header name"),
                "anthropic-version".parse().expect("a valid header name"),
            ]),
    ))
}

async fn health() -> impl IntoResponse {
    (
        StatusCode::OK,
        axum::Json(serde_json::json!({"status": "ok"})),
    )
}

async fn not_found() -> Response {
    api::ApiError::new(StatusCode::NOT_FOUND, "not_found_error", "no such endpoint").openai()
}

async fn metrics(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [(
            "content-type",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.worker.metrics.text(),
    )
}

/// Checks the API key, if the server has one.
pub fn authorized(s: &AppState, headers: &HeaderMap) -> bool {
    let Some(key) = &s.api_key else {
        return true;
    };
    let bearer = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let x_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
    bearer == Some(key.as_str()) || x_key == Some(key.as_str())
}

/// Binds `o.addr`, then loads the model with `load` (which also sizes the engine for it) while
/// answering 503, then serves it until
/// SIGINT/SIGTERM: new connections stop, running requests get `o.grace` to finish, and what
/// still runs then is cancelled.
pub fn serve(
    load: impl FnOnce() -> Result<(LoadedModel, EngineOptions)> + Send + 'static,
    o: ServeOptions,
) -> Result<()> {
    let cors = cors(&o.allowed_origins)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let grace = o.grace;
    rt.block_on(async move {
        let listener = std::net::TcpListener::bind(o.addr)
            .with_context(|| format!("cannot listen on {}", o.addr))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        eprintln!(
            "trellm: loading {} (listening on {addr}; /health answers 503 until it is ready)",
            o.model_name
        );
        let (loaded_tx, loaded_rx) = tokio::sync::oneshot::channel::<()>();
        let early = tokio::net::TcpListener::from_std(listener.try_clone()?)?;
        let loading_server = tokio::spawn(
            axum::serve(early, loading_router())
                .with_graceful_shutdown(async move {
                    let _ = loaded_rx.await;
                })
                .into_future(),
        );
        let (device, max_waiting) = (o.device, o.max_waiting);
        let started = tokio::task::spawn_blocking(move || -> Result<_> {
            let (model, engine) = load()?;
            let model = Arc::new(model);
            let worker = Worker::start(model.clone(), device, engine, max_waiting)?;
            Ok((model, worker))
        });
        let (model, worker) = tokio::select! {
            r = started => r.context("the loading thread panicked")??,
            _ = shutdown_signal() => return Ok(()),
        };
        let _ = loaded_tx.send(());
        let _ = loading_server.await;
        let state = Arc::new(AppState {
            model,
            worker,
            model_name: o.model_name,
            api_key: o.api_key,
            created: unix_time(),
        });
        let mut app = router(state.clone());
        if let Some(c) = cors {
            app = app.layer(c);
        }
        let listener = tokio::net::TcpListener::from_std(listener)?;
        eprintln!("trellm: serving {} on http://{addr}", state.model_name);
        let (stopping_tx, mut stopping) = tokio::sync::watch::channel(false);
        let server = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                shutdown_signal().await;
                let _ = stopping_tx.send(true);
            })
            .into_future();
        tokio::select! {
            r = server => r?,
            _ = async {
                let _ = stopping.wait_for(|&s| s).await;
                tokio::time::sleep(grace).await;
            } => eprintln!(
                "trellm: {} s after the signal, cancelling what still runs",
                grace.as_secs()
            ),
        }
        Ok::<_, anyhow::Error>(())
    })?;
    rt.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    eprintln!("trellm: shutting down");
}

#[cfg(test)]
mod tests {
    #[test]
    fn rfc3339_dates() {
        assert_eq!(super::rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(super::rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(super::rfc3339(1_796_526_245), "2026-12-06T03:04:05Z");
        assert_eq!(super::rfc3339(4_107_542_399), "2100-02-28T23:59:59Z");
    }
}
