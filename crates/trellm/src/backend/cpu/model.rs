//! The CPU model: the plan executed in f32 over weights decoded exactly from the memory map,
//! one batched step for ragged tokens of many sequences, keys and values in paged blocks.
//!
//! Linear layers run over every token of the step at once, so decode rows of a batch read each
//! weight block once (the multi-row kernels); attention runs per sequence over its own blocks.

use anyhow::{bail, ensure, Result};
use rayon::prelude::*;
use trellm_model::plan::{NormOp, Op, Plan, QkvEpilogue, ResidualEpilogue};
use trellm_model::{Batch, Logits, ModelBackend, Shard};

use crate::backend::cpu::{self, Exl3Activations};
use crate::model::config::{ModelConfig, Norm, QkNorm};
use crate::model::weights::{LayerWeights, Linear, NormWeights, Weights};

/// New queries of a sequence from which its attention runs as matrix products.
const ATTN_GEMM_MIN_QUERIES: usize = 16;
/// Queries per attention task in prefill.
const ATTN_QUERY_TILE: usize = 64;

/// What a layer's output and down projections do with their product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tail {
    /// Add it (with the bias and any post-norm) to the residual stream: the whole layer.
    Residual,
    /// Leave it, without bias, in the scratch's `proj` and add nothing: a tensor-parallel
    /// rank's partial sum.
    Partial,
    /// Skip it: a pass that only collects the projections' inputs.
    TapOnly,
    /// Stop once the first projection's input (the half-layer's normed rows) has been shown:
    /// nothing after the norm runs.
    InputOnly,
}

/// A model on the CPU: shared by every sequence, immutable.
pub struct CpuModel {
    pub cfg: ModelConfig,
    pub plan: Plan,
    pub weights: Weights,
    /// What EXL3 layers multiply by: int16 activations on MUL1 layers by default (on a 3-bpw
    /// SmolLM2, decode: mean KLD 2.4e-6 against the exact path, the same top token at every
    /// position, 1.9x its speed; prefill's GEMM: mean KLD 2.4e-6, 1.28x: BENCHMARKS.md), the
    /// exact path where asked.
    pub exl3_activations: Exl3Activations,
}

/// Keys and values in blocks of `block_size` positions. Block `b` holds, for each layer, its
/// keys transposed, `[kv_dim][slot]` (a head's scores over a block's positions are then one
/// vector operation per dimension), then its values position-major, `[slot][kv_dim]`. A block's
/// memory is allocated when it is first written.
pub struct CpuKv {
    block_size: usize,
    kv_dim: usize,
    blocks: Vec<Vec<f32>>,
}

impl CpuKv {
    fn block_len(&self, n_layers: usize) -> usize {
        n_layers * 2 * self.block_size * self.kv_dim
    }
    /// Start of a layer's transposed keys inside a block.
    #[inline]
    fn key_offset(&self, layer: usize) -> usize {
        layer * 2 * self.block_size * self.kv_dim
    }
    /// Offset of a layer's value at `slot` inside a block.
    #[inline]
    fn value_offset(&self, layer: usize, slot: usize) -> usize {
        ((layer * 2 + 1) * self.block_size + slot) * self.kv_dim
    }
}

/// Where a sequence's position `j` lives: its block table and the cache.
struct SeqKv<'a> {
    kv: &'a CpuKv,
    blocks: &'a [u32],
    layer: usize,
}

impl SeqKv<'_> {
    /// The value row of position `j` (`kv_dim`).
    #[inline]
    fn value(&self, j: usize) -> &[f32] {
        let bs = self.kv.block_size;
        let b = &self.kv.blocks[self.blocks[j / bs] as usize];
        &b[self.kv.value_offset(self.layer, j % bs)..][..self.kv.kv_dim]
    }
    /// The values of the sequence's block `i`, `[block_size][kv_dim]`.
    #[inline]
    fn value_block(&self, i: usize) -> &[f32] {
        let b = &self.kv.blocks[self.blocks[i] as usize];
        &b[self.kv.value_offset(self.layer, 0)..][..self.kv.block_size * self.kv.kv_dim]
    }
    /// The transposed keys of the sequence's block `i`, `[kv_dim][block_size]`.
    #[inline]
    fn key_block(&self, i: usize) -> &[f32] {
        let b = &self.kv.blocks[self.blocks[i] as usize];
        &b[self.kv.key_offset(self.layer)..][..self.kv.kv_dim * self.kv.block_size]
    }
    /// Positions `0..len` of keys (or values) copied out contiguously, `[pos][kv_dim]`.
    fn gather(&self, value: bool, len: usize) -> Vec<f32> {
        let (bs, d) = (self.kv.block_size, self.kv.kv_dim);
        let mut out = vec![0.0f32; len * d];
        for (i, row) in out.chunks_mut(d).enumerate() {
            if value {
                row.copy_from_slice(self.value(i));
            } else {
                let kt = self.key_block(i / bs);
                for (c, v) in row.iter_mut().enumerate() {
                    *v = kt[c * bs + i % bs];
                }
            }
        }
        out
    }
}

fn norm(x: &mut [f32], w: &NormWeights, op: NormOp) {
    match (op.kind, &w.b) {
        (Norm::Layer, Some(b)) => cpu::layer_norm(x, &w.w, b, op.eps),
        _ => cpu::rms_norm(x, &w.w, op.eps),
    }
}

