//! `trellm bench --device cuda`: the GPU benchmark on synthetic weights (`--shape`) and the
//! GPU-against-CPU check (`--check --model DIR`).

use anyhow::{bail, Result};

use super::bench::BenchArgs;

#[cfg(not(feature = "cuda"))]
pub fn run(_: &BenchArgs) -> Result<()> {
    bail!("this trellm was built without the cuda feature")
}

#[cfg(feature = "cuda")]
pub fn run(a: &BenchArgs) -> Result<()> {
    use crate::backend::cuda;
    if !cuda::available() {
        bail!("--device cuda: {}", cuda::unavailable_reason());
    }
    if let (Some(sizes), Some(shape)) = (&a.batch, &a.shape) {
        let model = cuda::CudaModel::synthetic(
            shape,
            a.n_prompt + a.n_gen,
            a.exl3,
            a.model.exl3_exact,
            a.tensor_parallel,
        )?;
        super::bench::batched_on(a, &model, &format!("--shape {shape}"), sizes)?;
        if a.tensor_parallel > 1 {
            return Ok(());
        }
        let b = sizes.iter().copied().max().unwrap_or(1);
        let (wall_ms, prof) = profile_batch(&model, b, a.n_prompt)?;
        let obj = serde_json::json!({
            "b": b,
            "context": a.n_prompt,
            "decode_step_wall_ms": wall_ms,
            "decode_step_profile_us": profile_json(&prof),
        });
        println!("{obj}");
        return Ok(());
    }
    if a.check {
        let dir = trellm_hub::resolve_model(&a.model.model, false)?;
        let r = cuda::check_against_cpu(&dir, a.n_gen)?;
        let obj = serde_json::json!({
            "model": r.model.display().to_string(),
            "steps": r.steps,
            "max_rel_err": r.max_rel_err,
            "max_abs_err": r.max_abs_err,
            "ids_equal": r.ids_equal(),
            "cpu_ids": r.cpu_ids,
            "gpu_ids": r.gpu_ids,
            "gap_at_divergence": r.gap_at_divergence,
        });
        println!("{obj}");
        return Ok(());
    }
    let Some(shape) = &a.shape else {
        bail!("the GPU benchmark needs --shape (llama-3.1-8b, llama-3.1-70b, tiny) or --check");
    };
    let o = trellm_cuda::bench::BenchOptions {
        n_prompt: a.n_prompt.max(1),
        context: a.context.max(1),
        n_gen: a.n_gen.max(1),
        repetitions: a.repetitions,
        seed: 1,
        exl3: a.exl3,
        exl3_int8: !a.model.exl3_exact,
    };
    let r = trellm_cuda::bench::run(shape, &o)?;
    let copy = r.copy_bytes_per_s;
    let obj = serde_json::json!({
        "device": r.device,
        "shape": r.shape,
        "weights": a.exl3.map_or("bf16".to_string(), |e| format!("{} (head {})", e.describe(), trellm_cuda::dense::SYNTHETIC_HEAD_BITS)),
        "exl3_int8": o.exl3_int8 && a.exl3.is_some_and(|e| e.codebook == trellm_quant::exl3::Codebook::Mul1),
        "copy_tb_s": copy / 1e12,
        "gemm_bf16_tflop_s": r.gemm_flops_bf16_out / 1e12,
        "gemm_bf16_f32out_tflop_s": r.gemm_flops_f32_out / 1e12,
        "n_prompt": o.n_prompt,
        "prefill_tok_s": r.prefill_tok_s,
        "prefill_tflop_s": r.prefill_flops / 1e12,
        "prefill_frac_of_gemm_peak": r.prefill_flops / r.gemm_flops_bf16_out,
        "context": o.context,
        "n_gen": o.n_gen,
        "decode_tok_s": r.decode_tok_s,
        "decode_ms_per_token": r.decode_ms,
        "decode_weight_bytes": r.decode_weight_bytes,
        "decode_tb_s": r.decode_bytes_per_s / 1e12,
        "decode_frac_of_copy": r.decode_bytes_per_s / copy,
        "gemv_only_ms": r.gemv_only_ms,
        "gemv_only_tb_s": r.decode_weight_bytes as f64 / (r.gemv_only_ms * 1e-3) / 1e12,
        "layers_only_ms": r.layers_only_ms,
        "decode_ids": r.decode_ids,
        "logits_finite": r.logits_finite,
        "decode_profile_us": profile_json(&r.decode_profile),
        "prefill_profile_us": profile_json(&r.prefill_profile),
    });
    if a.json {
        println!("{obj}");
    } else {
        println!("{}", serde_json::to_string_pretty(&obj)?);
    }
    Ok(())
}

/// One decode step of `b` sequences at context `ctx` (after their prefill): its wall time
/// (logits on the host included) and, in a second step, the time of every kernel.
#[cfg(feature = "cuda")]
fn profile_batch(
    model: &crate::backend::cuda::CudaModel,
    b: usize,
    ctx: usize,
) -> Result<(f64, Vec<trellm_cuda::KernelTime>)> {
    use crate::backend::BLOCK_SIZE;
    use trellm_model::{Batch, BlockPool, BlockTable, ModelBackend, Want};
    let blocks = b * (ctx + 2).div_ceil(BLOCK_SIZE);
    let mut cache = model.new_cache(blocks, BLOCK_SIZE)?;
    let mut pool = BlockPool::new(blocks, BLOCK_SIZE);
    let mut tables: Vec<BlockTable> = (0..b).map(|_| BlockTable::default()).collect();
    for t in &mut tables {
        pool.grow(t, ctx + 2).map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let step = |len: usize, start: usize| {
        let mut batch = Batch::default();
        for (i, t) in tables.iter().enumerate() {
            let toks: Vec<u32> = (0..len as u32).map(|j| (j * 7 + i as u32) % 1000).collect();
            batch.push(&toks, start, t.blocks().to_vec(), Want::Last);
        }
        batch
    };
    model.step(&step(ctx, 0), &mut cache)?;
    let t0 = std::time::Instant::now();
    model.step(&step(1, ctx), &mut cache)?;
    let wall_ms = t0.elapsed().as_secs_f64() * 1e3;
    let prof = model.profile_step(&step(1, ctx + 1), &mut cache)?;
    Ok((wall_ms, prof))
}

/// `[[name, calls, total microseconds], ...]`, largest first.
#[cfg(feature = "cuda")]
fn profile_json(p: &[trellm_cuda::KernelTime]) -> serde_json::Value {
    let mut v: Vec<_> = p.iter().collect();
    v.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    v.iter()
        .map(|k| serde_json::json!([k.name, k.calls, (k.ms * 1e4).round() / 10.0]))
        .collect()
}
