//! The GPU benchmark: synthetic seeded weights for a named shape, generated on the device, and
//! the ceilings they are judged against, measured in the same run (a device-to-device copy and a
//! large bf16 GEMM through cuBLAS).

use std::sync::Arc;

use anyhow::{bail, Result};
use cudarc::cublas::sys as bsys;
use cudarc::driver::sys as dsys;

use trellm_model::config::{Dims, Family};
use trellm_model::rope::Rope;
use trellm_model::{ModelConfig, Plan};

use crate::dense::{self, DenseModel, DenseWeights, Shape};
use crate::{kernels, Arg, Gpu};

/// Shapes `--shape` accepts.
pub const SHAPES: &[&str] = &["llama-3.1-8b", "llama-3.1-70b", "tiny"];

/// A llama-style config for a named shape (the same [`ModelConfig`] a loaded model has).
pub fn shape(name: &str) -> Result<ModelConfig> {
    let (h, ff, nh, nkv, hd, vocab, layers, base, tied) = match name {
        "llama-3.1-8b" => (4096, 14336, 32, 8, 128, 128256, 32, 500000.0, false),
        // 141 GB in bf16: more than one H200 holds (tensor parallelism's test shape).
        "llama-3.1-70b" => (8192, 28672, 64, 8, 128, 128256, 80, 500000.0, false),
        "tiny" => (256, 512, 4, 2, 64, 1024, 2, 10000.0, true),
        other => bail!("unknown shape '{other}' (known: {})", SHAPES.join(", ")),
    };
    let dims = Dims {
        hidden: h,
        intermediate: ff,
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        vocab,
        n_layers: layers,
        norm_eps: 1e-5,
        max_context: 131072,
        bos_id: None,
        eos_ids: Vec::new(),
    };
    let mut cfg =
        ModelConfig::llama_like(Family::Llama, dims, Some(Rope::plain(hd, base, false, 1.0)));
    cfg.tied_embeddings = tied;
    Ok(cfg)
}

#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Prefill length.
    pub n_prompt: usize,
    /// Context the decode steps start at.
    pub context: usize,
    /// Decode steps timed per repetition.
    pub n_gen: usize,
    pub repetitions: usize,
    pub seed: u64,
    /// Every projection and the head as synthetic EXL3 layers of this codebook and rates.
    pub exl3: Option<trellm_quant::exl3::Exl3Rates>,
    /// Decode's MUL1 layers on the fast path (`dense::Options::exl3_int8`).
    pub exl3_int8: bool,
}