fn norm_rows(x: &mut [f32], w: &NormWeights, op: NormOp) {
    rows_mut(x, w.w.len(), |r| norm(r, w, op));
}

/// Values below which a per-row pass runs on the calling thread: for a batch of decode rows a
/// fork-join costs more than the work.
const PAR_MIN_VALUES: usize = 1 << 15;

/// `f` on each `width`-sized row of `x`, in parallel where there is enough work.
fn rows_mut(x: &mut [f32], width: usize, f: impl Fn(&mut [f32]) + Sync + Send) {
    if x.len() < PAR_MIN_VALUES {
        x.chunks_mut(width).for_each(f);
    } else {
        x.par_chunks_mut(width).for_each(f);
    }
}

/// `y = x W^T (+ b)` for a batch of sequences of `seq_rows` rows each.
fn linear(x: &[f32], seq_rows: &[usize], l: &Linear, y: &mut [f32], acts: Exl3Activations) {
    cpu::linear_batched(x, seq_rows, &l.w, y, acts);
    add_bias(l, y);
}

/// `l`'s bias (if any) added to every row of `y`.
fn add_bias(l: &Linear, y: &mut [f32]) {
    if let Some(b) = &l.b {
        y.chunks_mut(b.len())
            .for_each(|r| r.iter_mut().zip(b).for_each(|(v, c)| *v += c));
    }
}

/// The inputs a layer's linear projections read (shared where projections share one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tap {
    /// The normed residual stream q, k and v read.
    Qkv,
    /// The attention output the output projection reads.
    O,
    /// The normed residual stream gate and up read.
    GateUp,
    /// The activation the down projection reads.
    Down,
}

/// Activations of one step.
struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
}

impl Scratch {
    /// Zeroed buffers for `m` token rows.
    fn new(cfg: &ModelConfig, m: usize) -> Scratch {
        let (h, q_dim, kv_dim) = (
            cfg.hidden,
            cfg.n_heads * cfg.head_dim,
            cfg.n_kv_heads * cfg.head_dim,
        );
        let zeros = |n: usize| vec![0.0f32; m * n];
        Scratch {
            x: zeros(h),
            xn: zeros(h),
            q: zeros(q_dim),
            k: zeros(kv_dim),
            v: zeros(kv_dim),
            attn: zeros(q_dim),
            proj: zeros(h),
            gate: zeros(cfg.intermediate),
            up: zeros(cfg.intermediate),
        }
    }

    /// Buffers for `m` token rows of `cfg`'s model, reusing these (the values left in them are
    /// not cleared: a layer writes every buffer before it reads it).
    fn resize(&mut self, cfg: &ModelConfig, m: usize) {
        let (h, q_dim, kv_dim) = (
            cfg.hidden,
            cfg.n_heads * cfg.head_dim,
            cfg.n_kv_heads * cfg.head_dim,
        );
        for (b, width) in [
            (&mut self.x, h),
            (&mut self.xn, h),
            (&mut self.q, q_dim),
            (&mut self.k, kv_dim),
            (&mut self.v, kv_dim),
            (&mut self.attn, q_dim),
            (&mut self.proj, h),
            (&mut self.gate, cfg.intermediate),
            (&mut self.up, cfg.intermediate),
        ] {
            b.resize(m * width, 0.0);
        }
    }
}

impl CpuModel {
    pub fn new(cfg: ModelConfig, weights: Weights) -> CpuModel {
        CpuModel {
            plan: Plan::new(&cfg),
            cfg,
            weights,
            exl3_activations: Exl3Activations::Int16,
        }
    }

