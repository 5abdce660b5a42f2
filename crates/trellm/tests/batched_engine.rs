//! Many sequences through one engine: each produces what it produces alone, bit for bit (with the
//! prefix cache, whose reuse changes the chunk shapes: within 1e-4). Sequences with
//! different prompts, lengths and samplers join and leave at different steps; prompts are cut
//! into prefill chunks that run beside other sequences' decode tokens. Runs on tiny fixtures of
//! several families (sliding windows, NoPE layers, dynamic RoPE, soft-capping, fused phi3
//! projections) and on the real default model. Also: KV blocks shared by a fork, and a full pool.

use std::path::PathBuf;
use std::sync::Arc;

use trellm::backend::cpu::CpuModel;
use trellm::backend::SoloSequence;
use trellm::engine::{Engine, EngineError, EngineOptions, Event, FinishReason, Request};
use trellm::engine::{SamplerParams, SeqId};
use trellm::model::load::load;
use trellm_model::{Batch, BlockPool, BlockTable, ModelBackend, Want};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/tiny"
    ))
    .join(name)
}

/// What one request produced: ids, top logprobs per step, prompt logprobs, how it ended.
#[derive(Debug, Default, Clone)]
struct Outcome {
    ids: Vec<u32>,
    top: Vec<Vec<(u32, f32)>>,
    prompt_top: Vec<Vec<(u32, f32)>>,
    reason: Option<FinishReason>,
}

fn opts(max_seqs: usize, chunk: usize) -> EngineOptions {
    EngineOptions {
        prefill_chunk: chunk,
        ..EngineOptions::for_sequences(max_seqs, 64)
    }
}

/// Runs `reqs` on one engine, submitting request `i` before step `join[i]`.
fn run(
    model: &Arc<CpuModel>,
    reqs: &[Request],
    join: &[usize],
    max_seqs: usize,
    chunk: usize,
) -> Vec<Outcome> {
    let mut e = Engine::new(model.clone(), None, opts(max_seqs, chunk)).unwrap();
    let mut ids: Vec<Option<SeqId>> = vec![None; reqs.len()];
    let mut out = vec![Outcome::default(); reqs.len()];
    let mut step = 0;
    loop {
        for (i, r) in reqs.iter().enumerate() {
            if join[i] == step && ids[i].is_none() {
                ids[i] = Some(e.submit(r.clone()).unwrap());
            }
        }
        if !e.has_work() && ids.iter().all(|i| i.is_some()) {
            break;
        }
        for ev in e.step().unwrap() {
            let slot = |id| ids.iter().position(|x| *x == Some(id)).unwrap();
            match ev {
                Event::Token { id, step, .. } => {
                    let o = &mut out[slot(id)];
                    o.ids.push(step.token);
                    o.top.push(step.top);
                }
                Event::Done {
                    id, reason, stats, ..
                } => {
                    let o = &mut out[slot(id)];
                    o.reason = Some(reason);
                    o.prompt_top = stats.prompt_logprobs;
                }
            }
        }
        step += 1;
        assert!(step < 10_000, "the engine does not finish");
    }
    out
}

/// Same ids and end; logprobs within `tol` (0: bit for bit).
fn assert_same(name: &str, i: usize, alone: &Outcome, batched: &Outcome, tol: f32) -> f32 {
    assert_eq!(alone.ids, batched.ids, "{name}: request {i}: ids differ");
    assert_eq!(alone.reason, batched.reason, "{name}: request {i}");
    let mut worst = 0.0f32;
    for (a, b) in alone
        .top
        .iter()
        .chain(&alone.prompt_top)
        .zip(batched.top.iter().chain(&batched.prompt_top))
    {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            // Top-K ids may swap only at exact ties of logprobs; compare values by rank.
            let d = (x.1 - y.1).abs();
            worst = worst.max(d);
            assert!(
                d <= tol,
                "{name}: request {i}: logprob differs by {d:e} ({x:?} vs {y:?})"
            );
        }
    }
    worst
}

/// A request of a varied shape: prompt length, sampler and length differ with `i`.
fn request(i: usize, vocab: usize) -> Request {
    let len = [3, 17, 1, 9, 24, 5, 12, 2, 30, 7, 16, 4, 20, 11, 6, 13][i % 16];
    let prompt = (0..len)
        .map(|j| ((i * 131 + j * 37 + 5) % vocab) as u32)
        .collect();
    let sampler = match i % 4 {
        0 => SamplerParams::default(),
        1 => SamplerParams {
            temp: 0.8,
            seed: Some(i as u64),
            ..Default::default()
        },
        2 => SamplerParams {
            temp: 1.0,
            top_p: 0.9,
            top_k: 20,
            seed: Some(100 + i as u64),
            repetition_penalty: Some(1.3),
            ..Default::default()
        },
        _ => SamplerParams {
            temp: 0.6,
            min_p: 0.05,
            presence_penalty: Some(0.5),
            seed: Some(7),
            ..Default::default()
        },
    };
    Request {
        prompt,
        max_tokens: 1 + (i * 7) % 19,
        sampler,
        logprobs: 5,
        prompt_logprobs: if i % 5 == 3 { 3 } else { 0 },
        ..Default::default()
    }
}

