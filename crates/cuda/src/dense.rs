//! The dense (llama/gemma-style) decoder on the GPU, driven by the model's [`ModelConfig`] and
//! [`Plan`] and uploaded from its [`Weights`], the descriptions every backend shares.
//!
//! Activations: the residual stream is f32; matrix inputs (normed activations, attention
//! output, the MLP's hidden state) are bf16; projections produce f32. Weights are bf16, norms
//! f32. The KV cache is bf16, `[position][kv_head][head_dim]` per layer.
//!
//! Kernels per layer: qkv projection (one fused matrix), q/k norm + RoPE + cache write, attention
//! (partial + combine), o projection, residual add fused with the next norm, gate/up projection
//! with the activation fused in (decode), down projection, residual add + next norm. Decode runs
//! our GEMV and is captured once as a CUDA graph that reads the token and position from device
//! memory, so one replay is one token with no host round trip; prefill runs cuBLAS GEMMs, and
//! its attention is one flash-style kernel on tensor cores over the query rows stacked per kv
//! head (GQA shares K/V; [`FlashPrefill`]); head dims it does not take (not a multiple of 16, or
//! above 128) run S = Q K^T and O = P V as strided-batched GEMMs per chunk of query tokens, with a
//! masking/soft-capping softmax kernel between.
//! Decode by default (Llama-like models: RMSNorm, no q/k norm, no post-norms or o/down biases)
//! fuses rope and the cache write into the qkv GEMV, and the residual add into the o/down GEMVs'
//! epilogues with the next RMSNorm deferred into the next GEMV (the producer leaves bf16(w * x)
//! and the sum of squares; the consumer scales its dot products), so a layer is 6 kernels:
//! qkv+rope, attention partials, combine, o+residual, gate/up+act, down+residual. Decode attention
//! splits the actual context over a chip-sized grid (one cluster launch per kv head while the
//! context is short); a batch's tokens take it on tensor cores (`attn_decode`, a warp a split)
//! where the head dim allows. Every reduction runs in a fixed order, so a request reproduces bit for bit.

use std::sync::Arc;

use anyhow::{anyhow, bail, ensure, Context, Result};
use cudarc::cublas::sys as bsys;
use cudarc::driver::{result as dres, sys as dsys, CudaFunction, CudaGraph, CudaSlice};
use trellm_model::config::{Activation, Mlp, Norm, QkNorm};
use trellm_model::plan::{
    AttentionOp, GluEpilogue, LayerPlan, NormOp, Op, QkvEpilogue, ResidualEpilogue,
};
use trellm_model::weights::{Exl3Matrix, LinearWeight, Matrix, NormWeights, Weights};
use trellm_model::{Batch, ModelConfig, Plan, Want};

use crate::exl3::{Exl3Linear, Exl3Scratch, RopeKv, Rows};
use crate::kernels;
use crate::{Arg, Gpu, HostBuffers, HostRows};
use trellm_quant::exl3::{Bitrate, Exl3Shape};

/// Sizes derived from a [`ModelConfig`] that the GPU buffers and kernels use.
pub trait Shape {
    fn q_dim(&self) -> usize;
    fn kv_dim(&self) -> usize;
    fn qkv_dim(&self) -> usize;
    fn gated(&self) -> bool;
    /// Rows of the gate/up matrix: gate rows then up rows, or up rows alone.
    fn gate_up_rows(&self) -> usize;
    /// Linear parameters per layer (qkv, o, gate/up, down).
    fn layer_matrix_params(&self) -> usize;
}

impl Shape for ModelConfig {
    fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    fn qkv_dim(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
    }
    fn gated(&self) -> bool {
        self.mlp == Mlp::Gated
    }
    fn gate_up_rows(&self) -> usize {
        if self.gated() {
            2 * self.intermediate
        } else {
            self.intermediate
        }
    }
    fn layer_matrix_params(&self) -> usize {
        let h = self.hidden;
        self.qkv_dim() * h + h * self.q_dim() + self.gate_up_rows() * h + h * self.intermediate
    }
}

/// The kernels' activation codes (`activate` in prelude.cuh).
fn act_code(a: Activation) -> i32 {
    match a {
        Activation::Silu => 0,
        Activation::GeluTanh => 1,
        Activation::Gelu => 2,
    }
}

/// What the CUDA decoder runs of a model; fails for what it does not run.
fn validate(cfg: &ModelConfig) -> Result<()> {
    ensure!(cfg.n_layers() > 0, "the model has no layers");
    ensure!(
        cfg.n_kv_heads > 0 && cfg.n_heads.is_multiple_of(cfg.n_kv_heads),
        "{} heads do not divide into {} kv heads",
        cfg.n_heads,
        cfg.n_kv_heads
    );
    ensure!(
        cfg.head_dim.is_multiple_of(8) && cfg.head_dim <= 256,
        "head_dim {} is not supported on CUDA (a multiple of 8, at most 256)",
        cfg.head_dim
    );
    for l in &cfg.layers {
        if let Some(r) = &l.rope {
            ensure!(
                r.dims <= cfg.head_dim && r.dims.is_multiple_of(2),
                "bad rotary dims"
            );
        }
    }
    if cfg.qk_norm == QkNorm::Whole && cfg.qkv_bias {
        bail!("whole-projection q/k norms with qkv biases are not supported on CUDA");
    }
    Ok(())
}

/// One layer's plan, in the order the CUDA decoder runs it.
#[derive(Debug, Clone)]
struct LayerOps {
    qkv: QkvEpilogue,
    attn: AttentionOp,
    out: ResidualEpilogue,
    glu: GluEpilogue,
    down: ResidualEpilogue,
}

impl LayerOps {
    /// Layer `l`'s plan, checked against its buffers: the norms the plan applies are the ones
    /// the weights hold (the kernels apply a norm where its weights are present).
    fn of(l: usize, lp: &LayerPlan, lw: &LayerBuffers) -> Result<LayerOps> {
        let [Op::AttnNorm(an), Op::Qkv(qkv), Op::Attention(attn), Op::Output(out), Op::MlpNorm(mn), Op::GateUp(glu), Op::Down(down)] =
            lp.ops.as_slice()
        else {
            bail!(
                "layer {l}: the CUDA decoder does not run this plan: {:?}",
                lp.ops
            );
        };
        let same = |op: &Option<NormOp>, w: &Option<DeviceNorm>| op.is_some() == w.is_some();
        ensure!(
            same(an, &lw.attn_norm)
                && same(mn, &lw.ffn_norm)
                && same(&out.post_norm, &lw.post_attn_norm)
                && same(&down.post_norm, &lw.post_ffn_norm),
            "layer {l}: the plan's norms and the weights' differ"
        );
        Ok(LayerOps {
            qkv: qkv.clone(),
            attn: *attn,
            out: *out,
            glu: *glu,
            down: *down,
        })
    }
}

/// bf16 bits of a float, round to nearest even.
pub fn to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// A norm's scale and (LayerNorm) bias on the device, f32.
pub struct DeviceNorm {
    pub w: CudaSlice<f32>,
    pub b: Option<CudaSlice<f32>>,
}

/// A projection's matrix on the device.
pub enum DeviceMatrix {
    /// bf16, row-major `[out, in]` (the fused decode GEMVs read it directly).
    Bf16(CudaSlice<u16>),
    /// EXL3 layers, compressed, their outputs side by side (q, k, v; gate, up).
    Exl3(Vec<Exl3Linear>),
}

/// A borrowed [`DeviceMatrix`] (or the embedding as a tied output head).
#[derive(Clone, Copy)]
enum MatRef<'a> {
    Bf16(u64),
    Exl3(&'a [Exl3Linear]),
}

impl DeviceMatrix {
    fn view(&self, g: &Gpu) -> MatRef<'_> {
        match self {
            DeviceMatrix::Bf16(w) => MatRef::Bf16(g.ptr(w)),
            DeviceMatrix::Exl3(parts) => MatRef::Exl3(parts),
        }
    }

    /// The bf16 matrix, where the fused decode kernels can read it.
    fn bf16(&self, g: &Gpu) -> Option<u64> {
        match self {
            DeviceMatrix::Bf16(w) => Some(g.ptr(w)),
            DeviceMatrix::Exl3(_) => None,
        }
    }

    fn exl3(&self) -> &[Exl3Linear] {
        match self {
            DeviceMatrix::Bf16(_) => &[],
            DeviceMatrix::Exl3(parts) => parts,
        }
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        match self {
            DeviceMatrix::Bf16(w) => 2 * w.len(),
            DeviceMatrix::Exl3(parts) => parts.iter().map(Exl3Linear::device_bytes).sum(),
        }
    }
}

/// A linear layer on the device: its matrix and an f32 bias (applied by the kernel after it).
pub struct DeviceLinear {
    pub w: DeviceMatrix,
    pub b: Option<CudaSlice<f32>>,
}

/// One decoder layer's buffers. Projections that run as one matrix are stacked: q, k, v rows;
/// gate rows then up rows (gated MLPs).
pub struct LayerBuffers {
    pub attn_norm: Option<DeviceNorm>,
    pub qkv: DeviceLinear,
    pub q_norm: Option<CudaSlice<f32>>,
    pub k_norm: Option<CudaSlice<f32>>,
    pub o: DeviceLinear,
    pub post_attn_norm: Option<DeviceNorm>,
    pub ffn_norm: Option<DeviceNorm>,
    pub gate_up: DeviceLinear,
    pub down: DeviceLinear,
    pub post_ffn_norm: Option<DeviceNorm>,
    pub inv_freq: Option<CudaSlice<f32>>,
}

/// All weights on the device.
pub struct DenseWeights {
    pub embed: CudaSlice<u16>,
    pub layers: Vec<LayerBuffers>,
    pub final_norm: DeviceNorm,
    /// None when tied to the embedding.
    pub lm_head: Option<DeviceMatrix>,
}

impl DenseWeights {
    /// Every stack of EXL3 layers run together (q, k, v; gate, up; or one), with whether it is
    /// the output head.
    fn exl3_groups(&self) -> impl Iterator<Item = (&[Exl3Linear], bool)> {
        let body = self.layers.iter().flat_map(|l| {
            [&l.qkv, &l.o, &l.gate_up, &l.down]
                .into_iter()
                .map(|p| (p.w.exl3(), false))
        });
        let head = self.lm_head.iter().map(|h| (h.exl3(), true));
        body.chain(head).filter(|(parts, _)| !parts.is_empty())
    }

    /// Bytes of the matrices one decode step reads (every projection and the output head).
    pub fn matrix_bytes(&self) -> usize {
        let body: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.qkv, &l.o, &l.gate_up, &l.down]
                    .iter()
                    .map(|p| p.w.device_bytes())
                    .sum::<usize>()
            })
            .sum();
        body + self
            .lm_head
            .as_ref()
            .map_or(2 * self.embed.len(), DeviceMatrix::device_bytes)
    }
}

/// The matrix of a projection in a ggml format.
fn ggml(l: &LinearWeight) -> Result<&Matrix> {
    match l {
        LinearWeight::Ggml(m) => Ok(m),
        LinearWeight::Exl3(_) => bail!("an EXL3 matrix where a ggml one was expected"),
    }
}

/// The matrices' rows, one after the other, decoded exactly and rounded to bf16.
fn bf16_rows(ms: &[&Matrix]) -> Vec<u16> {
    let mut out = Vec::with_capacity(ms.iter().map(|m| m.rows * m.cols).sum());
    for m in ms {
        let mut row = vec![0.0f32; m.cols];
        for r in 0..m.rows {
            m.dequantize_row(r, &mut row);
            out.extend(row.iter().map(|&v| to_bf16(v)));
        }
    }
    out
}

