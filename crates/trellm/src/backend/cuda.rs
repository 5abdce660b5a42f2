//! The bridge to the CUDA backend (`trellm-cuda`): the GPU decoder uploads the model's weights
//! (rounded to bf16) and runs its config and plan; it is checked against the CPU decoder in the
//! same binary.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, ensure, Result};
use trellm_cuda::dense::{DenseModel, DenseWeights, PagedKv, KV_BLOCK, MAX_SEQS};
use trellm_cuda::Gpu;

use trellm_model::{Batch, Logits, ModelBackend, Shard, Want};

use super::cpu::{CpuModel, Exl3Activations};
use super::SoloSequence;
use crate::engine::generate::PREFILL_STEP;
use crate::model::config::ModelConfig;
use crate::model::weights::{LayerWeights, Linear, LinearWeight, Matrix, NormWeights, Weights};

pub use trellm_cuda::{available, unavailable_reason};

/// Uploads `model`'s weights (any stored format, rounded to bf16) and builds the GPU decoder
/// over its config and plan.
pub fn upload(
    gpu: Arc<Gpu>,
    model: &CpuModel,
    max_context: usize,
    max_prefill: usize,
) -> Result<DenseModel> {
    upload_with(gpu, model, max_context, max_prefill, dense_options(model))
}

/// The decoder's options for `model`: its EXL3 MUL1 layers' one-row steps on the int8 fast path
/// unless the model asks for the exact path (`--exl3-exact`, as on the CPU).
pub fn dense_options(model: &CpuModel) -> trellm_cuda::dense::Options {
    exl3_options(model.exl3_activations == Exl3Activations::Exact)
}

/// The decoder's default options, the EXL3 one-row steps exact where asked for.
fn exl3_options(exl3_exact: bool) -> trellm_cuda::dense::Options {
    trellm_cuda::dense::Options {
        exl3_int8: !exl3_exact,
        ..Default::default()
    }
}

/// [`upload`] with the decoder's options.
pub fn upload_with(
    gpu: Arc<Gpu>,
    model: &CpuModel,
    max_context: usize,
    max_prefill: usize,
    opts: trellm_cuda::dense::Options,
) -> Result<DenseModel> {
    let w = DenseWeights::upload(&gpu, &model.cfg, &model.weights)?;
    DenseModel::with_options(
        gpu,
        &model.cfg,
        &model.plan,
        w,
        max_context,
        max_prefill,
        opts,
    )
}

/// The GPU decoder behind the step contract: ragged batches of many sequences over a paged KV
/// cache on the device (blocks of [`KV_BLOCK`] positions addressed through each sequence's block
/// table), see [`DenseModel::step_batch`]. Under tensor parallelism, one decoder per rank, rank
/// i on GPU i with its [`Shard`] of the weights and its kv heads' cache, each stepped by a
/// thread of its own; their all-reduces meet through NCCL.
pub struct CudaModel {
    cfg: ModelConfig,
    ranks: Vec<Mutex<SendDense>>,
}

/// The decoder's CUDA graphs hold raw handles, which cudarc does not mark `Send`; the mutex
/// lets one thread at a time use them, and cudarc binds the context before each call.
struct SendDense(DenseModel);
// SAFETY: see above: access is serialized by the mutex and the context is bound per call.
unsafe impl Send for SendDense {}

/// The KV blocks on the device, one cache a rank.
pub struct CudaCache(Vec<RankKv>);
struct RankKv(PagedKv);
// SAFETY: device buffers, used only under their rank's mutex (see SendDense); a step's rank
// threads each read only their own.
unsafe impl Send for RankKv {}
unsafe impl Sync for RankKv {}

impl CudaModel {
    /// Uploads `model` for sequences of up to `capacity` positions each (at most the model's
    /// context), split over `tensor_parallel` GPUs.
    pub fn new(model: &CpuModel, capacity: usize, tensor_parallel: usize) -> Result<CudaModel> {
        if !available() {
            bail!("--device cuda: {}", unavailable_reason());
        }
        let world = tensor_parallel.max(1);
        let gpus = ranks_gpus(&model.cfg, world)?;
        let cap = capacity.clamp(1, model.cfg.max_context.max(1));
        let prefill = PREFILL_STEP.min(cap.max(MAX_SEQS));
        let mut ranks = Vec::with_capacity(world);
        for (rank, gpu) in gpus.iter().enumerate() {
            let shard = Shard { rank, world };
            let cfg = shard.config(&model.cfg);
            let w = shard.weights(&model.cfg, &model.weights)?;
            let dw = DenseWeights::upload(gpu, &cfg, &w)?;
            let plan = trellm_model::Plan::new(&cfg);
            ranks.push(DenseModel::with_options(
                gpu.clone(),
                &cfg,
                &plan,
                dw,
                cap,
                prefill,
                dense_options(model),
            )?);
        }
        Self::join(model.cfg.clone(), &gpus, ranks)
    }