fn check_family(name: &str, b: usize) {
    check_folder(name, &fixture(name), b);
}

/// Batched against alone, bit for bit: the CPU's kernels give each row the same arithmetic
/// whatever runs beside it.
fn check_folder(name: &str, dir: &std::path::Path, b: usize) {
    let m = load(dir).unwrap();
    let model = m.model.clone();
    let vocab = model.cfg.vocab;
    let reqs: Vec<Request> = (0..b).map(|i| request(i, vocab)).collect();
    // Alone: each request in an engine of its own, with the same prefill chunking.
    let alone: Vec<Outcome> = reqs
        .iter()
        .map(|r| run(&model, std::slice::from_ref(r), &[0], 1, 8).remove(0))
        .collect();
    // Together: joining at different steps, chunks of 8 prompt tokens beside decodes.
    let join: Vec<usize> = (0..b).map(|i| (i * 3) % 7).collect();
    let together = run(&model, &reqs, &join, b, 8);
    let mut worst = 0.0f32;
    for i in 0..b {
        worst = worst.max(assert_same(name, i, &alone[i], &together[i], 0.0));
    }
    eprintln!("{name}: B = {b}: batched vs alone max |dlogprob| {worst:e}");
}

#[test]
fn batches_of_1_to_16_match_running_alone() {
    for (name, b) in [
        ("llama", 16),
        ("gemma3", 5),
        ("gemma2", 3),
        ("smollm3", 7),
        ("llama-rope-dynamic", 4),
        ("phi3", 2),
        ("starcoder2", 6),
        ("olmo2", 1),
        ("granite", 9),
        ("qwen3", 16),
    ] {
        check_family(name, b);
    }
}

/// EXL3 layers (exllamav3's tiny conversions: every codebook, MUL1 on int16 activations) in
/// batches, as the families above.
#[test]
fn exl3_batches_match_running_alone() {
    let root = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/exl3/tiny-llama"
    ));
    for (dir, b) in [
        ("3inst-4.0", 5),
        ("mcg-2.0", 3),
        ("mul1-2.5", 8),
        ("mul1-3.0", 16),
    ] {
        check_folder(dir, &root.join(dir), b);
    }
}

#[test]
fn a_slot_limit_queues_requests_without_changing_them() {
    let m = load(&fixture("qwen2")).unwrap();
    let reqs: Vec<Request> = (0..8).map(|i| request(i, m.model.cfg.vocab)).collect();
    let join = vec![0; 8];
    let wide = run(&m.model, &reqs, &join, 8, 8);
    let narrow = run(&m.model, &reqs, &join, 3, 5);
    for i in 0..8 {
        assert_same("qwen2 max_seqs 3", i, &wide[i], &narrow[i], 0.0);
    }
}

/// A fork shares its parent's blocks; extending either copies the shared partial block first,
/// and both continue exactly as sequences computed from scratch.
#[test]
fn forked_sequences_share_a_prefix_and_match_fresh_ones() {
    let m = load(&fixture("llama")).unwrap();
    let model = &*m.model;
    let bs = trellm::backend::BLOCK_SIZE;
    let mut cache = model.new_cache(16, bs).unwrap();
    let mut pool = BlockPool::new(16, bs);
    // One full block and a partial one.
    let prefix: Vec<u32> = (0..bs as u32 + 4).map(|i| (i * 37 + 3) % 200).collect();
    let mut a = BlockTable::default();
    pool.grow(&mut a, prefix.len()).unwrap();
    let mut batch = Batch::default();
    batch.push(&prefix, 0, a.blocks().to_vec(), Want::None);
    model.step(&batch, &mut cache).unwrap();

    let mut b = pool.fork(&a);
    let mut got = Vec::new();
    let mut batch = Batch::default();
    for (t, tok) in [(&mut a, 8u32), (&mut b, 97u32)] {
        let copies = pool.grow(t, prefix.len() + 1).unwrap();
        model.copy_blocks(&mut cache, &copies).unwrap();
        batch.push(&[tok], prefix.len(), t.blocks().to_vec(), Want::Last);
    }
    assert_ne!(
        a.blocks()[1],
        b.blocks()[1],
        "the shared partial block was copied"
    );
    assert_eq!(a.blocks()[0], b.blocks()[0], "the full block stays shared");
    got.push(model.step(&batch, &mut cache).unwrap());

    for (i, tok) in [8u32, 97].into_iter().enumerate() {
        let mut fresh = SoloSequence::new(model, 64).unwrap();
        let mut p = prefix.to_vec();
        p.push(tok);
        let want = fresh.forward(&p, Want::Last).unwrap();
        let v = model.cfg.vocab;
        let got = &got[0][i * v..(i + 1) * v];
        let d = got
            .iter()
            .zip(&want)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        // Two rows take another matmul path than seven: equal to rounding.
        assert!(
            d <= 1e-4,
            "fork {i}: differs from a fresh sequence by {d:e}"
        );
    }
    pool.release(a);
    pool.release(b);
    assert_eq!(pool.free_blocks(), 16);
}

