//! The engine thread: one loaded model, one engine, many requests. HTTP handlers hand it jobs
//! through a channel; it steps the engine while any request runs and sends each request's events
//! to that request's own channel. A request whose receiver is gone (the client disconnected) is
//! cancelled at once and its KV blocks freed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

use tokio::sync::mpsc::UnboundedSender;

use crate::engine::{EngineError, EngineOptions, Event, Request, SeqId};
use crate::model::load::LoadedModel;
use crate::Device;

/// What a request's channel carries.
#[derive(Debug)]
pub enum Update {
    Event(Event),
    /// The engine refused the request.
    Rejected(EngineError),
}

pub struct Job {
    pub request: Request,
    pub updates: UnboundedSender<Update>,
}

/// Counts the server reports.
#[derive(Debug, Default)]
pub struct Gauges {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    pub kv_free: AtomicUsize,
    pub kv_total: AtomicUsize,
}

/// Handle to the engine thread.
#[derive(Clone)]
pub struct Worker {
    jobs: mpsc::Sender<Job>,
    pub gauges: Arc<Gauges>,
}

impl Worker {
    /// Starts the engine thread over `model`; fails if the engine cannot be made.
    pub fn start(
        model: Arc<LoadedModel>,
        device: Device,
        opts: EngineOptions,
    ) -> anyhow::Result<Worker> {
        let (jobs, inbox) = mpsc::channel::<Job>();
        let gauges = Arc::new(Gauges::default());
        let (ready_tx, ready_rx) = mpsc::channel();
        let g = gauges.clone();
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
                let mut open: HashMap<SeqId, UnboundedSender<Update>> = HashMap::new();
                let (free, total) = engine.kv_blocks();
                g.kv_free.store(free, Ordering::Relaxed);
                g.kv_total.store(total, Ordering::Relaxed);
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
                        match engine.submit(job.request) {
                            Ok(id) => {
                                open.insert(id, job.updates);
                            }
                            Err(e) => {
                                let _ = job.updates.send(Update::Rejected(e));
                            }
                        }
                    }
                    let gone: Vec<SeqId> = open
                        .iter()
                        .filter(|(_, tx)| tx.is_closed())
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
                                    if let Some(tx) = open.get(&id) {
                                        if tx.send(Update::Event(ev)).is_err() {
                                            open.remove(&id);
                                            engine.cancel(id);
                                        } else if done {
                                            open.remove(&id);
                                        }
                                    }
                                }
                            }
                            Err(e) => {
                                // A failed step fails every request in it; the server goes on.
                                let msg = e.to_string();
                                for (id, tx) in open.drain() {
                                    let _ = tx.send(Update::Rejected(EngineError::Internal(
                                        anyhow::anyhow!("{msg}"),
                                    )));
                                    engine.cancel(id);
                                }
                            }
                        }
                    }
                    let (running, waiting) = engine.load();
                    let (free, total) = engine.kv_blocks();
                    g.running.store(running, Ordering::Relaxed);
                    g.waiting.store(waiting, Ordering::Relaxed);
                    g.kv_free.store(free, Ordering::Relaxed);
                    g.kv_total.store(total, Ordering::Relaxed);
                }
            })?;
        ready_rx
            .recv()
            .map_err(|_| anyhow::anyhow!("the engine thread died while starting"))??;
        Ok(Worker { jobs, gauges })
    }

    /// Queues a request; its events arrive on `updates`.
    pub fn submit(&self, request: Request, updates: UnboundedSender<Update>) -> bool {
        self.jobs.send(Job { request, updates }).is_ok()
    }
}
