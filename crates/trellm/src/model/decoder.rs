//! The universal decoder: one forward pass for every supported family, driven by `ModelConfig`.

use rayon::prelude::*;

use super::config::{Activation, ModelConfig};
use super::weights::Weights;
use crate::backend::cpu;

/// Keys and values of every layer, position-major: `[pos][kv_head][head_dim]`.
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
}

impl KvCache {
    pub fn new(cfg: &ModelConfig) -> Self {
        KvCache {
            k: vec![Vec::new(); cfg.n_layers()],
            v: vec![Vec::new(); cfg.n_layers()],
            len: 0,
        }
    }
    /// Positions stored.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Bytes held.
    pub fn n_bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|b| b.capacity() * 4).sum()
    }
}

/// Which positions of a forward pass need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    Last,
    All,
}

pub struct Decoder {
    pub cfg: ModelConfig,
    pub weights: Weights,
    /// Per layer: the RoPE inverse frequencies, one per rotated pair.
    inv_freq: Vec<Vec<f32>>,
}

/// `base^(-2i/dims)` evaluated as `2^(-(i / (dims/2)) * log2(base))` in f32, as mlx's rope
/// kernels do.
fn rope_inv_freq(dims: usize, base: f32) -> Vec<f32> {
    let half = dims / 2;
    let log2_base = base.log2();
    (0..half)
        .map(|i| (-(i as f32 / half as f32) * log2_base).exp2())
        .collect()
}

impl Decoder {
    pub fn new(cfg: ModelConfig, weights: Weights) -> Self {
        let inv_freq = cfg
            .layers
            .iter()
            .map(|l| rope_inv_freq(l.rope.dims, l.rope.base))
            .collect();
        Decoder {
            cfg,
            weights,
            inv_freq,
        }
    }

    /// Runs `tokens` at positions `cache.len()..`, appends their keys and values to the cache, and
    /// returns logits (`vocab` values per requested position).
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache, want: Logits) -> Vec<f32> {
        let cfg = &self.cfg;
        let (n, h, hd) = (tokens.len(), cfg.hidden, cfg.head_dim);
        let start = cache.len;
        let q_dim = cfg.n_heads * hd;
        let kv_dim = cfg.n_kv_heads * hd;

        let mut x = vec![0.0f32; n * h];
        for (t, &id) in tokens.iter().enumerate() {
            let row = &mut x[t * h..(t + 1) * h];
            self.weights.embed.dequantize_row(id as usize, row);
            if let Some(s) = cfg.embed_scale {
                row.iter_mut().for_each(|v| *v *= s);
            }
        }

        let mut xn = vec![0.0f32; n * h];
        let mut q = vec![0.0f32; n * q_dim];
        let mut k = vec![0.0f32; n * kv_dim];
        let mut v = vec![0.0f32; n * kv_dim];
        let mut attn = vec![0.0f32; n * q_dim];
        let mut proj = vec![0.0f32; n * h];
        let mut gate = vec![0.0f32; n * cfg.intermediate];
        let mut up = vec![0.0f32; n * cfg.intermediate];

        for (l, (lw, spec)) in self.weights.layers.iter().zip(&cfg.layers).enumerate() {
            xn.copy_from_slice(&x);
            xn.chunks_mut(h)
                .for_each(|r| cpu::rms_norm(r, &lw.attn_norm, cfg.norm_eps));
            cpu::matmul(&xn, n, &lw.q, &mut q);
            cpu::matmul(&xn, n, &lw.k, &mut k);
            cpu::matmul(&xn, n, &lw.v, &mut v);
            if let (Some(qn), Some(kn)) = (&lw.q_norm, &lw.k_norm) {
                cpu::rms_norm_chunks(&mut q, qn, cfg.norm_eps);
                cpu::rms_norm_chunks(&mut k, kn, cfg.norm_eps);
            }
            let inv_freq = &self.inv_freq[l];
            for t in 0..n {
                let pos = (start + t) as f32 * spec.rope.position_scale;
                for head in q[t * q_dim..(t + 1) * q_dim].chunks_mut(hd) {
                    cpu::rope(
                        &mut head[..spec.rope.dims],
                        pos,
                        inv_freq,
                        spec.rope.interleaved,
                    );
                }
                for head in k[t * kv_dim..(t + 1) * kv_dim].chunks_mut(hd) {
                    cpu::rope(
                        &mut head[..spec.rope.dims],
                        pos,
                        inv_freq,
                        spec.rope.interleaved,
                    );
                }
            }
            cache.k[l].extend_from_slice(&k);
            cache.v[l].extend_from_slice(&v);
            self.attention(
                &q,
                &cache.k[l],
                &cache.v[l],
                start,
                spec.sliding_window,
                &mut attn,
            );

            cpu::matmul(&attn, n, &lw.o, &mut proj);
            if let Some(w) = &lw.post_attn_norm {
                proj.chunks_mut(h)
                    .for_each(|r| cpu::rms_norm(r, w, cfg.norm_eps));
            }
            x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);

            xn.copy_from_slice(&x);
            xn.chunks_mut(h)
                .for_each(|r| cpu::rms_norm(r, &lw.ffn_norm, cfg.norm_eps));
            cpu::matmul(&xn, n, &lw.gate, &mut gate);
            cpu::matmul(&xn, n, &lw.up, &mut up);
            let act = match cfg.activation {
                Activation::Silu => cpu::silu,
                Activation::GeluTanh => cpu::gelu_tanh,
            };
            gate.iter_mut().zip(&up).for_each(|(g, u)| *g = act(*g) * u);
            cpu::matmul(&gate, n, &lw.down, &mut proj);
            if let Some(w) = &lw.post_ffn_norm {
                proj.chunks_mut(h)
                    .for_each(|r| cpu::rms_norm(r, w, cfg.norm_eps));
            }
            x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);
        }
        cache.len += n;

        let rows: &mut [f32] = match want {
            Logits::Last => &mut x[(n - 1) * h..],
            Logits::All => &mut x,
        };
        rows.chunks_mut(h)
            .for_each(|r| cpu::rms_norm(r, &self.weights.final_norm, cfg.norm_eps));
        let m = rows.len() / h;
        let mut logits = vec![0.0f32; m * cfg.vocab];
        cpu::matmul(rows, m, &self.weights.lm_head, &mut logits);
        logits
    }

    /// Causal attention of the new queries (positions `start..start+n`) over the cache.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        start: usize,
        window: Option<usize>,
        out: &mut [f32],
    ) {
        let cfg = &self.cfg;
        let hd = cfg.head_dim;
        let group = cfg.n_heads / cfg.n_kv_heads;
        let kv_dim = cfg.n_kv_heads * hd;
        out.par_chunks_mut(hd)
            .enumerate()
            .for_each_init(Vec::new, |scores, (i, o)| {
                let (t, head) = (i / cfg.n_heads, i % cfg.n_heads);
                let pos = start + t;
                let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                let kvh = head / group;
                let qh: Vec<f32> = q[i * hd..(i + 1) * hd]
                    .iter()
                    .map(|v| v * cfg.attn_scale)
                    .collect();
                scores.clear();
                scores.extend(
                    (lo..=pos).map(|j| cpu::dot(&qh, &keys[j * kv_dim + kvh * hd..][..hd])),
                );
                cpu::softmax(scores);
                o.fill(0.0);
                for (j, &p) in (lo..=pos).zip(scores.iter()) {
                    let vj = &values[j * kv_dim + kvh * hd..][..hd];
                    o.iter_mut().zip(vj).for_each(|(a, b)| *a += p * b);
                }
            });
    }
}