    fn check(&self, batch: &Batch, kv: &CpuKv) -> Result<()> {
        ensure!(
            kv.kv_dim == self.cfg.n_kv_heads * self.cfg.head_dim,
            "the KV cache belongs to another model"
        );
        for s in &batch.seqs {
            ensure!(
                s.offset + s.len <= batch.tokens.len() && s.len > 0,
                "a sequence's tokens lie outside the batch"
            );
            ensure!(
                s.blocks.len() * kv.block_size >= s.start + s.len,
                "a sequence's blocks hold {} positions, the step needs {}",
                s.blocks.len() * kv.block_size,
                s.start + s.len
            );
            ensure!(
                s.blocks.iter().all(|&b| (b as usize) < kv.blocks.len()),
                "a block id lies outside the KV cache"
            );
        }
        if let Some(&bad) = batch.tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
            bail!(
                "token id {bad} is outside the vocabulary (size {})",
                self.cfg.vocab
            );
        }
        Ok(())
    }

    fn step_on_pool(&self, batch: &Batch, kv: &mut CpuKv) -> Vec<f32> {
        self.allocate_blocks(batch, kv);
        let mut st = Scratch::new(&self.cfg, batch.tokens.len());
        self.embed(batch, &mut st);
        for (l, (lp, lw)) in self
            .plan
            .layers
            .iter()
            .zip(&self.weights.layers)
            .enumerate()
        {
            self.layer(
                l,
                &lp.ops,
                lw,
                batch,
                kv,
                &mut st,
                &mut |_, _| {},
                Tail::Residual,
            );
        }
        self.logits(batch, &mut st)
    }

    /// Gives memory to the blocks this step writes.
    fn allocate_blocks(&self, batch: &Batch, kv: &mut CpuKv) {
        let block_len = kv.block_len(self.cfg.n_layers());
        for s in &batch.seqs {
            let bs = kv.block_size;
            for j in s.start..s.start + s.len {
                let b = s.blocks[j / bs] as usize;
                if kv.blocks[b].is_empty() {
                    kv.blocks[b] = vec![0.0; block_len];
                }
            }
        }
    }

    /// The batch's token embeddings into the residual stream.
    fn embed(&self, batch: &Batch, st: &mut Scratch) {
        let h = self.cfg.hidden;
        for (t, &id) in batch.tokens.iter().enumerate() {
            let row = &mut st.x[t * h..(t + 1) * h];
            self.weights.embed.dequantize_row(id as usize, row);
            if let Some(s) = self.plan.embed_scale {
                row.iter_mut().for_each(|v| *v *= s);
            }
        }
    }

    /// The final norm and the output head over the rows that want logits, sequence by sequence.
    fn logits(&self, batch: &Batch, st: &mut Scratch) -> Vec<f32> {
        let cfg = &self.cfg;
        let h = cfg.hidden;
        let mut rows = Vec::with_capacity(batch.logit_rows() * h);
        for s in &batch.seqs {
            let r = s.want.rows(s.len);
            let first = s.offset + s.len - r;
            rows.extend_from_slice(&st.x[first * h..(s.offset + s.len) * h]);
        }
        norm_rows(&mut rows, &self.weights.final_norm, self.plan.final_norm);
        let n = rows.len() / h;
        if n == 0 {
            return Vec::new();
        }
        let mut logits = vec![0.0f32; n * cfg.vocab];
        let out_rows: Vec<usize> = batch
            .seqs
            .iter()
            .map(|s| s.want.rows(s.len))
            .filter(|&r| r > 0)
            .collect();
        cpu::linear_batched(
            &rows,
            &out_rows,
            &self.weights.lm_head,
            &mut logits,
            self.exl3_activations,
        );
        if let Some(cap) = self.plan.logits.softcap {
            logits.iter_mut().for_each(|v| *v = cpu::softcap(*v, cap));
        }
        if let Some(d) = self.plan.logits.divisor {
            logits.iter_mut().for_each(|v| *v /= d);
        }
        logits
    }

    /// Runs `ops` (a layer's plan or a part of it), showing `tap` each linear layer's input.
    /// `tail` says what the output and down projections do (see [`Tail`]).
    #[allow(clippy::too_many_arguments)]
    fn layer(
        &self,
        l: usize,
        ops: &[Op],
        lw: &LayerWeights,
        batch: &Batch,
        kv: &mut CpuKv,
        st: &mut Scratch,
        tap: &mut (dyn FnMut(Tap, &[f32]) + Send),
        tail: Tail,
    ) {
        let m = batch.tokens.len();
        let rows: Vec<usize> = batch.seqs.iter().map(|s| s.len).collect();
        let rows = &rows[..];
        let acts = self.exl3_activations;
        let pre_norm = |st: &mut Scratch, op: &Option<NormOp>, w: &Option<NormWeights>| {
            st.xn.copy_from_slice(&st.x);
            if let (Some(op), Some(w)) = (op, w) {
                norm_rows(&mut st.xn, w, *op);
            }
        };
        for op in ops {
            match op {
                Op::AttnNorm(n) => pre_norm(st, n, &lw.attn_norm),
                Op::Qkv(e) => {
                    tap(Tap::Qkv, &st.xn);
                    if tail == Tail::InputOnly {
                        return;
                    }
                    linear(&st.xn, rows, &lw.q, &mut st.q, acts);
                    linear(&st.xn, rows, &lw.k, &mut st.k, acts);
                    linear(&st.xn, rows, &lw.v, &mut st.v, acts);
                    qkv_epilogue(e, lw, batch, st);
                    write_kv(kv, l, batch, &st.k, &st.v);
                }
                Op::Attention(a) => {
                    let kv = &*kv;
                    let (q_dim, hd) = (a.n_heads * a.head_dim, a.head_dim);
                    let group = a.n_heads / a.n_kv_heads;
                    // Sequences with few new queries: tasks by query and head, reading keys in
                    // place from the blocks.
                    let mut small = vec![usize::MAX; m];
                    for (i, s) in batch.seqs.iter().enumerate() {
                        if s.len < ATTN_GEMM_MIN_QUERIES {
                            small[s.offset..s.offset + s.len].fill(i);
                        }
                    }
                    // The query heads of one kv head read its keys and values once, when there
                    // are enough tasks to keep every thread busy; one head a task otherwise.
                    // Each head's arithmetic is the same either way.
                    let threads = rayon::current_num_threads();
                    let per_task = if m * a.n_kv_heads >= 4 * threads {
                        group
                    } else {
                        1
                    };
                    let q = &st.q;
                    st.attn
                        .par_chunks_mut(per_task * hd)
                        .enumerate()
                        .for_each_init(
                            || (Vec::new(), Vec::new()),
                            |(scores, qs), (task, o)| {
                                let tasks_per_token = a.n_heads / per_task;
                                let (t, h0) =
                                    (task / tasks_per_token, task % tasks_per_token * per_task);
                                let Some(s) = batch.seqs.get(small[t]) else {
                                    return;
                                };
                                let pos = s.start + (t - s.offset);
                                let lo = a.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                                let seq = SeqKv {
                                    kv,
                                    blocks: &s.blocks,
                                    layer: l,
                                };
                                let kvh = h0 / group;
                                qs.clear();
                                qs.extend(
                                    q[t * q_dim + h0 * hd..][..per_task * hd]
                                        .iter()
                                        .map(|v| v * a.scale),
                                );
                                attend(qs, hd, kvh, lo, pos, &seq, a.softcap, scores, o);
                            },
                        );
                    // Prefill chunks: two matrix products per head and query tile over the
                    // sequence's keys gathered contiguously.
                    for s in batch.seqs.iter().filter(|s| s.len >= ATTN_GEMM_MIN_QUERIES) {
                        let seq = SeqKv {
                            kv,
                            blocks: &s.blocks,
                            layer: l,
                        };
                        let ctx = s.start + s.len;
                        let (keys, values) = (seq.gather(false, ctx), seq.gather(true, ctx));
                        attention_gemm(
                            a,
                            &st.q[s.offset * q_dim..(s.offset + s.len) * q_dim],
                            &keys,
                            &values,
                            s.start,
                            &mut st.attn[s.offset * q_dim..(s.offset + s.len) * q_dim],
                        );
                    }
                }
                Op::Output(e) => {
                    tap(Tap::O, &st.attn);
                    match tail {
                        Tail::Residual => {
                            linear(&st.attn, rows, &lw.o, &mut st.proj, acts);
                            residual(e, &lw.post_attn_norm, &mut st.x, &mut st.proj);
                        }
                        Tail::Partial => {
                            cpu::linear_batched(&st.attn, rows, &lw.o.w, &mut st.proj, acts)
                        }
                        Tail::TapOnly | Tail::InputOnly => {}
                    }
                }
                Op::MlpNorm(n) => pre_norm(st, n, &lw.ffn_norm),
                Op::GateUp(g) => {
                    tap(Tap::GateUp, &st.xn);
                    if tail == Tail::InputOnly {
                        return;
                    }
                    match (g.gated, &lw.gate) {
                        (true, Some(gate))
                            if cpu::gated_exl3(
                                &st.xn,
                                rows,
                                gate,
                                &lw.up,
                                g.activation,
                                &mut st.gate,
                                acts,
                            ) => {}
                        (true, Some(gate)) => {
                            linear(&st.xn, rows, &lw.up, &mut st.up, acts);
                            linear(&st.xn, rows, gate, &mut st.gate, acts);
                            cpu::gated_activation(g.activation, &mut st.gate, &st.up);
                        }
                        _ => {
                            linear(&st.xn, rows, &lw.up, &mut st.up, acts);
                            cpu::activation(g.activation, &st.up, &mut st.gate);
                        }
                    }
                }
                Op::Down(e) => {
                    tap(Tap::Down, &st.gate);
                    match tail {
                        Tail::Residual => {
                            linear(&st.gate, rows, &lw.down, &mut st.proj, acts);
                            residual(e, &lw.post_ffn_norm, &mut st.x, &mut st.proj);
                        }
                        Tail::Partial => {
                            cpu::linear_batched(&st.gate, rows, &lw.down.w, &mut st.proj, acts)
                        }
                        Tail::TapOnly | Tail::InputOnly => {}
                    }
                }
            }
        }
    }
}