    /// Seeded synthetic weights of a named shape (`bench --shape`), generated on the device;
    /// EXL3 layers of a codebook and rates with `exl3` (their one-row steps on the exact path
    /// with `exl3_exact`); split over `tensor_parallel` GPUs (each rank's shard seeded on its
    /// own: a timing model, not one whose ranks sum to a whole).
    pub fn synthetic(
        shape: &str,
        capacity: usize,
        exl3: Option<trellm_quant::exl3::Exl3Rates>,
        exl3_exact: bool,
        tensor_parallel: usize,
    ) -> Result<CudaModel> {
        if !available() {
            bail!("--device cuda: {}", unavailable_reason());
        }
        let cfg = trellm_cuda::bench::shape(shape)?;
        let world = tensor_parallel.max(1);
        let gpus = ranks_gpus(&cfg, world)?;
        let cap = capacity.max(1);
        let mut ranks = Vec::with_capacity(world);
        for (rank, gpu) in gpus.iter().enumerate() {
            let rcfg = Shard { rank, world }.config(&cfg);
            let w = DenseWeights::synthetic_with(gpu, &rcfg, 1 + rank as u64, exl3)?;
            let plan = trellm_model::Plan::new(&rcfg);
            let prefill = PREFILL_STEP.min(cap.max(MAX_SEQS));
            ranks.push(DenseModel::with_options(
                gpu.clone(),
                &rcfg,
                &plan,
                w,
                cap,
                prefill,
                exl3_options(exl3_exact),
            )?);
        }
        Self::join(cfg, &gpus, ranks)
    }

    /// The ranks as one model, their communicators set where there are several.
    fn join(cfg: ModelConfig, gpus: &[Arc<Gpu>], mut ranks: Vec<DenseModel>) -> Result<CudaModel> {
        if ranks.len() > 1 {
            let comms =
                trellm_cuda::nccl::Comm::for_gpus(&gpus.iter().map(|g| &**g).collect::<Vec<_>>())?;
            for (r, c) in ranks.iter_mut().zip(comms) {
                r.set_comm(Arc::new(c));
            }
        }
        Ok(CudaModel {
            cfg,
            ranks: ranks
                .into_iter()
                .map(|r| Mutex::new(SendDense(r)))
                .collect(),
        })
    }

    /// [`ModelBackend::step`] with every kernel timed (the batched bench's profile; one rank).
    pub fn profile_step(
        &self,
        batch: &Batch,
        cache: &mut CudaCache,
    ) -> Result<Vec<trellm_cuda::KernelTime>> {
        ensure!(self.ranks.len() == 1, "a profiled step runs on one GPU");
        self.rank(0)?.0.profile_step_batch(batch, &cache.0[0].0)
    }

    fn rank(&self, r: usize) -> Result<std::sync::MutexGuard<'_, SendDense>> {
        self.ranks[r]
            .lock()
            .map_err(|_| anyhow!("the CUDA decoder panicked"))
    }
}

impl ModelBackend for CudaModel {
    type Cache = CudaCache;

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn new_cache(&self, n_blocks: usize, block_size: usize) -> Result<CudaCache> {
        ensure!(
            block_size == KV_BLOCK,
            "the CUDA KV cache takes blocks of {KV_BLOCK} positions, not {block_size}"
        );
        let caches = (0..self.ranks.len()).map(|r| Ok(RankKv(self.rank(r)?.0.paged_kv(n_blocks)?)));
        Ok(CudaCache(caches.collect::<Result<_>>()?))
    }

    fn block_bytes(&self, block_size: usize) -> usize {
        self.cfg.n_layers() * 2 * block_size * self.cfg.n_kv_heads * self.cfg.head_dim * 2
    }

    fn copy_blocks(&self, cache: &mut CudaCache, copies: &[(u32, u32)]) -> Result<()> {
        for (r, kv) in cache.0.iter_mut().enumerate() {
            self.rank(r)?.0.copy_blocks(&mut kv.0, copies)?;
        }
        Ok(())
    }