#[derive(Debug, Clone)]
pub struct BenchReport {
    pub device: String,
    pub shape: String,
    /// Device-to-device copy, bytes read plus written per second.
    pub copy_bytes_per_s: f64,
    /// 8192^3 bf16 GEMM through cuBLAS, bf16 output / f32 output (the prefill's form).
    pub gemm_flops_bf16_out: f64,
    pub gemm_flops_f32_out: f64,
    pub prefill_tok_s: f64,
    pub prefill_flops: f64,
    pub decode_tok_s: f64,
    /// Weight bytes one decode step reads.
    pub decode_weight_bytes: usize,
    pub decode_bytes_per_s: f64,
    /// Decode, ms per token (median over the repetitions).
    pub decode_ms: f64,
    /// Replay of the linear layers alone over the same weights, the output head included (ms).
    pub gemv_only_ms: f64,
    /// The same without the output head: the transformer blocks' projections (ms).
    pub layers_only_ms: f64,
    /// Greedy ids of the first timed decode steps (a sanity check that logits are alive).
    pub decode_ids: Vec<u32>,
    pub logits_finite: bool,
    /// Time per kernel of one decode step (at `context`) and of the prefill, each kernel timed
    /// alone outside the graph (the sum exceeds the graph's time by the launch gaps).
    pub decode_profile: Vec<crate::KernelTime>,
    pub prefill_profile: Vec<crate::KernelTime>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A device-to-device copy of 2 GiB, bytes read plus written per second (median of at least 5):
/// the ceiling bandwidth-bound kernels are judged against.
pub fn copy_bytes_per_s(gpu: &Gpu, reps: usize) -> Result<f64> {
    let n = 1usize << 29;
    let src = gpu.alloc::<u32>(n)?;
    let mut dst = gpu.alloc::<u32>(n)?;
    let ms = time_ms(gpu, 2, reps.max(5), || {
        Ok(gpu.stream.memcpy_dtod(&src, &mut dst)?)
    })?;
    Ok(2.0 * (n * 4) as f64 / (ms * 1e-3))
}

/// Milliseconds of `f` on the stream, timed with events; median of `reps` after `warm` runs.
pub fn time_ms(
    gpu: &Gpu,
    warm: usize,
    reps: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..warm {
        f()?;
    }
    gpu.sync()?;
    let flags = Some(dsys::CUevent_flags::CU_EVENT_DEFAULT);
    let (a, b) = (gpu.ctx.new_event(flags)?, gpu.ctx.new_event(flags)?);
    let mut v = Vec::with_capacity(reps);
    for _ in 0..reps {
        a.record(&gpu.stream)?;
        f()?;
        b.record(&gpu.stream)?;
        b.synchronize()?;
        v.push(a.elapsed_ms(&b)? as f64);
    }
    Ok(median(v))
}

/// Fills `n` bf16 values at `p` with seeded uniform values in [-1, 1).
pub fn fill_random_bf16(gpu: &Gpu, p: u64, n: usize, seed: u64) -> Result<()> {
    let f = gpu.function(&kernels::ELEMENTWISE, &[], "fill_uniform_bf16")?;
    gpu.launch(
        &f,
        (gpu.sm_count as u32 * 8, 1, 1),
        256,
        &[
            Arg::Ptr(p),
            Arg::U64(n as u64),
            Arg::U64(seed),
            Arg::F32(1.0),
        ],
    )
}

/// Runs the benchmark on device 0.
pub fn run(shape_name: &str, o: &BenchOptions) -> Result<BenchReport> {
    let cfg = shape(shape_name)?;
    let reps = o.repetitions.max(1);
    let gpu = Arc::new(Gpu::new(0)?);

    // Ceiling 1: device-to-device copy of 2 GiB.
    let copy_bytes_per_s = copy_bytes_per_s(&gpu, reps)?;

    // Ceiling 2: a large bf16 GEMM on random data.
    let (gemm_flops_bf16_out, gemm_flops_f32_out) = {
        let s = 8192usize;
        let a = gpu.alloc::<u16>(s * s)?;
        let bm = gpu.alloc::<u16>(s * s)?;
        let c = gpu.alloc::<f32>(s * s)?;
        fill_random_bf16(&gpu, gpu.ptr(&a), s * s, 1)?;
        fill_random_bf16(&gpu, gpu.ptr(&bm), s * s, 2)?;
        let flops = 2.0 * (s * s * s) as f64;
        let (pa, pb, pc) = (gpu.ptr(&a), gpu.ptr(&bm), gpu.ptr(&c));
        let ms16 = time_ms(&gpu, 3, reps.max(10), || {
            dense::gemm(&gpu, s, s, s, pa, pb, pc, bsys::cudaDataType::CUDA_R_16BF)
        })?;
        let ms32 = time_ms(&gpu, 3, reps.max(10), || {
            dense::gemm(&gpu, s, s, s, pa, pb, pc, bsys::cudaDataType::CUDA_R_32F)
        })?;
        (flops / (ms16 * 1e-3), flops / (ms32 * 1e-3))
    };

    let w = DenseWeights::synthetic_with(&gpu, &cfg, o.seed, o.exl3)?;
    let bytes = w.matrix_bytes();
    let max_context = o.n_prompt.max(o.context + o.n_gen + 1);
    let plan = Plan::new(&cfg);
    let mut model = DenseModel::with_options(
        gpu.clone(),
        &cfg,
        &plan,
        w,
        max_context,
        o.n_prompt.max(o.context),
        crate::dense::Options {
            exl3_int8: o.exl3_int8,
            ..Default::default()
        },
    )?;
    let tokens: Vec<u32> = (0..max_context as u64)
        .map(|i| ((i.wrapping_mul(2654435761) + 7) % cfg.vocab as u64) as u32)
        .collect();

    // Prefill.
    let prefill_ms = time_ms(&gpu, 1, reps, || {
        model.reset()?;
        model.prefill(&tokens[..o.n_prompt])
    })?;
    let n = o.n_prompt as f64;
    let attn_flops = 4.0 * (cfg.n_heads * cfg.head_dim) as f64 * n * (n + 1.0) / 2.0;
    let prefill_flops = 2.0 * (cfg.layer_matrix_params() * cfg.n_layers()) as f64 * n
        + attn_flops * cfg.n_layers() as f64
        + 2.0 * (cfg.vocab * cfg.hidden) as f64;

    // Decode from `context`: the first step captures the graph.
    let mut decode_ids = Vec::new();
    model.reset()?;
    model.prefill(&tokens[..o.context])?;
    model.decode_step()?;
    let mut decode = Vec::new();
    for _ in 0..reps {
        model.reset()?;
        model.prefill(&tokens[..o.context])?;
        let ms = time_ms(&gpu, 0, 1, || model.decode(o.n_gen))?;
        decode.push(ms / o.n_gen as f64);
        if decode_ids.is_empty() {
            decode_ids = model.history()?.into_iter().take(16).collect();
        }
    }
    let decode_ms = median(decode);
    let gemv = model.capture_gemv_only(true)?;
    let gemv_only_ms = time_ms(&gpu, 3, reps.max(10), || Ok(gemv.launch()?))?;
    let layers = model.capture_gemv_only(false)?;
    let layers_only_ms = time_ms(&gpu, 3, reps.max(10), || Ok(layers.launch()?))?;
    model.reset()?;
    let prefill_profile = model.profile_prefill(&tokens[..o.n_prompt])?;
    model.reset()?;
    model.prefill(&tokens[..o.context])?;
    let decode_profile = model.profile_decode_step()?;
    let logits_finite = model.logits()?.iter().all(|v| v.is_finite());
    Ok(BenchReport {
        device: gpu.name.clone(),
        shape: shape_name.to_string(),
        copy_bytes_per_s,
        gemm_flops_bf16_out,
        gemm_flops_f32_out,
        prefill_tok_s: n / (prefill_ms * 1e-3),
        prefill_flops: prefill_flops / (prefill_ms * 1e-3),
        decode_tok_s: 1e3 / decode_ms,
        decode_weight_bytes: bytes,
        decode_bytes_per_s: bytes as f64 / (decode_ms * 1e-3),
        decode_ms,
        gemv_only_ms,
        layers_only_ms,
        decode_ids,
        logits_finite,
        decode_profile,
        prefill_profile,
    })
}