impl DenseWeights {
    /// Uploads `w` (any ggml format, rounded to bf16; norms and biases as f32), one layer at a
    /// time so the host holds one layer's bf16 copy at once.
    pub fn upload(gpu: &Gpu, cfg: &ModelConfig, w: &Weights) -> Result<DenseWeights> {
        validate(cfg)?;
        ensure!(
            w.layers.len() == cfg.n_layers(),
            "{} layers of weights for {} in the config",
            w.layers.len(),
            cfg.n_layers()
        );
        let norm = |n: &NormWeights| -> Result<DeviceNorm> {
            ensure!(n.w.len() == cfg.hidden, "norm of {} values", n.w.len());
            Ok(DeviceNorm {
                w: gpu.upload(&n.w)?,
                b: n.b.as_deref().map(|b| gpu.upload(b)).transpose()?,
            })
        };
        let opt = |v: &Option<Vec<f32>>| -> Result<Option<CudaSlice<f32>>> {
            v.as_deref().map(|b| gpu.upload(b)).transpose()
        };
        // Projections stored in a ggml format become one bf16 matrix; EXL3 ones stay compressed.
        let matrix = |ws: &[&LinearWeight]| -> Result<DeviceMatrix> {
            let exl3: Vec<&Exl3Matrix> = ws
                .iter()
                .filter_map(|w| match w {
                    LinearWeight::Exl3(e) => Some(e),
                    LinearWeight::Ggml(_) => None,
                })
                .collect();
            if exl3.is_empty() {
                let ms = ws.iter().map(|w| ggml(w)).collect::<Result<Vec<_>>>()?;
                return Ok(DeviceMatrix::Bf16(gpu.upload(&bf16_rows(&ms))?));
            }
            ensure!(
                exl3.len() == ws.len(),
                "a stacked projection mixes EXL3 and other weights, which CUDA does not run"
            );
            let mut parts = exl3
                .iter()
                .map(|e| Exl3Linear::upload(gpu, e, None))
                .collect::<Result<Vec<_>>>()?;
            Exl3Linear::join(gpu, &mut parts)?;
            Ok(DeviceMatrix::Exl3(parts))
        };
        // Several projections stacked into one matrix (biases side by side, zeros where one
        // has none; no bias if none has one).
        let linear = |ls: &[&trellm_model::weights::Linear], rows: usize, cols: usize| {
            ensure!(
                ls.iter().map(|l| l.w.rows()).sum::<usize>() == rows
                    && ls.iter().all(|l| l.w.cols() == cols),
                "a projection of {:?}, expected {rows}x{cols}",
                ls.iter()
                    .map(|l| (l.w.rows(), l.w.cols()))
                    .collect::<Vec<_>>()
            );
            let b = if ls.iter().all(|l| l.b.is_none()) {
                None
            } else {
                let mut v = Vec::with_capacity(rows);
                for l in ls {
                    match &l.b {
                        Some(b) => v.extend_from_slice(b),
                        None => v.extend(std::iter::repeat_n(0.0, l.w.rows())),
                    }
                }
                Some(gpu.upload(&v)?)
            };
            Ok(DeviceLinear {
                w: matrix(&ls.iter().map(|l| &l.w).collect::<Vec<_>>())?,
                b,
            })
        };
        let h = cfg.hidden;
        let mut layers = Vec::with_capacity(cfg.n_layers());
        for (lw, spec) in w.layers.iter().zip(&cfg.layers) {
            let gate_up = match &lw.gate {
                Some(g) => vec![g, &lw.up],
                None => vec![&lw.up],
            };
            layers.push(LayerBuffers {
                attn_norm: lw.attn_norm.as_ref().map(norm).transpose()?,
                qkv: linear(&[&lw.q, &lw.k, &lw.v], cfg.qkv_dim(), h)?,
                q_norm: opt(&lw.q_norm)?,
                k_norm: opt(&lw.k_norm)?,
                o: linear(&[&lw.o], h, cfg.q_dim())?,
                post_attn_norm: lw.post_attn_norm.as_ref().map(norm).transpose()?,
                ffn_norm: lw.ffn_norm.as_ref().map(norm).transpose()?,
                gate_up: linear(&gate_up, cfg.gate_up_rows(), h)?,
                down: linear(&[&lw.down], h, cfg.intermediate)?,
                post_ffn_norm: lw.post_ffn_norm.as_ref().map(norm).transpose()?,
                inv_freq: spec
                    .rope
                    .as_ref()
                    .map(|r| gpu.upload(&r.inv_freq(1)))
                    .transpose()?,
            });
        }
        ensure!(
            w.embed.rows == cfg.vocab && w.embed.cols == h,
            "embedding of {}x{}",
            w.embed.rows,
            w.embed.cols
        );
        let lm_head = if cfg.tied_embeddings {
            None
        } else {
            let m = &w.lm_head;
            ensure!(
                m.rows() == cfg.vocab && m.cols() == h,
                "lm_head of {}x{}",
                m.rows(),
                m.cols()
            );
            Some(matrix(&[m])?)
        };
        Ok(DenseWeights {
            embed: gpu.upload(&bf16_rows(&[&w.embed]))?,
            layers,
            final_norm: norm(&w.final_norm)?,
            lm_head,
        })
    }

    /// Seeded random weights generated on the device (uniform, scaled by `1/sqrt(fan_in)`), norms
    /// of one; biases zero. Nothing large crosses the bus.
    pub fn synthetic(gpu: &Gpu, cfg: &ModelConfig, seed: u64) -> Result<DenseWeights> {
        Self::synthetic_with(gpu, cfg, seed, None)
    }

    /// [`Self::synthetic`], with every projection and the output head as random EXL3 layers of
    /// `exl3`'s codebook and rates (the embedding stays bf16), dimensions padded to 128s.
    pub fn synthetic_with(
        gpu: &Gpu,
        cfg: &ModelConfig,
        seed: u64,
        exl3: Option<trellm_quant::exl3::Exl3Rates>,
    ) -> Result<DenseWeights> {
        validate(cfg)?;
        let fill = gpu.function(&kernels::ELEMENTWISE, &[], "fill_uniform_bf16")?;
        let fill_f = gpu.function(&kernels::ELEMENTWISE, &[], "fill_f32")?;
        let counter = std::cell::Cell::new(seed.wrapping_mul(0x2545_f491_4f6c_dd1d));
        let bump = || {
            counter.set(counter.get().wrapping_add(0x9e37_79b9_7f4a_7c15));
            counter.get()
        };
        let mat = |rows: usize, cols: usize| -> Result<CudaSlice<u16>> {
            let n = rows * cols;
            let s = gpu.alloc::<u16>(n)?;
            let counter = bump();
            // Uniform in [-a, a) has variance a^2/3: a = sqrt(3/fan_in) keeps activations at scale.
            let a = (3.0 / cols as f32).sqrt();
            gpu.launch(
                &fill,
                (gpu.sm_count as u32 * 8, 1, 1),
                256,
                &[
                    Arg::Ptr(gpu.ptr(&s)),
                    Arg::U64(n as u64),
                    Arg::U64(counter),
                    Arg::F32(a),
                ],
            )?;
            Ok(s)
        };
        let ones = |n: usize| -> Result<CudaSlice<f32>> {
            let s = gpu.alloc::<f32>(n)?;
            gpu.launch(
                &fill_f,
                (n.div_ceil(256).min(4096) as u32, 1, 1),
                256,
                &[Arg::Ptr(gpu.ptr(&s)), Arg::U64(n as u64), Arg::F32(1.0)],
            )?;
            Ok(s)
        };
        let h = cfg.hidden;
        let norm = |ones: &dyn Fn(usize) -> Result<CudaSlice<f32>>| -> Result<DeviceNorm> {
            Ok(DeviceNorm {
                w: ones(h)?,
                b: match cfg.norm {
                    Norm::Rms => None,
                    Norm::Layer => Some(gpu.alloc::<f32>(h)?),
                },
            })
        };
        let zeros = |on: bool, n: usize| -> Result<Option<CudaSlice<f32>>> {
            on.then(|| gpu.alloc::<f32>(n)).transpose()
        };
        // One matrix of `parts` (row count, projection name) stacked.
        let matrix = |parts: &[(usize, &str)], cols: usize| -> Result<DeviceMatrix> {
            let Some(spec) = exl3 else {
                return Ok(DeviceMatrix::Bf16(mat(
                    parts.iter().map(|p| p.0).sum(),
                    cols,
                )?));
            };
            let k = cols.next_multiple_of(128);
            let mut layers = parts
                .iter()
                .map(|&(rows, proj)| {
                    let shape = Exl3Shape {
                        k,
                        n: rows.next_multiple_of(128),
                        rate: spec.rate_of(proj),
                        codebook: spec.codebook,
                    };
                    Exl3Linear::synthetic(gpu, shape, bump()).map(|l| l.used(rows, cols))
                })
                .collect::<Result<Vec<_>>>()?;
            Exl3Linear::join(gpu, &mut layers)?;
            Ok(DeviceMatrix::Exl3(layers))
        };
        let gate_up_parts: Vec<(usize, &str)> = if cfg.gated() {
            vec![(cfg.intermediate, "gate"), (cfg.intermediate, "up")]
        } else {
            vec![(cfg.intermediate, "up")]
        };
        let mut layers = Vec::with_capacity(cfg.n_layers());
        for spec in &cfg.layers {
            let qk = |n| -> Result<Option<CudaSlice<f32>>> {
                match cfg.qk_norm {
                    QkNorm::None => Ok(None),
                    QkNorm::PerHead => ones(cfg.head_dim).map(Some),
                    QkNorm::Whole => ones(n).map(Some),
                }
            };
            layers.push(LayerBuffers {
                attn_norm: cfg.pre_norms.then(|| norm(&ones)).transpose()?,
                qkv: DeviceLinear {
                    w: matrix(
                        &[(cfg.q_dim(), "q"), (cfg.kv_dim(), "k"), (cfg.kv_dim(), "v")],
                        h,
                    )?,
                    b: zeros(cfg.qkv_bias, cfg.qkv_dim())?,
                },
                q_norm: qk(cfg.q_dim())?,
                k_norm: qk(cfg.kv_dim())?,
                o: DeviceLinear {
                    w: matrix(&[(h, "o")], cfg.q_dim())?,
                    b: zeros(cfg.o_bias, h)?,
                },
                post_attn_norm: cfg.post_norms.then(|| norm(&ones)).transpose()?,
                ffn_norm: cfg.pre_norms.then(|| norm(&ones)).transpose()?,
                gate_up: DeviceLinear {
                    w: matrix(&gate_up_parts, h)?,
                    b: zeros(cfg.mlp_bias, cfg.gate_up_rows())?,
                },
                down: DeviceLinear {
                    w: matrix(&[(h, "down")], cfg.intermediate)?,
                    b: zeros(cfg.mlp_bias, h)?,
                },
                post_ffn_norm: cfg.post_norms.then(|| norm(&ones)).transpose()?,
                inv_freq: spec
                    .rope
                    .as_ref()
                    .map(|r| gpu.upload(&r.inv_freq(1)))
                    .transpose()?,
            });
        }
        let embed = mat(cfg.vocab, h)?;
        let lm_head = match exl3 {
            // exllamav3's default: the head at 6 bits of the model's codebook.
            Some(spec) => {
                let shape = Exl3Shape {
                    k: h.next_multiple_of(128),
                    n: cfg.vocab.next_multiple_of(128),
                    rate: Bitrate::int(SYNTHETIC_HEAD_BITS),
                    codebook: spec.codebook,
                };
                let head = Exl3Linear::synthetic(gpu, shape, bump())?.used(cfg.vocab, h);
                Some(DeviceMatrix::Exl3(vec![head]))
            }
            None if cfg.tied_embeddings => None,
            None => Some(DeviceMatrix::Bf16(mat(cfg.vocab, h)?)),
        };
        let final_norm = norm(&ones)?;
        gpu.sync()?;
        Ok(DenseWeights {
            embed,
            layers,
            final_norm,
            lm_head,
        })
    }
}

/// Bits of a synthetic EXL3 model's output head (exllamav3 converts heads at 6 by default).
pub const SYNTHETIC_HEAD_BITS: u32 = 6;

/// Decode attention blocks to aim for when the splits share the actual context (H200 runs 6-7:
/// 256 blocks, one 32-key tile each at ctx 512-640, beat 128 and 512).
const DECODE_BLOCKS: usize = 256;
/// The same for a batch of tokens: one split each (256 blocks of 20 serial tiles at B = 32) cost
/// 2.2 ms a step at B = 64, 8B shape (H200, run 18); a few waves of short splits hide latency.
const BATCH_DECODE_BLOCKS: usize = 1024;
/// Warps of an `attn_decode` block (`DEC_WARPS` in attention.cu), each a split.
const DEC_WARPS: usize = 2;
/// Keys per `attn_decode` tile (`DEC_KT`).
const DEC_KEYS: usize = 16;
/// Query rows of one kv head's group an `attn_decode` warp takes (one 16-row mma tile).
const DEC_ROWS: usize = 16;
/// Warps `attn_decode` aims for in all, its splits sharing each token's keys. H200 session 13,
/// 8B shape, bf16, S_TG at B = 32: 1024 / 2048 / 4096 gave 4,161 / 4,272-4,345 / 3,863 tok/s.
const DECODE_WARPS: usize = 2048;
/// Keys per decode attention tile (`KT` in attention.cu): a split holds whole tiles.
const ATT_KEYS: usize = 32;
/// Rotary pairs per block of the qkv GEMV with rope (`QKV_PAIRS` in gemv.cu).
const QKV_PAIRS: usize = 2;
/// Rows per block of the residual GEMV (`RES_ROWS` in gemv.cu).
const RES_ROWS: usize = 4;
/// Integer buckets of one deferred-norm sum of squares (`SS_BUCKETS` in gemv.cu).
const SS_BUCKETS: usize = 16;
/// Query rows per attention block (`ATT_ROWS` in attention.cu).
const ATT_ROWS: usize = 4;
const ARGMAX_BLOCKS: usize = 128;
/// Positions per block of a paged KV cache (the engine's `BLOCK_SIZE`; a power of two:
/// `attn_prefill` takes a position's block by a shift).
pub const KV_BLOCK: usize = 16;
const _: () = assert!(KV_BLOCK.is_power_of_two());
/// Most sequences one pass of a batch step takes (the step is split into passes beyond).
pub const MAX_SEQS: usize = 64;

