//! GPU tests of the dense decoder on synthetic weights. Ignored here; run with `--ignored` on the
//! GPU machine (scripts/gpu/run_cuda.sh).

mod common;

use common::gpu;

use std::sync::Arc;

use trellm_cuda::dense::{DenseModel, DenseWeights, FewRows};
use trellm_cuda::{bench, Gpu};
use trellm_model::rope::Rope;
use trellm_model::{ModelConfig, Plan};

/// The decoder for `cfg` with its plan.
fn model(gpu: Arc<Gpu>, cfg: &ModelConfig, w: DenseWeights, ctx: usize) -> DenseModel {
    DenseModel::new(gpu, cfg, &Plan::new(cfg), w, ctx, ctx).unwrap()
}

/// Prefill of n tokens and (prefill of n-1, then one graph-replayed decode step) give the same
/// logits and the same argmax: the decode path (GEMV, split attention, graph) agrees with the
/// prefill path (cuBLAS, one split).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn decode_step_matches_prefill() {
    let gpu = gpu();
    let cfg = bench::shape("tiny").unwrap();
    let tokens: Vec<u32> = (0..40u32)
        .map(|i| (i * 97 + 5) % cfg.vocab as u32)
        .collect();
    let w = DenseWeights::synthetic(&gpu, &cfg, 7).unwrap();
    let mut m = model(gpu, &cfg, w, 64);
    m.prefill(&tokens).unwrap();
    let full = m.logits().unwrap();
    m.reset().unwrap();
    m.prefill(&tokens[..39]).unwrap();
    m.set_next_token(tokens[39]).unwrap();
    m.decode_step().unwrap();
    let stepped = m.logits().unwrap();
    assert!(full.iter().all(|v| v.is_finite()));
    let num: f64 = full
        .iter()
        .zip(&stepped)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = full.iter().map(|a| (*a as f64).powi(2)).sum();
    let rel = (num / den).sqrt();
    assert!(rel < 2e-2, "relative difference {rel}");
    // Replaying the graph keeps advancing: 8 more steps, 9 ids recorded.
    m.decode(8).unwrap();
    assert_eq!(m.history().unwrap().len(), 9);
    assert_eq!(m.len(), 48);
}

/// A tiny synthetic model with the given attention geometry (sliding window on layer 0).
fn geometry(head_dim: usize, n_heads: usize, n_kv: usize, window: Option<usize>) -> ModelConfig {
    let mut cfg = bench::shape("tiny").unwrap();
    cfg.head_dim = head_dim;
    cfg.n_heads = n_heads;
    cfg.n_kv_heads = n_kv;
    cfg.attn_scale = (head_dim as f32).powf(-0.5);
    for (l, spec) in cfg.layers.iter_mut().enumerate() {
        spec.rope = Some(Rope::plain(head_dim, 10000.0, false, 1.0));
        spec.sliding_window = if l == 0 { window } else { None };
    }
    cfg
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Every decode attention path against the prefill's attention (cuBLAS GEMMs), for head dims 64
/// to 256 (each a separately compiled kernel), GQA groups of 1, 4 and 7 and a sliding window: a
/// step at a short context runs the cluster attention, one past `cluster_ctx` (1024) the splits
/// and the combine kernel.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn decode_attention_paths_match_prefill_across_geometries() {
    let gpu = gpu();
    for (hd, nh, nkv, window) in [
        (64, 4, 4, None),
        (80, 8, 2, Some(300)),
        (96, 7, 1, None),
        (128, 8, 2, Some(40)),
        (256, 4, 1, None),
    ] {
        let cfg = geometry(hd, nh, nkv, window);
        for n in [40usize, 1100] {
            let tokens: Vec<u32> = (0..n as u32)
                .map(|i| (i * 97 + 5) % cfg.vocab as u32)
                .collect();
            let w = DenseWeights::synthetic(&gpu, &cfg, 11).unwrap();
            let mut m = model(gpu.clone(), &cfg, w, 1200);
            m.prefill(&tokens).unwrap();
            let full = m.logits().unwrap();
            m.reset().unwrap();
            m.prefill(&tokens[..n - 1]).unwrap();
            m.set_next_token(tokens[n - 1]).unwrap();
            m.decode_step().unwrap();
            let stepped = m.logits().unwrap();
            assert!(full.iter().all(|v| v.is_finite()), "hd {hd}, n {n}");
            let rel = rel_err(&full, &stepped);
            assert!(
                rel < 2e-2,
                "hd {hd} heads {nh}/{nkv} window {window:?} n {n}: {rel}"
            );
        }
    }
}

