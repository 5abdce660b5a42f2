//! The universal decoder: one forward pass for every supported family, driven by `ModelConfig`.
//!
//! The pass runs a batch of rows of equal length. Rows may be left-padded: a row's padding
//! never serves as a key, and its positions count from its first real token, so each row's
//! logits are those it gets alone.

use rayon::prelude::*;

use super::config::{Mlp, ModelConfig, Norm, QkNorm};
use super::weights::{Linear, NormWeights, Weights};
use crate::backend::cpu;

/// Keys and values of every layer and row, position-major: `[pos][kv_head][head_dim]`.
pub struct KvCache {
    /// `[layer][row]`.
    k: Vec<Vec<Vec<f32>>>,
    v: Vec<Vec<Vec<f32>>>,
    len: usize,
    /// Left padding of each row.
    pad: Vec<usize>,
}

impl KvCache {
    /// A cache for one sequence.
    pub fn new(cfg: &ModelConfig) -> Self {
        Self::batch(cfg, &[0])
    }
    /// A cache for rows whose first `left_padding[b]` tokens are padding.
    pub fn batch(cfg: &ModelConfig, left_padding: &[usize]) -> Self {
        let rows = left_padding.len();
        KvCache {
            k: vec![vec![Vec::new(); rows]; cfg.n_layers()],
            v: vec![vec![Vec::new(); rows]; cfg.n_layers()],
            len: 0,
            pad: left_padding.to_vec(),
        }
    }
    /// Positions stored (per row, padding included).
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Rows in the batch.
    pub fn rows(&self) -> usize {
        self.pad.len()
    }
}

/// New queries per row from which prefill attention runs as matrix products.
const ATTN_GEMM_MIN_QUERIES: usize = 16;
/// Queries per attention task in prefill.
const ATTN_QUERY_TILE: usize = 64;

/// Which positions of a forward pass need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    Last,
    All,
}

pub struct Decoder {
    pub cfg: ModelConfig,
    pub weights: Weights,
}

fn norm(x: &mut [f32], w: &NormWeights, kind: Norm, eps: f32) {
    match (kind, &w.b) {
        (Norm::Layer, Some(b)) => cpu::layer_norm(x, &w.w, b, eps),
        _ => cpu::rms_norm(x, &w.w, eps),
    }
}

/// `y = x W^T (+ b)` for `n` rows.
fn linear(x: &[f32], n: usize, l: &Linear, y: &mut [f32]) {
    cpu::linear(x, n, &l.w, y);
    if let Some(b) = &l.b {
        y.chunks_mut(b.len())
            .for_each(|r| r.iter_mut().zip(b).for_each(|(v, c)| *v += c));
    }
}

impl Decoder {
    pub fn new(cfg: ModelConfig, weights: Weights) -> Self {
        Decoder { cfg, weights }
    }