/// The decoder's sizes and thresholds; the defaults are the measured best on the H200
/// (scripts/gpu/NOTES.md). What measured worse was deleted rather than kept behind a switch: PDL
/// on the bf16 GEMVs (+0.1 ms a token in every configuration, runs 5-12; the small kernels and
/// the EXL3 layers do use it, `KernelSource::dependent_launch`), last-block residual + norm (+1.1 ms,
/// run 5), last-block attention combine (+0.28 ms), bf16 gate/up in prefill, fixed-size decode
/// splits over the whole cache, CUDA-core prefill attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Blocks per thread-block cluster of decode attention (2..=8, sm_90+): the splits of a kv
    /// head merge through distributed shared memory instead of a combine kernel (run 9: 8 beat 4
    /// and matched 16, which needs the non-portable size).
    pub cluster: usize,
    /// The longest context decode runs the cluster attention for; longer contexts replay a graph
    /// with the split count sized to the chip and the combine kernel.
    pub cluster_ctx: usize,
    /// Elements of the GEMM prefill attention's score buffer (f32; bounds the query rows a
    /// chunk), for head dims the flash kernel does not take.
    pub attn_score_budget: usize,
    /// One-row steps of MUL1 EXL3 layers on the fast path (int8 activations, dp4a), as
    /// exllamav3's default (on by default; false: the exact path, `--exl3-exact`).
    pub exl3_int8: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            cluster: 8,
            cluster_ctx: 1024,
            attn_score_budget: 1 << 25,
            exl3_int8: true,
        }
    }
}

struct Funcs {
    embed: CudaFunction,
    norm: CudaFunction,
    residual_norm: CudaFunction,
    act_rows: CudaFunction,
    argmax_partial: CudaFunction,
    argmax_final: CudaFunction,
    rope: CudaFunction,
    attn_partial: CudaFunction,
    attn_combine: CudaFunction,
    attn_prefill: Option<FlashPrefill>,
    /// Decode attention of a batch on tensor cores (`attn_decode`; head dims as `FA_OK`).
    attn_decode: Option<CudaFunction>,
    attn_softmax: CudaFunction,
    attn_unstack: CudaFunction,
    kv_gather: CudaFunction,
    gather_rows: CudaFunction,
    gemv_f32: CudaFunction,
    gemv_qkv_rope: CudaFunction,
    gemv_res: CudaFunction,
    gemv_glu: CudaFunction,
    gemv_act: CudaFunction,
    few_rows: FewRows,
}

/// Per-call scratch and the KV cache.
struct Buffers {
    x: CudaSlice<f32>,
    xn: CudaSlice<u16>,
    qkv: CudaSlice<f32>,
    q: CudaSlice<f32>,
    attn: CudaSlice<u16>,
    y: CudaSlice<f32>,
    gu: CudaSlice<f32>,
    act: CudaSlice<u16>,
    logits: CudaSlice<f32>,
    part_acc: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    argmax: CudaSlice<u64>,
    tokens: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    /// Decode's input token and position (device-resident, advanced by the graph).
    tok: CudaSlice<i32>,
    dpos: CudaSlice<i32>,
    history: CudaSlice<i32>,
    count: CudaSlice<i32>,
    k_cache: Vec<CudaSlice<u16>>,
    v_cache: Vec<CudaSlice<u16>>,
    /// Prefill attention on tensor cores: q (bf16) and the output stacked per kv head
    /// (`[kv head][t * group + j][head_dim]`), scores (f32) and probabilities (bf16) of one chunk
    /// of query rows.
    q_stacked: CudaSlice<u16>,
    o_stacked: CudaSlice<u16>,
    scores: CudaSlice<f32>,
    probs: CudaSlice<u16>,
    /// Decode's deferred-norm sums of squares, `SS_BUCKETS` integer buckets a slot: layer l's o
    /// GEMV fills slot 2l, its down GEMV slot 2l + 1 (see gemv_res and ss_add in gemv.cu).
    ss: CudaSlice<u64>,
    /// A batch step's block tables (every sequence's, one after the other), each token's offset
    /// into them, the tokens decode attention takes (one-token sequences), the rows whose logits
    /// are wanted and those rows of xn gathered; one sequence's keys and values gathered
    /// contiguous for the prefill GEMMs.
    tables: CudaSlice<i32>,
    table_off: CudaSlice<i32>,
    tok_idx: CudaSlice<i32>,
    rows: CudaSlice<i32>,
    sel: CudaSlice<u16>,
    k_gather: CudaSlice<u16>,
    v_gather: CudaSlice<u16>,
}

/// A model on the GPU with its KV cache (one sequence).
pub struct DenseModel {
    pub gpu: Arc<Gpu>,
    pub cfg: ModelConfig,
    pub plan: Plan,
    /// The plan's layers as the decoder runs them.
    ops: Vec<LayerOps>,
    pub w: DenseWeights,
    /// KV cache capacity in positions.
    pub max_context: usize,
    /// Most tokens one prefill call takes.
    pub max_prefill: usize,
    f: Funcs,
    b: Buffers,
    len: usize,
    /// Each layer's inverse-frequency table on the device (dynamic RoPE changes them).
    rope_tables: Vec<Option<Vec<f32>>>,
    /// The decode graphs, captured on first use: [split attention + combine, cluster attention].
    graphs: [Option<CudaGraph>; 2],
    /// Graphs of decode passes over a paged cache (one token for each of `m` sequences), by
    /// (the cache's id, cluster attention, m): inputs are read from the step buffers, written
    /// before each replay; no launch depends on anything else a step changes.
    paged_graphs: Vec<((u64, bool, usize), CudaGraph)>,
    /// Where a batch step's logits are downloaded to and lent from.
    host: HostBuffers,
    /// Query tokens per chunk of the GEMM attention (bounds the score buffer).
    attn_rows: usize,
    opts: Options,
    /// The EXL3 layers' scratch (None without EXL3 weights).
    exl3: Option<Exl3Scratch>,
    /// This rank's communicator under tensor parallelism: the output and down projections'
    /// partial sums are all-reduced before their residual epilogue.
    comm: Option<Arc<crate::nccl::Comm>>,
}

/// Where a forward pass takes its inputs.
#[derive(Clone, Copy)]
struct Inputs {
    m: usize,
    tokens: u64,
    pos: u64,
    /// Decode: GEMV, many attention splits, and the argmax advances the position.
    decode: bool,
    /// Decode attention as one cluster launch (see `Options::cluster`).
    cluster: bool,
    /// Keys in the cache once these rows are written (positions are `kv_len - m..kv_len`).
    kv_len: usize,
}

/// A sequence's tokens `off..off + len` of a pass, at positions `start..`, whose attention runs
/// through the prefill GEMMs; `table`: its block table on the device (0: the contiguous cache).
#[derive(Clone, Copy, Debug)]
struct Seg {
    off: usize,
    len: usize,
    start: usize,
    table: u64,
}

/// Prefill attention in one kernel (`attn_prefill` in attention.cu: flash style, the scores in
/// registers), for head dims that are a multiple of 16 up to 128 (`FA_OK`; the others run as
/// GEMMs). Against the GEMM path on the H200, Llama-3.1-8B shape, 2048 tokens: 8.0 ms of
/// attention against 14.6 (BENCHMARKS.md).
pub struct FlashPrefill {
    f: CudaFunction,
    head_dim: usize,
}

/// One segment's prefill attention: `rows` stacked query rows (`t * group + j`) from row `row0`
/// of `q` (bf16, `[kv head][q_rows][head_dim]`, scaled), the sequence's `n_keys` keys and values
/// in the cache (`[slot][n_kv][head_dim]` bf16, slots through the block table `table` of
/// `KV_BLOCK`-position blocks, or positions without one), each token's position (`pos`, i32),
/// and the `[t][head][head_dim]` bf16 output.
pub struct FlashSegment {
    pub q: u64,
    pub q_rows: usize,
    pub row0: usize,
    pub rows: usize,
    pub k: u64,
    pub v: u64,
    pub table: u64,
    pub n_kv: usize,
    pub n_keys: usize,
    pub pos: u64,
    pub group: usize,
    pub window: Option<usize>,
    pub softcap: Option<f32>,
    pub out: u64,
}

impl FlashPrefill {
    /// Stacked query rows a block takes (`FA_ROWS`).
    const ROWS: usize = 64;

    /// The kernel for `head_dim`, or None where it does not run (`FA_OK`).
    pub fn load(gpu: &Gpu, head_dim: usize) -> Result<Option<FlashPrefill>> {
        if !(head_dim.is_multiple_of(16) && head_dim <= 128) {
            return Ok(None);
        }
        let f = gpu.function(
            &kernels::ATTENTION,
            &[format!("HEAD_DIM={head_dim}")],
            "attn_prefill",
        )?;
        f.set_attribute(
            dsys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            Self::shared_bytes(head_dim) as i32,
        )?;
        Ok(Some(FlashPrefill { f, head_dim }))
    }

    /// Dynamic shared memory: two stages of 64 keys' K and V rows, each padded by 8 halves
    /// (`FA_STAGE`).
    fn shared_bytes(head_dim: usize) -> usize {
        2 * 2 * 64 * (head_dim + 8) * 2
    }

    pub fn launch(&self, gpu: &Gpu, s: &FlashSegment) -> Result<()> {
        gpu.launch_shared(
            &self.f,
            (s.rows.div_ceil(Self::ROWS) as u32, s.n_kv as u32, 1),
            128,
            Self::shared_bytes(self.head_dim) as u32,
            &[
                Arg::Ptr(s.q),
                Arg::I32(s.q_rows as i32),
                Arg::I32(s.row0 as i32),
                Arg::I32(s.rows as i32),
                Arg::Ptr(s.k),
                Arg::Ptr(s.v),
                Arg::Ptr(s.table),
                Arg::I32(KV_BLOCK as i32),
                Arg::I32(s.n_kv as i32),
                Arg::I32(s.n_keys as i32),
                Arg::Ptr(s.pos),
                Arg::I32(s.group as i32),
                Arg::I32(s.window.unwrap_or(0) as i32),
                Arg::F32(s.softcap.unwrap_or(0.0)),
                Arg::Ptr(s.out),
            ],
        )
    }
}

/// A pass of a batch step over a paged cache.
struct Paged<'a> {
    kv: &'a PagedKv,
    tables: u64,
    table_off: u64,
    /// The tokens whose attention runs in decode attention (those of one-token sequences).
    tok_idx: u64,
    singles: usize,
    segs: Vec<Seg>,
    /// Rows of the pass whose logits are wanted (listed in `Buffers::rows`).
    rows: usize,
}

/// A KV cache of `blocks` blocks of `KV_BLOCK` positions on the device, per layer keys and
/// values `[slot][kv_head][head_dim]` (bf16), slot = block * KV_BLOCK + position in the block.
pub struct PagedKv {
    k: Vec<CudaSlice<u16>>,
    v: Vec<CudaSlice<u16>>,
    pub blocks: usize,
    /// Unique for the process's life (graphs captured over this cache are keyed by it).
    id: u64,
}