/// Decode attention of a batch (`attn_decode`: a warp a split, on tensor cores) against each
/// sequence's prefill: ragged sequences of 700-1150 tokens prefilled through the paged cache,
/// then one step of one token each. GQA groups of 32 (two 16-row tiles), 3 and 7, head dims 64,
/// 80 and 128, a sliding window; with 64 sequences of 8 kv heads each warp walks more keys than
/// the 32 block-table entries it holds at once, so it refills them.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn batched_decode_attention_matches_prefill() {
    use trellm_model::{Batch, BlockPool, BlockTable, Want};
    const BS: usize = trellm_cuda::dense::KV_BLOCK;
    let gpu = gpu();
    for (hd, nh, nkv, window, seqs) in [
        (64, 256, 8, None, 64),
        (128, 12, 4, Some(300), 9),
        (80, 14, 2, None, 5),
    ] {
        let cfg = geometry(hd, nh, nkv, window);
        let ctx = 1200;
        let w = DenseWeights::synthetic(&gpu, &cfg, 5).unwrap();
        let mut m = model(gpu.clone(), &cfg, w, ctx);
        let prompts: Vec<Vec<u32>> = (0..seqs)
            .map(|s| {
                let n = 700 + (s * 131) % 450;
                (0..n as u32)
                    .map(|i| (i * 97 + 13 * s as u32 + 5) % cfg.vocab as u32)
                    .collect()
            })
            .collect();
        let blocks = seqs * ctx.div_ceil(BS);
        let mut pool = BlockPool::new(blocks, BS);
        let kv = m.paged_kv(blocks).unwrap();
        let mut tables: Vec<BlockTable> = prompts.iter().map(|_| BlockTable::default()).collect();
        let mut batch = Batch::default();
        for (p, t) in prompts.iter().zip(&mut tables) {
            pool.grow(t, p.len()).unwrap();
            batch.push(&p[..p.len() - 1], 0, t.blocks().to_vec(), Want::None);
        }
        m.step_batch(&batch, &kv).unwrap();
        let mut batch = Batch::default();
        for (p, t) in prompts.iter().zip(&tables) {
            batch.push(
                &p[p.len() - 1..],
                p.len() - 1,
                t.blocks().to_vec(),
                Want::Last,
            );
        }
        let stepped = m.step_batch(&batch, &kv).unwrap();
        let vocab = cfg.vocab;
        assert_eq!(stepped.len(), seqs * vocab);
        for s in 0..seqs {
            m.reset().unwrap();
            m.prefill(&prompts[s]).unwrap();
            let full = m.logits().unwrap();
            let row = &stepped[s * vocab..(s + 1) * vocab];
            assert!(row.iter().all(|v| v.is_finite()), "hd {hd} seq {s}");
            let rel = rel_err(&full, row);
            assert!(
                rel < 2e-2,
                "hd {hd} heads {nh}/{nkv} window {window:?} seq {s}: {rel}"
            );
        }
    }
}

/// The prefill's logits and every decode step's, as bits.
fn run_bits(m: &mut DenseModel, prompt: &[u32], steps: usize) -> Vec<Vec<u32>> {
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    m.reset().unwrap();
    m.prefill(prompt).unwrap();
    let mut out = vec![bits(m.logits().unwrap())];
    for _ in 0..steps {
        // The step's input is the previous argmax, left on the device by the graph.
        m.decode_step().unwrap();
        out.push(bits(m.logits().unwrap()));
    }
    out
}

/// The same request twice gives bit-identical logits at every step (no reduction whose order
/// depends on which block finishes first), on a shape wide enough for the deferred-norm sums to
/// take 512 blocks' partials, at contexts on both decode attention paths (cluster and splits).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn decode_is_bit_identical_run_to_run() {
    let gpu = gpu();
    let mut cfg = geometry(128, 16, 4, None);
    cfg.hidden = 2048;
    cfg.intermediate = 5632;
    cfg.vocab = 8192;
    let w = DenseWeights::synthetic(&gpu, &cfg, 3).unwrap();
    let mut m = model(gpu, &cfg, w, 1200);
    for n in [20usize, 1030] {
        let prompt: Vec<u32> = (0..n as u32)
            .map(|i| (i * 131 + 17) % cfg.vocab as u32)
            .collect();
        let a = run_bits(&mut m, &prompt, 24);
        let b = run_bits(&mut m, &prompt, 24);
        for (step, (x, y)) in a.iter().zip(&b).enumerate() {
            let diff = x.iter().zip(y).filter(|(p, q)| p != q).count();
            assert_eq!(diff, 0, "prompt {n}: step {step}: {diff} logits differ");
        }
    }
}

