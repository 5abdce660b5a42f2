//! `trellm serve`: OpenAI- and Anthropic-compatible HTTP endpoints over one engine, on tokio +
//! axum. Handlers parse and validate a request, turn it into engine requests (one per choice),
//! and stream or collect the engine's events; the engine thread (`worker`) batches every running
//! request into each step.

mod anthropic;
mod api;
mod openai;
mod worker;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

use crate::engine::EngineOptions;
use crate::model::load::LoadedModel;
use crate::Device;
pub use worker::Worker;

/// Largest request body accepted.
pub const MAX_BODY_BYTES: usize = 8 << 20;

pub struct ServeOptions {
    pub addr: SocketAddr,
    pub device: Device,
    pub engine: EngineOptions,
    /// Requests must carry this key (`Authorization: Bearer` or `x-api-key`).
    pub api_key: Option<String>,
    /// The name `/v1/models` lists and requests may name.
    pub model_name: String,
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

/// The router over a started engine (tests bind it to an ephemeral port).
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(openai::models))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
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
    let g = &s.worker.gauges;
    let body = format!(
        "# TYPE trellm_requests_running gauge\ntrellm_requests_running {}\n\
         # TYPE trellm_requests_waiting gauge\ntrellm_requests_waiting {}\n\
         # TYPE trellm_kv_blocks_free gauge\ntrellm_kv_blocks_free {}\n\
         # TYPE trellm_kv_blocks_total gauge\ntrellm_kv_blocks_total {}\n",
        g.running.load(Ordering::Relaxed),
        g.waiting.load(Ordering::Relaxed),
        g.kv_free.load(Ordering::Relaxed),
        g.kv_total.load(Ordering::Relaxed),
    );
    ([("content-type", "text/plain; version=0.0.4")], body)
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

/// Loads nothing: serves `model` until SIGINT/SIGTERM, then stops taking connections and lets
/// running requests finish (within `grace`).
pub fn serve(model: Arc<LoadedModel>, o: ServeOptions, grace: Duration) -> Result<()> {
    let worker = Worker::start(model.clone(), o.device, o.engine)?;
    let state = Arc::new(AppState {
        model,
        worker,
        model_name: o.model_name,
        api_key: o.api_key,
        created: unix_time(),
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(o.addr)
            .await
            .with_context(|| format!("cannot listen on {}", o.addr))?;
        eprintln!(
            "trellm: serving {} on http://{}",
            state.model_name,
            listener.local_addr()?
        );
        axum::serve(listener, router(state))
            .with_graceful_shutdown(shutdown_signal())
            .await?;
        Ok::<_, anyhow::Error>(())
    })?;
    rt.shutdown_timeout(grace);
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