static NEXT_KV_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl DenseModel {
    /// The decoder with the default [`Options`].
    pub fn new(
        gpu: Arc<Gpu>,
        cfg: &ModelConfig,
        plan: &Plan,
        w: DenseWeights,
        max_context: usize,
        max_prefill: usize,
    ) -> Result<DenseModel> {
        Self::with_options(
            gpu,
            cfg,
            plan,
            w,
            max_context,
            max_prefill,
            Options::default(),
        )
    }

    pub fn with_options(
        gpu: Arc<Gpu>,
        cfg: &ModelConfig,
        plan: &Plan,
        w: DenseWeights,
        max_context: usize,
        max_prefill: usize,
        opts: Options,
    ) -> Result<DenseModel> {
        validate(cfg)?;
        ensure!(
            plan.layers.len() == cfg.n_layers() && w.layers.len() == cfg.n_layers(),
            "the plan, the weights and the config disagree on the layer count"
        );
        let ops = (plan.layers.iter().zip(&w.layers).enumerate())
            .map(|(l, (lp, lw))| LayerOps::of(l, lp, lw))
            .collect::<Result<Vec<_>>>()?;
        ensure!(max_context > 0 && max_prefill > 0, "empty context");
        ensure!(
            (2..=8).contains(&opts.cluster),
            "cluster size {} (2..=8)",
            opts.cluster
        );
        let e = |n| gpu.function(&kernels::ELEMENTWISE, &[], n);
        let g = |n| gpu.function(&kernels::GEMV, &[], n);
        let hd = [format!("HEAD_DIM={}", cfg.head_dim)];
        let f = Funcs {
            embed: e("embed_rows")?,
            norm: e("norm_rows")?,
            residual_norm: e("residual_norm")?,
            act_rows: e("act_rows")?,
            argmax_partial: e("logits_argmax_partial")?,
            argmax_final: e("argmax_final")?,
            rope: gpu.function(&kernels::ROPE, &[], "qkv_rope")?,
            attn_partial: gpu.function(&kernels::ATTENTION, &hd, "attn_partial")?,
            attn_combine: gpu.function(&kernels::ATTENTION, &hd, "attn_combine")?,
            attn_prefill: FlashPrefill::load(&gpu, cfg.head_dim)?,
            attn_decode: if cfg.head_dim.is_multiple_of(16) && cfg.head_dim <= 128 {
                Some(gpu.function(&kernels::ATTENTION, &hd, "attn_decode")?)
            } else {
                None
            },
            attn_softmax: gpu.function(&kernels::ATTENTION, &hd, "attn_softmax")?,
            attn_unstack: gpu.function(&kernels::ATTENTION, &hd, "attn_unstack")?,
            kv_gather: gpu.function(&kernels::ATTENTION, &hd, "kv_gather")?,
            gather_rows: e("gather_rows")?,
            gemv_f32: g("gemv_f32")?,
            gemv_qkv_rope: g("gemv_qkv_rope")?,
            gemv_res: g("gemv_res")?,
            gemv_glu: g("gemv_glu")?,
            gemv_act: g("gemv_act")?,
            few_rows: FewRows::load(&gpu)?,
        };
        let t = max_prefill;
        let h = cfg.hidden;
        // Attention partials: up to MAX_SEQS tokens' heads, each with up to the decode split count.
        let splits = decode_splits(cfg, max_context, 1).max(opts.cluster);
        let part_rows = MAX_SEQS * cfg.n_heads * splits;
        let kv = max_context * cfg.kv_dim();
        let attn_rows = (opts.attn_score_budget / (cfg.n_heads * max_context)).clamp(1, t);
        // The GEMM path's scores, stacked outputs and gathered keys (none for flash prefill).
        let gemm = f.attn_prefill.is_none();
        let score_elems = if gemm {
            cfg.n_heads * attn_rows * (max_context + 8)
        } else {
            1
        };
        let gathered = if gemm { kv } else { 1 };
        let b = Buffers {
            x: gpu.alloc(t * h)?,
            xn: gpu.alloc(t * h)?,
            qkv: gpu.alloc(t * cfg.qkv_dim())?,
            q: gpu.alloc(t * cfg.q_dim())?,
            attn: gpu.alloc(t * cfg.q_dim())?,
            y: gpu.alloc(t * h)?,
            gu: gpu.alloc(t * cfg.gate_up_rows())?,
            act: gpu.alloc(t * cfg.intermediate)?,
            logits: gpu.alloc(MAX_SEQS * cfg.vocab)?,
            part_acc: gpu.alloc(part_rows * cfg.head_dim)?,
            part_ml: gpu.alloc(part_rows * 2)?,
            argmax: gpu.alloc(ARGMAX_BLOCKS)?,
            tokens: gpu.alloc(t)?,
            pos: gpu.alloc(t)?,
            tok: gpu.alloc(1)?,
            dpos: gpu.alloc(1)?,
            history: gpu.alloc(max_context)?,
            count: gpu.alloc(1)?,
            k_cache: (0..cfg.n_layers())
                .map(|_| gpu.alloc(kv))
                .collect::<Result<_>>()?,
            v_cache: (0..cfg.n_layers())
                .map(|_| gpu.alloc(kv))
                .collect::<Result<_>>()?,
            q_stacked: gpu.alloc(t * cfg.q_dim())?,
            o_stacked: gpu.alloc(if gemm { t * cfg.q_dim() } else { 1 })?,
            scores: gpu.alloc(score_elems)?,
            probs: gpu.alloc(score_elems)?,
            ss: gpu.alloc(2 * cfg.n_layers() * SS_BUCKETS)?,
            tables: gpu.alloc(MAX_SEQS * max_context.div_ceil(KV_BLOCK) + t)?,
            table_off: gpu.alloc(t)?,
            tok_idx: gpu.alloc(t.min(MAX_SEQS))?,
            rows: gpu.alloc(MAX_SEQS)?,
            sel: gpu.alloc(MAX_SEQS * h)?,
            k_gather: gpu.alloc(gathered)?,
            v_gather: gpu.alloc(gathered)?,
        };
        let rope_tables = ops
            .iter()
            .map(|o| o.qkv.rope.as_ref().map(|r| r.inv_freq(1)))
            .collect();
        // The head runs on at most a pass's wanted rows, the rest on up to a prefill chunk.
        let exl3_groups: Vec<(&[Exl3Linear], usize)> = w
            .exl3_groups()
            .map(|(parts, head)| (parts, if head { MAX_SEQS.min(t) } else { t }))
            .collect();
        let exl3 = if exl3_groups.is_empty() {
            None
        } else {
            let mut s = Exl3Scratch::for_groups(&gpu, &exl3_groups)?;
            s.int8 = opts.exl3_int8;
            Some(s)
        };
        let host = HostBuffers::new(gpu.ctx.clone());
        Ok(DenseModel {
            gpu,
            cfg: cfg.clone(),
            plan: plan.clone(),
            ops,
            w,
            max_context,
            max_prefill,
            f,
            b,
            len: 0,
            rope_tables,
            graphs: [None, None],
            paged_graphs: Vec::new(),
            host,
            attn_rows,
            opts,
            exl3,
            comm: None,
        })
    }

    /// Makes this model one rank of a tensor-parallel group (its weights and config that rank's
    /// [`trellm_model::Shard`]): each step then sums the row-parallel projections over the
    /// ranks through `comm`, inside the captured graphs too (recaptured from now on).
    pub fn set_comm(&mut self, comm: Arc<crate::nccl::Comm>) {
        self.comm = Some(comm);
        self.graphs = [None, None];
        self.paged_graphs.clear();
    }

    /// Positions in the cache.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Empties the cache (the decode graph stays valid: it reads positions from the device).
    pub fn reset(&mut self) -> Result<()> {
        self.len = 0;
        let g = &self.gpu;
        g.stream.memcpy_htod(&[0i32], &mut self.b.count)?;
        Ok(())
    }

    /// Runs `tokens` at positions `len..`, appending to the cache; leaves the last position's
    /// logits on the device and its argmax as the next decode input.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        ensure!(!tokens.is_empty(), "prefill of no tokens");
        let mut done = 0;
        while done < tokens.len() {
            let n = (tokens.len() - done).min(self.max_prefill);
            ensure!(
                self.len + n <= self.max_context,
                "context full ({} positions)",
                self.max_context
            );
            let ids: Vec<i32> = tokens[done..done + n].iter().map(|&t| t as i32).collect();
            let pos: Vec<i32> = (self.len..self.len + n).map(|p| p as i32).collect();
            self.refresh_rope(self.len + n)?;
            let g = self.gpu.clone();
            g.stream.memcpy_htod(&ids, &mut self.b.tokens)?;
            g.stream.memcpy_htod(&pos, &mut self.b.pos)?;
            let inp = Inputs {
                m: n,
                tokens: g.ptr(&self.b.tokens),
                pos: g.ptr(&self.b.pos),
                decode: false,
                cluster: false,
                kv_len: self.len + n,
            };
            self.enqueue(inp, None)?;
            self.len += n;
            done += n;
        }
        let g = self.gpu.clone();
        g.stream.memcpy_htod(&[self.len as i32], &mut self.b.dpos)?;
        Ok(())
    }

    /// Sets the next decode step's input token (otherwise it is the previous step's argmax).
    pub fn set_next_token(&mut self, id: u32) -> Result<()> {
        let g = self.gpu.clone();
        g.stream.memcpy_htod(&[id as i32], &mut self.b.tok)?;
        Ok(())
    }

    /// One decode step: the graph (captured on first use) embeds the pending token at position
    /// `len`, computes the logits and leaves their argmax as the next token.
    pub fn decode_step(&mut self) -> Result<()> {
        let cluster = self.begin_decode_step()?;
        let slot = cluster as usize;
        if self.graphs[slot].is_none() {
            self.graphs[slot] = Some(self.capture(cluster)?);
        }
        self.graphs[slot].as_ref().unwrap().launch()?;
        self.len += 1;
        Ok(())
    }

    /// One decode step outside the graph with every kernel timed (for `bench`): the step's
    /// kernels are queued behind a spin so the device never waits on the host.
    pub fn profile_decode_step(&mut self) -> Result<Vec<crate::KernelTime>> {
        let cluster = self.begin_decode_step()?;
        let g = self.gpu.clone();
        let inp = self.decode_inputs(cluster);
        g.spin(20.0)?;
        g.start_profile();
        let r = self.enqueue(inp, None);
        let prof = g.finish_profile();
        r?;
        self.len += 1;
        prof
    }

    /// [`DenseModel::prefill`] with every kernel and cuBLAS call timed.
    pub fn profile_prefill(&mut self, tokens: &[u32]) -> Result<Vec<crate::KernelTime>> {
        let g = self.gpu.clone();
        g.spin(20.0)?;
        g.start_profile();
        let r = self.prefill(tokens);
        let prof = g.finish_profile();
        r?;
        prof
    }

    /// Enqueues `steps` decode steps back to back (no host synchronisation).
    pub fn decode(&mut self, steps: usize) -> Result<()> {
        for _ in 0..steps {
            self.decode_step()?;
        }
        Ok(())
    }

    /// Checks there is room for one more position and readies the step's RoPE tables; returns
    /// whether the step runs the cluster attention.
    fn begin_decode_step(&mut self) -> Result<bool> {
        ensure!(
            self.len < self.max_context,
            "context full ({} positions)",
            self.max_context
        );
        self.refresh_rope(self.len + 1)?;
        Ok(self.cluster_attention(self.len + 1))
    }

    /// Dynamic RoPE: uploads the layers' inverse frequencies for a pass whose last position is
    /// `seq_len - 1` where they change (stream-ordered, so a graph replayed next reads them).
    fn refresh_rope(&mut self, seq_len: usize) -> Result<()> {
        for (l, ops) in self.ops.iter().enumerate() {
            let Some(rope) = ops.qkv.rope.as_ref().filter(|r| r.is_dynamic()) else {
                continue;
            };
            let table = rope.inv_freq(seq_len);
            if self.rope_tables[l].as_ref() != Some(&table) {
                let dev = self.w.layers[l]
                    .inv_freq
                    .as_mut()
                    .context("a rotary layer without frequencies")?;
                self.gpu.stream.memcpy_htod(&table, dev)?;
                self.rope_tables[l] = Some(table);
            }
        }
        Ok(())
    }

    /// Whether a decode step over `ctx` positions runs the cluster attention.
    fn cluster_attention(&self, ctx: usize) -> bool {
        ctx <= self.opts.cluster_ctx && self.gpu.sm90_or_newer()
    }

    fn decode_inputs(&self, cluster: bool) -> Inputs {
        let g = &self.gpu;
        Inputs {
            m: 1,
            tokens: g.ptr(&self.b.tok),
            pos: g.ptr(&self.b.dpos),
            decode: true,
            cluster,
            kv_len: 0,
        }
    }

    fn capture(&mut self, cluster: bool) -> Result<CudaGraph> {
        let g = self.gpu.clone();
        let inp = self.decode_inputs(cluster);
        g.sync()?;
        g.stream
            .begin_capture(dsys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let r = self.enqueue(inp, None);
        let graph = g
            .stream
            .end_capture(dsys::CUgraphInstantiate_flags(0))
            .context("capturing the decode graph");
        r?;
        let graph = graph?.ok_or_else(|| anyhow!("empty decode graph"))?;
        graph.upload()?;
        Ok(graph)
    }

    /// A graph of only the decode step's linear layers: every layer's projections (bf16: our
    /// GEMVs, gate/up with its activation fused; EXL3: the trellis layers with their Hadamards)
    /// and, with `head`, the output head, on whatever the activation buffers hold. Its replay
    /// time is what the matrix work of one token costs alone.
    pub fn capture_gemv_only(&self, head: bool) -> Result<CudaGraph> {
        let (g, c, b) = (&*self.gpu, &self.cfg, &self.b);
        let h = c.hidden;
        g.sync()?;
        g.stream
            .begin_capture(dsys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let r = (|| -> Result<()> {
            let (xn, y, act) = (g.ptr(&b.xn), g.ptr(&b.y), g.ptr(&b.act));
            for lw in &self.w.layers {
                self.linear(1, xn, lw.qkv.w.view(g), c.qkv_dim(), h, g.ptr(&b.qkv))?;
                self.linear(1, g.ptr(&b.attn), lw.o.w.view(g), h, c.q_dim(), y)?;
                let ff = c.intermediate;
                if let Some(w) = lw.gate_up.w.bf16(g) {
                    let (func, blocks) = if c.gated() {
                        (&self.f.gemv_glu, ff)
                    } else {
                        (&self.f.gemv_act, ff.div_ceil(2))
                    };
                    g.launch(
                        func,
                        (blocks as u32, 1, 1),
                        128,
                        &[
                            Arg::Ptr(w),
                            Arg::I32(ff as i32),
                            Arg::I32(h as i32),
                            Arg::Ptr(xn),
                            Arg::Ptr(0),
                            Arg::I32(act_code(c.activation)),
                            Arg::Ptr(act),
                            Arg::Ptr(0),
                            Arg::F32(0.0),
                            Arg::F32(0.0),
                            Arg::Ptr(0),
                        ],
                    )?;
                } else {
                    let gu = g.ptr(&b.gu);
                    self.linear(1, xn, lw.gate_up.w.view(g), c.gate_up_rows(), h, gu)?;
                }
                self.linear(1, act, lw.down.w.view(g), h, ff, y)?;
            }
            if head {
                self.linear(1, xn, self.head(), c.vocab, h, g.ptr(&b.logits))?;
            }
            Ok(())
        })();
        let graph = g.stream.end_capture(dsys::CUgraphInstantiate_flags(0));
        r?;
        let graph = graph?.ok_or_else(|| anyhow!("empty graph"))?;
        graph.upload()?;
        Ok(graph)
    }

    /// The last computed logits (synchronises).
    pub fn logits(&self) -> Result<Vec<f32>> {
        Ok(self
            .gpu
            .stream
            .clone_dtoh(&self.b.logits.slice(0..self.cfg.vocab))?)
    }

    /// A paged KV cache of `blocks` blocks of `KV_BLOCK` positions for
    /// [`step_batch`](Self::step_batch).
    pub fn paged_kv(&self, blocks: usize) -> Result<PagedKv> {
        let n = (blocks * KV_BLOCK * self.cfg.kv_dim()).max(1);
        let layers = || -> Result<Vec<CudaSlice<u16>>> {
            (0..self.cfg.n_layers())
                .map(|_| self.gpu.alloc::<u16>(n))
                .collect()
        };
        Ok(PagedKv {
            k: layers()?,
            v: layers()?,
            blocks,
            id: NEXT_KV_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// Copies whole blocks `(src, dst)` of every layer's keys and values (copy-on-write of a
    /// shared block before it is extended).
    pub fn copy_blocks(&self, kv: &mut PagedKv, copies: &[(u32, u32)]) -> Result<()> {
        let bytes = KV_BLOCK * self.cfg.kv_dim() * 2;
        for &(src, dst) in copies {
            ensure!(
                (src as usize) < kv.blocks && (dst as usize) < kv.blocks && src != dst,
                "copy of block {src} to {dst} in a cache of {} blocks",
                kv.blocks
            );
            for buf in kv.k.iter().chain(&kv.v) {
                let base = self.gpu.ptr(buf);
                // SAFETY: both ranges lie inside `buf` (checked above) and do not overlap; the
                // copy is ordered on the model's stream.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        base + (dst as usize * bytes) as u64,
                        base + (src as usize * bytes) as u64,
                        bytes,
                        self.gpu.stream.cu_stream(),
                    )
                }
                .context("copying a KV block")?;
            }
        }
        Ok(())
    }

    /// One step of an engine batch over the paged cache `kv`: every sequence's new tokens at
    /// its positions, keys and values written through its block table; returns the wanted
    /// logits, `vocab` a row, sequence by sequence. One-token sequences take the decode
    /// attention, longer runs the prefill GEMMs (their keys gathered from the blocks). A step of
    /// more than `max_prefill` tokens or `MAX_SEQS` sequences runs as several passes (a
    /// sequence may be split between them: its later tokens read the keys the earlier wrote).
    pub fn step_batch(&mut self, batch: &Batch, kv: &PagedKv) -> Result<HostRows> {
        // Dynamic RoPE's tables follow one sequence's length: one sequence a pass.
        let dynamic = self
            .ops
            .iter()
            .any(|o| o.qkv.rope.as_ref().is_some_and(|r| r.is_dynamic()));
        let mut out = self.host.take(batch.logit_rows() * self.cfg.vocab)?;
        let mut at = 0;
        let mut pass: Vec<(usize, usize, usize)> = Vec::new();
        let mut n_tok = 0;
        for (i, s) in batch.seqs.iter().enumerate() {
            // One position's logits are its last's.
            ensure!(
                s.want != Want::All || s.len == 1,
                "logits at every prompt position (--prompt-logprobs) are computed on the CPU only; drop --device cuda"
            );
            ensure!(
                s.offset + s.len <= batch.tokens.len(),
                "sequence {i}: tokens out of range"
            );
            ensure!(
                s.start + s.len <= self.max_context,
                "the context is full ({} positions on the GPU)",
                self.max_context
            );
            ensure!(
                s.blocks.len() * KV_BLOCK >= s.start + s.len
                    && s.blocks.iter().all(|&b| (b as usize) < kv.blocks),
                "sequence {i}: its blocks do not hold positions 0..{}",
                s.start + s.len
            );
            let mut from = 0;
            while from < s.len {
                if n_tok == self.max_prefill
                    || pass.len() == MAX_SEQS
                    || (dynamic && !pass.is_empty())
                {
                    self.run_pass(batch, &pass, kv, &mut out, &mut at)?;
                    pass.clear();
                    n_tok = 0;
                }
                let n = (s.len - from).min(self.max_prefill - n_tok);
                pass.push((i, from, n));
                n_tok += n;
                from += n;
            }
        }
        if !pass.is_empty() {
            self.run_pass(batch, &pass, kv, &mut out, &mut at)?;
        }
        ensure!(at == out.len(), "{at} logits for {} wanted", out.len());
        Ok(out)
    }

    /// [`step_batch`](Self::step_batch) with every kernel and cuBLAS call timed (queued behind
    /// a spin, as [`profile_decode_step`](Self::profile_decode_step)).
    pub fn profile_step_batch(
        &mut self,
        batch: &Batch,
        kv: &PagedKv,
    ) -> Result<Vec<crate::KernelTime>> {
        let g = self.gpu.clone();
        g.spin(20.0)?;
        g.start_profile();
        let r = self.step_batch(batch, kv);
        let prof = g.finish_profile();
        r?;
        prof
    }

    /// One pass of [`step_batch`](Self::step_batch): `pieces` are (sequence, first new token,
    /// tokens).
    fn run_pass(
        &mut self,
        batch: &Batch,
        pieces: &[(usize, usize, usize)],
        kv: &PagedKv,
        out: &mut HostRows,
        at: &mut usize,
    ) -> Result<()> {
        let g = self.gpu.clone();
        let table_base = g.ptr(&self.b.tables);
        let (mut tokens, mut pos, mut toff) = (Vec::new(), Vec::new(), Vec::new());
        let (mut tables, mut tok_idx, mut rows, mut segs) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut seq_len = 0;
        for &(i, from, n) in pieces {
            let s = &batch.seqs[i];
            let t0 = tokens.len();
            let first = s.offset + from;
            tokens.extend(batch.tokens[first..first + n].iter().map(|&t| t as i32));
            pos.extend((s.start + from..s.start + from + n).map(|p| p as i32));
            let off = tables.len();
            tables.extend(s.blocks.iter().map(|&b| b as i32));
            toff.extend(std::iter::repeat_n(off as i32, n));
            seq_len = seq_len.max(s.start + from + n);
            if n == 1 {
                tok_idx.push(t0 as i32);
            } else {
                segs.push(Seg {
                    off: t0,
                    len: n,
                    start: s.start + from,
                    table: table_base + 4 * off as u64,
                });
            }
            if from + n == s.len && s.want != Want::None {
                rows.push((t0 + n - 1) as i32);
            }
        }
        ensure!(
            tables.len() <= self.b.tables.len(),
            "block tables of {} entries (room for {})",
            tables.len(),
            self.b.tables.len()
        );
        ensure!(
            tokens.iter().all(|&t| (t as usize) < self.cfg.vocab),
            "a token id beyond the vocabulary ({})",
            self.cfg.vocab
        );
        self.refresh_rope(seq_len)?;
        let b = &mut self.b;
        g.stream.memcpy_htod(&tokens, &mut b.tokens)?;
        g.stream.memcpy_htod(&pos, &mut b.pos)?;
        g.stream.memcpy_htod(&toff, &mut b.table_off)?;
        g.stream.memcpy_htod(&tables, &mut b.tables)?;
        if !tok_idx.is_empty() {
            g.stream.memcpy_htod(&tok_idx, &mut b.tok_idx)?;
        }
        if !rows.is_empty() {
            g.stream.memcpy_htod(&rows, &mut b.rows)?;
        }
        let m = tokens.len();
        let inp = Inputs {
            m,
            tokens: g.ptr(&self.b.tokens),
            pos: g.ptr(&self.b.pos),
            decode: false,
            cluster: m == 1 && self.cluster_attention(pos[0] as usize + 1),
            kv_len: 0,
        };
        let pg = Paged {
            kv,
            tables: table_base,
            table_off: g.ptr(&self.b.table_off),
            tok_idx: g.ptr(&self.b.tok_idx),
            singles: tok_idx.len(),
            segs,
            rows: rows.len(),
        };
        if pg.segs.is_empty() && pg.rows == m && !g.profiling() {
            // Decode (one token for each sequence): replay a graph of the pass, captured on first
            // use for this many sequences (launching a batch's hundreds of kernels one by one
            // cost 0.6-1.2 ms a step at B = 32, 8B shape: H200 runs 23-25).
            let key = (kv.id, inp.cluster, m);
            let i = match self.paged_graphs.iter().position(|(k, _)| *k == key) {
                Some(i) => i,
                None => {
                    if self.paged_graphs.len() > MAX_SEQS {
                        self.paged_graphs.clear();
                    }
                    g.sync()?;
                    g.stream.begin_capture(
                        dsys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                    )?;
                    let r = self.enqueue(inp, Some(&pg));
                    let graph = g
                        .stream
                        .end_capture(dsys::CUgraphInstantiate_flags(0))
                        .context("capturing a batch pass");
                    r?;
                    let graph = graph?.ok_or_else(|| anyhow!("empty graph"))?;
                    graph.upload()?;
                    self.paged_graphs.push((key, graph));
                    self.paged_graphs.len() - 1
                }
            };
            self.paged_graphs[i].1.launch()?;
        } else {
            self.enqueue(inp, Some(&pg))?;
        }
        let n_out = rows.len() * self.cfg.vocab;
        if n_out > 0 {
            // Straight into the page-locked rows the step lends out (one DMA, no staging copy).
            let dst = &mut out.as_mut_slice()[*at..*at + n_out];
            g.ctx.bind_to_thread()?;
            // SAFETY: `dst` stays borrowed until the synchronize below; the source holds n_out.
            unsafe { dres::memcpy_dtoh_async(dst, g.ptr(&self.b.logits), g.stream.cu_stream()) }?;
            g.stream.synchronize()?;
            *at += n_out;
        }
        Ok(())
    }

    /// The pending next token (the last argmax; synchronises).
    pub fn next_token(&self) -> Result<u32> {
        Ok(self.gpu.stream.clone_dtoh(&self.b.tok)?[0] as u32)
    }

    /// Tokens the decode steps produced since the last [`reset`](Self::reset).
    pub fn history(&self) -> Result<Vec<u32>> {
        let n = self.gpu.stream.clone_dtoh(&self.b.count)?[0] as usize;
        let h = self.gpu.stream.clone_dtoh(&self.b.history)?;
        Ok(h[..n.min(h.len())].iter().map(|&v| v as u32).collect())
    }

    /// The output head: its own matrix, or the embedding when tied.
    fn head(&self) -> MatRef<'_> {
        match &self.w.lm_head {
            Some(m) => m.view(&self.gpu),
            None => MatRef::Bf16(self.gpu.ptr(&self.w.embed)),
        }
    }

    /// `y[m, n] (f32) = x[m, k] (bf16) . W[n, k]^T` for a matrix of either kind (an EXL3 stack's
    /// parts write their outputs side by side).
    fn linear(&self, m: usize, x: u64, w: MatRef, n: usize, k: usize, y: u64) -> Result<()> {
        match w {
            MatRef::Bf16(w) => self.matmul(m, x, w, n, k, y),
            MatRef::Exl3(parts) => {
                let s = self
                    .exl3
                    .as_ref()
                    .context("EXL3 layers without their scratch")?;
                let rows = Rows {
                    ptr: x,
                    bf16: true,
                    ld: k,
                };
                let off: usize = parts.iter().map(|p| p.rows).sum();
                ensure!(
                    off == n && parts.iter().all(|p| p.cols == k),
                    "EXL3 parts of {off} outputs for {n}x{k}"
                );
                Exl3Linear::forward_parts(&self.gpu, s, parts, m, rows, y, n)
            }
        }
    }

    /// A gated MLP's EXL3 gate and up with the activation fused into their launch (`act` =
    /// act(gate) * up, bf16); false where it does not apply (other weights, biases, a regime
    /// without the fusion), having run nothing.
    fn gated_exl3(
        &self,
        m: usize,
        xn: u64,
        lw: &LayerBuffers,
        ops: &LayerOps,
        act: u64,
    ) -> Result<bool> {
        let DeviceMatrix::Exl3(parts) = &lw.gate_up.w else {
            return Ok(false);
        };
        if !ops.glu.gated || lw.gate_up.b.is_some() {
            return Ok(false);
        }
        let s = self
            .exl3
            .as_ref()
            .context("EXL3 layers without their scratch")?;
        let h = self.cfg.hidden;
        let rows = Rows {
            ptr: xn,
            bf16: true,
            ld: h,
        };
        let code = act_code(ops.glu.activation);
        Exl3Linear::forward_gated(&self.gpu, s, parts, m, rows, code, act)
    }

    /// `y[m, n] (f32) = x[m, k] (bf16) . W[n, k]^T`: our GEMV for one row, our tensor-core
    /// decode GEMM up to [`FEW_ROWS`], cuBLAS above.
    fn matmul(&self, m: usize, x: u64, w: u64, n: usize, k: usize, y: u64) -> Result<()> {
        if m == 1 {
            return self.gemv(x, w, n, k, y, (0, 0));
        }
        if self.f.few_rows.fits(m, n, k) {
            return self.f.few_rows.run(&self.gpu, m, n, k, x, w, y);
        }
        gemm_bf16_f32(&self.gpu, m, n, k, x, w, y)
    }

    /// One row through our GEMV; `norm` = (sum of squares of a deferred RMSNorm, or 0; a sum to
    /// zero for the next gemv_res, or 0), see [`Self::norm_args`].
    fn gemv(&self, x: u64, w: u64, n: usize, k: usize, y: u64, norm: (u64, u64)) -> Result<()> {
        let g = &self.gpu;
        let mut args = vec![
            Arg::Ptr(w),
            Arg::I32(n as i32),
            Arg::I32(k as i32),
            Arg::Ptr(x),
            Arg::Ptr(y),
        ];
        args.extend(self.norm_args(norm));
        g.launch(&self.f.gemv_f32, (n.div_ceil(2) as u32, 1, 1), 128, &args)
    }

    /// The trailing (ss, 1/n, eps, zero) arguments of the GEMVs that can finish a deferred norm.
    fn norm_args(&self, (ss, zero): (u64, u64)) -> [Arg; 4] {
        [
            Arg::Ptr(ss),
            Arg::F32(1.0 / self.cfg.hidden as f32),
            Arg::F32(self.cfg.norm_eps),
            Arg::Ptr(zero),
        ]
    }

    /// Whether decode defers the norms into the GEMVs (gemv_res): RMSNorm, no projection bias
    /// or post-norm on the residual branches, and no all-reduce between a projection and its
    /// residual add.
    fn res_epi(&self) -> bool {
        let c = &self.cfg;
        let g = &self.gpu;
        self.comm.is_none()
            && c.norm == Norm::Rms
            && matches!(self.head(), MatRef::Bf16(_))
            && self.w.layers.iter().all(|l| {
                l.o.b.is_none()
                    && l.down.b.is_none()
                    && l.post_attn_norm.is_none()
                    && l.post_ffn_norm.is_none()
                    && l.o.w.bf16(g).is_some()
                    && l.down.w.bf16(g).is_some()
            })
    }

    fn enqueue(&self, inp: Inputs, pg: Option<&Paged>) -> Result<()> {
        let (g, c, f, b) = (&*self.gpu, &self.cfg, &self.f, &self.b);
        let m = inp.m;
        let (h, hd) = (c.hidden, c.head_dim);
        let (qd, qkvd) = (c.q_dim(), c.qkv_dim());
        let eps = c.norm_eps;
        let layer_norm = (c.norm == Norm::Layer) as i32;
        let nb = (h.next_power_of_two().clamp(32, 1024)) as u32;
        let p = |s: &CudaSlice<f32>| g.ptr(s);
        let po = |s: &Option<CudaSlice<f32>>| s.as_ref().map_or(0, |s| g.ptr(s));
        let pn = |n: &Option<DeviceNorm>| {
            (
                n.as_ref().map_or(0, |n| g.ptr(&n.w)),
                n.as_ref().map_or(0, |n| po(&n.b)),
            )
        };
        let (x, xn) = (p(&b.x), g.ptr(&b.xn));

        g.launch(
            &f.embed,
            (m as u32, 1, 1),
            256,
            &[
                Arg::Ptr(inp.tokens),
                Arg::Ptr(g.ptr(&self.w.embed)),
                Arg::I32(h as i32),
                Arg::F32(self.plan.embed_scale.unwrap_or(1.0)),
                Arg::Ptr(x),
            ],
        )?;
        // The first layer's input norm; later ones come out of the residual adds.
        let (w0, b0) = pn(&self.w.layers[0].attn_norm);
        g.launch(
            &f.norm,
            (m as u32, 1, 1),
            nb,
            &[
                Arg::Ptr(x),
                Arg::I32(h as i32),
                Arg::I32(h as i32),
                Arg::Ptr(w0),
                Arg::Ptr(b0),
                Arg::F32(eps),
                Arg::I32(layer_norm),
                Arg::Ptr(0),
                Arg::Ptr(xn),
                Arg::I32(h as i32),
            ],
        )?;
        let group = c.n_heads / c.n_kv_heads;
        let splits = if inp.cluster {
            self.opts.cluster
        } else if inp.decode || pg.is_some() {
            decode_splits(c, self.max_context, pg.map_or(1, |pp| pp.singles))
        } else {
            1
        };
        // Which tokens' attention runs where: one-token sequences in decode attention (a list of
        // them, or token 0 alone), longer runs of one sequence through the prefill GEMMs.
        let (singles, segs, tabs) = match pg {
            None if m == 1 => (Some((0u64, 1usize)), Vec::new(), (0, 0)),
            None => {
                let seg = Seg {
                    off: 0,
                    len: m,
                    start: inp.kv_len - m,
                    table: 0,
                };
                (None, vec![seg], (0, 0))
            }
            Some(pp) => (
                (pp.singles > 0).then_some((pp.tok_idx, pp.singles)),
                pp.segs.clone(),
                (pp.tables, pp.table_off),
            ),
        };
        let gemm_attn = !segs.is_empty();
        // Deferred norms (decode): the sum of squares the next GEMV scales by (0: xn is final).
        let epi = m == 1 && self.res_epi();
        let ss_slot = |i: usize| g.ptr(&b.ss) + (8 * SS_BUCKETS * i) as u64;
        let mut pending_ss = 0u64;
        for (l, (lw, ops)) in self.w.layers.iter().zip(&self.ops).enumerate() {
            let rope = ops.qkv.rope.as_ref();
            let attn = &ops.attn;
            let (kc, vc) = match pg {
                Some(pp) => (g.ptr(&pp.kv.k[l]), g.ptr(&pp.kv.v[l])),
                None => (g.ptr(&b.k_cache[l]), g.ptr(&b.v_cache[l])),
            };
            let qkv_norm = if epi {
                (pending_ss, ss_slot(2 * l))
            } else {
                (0, 0)
            };
            let qkv_bf16 = lw.qkv.w.bf16(g).filter(|_| m == 1);
            if let Some(qkv_w) = qkv_bf16.filter(|_| ops.qkv.qk_norm == QkNorm::None) {
                // One token: the qkv GEMV does the rope kernel's work in its epilogue.
                let na = self.norm_args(qkv_norm);
                g.launch(
                    &f.gemv_qkv_rope,
                    ((qkvd / 2).div_ceil(QKV_PAIRS) as u32, 1, 1),
                    128,
                    &[
                        Arg::Ptr(qkv_w),
                        Arg::I32(h as i32),
                        Arg::Ptr(xn),
                        Arg::Ptr(po(&lw.qkv.b)),
                        Arg::Ptr(inp.pos),
                        Arg::I32(c.n_heads as i32),
                        Arg::I32(c.n_kv_heads as i32),
                        Arg::I32(hd as i32),
                        Arg::Ptr(po(&lw.inv_freq)),
                        Arg::I32(rope.map_or(0, |r| r.dims as i32)),
                        Arg::I32(rope.is_some_and(|r| r.traditional) as i32),
                        Arg::F32(rope.map_or(1.0, |r| r.position_scale)),
                        Arg::F32(rope.and_then(|r| r.input_scale).unwrap_or(1.0)),
                        Arg::F32(attn.scale),
                        Arg::Ptr(p(&b.q)),
                        Arg::Ptr(kc),
                        Arg::Ptr(vc),
                        na[0],
                        na[1],
                        na[2],
                        na[3],
                        Arg::Ptr(tabs.0),
                        Arg::Ptr(tabs.1),
                        Arg::I32(KV_BLOCK as i32),
                    ],
                )?;
            } else {
                // A step of decode tokens alone: EXL3 q/k/v do the rope kernel's work in their
                // launch's epilogue where they can.
                let decode_only = !gemm_attn && singles.is_some_and(|(_, n)| n == m);
                if !(decode_only && self.qkv_rope_exl3(m, &inp, lw, ops, (kc, vc), tabs)?) {
                    let q_out = singles.is_some();
                    self.qkv_rope(
                        m,
                        &inp,
                        lw,
                        ops,
                        (kc, vc),
                        (gemm_attn, q_out),
                        qkv_norm,
                        tabs,
                    )?;
                }
            }
            if let Some((list, n)) = singles {
                // Batches merge their splits in the combine kernel: as clusters (batch-1's
                // merge) the attention took 1.93-1.96 ms a B = 32 step against 1.34 + 0.22 for
                // the combine (H200, run 20).
                let fused = inp.cluster;
                // Batches only: one token's attention stays attn_partial's (at a 2k context
                // it measured 226 tok/s against 220 through attn_decode, H200 session 13).
                let on_mma = f.attn_decode.as_ref().filter(|_| !fused && n > 1);
                let splits = match on_mma {
                    // A warp a split, about DECODE_WARPS warps in all, within the room the
                    // partial buffers leave for n tokens' heads.
                    Some(_) => {
                        let tiles = c.n_kv_heads * group.div_ceil(DEC_ROWS) * n;
                        let room = b.part_ml.len() / (2 * n * c.n_heads);
                        let per_tile = DECODE_WARPS
                            .div_ceil(DEC_WARPS * tiles)
                            .clamp(1, self.max_context.div_ceil(DEC_WARPS * DEC_KEYS))
                            .min((room / DEC_WARPS).max(1));
                        DEC_WARPS * per_tile
                    }
                    None => splits,
                };
                // Both kernels' arguments (attn_partial's cluster merge writes `attn` itself).
                let mut args = vec![
                    Arg::Ptr(p(&b.q)),
                    Arg::Ptr(kc),
                    Arg::Ptr(vc),
                    Arg::Ptr(inp.pos),
                    Arg::Ptr(list),
                    Arg::I32(c.n_heads as i32),
                    Arg::I32(c.n_kv_heads as i32),
                    Arg::I32(attn.window.unwrap_or(0) as i32),
                    Arg::F32(attn.softcap.unwrap_or(0.0)),
                    Arg::I32(splits as i32),
                    Arg::Ptr(p(&b.part_acc)),
                    Arg::Ptr(p(&b.part_ml)),
                ];
                if on_mma.is_none() {
                    args.push(Arg::Ptr(if fused { g.ptr(&b.attn) } else { 0 }));
                }
                args.extend([
                    Arg::Ptr(tabs.0),
                    Arg::Ptr(tabs.1),
                    Arg::I32(KV_BLOCK as i32),
                ]);
                match on_mma {
                    Some(dec) => g.launch(
                        dec,
                        (
                            c.n_kv_heads as u32,
                            (n * group.div_ceil(DEC_ROWS)) as u32,
                            (splits / DEC_WARPS) as u32,
                        ),
                        (32 * DEC_WARPS) as u32,
                        &args,
                    )?,
                    None => g.launch_cluster(
                        &f.attn_partial,
                        (
                            c.n_kv_heads as u32,
                            (n * group.div_ceil(ATT_ROWS)) as u32,
                            splits as u32,
                        ),
                        128,
                        fused.then_some((1, 1, splits as u32)),
                        &args,
                    )?,
                }
                if !fused {
                    g.launch(
                        &f.attn_combine,
                        ((n * c.n_heads) as u32, 1, 1),
                        hd.min(128).next_multiple_of(32) as u32,
                        &[
                            Arg::Ptr(p(&b.part_acc)),
                            Arg::Ptr(p(&b.part_ml)),
                            Arg::I32(splits as i32),
                            Arg::Ptr(list),
                            Arg::I32(c.n_heads as i32),
                            Arg::Ptr(g.ptr(&b.attn)),
                        ],
                    )?;
                }
            }
            for seg in &segs {
                if let Some(flash) = &f.attn_prefill {
                    flash.launch(
                        g,
                        &FlashSegment {
                            q: g.ptr(&b.q_stacked),
                            q_rows: m * group,
                            row0: seg.off * group,
                            rows: seg.len * group,
                            k: kc,
                            v: vc,
                            table: seg.table,
                            n_kv: c.n_kv_heads,
                            n_keys: seg.start + seg.len,
                            pos: inp.pos + 4 * seg.off as u64,
                            group,
                            window: attn.window,
                            softcap: attn.softcap,
                            out: g.ptr(&b.attn) + 2 * (seg.off * c.q_dim()) as u64,
                        },
                    )?;
                    continue;
                }
                let (kg, vg) = if seg.table != 0 {
                    // The sequence's keys and values, contiguous, for the GEMMs.
                    g.launch(
                        &f.kv_gather,
                        ((seg.start + seg.len) as u32, 1, 1),
                        128,
                        &[
                            Arg::Ptr(kc),
                            Arg::Ptr(vc),
                            Arg::Ptr(seg.table),
                            Arg::I32(KV_BLOCK as i32),
                            Arg::I32(c.kv_dim() as i32),
                            Arg::Ptr(g.ptr(&b.k_gather)),
                            Arg::Ptr(g.ptr(&b.v_gather)),
                        ],
                    )?;
                    (g.ptr(&b.k_gather), g.ptr(&b.v_gather))
                } else {
                    (kc, vc)
                };
                self.attention_gemm(m, &inp, attn, kg, vg, *seg)?;
            }
            let (pw, pb) = pn(&lw.post_attn_norm);
            let (nw, nbias) = pn(&lw.ffn_norm);
            let attn_out = g.ptr(&b.attn);
            let rscale = ops.out.scale.unwrap_or(1.0);
            if epi {
                let o = (attn_out, lw.o.w.bf16(g).context("a bf16 o")?, qd);
                pending_ss = self.gemv_res(o, rscale, nw, ss_slot(2 * l))?;
            } else {
                let o = (attn_out, lw.o.w.view(g), qd);
                self.proj_residual(m, o, po(&lw.o.b), (pw, pb), rscale, (nw, nbias))?;
            }
            let glu_norm = if epi {
                (pending_ss, ss_slot(2 * l + 1))
            } else {
                (0, 0)
            };

            let ff = c.intermediate;
            let act = g.ptr(&b.act);
            if let Some(gu_w) = lw.gate_up.w.bf16(g).filter(|_| m == 1) {
                let (func, blocks, n) = if ops.glu.gated {
                    (&f.gemv_glu, ff, ff)
                } else {
                    (&f.gemv_act, ff.div_ceil(2), ff)
                };
                let na = self.norm_args(glu_norm);
                g.launch(
                    func,
                    (blocks as u32, 1, 1),
                    128,
                    &[
                        Arg::Ptr(gu_w),
                        Arg::I32(n as i32),
                        Arg::I32(h as i32),
                        Arg::Ptr(xn),
                        Arg::Ptr(po(&lw.gate_up.b)),
                        Arg::I32(act_code(ops.glu.activation)),
                        Arg::Ptr(act),
                        na[0],
                        na[1],
                        na[2],
                        na[3],
                    ],
                )?;
            } else if !self.gated_exl3(m, xn, lw, ops, act)? {
                let gu = p(&b.gu);
                self.linear(m, xn, lw.gate_up.w.view(g), c.gate_up_rows(), h, gu)?;
                g.launch(
                    &f.act_rows,
                    (ff.div_ceil(4 * 256) as u32, m as u32, 1),
                    256,
                    &[
                        Arg::Ptr(gu),
                        Arg::Ptr(po(&lw.gate_up.b)),
                        Arg::I32(ff as i32),
                        Arg::I32(ops.glu.gated as i32),
                        Arg::I32(act_code(ops.glu.activation)),
                        Arg::Ptr(act),
                    ],
                )?;
            }
            let (pw, pb) = pn(&lw.post_ffn_norm);
            let next = match self.w.layers.get(l + 1) {
                Some(nl) => pn(&nl.attn_norm),
                None => (g.ptr(&self.w.final_norm.w), po(&self.w.final_norm.b)),
            };
            let rscale = ops.down.scale.unwrap_or(1.0);
            if epi {
                let down = (act, lw.down.w.bf16(g).context("a bf16 down")?, ff);
                pending_ss = self.gemv_res(down, rscale, next.0, ss_slot(2 * l + 1))?;
            } else {
                let down = (act, lw.down.w.view(g), ff);
                self.proj_residual(m, down, po(&lw.down.b), (pw, pb), rscale, next)?;
            }
        }

        let head = self.head();
        let logits = p(&b.logits);
        match pg {
            // The wanted rows of a batch pass, gathered, through one GEMM.
            Some(pp) if m > 1 => {
                if pp.rows == 0 {
                    return Ok(());
                }
                let sel = g.ptr(&b.sel);
                g.launch(
                    &f.gather_rows,
                    (pp.rows as u32, 1, 1),
                    256,
                    &[
                        Arg::Ptr(xn),
                        Arg::Ptr(g.ptr(&b.rows)),
                        Arg::I32(h as i32),
                        Arg::Ptr(sel),
                    ],
                )?;
                self.linear(pp.rows, sel, head, c.vocab, h, logits)?;
                // Soft-capping and the divisor, in place (the argmax is not used).
                return g.launch(
                    &f.argmax_partial,
                    (ARGMAX_BLOCKS as u32, 1, 1),
                    1024,
                    &[
                        Arg::Ptr(logits),
                        Arg::I32((pp.rows * c.vocab) as i32),
                        Arg::F32(self.plan.logits.softcap.unwrap_or(0.0)),
                        Arg::F32(self.plan.logits.divisor.unwrap_or(0.0)),
                        Arg::Ptr(g.ptr(&b.argmax)),
                    ],
                );
            }
            Some(pp) if pp.rows == 0 => return Ok(()),
            // Logits of the last row.
            _ => {
                let last = xn + 2 * ((m - 1) * h) as u64;
                match head {
                    MatRef::Bf16(w) => self.gemv(last, w, c.vocab, h, logits, (pending_ss, 0))?,
                    MatRef::Exl3(_) => self.linear(1, last, head, c.vocab, h, logits)?,
                }
            }
        }
        g.launch(
            &f.argmax_partial,
            (ARGMAX_BLOCKS as u32, 1, 1),
            1024,
            &[
                Arg::Ptr(logits),
                Arg::I32(c.vocab as i32),
                Arg::F32(self.plan.logits.softcap.unwrap_or(0.0)),
                Arg::F32(self.plan.logits.divisor.unwrap_or(0.0)),
                Arg::Ptr(g.ptr(&b.argmax)),
            ],
        )?;
        let (pos, hist, count) = if inp.decode {
            (g.ptr(&b.dpos), g.ptr(&b.history), g.ptr(&b.count))
        } else {
            (0, 0, 0)
        };
        g.launch(
            &f.argmax_final,
            (1, 1, 1),
            32,
            &[
                Arg::Ptr(g.ptr(&b.argmax)),
                Arg::I32(ARGMAX_BLOCKS as i32),
                Arg::Ptr(g.ptr(&b.tok)),
                Arg::Ptr(pos),
                Arg::Ptr(hist),
                Arg::Ptr(count),
            ],
        )?;
        Ok(())
    }

    /// The qkv projection, q/k norms, RoPE and the cache write (`kv`, through the block tables
    /// `tabs` if given) of `m` rows; q goes stacked as bf16 for the GEMM attention and/or to the
    /// f32 buffer (`(stacked, f32)`).
    #[allow(clippy::too_many_arguments)]
    fn qkv_rope(
        &self,
        m: usize,
        inp: &Inputs,
        lw: &LayerBuffers,
        ops: &LayerOps,
        (kc, vc): (u64, u64),
        (stacked, q_f32): (bool, bool),
        norm: (u64, u64),
        tabs: (u64, u64),
    ) -> Result<()> {
        let (g, c, f, b) = (&*self.gpu, &self.cfg, &self.f, &self.b);
        let (h, hd) = (c.hidden, c.head_dim);
        let (qd, kvd, qkvd) = (c.q_dim(), c.kv_dim(), c.qkv_dim());
        let eps = c.norm_eps;
        let nb = (h.next_power_of_two().clamp(32, 1024)) as u32;
        let po = |s: &Option<CudaSlice<f32>>| s.as_ref().map_or(0, |s| g.ptr(s));
        let qkv = g.ptr(&b.qkv);
        match lw.qkv.w.bf16(g) {
            Some(w) if m == 1 => self.gemv(g.ptr(&b.xn), w, qkvd, h, qkv, norm)?,
            _ => self.linear(m, g.ptr(&b.xn), lw.qkv.w.view(g), qkvd, h, qkv)?,
        }
        let qk_norm = ops.qkv.qk_norm;
        if qk_norm == QkNorm::Whole {
            for (off, len, w) in [(0, qd, &lw.q_norm), (qd, kvd, &lw.k_norm)] {
                g.launch(
                    &f.norm,
                    (m as u32, 1, 1),
                    nb,
                    &[
                        Arg::Ptr(qkv + 4 * off as u64),
                        Arg::I32(qkvd as i32),
                        Arg::I32(len as i32),
                        Arg::Ptr(po(w)),
                        Arg::Ptr(0),
                        Arg::F32(eps),
                        Arg::I32(0),
                        Arg::Ptr(qkv + 4 * off as u64),
                        Arg::Ptr(0),
                        Arg::I32(0),
                    ],
                )?;
            }
        }
        let per_head = qk_norm == QkNorm::PerHead;
        let rope = ops.qkv.rope.as_ref();
        let heads = c.n_heads + c.n_kv_heads;
        g.launch(
            &f.rope,
            (m as u32, heads.div_ceil(8) as u32, 1),
            256,
            &[
                Arg::Ptr(qkv),
                Arg::Ptr(po(&lw.qkv.b)),
                Arg::Ptr(inp.pos),
                Arg::I32(c.n_heads as i32),
                Arg::I32(c.n_kv_heads as i32),
                Arg::I32(hd as i32),
                Arg::Ptr(if per_head { po(&lw.q_norm) } else { 0 }),
                Arg::Ptr(if per_head { po(&lw.k_norm) } else { 0 }),
                Arg::F32(eps),
                Arg::Ptr(po(&lw.inv_freq)),
                Arg::I32(rope.map_or(0, |r| r.dims as i32)),
                Arg::I32(rope.is_some_and(|r| r.traditional) as i32),
                Arg::F32(rope.map_or(1.0, |r| r.position_scale)),
                Arg::F32(rope.and_then(|r| r.input_scale).unwrap_or(1.0)),
                Arg::F32(ops.attn.scale),
                Arg::Ptr(if q_f32 { g.ptr(&b.q) } else { 0 }),
                Arg::Ptr(kc),
                Arg::Ptr(vc),
                Arg::Ptr(if stacked { g.ptr(&b.q_stacked) } else { 0 }),
                Arg::Ptr(tabs.0),
                Arg::Ptr(tabs.1),
                Arg::I32(KV_BLOCK as i32),
            ],
        )
    }

    /// [`Self::qkv_rope`] for `m` decode tokens as one EXL3 launch, RoPE and the cache write in
    /// its epilogue ([`Exl3Linear::forward_rope`]): q to the f32 buffer. False, having run
    /// nothing, where the layer does not fit it: other weights, a bias or q/k norms outside the
    /// layers, a head dimension other than 128, RoPE over part of a head or on adjacent pairs.
    fn qkv_rope_exl3(
        &self,
        m: usize,
        inp: &Inputs,
        lw: &LayerBuffers,
        ops: &LayerOps,
        (kc, vc): (u64, u64),
        tabs: (u64, u64),
    ) -> Result<bool> {
        let (g, c) = (&*self.gpu, &self.cfg);
        let DeviceMatrix::Exl3(parts) = &lw.qkv.w else {
            return Ok(false);
        };
        let (Some(rope), Some(freq)) = (ops.qkv.rope.as_ref(), lw.inv_freq.as_ref()) else {
            return Ok(false);
        };
        let fits = c.head_dim == 128
            && rope.dims == 128
            && !rope.traditional
            && ops.qkv.qk_norm == QkNorm::None
            && lw.qkv.b.is_none();
        if !fits {
            return Ok(false);
        }
        let s = self
            .exl3
            .as_ref()
            .context("EXL3 layers without their scratch")?;
        let x = Rows {
            ptr: g.ptr(&self.b.xn),
            bf16: true,
            ld: c.hidden,
        };
        let e = RopeKv {
            pos: inp.pos,
            inv_freq: g.ptr(freq),
            n_heads: c.n_heads,
            n_kv: c.n_kv_heads,
            pos_scale: rope.position_scale,
            in_scale: rope.input_scale.unwrap_or(1.0),
            q_scale: ops.attn.scale,
            q: g.ptr(&self.b.q),
            k_cache: kc,
            v_cache: vc,
            tables: tabs.0,
            table_off: tabs.1,
            block: KV_BLOCK,
        };
        Exl3Linear::forward_rope(g, s, parts, m, x, &e)
    }

    /// Prefill attention on tensor cores, per chunk of query tokens: S = Q K^T (f32) as one
    /// batched GEMM over kv heads (each group's query rows stacked), the masked softmax into bf16
    /// P, O = P V (bf16); then O is unstacked into the `[t][head][d]` attention output. A chunk
    /// only multiplies the keys its last row can see.
    fn attention_gemm(
        &self,
        m: usize,
        inp: &Inputs,
        attn: &AttentionOp,
        kc: u64,
        vc: u64,
        seg: Seg,
    ) -> Result<()> {
        let (g, c, f, b) = (&*self.gpu, &self.cfg, &self.f, &self.b);
        let (hd, nkv) = (c.head_dim, c.n_kv_heads);
        let group = c.n_heads / nkv;
        let kvd = c.kv_dim();
        let first = seg.start;
        let pos = inp.pos + 4 * seg.off as u64;
        let (qs, os) = (g.ptr(&b.q_stacked), g.ptr(&b.o_stacked));
        let (sc, pr) = (g.ptr(&b.scores), g.ptr(&b.probs));
        let f32t = bsys::cudaDataType::CUDA_R_32F;
        let bf16t = bsys::cudaDataType::CUDA_R_16BF;
        let trans = bsys::cublasOperation_t::CUBLAS_OP_T;
        let none = bsys::cublasOperation_t::CUBLAS_OP_N;
        let mut t0 = 0;
        while t0 < seg.len {
            let tn = self.attn_rows.min(seg.len - t0);
            let n_keys = first + t0 + tn;
            let ld = n_keys.next_multiple_of(8);
            let rows = tn * group;
            let q0 = qs + 2 * ((seg.off + t0) * group * hd) as u64;
            // Column-major S^T (keys x rows) = K (keys x hd) . Q^T (hd x rows), per kv head.
            gemm_batched(
                g,
                (trans, none),
                (n_keys, rows, hd),
                (kc, bf16t, kvd, hd),
                (q0, bf16t, hd, m * group * hd),
                (sc, f32t, ld, rows * ld),
                nkv,
            )?;
            g.launch(
                &f.attn_softmax,
                (rows.div_ceil(8) as u32, nkv as u32, 1),
                256,
                &[
                    Arg::Ptr(sc),
                    Arg::I32(ld as i32),
                    Arg::I32(n_keys as i32),
                    Arg::I32(rows as i32),
                    Arg::Ptr(pos),
                    Arg::I32(t0 as i32),
                    Arg::I32(group as i32),
                    Arg::I32(attn.window.unwrap_or(0) as i32),
                    Arg::F32(attn.softcap.unwrap_or(0.0)),
                    Arg::Ptr(pr),
                ],
            )?;
            // Column-major O^T (hd x rows) = V^T (hd x keys) . P^T (keys x rows).
            gemm_batched(
                g,
                (none, none),
                (hd, rows, n_keys),
                (vc, bf16t, kvd, hd),
                (pr, bf16t, ld, rows * ld),
                (
                    os + 2 * ((seg.off + t0) * group * hd) as u64,
                    bf16t,
                    hd,
                    m * group * hd,
                ),
                nkv,
            )?;
            t0 += tn;
        }
        g.launch(
            &f.attn_unstack,
            (seg.len as u32, 1, 1),
            256,
            &[
                Arg::Ptr(os),
                Arg::I32(m as i32),
                Arg::I32(nkv as i32),
                Arg::I32(group as i32),
                Arg::I32(seg.off as i32),
                Arg::Ptr(g.ptr(&b.attn)),
            ],
        )
    }

    /// `y = inp . W^T` for the projection `(inp, W, k)`, then the residual step (see
    /// [`residual`](Self::residual)).
    fn proj_residual(
        &self,
        m: usize,
        (inp, w, k): (u64, MatRef, usize),
        bias: u64,
        post: (u64, u64),
        rscale: f32,
        next: (u64, u64),
    ) -> Result<()> {
        let (g, h) = (&*self.gpu, self.cfg.hidden);
        let y = g.ptr(&self.b.y);
        self.linear(m, inp, w, h, k, y)?;
        if let Some(c) = &self.comm {
            c.all_reduce_sum_f32(g, y, m * h)?;
        }
        self.residual(m, y, bias, post, rscale, next)
    }

    /// Decode's `x += rscale * inp . W^T` in the GEMV's epilogue, leaving `xn = bf16(nw * x)`
    /// and (with a norm) its sum of squares in `ss` for the next GEMV to finish the RMSNorm.
    /// Returns the sum the next GEMV scales by (0 without a norm).
    fn gemv_res(
        &self,
        (inp, w, k): (u64, u64, usize),
        rscale: f32,
        nw: u64,
        ss: u64,
    ) -> Result<u64> {
        let (g, h) = (&*self.gpu, self.cfg.hidden);
        let ss = if nw != 0 { ss } else { 0 };
        g.launch(
            &self.f.gemv_res,
            (h.div_ceil(RES_ROWS) as u32, 1, 1),
            128,
            &[
                Arg::Ptr(w),
                Arg::I32(h as i32),
                Arg::I32(k as i32),
                Arg::Ptr(inp),
                Arg::Ptr(g.ptr(&self.b.x)),
                Arg::F32(rscale),
                Arg::Ptr(nw),
                Arg::Ptr(g.ptr(&self.b.xn)),
                Arg::Ptr(ss),
            ],
        )?;
        Ok(ss)
    }

    /// `x += rscale * post(y + bias)`, then `xn = next_norm(x)` (identity when absent), per row.
    fn residual(
        &self,
        m: usize,
        y: u64,
        bias: u64,
        post: (u64, u64),
        rscale: f32,
        next: (u64, u64),
    ) -> Result<()> {
        let (g, c) = (&*self.gpu, &self.cfg);
        let h = c.hidden;
        g.launch(
            &self.f.residual_norm,
            (m as u32, 1, 1),
            (h.next_power_of_two().clamp(32, 1024)) as u32,
            &[
                Arg::Ptr(g.ptr(&self.b.x)),
                Arg::Ptr(y),
                Arg::I32(h as i32),
                Arg::Ptr(bias),
                Arg::Ptr(post.0),
                Arg::Ptr(post.1),
                Arg::F32(rscale),
                Arg::Ptr(next.0),
                Arg::Ptr(next.1),
                Arg::F32(c.norm_eps),
                Arg::I32((c.norm == Norm::Layer) as i32),
                Arg::Ptr(g.ptr(&self.b.xn)),
            ],
        )
    }
}

/// Decode attention's split count for `tokens` tokens: the splits share the actual context,
/// sized so that the grid holds about `DECODE_BLOCKS` blocks for one token (at most one tile a
/// split at full context) and `BATCH_DECODE_BLOCKS` for a batch, fewer splits each token.
fn decode_splits(c: &ModelConfig, max_context: usize, tokens: usize) -> usize {
    let tiles = c.n_kv_heads * (c.n_heads / c.n_kv_heads).div_ceil(ATT_ROWS) * tokens.max(1);
    let target = if tokens > 1 {
        BATCH_DECODE_BLOCKS
    } else {
        DECODE_BLOCKS
    };
    (target / tiles).clamp(1, max_context.div_ceil(ATT_KEYS).max(1))
}

/// Most rows of the tensor-core decode GEMM (`gemm_rows8` in gemv.cu); cuBLAS takes more.
pub const FEW_ROWS: usize = 8;
/// Largest matrix (elements) it takes: it beat cuBLAS on the 8B shape's qkv, o and down
/// (68-69 / 59-62 / 73-80% of copy against 60-66 / 47-50 / 77-78% at 2-8 rows), and lost on the
/// larger gate/up and head (80-84 / 89-95% against 81-88 / 95-97%; H200, session 6 run 6).
const FEW_ROWS_MAX_ELEMS: usize = 1 << 26;
/// Warps of a decode GEMM block (`ROWS8_WARPS` in gemv.cu).
const ROWS8_WARPS: usize = 8;

/// The tensor-core decode GEMM for 2..=[`FEW_ROWS`] rows: `y[m, n] (f32) = x[m, k] (bf16) .
/// w[n, k]^T`, each weight read once for all rows.
pub struct FewRows(CudaFunction);

impl FewRows {
    pub fn load(gpu: &Gpu) -> Result<FewRows> {
        Ok(FewRows(gpu.function(&kernels::GEMV, &[], "gemm_rows8")?))
    }

    /// Whether `m` rows through an `n x k` matrix run here (k whole 16-byte vectors).
    pub fn fits(&self, m: usize, n: usize, k: usize) -> bool {
        (2..=FEW_ROWS).contains(&m) && k.is_multiple_of(8) && n * k <= FEW_ROWS_MAX_ELEMS
    }

    #[allow(clippy::too_many_arguments)]
    pub fn run(&self, g: &Gpu, m: usize, n: usize, k: usize, x: u64, w: u64, y: u64) -> Result<()> {
        ensure!(
            self.fits(m, n, k),
            "the decode GEMM takes 2..={FEW_ROWS} rows through at most {FEW_ROWS_MAX_ELEMS} weights, not {m} through {n}x{k}"
        );
        self.launch(g, m, n, k, x, w, y)
    }

    /// As [`Self::run`] for a matrix of any size (the kernel's limits are on `m` and `k` only).
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &self,
        g: &Gpu,
        m: usize,
        n: usize,
        k: usize,
        x: u64,
        w: u64,
        y: u64,
    ) -> Result<()> {
        ensure!(
            (2..=FEW_ROWS).contains(&m) && k.is_multiple_of(8),
            "the decode GEMM takes 2..={FEW_ROWS} rows of whole 16-byte vectors, not {m}x{k}"
        );
        g.launch(
            &self.0,
            (n.div_ceil(16) as u32, 1, 1),
            (ROWS8_WARPS * 32) as u32,
            &[
                Arg::Ptr(w),
                Arg::Ptr(x),
                Arg::Ptr(y),
                Arg::I32(n as i32),
                Arg::I32(k as i32),
                Arg::I32(m as i32),
            ],
        )
    }
}

