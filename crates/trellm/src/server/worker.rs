//! The engine thread: one loaded model, one engine, many requests. HTTP handlers hand it jobs
//! through a channel; it steps the engine while any request runs and sends each request's events
//! to that request's own channel. A request whose receiver is gone (the client disconnected) is
//! cancelled at once and its KV blocks freed.

use std::collections::HashMap;
use std::sync::{mpsc, Arc};
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use super::metrics::Metrics;
use crate::engine::{EngineError, EngineOptions, Event, Request, SeqId};
use crate::model::load::LoadedModel;
use crate::Device;

/// What a request's channel carries.
#[derive(Debug)]
pub enum Update {
    Event(Event),
    /// The engine refused the request.
    Rejected(EngineError),
    /// The queue is full: try again later.
    Busy,
}

pub struct Job {
    pub request: Request,
    pub updates: UnboundedSender<Update>,
}

/// A request the engine thread is serving.
struct Open {
    updates: UnboundedSender<Update>,
    submitted: Instant,
    first_token: bool,
}

/// Handle to the engine thread.
#[derive(Clone)]
pub struct Worker {
    jobs: mpsc::Sender<Job>,
    pub metrics: Arc<Metrics>,
}

impl Worker {
    /// Starts the engine thread over `model`; fails if the engine cannot be made. At most
    /// `max_waiting` requests wait for a slot; more are answered [`Update::Busy`].
    pub fn start(
        model: Arc<LoadedModel>,
        device: Device,
        opts: EngineOptions,
        max_waiting: usize,
    ) -> anyhow::Result<Worker> {
        let (jobs, inbox) = mpsc::channel::<Job>();
        let metrics = Arc::new(Metrics::default());
        let (ready_tx, ready_rx) = mpsc::channel();
        let g = metrics.clone();
        std::thread::Builder::new()
            .name("trellm-engine".into())
            .spawn(move || {
                let engine = model.engine(device, opts);
                let mut engine = match engine {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let mut open: HashMap<SeqId, Open> = HashMap::new();
                let gauges = |engine: &crate::engine::Engine<'_>| {
                    let (running, waiting) = engine.load();
                    let (free, total) = engine.kv_blocks();
                    g.running.set(running as i64);
                    g.waiting.set(waiting as i64);
                    g.kv_free.set(free as i64);
                    g.kv_total.set(total as i64);
                    g.kv_cached.set(engine.cached_blocks() as i64);
                };
                gauges(&engine);
                let _ = ready_tx.send(Ok(()));
                loop {
                    // Block for work when idle; otherwise take whatever has arrived.
                    let first = if engine.has_work() {
                        inbox.try_recv().ok()
                    } else {
                        match inbox.recv() {
                            Ok(j) => Some(j),
                            Err(_) => return,
                        }
                    };
                    for job in first
                        .into_iter()
                        .chain(std::iter::from_fn(|| inbox.try_recv().ok()))
                    {
                        if engine.load().1 >= max_waiting {
                            g.rejected.inc();
                            let _ = job.updates.send(Update::Busy);
                            continue;
                        }
                        let prompt = job.request.prompt.len();
                        match engine.submit(job.request) {
                            Ok(id) => {
                                g.prompt_tokens.inc_by(prompt as u64);
                                open.insert(
                                    id,
                                    Open {
                                        updates: job.updates,
                                        submitted: Instant::now(),
                                        first_token: false,
                                    },
                                );
                            }
                            Err(e) => {
                                g.rejected.inc();
                                let _ = job.updates.send(Update::Rejected(e));
                            }
                        }
                    }
                    let gone: Vec<SeqId> = open
                        .iter()
                        .filter(|(_, o)| o.updates.is_closed())
                        .map(|(&id, _)| id)
                        .collect();
                    for id in gone {
                        open.remove(&id);
                        engine.cancel(id);
                    }
                    if engine.has_work() {
                        match engine.step() {
                            Ok(events) => {
                                for ev in events {
                                    let (id, done) = match &ev {
                                        Event::Token { id, .. } => (*id, false),
                                        Event::Done { id, .. } => (*id, true),
                                    };
                                    let Some(o) = open.get_mut(&id) else {
                                        continue;
                                    };
                                    match &ev {
                                        Event::Token { .. } => {
                                            g.generated_tokens.inc();
                                            if !std::mem::replace(&mut o.first_token, true) {
                                                g.time_to_first_token
                                                    .observe(o.submitted.elapsed().as_secs_f64());
                                            }
                                        }
                                        Event::Done { stats, .. } => {
                                            g.requests.inc();
                                            g.prefix_cache_hit_tokens
                                                .inc_by(stats.cached_tokens as u64);
                                            if stats.generated_tokens > 1 {
                                                g.time_per_output_token.observe(
                                                    stats.generation_time.as_secs_f64()
                                                        / (stats.generated_tokens - 1) as f64,
                                                );
                                            }
                                        }
                                    }
                                    if o.updates.send(Update::Event(ev)).is_err() {
                                        open.remove(&id);
                                        engine.cancel(id);
                                    } else if done {
                                        open.remove(&id);
                                    }
                                }
                            }
                            Err(e) => {
                                // A failed step fails every request in it; the server goes on.
                                let msg = e.to_string();
                                for (id, o) in open.drain() {
                                    let _ = o.updates.send(Update::Rejected(
                                        EngineError::Internal(anyhow::anyhow!("{msg}")),
                                    ));
                                    engine.cancel(id);
                                }
                            }
                        }
                    }
                    gauges(&engine);
                }
            })?;
        ready_rx
            .recv()
            .map_err(|_| anyhow::anyhow!("the engine thread died while starting"))??;
        Ok(Worker { jobs, metrics })
    }

    /// Queues a request; its events arrive on `updates`.
    pub fn submit(&self, request: Request, updates: UnboundedSender<Update>) -> bool {
        self.jobs.send(Job { request, updates }).is_ok()
    }
}