/// Seeded bf16 values in [-1, 1) (a few of them large) for the decode GEMM tests.
fn bf16_values(n: usize, seed: u64) -> Vec<u16> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            trellm_cuda::dense::to_bf16(if i % 97 == 0 { 40.0 * u } else { u })
        })
        .collect()
}

fn bf16_f64(v: u16) -> f64 {
    f32::from_bits((v as u32) << 16) as f64
}

/// The tensor-core decode GEMM against float64 on the host at 2..8 rows, on shapes that are and
/// are not whole tiles and chunks (n not a multiple of 16, k a multiple of 8 but not of 64); and
/// bit-identical run to run.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn few_rows_gemm_matches_f64() {
    let gpu = gpu();
    let few = FewRows::load(&gpu).unwrap();
    let mut failures = Vec::new();
    for &(n, k) in &[
        (256usize, 512usize),
        (72, 200),
        (4104, 136),
        (33, 8),
        (1000, 4096),
    ] {
        let w = bf16_values(n * k, (n * 31 + k) as u64);
        let wd = gpu.upload(&w).unwrap();
        for m in 2..=8usize {
            let x = bf16_values(m * k, (m * 7 + n) as u64);
            let xd = gpu.upload(&x).unwrap();
            let yd = gpu.alloc::<f32>(m * n).unwrap();
            let run = || {
                few.run(&gpu, m, n, k, gpu.ptr(&xd), gpu.ptr(&wd), gpu.ptr(&yd))
                    .unwrap();
                gpu.stream.clone_dtoh(&yd).unwrap()
            };
            let y = run();
            assert_eq!(y, run(), "{m}x{n}x{k}: runs differ");
            for t in 0..m {
                for o in 0..n {
                    let (mut dot, mut mag) = (0.0f64, 0.0f64);
                    for i in 0..k {
                        let p = bf16_f64(x[t * k + i]) * bf16_f64(w[o * k + i]);
                        dot += p;
                        mag += p.abs();
                    }
                    let got = y[t * n + o] as f64;
                    if (got - dot).abs() > 1e-5 * mag + 1e-30 {
                        failures.push(format!("{m}x{n}x{k}: y[{t}][{o}] = {got}, want {dot}"));
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} wrong, first: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
}

/// Times the decode GEMM against cuBLAS on the Llama-3.1-8B shapes at 2, 4 and 8 rows, as a share
/// of the same-run copy bandwidth (TRELLM_RESULTS appends the lines to a file); the larger
/// matrices, which the dispatcher gives cuBLAS, through the kernel directly.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn few_rows_gemm_timing() {
    let gpu = gpu();
    let copy = bench::copy_bytes_per_s(&gpu, 10).unwrap();
    let mut emit = common::results();
    emit(format!(
        "{{\"device\": \"{}\", \"copy_gb_s\": {:.1}}}",
        gpu.name,
        copy / 1e9
    ));
    let few = FewRows::load(&gpu).unwrap();
    let shapes = [
        ("qkv", 6144usize, 4096usize),
        ("o", 4096, 4096),
        ("gate_up", 28672, 4096),
        ("down", 4096, 14336),
        ("head", 128256, 4096),
    ];
    for (name, n, k) in shapes {
        let bytes = 2 * n * k;
        // Enough copies of the matrix that L2 (50 MB) holds none of it between reads.
        let copies = (400usize << 20).div_ceil(bytes).max(2);
        let ws: Vec<_> = (0..copies)
            .map(|c| {
                let w = gpu.alloc::<u16>(n * k).unwrap();
                bench::fill_random_bf16(&gpu, gpu.ptr(&w), n * k, c as u64).unwrap();
                w
            })
            .collect();
        let x = gpu.alloc::<u16>(8 * k).unwrap();
        bench::fill_random_bf16(&gpu, gpu.ptr(&x), 8 * k, 99).unwrap();
        let y = gpu.alloc::<f32>(8 * n).unwrap();
        for m in [2usize, 4, 8] {
            for ours in [false, true] {
                let ms = bench::time_ms(&gpu, 2, 7, || {
                    for w in &ws {
                        let (xp, wp, yp) = (gpu.ptr(&x), gpu.ptr(w), gpu.ptr(&y));
                        if ours {
                            few.launch(&gpu, m, n, k, xp, wp, yp)?;
                        } else {
                            trellm_cuda::dense::gemm_bf16_f32(&gpu, m, n, k, xp, wp, yp)?;
                        }
                    }
                    Ok(())
                })
                .unwrap()
                    / copies as f64;
                let pct = 100.0 * bytes as f64 / (ms * 1e-3) / copy;
                let kernel = if ours { "gemm_rows8" } else { "cublas" };
                emit(format!(
                    "{{\"matrix\": \"{name}\", \"n\": {n}, \"k\": {k}, \"rows\": {m}, \"kernel\": \"{kernel}\", \"us\": {:.2}, \"pct_copy\": {pct:.1}}}",
                    ms * 1e3
                ));
            }
        }
    }
}

/// Tensor parallelism's collective on one GPU (a world of one rank): the decoder with NCCL's
/// all-reduce between the output and down projections and their residual adds (the unfused
/// residual path, the all-reduce inside the captured decode graph) gives the plain decoder's
/// logits within bf16 rounding and the same greedy ids, and runs bit-identically twice.
#[test]
#[ignore = "needs an NVIDIA GPU and NCCL: run with --ignored on the GPU machine"]
fn nccl_world_of_one_matches_the_plain_decoder() {
    let gpu = gpu();
    assert!(
        trellm_cuda::nccl::available(),
        "NCCL (libnccl.so) is not on the loader's path"
    );
    let mut cfg = geometry(128, 16, 4, None);
    cfg.hidden = 1024;
    cfg.intermediate = 2816;
    cfg.vocab = 4096;
    let mut plain = model(
        gpu.clone(),
        &cfg,
        DenseWeights::synthetic(&gpu, &cfg, 9).unwrap(),
        512,
    );
    let mut ranked = model(
        gpu.clone(),
        &cfg,
        DenseWeights::synthetic(&gpu, &cfg, 9).unwrap(),
        512,
    );
    let comm = trellm_cuda::nccl::Comm::for_gpus(&[&gpu]).unwrap();
    assert_eq!((comm[0].rank, comm[0].world), (0, 1));
    ranked.set_comm(Arc::new(comm.into_iter().next().unwrap()));
    let prompt: Vec<u32> = (0..40u32)
        .map(|i| (i * 97 + 11) % cfg.vocab as u32)
        .collect();
    let floats = |v: &[u32]| v.iter().map(|&b| f32::from_bits(b)).collect::<Vec<_>>();
    let argmax = |v: &[f32]| (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap();
    let a = run_bits(&mut plain, &prompt, 24);
    let b = run_bits(&mut ranked, &prompt, 24);
    assert_eq!(b, run_bits(&mut ranked, &prompt, 24), "two runs differ");
    let mut worst = 0.0f64;
    for (step, (x, y)) in a.iter().zip(&b).enumerate() {
        let (x, y) = (floats(x), floats(y));
        let e = rel_err(&x, &y);
        worst = worst.max(e);
        assert!(e < 1e-2, "step {step}: relative error {e:e}");
        assert_eq!(argmax(&x), argmax(&y), "step {step}: greedy ids differ");
    }
    eprintln!("world of one vs plain: largest relative logit error {worst:.2e}");
}

/// Flash prefill attention (`attn_prefill`) against float64 attention on the host, on the kernel
/// alone: GQA groups of 1 to 7, head dims 16 to 128, sliding windows and soft-caps, keys already
/// in the cache before the segment (a continued prefill), a paged cache with shuffled blocks and
/// a contiguous one, row counts that are not whole blocks, and a segment that is not the step's
/// first (its stacked rows and outputs start past another's).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the GPU machine"]
fn flash_prefill_matches_f64_attention() {
    use trellm_cuda::dense::{FlashPrefill, FlashSegment, KV_BLOCK};
    let gpu = gpu();
    // (head dim, kv heads, group, window, soft-cap, keys before, tokens, paged)
    for (hd, n_kv, group, window, softcap, before, n, paged) in [
        (128, 2, 4, None, None, 0, 150, true),
        (128, 1, 1, Some(40), None, 70, 33, false),
        (64, 3, 1, Some(37), Some(30.0), 5, 100, true),
        (96, 1, 7, None, None, 17, 21, true),
        (80, 2, 2, None, Some(50.0), 0, 64, false),
        (16, 2, 2, Some(5), Some(4.0), 9, 40, true),
    ] {
        let flash = FlashPrefill::load(&gpu, hd)
            .unwrap()
            .expect("a flash head dim");
        let (off, n_heads, n_keys) = (3usize, n_kv * group, before + n);
        let m = off + n; // the step's tokens: another segment's 3, then this one's
        let seed = (hd * 31 + n) as u64;
        // q stacked [kv head][m * group][hd], scaled like the RoPE kernel leaves it.
        // Values in [-1, 1) (the generator's rare large ones folded back), q scaled like the
        // RoPE kernel leaves it.
        let values = |n: usize, seed: u64, scale: f32| -> Vec<u16> {
            bf16_values(n, seed)
                .into_iter()
                .map(|v| {
                    let x = bf16_f64(v) as f32;
                    trellm_cuda::dense::to_bf16(if x.abs() > 1.0 { x / 40.0 } else { x } * scale)
                })
                .collect()
        };
        let q = values(n_kv * m * group * hd, seed, 0.35);
        let blocks = n_keys.div_ceil(KV_BLOCK);
        // The sequence's logical blocks in physical slots, shuffled (or positions as slots).
        let table: Vec<i32> = (0..blocks as i32)
            .map(|b| (b * 7 + 3) % blocks as i32)
            .collect();
        let slot = |key: usize| {
            if paged {
                table[key / KV_BLOCK] as usize * KV_BLOCK + key % KV_BLOCK
            } else {
                key
            }
        };
        let cache = blocks * KV_BLOCK * n_kv * hd;
        let (kc, vc) = (values(cache, seed + 1, 1.0), values(cache, seed + 2, 1.0));
        let pos: Vec<i32> = (0..m).map(|t| (before + t) as i32 - off as i32).collect();
        let (qd, kd, vd) = (
            gpu.upload(&q).unwrap(),
            gpu.upload(&kc).unwrap(),
            gpu.upload(&vc).unwrap(),
        );
        let (td, pd) = (gpu.upload(&table).unwrap(), gpu.upload(&pos).unwrap());
        let out = gpu.alloc::<u16>(m * n_heads * hd).unwrap();
        flash
            .launch(
                &gpu,
                &FlashSegment {
                    q: gpu.ptr(&qd),
                    q_rows: m * group,
                    row0: off * group,
                    rows: n * group,
                    k: gpu.ptr(&kd),
                    v: gpu.ptr(&vd),
                    table: if paged { gpu.ptr(&td) } else { 0 },
                    n_kv,
                    n_keys,
                    pos: gpu.ptr(&pd) + 4 * off as u64,
                    group,
                    window,
                    softcap,
                    out: gpu.ptr(&out) + 2 * (off * n_heads * hd) as u64,
                },
            )
            .unwrap();
        let got = gpu.stream.clone_dtoh(&out).unwrap();
        let mut err = 0.0f64;
        for t in 0..n {
            let p = before + t;
            let lo = window.map_or(0, |w| (p + 1).saturating_sub(w));
            for h in 0..n_heads {
                let (kvh, row) = (h / group, (off + t) * group + h % group);
                let qr = &q[(kvh * m * group + row) * hd..][..hd];
                let kv_at = |c: &[u16], key: usize, d: usize| {
                    bf16_f64(c[(slot(key) * n_kv + kvh) * hd + d])
                };
                let scores: Vec<f64> = (lo..=p)
                    .map(|key| {
                        let s: f64 = (0..hd).map(|d| bf16_f64(qr[d]) * kv_at(&kc, key, d)).sum();
                        softcap.map_or(s, |c| (s / c as f64).tanh() * c as f64)
                    })
                    .collect();
                let mx = scores.iter().cloned().fold(f64::MIN, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                let sum: f64 = w.iter().sum();
                for d in 0..hd {
                    let want: f64 = (lo..=p)
                        .zip(&w)
                        .map(|(key, wk)| wk * kv_at(&vc, key, d))
                        .sum::<f64>()
                        / sum;
                    let have = bf16_f64(got[((off + t) * n_heads + h) * hd + d]);
                    err = err.max((have - want).abs());
                }
            }
        }
        // bf16 weights and outputs (2^-9 relative each) of values within 1: at most ~2^-8 x the
        // values' spread; a key too many or too few in the windowed and short cases (5 to 40
        // keys) is an error of about 1 / keys.
        assert!(
            err <= 0.01,
            "hd {hd}, {n_kv} kv x {group}, window {window:?}, softcap {softcap:?}, paged {paged}: \
             max error {err}"
        );
        // The other segment's rows are untouched.
        assert!(got[..off * n_heads * hd].iter().all(|&v| v == 0));
    }
}