#[test]
fn a_full_pool_makes_requests_wait_or_refuses_them() {
    let m = load(&fixture("llama")).unwrap();
    let vocab = m.model.cfg.vocab;
    // 6 blocks of 16 positions: room for two 40-position requests at a time.
    let o = EngineOptions {
        max_seqs: 8,
        kv_blocks: 6,
        prefill_chunk: 16,
        prefix_cache: true,
        tensor_parallel: 1,
    };
    let mut e = Engine::new(m.model.clone(), None, o).unwrap();
    let too_big = Request {
        prompt: vec![1; 90],
        max_tokens: 20,
        ..Default::default()
    };
    match e.submit(too_big) {
        Err(EngineError::ResourceExhausted(msg)) => assert!(msg.contains("KV"), "{msg}"),
        other => panic!("expected ResourceExhausted, got {other:?}"),
    }
    let reqs: Vec<Request> = (0..5)
        .map(|i| Request {
            prompt: (0..20).map(|j| ((i * 17 + j) % vocab) as u32).collect(),
            max_tokens: 21,
            ..Default::default()
        })
        .collect();
    let ids: Vec<SeqId> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    let mut done = Vec::new();
    let mut max_running = 0;
    while e.has_work() {
        let events = e.step().unwrap();
        let (running, _) = e.load();
        max_running = max_running.max(running);
        for ev in events {
            if let Event::Done { id, reason, .. } = ev {
                assert_eq!(reason, FinishReason::Length);
                done.push(id);
            }
        }
    }
    assert_eq!(max_running, 2, "the pool holds two such requests at a time");
    done.sort();
    assert_eq!(done, ids, "every request finished");
    assert_eq!(e.kv_blocks(), (6, 6), "every block came back");
}

#[test]
fn cancel_frees_blocks_and_others_continue() {
    let m = load(&fixture("mistral")).unwrap();
    let reqs: Vec<Request> = (0..3)
        .map(|i| Request {
            max_tokens: 12,
            ..request(i * 4, m.model.cfg.vocab)
        })
        .collect();
    let alone = run(&m.model, &reqs[2..], &[0], 1, 8).remove(0);
    let mut e = Engine::new(m.model.clone(), None, opts(3, 8)).unwrap();
    let ids: Vec<SeqId> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    let mut last = Outcome::default();
    let mut cancelled = 0;
    let mut steps = 0;
    while e.has_work() {
        if steps == 2 {
            e.cancel(ids[0]);
            e.cancel(ids[1]);
        }
        steps += 1;
        for ev in e.step().unwrap() {
            match ev {
                Event::Token { id, step, .. } if id == ids[2] => {
                    last.ids.push(step.token);
                    last.top.push(step.top);
                }
                Event::Done { reason, id, .. } => {
                    if id == ids[2] {
                        last.reason = Some(reason);
                    } else {
                        assert_eq!(reason, FinishReason::Cancelled);
                        cancelled += 1;
                    }
                }
                _ => {}
            }
        }
    }
    assert_eq!(cancelled, 2);
    assert_same("mistral after cancels", 2, &alone, &last, 0.0);
    let (free, total) = e.kv_blocks();
    assert_eq!(free, total);
}

/// The real default model: 8 chat-sized requests at once, as `trellm generate --requests` runs
/// them, against each alone.
#[test]
fn default_model_batch_matches_alone() {
    let path = trellm_hub::resolve_model("smollm2-135m-instruct", false).unwrap();
    let m = load(&path).unwrap();
    let reqs: Vec<Request> = (0..8)
        .map(|i| Request {
            max_tokens: 6 + i,
            ..request(i, m.model.cfg.vocab)
        })
        .collect();
    let alone: Vec<Outcome> = reqs
        .iter()
        .map(|r| run(&m.model, std::slice::from_ref(r), &[0], 1, 512).remove(0))
        .collect();
    let join: Vec<usize> = (0..8).map(|i| i % 3).collect();
    let together = run(&m.model, &reqs, &join, 8, 512);
    for i in 0..8 {
        assert_same("smollm2", i, &alone[i], &together[i], 0.0);
    }
}