    /// Runs `tokens` at positions `cache.len()..`, appends their keys and values to the cache, and
    /// returns logits (`vocab` values per requested position).
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache, want: Logits) -> Vec<f32> {
        assert_eq!(
            cache.rows(),
            1,
            "forward runs one sequence; use forward_batch"
        );
        self.forward_batch(tokens, cache, want)
    }

    /// Runs `cache.rows()` rows of `tokens.len() / rows` tokens each (row-major), at positions
    /// `cache.len()..` of each row; returns logits row by row (every position, or each row's
    /// last).
    pub fn forward_batch(&self, tokens: &[u32], cache: &mut KvCache, want: Logits) -> Vec<f32> {
        // On a pool thread, the many small parallel ops of a decode step are handed to the other
        // workers directly instead of each being injected from outside and waited for.
        cpu::pool().install(|| self.forward_batch_on_pool(tokens, cache, want))
    }

    fn forward_batch_on_pool(&self, tokens: &[u32], cache: &mut KvCache, want: Logits) -> Vec<f32> {
        let cfg = &self.cfg;
        let rows = cache.rows();
        assert!(
            rows > 0 && tokens.len().is_multiple_of(rows),
            "tokens do not split into rows"
        );
        let n = tokens.len() / rows;
        let m = tokens.len();
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let start = cache.len;
        let q_dim = cfg.n_heads * hd;
        let kv_dim = cfg.n_kv_heads * hd;

        let mut x = vec![0.0f32; m * h];
        for (t, &id) in tokens.iter().enumerate() {
            let row = &mut x[t * h..(t + 1) * h];
            self.weights.embed.dequantize_row(id as usize, row);
            if let Some(s) = cfg.embed_scale {
                row.iter_mut().for_each(|v| *v *= s);
            }
        }

        let mut xn = vec![0.0f32; m * h];
        let mut q = vec![0.0f32; m * q_dim];
        let mut k = vec![0.0f32; m * kv_dim];
        let mut v = vec![0.0f32; m * kv_dim];
        let mut attn = vec![0.0f32; m * q_dim];
        let mut proj = vec![0.0f32; m * h];
        let mut gate = vec![0.0f32; m * cfg.intermediate];
        let mut up = vec![0.0f32; m * cfg.intermediate];
        // Adds a layer's output to the residual stream (after its post-norm, if any).
        let residual = |x: &mut [f32], out: &mut [f32], post: &Option<NormWeights>| {
            if let Some(w) = post {
                out.chunks_mut(h)
                    .for_each(|r| norm(r, w, cfg.norm, cfg.norm_eps));
            }
            match cfg.residual_scale {
                Some(s) => x.iter_mut().zip(&*out).for_each(|(a, b)| *a += b * s),
                None => x.iter_mut().zip(&*out).for_each(|(a, b)| *a += b),
            }
        };

        for (l, (lw, spec)) in self.weights.layers.iter().zip(&cfg.layers).enumerate() {
            xn.copy_from_slice(&x);
            if let Some(w) = &lw.attn_norm {
                xn.chunks_mut(h)
                    .for_each(|r| norm(r, w, cfg.norm, cfg.norm_eps));
            }
            linear(&xn, m, &lw.q, &mut q);
            linear(&xn, m, &lw.k, &mut k);
            linear(&xn, m, &lw.v, &mut v);
            if let (Some(qn), Some(kn)) = (&lw.q_norm, &lw.k_norm) {
                match cfg.qk_norm {
                    QkNorm::Whole => {
                        q.chunks_mut(q_dim)
                            .for_each(|r| cpu::rms_norm(r, qn, cfg.norm_eps));
                        k.chunks_mut(kv_dim)
                            .for_each(|r| cpu::rms_norm(r, kn, cfg.norm_eps));
                    }
                    _ => {
                        cpu::rms_norm_chunks(&mut q, qn, cfg.norm_eps);
                        cpu::rms_norm_chunks(&mut k, kn, cfg.norm_eps);
                    }
                }
            }
            if let Some(rope) = &spec.rope {
                // Dynamic NTK depends on the row's own length (padding excluded).
                let inv: Vec<Vec<f32>> = if rope.is_dynamic() {
                    cache
                        .pad
                        .iter()
                        .map(|p| rope.inv_freq(start + n - p))
                        .collect()
                } else {
                    vec![rope.inv_freq(start + n)]
                };
                let half = rope.dims / 2;
                let (mut cos, mut sin) = (vec![0.0f32; half], vec![0.0f32; half]);
                for i in 0..m {
                    let (b, t) = (i / n, i % n);
                    let inv_freq = &inv[b.min(inv.len() - 1)];
                    // Positions count from the row's first real token.
                    let pos = (start + t) as i64 - cache.pad[b] as i64;
                    rope.cos_sin(pos, inv_freq, &mut cos, &mut sin);
                    for head in q[i * q_dim..(i + 1) * q_dim].chunks_mut(hd) {
                        rope.rotate(head, &cos, &sin);
                    }
                    for head in k[i * kv_dim..(i + 1) * kv_dim].chunks_mut(hd) {
                        rope.rotate(head, &cos, &sin);
                    }
                }
            }
            for b in 0..rows {
                cache.k[l][b].extend_from_slice(&k[b * n * kv_dim..(b + 1) * n * kv_dim]);
                cache.v[l][b].extend_from_slice(&v[b * n * kv_dim..(b + 1) * n * kv_dim]);
            }
            for b in 0..rows {
                self.attention(
                    &q[b * n * q_dim..(b + 1) * n * q_dim],
                    &cache.k[l][b],
                    &cache.v[l][b],
                    start,
                    cache.pad[b],
                    spec.sliding_window,
                    &mut attn[b * n * q_dim..(b + 1) * n * q_dim],
                );
            }
            linear(&attn, m, &lw.o, &mut proj);
            residual(&mut x, &mut proj, &lw.post_attn_norm);

            xn.copy_from_slice(&x);
            if let Some(w) = &lw.ffn_norm {
                xn.chunks_mut(h)
                    .for_each(|r| norm(r, w, cfg.norm, cfg.norm_eps));
            }
            linear(&xn, m, &lw.up, &mut up);
            match (cfg.mlp, &lw.gate) {
                (Mlp::Gated, Some(g)) => {
                    linear(&xn, m, g, &mut gate);
                    cpu::gated_activation(cfg.activation, &mut gate, &up);
                }
                _ => cpu::activation(cfg.activation, &up, &mut gate),
            }
            linear(&gate, m, &lw.down, &mut proj);
            residual(&mut x, &mut proj, &lw.post_ffn_norm);
        }
        cache.len += n;

        let rows_out: Vec<f32> = match want {
            Logits::Last => (0..rows)
                .flat_map(|b| x[((b + 1) * n - 1) * h..(b + 1) * n * h].iter().copied())
                .collect(),
            Logits::All => x,
        };
        let mut rows_out = rows_out;
        rows_out
            .chunks_mut(h)
            .for_each(|r| norm(r, &self.weights.final_norm, cfg.norm, cfg.norm_eps));
        let mo = rows_out.len() / h;
        let mut logits = vec![0.0f32; mo * cfg.vocab];
        cpu::linear(&rows_out, mo, &self.weights.lm_head, &mut logits);
        if let Some(cap) = cfg.final_softcap {
            logits.iter_mut().for_each(|v| *v = cpu::softcap(*v, cap));
        }
        if let Some(d) = cfg.logits_divisor {
            logits.iter_mut().for_each(|v| *v /= d);
        }
        logits
    }

    /// Causal attention of one row's new queries (positions `start..start+n`) over its cache;
    /// keys before `pad` are padding and never attended to.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        start: usize,
        pad: usize,
        window: Option<usize>,
        out: &mut [f32],
    ) {
        let cfg = &self.cfg;
        let hd = cfg.head_dim;
        let group = cfg.n_heads / cfg.n_kv_heads;
        let kv_dim = cfg.n_kv_heads * hd;
        if out.len() / (cfg.n_heads * hd) >= ATTN_GEMM_MIN_QUERIES {
            return self.attention_gemm(q, keys, values, start, pad, window, out);
        }
        out.par_chunks_mut(hd)
            .enumerate()
            .for_each_init(Vec::new, |scores, (i, o)| {
                let (t, head) = (i / cfg.n_heads, i % cfg.n_heads);
                let pos = start + t;
                let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w)).max(pad);
                o.fill(0.0);
                if lo > pos {
                    // A padding query: nothing to attend to, and nobody reads its output.
                    return;
                }
                let kvh = head / group;
                let qh: Vec<f32> = q[i * hd..(i + 1) * hd]
                    .iter()
                    .map(|v| v * cfg.attn_scale)
                    .collect();
                scores.clear();
                scores.extend(
                    (lo..=pos).map(|j| cpu::dot(&qh, &keys[j * kv_dim + kvh * hd..][..hd])),
                );
                if let Some(cap) = cfg.attn_softcap {
                    scores.iter_mut().for_each(|s| *s = cpu::softcap(*s, cap));
                }
                cpu::softmax(scores);
                for (j, &p) in (lo..=pos).zip(scores.iter()) {
                    cpu::axpy(p, &values[j * kv_dim + kvh * hd..][..hd], o);
                }
            });
    }

    /// Prefill attention as two matrix products per head and tile of queries (scores = Q·Kᵀ,
    /// out = softmax(scores)·V) by the `gemm` crate, reading Q, K and V in place through strides.
    #[allow(clippy::too_many_arguments)]
    fn attention_gemm(
        &self,
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        start: usize,
        pad: usize,
        window: Option<usize>,
        out: &mut [f32],
    ) {
        let cfg = &self.cfg;
        let hd = cfg.head_dim;
        let group = cfg.n_heads / cfg.n_kv_heads;
        let kv_dim = cfg.n_kv_heads * hd;
        let q_dim = cfg.n_heads * hd;
        let n = out.len() / q_dim;
        let tiles = n.div_ceil(ATTN_QUERY_TILE);
        let lo_of = |pos: usize| window.map_or(0, |w| (pos + 1).saturating_sub(w)).max(pad);
        let results: Vec<(usize, usize, Vec<f32>)> = (0..cfg.n_heads * tiles)
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
                if nj == 0 {
                    // Every query of the tile is padding.
                    return (head, t0, vec![0.0f32; nt * hd]);
                }
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
                        cfg.attn_scale,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
                for (t, row) in scores.chunks_mut(nj).enumerate() {
                    let pos = start + t0 + t;
                    let (lo, hi) = (lo_of(pos), pos + 1);
                    if lo >= hi {
                        // A padding query: nothing to attend to, and nobody reads its output.
                        row.fill(0.0);
                        continue;
                    }
                    let live = &mut row[lo - j0..hi - j0];
                    if let Some(cap) = cfg.attn_softcap {
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
}