/// q/k norms and RoPE on the step's q and k rows.
fn qkv_epilogue(e: &QkvEpilogue, lw: &LayerWeights, batch: &Batch, st: &mut Scratch) {
    let (q_dim, kv_dim, hd) = (e.q_dim, e.kv_dim, e.head_dim);
    if let (Some(qn), Some(kn)) = (&lw.q_norm, &lw.k_norm) {
        match e.qk_norm {
            QkNorm::Whole => {
                rows_mut(&mut st.q, q_dim, |r| cpu::rms_norm(r, qn, e.norm_eps));
                rows_mut(&mut st.k, kv_dim, |r| cpu::rms_norm(r, kn, e.norm_eps));
            }
            _ => {
                cpu::rms_norm_chunks(&mut st.q, qn, e.norm_eps);
                cpu::rms_norm_chunks(&mut st.k, kn, e.norm_eps);
            }
        }
    }
    let Some(rope) = &e.rope else {
        return;
    };
    let half = rope.dims / 2;
    let fixed = (!rope.is_dynamic()).then(|| rope.inv_freq(1));
    for s in &batch.seqs {
        // Dynamic NTK depends on the sequence's own length.
        let dynamic;
        let inv_freq = match &fixed {
            Some(f) => f,
            None => {
                dynamic = rope.inv_freq(s.start + s.len);
                &dynamic
            }
        };
        let (mut cos, mut sin) = (vec![0.0f32; half], vec![0.0f32; half]);
        for t in 0..s.len {
            let i = s.offset + t;
            rope.cos_sin((s.start + t) as i64, inv_freq, &mut cos, &mut sin);
            for head in st.q[i * q_dim..(i + 1) * q_dim].chunks_mut(hd) {
                rope.rotate(head, &cos, &sin);
            }
            for head in st.k[i * kv_dim..(i + 1) * kv_dim].chunks_mut(hd) {
                rope.rotate(head, &cos, &sin);
            }
        }
    }
}