/// Submits `req` and steps `e` until it ends: what it produced and its cached prompt tokens.
fn drive(e: &mut Engine, req: &Request) -> (Outcome, usize) {
    let id = e.submit(req.clone()).unwrap();
    let mut o = Outcome::default();
    let mut cached = None;
    while cached.is_none() {
        for ev in e.step().unwrap() {
            match ev {
                Event::Token { id: i, step, .. } if i == id => {
                    o.ids.push(step.token);
                    o.top.push(step.top);
                }
                Event::Done {
                    id: i,
                    reason,
                    stats,
                    ..
                } if i == id => {
                    o.reason = Some(reason);
                    cached = Some(stats.cached_tokens);
                }
                _ => {}
            }
        }
    }
    (o, cached.unwrap())
}

#[test]
fn the_prefix_cache_reuses_blocks_and_keeps_the_results() {
    // gemma3: sliding-window layers read cached blocks too.
    for name in ["llama", "gemma3", "qwen3"] {
        let m = load(&fixture(name)).unwrap();
        let vocab = m.model.cfg.vocab;
        let shared: Vec<u32> = (0..40).map(|j| ((j * 7 + 3) % vocab) as u32).collect();
        let mut reqs: Vec<Request> = (0..3)
            .map(|i| {
                let mut prompt = shared.clone();
                prompt.extend((0..5 + i).map(|j| ((j * 11 + i * 3 + 1) % vocab) as u32));
                Request {
                    prompt,
                    max_tokens: 12,
                    logprobs: 4,
                    ..Default::default()
                }
            })
            .collect();
        // Chunks of 64: a cached prefix of 32 starts the rest of a prompt mid-chunk.
        let warm_opts = EngineOptions {
            prefill_chunk: 64,
            ..EngineOptions::for_sequences(2, 128)
        };
        let cold_opts = EngineOptions {
            prefix_cache: false,
            ..warm_opts.clone()
        };
        let mut e = Engine::new(m.model.clone(), None, warm_opts).unwrap();
        let first = drive(&mut e, &reqs[0]).0;
        // A follow-up turn: the first request's prompt and reply, then more.
        let mut turn = reqs[0].prompt.clone();
        turn.extend(&first.ids);
        turn.extend([5, 6, 7].map(|t| t % vocab as u32));
        reqs.push(Request {
            prompt: turn,
            ..reqs[0].clone()
        });
        for (i, r) in reqs.iter().enumerate().skip(1) {
            let mut cold_engine = Engine::new(m.model.clone(), None, cold_opts.clone()).unwrap();
            let (cold, none) = drive(&mut cold_engine, r);
            assert_eq!(none, 0);
            let (warm, cached) = drive(&mut e, r);
            let expect = if i < 3 { 32 } else { 48 };
            assert_eq!(cached, expect, "{name}: request {i}: cached tokens");
            // The rest of the prompt runs in other chunk shapes than without the cache (and a
            // cached reply was decoded a token at a time): rounding moves, ids do not.
            assert_same(name, i, &cold, &warm, 1e-4);
        }
        let (free, total) = e.kv_blocks();
        assert_eq!(free, total, "cached blocks nobody uses count as free");
        assert!(e.cached_blocks() > 0);
    }
}

#[test]
fn cached_blocks_are_evicted_when_the_pool_needs_them() {
    let m = load(&fixture("llama")).unwrap();
    let vocab = m.model.cfg.vocab;
    // 6 blocks: each request needs 3; the cache fills the pool and must give way.
    let o = EngineOptions {
        max_seqs: 2,
        kv_blocks: 6,
        prefill_chunk: 16,
        prefix_cache: true,
        tensor_parallel: 1,
    };
    let mut e = Engine::new(m.model.clone(), None, o).unwrap();
    for i in 0..8 {
        let r = Request {
            prompt: (0..34).map(|j| ((i * 31 + j * 5) % vocab) as u32).collect(),
            max_tokens: 10,
            ..Default::default()
        };
        let (out, cached) = drive(&mut e, &r);
        assert_eq!(out.reason, Some(FinishReason::Length));
        assert_eq!(cached, 0);
        assert!(e.cached_blocks() <= 6);
    }
    assert_eq!(e.kv_blocks(), (6, 6));
}