/// `y[m, n] (f32, row-major) = x[m, k] (bf16) . w[n, k]^T (bf16)`, f32 accumulation, cuBLAS.
pub fn gemm_bf16_f32(g: &Gpu, m: usize, n: usize, k: usize, x: u64, w: u64, y: u64) -> Result<()> {
    gemm(g, m, n, k, x, w, y, bsys::cudaDataType::CUDA_R_32F)
}

/// As [`gemm_bf16_f32`] with the output type `out` (f32 or bf16).
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    g: &Gpu,
    m: usize,
    n: usize,
    k: usize,
    x: u64,
    w: u64,
    y: u64,
    out: bsys::cudaDataType,
) -> Result<()> {
    // Row-major Y = X W^T is column-major Y^T (n x m) = W (k x n)^T . X^T (k x m).
    let bf16t = bsys::cudaDataType::CUDA_R_16BF;
    gemm_ex(
        g,
        "cublas_gemm",
        (
            bsys::cublasOperation_t::CUBLAS_OP_T,
            bsys::cublasOperation_t::CUBLAS_OP_N,
        ),
        (n, m, k),
        (w, bf16t, k),
        (x, bf16t, k),
        (y, out, n),
    )
}

/// One cuBLAS GEMM (column-major, f32 accumulation): `c = op(a) . op(b)`, each operand given as
/// (pointer, type, leading dimension); timed under `name` in a profile.
pub(crate) fn gemm_ex(
    g: &Gpu,
    name: &str,
    ops: (bsys::cublasOperation_t, bsys::cublasOperation_t),
    (m, n, k): (usize, usize, usize),
    a: (u64, bsys::cudaDataType, usize),
    b: (u64, bsys::cudaDataType, usize),
    c: (u64, bsys::cudaDataType, usize),
) -> Result<()> {
    let (alpha, beta) = (1.0f32, 0.0f32);
    // SAFETY: the pointers are live device buffers of the stated sizes; the handle runs on the
    // model's stream.
    g.timed(name, || {
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *g.blas.handle(),
                ops.0,
                ops.1,
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                a.0 as *const _,
                a.1,
                a.2 as i32,
                b.0 as *const _,
                b.1,
                b.2 as i32,
                &beta as *const f32 as *const _,
                c.0 as *mut _,
                c.1,
                c.2 as i32,
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| anyhow!("cublasGemmEx({m}x{n}x{k}): {e:?}"))
    })
}