    fn step(&self, batch: &Batch, cache: &mut CudaCache) -> Result<Logits> {
        if self.ranks.len() == 1 {
            let rows = self.rank(0)?.0.step_batch(batch, &cache.0[0].0)?;
            return Ok(Logits::Lent(Box::new(rows)));
        }
        // Every rank steps at once (its all-reduces wait for the others'); all hold the same
        // logits (the head is replicated), rank 0's are returned.
        std::thread::scope(|s| {
            let steps: Vec<_> = (0..self.ranks.len())
                .zip(&cache.0)
                .map(|(r, kv)| s.spawn(move || self.rank(r)?.0.step_batch(batch, &kv.0)))
                .collect();
            let mut first = None;
            for h in steps {
                let logits = h
                    .join()
                    .map_err(|_| anyhow!("a tensor-parallel rank panicked"))??;
                first.get_or_insert(logits);
            }
            let rows = first.ok_or_else(|| anyhow!("no ranks"))?;
            Ok(Logits::Lent(Box::new(rows)))
        })
    }
}

/// GPUs 0..world for the ranks of `cfg`, once the split and the machine allow it.
fn ranks_gpus(cfg: &ModelConfig, world: usize) -> Result<Vec<Arc<Gpu>>> {
    let gpus = trellm_cuda::device_count()?;
    ensure!(
        world <= gpus,
        "--tensor-parallel {world}: this machine has {gpus} GPU(s)"
    );
    Shard::check(cfg, world)?;
    (0..world).map(|i| Gpu::new(i).map(Arc::new)).collect()
}

