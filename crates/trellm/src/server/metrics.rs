//! What `/metrics` reports, in Prometheus' text format: the engine thread updates the gauges and
//! counters after every step; latencies are observed as requests start and end.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

pub struct Metrics {
    registry: Registry,
    pub running: Gauge,
    pub waiting: Gauge,
    /// Blocks a new request can get: free ones plus cached ones no sequence is using.
    pub kv_free: Gauge,
    pub kv_total: Gauge,
    /// Blocks the prefix cache holds (some may also be in use).
    pub kv_cached: Gauge,
    pub requests: Counter,
    pub rejected: Counter,
    pub prompt_tokens: Counter,
    pub generated_tokens: Counter,
    /// Prompt tokens whose KV came from the prefix cache.
    pub prefix_cache_hit_tokens: Counter,
    pub time_to_first_token: Histogram,
    pub time_per_output_token: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("trellm");
        let mut gauge = |name: &str, help: &str| {
            let g = Gauge::default();
            registry.register(name, help, g.clone());
            g
        };
        let running = gauge("requests_running", "Requests in the running batch");
        let waiting = gauge(
            "requests_waiting",
            "Requests waiting for a slot or KV blocks",
        );
        let kv_free = gauge(
            "kv_blocks_free",
            "KV blocks a new request can get (free or evictable from the prefix cache)",
        );
        let kv_total = gauge("kv_blocks_total", "KV blocks in the pool");
        let kv_cached = gauge("kv_blocks_cached", "KV blocks held by the prefix cache");
        let mut counter = |name: &str, help: &str| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        };
        let requests = counter("requests_finished", "Requests that ran to an end");
        let rejected = counter("requests_rejected", "Requests refused by the engine");
        let prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests");
        let generated_tokens = counter("generation_tokens", "Tokens generated");
        let prefix_cache_hit_tokens = counter(
            "prefix_cache_hit_tokens",
            "Prompt tokens whose KV was reused from the prefix cache",
        );
        // 1 ms .. about 65 s.
        let time_to_first_token = Histogram::new(exponential_buckets(0.001, 2.0, 17));
        registry.register(
            "time_to_first_token_seconds",
            "From submission to the first generated token",
            time_to_first_token.clone(),
        );
        // 0.5 ms .. about 4 s.
        let time_per_output_token = Histogram::new(exponential_buckets(0.0005, 2.0, 14));
        registry.register(
            "time_per_output_token_seconds",
            "Mean time between a request's generated tokens",
            time_per_output_token.clone(),
        );
        Metrics {
            registry,
            running,
            waiting,
            kv_free,
            kv_total,
            kv_cached,
            requests,
            rejected,
            prompt_tokens,
            generated_tokens,
            prefix_cache_hit_tokens,
            time_to_first_token,
            time_per_output_token,
        }
    }
}

impl Metrics {
    pub fn text(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("formatting into a String cannot fail");
        out
    }
}