/// Each new token's key and value go to its position in its sequence's blocks.
fn write_kv(kv: &mut CpuKv, layer: usize, batch: &Batch, k: &[f32], v: &[f32]) {
    let (bs, d) = (kv.block_size, kv.kv_dim);
    for s in &batch.seqs {
        for t in 0..s.len {
            let (i, j) = (s.offset + t, s.start + t);
            let (b, slot) = (s.blocks[j / bs] as usize, j % bs);
            let ko = kv.key_offset(layer);
            let vo = kv.value_offset(layer, slot);
            let blk = &mut kv.blocks[b];
            for (c, &x) in k[i * d..(i + 1) * d].iter().enumerate() {
                blk[ko + c * bs + slot] = x;
            }
            blk[vo..vo + d].copy_from_slice(&v[i * d..(i + 1) * d]);
        }
    }
}

/// Decode attention of the query heads `qs` (scaled, `hd` each) that share kv head `kvh`, over
/// positions `lo..=pos` of `seq`, into `o`: scores a block of positions at a time from the
/// transposed keys, then softmax, then the values weighted. Compiled for the CPU's vector unit.
#[allow(clippy::too_many_arguments)]
fn attend(
    qs: &[f32],
    hd: usize,
    kvh: usize,
    lo: usize,
    pos: usize,
    seq: &SeqKv,
    softcap: Option<f32>,
    scores: &mut Vec<f32>,
    o: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        use trellm_quant::ggml::dot::{best_level, Level};
        match best_level() {
            // SAFETY: the level was detected on this CPU.
            Level::Avx512 => {
                return unsafe { attend_avx512(qs, hd, kvh, lo, pos, seq, softcap, scores, o) }
            }
            Level::Avx2 => {
                return unsafe { attend_avx2(qs, hd, kvh, lo, pos, seq, softcap, scores, o) }
            }
            Level::Scalar => {}
        }
    }
    attend_generic(qs, hd, kvh, lo, pos, seq, softcap, scores, o)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_avx512(
    qs: &[f32],
    hd: usize,
    kvh: usize,
    lo: usize,
    pos: usize,
    seq: &SeqKv,
    softcap: Option<f32>,
    scores: &mut Vec<f32>,
    o: &mut [f32],
) {
    attend_generic(qs, hd, kvh, lo, pos, seq, softcap, scores, o)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_avx2(
    qs: &[f32],
    hd: usize,
    kvh: usize,
    lo: usize,
    pos: usize,
    seq: &SeqKv,
    softcap: Option<f32>,
    scores: &mut Vec<f32>,
    o: &mut [f32],
) {
    attend_generic(qs, hd, kvh, lo, pos, seq, softcap, scores, o)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_generic(
    qs: &[f32],
    hd: usize,
    kvh: usize,
    lo: usize,
    pos: usize,
    seq: &SeqKv,
    softcap: Option<f32>,
    scores: &mut Vec<f32>,
    o: &mut [f32],
) {
    // `new_cache` makes blocks of this size only.
    const BS: usize = crate::backend::BLOCK_SIZE;
    // Blocks scored at once: each score is one chain of dependent adds over the head's
    // dimensions, so several blocks' chains in flight hide the latency (each score's arithmetic
    // and order unchanged).
    const NB: usize = 4;
    let n = pos + 1 - lo;
    let (b0, b1) = (lo / BS, pos / BS + 1);
    scores.resize(qs.len() / hd * n, 0.0);
    for (g, qh) in qs.chunks(hd).enumerate() {
        let sc = &mut scores[g * n..(g + 1) * n];
        let mut bi = b0;
        while bi < b1 {
            if b1 - bi >= NB {
                score_blocks::<NB>(qh, hd, kvh, lo, pos, bi, seq, sc);
                bi += NB;
            } else {
                score_blocks::<1>(qh, hd, kvh, lo, pos, bi, seq, sc);
                bi += 1;
            }
        }
    }
    for sc in scores.chunks_mut(n) {
        if let Some(cap) = softcap {
            sc.iter_mut().for_each(|s| *s = cpu::softcap(*s, cap));
        }
        cpu::softmax(sc);
    }
    // The weighted values, a 64-wide slice of a head at a time accumulated in registers over
    // the positions (the same sums, in the same order, as an axpy per position).
    const W: usize = 64;
    let kv_dim = seq.kv.kv_dim;
    for (g, oh) in o.chunks_mut(hd).enumerate() {
        let sc = &scores[g * n..(g + 1) * n];
        if !hd.is_multiple_of(W) {
            oh.fill(0.0);
            for (i, j) in (lo..=pos).enumerate() {
                cpu::axpy_generic(sc[i], &seq.value(j)[kvh * hd..][..hd], oh);
            }
            continue;
        }
        for (c0, oc) in (0..hd).step_by(W).zip(oh.chunks_exact_mut(W)) {
            let mut acc = [0.0f32; W];
            for bi in b0..b1 {
                let vb = seq.value_block(bi);
                let s0 = lo.max(bi * BS) - bi * BS;
                let s1 = pos.min(bi * BS + BS - 1) - bi * BS + 1;
                for slot in s0..s1 {
                    let v: &[f32; W] = vb[slot * kv_dim + kvh * hd + c0..][..W]
                        .try_into()
                        .expect("a value slice");
                    let p = sc[bi * BS + slot - lo];
                    for d in 0..W {
                        acc[d] += p * v[d];
                    }
                }
            }
            oc.copy_from_slice(&acc);
        }
    }
}

/// Scores of query head `qh` against the keys of blocks `bi..bi + K`, their slots inside
/// `lo..=pos` written to `sc` (indexed from `lo`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn score_blocks<const K: usize>(
    qh: &[f32],
    hd: usize,
    kvh: usize,
    lo: usize,
    pos: usize,
    bi: usize,
    seq: &SeqKv,
    sc: &mut [f32],
) {
    const BS: usize = crate::backend::BLOCK_SIZE;
    let kts: [&[f32]; K] = std::array::from_fn(|k| seq.key_block(bi + k));
    let mut acc = [[0.0f32; BS]; K];
    for (d, &qd) in qh.iter().enumerate() {
        for k in 0..K {
            let row: &[f32; BS] = kts[k][(kvh * hd + d) * BS..][..BS]
                .try_into()
                .expect("a block row");
            for s in 0..BS {
                acc[k][s] += qd * row[s];
            }
        }
    }
    for (k, acc) in acc.iter().enumerate() {
        let b = bi + k;
        // The block's slots inside lo..=pos.
        let s0 = lo.max(b * BS) - b * BS;
        let s1 = pos.min(b * BS + BS - 1) - b * BS + 1;
        let first = b * BS + s0 - lo;
        sc[first..first + (s1 - s0)].copy_from_slice(&acc[s0..s1]);
    }
}

/// Adds a projection's output to the residual stream (after its post-norm, if any).
fn residual(e: &ResidualEpilogue, post: &Option<NormWeights>, x: &mut [f32], out: &mut [f32]) {
    if let (Some(op), Some(w)) = (e.post_norm, post) {
        norm_rows(out, w, op);
    }
    match e.scale {
        Some(s) => x.iter_mut().zip(&*out).for_each(|(a, b)| *a += b * s),
        None => x.iter_mut().zip(&*out).for_each(|(a, b)| *a += b),
    }
}

/// Prefill attention of one sequence's new queries (positions `start..`) as two matrix products
/// per head and tile of queries (scores = Q·Kᵀ, out = softmax(scores)·V) by the `gemm` crate,
/// reading Q, K and V in place through strides.
fn attention_gemm(
    a: &trellm_model::plan::AttentionOp,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    start: usize,
    out: &mut [f32],
) {
    let hd = a.head_dim;
    let group = a.n_heads / a.n_kv_heads;
    let kv_dim = a.n_kv_heads * hd;
    let q_dim = a.n_heads * hd;
    let n = out.len() / q_dim;
    let tiles = n.div_ceil(ATTN_QUERY_TILE);
    let lo_of = |pos: usize| a.window.map_or(0, |w| (pos + 1).saturating_sub(w));
    let results: Vec<(usize, usize, Vec<f32>)> = (0..a.n_heads * tiles)
        .into_par_iter()
        .map(|task| {
            let (head, tile) = (task / tiles, task % tiles);
            let kvh = head / group;
            let t0 = tile * ATTN_QUERY_TILE;
            let nt = ATTN_QUERY_TILE.min(n - t0);
            // Keys any query of the tile may see.
            let j1 = start + t0 + nt;
            let j0 = lo_of(start + t0).min(j1);
            let nj = j1 - j0;
            let mut scores = vec![0.0f32; nt * nj];
            // SAFETY: the strides address q rows t0.. (head slice), key rows j0..j1 (kv head
            // slice) and the nt x nj scores buffer, all in bounds.
            unsafe {
                gemm::gemm(
                    nt,
                    nj,
                    hd,
                    scores.as_mut_ptr(),
                    1,
                    nj as isize,
                    false,
                    q.as_ptr().add(t0 * q_dim + head * hd),
                    1,
                    q_dim as isize,
                    keys.as_ptr().add(j0 * kv_dim + kvh * hd),
                    kv_dim as isize,
                    1,
                    0.0,
                    a.scale,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            for (t, row) in scores.chunks_mut(nj).enumerate() {
                let pos = start + t0 + t;
                let (lo, hi) = (lo_of(pos), pos + 1);
                let live = &mut row[lo - j0..hi - j0];
                if let Some(cap) = a.softcap {
                    live.iter_mut().for_each(|s| *s = cpu::softcap(*s, cap));
                }
                cpu::softmax(live);
                row[..lo - j0].fill(0.0);
                row[hi - j0..].fill(0.0);
            }
            let mut o = vec![0.0f32; nt * hd];
            // SAFETY: scores is nt x nj, value rows j0..j1 of the kv head, o is nt x hd.
            unsafe {
                gemm::gemm(
                    nt,
                    hd,
                    nj,
                    o.as_mut_ptr(),
                    1,
                    hd as isize,
                    false,
                    scores.as_ptr(),
                    1,
                    nj as isize,
                    values.as_ptr().add(j0 * kv_dim + kvh * hd),
                    1,
                    kv_dim as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            (head, t0, o)
        })
        .collect();
    for (head, t0, o) in results {
        for (t, row) in o.chunks(hd).enumerate() {
            out[(t0 + t) * q_dim + head * hd..][..hd].copy_from_slice(row);
        }
    }
}

thread_local! {
    /// [`CpuModel::forward_layer`]'s working memory (activations and the one layer's KV
    /// blocks), kept from call to call: made and zeroed anew for each 2048-token row (about 50
    /// MB for SmolLM2), it kept one thread busy while the other waited, 1 s of a 27 s layer.
    static PASS_MEMORY: std::cell::RefCell<(Option<Scratch>, Vec<Vec<f32>>)> =
        const { std::cell::RefCell::new((None, Vec::new())) };
}

impl CpuModel {
    /// Runs `ops` (a layer's plan or a part of it) with weights `lw` over the hidden states `x`
    /// (`[tokens][hidden]`) of one sequence at positions `0..tokens`, in place, showing `tap`
    /// the input rows of each linear projection. The quantizer's calibration pass runs a model
    /// this way, a half-layer (with weights it has just quantized) at a time; the keys and
    /// values live in a cache of one layer kept by the calling thread. With [`Tail::TapOnly`] the output
    /// and down projections are only shown to `tap`, and `x` is left as it was.
    pub fn forward_layer(
        &self,
        ops: &[Op],
        lw: &LayerWeights,
        x: &mut [f32],
        tail: Tail,
        tap: &mut (dyn FnMut(Tap, &[f32]) + Send),
    ) -> Result<()> {
        let cfg = &self.cfg;
        let (h, m) = (cfg.hidden, x.len() / cfg.hidden.max(1));
        ensure!(
            m > 0 && x.len() == m * h,
            "forward_layer: {} values for hidden size {h}",
            x.len()
        );
        let bs = crate::backend::BLOCK_SIZE;
        let n_blocks = m.div_ceil(bs);
        let kv_dim = cfg.n_kv_heads * cfg.head_dim;
        let mut batch = Batch::default();
        // The token ids are never read (no embedding): only the count and positions matter.
        batch.push(
            &vec![0; m],
            0,
            (0..n_blocks as u32).collect(),
            trellm_model::Want::None,
        );
        PASS_MEMORY.with_borrow_mut(|(st, blocks)| {
            let st = st.get_or_insert_with(|| Scratch::new(cfg, 0));
            st.resize(cfg, m);
            blocks.resize_with(n_blocks, Vec::new);
            blocks
                .iter_mut()
                .for_each(|b| b.resize(2 * bs * kv_dim, 0.0));
            let mut kv = CpuKv {
                block_size: bs,
                kv_dim,
                blocks: std::mem::take(blocks),
            };
            st.x.copy_from_slice(x);
            cpu::pool().install(|| self.layer(0, ops, lw, &batch, &mut kv, st, tap, tail));
            if matches!(tail, Tail::Residual | Tail::Partial) {
                x.copy_from_slice(&st.x);
            }
            *blocks = kv.blocks;
        });
        Ok(())
    }

    /// The rest of a half-layer from its last projection's input (`input`: `[tokens][width]`,
    /// the rows [`Tap::O`] or [`Tap::Down`] showed): `op`, the output or down projection with
    /// `lw`'s weights, added to `x` (`[tokens][hidden]`) as a [`Tail::Residual`] pass adds it.
    pub fn finish_half(
        &self,
        op: &Op,
        lw: &LayerWeights,
        input: &[f32],
        x: &mut [f32],
    ) -> Result<()> {
        let (l, e, post) = match op {
            Op::Output(e) => (&lw.o, e, &lw.post_attn_norm),
            Op::Down(e) => (&lw.down, e, &lw.post_ffn_norm),
            _ => bail!("finish_half: {op:?} is not a half-layer's last projection"),
        };
        let h = self.cfg.hidden;
        let m = x.len() / h.max(1);
        ensure!(
            m > 0 && x.len() == m * h && input.len() == m * l.w.cols(),
            "finish_half: {} inputs and {} hidden values for {m} rows",
            input.len(),
            x.len()
        );
        let mut proj = vec![0.0f32; m * h];
        cpu::pool().install(|| {
            linear(input, &[m], l, &mut proj, self.exl3_activations);
            residual(e, post, x, &mut proj);
        });
        Ok(())
    }

    /// The final norm over rows of hidden states (`[tokens][hidden]`), in place: the head's input.
    pub fn final_norm_rows(&self, x: &mut [f32]) {
        cpu::pool().install(|| norm_rows(x, &self.weights.final_norm, self.plan.final_norm));
    }
}

impl ModelBackend for CpuModel {
    type Cache = CpuKv;

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn new_cache(&self, n_blocks: usize, block_size: usize) -> Result<CpuKv> {
        ensure!(
            block_size == crate::backend::BLOCK_SIZE,
            "the CPU backend keeps KV blocks of {} positions",
            crate::backend::BLOCK_SIZE
        );
        Ok(CpuKv {
            block_size,
            kv_dim: self.cfg.n_kv_heads * self.cfg.head_dim,
            blocks: (0..n_blocks).map(|_| Vec::new()).collect(),
        })
    }

    fn block_bytes(&self, block_size: usize) -> usize {
        self.cfg.n_layers() * 2 * block_size * self.cfg.n_kv_heads * self.cfg.head_dim * 4
    }

    fn copy_blocks(&self, kv: &mut CpuKv, copies: &[(u32, u32)]) -> Result<()> {
        for &(src, dst) in copies {
            let data = kv.blocks[src as usize].clone();
            kv.blocks[dst as usize] = data;
        }
        Ok(())
    }

    fn step(&self, batch: &Batch, kv: &mut CpuKv) -> Result<Logits> {
        if batch.seqs.is_empty() {
            return Ok(Vec::new().into());
        }
        self.check(batch, kv)?;
        // On a pool thread, the many small parallel ops of a step are handed to the other
        // workers directly instead of each being injected from outside and waited for.
        Ok(cpu::pool().install(|| self.step_on_pool(batch, kv)).into())
    }
}

/// A model split over `world` tensor-parallel ranks ([`Shard`]), its ranks run one after another
/// in this process: each layer half (attention, MLP) runs on every rank up to its partial
/// projection, the partials are summed in rank order (the all-reduce), and the projection's bias
/// and residual epilogue run once on the sum. It checks the sharding's numerics on the CPU; GPU ranks run
/// the same split with NCCL's all-reduce.
pub struct ShardedCpu {
    ranks: Vec<CpuModel>,
    cfg: ModelConfig,
}

/// The ranks' KV caches (each holds its own kv heads).
pub struct ShardedKv(Vec<CpuKv>);

impl ShardedCpu {
    /// `full` split over `world` ranks, each running as `full` does.
    pub fn new(full: &CpuModel, world: usize) -> Result<ShardedCpu> {
        let cfg = full.cfg.clone();
        Shard::check(&cfg, world)?;
        let ranks = (0..world)
            .map(|rank| {
                let s = Shard { rank, world };
                Ok(CpuModel {
                    exl3_activations: full.exl3_activations,
                    ..CpuModel::new(s.config(&cfg), s.weights(&cfg, &full.weights)?)
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ShardedCpu { ranks, cfg })
    }

    fn step_on_pool(&self, batch: &Batch, kv: &mut ShardedKv) -> Vec<f32> {
        let m = batch.tokens.len();
        for (r, k) in self.ranks.iter().zip(kv.0.iter_mut()) {
            r.allocate_blocks(batch, k);
        }
        let mut sts: Vec<Scratch> = self.ranks.iter().map(|r| Scratch::new(&r.cfg, m)).collect();
        let first = &self.ranks[0];
        first.embed(batch, &mut sts[0]);
        for l in 0..self.cfg.n_layers() {
            let ops = &first.plan.layers[l].ops;
            let split = 1 + ops
                .iter()
                .position(|o| matches!(o, Op::Output(_)))
                .expect("a layer plan has an output projection");
            for half in [0..split, split..ops.len()] {
                let x = sts[0].x.clone();
                for ((rank, k), st) in self.ranks.iter().zip(kv.0.iter_mut()).zip(&mut sts) {
                    st.x.copy_from_slice(&x);
                    let ops = &rank.plan.layers[l].ops[half.clone()];
                    let lw = &rank.weights.layers[l];
                    rank.layer(l, ops, lw, batch, k, st, &mut |_, _| {}, Tail::Partial);
                }
                let (head, rest) = sts.split_first_mut().expect("at least one rank");
                for st in rest.iter() {
                    head.proj
                        .iter_mut()
                        .zip(&st.proj)
                        .for_each(|(a, b)| *a += b);
                }
                let lw = &first.weights.layers[l];
                let (e, proj, post) = match &ops[half.end - 1] {
                    Op::Output(e) => (e, &lw.o, &lw.post_attn_norm),
                    Op::Down(e) => (e, &lw.down, &lw.post_ffn_norm),
                    op => unreachable!("a layer half ends in {op:?}"),
                };
                add_bias(proj, &mut head.proj);
                residual(e, post, &mut head.x, &mut head.proj);
            }
        }
        first.logits(batch, &mut sts[0])
    }
}

impl ModelBackend for ShardedCpu {
    type Cache = ShardedKv;

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn new_cache(&self, n_blocks: usize, block_size: usize) -> Result<ShardedKv> {
        let caches = self.ranks.iter().map(|r| r.new_cache(n_blocks, block_size));
        Ok(ShardedKv(caches.collect::<Result<_>>()?))
    }

    fn block_bytes(&self, block_size: usize) -> usize {
        self.ranks.iter().map(|r| r.block_bytes(block_size)).sum()
    }

    fn copy_blocks(&self, kv: &mut ShardedKv, copies: &[(u32, u32)]) -> Result<()> {
        for (r, k) in self.ranks.iter().zip(kv.0.iter_mut()) {
            r.copy_blocks(k, copies)?;
        }
        Ok(())
    }

    fn step(&self, batch: &Batch, kv: &mut ShardedKv) -> Result<Logits> {
        if batch.seqs.is_empty() {
            return Ok(Vec::new().into());
        }
        for (r, k) in self.ranks.iter().zip(&kv.0) {
            r.check(batch, k)?;
        }
        Ok(cpu::pool().install(|| self.step_on_pool(batch, kv)).into())
    }
}
