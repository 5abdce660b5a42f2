//! `trellm serve`: the HTTP server (`crate::server`) over one loaded model.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

use super::{DeviceArgs, ModelArgs};
use crate::backend::ModelBackend as _;
use crate::engine::{EngineOptions, PREFILL_CHUNK_SERVE};
use crate::server::{serve, ServeOptions};

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Address to listen on (loopback unless told otherwise).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Requests running at once (more wait their turn).
    #[arg(long, default_value_t = 16)]
    pub max_seqs: usize,
    /// The longest prompt + reply a request may have, in tokens (default: the model's own context;
    /// at most that).
    #[arg(long, short = 'c', visible_alias = "max-model-len")]
    pub ctx_size: Option<usize>,
    /// Memory for the KV cache, e.g. 2G, 512M or a byte count.
    #[arg(long, default_value = "2G")]
    pub kv_memory: String,
    /// Require this key (`Authorization: Bearer KEY` or `x-api-key: KEY`).
    #[arg(long)]
    pub api_key: Option<String>,
    /// The model name the API reports and accepts (default: the model argument).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Origins a browser may call the API from (CORS), comma-separated; `*` for any. Default:
    /// none (no CORS headers).
    #[arg(long, value_delimiter = ',')]
    pub allowed_origins: Vec<String>,
    /// Requests that may wait for a slot; more are answered 503 with Retry-After.
    #[arg(long, default_value_t = 1024)]
    pub max_queue: usize,
    /// Seconds running requests may go on after SIGINT/SIGTERM before they are cancelled.
    #[arg(long, default_value_t = 10)]
    pub shutdown_grace: u64,
}

/// `2G`, `512M`, `64K` or plain bytes.
fn parse_bytes(s: &str) -> Result<usize> {
    let t = s.trim();
    let (num, mul) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: usize = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                _ => bail!("--kv-memory '{s}': use a byte count or K, M, G"),
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    let n: f64 = num
        .parse()
        .map_err(|_| anyhow::anyhow!("--kv-memory '{s}' is not a size"))?;
    if !n.is_finite() || n <= 0.0 || n * mul as f64 > 1e15 {
        bail!("--kv-memory '{s}' is out of range");
    }
    Ok((n * mul as f64) as usize)
}

pub fn run(a: ServeArgs) -> Result<()> {
    if a.max_seqs == 0 {
        bail!("--max-seqs must be at least 1");
    }
    let kv_bytes = parse_bytes(&a.kv_memory)?;
    let name = a
        .served_model_name
        .clone()
        .unwrap_or_else(|| a.model.model.clone());
    let opts = ServeOptions {
        addr: SocketAddr::new(a.host, a.port),
        device: a.device.device,
        api_key: a.api_key,
        model_name: name,
        allowed_origins: a.allowed_origins,
        max_waiting: a.max_queue,
        grace: Duration::from_secs(a.shutdown_grace),
    };
    let (model_args, kv_memory, max_seqs, ctx_size) =
        (a.model, a.kv_memory, a.max_seqs, a.ctx_size);
    let tensor_parallel = a.device.tensor_parallel;
    serve(
        move || {
            let mut m = model_args.load()?;
            if let Some(n) = ctx_size {
                let own = m.model.cfg.max_context;
                if n == 0 || n > own {
                    bail!("--ctx-size {n}: must be from 1 to the model's context of {own} tokens");
                }
                // Nothing else holds the model yet; every length check reads this field.
                Arc::get_mut(&mut m.model)
                    .context("the model is shared before serving")?
                    .cfg
                    .max_context = n;
            }
            let block = m.model.block_bytes(crate::backend::BLOCK_SIZE);
            let kv_blocks = kv_bytes / block.max(1);
            if kv_blocks == 0 {
                bail!("--kv-memory {kv_memory}: less than one KV block ({block} bytes)");
            }
            let engine = EngineOptions {
                max_seqs,
                kv_blocks,
                prefill_chunk: PREFILL_CHUNK_SERVE,
                prefix_cache: true,
                tensor_parallel,
            };
            Ok((m, engine))
        },
        opts,
    )
}