/// One cuBLAS strided-batched GEMM (column-major, f32 accumulation): `c = op(a) . op(b)`, each
/// operand given as (pointer, type, leading dimension, batch stride).
fn gemm_batched(
    g: &Gpu,
    ops: (bsys::cublasOperation_t, bsys::cublasOperation_t),
    (m, n, k): (usize, usize, usize),
    a: (u64, bsys::cudaDataType, usize, usize),
    b: (u64, bsys::cudaDataType, usize, usize),
    c: (u64, bsys::cudaDataType, usize, usize),
    batch: usize,
) -> Result<()> {
    let (alpha, beta) = (1.0f32, 0.0f32);
    // SAFETY: the pointers are live device buffers holding every batch at the stated strides;
    // the handle runs on the model's stream.
    g.timed("cublas_gemm_batched", || {
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *g.blas.handle(),
                ops.0,
                ops.1,
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                a.0 as *const _,
                a.1,
                a.2 as i32,
                a.3 as i64,
                b.0 as *const _,
                b.1,
                b.2 as i32,
                b.3 as i64,
                &beta as *const f32 as *const _,
                c.0 as *mut _,
                c.1,
                c.2 as i32,
                c.3 as i64,
                batch as i32,
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| anyhow!("cublasGemmStridedBatchedEx({m}x{n}x{k} x{batch}): {e:?}"))
    })
}