/// `w` with every ggml-format matrix decoded and rounded to bf16 (the values the GPU holds),
/// stored as f32 in memory; EXL3 matrices as they are (the GPU decodes them exactly); norms and
/// biases stay f32 as on the GPU.
pub fn bf16_rounded(w: &Weights) -> Result<Weights> {
    let mat = |m: &Matrix| -> Result<Matrix> {
        let mut v = vec![0.0f32; m.rows * m.cols];
        for (r, row) in v.chunks_exact_mut(m.cols.max(1)).enumerate() {
            m.dequantize_row(r, row);
            for x in row.iter_mut() {
                *x = half::bf16::from_f32(*x).to_f32();
            }
        }
        Matrix::from_f32(m.rows, m.cols, &v)
    };
    // EXL3 matrices are exact on both sides (the GPU keeps them compressed).
    let lw = |l: &LinearWeight| -> Result<LinearWeight> {
        Ok(match l {
            LinearWeight::Ggml(m) => LinearWeight::Ggml(mat(m)?),
            LinearWeight::Exl3(e) => LinearWeight::Exl3(e.clone()),
        })
    };
    let lin = |l: &Linear| -> Result<Linear> {
        Ok(Linear {
            w: lw(&l.w)?,
            b: l.b.clone(),
        })
    };
    let norm = |n: &NormWeights| NormWeights {
        w: n.w.clone(),
        b: n.b.clone(),
    };
    let layers = w
        .layers
        .iter()
        .map(|l| {
            Ok(LayerWeights {
                attn_norm: l.attn_norm.as_ref().map(norm),
                q: lin(&l.q)?,
                k: lin(&l.k)?,
                v: lin(&l.v)?,
                o: lin(&l.o)?,
                q_norm: l.q_norm.clone(),
                k_norm: l.k_norm.clone(),
                post_attn_norm: l.post_attn_norm.as_ref().map(norm),
                ffn_norm: l.ffn_norm.as_ref().map(norm),
                gate: l.gate.as_ref().map(lin).transpose()?,
                up: lin(&l.up)?,
                down: lin(&l.down)?,
                post_ffn_norm: l.post_ffn_norm.as_ref().map(norm),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Weights {
        embed: mat(&w.embed)?,
        layers,
        final_norm: norm(&w.final_norm),
        lm_head: lw(&w.lm_head)?,
    })
}

/// One comparison of the GPU decoder against the CPU decoder.
#[derive(Debug, Clone)]
pub struct CheckReport {
    pub model: PathBuf,
    pub steps: usize,
    /// Largest `|gpu - cpu| / |cpu|` (L2 over the vocabulary) over prefill and every step.
    pub max_rel_err: f64,
    pub max_abs_err: f64,
    pub cpu_ids: Vec<u32>,
    pub gpu_ids: Vec<u32>,
    /// The CPU's top-2 logit gap at the first step where the ids differ.
    pub gap_at_divergence: Option<f32>,
}

impl CheckReport {
    pub fn ids_equal(&self) -> bool {
        self.cpu_ids == self.gpu_ids
    }
}

/// The relative L2 error `|gpu - cpu| / |cpu|` and the largest `|gpu - cpu|`.
pub fn errors(gpu: &[f32], cpu: &[f32]) -> (f64, f64) {
    let (mut num, mut den, mut max) = (0.0f64, 0.0f64, 0.0f64);
    for (&g, &c) in gpu.iter().zip(cpu) {
        let d = (g - c) as f64;
        num += d * d;
        den += (c as f64) * (c as f64);
        max = max.max(d.abs());
    }
    ((num / den.max(1e-30)).sqrt(), max)
}

fn top2_gap(x: &[f32]) -> f32 {
    let mut v = x.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    v[0] - v.get(1).copied().unwrap_or(f32::NEG_INFINITY)
}

/// Runs a prompt and `steps` greedy steps on the CPU and the GPU decoder (weights rounded to
/// bf16 for both, see [`bf16_rounded`]) and compares logits and ids. `model_path`: any model
/// trellm loads (a folder, a GGUF file).
pub fn check_against_cpu(model_path: &Path, steps: usize) -> Result<CheckReport> {
    let loaded = crate::model::load::load(model_path)?;
    let src = &*loaded.model;
    // Both backends on their exact paths.
    let model = &CpuModel {
        exl3_activations: Exl3Activations::Exact,
        ..CpuModel::new(src.cfg.clone(), bf16_rounded(&src.weights)?)
    };
    let cfg = &model.cfg;
    let prompt: Vec<u32> = (0..11u32)
        .map(|i| (i * 37 + 3) % cfg.vocab as u32)
        .collect();
    let ctx = prompt.len() + steps + 1;
    let gpu = Arc::new(Gpu::new(0)?);
    let mut g = upload(gpu, model, ctx, prompt.len())?;

    let mut cpu = SoloSequence::new(model, ctx)?;
    let mut cpu_logits = cpu.forward(&prompt, Want::Last)?;
    g.prefill(&prompt)?;
    let mut gpu_logits = g.logits()?;
    let (mut max_rel, mut max_abs) = errors(&gpu_logits, &cpu_logits);
    let (mut cpu_ids, mut gpu_ids) = (Vec::new(), Vec::new());
    let mut gap = None;
    for _ in 0..steps {
        let c = crate::engine::sampler::argmax(&cpu_logits);
        let gt = g.next_token()?;
        if c != gt && gap.is_none() {
            gap = Some(top2_gap(&cpu_logits));
        }
        cpu_ids.push(c);
        gpu_ids.push(gt);
        // Both continue from the CPU's token, so later steps still compare like with like.
        g.set_next_token(c)?;
        cpu_logits = cpu.forward(&[c], Want::Last)?;
        g.decode_step()?;
        gpu_logits = g.logits()?;
        let (r, a) = errors(&gpu_logits, &cpu_logits);
        max_rel = max_rel.max(r);
        max_abs = max_abs.max(a);
    }
    Ok(CheckReport {
        model: model_path.to_path_buf(),
        steps,
        max_rel_err: max_rel,
        max_abs_err: max_abs,
        cpu_ids,
        gpu_ids,
        gap_at_divergence: gap,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ggml(l: &LinearWeight) -> Result<&Matrix> {
        match l {
            LinearWeight::Ggml(m) => Ok(m),
            LinearWeight::Exl3(_) => bail!("an EXL3 matrix"),
        }
    }

    /// The CPU side of `bench --check`: every matrix holds exactly the bf16 rounding of the
    /// stored values, in memory, so the check needs no folder layout (any format loads).
    #[test]
    fn bf16_rounded_weights_hold_the_rounded_values() {
        let dir = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/tiny/llama"
        ));
        let loaded = crate::model::load::load(dir).unwrap();
        let w = &loaded.model.weights;
        let r = bf16_rounded(w).unwrap();
        let pairs = [
            (&w.embed, &r.embed),
            (
                ggml(&w.layers[0].q.w).unwrap(),
                ggml(&r.layers[0].q.w).unwrap(),
            ),
            (
                ggml(&w.layers[1].down.w).unwrap(),
                ggml(&r.layers[1].down.w).unwrap(),
            ),
        ];
        let mut changed = 0;
        for (a, b) in pairs {
            assert_eq!((a.rows, a.cols), (b.rows, b.cols));
            let (mut ra, mut rb) = (vec![0.0; a.cols], vec![0.0; a.cols]);
            for row in 0..a.rows {
                a.dequantize_row(row, &mut ra);
                b.dequantize_row(row, &mut rb);
                for (x, y) in ra.iter().zip(&rb) {
                    assert_eq!(half::bf16::from_f32(*x).to_f32().to_bits(), y.to_bits());
                    changed += (x != y) as usize;
                }
            }
        }
        // The fixture's f32 weights are not all bf16 values: the rounding did something.
        assert!(changed > 0);
        assert_eq!(w.final_norm.w, r.final_norm.w);
    }
}
